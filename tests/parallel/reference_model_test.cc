// The single-rank reference model (parallel/reference_block.h, parallel/zigzag.h):
// - zigzag partition: the documented layout, every position exactly once, equal causal work per
//   rank, scatter / gather round trip bit-exact, InvalidArgument on bad shapes;
// - the block reproduces PyTorch's block_seed1 / block_seed2 (y and every gradient), and
//   accumulates its weight gradients;
// - the block and the model in zigzag token order with matching positions give the natural
//   order's outputs and gradients after un-permuting;
// - the model's options (learned positions, tied head): tensor lists, initialization order,
//   argument checks;
// - a 2-layer model's gradients against central finite differences of its loss, every element,
//   with and without learned positions and a tied head.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/ops.h"
#include "parallel/reference_block.h"
#include "parallel/zigzag.h"
#include "tests/kernels/testdata.h"

namespace stallfree {
namespace parallel {
namespace {

using kernels::CpuOps;

// ---------------------------------------------------------------------------------------------
// Zigzag.

TEST(Zigzag, DocumentedLayout) {
  // T = 8, D = 2: chunks of 2; rank 0 owns chunks 0 and 3, rank 1 chunks 1 and 2.
  absl::StatusOr<std::vector<int32_t>> r0 = ZigzagPositions(8, 2, 0);
  absl::StatusOr<std::vector<int32_t>> r1 = ZigzagPositions(8, 2, 1);
  ASSERT_TRUE(r0.ok()) << r0.status();
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(*r0, (std::vector<int32_t>{0, 1, 6, 7}));
  EXPECT_EQ(*r1, (std::vector<int32_t>{2, 3, 4, 5}));
  absl::StatusOr<std::vector<int32_t>> order = ZigzagOrder(8, 2);
  ASSERT_TRUE(order.ok()) << order.status();
  EXPECT_EQ(*order, (std::vector<int32_t>{0, 1, 6, 7, 2, 3, 4, 5}));
  absl::StatusOr<std::vector<int32_t>> one = ZigzagPositions(6, 1, 0);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));  // D = 1 is the identity.
}

TEST(Zigzag, CoversEveryPositionOnceWithEqualCausalWork) {
  for (int64_t D = 1; D <= 8; ++D) {
    for (int64_t k : {1, 2, 3, 7}) {
      const int64_t T = 2 * D * k;
      std::vector<int> seen(T, 0);
      int64_t work0 = -1;
      for (int64_t p = 0; p < D; ++p) {
        absl::StatusOr<std::vector<int32_t>> pos = ZigzagPositions(T, D, p);
        ASSERT_TRUE(pos.ok()) << pos.status();
        ASSERT_EQ(static_cast<int64_t>(pos->size()), T / D);
        int64_t work = 0;
        for (int32_t q : *pos) {
          ASSERT_GE(q, 0);
          ASSERT_LT(q, T);
          ++seen[q];
          work += q + 1;  // Keys a causal query at q attends to.
        }
        if (p == 0) work0 = work;
        EXPECT_EQ(work, work0) << "T=" << T << " D=" << D << " rank " << p;
      }
      for (int64_t t = 0; t < T; ++t) ASSERT_EQ(seen[t], 1) << "T=" << T << " D=" << D;
    }
  }
}

TEST(Zigzag, ScatterGatherRoundTripIsExact) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (int64_t D : {1, 2, 3, 4}) {
    const int64_t B = 3, T = 4 * D, C = 5, tl = T / D;
    std::vector<float> full(B * T * C);
    for (float& v : full) v = normal(rng);
    std::vector<std::vector<float>> locals(D, std::vector<float>(B * tl * C));
    std::vector<const float*> ptrs;
    for (int64_t p = 0; p < D; ++p) {
      ASSERT_TRUE(ZigzagScatter(full.data(), B, T, C, D, p, locals[p].data()).ok());
      const std::vector<int32_t> pos = *ZigzagPositions(T, D, p);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t i = 0; i < tl; ++i) {
          ASSERT_EQ(0, std::memcmp(&locals[p][(b * tl + i) * C], &full[(b * T + pos[i]) * C],
                                   C * sizeof(float)))
              << "D=" << D << " rank " << p << " b " << b << " local " << i;
        }
      }
      ptrs.push_back(locals[p].data());
    }
    std::vector<float> back(B * T * C, -1.0f);
    ASSERT_TRUE(ZigzagGather(ptrs, B, T, C, back.data()).ok());
    EXPECT_EQ(0, std::memcmp(back.data(), full.data(), full.size() * sizeof(float)));
    std::vector<float> back2(B * T * C, -1.0f);
    for (int64_t p = 0; p < D; ++p) {
      ASSERT_TRUE(ZigzagGatherRank(locals[p].data(), B, T, C, D, p, back2.data()).ok());
    }
    EXPECT_EQ(0, std::memcmp(back2.data(), full.data(), full.size() * sizeof(float)));
  }
}

