#include "parallel/reference_block.h"

#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace stallfree {
namespace parallel {
namespace {

using kernels::AttentionShape;
using kernels::Trans;
using kernels::TransformerOps;

// Each field of BlockWeights with its name and size for a config, in declaration order.
std::vector<int64_t> BlockSizes(const BlockConfig& c) {
  const int64_t cc = c.C * c.C, fc = c.FF * c.C;
  return {c.C, cc, cc, cc, cc, c.C, fc, fc, fc};
}

absl::Status CheckSize(const std::vector<float>& v, int64_t want, const std::string& name) {
  if (static_cast<int64_t>(v.size()) != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("reference: ", name, " has ", v.size(), " elements, want ", want));
  }
  return absl::OkStatus();
}

// An empty gradient field becomes zeros of its size; any other size than that is an error.
absl::Status PrepareGrad(std::vector<float>* g, int64_t want, const std::string& name) {
  if (g->empty()) g->assign(static_cast<size_t>(want), 0.0f);
  return CheckSize(*g, want, "gradient " + name);
}

absl::Status PrepareBlockGrads(const BlockConfig& cfg, BlockGrads* grads) {
  const std::vector<int64_t> sizes = BlockSizes(cfg);
  const std::vector<std::vector<float>*> t = grads->Tensors();
  for (size_t i = 0; i < t.size(); ++i) {
    RETURN_IF_ERROR(PrepareGrad(t[i], sizes[i], BlockTensorNames()[i]));
  }
  return absl::OkStatus();
}

absl::Status CheckBT(int64_t B, int64_t T) {
  if (B <= 0 || T <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("reference: B and T must be positive, got B=", B, " T=", T));
  }
  return absl::OkStatus();
}

// y[rows, out] = x[rows, in] W^T (+ beta * y) for W [out, in]; ldy is y's row stride.
void Linear(const TransformerOps& ops, const float* x, const float* w, int64_t rows, int64_t out,
            int64_t in, float* y, int64_t ldy, float beta = 0.0f) {
  ops.Gemm(Trans::kNo, Trans::kYes, rows, out, in, 1.0f, x, in, w, in, beta, y, ldy);
}

// dW[out, in] += dy^T x for dy [rows, out] (row stride lddy) and x [rows, in].
void LinearWeightGrad(const TransformerOps& ops, const float* dy, int64_t lddy, const float* x,
                      int64_t rows, int64_t out, int64_t in, float* dw) {
  ops.Gemm(Trans::kYes, Trans::kNo, out, in, rows, 1.0f, dy, lddy, x, in, 1.0f, dw, in);
}

// dx[rows, in] = dy W (+ beta * dx) for dy [rows, out] (row stride lddy), W [out, in].
void LinearInputGrad(const TransformerOps& ops, const float* dy, int64_t lddy, const float* w,
                     int64_t rows, int64_t out, int64_t in, float* dx, float beta = 0.0f) {
  ops.Gemm(Trans::kNo, Trans::kNo, rows, in, out, 1.0f, dy, lddy, w, in, beta, dx, in);
}

AttentionShape Shape(const BlockConfig& cfg, int64_t B, int64_t T) {
  AttentionShape s;
  s.batch = B;
  s.tq = s.tk = T;
  s.heads = cfg.H;
  s.head_dim = cfg.C / cfg.H;
  s.q_ld = s.k_ld = s.v_ld = 3 * cfg.C;
  s.out_ld = cfg.C;
  return s;
}

// OK iff learned positions are off, or every position indexes a row of pos_embedding.
absl::Status CheckPositions(const ModelConfig& cfg, const std::vector<int32_t>& positions) {
  if (!cfg.learned_positions) return absl::OkStatus();
  for (size_t i = 0; i < positions.size(); ++i) {
    if (positions[i] < 0 || positions[i] >= cfg.max_seq) {
      return absl::InvalidArgumentError(absl::StrCat("reference: position ", positions[i], " at ",
                                                     i, " not in [0, max_seq=", cfg.max_seq, ")"));
    }
  }
  return absl::OkStatus();
}

// The position ids of B rows of the same positions [T], for the pos_embedding lookup.
std::vector<int32_t> TilePositions(const std::vector<int32_t>& positions, int64_t B) {
  std::vector<int32_t> ids;
  ids.reserve(positions.size() * static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) ids.insert(ids.end(), positions.begin(), positions.end());
  return ids;
}

