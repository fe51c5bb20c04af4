// train_bench: the trainer on the same model and data in the three offload modes, one after the
// other against one stallfreed, then the figures and a plot of the three runs. The fine-tuning
// comparison runs each mode from the same pre-trained weights, and zenflow and no-offload once
// more with a bf16 model (--model_dtype bf16: bf16 weights and gradients, fp32 masters).
//
//   bazel run //bench:train_bench [-- --quick] [-- --nproc 2 --steps 200 ...]
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/flags.h"
#include "testing/daemon_process.h"
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

// The grad_norm column of a trainer's metrics.csv, one value per step.
std::vector<double> ReadGradNorms(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::vector<double> out;
  if (!std::getline(f, line)) return out;
  int col = -1, i = 0;
  std::stringstream header(line);
  for (std::string name; std::getline(header, name, ','); ++i)
    if (name == "grad_norm") col = i;
  if (col < 0) return out;
  while (std::getline(f, line)) {
    std::stringstream row(line);
    std::string cell;
    for (int c = 0; c <= col && std::getline(row, cell, ','); ++c) {
    }
    out.push_back(std::atof(cell.c_str()));
  }
  return out;
}

// Each step's gradient norm over the median of its previous 10 steps (0 for the first 10).
std::vector<double> NormJumps(const std::vector<double>& norms) {
  std::vector<double> out(norms.size(), 0.0);
  for (size_t i = 10; i < norms.size(); ++i) {
    std::vector<double> w(norms.begin() + i - 10, norms.begin() + i);
    std::nth_element(w.begin(), w.begin() + 5, w.end());
    const double hi = w[5];
    std::nth_element(w.begin(), w.begin() + 4, w.end());
    const double median = 0.5 * (w[4] + hi);
    out[i] = median > 0 ? norms[i] / median : 0.0;
  }
  return out;
}

// ZenFlow's own spikes: the largest jump of zenflow's gradient norm at a step where the
// no-offload run on the same data and seed stays below 3x itself. *at: that step (1-based).
double MaxOwnJump(const std::string& zenflow_csv, const std::string& nooffload_csv, int64_t* at) {
  const std::vector<double> z = NormJumps(ReadGradNorms(zenflow_csv));
  const std::vector<double> n = NormJumps(ReadGradNorms(nooffload_csv));
  double worst = 0;
  *at = 0;
  for (size_t i = 0; i < z.size() && i < n.size(); ++i)
    if (n[i] < 3.0 && z[i] > worst) {
      worst = z[i];
      *at = static_cast<int64_t>(i) + 1;
    }
  return worst;
}

using Summary = std::map<std::string, double>;  // a run's summary.json

struct Options {
  bool quick = false;
  int64_t steps = 0, nproc = 2, layers = 4, d_model = 128, heads = 4, d_ff = 384, seq_len = 64,
          batch = 8;
  std::string out_dir = "/tmp/stallfree-train-bench";
  std::string zenflow_args, jumps;
  int64_t pretrain_steps = 0, finetune_steps = 0;
  double finetune_lr = 3e-4;
  std::string stallfreed, trainer_bin;
};

