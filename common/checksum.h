// Checksum64: a fast streaming 64-bit checksum (not cryptographic) for files the project writes
// (the daemon's and the trainer's checkpoints): mixes 8-byte words; the digest also covers the
// length, so a truncated file never checks out.
#pragma once

#include <cstddef>
#include <cstdint>

namespace stallfree {

// A 64-bit checksum (not cryptographic): mixes 8-byte words; streaming.
class Checksum64 {
 public:
  void Update(const void* data, size_t n);
  uint64_t Digest() const;

 private:
  uint64_t h_ = 0x9e3779b97f4a7c15ULL;
  uint64_t total_ = 0;
  unsigned char tail_[8];
  size_t tail_n_ = 0;
  void Word(uint64_t w);
};

}  // namespace stallfree
