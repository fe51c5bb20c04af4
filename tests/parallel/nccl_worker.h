// Scaffolding shared by the multi-GPU block tests (tsp_nccl_worker.cc, tpsp_nccl_worker.cc). Such
// a binary is its own launcher: without RANK / WORLD_SIZE in the environment it is the parent
// (RunNcclParent: "SKIP: ..." and exit 0 without a usable device, otherwise D = min(4, device
// count) ranks as child processes of itself with a fresh STALLFREE_STORE_DIR); with them it is a
// child, which sets up its device with DeviceRank and checks a block against the CPU reference
// (NcclReference).
#pragma once

#include <cuda_runtime.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/launcher.h"
#include "parallel/nccl_communicator.h"
#include "parallel/reference_block.h"
#include "tests/parallel/worker_check.h"

namespace stallfree {
namespace testing {

// GPU fp32 GEMMs and reductions sum in another order than the CPU reference: every tensor must
// be within 1e-4 x max |reference| of it (no absolute floor).
inline constexpr Tolerance kDeviceTolerance{1e-4, 0.0};

// One child rank's device: a CUDA stream and the CUDA ops on it; NCCL communicators made by Nccl
// run on the same stream, since the blocks rely on stream order between ops and communication.
// Destroy every OpsBuffer and communicator of this device before the DeviceRank.
class DeviceRank {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceRank>> Create(int device) {
    if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      return absl::UnavailableError(
          absl::StrCat("cudaSetDevice(", device, "): ", cudaGetErrorString(e)));
    }
    std::unique_ptr<DeviceRank> d(new DeviceRank(device));
    if (cudaError_t e = cudaStreamCreateWithFlags(&d->stream_, cudaStreamNonBlocking);
        e != cudaSuccess) {
      return absl::UnavailableError(absl::StrCat("cudaStreamCreate: ", cudaGetErrorString(e)));
    }
    std::string error;
    d->ops_ = kernels::cuda::NewCudaOps(d->stream_, &error);
    if (d->ops_ == nullptr) return absl::UnavailableError("NewCudaOps: " + error);
    return d;
  }
  DeviceRank(const DeviceRank&) = delete;
  DeviceRank& operator=(const DeviceRank&) = delete;
  ~DeviceRank() {
    ops_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  const kernels::TransformerOps& ops() const { return *ops_; }
  // An NCCL communicator of bootstrap's group (a collective over it) on this device and stream.
  absl::StatusOr<std::unique_ptr<parallel::Communicator>> Nccl(
      parallel::Communicator* bootstrap) const {
    return parallel::NewNcclCommunicator(bootstrap, device_, stream_);
  }

 private:
  explicit DeviceRank(int device) : device_(device) {}
  int device_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<kernels::TransformerOps> ops_;
};

// The single-rank CPU reference of one block on the whole batch: the same weights, input and
// output gradient on every rank (fixed seeds).
struct NcclReference {
  // H and FF divisible by 1..4, T by 2D for D = 1..4.
  static constexpr int64_t kB = 2, kC = 96, kH = 12, kFF = 192, kT = 48;
  parallel::BlockConfig cfg;
  parallel::BlockWeights w;
  std::vector<float> x, dy, y, dx;  // [B, T, C]
  parallel::BlockGrads grads;

