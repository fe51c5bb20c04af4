#include "parallel/tpsp_block.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "parallel/linear.h"

namespace stallfree {
namespace parallel {
namespace {

using kernels::AttentionShape;
using kernels::Trans;
using kernels::TransformerOps;

// Shard sizes of BlockWeights' fields in declaration order.
std::vector<int64_t> ShardSizes(const BlockConfig& c, int D) {
  const int64_t cc = c.C * (c.C / D), fc = c.C * (c.FF / D);
  return {c.C, cc, cc, cc, cc, c.C, fc, fc, fc};
}

// dst[r, :] = src rows [row0, row0 + rows) of a [*, cols] matrix.
void CopyRows(const std::vector<float>& src, int64_t row0, int64_t rows, int64_t cols, float* dst) {
  std::memcpy(dst, src.data() + row0 * cols, sizeof(float) * rows * cols);
}

// dst [rows, width] = src[:, col0 .. col0 + width) for src [rows, cols].
void CopyCols(const float* src, int64_t rows, int64_t cols, int64_t col0, int64_t width,
              float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * width, src + r * cols + col0, sizeof(float) * width);
  }
}

// dst[:, col0 .. col0 + width) = src [rows, width] for dst [rows, cols].
void PlaceCols(const float* src, int64_t rows, int64_t cols, int64_t col0, int64_t width,
               float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * cols + col0, src + r * width, sizeof(float) * width);
  }
}

AttentionShape LocalShape(const BlockConfig& cfg, int D, int64_t B, int64_t T) {
  AttentionShape s;
  s.batch = B;
  s.tq = s.tk = T;
  s.heads = cfg.H / D;
  s.head_dim = cfg.C / cfg.H;
  s.q_ld = s.k_ld = s.v_ld = 3 * (cfg.C / D);
  s.out_ld = cfg.C / D;
  return s;
}

absl::Status CheckBT(int64_t B, int64_t T, int D) {
  if (B <= 0 || T <= 0 || T % D != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tpsp: need B > 0 and T > 0 with T % D == 0, got B=", B, " T=", T, " D=", D));
  }
  return absl::OkStatus();
}

absl::Status Sync(const TransformerOps& ops, const char* what) {
  return layer::Sync(ops, "tpsp", what);
}

using layer::Linear;
using layer::LinearInputGrad;
using layer::LinearWeightGrad;

}  // namespace

