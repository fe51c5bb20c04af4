// CUDA backend of the optimizer and selection kernels (kernels/optimizer.h). Plain C++ interface
// (no CUDA types), so callers compile with any host compiler.
//
// The kernel object enqueues every call on its stream and returns at once; pointers given to its
// methods are device pointers (TopK's and the column kernels' index arrays too). A launch error or
// an invalid argument is recorded (the first one is kept) and returned by Synchronize(), which
// also waits for the stream; it reports each error once.
//
// Numerics: the element-wise kernels use explicitly rounded fp32 operations (no contraction into
// FMA) in the oracle's order, with IEEE sqrt and division, so AdamW, AdamWColumns, Accumulate,
// the fused boundary pass and the bf16 conversions are bit-identical to ReferenceKernel() (NaN
// payloads included). ColumnScores sums in its own (fixed, deterministic) order. TopK and the
// column moves are exact.
//
// Thread safety: methods may be called from several host threads; the error slot and the
// grow-only workspace (ColumnScores partial sums, TopK sort buffers) are locked. All work goes
// to the one stream, in the order the calls were made. The stream must outlive the kernel object,
// and the device current at creation must be current at each call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/cuda/cuda_util.h"  // DeviceAvailable, the device-memory helpers
#include "kernels/optimizer.h"

namespace stallfree {
namespace kernels {
namespace cuda {

// The CUDA backend on `stream` (a cudaStream_t; nullptr = the legacy default stream), on the
// device current at the call. Returns null and sets *error if no device can be used
// (DeviceAvailable, kernels/cuda/cuda_util.h).
std::unique_ptr<OptimizerKernel> NewCudaOptimizerKernel(void* stream, std::string* error);

// Benchmark support: enqueues on `stream` a streaming kernel over n fp32 elements that reads
// `num_in` arrays and writes `num_out` arrays (1..4 each) with 16-byte accesses and almost no
// arithmetic: the memory-bound ceiling of an element-wise kernel with that access pattern (AdamW
// with fp32 gradients reads 4 and writes 3). Returns "" or the launch error.
std::string LaunchStreamPattern(void* stream, const float* const* in, int num_in, float* const* out,
                                int num_out, int64_t n);

}  // namespace cuda
}  // namespace kernels
}  // namespace stallfree
