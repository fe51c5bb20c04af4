// Where a parallel block's cached activations live: in the cache's std::vectors (the blocks'
// CPU API, host memory) or in OpsBuffers of the backend (their view API, the backend's memory).
// Header-only, shared by the TP+SP and TP x CP blocks, which list their cache's float tensors
// in a fixed order and address them through the pointers CacheData gives.
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

// Sizes a cache's N float tensors: as OpsBuffers of `ops` (in_backend; the vectors are
// released, so a cache holds one copy) or as the std::vectors (the buffers are untouched; the
// caller drops them).
template <size_t N>
void SizeCache(const kernels::TransformerOps& ops, const CacheSizes<N>& sizes, bool in_backend,
               const std::array<std::vector<float>*, N>& vecs,
               const std::array<kernels::OpsBuffer*, N>& bufs) {
  for (size_t i = 0; i < N; ++i) {
    if (in_backend) {
      std::vector<float>().swap(*vecs[i]);
      *bufs[i] = kernels::OpsBuffer(&ops, sizes[i]);
    } else {
      vecs[i]->resize(static_cast<size_t>(sizes[i]));
    }
  }
}

// The tensors' data pointers: the buffers' (bufs non-null) or the vectors'. False if a tensor's
// size is not `sizes`. Forward writes the cache through these pointers (it owns the cache);
// Backward only reads them, hence the const vectors.
template <size_t N>
bool CacheData(const std::array<const std::vector<float>*, N>& vecs,
               const std::array<const kernels::OpsBuffer*, N>* bufs, const CacheSizes<N>& sizes,
               std::array<float*, N>* data) {
  for (size_t i = 0; i < N; ++i) {
    const int64_t size =
        bufs != nullptr ? (*bufs)[i]->size() : static_cast<int64_t>(vecs[i]->size());
    if (size != sizes[i]) return false;
    (*data)[i] = bufs != nullptr ? (*bufs)[i]->data() : const_cast<float*>(vecs[i]->data());
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
