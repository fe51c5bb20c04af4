// CUDA backend of the optimizer and selection kernels (kernels/optimizer.h).
//
// Element-wise kernels (Accumulate, AdamW, AccumulateAdamW, the bf16 conversions) are one
// grid-stride template over an "op": a vector body that moves 4 elements per array per step
// (float4 for fp32, 8 bytes for 4 x bf16) and a scalar body. The host splits [0, n) into a head
// (elements before every array is vector-aligned), whole vectors and a tail; if the arrays cannot
// all be aligned at one index (different misalignments), everything runs through the scalar body.
// The memory-bound steps are limited by bytes, so the arithmetic can afford IEEE rounding
// intrinsics (__fmul_rn etc.: never contracted into FMA) in the oracle's exact order, which makes
// the results bit-identical to ReferenceKernel(). AdamWColumns (per-column bias corrections) has
// its own scalar grid-stride kernel with the same element arithmetic.
//
// ColumnScores: 32 x 8 thread blocks, threads along columns (coalesced row segments), the 8 row
// lanes and the row chunks reduced in a fixed order (no atomics: deterministic). TopK: an
// order-preserving 32-bit key per score (NaN lowest, -0 == +0), a stable descending radix sort of
// (key, index) pairs, then an ascending sort of the first k indices (CUB).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cub/device/device_radix_sort.cuh>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/optimizer_cuda.h"
#include "kernels/optimizer.h"

namespace stallfree {
namespace kernels {
namespace cuda {
namespace {

constexpr int kThreads = 256;
// Resident 256-thread blocks per SM at full occupancy (2048 threads): the grid-stride kernels
// launch one wave of these, enough bytes in flight to saturate HBM.
constexpr int kBlocksPerSm = 8;

// ----------------------------------------------------------------------------------------------
// Element helpers (bit-compatible with common/bf16.h).

__device__ __forceinline__ float Bf16ToF(uint32_t h) { return __uint_as_float(h << 16); }

// Round to nearest even; NaN keeps its sign and high payload bits and is forced quiet, so it can
// never round into infinity (as stallfree::FloatToBf16).
__device__ __forceinline__ uint32_t FToBf16(float f) {
  const uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (bits >> 16) | 0x0040u;
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ float LoadOne(const float* p) { return *p; }
__device__ __forceinline__ float LoadOne(const uint16_t* p) { return Bf16ToF(*p); }

// Four consecutive elements at a vector-aligned p.
__device__ __forceinline__ void Load4(const float* p, float (&x)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  x[0] = v.x;
  x[1] = v.y;
  x[2] = v.z;
  x[3] = v.w;
}
__device__ __forceinline__ void Load4(const uint16_t* p, float (&x)[4]) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);  // little endian: element 0 is the low half
  x[0] = __uint_as_float(v.x << 16);
  x[1] = __uint_as_float(v.x & 0xffff0000u);
  x[2] = __uint_as_float(v.y << 16);
  x[3] = __uint_as_float(v.y & 0xffff0000u);
}
__device__ __forceinline__ void Store4(float* p, const float (&x)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
}
__device__ __forceinline__ void Store4Bf16(uint16_t* p, const float (&x)[4]) {
  uint2 v;
  v.x = FToBf16(x[0]) | (FToBf16(x[1]) << 16);
  v.y = FToBf16(x[2]) | (FToBf16(x[3]) << 16);
  *reinterpret_cast<uint2*>(p) = v;
}

// One AdamW element with the oracle's operation order (kernels/cpu/reference.cc); g already
// scaled; the bias corrections step_size and bc2_sqrt given apart from k (whose own are not
// read), so that AdamWColumns can pass a column's. Every operation is explicitly rounded, so
// nothing is fused.
__device__ __forceinline__ void AdamWElement(const AdamWConstants& k, float step_size,
                                             float bc2_sqrt, float g, float& p, float& m,
                                             float& v) {
  const float decayed = __fmul_rn(p, k.decay);
  m = __fadd_rn(__fmul_rn(k.b1, m), __fmul_rn(k.omb1, g));
  v = __fadd_rn(__fmul_rn(k.b2, v), __fmul_rn(__fmul_rn(k.omb2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), bc2_sqrt), k.eps);
  p = __fsub_rn(decayed, __fmul_rn(step_size, __fdiv_rn(m, denom)));
}
__device__ __forceinline__ void AdamWElement(const AdamWConstants& k, float g, float& p, float& m,
                                             float& v) {
  AdamWElement(k, k.step_size, k.bc2_sqrt, g, p, m, v);
}

// ----------------------------------------------------------------------------------------------
// The element-wise ops. Each has Vec(e) for elements e..e+3 (every array vector-aligned at e)
// and One(e) for element e.

template <typename G, bool kOverwrite>
struct AccumulateOp {
  float* acc;
  const G* grad;
  float scale;
  __device__ __forceinline__ void Vec(int64_t e) const {
    float g[4], a[4] = {0, 0, 0, 0};
    Load4(grad + e, g);
    if (!kOverwrite) Load4(acc + e, a);
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const float s = __fmul_rn(scale, g[l]);
      a[l] = kOverwrite ? s : __fadd_rn(a[l], s);
    }
    Store4(acc + e, a);
  }
  __device__ __forceinline__ void One(int64_t e) const {
    const float s = __fmul_rn(scale, LoadOne(grad + e));
    acc[e] = kOverwrite ? s : __fadd_rn(acc[e], s);
  }
};

// Where the AdamW gradient comes from.
enum class GradSource {
  kGrad,     // g = grad_scale * grad
  kAccGrad,  // g = grad_scale * (acc + acc_scale * grad)
  kAcc,      // g = grad_scale * acc
};

template <typename G, GradSource kSource, bool kOut>
struct AdamWOp {
  AdamWConstants k;
  float* p;
  float* m;
  float* v;
  const float* acc;
  const G* grad;
  float acc_scale;
  uint16_t* out;

