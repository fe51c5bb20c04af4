// The data-parallel partition of the offloaded optimizer state (ARCHITECTURE.md, "Scale-out"),
// the one rule the PyTorch optimizer (python/stallfree/torch.py) and the trainer (--dp) share.
//
// A parameter of shape [d0, ..., dn] is `rows` = d0 * ... * d(n-1) rows of dn columns (a 1-D
// parameter: numel rows of one column), contiguous in memory. Over `world` data-parallel ranks,
// rank r owns rows [rows * r / world, rows * (r + 1) / world): every rank a contiguous block of
// every parameter, the blocks differing by at most one row, so each rank's engine offloads,
// pushes and updates 1/world of every weight (and holds 1/world of its hot columns' state). The
// ranks' column scores of a block sum to the whole weight's, so an all-reduce (sum) of the
// scores gives every rank the same hot set. A parameter with fewer rows than ranks is not worth
// splitting: every rank holds it whole (replicated) and steps it identically.
#pragma once

#include <cstdint>
#include <vector>

namespace stallfree {

struct RowBlock {
  int64_t begin = 0, end = 0;  // rows [begin, end) of the parameter
  bool replicated = false;     // every rank holds the whole parameter
  int64_t rows() const { return end - begin; }
};

// A parameter's rows and columns by the rule above (an empty shape, a scalar: one of each).
struct RowShape {
  int64_t rows = 1, cols = 1;
};
inline RowShape RowsOf(const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (shape.size() <= 1) return {numel, 1};
  return {numel / shape.back(), shape.back()};
}

inline RowBlock PartitionRows(int64_t rows, int world, int rank) {
  RowBlock b;
  if (world <= 1 || rows < world) {
    b.end = rows;
    b.replicated = world > 1;
    return b;
  }
  b.begin = rows * rank / world;
  b.end = rows * (rank + 1) / world;
  return b;
}

}  // namespace stallfree
