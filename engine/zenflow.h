// The ZenFlow engine: the trainer-side optimizer that updates the important gradient columns on
// the device at once and defers the rest to stallfreed, so the device does not wait for the CPU
// (ARCHITECTURE.md, "The ZenFlow engine").
//
// Parameters. Each parameter is a value buffer and a gradient buffer in the backend's memory
// (host for the CPU backend, device memory for CUDA), owned by the caller, both fp32 or both
// bf16 (EngineParam::dtype; bf16 is uint16 storage, round to nearest even). A parameter of
// two or more dimensions is a weight W[rows, cols] (rows = the product of the leading
// dimensions) split by column (input channel); a 1-D parameter (norm, bias) is always updated on
// the device. In `zenflow` mode a weight with fewer than kMinColdColumns (4) cold columns stays
// wholly on the device too (a reselection's handover moves at most a quarter of a weight's cold
// columns a call: see SplitsWeight).
//
// One Step(lr) per training step, after the backward has written the gradients:
// - selection at step 1 (before its updates): per-column scores (sum of squares, through the
//   optional ScoreReduce hook, so data-parallel replicas can all-reduce the scores — never the
//   gradients), then the top k = round(ratio * cols) columns (at least 1) are the hot set;
// - hot columns: AdamW on the device now, with their fp32 master, moments and int64 step counts
//   kept on the device (OptimizerKernel::AdamWColumns), written into the value buffer;
// - cold columns: gathered into the session's current gradient slot (double buffered), straight
//   or through a device buffer the copy thread downloads (see "Transfers"), and pushed by the
//   engine's copy thread (PushGradients, scale 1/S: the daemon accumulates the round's mean
//   gradient) while the caller computes the next step;
// - every S = update_interval steps (a round boundary) the copy thread starts the daemon's Update
//   (per-column step counts) with the round's last push folded in. It lands at the end of step
//   b + land_lag (b its boundary; by default the next boundary, which lands it before issuing
//   its own): buffered, the copy thread has already uploaded its parameters during the step
//   before (it waits for that Update first); direct, the engine waits for that Update then;
//   and the engine scatters them into the cold columns. Hot columns are never written by the
//   daemon's output. So each Update's parameters are read before the next Update is issued,
//   and the engine registers one parameter slot, in param_dtype (offload.proto,
//   RegisterParamsRequest).
// - reselection, at the end of a boundary step t >= max(W, 1) with (t - W) a multiple of
//   select_interval, from step t's scores: the new hot set applies from step t + 1. It is not a
//   sync point: the previous round's Update lands as at any boundary, then one MigrateColumns
//   handover (all parameters; offload.proto) goes to the daemon after this round's pushes and
//   before its Update, which may still be queued behind the previous one. The leaving columns
//   hand their fp32 value, m, v and step count to the daemon; the entering columns come back with
//   theirs from before this round's Update and their accumulated gradient, and the engine takes
//   their round step on the device (AccumulateAdamWColumns with this step's gradient, exactly
//   the daemon's fused pass), so they enter current; the daemon's Update leaves the arrived
//   columns as they came. No reset, no rounding.
// bf16 parameters (ARCHITECTURE.md, "Precision"). The optimizer runs on fp32 masters: the
// device-side share of a bf16 parameter (its hot columns, or the whole parameter when it lives on
// the device) keeps a fp32 master next to m and v, the daemon keeps the cold columns' (all of a
// sync-offload parameter's). The bf16 value is always the round-to-nearest-even rounding of its
// master, written by the step that changes the master, never re-derived from the bf16 value
// itself: hot columns and device parameters by the engine's kernels, cold columns from the
// daemon's output (param_dtype bf16: its rounding; fp32: rounded here). Migrations move fp32
// masters both ways, checkpoints hold the device-side masters (the daemon's hold the rest). The
// masters start as the bf16 values widened (exact), at the first Step (Restore: from the blob).
// Scores come from the bf16 gradient; the cold gradient crosses as is (grad_dtype bf16) or
// widened (fp32). An fp32 parameter runs exactly as before (no master: the value is the master).
//
// Transfers. The cold gradient of a split weight crosses to the daemon's gradient slot, and the
// daemon's parameters come back from its parameter slot, in one of two ways (ZenFlowConfig::
// transfers). Buffered: Step gathers the cold gradient into one device buffer (in grad_dtype)
// and the copy thread downloads it while the caller computes the next step; the copy thread
// uploads an Update's parameters into one device buffer (in param_dtype) during the step before
// the one that lands them. The copies overlap compute; the buffers cost about
// (1 - topk_ratio) x (grad_dtype + param_dtype bytes) per parameter on the device. Direct: Step's
// gather kernel writes the cold gradient straight into the pinned gradient slot, and the
// boundary's scatter kernel reads the parameters straight from the parameter slot, through the
// backend's view of the session's registered region (BackendMemory::HostView): no transfer
// buffers, but those two moves run inside Step at the host link's speed. Direct also writes the
// gradient slot from Step, so Step first waits for the daemon to be done with the slot (its
// push, or the fused Update that reads it): with the default land_lag an Update may take until
// the second step after its boundary before it stalls the caller, against the third when
// buffered; with a smaller land_lag L, until the end of step b + L in both (plus the upload,
// buffered). A whole offloaded
// parameter (sync-offload) crosses the same way in both: straight from and into its own buffers
// when the dtypes match, else through a device buffer that converts. The hot columns' gradient
// is gathered in row blocks through one scratch buffer of at most 2^20 elements shared by every
// weight.
//
// Bounded staleness: round R's Update, issued at its boundary b, lands in the cold columns at
// the end of step b + L, L = land_lag (1 <= L <= S; the default 0 means L = S, the next
// boundary), so the forwards of steps b + 1 .. b + L see round R-1's parameters: L steps
// behind the gradients already pushed. The daemon has L steps of the caller's compute to run
// the Update before the landing step waits for it. With await_updates (and during warm-up, and
// in sync-offload) the engine waits for round R's Update at its boundary instead, so there is
// no staleness. A column that enters the hot set is current at once. With predict_cold (the
// default) a round of one step lands its cold columns as 2 p_R - p_(R-1), where they would be
// a step on if they kept the step's change: measured on real text after the warm-up, it takes
// most of the one-step staleness's cost away (README, "Quality against AdamW"); a longer
// round's prediction, a whole round's change ahead, measured worse from scratch, so longer
// rounds land as computed. The model then shows, for its cold columns, that prediction, not
// the masters: at close(), too (the last landing), a step's change ahead of the optimizer's
// state.
//
// Warm-up: the first `warmup_steps` steps run with S = 1 and awaited updates, which is exact
// AdamW on every column (the daemon's part too), before the rounds begin. Measured, this is what
// keeps ZenFlow from its own loss spikes: a cold column's first per-round Adam steps, with
// moments from a few samples, otherwise come at the peak learning rate on 90% of the columns at
// once (bench/zenflow_variants.py); and the longer it is, the less of staleness's cost a run
// pays, which is largest while the weights change fastest, early on (bench/quality_suite.py).
// After the warm-up every column's moments rest on `warmup_steps` gradients. The cost is a
// synchronous step (the daemon's update waited for) during those steps.
//
// Modes, on the same code path: `zenflow` (above); `sync-offload` (ZeRO-Offload: every parameter,
// 1-D ones too, lives in the daemon; every step pushes every gradient, runs the Update and waits
// for it); `no-offload` (plain AdamW on the device; the quality reference; no session needed).
// Warm-up steps run `zenflow` with S = 1 and await_updates.
//
// Threads: Step, Flush and the accessors must be called from one thread. The engine owns a copy
// thread that talks to the daemon. Its copies (the cold gradients down, the next update's
// parameters up) go through ops.NewCopyStream() where the backend has one (CUDA: a non-blocking
// stream of its own, so they overlap the caller's compute), else through ops. They need no
// events: every buffer they read or write is handed over at a host synchronisation (the engine
// synchronises its stream before it posts a copy, and waits for the copy task before it uses
// the copied buffer). The target, kernels and ops must outlive the engine.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "engine/offload_target.h"
#include "kernels/memory.h"
#include "kernels/optimizer.h"

