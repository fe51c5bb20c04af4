// The single-rank reference that the TSP layers are checked against: PyTorch's pre-norm
// transformer block (tests/testdata/torch/block_seed*/manifest.json) and a small GPT-style model
// built from it, forward and backward, composed from the device-neutral ops of kernels/ops.h.
//
//   block:  h = x + attn(rmsnorm(x, ln1)),  y = h + mlp(rmsnorm(h, ln2))
//     attn(n) = softmax_causal(q k^T / sqrt(C/H)) v Wo^T per head, q = n Wq^T, k = n Wk^T,
//               v = n Wv^T, head i = features [i*C/H, (i+1)*C/H); no positional encoding, no
//               biases; causal over the given global positions (key j visible to query i iff
//               pos[j] <= pos[i]), so a zigzag-ordered local sequence attends correctly.
//     mlp(n)  = (silu(n Wg^T) * (n Wu^T)) Wd^T
//   model:  x0 = embedding[tokens] (+ pos_embedding[pos] with learned positions, pos = each
//           token's GLOBAL position); x_{l+1} = block_l(x_l);
//           logits = rmsnorm(x_L, ln_f) head^T, or rmsnorm(x_L, ln_f) embedding^T with a tied
//           head (the embedding's gradient then sums the lookup's and the head's parts);
//           loss = mean over valid targets (target >= 0) of cross-entropy(logits, target).
//
// Every W is [out, in] as in F.linear. Tensors are row-major host memory (std::vector or host
// pointers), so the ops must be a host backend: kernels::CpuOps(). Gradients are accumulated
// (+=) into the caller's BlockGrads / ModelGrads; an empty field is first sized and zeroed.
// The classes hold only their configuration: const methods, safe to share between threads as
// long as each call has its own cache.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"

namespace stallfree {
namespace parallel {

struct BlockConfig {
  int64_t C = 0;      // Model width.
  int64_t H = 0;      // Attention heads; C % H == 0.
  int64_t FF = 0;     // MLP hidden width.
  float eps = 1e-5f;  // RMSNorm epsilon.
};

// OK iff C, H, FF > 0, C % H == 0 and eps > 0.
absl::Status ValidateBlockConfig(const BlockConfig& cfg);

struct BlockWeights {
  std::vector<float> ln1;             // [C]
  std::vector<float> wq, wk, wv, wo;  // [C, C]
  std::vector<float> ln2;             // [C]
  std::vector<float> wg, wu;          // [FF, C]
  std::vector<float> wd;              // [C, FF]

  // Every field sized for cfg and zero.
  static BlockWeights Zeros(const BlockConfig& cfg);
  // The fields in declaration order (for loops over all tensors: init, tests, flattening).
  std::vector<std::vector<float>*> Tensors();
  std::vector<const std::vector<float>*> Tensors() const;
};
// The gradients have the weights' fields and shapes.
using BlockGrads = BlockWeights;

// The field names in declaration order, matching BlockWeights::Tensors():
// "ln1", "Wq", "Wk", "Wv", "Wo", "ln2", "Wg", "Wu", "Wd" (the manifest's names).
const std::vector<const char*>& BlockTensorNames();

// OK iff every field of w has its shape for cfg.
absl::Status CheckBlockWeights(const BlockConfig& cfg, const BlockWeights& w);

// What the backward needs from the forward (n = B * T tokens).
struct BlockCache {
  int64_t B = 0, T = 0;
  std::vector<int32_t> positions;  // [T]
  std::vector<float> x;            // [n, C] the block input
  std::vector<float> n1, rstd1;    // rmsnorm(x, ln1) [n, C], its rstd [n]
  std::vector<float> qkv;          // [n, 3C]: q | k | v per token
  std::vector<float> att, lse;     // attention output [n, C] (before Wo), lse [B, H, T]
  std::vector<float> h;            // [n, C]
  std::vector<float> n2, rstd2;    // rmsnorm(h, ln2) [n, C], its rstd [n]
  std::vector<float> g, u, m;      // n2 Wg^T, n2 Wu^T, silu(g) * u: [n, FF]
};

class ReferenceBlock {
 public:
  explicit ReferenceBlock(const BlockConfig& cfg) : cfg_(cfg) {}
  const BlockConfig& config() const { return cfg_; }

  // y [B, T, C] from x [B, T, C]; positions [T] are the tokens' global positions (shared by
  // every batch row), e.g. 0..T-1 or a rank's ZigzagPositions. y must not overlap x. cache may
  // be null (no backward). InvalidArgument on a bad config, weight shape, B or T.
  absl::Status Forward(const kernels::TransformerOps& ops, const BlockWeights& w, const float* x,
                       const int32_t* positions, int64_t B, int64_t T, float* y,
                       BlockCache* cache) const;

  // From dy = dL/dy [B, T, C] (the cache's B, T): writes dx [B, T, C] and accumulates (+=)
  // every weight gradient into grads. dx must not overlap dy.
  absl::Status Backward(const kernels::TransformerOps& ops, const BlockWeights& w,
                        const BlockCache& cache, const float* dy, float* dx,
                        BlockGrads* grads) const;

