#include "parallel/tsp_block.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "parallel/linear.h"
#include "parallel/zigzag.h"

namespace stallfree {
namespace parallel {
namespace {

using kernels::AttentionShape;
using kernels::Trans;
using kernels::TransformerOps;

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
  RETURN_IF_ERROR(CheckSize(w.ln1, d.C, absl::StrCat(what, " ln1").c_str()));
  RETURN_IF_ERROR(CheckSize(w.ln2, d.C, absl::StrCat(what, " ln2").c_str()));
  RETURN_IF_ERROR(CheckSize(w.attn, d.attn(), absl::StrCat(what, " attn").c_str()));
  return CheckSize(w.mlp, d.mlp(), absl::StrCat(what, " mlp").c_str());
}

// y[rows, out] = x[rows, in] W^T + beta y, W [out, in] with row stride ldw.
void Linear(const TransformerOps& ops, const float* x, int64_t ldx, const float* w, int64_t ldw,
            int64_t rows, int64_t out, int64_t in, float beta, float* y, int64_t ldy) {
  ops.Gemm(Trans::kNo, Trans::kYes, rows, out, in, 1.0f, x, ldx, w, ldw, beta, y, ldy);
}

// The gathered K|V [D][B][Tl][2Ch] in the sequence layout attention reads. With one batch row
// the two layouts coincide and the gathered buffer is used as it is (no copy); otherwise it is
// rearranged into seq_buf [B][T][2Ch].
const float* GatheredKeys(const TransformerOps& ops, const float* gathered, int64_t D, int64_t B,
                          int64_t Tl, int64_t Ch, float* seq_buf);

// The attention of one head shard: this rank's Tl zigzag queries of each row (q in packed
// q|k|v rows, 3Ch apart) against all T gathered keys (k|v rows, 2Ch apart).
AttentionShape HeadShardAttention(const Dims& d, int64_t B, int64_t T, int64_t D) {
  AttentionShape s;
  s.batch = B;
  s.tq = T / D;
  s.tk = T;
  s.heads = d.Hd;
  s.head_dim = d.hd;
  s.q_ld = 3 * d.Ch;
  s.k_ld = s.v_ld = 2 * d.Ch;
  s.out_ld = d.Ch;
  return s;
}

// Starts the broadcast of rank r's attention shard (Wq|Wk|Wv|Wo, wa floats) into half r % 2 of
// buf [2, wa]; rank p == r first copies its own shard `own` there.
std::shared_ptr<Work> StartHeadBroadcast(const TransformerOps& ops, Communicator* comm,
                                         WorkDrain* drain, const float* own, float* buf,
                                         int64_t wa, int64_t r, int64_t p) {
  float* half = buf + (r % 2) * wa;
  if (r == p) ops.CopyFloats(half, own, wa);
  return drain->Add(comm->IBroadcast(half, wa, static_cast<int>(r)));
}

// kv [nl, 2Ch] := the k|v columns of qkv [nl, 3Ch].
void PackKv(const TransformerOps& ops, const float* qkv, int64_t nl, int64_t Ch, float* kv) {
  ops.Copy2D(kv, 2 * Ch, qkv + Ch, 3 * Ch, nl, 2 * Ch);
}

const float* GatheredKeys(const TransformerOps& ops, const float* gathered, int64_t D, int64_t B,
                          int64_t Tl, int64_t Ch, float* seq_buf) {
  if (B == 1) return gathered;
  layer::RankMajorToBatchMajor(ops, gathered, D, B, Tl, 2 * Ch, seq_buf);
  return seq_buf;
}

absl::Status PrepareGrad(std::vector<float>* g, int64_t want, const char* name) {
  if (g->empty()) g->assign(static_cast<size_t>(want), 0.0f);
  return CheckSize(*g, want, name);
}

absl::Status SyncStatus(const TransformerOps& ops, const char* what) {
  return layer::Sync(ops, "tsp", what);
}

// The cache's tensors, wherever they live.
struct CacheRefs {
  const int32_t* q_pos = nullptr;
  const int32_t* k_pos = nullptr;
  float *x = nullptr, *n1 = nullptr, *rstd1 = nullptr, *qkv = nullptr, *att = nullptr,
        *lse = nullptr, *h = nullptr, *n2 = nullptr, *rstd2 = nullptr, *g = nullptr, *u = nullptr,
        *m = nullptr;
  int64_t x_size = 0, m_size = 0, qkv_size = 0;
};

CacheRefs RefsOf(const TspCache& c) {
  CacheRefs r;
  // The cache's tensors are written through these pointers by Forward, which owns the cache;
  // Backward only reads them.
  auto mut = [](const std::vector<float>& v) { return const_cast<float*>(v.data()); };
  if (c.buffers != nullptr) {
    const TspCacheBuffers& b = *c.buffers;
    r.q_pos = reinterpret_cast<const int32_t*>(b.q_pos.data());
    r.k_pos = reinterpret_cast<const int32_t*>(b.k_pos.data());
    r.x = b.x.data();
    r.n1 = b.n1.data();
    r.rstd1 = b.rstd1.data();
    r.qkv = b.qkv.data();
    r.att = b.att.data();
    r.lse = b.lse.data();
    r.h = b.h.data();
    r.n2 = b.n2.data();
    r.rstd2 = b.rstd2.data();
    r.g = b.g.data();
    r.u = b.u.data();
    r.m = b.m.data();
    r.x_size = b.x.size();
    r.m_size = b.m.size();
    r.qkv_size = b.qkv.size();
  } else {
    r.q_pos = c.q_pos.data();
    r.k_pos = c.k_pos.data();
    r.x = mut(c.x);
    r.n1 = mut(c.n1);
    r.rstd1 = mut(c.rstd1);
    r.qkv = mut(c.qkv);
    r.att = mut(c.att);
    r.lse = mut(c.lse);
    r.h = mut(c.h);
    r.n2 = mut(c.n2);
    r.rstd2 = mut(c.rstd2);
    r.g = mut(c.g);
    r.u = mut(c.u);
    r.m = mut(c.m);
    r.x_size = static_cast<int64_t>(c.x.size());
    r.m_size = static_cast<int64_t>(c.m.size());
    r.qkv_size = static_cast<int64_t>(c.qkv.size());
  }
  return r;
}

TspShardView ViewOf(const TspShard& w) {
  return TspShardView{w.ln1.data(), w.ln2.data(), w.attn.data(), w.mlp.data()};
}

bool AnyNull(const TspShardView& w) {
  return w.ln1 == nullptr || w.ln2 == nullptr || w.attn == nullptr || w.mlp == nullptr;
}

bool AnyNull(const TspGradsView& g) {
  return g.ln1 == nullptr || g.ln2 == nullptr || g.attn == nullptr || g.mlp == nullptr;
}

// The forward of both overloads; backend_cache selects where the cache's tensors live.
absl::Status ForwardImpl(const BlockConfig& cfg, Communicator* comm, const TransformerOps& ops,
                         const TspShardView& w, const float* x_local, int64_t B, int64_t T,
                         float* y_local, TspCache* cache, bool backend_cache);

absl::Status BackwardImpl(const BlockConfig& cfg, Communicator* comm, const TransformerOps& ops,
                          const TspShardView& w, const TspCache& c, const float* dy_local,
                          float* dx_local, const TspGradsView& grads);

}  // namespace

absl::Status CheckTspConfig(const BlockConfig& cfg, int64_t D) {
  RETURN_IF_ERROR(ValidateBlockConfig(cfg));
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
  RETURN_IF_ERROR(CheckTspConfig(cfg, D));
  RETURN_IF_ERROR(CheckBlockWeights(cfg, full));
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
  RETURN_IF_ERROR(CheckTspConfig(cfg, D));
  const Dims d(cfg, D);
  for (const TspShard& s : shards) RETURN_IF_ERROR(CheckShard(d, s, "shard"));
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
  const int64_t D = comm_->size();
  RETURN_IF_ERROR(CheckTspConfig(cfg_, D));
  RETURN_IF_ERROR(CheckShard(Dims(cfg_, D), w, "weights"));
  return ForwardImpl(cfg_, comm_, ops, ViewOf(w), x_local, B, T, y_local, cache,
                     /*backend_cache=*/false);
}

absl::Status TspBlock::Forward(const TransformerOps& ops, const TspShardView& w,
                               const float* x_local, int64_t B, int64_t T, float* y_local,
                               TspCache* cache) const {
  if (AnyNull(w)) return absl::InvalidArgumentError("tsp: null weight pointer");
  return ForwardImpl(cfg_, comm_, ops, w, x_local, B, T, y_local, cache, /*backend_cache=*/true);
}

absl::Status TspBlock::Backward(const TransformerOps& ops, const TspShard& w, const TspCache& c,
                                const float* dy_local, float* dx_local,
                                TspShardGrads* grads) const {
  if (comm_ == nullptr) return absl::InvalidArgumentError("tsp: null communicator");
  const int64_t D = comm_->size();
  RETURN_IF_ERROR(CheckTspConfig(cfg_, D));
  const Dims d(cfg_, D);
  RETURN_IF_ERROR(CheckShard(d, w, "weights"));
  if (grads == nullptr) return absl::InvalidArgumentError("tsp: null grads");
  RETURN_IF_ERROR(PrepareGrad(&grads->ln1, d.C, "gradient ln1"));
  RETURN_IF_ERROR(PrepareGrad(&grads->ln2, d.C, "gradient ln2"));
  RETURN_IF_ERROR(PrepareGrad(&grads->attn, d.attn(), "gradient attn"));
  RETURN_IF_ERROR(PrepareGrad(&grads->mlp, d.mlp(), "gradient mlp"));
  const TspGradsView g{grads->ln1.data(), grads->ln2.data(), grads->attn.data(),
                       grads->mlp.data()};
  return BackwardImpl(cfg_, comm_, ops, ViewOf(w), c, dy_local, dx_local, g);
}

absl::Status TspBlock::Backward(const TransformerOps& ops, const TspShardView& w,
                                const TspCache& c, const float* dy_local, float* dx_local,
                                const TspGradsView& grads) const {
  if (AnyNull(w)) return absl::InvalidArgumentError("tsp: null weight pointer");
  if (AnyNull(grads)) return absl::InvalidArgumentError("tsp: null gradient pointer");
  return BackwardImpl(cfg_, comm_, ops, w, c, dy_local, dx_local, grads);
}

namespace {

absl::Status ForwardImpl(const BlockConfig& cfg, Communicator* comm, const TransformerOps& ops,
                         const TspShardView& w, const float* x_local, int64_t B, int64_t T,
                         float* y_local, TspCache* cache, bool backend_cache) {
  if (comm == nullptr) return absl::InvalidArgumentError("tsp: null communicator");
  const int64_t D = comm->size(), p = comm->rank();
  RETURN_IF_ERROR(CheckTspConfig(cfg, D));
  const Dims d(cfg, D);
  RETURN_IF_ERROR(CheckZigzag(T, D, p));
  if (B <= 0) return absl::InvalidArgumentError(absl::StrCat("tsp: B=", B, " must be > 0"));
  if (x_local == nullptr || y_local == nullptr) {
    return absl::InvalidArgumentError("tsp: null x_local or y_local");
  }
  const int64_t C = d.C, Ch = d.Ch, F = d.F, Tl = T / D, nl = B * Tl;
  TspCache scratch;
  TspCache& c = cache != nullptr ? *cache : scratch;
  c.B = B;
  c.T = T;
  ASSIGN_OR_RETURN(c.q_pos, ZigzagPositions(T, D, p));
  ASSIGN_OR_RETURN(c.k_pos, ZigzagOrder(T, D));
  const int64_t sizes[12] = {nl * C,           nl * C,     nl,     D * nl * 3 * Ch,
                             D * nl * Ch,      D * B * d.Hd * Tl,  nl * C, nl * C,
                             nl,               D * nl * F, D * nl * F, D * nl * F};
  if (backend_cache) {
    for (std::vector<float>* v : {&c.x, &c.n1, &c.rstd1, &c.qkv, &c.att, &c.lse, &c.h, &c.n2,
                                  &c.rstd2, &c.g, &c.u, &c.m}) {
      std::vector<float>().swap(*v);
    }
    c.buffers = nullptr;  // release the previous step's buffers first (peak memory)
    auto b = std::make_shared<TspCacheBuffers>();
    kernels::OpsBuffer* bufs[12] = {&b->x,   &b->n1, &b->rstd1, &b->qkv, &b->att, &b->lse,
                                    &b->h,   &b->n2, &b->rstd2, &b->g,   &b->u,   &b->m};
    for (int i = 0; i < 12; ++i) *bufs[i] = kernels::OpsBuffer(&ops, sizes[i]);
    b->q_pos = kernels::OpsBuffer(&ops, Tl);
    b->k_pos = kernels::OpsBuffer(&ops, T);
    static_assert(sizeof(int32_t) == sizeof(float), "positions travel as float-sized bits");
    ops.Upload(b->q_pos.data(), reinterpret_cast<const float*>(c.q_pos.data()), Tl);
    ops.Upload(b->k_pos.data(), reinterpret_cast<const float*>(c.k_pos.data()), T);
    c.buffers = std::move(b);
  } else {
    c.buffers = nullptr;
    std::vector<float>* vecs[12] = {&c.x, &c.n1, &c.rstd1, &c.qkv, &c.att, &c.lse,
                                    &c.h, &c.n2, &c.rstd2, &c.g,   &c.u,   &c.m};
    for (int i = 0; i < 12; ++i) vecs[i]->resize(static_cast<size_t>(sizes[i]));
  }
  const CacheRefs cr = RefsOf(c);
  ops.CopyFloats(cr.x, x_local, nl * C);

  // ---- Attention: broadcast head shards, all-gather K|V. ----
  ops.RmsNormForward(x_local, w.ln1, nl, C, cfg.eps, cr.n1, cr.rstd1);
  const int64_t wa = d.attn();
  kernels::OpsBuffer wbuf(&ops, 2 * wa), kv_send(&ops, nl * 2 * Ch),
      kv_recv(&ops, D * nl * 2 * Ch), kv(&ops, B > 1 ? B * T * 2 * Ch : 0);
  WorkDrain drain;
  auto start_broadcast = [&](int64_t r) {
    return StartHeadBroadcast(ops, comm, &drain, w.attn, wbuf.data(), wa, r, p);
  };
  const AttentionShape s = HeadShardAttention(d, B, T, D);
  std::shared_ptr<Work> next = start_broadcast(0);
  for (int64_t r = 0; r < D; ++r) {
    RETURN_IF_ERROR(WaitIfSet(&next));
    const float* wr = wbuf.data() + (r % 2) * wa;  // Wq|Wk|Wv [3Ch, C], then Wo [C, Ch]
    float* qkv = cr.qkv + r * nl * 3 * Ch;
    float* att = cr.att + r * nl * Ch;
    float* lse = cr.lse + r * B * d.Hd * Tl;
    Linear(ops, cr.n1, C, wr, C, nl, 3 * Ch, C, 0.0f, qkv, 3 * Ch);
    PackKv(ops, qkv, nl, Ch, kv_send.data());
    RETURN_IF_ERROR(comm->AllGather(kv_send.data(), kv_recv.data(), nl * 2 * Ch));
    // Prefetch shard r+1 into the other buffer while attending with r (the backend runs
    // operations in issue order, so issued before the all-gather it would delay it).
    if (r + 1 < D) next = start_broadcast(r + 1);
    const float* keys = GatheredKeys(ops, kv_recv.data(), D, B, Tl, Ch, kv.data());
    ops.AttentionForward(s, qkv, keys, keys + Ch, cr.q_pos, cr.k_pos, att, lse);
    Linear(ops, att, Ch, wr + 3 * Ch * C, Ch, nl, C, Ch, r == 0 ? 0.0f : 1.0f, cr.h, C);
  }
  ops.Add(x_local, cr.h, nl * C, cr.h);

  // ---- MLP: FF shards travel the ring p-1 -> p -> p+1. ----
  ops.RmsNormForward(cr.h, w.ln2, nl, C, cfg.eps, cr.n2, cr.rstd2);
  const int64_t wm = d.mlp(), fc = F * C;
  kernels::OpsBuffer ring(&ops, 2 * wm);
  const int left = static_cast<int>((p - 1 + D) % D), right = static_cast<int>((p + 1) % D);
  const float* cur = w.mlp;
  for (int64_t j = 0; j < D; ++j) {
    const int64_t sh = (p - j + D) % D;  // the shard held at step j
    std::shared_ptr<Work> send, recv;
    float* nxt = ring.data() + (j % 2) * wm;
    if (j + 1 < D) {
      recv = drain.Add(comm->IRecv(nxt, wm, left, kTagFwdWeights));
      send = drain.Add(comm->ISend(cur, wm, right, kTagFwdWeights));
    }
    float* g = cr.g + sh * nl * F;
    float* u = cr.u + sh * nl * F;
    float* m = cr.m + sh * nl * F;
    Linear(ops, cr.n2, C, cur, C, nl, F, C, 0.0f, g, F);
    Linear(ops, cr.n2, C, cur + fc, C, nl, F, C, 0.0f, u, F);
    ops.SwiGluForward(g, u, nl * F, m);
    Linear(ops, m, F, cur + 2 * fc, F, nl, C, F, j == 0 ? 0.0f : 1.0f, y_local, C);
    RETURN_IF_ERROR(WaitIfSet(&send));
    RETURN_IF_ERROR(WaitIfSet(&recv));
    cur = nxt;
  }
  ops.Add(cr.h, y_local, nl * C, y_local);
  return SyncStatus(ops, "block forward");
}

// The backward after its argument checks, in two phases that share the cache and the rank's
// place: Mlp (the reverse ring) gives dh and ln2's partial gradient, then Attention (its buffers
// allocated once the MLP's are released: peak memory) gives dx_local and ln1's.
struct TspBackward {
  TspBackward(const BlockConfig& cfg, Communicator* comm, const TransformerOps& ops,
              const TspShardView& w, const TspCache& c, const CacheRefs& cr,
              const float* dy_local, float* dx_local, const TspGradsView& grads)
      : cfg(cfg), comm(comm), ops(ops), w(w), cr(cr), dy_local(dy_local), dx_local(dx_local),
        grads(grads), D(comm->size()), p(comm->rank()), d(cfg, D), C(d.C), Ch(d.Ch), F(d.F),
        B(c.B), T(c.T), Tl(T / D), nl(B * Tl) {}

