#include "parallel/tpsp_block.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "parallel/block_cache.h"
#include "parallel/linear.h"
#include "parallel/tp_sublayers.h"

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

// The cache's float tensors in TpspCacheBuffers' order, with their sizes for (D, B, T).
constexpr size_t kCacheTensors = 12;

layer::CacheSizes<kCacheTensors> CacheSizes(const BlockConfig& cfg, int D, int64_t B, int64_t T) {
  const int64_t C = cfg.C, Cl = C / D, Fl = cfg.FF / D, n = B * T, nl = n / D;
  //       x       rstd1 n1     qkv         att     lse                    h
  return {nl * C, nl, n * C, n * 3 * Cl, n * Cl, B * (cfg.H / D) * T, nl * C,
          //  rstd2 n2     g       u       m
          nl, n * C, n * Fl, n * Fl, n * Fl};
}

// Buffers is TpspCacheBuffers or const TpspCacheBuffers.
template <class Buffers>
std::array<decltype(&std::declval<Buffers*>()->x), kCacheTensors> TensorsOf(Buffers* b) {
  return {&b->x, &b->rstd1, &b->n1, &b->qkv, &b->att, &b->lse,
          &b->h, &b->rstd2, &b->n2, &b->g,   &b->u,   &b->m};
}

// The cache's tensors.
struct CacheRefs {
  const int32_t* positions = nullptr;
  float *x, *rstd1, *n1, *qkv, *att, *lse, *h, *rstd2, *n2, *g, *u, *m;

  tp::MlpCache mlp() const { return {rstd2, n2, g, u, m}; }
};

// False if the cache is empty, its tensors do not have the sizes for (D, c.B, c.T) or they are
// not ops' memory.
bool RefsOf(const TpspCache& c, const BlockConfig& cfg, int D, const TransformerOps& ops,
            CacheRefs* r) {
  const TpspCacheBuffers* b = c.buffers.get();
  std::array<float*, kCacheTensors> p;
  if (b == nullptr || b->positions.size() != c.T ||
      !layer::CacheData(ops, TensorsOf(b), CacheSizes(cfg, D, c.B, c.T), &p)) {
    return false;
  }
  r->positions = reinterpret_cast<const int32_t*>(b->positions.data());
  float** named[kCacheTensors] = {&r->x, &r->rstd1, &r->n1, &r->qkv, &r->att, &r->lse,
                                  &r->h, &r->rstd2, &r->n2, &r->g,   &r->u,   &r->m};
  for (size_t i = 0; i < kCacheTensors; ++i) *named[i] = p[i];
  return true;
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
  RETURN_IF_ERROR(ValidateBlockConfig(cfg));
  if (D <= 0 || p < 0 || p >= D || cfg.H % D != 0 || cfg.FF % D != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tpsp: bad degree D=", D, " rank ", p,
                                                   " for H=", cfg.H, " FF=", cfg.FF,
                                                   " (need H % D == 0, FF % D == 0)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<BlockWeights> ShardTpspWeights(const BlockConfig& cfg, const BlockWeights& full,
                                              int D, int p) {
  RETURN_IF_ERROR(ValidateTpspConfig(cfg, D, p));
  RETURN_IF_ERROR(CheckBlockWeights(cfg, full));
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
  RETURN_IF_ERROR(ValidateTpspConfig(cfg, D, 0));
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
  RETURN_IF_ERROR(ValidateTpspConfig(cfg, D, p));
  RETURN_IF_ERROR(CheckTpspShard(cfg, shard, D));
  if (full == nullptr) return absl::InvalidArgumentError("tpsp: null full gradients");
  bool empty = true;
  for (const std::vector<float>* v : full->Tensors()) empty = empty && v->empty();
  if (empty) *full = BlockWeights::Zeros(cfg);
  RETURN_IF_ERROR(CheckBlockWeights(cfg, *full));
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

absl::Status SizeTpspGrads(const BlockConfig& cfg, int D, BlockGrads* grads) {
  RETURN_IF_ERROR(ValidateTpspConfig(cfg, D, 0));
  if (grads == nullptr) return absl::InvalidArgumentError("tpsp: null grads");
  const std::vector<int64_t> sizes = ShardSizes(cfg, D);
  const std::vector<std::vector<float>*> t = grads->Tensors();
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i]->empty()) t[i]->assign(static_cast<size_t>(sizes[i]), 0.0f);
  }
  return CheckTpspShard(cfg, *grads, D);
}

