// Runs as one rank of a t x c TP x CP grid (RANK / WORLD_SIZE / STALLFREE_STORE_DIR from the
// launcher; argv[1] = t, c = WORLD_SIZE / t). Builds the TP and CP groups (NewGlooTpcpGroups);
// for C=32, H=4, FF=64, B=2 and T = 16, 32: every rank builds the same full weights, input x and
// output gradient dy from fixed seeds, runs the single-rank ReferenceBlock forward/backward on
// the whole batch (positions 0..T-1), then the TpcpBlock on its shard (weights
// ShardTpspWeights(t, tp_index), tokens TpcpPositions(T, t, c, tp_index, cp_index) of each row)
// and compares: y and dx on its own tokens; its shard's weight gradients against the matching
// slices of the reference gradients; the ln1/ln2 gradients (full sums).
// Tolerance (fp32, different summation orders): |got - ref| <= 1e-5 * max|ref| + 1e-7 per
// tensor (max over the whole reference tensor).
// Communication: both groups' counters after the forward and after the backward must equal the
// closed form of parallel/tpcp_block.h on Gloo's ring algorithms, per rank per layer
// (N_tp = B*(T/c)*C, N_kv = B*(T/c)*2C/t, N_w = 2C + 4C*C/t + 3C*FF/t floats):
//   TP forward:  all-gather 2 calls and reduce-scatter 2 calls, each 2 * 4*N_tp*(t-1)/t bytes
//                sent (and received); nothing else.
//   CP forward:  all-gather 1 call, 4*N_kv*(c-1) bytes; nothing else.
//   TP backward: as forward, plus all-reduce 1 call of 2C floats (ring: sends
//                4*(2n - blk(r) - blk(r+1)), receives 4*(2n - blk(r-1) - blk(r))).
//   CP backward: reduce-scatter 1 call, 4*N_kv*(c-1) bytes; all-reduce 1 call of N_w floats.
// The block runs on views (TpspShardView / TpspGradsView): here of host vectors (TpspViewOf),
// then of copies in the backend's buffers (OpsBuffers) on the same host backend, which must give
// bit-identical y, dx and gradients (CheckViewForm, worker_check.h).
// Prints "OK rank p" and exits 0, or the first mismatch and exits 1.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/reference_block.h"
#include "parallel/tpcp_block.h"
#include "parallel/tpsp_block.h"
#include "tests/parallel/worker_check.h"
#include "tests/parallel/worker_support.h"

namespace sp = stallfree::parallel;
namespace st = stallfree::testing;

