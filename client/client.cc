#include "client/client.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/host_register.h"
#include "common/log.h"
#include "common/status.h"
#include "common/unix_socket.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace stallfree {

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  // The daemon answers with the canonical code of its own status, never UNKNOWN or CANCELLED:
  // those come from the transport, a call cut off when the connection broke.
  if (s.error_code() == grpc::StatusCode::UNKNOWN ||
      s.error_code() == grpc::StatusCode::CANCELLED) {
    return absl::UnavailableError(
        absl::StrCat("the connection to stallfreed broke: ", s.error_message()));
  }
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

namespace {

using SysClock = std::chrono::system_clock;

// The setting's names, for the messages that say how to change it.
constexpr char kRpcTimeoutSetting[] =
    "the rpc_timeout setting: $STALLFREE_RPC_TIMEOUT, ZenFlowAdamW(rpc_timeout=...), the "
    "trainer's and stallfreectl's --rpc_timeout";
// The most WaitUpdateRequest.timeout_ms can name, in seconds.
constexpr double kMaxWaitS = 4294967.0;
// How long the health check after an unanswered call may take.
constexpr double kHealthProbeS = 1.0;

SysClock::time_point After(double seconds) {
  return SysClock::now() + std::chrono::duration_cast<SysClock::duration>(
                               std::chrono::duration<double>(seconds));
}

// Seconds as a reader wants them: 0.25 s, 2.5 s, 120 s, 1790 s.
std::string Seconds(double s) {
  return s >= 10 ? absl::StrFormat("%.0f s", s) : absl::StrFormat("%.2g s", s);
}

}  // namespace

absl::StatusOr<double> RpcTimeoutSeconds(double rpc_timeout_s) {
  std::string from = "rpc_timeout";
  double t = rpc_timeout_s;
  if (!(t > 0) && rpc_timeout_s != 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "rpc_timeout: ", rpc_timeout_s, " is not a positive number of seconds (0: the default)"));
  if (rpc_timeout_s == 0) {
    const char* env = getenv("STALLFREE_RPC_TIMEOUT");
    if (env == nullptr || *env == '\0') return kDefaultRpcTimeoutS;
    from = "$STALLFREE_RPC_TIMEOUT";
    if (!absl::SimpleAtod(env, &t) || !(t > 0))
      return absl::InvalidArgumentError(absl::StrCat(
          "$STALLFREE_RPC_TIMEOUT: '", env, "' is not a positive number of seconds"));
  }
  if (!(t <= kMaxWaitS))
    return absl::InvalidArgumentError(
        absl::StrCat(from, ": ", t, " s is more than ", kMaxWaitS, " s (about 49 days)"));
  return t;
}

Client::Client(std::string path, std::shared_ptr<grpc::Channel> channel, double rpc_timeout_s)
    : socket_path_(std::move(path)), rpc_timeout_s_(rpc_timeout_s), channel_(std::move(channel)),
      stub_(v1::Offload::NewStub(channel_)) {}

double Client::BoundFor(uint64_t work_bytes) const {
  return rpc_timeout_s_ + static_cast<double>(work_bytes) / kSlowestBytesPerSecond;
}

grpc::Status Client::Invoke(double bound_s, const RpcFn& call, bool* expired) {
  grpc::ClientContext ctx;
  const SysClock::time_point deadline = After(bound_s);
  ctx.set_deadline(deadline);
  grpc::Status s = call(&ctx);
  // gRPC's own expiry (at the deadline; a few ms of rounding allowed), or the daemon's
  // DEADLINE_EXCEEDED (WaitUpdate), which it sends well before.
  *expired = s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
             SysClock::now() >= deadline - std::chrono::milliseconds(5);
  return s;
}

absl::Status Client::Unanswered(const char* rpc, double bound_s, uint64_t work_bytes,
                                int daemon_pid) {
  std::string bound = Seconds(bound_s);
  if (work_bytes > 0 && bound_s - rpc_timeout_s_ >= 0.05)
    bound += absl::StrFormat(": rpc_timeout %s and %s for its %.1f MiB of work",
                             Seconds(rpc_timeout_s_), Seconds(bound_s - rpc_timeout_s_),
                             work_bytes / 1048576.0);
  const std::string pid = daemon_pid > 0 ? absl::StrCat(" (pid ", daemon_pid, ")") : "";
  // Whether the daemon answers at all: the health service runs on gRPC's threads, never
  // behind a session's work.
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(After(std::min(kHealthProbeS, rpc_timeout_s_)));
  grpc::health::v1::HealthCheckResponse resp;
  const bool answers =
      health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok();
  std::string state;
  if (answers) {
    state = absl::StrCat(
        "it answers a health check, so it runs but did not finish this call in time: the "
        "session's earlier work (a long Update or checkpoint) ran ahead of it, or the node is "
        "overloaded; if such work may take this long, raise rpc_timeout");
  } else {
    state = absl::StrCat(
        "it does not answer a health check either: it is stopped (SIGSTOP; kill -CONT",
        daemon_pid > 0 ? absl::StrCat(" ", daemon_pid) : std::string(" <its pid>"),
        " resumes it), hung or overloaded (stallfreectl --socket ", socket_path_,
        " health tells when it answers again)");
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "stallfreed at ", socket_path_, pid, " did not answer ", rpc, " within ", bound, " (",
      kRpcTimeoutSetting, "); ", state,
      ". The call's outcome is unknown: the daemon may still carry it out"));
}

