// The ZenFlow engine's schedule: what kind of step each step t = 1, 2, ... is, as pure functions
// of t and the configuration (engine/zenflow.h: "Warm-up", the round boundaries, reselection,
// "Bounded staleness"). The engine asks it and never works a boundary out itself; what is in
// flight (the pending Update, the prefetch, the slots' owners) stays the engine's, apart from
// these rules. Its unit test (tests/engine/schedule_test.cc) states the rules by example.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "engine/zenflow.h"

namespace stallfree {

// The automatic round (update_interval 0, "auto"): the rounds start at length 1; at each
// reselection boundary from the warm-up's last step on (Decides), the engine measures the
// caller's compute per step C, the daemon's time per Update U and the stall per step since the
// last decision, and Resize()s the rounds that follow to ChooseInterval's length. A length
// changes only there, so a round never straddles two lengths and a reselection period is always
// 4 whole rounds.
class Schedule {
 public:
  // `offloading`: the engine has a daemon to talk to (zenflow or sync-offload with something
  // offloaded); without one no step is a boundary.
  Schedule(const ZenFlowConfig& c, bool offloading)
      : mode_(c.mode),
        offloading_(offloading),
        auto_(c.update_interval == 0),
        S_(auto_ ? 1 : c.update_interval),
        W_(c.warmup_steps),
        base_(c.warmup_steps),
        select_(c.select_interval),
        land_lag_(c.land_lag),
        await_(c.await_updates),
        predict_(c.predict_cold) {}

  // Steps 1..W: S = 1 and awaited (exact AdamW on every column).
  bool Warm(int64_t t) const { return t <= W_; }
  // The round length that step t belongs to: 1 in the warm-up and in sync-offload, else S (the
  // length now: queried for the coming step, never for one before the last Resize).
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
    return offloading_ && (Interval(t) == 1 || (t - base_) % S_ == 0);
  }
  // Whether step t reselects the hot columns (at its end, from its scores): zenflow, a boundary
  // at or after the warm-up's last step, every select_interval (default 4 S) steps from there.
  bool Reselects(int64_t t) const {
    return mode_ == OffloadMode::kZenFlow && Boundary(t) && t >= std::max<int64_t>(W_, 1) &&
           (t - base_) % SelectInterval() == 0;
  }
  // The step at whose end the Update issued at boundary b lands in the cold columns: b itself
  // when awaited, else b + land_lag (by default S: the next boundary, which lands it before
  // issuing its own; an automatic round's land_lag is at most its length).
  int64_t Landing(int64_t b) const { return Awaits(b) ? b : b + LandLag(); }
  // Whether the Update issued at boundary b lands predicted one step ahead (predict_cold): a
  // round of one step not awaited. An awaited update lands as computed; a longer round's
  // prediction, a whole round's change ahead, measured worse (zenflow.h).
  bool Predicts(int64_t b) const { return predict_ && !Awaits(b) && Interval(b) == 1; }
  // The gradient slot step t writes (double buffered).
  static uint32_t GradSlot(int64_t t) { return static_cast<uint32_t>(t % 2); }

  // The automatic round. Whether the engine chooses the round length at the end of step t.
  bool Decides(int64_t t) const { return auto_ && Reselects(t); }
  // The rounds after step t (a Decides step) are `interval` steps long.
  void Resize(int64_t t, int64_t interval) {
    base_ = t;
    S_ = std::max<int64_t>(1, interval);
  }
  // The round length now, and the step the current length's rounds count from (the warm-up's
  // last step, or the last Resize): what a checkpoint of an automatic round keeps.
  int64_t interval() const { return S_; }
  int64_t base() const { return base_; }
  bool adaptive() const { return auto_; }

  // The shortest round whose Update hides behind the caller's compute: one round's Update
  // (update_s, the daemon's seconds) runs while the caller computes the round's S steps
  // (compute_s each), with a fifth spare: S = ceil(U / (0.8 C)). Where the caller stalled more
  // than 5% of its compute since the last choice (stall_s a step: what the figures miss, such
  // as pushes, or a CPU the daemon shares with the caller), *floor becomes one step more than
  // `current`, and no later choice goes below it (no see-saw between a length that stalls and
  // one that does not). In [max(1, *floor), max_interval]; without figures (compute_s or
  // update_s not > 0), `current`.
  static int64_t ChooseInterval(double update_s, double compute_s, double stall_s,
                                int64_t current, int64_t max_interval, int64_t* floor) {
    max_interval = std::max<int64_t>(1, max_interval);
    if (stall_s > 0.05 * compute_s && compute_s > 0)
      *floor = std::min(max_interval, std::max(*floor, current + 1));
    if (!(compute_s > 0) || !(update_s > 0)) return std::max(current, *floor);
    const double s = std::ceil(update_s / (0.8 * compute_s));
    const int64_t n = s >= static_cast<double>(max_interval) ? max_interval
                                                             : static_cast<int64_t>(s);
    return std::clamp<int64_t>(std::max(n, *floor), 1, max_interval);
  }

 private:
  int64_t SelectInterval() const { return select_ == 0 ? 4 * S_ : select_; }
  int64_t LandLag() const { return land_lag_ == 0 ? S_ : std::min(land_lag_, S_); }

  OffloadMode mode_;
  bool offloading_, auto_;
  int64_t S_, W_, base_, select_, land_lag_;
  bool await_, predict_;
};

}  // namespace stallfree
