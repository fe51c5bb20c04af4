// stallfree::Client: the library trainers link to offload optimizer work to stallfreed.
//
//   ASSIGN_OR_RETURN(auto client, Client::Connect("/run/stallfree/stallfreed.sock"));
//   ASSIGN_OR_RETURN(auto session, client->OpenSession("gpt", /*rank=*/0));
//   RETURN_IF_ERROR(session->RegisterParams({{"w", {1024, 1024}, v1::DTYPE_FP32}}));
//   RETURN_IF_ERROR(session->LoadValues({{"w", init}}));  // through the staging area, in chunks
//   memcpy(session->GradSlot(0, "w"), grad, bytes);  RETURN_IF_ERROR(session->Push(1, 0).status());
//   RETURN_IF_ERROR(session->Update(1, hyper, /*param_slot=*/0));
//   auto ready = session->WaitUpdateAsync(1);   // std::future; overlap compute here
//   const float* w = session->ParamsFp32(ready.get()->param_slot(), "w");
//
// Ownership: a Client owns its gRPC channel; a Session owns its mapping of the region and the
// fd connection that keeps the session alive (closing it, or the process dying, ends the
// session in the daemon). A Session must not outlive its Client.
// Thread safety: Client is thread safe. Session's RPC methods are thread safe; the region's
// bytes are shared memory, so the caller must not write a slot while a Push of it is in flight
// nor read a parameter slot while an Update into it runs (the gradient slots are double
// buffered for this; a session registered with one parameter slot must read each Update's
// parameters before it issues the next Update).
//
// Errors are absl::Status with the daemon's canonical codes (offload.proto says which call gives
// which). The codes that mean the daemon went away, or no longer has a session, so that callers
// decide by code and never by message text:
//   UNAVAILABLE  from any method: the daemon is gone. No daemon answers at the socket (Connect,
//                and every call after it went), the connection to it broke mid-call (gRPC's
//                transport errors; the fd socket's refused, reset or closed connection), or the
//                daemon is shutting down (SIGTERM). From a Session's methods also: any failure
//                after the connection that keeps the session alive has closed, i.e. the daemon
//                process that held the session exited, crashed or restarted (a restarted
//                daemon's "no session" or "wrong token" for it comes back as UNAVAILABLE, the
//                daemon's own message after "stallfreed went away (...): ").
//   NOT_FOUND    from a Session's methods, while the daemon that holds the session still runs,
//                naming "session.session_id: no session <id>": an operator closed the session
//                (stallfreectl close) or the daemon reclaimed it. NOT_FOUND also names a missing
//                parameter or checkpoint tag (the daemon's own files included: a missing file
//                is never UNAVAILABLE), so a caller that must tell the two apart asks
//                Client::ListSessions whether the session is still listed.
//   ABORTED      from WaitUpdate / WaitUpdateAsync: the session was closed or reclaimed while the
//                call waited (ABORTED also refuses an Update while the previous one runs).
//   DEADLINE_EXCEEDED  a call's bound passed (Deadlines, below). The message names the socket,
//                the RPC, the bound and the setting that makes it (rpc_timeout), and whether
//                the daemon still answers a health check (asked for at most 1 s more): if not,
//                it is stopped (SIGSTOP), hung or overloaded; if so, the call waited behind the
//                session's earlier work (a long Update) or the node is overloaded. The call's
//                outcome is then unknown (the daemon may still carry it out when it runs
//                again), except from WaitUpdate when the daemon itself answered that the
//                version is not ready yet: that one only waited, the session is intact and
//                WaitUpdate may be called again.
//
// Deadlines: no call waits for the daemon without a bound. rpc_timeout (Connect's
// rpc_timeout_s, else $STALLFREE_RPC_TIMEOUT in seconds, else kDefaultRpcTimeoutS) bounds every
// RPC, WaitUpdate's wait for an Update included (so it must exceed the daemon's longest Update);
// a call whose work in the daemon grows with the session's state (RegisterParams, LoadParams,
// PushGradients, MigrateColumns and the checkpoint calls) gets one more second per
// kSlowestBytesPerSecond bytes of that work, so that large checkpoints keep their time. Health
// and Session::Close take at most 5 s and 10 s. WaitUpdate asks the daemon to wait rpc_timeout
// less a margin (a quarter of it, at most 2 s), so that a live daemon answers "not ready" before
// the call's deadline. Connect's handshake is bounded by its timeout_ms; the fd socket's
// (attaching a session, a caller credential) by rpc_timeout.
#pragma once

