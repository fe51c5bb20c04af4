#include "engine/zenflow.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/bf16.h"
#include "common/log.h"
#include "common/state_format.h"
#include "common/status.h"
#include "engine/blob.h"
#include "engine/schedule.h"

namespace stallfree {
namespace {

using Clock = std::chrono::steady_clock;
using kernels::GradType;
using kernels::OpsBuffer;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Runs tasks in order on one thread; the caller waits for a task by its sequence number. The
// first error sticks: later waits return it.
class CopyThread {
 public:
  CopyThread() : thread_([this] { Run(); }) {}
  ~CopyThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  int64_t Post(std::function<absl::Status()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.emplace_back(++posted_, std::move(task));
    cv_.notify_all();
    return posted_;
  }

  absl::Status WaitFor(int64_t seq) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ >= seq || !error_.ok(); });
    return error_;
  }
  absl::Status WaitAll() {
    int64_t last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last = posted_;
    }
    return WaitFor(last);
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      auto [seq, task] = std::move(queue_.front());
      queue_.pop_front();
      const bool skip = !error_.ok();
      lock.unlock();
      absl::Status st = skip ? absl::OkStatus() : task();
      lock.lock();
      if (!st.ok() && error_.ok()) error_ = st;
      done_ = seq;
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<int64_t, std::function<absl::Status()>>> queue_;
  int64_t posted_ = 0, done_ = 0;
  bool stop_ = false;
  absl::Status error_;
  std::thread thread_;
};

absl::Status Invalid(const std::string& field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

GradType DTypeOf(DType t) { return t == DType::kBf16 ? GradType::kBf16 : GradType::kFp32; }
// Floats that hold n elements of dtype t.
int64_t FloatsFor(int64_t n, DType t) { return t == DType::kBf16 ? (n + 1) / 2 : n; }
// p advanced by `elems` elements of `size` bytes.
const void* Advance(const void* p, int64_t elems, size_t size) {
  return static_cast<const char*>(p) + elems * static_cast<int64_t>(size);
}
// The hot columns' gradient is gathered in row blocks of at most this many elements (zenflow.h,
// "Transfers").
constexpr int64_t kHotBlock = int64_t{1} << 20;

}  // namespace

const char* OffloadModeName(OffloadMode mode) {
  switch (mode) {
    case OffloadMode::kZenFlow: return "zenflow";
    case OffloadMode::kSyncOffload: return "sync-offload";
    case OffloadMode::kNoOffload: return "no-offload";
  }
  return "?";
}

int64_t HotColumnCount(double topk_ratio, int64_t cols) {
  return std::clamp<int64_t>(std::llround(topk_ratio * static_cast<double>(cols)), 1, cols);
}

bool SplitsWeight(double topk_ratio, int64_t cols) {
  return cols - HotColumnCount(topk_ratio, cols) >= kMinColdColumns;
}

bool TransfersAreDirect(Transfers transfers, bool has_copy_stream) {
  return transfers == Transfers::kDirect || (transfers == Transfers::kAuto && !has_copy_stream);
}

DeviceFootprint PlannedFootprint(const std::vector<ParamShape>& params, const ZenFlowConfig& cfg,
                                 bool direct) {
  // Setup's and SetupTransfers' allocations, in bytes (every buffer is whole floats; an index
  // array takes two floats an entry).
  DeviceFootprint f;
  int64_t scratch = 0;  // the hot gradient's row-block scratch, shared by the split weights
  int64_t consts = 0;   // the split weights' per-column constants, two floats a hot column
  bool offloads = false;
  for (const ParamShape& p : params) {
    int64_t numel = 1;
    for (int64_t d : p.shape) numel *= d;
    const int64_t cols = p.shape.back(), rows = cols > 0 ? numel / cols : 0;
    const bool bf16 = p.dtype == DType::kBf16;
    const int64_t esize = bf16 ? 2 : 4;
    f.params += 2 * numel * esize;
    if (cfg.mode == OffloadMode::kSyncOffload) {
      offloads = true;
      const bool straight_grad = p.dtype == cfg.grad_dtype;
      const bool straight_params = p.dtype == cfg.param_dtype;
      if (!straight_grad) f.transfers += 4 * FloatsFor(numel, cfg.grad_dtype);
      if (!straight_params) f.transfers += 4 * FloatsFor(numel, cfg.param_dtype);
      if (bf16 && numel % 2 == 1 && (straight_grad || straight_params)) {
        f.transfers += 4 * 3;
        f.selection += 4 * 2;
      }
      continue;
    }
    const int64_t k = HotColumnCount(cfg.topk_ratio, cols);
    if (cfg.mode != OffloadMode::kZenFlow || p.shape.size() < 2 ||
        !SplitsWeight(cfg.topk_ratio, cols)) {
      f.moments += 4 * 2 * numel;
      if (bf16) f.masters += 4 * numel;
      continue;
    }
    offloads = true;
    if (cfg.stream_gradients) f.params -= numel * esize;  // its gradient is transient
    const int64_t ncold = cols - k;
    f.masters += 4 * rows * k;
    f.moments += 4 * 2 * rows * k;
    f.selection += 4 * (2 * k + 2 * ncold + cols + 2 * k);
    consts += 2 * k;
    if (cfg.stream_gradients) {
      f.transfers += 4 * FloatsFor(rows * k, p.dtype);
    } else {
      const int64_t block = std::min(rows, std::max<int64_t>(1, kHotBlock / k));
      scratch = std::max(scratch, FloatsFor(block * k, p.dtype));
    }
    if (!direct)
      f.transfers += 4 * (FloatsFor(rows * ncold, cfg.grad_dtype) +
                          FloatsFor(rows * ncold, cfg.param_dtype));
  }
  if (offloads) {  // Setup stops before these when nothing is offloaded
    f.selection += 4 * consts;
    f.transfers += 4 * scratch;
  }
  return f;
}

absl::StatusOr<double> TopkForBudget(const std::vector<ParamShape>& params,
                                     const ZenFlowConfig& cfg, bool direct,
                                     double bytes_per_param) {
  if (cfg.mode != OffloadMode::kZenFlow)
    return Invalid("device_budget", absl::StrCat(
        "sizes the hot share of zenflow mode; mode ", OffloadModeName(cfg.mode),
        " has none (leave device_budget unset)"));
  if (!(bytes_per_param > 0) || !std::isfinite(bytes_per_param))
    return Invalid("device_budget", absl::StrCat(bytes_per_param,
                                                 " is not a positive number of bytes"));
  int64_t numel = 0;
  for (const ParamShape& p : params) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    numel += n;
  }
  if (numel == 0) return cfg.topk_ratio;
  const double budget = bytes_per_param * static_cast<double>(numel);
  ZenFlowConfig c = cfg;
  for (int i = 1000; i >= 1; --i) {
    c.topk_ratio = i / 1000.0;
    if (static_cast<double>(PlannedFootprint(params, c, direct).engine()) <= budget)
      return c.topk_ratio;
  }
  const double least = static_cast<double>(PlannedFootprint(params, c, direct).engine()) /
                       static_cast<double>(numel);
  std::string alt;
  if (!direct)
    alt = absl::StrFormat(", or transfers direct (no transfer buffers on the device: %.3f)",
                          static_cast<double>(PlannedFootprint(params, c, true).engine()) /
                              static_cast<double>(numel));
  return Invalid("device_budget", absl::StrFormat(
      "%g bytes a parameter is less than the least this engine takes, %.3f (one hot column a "
      "weight; the 1-D parameters and small weights stay wholly on the device at 8 or 12 bytes "
      "an element%s); give at least that%s",
      bytes_per_param, least, direct ? "" : ", buffered transfers grad + param dtype bytes per "
      "cold element", alt));
}

const char* TransfersName(Transfers t) {
  switch (t) {
    case Transfers::kAuto: return "auto";
    case Transfers::kBuffered: return "buffered";
    case Transfers::kDirect: return "direct";
  }
  return "?";
}

absl::StatusOr<Transfers> ParseTransfers(const std::string& name) {
  for (Transfers t : {Transfers::kAuto, Transfers::kBuffered, Transfers::kDirect})
    if (name == TransfersName(t)) return t;
  return absl::InvalidArgumentError(
      absl::StrCat("'", name, "' is not auto, buffered or direct"));
}

absl::StatusOr<OffloadMode> ParseOffloadMode(const std::string& name) {
  for (OffloadMode m : {OffloadMode::kZenFlow, OffloadMode::kSyncOffload, OffloadMode::kNoOffload})
    if (name == OffloadModeName(m)) return m;
  return absl::InvalidArgumentError(
      absl::StrCat("'", name, "' is not zenflow, sync-offload or no-offload"));
}

namespace {
std::string FieldText(double v) { return absl::StrFormat("%.17g", v); }
std::string FieldText(int64_t v) { return absl::StrCat(v); }
std::string FieldText(bool v) { return v ? "true" : "false"; }
std::string FieldText(DType v) { return DTypeName(v); }
std::string FieldText(OffloadMode v) { return OffloadModeName(v); }
std::string FieldText(Transfers v) { return TransfersName(v); }

absl::Status ParseField(const std::string& s, double* v) {
  if (absl::SimpleAtod(s, v)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("'", s, "' is not a number"));
}
absl::Status ParseField(const std::string& s, int64_t* v) {
  if (absl::SimpleAtoi(s, v)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("'", s, "' is not an integer"));
}
absl::Status ParseField(const std::string& s, bool* v) {
  if (absl::SimpleAtob(s, v)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("'", s, "' is not true or false"));
}
template <typename T>
absl::Status ParseEnum(absl::StatusOr<T> parsed, T* v) {
  if (!parsed.ok()) return parsed.status();
  *v = *parsed;
  return absl::OkStatus();
}
absl::Status ParseField(const std::string& s, DType* v) { return ParseEnum(ParseDType(s), v); }
absl::Status ParseField(const std::string& s, OffloadMode* v) {
  return ParseEnum(ParseOffloadMode(s), v);
}
absl::Status ParseField(const std::string& s, Transfers* v) {
  return ParseEnum(ParseTransfers(s), v);
}
}  // namespace

std::map<std::string, std::string> ConfigFields(const ZenFlowConfig& c) {
  std::map<std::string, std::string> out;
  VisitConfigFields(c, [&](const char* name, const auto& v) { out[name] = FieldText(v); });
  return out;
}

absl::Status SetConfigField(ZenFlowConfig* c, const std::string& name, const std::string& text) {
  absl::Status st = Invalid(name, "not a field of the engine's configuration (engine/zenflow.h)");
  VisitConfigFields(*c, [&](const char* field, auto& v) {
    if (name != field) return;
    st = ParseField(text, &v);
    if (!st.ok()) st = Invalid(name, std::string(st.message()));
  });
  return st;
}

absl::StatusOr<ConfigConflicts> ResumeConflicts(const std::map<std::string, std::string>& saved,
                                                const std::map<std::string, std::string>& now) {
  ZenFlowConfig was, is;
  // The values of the fields added since states were first saved, as those states ran.
  was.land_lag = 0;
  was.max_update_interval = 4;
  was.predict_cold = false;
  for (const auto& [name, text] : saved) RETURN_IF_ERROR(SetConfigField(&was, name, text));
  for (const auto& [name, text] : now) RETURN_IF_ERROR(SetConfigField(&is, name, text));
  const std::map<std::string, std::string> a = ConfigFields(was), b = ConfigFields(is);
  ConfigConflicts out;
  for (const auto& [name, text] : now) {
    if (name == "transfers" || name == "stream_gradients") continue;
    if (a.at(name) == b.at(name)) continue;  // compared as values, reported as given
    const auto given = saved.find(name);
    out[name] = {given != saved.end() ? given->second : a.at(name), text};
  }
  return out;
}

kernels::AdamWConfig ZenFlowConfig::AdamW(double lr, int64_t t) const {
  kernels::AdamWConfig a;
  a.lr = lr;
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.eps = eps;
  a.weight_decay = weight_decay;
  a.step = t;
  return a;
}

