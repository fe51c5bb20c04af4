// ModeledDevice: a stand-in accelerator for benchmarks, so that the ZenFlow engine's own code
// path (engine/zenflow.h) runs for a model of hundreds of millions of parameters without that
// much device memory or CPU time. It is one object implementing both kernel interfaces the
// engine takes (kernels::TransformerOps and kernels::OptimizerKernel).
//
// Memory. An allocation of at least `virtual_threshold_bytes` is *virtual*: it comes from one
// large PROT_NONE, MAP_NORESERVE reservation, so it costs no RAM and any accidental access by the
// CPU faults at once instead of silently computing. Smaller allocations are real host memory
// (CpuOps()): the engine reads them (column indices, scores, per-column AdamW constants, 1-D
// parameters).
//
// Time. Every operation is *enqueued* on the calling thread's stream with a modeled duration and
// Synchronize() sleeps until that thread's stream has drained, as a CUDA stream per thread would
// (the engine synchronizes before it reads results). Durations:
// - element-wise work, gathers, scatters, scores and AdamW: bytes moved / hbm_bytes_per_s;
// - GEMMs and attention: FLOPs / flops;
// - Upload / Download: bytes / pcie_bytes_per_s, on one link per direction shared by all threads
//   (concurrent copies in one direction queue; the two directions are independent);
// - plus launch_seconds per operation.
// An operation that touches virtual memory only takes its modeled time: it computes nothing and
// writes nothing (in particular a Download from virtual memory leaves the host bytes as they
// were; the caller pre-fills them). An operation on real memory only computes for real (through
// DefaultCpuKernel() / CpuOps()) and takes its modeled time as well.
//
// Scores. ColumnScores never reads the gradient: it writes modeled per-column scores (sum of
// squares; l1 = its square root) into the real output buffer. Per weight (keyed by the gradient
// pointer) each column has a log-importance x_c ~ N(0, score_sigma); the score is
// rows * exp(x_c) * 1e-6. Each further call on the same gradient drifts the ranking by one AR(1)
// step x_c <- rho x_c + sqrt(1 - rho^2) sigma eps, so a few per cent of the top set change per
// selection (sigma = 2, rho = 0.998: the top 10% of columns hold ~78% of the mass and ~5% of the
// top 10% change per call). Deterministic for a given seed and call order.
//
// Transfers. Every host thread has a stream of its own, so the engine's copy thread overlaps its
// copies with compute as a CUDA copy stream does, without NewCopyStream. The engine's direct
// transfers (kernels reading and writing host memory through HostView) are not modeled: HostView
// refuses, and the engine should be configured with Transfers::kBuffered, CUDA's default.
//
// Thread safety: all methods are thread safe. The device must outlive every buffer allocated from
// it; virtual address space is never reused (Free of a virtual block only updates the counters).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/ops.h"
#include "kernels/optimizer.h"

namespace stallfree {
namespace bench {

struct ModeledDeviceSpec {
  double flops = 400e12;            // effective dense bf16 FLOP/s
  double hbm_bytes_per_s = 3.0e12;  // effective HBM bandwidth of element-wise kernels
  double pcie_bytes_per_s = 50e9;   // effective host<->device bandwidth, each direction
  double launch_seconds = 4e-6;     // per operation
  int64_t virtual_threshold_bytes = int64_t{64} << 10;
  uint64_t reserve_bytes = uint64_t{4} << 40;  // virtual address space
  double score_sigma = 2.0;
  double score_rho = 0.998;
  uint32_t seed = 1;
};

// Counters since construction (or ResetStats).
struct ModeledDeviceStats {
  uint64_t bytes_h2d = 0, bytes_d2h = 0;  // modeled PCIe bytes
  double hbm_seconds = 0;                 // modeled time of element-wise work
  double flop_seconds = 0;                // modeled time of GEMMs and attention
  int64_t ops = 0;
  uint64_t virtual_live_bytes = 0, virtual_peak_bytes = 0;
};

class ModeledDevice final : public kernels::TransformerOps, public kernels::OptimizerKernel {
 public:
  // Reserves the virtual address space; aborts with a message naming the size and errno if the
  // reservation fails (a benchmark cannot go on without it).
  explicit ModeledDevice(const ModeledDeviceSpec& spec);
  ~ModeledDevice() override;
  ModeledDevice(const ModeledDevice&) = delete;
  ModeledDevice& operator=(const ModeledDevice&) = delete;

  const ModeledDeviceSpec& spec() const { return spec_; }
  bool IsVirtual(const void* p) const {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    return a >= base_ && a < base_ + spec_.reserve_bytes;
  }
  // Enqueues `seconds` of modeled compute on the calling thread's stream (e.g. a forward and
  // backward pass); Synchronize() waits for it.
  void EnqueueCompute(double seconds) const;
  ModeledDeviceStats stats() const;
  void ResetStats();

  const char* name() const override { return "modeled"; }
  std::string Synchronize() const override;

