#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <gtest/gtest.h>

#include "common/bf16.h"
#include "common/bounds.h"

namespace stallfree {
namespace {

TEST(CheckRange, AcceptsRangesInside) {
  EXPECT_TRUE(CheckRange(0, 0, 0, "f").ok());
  EXPECT_TRUE(CheckRange(0, 100, 100, "f").ok());
  EXPECT_TRUE(CheckRange(100, 0, 100, "f").ok());
  EXPECT_TRUE(CheckRange(40, 60, 100, "f").ok());
}

TEST(CheckRange, RejectsRangesOutside) {
  EXPECT_EQ(CheckRange(41, 60, 100, "f").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckRange(101, 0, 100, "f").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckRange(0, 101, 100, "f").code(), absl::StatusCode::kInvalidArgument);
}

TEST(CheckRange, RejectsOffsetPlusLengthOverflow) {
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  // offset + length wraps to a small number: a naive check (offset + length <= size) passes.
  EXPECT_EQ(CheckRange(64, max - 10, 100, "ranges[0].offset").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckRange(max, 2, 100, "f").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckRange(max, max, max, "f").code(), absl::StatusCode::kInvalidArgument);
  absl::Status s = CheckRange(64, max - 10, 100, "ranges[0].offset");
  EXPECT_NE(s.message().find("ranges[0].offset"), absl::string_view::npos) << s;
}

TEST(Arithmetic, DetectsOverflow) {
  uint64_t out;
  EXPECT_FALSE(MulOverflow(uint64_t{1} << 40, uint64_t{1} << 30, &out));
  EXPECT_TRUE(MulOverflow(1 << 20, 1 << 20, &out));
  EXPECT_EQ(out, uint64_t{1} << 40);
  EXPECT_FALSE(AddOverflow(std::numeric_limits<uint64_t>::max(), 1, &out));
  EXPECT_FALSE(AlignUp(std::numeric_limits<uint64_t>::max() - 2, 4096, &out));
  EXPECT_TRUE(AlignUp(4097, 4096, &out));
  EXPECT_EQ(out, 8192u);
}

uint32_t Bits(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}

TEST(Bf16, EveryBf16ValueRoundTripsExactly) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = Bf16ToFloat(static_cast<uint16_t>(h));
    uint16_t back = FloatToBf16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(back))) << h;
      EXPECT_EQ(back & 0x8000, h & 0x8000) << "sign of NaN kept, " << h;
    } else {
      EXPECT_EQ(back, h) << h;
    }
  }
}

TEST(Bf16, RoundsToNearestEven) {
  // 1.0 = 0x3f800000. Halfway to the next bf16 (0x3f81) is 0x3f808000: ties to even (0x3f80).
  auto from_bits = [](uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
  };
  EXPECT_EQ(FloatToBf16(from_bits(0x3f808000u)), 0x3f80);
  EXPECT_EQ(FloatToBf16(from_bits(0x3f808001u)), 0x3f81);
  EXPECT_EQ(FloatToBf16(from_bits(0x3f818000u)), 0x3f82);  // odd lower: tie goes up to even.
  EXPECT_EQ(FloatToBf16(from_bits(0x3f807fffu)), 0x3f80);
  // The largest finite float rounds to infinity (correct RNE), but NaN never does.
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(FloatToBf16(from_bits(0x7fffffffu)) & 0x7fc0, 0x7fc0);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(from_bits(0x7f800001u)))));
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  EXPECT_EQ(Bits(Bf16ToFloat(0x3f80)), 0x3f800000u);
}

}  // namespace
}  // namespace stallfree
