// trainer: a GPT-style model trained by TSP ranks with ZenFlow offload to stallfreed.
//
//   trainer --socket /run/stallfree/stallfreed.sock --preset demo --nproc 2 --mode zenflow
//
// With --nproc D and --dp N (N x D > 1) and no RANK in the environment, the trainer starts
// N x D local ranks of itself (parallel::LaunchLocal); under torchrun / Slurm / a launcher that
// sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, each process is one rank, and WORLD_SIZE
// must be N x D (without --nproc: D = WORLD_SIZE / N). Global rank = replica * D + TSP rank:
// the ranks of a replica (a TSP group) are consecutive, so a node's ranks hold whole replicas
// when D divides the ranks per node. --dp N > 1 builds two Gloo groups per rank over the one
// rendezvous store (parallel::NewGlooGroups): the TSP group of its replica and the
// data-parallel group of its TSP index (trainer/gpt.h has what --dp does).
//
// The daemon: --socket, else $STALLFREE_SOCKET, else the node's default socket; each rank uses
// the daemon of its own node (several nodes: several daemons, one socket path each).
//
// --device cuda (binaries built with --config=cuda): each rank trains on GPU LOCAL_RANK, with
// NCCL between the ranks' GPUs (trainer/device.h); the default, --device cpu, trains on the CPU
// with Gloo.
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/flags.h"
#include "parallel/communicator.h"
#include "parallel/launcher.h"
#include "trainer/device.h"
#include "trainer/gpt.h"

namespace {

std::string DefaultSocket() {
  const char* env = getenv("STALLFREE_SOCKET");
  if (env != nullptr && *env != '\0') return env;
  const char* xdg = getenv("XDG_RUNTIME_DIR");
  if (xdg != nullptr && *xdg != '\0') return std::string(xdg) + "/stallfree/stallfreed.sock";
  return "/run/stallfree/stallfreed.sock";
}

std::string SelfPath() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "";
  buf[n] = '\0';
  return buf;
}

// The flags that are not TrainOptions fields as given.
struct CommandLine {
  std::string mode = "zenflow", grad_dtype = "bf16", param_dtype = "bf16", model_dtype = "fp32";
  int64_t nproc = 0, dp = 1, seed = 1;  // nproc 0: not given (1, or WORLD_SIZE / dp)
};

// The model's shape.
void AddModelFlags(stallfree::FlagSet* flags, stallfree::trainer::TrainOptions* o) {
  flags->AddString("preset", &o->preset, "model preset (below); the shape flags override it");
  flags->AddInt("layers", &o->layers, "transformer blocks (0: the preset's)");
  flags->AddInt("d_model", &o->d_model, "model width (0: the preset's)");
  flags->AddInt("heads", &o->heads, "attention heads (0: the preset's)");
  flags->AddInt("d_ff", &o->d_ff, "MLP hidden width (0: the preset's)");
  flags->AddInt("seq_len", &o->seq_len, "tokens per sequence (0: the preset's)");
  flags->AddInt("batch", &o->batch, "sequences per step (0: the preset's)");
  flags->AddBool("tied_head", &o->tied_head, "use the embedding as the output head");
  flags->AddString("positions", &o->positions, "position encoding: learned or none");
  flags->AddInt("steps", &o->steps, "training steps (the learning-rate schedule's length)");
  flags->AddInt("stop_at", &o->stop_at, "stop after this step with a checkpoint (0: --steps)");
}

