// Reading a checkpoint for --resume (TrainOptions::resume), written with the same --dp or
// another.
//
// Internal to the trainer. ReadResume is per rank (it reads only this rank's sources); the
// caller agrees on the outcome across the ranks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "trainer/checkpoint.h"
#include "trainer/gpt.h"
#include "trainer/shard.h"

namespace stallfree {
namespace trainer {

// What a rank restores: the step, the data position and the whole tensors (every file of the
// checkpoint holds them), its engine's state, and the daemon checkpoint tag Restore reads, or,
// re-partitioned, the daemon state's bytes (RestoreBytes: no file).
struct ResumeState {
  RankState st;
  std::string daemon_tag;
  bool repartitioned = false;  // the daemon's part is `daemon` (empty: it holds none)
  std::string daemon;
  int64_t written_dp = 1;
  std::vector<std::string> missing;  // daemon checkpoints of the sources that were not found
};

// Reads the checkpoint o.resume for this rank (global rank `rank`, TSP rank key[0] of D, replica
// `replica` of N; `key`: this run's shape key, trainer/checkpoint.h). Written with the same --dp:
// the rank's own trainer file and daemon tag. Written with another (N' replicas of the same D):
// the old replicas j at this TSP position (global ranks j D + p) whose row blocks overlap this
// replica's (SourceRanks), each one's engine state from its trainer file and its daemon
// checkpoint's bytes through the session, cut and joined for this replica by Repartition
// (engine/repartition.h); the daemon part goes to the engine's RestoreBytes, straight into
// the session through its staging area (ImportState, as the PyTorch optimizer's load_state_dict
// does), with no file that a killed resume could leave behind. The global batch must stay the same (N' B' = N B: the data stream continues
// at the same window), and so must the TSP size, the model, its dtype and the mode
// (FailedPrecondition naming the values otherwise).
absl::StatusOr<ResumeState> ReadResume(const TrainOptions& o, const std::vector<int64_t>& key,
                                       int N, int replica, int rank,
                                       const std::vector<Tensor>& tensors, Session* session);

}  // namespace trainer
}  // namespace stallfree
