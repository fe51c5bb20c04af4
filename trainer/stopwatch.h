// Wall-clock seconds for the trainer's timings (the step, its compute, the data-parallel
// collectives): steady_clock, so a clock adjustment never shows as a slow step.
//
// Internal to the trainer.
#pragma once

#include <chrono>

namespace stallfree {
namespace trainer {

using Clock = std::chrono::steady_clock;

// Seconds from t0 to now.
inline double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace trainer
}  // namespace stallfree
