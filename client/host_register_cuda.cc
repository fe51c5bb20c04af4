#include <cuda_runtime_api.h>

#include "client/host_register.h"

namespace stallfree {
namespace {
constexpr uint64_t kChunk = uint64_t{64} << 30;
}

bool HostRegister(void* data, uint64_t size, std::string* error) {
  error->clear();
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return false;  // no GPU: plain memory.
  for (uint64_t off = 0; off < size; off += kChunk) {
    uint64_t len = size - off < kChunk ? size - off : kChunk;
    cudaError_t e = cudaHostRegister(static_cast<char*>(data) + off, len, cudaHostRegisterDefault);
    if (e != cudaSuccess) {
      *error = std::string("cudaHostRegister failed: ") + cudaGetErrorString(e);
      for (uint64_t u = 0; u < off; u += kChunk) cudaHostUnregister(static_cast<char*>(data) + u);
      return false;
    }
  }
  return true;
}

void HostUnregister(void* data, uint64_t size) {
  for (uint64_t off = 0; off < size; off += kChunk) cudaHostUnregister(static_cast<char*>(data) + off);
}
}  // namespace stallfree
