#include "python/engine_api.h"

#include <cmath>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/session_target.h"
#include "common/dtype.h"
#include "engine/partition.h"
#include "engine/repartition.h"
#include "engine/zenflow.h"
#include "kernels/memory.h"
#include "kernels/optimizer.h"
#include "common/corpus.h"
#ifdef STALLFREE_CUDA
#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/optimizer_cuda.h"
#endif

namespace stallfree {
namespace api {
namespace {

void Check(const absl::Status& s) {
  if (s.ok()) return;
  const std::string code = absl::StatusCodeToString(s.code());
  throw Error(absl::StrCat(code, ": ", s.message()), code);
}

template <typename T>
T Take(absl::StatusOr<T> s) {
  Check(s.status());
  return std::move(*s);
}

class ConnectionImpl : public Connection {
 public:
  ConnectionImpl(std::unique_ptr<Client> c, double reattach_s)
      : client_(std::move(c)), reattach_s_(reattach_s) {}
  std::string Health() override { return Take(client_->Health()); }
  std::map<std::string, double> Stats() override {
    v1::Stats s = Take(client_->GetStats());
    return {{"sessions", static_cast<double>(s.sessions())},
            {"pinned_bytes", static_cast<double>(s.pinned_bytes())},
            {"pushes", static_cast<double>(s.pushes())},
            {"updates", static_cast<double>(s.updates())},
            {"updates_running", static_cast<double>(s.updates_running())},
            {"updates_resumed", static_cast<double>(s.updates_resumed())},
            {"pushes_resumed", static_cast<double>(s.pushes_resumed())},
            {"held_states", static_cast<double>(s.held_states())},
            {"handovers_resumed", static_cast<double>(s.handovers_resumed())},
            {"handovers_answered_again", static_cast<double>(s.handovers_answered_again())},
            {"bytes_in", static_cast<double>(s.bytes_in())},
            {"bytes_out", static_cast<double>(s.bytes_out())},
            {"migrated_columns", static_cast<double>(s.migrated_columns())},
            {"update_seconds", s.update_seconds()},
            {"accumulate_seconds", s.accumulate_seconds()},
            {"worker_threads", static_cast<double>(s.worker_threads())}};
  }
  double RpcTimeout() const override { return client_->rpc_timeout_s(); }
  double ReattachTimeout() const override { return reattach_s_; }
  Client* client() { return client_.get(); }

