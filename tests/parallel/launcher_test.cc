// LaunchLocal with /bin/sh ranks: the environment, the file store directory's life, failure
// handling (grace period, SIGTERM, SIGKILL, the first failing rank), timeouts, exec failures.
#include "parallel/launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace stallfree {
namespace parallel {
namespace {

LaunchOptions Shell(int nproc, const std::string& script) {
  LaunchOptions o;
  o.nproc = nproc;
  o.argv = {"/bin/sh", "-c", script};
  o.grace = std::chrono::milliseconds(300);
  o.kill_after = std::chrono::milliseconds(500);
  o.timeout = std::chrono::seconds(20);
  return o;
}

std::string TmpDir() {
  const char* t = std::getenv("TEST_TMPDIR");
  return t != nullptr ? t : "/tmp";
}

std::string ReadLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

TEST(LauncherTest, SetsTheEnvironment) {
  LaunchOptions o = Shell(3,
                          "test \"$RANK\" -ge 0 && test \"$RANK\" -lt 3 && "
                          "test \"$WORLD_SIZE\" = 3 && test \"$LOCAL_RANK\" = \"$RANK\" && "
                          "test \"$LOCAL_WORLD_SIZE\" = 3 && test \"$MASTER_ADDR\" = 127.0.0.1 && "
                          "test \"$MASTER_PORT\" = 23456 && test -z \"$STALLFREE_STORE_DIR\" && "
                          "test \"$EXTRA\" = yes && echo \"$RANK\" > \"$OUT/rank$RANK\"");
  o.master_port = 23456;
  o.store = LaunchOptions::Store::kTcp;
  std::string out = TmpDir() + "/env";
  ASSERT_EQ(mkdir(out.c_str(), 0700), 0);
  o.env = {{"EXTRA", "yes"}, {"OUT", out}};
  auto r = LaunchLocal(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->ok());
  EXPECT_EQ(r->exit_code(), 0);
  EXPECT_EQ(r->master_port, 23456);
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(r->ranks[i].ok()) << "rank " << i << " exit " << r->ranks[i].exit_code;
    EXPECT_EQ(ReadLine(out + "/rank" + std::to_string(i)), std::to_string(i));
  }
}

TEST(LauncherTest, PicksAFreePortAndAFileStoreDirectory) {
  std::string out = TmpDir() + "/store";
  ASSERT_EQ(mkdir(out.c_str(), 0700), 0);
  LaunchOptions o = Shell(2,
                          "test -d \"$STALLFREE_STORE_DIR\" && "
                          "echo \"$STALLFREE_STORE_DIR\" > \"$OUT/dir$RANK\" && "
                          "echo \"$MASTER_PORT\" > \"$OUT/port$RANK\" && "
                          "touch \"$STALLFREE_STORE_DIR/key$RANK\"");
  o.store = LaunchOptions::Store::kFile;
  o.env = {{"OUT", out}};
  auto r = LaunchLocal(o);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->ok());
  EXPECT_GT(r->master_port, 0);
  std::string dir = ReadLine(out + "/dir0");
  EXPECT_FALSE(dir.empty());
  EXPECT_EQ(ReadLine(out + "/dir1"), dir);
  EXPECT_EQ(ReadLine(out + "/port0"), std::to_string(r->master_port));
  EXPECT_EQ(ReadLine(out + "/port1"), std::to_string(r->master_port));
  struct stat st;
  EXPECT_NE(stat(dir.c_str(), &st), 0) << "the store directory " << dir << " was not removed";
}

TEST(LauncherTest, FailingRankGetsTheOthersTerminated) {
  LaunchOptions o = Shell(3, "if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 5; fi; sleep 30");
  auto start = std::chrono::steady_clock::now();
  auto r = LaunchLocal(o);
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->ok());
  EXPECT_FALSE(r->timed_out);
  EXPECT_EQ(r->first_failed_rank, 1);
  EXPECT_EQ(r->exit_code(), 5);
  EXPECT_TRUE(r->ranks[1].exited);
  EXPECT_EQ(r->ranks[1].exit_code, 5);
  EXPECT_FALSE(r->ranks[1].killed_by_launcher);
  for (int i : {0, 2}) {
    EXPECT_TRUE(r->ranks[i].killed_by_launcher) << i;
    EXPECT_EQ(r->ranks[i].signal, SIGTERM) << i;
  }
  EXPECT_GE(took, 0.2 + 0.3);  // the grace period was given
  EXPECT_LT(took, 5.0);
}

