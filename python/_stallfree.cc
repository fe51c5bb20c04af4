// _stallfree: the Python binding of the client library and the ZenFlow engine, for the
// `stallfree` package (python/stallfree/). It deals only in pointers, shapes and a stream
// handle, never in libtorch types, so the same source builds against any Python and any
// PyTorch: the Python layer maps torch tensors onto EngineParams (data_ptr, shape).
//
// Errors: every absl::Status that is not OK becomes stallfree.Error (a RuntimeError) with the
// status code's name and message. Engine.step releases the GIL while the engine runs; the
// score-reduce hook (data-parallel selection) takes it back to call into Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/zenflow.h"
#include "kernels/ops.h"
#include "kernels/optimizer.h"
#include "trainer/data.h"
#ifdef STALLFREE_CUDA
#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/optimizer_cuda.h"
#endif

namespace py = pybind11;

namespace stallfree {
namespace {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void Check(const absl::Status& s) {
  if (!s.ok()) throw Error(std::string(absl::StatusCodeToString(s.code())) + ": " +
                           std::string(s.message()));
}

template <typename T>
T Take(absl::StatusOr<T> s) {
  Check(s.status());
  return std::move(*s);
}

// A connection to one daemon, shared by the engines (one session each) that use it.
class PyClient {
 public:
  PyClient(const std::string& socket, int timeout_ms)
      : client_(Take(Client::Connect(socket, timeout_ms))) {}
  Client* get() { return client_.get(); }
  std::string Health() { return Take(client_->Health()); }
  py::dict Stats() {
    v1::Stats s = Take(client_->GetStats());
    py::dict d;
    d["sessions"] = s.sessions();
    d["pinned_bytes"] = s.pinned_bytes();
    d["pushes"] = s.pushes();
    d["updates"] = s.updates();
    d["bytes_in"] = s.bytes_in();
    d["bytes_out"] = s.bytes_out();
    d["migrated_columns"] = s.migrated_columns();
    return d;
  }

 private:
  std::unique_ptr<Client> client_;
};

ZenFlowConfig ConfigFrom(const py::dict& d) {
  ZenFlowConfig c;
  auto mode = ParseOffloadMode(d["mode"].cast<std::string>());
  if (!mode.ok()) throw py::value_error(std::string(mode.status().message()));
  c.mode = *mode;
  c.topk_ratio = d["topk_ratio"].cast<double>();
  c.update_interval = d["update_interval"].cast<int64_t>();
  c.select_interval = d["select_interval"].cast<int64_t>();
  c.warmup_steps = d["warmup_steps"].cast<int64_t>();
  c.await_updates = d["await_updates"].cast<bool>();
  c.beta1 = d["beta1"].cast<double>();
  c.beta2 = d["beta2"].cast<double>();
  c.eps = d["eps"].cast<double>();
  c.weight_decay = d["weight_decay"].cast<double>();
  auto dtype = [](const std::string& s, const char* field) {
    if (s == "fp32") return v1::DTYPE_FP32;
    if (s == "bf16") return v1::DTYPE_BF16;
    throw py::value_error(absl::StrCat(field, ": '", s, "' is not 'bf16' or 'fp32'"));
  };
  c.grad_dtype = dtype(d["grad_dtype"].cast<std::string>(), "grad_dtype");
  c.param_dtype = dtype(d["param_dtype"].cast<std::string>(), "param_dtype");
  absl::Status valid = c.Validate();
  if (!valid.ok()) throw py::value_error(std::string(valid.message()));
  return c;
}

// One ZenFlow engine over one daemon session (none in no-offload mode).
class PyEngine {
 public:
  PyEngine(std::shared_ptr<PyClient> client, const std::string& session_name, int rank,
           const py::dict& config, const py::list& params, const std::string& device,
           uintptr_t stream)
      : client_(std::move(client)) {
    const ZenFlowConfig cfg = ConfigFrom(config);
    if (device == "cpu") {
      kernel_ = &kernels::DefaultCpuKernel();
      ops_ = &kernels::CpuOps();
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
          "this build of stallfree has no CUDA backend: CUDA tensors need the extension built "
          "with `bazel build --config=cuda //python:stallfree`");
#endif
    } else {
      throw py::value_error("device: '" + device + "' is not 'cpu' or 'cuda'");
    }
    std::vector<EngineParam> ps;
    for (const py::handle& h : params) {
      py::tuple t = h.cast<py::tuple>();
      EngineParam p;
      p.name = t[0].cast<std::string>();
      p.shape = t[1].cast<std::vector<int64_t>>();
      p.value = reinterpret_cast<float*>(t[2].cast<uintptr_t>());
      ps.push_back(std::move(p));
    }
    if (cfg.mode != OffloadMode::kNoOffload) {
      if (!client_) throw Error("mode " + std::string(OffloadModeName(cfg.mode)) +
                                " needs a daemon connection");
      session_ = Take(client_->get()->OpenSession(session_name, rank));
    }
    engine_ = Take(ZenFlowEngine::Create(cfg, std::move(ps), *kernel_, *ops_, session_.get()));
  }