 private:
  std::unique_ptr<Client> client_;
  const double reattach_s_;
};

DType DTypeOf(const std::string& s, const std::string& field) {
  absl::StatusOr<DType> t = ParseDType(s);
  if (!t.ok()) throw InvalidArgument(absl::StrCat(field, ": ", t.status().message()));
  return *t;
}

ZenFlowConfig ToConfig(const EngineConfig& e) {
  ZenFlowConfig c;
  for (const auto& [name, text] : e) {
    absl::Status st = SetConfigField(&c, name, text);
    if (!st.ok()) throw InvalidArgument(std::string(st.message()));
  }
  absl::Status valid = c.Validate();
  if (!valid.ok()) throw InvalidArgument(std::string(valid.message()));
  return c;
}

// A config or timing field as the facade's Value (byte counts are far below 2^63).
Value ValueOf(bool v) { return v; }
Value ValueOf(int64_t v) { return v; }
Value ValueOf(uint64_t v) { return static_cast<int64_t>(v); }
Value ValueOf(double v) { return v; }
Value ValueOf(DType v) { return std::string(DTypeName(v)); }
Value ValueOf(OffloadMode v) { return std::string(OffloadModeName(v)); }
Value ValueOf(Transfers v) { return std::string(TransfersName(v)); }

class EngineImpl : public Engine {
 public:
  EngineImpl(std::shared_ptr<Connection> connection, const std::string& session_name, int rank,
             const EngineConfig& config, const std::vector<ParamDesc>& params,
             const std::string& device, uintptr_t stream)
      : connection_(std::move(connection)) {
    const ZenFlowConfig cfg = ToConfig(config);
    if (device == "cpu") {
      kernel_ = &kernels::DefaultCpuKernel();
      ops_ = &kernels::CpuMemory();
    } else if (device == "cuda") {
#ifdef STALLFREE_CUDA
      std::string err;
      own_kernel_ = kernels::cuda::NewCudaOptimizerKernel(reinterpret_cast<void*>(stream), &err);
      if (!own_kernel_) throw Error("the CUDA optimizer backend: " + err);
      own_ops_ = kernels::cuda::NewCudaOps(reinterpret_cast<void*>(stream), &err);
      if (!own_ops_) throw Error("the CUDA ops backend: " + err);
      kernel_ = own_kernel_.get();
      ops_ = own_ops_.get();
#else
      (void)stream;
      throw Error(
          "this build of stallfree has no CUDA backend: CUDA tensors need the package built "
          "with `bazel build --config=cuda //python:stallfree_package` (make gpu-check does)");
#endif
    } else {
      throw InvalidArgument("device: '" + device + "' is not 'cpu' or 'cuda'");
    }
    std::vector<EngineParam> ps;
    for (size_t i = 0; i < params.size(); ++i) {
      const ParamDesc& d = params[i];
      ps.push_back({d.name, d.shape, reinterpret_cast<void*>(d.value), nullptr,
                    DTypeOf(d.dtype, absl::StrCat("params[", i, "].dtype"))});
    }
    if (cfg.mode != OffloadMode::kNoOffload) {
      auto* conn = dynamic_cast<ConnectionImpl*>(connection_.get());
      if (conn == nullptr)
        throw Error(absl::StrCat("mode ", OffloadModeName(cfg.mode),
                                 " needs a daemon connection"));
      target_ = std::make_unique<SessionTarget>(
          Take(conn->client()->OpenSession(session_name, rank)), conn->ReattachTimeout());
    }
    engine_ = Take(ZenFlowEngine::Create(cfg, std::move(ps), *kernel_, *ops_, target_.get()));
  }

  ~EngineImpl() override {
    try {
      Close(true);
    } catch (...) {
    }
  }

  void Step(double lr, const std::vector<uintptr_t>& values, const std::vector<uintptr_t>& grads,
            float split_grad_scale) override {
    ZenFlowEngine& e = Live();
    if (values.size() != grads.size()) throw InvalidArgument("values and grads differ in length");
    for (size_t i = 0; i < values.size(); ++i)
      Check(e.SetBuffers(i, reinterpret_cast<void*>(values[i]),
                         reinterpret_cast<const void*>(grads[i])));
    reduce_error_.clear();
    absl::Status st = e.Step(lr, split_grad_scale);
    if (!reduce_error_.empty()) throw Error("the score reduction failed: " + reduce_error_);
    Check(st);
  }

  void Flush() override { Check(Live().Flush()); }
  void SetAdamW(double beta1, double beta2, double eps, double wd) override {
    absl::Status st = Live().SetAdamW(beta1, beta2, eps, wd);  // fails only on a bad value
    if (!st.ok()) throw InvalidArgument(std::string(st.message()));
  }
  void SetValues(const std::vector<uintptr_t>& values) override {
    ZenFlowEngine& e = Live();
    for (size_t i = 0; i < values.size(); ++i)
      Check(e.SetBuffers(i, reinterpret_cast<void*>(values[i]), nullptr));
  }
  bool OnDevice(size_t i) override { return Live().OnDevice(i); }
  bool Splits(size_t i) override { return Live().Splits(i); }
  void StageGradient(size_t i, uintptr_t grad) override {
    Check(Live().StageGradient(i, reinterpret_cast<const void*>(grad)));
  }
  int64_t StepCount() override { return Live().step(); }
  std::vector<int64_t> HotColumns(const std::string& name) override {
    return Take(Live().HotColumns(name));
  }
  Timings LastTimings() override {
    Timings out;
    VisitTimingFields(Live().last_timings(),
                      [&](const char* name, const auto& v) { out[name] = ValueOf(v); });
    return out;
  }

