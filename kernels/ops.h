// Transformer operations, forward and backward: one device-neutral interface, a CPU backend
// (OpenBLAS GEMM, oneTBB) and a CUDA backend (cuBLAS, CUDA kernels). Memory and streams are
// kernels/memory.h's, which the ZenFlow engine uses without the math (and without BLAS).
//
// Conventions
// - All tensors are row-major. Pointers refer to the backend's memory (host for CpuOps(), device
//   for a CUDA backend). CPU calls run to completion; CUDA calls enqueue on the backend's stream
//   and Synchronize() returns "" or the first error.
// - Backward functions write (overwrite) the gradients of their inputs, except where a comment
//   says "accumulates" (+=): weight gradients that several calls contribute to.
// - Activations are fp32. Gemm has an fp32 and a bf16-input form (fp32 accumulation and output).
// - Shapes are validated by the callers (the layers); the kernels assume them. GEMM dimensions
//   and leading dimensions must be below 2^31 (BLAS takes int) and follow BLAS's rules (a
//   leading dimension is at least the row width).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kernels/memory.h"

namespace stallfree {
namespace kernels {

enum class Trans { kNo, kYes };

// Causal attention over explicit positions. Queries [batch, tq, heads, head_dim] and keys /
// values [batch, tk, heads, head_dim]; element (b, t, h, d) of q is at
// q[(b * tq + t) * q_ld + h * head_dim + d] (q_ld >= heads * head_dim, so q, k, v may be
// column slices of one fused projection), likewise k with k_ld, v with v_ld, out with out_ld.
// Key j is visible to query i iff k_pos[j] <= q_pos[i] (positions are global token positions,
// shared by every batch row and head): this is what lets a rank attend with its zigzag-ordered
// local queries against gathered keys. A query that sees no key gets out = 0 and lse = -inf.
// lse is [batch, heads, tq]: the log-sum-exp of the scaled scores, saved for the backward.
struct AttentionShape {
  int64_t batch = 1;
  int64_t tq = 0;
  int64_t tk = 0;
  int64_t heads = 1;
  int64_t head_dim = 0;
  int64_t q_ld = 0, k_ld = 0, v_ld = 0, out_ld = 0;
  float scale = 0;  // scores are scale * q.k; 0 means 1/sqrt(head_dim).
};

// The math of a transformer on a backend, over the backend's memory (kernels/memory.h).
class TransformerOps : public BackendMemory {
 public:
  // C[m,n] = alpha * op(A) op(B) + beta * C. op(A) is [m,k]: A is [m,k] (kNo) or [k,m] (kYes)
  // with row stride lda; op(B) is [k,n]: B is [k,n] or [n,k] with row stride ldb. A linear layer
  // y = x W^T with W[out,in] is Gemm(kNo, kYes, tokens, out, in, 1, x, in, W, in, 0, y, out).
  virtual void Gemm(Trans ta, Trans tb, int64_t m, int64_t n, int64_t k, float alpha,
                    const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                    float* c, int64_t ldc) const = 0;
  // The same with bf16 A and B (fp32 accumulation, fp32 C).
  virtual void GemmBf16(Trans ta, Trans tb, int64_t m, int64_t n, int64_t k, float alpha,
                        const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                        float beta, float* c, int64_t ldc) const = 0;

  // out[i, :] = table[ids[i], :] for i < n; table is [vocab, dim]; ids in [0, vocab).
  virtual void EmbeddingForward(const float* table, int64_t dim, const int32_t* ids, int64_t n,
                                float* out) const = 0;
  // Accumulates dtable[ids[i], :] += dout[i, :].
  virtual void EmbeddingBackward(const float* dout, int64_t dim, const int32_t* ids, int64_t n,
                                 float* dtable) const = 0;

  // y = x * rsqrt(mean(x^2) + eps) * w over the last dim; x, y [rows, dim]; rstd [rows] saved.
  virtual void RmsNormForward(const float* x, const float* w, int64_t rows, int64_t dim,
                              float eps, float* y, float* rstd) const = 0;
  // dx written; dw accumulated.
  virtual void RmsNormBackward(const float* x, const float* w, const float* rstd,
                               const float* dy, int64_t rows, int64_t dim, float* dx,
                               float* dw) const = 0;

  // The SiLU-gated MLP activation: out = silu(gate) * up, silu(z) = z / (1 + exp(-z)); n
  // elements.
  virtual void SwiGluForward(const float* gate, const float* up, int64_t n,
                             float* out) const = 0;
  virtual void SwiGluBackward(const float* gate, const float* up, const float* dout, int64_t n,
                              float* dgate, float* dup) const = 0;

  virtual void AttentionForward(const AttentionShape& s, const float* q, const float* k,
                                const float* v, const int32_t* q_pos, const int32_t* k_pos,
                                float* out, float* lse) const = 0;
  // dout has out's layout (stride out_ld); dq, dk, dv are written with the strides of q, k, v
  // (q_ld, k_ld, v_ld), only inside those views.
  virtual void AttentionBackward(const AttentionShape& s, const float* q, const float* k,
                                 const float* v, const int32_t* q_pos, const int32_t* k_pos,
                                 const float* out, const float* lse, const float* dout,
                                 float* dq, float* dk, float* dv) const = 0;

  // Cross-entropy of logits [rows, vocab] against targets [rows] (a target < 0 is ignored: loss
  // 0, gradient 0). loss[i] = lse_i - logits[i, target_i]; lse [rows] saved.
  virtual void CrossEntropyForward(const float* logits, int64_t rows, int64_t vocab,
                                   const int32_t* targets, float* loss, float* lse) const = 0;
  // dlogits[i, :] = dloss * (softmax(logits[i]) - onehot(target_i)), the gradient of
  // dloss * sum_i loss[i] (dloss = 1 / valid rows for a mean).
  virtual void CrossEntropyBackward(const float* logits, const float* lse,
                                    const int32_t* targets, int64_t rows, int64_t vocab,
                                    float dloss, float* dlogits) const = 0;

  // out[i] = a[i] + b[i]; out may alias a or b. (The residual add; its backward is the identity.)
  virtual void Add(const float* a, const float* b, int64_t n, float* out) const = 0;
};

// The CPU backend (process-wide, thread safe).
const TransformerOps& CpuOps();

}  // namespace kernels
}  // namespace stallfree
