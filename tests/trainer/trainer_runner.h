// The CPU end-to-end trainer tests' shared fixture (trainer_test, trainer_bf16_test,
// trainer_dp_test): a real stallfreed per test (2 threads, warnings only) whose runs write under
// its directory; running trainer/trainer from the test's runfiles directory with the flags every
// run starts with; a run's metrics.csv and summary.json read back; and what the resume tests
// share (the uninterrupted, stopped and resumed runs; the proof that the rounds are stale where
// they resume).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "testing/daemon_process.h"
#include "tests/trainer/trainer_process.h"

namespace stallfree {
namespace testing {

// A stallfreed of the test's own; run `name` writes to Dir(name), under the daemon's directory.
class TrainerFixture : public ::testing::Test {
 protected:
  using TrainerRun = ProcessRun;

  // Runs trainer/trainer with args (output captured), in the test's runfiles directory, after
  // `env` (e.g. "RANK=0 WORLD_SIZE=3 ").
  static TrainerRun Trainer(const std::vector<std::string>& args, const std::string& env = "");
  // a, then b.
  static std::vector<std::string> Cat(std::vector<std::string> a,
                                      const std::vector<std::string>& b);
  // A number of summary.json ("key": value), NaN if absent.
  static double SummaryValue(const std::string& json_path, const std::string& key);
  // The largest |a - b| / |a| over the steps both have.
  static double MaxRelativeDifference(const std::vector<double>& a, const std::vector<double>& b);

  void SetUp() override;

  // The flags every run of these tests starts with: the tiny preset, `steps` steps, quiet, on
  // the test's daemon, writing to Dir(name) as run `name`, no evaluation during the run, a
  // 5-step learning-rate warm-up, rounds of 4 (a fixed update_interval: runs are compared).
  std::vector<std::string> TinyRun(const std::string& name, int64_t steps) const;

  std::string Dir(const std::string& name) const { return out_ + "/" + name; }
  std::string Csv(const std::string& name) const { return Dir(name) + "/metrics.csv"; }
  // The loss column of run `name`'s metrics.csv, by step.
  std::vector<double> Losses(const std::string& name) const;
  // A number of run `name`'s summary.json, NaN if absent.
  double Summary(const std::string& name, const std::string& key) const;

  // The runs of a resume test: the uninterrupted run, the same run stopped early, and that one
  // resumed from its checkpoint there.
  struct ResumeRuns {
    TrainerRun full, first, resumed;
  };
  // Runs `full`, then `part` with --stop_at `stop_at`, then `part` with --resume
  // <part_name>-step<stop_at>: each must exit 0, and the last must say that it resumed from that
  // checkpoint at that step. Its failures are fatal: call it in ASSERT_NO_FATAL_FAILURE.
  void RunStoppedAndResumed(const std::vector<std::string>& full,
                            const std::vector<std::string>& part, const std::string& part_name,
                            int64_t stop_at, ResumeRuns* runs) const;

  // A resume test's proof that the rounds are stale where it resumes: run `name` (args: the
  // uninterrupted run's flags and --await_updates) must compute the uninterrupted run's losses
  // `full` through the first `warmup` steps and other ones at every step after step
  // `resumed_at`, so that a resume that lost, or applied early, the pending Update could not
  // have matched the uninterrupted run. Its failures are fatal: call it in
  // ASSERT_NO_FATAL_FAILURE.
  void ExpectAwaitedRunDiffersAfterTheResume(const std::string& name,
                                             const std::vector<std::string>& args,
                                             const std::vector<double>& full, int64_t warmup,
                                             int64_t resumed_at) const;

  std::unique_ptr<Daemon> daemon_;
  std::string out_;  // the runs' parent directory
};

}  // namespace testing
}  // namespace stallfree
