#include "engine/repartition.h"

#include <algorithm>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/blob.h"
#include "engine/partition.h"
#include "common/status.h"
#include "server/checkpoint.h"

namespace stallfree {
namespace {


using EngineParam = EngineBlobParam;
using EngineState = EngineBlob;

// The blob of old rank `rank`, parsed, for a group of `nparams` parameters.
absl::StatusOr<EngineState> ParseEngine(const std::string& blob, int rank, size_t nparams) {
  absl::StatusOr<EngineState> s = ParseEngineBlob(blob);
  if (!s.ok())
    return absl::DataLossError(absl::StrCat("rank ", rank, "'s ", s.status().message(),
                                            " (not a ZenFlow engine's state of these parameters)"));
  if (s->params.size() != nparams)
    return absl::DataLossError(absl::StrCat("rank ", rank, "'s engine state: ", s->params.size(),
                                            " parameters, the group has ", nparams));
  return s;
}

// Rows [begin, end) of a whole [rows, width] array, from the old ranks' blocks of it.
class RowSource {
 public:
  RowSource(const std::vector<int64_t>& shape, RowLayout layout, int old_world)
      : shape_(shape), layout_(layout), world_(old_world) {}
  // Rows [begin, end) of the result, `width` values each, from per-rank arrays `of(j)` holding
  // rank j's block (or the whole array where the old partition replicated the parameter).
  // Every source block is checked (its size against its rows) before the result is allocated.
  template <typename Of, typename T = float>
  absl::StatusOr<std::vector<T>> Take(int64_t begin, int64_t end, int64_t width, Of of) const {
    if (width < 0 || width > (int64_t{1} << 40))
      return absl::DataLossError(absl::StrCat("a row width of ", width, " values"));
    for (int pass = 0; pass < 2; ++pass) {
      std::vector<T> out;
      if (pass == 1) out.resize(static_cast<size_t>((end - begin) * width));
      for (int j = 0; j < world_; ++j) {
        const RowBlock b = ShareOfParam(shape_, world_, j, layout_).block;
        const int64_t lo = std::max(b.begin, begin), hi = std::min(b.end, end);
        if (lo >= hi) continue;
        const std::vector<T>* src = of(j);
        if (src == nullptr)
          return absl::InvalidArgumentError(absl::StrCat("rank ", j, "'s state is needed"));
        if (static_cast<int64_t>(src->size()) != b.rows() * width)
          return absl::DataLossError(absl::StrCat("rank ", j, "'s block has ", src->size(),
                                                  " values, its rows hold ", b.rows() * width));
        if (pass == 1)
          std::copy(src->begin() + (lo - b.begin) * width, src->begin() + (hi - b.begin) * width,
                    out.begin() + (lo - begin) * width);
        if (b.replicated) break;  // every rank holds it whole: one is enough
      }
      if (pass == 1) return out;
    }
    return std::vector<T>();  // not reached
  }

 private:
  const std::vector<int64_t>& shape_;
  RowLayout layout_;
  int world_;
};

// A daemon checkpoint's header and its four arrays per parameter.
struct DaemonState {
  v1::CheckpointHeader header;
  std::vector<std::vector<float>> master, m, v, acc;
};

absl::StatusOr<DaemonState> ParseDaemon(const std::string& bytes, int rank) {
  // The checkpoint format's in-memory reader: the header is checked, and the size it describes
  // must be the size of the bytes, before any array is allocated (so a corrupt header cannot
  // make it allocate more than the input justifies); the checksum at the end.
  DaemonState d;
  CheckpointImport import(bytes.size(), absl::StrCat("rank ", rank, "'s daemon checkpoint"));
  absl::StatusOr<bool> done = import.Take(
      bytes.data(), bytes.size(),
      [&d](const v1::CheckpointHeader& header)
          -> absl::StatusOr<std::vector<CheckpointArrays>> {
        d.header = header;
        const int n = header.params_size();
        for (auto* a : {&d.master, &d.m, &d.v, &d.acc}) a->resize(n);
        std::vector<CheckpointArrays> arrays;
        for (int i = 0; i < n; ++i) {
          const int64_t numel = CheckpointParamNumel(header.params(i)).value_or(0);
          for (auto* a : {&d.master, &d.m, &d.v, &d.acc}) (*a)[i].resize(numel);
          arrays.push_back(
              {d.master[i].data(), d.m[i].data(), d.v[i].data(), d.acc[i].data(), numel});
        }
        return arrays;
      });
  if (!done.ok()) return absl::DataLossError(done.status().message());
  if (!*done)
    return absl::DataLossError(absl::StrCat("rank ", rank, "'s daemon checkpoint: truncated"));
  return d;
}

absl::Status Disagree(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(
      "the ranks' states disagree on ", what, ": they were not saved at the same step of one run"));
}

}  // namespace

