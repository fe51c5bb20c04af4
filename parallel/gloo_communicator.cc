// Gloo backend: rendezvous through a file or TCP store, then every collective implemented here
// on Gloo's unbound-buffer point-to-point (ring / pipelined chain / dissemination), so the byte
// counters are exactly what this rank put on and took off the wire.
//
// Algorithms (D ranks, N elements, 4-byte floats):
// - broadcast: pipelined chain from the root (rel = (rank - root) mod D), 1 MiB chunks; every
//   rank but the last sends 4N, every rank but the root receives 4N.
// - reduce: the same chain reversed (the last rank starts, the root ends); every rank but the
//   root sends 4N, every rank but the last receives 4N.
// - all-gather: ring; sends and receives (D-1) * 4 * count.
// - reduce-scatter: ring; sends and receives (D-1) * 4 * count.
// - all-reduce: ring reduce-scatter + ring all-gather over D blocks (block b has N/D elements,
//   +1 for b < N mod D); sends 4 * (2N - |B_r| - |B_{r+1}|), receives 4 * (2N - |B_{r-1}| -
//   |B_r|).
// - barrier: dissemination, ceil(log2 D) rounds of a 1-byte token each way.
// - send/recv: 4 * count.
//
// Slots: collectives use bit 62 | (collective sequence << 16) | step; point-to-point uses
// (per-(peer, tag) sequence << 20) | tag, so they never collide.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"
#include "parallel/communicator.h"
#include "parallel/tcp_store.h"

namespace stallfree {
namespace parallel {
namespace {

using Buffer = std::unique_ptr<gloo::transport::UnboundBuffer>;
constexpr size_t kMinChainChunkBytes = 1 << 20;
constexpr size_t kMaxSteps = 1 << 16;  // the step field of a collective slot

// Chunk of the broadcast / reduce pipelines: 1 MiB, larger when that would need > 2^15 chunks.
size_t ChainChunkBytes(size_t bytes) {
  size_t chunk = std::max(kMinChainChunkBytes, bytes / (kMaxSteps / 2) + 1);
  return (chunk + sizeof(float) - 1) / sizeof(float) * sizeof(float);
}

// An error inside an operation, already converted to a status naming the op and the peer.
struct OpError : std::exception {
  explicit OpError(absl::Status s) : status(std::move(s)) {}
  const char* what() const noexcept override { return "OpError"; }
  absl::Status status;
};

class GlooWork : public Work {
 public:
  absl::Status Wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
    if (finisher_) {
      auto f = std::move(finisher_);
      finisher_ = nullptr;
      status_ = f();
    }
    return status_;
  }
  ~GlooWork() override {
    // A posted point-to-point op must complete before its buffer wrapper goes away.
    std::unique_lock<std::mutex> lock(mu_);
    if (done_ && finisher_) finisher_().IgnoreError();
  }
  void Finish(absl::Status status, std::function<absl::Status()> finisher = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = std::move(status);
    finisher_ = std::move(finisher);
    done_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  absl::Status status_;
  std::function<absl::Status()> finisher_;
};

std::shared_ptr<Work> DoneWork(absl::Status status) {
  auto w = std::make_shared<GlooWork>();
  w->Finish(std::move(status));
  return w;
}

struct Blocks {
  // Block b of an N-element buffer split into D parts, the first N mod D one larger.
  Blocks(int64_t n, int d) : n(n), d(d) {}
  int64_t size(int b) const { return n / d + (b < n % d ? 1 : 0); }
  int64_t offset(int b) const { return b * (n / d) + std::min<int64_t>(b, n % d); }
  int64_t n;
  int d;
};

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(const CommOptions& options, std::shared_ptr<gloo::rendezvous::Store> store,
                   std::unique_ptr<gloo::rendezvous::Store> prefix,
                   std::shared_ptr<gloo::transport::Device> device,
                   std::shared_ptr<gloo::rendezvous::Context> context)
      : options_(options),
        store_(std::move(store)),
        prefix_(std::move(prefix)),
        device_(std::move(device)),
        context_(std::move(context)) {
    worker_ = std::thread([this] { WorkerLoop(); });
  }