absl::Status CheckForwardPointers(const char* who, const TpspShardView& w, const float* x,
                                  const float* y) {
  if (w.AnyNull()) return absl::InvalidArgumentError(absl::StrCat(who, ": null weight pointer"));
  if (x == nullptr || y == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(who, ": null x or y"));
  return absl::OkStatus();
}

absl::Status CheckBackwardPointers(const char* who, const TpspShardView& w,
                                   const TpspGradsView& grads, const float* dy, const float* dx) {
  if (w.AnyNull()) return absl::InvalidArgumentError(absl::StrCat(who, ": null weight pointer"));
  if (grads.AnyNull())
    return absl::InvalidArgumentError(absl::StrCat(who, ": null gradient pointer"));
  if (dy == nullptr || dx == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(who, ": null dy or dx"));
  return absl::OkStatus();
}

TpspShardView TpspViewOf(const BlockWeights& w) {
  return TpspShardView{w.ln1.data(), w.wq.data(), w.wk.data(), w.wv.data(), w.wo.data(),
                       w.ln2.data(), w.wg.data(), w.wu.data(), w.wd.data()};
}

TpspGradsView TpspViewOf(BlockGrads* g) {
  return TpspGradsView{g->ln1.data(), g->wq.data(), g->wk.data(), g->wv.data(), g->wo.data(),
                       g->ln2.data(), g->wg.data(), g->wu.data(), g->wd.data()};
}

int64_t TpspCache::bytes() const {
  if (buffers == nullptr) return 0;
  int64_t floats = buffers->positions.size();
  for (const kernels::OpsBuffer* b : TensorsOf(buffers.get())) floats += b->size();
  return floats * static_cast<int64_t>(sizeof(float));
}

absl::Status TpspBlock::Check() const {
  if (comm_ == nullptr) return absl::InvalidArgumentError("tpsp: null communicator");
  return ValidateTpspConfig(cfg_, comm_->size(), comm_->rank());
}

absl::Status TpspBlock::Forward(const TransformerOps& ops, const TpspShardView& w,
                                const float* x_local, int64_t B, int64_t T, float* y_local,
                                TpspCache* cache) const {
  RETURN_IF_ERROR(Check());
  const int D = comm_->size();
  RETURN_IF_ERROR(CheckBT(B, T, D));
  RETURN_IF_ERROR(CheckForwardPointers("tpsp", w, x_local, y_local));
  TpspCache scratch;
  TpspCache& c = cache != nullptr ? *cache : scratch;
  const int64_t C = cfg_.C, Cl = C / D, C3 = 3 * Cl;
  c.B = B;
  c.T = T;
  // The previous step's buffers are released first, and the host positions once uploaded (peak
  // memory).
  c.buffers = nullptr;
  auto b = std::make_shared<TpspCacheBuffers>();
  {
    std::vector<int32_t> positions(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) positions[t] = static_cast<int32_t>(t);
    b->positions = layer::UploadPositions(ops, positions);
    RETURN_IF_ERROR(Sync(ops, "positions upload"));
  }
  layer::AllocateCache(ops, CacheSizes(cfg_, D, B, T), TensorsOf(b.get()));
  c.buffers = std::move(b);
  CacheRefs r;
  RefsOf(c, cfg_, D, ops, &r);  // sized just now
  const tp::SequenceParallel sp(ops, cfg_, comm_, B, T / D);
  const int64_t n = sp.tokens(), nl = sp.local_tokens();
  ops.CopyFloats(r.x, x_local, nl * C);
  kernels::OpsBuffer norm_local(&ops, nl * C), partial(&ops, n * C);

  // Attention: h = x + RS(attn_p(AG(rmsnorm(x)))).
  RETURN_IF_ERROR(sp.NormGather(x_local, w.ln1, r.rstd1, norm_local.data(), r.n1));
  Linear(ops, r.n1, C, w.wq, n, Cl, C, r.qkv, C3);
  Linear(ops, r.n1, C, w.wk, n, Cl, C, r.qkv + Cl, C3);
  Linear(ops, r.n1, C, w.wv, n, Cl, C, r.qkv + 2 * Cl, C3);
  const AttentionShape s = LocalShape(cfg_, D, B, T);
  ops.AttentionForward(s, r.qkv, r.qkv + Cl, r.qkv + 2 * Cl, r.positions, r.positions, r.att,
                       r.lse);
  RETURN_IF_ERROR(sp.RowParallelResidual(r.att, Cl, w.wo, x_local, partial.data(), r.h));

  // MLP: y = h + RS(mlp_p(AG(rmsnorm(h)))).
  RETURN_IF_ERROR(sp.Mlp({w.ln2, w.wg, w.wu, w.wd}, r.h, r.mlp(), norm_local.data(),
                         partial.data(), y_local));
  return Sync(ops, "block forward");
}

