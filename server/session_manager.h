// SessionManager: the daemon's registry of sessions (OffloadSession), who may use them (session
// tokens, caller credentials, uids), and the validation of every request.
//
// Every operation validates its request completely before it touches memory, then posts the
// work to the session's Strand inside the oneTBB arena and reports through `done`. No method
// blocks on optimizer work; `done` runs on an arena thread (or inline for errors).
//
// Lifetimes: a closed or reclaimed session leaves the registry at once, and its strand closes
// (it refuses new work; a request that found the session just before fails as if it had not),
// but the manager keeps the session in closing_ until the strand has run its last task: then
// the session's memory is released and the session dropped. Drain closes every strand and waits
// for all of them, closing ones included, and for the RunDetached tasks; once it has returned
// (the destructor drains too) no task that uses the manager is queued or running, so the
// manager and then the arena may go.
// Thread safe.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <tbb/task_arena.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "common/region.h"
#include "server/offload_session.h"
#include "stallfree/v1/offload.pb.h"

namespace stallfree {

struct DaemonOptions {
  std::string fd_socket_path;
  uint64_t pinned_budget_bytes = 0;
  PinPolicy pin = PinPolicy::kBestEffort;
  int worker_threads = 0;
  // Where Checkpoint writes and Restore reads (created if missing); empty: checkpoints are off.
  std::string state_dir;
  // How long a WaitUpdate waits for its version when the request names no timeout_ms
  // (stallfreed --update_wait_s); a request's own timeout_ms replaces it. Reported in GetStats
  // and in the DEADLINE_EXCEEDED that ends such a wait.
  std::chrono::milliseconds update_wait{60000};
};

class SessionManager {
 public:
  using Done = std::function<void(absl::Status)>;

  SessionManager(DaemonOptions options, tbb::task_arena* arena);
  ~SessionManager();  // Drain()
  SessionManager(const SessionManager&) = delete;
  SessionManager& operator=(const SessionManager&) = delete;

  absl::StatusOr<v1::OpenSessionResponse> Open(const v1::OpenSessionRequest& request);
  // Closes after the session's queued work finishes; the region is freed then.
  absl::StatusOr<uint64_t> Close(const v1::CloseSessionRequest& request);

  void RegisterParams(const v1::RegisterParamsRequest& request, v1::RegisterParamsResponse* response,
                      Done done);
  void LoadParams(const v1::LoadParamsRequest& request, Done done);
  void PushGradients(const v1::PushGradientsRequest& request, v1::PushGradientsResponse* response,
                     Done done);
  void PushGradientsInline(const v1::PushGradientsInlineRequest& request,
                           v1::PushGradientsResponse* response, Done done);
  // Validates and starts the update; returns at once. The result is observed by WaitUpdate.
  absl::Status Update(const v1::UpdateRequest& request);
  // Hands over the state of some columns through the staging area (offload.proto,
  // MigrateColumns with handover).
  void MigrateColumns(const v1::MigrateColumnsRequest& request,
                      v1::MigrateColumnsResponse* response, Done done);
  // Checkpoint files (offload.proto): written / read on the session's strand.
  void Checkpoint(const v1::CheckpointRequest& request, v1::CheckpointResponse* response,
                  Done done);
  void Restore(const v1::RestoreRequest& request, v1::RestoreResponse* response, Done done);
  // The caller's checkpoints (root: all); the file reads run on the arena.
  void ListCheckpoints(const v1::ListCheckpointsRequest& request,
                       v1::ListCheckpointsResponse* response, Done done);
  // Checkpoint bytes through the staging area, and removal (offload.proto): on the strand.
  void ReadCheckpoint(const v1::ReadCheckpointRequest& request,
                      v1::ReadCheckpointResponse* response, Done done);
  void WriteCheckpoint(const v1::WriteCheckpointRequest& request,
                       v1::WriteCheckpointResponse* response, Done done);
  void DeleteCheckpoint(const v1::DeleteCheckpointRequest& request, Done done);
  // The session's state through its staging area with no file (offload.proto, ExportState /
  // ImportState): on the strand, with or without a state directory.
  void ExportState(const v1::ExportStateRequest& request, v1::ExportStateResponse* response,
                   Done done);
  void ImportState(const v1::ImportStateRequest& request, v1::ImportStateResponse* response,
                   Done done);
  // Calls done once the version is ready, the wait passes (the request's timeout_ms, else
  // options.update_wait: DEADLINE_EXCEEDED, and the session is intact), or the session goes away.
  void WaitUpdate(const v1::WaitUpdateRequest& request, OffloadSession::WaitDone done);