TEST(LauncherTest, OthersMayFinishWithinTheGracePeriod) {
  LaunchOptions o = Shell(3, "if [ \"$RANK\" = 0 ]; then exit 4; fi; sleep 0.3; exit 0");
  o.grace = std::chrono::seconds(5);
  auto r = LaunchLocal(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_failed_rank, 0);
  EXPECT_EQ(r->exit_code(), 4);
  for (int i : {1, 2}) {
    EXPECT_TRUE(r->ranks[i].ok()) << i;
    EXPECT_FALSE(r->ranks[i].killed_by_launcher) << i;
  }
  EXPECT_LT(r->wall_s, 4.0);
}

TEST(LauncherTest, SigkillWhenSigtermIsIgnored) {
  LaunchOptions o =
      Shell(2, "trap '' TERM; if [ \"$RANK\" = 1 ]; then exit 2; fi; sleep 30; exit 0");
  auto r = LaunchLocal(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_failed_rank, 1);
  EXPECT_EQ(r->ranks[0].signal, SIGKILL);
  EXPECT_TRUE(r->ranks[0].killed_by_launcher);
  EXPECT_GE(r->wall_s, 0.3 + 0.5);
  EXPECT_LT(r->wall_s, 5.0);
}

TEST(LauncherTest, SignalledRankIsAFailure) {
  LaunchOptions o = Shell(2, "if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; sleep 0.2");
  auto r = LaunchLocal(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_failed_rank, 0);
  EXPECT_FALSE(r->ranks[0].exited);
  EXPECT_EQ(r->ranks[0].signal, SIGKILL);
  EXPECT_EQ(r->exit_code(), 128 + SIGKILL);
  EXPECT_TRUE(r->ranks[1].ok());
}

TEST(LauncherTest, OverallTimeout) {
  LaunchOptions o = Shell(2, "sleep 30");
  o.timeout = std::chrono::milliseconds(400);
  auto r = LaunchLocal(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->timed_out);
  EXPECT_FALSE(r->ok());
  EXPECT_EQ(r->first_failed_rank, -1);
  EXPECT_EQ(r->exit_code(), 124);
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(r->ranks[i].killed_by_launcher);
    EXPECT_EQ(r->ranks[i].signal, SIGTERM);
  }
  EXPECT_GE(r->wall_s, 0.4);
  EXPECT_LT(r->wall_s, 5.0);
}

TEST(LauncherTest, Cancel) {
  std::atomic<bool> cancel{false};
  LaunchOptions o = Shell(2, "sleep 30");
  o.cancel = &cancel;
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    cancel.store(true);
  });
  auto r = LaunchLocal(o);
  canceller.join();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->cancelled);
  EXPECT_FALSE(r->timed_out);
  EXPECT_EQ(r->first_failed_rank, -1);
  EXPECT_EQ(r->exit_code(), 130);
  EXPECT_LT(r->wall_s, 5.0);
}

TEST(LauncherTest, ExecFailureAndBadOptions) {
  LaunchOptions o;
  o.nproc = 2;
  o.argv = {"/nonexistent/program"};
  o.grace = std::chrono::milliseconds(100);
  auto r = LaunchLocal(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GE(r->first_failed_rank, 0);
  EXPECT_EQ(r->exit_code(), 127);

  o.nproc = 0;
  EXPECT_EQ(LaunchLocal(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.nproc = 1;
  o.argv.clear();
  EXPECT_EQ(LaunchLocal(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LauncherTest, PrefixedOutputPassesThrough) {
  // Every line (also one without a trailing newline) comes out prefixed with its rank; a
  // background child that keeps the pipe open is reaped with its rank's process group.
  std::string path = TmpDir() + "/stdout.txt";
  fflush(stdout);
  int saved = dup(STDOUT_FILENO);
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_GE(dup2(fd, STDOUT_FILENO), 0);
  close(fd);
  LaunchOptions o = Shell(2, "(sleep 30 &); echo hello from $RANK; printf 'tail'");
  auto r = LaunchLocal(o);
  fflush(stdout);
  dup2(saved, STDOUT_FILENO);
  close(saved);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->ok());
  EXPECT_LT(r->wall_s, 5.0);
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (int i = 0; i < 2; ++i) {
    std::string rank = std::to_string(i);
    EXPECT_NE(text.find("[rank " + rank + "] hello from " + rank + "\n"), std::string::npos)
        << text;
    EXPECT_NE(text.find("[rank " + rank + "] tail\n"), std::string::npos) << text;
  }
}

}  // namespace
}  // namespace parallel
}  // namespace stallfree
