// Runs comm_worker as D real processes through LaunchLocal: every collective checked on every
// rank (file store and TCP store, D = 1, 2, 4), groups split from one world, a dead peer detected by the survivors, a silent
// peer reported as DEADLINE_EXCEEDED, and an unreachable TCP store.
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "parallel/launcher.h"

namespace stallfree {
namespace parallel {
namespace {

constexpr char kWorker[] = "tests/parallel/comm_worker";  // relative to the runfiles cwd

LaunchOptions Options(int d, LaunchOptions::Store store, std::vector<std::string> args = {}) {
  LaunchOptions o;
  o.nproc = d;
  o.argv = {kWorker};
  for (auto& a : args) o.argv.push_back(a);
  o.store = store;
  o.grace = std::chrono::seconds(20);
  o.timeout = std::chrono::seconds(60);
  o.env = {{"STALLFREE_COMM_TIMEOUT_MS", "20000"}};
  return o;
}

void ExpectAllOk(const LaunchResult& r, const std::string& what) {
  EXPECT_TRUE(r.ok()) << what << ": first failed rank " << r.first_failed_rank << " timed out "
                      << r.timed_out;
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    EXPECT_TRUE(r.ranks[i].ok()) << what << " rank " << i << " exit " << r.ranks[i].exit_code
                                 << " signal " << r.ranks[i].signal;
  }
}

TEST(CommTest, AllCollectivesFileStore) {
  for (int d : {1, 2, 4}) {
    auto r = LaunchLocal(Options(d, LaunchOptions::Store::kFile));
    ASSERT_TRUE(r.ok()) << r.status();
    ExpectAllOk(*r, "file store D=" + std::to_string(d));
  }
}

TEST(CommTest, AllCollectivesTcpStore) {
  for (int d : {1, 2, 4}) {
    auto r = LaunchLocal(Options(d, LaunchOptions::Store::kTcp));
    ASSERT_TRUE(r.ok()) << r.status();
    ExpectAllOk(*r, "tcp store D=" + std::to_string(d));
  }
}

TEST(CommTest, PeerDeathIsDetected) {
  for (int d : {3, 4}) {
    LaunchOptions o = Options(d, LaunchOptions::Store::kTcp, {"--die_after_barrier=1"});
    o.env = {{"STALLFREE_COMM_TIMEOUT_MS", "5000"}};
    o.timeout = std::chrono::seconds(30);
    auto start = std::chrono::steady_clock::now();
    auto r = LaunchLocal(o);
    double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->timed_out);
    EXPECT_LT(took, 30.0);
    EXPECT_EQ(r->first_failed_rank, 1);
    ASSERT_EQ(r->ranks.size(), static_cast<size_t>(d));
    EXPECT_TRUE(r->ranks[1].exited);
    EXPECT_EQ(r->ranks[1].exit_code, 3);
    for (int i = 0; i < d; ++i) {
      if (i == 1) continue;
      EXPECT_TRUE(r->ranks[i].exited) << "D=" << d << " rank " << i;
      EXPECT_EQ(r->ranks[i].exit_code, 7) << "D=" << d << " rank " << i << " did not detect";
      EXPECT_FALSE(r->ranks[i].killed_by_launcher) << "D=" << d << " rank " << i;
    }
  }
}

TEST(CommTest, SilentPeerTimesOut) {
  LaunchOptions o = Options(3, LaunchOptions::Store::kFile, {"--stall_after_barrier=1"});
  o.env = {{"STALLFREE_COMM_TIMEOUT_MS", "2000"}};
  o.timeout = std::chrono::seconds(30);
  auto r = LaunchLocal(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->timed_out);
  EXPECT_LT(r->wall_s, 15.0);
  ASSERT_EQ(r->ranks.size(), 3u);
  EXPECT_EQ(r->ranks[0].exit_code, 8) << "rank 0 did not see DEADLINE_EXCEEDED";
  EXPECT_EQ(r->ranks[2].exit_code, 8) << "rank 2 did not see DEADLINE_EXCEEDED";
  EXPECT_EQ(r->ranks[1].exit_code, 3);
}

// NewGlooGroups: a world of 4 split into 2 rows of 2 and 2 columns of 2 (the trainer's --dp 2
// --nproc 2 mesh), and 6 into 2 x 3, over both stores: each group's collectives see only its
// members.
TEST(CommTest, GroupsOverOneStore) {
  for (auto store : {LaunchOptions::Store::kFile, LaunchOptions::Store::kTcp}) {
    for (auto [w, rows] : {std::pair<int, int>{4, 2}, {6, 2}}) {
      auto r = LaunchLocal(Options(w, store, {"--groups=" + std::to_string(rows)}));
      ASSERT_TRUE(r.ok()) << r.status();
      ExpectAllOk(*r, "groups W=" + std::to_string(w) +
                          (store == LaunchOptions::Store::kFile ? " file" : " tcp") + " store");
    }
  }
}

TEST(CommTest, UnreachableTcpStore) {
  auto r = LaunchLocal(Options(1, LaunchOptions::Store::kTcp, {"--unreachable_store=1"}));
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectAllOk(*r, "unreachable store");
}

}  // namespace
}  // namespace parallel
}  // namespace stallfree