namespace {

using st::g_rank;  // this rank, as CHECK_OK and CHECK_OR_FAIL print it

bool RunCase(sp::TpcpGroups& g, int64_t B, int64_t T) {
  const int t = g.tp_degree, c = g.cp_degree, i = g.tp_index, j = g.cp_index;
  const stallfree::kernels::TransformerOps& ops = stallfree::kernels::CpuOps();
  const std::string at = absl::StrCat("t=", t, " c=", c, " B=", B, " T=", T);
  std::printf("rank %d (tp %d, cp %d): %s\n", g_rank, i, j, at.c_str());
  // The same full weights, x and dy on every rank, and the reference on the whole batch (as
  // tpsp_worker).
  st::TpBlockCase rc;
  if (!st::MakeTpBlockCase(B, T, at, &rc)) return false;
  const sp::BlockConfig& cfg = rc.cfg;
  const int64_t C = cfg.C, Tl = T / c / t, nl = B * Tl;

  // This rank's tokens: the positions TpcpPositions gives, of every row.
  auto my_pos = sp::TpcpPositions(T, t, c, i, j);
  CHECK_OK(my_pos.status(), at + " positions");
  CHECK_OR_FAIL(static_cast<int64_t>(my_pos->size()) == Tl, at, " positions size");
  auto local_of = [&](const std::vector<float>& v) {
    std::vector<float> l(nl * C);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t s = 0; s < Tl; ++s) {
        std::copy(v.begin() + (b * T + (*my_pos)[s]) * C,
                  v.begin() + (b * T + (*my_pos)[s] + 1) * C, l.begin() + (b * Tl + s) * C);
      }
    }
    return l;
  };
  const std::vector<float> x_local = local_of(rc.x), dy_local = local_of(rc.dy);
  const std::vector<float> y_ref_local = local_of(rc.y_ref), dx_ref_local = local_of(rc.dx_ref);

  auto shard = sp::ShardTpspWeights(cfg, rc.full, t, i);
  CHECK_OK(shard.status(), at + " shard");
  sp::TpcpBlock block(cfg, g.tp.get(), g.cp.get());
  sp::TpcpCache cache;
  std::vector<float> y(nl * C), dx(nl * C);
  sp::BlockGrads g_shard;
  CHECK_OK(g.tp->Barrier(), at + " tp barrier");
  CHECK_OK(g.cp->Barrier(), at + " cp barrier");
  g.tp->ResetCounters();
  g.cp->ResetCounters();
  CHECK_OK(sp::SizeTpspGrads(cfg, t, &g_shard), at + " gradient shapes");
  CHECK_OK(block.Forward(ops, sp::TpspViewOf(*shard), x_local.data(), B, T, y.data(), &cache),
           at + " forward");

  const int64_t n_tp = B * (T / c) * C, n_kv = B * (T / c) * 2 * C / t;
  const int64_t n_w = 2 * C + 4 * C * C / t + 3 * C * cfg.FF / t;
  const int64_t tp_bytes = 2 * 4 * n_tp * (t - 1) / t;  // two calls
  const int64_t kv_bytes = 4 * n_kv * (c - 1);
  const st::OpExpects cp_fwd = {{sp::OpKind::kAllGather, {1, kv_bytes, kv_bytes}}};
  if (!st::CheckCounters(*g.tp, at + " forward tp",
                         st::TpLayerExpects(*g.tp, tp_bytes, false, C))) {
    return false;
  }
  if (!st::CheckCounters(*g.cp, at + " forward cp", cp_fwd)) return false;
  g.tp->ResetCounters();
  g.cp->ResetCounters();
  CHECK_OK(block.Backward(ops, sp::TpspViewOf(*shard), cache, dy_local.data(), dx.data(),
                          sp::TpspViewOf(&g_shard)),
           at + " backward");
  const st::OpExpects cp_bwd = {{sp::OpKind::kReduceScatter, {1, kv_bytes, kv_bytes}},
                                {sp::OpKind::kAllReduce, st::AllReduceExpect(*g.cp, n_w)}};
  if (!st::CheckCounters(*g.tp, at + " backward tp",
                         st::TpLayerExpects(*g.tp, tp_bytes, true, C))) {
    return false;
  }
  if (!st::CheckCounters(*g.cp, at + " backward cp", cp_bwd)) return false;

  if (!st::Compare(at + " y", y.data(), y_ref_local.data(), nl * C, st::MaxAbs(rc.y_ref))) {
    return false;
  }
  if (!st::Compare(at + " dx", dx.data(), dx_ref_local.data(), nl * C, st::MaxAbs(rc.dx_ref))) {
    return false;
  }

  // The shard's gradients against the reference's gradients sharded the same way.
  if (!st::CompareTpShardGrads(at, rc, g_shard, t, i)) return false;
  return st::CheckViewForm<sp::TpcpBlock, sp::TpcpCache>(
      at, block, ops, *shard, x_local, dy_local, B, T, y, dx, g_shard);
}

}  // namespace

int main(int argc, char** argv) {
  const std::optional<sp::CommOptions> options = st::RankOptions();
  if (!options) return 1;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s TP_DEGREE (CP degree = WORLD_SIZE / TP_DEGREE)\n", argv[0]);
    return 2;
  }
  const int t = std::atoi(argv[1]);
  auto groups = sp::NewGlooTpcpGroups(*options, t);
  if (!groups.ok()) {
    std::fprintf(stderr, "FAIL rank %d: %s\n", g_rank, groups.status().ToString().c_str());
    return 1;
  }
  for (int64_t T : {16, 32}) {
    if (!RunCase(*groups, 2, T)) return 1;
  }
  std::printf("OK rank %d\n", g_rank);
  return 0;
}
