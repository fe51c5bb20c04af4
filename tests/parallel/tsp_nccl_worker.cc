// The TSP block in device memory: CUDA ops and the NCCL communicator against the CPU
// ReferenceBlock. Without RANK/WORLD_SIZE in the environment this is the parent: it prints
// "SKIP: ..." and exits 0 without a usable device, otherwise runs D = min(4, device count) ranks
// as child processes of itself (RANK, WORLD_SIZE, LOCAL_RANK, a fresh STALLFREE_STORE_DIR) and
// fails if any child fails. A child bootstraps a Gloo communicator, creates the NCCL one on
// device LOCAL_RANK on the same stream as its CUDA ops, uploads its weight shard, zigzag input
// and output gradient, runs TspBlock forward / backward on the device (the TspShardView form),
// downloads y, dx and the shard gradients and compares them with the single-rank CPU reference,
// each within 1e-4 x max |reference| of that tensor (GPU fp32 GEMMs sum in another order).
// Prints "PASS: rank r ..." or the first mismatch ("FAIL ...").
#include <cuda_runtime.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/launcher.h"
#include "parallel/nccl_communicator.h"
#include "parallel/reference_block.h"
#include "parallel/tsp_block.h"
#include "parallel/zigzag.h"

namespace stallfree {
namespace parallel {
namespace {

using Clock = std::chrono::steady_clock;
using kernels::OpsBuffer;
using kernels::TransformerOps;

constexpr double kRelTol = 1e-4;
// H and FF divisible by 1..4, T by 2D for D = 1..4.
constexpr int64_t kB = 2, kC = 96, kH = 12, kFF = 192, kT = 48;

int g_rank = 0;

std::vector<float> Randn(uint32_t seed, int64_t n) {
  std::mt19937 rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    const double u1 = (static_cast<double>(rng()) + 1.0) / 4294967296.0;
    const double u2 = static_cast<double>(rng()) / 4294967296.0;
    x = static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
  }
  return v;
}

int Fail(const std::string& what, const absl::Status& s) {
  std::printf("FAIL rank %d: %s: %s\n", g_rank, what.c_str(), s.ToString().c_str());
  std::fflush(stdout);
  return 1;
}

int Fail(const std::string& what) { return Fail(what, absl::InternalError("check failed")); }

// True if |got - want| <= kRelTol * max |want| everywhere (and want is not all zero).
bool Compare(const std::vector<float>& got, const std::vector<float>& want,
             const std::string& what) {
  if (got.size() != want.size()) {
    std::printf("FAIL rank %d %s: size %zu vs %zu\n", g_rank, what.c_str(), got.size(),
                want.size());
    return false;
  }
  double max_ref = 0, worst = 0;
  for (float v : want) max_ref = std::max(max_ref, std::fabs(static_cast<double>(v)));
  const double tol = kRelTol * max_ref;
  size_t worst_i = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= worst)) {  // NaN-safe: a NaN error becomes the worst
      worst = std::isnan(err) ? INFINITY : err;
      worst_i = i;
    }
  }
  const bool ok = max_ref > 0 && worst <= tol;
  std::printf("%s rank %d %-6s max|ref| %.3e  max|err| %.3e at [%zu] (%.2e rel, tol %.0e)\n",
              ok ? "PASS" : "FAIL", g_rank, what.c_str(), max_ref, worst, worst_i,
              max_ref > 0 ? worst / max_ref : INFINITY, kRelTol);
  return ok;
}

// ---------------------------------------------------------------------------------------------
// Child side.

