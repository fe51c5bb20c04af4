// A trainer rank's model tensors on its device: where its TSP shard (and the shard's gradients)
// live, the per-tensor view the engine and the checkpoints use, a bf16 model's storage, and the
// squared gradient norm computed where the gradients are.
//
// Internal to the trainer (trainer/run.cc and its helpers). Not thread safe.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/zenflow.h"
#include "kernels/ops.h"
#include "parallel/distributed_model.h"
#include "trainer/device.h"

namespace stallfree {
namespace trainer {

// Where a shard's (or its gradients') tensors are: a host DistributedShard's vectors, or a
// BackendShard's device memory.
struct ShardPointers {
  float* embedding = nullptr;
  float* pos_embedding = nullptr;             // null without learned positions
  std::vector<std::array<float*, 4>> blocks;  // each TSP block's ln1, ln2, attn, mlp
  float* ln_f = nullptr;
  float* head = nullptr;  // null when tied
};

// The tensors of a host shard (null where a vector is empty). `*s` must outlive the pointers.
ShardPointers HostPointers(parallel::DistributedShard* s);

// A shard's tensors in a backend's memory: one allocation, each tensor of the host shard at its
// own 256-byte-aligned offset. The backend must outlive it.
class BackendShard {
 public:
  // The layout of `host`; its values uploaded when `upload`, zeros otherwise.
  BackendShard(const kernels::TransformerOps& ops, const parallel::DistributedShard& host,
               bool upload);

  const ShardPointers& pointers() const { return pointers_; }
  parallel::DistributedShardView View() const;
  parallel::DistributedGradsView Grads() const;

 private:
  kernels::OpsBuffer buffer_;
  ShardPointers pointers_;
};

// Every tensor of a rank's shard, with the engine's view of it (2-D weights split as separate
// matrices; the TSP shard packs several per buffer).
struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  // The model's fp32 values and gradients, which the model computes with: an fp32 model's own
  // (the engine's parameters), a bf16 model's working copies (widened values, gradients before
  // their rounding).
  float* value;
  float* grad;
  int64_t numel;
  bool replicated;  // the same on every rank (its gradient is all-reduced)
  // A bf16 model's storage (null for fp32): the engine's value and gradient buffers.
  uint16_t* value16 = nullptr;
  uint16_t* grad16 = nullptr;

  bool bf16() const { return value16 != nullptr; }
  // The engine's (the model's stored) value and gradient, and their element size.
  void* stored_value() const {
    return bf16() ? static_cast<void*>(value16) : static_cast<void*>(value);
  }
  void* stored_grad() const {
    return bf16() ? static_cast<void*>(grad16) : static_cast<void*>(grad);
  }
  size_t elem_size() const { return bf16() ? 2 : 4; }
  DType dtype() const { return bf16() ? DType::kBf16 : DType::kFp32; }
};

// The tensors of a shard of model `cfg` over D ranks: values at `w`, gradients at `g`.
std::vector<Tensor> ShardTensors(const parallel::ModelConfig& cfg, int D, const ShardPointers& w,
                                 const ShardPointers& g);

// A bf16 model's storage in a backend's memory (kernels/ops.h): one allocation holding every
// tensor's bf16 value and bf16 gradient, each at a 256-byte-aligned offset (so a tensor is also
// a whole number of floats from the start: Upload / Download move it as floats, exactly). Points
// the tensors' value16 / grad16 at it; zeros. The backend must outlive it.
class Bf16Storage {
 public:
  Bf16Storage(const kernels::TransformerOps& ops, std::vector<Tensor>* tensors);
  bool ok() const { return !buffer_.empty() && buffer_.data() != nullptr; }

 private:
  kernels::OpsBuffer buffer_;
};

// A tensor's stored values moved between host memory (numel x elem_size bytes, `host` at least
// a whole number of floats long) and the backend: bf16 ones as whole floats (the storage's
// tensors are float-aligned and padded), bit for bit.
void UploadStored(const kernels::TransformerOps& ops, const Tensor& t, const std::string& host);
// Download's result is in *host after the backend's Synchronize().
void DownloadStored(const kernels::TransformerOps& ops, const Tensor& t, std::string* host);

// The squared global norm's share of this rank in backend memory: the sum over tensors of their
// squares, each tensor counted where the host loop would count it (sharded ones on every rank,
// replicated ones on the lead only). Per-column sums of squares on the device (fp32, the
// kernel's order), one Download, the sum over columns in double on the host.
absl::StatusOr<double> BackendSquaredNorm(const RankDevice& dev, const std::vector<Tensor>& tensors,
                                          bool lead);

}  // namespace trainer
}  // namespace stallfree
