// GPU figures in one run: the device's copy bandwidth, the optimizer kernels against it, the
// column selection, and the bf16 GEMM rate.
//
//   bazel build --config=cuda //bench:gpu_bench && bazel-bin/bench/gpu_bench [--elements N]
//
// Bandwidth figures count the bytes a kernel must read plus the bytes it must write (each array
// once). The ceiling is a large cudaMemcpyAsync device to device (read + write bytes), and a
// streaming kernel with AdamW's access pattern (4 fp32 arrays read, 3 written, no arithmetic to
// speak of) shows what an element-wise kernel with that pattern can reach. Every time is taken
// with CUDA events around one call, after warm-up; a figure is the best of the repetitions (as
// STREAM reports: interference only makes a run slower), the median is printed beside it.
// Arrays are 256M elements (1 GiB per fp32 array), far beyond the 60 MB L2, filled with random
// values (never zeros). Prints "FIGURE <name> <value> <unit>" lines; without a device prints
// "SKIP: <reason>" and exits 0; exits 1 if a device call fails.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/optimizer_cuda.h"
#include "kernels/ops.h"
#include "kernels/optimizer.h"

namespace {

using stallfree::kernels::AccumulateMode;
using stallfree::kernels::AdamWConfig;
using stallfree::kernels::GradType;
using stallfree::kernels::OptimizerKernel;
using stallfree::kernels::Trans;
using stallfree::kernels::TransformerOps;
namespace cuda = stallfree::kernels::cuda;
namespace dmem = stallfree::kernels::cuda::dmem;

constexpr int kWarmup = 3;
constexpr int kReps = 10;

int g_errors = 0;

bool Ok(const std::string& error, const char* what) {
  if (error.empty()) return true;
  std::printf("ERROR %s: %s\n", what, error.c_str());
  std::fflush(stdout);
  ++g_errors;
  return false;
}

// A device buffer (RAII).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (!Ok(dmem::Alloc(bytes, &ptr_), "dmem::Alloc")) ptr_ = nullptr;
  }
  ~DeviceBuffer() { dmem::Free(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  bool ok() const { return ptr_ != nullptr || bytes_ == 0; }

 private:
  size_t bytes_;
  void* ptr_ = nullptr;
};

struct Timing {
  double best_ms = 0, median_ms = 0;
  bool ok = false;
};

Timing Time(void* stream, const std::function<void()>& enqueue, const char* what) {
  std::vector<float> ms;
  Timing t;
  if (!Ok(dmem::TimeOnStream(stream, enqueue, kWarmup, kReps, &ms), what) || ms.empty()) return t;
  std::sort(ms.begin(), ms.end());
  t.best_ms = ms.front();
  t.median_ms = ms[ms.size() / 2];
  t.ok = true;
  return t;
}

void Figure(const std::string& name, double value, const char* unit) {
  std::printf("FIGURE %s %.4g %s\n", name.c_str(), value, unit);
  std::fflush(stdout);
}

// Bytes over the best time, in GB/s; also prints the median time.
double Bandwidth(const std::string& name, const Timing& t, double bytes) {
  if (!t.ok) return 0;
  const double gbps = bytes / (t.best_ms * 1e-3) / 1e9;
  std::printf("INFO %s: best %.3f ms, median %.3f ms, %.3f GB moved\n", name.c_str(), t.best_ms,
              t.median_ms, bytes / 1e9);
  Figure(name + "_gbps", gbps, "GB/s");
  return gbps;
}

// Fills n fp32 elements at dst with a 4M-element random tile (normal * scale, or |normal| *
// scale), repeated: random data at host-copy speed.
bool FillRandom(float* dst, int64_t n, float scale, bool positive, uint64_t seed) {
  const int64_t tile = std::min<int64_t>(n, int64_t{1} << 22);
  std::vector<float> host(static_cast<size_t>(tile));
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 12345;
  for (int64_t i = 0; i < tile; i += 2) {
    auto next = [&s] {
      uint64_t z = (s += 0x9e3779b97f4a7c15ull);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      return ((z ^ (z >> 31)) >> 11) * (1.0 / 9007199254740992.0);
    };
    const double r = std::sqrt(-2.0 * std::log(1.0 - next())), a = 6.283185307179586 * next();
    const float x0 = static_cast<float>(r * std::cos(a)) * scale;
    const float x1 = static_cast<float>(r * std::sin(a)) * scale;
    host[i] = positive ? std::fabs(x0) : x0;
    if (i + 1 < tile) host[i + 1] = positive ? std::fabs(x1) : x1;
  }
  for (int64_t off = 0; off < n; off += tile) {
    const int64_t len = std::min(tile, n - off);
    if (!Ok(dmem::ToDevice(dst + off, host.data(), static_cast<size_t>(len) * sizeof(float)),
            "dmem::ToDevice")) {
      return false;
    }
  }
  return true;
}

AdamWConfig Config(int64_t step) {
  AdamWConfig c;
  c.lr = 1e-4;  // small steps: values stay in range over the repetitions
  c.weight_decay = 0.01;
  c.step = step;
  return c;
}

// What the optimizer figures share: the kernel, its stream, and seven arrays of n elements on
// the device (fp32 p, m, v, g, acc; bf16 g16, out16), with the step count of the AdamW calls.
struct OptimizerArrays {
  OptimizerArrays(OptimizerKernel* kernel, void* s, int64_t elements)
      : k(kernel),
        stream(s),
        n(elements),
        f32(static_cast<size_t>(n) * sizeof(float)),
        b16(static_cast<size_t>(n) * sizeof(uint16_t)),
        dn(static_cast<double>(n)),
        p(f32),
        m(f32),
        v(f32),
        g(f32),
        acc(f32),
        g16(b16),
        out16(b16) {}
  // Whether every array was allocated.
  bool ok() const {
    return p.ok() && m.ok() && v.ok() && g.ok() && acc.ok() && g16.ok() && out16.ok();
  }
  // Random p, m, v, g and acc (the same values every call).
  bool Init() {
    return FillRandom(p.as<float>(), n, 1.0f, false, 1) &&
           FillRandom(m.as<float>(), n, 1e-2f, false, 2) &&
           FillRandom(v.as<float>(), n, 1e-4f, true, 3) &&
           FillRandom(g.as<float>(), n, 1e-2f, false, 4) &&
           FillRandom(acc.as<float>(), n, 1e-2f, false, 5);
  }

  OptimizerKernel* k;
  void* stream;
  int64_t n;
  size_t f32, b16;
  double dn;
  DeviceBuffer p, m, v, g, acc, g16, out16;
  int64_t step = 1;
};

// The ceilings' bandwidths, GB/s (0 where not measured).
struct Ceilings {
  double d2d = 0, pattern_gbps = 0;
};

// The ceilings: a device-to-device copy, a 1-read 1-write streaming kernel and AdamW's 4-read
// 3-write pattern; refills the arrays the pattern overwrote. False if a device call failed.
bool MeasureCeilings(OptimizerArrays* a, Ceilings* ceilings) {
  void* stream = a->stream;
  const int64_t n = a->n;
  const Timing copy = Time(
      stream,
      [&] { Ok(dmem::CopyOnStream(a->acc.as<float>(), a->g.as<float>(), a->f32, stream), "copy"); },
      "d2d copy");
  ceilings->d2d = Bandwidth("gpu_d2d_copy", copy, 2.0 * a->f32);
  const Timing copy_kernel = Time(
      stream,
      [&] {
        const float* in[1] = {a->g.as<float>()};
        float* out[1] = {a->acc.as<float>()};
        Ok(cuda::LaunchStreamPattern(stream, in, 1, out, 1, n), "stream 1r1w");
      },
      "stream 1r1w");
  Bandwidth("gpu_stream_copy_kernel", copy_kernel, 2.0 * a->f32);
  const Timing pattern = Time(
      stream,
      [&] {
        const float* in[4] = {a->p.as<float>(), a->m.as<float>(), a->v.as<float>(),
                              a->g.as<float>()};
        float* out[3] = {a->p.as<float>(), a->m.as<float>(), a->v.as<float>()};
        Ok(cuda::LaunchStreamPattern(stream, in, 4, out, 3, n), "stream 4r3w");
      },
      "stream 4r3w");
  ceilings->pattern_gbps = Bandwidth("gpu_stream_4r3w", pattern, 28.0 * a->dn);
  return Ok(a->k->Synchronize(), "ceilings") && a->Init();  // the pattern overwrote p, m, v
}

// AdamW with an fp32 gradient, and with a bf16 gradient and bf16 parameter copy, against the
// ceilings. False if a device call failed.
bool MeasureAdamW(OptimizerArrays* a, const Ceilings& ceilings) {
  OptimizerKernel* k = a->k;
  const int64_t n = a->n;
  // AdamW, fp32 gradient: reads p, m, v, g; writes p, m, v (28 bytes per element).
  const Timing adamw32 = Time(
      a->stream,
      [&] {
        k->AdamW(Config(a->step++), a->p.as<float>(), a->m.as<float>(), a->v.as<float>(),
                 a->g.as<float>(), GradType::kFp32, n, nullptr);
      },
      "adamw fp32");
  const double a32 = Bandwidth("gpu_adamw_fp32", adamw32, 28.0 * a->dn);
  // bf16 gradient and bf16 parameter copy: 12 + 2 read, 12 + 2 written.
  const Timing adamw16 = Time(
      a->stream,
      [&] {
        k->AdamW(Config(a->step++), a->p.as<float>(), a->m.as<float>(), a->v.as<float>(),
                 a->g16.as<uint16_t>(), GradType::kBf16, n, a->out16.as<uint16_t>());
      },
      "adamw bf16");
  const double a16 = Bandwidth("gpu_adamw_bf16_grad_bf16_out", adamw16, 28.0 * a->dn);
  if (!Ok(k->Synchronize(), "AdamW")) return false;
  if (ceilings.d2d > 0) {
    Figure("gpu_adamw_fp32_fraction_of_d2d_copy", a32 / ceilings.d2d, "ratio");
    Figure("gpu_adamw_bf16_fraction_of_d2d_copy", a16 / ceilings.d2d, "ratio");
  }
  if (ceilings.pattern_gbps > 0) {
    Figure("gpu_adamw_fp32_fraction_of_stream_4r3w", a32 / ceilings.pattern_gbps, "ratio");
  }
  if (adamw32.ok) Figure("gpu_adamw_fp32_ms", adamw32.best_ms, "ms");
  return true;
}

// The ZenFlow boundary, fused against separate passes. False if a device call failed.
bool MeasureBoundary(OptimizerArrays* a, const Ceilings& ceilings) {
  OptimizerKernel* k = a->k;
  const int64_t n = a->n;
  // The ZenFlow boundary: acc + bf16 grad, AdamW, bf16 out. Fused: reads p, m, v, acc (16) and
  // the bf16 grad (2), writes p, m, v (12) and the bf16 copy (2) = 32 bytes per element.
  // Separate: Accumulate (acc += grad: 4 + 2 + 4) then AdamW on acc (16 + 12 + 2) = 40.
  const Timing fused = Time(
      a->stream,
      [&] {
        k->AccumulateAdamW(Config(a->step++), a->p.as<float>(), a->m.as<float>(),
                           a->v.as<float>(), a->acc.as<float>(), a->g16.as<uint16_t>(),
                           GradType::kBf16, 1.0f, n, a->out16.as<uint16_t>());
      },
      "boundary fused");
  const Timing separate = Time(
      a->stream,
      [&] {
        k->Accumulate(a->acc.as<float>(), a->g16.as<uint16_t>(), GradType::kBf16, 1e-3f, n,
                      AccumulateMode::kAdd);
        k->AdamW(Config(a->step++), a->p.as<float>(), a->m.as<float>(), a->v.as<float>(),
                 a->acc.as<float>(), GradType::kFp32, n, a->out16.as<uint16_t>());
      },
      "boundary separate");
  if (!Ok(k->Synchronize(), "boundary")) return false;
  const double fused_gbps = Bandwidth("gpu_boundary_fused", fused, 32.0 * a->dn);
  Bandwidth("gpu_boundary_separate", separate, 40.0 * a->dn);
  if (fused.ok && separate.ok) {
    Figure("gpu_boundary_fused_ms", fused.best_ms, "ms");
    Figure("gpu_boundary_separate_ms", separate.best_ms, "ms");
    Figure("gpu_boundary_fused_speedup", separate.best_ms / fused.best_ms, "ratio");
    if (ceilings.d2d > 0) {
      Figure("gpu_boundary_fused_fraction_of_d2d_copy", fused_gbps / ceilings.d2d, "ratio");
    }
  }
  return true;
}

// The optimizer figures on n-element arrays: ceilings, AdamW, the boundary. False if a device
// call failed.
bool MeasureOptimizer(OptimizerKernel* k, void* stream, int64_t n) {
  OptimizerArrays a(k, stream, n);
  if (!a.ok()) return false;
  if (!a.Init()) return false;
  k->FloatToBf16(a.g.as<float>(), a.g16.as<uint16_t>(), n);
  if (!Ok(k->Synchronize(), "FloatToBf16")) return false;
  Ceilings ceilings;
  return MeasureCeilings(&a, &ceilings) && MeasureAdamW(&a, ceilings) &&
         MeasureBoundary(&a, ceilings);
}

// Column selection on a 4096 x 4096 gradient: scores (l1 and l2sq), then the top 1024. False if
// a device call failed.
bool MeasureSelection(OptimizerKernel* k, void* stream) {
  const int64_t rows = 4096, cols = 4096, top = 1024;
  DeviceBuffer g(rows * cols * sizeof(float)), g16(rows * cols * sizeof(uint16_t));
  DeviceBuffer l1(cols * sizeof(float)), l2(cols * sizeof(float)), idx(top * sizeof(int64_t));
  if (!g.ok() || !g16.ok() || !l1.ok() || !l2.ok() || !idx.ok()) return false;
  if (!FillRandom(g.as<float>(), rows * cols, 1.0f, false, 6)) return false;
  k->FloatToBf16(g.as<float>(), g16.as<uint16_t>(), rows * cols);
  for (GradType type : {GradType::kFp32, GradType::kBf16}) {
    const char* tn = type == GradType::kBf16 ? "bf16" : "fp32";
    const void* src = type == GradType::kBf16 ? static_cast<const void*>(g16.as<uint16_t>())
                                              : static_cast<const void*>(g.as<float>());
    const Timing scores = Time(
        stream,
        [&] { k->ColumnScores(src, type, rows, cols, cols, l1.as<float>(), l2.as<float>()); },
        "column scores");
    const double bytes = static_cast<double>(rows * cols) * (type == GradType::kBf16 ? 2 : 4);
    Bandwidth(std::string("gpu_column_scores_4096_") + tn, scores, bytes);
    if (scores.ok) {
      Figure(std::string("gpu_column_scores_4096_") + tn + "_us", scores.best_ms * 1e3, "us");
    }
  }
  const Timing topk = Time(
      stream, [&] { k->TopK(l2.as<float>(), cols, top, idx.as<int64_t>()); }, "topk");
  const Timing both = Time(
      stream,
      [&] {
        k->ColumnScores(g.as<float>(), GradType::kFp32, rows, cols, cols, nullptr,
                        l2.as<float>());
        k->TopK(l2.as<float>(), cols, top, idx.as<int64_t>());
      },
      "scores + topk");
  if (!Ok(k->Synchronize(), "selection")) return false;
  if (topk.ok) Figure("gpu_topk_4096_k1024_us", topk.best_ms * 1e3, "us");
  if (both.ok) Figure("gpu_select_4096x4096_fp32_us", both.best_ms * 1e3, "us");
  return true;
}

// bf16 GEMM through the CUDA ops backend (cuBLAS), C = A B with fp32 output, 8192^3 and 4096^3.
// *error: where NewCudaOps says why it failed. False if a device call failed.
bool MeasureGemm(OptimizerKernel* k, void* stream, std::string* error) {
  std::unique_ptr<TransformerOps> ops = cuda::NewCudaOps(stream, error);
  if (ops == nullptr) {
    Ok(*error, "NewCudaOps");
    return true;
  }
  for (int64_t s : {int64_t{8192}, int64_t{4096}}) {
    const size_t elems = static_cast<size_t>(s * s);
    DeviceBuffer a(elems * 2), b(elems * 2), c(elems * 4), tmp(elems * 4);
    if (!a.ok() || !b.ok() || !c.ok() || !tmp.ok()) return false;
    if (!FillRandom(tmp.as<float>(), s * s, 1.0f, false, 7)) return false;
    k->FloatToBf16(tmp.as<float>(), a.as<uint16_t>(), s * s);
    // The fills go through the legacy stream: wait before tmp is overwritten.
    if (!Ok(k->Synchronize(), "gemm inputs")) return false;
    if (!FillRandom(tmp.as<float>(), s * s, 1.0f, false, 8)) return false;
    k->FloatToBf16(tmp.as<float>(), b.as<uint16_t>(), s * s);
    if (!Ok(k->Synchronize(), "gemm inputs")) return false;
    const Timing t = Time(
        stream,
        [&] {
          ops->GemmBf16(Trans::kNo, Trans::kNo, s, s, s, 1.0f, a.as<uint16_t>(), s,
                        b.as<uint16_t>(), s, 0.0f, c.as<float>(), s);
        },
        "gemm");
    if (!Ok(ops->Synchronize(), "GemmBf16") || !t.ok) continue;
    const double tflops = 2.0 * s * s * s / (t.best_ms * 1e-3) / 1e12;
    std::printf("INFO gemm bf16 %lld^3: best %.3f ms, median %.3f ms\n",
                static_cast<long long>(s), t.best_ms, t.median_ms);
    Figure(s == 8192 ? "gpu_gemm_bf16_tflops" : "gpu_gemm_bf16_4096_tflops", tflops, "TFLOP/s");
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = int64_t{256} << 20;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--elements") == 0 && i + 1 < argc) {
      n = std::max<int64_t>(1024, std::atoll(argv[++i]));
    } else {
      std::printf("usage: gpu_bench [--elements N]\n");
      return 2;
    }
  }
  std::string why;
  if (!cuda::DeviceAvailable(&why)) {
    std::printf("SKIP: %s\n", why.c_str());
    return 0;
  }
  std::printf("INFO device: %s\n", dmem::DeviceDescription().c_str());
  void* stream = nullptr;
  if (!Ok(dmem::CreateStream(&stream), "CreateStream")) return 1;
  std::string error;
  std::unique_ptr<OptimizerKernel> k = cuda::NewCudaOptimizerKernel(stream, &error);
  if (k == nullptr) {
    Ok(error, "NewCudaOptimizerKernel");
    return 1;
  }
  const size_t f32 = static_cast<size_t>(n) * sizeof(float);
  std::printf("INFO %lld elements per array (%.2f GiB fp32)\n", static_cast<long long>(n),
              f32 / 1073741824.0);
  if (!MeasureOptimizer(k.get(), stream, n)) return 1;
  if (!MeasureSelection(k.get(), stream)) return 1;
  if (!MeasureGemm(k.get(), stream, &error)) return 1;
  k.reset();
  dmem::DestroyStream(stream);
  std::printf("%s gpu_bench: %d device error(s)\n", g_errors == 0 ? "DONE" : "FAIL", g_errors);
  return g_errors == 0 ? 0 : 1;
}
