// Runs tpcp_worker through LaunchLocal (Gloo over loopback, file store shared by the TP and CP
// sub-groups) for (t, c) = (2, 2) with D = 4, and (1, 2), (2, 1) with D = 2: the TP x CP
// block's forward, backward and communication volume against the single-rank reference on every
// rank.
#include <string>
#include <utility>

#include "gtest/gtest.h"
#include "parallel/launcher.h"
#include "tests/parallel/worker_launch.h"

namespace stallfree {
namespace parallel {
namespace {

constexpr char kWorker[] = "tests/parallel/tpcp_worker";  // relative to the runfiles cwd

TEST(TpcpTest, MatchesReference) {
  for (const std::pair<int, int>& tc :
       {std::pair<int, int>{2, 2}, std::pair<int, int>{1, 2}, std::pair<int, int>{2, 1}}) {
    const int t = tc.first, c = tc.second;
    ASSERT_NO_FATAL_FAILURE(testing::LaunchAndExpectEveryRankOk(
        testing::WorkerLaunch(t * c, {kWorker, std::to_string(t)}, LaunchOptions::Store::kFile),
        "t=" + std::to_string(t) + " c=" + std::to_string(c)));
  }
}

}  // namespace
}  // namespace parallel
}  // namespace stallfree
