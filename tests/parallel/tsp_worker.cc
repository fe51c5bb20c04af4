// Runs as one rank of a TSP group (RANK / WORLD_SIZE / ... from the launcher). Every rank builds
// the same full block weights, input and output gradient from fixed seeds, runs the single-rank
// ReferenceBlock forward / backward on the whole batch, then the TspBlock on its zigzag shard,
// and compares: y and dx at its own positions, its weight shard's gradients (after the ring /
// reduce) and the all-reduced ln1 / ln2 gradients, each within 1e-5 x max |reference| of that
// tensor (fp32; the sums run in different orders). Also checks the sharding round trip and the
// communicator's all-gather / recv byte counts against the closed forms, and prints the counters.
// For T = 16 and T = 32 with B = 2, and T = 16 with B = 1 (C = 32, H = 4, FF = 64). Prints "OK rank r" and exits 0, or the
// first mismatch and exits 1.
#include <unistd.h>

#include <algorithm>
#include <chrono>
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
#include "parallel/tsp_block.h"
#include "parallel/zigzag.h"
#include "tests/parallel/worker_check.h"
#include "tests/parallel/worker_support.h"

namespace sp = stallfree::parallel;

namespace {

using stallfree::testing::Compare;
using stallfree::testing::g_rank;
using stallfree::testing::RandomNormal;

// fp32 with the sums in different orders: 1e-5 x max |reference| of the compared tensor.
constexpr stallfree::testing::Tolerance kTol{1e-5, 0.0};

bool RunCase(sp::Communicator& comm, int64_t T, int64_t B) {
  const int64_t D = comm.size(), p = comm.rank();
  const int64_t C = 32, H = 4, FF = 64, Tl = T / D, nl = B * Tl;
  const std::string at = absl::StrCat("T=", T, " B=", B);
  const sp::ModelConfig mcfg{/*vocab=*/8, C, H, FF, /*layers=*/1};
  const sp::BlockConfig cfg = mcfg.block();
  const auto& ops = stallfree::kernels::CpuOps();
  // Large enough weights that attention is far from uniform; jittered norms.
  const sp::BlockWeights w = sp::InitModelWeights(mcfg, 1234, 0.15f, 0.2f).blocks[0];
  const std::vector<float> x = RandomNormal(B * T * C, 77 + static_cast<uint32_t>(T), 1.0f);
  const std::vector<float> dy = RandomNormal(B * T * C, 99 + static_cast<uint32_t>(T), 1.0f);

  // The reference on the full batch.
  std::vector<int32_t> pos(T);
  for (int64_t i = 0; i < T; ++i) pos[i] = static_cast<int32_t>(i);
  const sp::ReferenceBlock ref(cfg);
  sp::BlockCache rcache;
  std::vector<float> y(B * T * C), dx(B * T * C);
  sp::BlockGrads rgrads;
  CHECK_OK(ref.Forward(ops, w, x.data(), pos.data(), B, T, y.data(), &rcache), at + " ref fwd");
  CHECK_OK(ref.Backward(ops, w, rcache, dy.data(), dx.data(), &rgrads), at + " ref bwd");

  // Sharding round trip (every rank's shards are computed locally; small).
  std::vector<sp::TspShard> all;
  for (int64_t q = 0; q < D; ++q) {
    auto s = sp::ShardBlockWeights(cfg, w, D, q);
    CHECK_OK(s.status(), at + " shard");
    all.push_back(*std::move(s));
  }
  auto back = sp::UnshardGrads(cfg, all);
  CHECK_OK(back.status(), at + " unshard");
  for (size_t i = 0; i < w.Tensors().size(); ++i) {
    CHECK_OR_FAIL(*back->Tensors()[i] == *w.Tensors()[i], at, " unshard round trip of ",
                  sp::BlockTensorNames()[i]);
  }

  // TSP on this rank's zigzag shard.
  std::vector<float> x_local(nl * C), dy_local(nl * C), y_want(nl * C), dx_want(nl * C);
  CHECK_OK(sp::ZigzagScatter(x.data(), B, T, C, D, p, x_local.data()), at + " scatter x");
  CHECK_OK(sp::ZigzagScatter(dy.data(), B, T, C, D, p, dy_local.data()), at + " scatter dy");
  CHECK_OK(sp::ZigzagScatter(y.data(), B, T, C, D, p, y_want.data()), at + " scatter y");
  CHECK_OK(sp::ZigzagScatter(dx.data(), B, T, C, D, p, dx_want.data()), at + " scatter dx");
  const sp::TspBlock block(cfg, &comm);
  sp::TspCache cache;
  std::vector<float> y_local(nl * C), dx_local(nl * C);
  sp::TspShardGrads grads;
  comm.ResetCounters();
  CHECK_OK(block.Forward(ops, all[p], x_local.data(), B, T, y_local.data(), &cache),
           at + " tsp forward");
  const sp::OpCounters fwd = comm.counters();
  comm.ResetCounters();
  CHECK_OK(block.Backward(ops, all[p], cache, dy_local.data(), dx_local.data(), &grads),
           at + " tsp backward");
  const sp::OpCounters bwd = comm.counters();

  if (!Compare(at + " y", y_local, y_want, kTol)) return false;
  if (!Compare(at + " dx", dx_local, dx_want, kTol)) return false;
  auto want = sp::ShardBlockWeights(cfg, rgrads, D, p);
  CHECK_OK(want.status(), at + " shard reference grads");
  if (!Compare(at + " dln1", grads.ln1, want->ln1, kTol)) return false;
  if (!Compare(at + " dln2", grads.ln2, want->ln2, kTol)) return false;
  if (!Compare(at + " dWqkvo", grads.attn, want->attn, kTol)) return false;
  if (!Compare(at + " dWgud", grads.mlp, want->mlp, kTol)) return false;

  // The backend-memory form (TspShardView / TspGradsView, cache in OpsBuffers) through the same
  // host backend: the same operations in the same order, so bit-identical results, accumulated
  // twice into gradients that start from the first pass's values.
  {
    namespace k = stallfree::kernels;
    using stallfree::testing::Download;
    using stallfree::testing::Upload;
    const sp::TspShard& sh = all[p];
    const k::OpsBuffer ln1 = Upload(ops, sh.ln1), ln2 = Upload(ops, sh.ln2),
                       attn = Upload(ops, sh.attn), mlp = Upload(ops, sh.mlp);
    const k::OpsBuffer gln1 = Upload(ops, grads.ln1), gln2 = Upload(ops, grads.ln2),
                       gattn = Upload(ops, grads.attn), gmlp = Upload(ops, grads.mlp);
    const k::OpsBuffer bx = Upload(ops, x_local), bdy = Upload(ops, dy_local), by(&ops, nl * C),
                       bdx(&ops, nl * C);
    const sp::TspShardView wv{ln1.data(), ln2.data(), attn.data(), mlp.data()};
    const sp::TspGradsView gv{gln1.data(), gln2.data(), gattn.data(), gmlp.data()};
    sp::TspCache vcache;
    CHECK_OK(block.Forward(ops, wv, bx.data(), B, T, by.data(), &vcache), at + " view forward");
    CHECK_OR_FAIL(vcache.buffers != nullptr && vcache.x.empty(), at, " view cache not in buffers");
    CHECK_OK(block.Backward(ops, wv, vcache, bdy.data(), bdx.data(), gv), at + " view backward");
    const std::vector<float> vy = Download(ops, by), vdx = Download(ops, bdx);
    CHECK_OR_FAIL(vy == y_local, at, " view forward y differs from the vector form");
    CHECK_OR_FAIL(vdx == dx_local, at, " view backward dx differs from the vector form");
    const std::pair<const k::OpsBuffer*, const std::vector<float>*> g2[4] = {
        {&gln1, &grads.ln1}, {&gln2, &grads.ln2}, {&gattn, &grads.attn}, {&gmlp, &grads.mlp}};
    for (const auto& [buf, first] : g2) {
      const std::vector<float> got = Download(ops, *buf);
      for (size_t i = 0; i < got.size(); ++i) {
        const float want2 = (*first)[i] + (*first)[i];
        CHECK_OR_FAIL(got[i] == want2, at, " view gradient [", i, "] = ", got[i], ", want ",
                      want2);
      }
    }
    // A vector-form backward from a view-form cache.
    sp::TspShardGrads g3;
    std::vector<float> dx3(nl * C);
    CHECK_OK(block.Backward(ops, sh, vcache, dy_local.data(), dx3.data(), &g3),
             at + " vector backward from a view cache");
    CHECK_OR_FAIL(dx3 == dx_local && g3.mlp == grads.mlp && g3.attn == grads.attn, at,
                  " vector backward from a view cache differs");
  }

  // Byte counts: the forward all-gathers D K|V shards of nl 2C/D floats (a ring: this rank
  // receives the D-1 other blocks), and receives D-1 MLP shards of 3 FF C / D floats; the
  // backward repeats the all-gathers and receives D-1 weight and D-1 gradient shards.
  const auto get = [](const sp::OpCounters& c, sp::OpKind k) { return c[static_cast<size_t>(k)]; };
  const int64_t kv_bytes = 4 * nl * 2 * (C / D), mlp_bytes = 4 * 3 * (FF / D) * C;
  CHECK_OR_FAIL(get(fwd, sp::OpKind::kAllGather).bytes_received == D * (D - 1) * kv_bytes, at,
                " forward all-gather received ", get(fwd, sp::OpKind::kAllGather).bytes_received);
  CHECK_OR_FAIL(get(fwd, sp::OpKind::kRecv).bytes_received == (D - 1) * mlp_bytes, at,
                " forward recv ", get(fwd, sp::OpKind::kRecv).bytes_received);
  CHECK_OR_FAIL(get(bwd, sp::OpKind::kAllGather).bytes_received == D * (D - 1) * kv_bytes, at,
                " backward all-gather received ", get(bwd, sp::OpKind::kAllGather).bytes_received);
  CHECK_OR_FAIL(get(bwd, sp::OpKind::kRecv).bytes_received == 2 * (D - 1) * mlp_bytes, at,
                " backward recv ", get(bwd, sp::OpKind::kRecv).bytes_received);
  for (int pass = 0; pass < 2; ++pass) {
    const sp::OpCounters& c = pass == 0 ? fwd : bwd;
    for (size_t k = 0; k < c.size(); ++k) {
      if (c[k].calls == 0) continue;
      std::printf("rank %d %s %s %-14s calls %3lld sent %8lld B received %8lld B\n", g_rank,
                  at.c_str(), pass == 0 ? "fwd" : "bwd", sp::OpKindName(static_cast<sp::OpKind>(k)),
                  static_cast<long long>(c[k].calls), static_cast<long long>(c[k].bytes_sent),
                  static_cast<long long>(c[k].bytes_received));
    }
  }
  return true;
}

// STALLFREE_TEST_DIE_RANK=k: rank k exits abruptly after joining the group; every other rank
// runs a TSP forward, which must fail (not hang) with UNAVAILABLE or DEADLINE_EXCEEDED naming
// the operation. Survivors exit 7 when they saw that error, 1 otherwise.
int RunDeath(sp::Communicator& comm, int die_rank) {
  const int64_t B = 2, C = 32, H = 4, FF = 64, T = 16, D = comm.size(), p = comm.rank();
  const sp::ModelConfig mcfg{/*vocab=*/8, C, H, FF, /*layers=*/1};
  const sp::BlockConfig cfg = mcfg.block();
  const sp::BlockWeights w = sp::InitModelWeights(mcfg, 1234, 0.15f, 0.2f).blocks[0];
  auto shard = sp::ShardBlockWeights(cfg, w, D, p);
  if (!shard.ok()) return 1;
  if (!comm.Barrier().ok()) return 1;
  if (p == die_rank) _exit(3);
  std::vector<float> x(B * (T / D) * C, 0.5f), y(x.size());
  const sp::TspBlock block(cfg, &comm);
  sp::TspCache cache;
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status st;
  // Several steps, so the dead rank is noticed whichever operation reaches it first.
  for (int i = 0; i < 4 && st.ok(); ++i) {
    st = block.Forward(stallfree::kernels::CpuOps(), *shard, x.data(), B, T, y.data(), &cache);
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("rank %d: after %.2f s: %s\n", g_rank, secs, st.ToString().c_str());
  std::fflush(stdout);
  const bool clear = absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st);
  return clear ? 7 : 1;
}

}  // namespace

int main() {
  const std::unique_ptr<sp::Communicator> comm = stallfree::testing::JoinGlooGroup();
  if (comm == nullptr) return 1;
  if (const char* die = std::getenv("STALLFREE_TEST_DIE_RANK"); die != nullptr) {
    return RunDeath(*comm, std::atoi(die));
  }
  for (int64_t T : {16, 32}) {
    if (!RunCase(*comm, T, /*B=*/2)) return 1;
  }
  // One batch row: attention reads the gathered K|V in place (no relayout copy).
  if (!RunCase(*comm, 16, /*B=*/1)) return 1;
  std::printf("OK rank %d\n", g_rank);
  std::fflush(stdout);
  return 0;
}
