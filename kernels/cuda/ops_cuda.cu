// CUDA backend of the transformer ops. See ops_cuda.h for the contract additions (error
// reporting, determinism, workspace) and kernels/ops.h for the ops themselves.
//
// Math is fp32 throughout and uses the accurate library functions (expf, logf, sqrtf, not the
// __expf intrinsics), so results agree with the CPU backend to accumulation-order rounding.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/ops.h"

namespace stallfree {
namespace kernels {
namespace cuda {
namespace {

constexpr float kNegInf = -INFINITY;

// Grid size for a grid-stride loop over n items: enough blocks to fill the device several
// times over, never more than the work needs.
inline unsigned GridFor(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, 8192)));
}

// ---------------------------------------------------------------------------------------------
// Reductions. The xor butterfly leaves the identical (bitwise) result in every participating
// lane, because each step adds the same two operands in either order.

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over all threads of the block (blockDim.x a multiple of 32, at most 1024). `scratch` holds
// 33 floats. Call at most once per kernel (it does not re-synchronise before reusing scratch).
__device__ float BlockSum(float v, float* scratch) {
  v = WarpSum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    float w = lane < warps ? scratch[lane] : 0.0f;
    w = WarpSum(w);
    if (lane == 0) scratch[32] = w;
  }
  __syncthreads();
  return scratch[32];
}

// Online log-sum-exp state: max m and sum s of exp(x - m). Merging two states is exact up to
// rounding in either order; m = -inf means "empty" (s = 0).
struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum Merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == kNegInf) return {kNegInf, 0.0f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

__device__ MaxSum BlockMaxSum(MaxSum v, float* scratch_m, float* scratch_s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
    v = Merge(v, other);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    scratch_m[warp] = v.m;
    scratch_s[warp] = v.s;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    MaxSum w = lane < warps ? MaxSum{scratch_m[lane], scratch_s[lane]} : MaxSum{kNegInf, 0.0f};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      MaxSum other{__shfl_xor_sync(0xffffffffu, w.m, o), __shfl_xor_sync(0xffffffffu, w.s, o)};
      w = Merge(w, other);
    }
    if (lane == 0) {
      scratch_m[32] = w.m;
      scratch_s[32] = w.s;
    }
  }
  __syncthreads();
  return {scratch_m[32], scratch_s[32]};
}

// ---------------------------------------------------------------------------------------------
// Elementwise kernels.

// C = beta * C for a GEMM with k == 0 (beta == 0 writes zeros without reading C, as BLAS does).
__global__ void ScaleMatrixKernel(float* c, int64_t rows, int64_t cols, int64_t ldc, float beta) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float* p = c + (i / cols) * ldc + i % cols;
    *p = beta == 0.0f ? 0.0f : beta * *p;
  }
}

// One block per token row: out[i, :] = table[ids[i], :].
__global__ void EmbeddingForwardKernel(const float* __restrict__ table, int64_t dim,
                                       const int32_t* __restrict__ ids, float* __restrict__ out) {
  const int64_t i = blockIdx.x;
  const float* src = table + static_cast<int64_t>(ids[i]) * dim;
  float* dst = out + i * dim;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) dst[d] = src[d];
}

__global__ void IotaKernel(int32_t* v, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    v[i] = static_cast<int32_t>(i);
  }
}

// Embedding backward over ids sorted stably (sorted_ids, with their original token indices in
// `order`): one block per sorted position; the block at the start of each run of equal ids adds
// that run's rows to dtable in original token order, so the result is deterministic and matches a
// sequential CPU loop's summation order. Other blocks exit at once.
__global__ void EmbeddingBackwardKernel(const float* __restrict__ dout, int64_t dim,
                                        const int32_t* __restrict__ sorted_ids,
                                        const int32_t* __restrict__ order, int64_t n,
                                        float* __restrict__ dtable) {
  const int64_t p = blockIdx.x;
  const int32_t id = sorted_ids[p];
  if (p > 0 && sorted_ids[p - 1] == id) return;
  float* row = dtable + static_cast<int64_t>(id) * dim;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    float acc = row[d];
    for (int64_t q = p; q < n && sorted_ids[q] == id; ++q) {
      acc += dout[static_cast<int64_t>(order[q]) * dim + d];
    }
    row[d] = acc;
  }
}

constexpr int kRowThreads = 256;

// One block per row: rstd = 1 / sqrt(mean(x^2) + eps), y = x * rstd * w.
__global__ void __launch_bounds__(kRowThreads)
    RmsNormForwardKernel(const float* __restrict__ x, const float* __restrict__ w, int64_t dim,
                         float eps, float* __restrict__ y, float* __restrict__ rstd) {
  __shared__ float scratch[33];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * dim;
  float ss = 0.0f;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) ss += xr[d] * xr[d];
  ss = BlockSum(ss, scratch);
  const float rs = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  if (threadIdx.x == 0) rstd[r] = rs;
  float* yr = y + r * dim;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) yr[d] = xr[d] * rs * w[d];
}

// One block per row: with g = dy * w, dx = rstd * g - x * rstd^3 * mean(g * x).
__global__ void __launch_bounds__(kRowThreads)
    RmsNormBackwardDxKernel(const float* __restrict__ x, const float* __restrict__ w,
                            const float* __restrict__ rstd, const float* __restrict__ dy,
                            int64_t dim, float* __restrict__ dx) {
  __shared__ float scratch[33];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * dim;
  const float* dyr = dy + r * dim;
  float dot = 0.0f;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) dot += dyr[d] * w[d] * xr[d];
  dot = BlockSum(dot, scratch);
  const float rs = rstd[r];
  const float coef = rs * rs * rs * dot / static_cast<float>(dim);
  float* dxr = dx + r * dim;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    dxr[d] = rs * dyr[d] * w[d] - xr[d] * coef;
  }
}

// dw, pass 1: block (column block, row chunk) writes partial[chunk, col] = sum over the chunk's
// rows of dy * x * rstd. One thread per column, so the loads are coalesced across the warp.
__global__ void RmsNormDwPartialKernel(const float* __restrict__ x, const float* __restrict__ rstd,
                                       const float* __restrict__ dy, int64_t rows, int64_t dim,
                                       int64_t rows_per_chunk, float* __restrict__ partial) {
  const int64_t col = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (col >= dim) return;
  const int64_t r0 = blockIdx.y * rows_per_chunk;
  const int64_t r1 = min(rows, r0 + rows_per_chunk);
  float acc = 0.0f;
  for (int64_t r = r0; r < r1; ++r) acc += dy[r * dim + col] * x[r * dim + col] * rstd[r];
  partial[blockIdx.y * dim + col] = acc;
}