#include <atomic>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "common/region.h"
#include "engine/offload_target.h"
#include "stallfree/v1/offload.grpc.pb.h"

namespace stallfree {

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  v1::DType grad_dtype = v1::DTYPE_FP32;
};

// A gRPC status as an absl::Status of the same code; UNKNOWN and CANCELLED, which only the
// transport gives (the daemon never answers them), become UNAVAILABLE.
absl::Status FromGrpc(const grpc::Status& s);

// rpc_timeout's default (Deadlines above): twice the 60 s the daemon used to wait for an Update,
// so that an Update that passed before passes now, while a daemon that stopped answering is
// reported within 2 minutes instead of never.
inline constexpr double kDefaultRpcTimeoutS = 120;
// The slowest the daemon's work on state bytes (copying, mlocking, a checkpoint written with
// fsync or read back) is allowed to be, for the bound of such a call: 64 MiB/s.
inline constexpr double kSlowestBytesPerSecond = 64.0 * 1024 * 1024;
// rpc_timeout in seconds: rpc_timeout_s when it is > 0, else $STALLFREE_RPC_TIMEOUT when set,
// else kDefaultRpcTimeoutS. INVALID_ARGUMENT naming the setting for a value that is not a
// positive number of seconds (at most 4294967, what WaitUpdateRequest.timeout_ms can name).
absl::StatusOr<double> RpcTimeoutSeconds(double rpc_timeout_s = 0);

class Session;

class Client {
 public:
  // Connects to the daemon's gRPC socket; fails with UNAVAILABLE naming the socket (and how to
  // start a daemon) if none answers within `timeout_ms`. rpc_timeout_s: the bound of every call
  // after it (Deadlines above; 0: $STALLFREE_RPC_TIMEOUT, else kDefaultRpcTimeoutS).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& socket_path,
                                                         int timeout_ms = 3000,
                                                         double rpc_timeout_s = 0);

  absl::StatusOr<std::unique_ptr<Session>> OpenSession(const std::string& name, int rank);
  // grpc.health.v1 status of the daemon: "SERVING" when all is well.
  absl::StatusOr<std::string> Health();
  absl::StatusOr<v1::Stats> GetStats();
  // This process's sessions and checkpoints (root: every uid's). Both present the caller
  // credential below.
  absl::StatusOr<std::vector<v1::SessionInfo>> ListSessions();
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints();
  // Removes checkpoint `tag` of this process's uid (offload.proto, DeleteCheckpoint).
  absl::Status DeleteCheckpoint(const std::string& tag);
  // Closes session `session_id` of this process's uid (root: any), as an administrator
  // (offload.proto, CloseSessionRequest); returns the bytes it freed.
  absl::StatusOr<uint64_t> CloseSession(uint64_t session_id);
  // The daemon's Prometheus text (root or the daemon's uid; offload.proto, GetMetrics).
  absl::StatusOr<std::string> Metrics();
  // The daemon's proof of this process's uid (offload.proto, CallerRef): obtained once from the
  // fd socket, whose connection the Client keeps open while it lives.
  absl::StatusOr<v1::CallerRef> Caller();

  ~Client();
  v1::Offload::Stub* stub() { return stub_.get(); }
  const std::string& socket_path() const { return socket_path_; }
  // The bound of every call, in seconds (Deadlines above).
  double rpc_timeout_s() const { return rpc_timeout_s_; }

 private:
  friend class Session;
  using RpcFn = std::function<grpc::Status(grpc::ClientContext*)>;
  Client(std::string path, std::shared_ptr<grpc::Channel> channel, double rpc_timeout_s);
  // rpc_timeout plus the seconds `work_bytes` of daemon work may take (kSlowestBytesPerSecond).
  double BoundFor(uint64_t work_bytes) const;
  // Runs `call` under a deadline `bound_s` seconds from now; *expired: the deadline passed with
  // no answer (gRPC's own DEADLINE_EXCEEDED, not the daemon's).
  grpc::Status Invoke(double bound_s, const RpcFn& call, bool* expired);
  // The DEADLINE_EXCEEDED of call `rpc` that got no answer within bound_s (for work_bytes of
  // work), after a health check of at most 1 s that says whether the daemon still answers;
  // daemon_pid (when known, else <= 0) named in the hint.
  absl::Status Unanswered(const char* rpc, double bound_s, uint64_t work_bytes, int daemon_pid);
  // status, converted (FromGrpc), for call `rpc`: an unanswered one as Unanswered, the daemon's
  // own DEADLINE_EXCEEDED with the socket and the call named.
  absl::Status Explain(absl::Status status, bool expired, const char* rpc, double bound_s,
                       uint64_t work_bytes, int daemon_pid);
  // An RPC of the Client's own: Invoke, FromGrpc, Explain.
  absl::Status Call(const char* rpc, const RpcFn& call);
  // One request and answer on a connection to the fd socket `path`, both bounded by rpc_timeout
  // (DEADLINE_EXCEEDED naming the socket past it).
  absl::Status FdExchange(int conn, const std::string& path, const std::string& request,
                          std::string* reply, std::vector<int>* fds, size_t max_fds,
                          const std::vector<int>& send_fds = {});

  std::string socket_path_;
  double rpc_timeout_s_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Offload::Stub> stub_;
  std::mutex caller_mu_;
  int caller_conn_ = -1;  // guarded by caller_mu_
  v1::CallerRef caller_;  // guarded by caller_mu_
};