// The optimisation: schedule, AdamW, the offload mode and ZenFlow's knobs, the dtypes.
void AddOptimizerFlags(stallfree::FlagSet* flags, stallfree::trainer::TrainOptions* o,
                       CommandLine* c) {
  flags->AddDouble("lr", &o->lr, "peak learning rate");
  flags->AddDouble("min_lr_ratio", &o->min_lr_ratio, "final learning rate over the peak (cosine)");
  flags->AddInt("lr_warmup", &o->lr_warmup, "linear learning-rate warm-up steps");
  flags->AddDouble("clip", &o->clip, "clip gradients to this global norm (0: off)");
  flags->AddDouble("weight_decay", &o->engine.weight_decay, "AdamW weight decay");
  flags->AddDouble("beta1", &o->engine.beta1, "AdamW's first-moment decay, in [0, 1)");
  flags->AddDouble("beta2", &o->engine.beta2, "AdamW's second-moment decay, in [0, 1)");
  flags->AddDouble("eps", &o->engine.eps, "AdamW's epsilon, >= 0");
  flags->AddInt("seed", &c->seed, "initialisation and data-order seed");
  flags->AddString("mode", &c->mode, "optimizer offload: zenflow, sync-offload or no-offload");
  flags->AddDouble("topk_ratio", &o->engine.topk_ratio,
                   "ZenFlow: hot share of each weight's columns");
  flags->AddDouble("device_budget", &o->device_budget,
                   "ZenFlow: instead of topk_ratio, the engine's device bytes per parameter "
                   "(masters, moments, transfer buffers, selection); the largest hot share that "
                   "fits it (0: off)");
  flags->AddInt("update_interval", &o->engine.update_interval,
                "ZenFlow: steps per daemon update (S); 0: auto, the shortest round whose update "
                "the step's compute hides, chosen as the run goes");
  flags->AddInt("max_update_interval", &o->engine.max_update_interval,
                "ZenFlow: the longest round update_interval 0 (auto) may choose");
  flags->AddInt("select_interval", &o->engine.select_interval,
                "ZenFlow: steps between reselections, a multiple of S (0: 4 S; 0 with auto)");
  flags->AddInt("engine_warmup", &o->engine.warmup_steps,
                "ZenFlow: first steps with synchronous full updates");
  flags->AddBool("await_updates", &o->engine.await_updates,
                 "ZenFlow: wait for each daemon update (no staleness)");
  flags->AddBool("predict_cold", &o->engine.predict_cold,
                 "ZenFlow: land each round's update predicted one round ahead (2 p_R - p_R-1)");
  flags->AddInt("land_lag", &o->engine.land_lag,
                "ZenFlow: steps after its boundary at which a round's update lands, 1..S "
                "(0: S, the next boundary)");
  flags->AddString("model_dtype", &c->model_dtype,
                   "the model's weight and gradient storage: fp32, or bf16 (2 + 2 "
                   "bytes per parameter; the optimizer keeps fp32 masters, the engine those of the "
                   "device-side share, stallfreed those of the cold columns; the model computes "
                   "in fp32 from widened copies). Distinct from --param_dtype / --grad_dtype, "
                   "which name only what crosses to and from stallfreed. A resume keeps it");
  flags->AddString("grad_dtype", &c->grad_dtype,
                   "gradients sent to the daemon: bf16 or fp32 (a transfer format, not the "
                   "model's storage: see --model_dtype)");
  flags->AddString("param_dtype", &c->param_dtype,
                   "parameters returned by the daemon: bf16 or fp32 (a transfer format, not the "
                   "model's storage: see --model_dtype)");
}

// Data, output, checkpoints and recovery, ranks and the device.
void AddRunFlags(stallfree::FlagSet* flags, stallfree::trainer::TrainOptions* o, CommandLine* c) {
  using namespace stallfree;
  flags->AddString("data", &o->data,
                   "training text (UTF-8, byte tokens) or uint16 token ids "
                   "(.u16 / .bin); empty: the generated default corpus");
  flags->AddString("format", &o->format, "data format: auto, bytes or uint16");
  flags->AddDouble("eval_fraction", &o->eval_fraction, "held-out share of the data (0..0.5)");
  flags->AddInt("eval_every", &o->eval_every, "evaluate every N steps (0: at the end only)");
  flags->AddInt("eval_batches", &o->eval_batches, "batches per evaluation");
  flags->AddString("out_dir", &o->out_dir, "metrics.csv, summary.json, train.png, checkpoints/");
  flags->AddString("run_name", &o->run_name, "names the run's checkpoints and daemon sessions");
  flags->AddInt("checkpoint_every", &o->checkpoint_every,
                "checkpoint every N steps (0: at the end only)");
  flags->AddInt("reconnect_s", &o->reconnect_s,
                "if stallfreed goes away, wait this long for it (systemd restarts it): the "
                "restarted daemon takes the run's sessions back and the run goes on where it was "
                "(from the last checkpoint if a session's state cannot be taken back); 0: stop "
                "at once and print the --resume command");
  flags->AddDouble("rpc_timeout", &o->rpc_timeout_s,
                   "seconds any call to stallfreed may take, a wait for its update included, "
                   "before the run fails naming the daemon (a stopped or hung one); 0: the client "
                   "library's default, 120");
  flags->AddInt("keep_checkpoints", &o->keep_checkpoints,
                "keep the run's newest N checkpoints, trainer files and the daemon's (0: all)");
  flags->AddString("resume", &o->resume,
                   "continue from this checkpoint tag (<run>-step<N>); --dp may differ from the "
                   "writing run's (the optimizer state is re-partitioned), --nproc and the global "
                   "batch (--dp x --batch) may not");
  flags->AddString("init_from", &o->init_from,
                   "start from another run's weights (fresh optimizer): <out_dir>/checkpoints/"
                   "<run>-step<N>, any mode");
  flags->AddString("dump_init", &o->dump_init,
                   "write the initial weights (float32), the batches of every step (int32) and "
                   "the configuration (manifest.json) into this directory, then train as usual "
                   "(--nproc 1; the format is in trainer/gpt.h)");
  flags->AddString(
      "socket", &o->socket,
      "stallfreed's gRPC socket (default: $STALLFREE_SOCKET, else the node's default)");
  flags->AddInt("nproc", &c->nproc,
                "TSP ranks per replica (D); 0: 1 when the trainer starts its ranks itself, "
                "WORLD_SIZE / --dp under an external launcher (RANK set), where WORLD_SIZE must "
                "equal --dp x --nproc");
  flags->AddInt("dp", &c->dp,
                "data-parallel replicas of the TSP group (N): N x D ranks, each replica on its "
                "own N-th of every global batch of N x --batch sequences; gradients averaged "
                "across replicas; the offloaded optimizer state partitioned across them (each "
                "rank's daemon session holds 1/N of its shard's); e.g. trainer --dp 2 --nproc 2 "
                "starts 4 ranks");
  flags->AddBool("quiet", &o->quiet, "no per-step progress lines");
  flags->AddString("device", &o->device,
                   trainer::CudaBuilt()
                       ? "cpu, or cuda: each rank on GPU LOCAL_RANK (NCCL between the GPUs)"
                       : "cpu (this binary was built without CUDA; --config=cuda adds cuda)");
}