// dw, pass 2: dw[col] += sum over chunks (in chunk order, hence deterministic).
__global__ void RmsNormDwFinalKernel(const float* __restrict__ partial, int64_t chunks,
                                     int64_t dim, float* __restrict__ dw) {
  const int64_t col = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (col >= dim) return;
  float acc = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) acc += partial[c * dim + col];
  dw[col] += acc;
}

__device__ __forceinline__ float Sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

__global__ void SwiGluForwardKernel(const float* __restrict__ gate, const float* __restrict__ up,
                                    int64_t n, float* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = g * Sigmoid(g) * up[i];
  }
}

// d silu(g) / dg = s * (1 + g * (1 - s)) with s = sigmoid(g).
__global__ void SwiGluBackwardKernel(const float* __restrict__ gate, const float* __restrict__ up,
                                     const float* __restrict__ dout, int64_t n,
                                     float* __restrict__ dgate, float* __restrict__ dup) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i], u = up[i], d = dout[i];
    const float s = Sigmoid(g);
    dgate[i] = d * u * (s * (1.0f + g * (1.0f - s)));
    dup[i] = d * g * s;
  }
}

// One block per row: online max / sum of exp over the vocabulary, then loss and lse.
__global__ void __launch_bounds__(kRowThreads)
    CrossEntropyForwardKernel(const float* __restrict__ logits, int64_t vocab,
                              const int32_t* __restrict__ targets, float* __restrict__ loss,
                              float* __restrict__ lse) {
  __shared__ float scratch_m[33], scratch_s[33];
  const int64_t r = blockIdx.x;
  const float* lr = logits + r * vocab;
  MaxSum acc{kNegInf, 0.0f};
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) acc = Merge(acc, MaxSum{lr[j], 1.0f});
  acc = BlockMaxSum(acc, scratch_m, scratch_s);
  if (threadIdx.x == 0) {
    const float l = acc.m + logf(acc.s);
    lse[r] = l;
    const int32_t t = targets[r];
    loss[r] = t < 0 ? 0.0f : l - lr[t];
  }
}

// One block per row: dlogits = dloss * (exp(logits - lse) - onehot(target)); 0 if ignored.
__global__ void CrossEntropyBackwardKernel(const float* __restrict__ logits,
                                           const float* __restrict__ lse,
                                           const int32_t* __restrict__ targets, int64_t vocab,
                                           float dloss, float* __restrict__ dlogits) {
  const int64_t r = blockIdx.x;
  const int32_t t = targets[r];
  const float* lr = logits + r * vocab;
  float* dr = dlogits + r * vocab;
  if (t < 0) {
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) dr[j] = 0.0f;
    return;
  }
  const float l = lse[r];
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    dr[j] = dloss * (expf(lr[j] - l) - (j == t ? 1.0f : 0.0f));
  }
}

// out may alias a or b, so no __restrict__: each element is read before it is written, by the
// same thread.
__global__ void AddVec4Kernel(const float4* a, const float4* b, int64_t n4, float4* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 x = a[i], y = b[i];
    out[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
  }
}

__global__ void FillKernel(float* dst, int64_t n, float value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = value;
  }
}

__global__ void AddKernel(const float* a, const float* b, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = a[i] + b[i];
  }
}

// ---------------------------------------------------------------------------------------------
// Attention.
//
// Tiles of 64 rows (queries or keys) x HD (head_dim padded up to 32, 64 or 128, padding zero),
// 256 threads per block arranged 16 x 16 as (ty, tx). A 64 x 64 score tile is computed with a
// 4 x 4 micro-tile per thread: rows ty*4 + i (contiguous, so a row's statistics stay in one
// thread) and columns tx + 16*j (strided, so the 16 threads sharing a row are the 16 low lanes
// of a half-warp and row reductions are xor shuffles over offsets 8..1). A 64 x HD accumulator
// (output, dq, dk or dv) is held as rows ty*4 + i, columns tx + 16*c, c < HD/16.
//
// Shared layouts: a row tile is [64][HD + 4]; the 4-float pad keeps rows 16-byte aligned for
// float4 loads and makes the float4 loads of 8 different rows (one load phase) hit distinct
// banks. A probability / dS tile is [64][68]: 68 puts the two rows a warp touches (ty, ty + 1
// -> rows 4 apart) 16 banks apart.

constexpr int kTile = 64;
constexpr int kAttnThreads = 256;
constexpr int kPLd = kTile + 4;

struct AttnParams {
  int64_t tq, tk, heads, head_dim;
  int64_t q_ld, k_ld, v_ld, out_ld;
  float scale;
  const float* q;
  const float* k;
  const float* v;
  const int32_t* q_pos;
  const int32_t* k_pos;
  float* out_w;        // forward output, stride out_ld
  float* lse_w;        // forward output, [batch, heads, tq]
  const float* out;    // backward input, stride out_ld
  const float* lse;    // backward input
  const float* dout;   // backward input, stride out_ld
  const float* delta;  // backward: rowsum(dout * out), [batch, heads, tq]
  float* dq;
  float* dk;
  float* dv;
};

template <int HD>
__host__ __device__ constexpr int RowLd() {
  return HD + 4;
}

template <int HD>
constexpr size_t FwdSmemBytes() {
  return sizeof(float) * (2 * kTile * RowLd<HD>() + kTile * kPLd);
}
template <int HD>
constexpr size_t BwdKvSmemBytes() {
  return sizeof(float) * (4 * kTile * RowLd<HD>() + 2 * kTile * kPLd);
}
template <int HD>
constexpr size_t BwdQSmemBytes() {
  return sizeof(float) * (4 * kTile * RowLd<HD>() + kTile * kPLd);
}

// dst[r][d] = src[(row0 + r) * ld + d] for row0 + r < rows and d < head_dim, else 0 (so padded
// rows and columns contribute nothing, and never hold uninitialised values that 0 * x would turn
// into NaN). Consecutive threads take consecutive d: coalesced global reads.
template <int HD>
__device__ __forceinline__ void LoadTile(float* dst, const float* src, int64_t ld, int64_t row0,
                                         int64_t rows, int64_t head_dim) {
  for (int idx = threadIdx.x; idx < kTile * HD; idx += kAttnThreads) {
    const int r = idx / HD, d = idx % HD;
    float val = 0.0f;
    if (row0 + r < rows && d < head_dim) val = src[(row0 + r) * ld + d];
    dst[r * RowLd<HD>() + d] = val;
  }
}

