// OffloadSession in process, without the daemon: the accumulator's states (a partial push after
// an Update adds to zeros, a whole-slot push overwrites the stale sums, the fused push reads them
// or not), column migration through the staging area, and a checkpoint written by one session
// and restored into another. The work methods are called directly (nothing is posted to the
// strand); expected values come from plain loops below, never from the session.
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include "common/bf16.h"
#include "common/region.h"
#include "common/state_format.h"
#include "server/offload_session.h"
#include "server/requests.h"

namespace stallfree {
namespace {

using Code = absl::StatusCode;

constexpr double kLr = 1e-2, kB1 = 0.9, kB2 = 0.999, kEps = 1e-8, kWd = 0.01;

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  v1::DType dtype;
};

// One AdamW step of one element, as offload.proto specifies it (fp32, bias corrections in double).
void AdamWStep(int64_t t, float g, float* p, float* m, float* v) {
  *p = *p * (1.0f - static_cast<float>(kLr * kWd));
  *m = static_cast<float>(kB1) * *m + static_cast<float>(1.0 - kB1) * g;
  *v = static_cast<float>(kB2) * *v + static_cast<float>(1.0 - kB2) * g * g;
  const float step_size = static_cast<float>(kLr / (1.0 - std::pow(kB1, static_cast<double>(t))));
  const float bc2 = static_cast<float>(std::sqrt(1.0 - std::pow(kB2, static_cast<double>(t))));
  *p = *p - step_size * *m / (std::sqrt(*v) / bc2 + static_cast<float>(kEps));
}

// The expected state over the flat fp32 arrays (padding included: it stays zero).
struct Model {
  std::vector<float> p, m, v, acc;
  explicit Model(size_t n) : p(n, 0.0f), m(n, 0.0f), v(n, 0.0f), acc(n, 0.0f) {}
  // A step on every element with gradient acc + push_scale * push (push may be empty), at step
  // steps[i] of element i (or t for all); then the accumulator is zero.
  void Step(int64_t t, const std::vector<float>& push = {}, float push_scale = 1.0f,
            const std::vector<int64_t>& steps = {}) {
    for (size_t i = 0; i < p.size(); ++i) {
      const float g = push.empty() ? acc[i] : acc[i] + push_scale * push[i];
      AdamWStep(steps.empty() ? t : steps[i], g, &p[i], &m[i], &v[i]);
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
  }
};

std::vector<float> Normal(size_t n, int seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> out(n);
  for (float& x : out) x = normal(rng);
  return out;
}

void ExpectNear(const std::vector<float>& want, const float* got, const std::string& what) {
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 2e-6f + 2e-5f * std::fabs(want[i])) << what << " [" << i << "]";
}

// A checkpoint file's arrays, flat as in the session (element offsets of `layout`).
struct FileState {
  StateHeader header;
  std::vector<float> master, m, v, acc;
};

FileState ReadFile(const std::string& path, const SessionLayout& layout) {
  FileState f;
  uint64_t bytes = 0;
  absl::StatusOr<StateHeader> header = ReadCheckpointHeader(path, &bytes);
  EXPECT_TRUE(header.ok()) << header.status();
  f.header = *header;
  const size_t n = layout.total_elems;
  f.master.assign(n, 0.0f);
  f.m.assign(n, 0.0f);
  f.v.assign(n, 0.0f);
  f.acc.assign(n, 0.0f);
  std::vector<CheckpointArrays> arrays;
  for (const ParamLayout& p : layout.params) {
    const uint64_t e = p.elem_offset;
    arrays.push_back({&f.master[e], &f.m[e], &f.v[e], &f.acc[e], p.numel});
  }
  EXPECT_TRUE(ReadCheckpointArrays(path, f.header, arrays).ok());
  return f;
}

class OffloadSessionTest : public ::testing::Test {
 protected:
  // A registered session and the test's own mapping of its region (as a trainer has).
  struct Registered {
    std::shared_ptr<OffloadSession> s;
    const SessionLayout* layout;
    std::unique_ptr<MappedRegion> region;

