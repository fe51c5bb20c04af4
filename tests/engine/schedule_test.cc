// engine/schedule.h by example: the steps of each kind written out for a few configurations,
// from the rules as zenflow.h states them, not computed by the same formulas.
#include "engine/schedule.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace stallfree {
namespace {

ZenFlowConfig Zen(int64_t S, int64_t W, int64_t select = 0, int64_t lag = 0) {
  ZenFlowConfig c;
  c.mode = OffloadMode::kZenFlow;
  c.update_interval = S;
  c.warmup_steps = W;
  c.select_interval = select;
  c.land_lag = lag;
  return c;
}

template <typename F>
std::vector<int64_t> StepsWhere(int64_t last, F f) {
  std::vector<int64_t> out;
  for (int64_t t = 1; t <= last; ++t)
    if (f(t)) out.push_back(t);
  return out;
}

using V = std::vector<int64_t>;

TEST(Schedule, WarmUpThenRoundsOfS) {
  const Schedule s(Zen(4, 3), /*offloading=*/true);
  EXPECT_EQ(StepsWhere(20, [&](int64_t t) { return s.Warm(t); }), (V{1, 2, 3}));
  EXPECT_EQ(StepsWhere(20, [&](int64_t t) { return s.Boundary(t); }),
            (V{1, 2, 3, 7, 11, 15, 19}));
  EXPECT_EQ(StepsWhere(20, [&](int64_t t) { return s.Awaits(t); }), (V{1, 2, 3}));
  EXPECT_EQ(s.Interval(3), 1);
  EXPECT_EQ(s.Interval(4), 4);
  // Reselection: the warm-up's last step, then every 4 S = 16 steps.
  EXPECT_EQ(StepsWhere(40, [&](int64_t t) { return s.Reselects(t); }), (V{3, 19, 35}));
  // By default a round's update lands at the next boundary; an awaited one at its own.
  EXPECT_EQ(s.Landing(2), 2);
  EXPECT_EQ(s.Landing(7), 11);
  EXPECT_EQ(s.Landing(11), 15);
}

TEST(Schedule, LandLagLandsThatManyStepsAfterTheBoundary) {
  const Schedule one(Zen(4, 0, 8, 1), true), two(Zen(4, 0, 8, 2), true);
  EXPECT_EQ(StepsWhere(12, [&](int64_t t) { return one.Boundary(t); }), (V{4, 8, 12}));
  EXPECT_EQ(one.Landing(4), 5);
  EXPECT_EQ(two.Landing(4), 6);
  EXPECT_EQ(two.Landing(8), 10);
  EXPECT_EQ(StepsWhere(24, [&](int64_t t) { return one.Reselects(t); }), (V{8, 16, 24}));
  // No warm-up: selection at step 1 is the engine's first step, not a reselection.
  EXPECT_FALSE(one.Reselects(1));
}

TEST(Schedule, OneStepRoundsAreStaleUnlessAwaited) {
  const Schedule async(Zen(1, 2), true);
  EXPECT_EQ(StepsWhere(6, [&](int64_t t) { return async.Boundary(t); }), (V{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(StepsWhere(6, [&](int64_t t) { return async.Awaits(t); }), (V{1, 2}));
  EXPECT_EQ(async.Landing(3), 4);
  ZenFlowConfig c = Zen(4, 0);
  c.await_updates = true;
  const Schedule awaited(c, true);
  EXPECT_EQ(awaited.Landing(4), 4);
}

TEST(Schedule, SyncOffloadEveryStepAwaitedAndNoOffloadNever) {
  ZenFlowConfig c = Zen(4, 0);
  c.mode = OffloadMode::kSyncOffload;
  const Schedule sync(c, true);
  EXPECT_EQ(StepsWhere(5, [&](int64_t t) { return sync.Boundary(t) && sync.Awaits(t); }),
            (V{1, 2, 3, 4, 5}));
  EXPECT_EQ(sync.Interval(9), 1);
  EXPECT_EQ(StepsWhere(8, [&](int64_t t) { return sync.Reselects(t); }), V{});
  c.mode = OffloadMode::kNoOffload;
  const Schedule none(c, /*offloading=*/false);
  EXPECT_EQ(StepsWhere(8, [&](int64_t t) { return none.Boundary(t) || none.Reselects(t); }),
            V{});
}

TEST(Schedule, GradientSlotsAlternate) {
  EXPECT_EQ(Schedule::GradSlot(1), 1u);
  EXPECT_EQ(Schedule::GradSlot(2), 0u);
  EXPECT_EQ(Schedule::GradSlot(7), 1u);
}

}  // namespace
}  // namespace stallfree
