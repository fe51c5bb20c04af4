#include "common/atomic_file.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace stallfree {
namespace {

absl::StatusCode FileErrorCode(int err) {
  switch (err) {
    case ENOENT:
      return absl::StatusCode::kNotFound;
    case EACCES:
    case EPERM:
      return absl::StatusCode::kPermissionDenied;
    case EROFS:
    case ENOTDIR:
    case EISDIR:
    case EEXIST:
    case ENOTEMPTY:
    case EXDEV:
    case ELOOP:
    case ENAMETOOLONG:
      return absl::StatusCode::kFailedPrecondition;
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
    case EMFILE:
    case ENFILE:
      return absl::StatusCode::kResourceExhausted;
    default:
      return absl::StatusCode::kInternal;
  }
}

// <dir>/.<name>.tmp.<pid>.<n>: hidden, and unique to this process and writer.
std::string TempSibling(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return HiddenSibling(path, absl::StrCat(".tmp.", getpid(), ".", counter.fetch_add(1)));
}

}  // namespace

absl::Status FileError(const std::string& call, const std::string& path, int err) {
  const absl::Status logged = ErrnoStatus(call, path, err);  // logs the call, path and errno
  return absl::Status(FileErrorCode(err), logged.message());
}

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string HiddenSibling(const std::string& path, const std::string& suffix) {
  const size_t slash = path.rfind('/');
  const size_t name = slash == std::string::npos ? 0 : slash + 1;
  return absl::StrCat(path.substr(0, name), ".", path.substr(name), suffix);
}

ScopedFd::~ScopedFd() {
  if (fd >= 0) close(fd);
}

absl::Status WriteFully(int fd, const void* data, size_t n, const std::string& path) {
  constexpr size_t kChunk = size_t{8} << 20;  // one write() call at most
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = write(fd, p, std::min(n, kChunk));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return FileError("write", path, errno);
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status MakeDirs(const std::string& path, mode_t mode) {
  if (path.empty()) return absl::InvalidArgumentError("MakeDirs: the path is empty");
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i < path.size() && path[i] != '/') continue;
    const std::string prefix = path.substr(0, i);
    if (mkdir(prefix.c_str(), mode) != 0 && errno != EEXIST)
      return FileError("mkdir", prefix, errno);
  }
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return FileError("stat", path, errno);
  if (!S_ISDIR(st.st_mode))
    return absl::FailedPreconditionError(
        absl::StrCat(path, " exists and is not a directory; remove it or choose another path"));
  return absl::OkStatus();
}

absl::Status FsyncDirectory(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return FileError("open", dir, errno);
  const int rc = fsync(fd);
  const int err = errno;
  close(fd);
  if (rc != 0) return FileError("fsync", dir, err);
  return absl::OkStatus();
}

absl::Status RenameDurably(const std::string& from, const std::string& to) {
  if (rename(from.c_str(), to.c_str()) != 0)
    return FileError("rename", absl::StrCat(from, " -> ", to), errno);
  return FsyncDirectory(DirOf(to));
}

absl::Status WriteFileAtomically(const std::string& path, std::string_view content, mode_t mode) {
  ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> writer, AtomicFileWriter::Open(path, mode));
  RETURN_IF_ERROR(writer->Append(content.data(), content.size()));
  return writer->Commit();
}

absl::StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Open(const std::string& path,
                                                                         mode_t mode) {
  std::string temp = TempSibling(path);
  const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) return FileError("open", temp, errno);
  return std::unique_ptr<AtomicFileWriter>(new AtomicFileWriter(path, std::move(temp), fd));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (!committed_) Discard(absl::OkStatus()).IgnoreError();
}

absl::Status AtomicFileWriter::Discard(absl::Status st) {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  unlink(temp_.c_str());
  return st;
}

absl::Status AtomicFileWriter::Append(const void* data, size_t n) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(temp_, " is not open"));
  absl::Status st = WriteFully(fd_, data, n, temp_);
  return st.ok() ? st : Discard(std::move(st));
}

absl::Status AtomicFileWriter::Commit() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(temp_, " is not open"));
  if (fsync(fd_) != 0) return Discard(FileError("fsync", temp_, errno));
  const int rc = close(fd_);
  fd_ = -1;
  if (rc != 0) return Discard(FileError("close", temp_, errno));
  if (rename(temp_.c_str(), path_.c_str()) != 0)
    return Discard(FileError("rename", absl::StrCat(temp_, " -> ", path_), errno));
  committed_ = true;
  return FsyncDirectory(DirOf(path_));
}

}  // namespace stallfree
