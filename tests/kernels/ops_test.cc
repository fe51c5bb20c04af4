// The CPU transformer ops: every forward against a direct formula evaluated in double here, every
// backward against central finite differences of its own forward.
//
// Finite differences. For an op f and a fixed random R, L(x) = sum(f(x) * R) (summed in double)
// has dL/dx = the op's backward applied to dout = R. The test compares that with
// (L(x + h e_i) - L(x - h e_i)) / 2h for every input element i. With h = 1e-2 in fp32 the
// difference quotient carries a truncation error of order h^2 |f'''| and a rounding error of
// order 1e-7 |L| / h, together at most 4e-5 of max|grad| in these cases (measured). The
// tolerance, 2e-3 of max|grad| plus 2e-4 absolute, leaves a wide margin over that noise and is
// far below the errors of real bugs (a missing factor, a dropped term, a wrong mask), which are
// of order max|grad| itself.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/bf16.h"
#include "kernels/ops.h"

namespace stallfree {
namespace kernels {
namespace {

constexpr double kFdStep = 1e-2;
constexpr double kFdRelTol = 2e-3;  // of max |gradient| over the tensor.
constexpr double kFdAbsTol = 2e-4;

std::mt19937& Rng() {
  static std::mt19937 rng(20240611);
  return rng;
}

std::vector<float> Uniform(size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(Rng());
  return v;
}

double MaxAbs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

double Dot(const std::vector<float>& a, const std::vector<float>& r) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * r[i];
  return s;
}

// Central differences of loss() with respect to the elements of *x listed in `which` (all if
// empty); returns one derivative per element of *x (0 where not listed).
std::vector<double> FiniteDiff(std::vector<float>* x, const std::function<double()>& loss,
                               const std::vector<size_t>& which = {}) {
  std::vector<size_t> idx = which;
  if (idx.empty()) {
    idx.resize(x->size());
    std::iota(idx.begin(), idx.end(), 0);
  }
  std::vector<double> g(x->size(), 0.0);
  for (size_t i : idx) {
    const float orig = (*x)[i];
    (*x)[i] = orig + static_cast<float>(kFdStep);
    const double up = loss();
    (*x)[i] = orig - static_cast<float>(kFdStep);
    const double down = loss();
    (*x)[i] = orig;
    g[i] = (up - down) / (2 * kFdStep);
  }
  return g;
}

// Analytic vs finite-difference gradient, element by element, within the file's tolerance.
void ExpectGradNear(const std::vector<float>& analytic, const std::vector<double>& fd,
                    const std::string& what, const std::vector<size_t>& which = {}) {
  ASSERT_EQ(analytic.size(), fd.size()) << what;
  const double tol = kFdRelTol * MaxAbs(fd) + kFdAbsTol;
  ASSERT_GT(MaxAbs(fd), 10 * kFdAbsTol) << what << ": degenerate test, gradient ~ 0";
  std::vector<size_t> idx = which;
  if (idx.empty()) {
    idx.resize(fd.size());
    std::iota(idx.begin(), idx.end(), 0);
  }
  for (size_t i : idx) {
    ASSERT_NEAR(analytic[i], fd[i], tol) << what << " element " << i;
  }
}

const TransformerOps& Ops() { return CpuOps(); }

// ---------------------------------------------------------------------------------------------
// GEMM

// op(A)[i, p] for a row-major A with row stride ld.
double OpAt(const std::vector<float>& a, Trans t, int64_t ld, int64_t i, int64_t p) {
  return t == Trans::kNo ? a[i * ld + p] : a[p * ld + i];
}

// C = alpha op(A) op(B) + beta C in double, over the [m, n] view of C only.
std::vector<double> NaiveGemm(Trans ta, Trans tb, int64_t m, int64_t n, int64_t k, double alpha,
                              const std::vector<float>& a, int64_t lda, const std::vector<float>& b,
                              int64_t ldb, double beta, const std::vector<float>& c, int64_t ldc) {
  std::vector<double> out(c.begin(), c.end());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) acc += OpAt(a, ta, lda, i, p) * OpAt(b, tb, ldb, p, j);
      out[i * ldc + j] = alpha * acc + beta * c[i * ldc + j];
    }
  }
  return out;
}

struct GemmCase {
  int64_t m, n, k;
};

