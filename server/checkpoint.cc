#include "server/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/state_format.h"
#include "common/log.h"
#include "common/status.h"

namespace stallfree {
namespace {

constexpr char kExt[] = ".sfckpt";

// The daemon's own state directory is gone (ENOENT under it, already logged with its errno): a
// misconfiguration for the operator to fix, not a missing checkpoint and not a lost daemon.
absl::Status StateDirMissing(const std::string& state_dir, const absl::Status& cause) {
  return absl::FailedPreconditionError(absl::StrCat(
      "stallfreed's state directory ", state_dir, " is missing (", cause.message(),
      "); create it (mode 0700, owned by stallfreed's user) or restart stallfreed, which does"));
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
      absl::StatusOr<StateHeader> h = PeekCheckpointHeader(path, &bytes);
      info.set_bytes(bytes);
      if (!dir.owned) {
        info.set_error(absl::StrCat(
            "no owner (written by stallfreed 0.1.0): move it to ", state_dir,
            "/<uid>/ to give it to that uid's sessions"));
      } else if (!h.ok()) {
        info.set_error(std::string(h.status().message()));
      }
      if (h.ok()) {
        info.set_session_name(h->session_name);
        info.set_rank(h->rank);
        info.set_version(h->version);
        info.set_params(static_cast<int64_t>(h->params.size()));
        int64_t elems = 0;  // what the header says (saturating: its body is not read here)
        for (const StateHeader::Param& p : h->params) {
          if (__builtin_add_overflow(elems, CheckpointParamNumel(p.spec).value_or(0), &elems)) {
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

absl::StatusOr<bool> WriteCheckpointChunk(const std::string& path, uint64_t offset,
                                          const void* src, uint64_t length, uint64_t total,
                                          uid_t owner) {
  // Hidden: '.' never starts a tag, so an upload is never taken for a checkpoint.
  const std::string upload = HiddenSibling(path, ".upload");
  ScopedFd fd(
      open(upload.c_str(), O_RDWR | O_CLOEXEC | (offset == 0 ? O_CREAT | O_TRUNC : 0), 0600));
  if (fd.fd < 0 && errno == ENOENT)
    return absl::FailedPreconditionError(absl::StrCat(
        "offset: ", offset, " but no upload of ", path, " is in progress; start at offset 0"));
  if (fd.fd < 0) return FileError("open", upload, errno);
  struct stat st;
  if (fstat(fd.fd, &st) != 0) return FileError("fstat", upload, errno);
  if (static_cast<uint64_t>(st.st_size) != offset)
    return absl::FailedPreconditionError(absl::StrCat(
        "offset: ", offset, " but the upload of ", path, " holds ", st.st_size,
        " bytes; start again at offset 0"));
  if (lseek(fd.fd, static_cast<off_t>(offset), SEEK_SET) < 0) return FileError("lseek", upload, errno);
  auto discard = [&](absl::Status s) {
    unlink(upload.c_str());
    return s;
  };
  absl::Status w = WriteFully(fd.fd, src, length, upload);
  if (!w.ok()) return discard(w);
  if (offset + length < total) return false;
  if (fsync(fd.fd) != 0) return discard(FileError("fsync", upload, errno));
  absl::StatusOr<StateHeader> header = VerifyCheckpointFd(fd.fd, upload, total);
  if (!header.ok()) return discard(header.status());
  if (header->owner_uid.has_value() && *header->owner_uid != owner)
    return discard(absl::PermissionDeniedError(absl::StrCat(
        "checkpoint ", path, " belongs to uid ", *header->owner_uid, ", not to uid ", owner,
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

}  // namespace stallfree
