// The CPU backend of the transformer ops: OpenBLAS for every matrix product (attention included,
// per batch row and head), oneTBB for the row-wise kernels.
//
// Threading. OpenBLAS (the Debian pthread build) parallelises a large sgemm itself, so GEMMs are
// only ever called from the calling thread, never from inside a oneTBB task: nesting the two
// pools would oversubscribe the cores. Between GEMMs, the row-wise work (softmax, norms) is
// split over rows with tbb::parallel_for.
//
// Determinism. Every output element is computed by exactly one task in a fixed order of
// operations, so results do not depend on the thread count or the schedule. The two reductions
// over rows (RMSNorm's dw, the embedding's dtable) are split by columns, not rows: each task
// owns a range of columns and sums over all rows serially.
#include <cblas.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "common/tbb_sync.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <limits>
#include <vector>

#include "common/bf16.h"
#include "kernels/cpu/memory_cpu.h"
#include "kernels/ops.h"

namespace stallfree {
namespace kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Roughly how many scalar operations make one oneTBB task worth its overhead (~microseconds).
constexpr int64_t kGrainWork = 1 << 14;

// Rows (or columns) per task when each costs `work_per_item` operations.
int64_t Grain(int64_t work_per_item) {
  return std::max<int64_t>(1, kGrainWork / std::max<int64_t>(work_per_item, 1));
}

// Calls fn(i) for i in [0, n); items are independent, so the split does not affect results.
template <class Fn>
void ParallelFor(int64_t n, int64_t work_per_item, const Fn& fn) {
  if (n <= 0) return;
  const int64_t grain = Grain(work_per_item);
  if (n <= grain) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  stallfree::ParallelFor(tbb::blocked_range<int64_t>(0, n, grain),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      for (int64_t i = r.begin(); i < r.end(); ++i) fn(i);
                    });
}

// Calls fn(begin, end) on disjoint column ranges covering [0, cols), for reductions over rows
// that must not race: each range is owned by one task.
template <class Fn>
void ParallelColumns(int64_t cols, int64_t rows, const Fn& fn) {
  if (cols <= 0) return;
  // At least 16 columns per task (one cache line of each row); more when rows are few.
  const int64_t width = std::max<int64_t>(16, Grain(rows));
  const int64_t tasks = (cols + width - 1) / width;
  ParallelFor(tasks, width * rows,
              [&](int64_t t) { fn(t * width, std::min(cols, (t + 1) * width)); });
}

CBLAS_TRANSPOSE ToCblas(Trans t) { return t == Trans::kYes ? CblasTrans : CblasNoTrans; }

// C = beta * C for an [m, n] block; beta == 0 overwrites (NaN or garbage in C does not survive),
// as BLAS does.
void ScaleMatrix(int64_t m, int64_t n, float beta, float* c, int64_t ldc) {
  if (beta == 1.0f) return;
  for (int64_t i = 0; i < m; ++i) {
    float* row = c + i * ldc;
    if (beta == 0.0f) {
      std::fill(row, row + n, 0.0f);
    } else {
      for (int64_t j = 0; j < n; ++j) row[j] *= beta;
    }
  }
}

// Row-major sgemm with the degenerate cases handled here: OpenBLAS rejects (and skips, after
// printing to stderr) an ld below 1, which a caller may legitimately pass when k == 0.
// cblas takes int dimensions: every extent here is far below 2^31 (the layers' tensors).
void Sgemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k, float alpha,
           const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
           int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    ScaleMatrix(m, n, beta, c, ldc);
    return;
  }
  cblas_sgemm(CblasRowMajor, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
              alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta, c,
              static_cast<int>(ldc));
}

// dst[r * cols + c] = src[r * ld + c] converted to fp32.
void Bf16PanelToFloat(const uint16_t* src, int64_t ld, int64_t rows, int64_t cols, float* dst) {
  ParallelFor(rows, cols, [&](int64_t r) {
    const uint16_t* s = src + r * ld;
    float* d = dst + r * cols;
    for (int64_t c = 0; c < cols; ++c) d[c] = Bf16ToFloat(s[c]);
  });
}