absl::Status ZenFlowConfig::Validate() const {
  if (!(topk_ratio > 0.0 && topk_ratio <= 1.0))
    return Invalid("topk_ratio", absl::StrCat(topk_ratio, " is outside (0, 1]"));
  if (update_interval < 0)
    return Invalid("update_interval", absl::StrCat(update_interval, " is not >= 1 (or 0: auto)"));
  if (max_update_interval < 1)
    return Invalid("max_update_interval", absl::StrCat(max_update_interval, " is not >= 1"));
  // The longest round this config may run: S, or the automatic round's bound.
  const int64_t longest = update_interval == 0 ? max_update_interval : update_interval;
  if (update_interval == 0 && select_interval != 0)
    return Invalid("select_interval",
                   absl::StrCat(select_interval, ": with update_interval auto (0) the rounds "
                                "change length, and reselection is every 4 of them: leave it 0"));
  if (select_interval < 0 || (update_interval > 0 && select_interval % update_interval != 0))
    return Invalid("select_interval",
                   absl::StrCat(select_interval, " is not a positive multiple of update_interval ",
                                update_interval, " (or 0 for 4 x update_interval)"));
  if (warmup_steps < 0) return Invalid("warmup_steps", absl::StrCat(warmup_steps, " is negative"));
  if (land_lag < 0 || land_lag > longest)
    return Invalid("land_lag", absl::StrCat(land_lag, " is outside [0, ",
                                            update_interval == 0 ? "max_update_interval "
                                                                 : "update_interval ",
                                            longest, "] (0: the round's length)"));
  if (!(beta1 >= 0.0 && beta1 < 1.0)) return Invalid("beta1", "must be in [0, 1)");
  if (!(beta2 >= 0.0 && beta2 < 1.0)) return Invalid("beta2", "must be in [0, 1)");
  // eps >= 0, as torch.optim.AdamW takes it; finite, for the kernels' arithmetic.
  if (!(eps >= 0.0) || !std::isfinite(eps)) return Invalid("eps", "must be finite and >= 0");
  if (!(weight_decay >= 0.0) || !std::isfinite(weight_decay))
    return Invalid("weight_decay", "must be finite and >= 0");
  return absl::OkStatus();
}

// One parameter's engine state.
struct PState {
  // The values of the checkpoint blob's kinds (engine/blob.h).
  enum Kind {
    kDevice = kBlobDevice,        // wholly on the device: plain AdamW with m, v, dstep
    kSplit = kBlobSplit,          // zenflow: hot columns on the device, cold columns in the daemon
    kOffloaded = kBlobOffloaded,  // sync-offload: wholly in the daemon
  };
  EngineParam p;
  Kind kind = kDevice;
  bool bf16 = false;  // p.dtype is BF16: value and gradient are bf16, fp32 masters (see zenflow.h)
  int64_t rows = 1, cols = 1, numel = 0;
  int64_t k = 0, ncold = 0;
  // kDevice. A bf16 parameter's fp32 master (empty for fp32: the value is the master), valid
  // once master_ready (the first Step widens the value, Restore reads it from the blob).
  OpsBuffer m, v, master;
  bool master_ready = false;
  int64_t dstep = 0;
  // kSplit: hot_idx[i] is the column at hot position i, cold_idx[j] the column at the daemon's
  // compact position j; hot_steps[i] the hot column's AdamW step count.
  std::vector<int64_t> hot_idx, cold_idx, hot_steps;
  OpsBuffer hot_master, hot_m, hot_v;
  // stream_gradients: the hot columns' gradient (the parameter's dtype), gathered by
  // StageGradient (or by Step from an unstaged gradient); staged: the next Step's gradient is
  // here and in the slot (or the send buffer), whatever p.grad says.
  OpsBuffer hot_grad;
  bool staged = false;
  int64_t consts_at = 0;  // its hot columns' AdamW constants in Impl::hot_consts: ss, then bc2
  OpsBuffer hot_idx_dev, cold_idx_dev, scores, topk_dev;  // int64 arrays as 2 floats each
  // kSplit and kOffloaded: the device buffers of buffered transfers (zenflow.h, "Transfers"),
  // each only where Setup needs it: send, the gradient as it crosses (grad_dtype: a buffered
  // split weight's gathered cold columns, a whole parameter converted); back, the parameters as
  // they come back (param_dtype), before the scatter or conversion into the value.
  OpsBuffer send, back;
  // Direct transfers (kSplit): the backend's views of the session's gradient slots and
  // parameter slots for this parameter (host memory).
  void* grad_view[2] = {nullptr, nullptr};
  const void* param_view[2] = {nullptr, nullptr};
  // A bf16 kOffloaded parameter of odd size crosses straight from and into the caller's
  // buffers (no copy) in whole floats, but its last element alone, through tail (floats 0, 1:
  // the gradient of slot 0, 1; float 2: the parameter back) and tail_idx (= numel - 1): a float
  // copy of it would touch 2 bytes past the caller's buffer.
  OpsBuffer tail, tail_idx;
  // kSplit and kOffloaded: steps of the current round in which the parameter had a gradient
  // (SetBuffers with a null gradient: none); a round without any skips the daemon's update.
  int64_t round_grads = 0;

  int64_t offload_numel() const { return kind == kSplit ? rows * ncold : numel; }
  // The shape the daemon's session registers for it (not kDevice): a split weight's cold
  // columns [rows, ncold], an offloaded parameter whole.
  std::vector<int64_t> offload_shape() const {
    return kind == kSplit ? std::vector<int64_t>{rows, ncold} : p.shape;
  }
  // A split weight of a stream_gradients engine (its hot_grad is allocated at Setup).
  bool streamed() const { return kind == kSplit && !hot_grad.empty(); }
  // Whether the parameter has a gradient in the coming Step (a share of no element always has
  // its empty one: every rank of a partition then steps and scores alike).
  bool has_grad() const { return staged || p.grad != nullptr || numel == 0; }
  kernels::GradType gtype() const { return bf16 ? GradType::kBf16 : GradType::kFp32; }
  size_t esize() const { return bf16 ? 2 : 4; }
  float* value32() const { return static_cast<float*>(p.value); }
  uint16_t* value16() const { return static_cast<uint16_t*>(p.value); }
  const float* grad32() const { return static_cast<const float*>(p.grad); }
  const uint16_t* grad16() const { return static_cast<const uint16_t*>(p.grad); }
  // A whole kOffloaded parameter's gradient and parameters cross straight from / into its
  // buffers when they cross in its dtype.
  bool straight_grad(DType grad_dtype) const {
    return kind == kOffloaded && p.dtype == grad_dtype;
  }
  bool straight_params(DType param_dtype) const {
    return kind == kOffloaded && p.dtype == param_dtype;
  }
  // The bytes of the buffers this parameter's state owns, by DeviceFootprint category.
  void AddFootprint(DeviceFootprint* f) const {
    auto b = [](const OpsBuffer& x) { return x.size() * 4; };
    f->masters += b(master) + b(hot_master);
    f->moments += b(m) + b(v) + b(hot_m) + b(hot_v);
    f->transfers += b(send) + b(back) + b(tail) + b(hot_grad);
    f->selection += b(hot_idx_dev) + b(cold_idx_dev) + b(scores) + b(topk_dev) + b(tail_idx);
    f->params += (streamed() ? 1 : 2) * numel * static_cast<int64_t>(esize());
  }
};

struct ZenFlowEngine::Impl {
  ZenFlowConfig cfg;
  const kernels::OptimizerKernel& k;
  const kernels::BackendMemory& ops;
  OffloadTarget* target;
  std::vector<PState> params;
  std::map<std::string, size_t> index;
  ScoreReduce reduce;

  int64_t step = 0;
  StepTimings last;
  bool loaded = false;
  absl::Status failure;
  // Transfers (zenflow.h): direct for every split weight, or buffered for every one.
  bool direct = false;
  // The hot columns' gradient, one row block of one weight at a time (kHotBlock).
  OpsBuffer hot_scratch;
  // Direct: the backend's view of the staging area (the initial load gathers into it).
  float* staging_view = nullptr;
  int64_t send_task = 0;          // copy-thread task that last downloaded the send buffers
  // StageGradient: the step whose gradients are being staged (0: none), so the waits for the
  // send buffers and the slot are done once; what the staging moved and took, for that Step's
  // timings.
  int64_t staging_for = 0;
  StepTimings staged_tm;
  int64_t slot_task[2] = {0, 0};  // copy-thread task that last pushed each gradient slot
  // The version of the Update that last pushed each gradient slot (fused push; 0: none): the
  // daemon reads the slot until that Update is done.
  int64_t slot_update[2] = {0, 0};
  int64_t pending_version = 0;    // Update issued, parameters not yet scattered
  bool pending_predicted = false;  // its parameters are predicted (predict_cold: zenflow.h)
  // The parameter slot that Update writes. Read from it, not from the slot WaitUpdate names:
  // WaitUpdate answers with the newest version, which may already be the next round's.
  uint32_t pending_pslot = 0;
  // The session's parameter slots: 1 when the engine registered it (every Update's parameters
  // are read out of the slot before the next Update is issued: see DoStep), 2 for a session
  // registered with two by someone else (the rounds alternate).
  uint32_t param_slots = 1;
  int64_t pending_task = 0;
  // The copy-thread task that waits for Update `prefetched_version` and uploads its parameters
  // into the split weights' cold buffers ahead of the boundary that lands them (0: none).
  int64_t prefetch_task = 0;
  int64_t prefetched_version = 0;
  int64_t rounds = 0;
  // The automatic round (schedule.h): the figures since its last choice (the caller's compute
  // of each step: the time from one Step's start to the next's, less the first one's stall;
  // the stall of each step not awaited; the daemon's seconds per Update seen), and the floor
  // its stalls set.
  struct Pace {
    std::vector<double> compute;
    double stall = 0, update = 0;
    int64_t stalled_steps = 0, updates = 0;
  } pace;
  Clock::time_point prev_start{};
  double prev_stall = 0;
  bool have_prev = false;
  int64_t seen_update = 0;  // the newest Update version counted in pace
  int64_t interval_floor = 1;
  // The largest sum of transient buffers one call has held (DeviceFootprint::transient_peak).
  int64_t transient_peak = 0;
  void NoteTransient(int64_t bytes) { transient_peak = std::max(transient_peak, bytes); }
  std::unique_ptr<CopyThread> copier;
  // Every split weight's per-column AdamW constants of a step (step size, sqrt of the second
  // bias correction), made on the host and uploaded in one copy.
  std::vector<float> hot_consts_host;
  OpsBuffer hot_consts;
  // The copy thread's backend: ops on a stream of its own where the backend has one (CUDA), so
  // its copies overlap the caller's compute; else ops itself.
  std::unique_ptr<kernels::BackendMemory> copy_stream;
  const kernels::BackendMemory& CopyOps() const { return copy_stream ? *copy_stream : ops; }
  absl::Status CopySync(const char* what) const {
    std::string err = CopyOps().Synchronize();
    if (!err.empty()) return absl::InternalError(absl::StrCat(what, ": ", err));
    return absl::OkStatus();
  }

  Impl(const ZenFlowConfig& c, const kernels::OptimizerKernel& kk,
       const kernels::BackendMemory& o, OffloadTarget* s)
      : cfg(c), k(kk), ops(o), target(s), sched(c, /*offloading=*/false) {}

  // Whether any state lives in the daemon: not in no-offload mode, nor in zenflow when every
  // parameter stays on the device (1-D ones, weights with fewer than 4 cold columns).
  bool offloading() const { return copier != nullptr; }
  // The step kinds (engine/schedule.h); offloading from when Setup makes the copy thread.
  Schedule sched;
  // Whether the daemon holds state of this engine: what Checkpoint writes there and Restore
  // reads back.
  bool daemon_has_state() const { return offloading() && loaded; }

  absl::Status Sync(const char* what) {
    RETURN_IF_ERROR(Allocated(what));
    std::string err = ops.Synchronize();
    if (err.empty()) err = k.Synchronize();
    if (!err.empty()) return absl::InternalError(absl::StrCat(what, ": ", err));
    return absl::OkStatus();
  }

