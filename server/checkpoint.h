// The daemon's checkpoints (offload.proto, Checkpoint / Restore): where they lie, who owns them,
// their listing, uploads, removal and the sweep of interrupted writes. The files' format (layout,
// header, reading, writing, verifying, ExportState / ImportState's bytes) is the state format's,
// common/state_format.h, which the engine reads and writes too.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "stallfree/v1/offload.pb.h"

namespace stallfree {

// OK iff tag is 1..128 bytes of [A-Za-z0-9._-], does not start with '.' and has no "..".
absl::Status ValidateCheckpointTag(const std::string& tag);

// Checkpoints belong to a uid (offload.proto, CallerRef): <state_dir>/<uid>/<tag>.sfckpt.
std::string OwnerDir(const std::string& state_dir, uid_t uid);
std::string CheckpointPath(const std::string& state_dir, uid_t uid, const std::string& tag);

// Creates <state_dir>/<uid> (0700) if missing; fails unless it is a directory (not a link).
// FailedPrecondition, naming state_dir, when state_dir itself is missing.
absl::Status EnsureOwnerDir(const std::string& state_dir, uid_t uid);

// The checkpoints of `uid` (all: every uid's, and the unowned files of stallfreed 0.1.0 in
// state_dir itself), sorted by owner and tag, with what their headers say. None when uid's
// directory does not exist; with `all`, FailedPrecondition when state_dir is missing.
absl::StatusOr<std::vector<v1::CheckpointInfo>> ListCheckpointFiles(const std::string& state_dir,
                                                                    uid_t uid, bool all);

// Appends `length` bytes to the upload of `path` (a hidden file beside it; offset 0 starts a new
// one, any other offset must equal its size: FailedPrecondition). When offset + length == total
// the upload is fsynced, verified as ReadCheckpointArrays would (DataLoss, and the upload is
// removed, if it fails) and renamed over `path` (then the directory is fsynced): returns true.
// A file whose header names another owner than `owner` is refused (PermissionDenied).
absl::StatusOr<bool> WriteCheckpointChunk(const std::string& path, uint64_t offset,
                                          const void* src, uint64_t length, uint64_t total,
                                          uid_t owner);

// Removes the checkpoint (NotFound if missing) and fsyncs the directory.
absl::Status DeleteCheckpointFile(const std::string& path);

// Removes what an interrupted write leaves in the state directory (the daemon calls it at
// start, when no session exists): the hidden files of uploads (.<tag>.sfckpt.upload) and of
// atomic writes (.<tag>.sfckpt.tmp.<pid>.<n>) in every uid's directory, and the transient
// checkpoints (bytes-<pid>-<n>-<hex>.sfckpt) that clients before ExportState had the daemon
// write for a state_dict() and remove after reading them (a client killed in between left
// them). Returns the paths it removed; a file it cannot remove is logged with its errno and left.
// FailedPrecondition when state_dir is missing.
absl::StatusOr<std::vector<std::string>> SweepStateDir(const std::string& state_dir);

}  // namespace stallfree