  ~GlooCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      stopping_ = true;
      queue_cv_.notify_all();
    }
    worker_.join();
    context_.reset();
  }

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  const char* backend() const override { return "gloo"; }

  std::shared_ptr<Work> IBroadcast(float* buf, int64_t count, int root) override {
    if (absl::Status s = CheckArgs(OpKind::kBroadcast, count, root); !s.ok()) return DoneWork(s);
    return Enqueue(OpKind::kBroadcast, [=] { RunBroadcast(buf, count, root); });
  }
  std::shared_ptr<Work> IReduce(const float* send, float* recv, int64_t count,
                                int root) override {
    if (absl::Status s = CheckArgs(OpKind::kReduce, count, root); !s.ok()) return DoneWork(s);
    return Enqueue(OpKind::kReduce, [=] { RunReduce(send, recv, count, root); });
  }
  std::shared_ptr<Work> IAllGather(const float* send, float* recv, int64_t count) override {
    if (absl::Status s = CheckArgs(OpKind::kAllGather, count, 0); !s.ok()) return DoneWork(s);
    return Enqueue(OpKind::kAllGather, [=] { RunAllGather(send, recv, count); });
  }
  std::shared_ptr<Work> IReduceScatter(const float* send, float* recv, int64_t count) override {
    if (absl::Status s = CheckArgs(OpKind::kReduceScatter, count, 0); !s.ok()) {
      return DoneWork(s);
    }
    return Enqueue(OpKind::kReduceScatter, [=] { RunReduceScatter(send, recv, count); });
  }
  std::shared_ptr<Work> IAllReduce(float* buf, int64_t count) override {
    if (absl::Status s = CheckArgs(OpKind::kAllReduce, count, 0); !s.ok()) return DoneWork(s);
    return Enqueue(OpKind::kAllReduce, [=] { RunAllReduce(buf, count); });
  }
  std::shared_ptr<Work> ISend(const float* buf, int64_t count, int peer, int tag) override {
    return PointToPoint(OpKind::kSend, const_cast<float*>(buf), count, peer, tag);
  }
  std::shared_ptr<Work> IRecv(float* buf, int64_t count, int peer, int tag) override {
    return PointToPoint(OpKind::kRecv, buf, count, peer, tag);
  }
  absl::Status Barrier() override {
    return Enqueue(OpKind::kBarrier, [=] { RunBarrier(); })->Wait();
  }

  OpCounters counters() const override {
    std::lock_guard<std::mutex> lock(counter_mu_);
    return counters_;
  }
  void ResetCounters() override {
    std::lock_guard<std::mutex> lock(counter_mu_);
    counters_ = OpCounters();
  }

 private:
  struct Op {
    OpKind kind;
    std::function<void()> run;  // throws OpError / gloo exceptions
    std::shared_ptr<GlooWork> work;
    // Point-to-point: posts and returns the finisher instead.
    std::function<std::function<absl::Status()>()> post;
  };

