// Scalar reference implementations: the oracle for every fast backend. Serial, one element at a
// time, written for clarity; never used by the daemon unless forced (STALLFREE_CPU_KERNEL).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/bf16.h"
#include "kernels/optimizer.h"

namespace stallfree {
namespace kernels {

AdamWConstants MakeAdamWConstants(const AdamWConfig& c) {
  const double t = static_cast<double>(c.step);
  const double bc1 = 1.0 - std::pow(c.beta1, t);
  const double bc2 = 1.0 - std::pow(c.beta2, t);
  AdamWConstants k;
  k.b1 = static_cast<float>(c.beta1);
  k.omb1 = static_cast<float>(1.0 - c.beta1);
  k.b2 = static_cast<float>(c.beta2);
  k.omb2 = static_cast<float>(1.0 - c.beta2);
  k.eps = static_cast<float>(c.eps);
  k.decay = static_cast<float>(1.0 - c.lr * c.weight_decay);
  k.step_size = static_cast<float>(c.lr / bc1);
  k.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  k.grad_scale = c.grad_scale;
  k.predict_out = c.predict_out;
  return k;
}

void MakeColumnConstants(const AdamWConfig& config, const int64_t* steps, int64_t cols,
                         float* step_size, float* bc2_sqrt) {
  // Through MakeAdamWConstants itself, so the two can never drift apart.
  AdamWConfig one = config;
  for (int64_t c = 0; c < cols; ++c) {
    one.step = steps[c];
    const AdamWConstants k = MakeAdamWConstants(one);
    step_size[c] = k.step_size;
    bc2_sqrt[c] = k.bc2_sqrt;
  }
}

void OptimizerKernel::AccumulateAdamWColumns(const AdamWConfig& config, const float* step_size,
                                             const float* bc2_sqrt, float* param, float* m,
                                             float* v, const float* acc, const void* grad,
                                             GradType type, float acc_scale, int64_t rows,
                                             int64_t cols, ParamOut out) const {
  if (rows <= 0 || cols <= 0) return;
  const int64_t n = rows * cols;
  std::vector<float> sum(static_cast<size_t>(n));
  if (acc != nullptr) std::copy_n(acc, n, sum.data());
  Accumulate(sum.data(), grad, type, acc_scale, n,
             acc == nullptr ? AccumulateMode::kOverwrite : AccumulateMode::kAdd);
  AdamWColumns(config, step_size, bc2_sqrt, param, m, v, sum.data(), GradType::kFp32, rows, cols,
               out);
}

namespace {
// One element of a converting column move: src[s] of src_type into dst[d] of dst_type.
void MoveElement(GradType src_type, const void* src, int64_t s, GradType dst_type, void* dst,
                 int64_t d) {
  if (src_type == dst_type) {
    if (src_type == GradType::kBf16)
      static_cast<uint16_t*>(dst)[d] = static_cast<const uint16_t*>(src)[s];
    else
      static_cast<uint32_t*>(dst)[d] = static_cast<const uint32_t*>(src)[s];
  } else if (src_type == GradType::kBf16) {
    static_cast<float*>(dst)[d] = stallfree::Bf16ToFloat(static_cast<const uint16_t*>(src)[s]);
  } else {
    static_cast<uint16_t*>(dst)[d] = stallfree::FloatToBf16(static_cast<const float*>(src)[s]);
  }
}
}  // namespace

void OptimizerKernel::GatherColumnsAs(GradType src_type, const void* src, int64_t rows,
                                      int64_t ld, const int64_t* idx, int64_t k,
                                      GradType dst_type, void* dst) const {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < k; ++j) MoveElement(src_type, src, r * ld + idx[j], dst_type, dst, r * k + j);
}

void OptimizerKernel::ScatterColumnsAs(GradType src_type, const void* src, int64_t rows,
                                       int64_t ld, const int64_t* idx, int64_t k,
                                       GradType dst_type, void* dst) const {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < k; ++j) MoveElement(src_type, src, r * k + j, dst_type, dst, r * ld + idx[j]);
}

namespace {

inline float LoadGrad(const void* grad, GradType type, int64_t i) {
  if (type == GradType::kBf16) return stallfree::Bf16ToFloat(static_cast<const uint16_t*>(grad)[i]);
  return static_cast<const float*>(grad)[i];
}

// One element of AdamW; g already scaled.
inline void AdamWElement(const AdamWConstants& k, float g, float* param, float* m, float* v,
                         ParamOut out) {
  const float old = *param;
  float p = old * k.decay;
  const float mi = k.b1 * *m + k.omb1 * g;
  const float vi = k.b2 * *v + k.omb2 * g * g;
  const float denom = std::sqrt(vi) / k.bc2_sqrt + k.eps;
  p -= k.step_size * (mi / denom);
  *m = mi;
  *v = vi;
  *param = p;
  const float shown = k.predict_out ? (p + p) - old : p;
  if (out.bf16 != nullptr) *out.bf16 = stallfree::FloatToBf16(shown);
  if (out.fp32 != nullptr) *out.fp32 = shown;
}

class ScalarKernel final : public OptimizerKernel {
 public:
  const char* name() const override { return "reference"; }

