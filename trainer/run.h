// One attempt at training on this rank (trainer/gpt.h has what a run does; RunRank makes a new
// attempt after a lost daemon): a run object whose steps are its methods, called in this order.
//
//   Setup    the options checked; the data; the device, the model shard and its gradients (and a
//            bf16 model's storage); the daemon session and the engine; the data-parallel buffers.
//   Restore  --resume (every rank reads its sources, then all agree) or --init_from.
//   Open     metrics.csv and the banner (rank 0); --dump_init.
//   Loop     the steps: batch, forward, backward, average over the replicas, clip, the engine's
//            step, the gather of the replicas' blocks, evaluations, metrics, checkpoints.
//   Finish   the engine's final flush and gather, the run's totals over the ranks, the summary.
//
//   TrainRun run(options, world, local_rank, &progress);
//   RETURN_IF_ERROR(run.Setup());
//   ...
//
// Collective: every rank calls the same methods in the same order; the first error ends the
// attempt (a lost daemon as every rank agreed: progress->daemon_lost). Not thread safe.
// `options`, `progress` and the world's communicators must outlive the run.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/session_target.h"
#include "engine/zenflow.h"
#include "parallel/distributed_model.h"
#include "trainer/daemon_loss.h"
#include "trainer/data.h"
#include "trainer/data_parallel.h"
#include "trainer/device.h"
#include "trainer/gpt.h"
#include "trainer/init_dump.h"
#include "trainer/shard.h"
#include "trainer/summary.h"
#include "trainer/world.h"

namespace stallfree {
namespace trainer {

class TrainRun {
 public:
  TrainRun(const TrainOptions& options, const World& world, int local_rank, Progress* progress);
  ~TrainRun();
  TrainRun(const TrainRun&) = delete;
  TrainRun& operator=(const TrainRun&) = delete;

  absl::Status Setup();
  absl::Status Restore();
  absl::Status Open();
  absl::Status Loop();
  absl::Status Finish();

 private:
  // Setup's parts.
  absl::Status CheckOptions();
  absl::Status LoadData();
  absl::Status MakeModel();
  absl::Status StartEngine();
  // Restore's parts.
  absl::Status Resume();
  absl::Status InitFrom();
  // Open's parts.
  absl::Status OpenMetrics();
  absl::Status DumpInit();
  // One training step, and its parts.
  absl::Status Step(int64_t step);
  absl::StatusOr<double> ClipGradients();  // returns the global norm before clipping
  void RecordStep(int64_t step, double step_s, double compute, const StepTimings& tm);
  void WriteMetrics(int64_t step, double loss, double eval, double lr, double step_s,
                    double compute, const StepTimings& tm, double norm);
  absl::Status Checkpoint(int64_t step);
  // Finish's part: the daemon's share of the run, over the ranks.
  absl::Status CountDaemonShare();

  // A bf16 model's working values := its stored bf16 values, widened (exact), unless they are.
  absl::Status Widen();
  // Stored values := the working fp32 values rounded to nearest even, then widened back.
  absl::Status RoundValues();
  // The replicas' blocks gathered (trainer/data_parallel.h); the working values then stale.
  absl::Status Gather(bool hot_only);
  // The model's forward on this rank's device; cache may be null (no backward).
  absl::StatusOr<double> Forward(parallel::DistributedCache* cache);
  // The mean over the replicas of a loss (each over its share of the global batch).
  absl::StatusOr<double> ReplicaMean(double x);
  // The mean loss over the eval batches (NaN without an eval split).
  absl::StatusOr<double> Evaluate();
  bool Evaluates(int64_t step) const;
  // Whether the current tokens / targets are batch `index` of the dumped ones (true without a
  // dump).
  bool IsDumped(const std::vector<int32_t>& want_tokens, const std::vector<int32_t>& want_targets,
                int64_t index) const;
  DaemonLink Link() const { return DaemonLink{client_.get(), session_.get()}; }

  const TrainOptions& o_;
  const World world_;
  const int local_rank_;
  Progress* const progress_;
  // rank: the global rank (files, daemon sessions and tags); lead: global rank 0 (prints and
  // writes the metrics); tsp_lead: TSP rank 0 (counts the replicated tensors in the norm).
  const int D_, N_, replica_, rank_;
  const bool lead_, tsp_lead_, bf16_;
  int64_t T_ = 0, B_ = 0;

  // Data: the global batch (N replicas x B sequences), the same on every rank; replica i trains
  // on (and evaluates) its sequences [i B, (i + 1) B).
  Corpus corpus_;
  std::optional<Batcher> batcher_;
  bool have_eval_ = false;
  absl::StatusOr<Batcher> eval_batcher_;

  // The device (before everything that lives in its memory or uses its backends) and the
  // data-parallel group on its memory (Gloo on the CPU, NCCL on a GPU).
  std::unique_ptr<RankDevice> dev_;
  parallel::Communicator* dp_dev_ = nullptr;

  // Model and gradients (the same layout, zeroed): host vectors on the CPU; on a GPU, the shard
  // uploaded into device memory and gradients allocated there (the host copy is then dropped).
  parallel::ModelConfig cfg_;
  std::unique_ptr<parallel::DistributedModel> model_;
  parallel::DistributedShard w_, g_;
  std::unique_ptr<BackendShard> dw_, dg_;
  parallel::DistributedShardView wv_;
  parallel::DistributedGradsView gv_;
  std::vector<Tensor> tensors_;
  int64_t params_local_ = 0, params_total_ = 0;
  // A bf16 model: its storage (the engine's parameters) beside the fp32 working copies in w / g
  // (or dw / dg). The values start as the rounding of the fp32 initialisation, widened back into
  // the working copies; `widened_` says whether the working values are the stored ones (every
  // change of the stored values clears it, each forward widens them first if not).
  std::unique_ptr<Bf16Storage> storage_;
  bool widened_ = true;

  // Engine and daemon session (none in no-offload mode); the engine over this replica's row
  // blocks (the whole tensors with one replica).
  std::unique_ptr<Client> client_;
  std::unique_ptr<Session> session_;
  std::unique_ptr<SessionTarget> target_;  // the engine's view of session_
  std::unique_ptr<DataParallelSync> dp_;
  std::vector<EngineParam> eparams_;
  std::unique_ptr<ZenFlowEngine> engine_;

  // What a checkpoint must match (trainer/checkpoint.h, the shape key), and the step this
  // attempt starts after.
  std::vector<int64_t> shape_key_;
  int64_t start_ = 0;

  // Output (rank 0's metrics), the steps, the batch buffers, --dump_init's batches.
  std::string csv_path_;
  std::FILE* csv_ = nullptr;
  int64_t last_step_ = 0, eval_n_ = 0;
  std::vector<int32_t> tokens_, targets_;
  int64_t mine_ = 0;  // where this replica's sequences start in tokens_ / targets_
  DumpedBatches dumped_;

  // The summary's figures, accumulated step by step.
  RunTotals totals_;
};

}  // namespace trainer
}  // namespace stallfree
