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

int Run(int argc, char** argv) {
  bool quick = false;
  int64_t trainers = 8, steps = 0;
  std::string stallfreed, trainer_bin, holder_bin, out_dir = "/tmp/stallfree-load-bench";
  FlagSet flags("load_bench",
                "trainers, a flooder and a session killer on one stallfreed: losses must equal "
                "each trainer's run alone, RSS must return to its baseline; push and update "
                "latency under load");
  flags.AddBool("quick", &quick, "a short run (about 30 s here; default about 2 min)");
  flags.AddInt("trainers", &trainers, "concurrent trainer processes");
  flags.AddInt("steps", &steps, "steps per trainer (0: 96 quick, 640 otherwise)");
  flags.AddString("out_dir", &out_dir, "where the trainers' runs go");
  flags.AddString("stallfreed", &stallfreed,
                  "the stallfreed binary (default: found beside this one)");
  flags.AddString("trainer", &trainer_bin, "the trainer binary (default: found beside this one)");
  flags.AddString("session_holder", &holder_bin,
                  "the session-holder test binary (default: found beside this one)");
  if (int code = flags.ParseCommandLine(argc, argv); code >= 0) return code;
  if (steps <= 0) steps = quick ? 96 : 640;
  if (trainers < 1) {
    fprintf(stderr, "load_bench: --trainers must be >= 1\n");
    return 2;
  }
  testing::SetBinary("trainer/trainer", trainer_bin);
  testing::SetBinary("tests/server/session_holder", holder_bin);
  const std::string trainer = testing::FindBinary("trainer/trainer");
  const std::string holder = testing::FindBinary("tests/server/session_holder");
  if (trainer.empty() || holder.empty()) {
    fprintf(stderr, "load_bench: %s\n",
            trainer.empty()
                ? testing::MissingBinaryMessage("trainer/trainer", "//trainer", "--trainer").c_str()
                : testing::MissingBinaryMessage("tests/server/session_holder",
                                                "//tests/server:session_holder",
                                                "--session_holder")
                      .c_str());
    return 1;
  }
  testing::SetBinary("server/stallfreed", stallfreed);
  testing::Daemon daemon({"--threads", "2", "--pin", "off"}, "warning");
  if (!daemon.started()) return 1;
  auto client_or = Client::Connect(daemon.socket());
  if (!client_or.ok()) {
    fprintf(stderr, "load_bench: %s\n", client_or.status().ToString().c_str());
    return 1;
  }
  Client& client = **client_or;
  if (system(("rm -rf " + out_dir + " && mkdir -p " + out_dir).c_str()) != 0) return 1;
  auto command = [&](int64_t i, const std::string& phase) {
    const std::string name = absl::StrCat(phase, "-", i);
    return absl::StrCat(trainer, " --preset tiny --quiet --mode zenflow --nproc 1 --steps ", steps,
                        " --seed ", i + 1, " --eval_every 0 --keep_checkpoints 1 --socket ",
                        daemon.socket(), " --out_dir ", out_dir, "/", name, " --run_name ", name,
                        " > ", out_dir, "/", name, ".log 2>&1");
  };
  printf("load_bench: %ld trainers x %ld steps (tiny preset, zenflow), stallfreed pid %d\n",
         (long)trainers, (long)steps, daemon.pid());
  std::fflush(stdout);

  // 1. Each trainer alone.
  const auto t_alone = Clock::now();
  for (int64_t i = 0; i < trainers; ++i) {
    const int rc = system(command(i, "alone").c_str());
    if (rc != 0) {
      fprintf(stderr, "load_bench: trainer %ld alone failed (status %d); see %s/alone-%ld.log\n",
              (long)i, rc, out_dir.c_str(), (long)i);
      return 1;
    }
  }
  printf("alone: %ld runs in %.1f s\n", (long)trainers,
         std::chrono::duration<double>(Clock::now() - t_alone).count());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const uint64_t rss_base = RssBytes(daemon.pid());

  // 2. All at once, with the flooder, the killer and the probe; twice. The first round may raise
  // the RSS once (allocator arenas of threads that the runs alone left idle); the second
  // shows whether anything grows with the work.
  std::atomic<bool> stop{false};
  std::atomic<int64_t> flooded{0}, killed{0};
  std::vector<double> push_ms, update_ms;
  int identical = 0, failed = 0;
  int64_t sessions = -1;
  uint64_t rss_round[2] = {0, 0};
  for (int round = 0; round < 2; ++round) {
    stop.store(false);
    std::thread flooder([&] {
      auto c = Client::Connect(daemon.socket());
      if (!c.ok()) return;
      auto s = (*c)->OpenSession("flooder", 9);
      if (!s.ok() || !(*s)->RegisterParams({{"w", {64, 64}, v1::DTYPE_BF16}}).ok()) return;
      std::mt19937_64 rng(9 + round);
      while (!stop.load()) {
        v1::PushGradientsRequest r;
        *r.mutable_session() = (*s)->ref();
        if (rng() % 4 == 0) {  // someone else's session, or a wrong token
          r.mutable_session()->set_session_id(rng() % 64);
          r.mutable_session()->set_token(std::string(32, 'f'));
        }
        r.set_slot(static_cast<uint32_t>(rng() % 3));
        v1::GradRange* g = r.add_ranges();
        g->set_param(rng() % 2 ? "w" : "nope");
        g->set_offset(rng() % 2 ? ~uint64_t{0} - 1 : rng() % 100000);
        g->set_length(rng() % 2 ? ~uint64_t{0} : (rng() % 100000) * 2);
        g->set_first_element(rng() % 10000);
        grpc::ClientContext ctx;
        v1::PushGradientsResponse resp;
        (*c)->stub()->PushGradients(&ctx, r, &resp);
        flooded++;
      }
    });
    std::thread killer([&] {
      while (!stop.load()) {
        const std::string ready = absl::StrCat(out_dir, "/holder.ready");
        unlink(ready.c_str());
        pid_t pid = testing::Spawn(
            absl::StrCat("exec ", holder, " ", daemon.socket(), " 65536 > ", ready));
        for (int i = 0; i < 200 && !stop.load(); ++i) {
          std::ifstream f(ready);
          std::string word;
          if (f >> word && word == "ready") break;
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
        killed++;
      }
    });
    std::thread probe([&] {
      auto s = client.OpenSession("probe", 10);
      if (!s.ok() || !(*s)->RegisterParams({{"w", {256, 256}, v1::DTYPE_BF16}}).ok() ||
          !(*s)->LoadParams().ok())
        return;
      v1::AdamWHyper h;
      h.set_lr(1e-3);
      h.set_beta1(0.9);
      h.set_beta2(0.999);
      h.set_eps(1e-8);
      for (int64_t step = 1; !stop.load(); ++step) {
        auto t0 = Clock::now();
        if (!(*s)->Push(step, 0).ok()) return;
        push_ms.push_back(Ms(Clock::now() - t0));
        t0 = Clock::now();
        if (!(*s)->Update(step, h, step % 2, v1::DTYPE_BF16, true).ok()) return;
        if (!(*s)->WaitUpdate(step).ok()) return;
        update_ms.push_back(Ms(Clock::now() - t0));
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    });
    const auto t_load = Clock::now();
    const std::string phase = absl::StrCat("load", round + 1);
    std::vector<pid_t> pids;
    for (int64_t i = 0; i < trainers; ++i) pids.push_back(testing::Spawn(command(i, phase)));
    for (pid_t pid : pids) {
      int status = 0;
      waitpid(pid, &status, 0);
      failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    const double load_s = std::chrono::duration<double>(Clock::now() - t_load).count();
    stop.store(true);
    flooder.join();
    killer.join();
    probe.join();
    printf("round %d under load: %ld trainers in %.1f s (%d failed so far), %ld flooding "
           "requests and %ld sessions killed with their owners so far\n",
           round + 1, (long)trainers, load_s, failed, (long)flooded.load(), (long)killed.load());

    // Losses against the runs alone.
    for (int64_t i = 0; i < trainers; ++i) {
      const auto alone = LossColumn(absl::StrCat(out_dir, "/alone-", i, "/metrics.csv"));
      const auto load = LossColumn(absl::StrCat(out_dir, "/", phase, "-", i, "/metrics.csv"));
      const bool same = !alone.empty() && alone == load;
      identical += same;
      if (!same)
        printf("trainer %ld: its losses in %s differ from its run alone (%zu and %zu steps; "
               "see %s/%s-%ld.log)\n",
               (long)i, phase.c_str(), alone.size(), load.size(), out_dir.c_str(), phase.c_str(),
               (long)i);
    }
    // The daemon's memory once every session is gone.
    for (int i = 0; i < 100; ++i) {
      auto st = client.GetStats();
      sessions = st.ok() ? st->sessions() : -1;
      if (sessions == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    rss_round[round] = RssBytes(daemon.pid());
    if (sessions != 0) break;
  }
  auto stats = client.GetStats();
  printf("daemon RSS: %.1f MiB after the runs alone, %.1f MiB after round 1, %.1f MiB after "
         "round 2 (%ld sessions left)\n",
         rss_base / 1048576.0, rss_round[0] / 1048576.0, rss_round[1] / 1048576.0,
         (long)sessions);
  auto growth = [](uint64_t a, uint64_t b) {
    return static_cast<long long>(b) - static_cast<long long>(a);
  };
  printf("FIGURE load_trainers_identical %d of %ld\n", identical, (long)(2 * trainers));
  printf("FIGURE load_rss_growth_bytes %lld bytes (round 2, after round 1)\n",
         growth(rss_round[0], rss_round[1]));
  printf("FIGURE load_rss_growth_first_round_bytes %lld bytes (round 1, after the runs alone)\n",
         growth(rss_base, rss_round[0]));
  printf("FIGURE load_push_p50_ms %.3f ms\n", Percentile(push_ms, 0.50));
  printf("FIGURE load_push_p99_ms %.3f ms\n", Percentile(push_ms, 0.99));
  printf("FIGURE load_update_p50_ms %.3f ms\n", Percentile(update_ms, 0.50));
  printf("FIGURE load_update_p99_ms %.3f ms\n", Percentile(update_ms, 0.99));
  printf("FIGURE load_rejected_requests %lld\n",
         stats.ok() ? static_cast<long long>(stats->rejected_requests()) : -1LL);
  printf("FIGURE load_sessions_killed %ld\n", (long)killed.load());
  return identical == 2 * trainers && failed == 0 && sessions == 0 ? 0 : 1;
}

}  // namespace
}  // namespace stallfree

int main(int argc, char** argv) { return stallfree::Run(argc, argv); }
