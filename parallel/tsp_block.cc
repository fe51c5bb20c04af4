#include "parallel/tsp_block.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "parallel/zigzag.h"

namespace stallfree {
namespace parallel {
namespace {

using kernels::AttentionShape;
using kernels::Trans;
using kernels::TransformerOps;

#define TSP_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status tsp_status_ = (expr);       \
    if (!tsp_status_.ok()) return tsp_status_; \
  } while (0)

// Point-to-point tags of the MLP rings.
constexpr int kTagFwdWeights = 101;
constexpr int kTagBwdWeights = 102;
constexpr int kTagBwdGrads = 103;

// Waits on every started operation when it goes out of scope, so that an early error return
// never leaves the communicator using a buffer that is being freed. Declare it after the
// buffers its operations use.
class WorkDrain {
 public:
  WorkDrain() = default;
  WorkDrain(const WorkDrain&) = delete;
  WorkDrain& operator=(const WorkDrain&) = delete;
  ~WorkDrain() {
    for (auto& w : works_) w->Wait().IgnoreError();
  }
  std::shared_ptr<Work> Add(std::shared_ptr<Work> w) {
    works_.push_back(w);
    return w;
  }

 private:
  std::vector<std::shared_ptr<Work>> works_;
};

absl::Status WaitIfSet(std::shared_ptr<Work>* w) {
  if (*w == nullptr) return absl::OkStatus();
  absl::Status s = (*w)->Wait();
  *w = nullptr;
  return s;
}

// The sizes of one rank's tensors.
struct Dims {
  Dims(const BlockConfig& cfg, int64_t D)
      : C(cfg.C),
        H(cfg.H),
        FF(cfg.FF),
        D(D),
        Ch(cfg.C / D),
        F(cfg.FF / D),
        Hd(cfg.H / D),
        hd(cfg.C / cfg.H) {}
  int64_t C, H, FF, D, Ch, F, Hd, hd;
  int64_t attn() const { return 4 * C * Ch; }
  int64_t mlp() const { return 3 * F * C; }
};

absl::Status CheckSize(const std::vector<float>& v, int64_t want, const char* name) {
  if (static_cast<int64_t>(v.size()) != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("tsp: ", name, " has ", v.size(), " elements, want ", want));
  }
  return absl::OkStatus();
}

absl::Status CheckShard(const Dims& d, const TspShard& w, const char* what) {
  TSP_RETURN_IF_ERROR(CheckSize(w.ln1, d.C, absl::StrCat(what, " ln1").c_str()));
  TSP_RETURN_IF_ERROR(CheckSize(w.ln2, d.C, absl::StrCat(what, " ln2").c_str()));
  TSP_RETURN_IF_ERROR(CheckSize(w.attn, d.attn(), absl::StrCat(what, " attn").c_str()));
  return CheckSize(w.mlp, d.mlp(), absl::StrCat(what, " mlp").c_str());
}

// y[rows, out] = x[rows, in] W^T + beta y, W [out, in] with row stride ldw.
void Linear(const TransformerOps& ops, const float* x, int64_t ldx, const float* w, int64_t ldw,
            int64_t rows, int64_t out, int64_t in, float beta, float* y, int64_t ldy) {
  ops.Gemm(Trans::kNo, Trans::kYes, rows, out, in, 1.0f, x, ldx, w, ldw, beta, y, ldy);
}

// kv [nl, 2Ch] := the k|v columns of qkv [nl, 3Ch].
void PackKv(const float* qkv, int64_t nl, int64_t Ch, float* kv) {
  for (int64_t i = 0; i < nl; ++i) {
    std::memcpy(kv + i * 2 * Ch, qkv + i * 3 * Ch + Ch,
                static_cast<size_t>(2 * Ch) * sizeof(float));
  }
}

// Between the all-gather layout [D][B][Tl][w] (rank major) and the sequence layout
// [B][D Tl][w] (batch major; within a row, rank q's tokens at q Tl..). to_seq selects the
// direction.
void Relayout(const float* src, int64_t D, int64_t B, int64_t Tl, int64_t w, bool to_seq,
              float* dst) {
  const size_t bytes = static_cast<size_t>(Tl * w) * sizeof(float);
  for (int64_t q = 0; q < D; ++q) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t rank_major = (q * B + b) * Tl * w, seq = (b * D + q) * Tl * w;
      if (to_seq) {
        std::memcpy(dst + seq, src + rank_major, bytes);
      } else {
        std::memcpy(dst + rank_major, src + seq, bytes);
      }
    }
  }
}

