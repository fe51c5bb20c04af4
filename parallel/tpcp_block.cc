#include "parallel/tpcp_block.h"

#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "parallel/linear.h"
#include "parallel/tpsp_block.h"
#include "parallel/zigzag.h"

namespace stallfree {
namespace parallel {
namespace {

using kernels::AttentionShape;
using kernels::Trans;
using kernels::TransformerOps;

// [groups, B, rows, width] (rank-major, as an all-gather leaves it) <-> [B, groups * rows,
// width] (batch-major, as the kernels read it).
void RankMajorToBatchMajor(const float* src, int64_t groups, int64_t B, int64_t rows, int64_t width,
                           float* dst) {
  const int64_t chunk = rows * width;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(dst + (b * groups + g) * chunk, src + (g * B + b) * chunk, sizeof(float) * chunk);
    }
  }
}
void BatchMajorToRankMajor(const float* src, int64_t groups, int64_t B, int64_t rows, int64_t width,
                           float* dst) {
  const int64_t chunk = rows * width;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(dst + (g * B + b) * chunk, src + (b * groups + g) * chunk, sizeof(float) * chunk);
    }
  }
}

absl::Status Sync(const TransformerOps& ops, const char* what) {
  return layer::Sync(ops, "tpcp", what);
}

using layer::Linear;
using layer::LinearInputGrad;
using layer::LinearWeightGrad;

// Sizes empty gradient fields to the shard shapes; any other mismatch is an error.
absl::Status SizeGrads(const BlockConfig& cfg, int t, BlockGrads* grads) {
  const int64_t C = cfg.C, cc = C * (C / t), fc = C * (cfg.FF / t);
  const std::vector<int64_t> sizes = {C, cc, cc, cc, cc, C, fc, fc, fc};
  const std::vector<std::vector<float>*> f = grads->Tensors();
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i]->empty()) f[i]->assign(static_cast<size_t>(sizes[i]), 0.0f);
  }
  return CheckTpspShard(cfg, *grads, t);
}

}  // namespace

absl::StatusOr<TpcpGroups> NewGlooTpcpGroups(const CommOptions& world, int tp_degree) {
  if (tp_degree < 1 || world.size < 1 || world.size % tp_degree != 0 || world.rank < 0 ||
      world.rank >= world.size) {
    return absl::InvalidArgumentError(absl::StrCat("tpcp: bad grid: world rank ", world.rank,
                                                   " / size ", world.size, ", tp degree ",
                                                   tp_degree));
  }
  TpcpGroups g;
  g.tp_degree = tp_degree;
  g.cp_degree = world.size / tp_degree;
  g.tp_index = world.rank % tp_degree;
  g.cp_index = world.rank / tp_degree;
  if ((g.tp_degree > 1 || g.cp_degree > 1) && world.store_dir.empty()) {
    return absl::InvalidArgumentError(
        "tpcp: the TP and CP groups need a shared file store (CommOptions::store_dir, "
        "STALLFREE_STORE_DIR); a TCP store serves one group only");
  }
  CommOptions tp = world;
  tp.rank = g.tp_index;
  tp.size = g.tp_degree;
  tp.group = absl::StrCat(world.group, ".tp", g.cp_index);
  absl::StatusOr<std::unique_ptr<Communicator>> tp_comm = NewGlooCommunicator(tp);
  if (!tp_comm.ok()) return tp_comm.status();
  g.tp = std::move(*tp_comm);
  CommOptions cp = world;
  cp.rank = g.cp_index;
  cp.size = g.cp_degree;
  cp.group = absl::StrCat(world.group, ".cp", g.tp_index);
  absl::StatusOr<std::unique_ptr<Communicator>> cp_comm = NewGlooCommunicator(cp);
  if (!cp_comm.ok()) return cp_comm.status();
  g.cp = std::move(*cp_comm);
  return g;
}

absl::Status ValidateTpcpConfig(const BlockConfig& cfg, int t, int c, int tp_index, int cp_index) {
  absl::Status st = ValidateTpspConfig(cfg, t, tp_index);
  if (!st.ok()) return st;
  if (c < 1 || cp_index < 0 || cp_index >= c) {
    return absl::InvalidArgumentError(
        absl::StrCat("tpcp: bad CP degree ", c, " / index ", cp_index));
  }
  return absl::OkStatus();
}

