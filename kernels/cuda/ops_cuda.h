// CUDA backend of the transformer ops (kernels/ops.h): cuBLAS GEMMs and CUDA kernels, among them
// a tiled flash-attention-style attention that never materialises the [tq, tk] score matrix.
// Plain C++ interface (no CUDA types), so callers compile with any host compiler.
//
// Every op enqueues on the backend's stream and returns at once; a launch or cuBLAS error is
// recorded (the first one is kept) and returned by Synchronize(), which also waits for the
// stream. The kernels are deterministic (run to run, on one device): none uses floating-point
// atomics; the embedding and RMSNorm weight gradients use ordered reductions (the embedding's in
// token order, as a sequential loop), attention backward uses separate dk/dv and dq kernels.
// GEMMs are cuBLAS's (reproducible on one GPU model and toolkit version). Temporary workspace
// comes from the stream-ordered allocator (cudaMallocAsync) and is released on the stream.
//
// Thread safety: an instance may be shared by host threads (its error slot is locked and the
// cuBLAS handle is configured once, at creation), but all work goes to its one stream, so
// callers that want concurrency create one instance per stream.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "kernels/cuda/cuda_util.h"  // DeviceAvailable, the device-memory helpers
#include "kernels/ops.h"

namespace stallfree {
namespace kernels {
namespace cuda {

// The CUDA backend on `stream` (a cudaStream_t; nullptr = the legacy default stream), on the
// device current at the call. Returns null and sets *error if the cuBLAS handle cannot be created
// (no device, no driver). AttentionForward / AttentionBackward support head_dim <= 128; a larger
// head_dim records an error (returned by Synchronize()) and launches nothing.
std::unique_ptr<TransformerOps> NewCudaOps(void* stream, std::string* error);

}  // namespace cuda
}  // namespace kernels
}  // namespace stallfree
