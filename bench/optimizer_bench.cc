// The CPU optimizer kernels against the memory-bandwidth limit of their own access pattern,
// measured in the same run on the same arrays.
//
//   bazel run //bench:optimizer_bench [-- --quick] [--elements N] [--reps R]
//
// The limit: a streaming kernel with AdamW's exact access pattern (p, g, m, v read; p, m, v
// written: 28 bytes per element) and trivial arithmetic, on all threads, over arrays far larger
// than the last-level cache. Every figure is the best of --reps runs (as STREAM reports),
// because on a shared machine interference only ever makes a run slower. Ends with FIGURE lines.
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/flags.h"
#include "common/region.h"
#include "kernels/optimizer.h"
#include "server/session_journal.h"
#include "server/session_record.h"

namespace stallfree {
namespace {

using kernels::AccumulateMode;
using kernels::AdamWConfig;
using kernels::GradType;
using kernels::OptimizerKernel;

constexpr int64_t kChunk = 1 << 15;  // as the kernels' own chunking

template <class Fn>
void ParallelChunks(int64_t n, Fn fn) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, chunks),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      const int64_t b = r.begin() * kChunk;
                      fn(b, std::min(n, r.end() * kChunk) - b);
                    });
}

// fn(begin, count) over [0, n) as one contiguous range a thread (static: no rebalancing).
template <class Fn>
void ParallelRanges(int64_t n, int threads, Fn fn) {
  const int64_t per = (n + threads - 1) / threads;
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, threads, 1),
      [&](const tbb::blocked_range<int64_t>& r) {
        for (int64_t t = r.begin(); t < r.end(); ++t) {
          const int64_t b = t * per, len = std::min(n, b + per) - b;
          if (len > 0) fn(b, len);
        }
      },
      tbb::simple_partitioner());
}

// The streaming limit: AdamW's 4-read / 3-write pattern with one add per array (of 0 * g, so
// the arrays keep their values). Vectorised for the widest ISA so arithmetic never limits it.
__attribute__((target("avx512f"))) void Stream4r3wAvx512(float* p, const float* g, float* m,
                                                          float* v, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(g + i), _mm512_setzero_ps());
    _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_loadu_ps(p + i), x));
    _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), x));
    _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), x));
  }
  for (; i < n; ++i) p[i] += 0 * g[i], m[i] += 0 * g[i], v[i] += 0 * g[i];
}
__attribute__((target("avx2"))) void Stream4r3wAvx2(float* p, const float* g, float* m, float* v,
                                                     int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(g + i), _mm256_setzero_ps());
    _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_loadu_ps(p + i), x));
    _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), x));
    _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), x));
  }
  for (; i < n; ++i) p[i] += 0 * g[i], m[i] += 0 * g[i], v[i] += 0 * g[i];
}
// Variant: four vectors an iteration (more loads in flight).
__attribute__((target("avx512f"))) void Stream4r3wUnrolledAvx512(float* p, const float* g, float* m,
                                                                  float* v, int64_t n) {
  int64_t i = 0;
  const __m512 zero = _mm512_setzero_ps();
  for (; i + 64 <= n; i += 64) {
    __m512 x[4];
    for (int k = 0; k < 4; ++k) x[k] = _mm512_mul_ps(_mm512_loadu_ps(g + i + 16 * k), zero);
    for (int k = 0; k < 4; ++k) {
      const int64_t j = i + 16 * k;
      _mm512_storeu_ps(p + j, _mm512_add_ps(_mm512_loadu_ps(p + j), x[k]));
      _mm512_storeu_ps(m + j, _mm512_add_ps(_mm512_loadu_ps(m + j), x[k]));
      _mm512_storeu_ps(v + j, _mm512_add_ps(_mm512_loadu_ps(v + j), x[k]));
    }
  }
  Stream4r3wAvx512(p + i, g + i, m + i, v + i, n - i);
}
// Variant: the four loads first, then the three stores (the order AdamW's loop has).
__attribute__((target("avx512f"))) void Stream4r3wGroupedAvx512(float* p, const float* g, float* m,
                                                                 float* v, int64_t n) {
  int64_t i = 0;
  const __m512 zero = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 gg = _mm512_loadu_ps(g + i), pp = _mm512_loadu_ps(p + i);
    const __m512 mm = _mm512_loadu_ps(m + i), vv = _mm512_loadu_ps(v + i);
    const __m512 x = _mm512_mul_ps(gg, zero);
    _mm512_storeu_ps(p + i, _mm512_add_ps(pp, x));
    _mm512_storeu_ps(m + i, _mm512_add_ps(mm, x));
    _mm512_storeu_ps(v + i, _mm512_add_ps(vv, x));
  }
  for (; i < n; ++i) p[i] += 0 * g[i], m[i] += 0 * g[i], v[i] += 0 * g[i];
}
// Variant: non-temporal stores (the written lines bypass the caches), where p, m and v share
// their alignment within a 64-byte line (they do for arrays allocated alike).
__attribute__((target("avx512f"))) void Stream4r3wNtAvx512(float* p, const float* g, float* m,
                                                            float* v, int64_t n) {
  const uintptr_t phase = reinterpret_cast<uintptr_t>(p) & 63;
  if ((reinterpret_cast<uintptr_t>(m) & 63) != phase ||
      (reinterpret_cast<uintptr_t>(v) & 63) != phase || phase % 4 != 0)
    return Stream4r3wAvx512(p, g, m, v, n);
  int64_t head = phase == 0 ? 0 : std::min<int64_t>(n, (64 - phase) / 4);
  Stream4r3wAvx512(p, g, m, v, head);
  int64_t i = head;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(g + i), _mm512_setzero_ps());
    _mm512_stream_ps(p + i, _mm512_add_ps(_mm512_load_ps(p + i), x));
    _mm512_stream_ps(m + i, _mm512_add_ps(_mm512_load_ps(m + i), x));
    _mm512_stream_ps(v + i, _mm512_add_ps(_mm512_load_ps(v + i), x));
  }
  _mm_sfence();
  Stream4r3wAvx512(p + i, g + i, m + i, v + i, n - i);
}