  __device__ __forceinline__ float Gradient(float a, float g) const {
    switch (kSource) {
      case GradSource::kGrad:
        return __fmul_rn(k.grad_scale, g);
      case GradSource::kAccGrad:
        return __fmul_rn(k.grad_scale, __fadd_rn(a, __fmul_rn(acc_scale, g)));
      case GradSource::kAcc:
      default:
        return __fmul_rn(k.grad_scale, a);
    }
  }
  __device__ __forceinline__ void Vec(int64_t e) const {
    float pp[4], mm[4], vv[4], aa[4] = {0, 0, 0, 0}, gg[4] = {0, 0, 0, 0};
    Load4(p + e, pp);
    Load4(m + e, mm);
    Load4(v + e, vv);
    if (kSource != GradSource::kGrad) Load4(acc + e, aa);
    if (kSource != GradSource::kAcc) Load4(grad + e, gg);
#pragma unroll
    for (int l = 0; l < 4; ++l) AdamWElement(k, Gradient(aa[l], gg[l]), pp[l], mm[l], vv[l]);
    Store4(p + e, pp);
    Store4(m + e, mm);
    Store4(v + e, vv);
    if (kOut) Store4Bf16(out + e, pp);
  }
  __device__ __forceinline__ void One(int64_t e) const {
    float pi = p[e], mi = m[e], vi = v[e];
    const float a = kSource != GradSource::kGrad ? acc[e] : 0.0f;
    const float g = kSource != GradSource::kAcc ? LoadOne(grad + e) : 0.0f;
    AdamWElement(k, Gradient(a, g), pi, mi, vi);
    p[e] = pi;
    m[e] = mi;
    v[e] = vi;
    if (kOut) out[e] = static_cast<uint16_t>(FToBf16(pi));
  }
};

struct ToBf16Op {
  const float* src;
  uint16_t* dst;
  __device__ __forceinline__ void Vec(int64_t e) const {
    float x[4];
    Load4(src + e, x);
    Store4Bf16(dst + e, x);
  }
  __device__ __forceinline__ void One(int64_t e) const {
    dst[e] = static_cast<uint16_t>(FToBf16(src[e]));
  }
};

struct FromBf16Op {
  const uint16_t* src;
  float* dst;
  __device__ __forceinline__ void Vec(int64_t e) const {
    float x[4];
    Load4(src + e, x);
    Store4(dst + e, x);
  }
  __device__ __forceinline__ void One(int64_t e) const { dst[e] = Bf16ToF(src[e]); }
};

// Benchmark pattern: reads kIn arrays, writes kOut arrays, one add per element.
template <int kIn, int kOut>
struct StreamOp {
  const float* in[4];
  float* out[4];
  __device__ __forceinline__ void Vec(int64_t e) const {
    float s[4] = {0, 0, 0, 0};
#pragma unroll
    for (int a = 0; a < kIn; ++a) {
      float x[4];
      Load4(in[a] + e, x);
#pragma unroll
      for (int l = 0; l < 4; ++l) s[l] += x[l];
    }
#pragma unroll
    for (int a = 0; a < kOut; ++a) Store4(out[a] + e, s);
  }
  __device__ __forceinline__ void One(int64_t e) const {
    float s = 0;
#pragma unroll
    for (int a = 0; a < kIn; ++a) s += in[a][e];
#pragma unroll
    for (int a = 0; a < kOut; ++a) out[a][e] = s;
  }
};

// AdamW with per-column bias corrections over a row-major [rows, cols] block of n = rows * cols
// elements: element i is in column i % cols. One element per thread per step (the constants'
// index does not follow a 4-element vector across a row end); the column is advanced by the
// stride modulo cols instead of divided out per element.
template <typename G, bool kOut>
__global__ void __launch_bounds__(kThreads)
    AdamWColumnsKernel(AdamWConstants k, const float* __restrict__ step_size,
                       const float* __restrict__ bc2_sqrt, float* __restrict__ p,
                       float* __restrict__ m, float* __restrict__ v, const G* __restrict__ grad,
                       uint16_t* __restrict__ out, int64_t n, int64_t cols) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t col_step = stride % cols;
  int64_t c = tid % cols;
  for (int64_t i = tid; i < n; i += stride) {
    float pi = p[i], mi = m[i], vi = v[i];
    AdamWElement(k, step_size[c], bc2_sqrt[c], __fmul_rn(k.grad_scale, LoadOne(grad + i)), pi, mi,
                 vi);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (kOut) out[i] = static_cast<uint16_t>(FToBf16(pi));
    c += col_step;
    if (c >= cols) c -= cols;
  }
}

// Vectors i < nvec cover elements head + 4i .. head + 4i + 3; the `rest` = n - 4 * nvec other
// elements are [0, head) and [head + 4 * nvec, n), numbered r = 0 .. rest-1.
template <typename Op>
__global__ void __launch_bounds__(kThreads)
    ElementwiseKernel(Op op, int64_t head, int64_t nvec, int64_t rest) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < nvec; i += stride) op.Vec(head + 4 * i);
  const int64_t jump = 4 * nvec;
  for (int64_t r = tid; r < rest; r += stride) op.One(r < head ? r : r + jump);
}

// Resident blocks per SM of ElementwiseKernel<Op> (the AdamW ops use ~50-60 registers, so
// fewer than kBlocksPerSm fit): the grid is exactly one full wave, so no partial second wave of
// grid-stride blocks runs at reduced occupancy. Computed once per op type.
template <typename Op>
int ResidentBlocksPerSm() {
  static const int blocks = [] {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, ElementwiseKernel<Op>, kThreads, 0) !=
            cudaSuccess ||
        b < 1) {
      cudaGetLastError();  // clear it: the launch itself reports real errors
      b = kBlocksPerSm;
    }
    return b;
  }();
  return blocks;
}

