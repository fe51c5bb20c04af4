// offload_modeled_bench: what ZenFlow saves in step time on a large model. The ZenFlow engine
// (engine/zenflow.h) runs in its three modes — zenflow, sync-offload (ZeRO-Offload behaviour) and
// no-offload — for a GPT of >= 0.5B parameters whose device is bench/modeled_device.h (virtual
// memory, operations that take their modeled time on an H100-like device and PCIe Gen5 link),
// against one real stallfreed that does its real work on every offloaded element (accumulating
// real bf16 gradients, AdamW over fp32 master and moments, bf16 parameters out). Forward and
// backward are a modeled wait of 6 * params * tokens / FLOP/s per step.
//
//   bazel run //bench:offload_modeled_bench [-- --quick] [--help for the rest]
//
// Per mode: step time, stall and host traffic; then the daemon's update rate against its fused
// boundary kernel run alone in this process on the daemon's own blocks. Ends with FIGURE lines:
// zenflow_vs_sync_offload_speedup_modeled, zenflow_stall_reduction_modeled,
// zenflow_host_traffic_per_step, zenflow_vs_nooffload_step_modeled,
// daemon_update_fraction_of_fused_kernel and the per-mode figures they come from. --quick (a
// 0.11B model) finishes within about 60 s on 2 cores.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/modeled_device.h"
#include "bench/offload_harness.h"
#include "common/bf16.h"
#include "common/flags.h"
#include "engine/zenflow.h"
#include "kernels/ops.h"
#include "kernels/optimizer.h"