// The patterns of the bf16 AdamW (p, m, v, bf16 g read; p, m, v, bf16 copy written) and of the
// fused boundary pass (p, m, v, acc, g read; p, m, v, bf16 copy written), streamed with trivial
// arithmetic: their own limits.
__attribute__((target("avx512f,avx512bw"))) void StreamBf16Avx512(float* p, const uint16_t* g16,
                                                                  float* m, float* v,
                                                                  uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i gb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g16 + i));
    const __m512 x = _mm512_mul_ps(
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(gb), 16)),
        _mm512_setzero_ps());
    const __m512 np = _mm512_add_ps(_mm512_loadu_ps(p + i), x);
    _mm512_storeu_ps(p + i, np);
    _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), x));
    _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), x));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(np), 16)));
  }
  for (; i < n; ++i) out[i] = static_cast<uint16_t>(g16[i] & 0), p[i] += 0, m[i] += 0, v[i] += 0;
}
__attribute__((target("avx512f,avx512bw"))) void StreamFusedAvx512(float* p, const float* acc,
                                                                   const float* g, float* m,
                                                                   float* v, uint16_t* out,
                                                                   int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(g + i), _mm512_loadu_ps(acc + i)),
                                   _mm512_setzero_ps());
    const __m512 np = _mm512_add_ps(_mm512_loadu_ps(p + i), x);
    _mm512_storeu_ps(p + i, np);
    _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), x));
    _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), x));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(np), 16)));
  }
  for (; i < n; ++i) out[i] = 0, p[i] += 0 * (g[i] + acc[i]), m[i] += 0, v[i] += 0;
}

void Stream4r3w(float* p, const float* g, float* m, float* v, int64_t n) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx512) return Stream4r3wAvx512(p, g, m, v, n);
  if (avx2) return Stream4r3wAvx2(p, g, m, v, n);
  for (int64_t i = 0; i < n; ++i) p[i] += 0 * g[i], m[i] += 0 * g[i], v[i] += 0 * g[i];
}

// STREAM triad a = b + s * c (2 reads, 1 write), for comparison only.
void Triad(float* a, const float* b, const float* c, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + 0.5f * c[i];
}

double Seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double Best(int reps, const std::function<void()>& fn) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) best = std::min(best, Seconds(fn));
  return best;
}

// A kernel timed in alternation with the streaming limit: each repetition runs both, in
// alternating order, so both see the same machine; the fraction of the limit is the median of the
// per-pair time ratios (robust to other tenants), the time the best run.
struct Paired {
  double best = 1e30;
  double limit_over_kernel = 0;  // median of t_limit / t_kernel
};

// limits: the variants of the limit; each repetition times all of them and the kernel, in
// alternating order, and the pair's limit is the fastest variant of that moment (a variant that
// a neighbour's load happens to slow does not make the kernel look faster than the limit).
using Limits = std::vector<std::function<void()>>;
Paired MeasurePaired(int reps, const Limits& limits, const std::function<void()>& fn) {
  Paired out;
  std::vector<double> ratios;
  for (int r = 0; r < reps; ++r) {
    double tl = 1e30, tk = 0;
    if (r % 2 == 1) tk = Seconds(fn);
    for (const auto& limit : limits) tl = std::min(tl, Seconds(limit));
    if (r % 2 == 0) tk = Seconds(fn);
    out.best = std::min(out.best, tk);
    ratios.push_back(tl / tk);
  }
  std::sort(ratios.begin(), ratios.end());
  out.limit_over_kernel = ratios[ratios.size() / 2];
  return out;
}

struct Arrays {
  std::vector<float> p, m, v, g, acc;
  std::vector<uint16_t> g16, out16;
};

void Fill(Arrays* a, int64_t n) {
  // First touch in parallel, so the pages are spread as the kernels will use them.
  a->p.resize(n);
  a->m.resize(n);
  a->v.resize(n);
  a->g.resize(n);
  a->acc.resize(n);
  a->g16.resize(n);
  a->out16.resize(n);
  ParallelChunks(n, [&](int64_t b, int64_t len) {
    std::mt19937 rng(static_cast<uint32_t>(b));
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (int64_t i = b; i < b + len; ++i) {
      a->p[i] = d(rng);
      a->g[i] = d(rng) * 1e-2f;
      a->m[i] = a->g[i] * 0.1f;
      a->v[i] = a->g[i] * a->g[i] * 0.01f;
      a->acc[i] = a->g[i];
      a->g16[i] = FloatToBf16(a->g[i]);
    }
  });
}

// fraction < 0: not compared with a limit.
void Row(const char* what, int64_t n, double bytes_per_elem, double secs, double fraction) {
  const double gbs = n * bytes_per_elem / secs / 1e9;
  printf("%-58s %8.3f s  %7.3f Gelem/s  %7.2f GB/s", what, secs, n / secs / 1e9, gbs);
  if (fraction >= 0) printf("  %5.3f of limit", fraction);
  printf("\n");
}

// Bytes each step must move per element.
constexpr double kAdamWBytes = 16 + 12;          // p, g, m, v read; p, m, v written (fp32 grad)
constexpr double kAdamWBf16Bytes = 14 + 14;      // bf16 grad in, bf16 params out
constexpr double kFusedBytes = 16 + 4 + 12 + 2;  // p, m, v, acc, g read; p, m, v, bf16 written
constexpr double kSeparateBytes = 12 + 28 + 6;   // accumulate; AdamW from acc; cast