// acc[i][j] = sum_d A[ty*4 + i][d] * B[tx + 16*j][d] over two [64][HD + 4] tiles.
template <int HD>
__device__ __forceinline__ void TileDot(const float* a, const float* b, int ty, int tx,
                                        float acc[4][4]) {
  constexpr int kLd = RowLd<HD>();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
  }
#pragma unroll 4
  for (int d = 0; d < HD; d += 4) {
    float4 av[4], bv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      av[i] = *reinterpret_cast<const float4*>(a + (ty * 4 + i) * kLd + d);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      bv[j] = *reinterpret_cast<const float4*>(b + (tx + 16 * j) * kLd + d);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float s = acc[i][j];
        s = fmaf(av[i].x, bv[j].x, s);
        s = fmaf(av[i].y, bv[j].y, s);
        s = fmaf(av[i].z, bv[j].z, s);
        s = fmaf(av[i].w, bv[j].w, s);
        acc[i][j] = s;
      }
    }
  }
}

// acc[i][c] += sum_kk P[ty*4 + i][kk] * V[kk][tx + 16*c] with P [64][68] and V [64][HD + 4].
template <int HD>
__device__ __forceinline__ void TileAccum(const float* p, const float* v, int ty, int tx,
                                          float acc[4][HD / 16]) {
  constexpr int kLd = RowLd<HD>();
  constexpr int kCols = HD / 16;
#pragma unroll 2
  for (int kk = 0; kk < kTile; kk += 4) {
    float4 pv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pv[i] = *reinterpret_cast<const float4*>(p + (ty * 4 + i) * kPLd + kk);
    }
#pragma unroll
    for (int sub = 0; sub < 4; ++sub) {
      float vv[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) vv[c] = v[(kk + sub) * kLd + tx + 16 * c];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float pi = sub == 0 ? pv[i].x : sub == 1 ? pv[i].y : sub == 2 ? pv[i].z : pv[i].w;
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[i][c] = fmaf(pi, vv[c], acc[i][c]);
      }
    }
  }
}

// Reductions over the 16 threads (tx) of a half-warp that share score rows.
__device__ __forceinline__ float RowMax16(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float RowSum16(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Forward. Grid (query tiles, heads, batch). The block keeps its 64 queries in shared memory and
// streams key tiles: K into the K/V buffer, scores and online-softmax update, P to shared, then V
// into the same buffer and O += P V. A key tile no query of the block can see (every key's
// position above the block's largest query position) is skipped: positions are arbitrary
// (zigzag), so tiles cannot be skipped by index.
template <int HD>
__global__ void __launch_bounds__(kAttnThreads) AttentionForwardKernel(AttnParams p) {
  extern __shared__ float4 smem4[];
  float* sq = reinterpret_cast<float*>(smem4);
  float* skv = sq + kTile * RowLd<HD>();
  float* sp = skv + kTile * RowLd<HD>();
  __shared__ int spos[kTile];

  constexpr int kCols = HD / 16;
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const float* qb = p.q + b * p.tq * p.q_ld + h * p.head_dim;
  const float* kb = p.k + b * p.tk * p.k_ld + h * p.head_dim;
  const float* vb = p.v + b * p.tk * p.v_ld + h * p.head_dim;

  LoadTile<HD>(sq, qb, p.q_ld, q0, p.tq, p.head_dim);
  if (tid < kTile) spos[tid] = q0 + tid < p.tq ? p.q_pos[q0 + tid] : INT_MIN;
  __syncthreads();
  int qmax = INT_MIN;
  for (int r = 0; r < kTile; ++r) qmax = max(qmax, spos[r]);
  bool rvalid[4];
  int rpos[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    rvalid[i] = q0 + ty * 4 + i < p.tq;
    rpos[i] = spos[ty * 4 + i];
  }

  float m[4], l[4], acc[4][kCols];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m[i] = kNegInf;
    l[i] = 0.0f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[i][c] = 0.0f;
  }

  for (int64_t k0 = 0; k0 < p.tk; k0 += kTile) {
    // Also the barrier that lets the previous iteration's readers of skv and sp finish.
    const bool any = tid < kTile && k0 + tid < p.tk && p.k_pos[k0 + tid] <= qmax;
    if (!__syncthreads_or(any)) continue;
    LoadTile<HD>(skv, kb, p.k_ld, k0, p.tk, p.head_dim);
    bool cvalid[4];
    int cpos[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      cvalid[j] = k0 + tx + 16 * j < p.tk;
      cpos[j] = cvalid[j] ? p.k_pos[k0 + tx + 16 * j] : 0;
    }
    __syncthreads();

    float s[4][4];
    TileDot<HD>(sq, skv, ty, tx, s);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float tmax = kNegInf;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool vis = rvalid[i] && cvalid[j] && cpos[j] <= rpos[i];
        s[i][j] = vis ? s[i][j] * p.scale : kNegInf;
        tmax = fmaxf(tmax, s[i][j]);
      }
      tmax = RowMax16(tmax);
      const float mnew = fmaxf(m[i], tmax);
      float alpha = 1.0f, rowsum = 0.0f;
      if (mnew != kNegInf) {  // uniform over the 16 threads of the row
        alpha = expf(m[i] - mnew);  // 0 when m[i] was -inf
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          s[i][j] = expf(s[i][j] - mnew);  // 0 for masked scores
          rowsum += s[i][j];
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) s[i][j] = 0.0f;
      }
      rowsum = RowSum16(rowsum);
      l[i] = l[i] * alpha + rowsum;
      m[i] = mnew;
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[i][c] *= alpha;
#pragma unroll
      for (int j = 0; j < 4; ++j) sp[(ty * 4 + i) * kPLd + tx + 16 * j] = s[i][j];
    }
    __syncthreads();  // K reads done, P complete

    LoadTile<HD>(skv, vb, p.v_ld, k0, p.tk, p.head_dim);
    __syncthreads();
    TileAccum<HD>(sp, skv, ty, tx, acc);
  }