// How [0, n) splits into head, vectors and tail for a set of arrays.
struct VecPlan {
  int64_t head = 0;
  int64_t nvec = 0;
};

struct ArrayRef {
  const void* ptr;  // nullptr: not part of the call
  size_t elem_size;
};

// Vectors need every array aligned to 4 elements at the same index; the head is the number of
// leading elements that takes. Arrays with different misalignments (or not even element-aligned)
// get no vectors: the scalar body covers all of [0, n).
VecPlan PlanVectors(int64_t n, std::initializer_list<ArrayRef> arrays) {
  VecPlan plan;
  int64_t head = -1;
  for (const ArrayRef& a : arrays) {
    if (a.ptr == nullptr) continue;
    const uintptr_t addr = reinterpret_cast<uintptr_t>(a.ptr);
    if (addr % a.elem_size != 0) return plan;
    const int64_t h = (4 - static_cast<int64_t>((addr / a.elem_size) % 4)) % 4;
    if (head < 0) {
      head = h;
    } else if (h != head) {
      return plan;
    }
  }
  if (head < 0 || head >= n) return plan;
  plan.head = head;
  plan.nvec = (n - head) / 4;
  return plan;
}

// ----------------------------------------------------------------------------------------------
// ColumnScores.

constexpr int kColTile = 32;  // columns per block (threadIdx.x): one warp reads a row segment
constexpr int kRowLanes = 8;  // row lanes per block (threadIdx.y)
// A row chunk is at least this many rows, so that each thread sums >= 8 rows before the
// cross-lane reduction.
constexpr int64_t kMinChunkRows = 64;

// Partial sums of the rows [blockIdx.y * rows_per_chunk, +rows_per_chunk) for column tiles
// blockIdx.x, +gridDim.x, ...: l1_part[blockIdx.y * cols + c] (either output may be null).
// Each thread sums its row lane in row order; the 8 lanes are added in lane order.
template <typename G>
__global__ void __launch_bounds__(kColTile* kRowLanes)
    ColumnPartialKernel(const G* __restrict__ grad, int64_t rows, int64_t cols, int64_t ld,
                        int64_t rows_per_chunk, float* __restrict__ l1_part,
                        float* __restrict__ l2_part) {
  __shared__ float s1[kRowLanes][kColTile];
  __shared__ float s2[kRowLanes][kColTile];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t r_begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r_end = min(rows, r_begin + rows_per_chunk);
  const int64_t col_tiles = (cols + kColTile - 1) / kColTile;
  // The tile loop's bounds depend on blockIdx only, so every thread reaches the barriers.
  for (int64_t tile = blockIdx.x; tile < col_tiles; tile += gridDim.x) {
    const int64_t c = tile * kColTile + tx;
    float a = 0.0f, b = 0.0f;
    if (c < cols) {
      const G* col = grad + c;
#pragma unroll 4
      for (int64_t r = r_begin + ty; r < r_end; r += kRowLanes) {
        const float x = LoadOne(col + r * ld);
        a += fabsf(x);
        b += x * x;
      }
    }
    s1[ty][tx] = a;
    s2[ty][tx] = b;
    __syncthreads();
    if (ty == 0 && c < cols) {
      float sa = s1[0][tx], sb = s2[0][tx];
#pragma unroll
      for (int y = 1; y < kRowLanes; ++y) {
        sa += s1[y][tx];
        sb += s2[y][tx];
      }
      const int64_t o = static_cast<int64_t>(blockIdx.y) * cols + c;
      if (l1_part != nullptr) l1_part[o] = sa;
      if (l2_part != nullptr) l2_part[o] = sb;
    }
    __syncthreads();  // s1/s2 are rewritten by the next tile
  }
}

// out[c] = sum over chunks of part[chunk * cols + c], in chunk order.
__global__ void __launch_bounds__(kThreads)
    ColumnFinalizeKernel(const float* __restrict__ part, int64_t chunks, int64_t cols,
                         float* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
       c += stride) {
    float s = 0.0f;
    for (int64_t k = 0; k < chunks; ++k) s += part[k * cols + c];
    out[c] = s;
  }
}

// ----------------------------------------------------------------------------------------------
// TopK.

// An unsigned key whose ascending order is the scores' order: NaN (any payload) is 0, below
// -inf; -0 is +0 so that zeros tie (and fall back to index order) as they compare equal.
__device__ __forceinline__ uint32_t OrderedKey(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0u;
  if (u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kThreads)
    TopKKeysKernel(const float* __restrict__ scores, int64_t n, uint32_t* __restrict__ keys,
                   uint64_t* __restrict__ vals) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    keys[i] = OrderedKey(scores[i]);
    vals[i] = static_cast<uint64_t>(i);
  }
}

__global__ void __launch_bounds__(kThreads) IotaKernel(int64_t* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = i;
  }
}

// ----------------------------------------------------------------------------------------------
// Column gather / scatter over the flat index t = r * k + j of the [rows, k] buffer: consecutive
// threads write (gather) or read (scatter) consecutive elements of it. I is uint32_t when every
// index fits (the division is cheaper), else int64_t.

// Elements as stored: uint16_t for bf16, uint32_t for fp32 (bits: an equal-type move copies them
// exactly). Convert<S, D>: bf16 widened exactly into fp32, fp32 rounded to nearest even into bf16
// (Bf16ToF / FToBf16).
template <typename S, typename D>
__device__ __forceinline__ D Convert(S x) {
  if constexpr (std::is_same<S, D>::value) {
    return x;
  } else if constexpr (std::is_same<S, uint16_t>::value) {
    return static_cast<uint32_t>(x) << 16;
  } else {
    return static_cast<uint16_t>(FToBf16(__uint_as_float(x)));
  }
}