  ~PyEngine() { Close(); }

  void Step(double lr, const std::vector<uintptr_t>& values,
            const std::vector<uintptr_t>& grads) {
    ZenFlowEngine& e = Engine();
    if (values.size() != grads.size()) throw py::value_error("values and grads differ in length");
    for (size_t i = 0; i < values.size(); ++i)
      Check(e.SetBuffers(i, reinterpret_cast<float*>(values[i]),
                         reinterpret_cast<const float*>(grads[i])));
    absl::Status st;
    {
      py::gil_scoped_release release;
      st = e.Step(lr);
    }
    if (!reduce_error_.empty()) {
      std::string why = reduce_error_;
      reduce_error_.clear();
      throw Error("the score reduction failed: " + why);
    }
    Check(st);
  }

  void Flush() {
    ZenFlowEngine& e = Engine();
    absl::Status st;
    {
      py::gil_scoped_release release;
      st = e.Flush();
    }
    Check(st);
  }

  void SetAdamW(double beta1, double beta2, double eps, double wd) {
    absl::Status st = Engine().SetAdamW(beta1, beta2, eps, wd);
    if (!st.ok()) throw py::value_error(std::string(st.message()));
  }

  bool OnDevice(size_t i) { return Engine().OnDevice(i); }
  int64_t StepCount() { return Engine().step(); }
  std::vector<int64_t> HotColumns(const std::string& name) {
    return Take(Engine().HotColumns(name));
  }

  py::dict LastTimings() {
    const StepTimings& t = Engine().last_timings();
    py::dict d;
    d["step"] = t.step;
    d["optimizer"] = t.optimizer;
    d["copies"] = t.copies;
    d["stall"] = t.stall;
    d["total"] = t.total;
    d["bytes_to_host"] = t.bytes_to_host;
    d["bytes_to_device"] = t.bytes_to_device;
    d["boundary"] = t.boundary;
    d["reselected"] = t.reselected;
    d["migrated_columns"] = t.migrated_columns;
    return d;
  }

  // The engine's state and the daemon's checkpoint bytes (empty when the daemon holds nothing
  // yet, or in no-offload mode). Values must be bound (a Step ran, or SetValues).
  py::tuple Checkpoint() {
    ZenFlowEngine& e = Engine();
    std::string state, daemon;
    absl::Status st;
    {
      py::gil_scoped_release release;
      const std::string tag = Tag();
      absl::StatusOr<std::string> s = e.Checkpoint(tag);
      st = s.status();
      if (st.ok()) state = std::move(*s);
      if (st.ok() && session_ && DaemonHoldsState()) {
        absl::StatusOr<std::string> d = session_->ReadCheckpointBytes(tag, /*delete_after=*/true);
        st = d.status();
        if (st.ok()) daemon = std::move(*d);
      }
    }
    Check(st);
    return py::make_tuple(py::bytes(state), py::bytes(daemon));
  }

  void Restore(const std::string& state, const std::string& daemon) {
    ZenFlowEngine& e = Engine();
    absl::Status st;
    {
      py::gil_scoped_release release;
      const std::string tag = Tag();
      if (!daemon.empty()) {
        if (!session_)
          st = absl::InvalidArgumentError(
              "the state holds a daemon checkpoint but this optimizer runs without a daemon "
              "(no-offload)");
        else
          st = session_->WriteCheckpointBytes(tag, daemon);
      }
      if (st.ok()) st = e.Restore(tag, state);
      if (!daemon.empty() && session_) {
        absl::Status del = session_->DeleteCheckpoint(tag);
        if (st.ok() && !del.ok() && del.code() != absl::StatusCode::kNotFound) st = del;
      }
    }
    Check(st);
  }

  void SetValues(const std::vector<uintptr_t>& values) {
    ZenFlowEngine& e = Engine();
    for (size_t i = 0; i < values.size(); ++i)
      Check(e.SetBuffers(i, reinterpret_cast<float*>(values[i]), nullptr));
  }