#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (!rvalid[i]) continue;
    const int64_t t = q0 + ty * 4 + i;
    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
    float* orow = p.out_w + (b * p.tq + t) * p.out_ld + h * p.head_dim;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = tx + 16 * c;
      if (d < p.head_dim) orow[d] = acc[i][c] * inv;
    }
    if (tx == 0) p.lse_w[(b * p.heads + h) * p.tq + t] = l[i] > 0.0f ? m[i] + logf(l[i]) : kNegInf;
  }
}

// delta[b, h, t] = sum_d dout * out: one warp per (b, t, h).
__global__ void AttentionDeltaKernel(AttnParams p, int64_t batch, float* __restrict__ delta) {
  const int64_t items = batch * p.tq * p.heads;
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp >= items) return;  // whole warps exit together
  const int64_t h = warp % p.heads;
  const int64_t bt = warp / p.heads;  // b * tq + t
  const float* o = p.out + bt * p.out_ld + h * p.head_dim;
  const float* g = p.dout + bt * p.out_ld + h * p.head_dim;
  float acc = 0.0f;
  for (int64_t d = lane; d < p.head_dim; d += 32) acc += o[d] * g[d];
  acc = WarpSum(acc);
  if (lane == 0) {
    const int64_t b = bt / p.tq, t = bt % p.tq;
    delta[(b * p.heads + h) * p.tq + t] = acc;
  }
}

// Probability of a (query, key) pair recomputed from the saved lse; 0 when masked or when the
// query saw no key at all (lse = -inf).
__device__ __forceinline__ float Prob(bool vis, float score, float scale, float lse) {
  return vis && lse != kNegInf ? expf(score * scale - lse) : 0.0f;
}

// Backward for dk and dv. Grid (key tiles, heads, batch). The block keeps its 64 keys and values
// and streams query tiles (skipping those whose queries all sit before the tile's first key
// position): S^T = K Q^T and dP^T = V dO^T per thread micro-tile, P^T and dS^T = P^T (dP^T -
// delta) to shared, then dV += P^T dO and dK += dS^T Q in registers. No atomics.
template <int HD>
__global__ void __launch_bounds__(kAttnThreads) AttentionBackwardKvKernel(AttnParams p) {
  extern __shared__ float4 smem4[];
  float* sk = reinterpret_cast<float*>(smem4);
  float* sv = sk + kTile * RowLd<HD>();
  float* sq = sv + kTile * RowLd<HD>();
  float* sdo = sq + kTile * RowLd<HD>();
  float* sp = sdo + kTile * RowLd<HD>();
  float* sds = sp + kTile * kPLd;
  __shared__ int spos[kTile];
  __shared__ float slse[kTile], sdelta[kTile];

  constexpr int kCols = HD / 16;
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = b * p.heads + h;
  const float* qb = p.q + b * p.tq * p.q_ld + h * p.head_dim;
  const float* kb = p.k + b * p.tk * p.k_ld + h * p.head_dim;
  const float* vb = p.v + b * p.tk * p.v_ld + h * p.head_dim;
  const float* dob = p.dout + b * p.tq * p.out_ld + h * p.head_dim;

  LoadTile<HD>(sk, kb, p.k_ld, k0, p.tk, p.head_dim);
  LoadTile<HD>(sv, vb, p.v_ld, k0, p.tk, p.head_dim);
  if (tid < kTile) spos[tid] = k0 + tid < p.tk ? p.k_pos[k0 + tid] : INT_MAX;
  __syncthreads();
  int kmin = INT_MAX;
  for (int r = 0; r < kTile; ++r) kmin = min(kmin, spos[r]);
  bool rvalid[4];
  int rpos[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    rvalid[i] = k0 + ty * 4 + i < p.tk;
    rpos[i] = spos[ty * 4 + i];
  }

  float dk[4][kCols], dv[4][kCols];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) dk[i][c] = dv[i][c] = 0.0f;
  }

  for (int64_t q0 = 0; q0 < p.tq; q0 += kTile) {
    // Also the barrier that lets the previous iteration's readers of sq, sdo, sp, sds finish.
    const bool any = tid < kTile && q0 + tid < p.tq && p.q_pos[q0 + tid] >= kmin;
    if (!__syncthreads_or(any)) continue;
    LoadTile<HD>(sq, qb, p.q_ld, q0, p.tq, p.head_dim);
    LoadTile<HD>(sdo, dob, p.out_ld, q0, p.tq, p.head_dim);
    if (tid < kTile) {
      const bool ok = q0 + tid < p.tq;
      slse[tid] = ok ? p.lse[bh * p.tq + q0 + tid] : kNegInf;
      sdelta[tid] = ok ? p.delta[bh * p.tq + q0 + tid] : 0.0f;
    }
    bool cvalid[4];
    int cpos[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      cvalid[j] = q0 + tx + 16 * j < p.tq;
      cpos[j] = cvalid[j] ? p.q_pos[q0 + tx + 16 * j] : 0;
    }
    __syncthreads();

    float s[4][4], dp[4][4];
    TileDot<HD>(sk, sq, ty, tx, s);    // rows keys, columns queries
    TileDot<HD>(sv, sdo, ty, tx, dp);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = tx + 16 * j;
        const bool vis = rvalid[i] && cvalid[j] && rpos[i] <= cpos[j];
        const float pij = Prob(vis, s[i][j], p.scale, slse[col]);
        sp[(ty * 4 + i) * kPLd + col] = pij;
        sds[(ty * 4 + i) * kPLd + col] = pij * (dp[i][j] - sdelta[col]);
      }
    }
    __syncthreads();
    TileAccum<HD>(sp, sdo, ty, tx, dv);
    TileAccum<HD>(sds, sq, ty, tx, dk);
  }

#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (!rvalid[i]) continue;
    const int64_t t = k0 + ty * 4 + i;
    float* dkrow = p.dk + (b * p.tk + t) * p.k_ld + h * p.head_dim;
    float* dvrow = p.dv + (b * p.tk + t) * p.v_ld + h * p.head_dim;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = tx + 16 * c;
      if (d < p.head_dim) {
        dkrow[d] = dk[i][c] * p.scale;
        dvrow[d] = dv[i][c];
      }
    }
  }
}