// What every phase shares: the sizes, the kernels, the arrays (and pointers into them), a
// one-thread arena, and the AdamW config with its step count (one count over all phases).
struct Bench {
  Bench(bool q, int64_t elements, int64_t r)
      : quick(q),
        n(elements),
        reps(r),
        threads(tbb::this_task_arena::max_concurrency()),
        fast(kernels::DefaultCpuKernel()),
        scalar(kernels::ReferenceKernel()) {
    c.lr = 1e-3;
    c.weight_decay = 0.01;
  }
  // Fills the arrays and takes the pointers into them.
  void Init() {
    Fill(&a, n);
    p = a.p.data();
    m = a.m.data();
    v = a.v.data();
    g = a.g.data();
    acc = a.acc.data();
    g16 = a.g16.data();
    out16 = a.out16.data();
  }
  // fn, run on the one-thread arena.
  auto Single(const std::function<void()>& fn) {
    return [this, fn] { one.execute(fn); };
  }
  // One AdamW step of kernel k over the arrays: fp32 gradient, or bf16 gradient and bf16 copy.
  void RunAdamW(const OptimizerKernel& k, bool bf16) {
    c.step = step++;
    if (bf16) {
      k.AdamW(c, p, m, v, g16, GradType::kBf16, n, out16);
    } else {
      k.AdamW(c, p, m, v, g, GradType::kFp32, n, nullptr);
    }
  }

  const bool quick;
  const int64_t n, reps;
  const int threads;
  const OptimizerKernel& fast;
  const OptimizerKernel& scalar;
  const bool avx512 = __builtin_cpu_supports("avx512f");
  Arrays a;
  float *p = nullptr, *m = nullptr, *v = nullptr, *g = nullptr, *acc = nullptr;
  uint16_t *g16 = nullptr, *out16 = nullptr;
  tbb::task_arena one{1};
  AdamWConfig c;
  int64_t step = 1;
};

using StreamFn = void (*)(float*, const float*, float*, float*, int64_t);

// The body ParallelChunks / ParallelRanges give a range: f on that range of the arrays.
auto On(const Bench* b, StreamFn f) {
  return [b, f](int64_t s, int64_t len) { f(b->p + s, b->g + s, b->m + s, b->v + s, len); };
}
// f over the arrays in 32K-element chunks, on all threads.
std::function<void()> Chunked(const Bench* b, StreamFn f) {
  return [b, f] { ParallelChunks(b->n, On(b, f)); };
}
// f over the arrays as one contiguous range a thread.
std::function<void()> Contiguous(const Bench* b, StreamFn f) {
  return [b, f] { ParallelRanges(b->n, b->threads, On(b, f)); };
}
// body over the arrays in both partitions (32K chunks, one contiguous range a thread).
Limits BothPartitions(const Bench* b, std::function<void(int64_t, int64_t)> body) {
  return Limits{[b, body] { ParallelChunks(b->n, body); },
                [b, body] { ParallelRanges(b->n, b->threads, body); }};
}
// The best time of the fastest of the limits, each the best of reps runs.
double BestOf(int64_t reps, const Limits& ls) {
  double t = 1e30;
  for (const auto& l : ls) t = std::min(t, Best(reps, l));
  return t;
}
// Fraction of the limit's bandwidth: (bytes / t_kernel) / (28 bytes / t_limit).
double Frac(const Paired& r, double bytes) { return r.limit_over_kernel * bytes / kAdamWBytes; }

// A streaming variant of the 4r/3w limit.
struct Variant {
  std::string name;
  std::function<void()> run;
};

// The streaming limits: the 4r/3w variants on all threads (the fastest is the limit), the
// fastest one-thread loop, and the STREAM triad.
struct StreamLimits {
  std::vector<Variant> variants;
  std::vector<double> variant_t;
  size_t fastest = 0;
  Limits all, one;  // every all-thread variant; every one-thread loop
  double t_limit = 0, t_limit1 = 1e30, limit_gbs = 0, limit1_gbs = 0, t_triad = 0, triad_gbs = 0;
};

// The limit is the fastest of a few streaming variants of the same access pattern, each
// the best of reps runs: 32K-element chunks as the kernels use (plain, unrolled, with
// non-temporal stores) and one contiguous range per thread. If a kernel still measures
// above 1 of it, the limit is not one: say so. Refills the arrays the triad overwrote.
StreamLimits MeasureLimits(Bench* b) {
  StreamLimits l;
  l.variants = {{"32K chunks", Chunked(b, &Stream4r3w)},
                {"one contiguous range a thread", Contiguous(b, &Stream4r3w)}};
  if (b->avx512) {
    l.variants.push_back({"32K chunks, unrolled x4", Chunked(b, &Stream4r3wUnrolledAvx512)});
    l.variants.push_back({"32K chunks, loads then stores", Chunked(b, &Stream4r3wGroupedAvx512)});
    l.variants.push_back({"32K chunks, non-temporal stores", Chunked(b, &Stream4r3wNtAvx512)});
    l.variants.push_back({"contiguous, unrolled x4", Contiguous(b, &Stream4r3wUnrolledAvx512)});
    l.variants.push_back({"contiguous, non-temporal stores", Contiguous(b, &Stream4r3wNtAvx512)});
  }
  for (size_t i = 0; i < l.variants.size(); ++i) {
    l.variant_t.push_back(Best(b->reps, l.variants[i].run));
    if (l.variant_t[i] < l.variant_t[l.fastest]) l.fastest = i;
  }
  for (const Variant& var : l.variants) l.all.push_back(var.run);
  // One thread: the fastest of the plain, unrolled, loads-then-stores and non-temporal loops.
  std::vector<StreamFn> one_fns = {&Stream4r3w};
  if (b->avx512) {
    one_fns.push_back(&Stream4r3wUnrolledAvx512);
    one_fns.push_back(&Stream4r3wGroupedAvx512);
    one_fns.push_back(&Stream4r3wNtAvx512);
  }
  for (StreamFn f : one_fns) {
    std::function<void()> run = b->Single([b, f] { f(b->p, b->g, b->m, b->v, b->n); });
    l.t_limit1 = std::min(l.t_limit1, Best(b->reps, run));
    l.one.push_back(run);
  }
  l.t_limit = l.variant_t[l.fastest];
  l.limit_gbs = b->n * kAdamWBytes / l.t_limit / 1e9;
  l.limit1_gbs = b->n * kAdamWBytes / l.t_limit1 / 1e9;
  l.t_triad = Best(b->reps, [b] {
    ParallelChunks(b->n, [b](int64_t s, int64_t len) {
      Triad(b->a.acc.data() + s, b->p + s, b->g + s, len);
    });
  });
  l.triad_gbs = b->n * 12.0 / l.t_triad / 1e9;
  Fill(&b->a, b->n);  // the triad overwrote the accumulator
  return l;
}

