#include "common/checksum.h"

#include <cstring>

namespace stallfree {

void Checksum64::Word(uint64_t w) {
  h_ ^= w;
  h_ *= 0xff51afd7ed558ccdULL;
  h_ ^= h_ >> 32;
}

void Checksum64::Update(const void* data, size_t n) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  total_ += n;
  while (n > 0 && tail_n_ > 0 && tail_n_ < 8) {
    tail_[tail_n_++] = *p++;
    --n;
    if (tail_n_ == 8) {
      uint64_t w;
      memcpy(&w, tail_, 8);
      Word(w);
      tail_n_ = 0;
    }
  }
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    Word(w);
  }
  while (n > 0) {
    tail_[tail_n_++] = *p++;
    --n;
  }
}

uint64_t Checksum64::Digest() const {
  Checksum64 c = *this;
  uint64_t w = 0;
  memcpy(&w, c.tail_, c.tail_n_);
  c.Word(w ^ (static_cast<uint64_t>(c.tail_n_) << 56));
  c.Word(c.total_);
  return c.h_;
}

}  // namespace stallfree
