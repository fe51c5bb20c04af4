// The CUDA optimizer and selection kernels against the scalar oracle, ReferenceKernel(), and
// against PyTorch's AdamW trajectories (tests/testdata/torch/adamw_seed*).
//
// A plain binary (run by make gpu-check, or by hand from the repository root or the gpu-check
// bundle, so that tests/testdata/torch/... resolves): one "PASS|FAIL <name> max_err=<x> tol=<y>"
// line per check, exit status 1 if any fails. Without a device it prints "SKIP: <reason>" and
// exits 0.
//
// The element-wise kernels are built to be bit-identical to the oracle (explicitly rounded fp32
// operations in the oracle's order), so those checks demand exact bit patterns (tol=0; max_err
// is the largest relative difference, printed only to size a failure). Each case compares the
// whole host mirror of every buffer, including elements before a misaligned start, so a write
// outside [0, n) is caught. Sizes are not multiples of 4, and the offsets cover all arrays
// shifted by one element (the vector path with a head) and arrays shifted differently (the
// scalar path).
#include "kernels/cuda/optimizer_cuda.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "kernels/optimizer.h"
#include "tests/kernels/cuda_test_util.h"
#include "tests/kernels/testdata.h"

namespace {

using stallfree::kernels::AccumulateMode;
using stallfree::kernels::AdamWConfig;
using stallfree::kernels::GradType;
using stallfree::kernels::OptimizerKernel;
using stallfree::kernels::ReferenceKernel;
namespace dmem = stallfree::kernels::cuda::dmem;
using stallfree::testing::CheckOk;
using stallfree::testing::DeviceArray;

const OptimizerKernel& Ref() { return ReferenceKernel(); }

int g_failures = 0;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// One named check: the largest error over its cases against a tolerance; prints one line.
class Result {
 public:
  Result(std::string name, double tol) : name_(std::move(name)), tol_(tol) {}
  ~Result() {
    std::printf("%s %s max_err=%.3g tol=%.3g%s%s\n", ok_ ? "PASS" : "FAIL", name_.c_str(), max_,
                tol_, ok_ ? "" : "  first failure: ", ok_ ? "" : first_.c_str());
    std::fflush(stdout);
    if (!ok_) ++g_failures;
  }
  Result(const Result&) = delete;
  Result& operator=(const Result&) = delete;

  void Add(double err, const std::string& where) {
    if (std::isnan(err) || err > max_) max_ = std::isnan(err) ? INFINITY : err;
    if (!(err <= tol_)) Fail(where);
  }
  void Fail(const std::string& why) {
    if (ok_) first_ = why;
    ok_ = false;
  }

 private:
  std::string name_;
  double tol_;
  double max_ = 0;
  bool ok_ = true;
  std::string first_;
};

// 0 if the bit patterns agree, else the relative difference (at least DBL_MIN, so -0 vs +0
// counts; infinite where a NaN is involved).
double BitError(float got, float want) {
  if (Bits(got) == Bits(want)) return 0.0;
  if (std::isnan(got) || std::isnan(want) || std::isinf(got) || std::isinf(want)) {
    return INFINITY;
  }
  const double d = std::fabs(double(got) - double(want)) / std::max(std::fabs(double(want)), 1e-30);
  return std::max(d, DBL_MIN);
}
double ElementError(float got, float want) { return BitError(got, want); }
double ElementError(uint16_t got, uint16_t want) {
  return BitError(stallfree::Bf16ToFloat(got), stallfree::Bf16ToFloat(want));
}
double ElementError(int64_t got, int64_t want) { return got == want ? 0.0 : 1.0; }
double ElementError(uint32_t got, uint32_t want) { return got == want ? 0.0 : 1.0; }
std::string Show(float x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g (0x%08x)", x, Bits(x));
  return buf;
}
std::string Show(uint16_t x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "bf16 0x%04x", x);
  return buf;
}
std::string Show(int64_t x) { return std::to_string(x); }
std::string Show(uint32_t x) { return std::to_string(x); }

// Every element must match exactly (bit patterns for floats).
template <typename T>
void CompareExact(Result* r, const std::vector<T>& got, const std::vector<T>& want,
                  const std::string& where) {
  if (got.size() != want.size()) {
    r->Fail(where + ": size " + std::to_string(got.size()) + " vs " + std::to_string(want.size()));
    return;
  }
  double max_err = 0;
  int64_t first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = ElementError(got[i], want[i]);
    if (e != 0 && first < 0) first = static_cast<int64_t>(i);
    if (std::isnan(e) || e > max_err) max_err = e;
  }
  r->Add(max_err, first < 0 ? where
                            : where + ": element " + std::to_string(first) + " got " +
                                  Show(got[first]) + " want " + Show(want[first]));
}

// Deterministic pseudo-random numbers (splitmix64; Box-Muller for normals): fast enough for
// tens of millions of values, and every case draws fresh ones from its own seed.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9e3779b97f4a7c15ull + 1) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double Uniform() { return (Next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
  float Normal() {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    const double u1 = 1.0 - Uniform(), u2 = Uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = static_cast<float>(r * std::sin(6.283185307179586 * u2));
    have_spare_ = true;
    return static_cast<float>(r * std::cos(6.283185307179586 * u2));
  }

 private:
  uint64_t s_;
  bool have_spare_ = false;
  float spare_ = 0;
};

std::vector<float> Normal(size_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> x(n);
  for (float& v : x) v = rng.Normal() * scale;
  return x;
}

