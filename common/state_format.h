// The optimizer state's one format, below the daemon and the engine alike: the daemon's
// checkpoint files (offload.proto, Checkpoint / Restore), the bytes of ExportState and
// ImportState (whole checkpoint files, which a PyTorch state_dict() carries), what
// engine/repartition.h cuts and joins, and the parameter table of the surviving state
// (server/session_record.h's RecordParam is a StateParam). Free of protobuf and gRPC.
//
// Layout (little-endian):
//   "SFCKPT1\n"                      8-byte magic
//   uint64 header_bytes               length of the encoded header (EncodeStateHeader)
//   header                            names, shapes, dtypes, per-column steps, step, version
//   per parameter, in header order:   master, m, v, accumulator: 4 x numel fp32
//   uint64 checksum                   Checksum64 of every byte before it
//
// The header is offload.proto's message stallfree.v1.CheckpointHeader (with ParamSpec) in
// protobuf's wire format, encoded and decoded here by hand (EncodeStateHeader /
// DecodeStateHeader): the .proto message remains the format's schema for any other reader, and
// the files of every earlier version (which protobuf wrote) read as they did.
// tests/common/state_format_test.cc pins the encoding byte for byte against protobuf's own.
//
// Writes are atomic: a temporary file in the same directory, fsync, rename over the target,
// fsync of the directory. Reads verify the size and the checksum of the whole file before
// anything is handed to the caller's arrays.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/checksum.h"