absl::Status PrepareGrad(std::vector<float>* g, int64_t want, const char* name) {
  if (g->empty()) g->assign(static_cast<size_t>(want), 0.0f);
  return CheckSize(*g, want, name);
}

void AddInto(const float* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

}  // namespace

absl::Status CheckTspConfig(const BlockConfig& cfg, int64_t D) {
  TSP_RETURN_IF_ERROR(ValidateBlockConfig(cfg));
  if (D < 1 || cfg.H % D != 0 || cfg.FF % D != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tsp: D=", D, " must be >= 1 and divide H=", cfg.H, " and FF=", cfg.FF));
  }
  return absl::OkStatus();
}

TspShard TspShard::Zeros(const BlockConfig& cfg, int64_t D) {
  const Dims d(cfg, D);
  TspShard s;
  s.ln1.assign(static_cast<size_t>(d.C), 0.0f);
  s.ln2.assign(static_cast<size_t>(d.C), 0.0f);
  s.attn.assign(static_cast<size_t>(d.attn()), 0.0f);
  s.mlp.assign(static_cast<size_t>(d.mlp()), 0.0f);
  return s;
}

absl::StatusOr<TspShard> ShardBlockWeights(const BlockConfig& cfg, const BlockWeights& full,
                                           int64_t D, int64_t p) {
  TSP_RETURN_IF_ERROR(CheckTspConfig(cfg, D));
  TSP_RETURN_IF_ERROR(CheckBlockWeights(cfg, full));
  if (p < 0 || p >= D) {
    return absl::InvalidArgumentError(absl::StrCat("tsp: rank ", p, " not in [0, ", D, ")"));
  }
  const Dims d(cfg, D);
  TspShard s = TspShard::Zeros(cfg, D);
  s.ln1 = full.ln1;
  s.ln2 = full.ln2;
  const int64_t rows = d.Ch * d.C;  // one of Wq_p, Wk_p, Wv_p
  const std::vector<float>* qkv[3] = {&full.wq, &full.wk, &full.wv};
  for (int i = 0; i < 3; ++i) {
    std::copy_n(qkv[i]->data() + p * rows, rows, s.attn.data() + i * rows);
  }
  float* wo = s.attn.data() + 3 * rows;
  for (int64_t i = 0; i < d.C; ++i) {
    std::copy_n(full.wo.data() + i * d.C + p * d.Ch, d.Ch, wo + i * d.Ch);
  }
  const int64_t fc = d.F * d.C;
  std::copy_n(full.wg.data() + p * fc, fc, s.mlp.data());
  std::copy_n(full.wu.data() + p * fc, fc, s.mlp.data() + fc);
  float* wd = s.mlp.data() + 2 * fc;
  for (int64_t i = 0; i < d.C; ++i) {
    std::copy_n(full.wd.data() + i * d.FF + p * d.F, d.F, wd + i * d.F);
  }
  return s;
}