std::vector<int> SourceRanks(const std::vector<WholeParam>& params, int old_world, int new_world,
                             int new_rank, RowLayout layout) {
  std::vector<char> need(old_world, 0);
  for (const WholeParam& p : params) {
    const RowBlock nb = ShareOfParam(p.shape, new_world, new_rank, layout).block;
    for (int j = 0; j < old_world; ++j) {
      const RowBlock ob = ShareOfParam(p.shape, old_world, j, layout).block;
      if (std::max(ob.begin, nb.begin) < std::min(ob.end, nb.end)) {
        need[j] = 1;
        if (ob.replicated) break;
      }
    }
  }
  std::vector<int> out;
  for (int j = 0; j < old_world; ++j)
    if (need[j]) out.push_back(j);
  return out;
}

namespace {

// One Repartition: the old ranks' states it needs, parsed, and the new rank's, cut from them.
class Repartitioner {
 public:
  Repartitioner(const std::vector<WholeParam>& params, int old_world, int new_world,
                int new_rank, RowLayout layout)
      : params_(params), old_world_(old_world), new_world_(new_world), new_rank_(new_rank),
        layout_(layout) {}

  // Parses the ranks SourceRanks names and checks that they were saved together.
  absl::Status Load(const std::vector<const PartitionedState*>& old);
  absl::StatusOr<PartitionedState> Cut();

 private:
  absl::Status CutEngineParam(size_t i, bool v3, BlobWriter* w);
  absl::Status CutDaemonParam(size_t i, int h, DaemonState* out);
  static std::string WriteDaemon(const DaemonState& d);

  // Rank `rank` of `world`'s share of parameter i.
  ShareOf Share(size_t i, int world, int rank) const {
    return ShareOfParam(params_[i].shape, world, rank, layout_);
  }

  const std::vector<WholeParam>& params_;
  const int old_world_, new_world_, new_rank_;
  const RowLayout layout_;
  std::map<int, EngineState> eng_;
  std::map<int, DaemonState> dmn_;
};

absl::Status Repartitioner::Load(const std::vector<const PartitionedState*>& old) {
  for (int j : SourceRanks(params_, old_world_, new_world_, new_rank_, layout_)) {
    if (old[j] == nullptr)
      return absl::InvalidArgumentError(absl::StrCat("rank ", j, " of ", old_world_,
                                                     "'s state is needed and was not given"));
    ASSIGN_OR_RETURN(eng_[j], ParseEngine(old[j]->engine, j, params_.size()));
    if (!old[j]->daemon.empty()) {
      ASSIGN_OR_RETURN(dmn_[j], ParseDaemon(old[j]->daemon, j));
    }
  }
  const EngineState& first = eng_.begin()->second;
  for (const auto& [j, s] : eng_) {
    if (s.mode != first.mode) return Disagree("the mode");
    if (s.step != first.step || s.rounds != first.rounds ||
        s.pending_version != first.pending_version || s.loaded != first.loaded)
      return Disagree(absl::StrCat("the step (rank ", j, ": ", s.step, ", rank ",
                                   eng_.begin()->first, ": ", first.step, ")"));
    if (s.magic != first.magic) return Disagree("the engine state's version");
    if (s.round_adaptive != first.round_adaptive || s.round_base != first.round_base ||
        s.round_interval != first.round_interval || s.round_floor != first.round_floor)
      return Disagree("the automatic round's length");
  }
  if (!dmn_.empty() && dmn_.size() != eng_.size()) return Disagree("whether the daemon holds state");
  return absl::OkStatus();
}

absl::StatusOr<PartitionedState> Repartitioner::Cut() {
  // The version the ranks wrote (engine/blob.h): V2, V3 (dtypes, bf16 masters) or V4 (and the
  // automatic round's state, the same on every rank).
  const EngineState& first = eng_.begin()->second;
  const bool v3 = BlobHasDTypes(first.magic);
  BlobWriter w;
  w.I64(first.magic);
  w.I64(first.mode);
  w.I64(first.step);
  w.I64(first.rounds);
  w.I64(first.pending_version);
  w.I64(first.loaded);
  w.I64(static_cast<int64_t>(params_.size()));
  DaemonState out_d;
  if (!dmn_.empty()) {
    out_d.header = dmn_.begin()->second.header;
    out_d.header.clear_params();
  }
  int daemon_index = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    RETURN_IF_ERROR(CutEngineParam(i, v3, &w));
    if (first.params[i].kind == kBlobDevice || dmn_.empty()) continue;
    RETURN_IF_ERROR(CutDaemonParam(i, daemon_index++, &out_d));
  }
  if (first.magic == kEngineBlobMagicV4) {
    w.I64(first.round_adaptive);
    w.I64(first.round_base);
    w.I64(first.round_interval);
    w.I64(first.round_floor);
  }
  PartitionedState out;
  out.engine = std::move(w.out);
  if (!dmn_.empty()) {
    out.daemon = WriteDaemon(out_d);
  }
  return out;
}

