#include "parallel/distributed_model.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status.h"
#include "parallel/block_cache.h"
#include "parallel/linear.h"
#include "parallel/zigzag.h"

namespace stallfree {
namespace parallel {
namespace {

using kernels::Trans;
using kernels::TransformerOps;

absl::Status CheckSize(const std::vector<float>& v, int64_t want, const std::string& name) {
  if (static_cast<int64_t>(v.size()) != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("distributed_model: ", name, " has ", v.size(), " elements, want ", want));
  }
  return absl::OkStatus();
}

absl::Status PrepareGrad(std::vector<float>* g, int64_t want, const std::string& name) {
  if (g->empty()) g->assign(static_cast<size_t>(want), 0.0f);
  return CheckSize(*g, want, "gradient " + name);
}

absl::Status Sync(const TransformerOps& ops, const char* what) {
  return layer::Sync(ops, "distributed_model", what);
}

// The sharded (non-replicated) fields of a block shard, in a fixed order.
std::vector<std::vector<float>*> ShardedFields(TspShard* s) { return {&s->attn, &s->mlp}; }
std::vector<std::vector<float>*> ShardedFields(BlockWeights* s) {
  return {&s->wq, &s->wk, &s->wv, &s->wo, &s->wg, &s->wu, &s->wd};
}

// shards[q] := rank q's values of the sharded fields of `own` (every rank's fields have the same
// sizes); the replicated fields are copied from `own`. One all-gather.
template <typename S>
absl::Status AllGatherShards(Communicator* comm, const S& own, std::vector<S>* shards) {
  const int D = comm->size();
  S mine = own;
  std::vector<std::vector<float>*> fields = ShardedFields(&mine);
  int64_t count = 0;
  for (const std::vector<float>* f : fields) count += static_cast<int64_t>(f->size());
  std::vector<float> send;
  send.reserve(static_cast<size_t>(count));
  for (const std::vector<float>* f : fields) send.insert(send.end(), f->begin(), f->end());
  std::vector<float> recv(static_cast<size_t>(count) * D);
  RETURN_IF_ERROR(comm->AllGather(send.data(), recv.data(), count));
  shards->assign(static_cast<size_t>(D), own);
  for (int q = 0; q < D; ++q) {
    const float* src = recv.data() + static_cast<int64_t>(q) * count;
    for (std::vector<float>* f : ShardedFields(&(*shards)[q])) {
      std::copy(src, src + f->size(), f->begin());
      src += f->size();
    }
  }
  return absl::OkStatus();
}

// The pos_embedding row of every local token: B copies of the local positions [T/D].
std::vector<int32_t> TiledPositions(const std::vector<int32_t>& positions, int64_t B) {
  std::vector<int32_t> ids;
  ids.reserve(positions.size() * static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) ids.insert(ids.end(), positions.begin(), positions.end());
  return ids;
}

}  // namespace

const char* LayoutName(Layout layout) {
  switch (layout) {
    case Layout::kTsp:
      return "tsp";
    case Layout::kTpsp:
      return "tpsp";
  }
  return "?";
}

absl::Status DistributedModel::Validate() const {
  if (comm_ == nullptr) return absl::InvalidArgumentError("distributed_model: null communicator");
  RETURN_IF_ERROR(ValidateModelConfig(cfg_));
  if (layout_ == Layout::kTsp) return CheckTspConfig(cfg_.block(), comm_->size());
  return ValidateTpspConfig(cfg_.block(), comm_->size(), comm_->rank());
}

absl::StatusOr<DistributedShard> DistributedModel::Shard(const ModelWeights& full) const {
  RETURN_IF_ERROR(Validate());
  RETURN_IF_ERROR(CheckModelWeights(cfg_, full));
  const int D = comm_->size(), p = comm_->rank();
  DistributedShard s;
  s.embedding = full.embedding;
  s.pos_embedding = full.pos_embedding;
  s.ln_f = full.ln_f;
  s.head = full.head;
  for (const BlockWeights& b : full.blocks) {
    if (layout_ == Layout::kTsp) {
      ASSIGN_OR_RETURN(TspShard t, ShardBlockWeights(cfg_.block(), b, D, p));
      s.tsp_blocks.push_back(std::move(t));
    } else {
      ASSIGN_OR_RETURN(BlockWeights t, ShardTpspWeights(cfg_.block(), b, D, p));
      s.tpsp_blocks.push_back(std::move(t));
    }
  }
  return s;
}

absl::StatusOr<std::vector<int32_t>> DistributedModel::LocalPositions(int64_t T) const {
  RETURN_IF_ERROR(Validate());
  const int64_t D = comm_->size(), p = comm_->rank();
  if (layout_ == Layout::kTsp) return ZigzagPositions(T, D, p);
  if (T <= 0 || T % D != 0 || T > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("distributed_model: T=", T, " must be positive and divisible by D=", D));
  }
  const int64_t Tl = T / D;
  std::vector<int32_t> pos(static_cast<size_t>(Tl));
  for (int64_t i = 0; i < Tl; ++i) pos[i] = static_cast<int32_t>(p * Tl + i);
  return pos;
}

