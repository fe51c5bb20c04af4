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

TEST(Schedule, AutomaticRoundsStartAtOneAndChangeOnlyWhereTheyAreResized) {
  ZenFlowConfig c = Zen(0, 2);  // update_interval auto, W = 2
  Schedule s(c, true);
  EXPECT_TRUE(s.adaptive());
  EXPECT_EQ(s.interval(), 1);
  // Before any choice: rounds of 1, stale by one step; reselection every 4 rounds from W.
  EXPECT_EQ(StepsWhere(6, [&](int64_t t) { return s.Boundary(t); }), (V{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(StepsWhere(10, [&](int64_t t) { return s.Decides(t); }), (V{2, 6, 10}));
  EXPECT_EQ(s.Landing(3), 4);
  // Chosen at the end of step 6: rounds of 3 from step 7 (boundaries 9, 12, ...), landing
  // at the next boundary, reselection (and the next choice) 4 rounds later.
  s.Resize(6, 3);
  EXPECT_EQ(s.Landing(6), 9);  // the Update issued at 6 lands with the new length
  EXPECT_EQ(s.Interval(7), 3);
  EXPECT_EQ(StepsWhere(30, [&](int64_t t) { return t > 6 && s.Boundary(t); }),
            (V{9, 12, 15, 18, 21, 24, 27, 30}));
  EXPECT_EQ(StepsWhere(30, [&](int64_t t) { return t > 6 && s.Decides(t); }), (V{18, 30}));
  EXPECT_EQ(s.base(), 6);
  // Back to 2 at 18: boundaries 20, 22, ...
  s.Resize(18, 2);
  EXPECT_EQ(StepsWhere(26, [&](int64_t t) { return t > 18 && s.Boundary(t); }),
            (V{20, 22, 24, 26}));
  // A fixed update_interval never decides.
  const Schedule fixed(Zen(4, 2), true);
  EXPECT_EQ(StepsWhere(40, [&](int64_t t) { return fixed.Decides(t); }), V{});
}

TEST(Schedule, AutomaticLandLagIsAtMostTheRound) {
  Schedule s(Zen(0, 0, 0, 2), true);  // land_lag 2
  EXPECT_EQ(s.Landing(3), 4);         // rounds of 1: at most 1 step
  s.Resize(4, 4);
  EXPECT_EQ(s.Landing(8), 10);
}

TEST(Schedule, OnlyRoundsOfOneStepNotAwaitedArePredicted) {
  ZenFlowConfig c = Zen(0, 2);
  c.predict_cold = true;
  Schedule s(c, true);
  EXPECT_EQ(StepsWhere(6, [&](int64_t t) { return s.Predicts(t); }), (V{3, 4, 5, 6}));
  s.Resize(6, 2);  // rounds of 2 from step 7: not predicted
  EXPECT_EQ(StepsWhere(10, [&](int64_t t) { return t > 6 && s.Predicts(t); }), V{});
  c.predict_cold = false;
  EXPECT_EQ(StepsWhere(6, [&](int64_t t) { return Schedule(c, true).Predicts(t); }), V{});
  ZenFlowConfig awaited = Zen(1, 0);
  awaited.await_updates = true;
  EXPECT_EQ(StepsWhere(4, [&](int64_t t) { return Schedule(awaited, true).Predicts(t); }), V{});
}

TEST(Schedule, ChooseIntervalHidesTheUpdateBehindTheRoundsCompute) {
  int64_t floor = 1;
  // U = 10 ms, C = 20 ms: one step hides it (10 <= 0.8 x 20).
  EXPECT_EQ(Schedule::ChooseInterval(0.010, 0.020, 0, 1, 4, &floor), 1);
  // U = 20 ms, C = 20 ms: 20 > 16, two steps (32 ms) do.
  EXPECT_EQ(Schedule::ChooseInterval(0.020, 0.020, 0, 1, 4, &floor), 2);
  // U = 50 ms: ceil(50 / 16) = 4; U = 500 ms: clamped to the bound.
  EXPECT_EQ(Schedule::ChooseInterval(0.050, 0.020, 0, 1, 4, &floor), 4);
  EXPECT_EQ(Schedule::ChooseInterval(0.500, 0.020, 0, 1, 4, &floor), 4);
  EXPECT_EQ(Schedule::ChooseInterval(0.500, 0.020, 0, 1, 8, &floor), 8);
  EXPECT_EQ(floor, 1);
  // No figures: the length stays.
  EXPECT_EQ(Schedule::ChooseInterval(0, 0.020, 0, 3, 4, &floor), 3);
  EXPECT_EQ(Schedule::ChooseInterval(0.010, 0, 0, 2, 4, &floor), 2);
  // A stall above 5% of the compute raises the floor past the current length, for good:
  // 2 ms of 20 stalled at S = 1 gives 2, and a later window that would choose 1 keeps 2.
  EXPECT_EQ(Schedule::ChooseInterval(0.010, 0.020, 0.002, 1, 4, &floor), 2);
  EXPECT_EQ(floor, 2);
  EXPECT_EQ(Schedule::ChooseInterval(0.010, 0.020, 0, 2, 4, &floor), 2);
  // 0.9 ms of 20 (4.5%) is no stall.
  int64_t f2 = 1;
  EXPECT_EQ(Schedule::ChooseInterval(0.010, 0.020, 0.0009, 1, 4, &f2), 1);
  // The floor never passes the bound.
  int64_t f3 = 4;
  EXPECT_EQ(Schedule::ChooseInterval(0.010, 0.020, 0.010, 4, 4, &f3), 4);
  EXPECT_EQ(f3, 4);
}

}  // namespace
}  // namespace stallfree
