#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/bf16.h"
#include "common/bounds.h"
#include "common/status.h"
#include "common/unix_socket.h"

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

// The one macro set (common/status.h): the error passes unchanged, or with its context before
// the message and its code kept; OK falls through; StatusOr works in both macros.
absl::Status Fails(absl::StatusCode code) { return absl::Status(code, "disk on fire"); }
absl::StatusOr<int> Value(bool ok) {
  if (!ok) return absl::NotFoundError("no value");
  return 7;
}
absl::Status Plain(absl::Status s, int* reached) {
  RETURN_IF_ERROR(s);
  RETURN_IF_ERROR(Value(true));
  *reached = 1;
  return absl::OkStatus();
}
absl::Status WithCtx(absl::Status s, int* reached) {
  RETURN_IF_ERROR_CTX(s, "writing ", 3, " files");
  *reached = 1;
  return absl::OkStatus();
}
absl::StatusOr<int> Assign(bool ok) {
  ASSIGN_OR_RETURN(int v, Value(ok));
  return v + 1;
}
absl::StatusOr<int> AssignCtx(bool ok) {
  ASSIGN_OR_RETURN_CTX(int v, Value(ok), "param ", "w");
  return v + 1;
}

TEST(StatusMacros, ReturnTheErrorOrFallThrough) {
  int reached = 0;
  absl::Status st = Plain(Fails(absl::StatusCode::kDataLoss), &reached);
  EXPECT_EQ(st, Fails(absl::StatusCode::kDataLoss));
  EXPECT_EQ(reached, 0);
  EXPECT_TRUE(Plain(absl::OkStatus(), &reached).ok());
  EXPECT_EQ(reached, 1);
  EXPECT_EQ(Assign(true).value(), 8);
  EXPECT_EQ(Assign(false).status(), absl::NotFoundError("no value"));
}

TEST(StatusMacros, ContextGoesBeforeTheMessageAndKeepsTheCode) {
  int reached = 0;
  absl::Status st = WithCtx(Fails(absl::StatusCode::kUnavailable), &reached);
  EXPECT_EQ(st, absl::UnavailableError("writing 3 files: disk on fire"));
  EXPECT_EQ(reached, 0);
  EXPECT_TRUE(WithCtx(absl::OkStatus(), &reached).ok());
  EXPECT_EQ(reached, 1);
  EXPECT_EQ(AssignCtx(true).value(), 8);
  EXPECT_EQ(AssignCtx(false).status(), absl::NotFoundError("param w: no value"));
}

// ErrnoStatus codes by errno: a missing file is NOT_FOUND (it was UNAVAILABLE, which callers
// read as "the daemon went away"); a refused or broken connection is UNAVAILABLE. The message
// names the call, the object and errno.
TEST(ErrnoStatus, CodesFollowErrno) {
  const absl::Status missing = ErrnoStatus("open", "/state/1000/a.sfckpt", ENOENT);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.message().find("open(/state/1000/a.sfckpt)"), std::string::npos) << missing;
  EXPECT_NE(missing.message().find("(errno " + std::to_string(ENOENT) + ")"), std::string::npos)
      << missing;
  for (int err : {ECONNREFUSED, ECONNRESET, EPIPE, ENOTCONN})
    EXPECT_EQ(ErrnoStatus("sendmsg", "fd 3", err).code(), absl::StatusCode::kUnavailable) << err;
  EXPECT_EQ(ErrnoStatus("mmap", "r", ENOMEM).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoStatus("open", "f", EACCES).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoStatus("write", "f", EIO).code(), absl::StatusCode::kInternal);
}

// PeerClosed: a session's liveness connection (the client's test for "the daemon that held my
// session is gone"): open is false, even with unread bytes; the other end closed is true.
TEST(PeerClosed, TellsAClosedConnectionFromAnOpenOne) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  EXPECT_FALSE(PeerClosed(sv[0]));
  ASSERT_EQ(write(sv[1], "x", 1), 1);
  EXPECT_FALSE(PeerClosed(sv[0]));
  close(sv[1]);
  EXPECT_TRUE(PeerClosed(sv[0]));
  close(sv[0]);
}

// Descriptors over a unix socket: two in one message arrive in order (each a working
// descriptor of the same open file); more than the receiver takes are all closed, with an error
// that counts them; a plain message carries none.
TEST(SendWithFds, DescriptorsArriveInOrderAndTooManyAreRefused) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  int a[2], b[2];
  ASSERT_EQ(pipe(a), 0);
  ASSERT_EQ(pipe(b), 0);
  ASSERT_TRUE(SendWithFds(sv[0], "two\n", {a[1], b[1]}).ok());
  std::string msg;
  std::vector<int> fds;
  ASSERT_TRUE(RecvWithFds(sv[1], 64, &msg, &fds, 2).ok());
  EXPECT_EQ(msg, "two\n");
  ASSERT_EQ(fds.size(), 2u);
  ASSERT_EQ(write(fds[0], "A", 1), 1);  // the first is a's write end, the second b's
  ASSERT_EQ(write(fds[1], "B", 1), 1);
  char c = 0;
  ASSERT_EQ(read(a[0], &c, 1), 1);
  EXPECT_EQ(c, 'A');
  ASSERT_EQ(read(b[0], &c, 1), 1);
  EXPECT_EQ(c, 'B');
  for (int fd : fds) close(fd);

  ASSERT_TRUE(SendWithFds(sv[0], "2", {a[1], b[1]}).ok());
  absl::Status st = RecvWithFds(sv[1], 64, &msg, &fds, 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("2 descriptors sent, at most 1"), std::string::npos) << st;
  EXPECT_TRUE(fds.empty());

  ASSERT_TRUE(SendWithFds(sv[0], "none", {}).ok());
  ASSERT_TRUE(RecvWithFds(sv[1], 64, &msg, &fds, 2).ok());
  EXPECT_EQ(msg, "none");
  EXPECT_TRUE(fds.empty());
  for (int fd : {sv[0], sv[1], a[0], a[1], b[0], b[1]}) close(fd);
}

}  // namespace
}  // namespace stallfree