template <typename S, typename D, typename I>
__global__ void __launch_bounds__(kThreads)
    GatherKernel(const S* __restrict__ src, I ld, const int64_t* __restrict__ idx, I k, I total,
                 D* __restrict__ dst) {
  const I stride = static_cast<I>(gridDim.x) * static_cast<I>(blockDim.x);
  for (I t = static_cast<I>(blockIdx.x) * static_cast<I>(blockDim.x) + threadIdx.x; t < total;
       t += stride) {
    const I r = t / k;
    const I j = t - r * k;
    dst[t] = Convert<S, D>(src[r * ld + static_cast<I>(idx[j])]);
  }
}

template <typename S, typename D, typename I>
__global__ void __launch_bounds__(kThreads)
    ScatterKernel(const S* __restrict__ src, I ld, const int64_t* __restrict__ idx, I k, I total,
                  D* __restrict__ dst) {
  const I stride = static_cast<I>(gridDim.x) * static_cast<I>(blockDim.x);
  for (I t = static_cast<I>(blockIdx.x) * static_cast<I>(blockDim.x) + threadIdx.x; t < total;
       t += stride) {
    const I r = t / k;
    const I j = t - r * k;
    dst[r * ld + static_cast<I>(idx[j])] = Convert<S, D>(src[t]);
  }
}

size_t AlignUp(size_t x) { return (x + 255) / 256 * 256; }

// ----------------------------------------------------------------------------------------------

class CudaOptimizerKernel final : public OptimizerKernel {
 public:
  CudaOptimizerKernel(cudaStream_t stream, int sm_count, bool memory_pools)
      : stream_(stream),
        sm_count_(std::max(1, sm_count)),
        max_blocks_(static_cast<int64_t>(sm_count_) * kBlocksPerSm),
        memory_pools_(memory_pools) {}

  ~CudaOptimizerKernel() override {
    std::lock_guard<std::mutex> lock(ws_mu_);
    FreeWorkspaceLocked();
    cudaStreamSynchronize(stream_);
  }

  const char* name() const override { return "cuda"; }

  void Accumulate(float* acc, const void* grad, GradType type, float scale, int64_t n,
                  AccumulateMode mode) const override {
    if (n <= 0) return;
    const bool over = mode == AccumulateMode::kOverwrite;
    const VecPlan plan = PlanVectors(n, {{acc, 4}, {grad, GradTypeSize(type)}});
    if (type == GradType::kBf16) {
      const auto* g = static_cast<const uint16_t*>(grad);
      if (over) {
        Launch("Accumulate", AccumulateOp<uint16_t, true>{acc, g, scale}, n, plan);
      } else {
        Launch("Accumulate", AccumulateOp<uint16_t, false>{acc, g, scale}, n, plan);
      }
    } else {
      const auto* g = static_cast<const float*>(grad);
      if (over) {
        Launch("Accumulate", AccumulateOp<float, true>{acc, g, scale}, n, plan);
      } else {
        Launch("Accumulate", AccumulateOp<float, false>{acc, g, scale}, n, plan);
      }
    }
  }

  void CopyOut(const ParamOut& out, const float* param, int64_t n) const {
    if (out.fp32 == nullptr || n <= 0) return;
    Check("cudaMemcpyAsync (fp32 output)",
          cudaMemcpyAsync(out.fp32, param, static_cast<size_t>(n) * sizeof(float),
                          cudaMemcpyDeviceToDevice, stream_));
  }

  // An fp32 output (ParamOut::fp32) is the parameter copied after the update (the daemon's CPU
  // kernels write it in the same pass; predict_out is theirs alone).
  void AdamW(const AdamWConfig& config, float* param, float* m, float* v, const void* grad,
             GradType type, int64_t n, ParamOut out) const override {
    AdamWTo(config, param, m, v, grad, type, n, out.bf16);
    CopyOut(out, param, n);
  }
  void AdamWTo(const AdamWConfig& config, float* param, float* m, float* v, const void* grad,
               GradType type, int64_t n, uint16_t* bf16_out) const {
    if (n <= 0) return;
    const AdamWConstants k = MakeAdamWConstants(config);
    const VecPlan plan =
        PlanVectors(n, {{param, 4}, {m, 4}, {v, 4}, {grad, GradTypeSize(type)}, {bf16_out, 2}});
    if (type == GradType::kBf16) {
      LaunchAdamW<uint16_t, GradSource::kGrad>(k, param, m, v, nullptr, grad, 1.0f, n, bf16_out,
                                               plan);
    } else {
      LaunchAdamW<float, GradSource::kGrad>(k, param, m, v, nullptr, grad, 1.0f, n, bf16_out, plan);
    }
  }

  void AdamWColumns(const AdamWConfig& config, const float* step_size, const float* bc2_sqrt,
                    float* param, float* m, float* v, const void* grad, GradType type,
                    int64_t rows, int64_t cols, ParamOut out) const override {
    AdamWColumnsTo(config, step_size, bc2_sqrt, param, m, v, grad, type, rows, cols, out.bf16);
    if (rows > 0 && cols > 0) CopyOut(out, param, rows * cols);
  }
  void AdamWColumnsTo(const AdamWConfig& config, const float* step_size, const float* bc2_sqrt,
                      float* param, float* m, float* v, const void* grad, GradType type,
                      int64_t rows, int64_t cols, uint16_t* bf16_out) const {
    if (rows < 0 || cols < 0) {
      Record("AdamWColumns: need rows >= 0 and cols >= 0");
      return;
    }
    if (rows == 0 || cols == 0) return;
    const AdamWConstants k = MakeAdamWConstants(config);  // its step_size, bc2_sqrt are unused
    const int64_t n = rows * cols;
    if (type == GradType::kBf16) {
      LaunchAdamWColumns(k, step_size, bc2_sqrt, param, m, v,
                         static_cast<const uint16_t*>(grad), n, cols, bf16_out);
    } else {
      LaunchAdamWColumns(k, step_size, bc2_sqrt, param, m, v, static_cast<const float*>(grad), n,
                         cols, bf16_out);
    }
  }

