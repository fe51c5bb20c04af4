#include "trainer/run.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/status.h"
#include "kernels/ops.h"
#include "kernels/optimizer.h"
#include "trainer/checkpoint.h"
#include "trainer/presets.h"
#include "trainer/resume.h"
#include "trainer/stopwatch.h"

namespace stallfree {
namespace trainer {
namespace {

// Warm-up then cosine decay to lr * min_ratio at the last step.
double LearningRate(const TrainOptions& o, int64_t step) {
  if (o.lr_warmup > 0 && step <= o.lr_warmup)
    return o.lr * static_cast<double>(step) / static_cast<double>(o.lr_warmup);
  const double span = std::max<int64_t>(1, o.steps - o.lr_warmup);
  const double progress = std::min(1.0, static_cast<double>(step - o.lr_warmup) / span);
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return o.lr * (o.min_lr_ratio + (1.0 - o.min_lr_ratio) * cosine);
}

// Rewrites metrics.csv without the rows after `step` (a resumed run writes them again).
absl::Status TruncateMetrics(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return absl::OkStatus();
  std::string line, kept;
  bool header = true;
  while (std::getline(in, line)) {
    if (header || std::atoll(line.c_str()) <= step) kept += line + "\n";
    header = false;
  }
  return WriteFileAtomically(path, kept);
}

}  // namespace

TrainRun::TrainRun(const TrainOptions& options, const World& world, int local_rank,
                   Progress* progress)
    : o_(options),
      world_(world),
      local_rank_(local_rank),
      progress_(progress),
      D_(world.D()),
      N_(world.N()),
      replica_(world.replica()),
      rank_(world.rank()),
      lead_(world.rank() == 0),
      tsp_lead_(world.tsp->rank() == 0),
      bf16_(options.model_dtype == DType::kBf16),
      eval_batcher_(absl::NotFoundError("no eval split")) {}

TrainRun::~TrainRun() {
  if (csv_ != nullptr) std::fclose(csv_);
}

// ---- Setup ----

absl::Status TrainRun::Setup() {
  RETURN_IF_ERROR(CheckOptions());
  RETURN_IF_ERROR(LoadData());
  RETURN_IF_ERROR(MakeModel());
  return StartEngine();
}

absl::Status TrainRun::CheckOptions() {
  const TrainOptions& o = o_;
  ASSIGN_OR_RETURN(Preset preset, FindPreset(o.preset));
  T_ = o.seq_len > 0 ? o.seq_len : preset.seq_len;
  B_ = o.batch > 0 ? o.batch : preset.batch;
  if (o.steps < 1) return absl::InvalidArgumentError("steps: must be >= 1");
  if (o.keep_checkpoints < 0)
    return absl::InvalidArgumentError("keep_checkpoints: must be >= 0 (0 keeps every one)");
  if (!o.init_from.empty() && !o.resume.empty())
    return absl::InvalidArgumentError("init_from: cannot be combined with --resume");
  if (!o.dump_init.empty() && D_ * N_ != 1)
    return absl::InvalidArgumentError(
        absl::StrCat("dump_init: writes a single rank's whole model, and this run has ", D_ * N_,
                     " ranks; run it with --nproc 1 --dp 1"));
  if (!o.dump_init.empty() && !o.resume.empty())
    return absl::InvalidArgumentError(
        "dump_init: writes a run's starting point, and a resumed run starts from a checkpoint's "
        "optimizer state; drop --resume (--init_from is fine: its weights are dumped)");
  RETURN_IF_ERROR(o.engine.Validate());
  if (o.model_dtype != DType::kFp32 && o.model_dtype != DType::kBf16)
    return absl::InvalidArgumentError("model_dtype: must be fp32 or bf16");
  if (bf16_ && !o.dump_init.empty())
    return absl::InvalidArgumentError(
        "dump_init: writes an fp32 model's starting point for a re-implementation that follows "
        "it in fp32, and this run has --model_dtype bf16; run it with --model_dtype fp32");
  return absl::OkStatus();
}

absl::Status TrainRun::LoadData() {
  const TrainOptions& o = o_;
  if (o.data.empty()) {
    corpus_ = DefaultCorpus();
    if (o.eval_fraction != kDefaultEvalFraction) {
      std::vector<uint16_t> all = corpus_.train;
      all.insert(all.end(), corpus_.eval.begin(), corpus_.eval.end());
      ASSIGN_OR_RETURN(corpus_,
                       SplitCorpus(std::move(all), corpus_.vocab, corpus_.source, o.eval_fraction));
    }
  } else {
    DataFormat format;
    if (!ParseDataFormat(o.format, &format))
      return absl::InvalidArgumentError(
          absl::StrCat("format: '", o.format, "' is not auto, bytes or uint16"));
    ASSIGN_OR_RETURN(corpus_, LoadCorpus(o.data, format, o.eval_fraction));
  }
  ASSIGN_OR_RETURN(cfg_, ModelFromOptions(o, corpus_.vocab, T_, D_));
  ASSIGN_OR_RETURN(Batcher batcher, Batcher::Create(&corpus_.train, N_ * B_, T_, o.seed));
  batcher_.emplace(std::move(batcher));
  have_eval_ = !corpus_.eval.empty() && static_cast<int64_t>(corpus_.eval.size()) > T_;
  if (have_eval_)
    eval_batcher_ = Batcher::Create(&corpus_.eval, N_ * B_, T_, o.seed, BatchOrder::kSequential);
  return absl::OkStatus();
}

absl::Status TrainRun::MakeModel() {
  ASSIGN_OR_RETURN(dev_, OpenRankDevice(o_.device, local_rank_, world_.tsp));
  const kernels::TransformerOps& ops = dev_->ops();
  if (N_ > 1) {
    ASSIGN_OR_RETURN(dp_dev_, dev_->OpenGroup(world_.dp));
  }
  model_ = std::make_unique<parallel::DistributedModel>(cfg_, parallel::Layout::kTsp,
                                                        dev_->model_comm());
  RETURN_IF_ERROR(model_->Validate());
  ASSIGN_OR_RETURN(w_, model_->Shard(parallel::InitModelWeights(cfg_, o_.seed)));
  if (dev_->host()) {
    g_ = w_;
  } else {
    dw_ = std::make_unique<BackendShard>(ops, w_, /*upload=*/true);
    dg_ = std::make_unique<BackendShard>(ops, w_, /*upload=*/false);
    RETURN_IF_ERROR(dev_->Synchronize());
    wv_ = dw_->View();
    gv_ = dg_->Grads();
    w_ = parallel::DistributedShard();
  }
  tensors_ = dev_->host() ? ShardTensors(cfg_, D_, HostPointers(&w_), HostPointers(&g_))
                          : ShardTensors(cfg_, D_, dw_->pointers(), dg_->pointers());
  for (const Tensor& t : tensors_) {
    params_local_ += t.numel;
    params_total_ += t.replicated ? t.numel : t.numel * D_;
  }
  if (bf16_) {
    storage_ = std::make_unique<Bf16Storage>(ops, &tensors_);
    if (!storage_->ok() && params_local_ > 0)
      return absl::ResourceExhaustedError(
          absl::StrCat("model_dtype bf16: cannot allocate the bf16 weights and gradients (",
                       4 * params_local_, " bytes) on ", dev_->name()));
    RETURN_IF_ERROR(RoundValues());
  }
  return absl::OkStatus();
}

absl::Status TrainRun::StartEngine() {
  const TrainOptions& o = o_;
  if (o.engine.mode != OffloadMode::kNoOffload) {
    if (o.socket.empty())
      return absl::InvalidArgumentError(absl::StrCat(
          "socket: mode ", OffloadModeName(o.engine.mode),
          " needs stallfreed; start one (stallfreed --socket PATH) and pass --socket PATH"));
    ASSIGN_OR_RETURN(client_, Client::Connect(o.socket, 3000, o.rpc_timeout_s));
    // One session per rank, named with the global rank.
    ASSIGN_OR_RETURN(session_,
                     client_->OpenSession(
                         absl::StrCat("gpt-", o.preset, "-", o.run_name, ".rank", rank_), rank_));
    // A daemon that goes away is waited for up to --reconnect_s and the session re-attached to
    // its successor, where the run goes on at the step it was (SessionTarget); only a state
    // that cannot be taken back falls to RunRank's restart from the last checkpoint.
    target_ = std::make_unique<SessionTarget>(session_.get(), static_cast<double>(o.reconnect_s));
  }
  dp_ = std::make_unique<DataParallelSync>(*dev_, dp_dev_, tensors_, N_, replica_, bf16_);
  std::set<std::string> replicated_params;  // held whole by every replica
  for (size_t i = 0; i < tensors_.size(); ++i) {
    eparams_.push_back(dp_->partition().View(tensors_[i], i, replica_, N_));
    if (dp_->partition().parts[i].replicated) replicated_params.insert(tensors_[i].name);
  }
  ZenFlowConfig engine_cfg = o.engine;
  if (o.device_budget > 0) {
    // The shard's weights whole (every data-parallel replica sizes the same share; the TSP
    // ranks' shards have the same shapes), with the copy stream a device backend has.
    std::vector<ParamShape> shapes;
    for (const Tensor& t : tensors_) {
      shapes.push_back({t.shape, bf16_ ? DType::kBf16 : DType::kFp32});
    }
    ASSIGN_OR_RETURN(engine_cfg.topk_ratio,
                     TopkForBudget(shapes, engine_cfg,
                                   TransfersAreDirect(engine_cfg.transfers, !dev_->host()),
                                   o.device_budget));
    if (rank_ == 0)
      printf("device_budget %g bytes a parameter: topk_ratio %g\n", o.device_budget,
             engine_cfg.topk_ratio);
  }
  ASSIGN_OR_RETURN(engine_, ZenFlowEngine::Create(engine_cfg, eparams_, dev_->kernel(),
                                                  dev_->ops(), target_.get()));
  if (N_ > 1 || D_ > 1) {
    // With --dp N > 1 a partitioned weight's block scores sum to the whole weight's: every
    // replica selects the same hot columns. Replicated ones have the same (averaged) gradient on
    // every replica. The automatic round's figures (param "": engine/schedule.h) are summed over
    // the whole world, so that every rank chooses the same length: the TSP ranks each update
    // their copy of the replicated weights (the embedding), which must stay equal.
    parallel::Communicator* dp_dev = N_ > 1 ? dp_dev_ : nullptr;
    const kernels::BackendMemory* ops = &dev_->ops();
    const World world = world_;
    engine_->set_score_reduce([dp_dev, ops, world, replicated_params](
                                  const std::string& name, float* v, int64_t n) -> absl::Status {
      if (name.empty()) {
        std::vector<float> host(n);
        ops->Download(host.data(), v, n);
        std::string err = ops->Synchronize();
        if (!err.empty()) return absl::InternalError("the automatic round's figures: " + err);
        for (float& x : host) {
          ASSIGN_OR_RETURN(double sum, world.Sum(x));
          x = static_cast<float>(sum);
        }
        ops->Upload(v, host.data(), n);
        err = ops->Synchronize();
        if (!err.empty()) return absl::InternalError("the automatic round's figures: " + err);
        return absl::OkStatus();
      }
      if (dp_dev == nullptr || replicated_params.count(name) > 0) return absl::OkStatus();
      return dp_dev->AllReduce(v, n);
    });
  }
  RETURN_IF_ERROR(dp_->Init());
  // What a checkpoint must match (trainer/checkpoint.h): with --dp N > 1 also N and the replica.
  shape_key_ = {world_.tsp->rank(),
                D_,
                cfg_.layers,
                cfg_.C,
                cfg_.H,
                cfg_.FF,
                cfg_.vocab,
                T_,
                B_,
                static_cast<int64_t>(o.engine.mode),
                cfg_.tied_head,
                cfg_.learned_positions};
  if (N_ > 1) shape_key_.insert(shape_key_.end(), {N_, replica_});
  return absl::OkStatus();
}

// ---- Restore ----

absl::Status TrainRun::Restore() {
  if (!o_.resume.empty()) RETURN_IF_ERROR(Resume());
  if (!o_.init_from.empty()) RETURN_IF_ERROR(InitFrom());
  return absl::OkStatus();
}

absl::Status TrainRun::Resume() {
  const TrainOptions& o = o_;
  // Every rank reads its sources (ReadResume), then all agree, so that one rank's error ends
  // every rank (a lost daemon as everywhere else: AgreeOnDaemon).
  absl::StatusOr<ResumeState> read =
      ReadResume(o, shape_key_, N_, replica_, rank_, tensors_, session_.get());
  const absl::Status agreed = AgreeOnDaemon(world_, Link(), progress_, read.status());
  if (progress_->daemon_lost) return agreed;
  ASSIGN_OR_RETURN(double failed, world_.Sum(read.ok() ? 0.0 : 1.0));
  if (!read.ok()) return read.status();
  if (failed > 0)
    return absl::FailedPreconditionError(absl::StrCat(
        "resume: another rank could not resume from '", o.resume, "' (its error says why)"));
  ResumeState rs = *std::move(read);
  RankState& st = rs.st;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (st.numel(i) != tensors_[i].numel)
      return absl::DataLossError(absl::StrCat("resume: tensor '", tensors_[i].name,
                                              "' has the wrong size in the checkpoint"));
    UploadStored(dev_->ops(), tensors_[i], st.tensors[i]);  // the stored values, as they were
  }
  RETURN_IF_ERROR(dev_->Synchronize());
  widened_ = !bf16_;
  RETURN_IF_ERROR(Widen());
  st.tensors.clear();
  // Re-partitioned, the daemon's part moves straight into the session (no file).
  absl::Status restored = rs.repartitioned ? engine_->RestoreBytes(st.engine, rs.daemon)
                                           : engine_->Restore(rs.daemon_tag, st.engine);
  rs.daemon.clear();
  if (!restored.ok() && !rs.missing.empty())
    restored = WithContext(restored, absl::StrCat("the daemon holds no checkpoint ",
                                                  rs.missing.front(), " of the writing run"));
  RETURN_IF_ERROR(AgreeOnDaemon(world_, Link(), progress_, restored));
  batcher_->Seek(st.data_position);
  start_ = st.step;
  if (lead_) {
    if (rs.written_dp == N_)
      printf("resumed from checkpoint '%s' at step %ld\n", o.resume.c_str(), (long)start_);
    else
      printf(
          "resumed from checkpoint '%s' at step %ld (written with --dp %ld, re-partitioned "
          "for --dp %d)\n",
          o.resume.c_str(), (long)start_, (long)rs.written_dp, N_);
  }
  return absl::OkStatus();
}

absl::Status TrainRun::InitFrom() {
  // Another run's weights, a fresh optimizer: fine-tuning from a checkpoint in any mode.
  const TrainOptions& o = o_;
  const std::string file = absl::StrCat(o.init_from, ".rank", rank_, ".trainer");
  ASSIGN_OR_RETURN(RankState st, DecodeState(file));
  std::vector<int64_t> want = shape_key_, got = st.shape;
  if (got.size() == want.size()) got[kKeyMode] = want[kKeyMode];  // the mode may differ
  if (WrittenDp(st) != N_)
    return absl::FailedPreconditionError(
        absl::StrCat("init_from: ", file, " was written by a run with --dp ", WrittenDp(st),
                     ", and this run has --dp ", N_, "; use the same --dp"));
  if (got != want || st.tensors.size() != tensors_.size())
    return absl::FailedPreconditionError(
        absl::StrCat("init_from: ", file, " holds another model, batch or rank count"));
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (st.numel(i) != tensors_[i].numel)
      return absl::DataLossError(
          absl::StrCat("init_from: tensor '", tensors_[i].name, "' has the wrong size in ", file));
    // Into the working fp32 values (a bf16 file's widened, exact); a bf16 model rounds them
    // below (a bf16 file's: back to the same bits).
    const std::vector<float> values = FileValuesAsFloat(st, i);
    dev_->ops().Upload(tensors_[i].value, values.data(), tensors_[i].numel);
  }
  RETURN_IF_ERROR(dev_->Synchronize());
  RETURN_IF_ERROR(RoundValues());
  if (lead_)
    printf(
        "initialised from %s (step %ld of that run); its %s weights%s; optimizer state and "
        "data order new\n",
        o.init_from.c_str(), (long)st.step, DTypeName(st.dtype),
        st.dtype == o.model_dtype ? ""
        : bf16_                   ? ", rounded to bf16"
                                  : ", widened to fp32");
  return absl::OkStatus();
}

