// Daemon: starts a real stallfreed process on a fresh socket under /tmp for tests and
// benchmarks, and kills it on destruction. The binary: FindBinary("server/stallfreed")
// (binaries.h); when there is none, started() is false and error() says where it looked.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "testing/binaries.h"

namespace stallfree {
namespace testing {

// One daemon per object, on its own socket under /tmp (unix socket paths are short).
class Daemon {
 public:
  // `env`: NAME=VALUE entries set in the daemon's environment.
  explicit Daemon(std::vector<std::string> extra = {}, std::string log_level = "debug",
                  std::vector<std::string> env = {})
      : env_(std::move(env)) {
    char tmpl[] = "/tmp/stallfree-test-XXXXXX";
    dir_ = mkdtemp(tmpl);
    chmod(dir_.c_str(), 0755);  // other uids must reach the fd socket to be refused by it.
    socket_ = dir_ + "/d.sock";
    log_ = dir_ + "/daemon.log";
    const std::string binary = FindBinary("server/stallfreed");
    if (binary.empty()) {
      error_ = MissingBinaryMessage("server/stallfreed", "//server:stallfreed", "--stallfreed");
      fprintf(stderr, "%s\n", error_.c_str());
      return;
    }
    std::vector<std::string> args = {binary, "--socket", socket_, "--log_level", log_level};
    bool has_state_dir = false;
    for (auto& e : extra) {
      has_state_dir = has_state_dir || e == "--state_dir";
      args.push_back(e);
    }
    if (!has_state_dir) {  // checkpoints stay inside the test's directory
      args.push_back("--state_dir");
      args.push_back(dir_ + "/state");
    }
    args_ = args;
    Spawn();
  }
  // A sanitizer's report in the log of the daemon (or of one it was restarted as) ends the
  // test process, the report shown: a test that kills and restarts its daemon would otherwise
  // take a daemon the sanitizer stopped for one it killed.
  ~Daemon() {
    Kill();
    const std::string report = SanitizerReport();
    if (!report.empty()) {
      fprintf(stderr, "stallfreed (log %s) stopped on a sanitizer's report:\n%s\n", log_.c_str(),
              report.c_str());
      abort();
    }
    std::string cmd = "rm -rf " + dir_;
    if (system(cmd.c_str()) != 0) perror("rm");
  }
  // SIGKILL and wait (a crash); a no-op when none runs.
  void Kill() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    pid_ = -1;
  }
  // Starts the daemon again with the same arguments, on the same sockets (a restart after
  // Kill or Terminate). `fds`: descriptors passed as systemd passes its fd store's
  // (sd_listen_fds_with_names(3): from 3 on, $LISTEN_FDS, $LISTEN_PID, $LISTEN_FDNAMES), each
  // with its name.
  void Restart(const std::vector<std::pair<std::string, int>>& fds = {}) {
    Kill();
    unlink(socket_.c_str());  // waited for below: the new daemon's own
    Spawn(fds);
  }

 private:
  void Spawn(const std::vector<std::pair<std::string, int>>& fds = {}) {
    const std::vector<std::string>& args = args_;
    pid_ = fork();
    if (pid_ == 0) {
      int fd = open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);  // restarts append
      dup2(fd, 2);
      for (const std::string& e : env_) putenv(const_cast<char*>(e.c_str()));
      if (!fds.empty()) {
        std::vector<int> high;  // out of the way first: the targets may be taken
        for (const auto& f : fds) high.push_back(fcntl(f.second, F_DUPFD, 100));
        std::string names;
        for (size_t i = 0; i < fds.size(); ++i) {
          dup2(high[i], 3 + static_cast<int>(i));
          names += (i > 0 ? ":" : "") + fds[i].first;
        }
        setenv("LISTEN_FDS", std::to_string(fds.size()).c_str(), 1);
        setenv("LISTEN_PID", std::to_string(getpid()).c_str(), 1);
        setenv("LISTEN_FDNAMES", names.c_str(), 1);
      }
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    for (int i = 0; i < 200; ++i) {
      struct stat st;
      if (stat(socket_.c_str(), &st) == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
  }

 public:
  // SIGTERM and wait; returns the exit status.
  int Terminate() {
    if (pid_ <= 0) return -1;
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }
  std::string Log() const {
    std::ifstream f(log_, std::ios::binary);
    std::ostringstream out;
    out << f.rdbuf();
    return out.str();
  }
  // The first sanitizer report in the log (AddressSanitizer, LeakSanitizer, ThreadSanitizer,
  // UBSan's "runtime error"), up to 8,000 characters of it; empty when there is none.
  std::string SanitizerReport() const {
    const std::string log = Log();
    size_t at = std::string::npos;
    for (const char* mark : {"ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
                             "WARNING: ThreadSanitizer", ": runtime error: "}) {
      const size_t found = log.find(mark);
      if (found < at) at = found;
    }
    if (at == std::string::npos) return "";
    at = log.rfind('\n', at);
    return log.substr(at == std::string::npos ? 0 : at + 1, 8000);
  }
  // False when no stallfreed binary was found (error() says where it looked).
  bool started() const { return pid_ > 0; }
  const std::string& error() const { return error_; }
  const std::string& socket() const { return socket_; }
  // The daemon's private temporary directory (removed with the daemon), e.g. for --state_dir.
  const std::string& dir() const { return dir_; }
  pid_t pid() const { return pid_; }

 private:
  std::string dir_, socket_, log_, error_;
  std::vector<std::string> args_;
  std::vector<std::string> env_;
  pid_t pid_ = -1;
};

}  // namespace testing
}  // namespace stallfree
