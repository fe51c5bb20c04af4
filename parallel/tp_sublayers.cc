#include "parallel/tp_sublayers.h"

#include "common/status.h"
#include "parallel/linear.h"

namespace stallfree {
namespace parallel {
namespace tp {

using kernels::TransformerOps;
using layer::BatchMajorToRankMajor;
using layer::Linear;
using layer::LinearInputGrad;
using layer::LinearWeightGrad;
using layer::RankMajorToBatchMajor;

SequenceParallel::SequenceParallel(const TransformerOps& ops, const BlockConfig& cfg,
                                   Communicator* group, int64_t B, int64_t rows)
    : ops_(ops),
      cfg_(cfg),
      group_(group),
      B_(B),
      rows_(rows),
      nl_(B * rows),
      n_(B * rows * group->size()),
      Fl_(cfg.FF / group->size()) {}

absl::Status SequenceParallel::Gather(const float* local, float* full) const {
  const int t = group_->size();
  kernels::OpsBuffer recv(&ops_, n_ * cfg_.C);
  RETURN_IF_ERROR(group_->AllGather(local, recv.data(), nl_ * cfg_.C));
  RankMajorToBatchMajor(ops_, recv.data(), t, B_, rows_, cfg_.C, full);
  return absl::OkStatus();
}

absl::Status SequenceParallel::ReduceScatter(const float* full, float* local) const {
  const int t = group_->size();
  kernels::OpsBuffer send(&ops_, n_ * cfg_.C);
  BatchMajorToRankMajor(ops_, full, t, B_, rows_, cfg_.C, send.data());
  return group_->ReduceScatter(send.data(), local, nl_ * cfg_.C);
}

absl::Status SequenceParallel::NormGather(const float* x, const float* ln, float* rstd,
                                          float* norm_local, float* gathered) const {
  ops_.RmsNormForward(x, ln, nl_, cfg_.C, cfg_.eps, norm_local, rstd);
  return Gather(norm_local, gathered);
}

absl::Status SequenceParallel::RowParallelResidual(const float* in, int64_t width, const float* w,
                                                   const float* residual, float* partial,
                                                   float* out) const {
  const int64_t C = cfg_.C;
  Linear(ops_, in, width, w, n_, C, width, partial, C);
  RETURN_IF_ERROR(ReduceScatter(partial, out));
  ops_.Add(residual, out, nl_ * C, out);
  return absl::OkStatus();
}

absl::Status SequenceParallel::RowParallelBackward(const float* dout, const float* in,
                                                   int64_t width, const float* w, float* full,
                                                   float* dw, float* din) const {
  const int64_t C = cfg_.C;
  RETURN_IF_ERROR(Gather(dout, full));
  LinearWeightGrad(ops_, full, C, in, n_, C, width, dw);
  LinearInputGrad(ops_, full, C, w, n_, C, width, din);
  return absl::OkStatus();
}

absl::Status SequenceParallel::NormBackward(const float* dfull, const float* x, const float* ln,
                                            const float* rstd, const float* dresidual,
                                            float* dnorm, float* dx, float* dln) const {
  RETURN_IF_ERROR(ReduceScatter(dfull, dnorm));
  ops_.RmsNormBackward(x, ln, rstd, dnorm, nl_, cfg_.C, dx, dln);
  ops_.Add(dx, dresidual, nl_ * cfg_.C, dx);
  return absl::OkStatus();
}

absl::Status SequenceParallel::Mlp(const MlpWeights& w, const float* h, const MlpCache& c,
                                   float* norm_local, float* partial, float* y) const {
  const int64_t C = cfg_.C;
  RETURN_IF_ERROR(NormGather(h, w.ln2, c.rstd2, norm_local, c.n2));
  Linear(ops_, c.n2, C, w.wg, n_, Fl_, C, c.g, Fl_);
  Linear(ops_, c.n2, C, w.wu, n_, Fl_, C, c.u, Fl_);
  ops_.SwiGluForward(c.g, c.u, n_ * Fl_, c.m);
  return RowParallelResidual(c.m, Fl_, w.wd, h, partial, y);
}

absl::Status SequenceParallel::MlpBackward(const MlpWeights& w, const float* h, const MlpCache& c,
                                           const float* dy, const Scratch& s, const MlpGrads& d,
                                           float* dln2, float* dh) const {
  const int64_t C = cfg_.C;
  RETURN_IF_ERROR(RowParallelBackward(dy, c.m, Fl_, w.wd, s.full, d.wd, s.dm));
  ops_.SwiGluBackward(c.g, c.u, s.dm, n_ * Fl_, s.dg, s.du);
  LinearWeightGrad(ops_, s.dg, Fl_, c.n2, n_, Fl_, C, d.wg);
  LinearWeightGrad(ops_, s.du, Fl_, c.n2, n_, Fl_, C, d.wu);
  LinearInputGrad(ops_, s.dg, Fl_, w.wg, n_, Fl_, C, s.dfull);
  LinearInputGrad(ops_, s.du, Fl_, w.wu, n_, Fl_, C, s.dfull, 1.0f);
  return NormBackward(s.dfull, h, w.ln2, c.rstd2, dy, s.dnorm, dh, dln2);
}

}  // namespace tp
}  // namespace parallel
}  // namespace stallfree
