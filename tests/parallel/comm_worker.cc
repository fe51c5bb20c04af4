// Runs as one rank of a group (RANK / WORLD_SIZE / ... from the launcher): every collective on
// rank-dependent data with exact expected results, async overlap, a tagged send/recv ring, and
// the byte counters against the closed forms of the Gloo backend's algorithms
// (parallel/gloo_communicator.cc). Prints "OK rank r" and exits 0, or the first mismatch and 1.
//
// --die_after_barrier=1: rank 1 _exit(3)s after the first barrier; the others run an all-reduce
// that must fail (UNAVAILABLE / DEADLINE_EXCEEDED, naming the op) within the timeout, and a
// later call must fail at once; they then exit 7 ("detected the peer's death correctly").
// --unreachable_store=1 (one process): a rank of a 2-rank group whose TCP store server is not
// there must get UNAVAILABLE naming the address within its 500 ms timeout; exits 0.
// --groups=R (W ranks, W a multiple of R): NewGlooGroups splits the world into R rows of
// C = W / R ranks (global rank = row * C + column) and C columns of R ranks, the mesh of the
// trainer's --dp (rows: TSP groups, columns: data-parallel groups); each rank all-reduces and
// all-gathers rank-dependent data in its row and its column, both groups interleaved, and checks
// the exact results. Prints "OK rank r"; exits 0, or 1 with the first mismatch.
// --stall_after_barrier=1: rank 1 sleeps for 2 x the timeout after the first barrier (alive but
// silent); the others' all-reduce must give DEADLINE_EXCEEDED within the timeout; they exit 8.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "parallel/communicator.h"

namespace sp = stallfree::parallel;

namespace {

constexpr int kDetectedExit = 7;
constexpr int kDyingExit = 3;
constexpr int kTimedOutExit = 8;

int g_rank = 0;

#define CHECK_OR_FAIL(cond, ...)                                                     \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "FAIL rank %d: %s:%d: %s: %s\n", g_rank, __FILE__, __LINE__, \
                   #cond, absl::StrCat(__VA_ARGS__).c_str());                        \
      return false;                                                                  \
    }                                                                                \
  } while (0)

#define CHECK_OK(expr, what)                                                         \
  do {                                                                               \
    absl::Status s_ = (expr);                                                        \
    CHECK_OR_FAIL(s_.ok(), what, ": ", s_.ToString());                               \
  } while (0)

// Small integers: every sum over ranks is exact in fp32.
float Value(int rank, int64_t i) { return static_cast<float>((rank + 1) * ((i % 13) + 1)); }

int64_t BlockSize(int64_t n, int d, int b) { return n / d + (b < n % d ? 1 : 0); }

bool CheckCounter(const sp::Communicator& c, sp::OpKind kind, int64_t calls, int64_t sent,
                  int64_t received, const std::string& what) {
  sp::OpCounter got = c.counters()[static_cast<size_t>(kind)];
  CHECK_OR_FAIL(got.calls == calls && got.bytes_sent == sent && got.bytes_received == received,
                what, " ", sp::OpKindName(kind), " counters: calls/sent/received ", got.calls, "/",
                got.bytes_sent, "/", got.bytes_received, ", expected ", calls, "/", sent, "/",
                received);
  return true;
}

int BarrierRounds(int d) {
  int rounds = 0;
  for (int k = 1; k < d; k *= 2) ++rounds;
  return rounds;
}

