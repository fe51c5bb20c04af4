// Every CPU optimizer / selection backend against the scalar oracle (kernels/cpu/reference.cc).
// The fast paths compute in the oracle's order with IEEE sqrt and division and no FMA
// contraction, so the tolerance here is zero: results must be bit-identical.
#include <tbb/task_arena.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "gtest/gtest.h"
#include "kernels/optimizer.h"
#include "kernels/undo_log.h"

namespace stallfree {
namespace kernels {
namespace {

std::vector<const OptimizerKernel*> FastKernels() {
  std::vector<const OptimizerKernel*> ks = {&PortableKernel(), &DefaultCpuKernel()};
  if (Avx512Kernel() != nullptr) ks.push_back(Avx512Kernel());
  if (Avx2Kernel() != nullptr) ks.push_back(Avx2Kernel());
  return ks;
}

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> out(n);
  for (float& x : out) x = d(rng);
  return out;
}

std::vector<uint16_t> ToBf16(const std::vector<float>& x) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = FloatToBf16(x[i]);
  return out;
}

// Bitwise comparison with the first differing index in the message.
template <class T>
void ExpectBitsEqual(const std::vector<T>& want, const std::vector<T>& got, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::memcmp(&want[i], &got[i], sizeof(T)) != 0) {
      FAIL() << what << ": first difference at " << i << " of " << want.size() << ": want "
             << +want[i] << " got " << +got[i];
    }
  }
}

// Sizes around the vector widths (8, 16), the 64-column blocks and the 32K-element chunks.
const int64_t kSizes[] = {0, 1, 7, 8, 15, 16, 17, 63, 100, 32768, 32768 + 13, 3 * 32768 + 5, 200003};

TEST(OptimizerCpu, DefaultIsTheWidestTheCpuSupports) {
  __builtin_cpu_init();
  const std::string name = DefaultCpuKernel().name();
  if (std::getenv("STALLFREE_CPU_KERNEL") != nullptr) GTEST_SKIP() << "kernel forced by env";
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
    EXPECT_EQ(name, "avx512");
  } else if (__builtin_cpu_supports("avx2")) {
    EXPECT_EQ(name, "avx2");
  } else {
    EXPECT_EQ(name, "scalar");
  }
}

TEST(OptimizerCpu, AdamWBitExactForEveryBackendSizeAndGradType) {
  for (const OptimizerKernel* k : FastKernels()) {
    for (int64_t n : kSizes) {
      for (GradType type : {GradType::kFp32, GradType::kBf16}) {
        for (bool with_out : {false, true}) {
          // Offset 1 element so the vectors are not aligned.
          const size_t off = 1;
          std::vector<float> p = Random(n + off, 1), m = Random(n + off, 2, 0.01f),
                             v = Random(n + off, 3, 0.001f);
          for (float& x : v) x = x * x;
          std::vector<float> g32 = Random(n + off, 4);
          std::vector<uint16_t> g16 = ToBf16(g32);
          std::vector<float> p2 = p, m2 = m, v2 = v;
          std::vector<uint16_t> o1(n + off, 0), o2(n + off, 0);
          AdamWConfig c;
          c.lr = 3e-3;
          c.weight_decay = 0.1;
          c.grad_scale = 0.5f;
          const void* g = type == GradType::kBf16 ? static_cast<const void*>(g16.data() + off)
                                                  : static_cast<const void*>(g32.data() + off);
          for (int64_t step : {int64_t{1}, int64_t{2}, int64_t{3000000000}}) {
            c.step = step;
            ReferenceKernel().AdamW(c, p.data() + off, m.data() + off, v.data() + off, g, type,
                                    n, with_out ? o1.data() + off : nullptr);
            k->AdamW(c, p2.data() + off, m2.data() + off, v2.data() + off, g, type, n,
                     with_out ? o2.data() + off : nullptr);
          }
          const std::string what = std::string(k->name()) + " n=" + std::to_string(n) +
                                   (type == GradType::kBf16 ? " bf16" : " fp32") +
                                   (with_out ? " +out" : "");
          ExpectBitsEqual(p, p2, what + " param");
          ExpectBitsEqual(m, m2, what + " m");
          ExpectBitsEqual(v, v2, what + " v");
          ExpectBitsEqual(o1, o2, what + " bf16 out");
          if (with_out && n > 0) {
            EXPECT_EQ(o2[off], FloatToBf16(p2[off])) << what;
          }
        }
      }
    }
  }
}

TEST(OptimizerCpu, AdamWMovesAgainstTheGradient) {
  // An outcome check independent of the oracle: on step 1 with no decay, m/sqrt(v) = sign(g),
  // so each parameter moves by lr against its gradient (to eps).
  const int64_t n = 1000;
  std::vector<float> p(n, 1.0f), m(n, 0.0f), v(n, 0.0f), g = Random(n, 9);
  AdamWConfig c;
  c.lr = 0.01;
  DefaultCpuKernel().AdamW(c, p.data(), m.data(), v.data(), g.data(), GradType::kFp32, n,
                           nullptr);
  for (int64_t i = 0; i < n; ++i) {
    if (std::fabs(g[i]) < 1e-3f) continue;
    EXPECT_NEAR(p[i], g[i] > 0 ? 0.99f : 1.01f, 1e-5f) << i;
  }
}

// Per-column steps that differ between neighbouring columns and cover a fresh column (1, 2), a
// settled one (1000) and one past 2^31 (3e9: an int32 or float counter would be wrong there).
std::vector<int64_t> ColumnSteps(int64_t cols) {
  const int64_t pool[] = {3000000000, 1, 2, 1000};
  std::vector<int64_t> steps(cols);
  for (int64_t c = 0; c < cols; ++c) steps[c] = pool[(5 * c + c / 4) % 4];
  return steps;
}

struct ColumnConstants {
  std::vector<float> step_size, bc2_sqrt;
};
ColumnConstants MakeColumns(const AdamWConfig& c, const std::vector<int64_t>& steps) {
  ColumnConstants k{std::vector<float>(steps.size()), std::vector<float>(steps.size())};
  MakeColumnConstants(c, steps.data(), steps.size(), k.step_size.data(), k.bc2_sqrt.data());
  return k;
}

AdamWConfig ColumnTestConfig() {
  AdamWConfig c;
  c.lr = 3e-3;
  c.beta2 = 0.95;
  c.weight_decay = 0.1;
  c.grad_scale = 0.5f;
  c.step = 77;  // ignored by AdamWColumns
  return c;
}

TEST(OptimizerCpu, ColumnConstantsEqualTheUniformConstantsOfEachStep) {
  const std::vector<int64_t> steps = {1, 2, 3, 10, 1000, 123456, 3000000000,
                                      std::numeric_limits<int64_t>::max()};
  for (double beta2 : {0.999, 0.95}) {
    AdamWConfig c = ColumnTestConfig();
    c.beta2 = beta2;
    const ColumnConstants k = MakeColumns(c, steps);
    for (size_t i = 0; i < steps.size(); ++i) {
      c.step = steps[i];
      const AdamWConstants want = MakeAdamWConstants(c);
      EXPECT_EQ(std::memcmp(&want.step_size, &k.step_size[i], 4), 0)
          << "step " << steps[i] << ": " << want.step_size << " vs " << k.step_size[i];
      EXPECT_EQ(std::memcmp(&want.bc2_sqrt, &k.bc2_sqrt[i], 4), 0)
          << "step " << steps[i] << ": " << want.bc2_sqrt << " vs " << k.bc2_sqrt[i];
    }
  }
}