  void Accumulate(float* acc, const void* grad, GradType type, float scale, int64_t n,
                  AccumulateMode mode) const override {
    for (int64_t i = 0; i < n; ++i) {
      const float g = scale * LoadGrad(grad, type, i);
      acc[i] = mode == AccumulateMode::kOverwrite ? g : acc[i] + g;
    }
  }

  void AdamW(const AdamWConfig& c, float* param, float* m, float* v, const void* grad,
             GradType type, int64_t n, ParamOut out) const override {
    const AdamWConstants k = MakeAdamWConstants(c);
    for (int64_t i = 0; i < n; ++i) {
      AdamWElement(k, k.grad_scale * LoadGrad(grad, type, i), param + i, m + i, v + i,
                   out.At(i));
    }
  }

  void AdamWColumns(const AdamWConfig& c, const float* step_size, const float* bc2_sqrt,
                    float* param, float* m, float* v, const void* grad, GradType type,
                    int64_t rows, int64_t cols, ParamOut out) const override {
    AdamWConstants k = MakeAdamWConstants(c);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t col = 0; col < cols; ++col) {
        k.step_size = step_size[col];
        k.bc2_sqrt = bc2_sqrt[col];
        const int64_t i = r * cols + col;
        AdamWElement(k, k.grad_scale * LoadGrad(grad, type, i), param + i, m + i, v + i,
                     out.At(i));
      }
    }
  }

  void AccumulateAdamWColumns(const AdamWConfig& c, const float* step_size,
                              const float* bc2_sqrt, float* param, float* m, float* v,
                              const float* acc, const void* grad, GradType type, float acc_scale,
                              int64_t rows, int64_t cols, ParamOut out) const override {
    AdamWConstants k = MakeAdamWConstants(c);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t col = 0; col < cols; ++col) {
        k.step_size = step_size[col];
        k.bc2_sqrt = bc2_sqrt[col];
        const int64_t i = r * cols + col;
        // As Accumulate forms it: scale * grad, then added to the accumulator.
        const float scaled = acc_scale * LoadGrad(grad, type, i);
        const float sum = acc == nullptr ? scaled : acc[i] + scaled;
        AdamWElement(k, k.grad_scale * sum, param + i, m + i, v + i,
                     out.At(i));
      }
    }
  }

  void AccumulateAdamW(const AdamWConfig& c, float* param, float* m, float* v, const float* acc,
                       const void* grad, GradType type, float acc_scale, int64_t n,
                       ParamOut out) const override {
    const AdamWConstants k = MakeAdamWConstants(c);
    for (int64_t i = 0; i < n; ++i) {
      float sum = acc[i];
      if (grad != nullptr) sum = sum + acc_scale * LoadGrad(grad, type, i);
      AdamWElement(k, k.grad_scale * sum, param + i, m + i, v + i,
                   out.At(i));
    }
  }

  void FloatToBf16(const float* src, uint16_t* dst, int64_t n) const override {
    for (int64_t i = 0; i < n; ++i) dst[i] = stallfree::FloatToBf16(src[i]);
  }
  void Bf16ToFloat(const uint16_t* src, float* dst, int64_t n) const override {
    for (int64_t i = 0; i < n; ++i) dst[i] = stallfree::Bf16ToFloat(src[i]);
  }

  void ColumnScores(const void* grad, GradType type, int64_t rows, int64_t cols, int64_t ld,
                    float* l1, float* l2sq) const override {
    for (int64_t c = 0; c < cols; ++c) {
      float a = 0.0f, b = 0.0f;
      for (int64_t r = 0; r < rows; ++r) {
        const float x = LoadGrad(grad, type, r * ld + c);
        a += std::fabs(x);
        b += x * x;
      }
      if (l1 != nullptr) l1[c] = a;
      if (l2sq != nullptr) l2sq[c] = b;
    }
  }

  void TopK(const float* scores, int64_t n, int64_t k, int64_t* indices) const override {
    // Full stable sort by score, descending, NaN last: the plainest statement of the order.
    std::vector<int64_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [scores](int64_t a, int64_t b) {
      const float x = scores[a], y = scores[b];
      if (std::isnan(x) || std::isnan(y)) return !std::isnan(x) && std::isnan(y);
      return x > y;
    });
    order.resize(static_cast<size_t>(k));
    std::sort(order.begin(), order.end());
    std::copy(order.begin(), order.end(), indices);
  }

  void GatherColumns(const void* src, size_t elem_size, int64_t rows, int64_t ld,
                     const int64_t* idx, int64_t k, void* dst) const override {
    const char* s = static_cast<const char*>(src);
    char* d = static_cast<char*>(dst);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < k; ++j)
        std::copy_n(s + (r * ld + idx[j]) * elem_size, elem_size, d + (r * k + j) * elem_size);
  }

  void ScatterColumns(const void* src, size_t elem_size, int64_t rows, int64_t ld,
                      const int64_t* idx, int64_t k, void* dst) const override {
    const char* s = static_cast<const char*>(src);
    char* d = static_cast<char*>(dst);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < k; ++j)
        std::copy_n(s + (r * k + j) * elem_size, elem_size, d + (r * ld + idx[j]) * elem_size);
  }
};

}  // namespace

const OptimizerKernel& ReferenceKernel() {
  static const ScalarKernel* kernel = new ScalarKernel();
  return *kernel;
}

}  // namespace kernels
}  // namespace stallfree
