// A trainer rank's share of data parallelism (--dp N > 1, trainer/gpt.h): the partition of its
// tensors' rows over the N replicas (engine/partition.h), the gradient average over the replicas
// after the backward, and the all-gather of every replica's updated row blocks after the step.
//
// Between round boundaries a zenflow step changes only the hot columns of the weights the
// engine splits (and the tensors wholly on the device): the cold columns change only where a
// daemon update lands, at a boundary. So those steps gather only the hot columns of the split
// weights; boundary steps (and the final Flush) gather everything.
//
// Internal to the trainer. The calls are collective over the data-parallel group; with N = 1
// each is a no-op. Not thread safe.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "engine/partition.h"
#include "engine/zenflow.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "trainer/device.h"
#include "trainer/shard.h"

namespace stallfree {
namespace trainer {

// The data-parallel partition of a rank's tensors over N replicas (engine/partition.h): a
// tensor of shape [..., cols] is rows = numel / cols rows (a 1-D one: numel rows of one column);
// replica q owns the row block blocks[q]. The all-gather after a step packs each replica's
// blocks into a slot of `slot` elements of the model's dtype (a bf16 model's: an even number, a
// whole number of floats), tensor i at `offset[i]` padded to its largest block.
struct DpPartition {
  struct Part {
    int64_t rows = 0, cols = 1;
    std::vector<RowBlock> blocks;  // per replica
    bool replicated = false;       // fewer rows than replicas: every replica holds it whole
    int64_t offset = 0;            // in a replica's slot (partitioned tensors)
  };
  std::vector<Part> parts;  // per tensor
  int64_t slot = 0;

  DpPartition(const std::vector<Tensor>& tensors, int N);

  // Tensor i's view for replica q's engine: its block's rows (the whole tensor when N is 1) of
  // the stored value and gradient.
  EngineParam View(const Tensor& t, size_t i, int q, int N) const;
};

class DataParallelSync {
 public:
  // `group`: the data-parallel group on the device's memory (null with N = 1). `dev` and
  // `tensors` must outlive this object.
  DataParallelSync(const RankDevice& dev, parallel::Communicator* group,
                   const std::vector<Tensor>& tensors, int N, int replica, bool bf16);
  DataParallelSync(const DataParallelSync&) = delete;
  DataParallelSync& operator=(const DataParallelSync&) = delete;

  const DpPartition& partition() const { return partition_; }
  // Allocates the all-gather's buffers in device memory (N x partition().slot elements of the
  // model's dtype; a bf16 slot is an even number of elements, moved as floats: the collective
  // copies their bits) and, for a bf16 model, the column list of whole-block copies.
  absl::Status Init();
  // Gradients := their mean over the replicas (each tensor's all-reduced where it lies, issued
  // together, waited together, then scaled by 1/N in place).
  absl::Status AverageGrads();
  // Every replica's updated blocks to every replica: one all-gather of the packed blocks, of
  // their hot columns only where `hot_only` (engine: the hot sets).
  absl::Status GatherBlocks(bool hot_only, ZenFlowEngine* engine);
  // Seconds spent in AverageGrads and GatherBlocks.
  double seconds() const { return seconds_; }

 private:
  // The hot columns' layout (made at the first hot-only gather: the hot sets exist from step 1's
  // selection on, and their sizes never change) and the hot columns on the device, refreshed at
  // the first hot-only gather after a full one (reselections happen only at boundaries).
  absl::Status RefreshHotColumns(ZenFlowEngine* engine);
  // Replica q's block of tensor i to (or, `unpack`, from) `packed`, its place in a slot.
  void Pack(size_t i, int q, char* packed, bool unpack, bool hot_only) const;
  // Where tensor i's block of replica slot `index` is in `buf` (slots of `slot` elements).
  char* SlotAt(const kernels::OpsBuffer& buf, int64_t index, size_t i, bool hot_only,
               int64_t slot) const;
  int64_t SlotFloats(int64_t slot) const { return bf16_ ? slot / 2 : slot; }

  const RankDevice& dev_;
  parallel::Communicator* group_;
  const std::vector<Tensor>& tensors_;
  const int N_, replica_;
  const bool bf16_;
  const DpPartition partition_;
  kernels::OpsBuffer send_, recv_;
  // A bf16 model's whole-block copies: GatherColumns / ScatterColumns of every column (0, 1, ...
  // up to the widest tensor's; int64 as 2 floats).
  kernels::OpsBuffer all_columns_;
  // The hot-only gather: tensor i's hot columns packed [rows, k] at hot_offset_[i] in a slot of
  // hot_slot_ elements (of the model's dtype; even for bf16); hot_idx_[i]: the hot columns on
  // the device (int64 as 2 floats).
  std::vector<int64_t> hot_k_, hot_offset_;
  std::vector<kernels::OpsBuffer> hot_idx_;
  int64_t hot_slot_ = -1;  // -1: no layout yet
  bool hot_stale_ = true;
  double seconds_ = 0;
};

}  // namespace trainer
}  // namespace stallfree
