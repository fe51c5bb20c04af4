// Runs as one rank of a TP+SP group (RANK / WORLD_SIZE / ... from the launcher). For C=32, H=4,
// FF=64, B=2 and T = 16, 32: every rank builds the same full weights, input x and output
// gradient dy from fixed seeds, runs the single-rank ReferenceBlock forward/backward on the
// whole batch (positions 0..T-1), then the TpspBlock on its shard (weights ShardTpspWeights(p),
// tokens [p*T/D, (p+1)*T/D) of each row), and compares:
//   y and dx on its own tokens; its shard's weight gradients against the matching slices of the
//   reference gradients (PlaceTpspShardGrads); the all-reduced ln1/ln2 gradients.
// Tolerance (fp32, different summation orders): |got - ref| <= 1e-5 * max|ref| + 1e-7 per
// tensor (max over the whole reference tensor).
// Communication: the counters after the forward and after the backward must equal the closed
// form of TP+SP on Gloo's ring algorithms, per rank per layer:
//   forward:  all-gather 2 calls, 2 * 4*B*T*C*(D-1)/D bytes sent (and received);
//             reduce-scatter 2 calls, the same bytes; nothing else.
//   backward: the same, plus one all-reduce of 2C floats (sent 4*(2*2C - blk(p) - blk(p+1)),
//             the Gloo ring's closed form, parallel/gloo_communicator.cc).
// The block runs on views (TpspShardView / TpspGradsView): here of host vectors (TpspViewOf),
// then of copies in the backend's buffers (OpsBuffers) on the same host backend, which must give
// bit-identical y, dx and gradients (CheckViewForm, worker_check.h).
// Prints "OK rank p" and exits 0, or the first mismatch and exits 1.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/reference_block.h"
#include "parallel/tpsp_block.h"
#include "tests/parallel/worker_check.h"
#include "tests/parallel/worker_support.h"

namespace sp = stallfree::parallel;
namespace st = stallfree::testing;

namespace {

using st::g_rank;  // this rank, as CHECK_OK and CHECK_OR_FAIL print it

bool RunCase(sp::Communicator& comm, int64_t B, int64_t T) {
  const int D = comm.size(), p = comm.rank();
  const stallfree::kernels::TransformerOps& ops = stallfree::kernels::CpuOps();
  const std::string at = absl::StrCat("D=", D, " B=", B, " T=", T);
  std::printf("rank %d: %s\n", p, at.c_str());
  // The same full weights, x and dy on every rank, and the reference on the whole batch.
  st::TpBlockCase rc;
  if (!st::MakeTpBlockCase(B, T, at, &rc)) return false;
  const sp::BlockConfig& cfg = rc.cfg;
  const int64_t C = cfg.C, Tl = T / D, nl = B * Tl;

  // This rank's tokens: [p*T/D, (p+1)*T/D) of every row.
  auto local_of = [&](const std::vector<float>& v) {
    std::vector<float> l(nl * C);
    for (int64_t b = 0; b < B; ++b) {
      std::copy(v.begin() + (b * T + p * Tl) * C, v.begin() + (b * T + (p + 1) * Tl) * C,
                l.begin() + b * Tl * C);
    }
    return l;
  };
  const std::vector<float> x_local = local_of(rc.x), dy_local = local_of(rc.dy);
  const std::vector<float> y_ref_local = local_of(rc.y_ref), dx_ref_local = local_of(rc.dx_ref);

  auto shard = sp::ShardTpspWeights(cfg, rc.full, D, p);
  CHECK_OK(shard.status(), at + " shard");
  sp::TpspBlock block(cfg, &comm);
  sp::TpspCache cache;
  std::vector<float> y(nl * C), dx(nl * C);
  sp::BlockGrads g_shard;
  CHECK_OK(comm.Barrier(), at + " barrier");
  comm.ResetCounters();
  CHECK_OK(sp::SizeTpspGrads(cfg, D, &g_shard), at + " gradient shapes");
  CHECK_OK(block.Forward(ops, sp::TpspViewOf(*shard), x_local.data(), B, T, y.data(), &cache),
           at + " forward");
  // Per all-gather / reduce-scatter of the [B, T, C] activation: 4*B*T*C*(D-1)/D bytes sent
  // (two calls of each kind).
  const int64_t per_collective = 4 * B * T * C * (D - 1) / D;
  if (!st::CheckCounters(comm, at + " forward",
                         st::TpLayerExpects(comm, 2 * per_collective, false, C))) {
    return false;
  }
  comm.ResetCounters();
  CHECK_OK(block.Backward(ops, sp::TpspViewOf(*shard), cache, dy_local.data(), dx.data(),
                          sp::TpspViewOf(&g_shard)),
           at + " backward");
  if (!st::CheckCounters(comm, at + " backward",
                         st::TpLayerExpects(comm, 2 * per_collective, true, C))) {
    return false;
  }

  if (!st::Compare(at + " y", y.data(), y_ref_local.data(), nl * C, st::MaxAbs(rc.y_ref))) {
    return false;
  }
  if (!st::Compare(at + " dx", dx.data(), dx_ref_local.data(), nl * C, st::MaxAbs(rc.dx_ref))) {
    return false;
  }

  // The shard's gradients, placed in the full layout, against the reference's slices: compare
  // the reference sharded the same way.
  if (!st::CompareTpShardGrads(at, rc, g_shard, D, p)) return false;
  // Round trip of the placement helper: the shard placed into a full layout lands on the
  // reference's values in its slices.
  sp::BlockGrads placed;
  CHECK_OK(sp::PlaceTpspShardGrads(cfg, g_shard, D, p, &placed), at + " place");
  auto replaced = sp::ShardTpspWeights(cfg, placed, D, p);
  CHECK_OK(replaced.status(), at + " reshard");
  const std::vector<const std::vector<float>*> got = std::as_const(g_shard).Tensors();
  const std::vector<const std::vector<float>*> back = std::as_const(*replaced).Tensors();
  for (size_t i = 0; i < got.size(); ++i) {
    CHECK_OR_FAIL(*back[i] == *got[i], at, " place/shard round trip of ",
                  sp::BlockTensorNames()[i]);
  }
  return st::CheckViewForm<sp::TpspBlock, sp::TpspCache>(
      at, block, ops, *shard, x_local, dy_local, B, T, y, dx, g_shard);
}

}  // namespace

int main() {
  const std::unique_ptr<sp::Communicator> comm = st::JoinGlooGroup();
  if (comm == nullptr) return 1;
  for (int64_t T : {16, 32}) {
    if (!RunCase(*comm, 2, T)) return 1;
  }
  std::printf("OK rank %d\n", g_rank);
  return 0;
}
