// The daemon's accumulator between updates, against the reference kernels: after an Update it
// is logically zero (the next whole-slot push overwrites it instead of a clearing pass), so a
// partial push, an Update with no push, and a checkpoint taken right after an Update must all
// behave as if it had been cleared.
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "client/client.h"
#include "common/bf16.h"
#include "kernels/optimizer.h"
#include "testing/daemon_process.h"
#include "testing/hyper.h"

namespace stallfree {
namespace {

using testing::Daemon;
constexpr int64_t kN = 4 * 8;

v1::AdamWHyper Hyper() { return testing::TestHyper(0.01); }

// The daemon's arithmetic on the host: master, moments, and the accumulator it should hold.
struct Model {
  std::vector<float> p, m, v, acc;
  Model() : p(kN), m(kN, 0.0f), v(kN, 0.0f), acc(kN, 0.0f) {
    for (int64_t i = 0; i < kN; ++i) p[i] = 0.1f * static_cast<float>(i) - 1.0f;
  }
  void Add(const std::vector<float>& g, int64_t first, int64_t count) {
    kernels::ReferenceKernel().Accumulate(acc.data() + first, g.data() + first,
                                          kernels::GradType::kFp32, 1.0f, count);
  }
  void Update(int64_t step) {
    kernels::AdamWConfig c;
    c.lr = 1e-2;
    c.weight_decay = 0.01;
    c.step = step;
    kernels::ReferenceKernel().AdamW(c, p.data(), m.data(), v.data(), acc.data(),
                                     kernels::GradType::kFp32, kN, nullptr);
    std::fill(acc.begin(), acc.end(), 0.0f);
  }
};

std::vector<float> Grad(int seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> g(kN);
  for (float& x : g) x = normal(rng);
  return g;
}

class AccumulatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<Daemon>(std::vector<std::string>{"--threads", "2"}, "warning");
    auto c = Client::Connect(daemon_->socket());
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
  }
  std::unique_ptr<Session> Open(const Model& model) {
    auto s = client_->OpenSession("acc", 0);
    EXPECT_TRUE(s.ok());
    EXPECT_TRUE((*s)->RegisterParams({{"w", {4, 8}, v1::DTYPE_FP32}}).ok());
    memcpy((*s)->StagingFp32("w"), model.p.data(), kN * 4);
    EXPECT_TRUE((*s)->LoadParams().ok());
    return std::move(*s);
  }
  // Whole-slot push of g.
  void PushAll(Session* s, int64_t step, const std::vector<float>& g) {
    memcpy(s->GradSlot(0, "w"), g.data(), kN * 4);
    ASSERT_TRUE(s->Push(step, 0).ok());
  }
  // Push of elements [first, first + count) of g only.
  void PushRange(Session* s, int64_t step, const std::vector<float>& g, int64_t first,
                 int64_t count) {
    memcpy(s->GradSlot(1, "w"), g.data(), kN * 4);
    v1::PushGradientsRequest req;
    req.set_step(step);
    req.set_slot(1);
    v1::GradRange* r = req.add_ranges();
    r->set_param("w");
    r->set_offset(first * 4);
    r->set_length(count * 4);
    r->set_first_element(first);
    ASSERT_TRUE(s->Push(req).ok());
  }
  void UpdateAndCheck(Session* s, Model* model, int64_t step) {
    ASSERT_TRUE(s->Update(step, Hyper(), step % 2).ok());
    auto ready = s->WaitUpdate(step);
    ASSERT_TRUE(ready.ok()) << ready.status();
    model->Update(step);
    const float* w = s->ParamsFp32(ready->param_slot(), "w");
    ASSERT_EQ(0, memcmp(w, model->p.data(), kN * 4)) << "after the update of step " << step;
  }

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<Client> client_;
};