absl::Status ValidateTpspConfig(const BlockConfig& cfg, int D, int p) {
  absl::Status st = ValidateBlockConfig(cfg);
  if (!st.ok()) return st;
  if (D <= 0 || p < 0 || p >= D || cfg.H % D != 0 || cfg.FF % D != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tpsp: bad degree D=", D, " rank ", p,
                                                   " for H=", cfg.H, " FF=", cfg.FF,
                                                   " (need H % D == 0, FF % D == 0)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<BlockWeights> ShardTpspWeights(const BlockConfig& cfg, const BlockWeights& full,
                                              int D, int p) {
  absl::Status st = ValidateTpspConfig(cfg, D, p);
  if (st.ok()) st = CheckBlockWeights(cfg, full);
  if (!st.ok()) return st;
  const int64_t C = cfg.C, Cl = C / D, Fl = cfg.FF / D;
  BlockWeights s;
  s.ln1 = full.ln1;
  s.ln2 = full.ln2;
  using Pair = std::pair<const std::vector<float>*, std::vector<float>*>;
  for (const Pair& sd : {Pair{&full.wq, &s.wq}, Pair{&full.wk, &s.wk}, Pair{&full.wv, &s.wv}}) {
    sd.second->resize(Cl * C);
    CopyRows(*sd.first, p * Cl, Cl, C, sd.second->data());
  }
  s.wo.resize(C * Cl);
  CopyCols(full.wo.data(), C, C, p * Cl, Cl, s.wo.data());
  for (const Pair& sd : {Pair{&full.wg, &s.wg}, Pair{&full.wu, &s.wu}}) {
    sd.second->resize(Fl * C);
    CopyRows(*sd.first, p * Fl, Fl, C, sd.second->data());
  }
  s.wd.resize(C * Fl);
  CopyCols(full.wd.data(), C, cfg.FF, p * Fl, Fl, s.wd.data());
  return s;
}

absl::Status CheckTpspShard(const BlockConfig& cfg, const BlockWeights& shard, int D) {
  absl::Status st = ValidateTpspConfig(cfg, D, 0);
  if (!st.ok()) return st;
  const std::vector<int64_t> sizes = ShardSizes(cfg, D);
  const std::vector<const std::vector<float>*> t = shard.Tensors();
  for (size_t i = 0; i < t.size(); ++i) {
    if (static_cast<int64_t>(t[i]->size()) != sizes[i]) {
      return absl::InvalidArgumentError(absl::StrCat("tpsp: shard ", BlockTensorNames()[i], " has ",
                                                     t[i]->size(), " elements, want ", sizes[i]));
    }
  }
  return absl::OkStatus();
}

absl::Status PlaceTpspShardGrads(const BlockConfig& cfg, const BlockGrads& shard, int D, int p,
                                 BlockGrads* full) {
  absl::Status st = ValidateTpspConfig(cfg, D, p);
  if (st.ok()) st = CheckTpspShard(cfg, shard, D);
  if (!st.ok()) return st;
  if (full == nullptr) return absl::InvalidArgumentError("tpsp: null full gradients");
  bool empty = true;
  for (const std::vector<float>* v : full->Tensors()) empty = empty && v->empty();
  if (empty) *full = BlockWeights::Zeros(cfg);
  st = CheckBlockWeights(cfg, *full);
  if (!st.ok()) return st;
  const int64_t C = cfg.C, Cl = C / D, Fl = cfg.FF / D;
  full->ln1 = shard.ln1;
  full->ln2 = shard.ln2;
  using Pair = std::pair<const std::vector<float>*, std::vector<float>*>;
  for (const Pair& sd :
       {Pair{&shard.wq, &full->wq}, Pair{&shard.wk, &full->wk}, Pair{&shard.wv, &full->wv}}) {
    std::copy(sd.first->begin(), sd.first->end(), sd.second->begin() + p * Cl * C);
  }
  PlaceCols(shard.wo.data(), C, C, p * Cl, Cl, full->wo.data());
  for (const Pair& sd : {Pair{&shard.wg, &full->wg}, Pair{&shard.wu, &full->wu}}) {
    std::copy(sd.first->begin(), sd.first->end(), sd.second->begin() + p * Fl * C);
  }
  PlaceCols(shard.wd.data(), C, cfg.FF, p * Fl, Fl, full->wd.data());
  return absl::OkStatus();
}

absl::Status TpspBlock::GatherSequence(const float* local, int64_t B, int64_t T,
                                       float* full) const {
  const int D = comm_->size();
  const int64_t C = cfg_.C, Tl = T / D, chunk = Tl * C;
  std::vector<float> recv(static_cast<size_t>(D * B * chunk));
  absl::Status st = comm_->AllGather(local, recv.data(), B * chunk);
  if (!st.ok()) return st;
  // recv is [D, B, T/D, C]; full is [B, T, C] with rank d's tokens at [d*T/D, (d+1)*T/D).
  for (int d = 0; d < D; ++d) {
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(full + (b * T + d * Tl) * C, recv.data() + (d * B + b) * chunk,
                  sizeof(float) * chunk);
    }
  }
  return absl::OkStatus();
}

absl::Status TpspBlock::ReduceScatterSequence(const float* full, int64_t B, int64_t T,
                                              float* local) const {
  const int D = comm_->size();
  const int64_t C = cfg_.C, Tl = T / D, chunk = Tl * C;
  // [B, T, C] -> [D, B, T/D, C]: block d of the reduce-scatter is rank d's tokens.
  std::vector<float> send(static_cast<size_t>(D * B * chunk));
  for (int d = 0; d < D; ++d) {
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(send.data() + (d * B + b) * chunk, full + (b * T + d * Tl) * C,
                  sizeof(float) * chunk);
    }
  }
  return comm_->ReduceScatter(send.data(), local, B * chunk);
}

