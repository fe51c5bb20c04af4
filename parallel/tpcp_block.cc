#include "parallel/tpcp_block.h"

#include <array>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "parallel/block_cache.h"
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
// width] (batch-major, as the kernels read it): one strided copy per group.
void RankMajorToBatchMajor(const TransformerOps& ops, const float* src, int64_t groups, int64_t B,
                           int64_t rows, int64_t width, float* dst) {
  const int64_t chunk = rows * width;
  for (int64_t g = 0; g < groups; ++g) {
    ops.Copy2D(dst + g * chunk, groups * chunk, src + g * B * chunk, chunk, B, chunk);
  }
}
void BatchMajorToRankMajor(const TransformerOps& ops, const float* src, int64_t groups, int64_t B,
                           int64_t rows, int64_t width, float* dst) {
  const int64_t chunk = rows * width;
  for (int64_t g = 0; g < groups; ++g) {
    ops.Copy2D(dst + g * B * chunk, chunk, src + g * chunk, groups * chunk, B, chunk);
  }
}

// The cache's float tensors in TpcpCacheBuffers' order, with their sizes for (t, c, B, T).
constexpr size_t kCacheTensors = 13;

layer::CacheSizes<kCacheTensors> CacheSizes(const BlockConfig& cfg, int t, int c, int64_t B,
                                            int64_t T) {
  const int64_t C = cfg.C, Ct = C / t, Ft = cfg.FF / t, Tc = T / c, nc = B * Tc, nl = nc / t;
  //       x       rstd1 n1      q        kv              att      lse
  return {nl * C, nl, nc * C, nc * Ct, B * T * 2 * Ct, nc * Ct, B * (cfg.H / t) * Tc,
          //  h     rstd2 n2      g        u        m
          nl * C, nl, nc * C, nc * Ft, nc * Ft, nc * Ft};
}

// Cache is TpcpCache or const TpcpCache; Buffers likewise.
template <class Cache>
std::array<decltype(&std::declval<Cache*>()->x), kCacheTensors> VectorsOf(Cache* k) {
  return {&k->x,   &k->rstd1, &k->n1, &k->q, &k->kv, &k->att, &k->lse,
          &k->h,   &k->rstd2, &k->n2, &k->g, &k->u,  &k->m};
}
template <class Buffers>
std::array<decltype(&std::declval<Buffers*>()->x), kCacheTensors> BuffersOf(Buffers* b) {
  return {&b->x,   &b->rstd1, &b->n1, &b->q, &b->kv, &b->att, &b->lse,
          &b->h,   &b->rstd2, &b->n2, &b->g, &b->u,  &b->m};
}

// The cache's tensors, wherever they live.
struct CacheRefs {
  const int32_t* q_pos = nullptr;
  const int32_t* k_pos = nullptr;
  float *x, *rstd1, *n1, *q, *kv, *att, *lse, *h, *rstd2, *n2, *g, *u, *m;
};

