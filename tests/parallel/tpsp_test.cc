// Runs tpsp_worker as D = 1, 2, 4 real processes through LaunchLocal (Gloo over loopback, TCP
// store): the Megatron TP+SP block's forward, backward and communication volume against the
// single-rank reference on every rank.
#include <chrono>
#include <string>

#include "gtest/gtest.h"
#include "parallel/launcher.h"

namespace stallfree {
namespace parallel {
namespace {

constexpr char kWorker[] = "tests/parallel/tpsp_worker";  // relative to the runfiles cwd

TEST(TpspTest, MatchesReference) {
  for (int d : {1, 2, 4}) {
    LaunchOptions o;
    o.nproc = d;
    o.argv = {kWorker};
    o.store = LaunchOptions::Store::kTcp;
    o.grace = std::chrono::seconds(10);
    o.timeout = std::chrono::seconds(60);
    o.env = {{"STALLFREE_COMM_TIMEOUT_MS", "20000"}};
    auto r = LaunchLocal(o);
    ASSERT_TRUE(r.ok()) << r.status();
    const std::string what = "D=" + std::to_string(d);
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