// Backward for dq. Grid (query tiles, heads, batch). The block keeps its 64 queries and their
// output gradients and streams key tiles (skipped as in the forward): S = Q K^T, dP = dO V^T,
// dS = P (dP - delta) to shared, dQ += dS K in registers.
template <int HD>
__global__ void __launch_bounds__(kAttnThreads) AttentionBackwardQKernel(AttnParams p) {
  extern __shared__ float4 smem4[];
  float* sq = reinterpret_cast<float*>(smem4);
  float* sdo = sq + kTile * RowLd<HD>();
  float* sk = sdo + kTile * RowLd<HD>();
  float* sv = sk + kTile * RowLd<HD>();
  float* sds = sv + kTile * RowLd<HD>();
  __shared__ int spos[kTile];

  constexpr int kCols = HD / 16;
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = b * p.heads + h;
  const float* qb = p.q + b * p.tq * p.q_ld + h * p.head_dim;
  const float* kb = p.k + b * p.tk * p.k_ld + h * p.head_dim;
  const float* vb = p.v + b * p.tk * p.v_ld + h * p.head_dim;
  const float* dob = p.dout + b * p.tq * p.out_ld + h * p.head_dim;

  LoadTile<HD>(sq, qb, p.q_ld, q0, p.tq, p.head_dim);
  LoadTile<HD>(sdo, dob, p.out_ld, q0, p.tq, p.head_dim);
  if (tid < kTile) spos[tid] = q0 + tid < p.tq ? p.q_pos[q0 + tid] : INT_MIN;
  __syncthreads();
  int qmax = INT_MIN;
  for (int r = 0; r < kTile; ++r) qmax = max(qmax, spos[r]);
  bool rvalid[4];
  int rpos[4];
  float rlse[4], rdelta[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t t = q0 + ty * 4 + i;
    rvalid[i] = t < p.tq;
    rpos[i] = spos[ty * 4 + i];
    rlse[i] = rvalid[i] ? p.lse[bh * p.tq + t] : kNegInf;
    rdelta[i] = rvalid[i] ? p.delta[bh * p.tq + t] : 0.0f;
  }

  float dq[4][kCols];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) dq[i][c] = 0.0f;
  }

  for (int64_t k0 = 0; k0 < p.tk; k0 += kTile) {
    // Also the barrier that lets the previous iteration's readers of sk and sds finish.
    const bool any = tid < kTile && k0 + tid < p.tk && p.k_pos[k0 + tid] <= qmax;
    if (!__syncthreads_or(any)) continue;
    LoadTile<HD>(sk, kb, p.k_ld, k0, p.tk, p.head_dim);
    LoadTile<HD>(sv, vb, p.v_ld, k0, p.tk, p.head_dim);
    bool cvalid[4];
    int cpos[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      cvalid[j] = k0 + tx + 16 * j < p.tk;
      cpos[j] = cvalid[j] ? p.k_pos[k0 + tx + 16 * j] : 0;
    }
    __syncthreads();

    float s[4][4], dp[4][4];
    TileDot<HD>(sq, sk, ty, tx, s);
    TileDot<HD>(sdo, sv, ty, tx, dp);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool vis = rvalid[i] && cvalid[j] && cpos[j] <= rpos[i];
        const float pij = Prob(vis, s[i][j], p.scale, rlse[i]);
        sds[(ty * 4 + i) * kPLd + tx + 16 * j] = pij * (dp[i][j] - rdelta[i]);
      }
    }
    __syncthreads();
    TileAccum<HD>(sds, sk, ty, tx, dq);
  }

#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (!rvalid[i]) continue;
    const int64_t t = q0 + ty * 4 + i;
    float* row = p.dq + (b * p.tq + t) * p.q_ld + h * p.head_dim;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = tx + 16 * c;
      if (d < p.head_dim) row[d] = dq[i][c] * p.scale;
    }
  }
}

// ---------------------------------------------------------------------------------------------

class CudaOps final : public TransformerOps {
 public:
  CudaOps(cudaStream_t stream, cublasHandle_t handle, int device)
      : stream_(stream), handle_(handle), device_(device) {}
  ~CudaOps() override {
    cublasDestroy(handle_);
    if (owns_stream_) cudaStreamDestroy(stream_);
  }

  std::unique_ptr<BackendMemory> NewCopyStream(std::string* error) const override;
  std::string BindDevice() const override {
    const cudaError_t e = cudaSetDevice(device_);
    return e == cudaSuccess ? "" : CudaErr("cudaSetDevice", e);
  }
  void* HostView(void* host, std::string* error) const override {
    void* dev = nullptr;
    const cudaError_t e = cudaHostGetDevicePointer(&dev, host, 0);
    if (e != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it so that Synchronize() does not report it
      *error = CudaErr("cudaHostGetDevicePointer (is the memory registered?)", e);
      return nullptr;
    }
    return dev;
  }
  bool owns_stream_ = false;  // a copy stream's backend destroys its stream

  const char* name() const override { return "cuda"; }

  void Gemm(Trans ta, Trans tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
            int64_t lda, const float* b, int64_t ldb, float beta, float* c,
            int64_t ldc) const override {
    GemmEx(ta, tb, m, n, k, alpha, a, CUDA_R_32F, lda, b, CUDA_R_32F, ldb, beta, c, ldc);
  }

  void GemmBf16(Trans ta, Trans tb, int64_t m, int64_t n, int64_t k, float alpha,
                const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta,
                float* c, int64_t ldc) const override {
    GemmEx(ta, tb, m, n, k, alpha, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, beta, c, ldc);
  }

  void EmbeddingForward(const float* table, int64_t dim, const int32_t* ids, int64_t n,
                        float* out) const override {
    if (n <= 0 || dim <= 0) return;
    EmbeddingForwardKernel<<<static_cast<unsigned>(n), RowThreads(dim), 0, stream_>>>(table, dim,
                                                                                     ids, out);
    CheckLaunch("EmbeddingForwardKernel");
  }

