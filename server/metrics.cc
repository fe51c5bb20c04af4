#include "server/metrics.h"

#include <civetweb.h>
#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "kernels/optimizer.h"

namespace stallfree {
namespace {

// A label value, escaped as the text format wants (backslash, double quote, newline).
std::string Escape(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out.push_back('\\');
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

void Family(std::string* out, const std::string& name, const char* type, const std::string& help) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

void One(std::string* out, const std::string& name, const char* type, const std::string& help,
         double value) {
  Family(out, name, type, help);
  absl::StrAppend(out, name, " ", absl::StrFormat("%.17g", value), "\n");
}

// Fields of /proc/self/status in kB, by name ("VmRSS").
uint64_t StatusKb(const std::string& field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1));
  return 0;
}

int64_t OpenFds() {
  int64_t n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (struct dirent* e = readdir(d))
      if (e->d_name[0] != '.') ++n;
    closedir(d);
  }
  return n - 1;  // the directory's own fd
}

// utime + stime (seconds) and the start time (seconds since the epoch), from /proc/self/stat.
void CpuAndStart(double* cpu, double* start) {
  std::ifstream f("/proc/self/stat");
  std::string all((std::istreambuf_iterator<char>(f)), {});
  std::istringstream in(all.substr(all.rfind(')') + 2));
  std::string field;
  std::vector<std::string> fields;
  while (in >> field) fields.push_back(field);
  const double hz = static_cast<double>(sysconf(_SC_CLK_TCK));
  *cpu = fields.size() > 12 ? (std::stod(fields[11]) + std::stod(fields[12])) / hz : 0;
  double boot = 0;
  std::ifstream stat("/proc/stat");
  std::string line;
  while (std::getline(stat, line))
    if (line.rfind("btime ", 0) == 0) boot = std::stod(line.substr(6));
  *start = fields.size() > 19 ? boot + std::stod(fields[19]) / hz : 0;
}

}  // namespace

