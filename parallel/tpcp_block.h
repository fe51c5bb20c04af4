// A second baseline for the TSP block: 2-D tensor parallelism (Megatron TP+SP, degree t) x
// context parallelism (CP, degree c), D = t * c ranks. World rank = cp_index * t + tp_index; a
// rank talks over two sub-communicators: its TP group (the t ranks with its cp_index, rank
// tp_index) and its CP group (the c ranks with its tp_index, rank cp_index). The same block as
// ReferenceBlock (parallel/reference_block.h), split as follows.
//
// Weights: the TP+SP shard tp_index of t (ShardTpspWeights(cfg, full, t, tp_index): heads
// tp_index*H/t .., FF rows tp_index*FF/t ..; ln1/ln2 replicated), replicated across the CP axis.
// Tokens: CP shards the sequence in zigzag order over the c CP ranks (ZigzagPositions(T, c,
// cp_index): chunks j and 2c-1-j of 2c, T/c tokens, its "CP shard"); inside the TP group the CP
// shard is sequence-parallel as in TP+SP: TP rank i holds the contiguous local tokens
// [i*T/(c*t), (i+1)*T/(c*t)) of the CP shard of every batch row, x_local [B, T/(c*t), C]
// (TpcpPositions gives their global positions).
//
// Forward, per layer:
//   attention: sequence-sharded RMSNorm; TP all-gather to the CP shard [B, T/c, C]; own heads'
//     q, k, v for the CP shard's tokens; K|V all-gathered over the CP axis (keys = all T tokens
//     in zigzag order, k_pos = ZigzagOrder(T, c)), overlapped with the q projection; causal
//     attention of the local queries (q_pos = the CP shard's positions); row-parallel Wo gives a
//     partial [B, T/c, C]; TP reduce-scatter back to [B, T/(c*t), C]; residual.
//   MLP: as TP+SP inside the TP group on the CP shard's tokens; no CP communication.
// Backward, the dual: TP all-gather of the incoming gradient before each row-parallel linear's
// backward, TP reduce-scatter after the column-parallel ones; dK|dV of all T keys
// reduce-scattered back over the CP axis to their owners (overlapped with dWq and dq Wq); the
// ln1/ln2 gradients (partial over the local tokens) are all-reduced over the TP group (2C
// floats), then every weight-shard gradient of this call, ln1/ln2 included, is all-reduced over
// the CP axis in one packed call (the weights are replicated there), which also completes the
// ln sums over the world. The gathered K|V is kept in the cache (no re-gather in the backward).
//
// Communication per rank per layer (fp32, Gloo's ring algorithms, both sub-communicators'
// counters; N_tp = B*(T/c)*C, N_kv = B*(T/c)*2C/t floats per rank, N_w = 2C + 4C*C/t + 3C*FF/t):
//   TP forward:  2 all-gathers + 2 reduce-scatters, each sends (and receives)
//                4 * N_tp * (t-1)/t bytes.
//   CP forward:  1 all-gather of K|V, sends (and receives) 4 * N_kv * (c-1) bytes.
//   TP backward: the same 2 + 2, plus 1 all-reduce of 2C floats (the ring all-reduce's closed
//                form: sends 4*(2n - |B_r| - |B_{r+1}|) for n floats in blocks of n/size).
//   CP backward: 1 reduce-scatter of dK|dV, 4 * N_kv * (c-1) bytes; 1 all-reduce of N_w floats.
// (Each call is counted by its communicator even when that group has size 1, with 0 bytes.)
//
// Requires H % t == 0, FF % t == 0, T % (2c) == 0 and (T/c) % t == 0. Forward / Backward are
// collective over both groups: every rank must call them with the same B and T.
//
// Memory spaces, as the TP+SP block's (parallel/tpsp_block.h): every buffer the block
// allocates comes from `ops` (kernels::OpsBuffer) and is only touched through ops calls and the
// Communicators. Its one API takes the TP+SP views (TpspShardView / TpspGradsView): pointers in
// `ops`' memory; the Communicators must accept that memory (NCCL on the same device) and run in
// stream order with the backend (both NCCL communicators and the CUDA ops on one stream), and the
// cache keeps its activations in TpcpCache::buffers (Backward must use the same backend). The
// steps it shares with the TP+SP block (the TP group's gathers, the MLP) are in
// parallel/tp_sublayers.h.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/reference_block.h"
#include "parallel/tpsp_block.h"

