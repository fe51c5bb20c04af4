// FakeServiceManager: the part of systemd a daemon talks to over $NOTIFY_SOCKET, for tests: a
// datagram socket that takes every notification (sd_notify(3)), keeps the descriptors a
// FDSTORE=1 message carries under their FDNAME (and closes them on FDSTOREREMOVE=1), as the
// service manager's file-descriptor store does, and hands them to a restarted daemon
// (testing::Daemon::Restart(fds)).
#pragma once

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace stallfree {
namespace testing {

// A datagram socket bound at `path` whose receives give up after `timeout_us`, as a service
// manager's notify socket; -1 if it cannot be bound.
inline int BindNotifySocket(const std::string& path, long timeout_us) {
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  timeval tv{0, timeout_us};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

class FakeServiceManager {
 public:
  explicit FakeServiceManager(const std::string& path)
      : path_(path), fd_(BindNotifySocket(path, 100000)), bound_(fd_ >= 0) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~FakeServiceManager() {
    stop_.store(true);
    thread_.join();
    if (fd_ >= 0) close(fd_);
    unlink(path_.c_str());
    for (auto& [name, fds] : store_)
      for (int fd : fds) close(fd);
  }
  bool bound() const { return bound_; }
  // "NOTIFY_SOCKET=<path>", for the daemon's environment.
  std::string Env() const { return "NOTIFY_SOCKET=" + path_; }

  // The store's descriptors with their names (still the store's), in the order they came.
  std::vector<std::pair<std::string, int>> Stored() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::pair<std::string, int>> out;
    for (const auto& [name, fds] : store_)
      for (int fd : fds) out.emplace_back(name, fd);
    return out;
  }
  // How many FDSTORE=1 (stored) and FDSTOREREMOVE=1 (removed) messages named `name`.
  int stored(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    return stored_[name];
  }
  int removed(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    return removed_[name];
  }
  // Waits up to `seconds` for pred() (called under no lock).
  template <class Pred>
  static bool WaitFor(Pred pred, double seconds) {
    const auto end = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
    while (!pred()) {
      if (std::chrono::steady_clock::now() > end) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return true;
  }

 private:
  void Loop() {
    while (!stop_.load() && fd_ >= 0) {
      char buf[4096];
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 16) + CMSG_SPACE(sizeof(ucred))];
      iovec iov{buf, sizeof buf};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof control;
      const ssize_t n = recvmsg(fd_, &msg, MSG_CMSG_CLOEXEC);
      if (n <= 0) continue;
      std::vector<int> fds;
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int fd;
          memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
          fds.push_back(fd);
        }
      }
      const std::string text(buf, static_cast<size_t>(n));
      std::map<std::string, std::string> fields;
      for (size_t at = 0; at < text.size();) {
        size_t end = text.find('\n', at);
        if (end == std::string::npos) end = text.size();
        const std::string line = text.substr(at, end - at);
        const size_t eq = line.find('=');
        if (eq != std::string::npos) fields[line.substr(0, eq)] = line.substr(eq + 1);
        at = end + 1;
      }
      std::lock_guard<std::mutex> lock(mu_);
      const std::string name = fields["FDNAME"];
      if (fields["FDSTORE"] == "1") {
        ++stored_[name];
        for (int fd : fds) store_[name].push_back(fd);
        fds.clear();
      } else if (fields["FDSTOREREMOVE"] == "1") {
        ++removed_[name];
        for (int fd : store_[name]) close(fd);
        store_.erase(name);
      }
      for (int fd : fds) close(fd);
    }
  }

  std::string path_;
  int fd_ = -1;
  bool bound_ = false;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex mu_;
  std::map<std::string, std::vector<int>> store_;
  std::map<std::string, int> stored_, removed_;
};

}  // namespace testing
}  // namespace stallfree