// The command line without --resume, for the hint a run prints when the daemon is gone.
std::string CommandLineWithoutResume(int argc, char** argv) {
  std::string line;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--resume" || arg == "-resume") {
      ++i;
      continue;
    }
    if (arg.rfind("--resume=", 0) == 0) continue;
    const bool plain = arg.find_first_of(" \t'\"$\\") == std::string::npos && !arg.empty();
    line += (i == 0 ? "" : " ") + (plain ? arg : "'" + arg + "'");
  }
  return line;
}

// The flags of `c` into `o`; -1, or the exit code of a usage error (printed).
int ApplyFlags(const CommandLine& c, stallfree::trainer::TrainOptions* o) {
  using namespace stallfree;
  auto parsed = ParseOffloadMode(c.mode);
  if (!parsed.ok()) {
    fprintf(stderr, "trainer: --mode: %s\n", std::string(parsed.status().message()).c_str());
    return 2;
  }
  o->engine.mode = *parsed;
  for (auto [name, text, out] :
       {std::make_tuple("grad_dtype", c.grad_dtype, &o->engine.grad_dtype),
        std::make_tuple("param_dtype", c.param_dtype, &o->engine.param_dtype),
        std::make_tuple("model_dtype", c.model_dtype, &o->model_dtype)}) {
    absl::StatusOr<DType> dtype = ParseDType(text);
    if (!dtype.ok()) {
      fprintf(stderr, "trainer: --%s: %s\n", name, std::string(dtype.status().message()).c_str());
      return 2;
    }
    *out = *dtype;
  }
  if (c.seed < 0 || c.seed > UINT32_MAX || c.nproc < 0 || c.nproc > 64 || c.dp < 1 || c.dp > 64) {
    fprintf(stderr,
            "trainer: --seed must be in [0, 2^32), --nproc in [1, 64] and --dp in "
            "[1, 64]\n");
    return 2;
  }
  o->seed = static_cast<uint32_t>(c.seed);
  if (absl::Status st = trainer::CheckDeviceName(o->device); !st.ok()) {
    fprintf(stderr, "trainer: --%s\n", std::string(st.message()).c_str());
    return 2;
  }
  return -1;
}

// Starts `ranks` local ranks of this binary (parallel::LaunchLocal); their exit code.
int LaunchLocalRanks(int64_t ranks, int argc, char** argv) {
  using namespace stallfree;
  parallel::LaunchOptions lo;
  lo.nproc = static_cast<int>(ranks);
  lo.argv.push_back(SelfPath());
  for (int i = 1; i < argc; ++i) lo.argv.push_back(argv[i]);
  lo.store = parallel::LaunchOptions::Store::kFile;
  lo.prefix_output = false;  // rank 0 alone prints; errors name their rank themselves
  // One BLAS thread per rank: the ranks already use every core between them.
  lo.env.push_back({"OPENBLAS_NUM_THREADS", "1"});
  auto result = parallel::LaunchLocal(lo);
  if (!result.ok()) {
    fprintf(stderr, "trainer: cannot start %ld ranks: %s\n", (long)ranks,
            std::string(result.status().message()).c_str());
    return 1;
  }
  if (!result->ok())
    fprintf(stderr, "trainer: rank %d failed (exit code %d)\n", result->first_failed_rank,
            result->exit_code());
  return result->exit_code();
}