namespace stallfree {

enum class OffloadMode { kZenFlow, kSyncOffload, kNoOffload };
const char* OffloadModeName(OffloadMode mode);  // "zenflow", "sync-offload", "no-offload"
absl::StatusOr<OffloadMode> ParseOffloadMode(const std::string& name);

// How the cold columns cross between a split weight and the daemon's pinned slots (see
// "Transfers" above): through device buffers that copies on a copy stream overlap with compute
// (kBuffered), or straight, the backend's gather and scatter kernels reading and writing the
// slots through its mapping of them (kDirect: no transfer buffers on the device). kAuto is
// kDirect where the backend has no copy stream (the CPU backend: its memory is the host's, so a
// buffer would only add a copy), kBuffered where it has one (CUDA).
enum class Transfers { kAuto, kBuffered, kDirect };
const char* TransfersName(Transfers t);  // "auto", "buffered", "direct"
absl::StatusOr<Transfers> ParseTransfers(const std::string& name);

// The split rule of zenflow mode, one copy for the engine, the benches and the trainer: a weight
// of `cols` input columns has HotColumnCount(ratio, cols) = clamp(round(ratio * cols), 1, cols)
// hot columns (round half away from zero), and is split (hot columns on the device, cold ones in
// the daemon) when at least kMinColdColumns are cold; else it stays wholly on the device (a
// reselection's handover moves at most ncold / 4 columns of a weight a call).
inline constexpr int64_t kMinColdColumns = 4;
int64_t HotColumnCount(double topk_ratio, int64_t cols);
bool SplitsWeight(double topk_ratio, int64_t cols);

// The engine warm-up's default, chosen by measurement (README, "Quality against AdamW"): 100
// steps of exact AdamW (S = 1, awaited) before ZenFlow proper. Against 20, with the automatic
// round, three seeds of bench/quality_suite.py: a Llama fine-tune 1.0036x AdamW's eval loss
// (20: 1.0225x, 50: 1.0114x), from scratch 1.085x (20: 1.173x, 50: 1.131x).
inline constexpr int64_t kDefaultWarmupSteps = 100;

struct ZenFlowConfig {
  OffloadMode mode = OffloadMode::kZenFlow;
  double topk_ratio = 0.1;     // hot share of each weight's columns, in (0, 1]
  // S >= 1: steps per daemon Update; 0: automatic, the shortest round whose Update the
  // caller's compute hides, chosen as the run goes, at most max_update_interval (schedule.h).
  int64_t update_interval = 0;
  int64_t max_update_interval = 4;
  int64_t select_interval = 0;  // steps between reselections, a multiple of S; 0 means 4 S
  // >= 0: first steps with S = 1 and awaited updates (every column steps every step, as in
  // no-offload); see "Warm-up" above.
  int64_t warmup_steps = kDefaultWarmupSteps;
  bool await_updates = false;   // wait for each round's Update at its boundary (no staleness)
  // Steps after its boundary at which a round's Update lands in the cold columns, in
  // [1, update_interval]; 0 means update_interval (at the next boundary). See "Bounded
  // staleness" above.
  int64_t land_lag = 0;
  // A round of one step lands its update as the cold columns predicted one step ahead,
  // 2 p_R - p_(R-1) (the daemon writes them: UpdateRequest.predict), instead of p_R: the forward
  // that sees it is a step late, and the prediction meets it where the columns will be. The
  // optimizer's state (the daemon's masters) is AdamW's either way; awaited updates, and
  // rounds longer than a step, land as computed. See "Bounded staleness" above.
  bool predict_cold = true;
  // AdamW (decoupled weight decay); lr comes with each Step.
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  // What crosses to and from the daemon: pushed gradients and returned parameters.
  DType grad_dtype = DType::kFp32;
  DType param_dtype = DType::kFp32;
  Transfers transfers = Transfers::kAuto;
  // The caller hands split weights' gradients over as the backward produces them
  // (StageGradient): each split weight keeps a [rows, k] hot-gradient buffer of its own instead
  // of the shared row-block scratch, and its gradient counts as transient (DeviceFootprint).
  bool stream_gradients = false;