    const ParamLayout& param(const std::string& name) const {
      return layout->params[layout->Find(name)];
    }
    uint64_t GradOffset(uint32_t slot) const {
      return layout->region.grad_slot_offset() + slot * layout->region.grad_slot_bytes();
    }
    uint8_t* Grad(uint32_t slot, const std::string& name) const {
      return region->data() + GradOffset(slot) + param(name).grad_offset;
    }
    // The start of the staging area (where a migration's blocks go), and where a parameter's
    // values go for a whole load (its element offset).
    float* Staging() const {
      return reinterpret_cast<float*>(region->data() + layout->region.staging_offset());
    }
    float* Staging(const std::string& name) const { return Staging() + param(name).elem_offset; }
    const float* ParamSlot(uint32_t slot) const {
      return reinterpret_cast<const float*>(region->data() + layout->region.param_slot_offset() +
                                            slot * layout->region.param_slot_bytes());
    }
    // Gradient g (flat, element offsets) written as each parameter's dtype into `slot`.
    void WriteGrad(uint32_t slot, const std::vector<float>& g) const {
      for (const ParamLayout& p : layout->params) {
        uint8_t* dst = Grad(slot, p.name);
        for (int64_t i = 0; i < p.numel; ++i) {
          const float x = g[p.elem_offset + i];
          if (p.grad_dtype == v1::DTYPE_BF16)
            reinterpret_cast<uint16_t*>(dst)[i] = FloatToBf16(x);
          else
            reinterpret_cast<float*>(dst)[i] = x;
        }
      }
    }
    // The whole-slot push of `slot`, as PushGradients with no ranges builds it.
    int64_t PushAll(uint32_t slot, float scale) const {
      std::vector<AccumulateJob> jobs;
      uint64_t bytes = 0;
      for (const ParamLayout& p : layout->params) {
        jobs.push_back({p.elem_offset, nullptr, GradOffset(slot) + p.grad_offset, p.grad_type(),
                        p.numel});
        bytes += p.numel * p.grad_element_bytes();
      }
      return s->Accumulate({jobs, /*whole=*/true, scale, bytes});
    }
    // Elements [first, first + count) of fp32 parameter `name` from `slot`.
    int64_t PushRange(uint32_t slot, const std::string& name, int64_t first, int64_t count) const {
      const ParamLayout& p = param(name);
      AccumulateJob job{p.elem_offset + first, nullptr,
                        GradOffset(slot) + p.grad_offset + first * 4, p.grad_type(), count};
      return s->Accumulate({{job}, /*whole=*/false, 1.0f, static_cast<uint64_t>(count) * 4});
    }
  };

  void SetUp() override {
    char tmpl[] = "/tmp/stallfree-session-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    if (system(("rm -rf " + dir_).c_str()) != 0) perror("rm");
  }

  Registered Register(uint64_t id, const std::vector<Spec>& specs) {
    Registered r;
    r.s = std::make_shared<OffloadSession>(
        id, "token", "test", 0, getpid(),
        OffloadSession::Env{&arena_, &budget_, &counters_, PinPolicy::kOff});
    v1::RegisterParamsRequest req;
    for (const Spec& spec : specs) {
      v1::ParamSpec* p = req.add_params();
      p->set_name(spec.name);
      for (int64_t d : spec.shape) p->add_shape(d);
      p->set_grad_dtype(spec.dtype);
    }
    absl::StatusOr<SessionLayout> layout = LayOutParams(req);
    EXPECT_TRUE(layout.ok()) << layout.status();
    EXPECT_TRUE(r.s->BeginRegister(layout->pinned_bytes()).ok());
    EXPECT_TRUE(r.s->Allocate(*std::move(layout)).ok());
    r.layout = r.s->layout();
    EXPECT_NE(r.layout, nullptr);
    absl::StatusOr<SessionFds> fd = r.s->Attach(getuid(), getpid());
    EXPECT_TRUE(fd.ok()) << fd.status();
    auto region = MappedRegion::MapFd(dup(fd->region_fd), fd->region_bytes);
    EXPECT_TRUE(region.ok()) << region.status();
    r.region = *std::move(region);
    return r;
  }

  // Loads model.p into every parameter (through the staging area).
  static void Load(const Registered& r, const Model& model) {
    v1::LoadParamsRequest req;  // every parameter whole, from its element offset
    absl::StatusOr<std::vector<LoadJob>> all = PlanLoad(req, *r.layout);
    ASSERT_TRUE(all.ok()) << all.status();
    for (const ParamLayout& p : r.layout->params)
      memcpy(r.Staging(p.name), &model.p[p.elem_offset], p.numel * 4);
    r.s->LoadParams(*all);
  }

