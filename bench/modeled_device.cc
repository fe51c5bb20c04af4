#include "bench/modeled_device.h"

#include <errno.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

namespace stallfree {
namespace bench {
namespace {

using kernels::GradType;

const kernels::TransformerOps& Cpu() { return kernels::CpuOps(); }
const kernels::OptimizerKernel& CpuK() { return kernels::DefaultCpuKernel(); }

double Sz(GradType t) { return static_cast<double>(kernels::GradTypeSize(t)); }

}  // namespace

ModeledDevice::ModeledDevice(const ModeledDeviceSpec& spec) : spec_(spec) {
  void* p = mmap(nullptr, spec_.reserve_bytes, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    fprintf(stderr, "ModeledDevice: mmap(PROT_NONE, %llu bytes) failed: %s (errno %d)\n",
            static_cast<unsigned long long>(spec_.reserve_bytes), strerror(errno), errno);
    abort();
  }
  base_ = reinterpret_cast<uintptr_t>(p);
  link_free_[0] = link_free_[1] = Clock::now();
}

ModeledDevice::~ModeledDevice() {
  munmap(reinterpret_cast<void*>(base_), spec_.reserve_bytes);
}

void ModeledDevice::Enqueue(double seconds, Link link) const {
  const auto dur = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(seconds + spec_.launch_seconds));
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = Clock::now();
  auto it = ready_.find(std::this_thread::get_id());
  if (it == ready_.end()) it = ready_.emplace(std::this_thread::get_id(), now).first;
  auto start = std::max(now, it->second);
  if (link != Link::kNone) {
    auto& free_at = link_free_[link == Link::kH2D ? 0 : 1];
    start = std::max(start, free_at);
    free_at = start + dur;
  }
  it->second = start + dur;
  stats_.ops++;
}

void ModeledDevice::EnqueueCompute(double seconds) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.flop_seconds += seconds;
  }
  Enqueue(seconds, Link::kNone);
}

void ModeledDevice::Hbm(double bytes) const {
  const double s = bytes / spec_.hbm_bytes_per_s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.hbm_seconds += s;
  }
  Enqueue(s, Link::kNone);
}

void ModeledDevice::Flops(double flops) const {
  const double s = flops / spec_.flops;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.flop_seconds += s;
  }
  Enqueue(s, Link::kNone);
}

bool ModeledDevice::AnyVirtual(std::initializer_list<const void*> ps) const {
  for (const void* p : ps)
    if (IsVirtual(p)) return true;
  return false;
}

std::string ModeledDevice::Synchronize() const {
  Clock::time_point until;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ready_.find(std::this_thread::get_id());
    if (it == ready_.end()) return "";
    until = it->second;
  }
  std::this_thread::sleep_until(until);
  return "";
}

ModeledDeviceStats ModeledDevice::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void ModeledDevice::ResetStats() {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t live = stats_.virtual_live_bytes;
  stats_ = ModeledDeviceStats();
  stats_.virtual_live_bytes = stats_.virtual_peak_bytes = live;
}

// ---- Memory ----

float* ModeledDevice::AllocFloats(int64_t n) const {
  if (n <= 0) return nullptr;
  const uint64_t bytes = static_cast<uint64_t>(n) * 4;
  if (bytes < static_cast<uint64_t>(spec_.virtual_threshold_bytes)) return Cpu().AllocFloats(n);
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t size = (bytes + 4095) & ~uint64_t{4095};
  if (next_ + size > spec_.reserve_bytes) {
    fprintf(stderr, "ModeledDevice: the %llu-byte virtual reservation is exhausted\n",
            static_cast<unsigned long long>(spec_.reserve_bytes));
    abort();
  }
  const uintptr_t p = base_ + next_;
  next_ += size;
  live_[p] = size;
  stats_.virtual_live_bytes += size;
  stats_.virtual_peak_bytes = std::max(stats_.virtual_peak_bytes, stats_.virtual_live_bytes);
  return reinterpret_cast<float*>(p);
}

void ModeledDevice::Free(void* p) const {
  if (p == nullptr) return;
  if (!IsVirtual(p)) return Cpu().Free(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(reinterpret_cast<uintptr_t>(p));
  if (it == live_.end()) return;
  stats_.virtual_live_bytes -= it->second;
  live_.erase(it);
}

void ModeledDevice::CopyFloats(float* dst, const float* src, int64_t n) const {
  if (!AnyVirtual({dst, src})) Cpu().CopyFloats(dst, src, n);
  Hbm(8.0 * n);
}

void ModeledDevice::Fill(float* dst, int64_t n, float value) const {
  if (!IsVirtual(dst)) Cpu().Fill(dst, n, value);
  Hbm(4.0 * n);
}

void ModeledDevice::Upload(float* dst, const float* src_host, int64_t n) const {
  if (!IsVirtual(dst)) memcpy(dst, src_host, static_cast<size_t>(n) * 4);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_h2d += static_cast<uint64_t>(n) * 4;
  }
  Enqueue(4.0 * n / spec_.pcie_bytes_per_s, Link::kH2D);
}

