// stallfreed under systemd's service protocol (Type=notify), with the test as systemd: the daemon
// is started with $NOTIFY_SOCKET pointing at the test's own datagram socket and $WATCHDOG_USEC
// set. Every datagram must be well formed (KEY=VALUE lines of READY, STATUS, WATCHDOG,
// STOPPING); the first is READY=1 with the STATUS of an empty daemon; WATCHDOG=1 follows within
// every watchdog period (systemd would kill the daemon otherwise), and its STATUS= follows the
// daemon's state (a session with registered parameters and one update); on SIGTERM STOPPING=1
// comes last, and the daemon exits 0.
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "client/client.h"
#include "testing/binaries.h"
#include "testing/fake_service_manager.h"
#include "testing/hyper.h"
#include "testing/spawn.h"

namespace stallfree {
namespace {

class NotifySocket {
 public:
  explicit NotifySocket(const std::string& path)
      : path_(path), fd_(testing::BindNotifySocket(path, 200000)), bound_(fd_ >= 0) {}
  ~NotifySocket() {
    if (fd_ >= 0) close(fd_);
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

using Clock = std::chrono::steady_clock;

// One datagram: its KEY=VALUE lines, and when it arrived.
struct Notification {
  std::map<std::string, std::string> fields;
  Clock::time_point at;
  std::string text;
  bool Has(const std::string& key) const { return fields.count(key) > 0; }
};

// Parses and checks a datagram as systemd would read it; adds a failure for anything else.
Notification Parse(const std::string& text) {
  Notification n;
  n.text = text;
  n.at = Clock::now();
  const std::regex status(R"(\d+ sessions, \d+ MiB pinned, \d+ updates|stopping: .+)");
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    const size_t eq = line.find('=');
    if (eq == std::string::npos || eq == 0) {
      ADD_FAILURE() << "not KEY=VALUE: '" << line << "' in " << text;
      continue;
    }
    const std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    EXPECT_TRUE(n.fields.emplace(key, value).second) << key << " twice in " << text;
    if (key == "READY" || key == "WATCHDOG" || key == "STOPPING" || key == "FDSTORE" ||
        key == "FDSTOREREMOVE") {
      EXPECT_EQ(value, "1") << text;
    } else if (key == "FDNAME") {  // a session's memfds in the fd store (server/fd_store.h)
      EXPECT_TRUE(std::regex_match(value, std::regex(R"(stallfree-\d+-(state|region))")))
          << "FDNAME: '" << value << "'";
    } else if (key == "STATUS") {
      EXPECT_TRUE(std::regex_match(value, status)) << "STATUS: '" << value << "'";
    } else {
      ADD_FAILURE() << "unexpected " << key << " in " << text;
    }
  }
  return n;
}

// "<n> sessions, <m> MiB pinned, <u> updates" -> n, m, u (-1 each when not that form).
struct StatusNumbers {
  int64_t sessions = -1, pinned_mib = -1, updates = -1;
};
StatusNumbers Numbers(const Notification& n) {
  StatusNumbers out;
  auto it = n.fields.find("STATUS");
  if (it == n.fields.end()) return out;
  std::smatch m;
  const std::regex re(R"((\d+) sessions, (\d+) MiB pinned, (\d+) updates)");
  if (std::regex_match(it->second, m, re)) {
    out.sessions = std::stoll(m[1]);
    out.pinned_mib = std::stoll(m[2]);
    out.updates = std::stoll(m[3]);
  }
  return out;
}

TEST(Systemd, ReadyStatusWatchdogThenStoppingInOrder) {
  char tmpl[] = "/tmp/stallfree-sd-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  NotifySocket notify(dir + "/notify");
  ASSERT_TRUE(notify.bound());
  const std::string daemon = testing::FindBinary("server/stallfreed");
  ASSERT_FALSE(daemon.empty());
  // A 2 s watchdog: WATCHDOG=1 is due every second, and systemd restarts a daemon that is
  // silent for the whole period.
  const auto period = std::chrono::seconds(2);
  const pid_t pid = testing::Spawn("exec env NOTIFY_SOCKET=" + dir +
                                   "/notify WATCHDOG_USEC=2000000 " + daemon + " --socket " + dir +
                                   "/d.sock --state_dir " + dir + "/state --log_level warning 2>" +
                                   dir + "/log");
  std::vector<Notification> got;
  // Receives until `done` holds for a datagram (true) or 20 s pass (false).
  auto receive_until = [&](const std::function<bool(const Notification&)>& done) {
    const auto until = Clock::now() + std::chrono::seconds(20);
    while (Clock::now() < until) {
      const std::string m = notify.Receive();
      if (m.empty()) continue;
      got.push_back(Parse(m));
      if (done(got.back())) return true;
    }
    return false;
  };
  ASSERT_TRUE(receive_until([](const Notification& n) { return n.Has("READY"); }))
      << "no READY=1 within 20 s";
  ASSERT_EQ(got.size(), 1u) << "READY=1 must come first: " << got.front().text;
  EXPECT_EQ(got.front().fields["STATUS"], "0 sessions, 0 MiB pinned, 0 updates");

  // A session with 4 Mi registered elements and one update: the watchdog's STATUS follows.
  auto client = Client::Connect(dir + "/d.sock");
  ASSERT_TRUE(client.ok()) << client.status();
  auto session = (*client)->OpenSession("sd", 0);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->RegisterParams({{"w", {int64_t{4} << 20}, v1::DTYPE_FP32}}).ok());
  ASSERT_TRUE((*session)->Update(1, testing::TestHyper(0.01), 0).ok());
  ASSERT_TRUE((*session)->WaitUpdate(1).ok());
  ASSERT_TRUE(receive_until([](const Notification& n) {
    const StatusNumbers s = Numbers(n);
    return n.Has("WATCHDOG") && s.sessions == 1 && s.updates == 1;
  })) << "no WATCHDOG=1 with the session and its update in its STATUS within 20 s";
  const StatusNumbers busy = Numbers(got.back());
  EXPECT_GE(busy.pinned_mib, 16) << got.back().text;  // values, m, v, accumulator: 16 MiB
  ASSERT_TRUE((*session)->Close().ok());
  session->reset();
  // Two more feedings after the session went: back to no sessions and no pinned memory.
  int after_close = 0;
  ASSERT_TRUE(receive_until([&](const Notification& n) {
    return n.Has("WATCHDOG") && Numbers(n).sessions == 0 && ++after_close == 2;
  })) << "no WATCHDOG=1 with the session gone within 20 s";
  EXPECT_EQ(Numbers(got.back()).pinned_mib, 0) << got.back().text;