std::string RenderMetrics(SessionManager* sessions) {
  const v1::Stats st = sessions->GetStats();
  DaemonCounters& c = sessions->counters();
  std::string out;
  Family(&out, "stallfree_build_info", "gauge", "stallfreed's version and optimizer kernel.");
  absl::StrAppend(&out, "stallfree_build_info{version=\"", Escape(st.version()),
                  "\",optimizer_kernel=\"", kernels::DefaultCpuKernel().name(), "\"} 1\n");
  One(&out, "stallfree_uptime_seconds", "gauge", "Seconds since stallfreed started.",
      st.uptime_seconds());
  One(&out, "stallfree_worker_threads", "gauge", "oneTBB optimizer worker threads.",
      st.worker_threads());
  One(&out, "stallfree_sessions", "gauge", "Open sessions.", st.sessions());
  One(&out, "stallfree_sessions_opened_total", "counter", "Sessions opened.",
      st.sessions_opened());
  One(&out, "stallfree_sessions_closed_total", "counter", "Sessions closed by their client.",
      st.sessions_closed());
  One(&out, "stallfree_sessions_reclaimed_total", "counter",
      "Sessions closed by the daemon because their process went away.", st.sessions_reclaimed());
  One(&out, "stallfree_params", "gauge", "Parameters registered by the open sessions.",
      st.params());
  One(&out, "stallfree_param_elements", "gauge", "Elements of those parameters.",
      st.param_elements());
  One(&out, "stallfree_param_bytes", "gauge", "fp32 master bytes of those parameters.",
      static_cast<double>(st.param_bytes()));
  One(&out, "stallfree_mlock_enabled", "gauge", "1 unless stallfreed runs with --pin off.",
      st.mlock_enabled() ? 1 : 0);
  One(&out, "stallfree_pinned_bytes", "gauge",
      "Bytes of the sessions' regions and optimizer state (pinned when mlock is on).",
      st.pinned_bytes());
  One(&out, "stallfree_pinned_budget_bytes", "gauge", "The --pinned_mib budget (0: none).",
      st.pinned_budget_bytes());
  One(&out, "stallfree_pushes_total", "counter", "Gradient pushes accumulated.", st.pushes());
  One(&out, "stallfree_updates_total", "counter", "AdamW updates applied.", st.updates());
  One(&out, "stallfree_accumulate_seconds_total", "counter", "Seconds spent accumulating pushes.",
      st.accumulate_seconds());
  One(&out, "stallfree_update_seconds_total", "counter", "Seconds spent in AdamW updates.",
      st.update_seconds());
  One(&out, "stallfree_gradient_bytes_total", "counter",
      "Gradient bytes consumed from the regions.", static_cast<double>(st.bytes_in()));
  One(&out, "stallfree_parameter_bytes_total", "counter",
      "Parameter bytes written to the regions.", static_cast<double>(st.bytes_out()));
  One(&out, "stallfree_migrated_columns_total", "counter",
      "Columns moved by MigrateColumns (each direction counts).", st.migrated_columns());
  One(&out, "stallfree_updates_running", "gauge", "Sessions whose Update is claimed or running.",
      st.updates_running());
  One(&out, "stallfree_updates_resumed_total", "counter",
      "Updates that a daemon before this one died in, finished here.", st.updates_resumed());
  One(&out, "stallfree_pushes_resumed_total", "counter",
      "Pushes that a daemon before this one died in, finished here.", st.pushes_resumed());
  One(&out, "stallfree_held_states", "gauge",
      "Session states the fd store passed at start, waiting for their processes.",
      st.held_states());
  One(&out, "stallfree_handovers_resumed_total", "counter",
      "Handovers of columns that a daemon before this one died in, finished here.",
      st.handovers_resumed());
  One(&out, "stallfree_handovers_answered_again_total", "counter",
      "Handovers done before their answer was lost, answered again.",
      st.handovers_answered_again());

  Family(&out, "stallfree_rejected_requests_total", "counter",
         "Requests answered with an error, by RPC method and gRPC code.");
  for (const auto& [key, n] : c.rejections.Snapshot())
    absl::StrAppend(&out, "stallfree_rejected_requests_total{method=\"", key.first,
                    "\",code=\"", absl::StatusCodeToString(static_cast<absl::StatusCode>(key.second)),
                    "\"} ", n, "\n");

  c.push_seconds.Render("stallfree_push_duration_seconds",
                        "Time to accumulate one push into fp32.", &out);
  c.push_bytes.Render("stallfree_push_size_bytes", "Gradient bytes of one push.", &out);
  c.update_seconds.Render("stallfree_update_duration_seconds", "Time of one AdamW update.", &out);
  c.migrate_seconds.Render("stallfree_migrate_duration_seconds",
                           "Time of one MigrateColumns.", &out);
  c.checkpoint_seconds.Render("stallfree_checkpoint_duration_seconds",
                              "Time to write one checkpoint.", &out);
  c.checkpoint_bytes.Render("stallfree_checkpoint_size_bytes", "Bytes of one checkpoint.", &out);

  // Per session: rendered from the open sessions, so a closed one's series are gone.
  const std::vector<v1::SessionInfo> all = sessions->AllSessionInfo();
  struct PerSession {
    const char* name;
    const char* type;
    const char* help;
    double (*value)(const v1::SessionInfo&);
  };
  const PerSession per[] = {
      {"stallfree_session_pushes_total", "counter", "Pushes of the session.",
       [](const v1::SessionInfo& s) { return static_cast<double>(s.pushes()); }},
      {"stallfree_session_updates_total", "counter", "Updates of the session.",
       [](const v1::SessionInfo& s) { return static_cast<double>(s.updates()); }},
      {"stallfree_session_last_step", "gauge", "The step of the session's last Update.",
       [](const v1::SessionInfo& s) { return static_cast<double>(s.last_step()); }},
      {"stallfree_session_staleness_steps", "gauge",
       "Steps between the last Update requested and the newest version ready.",
       [](const v1::SessionInfo& s) {
         return static_cast<double>(std::max<int64_t>(0, s.last_step() - s.version()));
       }},
      {"stallfree_session_update_running", "gauge", "1 while an Update of the session runs.",
       [](const v1::SessionInfo& s) { return s.update_running() ? 1.0 : 0.0; }},
      {"stallfree_session_pinned_bytes", "gauge", "The session's region and optimizer state.",
       [](const v1::SessionInfo& s) { return static_cast<double>(s.pinned_bytes()); }},
  };
  for (const PerSession& m : per) {
    Family(&out, m.name, m.type, m.help);
    for (const v1::SessionInfo& s : all)
      absl::StrAppend(&out, m.name, "{session=\"", s.session_id(), "\",name=\"",
                      Escape(s.name()), "\",rank=\"", s.rank(), "\"} ",
                      absl::StrFormat("%.17g", m.value(s)), "\n");
  }

  // The process.
  double cpu = 0, start = 0;
  CpuAndStart(&cpu, &start);
  struct rlimit fds {};
  getrlimit(RLIMIT_NOFILE, &fds);
  One(&out, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.",
      static_cast<double>(StatusKb("VmRSS")) * 1024);
  One(&out, "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.",
      static_cast<double>(StatusKb("VmSize")) * 1024);
  One(&out, "process_open_fds", "gauge", "Open file descriptors.", OpenFds());
  One(&out, "process_max_fds", "gauge", "The limit of open file descriptors.",
      static_cast<double>(fds.rlim_cur));
  One(&out, "process_cpu_seconds_total", "counter", "User and system CPU time in seconds.", cpu);
  One(&out, "process_start_time_seconds", "gauge",
      "Start time of the process since the Unix epoch in seconds.", start);
  One(&out, "stallfree_process_threads", "gauge", "Threads of the daemon.",
      static_cast<double>(StatusKb("Threads")));
  One(&out, "stallfree_mlocked_bytes", "gauge", "Bytes the daemon holds mlocked (VmLck).",
      static_cast<double>(StatusKb("VmLck")) * 1024);
  return out;
}