absl::Status DistributedModel::CheckShard(const DistributedShard& w, const char* what) const {
  const int64_t C = cfg_.C, V = cfg_.vocab, D = comm_->size();
  RETURN_IF_ERROR(CheckSize(w.embedding, V * C, absl::StrCat(what, "embedding")));
  RETURN_IF_ERROR(
      CheckSize(w.pos_embedding, PosEmbeddingSize(cfg_), absl::StrCat(what, "pos_embedding")));
  RETURN_IF_ERROR(CheckSize(w.ln_f, C, absl::StrCat(what, "ln_f")));
  RETURN_IF_ERROR(CheckSize(w.head, HeadSize(cfg_), absl::StrCat(what, "head")));
  const size_t want_tsp = layout_ == Layout::kTsp ? cfg_.layers : 0;
  const size_t want_tpsp = layout_ == Layout::kTpsp ? cfg_.layers : 0;
  if (w.tsp_blocks.size() != want_tsp || w.tpsp_blocks.size() != want_tpsp) {
    return absl::InvalidArgumentError(
        absl::StrCat("distributed_model: ", what, "shard has ", w.tsp_blocks.size(), " tsp and ",
                     w.tpsp_blocks.size(), " tpsp blocks, want ", want_tsp, " and ", want_tpsp));
  }
  for (const TspShard& b : w.tsp_blocks) {
    RETURN_IF_ERROR(CheckSize(b.ln1, C, absl::StrCat(what, "tsp ln1")));
    RETURN_IF_ERROR(CheckSize(b.ln2, C, absl::StrCat(what, "tsp ln2")));
    RETURN_IF_ERROR(CheckSize(b.attn, 4 * C * (C / D), absl::StrCat(what, "tsp attn")));
    RETURN_IF_ERROR(CheckSize(b.mlp, 3 * (cfg_.FF / D) * C, absl::StrCat(what, "tsp mlp")));
  }
  for (const BlockWeights& b : w.tpsp_blocks) {
    RETURN_IF_ERROR(CheckTpspShard(cfg_.block(), b, static_cast<int>(D)));
  }
  return absl::OkStatus();
}

// The weights of either form: pointers for the ops (head is the embedding when tied), and the
// shard (CPU API) or the view (backend memory) for the blocks. Exactly one of shard / view is set.
struct DistributedModel::WeightRefs {
  const float* embedding = nullptr;
  const float* pos_embedding = nullptr;
  const float* ln_f = nullptr;
  const float* head = nullptr;
  const DistributedShard* shard = nullptr;
  const DistributedShardView* view = nullptr;
};

// The gradients of either form: pointers for the ops (pos_embedding / head null when the config
// has none), and the grads (CPU API) or the view for the blocks. Exactly one of grads / view is
// set, matching WeightRefs.
struct DistributedModel::GradRefs {
  float* embedding = nullptr;
  float* pos_embedding = nullptr;
  float* ln_f = nullptr;
  float* head = nullptr;
  DistributedGrads* grads = nullptr;
  const DistributedGradsView* view = nullptr;
};

namespace {

bool AnyNullBlock(const TspShardView& v) {
  return v.ln1 == nullptr || v.ln2 == nullptr || v.attn == nullptr || v.mlp == nullptr;
}
bool AnyNullBlock(const TspGradsView& v) {
  return v.ln1 == nullptr || v.ln2 == nullptr || v.attn == nullptr || v.mlp == nullptr;
}
bool AnyNullBlock(const TpspShardView& v) { return v.AnyNull(); }
bool AnyNullBlock(const TpspGradsView& v) { return v.AnyNull(); }

// The cache's tensors, wherever they live (the view Forward's buffers or the CPU API's vectors).
// Backward only reads them.
struct CacheRefs {
  const int32_t* tokens = nullptr;
  const int32_t* targets = nullptr;
  const int32_t* pos_ids = nullptr;  // null without learned positions
  const float *x_final = nullptr, *nf = nullptr, *rstd_f = nullptr, *logits = nullptr,
              *lse = nullptr;
  std::vector<int32_t> host_pos_ids;  // the CPU API's pos_ids (pos_ids points here)

