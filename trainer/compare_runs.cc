// compare_runs: one plot of several trainer runs and a short text comparison of them
// (trainer/plot.h), as `make demo` shows its three modes.
//
//   compare_runs --png demo-out/train.png --baseline no-offload [--modeled bench-output.txt]
//       no-offload=demo-out/no-offload/metrics.csv
//       sync-offload=demo-out/sync-offload/metrics.csv zenflow=demo-out/zenflow/metrics.csv
//
// --modeled names a file holding bench/offload_modeled_bench's output: its FIGURE lines give the
// modeled device step time of each mode, drawn in a third panel and printed, marked as modeled.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/flags.h"
#include "trainer/plot.h"

int main(int argc, char** argv) {
  using namespace stallfree;
  std::string png, title = "training runs", baseline = "no-offload", modeled_file,
                   modeled_title = "a modeled device", marks;
  FlagSet flags("compare_runs",
                "draws one plot of trainer runs (loss curves, measured step times, optionally "
                "modeled ones) and prints their comparison.\n\n"
                "Usage: compare_runs --png OUT.png [flags] LABEL=metrics.csv...");
  flags.AddString("png", &png, "the plot to write (gnuplot); empty: print the comparison only");
  flags.AddString("title", &title, "the plot's title");
  flags.AddString("baseline", &baseline, "the label the other runs are compared with");
  flags.AddString("modeled", &modeled_file,
                  "a file with bench/offload_modeled_bench's output (its FIGURE lines): the "
                  "modeled step times, drawn and printed as modeled");
  flags.AddString("modeled_title", &modeled_title, "what the modeled figures model");
  flags.AddString("marks", &marks,
                  "vertical lines on the loss panels: STEP=LABEL, separated by ';' (a newline "
                  "in LABEL breaks it)");
  double zoom_from = 0;
  flags.AddDouble("zoom_from", &zoom_from,
                  "> 0: a second loss panel from this step on, with its own y range");
  if (int code = flags.ParseCommandLine(argc, argv); code >= 0) return code;
  if (flags.positional().empty()) {
    fprintf(stderr, "compare_runs: name at least one run as LABEL=metrics.csv\n");
    return 2;
  }
  trainer::PlotOptions o;
  o.title = title;
  o.zoom_from = zoom_from;
  std::vector<trainer::RunFigures> figures;
  for (const std::string& arg : flags.positional()) {
    std::vector<std::string> kv = absl::StrSplit(arg, absl::MaxSplits('=', 1));
    if (kv.size() != 2 || kv[0].empty() || kv[1].empty()) {
      fprintf(stderr, "compare_runs: '%s' is not LABEL=metrics.csv\n", arg.c_str());
      return 2;
    }
    absl::StatusOr<trainer::RunFigures> r = trainer::ReadRunFigures(kv[0], kv[1]);
    if (!r.ok()) {
      fprintf(stderr, "compare_runs: %s\n", std::string(r.status().message()).c_str());
      return 1;
    }
    figures.push_back(*r);
    o.runs.push_back({kv[0], kv[1]});
  }
  for (absl::string_view mark : absl::StrSplit(marks, ';', absl::SkipEmpty())) {
    std::vector<std::string> kv = absl::StrSplit(mark, absl::MaxSplits('=', 1));
    double step;
    if (kv.size() != 2 || !absl::SimpleAtod(kv[0], &step)) {
      fprintf(stderr, "compare_runs: --marks: '%s' is not STEP=LABEL\n", std::string(mark).c_str());
      return 2;
    }
    o.step_marks.push_back({step, kv[1]});
  }
  if (!modeled_file.empty()) {
    std::ifstream f(modeled_file);
    std::stringstream text;
    text << f.rdbuf();
    absl::StatusOr<std::vector<trainer::ModeledStep>> m =
        f ? trainer::ParseModeledFigures(text.str())
          : absl::NotFoundError("cannot read " + modeled_file);
    if (m.ok()) {
      // In the runs' order where the labels match, so that both panels line up.
      auto rank = [&](const trainer::ModeledStep& x) {
        for (size_t i = 0; i < o.runs.size(); ++i)
          if (o.runs[i].first == x.label) return i;
        return o.runs.size();
      };
      std::stable_sort(m->begin(), m->end(),
                       [&](const auto& a, const auto& b) { return rank(a) < rank(b); });
      o.modeled = *m;
      o.modeled_title = modeled_title;
    } else {
      fprintf(stderr, "compare_runs: no modeled figures (%s): the plot shows the measured ones\n",
              std::string(m.status().message()).c_str());
    }
  }
  printf("%s", trainer::CompareRuns(figures, baseline, o.modeled, modeled_title).c_str());
  if (!png.empty()) {
    absl::Status st = trainer::WritePlot(png, o);
    if (!st.ok()) {
      fprintf(stderr, "compare_runs: plot not drawn: %s\n", std::string(st.message()).c_str());
      return 1;
    }
    printf("plot: %s\n", png.c_str());
  }
  return 0;
}