  // OK, or InvalidArgument naming the field.
  absl::Status Validate() const;
  // The AdamW kernels' configuration of a step with learning rate lr and step count t.
  kernels::AdamWConfig AdamW(double lr, int64_t t) const;
  int64_t EffectiveSelectInterval() const {
    return select_interval == 0 ? 4 * std::max<int64_t>(update_interval, 1) : select_interval;
  }
};

// ZenFlowConfig's fields, the one list of them: f(name, member) for each, so that the Python
// binding (and anything else that names fields) reflects the config instead of copying it.
template <typename Config, typename F>
void VisitConfigFields(Config& c, F&& f) {
  f("mode", c.mode);
  f("topk_ratio", c.topk_ratio);
  f("update_interval", c.update_interval);
  f("max_update_interval", c.max_update_interval);
  f("select_interval", c.select_interval);
  f("warmup_steps", c.warmup_steps);
  f("await_updates", c.await_updates);
  f("land_lag", c.land_lag);
  f("predict_cold", c.predict_cold);
  f("beta1", c.beta1);
  f("beta2", c.beta2);
  f("eps", c.eps);
  f("weight_decay", c.weight_decay);
  f("grad_dtype", c.grad_dtype);
  f("param_dtype", c.param_dtype);
  f("transfers", c.transfers);
  f("stream_gradients", c.stream_gradients);
}
// The config as text by field name (numbers exactly, bools "true"/"false", enums by their
// names), and one field set from such text: InvalidArgument naming the field for a name that is
// not a field or text that is not of its type (ranges are Validate's).
std::map<std::string, std::string> ConfigFields(const ZenFlowConfig& c);
absl::Status SetConfigField(ZenFlowConfig* c, const std::string& name, const std::string& text);
// Resuming a state saved under configuration `saved` (field -> text, as ConfigFields writes it)
// in a run configured `now` (the same, of the fields the run sets): the fields of `now` whose
// saved value differs, {field: {saved text, now text}}; empty when the state may resume.
// transfers and stream_gradients choose how the same numbers move, not the numbers: any value of
// theirs resumes any. A field `saved` lacks was not yet a field when the state was written and
// has the value that state ran under: land_lag 0 (a round landed at the next boundary),
// max_update_interval 4 (the bound of an automatic round, which it did not have), predict_cold
// false (rounds landed as computed). InvalidArgument naming the field for a saved field that is
// not one, or text not of its type.
using ConfigConflicts = std::map<std::string, std::pair<std::string, std::string>>;
absl::StatusOr<ConfigConflicts> ResumeConflicts(const std::map<std::string, std::string>& saved,
                                                const std::map<std::string, std::string>& now);

struct EngineParam {
  std::string name;
  std::vector<int64_t> shape;  // every dimension >= 1
  void* value = nullptr;       // backend memory, `dtype` elements, updated in place
  const void* grad = nullptr;  // backend memory, `dtype` elements, read by Step (may be null
                               // until SetBuffers)
  // FP32 or BF16 (value and gradient alike; see "bf16 parameters" above).
  DType dtype = DType::kFp32;
};

// The backend memory the engine allocates (bytes; device memory on CUDA, host memory on the CPU
// backend), by what it holds. Every buffer the engine owns between calls is counted; transient
// buffers of one call (the initial load of the daemon, a reselection's handover batches, Column)
// are not, and the largest of them so far is in transient_peak. The backend's own workspaces
// (the CUDA kernels' scratch for scores and top-k) are not the engine's and not counted.
struct DeviceFootprint {
  int64_t masters = 0;    // fp32 masters: hot columns' (hot_master), bf16 device parameters'
  int64_t moments = 0;    // AdamW m and v of the device-side share
  // Gather / scatter buffers: the hot columns' gradient scratch; buffered transfers' cold
  // gradient on its way out and the daemon's parameters on their way back; odd-size tails.
  int64_t transfers = 0;
  int64_t selection = 0;  // column scores, top-k and hot / cold index arrays, per-column constants
  int64_t transient_peak = 0;
  // The caller's value and gradient buffers (numel x dtype bytes x 2): not the engine's, but
  // what a parameter costs on the device with it. With stream_gradients a split weight's
  // gradient lives only from the backward's producing it to StageGradient, one at a time: it is
  // not here, and the largest is in transient_peak.
  int64_t params = 0;
  int64_t engine() const { return masters + moments + transfers + selection; }
  int64_t total() const { return engine() + params; }
};

// What the engine's sizing rule sees of a parameter: its shape and dtype.
struct ParamShape {
  std::vector<int64_t> shape;  // every dimension >= 1
  DType dtype = DType::kFp32;
};
// The DeviceFootprint an engine of `cfg` allocates over `params` (transient_peak and the
// caller's `params` bytes aside), with direct or buffered transfers (TransfersAreDirect): the
// sizing of the engine's Setup, written out for planning; an engine's Footprint() equals it
// (tests/engine:zenflow_test, FootprintIsPlanned).
DeviceFootprint PlannedFootprint(const std::vector<ParamShape>& params, const ZenFlowConfig& cfg,
                                 bool direct);
// Whether an engine of `transfers` moves the cold columns directly: kDirect, or kAuto on a
// backend without a copy stream (the CPU backend; CUDA has one).
bool TransfersAreDirect(Transfers transfers, bool has_copy_stream);
// The hot share a device-memory budget buys (zenflow mode; ZenFlowAdamW's device_budget): the
// largest topk_ratio, a multiple of 1/1000 in (0, 1], whose PlannedFootprint(params, cfg with it,
// direct).engine() is at most bytes_per_param x the parameters' elements. The budget counts the
// engine's own device memory (masters, moments, transfer buffers, selection), not the caller's
// values and gradients. InvalidArgument naming device_budget when even the smallest share
// exceeds it (the 1-D parameters and small weights stay wholly on the device, 8 or 12 bytes an
// element, and buffered transfers take grad + param dtype bytes per cold element), with the
// least budget and what direct transfers would take; or when the mode is not zenflow.
absl::StatusOr<double> TopkForBudget(const std::vector<ParamShape>& params,
                                     const ZenFlowConfig& cfg, bool direct,
                                     double bytes_per_param);

// Where the time of one Step went (seconds) and what it moved (bytes between the device and the
// host: gradients and migrated state down, parameters and migrated state up). `compute` is the
// caller's to fill (forward + backward), for reports.
struct StepTimings {
  int64_t step = 0;
  double compute = 0;
  double optimizer = 0;  // device-side: scores, top-k, hot and 1-D AdamW, scatters of hot values
  double copies = 0;     // device-side gathers and the cold-parameter scatter
  double stall = 0;      // blocked on offload work: copy thread, daemon Update, migration
  double total = 0;      // the whole Step
  uint64_t bytes_to_host = 0;
  uint64_t bytes_to_device = 0;
  bool boundary = false;
  // The step changed the split weights' cold columns as well as their hot ones: a round
  // boundary, an Update landing (land_lag < update_interval lands between boundaries), every
  // step outside zenflow. Otherwise only the hot columns (and the weights wholly on the
  // device) changed: what data-parallel ranks need to share after the step.
  bool cold_changed = false;
  bool reselected = false;
  int64_t migrated_columns = 0;
  int64_t interval = 0;  // the length of the round this step belongs to (1 in the warm-up)
};
// StepTimings' fields, the one list of them (as VisitConfigFields).
template <typename Timings, typename F>
void VisitTimingFields(Timings& t, F&& f) {
  f("step", t.step);
  f("compute", t.compute);
  f("optimizer", t.optimizer);
  f("copies", t.copies);
  f("stall", t.stall);
  f("total", t.total);
  f("bytes_to_host", t.bytes_to_host);
  f("bytes_to_device", t.bytes_to_device);
  f("boundary", t.boundary);
  f("cold_changed", t.cold_changed);
  f("reselected", t.reselected);
  f("interval", t.interval);
  f("migrated_columns", t.migrated_columns);
}

// The state of one column of a parameter, for tests and checkpoints.
struct ColumnState {
  // [rows]. value: the parameter's value (a bf16 one widened), except for an fp32 parameter's
  // hot column, whose value is its master; master: the fp32 master where the engine holds it
  // (on_device), else empty.
  std::vector<float> value, master, m, v;
  int64_t step = 0;
  bool on_device = false;
};

class ZenFlowEngine {
 public:
  // Validates the config and the parameters and, unless mode is no-offload, registers the
  // offloaded parameters with `target` (engine/offload_target.h; a stallfreed session through
  // client/session_target.h), which must be fresh (no parameters registered yet), or, if it
  // already has a layout, checks that it matches (FailedPrecondition naming the parameter
  // otherwise). `target` may be null in no-offload mode. `kernel` and `ops` are one backend
  // (e.g. DefaultCpuKernel() and CpuMemory(), or the transformer ops, which are a backend's
  // memory too). InvalidArgument names the field: config fields, params[i].shape, .value, .grad.
  static absl::StatusOr<std::unique_ptr<ZenFlowEngine>> Create(
      const ZenFlowConfig& config, std::vector<EngineParam> params,
      const kernels::OptimizerKernel& kernel, const kernels::BackendMemory& ops,
      OffloadTarget* target);
  ~ZenFlowEngine();

