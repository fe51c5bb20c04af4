// The GPT model (DistributedModel) in device memory: CUDA ops and the NCCL communicator against
// the CPU ReferenceModel. Without RANK/WORLD_SIZE in the environment this is the parent: it
// prints "SKIP: ..." and exits 0 without a usable device, otherwise runs D = min(4, device count)
// ranks as child processes of itself and fails if any child fails (nccl_worker.h). A child, on
// device LOCAL_RANK with one stream for its CUDA ops and its NCCL communicator, runs for each
// layout (TSP, TP+SP) and each model option (learned positions, tied head) a 2-layer model
// (vocab 64, C 96, H 12, FF 192, max_seq 64; B 2, T 48, a few targets ignored): it uploads its
// shard (DistributedModel::Shard of the same full weights on every rank), runs the view-form
// Forward / Backward on the device with zeroed device gradients, downloads them and compares
//   - the loss with the single-rank CPU reference's, within 1e-4 relative, and bit-identical
//     on every rank;
//   - every gradient: the replicated embedding / pos_embedding / ln_f / head fully, and this
//     rank's block shards against the reference's gradients sharded the same way, each within
//     1e-4 x max |reference| of its tensor (kDeviceTolerance: GPU fp32 GEMMs sum in another
//     order).
// Prints a line per tensor, then "PASS: rank r ..." or the first mismatch ("FAIL ...").
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/distributed_model.h"
#include "parallel/reference_block.h"
#include "parallel/tpsp_block.h"
#include "parallel/tsp_block.h"
#include "tests/parallel/model_buffers.h"
#include "tests/parallel/nccl_worker.h"
#include "tests/parallel/worker_check.h"

