#include "parallel/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace stallfree {
namespace parallel {
namespace {

using Clock = std::chrono::steady_clock;

static_assert(sizeof(ncclUniqueId) == 32 * sizeof(float), "ncclUniqueId is 128 bytes");

constexpr int kMaxTag = 1 << 20;

absl::Status CudaError(cudaError_t err, const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": CUDA error ", cudaGetErrorName(err), " (",
                                          cudaGetErrorString(err), ")"));
}

absl::Status NcclError(ncclResult_t res, const std::string& what) {
  std::string msg = absl::StrCat(what, ": NCCL error ", static_cast<int>(res), " (",
                                 ncclGetErrorString(res), ")");
  switch (res) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(msg);
    case ncclRemoteError:
    case ncclSystemError:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// Sleeps a little longer each time, from a yield up to 1 ms, so short waits stay cheap.
class Backoff {
 public:
  void Pause() {
    if (spins_ < 64) {
      ++spins_;
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
    if (sleep_us_ < 1000) sleep_us_ *= 2;
  }

 private:
  int spins_ = 0;
  int sleep_us_ = 10;
};

class NcclWork;

// An ISend/IRecv held until the next flush.
struct PendingP2p {
  bool is_send;
  float* buf;
  int64_t count;
  int peer;
  std::shared_ptr<NcclWork> work;
};

// Everything the communicator and its Works share; torn down when the last of them is gone.
struct NcclState {
  std::mutex mu;
  ncclComm_t comm = nullptr;
  int rank = 0;
  int size = 1;
  int device = 0;
  cudaStream_t stream = nullptr;
  bool own_stream = false;
  float* barrier_buf = nullptr;  // One zero float on the device, all-reduced by Barrier().
  std::chrono::milliseconds timeout{60000};
  absl::Status broken;  // OK until the communicator is aborted.
  OpCounters counters;
  std::vector<PendingP2p> pending;

  ~NcclState();

  std::string Where(const char* op) const {
    return absl::StrCat("NCCL ", op, " on rank ", rank, " of ", size, " (device ", device, ")");
  }
  // Aborts the communicator (once) and records `status` as the reason every later call gets.
  void AbortLocked(absl::Status status);
  // In non-blocking mode a call may return ncclInProgress; waits until the communicator is
  // ready again, aborting after `timeout`.
  absl::Status WaitReadyLocked(ncclResult_t res, const char* op);
  absl::Status FlushLocked();
  void Count(OpKind kind, int64_t sent, int64_t received) {
    OpCounter& c = counters[static_cast<size_t>(kind)];
    ++c.calls;
    c.bytes_sent += sent;
    c.bytes_received += received;
  }
};

class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<NcclState> state, const char* op) : state_(std::move(state)), op_(op) {}
  // A Work that is already complete with `status`.
  explicit NcclWork(absl::Status status) : op_("failed"), done_(true), result_(status) {}
  ~NcclWork() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }

  // Records the completion event on the state's stream (state mutex held).
  absl::Status RecordLocked() {
    cudaError_t err = cudaEventCreateWithFlags(&event_, cudaEventDisableTiming);
    if (err != cudaSuccess) {
      event_ = nullptr;
      return CudaError(err, state_->Where(op_) + ": cudaEventCreate");
    }
    err = cudaEventRecord(event_, state_->stream);
    if (err != cudaSuccess) return CudaError(err, state_->Where(op_) + ": cudaEventRecord");
    recorded_ = true;
    return absl::OkStatus();
  }
  // Fails the work before it was enqueued (state mutex held).
  void FailLocked(absl::Status status) {
    enqueue_status_ = std::move(status);
    recorded_ = true;
  }

  absl::Status Wait() override {
    std::lock_guard<std::mutex> wait_lock(wait_mu_);
    if (done_) return result_;
    result_ = WaitImpl();
    done_ = true;
    return result_;
  }

 private:
  absl::Status WaitImpl() {
    NcclState& s = *state_;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (!recorded_) {
        absl::Status st = s.FlushLocked();
        if (!st.ok()) return st;
      }
      if (!enqueue_status_.ok()) return enqueue_status_;
      if (!s.broken.ok()) return s.broken;
    }
    const Clock::time_point deadline = Clock::now() + s.timeout;
    Backoff backoff;
    while (true) {
      cudaError_t err = cudaEventQuery(event_);
      if (err == cudaSuccess) break;
      {
        std::lock_guard<std::mutex> lock(s.mu);
        if (!s.broken.ok()) return s.broken;
        if (err != cudaErrorNotReady) {
          absl::Status st =
              absl::UnavailableError(CudaError(err, s.Where(op_) + ": cudaEventQuery").message());
          s.AbortLocked(st);
          return st;
        }
        ncclResult_t async = ncclSuccess;
        ncclResult_t res = ncclCommGetAsyncError(s.comm, &async);
        if (res != ncclSuccess) async = res;
        if (async != ncclSuccess && async != ncclInProgress) {
          absl::Status st = absl::UnavailableError(
              NcclError(async, s.Where(op_) + ": asynchronous error").message());
          s.AbortLocked(st);
          return st;
        }
        if (Clock::now() > deadline) {
          absl::Status st = absl::DeadlineExceededError(
              absl::StrCat(s.Where(op_), ": not complete after ", s.timeout.count(),
                           " ms (a peer died or did not issue the matching operation); "
                           "communicator aborted"));
          s.AbortLocked(st);
          return st;
        }
      }
      backoff.Pause();  // Unlocked.
    }
    std::lock_guard<std::mutex> lock(s.mu);
    // An abort (by another op) may have let the kernel finish early with garbage.
    return s.broken;
  }

  std::shared_ptr<NcclState> state_;
  const char* op_;
  // Guarded by state_->mu.
  cudaEvent_t event_ = nullptr;
  bool recorded_ = false;
  absl::Status enqueue_status_;
  // Guarded by wait_mu_.
  std::mutex wait_mu_;
  bool done_ = false;
  absl::Status result_;
};

