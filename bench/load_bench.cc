// load_bench: one stallfreed under load. Eight trainer processes (tiny preset, zenflow, each its
// own seed) train at once while a ninth client floods the daemon with bad ranges and wrong
// tokens and a tenth opens sessions and SIGKILLs their owners; a probe client times push and
// update round trips meanwhile. The load runs twice. Then:
//   - every trainer's losses must equal, step for step, the same trainer run alone on the same
//     daemon before the load (nothing lost or crossed between sessions);
//   - once every session is gone the daemon's RSS is read: after the runs alone, after round 1
//     and after round 2. Round 1 may raise it once (allocator arenas of threads the sequential
//     runs left idle); round 2's growth is what would grow with the work.
//
//   bazel run //bench:load_bench [-- --quick]    (also: bazel-bin/bench/load_bench from the root)
//
// Prints FIGURE load_trainers_identical (trainer runs under load whose losses equal their run
// alone, of 2 x --trainers), load_rss_growth_bytes (round 2), load_rss_growth_first_round_bytes,
// load_push_p50_ms / _p99_ms, load_update_p50_ms / _p99_ms, load_rejected_requests and
// load_sessions_killed. Exit status 0 iff every run matched and no session was left.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/flags.h"
#include "testing/daemon_process.h"
#include "testing/spawn.h"