// The kernels, each timed in alternation with a limit (MeasurePaired).
struct KernelRuns {
  // Whether the bf16 and fused kernels have limits of their own access patterns.
  bool own_limits = false;
  Limits limit_fused;
  double t_limit_bf16 = 0, t_limit_fused = 0;
  Paired fp32, fp32_1, bf16, bf16_1, scalar_run, fused, fused_vs_sep, separate;
  // Against a limit of the kernel's own pattern the bytes are the same: the time ratio.
  double Own(const Paired& r, double bytes) const {
    return own_limits ? r.limit_over_kernel : Frac(r, bytes);
  }
};

// AdamW (fp32 gradient; bf16 gradient and bf16 copy; the scalar oracle), all threads and one.
void MeasureAdamW(Bench* b, const StreamLimits& l, KernelRuns* k) {
  k->fp32 = MeasurePaired(b->reps, l.all, [b] { b->RunAdamW(b->fast, false); });
  k->fp32_1 = MeasurePaired(b->reps, l.one, b->Single([b] { b->RunAdamW(b->fast, false); }));
  // The bf16 and fused kernels against limits of their own access patterns (AVX-512 machines;
  // elsewhere the 4r/3w limit scaled by bytes, as before), each in both partitions, the
  // faster of them taken in each repetition as for the 4r/3w limit.
  k->own_limits = b->avx512 && __builtin_cpu_supports("avx512bw");
  const Limits limit_bf16 =
      k->own_limits ? BothPartitions(b, [b](int64_t s, int64_t len) {
        StreamBf16Avx512(b->p + s, b->g16 + s, b->m + s, b->v + s, b->out16 + s, len);
      })
                    : l.all;
  k->limit_fused =
      k->own_limits ? BothPartitions(b, [b](int64_t s, int64_t len) {
        StreamFusedAvx512(b->p + s, b->acc + s, b->g + s, b->m + s, b->v + s, b->out16 + s, len);
      })
                    : l.all;
  k->t_limit_bf16 = BestOf(b->reps, limit_bf16);
  k->t_limit_fused = BestOf(b->reps, k->limit_fused);
  k->bf16 = MeasurePaired(b->reps, limit_bf16, [b] { b->RunAdamW(b->fast, true); });
  k->bf16_1 = MeasurePaired(b->reps, l.one, b->Single([b] { b->RunAdamW(b->fast, true); }));
  k->scalar_run =
      MeasurePaired(b->quick ? 1 : 2, l.one, [b] { b->RunAdamW(b->scalar, false); });
}

// The ZenFlow boundary: the round's last push added to the accumulator and AdamW applied in
// one pass (bf16 copy written), against the same work as separate passes with the same fast
// kernels: accumulate, AdamW from the accumulator, cast (the accumulator is not cleared in
// either: the next round's first push overwrites it).
void MeasureBoundary(Bench* b, const StreamLimits& l, KernelRuns* k) {
  const int64_t n = b->n;
  auto fused_fn = [b, n] {
    b->c.step = b->step++;
    b->fast.AccumulateAdamW(b->c, b->p, b->m, b->v, b->a.acc.data(), b->g, GradType::kFp32, 1.0f,
                            n, b->a.out16.data());
  };
  auto separate_fn = [b, n] {
    b->c.step = b->step++;
    b->fast.Accumulate(b->a.acc.data(), b->g, GradType::kFp32, 1.0f, n, AccumulateMode::kAdd);
    b->fast.AdamW(b->c, b->p, b->m, b->v, b->a.acc.data(), GradType::kFp32, n, nullptr);
    b->fast.FloatToBf16(b->p, b->a.out16.data(), n);
  };
  k->fused = MeasurePaired(b->reps, k->limit_fused, fused_fn);
  // Fused against separate in alternation as well (separate plays the "limit" role here).
  k->fused_vs_sep = MeasurePaired(b->reps, {separate_fn}, fused_fn);
  k->separate = MeasurePaired(b->reps, l.all, separate_fn);
}

