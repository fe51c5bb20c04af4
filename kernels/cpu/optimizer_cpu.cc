// The CPU optimizer backends: the portable one-lane instantiation, run-time selection of
// AVX-512 / AVX2 from cpuid, and the parallel driver that splits every call into chunks over the
// caller's oneTBB arena. Also the selection helpers every CPU backend shares (top-k, gather,
// scatter), which move little data and need no SIMD.
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "common/tbb_sync.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "common/bf16.h"
#include "common/log.h"
#include "kernels/cpu/optimizer_cpu_impl.h"
#include "kernels/optimizer.h"
#include "kernels/undo_log.h"

namespace stallfree {
namespace kernels {

namespace {
thread_local const UndoLog* active_undo_log = nullptr;
}  // namespace

const UndoLog* ActiveUndoLog() { return active_undo_log; }

ScopedUndoLog::ScopedUndoLog(const UndoLog* log) : previous_(active_undo_log) {
  active_undo_log = log;
}

ScopedUndoLog::~ScopedUndoLog() { active_undo_log = previous_; }

namespace cpu {
namespace {

struct Portable {
  using F = float;
  static constexpr int W = 1;
  static constexpr int kMaxW = 1;
  static F Load(const float* p) { return *p; }
  static void Store(float* p, F x) { *p = x; }
  static void StoreStream(float* p, F x) { *p = x; }
  static F Set1(float x) { return x; }
  static F Add(F a, F b) { return a + b; }
  static F Sub(F a, F b) { return a - b; }
  static F Mul(F a, F b) { return a * b; }
  static F Div(F a, F b) { return a / b; }
  static F Sqrt(F a) { return std::sqrt(a); }
  static F Abs(F a) { return std::fabs(a); }
  static void Fence() {}
  static F LoadBf16(const uint16_t* p) { return stallfree::Bf16ToFloat(*p); }
  static void StoreBf16(uint16_t* p, F x) { *p = stallfree::FloatToBf16(x); }
};

}  // namespace

const ChunkFns& PortableFns() {
  static const ChunkFns fns = MakeChunkFns<Portable>("scalar");
  return fns;
}

namespace {

// Elements per chunk: 32K fp32 = 128 KiB per array, large enough that the per-chunk overhead
// vanishes, small enough that two threads balance on a noisy machine. Chunk starts are
// multiples of this, so vectors stay aligned relative to the arrays' starts.
constexpr int64_t kChunk = 1 << 15;

template <class Fn>
void ParallelChunks(int64_t n, Fn fn) {
  if (n <= 0) return;
  if (n <= kChunk) {
    fn(0, n);
    return;
  }
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  stallfree::ParallelFor(tbb::blocked_range<int64_t>(0, chunks), [&](const tbb::blocked_range<int64_t>& r) {
    const int64_t b = r.begin() * kChunk;
    const int64_t e = std::min(n, r.end() * kChunk);
    fn(b, e - b);
  });
}

const char* Offset(const void* p, int64_t elems, size_t elem_size) {
  return p == nullptr ? nullptr : static_cast<const char*>(p) + elems * elem_size;
}

// Column elements as stored: uint16_t for bf16, uint32_t for fp32 (bits, so an equal-type move
// copies them exactly). Convert<S, D> is the element conversion of GatherColumnsAs.
template <class S, class D>
D Convert(S x) {
  if constexpr (std::is_same_v<S, D>) {
    return x;
  } else if constexpr (std::is_same_v<S, uint16_t>) {
    return static_cast<uint32_t>(x) << 16;  // bf16 widened exactly
  } else {
    float f;
    std::memcpy(&f, &x, sizeof f);
    return stallfree::FloatToBf16(f);
  }
}

// dst[r, j] = Convert(src[r, idx[j]]) (gather) or dst[r, idx[j]] = Convert(src[r, j]) (scatter),
// parallel over rows.
template <bool kGather, class S, class D>
void MoveColumnsT(const S* src, int64_t rows, int64_t ld, const int64_t* idx, int64_t k, D* dst) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1));
  stallfree::ParallelFor(tbb::blocked_range<int64_t>(0, rows, grain),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      for (int64_t i = r.begin(); i < r.end(); ++i) {
                        if constexpr (kGather) {
                          const S* s = src + i * ld;
                          D* d = dst + i * k;
                          for (int64_t j = 0; j < k; ++j) d[j] = Convert<S, D>(s[idx[j]]);
                        } else {
                          const S* s = src + i * k;
                          D* d = dst + i * ld;
                          for (int64_t j = 0; j < k; ++j) d[idx[j]] = Convert<S, D>(s[j]);
                        }
                      }
                    });
}