namespace stallfree {
namespace bench {
namespace {

struct Options {
  EngineOptions engine;
  bool quick = false;
  // 0: the default, 19 / 1280 / 3456 / 50304 (0.505B parameters), or with --quick
  // 8 / 768 / 2048 / 32000 (0.11B).
  int64_t big_layers = 0, big_dim = 0, big_ff = 0, big_vocab = 0;
  bool big_default = false;  // none of the four was given
  int64_t tokens = 32768;
  double tflops = 400, hbm_tbps = 3.0, pcie_gbps = 50, launch_us = 4;
  int64_t big_steps = 0, big_select = 0;
  bool check_memory = true;
};

// Parses the flags into *o and fills in the defaults that depend on --quick; -1 to go on, else
// the exit code.
int ParseOptions(int argc, char** argv, Options* o) {
  FlagSet flags(
      "offload_modeled_bench",
      "ZenFlow vs sync-offload (ZeRO-Offload) vs no-offload on one stallfreed: a >= "
      "0.5B-parameter GPT on a modeled H100 + PCIe Gen5 device with the daemon doing its real "
      "work (step time, stall, host traffic). Ends with FIGURE lines.");
  flags.AddBool("quick", &o->quick,
                "a 0.11B model and fewer steps (finishes within about 60 s on 2 cores)");
  AddEngineFlags(&flags, &o->engine);
  flags.AddInt("big_layers", &o->big_layers, "transformer blocks (0: 19, --quick 8)");
  flags.AddInt("big_dim", &o->big_dim, "model width (0: 1280, --quick 768)");
  flags.AddInt("big_ff", &o->big_ff, "SwiGLU hidden width (0: 3456, --quick 2048)");
  flags.AddInt("big_vocab", &o->big_vocab,
               "vocabulary, untied embedding and head (0: 50304, --quick 32000)");
  flags.AddInt("tokens", &o->tokens, "tokens per step (forward + backward = 6 N tokens FLOPs)");
  flags.AddDouble("device_tflops", &o->tflops,
                  "effective device TFLOP/s (bf16, at the stated MFU)");
  flags.AddDouble("hbm_tbps", &o->hbm_tbps,
                  "effective HBM bandwidth of element-wise kernels, TB/s");
  flags.AddDouble("pcie_gbps", &o->pcie_gbps,
                  "effective host<->device bandwidth per direction, GB/s");
  flags.AddDouble("launch_us", &o->launch_us, "modeled launch latency per device operation, us");
  flags.AddInt("big_steps", &o->big_steps,
               "timed zenflow steps, a multiple of S (0: 2 S with --quick, else 4 S); "
               "sync-offload and no-offload time half as many");
  flags.AddInt("big_select", &o->big_select,
               "zenflow select_interval (0: 2 S with --quick so that the timed steps include a "
               "reselection, else 4 S, the engine's default)");
  flags.AddBool("check_memory", &o->check_memory,
                "drop blocks until the daemon's sessions fit in MemAvailable");
  if (int code = flags.ParseCommandLine(argc, argv); code >= 0) return code;
  o->big_default = o->big_layers <= 0 && o->big_dim <= 0 && o->big_ff <= 0 && o->big_vocab <= 0;
  if (o->big_layers <= 0) o->big_layers = o->quick ? 8 : 19;
  if (o->big_dim <= 0) o->big_dim = o->quick ? 768 : 1280;
  if (o->big_ff <= 0) o->big_ff = o->quick ? 2048 : 3456;
  if (o->big_vocab <= 0) o->big_vocab = o->quick ? 32000 : 50304;
  const int64_t S = o->engine.interval;
  if (S == 0) {  // auto: the engine chooses; 12 timed steps are whole rounds of 1 to 4
    if (o->big_steps <= 0) o->big_steps = 12;
    if (o->big_select != 0) {
      fprintf(stderr, "offload_modeled_bench: --big_select: not with --interval 0 (auto)\n");
      return 2;
    }
    return -1;
  }
  if (o->big_steps <= 0) o->big_steps = o->quick ? 2 * S : 4 * S;
  if (o->big_select <= 0) o->big_select = (o->quick ? 2 : 4) * S;
  if (S < 1 || o->big_steps % S != 0 || o->big_select % S != 0) {
    fprintf(stderr,
            "offload_modeled_bench: --big_steps and --big_select must be multiples of "
            "--interval\n");
    return 2;
  }
  return -1;
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Whether the engine splits a parameter of `shape` in zenflow (engine/zenflow.h's rule, for
// weights of two or more dimensions; 1-D parameters stay on the device).
bool EngineSplits(double ratio, const std::vector<int64_t>& shape) {
  return shape.size() >= 2 && SplitsWeight(ratio, shape.back());
}

// ----------------------------------------- Model -----------------------------------------

struct BigParam {
  std::string name;
  std::vector<int64_t> shape;
};

std::vector<BigParam> BigModel(const Options& o, int64_t layers) {
  const int64_t C = o.big_dim, FF = o.big_ff, V = o.big_vocab;
  std::vector<BigParam> ps = {{"embedding", {V, C}}};
  for (int64_t l = 0; l < layers; ++l) {
    const std::string b = absl::StrCat("block", l, ".");
    ps.push_back({b + "ln1", {C}});
    for (const char* n : {"Wq", "Wk", "Wv", "Wo"}) ps.push_back({b + n, {C, C}});
    ps.push_back({b + "ln2", {C}});
    ps.push_back({b + "Wg", {FF, C}});
    ps.push_back({b + "Wu", {FF, C}});
    ps.push_back({b + "Wd", {C, FF}});
  }
  ps.push_back({"ln_f", {C}});
  ps.push_back({"head", {V, C}});
  return ps;
}

// Parameters, and the elements each offload mode puts in the daemon.
struct BigCounts {
  int64_t params = 0, daemon_sync = 0, daemon_zenflow = 0;
};
BigCounts Count(const Options& o, const std::vector<BigParam>& ps) {
  BigCounts c;
  for (const BigParam& p : ps) {
    const int64_t n = Numel(p.shape), cols = p.shape.back();
    c.params += n;
    c.daemon_sync += n;
    if (EngineSplits(o.engine.ratio, p.shape))
      c.daemon_zenflow += n / cols * (cols - HotColumnCount(o.engine.ratio, cols));
  }
  return c;
}

// The daemon's bytes for an engine session of `elems` offloaded elements with bf16 transfers
// (README, "What a session pins"): two bf16 gradient slots and one bf16 parameter slot, a staging
// area of 1/32 of the state (region), and fp32 master, m, v and accumulator (state): 22.125 bytes.
// Page and alignment padding and the staging area's floors are ignored.
double DaemonBytes(int64_t elems) {
  return static_cast<double>(elems) * (2 * 2 + 2 + 0.125 + 4 * 4);
}

// The model to run: o's, with blocks dropped (--check_memory) until sync-offload's daemon memory
// fits in MemAvailable with 1.5 GiB to spare.
struct BigModelPlan {
  int64_t layers = 0;
  std::vector<BigParam> ps;
  BigCounts counts;
  uint64_t avail = 0;  // MemAvailable when planned
  bool downsized = false;
};
BigModelPlan PlanModel(const Options& o) {
  BigModelPlan m;
  m.layers = o.big_layers;
  m.ps = BigModel(o, m.layers);
  m.counts = Count(o, m.ps);
  m.avail = MemAvailableBytes();
  const double margin = 1.5 * (1ull << 30);
  while (o.check_memory && m.layers > 1 &&
         DaemonBytes(m.counts.daemon_sync) + margin > static_cast<double>(m.avail)) {
    --m.layers;
    m.ps = BigModel(o, m.layers);
    m.counts = Count(o, m.ps);
    m.downsized = true;
  }
  return m;
}

// ------------------------------------ Modeled gradients ------------------------------------

// Fills gradient slot `slot` of `session` with bf16 gradients of the modeled skew: column c of a
// weight has standard deviation sqrt(I_c / rows) * 1e-3 with I_c log-normal (sigma), and a
// zenflow session's compact [rows, ncold] block gets the lowest ncold of the weight's cols draws
// (its top-k columns are on the device). `normals`: 4096 N(0, 1) draws the values cycle through.
void FillGradSlot(const Options& o, Session* session, const std::vector<BigParam>& ps, bool zenflow,
                  double sigma, const std::vector<float>& normals, uint32_t slot) {
  std::mt19937_64 rng(static_cast<uint64_t>(o.engine.seed) * 31 + slot);
  std::normal_distribution<double> logn(0.0, sigma);
  uint64_t x = 0x9E3779B97F4A7C15ull ^ (slot + 1);
  for (const BigParam& p : ps) {
    auto layout = session->Param(p.name);
    if (!layout.ok()) continue;  // not offloaded in this mode
    const int64_t cols = p.shape.back(), rows = Numel(p.shape) / cols;
    std::vector<double> imp(static_cast<size_t>(cols));
    for (double& v : imp) v = std::exp(logn(rng));
    int64_t ncols = cols;
    if (zenflow && EngineSplits(o.engine.ratio, p.shape)) {
      ncols = cols - HotColumnCount(o.engine.ratio, cols);
      std::sort(imp.begin(), imp.end());
      imp.resize(static_cast<size_t>(ncols));
      std::shuffle(imp.begin(), imp.end(), rng);
    }
    std::vector<float> scale(static_cast<size_t>(ncols));
    for (int64_t c = 0; c < ncols; ++c)
      scale[c] = static_cast<float>(std::sqrt(imp[c] / static_cast<double>(rows)) * 1e-3);
    uint16_t* dst = static_cast<uint16_t*>(session->GradSlot(slot, p.name));
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* row = dst + r * ncols;
      for (int64_t c = 0; c < ncols; ++c) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        row[c] = FloatToBf16(normals[x & 4095] * scale[c]);
      }
    }
  }
}

// Fills both gradient slots of `session` once (FillGradSlot, one thread each); the daemon then
// accumulates real data every push.
void FillGradSlots(const Options& o, Session* session, const std::vector<BigParam>& ps,
                   bool zenflow, double sigma) {
  std::vector<float> normals(4096);
  std::mt19937_64 rng(static_cast<uint64_t>(o.engine.seed) + 17);
  std::normal_distribution<float> n01;
  for (float& x : normals) x = n01(rng);
  std::thread other(FillGradSlot, std::cref(o), session, std::cref(ps), zenflow, sigma,
                    std::cref(normals), 1u);
  FillGradSlot(o, session, ps, zenflow, sigma, normals, 0u);
  other.join();
}

// -------------------------------------- One mode's run --------------------------------------

struct ModeResult {
  bool ok = false;
  int64_t warmup = 0, timed = 0;
  StepMeans t;
  double setup = 0, fill = 0;
  uint64_t daemon_rss_kb = 0;
  int64_t daemon_elems = 0, reselections = 0, migrated = 0;
  // Mean stall of the timed steps that reselected, and of the others.
  double stall_reselect = 0, stall_other = 0;
  // The [rows, cols] blocks the daemon updates (zenflow: each split weight's cold columns).
  std::vector<std::pair<int64_t, int64_t>> daemon_shapes;
  // Daemon-side, over the timed steps (GetStats deltas).
  int64_t pushes = 0, updates = 0;
  double accumulate_s = 0, update_s = 0;
  double device_virtual_gib = 0;
  int64_t interval = 0;  // zenflow: the round length at the end (auto: the engine's choice)
};

// The parameters in the device's memory: virtual for the weights, real for the norms (which get
// real values 1 and small real gradients).
struct DeviceParams {
  std::vector<kernels::OpsBuffer> values, grads;
  std::vector<EngineParam> params;
};
void AllocateParams(const Options& o, ModeledDevice* dev, const std::vector<BigParam>& ps,
                    DeviceParams* d) {
  std::mt19937 rng(static_cast<uint32_t>(o.engine.seed));
  std::normal_distribution<float> n01;
  for (const BigParam& p : ps) {
    const int64_t n = Numel(p.shape);
    d->values.emplace_back(dev, n);
    d->grads.emplace_back(dev, n);
    if (!dev->IsVirtual(d->values.back().data())) {
      std::fill(d->values.back().data(), d->values.back().data() + n, 1.0f);
      for (int64_t i = 0; i < n; ++i) d->grads.back().data()[i] = 1e-3f * n01(rng);
    }
    d->params.push_back({p.name, p.shape, d->values.back().data(), d->grads.back().data()});
  }
}

// The daemon's side before the timed run: its element count and blocks into *r, both gradient
// slots filled, its parameter slots touched, its RSS.
void PrepareDaemon(const Options& o, Session* session, const std::vector<BigParam>& ps,
                   bool zenflow, double sigma, pid_t daemon_pid, ModeResult* r) {
  for (const auto& pl : session->layout().params()) r->daemon_elems += pl.numel();
  // The daemon's blocks are [rows, the columns it holds]: rows from the model, the columns from
  // the daemon's element count (zenflow: the cold ones).
  for (const BigParam& p : ps) {
    auto pl = session->Param(p.name);
    if (!pl.ok()) continue;  // wholly on the device
    const int64_t rows = Numel(p.shape) / p.shape.back();
    r->daemon_shapes.push_back({rows, (*pl)->numel() / rows});
  }
  const auto t_fill = Clock::now();
  FillGradSlots(o, session, ps, zenflow, sigma);
  // The daemon writes its bf16 parameters into its parameter slots (one for an engine session);
  // touch them once now so that no timed step pays the first write to fresh pages (on a VM whose
  // memory is backed lazily, a first touch costs far more than the write).
  for (uint32_t slot = 0; slot < session->layout().param_slots(); ++slot)
    for (const auto& pl : session->layout().params())
      memset(const_cast<uint16_t*>(session->ParamsBf16(slot, pl.name())), 0,
             static_cast<size_t>(pl.numel()) * 2);
  r->fill = Since(t_fill);
  r->daemon_rss_kb = ProcStatusKb(daemon_pid, "VmRSS:");
}

// r->warmup untimed steps, then r->timed timed ones (modeled compute, then the engine's Step);
// the daemon's push and update work over the timed steps from GetStats. Prints the error and
// returns false on one.
bool TimeSteps(Client* client, bool has_session, ModeledDevice* dev, double compute_s,
               ZenFlowEngine* engine, const char* mname, ModeResult* r) {
  StepRecorder rec;
  v1::Stats before;
  const double lr = 1e-4;
  for (int64_t t = 1; t <= r->warmup + r->timed; ++t) {
    if (t == r->warmup + 1 && has_session) {
      auto st = client->GetStats();
      if (st.ok()) before = *st;
    }
    const auto t0 = Clock::now();
    dev->EnqueueCompute(compute_s);  // forward + backward
    dev->Synchronize();
    const double compute = Since(t0);
    if (absl::Status st = engine->Step(lr); !st.ok()) {
      fprintf(stderr, "offload_modeled_bench %s step %lld: %s\n", mname, static_cast<long long>(t),
              st.ToString().c_str());
      return false;
    }
    if (t <= r->warmup) continue;
    const StepTimings& tm = engine->last_timings();
    rec.Add(compute, tm);
    r->reselections += tm.reselected ? 1 : 0;
    (tm.reselected ? r->stall_reselect : r->stall_other) += tm.stall;
    r->migrated += tm.migrated_columns;
  }
  if (r->reselections > 0) r->stall_reselect /= r->reselections;
  if (r->timed > r->reselections) r->stall_other /= r->timed - r->reselections;
  r->t = rec.Means();
  if (!has_session) return true;
  auto st = client->GetStats();
  if (st.ok()) {
    r->pushes = st->pushes() - before.pushes();
    r->updates = st->updates() - before.updates();
    r->accumulate_s = st->accumulate_seconds() - before.accumulate_seconds();
    r->update_s = st->update_seconds() - before.update_seconds();
  }
  return true;
}

ModeResult RunMode(const Options& o, OffloadMode mode, Client* client, pid_t daemon_pid,
                   ModeledDevice* dev, const std::vector<BigParam>& ps, double compute_s,
                   int64_t warmup, int64_t timed) {
  ModeResult r;
  r.warmup = warmup;
  r.timed = timed;
  const char* mname = OffloadModeName(mode);
  const auto t_setup = Clock::now();
  dev->ResetStats();
  DeviceParams d;
  AllocateParams(o, dev, ps, &d);
  ZenFlowConfig cfg = EngineConfig(o.engine, mode, o.big_select);
  cfg.transfers = Transfers::kBuffered;  // the modeled device's copies overlap compute (CUDA's)
  auto run = StartModeEngine(client, absl::StrCat("offload-bench-big-", mname), cfg,
                             std::move(d.params), *dev, *dev);
  if (!run.ok()) {
    fprintf(stderr, "offload_modeled_bench %s: %s\n", mname, run.status().ToString().c_str());
    return r;
  }
  Session* session = run->target ? run->target->session() : nullptr;
  if (session)
    PrepareDaemon(o, session, ps, mode == OffloadMode::kZenFlow, dev->spec().score_sigma,
                  daemon_pid, &r);
  r.setup = Since(t_setup);
  if (!TimeSteps(client, session != nullptr, dev, compute_s, run->engine.get(), mname, &r))
    return r;
  r.interval = run->engine->update_interval();
  if (absl::Status st = FlushAndClose(&*run); !st.ok()) {
    fprintf(stderr, "offload_modeled_bench %s: %s\n", mname, st.ToString().c_str());
    return r;
  }
  r.device_virtual_gib = GiB(static_cast<double>(dev->stats().virtual_peak_bytes));
  r.ok = true;
  return r;
}

// The fused boundary kernel's own rate in this process (the daemon's update without the daemon):
// AccumulateAdamWColumns with bf16 gradients and bf16 output, as the zenflow daemon runs it, on
// the daemon's own blocks (`shapes`, in order, up to 64M elements), best of 3 passes; elements
// per second.
double FusedKernelRate(const std::vector<std::pair<int64_t, int64_t>>& shapes) {
  std::vector<std::pair<int64_t, int64_t>> use;
  int64_t n = 0;
  for (const auto& sh : shapes) {
    if (n + sh.first * sh.second > (int64_t{64} << 20) && !use.empty()) break;
    use.push_back(sh);
    n += sh.first * sh.second;
  }
  std::vector<float> p(n, 0.5f), m(n, 0.0f), v(n, 0.0f), acc(n, 0.01f);
  std::vector<uint16_t> g(n, FloatToBf16(0.02f)), out(n);
  kernels::AdamWConfig cfg;
  cfg.lr = 1e-4;
  const kernels::OptimizerKernel& k = kernels::DefaultCpuKernel();
  double best = 1e30;
  for (int rep = 0; rep < 4; ++rep) {
    const auto t0 = Clock::now();
    int64_t e = 0;
    for (const auto& [rows, cols] : use) {
      std::vector<int64_t> steps(cols, 7 + rep);
      std::vector<float> ss(cols), bc2(cols);
      kernels::MakeColumnConstants(cfg, steps.data(), cols, ss.data(), bc2.data());
      k.AccumulateAdamWColumns(cfg, ss.data(), bc2.data(), p.data() + e, m.data() + e, v.data() + e,
                               acc.data() + e, g.data() + e, kernels::GradType::kBf16, 0.25f, rows,
                               cols, out.data() + e);
      e += rows * cols;
    }
    if (rep > 0) best = std::min(best, Since(t0));  // the first touches the pages
  }
  return static_cast<double>(n) / best;
}

// ----------------------------------------- Report -----------------------------------------

void PrintModel(const Options& o, const BigModelPlan& m) {
  printf("== Large model, modeled device, real daemon ==\n");
  if (o.quick && o.big_default)
    printf(
        "--quick: a 0.11B model, NOT the >= 0.5B of issue 5: on this kind of VM the first "
        "touch of a page costs ~5 s/GB, and the 0.5B sessions' ~29 GB of daemon memory "
        "take ~2.5 min to set up before any step; run without --quick for the 0.5B "
        "figures\n");
  if (m.downsized)
    printf(
        "DOWNSIZED: %.1f GiB available is too little for %lld blocks; running %lld blocks "
        "(%.3fB parameters) instead\n",
        GiB(static_cast<double>(m.avail)), (long long)o.big_layers, (long long)m.layers,
        m.counts.params / 1e9);
  printf(
      "model: GPT, %lld blocks, d_model %lld, SwiGLU d_ff %lld, vocab %lld (untied "
      "embedding and head), RMSNorm: %lld parameters (%.3fB), %.2f GB in bf16\n",
      (long long)m.layers, (long long)o.big_dim, (long long)o.big_ff, (long long)o.big_vocab,
      (long long)m.counts.params, m.counts.params / 1e9, 2.0 * m.counts.params / 1e9);
  printf(
      "in the daemon: sync-offload %lld elements (all parameters), zenflow %lld (the cold "
      "%.0f%% of every 2-D weight's columns); about %.1f GiB and %.1f GiB of daemon memory "
      "(22.1 B per element: bf16 gradient slots x2, a bf16 parameter slot, staging 1/32 of the "
      "state, fp32 master, m, v, accumulator); %.1f GiB available now\n",
      (long long)m.counts.daemon_sync, (long long)m.counts.daemon_zenflow,
      100 * (1 - o.engine.ratio), GiB(DaemonBytes(m.counts.daemon_sync)),
      GiB(DaemonBytes(m.counts.daemon_zenflow)), GiB(static_cast<double>(m.avail)));
}

void PrintDeviceModel(const Options& o, const BigModelPlan& m, double compute_s) {
  printf(
      "modeled device (H100 SXM on PCIe Gen5 x16 by default): %.0f TFLOP/s effective bf16 "
      "(989 peak dense x ~40%% MFU); HBM %.2f TB/s effective for element-wise kernels "
      "(3.35 peak); host<->device %.0f GB/s per direction (Gen5 x16: 64 raw), full "
      "duplex, copies in one direction queue; %.0f us per device operation\n",
      o.tflops, o.hbm_tbps, o.pcie_gbps, o.launch_us);
  printf(
      "modeled compute: forward + backward = 6 x %lld params x %lld tokens / %.0f TFLOP/s = "
      "%.1f ms per step (attention FLOPs not counted)\n",
      (long long)m.counts.params, (long long)o.tokens, o.tflops, 1e3 * compute_s);
  printf(
      "real: the daemon (a separate stallfreed process on this machine's %ld cores) "
      "accumulates every pushed bf16 gradient element and runs AdamW over every offloaded "
      "element (fp32 master and moments, bf16 out); the RPCs, the engine's code path, "
      "top-k, column indices, the 1-D parameters' AdamW\n",
      sysconf(_SC_NPROCESSORS_ONLN));
  printf(
      "modeled: device memory (virtual, never touched), device kernels (time = bytes / HBM "
      "bandwidth), PCIe copies (time = bytes / link bandwidth; a DMA costs the host CPU "
      "nothing, so copies from the device into the region write nothing: before the timed "
      "run both gradient slots are filled once with real bf16 gradients of the modeled "
      "skew, and the daemon accumulates those every step; this machine's memcpy would "
      "steal the daemon's cores), per-column gradient scores (log-normal importance, "
      "sigma %.1f, AR(1) drift rho %.3f per selection: top 10%% of columns ~78%% of the "
      "mass, ~5%% of the top set changes per selection), the daemon's initial parameters "
      "(zero: the device's values are virtual)\n",
      2.0, 0.998);
  printf(
      "streams: each host thread has its own modeled stream, so the engine's copy thread "
      "overlaps its device-to-host copies with compute (a copy engine); note the CUDA "
      "backend today enqueues those copies on its one stream (zenflow.h: a dedicated copy "
      "stream is future work)\n");
}

void PrintTable(const Options& o, const ModeResult (&r)[3], double model_bytes, double compute_s) {
  printf("\n%-13s %9s %9s %9s %9s %9s %9s %9s %10s %12s %12s\n", "mode", "step", "compute",
         "engine", "optimzr", "copies", "stall", "traffic", "traffic", "daemon push", "daemon upd");
  printf("%-13s %9s %9s %9s %9s %9s %9s %9s %10s %12s %12s\n", "", "ms", "ms", "ms", "ms", "ms",
         "ms", "GB/step", "x bf16", "ms each", "ms each");
  for (int i = 0; i < 3; ++i) {
    const ModeResult& x = r[i];
    if (!x.ok) {
      printf("%-13s FAILED\n", OffloadModeName(kModes[i]));
      continue;
    }
    printf("%-13s %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.3f %10.3f %12.1f %12.1f\n",
           OffloadModeName(kModes[i]), 1e3 * x.t.step, 1e3 * x.t.compute, 1e3 * x.t.engine,
           1e3 * x.t.optimizer, 1e3 * x.t.copies, 1e3 * x.t.stall, x.t.traffic / 1e9,
           x.t.traffic / model_bytes, x.pushes ? 1e3 * x.accumulate_s / x.pushes : 0.0,
           x.updates ? 1e3 * x.update_s / x.updates : 0.0);
  }
  printf(
      "(means over the timed steps; engine = the whole Step; optimizer = device-side "
      "AdamW of hot columns and 1-D parameters, scores, top-k; copies = device gathers and "
      "the cold-parameter scatter; stall = blocked on the copy thread, the daemon's Update or "
      "migration; traffic = bytes_to_host + bytes_to_device; daemon push / upd = the "
      "daemon's own accumulate and AdamW time per call, from GetStats)\n");
  const ModeResult& zen = r[2];
  if (zen.ok && zen.pushes > 0 && zen.updates > 0) {
    const double S = static_cast<double>(zen.interval);
    const double round_work = S * zen.accumulate_s / zen.pushes + zen.update_s / zen.updates;
    printf(
        "zenflow hides the daemon only if its work per round (S pushes + 1 update = %.0f ms "
        "here, on %ld cores) fits in S steps of compute (%.0f ms): the stall floor is about "
        "%.0f ms per step\n",
        1e3 * round_work, sysconf(_SC_NPROCESSORS_ONLN), 1e3 * S * compute_s,
        1e3 * std::max(0.0, round_work - S * compute_s) / S);
  }
  if (zen.ok)
    printf(
        "zenflow timed steps: %lld reselection(s), %lld columns migrated (both "
        "directions), stall %.1f ms in a reselection step and %.1f ms in any other; device "
        "memory modeled: peak %.1f GiB virtual\n",
        (long long)zen.reselections, (long long)zen.migrated, 1e3 * zen.stall_reselect,
        1e3 * zen.stall_other, zen.device_virtual_gib);
  printf("\n");
}

// The daemon's per-round update (zenflow: the cold elements, fused with the round's last push,
// bf16 out; from GetStats) against the same kernel alone, measured now.
void PrintDaemonUpdateFigures(const ModeResult& zen) {
  const double daemon_rate = zen.daemon_elems * zen.updates / zen.update_s;
  const double kernel_rate = FusedKernelRate(zen.daemon_shapes);
  // The same blocks with every row a multiple of 16 columns (64-byte aligned rows).
  std::vector<std::pair<int64_t, int64_t>> aligned = zen.daemon_shapes;
  for (auto& sh : aligned) sh.second = (sh.second + 15) / 16 * 16;
  const double aligned_rate = FusedKernelRate(aligned);
  printf("FIGURE daemon_update_gelem_per_s %.3f Gelem/s\n", daemon_rate / 1e9);
  printf("FIGURE fused_kernel_gelem_per_s %.3f Gelem/s\n", kernel_rate / 1e9);
  printf("FIGURE fused_kernel_aligned_rows_gelem_per_s %.3f Gelem/s\n", aligned_rate / 1e9);
  printf("FIGURE daemon_update_fraction_of_fused_kernel %.3f ratio\n", daemon_rate / kernel_rate);
  PrintTarget(
      "the daemon's update at >= 0.9 of its kernel's own rate "
      "(daemon_update_fraction_of_fused_kernel)",
      daemon_rate >= 0.9 * kernel_rate);
}

void PrintFigures(const ModeResult (&r)[3], double model_bytes) {
  const ModeResult &none = r[0], &sync = r[1], &zen = r[2];
  const double speedup = sync.t.step / zen.t.step;
  const double stall_red = sync.t.stall > 0 ? 1.0 - zen.t.stall / sync.t.stall : 0.0;
  const double traffic = zen.t.traffic / model_bytes;
  printf("FIGURE zenflow_vs_sync_offload_speedup_modeled %.3f x\n", speedup);
  printf("FIGURE zenflow_stall_reduction_modeled %.4f ratio\n", stall_red);
  printf("FIGURE zenflow_host_traffic_per_step %.4f x model bf16 size\n", traffic);
  printf("FIGURE sync_offload_host_traffic_per_step %.4f x model bf16 size\n",
         sync.t.traffic / model_bytes);
  printf("FIGURE zenflow_step_modeled %.1f ms\n", 1e3 * zen.t.step);
  printf("FIGURE sync_offload_step_modeled %.1f ms\n", 1e3 * sync.t.step);
  if (none.ok) {
    printf("FIGURE nooffload_step_modeled %.1f ms\n", 1e3 * none.t.step);
    printf("FIGURE zenflow_vs_nooffload_step_modeled %.3f x\n", zen.t.step / none.t.step);
  }
  printf("FIGURE zenflow_stall_per_step_modeled %.1f ms\n", 1e3 * zen.t.stall);
  printf("FIGURE sync_offload_stall_per_step_modeled %.1f ms\n", 1e3 * sync.t.stall);
  printf("FIGURE big_model_params %.4f B parameters\n", model_bytes / 2e9);
  printf("FIGURE zenflow_round_length %lld steps\n", static_cast<long long>(zen.interval));
  if (zen.timed > 0)
    printf("FIGURE zenflow_daemon_busy_s_per_step %.4f s\n",
           (zen.accumulate_s + zen.update_s) / static_cast<double>(zen.timed));
  if (zen.updates > 0 && zen.update_s > 0) PrintDaemonUpdateFigures(zen);
  if (none.ok)
    PrintTarget("zenflow step <= 1.10x no-offload's (zenflow_vs_nooffload_step_modeled)",
                zen.t.step <= 1.10 * none.t.step);
  PrintTarget("stall reduction >= 0.95 (zenflow_stall_reduction_modeled)", stall_red >= 0.95);
  PrintTarget(
      "host traffic <= 1.15x model size at ratio 0.1, S = 4 "
      "(zenflow_host_traffic_per_step)",
      traffic <= 1.15);
}

// ----------------------------------------- Driver -----------------------------------------

int Run(int argc, char** argv) {
  Options o;
  if (int code = ParseOptions(argc, argv, &o); code >= 0) return code;
  const auto t_run = Clock::now();
  std::unique_ptr<BenchDaemon> daemon = StartDaemon(o.engine.stallfreed);
  if (!daemon) return 1;
  PrintRunHeader("offload_modeled_bench", daemon->pid(), o.engine);
  const BigModelPlan m = PlanModel(o);
  const double compute_s =
      6.0 * static_cast<double>(m.counts.params) * o.tokens / (o.tflops * 1e12);
  PrintModel(o, m);
  PrintDeviceModel(o, m, compute_s);
  // zenflow's first Update runs during its second round, and it is the first to write the
  // daemon's moments (first touches are slow on a lazily backed VM): two rounds untimed, so the
  // timed rounds see steady state.
  // Auto (--interval 0): rounds of 1 until the engine's first choice at step 4, then its
  // second choice (4 rounds later: at step 4 + 4 S <= 4 + 4 max) untimed, so that the timed
  // steps run the length it settles on.
  const bool automatic = o.engine.interval == 0;
  const int64_t S = automatic ? 1 : o.engine.interval;
  const int64_t zen_warm = automatic ? 4 + 4 * ZenFlowConfig().max_update_interval : 2 * S,
                zen_timed = o.big_steps;
  const int64_t sync_warm = 1, sync_timed = std::max<int64_t>(2, o.big_steps / 2);
  printf(
      "steps: zenflow %lld untimed (two rounds: selection, initial load, the first "
      "update and the first wait for one) + %lld timed (%lld rounds; select_interval %lld); "
      "sync-offload and no-offload %lld untimed + %lld timed; lr 1e-4, betas (0.9, 0.95), "
      "wd %.2f\n",
      (long long)zen_warm, (long long)zen_timed, (long long)(zen_timed / S),
      (long long)o.big_select, (long long)sync_warm, (long long)sync_timed, o.engine.weight_decay);
  if (automatic)
    printf("zenflow update_interval auto: rounds of 1 until the engine's first choice (step 4), "
           "then what it chooses, again 4 rounds later (FIGURE zenflow_round_length; the "
           "rounds and select_interval above count rounds of 1)\n");
  fflush(stdout);
  ModeledDeviceSpec spec;
  spec.flops = o.tflops * 1e12;
  spec.hbm_bytes_per_s = o.hbm_tbps * 1e12;
  spec.pcie_bytes_per_s = o.pcie_gbps * 1e9;
  spec.launch_seconds = o.launch_us * 1e-6;
  spec.seed = static_cast<uint32_t>(o.engine.seed);
  ModeledDevice dev(spec);
  ModeResult r[3];
  int failures = 0;
  for (int i = 0; i < 3; ++i) {
    const bool zen = kModes[i] == OffloadMode::kZenFlow;
    const auto t0 = Clock::now();
    r[i] = RunMode(o, kModes[i], daemon->client(), daemon->pid(), &dev, m.ps, compute_s,
                   zen ? zen_warm : sync_warm, zen ? zen_timed : sync_timed);
    if (!r[i].ok) ++failures;
    printf(
        "  %s: %.1f s (setup %.1f s, of which filling the gradient slots and touching the "
        "parameter slots %.1f s; daemon RSS after setup %.1f GiB)\n",
        OffloadModeName(kModes[i]), Since(t0), r[i].setup, r[i].fill,
        r[i].daemon_rss_kb / (1024.0 * 1024.0));
    fflush(stdout);
  }
  const double model_bytes = 2.0 * static_cast<double>(m.counts.params);
  PrintTable(o, r, model_bytes, compute_s);
  if (r[1].ok && r[2].ok) PrintFigures(r, model_bytes);
  PrintPeakRssAndWall(daemon->pid(), t_run);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace bench
}  // namespace stallfree

int main(int argc, char** argv) { return stallfree::bench::Run(argc, argv); }
