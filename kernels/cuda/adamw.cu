// AdamW as a CUDA kernel: one grid-stride pass over p, m, v, g (math as in optimizer.h).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/optimizer_cuda.h"

namespace stallfree {
namespace kernels {
namespace cuda {
namespace {

std::string Err(const char* call, cudaError_t e) {
  return std::string(call) + " failed: " + cudaGetErrorString(e);
}

__device__ __forceinline__ float LoadGrad(const void* g, bool bf16, int64_t i) {
  if (bf16) return __bfloat162float(static_cast<const __nv_bfloat16*>(g)[i]);
  return static_cast<const float*>(g)[i];
}

__global__ void AdamWKernel(float b1, float omb1, float b2, float omb2, float eps, float decay, float step_size,
                            float bc2_sqrt, float scale, float* __restrict__ p,
                            float* __restrict__ m, float* __restrict__ v,
                            const void* __restrict__ g, bool bf16, int64_t n,
                            __nv_bfloat16* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gi = scale * LoadGrad(g, bf16, i);
    float pi = p[i] * decay;
    const float mi = b1 * m[i] + omb1 * gi;
    const float vi = b2 * v[i] + omb2 * gi * gi;
    // IEEE sqrt and division, as the CPU oracle, so results agree to rounding.
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
    pi = __fsub_rn(pi, __fmul_rn(step_size, __fdiv_rn(mi, denom)));
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    if (out != nullptr) out[i] = __float2bfloat16_rn(pi);
  }
}

}  // namespace

bool DeviceAvailable(std::string* why) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    *why = Err("cudaGetDeviceCount", e);
    return false;
  }
  if (count == 0) {
    *why = "no CUDA device present";
    return false;
  }
  return true;
}

std::string LaunchAdamW(const AdamWConfig& c, float* param, float* m, float* v, const void* grad,
                        GradType type, int64_t n, uint16_t* bf16_out, void* stream) {
  if (n <= 0) return "";
  const double t = static_cast<double>(c.step);
  const double bc1 = 1.0 - std::pow(c.beta1, t);
  const double bc2 = 1.0 - std::pow(c.beta2, t);
  const int threads = 256;
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks > 65536) blocks = 65536;
  AdamWKernel<<<static_cast<unsigned>(blocks), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      (float)c.beta1, (float)(1.0 - c.beta1), (float)c.beta2, (float)(1.0 - c.beta2),
      (float)c.eps, (float)(1.0 - c.lr * c.weight_decay), (float)(c.lr / bc1),
      (float)std::sqrt(bc2),
      c.grad_scale, param, m, v, grad, type == GradType::kBf16, n,
      reinterpret_cast<__nv_bfloat16*>(bf16_out));
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : Err("AdamWKernel launch", e);
}

std::string AdamWHost(const AdamWConfig& c, float* param, float* m, float* v, const float* grad,
                      int64_t n, uint16_t* bf16_out) {
  float *dp = nullptr, *dm = nullptr, *dv = nullptr, *dg = nullptr;
  uint16_t* db = nullptr;
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  std::string err;
  cudaError_t e;
#define SF_CUDA(call)                      \
  if (err.empty() && (e = (call)) != cudaSuccess) err = Err(#call, e)
  SF_CUDA(cudaMalloc(&dp, bytes));
  SF_CUDA(cudaMalloc(&dm, bytes));
  SF_CUDA(cudaMalloc(&dv, bytes));
  SF_CUDA(cudaMalloc(&dg, bytes));
  if (bf16_out != nullptr) SF_CUDA(cudaMalloc(&db, n * sizeof(uint16_t)));
  SF_CUDA(cudaMemcpy(dp, param, bytes, cudaMemcpyHostToDevice));
  SF_CUDA(cudaMemcpy(dm, m, bytes, cudaMemcpyHostToDevice));
  SF_CUDA(cudaMemcpy(dv, v, bytes, cudaMemcpyHostToDevice));
  SF_CUDA(cudaMemcpy(dg, grad, bytes, cudaMemcpyHostToDevice));
  if (err.empty()) err = LaunchAdamW(c, dp, dm, dv, dg, GradType::kFp32, n, db, nullptr);
  SF_CUDA(cudaDeviceSynchronize());
  SF_CUDA(cudaMemcpy(param, dp, bytes, cudaMemcpyDeviceToHost));
  SF_CUDA(cudaMemcpy(m, dm, bytes, cudaMemcpyDeviceToHost));
  SF_CUDA(cudaMemcpy(v, dv, bytes, cudaMemcpyDeviceToHost));
  if (bf16_out != nullptr) SF_CUDA(cudaMemcpy(bf16_out, db, n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
#undef SF_CUDA
  cudaFree(dp);
  cudaFree(dm);
  cudaFree(dv);
  cudaFree(dg);
  cudaFree(db);
  return err;
}

}  // namespace cuda
}  // namespace kernels
}  // namespace stallfree