  // dh := dy + d(mlp)/dh, lngrad[C, 2C) += ln2's partial gradient, grads.mlp += its own shard's.
  absl::Status Mlp(float* dh, float* lngrad) const {
    // ---- MLP: reverse ring p+1 -> p -> p-1 of (weights, gradient accumulator). ----
    // Step j handles shard (p+1+j) mod D; its weights come from p+1 (for j < D-1; at j = D-1 it
    // is p's own), its accumulator from p+1 (for j > 0), and both go on to p-1.
    const int64_t wm = d.mlp(), fc = F * C;
    const int left = static_cast<int>((p - 1 + D) % D), right = static_cast<int>((p + 1) % D);
    kernels::OpsBuffer wring(&ops, 2 * wm), gring(&ops, 2 * wm);
    kernels::OpsBuffer dm(&ops, nl * F), dg(&ops, nl * F), du(&ops, nl * F), dn2(&ops, nl * C);
    WorkDrain drain;  // after the buffers its operations use
    {
      std::shared_ptr<Work> own_send, wrecv, grecv_w, wsend[2], gsend[2];
      if (D > 1) {
        wrecv = drain.Add(comm->IRecv(wring.data(), wm, right, kTagBwdWeights));
        own_send = drain.Add(comm->ISend(w.mlp, wm, left, kTagBwdWeights));
      }
      for (int64_t j = 0; j < D; ++j) {
        const int64_t sh = (p + 1 + j) % D;
        const int64_t k = j % 2, k1 = (j + 1) % 2;
        const float* W = j + 1 < D ? wring.data() + k * wm : w.mlp;
        float* G = gring.data() + k * wm;
        RETURN_IF_ERROR(WaitIfSet(&wrecv));
        if (j + 2 < D) {  // p-1 uses this shard at its step j+1; the next one arrives for j+1.
          RETURN_IF_ERROR(WaitIfSet(&wsend[k1]));
          wrecv = drain.Add(comm->IRecv(wring.data() + k1 * wm, wm, right, kTagBwdWeights));
          wsend[k] = drain.Add(comm->ISend(W, wm, left, kTagBwdWeights));
        }
        if (j == 0) {
          ops.Fill(G, wm, 0.0f);
        } else {
          RETURN_IF_ERROR(WaitIfSet(&grecv_w));
        }
        if (j + 1 < D) {  // The accumulator of the next step's shard.
          RETURN_IF_ERROR(WaitIfSet(&gsend[k1]));
          grecv_w = drain.Add(comm->IRecv(gring.data() + k1 * wm, wm, right, kTagBwdGrads));
        }
        const float* g = cr.g + sh * nl * F;
        const float* u = cr.u + sh * nl * F;
        const float* m = cr.m + sh * nl * F;
        // y = h + m Wd^T; m = silu(g) * u; g = n2 Wg^T, u = n2 Wu^T.
        ops.Gemm(Trans::kNo, Trans::kNo, nl, F, C, 1.0f, dy_local, C, W + 2 * fc, F, 0.0f,
                 dm.data(), F);
        ops.Gemm(Trans::kYes, Trans::kNo, C, F, nl, 1.0f, dy_local, C, m, F, 1.0f, G + 2 * fc, F);
        ops.SwiGluBackward(g, u, dm.data(), nl * F, dg.data(), du.data());
        ops.Gemm(Trans::kYes, Trans::kNo, F, C, nl, 1.0f, dg.data(), F, cr.n2, C, 1.0f, G, C);
        ops.Gemm(Trans::kYes, Trans::kNo, F, C, nl, 1.0f, du.data(), F, cr.n2, C, 1.0f, G + fc, C);
        ops.Gemm(Trans::kNo, Trans::kNo, nl, C, F, 1.0f, dg.data(), F, W, C, j == 0 ? 0.0f : 1.0f,
                 dn2.data(), C);
        ops.Gemm(Trans::kNo, Trans::kNo, nl, C, F, 1.0f, du.data(), F, W + fc, C, 1.0f, dn2.data(),
                 C);
        if (j + 1 < D) {
          gsend[k] = drain.Add(comm->ISend(G, wm, left, kTagBwdGrads));
        } else {
          ops.Add(grads.mlp, G, wm, grads.mlp);  // Own shard: the sum over every rank's tokens.
        }
      }
      RETURN_IF_ERROR(WaitIfSet(&own_send));
      for (int k = 0; k < 2; ++k) {
        RETURN_IF_ERROR(WaitIfSet(&wsend[k]));
        RETURN_IF_ERROR(WaitIfSet(&gsend[k]));
      }
    }
    ops.RmsNormBackward(cr.h, w.ln2, cr.rstd2, dn2.data(), nl, C, dh, lngrad + C);
    ops.Add(dh, dy_local, nl * C, dh);
    return absl::OkStatus();
  }

