// The cached activations of a parallel block in the backend's memory: OpsBuffers of `ops` that
// the forward allocates and the backward reads back. Header-only, shared by the TP+SP and
// TP x CP blocks (and the distributed model's positions), which list their cache's float
// tensors in a fixed order and address them through the pointers CacheData gives.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/ops.h"

namespace stallfree {
namespace parallel {
namespace layer {

template <size_t N>
using CacheSizes = std::array<int64_t, N>;

// Allocates the N tensors (zeroed) in ops' memory; the buffers' previous memory is released
// first, one buffer at a time.
template <size_t N>
void AllocateCache(const kernels::TransformerOps& ops, const CacheSizes<N>& sizes,
                   const std::array<kernels::OpsBuffer*, N>& bufs) {
  for (size_t i = 0; i < N; ++i) {
    bufs[i]->reset();
    *bufs[i] = kernels::OpsBuffer(&ops, sizes[i]);
  }
}

// The tensors' data pointers. False if a tensor's size is not `sizes` or a buffer is not ops'
// (a cache of another backend). Forward writes the cache through these pointers (it owns the
// cache); Backward only reads them.
template <size_t N>
bool CacheData(const kernels::TransformerOps& ops,
               const std::array<const kernels::OpsBuffer*, N>& bufs, const CacheSizes<N>& sizes,
               std::array<float*, N>* data) {
  for (size_t i = 0; i < N; ++i) {
    if (bufs[i]->size() != sizes[i] || (sizes[i] > 0 && bufs[i]->ops() != &ops)) return false;
    (*data)[i] = bufs[i]->data();
  }
  return true;
}

// int32 positions in the backend's memory, bit for bit in float-sized elements.
inline kernels::OpsBuffer UploadPositions(const kernels::TransformerOps& ops,
                                          const std::vector<int32_t>& pos) {
  static_assert(sizeof(int32_t) == sizeof(float), "positions travel as float-sized bits");
  kernels::OpsBuffer b(&ops, static_cast<int64_t>(pos.size()));
  ops.Upload(b.data(), reinterpret_cast<const float*>(pos.data()), b.size());
  return b;
}

}  // namespace layer
}  // namespace parallel
}  // namespace stallfree
