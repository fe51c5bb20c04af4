#include "tests/parallel/worker_support.h"

#include <cstdio>
#include <utility>

#include "kernels/ops.h"
#include "parallel/tpsp_block.h"
#include "tests/parallel/worker_check.h"

namespace stallfree {
namespace testing {

namespace sp = parallel;

std::optional<sp::CommOptions> RankOptions() {
  auto options = sp::CommOptions::FromEnvironment();
  if (!options.ok()) {
    std::fprintf(stderr, "FAIL: %s\n", options.status().ToString().c_str());
    return std::nullopt;
  }
  g_rank = options->rank;
  return *std::move(options);
}

std::unique_ptr<sp::Communicator> JoinGlooGroup() {
  const std::optional<sp::CommOptions> options = RankOptions();
  if (!options) return nullptr;
  auto comm = sp::NewGlooCommunicator(*options);
  if (!comm.ok()) {
    std::fprintf(stderr, "FAIL rank %d: %s\n", g_rank, comm.status().ToString().c_str());
    return nullptr;
  }
  return *std::move(comm);
}

OpExpect AllReduceExpect(const sp::Communicator& comm, int64_t n) {
  const int d = comm.size(), r = comm.rank();
  OpExpect e;
  e.calls = 1;
  if (d > 1) {
    e.sent = 4 * (2 * n - BlockSize(n, d, r) - BlockSize(n, d, (r + 1) % d));
    e.received = 4 * (2 * n - BlockSize(n, d, (r - 1 + d) % d) - BlockSize(n, d, r));
  }
  return e;
}

OpExpects TpLayerExpects(const sp::Communicator& tp, int64_t bytes, bool backward, int64_t C) {
  OpExpects e = {{sp::OpKind::kAllGather, {2, bytes, bytes}},
                 {sp::OpKind::kReduceScatter, {2, bytes, bytes}}};
  if (backward) e.push_back({sp::OpKind::kAllReduce, AllReduceExpect(tp, 2 * C)});
  return e;
}

bool CheckCounters(const sp::Communicator& comm, const std::string& what, const OpExpects& want) {
  const sp::OpCounters got = comm.counters();
  for (int k = 0; k < static_cast<int>(sp::OpKind::kNumKinds); ++k) {
    const sp::OpKind kind = static_cast<sp::OpKind>(k);
    const sp::OpCounter& c = got[k];
    OpExpect e;
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

bool MakeTpBlockCase(int64_t B, int64_t T, const std::string& at, TpBlockCase* c) {
  const kernels::TransformerOps& ops = kernels::CpuOps();
  c->model.vocab = 1;
  c->model.C = 32;
  c->model.H = 4;
  c->model.FF = 64;
  c->model.layers = 1;
  c->cfg = c->model.block();
  const int64_t C = c->cfg.C, n = B * T;
  c->full = sp::InitModelWeights(c->model, 1234, 0.2f, 0.1f).blocks[0];
  c->x = RandomNormal(n * C, 77 + static_cast<uint32_t>(T), 1.0f);
  c->dy = RandomNormal(n * C, 99 + static_cast<uint32_t>(T), 1.0f);

  std::vector<int32_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(t);
  const sp::ReferenceBlock ref(c->cfg);
  sp::BlockCache ref_cache;
  c->y_ref.assign(n * C, 0.0f);
  c->dx_ref.assign(n * C, 0.0f);
  c->g_ref = sp::BlockGrads();
  CHECK_OK(ref.Forward(ops, c->full, c->x.data(), pos.data(), B, T, c->y_ref.data(), &ref_cache),
           at + " reference forward");
  CHECK_OK(ref.Backward(ops, c->full, ref_cache, c->dy.data(), c->dx_ref.data(), &c->g_ref),
           at + " reference backward");
  return true;
}

bool CompareTpShardGrads(const std::string& at, const TpBlockCase& c,
                         const sp::BlockGrads& g_shard, int parts, int index) {
  auto ref_shard = sp::ShardTpspWeights(c.cfg, c.g_ref, parts, index);
  CHECK_OK(ref_shard.status(), at + " reference gradient shard");
  const std::vector<const std::vector<float>*> got = g_shard.Tensors();
  const std::vector<const std::vector<float>*> want = std::as_const(*ref_shard).Tensors();
  const std::vector<const std::vector<float>*> want_full = c.g_ref.Tensors();
  for (size_t f = 0; f < got.size(); ++f) {
    CHECK_OR_FAIL(got[f]->size() == want[f]->size(), at, " d", sp::BlockTensorNames()[f], " size ",
                  got[f]->size(), " want ", want[f]->size());
    if (!Compare(at + " d" + sp::BlockTensorNames()[f], got[f]->data(), want[f]->data(),
                 static_cast<int64_t>(got[f]->size()), MaxAbs(*want_full[f]))) {
      return false;
    }
  }
  return true;
}

}  // namespace testing
}  // namespace stallfree
