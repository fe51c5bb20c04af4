#include "server/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/log.h"
#include "common/status.h"

namespace stallfree {
namespace {

constexpr char kMagic[8] = {'S', 'F', 'C', 'K', 'P', 'T', '1', '\n'};
constexpr size_t kIoChunk = size_t{8} << 20;
constexpr char kExt[] = ".sfckpt";

// The daemon's own state directory is gone (ENOENT under it, already logged with its errno): a
// misconfiguration for the operator to fix, not a missing checkpoint and not a lost daemon.
absl::Status StateDirMissing(const std::string& state_dir, const absl::Status& cause) {
  return absl::FailedPreconditionError(absl::StrCat(
      "stallfreed's state directory ", state_dir, " is missing (", cause.message(),
      "); create it (mode 0700, owned by stallfreed's user) or restart stallfreed, which does"));
}

// Closes an fd on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

absl::Status WriteAll(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = write(fd, p, std::min(n, kIoChunk));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return ErrnoStatus("write", path);
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status ReadAt(int fd, void* data, size_t n, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = pread(fd, p, std::min(n, kIoChunk), static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoStatus("pread", path);
    if (r == 0) return absl::DataLossError(absl::StrCat("checkpoint ", path, " is truncated"));
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

// The bytes of the arrays of a header that CheckpointBodyBytes accepted (WriteCheckpoint's
// headers are the daemon's own).
uint64_t BodyBytes(const v1::CheckpointHeader& header) {
  absl::StatusOr<uint64_t> body = CheckpointBodyBytes(header);
  return body.ok() ? *body : 0;
}

// The header of an open checkpoint file. With `sized`, the arrays it describes must be in the
// file too (so that its shapes may size buffers); without, only the header is judged (the
// listing: a bad body is found by a full read).
absl::StatusOr<v1::CheckpointHeader> ReadHeaderFd(int fd, const std::string& path,
                                                  uint64_t file_bytes, uint64_t* header_end,
                                                  bool sized = true) {
  char magic[8];
  uint64_t header_bytes = 0;
  if (file_bytes < 16)
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " is truncated: ", file_bytes,
                                            " bytes, not even a header"));
  RETURN_IF_ERROR(ReadAt(fd, magic, 8, 0, path));
  if (memcmp(magic, kMagic, 8) != 0)
    return absl::DataLossError(absl::StrCat(path, " is not a stallfree checkpoint (bad magic)"));
  RETURN_IF_ERROR(ReadAt(fd, &header_bytes, 8, 8, path));
  if (header_bytes > file_bytes - 16)
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " is truncated: its header needs ",
                                            header_bytes, " bytes, the file has ", file_bytes));
  std::string text(header_bytes, '\0');
  RETURN_IF_ERROR(ReadAt(fd, text.data(), header_bytes, 16, path));
  v1::CheckpointHeader header;
  if (!header.ParseFromString(text))
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " has a corrupt header"));
  // Its shapes' products in range; `sized`: the arrays they describe in the file, before
  // anyone sizes anything by them.
  absl::StatusOr<uint64_t> body = CheckpointBodyBytes(header);
  if (!body.ok())
    return absl::DataLossError(
        absl::StrCat("checkpoint ", path, " has a corrupt header: ", body.status().message()));
  const uint64_t room = file_bytes - 16 - header_bytes;  // for the arrays and the checksum
  if (sized && (room < 8 || *body > room - 8))
    return absl::DataLossError(absl::StrCat(
        "checkpoint ", path, " is truncated: ", file_bytes, " bytes, its header describes ",
        *body, " bytes of arrays after its ", 16 + header_bytes, " and an 8-byte checksum"));
  *header_end = 16 + header_bytes;
  return header;
}

absl::StatusOr<uint64_t> OpenForRead(const std::string& path, Fd* fd) {
  fd->fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd->fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("no checkpoint ", path));
    return ErrnoStatus("open", path);
  }
  struct stat st;
  if (fstat(fd->fd, &st) != 0) return ErrnoStatus("fstat", path);
  return static_cast<uint64_t>(st.st_size);
}

