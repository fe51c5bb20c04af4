// The trainer binary end to end, with a real stallfreed: the loss falls, D = 2 TSP ranks train
// like D = 1, zenflow with S = 1 and awaited updates trains exactly like no-offload, a resumed
// run continues exactly like the uninterrupted one, and a user's mistakes get errors they can act
// on.
#include <stdlib.h>
#include <sys/stat.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "client/client.h"
#include "engine/blob.h"
#include "testing/spawn.h"
#include "trainer/checkpoint.h"
#include "tests/trainer/trainer_runner.h"

namespace stallfree {
namespace {

class TrainerTest : public testing::TrainerFixture {
 protected:
  // Common flags: the tiny preset, quiet, on the test's daemon.
  std::vector<std::string> Base(const std::string& name, int64_t steps) const {
    return TinyRun(name, steps);
  }
};

TEST_F(TrainerTest, LossFallsAndTwoRanksTrainLikeOne) {
  const int64_t steps = 40;
  TrainerRun one = Trainer(Cat(Base("d1", steps), {"--nproc", "1"}));
  ASSERT_EQ(one.code, 0) << one.output;
  TrainerRun two = Trainer(Cat(Base("d2", steps), {"--nproc", "2"}));
  ASSERT_EQ(two.code, 0) << two.output;
  std::vector<double> a = Losses("d1"), b = Losses("d2");
  ASSERT_EQ(a.size(), static_cast<size_t>(steps));
  ASSERT_EQ(b.size(), static_cast<size_t>(steps));
  double first = (a[0] + a[1] + a[2]) / 3, last = (a[steps - 3] + a[steps - 2] + a[steps - 1]) / 3;
  EXPECT_LT(last, 0.8 * first) << "the loss did not fall: " << first << " -> " << last;
  // TSP over 2 ranks computes the same sums in another order; the runs drift apart only by
  // rounding, amplified by training.
  for (int64_t i = 0; i < steps; ++i)
    EXPECT_NEAR(a[i], b[i], 2e-3 * std::fabs(a[i])) << "step " << i + 1;
  EXPECT_NE(one.output.find("== summary"), std::string::npos) << one.output;
}

// With no staleness (S = 1, awaited, a reselection every step, fp32 transfers) zenflow computes
// what no-offload does. 2 warm-up steps (exact AdamW by construction), then 18 steps of rounds;
// the same run without --await_updates (each daemon update lands a step late) computes other
// losses from then on: the runs do reach ZenFlow's rounds, where staleness could show.
TEST_F(TrainerTest, ZenFlowWithZeroStalenessTrainsExactlyLikeNoOffload) {
  const std::vector<std::string> rounds = {"--update_interval", "1",    "--select_interval", "1",
                                           "--grad_dtype",      "fp32", "--param_dtype",     "fp32",
                                           "--topk_ratio",      "0.25", "--engine_warmup",   "2",
                                           "--mode",            "zenflow"};
  TrainerRun zf = Trainer(Cat(Cat(Base("zf", 20), rounds), {"--await_updates"}));
  ASSERT_EQ(zf.code, 0) << zf.output;
  TrainerRun plain = Trainer(Cat(Base("plain", 20), {"--mode", "no-offload"}));
  ASSERT_EQ(plain.code, 0) << plain.output;
  EXPECT_EQ(Losses("zf"), Losses("plain"));
  TrainerRun stale = Trainer(Cat(Base("stale", 20), rounds));
  ASSERT_EQ(stale.code, 0) << stale.output;
  const std::vector<double> a = Losses("plain"), b = Losses("stale");
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(b[i], a[i]) << "step " << i + 1 << " (warm-up)";
  for (int i = 4; i < 20; ++i) EXPECT_NE(b[i], a[i]) << "step " << i + 1 << " (rounds)";
}

TEST_F(TrainerTest, ResumeEqualsUninterruptedRun) {
  // 4 warm-up steps, then S = 4 (boundaries at steps 8, 12, 16, 20): the checkpoint at step 10
  // falls in the middle of a round, with the Update of the round that ended at step 8 pending.
  const std::vector<std::string> rounds = {"--nproc", "2", "--engine_warmup", "4"};
  ResumeRuns runs;
  ASSERT_NO_FATAL_FAILURE(RunStoppedAndResumed(Cat(Base("full", 20), rounds),
                                               Cat(Base("part", 20), rounds), "part", 10, &runs));
  const TrainerRun &first = runs.first, &resumed = runs.resumed;
  // Both summaries say which steps ran, and the resumed one's first loss is step 11's, not nan.
  EXPECT_NE(first.output.find("steps 1-10 of 20 (stopped early: --stop_at)"), std::string::npos)
      << first.output;
  EXPECT_NE(resumed.output.find("steps 11-20 of 20 (resumed after step 10)"), std::string::npos)
      << resumed.output;
  EXPECT_EQ(resumed.output.find("train loss   nan"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("(step 11 -> the mean of the last 10 steps)"), std::string::npos)
      << resumed.output;
  std::vector<double> a = Losses("full"), b = Losses("part");
  // The resumed run appends steps 11..20 to the first run's 1..10.
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
  // The rounds are stale where the test resumes: the same run with every Update awaited agrees
  // through the warm-up (4 steps) and differs at every step after the resume (step 10), so a
  // resume that lost or applied early the pending Update could not have matched the
  // uninterrupted run.
  ASSERT_NO_FATAL_FAILURE(ExpectAwaitedRunDiffersAfterTheResume(
      "awaited", Cat(Base("awaited", 20), Cat(rounds, {"--await_updates"})), a, 4, 10));
}

// With the automatic round (update_interval 0) the TSP ranks choose the same lengths, from
// figures summed over the world: each updates its own copy of the replicated embedding, so a
// rank that chose on its own figures (a slower answer from the daemon, a busier core) would
// let its copy drift. After 40 steps both copies are bit-identical and both checkpoints hold
// the same round.
TEST_F(TrainerTest, AutomaticRoundIsTheSameOnEveryRank) {
  TrainerRun run = Trainer(Cat(Base("auto", 40), {"--nproc", "2", "--update_interval", "0",
                                                  "--engine_warmup", "2",
                                                  "--checkpoint_every", "40"}));
  ASSERT_EQ(run.code, 0) << run.output;
  absl::StatusOr<trainer::RankState> st[2];
  absl::StatusOr<EngineBlob> blob[2];
  for (int r = 0; r < 2; ++r) {
    st[r] = trainer::DecodeState(trainer::RankFile(Dir("auto"), "auto-step40", r));
    ASSERT_TRUE(st[r].ok()) << st[r].status();
    blob[r] = ParseEngineBlob(st[r]->engine);
    ASSERT_TRUE(blob[r].ok()) << blob[r].status();
    EXPECT_EQ(blob[r]->magic, kEngineBlobMagicV4);
  }
  EXPECT_EQ(st[0]->tensors[0], st[1]->tensors[0]);  // the embedding, replicated
  EXPECT_EQ(blob[0]->round_interval, blob[1]->round_interval);
  EXPECT_EQ(blob[0]->round_base, blob[1]->round_base);
  EXPECT_GE(blob[0]->round_base, 2);  // a choice was made (at the warm-up's end or later)
}

// --device_budget B: the hot share is the largest whose engine state fits B bytes a parameter
// (engine/zenflow.h, TopkForBudget, tested by hand there): the run says which, and the engine's
// device bytes per parameter in summary.json stay within B, above what the default share takes
// on this model (so the budget bought more hot columns); too small a budget ends the run naming
// device_budget and the least it takes.
TEST_F(TrainerTest, DeviceBudgetSizesTheHotShare) {
  auto engine_bytes = [&](const std::string& name) {
    std::ifstream f(Dir(name) + "/summary.json");
    std::stringstream text;
    text << f.rdbuf();
    const std::string s = text.str(), key = "\"engine_device_bytes_per_param\": ";
    const size_t at = s.find(key);
    return at == std::string::npos ? -1.0 : std::stod(s.substr(at + key.size()));
  };
  TrainerRun base = Trainer(Base("budget0", 2));
  ASSERT_EQ(base.code, 0) << base.output;
  TrainerRun r = Trainer(Cat(Base("budget", 2), {"--device_budget", "6"}));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string said = "device_budget 6 bytes a parameter: topk_ratio ";
  const size_t at = r.output.find(said);
  ASSERT_NE(at, std::string::npos) << r.output;
  EXPECT_GT(std::stod(r.output.substr(at + said.size())), 0.1) << r.output;
  const double with_budget = engine_bytes("budget"), without = engine_bytes("budget0");
  EXPECT_LE(with_budget, 6.0);
  EXPECT_GT(with_budget, without);
  r = Trainer(Cat(Base("budget1", 2), {"--device_budget", "0.01"}));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("device_budget"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("least"), std::string::npos) << r.output;
}

// --keep_checkpoints N: after each checkpoint only the run's newest N stay, the trainer's files
// of every rank and the daemon's state files of the same tags; 0 keeps every one.
TEST_F(TrainerTest, KeepCheckpointsRemovesOlderTrainerAndDaemonFiles) {
  auto list = [](const std::string& dir) {
    std::vector<std::string> names;
    testing::ProcessRun ls = testing::RunShell("ls -1 " + dir);
    std::istringstream in(ls.output);
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) names.push_back(line);
    return names;
  };
  const std::string daemon_dir = daemon_->dir() + "/state/" + std::to_string(getuid());
  TrainerRun kept = Trainer(Cat(Base("keep", 14), {"--nproc", "2", "--checkpoint_every", "2",
                                                   "--keep_checkpoints", "2", "--stop_at", "12"}));
  ASSERT_EQ(kept.code, 0) << kept.output;
  EXPECT_EQ(list(out_ + "/keep/checkpoints"),
            (std::vector<std::string>{"keep-step10.rank0.trainer", "keep-step10.rank1.trainer",
                                      "keep-step12.rank0.trainer", "keep-step12.rank1.trainer"}));
  EXPECT_EQ(list(daemon_dir), (std::vector<std::string>{"keep-step10.r0.sfckpt",
                                                        "keep-step10.r1.sfckpt",
                                                        "keep-step12.r0.sfckpt",
                                                        "keep-step12.r1.sfckpt"}));
  // The newest resumes, and the resumed run prunes the same way.
  TrainerRun resumed = Trainer(Cat(Base("keep", 14), {"--nproc", "2", "--resume", "keep-step12",
                                                      "--checkpoint_every", "2",
                                                      "--keep_checkpoints", "2"}));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_EQ(list(daemon_dir), (std::vector<std::string>{"keep-step12.r0.sfckpt",
                                                        "keep-step12.r1.sfckpt",
                                                        "keep-step14.r0.sfckpt",
                                                        "keep-step14.r1.sfckpt"}));
  TrainerRun all = Trainer(Cat(Base("all", 6), {"--checkpoint_every", "2",
                                                "--keep_checkpoints", "0"}));
  ASSERT_EQ(all.code, 0) << all.output;
  EXPECT_EQ(list(out_ + "/all/checkpoints").size(), 3u);
  TrainerRun bad = Trainer(Cat(Base("bad", 2), {"--keep_checkpoints", "-1"}));
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.output.find("keep_checkpoints: must be >= 0"), std::string::npos) << bad.output;
}

// "exec trainer/trainer ARGS" with the --socket of args replaced by `socket`.
std::string OnSocket(std::vector<std::string> args, const std::string& socket) {
  for (size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == "--socket") args[i + 1] = socket;
  std::string cmd = "exec trainer/trainer";
  for (const std::string& a : args) cmd += " '" + a + "'";
  return cmd;
}

// Waits until the run's metrics.csv has `rows` steps (false after 60 s).
bool WaitForSteps(const std::string& csv, size_t rows) {
  for (int i = 0; i < 6000; ++i) {
    std::ifstream f(csv);
    size_t n = 0;
    for (std::string line; std::getline(f, line);) ++n;
    if (n >= rows + 1) return true;
    usleep(10000);
  }
  return false;
}

// 20 SIGKILLs of the daemon in a 200-step zenflow run (2 ranks, rounds of S = 4 after 4 warm-up
// steps, no periodic checkpoint to fall back to), each followed at once by a daemon on the same
// socket (as systemd's Restart= would): the run goes on where it was every time. Every other
// kill of the first sixteen is aimed inside an Update (the test polls the daemon's sessions and
// kills once one says its Update runs; the daemon's units are slowed by its testing flag
// --test_unit_delay_us so that an Update lasts long enough to be aimed at); the others fall at
// random instants. The daemons that took the sessions back must have finished at least 5 Updates
// that the kills cut short (their log says so), every loss equals the uninterrupted run's, the
// final parameters of both ranks equal its bit for bit, metrics.csv holds each step once, and
// no step is computed again (the log never falls back to a checkpoint or starts over).
TEST_F(TrainerTest, TwentyDaemonKillsInA200StepRunCostNoStep) {
  const int64_t steps = 200;
  const std::vector<std::string> flags = {"--nproc", "2", "--engine_warmup", "4", "--stop_at",
                                          "200"};
  TrainerRun ref = Trainer(Cat(Base("ref", steps), flags));
  ASSERT_EQ(ref.code, 0) << ref.output;
  testing::Daemon own({"--threads", "2", "--test_unit_delay_us", "1000"}, "info");
  ASSERT_TRUE(own.started()) << own.error();
  const pid_t trainer = testing::Spawn(
      OnSocket(Cat(Base("kills", steps), flags), own.socket()) + " --reconnect_s 60 > " + out_ +
      "/kills.log 2>&1");
  ASSERT_TRUE(WaitForSteps(Csv("kills"), 6)) << "the run did not reach step 6";
  std::mt19937 rng(20);
  std::uniform_int_distribution<int> pause_ms(30, 250);
  auto updating = [&] {
    auto client = Client::Connect(own.socket(), 1000, 2);
    if (!client.ok()) return false;
    auto sessions = (*client)->ListSessions();
    if (!sessions.ok()) return false;
    for (const v1::SessionInfo& s : *sessions)
      if (s.update_running()) return true;
    return false;
  };
  int kills = 0;
  int status = 0;
  bool exited = false;
  for (int k = 0; k < 20 && !exited; ++k) {
    if (k < 16 && k % 2 == 0) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (!updating() && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms(rng)));
    }
    exited = waitpid(trainer, &status, WNOHANG) == trainer;
    if (exited) break;
    own.Kill();
    own.Restart();
    ++kills;
  }
  if (!exited) waitpid(trainer, &status, 0);
  const std::string log = testing::RunShell("cat " + out_ + "/kills.log").output;
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << log;
  EXPECT_EQ(kills, 20) << "the run ended before its 20 kills\n" << log;
  const std::string daemon_log = own.Log();
  int finished = 0;
  for (size_t at = 0; (at = daemon_log.find(", cut short by the daemon before", at)) !=
                      std::string::npos;
       ++at)
    ++finished;
  EXPECT_GE(finished, 5) << "Updates finished by the next daemon:\n" << daemon_log;
  EXPECT_NE(log.find("taken back at version"), std::string::npos) << log;
  EXPECT_EQ(log.find("continuing from checkpoint"), std::string::npos) << log;
  EXPECT_EQ(log.find("starts over"), std::string::npos) << log;
  EXPECT_EQ(log.find("computed again"), std::string::npos) << log;
  const std::vector<double> a = Losses("ref"), b = Losses("kills");
  ASSERT_EQ(a.size(), static_cast<size_t>(steps));
  ASSERT_EQ(b.size(), static_cast<size_t>(steps)) << "metrics.csv must hold each step once";
  for (int64_t i = 0; i < steps; ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<trainer::RankState> want =
        trainer::DecodeState(trainer::RankFile(Dir("ref"), "ref-step200", r));
    absl::StatusOr<trainer::RankState> got =
        trainer::DecodeState(trainer::RankFile(Dir("kills"), "kills-step200", r));
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->tensors == want->tensors) << "rank " << r << "'s final parameters differ";
  }
}