int MetricsServer::Handle(struct mg_connection* conn, void* self) {
  const mg_request_info* req = mg_get_request_info(conn);
  if (req == nullptr || strcmp(req->request_method, "GET") != 0) {
    mg_send_http_error(conn, 405, "only GET /metrics");
    return 405;
  }
  const std::string body = RenderMetrics(static_cast<MetricsServer*>(self)->sessions_);
  mg_printf(conn,
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            "Content-Length: %zu\r\nConnection: close\r\n\r\n",
            body.size());
  mg_write(conn, body.data(), body.size());
  return 200;
}

absl::Status MetricsServer::Start(const std::string& address) {
  mg_init_library(0);
  const char* options[] = {"listening_ports", address.c_str(), "num_threads", "2",
                           "request_timeout_ms", "10000", nullptr};
  mg_callbacks callbacks;
  memset(&callbacks, 0, sizeof callbacks);
  ctx_ = mg_start(&callbacks, nullptr, options);
  if (ctx_ == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics_address: cannot serve HTTP on '", address,
        "' (HOST:PORT; is the port taken, or the address not this machine's?)"));
  mg_set_request_handler(ctx_, "/metrics", &MetricsServer::Handle, this);
  mg_server_port ports[4];
  const int n = mg_get_server_ports(ctx_, 4, ports);
  port_ = n > 0 ? ports[0].port : 0;
  return absl::OkStatus();
}

void MetricsServer::Stop() {
  if (ctx_ != nullptr) mg_stop(ctx_);
  ctx_ = nullptr;
}

}  // namespace stallfree
