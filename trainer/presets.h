// The trainer's model presets (--preset): named shapes whose fields the shape flags override one
// by one (trainer/gpt.h, TrainOptions; ModelFromOptions applies them).
//
//   ASSIGN_OR_RETURN(Preset p, FindPreset("tiny"));  // 2 layers, d_model 64, ...
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace stallfree {
namespace trainer {

struct Preset {
  std::string name;
  int64_t layers, d_model, heads, d_ff, seq_len, batch;
  std::string note;
};
// tiny (tests), demo (~20M parameters, make demo), gpt2-small (124M), 1b (GPU shapes).
const std::vector<Preset>& Presets();
// InvalidArgument naming the known presets if `name` is none of them.
absl::StatusOr<Preset> FindPreset(const std::string& name);

}  // namespace trainer
}  // namespace stallfree