  // Backend memory of n floats. A failed allocation (null) is counted, and the next Sync or
  // Allocated() reports it as RESOURCE_EXHAUSTED naming the bytes.
  OpsBuffer Alloc(int64_t n) {
    OpsBuffer b(&ops, n);
    if (n > 0 && b.data() == nullptr) {
      alloc_failed_bytes += 4 * n;
      ++alloc_failures;
    }
    return b;
  }
  int64_t alloc_failed_bytes = 0, alloc_failures = 0;
  absl::Status Allocated(const char* what) {
    if (alloc_failures == 0) return absl::OkStatus();
    std::string err = ops.Synchronize();
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": the ", ops.name(), " backend could not allocate ", alloc_failed_bytes,
        " bytes (", alloc_failures, " buffer", alloc_failures == 1 ? "" : "s", ")",
        err.empty() ? "" : " (" + err + ")",
        "; free device memory, or keep less on the device (a lower topk_ratio)"));
  }
  OpsBuffer Ints(int64_t n) { return Alloc(2 * n); }
  static int64_t* AsInts(const OpsBuffer& b) { return reinterpret_cast<int64_t*>(b.data()); }
  void UploadInts(const OpsBuffer& dst, const std::vector<int64_t>& src) {
    ops.Upload(dst.data(), reinterpret_cast<const float*>(src.data()),
               2 * static_cast<int64_t>(src.size()));
  }

  absl::Status Setup();
  // After the registration: direct or buffered transfers, and their views or buffers.
  absl::Status SetupTransfers();
  static int64_t HotBlockRows(const PState& ps) {
    return std::min(ps.rows, std::max<int64_t>(1, kHotBlock / std::max<int64_t>(ps.k, 1)));
  }
  absl::Status LoadDaemon();
  absl::Status SelectInitial(PState& ps, StepTimings* tm);
  // Enqueues the scores and top-k of ps's gradient and their download into *hot (valid after a
  // Sync).
  absl::Status EnqueueTopColumns(PState& ps, std::vector<int64_t>* hot);
  // slot: the gradient slot this step's cold gradients were gathered into.
  absl::Status Reselect(const kernels::AdamWConfig& adam, float scale, uint32_t slot,
                        StepTimings* tm);
  // A reselection's moves of one split weight, and one handover call's share of them.
  struct Move {
    PState* ps;
    std::vector<int64_t> hot, leaving, entering;  // hot positions leaving, compact positions
    size_t done = 0;                               // entering, paired in order
  };
  struct Batch {
    Move* mv;
    int64_t n = 0;
    uint64_t staging_at = 0;  // floats into the staging area
    std::vector<int64_t> pos, cols, steps;
    OpsBuffer pos_dev, cols_dev, tmp, grad, ss, bc2;
  };
  absl::Status ChooseMoves(std::vector<Move>* moves, StepTimings* tm);
  absl::Status StageHandOver(std::vector<Move>* moves, uint32_t slot, std::vector<Batch>* batches,
                             std::vector<OffloadTarget::ColumnMove>* request);
  absl::Status TakeEnteringColumns(const kernels::AdamWConfig& adam, float scale,
                                   const OffloadTarget::HandOver& got,
                                   std::vector<Batch>* batches, StepTimings* tm);
  absl::Status ApplyPendingUpdate(StepTimings* tm);
  // The parameters of slot `slot` into ps's values (uploaded: already in ps's cold buffers).
  absl::Status ScatterParams(PState& ps, uint32_t slot, bool uploaded, StepTimings* tm);
  void UploadParams(const kernels::BackendMemory& on, PState& ps, uint32_t slot);
  // One Step, as the algorithm's steps (zenflow.h): plan the step, update the device's share,
  // gather the cold gradients, reselect at a selection boundary, prepare the round's Update at
  // a boundary, post the pushes (and the Update), land the previous round, prefetch the next.
  absl::Status DoStep(double lr, float split_grad_scale);
  struct StepPlan {
    int64_t t = 0;
    double lr = 0;
    // 1/S: the daemon accumulates the round's mean gradient (times split_scale: every pushed
    // gradient, and an entering column's step gradient, is a split weight's).
    float scale = 1;
    float split_scale = 1;  // Step's split_grad_scale
    bool await = false, boundary = false, reselect = false;
    uint32_t slot = 0;  // this step's gradient slot
    kernels::AdamWConfig adam;
  };
  struct RoundUpdate {  // a boundary's Update
    OffloadTarget::AdamW hyper;
    uint32_t pslot = 0;
    std::vector<std::string> skip;
  };
  StepPlan Plan(double lr, float split_grad_scale);
  // The automatic round: each step's figures into pace, and at the end of a Decides step the
  // length of the rounds that follow, from them (summed over the replicas through `reduce`).
  absl::Status ChooseInterval(const StepPlan& plan);
  void MeasurePace(const StepPlan& plan, Clock::time_point start, const StepTimings& tm);
  absl::Status UpdateDeviceShare(const StepPlan& plan, StepTimings* tm);
  void UpdateHotColumns(PState& ps, const kernels::AdamWConfig& adam);
  absl::Status GatherColdGradients(const StepPlan& plan, std::vector<char>* present,
                                   StepTimings* tm);
  absl::Status PrepareRound(const StepPlan& plan, RoundUpdate* round, StepTimings* tm);
  void PostPushes(const StepPlan& plan, const std::vector<char>& present,
                  const RoundUpdate& round);
  void PrefetchForLanding(const StepPlan& plan);
  absl::Status StageGradient(PState& ps, const void* grad);
  // Restore: whether a parsed blob is this engine's (nothing changes), and one parameter's
  // state from it.
  absl::Status CheckBlob(const EngineBlob& blob) const;
  // A split weight's cold columns in the pending Update's parameter slot, as floats, when that
  // Update is predicted (empty otherwise): what its landing will show. And such values back
  // into parameter slot 0 (after a Restore).
  std::vector<float> PendingShown(const PState& ps) const;
  void ShowPending(const PState& ps, const std::vector<float>& shown);
  void ApplyBlobParam(PState& ps, const EngineBlobParam& bp, bool selected);
  // The step's kind (see zenflow.h): warm-up, a round boundary, a reselection.
  // Whether step t lands the pending Update (Schedule::Landing of its boundary).
  bool LandsPending(int64_t t) const {
    return pending_version > 0 && t == sched.Landing(pending_version);
  }
  // Before step t's cold gradients are written: the send buffers once the previous step's
  // download from them is done; direct, the gradient slot once the daemon is done with it (the
  // push that last wrote it, and a fused Update that reads it).
  absl::Status WaitToSend(int64_t t, StepTimings* tm);
};

absl::Status ZenFlowEngine::Impl::Setup() {
  std::vector<OffloadTarget::Param> specs;
  for (PState& ps : params) {
    ps.bf16 = ps.p.dtype == DType::kBf16;
    ps.numel = 1;
    for (int64_t d : ps.p.shape) ps.numel *= d;
    ps.cols = ps.p.shape.back();
    ps.rows = ps.cols > 0 ? ps.numel / ps.cols : 0;  // a 1-D share of no element: no rows
    if (cfg.mode == OffloadMode::kSyncOffload) {
      ps.kind = PState::kOffloaded;
    } else if (cfg.mode == OffloadMode::kZenFlow && ps.p.shape.size() >= 2) {
      ps.k = HotColumnCount(cfg.topk_ratio, ps.cols);
      ps.ncold = ps.cols - ps.k;
      ps.kind = SplitsWeight(cfg.topk_ratio, ps.cols) ? PState::kSplit : PState::kDevice;
    } else {
      ps.kind = PState::kDevice;
    }
    switch (ps.kind) {
      case PState::kDevice:
        ps.m = Alloc(ps.numel);
        ps.v = Alloc(ps.numel);
        if (ps.bf16) ps.master = Alloc(ps.numel);
        break;
      case PState::kSplit:
        ps.hot_master = Alloc(ps.rows * ps.k);
        ps.hot_m = Alloc(ps.rows * ps.k);
        ps.hot_v = Alloc(ps.rows * ps.k);
        ps.consts_at = static_cast<int64_t>(hot_consts_host.size());
        hot_consts_host.resize(hot_consts_host.size() + 2 * ps.k);
        ps.hot_idx_dev = Ints(ps.k);
        ps.cold_idx_dev = Ints(ps.ncold);
        ps.scores = Alloc(ps.cols);
        ps.topk_dev = Ints(ps.k);
        break;
      case PState::kOffloaded:
        break;
    }
    if (ps.kind != PState::kDevice) {
      OffloadTarget::Param spec;
      spec.name = ps.p.name;
      spec.shape = ps.offload_shape();
      spec.grad_dtype = cfg.grad_dtype;
      specs.push_back(std::move(spec));
    }
  }
  RETURN_IF_ERROR(Sync("allocating the engine's buffers"));
  if (cfg.mode == OffloadMode::kNoOffload || specs.empty()) return absl::OkStatus();
  if (target->registered_params() == 0) {
    // The parameter slots hold what crosses (param_dtype), and one suffices: the engine reads
    // each Update's parameters before it issues the next (DoStep).
    RETURN_IF_ERROR(target->Register(specs, cfg.param_dtype, /*param_slots=*/1));
  } else {
    if (target->param_dtype() == DType::kBf16 && cfg.param_dtype != DType::kBf16)
      return absl::FailedPreconditionError(
          "param_dtype: FP32, but the daemon session was registered with BF16 parameter slots");
    for (size_t i = 0; i < specs.size(); ++i) {
      int64_t numel = 1;
      for (int64_t d : specs[i].shape) numel *= d;
      absl::StatusOr<int64_t> registered = target->ParamNumel(specs[i].name);
      if (!registered.ok() || *registered != numel)
        return absl::FailedPreconditionError(absl::StrCat(
            "params: the daemon session has no parameter '", specs[i].name, "' of ", numel,
            " elements (the engine offloads it with that size); register the session's "
            "parameters through the engine"));
    }
  }
  param_slots = std::max<uint32_t>(1, target->param_slots());
  hot_consts = Alloc(static_cast<int64_t>(hot_consts_host.size()));
  std::string why;
  copy_stream = ops.NewCopyStream(&why);
  if (copy_stream == nullptr && !why.empty())
    SF_LOG(kWarning, "zenflow: no copy stream (%s); copies share the compute stream", why);
  RETURN_IF_ERROR(SetupTransfers());
  copier = std::make_unique<CopyThread>();
  // The copy thread's first task: the backend's device current there (a new thread starts on
  // device 0, not the device of the caller's stream).
  copier->Post([this]() -> absl::Status {
    const std::string why = CopyOps().BindDevice();
    if (why.empty()) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("the copy thread cannot use the ", ops.name(),
                                            " backend's device: ", why));
  });
  sched = Schedule(cfg, /*offloading=*/true);
  return absl::OkStatus();
}

absl::Status ZenFlowEngine::Impl::SetupTransfers() {
  // Direct where asked, or (auto) where there is no copy stream to overlap buffered copies with
  // compute; then only if the backend addresses every slot of every split weight.
  direct = cfg.transfers == Transfers::kDirect ||
           (cfg.transfers == Transfers::kAuto && copy_stream == nullptr);
  int64_t scratch = 0;
  for (PState& ps : params) {
    if (ps.kind != PState::kSplit) continue;
    if (cfg.stream_gradients)
      ps.hot_grad = Alloc(FloatsFor(ps.rows * ps.k, ps.p.dtype));
    else
      scratch = std::max(scratch, FloatsFor(HotBlockRows(ps) * ps.k, ps.p.dtype));
    for (uint32_t s = 0; direct && s < 2; ++s) {
      std::string why;
      ps.grad_view[s] = ops.HostView(target->GradSlot(s, ps.p.name), &why);
      if (s < param_slots && ps.grad_view[s] != nullptr) {
        const void* slot = target->ParamSlot(s, ps.p.name, cfg.param_dtype);
        ps.param_view[s] = ops.HostView(const_cast<void*>(slot), &why);
      }
      if (ps.grad_view[s] != nullptr && (s >= param_slots || ps.param_view[s] != nullptr))
        continue;
      if (cfg.transfers == Transfers::kDirect)
        return absl::FailedPreconditionError(absl::StrCat(
            "transfers: direct, but the ", ops.name(), " backend cannot address the daemon's "
            "slots of '", ps.p.name, "' (", why, "); use transfers buffered"));
      SF_LOG(kWarning, "zenflow: buffered transfers: the %s backend cannot address the daemon's "
             "slots (%s)", ops.name(), why);
      direct = false;
    }
  }
  hot_scratch = Alloc(scratch);
  if (direct) {
    std::string why;
    staging_view = static_cast<float*>(ops.HostView(target->Staging(), &why));
  }
  for (PState& ps : params) {
    if (ps.kind == PState::kDevice) continue;
    if (ps.kind == PState::kSplit && direct) continue;
    // Buffered: a device buffer for what crosses, unless it crosses straight from or into the
    // parameter's own buffers (a whole parameter in its dtype).
    const int64_t n = ps.offload_numel();
    if (!ps.straight_grad(cfg.grad_dtype)) ps.send = Alloc(FloatsFor(n, cfg.grad_dtype));
    if (!ps.straight_params(cfg.param_dtype))
      ps.back = Alloc(FloatsFor(n, cfg.param_dtype));
    if (ps.bf16 && n % 2 == 1 &&
        (ps.straight_grad(cfg.grad_dtype) || ps.straight_params(cfg.param_dtype))) {
      ps.tail = Alloc(3);
      ps.tail_idx = Ints(1);
      RETURN_IF_ERROR(Allocated("allocating the engine's transfer buffers"));
      UploadInts(ps.tail_idx, {n - 1});
    }
  }
  return Sync("allocating the engine's transfer buffers");
}

