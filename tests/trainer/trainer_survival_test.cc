// The trainer when its daemon goes away: 20 SIGKILLs of stallfreed in a 200-step zenflow run,
// each followed by a new daemon on the same socket, cost no step and change no bit; a session
// closed under a run is recovered like a lost daemon; a daemon that stays away ends the run with
// the command that continues it. `make test` runs these under AddressSanitizer (the trainer, its
// client and the daemons it loses and finds again all built so).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "client/client.h"
#include "testing/spawn.h"
#include "trainer/checkpoint.h"
#include "tests/trainer/trainer_runner.h"

namespace stallfree {
namespace {

using TrainerSurvivalTest = testing::TrainerFixture;

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
TEST_F(TrainerSurvivalTest, TwentyDaemonKillsInA200StepRunCostNoStep) {
  const int64_t steps = 200;
  const std::vector<std::string> flags = {"--nproc", "2", "--engine_warmup", "4", "--stop_at",
                                          "200"};
  TrainerRun ref = Trainer(Cat(TinyRun("ref", steps), flags));
  ASSERT_EQ(ref.code, 0) << ref.output;
  testing::Daemon own({"--threads", "2", "--test_unit_delay_us", "1000"}, "info");
  ASSERT_TRUE(own.started()) << own.error();
  const pid_t trainer = testing::Spawn(
      OnSocket(Cat(TinyRun("kills", steps), flags), own.socket()) + " --reconnect_s 60 > " + out_ +
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
TEST_F(TrainerSurvivalTest, ASessionClosedUnderARunIsRecoveredLikeALostDaemon) {
  const std::vector<std::string> flags = {"--checkpoint_every", "5", "--engine_warmup", "4"};
  TrainerRun ref = Trainer(Cat(TinyRun("ref", 120), flags));
  ASSERT_EQ(ref.code, 0) << ref.output;
  const pid_t trainer = testing::Spawn(OnSocket(Cat(TinyRun("closed", 120), flags),
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
TEST_F(TrainerSurvivalTest, ADaemonThatStaysAwayEndsTheRunWithTheResumeCommand) {
  testing::Daemon own({"--threads", "2"}, "warning");
  ASSERT_TRUE(own.started()) << own.error();
  testing::RunShell("mkdir -p " + out_);
  const pid_t trainer = testing::Spawn(
      OnSocket(Cat(TinyRun("gone", 400), {"--checkpoint_every", "5"}), own.socket()) +
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

}  // namespace
}  // namespace stallfree
