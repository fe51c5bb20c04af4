// The TSP block in device memory: CUDA ops and the NCCL communicator against the CPU
// ReferenceBlock. Without RANK/WORLD_SIZE in the environment this is the parent: it prints
// "SKIP: ..." and exits 0 without a usable device, otherwise runs D = min(4, device count) ranks
// as child processes of itself and fails if any child fails (nccl_worker.h). A child bootstraps
// a Gloo communicator, creates the NCCL one on device LOCAL_RANK on the same stream as its CUDA
// ops, uploads its weight shard, zigzag input and output gradient, runs TspBlock forward /
// backward on the device (the TspShardView form), downloads y, dx and the shard gradients and
// compares them with the single-rank CPU reference, each within 1e-4 x max |reference| of that
// tensor (kDeviceTolerance: GPU fp32 GEMMs sum in another order). Prints "PASS: rank r ..." or
// the first mismatch ("FAIL ...").
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/reference_block.h"
#include "parallel/tsp_block.h"
#include "parallel/zigzag.h"
#include "tests/parallel/nccl_worker.h"
#include "tests/parallel/worker_check.h"

namespace stallfree {
namespace parallel {
namespace {

using kernels::OpsBuffer;
using testing::Compare;
using testing::Download;
using testing::g_rank;
using testing::kDeviceTolerance;
using testing::NcclReference;
using testing::Upload;

bool CheckTsp(const testing::DeviceRank& dev, Communicator* nccl, const NcclReference& ref) {
  const kernels::TransformerOps& ops = dev.ops();
  const int64_t D = nccl->size(), p = nccl->rank();
  const int64_t B = NcclReference::kB, T = NcclReference::kT, C = NcclReference::kC;
  const int64_t nl = B * (T / D);
  std::vector<float> x_local(nl * C), dy_local(nl * C), y_want(nl * C), dx_want(nl * C);
  using Scatter = std::pair<const std::vector<float>*, std::vector<float>*>;
  for (auto [full, local] : {Scatter{&ref.x, &x_local}, Scatter{&ref.dy, &dy_local},
                             Scatter{&ref.y, &y_want}, Scatter{&ref.dx, &dx_want}}) {
    CHECK_OK(ZigzagScatter(full->data(), B, T, C, D, p, local->data()), "zigzag scatter");
  }
  absl::StatusOr<TspShard> shard = ShardBlockWeights(ref.cfg, ref.w, D, p);
  CHECK_OK(shard.status(), "shard weights");
  absl::StatusOr<TspShard> gwant = ShardBlockWeights(ref.cfg, ref.grads, D, p);
  CHECK_OK(gwant.status(), "shard reference gradients");

  const OpsBuffer ln1 = Upload(ops, shard->ln1), ln2 = Upload(ops, shard->ln2),
                  attn = Upload(ops, shard->attn), mlp = Upload(ops, shard->mlp);
  const OpsBuffer gln1(&ops, C), gln2(&ops, C), gattn(&ops, attn.size()), gmlp(&ops, mlp.size());
  const OpsBuffer bx = Upload(ops, x_local), bdy = Upload(ops, dy_local), by(&ops, nl * C),
                  bdx(&ops, nl * C);
  const std::string up = ops.Synchronize();
  CHECK_OR_FAIL(up.empty(), "upload: ", up);

  const TspBlock block(ref.cfg, nccl);
  const TspShardView wv{ln1.data(), ln2.data(), attn.data(), mlp.data()};
  const TspGradsView gv{gln1.data(), gln2.data(), gattn.data(), gmlp.data()};
  TspCache cache;
  CHECK_OK(block.Forward(ops, wv, bx.data(), B, T, by.data(), &cache), "tsp forward");
  CHECK_OK(block.Backward(ops, wv, cache, bdy.data(), bdx.data(), gv), "tsp backward");
  const std::vector<float> y = Download(ops, by), dx = Download(ops, bdx),
                           dln1 = Download(ops, gln1), dln2 = Download(ops, gln2),
                           dattn = Download(ops, gattn), dmlp = Download(ops, gmlp);
  const std::string down = ops.Synchronize();
  CHECK_OR_FAIL(down.empty(), "download: ", down);
  bool ok = Compare("tsp y", y, y_want, kDeviceTolerance);
  ok = Compare("tsp dx", dx, dx_want, kDeviceTolerance) && ok;
  ok = Compare("tsp dln1", dln1, gwant->ln1, kDeviceTolerance) && ok;
  ok = Compare("tsp dln2", dln2, gwant->ln2, kDeviceTolerance) && ok;
  ok = Compare("tsp dattn", dattn, gwant->attn, kDeviceTolerance) && ok;
  ok = Compare("tsp dmlp", dmlp, gwant->mlp, kDeviceTolerance) && ok;
  CHECK_OK(nccl->Barrier(), "nccl barrier");
  return ok;
}

bool Check(const CommOptions&, Communicator* gloo, const testing::DeviceRank& dev,
           const NcclReference& ref) {
  absl::StatusOr<std::unique_ptr<Communicator>> nccl = dev.Nccl(gloo);
  CHECK_OK(nccl.status(), "nccl communicator");
  return CheckTsp(dev, nccl->get(), ref);
}

}  // namespace
}  // namespace parallel
}  // namespace stallfree

int main() {
  if (!stallfree::testing::IsNcclChild()) return stallfree::testing::RunNcclParent("TSP");
  return stallfree::testing::RunNcclChild(stallfree::parallel::Check);
}