// Standard normal from two raw mt19937 outputs (Box-Muller), independent of <random>'s
// distribution implementations.
double Normal(std::mt19937* rng) {
  const double u1 = (static_cast<double>((*rng)()) + 1.0) / 4294967296.0;  // (0, 1]
  const double u2 = static_cast<double>((*rng)()) / 4294967296.0;          // [0, 1)
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

void Fill(std::mt19937* rng, double mean, double std, std::vector<float>* v) {
  for (float& x : *v) x = static_cast<float>(mean + std * Normal(rng));
}

}  // namespace

absl::Status ValidateBlockConfig(const BlockConfig& cfg) {
  if (cfg.C <= 0 || cfg.H <= 0 || cfg.FF <= 0 || cfg.C % cfg.H != 0 || !(cfg.eps > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("reference: bad block config C=", cfg.C,
                                                   " H=", cfg.H, " FF=", cfg.FF, " eps=", cfg.eps,
                                                   " (need C % H == 0, all > 0)"));
  }
  return absl::OkStatus();
}

BlockWeights BlockWeights::Zeros(const BlockConfig& cfg) {
  BlockWeights w;
  const std::vector<int64_t> sizes = BlockSizes(cfg);
  const std::vector<std::vector<float>*> t = w.Tensors();
  for (size_t i = 0; i < t.size(); ++i) t[i]->assign(static_cast<size_t>(sizes[i]), 0.0f);
  return w;
}

std::vector<std::vector<float>*> BlockWeights::Tensors() {
  return {&ln1, &wq, &wk, &wv, &wo, &ln2, &wg, &wu, &wd};
}

std::vector<const std::vector<float>*> BlockWeights::Tensors() const {
  return {&ln1, &wq, &wk, &wv, &wo, &ln2, &wg, &wu, &wd};
}

const std::vector<const char*>& BlockTensorNames() {
  static const std::vector<const char*>* names =
      new std::vector<const char*>{"ln1", "Wq", "Wk", "Wv", "Wo", "ln2", "Wg", "Wu", "Wd"};
  return *names;
}

absl::Status CheckBlockWeights(const BlockConfig& cfg, const BlockWeights& w) {
  RETURN_IF_ERROR(ValidateBlockConfig(cfg));
  const std::vector<int64_t> sizes = BlockSizes(cfg);
  const std::vector<const std::vector<float>*> t = w.Tensors();
  for (size_t i = 0; i < t.size(); ++i) {
    RETURN_IF_ERROR(CheckSize(*t[i], sizes[i], BlockTensorNames()[i]));
  }
  return absl::OkStatus();
}

absl::Status ReferenceBlock::Forward(const TransformerOps& ops, const BlockWeights& w,
                                     const float* x, const int32_t* positions, int64_t B, int64_t T,
                                     float* y, BlockCache* cache) const {
  RETURN_IF_ERROR(CheckBlockWeights(cfg_, w));
  RETURN_IF_ERROR(CheckBT(B, T));
  if (x == nullptr || positions == nullptr || y == nullptr) {
    return absl::InvalidArgumentError("reference: null x, positions or y");
  }
  BlockCache scratch;
  BlockCache& c = cache != nullptr ? *cache : scratch;
  const int64_t n = B * T, C = cfg_.C, FF = cfg_.FF, C3 = 3 * C;
  c.B = B;
  c.T = T;
  c.positions.assign(positions, positions + T);
  c.x.assign(x, x + n * C);
  c.n1.resize(n * C);
  c.rstd1.resize(n);
  c.qkv.resize(n * C3);
  c.att.resize(n * C);
  c.lse.resize(B * cfg_.H * T);
  c.h.resize(n * C);
  c.n2.resize(n * C);
  c.rstd2.resize(n);
  c.g.resize(n * FF);
  c.u.resize(n * FF);
  c.m.resize(n * FF);

  ops.RmsNormForward(x, w.ln1.data(), n, C, cfg_.eps, c.n1.data(), c.rstd1.data());
  Linear(ops, c.n1.data(), w.wq.data(), n, C, C, c.qkv.data(), C3);
  Linear(ops, c.n1.data(), w.wk.data(), n, C, C, c.qkv.data() + C, C3);
  Linear(ops, c.n1.data(), w.wv.data(), n, C, C, c.qkv.data() + 2 * C, C3);
  const AttentionShape s = Shape(cfg_, B, T);
  ops.AttentionForward(s, c.qkv.data(), c.qkv.data() + C, c.qkv.data() + 2 * C, c.positions.data(),
                       c.positions.data(), c.att.data(), c.lse.data());
  Linear(ops, c.att.data(), w.wo.data(), n, C, C, c.h.data(), C);
  ops.Add(x, c.h.data(), n * C, c.h.data());
  ops.RmsNormForward(c.h.data(), w.ln2.data(), n, C, cfg_.eps, c.n2.data(), c.rstd2.data());
  Linear(ops, c.n2.data(), w.wg.data(), n, FF, C, c.g.data(), FF);
  Linear(ops, c.n2.data(), w.wu.data(), n, FF, C, c.u.data(), FF);
  ops.SwiGluForward(c.g.data(), c.u.data(), n * FF, c.m.data());
  Linear(ops, c.m.data(), w.wd.data(), n, C, FF, y, C);
  ops.Add(c.h.data(), y, n * C, y);
  const std::string err = ops.Synchronize();
  if (!err.empty()) return absl::InternalError("reference: block forward: " + err);
  return absl::OkStatus();
}

