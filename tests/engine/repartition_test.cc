// engine/repartition.h: which old ranks a new rank reads (SourceRanks), and Repartition on real
// engine states and daemon checkpoints: a run of 4 data-parallel ranks (ZenFlowEngines over row
// blocks, CPU backend, one real stallfreed) saved mid-round and continued by 2, 1 and 4 ranks
// equals the uninterrupted 4-rank run bit for bit; and the errors: a needed rank missing, ranks
// saved at different steps, bytes that are no state.
//
// The ranks share the synthetic whole gradients (independent of the parameters) and each holds its
// own copy of the values, of which its engine updates its block (the whole parameter where it is
// replicated); the score hook gives every rank the whole weight's column scores, computed on the
// host from the whole gradient, as the data-parallel all-reduce would. Every update is element-
// wise with per-column step counts, so any partition computes the same numbers: the continued
// runs must equal the uninterrupted one exactly.
#include "engine/repartition.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/engine/engine_fixture.h"
#include "client/client.h"
#include "client/session_target.h"
#include "engine/partition.h"
#include "engine/zenflow.h"
#include "kernels/ops.h"
#include "kernels/optimizer.h"
#include "testing/daemon_process.h"

namespace stallfree {
namespace {

using testing::Daemon;

// ---- SourceRanks ----

TEST(SourceRanksTest, OverlappingRowBlocks) {
  const std::vector<WholeParam> w = {{"w", {10, 24}}};  // 10 rows
  // 4 -> 2: old blocks [0,2) [2,5) [5,7) [7,10); new [0,5) [5,10).
  EXPECT_EQ(SourceRanks(w, 4, 2, 0), (std::vector<int>{0, 1}));
  EXPECT_EQ(SourceRanks(w, 4, 2, 1), (std::vector<int>{2, 3}));
  // 2 -> 4: new [0,2) [2,5) [5,7) [7,10) each inside one old block.
  EXPECT_EQ(SourceRanks(w, 2, 4, 0), (std::vector<int>{0}));
  EXPECT_EQ(SourceRanks(w, 2, 4, 1), (std::vector<int>{0}));
  EXPECT_EQ(SourceRanks(w, 2, 4, 2), (std::vector<int>{1}));
  EXPECT_EQ(SourceRanks(w, 2, 4, 3), (std::vector<int>{1}));
  // 3 -> 2: old [0,3) [3,6) [6,10); new [0,5) [5,10): the middle rank feeds both.
  EXPECT_EQ(SourceRanks(w, 3, 2, 0), (std::vector<int>{0, 1}));
  EXPECT_EQ(SourceRanks(w, 3, 2, 1), (std::vector<int>{1, 2}));
  // -> 1: every old rank; the same world: itself.
  EXPECT_EQ(SourceRanks(w, 4, 1, 0), (std::vector<int>{0, 1, 2, 3}));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(SourceRanks(w, 4, 4, r), (std::vector<int>{r}));
  // A 1-D parameter is numel rows of one column; the union over the parameters.
  const std::vector<WholeParam> two = {{"a", {4, 8}}, {"b", {8}}};  // 4 and 8 rows
  // 4 -> 2, rank 1: a's rows [2,4) from old 2 and 3; b's rows [4,8) from old 2 and 3.
  EXPECT_EQ(SourceRanks(two, 4, 2, 1), (std::vector<int>{2, 3}));
  // 2 -> 3, rank 1: a's rows [1,2) (old 0), b's rows [2,5) (old 0 [0,4) and old 1 [4,8)).
  EXPECT_EQ(SourceRanks(two, 2, 3, 1), (std::vector<int>{0, 1}));
}

// A rank's share (engine/partition.h), the rule the Python front-end takes through the binding
// (partition_share): values worked out by hand.
TEST(ShareOfParamTest, RowsColumnsBlocksAndTheEnginesShape) {
  using Shape = std::vector<int64_t>;
  ShareOf s = ShareOfParam({5, 3}, 2, 1);  // 5 rows of 3: rank 1 has rows [2, 5)
  EXPECT_EQ(s.whole.rows, 5);
  EXPECT_EQ(s.whole.cols, 3);
  EXPECT_EQ(s.block.begin, 2);
  EXPECT_EQ(s.block.end, 5);
  EXPECT_EQ(s.shape, (Shape{3, 3}));
  EXPECT_EQ(s.first(), 6);
  EXPECT_EQ(s.end(), 15);
  s = ShareOfParam({2, 4, 6}, 4, 1);  // a 3-D weight: 8 rows of 6, rank 1 rows [2, 4)
  EXPECT_EQ(s.whole.rows, 8);
  EXPECT_EQ(s.shape, (Shape{2, 6}));
  EXPECT_EQ(s.first(), 12);
  s = ShareOfParam({7}, 4, 3);  // 1-D: 7 rows of one column, rank 3 rows [5, 7)
  EXPECT_EQ(s.whole.cols, 1);
  EXPECT_EQ(s.block.begin, 5);
  EXPECT_EQ(s.shape, (Shape{2}));
  s = ShareOfParam({2, 3}, 4, 3);  // fewer rows than ranks: whole
  EXPECT_TRUE(s.block.replicated);
  EXPECT_EQ(s.shape, (Shape{2, 3}));
  EXPECT_EQ(s.first(), 0);
  EXPECT_EQ(ShareOfParam({}, 2, 1).shape, (Shape{1}));  // a scalar
  EXPECT_TRUE(ShareOfParam({}, 2, 1).block.replicated);
  EXPECT_EQ(ShareOfParam({2, 4, 6}, 1, 0).shape, (Shape{2, 4, 6}));  // one rank: whole
  s = ShareOfParam({4, 0}, 2, 0);  // no columns: rows still split, no division by zero
  EXPECT_EQ(s.whole.rows, 4);
  EXPECT_EQ(s.shape, (Shape{2, 0}));
}

// FSDP2's layout: dimension 0 in chunks of ceil(d0 / world), the last short or empty; each
// index of dimension 0 is rows/d0 rows (hand-worked).
TEST(ShareOfParamTest, Fsdp2Chunks) {
  using Shape = std::vector<int64_t>;
  ShareOf s = ShareOfParam({66, 5}, 4, 3, RowLayout::kFsdp2);  // chunks of 17: rank 3 has 15
  EXPECT_EQ(s.block.begin, 51);
  EXPECT_EQ(s.block.end, 66);
  EXPECT_EQ(s.shape, (Shape{15, 5}));
  EXPECT_FALSE(s.block.replicated);
  s = ShareOfParam({3, 2, 4}, 2, 1, RowLayout::kFsdp2);  // chunks of 2 (of 2 rows each)
  EXPECT_EQ(s.block.begin, 4);
  EXPECT_EQ(s.block.end, 6);
  EXPECT_EQ(s.shape, (Shape{1, 2, 4}));  // the local tensor's shape, not [rows, cols]
  s = ShareOfParam({2, 8}, 4, 2, RowLayout::kFsdp2);  // chunks of 1: ranks 2, 3 hold none
  EXPECT_EQ(s.block.rows(), 0);
  EXPECT_EQ(s.shape, (Shape{0, 8}));
  EXPECT_EQ(ShareOfParam({7}, 1, 0, RowLayout::kFsdp2).shape, (Shape{7}));
  // 4 -> 2 over a 66-row weight: new rank 0 has rows [0, 33), old chunks [0,17) [17,34).
  const std::vector<WholeParam> w = {{"w", {66, 5}}};
  EXPECT_EQ(SourceRanks(w, 4, 2, 0, RowLayout::kFsdp2), (std::vector<int>{0, 1}));
  EXPECT_EQ(SourceRanks(w, 4, 2, 1, RowLayout::kFsdp2), (std::vector<int>{1, 2, 3}));
}

TEST(SourceRanksTest, FewerRowsThanRanksIsReplicated) {
  // 2 rows over 4 old ranks: every old rank holds it whole, so one (the first) is enough.
  const std::vector<WholeParam> small = {{"small", {2, 16}}};
  EXPECT_TRUE(PartitionRows(2, 4, 3).replicated);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(SourceRanks(small, 4, 2, r), (std::vector<int>{0}));
  EXPECT_EQ(SourceRanks(small, 4, 1, 0), (std::vector<int>{0}));
  // Replicated in the new world too (2 rows over 3 ranks): still old rank 0 only.
  for (int r = 0; r < 3; ++r) EXPECT_EQ(SourceRanks(small, 4, 3, r), (std::vector<int>{0}));
  // Partitioned in the old world (2 rows over 2 ranks), replicated in the new (over 4): every
  // new rank needs both old ones.
  for (int r = 0; r < 4; ++r) EXPECT_EQ(SourceRanks(small, 2, 4, r), (std::vector<int>{0, 1}));
  // A scalar is one row: replicated over any world > 1.
  EXPECT_EQ(SourceRanks({{"s", {}}}, 4, 2, 1), (std::vector<int>{0}));
  // With a partitioned parameter beside it, rank 1 of 2 needs old rank 0 (for `small`) and
  // the old ranks of its rows of `w` (2 and 3).
  const std::vector<WholeParam> both = {{"w", {10, 24}}, {"small", {2, 16}}};
  EXPECT_EQ(SourceRanks(both, 4, 2, 1), (std::vector<int>{0, 2, 3}));
}

// ---- Repartition on real states ----

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> value;
  int64_t numel() const { return static_cast<int64_t>(value.size()); }
  int64_t cols() const { return shape.size() >= 2 ? shape.back() : 1; }
  int64_t rows() const { return numel() / cols(); }
};

// Two split weights (`small` has fewer rows than 4 ranks: replicated there), a weight too
// narrow to split (on the device, its m and v in the engine state), a 1-D parameter.
std::vector<Tensor> MakeModel() {
  std::vector<Tensor> ts = {
      {"w", {10, 24}, {}}, {"small", {2, 16}, {}}, {"narrow", {5, 3}, {}}, {"bias", {22}, {}}};
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (Tensor& t : ts) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    t.value.resize(n);
    for (float& x : t.value) x = normal(rng);
  }
  return ts;
}

