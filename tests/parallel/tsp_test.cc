// Runs tsp_worker as D = 1, 2, 4 real processes over Gloo through LaunchLocal: the TSP block's
// forward and backward on every rank's zigzag shard against the single-rank reference.
#include <chrono>
#include <string>

#include "gtest/gtest.h"
#include "parallel/launcher.h"
#include "tests/parallel/worker_launch.h"

namespace stallfree {
namespace parallel {
namespace {

constexpr char kWorker[] = "tests/parallel/tsp_worker";  // relative to the runfiles cwd

TEST(TspTest, MatchesReferenceBlock) {
  ASSERT_NO_FATAL_FAILURE(testing::ExpectWorkerPassesWithOneTwoAndFourRanks(
      kWorker, LaunchOptions::Store::kFile, testing::kOneBlasThread));
}

// A rank that dies makes the others fail with a clear error within the communicator timeout:
// the survivors exit 7 ("saw UNAVAILABLE / DEADLINE_EXCEEDED"), nobody is killed by the
// launcher, and the whole run ends well within timeout + grace.
TEST(TspTest, DeadRankFailsTheOthersWithinTheTimeout) {
  LaunchOptions o;
  o.nproc = 4;
  o.argv = {kWorker};
  o.store = LaunchOptions::Store::kFile;
  o.grace = std::chrono::seconds(20);
  o.timeout = std::chrono::seconds(60);
  o.env = {{"STALLFREE_COMM_TIMEOUT_MS", "5000"},
           {"STALLFREE_TEST_DIE_RANK", "2"},
           {"OPENBLAS_NUM_THREADS", "1"},
           {"OMP_NUM_THREADS", "1"}};
  const auto t0 = std::chrono::steady_clock::now();
  auto r = LaunchLocal(o);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_failed_rank, 2);
  for (size_t i = 0; i < r->ranks.size(); ++i) {
    EXPECT_EQ(r->ranks[i].exit_code, i == 2 ? 3 : 7) << "rank " << i;
  }
  EXPECT_LT(secs, 5.0 + 10.0) << "survivors took too long to notice";
}

}  // namespace
}  // namespace parallel
}  // namespace stallfree