  v1::Stats GetStats();
  // The daemon-wide counters and histograms (the metrics endpoint, the gRPC edge's rejections).
  DaemonCounters& counters() { return counters_; }
  // The sessions of the caller's uid (root: all).
  absl::StatusOr<std::vector<v1::SessionInfo>> ListSessions(const v1::CallerRef& caller);
  // OK for a caller credential of root or of the daemon's own uid (the operator).
  absl::Status AuthorizeOperator(const v1::CallerRef& caller, const char* what);
  // Every session, whatever its uid: for the metrics endpoint, an operator's interface.
  std::vector<v1::SessionInfo> AllSessionInfo();

  // The fd hand-off: checks the token, makes the peer's kernel-reported uid and pid the
  // session's, returns the region's and the state's memfds (still owned by the session) and
  // sizes. On success the connection becomes the session's liveness channel:
  // OnConnectionClosed(session_id) must be called when it closes.
  absl::StatusOr<SessionFds> Attach(uint64_t session_id, const std::string& token,
                                    uid_t peer_uid, pid_t peer_pid);
  void OnConnectionClosed(uint64_t session_id);
  // Takes back a session that a daemon process before this one held, from its region's and
  // state's memfds (owned by this call from here on, closed on failure) sent by the session's
  // process, which presents the session's token and the generation it last got. The state's
  // record (session_record.h) must be whole and name the peer's uid, that token's digest and
  // that generation, with a registration this daemon lays out identically, and no work method
  // may have been running when it was last committed (its arrays could be torn). Refusals:
  // PermissionDenied (another uid, a wrong token), FailedPrecondition (a stale generation, a
  // torn or differently laid out state), DataLoss (no whole record), ResourceExhausted (the
  // budget), Unavailable while draining. The session gets a new id, its process's connection
  // becomes its liveness channel (OnConnectionClosed), as after Attach. `nonce` (0: none) names
  // the attempt: a process whose adoption succeeded in a daemon that died before answering (once
  // or more) retries with the generation it has and the same nonce, and is let in.
  absl::StatusOr<AdoptResult> Adopt(const std::string& token, uint64_t generation,
                                    uint64_t nonce, int region_fd, int state_fd, uid_t peer_uid,
                                    pid_t peer_pid);
  // The service manager's fd store (fd_store.h): `keep` gets a session's key and its state's
  // and region's memfds once its process attached or adopted it (the daemon keeps owning them),
  // `drop` its key once it is closed for good. Set before serving.
  void SetFdStore(std::function<void(const std::string&, int, int)> keep,
                  std::function<void(const std::string&)> drop);
  // A session's key in the fd store: its state memfd's inode ("" if fstat fails).
  static std::string FdKey(int state_fd);
  // A session's state the fd store passed this daemon at start (owned by this call): finishes
  // the Update or push the daemon before was cut short in (as Adopt does), leaves the record
  // for its process's Adopt (same generation), and holds the key for `hold`: a process that
  // re-attaches within it keeps the store's copy; after it, Housekeeping drops it. A state that
  // cannot be taken back (torn, closed, laid out otherwise) is dropped from the store at once.
  absl::Status HoldStored(const std::string& key, int region_fd, int state_fd,
                          std::chrono::seconds hold);
  // A caller credential for the peer's uid (offload.proto, CallerRef), valid until
  // DropCaller(caller_id), which the fd socket calls when the connection closes.
  v1::CallerRef NewCaller(uid_t peer_uid, pid_t peer_pid);
  void DropCaller(uint64_t caller_id);

  // Reclaims sessions whose opener process is gone and expires WaitUpdate timeouts.
  // Called periodically by the daemon's housekeeping thread.
  void Housekeeping();

  // Refuses new work (UNAVAILABLE) and waits for all queued and running work to finish: every
  // session's, closing ones included, and the RunDetached tasks.
  void Drain();

