#include "tests/trainer/trainer_runner.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace stallfree {
namespace testing {

TrainerFixture::TrainerRun TrainerFixture::Trainer(const std::vector<std::string>& args,
                                                   const std::string& env) {
  std::string cmd = env + "trainer/trainer";
  for (const std::string& a : args) cmd += " '" + a + "'";
  return RunShell(cmd);
}

std::vector<std::string> TrainerFixture::Cat(std::vector<std::string> a,
                                             const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

double TrainerFixture::SummaryValue(const std::string& json_path, const std::string& key) {
  std::ifstream f(json_path);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string s = ss.str();
  const std::string want = "\"" + key + "\": ";
  const size_t at = s.find(want);
  if (at == std::string::npos) return std::nan("");
  return std::strtod(s.c_str() + at + want.size(), nullptr);
}

double TrainerFixture::MaxRelativeDifference(const std::vector<double>& a,
                                             const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    worst = std::max(worst, std::fabs(a[i] - b[i]) / std::fabs(a[i]));
  return worst;
}

void TrainerFixture::SetUp() {
  daemon_ = std::make_unique<Daemon>(std::vector<std::string>{"--threads", "2"}, "warning");
  out_ = daemon_->dir() + "/runs";
}

std::vector<std::string> TrainerFixture::TinyRun(const std::string& name, int64_t steps) const {
  return {"--preset",  "tiny", "--steps",   std::to_string(steps), "--quiet",
          "--socket",  daemon_->socket(), "--out_dir", Dir(name),
          "--run_name", name,  "--eval_every", "0", "--lr_warmup", "5",
          // A fixed round: an automatic one's lengths come from timing, and these runs are
          // compared with each other step for step.
          "--update_interval", "4"};
}

std::vector<double> TrainerFixture::Losses(const std::string& name) const {
  return MetricsLosses(Csv(name));
}

double TrainerFixture::Summary(const std::string& name, const std::string& key) const {
  return SummaryValue(Dir(name) + "/summary.json", key);
}

void TrainerFixture::RunStoppedAndResumed(const std::vector<std::string>& full,
                                          const std::vector<std::string>& part,
                                          const std::string& part_name, int64_t stop_at,
                                          ResumeRuns* runs) const {
  const std::string step = std::to_string(stop_at), tag = part_name + "-step" + step;
  runs->full = Trainer(full);
  ASSERT_EQ(runs->full.code, 0) << runs->full.output;
  runs->first = Trainer(Cat(part, {"--stop_at", step}));
  ASSERT_EQ(runs->first.code, 0) << runs->first.output;
  runs->resumed = Trainer(Cat(part, {"--resume", tag}));
  ASSERT_EQ(runs->resumed.code, 0) << runs->resumed.output;
  EXPECT_NE(runs->resumed.output.find("resumed from checkpoint '" + tag + "' at step " + step),
            std::string::npos)
      << runs->resumed.output;
}

void TrainerFixture::ExpectAwaitedRunDiffersAfterTheResume(const std::string& name,
                                                           const std::vector<std::string>& args,
                                                           const std::vector<double>& full,
                                                           int64_t warmup,
                                                           int64_t resumed_at) const {
  TrainerRun awaited = Trainer(args);
  ASSERT_EQ(awaited.code, 0) << awaited.output;
  const std::vector<double> c = Losses(name);
  ASSERT_EQ(c.size(), full.size());
  for (int64_t i = 0; i < warmup; ++i)
    EXPECT_EQ(c[i], full[i]) << "step " << i + 1 << " (warm-up)";
  for (int64_t i = resumed_at; i < static_cast<int64_t>(full.size()); ++i)
    EXPECT_NE(c[i], full[i]) << "step " << i + 1 << " (after the resume)";
}

}  // namespace testing
}  // namespace stallfree
