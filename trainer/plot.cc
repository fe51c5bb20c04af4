#include "trainer/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace stallfree {
namespace trainer {
namespace {

// A single-quoted gnuplot string ('' is a quote inside one).
std::string GpQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

// A double-quoted gnuplot string, where \n starts a new line.
std::string GpDoubleQuote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '\n')
      out += "\\n";
    else if (c == '"' || c == '\\')
      out += std::string("\\") + c;
    else
      out += c;
  }
  return out + "\"";
}

// A double-quoted column of a whitespace-separated gnuplot data file.
std::string DatQuote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) out += c == '"' ? '\'' : c;
  return out + "\"";
}

double ParseNumber(absl::string_view v) {
  v = absl::StripAsciiWhitespace(v);
  if (v.empty() || v == "nan" || v == "-nan") return std::nan("");
  double d;
  return absl::SimpleAtod(v, &d) ? d : std::nan("");
}

}  // namespace

double FinalTrainLoss(const std::vector<double>& losses, int64_t* tail) {
  const int64_t n = static_cast<int64_t>(losses.size()), t = std::min<int64_t>(10, n);
  if (tail != nullptr) *tail = t;
  if (n == 0) return std::nan("");
  double sum = 0;
  for (int64_t i = n - t; i < n; ++i) sum += losses[i];
  return sum / static_cast<double>(t);
}

absl::StatusOr<RunFigures> ReadRunFigures(const std::string& label, const std::string& csv) {
  std::ifstream f(csv);
  if (!f) return absl::NotFoundError(absl::StrCat("no metrics file ", csv));
  std::string line;
  if (!std::getline(f, line)) return absl::InvalidArgumentError(absl::StrCat(csv, " is empty"));
  std::vector<std::string> names = absl::StrSplit(line, ',');
  std::map<std::string, int> col;
  for (size_t i = 0; i < names.size(); ++i)
    col[std::string(absl::StripAsciiWhitespace(names[i]))] = static_cast<int>(i);
  const char* required[] = {"step",      "loss",        "eval_loss", "step_s",
                            "compute_s", "optimizer_s", "copies_s",  "stall_s"};
  for (const char* name : required)
    if (!col.count(name))
      return absl::InvalidArgumentError(absl::StrCat(csv, " has no column ", name));
  const bool have_norm = col.count("grad_norm") > 0;
  std::vector<double> losses;
  RunFigures r;
  r.label = label;
  r.final_eval = std::nan("");
  r.max_loss_rise_grad_norm = std::nan("");
  const char* timed[] = {"step_s", "compute_s", "optimizer_s", "copies_s", "stall_s"};
  double sum_all[5] = {0, 0, 0, 0, 0}, sum_first[5] = {0, 0, 0, 0, 0};
  while (std::getline(f, line)) {
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    std::vector<std::string> v = absl::StrSplit(line, ',');
    auto at = [&](const char* name) {
      const int c = col[name];
      return c < static_cast<int>(v.size()) ? ParseNumber(v[c]) : std::nan("");
    };
    const double step = at("step"), loss = at("loss");
    if (!losses.empty() && loss - losses.back() > r.max_loss_rise) {
      r.max_loss_rise = loss - losses.back();
      r.max_loss_rise_step = static_cast<int64_t>(step);
      r.max_loss_rise_grad_norm = have_norm ? at("grad_norm") : std::nan("");
    }
    losses.push_back(loss);
    const double eval = at("eval_loss");
    if (!std::isnan(eval)) r.final_eval = eval;
    for (int k = 0; k < 5; ++k) {
      const double t = at(timed[k]);
      (r.steps == 0 ? sum_first : sum_all)[k] += std::isnan(t) ? 0.0 : t;
    }
    ++r.steps;
  }
  if (r.steps == 0) return absl::InvalidArgumentError(absl::StrCat(csv, " has no steps"));
  r.first_loss = losses.front();
  r.final_loss = FinalTrainLoss(losses);
  double* means[5] = {&r.step_s, &r.compute_s, &r.optimizer_s, &r.copies_s, &r.stall_s};
  for (int k = 0; k < 5; ++k)
    *means[k] = r.steps > 1 ? sum_all[k] / static_cast<double>(r.steps - 1) : sum_first[k];
  return r;
}

