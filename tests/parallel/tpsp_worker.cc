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

namespace sp = stallfree::parallel;

namespace {

using stallfree::testing::BlockSize;
using stallfree::testing::Compare;
using stallfree::testing::g_rank;
using stallfree::testing::MaxAbs;
using stallfree::testing::RandomNormal;

bool CheckCounters(const sp::Communicator& comm, const std::string& what, int64_t gather_sent_each,
                   bool with_all_reduce, int64_t all_reduce_count) {
  const int d = comm.size(), r = comm.rank();
  const sp::OpCounters got = comm.counters();
  for (int k = 0; k < static_cast<int>(sp::OpKind::kNumKinds); ++k) {
    const sp::OpKind kind = static_cast<sp::OpKind>(k);
    const sp::OpCounter& c = got[k];
    int64_t calls = 0, sent = 0, received = 0;
    if (kind == sp::OpKind::kAllGather || kind == sp::OpKind::kReduceScatter) {
      calls = 2;
      sent = received = 2 * gather_sent_each;
    } else if (kind == sp::OpKind::kAllReduce && with_all_reduce) {
      const int64_t n = all_reduce_count;
      calls = 1;
      sent = 4 * (2 * n - BlockSize(n, d, r) - BlockSize(n, d, (r + 1) % d));
      received = 4 * (2 * n - BlockSize(n, d, (r - 1 + d) % d) - BlockSize(n, d, r));
    }
    if (c.calls != 0 || calls != 0) {
      std::printf("  %s %-14s calls %lld  bytes sent %lld  received %lld (closed form %lld)\n",
                  what.c_str(), sp::OpKindName(kind), static_cast<long long>(c.calls),
                  static_cast<long long>(c.bytes_sent), static_cast<long long>(c.bytes_received),
                  static_cast<long long>(sent));
    }
    CHECK_OR_FAIL(c.calls == calls && c.bytes_sent == sent && c.bytes_received == received, what,
                  " ", sp::OpKindName(kind), ": calls/sent/received ", c.calls, "/", c.bytes_sent,
                  "/", c.bytes_received, ", closed form ", calls, "/", sent, "/", received);
  }
  return true;
}

bool RunCase(sp::Communicator& comm, int64_t B, int64_t T) {
  const int D = comm.size(), p = comm.rank();
  const stallfree::kernels::TransformerOps& ops = stallfree::kernels::CpuOps();
  sp::ModelConfig mc;
  mc.vocab = 1;
  mc.C = 32;
  mc.H = 4;
  mc.FF = 64;
  mc.layers = 1;
  const sp::BlockConfig cfg = mc.block();
  const int64_t C = cfg.C, n = B * T, Tl = T / D, nl = B * Tl;
  const std::string at = absl::StrCat("D=", D, " B=", B, " T=", T);
  std::printf("rank %d: %s\n", p, at.c_str());

  // The same full weights, x and dy on every rank (fixed seeds); larger than the default init
  // so that attention is far from uniform and every gradient is well above the tolerance floor.
  const sp::BlockWeights full = sp::InitModelWeights(mc, 1234, 0.2f, 0.1f).blocks[0];
  const std::vector<float> x = RandomNormal(n * C, 77 + static_cast<uint32_t>(T), 1.0f);
  const std::vector<float> dy = RandomNormal(n * C, 99 + static_cast<uint32_t>(T), 1.0f);

  // Reference on the whole batch.
  std::vector<int32_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(t);
  sp::ReferenceBlock ref(cfg);
  sp::BlockCache ref_cache;
  std::vector<float> y_ref(n * C), dx_ref(n * C);
  sp::BlockGrads g_ref;
  CHECK_OK(ref.Forward(ops, full, x.data(), pos.data(), B, T, y_ref.data(), &ref_cache),
           at + " reference forward");
  CHECK_OK(ref.Backward(ops, full, ref_cache, dy.data(), dx_ref.data(), &g_ref),
           at + " reference backward");

  // This rank's tokens: [p*T/D, (p+1)*T/D) of every row.
  auto local_of = [&](const std::vector<float>& v) {
    std::vector<float> l(nl * C);
    for (int64_t b = 0; b < B; ++b) {
      std::copy(v.begin() + (b * T + p * Tl) * C, v.begin() + (b * T + (p + 1) * Tl) * C,
                l.begin() + b * Tl * C);
    }
    return l;
  };
  const std::vector<float> x_local = local_of(x), dy_local = local_of(dy);
  const std::vector<float> y_ref_local = local_of(y_ref), dx_ref_local = local_of(dx_ref);

  auto shard = sp::ShardTpspWeights(cfg, full, D, p);
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
  // Per all-gather / reduce-scatter of the [B, T, C] activation: 4*B*T*C*(D-1)/D bytes sent.
  const int64_t per_collective = 4 * B * T * C * (D - 1) / D;
  if (!CheckCounters(comm, at + " forward", per_collective, false, 0)) return false;
  comm.ResetCounters();
  CHECK_OK(block.Backward(ops, sp::TpspViewOf(*shard), cache, dy_local.data(), dx.data(),
                          sp::TpspViewOf(&g_shard)),
           at + " backward");
  if (!CheckCounters(comm, at + " backward", per_collective, true, 2 * C)) return false;

  if (!Compare(at + " y", y.data(), y_ref_local.data(), nl * C, MaxAbs(y_ref))) return false;
  if (!Compare(at + " dx", dx.data(), dx_ref_local.data(), nl * C, MaxAbs(dx_ref))) return false;

  // The shard's gradients, placed in the full layout, against the reference's slices: compare
  // the reference sharded the same way.
  auto ref_shard = sp::ShardTpspWeights(cfg, g_ref, D, p);
  CHECK_OK(ref_shard.status(), at + " reference gradient shard");
  const std::vector<const std::vector<float>*> got = std::as_const(g_shard).Tensors();
  const std::vector<const std::vector<float>*> want = std::as_const(*ref_shard).Tensors();
  const std::vector<const std::vector<float>*> want_full = std::as_const(g_ref).Tensors();
  for (size_t i = 0; i < got.size(); ++i) {
    CHECK_OR_FAIL(got[i]->size() == want[i]->size(), at, " d", sp::BlockTensorNames()[i], " size ",
                  got[i]->size(), " want ", want[i]->size());
    if (!Compare(at + " d" + sp::BlockTensorNames()[i], got[i]->data(), want[i]->data(),
                 static_cast<int64_t>(got[i]->size()), MaxAbs(*want_full[i]))) {
      return false;
    }
  }
  // Round trip of the placement helper: the shard placed into a full layout lands on the
  // reference's values in its slices.
  sp::BlockGrads placed;
  CHECK_OK(sp::PlaceTpspShardGrads(cfg, g_shard, D, p, &placed), at + " place");
  auto replaced = sp::ShardTpspWeights(cfg, placed, D, p);
  CHECK_OK(replaced.status(), at + " reshard");
  const std::vector<const std::vector<float>*> back = std::as_const(*replaced).Tensors();
  for (size_t i = 0; i < got.size(); ++i) {
    CHECK_OR_FAIL(*back[i] == *got[i], at, " place/shard round trip of ",
                  sp::BlockTensorNames()[i]);
  }
  return stallfree::testing::CheckViewForm<sp::TpspBlock, sp::TpspCache>(
      at, block, ops, *shard, x_local, dy_local, B, T, y, dx, g_shard);
}

}  // namespace

int main() {
  auto options = sp::CommOptions::FromEnvironment();
  if (!options.ok()) {
    std::fprintf(stderr, "FAIL: %s\n", options.status().ToString().c_str());
    return 1;
  }
  g_rank = options->rank;
  auto comm = sp::NewGlooCommunicator(*options);
  if (!comm.ok()) {
    std::fprintf(stderr, "FAIL rank %d: %s\n", g_rank, comm.status().ToString().c_str());
    return 1;
  }
  for (int64_t T : {16, 32}) {
    if (!RunCase(**comm, 2, T)) return 1;
  }
  std::printf("OK rank %d\n", g_rank);
  return 0;
}