class Session {
 public:
  ~Session();  // Closes the session (best effort) and unmaps the region.
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Registers parameters, then receives the region's fd, maps it (and, in CUDA builds,
  // registers it with cudaHostRegister). Call once. param_dtype: what Updates write to the
  // parameter slots (UNSPECIFIED: FP32 slots, which take either); param_slots: 1 or 2, with a
  // staging area of about 1/32 of the state (0: the layout of before, 2 slots and a staging
  // area of all the fp32 values). See RegisterParamsRequest.
  absl::Status RegisterParams(const std::vector<ParamSpec>& params,
                              v1::DType param_dtype = v1::DTYPE_UNSPECIFIED,
                              uint32_t param_slots = 0);

  const v1::RegionLayout& layout() const { return layout_; }
  // The daemon's memfd of this session's optimizer state (master, m, v, accumulator), held by
  // this process from the attach on and never mapped here: the state outlives the daemon's
  // process. -1 before RegisterParams, and after Close.
  int state_fd() const { return state_fd_; }
  // The region's memfd (mapped here); -1 before RegisterParams and after Close.
  int region_fd() const { return region_ ? region_->fd() : -1; }
  uint64_t state_bytes() const { return state_bytes_; }
  absl::StatusOr<const v1::ParamLayout*> Param(const std::string& name) const;
  // Where parameter `name`'s gradient goes in gradient slot `slot` (0 or 1).
  void* GradSlot(uint32_t slot, const std::string& name) const;
  // The staging area (layout().staging_bytes() bytes): loads, migrations and checkpoint bytes
  // pass through it.
  float* Staging() const;
  uint64_t staging_floats() const { return layout_.staging_bytes() / 4; }
  // Where parameter `name`'s initial fp32 values go before a LoadParams() of it whole; null when
  // the parameter does not fit in the staging area there (a large session: use LoadValues).
  float* StagingFp32(const std::string& name) const;
  // Parameter `name` in parameter slot `slot`, as written by an Update; null for a slot the
  // session does not have (slot >= layout().param_slots()), and ParamsFp32 null in a session
  // of bf16 parameter slots.
  const float* ParamsFp32(uint32_t slot, const std::string& name) const;
  const uint16_t* ParamsBf16(uint32_t slot, const std::string& name) const;

