// The ZenFlow engine's checkpoint blob (ZenFlowEngine::Checkpoint): a flat little-endian byte
// string of int64 scalars and length-prefixed int64 / fp32 arrays, written and read by the
// engine (engine/zenflow.cc) and re-partitioned by engine/repartition.cc.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace stallfree {

//
// Versions (the magic, the first int64): V2 (kEngineBlobMagic), each offloaded parameter with
// its round_grads; V3 adds, after each parameter's kind, numel and k, its dtype (0 fp32,
// 1 bf16) and, after a device parameter's m and v, its fp32 master (numel floats for a bf16
// parameter whose master exists, else none). An engine writes the oldest version that holds its
// state: V2 when every parameter is fp32 (byte for byte what it wrote before bf16 parameters
// existed, so older readers and engine/repartition.cc keep reading it), V3 when one is bf16.
// V4 is V3 with, after each split parameter's hot arrays, the pending round's cold columns as
// the model will be shown them ([rows, ncold] floats: the daemon's predicted output, which its
// own checkpoint cannot rebuild; empty when no predicted round is pending), and after the
// parameters the round's state (schedule.h): whether it is automatic, the step its current
// length counts from, that length, and the least length its stalls have set. An engine with
// update_interval auto or predict_cold writes V4. The engine reads all three (a V1 blob, of a
// development version without round_grads, is refused).
constexpr int64_t kEngineBlobMagic = 0x325446574e455a53;    // "SZENWFT2": + round_grads
constexpr int64_t kEngineBlobMagicV3 = 0x335446574e455a53;  // "SZENWFT3": + dtype, bf16 masters
constexpr int64_t kEngineBlobMagicV4 = 0x345446574e455a53;  // "SZENWFT4": + the automatic round
// Whether a blob of this magic has the V3 parameter layout (dtypes, bf16 masters).
inline bool BlobHasDTypes(int64_t magic) {
  return magic == kEngineBlobMagicV3 || magic == kEngineBlobMagicV4;
}

// A parameter's dtype in a V3 blob.
enum EngineBlobDType : int64_t {
  kBlobFp32 = 0,
  kBlobBf16 = 1,
};

// A parameter's kind in the blob (the engine's PState::Kind).
enum EngineBlobKind : int64_t {
  kBlobDevice = 0,     // wholly on the device: dstep, m, v
  kBlobSplit = 1,      // zenflow: hot columns on the device (their state), cold in the daemon
  kBlobOffloaded = 2,  // sync-offload: wholly in the daemon
};

class BlobWriter {
 public:
  void I64(int64_t x) { Raw(&x, 8); }
  void Ints(const std::vector<int64_t>& v) {
    I64(static_cast<int64_t>(v.size()));
    Raw(v.data(), v.size() * 8);
  }
  void Floats(const std::vector<float>& v) {
    I64(static_cast<int64_t>(v.size()));
    Raw(v.data(), v.size() * 4);
  }
  void Raw(const void* p, size_t n) {
    if (n > 0) out.append(static_cast<const char*>(p), n);
  }
  std::string out;
};

// Reads a blob, every field by name: DataLoss "engine state: <field>: ..." when the field is
// truncated, or when an array's count is negative, is not what the caller expects, or needs more
// bytes than remain. A count is checked against the bytes that remain before anything is
// allocated for it, so no input makes the reader allocate more than its own size.
class BlobReader {
 public:
  explicit BlobReader(const std::string& s) : s_(s) {}
  absl::Status I64(const std::string& field, int64_t* x);
  // An array of exactly `expect` elements.
  absl::Status Ints(const std::string& field, std::vector<int64_t>* v, int64_t expect) {
    return Array(field, v, &expect);
  }
  absl::Status Floats(const std::string& field, std::vector<float>* v, int64_t expect) {
    return Array(field, v, &expect);
  }
  // An array of any length up to what remains.
  absl::Status AnyInts(const std::string& field, std::vector<int64_t>* v) {
    return Array(field, v, nullptr);
  }
  absl::Status AnyFloats(const std::string& field, std::vector<float>* v) {
    return Array(field, v, nullptr);
  }
  size_t remaining() const { return s_.size() - pos_; }
  bool done() const { return pos_ == s_.size(); }

 private:
  // OK when a count of `n` elements of `elem` bytes (`expect`: the count it must be, if any) is
  // whole in what remains (computed without overflow).
  absl::Status CheckCount(const std::string& field, int64_t n, size_t elem,
                          const int64_t* expect) const;
  template <typename T>
  absl::Status Array(const std::string& field, std::vector<T>* v, const int64_t* expect) {
    int64_t n = 0;
    absl::Status st = I64(field, &n);
    if (st.ok()) st = CheckCount(field, n, sizeof(T), expect);
    if (!st.ok()) return st;
    v->resize(static_cast<size_t>(n));  // n * sizeof(T) <= remaining(): checked
    if (n > 0) memcpy(v->data(), s_.data() + pos_, static_cast<size_t>(n) * sizeof(T));
    pos_ += static_cast<size_t>(n) * sizeof(T);
    return absl::OkStatus();
  }

  const std::string& s_;
  size_t pos_ = 0;
};

// An engine blob, parsed (ParseEngineBlob): the one reader of the format, for the engine's
// Restore and for Repartition.
struct EngineBlobParam {
  int64_t kind = 0, numel = 0, k = 0, dtype = kBlobFp32;
  std::vector<float> master;  // kBlobDevice, bf16 (V3): the fp32 master [rows, cols], or none yet
  int64_t dstep = 0, round_grads = 0;
  std::vector<float> m, v;                            // kBlobDevice: [rows, cols]
  std::vector<int64_t> hot_idx, cold_idx, hot_steps;  // kBlobSplit (empty before the first step)
  std::vector<float> hot_master, hot_m, hot_v;        // kBlobSplit: [rows, k] (likewise)
  std::vector<float> pending_shown;  // kBlobSplit (V4): [rows, ncold], or none
};
struct EngineBlob {
  int64_t magic = 0, mode = 0, step = 0, rounds = 0, pending_version = 0, loaded = 0;
  std::vector<EngineBlobParam> params;
  // V4: the round (Schedule::adaptive(), base(), interval(), and the floor of its choices).
  int64_t round_adaptive = 0, round_base = 0, round_interval = 0, round_floor = 0;
};
// DataLoss naming what is wrong when `bytes` is not a whole V2 / V3 / V4 engine blob; whether it
// fits an engine (its mode, parameters and shapes) is the caller's to check.
absl::StatusOr<EngineBlob> ParseEngineBlob(const std::string& bytes);

}  // namespace stallfree