std::vector<WholeParam> Whole(const std::vector<Tensor>& ts) {
  std::vector<WholeParam> out;
  for (const Tensor& t : ts) out.push_back({t.name, t.shape});
  return out;
}

// The whole gradients of step t: noise, with a band of 6 columns ten times larger moving by 3
// columns a step (so reselections migrate columns).
void FillGrads(std::vector<std::vector<float>>* grads, const std::vector<Tensor>& ts, int64_t t) {
  std::mt19937 rng(1000003 + static_cast<int>(t));
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < ts.size(); ++i) {
    const int64_t cols = ts[i].cols();
    std::vector<float>& g = (*grads)[i];
    for (int64_t k = 0; k < ts[i].numel(); ++k) {
      const int64_t c = k % cols;
      g[k] = normal(rng) * ((((c - 3 * t) % cols + cols) % cols) < 6 ? 10.0f : 1.0f);
    }
  }
}

// `automatic`: zenflow's round is update_interval auto, at most 2 steps, over sessions whose
// daemon reports a slow Update (engine_test::ReportedPace): rounds of 1 until the choice at
// step 4, then of 2 (boundaries 6, 8, 10), on every rank and every restored engine alike.
ZenFlowConfig Config(OffloadMode mode, bool automatic = false) {
  ZenFlowConfig c;
  c.mode = mode;
  c.topk_ratio = 0.25;
  c.update_interval = mode == OffloadMode::kZenFlow ? 2 : 1;
  c.select_interval = mode == OffloadMode::kZenFlow ? 2 : 0;
  c.warmup_steps = 0;
  c.weight_decay = 0.05;
  c.grad_dtype = DType::kBf16;
  if (automatic) {
    c.update_interval = 0;
    c.select_interval = 0;
    c.max_update_interval = 2;
  }
  return c;
}

