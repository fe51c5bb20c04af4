// Re-partitioning a data-parallel run's optimizer state for another number of ranks
// (engine/partition.h). Rank j of L wrote, per parameter group, its engine's state
// (ZenFlowEngine::Checkpoint) and its daemon session's checkpoint file (the bytes of
// <state_dir>/<uid>/<tag>.sfckpt), both of its own row blocks. Rank s of M takes the states of
// the old ranks whose blocks overlap its own and gets the engine state and the daemon checkpoint
// of its own blocks, which a fresh engine over those blocks restores as if it had written them.
// Nothing else changes: step counts, hot sets, the pending round and its accumulated gradient
// are the same on every rank of a partitioned run, and every per-element array (fp32 masters,
// moments, accumulators) is cut and joined by whole rows. So a run saved with L ranks and
// resumed with M continues as the uninterrupted run with L would, up to the summation order of
// the column scores and of the data-parallel gradient average. `layout` says who cut the rows
// (engine/partition.h): this partition, or FSDP2's fully_shard (states saved on one FSDP2 mesh
// resumed on another).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/partition.h"

namespace stallfree {

struct PartitionedState {
  std::string engine;  // ZenFlowEngine::Checkpoint's bytes
  std::string daemon;  // the daemon checkpoint's file bytes; empty: none (nothing offloaded yet)
};

// A parameter of the group, whole, in the engine's order.
struct WholeParam {
  std::string name;
  std::vector<int64_t> shape;  // empty: a scalar
};

// The old ranks (of old_world) whose states rank new_rank of new_world needs, increasing.
std::vector<int> SourceRanks(const std::vector<WholeParam>& params, int old_world, int new_world,
                             int new_rank, RowLayout layout = RowLayout::kEven);

// Rank new_rank of new_world's state from the old ranks' (old.size() = the old world size;
// old[j] may be null unless j is in SourceRanks). InvalidArgument / DataLoss when a state is
// not an engine's or a daemon's checkpoint of these parameters, or the ranks' states disagree
// (saved at different steps, or by another run). In memory: no file is written.
absl::StatusOr<PartitionedState> Repartition(const std::vector<WholeParam>& params,
                                             const std::vector<const PartitionedState*>& old,
                                             int new_world, int new_rank,
                                             RowLayout layout = RowLayout::kEven);

}  // namespace stallfree
