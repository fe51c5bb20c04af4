// TSP: the folded tensor+sequence parallel transformer block (ARCHITECTURE.md, "TSP"), the same
// math as ReferenceBlock (parallel/reference_block.h) on D ranks of one Communicator.
//
// Rank p holds
// - weight shard p: the rows of Wq, Wk, Wv for heads [p H/D, (p+1) H/D) ([C/D, C] each) and the
//   matching columns of Wo ([C, C/D]); rows [p FF/D, (p+1) FF/D) of Wg and Wu ([FF/D, C]) and
//   the matching columns of Wd ([C, FF/D]); ln1 and ln2 replicated;
// - tokens: its zigzag shard x_local [B, T/D, C] (chunks p and 2D-1-p, parallel/zigzag.h).
//
// Forward
// - attention: for r = 0..D-1, rank r's packed attention shard is broadcast from r; each rank
//   projects its own tokens, K|V of head shard r are all-gathered over the ranks (keys = all T
//   tokens at their ZigzagOrder positions), causal attention of the local queries, out +=
//   A_r Wo_r^T locally. Shard r+1 is prefetched by IBroadcast into a second buffer, issued right
//   after r's all-gather so that it overlaps r's attention and output projection.
// - MLP: the packed FF shards travel a ring (ISend to p+1, IRecv from p-1, D-1 hops), the next
//   hop posted before the current shard's GEMMs; partial outputs accumulate locally.
// Backward (the dual)
// - MLP: a reverse ring (to p-1, from p+1): rank p first receives shard p+1, and at step j
//   holds shard (p+1+j) mod D with its gradient accumulator, adds its tokens' contribution and
//   passes both on, so after D-1 hops it holds its own shard's full gradient sum.
// - attention: for r = 0..D-1, shard r re-broadcast (prefetched), K|V of shard r re-gathered
//   (only the local q|k|v and the attention output are cached), attention backward, dK|dV
//   reduce-scattered to the ranks owning those tokens, and the partial gradient of shard r
//   IReduce'd to its owner r (overlapped with the next shard).
// - ln1 / ln2 gradients all-reduced (one call of 2C floats).
//
// Memory: besides its own shard a rank holds at most two other weight shards at a time (the
// double buffers: two attention shards, or two MLP shards and, in the backward, two MLP
// gradient accumulators and two attention gradient partials). No full weight exists on any
// rank. Every rank must call Forward / Backward with the same config, B and T.
//
// Memory spaces. Every buffer the block allocates comes from `ops` (kernels::OpsBuffer) and is
// only touched through ops calls and the Communicator, so the block runs in host memory (CpuOps
// + Gloo) or device memory (a CUDA backend + the NCCL communicator):
// - The TspShard / TspShardGrads overloads are the CPU API: their std::vectors (and x_local,
//   y_local, dy_local, dx_local) are host memory, so `ops` must be a host backend and the
//   Communicator a host one; the cache keeps its activations in its std::vectors.
// - The TspShardView / TspGradsView overloads take pointers in the backend's memory: every
//   pointer of the views and x_local, y_local, dy_local, dx_local must be in `ops`' memory
//   (device memory for a CUDA backend) and the Communicator must accept that memory (NCCL on the
//   same device). The cache then keeps its activations in TspCache::buffers (allocated through
//   `ops`; Backward must use the same backend). A device Communicator must run its operations in
//   stream order with the backend (e.g. NCCL and the CUDA ops on one stream), because the block
//   issues ops and communication back to back without synchronising in between.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/reference_block.h"

namespace stallfree {
namespace parallel {

// OK iff cfg is valid, D >= 1, H % D == 0 and FF % D == 0.
absl::Status CheckTspConfig(const BlockConfig& cfg, int64_t D);

// Rank p's weights (and, with the same layout, its gradients).
struct TspShard {
  std::vector<float> ln1, ln2;  // [C], replicated
  // [4 C C/D]: Wq_p | Wk_p | Wv_p (each [C/D, C], so Wq|Wk|Wv is one [3C/D, C]) | Wo_p [C, C/D].
  std::vector<float> attn;
  // [3 FF/D C]: Wg_p | Wu_p (each [FF/D, C]) | Wd_p [C, FF/D].
  std::vector<float> mlp;