TEST(OptimizerCpu, ColumnOracleIsAdamWOnEachColumnAtItsOwnStep) {
  // The contract itself, on the oracle: column c of AdamWColumns is AdamW on that column alone
  // (extracted) with config.step = steps[c].
  for (int64_t rows : {1, 7, 64}) {
    for (int64_t cols : {1, 3, 17, 33}) {
      for (GradType type : {GradType::kFp32, GradType::kBf16}) {
        const int64_t n = rows * cols;
        std::vector<float> p = Random(n, 61), m = Random(n, 62, 0.01f), v = Random(n, 63, 0.01f);
        for (float& x : v) x = x * x;
        std::vector<float> g32 = Random(n, 64);
        std::vector<uint16_t> g16 = ToBf16(g32), out(n);
        const void* g = type == GradType::kBf16 ? static_cast<const void*>(g16.data())
                                                : static_cast<const void*>(g32.data());
        AdamWConfig c = ColumnTestConfig();
        const std::vector<int64_t> steps = ColumnSteps(cols);
        const ColumnConstants k = MakeColumns(c, steps);
        const std::vector<float> p0 = p, m0 = m, v0 = v;
        ReferenceKernel().AdamWColumns(c, k.step_size.data(), k.bc2_sqrt.data(), p.data(),
                                       m.data(), v.data(), g, type, rows, cols, out.data());
        for (int64_t col = 0; col < cols; ++col) {
          std::vector<float> cp(rows), cm(rows), cv(rows), cg(rows), want_p(rows), want_m(rows),
              want_v(rows);
          std::vector<uint16_t> cg16(rows), cout(rows), want_out(rows);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = r * cols + col;
            cp[r] = p0[i], cm[r] = m0[i], cv[r] = v0[i], cg[r] = g32[i], cg16[r] = g16[i];
            want_p[r] = p[i], want_m[r] = m[i], want_v[r] = v[i], want_out[r] = out[i];
          }
          c.step = steps[col];
          ReferenceKernel().AdamW(c, cp.data(), cm.data(), cv.data(),
                                  type == GradType::kBf16 ? static_cast<const void*>(cg16.data())
                                                          : static_cast<const void*>(cg.data()),
                                  type, rows, cout.data());
          const std::string what = std::to_string(rows) + "x" + std::to_string(cols) +
                                   (type == GradType::kBf16 ? " bf16" : " fp32") + " column " +
                                   std::to_string(col) + " step " + std::to_string(steps[col]);
          ExpectBitsEqual(cp, want_p, what + " param");
          ExpectBitsEqual(cm, want_m, what + " m");
          ExpectBitsEqual(cv, want_v, what + " v");
          ExpectBitsEqual(cout, want_out, what + " bf16 out");
        }
      }
    }
  }
}

TEST(OptimizerCpu, AdamWColumnsBitExactForEveryBackendAndShape) {
  struct Shape {
    int64_t rows, cols;
  };
  std::vector<Shape> shapes;
  for (int64_t rows : {1, 7, 64}) {
    for (int64_t cols : {1, 3, 17, 33, 1000}) shapes.push_back({rows, cols});
  }
  // Several tasks: many short rows per task, and rows longer than one task (split by columns).
  shapes.push_back({20000, 3});
  shapes.push_back({2, 70001});
  for (const OptimizerKernel* k : FastKernels()) {
    for (const Shape& s : shapes) {
      const int64_t n = s.rows * s.cols;
      for (GradType type : {GradType::kFp32, GradType::kBf16}) {
        for (bool with_out : {false, true}) {
          const size_t off = 1;  // misaligned starts
          std::vector<float> p = Random(n + off, 71), m = Random(n + off, 72, 0.01f),
                             v = Random(n + off, 73, 0.001f);
          for (float& x : v) x = x * x;
          std::vector<float> g32 = Random(n + off, 74);
          std::vector<uint16_t> g16 = ToBf16(g32);
          std::vector<float> p2 = p, m2 = m, v2 = v;
          std::vector<uint16_t> o1(n + off, 0), o2(n + off, 0);
          const void* g = type == GradType::kBf16 ? static_cast<const void*>(g16.data() + off)
                                                  : static_cast<const void*>(g32.data() + off);
          const AdamWConfig c = ColumnTestConfig();
          std::vector<int64_t> steps = ColumnSteps(s.cols);
          for (int round = 0; round < 2; ++round) {  // the state and every step move on
            const ColumnConstants kc = MakeColumns(c, steps);
            ReferenceKernel().AdamWColumns(c, kc.step_size.data(), kc.bc2_sqrt.data(),
                                           p.data() + off, m.data() + off, v.data() + off, g,
                                           type, s.rows, s.cols,
                                           with_out ? o1.data() + off : nullptr);
            k->AdamWColumns(c, kc.step_size.data(), kc.bc2_sqrt.data(), p2.data() + off,
                            m2.data() + off, v2.data() + off, g, type, s.rows, s.cols,
                            with_out ? o2.data() + off : nullptr);
            for (int64_t& t : steps) ++t;
          }
          const std::string what = std::string(k->name()) + " " + std::to_string(s.rows) + "x" +
                                   std::to_string(s.cols) +
                                   (type == GradType::kBf16 ? " bf16" : " fp32") +
                                   (with_out ? " +out" : "");
          ExpectBitsEqual(p, p2, what + " param");
          ExpectBitsEqual(m, m2, what + " m");
          ExpectBitsEqual(v, v2, what + " v");
          ExpectBitsEqual(o1, o2, what + " bf16 out");
          EXPECT_EQ(o2[0], 0) << what << ": wrote before the block";
          if (with_out) {
            EXPECT_EQ(o2[off + n - 1], FloatToBf16(p2[off + n - 1])) << what;
          }
        }
      }
    }
  }
}