// GemmBf16 panel sizes: the fp32 copies of an A and a B panel stay at 4 MiB each whatever the
// operands' size, while each sgemm is still large enough to run at full speed. A is converted
// once per column panel of C (n / kPanelN times), a cost of 1 / (2 * kPanelN) of the flops.
constexpr int64_t kPanelM = 1024, kPanelN = 1024, kPanelK = 1024;

// Query rows per attention block: bounds the score scratch at kQueryBlock * tk floats (twice in
// the backward) while keeping each sgemm large.
constexpr int64_t kQueryBlock = 256;

// Softmax of one row of scaled scores s[0, tk) in place over the keys visible to a query at
// position qp; invisible keys get probability 0. Returns the log-sum-exp (-inf and an all-zero
// row when no key is visible).
float MaskedSoftmaxRow(float* s, int64_t tk, const int32_t* k_pos, int32_t qp) {
  float mx = kNegInf;
  bool any = false;
  for (int64_t j = 0; j < tk; ++j) {
    if (k_pos[j] <= qp) {
      any = true;
      mx = std::max(mx, s[j]);
    }
  }
  if (!any) {
    std::fill(s, s + tk, 0.0f);
    return kNegInf;
  }
  double sum = 0;
  for (int64_t j = 0; j < tk; ++j) {
    const float p = k_pos[j] <= qp ? std::exp(s[j] - mx) : 0.0f;
    s[j] = p;
    sum += p;
  }
  // sum >= 1: the maximum contributes exp(0).
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t j = 0; j < tk; ++j) s[j] *= inv;
  return mx + static_cast<float>(std::log(sum));
}

// Pointers to one (batch row, head) of the attention operands.
struct HeadView {
  int64_t q_off, k_off, v_off, out_off, lse_off;
};

HeadView Head(const AttentionShape& s, int64_t b, int64_t h) {
  const int64_t col = h * s.head_dim;
  return {b * s.tq * s.q_ld + col, b * s.tk * s.k_ld + col, b * s.tk * s.v_ld + col,
          b * s.tq * s.out_ld + col, (b * s.heads + h) * s.tq};
}

float AttentionScale(const AttentionShape& s) {
  return s.scale != 0.0f ? s.scale : 1.0f / std::sqrt(static_cast<float>(s.head_dim));
}

class CpuTransformerOps final : public CpuMemoryOf<TransformerOps> {
 public:
  const char* name() const override { return "cpu"; }