  static UpdatePlan Plan(const Registered& r, int64_t step, bool column_steps,
                         uint32_t param_slot = 0) {
    UpdatePlan plan;
    plan.config.lr = kLr;
    plan.config.beta1 = kB1;
    plan.config.beta2 = kB2;
    plan.config.eps = kEps;
    plan.config.weight_decay = kWd;
    plan.config.step = step;
    plan.param_slot = param_slot;
    plan.column_steps = column_steps;
    plan.skip.assign(r.layout->params.size(), 0);
    return plan;
  }

  // A column-step Update fused with the whole-slot push of grad_slot at push_scale.
  static UpdatePlan FusedPlan(const Registered& r, int64_t step, uint32_t grad_slot,
                              float push_scale, uint32_t param_slot = 0) {
    UpdatePlan plan = Plan(r, step, true, param_slot);
    plan.fuse_push = true;
    plan.grad_slot = grad_slot;
    plan.push_scale = push_scale;
    return plan;
  }

  static void Update(const Registered& r, const UpdatePlan& plan) {
    ASSERT_TRUE(r.s->BeginUpdate(plan.config.step).ok());
    r.s->Update(plan);
  }

  FileState Snapshot(const Registered& r, const std::string& name, int64_t* version = nullptr) {
    const std::string path = dir_ + "/" + name + ".sfckpt";
    int64_t v = 0;
    absl::StatusOr<CheckpointWritten> out = r.s->Snapshot(path, getuid(), &v);
    EXPECT_TRUE(out.ok()) << out.status();
    if (version != nullptr) *version = v;
    return ReadFile(path, *r.layout);
  }