// Gradients spanning 1e-3 .. 10 (per element), as adamw_test draws them.
std::vector<float> GradValues(size_t n, uint64_t seed) {
  std::vector<float> g = Normal(n, seed);
  for (size_t i = 0; i < n; ++i) g[i] *= std::pow(10.0f, float(i % 5) - 3.0f);
  return g;
}

std::vector<uint16_t> ToBf16(const std::vector<float>& x) {
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = stallfree::FloatToBf16(x[i]);
  return h;
}

// A gradient array, fp32 or bf16, on the host and the device.
struct Grad {
  GradType type;
  std::vector<float> f;
  std::vector<uint16_t> h;
  std::unique_ptr<DeviceArray<float>> df;
  std::unique_ptr<DeviceArray<uint16_t>> dh;

  Grad(GradType t, const std::vector<float>& values) : type(t) {
    if (t == GradType::kBf16) {
      h = ToBf16(values);
      dh = std::make_unique<DeviceArray<uint16_t>>(h);
    } else {
      f = values;
      df = std::make_unique<DeviceArray<float>>(f);
    }
  }
  const void* host(int64_t off) const {
    return type == GradType::kBf16 ? static_cast<const void*>(h.data() + off)
                                   : static_cast<const void*>(f.data() + off);
  }
  const void* dev(int64_t off) const {
    return type == GradType::kBf16 ? static_cast<const void*>(dh->get() + off)
                                   : static_cast<const void*>(df->get() + off);
  }
};

const char* TypeName(GradType t) { return t == GradType::kBf16 ? "bf16" : "fp32"; }

std::string Case(int64_t n, std::initializer_list<int> offsets) {
  std::string s = "n=" + std::to_string(n) + " offsets=";
  for (int o : offsets) s += std::to_string(o);
  return s;
}

// ------------------------------------------------------------------------------------------------

void TestAccumulate(const OptimizerKernel& gpu) {
  struct Off {
    int acc, grad;
  };
  const Off offsets[] = {{0, 0}, {1, 1}, {2, 2}, {1, 0}, {0, 3}};
  const int64_t sizes[] = {1, 3, 4, 7, 1001, 3000001};
  uint64_t seed = 100;
  for (GradType type : {GradType::kFp32, GradType::kBf16}) {
    for (AccumulateMode mode : {AccumulateMode::kAdd, AccumulateMode::kOverwrite}) {
      Result r(std::string("accumulate_") + TypeName(type) +
                   (mode == AccumulateMode::kAdd ? "_add" : "_overwrite"),
               0.0);
      for (int64_t n : sizes) {
        for (const Off& o : offsets) {
          std::vector<float> acc = Normal(n + o.acc, ++seed);
          Grad g(type, GradValues(n + o.grad, ++seed));
          DeviceArray<float> dacc(acc);
          const float scale = 0.375f;
          Ref().Accumulate(acc.data() + o.acc, g.host(o.grad), type, scale, n, mode);
          gpu.Accumulate(dacc.get() + o.acc, g.dev(o.grad), type, scale, n, mode);
          CheckOk(gpu.Synchronize(), "Accumulate");
          CompareExact(&r, dacc.Get(), acc, Case(n, {o.acc, o.grad}));
        }
      }
    }
  }
}

struct AdamWOffsets {
  int p, m, v, g, out;
};
const AdamWOffsets kAdamWOffsets[] = {
    {0, 0, 0, 0, 0},  // aligned
    {1, 1, 1, 1, 1},  // all shifted alike: head + vectors + tail
    {3, 3, 3, 3, 3},  // the longest head
    {1, 0, 0, 0, 0},  // mixed (scalar path): param
    {0, 0, 0, 1, 0},  // gradient
    {0, 0, 0, 0, 2},  // bf16 copy
};

void TestAdamW(const OptimizerKernel& gpu) {
  const int64_t sizes[] = {5, 1000003};
  const int kSteps = 20;
  uint64_t seed = 1000;
  for (GradType type : {GradType::kFp32, GradType::kBf16}) {
    for (bool out : {false, true}) {
      Result r(std::string("adamw_") + TypeName(type) + (out ? "_bf16out" : "") + "_20steps", 0.0);
      for (int64_t n : sizes) {
        for (const AdamWOffsets& o : kAdamWOffsets) {
          std::vector<float> p = Normal(n + o.p, ++seed), m(n + o.m, 0.0f), v(n + o.v, 0.0f);
          std::vector<uint16_t> bf(n + o.out, 0xdeadu);
          DeviceArray<float> dp(p), dm(m), dv(v);
          DeviceArray<uint16_t> dbf(bf);
          // One long gradient pool; step t reads a window shifted by 131 elements.
          Grad pool(type, GradValues(n + o.g + 131 * kSteps, ++seed));
          AdamWConfig c;
          c.lr = 3e-3;
          c.beta1 = 0.9;
          c.beta2 = 0.95;
          c.eps = 1e-8;
          c.weight_decay = 0.1;
          c.grad_scale = 0.5f;
          for (int t = 1; t <= kSteps; ++t) {
            c.step = t;
            const int64_t go = o.g + 131 * (t - 1);
            Ref().AdamW(c, p.data() + o.p, m.data() + o.m, v.data() + o.v, pool.host(go), type, n,
                        out ? bf.data() + o.out : nullptr);
            gpu.AdamW(c, dp.get() + o.p, dm.get() + o.m, dv.get() + o.v, pool.dev(go), type, n,
                      out ? dbf.get() + o.out : nullptr);
          }
          CheckOk(gpu.Synchronize(), "AdamW");
          const std::string where = Case(n, {o.p, o.m, o.v, o.g, o.out});
          CompareExact(&r, dp.Get(), p, where + " param");
          CompareExact(&r, dm.Get(), m, where + " exp_avg");
          CompareExact(&r, dv.Get(), v, where + " exp_avg_sq");
          CompareExact(&r, dbf.Get(), bf, where + " bf16_out");
        }
      }
    }
  }
  // A step count where a float or bf16 counter would have saturated the bias corrections.
  Result r("adamw_step_1e6", 0.0);
  std::vector<float> p = Normal(1003, 7), m = Normal(1003, 8, 0.1f), v = Normal(1003, 9, 0.1f);
  for (float& x : v) x = x * x;
  std::vector<float> g = GradValues(1003, 10);
  DeviceArray<float> dp(p), dm(m), dv(v), dg(g);
  AdamWConfig c;
  c.step = 1000000;
  Ref().AdamW(c, p.data(), m.data(), v.data(), g.data(), GradType::kFp32, 1003, nullptr);
  gpu.AdamW(c, dp.get(), dm.get(), dv.get(), dg.get(), GradType::kFp32, 1003, nullptr);
  CheckOk(gpu.Synchronize(), "AdamW");
  CompareExact(&r, dp.Get(), p, "param");
  CompareExact(&r, dv.Get(), v, "exp_avg_sq");
}

