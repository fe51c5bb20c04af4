// What the TP+SP block (parallel/tpsp_block.h) and the TP x CP block (parallel/tpcp_block.h)
// share: Megatron's sequence-parallel layout inside a tensor-parallel group, and the steps of a
// sublayer in it.
//
// Layout. The group has t = group->size() ranks; each holds `rows` consecutive tokens of each of
// B batch rows, local [B, rows, C] (nl = B * rows tokens). Column-parallel linears run on the
// group's tokens, [B, t * rows, C] (n = t * nl), gathered in rank order: rank r's tokens of row b
// are rows [r * rows, (r + 1) * rows) of row b. Row-parallel linears give partial [B, t * rows,
// C] sums, reduce-scattered back to each rank's own tokens.
//
// Every pointer is in the backend's memory (`ops`); the group must accept that memory and run
// in stream order with `ops` (see the blocks' "Memory spaces"). Weight gradients accumulate
// (+=); the rest is written. Sublayer steps (names as in the blocks):
//   forward:  NormGather (rmsnorm of the local tokens, all-gather) ... RowParallelResidual
//             (the row-parallel linear, reduce-scatter, residual add); Mlp is the whole MLP.
//   backward: RowParallelBackward (all-gather of the incoming gradient, the row-parallel
//             linear's gradients) ... NormBackward (reduce-scatter of the input gradient, the
//             rmsnorm's backward, the residual branch); MlpBackward is the whole MLP.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/reference_block.h"

namespace stallfree {
namespace parallel {
namespace tp {

// The MLP's tensors: the shard's weights (ln2 [C], wg, wu [FF/t, C], wd [C, FF/t]), their
// gradients, and the activations the forward caches: rstd2 [nl], n2 [n, C], g, u, m [n, FF/t].
struct MlpWeights {
  const float *ln2, *wg, *wu, *wd;
};
struct MlpGrads {
  float *wg, *wu, *wd;
};
struct MlpCache {
  float *rstd2, *n2, *g, *u, *m;
};
// The backward's scratch: full, dfull [n, C]; dm, dg, du [n, FF/t]; dnorm [nl, C].
struct Scratch {
  float *full, *dfull, *dm, *dg, *du, *dnorm;
};

class SequenceParallel {
 public:
  // group must outlive this object; rows: local tokens per batch row.
  SequenceParallel(const kernels::TransformerOps& ops, const BlockConfig& cfg, Communicator* group,
                   int64_t B, int64_t rows);

  int64_t local_tokens() const { return nl_; }  // B * rows
  int64_t tokens() const { return n_; }         // B * rows * t

  // full [n, C] := the group's local [nl, C] (all-gather, then rank-major to batch-major).
  absl::Status Gather(const float* local, float* full) const;
  // local [nl, C] := the group's sum of its partial [n, C], this rank's tokens.
  absl::Status ReduceScatter(const float* full, float* local) const;

  // gathered [n, C] := AG(rmsnorm(x, ln)); rstd [nl] saved; norm_local [nl, C] is scratch.
  absl::Status NormGather(const float* x, const float* ln, float* rstd, float* norm_local,
                          float* gathered) const;
  // out [nl, C] := residual + RS(in [n, width] W^T) for W [C, width]; partial [n, C] is scratch.
  // out must not alias residual.
  absl::Status RowParallelResidual(const float* in, int64_t width, const float* w,
                                   const float* residual, float* partial, float* out) const;
  // For out = RowParallelResidual(in, w): full := AG(dout) [n, C], dw += full^T in, din [n,
  // width] := full W.
  absl::Status RowParallelBackward(const float* dout, const float* in, int64_t width,
                                   const float* w, float* full, float* dw, float* din) const;
  // The end of a sublayer's backward (its input was rmsnorm(x, ln), gathered): dnorm := RS(dfull)
  // [nl, C]; dx := rmsnorm backward + dresidual; dln += its gradient. dx must not alias
  // dresidual.
  absl::Status NormBackward(const float* dfull, const float* x, const float* ln,
                            const float* rstd, const float* dresidual, float* dnorm, float* dx,
                            float* dln) const;

  // y [nl, C] = h + RS(SwiGLU(AG(rmsnorm(h, ln2)) Wg^T, . Wu^T) Wd^T), the cache filled;
  // norm_local [nl, C] and partial [n, C] are scratch.
  absl::Status Mlp(const MlpWeights& w, const float* h, const MlpCache& c, float* norm_local,
                   float* partial, float* y) const;
  // Its backward from dy [nl, C]: dh [nl, C] := dy + d(mlp)/dh; d += the weights' gradients,
  // dln2 += ln2's (partial over the local tokens).
  absl::Status MlpBackward(const MlpWeights& w, const float* h, const MlpCache& c,
                           const float* dy, const Scratch& s, const MlpGrads& d, float* dln2,
                           float* dh) const;

 private:
  const kernels::TransformerOps& ops_;
  const BlockConfig cfg_;
  Communicator* const group_;
  const int64_t B_, rows_, nl_, n_, Fl_;
};

}  // namespace tp
}  // namespace parallel
}  // namespace stallfree
