#include "engine/blob.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace stallfree {
namespace {

absl::Status Corrupt(const std::string& field, const std::string& what) {
  return absl::DataLossError(absl::StrCat("engine state: ", field, ": ", what));
}

// The fewest bytes a parameter takes in a blob: its kind, numel and k.
constexpr size_t kMinParamBytes = 3 * 8;

}  // namespace

absl::Status BlobReader::I64(const std::string& field, int64_t* x) {
  if (remaining() < 8)
    return Corrupt(field, absl::StrCat("truncated (8 bytes needed, ", remaining(), " remain)"));
  memcpy(x, s_.data() + pos_, 8);
  pos_ += 8;
  return absl::OkStatus();
}

absl::Status BlobReader::CheckCount(const std::string& field, int64_t n, size_t elem,
                                    const int64_t* expect) const {
  if (n < 0) return Corrupt(field, absl::StrCat("a count of ", n, " elements"));
  if (expect != nullptr && n != *expect)
    return Corrupt(field, absl::StrCat(n, " elements, the parameter has ", *expect));
  // n * elem <= remaining(), without forming the product.
  if (static_cast<uint64_t>(n) > remaining() / elem)
    return Corrupt(field, absl::StrCat("truncated (", n, " elements of ", elem,
                                       " bytes, ", remaining(), " bytes remain)"));
  return absl::OkStatus();
}

absl::StatusOr<EngineBlob> ParseEngineBlob(const std::string& bytes) {
  BlobReader r(bytes);
  EngineBlob s;
  int64_t n = 0;
  if (!r.I64("magic", &s.magic).ok() || (!BlobHasDTypes(s.magic) && s.magic != kEngineBlobMagic))
    return absl::DataLossError("engine state: not a ZenFlow engine checkpoint (bad magic)");
  const bool v3 = BlobHasDTypes(s.magic);
  RETURN_IF_ERROR(r.I64("mode", &s.mode));
  RETURN_IF_ERROR(r.I64("step", &s.step));
  RETURN_IF_ERROR(r.I64("rounds", &s.rounds));
  RETURN_IF_ERROR(r.I64("pending_version", &s.pending_version));
  RETURN_IF_ERROR(r.I64("loaded", &s.loaded));
  RETURN_IF_ERROR(r.I64("parameter count", &n));
  if (s.step < 0 || s.rounds < 0 || s.pending_version < 0)
    return Corrupt("step", absl::StrCat("negative counts (step ", s.step, ", rounds ", s.rounds,
                                        ", pending_version ", s.pending_version, ")"));
  if (s.loaded != 0 && s.loaded != 1)
    return Corrupt("loaded", absl::StrCat(s.loaded, ", not 0 or 1"));
  if (n < 0 || static_cast<uint64_t>(n) > r.remaining() / kMinParamBytes)
    return Corrupt("parameter count", absl::StrCat(n, " parameters cannot be in the ",
                                                   r.remaining(), " bytes that remain"));
  s.params.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    EngineBlobParam p;
    const std::string at = absl::StrCat("parameter ", i, "'s ");
    RETURN_IF_ERROR(r.I64(at + "kind", &p.kind));
    RETURN_IF_ERROR(r.I64(at + "numel", &p.numel));
    RETURN_IF_ERROR(r.I64(at + "k", &p.k));
    if (p.numel < 0) return Corrupt(at + "numel", absl::StrCat(p.numel));
    if (p.k < 0) return Corrupt(at + "k", absl::StrCat(p.k));
    if (v3) RETURN_IF_ERROR(r.I64(at + "dtype", &p.dtype));
    if (p.kind == kBlobDevice) {
      RETURN_IF_ERROR(r.I64(at + "dstep", &p.dstep));
      RETURN_IF_ERROR(r.Floats(at + "m", &p.m, p.numel));
      RETURN_IF_ERROR(r.Floats(at + "v", &p.v, p.numel));
      if (v3) {
        RETURN_IF_ERROR(r.AnyFloats(at + "master", &p.master));
        if (!p.master.empty() && static_cast<int64_t>(p.master.size()) != p.numel)
          return Corrupt(at + "master", absl::StrCat("a device master of ", p.master.size(),
                                                     " elements, the parameter has ", p.numel));
      }
    } else if (p.kind == kBlobSplit || p.kind == kBlobOffloaded) {
      RETURN_IF_ERROR(r.I64(at + "round_grads", &p.round_grads));
    } else {
      return Corrupt(at + "kind", absl::StrCat("parameter kind ", p.kind));
    }
    if (p.kind == kBlobSplit) {
      RETURN_IF_ERROR(r.AnyInts(at + "hot_idx", &p.hot_idx));
      RETURN_IF_ERROR(r.AnyInts(at + "cold_idx", &p.cold_idx));
      RETURN_IF_ERROR(r.AnyInts(at + "hot_steps", &p.hot_steps));
      RETURN_IF_ERROR(r.AnyFloats(at + "hot_master", &p.hot_master));
      RETURN_IF_ERROR(r.AnyFloats(at + "hot_m", &p.hot_m));
      RETURN_IF_ERROR(r.AnyFloats(at + "hot_v", &p.hot_v));
      if (s.magic == kEngineBlobMagicV4)
        RETURN_IF_ERROR(r.AnyFloats(at + "pending_shown", &p.pending_shown));
    }
    s.params.push_back(std::move(p));
  }
  if (s.magic == kEngineBlobMagicV4) {
    RETURN_IF_ERROR(r.I64("round_adaptive", &s.round_adaptive));
    RETURN_IF_ERROR(r.I64("round_base", &s.round_base));
    RETURN_IF_ERROR(r.I64("round_interval", &s.round_interval));
    RETURN_IF_ERROR(r.I64("round_floor", &s.round_floor));
    if (s.round_base < 0 || s.round_interval < 1 || s.round_floor < 1)
      return Corrupt("round", "the automatic round's state");
  }
  if (!r.done()) return Corrupt("end", absl::StrCat(r.remaining(), " trailing bytes"));
  return s;
}

}  // namespace stallfree