  // ---- kernels::TransformerOps ----
  void Gemm(kernels::Trans ta, kernels::Trans tb, int64_t m, int64_t n, int64_t k, float alpha,
            const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
            int64_t ldc) const override;
  void GemmBf16(kernels::Trans ta, kernels::Trans tb, int64_t m, int64_t n, int64_t k,
                float alpha, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                float beta, float* c, int64_t ldc) const override;
  void EmbeddingForward(const float* table, int64_t dim, const int32_t* ids, int64_t n,
                        float* out) const override;
  void EmbeddingBackward(const float* dout, int64_t dim, const int32_t* ids, int64_t n,
                         float* dtable) const override;
  void RmsNormForward(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                      float* y, float* rstd) const override;
  void RmsNormBackward(const float* x, const float* w, const float* rstd, const float* dy,
                       int64_t rows, int64_t dim, float* dx, float* dw) const override;
  void SwiGluForward(const float* gate, const float* up, int64_t n, float* out) const override;
  void SwiGluBackward(const float* gate, const float* up, const float* dout, int64_t n,
                      float* dgate, float* dup) const override;
  void AttentionForward(const kernels::AttentionShape& s, const float* q, const float* k,
                        const float* v, const int32_t* q_pos, const int32_t* k_pos, float* out,
                        float* lse) const override;
  void AttentionBackward(const kernels::AttentionShape& s, const float* q, const float* k,
                         const float* v, const int32_t* q_pos, const int32_t* k_pos,
                         const float* out, const float* lse, const float* dout, float* dq,
                         float* dk, float* dv) const override;
  void CrossEntropyForward(const float* logits, int64_t rows, int64_t vocab,
                           const int32_t* targets, float* loss, float* lse) const override;
  void CrossEntropyBackward(const float* logits, const float* lse, const int32_t* targets,
                            int64_t rows, int64_t vocab, float dloss,
                            float* dlogits) const override;
  void Add(const float* a, const float* b, int64_t n, float* out) const override;
  float* AllocFloats(int64_t n) const override;
  void Free(void* p) const override;
  void CopyFloats(float* dst, const float* src, int64_t n) const override;
  void Fill(float* dst, int64_t n, float value) const override;
  void Upload(float* dst_backend, const float* src_host, int64_t n) const override;
  void Download(float* dst_host, const float* src_backend, int64_t n) const override;
  void Copy2D(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows,
              int64_t cols) const override;

  // ---- kernels::OptimizerKernel ----
  void Accumulate(float* acc, const void* grad, kernels::GradType type, float scale, int64_t n,
                  kernels::AccumulateMode mode) const override;
  void AdamW(const kernels::AdamWConfig& config, float* param, float* m, float* v,
             const void* grad, kernels::GradType type, int64_t n,
             kernels::ParamOut out) const override;
  void AdamWColumns(const kernels::AdamWConfig& config, const float* step_size,
                    const float* bc2_sqrt, float* param, float* m, float* v, const void* grad,
                    kernels::GradType type, int64_t rows, int64_t cols,
                    kernels::ParamOut out) const override;
  void AccumulateAdamW(const kernels::AdamWConfig& config, float* param, float* m, float* v,
                       const float* acc, const void* grad, kernels::GradType type,
                       float acc_scale, int64_t n, kernels::ParamOut out) const override;
  void AccumulateAdamWColumns(const kernels::AdamWConfig& config, const float* step_size,
                              const float* bc2_sqrt, float* param, float* m, float* v,
                              const float* acc, const void* grad, kernels::GradType type,
                              float acc_scale, int64_t rows, int64_t cols,
                              kernels::ParamOut out) const override;
  void FloatToBf16(const float* src, uint16_t* dst, int64_t n) const override;
  void Bf16ToFloat(const uint16_t* src, float* dst, int64_t n) const override;
  void ColumnScores(const void* grad, kernels::GradType type, int64_t rows, int64_t cols,
                    int64_t ld, float* l1, float* l2sq) const override;
  void TopK(const float* scores, int64_t n, int64_t k, int64_t* indices) const override;
  void GatherColumns(const void* src, size_t elem_size, int64_t rows, int64_t ld,
                     const int64_t* idx, int64_t k, void* dst) const override;
  void ScatterColumns(const void* src, size_t elem_size, int64_t rows, int64_t ld,
                      const int64_t* idx, int64_t k, void* dst) const override;
  void GatherColumnsAs(kernels::GradType src_type, const void* src, int64_t rows, int64_t ld,
                       const int64_t* idx, int64_t k, kernels::GradType dst_type,
                       void* dst) const override;
  void ScatterColumnsAs(kernels::GradType src_type, const void* src, int64_t rows, int64_t ld,
                        const int64_t* idx, int64_t k, kernels::GradType dst_type,
                        void* dst) const override;
  // Null: kernels here do not address host memory (the engine's direct transfers would take the
  // modeled HBM time instead of the link's). Run the engine with buffered transfers, as on CUDA.
  void* HostView(void* host, std::string* error) const override;

 private:
  using Clock = std::chrono::steady_clock;
  enum class Link { kNone, kH2D, kD2H };
  // Advances the calling thread's stream by `seconds` (+ launch), on `link` if one is given.
  void Enqueue(double seconds, Link link) const;
  void Hbm(double bytes) const;
  void Flops(double flops) const;
  bool AnyVirtual(std::initializer_list<const void*> ps) const;

  ModeledDeviceSpec spec_;
  uintptr_t base_ = 0;
  mutable std::mutex mu_;
  mutable uint64_t next_ = 0;  // bump offset into the reservation
  mutable std::map<uintptr_t, uint64_t> live_;  // virtual blocks: address -> bytes
  mutable std::map<std::thread::id, Clock::time_point> ready_;  // per-thread stream
  mutable Clock::time_point link_free_[2];
  mutable ModeledDeviceStats stats_;
  struct ScoreState {
    std::vector<double> x;
    std::mt19937_64 rng;
  };
  mutable std::map<const void*, ScoreState> scores_;
  mutable uint64_t weights_seen_ = 0;
};

}  // namespace bench
}  // namespace stallfree