  std::map<std::string, int64_t> DeviceBytes() override {
    const DeviceFootprint f = Live().Footprint();
    return {{"masters", f.masters},       {"moments", f.moments},
            {"transfers", f.transfers},   {"selection", f.selection},
            {"engine", f.engine()},       {"transient_peak", f.transient_peak},
            {"params", f.params},         {"total", f.total()}};
  }

  std::string Transfers() override { return TransfersName(Live().transfers()); }

  void SetScoreReduce(ScoreReduce fn) override {
    ZenFlowEngine& e = Live();
    if (!fn) {
      e.set_score_reduce(nullptr);
      return;
    }
    const kernels::BackendMemory* ops = ops_;
    e.set_score_reduce([this, ops, fn](const std::string& name, float* scores,
                                       int64_t cols) -> absl::Status {
      std::vector<float> host(cols);
      ops->Download(host.data(), scores, cols);
      std::string err = ops->Synchronize();
      if (!err.empty()) return absl::InternalError("downloading the column scores: " + err);
      try {
        fn(name, host.data(), cols);
      } catch (const std::exception& ex) {
        reduce_error_ = ex.what();
        return absl::AbortedError("score reduction: " + reduce_error_);
      }
      ops->Upload(scores, host.data(), cols);
      err = ops->Synchronize();
      if (!err.empty()) return absl::InternalError("uploading the column scores: " + err);
      return absl::OkStatus();
    });
  }

  std::pair<std::string, std::string> Checkpoint() override {
    ZenFlowEngine::Snapshot s = Take(Live().CheckpointBytes());
    return {std::move(s.engine), std::move(s.daemon)};
  }

  void Restore(const std::string& state, const std::string& daemon) override {
    Check(Live().RestoreBytes(state, daemon));
  }

  void CheckState(const std::string& state, const std::string& daemon) override {
    Check(Live().CheckState(state, daemon));
  }

  void Close(bool flush) override {
    if (!engine_) return;
    // A close does not wait for a daemon to come back (it also runs when the interpreter
    // exits): a lost daemon fails its flush at once.
    if (target_) target_->StopReattaching();
    // Closed whatever the flush gave; then a failed flush is raised (the values may lack the
    // newest cold columns, which the caller must know).
    const absl::Status flushed = flush ? engine_->Flush() : absl::OkStatus();
    engine_.reset();
    if (target_) {
      // Unflushed, an Update may still run in the daemon, which frees the session's memory
      // only after it: wait for it (within rpc_timeout; a daemon that fails it frees anyway).
      if (const int64_t running = flush ? 0 : target_->UnseenUpdate(); running > 0)
        target_->WaitUpdate(running).IgnoreError();
      target_->session()->Close().IgnoreError();
    }
    target_.reset();
    Check(flushed);
  }
  bool closed() const override { return engine_ == nullptr; }