  void Gemm(Trans ta, Trans tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
            int64_t lda, const float* b, int64_t ldb, float beta, float* c,
            int64_t ldc) const override {
    Sgemm(ToCblas(ta), ToCblas(tb), m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }

  // Converts panels of A and B to fp32 and multiplies them with sgemm, accumulating the k
  // panels into C (the first with the caller's beta, the rest with 1). Each panel keeps its
  // operand's orientation, so conversion reads rows contiguously and sgemm does the transpose.
  void GemmBf16(Trans ta, Trans tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a,
                int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
                int64_t ldc) const override {
    if (m <= 0 || n <= 0) return;
    if (k <= 0) {
      ScaleMatrix(m, n, beta, c, ldc);
      return;
    }
    const bool at = ta == Trans::kYes, bt = tb == Trans::kYes;
    std::vector<float> a_panel(std::min(m, kPanelM) * std::min(k, kPanelK));
    std::vector<float> b_panel(std::min(n, kPanelN) * std::min(k, kPanelK));
    for (int64_t j0 = 0; j0 < n; j0 += kPanelN) {
      const int64_t nc = std::min(kPanelN, n - j0);
      for (int64_t p0 = 0; p0 < k; p0 += kPanelK) {
        const int64_t kc = std::min(kPanelK, k - p0);
        // op(B)[p0:p0+kc, j0:j0+nc]: B[p0.., j0..] as [kc, nc], or B[j0.., p0..] as [nc, kc].
        if (bt) {
          Bf16PanelToFloat(b + j0 * ldb + p0, ldb, nc, kc, b_panel.data());
        } else {
          Bf16PanelToFloat(b + p0 * ldb + j0, ldb, kc, nc, b_panel.data());
        }
        const float beta_k = p0 == 0 ? beta : 1.0f;
        for (int64_t i0 = 0; i0 < m; i0 += kPanelM) {
          const int64_t mc = std::min(kPanelM, m - i0);
          if (at) {
            Bf16PanelToFloat(a + p0 * lda + i0, lda, kc, mc, a_panel.data());
          } else {
            Bf16PanelToFloat(a + i0 * lda + p0, lda, mc, kc, a_panel.data());
          }
          Sgemm(ToCblas(ta), ToCblas(tb), mc, nc, kc, alpha, a_panel.data(), at ? mc : kc,
                b_panel.data(), bt ? kc : nc, beta_k, c + i0 * ldc + j0, ldc);
        }
      }
    }
  }

  void EmbeddingForward(const float* table, int64_t dim, const int32_t* ids, int64_t n,
                        float* out) const override {
    ParallelFor(n, dim, [&](int64_t i) {
      std::memcpy(out + i * dim, table + static_cast<int64_t>(ids[i]) * dim, sizeof(float) * dim);
    });
  }

  // Repeated ids would race under a split by rows; a split by columns lets every task add its
  // columns of all rows in row order, so the sums are identical on every run.
  void EmbeddingBackward(const float* dout, int64_t dim, const int32_t* ids, int64_t n,
                         float* dtable) const override {
    ParallelColumns(dim, n, [&](int64_t c0, int64_t c1) {
      for (int64_t i = 0; i < n; ++i) {
        const float* src = dout + i * dim;
        float* dst = dtable + static_cast<int64_t>(ids[i]) * dim;
        for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
      }
    });
  }

  // rstd = 1 / sqrt(mean(x^2) + eps), the mean accumulated in double.
  void RmsNormForward(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                      float* y, float* rstd) const override {
    ParallelFor(rows, dim, [&](int64_t i) {
      const float* xi = x + i * dim;
      float* yi = y + i * dim;
      double ss = 0;
      for (int64_t j = 0; j < dim; ++j) ss += static_cast<double>(xi[j]) * xi[j];
      const float r = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
      rstd[i] = r;
      for (int64_t j = 0; j < dim; ++j) yi[j] = xi[j] * r * w[j];
    });
  }

  // With y_j = x_j r w_j and r = (mean(x^2) + eps)^(-1/2), dr/dx_j = -r^3 x_j / dim, so
  //   dx_j = r w_j dy_j - (r^3 / dim) x_j sum_k(dy_k w_k x_k),   dw_j += sum_rows dy_j x_j r.
  void RmsNormBackward(const float* x, const float* w, const float* rstd, const float* dy,
                       int64_t rows, int64_t dim, float* dx, float* dw) const override {
    ParallelFor(rows, dim, [&](int64_t i) {
      const float* xi = x + i * dim;
      const float* gi = dy + i * dim;
      float* dxi = dx + i * dim;
      double dot = 0;
      for (int64_t j = 0; j < dim; ++j) dot += static_cast<double>(gi[j]) * w[j] * xi[j];
      const float r = rstd[i];
      const float coef = static_cast<float>(static_cast<double>(r) * r * r * dot / dim);
      for (int64_t j = 0; j < dim; ++j) dxi[j] = r * w[j] * gi[j] - coef * xi[j];
    });
    ParallelColumns(dim, rows, [&](int64_t c0, int64_t c1) {
      std::vector<double> acc(c1 - c0, 0.0);
      for (int64_t i = 0; i < rows; ++i) {
        const float* xi = x + i * dim;
        const float* gi = dy + i * dim;
        const float r = rstd[i];
        for (int64_t c = c0; c < c1; ++c) acc[c - c0] += static_cast<double>(gi[c]) * xi[c] * r;
      }
      for (int64_t c = c0; c < c1; ++c) dw[c] += static_cast<float>(acc[c - c0]);
    });
  }

  // silu(z) = z * sigmoid(z); sigmoid(z) = 1 / (1 + exp(-z)) is 0 (not NaN) when exp overflows.
  void SwiGluForward(const float* gate, const float* up, int64_t n, float* out) const override {
    ParallelFor(n, 16, [&](int64_t i) {
      const float g = gate[i];
      out[i] = g / (1.0f + std::exp(-g)) * up[i];
    });
  }

  // d silu / dz = sigmoid(z) (1 + z (1 - sigmoid(z))).
  void SwiGluBackward(const float* gate, const float* up, const float* dout, int64_t n,
                      float* dgate, float* dup) const override {
    ParallelFor(n, 16, [&](int64_t i) {
      const float g = gate[i];
      const float sig = 1.0f / (1.0f + std::exp(-g));
      dgate[i] = dout[i] * up[i] * sig * (1.0f + g * (1.0f - sig));
      dup[i] = dout[i] * g * sig;
    });
  }

  // Per (batch row, head) and block of queries: S = scale Q K^T (sgemm), a masked softmax per
  // row (its log-sum-exp saved), then out = P V (sgemm).
  void AttentionForward(const AttentionShape& s, const float* q, const float* k, const float* v,
                        const int32_t* q_pos, const int32_t* k_pos, float* out,
                        float* lse) const override {
    const int64_t tq = s.tq, tk = s.tk, hd = s.head_dim;
    const float scale = AttentionScale(s);
    std::vector<float> scores(std::min(tq, kQueryBlock) * tk);
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t h = 0; h < s.heads; ++h) {
        const HeadView hv = Head(s, b, h);
        for (int64_t i0 = 0; i0 < tq; i0 += kQueryBlock) {
          const int64_t rows = std::min(kQueryBlock, tq - i0);
          float* o = out + hv.out_off + i0 * s.out_ld;
          float* l = lse + hv.lse_off + i0;
          Sgemm(CblasNoTrans, CblasTrans, rows, tk, hd, scale, q + hv.q_off + i0 * s.q_ld, s.q_ld,
                k + hv.k_off, s.k_ld, 0.0f, scores.data(), tk);
          ParallelFor(rows, 3 * tk, [&](int64_t r) {
            l[r] = MaskedSoftmaxRow(scores.data() + r * tk, tk, k_pos, q_pos[i0 + r]);
          });
          // With tk == 0, Sgemm's k == 0 path writes out = 0 (beta 0).
          Sgemm(CblasNoTrans, CblasNoTrans, rows, hd, tk, 1.0f, scores.data(), tk, v + hv.v_off,
                s.v_ld, 0.0f, o, s.out_ld);
        }
      }
    }
  }

  // With P recomputed from the saved lse (P_ij = exp(S_ij - lse_i) on visible keys),
  //   dV = P^T dO,  dP = dO V^T,  dS_ij = P_ij (dP_ij - D_i) with D_i = sum_d dO_id O_id,
  //   dQ = scale dS K,  dK = scale dS^T Q.
  // dK and dV sum over query blocks: the first block overwrites (beta 0), later ones add.
  void AttentionBackward(const AttentionShape& s, const float* q, const float* k, const float* v,
                         const int32_t* q_pos, const int32_t* k_pos, const float* out,
                         const float* lse, const float* dout, float* dq, float* dk,
                         float* dv) const override {
    const int64_t tq = s.tq, tk = s.tk, hd = s.head_dim;
    const float scale = AttentionScale(s);
    const int64_t block = std::min(tq, kQueryBlock);
    std::vector<float> p(block * tk), ds(block * tk);
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t h = 0; h < s.heads; ++h) {
        const HeadView hv = Head(s, b, h);
        float* dkh = dk + hv.k_off;
        float* dvh = dv + hv.v_off;
        if (tq == 0) {  // No query: the keys' gradients are zero.
          ScaleMatrix(tk, hd, 0.0f, dkh, s.k_ld);
          ScaleMatrix(tk, hd, 0.0f, dvh, s.v_ld);
          continue;
        }
        for (int64_t i0 = 0; i0 < tq; i0 += kQueryBlock) {
          const int64_t rows = std::min(kQueryBlock, tq - i0);
          const float* qb = q + hv.q_off + i0 * s.q_ld;
          const float* ob = out + hv.out_off + i0 * s.out_ld;
          const float* dob = dout + hv.out_off + i0 * s.out_ld;
          const float* lb = lse + hv.lse_off + i0;
          Sgemm(CblasNoTrans, CblasTrans, rows, tk, hd, scale, qb, s.q_ld, k + hv.k_off, s.k_ld,
                0.0f, p.data(), tk);
          Sgemm(CblasNoTrans, CblasTrans, rows, tk, hd, 1.0f, dob, s.out_ld, v + hv.v_off, s.v_ld,
                0.0f, ds.data(), tk);
          ParallelFor(rows, 4 * tk, [&](int64_t r) {
            float* pr = p.data() + r * tk;
            float* dsr = ds.data() + r * tk;
            const float l = lb[r];
            if (std::isinf(l)) {  // A query that sees no key: no probability, no gradient.
              std::fill(pr, pr + tk, 0.0f);
              std::fill(dsr, dsr + tk, 0.0f);
              return;
            }
            double d = 0;
            for (int64_t c = 0; c < hd; ++c) {
              d += static_cast<double>(dob[r * s.out_ld + c]) * ob[r * s.out_ld + c];
            }
            const float di = static_cast<float>(d);
            const int32_t qp = q_pos[i0 + r];
            for (int64_t j = 0; j < tk; ++j) {
              const float pj = k_pos[j] <= qp ? std::exp(pr[j] - l) : 0.0f;
              pr[j] = pj;
              dsr[j] = pj * (dsr[j] - di);
            }
          });
          const float beta = i0 == 0 ? 0.0f : 1.0f;
          Sgemm(CblasNoTrans, CblasNoTrans, rows, hd, tk, scale, ds.data(), tk, k + hv.k_off,
                s.k_ld, 0.0f, dq + hv.q_off + i0 * s.q_ld, s.q_ld);
          Sgemm(CblasTrans, CblasNoTrans, tk, hd, rows, scale, ds.data(), tk, qb, s.q_ld, beta, dkh,
                s.k_ld);
          Sgemm(CblasTrans, CblasNoTrans, tk, hd, rows, 1.0f, p.data(), tk, dob, s.out_ld, beta,
                dvh, s.v_ld);
        }
      }
    }
  }

  // lse is computed for every row, ignored ones included (their loss is 0).
  void CrossEntropyForward(const float* logits, int64_t rows, int64_t vocab, const int32_t* targets,
                           float* loss, float* lse) const override {
    ParallelFor(rows, 2 * vocab, [&](int64_t i) {
      const float* li = logits + i * vocab;
      float mx = kNegInf;
      for (int64_t j = 0; j < vocab; ++j) mx = std::max(mx, li[j]);
      double sum = 0;
      for (int64_t j = 0; j < vocab; ++j) sum += std::exp(li[j] - mx);
      const float l = mx + static_cast<float>(std::log(sum));
      lse[i] = l;
      loss[i] = targets[i] < 0 ? 0.0f : l - li[targets[i]];
    });
  }

  void CrossEntropyBackward(const float* logits, const float* lse, const int32_t* targets,
                            int64_t rows, int64_t vocab, float dloss,
                            float* dlogits) const override {
    ParallelFor(rows, vocab, [&](int64_t i) {
      float* gi = dlogits + i * vocab;
      const int32_t t = targets[i];
      if (t < 0) {
        std::fill(gi, gi + vocab, 0.0f);
        return;
      }
      const float* li = logits + i * vocab;
      const float l = lse[i];
      for (int64_t j = 0; j < vocab; ++j) gi[j] = dloss * std::exp(li[j] - l);
      gi[t] -= dloss;
    });
  }

  void Add(const float* a, const float* b, int64_t n, float* out) const override {
    constexpr int64_t kChunk = 1 << 14;
    ParallelFor((n + kChunk - 1) / kChunk, kChunk, [&](int64_t c) {
      const int64_t end = std::min(n, (c + 1) * kChunk);
      for (int64_t i = c * kChunk; i < end; ++i) out[i] = a[i] + b[i];
    });
  }
};

}  // namespace

const TransformerOps& CpuOps() {
  static const CpuTransformerOps ops;
  return ops;
}

}  // namespace kernels
}  // namespace stallfree