// Buffers sized for their ld (with 3 padding columns) so ld != width, and padding in C must
// survive untouched.
void CheckGemm(Trans ta, Trans tb, const GemmCase& g, bool bf16) {
  const int64_t a_rows = ta == Trans::kNo ? g.m : g.k, a_cols = ta == Trans::kNo ? g.k : g.m;
  const int64_t b_rows = tb == Trans::kNo ? g.k : g.n, b_cols = tb == Trans::kNo ? g.n : g.k;
  const int64_t lda = a_cols + 3, ldb = b_cols + 3, ldc = g.n + 3;
  std::vector<float> a = Uniform(a_rows * lda, -1, 1), b = Uniform(b_rows * ldb, -1, 1);
  std::vector<float> c = Uniform(g.m * ldc, -1, 1);
  std::vector<uint16_t> a16(a.size()), b16(b.size());
  if (bf16) {  // The reference multiplies the bf16 values exactly (in double).
    for (size_t i = 0; i < a.size(); ++i) a[i] = Bf16ToFloat(a16[i] = FloatToBf16(a[i]));
    for (size_t i = 0; i < b.size(); ++i) b[i] = Bf16ToFloat(b16[i] = FloatToBf16(b[i]));
  }
  const float alpha = 1.25f, beta = -0.5f;
  const std::vector<double> want =
      NaiveGemm(ta, tb, g.m, g.n, g.k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (bf16) {
    Ops().GemmBf16(ta, tb, g.m, g.n, g.k, alpha, a16.data(), lda, b16.data(), ldb, beta, c.data(),
                   ldc);
  } else {
    Ops().Gemm(ta, tb, g.m, g.n, g.k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
  }
  // fp32 accumulation of k products of magnitude <= 1: a few ulps times sqrt(k) or so.
  const double tol = 1e-6 * (g.k + 1);
  for (int64_t i = 0; i < g.m; ++i) {
    for (int64_t j = 0; j < ldc; ++j) {
      ASSERT_NEAR(c[i * ldc + j], want[i * ldc + j], tol)
          << "ta=" << (ta == Trans::kYes) << " tb=" << (tb == Trans::kYes) << " m=" << g.m
          << " n=" << g.n << " k=" << g.k << " at (" << i << ", " << j << ")"
          << (j >= g.n ? " (padding)" : "");
    }
  }
}

constexpr Trans kTrans[] = {Trans::kNo, Trans::kYes};

TEST(CpuGemm, MatchesTripleLoopForAllTransposesWithLdAndBeta) {
  for (Trans ta : kTrans) {
    for (Trans tb : kTrans) {
      for (GemmCase g : {GemmCase{5, 7, 9}, GemmCase{1, 1, 1}, GemmCase{33, 17, 64}}) {
        CheckGemm(ta, tb, g, /*bf16=*/false);
      }
    }
  }
}

TEST(CpuGemm, Bf16MatchesTripleLoopOnTheRoundedValues) {
  for (Trans ta : kTrans) {
    for (Trans tb : kTrans) {
      for (GemmCase g : {GemmCase{5, 7, 9}, GemmCase{33, 17, 64}}) {
        CheckGemm(ta, tb, g, /*bf16=*/true);
      }
    }
  }
}

// Beyond the 1024-wide conversion panels in each of m, n and k: the panel seams, and beta applied
// once (to the first k panel only).
TEST(CpuGemm, Bf16AcrossConversionPanels) {
  CheckGemm(Trans::kNo, Trans::kYes, GemmCase{9, 1030, 1100}, /*bf16=*/true);
  CheckGemm(Trans::kYes, Trans::kNo, GemmCase{1030, 7, 1030}, /*bf16=*/true);
}

TEST(CpuGemm, EmptyInnerDimensionScalesCAndBetaZeroOverwritesNaN) {
  std::vector<float> c{1, 2, 3, 4, 5, 6};
  float dummy = 0;
  Ops().Gemm(Trans::kNo, Trans::kNo, 2, 3, 0, 1.0f, &dummy, 0, &dummy, 3, 2.0f, c.data(), 3);
  EXPECT_EQ(c, (std::vector<float>{2, 4, 6, 8, 10, 12}));
  std::vector<float> nan(6, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> a = Uniform(2 * 4, -1, 1), b = Uniform(4 * 3, -1, 1);
  Ops().Gemm(Trans::kNo, Trans::kNo, 2, 3, 4, 1.0f, a.data(), 4, b.data(), 3, 0.0f, nan.data(), 3);
  for (float x : nan) EXPECT_FALSE(std::isnan(x));
}

// ---------------------------------------------------------------------------------------------
// Embedding

TEST(CpuEmbedding, ForwardGathersRowsAndBackwardAccumulatesRepeatedIds) {
  const int64_t vocab = 6, dim = 5, n = 9;
  const std::vector<int32_t> ids{3, 0, 3, 5, 3, 1, 0, 5, 3};
  std::vector<float> table = Uniform(vocab * dim, -1, 1), out(n * dim);
  Ops().EmbeddingForward(table.data(), dim, ids.data(), n, out.data());
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t d = 0; d < dim; ++d) ASSERT_EQ(out[i * dim + d], table[ids[i] * dim + d]);
  }

  // Backward accumulates: start from a non-zero dtable and compare the increment.
  const std::vector<float> r = Uniform(n * dim, -1, 1);
  std::vector<float> dtable(vocab * dim, 0.5f);
  Ops().EmbeddingBackward(r.data(), dim, ids.data(), n, dtable.data());
  std::vector<float> grad(vocab * dim);
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = dtable[i] - 0.5f;
  const std::vector<double> fd = FiniteDiff(&table, [&] {
    Ops().EmbeddingForward(table.data(), dim, ids.data(), n, out.data());
    return Dot(out, r);
  });
  ExpectGradNear(grad, fd, "dtable");
  // Row 2 and 4 are never looked up: exactly zero increment.
  for (int64_t d = 0; d < dim; ++d) {
    EXPECT_EQ(grad[2 * dim + d], 0.0f);
    EXPECT_EQ(grad[4 * dim + d], 0.0f);
  }
}

// Many rows hitting few ids, wide enough that the work splits into several tasks: equal to a
// serial double sum, and bit-identical on a second run.
TEST(CpuEmbedding, BackwardIsDeterministicUnderHeavyRepetition) {
  const int64_t vocab = 7, dim = 300, n = 4000;
  std::vector<int32_t> ids(n);
  std::uniform_int_distribution<int32_t> pick(0, vocab - 1);
  for (int32_t& id : ids) id = pick(Rng());
  const std::vector<float> dout = Uniform(n * dim, -1, 1);
  std::vector<float> d1(vocab * dim, 0.0f), d2(vocab * dim, 0.0f);
  Ops().EmbeddingBackward(dout.data(), dim, ids.data(), n, d1.data());
  Ops().EmbeddingBackward(dout.data(), dim, ids.data(), n, d2.data());
  EXPECT_EQ(d1, d2);
  std::vector<double> want(vocab * dim, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t d = 0; d < dim; ++d) want[ids[i] * dim + d] += dout[i * dim + d];
  }
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(d1[i], want[i], 1e-3) << i;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

TEST(CpuRmsNorm, ForwardMatchesFormula) {
  const int64_t rows = 7, dim = 48;
  const float eps = 1e-5f;
  std::vector<float> x = Uniform(rows * dim, -3, 3), w = Uniform(dim, 0.5f, 1.5f);
  x[5] = 1e3f;  // A large element in row 0.
  std::vector<float> y(rows * dim), rstd(rows);
  Ops().RmsNormForward(x.data(), w.data(), rows, dim, eps, y.data(), rstd.data());
  for (int64_t i = 0; i < rows; ++i) {
    double ss = 0;
    for (int64_t d = 0; d < dim; ++d) ss += static_cast<double>(x[i * dim + d]) * x[i * dim + d];
    const double r = 1.0 / std::sqrt(ss / dim + eps);
    ASSERT_NEAR(rstd[i], r, 1e-6 * r);
    for (int64_t d = 0; d < dim; ++d) {
      const double want = x[i * dim + d] * r * w[d];
      ASSERT_NEAR(y[i * dim + d], want, 1e-6 * (1 + std::fabs(want))) << i << "," << d;
    }
  }
}

TEST(CpuRmsNorm, BackwardMatchesFiniteDifferencesAndAccumulatesDw) {
  const int64_t rows = 5, dim = 12;
  const float eps = 1e-5f;
  std::vector<float> x = Uniform(rows * dim, -2, 2), w = Uniform(dim, 0.5f, 1.5f);
  const std::vector<float> r = Uniform(rows * dim, -1, 1);
  std::vector<float> y(rows * dim), rstd(rows), dx(rows * dim, 7.0f), dw(dim, 0.25f);
  Ops().RmsNormForward(x.data(), w.data(), rows, dim, eps, y.data(), rstd.data());
  Ops().RmsNormBackward(x.data(), w.data(), rstd.data(), r.data(), rows, dim, dx.data(), dw.data());
  auto loss = [&] {
    std::vector<float> yy(rows * dim), rr(rows);
    Ops().RmsNormForward(x.data(), w.data(), rows, dim, eps, yy.data(), rr.data());
    return Dot(yy, r);
  };
  ExpectGradNear(dx, FiniteDiff(&x, loss), "dx");
  for (float& g : dw) g -= 0.25f;  // dw accumulated onto its prior value.
  ExpectGradNear(dw, FiniteDiff(&w, loss), "dw");
}

TEST(CpuRmsNorm, DwIsDeterministicOverManyRows) {
  const int64_t rows = 3000, dim = 200;
  std::vector<float> x = Uniform(rows * dim, -2, 2), w = Uniform(dim, 0.5f, 1.5f);
  const std::vector<float> dy = Uniform(rows * dim, -1, 1);
  std::vector<float> y(rows * dim), rstd(rows), dx(rows * dim), dw1(dim, 0.0f), dw2(dim, 0.0f);
  Ops().RmsNormForward(x.data(), w.data(), rows, dim, 1e-5f, y.data(), rstd.data());
  Ops().RmsNormBackward(x.data(), w.data(), rstd.data(), dy.data(), rows, dim, dx.data(),
                        dw1.data());
  Ops().RmsNormBackward(x.data(), w.data(), rstd.data(), dy.data(), rows, dim, dx.data(),
                        dw2.data());
  EXPECT_EQ(dw1, dw2);
  for (int64_t d = 0; d < dim; ++d) {
    double want = 0;
    for (int64_t i = 0; i < rows; ++i) {
      want += static_cast<double>(dy[i * dim + d]) * x[i * dim + d] * rstd[i];
    }
    ASSERT_NEAR(dw1[d], want, 1e-4 * (1 + std::fabs(want))) << d;
  }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

TEST(CpuSwiGlu, ForwardMatchesFormulaAndStaysFiniteForLargeGates) {
  std::vector<float> gate = Uniform(50, -6, 6), up = Uniform(50, -2, 2), out(50);
  gate[0] = 100.0f;
  gate[1] = -100.0f;
  gate[2] = -1000.0f;  // exp(1000) overflows to inf: silu must still be -0, not NaN.
  Ops().SwiGluForward(gate.data(), up.data(), 50, out.data());
  for (int i = 0; i < 50; ++i) {
    const double g = gate[i], want = g / (1.0 + std::exp(-g)) * up[i];
    ASSERT_NEAR(out[i], want, 1e-6 * (1 + std::fabs(want))) << i;
  }
  std::vector<float> dout(50, 1.0f), dg(50), du(50);
  Ops().SwiGluBackward(gate.data(), up.data(), dout.data(), 50, dg.data(), du.data());
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(std::isfinite(dg[i]) && std::isfinite(du[i])) << i;
}

TEST(CpuSwiGlu, BackwardMatchesFiniteDifferences) {
  const int64_t n = 40;
  std::vector<float> gate = Uniform(n, -4, 4), up = Uniform(n, -2, 2);
  const std::vector<float> r = Uniform(n, -1, 1);
  std::vector<float> dg(n, 9.0f), du(n, 9.0f);
  Ops().SwiGluBackward(gate.data(), up.data(), r.data(), n, dg.data(), du.data());
  auto loss = [&] {
    std::vector<float> out(n);
    Ops().SwiGluForward(gate.data(), up.data(), n, out.data());
    return Dot(out, r);
  };
  ExpectGradNear(dg, FiniteDiff(&gate, loss), "dgate");
  ExpectGradNear(du, FiniteDiff(&up, loss), "dup");
}

// ---------------------------------------------------------------------------------------------
// Attention
//
// The operands live as the layers lay them out: q, k, v are column slices of wider buffers
// (fused q | k | v for self-attention, or q alone and k | v fused), with padding columns, so
// the strides, the head offsets and out-of-view writes are all exercised.

struct AttnLayout {
  AttentionShape s;
  bool fused_qkv;  // q, k, v in one buffer (tq == tk); otherwise q and a fused k | v buffer.
  std::vector<float> qbuf, kvbuf, outbuf;
  int64_t q_off, k_off, v_off;
  std::vector<int32_t> q_pos, k_pos;

  std::vector<float>& KvBuf() { return fused_qkv ? qbuf : kvbuf; }
  const float* Q() const { return qbuf.data() + q_off; }
  const float* K() const { return (fused_qkv ? qbuf : kvbuf).data() + k_off; }
  const float* V() const { return (fused_qkv ? qbuf : kvbuf).data() + v_off; }
};

AttnLayout MakeAttn(int64_t batch, int64_t tq, int64_t tk, int64_t heads, int64_t head_dim,
                    bool fused_qkv, std::vector<int32_t> q_pos, std::vector<int32_t> k_pos,
                    float lo = -1, float hi = 1) {
  AttnLayout a;
  const int64_t hd = heads * head_dim;
  a.s.batch = batch;
  a.s.tq = tq;
  a.s.tk = tk;
  a.s.heads = heads;
  a.s.head_dim = head_dim;
  a.fused_qkv = fused_qkv;
  if (fused_qkv) {
    a.s.q_ld = a.s.k_ld = a.s.v_ld = 3 * hd + 2;
    a.q_off = 0, a.k_off = hd, a.v_off = 2 * hd;
    a.qbuf = Uniform(batch * tq * a.s.q_ld, lo, hi);
  } else {
    a.s.q_ld = hd + 3;
    a.s.k_ld = a.s.v_ld = 2 * hd + 1;
    a.q_off = 0, a.k_off = 0, a.v_off = hd;
    a.qbuf = Uniform(batch * tq * a.s.q_ld, lo, hi);
    a.kvbuf = Uniform(batch * tk * a.s.k_ld, lo, hi);
  }
  a.s.out_ld = hd + 5;
  a.outbuf.assign(batch * tq * a.s.out_ld, 4.0f);  // Padding must stay 4.
  a.q_pos = std::move(q_pos);
  a.k_pos = std::move(k_pos);
  return a;
}

// Positions of t tokens in rank `rank`'s zigzag order over `ranks` ranks: its chunks rank and
// 2 * ranks - 1 - rank of 2 * ranks equal chunks, offset by base.
std::vector<int32_t> Zigzag(int64_t t, int ranks, int rank, int32_t base) {
  const int64_t chunks = 2 * ranks, len = t / chunks;
  std::vector<int32_t> pos;
  for (int64_t c : {int64_t{rank}, chunks - 1 - rank}) {
    for (int64_t i = 0; i < len; ++i) pos.push_back(static_cast<int32_t>(base + c * len + i));
  }
  return pos;
}

struct NaiveAttn {
  std::vector<double> out;  // [batch, tq, heads, head_dim], dense.
  std::vector<double> lse;  // [batch, heads, tq]
};

// Softmax over an explicit mask, in double.
NaiveAttn NaiveAttention(const AttnLayout& a) {
  const AttentionShape& s = a.s;
  const double scale = s.scale != 0 ? s.scale : 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  NaiveAttn r;
  r.out.assign(s.batch * s.tq * s.heads * s.head_dim, 0.0);
  r.lse.assign(s.batch * s.heads * s.tq, -std::numeric_limits<double>::infinity());
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t i = 0; i < s.tq; ++i) {
        std::vector<double> sc(s.tk);
        std::vector<bool> mask(s.tk);
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < s.tk; ++j) {
          mask[j] = a.k_pos[j] <= a.q_pos[i];
          double dot = 0;
          for (int64_t d = 0; d < s.head_dim; ++d) {
            dot += static_cast<double>(a.Q()[(b * s.tq + i) * s.q_ld + h * s.head_dim + d]) *
                   a.K()[(b * s.tk + j) * s.k_ld + h * s.head_dim + d];
          }
          sc[j] = scale * dot;
          if (mask[j]) mx = std::max(mx, sc[j]);
        }
        if (std::isinf(mx)) continue;  // No visible key: out 0, lse -inf.
        double sum = 0;
        for (int64_t j = 0; j < s.tk; ++j) sum += mask[j] ? std::exp(sc[j] - mx) : 0.0;
        r.lse[(b * s.heads + h) * s.tq + i] = mx + std::log(sum);
        for (int64_t j = 0; j < s.tk; ++j) {
          if (!mask[j]) continue;
          const double p = std::exp(sc[j] - mx) / sum;
          for (int64_t d = 0; d < s.head_dim; ++d) {
            r.out[((b * s.tq + i) * s.heads + h) * s.head_dim + d] +=
                p * a.V()[(b * s.tk + j) * s.v_ld + h * s.head_dim + d];
          }
        }
      }
    }
  }
  return r;
}