TEST(OptimizerCpu, AdamWColumnsWithOneStepEqualsAdamW) {
  std::vector<const OptimizerKernel*> ks = FastKernels();
  ks.push_back(&ReferenceKernel());
  for (const OptimizerKernel* k : ks) {
    for (int64_t step : {int64_t{1}, int64_t{1000}, int64_t{3000000000}}) {
      for (int64_t rows : {7, 64}) {
        for (int64_t cols : {33, 1000}) {
          const int64_t n = rows * cols;
          std::vector<float> p = Random(n, 81), m = Random(n, 82, 0.01f), v = Random(n, 83, 0.01f);
          for (float& x : v) x = x * x;
          std::vector<uint16_t> g16 = ToBf16(Random(n, 84)), o1(n), o2(n);
          std::vector<float> p2 = p, m2 = m, v2 = v;
          AdamWConfig c = ColumnTestConfig();
          c.step = step;
          const ColumnConstants kc = MakeColumns(c, std::vector<int64_t>(cols, step));
          k->AdamW(c, p.data(), m.data(), v.data(), g16.data(), GradType::kBf16, n, o1.data());
          k->AdamWColumns(c, kc.step_size.data(), kc.bc2_sqrt.data(), p2.data(), m2.data(),
                          v2.data(), g16.data(), GradType::kBf16, rows, cols, o2.data());
          const std::string what = std::string(k->name()) + " " + std::to_string(rows) + "x" +
                                   std::to_string(cols) + " step " + std::to_string(step);
          ExpectBitsEqual(p, p2, what + " param");
          ExpectBitsEqual(m, m2, what + " m");
          ExpectBitsEqual(v, v2, what + " v");
          ExpectBitsEqual(o1, o2, what + " bf16 out");
        }
      }
    }
  }
}

// The AdamWColumns test shapes: several tasks, many short rows per task, rows longer than one
// task (split by columns).
struct ColShape {
  int64_t rows, cols;
};
std::vector<ColShape> ColumnShapes() {
  std::vector<ColShape> shapes;
  for (int64_t rows : {1, 7, 64}) {
    for (int64_t cols : {1, 3, 17, 33, 1000}) shapes.push_back({rows, cols});
  }
  shapes.push_back({20000, 3});
  shapes.push_back({2, 70001});
  return shapes;
}

// One AccumulateAdamWColumns case (acc may be absent), two rounds at moving steps, with every
// array starting one element in (misaligned). `fused` runs the kernel under test on state 2;
// `want` produces the expected state 1.
struct AccColCase {
  int64_t rows, cols;
  GradType type;
  bool with_out, with_acc;
};
template <class Want, class Got>
void RunAccColCase(const AccColCase& k, const std::string& what, Want want, Got got) {
  const int64_t n = k.rows * k.cols;
  const size_t off = 1;
  std::vector<float> p = Random(n + off, 91), m = Random(n + off, 92, 0.01f),
                     v = Random(n + off, 93, 0.001f);
  for (float& x : v) x = x * x;
  const std::vector<float> acc = Random(n + off, 94);
  std::vector<float> g32 = Random(n + off, 95);
  std::vector<uint16_t> g16 = ToBf16(g32);
  std::vector<float> p2 = p, m2 = m, v2 = v, acc2 = acc;
  std::vector<uint16_t> o1(n + off, 0), o2(n + off, 0);
  const void* g = k.type == GradType::kBf16 ? static_cast<const void*>(g16.data() + off)
                                            : static_cast<const void*>(g32.data() + off);
  const AdamWConfig c = ColumnTestConfig();
  std::vector<int64_t> steps = ColumnSteps(k.cols);
  for (int round = 0; round < 2; ++round) {
    const ColumnConstants kc = MakeColumns(c, steps);
    want(c, kc, p.data() + off, m.data() + off, v.data() + off,
         k.with_acc ? acc.data() + off : nullptr, g, k.with_out ? o1.data() + off : nullptr);
    got(c, kc, p2.data() + off, m2.data() + off, v2.data() + off,
        k.with_acc ? acc2.data() + off : nullptr, g, k.with_out ? o2.data() + off : nullptr);
    for (int64_t& t : steps) ++t;
  }
  ExpectBitsEqual(p, p2, what + " param");
  ExpectBitsEqual(m, m2, what + " m");
  ExpectBitsEqual(v, v2, what + " v");
  ExpectBitsEqual(o1, o2, what + " bf16 out");
  ExpectBitsEqual(acc, acc2, what + " acc (must be read only)");
  EXPECT_EQ(o2[0], 0) << what << ": wrote before the block";
}

std::string AccColName(const std::string& k, const AccColCase& c) {
  return k + " " + std::to_string(c.rows) + "x" + std::to_string(c.cols) +
         (c.type == GradType::kBf16 ? " bf16" : " fp32") + (c.with_out ? " +out" : "") +
         (c.with_acc ? " +acc" : " no acc");
}

TEST(OptimizerCpu, AccumulateAdamWColumnsBitExactForEveryBackendAndShape) {
  for (const OptimizerKernel* k : FastKernels()) {
    for (const ColShape& s : ColumnShapes()) {
      for (GradType type : {GradType::kFp32, GradType::kBf16}) {
        for (bool with_out : {false, true}) {
          for (bool with_acc : {false, true}) {
            const AccColCase cs{s.rows, s.cols, type, with_out, with_acc};
            auto run = [&](const OptimizerKernel& kern) {
              return [&kern, cs](const AdamWConfig& c, const ColumnConstants& kc, float* p,
                                 float* m, float* v, const float* acc, const void* g,
                                 uint16_t* out) {
                kern.AccumulateAdamWColumns(c, kc.step_size.data(), kc.bc2_sqrt.data(), p, m, v,
                                            acc, g, cs.type, 0.25f, cs.rows, cs.cols, out);
              };
            };
            RunAccColCase(cs, AccColName(k->name(), cs), run(ReferenceKernel()), run(*k));
          }
        }
      }
    }
  }
}

// predict_out: the bf16 output is round((p_new + p_new) - p_old), written out here from the
// parameters before and after, while p, m and v are exactly those of the same call without it;
// every fast backend equals the oracle, through AdamW and the fused column kernel (the daemon's
// two update paths), over sizes that cross the vector widths and the chunks.
TEST(OptimizerCpu, PredictedOutputIsTwiceTheNewMinusTheOld) {
  AdamWConfig c;
  c.lr = 1e-2;
  c.weight_decay = 0.1;
  c.step = 3;
  for (const OptimizerKernel* k : FastKernels()) {
    for (int64_t n : {int64_t{1}, int64_t{17}, int64_t{32768 + 13}}) {
      const int64_t rows = 1, cols = n;
      const std::vector<float> p0 = Random(n, 1), m0 = Random(n, 2, 0.1f), g = Random(n, 3);
      std::vector<float> v0 = Random(n, 4, 0.1f), acc = Random(n, 5);
      for (float& x : v0) x = x * x;
      std::vector<float> ss(cols), bc(cols);
      std::vector<int64_t> steps(cols, 3);
      MakeColumnConstants(c, steps.data(), cols, ss.data(), bc.data());
      for (int fused = 0; fused < 2; ++fused) {
        const std::string what = std::string(k->name()) + (fused ? " fused" : " AdamW") +
                                 " n=" + std::to_string(n);
        auto run = [&](const OptimizerKernel& kern, bool predict, std::vector<float>* p,
                       std::vector<float>* m, std::vector<float>* v, std::vector<uint16_t>* out) {
          *p = p0;
          *m = m0;
          *v = v0;
          out->assign(n, 0);
          AdamWConfig cc = c;
          cc.predict_out = predict;
          if (fused)
            kern.AccumulateAdamWColumns(cc, ss.data(), bc.data(), p->data(), m->data(),
                                        v->data(), acc.data(), g.data(), GradType::kFp32, 0.5f,
                                        rows, cols, out->data());
          else
            kern.AdamW(cc, p->data(), m->data(), v->data(), g.data(), GradType::kFp32, n,
                       out->data());
        };
        std::vector<float> p, m, v, rp, rm, rv, pp, pm, pv;
        std::vector<uint16_t> out, rout, pout;
        run(*k, true, &p, &m, &v, &out);
        run(ReferenceKernel(), true, &rp, &rm, &rv, &rout);
        run(*k, false, &pp, &pm, &pv, &pout);
        std::vector<uint16_t> want(n);
        for (int64_t i = 0; i < n; ++i) want[i] = FloatToBf16((rp[i] + rp[i]) - p0[i]);
        ExpectBitsEqual(want, rout, what + " oracle");
        ExpectBitsEqual(rout, out, what);
        ExpectBitsEqual(rp, p, what + " p");
        ExpectBitsEqual(pp, p, what + " p without predict_out");
        ExpectBitsEqual(pm, m, what + " m without predict_out");
        ExpectBitsEqual(pv, v, what + " v without predict_out");
        EXPECT_NE(out, pout) << what;  // the prediction is not the value
      }
    }
  }
}