// The header alone of a listed checkpoint (ReadHeaderFd without `sized`).
absl::StatusOr<v1::CheckpointHeader> ReadListedHeader(const std::string& path,
                                                      uint64_t* file_bytes) {
  Fd fd;
  ASSIGN_OR_RETURN(uint64_t size, OpenForRead(path, &fd));
  *file_bytes = size;
  uint64_t header_end = 0;
  return ReadHeaderFd(fd.fd, path, size, &header_end, /*sized=*/false);
}

std::string DirOf(const std::string& path) { return path.substr(0, path.rfind('/')); }

// Verifies an open checkpoint file: its header, that its size is what the header describes, and
// the checksum of everything before the trailer. *header_end: where the arrays start.
absl::StatusOr<v1::CheckpointHeader> VerifyFd(int fd, const std::string& path, uint64_t size,
                                              uint64_t* header_end) {
  ASSIGN_OR_RETURN(v1::CheckpointHeader header, ReadHeaderFd(fd, path, size, header_end));
  const uint64_t want = *header_end + BodyBytes(header) + 8;
  if (size != want)
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " is ",
                                            size < want ? "truncated" : "too long", ": ", size,
                                            " bytes, its header describes ", want));
  Checksum64 sum;
  const size_t chunk = static_cast<size_t>(std::min<uint64_t>(kIoChunk, size - 8));
  std::unique_ptr<char[]> buf(new char[std::max<size_t>(chunk, 1)]);
  for (uint64_t off = 0; off < size - 8;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk, size - 8 - off));
    RETURN_IF_ERROR(ReadAt(fd, buf.get(), n, off, path));
    sum.Update(buf.get(), n);
    off += n;
  }
  uint64_t stored = 0;
  RETURN_IF_ERROR(ReadAt(fd, &stored, 8, size - 8, path));
  if (stored != sum.Digest())
    return absl::DataLossError(absl::StrFormat(
        "checkpoint %s is corrupt: checksum %016x, the file says %016x", path, sum.Digest(),
        stored));
  return header;
}

// A hidden file next to `path` ('.' never starts a tag, so it is never a checkpoint):
// <dir>/.<name><suffix>, for uploads.
std::string HiddenSibling(const std::string& path, const std::string& suffix) {
  return absl::StrCat(DirOf(path), "/.", path.substr(path.rfind('/') + 1), suffix);
}

// The header length in the first 16 bytes of a checkpoint of `total` bytes (total >= 24),
// after its magic; the header must leave room for the 8-byte checksum.
absl::StatusOr<uint64_t> HeaderLength(const char* first16, uint64_t total,
                                      const std::string& what) {
  if (memcmp(first16, kMagic, 8) != 0)
    return absl::DataLossError(absl::StrCat(what, " is not a stallfree checkpoint (bad magic)"));
  uint64_t header_bytes = 0;
  memcpy(&header_bytes, first16 + 8, 8);
  if (header_bytes > total - 24)
    return absl::DataLossError(absl::StrCat(what, " is truncated: its header needs ",
                                            header_bytes, " bytes, it has ", total));
  return header_bytes;
}

// The header in `text`, of a checkpoint of `total` bytes, whose size must be the one the
// header describes (16 + header + arrays + 8).
absl::StatusOr<v1::CheckpointHeader> HeaderOfText(const char* text, uint64_t header_bytes,
                                                  uint64_t total, const std::string& what) {
  v1::CheckpointHeader header;
  if (header_bytes > static_cast<uint64_t>(INT32_MAX) ||
      !header.ParseFromArray(text, static_cast<int>(header_bytes)))
    return absl::DataLossError(absl::StrCat(what, " has a corrupt header"));
  absl::StatusOr<uint64_t> body = CheckpointBodyBytes(header);
  if (!body.ok())
    return absl::DataLossError(
        absl::StrCat(what, " has a corrupt header: ", body.status().message()));
  uint64_t want = 24 + header_bytes;  // no overflow: header_bytes <= total - 24
  const bool over = __builtin_add_overflow(want, *body, &want);
  if (over || total != want)
    return absl::DataLossError(absl::StrCat(
        what, " is ", over || total < want ? "truncated" : "too long", ": ", total,
        " bytes, its header describes ", over ? "more than 2^64" : absl::StrCat(want)));
  return header;
}

