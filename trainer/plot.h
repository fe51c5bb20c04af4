// Plots of training runs: loss (training, and evaluation points) against the step for each run,
// and each run's mean step time split into compute, optimizer, copies and stall. Drawn as a PNG
// by gnuplot (Debian's gnuplot-nox) from the trainer's metrics CSV files.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace stallfree {
namespace trainer {

// runs: (label, metrics.csv path). Writes png, and beside it png + ".gp" (the gnuplot script)
// and png + ".breakdown.dat" (the mean times; the first step, which pays the setup, is left
// out). FailedPrecondition if gnuplot is not installed; NotFound for a missing CSV.
absl::Status WritePlot(const std::string& png,
                       const std::vector<std::pair<std::string, std::string>>& runs,
                       const std::string& title);

}  // namespace trainer
}  // namespace stallfree