absl::Status TpspBlock::Forward(const TransformerOps& ops, const BlockWeights& w,
                                const float* x_local, int64_t B, int64_t T, float* y_local,
                                TpspCache* cache) const {
  if (comm_ == nullptr) return absl::InvalidArgumentError("tpsp: null communicator");
  const int D = comm_->size();
  absl::Status st = ValidateTpspConfig(cfg_, D, comm_->rank());
  if (st.ok()) st = CheckTpspShard(cfg_, w, D);
  if (st.ok()) st = CheckBT(B, T, D);
  if (!st.ok()) return st;
  if (x_local == nullptr || y_local == nullptr) {
    return absl::InvalidArgumentError("tpsp: null x or y");
  }
  TpspCache scratch;
  TpspCache& c = cache != nullptr ? *cache : scratch;
  const int64_t C = cfg_.C, Cl = C / D, Fl = cfg_.FF / D, C3 = 3 * Cl;
  const int64_t n = B * T, nl = n / D;
  c.B = B;
  c.T = T;
  c.positions.resize(T);
  for (int64_t t = 0; t < T; ++t) c.positions[t] = static_cast<int32_t>(t);
  c.x.assign(x_local, x_local + nl * C);
  c.rstd1.resize(nl);
  c.n1.resize(n * C);
  c.qkv.resize(n * C3);
  c.att.resize(n * Cl);
  c.lse.resize(B * (cfg_.H / D) * T);
  c.h.resize(nl * C);
  c.rstd2.resize(nl);
  c.n2.resize(n * C);
  c.g.resize(n * Fl);
  c.u.resize(n * Fl);
  c.m.resize(n * Fl);
  std::vector<float> norm_local(nl * C), partial(n * C);

  // Attention: h = x + RS(attn_p(AG(rmsnorm(x)))).
  ops.RmsNormForward(x_local, w.ln1.data(), nl, C, cfg_.eps, norm_local.data(), c.rstd1.data());
  if (st = Sync(ops, "ln1 forward"); !st.ok()) return st;
  if (st = GatherSequence(norm_local.data(), B, T, c.n1.data()); !st.ok()) return st;
  Linear(ops, c.n1.data(), C, w.wq.data(), n, Cl, C, c.qkv.data(), C3);
  Linear(ops, c.n1.data(), C, w.wk.data(), n, Cl, C, c.qkv.data() + Cl, C3);
  Linear(ops, c.n1.data(), C, w.wv.data(), n, Cl, C, c.qkv.data() + 2 * Cl, C3);
  const AttentionShape s = LocalShape(cfg_, D, B, T);
  ops.AttentionForward(s, c.qkv.data(), c.qkv.data() + Cl, c.qkv.data() + 2 * Cl,
                       c.positions.data(), c.positions.data(), c.att.data(), c.lse.data());
  Linear(ops, c.att.data(), Cl, w.wo.data(), n, C, Cl, partial.data(), C);
  if (st = Sync(ops, "attention forward"); !st.ok()) return st;
  if (st = ReduceScatterSequence(partial.data(), B, T, c.h.data()); !st.ok()) return st;
  ops.Add(x_local, c.h.data(), nl * C, c.h.data());

  // MLP: y = h + RS(mlp_p(AG(rmsnorm(h)))).
  ops.RmsNormForward(c.h.data(), w.ln2.data(), nl, C, cfg_.eps, norm_local.data(), c.rstd2.data());
  if (st = Sync(ops, "ln2 forward"); !st.ok()) return st;
  if (st = GatherSequence(norm_local.data(), B, T, c.n2.data()); !st.ok()) return st;
  Linear(ops, c.n2.data(), C, w.wg.data(), n, Fl, C, c.g.data(), Fl);
  Linear(ops, c.n2.data(), C, w.wu.data(), n, Fl, C, c.u.data(), Fl);
  ops.SwiGluForward(c.g.data(), c.u.data(), n * Fl, c.m.data());
  Linear(ops, c.m.data(), Fl, w.wd.data(), n, C, Fl, partial.data(), C);
  if (st = Sync(ops, "mlp forward"); !st.ok()) return st;
  if (st = ReduceScatterSequence(partial.data(), B, T, y_local); !st.ok()) return st;
  ops.Add(c.h.data(), y_local, nl * C, y_local);
  return Sync(ops, "block forward");
}

