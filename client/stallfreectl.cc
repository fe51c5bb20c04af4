// stallfreectl: admin CLI for stallfreed (health, stats, sessions, checkpoints).
#include <poll.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_format.h"
#include "client/client.h"
#include "common/flags.h"

namespace {

std::string DefaultSocket() {
  const char* xdg = getenv("XDG_RUNTIME_DIR");
  if (xdg != nullptr && *xdg != '\0') return std::string(xdg) + "/stallfree/stallfreed.sock";
  return "/run/stallfree/stallfreed.sock";
}

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = true;
  opts.always_print_primitive_fields = true;
  opts.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(m, &out, opts).ok()) out = "{}";
  out += "\n";
  return out;
}

std::string Bytes(uint64_t b) {
  if (b >= (uint64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / 1073741824.0);
  if (b >= (uint64_t{1} << 20)) return absl::StrFormat("%.1f MiB", b / 1048576.0);
  return absl::StrFormat("%d B", b);
}

// The stats command's output once; 0, or the exit code of a failure (reported).
int PrintStats(stallfree::Client* client, const std::string& output) {
  using namespace stallfree;
  auto s = client->GetStats();
  if (!s.ok()) {
    fprintf(stderr, "stallfreectl: stats: %s\n", s.status().ToString().c_str());
    return 1;
  }
  if (output == "json") {
    printf("%s", Json(*s).c_str());
    return 0;
  }
  const v1::Stats& st = *s;
  printf("%-22s %s\n", "version", st.version().c_str());
  printf("%-22s %.1f s\n", "uptime", st.uptime_seconds());
  printf("%-22s %d\n", "worker_threads", st.worker_threads());
  printf("%-22s %g s\n", "update_wait", st.update_wait_seconds());
  printf("%-22s %ld (opened %ld, closed %ld, reclaimed %ld)\n", "sessions", (long)st.sessions(),
         (long)st.sessions_opened(), (long)st.sessions_closed(), (long)st.sessions_reclaimed());
  printf("%-22s %ld (%ld elements, %s fp32)\n", "params", (long)st.params(),
         (long)st.param_elements(), Bytes(st.param_bytes()).c_str());
  printf("%-22s %s of %s%s\n", "pinned", Bytes(st.pinned_bytes()).c_str(),
         st.pinned_budget_bytes() ? Bytes(st.pinned_budget_bytes()).c_str() : "unlimited",
         st.mlock_enabled() ? "" : " (mlock off)");
  printf("%-22s %ld (%.3f s accumulating)\n", "pushes", (long)st.pushes(), st.accumulate_seconds());
  printf("%-22s %ld (%.3f s in AdamW)\n", "updates", (long)st.updates(), st.update_seconds());
  printf("%-22s %s in, %s out\n", "bytes moved", Bytes(st.bytes_in()).c_str(),
         Bytes(st.bytes_out()).c_str());
  printf("%-22s %ld\n", "rejected requests", (long)st.rejected_requests());
  printf("%-22s %ld\n", "migrated columns", (long)st.migrated_columns());
  printf("%-22s %ld running, %ld resumed\n", "updates now", (long)st.updates_running(),
         (long)st.updates_resumed());
  printf("%-22s %ld\n", "pushes resumed", (long)st.pushes_resumed());
  printf("%-22s %ld resumed, %ld answered again\n", "handovers",
         (long)st.handovers_resumed(), (long)st.handovers_answered_again());
  printf("%-22s %ld\n", "held states", (long)st.held_states());
  return 0;
}

// top: a live view until q or Ctrl-C (or --iterations refreshes): rates from GetStats deltas,
// then a line per session. On a terminal the screen is redrawn and keys are read raw.
int Top(stallfree::Client* client, double interval, int64_t iterations) {
  using namespace stallfree;
  const bool tty = isatty(STDOUT_FILENO) && isatty(STDIN_FILENO);
  struct termios saved {};
  if (tty) {
    tcgetattr(STDIN_FILENO, &saved);
    struct termios raw = saved;
    raw.c_lflag &= ~static_cast<tcflag_t>(ICANON | ECHO);
    raw.c_cc[VMIN] = 0;
    raw.c_cc[VTIME] = 0;
    tcsetattr(STDIN_FILENO, TCSANOW, &raw);
  }
  auto restore = [&] {
    if (tty) tcsetattr(STDIN_FILENO, TCSANOW, &saved);
  };
  absl::StatusOr<v1::Stats> prev = client->GetStats();
  auto t_prev = std::chrono::steady_clock::now();
  for (int64_t n = 1;; ++n) {
    // Wait one interval, returning early on q.
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(interval);
    while (std::chrono::steady_clock::now() < until) {
      struct pollfd p = {STDIN_FILENO, POLLIN, 0};
      if (tty && poll(&p, 1, 50) > 0) {
        char ch = 0;
        if (read(STDIN_FILENO, &ch, 1) == 1 && (ch == 'q' || ch == 'Q' || ch == 3)) {
          restore();
          return 0;
        }
      } else if (!tty) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    absl::StatusOr<v1::Stats> st = client->GetStats();
    auto sessions = client->ListSessions();
    if (!st.ok() || !prev.ok() || !sessions.ok()) {
      restore();
      fprintf(stderr, "stallfreectl: top: %s\n",
              (!st.ok() ? st.status() : !prev.ok() ? prev.status() : sessions.status())
                  .ToString()
                  .c_str());
      return 1;
    }
    const auto now = std::chrono::steady_clock::now();
    const double dt = std::chrono::duration<double>(now - t_prev).count();
    std::string out = tty ? "\033[H\033[2J" : "";
    out += absl::StrFormat(
        "stallfreed %s  up %.0f s  %d workers   (q to quit)\n"
        "pushes/s %8.1f   updates/s %8.1f   in %7.3f GB/s   out %7.3f GB/s\n"
        "sessions %ld   pinned %s of %s   rejected %ld\n\n",
        st->version(), st->uptime_seconds(), st->worker_threads(),
        (st->pushes() - prev->pushes()) / dt, (st->updates() - prev->updates()) / dt,
        (st->bytes_in() - prev->bytes_in()) / dt / 1e9,
        (st->bytes_out() - prev->bytes_out()) / dt / 1e9, (long)st->sessions(),
        Bytes(st->pinned_bytes()),
        st->pinned_budget_bytes() ? Bytes(st->pinned_budget_bytes()) : std::string("unlimited"),
        (long)st->rejected_requests());
    out += absl::StrFormat("%-6s %-18s %-5s %-8s %-8s %-8s %-9s %-7s %s\n", "ID", "NAME", "RANK",
                           "PID", "STEP", "VERSION", "STALENESS", "UPDATE", "PINNED");
    for (const v1::SessionInfo& s : *sessions) {
      out += absl::StrFormat("%-6d %-18s %-5d %-8d %-8d %-8d %-9d %-7s %s\n", s.session_id(),
                             s.name().substr(0, 18), s.rank(), s.pid(), s.last_step(), s.version(),
                             std::max<int64_t>(0, s.last_step() - s.version()),
                             s.update_running() ? "running" : "-", Bytes(s.pinned_bytes()));
    }
    fputs(out.c_str(), stdout);
    std::fflush(stdout);
    prev = st;
    t_prev = now;
    if (iterations > 0 && n >= iterations) {
      restore();
      return 0;
    }
  }
}

// Reports a failed call of `what`; the exit code 1.
int Fail(const char* what, const absl::Status& st) {
  fprintf(stderr, "stallfreectl: %s: %s\n", what, st.ToString().c_str());
  return 1;
}

// The command line: the flags and COMMAND [ARG].
struct Command {
  std::string socket = DefaultSocket();
  std::string output = "table";
  double watch = 0;
  int64_t iterations = 0;
  double rpc_timeout = 0;         // seconds; 0: the client library's default
  std::vector<std::string> args;  // args[0] is the command
  const std::string& name() const { return args[0]; }
};

// Parses and checks the command line into *c; -1 to go on, else the exit code (help, usage).
int ParseCommand(int argc, char** argv, Command* c) {
  using namespace stallfree;
  FlagSet flags("stallfreectl",
                "admin CLI for stallfreed.\n\nUsage: stallfreectl [flags] COMMAND\n"
                "  health                     the daemon's health (exit 0 iff SERVING)\n"
                "  stats                      daemon-wide counters\n"
                "  sessions                   your sessions (root: every uid's)\n"
                "  checkpoints                your checkpoints (root: every uid's)\n"
                "  delete-checkpoint TAG      removes your checkpoint TAG\n"
                "  close SESSION_ID           closes one of your sessions (root: anyone's)\n"
                "  top                        a live view (every --watch seconds, default 1) until q\n"
                "  metrics                    the Prometheus text (root or the daemon's uid), e.g.\n"
                "                             for node_exporter's textfile collector");
  flags.AddString("socket", &c->socket, "the daemon's gRPC unix socket");
  flags.AddString("o", &c->output, "output format: table or json");
  flags.AddDouble("watch", &c->watch,
                  "stats: print again every SECONDS until Ctrl-C (0: once); top: the refresh "
                  "interval (0: 1 s)");
  flags.AddInt("iterations", &c->iterations, "stats --watch, top: stop after N prints (0: never)");
  flags.AddDouble("rpc_timeout", &c->rpc_timeout,
                  "seconds each call to the daemon may take before it fails naming the daemon "
                  "(a stopped or hung one); 0: the client library's default, 120");
  if (int code = flags.ParseCommandLine(argc, argv); code >= 0) return code;
  c->args = flags.positional();
  const std::string cmd = c->args.empty() ? "" : c->args[0];
  const size_t want_args = cmd == "delete-checkpoint" || cmd == "close" ? 2 : 1;
  if (c->args.size() != want_args || (c->output != "table" && c->output != "json")) {
    fprintf(stderr, "%s", flags.Help().c_str());
    return 2;
  }
  if (cmd != "health" && cmd != "stats" && cmd != "sessions" && cmd != "checkpoints" &&
      cmd != "delete-checkpoint" && cmd != "close" && cmd != "top" && cmd != "metrics") {
    fprintf(stderr,
            "stallfreectl: unknown command '%s' (health, stats, sessions, checkpoints, "
            "delete-checkpoint, close, top, metrics)\n",
            cmd.c_str());
    return 2;
  }
  if (!(c->rpc_timeout >= 0)) {
    fprintf(stderr, "stallfreectl: --rpc_timeout: %g is not >= 0 seconds\n", c->rpc_timeout);
    return 2;
  }
  if (c->watch < 0 || c->iterations < 0 || (c->watch > 0 && cmd != "stats" && cmd != "top")) {
    fprintf(stderr,
            "stallfreectl: --watch SECONDS (> 0) and --iterations N go with stats and top\n");
    return 2;
  }
  return -1;
}

int Health(stallfree::Client* client, const Command& c) {
  auto h = client->Health();
  if (!h.ok()) return Fail("health", h.status());
  if (c.output == "json") {
    printf("{\"status\": \"%s\", \"socket\": \"%s\"}\n", h->c_str(), c.socket.c_str());
  } else {
    printf("%s  %s\n", h->c_str(), c.socket.c_str());
  }
  return *h == "SERVING" ? 0 : 1;
}

int Stats(stallfree::Client* client, const Command& c) {
  for (int64_t n = 1;; ++n) {
    if (int code = PrintStats(client, c.output); code != 0) return code;
    if (c.watch <= 0 || (c.iterations > 0 && n >= c.iterations)) return 0;
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::duration<double>(c.watch));
    if (c.output == "table") printf("\n");
  }
}

int Metrics(stallfree::Client* client) {
  auto text = client->Metrics();
  if (!text.ok()) return Fail("metrics", text.status());
  fputs(text->c_str(), stdout);
  return 0;
}

int Close(stallfree::Client* client, const std::string& arg) {
  char* end = nullptr;
  const unsigned long long id = strtoull(arg.c_str(), &end, 10);
  if (arg.empty() || *end != '\0' || id == 0) {
    fprintf(stderr, "stallfreectl: close: '%s' is not a session id (see stallfreectl sessions)\n",
            arg.c_str());
    return 2;
  }
  auto freed = client->CloseSession(id);
  if (!freed.ok()) return Fail("close", freed.status());
  printf("closed session %llu (%s freed)\n", id, Bytes(*freed).c_str());
  return 0;
}

int DeleteCheckpoint(stallfree::Client* client, const std::string& tag) {
  absl::Status st = client->DeleteCheckpoint(tag);
  if (!st.ok()) return Fail("delete-checkpoint", st);
  printf("deleted checkpoint %s\n", tag.c_str());
  return 0;
}

int Checkpoints(stallfree::Client* client, const Command& cmd) {
  auto c = client->ListCheckpoints();
  if (!c.ok()) return Fail("checkpoints", c.status());
  if (cmd.output == "json") {
    printf("%s", Json(*c).c_str());
    return 0;
  }
  printf("state directory %s\n", c->state_dir().c_str());
  printf("%-6s %-24s %-12s %-16s %-5s %-8s %-12s %-10s %s\n", "UID", "TAG", "SIZE", "SESSION",
         "RANK", "PARAMS", "ELEMENTS", "VERSION", "MODIFIED");
  for (const auto& k : c->checkpoints()) {
    char when[32] = "-";
    time_t t = static_cast<time_t>(k.mtime_unix());
    struct tm tm;
    if (t > 0 && localtime_r(&t, &tm) != nullptr) strftime(when, sizeof when, "%F %T", &tm);
    if (!k.error().empty()) {
      printf("%-6u %-24s %-12s unusable: %s\n", k.owner_uid(), k.tag().c_str(),
             Bytes(k.bytes()).c_str(), k.error().c_str());
      continue;
    }
    printf("%-6u %-24s %-12s %-16s %-5d %-8ld %-12ld %-10ld %s\n", k.owner_uid(), k.tag().c_str(),
           Bytes(k.bytes()).c_str(), k.session_name().c_str(), k.rank(), (long)k.params(),
           (long)k.param_elements(), (long)k.version(), when);
  }
  return 0;
}

int Sessions(stallfree::Client* client, const Command& c) {
  using namespace stallfree;
  auto list = client->ListSessions();
  if (!list.ok()) return Fail("sessions", list.status());
  if (c.output == "json") {
    v1::ListSessionsResponse resp;
    for (auto& s : *list) *resp.add_sessions() = s;
    printf("%s", Json(resp).c_str());
    return 0;
  }
  printf("%-6s %-16s %-5s %-8s %-6s %-8s %-12s %-10s %-8s %-8s %-8s\n", "ID", "NAME", "RANK", "PID",
         "UID", "PARAMS", "ELEMENTS", "PINNED", "STEP", "PUSHES", "UPDATES");
  for (const auto& s : *list) {
    printf("%-6lu %-16s %-5d %-8ld %-6s %-8ld %-12ld %-10s %-8ld %-8ld %-8ld\n",
           (unsigned long)s.session_id(), s.name().c_str(), s.rank(), (long)s.pid(),
           s.attached() ? std::to_string(s.uid()).c_str() : "-",
           (long)s.params(), (long)s.param_elements(), Bytes(s.pinned_bytes()).c_str(),
           (long)s.last_step(), (long)s.pushes(), (long)s.updates());
  }
  return 0;
}

int Run(int argc, char** argv) {
  using namespace stallfree;
  Command c;
  if (int code = ParseCommand(argc, argv, &c); code >= 0) return code;
  auto connected = Client::Connect(c.socket, 3000, c.rpc_timeout);
  if (!connected.ok()) {
    fprintf(stderr, "stallfreectl: %s\n", std::string(connected.status().message()).c_str());
    return 1;
  }
  Client* client = connected->get();
  const std::string& cmd = c.name();
  if (cmd == "health") return Health(client, c);
  if (cmd == "stats") return Stats(client, c);
  if (cmd == "top") return Top(client, c.watch > 0 ? c.watch : 1.0, c.iterations);
  if (cmd == "metrics") return Metrics(client);
  if (cmd == "close") return Close(client, c.args[1]);
  if (cmd == "delete-checkpoint") return DeleteCheckpoint(client, c.args[1]);
  if (cmd == "checkpoints") return Checkpoints(client, c);
  return Sessions(client, c);
}

}  // namespace

int main(int argc, char** argv) { return Run(argc, argv); }