// AdamWColumns: every column at its own step (1, 2, 1000, 3e9 between neighbours), three rounds
// with every step advancing, against the oracle bit for bit. Shapes from one element to blocks
// larger than one grid-stride sweep (the column index wraps as the threads advance); the arrays
// start one element in (two for the bf16 copy) so that a write outside the block is caught.
void TestAdamWColumns(const OptimizerKernel& gpu) {
  struct Shape {
    int64_t rows, cols;
  };
  const Shape shapes[] = {{1, 1},    {7, 3},     {64, 17},   {7, 33},
                          {64, 1000}, {1, 300007}, {257, 4099}};
  const int64_t pool[] = {3000000000, 1, 2, 1000};
  uint64_t seed = 3000;
  for (GradType type : {GradType::kFp32, GradType::kBf16}) {
    for (bool out : {false, true}) {
      Result r(std::string("adamw_columns_") + TypeName(type) + (out ? "_bf16out" : "") +
                   "_3steps",
               0.0);
      for (const Shape& s : shapes) {
        const int64_t n = s.rows * s.cols;
        const int off = 1, out_off = 2;
        std::vector<float> p = Normal(n + off, ++seed), m = Normal(n + off, ++seed, 0.01f),
                           v = Normal(n + off, ++seed, 0.01f);
        for (float& x : v) x = x * x;
        std::vector<uint16_t> bf(n + out_off, 0xdeadu);
        DeviceArray<float> dp(p), dm(m), dv(v);
        DeviceArray<uint16_t> dbf(bf);
        std::vector<int64_t> steps(s.cols);
        for (int64_t c = 0; c < s.cols; ++c) steps[c] = pool[(5 * c + c / 4) % 4];
        AdamWConfig c;
        c.lr = 3e-3;
        c.beta2 = 0.95;
        c.weight_decay = 0.1;
        c.grad_scale = 0.5f;
        c.step = 77;  // ignored
        for (int round = 0; round < 3; ++round) {
          std::vector<float> step_size(s.cols), bc2_sqrt(s.cols);
          stallfree::kernels::MakeColumnConstants(c, steps.data(), s.cols, step_size.data(),
                                                  bc2_sqrt.data());
          DeviceArray<float> dstep(step_size), dbc2(bc2_sqrt);
          Grad g(type, GradValues(n + off, ++seed));
          Ref().AdamWColumns(c, step_size.data(), bc2_sqrt.data(), p.data() + off, m.data() + off,
                             v.data() + off, g.host(off), type, s.rows, s.cols,
                             out ? bf.data() + out_off : nullptr);
          gpu.AdamWColumns(c, dstep.get(), dbc2.get(), dp.get() + off, dm.get() + off,
                           dv.get() + off, g.dev(off), type, s.rows, s.cols,
                           out ? dbf.get() + out_off : nullptr);
          CheckOk(gpu.Synchronize(), "AdamWColumns");
          for (int64_t& t : steps) ++t;
        }
        const std::string where = std::to_string(s.rows) + "x" + std::to_string(s.cols);
        CompareExact(&r, dp.Get(), p, where + " param");
        CompareExact(&r, dm.Get(), m, where + " exp_avg");
        CompareExact(&r, dv.Get(), v, where + " exp_avg_sq");
        CompareExact(&r, dbf.Get(), bf, where + " bf16_out");
      }
    }
  }
}

