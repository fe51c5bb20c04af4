// ServiceNotifier: stallfreed's side of systemd's service protocol (sd_notify(3), libsystemd):
//   READY=1 once both sockets listen, STATUS= with the sessions and pinned bytes (every few
//   seconds), WATCHDOG=1 when $WATCHDOG_USEC is set, STOPPING=1 on shutdown.
// The watchdog is fed by a thread that first checks the service answers: `responsive` (a
// GetStats through the daemon's own gRPC socket) must succeed, else no WATCHDOG=1 is sent and
// systemd restarts a daemon that stopped serving. Without $NOTIFY_SOCKET every call is a no-op.
// Thread safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"

namespace stallfree {

class ServiceNotifier {
 public:
  // responsive: is the service serving (called from the notifier's thread)? status: the
  // STATUS= text.
  ServiceNotifier(std::function<absl::Status()> responsive, std::function<std::string()> status);
  ~ServiceNotifier();
  ServiceNotifier(const ServiceNotifier&) = delete;
  ServiceNotifier& operator=(const ServiceNotifier&) = delete;

  // Sends READY=1 and STATUS=, then starts the thread (STATUS= every 5 s, WATCHDOG=1 every half
  // watchdog period when enabled).
  void Ready();
  // Sends STOPPING=1 and stops the thread.
  void Stopping();

 private:
  void Loop();

  std::function<absl::Status()> responsive_;
  std::function<std::string()> status_;
  uint64_t watchdog_usec_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace stallfree