bool TestCollectives(sp::Communicator& c, int64_t n) {
  const int d = c.size(), r = c.rank();
  const int64_t bytes = 4 * n;
  const std::string at = absl::StrCat("count ", n);
  int64_t tri = static_cast<int64_t>(d) * (d + 1) / 2;  // sum of (rank + 1)

  // Broadcast from each of two roots.
  for (int root : {0, d - 1}) {
    c.ResetCounters();
    std::vector<float> buf(n);
    for (int64_t i = 0; i < n; ++i) buf[i] = r == root ? Value(root, i) : -1.0f;
    CHECK_OK(c.Broadcast(buf.data(), n, root), at + " broadcast");
    for (int64_t i = 0; i < n; ++i) {
      CHECK_OR_FAIL(buf[i] == Value(root, i), at, " broadcast root ", root, " [", i, "] = ",
                    buf[i]);
    }
    int rel = (r - root + d) % d;
    if (!CheckCounter(c, sp::OpKind::kBroadcast, 1, rel != d - 1 ? bytes : 0,
                      rel != 0 ? bytes : 0, at)) {
      return false;
    }
  }

  // Reduce to root d / 2, out of place and in place.
  for (bool in_place : {false, true}) {
    const int root = d / 2;
    c.ResetCounters();
    std::vector<float> send(n), recv(n, -1.0f);
    for (int64_t i = 0; i < n; ++i) send[i] = Value(r, i);
    float* out = in_place && r == root ? send.data() : recv.data();
    CHECK_OK(c.Reduce(send.data(), r == root ? out : nullptr, n, root), at + " reduce");
    if (r == root) {
      for (int64_t i = 0; i < n; ++i) {
        CHECK_OR_FAIL(out[i] == tri * ((i % 13) + 1), at, " reduce in_place ", in_place, " [",
                      i, "] = ", out[i]);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        CHECK_OR_FAIL(send[i] == Value(r, i), at, " reduce modified send [", i, "]");
      }
    }
    int rel = (r - root + d) % d;
    if (!CheckCounter(c, sp::OpKind::kReduce, 1, rel != 0 ? bytes : 0,
                      rel != d - 1 ? bytes : 0, at)) {
      return false;
    }
  }

  // All-gather.
  {
    c.ResetCounters();
    std::vector<float> send(n), recv(n * d, -1.0f);
    for (int64_t i = 0; i < n; ++i) send[i] = Value(r, i);
    CHECK_OK(c.AllGather(send.data(), recv.data(), n), at + " all_gather");
    for (int b = 0; b < d; ++b) {
      for (int64_t i = 0; i < n; ++i) {
        CHECK_OR_FAIL(recv[b * n + i] == Value(b, i), at, " all_gather block ", b, " [", i,
                      "] = ", recv[b * n + i]);
      }
    }
    if (!CheckCounter(c, sp::OpKind::kAllGather, 1, (d - 1) * bytes, (d - 1) * bytes, at)) {
      return false;
    }
  }

  // Reduce-scatter.
  {
    c.ResetCounters();
    std::vector<float> send(n * d), recv(n, -1.0f);
    for (int64_t j = 0; j < n * d; ++j) send[j] = Value(r, j);
    CHECK_OK(c.ReduceScatter(send.data(), recv.data(), n), at + " reduce_scatter");
    for (int64_t i = 0; i < n; ++i) {
      int64_t j = r * n + i;
      CHECK_OR_FAIL(recv[i] == tri * ((j % 13) + 1), at, " reduce_scatter [", i, "] = ",
                    recv[i]);
    }
    if (!CheckCounter(c, sp::OpKind::kReduceScatter, 1, (d - 1) * bytes, (d - 1) * bytes,
                      at)) {
      return false;
    }
  }

  // All-reduce.
  {
    c.ResetCounters();
    std::vector<float> buf(n);
    for (int64_t i = 0; i < n; ++i) buf[i] = Value(r, i);
    CHECK_OK(c.AllReduce(buf.data(), n), at + " all_reduce");
    for (int64_t i = 0; i < n; ++i) {
      CHECK_OR_FAIL(buf[i] == tri * ((i % 13) + 1), at, " all_reduce [", i, "] = ", buf[i]);
    }
    int64_t sent = 4 * (2 * n - BlockSize(n, d, r) - BlockSize(n, d, (r + 1) % d));
    int64_t recv = 4 * (2 * n - BlockSize(n, d, (r - 1 + d) % d) - BlockSize(n, d, r));
    if (!CheckCounter(c, sp::OpKind::kAllReduce, 1, sent, recv, at)) return false;
  }
  return true;
}

