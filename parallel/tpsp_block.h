// The baseline the TSP block is measured against: Megatron tensor parallelism with sequence
// parallelism (TP+SP) of degree D = comm->size(), rank p = comm->rank(). The same block as
// ReferenceBlock (parallel/reference_block.h), split as follows.
//
// Weights (a shard is a BlockWeights whose fields have the shard shapes):
//   Wq, Wk, Wv: rows [p*C/D, (p+1)*C/D) -> [C/D, C] (heads p*H/D .. (p+1)*H/D - 1)
//   Wo:         columns [p*C/D, (p+1)*C/D) -> [C, C/D]
//   Wg, Wu:     rows [p*FF/D, (p+1)*FF/D) -> [FF/D, C]
//   Wd:         columns [p*FF/D, (p+1)*FF/D) -> [C, FF/D]
//   ln1, ln2:   replicated [C]
// Activations between sublayers are sequence-sharded: rank p holds the contiguous tokens
// [p*T/D, (p+1)*T/D) of every batch row, x_local [B, T/D, C] (positions are global, 0..T-1).
//
// Forward, per sublayer: sequence-sharded RMSNorm; all-gather over the sequence to [B, T, C];
// column-parallel linears (own heads / own FF shard over all T tokens); causal attention or
// SwiGLU; the row-parallel linear gives a partial [B, T, C]; reduce-scatter over the sequence
// back to [B, T/D, C]; residual add.
// Backward, the dual: all-gather of the incoming gradient before the row-parallel linear's
// backward, reduce-scatter of the partial input gradient after the column-parallel ones. The
// shard's weight gradients are complete locally (computed over all T tokens); the ln1/ln2
// gradients are partial sums over the local tokens and are all-reduced (one call, 2C floats).
//
// Communication per rank per layer (fp32, ring algorithms, Gloo's counters):
//   forward:  2 all-gathers + 2 reduce-scatters of B*T*C floats each; each sends
//             4 * B*T*C * (D-1)/D bytes.
//   backward: the same 2 + 2, plus one all-reduce of 2C floats.
//
// Requires H % D == 0, FF % D == 0 and T % D == 0. Every rank must call Forward / Backward with
// the same B and T (they are collective calls).
//
// Memory spaces. Every buffer the block allocates comes from `ops` (kernels::OpsBuffer) and is
// only touched through ops calls and the Communicator, so the block runs in host memory (CpuOps
// + Gloo) or device memory (a CUDA backend + the NCCL communicator):
// - The BlockWeights / BlockGrads overloads are the CPU API: their std::vectors (and x_local,
//   y_local, dy_local, dx_local) are host memory, so `ops` must be a host backend and the
//   Communicator a host one; the cache keeps its activations in its std::vectors.
// - The TpspShardView / TpspGradsView overloads take pointers in the backend's memory: every
//   pointer of the views and x_local, y_local, dy_local, dx_local must be in `ops`' memory
//   (device memory for a CUDA backend) and the Communicator must accept that memory (NCCL on the
//   same device). The cache then keeps its activations in TpspCache::buffers (allocated through
//   `ops`; Backward must use the same backend). A device Communicator must run its operations in
//   stream order with the backend (NCCL and the CUDA ops on one stream), because the block
//   issues ops and communication back to back without synchronising in between.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/reference_block.h"

namespace stallfree {
namespace parallel {

// OK iff cfg is valid, D > 0, 0 <= p < D, H % D == 0 and FF % D == 0.
absl::Status ValidateTpspConfig(const BlockConfig& cfg, int D, int p);

// Shard p of D of full weights (shapes as above).
absl::StatusOr<BlockWeights> ShardTpspWeights(const BlockConfig& cfg, const BlockWeights& full,
                                              int D, int p);

// OK iff every field of shard has the shard shape for (cfg, D).
absl::Status CheckTpspShard(const BlockConfig& cfg, const BlockWeights& shard, int D);

// Writes (overwrites) shard p's gradients into their slices of *full (full layout; an empty
// *full is first sized and zeroed). ln1/ln2 (replicated, already all-reduced) are copied. For
// tests: placing every rank's shard gives the full gradient.
absl::Status PlaceTpspShardGrads(const BlockConfig& cfg, const BlockGrads& shard, int D, int p,
                                 BlockGrads* full);

// A shard's tensors (the BlockWeights fields, shard shapes as above) as pointers into the
// backend's memory (see "Memory spaces" above). The TP x CP block (parallel/tpcp_block.h) takes
// the same views.
struct TpspShardView {
  const float* ln1 = nullptr;
  const float* wq = nullptr;
  const float* wk = nullptr;
  const float* wv = nullptr;
  const float* wo = nullptr;
  const float* ln2 = nullptr;
  const float* wg = nullptr;
  const float* wu = nullptr;
  const float* wd = nullptr;

