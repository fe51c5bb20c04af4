// The ZenFlow engine against dense AdamW, with a real stallfreed process.
//
// Gradients are synthetic and independent of the parameters, with a band of "important" columns
// (10x the magnitude) that moves every step, so the top-k selection moves columns in and out of
// the hot set and the engine migrates their state through the daemon. On the CPU backend every
// kernel is bit-identical to the scalar oracle, so the expectations are exact (zero tolerance).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/session_target.h"
#include "engine/blob.h"
#include "engine/zenflow.h"
#include "common/bf16.h"
#include "kernels/memory.h"
#include "kernels/ops.h"
#include "kernels/optimizer.h"
#include "tests/engine/engine_fixture.h"

namespace stallfree {
namespace engine_test {
namespace {

// The fp32 model (engine_fixture.h).
std::vector<Tensor> MakeModel(int seed) { return SmallModel<float>(seed); }

std::vector<EngineParam> Params(std::vector<Tensor>* ts) {
  std::vector<EngineParam> ps;
  for (Tensor& t : *ts) ps.push_back({t.name, t.shape, t.value.data(), t.grad.data()});
  return ps;
}

// Dense AdamW on every parameter, the oracle kernel: the quality reference.
struct Dense {
  std::vector<Tensor> ts;
  std::vector<std::vector<float>> m, v;
  explicit Dense(std::vector<Tensor> model) : ts(std::move(model)) {
    for (Tensor& t : ts) {
      m.emplace_back(t.value.size(), 0.0f);
      v.emplace_back(t.value.size(), 0.0f);
    }
  }
  void Step(int64_t t, int seed, const ZenFlowConfig& c) {
    FillGrads(&ts, t, seed);
    const kernels::AdamWConfig a = c.AdamW(Lr(t), t);
    for (size_t i = 0; i < ts.size(); ++i)
      kernels::ReferenceKernel().AdamW(a, ts[i].value.data(), m[i].data(), v[i].data(),
                                       ts[i].grad.data(), kernels::GradType::kFp32,
                                       static_cast<int64_t>(ts[i].value.size()), nullptr);
  }
};

class ZenFlowTest : public EngineTest {};

// zenflow with S = 1 and every update awaited equals dense AdamW bit for bit, while reselection
// every step migrates columns between the device and the daemon; every hot column's value, m, v
// and step equal the dense trajectory at every step, including columns that went
// hot -> cold -> hot.
TEST_F(ZenFlowTest, ZeroStalenessEqualsDenseAdamWAcrossMigrations) {
  const int seed = 1;
  const ZenFlowConfig cfg = Config(OffloadMode::kZenFlow, 1, 1, true);
  std::vector<Tensor> model = MakeModel(seed);
  Dense dense(model);
  auto session = NewSession("zf-exact");
  ASSERT_NE(session, nullptr);
  auto engine = ZenFlowEngine::Create(cfg, Params(&model), kernels::DefaultCpuKernel(),
                                      kernels::CpuOps(), session.get());
  ASSERT_TRUE(engine.ok()) << engine.status();
  ZenFlowEngine& e = **engine;
  int64_t migrated = 0;
  std::map<int64_t, std::string> w1_history;  // column 0 of w1: 'H' hot / 'C' cold per step
  for (int64_t t = 1; t <= 16; ++t) {
    FillGrads(&model, t, seed);
    ASSERT_TRUE(e.Step(Lr(t)).ok()) << "step " << t;
    dense.Step(t, seed, cfg);
    migrated += e.last_timings().migrated_columns;
    ASSERT_TRUE(e.Flush().ok());
    for (size_t i = 0; i < model.size(); ++i) {
      const Tensor& x = model[i];
      ASSERT_EQ(0, memcmp(x.value.data(), dense.ts[i].value.data(), x.value.size() * 4))
          << x.name << " differs from dense AdamW after step " << t;
      auto hot = e.HotColumns(x.name);
      ASSERT_TRUE(hot.ok());
      for (int64_t c : *hot) {
        auto col = e.Column(x.name, c);
        ASSERT_TRUE(col.ok()) << col.status();
        ASSERT_TRUE(col->on_device);
        EXPECT_EQ(col->step, t) << x.name << " column " << c;
        EXPECT_EQ(col->value, ColumnOf(dense.ts[i].value, x.rows(), x.cols(), c));
        EXPECT_EQ(col->m, ColumnOf(dense.m[i], x.rows(), x.cols(), c))
            << x.name << " column " << c << " m after step " << t;
        EXPECT_EQ(col->v, ColumnOf(dense.v[i], x.rows(), x.cols(), c))
            << x.name << " column " << c << " v after step " << t;
      }
      if (x.name == "w1") {
        bool is_hot = std::find(hot->begin(), hot->end(), 0) != hot->end();
        w1_history[t] = is_hot ? "H" : "C";
      }
    }
  }
  EXPECT_GT(migrated, 0) << "the band never moved a column: the test proves nothing";
  std::string history;
  for (auto& [t, h] : w1_history) history += h;
  // The band of 6 moves 3 columns a step over 24 columns: column 0 is hot every 8th step.
  EXPECT_NE(history.find("HCCCCCCH"), std::string::npos) << history;
}

// Tall weights whose cold part is larger than the daemon's staging area: the engine loads them
// in several LoadParams calls and moves a reselection's columns in several handovers (each
// packed into the staging area), and still equals dense AdamW bit for bit (S = 1, awaited,
// reselection every step). The engine registers one parameter slot of its parameter dtype.
TEST_F(ZenFlowTest, TallWeightsLoadAndMigrateInChunksThroughTheStagingArea) {
  const int seed = 9;
  const ZenFlowConfig cfg = Config(OffloadMode::kZenFlow, 1, 1, true);
  std::vector<Tensor> model = {{"tall", {2048, 16}, {}, {}}, {"tall3", {1024, 2, 12}, {}, {}}};
  Initialise(&model, seed);
  Dense dense(model);
  auto session = NewSession("zf-tall");
  ASSERT_NE(session, nullptr);
  auto engine = ZenFlowEngine::Create(cfg, Params(&model), kernels::DefaultCpuKernel(),
                                      kernels::CpuOps(), session.get());
  ASSERT_TRUE(engine.ok()) << engine.status();
  const v1::RegionLayout& layout = session->session()->layout();
  EXPECT_EQ(layout.param_slots(), 1u);
  EXPECT_EQ(layout.param_dtype(), v1::DTYPE_FP32);
  int64_t registered = 0;
  for (const v1::ParamLayout& p : layout.params()) registered += p.numel();
  EXPECT_EQ(registered, 2048 * 12 + 2048 * 9);
  const uint64_t cap = session->staging_floats();
  ASSERT_LT(cap, static_cast<uint64_t>(registered)) << "the load would not be chunked";
  ZenFlowEngine& e = **engine;
  bool several_handovers = false;
  for (int64_t t = 1; t <= 10; ++t) {
    FillGrads(&model, t, seed);
    ASSERT_TRUE(e.Step(Lr(t)).ok()) << "step " << t;
    dense.Step(t, seed, cfg);
    // A handover call holds at most cap floats: 4 blocks of 2048 rows per column.
    if (e.last_timings().migrated_columns / 2 * 4 * 2048 > static_cast<int64_t>(cap))
      several_handovers = true;
    ASSERT_TRUE(e.Flush().ok());
    for (size_t i = 0; i < model.size(); ++i)
      ASSERT_EQ(0, memcmp(model[i].value.data(), dense.ts[i].value.data(),
                          model[i].value.size() * 4))
          << model[i].name << " differs from dense AdamW after step " << t;
  }
  EXPECT_TRUE(several_handovers) << "no reselection needed more than one handover";
}

// The ZenFlow algorithm per column, as the reference for S > 1: every column carries its own
// value, m, v and step wherever it lives. Hot columns take an AdamW step on every gradient, cold
// columns accumulate scale * g (scale = 1 / S) and take one AdamW step on the sum at the round's
// end. The hot set is selected at step 1 (before its updates) and at the end of every
// select_interval-th step (after its updates) from the scores of that step's gradient.
// Migration moves state and changes nothing, so the engine (awaited, fp32 transfers) must
// produce exactly these values at every step.
struct PerColumnZenFlow {
  std::vector<Tensor> ts;
  std::vector<std::vector<float>> m, v, acc;
  std::vector<std::vector<int64_t>> steps;  // per column
  std::vector<std::vector<char>> hot;       // per column, for split weights
  ZenFlowConfig cfg;
  PerColumnZenFlow(std::vector<Tensor> model, const ZenFlowConfig& c) : ts(std::move(model)), cfg(c) {
    for (Tensor& t : ts) {
      m.emplace_back(t.value.size(), 0.0f);
      v.emplace_back(t.value.size(), 0.0f);
      acc.emplace_back(t.value.size(), 0.0f);
      steps.emplace_back(t.cols(), 0);
      hot.emplace_back(t.cols(), 0);
    }
  }
  static bool Split(const Tensor& t, double ratio, int64_t* k) {
    *k = std::clamp<int64_t>(std::llround(ratio * t.cols()), 1, t.cols());
    return t.shape.size() >= 2 && t.cols() - *k >= 4;
  }
  // One AdamW step of column c of tensor i on gradient column g (rows floats).
  void UpdateColumn(size_t i, int64_t c, const std::vector<float>& g, double lr) {
    Tensor& t = ts[i];
    const int64_t rows = t.rows(), cols = t.cols();
    std::vector<float> p(rows), mm(rows), vv(rows);
    for (int64_t r = 0; r < rows; ++r) {
      p[r] = t.value[r * cols + c];
      mm[r] = m[i][r * cols + c];
      vv[r] = v[i][r * cols + c];
    }
    const kernels::AdamWConfig a = cfg.AdamW(lr, ++steps[i][c]);
    kernels::ReferenceKernel().AdamW(a, p.data(), mm.data(), vv.data(), g.data(),
                                     kernels::GradType::kFp32, rows, nullptr);
    for (int64_t r = 0; r < rows; ++r) {
      t.value[r * cols + c] = p[r];
      m[i][r * cols + c] = mm[r];
      v[i][r * cols + c] = vv[r];
    }
  }
  void Step(int64_t t, int seed) {
    FillGrads(&ts, t, seed);
    const int64_t S = cfg.update_interval;
    const bool reselect = t % cfg.EffectiveSelectInterval() == 0;
    const float scale = static_cast<float>(1.0 / static_cast<double>(S));
    for (size_t i = 0; i < ts.size(); ++i) {
      Tensor& x = ts[i];
      const int64_t rows = x.rows(), cols = x.cols();
      int64_t k;
      const bool split = Split(x, cfg.topk_ratio, &k);
      auto select = [&] {
        std::vector<float> scores(cols);
        kernels::ReferenceKernel().ColumnScores(x.grad.data(), kernels::GradType::kFp32, rows,
                                                cols, cols, nullptr, scores.data());
        std::vector<int64_t> top(k);
        kernels::ReferenceKernel().TopK(scores.data(), cols, k, top.data());
        std::fill(hot[i].begin(), hot[i].end(), 0);
        for (int64_t c : top) hot[i][c] = 1;
      };
      if (split && t == 1) select();
      for (int64_t c = 0; c < cols; ++c) {
        std::vector<float> g = ColumnOf(x.grad, rows, cols, c);
        if (!split || hot[i][c]) {
          UpdateColumn(i, c, g, Lr(t));
          continue;
        }
        for (int64_t r = 0; r < rows; ++r) {
          // What crosses to the daemon: the gradient as it is, or rounded to bf16.
          const uint16_t g16 = FloatToBf16(g[r]);
          const bool bf16 = cfg.grad_dtype == DType::kBf16;
          kernels::ReferenceKernel().Accumulate(
              &acc[i][r * cols + c], bf16 ? static_cast<const void*>(&g16) : &g[r],
              bf16 ? kernels::GradType::kBf16 : kernels::GradType::kFp32, scale, 1);
        }
        if (t % S == 0) {
          std::vector<float> sum = ColumnOf(acc[i], rows, cols, c);
          UpdateColumn(i, c, sum, Lr(t));
          for (int64_t r = 0; r < rows; ++r) acc[i][r * cols + c] = 0.0f;
        }
      }
      if (split && reselect) select();
    }
  }
};

// S = 4 with a reselection at every round: the engine equals the per-column algorithm bit for
// bit at every step (awaited updates, fp32 parameters back), while columns migrate every round;
// with fp32 gradients, and with bf16 ones (the cold columns' gradients rounded as they cross,
// the entering columns' round step taken on the device from the same rounded values).
TEST_F(ZenFlowTest, RoundsWithReselectionEqualThePerColumnAlgorithm) {
 for (DType grad_dtype : {DType::kFp32, DType::kBf16})
 for (Transfers how : {Transfers::kDirect, Transfers::kBuffered}) {
  SCOPED_TRACE(absl::StrCat(grad_dtype == DType::kFp32 ? "fp32 gradients " : "bf16 gradients ",
                            TransfersName(how)));
  const int seed = 6;
  ZenFlowConfig cfg = Config(OffloadMode::kZenFlow, 4, 4, true);
  cfg.grad_dtype = grad_dtype;
  cfg.transfers = how;
  std::vector<Tensor> model = MakeModel(seed);
  PerColumnZenFlow ref(model, cfg);
  auto session = NewSession(grad_dtype == DType::kFp32 ? "rounds" : "rounds-bf16");
  auto engine = ZenFlowEngine::Create(cfg, Params(&model), kernels::DefaultCpuKernel(),
                                      kernels::CpuOps(), session.get());
  ASSERT_TRUE(engine.ok()) << engine.status();
  int64_t migrated = 0;
  for (int64_t t = 1; t <= 20; ++t) {
    FillGrads(&model, t, seed);
    ASSERT_TRUE((*engine)->Step(Lr(t)).ok()) << "step " << t;
    migrated += (*engine)->last_timings().migrated_columns;
    ref.Step(t, seed);
    for (size_t i = 0; i < model.size(); ++i)
      ASSERT_EQ(model[i].value, ref.ts[i].value) << model[i].name << " after step " << t;
    for (size_t i = 0; i < model.size(); ++i) {
      auto hot = (*engine)->HotColumns(model[i].name);
      ASSERT_TRUE(hot.ok());
      for (int64_t c : *hot) {
        auto col = (*engine)->Column(model[i].name, c);
        ASSERT_TRUE(col.ok());
        EXPECT_EQ(col->step, ref.steps[i][c]) << model[i].name << " column " << c;
        EXPECT_EQ(col->m, ColumnOf(ref.m[i], model[i].rows(), model[i].cols(), c));
        EXPECT_EQ(col->v, ColumnOf(ref.v[i], model[i].rows(), model[i].cols(), c));
      }
    }
  }
  EXPECT_GT(migrated, 0);
 }
}

// The engine over a session that re-attaches (SessionTarget with reattach_s), its daemon
// SIGKILLed at random instants of a 40-step run that hands columns over at every round (top-k
// reselection every 2 steps, S = 2, Updates not awaited), each kill followed by a daemon started
// again on the same socket: the daemon's units and a handover's pieces wait 10 ms each (its
// testing flags), so the kills land inside pushes, Updates and handovers as well as between
// them. The parameters after every step equal those of the same run on a daemon never killed,
// bit for bit: what a dead daemon left half done the next one finished, a handover it had
// done was answered again, and an Update it had not begun was sent again. (Under
// AddressSanitizer too: make test runs tests/engine so.)
TEST(ZenFlowSurvival, ADaemonKilledAtRandomInstantsCostsTheEngineNothing) {
  const int64_t kSteps = 40;
  const int kKills = 10;
  struct Outcome {
    std::vector<std::vector<float>> values;  // per step, every parameter's, concatenated
    int64_t reattached = 0, migrated = 0;
    int64_t finished = 0;  // work of a killed daemon that the next one finished or answered
    int kills = 0;
  };
  // With kills, the run goes on past kSteps until the last kill was noticed (at most 400 steps);
  // without, it runs `steps`.
  auto run = [&](bool kill, int64_t steps) {
    Outcome o;
    std::vector<std::string> flags = {"--threads", "2"};
    if (kill) {
      flags.insert(flags.end(),
                   {"--test_unit_delay_us", "10000", "--test_piece_delay_us", "10000"});
    }
    testing::Daemon d(flags, "info");
    EXPECT_TRUE(d.started()) << d.error();
    auto client = Client::Connect(d.socket(), 3000, 60);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return o;
    auto s = (*client)->OpenSession("survival", 0);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return o;
    SessionTarget target(std::move(*s), 60);
    const int seed = 9;
    std::vector<Tensor> model = MakeModel(seed);
    auto engine = ZenFlowEngine::Create(Config(OffloadMode::kZenFlow, 2, 2, false),
                                        Params(&model), kernels::DefaultCpuKernel(),
                                        kernels::CpuOps(), &target);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return o;
    std::atomic<bool> stop{false}, killed_all{!kill};
    std::thread killer([&] {
      std::mt19937 rng(5);
      for (; kill && o.kills < kKills && !stop.load(); ++o.kills) {
        const auto until = std::chrono::steady_clock::now() +
                           std::chrono::milliseconds(30 + rng() % 120);
        while (!stop.load() && std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        if (stop.load()) break;
        // What the daemon about to be killed finished of its predecessor's work.
        auto c = Client::Connect(d.socket(), 3000);
        absl::StatusOr<v1::Stats> st = c.ok() ? (*c)->GetStats() : c.status();
        if (st.ok())
          o.finished += st->updates_resumed() + st->pushes_resumed() + st->handovers_resumed() +
                        st->handovers_answered_again();
        d.Kill();
        d.Restart();
        // The next kill once the engine has noticed this one (re-attached).
        while (!stop.load() && target.reattached() <= o.kills)
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      killed_all.store(true);
    });
    for (int64_t t = 1; kill ? (t <= kSteps || !killed_all.load()) && t <= 400 : t <= steps;
         ++t) {
      FillGrads(&model, t, seed);
      absl::Status st = (*engine)->Step(Lr(t));
      EXPECT_TRUE(st.ok()) << "step " << t << ": " << st << "\n" << d.Log();
      if (!st.ok()) break;
      o.migrated += (*engine)->last_timings().migrated_columns;
      std::vector<float> all;
      for (const Tensor& x : model) all.insert(all.end(), x.value.begin(), x.value.end());
      o.values.push_back(std::move(all));
    }
    absl::Status drained = (*engine)->Flush();
    EXPECT_TRUE(drained.ok()) << drained;
    stop.store(true);
    killer.join();
    o.reattached = target.reattached();
    return o;
  };
  const Outcome got = run(true, 0);
  const Outcome want = run(false, static_cast<int64_t>(got.values.size()));
  EXPECT_EQ(got.kills, kKills) << "the run ended before its kills";
  EXPECT_EQ(got.reattached, got.kills);
  EXPECT_GT(got.finished, 0) << "no kill landed inside the daemon's work";
  EXPECT_GT(want.migrated, 0) << "no column was handed over";
  EXPECT_EQ(got.migrated, want.migrated);
  ASSERT_GE(got.values.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(want.values.size(), got.values.size());
  for (size_t t = 0; t < got.values.size(); ++t)
    ASSERT_TRUE(got.values[t] == want.values[t]) << "the parameters differ after step " << t + 1;
}

// update_interval auto (W = 2, so it chooses at steps 2, 18, ...): a daemon whose Update takes
// 200 ms against a caller that computes nothing gets the longest round (4, the bound; 3 with
// max_update_interval 3), and then runs exactly the fixed S = 4 schedule, bit for bit; one
// whose Update takes 1 us against a caller computing 100 ms a step keeps rounds of 1, exactly
// the fixed S = 1 run. The state of an automatic round restores into an automatic engine only.
TEST_F(ZenFlowTest, AutomaticRoundFollowsTheDaemonsPaceAndRestores) {
  const int seed = 6;
  struct Case {
    double update_s, sleep_ms;
    int64_t max, want;
  };
  // (The third caller computes 100 ms a step: at 40 ms a loaded machine under ASan made the
  // engine's own waits, 2.7 ms a step, exceed the 5% of compute that lengthens a round.)
  for (const Case& k : {Case{0.2, 0, 4, 4}, Case{0.2, 0, 3, 3}, Case{1e-6, 100, 4, 1}}) {
    SCOPED_TRACE(absl::StrCat("update ", k.update_s, " s, max ", k.max));
    ZenFlowConfig autoc = Config(OffloadMode::kZenFlow, 0, 0, false);
    autoc.warmup_steps = 2;
    autoc.max_update_interval = k.max;
    ZenFlowConfig fixed = autoc;
    fixed.update_interval = k.want;
    std::vector<Tensor> a = MakeModel(seed), b = a;
    std::unique_ptr<SessionTarget> sa = NewPacedSession("auto", k.update_s);
    std::unique_ptr<SessionTarget> sb = NewSession("fixed");
    auto ea = ZenFlowEngine::Create(autoc, Params(&a), kernels::DefaultCpuKernel(),
                                    kernels::CpuOps(), sa.get());
    auto eb = ZenFlowEngine::Create(fixed, Params(&b), kernels::DefaultCpuKernel(),
                                    kernels::CpuOps(), sb.get());
    ASSERT_TRUE(ea.ok()) << ea.status();
    ASSERT_TRUE(eb.ok()) << eb.status();
    EXPECT_EQ((*ea)->update_interval(), 1);
    ZenFlowEngine::Snapshot mid;
    for (int64_t t = 1; t <= 24; ++t) {
      FillGrads(&a, t, seed);
      FillGrads(&b, t, seed);
      if (k.sleep_ms > 0) absl::SleepFor(absl::Milliseconds(k.sleep_ms));
      ASSERT_TRUE((*ea)->Step(Lr(t)).ok()) << "step " << t;
      ASSERT_TRUE((*eb)->Step(Lr(t)).ok()) << "step " << t;
      EXPECT_EQ((*ea)->last_timings().interval, t <= 2 ? 1 : k.want) << "step " << t;
      EXPECT_EQ((*ea)->last_timings().boundary, (*eb)->last_timings().boundary) << "step " << t;
      for (size_t i = 0; i < a.size(); ++i)
        ASSERT_EQ(0, memcmp(a[i].value.data(), b[i].value.data(), a[i].value.size() * 4))
            << a[i].name << " step " << t;
      if (t == 13) {  // mid-round for S = 4 (rounds end at 14, 18, ...)
        auto snap = (*ea)->CheckpointBytes();
        ASSERT_TRUE(snap.ok()) << snap.status();
        mid = *snap;
      }
    }
    EXPECT_EQ((*ea)->update_interval(), k.want);
    // The mid-run state: an automatic engine takes it with its round length; a fixed one
    // refuses it naming update_interval.
    std::vector<Tensor> c = MakeModel(seed);
    std::unique_ptr<SessionTarget> sc = NewPacedSession("auto-restored", k.update_s);
    auto ec = ZenFlowEngine::Create(autoc, Params(&c), kernels::DefaultCpuKernel(),
                                    kernels::CpuOps(), sc.get());
    ASSERT_TRUE(ec.ok()) << ec.status();
    ASSERT_TRUE((*ec)->RestoreBytes(mid.engine, mid.daemon).ok());
    EXPECT_EQ((*ec)->update_interval(), k.want);
    std::vector<Tensor> d = MakeModel(seed);
    std::unique_ptr<SessionTarget> sd = NewSession("fixed-restored");
    auto ed = ZenFlowEngine::Create(fixed, Params(&d), kernels::DefaultCpuKernel(),
                                    kernels::CpuOps(), sd.get());
    ASSERT_TRUE(ed.ok()) << ed.status();
    absl::Status refused = (*ed)->RestoreBytes(mid.engine, mid.daemon);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_NE(refused.message().find("update_interval auto"), std::string::npos) << refused;
  }
}

// A fixed round longer than max_update_interval's bound (which only an automatic round
// obeys), with predict_cold (so a V4 blob, holding the round), restores: the bound is not
// checked against it.
TEST_F(ZenFlowTest, AFixedRoundLongerThanTheAutomaticBoundRestores) {
  const int seed = 7;
  ZenFlowConfig cfg = Config(OffloadMode::kZenFlow, 8, 0, false);
  cfg.predict_cold = true;
  std::vector<Tensor> a = MakeModel(seed);
  std::unique_ptr<SessionTarget> sa = NewSession("fixed8");
  auto ea = ZenFlowEngine::Create(cfg, Params(&a), kernels::DefaultCpuKernel(),
                                  kernels::CpuOps(), sa.get());
  ASSERT_TRUE(ea.ok()) << ea.status();
  for (int64_t t = 1; t <= 3; ++t) {
    FillGrads(&a, t, seed);
    ASSERT_TRUE((*ea)->Step(Lr(t)).ok());
  }
  auto snap = (*ea)->CheckpointBytes();
  ASSERT_TRUE(snap.ok()) << snap.status();
  int64_t magic = 0;
  memcpy(&magic, snap->engine.data(), 8);
  EXPECT_EQ(magic, kEngineBlobMagicV4);
  std::vector<Tensor> b = MakeModel(seed);
  std::unique_ptr<SessionTarget> sb = NewSession("fixed8-restored");
  auto eb = ZenFlowEngine::Create(cfg, Params(&b), kernels::DefaultCpuKernel(),
                                  kernels::CpuOps(), sb.get());
  ASSERT_TRUE(eb.ok()) << eb.status();
  absl::Status st = (*eb)->RestoreBytes(snap->engine, snap->daemon);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ((*eb)->step(), 3);
}

// cold_changed (StepTimings) is the rule data-parallel replicas share their steps by: a step
// that does not report it changed no cold column of a split weight (only hot columns, which
// the replicas then exchange alone). Rounds of 4 with the Update landing 1, 2 or 4 (the next
// boundary) steps after its boundary, and predicted cold columns: the reported steps are
// exactly the boundaries and the landings, and every other step leaves every cold column's
// bytes as they were. (Not reporting the landings fails both checks: 104 cold columns change
// unreported, at steps 5, 6, 9, 10, 13 and 14; measured.)
TEST_F(ZenFlowTest, ColdChangedReportsEveryStepThatChangesAColdColumn) {
  const int seed = 6;
  for (int64_t lag : {1, 2, 0}) {
    SCOPED_TRACE(absl::StrCat("land_lag ", lag));
    ZenFlowConfig cfg = Config(OffloadMode::kZenFlow, 4, 4, false);
    cfg.land_lag = lag;
    cfg.predict_cold = true;
    std::vector<Tensor> model = MakeModel(seed);
    std::unique_ptr<SessionTarget> session = NewSession(absl::StrCat("cold-changed-", lag));
    auto engine = ZenFlowEngine::Create(cfg, Params(&model), kernels::DefaultCpuKernel(),
                                        kernels::CpuOps(), session.get());
    ASSERT_TRUE(engine.ok()) << engine.status();
    ZenFlowEngine& e = **engine;
    int landed_between = 0;
    for (int64_t t = 1; t <= 16; ++t) {
      FillGrads(&model, t, seed);
      const std::vector<Tensor> before = model;
      ASSERT_TRUE(e.Step(Lr(t)).ok()) << "step " << t;
      const int64_t since = t % 4;  // steps since the last boundary
      const bool boundary = t % 4 == 0;
      const bool lands = t > 4 && lag > 0 && since == lag;
      EXPECT_EQ(e.last_timings().cold_changed, boundary || lands) << "step " << t;
      landed_between += lands && !boundary;
      if (e.last_timings().cold_changed) continue;
      for (size_t i = 0; i < model.size(); ++i) {
        if (!e.Splits(i)) continue;
        auto hot = e.HotColumns(model[i].name);
        ASSERT_TRUE(hot.ok());
        const Tensor& x = model[i];
        for (int64_t c = 0; c < x.cols(); ++c) {
          if (std::binary_search(hot->begin(), hot->end(), c)) continue;
          EXPECT_EQ(ColumnOf(x.value, x.rows(), x.cols(), c),
                    ColumnOf(before[i].value, x.rows(), x.cols(), c))
              << x.name << " cold column " << c << " changed at step " << t;
        }
      }
    }
    EXPECT_EQ(landed_between, lag == 0 ? 0 : 3);
  }
}

// sync-offload and no-offload equal dense AdamW bit for bit (S = 1 by definition).
TEST_F(ZenFlowTest, SyncOffloadAndNoOffloadEqualDenseAdamW) {
  for (OffloadMode mode : {OffloadMode::kSyncOffload, OffloadMode::kNoOffload}) {
    const int seed = 2;
    const ZenFlowConfig cfg = Config(mode, 4, 0, false);
    std::vector<Tensor> model = MakeModel(seed);
    Dense dense(model);
    std::unique_ptr<SessionTarget> session;
    if (mode == OffloadMode::kSyncOffload) session = NewSession("sync");
    auto engine = ZenFlowEngine::Create(cfg, Params(&model), kernels::DefaultCpuKernel(),
                                        kernels::CpuOps(), session.get());
    ASSERT_TRUE(engine.ok()) << engine.status();
    for (int64_t t = 1; t <= 6; ++t) {
      FillGrads(&model, t, seed);
      ASSERT_TRUE((*engine)->Step(Lr(t)).ok());
      dense.Step(t, seed, cfg);
      EXPECT_EQ(mode == OffloadMode::kSyncOffload, (*engine)->last_timings().boundary);
      for (size_t i = 0; i < model.size(); ++i)
        ASSERT_EQ(0, memcmp(model[i].value.data(), dense.ts[i].value.data(),
                            model[i].value.size() * 4))
            << OffloadModeName(mode) << " " << model[i].name << " step " << t;
    }
  }
}

// What a framework front-end needs (the PyTorch optimizer): buffers that move between steps
// (SetBuffers), a parameter without a gradient in a step (skipped, as torch.optim.AdamW skips
// it, wherever its state lives), changed betas / weight decay (SetAdamW), and a zenflow group
// whose parameters all stay on the device (no daemon state at all: it must not touch the
// session).
TEST_F(ZenFlowTest, FrontEndBuffersAbsentGradientsAndDeviceOnlyGroups) {
  const int seed = 4;
  // A device-only zenflow group: a 1-D parameter and a weight too narrow to split.
  {
    std::vector<Tensor> model = {MakeModel(seed)[2], MakeModel(seed)[3]};
    Dense dense(model);
    std::unique_ptr<SessionTarget> session = NewSession("device-only");
    const ZenFlowConfig cfg = Config(OffloadMode::kZenFlow, 4, 0, false);
    auto engine = ZenFlowEngine::Create(cfg, Params(&model), kernels::DefaultCpuKernel(),
                                        kernels::CpuOps(), session.get());
    ASSERT_TRUE(engine.ok()) << engine.status();
    for (int64_t t = 1; t <= 5; ++t) {
      FillGrads(&model, t, seed);
      ASSERT_TRUE((*engine)->Step(Lr(t)).ok()) << "step " << t;
      dense.Step(t, seed, cfg);
      EXPECT_FALSE((*engine)->last_timings().boundary);
      for (size_t i = 0; i < model.size(); ++i)
        ASSERT_EQ(0, memcmp(model[i].value.data(), dense.ts[i].value.data(),
                            model[i].value.size() * 4)) << model[i].name << " step " << t;
    }
    EXPECT_EQ(session->session()->layout().params_size(), 0);  // nothing was registered
    EXPECT_TRUE((*engine)->Checkpoint("unused").ok());
  }
  // Buffers rebound every step to fresh copies; "bias" (on the device) has no gradient in steps
  // 3 and 4, "w1" (split in zenflow, in the daemon in sync-offload) none in steps 4 and 5. Each
  // mode at zero staleness equals AdamW that skips exactly those parameter-steps, bit for bit.
  for (OffloadMode mode :
       {OffloadMode::kNoOffload, OffloadMode::kSyncOffload, OffloadMode::kZenFlow}) {
    SCOPED_TRACE(OffloadModeName(mode));
    std::vector<Tensor> model = MakeModel(seed);
    std::vector<Tensor> ref = model;
    std::vector<std::vector<float>> m(ref.size()), v(ref.size());
    std::vector<int64_t> steps(ref.size(), 0);
    for (size_t i = 0; i < ref.size(); ++i) {
      m[i].assign(ref[i].value.size(), 0.0f);
      v[i].assign(ref[i].value.size(), 0.0f);
    }
    ZenFlowConfig cfg = Config(mode, 1, 1, /*await=*/true);
    std::unique_ptr<SessionTarget> session;
    if (mode != OffloadMode::kNoOffload) session = NewSession("absent");
    auto engine = ZenFlowEngine::Create(cfg, Params(&model), kernels::DefaultCpuKernel(),
                                        kernels::CpuOps(), session.get());
    ASSERT_TRUE(engine.ok()) << engine.status();
    auto absent = [](const std::string& name, int64_t t) {
      return (name == "bias" && (t == 3 || t == 4)) || (name == "w1" && (t == 4 || t == 5));
    };
    for (int64_t t = 1; t <= 7; ++t) {
      if (t == 6) {  // betas and weight decay change from step 6 on
        cfg.beta1 = 0.8;
        cfg.weight_decay = 0.2;
        ASSERT_TRUE((*engine)->SetAdamW(cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay).ok());
      }
      FillGrads(&model, t, seed);
      // Fresh buffers, as PyTorch's zero_grad(set_to_none=True) and a reallocation give.
      std::vector<std::vector<float>> values(model.size()), grads(model.size());
      for (size_t i = 0; i < model.size(); ++i) {
        values[i] = model[i].value;
        grads[i] = model[i].grad;
        ASSERT_TRUE((*engine)->SetBuffers(i, values[i].data(),
                                          absent(model[i].name, t) ? nullptr : grads[i].data())
                        .ok());
      }
      ASSERT_TRUE((*engine)->Step(Lr(t)).ok()) << "step " << t;
      for (size_t i = 0; i < model.size(); ++i) {
        model[i].value = values[i];
        if (absent(ref[i].name, t)) continue;  // skipped: no step, no decay
        const kernels::AdamWConfig a = cfg.AdamW(Lr(t), ++steps[i]);
        kernels::ReferenceKernel().AdamW(a, ref[i].value.data(), m[i].data(), v[i].data(),
                                         model[i].grad.data(), kernels::GradType::kFp32,
                                         static_cast<int64_t>(ref[i].value.size()), nullptr);
      }
      for (size_t i = 0; i < model.size(); ++i)
        ASSERT_EQ(0, memcmp(model[i].value.data(), ref[i].value.data(),
                            model[i].value.size() * 4)) << model[i].name << " step " << t;
    }
    EXPECT_EQ(steps[0], 5);  // w1 took 5 of the 7 steps
    EXPECT_EQ(steps[3], 5);  // bias too
    EXPECT_EQ((*engine)->SetAdamW(1.0, 0.999, 1e-8, 0).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ((*engine)->SetBuffers(9, model[0].value.data(), nullptr).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

// A rank's share of no rows (FSDP2 gives the last ranks none of a parameter with fewer rows in
// dimension 0 than ranks): a split-wide [0, 24] and a [0] parameter among the others, through a
// real daemon, with rounds, reselections (handovers of no rows), a checkpoint and a restore.
// They hold nothing and change nothing: every other parameter ends bit for bit as in the engine
// without them, the empty weight keeps a hot set of its columns (the same size as w1's: its
// scores are zeros, so any), and the daemon neither refuses nor divides by zero (a handover of
// no rows divided by its rows; a 1-D share of no elements by its columns).
TEST_F(ZenFlowTest, SharesOfNoRowsChangeNothing) {
  const int seed = 10;
  ZenFlowConfig cfg = Config(OffloadMode::kZenFlow, 4, 4, false);
  std::vector<std::vector<Tensor>> models;
  for (const bool with_empty : {false, true}) {
    SCOPED_TRACE(with_empty ? "with shares of no rows" : "without");
    std::vector<Tensor> model = MakeModel(seed);
    if (with_empty) {
      model.insert(model.begin() + 1, Tensor{"empty2d", {0, 24}, {}, {}});
      model.push_back(Tensor{"empty1d", {0}, {}, {}});
    }
    std::unique_ptr<SessionTarget> session =
        NewSession(with_empty ? "empty-shares" : "no-empty-shares");
    auto engine = ZenFlowEngine::Create(cfg, Params(&model), kernels::DefaultCpuKernel(),
                                        kernels::CpuOps(), session.get());
    ASSERT_TRUE(engine.ok()) << engine.status();
    for (int64_t t = 1; t <= 10; ++t) {
      FillGrads(&model, t, seed);
      ASSERT_TRUE((*engine)->Step(Lr(t)).ok()) << "step " << t;
    }
    absl::StatusOr<ZenFlowEngine::Snapshot> state = (*engine)->CheckpointBytes();
    ASSERT_TRUE(state.ok()) << state.status();
    std::unique_ptr<SessionTarget> again =
        NewSession(with_empty ? "empty-shares-2" : "no-empty-shares-2");
    auto restored = ZenFlowEngine::Create(cfg, Params(&model), kernels::DefaultCpuKernel(),
                                          kernels::CpuOps(), again.get());
    ASSERT_TRUE(restored.ok()) << restored.status();
    absl::Status back = (*restored)->RestoreBytes(state->engine, state->daemon);
    ASSERT_TRUE(back.ok()) << back;
    for (int64_t t = 11; t <= 14; ++t) {
      FillGrads(&model, t, seed);
      ASSERT_TRUE((*restored)->Step(Lr(t)).ok()) << "step " << t;
    }
    ASSERT_TRUE((*restored)->Flush().ok());
    if (with_empty) {
      EXPECT_TRUE((*restored)->Splits(1));
      auto hot = (*restored)->HotColumns("empty2d");
      ASSERT_TRUE(hot.ok());
      EXPECT_EQ(hot->size(), (*restored)->HotColumns("w1")->size());
      model.erase(model.begin() + 1);
      model.pop_back();
    }
    models.push_back(model);
  }
  for (size_t i = 0; i < models[0].size(); ++i)
    EXPECT_EQ(0, memcmp(models[0][i].value.data(), models[1][i].value.data(),
                        models[0][i].value.size() * 4)) << models[0][i].name;
}

// A backend that checks the device binding: every call it gets from a thread other than the one
// that made it (the caller's, which the front-end binds: torch.cuda.device around each engine
// call) must come after BindDevice on that thread, as CUDA needs (a new thread starts on device
// 0; cudaSetDevice is per thread). It offers a copy stream, so the engine runs its buffered
// transfers on the copy thread through it.
class BindingCheckedMemory : public kernels::BackendMemory {
 public:
  struct Record {
    std::mutex mu;
    std::thread::id owner = std::this_thread::get_id();
    std::set<std::thread::id> bound;
    int64_t off_owner = 0, unbound = 0;
  };
  explicit BindingCheckedMemory(std::shared_ptr<Record> r = std::make_shared<Record>())
      : r_(std::move(r)) {}
  const Record& record() const { return *r_; }

  const char* name() const override { return "binding-checked"; }
  std::string Synchronize() const override { return Check(), base().Synchronize(); }
  std::unique_ptr<BackendMemory> NewCopyStream(std::string*) const override {
    return std::make_unique<BindingCheckedMemory>(r_);
  }
  std::string BindDevice() const override {
    std::lock_guard<std::mutex> lock(r_->mu);
    r_->bound.insert(std::this_thread::get_id());
    return "";
  }
  void* HostView(void* host, std::string* error) const override {
    return Check(), base().HostView(host, error);
  }
  float* AllocFloats(int64_t n) const override { return Check(), base().AllocFloats(n); }
  void Free(void* p) const override { Check(), base().Free(p); }
  void CopyFloats(float* dst, const float* src, int64_t n) const override {
    Check(), base().CopyFloats(dst, src, n);
  }
  void Fill(float* dst, int64_t n, float value) const override {
    Check(), base().Fill(dst, n, value);
  }
  void Upload(float* dst, const float* src, int64_t n) const override {
    Check(), base().Upload(dst, src, n);
  }
  void Download(float* dst, const float* src, int64_t n) const override {
    Check(), base().Download(dst, src, n);
  }
  void Copy2D(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows,
              int64_t cols) const override {
    Check(), base().Copy2D(dst, dst_ld, src, src_ld, rows, cols);
  }

 private:
  static const kernels::BackendMemory& base() { return kernels::CpuMemory(); }
  void Check() const {
    std::lock_guard<std::mutex> lock(r_->mu);
    const std::thread::id me = std::this_thread::get_id();
    if (me == r_->owner) return;
    ++r_->off_owner;
    if (r_->bound.count(me) == 0) ++r_->unbound;
  }
  std::shared_ptr<Record> r_;
};

// The engine's copy thread binds the backend's device before its first use of the backend
// (BackendMemory::BindDevice), on every path: buffered transfers (pushes, prefetches, the
// Update's parameters) over rounds of 4 with reselections, then a Checkpoint and a Flush. Not
// binding (the engine before BindDevice) fails it: the copy thread's calls come unbound.
TEST_F(ZenFlowTest, TheCopyThreadBindsTheBackendsDevice) {
  const int seed = 9;
  ZenFlowConfig cfg = Config(OffloadMode::kZenFlow, 4, 4, false);
  cfg.transfers = Transfers::kBuffered;
  BindingCheckedMemory ops;
  std::vector<Tensor> model = MakeModel(seed);
  std::unique_ptr<SessionTarget> session = NewSession("binding");
  auto engine = ZenFlowEngine::Create(cfg, Params(&model), kernels::DefaultCpuKernel(), ops,
                                      session.get());
  ASSERT_TRUE(engine.ok()) << engine.status();
  for (int64_t t = 1; t <= 10; ++t) {
    FillGrads(&model, t, seed);
    ASSERT_TRUE((*engine)->Step(Lr(t)).ok()) << "step " << t;
  }
  ASSERT_TRUE((*engine)->Checkpoint("binding-ckpt").ok());
  ASSERT_TRUE((*engine)->Flush().ok());
  EXPECT_EQ((*engine)->transfers(), Transfers::kBuffered);
  EXPECT_GT(ops.record().off_owner, 0) << "the copy thread never used the backend";
  EXPECT_EQ(ops.record().unbound, 0) << "of " << ops.record().off_owner;
}

// SetAdamW between Steps while the previous Step's copy-thread tasks (bf16 gradient pushes, a
// round's Update) may still run: the new betas, eps and weight decay apply from the next Step
// on, whatever is in flight. Engine A changes them right after each Step, engine B the same
// values just before the next Step, after its copies have had time to finish; both must end bit
// for bit alike (an in-flight task reading the changed fields, or an Update taking them when it
// runs instead of when it is posted, would differ: measured, an Update that reads beta1 and the
// weight decay when it runs fails it), and under TSan (make test-tsan) the assignment meets no
// task reading it.
TEST_F(ZenFlowTest, SetAdamWWhileCopiesAreInFlight) {
  const int seed = 8;
  ZenFlowConfig cfg = Config(OffloadMode::kZenFlow, 4, 4, false);
  cfg.grad_dtype = DType::kBf16;
  auto hyper = [](int64_t t) {  // the AdamW settings from step t + 1 on
    return std::vector<double>{0.9 - 0.01 * (t % 3), 0.999 - 0.001 * (t % 2),
                               1e-8 * (1 + t % 4), 0.01 * (t % 5)};
  };
  std::vector<std::vector<Tensor>> models;
  for (const bool right_after : {true, false}) {
    SCOPED_TRACE(right_after ? "right after each Step" : "before the next Step");
    std::vector<Tensor> model = MakeModel(seed);
    std::unique_ptr<SessionTarget> session =
        NewSession(right_after ? "adamw-in-flight" : "adamw-settled");
    auto engine = ZenFlowEngine::Create(cfg, Params(&model), kernels::DefaultCpuKernel(),
                                        kernels::CpuOps(), session.get());
    ASSERT_TRUE(engine.ok()) << engine.status();
    for (int64_t t = 1; t <= 12; ++t) {
      FillGrads(&model, t, seed);
      if (!right_after && t > 1) {
        absl::SleepFor(absl::Milliseconds(20));
        const std::vector<double> h = hyper(t - 1);
        ASSERT_TRUE((*engine)->SetAdamW(h[0], h[1], h[2], h[3]).ok());
      }
      ASSERT_TRUE((*engine)->Step(Lr(t)).ok()) << "step " << t;
      if (right_after) {
        const std::vector<double> h = hyper(t);
        ASSERT_TRUE((*engine)->SetAdamW(h[0], h[1], h[2], h[3]).ok());
      }
    }
    ASSERT_TRUE((*engine)->Flush().ok());
    models.push_back(model);
  }
  for (size_t i = 0; i < models[0].size(); ++i)
    EXPECT_EQ(0, memcmp(models[0][i].value.data(), models[1][i].value.data(),
                        models[0][i].value.size() * 4)) << models[0][i].name;
}

// With S = 4 and asynchronous updates the cold columns lag the awaited run by exactly one round:
// after step t they hold what the awaited run held after step B(t) - S, B(t) = the last round
// boundary <= t (the initial values while B(t) - S <= 0). Hot columns do not lag.
TEST_F(ZenFlowTest, ColdColumnsLagByOneRound) {
  const int seed = 3;
  const int64_t S = 4, steps = 14;
  // One selection at step 1 only, so both runs keep the same hot set.
  using HotSets = std::map<std::string, std::vector<int64_t>>;
  auto run = [&](bool await, Transfers how, std::vector<std::vector<Tensor>>* snapshots,
                 std::vector<HotSets>* hot_sets) {
    std::vector<Tensor> model = MakeModel(seed);
    snapshots->push_back(model);  // step 0
    auto session = NewSession(await ? "await" : "async");
    ZenFlowConfig cfg = Config(OffloadMode::kZenFlow, S, 1000 * S, await);
    cfg.transfers = how;
    auto engine = ZenFlowEngine::Create(cfg, Params(&model), kernels::DefaultCpuKernel(),
                                        kernels::CpuOps(), session.get());
    ASSERT_TRUE(engine.ok()) << engine.status();
    for (int64_t t = 1; t <= steps; ++t) {
      FillGrads(&model, t, seed);
      ASSERT_TRUE((*engine)->Step(Lr(t)).ok());
      snapshots->push_back(model);
      HotSets hot;
      for (const Tensor& x : model) hot[x.name] = *(*engine)->HotColumns(x.name);
      hot_sets->push_back(hot);
    }
  };
  for (Transfers how : {Transfers::kDirect, Transfers::kBuffered}) {
  SCOPED_TRACE(TransfersName(how));
  std::vector<std::vector<Tensor>> awaited, async;
  std::vector<HotSets> hot_a, hot_b;
  run(true, how, &awaited, &hot_a);
  run(false, how, &async, &hot_b);
  ASSERT_EQ(hot_a, hot_b);
  int64_t lagging_checks = 0, cold_checks = 0;
  for (int64_t t = 1; t <= steps; ++t) {
    const int64_t b = (t / S) * S;
    const int64_t lagged = std::max<int64_t>(0, b - S);
    for (size_t i = 0; i < async[t].size(); ++i) {
      const Tensor& x = async[t][i];
      const std::vector<int64_t>& hot = hot_a[t - 1].at(x.name);
      for (int64_t c = 0; c < x.cols(); ++c) {
        const auto col = ColumnOf(x.value, x.rows(), x.cols(), c);
        if (std::find(hot.begin(), hot.end(), c) != hot.end()) {
          EXPECT_EQ(col, ColumnOf(awaited[t][i].value, x.rows(), x.cols(), c))
              << x.name << " hot column " << c << " lags at step " << t;
          continue;
        }
        ++cold_checks;
        EXPECT_EQ(col, ColumnOf(awaited[lagged][i].value, x.rows(), x.cols(), c))
            << x.name << " cold column " << c << " after step " << t
            << " is not the awaited run's state after step " << lagged;
        if (col != ColumnOf(awaited[b][i].value, x.rows(), x.cols(), c)) ++lagging_checks;
      }
    }
  }
  EXPECT_GT(cold_checks, 0);
  EXPECT_GT(lagging_checks, 0) << "no step distinguished a lag of one round from none";
  }
}

// Step's split_grad_scale c (how the front-end clips gradients it streamed) equals handing the
// split weights' gradients over multiplied by c in fp32 and the others as they are, bit for bit
// (S = 1: the daemon's accumulation scale 1/S times c is c itself, so the cold columns' sum
// rounds as c g does), through reselections that migrate columns (their step gradient scaled
// too), in both transfer modes, for every parameter after 9 steps; a scale that also reached
// the 1-D and narrow parameters, or missed the cold columns, would differ. Bad scales are
// refused, and in sync-offload (no split weight) any scale but 1.
TEST_F(ZenFlowTest, SplitGradScaleScalesTheSplitWeightsGradients) {
  const int seed = 5;
  const int64_t steps = 9;
  const float c = 0.3f;
  for (Transfers how : {Transfers::kDirect, Transfers::kBuffered}) {
    SCOPED_TRACE(TransfersName(how));
    auto run = [&](bool by_engine) {
      std::vector<Tensor> model = MakeModel(seed);
      auto session = NewSession(by_engine ? "scaled-engine" : "scaled-grads");
      ZenFlowConfig cfg = Config(OffloadMode::kZenFlow, 1, 2, false);
      cfg.transfers = how;
      auto engine = ZenFlowEngine::Create(cfg, Params(&model), kernels::DefaultCpuKernel(),
                                          kernels::CpuOps(), session.get());
      EXPECT_TRUE(engine.ok()) << engine.status();
      for (int64_t t = 1; t <= steps; ++t) {
        FillGrads(&model, t, seed);
        if (!by_engine)
          for (size_t i = 0; i < model.size(); ++i)
            if ((*engine)->Splits(i))
              for (float& g : model[i].grad) g *= c;
        EXPECT_TRUE((*engine)->Step(Lr(t), by_engine ? c : 1.0f).ok());
      }
      EXPECT_TRUE((*engine)->Flush().ok());
      return model;
    };
    const std::vector<Tensor> a = run(true), b = run(false);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].value, b[i].value) << a[i].name;
  }
  std::vector<Tensor> model = MakeModel(seed);
  auto session = NewSession("bad-scale");
  auto engine = ZenFlowEngine::Create(Config(OffloadMode::kZenFlow, 1, 2, false), Params(&model),
                                      kernels::DefaultCpuKernel(), kernels::CpuOps(),
                                      session.get());
  ASSERT_TRUE(engine.ok());
  FillGrads(&model, 1, seed);
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity()})
    EXPECT_EQ((*engine)->Step(Lr(1), bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_TRUE((*engine)->Step(Lr(1), 0.5f).ok());  // still usable
  std::vector<Tensor> dense = MakeModel(seed);
  auto sync_session = NewSession("sync-scale");
  auto sync = ZenFlowEngine::Create(Config(OffloadMode::kSyncOffload, 1, 2, false),
                                    Params(&dense), kernels::DefaultCpuKernel(),
                                    kernels::CpuOps(), sync_session.get());
  ASSERT_TRUE(sync.ok());
  EXPECT_EQ((*sync)->Step(Lr(1), 0.5f).code(), absl::StatusCode::kInvalidArgument);
}

// Stopping after step k (engine Checkpoint + daemon checkpoint), then restoring into a fresh
// session and engine gives the same parameters at every later step as the uninterrupted run, in
// every mode, with an Update still pending at the checkpoint (S = 2, k odd and even) and
// reselections after it.
TEST_F(ZenFlowTest, ResumeFromCheckpointEqualsUninterruptedRun) {
  const int seed = 5;
  const int64_t steps = 11;
  for (auto [mode, how] : {std::pair{OffloadMode::kZenFlow, Transfers::kDirect},
                           std::pair{OffloadMode::kZenFlow, Transfers::kBuffered},
                           std::pair{OffloadMode::kSyncOffload, Transfers::kAuto},
                           std::pair{OffloadMode::kNoOffload, Transfers::kAuto}}) {
    for (int64_t k : {4, 5}) {
      ZenFlowConfig cfg = Config(mode, 2, 4, false);
      cfg.grad_dtype = DType::kBf16;
      cfg.param_dtype = k == 5 ? DType::kBf16 : DType::kFp32;
      cfg.transfers = how;
      const std::string what = absl::StrCat(OffloadModeName(mode), " k=", k, " ",
                                            TransfersName(how));
      auto make = [&](std::vector<Tensor>* model, std::unique_ptr<SessionTarget>* session) {
        if (mode != OffloadMode::kNoOffload) *session = NewSession(what);
        return ZenFlowEngine::Create(cfg, Params(model), kernels::DefaultCpuKernel(),
                                     kernels::CpuOps(), session->get());
      };
      std::vector<std::vector<Tensor>> straight;
      {
        std::vector<Tensor> model = MakeModel(seed);
        std::unique_ptr<SessionTarget> session;
        auto engine = make(&model, &session);
        ASSERT_TRUE(engine.ok()) << engine.status();
        for (int64_t t = 1; t <= steps; ++t) {
          FillGrads(&model, t, seed);
          ASSERT_TRUE((*engine)->Step(Lr(t)).ok());
          straight.push_back(model);
        }
      }
      std::vector<Tensor> model = MakeModel(seed);
      std::string blob;
      const std::string tag = absl::StrCat("resume-", OffloadModeName(mode), "-", k);
      {
        std::unique_ptr<SessionTarget> session;
        auto engine = make(&model, &session);
        ASSERT_TRUE(engine.ok()) << engine.status();
        for (int64_t t = 1; t <= k; ++t) {
          FillGrads(&model, t, seed);
          ASSERT_TRUE((*engine)->Step(Lr(t)).ok());
        }
        auto saved = (*engine)->Checkpoint(tag);
        ASSERT_TRUE(saved.ok()) << what << ": " << saved.status();
        blob = *saved;
      }
      // A new process would reload the model's values from its own checkpoint: here they are
      // still in `model`. Everything else comes from the blob and the daemon.
      std::unique_ptr<SessionTarget> session;
      auto engine = make(&model, &session);
      ASSERT_TRUE(engine.ok()) << engine.status();
      ASSERT_TRUE((*engine)->Restore(tag, blob).ok()) << what;
      EXPECT_EQ((*engine)->step(), k);
      for (int64_t t = k + 1; t <= steps; ++t) {
        FillGrads(&model, t, seed);
        ASSERT_TRUE((*engine)->Step(Lr(t)).ok()) << what << " step " << t;
        for (size_t i = 0; i < model.size(); ++i)
          ASSERT_EQ(model[i].value, straight[t - 1][i].value)
              << what << ": " << model[i].name << " after step " << t;
      }
      // A blob of another mode or a damaged one is refused.
      std::vector<Tensor> other_model = MakeModel(seed);
      std::unique_ptr<SessionTarget> other_session;
      auto other = make(&other_model, &other_session);
      ASSERT_TRUE(other.ok());
      EXPECT_EQ((*other)->Restore(tag, blob.substr(0, blob.size() / 2)).code(),
                absl::StatusCode::kDataLoss);
      // The refusal changed nothing (Restore checks the whole blob first): the same engine then
      // takes the whole blob and continues as the uninterrupted run.
      for (size_t i = 0; i < other_model.size(); ++i)  // the checkpointed values, in place
        std::copy(straight[k - 1][i].value.begin(), straight[k - 1][i].value.end(),
                  other_model[i].value.begin());
      ASSERT_TRUE((*other)->Restore(tag, blob).ok()) << what;
      EXPECT_EQ((*other)->step(), k);
      for (int64_t t = k + 1; t <= steps; ++t) {
        FillGrads(&other_model, t, seed);
        ASSERT_TRUE((*other)->Step(Lr(t)).ok()) << what << " step " << t;
      }
      for (size_t i = 0; i < other_model.size(); ++i)
        ASSERT_EQ(other_model[i].value, straight[steps - 1][i].value)
            << what << ": " << other_model[i].name << " after a refused Restore";
    }
  }
}

// Bad configurations fail with a message naming the field.
TEST_F(ZenFlowTest, BadConfigurationNamesTheField) {
  std::vector<Tensor> model = MakeModel(4);
  auto session = NewSession("bad");
  auto create = [&](const ZenFlowConfig& c, OffloadTarget* s) {
    return ZenFlowEngine::Create(c, Params(&model), kernels::DefaultCpuKernel(),
                                 kernels::CpuOps(), s)
        .status();
  };
  auto expect_field = [](const absl::Status& st, absl::StatusCode code, const std::string& field) {
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_NE(st.message().find(field), std::string::npos) << st;
  };
  ZenFlowConfig c = Config(OffloadMode::kZenFlow, 4, 0, false);
  c.topk_ratio = 0.0;
  expect_field(create(c, session.get()), absl::StatusCode::kInvalidArgument, "topk_ratio");
  c.topk_ratio = 1.5;
  expect_field(create(c, session.get()), absl::StatusCode::kInvalidArgument, "topk_ratio");
  c = Config(OffloadMode::kZenFlow, 4, 6, false);
  expect_field(create(c, session.get()), absl::StatusCode::kInvalidArgument, "select_interval");
  c = Config(OffloadMode::kZenFlow, -1, 0, false);
  expect_field(create(c, session.get()), absl::StatusCode::kInvalidArgument, "update_interval");
  // update_interval 0 (auto): a bound >= 1, land_lag within it, reselection left to it.
  c = Config(OffloadMode::kZenFlow, 0, 0, false);
  c.max_update_interval = 0;
  expect_field(create(c, session.get()), absl::StatusCode::kInvalidArgument,
               "max_update_interval");
  c = Config(OffloadMode::kZenFlow, 0, 8, false);
  expect_field(create(c, session.get()), absl::StatusCode::kInvalidArgument, "select_interval");
  c = Config(OffloadMode::kZenFlow, 0, 0, false);
  c.land_lag = 5;  // max_update_interval 4
  expect_field(create(c, session.get()), absl::StatusCode::kInvalidArgument, "land_lag");
  c = Config(OffloadMode::kZenFlow, 4, 0, false);
  c.warmup_steps = -1;
  expect_field(create(c, session.get()), absl::StatusCode::kInvalidArgument, "warmup_steps");
  for (int64_t lag : {-1, 5}) {  // outside [0, S = 4]
    c = Config(OffloadMode::kZenFlow, 4, 0, false);
    c.land_lag = lag;
    expect_field(create(c, session.get()), absl::StatusCode::kInvalidArgument, "land_lag");
  }
  expect_field(create(Config(OffloadMode::kZenFlow, 4, 0, false), nullptr),
               absl::StatusCode::kInvalidArgument, "session");
  EXPECT_EQ(ParseOffloadMode("fast").status().code(), absl::StatusCode::kInvalidArgument);
  {
    std::vector<EngineParam> ps = Params(&model);
    ps[1].shape = {4, 0, 10};
    expect_field(ZenFlowEngine::Create(Config(OffloadMode::kZenFlow, 4, 0, false), ps,
                                       kernels::DefaultCpuKernel(), kernels::CpuOps(),
                                       session.get())
                     .status(),
                 absl::StatusCode::kInvalidArgument, "params[1].shape[1]");
  }
  // A session whose daemon-side parameters do not match the engine's.
  auto other = NewSession("mismatch");
  ASSERT_TRUE(other->session()->RegisterParams({{"w1", {8, 7}, v1::DTYPE_FP32}}).ok());
  expect_field(create(Config(OffloadMode::kZenFlow, 4, 0, false), other.get()),
               absl::StatusCode::kFailedPrecondition, "'w1'");
}

// The config's one field list (VisitConfigFields) round-trips through text exactly, and a bad
// name or text is refused naming the field: what the Python binding reflects.
TEST(ZenFlowConfigFields, RoundTripAndRefusals) {
  ZenFlowConfig c;
  c.mode = OffloadMode::kSyncOffload;
  c.topk_ratio = 0.1 + 1e-16;  // not a short decimal: the text must carry every bit
  c.update_interval = 3;
  c.max_update_interval = 6;
  c.select_interval = 9;
  c.warmup_steps = 7;
  c.await_updates = true;
  c.land_lag = 2;
  c.beta1 = 0.8;
  c.beta2 = 0.99;
  c.eps = 3e-9;
  c.weight_decay = 0.125;
  c.grad_dtype = DType::kBf16;
  c.param_dtype = DType::kBf16;
  c.transfers = Transfers::kDirect;
  c.stream_gradients = true;
  const std::map<std::string, std::string> text = ConfigFields(c);
  EXPECT_EQ(text.size(), 17u);
  ZenFlowConfig back;
  for (const auto& [name, value] : text)
    ASSERT_TRUE(SetConfigField(&back, name, value).ok()) << name << "=" << value;
  EXPECT_EQ(ConfigFields(back), text);
  EXPECT_EQ(back.topk_ratio, c.topk_ratio);
  EXPECT_EQ(back.eps, c.eps);
  EXPECT_EQ(text.at("mode"), "sync-offload");
  EXPECT_EQ(text.at("await_updates"), "true");
  EXPECT_EQ(text.at("land_lag"), "2");
  EXPECT_EQ(text.at("max_update_interval"), "6");
  auto refused = [&](const std::string& name, const std::string& value) {
    absl::Status st = SetConfigField(&back, name, value);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << name << "=" << value;
    EXPECT_EQ(st.message().rfind(name + ": ", 0), 0u) << st;
  };
  refused("topk", "0.1");
  refused("update_interval", "2.5");
  refused("topk_ratio", "a lot");
  refused("await_updates", "maybe");
  refused("mode", "zero3");
  refused("grad_dtype", "fp16");
  refused("transfers", "fast");
}

// Which saved configurations may resume (the front-end's load_state_dict asks this): the same
// numbers, however they move; a field the saved configuration lacks has the value such states
// ran with, not today's default.
TEST(ZenFlowConfigFields, ResumeConflicts) {
  using Fields = std::map<std::string, std::string>;
  ZenFlowConfig c;
  c.predict_cold = false;
  c.land_lag = 0;
  c.max_update_interval = 4;
  Fields now = ConfigFields(c);
  Fields saved = now;
  auto conflicts = [&](const Fields& s, const Fields& n) {
    absl::StatusOr<ConfigConflicts> out = ResumeConflicts(s, n);
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? *out : ConfigConflicts{};
  };
  EXPECT_TRUE(conflicts(saved, now).empty());
  saved["transfers"] = "direct";  // how the numbers move: any resumes any
  saved["stream_gradients"] = "true";
  now["transfers"] = "buffered";
  EXPECT_TRUE(conflicts(saved, now).empty());
  saved["topk_ratio"] = "0.2";
  saved["weight_decay"] = "0.5";
  EXPECT_EQ(conflicts(saved, now),
            (ConfigConflicts{{"topk_ratio", {"0.2", now.at("topk_ratio")}},
                             {"weight_decay", {"0.5", now.at("weight_decay")}}}));
  saved = now;
  // Written before these fields: they ran as land_lag 0, a bound of 4 and no prediction.
  saved.erase("land_lag");
  saved.erase("max_update_interval");
  saved.erase("predict_cold");
  EXPECT_TRUE(conflicts(saved, now).empty());
  now["predict_cold"] = "true";  // today's default: not what the saved state ran
  now["max_update_interval"] = "8";
  EXPECT_EQ(conflicts(saved, now),
            (ConfigConflicts{{"max_update_interval", {"4", "8"}},
                             {"predict_cold", {"false", "true"}}}));
  // Only the fields the run sets are compared.
  EXPECT_TRUE(conflicts(saved, Fields{{"mode", "zenflow"}}).empty());
  EXPECT_EQ(conflicts(saved, Fields{{"mode", "sync-offload"}}).size(), 1u);
  // A saved field that is not one, or not of its type.
  saved["topk"] = "0.1";
  EXPECT_EQ(ResumeConflicts(saved, now).status().code(), absl::StatusCode::kInvalidArgument);
  saved.erase("topk");
  saved["land_lag"] = "soon";
  EXPECT_EQ(ResumeConflicts(saved, now).status().code(), absl::StatusCode::kInvalidArgument);
}

// A backend that cannot allocate the engine's buffers: RESOURCE_EXHAUSTED naming the bytes,
// not INTERNAL (the CPU backend's allocation of 2 x 2 TiB moments fails; sanitizers abort on
// such a request instead of returning null, so their builds skip it).
// A bad lr is refused naming it, before anything changes: the engine is not failed, and the
// next Step with a good lr takes exactly AdamW's first step (here: w - lr * sign(g) for t = 1,
// eps 0, no decay).
TEST(ZenFlowEngineErrors, BadLrIsRefusedAndTheEngineGoesOn) {
  std::vector<float> w = {1.0f, -2.0f, 3.0f, 0.5f}, g = {0.25f, -1.0f, 2.0f, -0.5f};
  std::vector<EngineParam> ps = {{"b", {4}, w.data(), g.data(), DType::kFp32}};
  ZenFlowConfig c;
  c.mode = OffloadMode::kNoOffload;
  c.eps = 0;
  auto engine = ZenFlowEngine::Create(c, ps, kernels::DefaultCpuKernel(), kernels::CpuOps(),
                                      nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status();
  for (double lr : {-1e-3, std::nan(""), std::numeric_limits<double>::infinity()}) {
    absl::Status st = (*engine)->Step(lr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << lr;
    EXPECT_EQ(st.message().rfind("lr: ", 0), 0u) << st;
  }
  EXPECT_EQ((*engine)->step(), 0);
  ASSERT_TRUE((*engine)->Step(0.125).ok());
  EXPECT_EQ((*engine)->step(), 1);
  const std::vector<float> want = {0.875f, -1.875f, 2.875f, 0.625f};
  EXPECT_EQ(w, want);
}

TEST(ZenFlowEngineErrors, OutOfBackendMemoryIsResourceExhaustedNamingTheBytes) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizer allocators abort on a 2 TiB request";
#endif
  const int64_t rows = int64_t{1} << 20, cols = int64_t{1} << 19;  // 2^39 elements
  float value = 0;
  std::vector<EngineParam> ps = {{"w", {rows, cols}, &value, nullptr, DType::kFp32}};
  ZenFlowConfig c;
  c.mode = OffloadMode::kNoOffload;
  auto engine = ZenFlowEngine::Create(c, ps, kernels::DefaultCpuKernel(), kernels::CpuOps(),
                                      nullptr);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kResourceExhausted) << engine.status();
  const std::string bytes = absl::StrCat(2 * 4 * rows * cols);  // m and v
  EXPECT_NE(engine.status().message().find(bytes + " bytes (2 buffers)"), std::string::npos)
      << engine.status();
}

}  // namespace
}  // namespace engine_test
}  // namespace stallfree