  absl::Status CheckArgs(OpKind kind, int64_t count, int root) const {
    if (count < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(OpKindName(kind), ": negative count ", count));
    }
    if (root < 0 || root >= size()) {
      return absl::InvalidArgumentError(absl::StrCat(OpKindName(kind), ": root ", root,
                                                     " outside [0, ", size(), ")"));
    }
    return absl::OkStatus();
  }

  absl::Status BrokenStatus() {
    std::lock_guard<std::mutex> lock(broken_mu_);
    return broken_;
  }
  void Break(const absl::Status& s) {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (broken_.ok()) broken_ = s;
  }

  void Count(OpKind kind, int64_t sent, int64_t received) {
    std::lock_guard<std::mutex> lock(counter_mu_);
    OpCounter& c = counters_[static_cast<size_t>(kind)];
    c.bytes_sent += sent;
    c.bytes_received += received;
  }
  void CountCall(OpKind kind) {
    std::lock_guard<std::mutex> lock(counter_mu_);
    counters_[static_cast<size_t>(kind)].calls += 1;
  }

  std::shared_ptr<Work> Enqueue(OpKind kind, std::function<void()> run,
                                std::function<std::function<absl::Status()>()> post = nullptr) {
    CountCall(kind);
    if (absl::Status s = BrokenStatus(); !s.ok()) {
      return DoneWork(absl::Status(
          s.code(), absl::StrCat(OpKindName(kind), " on broken communicator (rank ", rank(),
                                 "): earlier error: ", s.message())));
    }
    auto work = std::make_shared<GlooWork>();
    std::lock_guard<std::mutex> lock(queue_mu_);
    queue_.push_back(Op{kind, std::move(run), work, std::move(post)});
    queue_cv_.notify_all();
    return work;
  }

  // Converts whatever an op threw into a status naming the op and the peer.
  absl::Status ToStatus(OpKind kind, int peer, const std::string& what) {
    bool timeout = absl::StrContains(what, "imed out") || absl::StrContains(what, "imeout");
    std::string msg = absl::StrCat("gloo ", OpKindName(kind), " failed on rank ", rank(), "/",
                                   size(), " with peer rank ", peer, ": ", what);
    return timeout ? absl::DeadlineExceededError(msg) : absl::UnavailableError(msg);
  }

  void WorkerLoop() {
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(queue_mu_);
        queue_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      if (absl::Status s = BrokenStatus(); !s.ok()) {
        op.work->Finish(absl::Status(
            s.code(), absl::StrCat(OpKindName(op.kind), " on broken communicator (rank ", rank(),
                                   "): earlier error: ", s.message())));
        continue;
      }
      current_peer_ = -1;
      absl::Status status;
      std::function<absl::Status()> finisher;
      try {
        if (op.post) {
          finisher = op.post();
        } else {
          op.run();
        }
      } catch (const OpError& e) {
        status = e.status;
      } catch (const gloo::IoException& e) {
        status = ToStatus(op.kind, current_peer_, e.what());
      } catch (const gloo::EnforceNotMet& e) {
        status = ToStatus(op.kind, current_peer_, e.what());
      } catch (const std::exception& e) {
        status = ToStatus(op.kind, current_peer_, e.what());
      }
      if (!status.ok()) {
        SF_LOG(kError, "%s", std::string(status.message()));
        Break(status);
      }
      op.work->Finish(status, std::move(finisher));
    }
  }

  // ---- transport helpers (worker thread) ----
  Buffer Wrap(const void* ptr, size_t bytes) {
    return context_->createUnboundBuffer(const_cast<void*>(ptr), bytes);
  }
  uint64_t CollectiveSlot(int step) const {
    return (uint64_t{1} << 62) | ((collective_seq_ & ((uint64_t{1} << 46) - 1)) << 16) |
           static_cast<uint64_t>(step);
  }
  void WaitSend(OpKind kind, gloo::transport::UnboundBuffer* b, int peer, size_t bytes) {
    current_peer_ = peer;
    if (!b->waitSend(options_.timeout)) {
      throw OpError(ToStatus(kind, peer, "send aborted"));
    }
    Count(kind, static_cast<int64_t>(bytes), 0);
  }
  void WaitRecv(OpKind kind, gloo::transport::UnboundBuffer* b, int peer, size_t bytes) {
    current_peer_ = peer;
    if (!b->waitRecv(options_.timeout)) {
      throw OpError(ToStatus(kind, peer, "recv aborted"));
    }
    Count(kind, 0, static_cast<int64_t>(bytes));
  }
  // One ring step: send [send_off, +send_bytes) of `sb` to the right, receive
  // [recv_off, +recv_bytes) of `rb` from the left. Zero-sized parts are skipped on both ends.
  void RingStep(OpKind kind, int step, gloo::transport::UnboundBuffer* sb, size_t send_off,
                size_t send_bytes, gloo::transport::UnboundBuffer* rb, size_t recv_off,
                size_t recv_bytes) {
    int right = (rank() + 1) % size();
    int left = (rank() - 1 + size()) % size();
    uint64_t slot = CollectiveSlot(step);
    current_peer_ = left;
    if (recv_bytes > 0) rb->recv(left, slot, recv_off, recv_bytes);
    current_peer_ = right;
    if (send_bytes > 0) sb->send(right, slot, send_off, send_bytes);
    if (send_bytes > 0) WaitSend(kind, sb, right, send_bytes);
    if (recv_bytes > 0) WaitRecv(kind, rb, left, recv_bytes);
  }

  // ---- collectives (worker thread) ----
  void RunBroadcast(float* buf, int64_t count, int root) {
    const int d = size();
    if (d == 1 || count == 0) return;
    ++collective_seq_;
    const int rel = (rank() - root + d) % d;
    const int prev = (rank() - 1 + d) % d;
    const int next = (rank() + 1) % d;
    const size_t bytes = static_cast<size_t>(count) * sizeof(float);
    const size_t chunk = ChainChunkBytes(bytes);
    Buffer sb = Wrap(buf, bytes), rb = Wrap(buf, bytes);
    bool send_pending = false;
    size_t pending_bytes = 0;
    int step = 0;
    for (size_t off = 0; off < bytes; off += chunk, ++step) {
      size_t n = std::min(chunk, bytes - off);
      if (rel > 0) {
        current_peer_ = prev;
        rb->recv(prev, CollectiveSlot(step), off, n);
        WaitRecv(OpKind::kBroadcast, rb.get(), prev, n);
      }
      if (rel < d - 1) {
        if (send_pending) WaitSend(OpKind::kBroadcast, sb.get(), next, pending_bytes);
        current_peer_ = next;
        sb->send(next, CollectiveSlot(step), off, n);
        send_pending = true;
        pending_bytes = n;
      }
    }
    if (send_pending) WaitSend(OpKind::kBroadcast, sb.get(), next, pending_bytes);
  }

  void RunReduce(const float* send, float* recv, int64_t count, int root) {
    const int d = size();
    if (rank() == root && send != recv && count > 0) {
      std::memmove(recv, send, static_cast<size_t>(count) * sizeof(float));
    }
    if (d == 1 || count == 0) return;
    ++collective_seq_;
    // Chain: rel d-1 -> d-2 -> ... -> 0 (the root).
    const int rel = (rank() - root + d) % d;
    const int toward_root = (rank() - 1 + d) % d;  // rel - 1
    const int from_far = (rank() + 1) % d;          // rel + 1
    std::vector<float> copy;
    float* acc = recv;
    if (rank() != root) {
      copy.assign(send, send + count);
      acc = copy.data();
    }
    const size_t bytes = static_cast<size_t>(count) * sizeof(float);
    const size_t chunk_floats = ChainChunkBytes(bytes) / sizeof(float);
    std::vector<float> scratch;
    Buffer scratch_buf;
    if (rel < d - 1) {
      scratch.resize(std::min<size_t>(chunk_floats, static_cast<size_t>(count)));
      scratch_buf = Wrap(scratch.data(), scratch.size() * sizeof(float));
    }
    Buffer sb = Wrap(acc, bytes);
    bool send_pending = false;
    size_t pending_bytes = 0;
    int step = 0;
    for (size_t first = 0; first < static_cast<size_t>(count); first += chunk_floats, ++step) {
      size_t n = std::min(chunk_floats, static_cast<size_t>(count) - first);
      if (rel < d - 1) {
        current_peer_ = from_far;
        scratch_buf->recv(from_far, CollectiveSlot(step), 0, n * sizeof(float));
        WaitRecv(OpKind::kReduce, scratch_buf.get(), from_far, n * sizeof(float));
        for (size_t i = 0; i < n; ++i) acc[first + i] += scratch[i];
      }
      if (rel > 0) {
        if (send_pending) WaitSend(OpKind::kReduce, sb.get(), toward_root, pending_bytes);
        current_peer_ = toward_root;
        sb->send(toward_root, CollectiveSlot(step), first * sizeof(float), n * sizeof(float));
        send_pending = true;
        pending_bytes = n * sizeof(float);
      }
    }
    if (send_pending) WaitSend(OpKind::kReduce, sb.get(), toward_root, pending_bytes);
  }

  // Ring all-gather of blocks already placed in buf (block `rank` filled), block layout `blk`.
  void RingAllGather(OpKind kind, float* buf, const Blocks& blk, int first_step) {
    const int d = size(), r = rank();
    Buffer sb = Wrap(buf, static_cast<size_t>(blk.n) * sizeof(float));
    Buffer rb = Wrap(buf, static_cast<size_t>(blk.n) * sizeof(float));
    for (int s = 0; s < d - 1; ++s) {
      int bs = ((r - s) % d + d) % d;
      int br = ((r - s - 1) % d + d) % d;
      RingStep(kind, first_step + s, sb.get(), blk.offset(bs) * sizeof(float),
               blk.size(bs) * sizeof(float), rb.get(), blk.offset(br) * sizeof(float),
               blk.size(br) * sizeof(float));
    }
  }

  // Ring reduce-scatter in place: afterwards block `rank` of buf holds the sum.
  void RingReduceScatter(OpKind kind, float* buf, const Blocks& blk) {
    const int d = size(), r = rank();
    int64_t max_block = blk.size(0);
    std::vector<float> tmp(static_cast<size_t>(std::max<int64_t>(max_block, 1)));
    Buffer sb = Wrap(buf, static_cast<size_t>(blk.n) * sizeof(float));
    Buffer rb = Wrap(tmp.data(), tmp.size() * sizeof(float));
    for (int s = 0; s < d - 1; ++s) {
      int bs = ((r - s - 1) % d + d) % d;
      int br = ((r - s - 2) % d + d) % d;
      RingStep(kind, s, sb.get(), blk.offset(bs) * sizeof(float), blk.size(bs) * sizeof(float),
               rb.get(), 0, blk.size(br) * sizeof(float));
      float* dst = buf + blk.offset(br);
      for (int64_t i = 0; i < blk.size(br); ++i) dst[i] += tmp[i];
    }
  }

  void RunAllGather(const float* send, float* recv, int64_t count) {
    const int d = size();
    if (count > 0 && recv + rank() * count != send) {
      std::memmove(recv + rank() * count, send, static_cast<size_t>(count) * sizeof(float));
    }
    if (d == 1 || count == 0) return;
    ++collective_seq_;
    RingAllGather(OpKind::kAllGather, recv, Blocks(count * d, d), 0);
  }

  void RunReduceScatter(const float* send, float* recv, int64_t count) {
    const int d = size();
    if (count == 0) return;
    if (d == 1) {
      if (send != recv) std::memmove(recv, send, static_cast<size_t>(count) * sizeof(float));
      return;
    }
    ++collective_seq_;
    std::vector<float> work(send, send + count * d);
    RingReduceScatter(OpKind::kReduceScatter, work.data(), Blocks(count * d, d));
    std::memcpy(recv, work.data() + rank() * count, static_cast<size_t>(count) * sizeof(float));
  }

  void RunAllReduce(float* buf, int64_t count) {
    const int d = size();
    if (d == 1 || count == 0) return;
    ++collective_seq_;
    Blocks blk(count, d);
    RingReduceScatter(OpKind::kAllReduce, buf, blk);
    RingAllGather(OpKind::kAllReduce, buf, blk, d);
  }

  void RunBarrier() {
    const int d = size();
    if (d == 1) return;
    ++collective_seq_;
    char out = 1, in = 0;
    Buffer sb = Wrap(&out, 1), rb = Wrap(&in, 1);
    int step = 0;
    for (int k = 1; k < d; k *= 2, ++step) {
      int to = (rank() + k) % d;
      int from = (rank() - k + d) % d;
      uint64_t slot = CollectiveSlot(step);
      current_peer_ = from;
      rb->recv(from, slot, 0, 1);
      current_peer_ = to;
      sb->send(to, slot, 0, 1);
      WaitSend(OpKind::kBarrier, sb.get(), to, 1);
      WaitRecv(OpKind::kBarrier, rb.get(), from, 1);
    }
  }

  std::shared_ptr<Work> PointToPoint(OpKind kind, float* buf, int64_t count, int peer,
                                     int tag) {
    if (count < 0 || peer < 0 || peer >= size() || peer == rank() || tag < 0 ||
        tag >= (1 << 20)) {
      return DoneWork(absl::InvalidArgumentError(
          absl::StrCat(OpKindName(kind), " on rank ", rank(), ": bad arguments (count ", count,
                       ", peer ", peer, ", tag ", tag, "; size ", size(), ", tags < 2^20)")));
    }
    auto post = [this, kind, buf, count, peer, tag]() -> std::function<absl::Status()> {
      if (count == 0) return nullptr;
      auto& seqs = kind == OpKind::kSend ? send_seq_ : recv_seq_;
      uint64_t seq = seqs[{peer, tag}]++;
      uint64_t slot = ((seq & ((uint64_t{1} << 40) - 1)) << 20) | static_cast<uint64_t>(tag);
      size_t bytes = static_cast<size_t>(count) * sizeof(float);
      std::shared_ptr<gloo::transport::UnboundBuffer> b(Wrap(buf, bytes).release());
      current_peer_ = peer;
      if (kind == OpKind::kSend) {
        b->send(peer, slot, 0, bytes);
      } else {
        b->recv(peer, slot, 0, bytes);
      }
      return [this, b, kind, peer, bytes]() -> absl::Status {
        absl::Status status;
        try {
          bool ok = kind == OpKind::kSend ? b->waitSend(options_.timeout)
                                          : b->waitRecv(options_.timeout);
          if (ok) {
            Count(kind, kind == OpKind::kSend ? bytes : 0, kind == OpKind::kRecv ? bytes : 0);
          } else {
            status = ToStatus(kind, peer, "aborted");
          }
        } catch (const gloo::IoException& e) {
          status = ToStatus(kind, peer, e.what());
        } catch (const gloo::EnforceNotMet& e) {
          status = ToStatus(kind, peer, e.what());
        } catch (const std::exception& e) {
          status = ToStatus(kind, peer, e.what());
        }
        if (!status.ok()) {
          SF_LOG(kError, "%s", std::string(status.message()));
          Break(status);
        }
        return status;
      };
    };
    return Enqueue(kind, nullptr, post);
  }

  const CommOptions options_;
  std::shared_ptr<gloo::rendezvous::Store> store_;  // shared by the groups of NewGlooGroups
  std::unique_ptr<gloo::rendezvous::Store> prefix_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;

  std::thread worker_;
  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<Op> queue_;
  bool stopping_ = false;

  // Worker-thread state.
  uint64_t collective_seq_ = 0;
  int current_peer_ = -1;
  std::map<std::pair<int, int>, uint64_t> send_seq_, recv_seq_;

  mutable std::mutex counter_mu_;
  OpCounters counters_{};
  std::mutex broken_mu_;
  absl::Status broken_;
};

}  // namespace