bool TestAsync(sp::Communicator& c) {
  const int d = c.size(), r = c.rank();
  int64_t tri = static_cast<int64_t>(d) * (d + 1) / 2;
  const int64_t n1 = 100003, n2 = 7, n3 = 4096;
  std::vector<float> a(n1), b(n2), g(n3), gathered(n3 * d), bc(n3);
  for (int64_t i = 0; i < n1; ++i) a[i] = Value(r, i);
  for (int64_t i = 0; i < n2; ++i) b[i] = Value(r, i + 5);
  for (int64_t i = 0; i < n3; ++i) g[i] = Value(r, i);
  for (int64_t i = 0; i < n3; ++i) bc[i] = r == 0 ? Value(0, i) : 0.0f;
  auto w1 = c.IAllReduce(a.data(), n1);
  auto w2 = c.IBroadcast(bc.data(), n3, 0);
  auto w3 = c.IAllGather(g.data(), gathered.data(), n3);
  auto w4 = c.IAllReduce(b.data(), n2);
  CHECK_OK(w4->Wait(), "async all_reduce b");
  CHECK_OK(w3->Wait(), "async all_gather");
  CHECK_OK(w1->Wait(), "async all_reduce a");
  CHECK_OK(w2->Wait(), "async broadcast");
  for (int64_t i = 0; i < n1; ++i) {
    CHECK_OR_FAIL(a[i] == tri * ((i % 13) + 1), "async all_reduce a [", i, "] = ", a[i]);
  }
  for (int64_t i = 0; i < n2; ++i) {
    CHECK_OR_FAIL(b[i] == tri * (((i + 5) % 13) + 1), "async all_reduce b [", i, "]");
  }
  for (int64_t i = 0; i < n3; ++i) CHECK_OR_FAIL(bc[i] == Value(0, i), "async bcast [", i, "]");
  for (int q = 0; q < d; ++q) {
    for (int64_t i = 0; i < n3; ++i) {
      CHECK_OR_FAIL(gathered[q * n3 + i] == Value(q, i), "async all_gather ", q, " [", i, "]");
    }
  }
  return true;
}

bool TestPointToPoint(sp::Communicator& c) {
  const int d = c.size(), r = c.rank();
  if (d == 1) {
    float x = 0;
    CHECK_OR_FAIL(absl::IsInvalidArgument(c.Send(&x, 1, 0, 0)), "send to self must fail");
    return true;
  }
  CHECK_OR_FAIL(absl::IsInvalidArgument(c.Send(nullptr, 1, r, 0)), "send to self must fail");
  CHECK_OR_FAIL(absl::IsInvalidArgument(c.Send(nullptr, 1, (r + 1) % d, 1 << 20)),
                "tag 2^20 must fail");
  c.ResetCounters();
  const int right = (r + 1) % d, left = (r - 1 + d) % d;
  const int64_t n5 = 7, n6 = 250001;
  std::vector<float> s5(n5), s6(n6), r5(n5, -1), r6(n6, -1), s5b(n5), r5b(n5, -1);
  for (int64_t i = 0; i < n5; ++i) s5[i] = Value(r, i) + 0.5f;
  for (int64_t i = 0; i < n5; ++i) s5b[i] = Value(r, i) + 0.25f;
  for (int64_t i = 0; i < n6; ++i) s6[i] = Value(r, i);
  // Two messages with the same tag must arrive in order; the tag-6 recv is posted first.
  auto a = c.ISend(s5.data(), n5, right, 5);
  auto b = c.ISend(s6.data(), n6, right, 6);
  auto e = c.ISend(s5b.data(), n5, right, 5);
  auto x = c.IRecv(r6.data(), n6, left, 6);
  auto y = c.IRecv(r5.data(), n5, left, 5);
  auto z = c.IRecv(r5b.data(), n5, left, 5);
  CHECK_OK(z->Wait(), "recv tag 5 (second)");
  CHECK_OK(y->Wait(), "recv tag 5");
  CHECK_OK(x->Wait(), "recv tag 6");
  CHECK_OK(a->Wait(), "send tag 5");
  CHECK_OK(b->Wait(), "send tag 6");
  CHECK_OK(e->Wait(), "send tag 5 (second)");
  for (int64_t i = 0; i < n5; ++i) {
    CHECK_OR_FAIL(r5[i] == Value(left, i) + 0.5f, "recv tag 5 [", i, "] = ", r5[i]);
    CHECK_OR_FAIL(r5b[i] == Value(left, i) + 0.25f, "recv tag 5 second [", i, "] = ", r5b[i]);
  }
  for (int64_t i = 0; i < n6; ++i) CHECK_OR_FAIL(r6[i] == Value(left, i), "recv tag 6 [", i, "]");
  const int64_t bytes = 4 * (2 * n5 + n6);
  if (!CheckCounter(c, sp::OpKind::kSend, 3, bytes, 0, "p2p")) return false;
  if (!CheckCounter(c, sp::OpKind::kRecv, 3, 0, bytes, "p2p")) return false;
  // A zero-length message is a no-op on both ends.
  CHECK_OK(c.Send(nullptr, 0, right, 9), "empty send");
  CHECK_OK(c.Recv(nullptr, 0, left, 9), "empty recv");
  return true;
}

