// The model of ReferenceModel (parallel/reference_block.h) on the D = comm->size() ranks of one
// Communicator, in one of two layouts of its blocks:
//   kTsp:  TspBlock (parallel/tsp_block.h); rank p holds the zigzag tokens ZigzagPositions(T, D,
//          p) of every batch row (T divisible by 2D).
//   kTpsp: TpspBlock (parallel/tpsp_block.h); rank p holds the contiguous tokens
//          [p T/D, (p+1) T/D) of every batch row (T divisible by D).
// Around the blocks (the same in both layouts):
//   embedding [vocab, C]: replicated; each rank looks up its own tokens. Its gradient is the
//                         all-reduced sum of the ranks' partial (own-token) gradients.
//   pos_embedding [max_seq, C] (learned_positions only): replicated; each rank adds the rows of
//                         its tokens' GLOBAL positions (LocalPositions), so the model equals the
//                         reference; gradient all-reduced like the embedding's.
//   ln_f [C], head [vocab, C]: replicated; each rank normalises its own tokens and computes
//                         their logits; gradients all-reduced like the embedding's. With
//                         tied_head there is no head: the logits use the embedding, whose
//                         partial gradient also takes the head's part.
//   The replicated tensors' partial gradients travel in ONE all-reduce of
//   (vocab + max_seq' + 1 + vocab') C floats (max_seq' = 0 without learned positions,
//   vocab' = 0 when tied).
//   loss: cross-entropy per local token; the mean over ALL valid targets (>= 0) of the global
//         batch: every rank all-gathers each rank's (loss sum, valid count) and adds them in
//         rank order in double, so the loss is bit-identical on every rank. The backward scales
//         the local rows by 1 / global valid count.
//
// Callers pass the full tokens / targets [B, T] on every rank (small int arrays); each rank
// picks its own. Every rank must call Forward / Backward / GatherGrads with the same config,
// layout, B, T, tokens and targets (they are collective calls; the argument checks run before
// any communication, so bad arguments fail on every rank alike).
//
// Memory spaces (as the blocks', parallel/tsp_block.h). tokens / targets are host memory in
// both forms; the model's tensors are where the form puts them:
// - The DistributedShard / DistributedGrads overloads are the CPU API: their std::vectors are
//   host memory, so `ops` must be a host backend (kernels::CpuOps()) and the Communicator a host
//   one (Gloo); the cache keeps its activations in its std::vectors (the TP+SP blocks', which
//   have only a view API, in their OpsBuffers of `ops`, host memory here).
// - The DistributedShardView / DistributedGradsView overloads take pointers in the backend's
//   memory (device memory for a CUDA backend), and the Communicator must accept that memory
//   (NCCL on the same device, in stream order with the backend's ops). The cache then keeps its
//   activations, and the local tokens / targets / position ids (int32 bits in float-sized
//   elements), in DistributedCache::buffers and its blocks' buffers; the replicated gradients'
//   all-reduce and the loss's all-gather run on backend memory. The only data that comes back
//   to the host is the loss: the nl per-token losses (one Download), added in double on the host
//   exactly as the CPU API does, so both forms give the same loss bit for bit on a host
//   backend, and then the ranks' (sum, count) after their all-gather.
// Both forms run the same operations in the same order: on a host backend their losses and
// gradients are bit-identical.
//
// A step on a GPU rank (cuda_ops on the stream of the NCCL communicator `nccl`; w and g views of
// OpsBuffers of cuda_ops holding the rank's shard and its zeroed gradients):
//   DistributedModel model(cfg, Layout::kTsp, nccl);
//   DistributedCache cache;
//   ASSIGN_OR_RETURN(double loss, model.Forward(cuda_ops, w, tokens, targets, B, T, &cache));
//   RETURN_IF_ERROR(model.Backward(cuda_ops, w, cache, g));  // g += d loss / d shard
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
#include "parallel/tsp_block.h"