  static absl::StatusOr<NcclReference> Run() {
    const parallel::ModelConfig mcfg{/*vocab=*/8, kC, kH, kFF, /*layers=*/1};
    NcclReference r;
    r.cfg = mcfg.block();
    r.w = parallel::InitModelWeights(mcfg, 1234, 0.15f, 0.2f).blocks[0];
    r.x = RandomNormal(kB * kT * kC, 77, 1.0f);
    r.dy = RandomNormal(kB * kT * kC, 99, 1.0f);
    r.y.resize(r.x.size());
    r.dx.resize(r.x.size());
    std::vector<int32_t> pos(kT);
    for (int64_t i = 0; i < kT; ++i) pos[i] = static_cast<int32_t>(i);
    const parallel::ReferenceBlock ref(r.cfg);
    parallel::BlockCache cache;
    const kernels::TransformerOps& cpu = kernels::CpuOps();
    absl::Status s = ref.Forward(cpu, r.w, r.x.data(), pos.data(), kB, kT, r.y.data(), &cache);
    if (s.ok()) s = ref.Backward(cpu, r.w, cache, r.dy.data(), r.dx.data(), &r.grads);
    if (!s.ok()) return s;
    return r;
  }
};

// A child's whole run: its CommOptions (from the environment), a Gloo communicator of the world,
// the CPU reference and its device (LOCAL_RANK); then check(options, gloo, device, reference),
// which runs the block checks and returns whether they passed. Everything `check` creates on
// the device is released before the device. Prints "PASS: rank r of D" or "FAIL: ..." and
// returns the exit status.
inline int RunNcclChild(
    const std::function<bool(const parallel::CommOptions&, parallel::Communicator*,
                             const DeviceRank&, const NcclReference&)>& check) {
  absl::StatusOr<parallel::CommOptions> options = parallel::CommOptions::FromEnvironment();
  if (!options.ok()) {
    std::printf("FAIL: %s\n", options.status().ToString().c_str());
    return 1;
  }
  g_rank = options->rank;
  const auto run = [&]() -> bool {
    absl::StatusOr<std::unique_ptr<parallel::Communicator>> gloo =
        parallel::NewGlooCommunicator(*options);
    CHECK_OK(gloo.status(), "gloo bootstrap");
    absl::StatusOr<NcclReference> ref = NcclReference::Run();
    CHECK_OK(ref.status(), "reference");
    bool ok;
    {
      absl::StatusOr<std::unique_ptr<DeviceRank>> dev = DeviceRank::Create(options->local_rank);
      CHECK_OK(dev.status(), "device");
      ok = check(*options, gloo->get(), **dev, *ref);
    }
    CHECK_OK((*gloo)->Barrier(), "final gloo barrier");
    return ok;
  };
  const bool ok = run();
  std::printf("%s: rank %d of %d\n", ok ? "PASS" : "FAIL", g_rank, options->size);
  std::fflush(stdout);
  return ok ? 0 : 1;
}

// Parent side: runs `d` ranks of this binary (argv = /proc/self/exe) with the communicators'
// timeout comm_timeout_ms; true if all exit 0 within the limit.
inline bool RunNcclGroup(int d, int comm_timeout_ms = 30000) {
  std::printf("=== D = %d\n", d);
  std::fflush(stdout);
  parallel::LaunchOptions o;
  o.nproc = d;
  o.argv = {"/proc/self/exe"};
  o.store = parallel::LaunchOptions::Store::kFile;
  o.timeout = std::chrono::seconds(240);
  o.env = {{"STALLFREE_COMM_TIMEOUT_MS", std::to_string(comm_timeout_ms)}};
  absl::StatusOr<parallel::LaunchResult> r = parallel::LaunchLocal(o);
  const bool ok = r.ok() && r->ok();
  if (!r.ok()) {
    std::printf("FAIL: D = %d: %s\n", d, r.status().ToString().c_str());
  } else if (!r->ok()) {
    std::printf("FAIL: D = %d: first failed rank %d, timed out %d\n", d, r->first_failed_rank,
                r->timed_out ? 1 : 0);
  }
  std::printf("%s: D = %d\n", ok ? "PASS" : "FAIL", d);
  std::fflush(stdout);
  return ok;
}

// True in a child rank (the launcher set RANK and WORLD_SIZE).
inline bool IsNcclChild() { return getenv("RANK") != nullptr && getenv("WORLD_SIZE") != nullptr; }

// The parent's whole run: "SKIP: <why>" and 0 without a usable device; otherwise
// D = min(4, devices) ranks, "ALL PASS" and 0 iff every rank passed. `what` names the blocks in
// the note printed when only one device (D = 1) could be tested.
inline int RunNcclParent(const char* what) {
  std::string why;
  if (!parallel::NcclDeviceAvailable(1, &why)) {
    std::printf("SKIP: %s\n", why.c_str());
    return 0;
  }
  int count = 0;
  cudaGetDeviceCount(&count);
  const bool ok = RunNcclGroup(std::min(4, count));
  if (count < 2) {
    std::printf("SKIP: multi-rank %s needs 2 devices, %d visible (the D = 1 case %s)\n", what,
                count, ok ? "passed" : "FAILED");
  }
  std::printf("%s\n", ok ? "ALL PASS" : "SOME FAILED");
  return ok ? 0 : 1;
}

}  // namespace testing
}  // namespace stallfree
