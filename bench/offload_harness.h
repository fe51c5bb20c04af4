// What the two offload benchmarks (offload_quality_bench: small-GPT training on the CPU;
// offload_modeled_bench: a large model on a modeled device) share: the engine options both take,
// a real stallfreed with a connected client, per-step timings averaged over a run, and the
// report's common lines.
//
// Example:
//   EngineOptions eo;
//   FlagSet flags("my_bench", "...");
//   AddEngineFlags(&flags, &eo);
//   ... parse ...
//   auto daemon = StartDaemon(eo.stallfreed);   // nullptr: it printed why
//   PrintRunHeader("my_bench", daemon->pid(), eo);
//   StepRecorder rec;   // per step: rec.Add(compute_seconds, engine->last_timings());
//   StepMeans means = rec.Means();
//
// Not thread safe; one bench thread uses these.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/session_target.h"
#include "common/flags.h"
#include "engine/zenflow.h"
#include "testing/daemon_process.h"

namespace stallfree {
namespace bench {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t);          // seconds
double Mean(const std::vector<double>& v);  // 0 for none
double GiB(double bytes);

// A field of /proc/<pid>/status in kB ("VmRSS:", "VmHWM:"); 0 if absent.
uint64_t ProcStatusKb(pid_t pid, const char* field);
// MemAvailable of /proc/meminfo, in bytes.
uint64_t MemAvailableBytes();

// The three modes, in the order every table and run uses.
inline constexpr OffloadMode kModes[] = {OffloadMode::kNoOffload, OffloadMode::kSyncOffload,
                                         OffloadMode::kZenFlow};

// The options of the engine and the daemon that both benchmarks take (same flag names).
struct EngineOptions {
  std::string stallfreed;  // "" : found beside the benchmark or in its runfiles
  int64_t seed = 1;
  double ratio = 0.1;    // zenflow: hot share of each weight's columns
  int64_t interval = ZenFlowConfig().update_interval;  // zenflow: S (the engine's default; 0: auto)
  int64_t land_lag = ZenFlowConfig().land_lag;  // zenflow: the engine's default
  double weight_decay = 0.01;
};
void AddEngineFlags(FlagSet* flags, EngineOptions* o);

// The engine's configuration for `mode`: bf16 gradients and parameters across, betas
// (0.9, 0.95), no engine warm-up (callers that want one set warmup_steps).
ZenFlowConfig EngineConfig(const EngineOptions& o, OffloadMode mode, int64_t select_interval);

// A stallfreed (--pin off, log level warning) on a private socket, and a client connected to it.
class BenchDaemon {
 public:
  BenchDaemon(const BenchDaemon&) = delete;
  BenchDaemon& operator=(const BenchDaemon&) = delete;
  Client* client() const { return client_.get(); }
  pid_t pid() const { return daemon_.pid(); }

 private:
  friend std::unique_ptr<BenchDaemon> StartDaemon(const std::string& stallfreed);
  BenchDaemon() : daemon_({"--pin", "off"}, "warning") {}
  testing::Daemon daemon_;
  std::unique_ptr<Client> client_;
};
// Starts one (`stallfreed`: the binary, "" to search for it); nullptr after printing why not.
std::unique_ptr<BenchDaemon> StartDaemon(const std::string& stallfreed);

// An engine in one mode and its daemon session (none for no-offload). The engine is declared
// last, so it goes before the session it uses.
struct ModeEngine {
  std::unique_ptr<SessionTarget> target;  // owns the session
  std::unique_ptr<ZenFlowEngine> engine;
};
// Opens the daemon session `session_name` (unless cfg.mode is no-offload) and creates the engine
// over `params` on `kernel` and `ops`; the error says which of the two failed.
absl::StatusOr<ModeEngine> StartModeEngine(Client* client, const std::string& session_name,
                                           const ZenFlowConfig& cfg,
                                           std::vector<EngineParam> params,
                                           const kernels::OptimizerKernel& kernel,
                                           const kernels::BackendMemory& ops);
// Flushes the engine (the pending update lands), then closes it and the session (the daemon
// frees its region and state). The flush's error, with "flush: " before it.
absl::Status FlushAndClose(ModeEngine* e);

// Means over a run's steps, in seconds; traffic in bytes per step (to host + to device).
struct StepMeans {
  double compute = 0, engine = 0, optimizer = 0, copies = 0, stall = 0, traffic = 0;
  double step = 0;  // compute + engine
};
class StepRecorder {
 public:
  // One step: its forward + backward time and the engine's timings of its Step.
  void Add(double compute, const StepTimings& tm);
  StepMeans Means() const;

 private:
  std::vector<double> compute_, engine_, optimizer_, copies_, stall_, traffic_;
};

// "<bench>: stallfreed pid ..., N CPU cores, X GiB available; zenflow ratio, S ..." and a blank
// line.
void PrintRunHeader(const char* bench, pid_t daemon_pid, const EngineOptions& o);
// "target <what>: met" or "NOT MET".
void PrintTarget(const char* what, bool met);
// The peak RSS of this process and of the daemon, and the wall time since `start`.
void PrintPeakRssAndWall(pid_t daemon_pid, Clock::time_point start);

}  // namespace bench
}  // namespace stallfree