absl::Status ZenFlowEngine::Impl::LoadDaemon() {
  // The offloaded values (a split weight's cold columns gathered first) go through the staging
  // area in ranges, as many per LoadParams as fit: the staging area is a small share of the
  // state (offload.proto, RegionLayout.staging_bytes).
  const uint64_t cap = target->staging_floats();
  std::vector<OffloadTarget::LoadRange> batch;
  uint64_t used = 0;
  auto flush = [&]() -> absl::Status {
    RETURN_IF_ERROR(Sync("staging the initial parameters"));
    RETURN_IF_ERROR(target->LoadParams(batch));
    batch.clear();
    used = 0;
    return absl::OkStatus();
  };
  for (PState& ps : params) {
    if (ps.kind == PState::kDevice) continue;
    // Direct: a split weight's cold columns (a bf16 one's widened, exactly) are gathered
    // straight into the staging area, in blocks of whole rows, when a row fits it.
    if (ps.kind == PState::kSplit && staging_view != nullptr &&
        cap >= static_cast<uint64_t>(ps.ncold)) {
      const uint64_t row = static_cast<uint64_t>(ps.ncold);
      for (int64_t r0 = 0; r0 < ps.rows;) {
        if (cap - used < row) RETURN_IF_ERROR(flush());
        const int64_t nr = std::min<int64_t>(ps.rows - r0, static_cast<int64_t>((cap - used) / row));
        k.GatherColumnsAs(ps.gtype(), Advance(ps.p.value, r0 * ps.cols, ps.esize()), nr, ps.cols,
                          AsInts(ps.cold_idx_dev), ps.ncold, GradType::kFp32,
                          staging_view + used);
        batch.push_back({ps.p.name, static_cast<uint64_t>(r0) * row, nr * row, used * 4});
        used += nr * row;
        r0 += nr;
      }
      continue;
    }
    // Else a split weight's cold columns are gathered, a bf16 parameter's initial masters are
    // its values widened (exact): through `back` where it holds fp32, else a buffer of this
    // call.
    OpsBuffer widened;
    float* gathered = cfg.param_dtype == DType::kFp32 ? ps.back.data() : nullptr;
    if ((ps.kind == PState::kSplit || ps.bf16) && gathered == nullptr) {
      widened = Alloc(ps.offload_numel());
      RETURN_IF_ERROR(Allocated("loading the daemon"));
      NoteTransient(widened.size() * 4);
      gathered = widened.data();
    }
    if (ps.kind == PState::kSplit)
      k.GatherColumnsAs(ps.gtype(), ps.p.value, ps.rows, ps.cols, AsInts(ps.cold_idx_dev),
                        ps.ncold, GradType::kFp32, gathered);
    else if (ps.bf16)
      k.Bf16ToFloat(ps.value16(), gathered, ps.numel);
    const float* src = ps.kind == PState::kSplit || ps.bf16 ? gathered : ps.value32();
    const uint64_t n = static_cast<uint64_t>(ps.offload_numel());
    for (uint64_t first = 0; first < n;) {
      if (used == cap) RETURN_IF_ERROR(flush());
      const uint64_t c = std::min(n - first, cap - used);
      ops.Download(target->Staging() + used, src + first, static_cast<int64_t>(c));
      batch.push_back({ps.p.name, first, c, used * 4});
      used += c;
      first += c;
    }
  }
  if (!batch.empty()) RETURN_IF_ERROR(flush());
  loaded = true;
  return absl::OkStatus();
}

absl::Status ZenFlowEngine::Impl::EnqueueTopColumns(PState& ps, std::vector<int64_t>* hot) {
  if (ps.staged) {
    // StageGradient computed them from the gradient it was given.
  } else if (ps.p.grad == nullptr) {
    std::vector<float> zeros(ps.cols, 0.0f);
    ops.Upload(ps.scores.data(), zeros.data(), ps.cols);
  } else {
    k.ColumnScores(ps.p.grad, ps.gtype(), ps.rows, ps.cols, ps.cols, nullptr,
                   ps.scores.data());
  }
  if (reduce) RETURN_IF_ERROR(reduce(ps.p.name, ps.scores.data(), ps.cols));
  k.TopK(ps.scores.data(), ps.cols, ps.k, AsInts(ps.topk_dev));
  hot->resize(ps.k);
  ops.Download(reinterpret_cast<float*>(hot->data()), ps.topk_dev.data(), 2 * ps.k);
  return absl::OkStatus();
}

absl::Status ZenFlowEngine::Impl::SelectInitial(PState& ps, StepTimings* tm) {
  // Without a gradient the first selection takes columns [0, k) (the top-k of all-zero scores).
  auto t0 = Clock::now();
  std::vector<int64_t> hot;
  RETURN_IF_ERROR(EnqueueTopColumns(ps, &hot));
  RETURN_IF_ERROR(Sync("selecting hot columns"));
  ps.hot_idx = hot;
  ps.hot_steps.assign(ps.k, 0);
  ps.cold_idx.resize(ps.ncold);
  kernels::ComplementIndices(hot.data(), ps.k, ps.cols, ps.cold_idx.data());
  UploadInts(ps.hot_idx_dev, ps.hot_idx);
  UploadInts(ps.cold_idx_dev, ps.cold_idx);
  // The hot masters: the values (a bf16 parameter's widened, exactly).
  if (ps.bf16)
    k.GatherColumnsToFloat(ps.value16(), ps.rows, ps.cols, AsInts(ps.hot_idx_dev), ps.k,
                           ps.hot_master.data());
  else
    k.GatherColumns(ps.p.value, 4, ps.rows, ps.cols, AsInts(ps.hot_idx_dev), ps.k,
                    ps.hot_master.data());
  absl::Status st = Sync("initialising the hot columns");
  tm->optimizer += Since(t0);
  return st;
}

absl::Status ZenFlowEngine::Impl::Reselect(const kernels::AdamWConfig& adam, float scale,
                                           uint32_t slot, StepTimings* tm) {
  // At a round boundary, after this step's updates and pushes, from this step's gradient (a
  // parameter without one keeps its hot set). The handover (MigrateColumnsRequest.handover),
  // while the daemon may still be busy with the previous round's Update: the leaving columns'
  // state goes to the daemon, which hands back the entering columns' state from before this
  // round's Update with their accumulated gradient; their round's AdamW step is taken here,
  // exactly as the daemon's fused Update would take it, and the daemon's Update leaves the
  // arrived columns alone. One call for every parameter, in rounds of what fits the staging
  // area (StageHandOver).
  std::vector<Move> moves;
  RETURN_IF_ERROR(ChooseMoves(&moves, tm));
  for (;;) {
    auto t0 = Clock::now();
    std::vector<Batch> batches;
    std::vector<OffloadTarget::ColumnMove> request;
    RETURN_IF_ERROR(StageHandOver(&moves, slot, &batches, &request));
    if (batches.empty()) break;
    tm->optimizer += Since(t0);
    t0 = Clock::now();
    absl::StatusOr<OffloadTarget::HandOver> got = target->HandOverColumns(request);
    tm->stall += Since(t0);
    RETURN_IF_ERROR(got.status());
    t0 = Clock::now();
    RETURN_IF_ERROR(TakeEnteringColumns(adam, scale, *got, &batches, tm));
    tm->optimizer += Since(t0);
  }
  const uint64_t staging_cap = target->staging_floats();
  for (const Move& mv : moves)
    if (mv.done != mv.leaving.size())
      return absl::InternalError(absl::StrCat(
          "reselection of '", mv.ps->p.name, "': ", mv.leaving.size() - mv.done,
          " columns did not fit the daemon's staging area of ", staging_cap, " floats"));
  const auto t0 = Clock::now();
  for (Move& mv : moves) {
    if (mv.leaving.empty()) continue;
    PState& ps = *mv.ps;
    UploadInts(ps.hot_idx_dev, ps.hot_idx);
    UploadInts(ps.cold_idx_dev, ps.cold_idx);
    // The entering columns' values are their fresh masters from now on (a bf16 value: their
    // rounding; the leaving columns keep theirs, the rounding of the masters they took along).
    k.ScatterColumnsAs(GradType::kFp32, ps.hot_master.data(), ps.rows, ps.cols,
                       AsInts(ps.hot_idx_dev), ps.k, ps.gtype(), ps.p.value);
  }
  absl::Status st = Sync("migrating columns");
  tm->optimizer += Since(t0);
  return st;
}

absl::Status ZenFlowEngine::Impl::ChooseMoves(std::vector<Move>* moves, StepTimings* tm) {
  // Each split weight with a gradient: the new hot set, the hot positions that leave and the
  // compact positions that enter (paired in order).
  const auto t0 = Clock::now();
  for (PState& ps : params) {
    if (ps.kind != PState::kSplit || !ps.has_grad()) continue;
    moves->push_back(Move{&ps});
    RETURN_IF_ERROR(EnqueueTopColumns(ps, &moves->back().hot));
  }
  RETURN_IF_ERROR(Sync("selecting hot columns"));
  for (Move& mv : *moves) {
    PState& ps = *mv.ps;
    std::vector<char> is_new(ps.cols, 0);
    for (int64_t c : mv.hot) is_new[c] = 1;
    for (int64_t i = 0; i < ps.k; ++i)
      if (!is_new[ps.hot_idx[i]]) mv.leaving.push_back(i);
    for (int64_t j = 0; j < ps.ncold; ++j)
      if (is_new[ps.cold_idx[j]]) mv.entering.push_back(j);
    if (mv.leaving.size() != mv.entering.size())
      return absl::InternalError(absl::StrCat("reselection of '", ps.p.name, "': ",
                                              mv.leaving.size(), " columns leave but ",
                                              mv.entering.size(), " enter"));
  }
  tm->optimizer += Since(t0);
  return absl::OkStatus();
}

absl::Status ZenFlowEngine::Impl::StageHandOver(std::vector<Move>* moves, uint32_t slot,
                                                std::vector<Batch>* batches,
                                                std::vector<OffloadTarget::ColumnMove>* request) {
  // One handover call's batches: per parameter 4 blocks of [rows, n] in the staging area, one
  // parameter's after the other's, at most ncold / 4 columns of a parameter per call (the
  // staging area holds 4 blocks of one column of any parameter, so the first batch of a call
  // always moves at least one column). The leaving columns' master, m, v go to the staging
  // area; the entering columns' gradient of this step is gathered as the daemon received it.
  const bool bf16 = cfg.grad_dtype == DType::kBf16;
  const uint64_t staging_cap = target->staging_floats();
  uint64_t used = 0;      // staging floats taken by this call's batches
  int64_t transient = 0;  // bytes of the batches' buffers
  for (Move& mv : *moves) {
    PState& ps = *mv.ps;
    const int64_t left = static_cast<int64_t>(mv.leaving.size() - mv.done);
    // (a share of no rows moves its columns' indices only: no staging to fit)
    const int64_t fit = ps.rows == 0 ? left
                                     : static_cast<int64_t>((staging_cap - used) / (4 * ps.rows));
    if (left == 0 || fit == 0) continue;
    Batch b;
    b.mv = &mv;
    b.n = std::min<int64_t>({ps.ncold / 4, left, fit});
    b.staging_at = used;
    const int64_t n = b.n, rn = ps.rows * n;
    used += 4 * static_cast<uint64_t>(rn);
    b.pos.assign(mv.leaving.begin() + mv.done, mv.leaving.begin() + mv.done + n);
    b.cols.assign(mv.entering.begin() + mv.done, mv.entering.begin() + mv.done + n);
    b.steps.resize(n);
    for (int64_t q = 0; q < n; ++q) b.steps[q] = ps.hot_steps[b.pos[q]];
    b.pos_dev = Ints(n);
    b.cols_dev = Ints(n);
    b.tmp = Alloc(4 * rn);
    b.grad = Alloc(bf16 ? (rn + 1) / 2 : rn);
    b.ss = Alloc(n);
    b.bc2 = Alloc(n);
    RETURN_IF_ERROR(Allocated("reselection"));
    transient += 4 * (b.pos_dev.size() + b.cols_dev.size() + b.tmp.size() + b.grad.size() +
                      b.ss.size() + b.bc2.size());
    UploadInts(b.pos_dev, b.pos);
    UploadInts(b.cols_dev, b.cols);
    const float* hot_state[3] = {ps.hot_master.data(), ps.hot_m.data(), ps.hot_v.data()};
    for (int a = 0; a < 3; ++a)
      k.GatherColumns(hot_state[a], 4, ps.rows, ps.k, AsInts(b.pos_dev), n,
                      b.tmp.data() + a * rn);
    // Their compact positions in this step's slot (direct) or send buffer, in grad_dtype.
    const void* sent = direct ? ps.grad_view[slot] : ps.send.data();
    k.GatherColumns(sent, bf16 ? 2 : 4, ps.rows, ps.ncold, AsInts(b.cols_dev), n, b.grad.data());
    ops.Download(target->Staging() + b.staging_at, b.tmp.data(), 3 * rn);
    request->push_back({ps.p.name, b.cols, b.steps});
    batches->push_back(std::move(b));
    mv.done += n;
  }
  if (batches->empty()) return absl::OkStatus();
  NoteTransient(transient);
  return Sync("gathering the leaving columns' state");
}