// The flags into *o, the quick/full defaults applied; -1 to go on, else the exit code.
int ParseOptions(int argc, char** argv, Options* o) {
  using stallfree::FlagSet;
  FlagSet flags("train_bench",
                "trains one model in zenflow, sync-offload and no-offload modes (same data, "
                "seed and schedule) and prints the comparison.");
  flags.AddBool("quick", &o->quick, "fewer steps (about 3 minutes on 2 cores)");
  flags.AddInt("steps", &o->steps, "steps per mode from scratch (0: 200 quick, 500 otherwise)");
  flags.AddInt("nproc", &o->nproc, "TSP ranks per run");
  flags.AddInt("layers", &o->layers, "model blocks");
  flags.AddInt("d_model", &o->d_model, "model width");
  flags.AddInt("heads", &o->heads, "attention heads");
  flags.AddInt("d_ff", &o->d_ff, "MLP width");
  flags.AddInt("seq_len", &o->seq_len, "sequence length");
  flags.AddInt("batch", &o->batch, "sequences per step");
  flags.AddString("out_dir", &o->out_dir, "where the runs' metrics and the plot go");
  flags.AddString("zenflow_args", &o->zenflow_args,
                  "extra trainer flags for the zenflow runs (e.g. \"--engine_warmup 0\"), to "
                  "measure a ZenFlow setting against no-offload in the same run");
  flags.AddInt("pretrain_steps", &o->pretrain_steps,
               "fine-tuning comparison: no-offload pre-training steps (0: 60 quick, 200; -1: skip)");
  flags.AddInt("finetune_steps", &o->finetune_steps,
               "fine-tuning comparison: steps per mode from the pre-trained weights (0: 40, 100)");
  flags.AddDouble("finetune_lr", &o->finetune_lr, "fine-tuning comparison: peak learning rate");
  flags.AddString("jumps", &o->jumps,
                  "RUN_DIR[,BASELINE_DIR]: only print the largest gradient-norm jump of a trainer "
                  "run (a step's norm over the median of its previous 10, from metrics.csv), at "
                  "steps where the baseline run's own jump stays below 3x");
  flags.AddString("stallfreed", &o->stallfreed,
                  "the stallfreed binary (default: found beside this one, or in its runfiles)");
  flags.AddString("trainer", &o->trainer_bin,
                  "the trainer binary (default: found beside this one, or in its runfiles)");
  if (int code = flags.ParseCommandLine(argc, argv); code >= 0) return code;
  if (o->steps == 0) o->steps = o->quick ? 200 : 500;
  if (o->pretrain_steps == 0) o->pretrain_steps = o->quick ? 60 : 200;
  if (o->finetune_steps == 0) o->finetune_steps = o->quick ? 40 : 100;
  return -1;
}

// --jumps RUN_DIR[,BASELINE_DIR]: prints the run's largest gradient-norm jump.
int PrintJumps(const std::string& jumps) {
  const size_t comma = jumps.find(',');
  const std::string run = jumps.substr(0, comma);
  if (ReadGradNorms(run + "/metrics.csv").size() <= 10) {
    fprintf(stderr, "train_bench: --jumps: %s/metrics.csv is missing or has <= 10 steps\n",
            run.c_str());
    return 1;
  }
  int64_t at = 0;
  double j = 0;
  if (comma == std::string::npos) {  // every step counts
    const std::vector<double> all = NormJumps(ReadGradNorms(run + "/metrics.csv"));
    const auto it = std::max_element(all.begin(), all.end());
    j = *it;
    at = (it - all.begin()) + 1;
  } else {
    j = MaxOwnJump(run + "/metrics.csv", jumps.substr(comma + 1) + "/metrics.csv", &at);
  }
  printf("largest gradient-norm jump of %s: %.1fx at step %ld\n", run.c_str(), j, (long)at);
  return 0;
}

const std::vector<std::string> kModes = {"no-offload", "sync-offload", "zenflow"};

// The runs' summaries: from scratch, and (pretrain_steps > 0) fine-tuned, fp32 and bf16.
struct Results {
  std::map<std::string, Summary> summary, tuned, tuned_bf16;
  std::vector<std::pair<std::string, std::string>> plots;  // (mode, metrics.csv) from scratch
};

// The trainer runs against one daemon: every mode from scratch, then the fine-tuning
// comparison. False if a run failed (reported).
class Runs {
 public:
  Runs(const Options& o, std::string trainer, std::string socket)
      : o_(o), trainer_(std::move(trainer)), socket_(std::move(socket)) {}

  bool FromScratch(Results* r) {
    for (const std::string& mode : kModes) {
      if (!Train(mode, mode, o_.steps,
                 absl::StrCat("--lr 3e-3", mode == "zenflow" ? " " + o_.zenflow_args : "")))
        return false;
      r->summary[mode] = ReadSummary(o_.out_dir + "/" + mode + "/summary.json");
      r->plots.push_back({mode, o_.out_dir + "/" + mode + "/metrics.csv"});
    }
    return true;
  }