double Lr(int64_t t) { return 1e-2 / (1.0 + 0.1 * t); }

// Rank `rank` of `world`: its copy of the values, its session and its engine over its blocks.
struct Rank {
  std::vector<Tensor> model;
  std::unique_ptr<SessionTarget> session;
  std::unique_ptr<ZenFlowEngine> engine;
};

class RepartitionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<Daemon>(std::vector<std::string>{"--threads", "2"}, "warning");
    auto client = Client::Connect(daemon_->socket());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    model_ = MakeModel();
    for (const Tensor& t : model_) grads_.emplace_back(t.numel(), 0.0f);
  }

  // A rank over `values` (the whole model, copied), as the trainer builds it (DpPartition::View).
  std::unique_ptr<Rank> MakeRank(const std::vector<Tensor>& values, int world, int rank,
                                 OffloadMode mode = OffloadMode::kZenFlow,
                                 bool automatic = false) {
    auto r = std::make_unique<Rank>();
    r->model = values;
    std::vector<EngineParam> params;
    for (size_t i = 0; i < values.size(); ++i) {
      Tensor& t = r->model[i];
      const RowBlock b = PartitionRows(t.rows(), world, rank);
      std::vector<int64_t> shape = t.shape;
      if (world > 1 && !b.replicated)
        shape = t.shape.size() >= 2 ? std::vector<int64_t>{b.rows(), t.cols()}
                                    : std::vector<int64_t>{b.rows()};
      params.push_back({t.name, shape, t.value.data() + b.begin * t.cols(),
                        grads_[i].data() + b.begin * t.cols()});
    }
    auto session = client_->OpenSession(
        absl::StrCat("repartition-", OffloadModeName(mode), "-", world, "-", rank), rank);
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return nullptr;
    if (automatic)
      r->session = std::make_unique<engine_test::ReportedPace>(std::move(*session), 0.2);
    else
      r->session = std::make_unique<SessionTarget>(std::move(*session));
    auto engine = ZenFlowEngine::Create(Config(mode, automatic), params,
                                        kernels::DefaultCpuKernel(),
                                        kernels::CpuOps(), r->session.get());
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return nullptr;
    r->engine = std::move(*engine);
    // The whole weight's column scores, the same on every rank (the all-reduce's result).
    const std::vector<Tensor>* whole = &model_;
    const std::vector<std::vector<float>>* grads = &grads_;
    r->engine->set_score_reduce([whole, grads](const std::string& name, float* scores,
                                               int64_t cols) -> absl::Status {
      if (name.empty()) {
        // The automatic round's figures ({replicas, compute, stall, replicas with an Update,
        // their Update seconds}, engine/zenflow.cc): summed over the ranks they are the same on
        // every rank, so every rank chooses the same length. The ranks here step one after the
        // other, so the sum is given: a 10 ms step without stalls and the reported 0.2 s Update
        // (one rank's figures; each rank's own measured stall could set a floor on it alone).
        const float fig[5] = {1.0f, 0.01f, 0.0f, 1.0f, 0.2f};
        std::copy(fig, fig + std::min<int64_t>(cols, 5), scores);
        return absl::OkStatus();
      }
      for (size_t i = 0; i < whole->size(); ++i) {
        if ((*whole)[i].name != name) continue;
        for (int64_t c = 0; c < cols; ++c) {
          double sq = 0;
          for (int64_t row = 0; row < (*whole)[i].rows(); ++row) {
            const double g = (*grads)[i][row * cols + c];
            sq += g * g;
          }
          scores[c] = static_cast<float>(sq);
        }
      }
      return absl::OkStatus();
    });
    return r;
  }

  // One step of every rank (the gradients of step t).
  void Step(std::vector<std::unique_ptr<Rank>>* ranks, int64_t t) {
    FillGrads(&grads_, model_, t);
    for (auto& r : *ranks) ASSERT_TRUE(r->engine->Step(Lr(t)).ok()) << "step " << t;
  }

  // The whole values: each block from its owner (a replicated parameter from rank 0), as the
  // trainer's all-gather assembles them.
  std::vector<Tensor> Gather(const std::vector<std::unique_ptr<Rank>>& ranks) {
    const int world = static_cast<int>(ranks.size());
    std::vector<Tensor> out = ranks[0]->model;
    for (size_t i = 0; i < out.size(); ++i) {
      for (int q = 1; q < world; ++q) {
        const RowBlock b = PartitionRows(out[i].rows(), world, q);
        if (b.replicated) continue;
        const int64_t c = out[i].cols();
        std::copy(ranks[q]->model[i].value.begin() + b.begin * c,
                  ranks[q]->model[i].value.begin() + b.end * c, out[i].value.begin() + b.begin * c);
      }
    }
    return out;
  }

  // Every rank's state: the engine's bytes and the daemon checkpoint's file bytes.
  std::vector<PartitionedState> Save(const std::vector<std::unique_ptr<Rank>>& ranks,
                                     const std::string& tag) {
    std::vector<PartitionedState> out;
    for (size_t r = 0; r < ranks.size(); ++r) {
      const std::string t = absl::StrCat(tag, ".r", r);
      auto engine = ranks[r]->engine->Checkpoint(t);
      EXPECT_TRUE(engine.ok()) << engine.status();
      auto daemon = ranks[r]->session->ReadCheckpoint(t, /*delete_after=*/true);
      EXPECT_TRUE(daemon.ok()) << daemon.status();
      out.push_back({engine.ok() ? *engine : "", daemon.ok() ? *daemon : ""});
    }
    return out;
  }

  void ContinueWithOtherWorlds(OffloadMode mode, bool automatic = false);

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<Client> client_;
  std::vector<Tensor> model_;                // the initial values and the shapes
  std::vector<std::vector<float>> grads_;    // the whole gradients of the current step
};

