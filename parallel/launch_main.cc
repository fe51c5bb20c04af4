// launch --nproc N [--store file|tcp] [--timeout_s S] [--grace_s G] [--prefix] -- program args
// Starts N local ranks of `program` (see parallel/launcher.h) and exits with the first failing
// rank's exit code (128 + signal if it was signalled, 124 on a timeout), 0 if all succeed.
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <string>
#include <vector>

#include "common/flags.h"
#include "parallel/launcher.h"

namespace {
std::atomic<bool> g_cancel{false};
void OnSignal(int) { g_cancel.store(true); }
}  // namespace

int main(int argc, char** argv) {
  // Everything after "--" belongs to the program, so flag parsing stops there.
  int split = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--") {
      split = i;
      break;
    }
  }
  stallfree::FlagSet flags(
      "launch",
      "Runs N local ranks of a program with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,\n"
      "MASTER_ADDR, MASTER_PORT (and STALLFREE_STORE_DIR for --store file).\n"
      "usage: launch --nproc N [--store file|tcp] [--timeout_s S] -- program args...");
  int64_t nproc = 1;
  std::string store = "tcp";
  double timeout_s = 0;
  double grace_s = 10;
  int64_t master_port = 0;
  bool prefix = true;
  flags.AddInt("nproc", &nproc, "number of ranks");
  flags.AddString("store", &store, "rendezvous store: file (a temporary directory) or tcp");
  flags.AddDouble("timeout_s", &timeout_s, "overall timeout in seconds (0: none)");
  flags.AddDouble("grace_s", &grace_s,
                  "after a rank fails, seconds before the others get SIGTERM");
  flags.AddInt("master_port", &master_port, "MASTER_PORT (0: pick a free one)");
  flags.AddBool("prefix", &prefix, "prefix each output line with [rank N]");
  int rc = flags.ParseCommandLine(split, argv);
  if (rc >= 0) return rc;
  std::vector<std::string> program(flags.positional().begin(), flags.positional().end());
  for (int i = split + 1; i < argc; ++i) program.push_back(argv[i]);
  if (program.empty()) {
    std::fprintf(stderr, "launch: no program given\n%s", flags.Help().c_str());
    return 2;
  }
  stallfree::parallel::LaunchOptions options;
  options.nproc = static_cast<int>(nproc);
  options.argv = program;
  if (store == "file") {
    options.store = stallfree::parallel::LaunchOptions::Store::kFile;
  } else if (store == "tcp") {
    options.store = stallfree::parallel::LaunchOptions::Store::kTcp;
  } else {
    std::fprintf(stderr, "launch: --store must be file or tcp, not '%s'\n", store.c_str());
    return 2;
  }
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  options.grace = std::chrono::milliseconds(static_cast<int64_t>(grace_s * 1000));
  options.master_port = static_cast<int>(master_port);
  options.prefix_output = prefix;
  // SIGINT / SIGTERM / SIGHUP: the ranks (in their own process groups) are terminated too.
  struct sigaction sa = {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);
  options.cancel = &g_cancel;
  auto result = stallfree::parallel::LaunchLocal(options);
  if (!result.ok()) {
    std::fprintf(stderr, "launch: %s\n", result.status().ToString().c_str());
    return 1;
  }
  for (size_t r = 0; r < result->ranks.size(); ++r) {
    const auto& e = result->ranks[r];
    if (e.ok()) continue;
    if (e.exited) {
      std::fprintf(stderr, "launch: rank %zu exited with code %d%s\n", r, e.exit_code,
                   e.killed_by_launcher ? " (after the launcher's SIGTERM)" : "");
    } else {
      std::fprintf(stderr, "launch: rank %zu killed by signal %d%s\n", r, e.signal,
                   e.killed_by_launcher ? " (sent by the launcher)" : "");
    }
  }
  if (result->cancelled) std::fprintf(stderr, "launch: interrupted; the ranks were stopped\n");
  if (result->timed_out) std::fprintf(stderr, "launch: timed out after %.1f s\n", timeout_s);
  if (result->first_failed_rank >= 0) {
    std::fprintf(stderr, "launch: rank %d failed first\n", result->first_failed_rank);
  }
  return result->exit_code();
}