// A transient checkpoint of clients before ExportState: bytes-<pid>-<n>-<hex>.sfckpt.
bool TransientName(const std::string& name) {
  const std::string ext = kExt;
  if (name.rfind("bytes-", 0) != 0 || name.size() <= 6 + ext.size() ||
      name.compare(name.size() - ext.size(), ext.size(), ext) != 0)
    return false;
  const std::string mid = name.substr(6, name.size() - 6 - ext.size());  // <pid>-<n>-<hex>
  const size_t a = mid.find('-'), b = a == std::string::npos ? a : mid.find('-', a + 1);
  if (b == std::string::npos || mid.find('-', b + 1) != std::string::npos) return false;
  const std::string pid = mid.substr(0, a), n = mid.substr(a + 1, b - a - 1),
                    hex = mid.substr(b + 1);
  return !pid.empty() && !n.empty() && !hex.empty() &&
         pid.find_first_not_of("0123456789") == std::string::npos &&
         n.find_first_not_of("0123456789") == std::string::npos &&
         hex.find_first_not_of("0123456789abcdef") == std::string::npos;
}

// What an interrupted write leaves: an upload's or an atomic write's hidden file.
bool HiddenLeftover(const std::string& name) {
  if (name.size() < 2 || name[0] != '.' || name == "..") return false;
  const std::string upload = ".upload";
  const bool is_upload = name.size() > upload.size() &&
                         name.compare(name.size() - upload.size(), upload.size(), upload) == 0;
  return is_upload || name.find(absl::StrCat(kExt, ".tmp.")) != std::string::npos;
}

}  // namespace

absl::StatusOr<int64_t> CheckpointParamNumel(const v1::CheckpointHeader::Param& p) {
  if (p.spec().shape_size() == 0 || p.spec().shape_size() > 8)
    return absl::DataLossError(absl::StrCat("parameter '", p.spec().name(), "': ",
                                            p.spec().shape_size(), " dimensions, not 1 to 8"));
  // The leading dimension may be 0, as a session's (a rank's share of no rows).
  int64_t numel = 1;
  for (int i = 0; i < p.spec().shape_size(); ++i) {
    const int64_t d = p.spec().shape(i), least = i == 0 ? 0 : 1;
    if (d < least || d > (int64_t{1} << 40))
      return absl::DataLossError(absl::StrCat("parameter '", p.spec().name(), "': dimension ", d,
                                              " is outside [", least, ", 2^40]"));
    // numel * 16 (its four fp32 arrays) must fit too: numel <= INT64_MAX / 16.
    if (__builtin_mul_overflow(numel, d, &numel) || numel > INT64_MAX / 16)
      return absl::DataLossError(absl::StrCat("parameter '", p.spec().name(),
                                              "': its shape's product overflows"));
  }
  return numel;
}

absl::StatusOr<uint64_t> CheckpointBodyBytes(const v1::CheckpointHeader& header) {
  uint64_t body = 0;
  for (const auto& p : header.params()) {
    ASSIGN_OR_RETURN(int64_t numel, CheckpointParamNumel(p));
    const uint64_t bytes = static_cast<uint64_t>(numel) * 4 * sizeof(float);  // no overflow
    if (__builtin_add_overflow(body, bytes, &body))
      return absl::DataLossError(
          absl::StrCat("parameter '", p.spec().name(), "': the arrays' bytes overflow"));
  }
  return body;
}