NcclState::~NcclState() {
  if (comm != nullptr) {
    cudaSetDevice(device);
    bool destroyed = false;
    ncclResult_t res = ncclCommFinalize(comm);
    if (res == ncclSuccess || res == ncclInProgress) {
      // Finalize flushes; bound the wait so a dead peer cannot hang the destructor.
      const Clock::time_point deadline = Clock::now() + timeout;
      Backoff backoff;
      ncclResult_t async = ncclInProgress;
      while (Clock::now() < deadline) {
        if (ncclCommGetAsyncError(comm, &async) != ncclSuccess) break;
        if (async != ncclInProgress) break;
        backoff.Pause();
      }
      if (async == ncclSuccess) destroyed = ncclCommDestroy(comm) == ncclSuccess;
    }
    if (!destroyed) ncclCommAbort(comm);
    comm = nullptr;
  }
  if (barrier_buf != nullptr) cudaFree(barrier_buf);
  if (own_stream && stream != nullptr) cudaStreamDestroy(stream);
}

void NcclState::AbortLocked(absl::Status status) {
  if (!broken.ok()) return;
  broken = std::move(status);
  if (comm != nullptr) {
    cudaSetDevice(device);
    ncclCommAbort(comm);
    comm = nullptr;
  }
  for (PendingP2p& p : pending) p.work->FailLocked(broken);
  pending.clear();
}

