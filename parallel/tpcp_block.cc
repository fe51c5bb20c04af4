#include "parallel/tpcp_block.h"

#include <array>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "parallel/block_cache.h"
#include "parallel/linear.h"
#include "parallel/tp_sublayers.h"
#include "parallel/tpsp_block.h"
#include "parallel/zigzag.h"

namespace stallfree {
namespace parallel {
namespace {

using kernels::AttentionShape;
using kernels::Trans;
using kernels::TransformerOps;

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

// Buffers is TpcpCacheBuffers or const TpcpCacheBuffers.
template <class Buffers>
std::array<decltype(&std::declval<Buffers*>()->x), kCacheTensors> TensorsOf(Buffers* b) {
  return {&b->x,   &b->rstd1, &b->n1, &b->q, &b->kv, &b->att, &b->lse,
          &b->h,   &b->rstd2, &b->n2, &b->g, &b->u,  &b->m};
}

// The cache's tensors.
struct CacheRefs {
  const int32_t* q_pos = nullptr;
  const int32_t* k_pos = nullptr;
  float *x, *rstd1, *n1, *q, *kv, *att, *lse, *h, *rstd2, *n2, *g, *u, *m;

  tp::MlpCache mlp() const { return {rstd2, n2, g, u, m}; }
};

// False if the cache is empty, its tensors do not have the sizes for (t, c, k.B, k.T) or they
// are not ops' memory.
bool RefsOf(const TpcpCache& k, const BlockConfig& cfg, int t, int c, const TransformerOps& ops,
            CacheRefs* r) {
  const TpcpCacheBuffers* b = k.buffers.get();
  std::array<float*, kCacheTensors> p;
  if (b == nullptr || b->q_pos.size() != k.T / c || b->k_pos.size() != k.T ||
      !layer::CacheData(ops, TensorsOf(b), CacheSizes(cfg, t, c, k.B, k.T), &p)) {
    return false;
  }
  r->q_pos = reinterpret_cast<const int32_t*>(b->q_pos.data());
  r->k_pos = reinterpret_cast<const int32_t*>(b->k_pos.data());
  float** named[kCacheTensors] = {&r->x, &r->rstd1, &r->n1, &r->q, &r->kv, &r->att, &r->lse,
                                  &r->h, &r->rstd2, &r->n2, &r->g, &r->u,  &r->m};
  for (size_t i = 0; i < kCacheTensors; ++i) *named[i] = p[i];
  return true;
}

// The local queries' attention against every token's keys: tq = T/c in zigzag order, tk = T.
AttentionShape CpShape(const BlockConfig& cfg, int t, int c, int64_t B, int64_t T) {
  const int64_t Ct = cfg.C / t;
  AttentionShape s;
  s.batch = B;
  s.tq = T / c;
  s.tk = T;
  s.heads = cfg.H / t;
  s.head_dim = cfg.C / cfg.H;
  s.q_ld = Ct;
  s.k_ld = s.v_ld = 2 * Ct;
  s.out_ld = Ct;
  return s;
}

absl::Status Sync(const TransformerOps& ops, const char* what) {
  return layer::Sync(ops, "tpcp", what);
}

using layer::Linear;
using layer::LinearInputGrad;
using layer::LinearWeightGrad;

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
  ASSIGN_OR_RETURN(g.tp, NewGlooCommunicator(tp));
  CommOptions cp = world;
  cp.rank = g.cp_index;
  cp.size = g.cp_degree;
  cp.group = absl::StrCat(world.group, ".cp", g.tp_index);
  ASSIGN_OR_RETURN(g.cp, NewGlooCommunicator(cp));
  return g;
}

absl::Status ValidateTpcpConfig(const BlockConfig& cfg, int t, int c, int tp_index, int cp_index) {
  RETURN_IF_ERROR(ValidateTpspConfig(cfg, t, tp_index));
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
  RETURN_IF_ERROR(CheckTpcpSequence(1, T, t, c));
  if (tp_index < 0 || tp_index >= t) {
    return absl::InvalidArgumentError(absl::StrCat("tpcp: bad TP index ", tp_index));
  }
  ASSIGN_OR_RETURN(const std::vector<int32_t> cp_pos, ZigzagPositions(T, c, cp_index));
  const int64_t Tl = T / c / t;
  return std::vector<int32_t>(cp_pos.begin() + tp_index * Tl, cp_pos.begin() + (tp_index + 1) * Tl);
}

absl::Status TpcpBlock::Check() const {
  if (tp_ == nullptr || cp_ == nullptr) {
    return absl::InvalidArgumentError("tpcp: null communicator");
  }
  return ValidateTpcpConfig(cfg_, tp_->size(), cp_->size(), tp_->rank(), cp_->rank());
}

int64_t TpcpCache::bytes() const {
  if (buffers == nullptr) return 0;
  int64_t floats = buffers->q_pos.size() + buffers->k_pos.size();
  for (const kernels::OpsBuffer* b : TensorsOf(buffers.get())) floats += b->size();
  return floats * static_cast<int64_t>(sizeof(float));
}

absl::Status TpcpBlock::Forward(const TransformerOps& ops, const TpspShardView& w,
                                const float* x_local, int64_t B, int64_t T, float* y_local,
                                TpcpCache* cache) const {
  RETURN_IF_ERROR(Check());
  const int t = tp_->size(), c = cp_->size();
  RETURN_IF_ERROR(CheckTpcpSequence(B, T, t, c));
  RETURN_IF_ERROR(CheckForwardPointers("tpcp", w, x_local, y_local));
  TpcpCache scratch;
  TpcpCache& k = cache != nullptr ? *cache : scratch;
  const int64_t C = cfg_.C, Ct = C / t;
  k.B = B;
  k.T = T;
  // The previous step's buffers are released first, and the host positions once uploaded (peak
  // memory).
  k.buffers = nullptr;
  auto b = std::make_shared<TpcpCacheBuffers>();
  {
    ASSIGN_OR_RETURN(const std::vector<int32_t> q_pos, ZigzagPositions(T, c, cp_->rank()));
    ASSIGN_OR_RETURN(const std::vector<int32_t> k_pos, ZigzagOrder(T, c));
    b->q_pos = layer::UploadPositions(ops, q_pos);
    b->k_pos = layer::UploadPositions(ops, k_pos);
    RETURN_IF_ERROR(Sync(ops, "positions upload"));
  }
  layer::AllocateCache(ops, CacheSizes(cfg_, t, c, B, T), TensorsOf(b.get()));
  k.buffers = std::move(b);
  CacheRefs r;
  RefsOf(k, cfg_, t, c, ops, &r);  // sized just now
  const tp::SequenceParallel sp(ops, cfg_, tp_, B, T / c / t);
  const int64_t nc = sp.tokens(), nl = sp.local_tokens();
  ops.CopyFloats(r.x, x_local, nl * C);
  kernels::OpsBuffer norm_local(&ops, nl * C), partial(&ops, nc * C);
  kernels::OpsBuffer kv_local(&ops, nc * 2 * Ct), kv_recv(&ops, B * T * 2 * Ct);

  // Attention: h = x + RS_tp(attn_own_heads(AG_tp(rmsnorm(x)), AG_cp(k|v))).
  RETURN_IF_ERROR(sp.NormGather(x_local, w.ln1, r.rstd1, norm_local.data(), r.n1));
  Linear(ops, r.n1, C, w.wk, nc, Ct, C, kv_local.data(), 2 * Ct);
  Linear(ops, r.n1, C, w.wv, nc, Ct, C, kv_local.data() + Ct, 2 * Ct);
  std::shared_ptr<Work> kv_gather = cp_->IAllGather(kv_local.data(), kv_recv.data(), nc * 2 * Ct);
  Linear(ops, r.n1, C, w.wq, nc, Ct, C, r.q, Ct);  // overlapped
  RETURN_IF_ERROR(kv_gather->Wait());
  // [c, B, Tc, 2Ct] -> [B, T, 2Ct]: the keys of row b in zigzag order (k_pos).
  layer::RankMajorToBatchMajor(ops, kv_recv.data(), c, B, T / c, 2 * Ct, r.kv);
  ops.AttentionForward(CpShape(cfg_, t, c, B, T), r.q, r.kv, r.kv + Ct, r.q_pos, r.k_pos, r.att,
                       r.lse);
  RETURN_IF_ERROR(sp.RowParallelResidual(r.att, Ct, w.wo, x_local, partial.data(), r.h));

  // MLP: y = h + RS_tp(mlp_own_ff(AG_tp(rmsnorm(h)))).
  RETURN_IF_ERROR(sp.Mlp({w.ln2, w.wg, w.wu, w.wd}, r.h, r.mlp(), norm_local.data(),
                         partial.data(), y_local));
  return Sync(ops, "block forward");
}

absl::Status TpcpBlock::Backward(const TransformerOps& ops, const TpspShardView& w,
                                 const TpcpCache& k, const float* dy_local, float* dx_local,
                                 const TpspGradsView& grads) const {
  RETURN_IF_ERROR(Check());
  const int t = tp_->size(), c = cp_->size();
  RETURN_IF_ERROR(CheckTpcpSequence(k.B, k.T, t, c));
  RETURN_IF_ERROR(CheckBackwardPointers("tpcp", w, grads, dy_local, dx_local));
  CacheRefs r;
  if (!RefsOf(k, cfg_, t, c, ops, &r)) {
    return absl::InvalidArgumentError(
        "tpcp: cache does not match its B, T, the grid or the backend");
  }
  const tp::SequenceParallel sp(ops, cfg_, tp_, k.B, k.T / c / t);
  const int64_t B = k.B, T = k.T, C = cfg_.C, Ct = C / t, Ft = cfg_.FF / t;
  const int64_t nc = sp.tokens(), nl = sp.local_tokens();

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
  float *d_wq = d[1], *d_wk = d[2], *d_wv = d[3], *d_wo = d[4];
  // The TP-gathered gradient and the partial input gradient [nc, C].
  kernels::OpsBuffer full(&ops, nc * C), dfull(&ops, nc * C);
  kernels::OpsBuffer dm(&ops, nc * Ft), dg(&ops, nc * Ft), du(&ops, nc * Ft), datt(&ops, nc * Ct),
      dq(&ops, nc * Ct);
  kernels::OpsBuffer dkv_all(&ops, B * T * 2 * Ct), dkv_send(&ops, B * T * 2 * Ct),
      dkv(&ops, nc * 2 * Ct);
  kernels::OpsBuffer dh(&ops, nl * C), dnorm(&ops, nl * C);
  kernels::OpsBuffer dln(&ops, 2 * C);  // ln1 | ln2 partial gradients over the local tokens
  const tp::Scratch scratch{full.data(), dfull.data(), dm.data(), dg.data(), du.data(),
                            dnorm.data()};

  // MLP: y = h + m Wd^T (summed over the TP group by the reduce-scatter).
  RETURN_IF_ERROR(sp.MlpBackward({w.ln2, w.wg, w.wu, w.wd}, r.h, r.mlp(), dy_local, scratch,
                                 {d[6], d[7], d[8]}, dln.data() + C, dh.data()));

  // Attention: h = x + att Wo^T (summed over the TP group).
  RETURN_IF_ERROR(sp.RowParallelBackward(dh.data(), r.att, Ct, w.wo, full.data(), d_wo,
                                         datt.data()));
  ops.AttentionBackward(CpShape(cfg_, t, c, B, T), r.q, r.kv, r.kv + Ct, r.q_pos, r.k_pos, r.att,
                        r.lse, datt.data(), dq.data(), dkv_all.data(), dkv_all.data() + Ct);
  // dK|dV of all T keys [B, T, 2Ct] -> [c, B, Tc, 2Ct]; block j goes to (is summed on) its
  // owner, CP rank j.
  layer::BatchMajorToRankMajor(ops, dkv_all.data(), c, B, T / c, 2 * Ct, dkv_send.data());
  std::shared_ptr<Work> dkv_scatter = cp_->IReduceScatter(dkv_send.data(), dkv.data(), nc * 2 * Ct);
  // Overlapped with the reduce-scatter: the q side.
  LinearWeightGrad(ops, dq.data(), Ct, r.n1, nc, Ct, C, d_wq);
  LinearInputGrad(ops, dq.data(), Ct, w.wq, nc, Ct, C, dfull.data(), 0.0f);
  RETURN_IF_ERROR(dkv_scatter->Wait());
  LinearWeightGrad(ops, dkv.data(), 2 * Ct, r.n1, nc, Ct, C, d_wk);
  LinearWeightGrad(ops, dkv.data() + Ct, 2 * Ct, r.n1, nc, Ct, C, d_wv);
  LinearInputGrad(ops, dkv.data(), 2 * Ct, w.wk, nc, Ct, C, dfull.data(), 1.0f);
  LinearInputGrad(ops, dkv.data() + Ct, 2 * Ct, w.wv, nc, Ct, C, dfull.data(), 1.0f);
  RETURN_IF_ERROR(sp.NormBackward(dfull.data(), r.x, w.ln1, r.rstd1, dh.data(), dnorm.data(),
                                  dx_local, dln.data()));

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