  bool AnyNull() const {
    for (const float* p : {ln1, wq, wk, wv, wo, ln2, wg, wu, wd}) {
      if (p == nullptr) return true;
    }
    return false;
  }
};
struct TpspGradsView {
  float* ln1 = nullptr;
  float* wq = nullptr;
  float* wk = nullptr;
  float* wv = nullptr;
  float* wo = nullptr;
  float* ln2 = nullptr;
  float* wg = nullptr;
  float* wu = nullptr;
  float* wd = nullptr;

  bool AnyNull() const {
    for (const float* p : {ln1, wq, wk, wv, wo, ln2, wg, wu, wd}) {
      if (p == nullptr) return true;
    }
    return false;
  }
};

// Views of host tensors (for a host backend); the views point into w / *g.
TpspShardView TpspViewOf(const BlockWeights& w);
TpspGradsView TpspViewOf(BlockGrads* g);

// The cache's activations in the backend's memory (the view overloads); positions holds the
// int32 positions bit for bit in float-sized elements.
struct TpspCacheBuffers {
  kernels::OpsBuffer positions, x, rstd1, n1, qkv, att, lse, h, rstd2, n2, g, u, m;
};

// What the backward needs from the forward. n = B * T (all tokens), nl = B * T / D (local).
// The CPU API fills the std::vectors; the view form fills `positions` (host metadata) and
// `buffers` (shared by copies of the cache) and leaves the float vectors empty.
struct TpspCache {
  int64_t B = 0, T = 0;            // T is the global sequence length
  std::vector<int32_t> positions;  // [T] 0..T-1
  std::vector<float> x;            // [nl, C] block input (local tokens)
  std::vector<float> rstd1;        // [nl]
  std::vector<float> n1;           // [n, C] gathered rmsnorm(x, ln1)
  std::vector<float> qkv;          // [n, 3C/D] own heads: q | k | v
  std::vector<float> att, lse;     // [n, C/D], [B, H/D, T]
  std::vector<float> h;            // [nl, C]
  std::vector<float> rstd2;        // [nl]
  std::vector<float> n2;           // [n, C] gathered rmsnorm(h, ln2)
  std::vector<float> g, u, m;      // [n, FF/D]
  std::shared_ptr<TpspCacheBuffers> buffers;  // the same tensors in backend memory, or null
};

class TpspBlock {
 public:
  // comm must outlive the block; D = comm->size(), p = comm->rank().
  TpspBlock(const BlockConfig& cfg, Communicator* comm) : cfg_(cfg), comm_(comm) {}
  const BlockConfig& config() const { return cfg_; }

  // y_local [B, T/D, C] from x_local [B, T/D, C] (this rank's tokens of a [B, T, C] batch).
  // cache may be null (no backward). InvalidArgument on bad shapes; communication errors as
  // the Communicator reports them.
  absl::Status Forward(const kernels::TransformerOps& ops, const BlockWeights& shard,
                       const float* x_local, int64_t B, int64_t T, float* y_local,
                       TpspCache* cache) const;

  // From dy_local [B, T/D, C]: writes dx_local [B, T/D, C] and accumulates (+=) the shard's
  // weight gradients (shard shapes; ln1/ln2 all-reduced, hence full) into *grads (empty
  // fields are first sized and zeroed).
  absl::Status Backward(const kernels::TransformerOps& ops, const BlockWeights& shard,
                        const TpspCache& cache, const float* dy_local, float* dx_local,
                        BlockGrads* grads) const;

  // The same in the backend's memory: every pointer of w and grads, x_local, y_local, dy_local
  // and dx_local in `ops`' memory (sizes are the caller's responsibility). grads is accumulated
  // (+=), so it must be initialised (e.g. zeroed with ops.Fill). The cache may come from either
  // Forward overload.
  absl::Status Forward(const kernels::TransformerOps& ops, const TpspShardView& shard,
                       const float* x_local, int64_t B, int64_t T, float* y_local,
                       TpspCache* cache) const;
  absl::Status Backward(const kernels::TransformerOps& ops, const TpspShardView& shard,
                        const TpspCache& cache, const float* dy_local, float* dx_local,
                        const TpspGradsView& grads) const;

 private:
  // The forward of both overloads; backend_cache selects where the cache's tensors live.
  absl::Status ForwardImpl(const kernels::TransformerOps& ops, const TpspShardView& w,
                           const float* x_local, int64_t B, int64_t T, float* y_local,
                           TpspCache* cache, bool backend_cache) const;
  absl::Status BackwardImpl(const kernels::TransformerOps& ops, const TpspShardView& w,
                            const TpspCache& cache, const float* dy_local, float* dx_local,
                            const TpspGradsView& grads) const;
  // full [B, T, C] := the ranks' local [B, T/D, C] (all-gather + rearrangement), backend memory.
  absl::Status GatherSequence(const kernels::TransformerOps& ops, const float* local, int64_t B,
                              int64_t T, float* full) const;
  // local [B, T/D, C] := sum over ranks of their partial [B, T, C], own tokens.
  absl::Status ReduceScatterSequence(const kernels::TransformerOps& ops, const float* full,
                                     int64_t B, int64_t T, float* local) const;

  BlockConfig cfg_;
  Communicator* comm_;
};

}  // namespace parallel
}  // namespace stallfree