absl::Status Client::Explain(absl::Status st, bool expired, const char* rpc, double bound_s,
                             uint64_t work_bytes, int daemon_pid) {
  if (!absl::IsDeadlineExceeded(st)) return st;
  if (expired) return Unanswered(rpc, bound_s, work_bytes, daemon_pid);
  return absl::DeadlineExceededError(
      absl::StrCat("stallfreed at ", socket_path_, ": ", rpc, ": ", st.message()));
}

absl::Status Client::Call(const char* rpc, const RpcFn& call) {
  bool expired = false;
  const grpc::Status s = Invoke(rpc_timeout_s_, call, &expired);
  return Explain(FromGrpc(s), expired, rpc, rpc_timeout_s_, 0, 0);
}

absl::Status Client::FdExchange(int conn, const std::string& path, const std::string& request,
                                std::string* reply, std::vector<int>* fds, size_t max_fds,
                                const std::vector<int>& send_fds) {
  fds->clear();
  // Both directions time out after rpc_timeout (a stopped daemon accepts connections through
  // the kernel's backlog, and then never answers).
  struct timeval tv;
  tv.tv_sec = static_cast<time_t>(rpc_timeout_s_);
  tv.tv_usec = static_cast<suseconds_t>((rpc_timeout_s_ - tv.tv_sec) * 1e6);
  if (setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0 ||
      setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0)
    return ErrnoStatus("setsockopt(SO_RCVTIMEO/SO_SNDTIMEO)", path);
  const auto start = std::chrono::steady_clock::now();
  absl::Status st = SendWithFds(conn, request, send_fds);
  if (st.ok()) st = RecvWithFds(conn, 512, reply, fds, max_fds);
  // A timed-out send or receive fails with EAGAIN, which ErrnoStatus makes RESOURCE_EXHAUSTED.
  if (absl::IsResourceExhausted(st) &&
      std::chrono::steady_clock::now() - start >=
          std::chrono::duration<double>(rpc_timeout_s_) - std::chrono::milliseconds(5))
    return absl::DeadlineExceededError(absl::StrCat(
        "stallfreed's fd socket ", path, " did not answer within ", Seconds(rpc_timeout_s_),
        " (", kRpcTimeoutSetting, "): the daemon is stopped (SIGSTOP), hung or overloaded"));
  RETURN_IF_ERROR(st);
  // The connection lives on (a session's liveness channel, a caller credential): no timeouts
  // on it from here.
  tv = timeval{};
  if (setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0 ||
      setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0)
    return ErrnoStatus("setsockopt(SO_RCVTIMEO/SO_SNDTIMEO)", path);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& socket_path,
                                                        int timeout_ms, double rpc_timeout_s) {
  ASSIGN_OR_RETURN(const double rpc_timeout, RpcTimeoutSeconds(rpc_timeout_s));
  const std::string hint = absl::StrCat("no stallfreed is listening on ", socket_path,
                                        "; start one with: stallfreed --socket ", socket_path);
  struct stat st;
  if (stat(socket_path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) {
    return absl::UnavailableError(hint);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(1 << 30);
  // A restarted daemon is reached within a second (gRPC's default backoff grows to 2 minutes):
  // a session re-attaches to it (Session::Reattach) and goes on.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  auto channel = grpc::CreateCustomChannel("unix:" + socket_path,
                                           grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() +
                                 std::chrono::milliseconds(timeout_ms))) {
    return absl::UnavailableError(hint);
  }
  return std::unique_ptr<Client>(new Client(socket_path, std::move(channel), rpc_timeout));
}

absl::StatusOr<std::string> Client::Health() {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  const double bound = std::min(5.0, rpc_timeout_s_);
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  bool expired = false;
  const grpc::Status s = Invoke(
      bound, [&](grpc::ClientContext* ctx) { return stub->Check(ctx, req, &resp); }, &expired);
  if (expired)
    return absl::DeadlineExceededError(absl::StrCat(
        "stallfreed at ", socket_path_, " did not answer a health check within ", Seconds(bound),
        ": it is stopped (SIGSTOP), hung or overloaded"));
  RETURN_IF_ERROR(FromGrpc(s));
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
}

absl::StatusOr<v1::Stats> Client::GetStats() {
  v1::GetStatsResponse resp;
  RETURN_IF_ERROR(Call("GetStats", [&](grpc::ClientContext* ctx) {
    return stub_->GetStats(ctx, v1::GetStatsRequest(), &resp);
  }));
  return resp.stats();
}

Client::~Client() {
  if (caller_conn_ >= 0) close(caller_conn_);
}

