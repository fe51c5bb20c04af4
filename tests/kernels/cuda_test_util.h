// What the GPU test binaries (ops_cuda_test, optimizer_cuda_test) share: a fatal check of a
// device call's error text, and a device copy of a host vector, on kernels/cuda/cuda_util.h.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_util.h"

namespace stallfree {
namespace testing {

// Device errors end a test binary: report and stop.
inline void CheckOk(const std::string& error, const std::string& what) {
  if (!error.empty()) {
    std::printf("FAIL %s: %s\n", what.c_str(), error.c_str());
    std::fflush(stdout);
    std::exit(1);
  }
}

// A device copy of a host vector (RAII): Put() writes the host values again, Get() reads them
// back. Never null, an empty one included (kernels may refuse a null pointer even for n = 0).
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(const std::vector<T>& host) : n_(host.size()) {
    CheckOk(kernels::cuda::dmem::Alloc(std::max<size_t>(bytes(), 1), &ptr_), "dmem::Alloc");
    Put(host);
  }
  ~DeviceArray() { kernels::cuda::dmem::Free(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return static_cast<T*>(ptr_); }
  void Put(const std::vector<T>& host) {
    if (host.size() != n_) CheckOk("size mismatch", "DeviceArray::Put");
    CheckOk(kernels::cuda::dmem::ToDevice(ptr_, host.data(), bytes()), "dmem::ToDevice");
  }
  std::vector<T> Get() const {
    std::vector<T> host(n_);
    CheckOk(kernels::cuda::dmem::ToHost(host.data(), ptr_, bytes()), "dmem::ToHost");
    return host;
  }

 private:
  size_t bytes() const { return n_ * sizeof(T); }
  size_t n_;
  void* ptr_ = nullptr;
};

}  // namespace testing
}  // namespace stallfree