void TestAccumulateAdamW(const OptimizerKernel& gpu) {
  struct Source {
    const char* name;
    bool has_grad;
    GradType type;
  };
  const Source sources[] = {{"acc_only", false, GradType::kFp32},
                            {"acc_fp32", true, GradType::kFp32},
                            {"acc_bf16", true, GradType::kBf16}};
  const int64_t sizes[] = {7, 1000003};
  uint64_t seed = 5000;
  for (const Source& s : sources) {
    for (bool out : {false, true}) {
      Result r(std::string("accumulate_adamw_") + s.name + (out ? "_bf16out" : ""), 0.0);
      for (int64_t n : sizes) {
        for (const AdamWOffsets& o : kAdamWOffsets) {
          const int oa = o.g;  // the accumulator shifts with the gradient
          std::vector<float> p = Normal(n + o.p, ++seed), m(n + o.m, 0.0f), v(n + o.v, 0.0f);
          std::vector<uint16_t> bf(n + o.out, 0xbeefu);
          DeviceArray<float> dp(p), dm(m), dv(v);
          DeviceArray<uint16_t> dbf(bf);
          AdamWConfig c;
          c.lr = 1e-3;
          c.weight_decay = 0.01;
          c.grad_scale = 0.5f;
          for (int t = 1; t <= 3; ++t) {
            c.step = t;
            std::vector<float> acc = GradValues(n + oa, ++seed);
            const std::vector<float> acc_before = acc;
            DeviceArray<float> dacc(acc);
            Grad g(s.type, GradValues(n + o.g, ++seed));
            Ref().AccumulateAdamW(c, p.data() + o.p, m.data() + o.m, v.data() + o.v,
                                  acc.data() + oa, s.has_grad ? g.host(o.g) : nullptr, s.type,
                                  0.25f, n, out ? bf.data() + o.out : nullptr);
            gpu.AccumulateAdamW(c, dp.get() + o.p, dm.get() + o.m, dv.get() + o.v, dacc.get() + oa,
                                s.has_grad ? g.dev(o.g) : nullptr, s.type, 0.25f, n,
                                out ? dbf.get() + o.out : nullptr);
            CheckOk(gpu.Synchronize(), "AccumulateAdamW");
            CompareExact(&r, dacc.Get(), acc_before, Case(n, {o.p, o.g}) + " acc (read only)");
          }
          const std::string where = Case(n, {o.p, o.m, o.v, o.g, o.out});
          CompareExact(&r, dp.Get(), p, where + " param");
          CompareExact(&r, dm.Get(), m, where + " exp_avg");
          CompareExact(&r, dv.Get(), v, where + " exp_avg_sq");
          CompareExact(&r, dbf.Get(), bf, where + " bf16_out");
        }
      }
    }
  }
}

bool IsBf16Nan(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x007fu) != 0; }

void TestConversions(const OptimizerKernel& gpu) {
  {
    // Every bf16 value, at an aligned and a misaligned start.
    Result r("bf16_to_float_all_65536", 0.0);
    std::vector<uint16_t> all(65536);
    for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
    DeviceArray<uint16_t> dsrc(all);
    for (int off : {0, 1}) {
      const int64_t n = 65536 - off;  // offset 1: head, vectors and a tail
      std::vector<float> want(n + off, -1.0f);
      DeviceArray<float> ddst(want);
      Ref().Bf16ToFloat(all.data() + off, want.data() + off, n);
      gpu.Bf16ToFloat(dsrc.get() + off, ddst.get() + off, n);
      CheckOk(gpu.Synchronize(), "Bf16ToFloat");
      CompareExact(&r, ddst.Get(), want, "offset " + std::to_string(off));
    }
  }
  // Floats that probe the rounding: every bf16 value widened, and with low halves exactly at
  // the tie (0x8000, odd and even upper halves), just below / above it, the smallest and largest
  // low halves; then special values and random bit patterns.
  std::vector<float> in;
  for (uint32_t h = 0; h < 65536; ++h) {
    for (uint32_t low : {0x0000u, 0x8000u, 0x7fffu, 0x8001u, 0x0001u, 0xffffu}) {
      in.push_back(FromBits((h << 16) | low));
    }
  }
  const uint32_t specials[] = {0x7f800000u, 0xff800000u, 0x7f7fffffu, 0x7f7f8000u, 0x7f7f7fffu,
                               0x00000001u, 0x80000001u, 0x00008000u, 0x00018000u, 0x80000000u,
                               0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fbfffffu,
                               0x7f80ffffu, 0x7fffffffu, 0xffffffffu, 0x3f808000u, 0x3f818000u};
  for (uint32_t s : specials) in.push_back(FromBits(s));
  Rng rng(77);
  for (int i = 0; i < 1000000; ++i) in.push_back(FromBits(static_cast<uint32_t>(rng.Next())));
  in.push_back(1.0f);  // odd length
  if (in.size() % 4 == 0) in.push_back(2.0f);
  const int64_t n_all = static_cast<int64_t>(in.size());
  Result r("float_to_bf16_rne_specials_random", 0.0);
  int64_t nan_inputs = 0, nan_payload_equal = 0;
  DeviceArray<float> dsrc(in);
  for (int off : {0, 1}) {
    const int64_t n = n_all - off;
    std::vector<uint16_t> want(n + off, 0x5555u), got;
    DeviceArray<uint16_t> ddst(want);
    Ref().FloatToBf16(in.data() + off, want.data() + off, n);
    gpu.FloatToBf16(dsrc.get() + off, ddst.get() + off, n);
    CheckOk(gpu.Synchronize(), "FloatToBf16");
    got = ddst.Get();
    // The contract: round to nearest even, NaN stays NaN. Exact for every number; for NaN
    // inputs the result must be a NaN (payloads matching the oracle is counted, not required).
    double max_err = 0;
    std::string first;
    for (size_t i = 0; i < got.size(); ++i) {
      double e;
      if (IsBf16Nan(want[i])) {
        ++nan_inputs;
        nan_payload_equal += got[i] == want[i];
        e = IsBf16Nan(got[i]) ? 0.0 : INFINITY;
      } else {
        e = ElementError(got[i], want[i]);
      }
      if (e != 0 && first.empty()) {
        first = "offset " + std::to_string(off) + " input " + Show(i >= size_t(off) ? in[i] : 0) +
                " got " + Show(got[i]) + " want " + Show(want[i]);
      }
      max_err = std::max(max_err, e);
    }
    r.Add(max_err, first);
  }
  std::printf("INFO float_to_bf16: %lld NaN inputs, %lld with the oracle's exact NaN bits\n",
              static_cast<long long>(nan_inputs), static_cast<long long>(nan_payload_equal));
}