int RunAll(sp::Communicator& c) {
  c.ResetCounters();
  CHECK_OK(c.Barrier(), "barrier");
  if (!CheckCounter(c, sp::OpKind::kBarrier, 1, BarrierRounds(c.size()),
                    BarrierRounds(c.size()), "barrier")) {
    return 1;
  }
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000000}, int64_t{1000001}}) {
    if (!TestCollectives(c, n)) return 1;
  }
  if (!TestAsync(c)) return 1;
  if (!TestPointToPoint(c)) return 1;
  CHECK_OK(c.Barrier(), "final barrier");
  std::printf("OK rank %d\n", c.rank());
  std::fflush(stdout);
  return 0;
}

int RunDeath(sp::Communicator& c, std::chrono::milliseconds timeout, bool stall) {
  if (c.size() < 3) {
    std::fprintf(stderr, "FAIL rank %d: --die/stall_after_barrier needs >= 3 ranks\n", c.rank());
    return 1;
  }
  absl::Status s = c.Barrier();
  if (!s.ok()) {
    std::fprintf(stderr, "FAIL rank %d: first barrier: %s\n", c.rank(), s.ToString().c_str());
    return 1;
  }
  if (c.rank() == 1 && stall) {
    std::fprintf(stderr, "rank 1 stalling after the barrier\n");
    std::this_thread::sleep_for(2 * timeout);
    _exit(kDyingExit);
  }
  if (c.rank() == 1) {
    usleep(300 * 1000);  // let the others finish the barrier
    std::fprintf(stderr, "rank 1 dying after the barrier\n");
    _exit(kDyingExit);
  }
  std::vector<float> buf(100000, 1.0f);
  auto start = std::chrono::steady_clock::now();
  s = c.AllReduce(buf.data(), static_cast<int64_t>(buf.size()));
  auto took = std::chrono::steady_clock::now() - start;
  if (s.ok()) {
    std::fprintf(stderr, "FAIL rank %d: all_reduce with a dead peer succeeded\n", c.rank());
    return 1;
  }
  std::fprintf(stderr, "rank %d: all_reduce failed as expected after %.2f s: %s\n", c.rank(),
               std::chrono::duration<double>(took).count(), s.ToString().c_str());
  bool code_ok = stall ? absl::IsDeadlineExceeded(s)
                       : absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
  if (!code_ok) {
    std::fprintf(stderr, "FAIL rank %d: wrong code\n", c.rank());
    return 1;
  }
  if (!absl::StrContains(s.message(), "all_reduce") || !absl::StrContains(s.message(), "rank")) {
    std::fprintf(stderr, "FAIL rank %d: the error does not name the op and rank\n", c.rank());
    return 1;
  }
  if (took > timeout + std::chrono::seconds(3)) {
    std::fprintf(stderr, "FAIL rank %d: detection took longer than the timeout\n", c.rank());
    return 1;
  }
  start = std::chrono::steady_clock::now();
  s = c.Barrier();
  took = std::chrono::steady_clock::now() - start;
  if (s.ok() || took > std::chrono::milliseconds(500)) {
    std::fprintf(stderr, "FAIL rank %d: a broken communicator must fail at once (%s)\n",
                 c.rank(), s.ToString().c_str());
    return 1;
  }
  std::printf("DETECTED rank %d\n", c.rank());
  std::fflush(stdout);
  if (stall) {
    // Stay until every survivor's own timeout has fired, so none sees our exit instead.
    std::this_thread::sleep_for(std::chrono::seconds(1));
    return kTimedOutExit;
  }
  return kDetectedExit;
}

