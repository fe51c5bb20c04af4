// The optimizer kernel interface: the math the daemon runs, device-neutral.
//
// Every backend implements OptimizerKernel over flat spans; callers split large tensors into
// chunks and may call a kernel concurrently on disjoint chunks (kernels are stateless and thread
// safe). ReferenceKernel() is the plain scalar oracle every faster backend is tested against.
//
// AdamW (decoupled weight decay, as torch.optim.AdamW), for step t >= 1 and g = scale * grad:
//   p <- p * (1 - lr * wd)
//   m <- b1 * m + (1 - b1) * g
//   v <- b2 * v + (1 - b2) * g^2
//   p <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// The bias corrections are computed in double from the int64 step, so they never saturate.
#pragma once

#include <cstdint>

namespace stallfree {
namespace kernels {

enum class GradType { kFp32, kBf16 };

struct AdamWConfig {
  // Hyper-parameters in double, as users write them (0.9, 0.999): the kernels derive the fp32
  // constants (beta, 1 - beta, lr * wd) from the double values, as PyTorch does.
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;        // t, >= 1.
  float grad_scale = 1.0f;  // multiplies the gradient (e.g. 1/accumulation count, unscaling).
};

class OptimizerKernel {
 public:
  virtual ~OptimizerKernel() = default;
  virtual const char* name() const = 0;

  // acc[i] += scale * grad[i] for i < n; grad is fp32 or bf16 per `type`.
  virtual void Accumulate(float* acc, const void* grad, GradType type, float scale,
                          int64_t n) const = 0;

  // One AdamW step over n elements. grad is fp32 or bf16 per `type`. If bf16_out is not null,
  // the new parameters are also written there as bf16 (round to nearest even).
  virtual void AdamW(const AdamWConfig& config, float* param, float* m, float* v,
                     const void* grad, GradType type, int64_t n, uint16_t* bf16_out) const = 0;

  // dst[i] = bf16(src[i]) and back.
  virtual void FloatToBf16(const float* src, uint16_t* dst, int64_t n) const = 0;
  virtual void Bf16ToFloat(const uint16_t* src, float* dst, int64_t n) const = 0;
};

// The scalar oracle.
const OptimizerKernel& ReferenceKernel();
// The kernel the daemon uses on this machine (currently the reference).
const OptimizerKernel& DefaultCpuKernel();

}  // namespace kernels
}  // namespace stallfree