absl::StatusOr<BlockWeights> UnshardGrads(const BlockConfig& cfg,
                                          absl::Span<const TspShard> shards) {
  const int64_t D = static_cast<int64_t>(shards.size());
  TSP_RETURN_IF_ERROR(CheckTspConfig(cfg, D));
  const Dims d(cfg, D);
  for (const TspShard& s : shards) TSP_RETURN_IF_ERROR(CheckShard(d, s, "shard"));
  BlockWeights full = BlockWeights::Zeros(cfg);
  full.ln1 = shards[0].ln1;
  full.ln2 = shards[0].ln2;
  const int64_t rows = d.Ch * d.C, fc = d.F * d.C;
  std::vector<float>* qkv[3] = {&full.wq, &full.wk, &full.wv};
  for (int64_t p = 0; p < D; ++p) {
    const TspShard& s = shards[p];
    for (int i = 0; i < 3; ++i) {
      std::copy_n(s.attn.data() + i * rows, rows, qkv[i]->data() + p * rows);
    }
    const float* wo = s.attn.data() + 3 * rows;
    for (int64_t i = 0; i < d.C; ++i) {
      std::copy_n(wo + i * d.Ch, d.Ch, full.wo.data() + i * d.C + p * d.Ch);
    }
    std::copy_n(s.mlp.data(), fc, full.wg.data() + p * fc);
    std::copy_n(s.mlp.data() + fc, fc, full.wu.data() + p * fc);
    const float* wd = s.mlp.data() + 2 * fc;
    for (int64_t i = 0; i < d.C; ++i) {
      std::copy_n(wd + i * d.F, d.F, full.wd.data() + i * d.FF + p * d.F);
    }
  }
  return full;
}

