// How the parallel tests start their workers (model_test, tsp_test, tpsp_test, tpcp_test): the
// launch options they share, and the expectation that every rank of a run exited 0 (for D = 1,
// 2 and 4 ranks, or any one launch).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "parallel/launcher.h"

namespace stallfree {
namespace testing {

// The environment that keeps OpenBLAS and OpenMP to one thread a rank.
inline const std::vector<std::pair<std::string, std::string>> kOneBlasThread = {
    {"OPENBLAS_NUM_THREADS", "1"}, {"OMP_NUM_THREADS", "1"}};

// `nproc` ranks of argv (argv[0] relative to the runfiles directory) on `store`, a grace of 10 s
// and a timeout of 60 s, every operation bounded by 20 s (STALLFREE_COMM_TIMEOUT_MS), and `env`
// besides.
parallel::LaunchOptions WorkerLaunch(int nproc, std::vector<std::string> argv,
                                     parallel::LaunchOptions::Store store,
                                     const std::vector<std::pair<std::string, std::string>>& env = {});

// Launches o (LaunchLocal) and expects every rank to have exited 0; `what` names the run in the
// failures. A launch that fails is fatal: call it in ASSERT_NO_FATAL_FAILURE.
void LaunchAndExpectEveryRankOk(const parallel::LaunchOptions& o, const std::string& what);

// Runs `worker` (relative to the runfiles directory) as D = 1, 2 and 4 ranks in turn
// (WorkerLaunch) and expects every rank of each run to exit 0, "D=<D>" naming the run in the
// failures. A launch that fails is fatal and ends the runs: call it in ASSERT_NO_FATAL_FAILURE.
void ExpectWorkerPassesWithOneTwoAndFourRanks(
    const std::string& worker, parallel::LaunchOptions::Store store,
    const std::vector<std::pair<std::string, std::string>>& env = {});

}  // namespace testing
}  // namespace stallfree
