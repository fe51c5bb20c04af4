// The ZenFlow engine's schedule: what kind of step each step t = 1, 2, ... is, as pure functions
// of t and the configuration (engine/zenflow.h: "Warm-up", the round boundaries, reselection,
// "Bounded staleness"). The engine asks it and never works a boundary out itself; what is in
// flight (the pending Update, the prefetch, the slots' owners) stays the engine's, apart from
// these rules. Its unit test (tests/engine/schedule_test.cc) states the rules by example.
#pragma once

#include <algorithm>
#include <cstdint>

#include "engine/zenflow.h"

namespace stallfree {

class Schedule {
 public:
  // `offloading`: the engine has a daemon to talk to (zenflow or sync-offload with something
  // offloaded); without one no step is a boundary.
  Schedule(const ZenFlowConfig& c, bool offloading)
      : mode_(c.mode),
        offloading_(offloading),
        S_(c.update_interval),
        W_(c.warmup_steps),
        select_(c.EffectiveSelectInterval()),
        lag_(c.land_lag == 0 ? c.update_interval : c.land_lag),
        await_(c.await_updates) {}

  // Steps 1..W: S = 1 and awaited (exact AdamW on every column).
  bool Warm(int64_t t) const { return t <= W_; }
  // The round length that step t belongs to: 1 in the warm-up and in sync-offload, else S.
  int64_t Interval(int64_t t) const {
    return Warm(t) || mode_ == OffloadMode::kSyncOffload ? 1 : S_;
  }
  // Whether step t's own Update is waited for at its end (no staleness): with await_updates,
  // in the warm-up and in sync-offload.
  bool Awaits(int64_t t) const {
    return await_ || Warm(t) || mode_ == OffloadMode::kSyncOffload;
  }
  // Whether step t ends a round: its last push is folded into the daemon's Update.
  bool Boundary(int64_t t) const {
    return offloading_ && (Interval(t) == 1 || (t - W_) % S_ == 0);
  }
  // Whether step t reselects the hot columns (at its end, from its scores): zenflow, a boundary
  // at or after the warm-up's last step, every select_interval steps from there.
  bool Reselects(int64_t t) const {
    return mode_ == OffloadMode::kZenFlow && Boundary(t) && t >= std::max<int64_t>(W_, 1) &&
           (t - W_) % select_ == 0;
  }
  // The step at whose end the Update issued at boundary b lands in the cold columns: b itself
  // when awaited, else b + land_lag (by default S: the next boundary, which lands it before
  // issuing its own).
  int64_t Landing(int64_t b) const { return Awaits(b) ? b : b + lag_; }
  // The gradient slot step t writes (double buffered).
  static uint32_t GradSlot(int64_t t) { return static_cast<uint32_t>(t % 2); }

 private:
  OffloadMode mode_;
  bool offloading_;
  int64_t S_, W_, select_, lag_;
  bool await_;
};

}  // namespace stallfree