  // Not fused here: the accumulator is copied into the workspace (or overwritten there when acc
  // is null), the gradient accumulated into it and AdamWColumns run on it: the same two
  // kernels as Accumulate + AdamWColumns, so bit-identical to them, without writing acc.
  void AccumulateAdamWColumns(const AdamWConfig& config, const float* step_size,
                              const float* bc2_sqrt, float* param, float* m, float* v,
                              const float* acc, const void* grad, GradType type, float acc_scale,
                              int64_t rows, int64_t cols, ParamOut out) const override {
    if (rows < 0 || cols < 0) {
      Record("AccumulateAdamWColumns: need rows >= 0 and cols >= 0");
      return;
    }
    if (rows == 0 || cols == 0) return;
    const int64_t n = rows * cols;
    const size_t bytes = static_cast<size_t>(n) * sizeof(float);
    // Held until every use of the workspace is enqueued (stream order protects the rest).
    std::lock_guard<std::mutex> lock(ws_mu_);
    float* sum = static_cast<float*>(WorkspaceLocked(AlignUp(bytes)));
    if (sum == nullptr) return;
    if (acc != nullptr &&
        !Check("cudaMemcpyAsync (AccumulateAdamWColumns)",
               cudaMemcpyAsync(sum, acc, bytes, cudaMemcpyDeviceToDevice, stream_)))
      return;
    Accumulate(sum, grad, type, acc_scale, n,
               acc == nullptr ? AccumulateMode::kOverwrite : AccumulateMode::kAdd);
    AdamWColumns(config, step_size, bc2_sqrt, param, m, v, sum, GradType::kFp32, rows, cols, out);
  }

  void AccumulateAdamW(const AdamWConfig& config, float* param, float* m, float* v,
                       const float* acc, const void* grad, GradType type, float acc_scale,
                       int64_t n, ParamOut out) const override {
    AccumulateAdamWTo(config, param, m, v, acc, grad, type, acc_scale, n, out.bf16);
    CopyOut(out, param, n);
  }
  void AccumulateAdamWTo(const AdamWConfig& config, float* param, float* m, float* v,
                         const float* acc, const void* grad, GradType type, float acc_scale,
                         int64_t n, uint16_t* bf16_out) const {
    if (n <= 0) return;
    const AdamWConstants k = MakeAdamWConstants(config);
    const VecPlan plan = PlanVectors(
        n, {{param, 4}, {m, 4}, {v, 4}, {acc, 4}, {grad, GradTypeSize(type)}, {bf16_out, 2}});
    if (grad == nullptr) {
      LaunchAdamW<float, GradSource::kAcc>(k, param, m, v, acc, nullptr, acc_scale, n, bf16_out,
                                           plan);
    } else if (type == GradType::kBf16) {
      LaunchAdamW<uint16_t, GradSource::kAccGrad>(k, param, m, v, acc, grad, acc_scale, n, bf16_out,
                                                  plan);
    } else {
      LaunchAdamW<float, GradSource::kAccGrad>(k, param, m, v, acc, grad, acc_scale, n, bf16_out,
                                               plan);
    }
  }

  void FloatToBf16(const float* src, uint16_t* dst, int64_t n) const override {
    if (n <= 0) return;
    Launch("FloatToBf16", ToBf16Op{src, dst}, n, PlanVectors(n, {{src, 4}, {dst, 2}}));
  }

  void Bf16ToFloat(const uint16_t* src, float* dst, int64_t n) const override {
    if (n <= 0) return;
    Launch("Bf16ToFloat", FromBf16Op{src, dst}, n, PlanVectors(n, {{src, 2}, {dst, 4}}));
  }

  void ColumnScores(const void* grad, GradType type, int64_t rows, int64_t cols, int64_t ld,
                    float* l1, float* l2sq) const override {
    if (rows < 0 || cols < 0 || ld < cols) {
      Record("ColumnScores: need rows >= 0, cols >= 0 and ld >= cols");
      return;
    }
    if (cols == 0 || (l1 == nullptr && l2sq == nullptr)) return;
    if (rows == 0) {  // empty sums: 0.0f is all zero bytes
      const size_t bytes = static_cast<size_t>(cols) * sizeof(float);
      if (l1 != nullptr) Check("cudaMemsetAsync", cudaMemsetAsync(l1, 0, bytes, stream_));
      if (l2sq != nullptr) Check("cudaMemsetAsync", cudaMemsetAsync(l2sq, 0, bytes, stream_));
      return;
    }
    // Enough (column tile, row chunk) blocks for one full wave; row chunks only as needed.
    const int64_t col_tiles = (cols + kColTile - 1) / kColTile;
    const int64_t grid_x = std::min<int64_t>(col_tiles, 1 << 20);
    const int64_t chunks_wanted = std::max<int64_t>(1, (max_blocks_ + grid_x - 1) / grid_x);
    const int64_t rows_per_chunk =
        std::max<int64_t>(kMinChunkRows, (rows + chunks_wanted - 1) / chunks_wanted);
    const int64_t chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;  // <= chunks_wanted
    const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(chunks));
    const dim3 block(kColTile, kRowLanes);