absl::Status ReferenceBlock::Backward(const TransformerOps& ops, const BlockWeights& w,
                                      const BlockCache& c, const float* dy, float* dx,
                                      BlockGrads* grads) const {
  RETURN_IF_ERROR(CheckBlockWeights(cfg_, w));
  RETURN_IF_ERROR(CheckBT(c.B, c.T));
  if (dy == nullptr || dx == nullptr || grads == nullptr) {
    return absl::InvalidArgumentError("reference: null dy, dx or grads");
  }
  const int64_t n = c.B * c.T, C = cfg_.C, FF = cfg_.FF, C3 = 3 * C;
  if (static_cast<int64_t>(c.x.size()) != n * C || static_cast<int64_t>(c.m.size()) != n * FF) {
    return absl::InvalidArgumentError("reference: block cache does not match its B, T");
  }
  RETURN_IF_ERROR(PrepareBlockGrads(cfg_, grads));

  std::vector<float> dm(n * FF), dg(n * FF), du(n * FF), dn2(n * C), dh(n * C), datt(n * C);
  std::vector<float> dqkv(n * C3), dn1(n * C);
  // y = h + m Wd^T.
  LinearWeightGrad(ops, dy, C, c.m.data(), n, C, FF, grads->wd.data());
  LinearInputGrad(ops, dy, C, w.wd.data(), n, C, FF, dm.data());
  ops.SwiGluBackward(c.g.data(), c.u.data(), dm.data(), n * FF, dg.data(), du.data());
  LinearWeightGrad(ops, dg.data(), FF, c.n2.data(), n, FF, C, grads->wg.data());
  LinearWeightGrad(ops, du.data(), FF, c.n2.data(), n, FF, C, grads->wu.data());
  LinearInputGrad(ops, dg.data(), FF, w.wg.data(), n, FF, C, dn2.data());
  LinearInputGrad(ops, du.data(), FF, w.wu.data(), n, FF, C, dn2.data(), 1.0f);
  ops.RmsNormBackward(c.h.data(), w.ln2.data(), c.rstd2.data(), dn2.data(), n, C, dh.data(),
                      grads->ln2.data());
  ops.Add(dh.data(), dy, n * C, dh.data());  // The residual's identity branch.
  // h = x + att Wo^T.
  LinearWeightGrad(ops, dh.data(), C, c.att.data(), n, C, C, grads->wo.data());
  LinearInputGrad(ops, dh.data(), C, w.wo.data(), n, C, C, datt.data());
  const AttentionShape s = Shape(cfg_, c.B, c.T);
  ops.AttentionBackward(s, c.qkv.data(), c.qkv.data() + C, c.qkv.data() + 2 * C, c.positions.data(),
                        c.positions.data(), c.att.data(), c.lse.data(), datt.data(), dqkv.data(),
                        dqkv.data() + C, dqkv.data() + 2 * C);
  const float* wqkv[3] = {w.wq.data(), w.wk.data(), w.wv.data()};
  float* dwqkv[3] = {grads->wq.data(), grads->wk.data(), grads->wv.data()};
  for (int i = 0; i < 3; ++i) {
    LinearWeightGrad(ops, dqkv.data() + i * C, C3, c.n1.data(), n, C, C, dwqkv[i]);
    LinearInputGrad(ops, dqkv.data() + i * C, C3, wqkv[i], n, C, C, dn1.data(),
                    i == 0 ? 0.0f : 1.0f);
  }
  ops.RmsNormBackward(c.x.data(), w.ln1.data(), c.rstd1.data(), dn1.data(), n, C, dx,
                      grads->ln1.data());
  ops.Add(dx, dh.data(), n * C, dx);
  const std::string err = ops.Synchronize();
  if (!err.empty()) return absl::InternalError("reference: block backward: " + err);
  return absl::OkStatus();
}

