// Runs model_worker as D = 1, 2, 4 real processes over Gloo through LaunchLocal: a 2-layer
// model's loss and gradients in the TSP and TP+SP layouts (DistributedModel) against the
// single-rank ReferenceModel, with and without learned positions and a tied head; and the
// model's view form (backend memory, here CpuOps) bit-identical to its vector form.
#include <chrono>
#include <string>

#include "gtest/gtest.h"
#include "parallel/launcher.h"

namespace stallfree {
namespace parallel {
namespace {

constexpr char kWorker[] = "tests/parallel/model_worker";  // relative to the runfiles cwd

TEST(ModelTest, MatchesReferenceModel) {
  for (int d : {1, 2, 4}) {
    LaunchOptions o;
    o.nproc = d;
    o.argv = {kWorker};
    o.store = LaunchOptions::Store::kFile;
    o.grace = std::chrono::seconds(10);
    o.timeout = std::chrono::seconds(60);
    o.env = {{"STALLFREE_COMM_TIMEOUT_MS", "20000"},
             {"OPENBLAS_NUM_THREADS", "1"},
             {"OMP_NUM_THREADS", "1"}};
    auto r = LaunchLocal(o);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->ok()) << "D=" << d << ": first failed rank " << r->first_failed_rank
                         << " timed out " << r->timed_out;
    for (size_t i = 0; i < r->ranks.size(); ++i) {
      EXPECT_TRUE(r->ranks[i].ok()) << "D=" << d << " rank " << i << " exit "
                                    << r->ranks[i].exit_code << " signal " << r->ranks[i].signal;
    }
  }
}

}  // namespace
}  // namespace parallel
}  // namespace stallfree