int RunGroups(const sp::CommOptions& world, int rows) {
  if (rows < 1 || world.size % rows != 0) {
    std::fprintf(stderr, "FAIL: --groups=%d does not divide the world of %d\n", rows, world.size);
    return 1;
  }
  const int cols = world.size / rows, row = world.rank / cols, col = world.rank % cols;
  auto groups = sp::NewGlooGroups(world, {{absl::StrCat("row", row), col, cols},
                                          {absl::StrCat("col", col), row, rows}});
  if (!groups.ok() || groups->size() != 2) {
    std::fprintf(stderr, "FAIL rank %d: %s\n", g_rank, groups.status().ToString().c_str());
    return 1;
  }
  sp::Communicator& r = *(*groups)[0];
  sp::Communicator& c = *(*groups)[1];
  auto check = [&]() -> bool {
    CHECK_OR_FAIL(r.rank() == col && r.size() == cols && c.rank() == row && c.size() == rows,
                  "group rank/size ", r.rank(), "/", r.size(), " and ", c.rank(), "/", c.size());
    for (int round = 0; round < 3; ++round) {
      const int64_t n = 1000 + round;
      // Row: sum over the row's global ranks; column: the same over the column's.
      std::vector<float> a(n), b(n);
      for (int64_t i = 0; i < n; ++i) a[i] = b[i] = Value(world.rank, i + round);
      auto wa = r.IAllReduce(a.data(), n);
      auto wb = c.IAllReduce(b.data(), n);
      CHECK_OK(wa->Wait(), "row all-reduce");
      CHECK_OK(wb->Wait(), "column all-reduce");
      for (int64_t i = 0; i < n; ++i) {
        float want_a = 0, want_b = 0;
        for (int k = 0; k < cols; ++k) want_a += Value(row * cols + k, i + round);
        for (int k = 0; k < rows; ++k) want_b += Value(k * cols + col, i + round);
        CHECK_OR_FAIL(a[i] == want_a && b[i] == want_b, "round ", round, " element ", i, ": ",
                      a[i], " / ", b[i], ", want ", want_a, " / ", want_b);
      }
      std::vector<float> mine(n, static_cast<float>(world.rank)), all(n * rows);
      CHECK_OK(c.AllGather(mine.data(), all.data(), n), "column all-gather");
      for (int k = 0; k < rows; ++k)
        CHECK_OR_FAIL(all[k * n] == static_cast<float>(k * cols + col) &&
                          all[k * n + n - 1] == static_cast<float>(k * cols + col),
                      "column all-gather block ", k);
    }
    CHECK_OK(r.Barrier(), "row barrier");
    CHECK_OK(c.Barrier(), "column barrier");
    return true;
  };
  if (!check()) return 1;
  std::printf("OK rank %d\n", world.rank);
  return 0;
}

int RunUnreachableStore() {
  // A port that was free a moment ago: nobody serves it.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(sa);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    std::perror("FAIL: port probe");
    return 1;
  }
  ::close(fd);
  sp::CommOptions options;
  options.rank = 1;
  options.size = 2;
  options.master_port = ntohs(sa.sin_port);
  options.timeout = std::chrono::milliseconds(500);
  auto start = std::chrono::steady_clock::now();
  auto comm = sp::NewGlooCommunicator(options);
  auto took = std::chrono::steady_clock::now() - start;
  std::string where = absl::StrCat("127.0.0.1:", options.master_port);
  if (comm.ok() || !absl::IsUnavailable(comm.status()) ||
      !absl::StrContains(comm.status().message(), where) ||
      took > std::chrono::milliseconds(3000)) {
    std::fprintf(stderr, "FAIL: unreachable store: %s after %.2f s (want UNAVAILABLE, %s)\n",
                 comm.ok() ? "OK" : comm.status().ToString().c_str(),
                 std::chrono::duration<double>(took).count(), where.c_str());
    return 1;
  }
  std::printf("OK unreachable store: %s\n", comm.status().ToString().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool die = false, stall = false;
  int group_rows = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--groups=", 9) == 0) {
      group_rows = std::atoi(argv[i] + 9);
    } else if (std::strcmp(argv[i], "--die_after_barrier=1") == 0) {
      die = true;
    } else if (std::strcmp(argv[i], "--unreachable_store=1") == 0) {
      return RunUnreachableStore();
    } else if (std::strcmp(argv[i], "--stall_after_barrier=1") == 0) {
      stall = true;
    } else {
      std::fprintf(stderr, "comm_worker: unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  auto options = sp::CommOptions::FromEnvironment();
  if (!options.ok()) {
    std::fprintf(stderr, "FAIL: %s\n", options.status().ToString().c_str());
    return 1;
  }
  g_rank = options->rank;
  if (group_rows > 0) return RunGroups(*options, group_rows);
  auto comm = sp::NewGlooCommunicator(*options);
  if (!comm.ok()) {
    std::fprintf(stderr, "FAIL rank %d: %s\n", g_rank, comm.status().ToString().c_str());
    return 1;
  }
  if ((*comm)->rank() != options->rank || (*comm)->size() != options->size ||
      std::strcmp((*comm)->backend(), "gloo") != 0) {
    std::fprintf(stderr, "FAIL rank %d: rank/size/backend mismatch\n", g_rank);
    return 1;
  }
  return die || stall ? RunDeath(**comm, options->timeout, stall) : RunAll(**comm);
}