absl::Status ValidateCheckpointTag(const std::string& tag) {
  if (tag.empty() || tag.size() > 128)
    return absl::InvalidArgumentError("tag: must be 1 to 128 bytes");
  if (tag[0] == '.')
    return absl::InvalidArgumentError(absl::StrCat("tag: '", tag, "' starts with '.'"));
  if (tag.find("..") != std::string::npos)
    return absl::InvalidArgumentError(absl::StrCat("tag: '", tag, "' contains \"..\""));
  for (char c : tag) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok)
      return absl::InvalidArgumentError(absl::StrCat(
          "tag: '", tag, "' may only contain letters, digits, '.', '_' and '-' (no paths)"));
  }
  return absl::OkStatus();
}

std::string OwnerDir(const std::string& state_dir, uid_t uid) {
  return absl::StrCat(state_dir, "/", uid);
}

std::string CheckpointPath(const std::string& state_dir, uid_t uid, const std::string& tag) {
  return absl::StrCat(OwnerDir(state_dir, uid), "/", tag, kExt);
}

absl::Status EnsureOwnerDir(const std::string& state_dir, uid_t uid) {
  const std::string dir = OwnerDir(state_dir, uid);
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    const bool missing = errno == ENOENT;
    const absl::Status st = ErrnoStatus("mkdir", dir);
    return missing ? StateDirMissing(state_dir, st) : st;
  }
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0) return ErrnoStatus("lstat", dir);
  if (!S_ISDIR(st.st_mode))
    return absl::FailedPreconditionError(absl::StrCat(
        dir, " is not a directory; remove it so that stallfreed can keep uid ", uid,
        "'s checkpoints there"));
  if ((st.st_mode & 07777) != 0700 && chmod(dir.c_str(), 0700) != 0)
    return ErrnoStatus("chmod", dir);
  return absl::OkStatus();
}

namespace {

// The per-uid directories of the state directory (a name of decimal digits, as OwnerDir
// makes them), with their uid; the state directory's absence as StateDirMissing says.
absl::StatusOr<std::vector<std::pair<std::string, uid_t>>> UidDirs(
    const std::string& state_dir) {
  DIR* d = opendir(state_dir.c_str());
  if (d == nullptr) {
    const bool missing = errno == ENOENT;
    const absl::Status st = ErrnoStatus("opendir", state_dir);
    return missing ? StateDirMissing(state_dir, st) : st;
  }
  std::vector<std::pair<std::string, uid_t>> out;
  while (struct dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.empty() || name.size() > 10 ||
        name.find_first_not_of("0123456789") != std::string::npos)
      continue;
    out.emplace_back(state_dir + "/" + name, static_cast<uid_t>(std::stoul(name)));
  }
  closedir(d);
  return out;
}

}  // namespace