 private:
  // Adopt; token null: from the fd store (HoldStored).
  absl::StatusOr<AdoptResult> AdoptImpl(const std::string* token, uint64_t generation,
                                        uint64_t nonce, int region_fd, int state_fd,
                                        uid_t peer_uid, pid_t peer_pid);
  // The session `ref` names, for the request `what`: Unavailable while draining, NotFound,
  // PermissionDenied for a wrong token, and with needs_registered FailedPrecondition
  // ("<what> before RegisterParams") until it has registered. The one lookup of every RPC.
  absl::StatusOr<std::shared_ptr<OffloadSession>> Lookup(const v1::SessionRef& ref,
                                                         const char* what, bool needs_registered)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Posts work to the session's strand. If the strand refuses it (the session closed, or the
  // daemon drains), the error a new request would get. The caller holds a reference to s.
  absl::Status Post(const OffloadSession& s, std::function<void()> work) ABSL_LOCKS_EXCLUDED(mu_);
  // Post, or Fail(that error, done).
  void PostOrFail(const OffloadSession& s, std::function<void()> work, const Done& done);
  // A session's checkpoint `tag`: the session, its uid and the file's path.
  struct Owned {
    std::shared_ptr<OffloadSession> session;
    uid_t uid;
    std::string path;
  };
  // Lookup, plus what every checkpoint RPC (`what`) needs: a state directory, a valid tag, a
  // registered session (its staging area exists) whose process attached (its uid is known).
  absl::StatusOr<Owned> LookupForCheckpoint(const v1::SessionRef& ref, const std::string& tag,
                                            const char* what);
  // The uid of a caller credential (PermissionDenied for a wrong token, Unauthenticated for none).
  absl::StatusOr<uid_t> CallerUid(const v1::CallerRef& caller, const char* what)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The uid behind a request: its session's if it names one (attached), else its caller's.
  absl::StatusOr<uid_t> Identify(const v1::CallerRef& caller, const v1::SessionRef& session,
                                 const char* what);
  // Runs fn on the arena (file I/O off the gRPC threads); Drain waits for it. Unavailable (fn
  // dropped) while draining.
  absl::Status RunDetached(std::function<void()> fn) ABSL_LOCKS_EXCLUDED(mu_);
  // Moves session `id` from the registry to closing_; null if it is not registered (any more).
  std::shared_ptr<OffloadSession> Unregister(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  // Closes the strand of an unregistered session; once its last task has run, releases the
  // session's memory and drops it from closing_.
  void Retire(const std::shared_ptr<OffloadSession>& s) ABSL_LOCKS_EXCLUDED(mu_);
  void Reclaim(uint64_t id, const std::string& why);
  void Reject(const absl::Status& s);
  // Reject(s), then done(s).
  void Fail(const absl::Status& s, const Done& done);
  // The registered sessions.
  std::vector<std::shared_ptr<OffloadSession>> OpenSessions() ABSL_LOCKS_EXCLUDED(mu_);
  // Runs a push's plan on the session's strand, then calls done (or fails with the plan's error).
  void PostAccumulate(std::shared_ptr<OffloadSession> s, absl::StatusOr<PushPlan> plan,
                      v1::PushGradientsResponse* resp, Done done);
  // Drain's condition: no closing session, no RunDetached task left.
  bool Settled() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return closing_.empty() && detached_running_ == 0;
  }

  const DaemonOptions options_;
  tbb::task_arena* const arena_;
  // Used by the sessions' work: declared before the sessions so that they outlive them.
  DaemonCounters counters_;
  PinnedBudget budget_;
  const std::chrono::steady_clock::time_point start_;

  mutable Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::shared_ptr<OffloadSession>> sessions_ ABSL_GUARDED_BY(mu_);
  // Closed or reclaimed sessions whose strand may still run tasks.
  std::map<uint64_t, std::shared_ptr<OffloadSession>> closing_ ABSL_GUARDED_BY(mu_);
  // The fd store (SetFdStore): each attached or adopted session's key, and the keys of states
  // it passed at start, held until their processes re-attach (HoldStored) or the deadline.
  std::function<void(const std::string&, int, int)> keep_fds_;
  std::function<void(const std::string&)> drop_fds_;
  std::map<uint64_t, std::string> stored_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::chrono::steady_clock::time_point> held_ ABSL_GUARDED_BY(mu_);
  struct Caller {
    std::string token;
    uid_t uid;
  };
  std::map<uint64_t, Caller> callers_ ABSL_GUARDED_BY(mu_);
  int64_t detached_running_ ABSL_GUARDED_BY(mu_) = 0;  // RunDetached tasks not finished yet
};

}  // namespace stallfree