absl::Status ZenFlowEngine::Impl::TakeEnteringColumns(const kernels::AdamWConfig& adam,
                                                      float scale,
                                                      const OffloadTarget::HandOver& got,
                                                      std::vector<Batch>* batches,
                                                      StepTimings* tm) {
  // The entering columns' state from the staging area, their round step with the daemon's
  // accumulated gradient and this step's (AccumulateAdamWColumns: the daemon's fused pass),
  // into the hot positions the leaving columns freed.
  const bool bf16 = cfg.grad_dtype == DType::kBf16;
  const bool acc_zero = got.pushes == 0;
  for (size_t i = 0; i < batches->size(); ++i) {
    Batch& b = (*batches)[i];
    PState& ps = *b.mv->ps;
    const int64_t n = b.n, rn = ps.rows * n;
    const size_t counts = i < got.steps.size() ? got.steps[i].size() : 0;
    if (counts != static_cast<size_t>(n))
      return absl::InternalError(absl::StrCat("handover of '", ps.p.name, "': ", counts,
                                              " step counts for ", n, " columns"));
    const std::vector<int64_t>& out_steps = got.steps[i];
    std::vector<int64_t> in_steps(n);
    for (int64_t q = 0; q < n; ++q) in_steps[q] = out_steps[q] + 1;
    std::vector<float> ss_h(n), bc2_h(n);
    kernels::MakeColumnConstants(adam, in_steps.data(), n, ss_h.data(), bc2_h.data());
    ops.Upload(b.ss.data(), ss_h.data(), n);
    ops.Upload(b.bc2.data(), bc2_h.data(), n);
    ops.Upload(b.tmp.data(), target->Staging() + b.staging_at, 4 * rn);
    k.AccumulateAdamWColumns(
        adam, b.ss.data(), b.bc2.data(), b.tmp.data(), b.tmp.data() + rn, b.tmp.data() + 2 * rn,
        acc_zero ? nullptr : b.tmp.data() + 3 * rn, b.grad.data(),
        bf16 ? GradType::kBf16 : GradType::kFp32, scale, ps.rows, n, nullptr);
    float* hot_state[3] = {ps.hot_master.data(), ps.hot_m.data(), ps.hot_v.data()};
    for (int a = 0; a < 3; ++a)
      k.ScatterColumns(b.tmp.data() + a * rn, 4, ps.rows, ps.k, AsInts(b.pos_dev), n,
                       hot_state[a]);
    for (int64_t q = 0; q < n; ++q) {
      std::swap(ps.hot_idx[b.pos[q]], ps.cold_idx[b.cols[q]]);
      ps.hot_steps[b.pos[q]] = in_steps[q];
    }
    tm->bytes_to_host += 3 * rn * 4;
    tm->bytes_to_device += 4 * rn * 4;
    tm->migrated_columns += 2 * n;
  }
  return Sync("taking the entering columns' round step");
}

void ZenFlowEngine::Impl::UploadParams(const kernels::BackendMemory& on, PState& ps,
                                       uint32_t slot) {
  const int64_t n = ps.offload_numel();
  // The slot's param_dtype elements as whole floats (FloatsFor).
  const float* src = static_cast<const float*>(target->ParamSlot(slot, ps.p.name, cfg.param_dtype));
  if (!ps.straight_params(cfg.param_dtype)) {
    on.Upload(ps.back.data(), src, FloatsFor(n, cfg.param_dtype));
  } else if (!ps.bf16) {
    on.Upload(ps.value32(), src, n);
  } else {
    // Straight into a whole bf16 parameter's value: whole floats, and an odd size's last element
    // (then at a float boundary of the slot, which is padded) into its tail.
    on.Upload(ps.value32(), src, n / 2);
    if (n % 2 == 1) on.Upload(ps.tail.data() + 2, src + n / 2, 1);
  }
}

absl::Status ZenFlowEngine::Impl::ScatterParams(PState& ps, uint32_t slot, bool uploaded,
                                                StepTimings* tm) {
  // A bf16 value takes the daemon's bf16 output (already the rounding of its masters) or the
  // rounding of its fp32 masters; an fp32 value the masters, or the bf16 output widened.
  const int64_t n = ps.offload_numel();
  const GradType from = DTypeOf(cfg.param_dtype);
  if (ps.kind == PState::kSplit && direct) {
    k.ScatterColumnsAs(from, ps.param_view[slot], ps.rows, ps.cols, AsInts(ps.cold_idx_dev),
                       ps.ncold, ps.gtype(), ps.p.value);
  } else {
    if (!uploaded) UploadParams(ops, ps, slot);
    if (ps.kind == PState::kSplit)
      k.ScatterColumnsAs(from, ps.back.data(), ps.rows, ps.cols, AsInts(ps.cold_idx_dev),
                         ps.ncold, ps.gtype(), ps.p.value);
    else if (!ps.straight_params(cfg.param_dtype) && ps.bf16)
      k.FloatToBf16(ps.back.data(), ps.value16(), n);
    else if (!ps.straight_params(cfg.param_dtype))
      k.Bf16ToFloat(reinterpret_cast<const uint16_t*>(ps.back.data()), ps.value32(), n);
    else if (ps.bf16 && n % 2 == 1)
      k.ScatterColumns(ps.tail.data() + 2, 2, 1, n, AsInts(ps.tail_idx), 1, ps.p.value);
  }
  tm->bytes_to_device += n * DTypeSize(cfg.param_dtype);
  return absl::OkStatus();
}

absl::Status ZenFlowEngine::Impl::ApplyPendingUpdate(StepTimings* tm) {
  if (pending_version == 0) return absl::OkStatus();
  auto t0 = Clock::now();
  const bool uploaded = prefetched_version == pending_version;
  if (uploaded) {
    RETURN_IF_ERROR(copier->WaitFor(prefetch_task));
  } else {
    RETURN_IF_ERROR(copier->WaitFor(pending_task));
    RETURN_IF_ERROR(target->WaitUpdate(pending_version));
  }
  prefetched_version = 0;
  tm->stall += Since(t0);
  tm->cold_changed = true;
  t0 = Clock::now();
  for (PState& ps : params)
    if (ps.kind != PState::kDevice)
      RETURN_IF_ERROR(ScatterParams(ps, pending_pslot, uploaded, tm));
  RETURN_IF_ERROR(Sync("scattering the daemon's parameters"));
  tm->copies += Since(t0);
  pending_version = 0;
  return absl::OkStatus();
}

absl::Status ZenFlowEngine::Impl::DoStep(double lr, float split_grad_scale) {
  const auto t_start = Clock::now();
  StepTimings tm;
  const StepPlan plan = Plan(lr, split_grad_scale);
  tm.step = plan.t;
  tm.boundary = plan.boundary;
  tm.interval = sched.Interval(plan.t);
  if (staging_for == plan.t) {  // what staging this step's gradients took (StageGradient)
    tm.copies += staged_tm.copies;
    tm.optimizer += staged_tm.optimizer;
    tm.stall += staged_tm.stall;
    tm.bytes_to_host += staged_tm.bytes_to_host;
  }
  if (offloading() && !loaded) {
    // Step 1: the first selection defines which columns the daemon holds; then load them.
    for (PState& ps : params)
      if (ps.kind == PState::kSplit && ps.hot_idx.empty()) RETURN_IF_ERROR(SelectInitial(ps, &tm));
    RETURN_IF_ERROR(LoadDaemon());
  }
  RETURN_IF_ERROR(UpdateDeviceShare(plan, &tm));
  if (offloading()) {
    std::vector<char> present;
    RETURN_IF_ERROR(GatherColdGradients(plan, &present, &tm));
    if (plan.reselect) {
      // The previous round's Update lands first, through the compact positions as they are;
      // the handovers then go to the daemon after this round's earlier pushes (the copy
      // thread's previous task) and before this step's fused Update.
      RETURN_IF_ERROR(ApplyPendingUpdate(&tm));
      const auto t0 = Clock::now();
      RETURN_IF_ERROR(copier->WaitFor(slot_task[plan.slot ^ 1u]));
      tm.stall += Since(t0);
      RETURN_IF_ERROR(Reselect(plan.adam, plan.scale, plan.slot, &tm));
      tm.reselected = true;
    }
    RoundUpdate round;
    if (plan.boundary) RETURN_IF_ERROR(PrepareRound(plan, &round, &tm));
    PostPushes(plan, present, round);
    if (plan.boundary) {
      RETURN_IF_ERROR(ApplyPendingUpdate(&tm));
      pending_task = slot_task[plan.slot];
      pending_version = plan.t;
      pending_pslot = round.pslot;
      pending_predicted = round.hyper.predict;
      if (plan.await) RETURN_IF_ERROR(ApplyPendingUpdate(&tm));
    } else if (LandsPending(plan.t)) {
      RETURN_IF_ERROR(ApplyPendingUpdate(&tm));  // land_lag < S: before the next boundary
    }
    if (sched.adaptive()) {
      MeasurePace(plan, t_start, tm);
      if (sched.Decides(plan.t)) RETURN_IF_ERROR(ChooseInterval(plan));
    }
    PrefetchForLanding(plan);  // after a new length: it decides when the pending Update lands
  }
  if (plan.boundary || cfg.mode != OffloadMode::kZenFlow) tm.cold_changed = true;
  tm.total = Since(t_start);
  last = tm;
  return absl::OkStatus();
}

void ZenFlowEngine::Impl::MeasurePace(const StepPlan& plan, Clock::time_point start,
                                      const StepTimings& tm) {
  // The caller's compute between the previous Step's start and this one's, less what that
  // Step stalled: what an Update can run behind (on a device, the queued kernels the engine's
  // Sync waits for count as compute too). Pauses between steps (an evaluation, a checkpoint)
  // come out of the median.
  if (have_prev)
    pace.compute.push_back(
        std::chrono::duration<double>(start - prev_start).count() - prev_stall);
  have_prev = true;
  prev_start = start;
  prev_stall = tm.stall;
  if (!plan.await) {
    pace.stall += tm.stall;
    ++pace.stalled_steps;
  }
  const OffloadTarget::UpdateSeen u = target->LastUpdate();
  if (u.version > seen_update) {
    seen_update = u.version;
    pace.update += u.seconds;
    ++pace.updates;
  }
}

absl::Status ZenFlowEngine::Impl::ChooseInterval(const StepPlan& plan) {
  std::vector<double>& c = pace.compute;
  double compute = 0;
  if (!c.empty()) {
    std::nth_element(c.begin(), c.begin() + c.size() / 2, c.end());
    compute = c[c.size() / 2];
  }
  // {replicas, compute, stall a step, replicas with an Update seen, their seconds an Update}
  std::vector<float> fig = {
      1.0f, static_cast<float>(compute),
      static_cast<float>(pace.stalled_steps > 0 ? pace.stall / pace.stalled_steps : 0.0),
      pace.updates > 0 ? 1.0f : 0.0f,
      static_cast<float>(pace.updates > 0 ? pace.update / pace.updates : 0.0)};
  if (reduce) {
    OpsBuffer buf = Alloc(static_cast<int64_t>(fig.size()));
    RETURN_IF_ERROR(Allocated("the automatic round's figures"));
    ops.Upload(buf.data(), fig.data(), static_cast<int64_t>(fig.size()));
    RETURN_IF_ERROR(Sync("uploading the automatic round's figures"));
    RETURN_IF_ERROR(reduce("", buf.data(), static_cast<int64_t>(fig.size())));
    ops.Download(fig.data(), buf.data(), static_cast<int64_t>(fig.size()));
    RETURN_IF_ERROR(Sync("downloading the automatic round's figures"));
  }
  const double n = std::max(1.0f, fig[0]);
  const double update = fig[3] > 0 ? fig[4] / fig[3] : 0.0;
  const int64_t before = sched.interval();
  const int64_t S = Schedule::ChooseInterval(update, fig[1] / n, fig[2] / n, before,
                                             cfg.max_update_interval, &interval_floor);
  if (S != before)
    SF_LOG(kInfo, "zenflow: update_interval auto: %d -> %d after step %d (the daemon's Update "
           "%.3g ms, the caller's compute %.3g ms a step, stall %.3g ms a step)",
           static_cast<int>(before), static_cast<int>(S), static_cast<int>(plan.t),
           update * 1e3, fig[1] / n * 1e3, fig[2] / n * 1e3);
  sched.Resize(plan.t, S);
  pace = Pace();
  return absl::OkStatus();
}

ZenFlowEngine::Impl::StepPlan ZenFlowEngine::Impl::Plan(double lr, float split_grad_scale) {
  StepPlan p;
  p.t = ++step;
  p.lr = lr;
  p.split_scale = split_grad_scale;
  p.scale = static_cast<float>(1.0 / static_cast<double>(sched.Interval(p.t)));
  if (p.split_scale != 1.0f) p.scale *= p.split_scale;
  p.await = sched.Awaits(p.t);
  p.boundary = sched.Boundary(p.t);
  p.reselect = sched.Reselects(p.t);
  p.adam = cfg.AdamW(lr, p.t);
  p.slot = Schedule::GradSlot(p.t);
  return p;
}

