// Starts `nproc` local ranks as processes (fork/exec of argv) with the launcher environment
// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT and, for
// the file store, STALLFREE_STORE_DIR) and waits for all of them. When a rank fails (non-zero
// exit or a signal) the others get `grace` to finish, then SIGTERM, then SIGKILL after
// `kill_after`. Each rank runs in its own process group, which receives the signals (and which
// is SIGKILLed when its rank exits, so no stray children keep output pipes open); a rank gets
// SIGTERM if the launching thread dies (PR_SET_PDEATHSIG).
#pragma once

#include <atomic>
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace stallfree {
namespace parallel {

struct LaunchOptions {
  int nproc = 1;
  std::vector<std::string> argv;  // argv[0] is the program (PATH is searched)
  enum class Store { kNone, kFile, kTcp };
  // kFile: a fresh mkdtemp directory in STALLFREE_STORE_DIR, removed afterwards. kTcp/kNone:
  // STALLFREE_STORE_DIR is removed from the ranks' environment (so they use the TCP store).
  Store store = Store::kTcp;
  int master_port = 0;  // 0: a free port picked by binding port 0
  std::chrono::milliseconds grace{std::chrono::seconds(10)};
  std::chrono::milliseconds kill_after{std::chrono::seconds(2)};
  // Overall bound (0: none): then every rank is terminated (SIGTERM, SIGKILL after kill_after).
  std::chrono::milliseconds timeout{0};
  // Prefix every output line of rank N with "[rank N] " (stdout and stderr go through a pipe
  // each, to the launcher's stdout and stderr). Otherwise the ranks inherit them.
  bool prefix_output = true;
  // Extra environment for every rank (name, value), applied last.
  std::vector<std::pair<std::string, std::string>> env;
  // If set and it becomes true (e.g. from a SIGINT handler), every rank is terminated as on a
  // timeout and the result has `cancelled`.
  const std::atomic<bool>* cancel = nullptr;
};

struct RankExit {
  int pid = -1;
  bool exited = false;    // exited normally with exit_code
  int exit_code = -1;
  int signal = 0;         // killed by this signal
  bool killed_by_launcher = false;  // the launcher sent it SIGTERM / SIGKILL
  bool ok() const { return exited && exit_code == 0; }
};

struct LaunchResult {
  std::vector<RankExit> ranks;
  int first_failed_rank = -1;  // -1 if every rank succeeded (and no timeout)
  bool timed_out = false;
  bool cancelled = false;
  int master_port = 0;
  double wall_s = 0;
  bool ok() const { return first_failed_rank < 0 && !timed_out && !cancelled; }
  // The first failing rank's code (128 + signal if it was signalled; 124 on a timeout and 130
  // on a cancel with no failure), 0 on success.
  int exit_code() const;
};

// Errors only for what prevents starting (bad options, fork/pipe/mkdtemp failures); a rank that
// fails is reported in the result.
absl::StatusOr<LaunchResult> LaunchLocal(const LaunchOptions& options);

// A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0).
absl::StatusOr<int> PickFreePort();

}  // namespace parallel
}  // namespace stallfree