// ---- Open ----

absl::Status TrainRun::Open() {
  RETURN_IF_ERROR(OpenMetrics());
  last_step_ = o_.stop_at > 0 ? std::min(o_.stop_at, o_.steps) : o_.steps;
  eval_n_ = have_eval_
                ? std::max<int64_t>(
                      1, std::min(o_.eval_batches, std::max(eval_batcher_->full_batches_per_epoch(),
                                                            static_cast<int64_t>(1))))
                : 0;
  tokens_.assign(N_ * B_ * T_, 0);
  targets_.assign(N_ * B_ * T_, 0);
  mine_ = static_cast<int64_t>(replica_) * B_ * T_;
  if (!o_.dump_init.empty()) RETURN_IF_ERROR(DumpInit());
  totals_.csv_path = csv_path_;
  return absl::OkStatus();
}

absl::Status TrainRun::OpenMetrics() {
  const TrainOptions& o = o_;
  csv_path_ = o.out_dir + "/metrics.csv";
  RETURN_IF_ERROR(MakeDirs(o.out_dir + "/checkpoints"));
  if (!lead_) return absl::OkStatus();
  const bool append = start_ > 0;
  if (append) RETURN_IF_ERROR(TruncateMetrics(csv_path_, start_));
  csv_ = std::fopen(csv_path_.c_str(), append ? "a" : "w");
  if (csv_ == nullptr) return FileError("fopen", csv_path_, errno);
  if (!append)
    std::fprintf(csv_,
                 "step,loss,eval_loss,lr,tokens_per_s,step_s,compute_s,optimizer_s,copies_s,"
                 "stall_s,bytes_to_host,bytes_to_device,grad_norm\n");
  const std::string batch =
      N_ == 1 ? absl::StrCat(B_) : absl::StrCat(B_, " per replica (global ", N_ * B_, ")");
  const std::string ranks =
      N_ == 1 ? absl::StrCat(D_, " ranks")
              : absl::StrCat(D_, " TSP ranks, x ", N_, " data-parallel replicas (", N_ * D_,
                             " ranks; each rank's optimizer state 1/", N_, " of its shard's)");
  printf(
      "training %s: preset %s, %ld layers, d_model %ld, %ld heads, d_ff %ld, seq %ld, "
      "batch %s, vocab %ld: %.2fM parameters (%.2fM on each of %s); %s weights and "
      "gradients; mode %s; device %s; data %s (%zu train / %zu eval tokens)\n",
      o.run_name.c_str(), o.preset.c_str(), (long)cfg_.layers, (long)cfg_.C, (long)cfg_.H,
      (long)cfg_.FF, (long)T_, batch.c_str(), (long)cfg_.vocab, params_total_ / 1e6,
      params_local_ / 1e6, ranks.c_str(), DTypeName(o.model_dtype),
      OffloadModeName(o.engine.mode), dev_->name().c_str(), corpus_.source.c_str(),
      corpus_.train.size(), corpus_.eval.size());
  std::fflush(stdout);
  return absl::OkStatus();
}

