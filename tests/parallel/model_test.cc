// Runs model_worker as D = 1, 2, 4 real processes over Gloo through LaunchLocal: a 2-layer
// model's loss and gradients in the TSP and TP+SP layouts (DistributedModel) against the
// single-rank ReferenceModel, with and without learned positions and a tied head; and the
// model's view form (backend memory, here CpuOps) bit-identical to its vector form.
#include <string>

#include "gtest/gtest.h"
#include "parallel/launcher.h"
#include "tests/parallel/worker_launch.h"

namespace stallfree {
namespace parallel {
namespace {

TEST(ModelTest, MatchesReferenceModel) {
  ASSERT_NO_FATAL_FAILURE(testing::ExpectWorkerPassesWithOneTwoAndFourRanks(
      "tests/parallel/model_worker", LaunchOptions::Store::kFile, testing::kOneBlasThread));
}

}  // namespace
}  // namespace parallel
}  // namespace stallfree
