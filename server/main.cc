// stallfreed: the per-node offload daemon.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/status.h"
#include "kernels/optimizer.h"
#include "server/checkpoint.h"
#include "server/fd_server.h"
#include "server/metrics.h"
#include "server/offload_service.h"
#include "server/fd_store.h"
#include "server/service_notify.h"
#include "server/session_manager.h"

namespace {

std::string DefaultSocketDir() {
  const char* xdg = getenv("XDG_RUNTIME_DIR");
  if (xdg != nullptr && *xdg != '\0') return absl::StrCat(xdg, "/stallfree");
  return "/run/stallfree";
}

std::string DefaultStateDir() {
  const char* systemd = getenv("STATE_DIRECTORY");  // StateDirectory= in the unit
  if (systemd != nullptr && *systemd != '\0') return systemd;
  if (getuid() == 0) return "/var/lib/stallfree";
  const char* xdg = getenv("XDG_STATE_HOME");
  if (xdg != nullptr && *xdg != '\0') return absl::StrCat(xdg, "/stallfree");
  const char* home = getenv("HOME");
  if (home != nullptr && *home != '\0') return absl::StrCat(home, "/.local/state/stallfree");
  return "";
}

// Every flag; each is also read from STALLFREE_<NAME> (common/flags.h).
struct Flags {
  std::string socket = DefaultSocketDir() + "/stallfreed.sock";
  std::string fd_socket;
  int64_t threads = 0;
  int64_t pinned_mib = 0;
  std::string pin = "best-effort";
  std::string log_level = "info";
  std::string log_format = "text";
  std::string state_dir = DefaultStateDir();
  int64_t parent_pid = 0;
  std::string metrics_address;
  double update_wait_s = 60;
  int64_t test_unit_delay_us = 0;
  int64_t test_answer_delay_us = 0;
  int64_t test_piece_delay_us = 0;
  double fd_store_hold_s = 300;
};

// Parses the command line into *f; -1 to go on, else the exit code (help, a bad flag).
int ParseFlags(int argc, char** argv, Flags* f) {
  stallfree::FlagSet flags(
      "stallfreed",
      "the stallfree offload daemon: owns pinned host memory and applies AdamW to the "
      "gradients trainers push through shared memory.");
  flags.AddString("socket", &f->socket,
                  "gRPC unix socket path ($XDG_RUNTIME_DIR/stallfree/ or /run/stallfree/)");
  flags.AddString("fd_socket", &f->fd_socket, "fd hand-off socket path (default: <socket>.fd)");
  flags.AddInt("threads", &f->threads, "optimizer worker threads (0: all cores)");
  flags.AddInt("pinned_mib", &f->pinned_mib,
               "pinned-memory budget in MiB for all sessions' regions and state (0: unlimited)");
  flags.AddString("pin", &f->pin,
                  "mlock policy: require (fail if mlock fails), best-effort (warn), off");
  flags.AddString("log_level", &f->log_level, "debug, info, warning or error");
  flags.AddString("log_format", &f->log_format,
                  "text, or json: one JSON object a line (time, level, file, line, message)");
  flags.AddString("state_dir", &f->state_dir,
                  "directory for checkpoints (Checkpoint / Restore); created if missing; empty "
                  "disables them ($STATE_DIRECTORY, else $XDG_STATE_HOME/stallfree or "
                  "~/.local/state/stallfree, /var/lib/stallfree for root)");
  flags.AddInt("parent_pid", &f->parent_pid,
               "stop (as on SIGTERM) when this process, the daemon's parent, exits or is killed: "
               "for a private daemon started by a trainer (0: never)");
  flags.AddDouble("update_wait_s", &f->update_wait_s,
                  "how long a WaitUpdate waits for its Update when the request names no "
                  "timeout_ms (older clients; stallfree's own name their rpc_timeout); past it "
                  "the caller gets DEADLINE_EXCEEDED naming this bound and the session goes on "
                  "(0.001 to 4294967; reported by GetStats)");
  flags.AddString("metrics_address", &f->metrics_address,
                  "serve Prometheus metrics at http://HOST:PORT/metrics (e.g. 127.0.0.1:9464; "
                  "port 0: any free one, logged); empty: off. Every uid's session names appear "
                  "there: bind it where only the node's monitoring reaches");
  flags.AddDouble("fd_store_hold_s", &f->fd_store_hold_s,
                  "under systemd with FileDescriptorStoreMax=: how long a session's state that "
                  "the service manager's fd store passed at start (the daemon before kept it "
                  "there) waits for its process to re-attach before it is dropped from the "
                  "store (its process, while alive, still holds it)");
  flags.AddInt("test_unit_delay_us", &f->test_unit_delay_us,
               "testing only: each unit (up to 1024 elements) of a push or an Update waits this long half way, "
               "so that a crash test can stop the daemon inside one (0: never)");
  flags.AddInt("test_piece_delay_us", &f->test_piece_delay_us,
               "testing only: each piece (up to 1024 cells) of a column handover's exchange waits "
               "this long between its two phases, so that a crash test can stop the daemon "
               "inside one (0: never)");
  flags.AddInt("test_answer_delay_us", &f->test_answer_delay_us,
               "testing only: a column handover's answer waits this long once the handover is "
               "done, so that a crash test can stop the daemon before the answer (0: never)");
  return flags.ParseCommandLine(argc, argv);
}

// The logging set up and the daemon's options from the flags; false (after saying why on
// stderr) for a value that is not one of a flag's words, or a negative count.
bool Configure(Flags* f, stallfree::DaemonOptions* opts) {
  using namespace stallfree;
  LogLevel level;
  if (!ParseLogLevel(f->log_level, &level)) {
    fprintf(stderr, "stallfreed: --log_level: '%s' is not debug, info, warning or error\n",
            f->log_level.c_str());
    return false;
  }
  SetLogLevel(level);
  LogFormat format;
  if (!ParseLogFormat(f->log_format, &format)) {
    fprintf(stderr, "stallfreed: --log_format: '%s' is not text or json\n",
            f->log_format.c_str());
    return false;
  }
  SetLogFormat(format);
  if (f->pin == "require") opts->pin = PinPolicy::kRequire;
  else if (f->pin == "best-effort") opts->pin = PinPolicy::kBestEffort;
  else if (f->pin == "off") opts->pin = PinPolicy::kOff;
  else {
    fprintf(stderr, "stallfreed: --pin: '%s' is not require, best-effort or off\n",
            f->pin.c_str());
    return false;
  }
  if (f->test_unit_delay_us > 0) SetUnitDelayForTesting(f->test_unit_delay_us);
  if (f->test_answer_delay_us > 0) SetHandoverAnswerDelayForTesting(f->test_answer_delay_us);
  if (f->test_piece_delay_us > 0) SetPieceDelayForTesting(f->test_piece_delay_us);
  if (f->threads < 0 || f->pinned_mib < 0 || f->test_unit_delay_us < 0 ||
      f->test_answer_delay_us < 0 || f->test_piece_delay_us < 0) {
    fprintf(stderr, "stallfreed: --threads, --pinned_mib and the --test_*_delay_us flags must be "
            ">= 0\n");
    return false;
  }
  // At least 1 ms, at most what WaitUpdateRequest.timeout_ms can name (about 49 days).
  if (!(f->update_wait_s >= 0.001 && f->update_wait_s <= 4294967.0)) {
    fprintf(stderr, "stallfreed: --update_wait_s: %g is not a number of seconds from 0.001 to "
            "4294967\n", f->update_wait_s);
    return false;
  }
  if (f->fd_socket.empty()) f->fd_socket = f->socket + ".fd";
  opts->state_dir = f->state_dir;
  opts->fd_socket_path = f->fd_socket;
  opts->pinned_budget_bytes = static_cast<uint64_t>(f->pinned_mib) << 20;
  opts->update_wait = std::chrono::milliseconds(std::llround(f->update_wait_s * 1000));
  opts->worker_threads =
      f->threads > 0 ? static_cast<int>(f->threads) : tbb::this_task_arena::max_concurrency();
  return true;
}

// The socket's directory and the state directory; false (logged) if one cannot be made.
bool MakeDirectories(const Flags& f) {
  std::string dir = f.socket.substr(0, f.socket.rfind('/'));
  if (!dir.empty() && mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    SF_LOG(kError, "mkdir(%s) failed: %s (errno %d)", dir, strerror(errno), errno);
    return false;
  }
  if (!f.state_dir.empty()) {
    absl::Status made = stallfree::MakeDirs(f.state_dir, 0700);
    if (!made.ok()) {
      SF_LOG(kError, "--state_dir %s: %s", f.state_dir, made.ToString());
      return false;
    }
    // No session exists yet: whatever an interrupted upload or write left is garbage.
    absl::StatusOr<std::vector<std::string>> swept = stallfree::SweepStateDir(f.state_dir);
    if (!swept.ok()) {
      SF_LOG(kWarning, "--state_dir %s: sweeping leftovers: %s", f.state_dir,
             swept.status().ToString());
    } else {
      for (const std::string& path : *swept)
        SF_LOG(kInfo, "removed %s, left by an interrupted checkpoint write or state transfer",
               path);
    }
  }
  return true;
}

// The gRPC server of `service` on unix:socket (health service on); null (logged) if it cannot
// listen.
std::unique_ptr<grpc::Server> StartGrpc(const std::string& socket,
                                        stallfree::OffloadService* service) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
  builder.RegisterService(service);
  builder.SetMaxReceiveMessageSize(1 << 30);
  builder.SetMaxSendMessageSize(64 << 20);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) {
    SF_LOG(kError, "cannot listen on unix:%s (is another stallfreed running?)", socket);
    return nullptr;
  }
  chmod(socket.c_str(), 0666);
  return server;
}

