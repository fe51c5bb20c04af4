// _stallfree: the Python binding of stallfree's engine facade (python/engine_api.h), for the
// `stallfree` package (python/stallfree/). It sees only the facade's standard C++ types, so it
// compiles against any Python and any PyTorch (none of libtorch is used: the Python layer maps
// torch tensors onto data_ptr and shapes): Bazel builds it here against Debian's Python, and
// make gpu-check compiles this one file on the GPU machine against that machine's Python,
// linked to the facade library it carries.
//
// stallfree.Error (a RuntimeError) carries every engine and daemon failure; ValueError a bad
// argument. Engine.step releases the GIL while the engine runs; the score-reduce hook takes it
// back to call into Python.
#include <cmath>
#include <cstring>
#include <string>

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "python/engine_api.h"

namespace py = pybind11;
using stallfree::api::Connection;
using stallfree::api::Engine;

namespace {

// A config value as the engine's text (engine/zenflow.h, SetConfigField): bools as true/false,
// floats by repr (which reads back exactly), the rest by str.
std::string ConfigText(const py::handle& v) {
  if (py::isinstance<py::bool_>(v)) return v.cast<bool>() ? "true" : "false";
  if (py::isinstance<py::float_>(v)) {
    // An integral float (2.0) as an integer, so that an integer field takes it as Python does.
    const double x = v.cast<double>();
    if (std::abs(x) < 9007199254740992.0 && x == std::floor(x))
      return std::to_string(static_cast<int64_t>(x));
    return py::repr(v).cast<std::string>();
  }
  return py::str(v).cast<std::string>();
}

// {field: value} as the engine's EngineConfig; the fields are the engine's (no list here).
stallfree::api::EngineConfig ConfigFrom(const py::dict& d) {
  stallfree::api::EngineConfig c;
  for (const auto& [k, v] : d) c[py::str(k).cast<std::string>()] = ConfigText(v);
  return c;
}

// The bytes at an address of the caller's (a uint8 tensor's data_ptr and numel).
std::string BytesAt(uintptr_t at, size_t n) {
  return n == 0 ? std::string() : std::string(reinterpret_cast<const char*>(at), n);
}

// An Engine method of (engine state, daemon state) bytes as a binding of their addresses and
// sizes (uint8 tensors' data_ptr and numel), the GIL released.
template <typename Method>
auto OnStateBytes(Method method) {
  return [method](stallfree::api::Engine& e, uintptr_t state, size_t state_size,
                  uintptr_t daemon, size_t daemon_size) {
    py::gil_scoped_release release;
    (e.*method)(BytesAt(state, state_size), BytesAt(daemon, daemon_size));
  };
}

// stallfree.Error (with the status code as `code`) and ValueError from the facade's exceptions.
void BindErrors(py::module_& m) {
  static py::exception<stallfree::api::Error> error(m, "Error", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const stallfree::api::Error& e) {
      // stallfree.Error with the status code as `code` (what callers decide by, not the text).
      py::object exc = py::reinterpret_borrow<py::object>(error.ptr())(e.what());
      exc.attr("code") = e.code;
      PyErr_SetObject(error.ptr(), exc.ptr());
    } catch (const stallfree::api::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
}

void BindClient(py::module_& m) {
  py::class_<Connection, std::shared_ptr<Connection>>(m, "Client")
      .def(py::init([](const std::string& socket, int timeout_ms, double rpc_timeout,
                       double reattach) {
             py::gil_scoped_release release;
             return Connection::Open(socket, timeout_ms, rpc_timeout, reattach);
           }),
           py::arg("socket"), py::arg("timeout_ms") = 3000, py::arg("rpc_timeout") = 0.0,
           py::arg("reattach") = 0.0)
      .def("health", &Connection::Health, py::call_guard<py::gil_scoped_release>())
      .def("stats", &Connection::Stats, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rpc_timeout", &Connection::RpcTimeout)
      .def_property_readonly("reattach_timeout", &Connection::ReattachTimeout);
}

void BindEngine(py::module_& m) {
  py::class_<Engine>(m, "Engine")
      .def(py::init([](std::shared_ptr<Connection> client, const std::string& session_name,
                       int rank, const py::dict& config, const py::list& params,
                       const std::string& device, uintptr_t stream) {
             // (name, shape, value address[, dtype "fp32" | "bf16"; default fp32])
             std::vector<stallfree::api::ParamDesc> ps;
             for (const py::handle& h : params) {
               py::tuple t = h.cast<py::tuple>();
               if (t.size() != 3 && t.size() != 4)
                 throw py::value_error(
                     "params: each entry is (name, shape, value address[, dtype])");
               ps.push_back({t[0].cast<std::string>(), t[1].cast<std::vector<int64_t>>(),
                             t[2].cast<uintptr_t>(),
                             t.size() == 4 ? t[3].cast<std::string>() : std::string("fp32")});
             }
             const stallfree::api::EngineConfig cfg = ConfigFrom(config);
             py::gil_scoped_release release;
             return Engine::Create(std::move(client), session_name, rank, cfg, ps, device,
                                   stream);
           }),
           py::arg("client"), py::arg("session_name"), py::arg("rank"), py::arg("config"),
           py::arg("params"), py::arg("device") = "cpu", py::arg("stream") = 0)
      .def("step", &Engine::Step, py::arg("lr"), py::arg("values"), py::arg("grads"),
           py::arg("split_grad_scale") = 1.0f, py::call_guard<py::gil_scoped_release>())
      .def("flush", &Engine::Flush, py::call_guard<py::gil_scoped_release>())
      .def("set_adamw", &Engine::SetAdamW)
      .def("set_values", &Engine::SetValues)
      .def("on_device", &Engine::OnDevice)
      .def("splits", &Engine::Splits)
      .def("stage_gradient", &Engine::StageGradient, py::arg("index"), py::arg("grad"),
           py::call_guard<py::gil_scoped_release>())
      .def("hot_columns", &Engine::HotColumns)
      .def("last_timings", &Engine::LastTimings)
      // {masters, moments, transfers, selection, engine, transient_peak, params, total}: bytes
      // of the engine's device (backend) memory and of the parameters' values and gradients.
      .def("device_bytes", &Engine::DeviceBytes)
      .def("transfers", &Engine::Transfers)
      .def("checkpoint",
           [](Engine& e) {
             std::pair<std::string, std::string> out;
             {
               py::gil_scoped_release release;
               out = e.Checkpoint();
             }
             // bytearrays: writable, so torch.frombuffer shares them instead of copying.
             return py::make_tuple(py::bytearray(out.first), py::bytearray(out.second));
           })
      // The state and daemon bytes by address and size (a uint8 tensor's data_ptr and numel),
      // so that a checkpoint of the daemon's state is not copied once more on its way in.
      .def("restore", OnStateBytes(&Engine::Restore), py::arg("state"), py::arg("state_size"),
           py::arg("daemon"), py::arg("daemon_size"))
      // What restore() of the same bytes would refuse on a fresh engine like this one (the
      // engine state, and the daemon state whole: its checksum and parameters); changes nothing.
      .def("check_state", OnStateBytes(&Engine::CheckState), py::arg("state"),
           py::arg("state_size"), py::arg("daemon"), py::arg("daemon_size"))
      // fn(name, memoryview of cols float32) reduces the scores in place; it runs with the GIL.
      .def("set_score_reduce",
           [](Engine& e, py::object fn) {
             if (fn.is_none()) return e.SetScoreReduce(nullptr);
             // The engine may drop the hook without the GIL (Close releases it): the holder
             // takes the GIL to release the Python object.
             std::shared_ptr<py::object> held(new py::object(fn), [](py::object* o) {
               py::gil_scoped_acquire acquire;
               delete o;
             });
             e.SetScoreReduce([held](const std::string& name, float* scores, int64_t cols) {
               py::gil_scoped_acquire acquire;
               try {
                 (*held)(name, py::memoryview::from_buffer(
                              scores, {static_cast<py::ssize_t>(cols)},
                              {static_cast<py::ssize_t>(sizeof(float))}, /*readonly=*/false));
               } catch (py::error_already_set& ex) {
                 throw stallfree::api::Error(ex.what());
               }
             });
           })
      .def("close", &Engine::Close, py::arg("flush") = true,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &Engine::closed)
      .def_property_readonly("step_count", &Engine::StepCount);
}

// The engine's rules the Python layer uses: config validation, the corpus, the data-parallel
// partition and re-partitioning of saved states.
void BindFunctions(py::module_& m) {
  m.def(
      "validate_config",
      [](const py::dict& config) { return stallfree::api::ValidateConfig(ConfigFrom(config)); },
      py::arg("config"),
      "config ({field: value} of the engine's ZenFlowConfig fields) as the engine takes it, or "
      "ValueError naming the field");
  m.def("default_config", &stallfree::api::DefaultConfig,
        "{field: value} of a default ZenFlowConfig (engine/zenflow.h): the engine's defaults");
  m.def(
      "resume_conflicts",
      [](const py::dict& saved, const py::dict& now) {
        return stallfree::api::ResumeConflicts(ConfigFrom(saved), ConfigFrom(now));
      },
      py::arg("saved"), py::arg("now"),
      "{field: (saved, now)} (text) of the fields of config `now` whose value differs from the "
      "one a state saved under config `saved` ran with: empty when it may resume (transfers and "
      "stream_gradients may differ; a field saved configs lack has the value they ran with)");
  m.def(
      "topk_for_budget",
      [](const py::dict& config, const py::list& params, const std::string& device,
         double bytes_per_param) {
        std::vector<stallfree::api::ParamDesc> ps;
        for (const auto& item : params) {
          py::tuple t = item.cast<py::tuple>();
          stallfree::api::ParamDesc d;
          d.shape = t[0].cast<std::vector<int64_t>>();
          d.dtype = t[1].cast<std::string>();
          ps.push_back(std::move(d));
        }
        return stallfree::api::TopkForBudget(ConfigFrom(config), ps, device, bytes_per_param);
      },
      py::arg("config"), py::arg("params"), py::arg("device"), py::arg("bytes_per_param"),
      "the topk_ratio a device budget of bytes_per_param buys for params [(shape, dtype)] on "
      "device ('cpu' or 'cuda'), or ValueError naming device_budget");
  m.def("default_corpus_text",
        [](int64_t approx_bytes, uint32_t seed) {
          return py::bytes(stallfree::api::DefaultCorpusText(approx_bytes, seed));
        },
        py::arg("approx_bytes") = int64_t{1} << 20, py::arg("seed") = 1);
  m.def("partition_share",
        [](const std::vector<int64_t>& shape, int world, int rank, const std::string& layout) {
          const stallfree::api::Share s = stallfree::api::ShareOf(shape, world, rank, layout);
          py::dict d;
          d["rows"] = s.rows;
          d["cols"] = s.cols;
          d["first"] = s.first;
          d["end"] = s.end;
          d["replicated"] = s.replicated;
          d["shape"] = s.shape;
          return d;
        },
        py::arg("shape"), py::arg("world"), py::arg("rank"), py::arg("layout") = "even",
        "{rows, cols, first, end, replicated, shape}: a parameter of `shape` as rows x cols and "
        "rank's share of it over world ranks (its elements [first, end); the shape the rank's "
        "engine sees); layout: 'even' (ZenFlowAdamW's own partition) or 'fsdp2' (fully_shard's "
        "chunks of dimension 0)");
  m.def("repartition_sources", &stallfree::api::RepartitionSources, py::arg("params"),
        py::arg("old_world"), py::arg("new_world"), py::arg("new_rank"),
        py::arg("layout") = "even",
        "the old ranks whose states rank new_rank of new_world needs (engine/repartition.h); "
        "layout: 'even' (ZenFlowAdamW's own partition) or 'fsdp2' (fully_shard's chunks)");
  // old: per old rank, (state address, size, daemon address, size) of its uint8 tensors, or
  // None where not needed; returns rank new_rank's (state, daemon) as bytearrays.
  m.def(
      "repartition",
      [](const stallfree::api::WholeShapes& params, const py::list& old, int new_world,
         int new_rank, const std::string& layout) {
        std::vector<std::optional<std::pair<std::string, std::string>>> held(old.size());
        for (size_t j = 0; j < old.size(); ++j) {
          if (old[j].is_none()) continue;
          py::tuple t = old[j].cast<py::tuple>();
          held[j].emplace(BytesAt(t[0].cast<uintptr_t>(), t[1].cast<size_t>()),
                          BytesAt(t[2].cast<uintptr_t>(), t[3].cast<size_t>()));
        }
        std::pair<std::string, std::string> out;
        {
          py::gil_scoped_release release;
          out = stallfree::api::Repartition(params, std::move(held), new_world, new_rank,
                                            layout);
        }
        return py::make_tuple(py::bytearray(out.first), py::bytearray(out.second));
      },
      py::arg("params"), py::arg("old"), py::arg("new_world"), py::arg("new_rank"),
      py::arg("layout") = "even");
  // A share's (engine state, daemon checkpoint), given by (address, size) of its uint8 tensors,
  // as (rest engine, rest daemon, [(param, name, width, int64, bytearray)]).
  m.def(
      "split_rows",
      [](const stallfree::api::WholeShapes& params, uintptr_t engine, size_t engine_size,
         uintptr_t daemon, size_t daemon_size, int world, int rank, const std::string& layout) {
        std::string e = BytesAt(engine, engine_size), d = BytesAt(daemon, daemon_size);
        std::tuple<std::string, std::string, std::vector<stallfree::api::RowArray>> out;
        {
          py::gil_scoped_release release;
          out = stallfree::api::SplitRows(params, std::move(e), std::move(d), world, rank,
                                          layout);
        }
        py::list arrays;
        for (stallfree::api::RowArray& a : std::get<2>(out)) {
          const char* data = a.int64 ? reinterpret_cast<const char*>(a.i64.data())
                                     : reinterpret_cast<const char*>(a.f32.data());
          const size_t bytes = a.int64 ? a.i64.size() * 8 : a.f32.size() * 4;
          arrays.append(py::make_tuple(a.param, a.name, a.width, a.int64,
                                       py::bytearray(data, bytes)));
          std::vector<float>().swap(a.f32);  // each array held once at a time
          std::vector<int64_t>().swap(a.i64);
        }
        return py::make_tuple(py::bytearray(std::get<0>(out)), py::bytearray(std::get<1>(out)),
                              arrays);
      },
      py::arg("params"), py::arg("engine"), py::arg("engine_size"), py::arg("daemon"),
      py::arg("daemon_size"), py::arg("world"), py::arg("rank"), py::arg("layout") = "fsdp2",
      "a share's state (engine/repartition.h, SplitRows) as its rest and per-row arrays");
  // The rest's bytes and arrays [(param, name, width, int64, address, size)] -> this rank's
  // (state, daemon) as bytearrays.
  m.def(
      "join_rows",
      [](const stallfree::api::WholeShapes& params, const py::bytes& rest_engine,
         const py::bytes& rest_daemon, const py::list& arrays, int world, int rank,
         const std::string& layout) {
        std::vector<stallfree::api::RowArray> in;
        for (const py::handle& h : arrays) {
          py::tuple t = h.cast<py::tuple>();
          stallfree::api::RowArray a;
          a.param = t[0].cast<int>();
          a.name = t[1].cast<std::string>();
          a.width = t[2].cast<int64_t>();
          a.int64 = t[3].cast<bool>();
          const auto* at = reinterpret_cast<const char*>(t[4].cast<uintptr_t>());
          const size_t bytes = t[5].cast<size_t>(), elem = a.int64 ? 8 : 4;
          if (bytes % elem != 0)
            throw stallfree::api::InvalidArgument("join_rows: '" + a.name + "' has " +
                                                  std::to_string(bytes) + " bytes, not whole " +
                                                  (a.int64 ? "int64" : "float32") + " values");
          if (a.int64) a.i64.resize(bytes / 8);
          else a.f32.resize(bytes / 4);
          if (bytes > 0)
            memcpy(a.int64 ? static_cast<void*>(a.i64.data()) : static_cast<void*>(a.f32.data()),
                   at, bytes);
          in.push_back(std::move(a));
        }
        std::string e = rest_engine, d = rest_daemon;
        std::pair<std::string, std::string> out;
        {
          py::gil_scoped_release release;
          out = stallfree::api::JoinRows(params, std::move(e), std::move(d), std::move(in),
                                         world, rank, layout);
        }
        return py::make_tuple(py::bytearray(out.first), py::bytearray(out.second));
      },
      py::arg("params"), py::arg("rest_engine"), py::arg("rest_daemon"), py::arg("arrays"),
      py::arg("world"), py::arg("rank"), py::arg("layout") = "fsdp2",
      "this rank's state from a split's rest and its own rows (engine/repartition.h, JoinRows)");
}

}  // namespace

PYBIND11_MODULE(_stallfree, m) {
  m.doc() = "stallfree's client library and ZenFlow engine (use the `stallfree` package)";
  BindErrors(m);
  BindClient(m);
  BindEngine(m);
  BindFunctions(m);
  m.attr("cuda_enabled") = stallfree::api::CudaEnabled();
}
