// NCCL communicator test. Without RANK/WORLD_SIZE in the environment this is the parent: it
// prints "SKIP: ..." and exits 0 without a usable device, otherwise runs D = 1, 2, 4 (those the
// visible devices allow; D = the device count if that is 3) as D child processes of itself
// (RANK, WORLD_SIZE, LOCAL_RANK, a fresh STALLFREE_STORE_DIR), and fails if any child fails.
// A child bootstraps a Gloo communicator, creates the NCCL one on device LOCAL_RANK, runs every
// operation on known data (integers, so fp32 sums are exact) and checks results and counters,
// then checks that an operation a peer never issues ends in DEADLINE_EXCEEDED within a bounded
// time and leaves the communicator broken.
#include <cuda_runtime.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "parallel/communicator.h"
#include "parallel/nccl_communicator.h"
#include "tests/parallel/nccl_worker.h"

namespace stallfree {
namespace parallel {
namespace {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------------
// Child side.

class DeviceBuffer {
 public:
  explicit DeviceBuffer(int64_t count) : count_(count) {
    if (cudaMalloc(reinterpret_cast<void**>(&ptr_), std::max<int64_t>(count, 1) * 4) !=
        cudaSuccess) {
      ptr_ = nullptr;
    }
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  float* get() const { return ptr_; }
  bool ok() const { return ptr_ != nullptr; }
  // cudaMemcpy from pageable memory may return before the data reaches the device, and the
  // communicator's stream does not wait for the legacy stream: synchronise.
  bool Upload(const std::vector<float>& v) {
    return cudaMemcpy(ptr_, v.data(), v.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
           cudaDeviceSynchronize() == cudaSuccess;
  }
  std::vector<float> Download() const {
    std::vector<float> v(count_);
    if (cudaMemcpy(v.data(), ptr_, count_ * 4, cudaMemcpyDeviceToHost) != cudaSuccess) {
      v.assign(count_, -12345.0f);
    }
    return v;
  }

 private:
  int64_t count_;
  float* ptr_ = nullptr;
};

class Checker {
 public:
  Checker(int rank, int size) : rank_(rank), size_(size) {}
  bool Check(bool ok, const std::string& what) {
    std::printf("%s: [rank %d/%d] %s\n", ok ? "PASS" : "FAIL", rank_, size_, what.c_str());
    std::fflush(stdout);
    if (!ok) ++failures_;
    return ok;
  }
  bool CheckStatus(const absl::Status& st, const std::string& what) {
    return Check(st.ok(), st.ok() ? what : absl::StrCat(what, ": ", st.ToString()));
  }
  // Compares element-wise; reports the first mismatch.
  bool CheckData(const std::vector<float>& got, const std::vector<float>& want,
                 const std::string& what) {
    if (got.size() != want.size()) {
      return Check(false, absl::StrCat(what, ": size ", got.size(), " != ", want.size()));
    }
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i] != want[i]) {
        return Check(false,
                     absl::StrCat(what, ": element ", i, " is ", got[i], ", want ", want[i]));
      }
    }
    return Check(true, what);
  }
  int failures() const { return failures_; }