  void EmbeddingBackward(const float* dout, int64_t dim, const int32_t* ids, int64_t n,
                         float* dtable) const override {
    if (n <= 0 || dim <= 0) return;
    if (n > INT_MAX) return Record("EmbeddingBackward: more than INT_MAX tokens");
    const int count = static_cast<int>(n);
    // Stable radix sort of (id, token index) pairs; the layout of the one workspace block is
    // sorted ids | indices in | indices out | CUB temporary storage, each 256-byte aligned.
    size_t sort_bytes = 0;
    cudaError_t e = cub::DeviceRadixSort::SortPairs(
        nullptr, sort_bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
        static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), count, 0, 32,
        stream_);
    if (e != cudaSuccess) return Record(CudaErr("cub::DeviceRadixSort::SortPairs (size)", e));
    const size_t arr = AlignUp(sizeof(int32_t) * static_cast<size_t>(n));
    char* ws = static_cast<char*>(Workspace(3 * arr + sort_bytes));
    if (ws == nullptr) return;
    int32_t* sorted_ids = reinterpret_cast<int32_t*>(ws);
    int32_t* order_in = reinterpret_cast<int32_t*>(ws + arr);
    int32_t* order = reinterpret_cast<int32_t*>(ws + 2 * arr);
    void* temp = ws + 3 * arr;
    IotaKernel<<<GridFor(n, 256), 256, 0, stream_>>>(order_in, n);
    CheckLaunch("IotaKernel");
    e = cub::DeviceRadixSort::SortPairs(temp, sort_bytes, ids, sorted_ids, order_in, order, count,
                                        0, 32, stream_);
    if (e != cudaSuccess) {
      Record(CudaErr("cub::DeviceRadixSort::SortPairs", e));
    } else {
      EmbeddingBackwardKernel<<<static_cast<unsigned>(n), RowThreads(dim), 0, stream_>>>(
          dout, dim, sorted_ids, order, n, dtable);
      CheckLaunch("EmbeddingBackwardKernel");
    }
    Release(ws);
  }

  void RmsNormForward(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                      float* y, float* rstd) const override {
    if (rows <= 0 || dim <= 0) return;
    RmsNormForwardKernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream_>>>(x, w, dim, eps,
                                                                                  y, rstd);
    CheckLaunch("RmsNormForwardKernel");
  }

  void RmsNormBackward(const float* x, const float* w, const float* rstd, const float* dy,
                       int64_t rows, int64_t dim, float* dx, float* dw) const override {
    if (rows <= 0 || dim <= 0) return;
    RmsNormBackwardDxKernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream_>>>(
        x, w, rstd, dy, dim, dx);
    CheckLaunch("RmsNormBackwardDxKernel");
    // Row chunks for the dw partial sums: at most 256 chunks (bounded workspace and final-pass
    // loop), at least 16 rows each (enough work per thread).
    const int64_t rows_per_chunk = std::max<int64_t>(16, (rows + 255) / 256);
    const int64_t chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
    float* partial = static_cast<float*>(Workspace(sizeof(float) * chunks * dim));
    if (partial == nullptr) return;
    const unsigned col_blocks = static_cast<unsigned>((dim + 255) / 256);
    RmsNormDwPartialKernel<<<dim3(col_blocks, static_cast<unsigned>(chunks)), 256, 0, stream_>>>(
        x, rstd, dy, rows, dim, rows_per_chunk, partial);
    CheckLaunch("RmsNormDwPartialKernel");
    RmsNormDwFinalKernel<<<col_blocks, 256, 0, stream_>>>(partial, chunks, dim, dw);
    CheckLaunch("RmsNormDwFinalKernel");
    Release(partial);
  }

  void SwiGluForward(const float* gate, const float* up, int64_t n, float* out) const override {
    if (n <= 0) return;
    SwiGluForwardKernel<<<GridFor(n, 256), 256, 0, stream_>>>(gate, up, n, out);
    CheckLaunch("SwiGluForwardKernel");
  }

  void SwiGluBackward(const float* gate, const float* up, const float* dout, int64_t n,
                      float* dgate, float* dup) const override {
    if (n <= 0) return;
    SwiGluBackwardKernel<<<GridFor(n, 256), 256, 0, stream_>>>(gate, up, dout, n, dgate, dup);
    CheckLaunch("SwiGluBackwardKernel");
  }

  void AttentionForward(const AttentionShape& s, const float* q, const float* k, const float* v,
                        const int32_t* q_pos, const int32_t* k_pos, float* out,
                        float* lse) const override {
    AttnParams p;
    if (!MakeParams(s, q, k, v, q_pos, k_pos, &p)) return;
    if (s.batch <= 0 || s.heads <= 0 || s.tq <= 0) return;
    p.out_w = out;
    p.lse_w = lse;
    const dim3 grid(static_cast<unsigned>((s.tq + kTile - 1) / kTile),
                    static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch));
    switch (PaddedHeadDim(s.head_dim)) {
      case 32: LaunchForward<32>(grid, p); break;
      case 64: LaunchForward<64>(grid, p); break;
      default: LaunchForward<128>(grid, p); break;
    }
  }

  void AttentionBackward(const AttentionShape& s, const float* q, const float* k, const float* v,
                         const int32_t* q_pos, const int32_t* k_pos, const float* out,
                         const float* lse, const float* dout, float* dq, float* dk,
                         float* dv) const override {
    AttnParams p;
    if (!MakeParams(s, q, k, v, q_pos, k_pos, &p)) return;
    if (s.batch <= 0 || s.heads <= 0) return;
    p.out = out;
    p.lse = lse;
    p.dout = dout;
    p.dq = dq;
    p.dk = dk;
    p.dv = dv;
    float* delta = nullptr;
    if (s.tq > 0) {
      const int64_t items = s.batch * s.heads * s.tq;
      delta = static_cast<float*>(Workspace(sizeof(float) * items));
      if (delta == nullptr) return;
      p.delta = delta;
      AttentionDeltaKernel<<<static_cast<unsigned>((items * 32 + 255) / 256), 256, 0, stream_>>>(
          p, s.batch, delta);
      CheckLaunch("AttentionDeltaKernel");
    }
    const dim3 kv_grid(static_cast<unsigned>((s.tk + kTile - 1) / kTile),
                       static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch));
    const dim3 q_grid(static_cast<unsigned>((s.tq + kTile - 1) / kTile),
                      static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch));
    switch (PaddedHeadDim(s.head_dim)) {
      case 32: LaunchBackward<32>(kv_grid, q_grid, p); break;
      case 64: LaunchBackward<64>(kv_grid, q_grid, p); break;
      default: LaunchBackward<128>(kv_grid, q_grid, p); break;
    }
    if (delta != nullptr) Release(delta);
  }

  void CrossEntropyForward(const float* logits, int64_t rows, int64_t vocab,
                           const int32_t* targets, float* loss, float* lse) const override {
    if (rows <= 0 || vocab <= 0) return;
    CrossEntropyForwardKernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream_>>>(
        logits, vocab, targets, loss, lse);
    CheckLaunch("CrossEntropyForwardKernel");
  }

  void CrossEntropyBackward(const float* logits, const float* lse, const int32_t* targets,
                            int64_t rows, int64_t vocab, float dloss,
                            float* dlogits) const override {
    if (rows <= 0 || vocab <= 0) return;
    CrossEntropyBackwardKernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream_>>>(
        logits, lse, targets, vocab, dloss, dlogits);
    CheckLaunch("CrossEntropyBackwardKernel");
  }

  void Add(const float* a, const float* b, int64_t n, float* out) const override {
    if (n <= 0) return;
    const auto aligned = [](const void* ptr) {
      return reinterpret_cast<uintptr_t>(ptr) % sizeof(float4) == 0;
    };
    int64_t head = 0;  // elements done by the float4 kernel
    if (aligned(a) && aligned(b) && aligned(out) && n >= 4) {
      const int64_t n4 = n / 4;
      AddVec4Kernel<<<GridFor(n4, 256), 256, 0, stream_>>>(reinterpret_cast<const float4*>(a),
                                                           reinterpret_cast<const float4*>(b), n4,
                                                           reinterpret_cast<float4*>(out));
      CheckLaunch("AddVec4Kernel");
      head = n4 * 4;
    }
    if (head < n) {
      AddKernel<<<GridFor(n - head, 256), 256, 0, stream_>>>(a + head, b + head, n - head,
                                                             out + head);
      CheckLaunch("AddKernel");
    }
  }

  float* AllocFloats(int64_t n) const override {
    if (n <= 0) return nullptr;
    const size_t bytes = static_cast<size_t>(n) * sizeof(float);
    void* ptr = nullptr;
    cudaError_t e = cudaMallocAsync(&ptr, bytes, stream_);
    if (e != cudaSuccess) {
      Record(CudaErr("cudaMallocAsync", e));
      return nullptr;
    }
    e = cudaMemsetAsync(ptr, 0, bytes, stream_);
    if (e != cudaSuccess) Record(CudaErr("cudaMemsetAsync", e));
    return static_cast<float*>(ptr);
  }

  void Free(void* p) const override {
    if (p != nullptr) Release(p);
  }

  void CopyFloats(float* dst, const float* src, int64_t n) const override {
    Memcpy(dst, src, n, cudaMemcpyDeviceToDevice, "cudaMemcpyAsync (device to device)");
  }

  void Fill(float* dst, int64_t n, float value) const override {
    if (n <= 0) return;
    if (value == 0.0f && !std::signbit(value)) {
      cudaError_t e = cudaMemsetAsync(dst, 0, static_cast<size_t>(n) * sizeof(float), stream_);
      if (e != cudaSuccess) Record(CudaErr("cudaMemsetAsync", e));
      return;
    }
    FillKernel<<<GridFor(n, 256), 256, 0, stream_>>>(dst, n, value);
    CheckLaunch("FillKernel");
  }

  void Upload(float* dst_backend, const float* src_host, int64_t n) const override {
    Memcpy(dst_backend, src_host, n, cudaMemcpyHostToDevice, "cudaMemcpyAsync (to device)");
  }

  void Download(float* dst_host, const float* src_backend, int64_t n) const override {
    Memcpy(dst_host, src_backend, n, cudaMemcpyDeviceToHost, "cudaMemcpyAsync (to host)");
  }

  void Copy2D(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows,
              int64_t cols) const override {
    if (rows <= 0 || cols <= 0) return;
    cudaError_t e = cudaMemcpy2DAsync(
        dst, static_cast<size_t>(dst_ld) * sizeof(float), src,
        static_cast<size_t>(src_ld) * sizeof(float), static_cast<size_t>(cols) * sizeof(float),
        static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, stream_);
    if (e != cudaSuccess) Record(CudaErr("cudaMemcpy2DAsync", e));
  }

  std::string Synchronize() const override {
    cudaError_t e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) Record(CudaErr("cudaStreamSynchronize", e));
    std::lock_guard<std::mutex> lock(mu_);
    std::string err;
    err.swap(first_error_);  // reported once; later calls start clean
    return err;
  }

 private:
  static unsigned RowThreads(int64_t dim) {
    // A warp multiple, at most 256: small rows do not leave most of a large block idle.
    return static_cast<unsigned>(std::min<int64_t>(256, (dim + 31) / 32 * 32));
  }

  static size_t AlignUp(size_t bytes) { return (bytes + 255) / 256 * 256; }

  static int PaddedHeadDim(int64_t head_dim) {
    return head_dim <= 32 ? 32 : head_dim <= 64 ? 64 : 128;
  }

  void Record(const std::string& error) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (first_error_.empty()) first_error_ = error;
  }

  void CheckLaunch(const char* kernel) const {
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) Record(CudaErr(kernel, e));
  }

  // Stream-ordered temporary memory: valid for work enqueued on stream_ until Release().
  void* Workspace(size_t bytes) const {
    void* ptr = nullptr;
    cudaError_t e = cudaMallocAsync(&ptr, std::max<size_t>(bytes, 1), stream_);
    if (e != cudaSuccess) {
      Record(CudaErr("cudaMallocAsync", e));
      return nullptr;
    }
    return ptr;
  }

  void Memcpy(void* dst, const void* src, int64_t n, cudaMemcpyKind kind, const char* what) const {
    if (n <= 0) return;
    cudaError_t e =
        cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float), kind, stream_);
    if (e != cudaSuccess) Record(CudaErr(what, e));
  }

  void Release(void* ptr) const {
    cudaError_t e = cudaFreeAsync(ptr, stream_);
    if (e != cudaSuccess) Record(CudaErr("cudaFreeAsync", e));
  }

  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: a row-major X with row
  // stride ld is the column-major X^T with leading dimension ld, so B goes first with its own
  // transpose flag, and m, n swap.
  void GemmEx(Trans ta, Trans tb, int64_t m, int64_t n, int64_t k, float alpha, const void* a,
              cudaDataType_t a_type, int64_t lda, const void* b, cudaDataType_t b_type,
              int64_t ldb, float beta, float* c, int64_t ldc) const {
    if (m <= 0 || n <= 0) return;
    if (k <= 0) {
      ScaleMatrixKernel<<<GridFor(m * n, 256), 256, 0, stream_>>>(c, m, n, ldc, beta);
      CheckLaunch("ScaleMatrixKernel");
      return;
    }
    if (std::max({m, n, k, lda, ldb, ldc}) > INT_MAX) {
      return Record("Gemm: a dimension or leading dimension exceeds INT_MAX");
    }
    const cublasOperation_t op_a = ta == Trans::kYes ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = tb == Trans::kYes ? CUBLAS_OP_T : CUBLAS_OP_N;
    // CUBLAS_COMPUTE_32F under CUBLAS_DEFAULT_MATH (set at creation): fp32 inputs never go
    // through TF32; bf16 inputs use tensor cores with fp32 accumulation.
    cublasStatus_t st = cublasGemmEx(
        handle_, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
        &alpha, b, b_type, static_cast<int>(ldb), a, a_type, static_cast<int>(lda), &beta, c,
        CUDA_R_32F, static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) {
      Record(std::string("cublasGemmEx failed: ") + cublasGetStatusString(st));
    }
  }

  bool MakeParams(const AttentionShape& s, const float* q, const float* k, const float* v,
                  const int32_t* q_pos, const int32_t* k_pos, AttnParams* p) const {
    if (s.head_dim <= 0 || s.head_dim > 128) {
      Record("attention: head_dim " + std::to_string(s.head_dim) +
             " unsupported by the CUDA backend (1..128)");
      return false;
    }
    if (s.heads > 65535 || s.batch > 65535 || (s.tq + kTile - 1) / kTile > INT_MAX ||
        (s.tk + kTile - 1) / kTile > INT_MAX) {
      Record("attention: shape exceeds the CUDA grid limits");
      return false;
    }
    *p = AttnParams{};
    p->tq = s.tq;
    p->tk = s.tk;
    p->heads = s.heads;
    p->head_dim = s.head_dim;
    p->q_ld = s.q_ld;
    p->k_ld = s.k_ld;
    p->v_ld = s.v_ld;
    p->out_ld = s.out_ld;
    p->scale = s.scale != 0.0f ? s.scale : 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    p->q = q;
    p->k = k;
    p->v = v;
    p->q_pos = q_pos;
    p->k_pos = k_pos;
    return true;
  }

  // Kernels above 48 KiB of dynamic shared memory must opt in; the attribute is set before each
  // launch (cheap, and correct whichever device is current).
  template <typename Kernel>
  bool PrepareSmem(Kernel kernel, size_t bytes, const char* name) const {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(bytes));
    if (e != cudaSuccess) {
      Record(CudaErr(name, e));
      return false;
    }
    return true;
  }

  template <int HD>
  void LaunchForward(dim3 grid, const AttnParams& p) const {
    const size_t smem = FwdSmemBytes<HD>();
    if (!PrepareSmem(AttentionForwardKernel<HD>, smem, "AttentionForwardKernel smem")) return;
    AttentionForwardKernel<HD><<<grid, kAttnThreads, smem, stream_>>>(p);
    CheckLaunch("AttentionForwardKernel");
  }

  template <int HD>
  void LaunchBackward(dim3 kv_grid, dim3 q_grid, const AttnParams& p) const {
    if (p.tk > 0) {
      const size_t smem = BwdKvSmemBytes<HD>();
      if (!PrepareSmem(AttentionBackwardKvKernel<HD>, smem, "AttentionBackwardKvKernel smem")) {
        return;
      }
      AttentionBackwardKvKernel<HD><<<kv_grid, kAttnThreads, smem, stream_>>>(p);
      CheckLaunch("AttentionBackwardKvKernel");
    }
    if (p.tq > 0) {
      const size_t smem = BwdQSmemBytes<HD>();
      if (!PrepareSmem(AttentionBackwardQKernel<HD>, smem, "AttentionBackwardQKernel smem")) {
        return;
      }
      AttentionBackwardQKernel<HD><<<q_grid, kAttnThreads, smem, stream_>>>(p);
      CheckLaunch("AttentionBackwardQKernel");
    }
  }

  cudaStream_t stream_;
  cublasHandle_t handle_;
  int device_;  // the stream's device (cudaStreamGetDevice), or the current one for stream 0
  mutable std::mutex mu_;
  mutable std::string first_error_;
};

}  // namespace