  static TspShard Zeros(const BlockConfig& cfg, int64_t D);
};
using TspShardGrads = TspShard;

// The same layout as pointers into the backend's memory (see "Memory spaces" above): ln1, ln2
// [C], attn [4 C C/D], mlp [3 FF/D C].
struct TspShardView {
  const float* ln1 = nullptr;
  const float* ln2 = nullptr;
  const float* attn = nullptr;
  const float* mlp = nullptr;
};
struct TspGradsView {
  float* ln1 = nullptr;
  float* ln2 = nullptr;
  float* attn = nullptr;
  float* mlp = nullptr;
};

// Shard p of full (D ranks). InvalidArgument on a bad config, D, p or weight shape.
absl::StatusOr<TspShard> ShardBlockWeights(const BlockConfig& cfg, const BlockWeights& full,
                                           int64_t D, int64_t p);

// The inverse: the full layout from every rank's shard (shards[p] of rank p, D = size). The
// replicated ln1 / ln2 are taken from shards[0]. For tests.
absl::StatusOr<BlockWeights> UnshardGrads(const BlockConfig& cfg,
                                          absl::Span<const TspShard> shards);

// The cache's activations in the backend's memory (the view overloads). q_pos / k_pos hold
// int32 positions bit for bit in float-sized elements.
struct TspCacheBuffers {
  kernels::OpsBuffer q_pos, k_pos, x, n1, rstd1, qkv, att, lse, h, n2, rstd2, g, u, m;
};

// What the backward needs (nl = B T/D local tokens; Ch = C/D, F = FF/D). The CPU API fills the
// std::vectors (q_pos / k_pos are filled by both forms, as host metadata); the view form leaves
// the float vectors empty and fills `buffers` instead (shared by copies of the cache).
struct TspCache {
  int64_t B = 0, T = 0;
  std::vector<int32_t> q_pos;    // [T/D] this rank's ZigzagPositions
  std::vector<int32_t> k_pos;    // [T] ZigzagOrder: the gathered keys' positions
  std::vector<float> x;          // [nl, C]
  std::vector<float> n1, rstd1;  // [nl, C], [nl]
  std::vector<float> qkv;        // [D][nl, 3Ch] local q|k|v of head shard r
  std::vector<float> att;        // [D][nl, Ch] attention output of head shard r (before Wo)
  std::vector<float> lse;        // [D][B, H/D, T/D]
  std::vector<float> h;          // [nl, C]
  std::vector<float> n2, rstd2;  // [nl, C], [nl]
  std::vector<float> g, u, m;    // [D][nl, F] for FF shard s
  std::shared_ptr<TspCacheBuffers> buffers;  // the same tensors in backend memory, or null
};

class TspBlock {
 public:
  // comm must outlive the block; its rank / size are p / D.
  TspBlock(const BlockConfig& cfg, Communicator* comm) : cfg_(cfg), comm_(comm) {}
  const BlockConfig& config() const { return cfg_; }

  // y_local [B, T/D, C] from this rank's zigzag shard x_local [B, T/D, C] of a T-token
  // sequence. cache may be null (no backward). InvalidArgument on bad shapes; communication
  // errors as the Communicator reports them.
  absl::Status Forward(const kernels::TransformerOps& ops, const TspShard& w, const float* x_local,
                       int64_t B, int64_t T, float* y_local, TspCache* cache) const;

  // From dy_local [B, T/D, C]: writes dx_local and accumulates (+=) this rank's shard gradient
  // (the full sum over every rank's tokens) and the all-reduced ln1 / ln2 gradients into grads
  // (empty fields are first sized and zeroed).
  absl::Status Backward(const kernels::TransformerOps& ops, const TspShard& w,
                        const TspCache& cache, const float* dy_local, float* dx_local,
                        TspShardGrads* grads) const;

  // The same in the backend's memory: every pointer of w and grads, x_local, y_local, dy_local
  // and dx_local in `ops`' memory (sizes are the caller's responsibility). grads is accumulated
  // (+=), so it must be initialised (e.g. zeroed with ops.Fill). The cache may come from either
  // Forward overload.
  absl::Status Forward(const kernels::TransformerOps& ops, const TspShardView& w,
                       const float* x_local, int64_t B, int64_t T, float* y_local,
                       TspCache* cache) const;
  absl::Status Backward(const kernels::TransformerOps& ops, const TspShardView& w,
                        const TspCache& cache, const float* dy_local, float* dx_local,
                        const TspGradsView& grads) const;

 private:
  BlockConfig cfg_;
  Communicator* comm_;
};

}  // namespace parallel
}  // namespace stallfree
