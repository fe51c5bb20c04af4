// The ZenFlow engine's checkpoint blob (ZenFlowEngine::Checkpoint): a flat little-endian byte
// string of int64 scalars and length-prefixed int64 / fp32 arrays, written and read by the
// engine (client/zenflow.cc) and re-partitioned by client/repartition.cc.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace stallfree {

constexpr int64_t kEngineBlobMagicV1 = 0x315446574e455a53;  // "SZENWFT1"
constexpr int64_t kEngineBlobMagic = 0x325446574e455a53;    // "SZENWFT2": + round_grads

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
  void Raw(const void* p, size_t n) { out.append(static_cast<const char*>(p), n); }
  std::string out;
};

class BlobReader {
 public:
  explicit BlobReader(const std::string& s) : s_(s) {}
  bool I64(int64_t* x) { return Raw(x, 8); }
  // An array of exactly `expect` elements (false otherwise, or when truncated).
  bool Ints(std::vector<int64_t>* v, int64_t expect) {
    int64_t n;
    if (!I64(&n) || n != expect) return false;
    v->resize(n);
    return Raw(v->data(), n * 8);
  }
  bool Floats(std::vector<float>* v, int64_t expect) {
    int64_t n;
    if (!I64(&n) || n != expect) return false;
    v->resize(n);
    return Raw(v->data(), n * 4);
  }
  // An array of any length up to what remains.
  bool AnyInts(std::vector<int64_t>* v) {
    int64_t n;
    if (!I64(&n) || n < 0 || static_cast<uint64_t>(n) > (s_.size() - pos_) / 8) return false;
    v->resize(n);
    return Raw(v->data(), n * 8);
  }
  bool AnyFloats(std::vector<float>* v) {
    int64_t n;
    if (!I64(&n) || n < 0 || static_cast<uint64_t>(n) > (s_.size() - pos_) / 4) return false;
    v->resize(n);
    return Raw(v->data(), n * 4);
  }
  bool Raw(void* p, size_t n) {
    if (n > s_.size() - pos_) return false;
    memcpy(p, s_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool done() const { return pos_ == s_.size(); }

 private:
  const std::string& s_;
  size_t pos_ = 0;
};

}  // namespace stallfree
