// The ZenFlow engine tests' shared model, gradients and schedule, and their fixture (zenflow_test,
// fp32 parameters; zenflow_bf16_test, bf16 ones): a small model of seeded normal values, synthetic
// gradients with a band of "important" columns (10x the magnitude) that moves every step, so the
// top-k selection moves columns in and out of the hot set and the engine migrates their state
// through the daemon; the engine configuration and learning rate the tests step with; a real
// stallfreed process per test, and sessions on it.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "client/client.h"
#include "client/session_target.h"
#include "common/bf16.h"
#include "engine/zenflow.h"
#include "testing/daemon_process.h"

namespace stallfree {
namespace engine_test {

// A parameter of a test model: T is float (fp32 parameters) or uint16_t (bf16 bits).
template <typename T>
struct ModelTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<T> value, grad;
  int64_t numel() const { return static_cast<int64_t>(value.size()); }
  int64_t cols() const { return shape.back(); }
  int64_t rows() const { return numel() / cols(); }
};
using Tensor = ModelTensor<float>;
using Tensor16 = ModelTensor<uint16_t>;

// x as a T: itself, or its bf16 rounding (to nearest even).
template <typename T>
T Stored(float x);
template <>
inline float Stored<float>(float x) {
  return x;
}
template <>
inline uint16_t Stored<uint16_t>(float x) {
  return FloatToBf16(x);
}

// Standard-normal values (the stream of `seed`, tensor after tensor; as T) and zero gradients.
template <typename T>
void Initialise(std::vector<ModelTensor<T>>* ts, int seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (ModelTensor<T>& t : *ts) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    t.value.resize(n);
    t.grad.assign(n, T{0});
    for (T& x : t.value) x = Stored<T>(normal(rng));
  }
}

// A small model: two split weights (one 3-D), a weight too narrow to split (15 elements: odd,
// so a sync-offload run of bf16 parameters moves its last element through the engine's tail), a
// 1-D parameter.
template <typename T>
std::vector<ModelTensor<T>> SmallModel(int seed) {
  std::vector<ModelTensor<T>> ts = {{"w1", {8, 24}, {}, {}},
                                    {"w2", {4, 3, 10}, {}, {}},
                                    {"narrow", {5, 3}, {}, {}},
                                    {"bias", {24}, {}, {}}};
  Initialise(&ts, seed);
  return ts;
}

// The gradients of step t (as T): noise, with columns [3t, 3t + 6) mod cols ten times larger
// (the band moves, so reselections migrate columns).
template <typename T>
void FillGrads(std::vector<ModelTensor<T>>* ts, int64_t t, int seed) {
  std::mt19937 rng(seed * 1000003 + static_cast<int>(t));
  std::normal_distribution<float> normal;
  for (ModelTensor<T>& x : *ts) {
    const int64_t cols = x.cols();
    for (int64_t i = 0; i < static_cast<int64_t>(x.grad.size()); ++i) {
      const int64_t c = i % cols;
      const bool band = ((c - 3 * t) % cols + cols) % cols < 6;
      x.grad[i] = Stored<T>(normal(rng) * (band ? 10.0f : 1.0f));
    }
  }
}

// The tests' engine: top-k 0.25, S = `S`, a reselection every `select` steps, updates awaited
// or not, weight decay 0.05, no engine warm-up, fp32 transfers (ZenFlowConfig's defaults),
// rounds landed as computed (predict_cold off).
inline ZenFlowConfig Config(OffloadMode mode, int64_t S, int64_t select, bool await) {
  ZenFlowConfig c;
  c.mode = mode;
  c.topk_ratio = 0.25;
  c.update_interval = S;
  c.select_interval = select;
  c.await_updates = await;
  c.weight_decay = 0.05;
  c.warmup_steps = 0;  // the tests that want the engine warm-up set it
  // Rounds land as the daemon computed them (the tests state the staleness by the masters);
  // the prediction is tests/python/test_zenflow_reference.py's and the tests that set it.
  c.predict_cold = false;
  return c;
}

// The learning rate of step t.
inline double Lr(int64_t t) { return 1e-2 / (1.0 + 0.1 * t); }

// Column c of a [rows, cols] row-major x.
inline std::vector<float> ColumnOf(const std::vector<float>& x, int64_t rows, int64_t cols,
                                   int64_t c) {
  std::vector<float> out(rows);
  for (int64_t r = 0; r < rows; ++r) out[r] = x[r * cols + c];
  return out;
}

// A session whose daemon reports every Update as taking `seconds` (the figure the automatic
// round reads, engine/schedule.h; everything else is the real daemon's), so that the length it
// chooses does not depend on this machine's timing.
class ReportedPace : public SessionTarget {
 public:
  ReportedPace(std::unique_ptr<Session> session, double seconds)
      : SessionTarget(std::move(session)), seconds_(seconds) {}
  UpdateSeen LastUpdate() const override {
    UpdateSeen u = SessionTarget::LastUpdate();
    if (u.version > 0) u.seconds = seconds_;
    return u;
  }

 private:
  double seconds_;
};

// A stallfreed (2 threads) for each test, a client of it, and sessions on it.
class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<testing::Daemon>(std::vector<std::string>{"--threads", "2"},
                                                "info");
    auto client = Client::Connect(daemon_->socket());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }
  std::unique_ptr<SessionTarget> NewSession(const std::string& name) {
    auto s = client_->OpenSession(name, 0);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::make_unique<SessionTarget>(std::move(*s)) : nullptr;
  }
  std::unique_ptr<SessionTarget> NewPacedSession(const std::string& name, double update_s) {
    auto s = client_->OpenSession(name, 0);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::make_unique<ReportedPace>(std::move(*s), update_s) : nullptr;
  }
  std::unique_ptr<testing::Daemon> daemon_;
  std::unique_ptr<Client> client_;
};

}  // namespace engine_test
}  // namespace stallfree