  // Fine-tuning, the published setting: every mode starts from the same no-offload pre-trained
  // weights (fresh optimizer, another data order) at a lower learning rate.
  bool FineTuned(Results* r) {
    if (o_.pretrain_steps <= 0) return true;
    if (!Train("pretrain", "no-offload", o_.pretrain_steps, "--lr 3e-3")) return false;
    const std::string init = absl::StrCat(o_.out_dir, "/pretrain/checkpoints/bench-pretrain-step",
                                          o_.pretrain_steps);
    for (const std::string& mode : kModes) {
      const std::string name = "finetune-" + mode;
      if (!Train(name, mode, o_.finetune_steps,
                 absl::StrCat("--seed 2 --lr_warmup 0 --lr ", o_.finetune_lr, " --init_from ",
                              init, mode == "zenflow" ? " " + o_.zenflow_args : "")))
        return false;
      r->tuned[mode] = ReadSummary(o_.out_dir + "/" + name + "/summary.json");
    }
    // The same fine-tuning with a bf16 model (the fp32 pre-trained weights rounded to bf16), in
    // zenflow against no-offload.
    for (const std::string mode : {"no-offload", "zenflow"}) {
      const std::string name = "finetune-bf16-" + mode;
      if (!Train(name, mode, o_.finetune_steps,
                 absl::StrCat("--seed 2 --lr_warmup 0 --lr ", o_.finetune_lr, " --init_from ",
                              init, " --model_dtype bf16",
                              mode == "zenflow" ? " " + o_.zenflow_args : "")))
        return false;
      r->tuned_bf16[mode] = ReadSummary(o_.out_dir + "/" + name + "/summary.json");
    }
    return true;
  }

 private:
  // One trainer run; false if it failed (reported).
  bool Train(const std::string& name, const std::string& mode, int64_t n,
             const std::string& extra) {
    const std::string dir = absl::StrCat(o_.out_dir, "/", name);
    std::string cmd = absl::StrCat(
        trainer_, " --preset tiny --quiet --mode ", mode, " --layers ", o_.layers,
        " --d_model ", o_.d_model, " --heads ", o_.heads, " --d_ff ", o_.d_ff, " --seq_len ",
        o_.seq_len, " --batch ", o_.batch, " --steps ", n, " --nproc ", o_.nproc,
        " --eval_every ", std::max<int64_t>(n / 4, 1), " --eval_batches 8 --socket ", socket_,
        " --out_dir ", dir, " --run_name bench-", name, " ", extra);
    printf("\n== %s\n", name.c_str());
    std::fflush(stdout);
    const int status = std::system(cmd.c_str());
    if (status != 0)
      fprintf(stderr, "train_bench: the %s run failed (status %d): %s\n", name.c_str(), status,
              cmd.c_str());
    return status == 0;
  }

  const Options& o_;
  const std::string trainer_, socket_;
};

// The modes' table, the plot and the fine-tuning table.
void PrintTables(const Options& o, Results& r) {
  const std::string png = o.out_dir + "/train_bench.png";
  absl::Status plotted =
      stallfree::trainer::WritePlot(png, r.plots, "train_bench: the three modes");
  printf("\n%-14s %12s %12s %12s %12s %12s %12s\n", "mode", "train loss", "eval loss",
         "tokens/s", "step (s)", "stall (s)", "stall share");
  for (const std::string& mode : kModes) {
    Summary& s = r.summary[mode];
    printf("%-14s %12.4f %12.4f %12.0f %12.4f %12.4f %12.3f\n", mode.c_str(),
           s["final_train_loss"], s["final_eval_loss"], s["tokens_per_s"], s["step_s"],
           s["stall_s"], s["stall_share"]);
  }
  printf("plot: %s\n", plotted.ok() ? png.c_str() : std::string(plotted.message()).c_str());
  if (r.tuned.empty()) return;
  printf("\nfine-tuning: %ld no-offload steps, then %ld steps per mode at lr %.1e\n",
         (long)o.pretrain_steps, (long)o.finetune_steps, o.finetune_lr);
  printf("%-16s %12s %12s\n", "mode", "train loss", "eval loss");
  for (const std::string& mode : kModes)
    printf("%-16s %12.4f %12.4f\n", mode.c_str(), r.tuned[mode]["final_train_loss"],
           r.tuned[mode]["final_eval_loss"]);
  for (const std::string mode : {"no-offload", "zenflow"})
    printf("%-16s %12.4f %12.4f   (bf16 model: %.2f bytes of weights and gradients per "
           "parameter; the engine's device state %.2f)\n",
           (mode + " bf16").c_str(), r.tuned_bf16[mode]["final_train_loss"],
           r.tuned_bf16[mode]["final_eval_loss"], r.tuned_bf16[mode]["model_bytes_per_param"],
           r.tuned_bf16[mode]["engine_device_bytes_per_param"]);
}

