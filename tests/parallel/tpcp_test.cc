// Runs tpcp_worker through LaunchLocal (Gloo over loopback, file store shared by the TP and CP
// sub-groups) for (t, c) = (2, 2) with D = 4, and (1, 2), (2, 1) with D = 2: the TP x CP
// block's forward, backward and communication volume against the single-rank reference on every
// rank.
#include <chrono>
#include <string>
#include <utility>

#include "gtest/gtest.h"
#include "parallel/launcher.h"

namespace stallfree {
namespace parallel {
namespace {

constexpr char kWorker[] = "tests/parallel/tpcp_worker";  // relative to the runfiles cwd

TEST(TpcpTest, MatchesReference) {
  for (const std::pair<int, int>& tc :
       {std::pair<int, int>{2, 2}, std::pair<int, int>{1, 2}, std::pair<int, int>{2, 1}}) {
    const int t = tc.first, c = tc.second;
    LaunchOptions o;
    o.nproc = t * c;
    o.argv = {kWorker, std::to_string(t)};
    o.store = LaunchOptions::Store::kFile;
    o.grace = std::chrono::seconds(10);
    o.timeout = std::chrono::seconds(60);
    o.env = {{"STALLFREE_COMM_TIMEOUT_MS", "20000"}};
    auto r = LaunchLocal(o);
    ASSERT_TRUE(r.ok()) << r.status();
    const std::string what = "t=" + std::to_string(t) + " c=" + std::to_string(c);
    EXPECT_TRUE(r->ok()) << what << ": first failed rank " << r->first_failed_rank << " timed out "
                         << r->timed_out;
    for (size_t i = 0; i < r->ranks.size(); ++i) {
      EXPECT_TRUE(r->ranks[i].ok()) << what << " rank " << i << " exit " << r->ranks[i].exit_code
                                    << " signal " << r->ranks[i].signal;
    }
  }
}

}  // namespace
}  // namespace parallel
}  // namespace stallfree
