#include "trainer/world.h"

#include "common/status.h"

namespace stallfree {
namespace trainer {

absl::StatusOr<double> AllReduceSum(parallel::Communicator* comm, double x) {
  float parts[2] = {static_cast<float>(x), static_cast<float>(x - static_cast<float>(x))};
  RETURN_IF_ERROR(comm->AllReduce(parts, 2));
  return static_cast<double>(parts[0]) + static_cast<double>(parts[1]);
}

absl::StatusOr<double> World::Sum(double x) const {
  ASSIGN_OR_RETURN(double sum, AllReduceSum(tsp, x));
  if (dp == nullptr) return sum;
  return AllReduceSum(dp, sum);
}

absl::Status World::Barrier() const {
  RETURN_IF_ERROR(tsp->Barrier());
  return dp == nullptr ? absl::OkStatus() : dp->Barrier();
}

}  // namespace trainer
}  // namespace stallfree