TEST_F(AccumulatorTest, PushesAfterAnUpdateStartFromZero) {
  Model model;
  auto s = Open(model);
  // Two whole pushes: the first after LoadParams, the second adds.
  PushAll(s.get(), 1, Grad(1));
  model.Add(Grad(1), 0, kN);
  PushAll(s.get(), 1, Grad(2));
  model.Add(Grad(2), 0, kN);
  UpdateAndCheck(s.get(), &model, 1);
  // A partial push right after an Update: the elements it does not cover have zero gradient.
  PushRange(s.get(), 2, Grad(3), 5, 9);
  model.Add(Grad(3), 5, 9);
  UpdateAndCheck(s.get(), &model, 2);
  // An Update with no push at all: a zero gradient (moments decay, weight decay applies).
  UpdateAndCheck(s.get(), &model, 3);
  // A whole push then a partial one in the same round.
  PushAll(s.get(), 4, Grad(4));
  model.Add(Grad(4), 0, kN);
  PushRange(s.get(), 4, Grad(5), 20, 7);
  model.Add(Grad(5), 20, 7);
  UpdateAndCheck(s.get(), &model, 4);
}

TEST_F(AccumulatorTest, CheckpointRightAfterAnUpdateHoldsAZeroAccumulator) {
  Model model;
  auto a = Open(model);
  PushAll(a.get(), 1, Grad(7));
  model.Add(Grad(7), 0, kN);
  UpdateAndCheck(a.get(), &model, 1);
  auto saved = a->Checkpoint("after-update");
  ASSERT_TRUE(saved.ok()) << saved.status();
  // Restored into a fresh session, a partial push must add to zeros.
  Model fresh;
  auto b = Open(fresh);
  ASSERT_TRUE(b->Restore("after-update").ok());
  PushRange(b.get(), 2, Grad(8), 3, 11);
  model.Add(Grad(8), 3, 11);
  UpdateAndCheck(b.get(), &model, 2);
}