// A kernel that forwards everything to the oracle except AccumulateAdamWColumns, so that the
// OptimizerKernel default (Accumulate into a scratch copy + AdamWColumns) runs.
class DefaultFusedKernel final : public OptimizerKernel {
 public:
  const OptimizerKernel& r = ReferenceKernel();
  const char* name() const override { return "default"; }
  void Accumulate(float* acc, const void* grad, GradType type, float scale, int64_t n,
                  AccumulateMode mode) const override {
    r.Accumulate(acc, grad, type, scale, n, mode);
  }
  void AdamW(const AdamWConfig& c, float* p, float* m, float* v, const void* g, GradType t,
             int64_t n, ParamOut o) const override {
    r.AdamW(c, p, m, v, g, t, n, o);
  }
  void AdamWColumns(const AdamWConfig& c, const float* ss, const float* bc, float* p, float* m,
                    float* v, const void* g, GradType t, int64_t rows, int64_t cols,
                    ParamOut o) const override {
    r.AdamWColumns(c, ss, bc, p, m, v, g, t, rows, cols, o);
  }
  void AccumulateAdamW(const AdamWConfig& c, float* p, float* m, float* v, const float* acc,
                       const void* g, GradType t, float s, int64_t n, ParamOut o) const override {
    r.AccumulateAdamW(c, p, m, v, acc, g, t, s, n, o);
  }
  void FloatToBf16(const float* src, uint16_t* dst, int64_t n) const override {
    r.FloatToBf16(src, dst, n);
  }
  void Bf16ToFloat(const uint16_t* src, float* dst, int64_t n) const override {
    r.Bf16ToFloat(src, dst, n);
  }
  void ColumnScores(const void* g, GradType t, int64_t rows, int64_t cols, int64_t ld, float* l1,
                    float* l2) const override {
    r.ColumnScores(g, t, rows, cols, ld, l1, l2);
  }
  void TopK(const float* s, int64_t n, int64_t k, int64_t* idx) const override {
    r.TopK(s, n, k, idx);
  }
  void GatherColumns(const void* src, size_t es, int64_t rows, int64_t ld, const int64_t* idx,
                     int64_t k, void* dst) const override {
    r.GatherColumns(src, es, rows, ld, idx, k, dst);
  }
  void ScatterColumns(const void* src, size_t es, int64_t rows, int64_t ld, const int64_t* idx,
                      int64_t k, void* dst) const override {
    r.ScatterColumns(src, es, rows, ld, idx, k, dst);
  }
};

// The fp32 output (ParamOut::Fp32: the daemon's fp32 parameter slot, written in the update's
// own pass with streaming stores where aligned): for every backend and the four AdamW entry
// points, it holds exactly the new parameters (with predict_out, (p_new + p_new) - p_old), and
// p, m and v are those of the same call without an output. Arrays 64-byte aligned and offset by
// 0 or 1 element, so both the streaming and the unaligned stores run, over sizes that cross the
// vector widths and the chunks.
TEST(OptimizerCpu, Fp32OutputIsTheNewValuesWrittenInTheSamePass) {
  AdamWConfig c;
  c.lr = 1e-2;
  c.weight_decay = 0.1;
  c.step = 3;
  struct Aligned {  // n floats at a 64-byte boundary plus `off` elements
    explicit Aligned(const std::vector<float>& x, size_t off)
        : buf((x.size() + off + 16 + 15) / 16 * 16 + 16), at(Align() + off) {
      std::copy(x.begin(), x.end(), at);
    }
    float* Align() {
      auto a = reinterpret_cast<uintptr_t>(buf.data());
      return reinterpret_cast<float*>((a + 63) / 64 * 64);
    }
    std::vector<float> Get(int64_t n) const { return std::vector<float>(at, at + n); }
    std::vector<float> buf;
    float* at;
  };
  std::vector<const OptimizerKernel*> kernels = FastKernels();
  kernels.push_back(&ReferenceKernel());
  for (const OptimizerKernel* k : kernels) {
    for (int64_t n : {int64_t{1}, int64_t{17}, int64_t{32768 + 13}}) {
      for (size_t off : {size_t{0}, size_t{1}}) {
        for (int entry = 0; entry < 4; ++entry) {
          for (bool predict : {false, true}) {
            const std::string what = std::string(k->name()) + " entry " +
                                     std::to_string(entry) + " n=" + std::to_string(n) +
                                     " off=" + std::to_string(off) + (predict ? " predict" : "");
            const std::vector<float> p0 = Random(n, 1), m0 = Random(n, 2, 0.1f),
                                     g = Random(n, 3), acc = Random(n, 5);
            std::vector<float> v0 = Random(n, 4, 0.1f);
            for (float& x : v0) x = x * x;
            std::vector<float> ss(n), bc(n);
            std::vector<int64_t> steps(n, 3);
            MakeColumnConstants(c, steps.data(), n, ss.data(), bc.data());
            AdamWConfig cc = c;
            cc.predict_out = predict;
            auto run = [&](Aligned* p, Aligned* m, Aligned* v, ParamOut out) {
              switch (entry) {
                case 0:
                  k->AdamW(cc, p->at, m->at, v->at, g.data(), GradType::kFp32, n, out);
                  break;
                case 1:
                  k->AdamWColumns(cc, ss.data(), bc.data(), p->at, m->at, v->at, g.data(),
                                  GradType::kFp32, 1, n, out);
                  break;
                case 2:
                  k->AccumulateAdamW(cc, p->at, m->at, v->at, acc.data(), g.data(),
                                     GradType::kFp32, 0.5f, n, out);
                  break;
                default:
                  k->AccumulateAdamWColumns(cc, ss.data(), bc.data(), p->at, m->at, v->at,
                                            acc.data(), g.data(), GradType::kFp32, 0.5f, 1, n,
                                            out);
              }
            };
            Aligned p(p0, off), m(m0, off), v(v0, off), o(std::vector<float>(n, -1.0f), off);
            Aligned rp(p0, off), rm(m0, off), rv(v0, off);
            run(&p, &m, &v, ParamOut::Fp32(o.at));
            run(&rp, &rm, &rv, nullptr);
            const std::vector<float> pn = p.Get(n), out = o.Get(n);
            std::vector<float> want(n);
            for (int64_t i = 0; i < n; ++i) want[i] = predict ? (pn[i] + pn[i]) - p0[i] : pn[i];
            ExpectBitsEqual(want, out, what + " out");
            ExpectBitsEqual(rp.Get(n), pn, what + " p");
            ExpectBitsEqual(rm.Get(n), m.Get(n), what + " m");
            ExpectBitsEqual(rv.Get(n), v.Get(n), what + " v");
          }
        }
      }
    }
  }
}