absl::StatusOr<std::vector<v1::CheckpointInfo>> ListCheckpointFiles(const std::string& state_dir,
                                                                    uid_t uid, bool all) {
  // (directory, owner, owned): every uid directory for `all`, else the caller's own.
  struct Dir {
    std::string path;
    uid_t owner;
    bool owned;
  };
  std::vector<Dir> dirs;
  if (all) {
    dirs.push_back({state_dir, 0, false});
    ASSIGN_OR_RETURN(auto owners, UidDirs(state_dir));
    for (const auto& [path, owner] : owners) dirs.push_back({path, owner, true});
  } else {
    dirs.push_back({OwnerDir(state_dir, uid), uid, true});
  }
  std::vector<v1::CheckpointInfo> out;
  for (const Dir& dir : dirs) {
    DIR* d = opendir(dir.path.c_str());
    if (d == nullptr) {
      if (errno == ENOENT) continue;  // this uid never wrote a checkpoint
      return ErrnoStatus("opendir", dir.path);
    }
    std::vector<std::string> tags;
    const std::string ext = kExt;
    while (struct dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name.size() > ext.size() && name[0] != '.' &&
          name.compare(name.size() - ext.size(), ext.size(), ext) == 0)
        tags.push_back(name.substr(0, name.size() - ext.size()));
    }
    closedir(d);
    std::sort(tags.begin(), tags.end());
    for (const std::string& tag : tags) {
      v1::CheckpointInfo info;
      info.set_tag(tag);
      info.set_owner_uid(dir.owner);
      const std::string path = absl::StrCat(dir.path, "/", tag, kExt);
      struct stat st;
      if (stat(path.c_str(), &st) == 0)
        info.set_mtime_unix(static_cast<double>(st.st_mtim.tv_sec) + st.st_mtim.tv_nsec * 1e-9);
      uint64_t bytes = 0;
      absl::StatusOr<v1::CheckpointHeader> h = ReadListedHeader(path, &bytes);
      info.set_bytes(bytes);
      if (!dir.owned) {
        info.set_error(absl::StrCat(
            "no owner (written by stallfreed 0.1.0): move it to ", state_dir,
            "/<uid>/ to give it to that uid's sessions"));
      } else if (!h.ok()) {
        info.set_error(std::string(h.status().message()));
      }
      if (h.ok()) {
        info.set_session_name(h->session_name());
        info.set_rank(h->rank());
        info.set_version(h->version());
        info.set_params(h->params_size());
        int64_t elems = 0;  // what the header says (saturating: its body is not read here)
        for (const auto& p : h->params()) {
          if (__builtin_add_overflow(elems, CheckpointParamNumel(p).value_or(0), &elems)) {
            elems = INT64_MAX;
            break;
          }
        }
        info.set_param_elements(elems);
      }
      out.push_back(std::move(info));
    }
  }
  return out;
}

absl::StatusOr<CheckpointWritten> WriteCheckpoint(const std::string& path,
                                                  const v1::CheckpointHeader& header,
                                                  const std::vector<CheckpointArrays>& arrays) {
  ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> file, AtomicFileWriter::Open(path, 0600));
  // The format's one statement is CheckpointExport's: its runs go to the file as they lie.
  CheckpointExport bytes(header, arrays);
  for (;;) {
    const auto [at, n] = bytes.NextRun(UINT64_MAX);
    if (n == 0) break;
    RETURN_IF_ERROR(file->Append(at, n));
  }
  RETURN_IF_ERROR(file->Commit());
  CheckpointWritten out;
  out.path = path;
  out.bytes = bytes.total();
  out.checksum = bytes.digest();
  return out;
}

absl::StatusOr<v1::CheckpointHeader> ReadCheckpointHeader(const std::string& path,
                                                          uint64_t* file_bytes) {
  Fd fd;
  ASSIGN_OR_RETURN(uint64_t size, OpenForRead(path, &fd));
  *file_bytes = size;
  uint64_t header_end = 0;
  return ReadHeaderFd(fd.fd, path, size, &header_end);
}