  CacheRefs(const DistributedCache& c, bool learned_positions) {
    if (c.buffers != nullptr) {
      const DistributedCacheBuffers& b = *c.buffers;
      tokens = reinterpret_cast<const int32_t*>(b.tokens.data());
      targets = reinterpret_cast<const int32_t*>(b.targets.data());
      if (learned_positions) pos_ids = reinterpret_cast<const int32_t*>(b.pos_ids.data());
      x_final = b.x_final.data();
      nf = b.nf.data();
      rstd_f = b.rstd_f.data();
      logits = b.logits.data();
      lse = b.lse.data();
    } else {
      tokens = c.tokens.data();
      targets = c.targets.data();
      if (learned_positions) {
        host_pos_ids = TiledPositions(c.positions, c.B);
        pos_ids = host_pos_ids.data();
      }
      x_final = c.x_final.data();
      nf = c.nf.data();
      rstd_f = c.rstd_f.data();
      logits = c.logits.data();
      lse = c.lse.data();
    }
  }
  CacheRefs(const CacheRefs&) = delete;
  CacheRefs& operator=(const CacheRefs&) = delete;
};

}  // namespace

template <class View>
absl::Status DistributedModel::CheckView(const View& v, const char* what) const {
  const auto fail = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("distributed_model: ", what, "view: ", why));
  };
  if (v.embedding == nullptr || v.ln_f == nullptr) return fail("null embedding or ln_f");
  if ((v.pos_embedding != nullptr) != cfg_.learned_positions) {
    return fail(cfg_.learned_positions ? "null pos_embedding with learned positions"
                                       : "a pos_embedding without learned positions");
  }
  if ((v.head != nullptr) == cfg_.tied_head) {
    return fail(cfg_.tied_head ? "a head with a tied head" : "null head");
  }
  const size_t want_tsp = layout_ == Layout::kTsp ? cfg_.layers : 0;
  const size_t want_tpsp = layout_ == Layout::kTpsp ? cfg_.layers : 0;
  if (v.tsp_blocks.size() != want_tsp || v.tpsp_blocks.size() != want_tpsp) {
    return fail(absl::StrCat(v.tsp_blocks.size(), " tsp and ", v.tpsp_blocks.size(),
                             " tpsp blocks, want ", want_tsp, " and ", want_tpsp));
  }
  for (const auto& b : v.tsp_blocks) {
    if (AnyNullBlock(b)) return fail("a null tsp block pointer");
  }
  for (const auto& b : v.tpsp_blocks) {
    if (AnyNullBlock(b)) return fail("a null tpsp block pointer");
  }
  return absl::OkStatus();
}

DistributedModel::WeightRefs DistributedModel::RefsOf(const DistributedShard& w) const {
  WeightRefs r;
  r.embedding = w.embedding.data();
  r.pos_embedding = cfg_.learned_positions ? w.pos_embedding.data() : nullptr;
  r.ln_f = w.ln_f.data();
  r.head = cfg_.tied_head ? w.embedding.data() : w.head.data();
  r.shard = &w;
  return r;
}

DistributedModel::WeightRefs DistributedModel::RefsOf(const DistributedShardView& w) const {
  WeightRefs r;
  r.embedding = w.embedding;
  r.pos_embedding = w.pos_embedding;
  r.ln_f = w.ln_f;
  r.head = cfg_.tied_head ? w.embedding : w.head;
  r.view = &w;
  return r;
}

absl::StatusOr<double> DistributedModel::Forward(const TransformerOps& ops,
                                                 const DistributedShard& w, const int32_t* tokens,
                                                 const int32_t* targets, int64_t B, int64_t T,
                                                 DistributedCache* cache) const {
  RETURN_IF_ERROR(Validate());
  RETURN_IF_ERROR(CheckShard(w, ""));
  const WeightRefs r = RefsOf(w);
  return ForwardImpl(ops, r, tokens, targets, B, T, cache);
}

