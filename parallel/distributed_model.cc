#include "parallel/distributed_model.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "parallel/zigzag.h"

namespace stallfree {
namespace parallel {
namespace {

using kernels::Trans;
using kernels::TransformerOps;

#define DM_RETURN_IF_ERROR(expr)     \
  do {                               \
    absl::Status dm_st_ = (expr);    \
    if (!dm_st_.ok()) return dm_st_; \
  } while (0)

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
  const std::string err = ops.Synchronize();
  if (!err.empty()) {
    return absl::InternalError(absl::StrCat("distributed_model: ", what, ": ", err));
  }
  return absl::OkStatus();
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
  DM_RETURN_IF_ERROR(comm->AllGather(send.data(), recv.data(), count));
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
  DM_RETURN_IF_ERROR(ValidateModelConfig(cfg_));
  if (layout_ == Layout::kTsp) return CheckTspConfig(cfg_.block(), comm_->size());
  return ValidateTpspConfig(cfg_.block(), comm_->size(), comm_->rank());
}

absl::StatusOr<DistributedShard> DistributedModel::Shard(const ModelWeights& full) const {
  DM_RETURN_IF_ERROR(Validate());
  DM_RETURN_IF_ERROR(CheckModelWeights(cfg_, full));
  const int D = comm_->size(), p = comm_->rank();
  DistributedShard s;
  s.embedding = full.embedding;
  s.pos_embedding = full.pos_embedding;
  s.ln_f = full.ln_f;
  s.head = full.head;
  for (const BlockWeights& b : full.blocks) {
    if (layout_ == Layout::kTsp) {
      absl::StatusOr<TspShard> t = ShardBlockWeights(cfg_.block(), b, D, p);
      if (!t.ok()) return t.status();
      s.tsp_blocks.push_back(*std::move(t));
    } else {
      absl::StatusOr<BlockWeights> t = ShardTpspWeights(cfg_.block(), b, D, p);
      if (!t.ok()) return t.status();
      s.tpsp_blocks.push_back(*std::move(t));
    }
  }
  return s;
}

absl::StatusOr<std::vector<int32_t>> DistributedModel::LocalPositions(int64_t T) const {
  DM_RETURN_IF_ERROR(Validate());
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
  DM_RETURN_IF_ERROR(CheckSize(w.embedding, V * C, absl::StrCat(what, "embedding")));
  DM_RETURN_IF_ERROR(
      CheckSize(w.pos_embedding, PosEmbeddingSize(cfg_), absl::StrCat(what, "pos_embedding")));
  DM_RETURN_IF_ERROR(CheckSize(w.ln_f, C, absl::StrCat(what, "ln_f")));
  DM_RETURN_IF_ERROR(CheckSize(w.head, HeadSize(cfg_), absl::StrCat(what, "head")));
  const size_t want_tsp = layout_ == Layout::kTsp ? cfg_.layers : 0;
  const size_t want_tpsp = layout_ == Layout::kTpsp ? cfg_.layers : 0;
  if (w.tsp_blocks.size() != want_tsp || w.tpsp_blocks.size() != want_tpsp) {
    return absl::InvalidArgumentError(
        absl::StrCat("distributed_model: ", what, "shard has ", w.tsp_blocks.size(), " tsp and ",
                     w.tpsp_blocks.size(), " tpsp blocks, want ", want_tsp, " and ", want_tpsp));
  }
  for (const TspShard& b : w.tsp_blocks) {
    DM_RETURN_IF_ERROR(CheckSize(b.ln1, C, absl::StrCat(what, "tsp ln1")));
    DM_RETURN_IF_ERROR(CheckSize(b.ln2, C, absl::StrCat(what, "tsp ln2")));
    DM_RETURN_IF_ERROR(CheckSize(b.attn, 4 * C * (C / D), absl::StrCat(what, "tsp attn")));
    DM_RETURN_IF_ERROR(CheckSize(b.mlp, 3 * (cfg_.FF / D) * C, absl::StrCat(what, "tsp mlp")));
  }
  for (const BlockWeights& b : w.tpsp_blocks) {
    DM_RETURN_IF_ERROR(CheckTpspShard(cfg_.block(), b, static_cast<int>(D)));
  }
  return absl::OkStatus();
}

absl::StatusOr<double> DistributedModel::Forward(const TransformerOps& ops,
                                                 const DistributedShard& w, const int32_t* tokens,
                                                 const int32_t* targets, int64_t B, int64_t T,
                                                 DistributedCache* cache) const {
  DM_RETURN_IF_ERROR(Validate());
  DM_RETURN_IF_ERROR(CheckShard(w, ""));
  if (B <= 0) return absl::InvalidArgumentError(absl::StrCat("distributed_model: B=", B));
  if (tokens == nullptr || targets == nullptr) {
    return absl::InvalidArgumentError("distributed_model: null tokens or targets");
  }
  absl::StatusOr<std::vector<int32_t>> pos = LocalPositions(T);
  if (!pos.ok()) return pos.status();
  if (cfg_.learned_positions && T > cfg_.max_seq) {
    return absl::InvalidArgumentError(absl::StrCat(
        "distributed_model: T=", T, " exceeds the position table's max_seq=", cfg_.max_seq));
  }
  const int64_t D = comm_->size(), C = cfg_.C, V = cfg_.vocab, Tl = T / D, nl = B * Tl;
  // Check the whole batch on every rank, so that a bad id fails every rank before any collective.
  for (int64_t i = 0; i < B * T; ++i) {
    if (tokens[i] < 0 || tokens[i] >= V || targets[i] >= V) {
      return absl::InvalidArgumentError(absl::StrCat("distributed_model: token ", tokens[i],
                                                     " / target ", targets[i], " at ", i,
                                                     " out of range for vocab ", V));
    }
  }
  DistributedCache scratch;
  DistributedCache& c = cache != nullptr ? *cache : scratch;
  c.B = B;
  c.T = T;
  c.positions = *std::move(pos);
  c.tokens.resize(nl);
  c.targets.resize(nl);
  int64_t local_valid = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < Tl; ++i) {
      c.tokens[b * Tl + i] = tokens[b * T + c.positions[i]];
      c.targets[b * Tl + i] = targets[b * T + c.positions[i]];
      if (c.targets[b * Tl + i] >= 0) ++local_valid;
    }
  }