// systemd (Type=notify): READY once both sockets listen; the watchdog is fed only while a
// GetStats through the daemon's own socket answers. STATUS= counts sessions, pinned memory and
// updates.
std::unique_ptr<stallfree::ServiceNotifier> NewNotifier(const std::string& socket,
                                                        stallfree::SessionManager* sessions) {
  using namespace stallfree;
  std::shared_ptr<v1::Offload::Stub> self(v1::Offload::NewStub(
      grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials())));
  return std::make_unique<ServiceNotifier>(
      [self]() -> absl::Status {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
        v1::GetStatsResponse resp;
        const grpc::Status st = self->GetStats(&ctx, v1::GetStatsRequest(), &resp);
        return st.ok() ? absl::OkStatus()
                       : absl::UnavailableError(absl::StrCat("GetStats: ", st.error_message()));
      },
      [sessions] {
        const v1::Stats st = sessions->GetStats();
        return absl::StrCat(st.sessions(), " sessions, ", st.pinned_bytes() >> 20,
                            " MiB pinned", st.pinned_budget_bytes() > 0
                                ? absl::StrCat(" of ", st.pinned_budget_bytes() >> 20, " MiB")
                                : std::string(),
                            ", ", st.updates(), " updates");
      });
}

// A private daemon follows its parent: when the parent dies (even by SIGKILL) the daemon is
// re-parented, getppid() changes, and it stops as on SIGTERM. Runs until *stop; not joinable
// without a parent_pid.
std::thread WatchParent(int64_t parent_pid, const std::atomic<bool>* stop) {
  if (parent_pid <= 0) return std::thread();
  if (getppid() != static_cast<pid_t>(parent_pid))
    SF_LOG(kWarning, "--parent_pid %d: the parent is already gone (getppid %d); stopping",
           parent_pid, getppid());
  return std::thread([stop, parent_pid] {
    while (!stop->load()) {
      if (getppid() != static_cast<pid_t>(parent_pid)) {
        SF_LOG(kInfo, "parent process %d is gone; stopping", parent_pid);
        kill(getpid(), SIGTERM);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
}

int Run(int argc, char** argv) {
  using namespace stallfree;
  Flags f;
  if (int code = ParseFlags(argc, argv, &f); code >= 0) return code;
  DaemonOptions opts;
  if (!Configure(&f, &opts)) return 2;
  if (!MakeDirectories(f)) return 1;

  // SIGTERM/SIGINT are taken by this thread with sigwait.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);

  // The daemon only enqueues into the arena (the strands); no application thread ever joins it.
  // oneTBB's defaults assume one does: the process gets cores - 1 worker threads and the arena
  // reserves a slot for the joining thread, so the kernels ran on worker_threads - 1 threads
  // (one of two cores). Allow worker_threads workers and reserve no slot.
  tbb::global_control workers(tbb::global_control::max_allowed_parallelism,
                              static_cast<size_t>(opts.worker_threads) + 1);
  tbb::task_arena arena(opts.worker_threads, /*reserved_for_masters=*/0);
  SessionManager sessions(opts, &arena);
  // The service manager's fd store: each session's memfds while it lives; the ones a daemon
  // before this one kept there, finished and held for their processes.
  if (FdStore::Available()) sessions.SetFdStore(&FdStore::Keep, &FdStore::Drop);
  for (const FdStore::Stored& stored : FdStore::TakeStored())
    sessions.HoldStored(stored.key, stored.region_fd, stored.state_fd,
                        std::chrono::seconds(static_cast<int64_t>(f.fd_store_hold_s)))
        .IgnoreError();  // logged
  FdServer fd_server(&sessions);
  absl::Status st = fd_server.Start(f.fd_socket);
  if (!st.ok()) {
    SF_LOG(kError, "cannot serve the fd socket %s: %s", f.fd_socket, st.ToString());
    return 1;
  }
  OffloadService service(&sessions, [&sessions] { return RenderMetrics(&sessions); });
  std::unique_ptr<grpc::Server> server = StartGrpc(f.socket, &service);
  if (!server) return 1;
  SF_LOG(kInfo,
         "stallfreed serving on unix:%s (fd socket %s), %d worker threads, budget %d MiB, pin %s, "
         "optimizer kernel %s, update wait %g s",
         f.socket, f.fd_socket, opts.worker_threads, f.pinned_mib, f.pin,
         kernels::DefaultCpuKernel().name(), opts.update_wait.count() / 1000.0);
  MetricsServer metrics(&sessions);
  if (!f.metrics_address.empty()) {
    absl::Status m = metrics.Start(f.metrics_address);
    if (!m.ok()) {
      SF_LOG(kError, "%s", m.ToString());
      return 1;
    }
    const std::string host = f.metrics_address.substr(0, f.metrics_address.rfind(':'));
    SF_LOG(kInfo, "metrics on http://%s:%d/metrics", host, metrics.port());
  }
  std::unique_ptr<ServiceNotifier> notifier = NewNotifier(f.socket, &sessions);
  notifier->Ready();

  std::atomic<bool> stop{false};
  std::thread housekeeping([&] {
    while (!stop.load()) {
      sessions.Housekeeping();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  std::thread parent_watch = WatchParent(f.parent_pid, &stop);
  int sig = 0;
  sigwait(&sigs, &sig);
  SF_LOG(kInfo, "signal %d: no new requests; finishing running updates", sig);
  notifier->Stopping();
  sessions.Drain();  // new requests get UNAVAILABLE; queued and running work completes.
  metrics.Stop();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  stop.store(true);
  housekeeping.join();
  if (parent_watch.joinable()) parent_watch.join();
  fd_server.Stop();
  unlink(f.socket.c_str());
  SF_LOG(kInfo, "stallfreed stopped");
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return Run(argc, argv); }
