// SessionManager: the daemon's sessions, their regions and optimizer state, and the work on them.
//
// Each session owns a memfd region (two gradient slots, two parameter slots, a staging area) and
// pinned fp32 state (master, m, v, accumulator), all laid out flat: parameter i occupies
// elements [e_i, e_i + numel_i) of every fp32 array, e_i a multiple of 16.
//
// Every operation validates its request completely before it touches memory, then runs the
// work on the session's Strand inside the oneTBB arena and reports through `done`. No method
// blocks on optimizer work; `done` runs on an arena thread (or inline for errors).
// Thread safe.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <tbb/task_arena.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/region.h"
#include "kernels/optimizer.h"
#include "server/strand.h"
#include "stallfree/v1/offload.pb.h"

namespace stallfree {

struct DaemonOptions {
  std::string fd_socket_path;
  uint64_t pinned_budget_bytes = 0;
  PinPolicy pin = PinPolicy::kBestEffort;
  int worker_threads = 0;
  // Where Checkpoint writes and Restore reads (created if missing); empty: checkpoints are off.
  std::string state_dir;
};

// Daemon-wide counters, read by GetStats.
struct DaemonCounters {
  std::atomic<int64_t> sessions_opened{0};
  std::atomic<int64_t> sessions_closed{0};
  std::atomic<int64_t> sessions_reclaimed{0};
  std::atomic<uint64_t> pinned_bytes{0};
  std::atomic<int64_t> pushes{0};
  std::atomic<int64_t> updates{0};
  std::atomic<int64_t> accumulate_ns{0};
  std::atomic<int64_t> update_ns{0};
  std::atomic<uint64_t> bytes_in{0};
  std::atomic<uint64_t> bytes_out{0};
  std::atomic<int64_t> rejected{0};
  std::atomic<int64_t> migrated_columns{0};
};

struct WaitResult {
  int64_t version = 0;
  uint32_t slot = 0;
  v1::DType dtype = v1::DTYPE_FP32;
  double update_seconds = 0;
};

class Session;

// One contiguous run of gradient elements to add into an accumulator.
struct AccumulateJob {
  float* acc;
  const uint8_t* src;
  kernels::GradType type;
  int64_t count;
};

class SessionManager {
 public:
  SessionManager(DaemonOptions options, tbb::task_arena* arena);
  ~SessionManager();
  SessionManager(const SessionManager&) = delete;
  SessionManager& operator=(const SessionManager&) = delete;

  absl::StatusOr<v1::OpenSessionResponse> Open(const v1::OpenSessionRequest& request);
  // Closes after the session's queued work finishes; the region is freed then.
  absl::StatusOr<uint64_t> Close(const v1::SessionRef& ref);

  void RegisterParams(const v1::RegisterParamsRequest& request, v1::RegisterParamsResponse* response,
                      std::function<void(absl::Status)> done);
  void LoadParams(const v1::LoadParamsRequest& request, std::function<void(absl::Status)> done);
  void PushGradients(const v1::PushGradientsRequest& request, v1::PushGradientsResponse* response,
                     std::function<void(absl::Status)> done);
  void PushGradientsInline(const v1::PushGradientsInlineRequest& request,
                           v1::PushGradientsResponse* response,
                           std::function<void(absl::Status)> done);
  // Validates and starts the update; returns at once. The result is observed by WaitUpdate.
  absl::Status Update(const v1::UpdateRequest& request);
  // Swaps the state of some columns with the staging area (offload.proto, MigrateColumns).
  void MigrateColumns(const v1::MigrateColumnsRequest& request,
                      v1::MigrateColumnsResponse* response,
                      std::function<void(absl::Status)> done);
  // Checkpoint files (offload.proto): written / read on the session's strand.
  void Checkpoint(const v1::CheckpointRequest& request, v1::CheckpointResponse* response,
                  std::function<void(absl::Status)> done);
  void Restore(const v1::RestoreRequest& request, v1::RestoreResponse* response,
               std::function<void(absl::Status)> done);
  // The caller's checkpoints (root: all); the file reads run on the arena.
  void ListCheckpoints(const v1::ListCheckpointsRequest& request,
                       v1::ListCheckpointsResponse* response,
                       std::function<void(absl::Status)> done);
  // Checkpoint bytes through the staging area, and removal (offload.proto): on the strand.
  void ReadCheckpoint(const v1::ReadCheckpointRequest& request,
                      v1::ReadCheckpointResponse* response, std::function<void(absl::Status)> done);
  void WriteCheckpoint(const v1::WriteCheckpointRequest& request,
                       v1::WriteCheckpointResponse* response,
                       std::function<void(absl::Status)> done);
  void DeleteCheckpoint(const v1::DeleteCheckpointRequest& request,
                        std::function<void(absl::Status)> done);
  // Calls done once the version is ready, the timeout passes, or the session goes away.
  void WaitUpdate(const v1::WaitUpdateRequest& request,
                  std::function<void(absl::StatusOr<WaitResult>)> done);