// The fused push (UpdateRequest.fuse_push): one session pushes and then updates, the other
// folds the round's last push into the Update; parameters (fp32 and bf16 out, fp32 and bf16
// gradients) must agree bit for bit, in rounds with and without earlier pushes, after a round
// with no push at all (the stale accumulator) and after a partial push.
TEST_F(AccumulatorTest, FusedPushUpdateEqualsPushThenUpdate) {
  const std::vector<ParamSpec> specs = {{"w", {4, 8}, v1::DTYPE_FP32},
                                        {"e", {3, 5, 7}, v1::DTYPE_BF16}};
  auto open = [&](const char* name) {
    auto s = client_->OpenSession(name, 0);
    EXPECT_TRUE(s.ok());
    EXPECT_TRUE((*s)->RegisterParams(specs).ok());
    for (int64_t i = 0; i < kN; ++i) (*s)->StagingFp32("w")[i] = 0.1f * i - 1.0f;
    for (int64_t i = 0; i < 105; ++i) (*s)->StagingFp32("e")[i] = 0.05f * i - 2.0f;
    EXPECT_TRUE((*s)->LoadParams().ok());
    return std::move(*s);
  };
  auto plain = open("plain"), fused = open("fused");
  // Writes gradient `seed` into `slot` of both sessions.
  auto write = [&](uint32_t slot, int seed) {
    std::vector<float> g = Grad(seed), e(105);
    std::mt19937 rng(seed + 1000);
    std::normal_distribution<float> normal;
    for (float& x : e) x = normal(rng);
    for (Session* s : {plain.get(), fused.get()}) {
      memcpy(s->GradSlot(slot, "w"), g.data(), kN * 4);
      uint16_t* eb = static_cast<uint16_t*>(s->GradSlot(slot, "e"));
      for (int64_t i = 0; i < 105; ++i) eb[i] = FloatToBf16(e[i]);
    }
  };
  auto push_both = [&](int64_t step, uint32_t slot, float scale) {
    ASSERT_TRUE(plain->Push(step, slot, scale).ok());
    ASSERT_TRUE(fused->Push(step, slot, scale).ok());
  };
  int64_t step = 0;
  // One boundary: the last push of the round (slot, scale) fused or not.
  auto boundary = [&](uint32_t slot, float scale, v1::DType out) {
    ++step;
    ASSERT_TRUE(plain->Push(step, slot, scale).ok());
    ASSERT_TRUE(plain->Update(step, Hyper(), step % 2, out, /*column_steps=*/true).ok());
    ASSERT_TRUE(fused->UpdateWithPush(step, Hyper(), step % 2, out, slot, scale).ok());
    auto a = plain->WaitUpdate(step);
    auto b = fused->WaitUpdate(step);
    ASSERT_TRUE(a.ok() && b.ok());
    const size_t esize = out == v1::DTYPE_BF16 ? 2 : 4;
    for (const char* name : {"w", "e"}) {
      const int64_t n = std::string(name) == "w" ? kN : 105;
      const void* pa = out == v1::DTYPE_BF16
                           ? static_cast<const void*>(plain->ParamsBf16(a->param_slot(), name))
                           : static_cast<const void*>(plain->ParamsFp32(a->param_slot(), name));
      const void* pb = out == v1::DTYPE_BF16
                           ? static_cast<const void*>(fused->ParamsBf16(b->param_slot(), name))
                           : static_cast<const void*>(fused->ParamsFp32(b->param_slot(), name));
      ASSERT_EQ(0, memcmp(pa, pb, n * esize)) << name << " after the update of step " << step;
    }
  };
  // The first round right after LoadParams: the fused push alone.
  write(0, 1);
  boundary(0, 0.5f, v1::DTYPE_FP32);
  // Earlier pushes in the round, then the fused one.
  write(1, 2);
  push_both(step + 1, 1, 0.25f);
  write(0, 3);
  push_both(step + 1, 0, 0.25f);
  write(1, 4);
  boundary(1, 0.25f, v1::DTYPE_BF16);
  // Nothing pushed since the last Update (the accumulator is stale): the fused push alone.
  write(0, 5);
  boundary(0, 1.0f, v1::DTYPE_FP32);
  // A partial push, then the fused one.
  write(1, 6);
  {
    ++step;
    for (Session* s : {plain.get(), fused.get()}) {
      v1::PushGradientsRequest req;
      req.set_step(step);
      req.set_slot(1);
      v1::GradRange* r = req.add_ranges();
      r->set_param("w");
      r->set_offset(4 * 4);
      r->set_length(9 * 4);
      r->set_first_element(4);
      ASSERT_TRUE(s->Push(req).ok());
    }
    --step;
  }
  write(0, 7);
  boundary(0, 0.5f, v1::DTYPE_BF16);
  // A round with one push (the plain session's pushes counted as the fused session's).
  write(1, 8);
  boundary(1, 0.0f, v1::DTYPE_FP32);  // 0 means 1

  auto sessions = client_->ListSessions();
  ASSERT_TRUE(sessions.ok());
  int64_t pushes[2] = {-1, -1};
  for (const v1::SessionInfo& info : *sessions) {
    if (info.name() == "plain") pushes[0] = info.pushes();
    if (info.name() == "fused") pushes[1] = info.pushes();
  }
  EXPECT_EQ(pushes[0], pushes[1]);
  EXPECT_EQ(pushes[0], 8);

  // Refused: fuse_push without column_steps, and a slot that does not exist.
  v1::UpdateRequest req;
  req.set_step(step + 1);
  *req.mutable_hyper() = Hyper();
  req.set_fuse_push(true);
  EXPECT_EQ(fused->Update(req).code(), absl::StatusCode::kInvalidArgument);
  req.set_column_steps(true);
  req.set_fused_grad_slot(2);
  EXPECT_EQ(fused->Update(req).code(), absl::StatusCode::kInvalidArgument);
  // Neither refusal took the step.
  EXPECT_TRUE(fused->UpdateWithPush(step + 1, Hyper(), 0, v1::DTYPE_FP32, 0).ok());
  EXPECT_TRUE(fused->WaitUpdate(step + 1).ok());
}

