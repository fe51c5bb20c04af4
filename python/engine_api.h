// The engine facade under the Python binding: the client library and the ZenFlow engine behind
// an interface of standard C++ types only (strings, vectors, pointers as integers, a stream
// handle), with no gRPC, Abseil, Python or libtorch header in sight. The binding
// (_stallfree.cc) is then a thin pybind11 layer that can be compiled against any Python
// (Debian's 3.11 here, the GPU machine's own in make gpu-check) and linked against this facade,
// built once as libstallfree_engine.so.
//
// Errors are thrown as stallfree::api::Error (code name and message of the absl::Status, e.g.
// "FAILED_PRECONDITION: ...") or, for a bad argument, stallfree::api::InvalidArgument.
// Thread safety: as ZenFlowEngine (one thread per Engine); Connection is thread safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

namespace stallfree {
namespace api {

// code: the absl::StatusCode's name ("UNAVAILABLE": the daemon went away, client/client.h), or
// "" for an error of the facade itself. Python sees it as stallfree.Error's `code`.
struct Error : std::runtime_error {
  explicit Error(const std::string& what, std::string status_code = "")
      : std::runtime_error(what), code(std::move(status_code)) {}
  std::string code;
};
struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A connection to one stallfreed, shared by the engines that open sessions on it.
class Connection {
 public:
  // timeout_ms: for the connection; rpc_timeout_s: the bound of every call after it (client.h,
  // Deadlines; 0: $STALLFREE_RPC_TIMEOUT, else 120 s): a daemon that does not answer within it
  // is an Error with code DEADLINE_EXCEEDED naming the socket, the call and the bound.
  // reattach_s > 0: an engine's session on it survives the daemon's going away: its next call
  // waits up to reattach_s for a daemon at the same socket (a restarted stallfreed) and goes on
  // there with the session's state as it was (client/session_target.h).
  static std::shared_ptr<Connection> Open(const std::string& socket, int timeout_ms,
                                          double rpc_timeout_s = 0, double reattach_s = 0);
  virtual ~Connection() = default;
  virtual std::string Health() = 0;
  virtual std::map<std::string, double> Stats() = 0;
  // The bound of every call, in seconds (what Open's rpc_timeout_s resolved to).
  virtual double RpcTimeout() const = 0;
  virtual double ReattachTimeout() const = 0;
};

// A field of the engine's config or timings (enums by name).
using Value = std::variant<bool, int64_t, double, std::string>;

// ZenFlowConfig's fields by name as text (engine/zenflow.h, ConfigFields and SetConfigField:
// the engine's one list of them); a field not given keeps ZenFlowConfig's default.
using EngineConfig = std::map<std::string, std::string>;
// The given fields as the engine took them (typed: "4" of an integer field is 4), or
// InvalidArgument naming the field unless the engine accepts `config` (what Engine::Create
// checks first).
std::map<std::string, Value> ValidateConfig(const EngineConfig& config);
// Every field of a default ZenFlowConfig (engine/zenflow.h), typed: the one statement of the
// engine's defaults, which the Python optimizer's signature takes its own from.
std::map<std::string, Value> DefaultConfig();
// The fields of `now` whose value differs from the one `saved` (a state's configuration) ran
// with, {field: (saved, now)} as text: the engine's rule of which configurations may resume a
// saved state (engine/zenflow.h, ResumeConflicts). InvalidArgument for a saved field that is
// not one or not of its type.
std::map<std::string, std::pair<std::string, std::string>> ResumeConflicts(
    const EngineConfig& saved, const EngineConfig& now);

struct ParamDesc {
  std::string name;
  std::vector<int64_t> shape;
  uintptr_t value = 0;  // contiguous, in the device's memory, of `dtype`
  // "fp32" or "bf16": the value's and the gradient's dtype (EngineParam::dtype; a bf16
  // parameter's fp32 masters are the engine's and the daemon's).
  std::string dtype = "fp32";
};

// StepTimings of the last Step by field name (engine/zenflow.h, VisitTimingFields).
using Timings = std::map<std::string, Value>;

// Reduces one weight's column scores (host memory, cols floats) in place, across data-parallel
// replicas. Throwing aborts the Step (the exception's what() is in the Error).
using ScoreReduce = std::function<void(const std::string& name, float* scores, int64_t cols)>;

// One ZenFlow engine and (unless no-offload) its own session on `connection`.
class Engine {
 public:
  // device: "cpu", or "cuda" in builds with the CUDA backend (kernels enqueued on `stream`, a
  // cudaStream_t, e.g. PyTorch's current stream).
  static std::unique_ptr<Engine> Create(std::shared_ptr<Connection> connection,
                                        const std::string& session_name, int rank,
                                        const EngineConfig& config,
                                        const std::vector<ParamDesc>& params,
                                        const std::string& device, uintptr_t stream);
  virtual ~Engine() = default;

