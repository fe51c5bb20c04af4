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

// A share's state as its per-row arrays and the rest (SplitRows), and back (JoinRows): what
// torch.distributed.checkpoint saves of an FSDP2 run's state, each per-row array as a tensor of
// the whole parameter's rows (a DTensor cut like the parameter), the rest once, so that any
// number of ranks loads it by reading their own rows.
//
// One per-row array: `width` values for each row of the share. Which arrays a state has, and
// their widths, follow from the parameters' kinds, hot counts and dtypes and the engine state's
// version alone (an array the state does not hold yet, such as a bf16 master before the first
// step, is zeros, with a flag), so a fresh optimizer's arrays are those of any state it loads.
struct RowField {
  enum Name {
    kM, kV, kMaster,                 // a parameter wholly on the device: [rows, cols]
    kHotMaster, kHotM, kHotV,        // a split one's hot columns: [rows, k]
    kShown,                          // its pending round's cold columns as shown (V4): [rows, cols - k]
    kDaemonMaster, kDaemonM, kDaemonV, kDaemonAcc,  // the daemon's: [rows, offloaded columns]
    kDaemonSteps,                    // a 1-D offloaded parameter's step counts: [rows, 1], int64
    kFlags,                          // [rows, 1] int64: 1 the bf16 master exists, 2 kShown does
  };
  int param = 0;  // the group's parameter
  Name name = kM;
  int64_t width = 0;
  std::vector<float> f32;    // rows * width values, the float arrays'
  std::vector<int64_t> i64;  // kDaemonSteps', kFlags'
  bool is_int() const { return name == kDaemonSteps || name == kFlags; }
  static const char* NameOf(Name name);  // "m", "v", "master", "hot_master", ...
};

struct SplitState {
  PartitionedState rest;  // the state of no rows: the scalars, column sets and step counts
  std::vector<RowField> fields;
};

// Rank `rank` of `world`'s state `share` as its per-row arrays and the rest. DataLoss when it
// is not a state of these parameters' shares.
absl::StatusOr<SplitState> SplitRows(const std::vector<WholeParam>& params,
                                     const PartitionedState& share, int world, int rank,
                                     RowLayout layout = RowLayout::kEven);

// Rank `rank` of `world`'s state from the rest of any rank's SplitRows (of any world) and the
// per-row arrays of its own rows: those SplitRows would give it, which it restores as if it had
// written them. InvalidArgument when a field is missing, repeated, unknown or of the wrong
// size; DataLoss when `rest` is not SplitRows' rest of these parameters.
// `fields` are taken (moved into the state written), not copied.
absl::StatusOr<PartitionedState> JoinRows(const std::vector<WholeParam>& params,
                                          const PartitionedState& rest,
                                          std::vector<RowField> fields, int world, int rank,
                                          RowLayout layout = RowLayout::kEven);

}  // namespace stallfree