 private:
  int rank_;
  int size_;
  int failures_ = 0;
};

// A small integer pattern, exact in fp32 even when summed over 4 ranks.
float Pattern(int rank, int64_t i) { return static_cast<float>((rank * 131 + i) % 1024); }

void RunCollectives(Communicator& comm, int64_t n, Checker& c) {
  const int r = comm.rank();
  const int d = comm.size();
  const std::string tag = absl::StrCat(" (count ", n, ")");

  // Broadcast from every root.
  for (int root = 0; root < d; ++root) {
    DeviceBuffer buf(n);
    std::vector<float> in(n), want(n);
    for (int64_t i = 0; i < n; ++i) {
      in[i] = Pattern(r, i) + 5000;
      want[i] = Pattern(root, i) + 5000;
    }
    buf.Upload(in);
    c.CheckStatus(comm.Broadcast(buf.get(), n, root), absl::StrCat("broadcast root ", root, tag));
    c.CheckData(buf.Download(), want, absl::StrCat("broadcast root ", root, " data", tag));
  }

  // Reduce to every root, out of place (recv null off the root) and in place.
  for (int root = 0; root < d; ++root) {
    for (bool in_place : {false, true}) {
      DeviceBuffer send(n), recv(n);
      std::vector<float> in(n), want(n, 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        in[i] = Pattern(r, i);
        for (int k = 0; k < d; ++k) want[i] += Pattern(k, i);
      }
      send.Upload(in);
      float* out = in_place ? send.get() : (r == root ? recv.get() : nullptr);
      const std::string what = absl::StrCat("reduce root ", root, in_place ? " in place" : "", tag);
      c.CheckStatus(comm.Reduce(send.get(), out, n, root), what);
      if (r == root) {
        c.CheckData(in_place ? send.Download() : recv.Download(), want, what + " data");
      } else if (!in_place) {
        c.CheckData(send.Download(), in, what + " send untouched");
      }
    }
  }

  // All-gather.
  {
    DeviceBuffer send(n), recv(n * d);
    std::vector<float> in(n), want(n * d);
    for (int64_t i = 0; i < n; ++i) in[i] = Pattern(r, i);
    for (int k = 0; k < d; ++k) {
      for (int64_t i = 0; i < n; ++i) want[k * n + i] = Pattern(k, i);
    }
    send.Upload(in);
    c.CheckStatus(comm.AllGather(send.get(), recv.get(), n), "all-gather" + tag);
    c.CheckData(recv.Download(), want, "all-gather data" + tag);
  }

  // Reduce-scatter.
  {
    DeviceBuffer send(n * d), recv(n);
    std::vector<float> in(n * d), want(n, 0.0f);
    for (int64_t i = 0; i < n * d; ++i) in[i] = Pattern(r, i);
    for (int k = 0; k < d; ++k) {
      for (int64_t i = 0; i < n; ++i) want[i] += Pattern(k, r * n + i);
    }
    send.Upload(in);
    c.CheckStatus(comm.ReduceScatter(send.get(), recv.get(), n), "reduce-scatter" + tag);
    c.CheckData(recv.Download(), want, "reduce-scatter data" + tag);
  }

  // All-reduce: four in flight at once, waited in reverse order.
  {
    constexpr int kInFlight = 4;
    std::vector<std::unique_ptr<DeviceBuffer>> bufs;
    std::vector<std::shared_ptr<Work>> works;
    for (int j = 0; j < kInFlight; ++j) {
      bufs.push_back(std::make_unique<DeviceBuffer>(n));
      std::vector<float> in(n);
      for (int64_t i = 0; i < n; ++i) in[i] = Pattern(r + j, i);
      bufs.back()->Upload(in);
    }
    for (int j = 0; j < kInFlight; ++j) works.push_back(comm.IAllReduce(bufs[j]->get(), n));
    for (int j = kInFlight - 1; j >= 0; --j) {
      c.CheckStatus(works[j]->Wait(), absl::StrCat("all-reduce #", j, tag));
      c.CheckStatus(works[j]->Wait(), absl::StrCat("all-reduce #", j, " waited twice", tag));
    }
    for (int j = 0; j < kInFlight; ++j) {
      std::vector<float> want(n, 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        for (int k = 0; k < d; ++k) want[i] += Pattern(k + j, i);
      }
      c.CheckData(bufs[j]->Download(), want, absl::StrCat("all-reduce #", j, " data", tag));
    }
  }

  if (d < 2) return;

  // Ring exchange: two messages to the next rank, two from the previous one, all in flight
  // before any wait (the backend batches them into one group).
  {
    const int next = (r + 1) % d;
    const int prev = (r + d - 1) % d;
    DeviceBuffer s1(n), s2(n), r1(n), r2(n);
    std::vector<float> a(n), b(n), want_a(n), want_b(n);
    for (int64_t i = 0; i < n; ++i) {
      a[i] = Pattern(r, i);
      b[i] = Pattern(r, i) + 2000;
      want_a[i] = Pattern(prev, i);
      want_b[i] = Pattern(prev, i) + 2000;
    }
    s1.Upload(a);
    s2.Upload(b);
    std::vector<std::shared_ptr<Work>> w;
    w.push_back(comm.ISend(s1.get(), n, next, 1));
    w.push_back(comm.ISend(s2.get(), n, next, 2));
    w.push_back(comm.IRecv(r1.get(), n, prev, 1));
    w.push_back(comm.IRecv(r2.get(), n, prev, 2));
    absl::Status st;
    for (auto& work : w) st.Update(work->Wait());
    c.CheckStatus(st, "ring send/recv" + tag);
    c.CheckData(r1.Download(), want_a, "ring recv tag 1 data" + tag);
    c.CheckData(r2.Download(), want_b, "ring recv tag 2 data" + tag);
  }

  // Blocking pairs (0,1), (2,3): the lower rank sends first.
  {
    const int partner = r ^ 1;
    if (partner < d) {
      DeviceBuffer s(n), rv(n);
      std::vector<float> in(n), want(n);
      for (int64_t i = 0; i < n; ++i) {
        in[i] = Pattern(r, i) + 3000;
        want[i] = Pattern(partner, i) + 3000;
      }
      s.Upload(in);
      absl::Status st;
      if (r < partner) {
        st.Update(comm.Send(s.get(), n, partner, 9));
        st.Update(comm.Recv(rv.get(), n, partner, 9));
      } else {
        st.Update(comm.Recv(rv.get(), n, partner, 9));
        st.Update(comm.Send(s.get(), n, partner, 9));
      }
      c.CheckStatus(st, "pairwise send/recv" + tag);
      c.CheckData(rv.Download(), want, "pairwise send/recv data" + tag);
    }
  }
}

void CheckCounters(Communicator& comm, Checker& c) {
  const int64_t d = comm.size();
  const int64_t n = 1000;
  DeviceBuffer a(n * d), b(n * d);
  a.Upload(std::vector<float>(n * d, 1.0f));
  comm.ResetCounters();
  absl::Status st;
  st.Update(comm.AllReduce(a.get(), n));
  st.Update(comm.AllGather(a.get(), b.get(), n));
  st.Update(comm.ReduceScatter(a.get(), b.get(), n));
  st.Update(comm.Broadcast(a.get(), n, 0));
  st.Update(comm.Barrier());
  c.CheckStatus(st, "counter ops");
  const OpCounters k = comm.counters();
  auto at = [&](OpKind kind) { return k[static_cast<size_t>(kind)]; };
  const int64_t ar = 2 * (d - 1) * n * 4 / d;
  c.Check(
      at(OpKind::kAllReduce).calls == 1 && at(OpKind::kAllReduce).bytes_sent == ar &&
          at(OpKind::kAllReduce).bytes_received == ar,
      absl::StrCat("all-reduce counters: sent ", at(OpKind::kAllReduce).bytes_sent, ", want ", ar));
  const int64_t ag = (d - 1) * n * 4;
  c.Check(at(OpKind::kAllGather).bytes_sent == ag && at(OpKind::kAllGather).bytes_received == ag &&
              at(OpKind::kReduceScatter).bytes_sent == ag &&
              at(OpKind::kReduceScatter).bytes_received == ag,
          absl::StrCat("all-gather/reduce-scatter counters: ", at(OpKind::kAllGather).bytes_sent,
                       ", want ", ag));
  const int64_t bsent = comm.rank() == d - 1 ? 0 : n * 4;
  const int64_t brecv = comm.rank() == 0 ? 0 : n * 4;
  c.Check(
      at(OpKind::kBroadcast).bytes_sent == bsent && at(OpKind::kBroadcast).bytes_received == brecv,
      absl::StrCat("broadcast counters: sent ", at(OpKind::kBroadcast).bytes_sent, " recv ",
                   at(OpKind::kBroadcast).bytes_received));
  c.Check(at(OpKind::kBarrier).calls == 1, "barrier counted");
  comm.ResetCounters();
  c.Check(comm.counters()[static_cast<size_t>(OpKind::kAllReduce)].calls == 0, "counters reset");
}

void CheckBadArguments(Communicator& comm, Checker& c) {
  DeviceBuffer a(4);
  c.Check(comm.Broadcast(a.get(), 4, comm.size()).code() == absl::StatusCode::kInvalidArgument,
          "broadcast with root out of range is INVALID_ARGUMENT");
  c.Check(comm.AllReduce(a.get(), -1).code() == absl::StatusCode::kInvalidArgument,
          "negative count is INVALID_ARGUMENT");
  c.Check(comm.ISend(a.get(), 4, 0, 1 << 20)->Wait().code() == absl::StatusCode::kInvalidArgument,
          "tag 2^20 is INVALID_ARGUMENT");
}

// Rank 0 issues an all-reduce the others never issue: it must get DEADLINE_EXCEEDED naming the
// operation and rank within about the timeout, and the communicator must stay broken.
// The other ranks keep their communicator until rank 0 is done (a Gloo barrier), so what rank
// 0 sees is a peer that never issued the operation, not one whose memory went away.
void CheckTimeout(Communicator& bootstrap, int device, Checker& c) {
  const auto timeout = std::chrono::milliseconds(2000);
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      NewNcclCommunicator(&bootstrap, device, nullptr, timeout);
  if (!c.CheckStatus(comm.status(), "timeout communicator created")) return;
  DeviceBuffer a(256);
  a.Upload(std::vector<float>(256, 1.0f));
  // Warm up together so connections exist; then only rank 0 issues.
  c.CheckStatus((*comm)->AllReduce(a.get(), 256), "timeout communicator warm-up");
  if ((*comm)->rank() == 0) {
    const Clock::time_point start = Clock::now();
    absl::Status st = (*comm)->AllReduce(a.get(), 256);
    const double secs = std::chrono::duration<double>(Clock::now() - start).count();
    c.Check(st.code() == absl::StatusCode::kDeadlineExceeded &&
                std::string(st.message()).find("all-reduce on rank 0") != std::string::npos,
            absl::StrCat("unmatched all-reduce: ", st.ToString()));
    c.Check(secs < 10.0, absl::StrCat("timeout reported after ", secs, " s (limit 2 s)"));
    const Clock::time_point again = Clock::now();
    absl::Status st2 = (*comm)->AllReduce(a.get(), 256);
    const double secs2 = std::chrono::duration<double>(Clock::now() - again).count();
    c.Check(st2.code() == st.code() && secs2 < 0.5,
            absl::StrCat("broken communicator fails at once: ", st2.ToString()));
    c.Check(!(*comm)->Barrier().ok(), "barrier on a broken communicator fails");
  }
  c.CheckStatus(bootstrap.Barrier(), "gloo barrier after the timeout check");
  const Clock::time_point start = Clock::now();
  comm->reset();
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  c.Check(secs < 10.0, absl::StrCat("destroying the communicator took ", secs, " s"));
}

int RunChild() {
  absl::StatusOr<CommOptions> options = CommOptions::FromEnvironment();
  if (!options.ok()) {
    std::printf("FAIL: CommOptions::FromEnvironment: %s\n", options.status().ToString().c_str());
    return 1;
  }
  Checker c(options->rank, options->size);
  absl::StatusOr<std::unique_ptr<Communicator>> gloo = NewGlooCommunicator(*options);
  if (!c.CheckStatus(gloo.status(), "gloo bootstrap")) return 1;
  const int device = options->local_rank;
  {
    absl::StatusOr<std::unique_ptr<Communicator>> nccl =
        NewNcclCommunicator(gloo->get(), device, nullptr);
    if (!c.CheckStatus(nccl.status(), "nccl communicator created")) return 1;
    Communicator& comm = **nccl;
    c.Check(comm.rank() == options->rank && comm.size() == options->size &&
                std::string(comm.backend()) == "nccl",
            "rank/size/backend");
    for (int64_t n : {int64_t{1}, int64_t{4099}, int64_t{(1 << 20) + 3}}) {
      RunCollectives(comm, n, c);
    }
    CheckCounters(comm, c);
    CheckBadArguments(comm, c);
    c.CheckStatus(comm.Barrier(), "barrier");
  }
  if (options->size >= 2) CheckTimeout(**gloo, device, c);
  c.CheckStatus((*gloo)->Barrier(), "final gloo barrier");
  std::printf("%s: rank %d done, %d failure(s)\n", c.failures() == 0 ? "PASS" : "FAIL",
              options->rank, c.failures());
  return c.failures() == 0 ? 0 : 1;
}

// ---------------------------------------------------------------------------------------------
// Parent side.

int RunParent() {
  std::string why;
  if (!NcclDeviceAvailable(1, &why)) {
    std::printf("SKIP: %s\n", why.c_str());
    return 0;
  }
  int count = 0;
  cudaGetDeviceCount(&count);
  std::vector<int> sizes;
  for (int d : {1, 2, 4}) {
    if (d <= count) sizes.push_back(d);
  }
  if (count == 3) sizes.push_back(3);
  bool ok = true;
  for (int d : sizes) ok = testing::RunNcclGroup(d, /*comm_timeout_ms=*/60000) && ok;
  if (count < 2) {
    std::printf("SKIP: multi-rank cases need 2 devices, %d visible (the D = 1 case %s)\n", count,
                ok ? "passed" : "FAILED");
  }
  std::printf("%s\n", ok ? "ALL PASS" : "SOME FAILED");
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace parallel
}  // namespace stallfree

int main() {
  if (getenv("RANK") == nullptr || getenv("WORLD_SIZE") == nullptr) {
    return stallfree::parallel::RunParent();
  }
  return stallfree::parallel::RunChild();
}
