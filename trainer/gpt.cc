#include "trainer/gpt.h"

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "trainer/daemon_loss.h"
#include "trainer/run.h"
#include "trainer/world.h"

namespace stallfree {
namespace trainer {
namespace {

// One attempt (trainer/run.h); RunRank makes another after a lost daemon.
absl::Status TrainAttempt(const TrainOptions& o, const World& world, int local_rank,
                          Progress* progress) {
  TrainRun run(o, world, local_rank, progress);
  RETURN_IF_ERROR(run.Setup());
  RETURN_IF_ERROR(run.Restore());
  RETURN_IF_ERROR(run.Open());
  RETURN_IF_ERROR(run.Loop());
  return run.Finish();
}

}  // namespace

absl::StatusOr<parallel::ModelConfig> ModelFromOptions(const TrainOptions& o, int64_t vocab,
                                                       int64_t seq_len, int D) {
  ASSIGN_OR_RETURN(Preset p, FindPreset(o.preset));
  parallel::ModelConfig cfg;
  cfg.vocab = vocab;
  cfg.layers = o.layers > 0 ? o.layers : p.layers;
  cfg.C = o.d_model > 0 ? o.d_model : p.d_model;
  cfg.H = o.heads > 0 ? o.heads : p.heads;
  cfg.FF = o.d_ff > 0 ? o.d_ff : p.d_ff;
  if (o.positions != "learned" && o.positions != "none")
    return absl::InvalidArgumentError(
        absl::StrCat("positions: '", o.positions, "' is not learned or none"));
  cfg.learned_positions = o.positions == "learned";
  cfg.max_seq = seq_len;
  cfg.tied_head = o.tied_head;
  RETURN_IF_ERROR(parallel::ValidateModelConfig(cfg));
  if (cfg.H % D != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("heads: ", cfg.H, " attention heads do not divide over ", D, " ranks"));
  if (cfg.FF % D != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("d_ff: ", cfg.FF, " does not divide over ", D, " ranks"));
  if (seq_len % (2 * D) != 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "seq_len: ", seq_len, " is not a multiple of 2 x ", D, " ranks (TSP's zigzag chunks)"));
  return cfg;
}

absl::Status RunRank(const TrainOptions& options, parallel::Communicator* comm, int local_rank) {
  return RunRank(options, RankGroups{comm, nullptr}, local_rank);
}

absl::Status RunRank(const TrainOptions& options, const RankGroups& groups, int local_rank) {
  if (groups.tsp == nullptr)
    return absl::InvalidArgumentError("RunRank: no TSP group (RankGroups::tsp is null)");
  World world;
  world.tsp = groups.tsp;
  world.dp = groups.dp != nullptr && groups.dp->size() > 1 ? groups.dp : nullptr;
  TrainOptions o = options;
  Progress progress;
  progress.checkpoint = o.resume;
  for (;;) {
    progress.daemon_lost = false;
    absl::Status st = TrainAttempt(o, world, local_rank, &progress);
    if (st.ok() || !progress.daemon_lost) return st;
    // Every rank is here: the loss was agreed on (AgreeOnDaemon).
    const bool lead = world.rank() == 0;
    if (o.reconnect_s <= 0) return DaemonGone(o, progress, st, "");
    if (lead) {
      printf("stallfreed at %s went away (%s); waiting up to %ld s for it (--reconnect_s)\n",
             o.socket.c_str(), std::string(st.message()).c_str(), (long)o.reconnect_s);
      std::fflush(stdout);
    }
    const absl::Status back = WaitForDaemon(o.socket, o.reconnect_s);
    ASSIGN_OR_RETURN(double missing, world.Sum(back.ok() ? 0.0 : 1.0));
    if (missing > 0)
      return DaemonGone(o, progress, st,
                        absl::StrCat(" and did not answer within --reconnect_s ", o.reconnect_s,
                                     " s (", back.ok() ? "on another rank" : back.message(), ")"));
    if (!progress.checkpoint.empty()) {
      o.resume = progress.checkpoint;
      o.init_from.clear();
    }
    if (lead) {
      if (progress.checkpoint.empty())
        printf("stallfreed is back; no checkpoint yet, so the run starts over\n");
      else
        printf(
            "stallfreed is back; continuing from checkpoint '%s' (step %ld): the steps since "
            "are computed again\n",
            progress.checkpoint.c_str(), (long)progress.checkpoint_step);
      std::fflush(stdout);
    }
  }
}

}  // namespace trainer
}  // namespace stallfree