  tbb::task_arena arena_{2};
  DaemonCounters counters_;
  PinnedBudget budget_{0};
  std::string dir_;
};

// LayOutParams: elements at multiples of 16, gradient bytes by dtype, slots page-aligned.
TEST_F(OffloadSessionTest, LayoutPadsParametersAndPagesSlots) {
  Registered r = Register(1, {{"w", {4, 8}, v1::DTYPE_FP32}, {"b", {5}, v1::DTYPE_BF16},
                              {"c", {3}, v1::DTYPE_FP32}});
  EXPECT_EQ(r.param("w").elem_offset, 0u);
  EXPECT_EQ(r.param("b").elem_offset, 32u);
  EXPECT_EQ(r.param("c").elem_offset, 48u);
  EXPECT_EQ(r.param("b").grad_offset, 128u);
  EXPECT_EQ(r.param("c").grad_offset, 128u + 32u);
  EXPECT_EQ(r.layout->total_elems, 64u);
  EXPECT_EQ(r.layout->region.grad_slot_bytes(), 4096u);
  EXPECT_EQ(r.layout->region.region_bytes(), 5u * 4096u);
  // The session record's page, then the state's four arrays 272 elements apart (64 elements,
  // padded to 272 more than a multiple of 1024: StateStride staggers them within a page).
  EXPECT_EQ(r.layout->state_stride, 272u);
  EXPECT_EQ(r.layout->arrays_offset, 4096u);
  // Then, from the next page, the work journal (session_journal.h): its header (32 bytes), its
  // entry (16 + a plan room of 256 + 32 x (2 x 3 + 64) = 2496, + an 8-byte checksum), 2 slot
  // headers and 1 bitmap word, to 64 bytes: 2624; and 2 slots of 3 units of 256 elements.
  EXPECT_EQ(r.layout->journal_offset, 3u * 4096u);
  EXPECT_EQ(r.layout->state_bytes, 3u * 4096u + 2624u + 2u * 3u * 256u * 4u);
  EXPECT_EQ(counters_.pinned_bytes.load(), 5u * 4096u + r.layout->state_bytes);
  r.s->Release();
  EXPECT_EQ(counters_.pinned_bytes.load(), 0u);
  EXPECT_EQ(r.s->BeginRegister(1).code(), Code::kFailedPrecondition);
}

TEST_F(OffloadSessionTest, AccumulatorIsLogicallyZeroAfterEveryUpdate) {
  Registered r = Register(1, {{"w", {4, 8}, v1::DTYPE_FP32}, {"b", {8}, v1::DTYPE_FP32}});
  const size_t n = r.layout->total_elems;  // 48: w at 0, b at 32, 8 of padding
  ASSERT_EQ(n, 48u);
  Model model(n);
  for (int i = 0; i < 32; ++i) model.p[i] = 0.1f * i - 1.0f;
  for (int i = 0; i < 8; ++i) model.p[32 + i] = 0.5f - 0.05f * i;
  Load(r, model);
  auto in_params = [](size_t i) { return i < 40; };
  // A whole-slot gradient as the parameters see it (the padding is never pushed).
  auto on_params = [&](const std::vector<float>& g) {
    std::vector<float> out(g.size(), 0.0f);
    for (size_t i = 0; i < g.size(); ++i)
      if (in_params(i)) out[i] = g[i];
    return out;
  };

  // Two pushes in a round: the whole slot (scaled), then part of w.
  const std::vector<float> g1 = Normal(n, 1), g2 = Normal(n, 2);
  r.WriteGrad(0, g1);
  EXPECT_EQ(r.PushAll(0, 0.5f), 1);
  for (size_t i = 0; i < n; ++i)
    if (in_params(i)) model.acc[i] += 0.5f * g1[i];
  r.WriteGrad(1, g2);
  EXPECT_EQ(r.PushRange(1, "w", 5, 9), 2);
  for (size_t i = 5; i < 14; ++i) model.acc[i] += g2[i];
  EXPECT_EQ(Snapshot(r, "a").acc, model.acc);

  Update(r, Plan(r, 1, false));
  model.Step(1);
  ExpectNear(model.p, r.ParamSlot(0), "params after step 1");

  // A partial push right after an Update adds to zeros, not to the stale sums.
  const std::vector<float> g3 = Normal(n, 3);
  r.WriteGrad(0, g3);
  EXPECT_EQ(r.PushRange(0, "b", 2, 4), 1);
  for (size_t i = 34; i < 38; ++i) model.acc[i] += g3[i];
  EXPECT_EQ(Snapshot(r, "b").acc, model.acc);

  Update(r, Plan(r, 2, false, 1));
  model.Step(2);
  ExpectNear(model.p, r.ParamSlot(1), "params after step 2");

  // A whole-slot push after an Update overwrites the stale sums (b[2..6) held g3).
  const std::vector<float> g4 = Normal(n, 4);
  r.WriteGrad(1, g4);
  EXPECT_EQ(r.PushAll(1, 1.0f), 1);
  for (size_t i = 0; i < n; ++i)
    if (in_params(i)) model.acc[i] = g4[i];
  EXPECT_EQ(Snapshot(r, "c").acc, model.acc);

  // Step 3 consumes g4; step 4 has no push at all: a zero gradient, not g4 again.
  Update(r, Plan(r, 3, false));
  model.Step(3);
  Update(r, Plan(r, 4, false, 1));
  model.Step(4);
  ExpectNear(model.p, r.ParamSlot(1), "params after step 4");
  // A checkpoint right after an Update holds a zero accumulator.
  FileState after4 = Snapshot(r, "d");
  EXPECT_EQ(after4.acc, std::vector<float>(n, 0.0f));
  ExpectNear(model.m, after4.m.data(), "m after step 4");
  ExpectNear(model.v, after4.v.data(), "v after step 4");

  // The fused push after a partial push: the sums and the fused slot's gradient, scaled.
  const std::vector<float> g5 = Normal(n, 5), g6 = Normal(n, 6);
  r.WriteGrad(1, g5);
  r.PushRange(1, "w", 0, 4);
  for (size_t i = 0; i < 4; ++i) model.acc[i] += g5[i];
  r.WriteGrad(0, g6);
  UpdatePlan fused = FusedPlan(r, 5, 0, 0.25f);
  Update(r, fused);
  model.Step(5, on_params(g6), 0.25f);
  ExpectNear(model.p, r.ParamSlot(0), "params after the fused step 5");

  // The fused push with nothing pushed since the Update: the stale sums (g5) are not read.
  const std::vector<float> g7 = Normal(n, 7);
  r.WriteGrad(1, g7);
  fused = FusedPlan(r, 6, 1, 2.0f, 1);
  Update(r, fused);
  model.Step(6, on_params(g7), 2.0f);
  ExpectNear(model.p, r.ParamSlot(1), "params after the fused step 6");
  EXPECT_EQ(Snapshot(r, "e").acc, std::vector<float>(n, 0.0f));

  v1::SessionInfo info = r.s->Info();
  EXPECT_EQ(info.pushes(), 7);  // five pushes and two fused ones
  EXPECT_EQ(info.updates(), 6);
  EXPECT_EQ(info.version(), 6);
}

// A handover in the middle of a round: the outgoing columns' state from before the round's
// Update and their accumulated gradient go out; the round's fused Update steps every other
// column (fused push included) and leaves the incoming ones exactly as they arrived, in the
// state, their step counts and the bf16 parameter slot.
TEST_F(OffloadSessionTest, HandOverMidRoundHandsTheRoundOutAndKeepsTheIncomingColumns) {
  Registered r = Register(1, {{"w", {4, 9}, v1::DTYPE_FP32}});
  const size_t n = r.layout->total_elems;
  const int64_t rows = 4, cols = 9;
  Model model(n);
  for (int i = 0; i < 36; ++i) model.p[i] = 0.02f * i - 0.3f;
  Load(r, model);
  auto grad = [&](int seed) {
    std::vector<float> g = Normal(n, seed);
    std::fill(g.begin() + 36, g.end(), 0.0f);
    return g;
  };
  // Round 1 (steps 1-2): a push of g1, then the fused Update with g2.
  const std::vector<float> g1 = grad(21), g2 = grad(22), g3 = grad(23), g4 = grad(24);
  r.WriteGrad(0, g1);
  r.PushAll(0, 0.5f);
  r.WriteGrad(1, g2);
  UpdatePlan fused = FusedPlan(r, 2, 1, 0.5f);
  Update(r, fused);
  for (size_t i = 0; i < n; ++i) model.acc[i] = 0.5f * g1[i];
  model.Step(1, g2, 0.5f);
  // Round 2: a push of g3, then a handover of columns 6 and 1 before the round's Update.
  r.WriteGrad(0, g3);
  r.PushAll(0, 0.5f);
  for (size_t i = 0; i < n; ++i) model.acc[i] = 0.5f * g3[i];
  const std::vector<int64_t> columns = {6, 1};
  const int64_t k = 2;
  float* staging = r.Staging();
  std::vector<float> incoming(3 * rows * k);
  for (size_t i = 0; i < incoming.size(); ++i) incoming[i] = 0.5f - 0.0625f * static_cast<float>(i);
  memcpy(staging, incoming.data(), incoming.size() * 4);
  std::vector<MigrateResult> got = r.s->HandOver({MigratePlan{0, columns, {9, 4}, 0}});
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].steps, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(got[0].pushes, 1);
  // Out: value, m, v after round 1, and the round's accumulated gradient (0.5 * g3).
  const std::vector<float>* out[4] = {&model.p, &model.m, &model.v, &model.acc};
  for (int a = 0; a < 4; ++a)
    for (int64_t row = 0; row < rows; ++row)
      for (int64_t j = 0; j < k; ++j) {
        const float want = (*out[a])[row * cols + columns[j]];
        ASSERT_NEAR(staging[a * rows * k + row * k + j], want, 2e-6f + 2e-5f * std::fabs(want))
            << "block " << a << " row " << row << " column " << columns[j];
      }
  int64_t version = 0;
  absl::StatusOr<CheckpointWritten> refused =
      r.s->Snapshot(dir_ + "/refused.sfckpt", getuid(), &version);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition)
      << "a checkpoint between a handover and the round's Update must be refused";
  // The round's fused Update (g4, bf16 out): every other column steps at step 2; columns 6 and
  // 1 hold what arrived.
  r.WriteGrad(1, g4);
  fused = FusedPlan(r, 4, 1, 0.5f, 1);
  fused.out = v1::DTYPE_BF16;
  Update(r, fused);
  std::vector<int64_t> elem_steps(n, 2);
  model.Step(4, g4, 0.5f, elem_steps);
  std::vector<float>* state[3] = {&model.p, &model.m, &model.v};
  for (int a = 0; a < 3; ++a)
    for (int64_t row = 0; row < rows; ++row)
      for (int64_t j = 0; j < k; ++j)
        (*state[a])[row * cols + columns[j]] = incoming[a * rows * k + row * k + j];
  FileState f = Snapshot(r, "after");
  for (size_t i = 0; i < 36; ++i) {
    const bool moved = i % cols == 6 || i % cols == 1;
    if (moved) {
      EXPECT_EQ(f.master[i], model.p[i]) << i;
      EXPECT_EQ(f.m[i], model.m[i]) << i;
      EXPECT_EQ(f.v[i], model.v[i]) << i;
    } else {
      ASSERT_NEAR(f.master[i], model.p[i], 2e-6f + 2e-5f * std::fabs(model.p[i])) << i;
    }
    const uint16_t* slot = reinterpret_cast<const uint16_t*>(r.ParamSlot(1));
    EXPECT_EQ(slot[i], FloatToBf16(f.master[i])) << "bf16 parameter " << i;
  }
  EXPECT_EQ(f.header.params[0].col_steps, (std::vector<int64_t>{2, 4, 2, 2, 2, 2, 9, 2, 2}));
}