TEST(Zigzag, RejectsBadShapes) {
  std::vector<float> buf(64);
  EXPECT_EQ(ZigzagPositions(10, 2, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ZigzagPositions(0, 2, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ZigzagPositions(8, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ZigzagPositions(8, 2, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ZigzagPositions(8, 2, -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ZigzagOrder(12, 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ZigzagScatter(buf.data(), 1, 6, 2, 2, 0, buf.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ZigzagScatter(buf.data(), 0, 8, 2, 2, 0, buf.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ZigzagGatherRank(buf.data(), 1, 8, 2, 2, 3, buf.data()).code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<const float*> with_null = {buf.data(), nullptr};
  EXPECT_EQ(ZigzagGather(with_null, 1, 8, 2, buf.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ZigzagGather({}, 1, 8, 2, buf.data()).code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// The block against PyTorch (the same data and tolerance as tests/kernels/block_test.cc).

double ManifestNumber(const std::string& json, const std::string& key) {
  const std::string tag = "\"" + key + "\":";
  const size_t at = json.find(tag);
  if (at == std::string::npos) return -1;
  return std::stod(json.substr(at + tag.size()));
}

struct TorchBlockData {
  int64_t B = 0, T = 0;
  BlockConfig cfg;
  BlockWeights w;
  std::vector<float> x, dy, y, grad_x;
  BlockGrads grads;  // torch's grad_<name> for every weight.
};

void LoadTorchBlock(const std::string& dir, TorchBlockData* d) {
  std::ifstream mf(dir + "manifest.json");
  ASSERT_TRUE(mf.good()) << "missing " << dir << "manifest.json";
  std::stringstream ss;
  ss << mf.rdbuf();
  const std::string json = ss.str();
  d->B = static_cast<int64_t>(ManifestNumber(json, "B"));
  d->T = static_cast<int64_t>(ManifestNumber(json, "T"));
  d->cfg.C = static_cast<int64_t>(ManifestNumber(json, "C"));
  d->cfg.H = static_cast<int64_t>(ManifestNumber(json, "H"));
  d->cfg.FF = static_cast<int64_t>(ManifestNumber(json, "FF"));
  d->cfg.eps = static_cast<float>(ManifestNumber(json, "rmsnorm_eps"));
  ASSERT_TRUE(ValidateBlockConfig(d->cfg).ok()) << "unreadable shapes in " << dir;
  ASSERT_GT(d->B, 0);
  ASSERT_GT(d->T, 0);
  const size_t btc = static_cast<size_t>(d->B * d->T * d->cfg.C);
  struct File {
    std::string name;
    std::vector<float>* dst;
    size_t size;
  };
  std::vector<File> files = {
      {"x", &d->x, btc}, {"dy", &d->dy, btc}, {"y", &d->y, btc}, {"grad_x", &d->grad_x, btc}};
  const BlockWeights zeros = BlockWeights::Zeros(d->cfg);
  const std::vector<std::vector<float>*> w = d->w.Tensors(), g = d->grads.Tensors();
  const std::vector<const std::vector<float>*> z = zeros.Tensors();
  for (size_t i = 0; i < w.size(); ++i) {
    const std::string name = BlockTensorNames()[i];
    files.push_back({name, w[i], z[i]->size()});
    files.push_back({"grad_" + name, g[i], z[i]->size()});
  }
  for (const File& f : files) {
    const std::string path = dir + f.name + ".f32";
    *f.dst = testing::LoadF32(path);
    ASSERT_EQ(f.dst->size(), f.size) << path << " (missing or wrong size)";
  }
}

// Every element within rel_tol of the reference tensor's largest magnitude; the worst ratio is
// recorded in test.xml as <what>_max_err_rel.
void ExpectTensorNear(const std::vector<float>& got, const std::vector<float>& want, double rel_tol,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0, worst = 0;
  for (float w : want) scale = std::max(scale, static_cast<double>(std::fabs(w)));
  ASSERT_GT(scale, 0.0) << what << " reference is all zero";
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
    ASSERT_NEAR(got[i], want[i], rel_tol * scale) << what << " element " << i;
  }
  std::ostringstream rel;
  rel << worst / scale;
  ::testing::Test::RecordProperty(what + "_max_err_rel", rel.str());
}

// fp32 against torch's fp32 with a different operation order, as block_test: 2e-5 of the
// reference's largest magnitude (measured worst: under 1e-6).
constexpr double kTorchRelTol = 2e-5;

class TorchBlock : public ::testing::TestWithParam<const char*> {};

TEST_P(TorchBlock, ReproducesForwardAndEveryGradient) {
  TorchBlockData d;
  ASSERT_NO_FATAL_FAILURE(
      LoadTorchBlock(std::string("tests/testdata/torch/") + GetParam() + "/", &d));
  const ReferenceBlock block(d.cfg);
  std::vector<int32_t> pos(d.T);
  std::iota(pos.begin(), pos.end(), 0);
  std::vector<float> y(d.x.size()), dx(d.x.size());
  BlockCache cache;
  ASSERT_TRUE(
      block.Forward(CpuOps(), d.w, d.x.data(), pos.data(), d.B, d.T, y.data(), &cache).ok());
  BlockGrads grads;  // Empty: sized and zeroed by Backward.
  ASSERT_TRUE(block.Backward(CpuOps(), d.w, cache, d.dy.data(), dx.data(), &grads).ok());
  ExpectTensorNear(y, d.y, kTorchRelTol, "y");
  ExpectTensorNear(dx, d.grad_x, kTorchRelTol, "grad_x");
  const std::vector<std::vector<float>*> got = grads.Tensors(), want = d.grads.Tensors();
  for (size_t i = 0; i < got.size(); ++i) {
    ExpectTensorNear(*got[i], *want[i], kTorchRelTol, std::string("grad_") + BlockTensorNames()[i]);
  }

  // Weight gradients accumulate: a second backward doubles them; dx is overwritten.
  ASSERT_TRUE(block.Backward(CpuOps(), d.w, cache, d.dy.data(), dx.data(), &grads).ok());
  ExpectTensorNear(dx, d.grad_x, kTorchRelTol, "grad_x_again");
  for (size_t i = 0; i < got.size(); ++i) {
    std::vector<float> twice = *want[i];
    for (float& v : twice) v *= 2;
    ExpectTensorNear(*got[i], twice, kTorchRelTol, std::string("grad2_") + BlockTensorNames()[i]);
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, TorchBlock, ::testing::Values("block_seed1", "block_seed2"));

TEST(ReferenceBlock, RejectsBadShapes) {
  const BlockConfig cfg{8, 2, 16, 1e-5f};
  const ReferenceBlock block(cfg);
  BlockWeights w = BlockWeights::Zeros(cfg);
  std::vector<float> x(2 * 4 * 8), y(x.size());
  const std::vector<int32_t> pos = {0, 1, 2, 3};
  EXPECT_TRUE(block.Forward(CpuOps(), w, x.data(), pos.data(), 2, 4, y.data(), nullptr).ok());
  EXPECT_EQ(block.Forward(CpuOps(), w, x.data(), pos.data(), 0, 4, y.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReferenceBlock(BlockConfig{8, 3, 16, 1e-5f})
                .Forward(CpuOps(), w, x.data(), pos.data(), 2, 4, y.data(), nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
  BlockCache cache;
  ASSERT_TRUE(block.Forward(CpuOps(), w, x.data(), pos.data(), 2, 4, y.data(), &cache).ok());
  BlockGrads wrong;
  wrong.wq.resize(3);  // Neither empty nor [C, C].
  EXPECT_EQ(block.Backward(CpuOps(), w, cache, y.data(), x.data(), &wrong).code(),
            absl::StatusCode::kInvalidArgument);
  w.wd.pop_back();
  EXPECT_EQ(block.Forward(CpuOps(), w, x.data(), pos.data(), 2, 4, y.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// Zigzag token order with global positions against the natural order.

// Reorders the tokens of each batch row: out[b, i] = in[b, order[i]] (forward) or
// out[b, order[i]] = in[b, i] (inverse); rows of width C.
template <typename V>
std::vector<V> Permute(const std::vector<V>& in, const std::vector<int32_t>& order, int64_t B,
                       int64_t C, bool inverse) {
  const int64_t T = static_cast<int64_t>(order.size());
  std::vector<V> out(in.size());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < T; ++i) {
      const int64_t src = inverse ? i : order[i], dst = inverse ? order[i] : i;
      std::copy_n(&in[(b * T + src) * C], C, &out[(b * T + dst) * C]);
    }
  }
  return out;
}

// Only the order of fp32 sums changes (softmax over keys, weight-gradient sums over tokens):
// 1e-5 of each tensor's largest magnitude (measured worst: about 1e-7).
constexpr double kPermutedRelTol = 1e-5;

TEST(ReferenceBlock, ZigzagOrderMatchesNaturalOrder) {
  TorchBlockData d;
  ASSERT_NO_FATAL_FAILURE(LoadTorchBlock("tests/testdata/torch/block_seed1/", &d));
  const ReferenceBlock block(d.cfg);
  const int64_t C = d.cfg.C;
  std::vector<int32_t> natural(d.T);
  std::iota(natural.begin(), natural.end(), 0);
  std::vector<float> y(d.x.size()), dx(d.x.size());
  BlockCache cache;
  BlockGrads grads;
  ASSERT_TRUE(
      block.Forward(CpuOps(), d.w, d.x.data(), natural.data(), d.B, d.T, y.data(), &cache).ok());
  ASSERT_TRUE(block.Backward(CpuOps(), d.w, cache, d.dy.data(), dx.data(), &grads).ok());

  for (int64_t D : {2, 4, 8}) {
    SCOPED_TRACE("D=" + std::to_string(D));
    const std::vector<int32_t> order = *ZigzagOrder(d.T, D);
    const std::vector<float> xp = Permute(d.x, order, d.B, C, false);
    const std::vector<float> dyp = Permute(d.dy, order, d.B, C, false);
    std::vector<float> yp(xp.size()), dxp(xp.size());
    BlockCache cp;
    BlockGrads gp;
    ASSERT_TRUE(
        block.Forward(CpuOps(), d.w, xp.data(), order.data(), d.B, d.T, yp.data(), &cp).ok());
    ASSERT_TRUE(block.Backward(CpuOps(), d.w, cp, dyp.data(), dxp.data(), &gp).ok());
    ExpectTensorNear(Permute(yp, order, d.B, C, true), y, kPermutedRelTol, "zigzag_y");
    ExpectTensorNear(Permute(dxp, order, d.B, C, true), dx, kPermutedRelTol, "zigzag_dx");
    const std::vector<std::vector<float>*> a = gp.Tensors(), b = grads.Tensors();
    for (size_t i = 0; i < a.size(); ++i) {
      ExpectTensorNear(*a[i], *b[i], kPermutedRelTol,
                       std::string("zigzag_grad_") + BlockTensorNames()[i]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The model.

struct Batch {
  int64_t B = 0, T = 0;
  std::vector<int32_t> tokens, targets;
};

Batch MakeBatch(const ModelConfig& cfg, int64_t B, int64_t T, uint32_t seed) {
  Batch b{B, T, std::vector<int32_t>(B * T), std::vector<int32_t>(B * T)};
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < B * T; ++i) {
    b.tokens[i] = static_cast<int32_t>(rng() % cfg.vocab);
    b.targets[i] = static_cast<int32_t>(rng() % cfg.vocab);
  }
  b.targets[1] = -1;  // Ignored targets: the mean is over the valid ones.
  b.targets[B * T - 2] = -1;
  return b;
}

TEST(ReferenceModel, InitIsDeterministicAndLossStartsNearLogVocab) {
  const ModelConfig cfg{50, 32, 4, 64, 2, 1e-5f};
  const ModelWeights a = InitModelWeights(cfg, 11), b = InitModelWeights(cfg, 11);
  const ModelWeights c = InitModelWeights(cfg, 12);
  ASSERT_TRUE(CheckModelWeights(cfg, a).ok());
  const std::vector<const std::vector<float>*> ta = a.Tensors(), tb = b.Tensors(), tc = c.Tensors();
  ASSERT_EQ(ta.size(), ModelTensorNames(cfg).size());
  for (size_t i = 0; i < ta.size(); ++i) EXPECT_EQ(*ta[i], *tb[i]) << ModelTensorNames(cfg)[i];
  EXPECT_NE(a.head, c.head);
  EXPECT_EQ(a.ln_f, std::vector<float>(cfg.C, 1.0f));
  double sq = 0;
  for (float v : a.embedding) sq += static_cast<double>(v) * v;
  EXPECT_NEAR(std::sqrt(sq / a.embedding.size()), 0.02, 0.002);  // std of 1600 normals.

  const Batch batch = MakeBatch(cfg, 2, 8, 5);
  const absl::StatusOr<double> loss = ReferenceModel(cfg).Forward(
      CpuOps(), a, batch.tokens.data(), batch.targets.data(), batch.B, batch.T, nullptr, nullptr);
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_NEAR(*loss, std::log(50.0), 0.05);  // Near-uniform logits at std 0.02.
}

TEST(ReferenceModel, RejectsBadInputs) {
  const ModelConfig cfg{10, 8, 2, 16, 1, 1e-5f};
  const ModelWeights w = InitModelWeights(cfg, 1);
  const ReferenceModel model(cfg);
  std::vector<int32_t> tokens = {1, 2, 3, 4}, targets = {1, 2, 3, 10};
  EXPECT_EQ(model.Forward(CpuOps(), w, tokens.data(), targets.data(), 1, 4, nullptr, nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  targets[3] = -1;
  tokens[0] = -1;
  EXPECT_EQ(model.Forward(CpuOps(), w, tokens.data(), targets.data(), 1, 4, nullptr, nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  tokens[0] = 0;
  EXPECT_TRUE(
      model.Forward(CpuOps(), w, tokens.data(), targets.data(), 1, 4, nullptr, nullptr).ok());
  ModelWeights short_w = w;
  short_w.blocks.pop_back();
  EXPECT_EQ(model.Forward(CpuOps(), short_w, tokens.data(), targets.data(), 1, 4, nullptr, nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // No valid target: loss 0, zero gradients.
  const std::vector<int32_t> none = {-1, -1, -1, -1};
  ModelCache cache;
  const absl::StatusOr<double> zero =
      model.Forward(CpuOps(), w, tokens.data(), none.data(), 1, 4, nullptr, &cache);
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ(*zero, 0.0);
  ModelGrads g;
  ASSERT_TRUE(model.Backward(CpuOps(), w, cache, &g).ok());
  for (const std::vector<float>* t : g.Tensors()) {
    EXPECT_EQ(*std::max_element(t->begin(), t->end()), 0.0f);
  }
}

// The model's options, for the tests that run every combination.
struct Features {
  bool learned_positions;
  bool tied_head;
};
constexpr Features kAllFeatures[] = {{false, false}, {true, false}, {false, true}, {true, true}};

std::string FeaturesName(const Features& f) {
  return std::string(f.learned_positions ? "learned_pos" : "no_pos") +
         (f.tied_head ? "_tied" : "_untied");
}

void PrintTo(const Features& f, std::ostream* os) { *os << FeaturesName(f); }

ModelConfig WithFeatures(ModelConfig cfg, const Features& f, int64_t max_seq) {
  cfg.learned_positions = f.learned_positions;
  cfg.max_seq = max_seq;
  cfg.tied_head = f.tied_head;
  return cfg;
}

// The draws InitModelWeights documents, redone here: one mt19937 stream, Box-Muller from its raw
// outputs, tensors in ModelTensorNames order.
ModelWeights RedrawInit(const ModelConfig& cfg, uint32_t seed, double stddev, double jitter) {
  ModelWeights w = ModelWeights::Zeros(cfg);
  std::mt19937 rng(seed);
  const double residual = stddev / std::sqrt(2.0 * static_cast<double>(cfg.layers));
  const std::vector<std::string> names = ModelTensorNames(cfg);
  const std::vector<std::vector<float>*> t = w.Tensors();
  EXPECT_EQ(t.size(), names.size());
  for (size_t i = 0; i < t.size() && i < names.size(); ++i) {
    const std::string& n = names[i];
    const bool norm = n == "ln_f" || n.find(".ln") != std::string::npos;
    const bool scaled = n.find(".Wo") != std::string::npos || n.find(".Wd") != std::string::npos;
    const double mean = norm ? 1.0 : 0.0, sd = norm ? jitter : scaled ? residual : stddev;
    for (float& x : *t[i]) {
      const double u1 = (static_cast<double>(rng()) + 1.0) / 4294967296.0;
      const double u2 = static_cast<double>(rng()) / 4294967296.0;
      x = static_cast<float>(mean +
                             sd * (std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2)));
    }
  }
  return w;
}

TEST(ReferenceModel, OptionsShapeTheTensorListAndTheInitOrder) {
  const ModelConfig base{11, 8, 2, 16, 2, 1e-5f};
  for (const Features& f : kAllFeatures) {
    SCOPED_TRACE(FeaturesName(f));
    const ModelConfig cfg = WithFeatures(base, f, 12);
    ASSERT_TRUE(ValidateModelConfig(cfg).ok());
    const ModelWeights w = InitModelWeights(cfg, 7, 0.1f, 0.2f);
    ASSERT_TRUE(CheckModelWeights(cfg, w).ok());
    EXPECT_EQ(w.pos_embedding.size(), f.learned_positions ? 12u * 8u : 0u);
    EXPECT_EQ(w.head.size(), f.tied_head ? 0u : 11u * 8u);
    EXPECT_EQ(PosEmbeddingSize(cfg), static_cast<int64_t>(w.pos_embedding.size()));
    EXPECT_EQ(HeadSize(cfg), static_cast<int64_t>(w.head.size()));
    const std::vector<std::string> names = ModelTensorNames(cfg);
    const std::vector<const std::vector<float>*> t = w.Tensors();
    ASSERT_EQ(t.size(), names.size());
    EXPECT_EQ(names[0], "embedding");
    EXPECT_EQ(names[1], f.learned_positions ? "pos_embedding" : "block0.ln1");
    EXPECT_EQ(names.back(), f.tied_head ? "ln_f" : "head");
    EXPECT_EQ(t.size(), 2 + 9 * 2 + (f.learned_positions ? 1u : 0u) + (f.tied_head ? 0u : 1u));
    if (f.learned_positions) {
      EXPECT_EQ(t[1], &w.pos_embedding);
    }
    // Drawn in Tensors() order from one stream: the default config's draws are the same as
    // before the options existed, and a tied model is the untied one without its head.
    const ModelWeights redrawn = RedrawInit(cfg, 7, 0.1f, 0.2f);
    const std::vector<const std::vector<float>*> r = redrawn.Tensors();
    ASSERT_EQ(r.size(), t.size());
    for (size_t i = 0; i < t.size(); ++i) EXPECT_EQ(*t[i], *r[i]) << names[i];
    const ModelWeights zeros = ModelWeights::Zeros(cfg);
    const std::vector<const std::vector<float>*> z = zeros.Tensors();
    ASSERT_EQ(z.size(), t.size());
    for (size_t i = 0; i < t.size(); ++i) EXPECT_EQ(z[i]->size(), t[i]->size()) << names[i];
  }
  const ModelConfig untied = WithFeatures(base, {false, false}, 0);
  const ModelConfig tied = WithFeatures(base, {false, true}, 0);
  const ModelWeights a = InitModelWeights(untied, 3), b = InitModelWeights(tied, 3);
  EXPECT_EQ(a.embedding, b.embedding);
  EXPECT_EQ(a.blocks[1].wd, b.blocks[1].wd);
  EXPECT_EQ(a.ln_f, b.ln_f);
}

TEST(ReferenceModel, OptionsRejectBadShapesAndPositions) {
  const ModelConfig base{10, 8, 2, 16, 1, 1e-5f};
  EXPECT_EQ(ValidateModelConfig(WithFeatures(base, {true, false}, 0)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateModelConfig(WithFeatures(base, {false, false}, -1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateModelConfig(WithFeatures(base, {false, true}, 4)).ok());  // Unused.

  const ModelConfig cfg = WithFeatures(base, {true, true}, 4);
  const ModelWeights w = InitModelWeights(cfg, 1);
  ModelWeights with_head = w;
  with_head.head.assign(10 * 8, 0.5f);
  EXPECT_EQ(CheckModelWeights(cfg, with_head).code(), absl::StatusCode::kInvalidArgument);
  ModelWeights no_pos = w;
  no_pos.pos_embedding.clear();
  EXPECT_EQ(CheckModelWeights(cfg, no_pos).code(), absl::StatusCode::kInvalidArgument);
  // The untied, position-free model's weights do not fit this config and vice versa.
  EXPECT_FALSE(CheckModelWeights(cfg, InitModelWeights(base, 1)).ok());
  EXPECT_FALSE(CheckModelWeights(base, w).ok());

  const ReferenceModel model(cfg);
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5}, targets = {2, 3, 4, 5, 6};
  EXPECT_TRUE(
      model.Forward(CpuOps(), w, tokens.data(), targets.data(), 1, 4, nullptr, nullptr).ok());
  // T = 5 > max_seq = 4: position 4 has no row.
  EXPECT_EQ(model.Forward(CpuOps(), w, tokens.data(), targets.data(), 1, 5, nullptr, nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<int32_t> far = {0, 1, 2, 4}, negative = {-1, 0, 1, 2};
  EXPECT_EQ(model.Forward(CpuOps(), w, tokens.data(), targets.data(), 1, 4, far.data(), nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      model.Forward(CpuOps(), w, tokens.data(), targets.data(), 1, 4, negative.data(), nullptr)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  // A gradient with a head for a tied model is refused; an empty one is sized without a head.
  ModelCache cache;
  ASSERT_TRUE(
      model.Forward(CpuOps(), w, tokens.data(), targets.data(), 1, 4, nullptr, &cache).ok());
  ModelGrads wrong;
  wrong.head.assign(10 * 8, 0.0f);
  EXPECT_EQ(model.Backward(CpuOps(), w, cache, &wrong).code(), absl::StatusCode::kInvalidArgument);
  ModelGrads g;
  ASSERT_TRUE(model.Backward(CpuOps(), w, cache, &g).ok());
  EXPECT_TRUE(g.head.empty());
  EXPECT_TRUE(CheckModelWeights(cfg, g).ok());
  // Positions 0..3 each got gradient; the lookup is per position, not per token.
  for (int64_t r = 0; r < 4; ++r) {
    double sq = 0;
    for (int64_t j = 0; j < 8; ++j) sq += std::fabs(g.pos_embedding[r * 8 + j]);
    EXPECT_GT(sq, 0.0) << "position " << r;
  }
}

class ModelWithFeatures : public ::testing::TestWithParam<Features> {};

std::string FeaturesParamName(const ::testing::TestParamInfo<Features>& info) {
  return FeaturesName(info.param);
}

TEST_P(ModelWithFeatures, ZigzagOrderGivesTheSameLossAndGradients) {
  // max_seq above T: the table's rows past T - 1 are never used (their gradient stays 0).
  const ModelConfig cfg = WithFeatures(ModelConfig{17, 16, 2, 32, 2, 1e-5f}, GetParam(), 20);
  const ModelWeights w = InitModelWeights(cfg, 21, 0.3f, 0.2f);
  const ReferenceModel model(cfg);
  const Batch batch = MakeBatch(cfg, 2, 16, 22);
  ModelCache cache;
  const absl::StatusOr<double> loss = model.Forward(
      CpuOps(), w, batch.tokens.data(), batch.targets.data(), batch.B, batch.T, nullptr, &cache);
  ASSERT_TRUE(loss.ok()) << loss.status();
  ModelGrads grads;
  ASSERT_TRUE(model.Backward(CpuOps(), w, cache, &grads).ok());
  const std::vector<int32_t> order = *ZigzagOrder(batch.T, 4);
  const std::vector<int32_t> tp = Permute(batch.tokens, order, batch.B, 1, false);
  const std::vector<int32_t> gp = Permute(batch.targets, order, batch.B, 1, false);
  ModelCache cp;
  const absl::StatusOr<double> lp =
      model.Forward(CpuOps(), w, tp.data(), gp.data(), batch.B, batch.T, order.data(), &cp);
  ASSERT_TRUE(lp.ok()) << lp.status();
  EXPECT_NEAR(*lp, *loss, 1e-6 * *loss);
  ModelGrads gz;
  ASSERT_TRUE(model.Backward(CpuOps(), w, cp, &gz).ok());
  const std::vector<std::string> names = ModelTensorNames(cfg);
  const std::vector<std::vector<float>*> a = gz.Tensors(), b = grads.Tensors();
  for (size_t i = 0; i < a.size(); ++i) {
    ExpectTensorNear(*a[i], *b[i], kPermutedRelTol, "model_zigzag_" + names[i]);
  }
}

// Central differences of the fp32 forward (per-token losses summed in double), h = 5e-3, on
// every element of every weight tensor (4848 in the option-free model), with weights of
// magnitude ~0.3: the truncation error is O(h^2) (it dominates: the worst element is off by 9e-4
// at h = 5e-3, 3.4e-3 at 1e-2) and the rounding noise is about 1e-7 / h. Each element must
// satisfy |fd - analytic| <= kFdAbsTol + kFdRelTol * |fd|; the worst measured is 0.36 of that
// (recorded as fd_max_err_over_tol in test.xml). A 7% error in the loss scale fails it, and so
// does a tied embedding missing the head's part of its gradient.
constexpr double kFdH = 5e-3;
constexpr double kFdAbsTol = 1e-4;
constexpr double kFdRelTol = 1e-2;

TEST_P(ModelWithFeatures, GradientsMatchFiniteDifferences) {
  const ModelConfig cfg = WithFeatures(ModelConfig{13, 16, 2, 24, 2, 1e-5f}, GetParam(), 10);
  // Larger than training init so that every path is clearly nonlinear and every gradient is
  // well above the finite-difference noise; norm weights away from 1.
  ModelWeights w = InitModelWeights(cfg, 31, 0.3f, 0.2f);
  const ReferenceModel model(cfg);
  const Batch batch = MakeBatch(cfg, 2, 8, 32);
  auto loss_at = [&](const ModelWeights& weights) {
    absl::StatusOr<double> l =
        model.Forward(CpuOps(), weights, batch.tokens.data(), batch.targets.data(), batch.B,
                      batch.T, nullptr, nullptr);
    EXPECT_TRUE(l.ok()) << l.status();
    return l.ok() ? *l : 0.0;
  };
  ModelCache cache;
  ASSERT_TRUE(model
                  .Forward(CpuOps(), w, batch.tokens.data(), batch.targets.data(), batch.B, batch.T,
                           nullptr, &cache)
                  .ok());
  ModelGrads grads;
  ASSERT_TRUE(model.Backward(CpuOps(), w, cache, &grads).ok());

  const std::vector<std::string> names = ModelTensorNames(cfg);
  const std::vector<std::vector<float>*> wt = w.Tensors();
  const std::vector<const std::vector<float>*> gt = static_cast<const ModelGrads&>(grads).Tensors();
  ASSERT_EQ(wt.size(), names.size());
  double worst = 0, worst_abs = 0;
  int64_t checked = 0;
  for (size_t t = 0; t < wt.size(); ++t) {
    std::vector<float>& param = *wt[t];
    double grad_scale = 0;
    for (float g : *gt[t]) grad_scale = std::max(grad_scale, std::fabs(static_cast<double>(g)));
    EXPECT_GT(grad_scale, 1e-3) << names[t] << " gradient is (nearly) all zero";
    EXPECT_EQ(param.size(), gt[t]->size()) << names[t];
    for (size_t i = 0; i < param.size(); ++i) {
      const float saved = param[i];
      param[i] = static_cast<float>(saved + kFdH);
      const double plus = loss_at(w);
      param[i] = static_cast<float>(saved - kFdH);
      const double minus = loss_at(w);
      param[i] = saved;
      const double fd = (plus - minus) / (2 * kFdH);
      const double an = (*gt[t])[i];
      const double err = std::fabs(fd - an), tol = kFdAbsTol + kFdRelTol * std::fabs(fd);
      worst = std::max(worst, err / tol);
      worst_abs = std::max(worst_abs, err);
      ++checked;
      ASSERT_LE(err, tol) << names[t] << "[" << i << "]: finite difference " << fd << ", analytic "
                          << an;
    }
  }
  std::ostringstream os;
  os << worst;
  ::testing::Test::RecordProperty("fd_max_err_over_tol", os.str());
  std::printf(
      "finite differences (%s): %lld elements, worst |fd - analytic| = %g, worst / tolerance "
      "= %g\n",
      FeaturesName(GetParam()).c_str(), static_cast<long long>(checked), worst_abs, worst);
}

INSTANTIATE_TEST_SUITE_P(Options, ModelWithFeatures, ::testing::ValuesIn(kAllFeatures),
                         FeaturesParamName);

}  // namespace
}  // namespace parallel
}  // namespace stallfree
