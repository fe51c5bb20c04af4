// The CUDA helpers of kernels/cuda/cuda_util.h.
#include "kernels/cuda/cuda_util.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace stallfree {
namespace kernels {
namespace cuda {

std::string CudaErr(const char* what, int cuda_error) {
  return std::string(what) + " failed: " + cudaGetErrorString(static_cast<cudaError_t>(cuda_error));
}

bool DeviceAvailable(std::string* why) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    *why = CudaErr("cudaGetDeviceCount", e);
    return false;
  }
  if (count == 0) {
    *why = "no CUDA device present";
    return false;
  }
  return true;
}

namespace dmem {

std::string Alloc(size_t bytes, void** ptr) {
  *ptr = nullptr;
  if (bytes == 0) return "";
  const cudaError_t e = cudaMalloc(ptr, bytes);
  if (e != cudaSuccess) {
    *ptr = nullptr;
    return CudaErr("cudaMalloc", e);
  }
  return "";
}

void Free(void* ptr) {
  if (ptr != nullptr) cudaFree(ptr);
}

namespace {
// cudaMemcpy from pageable host memory may return before the DMA has landed; the explicit
// stream synchronize makes "returned" mean "complete" for the device-side reader too.
std::string CopyAndWait(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                        const std::string& direction) {
  if (bytes == 0) return "";
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, 0);
  if (e != cudaSuccess) return CudaErr(("cudaMemcpyAsync (" + direction + ")").c_str(), e);
  e = cudaStreamSynchronize(0);
  return e == cudaSuccess ? "" : CudaErr(("cudaStreamSynchronize (" + direction + ")").c_str(), e);
}
}  // namespace

std::string ToDevice(void* dst, const void* src, size_t bytes) {
  return CopyAndWait(dst, src, bytes, cudaMemcpyHostToDevice, "to device");
}

std::string ToHost(void* dst, const void* src, size_t bytes) {
  return CopyAndWait(dst, src, bytes, cudaMemcpyDeviceToHost, "to host");
}

std::string CopyOnStream(void* dst, const void* src, size_t bytes, void* stream) {
  const cudaError_t e =
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
  return e == cudaSuccess ? "" : CudaErr("cudaMemcpyAsync (device to device)", e);
}

std::string CreateStream(void** stream) {
  cudaStream_t s = nullptr;
  const cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  *stream = s;
  return e == cudaSuccess ? "" : CudaErr("cudaStreamCreateWithFlags", e);
}

void DestroyStream(void* stream) {
  if (stream != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

std::string TimeOnStream(void* stream, const std::function<void()>& enqueue, int warmup, int reps,
                         std::vector<float>* ms) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  ms->clear();
  for (int i = 0; i < warmup; ++i) enqueue();
  std::vector<cudaEvent_t> events(2 * static_cast<size_t>(std::max(reps, 0)), nullptr);
  std::string err;
  for (cudaEvent_t& ev : events) {
    const cudaError_t e = cudaEventCreate(&ev);
    if (e != cudaSuccess && err.empty()) err = CudaErr("cudaEventCreate", e);
  }
  for (int i = 0; i < reps && err.empty(); ++i) {
    cudaError_t e = cudaEventRecord(events[2 * i], s);
    enqueue();
    if (e == cudaSuccess) e = cudaEventRecord(events[2 * i + 1], s);
    if (e != cudaSuccess) err = CudaErr("cudaEventRecord", e);
  }
  if (err.empty()) {
    const cudaError_t e = cudaStreamSynchronize(s);
    if (e != cudaSuccess) err = CudaErr("cudaStreamSynchronize (timing)", e);
  }
  for (int i = 0; i < reps && err.empty(); ++i) {
    float t = 0;
    const cudaError_t e = cudaEventElapsedTime(&t, events[2 * i], events[2 * i + 1]);
    if (e != cudaSuccess) {
      err = CudaErr("cudaEventElapsedTime", e);
    } else {
      ms->push_back(t);
    }
  }
  for (cudaEvent_t ev : events) {
    if (ev != nullptr) cudaEventDestroy(ev);
  }
  return err;
}

std::string DeviceDescription() {
  int device = 0;
  cudaDeviceProp prop;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return CudaErr("cudaGetDeviceProperties", e);
  char buf[512];
  snprintf(buf, sizeof buf, "%s, %d SMs, %.1f GiB, CC %d.%d", prop.name, prop.multiProcessorCount,
           prop.totalGlobalMem / 1073741824.0, prop.major, prop.minor);
  return buf;
}

}  // namespace dmem

}  // namespace cuda
}  // namespace kernels
}  // namespace stallfree
