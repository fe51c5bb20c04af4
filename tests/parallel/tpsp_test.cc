// Runs tpsp_worker as D = 1, 2, 4 real processes through LaunchLocal (Gloo over loopback, TCP
// store): the Megatron TP+SP block's forward, backward and communication volume against the
// single-rank reference on every rank.
#include <string>

#include "gtest/gtest.h"
#include "parallel/launcher.h"
#include "tests/parallel/worker_launch.h"

namespace stallfree {
namespace parallel {
namespace {

TEST(TpspTest, MatchesReference) {
  ASSERT_NO_FATAL_FAILURE(testing::ExpectWorkerPassesWithOneTwoAndFourRanks(
      "tests/parallel/tpsp_worker", LaunchOptions::Store::kTcp));
}

}  // namespace
}  // namespace parallel
}  // namespace stallfree