absl::Status ZenFlowEngine::Impl::UpdateDeviceShare(const StepPlan& plan, StepTimings* tm) {
  // The device's share: 1-D and device-only parameters whole, hot columns of split weights.
  const auto t0 = Clock::now();
  const kernels::AdamWConfig& adam = plan.adam;
  // A bf16 device parameter's master starts as its value widened, at its first Step (the value
  // buffer may have been rebound since Create).
  for (PState& ps : params) {
    if (ps.kind != PState::kDevice || !ps.bf16 || ps.master_ready) continue;
    k.Bf16ToFloat(ps.value16(), ps.master.data(), ps.numel);
    ps.master_ready = true;
  }
  if (!hot_consts_host.empty()) {
    for (PState& ps : params) {
      if (ps.kind != PState::kSplit || !ps.has_grad()) continue;
      for (int64_t& s : ps.hot_steps) ++s;
      float* c = hot_consts_host.data() + ps.consts_at;
      kernels::MakeColumnConstants(adam, ps.hot_steps.data(), ps.k, c, c + ps.k);
    }
    ops.Upload(hot_consts.data(), hot_consts_host.data(),
               static_cast<int64_t>(hot_consts_host.size()));
  }
  for (PState& ps : params) {
    if (!ps.has_grad()) continue;  // a device parameter without a gradient this step
    if (ps.kind == PState::kDevice) {
      kernels::AdamWConfig a = adam;
      a.step = ++ps.dstep;
      if (ps.bf16)  // the step on the master, its rounding into the value
        k.AdamW(a, ps.master.data(), ps.m.data(), ps.v.data(), ps.p.grad, GradType::kBf16,
                ps.numel, ps.value16());
      else
        k.AdamW(a, ps.value32(), ps.m.data(), ps.v.data(), ps.p.grad, GradType::kFp32, ps.numel,
                nullptr);
    } else if (ps.kind == PState::kSplit) {
      kernels::AdamWConfig a = adam;
      a.grad_scale = plan.split_scale;
      UpdateHotColumns(ps, a);
    }
  }
  RETURN_IF_ERROR(Sync("the device-side optimizer"));
  tm->optimizer += Since(t0);
  return absl::OkStatus();
}

void ZenFlowEngine::Impl::UpdateHotColumns(PState& ps, const kernels::AdamWConfig& adam) {
  // The hot columns' gradient in row blocks through the scratch (stream ordered on a device),
  // each block's AdamW on the matching rows of the masters and moments (stream_gradients: all
  // rows through its own hot_grad, where StageGradient may have put them already); then the
  // masters (rounded, for bf16) into the value.
  const float* c = hot_consts.data() + ps.consts_at;
  const int64_t block = ps.streamed() ? ps.rows : HotBlockRows(ps);
  float* buf = ps.streamed() ? ps.hot_grad.data() : hot_scratch.data();
  for (int64_t r0 = 0; r0 < ps.rows; r0 += block) {
    const int64_t nr = std::min(block, ps.rows - r0), at = r0 * ps.k;
    if (!ps.staged)
      k.GatherColumns(Advance(ps.p.grad, r0 * ps.cols, ps.esize()), ps.esize(), nr, ps.cols,
                      AsInts(ps.hot_idx_dev), ps.k, buf);
    k.AdamWColumns(adam, c, c + ps.k, ps.hot_master.data() + at, ps.hot_m.data() + at,
                   ps.hot_v.data() + at, buf, ps.gtype(), nr, ps.k, nullptr);
  }
  k.ScatterColumnsAs(GradType::kFp32, ps.hot_master.data(), ps.rows, ps.cols,
                     AsInts(ps.hot_idx_dev), ps.k, ps.gtype(), ps.p.value);
}

absl::Status ZenFlowEngine::Impl::GatherColdGradients(const StepPlan& plan,
                                                      std::vector<char>* present,
                                                      StepTimings* tm) {
  // Cold gradients on their way: into the send buffers, or, direct, into this step's gradient
  // slot (WaitToSend: once each is free). A parameter without a gradient this step pushes
  // zeros, written on the host by the copy task: it adds nothing to the round's mean.
  const uint32_t slot = plan.slot;
  if (staging_for != plan.t) RETURN_IF_ERROR(WaitToSend(plan.t, tm));
  const auto t0 = Clock::now();
  present->assign(params.size(), 0);
  const GradType gt = DTypeOf(cfg.grad_dtype);
  for (size_t i = 0; i < params.size(); ++i) {
    PState& ps = params[i];
    if (ps.kind == PState::kDevice || !ps.has_grad()) continue;
    (*present)[i] = 1;
    ++ps.round_grads;
    const int64_t n = ps.offload_numel();
    if (ps.staged) continue;  // already in the slot or the send buffer, counted by the staging
    if (ps.kind == PState::kSplit) {
      k.GatherColumnsAs(ps.gtype(), ps.p.grad, ps.rows, ps.cols, AsInts(ps.cold_idx_dev),
                        ps.ncold, gt, direct ? ps.grad_view[slot] : ps.send.data());
    } else if (!ps.straight_grad(cfg.grad_dtype) && ps.bf16) {
      k.Bf16ToFloat(ps.grad16(), ps.send.data(), n);
    } else if (!ps.straight_grad(cfg.grad_dtype)) {
      k.FloatToBf16(ps.grad32(), reinterpret_cast<uint16_t*>(ps.send.data()), n);
    } else if (ps.bf16 && n % 2 == 1) {
      // Straight from a whole bf16 parameter's buffer: an odd size's last element through its
      // tail.
      k.GatherColumns(ps.p.grad, 2, 1, n, AsInts(ps.tail_idx), 1, ps.tail.data() + slot);
    }
    tm->bytes_to_host += n * DTypeSize(cfg.grad_dtype);
  }
  RETURN_IF_ERROR(Sync("gathering the cold gradients"));
  tm->copies += Since(t0);
  return absl::OkStatus();
}

absl::Status ZenFlowEngine::Impl::PrepareRound(const StepPlan& plan, RoundUpdate* round,
                                               StepTimings* tm) {
  // At a round boundary the round's last push is folded into the Update (the daemon's fused
  // boundary pass: no accumulator write and re-read for it), so the copy task that writes the
  // slot then issues the Update itself (PostPushes).
  for (PState& ps : params) {  // no gradient in the whole round: no step, no decay
    if (ps.kind != PState::kDevice && ps.round_grads == 0) round->skip.push_back(ps.p.name);
    ps.round_grads = 0;
  }
  round->hyper = {plan.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay};
  round->hyper.predict = sched.Predicts(plan.t);
  const uint32_t pslot = static_cast<uint32_t>(rounds++ % param_slots);
  round->pslot = pslot;
  // The Update posted next writes parameter slot pslot as soon as the copy thread issues it. A
  // pending Update's parameters still in that slot (one slot: always) must be read out first.
  // The prefetch task does that ahead of this Update on the copy thread (posted earlier, it
  // runs first); with await_updates, in warm-up and in sync-offload the pending Update landed
  // in its own step, and at a reselection above; otherwise (direct transfers; an engine
  // restored just before a boundary: Restore drops the prefetch) it lands here, before the post.
  auto unread = [&] {
    return pending_version > 0 && pending_pslot == pslot && prefetched_version != pending_version;
  };
  if (unread()) RETURN_IF_ERROR(ApplyPendingUpdate(tm));
  // The guard of that order (ZenFlowTest.ResumeFromCheckpointEqualsUninterruptedRun, k = 5,
  // trips it if the landing above goes): an error, never a read racing the daemon's write.
  if (unread())
    return absl::InternalError(absl::StrCat(
        "step ", plan.t, ": the Update would overwrite parameter slot ", pslot,
        " before version ", pending_version, "'s parameters were read from it"));
  return absl::OkStatus();
}

void ZenFlowEngine::Impl::PostPushes(const StepPlan& plan, const std::vector<char>& present,
                                     const RoundUpdate& round) {
  // Two copy-thread tasks: the slot's bytes (what the send buffers hold, straight from whole
  // parameters' buffers, zeros for a missing gradient; direct ones are already there) once no
  // Update reads the slot; then the push, or at a boundary the fused Update (after the previous
  // round's: the daemon runs one at a time; both normally long done by then).
  const uint32_t slot = plan.slot;
  const bool fuse = plan.boundary;
  const int64_t slot_busy = slot_update[slot];  // an Update that still reads the slot
  const int64_t prev_update = pending_version;  // an Update that may still run
  slot_update[slot] = fuse ? plan.t : 0;
  send_task = copier->Post([this, slot, slot_busy, present]() -> absl::Status {
    if (slot_busy > 0) RETURN_IF_ERROR(target->WaitUpdate(slot_busy));
    for (size_t i = 0; i < params.size(); ++i) {
      PState& ps = params[i];
      if (ps.kind == PState::kDevice || (ps.kind == PState::kSplit && direct && present[i]))
        continue;
      const int64_t n = ps.offload_numel();
      float* dst = static_cast<float*>(target->GradSlot(slot, ps.p.name));
      if (!present[i]) {
        memset(dst, 0, n * DTypeSize(cfg.grad_dtype));
      } else if (!ps.straight_grad(cfg.grad_dtype)) {
        CopyOps().Download(dst, ps.send.data(), FloatsFor(n, cfg.grad_dtype));
      } else if (!ps.bf16) {
        CopyOps().Download(dst, ps.grad32(), n);
      } else {
        // Whole floats of the caller's buffer, and an odd size's last element from its tail
        // (to a float boundary of the slot, which is padded).
        CopyOps().Download(dst, static_cast<const float*>(ps.p.grad), n / 2);
        if (n % 2 == 1) CopyOps().Download(dst + n / 2, ps.tail.data() + slot, 1);
      }
    }
    return CopySync("copying the cold gradients to the host");
  });
  const int64_t t = plan.t;
  const float scale = plan.scale;
  const DType out = cfg.param_dtype;
  slot_task[slot] = copier->Post([this, slot, t, scale, fuse, prev_update, round,
                                  out]() -> absl::Status {
    if (!fuse) return target->Push(t, slot, scale);
    if (prev_update > 0) RETURN_IF_ERROR(target->WaitUpdate(prev_update));
    return target->UpdateWithPush(t, round.hyper, round.pslot, out, slot, scale, round.skip);
  });
}

void ZenFlowEngine::Impl::PrefetchForLanding(const StepPlan& plan) {
  // Buffered: before the step that lands a pending Update (LandsPending), the copy thread
  // uploads its parameters while the caller computes that step (zenflow: only split weights go
  // through the daemon). With land_lag 1 that is right after the boundary posts the Update: the
  // task waits for it on the copy thread.
  if (cfg.mode != OffloadMode::kZenFlow || direct || prefetched_version != 0 ||
      !LandsPending(plan.t + 1))
    return;
  const int64_t v = pending_version;
  const uint32_t from = pending_pslot;
  prefetch_task = copier->Post([this, v, from]() -> absl::Status {
    RETURN_IF_ERROR(target->WaitUpdate(v));
    for (PState& ps : params)
      if (ps.kind == PState::kSplit) UploadParams(CopyOps(), ps, from);
    return CopySync("uploading the daemon's parameters");
  });
  prefetched_version = v;
}

ZenFlowEngine::ZenFlowEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ZenFlowEngine::~ZenFlowEngine() {
  if (impl_->copier) impl_->copier->WaitAll().IgnoreError();
}

absl::StatusOr<std::unique_ptr<ZenFlowEngine>> ZenFlowEngine::Create(
    const ZenFlowConfig& config, std::vector<EngineParam> params,
    const kernels::OptimizerKernel& kernel, const kernels::BackendMemory& ops,
    OffloadTarget* target) {
  RETURN_IF_ERROR(config.Validate());
  if (config.mode != OffloadMode::kNoOffload && target == nullptr)
    return Invalid("session", absl::StrCat("mode ", OffloadModeName(config.mode),
                                           " needs a stallfreed session"));
  if (params.empty()) return Invalid("params", "empty");
  auto impl = std::make_unique<Impl>(config, kernel, ops, target);
  std::set<std::string> names;
  for (size_t i = 0; i < params.size(); ++i) {
    const EngineParam& p = params[i];
    const std::string field = absl::StrCat("params[", i, "]");
    if (p.name.empty() || !names.insert(p.name).second)
      return Invalid(field + ".name", absl::StrCat("'", p.name, "' is empty or a duplicate"));
    if (p.shape.empty()) return Invalid(field + ".shape", "no dimensions");
    // The leading dimension may be 0: a rank's empty share of a parameter (FSDP2 leaves the
    // last ranks none of a parameter with fewer rows than ranks). Such a parameter takes part
    // in everything by its columns (its scores are zeros) and holds no element.
    for (size_t d = 0; d < p.shape.size(); ++d)
      if (p.shape[d] < (d == 0 ? 0 : 1))
        return Invalid(absl::StrCat(field, ".shape[", d, "]"),
                       absl::StrCat(p.shape[d], " is not >= ", d == 0 ? 0 : 1));
    if (p.value == nullptr && p.shape[0] > 0) return Invalid(field + ".value", "null");
    impl->index[p.name] = i;
    PState ps;
    ps.p = p;
    impl->params.push_back(std::move(ps));
  }
  RETURN_IF_ERROR(impl->Setup());
  return std::unique_ptr<ZenFlowEngine>(new ZenFlowEngine(std::move(impl)));
}

