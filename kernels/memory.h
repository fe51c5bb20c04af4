// A backend's memory and stream: allocation, copies between host and backend memory, views of
// host memory, synchronisation. The ZenFlow engine needs this of a backend besides its
// optimizer kernels (kernels/optimizer.h); the transformer ops (kernels/ops.h) extend it with
// the math. Backends: the CPU's (CpuMemory() here, host memory, no BLAS; CpuOps() in ops.h is
// the same memory with the math) and CUDA's (kernels/cuda/ops_cuda.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace stallfree {
namespace kernels {

class BackendMemory {
 public:
  virtual ~BackendMemory() = default;
  virtual const char* name() const = 0;

  virtual std::string Synchronize() const { return ""; }
  // A backend on a stream of its own on the same device, for copies that should overlap this
  // backend's work (the ZenFlow engine's copy thread); its memory is this backend's. Null when
  // the backend has no such thing (host backends: nothing to overlap), or on failure (*error
  // says why): then use this backend.
  virtual std::unique_ptr<BackendMemory> NewCopyStream(std::string* error) const {
    (void)error;
    return nullptr;
  }

  // Makes this backend's device current on the calling thread (CUDA: the device of the stream
  // it was created on; cudaSetDevice), for a thread of the backend's own user that was not
  // started on it (the ZenFlow engine's copy thread: a new thread starts on device 0). ""
  // or why it failed. Host backends: nothing to do.
  virtual std::string BindDevice() const { return ""; }

  // Host memory as this backend's kernels address it: a pointer through which they read and
  // write the host memory at `host`, or null when they cannot (*error says why). Host backends:
  // `host` itself. CUDA: memory the driver has registered (client/host_register.h) through its
  // device mapping, so a kernel moves data straight between device and host memory at the host
  // link's speed (the ZenFlow engine's direct transfers).
  virtual void* HostView(void* host, std::string* error) const {
    (void)error;
    return host;
  }

  // Memory in the backend's memory space (host for CpuOps(), device for a CUDA backend). The
  // copies move bits exactly (they may carry int32 data reinterpreted as float). A CUDA backend
  // enqueues them on its stream like the other ops (AllocFloats / Free are stream ordered) and
  // records failures for Synchronize(); AllocFloats then returns null.

  // n >= 0 zero-initialised floats; null for n == 0. Release with Free().
  virtual float* AllocFloats(int64_t n) const = 0;
  // p from AllocFloats (or null).
  virtual void Free(void* p) const = 0;
  // dst[0, n) := src[0, n), both in backend memory, not overlapping.
  virtual void CopyFloats(float* dst, const float* src, int64_t n) const = 0;
  // dst[0, n) := value.
  virtual void Fill(float* dst, int64_t n, float value) const = 0;
  // From host memory to backend memory, and back. Download's result is in dst_host once
  // Synchronize() has returned (at once for a host backend).
  virtual void Upload(float* dst_backend, const float* src_host, int64_t n) const = 0;
  virtual void Download(float* dst_host, const float* src_backend, int64_t n) const = 0;
  // Row-major strided copy in backend memory: dst[i * dst_ld + j] := src[i * src_ld + j] for
  // i < rows, j < cols (element strides, ld >= cols; the two views do not overlap).
  virtual void Copy2D(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows,
                      int64_t cols) const = 0;
};

// A move-only owner of n floats of a backend's memory (zero-initialised), released through the
// same backend. The backend must outlive the buffer.
class OpsBuffer {
 public:
  OpsBuffer() = default;
  OpsBuffer(const BackendMemory* ops, int64_t n)
      : ops_(ops), data_(n > 0 ? ops->AllocFloats(n) : nullptr), size_(n > 0 ? n : 0) {}
  OpsBuffer(const OpsBuffer&) = delete;
  OpsBuffer& operator=(const OpsBuffer&) = delete;
  OpsBuffer(OpsBuffer&& o) noexcept : ops_(o.ops_), data_(o.data_), size_(o.size_) {
    o.ops_ = nullptr;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  OpsBuffer& operator=(OpsBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      ops_ = o.ops_;
      data_ = o.data_;
      size_ = o.size_;
      o.ops_ = nullptr;
      o.data_ = nullptr;
      o.size_ = 0;
    }
    return *this;
  }
  ~OpsBuffer() { reset(); }

  float* data() const { return data_; }
  int64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const BackendMemory* ops() const { return ops_; }
  // Releases the memory (size 0).
  void reset() {
    if (data_ != nullptr) ops_->Free(data_);
    data_ = nullptr;
    size_ = 0;
  }

 private:
  const BackendMemory* ops_ = nullptr;
  float* data_ = nullptr;
  int64_t size_ = 0;
};

// The CPU backend's memory (host memory; process-wide, thread safe).
const BackendMemory& CpuMemory();

}  // namespace kernels
}  // namespace stallfree
