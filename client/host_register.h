// Registers a host mapping with the CUDA driver (cudaHostRegister, in chunks of at most 64 GiB)
// so the GPU can DMA into it. A no-op returning false in CPU-only builds.
#pragma once

#include <cstdint>
#include <string>

namespace stallfree {
// Returns true if registered; *error is set (and false returned) if a CUDA call failed.
bool HostRegister(void* data, uint64_t size, std::string* error);
void HostUnregister(void* data, uint64_t size);
}  // namespace stallfree
