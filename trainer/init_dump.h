// --dump_init (TrainOptions::dump_init, trainer/gpt.h has the format): a run's starting point,
// its weights, the batches of every step and of an evaluation, and its configuration as
// manifest.json, for a re-implementation to follow step by step.
//
// Internal to the trainer. Single rank.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "parallel/reference_block.h"
#include "trainer/data.h"
#include "trainer/device.h"
#include "trainer/gpt.h"
#include "trainer/shard.h"

namespace stallfree {
namespace trainer {

// The batches a run trains and evaluates on, [steps, B, T] and [eval batches, B, T] each.
struct DumpedBatches {
  std::vector<int32_t> tokens, targets, eval_tokens, eval_targets;
};

// Writes the dump directory o.dump_init (created if missing): manifest.json, one <name>.f32 per
// tensor (downloaded from the backend), the batches. `lrs`: the rate of steps 1..steps;
// `eval_steps`: the evaluated steps. Every file is written atomically.
absl::Status WriteInitDump(const TrainOptions& o, const parallel::ModelConfig& cfg, int64_t B,
                           int64_t T, const Corpus& corpus, const std::vector<Tensor>& tensors,
                           const RankDevice& dev, const DumpedBatches& batches,
                           const std::vector<double>& lrs, const std::vector<int64_t>& eval_steps);

}  // namespace trainer
}  // namespace stallfree
