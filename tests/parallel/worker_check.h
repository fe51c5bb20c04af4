// Checks shared by the parallel layer workers (run as ranks by the tests): failure macros that
// print the rank and return false, seeded normal data, the tolerance comparison, and moving
// tensors to and from a backend's memory.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/ops.h"
#include "parallel/reference_block.h"
#include "parallel/tpsp_block.h"

namespace stallfree {
namespace testing {

inline int g_rank = 0;  // this process's rank, for messages

#define CHECK_OR_FAIL(cond, ...)                                                               \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      std::fprintf(stderr, "FAIL rank %d: %s:%d: %s: %s\n", g_rank, __FILE__, __LINE__, #cond, \
                   absl::StrCat(__VA_ARGS__).c_str());                                         \
      return false;                                                                            \
    }                                                                                          \
  } while (0)

#define CHECK_OK(expr, what)                           \
  do {                                                 \
    absl::Status s_ = (expr);                          \
    CHECK_OR_FAIL(s_.ok(), what, ": ", s_.ToString()); \
  } while (0)

inline constexpr double kRelTol = 1e-5;
inline constexpr double kAbsTol = 1e-7;

// Per element |got - ref| <= rel * ref_max + abs, ref_max = max |reference tensor|.
struct Tolerance {
  double rel = kRelTol;
  double abs = kAbsTol;
};

inline std::vector<float> RandomNormal(int64_t n, uint32_t seed, float stddev) {
  std::mt19937 rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    const double u1 = (static_cast<double>(rng()) + 1.0) / 4294967296.0;
    const double u2 = static_cast<double>(rng()) / 4294967296.0;
    x = static_cast<float>(stddev * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
  }
  return v;
}

inline double MaxAbs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

// got [n] against ref [n] with ref_max = max|ref tensor| (ref may be a slice of that tensor).
// Fails on the first element out of tolerance (a NaN included), and when ref_max is not above
// 100 x the absolute floor (a vacuous check).
inline bool Compare(const std::string& what, const float* got, const float* ref, int64_t n,
                    double ref_max, Tolerance tol = {}) {
  CHECK_OR_FAIL(ref_max > 100 * tol.abs, what, ": the reference is (nearly) zero, max ", ref_max);
  const double bound = tol.rel * ref_max + tol.abs;
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    CHECK_OR_FAIL(err <= bound, what, " [", i, "] = ", got[i], ", reference ", ref[i], " (err ",
                  err, " > tol ", bound, ", max|ref| ", ref_max, ")");
    worst = std::max(worst, err);
  }
  std::printf("rank %d %-26s max|ref| %.3e  max|err| %.3e  (%.2e rel, tol %.0e rel + %.0e)\n",
              g_rank, what.c_str(), ref_max, worst, worst / ref_max, tol.rel, tol.abs);
  return true;
}

// The same for whole tensors; ref_max defaults to max |want|.
inline bool Compare(const std::string& what, const std::vector<float>& got,
                    const std::vector<float>& want, double ref_max, Tolerance tol = {}) {
  CHECK_OR_FAIL(got.size() == want.size(), what, ": size ", got.size(), " vs ", want.size());
  return Compare(what, got.data(), want.data(), static_cast<int64_t>(want.size()), ref_max, tol);
}
inline bool Compare(const std::string& what, const std::vector<float>& got,
                    const std::vector<float>& want, Tolerance tol = {}) {
  return Compare(what, got, want, MaxAbs(want), tol);
}

inline int64_t BlockSize(int64_t n, int d, int b) { return n / d + (b < n % d ? 1 : 0); }

// ---- Tensors in a backend's memory (host for CpuOps, device for a CUDA backend). ----

// A copy of v in ops' memory.
inline kernels::OpsBuffer Upload(const kernels::TransformerOps& ops, const std::vector<float>& v) {
  kernels::OpsBuffer b(&ops, static_cast<int64_t>(v.size()));
  ops.Upload(b.data(), v.data(), b.size());
  return b;
}

// b's contents; valid once ops.Synchronize() has returned (at once for a host backend).
inline std::vector<float> Download(const kernels::TransformerOps& ops,
                                   const kernels::OpsBuffer& b) {
  std::vector<float> v(static_cast<size_t>(b.size()));
  ops.Download(v.data(), b.data(), b.size());
  return v;
}

// w with every element 0 (the same shapes): gradients a block accumulates into.
inline parallel::BlockWeights ZerosLike(const parallel::BlockWeights& w) {
  parallel::BlockWeights z = w;
  for (std::vector<float>* f : z.Tensors()) std::fill(f->begin(), f->end(), 0.0f);
  return z;
}