bool SeesNoKey(const AttnLayout& a, int64_t i) {
  for (int32_t kp : a.k_pos) {
    if (kp <= a.q_pos[i]) return false;
  }
  return true;
}

void CheckAttentionForward(AttnLayout a, const std::string& what) {
  const AttentionShape& s = a.s;
  std::vector<float> lse(s.batch * s.heads * s.tq, 4.0f);
  Ops().AttentionForward(s, a.Q(), a.K(), a.V(), a.q_pos.data(), a.k_pos.data(), a.outbuf.data(),
                         lse.data());
  const NaiveAttn want = NaiveAttention(a);
  const int64_t hd = s.heads * s.head_dim;
  int masked = 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t i = 0; i < s.tq; ++i) {
      const bool none = SeesNoKey(a, i);
      masked += none && b == 0;
      for (int64_t c = 0; c < s.out_ld; ++c) {
        const float got = a.outbuf[(b * s.tq + i) * s.out_ld + c];
        if (c >= hd) {
          ASSERT_EQ(got, 4.0f) << what << ": padding of out written at row " << i;
          continue;
        }
        if (none) {
          ASSERT_EQ(got, 0.0f) << what << ": fully masked query " << i;
          continue;
        }
        // Probabilities sum to 1 over values of magnitude <= 1 (the inputs' range).
        ASSERT_NEAR(got, want.out[(b * s.tq + i) * hd + c], 2e-6)
            << what << " out b=" << b << " i=" << i << " c=" << c;
      }
      for (int64_t h = 0; h < s.heads; ++h) {
        const int64_t li = (b * s.heads + h) * s.tq + i;
        if (none) {
          ASSERT_TRUE(std::isinf(lse[li]) && lse[li] < 0) << what << " lse of masked query " << i;
        } else {
          ASSERT_NEAR(lse[li], want.lse[li], 2e-6 * (1 + std::fabs(want.lse[li])))
              << what << " lse b=" << b << " h=" << h << " i=" << i;
        }
      }
    }
  }
  if (what.find("masked") != std::string::npos) {
    EXPECT_GT(masked, 0) << what;
  }
}