int RunChild() {
  absl::StatusOr<CommOptions> options = CommOptions::FromEnvironment();
  if (!options.ok()) return Fail("CommOptions::FromEnvironment", options.status());
  g_rank = options->rank;
  const int64_t D = options->size, p = options->rank;
  const int device = options->local_rank;
  absl::StatusOr<std::unique_ptr<Communicator>> gloo = NewGlooCommunicator(*options);
  if (!gloo.ok()) return Fail("gloo bootstrap", gloo.status());
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return Fail(absl::StrCat("cudaSetDevice(", device, "): ", cudaGetErrorString(e)));
  }
  // One stream for the ops and the communicator: the block relies on stream order between them.
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      e != cudaSuccess) {
    return Fail(absl::StrCat("cudaStreamCreate: ", cudaGetErrorString(e)));
  }
  int rc = 0;
  {
    std::string error;
    std::unique_ptr<TransformerOps> gpu = kernels::cuda::NewCudaOps(stream, &error);
    if (gpu == nullptr) return Fail("NewCudaOps: " + error);
    const TransformerOps& ops = *gpu;
    absl::StatusOr<std::unique_ptr<Communicator>> nccl =
        NewNcclCommunicator(gloo->get(), device, stream);
    if (!nccl.ok()) return Fail("nccl communicator", nccl.status());

    // The reference on the full batch (CPU).
    const ModelConfig mcfg{/*vocab=*/8, kC, kH, kFF, /*layers=*/1};
    const BlockConfig cfg = mcfg.block();
    const int64_t B = kB, T = kT, C = kC, nl = B * (T / D);
    const BlockWeights w = InitModelWeights(mcfg, 1234, 0.15f, 0.2f).blocks[0];
    const std::vector<float> x = Randn(77, B * T * C), dy = Randn(99, B * T * C);
    std::vector<int32_t> pos(T);
    for (int64_t i = 0; i < T; ++i) pos[i] = static_cast<int32_t>(i);
    const ReferenceBlock ref(cfg);
    BlockCache rcache;
    BlockGrads rgrads;
    std::vector<float> y(B * T * C), dx(B * T * C);
    const TransformerOps& cpu = kernels::CpuOps();
    if (absl::Status s = ref.Forward(cpu, w, x.data(), pos.data(), B, T, y.data(), &rcache);
        !s.ok()) {
      return Fail("reference forward", s);
    }
    if (absl::Status s = ref.Backward(cpu, w, rcache, dy.data(), dx.data(), &rgrads); !s.ok()) {
      return Fail("reference backward", s);
    }
    std::vector<float> x_local(nl * C), dy_local(nl * C), y_want(nl * C), dx_want(nl * C);
    using Scatter = std::pair<const std::vector<float>*, std::vector<float>*>;
    for (auto [full, local] : {Scatter{&x, &x_local}, Scatter{&dy, &dy_local},
                               Scatter{&y, &y_want}, Scatter{&dx, &dx_want}}) {
      if (absl::Status s = ZigzagScatter(full->data(), B, T, C, D, p, local->data()); !s.ok()) {
        return Fail("zigzag scatter", s);
      }
    }
    absl::StatusOr<TspShard> shard = ShardBlockWeights(cfg, w, D, p);
    if (!shard.ok()) return Fail("shard weights", shard.status());
    absl::StatusOr<TspShard> gwant = ShardBlockWeights(cfg, rgrads, D, p);
    if (!gwant.ok()) return Fail("shard reference gradients", gwant.status());

    // Device copies.
    auto upload = [&](const std::vector<float>& v) {
      OpsBuffer b(&ops, static_cast<int64_t>(v.size()));
      ops.Upload(b.data(), v.data(), b.size());
      return b;
    };
    OpsBuffer ln1 = upload(shard->ln1), ln2 = upload(shard->ln2), attn = upload(shard->attn),
              mlp = upload(shard->mlp);
    OpsBuffer gln1(&ops, C), gln2(&ops, C), gattn(&ops, attn.size()), gmlp(&ops, mlp.size());
    OpsBuffer bx = upload(x_local), bdy = upload(dy_local), by(&ops, nl * C), bdx(&ops, nl * C);
    const std::string up = ops.Synchronize();
    if (!up.empty()) return Fail("upload: " + up);

    const TspBlock block(cfg, nccl->get());
    const TspShardView wv{ln1.data(), ln2.data(), attn.data(), mlp.data()};
    const TspGradsView gv{gln1.data(), gln2.data(), gattn.data(), gmlp.data()};
    TspCache cache;
    if (absl::Status s = block.Forward(ops, wv, bx.data(), B, T, by.data(), &cache); !s.ok()) {
      return Fail("tsp forward", s);
    }
    if (absl::Status s = block.Backward(ops, wv, cache, bdy.data(), bdx.data(), gv); !s.ok()) {
      return Fail("tsp backward", s);
    }
    auto download = [&](const OpsBuffer& b) {
      std::vector<float> v(static_cast<size_t>(b.size()));
      ops.Download(v.data(), b.data(), b.size());
      return v;
    };
    const std::vector<float> y_got = download(by), dx_got = download(bdx),
                             gln1_got = download(gln1), gln2_got = download(gln2),
                             gattn_got = download(gattn), gmlp_got = download(gmlp);
    const std::string down = ops.Synchronize();
    if (!down.empty()) return Fail("download: " + down);
    bool ok = Compare(y_got, y_want, "y");
    ok = Compare(dx_got, dx_want, "dx") && ok;
    ok = Compare(gln1_got, gwant->ln1, "dln1") && ok;
    ok = Compare(gln2_got, gwant->ln2, "dln2") && ok;
    ok = Compare(gattn_got, gwant->attn, "dattn") && ok;
    ok = Compare(gmlp_got, gwant->mlp, "dmlp") && ok;
    if (absl::Status s = (*nccl)->Barrier(); !s.ok()) return Fail("nccl barrier", s);
    rc = ok ? 0 : 1;
  }  // buffers, cache and communicator released before the stream
  cudaStreamDestroy(stream);
  if (absl::Status s = (*gloo)->Barrier(); !s.ok()) return Fail("final gloo barrier", s);
  std::printf("%s: rank %d of %lld\n", rc == 0 ? "PASS" : "FAIL", g_rank,
              static_cast<long long>(D));
  std::fflush(stdout);
  return rc;
}

// ---------------------------------------------------------------------------------------------
// Parent side.

// Runs `d` ranks as child processes; true if all exit 0 within the limit.
bool RunGroup(int d) {
  std::printf("=== D = %d\n", d);
  std::fflush(stdout);
  LaunchOptions o;
  o.nproc = d;
  o.argv = {"/proc/self/exe"};
  o.store = LaunchOptions::Store::kFile;
  o.timeout = std::chrono::seconds(240);
  o.env = {{"STALLFREE_COMM_TIMEOUT_MS", "30000"}};
  absl::StatusOr<LaunchResult> r = LaunchLocal(o);
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

int RunParent() {
  std::string why;
  if (!NcclDeviceAvailable(1, &why)) {
    std::printf("SKIP: %s\n", why.c_str());
    return 0;
  }
  int count = 0;
  cudaGetDeviceCount(&count);
  const int d = std::min(4, count);
  const bool ok = RunGroup(d);
  if (count < 2) {
    std::printf("SKIP: multi-rank TSP needs 2 devices, %d visible (the D = 1 case %s)\n", count,
                ok ? "passed" : "FAILED");
  }
  std::printf("%s\n", ok ? "ALL PASS" : "SOME FAILED");
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace parallel
}  // namespace stallfree

int main() {
  if (getenv("RANK") == nullptr || getenv("WORLD_SIZE") == nullptr) {
    return stallfree::parallel::RunParent();
  }
  return stallfree::parallel::RunChild();
}
