// The CUDA side of trainer/device.h in builds without CUDA: there is no GPU device to open.
#include "trainer/device.h"

namespace stallfree {
namespace trainer {
namespace internal {

bool CudaBuilt() { return false; }

absl::StatusOr<std::unique_ptr<RankDevice>> OpenCudaDevice(int, parallel::Communicator*) {
  return absl::InvalidArgumentError(
      "device: this trainer was built without CUDA; rebuild it with --config=cuda");
}

}  // namespace internal
}  // namespace trainer
}  // namespace stallfree