  // dx_local := d(block)/dx from dh, lngrad[0, C) += ln1's partial gradient, grads.attn += its
  // own head shard's (reduced from every rank).
  absl::Status Attention(const float* dh, float* lngrad) const {
    const int64_t wa = d.attn();
    kernels::OpsBuffer wbuf(&ops, 2 * wa), gbuf(&ops, 2 * wa), grecv(&ops, wa), dA(&ops, nl * Ch),
        kv_send(&ops, nl * 2 * Ch), kv_recv(&ops, D * nl * 2 * Ch),
        kv(&ops, B > 1 ? B * T * 2 * Ch : 0), dkv(&ops, B > 1 ? B * T * 2 * Ch : 0),
        dkv_send(&ops, D * nl * 2 * Ch), dkv_local(&ops, nl * 2 * Ch), dqkv(&ops, nl * 3 * Ch),
        dn1(&ops, nl * C);
    WorkDrain drain;  // after the buffers its operations use
    // ---- Attention: re-broadcast head shards, re-gather K|V, reduce-scatter dK|dV, reduce the
    // shard gradients to their owners. ----
    const AttentionShape s = HeadShardAttention(d, B, T, D);
    auto start_broadcast = [&](int64_t r) {
      return StartHeadBroadcast(ops, comm, &drain, w.attn, wbuf.data(), wa, r, p);
    };
    std::shared_ptr<Work> next = start_broadcast(0), reduce[2];
    for (int64_t r = 0; r < D; ++r) {
      RETURN_IF_ERROR(WaitIfSet(&next));
      const int64_t k = r % 2;
      const float* wr = wbuf.data() + k * wa;
      float* gb = gbuf.data() + k * wa;
      RETURN_IF_ERROR(WaitIfSet(&reduce[k]));  // shard r-2's reduce used gb
      const float* qkv = cr.qkv + r * nl * 3 * Ch;
      const float* att = cr.att + r * nl * Ch;
      const float* lse = cr.lse + r * B * d.Hd * Tl;
      // h = x + sum_r att_r Wo_r^T.
      ops.Gemm(Trans::kNo, Trans::kNo, nl, Ch, C, 1.0f, dh, C, wr + 3 * Ch * C, Ch, 0.0f,
               dA.data(), Ch);
      ops.Gemm(Trans::kYes, Trans::kNo, C, Ch, nl, 1.0f, dh, C, att, Ch, 0.0f, gb + 3 * Ch * C,
               Ch);
      PackKv(ops, qkv, nl, Ch, kv_send.data());
      RETURN_IF_ERROR(comm->AllGather(kv_send.data(), kv_recv.data(), nl * 2 * Ch));
      // Prefetch shard r+1 into the other buffer while attending with r (the backend runs
      // operations in issue order, so issued before the all-gather it would delay it).
      if (r + 1 < D) next = start_broadcast(r + 1);
      const float* keys = GatheredKeys(ops, kv_recv.data(), D, B, Tl, Ch, kv.data());
      // With one batch row the sequence layout is the reduce-scatter's layout: write dK|dV there.
      float* dkeys = B > 1 ? dkv.data() : dkv_send.data();
      ops.AttentionBackward(s, qkv, keys, keys + Ch, cr.q_pos, cr.k_pos, att, lse, dA.data(),
                            dqkv.data(), dkeys, dkeys + Ch);
      if (B > 1) layer::BatchMajorToRankMajor(ops, dkv.data(), D, B, Tl, 2 * Ch, dkv_send.data());
      RETURN_IF_ERROR(comm->ReduceScatter(dkv_send.data(), dkv_local.data(), nl * 2 * Ch));
      ops.Copy2D(dqkv.data() + Ch, 3 * Ch, dkv_local.data(), 2 * Ch, nl, 2 * Ch);
      // q|k|v = n1 Wqkv_r^T.
      ops.Gemm(Trans::kYes, Trans::kNo, 3 * Ch, C, nl, 1.0f, dqkv.data(), 3 * Ch, cr.n1, C, 0.0f,
               gb, C);
      ops.Gemm(Trans::kNo, Trans::kNo, nl, C, 3 * Ch, 1.0f, dqkv.data(), 3 * Ch, wr, C,
               r == 0 ? 0.0f : 1.0f, dn1.data(), C);
      reduce[k] =
          drain.Add(comm->IReduce(gb, r == p ? grecv.data() : nullptr, wa, static_cast<int>(r)));
    }
    for (int k = 0; k < 2; ++k) RETURN_IF_ERROR(WaitIfSet(&reduce[k]));
    ops.Add(grads.attn, grecv.data(), wa, grads.attn);
    ops.RmsNormBackward(cr.x, w.ln1, cr.rstd1, dn1.data(), nl, C, dx_local, lngrad);
    ops.Add(dx_local, dh, nl * C, dx_local);
    return absl::OkStatus();
  }

