#include "common/dtype.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace stallfree {

const char* DTypeName(DType t) { return t == DType::kBf16 ? "bf16" : "fp32"; }

absl::StatusOr<DType> ParseDType(const std::string& name) {
  if (name == "fp32") return DType::kFp32;
  if (name == "bf16") return DType::kBf16;
  return absl::InvalidArgumentError(absl::StrCat("'", name, "' is not 'bf16' or 'fp32'"));
}

}  // namespace stallfree
