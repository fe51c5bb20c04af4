// The AdamW reference kernel against (a) the formula evaluated in double precision here, and
// (b) PyTorch's torch.optim.AdamW trajectories in tests/testdata/torch/.
#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "common/bf16.h"
#include "kernels/optimizer.h"
#include "tests/kernels/testdata.h"

namespace stallfree {
namespace {

using kernels::AdamWConfig;
using kernels::GradType;

// An independent AdamW in double: the textbook algorithm of Loshchilov & Hutter as in PyTorch.
struct DoubleAdamW {
  std::vector<double> p, m, v;
  void Step(const AdamWConfig& c, const std::vector<float>& g) {
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] *= 1.0 - double(c.lr) * c.weight_decay;
      m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * g[i];
      v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * double(g[i]) * g[i];
      double denom = std::sqrt(v[i]) / std::sqrt(1.0 - std::pow(double(c.beta2), double(c.step))) + c.eps;
      p[i] -= (c.lr / (1.0 - std::pow(double(c.beta1), double(c.step)))) * m[i] / denom;
    }
  }
};

TEST(AdamWReference, MatchesDoublePrecisionFormulaOverSteps) {
  const int n = 5000;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
  for (float& x : p) x = normal(rng);
  DoubleAdamW ref{std::vector<double>(p.begin(), p.end()), std::vector<double>(n, 0.0),
                  std::vector<double>(n, 0.0)};
  AdamWConfig c;
  c.lr = 3e-3;
  c.beta1 = 0.9;
  c.beta2 = 0.95;
  c.eps = 1e-8;
  c.weight_decay = 0.1;
  for (int t = 1; t <= 20; ++t) {
    std::vector<float> g(n);
    for (int i = 0; i < n; ++i) g[i] = normal(rng) * std::pow(10.0f, float(i % 5) - 3.0f);
    c.step = t;
    kernels::ReferenceKernel().AdamW(c, p.data(), m.data(), v.data(), g.data(), GradType::kFp32,
                                     n, nullptr);
    ref.Step(c, g);
  }
  // fp32 arithmetic vs double over 20 steps: relative error of a few fp32 ulps of the update.
  for (int i = 0; i < n; ++i) {
    ASSERT_NEAR(p[i], ref.p[i], 1e-6 + 2e-6 * std::fabs(ref.p[i])) << "param " << i;
    // Moments: fp32 rounding relative to the gradient's scale (m can cancel to near zero).
    const double gscale = 5.0 * std::pow(10.0, double(i % 5) - 3.0);
    ASSERT_NEAR(m[i], ref.m[i], 1e-6 * gscale) << "m " << i;
    ASSERT_NEAR(v[i], ref.v[i], 1e-6 * gscale * gscale) << "v " << i;
  }
}

TEST(AdamWReference, LargeStepCountsStillCorrectBias) {
  // Step 1e6: bias corrections are ~1; a bf16 or float step counter would stop at 256 / 2^24.
  std::vector<float> p{1.0f}, m{0.5f}, v{0.25f}, g{0.1f};
  AdamWConfig c;
  c.step = 1000000;
  c.lr = 1e-3;
  kernels::ReferenceKernel().AdamW(c, p.data(), m.data(), v.data(), g.data(), GradType::kFp32, 1,
                                   nullptr);
  const double mi = 0.9 * 0.5 + 0.1 * 0.1, vi = 0.999 * 0.25 + 0.001 * 0.01;
  EXPECT_NEAR(p[0], 1.0 - 1e-3 * mi / (std::sqrt(vi) + 1e-8), 1e-6);
}

TEST(AdamWReference, Bf16GradientAndBf16OutputAgreeWithFp32Path) {
  const int n = 1024;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p(n), g(n);
  std::vector<uint16_t> g16(n), out16(n);
  for (int i = 0; i < n; ++i) {
    p[i] = normal(rng);
    g16[i] = FloatToBf16(normal(rng));
    g[i] = Bf16ToFloat(g16[i]);
  }
  std::vector<float> p2 = p, m(n, 0), v(n, 0), m2(n, 0), v2(n, 0);
  AdamWConfig c;
  kernels::ReferenceKernel().AdamW(c, p.data(), m.data(), v.data(), g.data(), GradType::kFp32, n,
                                   nullptr);
  kernels::ReferenceKernel().AdamW(c, p2.data(), m2.data(), v2.data(), g16.data(),
                                   GradType::kBf16, n, out16.data());
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(p[i], p2[i]);
    ASSERT_EQ(out16[i], FloatToBf16(p2[i]));
  }
}

class TorchAdamW : public ::testing::TestWithParam<const char*> {};

TEST_P(TorchAdamW, ReproducesPyTorchTrajectory) {
  const std::string dir = std::string("tests/testdata/torch/") + GetParam() + "/";
  std::vector<float> p = testing::LoadF32(dir + "param_init.f32");
  std::vector<float> grads = testing::LoadF32(dir + "grads.f32");
  std::vector<float> want_p = testing::LoadF32(dir + "param_final.f32");
  std::vector<float> want_m = testing::LoadF32(dir + "exp_avg_final.f32");
  std::vector<float> want_v = testing::LoadF32(dir + "exp_avg_sq_final.f32");
  const size_t n = 4096;
  ASSERT_EQ(p.size(), n);
  ASSERT_EQ(grads.size(), 12 * n);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  AdamWConfig c;
  const bool seed2 = std::string(GetParam()) == "adamw_seed2";
  c.lr = seed2 ? 0.003 : 0.002;  // manifest.json of each seed.
  c.beta1 = 0.9;
  c.beta2 = 0.999;
  c.eps = 1e-8;
  c.weight_decay = seed2 ? 0.0 : 0.01;
  for (int t = 0; t < 12; ++t) {
    c.step = t + 1;
    kernels::ReferenceKernel().AdamW(c, p.data(), m.data(), v.data(), grads.data() + t * n,
                                     GradType::kFp32, n, nullptr);
  }
  // PyTorch's AdamW differs from ours only in fp32 operation order. Parameters: 2e-6 relative.
  // Moments can cancel to far below the gradients that formed them, so their tolerance is
  // relative to the element's largest gradient (fp32 rounding over 12 steps: ~1e-6 of it).
  for (size_t i = 0; i < n; ++i) {
    double gmax = 0;
    for (int t = 0; t < 12; ++t) gmax = std::max(gmax, double(std::fabs(grads[t * n + i])));
    ASSERT_NEAR(p[i], want_p[i], 2e-6f * std::fabs(want_p[i]) + 1e-7f) << "param " << i;
    ASSERT_NEAR(m[i], want_m[i], 1e-6 * gmax) << "exp_avg " << i;
    ASSERT_NEAR(v[i], want_v[i], 1e-6 * gmax * gmax) << "exp_avg_sq " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, TorchAdamW, ::testing::Values("adamw_seed1", "adamw_seed2"));

TEST(AccumulateReference, SumsScaledFp32AndBf16) {
  std::vector<float> acc{1.0f, 2.0f, 3.0f};
  std::vector<float> g{0.5f, -1.0f, 4.0f};
  std::vector<uint16_t> g16{FloatToBf16(0.25f), FloatToBf16(1.0f), FloatToBf16(-2.0f)};
  kernels::ReferenceKernel().Accumulate(acc.data(), g.data(), GradType::kFp32, 2.0f, 3);
  kernels::ReferenceKernel().Accumulate(acc.data(), g16.data(), GradType::kBf16, 1.0f, 3);
  EXPECT_EQ(acc, (std::vector<float>{2.25f, 1.0f, 9.0f}));
}

}  // namespace
}  // namespace stallfree
