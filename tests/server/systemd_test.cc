// stallfreed under systemd's service protocol (Type=notify), with the test as systemd: the daemon
// is started with $NOTIFY_SOCKET pointing at the test's own datagram socket and $WATCHDOG_USEC
// set, and must send READY=1 (with a STATUS= naming its sessions and pinned bytes), then
// WATCHDOG=1 at least every half period, then, on SIGTERM, STOPPING=1 last, and exit 0.
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "testing/binaries.h"
#include "testing/spawn.h"

namespace stallfree {
namespace {

class NotifySocket {
 public:
  explicit NotifySocket(const std::string& path) : path_(path) {
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
    bound_ = bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    timeval tv{0, 200000};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~NotifySocket() {
    close(fd_);
    unlink(path_.c_str());
  }
  bool bound() const { return bound_; }
  // One datagram, or "" after 200 ms.
  std::string Receive() {
    char buf[4096];
    const ssize_t n = recv(fd_, buf, sizeof buf, 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool bound_ = false;
};

TEST(Systemd, ReadyStatusWatchdogThenStoppingInOrder) {
  char tmpl[] = "/tmp/stallfree-sd-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  NotifySocket notify(dir + "/notify");
  ASSERT_TRUE(notify.bound());
  const std::string daemon = testing::FindBinary("server/stallfreed");
  ASSERT_FALSE(daemon.empty());
  // A 300 ms watchdog: WATCHDOG=1 is due every 150 ms.
  const pid_t pid = testing::Spawn("exec env NOTIFY_SOCKET=" + dir + "/notify WATCHDOG_USEC=300000 " +
                                   daemon + " --socket " + dir + "/d.sock --state_dir " + dir +
                                   "/state --log_level warning 2>" + dir + "/log");
  std::vector<std::string> got;
  int watchdogs = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (watchdogs < 4 && std::chrono::steady_clock::now() < until) {
    std::string m = notify.Receive();
    if (m.empty()) continue;
    got.push_back(m);
    if (m.find("WATCHDOG=1") != std::string::npos) ++watchdogs;
  }
  ASSERT_GE(watchdogs, 4) << "no watchdog feeding within 20 s";
  kill(pid, SIGTERM);
  bool stopping = false;
  const auto stop_until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!stopping && std::chrono::steady_clock::now() < stop_until) {
    std::string m = notify.Receive();
    if (m.empty()) continue;
    got.push_back(m);
    stopping = m.find("STOPPING=1") != std::string::npos;
  }
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  ASSERT_TRUE(stopping);
  // READY first, with the status line; STOPPING last; every WATCHDOG in between.
  ASSERT_FALSE(got.empty());
  EXPECT_NE(got.front().find("READY=1"), std::string::npos) << got.front();
  EXPECT_NE(got.front().find("STATUS=0 sessions, 0 MiB pinned"), std::string::npos)
      << got.front();
  EXPECT_NE(got.back().find("STOPPING=1"), std::string::npos) << got.back();
  for (size_t i = 1; i + 1 < got.size(); ++i) {
    EXPECT_EQ(got[i].find("READY=1"), std::string::npos) << i << ": " << got[i];
    EXPECT_EQ(got[i].find("STOPPING=1"), std::string::npos) << i << ": " << got[i];
  }
  if (system(("rm -rf " + dir).c_str()) != 0) perror("rm");
}

// Without $NOTIFY_SOCKET the daemon runs as before (sd_notify is a no-op).
TEST(Systemd, WithoutNotifySocketNothingChanges) {
  char tmpl[] = "/tmp/stallfree-sd-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string daemon = testing::FindBinary("server/stallfreed");
  const pid_t pid = testing::Spawn("exec env -u NOTIFY_SOCKET " + daemon + " --socket " + dir +
                                   "/d.sock --state_dir " + dir + "/state --log_level warning");
  struct stat st;
  bool up = false;
  for (int i = 0; i < 200 && !up; ++i) {
    up = stat((dir + "/d.sock").c_str(), &st) == 0;
    usleep(25000);
  }
  EXPECT_TRUE(up);
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  if (system(("rm -rf " + dir).c_str()) != 0) perror("rm");
}

}  // namespace
}  // namespace stallfree
