#include "trainer/plot.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace stallfree {
namespace trainer {
namespace {

// Mean compute, optimizer, copies, stall (s) over the rows after the first.
absl::Status MeanTimes(const std::string& csv, double out[4]) {
  std::ifstream f(csv);
  if (!f) return absl::NotFoundError(absl::StrCat("no metrics file ", csv));
  std::string line;
  std::getline(f, line);  // header
  std::vector<std::string> names = absl::StrSplit(line, ',');
  int col[4] = {-1, -1, -1, -1};
  const char* want[4] = {"compute_s", "optimizer_s", "copies_s", "stall_s"};
  for (size_t i = 0; i < names.size(); ++i)
    for (int k = 0; k < 4; ++k)
      if (names[i] == want[k]) col[k] = static_cast<int>(i);
  for (int k = 0; k < 4; ++k) {
    if (col[k] < 0) return absl::InvalidArgumentError(absl::StrCat(csv, " has no ", want[k]));
    out[k] = 0;
  }
  int rows = 0;
  bool first = true;
  while (std::getline(f, line)) {
    if (first) {
      first = false;
      continue;
    }
    std::vector<std::string> v = absl::StrSplit(line, ',');
    for (int k = 0; k < 4; ++k)
      if (col[k] < static_cast<int>(v.size())) out[k] += std::atof(v[col[k]].c_str());
    ++rows;
  }
  for (int k = 0; k < 4; ++k) out[k] /= std::max(rows, 1);
  return absl::OkStatus();
}

}  // namespace

absl::Status WritePlot(const std::string& png,
                       const std::vector<std::pair<std::string, std::string>>& runs,
                       const std::string& title) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0)
    return absl::FailedPreconditionError(
        "gnuplot is not installed (apt-get install gnuplot-nox; make deps does it)");
  const std::string dat = png + ".breakdown.dat";
  {
    std::ofstream d(dat);
    d << "# run compute_s optimizer_s copies_s stall_s\n";
    for (const auto& [label, csv] : runs) {
      double t[4];
      absl::Status st = MeanTimes(csv, t);
      if (!st.ok()) return st;
      d << absl::StrFormat("\"%s\" %.6f %.6f %.6f %.6f\n", label, t[0], t[1], t[2], t[3]);
    }
  }
  std::ostringstream gp;
  gp << "set terminal pngcairo size 1200,500 noenhanced\n"
     << "set output '" << png << "'\n"
     << "set datafile separator ','\n"
     << "set datafile missing 'nan'\n"
     << "set multiplot layout 1,2 title '" << title << "'\n"
     << "set title 'loss'\nset xlabel 'step'\nset ylabel 'cross-entropy (nats/token)'\n"
     << "set key top right\nset grid\n"
     << "plot ";
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& [label, csv] = runs[i];
    gp << (i ? ", " : "") << "'" << csv << "' using 1:2 skip 1 with lines lw 2 lc " << i + 1
       << " title '" << label << " train', '" << csv
       << "' using 1:3 skip 1 with points pt 7 ps 1.2 lc " << i + 1 << " title '" << label
       << " eval'";
  }
  gp << "\nset datafile separator whitespace\n"
     << "set title 'mean step time'\nset xlabel ''\nset ylabel 'seconds'\n"
     << "set style data histograms\nset style histogram rowstacked\n"
     << "set style fill solid 0.8 border -1\nset boxwidth 0.6\nset key top left\n"
     << "plot '" << dat << "' using 2:xtic(1) title 'compute', '' using 3 title 'optimizer', "
     << "'' using 4 title 'copies', '' using 5 title 'stall'\n"
     << "unset multiplot\n";
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

}  // namespace trainer
}  // namespace stallfree
