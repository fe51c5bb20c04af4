// bfloat16 <-> fp32 conversion. fp32 -> bf16 rounds to nearest, ties to even; NaNs stay NaN
// (quiet, sign kept) and never round into infinity.
#pragma once

#include <cstdint>
#include <cstring>

namespace stallfree {

inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign, force a quiet mantissa bit.
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

}  // namespace stallfree