TEST(CpuAttention, ForwardMatchesNaiveMaskedSoftmax) {
  {
    // This rank's zigzag queries (chunks 0 and 3 of 4) against keys gathered in a shuffled
    // order, tq != tk, q separate from a fused k | v buffer; query 3 precedes every key.
    std::vector<int32_t> q_pos = Zigzag(24, 2, 0, 10), k_pos(20);
    q_pos[3] = 2;
    std::iota(k_pos.begin(), k_pos.end(), 10);
    std::shuffle(k_pos.begin(), k_pos.end(), Rng());
    CheckAttentionForward(MakeAttn(2, 12, 20, 3, 8, false, q_pos, k_pos), "zigzag_masked");
  }
  {
    // Self-attention of rank 1's zigzag tokens (non-monotonic positions), fused q | k | v.
    std::vector<int32_t> pos = Zigzag(32, 2, 1, 0);
    CheckAttentionForward(MakeAttn(1, 16, 16, 2, 16, true, pos, pos), "fused_zigzag");
  }
  {
    // More queries than one 256-row block, an explicit scale, head_dim 64.
    std::vector<int32_t> q_pos(300), k_pos(70);
    std::iota(q_pos.begin(), q_pos.end(), 0);
    for (int j = 0; j < 70; ++j) k_pos[j] = 5 * j;
    AttnLayout a = MakeAttn(1, 300, 70, 1, 64, false, q_pos, k_pos);
    a.s.scale = 0.3f;
    CheckAttentionForward(a, "blocks_scale");
  }
  {
    // Scores of order 100 (inputs up to 6, head_dim 32): exp without max-subtraction overflows.
    std::vector<int32_t> pos(10);
    std::iota(pos.begin(), pos.end(), 0);
    AttnLayout a = MakeAttn(1, 10, 10, 1, 32, true, pos, pos, -6, 6);
    a.s.scale = 1.0f;
    std::vector<float> lse(10);
    Ops().AttentionForward(a.s, a.Q(), a.K(), a.V(), a.q_pos.data(), a.k_pos.data(),
                           a.outbuf.data(), lse.data());
    const NaiveAttn want = NaiveAttention(a);
    for (int64_t i = 0; i < 10; ++i) {
      ASSERT_NEAR(lse[i], want.lse[i], 1e-5 * std::fabs(want.lse[i])) << i;
      for (int64_t c = 0; c < 32; ++c) {
        ASSERT_NEAR(a.outbuf[i * a.s.out_ld + c], want.out[i * 32 + c], 1e-4) << i << "," << c;
      }
    }
  }
}

