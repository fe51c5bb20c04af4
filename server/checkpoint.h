// Checkpoint files of the daemon's optimizer state (offload.proto, Checkpoint / Restore).
//
// Layout (little-endian):
//   "SFCKPT1\n"                      8-byte magic
//   uint64 header_bytes               length of the serialized v1::CheckpointHeader
//   header                            names, shapes, dtypes, per-column steps, step, version
//   per parameter, in header order:   master, m, v, accumulator: 4 x numel fp32
//   uint64 checksum                   Checksum64 of every byte before it
//
// Writes are atomic: a temporary file in the same directory, fsync, rename over the target,
// fsync of the directory. Reads verify the size and the checksum of the whole file before
// anything is handed to the caller's arrays.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/checksum.h"
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

// A header parameter's elements (the product of its shape, 1 to 8 dimensions each in
// [1, 2^40]), and the bytes of the arrays a header describes (4 x numel fp32 per parameter),
// in overflow-safe arithmetic: DataLoss naming the parameter when a shape is out of range or a
// product or sum overflows (numel * 16 <= INT64_MAX otherwise).
absl::StatusOr<int64_t> CheckpointParamNumel(const v1::CheckpointHeader::Param& p);
absl::StatusOr<uint64_t> CheckpointBodyBytes(const v1::CheckpointHeader& header);

// One parameter's four fp32 state arrays of numel elements.
struct CheckpointArrays {
  float* master;
  float* m;
  float* v;
  float* acc;
  int64_t numel;
};

struct CheckpointWritten {
  std::string path;
  uint64_t bytes = 0;
  uint64_t checksum = 0;
};

// Writes header + arrays (arrays[i] belongs to header.params(i)) atomically to path.
absl::StatusOr<CheckpointWritten> WriteCheckpoint(const std::string& path,
                                                  const v1::CheckpointHeader& header,
                                                  const std::vector<CheckpointArrays>& arrays);

// Reads and verifies the header of path (NotFound, DataLoss for a bad magic / truncation: a
// header whose arrays, by CheckpointBodyBytes, are not all in the file is refused, so its
// shapes may size buffers). *file_bytes is the file's size. Does not verify the checksum.
absl::StatusOr<v1::CheckpointHeader> ReadCheckpointHeader(const std::string& path,
                                                          uint64_t* file_bytes);

// Verifies the whole file (size, checksum: DataLoss otherwise), then reads the arrays into
// `arrays` (one per header parameter, numel as in the header). Nothing is written to the arrays
// unless the file verified.
absl::Status ReadCheckpointArrays(const std::string& path, const v1::CheckpointHeader& header,
                                  const std::vector<CheckpointArrays>& arrays);

// Copies bytes [offset, offset + n) of the file into dst, n = min(capacity, size - offset), and
// returns n. *file_bytes is the file's size. NotFound, InvalidArgument (offset beyond the end).
absl::StatusOr<uint64_t> ReadCheckpointBytes(const std::string& path, uint64_t offset, void* dst,
                                             uint64_t capacity, uint64_t* file_bytes);

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

}  // namespace stallfree