absl::Status ZenFlowEngine::Step(double lr, float split_grad_scale) {
  if (!impl_->failure.ok()) return impl_->failure;
  // A bad argument, refused before anything changes (the engine stays usable).
  if (!(lr >= 0.0) || !std::isfinite(lr))
    return Invalid("lr", absl::StrCat(lr, " is not finite and >= 0"));
  if (!(split_grad_scale > 0.0f) || !std::isfinite(split_grad_scale))
    return Invalid("split_grad_scale", absl::StrCat(split_grad_scale, " is not finite and > 0"));
  if (split_grad_scale != 1.0f && impl_->cfg.mode != OffloadMode::kZenFlow)
    return Invalid("split_grad_scale", absl::StrCat("mode ", OffloadModeName(impl_->cfg.mode),
                                                    " splits no weight"));
  absl::Status st = impl_->DoStep(lr, split_grad_scale);
  for (PState& ps : impl_->params) ps.staged = false;
  impl_->staging_for = 0;
  impl_->staged_tm = StepTimings();
  if (!st.ok()) impl_->failure = st;
  return st;
}

absl::Status ZenFlowEngine::StageGradient(size_t index, const void* grad) {
  if (!impl_->failure.ok()) return impl_->failure;
  if (index >= impl_->params.size())
    return Invalid("index", absl::StrCat(index, " is not below ", impl_->params.size()));
  if (grad == nullptr) return Invalid("grad", "null");
  if (!impl_->cfg.stream_gradients)
    return absl::FailedPreconditionError(
        "StageGradient: the engine was created without stream_gradients");
  PState& ps = impl_->params[index];
  if (ps.kind != PState::kSplit)
    return absl::FailedPreconditionError(absl::StrCat(
        "StageGradient: '", ps.p.name, "' is not a split weight (Splits(", index,
        ") is false): its gradient stays in its buffer until Step"));
  if (ps.staged)
    return absl::FailedPreconditionError(absl::StrCat(
        "StageGradient: '", ps.p.name, "' already has a gradient for step ",
        impl_->step + 1, ": one backward per step (gradient accumulation needs the whole "
        "gradient kept until Step)"));
  absl::Status st = impl_->StageGradient(ps, grad);
  if (!st.ok()) impl_->failure = st;
  return st;
}

absl::Status ZenFlowEngine::Impl::WaitToSend(int64_t t, StepTimings* tm) {
  const uint32_t slot = Schedule::GradSlot(t);
  const auto t0 = Clock::now();
  RETURN_IF_ERROR(copier->WaitFor(send_task));
  if (direct) {
    RETURN_IF_ERROR(copier->WaitFor(slot_task[slot]));
    if (slot_update[slot] > 0) RETURN_IF_ERROR(target->WaitUpdate(slot_update[slot]));
    slot_update[slot] = 0;
  }
  tm->stall += Since(t0);
  return absl::OkStatus();
}

absl::Status ZenFlowEngine::Impl::StageGradient(PState& ps, const void* grad) {
  // What the coming Step t would read from the gradient, read now: step 1's selection, the
  // scores where t reselects, the hot columns into hot_grad, the cold ones where Step's gather
  // puts them (direct: the slot; buffered: the send buffer). Then the caller may free it.
  const int64_t t = step + 1;
  if (staging_for != t) {
    staged_tm = StepTimings();
    RETURN_IF_ERROR(WaitToSend(t, &staged_tm));
    staging_for = t;
  }
  ps.p.grad = grad;
  if (!loaded && ps.hot_idx.empty()) RETURN_IF_ERROR(SelectInitial(ps, &staged_tm));
  const auto t0 = Clock::now();
  if (sched.Reselects(t))
    k.ColumnScores(grad, ps.gtype(), ps.rows, ps.cols, ps.cols, nullptr, ps.scores.data());
  k.GatherColumns(grad, ps.esize(), ps.rows, ps.cols, AsInts(ps.hot_idx_dev), ps.k,
                  ps.hot_grad.data());
  const uint32_t slot = Schedule::GradSlot(t);
  k.GatherColumnsAs(ps.gtype(), grad, ps.rows, ps.cols, AsInts(ps.cold_idx_dev), ps.ncold,
                    DTypeOf(cfg.grad_dtype), direct ? ps.grad_view[slot] : ps.send.data());
  absl::Status st = Sync("staging a gradient");
  ps.p.grad = nullptr;
  RETURN_IF_ERROR(st);
  ps.staged = true;
  staged_tm.copies += Since(t0);
  staged_tm.bytes_to_host += ps.offload_numel() * DTypeSize(cfg.grad_dtype);
  return absl::OkStatus();
}

absl::Status ZenFlowEngine::Flush() {
  if (!impl_->failure.ok()) return impl_->failure;
  if (!impl_->copier) return absl::OkStatus();
  StepTimings tm;
  absl::Status st = impl_->copier->WaitAll();
  if (st.ok()) st = impl_->ApplyPendingUpdate(&tm);
  if (!st.ok()) impl_->failure = st;
  return st;
}

absl::StatusOr<std::string> ZenFlowEngine::Checkpoint(const std::string& tag) {
  return CheckpointTo(tag, nullptr);
}

absl::StatusOr<std::string> ZenFlowEngine::CheckpointTo(const std::string& tag,
                                                        std::string* daemon) {
  Impl& im = *impl_;
  if (!im.failure.ok()) return im.failure;
  if (im.staging_for != 0)
    return absl::FailedPreconditionError(
        "Checkpoint: gradients are staged for the next Step (StageGradient); checkpoint after "
        "that Step");
  if (im.offloading()) {
    RETURN_IF_ERROR(im.copier->WaitAll());
    if (im.pending_version > 0)
      RETURN_IF_ERROR(im.target->WaitUpdate(im.pending_version));
  }
  // The daemon's part: its checkpoint `tag`, or (daemon) its bytes, with no file.
  if (im.daemon_has_state() && daemon != nullptr) {
    ASSIGN_OR_RETURN(*daemon, im.target->ExportState());
  } else if (im.daemon_has_state()) {
    RETURN_IF_ERROR(im.target->Checkpoint(tag));
  }
  auto download = [&](const OpsBuffer& b) {
    std::vector<float> host(b.size());
    im.ops.Download(host.data(), b.data(), b.size());
    return host;
  };
  // V2 unless a parameter is bf16, V4 with an automatic round or predicted rounds (engine/
  // blob.h).
  const bool v4 = im.sched.adaptive() ||
                  (im.cfg.mode == OffloadMode::kZenFlow && im.cfg.predict_cold);
  const bool v3 = v4 || std::any_of(im.params.begin(), im.params.end(),
                                    [](const PState& ps) { return ps.bf16; });
  BlobWriter w;
  w.I64(v4 ? kEngineBlobMagicV4 : v3 ? kEngineBlobMagicV3 : kEngineBlobMagic);
  w.I64(static_cast<int64_t>(im.cfg.mode));
  w.I64(im.step);
  w.I64(im.rounds);
  w.I64(im.pending_version);
  w.I64(im.loaded ? 1 : 0);
  w.I64(static_cast<int64_t>(im.params.size()));
  for (const PState& ps : im.params) {
    w.I64(ps.kind);
    w.I64(ps.numel);
    w.I64(ps.k);
    if (v3) w.I64(ps.bf16 ? kBlobBf16 : kBlobFp32);
    if (ps.kind == PState::kDevice) {
      w.I64(ps.dstep);
      w.Floats(download(ps.m));
      w.Floats(download(ps.v));
      // A bf16 parameter's master (none before its first Step: the value widened is then).
      if (v3) w.Floats(ps.master_ready ? download(ps.master) : std::vector<float>());
    } else {
      w.I64(ps.round_grads);
    }
    if (ps.kind == PState::kSplit) {
      w.Ints(ps.hot_idx);
      w.Ints(ps.cold_idx);
      w.Ints(ps.hot_steps);
      w.Floats(download(ps.hot_master));
      w.Floats(download(ps.hot_m));
      w.Floats(download(ps.hot_v));
      if (v4) w.Floats(im.PendingShown(ps));
    }
  }
  if (v4) {
    w.I64(im.sched.adaptive() ? 1 : 0);
    w.I64(im.sched.base());
    w.I64(im.sched.interval());
    w.I64(im.interval_floor);
  }
  RETURN_IF_ERROR(im.Sync("downloading the engine's state"));
  return w.out;
}

absl::Status ZenFlowEngine::DeleteCheckpoint(const std::string& tag) {
  Impl& im = *impl_;
  if (!im.offloading() || im.target == nullptr) return absl::OkStatus();
  return im.target->DeleteCheckpoint(tag);
}

absl::Status ZenFlowEngine::Restore(const std::string& tag, const std::string& state) {
  return RestoreFrom(tag, state, nullptr);
}

absl::Status ZenFlowEngine::RestoreFrom(const std::string& tag, const std::string& state,
                                        const std::string* daemon) {
  // The blob is parsed (engine/blob.h) and checked against this engine whole, and the daemon
  // restores its checkpoint, before anything of the engine's changes: a refused blob, or a
  // daemon that refuses or fails its Restore, leaves the engine as fresh as it was.
  Impl& im = *impl_;
  if (im.step != 0)
    return absl::FailedPreconditionError("Restore: the engine has already run a step");
  ASSIGN_OR_RETURN(EngineBlob blob, ParseEngineBlob(state));
  RETURN_IF_ERROR(im.CheckBlob(blob));
  // (daemon_has_state() once the blob's `loaded` is the engine's)
  if (im.offloading() && blob.loaded != 0 && daemon != nullptr && daemon->empty())
    return absl::InvalidArgumentError(
        "state: the engine's state says the daemon holds its offloaded part, but no daemon "
        "state came with it");
  if (im.offloading() && blob.loaded != 0)
    RETURN_IF_ERROR(daemon != nullptr ? im.target->ImportState(*daemon, im.cfg.param_dtype)
                                      : im.target->Restore(tag, im.cfg.param_dtype));
  for (size_t i = 0; i < im.params.size(); ++i)
    im.ApplyBlobParam(im.params[i], blob.params[i], blob.loaded != 0);
  if (absl::Status st = im.Sync("restoring the engine's state"); !st.ok()) {
    im.failure = st;  // the daemon holds the restored state, the engine part of it: unusable
    return st;
  }
  im.step = blob.step;
  im.rounds = blob.rounds;
  im.pending_version = blob.pending_version;
  im.loaded = blob.loaded != 0;
  if (blob.magic == kEngineBlobMagicV4 && blob.round_adaptive != 0) {
    im.sched.Resize(blob.round_base, blob.round_interval);
    im.interval_floor = blob.round_floor;
  }
  // The daemon's Restore puts the checkpointed parameters in parameter slot 0: the pending
  // round reads them there, and the next Update writes the other slot if there are two (with
  // one, DoStep lands the pending round before the next Update is issued).
  im.pending_pslot = 0;
  im.prefetched_version = 0;
  if (im.rounds % 2 == 0) ++im.rounds;
  // A predicted round pending: the daemon's Restore wrote its masters to slot 0; the landing
  // shows the prediction the blob kept.
  im.pending_predicted = false;
  for (size_t i = 0; i < im.params.size(); ++i)
    if (!blob.params[i].pending_shown.empty()) {
      im.ShowPending(im.params[i], blob.params[i].pending_shown);
      im.pending_predicted = true;
    }
  return absl::OkStatus();
}

absl::StatusOr<ZenFlowEngine::Snapshot> ZenFlowEngine::CheckpointBytes() {
  Snapshot out;
  ASSIGN_OR_RETURN(out.engine, CheckpointTo("", &out.daemon));
  return out;
}

namespace {
absl::Status NothingOffloaded() {
  return absl::InvalidArgumentError(
      "the state holds a daemon checkpoint but this engine offloads nothing (mode "
      "no-offload, or no weight splits)");
}
}  // namespace

absl::Status ZenFlowEngine::RestoreBytes(const std::string& engine, const std::string& daemon) {
  if (!daemon.empty() && !impl_->offloading()) return NothingOffloaded();
  return RestoreFrom("", engine, &daemon);
}

absl::Status ZenFlowEngine::CheckState(const std::string& engine,
                                       const std::string& daemon) const {
  const Impl& im = *impl_;
  ASSIGN_OR_RETURN(EngineBlob blob, ParseEngineBlob(engine));
  RETURN_IF_ERROR(im.CheckBlob(blob));
  if (!daemon.empty() && !im.offloading()) return NothingOffloaded();
  if (!im.offloading() || blob.loaded == 0) return absl::OkStatus();
  if (daemon.empty())
    return absl::InvalidArgumentError(
        "state: the engine's state says the daemon holds its offloaded part, but no daemon "
        "state came with it");
  // Its parameters must be the ones this engine registers (Setup), judged by the daemon's own
  // rule before the checksum, as the daemon's import judges them.
  std::vector<StateParam> specs;
  for (const PState& ps : im.params) {
    if (ps.kind == PState::kDevice) continue;
    specs.push_back({ps.p.name, ps.offload_shape(),
                     im.cfg.grad_dtype == DType::kBf16 ? kStateBf16 : kStateFp32});
  }
  auto judge = [&specs](const StateHeader& header) {
    return MatchCheckpointParams(header, specs, "state: the daemon's state");
  };
  return VerifyCheckpointBytes(daemon.data(), daemon.size(), "the daemon's state", judge)
      .status();
}

