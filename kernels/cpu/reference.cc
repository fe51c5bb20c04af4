// Scalar reference implementations: the oracle for every fast backend.
#include <cmath>

#include "common/bf16.h"
#include "kernels/optimizer.h"

namespace stallfree {
namespace kernels {
namespace {

inline float LoadGrad(const void* grad, GradType type, int64_t i) {
  if (type == GradType::kBf16) return stallfree::Bf16ToFloat(static_cast<const uint16_t*>(grad)[i]);
  return static_cast<const float*>(grad)[i];
}

class ScalarKernel final : public OptimizerKernel {
 public:
  const char* name() const override { return "scalar-reference"; }

  void Accumulate(float* acc, const void* grad, GradType type, float scale,
                  int64_t n) const override {
    // One loop per dtype, so the compiler can vectorise each (the issue after this one brings
    // the explicit SIMD kernels).
    if (type == GradType::kFp32) {
      const float* g = static_cast<const float*>(grad);
      for (int64_t i = 0; i < n; ++i) acc[i] += scale * g[i];
    } else {
      const uint16_t* g = static_cast<const uint16_t*>(grad);
      for (int64_t i = 0; i < n; ++i) acc[i] += scale * stallfree::Bf16ToFloat(g[i]);
    }
  }

  void AdamW(const AdamWConfig& c, float* param, float* m, float* v, const void* grad,
             GradType type, int64_t n, uint16_t* bf16_out) const override {
    const double t = static_cast<double>(c.step);
    const double bc1 = 1.0 - std::pow(c.beta1, t);
    const double bc2 = 1.0 - std::pow(c.beta2, t);
    const float step_size = static_cast<float>(c.lr / bc1);
    const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    const float decay = static_cast<float>(1.0 - c.lr * c.weight_decay);
    const float b1 = static_cast<float>(c.beta1), omb1 = static_cast<float>(1.0 - c.beta1);
    const float b2 = static_cast<float>(c.beta2), omb2 = static_cast<float>(1.0 - c.beta2);
    const float eps = static_cast<float>(c.eps);
    for (int64_t i = 0; i < n; ++i) {
      const float g = c.grad_scale * LoadGrad(grad, type, i);
      float p = param[i] * decay;
      const float mi = b1 * m[i] + omb1 * g;
      const float vi = b2 * v[i] + omb2 * g * g;
      const float denom = std::sqrt(vi) / bc2_sqrt + eps;
      p -= step_size * (mi / denom);
      m[i] = mi;
      v[i] = vi;
      param[i] = p;
      if (bf16_out != nullptr) bf16_out[i] = stallfree::FloatToBf16(p);
    }
  }

  void FloatToBf16(const float* src, uint16_t* dst, int64_t n) const override {
    for (int64_t i = 0; i < n; ++i) dst[i] = stallfree::FloatToBf16(src[i]);
  }
  void Bf16ToFloat(const uint16_t* src, float* dst, int64_t n) const override {
    for (int64_t i = 0; i < n; ++i) dst[i] = stallfree::Bf16ToFloat(src[i]);
  }
};

}  // namespace

const OptimizerKernel& ReferenceKernel() {
  static const ScalarKernel* kernel = new ScalarKernel();
  return *kernel;
}

const OptimizerKernel& DefaultCpuKernel() { return ReferenceKernel(); }

}  // namespace kernels
}  // namespace stallfree
