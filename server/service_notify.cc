#include "server/service_notify.h"

#include <systemd/sd-daemon.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace stallfree {
namespace {

void Notify(const std::string& state) {
  const int r = sd_notify(0, state.c_str());
  if (r < 0) SF_LOG(kWarning, "sd_notify(%s) failed: %s (errno %d)", state, strerror(-r), -r);
}

}  // namespace

ServiceNotifier::ServiceNotifier(std::function<absl::Status()> responsive,
                                 std::function<std::string()> status)
    : responsive_(std::move(responsive)), status_(std::move(status)) {
  uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) > 0) watchdog_usec_ = usec;
}

ServiceNotifier::~ServiceNotifier() { Stopping(); }

void ServiceNotifier::Ready() {
  Notify(absl::StrCat("READY=1\nSTATUS=", status_()));
  if (watchdog_usec_ > 0)
    SF_LOG(kInfo, "systemd watchdog: every %d ms, fed after a GetStats through the socket",
           watchdog_usec_ / 2000);
  thread_ = std::thread([this] { Loop(); });
}

void ServiceNotifier::Stopping() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) {
    thread_.join();
    Notify("STOPPING=1\nSTATUS=stopping: finishing running updates");
  }
}

void ServiceNotifier::Loop() {
  using Clock = std::chrono::steady_clock;
  const auto status_every = std::chrono::seconds(5);
  const auto feed_every = std::chrono::microseconds(std::max<uint64_t>(watchdog_usec_ / 2, 1000));
  auto next_status = Clock::now() + status_every;
  auto next_feed = Clock::now();
  for (;;) {
    const auto now = Clock::now();
    if (watchdog_usec_ > 0 && now >= next_feed) {
      const absl::Status ok = responsive_();
      if (ok.ok())
        Notify(absl::StrCat("WATCHDOG=1\nSTATUS=", status_()));
      else
        SF_LOG(kWarning, "systemd watchdog not fed: the daemon does not answer (%s)",
               ok.ToString());
      next_feed = now + feed_every;
    }
    if (now >= next_status) {
      Notify(absl::StrCat("STATUS=", status_()));
      next_status = now + status_every;
    }
    auto wake = next_status;
    if (watchdog_usec_ > 0) wake = std::min(wake, next_feed);
    std::unique_lock<std::mutex> lock(mu_);
    if (cv_.wait_until(lock, wake, [this] { return stop_; })) return;
  }
}

}  // namespace stallfree
