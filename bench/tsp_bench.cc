// TSP (folded tensor+sequence parallelism, parallel/tsp_block.h) against the Megatron TP+SP
// baseline (parallel/tpsp_block.h) and TP x CP (parallel/tpcp_block.h) at equal D: per-rank
// memory, communication per layer against the closed forms, and tokens/s of one block.
//
//   bazel run //bench:tsp_bench [-- --quick] [--reps R] [--seqs 256,512,1024,4096] [--ds 2,4]
//
// The binary is both the driver and the worker. Without RANK in the environment it is the
// driver: for every (D, T, scheme) it starts itself D times with LaunchLocal (file store); each
// rank writes one line of measurements to a file in a temp directory; the driver prints a table
// per (D, T) and FIGURE lines. With RANK set it is one rank of one configuration.
//
// Block: C=256, H=8, FF=1024, B=1, fp32 on the CPU (kernels::CpuOps(), Gloo over loopback).
// Per rank:
// - params: bytes of its weight shard (TSP: 4C^2/D + 3 FF C/D + 2C floats; TP+SP the same;
//   TP x CP with t x c = D: the TP+SP shard of degree t, replicated over c).
// - cache: bytes of the forward's cache kept for the backward, counted from the cache struct's
//   vectors (capacity x element size).
// - peak act: the peak of live heap bytes during one forward + backward above the bytes live
//   before it (weights, input, output, gradients already allocated), from a global operator
//   new / delete hook (malloc_usable_size); so it is the cache plus the largest transient
//   buffers the block and the communicator allocate through C++ containers (raw malloc, e.g.
//   inside BLAS, is not seen).
// - comm: bytes sent and received in one forward + backward, summed over the OpKind counters
//   of the rank's communicator(s) (Gloo counts at the transport); the table shows the mean
//   over the ranks (chains and rings are not symmetric per rank, their mean is) next to the
//   closed form of that mean.
// - tokens/s: B*T / (forward + backward wall time), the slowest rank per repetition, best
//   repetition after one warm-up. The D ranks share this machine's cores, so this is a CPU
//   contention figure, not an interconnect one.
#include <malloc.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/flags.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/launcher.h"
#include "parallel/reference_block.h"
#include "parallel/tpcp_block.h"
#include "parallel/tpsp_block.h"
#include "parallel/tsp_block.h"
#include "parallel/zigzag.h"

// ---- Heap accounting: every operator new / delete of this process. ----
namespace {
std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};

void NoteAlloc(void* p) {
  if (p == nullptr) return;
  const int64_t now =
      g_live.fetch_add(static_cast<int64_t>(malloc_usable_size(p)), std::memory_order_relaxed) +
      static_cast<int64_t>(malloc_usable_size(p));
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}
void NoteFree(void* p) {
  if (p == nullptr) return;
  g_live.fetch_sub(static_cast<int64_t>(malloc_usable_size(p)), std::memory_order_relaxed);
}
void* Alloc(size_t n) {
  void* p = std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  NoteAlloc(p);
  return p;
}
void* AllocAligned(size_t n, std::align_val_t a) {
  const size_t al = std::max(static_cast<size_t>(a), sizeof(void*));
  void* p = nullptr;
  if (posix_memalign(&p, al, n == 0 ? 1 : n) != 0) throw std::bad_alloc();
  NoteAlloc(p);
  return p;
}
void Free(void* p) {
  NoteFree(p);
  std::free(p);
}
}  // namespace

