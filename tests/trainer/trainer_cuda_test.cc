// The trainer on GPUs end to end (--device cuda), with a real stallfreed. Without a usable CUDA
// device it prints "SKIP: ..." and exits 0. Otherwise, on D = min(2, GPUs) ranks (GPU LOCAL_RANK
// each, NCCL between them), the tiny preset in zenflow mode (S = 4, stale cold columns; an
// engine warm-up of 4 steps, so that the rounds start at step 5 and step 15 is inside one, not
// inside the default warm-up of 20):
//   - 30 steps on the GPUs: the loss falls (the mean of the last 3 steps below 0.8 x the mean of
//     the first 3) and rank 0 reports device cuda:0;
//   - the same run with --device cpu: every step's loss within kCpuTolerance (2e-2) relative of
//     the GPU run's (cuBLAS and the CUDA kernels sum in another order than OpenBLAS and the CPU
//     kernels, the gradient norm comes from fp32 column sums, and training amplifies rounding);
//   - a GPU run stopped at step 15 (a checkpoint in the middle of a round: the shard downloaded
//     into the trainer's checkpoint) and resumed (uploaded): steps 16..30 within kResumeTolerance
//     (1e-6) relative of the uninterrupted GPU run's (the backends are deterministic on one
//     device, so this is expected to be exact; the tolerance only allows for library
//     reproducibility across processes, which CUDA does not promise).
// All of it twice: with an fp32 model, then with a bf16 one (--model_dtype bf16: bf16 weights and
// gradients in device memory, fp32 masters in the engine and the daemon, fp32 working copies for
// the model's compute; the CPU run bf16 too).
// Prints each step's losses, then "PASS" or the failures ("FAIL: ..."); exit status 0 iff PASS.
//
// Binaries: trainer/trainer and server/stallfreed from this binary's runfiles (bazel build), or,
// in a gpu-check bundle, `trainer` and `stallfreed` next to this binary.
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "parallel/nccl_communicator.h"
#include "testing/daemon_process.h"
#include "tests/trainer/trainer_process.h"