absl::Status CheckTpcpSequence(int64_t B, int64_t T, int t, int c) {
  if (B <= 0 || t < 1 || c < 1 || T <= 0 || T % (2 * c) != 0 || (T / c) % t != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tpcp: need B > 0, T % (2c) == 0 and ",
                                                   "(T/c) % t == 0, got B=", B, " T=", T, " t=", t,
                                                   " c=", c));
  }
  return CheckZigzag(T, c, 0);
}

absl::StatusOr<std::vector<int32_t>> TpcpPositions(int64_t T, int t, int c, int tp_index,
                                                   int cp_index) {
  absl::Status st = CheckTpcpSequence(1, T, t, c);
  if (!st.ok()) return st;
  if (tp_index < 0 || tp_index >= t) {
    return absl::InvalidArgumentError(absl::StrCat("tpcp: bad TP index ", tp_index));
  }
  absl::StatusOr<std::vector<int32_t>> cp_pos = ZigzagPositions(T, c, cp_index);
  if (!cp_pos.ok()) return cp_pos.status();
  const int64_t Tl = T / c / t;
  return std::vector<int32_t>(cp_pos->begin() + tp_index * Tl,
                              cp_pos->begin() + (tp_index + 1) * Tl);
}

absl::Status TpcpBlock::Check() const {
  if (tp_ == nullptr || cp_ == nullptr) {
    return absl::InvalidArgumentError("tpcp: null communicator");
  }
  return ValidateTpcpConfig(cfg_, tp_->size(), cp_->size(), tp_->rank(), cp_->rank());
}

absl::Status TpcpBlock::GatherTp(const float* local, int64_t B, int64_t Tc, float* full) const {
  const int t = tp_->size();
  const int64_t Tl = Tc / t;
  std::vector<float> recv(static_cast<size_t>(B * Tc * cfg_.C));
  absl::Status st = tp_->AllGather(local, recv.data(), B * Tl * cfg_.C);
  if (!st.ok()) return st;
  RankMajorToBatchMajor(recv.data(), t, B, Tl, cfg_.C, full);
  return absl::OkStatus();
}

absl::Status TpcpBlock::ReduceScatterTp(const float* full, int64_t B, int64_t Tc,
                                        float* local) const {
  const int t = tp_->size();
  const int64_t Tl = Tc / t;
  std::vector<float> send(static_cast<size_t>(B * Tc * cfg_.C));
  BatchMajorToRankMajor(full, t, B, Tl, cfg_.C, send.data());
  return tp_->ReduceScatter(send.data(), local, B * Tl * cfg_.C);
}

