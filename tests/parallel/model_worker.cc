// Runs as one rank of a group (RANK / WORLD_SIZE / ... from the launcher). For each layout (TSP,
// TP+SP) and each combination of the model's options (learned positions with max_seq 20 > T, a
// tied head): every rank builds the same full model weights (InitModelWeights, fixed seed; vocab
// 50, C 32, H 4, FF 64, 2 layers), tokens and targets [B=2, T=16] (a few targets -1 = ignored),
// runs the single-rank ReferenceModel forward / backward on the whole batch (natural order,
// positions 0..T-1), then the DistributedModel, and checks:
//   - the loss equals the reference's within 1e-6 relative, and is bit-identical on every rank;
//   - every gradient: the replicated embedding / pos_embedding / ln_f / head fully (no head when
//     tied), and this rank's block shards
//     against the reference's gradients sharded the same way, each within
//     1e-5 x max|reference| + 1e-7; then GatherGrads' full ModelGrads against every reference
//     tensor with the same tolerance (and each reference tensor non-zero: no vacuous check);
//   - a batch with every target ignored gives loss 0 and zero gradients on every rank;
//   - bad arguments (T not divisible, a token out of range, T > max_seq with learned positions)
//     give InvalidArgument on every rank;
//   - the view form (DistributedShardView / DistributedGradsView on uploaded copies, cache in
//     OpsBuffers) on the same CpuOps is bit-identical to the vector form: the loss and every
//     gradient; a second view backward from the same cache doubles every gradient exactly; a
//     vector backward from the view cache reproduces the gradients; the view backward refuses a
//     vector cache; every target ignored gives loss 0 and leaves the gradients 0.
// Prints "OK rank r" and exits 0, or the first mismatch and exits 1.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/distributed_model.h"
#include "parallel/reference_block.h"
#include "parallel/tpsp_block.h"
#include "parallel/tsp_block.h"
#include "tests/parallel/model_buffers.h"
#include "tests/parallel/worker_check.h"
#include "tests/parallel/worker_support.h"

namespace sp = stallfree::parallel;