void ModeledDevice::Download(float* dst_host, const float* src, int64_t n) const {
  if (!IsVirtual(src)) memcpy(dst_host, src, static_cast<size_t>(n) * 4);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_d2h += static_cast<uint64_t>(n) * 4;
  }
  Enqueue(4.0 * n / spec_.pcie_bytes_per_s, Link::kD2H);
}

void ModeledDevice::Copy2D(float* dst, int64_t dst_ld, const float* src, int64_t src_ld,
                           int64_t rows, int64_t cols) const {
  if (!AnyVirtual({dst, src})) Cpu().Copy2D(dst, dst_ld, src, src_ld, rows, cols);
  Hbm(8.0 * rows * cols);
}

// ---- Transformer ops (not used by the engine; modeled for completeness) ----

void ModeledDevice::Gemm(kernels::Trans ta, kernels::Trans tb, int64_t m, int64_t n, int64_t k,
                         float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                         float beta, float* c, int64_t ldc) const {
  if (!AnyVirtual({a, b, c})) Cpu().Gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  Flops(2.0 * m * n * k);
}

void ModeledDevice::GemmBf16(kernels::Trans ta, kernels::Trans tb, int64_t m, int64_t n,
                             int64_t k, float alpha, const uint16_t* a, int64_t lda,
                             const uint16_t* b, int64_t ldb, float beta, float* c,
                             int64_t ldc) const {
  if (!AnyVirtual({a, b, c}))
    Cpu().GemmBf16(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  Flops(2.0 * m * n * k);
}

void ModeledDevice::EmbeddingForward(const float* table, int64_t dim, const int32_t* ids,
                                     int64_t n, float* out) const {
  if (!AnyVirtual({table, ids, out})) Cpu().EmbeddingForward(table, dim, ids, n, out);
  Hbm(8.0 * n * dim);
}

void ModeledDevice::EmbeddingBackward(const float* dout, int64_t dim, const int32_t* ids,
                                      int64_t n, float* dtable) const {
  if (!AnyVirtual({dout, ids, dtable})) Cpu().EmbeddingBackward(dout, dim, ids, n, dtable);
  Hbm(12.0 * n * dim);
}

void ModeledDevice::RmsNormForward(const float* x, const float* w, int64_t rows, int64_t dim,
                                   float eps, float* y, float* rstd) const {
  if (!AnyVirtual({x, w, y, rstd})) Cpu().RmsNormForward(x, w, rows, dim, eps, y, rstd);
  Hbm(8.0 * rows * dim);
}

void ModeledDevice::RmsNormBackward(const float* x, const float* w, const float* rstd,
                                    const float* dy, int64_t rows, int64_t dim, float* dx,
                                    float* dw) const {
  if (!AnyVirtual({x, w, rstd, dy, dx, dw}))
    Cpu().RmsNormBackward(x, w, rstd, dy, rows, dim, dx, dw);
  Hbm(12.0 * rows * dim);
}

void ModeledDevice::SwiGluForward(const float* gate, const float* up, int64_t n,
                                  float* out) const {
  if (!AnyVirtual({gate, up, out})) Cpu().SwiGluForward(gate, up, n, out);
  Hbm(12.0 * n);
}

void ModeledDevice::SwiGluBackward(const float* gate, const float* up, const float* dout,
                                   int64_t n, float* dgate, float* dup) const {
  if (!AnyVirtual({gate, up, dout, dgate, dup}))
    Cpu().SwiGluBackward(gate, up, dout, n, dgate, dup);
  Hbm(20.0 * n);
}

void ModeledDevice::AttentionForward(const kernels::AttentionShape& s, const float* q,
                                     const float* k, const float* v, const int32_t* q_pos,
                                     const int32_t* k_pos, float* out, float* lse) const {
  if (!AnyVirtual({q, k, v, q_pos, k_pos, out, lse}))
    Cpu().AttentionForward(s, q, k, v, q_pos, k_pos, out, lse);
  Flops(4.0 * s.batch * s.heads * s.tq * s.tk * s.head_dim / 2);  // causal: half the pairs
}

void ModeledDevice::AttentionBackward(const kernels::AttentionShape& s, const float* q,
                                      const float* k, const float* v, const int32_t* q_pos,
                                      const int32_t* k_pos, const float* out, const float* lse,
                                      const float* dout, float* dq, float* dk, float* dv) const {
  if (!AnyVirtual({q, k, v, q_pos, k_pos, out, lse, dout, dq, dk, dv}))
    Cpu().AttentionBackward(s, q, k, v, q_pos, k_pos, out, lse, dout, dq, dk, dv);
  Flops(10.0 * s.batch * s.heads * s.tq * s.tk * s.head_dim / 2);
}

void ModeledDevice::CrossEntropyForward(const float* logits, int64_t rows, int64_t vocab,
                                        const int32_t* targets, float* loss, float* lse) const {
  if (!AnyVirtual({logits, targets, loss, lse}))
    Cpu().CrossEntropyForward(logits, rows, vocab, targets, loss, lse);
  Hbm(4.0 * rows * vocab);
}

void ModeledDevice::CrossEntropyBackward(const float* logits, const float* lse,
                                         const int32_t* targets, int64_t rows, int64_t vocab,
                                         float dloss, float* dlogits) const {
  if (!AnyVirtual({logits, lse, targets, dlogits}))
    Cpu().CrossEntropyBackward(logits, lse, targets, rows, vocab, dloss, dlogits);
  Hbm(8.0 * rows * vocab);
}

void ModeledDevice::Add(const float* a, const float* b, int64_t n, float* out) const {
  if (!AnyVirtual({a, b, out})) Cpu().Add(a, b, n, out);
  Hbm(12.0 * n);
}

// ---- Optimizer kernels ----

void ModeledDevice::Accumulate(float* acc, const void* grad, GradType type, float scale,
                               int64_t n, kernels::AccumulateMode mode) const {
  if (!AnyVirtual({acc, grad})) CpuK().Accumulate(acc, grad, type, scale, n, mode);
  Hbm(n * (8.0 + Sz(type)));
}

void ModeledDevice::AdamW(const kernels::AdamWConfig& config, float* param, float* m, float* v,
                          const void* grad, GradType type, int64_t n, kernels::ParamOut out) const {
  if (!AnyVirtual({param, m, v, grad, out.bf16, out.fp32}))
    CpuK().AdamW(config, param, m, v, grad, type, n, out);
  Hbm(n * (24.0 + Sz(type) + (out.bf16 ? 2.0 : 0.0) + (out.fp32 ? 4.0 : 0.0)));
}

void ModeledDevice::AdamWColumns(const kernels::AdamWConfig& config, const float* step_size,
                                 const float* bc2_sqrt, float* param, float* m, float* v,
                                 const void* grad, GradType type, int64_t rows, int64_t cols,
                                 kernels::ParamOut out) const {
  if (!AnyVirtual({step_size, bc2_sqrt, param, m, v, grad, out.bf16, out.fp32}))
    CpuK().AdamWColumns(config, step_size, bc2_sqrt, param, m, v, grad, type, rows, cols,
                        out);
  Hbm(static_cast<double>(rows) * cols * (24.0 + Sz(type) + (out.bf16 ? 2.0 : 0.0) + (out.fp32 ? 4.0 : 0.0)));
}

void ModeledDevice::AccumulateAdamW(const kernels::AdamWConfig& config, float* param, float* m,
                                    float* v, const float* acc, const void* grad, GradType type,
                                    float acc_scale, int64_t n, kernels::ParamOut out) const {
  if (!AnyVirtual({param, m, v, acc, grad, out.bf16, out.fp32}))
    CpuK().AccumulateAdamW(config, param, m, v, acc, grad, type, acc_scale, n, out);
  Hbm(n * (28.0 + (grad ? Sz(type) : 0.0) + (out.bf16 ? 2.0 : 0.0) + (out.fp32 ? 4.0 : 0.0)));
}

void ModeledDevice::AccumulateAdamWColumns(const kernels::AdamWConfig& config,
                                           const float* step_size, const float* bc2_sqrt,
                                           float* param, float* m, float* v, const float* acc,
                                           const void* grad, GradType type, float acc_scale,
                                           int64_t rows, int64_t cols, kernels::ParamOut out) const {
  if (!AnyVirtual({step_size, bc2_sqrt, param, m, v, acc, grad, out.bf16, out.fp32}))
    CpuK().AccumulateAdamWColumns(config, step_size, bc2_sqrt, param, m, v, acc, grad, type,
                                  acc_scale, rows, cols, out);
  Hbm(static_cast<double>(rows) * cols *
      (24.0 + (acc ? 4.0 : 0.0) + Sz(type) + (out.bf16 ? 2.0 : 0.0) + (out.fp32 ? 4.0 : 0.0)));
}

void ModeledDevice::FloatToBf16(const float* src, uint16_t* dst, int64_t n) const {
  if (!AnyVirtual({src, dst})) CpuK().FloatToBf16(src, dst, n);
  Hbm(6.0 * n);
}

void ModeledDevice::Bf16ToFloat(const uint16_t* src, float* dst, int64_t n) const {
  if (!AnyVirtual({src, dst})) CpuK().Bf16ToFloat(src, dst, n);
  Hbm(6.0 * n);
}

void ModeledDevice::ColumnScores(const void* grad, GradType type, int64_t rows, int64_t cols,
                                 int64_t ld, float* l1, float* l2sq) const {
  (void)ld;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = scores_.find(grad);
    if (it == scores_.end() || static_cast<int64_t>(it->second.x.size()) != cols) {
      ScoreState st;
      st.rng.seed(static_cast<uint64_t>(spec_.seed) * 0x9E3779B97F4A7C15ull + ++weights_seen_);
      std::normal_distribution<double> normal(0.0, spec_.score_sigma);
      st.x.resize(static_cast<size_t>(cols));
      for (double& x : st.x) x = normal(st.rng);
      it = scores_.insert_or_assign(grad, std::move(st)).first;
    } else {
      ScoreState& st = it->second;
      std::normal_distribution<double> normal(0.0, spec_.score_sigma);
      const double rho = spec_.score_rho, keep = std::sqrt(1.0 - rho * rho);
      for (double& x : st.x) x = rho * x + keep * normal(st.rng);
    }
    const std::vector<double>& x = it->second.x;
    for (int64_t c = 0; c < cols; ++c) {
      const double ss = static_cast<double>(rows) * std::exp(x[c]) * 1e-6;
      if (l2sq != nullptr && !IsVirtual(l2sq)) l2sq[c] = static_cast<float>(ss);
      if (l1 != nullptr && !IsVirtual(l1)) l1[c] = static_cast<float>(std::sqrt(ss));
    }
  }
  Hbm(static_cast<double>(rows) * cols * Sz(type));
}