absl::Status TpcpBlock::Forward(const TransformerOps& ops, const BlockWeights& w,
                                const float* x_local, int64_t B, int64_t T, float* y_local,
                                TpcpCache* cache) const {
  absl::Status st = Check();
  if (!st.ok()) return st;
  const int t = tp_->size(), c = cp_->size();
  if (st = CheckTpspShard(cfg_, w, t); !st.ok()) return st;
  if (st = CheckTpcpSequence(B, T, t, c); !st.ok()) return st;
  if (x_local == nullptr || y_local == nullptr) {
    return absl::InvalidArgumentError("tpcp: null x or y");
  }
  TpcpCache scratch;
  TpcpCache& k = cache != nullptr ? *cache : scratch;
  const int64_t C = cfg_.C, Ct = C / t, Ft = cfg_.FF / t, Ht = cfg_.H / t;
  const int64_t Tc = T / c, nc = B * Tc, nl = nc / t;
  k.B = B;
  k.T = T;
  {
    absl::StatusOr<std::vector<int32_t>> q_pos = ZigzagPositions(T, c, cp_->rank());
    absl::StatusOr<std::vector<int32_t>> k_pos = ZigzagOrder(T, c);
    if (!q_pos.ok()) return q_pos.status();
    if (!k_pos.ok()) return k_pos.status();
    k.q_pos = std::move(*q_pos);
    k.k_pos = std::move(*k_pos);
  }
  k.x.assign(x_local, x_local + nl * C);
  k.rstd1.resize(nl);
  k.n1.resize(nc * C);
  k.q.resize(nc * Ct);
  k.kv.resize(B * T * 2 * Ct);
  k.att.resize(nc * Ct);
  k.lse.resize(B * Ht * Tc);
  k.h.resize(nl * C);
  k.rstd2.resize(nl);
  k.n2.resize(nc * C);
  k.g.resize(nc * Ft);
  k.u.resize(nc * Ft);
  k.m.resize(nc * Ft);
  std::vector<float> norm_local(nl * C), partial(nc * C);
  std::vector<float> kv_local(nc * 2 * Ct), kv_recv(B * T * 2 * Ct);

  // Attention: h = x + RS_tp(attn_own_heads(AG_tp(rmsnorm(x)), AG_cp(k|v))).
  ops.RmsNormForward(x_local, w.ln1.data(), nl, C, cfg_.eps, norm_local.data(), k.rstd1.data());
  if (st = Sync(ops, "ln1 forward"); !st.ok()) return st;
  if (st = GatherTp(norm_local.data(), B, Tc, k.n1.data()); !st.ok()) return st;
  Linear(ops, k.n1.data(), C, w.wk.data(), nc, Ct, C, kv_local.data(), 2 * Ct);
  Linear(ops, k.n1.data(), C, w.wv.data(), nc, Ct, C, kv_local.data() + Ct, 2 * Ct);
  if (st = Sync(ops, "k/v projection"); !st.ok()) return st;
  std::shared_ptr<Work> kv_gather = cp_->IAllGather(kv_local.data(), kv_recv.data(), nc * 2 * Ct);
  Linear(ops, k.n1.data(), C, w.wq.data(), nc, Ct, C, k.q.data(), Ct);  // overlapped
  if (st = kv_gather->Wait(); !st.ok()) return st;
  // [c, B, Tc, 2Ct] -> [B, T, 2Ct]: the keys of row b in zigzag order (k_pos).
  RankMajorToBatchMajor(kv_recv.data(), c, B, Tc, 2 * Ct, k.kv.data());
  AttentionShape s;
  s.batch = B;
  s.tq = Tc;
  s.tk = T;
  s.heads = Ht;
  s.head_dim = C / cfg_.H;
  s.q_ld = Ct;
  s.k_ld = s.v_ld = 2 * Ct;
  s.out_ld = Ct;
  ops.AttentionForward(s, k.q.data(), k.kv.data(), k.kv.data() + Ct, k.q_pos.data(), k.k_pos.data(),
                       k.att.data(), k.lse.data());
  Linear(ops, k.att.data(), Ct, w.wo.data(), nc, C, Ct, partial.data(), C);
  if (st = Sync(ops, "attention forward"); !st.ok()) return st;
  if (st = ReduceScatterTp(partial.data(), B, Tc, k.h.data()); !st.ok()) return st;
  ops.Add(x_local, k.h.data(), nl * C, k.h.data());

  // MLP: y = h + RS_tp(mlp_own_ff(AG_tp(rmsnorm(h)))).
  ops.RmsNormForward(k.h.data(), w.ln2.data(), nl, C, cfg_.eps, norm_local.data(), k.rstd2.data());
  if (st = Sync(ops, "ln2 forward"); !st.ok()) return st;
  if (st = GatherTp(norm_local.data(), B, Tc, k.n2.data()); !st.ok()) return st;
  Linear(ops, k.n2.data(), C, w.wg.data(), nc, Ft, C, k.g.data(), Ft);
  Linear(ops, k.n2.data(), C, w.wu.data(), nc, Ft, C, k.u.data(), Ft);
  ops.SwiGluForward(k.g.data(), k.u.data(), nc * Ft, k.m.data());
  Linear(ops, k.m.data(), Ft, w.wd.data(), nc, C, Ft, partial.data(), C);
  if (st = Sync(ops, "mlp forward"); !st.ok()) return st;
  if (st = ReduceScatterTp(partial.data(), B, Tc, y_local); !st.ok()) return st;
  ops.Add(k.h.data(), y_local, nl * C, y_local);
  return Sync(ops, "block forward");
}