namespace stallfree {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// VmRSS of a process, bytes (0 if unreadable).
uint64_t RssBytes(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

// The loss column of a trainer's metrics.csv, as printed (exact comparison).
std::vector<std::string> LossColumn(const std::string& csv) {
  std::ifstream f(csv);
  std::string line;
  std::vector<std::string> out;
  std::getline(f, line);
  while (std::getline(f, line)) {
    std::stringstream s(line);
    std::string step, loss;
    std::getline(s, step, ',');
    std::getline(s, loss, ',');
    out.push_back(loss);
  }
  return out;
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

// load_bench's flags.
struct Flags {
  bool quick = false;
  int64_t trainers = 8, steps = 0;
  std::string stallfreed, trainer_bin, holder_bin, out_dir = "/tmp/stallfree-load-bench";
};

// Parses the command line into *f (steps resolved); returns an exit status, or -1 to go on.
int ParseFlags(int argc, char** argv, Flags* f) {
  FlagSet flags("load_bench",
                "trainers, a flooder and a session killer on one stallfreed: losses must equal "
                "each trainer's run alone, RSS must return to its baseline; push and update "
                "latency under load");
  flags.AddBool("quick", &f->quick, "a short run (about 30 s here; default about 2 min)");
  flags.AddInt("trainers", &f->trainers, "concurrent trainer processes");
  flags.AddInt("steps", &f->steps, "steps per trainer (0: 96 quick, 640 otherwise)");
  flags.AddString("out_dir", &f->out_dir, "where the trainers' runs go");
  flags.AddString("stallfreed", &f->stallfreed,
                  "the stallfreed binary (default: found beside this one)");
  flags.AddString("trainer", &f->trainer_bin,
                  "the trainer binary (default: found beside this one)");
  flags.AddString("session_holder", &f->holder_bin,
                  "the session-holder test binary (default: found beside this one)");
  if (int code = flags.ParseCommandLine(argc, argv); code >= 0) return code;
  if (f->steps <= 0) f->steps = f->quick ? 96 : 640;
  if (f->trainers < 1) {
    fprintf(stderr, "load_bench: --trainers must be >= 1\n");
    return 2;
  }
  return -1;
}

// What every phase uses: the flags, the trainer and session-holder binaries, the daemon and a
// client of it.
struct Bench {
  const Flags& f;
  std::string trainer, holder;
  const testing::Daemon& daemon;
  Client& client;

  // The shell command of trainer i in a phase ("alone", "load1", "load2"), its log in out_dir.
  std::string Command(int64_t i, const std::string& phase) const {
    const std::string name = absl::StrCat(phase, "-", i);
    return absl::StrCat(trainer, " --preset tiny --quiet --mode zenflow --nproc 1 --steps ",
                        f.steps, " --seed ", i + 1,
                        " --eval_every 0 --keep_checkpoints 1 --socket ", daemon.socket(),
                        " --out_dir ", f.out_dir, "/", name, " --run_name ", name, " > ",
                        f.out_dir, "/", name, ".log 2>&1");
  }
};

// What the load rounds gather: the background threads' counts and the probe's latencies, the
// trainer runs that matched or failed, sessions left and the daemon's RSS after each round.
struct LoadResult {
  std::atomic<bool> stop{false};
  std::atomic<int64_t> flooded{0}, killed{0};
  std::vector<double> push_ms, update_ms;
  int identical = 0, failed = 0;
  int64_t sessions = -1;
  uint64_t rss_round[2] = {0, 0};
};

// The flooder: pushes with bad ranges and wrong sessions or tokens until r->stop.
void Flood(const Bench& b, int round, LoadResult* r) {
  auto c = Client::Connect(b.daemon.socket());
  if (!c.ok()) return;
  auto s = (*c)->OpenSession("flooder", 9);
  if (!s.ok() || !(*s)->RegisterParams({{"w", {64, 64}, v1::DTYPE_BF16}}).ok()) return;
  std::mt19937_64 rng(9 + round);
  while (!r->stop.load()) {
    v1::PushGradientsRequest req;
    *req.mutable_session() = (*s)->ref();
    if (rng() % 4 == 0) {  // someone else's session, or a wrong token
      req.mutable_session()->set_session_id(rng() % 64);
      req.mutable_session()->set_token(std::string(32, 'f'));
    }
    req.set_slot(static_cast<uint32_t>(rng() % 3));
    v1::GradRange* g = req.add_ranges();
    g->set_param(rng() % 2 ? "w" : "nope");
    g->set_offset(rng() % 2 ? ~uint64_t{0} - 1 : rng() % 100000);
    g->set_length(rng() % 2 ? ~uint64_t{0} : (rng() % 100000) * 2);
    g->set_first_element(rng() % 10000);
    grpc::ClientContext ctx;
    v1::PushGradientsResponse resp;
    (*c)->stub()->PushGradients(&ctx, req, &resp);
    r->flooded++;
  }
}

// The killer: starts session holders and SIGKILLs each once its session is open, until r->stop.
void KillOwners(const Bench& b, LoadResult* r) {
  while (!r->stop.load()) {
    const std::string ready = absl::StrCat(b.f.out_dir, "/holder.ready");
    unlink(ready.c_str());
    pid_t pid = testing::Spawn(
        absl::StrCat("exec ", b.holder, " ", b.daemon.socket(), " 65536 > ", ready));
    for (int i = 0; i < 200 && !r->stop.load(); ++i) {
      std::ifstream f(ready);
      std::string word;
      if (f >> word && word == "ready") break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    r->killed++;
  }
}

// The probe: times push and update round trips of its own session until r->stop.
void Probe(const Bench& b, LoadResult* r) {
  auto s = b.client.OpenSession("probe", 10);
  if (!s.ok() || !(*s)->RegisterParams({{"w", {256, 256}, v1::DTYPE_BF16}}).ok() ||
      !(*s)->LoadParams().ok())
    return;
  v1::AdamWHyper h;
  h.set_lr(1e-3);
  h.set_beta1(0.9);
  h.set_beta2(0.999);
  h.set_eps(1e-8);
  for (int64_t step = 1; !r->stop.load(); ++step) {
    auto t0 = Clock::now();
    if (!(*s)->Push(step, 0).ok()) return;
    r->push_ms.push_back(Ms(Clock::now() - t0));
    t0 = Clock::now();
    if (!(*s)->Update(step, h, step % 2, v1::DTYPE_BF16, true).ok()) return;
    if (!(*s)->WaitUpdate(step).ok()) return;
    r->update_ms.push_back(Ms(Clock::now() - t0));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// 1. Each trainer alone; false (said on stderr) if one failed.
bool RunAlone(const Bench& b) {
  const auto t_alone = Clock::now();
  for (int64_t i = 0; i < b.f.trainers; ++i) {
    const int rc = system(b.Command(i, "alone").c_str());
    if (rc != 0) {
      fprintf(stderr, "load_bench: trainer %ld alone failed (status %d); see %s/alone-%ld.log\n",
              (long)i, rc, b.f.out_dir.c_str(), (long)i);
      return false;
    }
  }
  printf("alone: %ld runs in %.1f s\n", (long)b.f.trainers,
         std::chrono::duration<double>(Clock::now() - t_alone).count());
  return true;
}

// Round `round` (0 or 1) under load: all trainers at once beside the flooder, the killer and the
// probe; then their losses against the runs alone and the daemon's RSS once every session is
// gone. False if sessions were left.
bool RunLoadRound(const Bench& b, int round, LoadResult* r) {
  r->stop.store(false);
  std::thread flooder([&] { Flood(b, round, r); });
  std::thread killer([&] { KillOwners(b, r); });
  std::thread probe([&] { Probe(b, r); });
  const auto t_load = Clock::now();
  const std::string phase = absl::StrCat("load", round + 1);
  std::vector<pid_t> pids;
  for (int64_t i = 0; i < b.f.trainers; ++i) pids.push_back(testing::Spawn(b.Command(i, phase)));
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    r->failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  const double load_s = std::chrono::duration<double>(Clock::now() - t_load).count();
  r->stop.store(true);
  flooder.join();
  killer.join();
  probe.join();
  printf("round %d under load: %ld trainers in %.1f s (%d failed so far), %ld flooding "
         "requests and %ld sessions killed with their owners so far\n",
         round + 1, (long)b.f.trainers, load_s, r->failed, (long)r->flooded.load(),
         (long)r->killed.load());

  // Losses against the runs alone.
  for (int64_t i = 0; i < b.f.trainers; ++i) {
    const auto alone = LossColumn(absl::StrCat(b.f.out_dir, "/alone-", i, "/metrics.csv"));
    const auto load = LossColumn(absl::StrCat(b.f.out_dir, "/", phase, "-", i, "/metrics.csv"));
    const bool same = !alone.empty() && alone == load;
    r->identical += same;
    if (!same)
      printf("trainer %ld: its losses in %s differ from its run alone (%zu and %zu steps; "
             "see %s/%s-%ld.log)\n",
             (long)i, phase.c_str(), alone.size(), load.size(), b.f.out_dir.c_str(),
             phase.c_str(), (long)i);
  }
  // The daemon's memory once every session is gone.
  for (int i = 0; i < 100; ++i) {
    auto st = b.client.GetStats();
    r->sessions = st.ok() ? st->sessions() : -1;
    if (r->sessions == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  r->rss_round[round] = RssBytes(b.daemon.pid());
  return r->sessions == 0;
}

// The RSS line and the FIGURE lines; returns the exit status.
int Report(const Bench& bench, uint64_t rss_base, const LoadResult& r) {
  auto stats = bench.client.GetStats();
  printf("daemon RSS: %.1f MiB after the runs alone, %.1f MiB after round 1, %.1f MiB after "
         "round 2 (%ld sessions left)\n",
         rss_base / 1048576.0, r.rss_round[0] / 1048576.0, r.rss_round[1] / 1048576.0,
         (long)r.sessions);
  auto growth = [](uint64_t a, uint64_t b) {
    return static_cast<long long>(b) - static_cast<long long>(a);
  };
  const int64_t trainers = bench.f.trainers;
  printf("FIGURE load_trainers_identical %d of %ld\n", r.identical, (long)(2 * trainers));
  printf("FIGURE load_rss_growth_bytes %lld bytes (round 2, after round 1)\n",
         growth(r.rss_round[0], r.rss_round[1]));
  printf("FIGURE load_rss_growth_first_round_bytes %lld bytes (round 1, after the runs alone)\n",
         growth(rss_base, r.rss_round[0]));
  printf("FIGURE load_push_p50_ms %.3f ms\n", Percentile(r.push_ms, 0.50));
  printf("FIGURE load_push_p99_ms %.3f ms\n", Percentile(r.push_ms, 0.99));
  printf("FIGURE load_update_p50_ms %.3f ms\n", Percentile(r.update_ms, 0.50));
  printf("FIGURE load_update_p99_ms %.3f ms\n", Percentile(r.update_ms, 0.99));
  printf("FIGURE load_rejected_requests %lld\n",
         stats.ok() ? static_cast<long long>(stats->rejected_requests()) : -1LL);
  printf("FIGURE load_sessions_killed %ld\n", (long)r.killed.load());
  return r.identical == 2 * trainers && r.failed == 0 && r.sessions == 0 ? 0 : 1;
}

int Run(int argc, char** argv) {
  Flags f;
  if (int code = ParseFlags(argc, argv, &f); code >= 0) return code;
  testing::SetBinary("trainer/trainer", f.trainer_bin);
  testing::SetBinary("testing/session_holder", f.holder_bin);
  const std::string trainer = testing::FindBinary("trainer/trainer");
  const std::string holder = testing::FindBinary("testing/session_holder");
  if (trainer.empty() || holder.empty()) {
    fprintf(stderr, "load_bench: %s\n",
            trainer.empty()
                ? testing::MissingBinaryMessage("trainer/trainer", "//trainer", "--trainer").c_str()
                : testing::MissingBinaryMessage("testing/session_holder",
                                                "//testing:session_holder",
                                                "--session_holder")
                      .c_str());
    return 1;
  }
  testing::SetBinary("server/stallfreed", f.stallfreed);
  testing::Daemon daemon({"--threads", "2", "--pin", "off"}, "warning");
  if (!daemon.started()) return 1;
  auto client_or = Client::Connect(daemon.socket());
  if (!client_or.ok()) {
    fprintf(stderr, "load_bench: %s\n", client_or.status().ToString().c_str());
    return 1;
  }
  const Bench b{f, trainer, holder, daemon, **client_or};
  if (system(("rm -rf " + f.out_dir + " && mkdir -p " + f.out_dir).c_str()) != 0) return 1;
  printf("load_bench: %ld trainers x %ld steps (tiny preset, zenflow), stallfreed pid %d\n",
         (long)f.trainers, (long)f.steps, daemon.pid());
  std::fflush(stdout);

  // 1. Each trainer alone.
  if (!RunAlone(b)) return 1;
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const uint64_t rss_base = RssBytes(daemon.pid());

  // 2. All at once, with the flooder, the killer and the probe; twice. The first round may raise
  // the RSS once (allocator arenas of threads that the runs alone left idle); the second
  // shows whether anything grows with the work.
  LoadResult r;
  for (int round = 0; round < 2; ++round) {
    if (!RunLoadRound(b, round, &r)) break;
  }
  return Report(b, rss_base, r);
}

}  // namespace
}  // namespace stallfree

int main(int argc, char** argv) { return stallfree::Run(argc, argv); }
