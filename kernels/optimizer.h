// The optimizer and selection kernel interface: the math the daemon and the ZenFlow engine run,
// device-neutral.
//
// Every backend implements OptimizerKernel over flat arrays in the backend's memory (host memory
// for the CPU backends, device memory for CUDA). CPU backends run each call to completion,
// parallel over the calling oneTBB arena; the CUDA backend enqueues on its stream and
// Synchronize() reports the first error. ReferenceKernel() is the plain scalar oracle every
// faster backend is tested against.
//
// AdamW (decoupled weight decay, as torch.optim.AdamW), for step t >= 1 and g = scale * grad:
//   p <- p * (1 - lr * wd)
//   m <- b1 * m + (1 - b1) * g
//   v <- b2 * v + (1 - b2) * g^2
//   p <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// The bias corrections are computed in double from the int64 step, so they never saturate; the
// per-element arithmetic is fp32 with IEEE sqrt and division, so every backend agrees with the
// oracle to rounding (the tests state their tolerance).
//
// Columns: a 2-D weight W[rows=out, cols=in] is row-major; column c is the input channel c, the
// elements W[r, c] for every r. The selection kernels score columns, pick the top k, and move
// selected / unselected columns between W and contiguous row-major buffers [rows, k].
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace stallfree {
namespace kernels {

enum class GradType { kFp32, kBf16 };

inline size_t GradTypeSize(GradType t) { return t == GradType::kBf16 ? 2 : 4; }

struct AdamWConfig {
  // Hyper-parameters in double, as users write them (0.9, 0.999): the kernels derive the fp32
  // constants (beta, 1 - beta, lr * wd) from the double values, as PyTorch does.
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;        // t, >= 1.
  float grad_scale = 1.0f;  // multiplies the gradient (e.g. 1/accumulation count, unscaling).
  // The output (`out` of the kernels that take one) is the value predicted one step ahead,
  // 2 p_new - p_old (2 p_new exact, the difference rounded once in fp32; then rounded to bf16
  // for a bf16 output), instead of p_new; p itself is AdamW's as always. The daemon's ZenFlow update with predict_cold
  // (engine/zenflow.h). The CPU kernels only (the daemon's).
  bool predict_out = false;
};

// The fp32 constants of one AdamW step, derived once per call from an AdamWConfig in double.
struct AdamWConstants {
  float b1, omb1, b2, omb2, eps, decay, step_size, bc2_sqrt, grad_scale;
  bool predict_out = false;
};
AdamWConstants MakeAdamWConstants(const AdamWConfig& config);

// step_size[c], bc2_sqrt[c] for steps[c] >= 1 (c < cols), bit-identical to the fields of
// MakeAdamWConstants(config with step = steps[c]). Host memory (a device backend's caller copies
// them over). For OptimizerKernel::AdamWColumns; config.step is ignored.
void MakeColumnConstants(const AdamWConfig& config, const int64_t* steps, int64_t cols,
                         float* step_size, float* bc2_sqrt);

// Where an AdamW pass also writes the new parameter values (the daemon's parameter slot, the
// device's bf16 parameter): as bf16 (round to nearest even), or as fp32, in the same pass as the
// update (streaming stores on the CPU: the slot is not read back by the pass); both null:
// nowhere. Laid out like the parameter. A bf16 pointer converts to one, so callers that write
// bf16 pass it as before.
struct ParamOut {
  uint16_t* bf16 = nullptr;
  float* fp32 = nullptr;
  ParamOut() = default;
  ParamOut(std::nullptr_t) {}                 // NOLINT: nowhere, as a null bf16 pointer was
  ParamOut(uint16_t* bf16_out) : bf16(bf16_out) {}  // NOLINT: implicit, the bf16 output
  static ParamOut Fp32(float* out) {
    ParamOut o;
    o.fp32 = out;
    return o;
  }
  bool empty() const { return bf16 == nullptr && fp32 == nullptr; }
  // The output of the elements from `offset` on.
  ParamOut At(int64_t offset) const {
    ParamOut o;
    o.bf16 = bf16 == nullptr ? nullptr : bf16 + offset;
    o.fp32 = fp32 == nullptr ? nullptr : fp32 + offset;
    return o;
  }
};

enum class AccumulateMode {
  kAdd,        // acc[i] += scale * grad[i]
  kOverwrite,  // acc[i]  = scale * grad[i] (the first push of a round: no clearing pass)
};

class OptimizerKernel {
 public:
  virtual ~OptimizerKernel() = default;
  virtual const char* name() const = 0;
  // Whether the AdamW kernels keep the calling thread's undo log (kernels/undo_log.h): the CPU
  // backends do; the oracle and the CUDA backend do not.
  virtual bool KeepsUndoLog() const { return false; }

  // acc[i] (+)= scale * grad[i] for i < n; grad is fp32 or bf16 per `type`.
  virtual void Accumulate(float* acc, const void* grad, GradType type, float scale, int64_t n,
                          AccumulateMode mode = AccumulateMode::kAdd) const = 0;

  // One AdamW step over n elements. grad is fp32 or bf16 per `type`. The new parameters are
  // also written to `out` (ParamOut: bf16, fp32, or nowhere).
  virtual void AdamW(const AdamWConfig& config, float* param, float* m, float* v,
                     const void* grad, GradType type, int64_t n, ParamOut out) const = 0;

  // AdamW over a row-major block [rows, cols] (row stride cols) in which column c has its own
  // step: the bias-correction constants come from step_size[c] and bc2_sqrt[c] (per-column
  // copies of AdamWConstants::step_size and ::bc2_sqrt; MakeColumnConstants builds them), the
  // rest from config (config.step is ignored). step_size and bc2_sqrt are in the backend's
  // memory. Bit-identical to AdamW on each column with config.step = that column's step.
  //
  // ZenFlow needs this because columns move between the GPU and the CPU daemon with their step
  // counts, so the columns of one weight are at different steps. grad and out are laid out
  // like param ([rows, cols], fp32 or bf16 per `type`); out may be empty. rows, cols >= 0.
  virtual void AdamWColumns(const AdamWConfig& config, const float* step_size,
                            const float* bc2_sqrt, float* param, float* m, float* v,
                            const void* grad, GradType type, int64_t rows, int64_t cols,
                            ParamOut out) const = 0;

  // AdamWColumns fused with the accumulation of one more gradient (the ZenFlow round's last push
  // folded into its Update): for every element i of the row-major [rows, cols] block,
  //   sum[i] = acc[i] + acc_scale * grad[i]   (acc_scale * grad[i] when acc is null)
  // and then AdamWColumns's step with the gradient sum[i] (config.grad_scale multiplies it).
  // Bit-identical to Accumulate(acc, grad, type, acc_scale, rows * cols, kAdd) (kOverwrite when
  // acc is null) followed by AdamWColumns on the fp32 acc, except that acc is only read (null:
  // the accumulator is logically zero, nothing pushed since the last Update). grad (fp32 or bf16
  // per `type`) must not be null; acc, grad and out are laid out like param. All arrays are
  // in the backend's memory; step_size, bc2_sqrt as for AdamWColumns. rows, cols >= 0.
  //
  // The default does exactly those two calls through a host-memory scratch copy of acc, so it
  // is only right for backends whose memory is host memory; the CPU backends and the oracle
  // override it with one fused pass, the CUDA backend with the two kernels on a device scratch.
  virtual void AccumulateAdamWColumns(const AdamWConfig& config, const float* step_size,
                                      const float* bc2_sqrt, float* param, float* m, float* v,
                                      const float* acc, const void* grad, GradType type,
                                      float acc_scale, int64_t rows, int64_t cols,
                                      ParamOut out) const;

  // The fused ZenFlow boundary pass: g = acc[i] + acc_scale * grad[i] (the round's last deferred
  // gradient, fp32 or bf16), then the AdamW step of `config` with that g (config.grad_scale
  // multiplies the sum), writing the new values to `out`. acc is read, not written:
  // the next round's first push overwrites it (AccumulateMode::kOverwrite). grad may be null
  // (g = acc[i]).
  virtual void AccumulateAdamW(const AdamWConfig& config, float* param, float* m, float* v,
                               const float* acc, const void* grad, GradType type,
                               float acc_scale, int64_t n, ParamOut out) const = 0;

  // dst[i] = bf16(src[i]) (round to nearest even, NaN stays NaN) and back.
  virtual void FloatToBf16(const float* src, uint16_t* dst, int64_t n) const = 0;
  virtual void Bf16ToFloat(const uint16_t* src, float* dst, int64_t n) const = 0;

  // Per-column scores of a gradient G[rows, cols] (fp32 or bf16), row-major with row stride
  // `ld` elements (ld >= cols): l1[c] = sum_r |G[r,c]|, l2sq[c] = sum_r G[r,c]^2. Either output
  // may be null. Sums are in fp32 in an order the backend chooses; the tests allow for that.
  virtual void ColumnScores(const void* grad, GradType type, int64_t rows, int64_t cols,
                            int64_t ld, float* l1, float* l2sq) const = 0;

  // The k largest of scores[0..n) by value (NaN counts as smallest; ties go to the lower index),
  // written to indices[0..k) in increasing index order. 0 <= k <= n.
  virtual void TopK(const float* scores, int64_t n, int64_t k, int64_t* indices) const = 0;

  // dst[r, j] = src[r, idx[j]] for r < rows, j < k: dst is row-major [rows, k], src [rows, ld].
  // Elements are elem_size bytes (2 or 4). idx entries are in [0, ld).
  virtual void GatherColumns(const void* src, size_t elem_size, int64_t rows, int64_t ld,
                             const int64_t* idx, int64_t k, void* dst) const = 0;
  // The inverse: dst[r, idx[j]] = src[r, j]; other columns of dst are untouched.
  virtual void ScatterColumns(const void* src, size_t elem_size, int64_t rows, int64_t ld,
                              const int64_t* idx, int64_t k, void* dst) const = 0;

  // The same moves with the element type converted on the way, for any pair of fp32 and bf16
  // (GradType names the element type here): bf16 -> fp32 widens exactly, fp32 -> bf16 rounds to
  // nearest even (NaN kept quiet, as FloatToBf16), equal types copy the bits. Gather:
  //   dst[r, j] = convert(src[r, idx[j]])      (src [rows, ld] of src_type, dst [rows, k]),
  // bit-identical to GatherColumns followed by the conversion; scatter:
  //   dst[r, idx[j]] = convert(src[r, j])      (src [rows, k], dst [rows, ld] of dst_type; other
  //                                             columns untouched),
  // bit-identical to the conversion followed by ScatterColumns. For bf16 parameters with fp32
  // masters and for the ZenFlow engine's moves straight between a weight and the daemon's slots.
  // Backend memory, as GatherColumns, or host memory the backend addresses through
  // TransformerOps::HostView. The defaults are plain loops over host memory (like
  // AccumulateAdamWColumns's default, right only for host-memory backends); the CPU backends and
  // CUDA override them.
  virtual void GatherColumnsAs(GradType src_type, const void* src, int64_t rows, int64_t ld,
                               const int64_t* idx, int64_t k, GradType dst_type,
                               void* dst) const;
  virtual void ScatterColumnsAs(GradType src_type, const void* src, int64_t rows, int64_t ld,
                                const int64_t* idx, int64_t k, GradType dst_type,
                                void* dst) const;
  // The two moves of a bf16 parameter's fp32 masters.
  void GatherColumnsToFloat(const uint16_t* src, int64_t rows, int64_t ld, const int64_t* idx,
                            int64_t k, float* dst) const {
    GatherColumnsAs(GradType::kBf16, src, rows, ld, idx, k, GradType::kFp32, dst);
  }
  void ScatterColumnsToBf16(const float* src, int64_t rows, int64_t ld, const int64_t* idx,
                            int64_t k, uint16_t* dst) const {
    ScatterColumnsAs(GradType::kFp32, src, rows, ld, idx, k, GradType::kBf16, dst);
  }

  // Waits for the work issued so far; returns "" or the first error (CPU backends: always "").
  virtual std::string Synchronize() const { return ""; }
};

// The columns of [0, n) that are not in sorted `selected[0..k)`, in increasing order, to
// out[0..n-k). Host helper shared by all backends.
void ComplementIndices(const int64_t* selected, int64_t k, int64_t n, int64_t* out);

// The scalar oracle.
const OptimizerKernel& ReferenceKernel();

// CPU backends by instruction set. Each returns null if this CPU (or this build) lacks it.
const OptimizerKernel* Avx512Kernel();
const OptimizerKernel* Avx2Kernel();
// The portable path (no intrinsics, parallel like the others): runs on any x86-64.
const OptimizerKernel& PortableKernel();
// The fastest CPU backend this machine supports (AVX-512, else AVX2, else the portable path);
// chosen once from cpuid. STALLFREE_CPU_KERNEL=avx512|avx2|scalar|
// reference forces one (for tests and benchmarks).
const OptimizerKernel& DefaultCpuKernel();

}  // namespace kernels
}  // namespace stallfree
