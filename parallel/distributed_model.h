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
// any communication, so bad arguments fail on every rank alike). All tensors are host memory:
// `ops` must be a host backend (kernels::CpuOps()) and the Communicator a host one (Gloo).
#pragma once

#include <cstdint>
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

// What the backward needs (nl = B T/D local tokens).
struct DistributedCache {
  int64_t B = 0, T = 0;
  int64_t valid = 0;                     // valid targets of the global batch
  std::vector<int32_t> positions;        // [T/D] the local tokens' global positions
  std::vector<int32_t> tokens, targets;  // [nl] local
  std::vector<TspCache> tsp_blocks;      // [layers] (kTsp)
  std::vector<TpspCache> tpsp_blocks;    // [layers] (kTpsp)
  std::vector<float> x_final;            // [nl, C] the last block's output
  std::vector<float> nf, rstd_f;         // [nl, C], [nl]
  std::vector<float> logits, lse;        // [nl, vocab], [nl]
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

  // Collective: every rank's shard gradients reassembled in the full ModelGrads layout, returned
  // on every rank (one all-gather per block; the replicated tensors are copied from this rank's
  // grads). For tests and checkpoints.
  absl::StatusOr<ModelGrads> GatherGrads(const DistributedGrads& grads) const;

 private:
  absl::Status CheckShard(const DistributedShard& w, const char* what) const;

  ModelConfig cfg_;
  Layout layout_;
  Communicator* comm_;
};

}  // namespace parallel
}  // namespace stallfree