// zenflow (S = 2, reselection every round; the 1-D parameter on the device) and sync-offload
// (every parameter in the daemon: the 1-D one's per-element step counts cut by rows too; its 22
// rows split unevenly, 5, 6, 5, 6).
TEST_F(RepartitionTest, FourRanksSavedMidRoundContinueWithTwoOneAndFourExactly) {
  for (OffloadMode mode : {OffloadMode::kZenFlow, OffloadMode::kSyncOffload}) {
    SCOPED_TRACE(OffloadModeName(mode));
    ContinueWithOtherWorlds(mode);
  }
}

// The automatic round's state (a V4 blob) is cut like the rest and carried to every new rank:
// saved at step 5, mid-round of 2, the continuations land and bound the rounds where the
// uninterrupted run does.
TEST_F(RepartitionTest, AnAutomaticRoundSavedMidRoundContinuesExactly) {
  ContinueWithOtherWorlds(OffloadMode::kZenFlow, /*automatic=*/true);
}

// The whole parameters' per-row arrays, each row from the split of the old rank that holds it.
std::vector<RowField> WholeRows(const std::vector<WholeParam>& whole,
                                const std::vector<SplitState>& splits) {
  const int world = static_cast<int>(splits.size());
  std::vector<RowField> out = splits[0].fields;
  for (RowField& f : out) {
    const ShareOf s0 = ShareOfParam(whole[f.param].shape, world, 0);
    if (s0.block.replicated) continue;  // rank 0 holds it whole
    const size_t n = static_cast<size_t>(s0.whole.rows * f.width);
    f.f32.clear();
    f.i64.clear();
    for (int j = 0; j < world; ++j)
      for (const RowField& g : splits[j].fields)
        if (g.param == f.param && g.name == f.name) {
          f.f32.insert(f.f32.end(), g.f32.begin(), g.f32.end());
          f.i64.insert(f.i64.end(), g.i64.begin(), g.i64.end());
        }
    EXPECT_EQ(f.is_int() ? f.i64.size() : f.f32.size(), n) << RowField::NameOf(f.name);
  }
  return out;
}