absl::Status ValidateModelConfig(const ModelConfig& cfg) {
  if (cfg.vocab <= 0 || cfg.layers <= 0 || cfg.vocab > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("reference: bad model config vocab=", cfg.vocab, " layers=", cfg.layers));
  }
  if (cfg.max_seq < 0 || cfg.max_seq > INT32_MAX || (cfg.learned_positions && cfg.max_seq == 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("reference: bad model config max_seq=", cfg.max_seq,
                     cfg.learned_positions ? " (learned positions need max_seq > 0)" : ""));
  }
  return ValidateBlockConfig(cfg.block());
}

int64_t PosEmbeddingSize(const ModelConfig& cfg) {
  return cfg.learned_positions ? cfg.max_seq * cfg.C : 0;
}

int64_t HeadSize(const ModelConfig& cfg) { return cfg.tied_head ? 0 : cfg.vocab * cfg.C; }

ModelWeights ModelWeights::Zeros(const ModelConfig& cfg) {
  ModelWeights w;
  w.embedding.assign(static_cast<size_t>(cfg.vocab * cfg.C), 0.0f);
  w.pos_embedding.assign(static_cast<size_t>(PosEmbeddingSize(cfg)), 0.0f);
  w.blocks.assign(static_cast<size_t>(cfg.layers), BlockWeights::Zeros(cfg.block()));
  w.ln_f.assign(static_cast<size_t>(cfg.C), 0.0f);
  w.head.assign(static_cast<size_t>(HeadSize(cfg)), 0.0f);
  return w;
}

std::vector<std::vector<float>*> ModelWeights::Tensors() {
  std::vector<std::vector<float>*> t = {&embedding};
  if (!pos_embedding.empty()) t.push_back(&pos_embedding);
  for (BlockWeights& b : blocks) {
    for (std::vector<float>* v : b.Tensors()) t.push_back(v);
  }
  t.push_back(&ln_f);
  if (!head.empty()) t.push_back(&head);
  return t;
}

std::vector<const std::vector<float>*> ModelWeights::Tensors() const {
  std::vector<const std::vector<float>*> t = {&embedding};
  if (!pos_embedding.empty()) t.push_back(&pos_embedding);
  for (const BlockWeights& b : blocks) {
    for (const std::vector<float>* v : b.Tensors()) t.push_back(v);
  }
  t.push_back(&ln_f);
  if (!head.empty()) t.push_back(&head);
  return t;
}

std::vector<std::string> ModelTensorNames(const ModelConfig& cfg) {
  std::vector<std::string> names = {"embedding"};
  if (cfg.learned_positions) names.push_back("pos_embedding");
  for (int64_t l = 0; l < cfg.layers; ++l) {
    for (const char* n : BlockTensorNames()) names.push_back(absl::StrCat("block", l, ".", n));
  }
  names.push_back("ln_f");
  if (!cfg.tied_head) names.push_back("head");
  return names;
}

absl::Status CheckModelWeights(const ModelConfig& cfg, const ModelWeights& w) {
  RETURN_IF_ERROR(ValidateModelConfig(cfg));
  RETURN_IF_ERROR(CheckSize(w.embedding, cfg.vocab * cfg.C, "embedding"));
  RETURN_IF_ERROR(CheckSize(w.pos_embedding, PosEmbeddingSize(cfg), "pos_embedding"));
  RETURN_IF_ERROR(CheckSize(w.ln_f, cfg.C, "ln_f"));
  RETURN_IF_ERROR(CheckSize(w.head, HeadSize(cfg), "head"));
  if (static_cast<int64_t>(w.blocks.size()) != cfg.layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("reference: ", w.blocks.size(), " blocks, want ", cfg.layers));
  }
  for (const BlockWeights& b : w.blocks) {
    RETURN_IF_ERROR(CheckBlockWeights(cfg.block(), b));
  }
  return absl::OkStatus();
}