    if (chunks == 1) {  // one chunk: the partial sums are the answer
      LaunchColumnPartial(grad, type, rows, cols, ld, rows_per_chunk, l1, l2sq, grid, block);
      return;
    }
    std::lock_guard<std::mutex> lock(ws_mu_);
    const size_t part_bytes = AlignUp(static_cast<size_t>(chunks * cols) * sizeof(float));
    char* ws = static_cast<char*>(WorkspaceLocked(2 * part_bytes));
    if (ws == nullptr) return;
    float* p1 = l1 != nullptr ? reinterpret_cast<float*>(ws) : nullptr;
    float* p2 = l2sq != nullptr ? reinterpret_cast<float*>(ws + part_bytes) : nullptr;
    LaunchColumnPartial(grad, type, rows, cols, ld, rows_per_chunk, p1, p2, grid, block);
    const unsigned fin_blocks = Blocks(cols);
    if (p1 != nullptr) {
      ColumnFinalizeKernel<<<fin_blocks, kThreads, 0, stream_>>>(p1, chunks, cols, l1);
      CheckLaunch("ColumnFinalizeKernel");
    }
    if (p2 != nullptr) {
      ColumnFinalizeKernel<<<fin_blocks, kThreads, 0, stream_>>>(p2, chunks, cols, l2sq);
      CheckLaunch("ColumnFinalizeKernel");
    }
  }

  void TopK(const float* scores, int64_t n, int64_t k, int64_t* indices) const override {
    if (n < 0 || k < 0 || k > n) {
      Record("TopK: need 0 <= k <= n");
      return;
    }
    if (k == 0) return;
    if (k == n) {  // every index, already in increasing order
      IotaKernel<<<Blocks(n), kThreads, 0, stream_>>>(indices, n);
      CheckLaunch("IotaKernel");
      return;
    }
    // Bits that distinguish the indices 0 .. n-1 (n >= 2 here): fewer radix passes.
    const int index_bits = 64 - __builtin_clzll(static_cast<unsigned long long>(n - 1));
    auto* out = reinterpret_cast<uint64_t*>(indices);  // indices are non-negative

    // Workspace: keys[2][n] (uint32), vals[2][n] (uint64), CUB temporary storage.
    size_t sort_temp = 0, select_temp = 0;
    {
      cub::DoubleBuffer<uint32_t> keys(nullptr, nullptr);
      cub::DoubleBuffer<uint64_t> vals(nullptr, nullptr);
      if (!Check("cub::DeviceRadixSort::SortPairsDescending (size)",
                 cub::DeviceRadixSort::SortPairsDescending(nullptr, sort_temp, keys, vals, n, 0, 32,
                                                           stream_)) ||
          !Check("cub::DeviceRadixSort::SortKeys (size)",
                 cub::DeviceRadixSort::SortKeys(
                     nullptr, select_temp, static_cast<const uint64_t*>(nullptr),
                     static_cast<uint64_t*>(nullptr), k, 0, index_bits, stream_))) {
        return;
      }
    }
    const size_t key_bytes = AlignUp(static_cast<size_t>(n) * sizeof(uint32_t));
    const size_t val_bytes = AlignUp(static_cast<size_t>(n) * sizeof(uint64_t));
    size_t temp_bytes = AlignUp(std::max<size_t>(std::max(sort_temp, select_temp), 1));

    std::lock_guard<std::mutex> lock(ws_mu_);
    char* ws = static_cast<char*>(WorkspaceLocked(2 * key_bytes + 2 * val_bytes + temp_bytes));
    if (ws == nullptr) return;
    auto* k0 = reinterpret_cast<uint32_t*>(ws);
    auto* k1 = reinterpret_cast<uint32_t*>(ws + key_bytes);
    auto* v0 = reinterpret_cast<uint64_t*>(ws + 2 * key_bytes);
    auto* v1 = reinterpret_cast<uint64_t*>(ws + 2 * key_bytes + val_bytes);
    void* temp = ws + 2 * key_bytes + 2 * val_bytes;

    TopKKeysKernel<<<Blocks(n), kThreads, 0, stream_>>>(scores, n, k0, v0);
    if (!CheckLaunch("TopKKeysKernel")) return;
    // Stable: equal keys keep index order, so ties go to the lower index.
    cub::DoubleBuffer<uint32_t> keys(k0, k1);
    cub::DoubleBuffer<uint64_t> vals(v0, v1);
    if (!Check("cub::DeviceRadixSort::SortPairsDescending",
               cub::DeviceRadixSort::SortPairsDescending(temp, temp_bytes, keys, vals, n, 0, 32,
                                                         stream_))) {
      return;
    }
    // The k best, in increasing index order.
    size_t select_bytes = temp_bytes;
    Check("cub::DeviceRadixSort::SortKeys",
          cub::DeviceRadixSort::SortKeys(temp, select_bytes,
                                         static_cast<const uint64_t*>(vals.Current()), out, k, 0,
                                         index_bits, stream_));
  }

  void GatherColumns(const void* src, size_t elem_size, int64_t rows, int64_t ld,
                     const int64_t* idx, int64_t k, void* dst) const override {
    if (!CheckElemSize(elem_size)) return;
    Columns(/*gather=*/true, ElemType(elem_size), src, rows, ld, idx, k, ElemType(elem_size), dst);
  }

  void ScatterColumns(const void* src, size_t elem_size, int64_t rows, int64_t ld,
                      const int64_t* idx, int64_t k, void* dst) const override {
    if (!CheckElemSize(elem_size)) return;
    Columns(/*gather=*/false, ElemType(elem_size), src, rows, ld, idx, k, ElemType(elem_size),
            dst);
  }

  void GatherColumnsAs(GradType st, const void* src, int64_t rows, int64_t ld, const int64_t* idx,
                       int64_t k, GradType dt, void* dst) const override {
    Columns(/*gather=*/true, st, src, rows, ld, idx, k, dt, dst);
  }

  void ScatterColumnsAs(GradType st, const void* src, int64_t rows, int64_t ld,
                        const int64_t* idx, int64_t k, GradType dt, void* dst) const override {
    Columns(/*gather=*/false, st, src, rows, ld, idx, k, dt, dst);
  }

  std::string Synchronize() const override {
    const cudaError_t e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) Record(CudaErr("cudaStreamSynchronize", e));
    std::lock_guard<std::mutex> lock(err_mu_);
    std::string err;
    err.swap(first_error_);  // reported once; later calls start clean
    return err;
  }

  std::string StreamPattern(const float* const* in, int num_in, float* const* out, int num_out,
                            int64_t n) const {
    if (num_in < 1 || num_in > 4 || num_out < 1 || num_out > 4 || n < 0) {
      return "LaunchStreamPattern: need 1..4 inputs and outputs and n >= 0";
    }
    if (n == 0) return "";
    // Only the patterns the benchmark uses are instantiated.
    StreamOp<4, 3> op43{};
    StreamOp<1, 1> op11{};
    for (int a = 0; a < num_in; ++a) op43.in[a] = op11.in[a] = in[a];
    for (int a = 0; a < num_out; ++a) op43.out[a] = op11.out[a] = out[a];
    if (num_in == 4 && num_out == 3) {
      Launch("StreamPattern", op43, n,
             PlanVectors(n, {{in[0], 4},
                             {in[1], 4},
                             {in[2], 4},
                             {in[3], 4},
                             {out[0], 4},
                             {out[1], 4},
                             {out[2], 4}}));
    } else if (num_in == 1 && num_out == 1) {
      Launch("StreamPattern", op11, n, PlanVectors(n, {{in[0], 4}, {out[0], 4}}));
    } else {
      return "LaunchStreamPattern: only 4 in / 3 out and 1 in / 1 out are built";
    }
    std::lock_guard<std::mutex> lock(err_mu_);
    return first_error_;  // the launch error, if any; no wait
  }

 private:
  // Blocks for `items` grid-stride work items, at most `cap`.
  static unsigned BlocksFor(int64_t items, int64_t cap) {
    const int64_t b = (items + kThreads - 1) / kThreads;
    return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(b, cap)));
  }
  unsigned Blocks(int64_t items) const { return BlocksFor(items, max_blocks_); }

  template <typename Op>
  void Launch(const char* name, const Op& op, int64_t n, const VecPlan& plan) const {
    const int64_t rest = n - 4 * plan.nvec;
    const int64_t cap = static_cast<int64_t>(sm_count_) * ResidentBlocksPerSm<Op>();
    ElementwiseKernel<Op><<<BlocksFor(std::max(plan.nvec, rest), cap), kThreads, 0, stream_>>>(
        op, plan.head, plan.nvec, rest);
    CheckLaunch(name);
  }

  template <typename G, GradSource kSource>
  void LaunchAdamW(const AdamWConstants& k, float* p, float* m, float* v, const float* acc,
                   const void* grad, float acc_scale, int64_t n, uint16_t* out,
                   const VecPlan& plan) const {
    const G* g = static_cast<const G*>(grad);
    if (out != nullptr) {
      Launch("AdamW", AdamWOp<G, kSource, true>{k, p, m, v, acc, g, acc_scale, out}, n, plan);
    } else {
      Launch("AdamW", AdamWOp<G, kSource, false>{k, p, m, v, acc, g, acc_scale, nullptr}, n, plan);
    }
  }

  template <typename G>
  void LaunchAdamWColumns(const AdamWConstants& k, const float* step_size, const float* bc2_sqrt,
                          float* p, float* m, float* v, const G* g, int64_t n, int64_t cols,
                          uint16_t* out) const {
    const unsigned blocks = Blocks(n);
    if (out != nullptr) {
      AdamWColumnsKernel<G, true><<<blocks, kThreads, 0, stream_>>>(k, step_size, bc2_sqrt, p, m,
                                                                     v, g, out, n, cols);
    } else {
      AdamWColumnsKernel<G, false><<<blocks, kThreads, 0, stream_>>>(k, step_size, bc2_sqrt, p, m,
                                                                      v, g, nullptr, n, cols);
    }
    CheckLaunch("AdamWColumnsKernel");
  }

  void LaunchColumnPartial(const void* grad, GradType type, int64_t rows, int64_t cols, int64_t ld,
                           int64_t rows_per_chunk, float* p1, float* p2, dim3 grid,
                           dim3 block) const {
    if (type == GradType::kBf16) {
      ColumnPartialKernel<uint16_t><<<grid, block, 0, stream_>>>(
          static_cast<const uint16_t*>(grad), rows, cols, ld, rows_per_chunk, p1, p2);
    } else {
      ColumnPartialKernel<float><<<grid, block, 0, stream_>>>(static_cast<const float*>(grad), rows,
                                                              cols, ld, rows_per_chunk, p1, p2);
    }
    CheckLaunch("ColumnPartialKernel");
  }

  static GradType ElemType(size_t elem_size) {
    return elem_size == 2 ? GradType::kBf16 : GradType::kFp32;
  }
  bool CheckElemSize(size_t elem_size) const {
    if (elem_size == 2 || elem_size == 4) return true;
    Record("GatherColumns/ScatterColumns: elem_size must be 2 or 4, got " +
           std::to_string(elem_size));
    return false;
  }

  // Every column move: st / dt the element types of src / dst.
  void Columns(bool gather, GradType st, const void* src, int64_t rows, int64_t ld,
               const int64_t* idx, int64_t k, GradType dt, void* dst) const {
    if (rows < 0 || k < 0 || ld < 0) {
      Record("column gather / scatter: negative rows, ld or k");
      return;
    }
    if (rows == 0 || k == 0) return;
    const int64_t total = rows * k;
    const unsigned blocks = Blocks(total);
    // 32-bit index arithmetic when t + stride and r * ld + idx stay below 2^31 (idx < ld).
    const bool narrow = rows * ld < (int64_t{1} << 31) && total < (int64_t{1} << 31);
    if (narrow) {
      LaunchColumns<uint32_t>(gather, st, src, ld, idx, k, total, dt, dst, blocks);
    } else {
      LaunchColumns<int64_t>(gather, st, src, ld, idx, k, total, dt, dst, blocks);
    }
  }

  template <typename I>
  void LaunchColumns(bool gather, GradType st, const void* src, int64_t ld, const int64_t* idx,
                     int64_t k, int64_t total, GradType dt, void* dst, unsigned blocks) const {
    const bool s16 = st == GradType::kBf16, d16 = dt == GradType::kBf16;
    if (s16 && d16) {
      LaunchColumnsT<uint16_t, uint16_t, I>(gather, src, ld, idx, k, total, dst, blocks);
    } else if (s16) {
      LaunchColumnsT<uint16_t, uint32_t, I>(gather, src, ld, idx, k, total, dst, blocks);
    } else if (d16) {
      LaunchColumnsT<uint32_t, uint16_t, I>(gather, src, ld, idx, k, total, dst, blocks);
    } else {
      LaunchColumnsT<uint32_t, uint32_t, I>(gather, src, ld, idx, k, total, dst, blocks);
    }
  }

  template <typename S, typename D, typename I>
  void LaunchColumnsT(bool gather, const void* src, int64_t ld, const int64_t* idx, int64_t k,
                      int64_t total, void* dst, unsigned blocks) const {
    if (gather) {
      GatherKernel<S, D, I><<<blocks, kThreads, 0, stream_>>>(
          static_cast<const S*>(src), static_cast<I>(ld), idx, static_cast<I>(k),
          static_cast<I>(total), static_cast<D*>(dst));
      CheckLaunch("GatherKernel");
    } else {
      ScatterKernel<S, D, I><<<blocks, kThreads, 0, stream_>>>(
          static_cast<const S*>(src), static_cast<I>(ld), idx, static_cast<I>(k),
          static_cast<I>(total), static_cast<D*>(dst));
      CheckLaunch("ScatterKernel");
    }
  }

  // The workspace, grown to at least `bytes`; ws_mu_ must be held for as long as the caller
  // enqueues work that uses it. Stream-ordered allocation: a buffer freed here is released only
  // after the work already enqueued on the stream (which may still use it) has run.
  // Without memory pools (cudaMallocAsync unsupported), the old buffer is freed only after the
  // stream has drained.
  void* WorkspaceLocked(size_t bytes) const {
    if (bytes <= ws_bytes_) return ws_;
    const size_t grown = std::max(bytes, ws_bytes_ + ws_bytes_ / 2);  // amortise regrowth
    FreeWorkspaceLocked();
    const cudaError_t e =
        memory_pools_ ? cudaMallocAsync(&ws_, grown, stream_) : cudaMalloc(&ws_, grown);
    if (!Check("cudaMalloc(Async) (workspace)", e)) {
      ws_ = nullptr;
      return nullptr;
    }
    ws_bytes_ = grown;
    return ws_;
  }
  void FreeWorkspaceLocked() const {
    if (ws_ != nullptr) {
      if (memory_pools_) {
        Check("cudaFreeAsync", cudaFreeAsync(ws_, stream_));
      } else {
        Check("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
        Check("cudaFree", cudaFree(ws_));
      }
    }
    ws_ = nullptr;
    ws_bytes_ = 0;
  }

  void Record(const std::string& error) const {
    std::lock_guard<std::mutex> lock(err_mu_);
    if (first_error_.empty()) first_error_ = error;
  }
  bool Check(const char* what, cudaError_t e) const {
    if (e == cudaSuccess) return true;
    Record(CudaErr(what, e));
    return false;
  }
  bool CheckLaunch(const char* kernel) const { return Check(kernel, cudaGetLastError()); }

  const cudaStream_t stream_;
  const int sm_count_;
  const int64_t max_blocks_;  // one wave of 256-thread blocks at full occupancy
  const bool memory_pools_;   // cudaMallocAsync / cudaFreeAsync available

  mutable std::mutex err_mu_;
  mutable std::string first_error_;  // guarded by err_mu_

  mutable std::mutex ws_mu_;
  mutable void* ws_ = nullptr;  // guarded by ws_mu_
  mutable size_t ws_bytes_ = 0;
};

}  // namespace

std::unique_ptr<OptimizerKernel> NewCudaOptimizerKernel(void* stream, std::string* error) {
  if (!DeviceAvailable(error)) return nullptr;
  int device = 0, sm_count = 0, pools = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  }
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device);
  }
  if (e != cudaSuccess) {
    *error = CudaErr("cudaDeviceGetAttribute", e);
    return nullptr;
  }
  return std::make_unique<CudaOptimizerKernel>(static_cast<cudaStream_t>(stream), sm_count,
                                               pools != 0);
}

std::string LaunchStreamPattern(void* stream, const float* const* in, int num_in, float* const* out,
                                int num_out, int64_t n) {
  std::string error;
  std::unique_ptr<OptimizerKernel> kernel = NewCudaOptimizerKernel(stream, &error);
  if (kernel == nullptr) return error;
  return static_cast<CudaOptimizerKernel*>(kernel.get())
      ->StreamPattern(in, num_in, out, num_out, n);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace stallfree