absl::StatusOr<double> DistributedModel::Forward(const TransformerOps& ops,
                                                 const DistributedShardView& w,
                                                 const int32_t* tokens, const int32_t* targets,
                                                 int64_t B, int64_t T,
                                                 DistributedCache* cache) const {
  RETURN_IF_ERROR(Validate());
  RETURN_IF_ERROR(CheckView(w, ""));
  const WeightRefs r = RefsOf(w);
  return ForwardImpl(ops, r, tokens, targets, B, T, cache);
}

absl::StatusOr<int64_t> DistributedModel::SelectTokens(const int32_t* tokens,
                                                       const int32_t* targets, int64_t B,
                                                       int64_t T, DistributedCache* c) const {
  if (B <= 0) return absl::InvalidArgumentError(absl::StrCat("distributed_model: B=", B));
  if (tokens == nullptr || targets == nullptr) {
    return absl::InvalidArgumentError("distributed_model: null tokens or targets");
  }
  ASSIGN_OR_RETURN(std::vector<int32_t> pos, LocalPositions(T));
  if (cfg_.learned_positions && T > cfg_.max_seq) {
    return absl::InvalidArgumentError(absl::StrCat(
        "distributed_model: T=", T, " exceeds the position table's max_seq=", cfg_.max_seq));
  }
  const int64_t V = cfg_.vocab, Tl = T / comm_->size(), nl = B * Tl;
  // Check the whole batch on every rank, so that a bad id fails every rank before any collective.
  for (int64_t i = 0; i < B * T; ++i) {
    if (tokens[i] < 0 || tokens[i] >= V || targets[i] >= V) {
      return absl::InvalidArgumentError(absl::StrCat("distributed_model: token ", tokens[i],
                                                     " / target ", targets[i], " at ", i,
                                                     " out of range for vocab ", V));
    }
  }
  c->B = B;
  c->T = T;
  c->positions = std::move(pos);
  c->tokens.resize(nl);
  c->targets.resize(nl);
  int64_t local_valid = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < Tl; ++i) {
      c->tokens[b * Tl + i] = tokens[b * T + c->positions[i]];
      c->targets[b * Tl + i] = targets[b * T + c->positions[i]];
      if (c->targets[b * Tl + i] >= 0) ++local_valid;
    }
  }
  return local_valid;
}

void DistributedModel::AllocateCache(const TransformerOps& ops, bool backend,
                                     const std::vector<int32_t>& pos_ids,
                                     DistributedCache* c) const {
  const int64_t C = cfg_.C, V = cfg_.vocab, nl = static_cast<int64_t>(c->tokens.size());
  if (backend) {
    for (std::vector<float>* v : {&c->x_final, &c->nf, &c->rstd_f, &c->logits, &c->lse}) {
      std::vector<float>().swap(*v);
    }
    c->buffers = nullptr;  // release the previous step's buffers first (peak memory)
    auto b = std::make_shared<DistributedCacheBuffers>();
    b->tokens = layer::UploadPositions(ops, c->tokens);
    b->targets = layer::UploadPositions(ops, c->targets);
    if (cfg_.learned_positions) b->pos_ids = layer::UploadPositions(ops, pos_ids);
    b->x_final = kernels::OpsBuffer(&ops, nl * C);
    b->nf = kernels::OpsBuffer(&ops, nl * C);
    b->rstd_f = kernels::OpsBuffer(&ops, nl);
    b->logits = kernels::OpsBuffer(&ops, nl * V);
    b->lse = kernels::OpsBuffer(&ops, nl);
    c->buffers = std::move(b);
  } else {
    c->buffers = nullptr;
    c->x_final.resize(nl * C);
    c->nf.resize(nl * C);
    c->rstd_f.resize(nl);
    c->logits.resize(nl * V);
    c->lse.resize(nl);
  }
}