  // Called with (name, memoryview of cols float32 on the host) before each top-k; the callable
  // reduces the scores in place (e.g. torch.distributed.all_reduce).
  void SetScoreReduce(py::object fn) {
    if (fn.is_none()) {
      Engine().set_score_reduce(nullptr);
      return;
    }
    reduce_fn_ = fn;
    const kernels::TransformerOps* ops = ops_;
    Engine().set_score_reduce([this, ops](const std::string& name, float* scores,
                                          int64_t cols) -> absl::Status {
      std::vector<float> host(cols);
      ops->Download(host.data(), scores, cols);
      std::string err = ops->Synchronize();
      if (!err.empty()) return absl::InternalError("downloading the column scores: " + err);
      {
        py::gil_scoped_acquire acquire;
        try {
          py::memoryview view = py::memoryview::from_buffer(
              host.data(), {static_cast<py::ssize_t>(cols)},
              {static_cast<py::ssize_t>(sizeof(float))}, /*readonly=*/false);
          reduce_fn_(name, view);
        } catch (py::error_already_set& e) {
          reduce_error_ = e.what();
          return absl::AbortedError("score reduction: " + reduce_error_);
        }
      }
      ops->Upload(scores, host.data(), cols);
      err = ops->Synchronize();
      if (!err.empty()) return absl::InternalError("uploading the column scores: " + err);
      return absl::OkStatus();
    });
  }

  void Close() {
    if (engine_) {
      py::gil_scoped_release release;
      engine_->Flush().IgnoreError();
      engine_.reset();
      if (session_) session_->Close().IgnoreError();
      session_.reset();
    }
  }

  bool closed() const { return engine_ == nullptr; }

 private:
  ZenFlowEngine& Engine() {
    if (!engine_) throw Error("the optimizer is closed");
    return *engine_;
  }
  bool DaemonHoldsState() const { return session_ && session_->layout().params_size() > 0 &&
                                         engine_->step() > 0; }
  std::string Tag() {
    static std::atomic<int64_t> counter{0};
    return absl::StrCat("torch-", session_ ? session_->ref().session_id() : 0, "-", getpid(), "-",
                        counter.fetch_add(1));
  }

  std::shared_ptr<PyClient> client_;
  std::unique_ptr<Session> session_;
  std::unique_ptr<kernels::OptimizerKernel> own_kernel_;
  std::unique_ptr<kernels::TransformerOps> own_ops_;
  const kernels::OptimizerKernel* kernel_ = nullptr;
  const kernels::TransformerOps* ops_ = nullptr;
  std::unique_ptr<ZenFlowEngine> engine_;
  py::object reduce_fn_;
  std::string reduce_error_;
};

}  // namespace
}  // namespace stallfree

PYBIND11_MODULE(_stallfree, m) {
  using namespace stallfree;
  m.doc() = "stallfree's client library and ZenFlow engine (use the `stallfree` package)";
  py::register_exception<Error>(m, "Error", PyExc_RuntimeError);

  py::class_<PyClient, std::shared_ptr<PyClient>>(m, "Client")
      .def(py::init<const std::string&, int>(), py::arg("socket"), py::arg("timeout_ms") = 3000)
      .def("health", &PyClient::Health)
      .def("stats", &PyClient::Stats);

  py::class_<PyEngine>(m, "Engine", py::dynamic_attr())
      .def(py::init<std::shared_ptr<PyClient>, const std::string&, int, const py::dict&,
                    const py::list&, const std::string&, uintptr_t>(),
           py::arg("client"), py::arg("session_name"), py::arg("rank"), py::arg("config"),
           py::arg("params"), py::arg("device") = "cpu", py::arg("stream") = 0)
      .def("step", &PyEngine::Step, py::arg("lr"), py::arg("values"), py::arg("grads"))
      .def("flush", &PyEngine::Flush)
      .def("set_adamw", &PyEngine::SetAdamW)
      .def("set_values", &PyEngine::SetValues)
      .def("on_device", &PyEngine::OnDevice)
      .def("hot_columns", &PyEngine::HotColumns)
      .def("last_timings", &PyEngine::LastTimings)
      .def("checkpoint", &PyEngine::Checkpoint)
      .def("restore", &PyEngine::Restore)
      .def("set_score_reduce", &PyEngine::SetScoreReduce)
      .def("close", &PyEngine::Close)
      .def_property_readonly("closed", &PyEngine::closed)
      .def_property_readonly("step_count", &PyEngine::StepCount);

  m.def("default_corpus_text",
        [](int64_t approx_bytes, uint32_t seed) {
          return py::bytes(DefaultCorpusText(approx_bytes, seed));
        },
        py::arg("approx_bytes") = int64_t{1} << 20, py::arg("seed") = 1);
  m.attr("cuda_enabled") =
#ifdef STALLFREE_CUDA
      true;
#else
      false;
#endif
}