namespace stallfree {
namespace parallel {

// The two sub-communicators of one rank of a t x c grid.
struct TpcpGroups {
  int tp_degree = 1, cp_degree = 1;
  int tp_index = 0, cp_index = 0;
  std::unique_ptr<Communicator> tp;  // group "<world.group>.tp<cp_index>", rank tp_index of t
  std::unique_ptr<Communicator> cp;  // group "<world.group>.cp<tp_index>", rank cp_index of c
};

// Builds this rank's TP and CP groups with NewGlooCommunicator from the world's options
// (rank = cp_index * t + tp_index, size = t * c), sharing the world's file store (store_dir;
// required when a group has more than one rank, since each group needs its own rendezvous).
// Every rank of the world must call it (the TP group is created first, then the CP group).
absl::StatusOr<TpcpGroups> NewGlooTpcpGroups(const CommOptions& world, int tp_degree);

// OK iff cfg is valid, t, c >= 1, H % t == 0, FF % t == 0 and the indices are in range.
absl::Status ValidateTpcpConfig(const BlockConfig& cfg, int t, int c, int tp_index, int cp_index);

// OK iff B > 0, T > 0, T % (2c) == 0 and (T/c) % t == 0 (and T < 2^31).
absl::Status CheckTpcpSequence(int64_t B, int64_t T, int t, int c);

// The global positions of rank (tp_index, cp_index)'s T/(c*t) local tokens, in local order.
absl::StatusOr<std::vector<int32_t>> TpcpPositions(int64_t T, int t, int c, int tp_index,
                                                   int cp_index);

// What the backward needs from the forward, in the backend's memory. nc = B*T/c (the CP shard),
// nl = nc/t (local). q_pos / k_pos hold the int32 positions bit for bit in float-sized elements.
struct TpcpCacheBuffers {
  kernels::OpsBuffer q_pos;     // [T/c] the CP shard's positions (ZigzagPositions)
  kernels::OpsBuffer k_pos;     // [T] ZigzagOrder(T, c)
  kernels::OpsBuffer x;         // [nl, C] block input (local tokens)
  kernels::OpsBuffer rstd1;     // [nl]
  kernels::OpsBuffer n1;        // [nc, C] TP-gathered rmsnorm(x, ln1)
  kernels::OpsBuffer q;         // [nc, C/t] own heads
  kernels::OpsBuffer kv;        // [B, T, 2C/t] own heads' k | v of every token (CP-gathered)
  kernels::OpsBuffer att, lse;  // [nc, C/t], [B, H/t, T/c]
  kernels::OpsBuffer h;         // [nl, C]
  kernels::OpsBuffer rstd2;     // [nl]
  kernels::OpsBuffer n2;        // [nc, C] TP-gathered rmsnorm(h, ln2)
  kernels::OpsBuffer g, u, m;   // [nc, FF/t]
};
struct TpcpCache {
  int64_t B = 0, T = 0;
  std::shared_ptr<TpcpCacheBuffers> buffers;  // shared by copies of the cache; null before Forward
  // The bytes of the cached tensors (positions included); 0 before Forward.
  int64_t bytes() const;
};

class TpcpBlock {
 public:
  // tp and cp must outlive the block; t = tp->size(), tp_index = tp->rank(), likewise cp.
  TpcpBlock(const BlockConfig& cfg, Communicator* tp, Communicator* cp)
      : cfg_(cfg), tp_(tp), cp_(cp) {}
  const BlockConfig& config() const { return cfg_; }

  // y_local [B, T/(c*t), C] from x_local (this rank's tokens, as above), all in `ops`' memory
  // (sizes are the caller's responsibility). shard is the TP+SP shard tp_index of t. cache may
  // be null (no backward). InvalidArgument on bad shapes or null pointers; communication errors
  // as the Communicators report them.
  absl::Status Forward(const kernels::TransformerOps& ops, const TpspShardView& shard,
                       const float* x_local, int64_t B, int64_t T, float* y_local,
                       TpcpCache* cache) const;

  // From dy_local [B, T/(c*t), C]: writes dx_local and accumulates (+=) the shard's complete
  // weight gradients (shard shapes, summed over every rank's tokens; identical on the CP
  // group's ranks) into grads, which must be initialised (e.g. zeroed with ops.Fill, or
  // SizeTpspGrads for host vectors).
  absl::Status Backward(const kernels::TransformerOps& ops, const TpspShardView& shard,
                        const TpcpCache& cache, const float* dy_local, float* dx_local,
                        const TpspGradsView& grads) const;

 private:
  absl::Status Check() const;

  BlockConfig cfg_;
  Communicator* tp_;
  Communicator* cp_;
};

}  // namespace parallel
}  // namespace stallfree
