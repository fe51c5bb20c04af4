#include "tests/parallel/worker_launch.h"

#include <chrono>

#include <gtest/gtest.h>

namespace stallfree {
namespace testing {

parallel::LaunchOptions WorkerLaunch(int nproc, std::vector<std::string> argv,
                                     parallel::LaunchOptions::Store store,
                                     const std::vector<std::pair<std::string, std::string>>& env) {
  parallel::LaunchOptions o;
  o.nproc = nproc;
  o.argv = std::move(argv);
  o.store = store;
  o.grace = std::chrono::seconds(10);
  o.timeout = std::chrono::seconds(60);
  o.env = {{"STALLFREE_COMM_TIMEOUT_MS", "20000"}};
  o.env.insert(o.env.end(), env.begin(), env.end());
  return o;
}

void LaunchAndExpectEveryRankOk(const parallel::LaunchOptions& o, const std::string& what) {
  auto r = parallel::LaunchLocal(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->ok()) << what << ": first failed rank " << r->first_failed_rank << " timed out "
                       << r->timed_out;
  for (size_t i = 0; i < r->ranks.size(); ++i) {
    EXPECT_TRUE(r->ranks[i].ok()) << what << " rank " << i << " exit " << r->ranks[i].exit_code
                                  << " signal " << r->ranks[i].signal;
  }
}

void ExpectWorkerPassesWithOneTwoAndFourRanks(
    const std::string& worker, parallel::LaunchOptions::Store store,
    const std::vector<std::pair<std::string, std::string>>& env) {
  for (int d : {1, 2, 4}) {
    ASSERT_NO_FATAL_FAILURE(
        LaunchAndExpectEveryRankOk(WorkerLaunch(d, {worker}, store, env), "D=" + std::to_string(d)));
  }
}

}  // namespace testing
}  // namespace stallfree
