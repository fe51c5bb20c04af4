// Bounded waits (issue 30), against a real stallfreed: every call of the client library has a
// deadline from one setting, rpc_timeout. A daemon stopped with SIGSTOP fails each call within
// that bound (plus the 1 s health check that tells a stopped daemon from a busy one) with
// DEADLINE_EXCEEDED naming the socket, the call, the bound and the setting; after SIGCONT the
// session goes on. And the setting's resolution (explicit, $STALLFREE_RPC_TIMEOUT, default), and
// the daemon's --update_wait_s as GetStats reports it.
#include <dirent.h>
#include <signal.h>
#include <stdlib.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "client/client.h"
#include "testing/daemon_process.h"
#include "testing/hyper.h"

namespace stallfree {
namespace {

using Code = absl::StatusCode;
using testing::Daemon;

constexpr double kRpcTimeoutS = 0.5;

// Waits (at most 5 s) until every thread of process `pid` is stopped (state T): SIGSTOP
// takes effect asynchronously, and a call made before it would still be answered.
bool WaitStopped(pid_t pid) {
  for (int i = 0; i < 500; ++i) {
    bool all = true;
    DIR* tasks = opendir(("/proc/" + std::to_string(pid) + "/task").c_str());
    if (tasks == nullptr) return false;
    while (struct dirent* e = readdir(tasks)) {
      if (e->d_name[0] == '.') continue;
      std::ifstream stat("/proc/" + std::to_string(pid) + "/task/" + e->d_name + "/stat");
      std::string line;
      std::getline(stat, line);
      const size_t paren = line.rfind(')');  // the name may hold spaces and parentheses
      if (paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] != 'T')
        all = false;
    }
    closedir(tasks);
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs `call` against the stopped daemon: DEADLINE_EXCEEDED after rpc_timeout, and before it
// plus the health check's second (and some slack for a loaded machine); the message names the
// socket, the call, the bound, the setting, and the daemon as stopped, with its pid.
void ExpectUnanswered(const Daemon& d, const char* rpc, const std::function<absl::Status()>& call,
                      bool names_pid) {
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status st = call();
  const double took = SecondsSince(t0);
  EXPECT_EQ(st.code(), Code::kDeadlineExceeded) << rpc << ": " << st;
  EXPECT_GE(took, kRpcTimeoutS * 0.95) << rpc;
  // The health check after it takes at most min(1 s, rpc_timeout).
  EXPECT_LT(took, 2 * kRpcTimeoutS + 1.5) << rpc << ": the bound did not hold";
  const std::string msg(st.message());
  EXPECT_NE(msg.find("stallfreed at " + d.socket()), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::string("did not answer ") + rpc + " within 0.5 s"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("$STALLFREE_RPC_TIMEOUT"), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not answer a health check either: it is stopped (SIGSTOP"),
            std::string::npos)
      << msg;
  if (names_pid)
    EXPECT_NE(msg.find("kill -CONT " + std::to_string(d.pid())), std::string::npos) << msg;
}

TEST(BoundedWaits, StoppedDaemonFailsEachCallWithinRpcTimeoutThenTheSessionGoesOn) {
  Daemon d({"--threads", "1"});
  ASSERT_TRUE(d.started()) << d.error();
  auto client = Client::Connect(d.socket(), 3000, kRpcTimeoutS);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->rpc_timeout_s(), kRpcTimeoutS);
  auto opened = (*client)->OpenSession("bounded", 0);
  ASSERT_TRUE(opened.ok()) << opened.status();
  Session& s = **opened;
  const int64_t n = 64 * 32;
  ASSERT_TRUE(s.RegisterParams({{"w", {64, 32}, v1::DTYPE_FP32}}).ok());
  std::vector<float> w(n, 0.5f), g(n, 0.25f);
  memcpy(s.StagingFp32("w"), w.data(), n * 4);
  ASSERT_TRUE(s.LoadParams().ok());
  memcpy(s.GradSlot(0, "w"), g.data(), n * 4);
  ASSERT_TRUE(s.Push(1, 0).ok());
  ASSERT_TRUE(s.Update(1, testing::TestHyper(0.0), 0).ok());
  auto first = s.WaitUpdate(1);
  ASSERT_TRUE(first.ok()) << first.status();

  ASSERT_EQ(kill(d.pid(), SIGSTOP), 0) << strerror(errno);
  // Whatever happens below, the daemon runs again before it is killed and its files go.
  struct Resume {
    pid_t pid;
    ~Resume() { kill(pid, SIGCONT); }
  } resume{d.pid()};
  ASSERT_TRUE(WaitStopped(d.pid()));
  ExpectUnanswered(d, "PushGradients", [&] { return s.Push(2, 1).status(); }, true);
  ExpectUnanswered(d, "WaitUpdate", [&] { return s.WaitUpdate(1).status(); }, true);
  ExpectUnanswered(d, "Checkpoint", [&] { return s.Checkpoint("frozen").status(); }, true);
  ExpectUnanswered(d, "GetStats", [&] { return (*client)->GetStats().status(); }, false);
  // The health check itself: at most min(5 s, rpc_timeout).
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<std::string> health = (*client)->Health();
  EXPECT_EQ(health.status().code(), Code::kDeadlineExceeded) << health.status();
  EXPECT_LT(SecondsSince(t0), kRpcTimeoutS + 1.5);

  ASSERT_EQ(kill(d.pid(), SIGCONT), 0) << strerror(errno);
  health = (*client)->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "SERVING");
  // The session goes on: the next round pushes, updates and lands (the push that timed out may
  // or may not have run once the daemon went on: its outcome is unknown, so none is counted).
  memcpy(s.GradSlot(0, "w"), g.data(), n * 4);
  auto pushed = s.Push(2, 0);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  ASSERT_TRUE(s.Update(2, testing::TestHyper(0.0), 0).ok());
  auto second = s.WaitUpdate(2);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->version(), 2);
  for (int64_t i = 0; i < n; ++i) ASSERT_LT(s.ParamsFp32(0, "w")[i], w[i]) << i;  // stepped
  EXPECT_TRUE(s.Close().ok());
}

// The daemon's own wait (for requests that name no timeout_ms) is a flag, and GetStats reports it.
TEST(BoundedWaits, DaemonReportsItsUpdateWait) {
  Daemon d({"--update_wait_s", "0.25"});
  ASSERT_TRUE(d.started()) << d.error();
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok()) << client.status();
  auto stats = (*client)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->update_wait_seconds(), 0.25);
  Daemon defaults;
  auto other = Client::Connect(defaults.socket());
  ASSERT_TRUE(other.ok()) << other.status();
  stats = (*other)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->update_wait_seconds(), 60);
}

