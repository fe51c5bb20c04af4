// The element types of parameters and gradients, and of what crosses between a trainer and
// stallfreed: fp32, and bf16 (uint16 storage, round to nearest even; common/bf16.h). The
// engine, the trainer and the Python binding speak this type; the RPC client maps it onto
// offload.proto's DType at the wire (client/session_target.h).
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace stallfree {

enum class DType { kFp32, kBf16 };

// "fp32" / "bf16".
const char* DTypeName(DType t);
// The inverse; InvalidArgument "'<name>' is not 'bf16' or 'fp32'" otherwise.
absl::StatusOr<DType> ParseDType(const std::string& name);
// Bytes per element.
inline size_t DTypeSize(DType t) { return t == DType::kBf16 ? 2 : 4; }

}  // namespace stallfree