ModelWeights InitModelWeights(const ModelConfig& cfg, uint32_t seed, float stddev,
                              float norm_jitter) {
  ModelWeights w = ModelWeights::Zeros(cfg);
  std::mt19937 rng(seed);
  const double layers = static_cast<double>(cfg.layers > 0 ? cfg.layers : 1);
  const double residual = stddev / std::sqrt(2.0 * layers);
  Fill(&rng, 0.0, stddev, &w.embedding);
  Fill(&rng, 0.0, stddev, &w.pos_embedding);  // Empty (no draws) without learned positions.
  for (BlockWeights& b : w.blocks) {
    Fill(&rng, 1.0, norm_jitter, &b.ln1);
    Fill(&rng, 0.0, stddev, &b.wq);
    Fill(&rng, 0.0, stddev, &b.wk);
    Fill(&rng, 0.0, stddev, &b.wv);
    Fill(&rng, 0.0, residual, &b.wo);
    Fill(&rng, 1.0, norm_jitter, &b.ln2);
    Fill(&rng, 0.0, stddev, &b.wg);
    Fill(&rng, 0.0, stddev, &b.wu);
    Fill(&rng, 0.0, residual, &b.wd);
  }
  Fill(&rng, 1.0, norm_jitter, &w.ln_f);
  Fill(&rng, 0.0, stddev, &w.head);  // Empty (no draws) when tied.
  return w;
}

absl::StatusOr<double> ReferenceModel::Forward(const TransformerOps& ops, const ModelWeights& w,
                                               const int32_t* tokens, const int32_t* targets,
                                               int64_t B, int64_t T, const int32_t* positions,
                                               ModelCache* cache) const {
  RETURN_IF_ERROR(CheckModelWeights(cfg_, w));
  RETURN_IF_ERROR(CheckBT(B, T));
  if (tokens == nullptr || targets == nullptr) {
    return absl::InvalidArgumentError("reference: null tokens or targets");
  }
  const int64_t n = B * T, C = cfg_.C, V = cfg_.vocab;
  ModelCache scratch;
  ModelCache& c = cache != nullptr ? *cache : scratch;
  c.B = B;
  c.T = T;
  c.tokens.assign(tokens, tokens + n);
  c.targets.assign(targets, targets + n);
  c.valid = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= V) {
      return absl::InvalidArgumentError(
          absl::StrCat("reference: token ", tokens[i], " at ", i, " not in [0, ", V, ")"));
    }
    if (targets[i] >= V) {
      return absl::InvalidArgumentError(
          absl::StrCat("reference: target ", targets[i], " at ", i, " >= vocab ", V));
    }
    if (targets[i] >= 0) ++c.valid;
  }
  if (positions != nullptr) {
    c.positions.assign(positions, positions + T);
  } else {
    c.positions.resize(T);
    std::iota(c.positions.begin(), c.positions.end(), 0);
  }
  RETURN_IF_ERROR(CheckPositions(cfg_, c.positions));
  c.blocks.resize(static_cast<size_t>(cfg_.layers));

  std::vector<float> x(n * C);
  c.x_final.resize(n * C);
  ops.EmbeddingForward(w.embedding.data(), C, tokens, n, x.data());
  if (cfg_.learned_positions) {
    const std::vector<int32_t> ids = TilePositions(c.positions, B);
    std::vector<float> pe(n * C);
    ops.EmbeddingForward(w.pos_embedding.data(), C, ids.data(), n, pe.data());
    ops.Add(x.data(), pe.data(), n * C, x.data());
  }
  const ReferenceBlock block(cfg_.block());
  for (int64_t l = 0; l < cfg_.layers; ++l) {
    RETURN_IF_ERROR(block.Forward(ops, w.blocks[l], x.data(), c.positions.data(), B, T,
                                  c.x_final.data(), &c.blocks[l]));
    x.swap(c.x_final);
  }
  c.x_final.swap(x);  // The last block's output.
  c.nf.resize(n * C);
  c.rstd_f.resize(n);
  c.logits.resize(n * V);
  c.lse.resize(n);
  std::vector<float> loss(n);
  ops.RmsNormForward(c.x_final.data(), w.ln_f.data(), n, C, cfg_.eps, c.nf.data(), c.rstd_f.data());
  const std::vector<float>& head = cfg_.tied_head ? w.embedding : w.head;
  Linear(ops, c.nf.data(), head.data(), n, V, C, c.logits.data(), V);
  ops.CrossEntropyForward(c.logits.data(), n, V, targets, loss.data(), c.lse.data());
  const std::string err = ops.Synchronize();
  if (!err.empty()) return absl::InternalError("reference: model forward: " + err);
  if (c.valid == 0) return 0.0;
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (targets[i] >= 0) sum += loss[i];
  }
  return sum / static_cast<double>(c.valid);
}