absl::Status DistributedModel::BlocksForward(const TransformerOps& ops, const WeightRefs& w,
                                             const int32_t* tokens, const int32_t* pos_ids,
                                             float* x_final, DistributedCache* c) const {
  const bool backend = w.view != nullptr;
  const int64_t B = c->B, T = c->T, C = cfg_.C, nl = static_cast<int64_t>(c->tokens.size());
  // The residual stream alternates between x_final and `work`, starting so that the last block
  // (or, without blocks, the embedding) writes x_final.
  const int64_t L = cfg_.layers;
  kernels::OpsBuffer work(&ops, nl * C);
  const auto output_of = [&](int64_t l) { return (L - 1 - l) % 2 == 0 ? x_final : work.data(); };
  float* x = output_of(-1);
  ops.EmbeddingForward(w.embedding, C, tokens, nl, x);
  if (cfg_.learned_positions) {
    const kernels::OpsBuffer pe(&ops, nl * C);
    ops.EmbeddingForward(w.pos_embedding, C, pos_ids, nl, pe.data());
    ops.Add(x, pe.data(), nl * C, x);
  }
  RETURN_IF_ERROR(Sync(ops, "embedding forward"));
  if (layout_ == Layout::kTsp) {
    c->tsp_blocks.assign(static_cast<size_t>(L), TspCache());
    c->tpsp_blocks.clear();
    const TspBlock block(cfg_.block(), comm_);
    for (int64_t l = 0; l < L; ++l) {
      float* y = output_of(l);
      RETURN_IF_ERROR(
          backend ? block.Forward(ops, w.view->tsp_blocks[l], x, B, T, y, &c->tsp_blocks[l])
                  : block.Forward(ops, w.shard->tsp_blocks[l], x, B, T, y, &c->tsp_blocks[l]));
      x = y;
    }
  } else {
    c->tpsp_blocks.assign(static_cast<size_t>(L), TpspCache());
    c->tsp_blocks.clear();
    const TpspBlock block(cfg_.block(), comm_);
    for (int64_t l = 0; l < L; ++l) {
      float* y = output_of(l);
      const TpspShardView wl =
          backend ? w.view->tpsp_blocks[l] : TpspViewOf(w.shard->tpsp_blocks[l]);
      RETURN_IF_ERROR(block.Forward(ops, wl, x, B, T, y, &c->tpsp_blocks[l]));
      x = y;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<double> DistributedModel::GlobalMeanLoss(const TransformerOps& ops, double sum,
                                                        int64_t local_valid,
                                                        DistributedCache* c) const {
  // The Communicator moves fp32: send the double sum as hi + lo (exact to ~2^-48 relative) and
  // the count (exact below 2^24), then add the ranks' parts in rank order on every rank. The
  // all-gather runs on backend memory (a device Communicator needs device buffers).
  if (local_valid >= (int64_t{1} << 24)) {
    return absl::InvalidArgumentError("distributed_model: too many targets on one rank");
  }
  const int64_t D = comm_->size();
  const float hi = static_cast<float>(sum);
  const float lo = static_cast<float>(sum - static_cast<double>(hi));
  const float send[3] = {hi, lo, static_cast<float>(local_valid)};
  std::vector<float> recv(3 * D);
  {
    const kernels::OpsBuffer sent(&ops, 3), gathered(&ops, 3 * D);
    ops.Upload(sent.data(), send, 3);
    RETURN_IF_ERROR(comm_->AllGather(sent.data(), gathered.data(), 3));
    ops.Download(recv.data(), gathered.data(), 3 * D);
    RETURN_IF_ERROR(Sync(ops, "loss all-gather"));
  }
  double total = 0;
  int64_t valid = 0;
  for (int64_t q = 0; q < D; ++q) {
    total += static_cast<double>(recv[3 * q]) + static_cast<double>(recv[3 * q + 1]);
    valid += static_cast<int64_t>(recv[3 * q + 2]);
  }
  c->valid = valid;
  if (valid == 0) return 0.0;
  return total / static_cast<double>(valid);
}

absl::StatusOr<double> DistributedModel::ForwardImpl(const TransformerOps& ops, const WeightRefs& w,
                                                     const int32_t* tokens, const int32_t* targets,
                                                     int64_t B, int64_t T,
                                                     DistributedCache* cache) const {
  DistributedCache scratch;
  DistributedCache& c = cache != nullptr ? *cache : scratch;
  ASSIGN_OR_RETURN(const int64_t local_valid, SelectTokens(tokens, targets, B, T, &c));
  const int64_t C = cfg_.C, V = cfg_.vocab, nl = static_cast<int64_t>(c.tokens.size());
  // Each local token's row of the position table (its global position); host memory until the
  // uploads below have been synchronised.
  const std::vector<int32_t> pos_ids =
      cfg_.learned_positions ? TiledPositions(c.positions, B) : std::vector<int32_t>();
  // The cache's tensors: OpsBuffers (view form) or the vectors (CPU API).
  AllocateCache(ops, w.view != nullptr, pos_ids, &c);
  const CacheRefs cr(c, cfg_.learned_positions);
  // The cache is this call's to write.
  float* const x_final = const_cast<float*>(cr.x_final);
  float* const nf = const_cast<float*>(cr.nf);
  float* const rstd_f = const_cast<float*>(cr.rstd_f);
  float* const logits = const_cast<float*>(cr.logits);
  float* const lse = const_cast<float*>(cr.lse);
  RETURN_IF_ERROR(BlocksForward(ops, w, cr.tokens, cr.pos_ids, x_final, &c));
  kernels::OpsBuffer loss(&ops, nl);
  ops.RmsNormForward(x_final, w.ln_f, nl, C, cfg_.eps, nf, rstd_f);
  ops.Gemm(Trans::kNo, Trans::kYes, nl, V, C, 1.0f, nf, C, w.head, C, 0.0f, logits, V);
  ops.CrossEntropyForward(logits, nl, V, cr.targets, loss.data(), lse);
  // The per-token losses come to the host and are added in double there, in token order: the
  // same sum in both forms (a device reduction would round differently from the CPU API's).
  std::vector<float> token_loss(static_cast<size_t>(nl));
  ops.Download(token_loss.data(), loss.data(), nl);
  RETURN_IF_ERROR(Sync(ops, "head forward"));
  double sum = 0;
  for (int64_t i = 0; i < nl; ++i) {
    if (c.targets[i] >= 0) sum += token_loss[i];
  }
  return GlobalMeanLoss(ops, sum, local_valid, &c);
}

absl::Status DistributedModel::CheckCache(const DistributedCache& c) const {
  const int64_t D = comm_->size(), C = cfg_.C, V = cfg_.vocab;
  if (c.B <= 0 || c.T <= 0 || c.T % D != 0) {
    return absl::InvalidArgumentError("distributed_model: cache has a bad B, T");
  }
  const int64_t nl = c.B * c.T / D;
  const size_t layers = static_cast<size_t>(cfg_.layers);
  const bool tsp = layout_ == Layout::kTsp;
  bool sizes_ok;
  if (c.buffers != nullptr) {
    const DistributedCacheBuffers& b = *c.buffers;
    sizes_ok = b.tokens.size() == nl && b.targets.size() == nl &&
               b.pos_ids.size() == (cfg_.learned_positions ? nl : 0) &&
               b.x_final.size() == nl * C && b.nf.size() == nl * C && b.rstd_f.size() == nl &&
               b.logits.size() == nl * V && b.lse.size() == nl;
  } else {
    sizes_ok = static_cast<int64_t>(c.x_final.size()) == nl * C &&
               static_cast<int64_t>(c.nf.size()) == nl * C &&
               static_cast<int64_t>(c.rstd_f.size()) == nl &&
               static_cast<int64_t>(c.logits.size()) == nl * V &&
               static_cast<int64_t>(c.lse.size()) == nl;
  }
  if (!sizes_ok || (tsp ? c.tsp_blocks.size() : c.tpsp_blocks.size()) != layers ||
      static_cast<int64_t>(c.tokens.size()) != nl || static_cast<int64_t>(c.targets.size()) != nl ||
      static_cast<int64_t>(c.positions.size()) != c.T / D ||
      (cfg_.learned_positions && c.T > cfg_.max_seq)) {
    return absl::InvalidArgumentError("distributed_model: cache does not match the model");
  }
  return absl::OkStatus();
}

absl::Status DistributedModel::Backward(const TransformerOps& ops, const DistributedShard& w,
                                        const DistributedCache& c, DistributedGrads* grads) const {
  RETURN_IF_ERROR(Validate());
  RETURN_IF_ERROR(CheckShard(w, ""));
  if (grads == nullptr) return absl::InvalidArgumentError("distributed_model: null grads");
  const int64_t D = comm_->size(), C = cfg_.C, V = cfg_.vocab;
  RETURN_IF_ERROR(CheckCache(c));
  const size_t layers = static_cast<size_t>(cfg_.layers);
  const bool tsp = layout_ == Layout::kTsp;
  // Size the gradients like the weights.
  const int64_t P = PosEmbeddingSize(cfg_), Hd = HeadSize(cfg_);
  RETURN_IF_ERROR(PrepareGrad(&grads->embedding, V * C, "embedding"));
  RETURN_IF_ERROR(PrepareGrad(&grads->pos_embedding, P, "pos_embedding"));
  RETURN_IF_ERROR(PrepareGrad(&grads->ln_f, C, "ln_f"));
  RETURN_IF_ERROR(PrepareGrad(&grads->head, Hd, "head"));
  if (tsp) {
    if (grads->tsp_blocks.empty()) grads->tsp_blocks.resize(layers);
  } else {
    if (grads->tpsp_blocks.empty()) grads->tpsp_blocks.resize(layers);
  }
  if ((tsp ? grads->tsp_blocks.size() : grads->tpsp_blocks.size()) != layers ||
      (tsp ? grads->tpsp_blocks.size() : grads->tsp_blocks.size()) != 0) {
    return absl::InvalidArgumentError("distributed_model: gradient blocks do not match layers");
  }
  // The TP+SP blocks accumulate into views: their gradients are sized here.
  for (BlockGrads& g : grads->tpsp_blocks) {
    RETURN_IF_ERROR(SizeTpspGrads(cfg_.block(), static_cast<int>(D), &g));
  }
  if (c.valid == 0) {
    // The loss is the constant 0; still size the block gradients (all ranks return here).
    for (TspShard& g : grads->tsp_blocks) {
      if (g.attn.empty()) g = TspShard::Zeros(cfg_.block(), D);
    }
    return CheckShard(*grads, "gradient ");
  }
  const WeightRefs r = RefsOf(w);
  GradRefs g;
  g.embedding = grads->embedding.data();
  g.pos_embedding = P > 0 ? grads->pos_embedding.data() : nullptr;
  g.ln_f = grads->ln_f.data();
  g.head = Hd > 0 ? grads->head.data() : nullptr;
  g.grads = grads;
  return BackwardImpl(ops, r, c, g);
}

absl::Status DistributedModel::Backward(const TransformerOps& ops, const DistributedShardView& w,
                                        const DistributedCache& c,
                                        const DistributedGradsView& grads) const {
  RETURN_IF_ERROR(Validate());
  RETURN_IF_ERROR(CheckView(w, ""));
  RETURN_IF_ERROR(CheckView(grads, "gradient "));
  RETURN_IF_ERROR(CheckCache(c));
  bool in_buffers = c.buffers != nullptr;
  for (const TspCache& b : c.tsp_blocks) in_buffers = in_buffers && b.buffers != nullptr;
  for (const TpspCache& b : c.tpsp_blocks) in_buffers = in_buffers && b.buffers != nullptr;
  if (!in_buffers) {
    return absl::InvalidArgumentError(
        "distributed_model: the view Backward needs a cache from the view Forward");
  }
  if (c.valid == 0) return absl::OkStatus();  // The loss is the constant 0 (all ranks return).
  const WeightRefs r = RefsOf(w);
  GradRefs g;
  g.embedding = grads.embedding;
  g.pos_embedding = grads.pos_embedding;
  g.ln_f = grads.ln_f;
  g.head = grads.head;
  g.view = &grads;
  return BackwardImpl(ops, r, c, g);
}

absl::Status DistributedModel::BackwardImpl(const TransformerOps& ops, const WeightRefs& w,
                                            const DistributedCache& c, const GradRefs& g) const {
  const bool backend = w.view != nullptr;
  const int64_t D = comm_->size(), C = cfg_.C, V = cfg_.vocab, nl = c.B * c.T / D;
  const int64_t P = PosEmbeddingSize(cfg_), Hd = HeadSize(cfg_);
  const CacheRefs cr(c, cfg_.learned_positions);

  // The replicated tensors' partial gradients, packed for one all-reduce:
  // embedding | pos_embedding (P floats, 0 without learned positions) | ln_f | head (Hd floats,
  // 0 when tied; a tied head's part goes to the embedding's slot).
  const kernels::OpsBuffer partial(&ops, V * C + P + C + Hd);  // zeroed
  float* d_embedding = partial.data();
  float* d_pos = partial.data() + V * C;
  float* d_ln_f = d_pos + P;
  float* d_head = cfg_.tied_head ? d_embedding : d_ln_f + C;

  kernels::OpsBuffer dlogits(&ops, nl * V), dnf(&ops, nl * C), dx_buf(&ops, nl * C),
      dprev_buf(&ops, nl * C);
  ops.CrossEntropyBackward(cr.logits, cr.lse, cr.targets, nl, V, 1.0f / static_cast<float>(c.valid),
                           dlogits.data());
  // logits = nf head^T: d head += dlogits^T nf, d nf = dlogits head.
  ops.Gemm(Trans::kYes, Trans::kNo, V, C, nl, 1.0f, dlogits.data(), V, cr.nf, C, 1.0f, d_head, C);
  ops.Gemm(Trans::kNo, Trans::kNo, nl, C, V, 1.0f, dlogits.data(), V, w.head, C, 0.0f, dnf.data(),
           C);
  float* dx = dx_buf.data();
  float* dprev = dprev_buf.data();
  ops.RmsNormBackward(cr.x_final, w.ln_f, cr.rstd_f, dnf.data(), nl, C, dx, d_ln_f);
  RETURN_IF_ERROR(Sync(ops, "head backward"));
  dlogits.reset();
  if (layout_ == Layout::kTsp) {
    const TspBlock block(cfg_.block(), comm_);
    for (int64_t l = cfg_.layers - 1; l >= 0; --l) {
      RETURN_IF_ERROR(backend ? block.Backward(ops, w.view->tsp_blocks[l], c.tsp_blocks[l], dx,
                                                  dprev, g.view->tsp_blocks[l])
                                 : block.Backward(ops, w.shard->tsp_blocks[l], c.tsp_blocks[l], dx,
                                                  dprev, &g.grads->tsp_blocks[l]));
      std::swap(dx, dprev);
    }
  } else {
    const TpspBlock block(cfg_.block(), comm_);
    for (int64_t l = cfg_.layers - 1; l >= 0; --l) {
      const TpspShardView wl =
          backend ? w.view->tpsp_blocks[l] : TpspViewOf(w.shard->tpsp_blocks[l]);
      const TpspGradsView gl =
          backend ? g.view->tpsp_blocks[l] : TpspViewOf(&g.grads->tpsp_blocks[l]);
      RETURN_IF_ERROR(block.Backward(ops, wl, c.tpsp_blocks[l], dx, dprev, gl));
      std::swap(dx, dprev);
    }
  }
  ops.EmbeddingBackward(dx, C, cr.tokens, nl, d_embedding);
  if (cfg_.learned_positions) ops.EmbeddingBackward(dx, C, cr.pos_ids, nl, d_pos);
  RETURN_IF_ERROR(Sync(ops, "embedding backward"));
  RETURN_IF_ERROR(comm_->AllReduce(partial.data(), partial.size()));
  ops.Add(g.embedding, d_embedding, V * C, g.embedding);
  if (P > 0) ops.Add(g.pos_embedding, d_pos, P, g.pos_embedding);
  ops.Add(g.ln_f, d_ln_f, C, g.ln_f);
  if (Hd > 0) ops.Add(g.head, d_head, Hd, g.head);
  return Sync(ops, "gradient accumulation");
}

absl::StatusOr<ModelGrads> DistributedModel::GatherGrads(const DistributedGrads& grads) const {
  RETURN_IF_ERROR(Validate());
  RETURN_IF_ERROR(CheckShard(grads, "gradient "));
  const int D = comm_->size();
  ModelGrads full;
  full.embedding = grads.embedding;
  full.pos_embedding = grads.pos_embedding;
  full.ln_f = grads.ln_f;
  full.head = grads.head;
  full.blocks.resize(static_cast<size_t>(cfg_.layers));
  for (int64_t l = 0; l < cfg_.layers; ++l) {
    if (layout_ == Layout::kTsp) {
      std::vector<TspShard> shards;
      RETURN_IF_ERROR(AllGatherShards(comm_, grads.tsp_blocks[l], &shards));
      ASSIGN_OR_RETURN(full.blocks[l], UnshardGrads(cfg_.block(), shards));
    } else {
      std::vector<BlockWeights> shards;
      RETURN_IF_ERROR(AllGatherShards(comm_, grads.tpsp_blocks[l], &shards));
      for (int q = 0; q < D; ++q) {
        RETURN_IF_ERROR(PlaceTpspShardGrads(cfg_.block(), shards[q], D, q, &full.blocks[l]));
      }
    }
  }
  return full;
}

}  // namespace parallel
}  // namespace stallfree
