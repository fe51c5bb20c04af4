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
// + Gloo) or device memory (a CUDA backend + the NCCL communicator). Its one API takes views
// (TpspShardView / TpspGradsView): every pointer of the views and x_local, y_local, dy_local,
// dx_local must be in `ops`' memory (host vectors through TpspViewOf for a host backend, device
// memory for a CUDA backend), and the Communicator must accept that memory (NCCL on the same
// device). The cache keeps its activations in TpspCache::buffers (allocated through `ops`;
// Backward must use the same backend). A device Communicator must run its operations in stream
// order with the backend (NCCL and the CUDA ops on one stream), because the block issues ops and
// communication back to back without synchronising in between. The shared steps of a TP group
// are in parallel/tp_sublayers.h.
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

// Sizes the empty fields of *grads to the shard shapes for degree D, zeroed; then OK iff every
// field has its shard shape (CheckTpspShard): host gradients for Backward (TpspViewOf(grads)).
absl::Status SizeTpspGrads(const BlockConfig& cfg, int D, BlockGrads* grads);

// A shard's tensors (the BlockWeights fields, shard shapes as above) as pointers into the
// backend's memory (see "Memory spaces" above): TpspShardView the weights, TpspGradsView the
// gradients. The TP x CP block (parallel/tpcp_block.h) takes the same views.
template <typename T>
struct TpspView {
  T* ln1 = nullptr;
  T* wq = nullptr;
  T* wk = nullptr;
  T* wv = nullptr;
  T* wo = nullptr;
  T* ln2 = nullptr;
  T* wg = nullptr;
  T* wu = nullptr;
  T* wd = nullptr;

  bool AnyNull() const {
    for (const float* p : {ln1, wq, wk, wv, wo, ln2, wg, wu, wd}) {
      if (p == nullptr) return true;
    }
    return false;
  }
};
using TpspShardView = TpspView<const float>;
using TpspGradsView = TpspView<float>;

// The pointer checks of a block's Forward and Backward (TP+SP and TP x CP alike):
// InvalidArgument "<who>: null ..." naming what is null.
absl::Status CheckForwardPointers(const char* who, const TpspShardView& w, const float* x,
                                  const float* y);
absl::Status CheckBackwardPointers(const char* who, const TpspShardView& w,
                                   const TpspGradsView& grads, const float* dy, const float* dx);

// Views of host tensors (for a host backend); the views point into w / *g.
TpspShardView TpspViewOf(const BlockWeights& w);
TpspGradsView TpspViewOf(BlockGrads* g);

// What the backward needs from the forward, in the backend's memory. n = B * T (all tokens),
// nl = B * T / D (local). positions holds the int32 positions 0..T-1 bit for bit in float-sized
// elements.
struct TpspCacheBuffers {
  kernels::OpsBuffer positions;  // [T]
  kernels::OpsBuffer x;          // [nl, C] block input (local tokens)
  kernels::OpsBuffer rstd1;      // [nl]
  kernels::OpsBuffer n1;         // [n, C] gathered rmsnorm(x, ln1)
  kernels::OpsBuffer qkv;        // [n, 3C/D] own heads: q | k | v
  kernels::OpsBuffer att, lse;   // [n, C/D], [B, H/D, T]
  kernels::OpsBuffer h;          // [nl, C]
  kernels::OpsBuffer rstd2;      // [nl]
  kernels::OpsBuffer n2;         // [n, C] gathered rmsnorm(h, ln2)
  kernels::OpsBuffer g, u, m;    // [n, FF/D]
};
struct TpspCache {
  int64_t B = 0, T = 0;  // T is the global sequence length
  std::shared_ptr<TpspCacheBuffers> buffers;  // shared by copies of the cache; null before Forward
  // The bytes of the cached tensors (positions included); 0 before Forward.
  int64_t bytes() const;
};

class TpspBlock {
 public:
  // comm must outlive the block; D = comm->size(), p = comm->rank().
  TpspBlock(const BlockConfig& cfg, Communicator* comm) : cfg_(cfg), comm_(comm) {}
  const BlockConfig& config() const { return cfg_; }

  // y_local [B, T/D, C] from x_local [B, T/D, C] (this rank's tokens of a [B, T, C] batch),
  // all in `ops`' memory (sizes are the caller's responsibility). cache may be null (no
  // backward). InvalidArgument on bad shapes or null pointers; communication errors as the
  // Communicator reports them.
  absl::Status Forward(const kernels::TransformerOps& ops, const TpspShardView& shard,
                       const float* x_local, int64_t B, int64_t T, float* y_local,
                       TpspCache* cache) const;

  // From dy_local [B, T/D, C]: writes dx_local [B, T/D, C] and accumulates (+=) the shard's
  // weight gradients (shard shapes; ln1/ln2 all-reduced, hence full) into grads, which must be
  // initialised (e.g. zeroed with ops.Fill, or SizeTpspGrads for host vectors).
  absl::Status Backward(const kernels::TransformerOps& ops, const TpspShardView& shard,
                        const TpspCache& cache, const float* dy_local, float* dx_local,
                        const TpspGradsView& grads) const;

 private:
  absl::Status Check() const;

  BlockConfig cfg_;
  Communicator* comm_;
};

}  // namespace parallel
}  // namespace stallfree