// Central differences over every in-view element of q, k and v; also checks that padding columns
// of dq / dk / dv are untouched and that a query seeing no key gets dq = 0.
void CheckAttentionBackward(AttnLayout a, const std::string& what) {
  const AttentionShape& s = a.s;
  const int64_t hd = s.heads * s.head_dim;
  std::vector<float> lse(s.batch * s.heads * s.tq);
  const std::vector<float> r = Uniform(a.outbuf.size(), -1, 1);
  Ops().AttentionForward(s, a.Q(), a.K(), a.V(), a.q_pos.data(), a.k_pos.data(), a.outbuf.data(),
                         lse.data());
  const float kUntouched = 3.0f;
  std::vector<float> gq(a.qbuf.size(), kUntouched), gkv(a.kvbuf.size(), kUntouched);
  std::vector<float>& gkvref = a.fused_qkv ? gq : gkv;
  Ops().AttentionBackward(s, a.Q(), a.K(), a.V(), a.q_pos.data(), a.k_pos.data(), a.outbuf.data(),
                          lse.data(), r.data(), gq.data() + a.q_off, gkvref.data() + a.k_off,
                          gkvref.data() + a.v_off);

  auto loss = [&] {
    std::vector<float> out(a.outbuf.size(), 0.0f), l(lse.size());
    Ops().AttentionForward(s, a.Q(), a.K(), a.V(), a.q_pos.data(), a.k_pos.data(), out.data(),
                           l.data());
    return Dot(out, r);  // r is nonzero on padding too; those out elements must stay 0.
  };
  // In-view element indices of one operand: rows x [off, off + hd) of a buffer with stride ld.
  auto view = [&](int64_t rows, int64_t ld, int64_t off) {
    std::vector<size_t> idx;
    for (int64_t t = 0; t < rows; ++t) {
      for (int64_t c = 0; c < hd; ++c) idx.push_back(t * ld + off + c);
    }
    return idx;
  };
  const std::vector<size_t> qv = view(s.batch * s.tq, s.q_ld, a.q_off);
  const std::vector<size_t> kv = view(s.batch * s.tk, s.k_ld, a.k_off);
  const std::vector<size_t> vv = view(s.batch * s.tk, s.v_ld, a.v_off);
  std::vector<float>& kvbuf = a.KvBuf();
  // FiniteDiff leaves the other indices' derivatives at 0; ExpectGradNear compares only `which`.
  ExpectGradNear(gq, FiniteDiff(&a.qbuf, loss, qv), what + " dq", qv);
  ExpectGradNear(gkvref, FiniteDiff(&kvbuf, loss, kv), what + " dk", kv);
  ExpectGradNear(gkvref, FiniteDiff(&kvbuf, loss, vv), what + " dv", vv);

  // Everything outside the three views keeps its prior value.
  std::vector<bool> in_view(gq.size(), false), in_kv_view(gkv.size(), false);
  for (size_t i : qv) in_view[i] = true;
  for (size_t i : kv) (a.fused_qkv ? in_view : in_kv_view)[i] = true;
  for (size_t i : vv) (a.fused_qkv ? in_view : in_kv_view)[i] = true;
  for (size_t i = 0; i < gq.size(); ++i) {
    if (!in_view[i]) {
      ASSERT_EQ(gq[i], kUntouched) << what << " padding of dq at " << i;
    }
  }
  for (size_t i = 0; i < gkv.size(); ++i) {
    if (!in_kv_view[i]) {
      ASSERT_EQ(gkv[i], kUntouched) << what << " padding of dkv at " << i;
    }
  }
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t i = 0; i < s.tq; ++i) {
      if (!SeesNoKey(a, i)) continue;
      for (int64_t c = 0; c < hd; ++c) {
        ASSERT_EQ(gq[(b * s.tq + i) * s.q_ld + a.q_off + c], 0.0f) << what << " masked dq";
      }
    }
  }
}