void ModeledDevice::TopK(const float* scores, int64_t n, int64_t k, int64_t* indices) const {
  if (!AnyVirtual({scores, indices})) CpuK().TopK(scores, n, k, indices);
  Hbm(4.0 * n + 8.0 * k);
}

void ModeledDevice::GatherColumns(const void* src, size_t elem_size, int64_t rows, int64_t ld,
                                  const int64_t* idx, int64_t k, void* dst) const {
  if (!AnyVirtual({src, idx, dst})) CpuK().GatherColumns(src, elem_size, rows, ld, idx, k, dst);
  Hbm(2.0 * static_cast<double>(rows) * k * elem_size);
}

void ModeledDevice::ScatterColumns(const void* src, size_t elem_size, int64_t rows, int64_t ld,
                                   const int64_t* idx, int64_t k, void* dst) const {
  if (!AnyVirtual({src, idx, dst}))
    CpuK().ScatterColumns(src, elem_size, rows, ld, idx, k, dst);
  Hbm(2.0 * static_cast<double>(rows) * k * elem_size);
}

void ModeledDevice::GatherColumnsAs(GradType src_type, const void* src, int64_t rows,
                                    int64_t ld, const int64_t* idx, int64_t k,
                                    GradType dst_type, void* dst) const {
  if (!AnyVirtual({src, idx, dst}))
    CpuK().GatherColumnsAs(src_type, src, rows, ld, idx, k, dst_type, dst);
  Hbm(static_cast<double>(rows) * k * (Sz(src_type) + Sz(dst_type)));
}

void ModeledDevice::ScatterColumnsAs(GradType src_type, const void* src, int64_t rows,
                                     int64_t ld, const int64_t* idx, int64_t k,
                                     GradType dst_type, void* dst) const {
  if (!AnyVirtual({src, idx, dst}))
    CpuK().ScatterColumnsAs(src_type, src, rows, ld, idx, k, dst_type, dst);
  Hbm(static_cast<double>(rows) * k * (Sz(src_type) + Sz(dst_type)));
}

void* ModeledDevice::HostView(void* host, std::string* error) const {
  (void)host;
  if (error) *error = "the modeled device does not model direct transfers";
  return nullptr;
}

}  // namespace bench
}  // namespace stallfree