absl::StatusOr<std::vector<ModeledStep>> ParseModeledFigures(const std::string& text) {
  std::map<std::string, double> figures;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (!absl::ConsumePrefix(&line, "FIGURE ")) continue;
    std::vector<absl::string_view> w = absl::StrSplit(line, ' ', absl::SkipEmpty());
    double value;
    if (w.size() >= 2 && absl::SimpleAtod(w[1], &value)) figures[std::string(w[0])] = value;
  }
  struct Want {
    const char* label;
    const char* step;
    const char* stall;  // nullptr: no stall (no-offload has nothing to wait for)
  };
  const Want wants[] = {
      {"no-offload", "nooffload_step_modeled", nullptr},
      {"sync-offload", "sync_offload_step_modeled", "sync_offload_stall_per_step_modeled"},
      {"zenflow", "zenflow_step_modeled", "zenflow_stall_per_step_modeled"},
  };
  std::vector<ModeledStep> out;
  for (const Want& w : wants) {
    auto step = figures.find(w.step);
    if (step == figures.end())
      return absl::InvalidArgumentError(absl::StrCat("no FIGURE ", w.step, " line"));
    ModeledStep m;
    m.label = w.label;
    m.step_s = step->second / 1e3;
    if (w.stall != nullptr) {
      auto stall = figures.find(w.stall);
      m.stall_s = stall == figures.end() ? 0.0 : stall->second / 1e3;
    }
    out.push_back(m);
  }
  return out;
}

absl::Status WritePlot(const std::string& png, const PlotOptions& o) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0)
    return absl::FailedPreconditionError(
        "gnuplot is not installed (apt-get install gnuplot-nox; make deps does it)");
  const std::string dat = png + ".breakdown.dat";
  {
    std::ofstream d(dat);
    d << "# run compute_s optimizer_s copies_s stall_s\n";
    for (const auto& [label, csv] : o.runs) {
      absl::StatusOr<RunFigures> r = ReadRunFigures(label, csv);
      if (!r.ok()) return r.status();
      d << absl::StrFormat("%s %.6f %.6f %.6f %.6f\n", DatQuote(label), r->compute_s,
                           r->optimizer_s, r->copies_s, r->stall_s);
    }
  }
  const bool modeled = !o.modeled.empty();
  const std::string mdat = png + ".modeled.dat";
  if (modeled) {
    std::ofstream d(mdat);
    d << "# mode step_without_stall_ms stall_ms (MODELED, not measured on a device)\n";
    for (const ModeledStep& m : o.modeled)
      d << absl::StrFormat("%s %.3f %.3f\n", DatQuote(m.label), 1e3 * (m.step_s - m.stall_s),
                           1e3 * m.stall_s);
  }
  // Panels: the loss, its zoom, the measured step times, the modeled ones; four make a 2 x 2
  // grid, fewer a row.
  const bool zoom = o.zoom_from > 0;
  const int panels = 2 + (zoom ? 1 : 0) + (modeled ? 1 : 0);
  const bool grid = panels == 4;
  std::ostringstream gp;
  gp << "set terminal pngcairo size " << (grid ? 1400 : 600 * panels) << "," << (grid ? 1000 : 540)
     << " noenhanced\n"
     << "set output " << GpQuote(png) << "\n"
     << "set datafile separator ','\n"
     << "set datafile missing 'nan'\n"
     << "set multiplot layout " << (grid ? 2 : 1) << "," << (grid ? 2 : panels) << " title "
     << GpQuote(o.title) << "\n"
     << "set xlabel 'step'\nset ylabel 'cross-entropy (nats/token)'\nset key top right\n"
     << "set grid\n";
  std::ostringstream curves;
  for (size_t i = 0; i < o.runs.size(); ++i) {
    const auto& [label, csv] = o.runs[i];
    curves << (i ? ", " : "") << GpQuote(csv) << " using 1:2 skip 1 with lines lw 2 dt " << i + 1
           << " lc " << i + 1 << " title " << GpQuote(label + " train") << ", " << GpQuote(csv)
           << " using 1:3 skip 1 with points pt " << 7 + 2 * static_cast<int>(i) << " ps 1.3 lc "
           << i + 1 << " title " << GpQuote(label + " eval");
  }
  gp << "set title 'loss'\n";
  for (size_t i = 0; i < o.step_marks.size(); ++i) {
    const auto& [step, label] = o.step_marks[i];
    gp << "set arrow " << i + 1 << " from " << step << ", graph 0 to " << step
       << ", graph 1 nohead dt 3 lw 1.5 lc rgb 'gray30'\n"
       << "set label " << i + 1 << " " << GpDoubleQuote(label) << " at " << step
       << ", graph 0.55 left offset 0.8,0 tc rgb 'gray20'\n";
  }
  gp << "plot " << curves.str() << "\n";
  if (zoom) {
    gp << "set title " << GpQuote(absl::StrCat("the same, from step ", o.zoom_from)) << "\n"
       << "set xrange [" << o.zoom_from
       << ":*]\nunset arrow\nunset label\n";  // it starts at a mark
    gp << "plot " << curves.str() << "\nset xrange [*:*]\n";
  }
  gp << "unset arrow\nunset label\n"
     << "set datafile separator whitespace\n"
     << "set title 'mean step time, measured on this machine'\nset xlabel ''\n"
     << "set ylabel 'seconds per step (measured)'\n"
     << "set style data histograms\nset style histogram rowstacked\n"
     << "set style fill solid 0.8 border -1\nset boxwidth 0.6\n"
     << "set key outside top center horizontal\nset yrange [0:*]\n"
     << "plot " << GpQuote(dat) << " using 2:xtic(1) title 'compute', '' using 3 title "
     << "'optimizer', '' using 4 title 'copies', '' using 5 title 'stall'\n";
  if (modeled)
    gp << "set title "
       << GpDoubleQuote("MODELED step time (not measured on a GPU)\n" + o.modeled_title) << "\n"
       << "set ylabel 'ms per step (modeled)'\n"
       << "plot " << GpQuote(mdat) << " using 2:xtic(1) title 'step without stall (modeled)' "
       << "lc 6, '' using 3 title 'stall (modeled)' lc 4\n";
  gp << "unset multiplot\n";
  const std::string script = png + ".gp";
  {
    std::ofstream s(script);
    s << gp.str();
  }
  const std::string cmd = absl::StrCat("gnuplot '", script, "' 2>'", png, ".log'");
  if (std::system(cmd.c_str()) != 0)
    return absl::InternalError(absl::StrCat("gnuplot failed; see ", png, ".log"));
  return absl::OkStatus();
}

