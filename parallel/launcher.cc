#include "parallel/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"

extern char** environ;

namespace stallfree {
namespace parallel {

int LaunchResult::exit_code() const {
  if (first_failed_rank >= 0) {
    const RankExit& r = ranks[first_failed_rank];
    return r.exited ? r.exit_code : 128 + r.signal;
  }
  if (timed_out) return 124;
  return cancelled ? 130 : 0;
}

absl::StatusOr<int> PickFreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("socket", "free port probe");
  sockaddr_in sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = 0;
  socklen_t len = sizeof(sa);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    absl::Status s = ErrnoStatus("bind/getsockname", "127.0.0.1:0");
    ::close(fd);
    return s;
  }
  ::close(fd);
  return static_cast<int>(ntohs(sa.sin_port));
}

namespace {

int RemoveEntry(const char* path, const struct stat*, int, struct FTW*) {
  return ::remove(path);
}

// Copies lines from `fd` to `out_fd`, each prefixed; returns at EOF.
void PumpLines(int fd, int out_fd, std::string prefix) {
  std::string pending;
  char buf[4096];
  auto flush_lines = [&](bool all) {
    size_t start = 0;
    for (;;) {
      size_t nl = pending.find('\n', start);
      if (nl == std::string::npos) break;
      std::string line = prefix + pending.substr(start, nl - start + 1);
      if (::write(out_fd, line.data(), line.size()) < 0) {
        // Nothing sensible to do if our own output is gone.
      }
      start = nl + 1;
    }
    pending.erase(0, start);
    if (all && !pending.empty()) {
      std::string line = prefix + pending + "\n";
      if (::write(out_fd, line.data(), line.size()) < 0) {
      }
      pending.clear();
    }
  };
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    pending.append(buf, static_cast<size_t>(n));
    flush_lines(false);
  }
  flush_lines(true);
  ::close(fd);
}

}  // namespace

