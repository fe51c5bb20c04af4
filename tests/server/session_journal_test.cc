// The work journal (server/session_journal.h) on its own: an operation cut short with units
// done, one unit half changed and the rest untouched is rolled back and run again to exactly
// the uninterrupted result; without the roll-back it is not; entries that do not check out are
// refused.
#include "server/session_journal.h"

#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace stallfree {
namespace {

constexpr uint64_t kElems = 100000;  // not a multiple of the unit: a short last unit

struct Fixture {
  JournalGeometry g = JournalGeometryFor(kElems, 3);
  std::vector<uint64_t> memory = std::vector<uint64_t>(g.bytes / 8 + 8);
  WorkJournal journal{reinterpret_cast<uint8_t*>(memory.data()), g};
  std::vector<std::vector<float>> arrays = std::vector<std::vector<float>>(3);
  Fixture() {
    journal.Format();
    std::mt19937 rng(3);
    std::normal_distribution<float> normal;
    for (auto& a : arrays) {
      a.resize(kElems);
      for (float& x : a) x = normal(rng);
    }
  }
  std::vector<float*> ptrs() { return {arrays[0].data(), arrays[1].data(), arrays[2].data()}; }
};

// The operation: every element of the three arrays, x -> 0.5 x + 1 (not idempotent: applied
// twice it differs).
void Step(std::vector<float*> a, uint64_t b, uint64_t e) {
  for (float* x : a)
    for (uint64_t i = b; i < e; ++i) x[i] = 0.5f * x[i] + 1.0f;
}

TEST(WorkJournal, AnOperationCutShortIsFinishedExactlyAfterItsTornUnitIsRolledBack) {
  Fixture f;
  ASSERT_GE(f.g.units, 8u);
  ASSERT_EQ(f.g.units, (kElems + f.g.unit - 1) / f.g.unit);
  std::vector<std::vector<float>> want = f.arrays;
  Step({want[0].data(), want[1].data(), want[2].data()}, 0, kElems);

  ASSERT_TRUE(f.journal.Begin(7, JournalOp::kUpdate, "plan bytes").ok());
  // The even units done, then unit 3 cut short half way (the exception stands for the crash).
  f.journal.Run(kElems, f.ptrs(), [&](uint64_t b, uint64_t e) { Step(f.ptrs(), b, e); },
                [](uint64_t u) { return u % 2 == 1; });
  const uint64_t torn = 3;
  EXPECT_THROW(f.journal.Run(kElems, f.ptrs(),
                             [&](uint64_t b, uint64_t e) {
                               Step(f.ptrs(), b, b + (e - b) / 2);
                               throw std::runtime_error("killed");
                             },
                             [&](uint64_t u) { return u != torn; }),
               std::runtime_error);
  EXPECT_EQ(f.journal.done_units(), (f.g.units + 1) / 2);
  EXPECT_FALSE(f.journal.done(torn));
  EXPECT_TRUE(f.journal.done(2));

  absl::StatusOr<JournalEntry> entry = f.journal.Entry();
  ASSERT_TRUE(entry.ok()) << entry.status();
  EXPECT_EQ(entry->commit_sequence, 7u);
  EXPECT_EQ(entry->kind, JournalOp::kUpdate);
  EXPECT_EQ(entry->plan, "plan bytes");

  // Without the roll-back the torn unit's first half would take the step twice.
  Fixture copy = f;
  WorkJournal copied(reinterpret_cast<uint8_t*>(copy.memory.data()), copy.g);
  copied.Run(kElems, copy.ptrs(), [&](uint64_t b, uint64_t e) { Step(copy.ptrs(), b, e); });
  EXPECT_FALSE(copy.arrays == want) << "the test cannot tell a missing roll-back";

  ASSERT_TRUE(f.journal.RollBackTorn(kElems, f.ptrs()).ok());
  f.journal.Run(kElems, f.ptrs(), [&](uint64_t b, uint64_t e) { Step(f.ptrs(), b, e); });
  EXPECT_EQ(f.journal.done_units(), f.g.units);
  for (int a = 0; a < 3; ++a) EXPECT_TRUE(f.arrays[a] == want[a]) << "array " << a;
}

TEST(WorkJournal, EntriesThatDoNotCheckOutAreRefused) {
  Fixture f;
  EXPECT_TRUE(f.journal.CheckHeader().ok());
  // Never begun: the formatted entry is zeros with no checksum.
  EXPECT_EQ(f.journal.Entry().status().code(), absl::StatusCode::kDataLoss);
  ASSERT_TRUE(f.journal.Begin(9, JournalOp::kPush, std::string(100, 'x')).ok());
  ASSERT_TRUE(f.journal.Entry().ok());
  // A plan byte changed: the checksum fails.
  reinterpret_cast<uint8_t*>(f.memory.data())[32 + 16 + 5] ^= 1;
  EXPECT_EQ(f.journal.Entry().status().code(), absl::StatusCode::kDataLoss);
  // A plan larger than the room: refused, and the old entry is no longer valid.
  EXPECT_EQ(f.journal.Begin(10, JournalOp::kPush, std::string(f.g.plan_capacity + 1, 'y')).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(f.journal.Entry().ok());
  // Another geometry's header.
  WorkJournal other(reinterpret_cast<uint8_t*>(f.memory.data()), JournalGeometryFor(kElems / 2, 3));
  EXPECT_EQ(other.CheckHeader().code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace stallfree