absl::Status WritePlot(const std::string& png,
                       const std::vector<std::pair<std::string, std::string>>& runs,
                       const std::string& title) {
  PlotOptions o;
  o.title = title;
  o.runs = runs;
  return WritePlot(png, o);
}

std::string CompareRuns(const std::vector<RunFigures>& runs, const std::string& baseline,
                        const std::vector<ModeledStep>& modeled, const std::string& modeled_what) {
  std::string out;
  size_t width = 4;
  for (const RunFigures& r : runs) width = std::max(width, r.label.size());
  for (const ModeledStep& m : modeled) width = std::max(width, m.label.size());
  const int w = static_cast<int>(width);
  absl::StrAppendFormat(&out, "%-*s  %-17s %9s  %-24s %8s  %s\n", w, "run", "train loss",
                        "eval loss", "largest loss rise", "step s",
                        "(compute / optimizer / copies / stall)");
  for (const RunFigures& r : runs)
    absl::StrAppendFormat(
        &out, "%-*s  %.3f -> %-8.4f %9.4f  %-24s %8.3f  (%.3f / %.3f / %.3f / %.3f)\n", w, r.label,
        r.first_loss, r.final_loss, r.final_eval,
        r.max_loss_rise_step > 0
            ? absl::StrFormat("+%.3f (step %ld, |g| %.3g)", r.max_loss_rise,
                              (long)r.max_loss_rise_step, r.max_loss_rise_grad_norm)
            : std::string("none"),
        r.step_s, r.compute_s, r.optimizer_s, r.copies_s, r.stall_s);
  absl::StrAppend(
      &out,
      "(train loss: the first step's -> the mean of the last 10 (or all) steps; largest loss "
      "rise: from one step to the next; step s: the mean over every step after the "
      "first)\n");
  auto find = [&](const std::string& label) -> const RunFigures* {
    for (const RunFigures& r : runs)
      if (r.label == label) return &r;
    return nullptr;
  };
  if (const RunFigures* base = find(baseline)) {
    for (const RunFigures& r : runs) {
      if (&r == base) continue;
      absl::StrAppendFormat(&out,
                            "%s / %s: final train loss %.3fx, eval loss %.3fx, step time %.3fx\n",
                            r.label, base->label, r.final_loss / base->final_loss,
                            r.final_eval / base->final_eval, r.step_s / base->step_s);
    }
  }
  const RunFigures* zen = find("zenflow");
  const RunFigures* sync = find("sync-offload");
  if (zen != nullptr && sync != nullptr)
    absl::StrAppendFormat(&out,
                          "zenflow / sync-offload: step time %.3fx (stall %.3f s against %.3f s)\n",
                          zen->step_s / sync->step_s, zen->stall_s, sync->stall_s);
  if (!modeled.empty()) {
    absl::StrAppendFormat(&out, "\nMODELED, not measured on a GPU: %s\n", modeled_what);
    std::map<std::string, const ModeledStep*> by;
    for (const ModeledStep& m : modeled) {
      by[m.label] = &m;
      absl::StrAppendFormat(&out, "%-*s  step %8.1f ms (modeled), stall %7.1f ms\n", w, m.label,
                            1e3 * m.step_s, 1e3 * m.stall_s);
    }
    const ModeledStep* mz = by.count("zenflow") ? by["zenflow"] : nullptr;
    const ModeledStep* mn = by.count("no-offload") ? by["no-offload"] : nullptr;
    const ModeledStep* ms = by.count("sync-offload") ? by["sync-offload"] : nullptr;
    if (mz != nullptr && mn != nullptr)
      absl::StrAppendFormat(&out, "zenflow / no-offload: step time %.3fx (modeled)\n",
                            mz->step_s / mn->step_s);
    if (mz != nullptr && ms != nullptr)
      absl::StrAppendFormat(&out, "zenflow / sync-offload: step time %.3fx (modeled)\n",
                            mz->step_s / ms->step_s);
  }
  return out;
}

}  // namespace trainer
}  // namespace stallfree
