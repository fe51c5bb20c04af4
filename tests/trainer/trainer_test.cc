// The trainer binary end to end, with a real stallfreed: the loss falls, D = 2 TSP ranks train
// like D = 1, zenflow with S = 1 and awaited updates trains exactly like no-offload, a resumed
// run continues exactly like the uninterrupted one, and a user's mistakes get errors they can act
// on.
#include <stdlib.h>
#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine/blob.h"
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