namespace stallfree {

// One parameter of a state (offload.proto's ParamSpec): its name (UTF-8, as the schema's strings
// are; carried as bytes), its shape, and the dtype of the gradients pushed for it, the value of
// offload.proto's DType (0 unspecified, 1 fp32, 2 bf16).
struct StateParam {
  std::string name;
  std::vector<int64_t> shape;
  uint32_t grad_dtype = 0;  // v1::DType
};
bool operator==(const StateParam& a, const StateParam& b);
inline bool operator!=(const StateParam& a, const StateParam& b) { return !(a == b); }
// StateParam::grad_dtype's values (offload.proto's DTYPE_FP32 and DTYPE_BF16).
inline constexpr uint32_t kStateFp32 = 1;
inline constexpr uint32_t kStateBf16 = 2;

// A checkpoint's header (offload.proto's CheckpointHeader): who wrote it, at which step, and its
// parameters, each with its step count per column (its shape's last dimension).
struct StateHeader {
  std::string session_name;
  int32_t rank = 0;
  int64_t last_step = 0;
  int64_t version = 0;
  // The uid of the session that wrote the file (absent in files of stallfreed 0.1.0, which lie
  // in <state_dir> itself and are listed to root only).
  std::optional<uint32_t> owner_uid;
  struct Param {
    StateParam spec;
    std::vector<int64_t> col_steps;
  };
  std::vector<Param> params;
};
bool operator==(const StateHeader::Param& a, const StateHeader::Param& b);
bool operator==(const StateHeader& a, const StateHeader& b);
inline bool operator!=(const StateHeader& a, const StateHeader& b) { return !(a == b); }

// The header's bytes: what protobuf's SerializeToString writes for the CheckpointHeader of the
// same fields (fields in number order, zero scalars and empty strings left out, owner_uid
// written when present, repeated int64s packed, every parameter's spec written).
std::string EncodeStateHeader(const StateHeader& header);
// The inverse, for bytes of any writer of the schema: repeated fields packed or not, unknown
// fields (wire types 0, 1, 2, 5) skipped, a field given twice read as protobuf reads it (the
// last scalar, the repeated elements appended, a message merged). DataLoss naming the field and
// the byte for malformed bytes: a truncated varint or one longer than 10 bytes or past 64 bits,
// a length past the end, a group or an invalid wire type, field number 0.
absl::StatusOr<StateHeader> DecodeStateHeader(const void* data, size_t size);

// A parameter's elements (the product of its shape, 1 to 8 dimensions each in [1, 2^40], the
// leading one in [0, 2^40]: a rank's share of no rows), in overflow-safe arithmetic: DataLoss
// naming the parameter when a shape is out of range or the product overflows (numel * 16 <=
// INT64_MAX otherwise).
absl::StatusOr<int64_t> CheckpointParamNumel(const StateParam& p);

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

// Writes header + arrays (arrays[i] belongs to header.params[i]) atomically to path.
absl::StatusOr<CheckpointWritten> WriteCheckpoint(const std::string& path,
                                                  const StateHeader& header,
                                                  const std::vector<CheckpointArrays>& arrays);

// Reads and verifies the header of path (NotFound, DataLoss for a bad magic / truncation: a
// header whose arrays (4 x numel fp32 a parameter) are not all in the file is refused, so its
// shapes may size buffers). *file_bytes is the file's size. Does not verify the checksum.
absl::StatusOr<StateHeader> ReadCheckpointHeader(const std::string& path, uint64_t* file_bytes);

// The header alone, as ReadCheckpointHeader reads it but without looking for its arrays in the
// file (a listing, which reads no more: a bad body is found by a full read).
absl::StatusOr<StateHeader> PeekCheckpointHeader(const std::string& path, uint64_t* file_bytes);

// Verifies the whole file (size, checksum: DataLoss otherwise), then reads the arrays into
// `arrays` (one per header parameter, numel as in the header). Nothing is written to the arrays
// unless the file verified.
absl::Status ReadCheckpointArrays(const std::string& path, const StateHeader& header,
                                  const std::vector<CheckpointArrays>& arrays);

// Verifies the open checkpoint file fd (`path` names it in errors) of `size` bytes as
// ReadCheckpointArrays does: its header, that its size is what the header describes, and the
// checksum of everything before the trailer. Its header.
absl::StatusOr<StateHeader> VerifyCheckpointFd(int fd, const std::string& path, uint64_t size);

// Copies bytes [offset, offset + n) of the file into dst, n = min(capacity, size - offset), and
// returns n. *file_bytes is the file's size. NotFound, InvalidArgument (offset beyond the end).
absl::StatusOr<uint64_t> ReadCheckpointBytes(const std::string& path, uint64_t offset, void* dst,
                                             uint64_t capacity, uint64_t* file_bytes);

// Whether a checkpoint's header holds the parameters `specs` (a session's, in registration
// order): each the same StateParam (name, shape and dtype), with one step count per column (its
// shape's last dimension). The daemon's rule for a Restore or an ImportState into a session,
// and the engine's check of a state before it frees anything (ZenFlowEngine::CheckState).
// FailedPrecondition naming the first difference; `what` names the checkpoint after its field
// ("tag: checkpoint 'x'").
absl::Status MatchCheckpointParams(const StateHeader& header, const std::vector<StateParam>& specs,
                                   const std::string& what);

// A checkpoint's bytes in memory (a whole file, as ReadCheckpointBytes or ExportState gave
// them), verified as ReadCheckpointArrays verifies a file: magic, header, the size it
// describes and the checksum. Its header, or DataLoss naming `what` and the fault. `judge`, if
// given, sees the header before the checksum is computed (the order of an ImportState, which
// judges the header as soon as it has arrived), and its error is returned as it is.
absl::StatusOr<StateHeader> VerifyCheckpointBytes(
    const void* data, uint64_t size, const std::string& what,
    const std::function<absl::Status(const StateHeader&)>& judge = nullptr);

// A checkpoint's bytes made from live arrays, chunk after chunk in order, with no file
// (ExportState): the bytes WriteCheckpoint would write for header and arrays. The arrays must
// not change while an export runs (the caller ends it when they do). Not copyable.
class CheckpointExport {
 public:
  CheckpointExport(const StateHeader& header, std::vector<CheckpointArrays> arrays);
  CheckpointExport(const CheckpointExport&) = delete;
  CheckpointExport& operator=(const CheckpointExport&) = delete;
  // Internal unless the arrays are the header's, one per parameter, each of its size; such an
  // export hands out nothing (total() 0).
  const absl::Status& status() const { return status_; }
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
  absl::Status status_;
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
  // the arrays the body goes into (arrays[i] of header.params[i], numel as the header says), or
  // an error that ends the import with nothing changed.
  using Accept = std::function<absl::StatusOr<std::vector<CheckpointArrays>>(const StateHeader&)>;
  // Takes the next n bytes (n <= total() - done()). True once every byte arrived and the
  // checksum matched; DataLoss for a bad prefix (before any array changed: see writing()) or a
  // checksum that does not match (after); accept's error as it is.
  absl::StatusOr<bool> Take(const void* src, uint64_t n, const Accept& accept);
  uint64_t total() const { return total_; }
  uint64_t done() const { return done_; }
  // Whether bytes went into the arrays: a failure from here on leaves them changed.
  bool writing() const { return writing_; }
  const StateHeader& header() const { return header_; }

 private:
  absl::Status TakePrefix(const Accept& accept);
  const uint64_t total_;
  const std::string what_;
  uint64_t done_ = 0;
  std::string prefix_;
  uint64_t header_bytes_ = 0;
  bool have_header_ = false;
  StateHeader header_;
  std::vector<std::pair<char*, uint64_t>> pieces_;  // each array, in the file's order
  size_t piece_ = 0;
  uint64_t in_piece_ = 0;
  unsigned char trailer_[8] = {};
  uint64_t trailer_n_ = 0;
  Checksum64 sum_;
  bool writing_ = false;
};

}  // namespace stallfree