TEST(OptimizerCpu, AccumulateAdamWColumnsOracleEqualsAccumulateThenAdamWColumns) {
  // The contract, on the oracle (and on the OptimizerKernel default): Accumulate into the
  // accumulator (kOverwrite when there is none: nothing pushed since the last Update), then
  // AdamWColumns on it as an fp32 gradient.
  const DefaultFusedKernel dflt;
  const OptimizerKernel* fused[] = {&ReferenceKernel(), &dflt};
  for (const OptimizerKernel* k : fused) {
    for (const ColShape& s : ColumnShapes()) {
      for (GradType type : {GradType::kFp32, GradType::kBf16}) {
        for (bool with_out : {false, true}) {
          for (bool with_acc : {false, true}) {
            const AccColCase cs{s.rows, s.cols, type, with_out, with_acc};
            const int64_t n = cs.rows * cs.cols;
            auto separate = [cs, n](const AdamWConfig& c, const ColumnConstants& kc, float* p,
                                    float* m, float* v, const float* acc, const void* g,
                                    uint16_t* out) {
              const OptimizerKernel& r = ReferenceKernel();
              std::vector<float> sum(n, -1.0f);
              if (acc != nullptr) std::memcpy(sum.data(), acc, n * sizeof(float));
              r.Accumulate(sum.data(), g, cs.type, 0.25f, n,
                           acc != nullptr ? AccumulateMode::kAdd : AccumulateMode::kOverwrite);
              r.AdamWColumns(c, kc.step_size.data(), kc.bc2_sqrt.data(), p, m, v, sum.data(),
                             GradType::kFp32, cs.rows, cs.cols, out);
            };
            auto one = [k, cs](const AdamWConfig& c, const ColumnConstants& kc, float* p,
                               float* m, float* v, const float* acc, const void* g,
                               uint16_t* out) {
              k->AccumulateAdamWColumns(c, kc.step_size.data(), kc.bc2_sqrt.data(), p, m, v, acc,
                                        g, cs.type, 0.25f, cs.rows, cs.cols, out);
            };
            RunAccColCase(cs, AccColName(k->name(), cs) + " vs separate", separate, one);
          }
        }
      }
    }
  }
}

TEST(OptimizerCpu, AccumulateAddAndOverwriteBitExact) {
  for (const OptimizerKernel* k : FastKernels()) {
    for (int64_t n : kSizes) {
      for (GradType type : {GradType::kFp32, GradType::kBf16}) {
        for (AccumulateMode mode : {AccumulateMode::kAdd, AccumulateMode::kOverwrite}) {
          std::vector<float> a1 = Random(n + 3, 5), g32 = Random(n + 3, 6);
          std::vector<uint16_t> g16 = ToBf16(g32);
          std::vector<float> a2 = a1;
          const void* g = type == GradType::kBf16 ? static_cast<const void*>(g16.data() + 3)
                                                  : static_cast<const void*>(g32.data() + 3);
          ReferenceKernel().Accumulate(a1.data() + 3, g, type, 0.25f, n, mode);
          k->Accumulate(a2.data() + 3, g, type, 0.25f, n, mode);
          ExpectBitsEqual(a1, a2, std::string(k->name()) + " accumulate n=" + std::to_string(n));
        }
      }
    }
  }
}

TEST(OptimizerCpu, FusedBoundaryEqualsSeparatePasses) {
  // AccumulateAdamW(acc, last grad) must equal: Accumulate(acc, last grad); AdamW(acc); cast.
  for (const OptimizerKernel* k : FastKernels()) {
    for (int64_t n : {int64_t{17}, int64_t{100003}}) {
      for (GradType type : {GradType::kFp32, GradType::kBf16}) {
        for (bool null_grad : {false, true}) {
          std::vector<float> p = Random(n, 11), m = Random(n, 12, 0.01f), v = Random(n, 13, 0.01f);
          for (float& x : v) x = x * x;
          std::vector<float> acc = Random(n, 14), g32 = Random(n, 15);
          std::vector<uint16_t> g16 = ToBf16(g32);
          const void* g = null_grad ? nullptr
                          : type == GradType::kBf16 ? static_cast<const void*>(g16.data())
                                                    : static_cast<const void*>(g32.data());
          AdamWConfig c;
          c.step = 7;
          c.weight_decay = 0.01;
          c.grad_scale = 0.125f;
          std::vector<float> p2 = p, m2 = m, v2 = v, acc2 = acc;
          std::vector<uint16_t> o1(n), o2(n);
          k->AccumulateAdamW(c, p.data(), m.data(), v.data(), acc.data(), g, type, 0.5f, n,
                             o1.data());
          if (g != nullptr) {
            ReferenceKernel().Accumulate(acc2.data(), g, type, 0.5f, n, AccumulateMode::kAdd);
          }
          ReferenceKernel().AdamW(c, p2.data(), m2.data(), v2.data(), acc2.data(),
                                  GradType::kFp32, n, nullptr);
          ReferenceKernel().FloatToBf16(p2.data(), o2.data(), n);
          const std::string what = std::string(k->name()) + " fused n=" + std::to_string(n);
          ExpectBitsEqual(p2, p, what + " param");
          ExpectBitsEqual(m2, m, what + " m");
          ExpectBitsEqual(v2, v, what + " v");
          ExpectBitsEqual(o2, o1, what + " bf16");
        }
      }
    }
  }
}