  // Every parameter whole, from its StagingFp32 (small sessions only; see LoadParamsRequest).
  absl::Status LoadParams();
  // Ranges the caller wrote into Staging() (LoadParamsRequest.ranges).
  using LoadRange = OffloadTarget::LoadRange;  // staging_offset: bytes into the staging area
  absl::Status LoadParams(const std::vector<LoadRange>& ranges);
  // Loads each named parameter's initial fp32 values from host memory (numel floats each),
  // through the staging area, as many ranges per call as fit.
  absl::Status LoadValues(const std::vector<std::pair<std::string, const float*>>& values);
  // Accumulates every parameter's gradient in `slot` (the whole of each parameter).
  absl::StatusOr<v1::PushGradientsResponse> Push(int64_t step, uint32_t slot, float scale = 1.0f);
  // The general form: explicit ranges.
  absl::StatusOr<v1::PushGradientsResponse> Push(const v1::PushGradientsRequest& request);
  // Starts AdamW; returns when the daemon accepted it (not when it finished).
  // column_steps: each column's bias correction uses its own step count (offload.proto).
  absl::Status Update(int64_t step, const v1::AdamWHyper& hyper, uint32_t param_slot,
                      v1::DType out_dtype = v1::DTYPE_FP32, bool column_steps = false);
  // The fused form (column steps only): the gradients in grad_slot are pushed with push_scale
  // as part of this Update (as Push(step, grad_slot, push_scale) and then Update would, bit for
  // bit, in one pass on the daemon). Do not write grad_slot until the Update is done
  // (WaitUpdate(step)): the daemon reads it while the Update runs. See UpdateRequest.fuse_push.
  // skip_params: parameters this Update leaves unchanged (UpdateRequest.skip_params);
  // predict: the parameters go out predicted one Update ahead (UpdateRequest.predict).
  absl::Status UpdateWithPush(int64_t step, const v1::AdamWHyper& hyper, uint32_t param_slot,
                              v1::DType out_dtype, uint32_t grad_slot, float push_scale = 1.0f,
                              const std::vector<std::string>& skip_params = {},
                              bool predict = false);
  // The general form: an explicit request (its session is set here).
  absl::Status Update(v1::UpdateRequest request);
  // Hands over columns of one or more parameters in the middle of a round, in one call
  // (MigrateColumnsRequest.handover): the caller wrote each move's three incoming [rows, n]
  // blocks (values, m, v) in Staging(), each move's four blocks after the previous move's (the
  // first at its start; all must fit); the outgoing columns' state and accumulated gradient come
  // back in the four blocks. The response has their step counts (moves[0]'s in steps, the
  // others' in more) and whether the gradient blocks are zero (pushes == 0). moves must not be
  // empty. handovers_before: the handovers the session finished before this one, when the caller
  // knows (MigrateColumnsRequest.handovers_before: then sending it again after a lost answer
  // gets the answer again instead of a second exchange).
  using ColumnMove = OffloadTarget::ColumnMove;
  absl::StatusOr<v1::MigrateColumnsResponse> HandOverColumns(
      const std::vector<ColumnMove>& moves,
      std::optional<int64_t> handovers_before = std::nullopt);
  // Waits until version min_version (or newer) is ready. timeout_ms: how long the daemon waits
  // (the call's bound is that plus rpc_timeout); 0: rpc_timeout less a margin, the call's bound
  // rpc_timeout (Deadlines above). The daemon's DEADLINE_EXCEEDED ("not ready after ...") may
  // be retried: the Update goes on.
  absl::StatusOr<v1::WaitUpdateResponse> WaitUpdate(int64_t min_version, uint32_t timeout_ms = 0);
  std::future<absl::StatusOr<v1::WaitUpdateResponse>> WaitUpdateAsync(int64_t min_version);
  // Writes the session's optimizer state to the daemon's state directory as `tag`, and reads
  // it back into this (registered) session (offload.proto: CheckpointRequest, RestoreRequest).
  absl::StatusOr<v1::CheckpointResponse> Checkpoint(const std::string& tag);
  absl::StatusOr<v1::RestoreResponse> Restore(const std::string& tag,
                                              v1::DType out_dtype = v1::DTYPE_FP32);
  // The bytes of checkpoint `tag` (as Checkpoint wrote it), moved through the staging area in
  // chunks (offload.proto: ReadCheckpoint); with delete_after the daemon removes the file once
  // it has been read. And the inverse: stores `bytes` (a whole checkpoint file, verified by the
  // daemon) as `tag`, for a later Restore. Both need registered parameters and must not run
  // while the staging area is in use (LoadParams, HandOverColumns).
  absl::StatusOr<std::string> ReadCheckpointBytes(const std::string& tag, bool delete_after);
  absl::Status WriteCheckpointBytes(const std::string& tag, const std::string& bytes);
  absl::Status DeleteCheckpoint(const std::string& tag);
  // The session's optimizer state as the bytes of a checkpoint of it, and their restoration
  // into this (registered) session as Restore would (the parameter slots then hold the restored
  // values in out_dtype), moved through the staging area in chunks straight out of and into the
  // daemon's pinned state, with no file (offload.proto: ExportState, ImportState): no state
  // directory is needed and nothing is left behind. Each chunk is one call, bounded by
  // rpc_timeout plus the staging area's work. Neither may run while the staging area is in use
  // (LoadParams, HandOverColumns); *version: the version the state holds.
  absl::StatusOr<std::string> ExportState(int64_t* version = nullptr);
  absl::StatusOr<v1::ImportStateResponse> ImportState(const void* bytes, uint64_t size,
                                                      v1::DType out_dtype = v1::DTYPE_FP32);
  absl::Status Close();