// The table of the limits and the kernels.
void PrintTable(const Bench& b, const StreamLimits& l, const KernelRuns& k) {
  const int64_t n = b.n;
  printf("\n%-58s %10s  %13s  %10s\n", "", "time", "rate", "bandwidth");
  if (k.own_limits) {
    Row("streaming limit of the bf16 AdamW pattern, all threads", n, kAdamWBf16Bytes,
        k.t_limit_bf16, -1);
    Row("streaming limit of the fused boundary pattern, all threads", n, kFusedBytes,
        k.t_limit_fused, -1);
  }
  for (size_t i = 0; i < l.variants.size(); ++i)
    Row(("streaming 4r/3w, " + l.variants[i].name + (i == l.fastest ? " = limit" : "")).c_str(),
        n, kAdamWBytes, l.variant_t[i], -1);
  Row("streaming limit, 4 read / 3 write, 1 thread", n, kAdamWBytes, l.t_limit1, -1);
  printf("%-58s %8.3f s  %24.2f GB/s  (4r/3w limit is %.2fx the triad)\n",
         "STREAM triad, all threads (for comparison)", l.t_triad, l.triad_gbs,
         l.limit_gbs / l.triad_gbs);
  Row("AdamW fp32 grad, all threads", n, kAdamWBytes, k.fp32.best, Frac(k.fp32, kAdamWBytes));
  Row("AdamW fp32 grad, 1 thread (vs 1-thread limit)", n, kAdamWBytes, k.fp32_1.best,
      Frac(k.fp32_1, kAdamWBytes));
  Row("AdamW bf16 grad + bf16 params out, all threads", n, kAdamWBf16Bytes, k.bf16.best,
      k.Own(k.bf16, kAdamWBf16Bytes));
  Row("AdamW bf16 grad + bf16 params out, 1 thread", n, kAdamWBf16Bytes, k.bf16_1.best,
      Frac(k.bf16_1, kAdamWBf16Bytes));
  Row("AdamW fp32, scalar oracle (1 thread)", n, kAdamWBytes, k.scalar_run.best,
      Frac(k.scalar_run, kAdamWBytes));
  Row("boundary: fused accumulate + AdamW + bf16, all threads", n, kFusedBytes, k.fused.best,
      k.Own(k.fused, kFusedBytes));
  Row("boundary: separate accumulate, AdamW, cast passes", n, kSeparateBytes, k.separate.best,
      Frac(k.separate, kSeparateBytes));
}

// The 4096 x 4096 block's times: AdamW, accumulate, column selection, per-column AdamW.
struct BlockRuns {
  double t_w_adamw = 0, t_w_acc = 0, t_w_select = 0, t_w_cols = 0;
  // One AccumulateAdamWColumns call on a row of 64 / 1024 elements that stays in L1: the first
  // is mostly the call's fixed cost, the second a work journal unit's (seconds per call).
  double call_64 = 0, call_1024 = 0;
};

// Accumulate and column selection on a 4096 x 4096 gradient, against one AdamW step on it;
// prints the block's lines.
BlockRuns MeasureBlock(Bench* b) {
  const OptimizerKernel& fast = b->fast;
  float *p = b->p, *m = b->m, *v = b->v, *g = b->g;
  AdamWConfig& c = b->c;
  BlockRuns w;
  const int64_t rows = 4096, cols = 4096, tn = rows * cols;
  w.t_w_adamw = Best(b->reps * 2, [&] {
    c.step = b->step++;
    fast.AdamW(c, p, m, v, g, GradType::kFp32, tn, nullptr);
  });
  w.t_w_acc = Best(b->reps * 2, [&] {
    fast.Accumulate(b->a.acc.data(), g, GradType::kFp32, 1.0f, tn, AccumulateMode::kAdd);
  });
  std::vector<float> l2(cols);
  std::vector<int64_t> idx(cols / 10);
  w.t_w_select = Best(b->reps * 2, [&] {
    fast.ColumnScores(g, GradType::kFp32, rows, cols, cols, nullptr, l2.data());
    fast.TopK(l2.data(), cols, cols / 10, idx.data());
  });
  // AdamWColumns on the same block, every column at its own step (ZenFlow's migrated columns),
  // against the uniform AdamW just measured: the cost of the per-column bias corrections.
  std::vector<int64_t> col_steps(cols);
  for (int64_t j = 0; j < cols; ++j) col_steps[j] = 1 + j % 1000;
  std::vector<float> col_step_size(cols), col_bc2_sqrt(cols);
  kernels::MakeColumnConstants(c, col_steps.data(), cols, col_step_size.data(),
                               col_bc2_sqrt.data());
  w.t_w_cols = Best(b->reps * 2, [&] {
    fast.AdamWColumns(c, col_step_size.data(), col_bc2_sqrt.data(), p, m, v, g, GradType::kFp32,
                      rows, cols, nullptr);
  });
  printf("\n4096x4096 gradient: AdamW %.2f ms, accumulate %.2f ms (%.3f of AdamW), column "
         "scores + top-10%% %.2f ms (%.3f of AdamW)\n",
         w.t_w_adamw * 1e3, w.t_w_acc * 1e3, w.t_w_acc / w.t_w_adamw, w.t_w_select * 1e3,
         w.t_w_select / w.t_w_adamw);
  printf("4096x4096 per-column steps: AdamWColumns %.2f ms (%.3f of AdamW)\n", w.t_w_cols * 1e3,
         w.t_w_cols / w.t_w_adamw);
  // What a kernel call costs by itself: why the work journal runs a worker's consecutive units
  // as one call (server/session_journal.h).
  {
    constexpr int kCalls = 20000;
    auto calls = [&](int64_t n) {
      return Best(b->reps * 2, [&] {
                for (int i = 0; i < kCalls; ++i)
                  fast.AccumulateAdamWColumns(c, col_step_size.data(), col_bc2_sqrt.data(), p, m,
                                              v, b->a.acc.data(), g, GradType::kFp32, 0.5f, 1, n,
                                              kernels::ParamOut::Fp32(b->a.p.data() + n));
              }) / kCalls;
    };
    w.call_64 = calls(64);
    w.call_1024 = calls(1024);
  }
  printf("one AccumulateAdamWColumns call in L1: %.0f ns on 64 elements, %.0f ns on 1024\n",
         w.call_64 * 1e9, w.call_1024 * 1e9);
  return w;
}