TEST(OptimizerCpu, Bf16ConversionsEveryValueAndSpecialFloats) {
  for (const OptimizerKernel* k : FastKernels()) {
    // Every bf16 value widens exactly and narrows back to itself (NaNs to a quiet NaN with the
    // same sign).
    std::vector<uint16_t> all(65536), back(65536);
    for (int i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
    std::vector<float> wide(65536);
    k->Bf16ToFloat(all.data(), wide.data(), 65536);
    k->FloatToBf16(wide.data(), back.data(), 65536);
    for (int i = 0; i < 65536; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &wide[i], 4);
      ASSERT_EQ(bits, static_cast<uint32_t>(i) << 16) << k->name() << " widen " << i;
      const bool nan = (i & 0x7fff) > 0x7f80;
      ASSERT_EQ(back[i], nan ? (i | 0x40) : i) << k->name() << " narrow " << i;
    }
    // Random bit patterns (denormals, infinities, NaNs included) and the rounding ties.
    std::mt19937 rng(21);
    std::vector<float> f(1 << 20);
    for (size_t i = 0; i < f.size(); ++i) {
      uint32_t bits = rng();
      if (i % 7 == 0) bits = (bits & 0xffff0000u) | 0x8000u;  // exact tie
      std::memcpy(&f[i], &bits, 4);
    }
    std::vector<uint16_t> want(f.size()), got(f.size());
    ReferenceKernel().FloatToBf16(f.data(), want.data(), f.size());
    k->FloatToBf16(f.data(), got.data(), f.size());
    ExpectBitsEqual(want, got, std::string(k->name()) + " narrow random");
  }
  // The oracle itself on the cases that matter: ties go to even, the largest finite rounds up
  // to infinity, a NaN stays NaN.
  EXPECT_EQ(FloatToBf16(Bf16ToFloat(0x3f80) + std::ldexp(1.0f, -8)), 0x3f80);  // 1 + half ulp
  EXPECT_EQ(FloatToBf16(Bf16ToFloat(0x3f81) + std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
}

TEST(OptimizerCpu, ColumnScoresBitExactAndThreadCountIndependent) {
  for (const OptimizerKernel* k : FastKernels()) {
    for (int64_t rows : {1, 5, 64}) {
      for (int64_t cols : {1, 15, 64, 100, 333, 1100}) {
        const int64_t ld = cols + 3;
        std::vector<float> g32 = Random(rows * ld, 31);
        std::vector<uint16_t> g16 = ToBf16(g32);
        for (GradType type : {GradType::kFp32, GradType::kBf16}) {
          const void* g = type == GradType::kBf16 ? static_cast<const void*>(g16.data())
                                                  : static_cast<const void*>(g32.data());
          std::vector<float> l1a(cols), l2a(cols), l1b(cols), l2b(cols), l1c(cols);
          ReferenceKernel().ColumnScores(g, type, rows, cols, ld, l1a.data(), l2a.data());
          k->ColumnScores(g, type, rows, cols, ld, l1b.data(), l2b.data());
          tbb::task_arena one(1);
          one.execute([&] { k->ColumnScores(g, type, rows, cols, ld, l1c.data(), nullptr); });
          const std::string what = std::string(k->name()) + " scores " + std::to_string(rows) +
                                   "x" + std::to_string(cols);
          ExpectBitsEqual(l1a, l1b, what + " l1");
          ExpectBitsEqual(l2a, l2b, what + " l2");
          ExpectBitsEqual(l1a, l1c, what + " l1 one thread");
        }
      }
    }
  }
  // Against values computed by hand: G = [[1, -2], [3, 4]].
  const float g[] = {1, -2, 3, 4};
  float l1[2], l2[2];
  DefaultCpuKernel().ColumnScores(g, GradType::kFp32, 2, 2, 2, l1, l2);
  EXPECT_EQ(l1[0], 4.0f);
  EXPECT_EQ(l1[1], 6.0f);
  EXPECT_EQ(l2[0], 10.0f);
  EXPECT_EQ(l2[1], 20.0f);
}

TEST(OptimizerCpu, TopKTiesNansAndEdges) {
  const float nan = std::nanf("");
  const std::vector<float> s = {1, 5, nan, 5, 3, 5, -1, nan, 2};
  int64_t idx[9];
  for (const OptimizerKernel* k : FastKernels()) {
    k->TopK(s.data(), 9, 2, idx);  // three 5s: the two lowest indices win
    EXPECT_EQ(idx[0], 1);
    EXPECT_EQ(idx[1], 3);
    k->TopK(s.data(), 9, 5, idx);  // 5, 5, 5, 3, 2, in index order
    EXPECT_EQ(std::vector<int64_t>(idx, idx + 5), (std::vector<int64_t>{1, 3, 4, 5, 8}));
    k->TopK(s.data(), 9, 8, idx);  // every number and the first NaN
    EXPECT_EQ(std::vector<int64_t>(idx, idx + 8), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 8}));
    k->TopK(s.data(), 9, 0, idx);
    // Large random against the oracle.
    std::vector<float> r = Random(50000, 41);
    for (size_t i = 0; i < r.size(); i += 97) r[i] = r[i / 2];  // duplicates
    for (int64_t kk : {1, 4999, 50000}) {
      std::vector<int64_t> a(kk), b(kk);
      ReferenceKernel().TopK(r.data(), r.size(), kk, a.data());
      k->TopK(r.data(), r.size(), kk, b.data());
      EXPECT_EQ(a, b) << k->name() << " k=" << kk;
    }
  }
}

TEST(OptimizerCpu, GatherScatterRoundTripAndComplement) {
  const int64_t rows = 37, cols = 300;
  std::vector<float> w = Random(rows * cols, 51);
  std::vector<float> scores(cols);
  DefaultCpuKernel().ColumnScores(w.data(), GradType::kFp32, rows, cols, cols, scores.data(),
                                  nullptr);
  const int64_t k = 30;
  std::vector<int64_t> hot(k), cold(cols - k);
  DefaultCpuKernel().TopK(scores.data(), cols, k, hot.data());
  ComplementIndices(hot.data(), k, cols, cold.data());
  for (size_t i = 1; i < cold.size(); ++i) ASSERT_LT(cold[i - 1], cold[i]);
  for (const OptimizerKernel* k2 : FastKernels()) {
    for (size_t esize : {size_t{4}, size_t{2}}) {
      std::vector<float> hot_buf(rows * k), cold_buf(rows * (cols - k)), ref_hot(rows * k);
      k2->GatherColumns(w.data(), esize, rows, cols, hot.data(), k, hot_buf.data());
      k2->GatherColumns(w.data(), esize, rows, cols, cold.data(), cols - k, cold_buf.data());
      if (esize == 4) {
        ReferenceKernel().GatherColumns(w.data(), 4, rows, cols, hot.data(), k, ref_hot.data());
        ExpectBitsEqual(ref_hot, hot_buf, std::string(k2->name()) + " gather");
        for (int64_t r = 0; r < rows; ++r) ASSERT_EQ(hot_buf[r * k + 3], w[r * cols + hot[3]]);
        // Scatter both halves into a blank matrix: it must equal the original bit for bit.
        std::vector<float> back(rows * cols, std::nanf(""));
        k2->ScatterColumns(hot_buf.data(), 4, rows, cols, hot.data(), k, back.data());
        k2->ScatterColumns(cold_buf.data(), 4, rows, cols, cold.data(), cols - k, back.data());
        ExpectBitsEqual(w, back, std::string(k2->name()) + " round trip");
      } else {
        // As 2-byte elements over a bf16 matrix.
        std::vector<uint16_t> w16 = ToBf16(w), h16(rows * k), c16(rows * (cols - k)),
                              back(rows * cols, 0xffff);
        k2->GatherColumns(w16.data(), 2, rows, cols, hot.data(), k, h16.data());
        k2->GatherColumns(w16.data(), 2, rows, cols, cold.data(), cols - k, c16.data());
        k2->ScatterColumns(h16.data(), 2, rows, cols, hot.data(), k, back.data());
        k2->ScatterColumns(c16.data(), 2, rows, cols, cold.data(), cols - k, back.data());
        ExpectBitsEqual(w16, back, std::string(k2->name()) + " bf16 round trip");
      }
    }
  }
}