// A session the daemon closes under a running trainer (stallfreectl close: the daemon then
// answers NOT_FOUND, or ABORTED to a call waiting on the session) is a lost daemon too
// (trainer/daemon_loss.h decides by status code, and by asking the daemon whether it still has
// the session): the trainer continues from its last checkpoint with a new session, and its
// losses equal an uninterrupted run's, every one of them.
TEST_F(TrainerTest, ASessionClosedUnderARunIsRecoveredLikeALostDaemon) {
  const std::vector<std::string> flags = {"--checkpoint_every", "5", "--engine_warmup", "4"};
  TrainerRun ref = Trainer(Cat(Base("ref", 120), flags));
  ASSERT_EQ(ref.code, 0) << ref.output;
  const pid_t trainer = testing::Spawn(OnSocket(Cat(Base("closed", 120), flags),
                                                daemon_->socket()) +
                                       " --reconnect_s 30 > " + out_ + "/closed.log 2>&1");
  ASSERT_TRUE(WaitForSteps(Csv("closed"), 12)) << "the run did not reach step 12";
  // The run's session, the only one on the test's daemon.
  const std::string ctl = "client/stallfreectl --socket " + daemon_->socket();
  const TrainerRun listed = testing::RunShell(ctl + " -o json sessions");
  const size_t at = listed.output.find("\"session_id\": \"");
  ASSERT_NE(at, std::string::npos) << listed.output;
  const std::string id = listed.output.substr(at + 15, listed.output.find('"', at + 15) - at - 15);
  const TrainerRun closed = testing::RunShell(ctl + " close " + id);
  EXPECT_EQ(closed.code, 0) << closed.output;
  int status = 0;
  waitpid(trainer, &status, 0);
  const std::string log = testing::RunShell("cat " + out_ + "/closed.log").output;
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << log;
  EXPECT_NE(log.find("went away"), std::string::npos) << log;
  EXPECT_NE(log.find("stallfreed is back; continuing from checkpoint 'closed-step"),
            std::string::npos)
      << log;
  const std::vector<double> a = Losses("ref"), b = Losses("closed");
  ASSERT_EQ(a.size(), 120u);
  ASSERT_EQ(b.size(), 120u) << "metrics.csv must hold each step once";
  for (int i = 0; i < 120; ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
}

// Without the daemon coming back within --reconnect_s, the run stops with an error that names
// the socket, the last checkpoint and the command that continues from it.
TEST_F(TrainerTest, ADaemonThatStaysAwayEndsTheRunWithTheResumeCommand) {
  testing::Daemon own({"--threads", "2"}, "warning");
  ASSERT_TRUE(own.started()) << own.error();
  testing::RunShell("mkdir -p " + out_);
  const pid_t trainer = testing::Spawn(
      OnSocket(Cat(Base("gone", 400), {"--checkpoint_every", "5"}), own.socket()) +
      " --reconnect_s 1 > " + out_ + "/gone.log 2>&1");
  ASSERT_TRUE(WaitForSteps(Csv("gone"), 12));
  own.Kill();
  int status = 0;
  waitpid(trainer, &status, 0);
  const std::string log = testing::RunShell("cat " + out_ + "/gone.log").output;
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << log;
  EXPECT_NE(log.find("stallfreed at " + own.socket() + " went away"), std::string::npos) << log;
  EXPECT_NE(log.find("did not answer within --reconnect_s 1 s"), std::string::npos) << log;
  EXPECT_NE(log.find("the last checkpoint is 'gone-step"), std::string::npos) << log;
  EXPECT_NE(log.find("continue with: trainer/trainer --preset tiny"), std::string::npos) << log;
  EXPECT_NE(log.find(" --resume gone-step"), std::string::npos) << log;
}

TEST_F(TrainerTest, InitFromStartsAnyModeFromAnotherRunsWeights) {
  TrainerRun pre = Trainer(Cat(Base("pre", 30), {"--mode", "no-offload"}));
  ASSERT_EQ(pre.code, 0) << pre.output;
  const std::string init = out_ + "/pre/checkpoints/pre-step30";
  TrainerRun tuned = Trainer(Cat(Base("tuned", 10), {"--init_from", init, "--lr", "3e-4"}));
  ASSERT_EQ(tuned.code, 0) << tuned.output;
  EXPECT_NE(tuned.output.find("initialised from " + init + " (step 30 of that run)"),
            std::string::npos)
      << tuned.output;
  // The same batches from the initial weights and from the pre-trained ones.
  std::vector<double> fresh = Losses("pre"), warm = Losses("tuned");
  ASSERT_FALSE(warm.empty());
  EXPECT_LT(warm[0], 0.8 * fresh[0]);
  EXPECT_NEAR(warm[0], fresh.back(), 0.15 * fresh.back());
  TrainerRun both = Trainer(Cat(Base("both", 10), {"--init_from", init, "--resume", "x"}));
  EXPECT_EQ(both.code, 2);
  EXPECT_NE(both.output.find("init_from: cannot be combined with --resume"), std::string::npos);
  TrainerRun other = Trainer(Cat(Base("other", 10), {"--init_from", init, "--layers", "3"}));
  EXPECT_NE(other.code, 0);
  EXPECT_NE(other.output.find("holds another model"), std::string::npos) << other.output;
}

TEST_F(TrainerTest, UserErrorsSayWhatToDo) {
  TrainerRun r = Trainer({"--preset", "tiny", "--steps", "2", "--socket", "/tmp/no-such-dir/x.sock",
                   "--out_dir", out_ + "/e1"});
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("start one with: stallfreed --socket /tmp/no-such-dir/x.sock"),
            std::string::npos)
      << r.output;
  r = Trainer(Cat(Base("e2", 2), {"--nproc", "3"}));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("heads: 4 attention heads do not divide over 3 ranks"),
            std::string::npos)
      << r.output;
  r = Trainer(Cat(Base("e3", 2), {"--data", out_ + "/missing.txt"}));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("missing.txt"), std::string::npos) << r.output;
  const std::string empty = daemon_->dir() + "/empty.txt";
  { std::ofstream f(empty); }
  r = Trainer(Cat(Base("e4", 2), {"--data", empty}));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("empty"), std::string::npos) << r.output;
  r = Trainer({"--help"});
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.output.find("--resume"), std::string::npos);
  r = Trainer(Cat(Base("e5", 2), {"--mode", "turbo"}));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("mode"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace stallfree