// The daemon's fp32 update as OffloadSession::Update runs it: master, m, v and the accumulator
// in one state block, the new values also written to an fp32 parameter slot of the session's
// region (a memfd). The arrays placed exactly n elements apart (as the daemon did; n here a
// power of two, as a model of 2048 x 2048 weights gives) and StateStride apart (as it does now:
// 1088 bytes further into a page each, server/requests.h); the state block in the daemon's anonymous
// memory (transparent huge pages), and in a memfd, as a state that outlives the daemon would
// need (shmem's own huge-page setting applies there). Also the update without the slot, and with
// the slot written by a second pass (a memcpy, as before the kernels wrote it).
struct SlotRuns {
  double packed = 0, strided = 0, memfd = 0, no_slot = 0, copy_after = 0;  // best seconds
  double commits = 0;  // the session record's two commits of an Update (server/session_record.h)
  double journaled = 0;  // the memfd update through the work journal (server/session_journal.h)
  double cols_plain = 0, cols_journaled = 0;  // the column-step fused update, without and with
  double cols_plain_1thread = 0, cols_journaled_1thread = 0;  // the same on one thread
};

SlotRuns MeasureSlot(Bench* b) {
  SlotRuns r;
  const int64_t n = b->n;
  const int64_t stride = n + (1024 + 272 - n % 1024) % 1024;  // server/requests.h, StateStride
  const uint64_t bytes = static_cast<uint64_t>(stride) * 4 * sizeof(float);
  auto slot = MappedRegion::CreateMemfd("bench slot", static_cast<uint64_t>(n) * sizeof(float),
                                        PinPolicy::kOff);
  auto anon = MappedRegion::CreateAnonymous("bench state", bytes, PinPolicy::kOff);
  auto memfd = MappedRegion::CreateMemfd("bench state memfd", bytes, PinPolicy::kOff);
  if (!slot.ok() || !anon.ok() || !memfd.ok()) {
    printf("session state placement: not measured (%s)\n",
           std::string((!slot.ok() ? slot.status() : !anon.ok() ? anon.status()
                                                                : memfd.status()).message())
               .c_str());
    return r;
  }
  float* out = reinterpret_cast<float*>((*slot)->data());
  // With `journal`, the update runs as OffloadSession::Update runs it: over the journal's units,
  // each saved before it changes and marked done after.
  auto run = [&](MappedRegion* state, int64_t apart, bool with_slot, bool copy,
                 WorkJournal* journal = nullptr) {
    float* base = reinterpret_cast<float*>(state->data());
    float *p = base, *m = base + apart, *v = base + 2 * apart, *acc = base + 3 * apart;
    ParallelChunks(n, [&](int64_t s, int64_t len) {  // first touch, as Fill
      for (int64_t i = s; i < s + len; ++i) {
        p[i] = b->a.p[i];
        m[i] = b->a.m[i];
        v[i] = b->a.v[i];
        acc[i] = b->a.acc[i];
      }
    });
    return Best(static_cast<int>(b->reps), [&] {
      b->c.step = b->step++;
      if (journal != nullptr) {
        journal->Begin(static_cast<uint64_t>(b->c.step), JournalOp::kUpdate, "").IgnoreError();
        journal->Run(
            static_cast<uint64_t>(n), {p, m, v},
            [&](uint64_t s, uint64_t e) {
              b->fast.AdamW(b->c, p + s, m + s, v + s, acc + s, GradType::kFp32,
                            static_cast<int64_t>(e - s), kernels::ParamOut::Fp32(out + s));
            },
            nullptr,
            b->fast.KeepsUndoLog() ? WorkJournal::Saving::kInKernels
                                   : WorkJournal::Saving::kCopyFirst);
        return;
      }
      ParallelChunks(n, [&](int64_t s, int64_t len) {
        b->fast.AdamW(b->c, p + s, m + s, v + s, acc + s, GradType::kFp32, len,
                      with_slot && !copy ? kernels::ParamOut::Fp32(out + s) : nullptr);
        if (copy) memcpy(out + s, p + s, len * sizeof(float));
      });
    });
  };
  r.packed = run(anon->get(), n, true, false);
  r.strided = run(anon->get(), stride, true, false);
  r.memfd = run(memfd->get(), stride, true, false);
  r.no_slot = run(anon->get(), stride, false, false);
  r.copy_after = run(anon->get(), stride, true, true);
  {
    const JournalGeometry g = JournalGeometryFor(static_cast<uint64_t>(n), 1, 2048);
    auto jmem = MappedRegion::CreateMemfd("bench journal", g.bytes, PinPolicy::kOff);
    if (jmem.ok()) {
      WorkJournal journal((*jmem)->data(), g);
      journal.Format();
      // Alternated with the plain memfd update: this machine is shared and noisy.
      double plain = r.memfd, with = 1e30;
      for (int round = 0; round < 2; ++round) {
        with = std::min(with, run(memfd->get(), stride, true, false, &journal));
        plain = std::min(plain, run(memfd->get(), stride, true, false));
      }
      r.memfd = plain;
      r.journaled = with;
      // The kernel ZenFlow's Updates run (the round's last push fused into AdamW with per-column
      // steps; rows of 2048 columns, fp32 gradient and slot): per journal unit in the kernels'
      // pass, against whole rows in chunks without the journal.
      const int64_t cols = 2048, rows = n / cols;
      std::vector<int64_t> steps(cols);
      for (int64_t j = 0; j < cols; ++j) steps[j] = 1 + j % 7;
      std::vector<float> ss(cols), bc(cols);
      kernels::MakeColumnConstants(b->c, steps.data(), cols, ss.data(), bc.data());
      float* base = reinterpret_cast<float*>((*memfd)->data());
      float *p = base, *m = base + stride, *v = base + 2 * stride, *acc = base + 3 * stride;
      const float* g = b->a.g.data();
      auto cols_run = [&](bool journaled) {
        return Best(static_cast<int>(b->reps), [&] {
          if (journaled) {
            journal.Begin(1, JournalOp::kUpdate, "").IgnoreError();
            journal.Run(
                static_cast<uint64_t>(rows * cols), {p, m, v},
                [&](uint64_t s, uint64_t e) {
                  // As OffloadSession::UpdateArrays cuts a range: a row's rest, whole rows, a
                  // row's start.
                  for (int64_t at = static_cast<int64_t>(s); at < static_cast<int64_t>(e);) {
                    const int64_t c0 = at % cols, left = static_cast<int64_t>(e) - at;
                    const int64_t nr = c0 != 0 || left < cols ? 1 : left / cols;
                    const int64_t nc = nr > 1 || (c0 == 0 && left >= cols)
                                           ? cols : std::min(cols - c0, left);
                    b->fast.AccumulateAdamWColumns(b->c, ss.data() + c0, bc.data() + c0, p + at,
                                                   m + at, v + at, acc + at, g + at,
                                                   GradType::kFp32, 0.5f, nr, nc,
                                                   kernels::ParamOut::Fp32(out + at));
                    at += nr * nc;
                  }
                },
                nullptr, WorkJournal::Saving::kInKernels);
            return;
          }
          ParallelChunks(rows, [&](int64_t r0, int64_t nr) {
            const int64_t at = r0 * cols;
            b->fast.AccumulateAdamWColumns(b->c, ss.data(), bc.data(), p + at, m + at, v + at,
                                           acc + at, g + at, GradType::kFp32, 0.5f, nr, cols,
                                           kernels::ParamOut::Fp32(out + at));
          });
        });
      };
      double cplain = 1e30, cwith = 1e30, cplain1 = 1e30, cwith1 = 1e30;
      for (int round = 0; round < 2; ++round) {
        cwith = std::min(cwith, cols_run(true));
        cplain = std::min(cplain, cols_run(false));
      }
      // The same on one thread: there the core, not the memory, is the limit, and what the
      // kernels' undo log adds shows whole (three 64-byte ring stores and a mark a vector).
      for (int round = 0; round < 2; ++round) {
        b->one.execute([&] { cwith1 = std::min(cwith1, cols_run(true)); });
        b->one.execute([&] { cplain1 = std::min(cplain1, cols_run(false)); });
      }
      r.cols_plain = cplain;
      r.cols_journaled = cwith;
      r.cols_plain_1thread = cplain1;
      r.cols_journaled_1thread = cwith1;
    }
  }
  // What crash safety adds to each Update: the session record's two commits (busy before, done
  // after), for the n elements as square-ish weights of 8192 columns (per-column steps: the
  // commit's size grows with the columns, not the elements).
  {
    const int64_t cols = 8192, rows = std::max<int64_t>(1, n / cols);
    SessionIdentity id;
    id.params = {{"w", {rows, cols}, 1}};
    std::vector<uint8_t> rec(RecordBytes(id.params));
    SessionRecord record(rec.data(), rec.size());
    SessionCommit c;
    c.col_steps = {std::vector<int64_t>(cols, 3)};
    if (record.WriteIdentity(id).ok())
      r.commits = Best(static_cast<int>(b->reps), [&] {
        for (int i = 0; i < 2; ++i) record.Commit(c).IgnoreError();
      });
  }
  if (r.journaled > 0)
    printf("\nsession update through the work journal (memfd state + slot): %.3f Gelem/s, "
           "without %.3f\n", n / r.journaled / 1e9, n / r.memfd / 1e9);
  if (r.cols_journaled > 0)
    printf("the same with per-column steps and the push fused (ZenFlow's Update): %.3f Gelem/s, "
           "without the journal %.3f; on one thread %.3f and %.3f\n", n / r.cols_journaled / 1e9,
           n / r.cols_plain / 1e9, n / r.cols_journaled_1thread / 1e9,
           n / r.cols_plain_1thread / 1e9);
  printf("\nsession state placement (%lld elements; fp32 update + slot): arrays n apart %.3f "
         "Gelem/s, StateStride apart %.3f, the state in a memfd %.3f; without the slot %.3f; "
         "the slot by a second pass %.3f\n",
         static_cast<long long>(n), n / r.packed / 1e9, n / r.strided / 1e9, n / r.memfd / 1e9,
         n / r.no_slot / 1e9, n / r.copy_after / 1e9);
  return r;
}

