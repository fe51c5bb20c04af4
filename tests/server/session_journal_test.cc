// The work journal (server/session_journal.h) on its own: an operation cut short with units
// done, one unit half changed and the rest untouched is rolled back and run again to exactly
// the uninterrupted result; without the roll-back it is not; entries that do not check out are
// refused.
#include "server/session_journal.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/optimizer.h"

namespace stallfree {
namespace {

constexpr uint64_t kElems = 100000;  // not a multiple of the unit: a short last unit

struct Fixture {
  JournalGeometry g = JournalGeometryFor(kElems, 3, 3 * 64);
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

// An AdamW step of every element through the CPU kernels (what an Update's units run).
struct KernelStep {
  const kernels::OptimizerKernel& k;
  std::vector<float> grad;
  void operator()(std::vector<float*> a, uint64_t b, uint64_t e) const {
    kernels::AdamWConfig c;
    c.lr = 1e-2;
    c.weight_decay = 0.1;
    c.step = 3;
    k.AdamW(c, a[0] + b, a[1] + b, a[2] + b, grad.data() + b, kernels::GradType::kFp32,
            static_cast<int64_t>(e - b), nullptr);
  }
};

// Random gradients for `step` and m, v >= 0 in `f`; returns the arrays after one step.
std::vector<std::vector<float>> PrepareKernelCase(uint32_t seed, Fixture* f, KernelStep* step) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  step->grad.resize(kElems);
  for (float& x : step->grad) x = normal(rng);
  for (float& x : f->arrays[2]) x = x * x;
  std::vector<std::vector<float>> want = f->arrays;
  (*step)({want[0].data(), want[1].data(), want[2].data()}, 0, kElems);
  return want;
}

// Bit for bit, naming the first element that differs.
void ExpectArrays(const Fixture& f, const std::vector<std::vector<float>>& want) {
  for (int a = 0; a < 3; ++a) {
    size_t first = 0;
    while (first < kElems && f.arrays[a][first] == want[a][first]) ++first;
    EXPECT_EQ(first, kElems) << "array " << a << " differs from element " << first << " (unit "
                             << first / f.g.unit << ")";
  }
}

// Runs `step` over the units of `f` in the kernels' pass, with unit `torn` cut short: its work
// runs over [b, b + cut) and dies inside its last vector, whose last 3 elements it leaves
// garbage (with vectors of 8 or 16 elements from the unit's start, the cuts below end with
// tails of 5 or more).
void CutShortInTheKernels(Fixture& f, const KernelStep& step, uint64_t torn, uint64_t cut,
                          WorkJournal::Saving saving) {
  EXPECT_THROW(
      f.journal.Run(
          kElems, f.ptrs(),
          [&](uint64_t b, uint64_t e) {
            const uint64_t end = std::min(e, torn * f.g.unit + cut);
            step(f.ptrs(), b, end);
            for (float* a : f.ptrs())
              for (uint64_t i = end - 3; i < end; ++i) a[i] = 1e30f;
            throw std::runtime_error("killed");
          },
          [&](uint64_t u) { return u != torn; }, saving),
      std::runtime_error);
}

TEST(WorkJournal, AnUpdateCutShortInsideTheKernelsPassGoesOnFromWhereItStopped) {
  const kernels::OptimizerKernel& k = kernels::DefaultCpuKernel();
  ASSERT_TRUE(k.KeepsUndoLog()) << k.name();
  if (std::string(k.name()) == "scalar") GTEST_SKIP() << "vectors of one element";
  Fixture f;
  KernelStep step{k, {}};
  const std::vector<std::vector<float>> want = PrepareKernelCase(5, &f, &step);
  const std::vector<std::vector<float>> before = f.arrays;
  const auto in_kernels = WorkJournal::Saving::kInKernels;

  ASSERT_TRUE(f.journal.Begin(8, JournalOp::kUpdate, "").ok());
  f.journal.Run(kElems, f.ptrs(), [&](uint64_t b, uint64_t e) { step(f.ptrs(), b, e); },
                [](uint64_t u) { return u % 2 == 1; }, in_kernels);
  const uint64_t torn = 5, cut = 301;  // not a multiple of any vector width
  CutShortInTheKernels(f, step, torn, cut, in_kernels);
  EXPECT_FALSE(f.journal.done(torn));

  // Run again from the unit's start after putting the window back, the elements before it would
  // take the step twice; without putting it back, the garbage stays.
  {
    Fixture copy = f;
    WorkJournal copied(reinterpret_cast<uint8_t*>(copy.memory.data()), copy.g);
    copied.Run(kElems, copy.ptrs(), [&](uint64_t b, uint64_t e) { step(copy.ptrs(), b, e); },
               nullptr, in_kernels);
    EXPECT_FALSE(copy.arrays == want) << "the test cannot tell a missing roll-back";
  }
  {
    Fixture copy = f;
    WorkJournal copied(reinterpret_cast<uint8_t*>(copy.memory.data()), copy.g);
    ASSERT_TRUE(copied.RollBackTorn(kElems, copy.ptrs()).ok());
    WorkJournal fresh(reinterpret_cast<uint8_t*>(copy.memory.data()), copy.g);  // forgets where
    fresh.Run(kElems, copy.ptrs(), [&](uint64_t b, uint64_t e) { step(copy.ptrs(), b, e); },
              nullptr, in_kernels);
    EXPECT_FALSE(copy.arrays == want) << "the test cannot tell a unit run again from its start";
  }

  // Killed again while it goes on (a second daemon), then finished by a third, which runs the
  // oracle (no undo log: the unit is copied whole and goes on from where it stopped), killed
  // again, and finished.
  ASSERT_TRUE(f.journal.RollBackTorn(kElems, f.ptrs()).ok());
  CutShortInTheKernels(f, step, torn, cut + 200, in_kernels);
  ASSERT_TRUE(f.journal.RollBackTorn(kElems, f.ptrs()).ok());
  const KernelStep oracle{kernels::ReferenceKernel(), step.grad};
  ASSERT_FALSE(kernels::ReferenceKernel().KeepsUndoLog());
  CutShortInTheKernels(f, oracle, torn, cut + 400, WorkJournal::Saving::kCopyFirst);
  ASSERT_TRUE(f.journal.RollBackTorn(kElems, f.ptrs()).ok());
  f.journal.Run(kElems, f.ptrs(), [&](uint64_t b, uint64_t e) { step(f.ptrs(), b, e); },
                nullptr, in_kernels);
  EXPECT_EQ(f.journal.done_units(), f.g.units);
  ExpectArrays(f, want);
  EXPECT_FALSE(f.arrays == before);
}

// Consecutive units run as one span in the kernels' pass; a kill in a vector that crossed from
// one unit into the next (the work's kernel calls are 100 elements long, so vectors do not
// keep to the units) leaves the span's earlier units done, the unit it stopped in to go on
// from where it stopped, and the next unit's head as it was.
TEST(WorkJournal, ASpanCutShortInAVectorAcrossTwoUnitsIsFinishedExactly) {
  const kernels::OptimizerKernel& k = kernels::DefaultCpuKernel();
  if (std::string(k.name()) == "scalar") GTEST_SKIP() << "vectors of one element";
  Fixture f;
  KernelStep step{k, {}};
  const std::vector<std::vector<float>> want = PrepareKernelCase(6, &f, &step);
  // Pieces of 100 from the start of what the journal hands the work.
  auto pieces = [&](Fixture& x, uint64_t b, uint64_t e, uint64_t stop) {
    for (uint64_t at = b; at < std::min(e, stop); at += 100)
      step(x.ptrs(), at, std::min({e, stop, at + 100}));
    if (stop < e) {
      for (float* a : x.ptrs())
        for (uint64_t i = stop - 3; i < stop; ++i) a[i] = 1e30f;
      throw std::runtime_error("killed");
    }
  };
  const uint64_t unit = f.g.unit;
  ASSERT_EQ(unit % 100, 68u) << "the cut below assumes units of 768";
  // Unit 5 starts at 3840; the piece [3800, 3900) cut at 3845 ends with the vector
  // [3832, 3845) in flight, 8 elements of unit 4 and 5 of unit 5.
  const uint64_t stop = 5 * unit + 5;
  const auto in_kernels = WorkJournal::Saving::kInKernels;
  ASSERT_TRUE(f.journal.Begin(9, JournalOp::kUpdate, "").ok());
  EXPECT_THROW(f.journal.Run(kElems, f.ptrs(),
                             [&](uint64_t b, uint64_t e) { pieces(f, b, e, stop); },
                             [](uint64_t u) { return u >= 32; }, in_kernels),
               std::runtime_error);
  EXPECT_EQ(f.journal.done_units(), 0u) << "one span of 32 units, cut short";
  ASSERT_TRUE(f.journal.RollBackTorn(kElems, f.ptrs()).ok());
  EXPECT_EQ(f.journal.done_units(), 4u) << "the units before the one it stopped in";
  EXPECT_FALSE(f.journal.done(4));
  f.journal.Run(kElems, f.ptrs(), [&](uint64_t b, uint64_t e) { pieces(f, b, e, kElems); },
                nullptr, in_kernels);
  EXPECT_EQ(f.journal.done_units(), f.g.units);
  ExpectArrays(f, want);
}

// A handover's exchange (OffloadSession::ExchangeColumns) in the journal's pieces: staging cell
// c of three blocks swaps with element 13 c mod kElems of the three arrays. Killed again and
// again (an exception after a random number of cells: in a piece's save, its first phase or its
// second, on two workers, and inside the finishing of the pieces torn before), each time taken
// on by a new WorkJournal over the same memory (a new daemon) that finishes the torn pieces and
// runs the rest: the result is the swap, exactly. Rolling a torn piece back instead cannot give
// it: after its first phase the arrays' old values are only in the staging blocks.
TEST(WorkJournal, AnExchangeCutShortInEitherPhaseIsFinishedFromWhereItStopped) {
  Fixture f;
  const uint64_t cells = 20000, unit = f.g.unit, pieces = (cells + unit - 1) / unit;
  ASSERT_LE(pieces, f.g.units);
  std::vector<std::vector<float>> staging(3, std::vector<float>(cells));
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (auto& b : staging)
    for (float& x : b) x = normal(rng);
  auto at = [](uint64_t c) { return c * 13 % kElems; };  // distinct: 13 is prime to 10^5
  std::vector<std::vector<float>> want_arrays = f.arrays, want_staging = staging;
  for (int a = 0; a < 3; ++a)
    for (uint64_t c = 0; c < cells; ++c) std::swap(want_staging[a][c], want_arrays[a][at(c)]);

  std::atomic<int64_t> budget{-1};  // cells until the kill; < 0: none
  std::atomic<bool> killed{false};  // then every worker stops at its next cell
  std::atomic<int> phase_killed[3] = {0, 0, 0};
  auto tick = [&](int phase) {
    if (killed.load()) throw std::runtime_error("killed");
    if (budget.load() >= 0 && budget.fetch_sub(1) <= 0) {
      killed = true;
      phase_killed[phase].fetch_add(1);
      throw std::runtime_error("killed");
    }
  };
  WorkJournal::PhasedWork work;
  work.save = [&](uint64_t p, float* slot) {
    for (uint64_t c = p * unit; c < std::min(cells, p * unit + unit); ++c) {
      tick(0);
      for (int a = 0; a < 3; ++a) slot[a * unit + c - p * unit] = staging[a][c];
    }
  };
  work.first = [&](uint64_t p, const float*) {
    for (uint64_t c = p * unit; c < std::min(cells, p * unit + unit); ++c) {
      tick(1);
      for (int a = 0; a < 3; ++a) staging[a][c] = f.arrays[a][at(c)];
    }
  };
  work.second = [&](uint64_t p, const float* slot) {
    for (uint64_t c = p * unit; c < std::min(cells, p * unit + unit); ++c) {
      tick(2);
      for (int a = 0; a < 3; ++a) f.arrays[a][at(c)] = slot[a * unit + c - p * unit];
    }
  };
  ASSERT_TRUE(f.journal.Begin(9, JournalOp::kHandover, "plan").ok());
  int kills = 0, kills_finishing = 0;
  for (int run = 0;; ++run) {
    WorkJournal daemon(reinterpret_cast<uint8_t*>(f.memory.data()), f.g);
    // Every third kill soon after the start: inside the finishing of a torn piece, if any.
    const uint64_t within = kills % 3 == 2 ? unit / 2 : 3 * unit * 3;
    budget = kills < 16 ? static_cast<int64_t>(rng() % within) : -1;
    killed = false;
    bool finishing = run > 0;
    try {
      if (finishing) {
        ASSERT_TRUE(daemon.FinishTornPieces(pieces, work).ok());
      }
      finishing = false;
      daemon.RunPieces(pieces, work);
      if (budget.load() < 0 || daemon.done_units() == pieces) break;
    } catch (const std::runtime_error&) {
      ++kills;
      if (finishing) ++kills_finishing;
    }
  }
  EXPECT_EQ(kills, 16);
  EXPECT_GE(phase_killed[0].load(), 1) << "no kill in a save";
  EXPECT_GE(phase_killed[1].load(), 1) << "no kill in a first phase";
  EXPECT_GE(phase_killed[2].load(), 1) << "no kill in a second phase";
  EXPECT_GE(kills_finishing, 1) << "no kill while torn pieces were finished";
  EXPECT_TRUE(f.arrays == want_arrays) << "the arrays are not the exchange's";
  EXPECT_TRUE(staging == want_staging) << "the staging blocks are not the exchange's";
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
  WorkJournal other(reinterpret_cast<uint8_t*>(f.memory.data()),
                    JournalGeometryFor(kElems / 2, 3, 3 * 64));
  EXPECT_EQ(other.CheckHeader().code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace stallfree