// One setting: an explicit rpc_timeout, else $STALLFREE_RPC_TIMEOUT, else the default; a value
// that is not a positive number of seconds is refused naming where it came from.
TEST(BoundedWaits, RpcTimeoutComesFromTheArgumentTheEnvironmentOrTheDefault) {
  unsetenv("STALLFREE_RPC_TIMEOUT");
  EXPECT_EQ(*RpcTimeoutSeconds(0), kDefaultRpcTimeoutS);
  EXPECT_EQ(*RpcTimeoutSeconds(7.5), 7.5);
  setenv("STALLFREE_RPC_TIMEOUT", "3.5", 1);
  EXPECT_EQ(*RpcTimeoutSeconds(0), 3.5);
  EXPECT_EQ(*RpcTimeoutSeconds(9), 9);  // the argument wins
  setenv("STALLFREE_RPC_TIMEOUT", "soon", 1);
  absl::StatusOr<double> bad = RpcTimeoutSeconds(0);
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("$STALLFREE_RPC_TIMEOUT: 'soon'"), std::string::npos)
      << bad.status();
  setenv("STALLFREE_RPC_TIMEOUT", "0", 1);
  EXPECT_EQ(RpcTimeoutSeconds(0).status().code(), Code::kInvalidArgument);
  unsetenv("STALLFREE_RPC_TIMEOUT");
  EXPECT_EQ(RpcTimeoutSeconds(-1).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(RpcTimeoutSeconds(1e9).status().code(), Code::kInvalidArgument);
  // Connect refuses it too, before it connects.
  setenv("STALLFREE_RPC_TIMEOUT", "-2", 1);
  EXPECT_EQ(Client::Connect("/tmp/no-such-stallfreed.sock").status().code(),
            Code::kInvalidArgument);
  unsetenv("STALLFREE_RPC_TIMEOUT");
}

}  // namespace
}  // namespace stallfree