// The FIGURE lines.
void PrintFigures(const Options& o, Results& r) {
  Summary& z = r.summary["zenflow"];
  Summary& n = r.summary["no-offload"];
  Summary& y = r.summary["sync-offload"];
  auto& tuned = r.tuned;
  auto& tuned_bf16 = r.tuned_bf16;
  printf("\nFIGURE train_zenflow_vs_nooffload_eval_loss_scratch %.4f x (target <= 1.05)\n",
         z["final_eval_loss"] / n["final_eval_loss"]);
  if (!tuned.empty()) {
    printf("FIGURE train_zenflow_vs_nooffload_eval_loss_finetune %.4f x (target <= 1.01)\n",
           tuned["zenflow"]["final_eval_loss"] / tuned["no-offload"]["final_eval_loss"]);
    printf("FIGURE train_zenflow_vs_nooffload_eval_loss_finetune_bf16 %.4f x (target <= 1.01)\n",
           tuned_bf16["zenflow"]["final_eval_loss"] / tuned_bf16["no-offload"]["final_eval_loss"]);
    // What the model's storage costs (the engine's accounting of the buffers it updates and
    // reads): bf16 against the fp32 model's 8. The CPU trainer computes in fp32 from working
    // copies beside it (summary.json's working_bytes_per_param).
    printf("FIGURE train_bf16_model_weight_grad_bytes_per_param %.2f bytes (fp32 model: %.2f)\n",
           tuned_bf16["zenflow"]["model_bytes_per_param"],
           tuned["zenflow"]["model_bytes_per_param"]);
    printf("FIGURE train_bf16_zenflow_engine_device_bytes_per_param %.2f bytes\n",
           tuned_bf16["zenflow"]["engine_device_bytes_per_param"]);
  }
  int64_t at = 0, at_tuned = 0;
  double jump = MaxOwnJump(o.out_dir + "/zenflow/metrics.csv",
                           o.out_dir + "/no-offload/metrics.csv", &at);
  if (!tuned.empty()) {
    const double j = MaxOwnJump(o.out_dir + "/finetune-zenflow/metrics.csv",
                                o.out_dir + "/finetune-no-offload/metrics.csv", &at_tuned);
    printf("zenflow's largest own gradient-norm jump: %.1fx at step %ld from scratch, %.1fx at "
           "step %ld fine-tuning\n", jump, (long)at, j, (long)at_tuned);
    jump = std::max(jump, j);
  }
  printf("FIGURE train_zenflow_max_grad_norm_jump %.2f x (target <= 3)\n", jump);
  printf("FIGURE train_zenflow_vs_sync_offload_step_time %.4f x\n", z["step_s"] / y["step_s"]);
  printf("FIGURE train_stall_share_zenflow %.4f\n", z["stall_share"]);
  printf("FIGURE train_stall_share_sync_offload %.4f\n", y["stall_share"]);
  for (const std::string& mode : kModes)
    printf("FIGURE train_tokens_per_s_%s %.1f tokens/s\n", mode.c_str(),
           r.summary[mode]["tokens_per_s"]);
  printf("FIGURE train_host_traffic_per_step_zenflow %.3f x bf16 model\n",
         z["host_traffic_per_step_over_bf16_model"]);
}

int Run(int argc, char** argv) {
  namespace testing = stallfree::testing;
  Options o;
  if (int code = ParseOptions(argc, argv, &o); code >= 0) return code;
  if (!o.jumps.empty()) return PrintJumps(o.jumps);
  testing::SetBinary("trainer/trainer", o.trainer_bin);
  const std::string trainer = testing::FindBinary("trainer/trainer");
  if (trainer.empty()) {
    fprintf(stderr, "train_bench: %s\n",
            testing::MissingBinaryMessage("trainer/trainer", "//trainer", "--trainer").c_str());
    return 1;
  }
  testing::SetBinary("server/stallfreed", o.stallfreed);
  testing::Daemon daemon({"--threads", "2"}, "warning");
  if (!daemon.started()) return 1;  // the Daemon said where it looked
  printf("train_bench: %ld layers, d_model %ld, heads %ld, d_ff %ld, seq %ld, batch %ld, %ld steps, "
         "D = %ld, the generated corpus; zenflow: ratio 0.1, S = 4, bf16 transfers\n",
         (long)o.layers, (long)o.d_model, (long)o.heads, (long)o.d_ff, (long)o.seq_len,
         (long)o.batch, (long)o.steps, (long)o.nproc);
  Results r;
  Runs runs(o, trainer, daemon.socket());
  if (!runs.FromScratch(&r) || !runs.FineTuned(&r)) return 1;
  PrintTables(o, r);
  PrintFigures(o, r);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return Run(argc, argv); }