absl::Status ReferenceModel::Backward(const TransformerOps& ops, const ModelWeights& w,
                                      const ModelCache& c, ModelGrads* grads) const {
  RETURN_IF_ERROR(CheckModelWeights(cfg_, w));
  RETURN_IF_ERROR(CheckBT(c.B, c.T));
  if (grads == nullptr) return absl::InvalidArgumentError("reference: null grads");
  const int64_t n = c.B * c.T, C = cfg_.C, V = cfg_.vocab;
  if (static_cast<int64_t>(c.blocks.size()) != cfg_.layers ||
      static_cast<int64_t>(c.logits.size()) != n * V ||
      static_cast<int64_t>(c.positions.size()) != c.T ||
      static_cast<int64_t>(c.tokens.size()) != n) {
    return absl::InvalidArgumentError("reference: model cache does not match the config");
  }
  RETURN_IF_ERROR(CheckPositions(cfg_, c.positions));
  if (grads->blocks.empty()) grads->blocks.resize(static_cast<size_t>(cfg_.layers));
  if (static_cast<int64_t>(grads->blocks.size()) != cfg_.layers) {
    return absl::InvalidArgumentError("reference: gradient blocks do not match layers");
  }
  RETURN_IF_ERROR(PrepareGrad(&grads->embedding, V * C, "embedding"));
  RETURN_IF_ERROR(PrepareGrad(&grads->pos_embedding, PosEmbeddingSize(cfg_), "pos_embedding"));
  RETURN_IF_ERROR(PrepareGrad(&grads->ln_f, C, "ln_f"));
  RETURN_IF_ERROR(PrepareGrad(&grads->head, HeadSize(cfg_), "head"));
  for (int64_t l = 0; l < cfg_.layers; ++l) {
    RETURN_IF_ERROR(PrepareBlockGrads(cfg_.block(), &grads->blocks[l]));
  }
  if (c.valid == 0) return absl::OkStatus();  // The loss is the constant 0.

  std::vector<float> dlogits(n * V), dnf(n * C), dx(n * C), dprev(n * C);
  ops.CrossEntropyBackward(c.logits.data(), c.lse.data(), c.targets.data(), n, V,
                           1.0f / static_cast<float>(c.valid), dlogits.data());
  // logits = nf head^T; a tied head's part of the gradient goes to the embedding.
  float* dhead = cfg_.tied_head ? grads->embedding.data() : grads->head.data();
  const float* head = cfg_.tied_head ? w.embedding.data() : w.head.data();
  LinearWeightGrad(ops, dlogits.data(), V, c.nf.data(), n, V, C, dhead);
  LinearInputGrad(ops, dlogits.data(), V, head, n, V, C, dnf.data());
  ops.RmsNormBackward(c.x_final.data(), w.ln_f.data(), c.rstd_f.data(), dnf.data(), n, C, dx.data(),
                      grads->ln_f.data());
  const ReferenceBlock block(cfg_.block());
  for (int64_t l = cfg_.layers - 1; l >= 0; --l) {
    RETURN_IF_ERROR(
        block.Backward(ops, w.blocks[l], c.blocks[l], dx.data(), dprev.data(), &grads->blocks[l]));
    dx.swap(dprev);
  }
  ops.EmbeddingBackward(dx.data(), C, c.tokens.data(), n, grads->embedding.data());
  if (cfg_.learned_positions) {
    const std::vector<int32_t> ids = TilePositions(c.positions, c.B);
    ops.EmbeddingBackward(dx.data(), C, ids.data(), n, grads->pos_embedding.data());
  }
  const std::string err = ops.Synchronize();
  if (!err.empty()) return absl::InternalError("reference: model backward: " + err);
  return absl::OkStatus();
}

}  // namespace parallel
}  // namespace stallfree