TEST(CpuAttention, BackwardMatchesFiniteDifferences) {
  {
    // Zigzag queries, shuffled keys, tq != tk, a query that sees no key, and keys (positions
    // above every query) that no query sees: their dk / dv must be 0.
    std::vector<int32_t> q_pos = Zigzag(8, 2, 0, 3), k_pos(7);
    q_pos[1] = 0;
    std::iota(k_pos.begin(), k_pos.end(), 2);
    std::shuffle(k_pos.begin(), k_pos.end(), Rng());
    k_pos[4] = 50;
    CheckAttentionBackward(MakeAttn(2, 4, 7, 2, 4, false, q_pos, k_pos), "zigzag_masked");
  }
  {
    // Fused q | k | v self-attention over zigzag positions.
    std::vector<int32_t> pos = Zigzag(12, 2, 1, 0);
    CheckAttentionBackward(MakeAttn(1, 6, 6, 2, 3, true, pos, pos), "fused_zigzag");
  }
  {
    // 300 queries (two 256-row blocks): dk and dv summed over blocks; an explicit scale.
    std::vector<int32_t> q_pos(300), k_pos(6);
    std::iota(q_pos.begin(), q_pos.end(), 0);
    for (int j = 0; j < 6; ++j) k_pos[j] = 50 * j + 7;
    AttnLayout a = MakeAttn(1, 300, 6, 1, 2, false, q_pos, k_pos);
    a.s.scale = 0.8f;
    CheckAttentionBackward(a, "blocks");
  }
}

