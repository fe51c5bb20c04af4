// FindBinary: where another of the project's binaries is, for tests and benchmarks that start it
// (stallfreed, the trainer), wherever they were started from:
//   1. an explicit path (a benchmark's --stallfreed / --trainer flag, SetBinary);
//   2. `<runfile>` relative to the working directory, when it is an executable file (bazel test
//      and bazel run start in the runfiles root);
//   3. `<self>.runfiles/stallfree/<runfile>` (a bazel-bin binary run from anywhere);
//   4. `<self's directory>/../<runfile>` (bazel-bin/bench/x finds bazel-bin/server/stallfreed);
//   5. `<self's directory>/<basename>` (a gpu-check bundle: every binary in one folder).
// Header-only; returns "" (and MissingBinaryMessage says where it looked) when none exists.
#pragma once

#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <string>
#include <vector>

namespace stallfree {
namespace testing {

inline std::map<std::string, std::string>& BinaryOverrides() {
  static std::map<std::string, std::string> overrides;
  return overrides;
}

// Uses `path` for `runfile` (e.g. "server/stallfreed") from now on; "" restores the search.
inline void SetBinary(const std::string& runfile, const std::string& path) {
  if (path.empty()) BinaryOverrides().erase(runfile);
  else BinaryOverrides()[runfile] = path;
}

inline std::string SelfExecutable() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "";
  buf[n] = '\0';
  return buf;
}

inline bool IsExecutableFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

// The places FindBinary tries for `runfile`, in order.
inline std::vector<std::string> BinaryCandidates(const std::string& runfile) {
  auto it = BinaryOverrides().find(runfile);
  if (it != BinaryOverrides().end()) return {it->second};
  const std::string self = SelfExecutable();
  const std::string dir = self.substr(0, self.rfind('/') + 1);
  const std::string base = runfile.substr(runfile.rfind('/') + 1);
  return {runfile, self + ".runfiles/stallfree/" + runfile, dir + "../" + runfile, dir + base};
}

inline std::string FindBinary(const std::string& runfile) {
  for (const std::string& c : BinaryCandidates(runfile)) {
    if (!IsExecutableFile(c)) continue;
    if (c[0] == '/') return c;
    char cwd[PATH_MAX];
    return getcwd(cwd, sizeof cwd) ? std::string(cwd) + "/" + c : c;
  }
  return "";
}

// "no <runfile> binary: looked at A, B, ...; build it with `bazel build //<target>` or pass
// <flag> PATH".
inline std::string MissingBinaryMessage(const std::string& runfile, const std::string& target,
                                        const std::string& flag) {
  std::string looked;
  for (const std::string& c : BinaryCandidates(runfile)) looked += (looked.empty() ? "" : ", ") + c;
  return "no " + runfile + " binary: looked at " + looked + "; build it with `bazel build " +
         target + "`" + (flag.empty() ? "" : " or pass " + flag + " PATH");
}

}  // namespace testing
}  // namespace stallfree