  // One optimizer step (t = step() + 1) with learning rate lr over the gradients now in the
  // parameters' grad buffers. Errors from the daemon or the backend are returned here (or by a
  // later Step for asynchronous work) and leave the engine failed; an lr that is negative or not
  // finite is InvalidArgument and changes nothing.
  // split_grad_scale multiplies the gradients of the split weights in this Step (hot and cold
  // columns alike; the others' are taken as they are): how a caller clips gradients it staged
  // with StageGradient, whose only copy is the engine's (the caller scales the others in
  // place). Finite and > 0; 1 by default.
  absl::Status Step(double lr, float split_grad_scale = 1.0f);

  // Points parameter `index` (the order of Create's params) at new buffers from the next Step on:
  // frameworks that reallocate gradients (PyTorch's zero_grad(set_to_none=True)) call this
  // before each Step. Neither buffer is read or written outside Step, Flush, Checkpoint, Restore
  // and Column. `grad` == nullptr means the parameter has no gradient in the next Step, and is
  // skipped as torch.optim.AdamW skips it: its device-side part (the whole parameter, or its hot
  // columns) takes no step (value, moments, step counts unchanged) and a reselection keeps its
  // hot set; its daemon-side part adds nothing to the round's gradient (the daemon's round
  // gradient is the sum of the round's gradients over S), and a round in which it never had a
  // gradient leaves it unchanged in the daemon (UpdateRequest.skip_params). In sync-offload
  // (S = 1) that is exactly torch's skip.
  // The buffers are in the parameter's dtype.
  absl::Status SetBuffers(size_t index, void* value, const void* grad);
  // Streamed gradients: hands split weight `index`'s gradient (`grad`, backend memory of its
  // dtype) to the engine before the Step that uses it, as the backward produces it, so the
  // caller may free it when this returns: the whole-model gradient need never be resident. The
  // engine reads now what that Step would read (the scores where it selects, the hot columns
  // into a [rows, k] buffer of its own, the cold ones straight to the daemon's slot, or the send
  // buffer when buffered), and that Step takes the parameter as having this gradient whatever
  // SetBuffers says. The Step's timings include the staging. FailedPrecondition without
  // stream_gradients in the config, for a parameter that is not a split weight
  // (Splits(index)), or one already staged for this Step (a second
  // backward: gradient accumulation needs the whole gradient until Step); Checkpoint refuses
  // while gradients are staged. The first staging of a step waits, as Step would, for the
  // daemon to be done with the slot.
  absl::Status StageGradient(size_t index, const void* grad);
  // Whether parameter `index` is split by column (hot columns on the device, cold in the
  // daemon): what StageGradient takes.
  bool Splits(size_t index) const;
  // Changes AdamW's betas, eps and weight decay from the next Step on (validated as in Create).
  absl::Status SetAdamW(double beta1, double beta2, double eps, double weight_decay);
  // Whether parameter `index` lives wholly on the device (its gradient may be absent).
  bool OnDevice(size_t index) const;