  v1::Stats GetStats();
  // The sessions of the caller's uid (root: all).
  absl::StatusOr<std::vector<v1::SessionInfo>> ListSessions(const v1::CallerRef& caller);

  // The fd hand-off: checks the token, makes the peer's kernel-reported uid and pid the
  // session's, returns the memfd (still owned by the session) and its size. On success the
  // connection becomes the session's liveness channel: OnConnectionClosed(session_id) must be
  // called when it closes.
  absl::StatusOr<std::pair<int, uint64_t>> Attach(uint64_t session_id, const std::string& token,
                                                  uid_t peer_uid, pid_t peer_pid);
  void OnConnectionClosed(uint64_t session_id);
  // A caller credential for the peer's uid (offload.proto, CallerRef), valid until
  // DropCaller(caller_id), which the fd socket calls when the connection closes.
  v1::CallerRef NewCaller(uid_t peer_uid, pid_t peer_pid);
  void DropCaller(uint64_t caller_id);

  // Reclaims sessions whose opener process is gone and expires WaitUpdate timeouts.
  // Called periodically by the daemon's housekeeping thread.
  void Housekeeping();

  // Refuses new work (UNAVAILABLE) and waits for all queued and running work to finish.
  void Drain();

 private:
  absl::StatusOr<std::shared_ptr<Session>> Find(const v1::SessionRef& ref);
  // A session's checkpoint `tag`: the session, its uid and the file's path.
  struct Owned {
    std::shared_ptr<Session> session;
    uid_t uid;
    std::string path;
  };
  // Find, plus what every checkpoint RPC (`what`) needs: a state directory, a valid tag, a
  // registered session (its staging area exists) whose process attached (its uid is known).
  absl::StatusOr<Owned> FindForCheckpoint(const v1::SessionRef& ref, const std::string& tag,
                                          const char* what);
  // The uid of a caller credential (PermissionDenied for a wrong token, Unauthenticated for none).
  absl::StatusOr<uid_t> CallerUid(const v1::CallerRef& caller, const char* what);
  // The uid behind a request: its session's if it names one (attached), else its caller's.
  absl::StatusOr<uid_t> Identify(const v1::CallerRef& caller, const v1::SessionRef& session,
                                 const char* what);
  // Runs fn on the arena (file I/O off the gRPC threads); Drain waits for it.
  void RunDetached(std::function<void()> fn);
  void Reclaim(uint64_t id, const std::string& why);
  void Reject(const absl::Status& s);
  // Reject(s), then done(s).
  void Fail(const absl::Status& s, const std::function<void(absl::Status)>& done);
  // Every session, whatever its uid (GetStats, ListSessions).
  std::vector<v1::SessionInfo> AllSessions();
  // Runs the validated jobs on the session's strand, counts them, then calls done. `whole`: the
  // jobs cover every element of every parameter (a whole-slot push).
  void PostAccumulate(std::shared_ptr<Session> s, std::vector<AccumulateJob> jobs, bool whole,
                      float scale, uint64_t bytes, v1::PushGradientsResponse* resp,
                      std::function<void(absl::Status)> done);

  const DaemonOptions options_;
  tbb::task_arena* arena_;
  DaemonCounters counters_;
  std::chrono::steady_clock::time_point start_;
  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> reserved_bytes_{0};

  std::mutex mu_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::shared_ptr<Session>> sessions_;
  struct Caller {
    std::string token;
    uid_t uid;
  };
  std::map<uint64_t, Caller> callers_;
  int64_t detached_running_ = 0;  // RunDetached tasks not finished yet
  std::condition_variable detached_cv_;
};

}  // namespace stallfree
