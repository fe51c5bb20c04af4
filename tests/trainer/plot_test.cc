// trainer/plot.h: a run's figures read back from a metrics CSV (the summary's definitions), the
// modeled step times parsed from offload_modeled_bench's FIGURE lines, the text comparison's
// ratios, and the PNG with its measured and MODELED panels.
#include "trainer/plot.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"

namespace stallfree {
namespace trainer {
namespace {

std::string TempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string templ = std::string(base != nullptr ? base : "/tmp") + "/plot_test.XXXXXX";
  char* dir = mkdtemp(&templ[0]);
  EXPECT_NE(dir, nullptr);
  return templ;
}

std::string WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  EXPECT_TRUE(f.good()) << path;
  return path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

const char kHeader[] =
    "step,loss,eval_loss,lr,tokens_per_s,step_s,compute_s,optimizer_s,copies_s,stall_s,"
    "bytes_to_host,bytes_to_device,grad_norm\n";

// A metrics file of `steps` rows: loss 5 - 0.1 * step, an eval every 5 steps (eval = loss -
// 0.05), step i takes `step_s` seconds (the first 10x that) split 0.8 / 0.1 / 0.05 / 0.05, and
// the gradient norm is 1 except `spike` at step `spike_step`, whose loss is 1.3 higher.
std::string Metrics(int steps, double step_s, double spike, int spike_step) {
  std::string out = kHeader;
  for (int i = 1; i <= steps; ++i) {
    const double loss = 5.0 - 0.1 * i + (i == spike_step ? 1.3 : 0.0);
    const double s = i == 1 ? 10 * step_s : step_s;
    out += absl::StrFormat("%d,%.6f,%s,0.001,100,%.6f,%.6f,%.6f,%.6f,%.6f,0,0,%.3f\n", i, loss,
                           i % 5 == 0 ? absl::StrFormat("%.6f", loss - 0.05) : "nan", s, 0.8 * s,
                           0.1 * s, 0.05 * s, 0.05 * s, i == spike_step ? spike : 1.0);
  }
  return out;
}

const char kModeledOutput[] =
    "mode  step ...\n"
    "no-offload 53.5 52.1 ...\n"
    "FIGURE zenflow_vs_sync_offload_speedup_modeled 1.953 x\n"
    "FIGURE zenflow_step_modeled 57.0 ms\n"
    "FIGURE sync_offload_step_modeled 111.3 ms\n"
    "FIGURE nooffload_step_modeled 53.5 ms\n"
    "FIGURE zenflow_stall_per_step_modeled 1.1 ms\n"
    "FIGURE sync_offload_stall_per_step_modeled 53.3 ms\n"
    "target ...\n";

TEST(ReadRunFiguresTest, SummaryDefinitions) {
  const std::string dir = TempDir();
  const std::string csv = WriteFile(dir + "/m.csv", Metrics(30, 0.5, 136.0, 9));
  absl::StatusOr<RunFigures> r = ReadRunFigures("zenflow", csv);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->label, "zenflow");
  EXPECT_EQ(r->steps, 30);
  EXPECT_NEAR(r->first_loss, 4.9, 1e-9);
  // The mean of steps 21..30: 5 - 0.1 * 25.5.
  EXPECT_NEAR(r->final_loss, 5.0 - 0.1 * 25.5, 1e-9);
  EXPECT_NEAR(r->final_eval, 5.0 - 0.1 * 30 - 0.05, 1e-9);
  EXPECT_NEAR(r->max_loss_rise, 1.3 - 0.1, 1e-9);  // the spike at step 9
  EXPECT_EQ(r->max_loss_rise_step, 9);
  EXPECT_DOUBLE_EQ(r->max_loss_rise_grad_norm, 136.0);
  // The first step (10x slower) is left out of the means.
  EXPECT_NEAR(r->step_s, 0.5, 1e-9);
  EXPECT_NEAR(r->compute_s, 0.4, 1e-9);
  EXPECT_NEAR(r->optimizer_s, 0.05, 1e-9);
  EXPECT_NEAR(r->copies_s, 0.025, 1e-9);
  EXPECT_NEAR(r->stall_s, 0.025, 1e-9);
}

TEST(ReadRunFiguresTest, ShortRunsAndErrors) {
  const std::string dir = TempDir();
  // Fewer than 10 steps: the mean of all of them; one step: its own time; no eval: NaN.
  absl::StatusOr<RunFigures> three =
      ReadRunFigures("a", WriteFile(dir + "/3.csv", Metrics(3, 0.5, 1.0, 0)));
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_NEAR(three->final_loss, 5.0 - 0.2, 1e-9);
  EXPECT_TRUE(std::isnan(three->final_eval));
  EXPECT_EQ(three->max_loss_rise, 0.0);  // the loss only fell
  EXPECT_EQ(three->max_loss_rise_step, 0);
  absl::StatusOr<RunFigures> one =
      ReadRunFigures("a", WriteFile(dir + "/1.csv", Metrics(1, 0.5, 1.0, 0)));
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_NEAR(one->step_s, 5.0, 1e-9);

  EXPECT_EQ(ReadRunFigures("a", dir + "/missing.csv").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ReadRunFigures("a", WriteFile(dir + "/h.csv", kHeader)).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status no_column =
      ReadRunFigures("a", WriteFile(dir + "/c.csv", "step,loss\n1,2\n")).status();
  EXPECT_EQ(no_column.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(no_column.message()).find("eval_loss"), std::string::npos) << no_column;
}

TEST(ParseModeledFiguresTest, TheThreeModesInSeconds) {
  absl::StatusOr<std::vector<ModeledStep>> m = ParseModeledFigures(kModeledOutput);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->size(), 3u);
  EXPECT_EQ((*m)[0].label, "no-offload");
  EXPECT_NEAR((*m)[0].step_s, 0.0535, 1e-12);
  EXPECT_EQ((*m)[0].stall_s, 0.0);
  EXPECT_EQ((*m)[1].label, "sync-offload");
  EXPECT_NEAR((*m)[1].step_s, 0.1113, 1e-12);
  EXPECT_NEAR((*m)[1].stall_s, 0.0533, 1e-12);
  EXPECT_EQ((*m)[2].label, "zenflow");
  EXPECT_NEAR((*m)[2].step_s, 0.057, 1e-12);
  EXPECT_NEAR((*m)[2].stall_s, 0.0011, 1e-12);

  absl::Status missing = ParseModeledFigures("FIGURE zenflow_step_modeled 57.0 ms\n").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(missing.message()).find("nooffload_step_modeled"), std::string::npos);
}