// UpdateRequest.skip_params: the skipped parameter's master, moments and column steps stay as
// they were (the next Update continues as if the skipped one had never touched it), its values
// still go out in the parameter slot, and the other parameter is updated as usual.
TEST_F(AccumulatorTest, SkippedParametersAreLeftUnchanged) {
  const std::vector<ParamSpec> specs = {{"w", {4, 8}, v1::DTYPE_FP32},
                                        {"e", {3, 8}, v1::DTYPE_FP32}};
  auto open = [&](const char* name) {
    auto s = client_->OpenSession(name, 0);
    EXPECT_TRUE(s.ok());
    EXPECT_TRUE((*s)->RegisterParams(specs).ok());
    for (int64_t i = 0; i < kN; ++i) (*s)->StagingFp32("w")[i] = 0.1f * i - 1.0f;
    for (int64_t i = 0; i < 24; ++i) (*s)->StagingFp32("e")[i] = 0.05f * i - 2.0f;
    EXPECT_TRUE((*s)->LoadParams().ok());
    return std::move(*s);
  };
  // "skip" skips e in its step 2; "ref" never sees that step for e: e's update of step 2 in
  // "skip" must equal e's second update in "ref", which takes the same gradients.
  auto skip = open("skip"), ref = open("ref");
  auto write = [&](Session* s, int seed) {
    std::vector<float> g = Grad(seed);
    memcpy(s->GradSlot(0, "w"), g.data(), kN * 4);
    for (int64_t i = 0; i < 24; ++i) static_cast<float*>(s->GradSlot(0, "e"))[i] = g[i] * 0.5f;
  };
  auto update = [&](Session* s, int64_t step, std::vector<std::string> skipped) {
    EXPECT_TRUE(s->UpdateWithPush(step, Hyper(), step % 2, v1::DTYPE_BF16, 0, 1.0f, skipped)
                    .ok());
    auto r = s->WaitUpdate(step);
    EXPECT_TRUE(r.ok());
    return r->param_slot();
  };
  write(skip.get(), 1);
  update(skip.get(), 1, {});
  const std::vector<uint16_t> e1(skip->ParamsBf16(1, "e"), skip->ParamsBf16(1, "e") + 24);
  write(skip.get(), 2);
  const uint32_t slot2 = update(skip.get(), 2, {"e"});
  // e unchanged (its values written out again), w stepped.
  EXPECT_EQ(std::vector<uint16_t>(skip->ParamsBf16(slot2, "e"), skip->ParamsBf16(slot2, "e") + 24),
            e1);
  EXPECT_NE(std::vector<uint16_t>(skip->ParamsBf16(slot2, "w"), skip->ParamsBf16(slot2, "w") + kN),
            std::vector<uint16_t>(skip->ParamsBf16(1, "w"), skip->ParamsBf16(1, "w") + kN));
  write(skip.get(), 3);
  const uint32_t slot3 = update(skip.get(), 3, {});
  // In "ref", e's steps are gradients 1 and 3 (and w is skipped in its step 2 instead, so its
  // column steps match too: both parameters had two steps).
  write(ref.get(), 1);
  update(ref.get(), 1, {});
  write(ref.get(), 3);
  const uint32_t ref_slot = update(ref.get(), 2, {"w"});
  EXPECT_EQ(std::vector<uint16_t>(skip->ParamsBf16(slot3, "e"), skip->ParamsBf16(slot3, "e") + 24),
            std::vector<uint16_t>(ref->ParamsBf16(ref_slot, "e"), ref->ParamsBf16(ref_slot, "e") + 24));

  // Refused: an unknown name, a name twice, skip_params without column_steps.
  v1::UpdateRequest req;
  req.set_step(10);
  *req.mutable_hyper() = Hyper();
  req.set_column_steps(true);
  req.add_skip_params("nope");
  EXPECT_EQ(skip->Update(req).code(), absl::StatusCode::kInvalidArgument);
  req.clear_skip_params();
  req.add_skip_params("w");
  req.add_skip_params("w");
  EXPECT_EQ(skip->Update(req).code(), absl::StatusCode::kInvalidArgument);
  req.clear_skip_params();
  req.add_skip_params("w");
  req.set_column_steps(false);
  EXPECT_EQ(skip->Update(req).code(), absl::StatusCode::kInvalidArgument);
}

