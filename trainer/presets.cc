#include "trainer/presets.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace stallfree {
namespace trainer {

const std::vector<Preset>& Presets() {
  static const std::vector<Preset> presets = {
      {"tiny", 2, 64, 4, 128, 32, 4, "tests: ~0.1M parameters, a few ms per step"},
      {"demo", 12, 384, 6, 1024, 128, 4, "make demo: ~21M parameters (byte vocabulary)"},
      {"gpt2-small", 12, 768, 12, 2048, 1024, 8, "GPT-2 small's shape (~85M with bytes), GPUs"},
      {"1b", 20, 2048, 16, 5632, 2048, 8, "~1.0B parameters, GPUs"},
  };
  return presets;
}

absl::StatusOr<Preset> FindPreset(const std::string& name) {
  std::string known;
  for (const Preset& p : Presets()) {
    if (p.name == name) return p;
    known += (known.empty() ? "" : ", ") + p.name;
  }
  return absl::InvalidArgumentError(absl::StrCat("preset: '", name, "' is not one of ", known));
}

}  // namespace trainer
}  // namespace stallfree