// The session update's FIGURE lines.
void PrintSlotFigures(int64_t n, const SlotRuns& slot) {
  if (slot.strided > 0) {
    printf("FIGURE session_update_fp32_slot_gelem_per_s %.3f Gelem/s\n", n / slot.strided / 1e9);
    printf("FIGURE session_update_state_stride_vs_packed %.3f x\n", slot.packed / slot.strided);
    printf("FIGURE session_update_fp32_slot_vs_second_pass %.3f x\n",
           slot.copy_after / slot.strided);
    printf("FIGURE session_update_state_memfd_vs_anonymous %.3f x\n", slot.strided / slot.memfd);
    printf("FIGURE session_update_record_commits_fraction %.5f ratio (of the update's time)\n",
           slot.commits / slot.strided);
    if (slot.journaled > 0)
      printf("FIGURE session_update_journaled_vs_without %.3f x (throughput; crash safety's "
             "target >= 0.95)\n", slot.memfd / slot.journaled);
    if (slot.cols_journaled > 0)
      printf("FIGURE session_update_columns_journaled_vs_without %.3f x (throughput; the "
             "column-step fused Update, target >= 0.95)\n",
             slot.cols_plain / slot.cols_journaled);
    if (slot.cols_journaled_1thread > 0)
      printf("FIGURE session_update_columns_journaled_vs_without_1thread %.3f x (one core: the "
             "undo log's stores in full)\n",
             slot.cols_plain_1thread / slot.cols_journaled_1thread);
  }
}