// Column scores against sums in double. fp32 summation of m terms in any order is within
// (m - 1) * 2^-24 * sum|terms| of the exact sum, plus one rounding of each square: the tolerance
// is relative to sum|x| (l1) or sum x^2 (l2sq) with a 2x margin.
void TestColumnScores(const OptimizerKernel& gpu) {
  struct Shape {
    int64_t rows, cols, ld;
  };
  const Shape shapes[] = {{1, 1, 1},          {7, 5, 9},         {64, 33, 40},
                          {1000, 333, 337},   {3, 5000, 5001},   {20000, 7, 8},
                          {4096, 4096, 4096}, {513, 4099, 4100}, {0, 10, 10}};
  uint64_t seed = 9000;
  for (GradType type : {GradType::kFp32, GradType::kBf16}) {
    double max_norm_err = 0;
    std::string first;
    for (const Shape& s : shapes) {
      // Padding columns hold 1e30: reading one would dominate the sum.
      std::vector<float> g = Normal(static_cast<size_t>(s.rows * s.ld), ++seed);
      for (int64_t rr = 0; rr < s.rows; ++rr) {
        for (int64_t c = s.cols; c < s.ld; ++c) g[rr * s.ld + c] = 1e30f;
      }
      if (type == GradType::kBf16) {
        for (float& x : g) x = stallfree::Bf16ToFloat(stallfree::FloatToBf16(x));
      }
      Grad dg(type, g);
      std::vector<double> w1(s.cols, 0.0), w2(s.cols, 0.0);
      for (int64_t rr = 0; rr < s.rows; ++rr) {
        for (int64_t c = 0; c < s.cols; ++c) {
          const double x = g[rr * s.ld + c];
          w1[c] += std::fabs(x);
          w2[c] += x * x;
        }
      }
      const double tol = 2.0 * (static_cast<double>(s.rows) + 2.0) * std::ldexp(1.0, -24);
      // Both outputs, then each alone (the other null); outputs poisoned with NaN.
      for (int which = 0; which < 3; ++which) {
        const bool want1 = which != 2, want2 = which != 1;
        std::vector<float> poison(s.cols, std::numeric_limits<float>::quiet_NaN());
        DeviceArray<float> d1(poison), d2(poison);
        gpu.ColumnScores(dg.dev(0), type, s.rows, s.cols, s.ld, want1 ? d1.get() : nullptr,
                         want2 ? d2.get() : nullptr);
        CheckOk(gpu.Synchronize(), "ColumnScores");
        const std::vector<float> g1 = d1.Get(), g2 = d2.Get();
        for (int64_t c = 0; c < s.cols; ++c) {
          for (int o = 0; o < 2; ++o) {
            if (!(o == 0 ? want1 : want2)) continue;
            const double got = o == 0 ? g1[c] : g2[c];
            const double want = o == 0 ? w1[c] : w2[c];
            // Normalised error: |got - want| / (want * tol), <= 1 passes. (rows == 0: exact 0.)
            double e = std::fabs(got - want) / (std::max(want, 1e-300) * tol);
            if (s.rows == 0) e = got == 0.0 ? 0.0 : INFINITY;
            if (std::isnan(e)) e = INFINITY;
            if (e > 1.0 && first.empty()) {
              first = "rows=" + std::to_string(s.rows) + " cols=" + std::to_string(s.cols) +
                      " ld=" + std::to_string(s.ld) + (o == 0 ? " l1[" : " l2sq[") +
                      std::to_string(c) + "] got " + std::to_string(got) + " want " +
                      std::to_string(want);
            }
            max_norm_err = std::max(max_norm_err, e);
          }
        }
      }
    }
    // Reported as a fraction of each column's bound (tol=1).
    Result r(std::string("column_scores_") + TypeName(type) + "_vs_double_err_over_bound", 1.0);
    r.Add(max_norm_err, first);
  }
}