absl::Status TpspBlock::Backward(const TransformerOps& ops, const TpspShardView& w,
                                 const TpspCache& c, const float* dy_local, float* dx_local,
                                 const TpspGradsView& grads) const {
  RETURN_IF_ERROR(Check());
  const int D = comm_->size();
  RETURN_IF_ERROR(CheckBT(c.B, c.T, D));
  RETURN_IF_ERROR(CheckBackwardPointers("tpsp", w, grads, dy_local, dx_local));
  CacheRefs r;
  if (!RefsOf(c, cfg_, D, ops, &r)) {
    return absl::InvalidArgumentError(
        "tpsp: cache does not match its B, T, the group size or the backend");
  }
  const tp::SequenceParallel sp(ops, cfg_, comm_, c.B, c.T / D);
  const int64_t C = cfg_.C, Cl = C / D, Fl = cfg_.FF / D, C3 = 3 * Cl;
  const int64_t n = sp.tokens(), nl = sp.local_tokens();

  // The gathered gradient and the partial input gradient [n, C].
  kernels::OpsBuffer full(&ops, n * C), dfull(&ops, n * C);
  kernels::OpsBuffer dm(&ops, n * Fl), dg(&ops, n * Fl), du(&ops, n * Fl), datt(&ops, n * Cl),
      dqkv(&ops, n * C3);
  kernels::OpsBuffer dh(&ops, nl * C), dnorm(&ops, nl * C);
  kernels::OpsBuffer dln(&ops, 2 * C);  // ln1 | ln2 partial gradients over the local tokens
  const tp::Scratch scratch{full.data(), dfull.data(), dm.data(), dg.data(), du.data(),
                            dnorm.data()};

  // MLP: y = h + m Wd_p^T (summed over ranks by the reduce-scatter).
  RETURN_IF_ERROR(sp.MlpBackward({w.ln2, w.wg, w.wu, w.wd}, r.h, r.mlp(), dy_local, scratch,
                                 {grads.wg, grads.wu, grads.wd}, dln.data() + C, dh.data()));

  // Attention: h = x + att_p Wo_p^T (summed over ranks).
  RETURN_IF_ERROR(
      sp.RowParallelBackward(dh.data(), r.att, Cl, w.wo, full.data(), grads.wo, datt.data()));
  const AttentionShape s = LocalShape(cfg_, D, c.B, c.T);
  ops.AttentionBackward(s, r.qkv, r.qkv + Cl, r.qkv + 2 * Cl, r.positions, r.positions, r.att,
                        r.lse, datt.data(), dqkv.data(), dqkv.data() + Cl, dqkv.data() + 2 * Cl);
  const float* wqkv[3] = {w.wq, w.wk, w.wv};
  float* dwqkv[3] = {grads.wq, grads.wk, grads.wv};
  for (int i = 0; i < 3; ++i) {
    LinearWeightGrad(ops, dqkv.data() + i * Cl, C3, r.n1, n, Cl, C, dwqkv[i]);
    LinearInputGrad(ops, dqkv.data() + i * Cl, C3, wqkv[i], n, Cl, C, dfull.data(),
                    i == 0 ? 0.0f : 1.0f);
  }
  RETURN_IF_ERROR(sp.NormBackward(dfull.data(), r.x, w.ln1, r.rstd1, dh.data(), dnorm.data(),
                                  dx_local, dln.data()));

  // The replicated norms' gradients: sums over every rank's tokens.
  RETURN_IF_ERROR(comm_->AllReduce(dln.data(), 2 * C));
  ops.Add(grads.ln1, dln.data(), C, grads.ln1);
  ops.Add(grads.ln2, dln.data() + C, C, grads.ln2);
  return Sync(ops, "block backward");
}

}  // namespace parallel
}  // namespace stallfree