absl::Status TspBlock::Forward(const TransformerOps& ops, const TspShard& w, const float* x_local,
                               int64_t B, int64_t T, float* y_local, TspCache* cache) const {
  if (comm_ == nullptr) return absl::InvalidArgumentError("tsp: null communicator");
  const int64_t D = comm_->size(), p = comm_->rank();
  TSP_RETURN_IF_ERROR(CheckTspConfig(cfg_, D));
  const Dims d(cfg_, D);
  TSP_RETURN_IF_ERROR(CheckShard(d, w, "weights"));
  TSP_RETURN_IF_ERROR(CheckZigzag(T, D, p));
  if (B <= 0) return absl::InvalidArgumentError(absl::StrCat("tsp: B=", B, " must be > 0"));
  if (x_local == nullptr || y_local == nullptr) {
    return absl::InvalidArgumentError("tsp: null x_local or y_local");
  }
  const int64_t C = d.C, Ch = d.Ch, F = d.F, Tl = T / D, nl = B * Tl;
  TspCache scratch;
  TspCache& c = cache != nullptr ? *cache : scratch;
  c.B = B;
  c.T = T;
  {
    absl::StatusOr<std::vector<int32_t>> q_pos = ZigzagPositions(T, D, p);
    if (!q_pos.ok()) return q_pos.status();
    absl::StatusOr<std::vector<int32_t>> k_pos = ZigzagOrder(T, D);
    if (!k_pos.ok()) return k_pos.status();
    c.q_pos = *std::move(q_pos);
    c.k_pos = *std::move(k_pos);
  }
  c.x.assign(x_local, x_local + nl * C);
  c.n1.resize(nl * C);
  c.rstd1.resize(nl);
  c.qkv.resize(D * nl * 3 * Ch);
  c.att.resize(D * nl * Ch);
  c.lse.resize(D * B * d.Hd * Tl);
  c.h.resize(nl * C);
  c.n2.resize(nl * C);
  c.rstd2.resize(nl);
  c.g.resize(D * nl * F);
  c.u.resize(D * nl * F);
  c.m.resize(D * nl * F);

  // ---- Attention: broadcast head shards, all-gather K|V. ----
  ops.RmsNormForward(x_local, w.ln1.data(), nl, C, cfg_.eps, c.n1.data(), c.rstd1.data());
  const int64_t wa = d.attn();
  std::vector<float> wbuf(2 * wa), kv_send(nl * 2 * Ch), kv_recv(D * nl * 2 * Ch);
  std::vector<float> kv(B * T * 2 * Ch);
  WorkDrain drain;
  auto start_broadcast = [&](int64_t r) {
    float* buf = wbuf.data() + (r % 2) * wa;
    if (r == p) std::copy(w.attn.begin(), w.attn.end(), buf);
    return drain.Add(comm_->IBroadcast(buf, wa, static_cast<int>(r)));
  };
  AttentionShape s;
  s.batch = B;
  s.tq = Tl;
  s.tk = T;
  s.heads = d.Hd;
  s.head_dim = d.hd;
  s.q_ld = 3 * Ch;
  s.k_ld = s.v_ld = 2 * Ch;
  s.out_ld = Ch;
  std::shared_ptr<Work> next = start_broadcast(0);
  for (int64_t r = 0; r < D; ++r) {
    TSP_RETURN_IF_ERROR(WaitIfSet(&next));
    const float* wr = wbuf.data() + (r % 2) * wa;  // Wq|Wk|Wv [3Ch, C], then Wo [C, Ch]
    float* qkv = c.qkv.data() + r * nl * 3 * Ch;
    float* att = c.att.data() + r * nl * Ch;
    float* lse = c.lse.data() + r * B * d.Hd * Tl;
    Linear(ops, c.n1.data(), C, wr, C, nl, 3 * Ch, C, 0.0f, qkv, 3 * Ch);
    PackKv(qkv, nl, Ch, kv_send.data());
    TSP_RETURN_IF_ERROR(comm_->AllGather(kv_send.data(), kv_recv.data(), nl * 2 * Ch));
    // Prefetch shard r+1 into the other buffer while attending with r (the backend runs
    // operations in issue order, so issued before the all-gather it would delay it).
    if (r + 1 < D) next = start_broadcast(r + 1);
    Relayout(kv_recv.data(), D, B, Tl, 2 * Ch, /*to_seq=*/true, kv.data());
    ops.AttentionForward(s, qkv, kv.data(), kv.data() + Ch, c.q_pos.data(), c.k_pos.data(), att,
                         lse);
    Linear(ops, att, Ch, wr + 3 * Ch * C, Ch, nl, C, Ch, r == 0 ? 0.0f : 1.0f, c.h.data(), C);
  }
  ops.Add(x_local, c.h.data(), nl * C, c.h.data());

  // ---- MLP: FF shards travel the ring p-1 -> p -> p+1. ----
  ops.RmsNormForward(c.h.data(), w.ln2.data(), nl, C, cfg_.eps, c.n2.data(), c.rstd2.data());
  const int64_t wm = d.mlp(), fc = F * C;
  std::vector<float> ring(2 * wm);
  const int left = static_cast<int>((p - 1 + D) % D), right = static_cast<int>((p + 1) % D);
  const float* cur = w.mlp.data();
  for (int64_t j = 0; j < D; ++j) {
    const int64_t sh = (p - j + D) % D;  // the shard held at step j
    std::shared_ptr<Work> send, recv;
    float* nxt = ring.data() + (j % 2) * wm;
    if (j + 1 < D) {
      recv = drain.Add(comm_->IRecv(nxt, wm, left, kTagFwdWeights));
      send = drain.Add(comm_->ISend(cur, wm, right, kTagFwdWeights));
    }
    float* g = c.g.data() + sh * nl * F;
    float* u = c.u.data() + sh * nl * F;
    float* m = c.m.data() + sh * nl * F;
    Linear(ops, c.n2.data(), C, cur, C, nl, F, C, 0.0f, g, F);
    Linear(ops, c.n2.data(), C, cur + fc, C, nl, F, C, 0.0f, u, F);
    ops.SwiGluForward(g, u, nl * F, m);
    Linear(ops, m, F, cur + 2 * fc, F, nl, C, F, j == 0 ? 0.0f : 1.0f, y_local, C);
    TSP_RETURN_IF_ERROR(WaitIfSet(&send));
    TSP_RETURN_IF_ERROR(WaitIfSet(&recv));
    cur = nxt;
  }
  ops.Add(c.h.data(), y_local, nl * C, y_local);
  const std::string err = ops.Synchronize();
  if (!err.empty()) return absl::InternalError("tsp: block forward: " + err);
  return absl::OkStatus();
}

