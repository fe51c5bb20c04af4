#include "engine/blob.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace stallfree {

absl::StatusOr<EngineBlob> ParseEngineBlob(const std::string& bytes) {
  auto corrupt = [](const std::string& what) {
    return absl::DataLossError(absl::StrCat("engine state: ", what));
  };
  BlobReader r(bytes);
  EngineBlob s;
  int64_t n = 0;
  if (!r.I64(&s.magic) || (!BlobHasDTypes(s.magic) && s.magic != kEngineBlobMagic))
    return corrupt("not a ZenFlow engine checkpoint (bad magic)");
  const bool v3 = BlobHasDTypes(s.magic);
  if (!r.I64(&s.mode) || !r.I64(&s.step) || !r.I64(&s.rounds) || !r.I64(&s.pending_version) ||
      !r.I64(&s.loaded) || !r.I64(&n) || n < 0)
    return corrupt("truncated");
  for (int64_t i = 0; i < n; ++i) {
    EngineBlobParam p;
    if (!r.I64(&p.kind) || !r.I64(&p.numel) || !r.I64(&p.k) || p.numel < 0)
      return corrupt("truncated");
    if (v3 && !r.I64(&p.dtype)) return corrupt("truncated");
    if (p.kind == kBlobDevice) {
      if (!r.I64(&p.dstep) || !r.Floats(&p.m, p.numel) || !r.Floats(&p.v, p.numel))
        return corrupt("truncated");
      if (v3 && (!r.AnyFloats(&p.master) ||
                 (!p.master.empty() && static_cast<int64_t>(p.master.size()) != p.numel)))
        return corrupt(absl::StrCat("parameter ", i, ": a device master of the wrong size"));
    } else if (!r.I64(&p.round_grads)) {
      return corrupt("truncated");
    }
    if (p.kind == kBlobSplit) {
      if (!r.AnyInts(&p.hot_idx) || !r.AnyInts(&p.cold_idx) || !r.AnyInts(&p.hot_steps) ||
          !r.AnyFloats(&p.hot_master) || !r.AnyFloats(&p.hot_m) || !r.AnyFloats(&p.hot_v))
        return corrupt("truncated");
      if (s.magic == kEngineBlobMagicV4 && !r.AnyFloats(&p.pending_shown))
        return corrupt("truncated");
    } else if (p.kind != kBlobDevice && p.kind != kBlobOffloaded) {
      return corrupt(absl::StrCat("parameter kind ", p.kind));
    }
    s.params.push_back(std::move(p));
  }
  if (s.magic == kEngineBlobMagicV4 && (!r.I64(&s.round_adaptive) || !r.I64(&s.round_base) ||
                                        !r.I64(&s.round_interval) || !r.I64(&s.round_floor)))
    return corrupt("truncated");
  if (s.magic == kEngineBlobMagicV4 &&
      (s.round_base < 0 || s.round_interval < 1 || s.round_floor < 1))
    return corrupt("the automatic round's state");
  if (!r.done()) return corrupt("trailing bytes");
  return s;
}

}  // namespace stallfree