// Degenerate extents: no keys at all (every query masked) and no queries (keys get zero
// gradients, overwritten, not left as they were).
TEST(CpuAttention, EmptyKeysOrQueries) {
  {
    AttnLayout a = MakeAttn(2, 3, 0, 2, 4, false, {0, 1, 2}, {});
    std::vector<float> lse(2 * 2 * 3, 4.0f);
    Ops().AttentionForward(a.s, a.Q(), a.K(), a.V(), a.q_pos.data(), a.k_pos.data(),
                           a.outbuf.data(), lse.data());
    for (float l : lse) EXPECT_TRUE(std::isinf(l) && l < 0);
    for (int64_t row = 0; row < 6; ++row) {
      for (int64_t c = 0; c < 8; ++c) EXPECT_EQ(a.outbuf[row * a.s.out_ld + c], 0.0f);
    }
    const std::vector<float> dout = Uniform(a.outbuf.size(), -1, 1);
    std::vector<float> dq(a.qbuf.size(), 3.0f);
    Ops().AttentionBackward(a.s, a.Q(), a.K(), a.V(), a.q_pos.data(), a.k_pos.data(),
                            a.outbuf.data(), lse.data(), dout.data(), dq.data(), nullptr, nullptr);
    for (int64_t row = 0; row < 6; ++row) {
      for (int64_t c = 0; c < 8; ++c) EXPECT_EQ(dq[row * a.s.q_ld + c], 0.0f);
    }
  }
  {
    AttnLayout a = MakeAttn(2, 0, 3, 2, 4, false, {}, {0, 1, 2});
    std::vector<float> dkv(a.kvbuf.size(), 3.0f);
    Ops().AttentionBackward(a.s, a.Q(), a.K(), a.V(), a.q_pos.data(), a.k_pos.data(), nullptr,
                            nullptr, nullptr, nullptr, dkv.data(), dkv.data() + 8);
    for (int64_t row = 0; row < 6; ++row) {
      for (int64_t c = 0; c < a.s.k_ld; ++c) {
        EXPECT_EQ(dkv[row * a.s.k_ld + c], c < 16 ? 0.0f : 3.0f) << row << "," << c;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy

TEST(CpuCrossEntropy, ForwardMatchesLogSumExpAndIgnoresNegativeTargets) {
  const int64_t rows = 6, vocab = 11;
  std::vector<float> logits = Uniform(rows * vocab, -3, 3);
  for (int64_t j = 0; j < vocab; ++j) logits[2 * vocab + j] += 1000.0f;  // exp would overflow.
  const std::vector<int32_t> targets{3, -1, 10, 0, -100, 7};
  std::vector<float> loss(rows, 9.0f), lse(rows);
  Ops().CrossEntropyForward(logits.data(), rows, vocab, targets.data(), loss.data(), lse.data());
  for (int64_t i = 0; i < rows; ++i) {
    if (targets[i] < 0) {
      EXPECT_EQ(loss[i], 0.0f) << i;
      continue;
    }
    double mx = -1e30, sum = 0;
    for (int64_t j = 0; j < vocab; ++j) {
      mx = std::max(mx, static_cast<double>(logits[i * vocab + j]));
    }
    for (int64_t j = 0; j < vocab; ++j) sum += std::exp(logits[i * vocab + j] - mx);
    const double want_lse = mx + std::log(sum);
    EXPECT_NEAR(lse[i], want_lse, 1e-6 * (1 + std::fabs(want_lse))) << i;
    // Row 2's loss is a difference of two numbers near 1000: fp32 spacing there is 6e-5.
    EXPECT_NEAR(loss[i], want_lse - logits[i * vocab + targets[i]], 2e-4) << i;
  }
}

TEST(CpuCrossEntropy, BackwardMatchesFiniteDifferencesAndZeroesIgnoredRows) {
  const int64_t rows = 5, vocab = 9;
  std::vector<float> logits = Uniform(rows * vocab, -2, 2);
  const std::vector<int32_t> targets{4, -1, 0, 8, -7};
  const float dloss = 0.7f;
  std::vector<float> loss(rows), lse(rows), dlogits(rows * vocab, 5.0f);
  Ops().CrossEntropyForward(logits.data(), rows, vocab, targets.data(), loss.data(), lse.data());
  Ops().CrossEntropyBackward(logits.data(), lse.data(), targets.data(), rows, vocab, dloss,
                             dlogits.data());
  std::vector<double> fd = FiniteDiff(&logits, [&] {
    std::vector<float> l(rows), s(rows);
    Ops().CrossEntropyForward(logits.data(), rows, vocab, targets.data(), l.data(), s.data());
    return dloss * std::accumulate(l.begin(), l.end(), 0.0);
  });
  ExpectGradNear(dlogits, fd, "dlogits");
  for (int64_t j = 0; j < vocab; ++j) {
    EXPECT_EQ(dlogits[1 * vocab + j], 0.0f);
    EXPECT_EQ(dlogits[4 * vocab + j], 0.0f);
  }
  // Each valid row's gradient sums to 0 (softmax minus one-hot).
  double row0 = 0;
  for (int64_t j = 0; j < vocab; ++j) row0 += dlogits[j];
  EXPECT_NEAR(row0, 0.0, 1e-6);
}

// ---------------------------------------------------------------------------------------------
// Add

TEST(CpuAdd, AddsElementwiseAlsoInPlace) {
  const int64_t n = 100000;  // Several parallel chunks.
  std::vector<float> a = Uniform(n, -1, 1), b = Uniform(n, -1, 1), out(n);
  Ops().Add(a.data(), b.data(), n, out.data());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], a[i] + b[i]) << i;
  std::vector<float> a2 = a;
  Ops().Add(a2.data(), b.data(), n, a2.data());  // out aliases a
  EXPECT_EQ(a2, out);
  std::vector<float> b2 = b;
  Ops().Add(a.data(), b2.data(), n, b2.data());  // out aliases b
  EXPECT_EQ(b2, out);
}

TEST(CpuMemory, AllocFillCopyUploadDownloadAndCopy2D) {
  const TransformerOps& ops = Ops();
  EXPECT_EQ(ops.AllocFloats(0), nullptr);
  ops.Free(nullptr);
  const int64_t rows = 5, cols = 3, src_ld = 7, dst_ld = 4, n = rows * src_ld;
  OpsBuffer a(&ops, n), b(&ops, n), c(&ops, rows * dst_ld);
  ASSERT_NE(a.data(), nullptr);
  EXPECT_EQ(a.size(), n);
  std::vector<float> host(n, -1.0f);
  ops.Download(host.data(), a.data(), n);
  EXPECT_EQ(host, std::vector<float>(n, 0.0f));  // zero-initialised
  std::vector<float> src(n);
  std::iota(src.begin(), src.end(), 1.0f);
  ops.Upload(a.data(), src.data(), n);
  ops.CopyFloats(b.data(), a.data(), n);
  ops.Download(host.data(), b.data(), n);
  EXPECT_EQ(host, src);
  ops.Fill(c.data(), rows * dst_ld, 2.5f);
  ops.Copy2D(c.data() + 1, dst_ld, a.data() + 2, src_ld, rows, cols);
  std::vector<float> got(rows * dst_ld);
  ops.Download(got.data(), c.data(), rows * dst_ld);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < dst_ld; ++j) {
      const float want = j >= 1 && j < 1 + cols ? src[i * src_ld + 2 + j - 1] : 2.5f;
      EXPECT_EQ(got[i * dst_ld + j], want) << i << "," << j;
    }
  }
  // Bits travel exactly (int32 data in float buffers).
  const std::vector<int32_t> ints = {0, 1, -1, 7, 1 << 30};
  OpsBuffer d(&ops, static_cast<int64_t>(ints.size()));
  ops.Upload(d.data(), reinterpret_cast<const float*>(ints.data()), d.size());
  std::vector<int32_t> back(ints.size());
  ops.Download(reinterpret_cast<float*>(back.data()), d.data(), d.size());
  EXPECT_EQ(back, ints);
  // Move-only ownership.
  float* p = a.data();
  OpsBuffer moved(std::move(a));
  EXPECT_EQ(moved.data(), p);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(a.size(), 0);
  b = std::move(moved);
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.size(), n);
  b.reset();
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(ops.Synchronize(), "");
}

}  // namespace
}  // namespace kernels
}  // namespace stallfree