absl::Status NcclState::WaitReadyLocked(ncclResult_t res, const char* op) {
  const Clock::time_point deadline = Clock::now() + timeout;
  Backoff backoff;
  while (res == ncclInProgress) {
    if (Clock::now() > deadline) {
      absl::Status st = absl::DeadlineExceededError(
          absl::StrCat(Where(op), ": NCCL call still in progress after ", timeout.count(),
                       " ms (a peer did not join); communicator aborted"));
      AbortLocked(st);
      return st;
    }
    backoff.Pause();
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm, &async);
    res = r != ncclSuccess ? r : async;
  }
  if (res != ncclSuccess) {
    absl::Status st = NcclError(res, Where(op));
    if (res != ncclInvalidArgument && res != ncclInvalidUsage) {
      st = absl::UnavailableError(st.message());
      AbortLocked(st);
    }
    return st;
  }
  return absl::OkStatus();
}

absl::Status NcclState::FlushLocked() {
  if (pending.empty()) return absl::OkStatus();
  if (!broken.ok()) return broken;
  std::vector<PendingP2p> batch;
  batch.swap(pending);
  cudaSetDevice(device);
  ncclResult_t res = ncclGroupStart();
  for (const PendingP2p& p : batch) {
    if (res != ncclSuccess) break;
    res = p.is_send ? ncclSend(p.buf, p.count, ncclFloat32, p.peer, comm, stream)
                    : ncclRecv(p.buf, p.count, ncclFloat32, p.peer, comm, stream);
  }
  ncclResult_t end = ncclGroupEnd();
  if (res == ncclSuccess || res == ncclInProgress) res = end;
  absl::Status st = WaitReadyLocked(res, batch.size() == 1 && batch[0].is_send ? "send"
                                         : batch.size() == 1                   ? "recv"
                                                                               : "send/recv");
  for (const PendingP2p& p : batch) {
    absl::Status one = st.ok() ? p.work->RecordLocked() : st;
    if (!one.ok()) p.work->FailLocked(one);
  }
  return st;
}