TEST_F(OffloadSessionTest, SnapshotRestoresIntoAnotherSessionExactly) {
  const std::vector<Spec> specs = {{"w", {4, 8}, v1::DTYPE_FP32},
                                        {"b", {8}, v1::DTYPE_BF16}};
  Registered a = Register(1, specs);
  const size_t n = a.layout->total_elems;
  Model model(n);
  for (int i = 0; i < 40; ++i) model.p[i] = 0.03f * i - 0.6f;
  Load(a, model);
  std::vector<float> g1 = Normal(n, 21);
  for (size_t i = 32; i < n; ++i) g1[i] = i < 40 ? Bf16ToFloat(FloatToBf16(g1[i])) : 0.0f;
  a.WriteGrad(0, g1);
  a.PushAll(0, 1.0f);
  model.acc = g1;
  Update(a, Plan(a, 1, true, 1));
  model.Step(1);
  // A round in progress: the accumulator holds part of w's next gradient.
  const std::vector<float> g2 = Normal(n, 22);
  a.WriteGrad(0, g2);
  a.PushRange(0, "w", 3, 11);
  for (size_t i = 3; i < 14; ++i) model.acc[i] += g2[i];

  int64_t version = 0;
  FileState saved = Snapshot(a, "saved", &version);
  EXPECT_EQ(version, 1);
  EXPECT_EQ(saved.header.version, 1);
  EXPECT_EQ(saved.header.last_step, 1);
  EXPECT_EQ(saved.header.owner_uid, getuid());
  EXPECT_EQ(saved.acc, model.acc);
  ExpectNear(model.p, saved.master.data(), "saved master");
  ExpectNear(model.m, saved.m.data(), "saved m");
  ExpectNear(model.v, saved.v.data(), "saved v");

  Registered b = Register(2, specs);
  Load(b, Model(n));
  const std::string path = dir_ + "/saved.sfckpt";
  uint64_t bytes = 0;
  // Someone else's checkpoint is refused and changes nothing.
  ASSERT_TRUE(b.s->BeginRestore().ok());
  EXPECT_EQ(b.s->Restore(path, getuid() + 1, "saved", v1::DTYPE_FP32, &bytes).status().code(),
            Code::kPermissionDenied);
  EXPECT_EQ(b.s->Info().version(), 0);
  ASSERT_TRUE(b.s->BeginRestore().ok());
  EXPECT_EQ(b.s->BeginRestore().code(), Code::kAborted);
  absl::StatusOr<StateHeader> restored =
      b.s->Restore(path, getuid(), "saved", v1::DTYPE_FP32, &bytes);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->version, 1);
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(bytes, static_cast<uint64_t>(st.st_size));
  EXPECT_EQ(b.s->Info().version(), 1);
  EXPECT_EQ(b.s->CheckLoadable().code(), Code::kFailedPrecondition);
  // Parameter slot 0 holds the restored master.
  for (const ParamLayout& p : b.layout->params)
    for (int64_t i = 0; i < p.numel; ++i)
      ASSERT_EQ(b.ParamSlot(0)[p.elem_offset + i], saved.master[p.elem_offset + i]);

  // B's own checkpoint is A's, array for array and step for step.
  FileState again = Snapshot(b, "again");
  EXPECT_EQ(again.master, saved.master);
  EXPECT_EQ(again.m, saved.m);
  EXPECT_EQ(again.v, saved.v);
  EXPECT_EQ(again.acc, saved.acc);
  EXPECT_TRUE(again.header.params == saved.header.params);

  // Both go on with the restored sums (w's partial push) to the expected step 2.
  for (const Registered* r : {&a, &b}) Update(*r, Plan(*r, 2, true));
  model.Step(2);
  ExpectNear(model.p, a.ParamSlot(0), "A after step 2");
  EXPECT_EQ(0, memcmp(a.ParamSlot(0), b.ParamSlot(0), n * 4));

  // A session with other parameters cannot take the checkpoint.
  Registered c = Register(3, {{"w", {4, 8}, v1::DTYPE_FP32}});
  ASSERT_TRUE(c.s->BeginRestore().ok());
  EXPECT_EQ(c.s->Restore(path, getuid(), "saved", v1::DTYPE_FP32, &bytes).status().code(),
            Code::kFailedPrecondition);
}

}  // namespace
}  // namespace stallfree
