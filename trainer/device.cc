#include "trainer/device.h"

#include "absl/strings/str_cat.h"

namespace stallfree {
namespace trainer {
namespace {

class CpuDevice final : public RankDevice {
 public:
  explicit CpuDevice(parallel::Communicator* gloo) : gloo_(gloo) {}
  std::string name() const override { return "cpu"; }
  bool host() const override { return true; }
  const kernels::TransformerOps& ops() const override { return kernels::CpuOps(); }
  const kernels::OptimizerKernel& kernel() const override { return kernels::DefaultCpuKernel(); }
  parallel::Communicator* model_comm() const override { return gloo_; }
  absl::StatusOr<parallel::Communicator*> OpenGroup(parallel::Communicator* gloo) override {
    return gloo;
  }

 private:
  parallel::Communicator* gloo_;
};

}  // namespace

absl::Status RankDevice::Synchronize() const {
  std::string err = ops().Synchronize();
  if (err.empty()) err = kernel().Synchronize();
  if (!err.empty()) return absl::InternalError(absl::StrCat("device ", name(), ": ", err));
  return absl::OkStatus();
}

bool CudaBuilt() { return internal::CudaBuilt(); }

absl::Status CheckDeviceName(const std::string& device) {
  if (device == "cpu") return absl::OkStatus();
  if (device == "cuda") {
    if (CudaBuilt()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        "device: this trainer was built without CUDA, so --device cuda is not available; "
        "rebuild it with `bazel build --config=cuda //trainer` (or use --device cpu)");
  }
  return absl::InvalidArgumentError(absl::StrCat("device: '", device, "' is not cpu or cuda"));
}

absl::StatusOr<std::unique_ptr<RankDevice>> OpenRankDevice(const std::string& device,
                                                           int local_rank,
                                                           parallel::Communicator* gloo) {
  if (absl::Status st = CheckDeviceName(device); !st.ok()) return st;
  if (device == "cpu") return std::unique_ptr<RankDevice>(new CpuDevice(gloo));
  return internal::OpenCudaDevice(local_rank, gloo);
}

}  // namespace trainer
}  // namespace stallfree