namespace {

using stallfree::testing::Compare;
using stallfree::testing::g_rank;
using stallfree::testing::MaxAbs;

constexpr double kLossRelTol = 1e-6;

// The loss of every rank, as hi / lo floats (exact), must be bitwise equal.
bool CheckSameOnAllRanks(sp::Communicator& comm, double loss, const std::string& what) {
  const int D = comm.size();
  const float hi = static_cast<float>(loss);
  const float send[2] = {hi, static_cast<float>(loss - static_cast<double>(hi))};
  std::vector<float> recv(2 * D);
  CHECK_OK(comm.AllGather(send, recv.data(), 2), what + " all-gather loss");
  for (int q = 0; q < D; ++q) {
    CHECK_OR_FAIL(std::memcmp(&recv[2 * q], send, sizeof(send)) == 0, what, ": rank ", q, " loss ",
                  static_cast<double>(recv[2 * q]) + recv[2 * q + 1], " vs ", loss);
  }
  return true;
}

// got == factor x want element for element (factor 1 or 2: x + x is exact), every tensor.
bool SameGrads(const std::string& what, const sp::DistributedGrads& got,
               const sp::DistributedGrads& want, int factor) {
  const auto g = stallfree::testing::NamedTensors(got), w = stallfree::testing::NamedTensors(want);
  CHECK_OR_FAIL(g.size() == w.size(), what, ": ", g.size(), " tensors, want ", w.size());
  for (size_t t = 0; t < w.size(); ++t) {
    CHECK_OR_FAIL(g[t].first == w[t].first && g[t].second->size() == w[t].second->size(), what,
                  ": tensor ", g[t].first, " vs ", w[t].first);
    for (size_t i = 0; i < w[t].second->size(); ++i) {
      const float x = (*w[t].second)[i], want_i = factor == 2 ? x + x : x;
      CHECK_OR_FAIL((*g[t].second)[i] == want_i, what, ": d", w[t].first, " [", i,
                    "] = ", (*g[t].second)[i], ", want ", want_i);
    }
  }
  return true;
}

// The view form on CpuOps against the vector form's loss and gradients (see the top comment).
bool CheckModelViewForm(const std::string& at, const sp::DistributedModel& model,
                        const sp::DistributedShard& shard, const sp::DistributedCache& vector_cache,
                        const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets,
                        int64_t B, int64_t T, double loss, const sp::DistributedGrads& grads) {
  using stallfree::testing::ModelBuffers;
  const auto& ops = stallfree::kernels::CpuOps();
  const ModelBuffers w = ModelBuffers::Upload(ops, shard);
  const ModelBuffers g = ModelBuffers::Upload(ops, stallfree::testing::ZerosLike(grads));
  CHECK_OR_FAIL((w.view().pos_embedding != nullptr) == model.config().learned_positions &&
                    (w.view().head == nullptr) == model.config().tied_head,
                at, " view pointers do not follow the config");
  sp::DistributedCache cache;
  auto vloss = model.Forward(ops, w.view(), tokens.data(), targets.data(), B, T, &cache);
  CHECK_OK(vloss.status(), at + " view forward");
  CHECK_OR_FAIL(*vloss == loss, at, " view loss ", *vloss, " vs vector form ", loss);
  CHECK_OR_FAIL(cache.valid == vector_cache.valid, at, " view valid ", cache.valid);
  CHECK_OR_FAIL(cache.buffers != nullptr && cache.x_final.empty() && cache.logits.empty(), at,
                " view cache not in buffers");
  for (const sp::TspCache& b : cache.tsp_blocks) {
    CHECK_OR_FAIL(b.buffers != nullptr, at, " view tsp block cache not in buffers");
  }
  for (const sp::TpspCache& b : cache.tpsp_blocks) {
    CHECK_OR_FAIL(b.buffers != nullptr, at, " view tpsp block cache not in buffers");
  }
  CHECK_OK(model.Backward(ops, w.view(), cache, g.grads()), at + " view backward");
  if (!SameGrads(at + " view gradients", g.Download(ops), grads, 1)) return false;
  CHECK_OK(model.Backward(ops, w.view(), cache, g.grads()), at + " second view backward");
  if (!SameGrads(at + " view gradients after two backwards", g.Download(ops), grads, 2)) {
    return false;
  }
  sp::DistributedGrads from_view;
  CHECK_OK(model.Backward(ops, shard, cache, &from_view), at + " vector backward, view cache");
  if (!SameGrads(at + " vector backward from a view cache", from_view, grads, 1)) return false;
  const absl::Status refused = model.Backward(ops, w.view(), vector_cache, g.grads());
  CHECK_OR_FAIL(refused.code() == absl::StatusCode::kInvalidArgument, at,
                " view backward from a vector cache: ", refused.ToString());

  // Every target ignored.
  const std::vector<int32_t> none(targets.size(), -1);
  const ModelBuffers g0 = ModelBuffers::Upload(ops, stallfree::testing::ZerosLike(grads));
  sp::DistributedCache c0;
  auto l0 = model.Forward(ops, w.view(), tokens.data(), none.data(), B, T, &c0);
  CHECK_OK(l0.status(), at + " view forward, no targets");
  CHECK_OR_FAIL(*l0 == 0.0 && c0.valid == 0, at, " view, no targets: loss ", *l0);
  CHECK_OK(model.Backward(ops, w.view(), c0, g0.grads()), at + " view backward, no targets");
  if (!SameGrads(at + " view, no targets", g0.Download(ops), stallfree::testing::ZerosLike(grads),
                 1)) {
    return false;
  }
  std::printf("rank %d %s view form: bit-identical to the vector form\n", g_rank, at.c_str());
  return true;
}

bool RunLayout(sp::Communicator& comm, sp::Layout layout, bool learned_positions, bool tied_head) {
  const int D = comm.size(), p = comm.rank();
  const auto& ops = stallfree::kernels::CpuOps();
  const int64_t B = 2, T = 16, n = B * T;
  sp::ModelConfig cfg;
  cfg.vocab = 50;
  cfg.C = 32;
  cfg.H = 4;
  cfg.FF = 64;
  cfg.layers = 2;
  cfg.learned_positions = learned_positions;
  cfg.max_seq = 20;  // Rows 16..19 unused: their gradient must stay 0 on every rank.
  cfg.tied_head = tied_head;
  const sp::BlockConfig bcfg = cfg.block();
  const std::string at =
      absl::StrCat(sp::LayoutName(layout), " D=", D, learned_positions ? " learned_pos" : "",
                   tied_head ? " tied" : "");
  std::printf("rank %d: %s\n", p, at.c_str());

  // Larger than the default init so that attention is far from uniform and every gradient is
  // well above the tolerance floor; jittered norms.
  const sp::ModelWeights full = sp::InitModelWeights(cfg, 4321, 0.2f, 0.1f);
  std::mt19937 rng(99);
  std::vector<int32_t> tokens(n), targets(n);
  for (int64_t i = 0; i < n; ++i) tokens[i] = static_cast<int32_t>(rng() % cfg.vocab);
  for (int64_t i = 0; i < n; ++i) targets[i] = static_cast<int32_t>(rng() % cfg.vocab);
  for (int64_t i : {3, 10, 16, 29}) targets[i] = -1;

  // The reference on the whole batch.
  const sp::ReferenceModel ref(cfg);
  sp::ModelCache rcache;
  auto ref_loss = ref.Forward(ops, full, tokens.data(), targets.data(), B, T, nullptr, &rcache);
  CHECK_OK(ref_loss.status(), at + " reference forward");
  sp::ModelGrads rgrads;
  CHECK_OK(ref.Backward(ops, full, rcache, &rgrads), at + " reference backward");

  // The distributed model.
  const sp::DistributedModel model(cfg, layout, &comm);
  auto shard = model.Shard(full);
  CHECK_OK(shard.status(), at + " shard");
  sp::DistributedCache cache;
  auto loss = model.Forward(ops, *shard, tokens.data(), targets.data(), B, T, &cache);
  CHECK_OK(loss.status(), at + " forward");
  const double rel = std::fabs(*loss - *ref_loss) / std::fabs(*ref_loss);
  CHECK_OR_FAIL(rel <= kLossRelTol, at, " loss ", *loss, " vs reference ", *ref_loss, " (rel ", rel,
                ")");
  CHECK_OR_FAIL(cache.valid == rcache.valid, at, " valid ", cache.valid, " vs ", rcache.valid);
  std::printf("rank %d %s loss %.9f reference %.9f (%.2e rel)\n", p, at.c_str(), *loss, *ref_loss,
              rel);
  if (!CheckSameOnAllRanks(comm, *loss, at + " loss")) return false;

  sp::DistributedGrads grads;
  CHECK_OK(model.Backward(ops, *shard, cache, &grads), at + " backward");

  if (!CheckModelViewForm(at, model, *shard, cache, tokens, targets, B, T, *loss, grads)) {
    return false;
  }

  // Replicated tensors fully.
  if (!Compare(at + " dembedding", grads.embedding, rgrads.embedding, MaxAbs(rgrads.embedding)) ||
      !Compare(at + " dln_f", grads.ln_f, rgrads.ln_f, MaxAbs(rgrads.ln_f))) {
    return false;
  }
  if (learned_positions) {
    CHECK_OR_FAIL(rgrads.pos_embedding.size() == static_cast<size_t>(cfg.max_seq * cfg.C), at,
                  " reference pos_embedding gradient size ", rgrads.pos_embedding.size());
    if (!Compare(at + " dpos_embedding", grads.pos_embedding, rgrads.pos_embedding,
                 MaxAbs(rgrads.pos_embedding))) {
      return false;
    }
  } else {
    CHECK_OR_FAIL(grads.pos_embedding.empty(), at, " a pos_embedding gradient without positions");
  }
  if (tied_head) {
    CHECK_OR_FAIL(grads.head.empty() && shard->head.empty(), at, " a head in a tied model");
  } else if (!Compare(at + " dhead", grads.head, rgrads.head, MaxAbs(rgrads.head))) {
    return false;
  }
  // This rank's block shards against the reference's gradients sharded alike.
  for (int64_t l = 0; l < cfg.layers; ++l) {
    const std::string bl = absl::StrCat(at, " block", l);
    if (layout == sp::Layout::kTsp) {
      CHECK_OR_FAIL(grads.tsp_blocks.size() == static_cast<size_t>(cfg.layers), bl, " blocks");
      auto want = sp::ShardBlockWeights(bcfg, rgrads.blocks[l], D, p);
      CHECK_OK(want.status(), bl + " shard reference");
      const sp::TspShard& got = grads.tsp_blocks[l];
      if (!Compare(bl + ".dln1", got.ln1, want->ln1, MaxAbs(want->ln1)) ||
          !Compare(bl + ".dln2", got.ln2, want->ln2, MaxAbs(want->ln2)) ||
          !Compare(bl + ".dattn", got.attn, want->attn, MaxAbs(want->attn)) ||
          !Compare(bl + ".dmlp", got.mlp, want->mlp, MaxAbs(want->mlp))) {
        return false;
      }
    } else {
      CHECK_OR_FAIL(grads.tpsp_blocks.size() == static_cast<size_t>(cfg.layers), bl, " blocks");
      auto want = sp::ShardTpspWeights(bcfg, rgrads.blocks[l], D, p);
      CHECK_OK(want.status(), bl + " shard reference");
      const auto got_t = std::as_const(grads.tpsp_blocks[l]).Tensors();
      const auto want_t = std::as_const(*want).Tensors();
      const auto full_t = std::as_const(rgrads.blocks[l]).Tensors();
      for (size_t i = 0; i < got_t.size(); ++i) {
        if (!Compare(bl + ".d" + sp::BlockTensorNames()[i], *got_t[i], *want_t[i],
                     MaxAbs(*full_t[i]))) {
          return false;
        }
      }
    }
  }
  // Every rank's shards reassembled, against the whole reference.
  auto gathered = model.GatherGrads(grads);
  CHECK_OK(gathered.status(), at + " gather grads");
  const std::vector<std::string> names = sp::ModelTensorNames(cfg);
  const auto got_all = std::as_const(*gathered).Tensors();
  const auto want_all = std::as_const(rgrads).Tensors();
  CHECK_OR_FAIL(got_all.size() == want_all.size(), at, " gathered tensor count");
  for (size_t i = 0; i < want_all.size(); ++i) {
    if (!Compare(at + " full d" + names[i], *got_all[i], *want_all[i], MaxAbs(*want_all[i]))) {
      return false;
    }
  }

  // Every target ignored: loss 0, zero gradients, on every rank.
  {
    const std::vector<int32_t> none(n, -1);
    sp::DistributedCache c0;
    auto l0 = model.Forward(ops, *shard, tokens.data(), none.data(), B, T, &c0);
    CHECK_OK(l0.status(), at + " forward, no targets");
    CHECK_OR_FAIL(*l0 == 0.0 && c0.valid == 0, at, " no targets: loss ", *l0, " valid ", c0.valid);
    sp::DistributedGrads g0;
    CHECK_OK(model.Backward(ops, *shard, c0, &g0), at + " backward, no targets");
    auto full0 = model.GatherGrads(g0);
    CHECK_OK(full0.status(), at + " gather, no targets");
    for (const std::vector<float>* t : std::as_const(*full0).Tensors()) {
      CHECK_OR_FAIL(MaxAbs(*t) == 0.0, at, " no targets: a non-zero gradient");
    }
  }

  // Bad arguments fail on every rank before any communication.
  {
    auto bad_t = model.Forward(ops, *shard, tokens.data(), targets.data(), B, 15, nullptr);
    if (layout == sp::Layout::kTsp || D > 1) {
      CHECK_OR_FAIL(bad_t.status().code() == absl::StatusCode::kInvalidArgument, at,
                    " T=15: ", bad_t.status().ToString());
    }
    std::vector<int32_t> bad_tokens = tokens;
    bad_tokens[5] = static_cast<int32_t>(cfg.vocab);
    auto bad_id = model.Forward(ops, *shard, bad_tokens.data(), targets.data(), B, T, nullptr);
    CHECK_OR_FAIL(bad_id.status().code() == absl::StatusCode::kInvalidArgument, at,
                  " token = vocab: ", bad_id.status().ToString());
    if (learned_positions) {
      // T = 32 divides for every D here, but positions 20..31 have no table row.
      const std::vector<int32_t> long_tokens(2 * n, 1), long_targets(2 * n, 2);
      auto too_long =
          model.Forward(ops, *shard, long_tokens.data(), long_targets.data(), B, 2 * T, nullptr);
      CHECK_OR_FAIL(too_long.status().code() == absl::StatusCode::kInvalidArgument, at,
                    " T=32 > max_seq: ", too_long.status().ToString());
    }
  }
  // The group is still in step: one more all-gather of the loss.
  return CheckSameOnAllRanks(comm, *loss, at + " loss after the error cases");
}

}  // namespace

int main() {
  const std::unique_ptr<sp::Communicator> comm = stallfree::testing::JoinGlooGroup();
  if (comm == nullptr) return 1;
  for (sp::Layout layout : {sp::Layout::kTsp, sp::Layout::kTpsp}) {
    for (bool learned_positions : {false, true}) {
      for (bool tied_head : {false, true}) {
        if (!RunLayout(*comm, layout, learned_positions, tied_head)) return 1;
      }
    }
  }
  std::printf("OK rank %d\n", g_rank);
  std::fflush(stdout);
  return 0;
}