absl::Status Repartitioner::CutEngineParam(size_t i, bool v3, BlobWriter* w) {
  const RowShape rc = RowsOf(params_[i].shape);
  const RowBlock nb = Share(i, new_world_, new_rank_).block;
  const RowSource rows(params_[i].shape, layout_, old_world_);
  const EngineParam& p0 = eng_.begin()->second.params[i];
  for (const auto& [j, s] : eng_) {
    const EngineParam& p = s.params[i];
    // Rank j's parameter is its own block of rows, of at most all the columns hot.
    const RowBlock ob = Share(i, old_world_, j).block;
    if (p.numel != ob.rows() * rc.cols || p.k < 0 || p.k > rc.cols)
      return absl::DataLossError(absl::StrCat(
          "rank ", j, "'s engine state: parameter '", params_[i].name, "' has numel ", p.numel,
          " and k ", p.k, ", its block of ", ob.rows(), " rows of ", rc.cols,
          " columns has numel ", ob.rows() * rc.cols));
    if (p.kind != p0.kind || p.k != p0.k || p.dstep != p0.dstep || p.dtype != p0.dtype ||
        p.master.empty() != p0.master.empty() || p.round_grads != p0.round_grads ||
        p.hot_idx != p0.hot_idx || p.cold_idx != p0.cold_idx || p.hot_steps != p0.hot_steps ||
        p.pending_shown.empty() != p0.pending_shown.empty())
      return Disagree(absl::StrCat("parameter '", params_[i].name, "' (its split, hot columns or "
                                   "step counts)"));
  }
  // The rows [nb.begin, nb.end) of one of the engine's per-parameter arrays of `width` columns.
  auto take = [&](std::vector<float> EngineParam::*field, int64_t width) -> absl::Status {
    auto of = [this, i, field](int j) -> const std::vector<float>* {
      auto it = eng_.find(j);
      return it == eng_.end() ? nullptr : &(it->second.params[i].*field);
    };
    absl::StatusOr<std::vector<float>> a = rows.Take(nb.begin, nb.end, width, of);
    if (!a.ok()) return a.status();
    w->Floats(*a);
    return absl::OkStatus();
  };
  w->I64(p0.kind);
  w->I64(nb.rows() * rc.cols);
  w->I64(p0.k);
  if (v3) w->I64(p0.dtype);
  if (p0.kind == kBlobDevice) {
    w->I64(p0.dstep);
    RETURN_IF_ERROR(take(&EngineParam::m, rc.cols));
    RETURN_IF_ERROR(take(&EngineParam::v, rc.cols));
    if (v3 && p0.master.empty()) w->Floats({});  // no master yet: the first Step widens the value
    else if (v3) RETURN_IF_ERROR(take(&EngineParam::master, rc.cols));
  } else {
    w->I64(p0.round_grads);
  }
  if (p0.kind == kBlobSplit) {
    w->Ints(p0.hot_idx);
    w->Ints(p0.cold_idx);
    w->Ints(p0.hot_steps);
    for (auto field : {&EngineParam::hot_master, &EngineParam::hot_m, &EngineParam::hot_v})
      RETURN_IF_ERROR(take(field, p0.k));
    if (eng_.begin()->second.magic == kEngineBlobMagicV4) {
      if (p0.pending_shown.empty()) w->Floats({});
      else RETURN_IF_ERROR(take(&EngineParam::pending_shown, rc.cols - p0.k));
    }
  }
  return absl::OkStatus();
}

