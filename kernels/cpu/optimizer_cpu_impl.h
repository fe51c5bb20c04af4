// The CPU optimizer kernels, written once as templates over an instruction-set "vector traits"
// type V and instantiated three times: AVX-512 (simd_avx512.cc), AVX2 (simd_avx2.cc) and a
// one-lane portable version (optimizer_cpu.cc). optimizer_cpu.cc picks one from cpuid and runs
// it in parallel chunks over the caller's oneTBB arena.
//
// Rules that keep this safe and exact:
// - Everything below is in an anonymous namespace, so each translation unit has its own copies
//   compiled for its own target: no inline function compiled for AVX-512 can be merged by the
//   linker into code that runs on a CPU without it.
// - The ISA files include every standard header *before* switching the target, so no library
//   code is compiled for the wider instruction set.
// - The library is built with -ffp-contract=off and the templates use separate multiply and add,
//   with IEEE sqrt and division, in the oracle's order: results are bit-identical to the scalar
//   reference (kernels/cpu/reference.cc), which the tests assert.
// - Tails shorter than one vector go through a zero-padded stack buffer, so the same vector code
//   handles them.
//
// V provides: type F (a vector of W floats), W, Load/Store (unaligned), Set1, Add, Mul, Div,
// Sqrt, Abs, Fence (orders non-temporal stores; may be empty), LoadBf16 (W bf16 -> F) and
// StoreBf16 (F -> W bf16, round to nearest even, NaN kept
// quiet with its sign, as common/bf16.h).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/optimizer.h"
#include "kernels/undo_log.h"

namespace stallfree {
namespace kernels {
namespace cpu {

// The per-ISA chunk functions. Each processes one contiguous chunk serially; the caller
// parallelises over chunks.
struct ChunkFns {
  const char* name;
  void (*accumulate)(float* acc, const void* grad, GradType type, float scale, int64_t n,
                     AccumulateMode mode);
  // The AdamW kernels keep `log` (kernels/undo_log.h; null: none) for the elements they write.
  void (*adamw)(const AdamWConstants& c, float* p, float* m, float* v, const void* grad,
                GradType type, int64_t n, ParamOut out, const UndoLog* log);
  // AdamW with per-column bias corrections over a [rows, cols] block whose rows start `ld`
  // elements apart (p, m, v, grad, out alike): element (r, j) uses step_size[j] and bc2_sqrt[j]
  // in place of c.step_size and c.bc2_sqrt.
  void (*adamw_cols)(const AdamWConstants& c, const float* step_size, const float* bc2_sqrt,
                     float* p, float* m, float* v, const void* grad, GradType type, int64_t rows,
                     int64_t cols, int64_t ld, ParamOut out, const UndoLog* log);
  void (*acc_adamw)(const AdamWConstants& c, float* p, float* m, float* v, const float* acc,
                    const void* grad, GradType type, float acc_scale, int64_t n, ParamOut out,
                    const UndoLog* log);
  // adamw_cols on g = acc + acc_scale * grad (acc null: acc_scale * grad); acc like p.
  void (*acc_adamw_cols)(const AdamWConstants& c, const float* step_size, const float* bc2_sqrt,
                         float* p, float* m, float* v, const float* acc, const void* grad,
                         GradType type, float acc_scale, int64_t rows, int64_t cols, int64_t ld,
                         ParamOut out, const UndoLog* log);
  void (*to_bf16)(const float* src, uint16_t* dst, int64_t n);
  void (*from_bf16)(const uint16_t* src, float* dst, int64_t n);
  // Column scores of columns [c_begin, c_end) of G[rows, ld].
  void (*col_scores)(const void* grad, GradType type, int64_t rows, int64_t c_begin,
                     int64_t c_end, int64_t ld, float* l1, float* l2sq);
};

// Null when this build or CPU cannot run them (the caller checks the CPU).
const ChunkFns* Avx512Fns();
const ChunkFns* Avx2Fns();
const ChunkFns& PortableFns();

// Top-k on the host (shared by the CPU backends; the oracle has its own full sort).
void TopKHost(const float* scores, int64_t n, int64_t k, int64_t* indices);

namespace {

template <class V, bool kBf16>
inline typename V::F LoadG(const void* g, int64_t i) {
  if (kBf16) return V::LoadBf16(static_cast<const uint16_t*>(g) + i);
  return V::Load(static_cast<const float*>(g) + i);
}

// Runs body(i) for each full vector at i, then body on a zero-padded copy of the tail: `ins`
// are the arrays read, `outs` the arrays written (copied in and back so in-place updates work).
// Element sizes are given per array. before(i, count), when given, runs before the body of the
// `count` elements at i (indices into the real arrays, for the tail too).
struct TailArray {
  void* base;       // the array's start (null: absent)
  size_t elem;      // 2 or 4 bytes
  bool written;
};

struct NoBefore {
  void operator()(int64_t, int64_t) const {}
};

template <int kMaxW, int kArrays, class Body, class Before = NoBefore>
inline void ForEachVector(int64_t n, int w, TailArray (&arrays)[kArrays], Body body,
                          Before before = NoBefore{}) {
  int64_t i = 0;
  for (; i + w <= n; i += w) {
    before(i, w);
    body(arrays, i);
  }
  const int64_t rest = n - i;
  if (rest == 0) return;
  before(i, rest);
  alignas(64) unsigned char buf[kArrays][kMaxW * 4];
  TailArray tail[kArrays];
  for (int a = 0; a < kArrays; ++a) {
    tail[a] = arrays[a];
    if (arrays[a].base == nullptr) continue;
    std::memset(buf[a], 0, sizeof buf[a]);
    std::memcpy(buf[a], static_cast<unsigned char*>(arrays[a].base) + i * arrays[a].elem,
                rest * arrays[a].elem);
    tail[a].base = buf[a];
  }
  body(tail, 0);
  for (int a = 0; a < kArrays; ++a) {
    if (arrays[a].base == nullptr || !arrays[a].written) continue;
    std::memcpy(static_cast<unsigned char*>(arrays[a].base) + i * arrays[a].elem, buf[a],
                rest * arrays[a].elem);
  }
}

// Keeps an undo log (kernels/undo_log.h) inside a kernel call: Before(p, m, v, count) runs
// before the kernel writes the `count` (at most one vector's) elements at p, m and v (real
// memory: the tail's padded copy is not). kOn false: nothing, compiled away. The log's fields
// it needs are copied in: the compiler barrier after each mark would otherwise make the loop
// load them from the log again for every vector.
template <class V, bool kOn>
class UndoKeeper {
 public:
  static_assert(V::W <= static_cast<int>(kUndoMaxWindow), "a vector must fit the undo window");

