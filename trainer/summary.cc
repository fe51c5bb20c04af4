#include "trainer/summary.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/status.h"
#include "trainer/checkpoint.h"
#include "trainer/plot.h"

namespace stallfree {
namespace trainer {
namespace {

// The summary's derived figures.
struct Figures {
  int64_t n = 0;     // steps run by this process
  int64_t tail = 0;  // the steps of the final train loss
  double final_loss = 0;
  double steps_done = 1;  // the timed steps (at least 1)
  double model_bf16 = 0;  // the model's bytes in bf16
  // Bytes per parameter of this rank: the model's weights and gradients as stored (the engine's
  // parameters), a bf16 model's fp32 working copies, the engine's own device state.
  double stored_bytes = 0, working_bytes = 0, engine_bytes = 0;
};

Figures Derive(const RunTotals& t) {
  Figures f;
  f.n = static_cast<int64_t>(t.losses.size());
  f.final_loss = FinalTrainLoss(t.losses, &f.tail);
  f.steps_done = std::max<int64_t>(t.timed, 1);
  f.model_bf16 = 2.0 * static_cast<double>(t.params_total);
  const double elements = static_cast<double>(std::max<int64_t>(t.engine_elements, 1));
  f.stored_bytes = static_cast<double>(t.footprint.params) / elements;
  f.working_bytes = t.model_dtype == DType::kBf16 ? 8.0 : 0.0;  // fp32 value and gradient
  f.engine_bytes = static_cast<double>(t.footprint.engine()) / elements;
  return f;
}

std::string SummaryJson(const RunTotals& t, const Figures& f) {
  const int64_t N = t.N, B = t.B, T = t.T;
  return absl::StrFormat(
      "{\"mode\": \"%s\", \"D\": %d, \"dp\": %d, \"batch\": %ld, \"global_batch\": %ld, "
      "\"preset\": \"%s\", \"params\": %ld, \"steps\": %ld, "
      "\"first_step\": %ld, \"last_step\": %ld, \"first_loss\": %.6f, "
      "\"final_train_loss\": %.6f, \"final_eval_loss\": %.6f, "
      "\"tokens_per_s\": %.3f, \"step_s\": %.6f, \"compute_s\": %.6f, \"optimizer_s\": %.6f, "
      "\"copies_s\": %.6f, \"stall_s\": %.6f, \"stall_share\": %.6f, "
      "\"host_traffic_per_step_over_bf16_model\": %.6f, \"dp_collectives_s\": %.6f, "
      "\"reselections\": %ld, \"migrated_columns\": %.0f, "
      "\"run_param_elements\": %.0f, \"run_pinned_bytes\": %.0f, "
      "\"daemon_sessions\": %ld, \"daemon_param_elements\": %ld, "
      "\"daemon_pinned_bytes\": %lu, \"model_dtype\": \"%s\", "
      "\"model_bytes_per_param\": %.4f, \"working_bytes_per_param\": %.4f, "
      "\"engine_device_bytes_per_param\": %.4f}\n",
      OffloadModeName(t.mode), t.D, t.N, (long)B, (long)(N * B), t.preset, (long)t.params_total,
      (long)t.steps, (long)(t.start + 1), (long)t.last_step, t.first_loss, f.final_loss,
      t.last_eval, static_cast<double>(N * B * T) * f.steps_done / t.step, t.step / f.steps_done,
      t.compute / f.steps_done, t.optimizer / f.steps_done, t.copies / f.steps_done,
      t.stall / f.steps_done, t.stall / std::max(t.step, 1e-12),
      t.traffic / std::max<double>(f.n, 1) / f.model_bf16,
      t.dp_collectives / std::max<double>(f.n, 1), (long)t.reselections, t.migrated, t.run_elements,
      t.run_pinned, (long)t.daemon_stats.sessions(), (long)t.daemon_stats.param_elements(),
      (unsigned long)t.daemon_stats.pinned_bytes(), DTypeName(t.model_dtype), f.stored_bytes,
      f.working_bytes, f.engine_bytes);
}

void PrintSummary(const RunTotals& t, const Figures& f, const std::string& plot,
                  const absl::Status& plotted) {
  const int64_t N = t.N, B = t.B, T = t.T;
  const bool bf16 = t.model_dtype == DType::kBf16;
  const std::string ran =
      t.start == 0 && t.last_step == t.steps
          ? absl::StrCat(t.steps, " steps")
          : absl::StrCat("steps ", t.start + 1, "-", t.last_step, " of ", t.steps,
                         t.start > 0 ? absl::StrCat(" (resumed after step ", t.start, ")") : "",
                         t.last_step < t.steps ? " (stopped early: --stop_at)" : "");
  printf("\n== summary: %s, %s, D = %d%s, %.2fM parameters, %s\n", t.run_name.c_str(),
         OffloadModeName(t.mode), t.D, N == 1 ? "" : absl::StrCat(" x dp ", N).c_str(),
         t.params_total / 1e6, ran.c_str());
  printf("  train loss   %.4f -> %.4f (step %ld -> the mean of the last %ld steps)\n", t.first_loss,
         f.final_loss, (long)(t.start + 1), (long)f.tail);
  printf("  eval loss    %.4f\n", t.last_eval);
  printf("  throughput   %.0f tokens/s\n", static_cast<double>(N * B * T) * f.steps_done / t.step);
  printf(
      "  step time    %.3f s: compute %.3f, optimizer %.3f, copies %.3f, stall %.3f "
      "(stall share %.1f%%)\n",
      t.step / f.steps_done, t.compute / f.steps_done, t.optimizer / f.steps_done,
      t.copies / f.steps_done, t.stall / f.steps_done, 100.0 * t.stall / std::max(t.step, 1e-12));
  printf(
      "  model        %s weights and gradients: %.2f bytes per parameter%s; the engine's "
      "device-side state %.2f bytes per parameter (rank 0)\n",
      DTypeName(t.model_dtype), f.stored_bytes,
      bf16 ? absl::StrFormat(" (and %.2f of fp32 working copies for the fp32 compute)",
                             f.working_bytes)
                 .c_str()
           : "",
      f.engine_bytes);
  printf("  host traffic %.3f x the model's bf16 size per step\n",
         t.traffic / std::max<double>(f.n, 1) / f.model_bf16);
  if (N > 1)
    printf(
        "  data parallel %.3f s per step in the gradient all-reduce and the parameter "
        "all-gather\n",
        t.dp_collectives / std::max<double>(f.n, 1));
  if (t.daemon)
    printf(
        "  daemon       this run's %ld sessions: %.0f registered elements, %.1f MB pinned "
        "(the daemon: %ld sessions, %ld elements, %.1f MB pinned)\n",
        (long)(N * t.D), t.run_elements, t.run_pinned / 1e6, (long)t.daemon_stats.sessions(),
        (long)t.daemon_stats.param_elements(), t.daemon_stats.pinned_bytes() / 1e6);
  printf("  metrics      %s, %s/summary.json\n", t.csv_path.c_str(), t.out_dir.c_str());
  if (plotted.ok())
    printf("  plot         %s\n", plot.c_str());
  else
    printf("  plot         not drawn: %s\n", std::string(plotted.message()).c_str());
  std::fflush(stdout);
}

}  // namespace

absl::Status WriteSummary(const RunTotals& t) {
  const Figures f = Derive(t);
  const std::string plot = t.out_dir + "/train.png";
  absl::Status plotted = WritePlot(plot, {{OffloadModeName(t.mode), t.csv_path}},
                                   absl::StrCat(t.run_name, ": ", t.preset, ", D=", t.D));
  RETURN_IF_ERROR(WriteFileAtomically(t.out_dir + "/summary.json", SummaryJson(t, f)));
  PrintSummary(t, f, plot, plotted);
  return absl::OkStatus();
}

}  // namespace trainer
}  // namespace stallfree