void TestTopK(const OptimizerKernel& gpu) {
  Result r("topk_ties_nans_vs_host_sort", 0.0);
  const int64_t sizes[] = {1, 2, 17, 4096, 100003, 1000000, 33};  // grows, then shrinks
  uint64_t seed = 12000;
  for (int64_t n : sizes) {
    for (int dist = 0; dist < 5; ++dist) {
      if (n == 1000000 && dist > 1) continue;
      Rng rng(++seed);
      std::vector<float> s(n);
      for (int64_t i = 0; i < n; ++i) {
        switch (dist) {
          case 0:  // distinct-ish normals
            s[i] = rng.Normal();
            break;
          case 1: {  // many ties, NaNs (several payloads), signed zeros, infinities
            const uint64_t u = rng.Next() % 100;
            if (u < 5) {
              s[i] = FromBits(u < 2 ? 0x7fc00000u : (u < 4 ? 0xffc00001u : 0x7f800001u));
            } else if (u < 10) {
              s[i] = u < 7 ? 0.0f : -0.0f;
            } else if (u < 12) {
              s[i] = u == 10 ? INFINITY : -INFINITY;
            } else {
              s[i] = static_cast<float>(static_cast<int>(u % 8) - 3);
            }
            break;
          }
          case 2:
            s[i] = 1.0f;
            break;
          case 3:
            s[i] = std::numeric_limits<float>::quiet_NaN();
            break;
          default:  // ascending: the best are at the end
            s[i] = static_cast<float>(i) * 0.5f;
        }
      }
      DeviceArray<float> ds(s);
      for (int64_t k : {int64_t{0}, int64_t{1}, n / 3, n - 1, n}) {
        if (k < 0 || k > n) continue;
        std::vector<int64_t> want(k + 1, -7), poison(k + 1, -7);
        DeviceArray<int64_t> dk(poison);
        Ref().TopK(s.data(), n, k, want.data());
        gpu.TopK(ds.get(), n, k, dk.get());
        CheckOk(gpu.Synchronize(), "TopK");
        CompareExact(
            &r, dk.Get(), want,
            "n=" + std::to_string(n) + " k=" + std::to_string(k) + " dist=" + std::to_string(dist));
      }
    }
  }
}

template <typename T>
void ColumnsCase(const OptimizerKernel& gpu, Result* r, int64_t rows, int64_t ld, int64_t k,
                 int src_off, bool sorted, uint64_t seed) {
  Rng rng(seed);
  const size_t es = sizeof(T);
  // W: random bit patterns (NaN patterns included: the moves must copy bits).
  std::vector<T> w(static_cast<size_t>(rows * ld) + src_off);
  for (T& x : w) x = static_cast<T>(rng.Next());
  // A random k-subset of the columns.
  std::vector<int64_t> cols(ld);
  std::iota(cols.begin(), cols.end(), 0);
  for (int64_t i = 0; i < k; ++i) {
    std::swap(cols[i], cols[i + static_cast<int64_t>(rng.Next() % (ld - i))]);
  }
  std::vector<int64_t> sel(cols.begin(), cols.begin() + k);
  if (sorted) std::sort(sel.begin(), sel.end());
  std::vector<int64_t> sel_sorted = sel;
  std::sort(sel_sorted.begin(), sel_sorted.end());
  std::vector<int64_t> comp(ld - k);
  stallfree::kernels::ComplementIndices(sel_sorted.data(), k, ld, comp.data());

  const std::string where = "elem=" + std::to_string(es) + " rows=" + std::to_string(rows) +
                            " ld=" + std::to_string(ld) + " k=" + std::to_string(k) +
                            " src_off=" + std::to_string(src_off) +
                            (sorted ? " sorted" : " unsorted");
  std::vector<int64_t> sel_pad = sel, comp_pad = comp;
  sel_pad.push_back(0);  // never empty for the device copy
  comp_pad.push_back(0);
  DeviceArray<T> dw(w);
  DeviceArray<int64_t> dsel(sel_pad), dcomp(comp_pad);

  // Gather against the oracle.
  std::vector<T> a(static_cast<size_t>(rows * k) + 1, T(0x5a5a)), b(rows * (ld - k) + 1, T(0));
  DeviceArray<T> da(a), db(b);
  Ref().GatherColumns(w.data() + src_off, es, rows, ld, sel.data(), k, a.data());
  gpu.GatherColumns(dw.get() + src_off, es, rows, ld, dsel.get(), k, da.get());
  gpu.GatherColumns(dw.get() + src_off, es, rows, ld, dcomp.get(), ld - k, db.get());
  CheckOk(gpu.Synchronize(), "GatherColumns");
  CompareExact(r, da.Get(), a, where + " gather");

  // Scatter of the selection into a poisoned W-shaped buffer against the oracle (other columns
  // untouched), then the complement on top: the round trip must rebuild W bit for bit.
  std::vector<T> d(static_cast<size_t>(rows * ld), T(0x3c3c));
  DeviceArray<T> dd(d);
  Ref().ScatterColumns(a.data(), es, rows, ld, sel.data(), k, d.data());
  gpu.ScatterColumns(da.get(), es, rows, ld, dsel.get(), k, dd.get());
  CheckOk(gpu.Synchronize(), "ScatterColumns");
  CompareExact(r, dd.Get(), d, where + " scatter");
  gpu.ScatterColumns(db.get(), es, rows, ld, dcomp.get(), ld - k, dd.get());
  CheckOk(gpu.Synchronize(), "ScatterColumns");
  std::vector<T> w_view(w.begin() + src_off, w.end());
  CompareExact(r, dd.Get(), w_view, where + " round trip");

  // bf16 W: the converting moves (GatherColumnsToFloat widens the selected bf16 columns,
  // ScatterColumnsToBf16 rounds fp32 columns into a poisoned bf16 W) against the oracle; the
  // fp32 source of the scatter is random bits (ties, denormals, infinities, NaNs).
  if constexpr (sizeof(T) == 2) {
    std::vector<float> wide(static_cast<size_t>(rows * k) + 1, -1.0f);
    DeviceArray<float> dwide(wide);
    Ref().GatherColumnsToFloat(w.data() + src_off, rows, ld, sel.data(), k, wide.data());
    gpu.GatherColumnsToFloat(dw.get() + src_off, rows, ld, dsel.get(), k, dwide.get());
    CheckOk(gpu.Synchronize(), "GatherColumnsToFloat");
    CompareExact(r, dwide.Get(), wide, where + " gather to fp32");
    std::vector<uint32_t> bits(static_cast<size_t>(rows * k) + 1);
    for (uint32_t& x : bits) x = static_cast<uint32_t>(rng.Next());
    std::vector<float> f(bits.size());
    std::memcpy(f.data(), bits.data(), f.size() * 4);
    std::vector<T> n16(static_cast<size_t>(rows * ld), T(0x3c3c));
    DeviceArray<float> df(f);
    DeviceArray<T> dn16(n16);
    Ref().ScatterColumnsToBf16(f.data(), rows, ld, sel.data(), k, n16.data());
    gpu.ScatterColumnsToBf16(df.get(), rows, ld, dsel.get(), k, dn16.get());
    CheckOk(gpu.Synchronize(), "ScatterColumnsToBf16");
    CompareExact(r, dn16.Get(), n16, where + " scatter to bf16");
  } else {
    // fp32 W: the other two conversions (GatherColumnsAs rounds the selected fp32 columns to
    // bf16, ScatterColumnsAs widens bf16 columns of random bits into a poisoned fp32 W).
    std::vector<uint16_t> narrow(static_cast<size_t>(rows * k) + 1, 0x7777);
    DeviceArray<uint16_t> dnarrow(narrow);
    Ref().GatherColumnsAs(GradType::kFp32, w.data() + src_off, rows, ld, sel.data(), k,
                          GradType::kBf16, narrow.data());
    gpu.GatherColumnsAs(GradType::kFp32, dw.get() + src_off, rows, ld, dsel.get(), k,
                        GradType::kBf16, dnarrow.get());
    CheckOk(gpu.Synchronize(), "GatherColumnsAs fp32 -> bf16");
    CompareExact(r, dnarrow.Get(), narrow, where + " gather to bf16");
    std::vector<uint16_t> h(static_cast<size_t>(rows * k) + 1);
    for (uint16_t& x : h) x = static_cast<uint16_t>(rng.Next());
    std::vector<T> wide(static_cast<size_t>(rows * ld), T(0x3c3c));
    DeviceArray<uint16_t> dh(h);
    DeviceArray<T> dwide(wide);
    Ref().ScatterColumnsAs(GradType::kBf16, h.data(), rows, ld, sel.data(), k, GradType::kFp32,
                           wide.data());
    gpu.ScatterColumnsAs(GradType::kBf16, dh.get(), rows, ld, dsel.get(), k, GradType::kFp32,
                         dwide.get());
    CheckOk(gpu.Synchronize(), "ScatterColumnsAs bf16 -> fp32");
    CompareExact(r, dwide.Get(), wide, where + " scatter to fp32");
  }
}