std::unique_ptr<TransformerOps> NewCudaOps(void* stream, std::string* error) {
  // The backend works on its stream's device whatever device the caller has current: the
  // cuBLAS handle is created there, and BindDevice makes it current on other threads.
  // The caller's current device is current again on return.
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  int device = 0, current = 0;
  cudaError_t e = cudaGetDevice(&current);
  if (e == cudaSuccess) e = s != nullptr ? cudaStreamGetDevice(s, &device) : cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    *error = CudaErr("finding the stream's device (cudaStreamGetDevice)", e);
    return nullptr;
  }
  struct Restore {
    int device;
    ~Restore() { cudaSetDevice(device); }
  } restore{current};
  cublasHandle_t handle = nullptr;
  cublasStatus_t st = cublasCreate(&handle);
  if (st != CUBLAS_STATUS_SUCCESS) {
    *error = std::string("cublasCreate failed: ") + cublasGetStatusString(st);
    return nullptr;
  }
  st = cublasSetStream(handle, s);
  if (st == CUBLAS_STATUS_SUCCESS) st = cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH);
  if (st != CUBLAS_STATUS_SUCCESS) {
    *error = std::string("cublas handle setup failed: ") + cublasGetStatusString(st);
    cublasDestroy(handle);
    return nullptr;
  }
  return std::make_unique<CudaOps>(s, handle, device);
}

std::unique_ptr<BackendMemory> CudaOps::NewCopyStream(std::string* error) const {
  // On this backend's device, whatever the caller has current (current again on return).
  int current = 0;
  cudaError_t e = cudaGetDevice(&current);
  if (e == cudaSuccess) e = cudaSetDevice(device_);
  cudaStream_t s = nullptr;
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaSetDevice(current);
  if (e != cudaSuccess) {
    *error = CudaErr("cudaStreamCreateWithFlags (copy stream)", e);
    return nullptr;
  }
  std::unique_ptr<TransformerOps> ops = NewCudaOps(s, error);
  if (ops == nullptr) {
    cudaStreamDestroy(s);
    return nullptr;
  }
  static_cast<CudaOps*>(ops.get())->owns_stream_ = true;
  return std::unique_ptr<BackendMemory>(ops.release());
}

}  // namespace cuda
}  // namespace kernels
}  // namespace stallfree