absl::Status TpspBlock::Backward(const TransformerOps& ops, const BlockWeights& w,
                                 const TpspCache& c, const float* dy_local, float* dx_local,
                                 BlockGrads* grads) const {
  if (comm_ == nullptr) return absl::InvalidArgumentError("tpsp: null communicator");
  const int D = comm_->size();
  absl::Status st = ValidateTpspConfig(cfg_, D, comm_->rank());
  if (st.ok()) st = CheckTpspShard(cfg_, w, D);
  if (st.ok()) st = CheckBT(c.B, c.T, D);
  if (!st.ok()) return st;
  if (dy_local == nullptr || dx_local == nullptr || grads == nullptr) {
    return absl::InvalidArgumentError("tpsp: null dy, dx or grads");
  }
  const int64_t B = c.B, T = c.T, C = cfg_.C, Cl = C / D, Fl = cfg_.FF / D, C3 = 3 * Cl;
  const int64_t n = B * T, nl = n / D;
  if (static_cast<int64_t>(c.x.size()) != nl * C || static_cast<int64_t>(c.m.size()) != n * Fl ||
      static_cast<int64_t>(c.qkv.size()) != n * C3) {
    return absl::InvalidArgumentError("tpsp: cache does not match its B, T and D");
  }
  // Size empty gradient fields; any other size is an error.
  {
    const std::vector<int64_t> sizes = ShardSizes(cfg_, D);
    const std::vector<std::vector<float>*> t = grads->Tensors();
    for (size_t i = 0; i < t.size(); ++i) {
      if (t[i]->empty()) t[i]->assign(static_cast<size_t>(sizes[i]), 0.0f);
    }
    if (st = CheckTpspShard(cfg_, *grads, D); !st.ok()) return st;
  }

  std::vector<float> full(n * C), dfull(n * C);  // gathered gradient; partial input gradient
  std::vector<float> dm(n * Fl), dg(n * Fl), du(n * Fl), datt(n * Cl), dqkv(n * C3);
  std::vector<float> dh(nl * C), dnorm(nl * C);
  std::vector<float> dln(2 * C, 0.0f);  // ln1 | ln2 partial gradients over the local tokens

  // MLP: y = h + m Wd_p^T (summed over ranks by the reduce-scatter).
  if (st = GatherSequence(dy_local, B, T, full.data()); !st.ok()) return st;
  LinearWeightGrad(ops, full.data(), C, c.m.data(), n, C, Fl, grads->wd.data());
  LinearInputGrad(ops, full.data(), C, w.wd.data(), n, C, Fl, dm.data());
  ops.SwiGluBackward(c.g.data(), c.u.data(), dm.data(), n * Fl, dg.data(), du.data());
  LinearWeightGrad(ops, dg.data(), Fl, c.n2.data(), n, Fl, C, grads->wg.data());
  LinearWeightGrad(ops, du.data(), Fl, c.n2.data(), n, Fl, C, grads->wu.data());
  LinearInputGrad(ops, dg.data(), Fl, w.wg.data(), n, Fl, C, dfull.data());
  LinearInputGrad(ops, du.data(), Fl, w.wu.data(), n, Fl, C, dfull.data(), 1.0f);
  if (st = Sync(ops, "mlp backward"); !st.ok()) return st;
  if (st = ReduceScatterSequence(dfull.data(), B, T, dnorm.data()); !st.ok()) return st;
  ops.RmsNormBackward(c.h.data(), w.ln2.data(), c.rstd2.data(), dnorm.data(), nl, C, dh.data(),
                      dln.data() + C);
  ops.Add(dh.data(), dy_local, nl * C, dh.data());  // The residual's identity branch.

  // Attention: h = x + att_p Wo_p^T (summed over ranks).
  if (st = Sync(ops, "ln2 backward"); !st.ok()) return st;
  if (st = GatherSequence(dh.data(), B, T, full.data()); !st.ok()) return st;
  LinearWeightGrad(ops, full.data(), C, c.att.data(), n, C, Cl, grads->wo.data());
  LinearInputGrad(ops, full.data(), C, w.wo.data(), n, C, Cl, datt.data());
  const AttentionShape s = LocalShape(cfg_, D, B, T);
  ops.AttentionBackward(s, c.qkv.data(), c.qkv.data() + Cl, c.qkv.data() + 2 * Cl,
                        c.positions.data(), c.positions.data(), c.att.data(), c.lse.data(),
                        datt.data(), dqkv.data(), dqkv.data() + Cl, dqkv.data() + 2 * Cl);
  const float* wqkv[3] = {w.wq.data(), w.wk.data(), w.wv.data()};
  float* dwqkv[3] = {grads->wq.data(), grads->wk.data(), grads->wv.data()};
  for (int i = 0; i < 3; ++i) {
    LinearWeightGrad(ops, dqkv.data() + i * Cl, C3, c.n1.data(), n, Cl, C, dwqkv[i]);
    LinearInputGrad(ops, dqkv.data() + i * Cl, C3, wqkv[i], n, Cl, C, dfull.data(),
                    i == 0 ? 0.0f : 1.0f);
  }
  if (st = Sync(ops, "attention backward"); !st.ok()) return st;
  if (st = ReduceScatterSequence(dfull.data(), B, T, dnorm.data()); !st.ok()) return st;
  ops.RmsNormBackward(c.x.data(), w.ln1.data(), c.rstd1.data(), dnorm.data(), nl, C, dx_local,
                      dln.data());
  ops.Add(dx_local, dh.data(), nl * C, dx_local);
  if (st = Sync(ops, "ln1 backward"); !st.ok()) return st;

  // The replicated norms' gradients: sums over every rank's tokens.
  if (st = comm_->AllReduce(dln.data(), 2 * C); !st.ok()) return st;
  for (int64_t i = 0; i < C; ++i) {
    grads->ln1[i] += dln[i];
    grads->ln2[i] += dln[C + i];
  }
  return absl::OkStatus();
}

}  // namespace parallel
}  // namespace stallfree
