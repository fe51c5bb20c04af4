#include "engine/repartition.h"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/blob.h"
#include "engine/partition.h"
#include "common/state_format.h"
#include "common/status.h"

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
  StateHeader header;
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
      [&d](const StateHeader& header) -> absl::StatusOr<std::vector<CheckpointArrays>> {
        d.header = header;
        const size_t n = header.params.size();
        for (auto* a : {&d.master, &d.m, &d.v, &d.acc}) a->resize(n);
        std::vector<CheckpointArrays> arrays;
        for (size_t i = 0; i < n; ++i) {
          const int64_t numel = CheckpointParamNumel(header.params[i].spec).value_or(0);
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

// A daemon checkpoint's file bytes.
absl::StatusOr<std::string> WriteDaemon(const DaemonState& d) {
  std::vector<CheckpointArrays> arrays;
  for (size_t h = 0; h < d.master.size(); ++h)  // read only: the export does not write them
    arrays.push_back({const_cast<float*>(d.master[h].data()), const_cast<float*>(d.m[h].data()),
                      const_cast<float*>(d.v[h].data()), const_cast<float*>(d.acc[h].data()),
                      static_cast<int64_t>(d.master[h].size())});
  CheckpointExport out(d.header, std::move(arrays));
  RETURN_IF_ERROR(out.status());
  std::string bytes(out.total(), '\0');
  out.Next(bytes.data(), bytes.size());
  return bytes;
}

// The daemon counts steps per column of the parameter's last dimension: the partition's columns
// for a weight, but each element (each of the partition's rows) of a 1-D one, whose step counts
// are then cut and joined by rows like its arrays.
bool StepsByRow(const EngineParam& p, const WholeParam& whole) {
  return p.kind != kBlobSplit && whole.shape.size() <= 1;
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

// Parameter i's array `name` in a parsed state: the engine's (p), or its daemon's (d, the
// daemon's h-th offloaded parameter); null where the state has none (no daemon state) and for
// the int64 arrays (kDaemonSteps, kFlags). The one map from a RowField to where a state keeps it.
template <typename P, typename D>
auto ArrayOf(P& p, D* d, int h, RowField::Name name) -> decltype(&p.m) {
  switch (name) {
    case RowField::kM: return &p.m;
    case RowField::kV: return &p.v;
    case RowField::kMaster: return &p.master;
    case RowField::kHotMaster: return &p.hot_master;
    case RowField::kHotM: return &p.hot_m;
    case RowField::kHotV: return &p.hot_v;
    case RowField::kShown: return &p.pending_shown;
    case RowField::kDaemonMaster: return d == nullptr ? nullptr : &d->master[h];
    case RowField::kDaemonM: return d == nullptr ? nullptr : &d->m[h];
    case RowField::kDaemonV: return d == nullptr ? nullptr : &d->v[h];
    case RowField::kDaemonAcc: return d == nullptr ? nullptr : &d->acc[h];
    case RowField::kDaemonSteps:
    case RowField::kFlags: return nullptr;
  }
  return nullptr;
}

// Where a written state's per-row arrays come from: the old ranks' blocks (Repartition), or the
// arrays given (JoinRows), or none (the state of no rows).
class RowsFrom {
 public:
  virtual ~RowsFrom() = default;
  // Parameter i's float array `name` (h: its index among the daemon's parameters), the
  // target's rows of `width` values each.
  virtual absl::StatusOr<std::vector<float>> Floats(size_t i, int h, RowField::Name name,
                                                    int64_t width) = 0;
  // Parameter i's daemon step counts by row (a 1-D parameter's).
  virtual absl::StatusOr<std::vector<int64_t>> DaemonSteps(size_t i, int h) = 0;
};

// The state of the target shares: the scalars, the parameters' kinds, column sets and step
// counts and the daemon's header from `first` / `d0` (a state these agree with), the per-row
// arrays from `rows`. `master[i]` / `shown[i]`: whether parameter i's bf16 master / pending
// shown columns exist; `d0` null: no daemon checkpoint (nothing offloaded yet).
struct StateWriter {
  const std::vector<WholeParam>& params;
  const EngineState& first;
  const DaemonState* d0;
  const std::vector<ShareOf>& target;
  const std::vector<char>& master;
  const std::vector<char>& shown;
  RowsFrom& rows;

  absl::StatusOr<PartitionedState> Write();
  absl::Status EngineParamOf(size_t i, bool v3, BlobWriter* w);
  absl::Status DaemonParamOf(size_t i, int h, DaemonState* out);
};

absl::StatusOr<PartitionedState> StateWriter::Write() {
  // The version the ranks wrote (engine/blob.h): V2, V3 (dtypes, bf16 masters) or V4 (and the
  // automatic round's state, the same on every rank).
  const bool v3 = BlobHasDTypes(first.magic);
  BlobWriter w;
  w.I64(first.magic);
  w.I64(first.mode);
  w.I64(first.step);
  w.I64(first.rounds);
  w.I64(first.pending_version);
  w.I64(first.loaded);
  w.I64(static_cast<int64_t>(params.size()));
  DaemonState out_d;
  if (d0 != nullptr) {
    out_d.header = d0->header;
    out_d.header.params.clear();
  }
  int daemon_index = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    RETURN_IF_ERROR(EngineParamOf(i, v3, &w));
    if (first.params[i].kind == kBlobDevice || d0 == nullptr) continue;
    RETURN_IF_ERROR(DaemonParamOf(i, daemon_index++, &out_d));
  }
  if (first.magic == kEngineBlobMagicV4) {
    w.I64(first.round_adaptive);
    w.I64(first.round_base);
    w.I64(first.round_interval);
    w.I64(first.round_floor);
  }
  PartitionedState out;
  out.engine = std::move(w.out);
  if (d0 != nullptr) {
    ASSIGN_OR_RETURN(out.daemon, WriteDaemon(out_d));
  }
  return out;
}

absl::Status StateWriter::EngineParamOf(size_t i, bool v3, BlobWriter* w) {
  const RowShape rc = RowsOf(params[i].shape);
  const RowBlock nb = target[i].block;
  const EngineParam& p0 = first.params[i];
  auto take = [&](RowField::Name name, int64_t width) -> absl::Status {
    ASSIGN_OR_RETURN(std::vector<float> a, rows.Floats(i, -1, name, width));
    w->Floats(a);
    return absl::OkStatus();
  };
  w->I64(p0.kind);
  w->I64(nb.rows() * rc.cols);
  w->I64(p0.k);
  if (v3) w->I64(p0.dtype);
  if (p0.kind == kBlobDevice) {
    w->I64(p0.dstep);
    RETURN_IF_ERROR(take(RowField::kM, rc.cols));
    RETURN_IF_ERROR(take(RowField::kV, rc.cols));
    if (v3 && !master[i]) w->Floats({});  // no master yet: the first Step widens the value
    else if (v3) RETURN_IF_ERROR(take(RowField::kMaster, rc.cols));
  } else {
    w->I64(p0.round_grads);
  }
  if (p0.kind == kBlobSplit) {
    w->Ints(p0.hot_idx);
    w->Ints(p0.cold_idx);
    w->Ints(p0.hot_steps);
    const int64_t k = p0.hot_idx.empty() ? 0 : p0.k;  // no hot arrays before the first step
    RETURN_IF_ERROR(take(RowField::kHotMaster, k));
    RETURN_IF_ERROR(take(RowField::kHotM, k));
    RETURN_IF_ERROR(take(RowField::kHotV, k));
    if (first.magic == kEngineBlobMagicV4) {
      if (!shown[i]) w->Floats({});
      else RETURN_IF_ERROR(take(RowField::kShown, rc.cols - p0.k));
    }
  }
  return absl::OkStatus();
}

absl::Status StateWriter::DaemonParamOf(size_t i, int h, DaemonState* out) {
  // The daemon's arrays of parameter i (its h-th offloaded one): [rows, width], width = its
  // offloaded columns.
  const RowShape rc = RowsOf(params[i].shape);
  const RowBlock nb = target[i].block;
  const EngineParam& p0 = first.params[i];
  if (static_cast<size_t>(h) >= d0->header.params.size())
    return absl::DataLossError("the daemon checkpoint has fewer parameters than the engine offloads");
  // (a daemon checkpoint exists only once the engine has loaded the daemon, at its first step,
  // which selects the column sets)
  const int64_t width = p0.kind == kBlobSplit ? static_cast<int64_t>(p0.cold_idx.size()) : rc.cols;
  StateHeader::Param& hp = out->header.params.emplace_back(d0->header.params[h]);
  if (p0.kind == kBlobSplit)
    hp.spec.shape = {nb.rows(), width};
  else
    hp.spec.shape = target[i].shape;
  if (StepsByRow(p0, params[i])) {
    ASSIGN_OR_RETURN(hp.col_steps, rows.DaemonSteps(i, h));
  }
  const std::pair<RowField::Name, std::vector<std::vector<float>> DaemonState::*> arrays[] = {
      {RowField::kDaemonMaster, &DaemonState::master}, {RowField::kDaemonM, &DaemonState::m},
      {RowField::kDaemonV, &DaemonState::v}, {RowField::kDaemonAcc, &DaemonState::acc}};
  for (const auto& [name, member] : arrays) {
    ASSIGN_OR_RETURN(std::vector<float> a, rows.Floats(i, h, name, width));
    (out->*member).push_back(std::move(a));
  }
  return absl::OkStatus();
}

// Rows from the old ranks' blocks (Repartition).
class OldRanksRows : public RowsFrom {
 public:
  OldRanksRows(const std::vector<WholeParam>& params, const std::vector<ShareOf>& target,
               const std::map<int, EngineState>& eng, const std::map<int, DaemonState>& dmn,
               int old_world, RowLayout layout)
      : params_(params), target_(target), eng_(eng), dmn_(dmn), old_world_(old_world),
        layout_(layout) {}

  absl::StatusOr<std::vector<float>> Floats(size_t i, int h, RowField::Name name,
                                            int64_t width) override {
    auto of = [this, i, h, name](int j) -> const std::vector<float>* {
      auto e = eng_.find(j);
      if (e == eng_.end()) return nullptr;
      auto d = dmn_.find(j);
      return ArrayOf(e->second.params[i], d == dmn_.end() ? nullptr : &d->second, h, name);
    };
    return Source(i).Take(target_[i].block.begin, target_[i].block.end, width, of);
  }
  absl::StatusOr<std::vector<int64_t>> DaemonSteps(size_t i, int h) override {
    auto of = [this, h](int j) -> const std::vector<int64_t>* {
      auto it = dmn_.find(j);
      return it == dmn_.end() ? nullptr : &it->second.header.params[h].col_steps;
    };
    return Source(i).Take<decltype(of), int64_t>(target_[i].block.begin, target_[i].block.end, 1,
                                                 of);
  }

 private:
  RowSource Source(size_t i) const { return RowSource(params_[i].shape, layout_, old_world_); }

  const std::vector<WholeParam>& params_;
  const std::vector<ShareOf>& target_;
  const std::map<int, EngineState>& eng_;
  const std::map<int, DaemonState>& dmn_;
  const int old_world_;
  const RowLayout layout_;
};

// One Repartition: the old ranks' states it needs, parsed, checked to agree, and the new rank's
// written from them.
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
  absl::Status CheckEngineParam(size_t i) const;
  absl::Status CheckDaemonParam(size_t i, int h) const;

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
  int h = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    RETURN_IF_ERROR(CheckEngineParam(i));
    if (first.params[i].kind == kBlobDevice || dmn_.empty()) continue;
    RETURN_IF_ERROR(CheckDaemonParam(i, h++));
  }
  return absl::OkStatus();
}

