// The baselines in device memory: the Megatron TP+SP block (parallel/tpsp_block.h) and the
// TP x CP block (parallel/tpcp_block.h) on CUDA ops and NCCL communicators, against the CPU
// ReferenceBlock. Without RANK/WORLD_SIZE in the environment this is the parent: it prints
// "SKIP: ..." and exits 0 without a usable device, otherwise runs D = min(4, device count) ranks
// as child processes of itself and fails if any child fails (nccl_worker.h). A child, on device
// LOCAL_RANK with one stream for its CUDA ops and every NCCL communicator:
//   - TP+SP over the world (degree D): uploads its ShardTpspWeights shard, its contiguous tokens
//     [p T/D, (p+1) T/D) of x and dy, runs TpspBlock forward / backward (the view form);
//   - TP x CP on the grid t x c = D (c = 2, t = D/2 for even D; c = D, t = 1 otherwise), TP and
//     CP NCCL communicators bootstrapped from NewGlooTpcpGroups: its ShardTpspWeights(t) shard
//     and its TpcpPositions tokens, TpcpBlock forward / backward (the view form);
// downloads y, dx and the shard gradients and compares each with the single-rank CPU reference
// (the matching tokens / shard slices), within 1e-4 x max |reference| of that tensor
// (kDeviceTolerance: GPU fp32 GEMMs sum in another order). Prints a line per tensor, then
// "PASS: rank r ..." or "FAIL ...".
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/reference_block.h"
#include "parallel/tpcp_block.h"
#include "parallel/tpsp_block.h"
#include "tests/parallel/nccl_worker.h"
#include "tests/parallel/worker_check.h"

