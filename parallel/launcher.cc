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

// A fresh store directory for LaunchOptions::Store::kFile, under $TEST_TMPDIR, $TMPDIR or /tmp.
absl::StatusOr<std::string> MakeStoreDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  if (tmp == nullptr || *tmp == '\0') tmp = std::getenv("TMPDIR");
  if (tmp == nullptr || *tmp == '\0') tmp = "/tmp";
  std::string templ = absl::StrCat(tmp, "/stallfree_store.XXXXXX");
  if (::mkdtemp(&templ[0]) == nullptr) return ErrnoStatus("mkdtemp", templ);
  return templ;
}

// The ranks' common environment: ours, minus what we set, plus the launcher variables.
std::map<std::string, std::string> BaseEnvironment(int nproc, int master_port,
                                                   const std::string& store_dir) {
  std::map<std::string, std::string> base;
  for (char** e = environ; *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq == nullptr) continue;
    base[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
  }
  base.erase("STALLFREE_STORE_DIR");
  base["WORLD_SIZE"] = std::to_string(nproc);
  base["LOCAL_WORLD_SIZE"] = std::to_string(nproc);
  base["MASTER_ADDR"] = "127.0.0.1";
  base["MASTER_PORT"] = std::to_string(master_port);
  if (!store_dir.empty()) base["STALLFREE_STORE_DIR"] = store_dir;
  return base;
}

// The ranks of one launch: starts them, waits for them (with the grace, timeout, cancel and
// kill escalation of LaunchOptions) and records how each ended in the result.
class RankGroup {
 public:
  using Clock = std::chrono::steady_clock;

  RankGroup(const LaunchOptions& options, LaunchResult* result)
      : o_(options), result_(result), running_(options.nproc, false) {
    result_->ranks.resize(options.nproc);
  }

  // Starts every rank; stops at the first that cannot be started (its error), leaving the
  // started ones to Wait.
  absl::Status Start(const std::map<std::string, std::string>& base) {
    for (int r = 0; r < o_.nproc; ++r) RETURN_IF_ERROR(StartRank(r, base));
    return absl::OkStatus();
  }

  // Waits until every started rank has ended; a failed start counts as a failure from now (the
  // others get the grace period).
  void Wait(Clock::time_point start, bool start_failed) {
    failure_seen_ = start_failed;
    failure_time_ = Clock::now();
    while (Reap()) {
      Escalate(Clock::now(), start);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    for (std::thread& t : pumps_) t.join();
  }

 private:
  absl::Status StartRank(int r, const std::map<std::string, std::string>& base) {
    std::map<std::string, std::string> env = base;
    env["RANK"] = std::to_string(r);
    env["LOCAL_RANK"] = std::to_string(r);
    for (const auto& kv : o_.env) env[kv.first] = kv.second;
    std::vector<std::string> env_strings;
    for (const auto& kv : env) env_strings.push_back(kv.first + "=" + kv.second);
    std::vector<char*> envp, argv;
    for (std::string& s : env_strings) envp.push_back(&s[0]);
    envp.push_back(nullptr);
    std::vector<std::string> args = o_.argv;
    for (std::string& s : args) argv.push_back(&s[0]);
    argv.push_back(nullptr);

    int out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1};
    if (o_.prefix_output &&
        (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0)) {
      return ErrnoStatus("pipe2", absl::StrCat("output of rank ", r));
    }
    pid_t pid = ::fork();
    if (pid < 0) return ErrnoStatus("fork", absl::StrCat("rank ", r));
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (o_.prefix_output) {
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
    result_->ranks[r].pid = pid;
    running_[r] = true;
    if (o_.prefix_output) {
      ::close(out_pipe[1]);
      ::close(err_pipe[1]);
      std::string prefix = absl::StrCat("[rank ", r, "] ");
      pumps_.emplace_back(PumpLines, out_pipe[0], STDOUT_FILENO, prefix);
      pumps_.emplace_back(PumpLines, err_pipe[0], STDERR_FILENO, prefix);
    }
    return absl::OkStatus();
  }

  // Records every rank that has ended since the last call; true while any still runs.
  bool Reap() {
    bool any_running = false;
    for (int r = 0; r < o_.nproc; ++r) {
      if (!running_[r]) continue;
      int status = 0;
      pid_t got = ::waitpid(result_->ranks[r].pid, &status, WNOHANG);
      if (got == 0 || (got < 0 && errno == EINTR)) {
        any_running = true;
        continue;
      }
      running_[r] = false;
      RankExit& e = result_->ranks[r];
      if (got > 0 && WIFEXITED(status)) {
        e.exited = true;
        e.exit_code = WEXITSTATUS(status);
      } else if (got > 0 && WIFSIGNALED(status)) {
        e.signal = WTERMSIG(status);
      }
      // A rank that we killed ourselves after a timeout is not "the first failure".
      const bool stopped_by_us =
          (result_->timed_out || result_->cancelled) && e.killed_by_launcher;
      if (!e.ok() && result_->first_failed_rank < 0 && !stopped_by_us) {
        result_->first_failed_rank = r;
        if (!failure_seen_) {
          failure_seen_ = true;
          failure_time_ = Clock::now();
        }
      }
      // Reap the group's leftovers (e.g. children of a shell) without blocking.
      if (got > 0) ::kill(-e.pid, SIGKILL);
    }
    return any_running;
  }

  // SIGTERM on a timeout, a cancel or when a failure's grace is over; SIGKILL kill_after later.
  void Escalate(Clock::time_point now, Clock::time_point start) {
    if (!result_->timed_out && o_.timeout.count() > 0 && now - start >= o_.timeout) {
      result_->timed_out = true;
      Terminate(now);
    }
    if (!result_->cancelled && o_.cancel != nullptr && o_.cancel->load()) {
      result_->cancelled = true;
      Terminate(now);
    }
    if (failure_seen_ && now - failure_time_ >= o_.grace) Terminate(now);
    if (term_sent_ && !kill_sent_ && now - term_time_ >= o_.kill_after) {
      SignalAll(SIGKILL);
      kill_sent_ = true;
    }
  }

  // SIGTERM to every running rank, once.
  void Terminate(Clock::time_point now) {
    if (term_sent_) return;
    SignalAll(SIGTERM);
    term_sent_ = true;
    term_time_ = now;
  }

  void SignalAll(int sig) {
    for (int r = 0; r < o_.nproc; ++r) {
      if (!running_[r]) continue;
      result_->ranks[r].killed_by_launcher = true;
      ::kill(-result_->ranks[r].pid, sig);
      ::kill(result_->ranks[r].pid, sig);
    }
  }

  const LaunchOptions& o_;
  LaunchResult* const result_;
  std::vector<bool> running_;
  std::vector<std::thread> pumps_;
  bool failure_seen_ = false;
  Clock::time_point failure_time_;
  bool term_sent_ = false, kill_sent_ = false;
  Clock::time_point term_time_;
};

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
    ASSIGN_OR_RETURN(store_dir, MakeStoreDir());
  }
  const auto start = RankGroup::Clock::now();
  RankGroup ranks(options, &result);
  const absl::Status start_error =
      ranks.Start(BaseEnvironment(options.nproc, result.master_port, store_dir));
  ranks.Wait(start, !start_error.ok());
  if (!store_dir.empty()) {
    ::nftw(store_dir.c_str(), RemoveEntry, 16, FTW_DEPTH | FTW_PHYS);
  }
  result.wall_s = std::chrono::duration<double>(RankGroup::Clock::now() - start).count();
  if (!start_error.ok()) return start_error;
  return result;
}

}  // namespace parallel
}  // namespace stallfree