// The converting column moves (bf16 parameters with fp32 masters, the engine's moves into the
// daemon's slots): for every pair of element types, GatherColumnsAs equals GatherColumns then the
// conversion, ScatterColumnsAs equals the conversion then ScatterColumns, bit for bit, for every
// CPU backend, the oracle and the base class's default (over random bit patterns: rounding ties,
// denormals, infinities, NaNs); the scatter leaves the other columns alone.
TEST(OptimizerCpu, ConvertingColumnMovesEqualMoveThenConvert) {
  const int64_t rows = 33, cols = 70, k = 23;
  std::mt19937 rng(77);
  std::vector<uint32_t> bits(rows * cols);
  for (uint32_t& b : bits) b = rng();
  std::vector<float> f(rows * cols);
  memcpy(f.data(), bits.data(), f.size() * 4);
  for (int64_t i = 0; i < rows * cols; i += 7) f[i] = 1.0f + std::ldexp(1.0f, -8);  // a tie
  std::vector<int64_t> idx;
  for (int64_t c = 0; c < cols && static_cast<int64_t>(idx.size()) < k; c += 3) idx.push_back(c);
  ASSERT_EQ(static_cast<int64_t>(idx.size()), k);
  std::vector<uint16_t> w16 = ToBf16(f);
  const OptimizerKernel& ref = ReferenceKernel();
  // A [n] array of type t as bytes: the fp32 or bf16 source, or a poisoned destination.
  auto source = [&](GradType t) {
    std::vector<uint8_t> b(rows * cols * GradTypeSize(t));
    memcpy(b.data(), t == GradType::kBf16 ? static_cast<const void*>(w16.data()) : f.data(),
           b.size());
    return b;
  };
  // Converts n elements of type st into type dt through the oracle (a copy when equal).
  auto convert = [&](GradType st, const std::vector<uint8_t>& in, GradType dt, int64_t n) {
    std::vector<uint8_t> out(n * GradTypeSize(dt));
    if (st == dt) memcpy(out.data(), in.data(), out.size());
    else if (st == GradType::kBf16)
      ref.Bf16ToFloat(reinterpret_cast<const uint16_t*>(in.data()),
                      reinterpret_cast<float*>(out.data()), n);
    else
      ref.FloatToBf16(reinterpret_cast<const float*>(in.data()),
                      reinterpret_cast<uint16_t*>(out.data()), n);
    return out;
  };
  const GradType types[2] = {GradType::kFp32, GradType::kBf16};
  // The base class's defaults, through a kernel that overrides nothing else of them.
  struct Defaults final : OptimizerKernel {
    const OptimizerKernel& r = ReferenceKernel();
    const char* name() const override { return "defaults"; }
    void Accumulate(float* a, const void* g, GradType t, float s, int64_t n,
                    AccumulateMode m) const override { r.Accumulate(a, g, t, s, n, m); }
    void AdamW(const AdamWConfig& c, float* p, float* m, float* v, const void* g, GradType t,
               int64_t n, ParamOut o) const override { r.AdamW(c, p, m, v, g, t, n, o); }
    void AdamWColumns(const AdamWConfig& c, const float* ss, const float* bc, float* p, float* m,
                      float* v, const void* g, GradType t, int64_t rw, int64_t cl,
                      ParamOut o) const override {
      r.AdamWColumns(c, ss, bc, p, m, v, g, t, rw, cl, o);
    }
    void AccumulateAdamW(const AdamWConfig& c, float* p, float* m, float* v, const float* a,
                         const void* g, GradType t, float s, int64_t n,
                         ParamOut o) const override {
      r.AccumulateAdamW(c, p, m, v, a, g, t, s, n, o);
    }
    void FloatToBf16(const float* s, uint16_t* d, int64_t n) const override { r.FloatToBf16(s, d, n); }
    void Bf16ToFloat(const uint16_t* s, float* d, int64_t n) const override { r.Bf16ToFloat(s, d, n); }
    void ColumnScores(const void* g, GradType t, int64_t rw, int64_t cl, int64_t ld, float* l1,
                      float* l2) const override { r.ColumnScores(g, t, rw, cl, ld, l1, l2); }
    void TopK(const float* s, int64_t n, int64_t kk, int64_t* i) const override { r.TopK(s, n, kk, i); }
    void GatherColumns(const void* s, size_t e, int64_t rw, int64_t ld, const int64_t* i,
                       int64_t kk, void* d) const override { r.GatherColumns(s, e, rw, ld, i, kk, d); }
    void ScatterColumns(const void* s, size_t e, int64_t rw, int64_t ld, const int64_t* i,
                        int64_t kk, void* d) const override { r.ScatterColumns(s, e, rw, ld, i, kk, d); }
  } defaults;
  std::vector<const OptimizerKernel*> all = FastKernels();
  all.push_back(&ReferenceKernel());
  all.push_back(&defaults);
  for (GradType st : types) {
    for (GradType dt : types) {
      const size_t ss = GradTypeSize(st), ds = GradTypeSize(dt);
      const std::vector<uint8_t> src = source(st);
      // Wanted: the composition through the oracle.
      std::vector<uint8_t> moved(rows * k * ss);
      ref.GatherColumns(src.data(), ss, rows, cols, idx.data(), k, moved.data());
      const std::vector<uint8_t> want_gather = convert(st, moved, dt, rows * k);
      const std::vector<uint8_t> compact(src.begin(), src.begin() + rows * k * ss);
      const std::vector<uint8_t> conv = convert(st, compact, dt, rows * k);
      std::vector<uint8_t> want_scatter(rows * cols * ds, 0x5a);
      ref.ScatterColumns(conv.data(), ds, rows, cols, idx.data(), k, want_scatter.data());
      for (const OptimizerKernel* kk : all) {
        const std::string what = std::string(kk->name()) + (st == GradType::kBf16 ? " bf16" : " fp32") +
                                 (dt == GradType::kBf16 ? " -> bf16" : " -> fp32");
        std::vector<uint8_t> got_gather(rows * k * ds, 0xff);
        kk->GatherColumnsAs(st, src.data(), rows, cols, idx.data(), k, dt, got_gather.data());
        EXPECT_EQ(want_gather, got_gather) << what << " GatherColumnsAs";
        std::vector<uint8_t> got_scatter(rows * cols * ds, 0x5a);
        kk->ScatterColumnsAs(st, compact.data(), rows, cols, idx.data(), k, dt,
                             got_scatter.data());
        EXPECT_EQ(want_scatter, got_scatter) << what << " ScatterColumnsAs";
      }
    }
  }
  // The named forms are the bf16 -> fp32 gather and the fp32 -> bf16 scatter.
  std::vector<float> wide(rows * k), want_wide(rows * k);
  ref.GatherColumnsAs(GradType::kBf16, w16.data(), rows, cols, idx.data(), k, GradType::kFp32,
                      want_wide.data());
  ref.GatherColumnsToFloat(w16.data(), rows, cols, idx.data(), k, wide.data());
  ExpectBitsEqual(want_wide, wide, "GatherColumnsToFloat");
  std::vector<uint16_t> narrow(rows * cols, 1), want_narrow(rows * cols, 1);
  ref.ScatterColumnsAs(GradType::kFp32, f.data(), rows, cols, idx.data(), k, GradType::kBf16,
                       want_narrow.data());
  ref.ScatterColumnsToBf16(f.data(), rows, cols, idx.data(), k, narrow.data());
  ExpectBitsEqual(want_narrow, narrow, "ScatterColumnsToBf16");
}