void TestColumns(const OptimizerKernel& gpu) {
  struct Shape {
    int64_t rows, ld, k;
  };
  const Shape shapes[] = {{1, 1, 1},     {5, 37, 11},     {1000, 4097, 1000}, {300, 300, 0},
                          {3, 100, 100}, {4096, 1024, 3}, {2, 70000, 12345}};
  Result r("gather_scatter_columns_exact", 0.0);
  uint64_t seed = 20000;
  for (const Shape& s : shapes) {
    for (int src_off : {0, 1}) {
      for (bool sorted : {true, false}) {
        ColumnsCase<uint32_t>(gpu, &r, s.rows, s.ld, s.k, src_off, sorted, ++seed);
        ColumnsCase<uint16_t>(gpu, &r, s.rows, s.ld, s.k, src_off, sorted, ++seed);
      }
    }
  }
}

// Invalid arguments are recorded and reported by the next Synchronize(), once.
void TestErrors(const OptimizerKernel& gpu) {
  Result r("errors_reported_once", 0.0);
  std::vector<float> x(16, 1.0f);
  std::vector<int64_t> idx(4, 0);
  DeviceArray<float> dx(x);
  DeviceArray<int64_t> di(idx);
  gpu.GatherColumns(dx.get(), 3, 2, 8, di.get(), 2, dx.get() + 8);
  std::string e1 = gpu.Synchronize();
  std::string e2 = gpu.Synchronize();
  gpu.TopK(dx.get(), 4, 5, di.get());
  std::string e3 = gpu.Synchronize();
  gpu.ColumnScores(dx.get(), GradType::kFp32, 2, 8, 4, dx.get(), nullptr);
  std::string e4 = gpu.Synchronize();
  gpu.AdamWColumns(AdamWConfig(), dx.get(), dx.get(), dx.get(), dx.get(), dx.get(), dx.get(),
                   GradType::kFp32, -1, 4, nullptr);
  std::string e5 = gpu.Synchronize();
  if (e1.empty()) r.Fail("elem_size 3 not reported");
  if (!e2.empty()) r.Fail("error reported twice: " + e2);
  if (e3.empty()) r.Fail("TopK k > n not reported");
  if (e4.empty()) r.Fail("ColumnScores ld < cols not reported");
  if (e5.empty()) r.Fail("AdamWColumns rows < 0 not reported");
  if (dx.Get() != x) r.Fail("an invalid call wrote memory");
  std::printf("INFO errors: \"%s\" / \"%s\" / \"%s\" / \"%s\"\n", e1.c_str(), e3.c_str(),
              e4.c_str(), e5.c_str());
}

