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

#include <algorithm>
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
  if (shape.size() <= 1) return {shape.empty() ? 1 : shape[0], 1};
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  return {rows, shape.back()};
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

// Who cut a run's parameters into the ranks' rows. kEven: this partition (PartitionRows above).
// kFsdp2: FSDP2's fully_shard, whose ranks each hold a chunk of dimension 0, ceil(d0 / world)
// of its indices (as torch.chunk cuts it: the last ranks' chunks short, or empty), each index
// being rows/d0 of the rows; never replicated.
enum class RowLayout { kEven, kFsdp2 };

// Rank `rank`'s share of a parameter of `shape` over `world` ranks: its rows, and the shape its
// engine sees. kEven: [rows of the block, cols] ([rows of the block] for a 1-D parameter), or the
// whole shape ([1] for a scalar) where the rank holds the parameter whole (world 1,
// replicated). kFsdp2: the shape with dimension 0 cut to the rank's chunk (FSDP2's local
// tensor's).
struct ShareOf {
  RowShape whole;
  RowBlock block;
  std::vector<int64_t> shape;
  int64_t first() const { return block.begin * whole.cols; }  // its first element
  int64_t end() const { return block.end * whole.cols; }
};
inline ShareOf ShareOfParam(const std::vector<int64_t>& shape, int world, int rank,
                            RowLayout layout = RowLayout::kEven) {
  ShareOf s;
  s.whole = RowsOf(shape);
  if (layout == RowLayout::kFsdp2 && !shape.empty()) {
    const int64_t d0 = shape[0];
    const int64_t per = d0 == 0 ? 0 : s.whole.rows / d0;  // rows an index of dimension 0 holds
    const int64_t chunk = world <= 1 ? d0 : (d0 + world - 1) / world;
    const int64_t b = std::min(d0, chunk * rank), e = std::min(d0, chunk * (rank + 1));
    s.block.begin = b * per;
    s.block.end = e * per;
    s.shape = shape;
    s.shape[0] = e - b;
    return s;
  }
  s.block = PartitionRows(s.whole.rows, world, rank);
  if (world <= 1 || s.block.replicated) {
    s.shape = shape.empty() ? std::vector<int64_t>{1} : shape;
  } else {
    s.shape = {s.block.rows()};
    if (shape.size() >= 2) s.shape.push_back(s.whole.cols);
  }
  return s;
}

}  // namespace stallfree