absl::Status Repartitioner::CheckEngineParam(size_t i) const {
  const RowShape rc = RowsOf(params_[i].shape);
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
  return absl::OkStatus();
}

absl::Status Repartitioner::CheckDaemonParam(size_t i, int h) const {
  const EngineParam& p0 = eng_.begin()->second.params[i];
  const DaemonState& d0 = dmn_.begin()->second;
  const bool steps_by_row = StepsByRow(p0, params_[i]);
  for (const auto& [j, d] : dmn_) {
    if (static_cast<size_t>(h) >= d.header.params.size())
      return absl::DataLossError(
          "the daemon checkpoint has fewer parameters than the engine offloads");
    if (d.header.params.size() != d0.header.params.size() ||
        d.header.params[h].spec.name != params_[i].name ||
        (!steps_by_row && d.header.params[h].col_steps != d0.header.params[h].col_steps) ||
        d.header.version != d0.header.version || d.header.last_step != d0.header.last_step)
      return Disagree(absl::StrCat("the daemon's parameter '", params_[i].name, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PartitionedState> Repartitioner::Cut() {
  const EngineState& first = eng_.begin()->second;
  std::vector<ShareOf> target;
  std::vector<char> master, shown;
  for (size_t i = 0; i < params_.size(); ++i) {
    target.push_back(Share(i, new_world_, new_rank_));
    master.push_back(!first.params[i].master.empty());
    shown.push_back(!first.params[i].pending_shown.empty());
  }
  OldRanksRows rows(params_, target, eng_, dmn_, old_world_, layout_);
  StateWriter w{params_, first, dmn_.empty() ? nullptr : &dmn_.begin()->second,
                target, master, shown, rows};
  return w.Write();
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

const char* RowField::NameOf(Name name) {
  switch (name) {
    case kM: return "m";
    case kV: return "v";
    case kMaster: return "master";
    case kHotMaster: return "hot_master";
    case kHotM: return "hot_m";
    case kHotV: return "hot_v";
    case kShown: return "shown";
    case kDaemonMaster: return "daemon_master";
    case kDaemonM: return "daemon_m";
    case kDaemonV: return "daemon_v";
    case kDaemonAcc: return "daemon_acc";
    case kDaemonSteps: return "daemon_steps";
    case kFlags: return "flags";
  }
  return "?";
}

namespace {

// The per-row arrays a state of this version has for parameter `p` (of `whole`), and their
// widths: a function of its kind, hot count and dtype alone.
std::vector<std::pair<RowField::Name, int64_t>> FieldsOf(const EngineParam& p,
                                                        const WholeParam& whole, int64_t magic) {
  const int64_t cols = RowsOf(whole.shape).cols;
  std::vector<std::pair<RowField::Name, int64_t>> out;
  if (p.kind == kBlobDevice) {
    out = {{RowField::kM, cols}, {RowField::kV, cols}};
    if (BlobHasDTypes(magic) && p.dtype == kBlobBf16) out.push_back({RowField::kMaster, cols});
  } else {
    if (p.kind == kBlobSplit) {
      out = {{RowField::kHotMaster, p.k}, {RowField::kHotM, p.k}, {RowField::kHotV, p.k}};
      if (magic == kEngineBlobMagicV4) out.push_back({RowField::kShown, cols - p.k});
    }
    const int64_t width = p.kind == kBlobSplit ? cols - p.k : cols;
    for (RowField::Name n : {RowField::kDaemonMaster, RowField::kDaemonM, RowField::kDaemonV,
                             RowField::kDaemonAcc})
      out.push_back({n, width});
    if (StepsByRow(p, whole)) out.push_back({RowField::kDaemonSteps, 1});
  }
  out.push_back({RowField::kFlags, 1});
  return out;
}

// No rows: the rest of a state.
class NoRows : public RowsFrom {
 public:
  absl::StatusOr<std::vector<float>> Floats(size_t, int, RowField::Name, int64_t) override {
    return std::vector<float>();
  }
  absl::StatusOr<std::vector<int64_t>> DaemonSteps(size_t, int) override {
    return std::vector<int64_t>();
  }
};

// The rows given to JoinRows, by parameter and name (checked whole by JoinRows).
class GivenRows : public RowsFrom {
 public:
  GivenRows(const std::vector<WholeParam>& params,
            const std::map<std::pair<int, RowField::Name>, RowField*>& fields)
      : params_(params), fields_(fields) {}

  // Each array is taken once: moved out, not copied.
  absl::StatusOr<std::vector<float>> Floats(size_t i, int, RowField::Name name,
                                            int64_t width) override {
    if (width == 0) return std::vector<float>();  // not held yet (the hot arrays, step 0)
    ASSIGN_OR_RETURN(RowField * f, Find(i, name, width));
    return std::move(f->f32);
  }
  absl::StatusOr<std::vector<int64_t>> DaemonSteps(size_t i, int) override {
    ASSIGN_OR_RETURN(RowField * f, Find(i, RowField::kDaemonSteps, 1));
    return std::move(f->i64);
  }

 private:
  absl::StatusOr<RowField*> Find(size_t i, RowField::Name name, int64_t width) const {
    auto it = fields_.find({static_cast<int>(i), name});
    if (it == fields_.end() || it->second->width != width)
      return absl::DataLossError(absl::StrCat(
          "parameter '", params_[i].name, "': its state's ", RowField::NameOf(name), " has ",
          it == fields_.end() ? 0 : it->second->width, " values a row, the rest says ", width));
    return it->second;
  }

  const std::vector<WholeParam>& params_;
  const std::map<std::pair<int, RowField::Name>, RowField*>& fields_;
};

// Rank `rank`'s shares, cut to no rows (the shares of SplitRows' rest).
std::vector<ShareOf> NoRowsOf(const std::vector<WholeParam>& params, int world, int rank,
                              RowLayout layout) {
  std::vector<ShareOf> out;
  for (const WholeParam& p : params) {
    ShareOf s = ShareOfParam(p.shape, world, rank, layout);
    s.block.end = s.block.begin;
    if (!s.shape.empty()) s.shape[0] = 0;
    out.push_back(std::move(s));
  }
  return out;
}

absl::Status CheckWorld(const char* what, int world, int rank) {
  if (world < 1 || rank < 0 || rank >= world)
    return absl::InvalidArgumentError(absl::StrCat(what, ": needs 0 <= rank < world"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SplitState> SplitRows(const std::vector<WholeParam>& params,
                                     const PartitionedState& share, int world, int rank,
                                     RowLayout layout) {
  RETURN_IF_ERROR(CheckWorld("SplitRows", world, rank));
  ASSIGN_OR_RETURN(EngineState eng, ParseEngine(share.engine, rank, params.size()));
  std::optional<DaemonState> dmn;
  if (!share.daemon.empty()) {
    ASSIGN_OR_RETURN(dmn.emplace(), ParseDaemon(share.daemon, rank));
  }
  // Which optional arrays the state holds, before the arrays are moved out.
  std::vector<char> master, shown;
  for (const EngineParam& p : eng.params) {
    master.push_back(!p.master.empty());
    shown.push_back(!p.pending_shown.empty());
  }
  SplitState out;
  int h = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    EngineParam& p = eng.params[i];
    const ShareOf sh = ShareOfParam(params[i].shape, world, rank, layout);
    const int64_t rows = sh.block.rows();
    if (p.numel != rows * sh.whole.cols || p.k < 0 || p.k > sh.whole.cols)
      return absl::DataLossError(absl::StrCat(
          "the engine state's parameter '", params[i].name, "' has numel ", p.numel, " and k ",
          p.k, ", rank ", rank, " of ", world, "'s ", rows, " rows of ", sh.whole.cols,
          " columns have ", rows * sh.whole.cols));
    const bool offloaded = p.kind != kBlobDevice && dmn.has_value();
    if (offloaded && static_cast<size_t>(h) >= dmn->header.params.size())
      return absl::DataLossError("the daemon checkpoint has fewer parameters than the engine offloads");
    for (const auto& [name, width] : FieldsOf(p, params[i], eng.magic)) {
      RowField f;
      f.param = static_cast<int>(i);
      f.name = name;
      f.width = width;
      const size_t n = static_cast<size_t>(rows * width);
      std::vector<float>* held = ArrayOf(p, offloaded ? &*dmn : nullptr, h, name);
      if (name == RowField::kDaemonSteps) {
        if (offloaded)
          f.i64 = dmn->header.params[h].col_steps;
        f.i64.resize(n);
      } else if (name == RowField::kFlags) {
        f.i64.assign(n, (master[i] ? 1 : 0) | (shown[i] ? 2 : 0));
      }
      if (!f.is_int()) {
        // Not held yet (no master, no pending round, nothing offloaded): zeros, per the flags
        // and the rest.
        if (held != nullptr && !held->empty() && held->size() != n)
          return absl::DataLossError(absl::StrCat(
              "parameter '", params[i].name, "': its ", RowField::NameOf(name), " has ",
              held->size(), " values, its ", rows, " rows of ", width, " hold ", n));
        // (moved out of the parsed state: its rest below needs none of the arrays)
        f.f32 = held != nullptr && !held->empty() ? std::move(*held) : std::vector<float>(n, 0.0f);
      } else if (f.i64.size() != n) {
        return absl::DataLossError(absl::StrCat("parameter '", params[i].name, "': its ",
                                                RowField::NameOf(name), " has ", f.i64.size(),
                                                " values, its rows hold ", n));
      }
      out.fields.push_back(std::move(f));
    }
    if (offloaded) ++h;
  }
  const std::vector<ShareOf> none = NoRowsOf(params, world, rank, layout);
  NoRows no_rows;
  StateWriter w{params, eng, dmn ? &*dmn : nullptr, none, master, shown, no_rows};
  ASSIGN_OR_RETURN(out.rest, w.Write());
  return out;
}

absl::StatusOr<PartitionedState> JoinRows(const std::vector<WholeParam>& params,
                                          const PartitionedState& rest,
                                          std::vector<RowField> fields, int world, int rank,
                                          RowLayout layout) {
  RETURN_IF_ERROR(CheckWorld("JoinRows", world, rank));
  absl::StatusOr<EngineState> eng = ParseEngineBlob(rest.engine);
  if (!eng.ok() || eng->params.size() != params.size())
    return absl::DataLossError(absl::StrCat(
        "the state's rest: ",
        eng.ok() ? absl::StrCat(eng->params.size(), " parameters, the group has ", params.size())
                 : std::string(eng.status().message())));
  std::optional<DaemonState> dmn;
  if (!rest.daemon.empty()) {
    ASSIGN_OR_RETURN(dmn.emplace(), ParseDaemon(rest.daemon, rank));
  }
  std::map<std::pair<int, RowField::Name>, RowField*> by_name;
  for (RowField& f : fields) {
    if (f.param < 0 || static_cast<size_t>(f.param) >= params.size())
      return absl::InvalidArgumentError(absl::StrCat("a row array of parameter ", f.param,
                                                     ": the group has ", params.size()));
    if (!by_name.emplace(std::make_pair(f.param, f.name), &f).second)
      return absl::InvalidArgumentError(absl::StrCat("parameter '", params[f.param].name,
                                                     "': ", RowField::NameOf(f.name),
                                                     " given twice"));
  }
  std::vector<ShareOf> target;
  std::vector<char> master, shown;
  size_t expected = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const EngineParam& p = eng->params[i];
    if (p.numel != 0)
      return absl::DataLossError(absl::StrCat("the state's rest holds ", p.numel,
                                              " values of parameter '", params[i].name,
                                              "': not the rest of a split state"));
    target.push_back(ShareOfParam(params[i].shape, world, rank, layout));
    const int64_t rows = target.back().block.rows();
    for (const auto& [name, width] : FieldsOf(p, params[i], eng->magic)) {
      ++expected;
      auto it = by_name.find({static_cast<int>(i), name});
      if (it == by_name.end())
        return absl::InvalidArgumentError(absl::StrCat("parameter '", params[i].name, "': no ",
                                                       RowField::NameOf(name), " given"));
      const RowField& f = *it->second;
      const size_t n = f.is_int() ? f.i64.size() : f.f32.size();
      if (f.width != width || static_cast<int64_t>(n) != rows * width)
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter '", params[i].name, "': ", RowField::NameOf(name), " has ", n,
            " values of width ", f.width, "; rank ", rank, " of ", world, "'s ", rows,
            " rows of ", width, " hold ", rows * width));
    }
    // The flags of the rows (every row of a share says the same); no rows: nothing held.
    const std::vector<int64_t>& flags = by_name.at({static_cast<int>(i), RowField::kFlags})->i64;
    for (int64_t x : flags)
      if (x != flags[0])
        return absl::DataLossError(absl::StrCat("parameter '", params[i].name,
                                                "': its rows disagree on what the state holds"));
    const int64_t held = flags.empty() ? 0 : flags[0];
    master.push_back((held & 1) != 0);
    shown.push_back((held & 2) != 0);
  }
  if (expected != fields.size())
    return absl::InvalidArgumentError(absl::StrCat(fields.size() - expected,
                                                   " row arrays that no parameter has"));
  GivenRows given(params, by_name);
  StateWriter w{params, *eng, dmn ? &*dmn : nullptr, target, master, shown, given};
  return w.Write();
}

}  // namespace stallfree
