// synthetic_trainer: a trainer-shaped client for the demo until the real trainer lands.
// Registers a GPT-like set of weights (default ~67M parameters), then runs steps of
// "compute" (writing random gradients into the gradient slot) + push + AdamW in the daemon:
// first waiting for every update (sync), then overlapping each update with the next step's
// compute. Prints one progress line per step and a summary.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "client/client.h"
#include "common/flags.h"

namespace {
using Clock = std::chrono::steady_clock;
double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Fills `n` floats with cheap pseudo-random gradients (xorshift), standing in for backward.
void FakeBackward(float* g, int64_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    g[i] = (static_cast<int32_t>(x >> 32) * (1.0f / 2147483648.0f)) * 1e-2f;
  }
}

int Run(int argc, char** argv) {
  using namespace stallfree;
  std::string socket;
  int64_t layers = 8, d_model = 768, vocab = 32768, steps = 6;
  FlagSet flags("synthetic_trainer",
                "pushes random gradients of a GPT-shaped model through stallfreed, first "
                "waiting for each update, then overlapping updates with compute");
  flags.AddString("socket", &socket, "stallfreed's gRPC socket");
  flags.AddInt("layers", &layers, "transformer blocks (12*d_model^2 parameters each)");
  flags.AddInt("d_model", &d_model, "model width");
  flags.AddInt("vocab", &vocab, "vocabulary (embedding of vocab*d_model)");
  flags.AddInt("steps", &steps, "steps per phase (sync, then overlapped)");
  if (int code = flags.ParseCommandLine(argc, argv); code >= 0) return code;
  if (socket.empty() || layers < 1 || d_model < 1 || vocab < 1 || steps < 1) {
    fprintf(stderr, "synthetic_trainer: --socket is required; sizes and --steps must be >= 1\n");
    return 2;
  }
  auto client = Client::Connect(socket);
  if (!client.ok()) {
    fprintf(stderr, "synthetic_trainer: %s\n", std::string(client.status().message()).c_str());
    return 1;
  }
  auto session = (*client)->OpenSession("synthetic-gpt", 0);
  if (!session.ok()) {
    fprintf(stderr, "synthetic_trainer: %s\n", session.status().ToString().c_str());
    return 1;
  }
  Session& s = **session;
  std::vector<ParamSpec> specs;
  specs.push_back({"wte", {vocab, d_model}, v1::DTYPE_FP32});
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "h" + std::to_string(l) + ".";
    specs.push_back({p + "attn.wqkv", {3 * d_model, d_model}, v1::DTYPE_FP32});
    specs.push_back({p + "attn.wo", {d_model, d_model}, v1::DTYPE_FP32});
    specs.push_back({p + "mlp.wi", {4 * d_model, d_model}, v1::DTYPE_FP32});
    specs.push_back({p + "mlp.wo", {d_model, 4 * d_model}, v1::DTYPE_FP32});
  }
  int64_t total = 0;
  for (auto& p : specs) total += p.shape[0] * p.shape[1];
  printf("model: %ld tensors, %.1fM parameters (%.0f MiB fp32 each of master, m, v, accumulator)\n",
         (long)specs.size(), total / 1e6, total * 4 / 1048576.0);
  absl::Status st = s.RegisterParams(specs);
  if (!st.ok()) {
    fprintf(stderr, "synthetic_trainer: %s\n", st.ToString().c_str());
    return 1;
  }
  printf("region: %.0f MiB shared with the daemon\n", s.layout().region_bytes() / 1048576.0);
  for (auto& p : specs) {
    const int64_t n = p.shape[0] * p.shape[1];
    FakeBackward(s.StagingFp32(p.name), n, 7);
  }
  if (!(st = s.LoadParams()).ok()) {
    fprintf(stderr, "synthetic_trainer: %s\n", st.ToString().c_str());
    return 1;
  }
  v1::AdamWHyper h;
  h.set_lr(3e-4);
  h.set_beta1(0.9);
  h.set_beta2(0.95);
  h.set_eps(1e-8);
  h.set_weight_decay(0.1);
  int64_t step = 0;
  double phase_ms[2] = {0, 0}, phase_stall[2] = {0, 0};
  for (int phase = 0; phase < 2; ++phase) {
    const bool overlap = phase == 1;
    printf("\n%s: %ld steps\n", overlap ? "overlapped (update runs during the next compute)"
                                        : "synchronous (wait for every update)",
           (long)steps);
    for (int64_t i = 0; i < steps; ++i) {
      ++step;
      const uint32_t slot = step % 2;
      const auto t0 = Clock::now();
      for (auto& p : specs)
        FakeBackward(static_cast<float*>(s.GradSlot(slot, p.name)), p.shape[0] * p.shape[1], step);
      const auto t1 = Clock::now();
      double stall = 0;
      if (overlap && step > 1) {  // the previous update must land before this push joins it.
        auto ready = s.WaitUpdate(step - 1);
        if (!ready.ok()) {
          fprintf(stderr, "wait: %s\n", ready.status().ToString().c_str());
          return 1;
        }
        stall = Ms(t1, Clock::now());
      }
      const auto t2 = Clock::now();
      auto pushed = s.Push(step, slot);
      const auto t3 = Clock::now();
      if (!pushed.ok() || !(st = s.Update(step, h, slot)).ok()) {
        fprintf(stderr, "step %ld: %s\n", (long)step,
                (!pushed.ok() ? pushed.status() : st).ToString().c_str());
        return 1;
      }
      if (!overlap) {
        auto ready = s.WaitUpdate(step);
        if (!ready.ok()) {
          fprintf(stderr, "wait: %s\n", ready.status().ToString().c_str());
          return 1;
        }
        stall = Ms(t3, Clock::now()) + Ms(t2, t3);
      } else {
        stall += Ms(t2, t3);
      }
      const double total_ms = Ms(t0, Clock::now());
      phase_ms[phase] += total_ms;
      phase_stall[phase] += stall;
      printf("step %3ld  compute %7.1f ms  push %7.1f ms  stall %7.1f ms  step %7.1f ms\n",
             (long)step, Ms(t0, t1), Ms(t2, t3), stall, total_ms);
      fflush(stdout);
    }
  }
  if (!s.WaitUpdate(step).ok()) return 1;
  printf("\nsummary: %.1fM parameters; mean step %.1f ms synchronous vs %.1f ms overlapped "
         "(%.2fx); stall share %.0f%% vs %.0f%%\n",
         total / 1e6, phase_ms[0] / steps, phase_ms[1] / steps, phase_ms[0] / phase_ms[1],
         100 * phase_stall[0] / phase_ms[0], 100 * phase_stall[1] / phase_ms[1]);
  return s.Close().ok() ? 0 : 1;
}
}  // namespace

int main(int argc, char** argv) { return Run(argc, argv); }
