// The compute device of one trainer rank: where the rank's shard and gradients live, the
// backends that compute on them, and the communicator the model's collectives run on.
//
//   cpu:  host memory; kernels::CpuOps() and kernels::DefaultCpuKernel(); the rank's Gloo group.
//   cuda: GPU `local_rank` (only in builds with --config=cuda); device memory; one CUDA stream
//         shared by the CUDA ops, the CUDA optimizer kernel and an NCCL communicator that is
//         bootstrapped through the rank's Gloo group, so that model ops, collectives and
//         optimizer kernels run in stream order without extra synchronisation.
//
// Only trainer/device_cuda.cc (linked in CUDA builds) includes CUDA headers; the CPU build links
// trainer/device_none.cc instead and never links CUDA.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<RankDevice> dev, OpenRankDevice("cuda", local_rank, gloo));
//   DistributedModel model(cfg, Layout::kTsp, dev->model_comm());
//   float* w = dev->ops().AllocFloats(n);  // device memory for cuda
//
// Ownership and lifetime: the device owns its backends, stream and NCCL communicator; `gloo`
// must outlive it. Everything allocated through ops(), every engine built on kernel() / ops()
// and every model using model_comm() must be destroyed before the device. Thread safety: as the
// backends' (kernels/ops.h, kernels/optimizer.h); one thread drives a rank.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "kernels/optimizer.h"
#include "parallel/communicator.h"

namespace stallfree {
namespace trainer {

class RankDevice {
 public:
  virtual ~RankDevice() = default;
  RankDevice(const RankDevice&) = delete;
  RankDevice& operator=(const RankDevice&) = delete;

  // "cpu", or "cuda:<device index>".
  virtual std::string name() const = 0;
  // True when ops() and kernel() work on host memory (pointers a host loop may read).
  virtual bool host() const = 0;
  virtual const kernels::TransformerOps& ops() const = 0;
  virtual const kernels::OptimizerKernel& kernel() const = 0;
  // The communicator for the model's collectives (on ops()' memory): the Gloo group itself on
  // the CPU, the NCCL group on a GPU. Host-side scalars still travel over the Gloo group.
  virtual parallel::Communicator* model_comm() const = 0;
  // A communicator on ops()' memory for another group of host ranks (`gloo`, e.g. the
  // data-parallel group of --dp): `gloo` itself on the CPU; on a GPU an NCCL communicator on the
  // device's stream, bootstrapped through `gloo` (a collective over it), owned by the device.
  // `gloo` must outlive the device.
  virtual absl::StatusOr<parallel::Communicator*> OpenGroup(parallel::Communicator* gloo) = 0;

  // Waits for the work issued to ops() and kernel(); OK or Internal with the first error.
  absl::Status Synchronize() const;

 protected:
  RankDevice() = default;
};

// Whether this binary was built with --config=cuda.
bool CudaBuilt();

// Checks a --device value without touching any device: OK for "cpu", and for "cuda" in a CUDA
// build; InvalidArgument otherwise ("device: ..." naming the fix).
absl::Status CheckDeviceName(const std::string& device);

// Opens this rank's device (see the top of this file). cuda: Unavailable when no CUDA device can
// be used or fewer than local_rank + 1 are visible; a collective over `gloo` (the NCCL
// bootstrap), so every rank of the group must call it with the same `device`.
absl::StatusOr<std::unique_ptr<RankDevice>> OpenRankDevice(const std::string& device,
                                                           int local_rank,
                                                           parallel::Communicator* gloo);

namespace internal {
// The CUDA side, defined by device_cuda.cc (CUDA builds) or device_none.cc (others).
bool CudaBuilt();
absl::StatusOr<std::unique_ptr<RankDevice>> OpenCudaDevice(int local_rank,
                                                           parallel::Communicator* gloo);
}  // namespace internal

}  // namespace trainer
}  // namespace stallfree