absl::StatusOr<v1::CallerRef> Client::Caller() {
  std::lock_guard<std::mutex> lock(caller_mu_);
  if (caller_conn_ >= 0 && !PeerClosed(caller_conn_)) return caller_;
  if (caller_conn_ >= 0) {  // the daemon that issued it went away: ask the one there now
    close(caller_conn_);
    caller_conn_ = -1;
  }
  ASSIGN_OR_RETURN(v1::Stats stats, GetStats());
  ASSIGN_OR_RETURN(int conn, ConnectUnix(stats.fd_socket()));
  std::string reply;
  std::vector<int> fds;
  absl::Status st = FdExchange(conn, stats.fd_socket(), "CALLER\n", &reply, &fds, 1);
  for (int fd : fds) close(fd);
  std::istringstream in(reply.rfind("OK ", 0) == 0 ? reply.substr(3) : "");
  uint64_t id = 0;
  std::string token;
  if (st.ok() && !(in >> id >> token)) {
    while (!reply.empty() && reply.back() == '\n') reply.pop_back();
    st = absl::PermissionDeniedError(absl::StrCat("the daemon's fd socket ", stats.fd_socket(),
                                                  " refused a caller credential: ", reply));
  }
  if (!st.ok()) {
    close(conn);
    return st;
  }
  caller_conn_ = conn;
  caller_.set_caller_id(id);
  caller_.set_token(token);
  return caller_;
}

absl::StatusOr<std::vector<v1::SessionInfo>> Client::ListSessions() {
  v1::ListSessionsRequest req;
  ASSIGN_OR_RETURN(*req.mutable_caller(), Caller());
  v1::ListSessionsResponse resp;
  RETURN_IF_ERROR(Call("ListSessions", [&](grpc::ClientContext* ctx) {
    return stub_->ListSessions(ctx, req, &resp);
  }));
  return std::vector<v1::SessionInfo>(resp.sessions().begin(), resp.sessions().end());
}

absl::StatusOr<v1::ListCheckpointsResponse> Client::ListCheckpoints() {
  v1::ListCheckpointsRequest req;
  ASSIGN_OR_RETURN(*req.mutable_caller(), Caller());
  v1::ListCheckpointsResponse resp;
  RETURN_IF_ERROR(Call("ListCheckpoints", [&](grpc::ClientContext* ctx) {
    return stub_->ListCheckpoints(ctx, req, &resp);
  }));
  return resp;
}

absl::StatusOr<uint64_t> Client::CloseSession(uint64_t session_id) {
  v1::CloseSessionRequest req;
  ASSIGN_OR_RETURN(*req.mutable_caller(), Caller());
  req.mutable_session()->set_session_id(session_id);
  v1::CloseSessionResponse resp;
  RETURN_IF_ERROR(Call("CloseSession", [&](grpc::ClientContext* ctx) {
    return stub_->CloseSession(ctx, req, &resp);
  }));
  return resp.freed_bytes();
}

absl::StatusOr<std::string> Client::Metrics() {
  v1::GetMetricsRequest req;
  ASSIGN_OR_RETURN(*req.mutable_caller(), Caller());
  v1::GetMetricsResponse resp;
  RETURN_IF_ERROR(Call("GetMetrics", [&](grpc::ClientContext* ctx) {
    return stub_->GetMetrics(ctx, req, &resp);
  }));
  return resp.text();
}

absl::Status Client::DeleteCheckpoint(const std::string& tag) {
  v1::DeleteCheckpointRequest req;
  ASSIGN_OR_RETURN(*req.mutable_caller(), Caller());
  req.set_tag(tag);
  v1::DeleteCheckpointResponse resp;
  return Call("DeleteCheckpoint", [&](grpc::ClientContext* ctx) {
    return stub_->DeleteCheckpoint(ctx, req, &resp);
  });
}

absl::StatusOr<std::unique_ptr<Session>> Client::OpenSession(const std::string& name, int rank) {
  v1::OpenSessionRequest req;
  req.set_name(name);
  req.set_rank(rank);
  req.set_pid(getpid());
  v1::OpenSessionResponse resp;
  RETURN_IF_ERROR(Call("OpenSession", [&](grpc::ClientContext* ctx) {
    return stub_->OpenSession(ctx, req, &resp);
  }));
  return std::unique_ptr<Session>(new Session(this, resp.session(), resp.fd_socket()));
}

Session::Session(Client* client, v1::SessionRef ref, std::string fd_socket)
    : client_(client), token_(ref.token()), session_id_(ref.session_id()),
      fd_socket_(std::move(fd_socket)) {}

Session::~Session() { Close().IgnoreError(); }

absl::Status Session::Rpc(const grpc::Status& s) const {
  absl::Status st = FromGrpc(s);
  const int conn = conn_.load();
  if (st.ok() || absl::IsUnavailable(st) || conn < 0 || !PeerClosed(conn)) return st;
  // The daemon that held the session closed the session's connection: its process is gone, and
  // whatever answered (a restarted daemon: "no session", a wrong token) does not have the session.
  return absl::UnavailableError(absl::StrCat("stallfreed went away (the connection of session ",
                                             session_id_.load(), " closed): ", st.ToString()));
}

int Session::DaemonPid() const {
  const int conn = conn_.load();
  if (conn < 0) return 0;
  absl::StatusOr<struct ucred> peer = PeerCredentials(conn);
  return peer.ok() ? static_cast<int>(peer->pid) : 0;
}

uint64_t Session::StateBytes() const {
  uint64_t elements = 0;
  for (const v1::ParamLayout& p : layout_.params()) elements += p.numel();
  return layout_.region_bytes() + 16 * elements;
}