// The FIGURE lines.
void PrintFigures(const Bench& b, const StreamLimits& l, const KernelRuns& k, const BlockRuns& w,
                  const SlotRuns& slot) {
  const int64_t n = b.n;
  printf("\n");
  printf("FIGURE stream_limit_4r3w %.2f GB/s\n", l.limit_gbs);
  printf("FIGURE stream_limit_4r3w_1thread %.2f GB/s\n", l.limit1_gbs);
  printf("FIGURE stream_triad %.2f GB/s\n", l.triad_gbs);
  printf("FIGURE adamw_fp32_gelem_per_s %.3f Gelem/s\n", n / k.fp32.best / 1e9);
  printf("FIGURE adamw_fp32_fraction_of_stream_limit %.3f ratio\n", Frac(k.fp32, kAdamWBytes));
  printf("FIGURE adamw_fp32_1thread_gelem_per_s %.3f Gelem/s\n", n / k.fp32_1.best / 1e9);
  printf("FIGURE adamw_fp32_1thread_fraction_of_1thread_limit %.3f ratio\n",
         Frac(k.fp32_1, kAdamWBytes));
  printf("FIGURE adamw_bf16_gelem_per_s %.3f Gelem/s\n", n / k.bf16.best / 1e9);
  printf("FIGURE adamw_bf16_fraction_of_stream_limit %.3f ratio\n",
         k.Own(k.bf16, kAdamWBf16Bytes));
  printf("FIGURE adamw_vs_scalar %.2f x\n", k.scalar_run.best / k.fp32.best);
  double worst = 0;
  for (double f : {Frac(k.fp32, kAdamWBytes), Frac(k.fp32_1, kAdamWBytes),
                   k.Own(k.bf16, kAdamWBf16Bytes), k.Own(k.fused, kFusedBytes),
                   Frac(k.separate, kSeparateBytes)})
    worst = std::max(worst, f);
  printf("FIGURE max_kernel_fraction_of_stream_limit %.3f ratio (a limit is one if <= 1.02)\n",
         worst);
  printf("FIGURE fused_boundary_gelem_per_s %.3f Gelem/s\n", n / k.fused.best / 1e9);
  printf("FIGURE fused_boundary_vs_separate_passes %.2f x\n", k.fused_vs_sep.limit_over_kernel);
  printf("FIGURE accumulate_4096x4096_fraction_of_adamw %.3f ratio\n", w.t_w_acc / w.t_w_adamw);
  printf("FIGURE select_4096x4096_fraction_of_adamw %.3f ratio\n", w.t_w_select / w.t_w_adamw);
  printf("FIGURE adamw_columns_4096x4096_fraction_of_adamw %.3f ratio\n",
         w.t_w_cols / w.t_w_adamw);
  printf("FIGURE adamw_columns_call_64_ns %.0f ns (one call on 64 elements in L1)\n",
         w.call_64 * 1e9);
  printf("FIGURE adamw_columns_call_64_fraction_of_1024 %.3f ratio (a journal unit's call)\n",
         w.call_64 / w.call_1024);
  PrintSlotFigures(n, slot);
}


int Main(int argc, char** argv) {
  bool quick = false;
  int64_t elements = int64_t{256} << 20;
  int64_t reps = 5;
  FlagSet flags("optimizer_bench",
                "CPU AdamW, the fused ZenFlow boundary pass, accumulate and column selection "
                "against the streaming limit of their access pattern.");
  flags.AddBool("quick", &quick, "64M elements, 3 repetitions (finishes within 40 s)");
  flags.AddInt("elements", &elements, "elements per array for the AdamW figures");
  flags.AddInt("reps", &reps, "repetitions per figure (the best is reported)");
  bool session_only = false;
  flags.AddBool("session_only", &session_only,
                "only the session update's figures (the state placement, the work journal)");
  if (int code = flags.ParseCommandLine(argc, argv); code >= 0) return code;
  if (quick) {
    elements = int64_t{64} << 20;
    reps = 3;
  }
  Bench b(quick, elements, reps);
  printf("optimizer_bench: %lld elements per array (%.0f MiB fp32), %d threads, kernel %s, best "
         "of %lld\n",
         static_cast<long long>(b.n), b.n * 4.0 / (1 << 20), b.threads, b.fast.name(),
         static_cast<long long>(reps));
  b.Init();
  if (session_only) {
    const SlotRuns slot = MeasureSlot(&b);
    PrintSlotFigures(b.n, slot);
    return 0;
  }
  const StreamLimits l = MeasureLimits(&b);
  KernelRuns k;
  MeasureAdamW(&b, l, &k);
  MeasureBoundary(&b, l, &k);
  PrintTable(b, l, k);
  const BlockRuns w = MeasureBlock(&b);
  const SlotRuns slot = MeasureSlot(&b);
  PrintFigures(b, l, k, w, slot);
  return 0;
}

}  // namespace
}  // namespace stallfree

int main(int argc, char** argv) { return stallfree::Main(argc, argv); }
