// train_bench: the trainer on the same model and data in the three offload modes, one after the
// other against one stallfreed, then the figures and a plot of the three runs.
//
//   bazel run //bench:train_bench [-- --quick] [-- --nproc 2 --steps 200 ...]
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/flags.h"
#include "tests/support/daemon_process.h"
#include "trainer/plot.h"

namespace {

// The numbers of a trainer's summary.json (a flat object of numbers and strings).
std::map<std::string, double> ReadSummary(const std::string& path) {
  std::ifstream f(path);
  std::string text((std::istreambuf_iterator<char>(f)), {});
  std::map<std::string, double> out;
  size_t pos = 0;
  while ((pos = text.find('"', pos)) != std::string::npos) {
    const size_t end = text.find('"', pos + 1);
    if (end == std::string::npos) break;
    const std::string key = text.substr(pos + 1, end - pos - 1);
    size_t colon = text.find(':', end);
    if (colon == std::string::npos) break;
    size_t v = text.find_first_not_of(" ", colon + 1);
    if (v != std::string::npos && text[v] != '"') out[key] = std::atof(text.c_str() + v);
    pos = text.find_first_of(",}", colon);
    if (pos == std::string::npos) break;
  }
  return out;
}

int Run(int argc, char** argv) {
  using namespace stallfree;
  bool quick = false;
  int64_t steps = 0, nproc = 2, layers = 4, d_model = 128, heads = 4, d_ff = 384, seq_len = 64,
          batch = 8;
  std::string out_dir = "/tmp/stallfree-train-bench";
  FlagSet flags("train_bench",
                "trains one model in zenflow, sync-offload and no-offload modes (same data, "
                "seed and schedule) and prints the comparison.");
  flags.AddBool("quick", &quick, "fewer steps (within 180 s on 2 cores)");
  flags.AddInt("steps", &steps, "steps per mode (0: 60 quick, 200 otherwise)");
  flags.AddInt("nproc", &nproc, "TSP ranks per run");
  flags.AddInt("layers", &layers, "model blocks");
  flags.AddInt("d_model", &d_model, "model width");
  flags.AddInt("heads", &heads, "attention heads");
  flags.AddInt("d_ff", &d_ff, "MLP width");
  flags.AddInt("seq_len", &seq_len, "sequence length");
  flags.AddInt("batch", &batch, "sequences per step");
  flags.AddString("out_dir", &out_dir, "where the runs' metrics and the plot go");
  if (int code = flags.ParseCommandLine(argc, argv); code >= 0) return code;
  if (steps == 0) steps = quick ? 60 : 200;

  testing::Daemon daemon({"--threads", "2"}, "warning");
  const std::vector<std::string> modes = {"no-offload", "sync-offload", "zenflow"};
  std::map<std::string, std::map<std::string, double>> summary;
  std::vector<std::pair<std::string, std::string>> plots;
  printf("train_bench: %ld layers, d_model %ld, heads %ld, d_ff %ld, seq %ld, batch %ld, %ld steps, "
         "D = %ld, the generated corpus; zenflow: ratio 0.1, S = 4, bf16 transfers\n",
         (long)layers, (long)d_model, (long)heads, (long)d_ff, (long)seq_len, (long)batch,
         (long)steps, (long)nproc);
  for (const std::string& mode : modes) {
    const std::string dir = absl::StrCat(out_dir, "/", mode);
    std::string cmd = absl::StrCat(
        "trainer/trainer --preset tiny --quiet --mode ", mode, " --layers ", layers,
        " --d_model ", d_model, " --heads ", heads, " --d_ff ", d_ff, " --seq_len ", seq_len,
        " --batch ", batch, " --steps ", steps, " --nproc ", nproc, " --eval_every ",
        std::max<int64_t>(steps / 4, 1), " --eval_batches 8 --lr 3e-3 --socket ",
        daemon.socket(), " --out_dir ", dir, " --run_name bench-", mode);
    printf("\n== %s\n", mode.c_str());
    std::fflush(stdout);
    const int status = std::system(cmd.c_str());
    if (status != 0) {
      fprintf(stderr, "train_bench: the %s run failed (status %d): %s\n", mode.c_str(), status,
              cmd.c_str());
      return 1;
    }
    summary[mode] = ReadSummary(dir + "/summary.json");
    plots.push_back({mode, dir + "/metrics.csv"});
  }
  const std::string png = out_dir + "/train_bench.png";
  absl::Status plotted = trainer::WritePlot(png, plots, "train_bench: the three modes");

  printf("\n%-14s %12s %12s %12s %12s %12s %12s\n", "mode", "train loss", "eval loss",
         "tokens/s", "step (s)", "stall (s)", "stall share");
  for (const std::string& mode : modes) {
    auto& s = summary[mode];
    printf("%-14s %12.4f %12.4f %12.0f %12.4f %12.4f %12.3f\n", mode.c_str(),
           s["final_train_loss"], s["final_eval_loss"], s["tokens_per_s"], s["step_s"],
           s["stall_s"], s["stall_share"]);
  }
  printf("plot: %s\n", plotted.ok() ? png.c_str() : std::string(plotted.message()).c_str());
  auto& z = summary["zenflow"];
  auto& n = summary["no-offload"];
  auto& y = summary["sync-offload"];
  printf("\nFIGURE train_zenflow_vs_nooffload_eval_loss %.4f x (target <= 1.02)\n",
         z["final_eval_loss"] / n["final_eval_loss"]);
  printf("FIGURE train_zenflow_vs_sync_offload_step_time %.4f x\n", z["step_s"] / y["step_s"]);
  printf("FIGURE train_stall_share_zenflow %.4f\n", z["stall_share"]);
  printf("FIGURE train_stall_share_sync_offload %.4f\n", y["stall_share"]);
  for (const std::string& mode : modes)
    printf("FIGURE train_tokens_per_s_%s %.1f tokens/s\n", mode.c_str(),
           summary[mode]["tokens_per_s"]);
  printf("FIGURE train_host_traffic_per_step_zenflow %.3f x bf16 model\n",
         z["host_traffic_per_step_over_bf16_model"]);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return Run(argc, argv); }