 private:
  ZenFlowEngine& Live() {
    if (!engine_) throw Error("the optimizer is closed");
    return *engine_;
  }
  std::shared_ptr<Connection> connection_;
  std::unique_ptr<SessionTarget> target_;  // owns the session
  std::unique_ptr<kernels::OptimizerKernel> own_kernel_;
  std::unique_ptr<kernels::BackendMemory> own_ops_;  // CUDA (its ops: cuBLAS comes with them)
  const kernels::OptimizerKernel* kernel_ = nullptr;
  const kernels::BackendMemory* ops_ = nullptr;
  std::unique_ptr<ZenFlowEngine> engine_;
  std::string reduce_error_;
};

}  // namespace

std::map<std::string, Value> ValidateConfig(const EngineConfig& config) {
  const ZenFlowConfig c = ToConfig(config);
  std::map<std::string, Value> out;
  VisitConfigFields(c, [&](const char* name, const auto& v) {
    if (config.count(name) > 0) out[name] = ValueOf(v);
  });
  return out;
}

std::map<std::string, Value> DefaultConfig() {
  const ZenFlowConfig c;
  std::map<std::string, Value> out;
  VisitConfigFields(c, [&](const char* name, const auto& v) { out[name] = ValueOf(v); });
  return out;
}

std::map<std::string, std::pair<std::string, std::string>> ResumeConflicts(
    const EngineConfig& saved, const EngineConfig& now) {
  absl::StatusOr<ConfigConflicts> out = stallfree::ResumeConflicts(saved, now);
  if (!out.ok())
    throw InvalidArgument("the saved configuration: " + std::string(out.status().message()));
  return *std::move(out);
}

double TopkForBudget(const EngineConfig& config, const std::vector<ParamDesc>& params,
                     const std::string& device, double bytes_per_param) {
  const ZenFlowConfig c = ToConfig(config);
  if (device != "cpu" && device != "cuda")
    throw InvalidArgument("device: '" + device + "' is not 'cpu' or 'cuda'");
  std::vector<ParamShape> shapes;
  for (size_t i = 0; i < params.size(); ++i)
    shapes.push_back({params[i].shape,
                      DTypeOf(params[i].dtype, absl::StrCat("params[", i, "].dtype"))});
  // The CUDA backend has a copy stream, the CPU one none (kernels/ops.h, NewCopyStream).
  absl::StatusOr<double> ratio = stallfree::TopkForBudget(
      shapes, c, TransfersAreDirect(c.transfers, /*has_copy_stream=*/device == "cuda"),
      bytes_per_param);
  if (!ratio.ok()) throw InvalidArgument(std::string(ratio.status().message()));
  return *ratio;
}

std::shared_ptr<Connection> Connection::Open(const std::string& socket, int timeout_ms,
                                             double rpc_timeout_s, double reattach_s) {
  absl::StatusOr<double> t = RpcTimeoutSeconds(rpc_timeout_s);
  if (!t.ok()) throw InvalidArgument(std::string(t.status().message()));
  if (!(reattach_s >= 0) || !std::isfinite(reattach_s))
    throw InvalidArgument("reattach_timeout: must be a finite number of seconds >= 0");
  return std::make_shared<ConnectionImpl>(Take(Client::Connect(socket, timeout_ms, *t)),
                                          reattach_s);
}

std::unique_ptr<Engine> Engine::Create(std::shared_ptr<Connection> connection,
                                       const std::string& session_name, int rank,
                                       const EngineConfig& config,
                                       const std::vector<ParamDesc>& params,
                                       const std::string& device, uintptr_t stream) {
  return std::make_unique<EngineImpl>(std::move(connection), session_name, rank, config, params,
                                      device, stream);
}

std::string DefaultCorpusText(int64_t approx_bytes, uint32_t seed) {
  return stallfree::DefaultCorpusText(approx_bytes, seed);
}

namespace {
RowLayout LayoutOf(const std::string& layout) {
  if (layout == "even") return RowLayout::kEven;
  if (layout == "fsdp2") return RowLayout::kFsdp2;
  throw InvalidArgument("layout: '" + layout + "' is not 'even' or 'fsdp2'");
}
}  // namespace

Share ShareOf(const std::vector<int64_t>& shape, int world, int rank, const std::string& layout) {
  if (world < 1 || rank < 0 || rank >= world)
    throw InvalidArgument("partition_share: needs 0 <= rank < world");
  for (int64_t d : shape)
    if (d < 0) throw InvalidArgument("partition_share: a negative dimension");
  const stallfree::ShareOf s = stallfree::ShareOfParam(shape, world, rank, LayoutOf(layout));
  return Share{s.whole.rows, s.whole.cols, s.first(), s.end(), s.block.replicated, s.shape};
}

namespace {
std::vector<WholeParam> Whole(const WholeShapes& params) {
  std::vector<WholeParam> out;
  for (const auto& [name, shape] : params) out.push_back({name, shape});
  return out;
}

}  // namespace

std::vector<int> RepartitionSources(const WholeShapes& params, int old_world, int new_world,
                                    int new_rank, const std::string& layout) {
  if (old_world < 1 || new_world < 1 || new_rank < 0 || new_rank >= new_world)
    throw InvalidArgument("repartition: needs worlds >= 1 and 0 <= new_rank < new_world");
  return SourceRanks(Whole(params), old_world, new_world, new_rank, LayoutOf(layout));
}

std::pair<std::string, std::string> Repartition(
    const WholeShapes& params,
    std::vector<std::optional<std::pair<std::string, std::string>>> old, int new_world,
    int new_rank, const std::string& layout) {
  const RowLayout rows = LayoutOf(layout);
  std::vector<PartitionedState> states(old.size());
  std::vector<const PartitionedState*> ptrs(old.size(), nullptr);
  for (size_t j = 0; j < old.size(); ++j) {
    if (!old[j]) continue;
    states[j] = {std::move(old[j]->first), std::move(old[j]->second)};
    ptrs[j] = &states[j];
  }
  PartitionedState out =
      Take(stallfree::Repartition(Whole(params), ptrs, new_world, new_rank, rows));
  return {std::move(out.engine), std::move(out.daemon)};
}

std::tuple<std::string, std::string, std::vector<RowArray>> SplitRows(
    const WholeShapes& params, std::string engine, std::string daemon, int world, int rank,
    const std::string& layout) {
  const PartitionedState share{std::move(engine), std::move(daemon)};
  stallfree::SplitState split =
      Take(stallfree::SplitRows(Whole(params), share, world, rank, LayoutOf(layout)));
  std::vector<RowArray> arrays;
  for (stallfree::RowField& f : split.fields) {
    RowArray a;
    a.param = f.param;
    a.name = stallfree::RowField::NameOf(f.name);
    a.width = f.width;
    a.int64 = f.is_int();
    a.f32 = std::move(f.f32);
    a.i64 = std::move(f.i64);
    arrays.push_back(std::move(a));
  }
  return {std::move(split.rest.engine), std::move(split.rest.daemon), std::move(arrays)};
}

std::pair<std::string, std::string> JoinRows(const WholeShapes& params, std::string rest_engine,
                                             std::string rest_daemon,
                                             std::vector<RowArray> arrays, int world, int rank,
                                             const std::string& layout) {
  std::vector<stallfree::RowField> fields;
  for (RowArray& a : arrays) {
    stallfree::RowField f;
    f.param = a.param;
    f.width = a.width;
    bool known = false;
    for (int n = stallfree::RowField::kM; n <= stallfree::RowField::kFlags; ++n)
      if (a.name == stallfree::RowField::NameOf(static_cast<stallfree::RowField::Name>(n))) {
        f.name = static_cast<stallfree::RowField::Name>(n);
        known = true;
      }
    if (!known) throw InvalidArgument("join_rows: no row array is named '" + a.name + "'");
    if (a.int64 != f.is_int())
      throw InvalidArgument("join_rows: '" + a.name + "' holds " +
                            (f.is_int() ? "int64" : "float32") + " values");
    f.f32 = std::move(a.f32);
    f.i64 = std::move(a.i64);
    fields.push_back(std::move(f));
  }
  const PartitionedState rest{std::move(rest_engine), std::move(rest_daemon)};
  PartitionedState out = Take(
      stallfree::JoinRows(Whole(params), rest, std::move(fields), world, rank, LayoutOf(layout)));
  return {std::move(out.engine), std::move(out.daemon)};
}

bool CudaEnabled() {
#ifdef STALLFREE_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace api
}  // namespace stallfree