  std::vector<float> x(nl * C);
  c.x_final.resize(nl * C);
  ops.EmbeddingForward(w.embedding.data(), C, c.tokens.data(), nl, x.data());
  if (cfg_.learned_positions) {
    // Each local token's row of the table at its global position.
    const std::vector<int32_t> ids = TiledPositions(c.positions, B);
    std::vector<float> pe(nl * C);
    ops.EmbeddingForward(w.pos_embedding.data(), C, ids.data(), nl, pe.data());
    ops.Add(x.data(), pe.data(), nl * C, x.data());
  }
  DM_RETURN_IF_ERROR(Sync(ops, "embedding forward"));
  if (layout_ == Layout::kTsp) {
    c.tsp_blocks.assign(static_cast<size_t>(cfg_.layers), TspCache());
    c.tpsp_blocks.clear();
    const TspBlock block(cfg_.block(), comm_);
    for (int64_t l = 0; l < cfg_.layers; ++l) {
      DM_RETURN_IF_ERROR(
          block.Forward(ops, w.tsp_blocks[l], x.data(), B, T, c.x_final.data(), &c.tsp_blocks[l]));
      x.swap(c.x_final);
    }
  } else {
    c.tpsp_blocks.assign(static_cast<size_t>(cfg_.layers), TpspCache());
    c.tsp_blocks.clear();
    const TpspBlock block(cfg_.block(), comm_);
    for (int64_t l = 0; l < cfg_.layers; ++l) {
      DM_RETURN_IF_ERROR(block.Forward(ops, w.tpsp_blocks[l], x.data(), B, T, c.x_final.data(),
                                       &c.tpsp_blocks[l]));
      x.swap(c.x_final);
    }
  }
  c.x_final.swap(x);  // The last block's output.
  c.nf.resize(nl * C);
  c.rstd_f.resize(nl);
  c.logits.resize(nl * V);
  c.lse.resize(nl);
  std::vector<float> loss(nl);
  ops.RmsNormForward(c.x_final.data(), w.ln_f.data(), nl, C, cfg_.eps, c.nf.data(),
                     c.rstd_f.data());
  const std::vector<float>& head = cfg_.tied_head ? w.embedding : w.head;
  ops.Gemm(Trans::kNo, Trans::kYes, nl, V, C, 1.0f, c.nf.data(), C, head.data(), C, 0.0f,
           c.logits.data(), V);
  ops.CrossEntropyForward(c.logits.data(), nl, V, c.targets.data(), loss.data(), c.lse.data());
  DM_RETURN_IF_ERROR(Sync(ops, "head forward"));
  double sum = 0;
  for (int64_t i = 0; i < nl; ++i) {
    if (c.targets[i] >= 0) sum += loss[i];
  }