// False if the cache's tensors do not have `sizes` or (in backend memory) do not belong to ops.
bool RefsOf(const TpcpCache& k, const layer::CacheSizes<kCacheTensors>& sizes,
            const TransformerOps& ops, CacheRefs* r) {
  std::array<float*, kCacheTensors> p;
  const TpcpCacheBuffers* b = k.buffers.get();
  if (b != nullptr) {
    const auto bufs = BuffersOf(b);
    if (b->x.ops() != &ops || !layer::CacheData(VectorsOf(&k), &bufs, sizes, &p)) return false;
    r->q_pos = reinterpret_cast<const int32_t*>(b->q_pos.data());
    r->k_pos = reinterpret_cast<const int32_t*>(b->k_pos.data());
  } else {
    if (!layer::CacheData<kCacheTensors>(VectorsOf(&k), nullptr, sizes, &p)) return false;
    r->q_pos = k.q_pos.data();
    r->k_pos = k.k_pos.data();
  }
  float** named[kCacheTensors] = {&r->x, &r->rstd1, &r->n1, &r->q, &r->kv, &r->att, &r->lse,
                                  &r->h, &r->rstd2, &r->n2, &r->g, &r->u,  &r->m};
  for (size_t i = 0; i < kCacheTensors; ++i) *named[i] = p[i];
  return true;
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

absl::Status TpcpBlock::GatherTp(const TransformerOps& ops, const float* local, int64_t B,
                                 int64_t Tc, float* full) const {
  const int t = tp_->size();
  const int64_t Tl = Tc / t;
  kernels::OpsBuffer recv(&ops, B * Tc * cfg_.C);
  RETURN_IF_ERROR(tp_->AllGather(local, recv.data(), B * Tl * cfg_.C));
  RankMajorToBatchMajor(ops, recv.data(), t, B, Tl, cfg_.C, full);
  return absl::OkStatus();
}

absl::Status TpcpBlock::ReduceScatterTp(const TransformerOps& ops, const float* full, int64_t B,
                                        int64_t Tc, float* local) const {
  const int t = tp_->size();
  const int64_t Tl = Tc / t;
  kernels::OpsBuffer send(&ops, B * Tc * cfg_.C);
  BatchMajorToRankMajor(ops, full, t, B, Tl, cfg_.C, send.data());
  return tp_->ReduceScatter(send.data(), local, B * Tl * cfg_.C);
}

absl::Status TpcpBlock::Forward(const TransformerOps& ops, const BlockWeights& w,
                                const float* x_local, int64_t B, int64_t T, float* y_local,
                                TpcpCache* cache) const {
  RETURN_IF_ERROR(Check());
  RETURN_IF_ERROR(CheckTpspShard(cfg_, w, tp_->size()));
  return ForwardImpl(ops, TpspViewOf(w), x_local, B, T, y_local, cache, /*backend_cache=*/false);
}

absl::Status TpcpBlock::Forward(const TransformerOps& ops, const TpspShardView& w,
                                const float* x_local, int64_t B, int64_t T, float* y_local,
                                TpcpCache* cache) const {
  if (w.AnyNull()) return absl::InvalidArgumentError("tpcp: null weight pointer");
  return ForwardImpl(ops, w, x_local, B, T, y_local, cache, /*backend_cache=*/true);
}

absl::Status TpcpBlock::Backward(const TransformerOps& ops, const BlockWeights& w,
                                 const TpcpCache& k, const float* dy_local, float* dx_local,
                                 BlockGrads* grads) const {
  RETURN_IF_ERROR(Check());
  const int t = tp_->size();
  RETURN_IF_ERROR(CheckTpspShard(cfg_, w, t));
  if (grads == nullptr) return absl::InvalidArgumentError("tpcp: null grads");
  RETURN_IF_ERROR(SizeGrads(cfg_, t, grads));
  return BackwardImpl(ops, TpspViewOf(w), k, dy_local, dx_local, TpspViewOf(grads));
}

absl::Status TpcpBlock::Backward(const TransformerOps& ops, const TpspShardView& w,
                                 const TpcpCache& k, const float* dy_local, float* dx_local,
                                 const TpspGradsView& grads) const {
  if (w.AnyNull()) return absl::InvalidArgumentError("tpcp: null weight pointer");
  if (grads.AnyNull()) return absl::InvalidArgumentError("tpcp: null gradient pointer");
  return BackwardImpl(ops, w, k, dy_local, dx_local, grads);
}

absl::Status TpcpBlock::ForwardImpl(const TransformerOps& ops, const TpspShardView& w,
                                    const float* x_local, int64_t B, int64_t T, float* y_local,
                                    TpcpCache* cache, bool backend_cache) const {
  RETURN_IF_ERROR(Check());
  const int t = tp_->size(), c = cp_->size();
  RETURN_IF_ERROR(CheckTpcpSequence(B, T, t, c));
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
  // The previous step's buffers are released first (peak memory).
  k.buffers = nullptr;
  const layer::CacheSizes<kCacheTensors> sizes = CacheSizes(cfg_, t, c, B, T);
  if (backend_cache) {
    auto b = std::make_shared<TpcpCacheBuffers>();
    layer::SizeCache(ops, sizes, true, VectorsOf(&k), BuffersOf(b.get()));
    b->q_pos = layer::UploadPositions(ops, k.q_pos);
    b->k_pos = layer::UploadPositions(ops, k.k_pos);
    k.buffers = std::move(b);
  } else {
    TpcpCacheBuffers unused;
    layer::SizeCache(ops, sizes, false, VectorsOf(&k), BuffersOf(&unused));
  }
  CacheRefs r;
  RefsOf(k, sizes, ops, &r);  // sized just now
  ops.CopyFloats(r.x, x_local, nl * C);
  kernels::OpsBuffer norm_local(&ops, nl * C), partial(&ops, nc * C);
  kernels::OpsBuffer kv_local(&ops, nc * 2 * Ct), kv_recv(&ops, B * T * 2 * Ct);

  // Attention: h = x + RS_tp(attn_own_heads(AG_tp(rmsnorm(x)), AG_cp(k|v))).
  ops.RmsNormForward(x_local, w.ln1, nl, C, cfg_.eps, norm_local.data(), r.rstd1);
  RETURN_IF_ERROR(GatherTp(ops, norm_local.data(), B, Tc, r.n1));
  Linear(ops, r.n1, C, w.wk, nc, Ct, C, kv_local.data(), 2 * Ct);
  Linear(ops, r.n1, C, w.wv, nc, Ct, C, kv_local.data() + Ct, 2 * Ct);
  std::shared_ptr<Work> kv_gather = cp_->IAllGather(kv_local.data(), kv_recv.data(), nc * 2 * Ct);
  Linear(ops, r.n1, C, w.wq, nc, Ct, C, r.q, Ct);  // overlapped
  RETURN_IF_ERROR(kv_gather->Wait());
  // [c, B, Tc, 2Ct] -> [B, T, 2Ct]: the keys of row b in zigzag order (k_pos).
  RankMajorToBatchMajor(ops, kv_recv.data(), c, B, Tc, 2 * Ct, r.kv);
  AttentionShape s;
  s.batch = B;
  s.tq = Tc;
  s.tk = T;
  s.heads = Ht;
  s.head_dim = C / cfg_.H;
  s.q_ld = Ct;
  s.k_ld = s.v_ld = 2 * Ct;
  s.out_ld = Ct;
  ops.AttentionForward(s, r.q, r.kv, r.kv + Ct, r.q_pos, r.k_pos, r.att, r.lse);
  Linear(ops, r.att, Ct, w.wo, nc, C, Ct, partial.data(), C);
  RETURN_IF_ERROR(ReduceScatterTp(ops, partial.data(), B, Tc, r.h));
  ops.Add(x_local, r.h, nl * C, r.h);

  // MLP: y = h + RS_tp(mlp_own_ff(AG_tp(rmsnorm(h)))).
  ops.RmsNormForward(r.h, w.ln2, nl, C, cfg_.eps, norm_local.data(), r.rstd2);
  RETURN_IF_ERROR(GatherTp(ops, norm_local.data(), B, Tc, r.n2));
  Linear(ops, r.n2, C, w.wg, nc, Ft, C, r.g, Ft);
  Linear(ops, r.n2, C, w.wu, nc, Ft, C, r.u, Ft);
  ops.SwiGluForward(r.g, r.u, nc * Ft, r.m);
  Linear(ops, r.m, Ft, w.wd, nc, C, Ft, partial.data(), C);
  RETURN_IF_ERROR(ReduceScatterTp(ops, partial.data(), B, Tc, y_local));
  ops.Add(r.h, y_local, nl * C, y_local);
  return Sync(ops, "block forward");
}

absl::Status TpcpBlock::BackwardImpl(const TransformerOps& ops, const TpspShardView& w,
                                     const TpcpCache& k, const float* dy_local, float* dx_local,
                                     const TpspGradsView& grads) const {
  RETURN_IF_ERROR(Check());
  const int t = tp_->size(), c = cp_->size();
  RETURN_IF_ERROR(CheckTpcpSequence(k.B, k.T, t, c));
  if (dy_local == nullptr || dx_local == nullptr) {
    return absl::InvalidArgumentError("tpcp: null dy or dx");
  }
  const int64_t B = k.B, T = k.T, C = cfg_.C, Ct = C / t, Ft = cfg_.FF / t, Ht = cfg_.H / t;
  const int64_t Tc = T / c, nc = B * Tc, nl = nc / t;
  CacheRefs r;
  if (static_cast<int64_t>(k.q_pos.size()) != Tc || static_cast<int64_t>(k.k_pos.size()) != T ||
      !RefsOf(k, CacheSizes(cfg_, t, c, B, T), ops, &r)) {
    return absl::InvalidArgumentError(
        "tpcp: cache does not match its B, T, the grid or the backend");
  }

  // This call's shard gradients in BlockWeights::Tensors() order, packed as the CP all-reduce
  // sends them, summed over the CP axis at the end before the += into grads.
  const int64_t cc = C * Ct, fc = C * Ft;
  const int64_t sizes[9] = {C, cc, cc, cc, cc, C, fc, fc, fc};
  int64_t offsets[9], total = 0;
  for (int i = 0; i < 9; ++i) {
    offsets[i] = total;
    total += sizes[i];
  }
  kernels::OpsBuffer packed(&ops, total);
  float* d[9];
  for (int i = 0; i < 9; ++i) d[i] = packed.data() + offsets[i];
  float *d_wq = d[1], *d_wk = d[2], *d_wv = d[3], *d_wo = d[4], *d_wg = d[6], *d_wu = d[7],
        *d_wd = d[8];
  // The TP-gathered gradient and the partial input gradient [nc, C].
  kernels::OpsBuffer full(&ops, nc * C), dfull(&ops, nc * C);
  kernels::OpsBuffer dm(&ops, nc * Ft), dg(&ops, nc * Ft), du(&ops, nc * Ft), datt(&ops, nc * Ct),
      dq(&ops, nc * Ct);
  kernels::OpsBuffer dkv_all(&ops, B * T * 2 * Ct), dkv_send(&ops, B * T * 2 * Ct),
      dkv(&ops, nc * 2 * Ct);
  kernels::OpsBuffer dh(&ops, nl * C), dnorm(&ops, nl * C);
  kernels::OpsBuffer dln(&ops, 2 * C);  // ln1 | ln2 partial gradients over the local tokens

  // MLP: y = h + m Wd^T (summed over the TP group by the reduce-scatter).
  RETURN_IF_ERROR(GatherTp(ops, dy_local, B, Tc, full.data()));
  LinearWeightGrad(ops, full.data(), C, r.m, nc, C, Ft, d_wd);
  LinearInputGrad(ops, full.data(), C, w.wd, nc, C, Ft, dm.data(), 0.0f);
  ops.SwiGluBackward(r.g, r.u, dm.data(), nc * Ft, dg.data(), du.data());
  LinearWeightGrad(ops, dg.data(), Ft, r.n2, nc, Ft, C, d_wg);
  LinearWeightGrad(ops, du.data(), Ft, r.n2, nc, Ft, C, d_wu);
  LinearInputGrad(ops, dg.data(), Ft, w.wg, nc, Ft, C, dfull.data(), 0.0f);
  LinearInputGrad(ops, du.data(), Ft, w.wu, nc, Ft, C, dfull.data(), 1.0f);
  RETURN_IF_ERROR(ReduceScatterTp(ops, dfull.data(), B, Tc, dnorm.data()));
  ops.RmsNormBackward(r.h, w.ln2, r.rstd2, dnorm.data(), nl, C, dh.data(), dln.data() + C);
  ops.Add(dh.data(), dy_local, nl * C, dh.data());  // The residual's identity branch.

  // Attention: h = x + att Wo^T (summed over the TP group).
  RETURN_IF_ERROR(GatherTp(ops, dh.data(), B, Tc, full.data()));
  LinearWeightGrad(ops, full.data(), C, r.att, nc, C, Ct, d_wo);
  LinearInputGrad(ops, full.data(), C, w.wo, nc, C, Ct, datt.data(), 0.0f);
  AttentionShape s;
  s.batch = B;
  s.tq = Tc;
  s.tk = T;
  s.heads = Ht;
  s.head_dim = C / cfg_.H;
  s.q_ld = Ct;
  s.k_ld = s.v_ld = 2 * Ct;
  s.out_ld = Ct;
  ops.AttentionBackward(s, r.q, r.kv, r.kv + Ct, r.q_pos, r.k_pos, r.att, r.lse, datt.data(),
                        dq.data(), dkv_all.data(), dkv_all.data() + Ct);
  // dK|dV of all T keys [B, T, 2Ct] -> [c, B, Tc, 2Ct]; block j goes to (is summed on) its
  // owner, CP rank j.
  BatchMajorToRankMajor(ops, dkv_all.data(), c, B, Tc, 2 * Ct, dkv_send.data());
  std::shared_ptr<Work> dkv_scatter = cp_->IReduceScatter(dkv_send.data(), dkv.data(), nc * 2 * Ct);
  // Overlapped with the reduce-scatter: the q side.
  LinearWeightGrad(ops, dq.data(), Ct, r.n1, nc, Ct, C, d_wq);
  LinearInputGrad(ops, dq.data(), Ct, w.wq, nc, Ct, C, dfull.data(), 0.0f);
  RETURN_IF_ERROR(dkv_scatter->Wait());
  LinearWeightGrad(ops, dkv.data(), 2 * Ct, r.n1, nc, Ct, C, d_wk);
  LinearWeightGrad(ops, dkv.data() + Ct, 2 * Ct, r.n1, nc, Ct, C, d_wv);
  LinearInputGrad(ops, dkv.data(), 2 * Ct, w.wk, nc, Ct, C, dfull.data(), 1.0f);
  LinearInputGrad(ops, dkv.data() + Ct, 2 * Ct, w.wv, nc, Ct, C, dfull.data(), 1.0f);
  RETURN_IF_ERROR(ReduceScatterTp(ops, dfull.data(), B, Tc, dnorm.data()));
  ops.RmsNormBackward(r.x, w.ln1, r.rstd1, dnorm.data(), nl, C, dx_local, dln.data());
  ops.Add(dx_local, dh.data(), nl * C, dx_local);

  // ln1 | ln2: partial over the local tokens -> summed over the TP group (the CP shard).
  RETURN_IF_ERROR(tp_->AllReduce(dln.data(), 2 * C));
  ops.CopyFloats(d[0], dln.data(), C);
  ops.CopyFloats(d[5], dln.data() + C, C);
  // Every field (ln included) summed over the CP axis in one packed all-reduce.
  RETURN_IF_ERROR(cp_->AllReduce(packed.data(), total));
  float* out[9] = {grads.ln1, grads.wq, grads.wk, grads.wv, grads.wo,
                   grads.ln2, grads.wg, grads.wu, grads.wd};
  for (int i = 0; i < 9; ++i) ops.Add(out[i], d[i], sizes[i], out[i]);
  return Sync(ops, "block backward");
}

}  // namespace parallel
}  // namespace stallfree