TEST(CompareRunsTest, RatiosAgainstTheBaselineAndModeledMarked) {
  RunFigures base, sync, zen;
  base.label = "no-offload";
  base.final_loss = 2.0;
  base.final_eval = 2.5;
  base.step_s = 1.0;
  sync = base;
  sync.label = "sync-offload";
  sync.step_s = 1.6;
  sync.stall_s = 0.5;
  zen = base;
  zen.label = "zenflow";
  zen.final_loss = 2.2;
  zen.final_eval = 2.6;
  zen.step_s = 1.2;
  zen.stall_s = 0.01;
  zen.max_loss_rise = 1.3;
  zen.max_loss_rise_step = 9;
  zen.max_loss_rise_grad_norm = 136.2;
  auto modeled = ParseModeledFigures(kModeledOutput);
  ASSERT_TRUE(modeled.ok());
  const std::string text = CompareRuns({base, sync, zen}, "no-offload", *modeled, "0.11B model");
  EXPECT_NE(text.find("zenflow / no-offload: final train loss 1.100x, eval loss 1.040x, step "
                      "time 1.200x"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("sync-offload / no-offload: final train loss 1.000x, eval loss 1.000x, "
                      "step time 1.600x"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("zenflow / sync-offload: step time 0.750x"), std::string::npos) << text;
  EXPECT_NE(text.find("+1.300 (step 9, |g| 136)"), std::string::npos) << text;
  EXPECT_NE(text.find("none"), std::string::npos) << text;  // the others never rose
  EXPECT_NE(text.find("MODELED, not measured on a GPU: 0.11B model"), std::string::npos) << text;
  EXPECT_NE(text.find("zenflow / no-offload: step time 1.065x (modeled)"), std::string::npos)
      << text;
  EXPECT_NE(text.find("zenflow / sync-offload: step time 0.512x (modeled)"), std::string::npos)
      << text;

  // Without a baseline run or modeled figures, no ratio against them is made up.
  const std::string alone = CompareRuns({zen}, "no-offload", {}, "");
  EXPECT_EQ(alone.find("x,"), std::string::npos) << alone;
  EXPECT_EQ(alone.find("zenflow / "), std::string::npos) << alone;
  EXPECT_EQ(alone.find("MODELED"), std::string::npos) << alone;
}

TEST(WritePlotTest, ThreeRunsAndTheModeledPanel) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    // make deps installs gnuplot-nox; without it WritePlot must say so.
    EXPECT_EQ(WritePlot("/tmp/x.png", {{"a", "/nonexistent.csv"}}, "t").code(),
              absl::StatusCode::kFailedPrecondition);
    GTEST_SKIP() << "gnuplot is not installed";
  }
  const std::string dir = TempDir();
  PlotOptions o;
  o.title = "demo: it's the three modes";  // a quote in a gnuplot string
  o.runs = {{"no-offload", WriteFile(dir + "/n.csv", Metrics(30, 1.0, 1.0, 0))},
            {"sync-offload", WriteFile(dir + "/s.csv", Metrics(30, 1.6, 1.0, 0))},
            {"zenflow", WriteFile(dir + "/z.csv", Metrics(30, 1.2, 1.0, 0))}};
  o.step_marks = {{20, "warm-up\nends"}};
  o.zoom_from = 20;
  o.modeled = *ParseModeledFigures(kModeledOutput);
  o.modeled_title = "0.11B on a modeled GPU";
  const std::string png = dir + "/train.png";
  absl::Status st = WritePlot(png, o);
  ASSERT_TRUE(st.ok()) << st << "\n" << ReadFile(png + ".log");
  const std::string image = ReadFile(png);
  ASSERT_GT(image.size(), 1000u);
  EXPECT_EQ(image.substr(0, 8), "\x89PNG\r\n\x1a\n");
  const std::string script = ReadFile(png + ".gp");
  EXPECT_NE(script.find("layout 2,2"), std::string::npos)
      << script;  // loss, zoom, measured, modeled
  EXPECT_NE(script.find("set xrange [20:*]"), std::string::npos) << script;
  EXPECT_NE(script.find("\"MODELED step time (not measured on a GPU)\\n0.11B on a modeled GPU\""),
            std::string::npos)
      << script;
  EXPECT_NE(script.find("'demo: it''s the three modes'"), std::string::npos) << script;
  EXPECT_NE(script.find("\"warm-up\\nends\""), std::string::npos) << script;
  for (const char* label : {"'no-offload train'", "'sync-offload train'", "'zenflow train'"})
    EXPECT_NE(script.find(label), std::string::npos) << label << "\n" << script;
  // The measured means leave out the first step; the modeled bars are in ms, the stall apart.
  const std::string breakdown = ReadFile(png + ".breakdown.dat");
  EXPECT_NE(breakdown.find("\"sync-offload\" 1.280000 0.160000 0.080000 0.080000"),
            std::string::npos)
      << breakdown;
  const std::string modeled = ReadFile(png + ".modeled.dat");
  EXPECT_NE(modeled.find("\"sync-offload\" 58.000 53.300"), std::string::npos) << modeled;
  EXPECT_NE(modeled.find("\"zenflow\" 55.900 1.100"), std::string::npos) << modeled;

  // Two panels without modeled figures; a missing metrics file is NotFound.
  ASSERT_TRUE(WritePlot(dir + "/two.png", o.runs, "t").ok());
  EXPECT_NE(ReadFile(dir + "/two.png.gp").find("layout 1,2"), std::string::npos);
  EXPECT_EQ(WritePlot(dir + "/x.png", {{"a", dir + "/none.csv"}}, "t").code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace trainer
}  // namespace stallfree