namespace stallfree {
namespace parallel {

enum class Layout { kTsp, kTpsp };
const char* LayoutName(Layout layout);  // "tsp", "tpsp"

// Rank p's weights (and, with the same layout, its gradients). Exactly one of tsp_blocks /
// tpsp_blocks has `layers` entries (the one of the model's layout); the other is empty.
struct DistributedShard {
  std::vector<float> embedding;           // [vocab, C] replicated
  std::vector<float> pos_embedding;       // [max_seq, C] replicated (learned positions), or empty
  std::vector<TspShard> tsp_blocks;       // kTsp: ShardBlockWeights(block l, D, p)
  std::vector<BlockWeights> tpsp_blocks;  // kTpsp: ShardTpspWeights(block l, D, p)
  std::vector<float> ln_f;                // [C] replicated
  std::vector<float> head;                // [vocab, C] replicated; empty when tied_head
};
using DistributedGrads = DistributedShard;

// The same tensors as pointers into the backend's memory (see "Memory spaces"). Exactly one of
// tsp_blocks / tpsp_blocks has `layers` entries (the model's layout); the other is empty.
struct DistributedShardView {
  const float* embedding = nullptr;        // [vocab, C]
  const float* pos_embedding = nullptr;    // [max_seq, C] with learned positions; else null
  std::vector<TspShardView> tsp_blocks;    // kTsp
  std::vector<TpspShardView> tpsp_blocks;  // kTpsp
  const float* ln_f = nullptr;             // [C]
  const float* head = nullptr;             // [vocab, C]; null when tied_head
};
// Gradients in the backend's memory, the shapes of DistributedShardView. Backward accumulates
// (+=) into them, so they must be initialised (e.g. zeroed with ops.Fill).
struct DistributedGradsView {
  float* embedding = nullptr;
  float* pos_embedding = nullptr;  // null without learned positions
  std::vector<TspGradsView> tsp_blocks;
  std::vector<TpspGradsView> tpsp_blocks;
  float* ln_f = nullptr;
  float* head = nullptr;  // null when tied_head (the embedding takes the head's part)
};

// The cache's tensors in the backend's memory (the view Forward). tokens, targets and pos_ids
// hold int32 bit for bit in float-sized elements; pos_ids (each local token's global position)
// is empty without learned positions.
struct DistributedCacheBuffers {
  kernels::OpsBuffer tokens, targets, pos_ids;  // [nl] each
  kernels::OpsBuffer x_final, nf, rstd_f;       // [nl, C], [nl, C], [nl]
  kernels::OpsBuffer logits, lse;               // [nl, vocab], [nl]
};

// What the backward needs (nl = B T/D local tokens). Both Forward overloads fill the host
// metadata (B, T, valid, positions, tokens, targets); the CPU API fills the float vectors and
// the TSP blocks' vector caches, the view form leaves the float vectors empty and fills
// `buffers` and the TSP blocks' buffers instead (shared by copies of the cache). The TP+SP
// blocks' caches are in their buffers in both forms.
struct DistributedCache {
  int64_t B = 0, T = 0;
  int64_t valid = 0;                                 // valid targets of the global batch
  std::vector<int32_t> positions;                    // [T/D] the local tokens' global positions
  std::vector<int32_t> tokens, targets;              // [nl] local
  std::vector<TspCache> tsp_blocks;                  // [layers] (kTsp)
  std::vector<TpspCache> tpsp_blocks;                // [layers] (kTpsp)
  std::vector<float> x_final;                        // [nl, C] the last block's output
  std::vector<float> nf, rstd_f;                     // [nl, C], [nl]
  std::vector<float> logits, lse;                    // [nl, vocab], [nl]
  std::shared_ptr<DistributedCacheBuffers> buffers;  // the view form's tensors, or null
};

class DistributedModel {
 public:
  // comm must outlive the model; its rank / size are p / D.
  DistributedModel(const ModelConfig& cfg, Layout layout, Communicator* comm)
      : cfg_(cfg), layout_(layout), comm_(comm) {}
  const ModelConfig& config() const { return cfg_; }
  Layout layout() const { return layout_; }

  // OK iff the config is valid for the layout and D (H % D == 0, FF % D == 0).
  absl::Status Validate() const;

  // This rank's shard of full weights (local; no communication). InvalidArgument on a bad
  // config or weight shape.
  absl::StatusOr<DistributedShard> Shard(const ModelWeights& full) const;

  // The global positions of this rank's tokens in a length-T row, in local order. InvalidArgument
  // if T does not divide for the layout (2D for kTsp, D for kTpsp).
  absl::StatusOr<std::vector<int32_t>> LocalPositions(int64_t T) const;

