// The GPT trainer: a GPT-style model (parallel::DistributedModel in the TSP layout) trained by
// D ranks with the ZenFlow engine (engine/zenflow.h) over stallfreed, optionally replicated N
// times for data parallelism (--dp N: N x D ranks).
//
// One rank's work is RunRank: every rank reads the same corpus and draws the same batches (the
// model picks each rank's zigzag tokens), holds its TSP shard of the weights, and runs its own
// ZenFlow engine and daemon session for its own shards (replicated tensors — embeddings, norms,
// head — receive all-reduced gradients, so every rank's engine applies the same update to its
// copy). Gradients are clipped by their global norm, summed across ranks. Rank 0 prints the
// progress and writes the metrics (JSON lines) and the summary.
//
// Data parallelism (ARCHITECTURE.md, "Scale-out"): N replicas of the TSP group; global rank =
// replica * D + TSP rank; the rank's groups are its replica's TSP group and its data-parallel
// group (the N ranks of its TSP index). `batch` is the batch of ONE replica: each step draws a
// global batch of N x batch sequences and replica i trains on sequences [i B, (i + 1) B), so
// `--dp N --batch B` sees the batches of `--dp 1 --batch N*B`. After the backward the gradients
// are averaged over the data-parallel group (one all-reduce of all of them), then clipped
// (the norm, the same on every replica, over the TSP group). The optimizer state is partitioned
// by engine/partition.h's rule: the engine of data-parallel rank r is built over row-block
// views of the rank's tensors (rows [R r/N, R (r+1)/N) of each, replicated whole where R < N),
// so its daemon session registers, receives and updates only that block; the engine's
// ScoreReduce all-reduces the column scores of the partitioned weights over the group (every
// replica picks the same hot columns); after each step (and after the final Flush) one
// all-gather of a padded flat buffer of the updated blocks gives every replica the whole
// parameters. Losses (train and eval) are the mean over the replicas, i.e. over the global
// batch. Checkpoint files and daemon tags carry the global rank. A resume may change --dp (not
// D, nor the global batch N x batch): the model tensors are whole in every rank's file, and rank
// (replica s, TSP index p) of the new run reads the files and daemon checkpoints of only the old
// replicas at index p whose row blocks overlap its own (engine/repartition.h, SourceRanks), cuts
// its engine and daemon state from them by whole rows (Repartition) and restores its fresh
// engine from them (RestoreBytes: the daemon part goes straight into the session, no file): the run continues as the uninterrupted one would, up to the
// summation order of the gradient average and the column scores (tests/trainer/
// trainer_dp_test.cc).
//
// Checkpoints (every --checkpoint_every steps and at the end): each rank writes
// <out_dir>/checkpoints/<tag>.rank<r>.trainer (its shard, the engine's state, the data position,
// a checksum; trainer/checkpoint.h, written atomically) and the daemon writes its state as
// <tag>.r<r> (r: the global rank).  --resume <tag> continues from there exactly as the
// uninterrupted run would. After each checkpoint only the run's newest --keep_checkpoints stay:
// each rank removes its older trainer files and the daemon's checkpoints of the same tags.
//
// bf16 models (--model_dtype bf16, TrainOptions::model_dtype): every tensor's value and gradient
// buffers, the ones the engine updates and reads (EngineParam::dtype BF16), are bf16 storage
// (2 + 2 bytes per parameter instead of 4 + 4); the engine holds the fp32 masters of the
// device-side share and the daemon those of the cold columns, and every bf16 value is the
// rounding of its master. The model computes in fp32 (parallel::DistributedModel has no bf16
// weights): before a forward, the bf16 values are widened (exactly) into fp32 working copies of
// the shard's weights, the backward writes fp32 working gradients, which are averaged over the
// replicas, clipped by their global norm (all in fp32, as for an fp32 model), then rounded once
// to nearest even into the bf16 gradient buffers the engine reads. The working copies are the
// compute path's, whole-shard and kept between steps (the model takes whole-shard views; a
// layer-by-layer widening needs a bf16-weight model API). Initial weights are the bf16 rounding
// of the fp32 initialisation; --init_from rounds an fp32 checkpoint's weights (and widens a bf16
// one's into an fp32 model). The data-parallel all-gather moves the updated bf16 blocks as bf16.
// Checkpoints store the bf16 values (2 bytes each) and record the model dtype: a resume with
// another --model_dtype is refused. --dump_init (an fp32 model's starting point) is refused.
//
// Devices (trainer/device.h): with device "cpu" the shard, its gradients and the engine's
// device-side state are host memory, the model's collectives run over the Gloo group. With
// "cuda" (CUDA builds) each rank uses GPU LOCAL_RANK: the shard and gradients live in device
// memory (the model's view form, kernels/cuda ops, NCCL for the model's collectives and for the
// data-parallel group, the CUDA optimizer kernel for the engine's hot columns; cold columns go
// through the session's region), the gradient norm comes from per-column sums of squares on the
// device, and checkpoints hold the downloaded values in the same file format (resume uploads
// them).
//
// The code: RunRank (trainer/gpt.cc) runs attempts of trainer/run.h's TrainRun (setup, restore,
// open, loop, finish), again from the last checkpoint when the daemon went away (trainer/
// daemon_loss.h decides that by status code). Beside it: the model tensors on the device
// (trainer/shard.h), the data-parallel partition and collectives (trainer/data_parallel.h), the
// checkpoint files (trainer/checkpoint.h) and --resume's reading of them (trainer/resume.h),
// --dump_init (trainer/init_dump.h), the summary (trainer/summary.h) and the presets
// (trainer/presets.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/zenflow.h"
#include "parallel/communicator.h"
#include "parallel/reference_block.h"
#include "trainer/presets.h"