// The undo log (kernels/undo_log.h) the AdamW kernels keep: logging changes no result; after two
// calls on the range (with a gap between them) the mark names the last vector, which the ring
// holds from before; a kill inside that vector (its elements made garbage here) is finished
// exactly by putting the window back and running the rest again; a call outside the range is
// not logged.
TEST(OptimizerCpu, UndoLogKeepsTheVectorInFlightAndMarksWhatIsDone) {
  constexpr int64_t kN = 300, kOff = 3;  // misaligned
  const AdamWConfig c = ColumnTestConfig();
  const std::vector<int64_t> steps = ColumnSteps(kN);
  const ColumnConstants kc = MakeColumns(c, steps);
  for (const OptimizerKernel* k : FastKernels()) {
    ASSERT_TRUE(k->KeepsUndoLog()) << k->name();
    for (int variant = 0; variant < 4; ++variant) {
      const std::string what = std::string(k->name()) + " variant " + std::to_string(variant);
      std::vector<float> p = Random(kN + kOff, 11), m = Random(kN + kOff, 12, 0.01f),
                         v = Random(kN + kOff, 13, 0.001f), acc = Random(kN + kOff, 14);
      for (float& x : v) x = x * x;
      const std::vector<float> g = Random(kN + kOff, 15);
      // The calls: [10, 87) and [120, 300) of the range; the same calls without a log give want.
      auto call = [&](std::vector<float>& P, std::vector<float>& M, std::vector<float>& V,
                      int64_t b, int64_t e) {
        float *pp = P.data() + kOff + b, *pm = M.data() + kOff + b, *pv = V.data() + kOff + b;
        const float* pa = acc.data() + kOff + b;
        const float* pg = g.data() + kOff + b;
        AdamWConfig cs = c;
        cs.step = 5;
        switch (variant) {
          case 0: k->AdamW(cs, pp, pm, pv, pg, GradType::kFp32, e - b, nullptr); break;
          case 1:
            k->AccumulateAdamW(cs, pp, pm, pv, pa, pg, GradType::kFp32, 0.5f, e - b, nullptr);
            break;
          case 2:  // one row of e - b columns
            k->AdamWColumns(c, kc.step_size.data() + b, kc.bc2_sqrt.data() + b, pp, pm, pv, pg,
                            GradType::kFp32, 1, e - b, nullptr);
            break;
          default:
            k->AccumulateAdamWColumns(c, kc.step_size.data() + b, kc.bc2_sqrt.data() + b, pp, pm,
                                      pv, pa, pg, GradType::kFp32, 0.5f, 1, e - b, nullptr);
        }
      };
      std::vector<float> wp = p, wm = m, wv = v;
      call(wp, wm, wv, 10, 87);
      call(wp, wm, wv, 120, kN);

      std::vector<float> ring(3 * kUndoRing, -1.0f);
      uint64_t mark = UndoMark(7, 0, 0);
      UndoLog log;
      log.base[0] = p.data() + kOff;
      log.base[1] = m.data() + kOff;
      log.base[2] = v.data() + kOff;
      log.ring = ring.data();
      log.elems = kN;
      log.mark = &mark;
      log.tag = 7;
      const std::vector<float> old_p = p, old_m = m, old_v = v;
      {
        ScopedUndoLog active(&log);
        call(p, m, v, 10, 87);
        call(p, m, v, 120, kN);
        // Outside the range (its first element before the range's): not logged.
        const uint64_t before = mark;
        std::vector<float> q = old_p, qm = old_m, qv = old_v;
        k->AdamW(c, q.data(), qm.data(), qv.data(), g.data(), GradType::kFp32, 5, nullptr);
        EXPECT_EQ(mark, before) << what;
      }
      EXPECT_EQ(ActiveUndoLog(), nullptr);
      ExpectBitsEqual(wp, p, what + " param");
      ExpectBitsEqual(wm, m, what + " m");
      ExpectBitsEqual(wv, v, what + " v");
      // The last vector of [120, 300) for this backend's width.
      const int64_t width = std::string(k->name()) == "avx512" ? 16
                            : std::string(k->name()) == "avx2" ? 8 : 1;
      const int64_t rest = (kN - 120) % width;
      const uint64_t done = static_cast<uint64_t>(rest != 0 ? kN - rest : kN - width);
      const uint64_t window = static_cast<uint64_t>(rest != 0 ? rest : width);
      EXPECT_EQ(UndoMarkTag(mark), 7u) << what;
      EXPECT_FALSE(UndoMarkWhole(mark)) << what;
      EXPECT_EQ(UndoMarkDone(mark), done) << what;
      EXPECT_EQ(UndoMarkWindow(mark), window) << what;
      const std::vector<float>* olds[3] = {&old_p, &old_m, &old_v};
      for (int a = 0; a < 3; ++a)
        for (uint64_t i = 0; i < window; ++i)
          EXPECT_EQ(ring[a * kUndoRing + UndoRingAt(done) + i], (*olds[a])[kOff + done + i])
              << what << " array " << a << " element " << done + i;
      // A kill inside the last vector: its elements anything. Put the window back and run again
      // from `done`: the uninterrupted result.
      std::vector<float>* arrays[3] = {&p, &m, &v};
      for (int a = 0; a < 3; ++a)
        for (uint64_t i = 0; i < window; ++i) (*arrays[a])[kOff + done + i] = 1e30f;
      for (int a = 0; a < 3; ++a)
        for (uint64_t i = 0; i < window; ++i)
          (*arrays[a])[kOff + done + i] = ring[a * kUndoRing + UndoRingAt(done) + i];
      call(p, m, v, static_cast<int64_t>(done), kN);
      ExpectBitsEqual(wp, p, what + " param, finished");
      ExpectBitsEqual(wm, m, what + " m, finished");
      ExpectBitsEqual(wv, v, what + " v, finished");
    }
  }
}

}  // namespace
}  // namespace kernels
}  // namespace stallfree