absl::Status Session::Call(const char* rpc, uint64_t work_bytes, const Client::RpcFn& call,
                           double bound_s) {
  const double bound = bound_s > 0 ? bound_s : client_->BoundFor(work_bytes);
  bool expired = false;
  const grpc::Status s = client_->Invoke(bound, call, &expired);
  absl::Status st = Rpc(s);
  // The daemon's pid (a getsockopt) only for the message of a call that ran out of time: every
  // push and update of every step comes through here.
  if (!absl::IsDeadlineExceeded(st)) return st;
  return client_->Explain(std::move(st), expired, rpc, bound, work_bytes, DaemonPid());
}

absl::Status Session::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  v1::CloseSessionRequest req;
  *req.mutable_session() = ref();
  v1::CloseSessionResponse resp;
  absl::Status st = Call(
      "CloseSession", 0,
      [&](grpc::ClientContext* ctx) { return client_->stub()->CloseSession(ctx, req, &resp); },
      std::min(10.0, client_->rpc_timeout_s()));
  if (host_registered_) HostUnregister(region_->data(), region_->size());
  region_.reset();
  if (state_fd_ >= 0) close(state_fd_);  // the session is closed: its state may go
  state_fd_ = -1;
  if (conn_ >= 0) close(conn_);
  conn_ = -1;
  for (int fd : dead_conns_) close(fd);
  dead_conns_.clear();
  return st;
}

absl::Status Session::Attach() {
  ASSIGN_OR_RETURN(int conn, ConnectUnix(fd_socket_));
  conn_ = conn;
  std::string reply;
  std::vector<int> fds;
  // The region's memfd, which this process maps, and the optimizer state's, which it holds.
  RETURN_IF_ERROR(client_->FdExchange(
      conn_, fd_socket_, absl::StrCat(session_id_.load(), " ", token_, " STATE\n"), &reply,
      &fds, 2));
  auto close_all = [&fds] {
    for (int fd : fds) close(fd);
  };
  if (reply.rfind("OK ", 0) != 0 || fds.size() != 2) {
    close_all();
    while (!reply.empty() && reply.back() == '\n') reply.pop_back();
    return absl::PermissionDeniedError(absl::StrCat("the daemon refused the region of session ",
                                                    session_id_.load(), ": ", reply));
  }
  uint64_t size = 0, state_size = 0, generation = 0;
  std::istringstream(reply.substr(3)) >> size >> state_size >> generation;
  generation_ = generation;
  struct stat st;
  if (size != layout_.region_bytes() || fstat(fds[1], &st) != 0 ||
      static_cast<uint64_t>(st.st_size) != state_size) {
    close_all();
    return absl::InternalError(absl::StrCat("region is ", size, " bytes, layout says ",
                                            layout_.region_bytes(), "; state ", state_size,
                                            " bytes"));
  }
  state_fd_ = fds[1];
  state_bytes_ = state_size;
  const int fd = fds[0];
  ASSIGN_OR_RETURN(region_, MappedRegion::MapFd(fd, size));
  std::string err;
  host_registered_ = HostRegister(region_->data(), region_->size(), &err);
  if (!err.empty()) SF_LOG(kWarning, "region of session %d: %s", session_id_.load(), err);
  return absl::OkStatus();
}

namespace {
// The code of an fd socket refusal "ERR <CODE> <message>" (fd_server.h); UNKNOWN if none is named.
absl::StatusCode RefusalCode(const std::string& reply) {
  std::istringstream in(reply);
  std::string err, name;
  in >> err >> name;
  for (int c = 0; c <= 16; ++c)
    if (absl::StatusCodeToString(static_cast<absl::StatusCode>(c)) == name)
      return static_cast<absl::StatusCode>(c);
  return absl::StatusCode::kUnknown;
}
}  // namespace