absl::Status ZenFlowEngine::Impl::CheckBlob(const EngineBlob& blob) const {
  // InvalidArgument: a blob of another engine (mode, parameters, shapes, split, dtypes);
  // DataLoss: one whose arrays do not fit what it says.
  auto bad = [](const std::string& what) {
    return absl::DataLossError(absl::StrCat("state: ", what));
  };
  if (blob.mode != static_cast<int64_t>(cfg.mode))
    return absl::InvalidArgumentError(absl::StrCat(
        "state: written in mode ", blob.mode, ", this engine runs ", OffloadModeName(cfg.mode)));
  if (blob.params.size() != params.size())
    return absl::InvalidArgumentError(absl::StrCat("state: ", blob.params.size(),
                                                   " parameters, the engine has ", params.size()));
  // An automatic round's state only into an engine with one, and back: their rounds would
  // otherwise disagree about where the pending Update lands.
  if ((blob.magic == kEngineBlobMagicV4 && blob.round_adaptive != 0) != sched.adaptive())
    return absl::InvalidArgumentError(absl::StrCat(
        "state: written with update_interval ",
        blob.magic == kEngineBlobMagicV4 && blob.round_adaptive != 0 ? "auto" : "fixed",
        ", this engine runs ",
        sched.adaptive() ? "auto" : absl::StrCat(cfg.update_interval),
        ": restore it with the update_interval it was written with"));
  if (blob.magic == kEngineBlobMagicV4 && blob.round_adaptive != 0 &&
      blob.round_interval > cfg.max_update_interval)
    return absl::InvalidArgumentError(absl::StrCat(
        "state: an automatic round of ", blob.round_interval,
        " steps, longer than this engine's max_update_interval ", cfg.max_update_interval));
  for (size_t i = 0; i < params.size(); ++i) {
    const PState& ps = params[i];
    const EngineBlobParam& bp = blob.params[i];
    if (bp.kind != ps.kind || bp.numel != ps.numel || bp.k != ps.k)
      return absl::InvalidArgumentError(absl::StrCat(
          "state: parameter '", ps.p.name, "' was checkpointed with another shape or split"));
    if (bp.dtype != (ps.bf16 ? kBlobBf16 : kBlobFp32))  // blobs before V3: fp32 only
      return absl::InvalidArgumentError(absl::StrCat(
          "state: parameter '", ps.p.name, "' was checkpointed as ",
          bp.dtype == kBlobBf16 ? "bf16" : bp.dtype == kBlobFp32 ? "fp32" : "an unknown dtype",
          ", the engine holds it as ", ps.bf16 ? "bf16" : "fp32"));
    if (ps.kind == PState::kDevice && !bp.master.empty() && !ps.bf16)
      return bad(absl::StrCat("an fp32 parameter '", ps.p.name, "' with a master"));
    if (ps.kind != PState::kSplit) continue;
    // A weight checkpointed before its first selection (an engine that has not stepped) has no
    // column sets yet (they come with the daemon's load at step 1): it restores unselected.
    // (its hot arrays are whole either way: the fresh engine's buffers).
    const size_t k = blob.loaded != 0 ? ps.k : 0, ncold = blob.loaded != 0 ? ps.ncold : 0;
    const size_t hot = static_cast<size_t>(ps.k * ps.rows);
    if (bp.hot_idx.size() != k || bp.cold_idx.size() != ncold || bp.hot_steps.size() != k ||
        bp.hot_master.size() != hot || bp.hot_m.size() != hot || bp.hot_v.size() != hot)
      return bad(absl::StrCat("the hot columns of '", ps.p.name, "' are mis-sized"));
    if (!bp.pending_shown.empty() &&
        (blob.pending_version == 0 || blob.loaded == 0 ||
         bp.pending_shown.size() != static_cast<size_t>(ps.rows * ps.ncold)))
      return bad(absl::StrCat("the pending prediction of '", ps.p.name, "' is mis-sized"));
    std::vector<int> seen(ps.cols, 0);
    for (const std::vector<int64_t>* set : {&bp.hot_idx, &bp.cold_idx})
      for (int64_t col : *set) {
        if (col < 0 || col >= ps.cols || seen[col]++ > 0)
          return bad(absl::StrCat("the column sets of '", ps.p.name, "' are corrupt"));
      }
  }
  return absl::OkStatus();
}

std::vector<float> ZenFlowEngine::Impl::PendingShown(const PState& ps) const {
  std::vector<float> out;
  if (pending_version == 0 || !pending_predicted || ps.kind != PState::kSplit) return out;
  const int64_t n = ps.rows * ps.ncold;
  const void* slot = target->ParamSlot(pending_pslot, ps.p.name, cfg.param_dtype);
  out.resize(n);
  if (cfg.param_dtype == DType::kBf16) {
    const uint16_t* b = static_cast<const uint16_t*>(slot);
    for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(b[i]);
  } else {
    memcpy(out.data(), slot, n * sizeof(float));
  }
  return out;
}

void ZenFlowEngine::Impl::ShowPending(const PState& ps, const std::vector<float>& shown) {
  void* slot = const_cast<void*>(target->ParamSlot(0, ps.p.name, cfg.param_dtype));
  const int64_t n = static_cast<int64_t>(shown.size());
  if (cfg.param_dtype == DType::kBf16) {
    uint16_t* b = static_cast<uint16_t*>(slot);
    for (int64_t i = 0; i < n; ++i) b[i] = FloatToBf16(shown[i]);  // exact: widened bf16
  } else {
    memcpy(slot, shown.data(), n * sizeof(float));
  }
}

void ZenFlowEngine::Impl::ApplyBlobParam(PState& ps, const EngineBlobParam& bp, bool selected) {
  // A checked blob's parameter into the engine (CheckBlob passed).
  if (ps.kind == PState::kDevice) {
    ps.dstep = bp.dstep;
    ops.Upload(ps.m.data(), bp.m.data(), ps.numel);
    ops.Upload(ps.v.data(), bp.v.data(), ps.numel);
    // Without a master (checkpointed before its first Step) the first Step widens the value.
    ps.master_ready = !bp.master.empty();
    if (ps.master_ready) ops.Upload(ps.master.data(), bp.master.data(), ps.numel);
    return;
  }
  ps.round_grads = bp.round_grads;
  if (ps.kind != PState::kSplit || !selected) return;  // unselected: the fresh engine's buffers
  const int64_t hot = ps.rows * ps.k;
  ps.hot_idx = bp.hot_idx;
  ps.cold_idx = bp.cold_idx;
  ps.hot_steps = bp.hot_steps;
  UploadInts(ps.hot_idx_dev, ps.hot_idx);
  UploadInts(ps.cold_idx_dev, ps.cold_idx);
  ops.Upload(ps.hot_master.data(), bp.hot_master.data(), hot);
  ops.Upload(ps.hot_m.data(), bp.hot_m.data(), hot);
  ops.Upload(ps.hot_v.data(), bp.hot_v.data(), hot);
}

absl::Status ZenFlowEngine::SetBuffers(size_t index, void* value, const void* grad) {
  if (index >= impl_->params.size())
    return Invalid("index", absl::StrCat(index, " is not below ", impl_->params.size()));
  if (value == nullptr && impl_->params[index].numel > 0) return Invalid("value", "null");
  impl_->params[index].p.value = value;
  impl_->params[index].p.grad = grad;
  return absl::OkStatus();
}

absl::Status ZenFlowEngine::SetAdamW(double beta1, double beta2, double eps,
                                     double weight_decay) {
  ZenFlowConfig c = impl_->cfg;
  c.beta1 = beta1;
  c.beta2 = beta2;
  c.eps = eps;
  c.weight_decay = weight_decay;
  RETURN_IF_ERROR(c.Validate());
  // These four fields only, not the whole config: copy-thread tasks still in flight from the
  // previous Step read the config's dtypes (never these four: an Update's hyper-parameters are
  // captured when it is posted), so assigning the whole struct would race them.
  impl_->cfg.beta1 = beta1;
  impl_->cfg.beta2 = beta2;
  impl_->cfg.eps = eps;
  impl_->cfg.weight_decay = weight_decay;
  return absl::OkStatus();
}

bool ZenFlowEngine::OnDevice(size_t index) const {
  return index < impl_->params.size() && impl_->params[index].kind == PState::kDevice;
}
bool ZenFlowEngine::Splits(size_t index) const {
  return index < impl_->params.size() && impl_->params[index].kind == PState::kSplit;
}

int64_t ZenFlowEngine::step() const { return impl_->step; }
const StepTimings& ZenFlowEngine::last_timings() const { return impl_->last; }
int64_t ZenFlowEngine::update_interval() const { return impl_->sched.interval(); }

DeviceFootprint ZenFlowEngine::Footprint() const {
  DeviceFootprint f;
  for (const PState& ps : impl_->params) ps.AddFootprint(&f);
  f.selection += impl_->hot_consts.size() * 4;
  f.transfers += impl_->hot_scratch.size() * 4;
  f.transient_peak = impl_->transient_peak;
  for (const PState& ps : impl_->params)  // a streamed gradient, one at a time
    if (ps.streamed())
      f.transient_peak = std::max<int64_t>(f.transient_peak, ps.numel * ps.esize());
  return f;
}
const ZenFlowConfig& ZenFlowEngine::config() const { return impl_->cfg; }
Transfers ZenFlowEngine::transfers() const {
  return impl_->direct ? Transfers::kDirect : Transfers::kBuffered;
}
void ZenFlowEngine::set_score_reduce(ScoreReduce fn) { impl_->reduce = std::move(fn); }

absl::StatusOr<std::vector<int64_t>> ZenFlowEngine::HotColumns(const std::string& param) const {
  auto it = impl_->index.find(param);
  if (it == impl_->index.end())
    return absl::NotFoundError(absl::StrCat("param: no parameter '", param, "'"));
  const PState& ps = impl_->params[it->second];
  std::vector<int64_t> out;
  if (ps.kind == PState::kSplit) {
    out = ps.hot_idx;
    std::sort(out.begin(), out.end());
  } else if (ps.kind == PState::kDevice) {
    for (int64_t c = 0; c < ps.cols; ++c) out.push_back(c);
  }
  return out;
}

absl::StatusOr<ColumnState> ZenFlowEngine::Column(const std::string& param, int64_t col) const {
  auto it = impl_->index.find(param);
  if (it == impl_->index.end())
    return absl::NotFoundError(absl::StrCat("param: no parameter '", param, "'"));
  const PState& ps = impl_->params[it->second];
  if (col < 0 || col >= ps.cols)
    return Invalid("col", absl::StrCat(col, " is outside [0, ", ps.cols, ")"));
  Impl& im = *impl_;
  ColumnState out;
  // Column c of a [rows, ld] array of fp32 (bf16: widened).
  auto column_of = [&](const void* base, int64_t ld, int64_t c, bool bf16 = false) {
    std::vector<float> host(ps.rows);
    std::vector<int64_t> idx = {c};
    OpsBuffer idx_dev = im.Ints(1), tmp(&im.ops, ps.rows);
    im.UploadInts(idx_dev, idx);
    if (bf16)
      im.k.GatherColumnsToFloat(static_cast<const uint16_t*>(base), ps.rows, ld,
                                Impl::AsInts(idx_dev), 1, tmp.data());
    else
      im.k.GatherColumns(base, 4, ps.rows, ld, Impl::AsInts(idx_dev), 1, tmp.data());
    im.ops.Download(host.data(), tmp.data(), ps.rows);
    return host;
  };
  out.value = column_of(ps.p.value, ps.cols, col, ps.bf16);
  if (ps.kind == PState::kDevice) {
    out.master = ps.bf16 ? (ps.master_ready ? column_of(ps.master.data(), ps.cols, col)
                                            : out.value)
                         : out.value;
    out.m = column_of(ps.m.data(), ps.cols, col);
    out.v = column_of(ps.v.data(), ps.cols, col);
    out.step = ps.dstep;
    out.on_device = true;
  } else if (ps.kind == PState::kSplit) {
    auto pos = std::find(ps.hot_idx.begin(), ps.hot_idx.end(), col);
    if (pos != ps.hot_idx.end()) {
      const int64_t i = pos - ps.hot_idx.begin();
      out.master = column_of(ps.hot_master.data(), ps.k, i);
      if (!ps.bf16) out.value = out.master;
      out.m = column_of(ps.hot_m.data(), ps.k, i);
      out.v = column_of(ps.hot_v.data(), ps.k, i);
      out.step = ps.hot_steps[i];
      out.on_device = true;
    }
  }
  RETURN_IF_ERROR(im.Sync("reading a column"));
  return out;
}

}  // namespace stallfree
