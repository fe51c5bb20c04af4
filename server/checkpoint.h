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

// <dir>/<tag>.sfckpt
std::string CheckpointPath(const std::string& dir, const std::string& tag);

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

// Reads and verifies the header of path (NotFound, DataLoss for a bad magic / truncation).
// *file_bytes is the file's size. Does not verify the checksum.
absl::StatusOr<v1::CheckpointHeader> ReadCheckpointHeader(const std::string& path,
                                                          uint64_t* file_bytes);

// Verifies the whole file (size, checksum: DataLoss otherwise), then reads the arrays into
// `arrays` (one per header parameter, numel as in the header). Nothing is written to the arrays
// unless the file verified.
absl::Status ReadCheckpointArrays(const std::string& path, const v1::CheckpointHeader& header,
                                  const std::vector<CheckpointArrays>& arrays);

}  // namespace stallfree