  // Binds each parameter's value and gradient (0: no gradient this step; skipped as
  // torch.optim.AdamW skips it) and runs ZenFlowEngine::Step(lr, split_grad_scale).
  virtual void Step(double lr, const std::vector<uintptr_t>& values,
                    const std::vector<uintptr_t>& grads, float split_grad_scale) = 0;
  virtual void Flush() = 0;
  virtual void SetAdamW(double beta1, double beta2, double eps, double weight_decay) = 0;
  virtual void SetValues(const std::vector<uintptr_t>& values) = 0;
  virtual void SetScoreReduce(ScoreReduce fn) = 0;
  virtual bool OnDevice(size_t index) = 0;
  // ZenFlowEngine::Splits and ::StageGradient (the gradient's address, of the parameter's dtype;
  // the caller may free it when this returns).
  virtual bool Splits(size_t index) = 0;
  virtual void StageGradient(size_t index, uintptr_t grad) = 0;
  virtual int64_t StepCount() = 0;
  virtual std::vector<int64_t> HotColumns(const std::string& name) = 0;
  virtual Timings LastTimings() = 0;
  // The engine's backend memory in bytes (ZenFlowEngine::Footprint): "masters", "moments",
  // "transfers", "selection", their sum "engine", the largest transient "transient_peak", the
  // parameters' own values and gradients "params", and "total" = engine + params.
  virtual std::map<std::string, int64_t> DeviceBytes() = 0;
  // The transfers in use: "direct" or "buffered" (what "auto" chose).
  virtual std::string Transfers() = 0;
  // The engine's state and the daemon session's checkpoint bytes (empty without daemon state).
  // Between Steps; does not change the run.
  virtual std::pair<std::string, std::string> Checkpoint() = 0;
  // The inverse, on a fresh engine (no Step yet) whose values hold the checkpointed values.
  virtual void Restore(const std::string& state, const std::string& daemon) = 0;
  // Throws the Error Restore(state, daemon) would throw on a fresh engine of this one's
  // configuration, as far as the state can tell (ZenFlowEngine::CheckState); changes nothing.
  virtual void CheckState(const std::string& state, const std::string& daemon) = 0;
  // Waits for offload work and, with `flush`, writes the newest cold columns into the values
  // (ZenFlowEngine::Flush); then closes the session. Without `flush` the values are left as they
  // are (an engine being replaced by a restored one must not write its state over a model just
  // loaded), and an Update the daemon still runs for the session is waited for (within
  // rpc_timeout), so that the daemon has freed the session's memory when Close returns: a
  // replacing engine's session can take it. Any later call throws Error. A failed flush throws
  // its Error once the engine and the session are closed.
  virtual void Close(bool flush = true) = 0;
  virtual bool closed() const = 0;
};

// The hot share (topk_ratio) a device-memory budget buys (engine/zenflow.h, TopkForBudget):
// `params` by shape and dtype only (their values are not read), `device` "cpu" (direct
// transfers under "auto") or "cuda" (buffered under "auto"). InvalidArgument naming
// device_budget when it is too small or the mode is not zenflow.
double TopkForBudget(const EngineConfig& config, const std::vector<ParamDesc>& params,
                     const std::string& device, double bytes_per_param);

// The generated corpus of common/corpus.h (DefaultCorpusText).
std::string DefaultCorpusText(int64_t approx_bytes, uint32_t seed);

// Whether this build has the CUDA backend.
bool CudaEnabled();

// Rank `rank`'s share of a parameter of `shape` over `world` data-parallel ranks
// (engine/partition.h, the rule the trainer uses too): the parameter as rows x cols, the share's
// elements [first, end), whether every rank holds it whole, and the shape the rank's engine sees.
struct Share {
  int64_t rows = 1, cols = 1, first = 0, end = 0;
  bool replicated = false;
  std::vector<int64_t> shape;
};
// layout: "even" (this partition) or "fsdp2" (fully_shard's chunks of dimension 0).
Share ShareOf(const std::vector<int64_t>& shape, int world, int rank,
              const std::string& layout = "even");

// A group's parameters, whole (name, shape), in the engine's order.
using WholeShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;
// The ranks of an old partition over old_world whose states rank new_rank of new_world needs
// (engine/repartition.h).
// layout: who cut the rows, "even" (this partition) or "fsdp2" (FSDP2's fully_shard); see
// engine/partition.h, RowLayout.
std::vector<int> RepartitionSources(const WholeShapes& params, int old_world, int new_world,
                                    int new_rank, const std::string& layout);
// Rank new_rank of new_world's (engine state, daemon checkpoint) from the old ranks' (old[j]:
// rank j's pair, moved in, or empty where not needed), in memory.
std::pair<std::string, std::string> Repartition(
    const WholeShapes& params,
    std::vector<std::optional<std::pair<std::string, std::string>>> old, int new_world,
    int new_rank, const std::string& layout);

// One per-row array of a share's state (engine/repartition.h, RowField): its parameter in the
// group, its name ("m", "hot_master", "daemon_steps", ...), its values per row, and its values:
// fp32, or int64 where `int64`.
struct RowArray {
  int param = 0;
  std::string name;
  int64_t width = 0;
  bool int64 = false;
  std::vector<float> f32;
  std::vector<int64_t> i64;
};
// A share's (engine state, daemon checkpoint) as the rest (engine, daemon) and its per-row
// arrays (engine/repartition.h, SplitRows), and back (JoinRows).
std::tuple<std::string, std::string, std::vector<RowArray>> SplitRows(
    const WholeShapes& params, std::string engine, std::string daemon, int world, int rank,
    const std::string& layout);
std::pair<std::string, std::string> JoinRows(const WholeShapes& params, std::string rest_engine,
                                             std::string rest_daemon,
                                             std::vector<RowArray> arrays, int world, int rank,
                                             const std::string& layout);

}  // namespace api
}  // namespace stallfree