absl::Status TspBlock::Backward(const TransformerOps& ops, const TspShard& w, const TspCache& c,
                                const float* dy_local, float* dx_local,
                                TspShardGrads* grads) const {
  if (comm_ == nullptr) return absl::InvalidArgumentError("tsp: null communicator");
  const int64_t D = comm_->size(), p = comm_->rank();
  TSP_RETURN_IF_ERROR(CheckTspConfig(cfg_, D));
  const Dims d(cfg_, D);
  TSP_RETURN_IF_ERROR(CheckShard(d, w, "weights"));
  TSP_RETURN_IF_ERROR(CheckZigzag(c.T, D, p));
  if (dy_local == nullptr || dx_local == nullptr || grads == nullptr) {
    return absl::InvalidArgumentError("tsp: null dy_local, dx_local or grads");
  }
  const int64_t C = d.C, Ch = d.Ch, F = d.F, B = c.B, T = c.T, Tl = T / D, nl = B * Tl;
  if (B <= 0 || static_cast<int64_t>(c.x.size()) != nl * C ||
      static_cast<int64_t>(c.m.size()) != D * nl * F ||
      static_cast<int64_t>(c.qkv.size()) != D * nl * 3 * Ch ||
      static_cast<int64_t>(c.k_pos.size()) != T) {
    return absl::InvalidArgumentError("tsp: cache does not match its B, T and the group size");
  }
  TSP_RETURN_IF_ERROR(PrepareGrad(&grads->ln1, C, "gradient ln1"));
  TSP_RETURN_IF_ERROR(PrepareGrad(&grads->ln2, C, "gradient ln2"));
  TSP_RETURN_IF_ERROR(PrepareGrad(&grads->attn, d.attn(), "gradient attn"));
  TSP_RETURN_IF_ERROR(PrepareGrad(&grads->mlp, d.mlp(), "gradient mlp"));

  // ---- MLP: reverse ring p+1 -> p -> p-1 of (weights, gradient accumulator). ----
  // Step j handles shard (p+1+j) mod D; its weights come from p+1 (for j < D-1; at j = D-1 it
  // is p's own), its accumulator from p+1 (for j > 0), and both go on to p-1.
  const int64_t wm = d.mlp(), fc = F * C, wa = d.attn();
  const int left = static_cast<int>((p - 1 + D) % D), right = static_cast<int>((p + 1) % D);
  std::vector<float> wring(2 * wm), gring(2 * wm);
  std::vector<float> dm(nl * F), dg(nl * F), du(nl * F), dn2(nl * C), dh(nl * C);
  std::vector<float> lngrad(2 * C, 0.0f);  // this rank's dln1 | dln2, then all-reduced
  // Attention buffers: declared here, before the drain, so they outlive its operations, but
  // sized only once the MLP phase has released its ring buffers (peak memory).
  std::vector<float> wbuf, gbuf, grecv, dA, kv_send, kv_recv, kv, dkv, dkv_send, dkv_local, dqkv,
      dn1;
  WorkDrain drain;
  {
    std::shared_ptr<Work> own_send, wrecv, grecv_w, wsend[2], gsend[2];
    if (D > 1) {
      wrecv = drain.Add(comm_->IRecv(wring.data(), wm, right, kTagBwdWeights));
      own_send = drain.Add(comm_->ISend(w.mlp.data(), wm, left, kTagBwdWeights));
    }
    for (int64_t j = 0; j < D; ++j) {
      const int64_t sh = (p + 1 + j) % D;
      const int64_t k = j % 2, k1 = (j + 1) % 2;
      const float* W = j + 1 < D ? wring.data() + k * wm : w.mlp.data();
      float* G = gring.data() + k * wm;
      TSP_RETURN_IF_ERROR(WaitIfSet(&wrecv));
      if (j + 2 < D) {  // p-1 uses this shard at its step j+1; the next one arrives for j+1.
        TSP_RETURN_IF_ERROR(WaitIfSet(&wsend[k1]));
        wrecv = drain.Add(comm_->IRecv(wring.data() + k1 * wm, wm, right, kTagBwdWeights));
        wsend[k] = drain.Add(comm_->ISend(W, wm, left, kTagBwdWeights));
      }
      if (j == 0) {
        std::fill(G, G + wm, 0.0f);
      } else {
        TSP_RETURN_IF_ERROR(WaitIfSet(&grecv_w));
      }
      if (j + 1 < D) {  // The accumulator of the next step's shard.
        TSP_RETURN_IF_ERROR(WaitIfSet(&gsend[k1]));
        grecv_w = drain.Add(comm_->IRecv(gring.data() + k1 * wm, wm, right, kTagBwdGrads));
      }
      const float* g = c.g.data() + sh * nl * F;
      const float* u = c.u.data() + sh * nl * F;
      const float* m = c.m.data() + sh * nl * F;
      // y = h + m Wd^T; m = silu(g) * u; g = n2 Wg^T, u = n2 Wu^T.
      ops.Gemm(Trans::kNo, Trans::kNo, nl, F, C, 1.0f, dy_local, C, W + 2 * fc, F, 0.0f, dm.data(),
               F);
      ops.Gemm(Trans::kYes, Trans::kNo, C, F, nl, 1.0f, dy_local, C, m, F, 1.0f, G + 2 * fc, F);
      ops.SwiGluBackward(g, u, dm.data(), nl * F, dg.data(), du.data());
      ops.Gemm(Trans::kYes, Trans::kNo, F, C, nl, 1.0f, dg.data(), F, c.n2.data(), C, 1.0f, G, C);
      ops.Gemm(Trans::kYes, Trans::kNo, F, C, nl, 1.0f, du.data(), F, c.n2.data(), C, 1.0f, G + fc,
               C);
      ops.Gemm(Trans::kNo, Trans::kNo, nl, C, F, 1.0f, dg.data(), F, W, C, j == 0 ? 0.0f : 1.0f,
               dn2.data(), C);
      ops.Gemm(Trans::kNo, Trans::kNo, nl, C, F, 1.0f, du.data(), F, W + fc, C, 1.0f, dn2.data(),
               C);
      if (j + 1 < D) {
        gsend[k] = drain.Add(comm_->ISend(G, wm, left, kTagBwdGrads));
      } else {
        AddInto(G, wm, grads->mlp.data());  // Own shard: the sum over every rank's tokens.
      }
    }
    TSP_RETURN_IF_ERROR(WaitIfSet(&own_send));
    for (int k = 0; k < 2; ++k) {
      TSP_RETURN_IF_ERROR(WaitIfSet(&wsend[k]));
      TSP_RETURN_IF_ERROR(WaitIfSet(&gsend[k]));
    }
  }
  ops.RmsNormBackward(c.h.data(), w.ln2.data(), c.rstd2.data(), dn2.data(), nl, C, dh.data(),
                      lngrad.data() + C);
  ops.Add(dh.data(), dy_local, nl * C, dh.data());
  // Every MLP operation has completed: release its buffers before the attention phase.
  for (std::vector<float>* b : {&wring, &gring, &dm, &dg, &du, &dn2}) {
    std::vector<float>().swap(*b);
  }
  wbuf.resize(2 * wa);
  gbuf.resize(2 * wa);
  grecv.resize(wa);
  dA.resize(nl * Ch);
  kv_send.resize(nl * 2 * Ch);
  kv_recv.resize(D * nl * 2 * Ch);
  kv.resize(B * T * 2 * Ch);
  dkv.resize(B * T * 2 * Ch);
  dkv_send.resize(D * nl * 2 * Ch);
  dkv_local.resize(nl * 2 * Ch);
  dqkv.resize(nl * 3 * Ch);
  dn1.resize(nl * C);

  // ---- Attention: re-broadcast head shards, re-gather K|V, reduce-scatter dK|dV, reduce the
  // shard gradients to their owners. ----
  AttentionShape s;
  s.batch = B;
  s.tq = Tl;
  s.tk = T;
  s.heads = d.Hd;
  s.head_dim = d.hd;
  s.q_ld = 3 * Ch;
  s.k_ld = s.v_ld = 2 * Ch;
  s.out_ld = Ch;
  auto start_broadcast = [&](int64_t r) {
    float* buf = wbuf.data() + (r % 2) * wa;
    if (r == p) std::copy(w.attn.begin(), w.attn.end(), buf);
    return drain.Add(comm_->IBroadcast(buf, wa, static_cast<int>(r)));
  };
  std::shared_ptr<Work> next = start_broadcast(0), reduce[2];
  for (int64_t r = 0; r < D; ++r) {
    TSP_RETURN_IF_ERROR(WaitIfSet(&next));
    const int64_t k = r % 2;
    const float* wr = wbuf.data() + k * wa;
    float* gb = gbuf.data() + k * wa;
    TSP_RETURN_IF_ERROR(WaitIfSet(&reduce[k]));  // shard r-2's reduce used gb
    const float* qkv = c.qkv.data() + r * nl * 3 * Ch;
    const float* att = c.att.data() + r * nl * Ch;
    const float* lse = c.lse.data() + r * B * d.Hd * Tl;
    // h = x + sum_r att_r Wo_r^T.
    ops.Gemm(Trans::kNo, Trans::kNo, nl, Ch, C, 1.0f, dh.data(), C, wr + 3 * Ch * C, Ch, 0.0f,
             dA.data(), Ch);
    ops.Gemm(Trans::kYes, Trans::kNo, C, Ch, nl, 1.0f, dh.data(), C, att, Ch, 0.0f, gb + 3 * Ch * C,
             Ch);
    PackKv(qkv, nl, Ch, kv_send.data());
    TSP_RETURN_IF_ERROR(comm_->AllGather(kv_send.data(), kv_recv.data(), nl * 2 * Ch));
    // Prefetch shard r+1 into the other buffer while attending with r (the backend runs
    // operations in issue order, so issued before the all-gather it would delay it).
    if (r + 1 < D) next = start_broadcast(r + 1);
    Relayout(kv_recv.data(), D, B, Tl, 2 * Ch, /*to_seq=*/true, kv.data());
    ops.AttentionBackward(s, qkv, kv.data(), kv.data() + Ch, c.q_pos.data(), c.k_pos.data(), att,
                          lse, dA.data(), dqkv.data(), dkv.data(), dkv.data() + Ch);
    Relayout(dkv.data(), D, B, Tl, 2 * Ch, /*to_seq=*/false, dkv_send.data());
    TSP_RETURN_IF_ERROR(comm_->ReduceScatter(dkv_send.data(), dkv_local.data(), nl * 2 * Ch));
    for (int64_t i = 0; i < nl; ++i) {
      std::copy_n(dkv_local.data() + i * 2 * Ch, 2 * Ch, dqkv.data() + i * 3 * Ch + Ch);
    }
    // q|k|v = n1 Wqkv_r^T.
    ops.Gemm(Trans::kYes, Trans::kNo, 3 * Ch, C, nl, 1.0f, dqkv.data(), 3 * Ch, c.n1.data(), C,
             0.0f, gb, C);
    ops.Gemm(Trans::kNo, Trans::kNo, nl, C, 3 * Ch, 1.0f, dqkv.data(), 3 * Ch, wr, C,
             r == 0 ? 0.0f : 1.0f, dn1.data(), C);
    reduce[k] =
        drain.Add(comm_->IReduce(gb, r == p ? grecv.data() : nullptr, wa, static_cast<int>(r)));
  }
  for (int k = 0; k < 2; ++k) TSP_RETURN_IF_ERROR(WaitIfSet(&reduce[k]));
  AddInto(grecv.data(), wa, grads->attn.data());
  ops.RmsNormBackward(c.x.data(), w.ln1.data(), c.rstd1.data(), dn1.data(), nl, C, dx_local,
                      lngrad.data());
  ops.Add(dx_local, dh.data(), nl * C, dx_local);
  TSP_RETURN_IF_ERROR(comm_->AllReduce(lngrad.data(), 2 * C));
  AddInto(lngrad.data(), C, grads->ln1.data());
  AddInto(lngrad.data() + C, C, grads->ln2.data());
  const std::string err = ops.Synchronize();
  if (!err.empty()) return absl::InternalError("tsp: block backward: " + err);
  return absl::OkStatus();
}

}  // namespace parallel
}  // namespace stallfree