// BlockWeights-shaped tensors (a TP+SP shard or its gradients) in a backend's memory, in
// BlockWeights::Tensors() order, with the views the TP+SP and TP x CP blocks take.
struct BlockBuffers {
  std::vector<kernels::OpsBuffer> t;

  static BlockBuffers Upload(const kernels::TransformerOps& ops, const parallel::BlockWeights& w) {
    BlockBuffers b;
    for (const std::vector<float>* v : w.Tensors()) b.t.push_back(testing::Upload(ops, *v));
    return b;
  }
  // Valid once ops.Synchronize() has returned.
  parallel::BlockWeights Download(const kernels::TransformerOps& ops) const {
    parallel::BlockWeights w;
    std::vector<std::vector<float>*> f = w.Tensors();
    for (size_t i = 0; i < f.size(); ++i) *f[i] = testing::Download(ops, t[i]);
    return w;
  }
  parallel::TpspShardView view() const {
    return {t[0].data(), t[1].data(), t[2].data(), t[3].data(), t[4].data(),
            t[5].data(), t[6].data(), t[7].data(), t[8].data()};
  }
  parallel::TpspGradsView grads() const {
    return {t[0].data(), t[1].data(), t[2].data(), t[3].data(), t[4].data(),
            t[5].data(), t[6].data(), t[7].data(), t[8].data()};
  }
};

// Checks a TP+SP-sharded block (Block = parallel::TpspBlock or parallel::TpcpBlock, Cache its
// cache type) on tensors in the backend's buffers (OpsBuffers) against the same block on views of
// host vectors (TpspViewOf), whose results y, dx and grads the caller got: the same operations in
// the same order, so bit-identical results. Runs the block once on uploaded copies of shard,
// x_local and dy_local, with gradients that start from `grads` (so they must end at exactly
// 2 x grads), and checks y / dx; then a backward on the host vectors from the uploaded run's
// cache must reproduce dx and grads.
template <class Block, class Cache>
bool CheckViewForm(const std::string& at, const Block& block, const kernels::TransformerOps& ops,
                   const parallel::BlockWeights& shard, const std::vector<float>& x_local,
                   const std::vector<float>& dy_local, int64_t B, int64_t T,
                   const std::vector<float>& y, const std::vector<float>& dx,
                   const parallel::BlockGrads& grads) {
  const BlockBuffers w = BlockBuffers::Upload(ops, shard), g = BlockBuffers::Upload(ops, grads);
  const kernels::OpsBuffer x = Upload(ops, x_local), dy = Upload(ops, dy_local);
  const kernels::OpsBuffer vy(&ops, static_cast<int64_t>(y.size())),
      vdx(&ops, static_cast<int64_t>(dx.size()));
  Cache cache;
  CHECK_OK(block.Forward(ops, w.view(), x.data(), B, T, vy.data(), &cache), at + " view forward");
  CHECK_OR_FAIL(cache.buffers != nullptr && cache.bytes() > 0, at, " view cache not in buffers");
  CHECK_OK(block.Backward(ops, w.view(), cache, dy.data(), vdx.data(), g.grads()),
           at + " view backward");
  CHECK_OR_FAIL(Download(ops, vy) == y, at, " view forward y differs from the host-vector run");
  CHECK_OR_FAIL(Download(ops, vdx) == dx, at, " view backward dx differs from the host-vector run");
  const parallel::BlockGrads twice = g.Download(ops);
  const std::vector<const std::vector<float>*> got = twice.Tensors(), first = grads.Tensors();
  for (size_t f = 0; f < got.size(); ++f) {
    for (size_t i = 0; i < got[f]->size(); ++i) {
      const float want = (*first[f])[i] + (*first[f])[i];
      CHECK_OR_FAIL((*got[f])[i] == want, at, " view gradient d",
                    parallel::BlockTensorNames()[f], " [", i, "] = ", (*got[f])[i], ", want ",
                    want);
    }
  }
  parallel::BlockGrads g3 = ZerosLike(grads);
  std::vector<float> dx3(dx.size());
  CHECK_OK(block.Backward(ops, parallel::TpspViewOf(shard), cache, dy_local.data(), dx3.data(),
                          parallel::TpspViewOf(&g3)),
           at + " host-vector backward from a view cache");
  CHECK_OR_FAIL(dx3 == dx, at, " host-vector backward from a view cache: dx differs");
  const std::vector<const std::vector<float>*> got3 = std::as_const(g3).Tensors();
  for (size_t f = 0; f < got3.size(); ++f) {
    CHECK_OR_FAIL(*got3[f] == *first[f], at, " host-vector backward from a view cache: d",
                  parallel::BlockTensorNames()[f], " differs");
  }
  std::printf("rank %d %s in backend buffers: bit-identical to the host-vector run\n", g_rank,
              at.c_str());
  return true;
}

}  // namespace testing
}  // namespace stallfree