absl::StatusOr<Session::Adopted> Session::Reattach(double wait_s) {
  if (closed_ || region_ == nullptr || state_fd_ < 0)
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", session_id_.load(), " has no state to re-attach (closed, or not registered)"));
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                    std::chrono::duration<double>(wait_s));
  // A daemon that is shutting down (SIGTERM: an upgrade, systemctl restart) answers UNAVAILABLE
  // while it finishes its running work, and closes the session's connection when it exits:
  // until then the session is still its own.
  while (conn_ >= 0 && !PeerClosed(conn_)) {
    if (std::chrono::steady_clock::now() >= deadline)
      return absl::FailedPreconditionError(absl::StrCat(
          "the daemon that holds session ", session_id_.load(), " is still connected to it "
          "after ", Seconds(wait_s)));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto next_note = start + std::chrono::seconds(10);
  // One nonce per adoption, kept until one succeeds: if a daemon adopts the session and dies
  // before its answer arrives, the next one recognises this process's retry by it.
  if (adopt_nonce_ == 0) {
    std::random_device rd;
    while (adopt_nonce_ == 0) adopt_nonce_ = (uint64_t{rd()} << 32) | rd();
  }
  const std::string request =
      absl::StrCat("ADOPT ", token_, " ", generation_.load(), " ", adopt_nonce_, "\n");
  absl::Status last = absl::UnavailableError("no attempt");
  while (true) {
    absl::StatusOr<int> conn = ConnectUnix(fd_socket_);
    if (conn.ok()) {
      std::string reply;
      std::vector<int> fds;
      last = client_->FdExchange(*conn, fd_socket_, request, &reply, &fds, 0,
                                 {region_->fd(), state_fd_});
      while (!reply.empty() && reply.back() == '\n') reply.pop_back();
      Adopted got;
      uint64_t id = 0, generation = 0;
      std::istringstream in(reply.rfind("OK ", 0) == 0 ? reply.substr(3) : "");
      if (last.ok() &&
          (in >> id >> generation >> got.version >> got.last_step >> got.pushes_since_update >>
           got.handovers)) {
        // The dead daemon's connection stays open until Close: another thread's call may be
        // asking it whether it closed (Rpc).
        if (conn_ >= 0) dead_conns_.push_back(conn_);
        const uint64_t old_id = session_id_.exchange(id);
        generation_ = generation;
        handovers_ = got.handovers;
        adopt_nonce_ = 0;
        conn_ = *conn;
        // The gRPC channel may still hold the dead daemon's connection (its first call would
        // fail on it) or be backing off (Connect's backoff, at most 1 s): a health check until
        // the new daemon answers one, within the same bound (and at least 2 s), so that the
        // session's next call reaches it.
        const auto until =
            std::max(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(2));
        while (!client_->Health().ok() && std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        SF_LOG(kInfo, "session %d re-attached to the stallfreed at %s as session %d "
               "(generation %d): version %d, %d pushes since it", old_id, fd_socket_, id,
               generation, got.version, got.pushes_since_update);
        return got;
      }
      close(*conn);
      const absl::StatusCode refused = RefusalCode(reply);
      // The daemon answered and refused: waiting does not change that, unless it is itself
      // shutting down (UNAVAILABLE: the next one is waited for).
      if (last.ok() && refused != absl::StatusCode::kUnavailable)
        return absl::Status(refused == absl::StatusCode::kUnknown
                                ? absl::StatusCode::kFailedPrecondition
                                : refused,
                            absl::StrCat("the stallfreed at ", fd_socket_,
                                         " refused to take back session ", session_id_.load(),
                                         ": ", reply));
      if (last.ok()) last = absl::UnavailableError(reply);
    } else {
      last = conn.status();
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline)
      return absl::UnavailableError(absl::StrCat(
          "no stallfreed took back session ", session_id_.load(), " at ", fd_socket_, " within ",
          Seconds(wait_s), " (", last.message(), "); its state is still held by this process "
          "until the session closes"));
    if (now >= next_note) {
      SF_LOG(kWarning,
             "session %d: waiting for a stallfreed at %s to take it back (%.0f of %.0f s)",
             session_id_.load(), fd_socket_,
             std::chrono::duration<double>(now - start).count(), wait_s);
      next_note = now + std::chrono::seconds(10);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

absl::Status Session::RegisterParams(const std::vector<ParamSpec>& params,
                                     v1::DType param_dtype, uint32_t param_slots) {
  v1::RegisterParamsRequest req;
  uint64_t elements = 0;
  *req.mutable_session() = ref();
  req.set_param_dtype(param_dtype);
  req.set_param_slots(param_slots);
  for (const ParamSpec& p : params) {
    v1::ParamSpec* s = req.add_params();
    s->set_name(p.name);
    uint64_t numel = 1;
    for (int64_t d : p.shape) {
      s->add_shape(d);
      numel *= d > 0 ? static_cast<uint64_t>(d) : 1;
    }
    elements += numel;
    s->set_grad_dtype(p.grad_dtype);
  }
  v1::RegisterParamsResponse resp;
  // The daemon allocates, populates and mlocks at most 48 bytes an element (the region of the
  // layout of before, 20 fp32 bytes, and 16 of state, rounded up).
  RETURN_IF_ERROR(Call("RegisterParams", 48 * elements, [&](grpc::ClientContext* ctx) {
    return client_->stub()->RegisterParams(ctx, req, &resp);
  }));
  layout_ = resp.layout();
  // A daemon from before param_slots (stallfree 0.1.0) lays out two fp32 parameter slots and
  // names neither.
  if (layout_.param_slots() == 0) {
    layout_.set_param_slots(2);
    layout_.set_param_dtype(v1::DTYPE_FP32);
  }
  // Every slot inside the region: a layout that is not (a daemon of another protocol) would
  // send the engine's copies outside the mapping.
  const v1::RegionLayout& l = layout_;
  const uint64_t grad_end = l.grad_slot_offset() + 2 * l.grad_slot_bytes();
  const uint64_t param_end = l.param_slot_offset() + uint64_t{l.param_slots()} * l.param_slot_bytes();
  const uint64_t staging_end = l.staging_offset() + l.staging_bytes();
  if (grad_end > l.region_bytes() || param_end > l.region_bytes() ||
      staging_end > l.region_bytes() || l.param_slots() > 2)
    return absl::FailedPreconditionError(absl::StrCat(
        "the daemon's region layout does not fit its region (", l.region_bytes(),
        " bytes; gradient slots end at ", grad_end, ", parameter slots at ", param_end,
        ", staging at ", staging_end, "): a stallfreed of another version? Run the "
        "stallfreed that comes with this client"));
  for (const v1::ParamLayout& p : layout_.params()) params_[p.name()] = p;
  RETURN_IF_ERROR(Attach());
  handovers_ = 0;
  return absl::OkStatus();
}

absl::StatusOr<const v1::ParamLayout*> Session::Param(const std::string& name) const {
  auto it = params_.find(name);
  if (it == params_.end()) return absl::NotFoundError(absl::StrCat("no parameter '", name, "'"));
  return &it->second;
}

void* Session::GradSlot(uint32_t slot, const std::string& name) const {
  const v1::ParamLayout& p = params_.at(name);
  return region_->data() + layout_.grad_slot_offset() + slot * layout_.grad_slot_bytes() +
         p.grad_offset();
}
float* Session::Staging() const {
  return reinterpret_cast<float*>(region_->data() + layout_.staging_offset());
}
float* Session::StagingFp32(const std::string& name) const {
  const v1::ParamLayout& p = params_.at(name);
  if (p.staging_offset() + 4 * static_cast<uint64_t>(p.numel()) > layout_.staging_bytes())
    return nullptr;
  return reinterpret_cast<float*>(region_->data() + layout_.staging_offset() +
                                  p.staging_offset());
}
const float* Session::ParamsFp32(uint32_t slot, const std::string& name) const {
  if (slot >= layout_.param_slots() || layout_.param_dtype() == v1::DTYPE_BF16) return nullptr;
  return reinterpret_cast<const float*>(region_->data() + layout_.param_slot_offset() +
                                        slot * layout_.param_slot_bytes() +
                                        params_.at(name).param_offset_fp32());
}
const uint16_t* Session::ParamsBf16(uint32_t slot, const std::string& name) const {
  if (slot >= layout_.param_slots()) return nullptr;
  return reinterpret_cast<const uint16_t*>(region_->data() + layout_.param_slot_offset() +
                                           slot * layout_.param_slot_bytes() +
                                           params_.at(name).param_offset_bf16());
}

absl::Status Session::LoadParams() { return LoadParams(std::vector<LoadRange>{}); }

absl::Status Session::LoadParams(const std::vector<LoadRange>& ranges) {
  v1::LoadParamsRequest req;
  *req.mutable_session() = ref();
  for (const LoadRange& r : ranges) {
    v1::LoadRange* out = req.add_ranges();
    out->set_param(r.param);
    out->set_first_element(r.first_element);
    out->set_count(r.count);
    out->set_staging_offset(r.staging_offset);
  }
  v1::LoadParamsResponse resp;
  return Call("LoadParams", layout_.staging_bytes(), [&](grpc::ClientContext* ctx) {
    return client_->stub()->LoadParams(ctx, req, &resp);
  });
}

absl::Status Session::LoadValues(
    const std::vector<std::pair<std::string, const float*>>& values) {
  if (!region_) return absl::FailedPreconditionError("LoadValues before RegisterParams");
  const uint64_t cap = staging_floats();
  float* staging = Staging();
  std::vector<LoadRange> batch;
  uint64_t used = 0;
  for (const auto& [name, src] : values) {
    ASSIGN_OR_RETURN(const v1::ParamLayout* p, Param(name));
    const uint64_t numel = static_cast<uint64_t>(p->numel());
    for (uint64_t first = 0; first < numel;) {
      if (used == cap) {
        RETURN_IF_ERROR(LoadParams(batch));
        batch.clear();
        used = 0;
      }
      const uint64_t n = std::min(numel - first, cap - used);
      memcpy(staging + used, src + first, n * sizeof(float));
      batch.push_back({name, first, n, used * 4});
      used += n;
      first += n;
    }
  }
  if (!batch.empty()) RETURN_IF_ERROR(LoadParams(batch));
  return absl::OkStatus();
}

absl::StatusOr<v1::PushGradientsResponse> Session::Push(const v1::PushGradientsRequest& request) {
  v1::PushGradientsRequest req = request;
  *req.mutable_session() = ref();
  v1::PushGradientsResponse resp;
  // It reads a gradient slot and reads and writes the fp32 accumulator (at most 3 slots of
  // bytes), behind the session's earlier work (a running Update, which rpc_timeout bounds).
  RETURN_IF_ERROR(Call("PushGradients", layout_.grad_slot_bytes() * 3,
                       [&](grpc::ClientContext* ctx) {
                         return client_->stub()->PushGradients(ctx, req, &resp);
                       }));
  return resp;
}

absl::StatusOr<v1::PushGradientsResponse> Session::Push(int64_t step, uint32_t slot, float scale) {
  v1::PushGradientsRequest req;
  req.set_step(step);
  req.set_slot(slot);
  req.set_scale(scale);
  return Push(req);
}

absl::Status Session::Update(int64_t step, const v1::AdamWHyper& hyper, uint32_t param_slot,
                             v1::DType out_dtype, bool column_steps) {
  v1::UpdateRequest req;
  req.set_step(step);
  *req.mutable_hyper() = hyper;
  req.set_param_slot(param_slot);
  req.set_out_dtype(out_dtype);
  req.set_column_steps(column_steps);
  return Update(std::move(req));
}

absl::Status Session::UpdateWithPush(int64_t step, const v1::AdamWHyper& hyper,
                                     uint32_t param_slot, v1::DType out_dtype, uint32_t grad_slot,
                                     float push_scale,
                                     const std::vector<std::string>& skip_params,
                                     bool predict) {
  v1::UpdateRequest req;
  req.set_predict(predict);
  for (const std::string& name : skip_params) req.add_skip_params(name);
  req.set_step(step);
  *req.mutable_hyper() = hyper;
  req.set_param_slot(param_slot);
  req.set_out_dtype(out_dtype);
  req.set_column_steps(true);
  req.set_fuse_push(true);
  req.set_fused_grad_slot(grad_slot);
  req.set_push_scale(push_scale);
  return Update(std::move(req));
}

absl::Status Session::Update(v1::UpdateRequest req) {
  *req.mutable_session() = ref();
  v1::UpdateResponse resp;
  // Validated and started; the daemon answers at once (WaitUpdate waits for the work).
  return Call("Update", 0, [&](grpc::ClientContext* ctx) {
    return client_->stub()->Update(ctx, req, &resp);
  });
}

absl::StatusOr<v1::MigrateColumnsResponse> Session::HandOverColumns(
    const std::vector<ColumnMove>& moves, std::optional<int64_t> handovers_before) {
  if (moves.empty()) return absl::InvalidArgumentError("HandOverColumns: no moves");
  v1::MigrateColumnsRequest req;
  *req.mutable_session() = ref();
  req.set_handover(true);
  if (handovers_before) req.set_handovers_before(*handovers_before);
  req.set_param(moves[0].param);
  for (int64_t c : moves[0].columns) req.add_columns(c);
  for (int64_t t : moves[0].steps) req.add_steps(t);
  for (size_t i = 1; i < moves.size(); ++i) {
    v1::ColumnHandover* h = req.add_more();
    h->set_param(moves[i].param);
    for (int64_t c : moves[i].columns) h->add_columns(c);
    for (int64_t t : moves[i].steps) h->add_steps(t);
  }
  v1::MigrateColumnsResponse resp;
  RETURN_IF_ERROR(Call("MigrateColumns", layout_.staging_bytes(), [&](grpc::ClientContext* ctx) {
    return client_->stub()->MigrateColumns(ctx, req, &resp);
  }));
  if (resp.more_size() != static_cast<int>(moves.size()) - 1)
    return absl::InternalError(absl::StrCat("HandOverColumns: ", resp.more_size() + 1,
                                            " answers for ", moves.size(), " parameters"));
  if (handovers_before) {
    handovers_ = *handovers_before + 1;
  } else if (handovers_.load() >= 0) {
    ++handovers_;
  }
  return resp;
}

absl::StatusOr<v1::WaitUpdateResponse> Session::WaitUpdate(int64_t min_version,
                                                           uint32_t timeout_ms) {
  const double t = client_->rpc_timeout_s();
  double bound = t;
  if (timeout_ms > 0) {
    bound = timeout_ms / 1000.0 + t;
  } else {
    // The daemon's answer ("not ready after ...") comes before the call's own deadline.
    const double margin = std::min(t / 4, 2.0);
    timeout_ms = static_cast<uint32_t>(std::max(1.0, std::floor((t - margin) * 1000)));
  }
  v1::WaitUpdateRequest req;
  *req.mutable_session() = ref();
  req.set_min_version(min_version);
  req.set_timeout_ms(timeout_ms);
  v1::WaitUpdateResponse resp;
  RETURN_IF_ERROR(Call(
      "WaitUpdate", 0,
      [&](grpc::ClientContext* ctx) { return client_->stub()->WaitUpdate(ctx, req, &resp); },
      bound));
  return resp;
}

absl::StatusOr<v1::CheckpointResponse> Session::Checkpoint(const std::string& tag) {
  v1::CheckpointRequest req;
  *req.mutable_session() = ref();
  req.set_tag(tag);
  v1::CheckpointResponse resp;
  RETURN_IF_ERROR(Call("Checkpoint", StateBytes(), [&](grpc::ClientContext* ctx) {
    return client_->stub()->Checkpoint(ctx, req, &resp);
  }));
  return resp;
}

absl::StatusOr<v1::RestoreResponse> Session::Restore(const std::string& tag, v1::DType out_dtype) {
  v1::RestoreRequest req;
  *req.mutable_session() = ref();
  req.set_tag(tag);
  req.set_out_dtype(out_dtype);
  v1::RestoreResponse resp;
  RETURN_IF_ERROR(Call("Restore", StateBytes(), [&](grpc::ClientContext* ctx) {
    return client_->stub()->Restore(ctx, req, &resp);
  }));
  return resp;
}

absl::StatusOr<std::string> Session::ReadCheckpointBytes(const std::string& tag,
                                                         bool delete_after) {
  if (!region_) return absl::FailedPreconditionError("ReadCheckpointBytes before RegisterParams");
  const uint8_t* staging = region_->data() + layout_.staging_offset();
  std::string out;
  for (uint64_t offset = 0;;) {
    v1::ReadCheckpointRequest req;
    *req.mutable_session() = ref();
    req.set_tag(tag);
    req.set_offset(offset);
    req.set_delete_after(delete_after);
    v1::ReadCheckpointResponse resp;
    // A chunk, behind the session's earlier work; the daemon may read the whole file first.
    RETURN_IF_ERROR(Call("ReadCheckpoint", StateBytes(), [&](grpc::ClientContext* ctx) {
      return client_->stub()->ReadCheckpoint(ctx, req, &resp);
    }));
    if (offset == 0) out.reserve(resp.total_bytes());
    out.append(reinterpret_cast<const char*>(staging), resp.length());
    offset += resp.length();
    if (offset >= resp.total_bytes()) break;
    if (resp.length() == 0)
      return absl::InternalError(absl::StrCat("ReadCheckpoint of '", tag, "' made no progress"));
  }
  return out;
}

absl::Status Session::WriteCheckpointBytes(const std::string& tag, const std::string& bytes) {
  if (!region_) return absl::FailedPreconditionError("WriteCheckpointBytes before RegisterParams");
  uint8_t* staging = region_->data() + layout_.staging_offset();
  const uint64_t chunk = layout_.staging_bytes();
  if (chunk == 0) return absl::FailedPreconditionError("the session has no staging area");
  uint64_t offset = 0;
  do {
    const uint64_t n = std::min<uint64_t>(chunk, bytes.size() - offset);
    memcpy(staging, bytes.data() + offset, n);
    v1::WriteCheckpointRequest req;
    *req.mutable_session() = ref();
    req.set_tag(tag);
    req.set_offset(offset);
    req.set_length(n);
    req.set_total_bytes(bytes.size());
    v1::WriteCheckpointResponse resp;
    // A chunk; the last one has the daemon verify and write the whole upload.
    RETURN_IF_ERROR(Call("WriteCheckpoint", std::max<uint64_t>(bytes.size(), StateBytes()),
                         [&](grpc::ClientContext* ctx) {
                           return client_->stub()->WriteCheckpoint(ctx, req, &resp);
                         }));
    offset += n;
  } while (offset < bytes.size());
  return absl::OkStatus();
}

absl::Status Session::DeleteCheckpoint(const std::string& tag) {
  v1::DeleteCheckpointRequest req;
  *req.mutable_session() = ref();
  req.set_tag(tag);
  v1::DeleteCheckpointResponse resp;
  // On the session's strand, behind its earlier work.
  return Call("DeleteCheckpoint", 0, [&](grpc::ClientContext* ctx) {
    return client_->stub()->DeleteCheckpoint(ctx, req, &resp);
  });
}

absl::StatusOr<std::string> Session::ExportState(int64_t* version) {
  if (!region_) return absl::FailedPreconditionError("ExportState before RegisterParams");
  const uint8_t* staging = region_->data() + layout_.staging_offset();
  std::string out;
  for (uint64_t offset = 0;;) {
    v1::ExportStateRequest req;
    *req.mutable_session() = ref();
    req.set_offset(offset);
    v1::ExportStateResponse resp;
    // The first chunk waits behind the session's earlier work (an Update); each copies at most
    // the staging area.
    RETURN_IF_ERROR(Call("ExportState", offset == 0 ? StateBytes() : layout_.staging_bytes(),
                         [&](grpc::ClientContext* ctx) {
                           return client_->stub()->ExportState(ctx, req, &resp);
                         }));
    if (offset == 0) out.reserve(resp.total_bytes());
    if (resp.length() > layout_.staging_bytes() || resp.total_bytes() < offset + resp.length())
      return absl::InternalError(absl::StrCat(
          "ExportState: a chunk of ", resp.length(), " bytes at ", offset, " of ",
          resp.total_bytes(), " does not fit the staging area of ", layout_.staging_bytes()));
    out.append(reinterpret_cast<const char*>(staging), resp.length());
    offset += resp.length();
    if (version != nullptr) *version = resp.version();
    if (offset >= resp.total_bytes()) break;
    if (resp.length() == 0) return absl::InternalError("ExportState made no progress");
  }
  return out;
}

absl::StatusOr<v1::ImportStateResponse> Session::ImportState(const void* bytes, uint64_t size,
                                                             v1::DType out_dtype) {
  if (!region_) return absl::FailedPreconditionError("ImportState before RegisterParams");
  uint8_t* staging = region_->data() + layout_.staging_offset();
  const uint64_t chunk = layout_.staging_bytes();
  if (chunk == 0) return absl::FailedPreconditionError("the session has no staging area");
  const char* src = static_cast<const char*>(bytes);
  v1::ImportStateResponse resp;
  uint64_t offset = 0;
  do {
    const uint64_t n = std::min<uint64_t>(chunk, size - offset);
    if (n > 0) memcpy(staging, src + offset, n);  // an empty state: bytes may be null
    v1::ImportStateRequest req;
    *req.mutable_session() = ref();
    req.set_offset(offset);
    req.set_length(n);
    req.set_total_bytes(size);
    req.set_out_dtype(out_dtype);
    // A chunk; the last one also verifies the checksum and writes the parameter slot.
    RETURN_IF_ERROR(Call("ImportState", offset + n == size ? StateBytes() : chunk,
                         [&](grpc::ClientContext* ctx) {
                           return client_->stub()->ImportState(ctx, req, &resp);
                         }));
    offset += n;
  } while (offset < size);
  if (!resp.complete())
    return absl::InternalError(absl::StrCat("ImportState: all ", size,
                                            " bytes sent, but the daemon did not complete it"));
  return resp;
}

std::future<absl::StatusOr<v1::WaitUpdateResponse>> Session::WaitUpdateAsync(int64_t min_version) {
  return std::async(std::launch::async, [this, min_version] { return WaitUpdate(min_version); });
}

}  // namespace stallfree