  const BlockConfig& cfg;
  Communicator* const comm;
  const TransformerOps& ops;
  const TspShardView& w;
  const CacheRefs& cr;
  const float* const dy_local;
  float* const dx_local;
  const TspGradsView& grads;
  const int64_t D, p;
  const Dims d;
  const int64_t C, Ch, F, B, T, Tl, nl;
};

absl::Status BackwardImpl(const BlockConfig& cfg, Communicator* comm, const TransformerOps& ops,
                          const TspShardView& w, const TspCache& c, const float* dy_local,
                          float* dx_local, const TspGradsView& grads) {
  if (comm == nullptr) return absl::InvalidArgumentError("tsp: null communicator");
  const int64_t D = comm->size(), p = comm->rank();
  RETURN_IF_ERROR(CheckTspConfig(cfg, D));
  const Dims d(cfg, D);
  RETURN_IF_ERROR(CheckZigzag(c.T, D, p));
  if (dy_local == nullptr || dx_local == nullptr) {
    return absl::InvalidArgumentError("tsp: null dy_local, dx_local or grads");
  }
  const int64_t C = d.C, Ch = d.Ch, F = d.F, B = c.B, T = c.T, Tl = T / D, nl = B * Tl;
  const CacheRefs cr = RefsOf(c);
  if (B <= 0 || cr.x_size != nl * C || cr.m_size != D * nl * F ||
      cr.qkv_size != D * nl * 3 * Ch || static_cast<int64_t>(c.k_pos.size()) != T ||
      (c.buffers != nullptr && c.buffers->x.ops() != &ops)) {
    return absl::InvalidArgumentError(
        "tsp: cache does not match its B, T, the group size or the backend");
  }
  const TspBackward backward(cfg, comm, ops, w, c, cr, dy_local, dx_local, grads);
  kernels::OpsBuffer dh(&ops, nl * C);
  kernels::OpsBuffer lngrad(&ops, 2 * C);  // this rank's dln1 | dln2 (zeroed), then all-reduced
  RETURN_IF_ERROR(backward.Mlp(dh.data(), lngrad.data()));
  RETURN_IF_ERROR(backward.Attention(dh.data(), lngrad.data()));
  RETURN_IF_ERROR(comm->AllReduce(lngrad.data(), 2 * C));
  ops.Add(grads.ln1, lngrad.data(), C, grads.ln1);
  ops.Add(grads.ln2, lngrad.data() + C, C, grads.ln2);
  return SyncStatus(ops, "block backward");
}

}  // namespace
}  // namespace parallel
}  // namespace stallfree
