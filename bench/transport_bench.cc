// transport_bench: the shared-memory gradient push against the same bytes sent inside a
// protobuf message over the same unix socket, and against a plain memcpy (the limit).
// Both pushes do the same daemon-side work (accumulate into the fp32 accumulator).
// Ends with FIGURE lines. --quick finishes within 30 s.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "client/client.h"
#include "common/flags.h"
#include "testing/daemon_process.h"

namespace {
using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Run(int argc, char** argv) {
  using namespace stallfree;
  bool quick = false;
  int64_t reps = 7;
  FlagSet flags("transport_bench",
                "shared-memory push vs protobuf bytes vs memcpy, 4 MiB to 256 MiB; small-RPC latency");
  flags.AddBool("quick", &quick, "fewer repetitions (finishes within 30 s)");
  flags.AddInt("reps", &reps, "repetitions per payload (median is reported)");
  std::string stallfreed;
  flags.AddString("stallfreed", &stallfreed,
                  "the stallfreed binary (default: found beside this one, or in its runfiles)");
  if (int code = flags.ParseCommandLine(argc, argv); code >= 0) return code;
  if (quick) reps = 3;
  testing::SetBinary("server/stallfreed", stallfreed);
  testing::Daemon daemon({}, "warning");
  if (!daemon.started()) return 1;  // the Daemon said where it looked
  auto client = Client::Connect(daemon.socket());
  if (!client.ok()) {
    fprintf(stderr, "%s\n", client.status().ToString().c_str());
    return 1;
  }
  const std::vector<int> sizes_mib = {4, 16, 64, 256};
  printf("shm push: the gradient is already in the slot (as a device DMA leaves it); the RPC and the\n"
         "daemon's accumulate. +write: the trainer's memcpy into the slot as well. protobuf: the same\n"
         "bytes in a PushGradientsInline message (serialise, socket, parse, same accumulate).\n");
  printf("%-10s %10s %12s %14s %12s %10s %10s %10s\n", "payload", "shm GB/s", "+write GB/s",
         "protobuf GB/s", "memcpy GB/s", "shm/pb", "shm/memcpy", "+w/memcpy");
  double shm256 = 0, shmw256 = 0, pb256 = 0, mc256 = 0;
  for (int mib : sizes_mib) {
    const int64_t n = (int64_t{mib} << 20) / 4;
    const size_t bytes = static_cast<size_t>(n) * 4;
    auto session = (*client)->OpenSession("bench", 0);
    if (!session.ok()) return 1;
    Session& s = **session;
    if (!s.RegisterParams({{"g", {n}, v1::DTYPE_FP32}}).ok()) return 1;
    std::vector<float> src(n);
    for (int64_t i = 0; i < n; ++i) src[i] = static_cast<float>(i % 1000) * 1e-3f;
    std::vector<char> dst(bytes);
    std::string payload(reinterpret_cast<const char*>(src.data()), bytes);
    std::vector<double> shm, shmw, pb, mc;
    for (int r = 0; r < reps + 1; ++r) {  // the first round warms up and is dropped.
      auto t = Clock::now();
      memcpy(dst.data(), src.data(), bytes);
      double tm = Since(t);
      t = Clock::now();
      memcpy(s.GradSlot(0, "g"), src.data(), bytes);  // the trainer's write into the slot
      double tw = Since(t);
      t = Clock::now();
      auto pushed = s.Push(1, 0);  // RPC + the daemon's accumulate straight from the slot
      double ts = Since(t);
      if (!pushed.ok()) {
        fprintf(stderr, "push: %s\n", pushed.status().ToString().c_str());
        return 1;
      }
      t = Clock::now();
      v1::PushGradientsInlineRequest req;
      *req.mutable_session() = s.ref();
      req.set_param("g");
      req.set_data(payload);  // serialising from the trainer's buffer includes this copy
      grpc::ClientContext ctx;
      v1::PushGradientsResponse resp;
      grpc::Status st = (*client)->stub()->PushGradientsInline(&ctx, req, &resp);
      double tp = Since(t);
      if (!st.ok()) {
        fprintf(stderr, "inline push: %s\n", st.error_message().c_str());
        return 1;
      }
      if (r == 0) continue;
      mc.push_back(tm);
      shm.push_back(ts);
      shmw.push_back(tw + ts);
      pb.push_back(tp);
    }
    const double gb = bytes / 1e9;
    const double s_gbs = gb / Median(shm), w_gbs = gb / Median(shmw), p_gbs = gb / Median(pb),
                 m_gbs = gb / Median(mc);
    printf("%-10s %10.2f %12.2f %14.2f %12.2f %9.2fx %9.2fx %9.2fx\n",
           absl::StrFormat("%d MiB", mib).c_str(), s_gbs, w_gbs, p_gbs, m_gbs, s_gbs / p_gbs,
           s_gbs / m_gbs, w_gbs / m_gbs);
    if (mib == 256) {
      shmw256 = w_gbs;
      shm256 = s_gbs;
      pb256 = p_gbs;
      mc256 = m_gbs;
    }
    s.Close().IgnoreError();
  }
  // Small-RPC round trip: GetStats over the same socket.
  std::vector<double> lat;
  const int calls = quick ? 500 : 2000;
  for (int i = 0; i < calls; ++i) {
    auto t = Clock::now();
    auto st = (*client)->GetStats();
    lat.push_back(Since(t) * 1e6);
    if (!st.ok()) return 1;
  }
  std::sort(lat.begin(), lat.end());
  const double p50 = lat[lat.size() / 2], p99 = lat[lat.size() * 99 / 100];
  printf("small RPC (GetStats) round trip over %d calls: p50 %.1f us, p99 %.1f us\n", calls, p50, p99);
  printf("FIGURE shm_push_256MiB %.2f GB/s\n", shm256);
  printf("FIGURE grpc_bytes_push_256MiB %.2f GB/s\n", pb256);
  printf("FIGURE memcpy_256MiB %.2f GB/s\n", mc256);
  printf("FIGURE shm_vs_grpc_bytes_256MiB %.2f x\n", shm256 / pb256);
  printf("FIGURE shm_vs_memcpy_256MiB %.2f x\n", shm256 / mc256);
  printf("FIGURE shm_write_and_push_256MiB %.2f GB/s\n", shmw256);
  printf("FIGURE shm_write_and_push_vs_memcpy_256MiB %.2f x\n", shmw256 / mc256);
  printf("FIGURE small_rpc_p50 %.1f us\n", p50);
  printf("FIGURE small_rpc_p99 %.1f us\n", p99);
  return 0;
}
}  // namespace

int main(int argc, char** argv) { return Run(argc, argv); }