// PyTorch's torch.optim.AdamW trajectories, with adamw_test.cc's tolerances; and the same
// trajectory must equal the oracle's bit for bit.
void TestTorch(const OptimizerKernel& gpu) {
  for (const char* seed : {"adamw_seed1", "adamw_seed2"}) {
    const std::string dir = std::string("tests/testdata/torch/") + seed + "/";
    std::vector<float> p = stallfree::testing::LoadF32(dir + "param_init.f32");
    const std::vector<float> grads = stallfree::testing::LoadF32(dir + "grads.f32");
    const std::vector<float> want_p = stallfree::testing::LoadF32(dir + "param_final.f32");
    const std::vector<float> want_m = stallfree::testing::LoadF32(dir + "exp_avg_final.f32");
    const std::vector<float> want_v = stallfree::testing::LoadF32(dir + "exp_avg_sq_final.f32");
    const size_t n = 4096;
    Result r(std::string("torch_") + seed + "_err_over_tol", 1.0);
    if (p.size() != n || grads.size() != 12 * n || want_p.size() != n || want_m.size() != n ||
        want_v.size() != n) {
      r.Fail("cannot read " + dir + " (run from the repository root or the gpu-check bundle)");
      continue;
    }
    const bool seed2 = std::string(seed) == "adamw_seed2";
    AdamWConfig c;
    c.lr = seed2 ? 0.003 : 0.002;  // manifest.json of each seed
    c.beta1 = 0.9;
    c.beta2 = 0.999;
    c.eps = 1e-8;
    c.weight_decay = seed2 ? 0.0 : 0.01;
    std::vector<float> m(n, 0.0f), v(n, 0.0f);
    std::vector<float> rp = p, rm = m, rv = v;
    DeviceArray<float> dp(p), dm(m), dv(v), dg(grads);
    for (int t = 0; t < 12; ++t) {
      c.step = t + 1;
      gpu.AdamW(c, dp.get(), dm.get(), dv.get(), dg.get() + t * n, GradType::kFp32, n, nullptr);
      Ref().AdamW(c, rp.data(), rm.data(), rv.data(), grads.data() + t * n, GradType::kFp32, n,
                  nullptr);
    }
    CheckOk(gpu.Synchronize(), "AdamW (torch)");
    p = dp.Get();
    m = dm.Get();
    v = dv.Get();
    // PyTorch differs only in fp32 operation order. Parameters: 2e-6 relative (+1e-7); moments
    // relative to the element's largest gradient (they can cancel far below it).
    double worst = 0;
    std::string first;
    for (size_t i = 0; i < n; ++i) {
      double gmax = 0;
      for (int t = 0; t < 12; ++t) gmax = std::max(gmax, double(std::fabs(grads[t * n + i])));
      const double ep = std::fabs(double(p[i]) - want_p[i]) / (2e-6 * std::fabs(want_p[i]) + 1e-7);
      const double em = std::fabs(double(m[i]) - want_m[i]) / std::max(1e-6 * gmax, 1e-30);
      const double ev = std::fabs(double(v[i]) - want_v[i]) / std::max(1e-6 * gmax * gmax, 1e-30);
      const double e = std::max({ep, em, ev});
      if (!(e <= 1.0) && first.empty()) first = "element " + std::to_string(i);
      worst = std::isnan(e) ? INFINITY : std::max(worst, e);
    }
    r.Add(worst, first);
    Result exact(std::string("torch_") + seed + "_vs_oracle", 0.0);
    CompareExact(&exact, p, rp, "param");
    CompareExact(&exact, m, rm, "exp_avg");
    CompareExact(&exact, v, rv, "exp_avg_sq");
  }
}

}  // namespace

int main() {
  std::string why;
  if (!stallfree::kernels::cuda::DeviceAvailable(&why)) {
    std::printf("SKIP: %s\n", why.c_str());
    return 0;
  }
  // Most checks run on a non-blocking stream (nothing orders it with the legacy stream but the
  // kernel's Synchronize()); the PyTorch trajectories on the legacy default stream.
  void* stream = nullptr;
  const std::string stream_error = dmem::CreateStream(&stream);
  if (!stream_error.empty()) {
    std::printf("FAIL CreateStream: %s\n", stream_error.c_str());
    return 1;
  }
  std::printf("INFO device: %s\n", dmem::DeviceDescription().c_str());
  std::string error;
  std::unique_ptr<OptimizerKernel> gpu =
      stallfree::kernels::cuda::NewCudaOptimizerKernel(stream, &error);
  std::unique_ptr<OptimizerKernel> gpu_default =
      stallfree::kernels::cuda::NewCudaOptimizerKernel(nullptr, &error);
  if (gpu == nullptr || gpu_default == nullptr) {
    std::printf("FAIL NewCudaOptimizerKernel: %s\n", error.c_str());
    return 1;
  }
  TestAccumulate(*gpu);
  TestAdamW(*gpu);
  TestAdamWColumns(*gpu);
  TestAccumulateAdamW(*gpu);
  TestConversions(*gpu);
  TestColumnScores(*gpu);
  TestTopK(*gpu);
  TestColumns(*gpu);
  TestErrors(*gpu);
  TestTorch(*gpu_default);
  gpu.reset();
  gpu_default.reset();
  dmem::DestroyStream(stream);
  std::printf("%s optimizer_cuda_test: %d failing check(s)\n", g_failures == 0 ? "PASS" : "FAIL",
              g_failures);
  return g_failures == 0 ? 0 : 1;
}