  // The mean cross-entropy over the valid targets of the global batch (0 when there are none),
  // the same on every rank. tokens / targets: the full [B, T] arrays (tokens in [0, vocab),
  // targets in [-1, vocab)); with learned positions T <= max_seq. cache may be null (no
  // backward).
  absl::StatusOr<double> Forward(const kernels::TransformerOps& ops, const DistributedShard& w,
                                 const int32_t* tokens, const int32_t* targets, int64_t B,
                                 int64_t T, DistributedCache* cache) const;

  // Accumulates (+=) d loss / d this rank's shard into grads (empty fields are first sized and
  // zeroed): block shards as the blocks' Backward gives them, and the all-reduced (full)
  // embedding, pos_embedding, ln_f and head gradients (those the config has).
  absl::Status Backward(const kernels::TransformerOps& ops, const DistributedShard& w,
                        const DistributedCache& cache, DistributedGrads* grads) const;

  // The same in the backend's memory (see "Memory spaces"): every pointer of w and grads in
  // `ops`' memory (sizes are the caller's responsibility; the pointers' presence is checked
  // against the config and layout). tokens / targets are host memory, as above. The view
  // Backward needs a cache from the view Forward with the same backend (the CPU-API Backward
  // also accepts one, on a host backend); grads is accumulated (+=).
  absl::StatusOr<double> Forward(const kernels::TransformerOps& ops, const DistributedShardView& w,
                                 const int32_t* tokens, const int32_t* targets, int64_t B,
                                 int64_t T, DistributedCache* cache) const;
  absl::Status Backward(const kernels::TransformerOps& ops, const DistributedShardView& w,
                        const DistributedCache& cache, const DistributedGradsView& grads) const;

  // Collective: every rank's shard gradients reassembled in the full ModelGrads layout, returned
  // on every rank (one all-gather per block; the replicated tensors are copied from this rank's
  // grads). For tests and checkpoints.
  absl::StatusOr<ModelGrads> GatherGrads(const DistributedGrads& grads) const;

 private:
  // Where the weights / gradients of either form are (defined in the .cc).
  struct WeightRefs;
  struct GradRefs;

  // The weights of either form as WeightRefs (head: the embedding when tied).
  WeightRefs RefsOf(const DistributedShard& w) const;
  WeightRefs RefsOf(const DistributedShardView& w) const;
  absl::Status CheckShard(const DistributedShard& w, const char* what) const;
  template <class View>
  absl::Status CheckView(const View& v, const char* what) const;
  // The shared forward / backward of both forms, after their argument checks.
  absl::StatusOr<double> ForwardImpl(const kernels::TransformerOps& ops, const WeightRefs& w,
                                     const int32_t* tokens, const int32_t* targets, int64_t B,
                                     int64_t T, DistributedCache* cache) const;
  // The forward's steps. SelectTokens checks the batch and fills the cache's host metadata (B, T,
  // positions, this rank's tokens and targets); returns the local valid targets.
  absl::StatusOr<int64_t> SelectTokens(const int32_t* tokens, const int32_t* targets, int64_t B,
                                       int64_t T, DistributedCache* c) const;
  // Sizes the cache's tensors: OpsBuffers of ops (backend: the view form) or the vectors.
  void AllocateCache(const kernels::TransformerOps& ops, bool backend,
                     const std::vector<int32_t>& pos_ids, DistributedCache* c) const;
  // The embedding and the blocks; the last block's output in x_final.
  absl::Status BlocksForward(const kernels::TransformerOps& ops, const WeightRefs& w,
                             const int32_t* tokens, const int32_t* pos_ids, float* x_final,
                             DistributedCache* c) const;
  // The mean over the global batch's valid targets of this rank's loss sum and count (c->valid).
  absl::StatusOr<double> GlobalMeanLoss(const kernels::TransformerOps& ops, double sum,
                                        int64_t local_valid, DistributedCache* c) const;
  absl::Status CheckCache(const DistributedCache& c) const;
  absl::Status BackwardImpl(const kernels::TransformerOps& ops, const WeightRefs& w,
                            const DistributedCache& c, const GradRefs& g) const;

  ModelConfig cfg_;
  Layout layout_;
  Communicator* comm_;
};

}  // namespace parallel
}  // namespace stallfree