  explicit UndoKeeper(const UndoLog* log) {
    if (!kOn) return;
    base_ = log->base[0];
    ring_ = log->ring;
    mark_ = log->mark;
    tag_ = log->tag;
  }

  void Before(const float* p, const float* m, const float* v, int64_t count) {
    if (!kOn) return;
    const uint64_t o = static_cast<uint64_t>(p - base_);
    float* r = ring_ + UndoRingAt(o);
    if (count == V::W) {
      V::Store(r, V::Load(p));
      V::Store(r + kUndoRing, V::Load(m));
      V::Store(r + 2 * kUndoRing, V::Load(v));
    } else {  // a tail
      for (int64_t i = 0; i < count; ++i)
        r[i] = p[i], r[kUndoRing + i] = m[i], r[2 * kUndoRing + i] = v[i];
    }
    // The copy before the mark (release), the mark before the arrays' stores (the barrier).
    __atomic_store_n(mark_, UndoMark(tag_, o, static_cast<uint64_t>(count)), __ATOMIC_RELEASE);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
  }

 private:
  const float* base_ = nullptr;
  float* ring_ = nullptr;
  uint64_t* mark_ = nullptr;
  uint64_t tag_ = 0;
};

// Runs run(std::true_type) with a log, run(std::false_type) without: the kernels' bodies are
// compiled both ways.
template <class Run>
inline void WithUndo(const UndoLog* log, Run run) {
  if (log != nullptr) run(std::true_type{});
  else run(std::false_type{});
}

template <class V>
void AccumulateT(float* acc, const void* grad, GradType type, float scale, int64_t n,
                 AccumulateMode mode) {
  TailArray arr[2] = {{acc, 4, true}, {const_cast<void*>(grad), GradTypeSize(type), false}};
  const typename V::F s = V::Set1(scale);
  auto run = [&](auto bf16_tag, auto overwrite_tag) {
    constexpr bool kBf16 = decltype(bf16_tag)::value;
    constexpr bool kOverwrite = decltype(overwrite_tag)::value;
    ForEachVector<V::kMaxW>(n, V::W, arr, [&](TailArray(&a)[2], int64_t i) {
      float* pa = static_cast<float*>(a[0].base) + i;
      const typename V::F g = V::Mul(s, LoadG<V, kBf16>(a[1].base, i));
      V::Store(pa, kOverwrite ? g : V::Add(V::Load(pa), g));
    });
  };
  using T = std::true_type;
  using Fa = std::false_type;
  const bool bf16 = type == GradType::kBf16, over = mode == AccumulateMode::kOverwrite;
  if (bf16 && over) run(T{}, T{});
  else if (bf16) run(T{}, Fa{});
  else if (over) run(Fa{}, T{});
  else run(Fa{}, Fa{});
}

// Where AdamWVec's bias-correction constants come from: one step for every lane (broadcast from
// the AdamWConstants), or one step per column (loaded from the per-column arrays at the
// vector's columns). Read at the point of use, so the uniform path compiles exactly as it did
// before per-column steps existed.
template <class V>
struct UniformStep {
  const AdamWConstants& c;
  typename V::F StepSize() const { return V::Set1(c.step_size); }
  typename V::F Bc2Sqrt() const { return V::Set1(c.bc2_sqrt); }
};
template <class V>
struct ColumnSteps {
  const float* step_size;  // at the vector's first column
  const float* bc2_sqrt;
  typename V::F StepSize() const { return V::Load(step_size); }
  typename V::F Bc2Sqrt() const { return V::Load(bc2_sqrt); }
};

// The AdamW arithmetic on one vector, in the oracle's order. g is already scaled. step_size and
// bc2_sqrt come from `steps`; the other constants from c.
template <class V, class Steps>
inline void AdamWVec(const AdamWConstants& c, const Steps& steps, typename V::F g, float* pp,
                     float* pm, float* pv, uint16_t* pout, float* pout32) {
  using F = typename V::F;
  const F old = V::Load(pp);
  F p = V::Mul(old, V::Set1(c.decay));
  const F m = V::Add(V::Mul(V::Set1(c.b1), V::Load(pm)), V::Mul(V::Set1(c.omb1), g));
  const F v = V::Add(V::Mul(V::Set1(c.b2), V::Load(pv)), V::Mul(V::Mul(V::Set1(c.omb2), g), g));
  const F denom = V::Add(V::Div(V::Sqrt(v), steps.Bc2Sqrt()), V::Set1(c.eps));
  p = V::Sub(p, V::Mul(steps.StepSize(), V::Div(m, denom)));
  V::Store(pm, m);
  V::Store(pv, v);
  V::Store(pp, p);
  if (pout != nullptr || pout32 != nullptr) {
    const F shown = c.predict_out ? V::Sub(V::Add(p, p), old) : p;
    if (pout != nullptr) V::StoreBf16(pout, shown);
    if (pout32 != nullptr) V::StoreStream(pout32, shown);
  }
}

// The outputs of the vector at i: a[b] the bf16 array, a[f] the fp32 one (null where absent).
template <int kArrays>
inline uint16_t* OutBf16(TailArray (&a)[kArrays], int b, int64_t i) {
  return a[b].base == nullptr ? nullptr : static_cast<uint16_t*>(a[b].base) + i;
}
template <int kArrays>
inline float* OutFp32(TailArray (&a)[kArrays], int f, int64_t i) {
  return a[f].base == nullptr ? nullptr : static_cast<float*>(a[f].base) + i;
}

template <class V>
void AdamWT(const AdamWConstants& c, float* p, float* m, float* v, const void* grad,
            GradType type, int64_t n, ParamOut out, const UndoLog* log) {
  TailArray arr[6] = {{p, 4, true},
                      {m, 4, true},
                      {v, 4, true},
                      {const_cast<void*>(grad), GradTypeSize(type), false},
                      {out.bf16, 2, true},
                      {out.fp32, 4, true}};
  const typename V::F scale = V::Set1(c.grad_scale);
  auto run = [&](auto bf16_tag, auto undo_tag) {
    constexpr bool kBf16 = decltype(bf16_tag)::value;
    UndoKeeper<V, decltype(undo_tag)::value> undo(log);
    ForEachVector<V::kMaxW>(
        n, V::W, arr,
        [&](TailArray(&a)[6], int64_t i) {
          const typename V::F g = V::Mul(scale, LoadG<V, kBf16>(a[3].base, i));
          AdamWVec<V>(c, UniformStep<V>{c}, g, static_cast<float*>(a[0].base) + i,
                      static_cast<float*>(a[1].base) + i, static_cast<float*>(a[2].base) + i,
                      OutBf16(a, 4, i), OutFp32(a, 5, i));
        },
        [&](int64_t i, int64_t count) { undo.Before(p + i, m + i, v + i, count); });
  };
  WithUndo(log, [&](auto undo_tag) {
    if (type == GradType::kBf16) run(std::true_type{}, undo_tag);
    else run(std::false_type{}, undo_tag);
  });
  V::Fence();
}

// One row at a time: the column constants are read as vectors alongside the row's elements (they
// stay in L1 across rows); a row's tail goes through ForEachVector's zero-padded buffer like any
// other array (padding lanes compute garbage that is never stored).
template <class V>
void AdamWColsT(const AdamWConstants& c, const float* step_size, const float* bc2_sqrt, float* p,
                float* m, float* v, const void* grad, GradType type, int64_t rows, int64_t cols,
                int64_t ld, ParamOut out, const UndoLog* log) {
  const size_t gs = GradTypeSize(type);
  const typename V::F scale = V::Set1(c.grad_scale);
  auto run = [&](auto bf16_tag, auto undo_tag) {
    constexpr bool kBf16 = decltype(bf16_tag)::value;
    UndoKeeper<V, decltype(undo_tag)::value> undo(log);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = r * ld;
      const ParamOut o = out.At(at);
      TailArray arr[8] = {{p + at, 4, true},
                          {m + at, 4, true},
                          {v + at, 4, true},
                          {const_cast<char*>(static_cast<const char*>(grad)) + at * gs, gs, false},
                          {o.bf16, 2, true},
                          {const_cast<float*>(step_size), 4, false},
                          {const_cast<float*>(bc2_sqrt), 4, false},
                          {o.fp32, 4, true}};
      ForEachVector<V::kMaxW>(cols, V::W, arr, [&](TailArray(&a)[8], int64_t i) {
        const typename V::F g = V::Mul(scale, LoadG<V, kBf16>(a[3].base, i));
        const ColumnSteps<V> steps{static_cast<const float*>(a[5].base) + i,
                                   static_cast<const float*>(a[6].base) + i};
        AdamWVec<V>(c, steps, g, static_cast<float*>(a[0].base) + i,
                    static_cast<float*>(a[1].base) + i, static_cast<float*>(a[2].base) + i,
                    OutBf16(a, 4, i), OutFp32(a, 7, i));
      }, [&](int64_t i, int64_t count) {
        undo.Before(p + at + i, m + at + i, v + at + i, count);
      });
    }
  };
  WithUndo(log, [&](auto undo_tag) {
    if (type == GradType::kBf16) run(std::true_type{}, undo_tag);
    else run(std::false_type{}, undo_tag);
  });
  V::Fence();
}

// AdamWColsT on g = acc + acc_scale * grad (acc null: g = acc_scale * grad), the sum formed as
// AccumulateT forms it, so the result is bit-identical to AccumulateT into acc and then AdamWColsT
// on the fp32 acc. acc is laid out like p (row stride ld) and only read.
template <class V>
void AccAdamWColsT(const AdamWConstants& c, const float* step_size, const float* bc2_sqrt,
                   float* p, float* m, float* v, const float* acc, const void* grad,
                   GradType type, float acc_scale, int64_t rows, int64_t cols, int64_t ld,
                   ParamOut out, const UndoLog* log) {
  const size_t gs = GradTypeSize(type);
  const typename V::F scale = V::Set1(c.grad_scale), ascale = V::Set1(acc_scale);
  auto run = [&](auto bf16_tag, auto has_acc_tag, auto undo_tag) {
    constexpr bool kBf16 = decltype(bf16_tag)::value;
    constexpr bool kHasAcc = decltype(has_acc_tag)::value;
    UndoKeeper<V, decltype(undo_tag)::value> undo(log);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = r * ld;
      const ParamOut o = out.At(at);
      TailArray arr[9] = {{p + at, 4, true},
                          {m + at, 4, true},
                          {v + at, 4, true},
                          {const_cast<char*>(static_cast<const char*>(grad)) + at * gs, gs, false},
                          {o.bf16, 2, true},
                          {const_cast<float*>(step_size), 4, false},
                          {const_cast<float*>(bc2_sqrt), 4, false},
                          {kHasAcc ? const_cast<float*>(acc) + at : nullptr, 4, false},
                          {o.fp32, 4, true}};
      ForEachVector<V::kMaxW>(cols, V::W, arr, [&](TailArray(&a)[9], int64_t i) {
        typename V::F sum = V::Mul(ascale, LoadG<V, kBf16>(a[3].base, i));
        if (kHasAcc) sum = V::Add(V::Load(static_cast<const float*>(a[7].base) + i), sum);
        const ColumnSteps<V> steps{static_cast<const float*>(a[5].base) + i,
                                   static_cast<const float*>(a[6].base) + i};
        AdamWVec<V>(c, steps, V::Mul(scale, sum), static_cast<float*>(a[0].base) + i,
                    static_cast<float*>(a[1].base) + i, static_cast<float*>(a[2].base) + i,
                    OutBf16(a, 4, i), OutFp32(a, 8, i));
      }, [&](int64_t i, int64_t count) {
        undo.Before(p + at + i, m + at + i, v + at + i, count);
      });
    }
  };
  using T = std::true_type;
  using Fa = std::false_type;
  const bool bf16 = type == GradType::kBf16, has_acc = acc != nullptr;
  WithUndo(log, [&](auto undo_tag) {
    if (bf16 && has_acc) run(T{}, T{}, undo_tag);
    else if (bf16) run(T{}, Fa{}, undo_tag);
    else if (has_acc) run(Fa{}, T{}, undo_tag);
    else run(Fa{}, Fa{}, undo_tag);
  });
  V::Fence();
}

template <class V>
void AccAdamWT(const AdamWConstants& c, float* p, float* m, float* v, const float* acc,
               const void* grad, GradType type, float acc_scale, int64_t n, ParamOut out,
               const UndoLog* log) {
  TailArray arr[7] = {{p, 4, true},
                      {m, 4, true},
                      {v, 4, true},
                      {const_cast<float*>(acc), 4, false},
                      {const_cast<void*>(grad), GradTypeSize(type), false},
                      {out.bf16, 2, true},
                      {out.fp32, 4, true}};
  const typename V::F scale = V::Set1(c.grad_scale), ascale = V::Set1(acc_scale);
  auto run = [&](auto bf16_tag, auto has_grad_tag, auto undo_tag) {
    constexpr bool kBf16 = decltype(bf16_tag)::value;
    constexpr bool kHasGrad = decltype(has_grad_tag)::value;
    UndoKeeper<V, decltype(undo_tag)::value> undo(log);
    ForEachVector<V::kMaxW>(
        n, V::W, arr,
        [&](TailArray(&a)[7], int64_t i) {
          typename V::F sum = V::Load(static_cast<const float*>(a[3].base) + i);
          if (kHasGrad) sum = V::Add(sum, V::Mul(ascale, LoadG<V, kBf16>(a[4].base, i)));
          AdamWVec<V>(c, UniformStep<V>{c}, V::Mul(scale, sum),
                      static_cast<float*>(a[0].base) + i, static_cast<float*>(a[1].base) + i,
                      static_cast<float*>(a[2].base) + i, OutBf16(a, 5, i), OutFp32(a, 6, i));
        },
        [&](int64_t i, int64_t count) { undo.Before(p + i, m + i, v + i, count); });
  };
  WithUndo(log, [&](auto undo_tag) {
    if (grad == nullptr) run(std::false_type{}, std::false_type{}, undo_tag);
    else if (type == GradType::kBf16) run(std::true_type{}, std::true_type{}, undo_tag);
    else run(std::false_type{}, std::true_type{}, undo_tag);
  });
  V::Fence();
}

template <class V>
void ToBf16T(const float* src, uint16_t* dst, int64_t n) {
  TailArray arr[2] = {{const_cast<float*>(src), 4, false}, {dst, 2, true}};
  ForEachVector<V::kMaxW>(n, V::W, arr, [&](TailArray(&a)[2], int64_t i) {
    V::StoreBf16(static_cast<uint16_t*>(a[1].base) + i,
                 V::Load(static_cast<const float*>(a[0].base) + i));
  });
  V::Fence();
}

template <class V>
void FromBf16T(const uint16_t* src, float* dst, int64_t n) {
  TailArray arr[2] = {{const_cast<uint16_t*>(src), 2, false}, {dst, 4, true}};
  ForEachVector<V::kMaxW>(n, V::W, arr, [&](TailArray(&a)[2], int64_t i) {
    V::Store(static_cast<float*>(a[1].base) + i,
             V::LoadBf16(static_cast<const uint16_t*>(a[0].base) + i));
  });
}

// Column scores over bands of up to 512 columns, in blocks of 32 rows: for each group of kU
// vectors of columns, the running sums are loaded into registers, the block's rows are added in
// order, and the sums stored back (L1-resident). Every column therefore sums its rows in order,
// as the oracle does: the result depends neither on the vector width nor on the thread count.
template <class V, int kU>
inline void ColGroup(const void* grad, bool bf16, int64_t r0, int64_t r1, int64_t ld,
                     int64_t col, float* s1, float* s2) {
  typename V::F a[kU], b[kU];
  for (int u = 0; u < kU; ++u) a[u] = V::Load(s1 + u * V::W), b[u] = V::Load(s2 + u * V::W);
  for (int64_t r = r0; r < r1; ++r) {
    for (int u = 0; u < kU; ++u) {
      const int64_t at = r * ld + col + u * V::W;
      const typename V::F x = bf16 ? LoadG<V, true>(grad, at) : LoadG<V, false>(grad, at);
      a[u] = V::Add(a[u], V::Abs(x));
      b[u] = V::Add(b[u], V::Mul(x, x));
    }
  }
  for (int u = 0; u < kU; ++u) V::Store(s1 + u * V::W, a[u]), V::Store(s2 + u * V::W, b[u]);
}

template <class V>
void ColScoresT(const void* grad, GradType type, int64_t rows, int64_t c_begin, int64_t c_end,
                int64_t ld, float* l1, float* l2sq) {
  constexpr int64_t kBand = 512, kRowBlock = 32;
  constexpr int kU = 4;
  alignas(64) float s1[kBand], s2[kBand];
  const bool bf16 = type == GradType::kBf16;
  for (int64_t cb = c_begin; cb < c_end; cb += kBand) {
    const int64_t width = c_end - cb < kBand ? c_end - cb : kBand;
    const int64_t vec_end = width / V::W * V::W;
    const int64_t group_end = width / (kU * V::W) * (kU * V::W);
    std::memset(s1, 0, sizeof s1);
    std::memset(s2, 0, sizeof s2);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int64_t r1 = rows - r0 < kRowBlock ? rows : r0 + kRowBlock;
      int64_t j = 0;
      for (; j < group_end; j += kU * V::W) {
        ColGroup<V, kU>(grad, bf16, r0, r1, ld, cb + j, s1 + j, s2 + j);
      }
      for (; j < vec_end; j += V::W) ColGroup<V, 1>(grad, bf16, r0, r1, ld, cb + j, s1 + j, s2 + j);
      for (; j < width; ++j) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t at = r * ld + cb + j;
          float x;
          if (bf16) {
            const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(grad)[at])
                                  << 16;
            std::memcpy(&x, &bits, sizeof x);
          } else {
            x = static_cast<const float*>(grad)[at];
          }
          s1[j] += x < 0 ? -x : x;
          s2[j] += x * x;
        }
      }
    }
    if (l1 != nullptr) std::memcpy(l1 + cb, s1, width * sizeof(float));
    if (l2sq != nullptr) std::memcpy(l2sq + cb, s2, width * sizeof(float));
  }
}

template <class V>
ChunkFns MakeChunkFns(const char* name) {
  return ChunkFns{name,          &AccumulateT<V>,      &AdamWT<V>,    &AdamWColsT<V>,
                  &AccAdamWT<V>, &AccAdamWColsT<V>,    &ToBf16T<V>,   &FromBf16T<V>,
                  &ColScoresT<V>};
}

}  // namespace
}  // namespace cpu
}  // namespace kernels
}  // namespace stallfree
