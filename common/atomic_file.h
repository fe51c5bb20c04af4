// Durable, atomic file writes and mkdir -p: the one copy the trainer's checkpoints and metrics,
// the daemon's checkpoints and its state directory use.
//
// A reader of `path` sees the old content or the new one, never a mix, and after Commit returns
// the new content survives a crash: the bytes go to a hidden temporary file in the same
// directory (<dir>/.<name>.tmp.<pid>.<n>, never a name a listing of checkpoints picks up), which
// is fsynced, renamed over `path`, and then the directory is fsynced (the rename itself durable).
// A temporary file left by a crash is never read; the next writer of the same name (a process
// with the same pid) truncates it.
//
//   RETURN_IF_ERROR(MakeDirs(out_dir + "/checkpoints"));
//   RETURN_IF_ERROR(WriteFileAtomically(out_dir + "/summary.json", json));
//
//   // Large content, streamed (nothing of it held in memory at once):
//   ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> w, AtomicFileWriter::Open(path, 0600));
//   RETURN_IF_ERROR(w->Append(header.data(), header.size()));
//   ...
//   RETURN_IF_ERROR(w->Commit());  // without it, the destructor removes the temporary file
//
// Errors: every failed system call is logged (ERROR) with its errno and the path it concerned,
// and its status names both. The code says what the errno means for a file:
//   NotFound            ENOENT (a directory on the path is missing)
//   PermissionDenied    EACCES, EPERM
//   FailedPrecondition  EROFS, ENOTDIR, EISDIR, EEXIST, ENOTEMPTY, EXDEV, ELOOP, ENAMETOOLONG
//                       (and MakeDirs on a path that exists but is not a directory)
//   ResourceExhausted   ENOSPC, EDQUOT, ENOMEM, EMFILE, ENFILE
//   Internal            anything else (EIO, ...)
// Not UNAVAILABLE: that code means "the daemon went away" to the trainer (trainer/daemon_loss.h).
//
// Thread safety: the functions are; one AtomicFileWriter is not (distinct writers are, even for
// the same path: each has its own temporary file, and the last Commit wins).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace stallfree {

// The status of a failed file-system call `call` on `path` (errno `err`), coded as above; logs it.
absl::Status FileError(const std::string& call, const std::string& path, int err);

// The directory of `path` ("." for a bare name, "/" for a name in the root).
std::string DirOf(const std::string& path);

// A hidden file next to `path`: <dir>/.<name><suffix> (.<name><suffix> for a bare name).
std::string HiddenSibling(const std::string& path, const std::string& suffix);

// An open file descriptor, closed when this goes out of scope (-1: none).
struct ScopedFd {
  int fd = -1;
  ScopedFd() = default;
  explicit ScopedFd(int f) : fd(f) {}
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd();
};

// write(2) until all n bytes of data went to fd (at its offset), in calls of at most 8 MiB,
// again after EINTR; an error coded as above, naming `path`.
absl::Status WriteFully(int fd, const void* data, size_t n, const std::string& path);

// mkdir -p: creates `path` and each missing directory above it with `mode` (before the umask).
// OK if it exists as a directory; FailedPrecondition if it (or a component) is not a directory.
absl::Status MakeDirs(const std::string& path, mode_t mode = 0755);

// fsync of a directory: makes the creations, renames and removals of entries in it durable.
absl::Status FsyncDirectory(const std::string& dir);

// rename(from, to), then fsync of to's directory. `from` and `to` must be in one file system.
absl::Status RenameDurably(const std::string& from, const std::string& to);

// Replaces (or creates) `path` with `content`, atomically and durably (file mode `mode` before
// the umask). The directory must exist (NotFound otherwise: see MakeDirs).
absl::Status WriteFileAtomically(const std::string& path, std::string_view content,
                                 mode_t mode = 0644);

// The streaming form: Append the content piece by piece, then Commit.
class AtomicFileWriter {
 public:
  // Creates the temporary file beside `path` (the directory must exist).
  static absl::StatusOr<std::unique_ptr<AtomicFileWriter>> Open(const std::string& path,
                                                                mode_t mode = 0644);
  // Without a successful Commit: closes and removes the temporary file; `path` is unchanged.
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  // Writes n bytes at the end of the temporary file (all of them, across short writes).
  absl::Status Append(const void* data, size_t n);
  // fsync, close, rename over `path`, fsync of the directory. After an error the temporary file
  // is removed and `path` is unchanged, except when only the directory's fsync failed (the new
  // content is in place, but not yet durable). Call at most once.
  absl::Status Commit();

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_; }

 private:
  AtomicFileWriter(std::string path, std::string temp, int fd)
      : path_(std::move(path)), temp_(std::move(temp)), fd_(fd) {}
  // Closes the fd (if open) and removes the temporary file; returns `st`.
  absl::Status Discard(absl::Status st);

  std::string path_, temp_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace stallfree
