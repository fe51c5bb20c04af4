// The session record (server/session_record.h): its identity round-trips and checks its
// checksum; commits alternate between two slots, so that a commit torn half way leaves the one
// before it as the newest; a record with no whole commit is refused.
#include "server/session_record.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace stallfree {
namespace {

SessionIdentity Identity() {
  SessionIdentity id;
  id.uid = 1000;
  id.rank = 2;
  id.generation = 7;
  id.token_sha256 = TokenDigest("a-token");
  id.name = "job";
  id.param_dtype = 2;
  id.param_slots = 1;
  id.params = {{"w", {4, 3}, 1}, {"b", {5}, 2}};
  id.total_elems = 32;
  id.state_stride = 272;
  id.region_bytes = 5 * 4096;
  id.state_bytes = 4096 + 16 * 272;
  return id;
}

SessionCommit CommitAt(int64_t version) {
  SessionCommit c;
  c.version = version;
  c.last_step = version;
  c.pushes_since_update = version % 3;
  c.updated_once = true;
  c.has_state = true;
  c.acc_stale = version % 2 == 0;
  c.ready_dtype = 2;
  c.col_steps = {{version, version, version - 1}, {version, version, version, version, version}};
  return c;
}

TEST(SessionRecord, IdentityRoundTripsAndChecksItsChecksum) {
  const SessionIdentity id = Identity();
  std::vector<uint8_t> mem(RecordBytes(id.params), 0);
  SessionRecord r(mem.data(), mem.size());
  EXPECT_EQ(r.ReadIdentity().status().code(), absl::StatusCode::kDataLoss);
  ASSERT_TRUE(r.WriteIdentity(id).ok());
  absl::StatusOr<SessionIdentity> got = r.ReadIdentity();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->uid, id.uid);
  EXPECT_EQ(got->rank, id.rank);
  EXPECT_EQ(got->generation, id.generation);
  EXPECT_EQ(got->token_sha256, TokenDigest("a-token"));
  EXPECT_NE(got->token_sha256, TokenDigest("a-tokem"));
  EXPECT_EQ(got->name, "job");
  ASSERT_EQ(got->params.size(), 2u);
  EXPECT_EQ(got->params[0].name, "w");
  EXPECT_EQ(got->params[0].shape, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(got->params[1].grad_dtype, 2u);
  EXPECT_EQ(got->state_bytes, id.state_bytes);
  for (size_t at : {size_t{9}, size_t{20}, size_t{60}}) {  // any flipped byte is seen
    mem[at] ^= 0x10;
    EXPECT_EQ(r.ReadIdentity().status().code(), absl::StatusCode::kDataLoss) << at;
    mem[at] ^= 0x10;
  }
  EXPECT_EQ(got->format, kRecordFormat);
  // The format before journaled handovers (2) is read and kept; others are refused by name.
  SessionIdentity two = id;
  two.format = kRecordFormatNoHandovers;
  ASSERT_TRUE(r.WriteIdentity(two).ok());
  got = r.ReadIdentity();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->format, kRecordFormatNoHandovers);
  for (uint32_t other : {1u, 4u}) {
    SessionIdentity bad = id;
    bad.format = other;
    ASSERT_TRUE(r.WriteIdentity(bad).ok());
    got = r.ReadIdentity();
    EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << other;
    EXPECT_NE(got.status().message().find(absl::StrCat("has format ", other, "; this stallfreed "
                                                       "reads formats 2 and 3")),
              std::string::npos)
        << got.status();
  }
  ASSERT_TRUE(r.WriteIdentity(id).ok());
  // A name longer than the record has room for is refused, not written past the end.
  SessionIdentity long_name = id;
  long_name.name.assign(kRecordMaxName + 1, 'x');
  EXPECT_FALSE(r.WriteIdentity(long_name).ok());
}

TEST(SessionRecord, ACommitTornHalfWayLeavesTheOneBeforeIt) {
  const SessionIdentity id = Identity();
  std::vector<uint8_t> mem(RecordBytes(id.params), 0);
  SessionRecord r(mem.data(), mem.size());
  ASSERT_TRUE(r.WriteIdentity(id).ok());
  EXPECT_EQ(r.NewestCommit().status().code(), absl::StatusCode::kNotFound);
  for (int64_t v = 1; v <= 5; ++v) {
    absl::StatusOr<uint64_t> seq = r.Commit(CommitAt(v));
    ASSERT_TRUE(seq.ok()) << seq.status();
    EXPECT_EQ(*seq, static_cast<uint64_t>(v));
    absl::StatusOr<SessionCommit> newest = r.NewestCommit();
    ASSERT_TRUE(newest.ok()) << newest.status();
    EXPECT_EQ(newest->version, v);
    EXPECT_EQ(newest->col_steps, CommitAt(v).col_steps);
    EXPECT_EQ(newest->acc_stale, v % 2 == 0);
    EXPECT_EQ(newest->pushes_since_update, v % 3);
  }
  // Commit 6 torn: written over slot of commit 4 (the older), only its first bytes.
  std::vector<uint8_t> whole = mem;
  ASSERT_TRUE(r.Commit(CommitAt(6)).ok());
  std::vector<uint8_t> after = mem;
  size_t first = 0;
  while (first < mem.size() && whole[first] == after[first]) ++first;
  ASSERT_LT(first, mem.size());
  mem = whole;
  memcpy(mem.data() + first, after.data() + first, 24);  // the sequence and a little more
  SessionRecord reread(mem.data(), mem.size());
  absl::StatusOr<SessionCommit> newest = reread.NewestCommit();
  ASSERT_TRUE(newest.ok()) << newest.status();
  EXPECT_EQ(newest->version, 5);
  // Both slots bad: refused.
  SessionRecord rr(mem.data(), mem.size());
  uint32_t identity = 0;  // the identity's bytes (its header's second word): the slots follow
  memcpy(&identity, mem.data() + 12, 4);
  mem[identity + 30] ^= 1;
  mem[identity + 56 + 8 * 8 + 8 + 30] ^= 1;
  EXPECT_EQ(rr.NewestCommit().status().code(), absl::StatusCode::kDataLoss);
  // A commit whose columns are not the identity's is refused.
  SessionCommit wrong = CommitAt(7);
  wrong.col_steps[1].pop_back();
  EXPECT_FALSE(r.Commit(wrong).ok());
}

}  // namespace
}  // namespace stallfree