namespace stallfree {
namespace parallel {
namespace {

using testing::Compare;
using testing::g_rank;
using testing::kDeviceTolerance;
using testing::ModelBuffers;
using testing::NamedTensors;

// The loss of every rank, as hi / lo floats (exact), must be bitwise equal (over the host
// bootstrap communicator).
bool SameLossOnAllRanks(Communicator* gloo, double loss, const std::string& what) {
  const int D = gloo->size();
  const float hi = static_cast<float>(loss);
  const float send[2] = {hi, static_cast<float>(loss - static_cast<double>(hi))};
  std::vector<float> recv(2 * D);
  CHECK_OK(gloo->AllGather(send, recv.data(), 2), what + " all-gather loss");
  for (int q = 0; q < D; ++q) {
    CHECK_OR_FAIL(std::memcmp(&recv[2 * q], send, sizeof(send)) == 0, what, ": rank ", q, " loss ",
                  static_cast<double>(recv[2 * q]) + recv[2 * q + 1], " vs ", loss);
  }
  return true;
}

bool CheckModel(const kernels::TransformerOps& ops, Communicator* nccl, Communicator* gloo,
                Layout layout, bool learned_positions, bool tied_head) {
  const int D = nccl->size(), p = nccl->rank();
  const int64_t B = 2, T = 48, n = B * T;  // T divisible by 2D for D = 1..4
  ModelConfig cfg;
  cfg.vocab = 64;
  cfg.C = 96;
  cfg.H = 12;
  cfg.FF = 192;
  cfg.layers = 2;
  cfg.learned_positions = learned_positions;
  cfg.max_seq = 64;  // rows 48..63 unused: their gradient must stay 0
  cfg.tied_head = tied_head;
  const std::string at =
      absl::StrCat(LayoutName(layout), " D=", D, learned_positions ? " learned_pos" : "",
                   tied_head ? " tied" : "");
  std::printf("rank %d: %s\n", p, at.c_str());

  const ModelWeights full = InitModelWeights(cfg, 4321, 0.2f, 0.1f);
  std::mt19937 rng(99);
  std::vector<int32_t> tokens(n), targets(n);
  for (int64_t i = 0; i < n; ++i) tokens[i] = static_cast<int32_t>(rng() % cfg.vocab);
  for (int64_t i = 0; i < n; ++i) targets[i] = static_cast<int32_t>(rng() % cfg.vocab);
  for (int64_t i : {3, 10, 47, 60}) targets[i] = -1;

  // The single-rank reference on the CPU, the whole batch.
  const ReferenceModel ref(cfg);
  ModelCache rcache;
  const kernels::TransformerOps& cpu = kernels::CpuOps();
  absl::StatusOr<double> ref_loss =
      ref.Forward(cpu, full, tokens.data(), targets.data(), B, T, nullptr, &rcache);
  CHECK_OK(ref_loss.status(), at + " reference forward");
  ModelGrads rgrads;
  CHECK_OK(ref.Backward(cpu, full, rcache, &rgrads), at + " reference backward");

  // The reference's gradients in this rank's shard layout.
  const DistributedModel model(cfg, layout, nccl);
  absl::StatusOr<DistributedShard> shard = model.Shard(full);
  CHECK_OK(shard.status(), at + " shard");
  DistributedGrads want;
  want.embedding = rgrads.embedding;
  want.pos_embedding = rgrads.pos_embedding;
  want.ln_f = rgrads.ln_f;
  want.head = rgrads.head;
  for (const BlockGrads& b : rgrads.blocks) {
    if (layout == Layout::kTsp) {
      absl::StatusOr<TspShard> s = ShardBlockWeights(cfg.block(), b, D, p);
      CHECK_OK(s.status(), at + " shard reference gradients");
      want.tsp_blocks.push_back(*std::move(s));
    } else {
      absl::StatusOr<BlockWeights> s = ShardTpspWeights(cfg.block(), b, D, p);
      CHECK_OK(s.status(), at + " shard reference gradients");
      want.tpsp_blocks.push_back(*std::move(s));
    }
  }
  // The full reference tensors, for max |reference| of the sharded ones.
  std::vector<std::pair<std::string, double>> ref_max;
  {
    DistributedGrads full_want = want;
    for (size_t l = 0; l < rgrads.blocks.size(); ++l) {
      if (layout == Layout::kTsp) {
        absl::StatusOr<TspShard> s = ShardBlockWeights(cfg.block(), rgrads.blocks[l], 1, 0);
        CHECK_OK(s.status(), at + " unsharded reference gradients");
        full_want.tsp_blocks[l] = *std::move(s);
      } else {
        full_want.tpsp_blocks[l] = rgrads.blocks[l];
      }
    }
    for (const auto& [name, t] : NamedTensors(full_want)) {
      ref_max.emplace_back(name, testing::MaxAbs(*t));
    }
  }

  // The model on the device.
  bool ok = true;
  {
    const ModelBuffers w = ModelBuffers::Upload(ops, *shard);
    const ModelBuffers g = ModelBuffers::Upload(ops, testing::ZerosLike(want));
    const std::string up = ops.Synchronize();
    CHECK_OR_FAIL(up.empty(), at, " upload: ", up);
    DistributedCache cache;
    absl::StatusOr<double> loss =
        model.Forward(ops, w.view(), tokens.data(), targets.data(), B, T, &cache);
    CHECK_OK(loss.status(), at + " forward");
    CHECK_OK(model.Backward(ops, w.view(), cache, g.grads()), at + " backward");
    const DistributedGrads got = g.Download(ops);
    const std::string down = ops.Synchronize();
    CHECK_OR_FAIL(down.empty(), at, " download: ", down);

    const double rel = std::fabs(*loss - *ref_loss) / std::fabs(*ref_loss);
    std::printf("rank %d %s loss %.9f reference %.9f (%.2e rel)\n", p, at.c_str(), *loss, *ref_loss,
                rel);
    CHECK_OR_FAIL(rel <= kDeviceTolerance.rel, at, " loss ", *loss, " vs reference ", *ref_loss,
                  " (rel ", rel, ")");
    CHECK_OR_FAIL(cache.valid == rcache.valid, at, " valid ", cache.valid, " vs ", rcache.valid);
    if (!SameLossOnAllRanks(gloo, *loss, at + " loss")) return false;

    const auto got_t = NamedTensors(got), want_t = NamedTensors(want);
    CHECK_OR_FAIL(got_t.size() == want_t.size() && want_t.size() == ref_max.size(), at,
                  " tensor count ", got_t.size(), " vs ", want_t.size());
    for (size_t i = 0; i < want_t.size(); ++i) {
      ok = Compare(at + " d" + want_t[i].first, *got_t[i].second, *want_t[i].second,
                   ref_max[i].second, kDeviceTolerance) &&
           ok;
    }
    CHECK_OK(nccl->Barrier(), at + " nccl barrier");
  }
  return ok;
}

bool Check(const CommOptions&, Communicator* gloo, const testing::DeviceRank& dev,
           const testing::NcclReference&) {
  absl::StatusOr<std::unique_ptr<Communicator>> nccl = dev.Nccl(gloo);
  CHECK_OK(nccl.status(), "nccl communicator");
  bool ok = true;
  for (Layout layout : {Layout::kTsp, Layout::kTpsp}) {
    for (bool learned_positions : {false, true}) {
      for (bool tied_head : {false, true}) {
        ok = CheckModel(dev.ops(), nccl->get(), gloo, layout, learned_positions, tied_head) && ok;
      }
    }
  }
  return ok;
}

}  // namespace
}  // namespace parallel
}  // namespace stallfree

int main() {
  if (!stallfree::testing::IsNcclChild()) return stallfree::testing::RunNcclParent("model");
  return stallfree::testing::RunNcclChild(stallfree::parallel::Check);
}
