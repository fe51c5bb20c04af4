#include "parallel/zigzag.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace stallfree {
namespace parallel {
namespace {

absl::Status CheckShape(int64_t B, int64_t C) {
  if (B <= 0 || C <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("zigzag: B and C must be positive, got B=", B, " C=", C));
  }
  return absl::OkStatus();
}

// Copies rank p's rows: full -> local (to_local) or local -> full. src and dst are full and
// local in the direction of the copy.
void CopyRows(int64_t B, int64_t T, int64_t C, int64_t D, int64_t p, bool to_local,
              const float* src, float* dst) {
  const int64_t chunk = T / (2 * D), tl = T / D;
  const int64_t starts[2] = {p * chunk, (2 * D - 1 - p) * chunk};
  const size_t bytes = static_cast<size_t>(chunk * C) * sizeof(float);
  for (int64_t b = 0; b < B; ++b) {
    for (int half = 0; half < 2; ++half) {
      const int64_t f = (b * T + starts[half]) * C, l = (b * tl + half * chunk) * C;
      if (to_local) {
        std::memcpy(dst + l, src + f, bytes);
      } else {
        std::memcpy(dst + f, src + l, bytes);
      }
    }
  }
}

}  // namespace

absl::Status CheckZigzag(int64_t T, int64_t D, int64_t p) {
  if (D < 1) return absl::InvalidArgumentError(absl::StrCat("zigzag: D must be >= 1, got ", D));
  if (p < 0 || p >= D) {
    return absl::InvalidArgumentError(absl::StrCat("zigzag: rank ", p, " not in [0, ", D, ")"));
  }
  if (T <= 0 || T % (2 * D) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("zigzag: T=", T, " is not a positive multiple of 2D=", 2 * D));
  }
  if (T > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("zigzag: T=", T, " does not fit int32"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> ZigzagPositions(int64_t T, int64_t D, int64_t p) {
  RETURN_IF_ERROR(CheckZigzag(T, D, p));
  const int64_t chunk = T / (2 * D);
  std::vector<int32_t> pos;
  pos.reserve(static_cast<size_t>(2 * chunk));
  for (int64_t start : {p * chunk, (2 * D - 1 - p) * chunk}) {
    for (int64_t i = 0; i < chunk; ++i) pos.push_back(static_cast<int32_t>(start + i));
  }
  return pos;
}

absl::StatusOr<std::vector<int32_t>> ZigzagOrder(int64_t T, int64_t D) {
  RETURN_IF_ERROR(CheckZigzag(T, D, 0));
  std::vector<int32_t> order;
  for (int64_t p = 0; p < D; ++p) {
    ASSIGN_OR_RETURN(const std::vector<int32_t> pos, ZigzagPositions(T, D, p));
    order.insert(order.end(), pos.begin(), pos.end());
  }
  return order;
}

absl::Status ZigzagScatter(const float* full, int64_t B, int64_t T, int64_t C, int64_t D, int64_t p,
                           float* local) {
  RETURN_IF_ERROR(CheckZigzag(T, D, p));
  RETURN_IF_ERROR(CheckShape(B, C));
  CopyRows(B, T, C, D, p, /*to_local=*/true, full, local);
  return absl::OkStatus();
}

absl::Status ZigzagGatherRank(const float* local, int64_t B, int64_t T, int64_t C, int64_t D,
                              int64_t p, float* full) {
  RETURN_IF_ERROR(CheckZigzag(T, D, p));
  RETURN_IF_ERROR(CheckShape(B, C));
  CopyRows(B, T, C, D, p, /*to_local=*/false, local, full);
  return absl::OkStatus();
}

absl::Status ZigzagGather(absl::Span<const float* const> locals, int64_t B, int64_t T, int64_t C,
                          float* full) {
  const int64_t D = static_cast<int64_t>(locals.size());
  RETURN_IF_ERROR(CheckZigzag(T, D, 0));
  RETURN_IF_ERROR(CheckShape(B, C));
  for (int64_t p = 0; p < D; ++p) {
    if (locals[p] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("zigzag: shard of rank ", p, " is null"));
    }
  }
  for (int64_t p = 0; p < D; ++p) {
    CopyRows(B, T, C, D, p, /*to_local=*/false, locals[p], full);
  }
  return absl::OkStatus();
}

}  // namespace parallel
}  // namespace stallfree