// UpdateRequest.predict: the parameter slot gets (p_new + p_new) - p_old, p_old each value
// before the Update, in fp32 and (rounded) in bf16, while the state is the plain session's (its
// next Update without predict gives the plain session's values); a skipped parameter goes out
// as it is; without column_steps it is refused.
TEST_F(AccumulatorTest, PredictedParametersAreOneUpdateAhead) {
  const std::vector<ParamSpec> specs = {{"w", {4, 8}, v1::DTYPE_FP32},
                                        {"e", {3, 8}, v1::DTYPE_FP32}};
  std::vector<float> p0w(kN), p0e(24);
  for (int64_t i = 0; i < kN; ++i) p0w[i] = 0.1f * i - 1.0f;
  for (int64_t i = 0; i < 24; ++i) p0e[i] = 0.05f * i - 2.0f;
  auto open = [&](const char* name) {
    auto s = client_->OpenSession(name, 0);
    EXPECT_TRUE(s.ok());
    EXPECT_TRUE((*s)->RegisterParams(specs).ok());
    memcpy((*s)->StagingFp32("w"), p0w.data(), kN * 4);
    memcpy((*s)->StagingFp32("e"), p0e.data(), 24 * 4);
    EXPECT_TRUE((*s)->LoadParams().ok());
    return std::move(*s);
  };
  auto plain = open("plain"), pred = open("pred");
  auto write = [&](int seed) {
    std::vector<float> g = Grad(seed);
    for (Session* s : {plain.get(), pred.get()}) {
      memcpy(s->GradSlot(0, "w"), g.data(), kN * 4);
      for (int64_t i = 0; i < 24; ++i) static_cast<float*>(s->GradSlot(0, "e"))[i] = g[i];
    }
  };
  auto update = [&](Session* s, int64_t step, v1::DType out, bool predict,
                    std::vector<std::string> skipped) {
    EXPECT_TRUE(
        s->UpdateWithPush(step, Hyper(), 0, out, 0, 1.0f, skipped, predict).ok());
    EXPECT_TRUE(s->WaitUpdate(step).ok());
  };
  auto fp32 = [](Session* s, const char* name, int64_t n) {
    return std::vector<float>(s->ParamsFp32(0, name), s->ParamsFp32(0, name) + n);
  };
  // Step 1, fp32 out: 2 p1 - p0.
  write(1);
  update(plain.get(), 1, v1::DTYPE_FP32, false, {});
  update(pred.get(), 1, v1::DTYPE_FP32, true, {});
  const std::vector<float> p1w = fp32(plain.get(), "w", kN), p1e = fp32(plain.get(), "e", 24);
  const std::vector<float> q1w = fp32(pred.get(), "w", kN);
  for (int64_t i = 0; i < kN; ++i)
    ASSERT_EQ(q1w[i], (p1w[i] + p1w[i]) - p0w[i]) << "w[" << i << "] after step 1";
  EXPECT_NE(q1w, p1w);
  // Step 2, bf16 out, e skipped: w rounded from 2 p2 - p1; e as it is.
  write(2);
  update(plain.get(), 2, v1::DTYPE_FP32, false, {"e"});
  update(pred.get(), 2, v1::DTYPE_BF16, true, {"e"});
  const std::vector<float> p2w = fp32(plain.get(), "w", kN);
  for (int64_t i = 0; i < kN; ++i)
    ASSERT_EQ(pred->ParamsBf16(0, "w")[i], FloatToBf16((p2w[i] + p2w[i]) - p1w[i]))
        << "w[" << i << "] after step 2";
  for (int64_t i = 0; i < 24; ++i)
    ASSERT_EQ(pred->ParamsBf16(0, "e")[i], FloatToBf16(p1e[i])) << "e[" << i << "]";
  // Step 3 without predict: the same state, so the plain session's values.
  write(3);
  update(plain.get(), 3, v1::DTYPE_FP32, false, {});
  update(pred.get(), 3, v1::DTYPE_FP32, false, {});
  EXPECT_EQ(fp32(pred.get(), "w", kN), fp32(plain.get(), "w", kN));
  EXPECT_EQ(fp32(pred.get(), "e", 24), fp32(plain.get(), "e", 24));
  // Refused without column_steps.
  v1::UpdateRequest req;
  req.set_step(4);
  *req.mutable_hyper() = Hyper();
  req.set_predict(true);
  EXPECT_EQ(pred->Update(req).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace stallfree