absl::Status TpcpBlock::Backward(const TransformerOps& ops, const BlockWeights& w,
                                 const TpcpCache& k, const float* dy_local, float* dx_local,
                                 BlockGrads* grads) const {
  absl::Status st = Check();
  if (!st.ok()) return st;
  const int t = tp_->size(), c = cp_->size();
  if (st = CheckTpspShard(cfg_, w, t); !st.ok()) return st;
  if (st = CheckTpcpSequence(k.B, k.T, t, c); !st.ok()) return st;
  if (dy_local == nullptr || dx_local == nullptr || grads == nullptr) {
    return absl::InvalidArgumentError("tpcp: null dy, dx or grads");
  }
  const int64_t B = k.B, T = k.T, C = cfg_.C, Ct = C / t, Ft = cfg_.FF / t, Ht = cfg_.H / t;
  const int64_t Tc = T / c, nc = B * Tc, nl = nc / t;
  if (static_cast<int64_t>(k.x.size()) != nl * C || static_cast<int64_t>(k.m.size()) != nc * Ft ||
      static_cast<int64_t>(k.kv.size()) != B * T * 2 * Ct ||
      static_cast<int64_t>(k.q.size()) != nc * Ct ||
      static_cast<int64_t>(k.lse.size()) != B * Ht * Tc ||
      static_cast<int64_t>(k.q_pos.size()) != Tc || static_cast<int64_t>(k.k_pos.size()) != T) {
    return absl::InvalidArgumentError("tpcp: cache does not match its B, T and the grid");
  }
  if (st = SizeGrads(cfg_, t, grads); !st.ok()) return st;

  // This call's shard gradients, summed over the CP axis at the end before the += into grads.
  BlockGrads d;
  if (st = SizeGrads(cfg_, t, &d); !st.ok()) return st;
  std::vector<float> full(nc * C), dfull(nc * C);  // TP-gathered gradient; partial input grad
  std::vector<float> dm(nc * Ft), dg(nc * Ft), du(nc * Ft), datt(nc * Ct), dq(nc * Ct);
  std::vector<float> dkv_all(B * T * 2 * Ct), dkv_send(B * T * 2 * Ct), dkv(nc * 2 * Ct);
  std::vector<float> dh(nl * C), dnorm(nl * C);

  // MLP: y = h + m Wd^T (summed over the TP group by the reduce-scatter).
  if (st = GatherTp(dy_local, B, Tc, full.data()); !st.ok()) return st;
  LinearWeightGrad(ops, full.data(), C, k.m.data(), nc, C, Ft, d.wd.data());
  LinearInputGrad(ops, full.data(), C, w.wd.data(), nc, C, Ft, dm.data(), 0.0f);
  ops.SwiGluBackward(k.g.data(), k.u.data(), dm.data(), nc * Ft, dg.data(), du.data());
  LinearWeightGrad(ops, dg.data(), Ft, k.n2.data(), nc, Ft, C, d.wg.data());
  LinearWeightGrad(ops, du.data(), Ft, k.n2.data(), nc, Ft, C, d.wu.data());
  LinearInputGrad(ops, dg.data(), Ft, w.wg.data(), nc, Ft, C, dfull.data(), 0.0f);
  LinearInputGrad(ops, du.data(), Ft, w.wu.data(), nc, Ft, C, dfull.data(), 1.0f);
  if (st = Sync(ops, "mlp backward"); !st.ok()) return st;
  if (st = ReduceScatterTp(dfull.data(), B, Tc, dnorm.data()); !st.ok()) return st;
  ops.RmsNormBackward(k.h.data(), w.ln2.data(), k.rstd2.data(), dnorm.data(), nl, C, dh.data(),
                      d.ln2.data());
  ops.Add(dh.data(), dy_local, nl * C, dh.data());  // The residual's identity branch.
  if (st = Sync(ops, "ln2 backward"); !st.ok()) return st;

  // Attention: h = x + att Wo^T (summed over the TP group).
  if (st = GatherTp(dh.data(), B, Tc, full.data()); !st.ok()) return st;
  LinearWeightGrad(ops, full.data(), C, k.att.data(), nc, C, Ct, d.wo.data());
  LinearInputGrad(ops, full.data(), C, w.wo.data(), nc, C, Ct, datt.data(), 0.0f);
  AttentionShape s;
  s.batch = B;
  s.tq = Tc;
  s.tk = T;
  s.heads = Ht;
  s.head_dim = C / cfg_.H;
  s.q_ld = Ct;
  s.k_ld = s.v_ld = 2 * Ct;
  s.out_ld = Ct;
  ops.AttentionBackward(s, k.q.data(), k.kv.data(), k.kv.data() + Ct, k.q_pos.data(),
                        k.k_pos.data(), k.att.data(), k.lse.data(), datt.data(), dq.data(),
                        dkv_all.data(), dkv_all.data() + Ct);
  if (st = Sync(ops, "attention backward"); !st.ok()) return st;
  // dK|dV of all T keys [B, T, 2Ct] -> [c, B, Tc, 2Ct]; block j goes to (is summed on) its
  // owner, CP rank j.
  BatchMajorToRankMajor(dkv_all.data(), c, B, Tc, 2 * Ct, dkv_send.data());
  std::shared_ptr<Work> dkv_scatter = cp_->IReduceScatter(dkv_send.data(), dkv.data(), nc * 2 * Ct);
  // Overlapped with the reduce-scatter: the q side.
  LinearWeightGrad(ops, dq.data(), Ct, k.n1.data(), nc, Ct, C, d.wq.data());
  LinearInputGrad(ops, dq.data(), Ct, w.wq.data(), nc, Ct, C, dfull.data(), 0.0f);
  const absl::Status scattered = dkv_scatter->Wait();  // before any return: buffers in flight
  if (st = Sync(ops, "q backward"); !st.ok()) return st;
  if (!scattered.ok()) return scattered;
  LinearWeightGrad(ops, dkv.data(), 2 * Ct, k.n1.data(), nc, Ct, C, d.wk.data());
  LinearWeightGrad(ops, dkv.data() + Ct, 2 * Ct, k.n1.data(), nc, Ct, C, d.wv.data());
  LinearInputGrad(ops, dkv.data(), 2 * Ct, w.wk.data(), nc, Ct, C, dfull.data(), 1.0f);
  LinearInputGrad(ops, dkv.data() + Ct, 2 * Ct, w.wv.data(), nc, Ct, C, dfull.data(), 1.0f);
  if (st = Sync(ops, "k/v backward"); !st.ok()) return st;
  if (st = ReduceScatterTp(dfull.data(), B, Tc, dnorm.data()); !st.ok()) return st;
  ops.RmsNormBackward(k.x.data(), w.ln1.data(), k.rstd1.data(), dnorm.data(), nl, C, dx_local,
                      d.ln1.data());
  ops.Add(dx_local, dh.data(), nl * C, dx_local);
  if (st = Sync(ops, "ln1 backward"); !st.ok()) return st;

  // ln1 | ln2: partial over the local tokens -> summed over the TP group (the CP shard).
  std::vector<float> dln(2 * C);
  std::memcpy(dln.data(), d.ln1.data(), sizeof(float) * C);
  std::memcpy(dln.data() + C, d.ln2.data(), sizeof(float) * C);
  if (st = tp_->AllReduce(dln.data(), 2 * C); !st.ok()) return st;
  std::memcpy(d.ln1.data(), dln.data(), sizeof(float) * C);
  std::memcpy(d.ln2.data(), dln.data() + C, sizeof(float) * C);
  // Every field (ln included) summed over the CP axis in one packed all-reduce.
  const std::vector<std::vector<float>*> fields = d.Tensors();
  size_t total = 0;
  for (const std::vector<float>* f : fields) total += f->size();
  std::vector<float> packed;
  packed.reserve(total);
  for (const std::vector<float>* f : fields) packed.insert(packed.end(), f->begin(), f->end());
  if (st = cp_->AllReduce(packed.data(), static_cast<int64_t>(total)); !st.ok()) return st;
  const std::vector<std::vector<float>*> out = grads->Tensors();
  size_t off = 0;
  for (std::vector<float>* f : out) {
    for (float& v : *f) v += packed[off++];
  }
  return absl::OkStatus();
}

}  // namespace parallel
}  // namespace stallfree