  // The Communicator moves fp32: send the double sum as hi + lo (exact to ~2^-48 relative) and
  // the count (exact below 2^24), then add the ranks' parts in rank order on every rank.
  if (local_valid >= (int64_t{1} << 24)) {
    return absl::InvalidArgumentError("distributed_model: too many targets on one rank");
  }
  const float hi = static_cast<float>(sum);
  const float lo = static_cast<float>(sum - static_cast<double>(hi));
  const float send[3] = {hi, lo, static_cast<float>(local_valid)};
  std::vector<float> recv(3 * D);
  DM_RETURN_IF_ERROR(comm_->AllGather(send, recv.data(), 3));
  double total = 0;
  int64_t valid = 0;
  for (int64_t q = 0; q < D; ++q) {
    total += static_cast<double>(recv[3 * q]) + static_cast<double>(recv[3 * q + 1]);
    valid += static_cast<int64_t>(recv[3 * q + 2]);
  }
  c.valid = valid;
  if (valid == 0) return 0.0;
  return total / static_cast<double>(valid);
}

absl::Status DistributedModel::Backward(const TransformerOps& ops, const DistributedShard& w,
                                        const DistributedCache& c, DistributedGrads* grads) const {
  DM_RETURN_IF_ERROR(Validate());
  DM_RETURN_IF_ERROR(CheckShard(w, ""));
  if (grads == nullptr) return absl::InvalidArgumentError("distributed_model: null grads");
  const int64_t D = comm_->size(), C = cfg_.C, V = cfg_.vocab;
  if (c.B <= 0 || c.T <= 0 || c.T % D != 0) {
    return absl::InvalidArgumentError("distributed_model: cache has a bad B, T");
  }
  const int64_t nl = c.B * c.T / D;
  const size_t layers = static_cast<size_t>(cfg_.layers);
  const bool tsp = layout_ == Layout::kTsp;
  if ((tsp ? c.tsp_blocks.size() : c.tpsp_blocks.size()) != layers ||
      static_cast<int64_t>(c.logits.size()) != nl * V ||
      static_cast<int64_t>(c.tokens.size()) != nl ||
      static_cast<int64_t>(c.positions.size()) != c.T / D ||
      (cfg_.learned_positions && c.T > cfg_.max_seq)) {
    return absl::InvalidArgumentError("distributed_model: cache does not match the model");
  }
  // Size the gradients like the weights.
  const int64_t P = PosEmbeddingSize(cfg_), Hd = HeadSize(cfg_);
  DM_RETURN_IF_ERROR(PrepareGrad(&grads->embedding, V * C, "embedding"));
  DM_RETURN_IF_ERROR(PrepareGrad(&grads->pos_embedding, P, "pos_embedding"));
  DM_RETURN_IF_ERROR(PrepareGrad(&grads->ln_f, C, "ln_f"));
  DM_RETURN_IF_ERROR(PrepareGrad(&grads->head, Hd, "head"));
  if (tsp) {
    if (grads->tsp_blocks.empty()) grads->tsp_blocks.resize(layers);
  } else {
    if (grads->tpsp_blocks.empty()) grads->tpsp_blocks.resize(layers);
  }
  if ((tsp ? grads->tsp_blocks.size() : grads->tpsp_blocks.size()) != layers ||
      (tsp ? grads->tpsp_blocks.size() : grads->tsp_blocks.size()) != 0) {
    return absl::InvalidArgumentError("distributed_model: gradient blocks do not match layers");
  }
  if (c.valid == 0) {
    // The loss is the constant 0; still size the block gradients (all ranks return here).
    if (tsp) {
      for (TspShard& g : grads->tsp_blocks) {
        if (g.attn.empty()) g = TspShard::Zeros(cfg_.block(), D);
      }
    } else {
      for (BlockWeights& g : grads->tpsp_blocks) {
        if (g.wq.empty()) {
          absl::StatusOr<BlockWeights> z = ShardTpspWeights(
              cfg_.block(), BlockWeights::Zeros(cfg_.block()), static_cast<int>(D), 0);
          if (!z.ok()) return z.status();
          g = *std::move(z);
        }
      }
    }
    return CheckShard(*grads, "gradient ");
  }

  // The replicated tensors' partial gradients, packed for one all-reduce:
  // embedding | pos_embedding (P floats, 0 without learned positions) | ln_f | head (Hd floats,
  // 0 when tied; a tied head's part goes to the embedding's slot).
  std::vector<float> partial(V * C + P + C + Hd, 0.0f);
  float* d_embedding = partial.data();
  float* d_pos = partial.data() + V * C;
  float* d_ln_f = d_pos + P;
  float* d_head = cfg_.tied_head ? d_embedding : d_ln_f + C;
  const float* head = cfg_.tied_head ? w.embedding.data() : w.head.data();

  std::vector<float> dlogits(nl * V), dnf(nl * C), dx(nl * C), dprev(nl * C);
  ops.CrossEntropyBackward(c.logits.data(), c.lse.data(), c.targets.data(), nl, V,
                           1.0f / static_cast<float>(c.valid), dlogits.data());
  // logits = nf head^T: d head += dlogits^T nf, d nf = dlogits head.
  ops.Gemm(Trans::kYes, Trans::kNo, V, C, nl, 1.0f, dlogits.data(), V, c.nf.data(), C, 1.0f, d_head,
           C);
  ops.Gemm(Trans::kNo, Trans::kNo, nl, C, V, 1.0f, dlogits.data(), V, head, C, 0.0f, dnf.data(), C);
  ops.RmsNormBackward(c.x_final.data(), w.ln_f.data(), c.rstd_f.data(), dnf.data(), nl, C,
                      dx.data(), d_ln_f);
  DM_RETURN_IF_ERROR(Sync(ops, "head backward"));
  if (tsp) {
    const TspBlock block(cfg_.block(), comm_);
    for (int64_t l = cfg_.layers - 1; l >= 0; --l) {
      DM_RETURN_IF_ERROR(block.Backward(ops, w.tsp_blocks[l], c.tsp_blocks[l], dx.data(),
                                        dprev.data(), &grads->tsp_blocks[l]));
      dx.swap(dprev);
    }
  } else {
    const TpspBlock block(cfg_.block(), comm_);
    for (int64_t l = cfg_.layers - 1; l >= 0; --l) {
      DM_RETURN_IF_ERROR(block.Backward(ops, w.tpsp_blocks[l], c.tpsp_blocks[l], dx.data(),
                                        dprev.data(), &grads->tpsp_blocks[l]));
      dx.swap(dprev);
    }
  }
  ops.EmbeddingBackward(dx.data(), C, c.tokens.data(), nl, d_embedding);
  if (cfg_.learned_positions) {
    const std::vector<int32_t> ids = TiledPositions(c.positions, c.B);
    ops.EmbeddingBackward(dx.data(), C, ids.data(), nl, d_pos);
  }
  DM_RETURN_IF_ERROR(Sync(ops, "embedding backward"));
  DM_RETURN_IF_ERROR(comm_->AllReduce(partial.data(), static_cast<int64_t>(partial.size())));
  ops.Add(grads->embedding.data(), d_embedding, V * C, grads->embedding.data());
  if (P > 0) ops.Add(grads->pos_embedding.data(), d_pos, P, grads->pos_embedding.data());
  ops.Add(grads->ln_f.data(), d_ln_f, C, grads->ln_f.data());
  if (Hd > 0) ops.Add(grads->head.data(), d_head, Hd, grads->head.data());
  return Sync(ops, "gradient accumulation");
}

absl::StatusOr<ModelGrads> DistributedModel::GatherGrads(const DistributedGrads& grads) const {
  DM_RETURN_IF_ERROR(Validate());
  DM_RETURN_IF_ERROR(CheckShard(grads, "gradient "));
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
      DM_RETURN_IF_ERROR(AllGatherShards(comm_, grads.tsp_blocks[l], &shards));
      absl::StatusOr<BlockWeights> b = UnshardGrads(cfg_.block(), shards);
      if (!b.ok()) return b.status();
      full.blocks[l] = *std::move(b);
    } else {
      std::vector<BlockWeights> shards;
      DM_RETURN_IF_ERROR(AllGatherShards(comm_, grads.tpsp_blocks[l], &shards));
      for (int q = 0; q < D; ++q) {
        DM_RETURN_IF_ERROR(PlaceTpspShardGrads(cfg_.block(), shards[q], D, q, &full.blocks[l]));
      }
    }
  }
  return full;
}

}  // namespace parallel
}  // namespace stallfree
