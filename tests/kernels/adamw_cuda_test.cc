// The CUDA AdamW kernel against the CPU reference. Skips (exit 0) when no device is present.
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "kernels/cuda/optimizer_cuda.h"
#include "kernels/optimizer.h"

int main() {
  using namespace stallfree::kernels;
  std::string why;
  if (!cuda::DeviceAvailable(&why)) {
    printf("SKIP adamw_cuda_test: %s\n", why.c_str());
    return 0;
  }
  const int n = 1 << 20;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
  for (float& x : p) x = normal(rng);
  std::vector<float> pc = p, mc = m, vc = v;
  std::vector<uint16_t> out(n);
  AdamWConfig c;
  c.weight_decay = 0.01f;
  double max_rel = 0;
  for (int t = 1; t <= 5; ++t) {
    std::vector<float> g(n);
    for (float& x : g) x = normal(rng) * 1e-2f;
    c.step = t;
    ReferenceKernel().AdamW(c, pc.data(), mc.data(), vc.data(), g.data(), GradType::kFp32, n, nullptr);
    std::string err = cuda::AdamWHost(c, p.data(), m.data(), v.data(), g.data(), n, out.data());
    if (!err.empty()) {
      printf("FAIL adamw_cuda_test: %s\n", err.c_str());
      return 1;
    }
  }
  for (int i = 0; i < n; ++i) {
    double rel = std::fabs(p[i] - pc[i]) / (std::fabs(pc[i]) + 1e-6);
    if (rel > max_rel) max_rel = rel;
    if (out[i] != stallfree::FloatToBf16(p[i])) {
      printf("FAIL adamw_cuda_test: bf16 copy differs at %d\n", i);
      return 1;
    }
  }
  const double tol = 1e-6;  // a few ulps: the GPU may contract m/v updates into FMAs.
  printf("%s adamw_cuda_test: max relative difference to the CPU oracle %.3g (tolerance %.0e)\n",
         max_rel <= tol ? "PASS" : "FAIL", max_rel, tol);
  return max_rel <= tol ? 0 : 1;
}