// MoveColumnsT with the element types named at run time.
template <bool kGather>
void MoveColumns(GradType st, const void* src, int64_t rows, int64_t ld, const int64_t* idx,
                 int64_t k, GradType dt, void* dst) {
  const bool s16 = st == GradType::kBf16, d16 = dt == GradType::kBf16;
  if (s16 && d16)
    MoveColumnsT<kGather>(static_cast<const uint16_t*>(src), rows, ld, idx, k,
                          static_cast<uint16_t*>(dst));
  else if (s16)
    MoveColumnsT<kGather>(static_cast<const uint16_t*>(src), rows, ld, idx, k,
                          static_cast<uint32_t*>(dst));
  else if (d16)
    MoveColumnsT<kGather>(static_cast<const uint32_t*>(src), rows, ld, idx, k,
                          static_cast<uint16_t*>(dst));
  else
    MoveColumnsT<kGather>(static_cast<const uint32_t*>(src), rows, ld, idx, k,
                          static_cast<uint32_t*>(dst));
}

GradType ElemType(size_t elem_size) { return elem_size == 2 ? GradType::kBf16 : GradType::kFp32; }

// The calling thread's undo log (kernels/undo_log.h) if the call's `extent` elements from p
// (and the same elements of m and v) lie in its range; such a call runs whole on this thread.
// A call outside the range is not logged.
const UndoLog* LogFor(const float* p, const float* m, const float* v, int64_t extent) {
  const UndoLog* log = ActiveUndoLog();
  if (log == nullptr || extent <= 0) return nullptr;
  const int64_t o = p - log->base[0];
  if (o < 0 || o + extent > static_cast<int64_t>(log->elems) || m - log->base[1] != o ||
      v - log->base[2] != o)
    return nullptr;
  return log;
}

class CpuKernel final : public OptimizerKernel {
 public:
  explicit CpuKernel(const ChunkFns& fns) : f_(fns) {}
  const char* name() const override { return f_.name; }
  bool KeepsUndoLog() const override { return true; }

  void Accumulate(float* acc, const void* grad, GradType type, float scale, int64_t n,
                  AccumulateMode mode) const override {
    const size_t gs = GradTypeSize(type);
    ParallelChunks(n, [&](int64_t b, int64_t len) {
      f_.accumulate(acc + b, Offset(grad, b, gs), type, scale, len, mode);
    });
  }

  void AdamW(const AdamWConfig& config, float* p, float* m, float* v, const void* grad,
             GradType type, int64_t n, ParamOut out) const override {
    const AdamWConstants c = MakeAdamWConstants(config);
    if (const UndoLog* log = LogFor(p, m, v, n)) {
      f_.adamw(c, p, m, v, grad, type, n, out, log);
      return;
    }
    const size_t gs = GradTypeSize(type);
    ParallelChunks(n, [&](int64_t b, int64_t len) {
      f_.adamw(c, p + b, m + b, v + b, Offset(grad, b, gs), type, len, out.At(b), nullptr);
    });
  }

  // Tasks of about kChunk elements: whole rows (several of them when cols is small), or
  // kChunk-column segments of a row when a row alone is longer. A block of at most kChunk
  // elements is one task on the calling thread (no parallel overhead).
  void AdamWColumns(const AdamWConfig& config, const float* step_size, const float* bc2_sqrt,
                    float* p, float* m, float* v, const void* grad, GradType type, int64_t rows,
                    int64_t cols, ParamOut out) const override {
    const AdamWConstants c = MakeAdamWConstants(config);  // its step_size, bc2_sqrt are unused
    if (const UndoLog* log = LogFor(p, m, v, rows * cols)) {
      f_.adamw_cols(c, step_size, bc2_sqrt, p, m, v, grad, type, rows, cols, cols, out, log);
      return;
    }
    const size_t gs = GradTypeSize(type);
    ColumnTasks(rows, cols, [&](int64_t r0, int64_t c0, int64_t nr, int64_t nc) {
      const int64_t at = r0 * cols + c0;
      f_.adamw_cols(c, step_size + c0, bc2_sqrt + c0, p + at, m + at, v + at,
                    Offset(grad, at, gs), type, nr, nc, cols, out.At(at), nullptr);
    });
  }