// This process is one rank under a launcher (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set).
int RunThisRank(const stallfree::trainer::TrainOptions& o, int64_t nproc, int64_t dp) {
  using namespace stallfree;
  auto options = parallel::CommOptions::FromEnvironment();
  if (!options.ok()) {
    fprintf(stderr, "trainer: %s\n", std::string(options.status().message()).c_str());
    return 2;
  }
  if (nproc == 0) {  // an external launcher and no --nproc: the world is dp replicas
    if (options->size % dp != 0) {
      fprintf(stderr,
              "trainer: WORLD_SIZE=%d ranks do not divide into --dp %ld replicas; "
              "launch a multiple of %ld ranks (or pass --nproc)\n",
              options->size, (long)dp, (long)dp);
      return 2;
    }
    nproc = options->size / dp;
  }
  if (options->size != nproc * dp) {
    fprintf(stderr,
            "trainer: WORLD_SIZE=%d, but --dp %ld x --nproc %ld = %ld ranks; launch "
            "%ld ranks, or change --dp / --nproc to match\n",
            options->size, (long)dp, (long)nproc, (long)(nproc * dp), (long)(nproc * dp));
    return 2;
  }
  // The groups: one Gloo communicator (the TSP group) with one replica; with several, the
  // replica's TSP group and the TSP index's data-parallel group over the one store.
  const int D = static_cast<int>(nproc), N = static_cast<int>(dp);
  const int replica = options->rank / D, tsp_rank = options->rank % D;
  std::vector<std::unique_ptr<parallel::Communicator>> comms;
  if (N == 1) {
    auto comm = parallel::NewGlooCommunicator(*options);
    if (!comm.ok()) {
      fprintf(stderr, "trainer: rank %d: %s\n", options->rank,
              std::string(comm.status().message()).c_str());
      return 1;
    }
    comms.push_back(*std::move(comm));
  } else {
    auto groups = parallel::NewGlooGroups(*options, {{absl::StrCat("tsp", replica), tsp_rank, D},
                                                     {absl::StrCat("dp", tsp_rank), replica, N}});
    if (!groups.ok()) {
      fprintf(stderr, "trainer: rank %d: %s\n", options->rank,
              std::string(groups.status().message()).c_str());
      return 1;
    }
    comms = *std::move(groups);
  }
  trainer::RankGroups rank_groups;
  rank_groups.tsp = comms[0].get();
  rank_groups.dp = N > 1 ? comms[1].get() : nullptr;
  absl::Status st = trainer::RunRank(o, rank_groups, options->local_rank);
  if (!st.ok()) {
    fprintf(stderr, "trainer: rank %d: %s\n", options->rank, st.ToString().c_str());
    const bool usage = st.code() == absl::StatusCode::kInvalidArgument ||
                       st.code() == absl::StatusCode::kNotFound ||
                       st.code() == absl::StatusCode::kUnavailable;
    return usage ? 2 : 1;
  }
  return 0;
}

int Run(int argc, char** argv) {
  using namespace stallfree;
  trainer::TrainOptions o;
  o.socket = DefaultSocket();
  CommandLine c;
  std::string presets;
  for (const auto& p : trainer::Presets())
    presets += absl::StrCat("\n  ", p.name, ": ", p.layers, " layers, d_model ", p.d_model, ", ",
                            p.heads, " heads, d_ff ", p.d_ff, ", seq ", p.seq_len, ", batch ",
                            p.batch, " (", p.note, ")");
  FlagSet flags("trainer",
                "trains a GPT-style model with TSP ranks and ZenFlow offload to stallfreed.\n\n"
                "Usage: trainer [flags]\n\nPresets:" +
                    presets);
  AddModelFlags(&flags, &o);
  AddOptimizerFlags(&flags, &o, &c);
  AddRunFlags(&flags, &o, &c);
  if (int code = flags.ParseCommandLine(argc, argv); code >= 0) return code;
  o.command_line = CommandLineWithoutResume(argc, argv);
  if (!flags.positional().empty()) {
    fprintf(stderr, "trainer: unexpected argument '%s'\n", flags.positional()[0].c_str());
    return 2;
  }
  if (int code = ApplyFlags(c, &o); code >= 0) return code;

  const bool external = getenv("RANK") != nullptr;
  if (!external && c.nproc == 0) c.nproc = 1;
  if ((c.nproc > 1 || c.dp > 1) && !o.dump_init.empty()) {
    fprintf(stderr,
            "trainer: --dump_init writes a single rank's whole model; run it with "
            "--nproc 1 --dp 1\n");
    return 2;
  }
  if (c.nproc * c.dp > 1 && !external) return LaunchLocalRanks(c.nproc * c.dp, argc, argv);
  return RunThisRank(o, c.nproc, c.dp);
}

}  // namespace

int main(int argc, char** argv) { return Run(argc, argv); }
