#include "common/region.h"

#include <fcntl.h>
#include <string.h>
#include <linux/memfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"

namespace stallfree {

absl::Status MappedRegion::Pin(const std::string& name, uint8_t* data, uint64_t size,
                               PinPolicy pin, bool* locked) {
  *locked = false;
  if (pin == PinPolicy::kOff || size == 0) return absl::OkStatus();
  if (mlock(data, size) == 0) {
    *locked = true;
    return absl::OkStatus();
  }
  int err = errno;
  if (pin == PinPolicy::kRequire) {
    return ErrnoStatus("mlock", absl::StrCat(name, ", ", size, " bytes"), err);
  }
  SF_LOG(kWarning, "mlock(%s, %d bytes) failed: %s (errno %d); memory stays unpinned", name, size,
         strerror(err), err);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MappedRegion>> MappedRegion::CreateMemfd(const std::string& name,
                                                                        uint64_t size,
                                                                        PinPolicy pin) {
  if (size == 0) return absl::InvalidArgumentError("region size must be > 0");
  int fd = static_cast<int>(syscall(SYS_memfd_create, name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fd < 0) return ErrnoStatus("memfd_create", name);
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    absl::Status s = ErrnoStatus("ftruncate", absl::StrCat(name, " to ", size, " bytes"));
    close(fd);
    return s;
  }
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    absl::Status s = ErrnoStatus("fcntl(F_ADD_SEALS)", name);
    close(fd);
    return s;
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    absl::Status s = ErrnoStatus("mmap", absl::StrCat(name, ", ", size, " bytes"));
    close(fd);
    return s;
  }
  bool locked = false;
  absl::Status st = Pin(name, static_cast<uint8_t*>(p), size, pin, &locked);
  if (!st.ok()) {
    munmap(p, size);
    close(fd);
    return st;
  }
  return std::unique_ptr<MappedRegion>(
      new MappedRegion(name, static_cast<uint8_t*>(p), size, fd, locked));
}

absl::StatusOr<std::unique_ptr<MappedRegion>> MappedRegion::CreateAnonymous(
    const std::string& name, uint64_t size, PinPolicy pin) {
  if (size == 0) return absl::InvalidArgumentError("size must be > 0");
  // Not MAP_POPULATE: the huge-page advice must come before the pages exist. Transparent huge
  // pages (THP "madvise" mode) cut the TLB misses of the optimizer's five to seven streams, and
  // on a VM whose memory is backed lazily only a huge-page populate really backs the memory: a
  // populate of 4 KiB pages is cheap, and the first write to each page then costs ~3-5 s/GB,
  // which the daemon would pay inside its first pushes and updates (measured on this project's
  // Firecracker VMs). Both steps are advice: if either fails the memory works as before.
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return ErrnoStatus("mmap", absl::StrCat(name, ", ", size, " bytes"));
  if (madvise(p, size, MADV_HUGEPAGE) != 0)
    SF_LOG(kDebug, "madvise(%s, MADV_HUGEPAGE) failed: %s (errno %d)", name, strerror(errno), errno);
  if (madvise(p, size, MADV_POPULATE_WRITE) != 0)
    SF_LOG(kDebug, "madvise(%s, MADV_POPULATE_WRITE) failed: %s (errno %d); pages fault in on "
           "first use", name, strerror(errno), errno);
  bool locked = false;
  absl::Status st = Pin(name, static_cast<uint8_t*>(p), size, pin, &locked);
  if (!st.ok()) {
    munmap(p, size);
    return st;
  }
  return std::unique_ptr<MappedRegion>(
      new MappedRegion(name, static_cast<uint8_t*>(p), size, -1, locked));
}

absl::StatusOr<std::unique_ptr<MappedRegion>> MappedRegion::MapFd(int fd, uint64_t size) {
  std::string name = absl::StrCat("memfd ", fd);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    absl::Status s = ErrnoStatus("fstat", name);
    close(fd);
    return s;
  }
  if (static_cast<uint64_t>(st.st_size) != size) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat(name, " is ", st.st_size, " bytes, the layout says ", size));
  }
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat(name, " is not sealed against shrinking"));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    absl::Status s = ErrnoStatus("mmap", absl::StrCat(name, ", ", size, " bytes"));
    close(fd);
    return s;
  }
  return std::unique_ptr<MappedRegion>(
      new MappedRegion(name, static_cast<uint8_t*>(p), size, fd, false));
}

absl::Status MappedRegion::Lock(PinPolicy pin) {
  if (locked_) return absl::OkStatus();
  return Pin(name_, data_, size_, pin, &locked_);
}

MappedRegion::~MappedRegion() {
  if (data_ != nullptr) {
    if (locked_) munlock(data_, size_);
    if (munmap(data_, size_) != 0) ErrnoStatus("munmap", name_).IgnoreError();
  }
  if (fd_ >= 0) close(fd_);
}

}  // namespace stallfree