  // Where a session's state stands when a daemon takes it back (the newest commit of its
  // record, server/session_record.h): the newest version an Update made ready, the step of the
  // last Update, and the pushes since it.
  struct Adopted {
    int64_t version = 0;
    int64_t last_step = 0;
    int64_t pushes_since_update = 0;
    int64_t handovers = 0;  // HandOver calls the session finished, ever
  };
  // After the daemon that held this session went away (a call failed UNAVAILABLE), gives the
  // session to the daemon now at the same fd socket (a restarted stallfreed), waiting up to
  // wait_s seconds for one to answer: the region's and the state's descriptors go with the token
  // and the generation (server/fd_server.h, ADOPT). The session then has a new id (ref()) and
  // its state as it was: a call that failed is retried if Adopted says that it did not happen.
  // UNAVAILABLE naming the socket when no daemon answered in time (a daemon that answers that
  // it is shutting down is waited past); the daemon's refusal with its code otherwise
  // (PERMISSION_DENIED, FAILED_PRECONDITION: a stale generation, a torn state).
  // Not concurrently with the session's other calls.
  absl::StatusOr<Adopted> Reattach(double wait_s);
  // The generation the session's record had at the attach or the last Reattach.
  uint64_t generation() const { return generation_.load(); }
  // The handovers the session has finished, as this process knows them: 0 after RegisterParams,
  // the record's count after a Reattach, one more after each HandOverColumns; -1 when not known
  // (a session registered elsewhere, not re-attached yet).
  int64_t handovers() const { return handovers_.load(); }

  // The session's id (a Reattach changes it) and token.
  v1::SessionRef ref() const {
    v1::SessionRef r;
    r.set_session_id(session_id_.load());
    r.set_token(token_);
    return r;
  }

 private:
  friend class Client;
  Session(Client* client, v1::SessionRef ref, std::string fd_socket);
  absl::Status Attach();
  // The status of one of this session's RPCs: FromGrpc's, or UNAVAILABLE once the session's
  // connection to the daemon has closed (see the top of this file).
  absl::Status Rpc(const grpc::Status& s) const;
  // One of this session's RPCs, `rpc`, bounded by rpc_timeout plus work_bytes of daemon work
  // (bound_s > 0: that bound instead): Invoke, Rpc, Client::Explain.
  absl::Status Call(const char* rpc, uint64_t work_bytes, const Client::RpcFn& call,
                    double bound_s = 0);
  // The daemon's pid, from the session's connection to its fd socket; 0 when not attached.
  int DaemonPid() const;
  // The bytes of the session's state in the daemon: its region, and fp32 master, m, v and
  // accumulator per element (what a checkpoint writes and reads); 0 before RegisterParams.
  uint64_t StateBytes() const;

  Client* client_;
  const std::string token_;
  // Written by Reattach while other threads' calls may read them.
  std::atomic<uint64_t> session_id_;
  std::string fd_socket_;
  std::atomic<int> conn_{-1};
  std::vector<int> dead_conns_;  // the connections of daemons gone, closed by Close
  bool closed_ = false;
  bool host_registered_ = false;
  v1::RegionLayout layout_;
  std::map<std::string, v1::ParamLayout> params_;
  std::unique_ptr<MappedRegion> region_;
  int state_fd_ = -1;
  uint64_t state_bytes_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> handovers_{-1};
  // The nonce of the adoption Reattach attempts until one succeeds (0: none yet).
  uint64_t adopt_nonce_ = 0;
};

}  // namespace stallfree