  // Waits for all offload work and brings the cold columns to the newest Update's parameters.
  // Gradients pushed since the last round boundary stay in the daemon's accumulator (they are
  // applied at the round's end).
  absl::Status Flush();

  int64_t step() const;
  const StepTimings& last_timings() const;
  // The length of the rounds after the warm-up: update_interval, or with auto the length
  // chosen last (1 before the first choice).
  int64_t update_interval() const;
  // What the engine holds in the backend's memory now (see DeviceFootprint), and its total
  // (DeviceFootprint::engine(): without the caller's parameters and gradients).
  DeviceFootprint Footprint() const;
  int64_t DeviceBytes() const { return Footprint().engine(); }
  const ZenFlowConfig& config() const;
  // The transfers in use (kDirect or kBuffered: what kAuto chose; see "Transfers").
  Transfers transfers() const;

  // Hot columns of a parameter, in increasing order (all columns for device-only parameters).
  absl::StatusOr<std::vector<int64_t>> HotColumns(const std::string& param) const;
  // A column's value, and, when it is on the device, its m, v and step (call after Flush; the
  // daemon's moments are not readable without migrating them).
  absl::StatusOr<ColumnState> Column(const std::string& param, int64_t col) const;

  // Checkpoint, between Steps: waits for the copy thread and for a running daemon Update (whose
  // parameters it does not apply, so the run's trajectory is unchanged), has the daemon write
  // its state as `tag` (OffloadTarget::Checkpoint), and returns the engine's own state (step
  // counts, hot sets, device-side masters and moments, the pending round) as bytes for the
  // caller to store with the model's values. No-offload needs no tag (pass "").
  absl::StatusOr<std::string> Checkpoint(const std::string& tag);
  // The inverse, on a fresh engine (same config and parameters, a fresh target, no Step yet)
  // whose value buffers already hold the checkpointed values: restores the daemon from `tag` and
  // the engine from `state`. The run then continues exactly as the checkpointed one would have.
  // InvalidArgument / DataLoss when `state` does not belong to this engine's configuration.
  // All or nothing: on any error (a refused blob, a daemon that refuses or fails its Restore)
  // the engine is as fresh as it was.
  absl::Status Restore(const std::string& tag, const std::string& state);
  // Removes the daemon's checkpoint `tag` (this uid's; NotFound if there is none). OK without
  // a daemon (no-offload, or nothing offloaded).
  absl::Status DeleteCheckpoint(const std::string& tag);
  // Checkpoint and Restore through bytes alone, for callers that keep the whole state
  // themselves (the PyTorch optimizer's state dict): the engine's state and the daemon's
  // checkpoint bytes (empty when the daemon holds nothing), which move straight out of and into
  // the daemon's pinned state through the session's staging area (OffloadTarget::ExportState,
  // ImportState): no file is written anywhere, so none is left behind by a failure or a killed
  // process, and the daemon needs no state directory. RestoreBytes: InvalidArgument for daemon
  // bytes on an engine that offloads nothing, and for none where the engine's state says the
  // daemon holds a part; all or nothing as Restore (the fresh target's state is zero again
  // after an import the daemon refused half way).
  struct Snapshot {
    std::string engine, daemon;
  };
  absl::StatusOr<Snapshot> CheckpointBytes();
  absl::Status RestoreBytes(const std::string& engine, const std::string& daemon);
  // Whether RestoreBytes(engine, daemon) on a fresh engine of this one's configuration and
  // parameters could restore them, judged without any target: the engine blob as Restore judges
  // it, and the daemon bytes whole (magic, header, size, checksum: DataLoss) holding the
  // parameters this engine offloads, as it offloads them (FailedPrecondition otherwise). What
  // it accepts, only a failing daemon can refuse. Any engine, stepped or not; changes nothing.
  absl::Status CheckState(const std::string& engine, const std::string& daemon) const;

  // Called on every weight's per-column scores (backend memory, cols floats) before top-k:
  // data-parallel replicas all-reduce (sum) them here so that they agree on the selection.
  // With update_interval auto it is also called, with param "", on the figures an automatic
  // round's length is chosen from (engine/schedule.h; 5 floats), summed the same way, so that
  // every replica chooses the same length.
  using ScoreReduce = std::function<absl::Status(const std::string& param, float* scores,
                                                 int64_t cols)>;
  void set_score_reduce(ScoreReduce fn);

 private:
  struct Impl;
  explicit ZenFlowEngine(std::unique_ptr<Impl> impl);
  // Checkpoint, with the daemon's part as bytes in *daemon (ExportState) when daemon is not
  // null; Restore, from bytes (ImportState) when daemon is not null.
  absl::StatusOr<std::string> CheckpointTo(const std::string& tag, std::string* daemon);
  absl::Status RestoreFrom(const std::string& tag, const std::string& state,
                           const std::string* daemon);
  std::unique_ptr<Impl> impl_;
};

}  // namespace stallfree