absl::Status Repartitioner::CutDaemonParam(size_t i, int h, DaemonState* out) {
  // The daemon's arrays of parameter i (its h-th offloaded one): [rows, width], width = its
  // offloaded columns.
  const RowShape rc = RowsOf(params_[i].shape);
  const RowBlock nb = Share(i, new_world_, new_rank_).block;
  const RowSource rows(params_[i].shape, layout_, old_world_);
  const EngineParam& p0 = eng_.begin()->second.params[i];
  const DaemonState& d0 = dmn_.begin()->second;
  if (h >= d0.header.params_size())
    return absl::DataLossError("the daemon checkpoint has fewer parameters than the engine offloads");
  // The daemon counts steps per column of the parameter's last dimension: the partition's
  // columns for a weight, but each element (each of the partition's rows) of a 1-D one, whose
  // step counts are then cut and joined by rows like its arrays.
  const bool steps_by_row = p0.kind != kBlobSplit && params_[i].shape.size() <= 1;
  for (const auto& [j, d] : dmn_) {
    if (d.header.params_size() != d0.header.params_size() ||
        d.header.params(h).spec().name() != params_[i].name ||
        (!steps_by_row &&
         (d.header.params(h).col_steps().size() != d0.header.params(h).col_steps().size() ||
          !std::equal(d.header.params(h).col_steps().begin(), d.header.params(h).col_steps().end(),
                      d0.header.params(h).col_steps().begin()))) ||
        d.header.version() != d0.header.version() || d.header.last_step() != d0.header.last_step())
      return Disagree(absl::StrCat("the daemon's parameter '", params_[i].name, "'"));
  }
  // (a daemon checkpoint exists only once the engine has loaded the daemon, at its first step,
  // which selects the column sets)
  const int64_t width = p0.kind == kBlobSplit ? static_cast<int64_t>(p0.cold_idx.size()) : rc.cols;
  v1::CheckpointHeader::Param* hp = out->header.add_params();
  *hp = d0.header.params(h);
  hp->mutable_spec()->clear_shape();
  if (p0.kind == kBlobSplit) {
    hp->mutable_spec()->add_shape(nb.rows());
    hp->mutable_spec()->add_shape(width);
  } else {
    for (int64_t x : Share(i, new_world_, new_rank_).shape)
      hp->mutable_spec()->add_shape(x);
  }
  if (steps_by_row) {
    std::map<int, std::vector<int64_t>> steps;
    for (const auto& [j, d] : dmn_)
      steps[j].assign(d.header.params(h).col_steps().begin(), d.header.params(h).col_steps().end());
    auto steps_of = [&steps](int j) -> const std::vector<int64_t>* {
      auto it = steps.find(j);
      return it == steps.end() ? nullptr : &it->second;
    };
    absl::StatusOr<std::vector<int64_t>> a =
        rows.Take<decltype(steps_of), int64_t>(nb.begin, nb.end, 1, steps_of);
    if (!a.ok()) return a.status();
    hp->clear_col_steps();
    for (int64_t x : *a) hp->add_col_steps(x);
  }
  for (auto field : {&DaemonState::master, &DaemonState::m, &DaemonState::v, &DaemonState::acc}) {
    auto daemon_of = [this, h, field](int j) -> const std::vector<float>* {
      auto it = dmn_.find(j);
      return it == dmn_.end() ? nullptr : &(it->second.*field)[h];
    };
    absl::StatusOr<std::vector<float>> a = rows.Take(nb.begin, nb.end, width, daemon_of);
    if (!a.ok()) return a.status();
    (out->*field).push_back(std::move(*a));
  }
  return absl::OkStatus();
}

std::string Repartitioner::WriteDaemon(const DaemonState& d) {
  std::vector<CheckpointArrays> arrays;
  for (size_t h = 0; h < d.master.size(); ++h)  // read only: the export does not write them
    arrays.push_back({const_cast<float*>(d.master[h].data()), const_cast<float*>(d.m[h].data()),
                      const_cast<float*>(d.v[h].data()), const_cast<float*>(d.acc[h].data()),
                      static_cast<int64_t>(d.master[h].size())});
  CheckpointExport out(d.header, std::move(arrays));
  std::string bytes(out.total(), '\0');
  out.Next(bytes.data(), bytes.size());
  return bytes;
}

}  // namespace

absl::StatusOr<PartitionedState> Repartition(const std::vector<WholeParam>& params,
                                             const std::vector<const PartitionedState*>& old,
                                             int new_world, int new_rank, RowLayout layout) {
  const int old_world = static_cast<int>(old.size());
  if (old_world < 1 || new_world < 1 || new_rank < 0 || new_rank >= new_world)
    return absl::InvalidArgumentError("Repartition: needs old ranks, and 0 <= new_rank < new_world");
  Repartitioner r(params, old_world, new_world, new_rank, layout);
  RETURN_IF_ERROR(r.Load(old));
  return r.Cut();
}

}  // namespace stallfree