// --dump_init: the batches of steps 1..steps and of an evaluation, drawn by the batchers
// themselves (then rewound), the weights, the configuration. The loop checks that it trains and
// evaluates on exactly these batches.
absl::Status TrainRun::DumpInit() {
  const int64_t position = batcher_->position();
  for (int64_t step = 1; step <= o_.steps; ++step) {
    batcher_->Next(tokens_.data(), targets_.data());
    dumped_.tokens.insert(dumped_.tokens.end(), tokens_.begin(), tokens_.end());
    dumped_.targets.insert(dumped_.targets.end(), targets_.begin(), targets_.end());
  }
  batcher_->Seek(position);
  if (have_eval_) eval_batcher_->Seek(0);
  for (int64_t i = 0; i < eval_n_; ++i) {
    eval_batcher_->Next(tokens_.data(), targets_.data());
    dumped_.eval_tokens.insert(dumped_.eval_tokens.end(), tokens_.begin(), tokens_.end());
    dumped_.eval_targets.insert(dumped_.eval_targets.end(), targets_.begin(), targets_.end());
  }
  std::vector<double> lrs;
  std::vector<int64_t> eval_steps;
  for (int64_t step = 1; step <= o_.steps; ++step) {
    lrs.push_back(LearningRate(o_, step));
    if (step <= last_step_ && Evaluates(step) && have_eval_) eval_steps.push_back(step);
  }
  RETURN_IF_ERROR(
      WriteInitDump(o_, cfg_, B_, T_, corpus_, tensors_, *dev_, dumped_, lrs, eval_steps));
  if (lead_) {
    printf("wrote the initial weights, configuration and batches to %s\n", o_.dump_init.c_str());
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

// ---- Loop ----

absl::Status TrainRun::Loop() {
  totals_.first_loss = std::nan("");
  totals_.last_eval = std::nan("");
  for (int64_t step = start_ + 1; step <= last_step_; ++step) RETURN_IF_ERROR(Step(step));
  return absl::OkStatus();
}

absl::Status TrainRun::Step(int64_t step) {
  const auto t0 = Clock::now();
  batcher_->Next(tokens_.data(), targets_.data());
  if (!IsDumped(dumped_.tokens, dumped_.targets, step - 1))
    return absl::InternalError(absl::StrCat(
        "dump_init: step ", step, "'s batch differs from the dumped one (a trainer bug)"));
  for (const Tensor& t : tensors_) dev_->ops().Fill(t.grad, t.numel, 0.0f);
  parallel::DistributedCache cache;
  ASSIGN_OR_RETURN(double local_loss, Forward(&cache));
  if (dev_->host()) {
    RETURN_IF_ERROR(model_->Backward(dev_->ops(), w_, cache, &g_));
  } else {
    RETURN_IF_ERROR(model_->Backward(dev_->ops(), wv_, cache, gv_));
    RETURN_IF_ERROR(dev_->Synchronize());  // the compute time covers the queued work
  }
  const double compute = SecondsSince(t0);
  ASSIGN_OR_RETURN(double loss, ReplicaMean(local_loss));
  RETURN_IF_ERROR(dp_->AverageGrads());
  ASSIGN_OR_RETURN(double norm, ClipGradients());
  if (bf16_) {
    // The gradient the engine reads: the averaged, clipped fp32 gradient rounded once to
    // nearest even.
    for (const Tensor& t : tensors_) dev_->kernel().FloatToBf16(t.grad, t.grad16, t.numel);
  }
  const double lr = LearningRate(o_, step);
  RETURN_IF_ERROR(AgreeOnDaemon(world_, Link(), progress_, engine_->Step(lr)));
  widened_ = !bf16_;  // the step wrote new stored values
  RETURN_IF_ERROR(Gather(/*hot_only=*/!engine_->last_timings().cold_changed));
  const StepTimings& tm = engine_->last_timings();
  const double step_s = SecondsSince(t0);
  if (step == start_ + 1) totals_.first_loss = loss;  // this process's first step (a resume's too)
  totals_.losses.push_back(loss);
  double eval = std::nan("");
  if (Evaluates(step)) {
    ASSIGN_OR_RETURN(eval, Evaluate());
    totals_.last_eval = eval;
  }
  RecordStep(step, step_s, compute, tm);
  if (lead_) WriteMetrics(step, loss, eval, lr, step_s, compute, tm, norm);
  if ((o_.checkpoint_every > 0 && step % o_.checkpoint_every == 0) || step == last_step_)
    RETURN_IF_ERROR(Checkpoint(step));
  return absl::OkStatus();
}

// Clip by the global norm: sharded tensors count on their owner, replicated ones once (the
// gradients, averaged, are the same on every replica: the norm is the TSP group's).
absl::StatusOr<double> TrainRun::ClipGradients() {
  double sq = 0;
  if (dev_->host()) {
    for (const Tensor& t : tensors_) {
      if (t.replicated && !tsp_lead_) continue;
      for (int64_t i = 0; i < t.numel; ++i) sq += static_cast<double>(t.grad[i]) * t.grad[i];
    }
  } else {
    ASSIGN_OR_RETURN(sq, BackendSquaredNorm(*dev_, tensors_, tsp_lead_));
  }
  ASSIGN_OR_RETURN(double total_sq, AllReduceSum(world_.tsp, sq));
  const double norm = std::sqrt(total_sq);
  if (o_.clip > 0 && norm > o_.clip) {
    const float scale = static_cast<float>(o_.clip / norm);
    if (dev_->host()) {
      for (const Tensor& t : tensors_)
        for (int64_t i = 0; i < t.numel; ++i) t.grad[i] *= scale;
    } else {
      // g = scale * g in place (an element-wise overwrite: each element is read, then written,
      // by the same thread), in stream order before the engine reads the gradients.
      for (const Tensor& t : tensors_)
        dev_->kernel().Accumulate(t.grad, t.grad, kernels::GradType::kFp32, scale, t.numel,
                                  kernels::AccumulateMode::kOverwrite);
    }
  }
  return norm;
}

void TrainRun::RecordStep(int64_t step, double step_s, double compute, const StepTimings& tm) {
  if (step > start_ + 1 || o_.steps - start_ == 1) {  // the first step pays allocation and setup
    totals_.step += step_s;
    totals_.compute += compute;
    totals_.optimizer += tm.optimizer;
    totals_.copies += tm.copies;
    totals_.stall += tm.stall;
    ++totals_.timed;
  }
  totals_.traffic += static_cast<double>(tm.bytes_to_host + tm.bytes_to_device);
  totals_.migrated += static_cast<double>(tm.migrated_columns);
  totals_.reselections += tm.reselected ? 1 : 0;
}

void TrainRun::WriteMetrics(int64_t step, double loss, double eval, double lr, double step_s,
                            double compute, const StepTimings& tm, double norm) {
  const double tps = static_cast<double>(N_ * B_ * T_) / step_s;
  std::fprintf(csv_, "%ld,%.9g,%.9g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%lu,%lu,%.6g\n", (long)step,
               loss, eval, lr, tps, step_s, compute, tm.optimizer, tm.copies, tm.stall,
               (unsigned long)tm.bytes_to_host, (unsigned long)tm.bytes_to_device, norm);
  std::fflush(csv_);
  if (!o_.quiet) {
    printf(
        "step %4ld/%ld  loss %.4f  lr %.2e  |g| %.3f  %6.0f tok/s  step %.3f s "
        "(compute %.3f, optimizer %.3f, copies %.3f, stall %.3f)\n",
        (long)step, (long)o_.steps, loss, lr, norm, tps, step_s, compute, tm.optimizer, tm.copies,
        tm.stall);
  }
  if (!std::isnan(eval)) printf("eval step %ld  loss %.4f\n", (long)step, eval);
  std::fflush(stdout);
}

absl::Status TrainRun::Checkpoint(int64_t step) {
  const std::string tag = absl::StrCat(o_.run_name, "-step", step);
  RankState st;
  st.step = step;
  st.data_position = batcher_->position();
  st.shape = shape_key_;
  st.dtype = o_.model_dtype;
  st.tensors.resize(tensors_.size());
  for (size_t i = 0; i < tensors_.size(); ++i)
    DownloadStored(dev_->ops(), tensors_[i], &st.tensors[i]);
  RETURN_IF_ERROR(dev_->Synchronize());
  for (size_t i = 0; i < tensors_.size(); ++i)  // drop a bf16 tensor's padding to whole floats
    st.tensors[i].resize(tensors_[i].numel * tensors_[i].elem_size());
  absl::StatusOr<std::string> engine_state = engine_->Checkpoint(absl::StrCat(tag, ".r", rank_));
  RETURN_IF_ERROR(AgreeOnDaemon(world_, Link(), progress_, engine_state.status()));
  st.engine = std::move(*engine_state);
  RETURN_IF_ERROR(WriteRankFile(o_.out_dir, tag, rank_, st));
  RETURN_IF_ERROR(world_.Barrier());  // every rank holds the new one before any old one goes
  progress_->checkpoint = tag;
  progress_->checkpoint_step = step;
  PruneCheckpoints(o_.out_dir, o_.run_name, o_.keep_checkpoints, rank_, engine_.get());
  if (lead_) {
    printf("checkpoint '%s' written (step %ld; resume with --resume %s)\n", tag.c_str(), (long)step,
           tag.c_str());
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

// ---- Finish ----

absl::Status TrainRun::Finish() {
  RETURN_IF_ERROR(AgreeOnDaemon(world_, Link(), progress_, engine_->Flush()));
  widened_ = !bf16_;
  // The engine's accounting of the buffers it was given (DeviceFootprint::params: value and
  // gradient, numel x dtype bytes each) and of its own, over the elements it updates.
  totals_.footprint = engine_->Footprint();
  for (const EngineParam& p : eparams_) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    totals_.engine_elements += n;
  }
  RETURN_IF_ERROR(Gather(false));  // the flushed cold columns of every replica's blocks
  // Traffic over every rank (each moves its own shards): one all-reduce for the whole run.
  ASSIGN_OR_RETURN(totals_.traffic, world_.Sum(totals_.traffic));
  // Columns migrated between the device and the daemon (every rank's engine, each of its own
  // blocks), and this rank's reselections (the same on every rank).
  ASSIGN_OR_RETURN(totals_.migrated, world_.Sum(totals_.migrated));
  RETURN_IF_ERROR(CountDaemonShare());
  if (lead_) {
    std::fclose(csv_);
    csv_ = nullptr;
    RunTotals& t = totals_;
    t.run_name = o_.run_name;
    t.preset = o_.preset;
    t.out_dir = o_.out_dir;
    t.mode = o_.engine.mode;
    t.model_dtype = o_.model_dtype;
    t.D = D_;
    t.N = N_;
    t.B = B_;
    t.T = T_;
    t.steps = o_.steps;
    t.start = start_;
    t.last_step = last_step_;
    t.params_total = params_total_;
    t.dp_collectives = dp_->seconds();
    t.daemon = client_ != nullptr;
    RETURN_IF_ERROR(WriteSummary(t));
  }
  return world_.Barrier();
}

// The daemon's share of the run: this run's sessions' registered elements and pinned bytes
// (summed over the ranks), and the daemon's GetStats (every session it holds now) read by rank 0
// while every rank's session is still open (between the sum and the final barrier).
absl::Status TrainRun::CountDaemonShare() {
  double run_elements = 0, run_pinned = 0;
  if (client_ != nullptr && session_ != nullptr) {
    absl::StatusOr<std::vector<v1::SessionInfo>> sessions = client_->ListSessions();
    if (sessions.ok()) {
      for (const v1::SessionInfo& si : *sessions) {
        if (si.session_id() != session_->ref().session_id()) continue;
        run_elements = static_cast<double>(si.param_elements());
        run_pinned = static_cast<double>(si.pinned_bytes());
      }
    }
  }
  ASSIGN_OR_RETURN(totals_.run_elements, world_.Sum(run_elements));
  ASSIGN_OR_RETURN(totals_.run_pinned, world_.Sum(run_pinned));
  if (lead_ && client_ != nullptr) {
    absl::StatusOr<v1::Stats> stats = client_->GetStats();
    if (stats.ok()) totals_.daemon_stats = *stats;
  }
  return absl::OkStatus();
}

// ---- Helpers ----

absl::Status TrainRun::Widen() {
  if (!bf16_ || widened_) return absl::OkStatus();
  for (const Tensor& t : tensors_) dev_->kernel().Bf16ToFloat(t.value16, t.value, t.numel);
  RETURN_IF_ERROR(dev_->Synchronize());
  widened_ = true;
  return absl::OkStatus();
}

absl::Status TrainRun::RoundValues() {
  if (!bf16_) return absl::OkStatus();
  for (const Tensor& t : tensors_) dev_->kernel().FloatToBf16(t.value, t.value16, t.numel);
  widened_ = false;
  return Widen();
}

absl::Status TrainRun::Gather(bool hot_only) {
  RETURN_IF_ERROR(dp_->GatherBlocks(hot_only, engine_.get()));
  widened_ = !bf16_;  // other replicas' blocks (and this one's update) are new
  return absl::OkStatus();
}

absl::StatusOr<double> TrainRun::Forward(parallel::DistributedCache* cache) {
  RETURN_IF_ERROR(Widen());  // a bf16 model's working values are its stored ones
  const int32_t* x = tokens_.data() + mine_;
  const int32_t* y = targets_.data() + mine_;
  if (dev_->host()) return model_->Forward(dev_->ops(), w_, x, y, B_, T_, cache);
  return model_->Forward(dev_->ops(), wv_, x, y, B_, T_, cache);
}

absl::StatusOr<double> TrainRun::ReplicaMean(double x) {
  if (N_ == 1) return x;
  ASSIGN_OR_RETURN(double sum, AllReduceSum(world_.dp, x));
  return sum / N_;
}

absl::StatusOr<double> TrainRun::Evaluate() {
  if (!have_eval_) return std::nan("");
  Batcher& eb = *eval_batcher_;
  eb.Seek(0);
  double sum = 0;
  for (int64_t i = 0; i < eval_n_; ++i) {
    eb.Next(tokens_.data(), targets_.data());
    if (!IsDumped(dumped_.eval_tokens, dumped_.eval_targets, i))
      return absl::InternalError(absl::StrCat("dump_init: evaluation batch ", i,
                                              " differs from the dumped one (a trainer bug)"));
    ASSIGN_OR_RETURN(double local, Forward(nullptr));
    ASSIGN_OR_RETURN(double loss, ReplicaMean(local));
    sum += loss;
  }
  return sum / static_cast<double>(eval_n_);
}

bool TrainRun::Evaluates(int64_t step) const {
  return (o_.eval_every > 0 && step % o_.eval_every == 0) || step == last_step_;
}

bool TrainRun::IsDumped(const std::vector<int32_t>& want_tokens,
                        const std::vector<int32_t>& want_targets, int64_t index) const {
  if (o_.dump_init.empty()) return true;
  const int64_t at = index * B_ * T_;
  return std::equal(tokens_.begin(), tokens_.end(), want_tokens.begin() + at) &&
         std::equal(targets_.begin(), targets_.end(), want_targets.begin() + at);
}

}  // namespace trainer
}  // namespace stallfree