void* operator new(size_t n) { return Alloc(n); }
void* operator new[](size_t n) { return Alloc(n); }
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  try {
    return Alloc(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](size_t n, const std::nothrow_t&) noexcept {
  try {
    return Alloc(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new(size_t n, std::align_val_t a) { return AllocAligned(n, a); }
void* operator new[](size_t n, std::align_val_t a) { return AllocAligned(n, a); }
void operator delete(void* p) noexcept { Free(p); }
void operator delete[](void* p) noexcept { Free(p); }
void operator delete(void* p, size_t) noexcept { Free(p); }
void operator delete[](void* p, size_t) noexcept { Free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { Free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { Free(p); }
void operator delete(void* p, std::align_val_t) noexcept { Free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { Free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { Free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { Free(p); }

namespace stallfree {
namespace {

namespace sp = parallel;

constexpr int64_t kC = 256, kH = 8, kFF = 1024, kB = 1;
constexpr char kOutEnv[] = "TSP_BENCH_OUT_DIR";

// ---- Closed forms: the mean over the ranks of the bytes one rank sends in one forward +
// backward of one layer (equal to the mean received). ----
double PredictTsp(double D, double T) {
  const double C = kC, FF = kFF, B = kB, f = (D - 1) / D;
  // Weights: D broadcasts fwd + D bwd + D reduces bwd of 4C^2/D floats (chains: D-1 of the D
  // ranks send each); K|V all-gather fwd + bwd, dK|dV reduce-scatter: 2BTC (D-1)/D floats
  // each; MLP ring: D-1 hops of 3 FF C/D floats fwd, twice that bwd (weights + gradients); ln
  // all-reduce of 2C floats (ring: 2 * 2C (D-1)/D).
  return 4.0 * (3 * 4 * C * C * f + 3 * 2 * B * T * C * f + 3 * 3 * FF * C * f + 4 * C * f);
}
double PredictTpsp(double D, double T) {
  const double C = kC, B = kB, f = (D - 1) / D;
  // 2 all-gathers + 2 reduce-scatters of BTC floats fwd, the same bwd, ln all-reduce of 2C.
  return 4.0 * (8 * B * T * C * f + 4 * C * f);
}
double PredictTpcp(double t, double c, double T) {
  const double C = kC, FF = kFF, B = kB, ft = (t - 1) / t, fc = (c - 1) / c;
  const double n_tp = B * (T / c) * C, n_kv = B * (T / c) * 2 * C / t;
  const double n_w = 2 * C + 4 * C * C / t + 3 * C * FF / t;
  // TP: 8 collectives of the CP shard + ln all-reduce; CP: K|V all-gather, dK|dV
  // reduce-scatter, weight-gradient all-reduce.
  return 4.0 * (8 * n_tp * ft + 4 * C * ft + 2 * n_kv * (c - 1) + 2 * n_w * fc);
}

int TpDegree(int D) { return D >= 4 ? 2 : 1; }  // TP x CP: t = 2 for D = 4, pure CP for D = 2

std::vector<float> Randn(uint32_t seed, int64_t n) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

template <class T>
int64_t Bytes(const std::vector<T>& v) {
  return static_cast<int64_t>(v.capacity() * sizeof(T));
}
template <class... V>
int64_t SumBytes(const V&... v) {
  return (Bytes(v) + ...);
}
int64_t CacheBytes(const sp::TspCache& c) {
  return SumBytes(c.q_pos, c.k_pos, c.x, c.n1, c.rstd1, c.qkv, c.att, c.lse, c.h, c.n2, c.rstd2,
                  c.g, c.u, c.m);
}
int64_t CacheBytes(const sp::TpspCache& c) { return c.bytes(); }
int64_t CacheBytes(const sp::TpcpCache& c) { return c.bytes(); }
int64_t ParamBytes(const sp::BlockWeights& w) {
  int64_t b = 0;
  for (const std::vector<float>* t : w.Tensors()) b += Bytes(*t);
  return b;
}

// ---- Worker: one rank of one configuration. ----
struct WorkerFlags {
  std::string scheme;
  int64_t T = 0;
  int64_t reps = 3;
};

int Fail(int rank, const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "tsp_bench rank %d: %s: %s\n", rank, what.c_str(), s.ToString().c_str());
  return 1;
}

// A world barrier: for TP x CP, TP then CP (the grid is connected, so every rank has passed
// the first barrier before any leaves the second).
absl::Status WorldBarrier(const std::vector<sp::Communicator*>& comms) {
  for (sp::Communicator* c : comms) {
    if (absl::Status s = c->Barrier(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// One rank's measurements: the forward's cache, the peak of live heap bytes above those live
// before the step, bytes sent and received per step, and each timed repetition's seconds.
struct RankMeasure {
  int64_t cache_bytes = 0, peak_act = 0, sent = 0, received = 0;
  std::vector<double> times;
};

// Runs step (one forward + backward: absl::Status(int64_t* cache_bytes)) reps + 1 times, each
// after a world barrier, the first a warm-up, and measures the others into *m; nonzero (said on
// stderr) if a barrier or a step failed.
template <class Step>
int MeasureRank(int rank, int64_t reps, const std::vector<sp::Communicator*>& comms,
                const Step& step, RankMeasure* m) {
  for (int64_t rep = 0; rep <= reps; ++rep) {  // rep 0: warm-up (Gloo pairs, page faults)
    if (absl::Status s = WorldBarrier(comms); !s.ok()) return Fail(rank, "barrier", s);
    for (sp::Communicator* c : comms) c->ResetCounters();
    const int64_t base = g_live.load();
    g_peak.store(base);
    const auto t0 = std::chrono::steady_clock::now();
    if (absl::Status s = step(&m->cache_bytes); !s.ok()) return Fail(rank, "forward/backward", s);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep == 0) continue;
    m->times.push_back(secs);
    m->peak_act = std::max(m->peak_act, g_peak.load() - base);
    int64_t s_bytes = 0, r_bytes = 0;
    for (sp::Communicator* c : comms) {
      for (const sp::OpCounter& k : c->counters()) {
        s_bytes += k.bytes_sent;
        r_bytes += k.bytes_received;
      }
    }
    m->sent = s_bytes;  // the same every repetition
    m->received = r_bytes;
  }
  return 0;
}

// Writes the rank's line (rank, param bytes, the measurements, the times) to out_dir/rank<r>.txt
// for the driver; nonzero (said on stderr) if the write failed.
int WriteRankLine(int rank, const char* out_dir, int64_t param_bytes, const RankMeasure& m) {
  std::string line = absl::StrCat(rank, " ", param_bytes, " ", m.cache_bytes, " ", m.peak_act,
                                  " ", m.sent, " ", m.received);
  for (double t : m.times) absl::StrAppend(&line, " ", t);
  const std::string path = absl::StrCat(out_dir, "/rank", rank, ".txt");
  std::ofstream out(path);
  out << line << "\n";
  out.close();
  if (!out) return Fail(rank, "write " + path, absl::InternalError("write failed"));
  return 0;
}

int RunWorker(const WorkerFlags& wf) {
  auto options = sp::CommOptions::FromEnvironment();
  if (!options.ok()) return Fail(-1, "environment", options.status());
  const int rank = options->rank, D = options->size;
  const char* out_dir = std::getenv(kOutEnv);
  if (out_dir == nullptr) return Fail(rank, "environment", absl::InvalidArgumentError(kOutEnv));
  const kernels::TransformerOps& ops = kernels::CpuOps();
  const sp::ModelConfig mcfg{/*vocab=*/8, kC, kH, kFF, /*layers=*/1};
  const sp::BlockConfig cfg = mcfg.block();
  const int64_t B = kB, T = wf.T, nl = B * T / D, C = kC;

  // Communicators: one world group, or TP and CP sub-groups for TP x CP.
  std::unique_ptr<sp::Communicator> world;
  sp::TpcpGroups groups;
  std::vector<sp::Communicator*> comms;
  if (wf.scheme == "tpcp") {
    auto g = sp::NewGlooTpcpGroups(*options, TpDegree(D));
    if (!g.ok()) return Fail(rank, "tpcp groups", g.status());
    groups = *std::move(g);
    comms = {groups.tp.get(), groups.cp.get()};
  } else {
    auto c = sp::NewGlooCommunicator(*options);
    if (!c.ok()) return Fail(rank, "communicator", c.status());
    world = *std::move(c);
    comms = {world.get()};
  }
  // Weights (every rank draws the full block and keeps its shard), input and gradient.
  std::vector<float> x_local = Randn(77 + static_cast<uint32_t>(rank), nl * C);
  std::vector<float> dy_local = Randn(99 + static_cast<uint32_t>(rank), nl * C);
  std::vector<float> y_local(nl * C), dx_local(nl * C);
  sp::TspShard tsp_w, tsp_g;
  sp::BlockWeights tp_w, tp_g;
  int64_t param_bytes = 0;
  {
    const sp::BlockWeights full = sp::InitModelWeights(mcfg, 1234).blocks[0];
    if (wf.scheme == "tsp") {
      auto s = sp::ShardBlockWeights(cfg, full, D, rank);
      if (!s.ok()) return Fail(rank, "shard", s.status());
      tsp_w = *std::move(s);
      tsp_g = sp::TspShard::Zeros(cfg, D);
      param_bytes = SumBytes(tsp_w.ln1, tsp_w.ln2, tsp_w.attn, tsp_w.mlp);
    } else {
      const int t = wf.scheme == "tpcp" ? groups.tp_degree : D;
      const int i = wf.scheme == "tpcp" ? groups.tp_index : rank;
      auto s = sp::ShardTpspWeights(cfg, full, t, i);
      if (!s.ok()) return Fail(rank, "shard", s.status());
      tp_w = *std::move(s);
      tp_g = tp_w;
      for (std::vector<float>* v : tp_g.Tensors()) std::fill(v->begin(), v->end(), 0.0f);
      param_bytes = ParamBytes(tp_w);
    }
  }
  const sp::TspBlock tsp(cfg, world.get());
  const sp::TpspBlock tpsp(cfg, world.get());
  const sp::TpcpBlock tpcp(cfg, groups.tp.get(), groups.cp.get());

  // One forward + backward with a fresh cache; returns the cache's bytes in *cache_bytes.
  auto step = [&](int64_t* cache_bytes) -> absl::Status {
    absl::Status s;
    if (wf.scheme == "tsp") {
      sp::TspCache cache;
      s = tsp.Forward(ops, tsp_w, x_local.data(), B, T, y_local.data(), &cache);
      if (s.ok()) s = tsp.Backward(ops, tsp_w, cache, dy_local.data(), dx_local.data(), &tsp_g);
      *cache_bytes = CacheBytes(cache);
    } else if (wf.scheme == "tpsp") {
      sp::TpspCache cache;
      s = tpsp.Forward(ops, sp::TpspViewOf(tp_w), x_local.data(), B, T, y_local.data(), &cache);
      if (s.ok())
        s = tpsp.Backward(ops, sp::TpspViewOf(tp_w), cache, dy_local.data(), dx_local.data(),
                          sp::TpspViewOf(&tp_g));
      *cache_bytes = CacheBytes(cache);
    } else {
      sp::TpcpCache cache;
      s = tpcp.Forward(ops, sp::TpspViewOf(tp_w), x_local.data(), B, T, y_local.data(), &cache);
      if (s.ok())
        s = tpcp.Backward(ops, sp::TpspViewOf(tp_w), cache, dy_local.data(), dx_local.data(),
                          sp::TpspViewOf(&tp_g));
      *cache_bytes = CacheBytes(cache);
    }
    return s;
  };

  RankMeasure measure;
  if (int rc = MeasureRank(rank, wf.reps, comms, step, &measure); rc != 0) return rc;
  return WriteRankLine(rank, out_dir, param_bytes, measure);
}

// ---- Driver. ----
struct Result {
  bool ok = false;
  int D = 0;
  int64_t T = 0;
  std::string scheme;
  int64_t params_max = 0, cache_max = 0, peak_act_max = 0, total_max = 0;  // max over ranks
  double sent_mean = 0, recv_mean = 0, predicted = 0;
  int64_t sent_min = -1, sent_max = 0;  // per-rank spread of the bytes sent
  double best_s = 0;  // best repetition of the slowest rank
  double tokens_per_s() const { return best_s > 0 ? kB * T / best_s : 0; }
};

std::string SchemeLabel(const std::string& scheme, int D) {
  if (scheme == "tsp") return "TSP";
  if (scheme == "tpsp") return "TP+SP";
  return absl::StrCat("TPxCP(", TpDegree(D), "x", D / TpDegree(D), ")");
}

Result RunConfig(const std::string& self, const std::string& scheme, int D, int64_t T,
                 int64_t reps) {
  Result r;
  r.D = D;
  r.T = T;
  r.scheme = scheme;
  const int t = TpDegree(D);
  r.predicted = scheme == "tsp"    ? PredictTsp(D, T)
                : scheme == "tpsp" ? PredictTpsp(D, T)
                                   : PredictTpcp(t, D / t, T);
  char tmpl[] = "/tmp/tsp_bench.XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    std::fprintf(stderr, "mkdtemp failed\n");
    return r;
  }
  const std::string dir = tmpl;
  sp::LaunchOptions o;
  o.nproc = D;
  o.argv = {self, "--worker_scheme=" + scheme, absl::StrCat("--worker_T=", T),
            absl::StrCat("--reps=", reps)};
  o.store = sp::LaunchOptions::Store::kFile;
  o.timeout = std::chrono::seconds(300);
  o.env = {{kOutEnv, dir},
           {"STALLFREE_COMM_TIMEOUT_MS", "60000"},
           {"OPENBLAS_NUM_THREADS", "1"},
           {"OMP_NUM_THREADS", "1"}};
  auto launched = sp::LaunchLocal(o);
  if (!launched.ok() || !launched->ok()) {
    std::fprintf(stderr, "%s D=%d T=%lld failed: %s\n", scheme.c_str(), D,
                 static_cast<long long>(T),
                 launched.ok() ? absl::StrCat("rank ", launched->first_failed_rank).c_str()
                               : launched.status().ToString().c_str());
    std::filesystem::remove_all(dir);
    return r;
  }
  std::vector<double> slowest(static_cast<size_t>(reps), 0.0);
  bool ok = true;
  for (int q = 0; q < D && ok; ++q) {
    std::ifstream in(absl::StrCat(dir, "/rank", q, ".txt"));
    int rank = -1;
    int64_t params = 0, cache = 0, peak = 0, sent = 0, recv = 0;
    in >> rank >> params >> cache >> peak >> sent >> recv;
    for (int64_t i = 0; i < reps; ++i) {
      double s = 0;
      in >> s;
      slowest[i] = std::max(slowest[i], s);
    }
    ok = static_cast<bool>(in) && rank == q;
    r.params_max = std::max(r.params_max, params);
    r.cache_max = std::max(r.cache_max, cache);
    r.peak_act_max = std::max(r.peak_act_max, peak);
    r.total_max = std::max(r.total_max, params + peak);
    r.sent_mean += static_cast<double>(sent) / D;
    r.sent_min = r.sent_min < 0 ? sent : std::min(r.sent_min, sent);
    r.sent_max = std::max(r.sent_max, sent);
    r.recv_mean += static_cast<double>(recv) / D;
  }
  std::filesystem::remove_all(dir);
  if (!ok) {
    std::fprintf(stderr, "%s D=%d T=%lld: bad rank output\n", scheme.c_str(), D,
                 static_cast<long long>(T));
    return r;
  }
  r.best_s = *std::min_element(slowest.begin(), slowest.end());
  r.ok = true;
  return r;
}

double MiB(double b) { return b / (1024.0 * 1024.0); }

std::vector<int64_t> ParseList(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, ',')) {
    char* end = nullptr;
    const long long v = std::strtoll(part.c_str(), &end, 10);
    if (!part.empty() && *end == '\0' && v > 0) out.push_back(v);
  }
  return out;
}

int RunDriver(bool quick, int64_t reps, const std::string& seqs, const std::string& ds) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) {
    std::fprintf(stderr, "cannot read /proc/self/exe\n");
    return 1;
  }
  self[n] = '\0';
  const char* default_seqs = quick ? "128,256" : "256,512,1024,4096";
  std::vector<int64_t> Ts = ParseList(seqs.empty() ? default_seqs : seqs);
  const std::vector<int64_t> Ds = ParseList(ds);
  if (reps <= 0) reps = quick ? 2 : 3;
  if (Ts.empty() || Ds.empty()) {
    std::fprintf(stderr, "empty --seqs or --ds\n");
    return 2;
  }
  const std::vector<std::string> schemes = {"tsp", "tpsp", "tpcp"};
  std::printf("tsp_bench: one block C=%lld H=%lld FF=%lld B=%lld, fp32, CpuOps + Gloo (loopback), "
              "%lld timed reps after 1 warm-up\n",
              static_cast<long long>(kC), static_cast<long long>(kH), static_cast<long long>(kFF),
              static_cast<long long>(kB), static_cast<long long>(reps));
  std::printf("memory: params = own shard; cache = forward cache (counted from its vectors); "
              "peak act = peak live heap during fwd+bwd above the level before it (operator new "
              "hook: cache + transient buffers), transnt = peak act - cache; total = params + "
              "peak act; each the max over ranks\n");
  std::printf("comm: bytes sent per rank per layer, fwd+bwd, mean over ranks, from the "
              "communicator counters; pred = closed form of that mean\n");
  std::printf("caveat: the D ranks share this machine's %ld cores (1 BLAS thread each), so "
              "tokens/s measure CPU contention, not the interconnect\n\n",
              sysconf(_SC_NPROCESSORS_ONLN));
  std::map<std::string, Result> results;  // key: scheme/D/T
  auto key = [](const std::string& s, int D, int64_t T) { return absl::StrCat(s, "/", D, "/", T); };
  int failures = 0;
  for (int64_t D64 : Ds) {
    const int D = static_cast<int>(D64);
    for (int64_t T : Ts) {
      std::printf("D=%d T=%lld\n", D, static_cast<long long>(T));
      std::printf("  %-13s %8s %8s %9s %9s %8s %11s %11s %11s %7s %9s\n", "scheme", "params",
                  "cache", "transnt", "peak act", "total", "sent/layer", "recv/layer",
                  "predicted", "meas/pr", "tokens/s");
      std::printf("  %-13s %8s %8s %9s %9s %8s %11s %11s %11s %7s %9s\n", "", "MiB", "MiB", "MiB",
                  "MiB", "MiB", "MiB", "MiB", "MiB", "", "");
      for (const std::string& scheme : schemes) {
        const Result r = RunConfig(self, scheme, D, T, reps);
        if (!r.ok) {
          ++failures;
          std::printf("  %-13s FAILED\n", SchemeLabel(scheme, D).c_str());
          continue;
        }
        results[key(scheme, D, T)] = r;
        std::printf("  %-13s %8.3f %8.3f %9.3f %9.3f %8.3f %11.3f %11.3f %11.3f %7.3f %9.0f\n",
                    SchemeLabel(scheme, D).c_str(), MiB(r.params_max), MiB(r.cache_max),
                    MiB(r.peak_act_max - r.cache_max), MiB(r.peak_act_max), MiB(r.total_max),
                    MiB(r.sent_mean), MiB(r.recv_mean), MiB(r.predicted),
                    r.sent_mean / r.predicted, r.tokens_per_s());
        if (r.sent_min != r.sent_max) {
          std::printf("  %-13s (per-rank bytes sent range from %.3f to %.3f MiB)\n", "",
                      MiB(static_cast<double>(r.sent_min)), MiB(static_cast<double>(r.sent_max)));
        }
        std::fflush(stdout);
      }
      std::printf("\n");
    }
  }
  // Figures at the longest T for each D.
  const int64_t Tmax = *std::max_element(Ts.begin(), Ts.end());
  for (int64_t D64 : Ds) {
    const int D = static_cast<int>(D64);
    const std::string at = absl::StrCat("_D", D, "_T", Tmax);
    for (const std::string& scheme : schemes) {
      auto it = results.find(key(scheme, D, Tmax));
      if (it == results.end()) continue;
      const Result& r = it->second;
      std::printf("FIGURE %s_tokens_per_s%s %.0f tokens/s\n", scheme.c_str(), at.c_str(),
                  r.tokens_per_s());
      std::printf("FIGURE %s_peak_memory_per_rank%s %.3f MiB\n", scheme.c_str(), at.c_str(),
                  MiB(r.total_max));
      std::printf("FIGURE %s_comm_bytes_per_layer%s %.0f bytes\n", scheme.c_str(), at.c_str(),
                  r.sent_mean);
      std::printf("FIGURE %s_comm_measured_over_predicted%s %.4f ratio\n", scheme.c_str(),
                  at.c_str(), r.sent_mean / r.predicted);
    }
    auto tsp = results.find(key("tsp", D, Tmax));
    if (tsp == results.end()) continue;
    const Result* best = nullptr;     // the lowest peak memory per rank
    const Result* fastest = nullptr;  // the most tokens/s
    for (const char* scheme : {"tpsp", "tpcp"}) {
      auto it = results.find(key(scheme, D, Tmax));
      if (it == results.end()) continue;
      const double ratio =
          static_cast<double>(tsp->second.total_max) / static_cast<double>(it->second.total_max);
      std::printf("FIGURE tsp_vs_%s_only_peak_memory_D%d %.3f x\n", scheme, D, ratio);
      if (best == nullptr || it->second.total_max < best->total_max) best = &it->second;
      if (fastest == nullptr || it->second.tokens_per_s() > fastest->tokens_per_s()) {
        fastest = &it->second;
      }
    }
    if (best != nullptr) {
      // Over the best (lowest-memory) baseline, as named in the brief.
      std::printf("FIGURE tsp_vs_tpsp_peak_memory_D%d %.3f x\n", D,
                  static_cast<double>(tsp->second.total_max) /
                      static_cast<double>(best->total_max));
      std::printf("FIGURE tsp_vs_fastest_baseline_tokens_per_s_D%d %.3f x\n", D,
                  tsp->second.tokens_per_s() / fastest->tokens_per_s());
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace stallfree

int main(int argc, char** argv) {
  bool quick = false;
  int64_t reps = 0;
  std::string seqs, ds = "2,4";
  stallfree::WorkerFlags wf;
  stallfree::FlagSet flags(
      "tsp_bench",
      "TSP vs TP+SP vs TP x CP on one block (C=256, H=8, FF=1024, B=1, fp32, CPU): per-rank "
      "memory, communication per layer against the closed forms, tokens/s. Launches itself as "
      "D local ranks per configuration.");
  flags.AddBool("quick", &quick, "T in {128, 256}, 2 reps (finishes within 60 s)");
  flags.AddInt("reps", &reps, "timed repetitions after one warm-up (0: 3, or 2 with --quick)");
  flags.AddString("seqs", &seqs, "comma-separated sequence lengths (empty: 256,512,1024,4096)");
  flags.AddString("ds", &ds, "comma-separated group sizes D");
  flags.AddString("worker_scheme", &wf.scheme, "internal: tsp | tpsp | tpcp (worker ranks)");
  flags.AddInt("worker_T", &wf.T, "internal: sequence length (worker ranks)");
  if (int code = flags.ParseCommandLine(argc, argv); code >= 0) return code;
  if (std::getenv("RANK") != nullptr) {
    wf.reps = reps > 0 ? reps : 3;
    if (wf.scheme != "tsp" && wf.scheme != "tpsp" && wf.scheme != "tpcp") {
      std::fprintf(stderr, "tsp_bench worker: bad --worker_scheme '%s'\n", wf.scheme.c_str());
      return 2;
    }
    return stallfree::RunWorker(wf);
  }
  return stallfree::RunDriver(quick, reps, seqs, ds);
}