namespace stallfree {
namespace {

constexpr double kCpuTolerance = 2e-2;
constexpr double kResumeTolerance = 1e-6;
constexpr int kSteps = 30;
constexpr int kStopAt = 15;

using Run = testing::ProcessRun;
Run Shell(const std::string& cmd) { return testing::RunShell(cmd); }
std::vector<double> Losses(const std::string& csv) { return testing::MetricsLosses(csv); }

int Main() {
  // The binaries first, so that a broken build or bundle shows even without a device.
  // From this binary's runfiles (bazel build), or next to it in a gpu-check bundle
  // (testing/binaries.h).
  const std::string trainer = testing::FindBinary("trainer/trainer");
  const std::string daemon_bin = testing::FindBinary("server/stallfreed");
  if (trainer.empty() || daemon_bin.empty()) {
    std::printf("FAIL: cannot find the trainer ('%s') or stallfreed ('%s') for %s\n",
                trainer.c_str(), daemon_bin.c_str(), testing::SelfExecutable().c_str());
    return 1;
  }
  std::printf("trainer %s, stallfreed %s\n", trainer.c_str(), daemon_bin.c_str());
  std::string why;
  if (!parallel::NcclDeviceAvailable(1, &why)) {
    std::printf("SKIP: no usable CUDA device: %s\n", why.c_str());
    return 0;
  }
  const int D = parallel::NcclDeviceAvailable(2, nullptr) ? 2 : 1;
  // testing::Daemon starts "server/stallfreed" relative to the working directory: give it one.
  char tmpl[] = "/tmp/stallfree-trainer-cuda-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::string work = tmpl;
  if (mkdir((work + "/server").c_str(), 0755) != 0 ||
      symlink(daemon_bin.c_str(), (work + "/server/stallfreed").c_str()) != 0 ||
      chdir(work.c_str()) != 0) {
    std::perror(("setting up " + work).c_str());
    return 1;
  }

  bool ok = true;
  auto fail = [&](const std::string& what) {
    std::printf("FAIL: %s\n", what.c_str());
    ok = false;
  };
  {
    testing::Daemon daemon({}, "warning");
    std::string model_dtype;  // of the runs below
    auto train = [&](const std::string& name, const std::string& device, const std::string& extra) {
      std::string cmd = "'" + trainer + "' --preset tiny --steps " + std::to_string(kSteps) +
                        " --quiet --mode zenflow --eval_every 0 --lr_warmup 5 --engine_warmup 4"
                        " --nproc " +
                        std::to_string(D) + " --socket '" + daemon.socket() + "' --out_dir '" +
                        work + "/runs/" + name + "' --run_name " + name + " --device " + device +
                        " --model_dtype " + model_dtype + " " + extra;
      std::printf("$ %s\n", cmd.c_str());
      std::fflush(stdout);
      Run r = Shell(cmd);
      if (r.code != 0) {
        std::printf("%s", r.output.c_str());
        fail(name + ": the trainer exited with status " + std::to_string(r.code));
      }
      return r;
    };
    auto csv = [&](const std::string& name) { return work + "/runs/" + name + "/metrics.csv"; };

    for (const std::string dtype : {"fp32", "bf16"}) {
      model_dtype = dtype;
      std::printf("=== D = %d, --model_dtype %s\n", D, dtype.c_str());
      const std::string gpu_name = "gpu-" + dtype, cpu_name = "cpu-" + dtype,
                        part_name = "part-" + dtype;
      const Run gpu = train(gpu_name, "cuda", "");
      if (ok && gpu.output.find("device cuda:0") == std::string::npos) {
        std::printf("%s", gpu.output.c_str());
        fail("the --device cuda run does not report device cuda:0");
      }
      if (ok && gpu.output.find(dtype + " weights and gradients") == std::string::npos) {
        std::printf("%s", gpu.output.c_str());
        fail("the --device cuda run does not report " + dtype + " weights and gradients");
      }
      train(cpu_name, "cpu", "");
      train(part_name, "cuda", "--stop_at " + std::to_string(kStopAt));
      const Run resumed =
          train(part_name, "cuda", "--resume " + part_name + "-step" + std::to_string(kStopAt));
      if (ok && resumed.output.find("resumed from checkpoint") == std::string::npos)
        fail("the resumed run does not say it resumed:\n" + resumed.output);

      if (ok) {
        const std::vector<double> g = Losses(csv(gpu_name)), c = Losses(csv(cpu_name)),
                                  p = Losses(csv(part_name));
        if (g.size() != kSteps || c.size() != kSteps || p.size() != kSteps) {
          fail("metrics: " + std::to_string(g.size()) + " / " + std::to_string(c.size()) + " / " +
               std::to_string(p.size()) + " steps, want " + std::to_string(kSteps) + " each");
        } else {
          double worst_cpu = 0, worst_resume = 0;
          std::printf("step   cuda loss    cpu loss     rel diff   resumed cuda\n");
          for (int i = 0; i < kSteps; ++i) {
            const double rel = std::fabs(g[i] - c[i]) / std::fabs(c[i]);
            const double rel_resume = std::fabs(g[i] - p[i]) / std::fabs(g[i]);
            worst_cpu = std::max(worst_cpu, rel);
            worst_resume = std::max(worst_resume, rel_resume);
            std::printf("%4d  %10.6f  %10.6f  %9.2e  %10.6f\n", i + 1, g[i], c[i], rel, p[i]);
            if (rel > kCpuTolerance)
              fail("step " + std::to_string(i + 1) + ": cuda loss " + std::to_string(g[i]) +
                   " vs cpu " + std::to_string(c[i]) + " differ by more than 2e-2 relative");
            if (rel_resume > kResumeTolerance)
              fail("step " + std::to_string(i + 1) + ": the resumed cuda run's loss " +
                   std::to_string(p[i]) + " vs the uninterrupted " + std::to_string(g[i]));
          }
          const double first = (g[0] + g[1] + g[2]) / 3;
          const double last = (g[kSteps - 3] + g[kSteps - 2] + g[kSteps - 1]) / 3;
          std::printf(
              "cuda loss %.4f -> %.4f; worst step vs cpu %.2e (tolerance %.0e), resumed vs "
              "uninterrupted %.2e (tolerance %.0e)\n",
              first, last, worst_cpu, kCpuTolerance, worst_resume, kResumeTolerance);
          if (!(last < 0.8 * first))
            fail("the cuda loss did not fall: " + std::to_string(first) + " -> " +
                 std::to_string(last));
        }
      }
    }  // the model dtypes
    if (!ok) std::printf("daemon log:\n%s\n", daemon.Log().c_str());
  }
  if (chdir("/") != 0) std::perror("chdir /");
  Shell("rm -rf '" + work + "'");
  if (ok && D < 2)
    std::printf(
        "SKIP: multi-rank training on GPUs needs 2 devices, 1 visible (the D = 1 run "
        "passed)\n");
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace stallfree

int main() { return stallfree::Main(); }
