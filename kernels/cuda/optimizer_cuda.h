// CUDA backend of the optimizer kernels. Plain C++ interface (no CUDA types), so callers
// compile with any host compiler. Functions return an empty string on success, or a message
// naming the CUDA call and its error.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/optimizer.h"

namespace stallfree {
namespace kernels {
namespace cuda {

// True if a CUDA device can be used; otherwise *why says why (no driver, no device).
bool DeviceAvailable(std::string* why);

// AdamW on device memory, asynchronously on `stream` (a cudaStream_t; nullptr = default).
std::string LaunchAdamW(const AdamWConfig& config, float* param, float* m, float* v,
                        const void* grad, GradType type, int64_t n, uint16_t* bf16_out,
                        void* stream);

// Test helper: copies host arrays to the device, runs LaunchAdamW, copies them back.
std::string AdamWHost(const AdamWConfig& config, float* param, float* m, float* v,
                      const float* grad, int64_t n, uint16_t* bf16_out);

}  // namespace cuda
}  // namespace kernels
}  // namespace stallfree
