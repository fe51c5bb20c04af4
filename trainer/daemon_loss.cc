#include "trainer/daemon_loss.h"

#include <unistd.h>

#include <chrono>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace stallfree {
namespace trainer {

bool IsDaemonLoss(const absl::Status& st, const DaemonLink& daemon) {
  if (daemon.client == nullptr || daemon.session == nullptr) return false;
  if (!absl::IsUnavailable(st) && !absl::IsNotFound(st) && !absl::IsAborted(st)) return false;
  absl::StatusOr<std::vector<v1::SessionInfo>> sessions = daemon.client->ListSessions();
  if (!sessions.ok()) return true;                                // stallfreed does not answer
  if (daemon.session->layout().params_size() == 0) return false;  // never listed: see above
  for (const v1::SessionInfo& si : *sessions)
    if (si.session_id() == daemon.session->ref().session_id() && si.pid() == getpid())
      return false;  // the daemon still has the session: the error is about something else
  return true;
}

absl::Status AgreeOnDaemon(const World& world, const DaemonLink& daemon, Progress* progress,
                           absl::Status st) {
  const bool lost_here = IsDaemonLoss(st, daemon);
  ASSIGN_OR_RETURN(double lost, world.Sum(lost_here ? 1.0 : 0.0));
  if (lost == 0) return st;
  progress->daemon_lost = true;
  return absl::UnavailableError(lost_here ? std::string(st.message())
                                          : "another rank lost stallfreed");
}

absl::Status WaitForDaemon(const std::string& socket, int64_t seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  absl::Status last = absl::UnavailableError("not tried");
  while (std::chrono::steady_clock::now() < deadline) {
    auto client = Client::Connect(socket, 1000);
    if (client.ok()) {
      auto health = (*client)->Health();
      if (health.ok() && *health == "SERVING") return absl::OkStatus();
      last = health.ok() ? absl::UnavailableError(*health) : health.status();
    } else {
      last = client.status();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  return last;
}

absl::Status DaemonGone(const TrainOptions& o, const Progress& p, const absl::Status& cause,
                        const std::string& why) {
  std::string next;
  if (p.checkpoint.empty()) {
    next = absl::StrCat(
        "no checkpoint was written yet: restart stallfreed and run the same "
        "command again (--checkpoint_every N loses less next time)");
  } else {
    next = absl::StrCat("the last checkpoint is '", p.checkpoint, "' (step ", p.checkpoint_step,
                        "): restart stallfreed (stallfreed --socket ", o.socket,
                        " --state_dir <the same directory>) and continue with: ",
                        o.command_line.empty() ? "trainer <the same flags>" : o.command_line,
                        " --resume ", p.checkpoint);
  }
  return absl::UnavailableError(absl::StrCat("stallfreed at ", o.socket, " went away (",
                                             cause.message(), ")", why, "; ", next));
}

}  // namespace trainer
}  // namespace stallfree
