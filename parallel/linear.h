// What every parallel block uses: the linear-layer GEMMs (W is [out, in], as F.linear), the
// relayout between a collective's rank-major and the kernels' batch-major token order, and the
// status check after a backend's queued work. Header-only, shared by the TSP, TP+SP and TP x CP
// blocks and the distributed model.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/ops.h"

namespace stallfree {
namespace parallel {
namespace layer {

// y[rows, out] = x[rows, in] W^T (+ beta * y) for W [out, in]; ldx, ldy row strides.
inline void Linear(const kernels::TransformerOps& ops, const float* x, int64_t ldx,
                   const float* w, int64_t rows, int64_t out, int64_t in, float* y, int64_t ldy,
                   float beta = 0.0f) {
  ops.Gemm(kernels::Trans::kNo, kernels::Trans::kYes, rows, out, in, 1.0f, x, ldx, w, in, beta,
           y, ldy);
}

// dW[out, in] += dy^T x for dy [rows, out] (row stride lddy) and x [rows, in].
inline void LinearWeightGrad(const kernels::TransformerOps& ops, const float* dy, int64_t lddy,
                             const float* x, int64_t rows, int64_t out, int64_t in, float* dw) {
  ops.Gemm(kernels::Trans::kYes, kernels::Trans::kNo, out, in, rows, 1.0f, dy, lddy, x, in, 1.0f,
           dw, in);
}

// dx[rows, in] = dy W (+ beta * dx) for dy [rows, out] (row stride lddy), W [out, in].
inline void LinearInputGrad(const kernels::TransformerOps& ops, const float* dy, int64_t lddy,
                            const float* w, int64_t rows, int64_t out, int64_t in, float* dx,
                            float beta = 0.0f) {
  ops.Gemm(kernels::Trans::kNo, kernels::Trans::kNo, rows, in, out, 1.0f, dy, lddy, w, in, beta,
           dx, in);
}

// [groups, B, rows, width] (rank-major, as an all-gather leaves it and a reduce-scatter takes
// it) <-> [B, groups * rows, width] (batch-major, as the kernels read it): one strided copy per
// group.
inline void RankMajorToBatchMajor(const kernels::TransformerOps& ops, const float* src,
                                  int64_t groups, int64_t B, int64_t rows, int64_t width,
                                  float* dst) {
  const int64_t chunk = rows * width;
  for (int64_t g = 0; g < groups; ++g) {
    ops.Copy2D(dst + g * chunk, groups * chunk, src + g * B * chunk, chunk, B, chunk);
  }
}
inline void BatchMajorToRankMajor(const kernels::TransformerOps& ops, const float* src,
                                  int64_t groups, int64_t B, int64_t rows, int64_t width,
                                  float* dst) {
  const int64_t chunk = rows * width;
  for (int64_t g = 0; g < groups; ++g) {
    ops.Copy2D(dst + g * B * chunk, chunk, src + g * chunk, groups * chunk, B, chunk);
  }
}

// Waits for the backend's queued work; its error becomes INTERNAL naming the scheme and step.
inline absl::Status Sync(const kernels::TransformerOps& ops, const char* scheme,
                         const char* what) {
  const std::string err = ops.Synchronize();
  if (!err.empty()) return absl::InternalError(absl::StrCat(scheme, ": ", what, ": ", err));
  return absl::OkStatus();
}

}  // namespace layer
}  // namespace parallel
}  // namespace stallfree