 private:
  BlockConfig cfg_;
};

struct ModelConfig {
  int64_t vocab = 0;
  int64_t C = 0;
  int64_t H = 0;
  int64_t FF = 0;
  int64_t layers = 0;
  float eps = 1e-5f;
  // Learned absolute positions: x0 += pos_embedding[global position]. max_seq is the table's
  // rows: required > 0 with learned_positions, and every position used must be < max_seq
  // (ignored otherwise). The default (false) is a position-free model.
  bool learned_positions = false;
  int64_t max_seq = 0;
  // The output head shares the embedding's [vocab, C] matrix (ModelWeights::head stays empty).
  bool tied_head = false;

  BlockConfig block() const { return BlockConfig{C, H, FF, eps}; }
};

// OK iff vocab > 0, layers > 0, block() is valid, max_seq >= 0 (and > 0 with
// learned_positions).
absl::Status ValidateModelConfig(const ModelConfig& cfg);

// The sizes of the optional tensors for cfg: max_seq * C with learned positions, else 0;
// vocab * C with an untied head, else 0.
int64_t PosEmbeddingSize(const ModelConfig& cfg);
int64_t HeadSize(const ModelConfig& cfg);

struct ModelWeights {
  std::vector<float> embedding;      // [vocab, C]
  std::vector<float> pos_embedding;  // [max_seq, C] when learned_positions, else empty
  std::vector<BlockWeights> blocks;  // [layers]
  std::vector<float> ln_f;           // [C]
  std::vector<float> head;           // [vocab, C]; empty when tied_head

  // Every tensor of cfg sized and zero (pos_embedding / head empty when cfg has none).
  static ModelWeights Zeros(const ModelConfig& cfg);
  // Every tensor: embedding, pos_embedding if non-empty, each block's Tensors(), ln_f, head if
  // non-empty. For weights (or gradients) of a config this matches ModelTensorNames(cfg).
  std::vector<std::vector<float>*> Tensors();
  std::vector<const std::vector<float>*> Tensors() const;
};
using ModelGrads = ModelWeights;

// Names matching ModelWeights::Tensors(): "embedding", "pos_embedding" (learned positions only),
// "block0.ln1", ..., "ln_f", "head" (untied head only).
std::vector<std::string> ModelTensorNames(const ModelConfig& cfg);

absl::Status CheckModelWeights(const ModelConfig& cfg, const ModelWeights& w);

// Deterministic initialization from seed (std::mt19937; normals by Box-Muller from its raw
// 32-bit outputs, so the values do not depend on the standard library): every matrix is
// normal(0, stddev); the residual-branch outputs Wo and Wd are further scaled by 1/sqrt(2 layers)
// (GPT-2); RMSNorm weights (ln1, ln2, ln_f) are 1 + norm_jitter * normal (1 exactly for the
// default 0). Tensors are drawn in Tensors() order (pos_embedding normal(0, stddev) right after
// the embedding; no head drawn when tied), so the default config's values do not depend on the
// two options' existence, and a tied model equals the untied one of the same seed without head.
ModelWeights InitModelWeights(const ModelConfig& cfg, uint32_t seed, float stddev = 0.02f,
                              float norm_jitter = 0.0f);

struct ModelCache {
  int64_t B = 0, T = 0;
  int64_t valid = 0;  // targets >= 0
  std::vector<int32_t> tokens, targets, positions;
  std::vector<BlockCache> blocks;  // [layers]
  std::vector<float> x_final;      // [n, C] the last block's output
  std::vector<float> nf, rstd_f;   // rmsnorm(x_final, ln_f) [n, C], rstd [n]
  std::vector<float> logits, lse;  // [n, vocab], [n]
};

class ReferenceModel {
 public:
  explicit ReferenceModel(const ModelConfig& cfg) : cfg_(cfg) {}
  const ModelConfig& config() const { return cfg_; }

  // The mean cross-entropy over the targets >= 0 (0 when there are none) of tokens [B, T]
  // predicting targets [B, T]; tokens in [0, vocab), targets in [-1, vocab) (negative =
  // ignored). positions [T] as in ReferenceBlock::Forward, or null for 0..T-1; with learned
  // positions they also index pos_embedding (InvalidArgument unless in [0, max_seq)). The loss
  // sums the per-token fp32 losses in double. cache may be null.
  absl::StatusOr<double> Forward(const kernels::TransformerOps& ops, const ModelWeights& w,
                                 const int32_t* tokens, const int32_t* targets, int64_t B,
                                 int64_t T, const int32_t* positions, ModelCache* cache) const;

  // Accumulates (+=) d loss / d every weight into grads.
  absl::Status Backward(const kernels::TransformerOps& ops, const ModelWeights& w,
                        const ModelCache& cache, ModelGrads* grads) const;

 private:
  ModelConfig cfg_;
};

}  // namespace parallel
}  // namespace stallfree
