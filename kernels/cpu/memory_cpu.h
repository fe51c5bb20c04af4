// The CPU backend's memory (kernels/memory.h): host memory through operator new, plain copies.
// A mixin, so that CpuMemory() and the CPU transformer ops (ops_cpu.cc) share one
// implementation: CpuMemoryOf<BackendMemory> alone needs no BLAS.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>

#include "kernels/memory.h"

namespace stallfree {
namespace kernels {

template <typename Base>
class CpuMemoryOf : public Base {
 public:
  float* AllocFloats(int64_t n) const override {
    if (n <= 0) return nullptr;
    // Through operator new, like the std::vector buffers elsewhere, so heap accounting (the
    // peak-memory figures of bench/tsp_bench) sees these buffers too.
    return new (std::nothrow) float[static_cast<size_t>(n)]();
  }

  void Free(void* p) const override { delete[] static_cast<float*>(p); }

  void CopyFloats(float* dst, const float* src, int64_t n) const override {
    if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  }

  void Fill(float* dst, int64_t n, float value) const override {
    if (n > 0) std::fill(dst, dst + n, value);
  }

  void Upload(float* dst_backend, const float* src_host, int64_t n) const override {
    CopyFloats(dst_backend, src_host, n);
  }

  void Download(float* dst_host, const float* src_backend, int64_t n) const override {
    CopyFloats(dst_host, src_backend, n);
  }

  void Copy2D(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows,
              int64_t cols) const override {
    if (rows <= 0 || cols <= 0) return;
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(dst + i * dst_ld, src + i * src_ld, static_cast<size_t>(cols) * sizeof(float));
    }
  }
};

}  // namespace kernels
}  // namespace stallfree