absl::StatusOr<LaunchResult> LaunchLocal(const LaunchOptions& options) {
  if (options.nproc < 1) {
    return absl::InvalidArgumentError(absl::StrCat("launch: nproc ", options.nproc, " < 1"));
  }
  if (options.argv.empty()) return absl::InvalidArgumentError("launch: no program given");
  LaunchResult result;
  result.master_port = options.master_port;
  if (result.master_port == 0) {
    ASSIGN_OR_RETURN(result.master_port, PickFreePort());
  }
  std::string store_dir;
  if (options.store == LaunchOptions::Store::kFile) {
    const char* tmp = std::getenv("TEST_TMPDIR");
    if (tmp == nullptr || *tmp == '\0') tmp = std::getenv("TMPDIR");
    if (tmp == nullptr || *tmp == '\0') tmp = "/tmp";
    std::string templ = absl::StrCat(tmp, "/stallfree_store.XXXXXX");
    if (::mkdtemp(&templ[0]) == nullptr) return ErrnoStatus("mkdtemp", templ);
    store_dir = templ;
  }

  // The environment: ours, minus what we set, plus the launcher variables.
  std::map<std::string, std::string> base;
  for (char** e = environ; *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq == nullptr) continue;
    base[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
  }
  base.erase("STALLFREE_STORE_DIR");
  base["WORLD_SIZE"] = std::to_string(options.nproc);
  base["LOCAL_WORLD_SIZE"] = std::to_string(options.nproc);
  base["MASTER_ADDR"] = "127.0.0.1";
  base["MASTER_PORT"] = std::to_string(result.master_port);
  if (!store_dir.empty()) base["STALLFREE_STORE_DIR"] = store_dir;

  auto start = std::chrono::steady_clock::now();
  result.ranks.resize(options.nproc);
  std::vector<std::thread> pumps;
  std::vector<bool> running(options.nproc, false);
  absl::Status start_error;
  for (int r = 0; r < options.nproc; ++r) {
    std::map<std::string, std::string> env = base;
    env["RANK"] = std::to_string(r);
    env["LOCAL_RANK"] = std::to_string(r);
    for (const auto& kv : options.env) env[kv.first] = kv.second;
    std::vector<std::string> env_strings;
    for (const auto& kv : env) env_strings.push_back(kv.first + "=" + kv.second);
    std::vector<char*> envp, argv;
    for (std::string& s : env_strings) envp.push_back(&s[0]);
    envp.push_back(nullptr);
    std::vector<std::string> args = options.argv;
    for (std::string& s : args) argv.push_back(&s[0]);
    argv.push_back(nullptr);

    int out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1};
    if (options.prefix_output) {
      if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0) {
        start_error = ErrnoStatus("pipe2", absl::StrCat("output of rank ", r));
        break;
      }
    }
    pid_t pid = ::fork();
    if (pid < 0) {
      start_error = ErrnoStatus("fork", absl::StrCat("rank ", r));
      break;
    }
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (options.prefix_output) {
        ::dup2(out_pipe[1], STDOUT_FILENO);
        ::dup2(err_pipe[1], STDERR_FILENO);
      }
      ::execvpe(argv[0], argv.data(), envp.data());
      const char msg[] = "launch: exec failed\n";
      if (::write(STDERR_FILENO, msg, sizeof(msg) - 1) < 0) {
      }
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // both sides, to avoid the race
    result.ranks[r].pid = pid;
    running[r] = true;
    if (options.prefix_output) {
      ::close(out_pipe[1]);
      ::close(err_pipe[1]);
      std::string prefix = absl::StrCat("[rank ", r, "] ");
      pumps.emplace_back(PumpLines, out_pipe[0], STDOUT_FILENO, prefix);
      pumps.emplace_back(PumpLines, err_pipe[0], STDERR_FILENO, prefix);
    }
  }

  // Wait loop.
  using Clock = std::chrono::steady_clock;
  bool failure_seen = !start_error.ok();
  Clock::time_point failure_time = Clock::now();
  Clock::time_point term_time;
  bool term_sent = false, kill_sent = false;
  auto signal_all = [&](int sig) {
    for (int r = 0; r < options.nproc; ++r) {
      if (!running[r]) continue;
      result.ranks[r].killed_by_launcher = true;
      ::kill(-result.ranks[r].pid, sig);
      ::kill(result.ranks[r].pid, sig);
    }
  };
  for (;;) {
    bool any_running = false;
    for (int r = 0; r < options.nproc; ++r) {
      if (!running[r]) continue;
      int status = 0;
      pid_t got = ::waitpid(result.ranks[r].pid, &status, WNOHANG);
      if (got == 0) {
        any_running = true;
        continue;
      }
      if (got < 0 && errno == EINTR) {
        any_running = true;
        continue;
      }
      running[r] = false;
      RankExit& e = result.ranks[r];
      if (got > 0 && WIFEXITED(status)) {
        e.exited = true;
        e.exit_code = WEXITSTATUS(status);
      } else if (got > 0 && WIFSIGNALED(status)) {
        e.signal = WTERMSIG(status);
      }
      // A rank that we killed ourselves after a timeout is not "the first failure".
      bool stopped_by_us = (result.timed_out || result.cancelled) && e.killed_by_launcher;
      if (!e.ok() && result.first_failed_rank < 0 && !stopped_by_us) {
        result.first_failed_rank = r;
        if (!failure_seen) {
          failure_seen = true;
          failure_time = Clock::now();
        }
      }
      if (got > 0) {
        // Reap the group's leftovers (e.g. children of a shell) without blocking.
        ::kill(-e.pid, SIGKILL);
      }
    }
    if (!any_running) break;
    Clock::time_point now = Clock::now();
    if (!result.timed_out && options.timeout.count() > 0 && now - start >= options.timeout) {
      result.timed_out = true;
      if (!term_sent) {
        signal_all(SIGTERM);
        term_sent = true;
        term_time = now;
      }
    }
    if (!result.cancelled && options.cancel != nullptr && options.cancel->load()) {
      result.cancelled = true;
      if (!term_sent) {
        signal_all(SIGTERM);
        term_sent = true;
        term_time = now;
      }
    }
    if (failure_seen && !term_sent && now - failure_time >= options.grace) {
      signal_all(SIGTERM);
      term_sent = true;
      term_time = now;
    }
    if (term_sent && !kill_sent && now - term_time >= options.kill_after) {
      signal_all(SIGKILL);
      kill_sent = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (std::thread& t : pumps) t.join();
  if (!store_dir.empty()) {
    ::nftw(store_dir.c_str(), RemoveEntry, 16, FTW_DEPTH | FTW_PHYS);
  }
  result.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  if (!start_error.ok()) return start_error;
  return result;
}

}  // namespace parallel
}  // namespace stallfree