  // The same tasks as AdamWColumns, each one fused pass over its block.
  void AccumulateAdamWColumns(const AdamWConfig& config, const float* step_size,
                              const float* bc2_sqrt, float* p, float* m, float* v,
                              const float* acc, const void* grad, GradType type, float acc_scale,
                              int64_t rows, int64_t cols, ParamOut out) const override {
    const AdamWConstants c = MakeAdamWConstants(config);  // its step_size, bc2_sqrt are unused
    if (const UndoLog* log = LogFor(p, m, v, rows * cols)) {
      f_.acc_adamw_cols(c, step_size, bc2_sqrt, p, m, v, acc, grad, type, acc_scale, rows, cols,
                        cols, out, log);
      return;
    }
    const size_t gs = GradTypeSize(type);
    ColumnTasks(rows, cols, [&](int64_t r0, int64_t c0, int64_t nr, int64_t nc) {
      const int64_t at = r0 * cols + c0;
      f_.acc_adamw_cols(c, step_size + c0, bc2_sqrt + c0, p + at, m + at, v + at,
                        acc == nullptr ? nullptr : acc + at, Offset(grad, at, gs), type,
                        acc_scale, nr, nc, cols, out.At(at), nullptr);
    });
  }

  void AccumulateAdamW(const AdamWConfig& config, float* p, float* m, float* v, const float* acc,
                       const void* grad, GradType type, float acc_scale, int64_t n,
                       ParamOut out) const override {
    const AdamWConstants c = MakeAdamWConstants(config);
    if (const UndoLog* log = LogFor(p, m, v, n)) {
      f_.acc_adamw(c, p, m, v, acc, grad, type, acc_scale, n, out, log);
      return;
    }
    const size_t gs = GradTypeSize(type);
    ParallelChunks(n, [&](int64_t b, int64_t len) {
      f_.acc_adamw(c, p + b, m + b, v + b, acc + b, Offset(grad, b, gs), type, acc_scale, len,
                   out.At(b), nullptr);
    });
  }

  void FloatToBf16(const float* src, uint16_t* dst, int64_t n) const override {
    ParallelChunks(n, [&](int64_t b, int64_t len) { f_.to_bf16(src + b, dst + b, len); });
  }
  void Bf16ToFloat(const uint16_t* src, float* dst, int64_t n) const override {
    ParallelChunks(n, [&](int64_t b, int64_t len) { f_.from_bf16(src + b, dst + b, len); });
  }

  void ColumnScores(const void* grad, GradType type, int64_t rows, int64_t cols, int64_t ld,
                    float* l1, float* l2sq) const override {
    if (cols <= 0) return;
    // Parallel over bands of 512 columns only: each column's sum runs over the rows in order,
    // so the result is the same for any thread count.
    constexpr int64_t kBlock = 512;
    const int64_t blocks = (cols + kBlock - 1) / kBlock;
    stallfree::ParallelFor(tbb::blocked_range<int64_t>(0, blocks),
                      [&](const tbb::blocked_range<int64_t>& r) {
                        const int64_t cb = r.begin() * kBlock;
                        const int64_t ce = std::min(cols, r.end() * kBlock);
                        f_.col_scores(grad, type, rows, cb, ce, ld, l1, l2sq);
                      });
  }

  void TopK(const float* scores, int64_t n, int64_t k, int64_t* indices) const override {
    TopKHost(scores, n, k, indices);
  }

  void GatherColumns(const void* src, size_t elem_size, int64_t rows, int64_t ld,
                     const int64_t* idx, int64_t k, void* dst) const override {
    MoveColumns<true>(ElemType(elem_size), src, rows, ld, idx, k, ElemType(elem_size), dst);
  }
  void ScatterColumns(const void* src, size_t elem_size, int64_t rows, int64_t ld,
                      const int64_t* idx, int64_t k, void* dst) const override {
    MoveColumns<false>(ElemType(elem_size), src, rows, ld, idx, k, ElemType(elem_size), dst);
  }
  void GatherColumnsAs(GradType st, const void* src, int64_t rows, int64_t ld, const int64_t* idx,
                       int64_t k, GradType dt, void* dst) const override {
    MoveColumns<true>(st, src, rows, ld, idx, k, dt, dst);
  }
  void ScatterColumnsAs(GradType st, const void* src, int64_t rows, int64_t ld,
                        const int64_t* idx, int64_t k, GradType dt, void* dst) const override {
    MoveColumns<false>(st, src, rows, ld, idx, k, dt, dst);
  }