namespace stallfree {
namespace parallel {
namespace {

using kernels::OpsBuffer;
using testing::BlockBuffers;
using testing::Compare;
using testing::Download;
using testing::g_rank;
using testing::kDeviceTolerance;
using testing::NcclReference;
using testing::Upload;

// Rows `pos` (global positions) of every batch row of a [B, T, C] tensor: [B, pos.size(), C].
std::vector<float> TokensAt(const std::vector<float>& full, const std::vector<int32_t>& pos) {
  const int64_t B = NcclReference::kB, T = NcclReference::kT, C = NcclReference::kC;
  const int64_t n = static_cast<int64_t>(pos.size());
  std::vector<float> local(B * n * C);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < n; ++i) {
      std::copy_n(full.begin() + (b * T + pos[i]) * C, C, local.begin() + (b * n + i) * C);
    }
  }
  return local;
}

// Runs `block` (TpspBlock or TpcpBlock, Cache its cache) in device memory on the shard of TP
// degree t, index i, and this rank's tokens at `pos`; compares with the reference. `what` names
// the scheme in the output.
template <class Block, class Cache>
bool CheckBlock(const std::string& what, const Block& block, const kernels::TransformerOps& ops,
                const NcclReference& ref, int t, int i, const std::vector<int32_t>& pos) {
  const int64_t B = NcclReference::kB, T = NcclReference::kT;
  absl::StatusOr<BlockWeights> shard = ShardTpspWeights(ref.cfg, ref.w, t, i);
  CHECK_OK(shard.status(), what + " shard weights");
  absl::StatusOr<BlockWeights> gwant = ShardTpspWeights(ref.cfg, ref.grads, t, i);
  CHECK_OK(gwant.status(), what + " shard reference gradients");
  const std::vector<float> x_local = TokensAt(ref.x, pos), dy_local = TokensAt(ref.dy, pos);

  const BlockBuffers w = BlockBuffers::Upload(ops, *shard);
  // The shard's shapes; Backward accumulates into them.
  const BlockBuffers g = BlockBuffers::Upload(ops, testing::ZerosLike(*gwant));
  const OpsBuffer bx = Upload(ops, x_local), bdy = Upload(ops, dy_local);
  const OpsBuffer by(&ops, bx.size()), bdx(&ops, bx.size());
  Cache cache;
  CHECK_OK(block.Forward(ops, w.view(), bx.data(), B, T, by.data(), &cache), what + " forward");
  CHECK_OK(block.Backward(ops, w.view(), cache, bdy.data(), bdx.data(), g.grads()),
           what + " backward");
  const std::vector<float> y = Download(ops, by), dx = Download(ops, bdx);
  const BlockGrads grads = g.Download(ops);
  const std::string err = ops.Synchronize();
  CHECK_OR_FAIL(err.empty(), what, " device: ", err);

  bool ok = Compare(what + " y", y, TokensAt(ref.y, pos), kDeviceTolerance);
  ok = Compare(what + " dx", dx, TokensAt(ref.dx, pos), kDeviceTolerance) && ok;
  const std::vector<const std::vector<float>*> got = grads.Tensors(),
                                                     want = std::as_const(*gwant).Tensors();
  for (size_t f = 0; f < got.size(); ++f) {
    ok = Compare(what + " d" + BlockTensorNames()[f], *got[f], *want[f], kDeviceTolerance) && ok;
  }
  return ok;
}

bool CheckTpsp(const testing::DeviceRank& dev, Communicator* world, const NcclReference& ref) {
  const int D = world->size(), p = world->rank();
  const int64_t Tl = NcclReference::kT / D;
  std::vector<int32_t> pos(Tl);
  for (int64_t s = 0; s < Tl; ++s) pos[s] = static_cast<int32_t>(p * Tl + s);
  absl::StatusOr<std::unique_ptr<Communicator>> nccl = dev.Nccl(world);
  CHECK_OK(nccl.status(), "tpsp nccl communicator");
  const TpspBlock block(ref.cfg, nccl->get());
  const bool ok = CheckBlock<TpspBlock, TpspCache>(absl::StrCat("tpsp D=", D), block, dev.ops(),
                                                   ref, D, p, pos);
  CHECK_OK((*nccl)->Barrier(), "tpsp nccl barrier");
  return ok;
}

bool CheckTpcp(const testing::DeviceRank& dev, const CommOptions& options,
               const NcclReference& ref) {
  const int D = options.size, c = D % 2 == 0 ? 2 : D, t = D / c;
  absl::StatusOr<TpcpGroups> gloo = NewGlooTpcpGroups(options, t);
  CHECK_OK(gloo.status(), "tpcp gloo groups");
  absl::StatusOr<std::unique_ptr<Communicator>> tp = dev.Nccl(gloo->tp.get());
  CHECK_OK(tp.status(), "tpcp tp nccl communicator");
  absl::StatusOr<std::unique_ptr<Communicator>> cp = dev.Nccl(gloo->cp.get());
  CHECK_OK(cp.status(), "tpcp cp nccl communicator");
  absl::StatusOr<std::vector<int32_t>> pos =
      TpcpPositions(NcclReference::kT, t, c, gloo->tp_index, gloo->cp_index);
  CHECK_OK(pos.status(), "tpcp positions");
  const TpcpBlock block(ref.cfg, tp->get(), cp->get());
  const bool ok = CheckBlock<TpcpBlock, TpcpCache>(absl::StrCat("tpcp t=", t, " c=", c), block,
                                                   dev.ops(), ref, t, gloo->tp_index, *pos);
  CHECK_OK((*tp)->Barrier(), "tpcp tp nccl barrier");
  CHECK_OK((*cp)->Barrier(), "tpcp cp nccl barrier");
  return ok;
}

bool Check(const CommOptions& options, Communicator* gloo, const testing::DeviceRank& dev,
           const NcclReference& ref) {
  const bool tpsp = CheckTpsp(dev, gloo, ref);
  return CheckTpcp(dev, options, ref) && tpsp;
}

}  // namespace
}  // namespace parallel
}  // namespace stallfree

int main() {
  if (!stallfree::testing::IsNcclChild()) {
    return stallfree::testing::RunNcclParent("TP+SP / TP x CP");
  }
  return stallfree::testing::RunNcclChild(stallfree::parallel::Check);
}
