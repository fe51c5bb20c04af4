// The CUDA side of trainer/device.h (builds with --config=cuda): GPU LOCAL_RANK, one stream for
// the CUDA ops, the CUDA optimizer kernel and the NCCL communicator.
#include <cuda_runtime.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/optimizer_cuda.h"
#include "parallel/nccl_communicator.h"
#include "trainer/device.h"

namespace stallfree {
namespace trainer {
namespace internal {
namespace {

class CudaDevice final : public RankDevice {
 public:
  // On GPU `device` (the rank's LOCAL_RANK).
  explicit CudaDevice(int device) : device_(device) {}
  ~CudaDevice() override {
    // Users of the stream first, then the stream.
    groups_.clear();
    nccl_.reset();
    kernel_.reset();
    ops_.reset();
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  std::string name() const override { return absl::StrCat("cuda:", device_); }
  bool host() const override { return false; }
  const kernels::TransformerOps& ops() const override { return *ops_; }
  const kernels::OptimizerKernel& kernel() const override { return *kernel_; }
  parallel::Communicator* model_comm() const override { return nccl_.get(); }
  absl::StatusOr<parallel::Communicator*> OpenGroup(parallel::Communicator* gloo) override {
    absl::StatusOr<std::unique_ptr<parallel::Communicator>> nccl =
        parallel::NewNcclCommunicator(gloo, device_, stream_);
    if (!nccl.ok()) return nccl.status();
    groups_.push_back(*std::move(nccl));
    return groups_.back().get();
  }

  // Everything but the NCCL communicator (local; no communication).
  absl::Status OpenLocal() {
    int count = 0;
    if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
      return absl::UnavailableError(
          absl::StrCat("device: --device cuda needs a CUDA GPU, and none can be used here (",
                       e != cudaSuccess ? cudaGetErrorString(e) : "no device visible", ")"));
    }
    if (device_ >= count) {
      return absl::UnavailableError(absl::StrCat(
          "device: this rank has LOCAL_RANK ", device_, " and uses GPU ", device_, ", but only ",
          count, " GPU(s) are visible; run at most ", count, " ranks per node with --device cuda"));
    }
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
      return absl::UnavailableError(
          absl::StrCat("device: cudaSetDevice(", device_, "): ", cudaGetErrorString(e)));
    }
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
        e != cudaSuccess) {
      stream_ = nullptr;
      return absl::UnavailableError(
          absl::StrCat("device: cudaStreamCreate on GPU ", device_, ": ", cudaGetErrorString(e)));
    }
    std::string error;
    ops_ = kernels::cuda::NewCudaOps(stream_, &error);
    if (ops_ == nullptr) {
      return absl::UnavailableError(absl::StrCat("device: CUDA ops on GPU ", device_, ": ", error));
    }
    kernel_ = kernels::cuda::NewCudaOptimizerKernel(stream_, &error);
    if (kernel_ == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("device: CUDA optimizer kernel on GPU ", device_, ": ", error));
    }
    return absl::OkStatus();
  }

  absl::Status OpenNccl(parallel::Communicator* gloo) {
    absl::StatusOr<std::unique_ptr<parallel::Communicator>> nccl =
        parallel::NewNcclCommunicator(gloo, device_, stream_);
    if (!nccl.ok()) return nccl.status();
    nccl_ = *std::move(nccl);
    return absl::OkStatus();
  }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<kernels::TransformerOps> ops_;
  std::unique_ptr<kernels::OptimizerKernel> kernel_;
  std::unique_ptr<parallel::Communicator> nccl_;
  std::vector<std::unique_ptr<parallel::Communicator>> groups_;  // OpenGroup's
};

}  // namespace

bool CudaBuilt() { return true; }

absl::StatusOr<std::unique_ptr<RankDevice>> OpenCudaDevice(int local_rank,
                                                           parallel::Communicator* gloo) {
  auto dev = std::make_unique<CudaDevice>(local_rank);
  const absl::Status local = dev->OpenLocal();
  // Every rank learns whether all opened their GPU before the NCCL bootstrap, so a rank short of
  // a GPU fails the whole group at once instead of leaving the others waiting for it.
  float failed = local.ok() ? 0.0f : 1.0f;
  if (absl::Status st = gloo->AllReduce(&failed, 1); !st.ok()) return st;
  if (!local.ok()) return local;
  if (failed > 0) {
    return absl::UnavailableError(
        "device: another rank could not open its GPU (its error says why)");
  }
  if (absl::Status st = dev->OpenNccl(gloo); !st.ok()) return st;
  return std::unique_ptr<RankDevice>(std::move(dev));
}

}  // namespace internal
}  // namespace trainer
}  // namespace stallfree