absl::Status ReadCheckpointArrays(const std::string& path, const v1::CheckpointHeader& expected,
                                  const std::vector<CheckpointArrays>& arrays) {
  Fd fd;
  ASSIGN_OR_RETURN(uint64_t size, OpenForRead(path, &fd));
  uint64_t header_end = 0;
  // Pass 1: the size and the checksum.
  ASSIGN_OR_RETURN(v1::CheckpointHeader header, VerifyFd(fd.fd, path, size, &header_end));
  if (header.SerializeAsString() != expected.SerializeAsString())
    return absl::AbortedError(absl::StrCat("checkpoint ", path, " changed while it was read"));
  // Pass 2: the arrays (same open file, so the same bytes).
  uint64_t off = header_end;
  for (const CheckpointArrays& a : arrays) {
    for (float* x : {a.master, a.m, a.v, a.acc}) {
      RETURN_IF_ERROR(ReadAt(fd.fd, x, a.numel * sizeof(float), off, path));
      off += a.numel * sizeof(float);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ReadCheckpointBytes(const std::string& path, uint64_t offset, void* dst,
                                             uint64_t capacity, uint64_t* file_bytes) {
  Fd fd;
  ASSIGN_OR_RETURN(uint64_t size, OpenForRead(path, &fd));
  *file_bytes = size;
  if (offset > size)
    return absl::InvalidArgumentError(
        absl::StrCat("offset: ", offset, " is beyond the checkpoint's ", size, " bytes"));
  const uint64_t n = std::min(capacity, size - offset);
  RETURN_IF_ERROR(ReadAt(fd.fd, dst, n, offset, path));
  return n;
}

absl::StatusOr<bool> WriteCheckpointChunk(const std::string& path, uint64_t offset,
                                          const void* src, uint64_t length, uint64_t total,
                                          uid_t owner) {
  const std::string upload = HiddenSibling(path, ".upload");
  Fd fd;
  fd.fd = open(upload.c_str(), O_RDWR | O_CLOEXEC | (offset == 0 ? O_CREAT | O_TRUNC : 0), 0600);
  if (fd.fd < 0 && errno == ENOENT)
    return absl::FailedPreconditionError(absl::StrCat(
        "offset: ", offset, " but no upload of ", path, " is in progress; start at offset 0"));
  if (fd.fd < 0) return ErrnoStatus("open", upload);
  struct stat st;
  if (fstat(fd.fd, &st) != 0) return ErrnoStatus("fstat", upload);
  if (static_cast<uint64_t>(st.st_size) != offset)
    return absl::FailedPreconditionError(absl::StrCat(
        "offset: ", offset, " but the upload of ", path, " holds ", st.st_size,
        " bytes; start again at offset 0"));
  if (lseek(fd.fd, static_cast<off_t>(offset), SEEK_SET) < 0) return ErrnoStatus("lseek", upload);
  auto discard = [&](absl::Status s) {
    unlink(upload.c_str());
    return s;
  };
  absl::Status w = WriteAll(fd.fd, src, length, upload);
  if (!w.ok()) return discard(w);
  if (offset + length < total) return false;
  if (fsync(fd.fd) != 0) return discard(ErrnoStatus("fsync", upload));
  uint64_t header_end = 0;
  absl::StatusOr<v1::CheckpointHeader> header = VerifyFd(fd.fd, upload, total, &header_end);
  if (!header.ok()) return discard(header.status());
  if (header->has_owner_uid() && header->owner_uid() != owner)
    return discard(absl::PermissionDeniedError(absl::StrCat(
        "checkpoint ", path, " belongs to uid ", header->owner_uid(), ", not to uid ", owner,
        "; checkpoint bytes move only between processes of one uid")));
  absl::Status renamed = RenameDurably(upload, path);
  if (!renamed.ok()) return discard(renamed);
  return true;
}

absl::Status DeleteCheckpointFile(const std::string& path) {
  if (unlink(path.c_str()) != 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("no checkpoint ", path));
    return ErrnoStatus("unlink", path);
  }
  return FsyncDirectory(DirOf(path));
}

}  // namespace stallfree

namespace stallfree {

absl::StatusOr<std::vector<std::string>> SweepStateDir(const std::string& state_dir) {
  std::vector<std::string> dirs = {state_dir};
  ASSIGN_OR_RETURN(auto owners, UidDirs(state_dir));
  for (const auto& owner : owners) dirs.push_back(owner.first);
  std::vector<std::string> removed;
  for (const std::string& dir : dirs) {
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) {
      SF_LOG(kWarning, "sweeping %s: opendir: %s (errno %d)", dir, strerror(errno), errno);
      continue;
    }
    std::vector<std::string> names;
    while (struct dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (HiddenLeftover(name) || TransientName(name)) names.push_back(name);
    }
    closedir(d);
    bool any = false;
    for (const std::string& name : names) {
      const std::string path = absl::StrCat(dir, "/", name);
      struct stat st;
      if (lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      if (unlink(path.c_str()) != 0) {
        SF_LOG(kWarning, "sweeping %s: unlink %s: %s (errno %d)", dir, path, strerror(errno),
               errno);
        continue;
      }
      removed.push_back(path);
      any = true;
    }
    if (any) {
      absl::Status synced = FsyncDirectory(dir);
      if (!synced.ok()) SF_LOG(kWarning, "sweeping %s: %s", dir, synced.ToString());
    }
  }
  return removed;
}

absl::Status MatchCheckpointParams(const v1::CheckpointHeader& header,
                                   const std::vector<v1::ParamSpec>& specs,
                                   const std::string& what) {
  const size_t colon = what.find(": ");
  const std::string field = what.substr(0, colon), name = what.substr(colon + 2);
  if (header.params_size() != static_cast<int>(specs.size()))
    return absl::FailedPreconditionError(absl::StrCat(
        what, " has ", header.params_size(), " parameters, the session registered ",
        specs.size()));
  for (size_t i = 0; i < specs.size(); ++i) {
    const v1::CheckpointHeader::Param& hp = header.params(static_cast<int>(i));
    const int64_t cols = specs[i].shape_size() > 0 ? specs[i].shape(specs[i].shape_size() - 1) : 1;
    if (hp.spec().SerializeAsString() != specs[i].SerializeAsString() ||
        hp.col_steps_size() != cols)
      return absl::FailedPreconditionError(absl::StrCat(
          field, ": parameter ", i, " of ", name, " is '", hp.spec().name(),
          "' with another name, shape or dtype than the session's '", specs[i].name(), "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::CheckpointHeader> VerifyCheckpointBytes(
    const void* data, uint64_t size, const std::string& what,
    const std::function<absl::Status(const v1::CheckpointHeader&)>& judge) {
  const char* p = static_cast<const char*>(data);
  if (size < 24)
    return absl::DataLossError(
        absl::StrCat(what, " is truncated: ", size, " bytes, not even a header"));
  ASSIGN_OR_RETURN(uint64_t header_bytes, HeaderLength(p, size, what));
  ASSIGN_OR_RETURN(v1::CheckpointHeader header, HeaderOfText(p + 16, header_bytes, size, what));
  if (judge) RETURN_IF_ERROR(judge(header));
  Checksum64 sum;
  sum.Update(p, size - 8);
  uint64_t stored = 0;
  memcpy(&stored, p + size - 8, 8);
  if (stored != sum.Digest())
    return absl::DataLossError(absl::StrFormat("%s is corrupt: checksum %016x, it says %016x",
                                               what, sum.Digest(), stored));
  return header;
}

CheckpointExport::CheckpointExport(const v1::CheckpointHeader& header,
                                   std::vector<CheckpointArrays> arrays) {
  std::string text;
  header.SerializeToString(&text);
  const uint64_t header_bytes = text.size();
  prefix_.assign(kMagic, 8);
  prefix_.append(reinterpret_cast<const char*>(&header_bytes), 8);
  prefix_.append(text);
  pieces_.push_back({prefix_.data(), prefix_.size()});
  total_ = prefix_.size() + 8;
  for (const CheckpointArrays& a : arrays)
    for (const float* x : {a.master, a.m, a.v, a.acc}) {
      pieces_.push_back({reinterpret_cast<const char*>(x), a.numel * sizeof(float)});
      total_ += a.numel * sizeof(float);
    }
  pieces_.push_back({reinterpret_cast<const char*>(&digest_), 8});
}

std::pair<const char*, uint64_t> CheckpointExport::NextRun(uint64_t max) {
  while (piece_ < pieces_.size() && in_piece_ == pieces_[piece_].bytes) {  // empty arrays
    ++piece_;
    in_piece_ = 0;
  }
  if (piece_ == pieces_.size() || max == 0) return {nullptr, 0};
  const Piece& p = pieces_[piece_];
  const bool trailer = piece_ + 1 == pieces_.size();
  if (trailer && in_piece_ == 0) digest_ = sum_.Digest();  // everything before it is out
  const uint64_t k = std::min(max, p.bytes - in_piece_);
  const char* at = p.data + in_piece_;
  if (!trailer) sum_.Update(at, k);
  in_piece_ += k;
  done_ += k;
  return {at, k};
}

uint64_t CheckpointExport::Next(void* dst, uint64_t capacity) {
  char* out = static_cast<char*>(dst);
  uint64_t n = 0;
  for (;;) {
    const auto [at, k] = NextRun(capacity - n);
    if (k == 0) return n;
    memcpy(out + n, at, k);
    n += k;
  }
}

CheckpointImport::CheckpointImport(uint64_t total, std::string what)
    : total_(total), what_(std::move(what)) {}

absl::Status CheckpointImport::TakePrefix(const Accept& accept) {
  if (prefix_.size() == 16) {
    ASSIGN_OR_RETURN(header_bytes_, HeaderLength(prefix_.data(), total_, what_));
    if (header_bytes_ > 0) return absl::OkStatus();  // the header's bytes come next
  }
  if (prefix_.size() < 16 + header_bytes_) return absl::OkStatus();
  ASSIGN_OR_RETURN(header_, HeaderOfText(prefix_.data() + 16, header_bytes_, total_, what_));
  ASSIGN_OR_RETURN(std::vector<CheckpointArrays> arrays, accept(header_));
  if (arrays.size() != static_cast<size_t>(header_.params_size()))
    return absl::InternalError(absl::StrCat(what_, ": ", arrays.size(), " arrays for ",
                                            header_.params_size(), " parameters"));
  for (int i = 0; i < header_.params_size(); ++i) {
    const CheckpointArrays& a = arrays[i];
    if (a.numel != CheckpointParamNumel(header_.params(i)).value_or(-1))
      return absl::InternalError(absl::StrCat(what_, ": parameter ", i, "'s arrays are not its size"));
    for (float* x : {a.master, a.m, a.v, a.acc})
      pieces_.emplace_back(reinterpret_cast<char*>(x), a.numel * sizeof(float));
  }
  have_header_ = true;
  std::string().swap(prefix_);
  return absl::OkStatus();
}

absl::StatusOr<bool> CheckpointImport::Take(const void* src, uint64_t n, const Accept& accept) {
  const char* in = static_cast<const char*>(src);
  if (total_ < 24)
    return absl::DataLossError(
        absl::StrCat(what_, " is truncated: ", total_, " bytes, not even a header"));
  if (n > total_ - done_)
    return absl::InvalidArgumentError(absl::StrCat("length: ", n, " bytes at ", done_,
                                                   " pass the state's ", total_));
  while (n > 0) {
    uint64_t k = 0;
    if (!have_header_) {
      // The prefix, kept whole: the first 16 bytes, then the header they announce (never
      // more than has arrived).
      const uint64_t want = prefix_.size() < 16 ? 16 : 16 + header_bytes_;
      k = std::min(n, want - prefix_.size());
      prefix_.append(in, k);
      sum_.Update(in, k);
      done_ += k;
      if (prefix_.size() == want) RETURN_IF_ERROR(TakePrefix(accept));
    } else if (piece_ < pieces_.size()) {
      auto& [data, bytes] = pieces_[piece_];
      k = std::min(n, bytes - in_piece_);
      if (k > 0) memcpy(data + in_piece_, in, k);  // (an array of no rows has no data)
      writing_ = true;
      sum_.Update(in, k);
      done_ += k;
      in_piece_ += k;
      if (in_piece_ == bytes) {
        ++piece_;
        in_piece_ = 0;
      }
    } else {
      k = std::min<uint64_t>(n, 8 - trailer_n_);
      memcpy(trailer_ + trailer_n_, in, k);
      trailer_n_ += k;
      done_ += k;
    }
    in += k;
    n -= k;
  }
  if (done_ < total_) return false;
  uint64_t stored = 0;
  memcpy(&stored, trailer_, 8);
  if (stored != sum_.Digest())
    return absl::DataLossError(absl::StrFormat("%s is corrupt: checksum %016x, it says %016x",
                                               what_, sum_.Digest(), stored));
  return true;
}

}  // namespace stallfree