namespace {

bool IsTimeout(const std::string& what) {
  return absl::StrContains(what, "imed out") || absl::StrContains(what, "imeout");
}

std::string StoreWhere(const CommOptions& options) {
  return options.store_dir.empty()
             ? absl::StrCat("TCP store ", options.master_addr, ":", options.master_port)
             : absl::StrCat("file store ", options.store_dir);
}

// The world's rendezvous store: the TCP store (served by world rank 0) or the file store.
absl::StatusOr<std::shared_ptr<gloo::rendezvous::Store>> OpenStore(const CommOptions& options) {
  try {
    if (options.store_dir.empty()) {
      ASSIGN_OR_RETURN(std::unique_ptr<TcpStore> tcp,
                       TcpStore::Create(options.master_addr, options.master_port,
                                        options.rank == 0, options.timeout));
      return std::shared_ptr<gloo::rendezvous::Store>(std::move(tcp));
    }
    return std::shared_ptr<gloo::rendezvous::Store>(
        std::make_shared<gloo::rendezvous::FileStore>(options.store_dir));
  } catch (const std::exception& e) {
    const std::string msg = absl::StrCat("gloo rendezvous failed on rank ", options.rank, "/",
                                         options.size, ": cannot open the ", StoreWhere(options),
                                         ": ", e.what());
    SF_LOG(kError, "%s", msg);
    return IsTimeout(e.what()) ? absl::DeadlineExceededError(msg) : absl::UnavailableError(msg);
  }
}

// One group's communicator: options.rank / options.size in the group, its keys under
// options.group in `store` (unused for a group of one).
absl::StatusOr<std::unique_ptr<Communicator>> ConnectGroup(
    const CommOptions& options, const std::string& where,
    std::shared_ptr<gloo::rendezvous::Store> store,
    std::shared_ptr<gloo::transport::Device>* device) {
  std::unique_ptr<gloo::rendezvous::Store> prefix;
  std::shared_ptr<gloo::rendezvous::Context> context;
  if (options.size > 1) {
    try {
      prefix = std::make_unique<gloo::rendezvous::PrefixStore>(options.group, *store);
      if (*device == nullptr) {
        gloo::transport::tcp::attr attr;
        attr.hostname = options.transport_addr;
        *device = gloo::transport::tcp::CreateDevice(attr);
      }
      context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.size);
      context->setTimeout(options.timeout);
      context->connectFullMesh(*prefix, *device);
    } catch (const std::exception& e) {
      std::string what = e.what();
      std::string msg = absl::StrCat("gloo rendezvous failed on rank ", options.rank, "/",
                                     options.size, " via ", where, " (group '", options.group,
                                     "', transport ", options.transport_addr, "): ", what);
      SF_LOG(kError, "%s", msg);
      return IsTimeout(what) ? absl::DeadlineExceededError(msg) : absl::UnavailableError(msg);
    }
  }
  // Every communicator keeps the store: world rank 0's serves the TCP store, which the groups
  // without rank 0 may still be connecting through.
  return std::unique_ptr<Communicator>(new GlooCommunicator(
      options, std::move(store), std::move(prefix), *device, std::move(context)));
}

