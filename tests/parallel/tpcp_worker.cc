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

namespace sp = stallfree::parallel;

namespace {

using stallfree::testing::BlockSize;
using stallfree::testing::Compare;
using stallfree::testing::g_rank;
using stallfree::testing::MaxAbs;
using stallfree::testing::RandomNormal;

// Expected calls / sent / received of one op kind.
struct Expect {
  int64_t calls = 0, sent = 0, received = 0;
};
using Expects = std::vector<std::pair<sp::OpKind, Expect>>;

// Ring all-reduce of n floats over comm's group (parallel/gloo_communicator.cc's closed form).
Expect AllReduceExpect(const sp::Communicator& comm, int64_t n) {
  const int d = comm.size(), r = comm.rank();
  Expect e;
  e.calls = 1;
  if (d > 1) {
    e.sent = 4 * (2 * n - BlockSize(n, d, r) - BlockSize(n, d, (r + 1) % d));
    e.received = 4 * (2 * n - BlockSize(n, d, (r - 1 + d) % d) - BlockSize(n, d, r));
  }
  return e;
}

bool CheckCounters(const sp::Communicator& comm, const std::string& what, const Expects& want) {
  const sp::OpCounters got = comm.counters();
  for (int k = 0; k < static_cast<int>(sp::OpKind::kNumKinds); ++k) {
    const sp::OpKind kind = static_cast<sp::OpKind>(k);
    const sp::OpCounter& c = got[k];
    Expect e;
    for (const auto& [wk, we] : want) {
      if (wk == kind) e = we;
    }
    if (c.calls != 0 || e.calls != 0) {
      std::printf("  %s %-14s calls %lld  bytes sent %lld  received %lld (closed form %lld/%lld)\n",
                  what.c_str(), sp::OpKindName(kind), static_cast<long long>(c.calls),
                  static_cast<long long>(c.bytes_sent), static_cast<long long>(c.bytes_received),
                  static_cast<long long>(e.sent), static_cast<long long>(e.received));
    }
    CHECK_OR_FAIL(c.calls == e.calls && c.bytes_sent == e.sent && c.bytes_received == e.received,
                  what, " ", sp::OpKindName(kind), ": calls/sent/received ", c.calls, "/",
                  c.bytes_sent, "/", c.bytes_received, ", closed form ", e.calls, "/", e.sent, "/",
                  e.received);
  }
  return true;
}

bool RunCase(sp::TpcpGroups& g, int64_t B, int64_t T) {
  const int t = g.tp_degree, c = g.cp_degree, i = g.tp_index, j = g.cp_index;
  const stallfree::kernels::TransformerOps& ops = stallfree::kernels::CpuOps();
  sp::ModelConfig mc;
  mc.vocab = 1;
  mc.C = 32;
  mc.H = 4;
  mc.FF = 64;
  mc.layers = 1;
  const sp::BlockConfig cfg = mc.block();
  const int64_t C = cfg.C, n = B * T, Tl = T / c / t, nl = B * Tl;
  const std::string at = absl::StrCat("t=", t, " c=", c, " B=", B, " T=", T);
  std::printf("rank %d (tp %d, cp %d): %s\n", g_rank, i, j, at.c_str());

  // The same full weights, x and dy on every rank (fixed seeds; as tpsp_worker).
  const sp::BlockWeights full = sp::InitModelWeights(mc, 1234, 0.2f, 0.1f).blocks[0];
  const std::vector<float> x = RandomNormal(n * C, 77 + static_cast<uint32_t>(T), 1.0f);
  const std::vector<float> dy = RandomNormal(n * C, 99 + static_cast<uint32_t>(T), 1.0f);

  // Reference on the whole batch.
  std::vector<int32_t> pos(T);
  for (int64_t s = 0; s < T; ++s) pos[s] = static_cast<int32_t>(s);
  sp::ReferenceBlock ref(cfg);
  sp::BlockCache ref_cache;
  std::vector<float> y_ref(n * C), dx_ref(n * C);
  sp::BlockGrads g_ref;
  CHECK_OK(ref.Forward(ops, full, x.data(), pos.data(), B, T, y_ref.data(), &ref_cache),
           at + " reference forward");
  CHECK_OK(ref.Backward(ops, full, ref_cache, dy.data(), dx_ref.data(), &g_ref),
           at + " reference backward");

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
  const std::vector<float> x_local = local_of(x), dy_local = local_of(dy);
  const std::vector<float> y_ref_local = local_of(y_ref), dx_ref_local = local_of(dx_ref);

  auto shard = sp::ShardTpspWeights(cfg, full, t, i);
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
  const Expects tp_fwd = {{sp::OpKind::kAllGather, {2, tp_bytes, tp_bytes}},
                          {sp::OpKind::kReduceScatter, {2, tp_bytes, tp_bytes}}};
  const Expects cp_fwd = {{sp::OpKind::kAllGather, {1, kv_bytes, kv_bytes}}};
  if (!CheckCounters(*g.tp, at + " forward tp", tp_fwd)) return false;
  if (!CheckCounters(*g.cp, at + " forward cp", cp_fwd)) return false;
  g.tp->ResetCounters();
  g.cp->ResetCounters();
  CHECK_OK(block.Backward(ops, sp::TpspViewOf(*shard), cache, dy_local.data(), dx.data(),
                          sp::TpspViewOf(&g_shard)),
           at + " backward");
  Expects tp_bwd = tp_fwd;
  tp_bwd.push_back({sp::OpKind::kAllReduce, AllReduceExpect(*g.tp, 2 * C)});
  const Expects cp_bwd = {{sp::OpKind::kReduceScatter, {1, kv_bytes, kv_bytes}},
                          {sp::OpKind::kAllReduce, AllReduceExpect(*g.cp, n_w)}};
  if (!CheckCounters(*g.tp, at + " backward tp", tp_bwd)) return false;
  if (!CheckCounters(*g.cp, at + " backward cp", cp_bwd)) return false;

  if (!Compare(at + " y", y.data(), y_ref_local.data(), nl * C, MaxAbs(y_ref))) return false;
  if (!Compare(at + " dx", dx.data(), dx_ref_local.data(), nl * C, MaxAbs(dx_ref))) return false;

  // The shard's gradients against the reference's gradients sharded the same way.
  auto ref_shard = sp::ShardTpspWeights(cfg, g_ref, t, i);
  CHECK_OK(ref_shard.status(), at + " reference gradient shard");
  const std::vector<const std::vector<float>*> got = std::as_const(g_shard).Tensors();
  const std::vector<const std::vector<float>*> want = std::as_const(*ref_shard).Tensors();
  const std::vector<const std::vector<float>*> want_full = std::as_const(g_ref).Tensors();
  for (size_t f = 0; f < got.size(); ++f) {
    CHECK_OR_FAIL(got[f]->size() == want[f]->size(), at, " d", sp::BlockTensorNames()[f], " size ",
                  got[f]->size(), " want ", want[f]->size());
    if (!Compare(at + " d" + sp::BlockTensorNames()[f], got[f]->data(), want[f]->data(),
                 static_cast<int64_t>(got[f]->size()), MaxAbs(*want_full[f]))) {
      return false;
    }
  }
  return stallfree::testing::CheckViewForm<sp::TpcpBlock, sp::TpcpCache>(
      at, block, ops, *shard, x_local, dy_local, B, T, y, dx, g_shard);
}

}  // namespace

int main(int argc, char** argv) {
  auto options = sp::CommOptions::FromEnvironment();
  if (!options.ok()) {
    std::fprintf(stderr, "FAIL: %s\n", options.status().ToString().c_str());
    return 1;
  }
  g_rank = options->rank;
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
