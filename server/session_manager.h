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
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints();
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
  std::vector<v1::SessionInfo> ListSessions();

  // The fd hand-off: checks the token and the peer's uid, returns the memfd (still owned by the
  // session) and its size. On success the connection `sock` becomes the session's liveness
  // channel: OnConnectionClosed(session_id) must be called when it closes.
  absl::StatusOr<std::pair<int, uint64_t>> Attach(uint64_t session_id, const std::string& token,
                                                  uid_t peer_uid, pid_t peer_pid);
  void OnConnectionClosed(uint64_t session_id);

  // Reclaims sessions whose opener process is gone and expires WaitUpdate timeouts.
  // Called periodically by the daemon's housekeeping thread.
  void Housekeeping();

  // Refuses new work (UNAVAILABLE) and waits for all queued and running work to finish.
  void Drain();

 private:
  absl::StatusOr<std::shared_ptr<Session>> Find(const v1::SessionRef& ref);
  // Find, plus the checks every checkpoint RPC makes: a state directory and a valid tag.
  absl::StatusOr<std::shared_ptr<Session>> FindForCheckpoint(const v1::SessionRef& ref,
                                                             const std::string& tag);
  // FindForCheckpoint, plus a registered session (its staging area exists) for `what`, and,
  // with must_own, a tag the session wrote itself (PermissionDenied otherwise).
  absl::StatusOr<std::shared_ptr<Session>> FindOwnCheckpoint(const v1::SessionRef& ref,
                                                             const std::string& tag,
                                                             const char* what, bool must_own);
  void Reclaim(uint64_t id, const std::string& why);
  void Reject(const absl::Status& s);
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
};

}  // namespace stallfree