absl::Status CheckOptions(const CommOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(absl::StrCat("gloo: bad rank ", options.rank, " / size ",
                                                   options.size));
  }
  if (options.timeout.count() <= 0) {
    return absl::InvalidArgumentError("gloo: timeout must be positive");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> NewGlooCommunicator(const CommOptions& options) {
  RETURN_IF_ERROR(CheckOptions(options));
  std::shared_ptr<gloo::rendezvous::Store> store;
  if (options.size > 1) {
    ASSIGN_OR_RETURN(store, OpenStore(options));
  }
  std::shared_ptr<gloo::transport::Device> device;
  return ConnectGroup(options, StoreWhere(options), std::move(store), &device);
}

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> NewGlooGroups(
    const CommOptions& world, const std::vector<GroupMembership>& groups) {
  RETURN_IF_ERROR(CheckOptions(world));
  for (const GroupMembership& g : groups) {
    if (g.name.empty() || g.size < 1 || g.size > world.size || g.rank < 0 || g.rank >= g.size)
      return absl::InvalidArgumentError(absl::StrCat(
          "gloo groups: group '", g.name, "' has rank ", g.rank, " / size ", g.size,
          " (a non-empty name, 0 <= rank < size <= the world's ", world.size, ")"));
  }
  std::shared_ptr<gloo::rendezvous::Store> store;
  if (world.size > 1) {
    ASSIGN_OR_RETURN(store, OpenStore(world));
  }
  std::shared_ptr<gloo::transport::Device> device;  // one TCP device for every group
  std::vector<std::unique_ptr<Communicator>> out;
  for (const GroupMembership& g : groups) {
    CommOptions o = world;
    o.rank = g.rank;
    o.size = g.size;
    o.group = absl::StrCat(world.group, "/", g.name);
    ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c,
                     ConnectGroup(o, StoreWhere(world), store, &device));
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace parallel
}  // namespace stallfree