class NcclCommunicator : public Communicator {
 public:
  explicit NcclCommunicator(std::shared_ptr<NcclState> state) : state_(std::move(state)) {}
  ~NcclCommunicator() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->FlushLocked().IgnoreError();
  }

  int rank() const override { return state_->rank; }
  int size() const override { return state_->size; }
  const char* backend() const override { return "nccl"; }

  std::shared_ptr<Work> IBroadcast(float* buf, int64_t count, int root) override {
    const int d = state_->size;
    return Issue(
        "broadcast", count, root,
        [&](ncclComm_t c, cudaStream_t s) {
          return ncclBroadcast(buf, buf, count, ncclFloat32, root, c, s);
        },
        [&](NcclState& st) {
          // Ring pipeline from root: root..root-1; the last rank does not send.
          const int64_t n = count * 4;
          const int pos = (st.rank - root + d) % d;
          st.Count(OpKind::kBroadcast, pos != d - 1 ? n : 0, pos != 0 ? n : 0);
        });
  }

  std::shared_ptr<Work> IReduce(const float* send, float* recv, int64_t count, int root) override {
    const int d = state_->size;
    if (state_->rank == root && recv == nullptr && count > 0) {
      return Failed(absl::InvalidArgumentError(
          absl::StrCat(state_->Where("reduce"), ": recv is null on the root")));
    }
    // Off the root NCCL never writes recvbuff (ring reduce); pass send rather than null.
    float* out = recv != nullptr ? recv : const_cast<float*>(send);
    return Issue(
        "reduce", count, root,
        [&](ncclComm_t c, cudaStream_t s) {
          return ncclReduce(send, out, count, ncclFloat32, ncclSum, root, c, s);
        },
        [&](NcclState& st) {
          // Ring pipeline ending at root: root+1..root; the first does not receive, root does
          // not send.
          const int64_t n = count * 4;
          const int pos = (st.rank - root - 1 + 2 * d) % d;
          st.Count(OpKind::kReduce, pos != d - 1 ? n : 0, pos != 0 ? n : 0);
        });
  }

  std::shared_ptr<Work> IAllGather(const float* send, float* recv, int64_t count) override {
    return Issue(
        "all-gather", count, 0,
        [&](ncclComm_t c, cudaStream_t s) {
          return ncclAllGather(send, recv, count, ncclFloat32, c, s);
        },
        [&](NcclState& st) {
          const int64_t n = (st.size - 1) * count * 4;
          st.Count(OpKind::kAllGather, n, n);
        });
  }

  std::shared_ptr<Work> IReduceScatter(const float* send, float* recv, int64_t count) override {
    return Issue(
        "reduce-scatter", count, 0,
        [&](ncclComm_t c, cudaStream_t s) {
          return ncclReduceScatter(send, recv, count, ncclFloat32, ncclSum, c, s);
        },
        [&](NcclState& st) {
          const int64_t n = (st.size - 1) * count * 4;
          st.Count(OpKind::kReduceScatter, n, n);
        });
  }

  std::shared_ptr<Work> IAllReduce(float* buf, int64_t count) override {
    return Issue(
        "all-reduce", count, 0,
        [&](ncclComm_t c, cudaStream_t s) {
          return ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, c, s);
        },
        [&](NcclState& st) {
          const int64_t n = 2 * (st.size - 1) * count * 4 / st.size;
          st.Count(OpKind::kAllReduce, n, n);
        });
  }

  std::shared_ptr<Work> ISend(const float* buf, int64_t count, int peer, int tag) override {
    return IP2p(true, const_cast<float*>(buf), count, peer, tag);
  }
  std::shared_ptr<Work> IRecv(float* buf, int64_t count, int peer, int tag) override {
    return IP2p(false, buf, count, peer, tag);
  }

  // An all-reduce of one (zero) float; waiting for its event synchronises the host with the
  // stream up to it, which is what a stream synchronisation would add.
  absl::Status Barrier() override {
    float* one = state_->barrier_buf;
    return Issue(
               "barrier", 1, 0,
               [&](ncclComm_t c, cudaStream_t s) {
                 return ncclAllReduce(one, one, 1, ncclFloat32, ncclSum, c, s);
               },
               [&](NcclState& st) {
                 const int64_t n = 2 * (st.size - 1) * 4 / st.size;
                 st.Count(OpKind::kBarrier, n, n);
               })
        ->Wait();
  }

  OpCounters counters() const override {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->counters;
  }
  void ResetCounters() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->counters = OpCounters();
  }

 private:
  std::shared_ptr<Work> Failed(absl::Status status) {
    return std::make_shared<NcclWork>(std::move(status));
  }

  // Validates, flushes held point-to-point work, enqueues `call`, records the event and counts.
  template <typename Call, typename Counter>
  std::shared_ptr<Work> Issue(const char* op, int64_t count, int root, Call call, Counter counter) {
    NcclState& s = *state_;
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.broken.ok()) return Failed(s.broken);
    if (count < 0) {
      return Failed(absl::InvalidArgumentError(absl::StrCat(s.Where(op), ": count ", count)));
    }
    if (root < 0 || root >= s.size) {
      return Failed(
          absl::InvalidArgumentError(absl::StrCat(s.Where(op), ": root ", root, " out of range")));
    }
    absl::Status st = s.FlushLocked();
    if (!st.ok()) return Failed(st);
    cudaError_t err = cudaSetDevice(s.device);
    if (err != cudaSuccess) return Failed(CudaError(err, s.Where(op) + ": cudaSetDevice"));
    st = s.WaitReadyLocked(call(s.comm, s.stream), op);
    if (!st.ok()) return Failed(st);
    auto work = std::make_shared<NcclWork>(state_, op);
    st = work->RecordLocked();
    if (!st.ok()) return Failed(st);
    counter(s);
    return work;
  }

  std::shared_ptr<Work> IP2p(bool is_send, float* buf, int64_t count, int peer, int tag) {
    const char* op = is_send ? "send" : "recv";
    NcclState& s = *state_;
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.broken.ok()) return Failed(s.broken);
    if (count < 0 || peer < 0 || peer >= s.size || tag < 0 || tag >= kMaxTag) {
      return Failed(absl::InvalidArgumentError(absl::StrCat(
          s.Where(op), ": bad arguments (count ", count, ", peer ", peer, ", tag ", tag, ")")));
    }
    auto work = std::make_shared<NcclWork>(state_, op);
    s.pending.push_back(PendingP2p{is_send, buf, count, peer, work});
    const int64_t n = count * 4;
    s.Count(is_send ? OpKind::kSend : OpKind::kRecv, is_send ? n : 0, is_send ? 0 : n);
    return work;
  }

  std::shared_ptr<NcclState> state_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> NewNcclCommunicator(
    Communicator* bootstrap, int device, void* stream, std::chrono::milliseconds timeout) {
  if (bootstrap == nullptr) return absl::InvalidArgumentError("NCCL: bootstrap is null");
  auto state = std::make_shared<NcclState>();
  state->rank = bootstrap->rank();
  state->size = bootstrap->size();
  state->device = device;
  state->timeout = timeout;
  const std::string where = state->Where("init");

  // Rank 0 makes the id; a failure there is still broadcast (as zeros plus a flag) so the
  // other ranks do not wait for an id that never comes.
  float buf[33] = {};
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  absl::Status local;
  if (state->rank == 0) {
    ncclResult_t res = ncclGetUniqueId(&id);
    if (res != ncclSuccess) {
      local = NcclError(res, where + ": ncclGetUniqueId");
      buf[32] = 1.0f;
    } else {
      std::memcpy(buf, &id, sizeof(id));
    }
  }
  absl::Status st = bootstrap->Broadcast(buf, 33, 0);
  if (!st.ok()) {
    return absl::Status(st.code(),
                        absl::StrCat(where, ": broadcasting the ncclUniqueId: ", st.message()));
  }
  if (!local.ok()) return local;
  if (buf[32] != 0.0f) return absl::UnavailableError(where + ": rank 0 failed to make an id");
  std::memcpy(&id, buf, sizeof(id));

  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return CudaError(err, where + ": cudaSetDevice");
  if (stream != nullptr) {
    state->stream = static_cast<cudaStream_t>(stream);
  } else {
    err = cudaStreamCreateWithFlags(&state->stream, cudaStreamNonBlocking);
    if (err != cudaSuccess) return CudaError(err, where + ": cudaStreamCreate");
    state->own_stream = true;
  }
  err = cudaMalloc(reinterpret_cast<void**>(&state->barrier_buf), sizeof(float));
  if (err != cudaSuccess) return CudaError(err, where + ": cudaMalloc");
  err = cudaMemset(state->barrier_buf, 0, sizeof(float));
  if (err != cudaSuccess) return CudaError(err, where + ": cudaMemset");
  err = cudaDeviceSynchronize();
  if (err != cudaSuccess) return CudaError(err, where + ": cudaDeviceSynchronize");

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t res = ncclCommInitRankConfig(&state->comm, state->size, id, state->rank, &config);
  if (res != ncclSuccess && res != ncclInProgress) {
    if (state->comm != nullptr) ncclCommAbort(state->comm);
    state->comm = nullptr;
    return NcclError(res, where + ": ncclCommInitRankConfig");
  }
  {
    std::lock_guard<std::mutex> lock(state->mu);
    st = state->WaitReadyLocked(res, "init");
  }
  if (!st.ok()) return st;
  return std::unique_ptr<Communicator>(new NcclCommunicator(std::move(state)));
}

bool NcclDeviceAvailable(int needed_devices, std::string* why) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why != nullptr) {
      *why = absl::StrCat("no usable CUDA driver/device: ", cudaGetErrorString(err));
    }
    return false;
  }
  if (count < needed_devices) {
    if (why != nullptr) {
      *why = absl::StrCat(count, " CUDA device(s) visible, ", needed_devices, " needed");
    }
    return false;
  }
  return true;
}

}  // namespace parallel
}  // namespace stallfree
