#include "trainer/data_parallel.h"

#include <algorithm>
#include <memory>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "trainer/stopwatch.h"

namespace stallfree {
namespace trainer {

DpPartition::DpPartition(const std::vector<Tensor>& tensors, int N) {
  for (const Tensor& t : tensors) {
    Part p;
    const RowShape rc = RowsOf(t.shape);
    p.rows = rc.rows;
    p.cols = rc.cols;
    for (int q = 0; q < N; ++q) p.blocks.push_back(PartitionRows(p.rows, N, q));
    p.replicated = p.blocks[0].replicated;
    if (N > 1 && !p.replicated) {
      int64_t largest = 0;
      for (const RowBlock& b : p.blocks) largest = std::max(largest, b.rows());
      p.offset = slot;
      slot += largest * p.cols;
    }
    parts.push_back(std::move(p));
  }
  if (!tensors.empty() && tensors[0].bf16()) slot += slot % 2;
}

EngineParam DpPartition::View(const Tensor& t, size_t i, int q, int N) const {
  if (N == 1) return EngineParam{t.name, t.shape, t.stored_value(), t.stored_grad(), t.dtype()};
  const Part& p = parts[i];
  const RowBlock& b = p.blocks[q];
  std::vector<int64_t> shape =
      t.shape.size() >= 2 ? std::vector<int64_t>{b.rows(), p.cols} : std::vector<int64_t>{b.rows()};
  const int64_t skip = b.begin * p.cols * static_cast<int64_t>(t.elem_size());  // bytes
  return EngineParam{t.name, std::move(shape), static_cast<char*>(t.stored_value()) + skip,
                     static_cast<char*>(t.stored_grad()) + skip, t.dtype()};
}

DataParallelSync::DataParallelSync(const RankDevice& dev, parallel::Communicator* group,
                                   const std::vector<Tensor>& tensors, int N, int replica,
                                   bool bf16)
    : dev_(dev),
      group_(group),
      tensors_(tensors),
      N_(N),
      replica_(replica),
      bf16_(bf16),
      partition_(tensors, N),
      hot_k_(tensors.size(), 0),
      hot_offset_(tensors.size(), 0),
      hot_idx_(tensors.size()) {}

absl::Status DataParallelSync::Init() {
  if (N_ == 1) return absl::OkStatus();
  const kernels::TransformerOps& ops = dev_.ops();
  const int64_t floats = std::max<int64_t>(SlotFloats(partition_.slot), 1);
  send_ = kernels::OpsBuffer(&ops, floats);
  recv_ = kernels::OpsBuffer(&ops, N_ * floats);
  ops.Fill(send_.data(), floats, 0.0f);  // the padding
  if (bf16_) {
    int64_t widest = 1;
    for (const DpPartition::Part& p : partition_.parts) widest = std::max(widest, p.cols);
    std::vector<int64_t> idx(widest);
    std::iota(idx.begin(), idx.end(), int64_t{0});
    all_columns_ = kernels::OpsBuffer(&ops, 2 * widest);
    ops.Upload(all_columns_.data(), reinterpret_cast<const float*>(idx.data()), 2 * widest);
    RETURN_IF_ERROR(dev_.Synchronize());
  }
  return absl::OkStatus();
}

absl::Status DataParallelSync::AverageGrads() {
  if (N_ == 1) return absl::OkStatus();
  const auto t0 = Clock::now();
  std::vector<std::shared_ptr<parallel::Work>> works;
  for (const Tensor& t : tensors_) works.push_back(group_->IAllReduce(t.grad, t.numel));
  for (auto& w : works) RETURN_IF_ERROR(w->Wait());
  for (const Tensor& t : tensors_)
    dev_.kernel().Accumulate(t.grad, t.grad, kernels::GradType::kFp32,
                             1.0f / static_cast<float>(N_), t.numel,
                             kernels::AccumulateMode::kOverwrite);
  RETURN_IF_ERROR(dev_.Synchronize());
  seconds_ += SecondsSince(t0);
  return absl::OkStatus();
}

absl::Status DataParallelSync::RefreshHotColumns(ZenFlowEngine* engine) {
  const bool layout = hot_slot_ < 0;
  if (layout) hot_slot_ = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const DpPartition::Part& p = partition_.parts[i];
    if (p.replicated) continue;
    std::vector<int64_t> hot;
    if (!engine->OnDevice(i)) {
      ASSIGN_OR_RETURN(hot, engine->HotColumns(tensors_[i].name));
    }
    if (layout) {
      int64_t largest = 0;
      for (const RowBlock& b : p.blocks) largest = std::max(largest, b.rows());
      hot_k_[i] = static_cast<int64_t>(hot.size());
      if (hot_k_[i] > 0) hot_idx_[i] = kernels::OpsBuffer(&dev_.ops(), 2 * hot_k_[i]);
      hot_offset_[i] = hot_slot_;
      hot_slot_ += largest * (hot_k_[i] > 0 ? hot_k_[i] : p.cols);
    }
    if (static_cast<int64_t>(hot.size()) != hot_k_[i])
      return absl::InternalError(
          absl::StrCat("the hot set of '", tensors_[i].name, "' changed size"));
    if (hot_k_[i] > 0)
      dev_.ops().Upload(hot_idx_[i].data(), reinterpret_cast<const float*>(hot.data()),
                        2 * hot_k_[i]);
  }
  if (layout && bf16_) hot_slot_ += hot_slot_ % 2;
  hot_stale_ = false;
  return absl::OkStatus();
}

void DataParallelSync::Pack(size_t i, int q, char* packed, bool unpack, bool hot_only) const {
  const size_t elem = bf16_ ? 2 : 4;
  const DpPartition::Part& p = partition_.parts[i];
  const RowBlock& b = p.blocks[q];
  char* rows = static_cast<char*>(tensors_[i].stored_value()) + b.begin * p.cols * elem;
  const bool hot = hot_only && hot_k_[i] > 0;
  if (hot || bf16_) {
    const int64_t* idx =
        reinterpret_cast<const int64_t*>(hot ? hot_idx_[i].data() : all_columns_.data());
    const int64_t k = hot ? hot_k_[i] : p.cols;
    if (unpack)
      dev_.kernel().ScatterColumns(packed, elem, b.rows(), p.cols, idx, k, rows);
    else
      dev_.kernel().GatherColumns(rows, elem, b.rows(), p.cols, idx, k, packed);
  } else if (unpack) {
    dev_.ops().CopyFloats(reinterpret_cast<float*>(rows), reinterpret_cast<const float*>(packed),
                          b.rows() * p.cols);
  } else {
    dev_.ops().CopyFloats(reinterpret_cast<float*>(packed), reinterpret_cast<const float*>(rows),
                          b.rows() * p.cols);
  }
}

char* DataParallelSync::SlotAt(const kernels::OpsBuffer& buf, int64_t index, size_t i,
                               bool hot_only, int64_t slot) const {
  const size_t elem = bf16_ ? 2 : 4;
  const int64_t off = hot_only ? hot_offset_[i] : partition_.parts[i].offset;
  return reinterpret_cast<char*>(buf.data()) + (index * slot + off) * elem;
}

absl::Status DataParallelSync::GatherBlocks(bool hot_only, ZenFlowEngine* engine) {
  if (N_ == 1 || partition_.slot == 0) return absl::OkStatus();
  const auto t0 = Clock::now();
  if (!hot_only) {
    hot_stale_ = true;
  } else if (hot_stale_) {
    RETURN_IF_ERROR(RefreshHotColumns(engine));
  }
  const int64_t slot = hot_only ? hot_slot_ : partition_.slot;
  for (size_t i = 0; i < tensors_.size(); ++i)
    if (!partition_.parts[i].replicated)
      Pack(i, replica_, SlotAt(send_, 0, i, hot_only, slot), false, hot_only);
  RETURN_IF_ERROR(group_->AllGather(send_.data(), recv_.data(), SlotFloats(slot)));
  for (int q = 0; q < N_; ++q) {
    if (q == replica_) continue;
    for (size_t i = 0; i < tensors_.size(); ++i)
      if (!partition_.parts[i].replicated)
        Pack(i, q, SlotAt(recv_, q, i, hot_only, slot), true, hot_only);
  }
  RETURN_IF_ERROR(dev_.Synchronize());
  seconds_ += SecondsSince(t0);
  return absl::OkStatus();
}

}  // namespace trainer
}  // namespace stallfree
