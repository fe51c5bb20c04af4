#include "bench/offload_harness.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "testing/binaries.h"

namespace stallfree {
namespace bench {

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / static_cast<double>(v.size());
}

double GiB(double bytes) { return bytes / (1024.0 * 1024.0 * 1024.0); }

uint64_t ProcStatusKb(pid_t pid, const char* field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::strtoull(line.c_str() + strlen(field), nullptr, 10);
  return 0;
}

uint64_t MemAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("MemAvailable:", 0) == 0)
      return std::strtoull(line.c_str() + 13, nullptr, 10) * 1024;
  return 0;
}

void AddEngineFlags(FlagSet* flags, EngineOptions* o) {
  flags->AddString("stallfreed", &o->stallfreed,
                   "the stallfreed binary (default: found beside this one, or in its runfiles)");
  flags->AddInt("seed", &o->seed, "seed of weights, data and modeled gradients");
  flags->AddDouble("ratio", &o->ratio, "zenflow: hot share of each weight's columns");
  flags->AddInt("interval", &o->interval,
                "zenflow: S, steps per daemon update (0: auto, the engine's choice)");
  flags->AddInt("land_lag", &o->land_lag,
                "zenflow: steps after its boundary at which a round's update lands (0: S)");
  flags->AddDouble("weight_decay", &o->weight_decay, "AdamW weight decay");
}

ZenFlowConfig EngineConfig(const EngineOptions& o, OffloadMode mode, int64_t select_interval) {
  ZenFlowConfig c;
  c.mode = mode;
  c.topk_ratio = o.ratio;
  c.update_interval = o.interval;
  c.land_lag = o.land_lag;
  c.select_interval = select_interval;
  c.weight_decay = o.weight_decay;
  c.beta1 = 0.9;
  c.beta2 = 0.95;
  c.grad_dtype = DType::kBf16;
  c.param_dtype = DType::kBf16;
  c.warmup_steps = 0;
  return c;
}

std::unique_ptr<BenchDaemon> StartDaemon(const std::string& stallfreed) {
  testing::SetBinary("server/stallfreed", stallfreed);
  std::unique_ptr<BenchDaemon> d(new BenchDaemon());
  if (!d->daemon_.started()) return nullptr;  // the Daemon said where it looked
  auto client = Client::Connect(d->daemon_.socket());
  if (!client.ok()) {
    fprintf(stderr, "%s\n", client.status().ToString().c_str());
    return nullptr;
  }
  d->client_ = std::move(*client);
  return d;
}

absl::StatusOr<ModeEngine> StartModeEngine(Client* client, const std::string& session_name,
                                           const ZenFlowConfig& cfg,
                                           std::vector<EngineParam> params,
                                           const kernels::OptimizerKernel& kernel,
                                           const kernels::BackendMemory& ops) {
  ModeEngine e;
  if (cfg.mode != OffloadMode::kNoOffload) {
    std::unique_ptr<Session> session;
    ASSIGN_OR_RETURN_CTX(session, client->OpenSession(session_name, 0), "OpenSession");
    e.target = std::make_unique<SessionTarget>(std::move(session));
  }
  ASSIGN_OR_RETURN_CTX(e.engine,
                       ZenFlowEngine::Create(cfg, std::move(params), kernel, ops, e.target.get()),
                       "ZenFlowEngine::Create");
  return e;
}

absl::Status FlushAndClose(ModeEngine* e) {
  RETURN_IF_ERROR_CTX(e->engine->Flush(), "flush");
  e->engine.reset();
  e->target.reset();
  return absl::OkStatus();
}

void StepRecorder::Add(double compute, const StepTimings& tm) {
  compute_.push_back(compute);
  engine_.push_back(tm.total);
  optimizer_.push_back(tm.optimizer);
  copies_.push_back(tm.copies);
  stall_.push_back(tm.stall);
  traffic_.push_back(static_cast<double>(tm.bytes_to_host + tm.bytes_to_device));
}

StepMeans StepRecorder::Means() const {
  StepMeans m;
  m.compute = Mean(compute_);
  m.engine = Mean(engine_);
  m.optimizer = Mean(optimizer_);
  m.copies = Mean(copies_);
  m.stall = Mean(stall_);
  m.traffic = Mean(traffic_);
  m.step = m.compute + m.engine;
  return m;
}

void PrintRunHeader(const char* bench, pid_t daemon_pid, const EngineOptions& o) {
  printf(
      "%s: stallfreed pid %d (--pin off, all cores), %ld CPU cores, %.1f GiB available; "
      "zenflow ratio %.2f, S = %lld; grads and params cross as bf16 in zenflow and "
      "sync-offload\n\n",
      bench, daemon_pid, sysconf(_SC_NPROCESSORS_ONLN),
      GiB(static_cast<double>(MemAvailableBytes())), o.ratio, static_cast<long long>(o.interval));
}

void PrintTarget(const char* what, bool met) {
  printf("target %s: %s\n", what, met ? "met" : "NOT MET");
}

void PrintPeakRssAndWall(pid_t daemon_pid, Clock::time_point start) {
  printf("peak RSS: this process %.2f GiB (VmHWM), the daemon %.2f GiB (VmHWM)\n",
         ProcStatusKb(getpid(), "VmHWM:") / (1024.0 * 1024.0),
         ProcStatusKb(daemon_pid, "VmHWM:") / (1024.0 * 1024.0));
  printf("total wall time %.1f s\n", Since(start));
}

}  // namespace bench
}  // namespace stallfree