// Rank `rank` of `world`'s rows of the whole arrays.
std::vector<RowField> RankRows(const std::vector<RowField>& whole_rows, int world, int rank,
                             const std::vector<WholeParam>& whole) {
  std::vector<RowField> out;
  for (const RowField& f : whole_rows) {
    const RowBlock b = ShareOfParam(whole[f.param].shape, world, rank).block;
    RowField g = f;
    if (f.is_int())
      g.i64.assign(f.i64.begin() + b.begin * f.width, f.i64.begin() + b.end * f.width);
    else
      g.f32.assign(f.f32.begin() + b.begin * f.width, f.f32.begin() + b.end * f.width);
    out.push_back(std::move(g));
  }
  return out;
}

void RepartitionTest::ContinueWithOtherWorlds(OffloadMode mode, bool automatic) {
  constexpr int kOld = 4;
  constexpr int64_t kSaved = 5, kSteps = 10;  // step 5: inside a round (S = 2), Update pending
  std::vector<std::unique_ptr<Rank>> old;
  for (int r = 0; r < kOld; ++r) {
    old.push_back(MakeRank(model_, kOld, r, mode, automatic));
    ASSERT_NE(old.back(), nullptr);
  }
  for (int64_t t = 1; t <= kSaved; ++t) Step(&old, t);
  if (automatic) {
    ASSERT_EQ(old[0]->engine->update_interval(), 2);
    ASSERT_FALSE(old[0]->engine->last_timings().boundary);  // step 5: mid-round
  }
  const std::vector<PartitionedState> saved = Save(old, absl::StrCat("four-", OffloadModeName(mode)));
  const std::vector<Tensor> values = Gather(old);
  std::vector<std::vector<Tensor>> straight;  // the uninterrupted run, steps kSaved+1..kSteps
  for (int64_t t = kSaved + 1; t <= kSteps; ++t) {
    Step(&old, t);
    straight.push_back(Gather(old));
  }
  ASSERT_FALSE(saved[0].daemon.empty()) << "nothing was offloaded: the test proves nothing";
  const std::vector<WholeParam> whole = Whole(model_);
  std::vector<SplitState> splits;
  for (int r = 0; r < kOld; ++r) {
    absl::StatusOr<SplitState> split = SplitRows(whole, saved[r], kOld, r);
    ASSERT_TRUE(split.ok()) << split.status();
    // A rank's own arrays and its rest give back its state, byte for byte.
    absl::StatusOr<PartitionedState> back = JoinRows(whole, split->rest, split->fields, kOld, r);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(back->engine == saved[r].engine);
    EXPECT_TRUE(back->daemon == saved[r].daemon);
    splits.push_back(std::move(*split));
  }
  const std::vector<RowField> whole_rows = WholeRows(whole, splits);

  for (int world : {2, 1, 4}) {
    SCOPED_TRACE(absl::StrCat("4 -> ", world, " ranks"));
    std::vector<std::unique_ptr<Rank>> ranks;
    for (int s = 0; s < world; ++s) {
      ranks.push_back(MakeRank(values, world, s, mode, automatic));
      ASSERT_NE(ranks.back(), nullptr);
      // Only the sources are given: a rank never needs the others' states.
      std::vector<const PartitionedState*> given(kOld, nullptr);
      for (int j : SourceRanks(whole, kOld, world, s)) given[j] = &saved[j];
      absl::StatusOr<PartitionedState> mine = Repartition(whole, given, world, s);
      ASSERT_TRUE(mine.ok()) << mine.status();
      if (world == kOld) {
        EXPECT_EQ(mine->engine, saved[s].engine);  // the identity
      }
      // The same state through the per-row arrays (what a DCP checkpoint of FSDP2 holds): the
      // whole arrays joined from the old ranks' splits, this rank's rows of them, and the rest
      // of any old rank's split. (The daemon checkpoint's header names the session and rank
      // that wrote it, which a restore does not read: compared with the rest of the rank whose
      // header Repartition copies, its first source.)
      const std::vector<RowField> my_rows = RankRows(whole_rows, world, s, whole);
      absl::StatusOr<PartitionedState> joined =
          JoinRows(whole, splits[(s + 1) % kOld].rest, my_rows, world, s);
      ASSERT_TRUE(joined.ok()) << joined.status();
      EXPECT_TRUE(joined->engine == mine->engine);
      joined = JoinRows(whole, splits[SourceRanks(whole, kOld, world, s)[0]].rest, my_rows,
                        world, s);
      ASSERT_TRUE(joined.ok()) << joined.status();
      EXPECT_TRUE(joined->daemon == mine->daemon);
      const std::string tag = absl::StrCat("to", world, "-", OffloadModeName(mode), ".r", s);
      ASSERT_TRUE(ranks[s]->session->WriteCheckpoint(tag, mine->daemon).ok());
      absl::Status st = ranks[s]->engine->Restore(tag, mine->engine);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_EQ(ranks[s]->engine->step(), kSaved);
      if (automatic) {
        EXPECT_EQ(ranks[s]->engine->update_interval(), 2);
      }
    }
    for (int64_t t = kSaved + 1; t <= kSteps; ++t) {
      Step(&ranks, t);
      const std::vector<Tensor> got = Gather(ranks);
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_EQ(got[i].value, straight[t - kSaved - 1][i].value)
            << got[i].name << " after step " << t;
    }
  }
}

