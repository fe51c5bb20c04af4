// LeWriter / LeReader: fixed-size little-endian values and length-prefixed strings in a byte
// buffer (the machines this runs on are little-endian), for the small binary formats the daemon
// keeps in shared memory (server/session_record.h, the work journal's plans).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace stallfree {

// Appends fixed-size little-endian values.
class LeWriter {
 public:
  template <typename T>
  void Put(T v) {
    const size_t at = out.size();
    out.resize(at + sizeof v);
    memcpy(out.data() + at, &v, sizeof v);
  }
  void Bytes(const void* p, size_t n) {
    const uint8_t* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
  void Str(const std::string& s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    Bytes(s.data(), s.size());
  }
  std::vector<uint8_t> out;
};

// Reads what LeWriter wrote, within [p, p + n); a read past the end fails (ok() false).
class LeReader {
 public:
  LeReader(const uint8_t* p, uint64_t n) : p_(p), n_(n) {}
  template <typename T>
  T Get() {
    T v{};
    if (at_ + sizeof v > n_) {
      ok_ = false;
      return v;
    }
    memcpy(&v, p_ + at_, sizeof v);
    at_ += sizeof v;
    return v;
  }
  bool Bytes(void* dst, uint64_t n) {
    if (at_ > n_ || n > n_ - at_) return ok_ = false;
    memcpy(dst, p_ + at_, n);
    at_ += n;
    return true;
  }
  bool Str(std::string* s, uint32_t max) {
    const uint32_t n = Get<uint32_t>();
    if (!ok_ || n > max) return ok_ = false;
    s->resize(n);
    return Bytes(s->data(), n);
  }
  bool ok() const { return ok_; }
  uint64_t at() const { return at_; }

 private:
  const uint8_t* p_;
  uint64_t n_;
  uint64_t at_ = 0;
  bool ok_ = true;
};

}  // namespace stallfree
