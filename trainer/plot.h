// Plots and comparisons of training runs, from the trainer's metrics CSV files: the loss
// (training, and evaluation points) against the step for each run, each run's mean step time
// split into compute, optimizer, copies and stall, and optionally a third panel of modeled
// device step times (bench/offload_modeled_bench's FIGURE lines), labelled as modeled. Drawn as
// a PNG by gnuplot (Debian's gnuplot-nox). `make demo` draws its plot and prints its comparison
// with these (trainer/compare_runs.cc).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace stallfree {
namespace trainer {

// One run's figures, read back from its metrics.csv as the trainer's summary derives them.
struct RunFigures {
  std::string label;
  int64_t steps = 0;      // rows of the file
  double first_loss = 0;  // the first step's train loss
  double final_loss = 0;  // the mean train loss of the last min(10, steps) steps
  double final_eval = 0;  // the last evaluation's loss (NaN if the run never evaluated)
  // The largest rise of the train loss from one step to the next (a spike; 0 if it never
  // rose), the step it rose at and that step's gradient norm before clipping (NaN if the file
  // has none).
  double max_loss_rise = 0;
  int64_t max_loss_rise_step = 0;
  double max_loss_rise_grad_norm = 0;
  // Mean seconds per step over the rows after the first (which pays the setup); the first row
  // alone when there is one. step_s is the whole step; the others are parts of it.
  double step_s = 0, compute_s = 0, optimizer_s = 0, copies_s = 0, stall_s = 0;
};

// NotFound for a missing file, InvalidArgument for one without the trainer's columns or rows.
absl::StatusOr<RunFigures> ReadRunFigures(const std::string& label, const std::string& csv);

// A run's final train loss, the summary's and the comparison's: the mean of the last
// min(10, n) of its n losses (NaN for none); *tail, if given, gets that count.
double FinalTrainLoss(const std::vector<double>& losses, int64_t* tail = nullptr);

// A mode's step time on a modeled device (not measured on one): seconds per step, the stall
// being part of it.
struct ModeledStep {
  std::string label;
  double step_s = 0, stall_s = 0;
};

// The three modes' modeled step times from bench/offload_modeled_bench's output (its FIGURE
// lines nooffload_step_modeled, sync_offload_step_modeled, zenflow_step_modeled in ms, and the
// offload modes' *_stall_per_step_modeled), in that order. InvalidArgument when a step figure
// is missing.
absl::StatusOr<std::vector<ModeledStep>> ParseModeledFigures(const std::string& text);

struct PlotOptions {
  std::string title;
  std::vector<std::pair<std::string, std::string>> runs;  // (label, metrics.csv path)
  // Vertical lines on the loss panels: (step, label; "\n" breaks it), e.g. the end of
  // ZenFlow's exact warm-up.
  std::vector<std::pair<double, std::string>> step_marks;
  // > 0: a second loss panel from this step on (its own y range), where runs that differ late
  // show it.
  double zoom_from = 0;
  // Non-empty: a panel of these modeled step times (ms), titled modeled_title, which
  // should say what was modeled; the panel's own title says "MODELED".
  std::vector<ModeledStep> modeled;
  std::string modeled_title;
};

// Writes png, and beside it png + ".gp" (the gnuplot script), png + ".breakdown.dat" (the mean
// measured times; the first step, which pays the setup, is left out) and, with modeled figures,
// png + ".modeled.dat". The i-th run's loss curve is solid, dashed, dotted... so that runs on
// top of each other stay visible. Four panels (zoom and modeled) make a 2 x 2 grid.
// FailedPrecondition if gnuplot is not installed; NotFound for a missing CSV.
absl::Status WritePlot(const std::string& png, const PlotOptions& options);

// WritePlot with runs and a title only.
absl::Status WritePlot(const std::string& png,
                       const std::vector<std::pair<std::string, std::string>>& runs,
                       const std::string& title);

// A short text comparison: per run the train loss (first -> final), eval loss, largest
// gradient norm and mean step time with its parts; then each other run against the one
// labelled `baseline` (final loss, eval loss and step time ratios) and zenflow against
// sync-offload's step when both are there; then the modeled step times, if any, with their
// ratios, marked as modeled. Runs or figures that are missing are left out, not invented.
std::string CompareRuns(const std::vector<RunFigures>& runs, const std::string& baseline,
                        const std::vector<ModeledStep>& modeled, const std::string& modeled_what);

}  // namespace trainer
}  // namespace stallfree
