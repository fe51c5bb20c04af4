// Running the trainer binary from a test and reading its metrics (shared by the CPU and GPU
// end-to-end tests).
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace stallfree {
namespace testing {

struct ProcessRun {
  int code = -1;  // exit code, or 128 + signal
  std::string output;  // stdout and stderr
};

// Runs a shell command line, capturing its output.
inline ProcessRun RunShell(const std::string& cmd) {
  ProcessRun r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// The loss column of a trainer's metrics.csv, by step.
inline std::vector<double> MetricsLosses(const std::string& csv) {
  std::ifstream f(csv);
  std::string line;
  std::getline(f, line);
  std::vector<double> out;
  while (std::getline(f, line)) {
    std::stringstream s(line);
    std::string step, loss;
    std::getline(s, step, ',');
    std::getline(s, loss, ',');
    out.push_back(std::stod(loss));
  }
  return out;
}

}  // namespace testing
}  // namespace stallfree
