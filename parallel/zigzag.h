// The zigzag sequence partition of TSP (ARCHITECTURE.md, "TSP"): for D ranks and a sequence of
// T tokens (T divisible by 2D), the sequence is cut into 2D chunks of T / (2D) tokens and rank p
// owns chunks p and 2D-1-p, in that local order. Every rank then holds T / D tokens and the same
// causal attention work (sum over its positions of pos + 1). Positions stay global: a rank's
// local sequence is attended with ZigzagPositions as q_pos / k_pos.
//
// Tensors are row-major, host memory: a full sequence is [B, T, C], a rank's shard [B, T/D, C]
// (the same B rows, each with that rank's T/D tokens in local order).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace stallfree {
namespace parallel {

// OK iff D >= 1, 0 <= p < D, T > 0, T divisible by 2D and T < 2^31 (positions are int32);
// InvalidArgument otherwise.
absl::Status CheckZigzag(int64_t T, int64_t D, int64_t p);

// The global positions rank p holds, in its local order: chunk p, then chunk 2D-1-p.
absl::StatusOr<std::vector<int32_t>> ZigzagPositions(int64_t T, int64_t D, int64_t p);

// Every rank's positions concatenated (rank 0's, then rank 1's, ...): a permutation of 0..T-1.
// Element i is the global position of the i-th token of the zigzag-ordered sequence.
absl::StatusOr<std::vector<int32_t>> ZigzagOrder(int64_t T, int64_t D);

// local[b, i, :] = full[b, ZigzagPositions(T, D, p)[i], :]; full [B, T, C], local [B, T/D, C].
absl::Status ZigzagScatter(const float* full, int64_t B, int64_t T, int64_t C, int64_t D, int64_t p,
                           float* local);

// The inverse for one rank: writes rank p's shard into its rows of full (other rows untouched).
absl::Status ZigzagGatherRank(const float* local, int64_t B, int64_t T, int64_t C, int64_t D,
                              int64_t p, float* full);

// The inverse for all ranks: locals[p] is rank p's shard [B, T/D, C] (locals.size() == D);
// writes every row of full [B, T, C].
absl::Status ZigzagGather(absl::Span<const float* const> locals, int64_t B, int64_t T, int64_t C,
                          float* full);

}  // namespace parallel
}  // namespace stallfree