TEST_F(RepartitionTest, MissingRanksDisagreeingStepsAndGarbageAreRefused) {
  constexpr int kOld = 4;
  std::vector<std::unique_ptr<Rank>> old;
  for (int r = 0; r < kOld; ++r) {
    old.push_back(MakeRank(model_, kOld, r));
    ASSERT_NE(old.back(), nullptr);
  }
  for (int64_t t = 1; t <= 3; ++t) Step(&old, t);
  const std::vector<PartitionedState> at3 = Save(old, "at3");
  Step(&old, 4);
  const std::vector<PartitionedState> at4 = Save(old, "at4");
  const std::vector<WholeParam> whole = Whole(model_);
  auto all = [](const std::vector<PartitionedState>& s) {
    std::vector<const PartitionedState*> p;
    for (const PartitionedState& x : s) p.push_back(&x);
    return p;
  };
  ASSERT_TRUE(Repartition(whole, all(at3), 2, 1).ok());

  // Rank 1 of 2 needs old ranks 0 (`small` is replicated over 4), 2 and 3: without rank 2, an
  // InvalidArgument naming it.
  std::vector<const PartitionedState*> missing = all(at3);
  missing[2] = nullptr;
  absl::StatusOr<PartitionedState> r = Repartition(whole, missing, 2, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("rank 2 of 4"), std::string::npos) << r.status();
  // Rank 1 (not a source of rank 1 of 2) may be missing.
  missing = all(at3);
  missing[1] = nullptr;
  EXPECT_TRUE(Repartition(whole, missing, 2, 1).ok());

  // Old rank 3 saved at step 4, the others at step 3.
  std::vector<const PartitionedState*> mixed = all(at3);
  mixed[3] = &at4[3];
  r = Repartition(whole, mixed, 2, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("disagree"), std::string::npos) << r.status();

  // Bytes that are no engine state, and a daemon checkpoint that is no checkpoint (or is cut).
  for (int which = 0; which < 3; ++which) {
    PartitionedState bad = at3[2];
    if (which == 0) bad.engine = "not an engine state at all";
    if (which == 1) bad.daemon = std::string(4096, 'x');
    if (which == 2) bad.daemon.resize(bad.daemon.size() / 2);
    std::vector<const PartitionedState*> p = all(at3);
    p[2] = &bad;
    r = Repartition(whole, p, 2, 1);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << which << ": " << r.status();
    EXPECT_NE(r.status().message().find("rank 2"), std::string::npos) << r.status();
  }
  // JoinRows: a missing array, one of the wrong size, one too many, a rest that holds rows.
  absl::StatusOr<SplitState> split = SplitRows(whole, at3[1], 4, 1);
  ASSERT_TRUE(split.ok()) << split.status();
  ASSERT_TRUE(JoinRows(whole, split->rest, split->fields, 4, 1).ok());
  std::vector<RowField> fields = split->fields;
  fields.erase(fields.begin());
  r = JoinRows(whole, split->rest, fields, 4, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("no hot_master given"), std::string::npos) << r.status();
  fields = split->fields;
  fields[0].f32.pop_back();
  r = JoinRows(whole, split->rest, fields, 4, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  fields = split->fields;
  fields.push_back(fields[0]);
  r = JoinRows(whole, split->rest, fields, 4, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("given twice"), std::string::npos) << r.status();
  r = JoinRows(whole, at3[1], split->fields, 4, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("not the rest"), std::string::npos) << r.status();
  // Another model's states: the parameter count differs.
  std::vector<WholeParam> fewer = whole;
  fewer.pop_back();
  r = Repartition(fewer, all(at3), 2, 1);
  EXPECT_FALSE(r.ok());
}

}  // namespace
}  // namespace stallfree
