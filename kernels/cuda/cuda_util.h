// The CUDA runtime helpers of the whole tree, in one place: the error text of a CUDA call, the
// device check, and small device-memory, stream and timing helpers for tests and benchmarks.
// Plain C++ interface (no CUDA types), so callers compile with any host compiler; the CUDA
// backends (ops_cuda.cu, optimizer_cuda.cu) use the same functions.
//
//   std::string why;
//   if (!cuda::DeviceAvailable(&why)) { printf("SKIP: %s\n", why.c_str()); return 0; }
//   void* p = nullptr;
//   if (std::string e = cuda::dmem::Alloc(bytes, &p); !e.empty()) return Fail(e);
//   cuda::dmem::ToDevice(p, host, bytes);  ...  cuda::dmem::Free(p);
//
// Every function that can fail returns "" on success or a message naming the CUDA call and its
// error. Thread safety: as the CUDA runtime's (any thread; the device current on that thread).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace stallfree {
namespace kernels {
namespace cuda {

// "<what> failed: <the runtime's error string>" for cuda_error, a cudaError_t.
std::string CudaErr(const char* what, int cuda_error);

// True if a CUDA device can be used; otherwise *why says why (no driver, no device).
bool DeviceAvailable(std::string* why);

namespace dmem {
// Synchronous: they do not wait for work enqueued on other streams (call the kernel's or the
// ops' Synchronize() before reading their results), and the copies return once complete.
std::string Alloc(size_t bytes, void** ptr);  // bytes == 0 gives nullptr.
void Free(void* ptr);                         // nullptr is a no-op.
std::string ToDevice(void* dst, const void* src, size_t bytes);
std::string ToHost(void* dst, const void* src, size_t bytes);

// Enqueued on `stream`: a device-to-device copy.
std::string CopyOnStream(void* dst, const void* src, size_t bytes, void* stream);

// A stream that does not synchronize with the legacy default stream (a cudaStream_t).
std::string CreateStream(void** stream);
void DestroyStream(void* stream);

// Times `enqueue` (which enqueues work on `stream`) with CUDA events: `warmup` untimed calls,
// then `reps` calls, each between its own pair of events; *ms gets each call's milliseconds.
std::string TimeOnStream(void* stream, const std::function<void()>& enqueue, int warmup, int reps,
                         std::vector<float>* ms);

// "<name>, <SMs> SMs, <GiB> GiB, CC <major>.<minor>" of the current device.
std::string DeviceDescription();
}  // namespace dmem

}  // namespace cuda
}  // namespace kernels
}  // namespace stallfree
