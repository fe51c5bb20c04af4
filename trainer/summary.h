// The end of a trainer run (rank 0): <out_dir>/summary.json (one JSON object: the run, its
// losses, where the step time went, traffic, the daemon's share, bytes per parameter),
// <out_dir>/train.png (trainer/plot.h) and the printed summary.
//
// Internal to the trainer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/client.h"
#include "engine/zenflow.h"

namespace stallfree {
namespace trainer {

// What a run did and measured, as its summary reports it.
struct RunTotals {
  // The run.
  std::string run_name, preset, out_dir, csv_path;
  OffloadMode mode = OffloadMode::kZenFlow;
  DType model_dtype = DType::kFp32;
  int D = 1, N = 1;
  int64_t B = 0, T = 0, steps = 0;
  int64_t start = 0, last_step = 0;  // the steps this process ran: start + 1 .. last_step
  int64_t params_total = 0;
  // Losses: every step's of this process, its first one, the last evaluation.
  std::vector<double> losses;
  double first_loss = 0, last_eval = 0;
  // Seconds summed over the `timed` steps (all but a first step that paid for setup).
  int64_t timed = 0;
  double step = 0, compute = 0, optimizer = 0, copies = 0, stall = 0;
  double dp_collectives = 0;  // seconds in the data-parallel collectives, over every step
  // Bytes moved between device and host over every rank and step; columns migrated; this
  // rank's reselections.
  double traffic = 0, migrated = 0;
  int64_t reselections = 0;
  // The engine's accounting of rank 0 (its buffers and the ones it was given) over the
  // elements it updates.
  DeviceFootprint footprint;
  int64_t engine_elements = 0;
  // The daemon: whether there was one, this run's sessions' registered elements and pinned
  // bytes (every rank's), and its GetStats (every session it held).
  bool daemon = false;
  double run_elements = 0, run_pinned = 0;
  v1::Stats daemon_stats;
};

// Draws the plot, writes summary.json (atomically) and prints the summary.
absl::Status WriteSummary(const RunTotals& t);

}  // namespace trainer
}  // namespace stallfree
