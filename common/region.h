// Shared and pinned memory.
//
// MappedRegion owns one mapping (and, for memfd regions, the fd). The daemon creates a
// session's region with CreateMemfd: sized, sealed against shrinking and growing, populated and
// (per PinPolicy) mlocked; it hands the fd to the client, which maps it with MapFd.
// Not copyable; destruction unmaps, unlocks and closes. Thread compatible: the mapping's bytes
// may be used from any thread, the object itself must not be destroyed while in use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace stallfree {

enum class PinPolicy {
  kRequire,     // mlock must succeed, or creation fails (RESOURCE_EXHAUSTED).
  kBestEffort,  // try mlock; on failure log a warning and keep the memory unpinned.
  kOff,         // never mlock (tests on machines with a tiny RLIMIT_MEMLOCK).
};

class MappedRegion {
 public:
  // memfd of `size` bytes named `name` (shown in /proc/<pid>/fd only; no /dev/shm object).
  static absl::StatusOr<std::unique_ptr<MappedRegion>> CreateMemfd(const std::string& name,
                                                                   uint64_t size, PinPolicy pin);
  // Anonymous private memory (the daemon's optimizer state), zero, populated (with transparent
  // huge pages where the kernel allows them: MADV_HUGEPAGE) and pinned per `pin`.
  static absl::StatusOr<std::unique_ptr<MappedRegion>> CreateAnonymous(const std::string& name,
                                                                      uint64_t size,
                                                                      PinPolicy pin);
  // Maps a memfd received from the daemon. Takes ownership of `fd`. Verifies with fstat that
  // the file is `size` bytes and that it is sealed against shrinking.
  static absl::StatusOr<std::unique_ptr<MappedRegion>> MapFd(int fd, uint64_t size);

  // Pins a mapping made by MapFd per `pin` (as CreateMemfd does its own): the daemon's mapping
  // of a session it adopts. Idempotent.
  absl::Status Lock(PinPolicy pin);

  ~MappedRegion();
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }           // -1 for anonymous memory.
  bool locked() const { return locked_; }  // true if mlock succeeded.

 private:
  MappedRegion(std::string name, uint8_t* data, uint64_t size, int fd, bool locked)
      : name_(std::move(name)), data_(data), size_(size), fd_(fd), locked_(locked) {}
  static absl::Status Pin(const std::string& name, uint8_t* data, uint64_t size, PinPolicy pin,
                          bool* locked);

  std::string name_;
  uint8_t* data_;
  uint64_t size_;
  int fd_;
  bool locked_;
};

}  // namespace stallfree