namespace stallfree {
namespace trainer {

struct TrainOptions {
  // Model: the preset's shape, where a field here is 0.
  std::string preset = "tiny";
  // batch: sequences per step of one replica (the global batch is --dp times it).
  int64_t layers = 0, d_model = 0, heads = 0, d_ff = 0, seq_len = 0, batch = 0;
  bool tied_head = false;
  std::string positions = "learned";  // learned | none
  // Optimisation.
  int64_t steps = 100;
  int64_t stop_at = 0;        // stop (with a checkpoint) after this step; 0: at `steps`
  double lr = 3e-3;
  double min_lr_ratio = 0.1;  // cosine decay to lr * min_lr_ratio at `steps`
  int64_t lr_warmup = 10;     // linear warm-up steps
  double clip = 1.0;          // global gradient-norm clip (0: off)
  uint32_t seed = 1;
  ZenFlowConfig engine;       // mode, ratio, intervals, AdamW betas / eps / weight decay
  // > 0: the engine's device memory in bytes per parameter of this rank's shard (whole over
  // the data-parallel replicas); the run's topk_ratio is the largest that fits it
  // (engine/zenflow.h, TopkForBudget), instead of engine.topk_ratio.
  double device_budget = 0;
  // The model's own storage of its weights and gradients (--model_dtype): FP32, or BF16 (uint16,
  // round to nearest even; the engine keeps the fp32 masters, engine/zenflow.h "bf16
  // parameters"). Not engine.param_dtype / grad_dtype, which name what crosses to and from the
  // daemon. See "bf16 models" above.
  DType model_dtype = DType::kFp32;
  // Data.
  std::string data;           // empty: the generated default corpus
  std::string format = "auto";
  double eval_fraction = 0.1;
  int64_t eval_every = 25;    // 0: only at the end
  int64_t eval_batches = 4;
  // Output and state.
  std::string out_dir = "train-out";
  std::string run_name = "run";
  int64_t checkpoint_every = 0;  // 0: only at the end
  int64_t keep_checkpoints = 3;  // the newest N of this run stay (trainer and daemon); 0: all
  // When the daemon goes away: wait this long for it to come back, then continue from the last
  // checkpoint (computing the steps since again); 0: fail at once, naming the --resume command.
  int64_t reconnect_s = 60;
  // The bound of every call to the daemon in seconds (client/client.h, Deadlines); 0:
  // $STALLFREE_RPC_TIMEOUT, else 120. A daemon that does not answer within it fails the step.
  double rpc_timeout_s = 0;
  std::string command_line;      // how this run was started, for the --resume hint
  std::string resume;            // a checkpoint tag written by an earlier run
  // Weights only (fresh optimizer and data order) from another run's checkpoint, given as its
  // path without the ".rank<r>.trainer" suffix, e.g. runs/a/checkpoints/a-step400.
  std::string init_from;
  // Writes the run's starting point into this directory (single rank only, not with --resume),
  // then trains as usual: a re-implementation elsewhere (tests/python/test_trainer_vs_torch.py)
  // loads it and follows the run step by step. Files (every number little-endian):
  //   manifest.json  format "stallfree-trainer-init/1"; "model" (layers, d_model, heads, d_ff,
  //                  vocab, seq_len, max_seq, positions, tied_head, norm_eps), "optimizer"
  //                  (mode, lr, lr_warmup, min_lr_ratio, steps, clip, weight_decay, beta1,
  //                  beta2, eps, and lr_per_step: the rate of steps 1..steps), "data" (source,
  //                  batch, seed, token counts, eval_every, eval_steps: the steps after whose
  //                  update the eval loss is measured, eval_batches), "tensors" (name, shape,
  //                  file, in the engine's order) and "batches" (file, shape, dtype).
  //   <name>.f32     each weight, float32 row-major, after initialisation (or --init_from):
  //                  embedding [vocab, C]; pos_embedding [max_seq, C] (learned positions);
  //                  per block l: block<l>.ln1, .ln2 [C], .wqkv [3C, C] = the rows of Wq, Wk,
  //                  Wv, .wo [C, C], .wgu [2 FF, C] = the rows of Wg, Wu, .wd [C, FF]; ln_f [C];
  //                  head [vocab, C] (untied head). Every W is [out, in] as in F.linear.
  //   tokens.i32, targets.i32            int32 [steps, B, T]: the batch of each step 1..steps.
  //   eval_tokens.i32, eval_targets.i32  int32 [eval_batches, B, T]: every evaluation's batches.
  // The math is parallel/reference_block.h's; the schedule LearningRate's (trainer/run.cc);
  // clipping scales every gradient by float(clip / norm) when the fp64 global norm exceeds clip;
  // AdamW (kernels/optimizer.h) decays every tensor, 1-D ones included. The run checks that
  // each batch it trains and evaluates on is the dumped one.
  std::string dump_init;
  std::string socket;            // stallfreed's socket (zenflow, sync-offload)
  bool quiet = false;            // no per-step lines
  std::string device = "cpu";    // cpu | cuda (CUDA builds only; GPU LOCAL_RANK)
};

// The model configuration the options describe for vocab `vocab`, checked against D ranks:
// InvalidArgument naming the field that does not divide (heads, d_ff, seq_len by 2D).
absl::StatusOr<parallel::ModelConfig> ModelFromOptions(const TrainOptions& options, int64_t vocab,
                                                       int64_t seq_len, int D);

// A rank's host (Gloo) groups: its replica's TSP group and, with data parallelism, its
// data-parallel group (the ranks of the same TSP index in the N replicas; its rank is the
// replica's index). Global rank = dp->rank() * tsp->size() + tsp->rank().
struct RankGroups {
  parallel::Communicator* tsp = nullptr;
  parallel::Communicator* dp = nullptr;  // null (or of size 1): one replica
};

// Trains on this rank (local_rank: this rank's index on its node, the GPU it uses with device
// "cuda"). Collective: every rank of every group must call it with the same options.
absl::Status RunRank(const TrainOptions& options, const RankGroups& groups, int local_rank = 0);
// One replica: comm is the TSP group.
absl::Status RunRank(const TrainOptions& options, parallel::Communicator* comm,
                     int local_rank = 0);

}  // namespace trainer
}  // namespace stallfree
