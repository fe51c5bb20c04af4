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
#include <functional>
#include <string>
#include <utility>
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

// Removes what an interrupted write leaves in the state directory (the daemon calls it at
// start, when no session exists): the hidden files of uploads (.<tag>.sfckpt.upload) and of
// atomic writes (.<tag>.sfckpt.tmp.<pid>.<n>) in every uid's directory, and the transient
// checkpoints (bytes-<pid>-<n>-<hex>.sfckpt) that clients before ExportState had the daemon
// write for a state_dict() and remove after reading them (a client killed in between left
// them). Returns the paths it removed; a file it cannot remove is logged with its errno and left.
// FailedPrecondition when state_dir is missing.
absl::StatusOr<std::vector<std::string>> SweepStateDir(const std::string& state_dir);

// Whether a checkpoint's header holds the parameters `specs` (a session's, in registration
// order): each the same ParamSpec, byte for byte, with one step count per column (its shape's
// last dimension). The daemon's rule for a Restore or an ImportState into a session, and the
// engine's check of a state before it frees anything (ZenFlowEngine::CheckState).
// FailedPrecondition naming the first difference; `what` names the checkpoint after its field
// ("tag: checkpoint 'x'").
absl::Status MatchCheckpointParams(const v1::CheckpointHeader& header,
                                   const std::vector<v1::ParamSpec>& specs,
                                   const std::string& what);

// A checkpoint's bytes in memory (a whole file, as ReadCheckpointBytes or ExportState gave
// them), verified as ReadCheckpointArrays verifies a file: magic, header, the size it
// describes and the checksum. Its header, or DataLoss naming `what` and the fault. `judge`, if
// given, sees the header before the checksum is computed (the order of an ImportState, which
// judges the header as soon as it has arrived), and its error is returned as it is.
absl::StatusOr<v1::CheckpointHeader> VerifyCheckpointBytes(
    const void* data, uint64_t size, const std::string& what,
    const std::function<absl::Status(const v1::CheckpointHeader&)>& judge = nullptr);

// A checkpoint's bytes made from live arrays, chunk after chunk in order, with no file
// (ExportState): the bytes WriteCheckpoint would write for header and arrays. The arrays must
// not change while an export runs (the caller ends it when they do). Not copyable.
class CheckpointExport {
 public:
  CheckpointExport(const v1::CheckpointHeader& header, std::vector<CheckpointArrays> arrays);
  CheckpointExport(const CheckpointExport&) = delete;
  CheckpointExport& operator=(const CheckpointExport&) = delete;
  uint64_t total() const { return total_; }
  uint64_t done() const { return done_; }  // bytes handed out so far
  // The next contiguous run of at most max bytes, where it lies (an array's memory, the
  // prefix, the trailer), and its length; {nullptr, 0} at the end. WriteCheckpoint writes the
  // runs to its file as they are.
  std::pair<const char*, uint64_t> NextRun(uint64_t max);
  // Copies the next min(capacity, total() - done()) bytes to dst; returns how many.
  uint64_t Next(void* dst, uint64_t capacity);
  // The trailer's checksum, once done() == total().
  uint64_t digest() const { return digest_; }

 private:
  struct Piece {
    const char* data;
    uint64_t bytes;
  };
  std::string prefix_;  // magic, header length, header
  uint64_t digest_ = 0;  // the trailer: set once every byte before it has been handed out
  std::vector<Piece> pieces_;  // prefix_, each array, digest_
  size_t piece_ = 0;
  uint64_t in_piece_ = 0;
  Checksum64 sum_;
  uint64_t total_ = 0, done_ = 0;
};

// The inverse (ImportState): a checkpoint's bytes taken chunk after chunk in order, straight
// into live arrays. The prefix (magic, header length, header) is kept until it is whole and
// judged before any array changes; the checksum is compared once the last byte arrived. `what`
// names the bytes in errors. Not copyable.
class CheckpointImport {
 public:
  CheckpointImport(uint64_t total, std::string what);
  CheckpointImport(const CheckpointImport&) = delete;
  CheckpointImport& operator=(const CheckpointImport&) = delete;
  // Given the header (checked: magic, its shapes, total() equal to the size it describes),
  // the arrays the body goes into (arrays[i] of header.params(i), numel as the header says), or
  // an error that ends the import with nothing changed.
  using Accept =
      std::function<absl::StatusOr<std::vector<CheckpointArrays>>(const v1::CheckpointHeader&)>;
  // Takes the next n bytes (n <= total() - done()). True once every byte arrived and the
  // checksum matched; DataLoss for a bad prefix (before any array changed: see writing()) or a
  // checksum that does not match (after); accept's error as it is.
  absl::StatusOr<bool> Take(const void* src, uint64_t n, const Accept& accept);
  uint64_t total() const { return total_; }
  uint64_t done() const { return done_; }
  // Whether bytes went into the arrays: a failure from here on leaves them changed.
  bool writing() const { return writing_; }
  const v1::CheckpointHeader& header() const { return header_; }

 private:
  absl::Status TakePrefix(const Accept& accept);
  const uint64_t total_;
  const std::string what_;
  uint64_t done_ = 0;
  std::string prefix_;
  uint64_t header_bytes_ = 0;
  bool have_header_ = false;
  v1::CheckpointHeader header_;
  std::vector<std::pair<char*, uint64_t>> pieces_;  // each array, in the file's order
  size_t piece_ = 0;
  uint64_t in_piece_ = 0;
  unsigned char trailer_[8] = {};
  uint64_t trailer_n_ = 0;
  Checksum64 sum_;
  bool writing_ = false;
};

}  // namespace stallfree
