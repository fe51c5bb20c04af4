// The ranks of a trainer run: this rank's TSP group and, with --dp N > 1, its data-parallel
// group. Global rank = replica * D + TSP rank. A sum over the world is a sum over the TSP group,
// then over the data-parallel group (likewise a barrier).
//
// Internal to the trainer. Collective calls: every rank of the groups must make them in the
// same order.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "parallel/communicator.h"

namespace stallfree {
namespace trainer {

// Sum over the group's ranks of one double (through the float communicator in two halves, so the
// sum keeps double precision for values of similar magnitude).
absl::StatusOr<double> AllReduceSum(parallel::Communicator* comm, double x);

struct World {
  parallel::Communicator* tsp = nullptr;
  parallel::Communicator* dp = nullptr;  // null with one replica

  int D() const { return tsp->size(); }
  int N() const { return dp == nullptr ? 1 : dp->size(); }
  int replica() const { return dp == nullptr ? 0 : dp->rank(); }
  int rank() const { return replica() * D() + tsp->rank(); }
  absl::StatusOr<double> Sum(double x) const;
  absl::Status Barrier() const;
};

}  // namespace trainer
}  // namespace stallfree