  kill(pid, SIGTERM);
  const bool stopping =
      receive_until([](const Notification& n) { return n.Has("STOPPING"); });
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  ASSERT_TRUE(stopping) << "no STOPPING=1 within 20 s of SIGTERM";
  // STOPPING last; READY only first; WATCHDOG=1 never further apart than the period, from READY.
  EXPECT_EQ(got.back().fields["STATUS"], "stopping: finishing running updates");
  int watchdogs = 0;
  Clock::time_point last_feed = got.front().at;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].Has("READY"), i == 0) << i << ": " << got[i].text;
    EXPECT_EQ(got[i].Has("STOPPING"), i + 1 == got.size()) << i << ": " << got[i].text;
    if (!got[i].Has("WATCHDOG")) continue;
    ++watchdogs;
    EXPECT_LT(got[i].at - last_feed, period) << "watchdog " << watchdogs << " came late";
    last_feed = got[i].at;
  }
  EXPECT_GE(watchdogs, 3);
  // The session's two memfds went to the fd store once it attached, and out when it closed.
  std::vector<std::string> stored, removed;
  for (const Notification& n : got) {
    if (n.Has("FDSTORE")) stored.push_back(n.fields.at("FDNAME"));
    if (n.Has("FDSTOREREMOVE")) removed.push_back(n.fields.at("FDNAME"));
  }
  EXPECT_EQ(stored.size(), 2u);
  EXPECT_EQ(removed, stored);
  if (system(("rm -rf " + dir).c_str()) != 0) perror("rm");
}

// Without $NOTIFY_SOCKET the daemon runs as before (sd_notify is a no-op): it serves, and exits 0
// on SIGTERM.
TEST(Systemd, WithoutNotifySocketNothingChanges) {
  char tmpl[] = "/tmp/stallfree-sd-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string daemon = testing::FindBinary("server/stallfreed");
  ASSERT_FALSE(daemon.empty());
  const pid_t pid = testing::Spawn("exec env -u NOTIFY_SOCKET -u WATCHDOG_USEC " + daemon +
                                   " --socket " + dir + "/d.sock --state_dir " + dir +
                                   "/state --log_level warning");
  // Until the daemon listens (at most 10 s); then it must answer.
  absl::StatusOr<std::unique_ptr<Client>> client = absl::UnavailableError("not tried");
  for (int i = 0; i < 400 && !client.ok(); ++i) {
    client = Client::Connect(dir + "/d.sock", 100);
    if (!client.ok()) usleep(25000);
  }
  ASSERT_TRUE(client.ok()) << client.status();
  auto health = (*client)->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "SERVING");
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  if (system(("rm -rf " + dir).c_str()) != 0) perror("rm");
}

}  // namespace
}  // namespace stallfree