 private:
  // Runs fn(r0, c0, nr, nc) over blocks [r0, +nr) x [c0, +nc) of a [rows, cols] array that
  // cover it: whole rows (several when cols is small) or kChunk-column segments of a row when
  // a row alone is longer (a multiple of the vector width). One block runs on the calling
  // thread (no parallel overhead).
  template <class Fn>
  static void ColumnTasks(int64_t rows, int64_t cols, Fn fn) {
    if (rows <= 0 || cols <= 0) return;
    const int64_t seg = std::min(cols, kChunk);
    const int64_t segs = (cols + seg - 1) / seg;
    const int64_t rows_per_task = std::max<int64_t>(1, kChunk / seg);
    const int64_t tasks = (rows + rows_per_task - 1) / rows_per_task * segs;
    auto task = [&](int64_t t) {
      const int64_t r0 = t / segs * rows_per_task, c0 = t % segs * seg;
      fn(r0, c0, std::min(rows - r0, rows_per_task), std::min(cols - c0, seg));
    };
    if (tasks == 1) {
      task(0);
      return;
    }
    stallfree::ParallelFor(tbb::blocked_range<int64_t>(0, tasks),
                      [&](const tbb::blocked_range<int64_t>& r) {
                        for (int64_t t = r.begin(); t < r.end(); ++t) task(t);
                      });
  }

  const ChunkFns& f_;
};

bool CpuHasAvx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool CpuHasAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}

}  // namespace

// Top-k by a partial selection over indices: NaN ranks below every number, equal scores go to
// the lower index, and the chosen indices come out sorted (the order gathers use).
void TopKHost(const float* scores, int64_t n, int64_t k, int64_t* indices) {
  if (k <= 0) return;
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  auto better = [scores](int64_t a, int64_t b) {
    const float x = scores[a], y = scores[b];
    const bool xn = std::isnan(x), yn = std::isnan(y);
    if (xn != yn) return yn;  // the number beats the NaN
    if (!xn && x != y) return x > y;
    return a < b;
  };
  if (k < n) std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), better);
  std::sort(order.begin(), order.begin() + k);
  std::copy(order.begin(), order.begin() + k, indices);
}

}  // namespace cpu

void ComplementIndices(const int64_t* selected, int64_t k, int64_t n, int64_t* out) {
  int64_t j = 0, o = 0;
  for (int64_t c = 0; c < n; ++c) {
    if (j < k && selected[j] == c) {
      ++j;
    } else {
      out[o++] = c;
    }
  }
}

const OptimizerKernel* Avx512Kernel() {
  static const OptimizerKernel* k =
      cpu::CpuHasAvx512() ? new cpu::CpuKernel(*cpu::Avx512Fns()) : nullptr;
  return k;
}

const OptimizerKernel* Avx2Kernel() {
  static const OptimizerKernel* k =
      cpu::CpuHasAvx2() ? new cpu::CpuKernel(*cpu::Avx2Fns()) : nullptr;
  return k;
}

const OptimizerKernel& PortableKernel() {
  static const OptimizerKernel* k = new cpu::CpuKernel(cpu::PortableFns());
  return *k;
}

namespace {

const OptimizerKernel& ChooseCpuKernel() {
  const char* forced = std::getenv("STALLFREE_CPU_KERNEL");
  const std::string want = forced == nullptr ? "" : forced;
  const OptimizerKernel* chosen = nullptr;
  if (want == "avx512") chosen = Avx512Kernel();
  else if (want == "avx2") chosen = Avx2Kernel();
  else if (want == "scalar") chosen = &PortableKernel();
  else if (want == "reference") chosen = &ReferenceKernel();
  if (!want.empty() && chosen == nullptr) {
    SF_LOG(kWarning, "STALLFREE_CPU_KERNEL=%s is not available on this CPU (choose avx512, "
           "avx2, scalar or reference); using the fastest available", want.c_str());
  }
  if (chosen == nullptr) chosen = Avx512Kernel();
  if (chosen == nullptr) chosen = Avx2Kernel();
  if (chosen == nullptr) chosen = &PortableKernel();
  return *chosen;
}

}  // namespace

const OptimizerKernel& DefaultCpuKernel() {
  static const OptimizerKernel& k = ChooseCpuKernel();
  return k;
}

}  // namespace kernels
}  // namespace stallfree
