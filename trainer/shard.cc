#include "trainer/shard.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace stallfree {
namespace trainer {
namespace {

// The model's view (of values or of gradients: the same fields) of the tensors at `p`.
template <class View>
View ViewOf(const ShardPointers& p) {
  View v;
  v.embedding = p.embedding;
  v.pos_embedding = p.pos_embedding;
  for (const auto& b : p.blocks) v.tsp_blocks.push_back({b[0], b[1], b[2], b[3]});
  v.ln_f = p.ln_f;
  v.head = p.head;
  return v;
}

}  // namespace

ShardPointers HostPointers(parallel::DistributedShard* s) {
  auto at = [](std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
  ShardPointers p;
  p.embedding = at(s->embedding);
  p.pos_embedding = at(s->pos_embedding);
  for (parallel::TspShard& b : s->tsp_blocks)
    p.blocks.push_back({at(b.ln1), at(b.ln2), at(b.attn), at(b.mlp)});
  p.ln_f = at(s->ln_f);
  p.head = at(s->head);
  return p;
}

BackendShard::BackendShard(const kernels::TransformerOps& ops,
                           const parallel::DistributedShard& host, bool upload) {
  std::vector<const std::vector<float>*> fields = {&host.embedding, &host.pos_embedding};
  for (const parallel::TspShard& b : host.tsp_blocks)
    for (const std::vector<float>* f : {&b.ln1, &b.ln2, &b.attn, &b.mlp}) fields.push_back(f);
  fields.push_back(&host.ln_f);
  fields.push_back(&host.head);
  constexpr int64_t kAlign = 64;  // floats
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const std::vector<float>* f : fields) {
    offsets.push_back(total);
    total += (static_cast<int64_t>(f->size()) + kAlign - 1) / kAlign * kAlign;
  }
  buffer_ = kernels::OpsBuffer(&ops, total);
  std::vector<float*> at(fields.size(), nullptr);
  for (size_t i = 0; i < fields.size(); ++i) {
    if (fields[i]->empty() || buffer_.data() == nullptr) continue;
    at[i] = buffer_.data() + offsets[i];
    if (upload) ops.Upload(at[i], fields[i]->data(), static_cast<int64_t>(fields[i]->size()));
  }
  size_t i = 0;
  pointers_.embedding = at[i++];
  pointers_.pos_embedding = at[i++];
  for (size_t l = 0; l < host.tsp_blocks.size(); ++l, i += 4)
    pointers_.blocks.push_back({at[i], at[i + 1], at[i + 2], at[i + 3]});
  pointers_.ln_f = at[i++];
  pointers_.head = at[i++];
}

parallel::DistributedShardView BackendShard::View() const {
  return ViewOf<parallel::DistributedShardView>(pointers_);
}

parallel::DistributedGradsView BackendShard::Grads() const {
  return ViewOf<parallel::DistributedGradsView>(pointers_);
}

std::vector<Tensor> ShardTensors(const parallel::ModelConfig& cfg, int D, const ShardPointers& w,
                                 const ShardPointers& g) {
  std::vector<Tensor> out;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float* value, float* grad,
                 bool replicated) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    out.push_back({name, std::move(shape), value, grad, n, replicated});
  };
  const int64_t C = cfg.C, Ch = cfg.C / D, F = cfg.FF / D;
  add("embedding", {cfg.vocab, C}, w.embedding, g.embedding, true);
  if (w.pos_embedding != nullptr)
    add("pos_embedding", {cfg.max_seq, C}, w.pos_embedding, g.pos_embedding, true);
  for (size_t l = 0; l < w.blocks.size(); ++l) {
    const std::array<float*, 4>& ws = w.blocks[l];
    const std::array<float*, 4>& gs = g.blocks[l];
    const std::string b = absl::StrCat("block", l, ".");
    add(b + "ln1", {C}, ws[0], gs[0], true);
    add(b + "ln2", {C}, ws[1], gs[1], true);
    add(b + "wqkv", {3 * Ch, C}, ws[2], gs[2], false);
    add(b + "wo", {C, Ch}, ws[2] + 3 * Ch * C, gs[2] + 3 * Ch * C, false);
    add(b + "wgu", {2 * F, C}, ws[3], gs[3], false);
    add(b + "wd", {C, F}, ws[3] + 2 * F * C, gs[3] + 2 * F * C, false);
  }
  add("ln_f", {C}, w.ln_f, g.ln_f, true);
  if (w.head != nullptr) add("head", {cfg.vocab, C}, w.head, g.head, true);
  return out;
}

Bf16Storage::Bf16Storage(const kernels::TransformerOps& ops, std::vector<Tensor>* tensors) {
  constexpr int64_t kAlign = 128;  // bf16 elements
  std::vector<int64_t> offsets;
  int64_t total = 0;  // bf16 elements
  for (int half = 0; half < 2; ++half)
    for (const Tensor& t : *tensors) {
      offsets.push_back(total);
      total += (t.numel + kAlign - 1) / kAlign * kAlign;
    }
  buffer_ = kernels::OpsBuffer(&ops, total / 2);
  uint16_t* base = reinterpret_cast<uint16_t*>(buffer_.data());
  const size_t n = tensors->size();
  for (size_t i = 0; i < n; ++i) {
    (*tensors)[i].value16 = base + offsets[i];
    (*tensors)[i].grad16 = base + offsets[n + i];
  }
}

void UploadStored(const kernels::TransformerOps& ops, const Tensor& t, const std::string& host) {
  if (!t.bf16()) {
    ops.Upload(t.value, reinterpret_cast<const float*>(host.data()), t.numel);
    return;
  }
  const int64_t floats = (t.numel + 1) / 2;
  std::vector<float> padded(floats, 0.0f);
  memcpy(padded.data(), host.data(), t.numel * 2);
  ops.Upload(reinterpret_cast<float*>(t.value16), padded.data(), floats);
}

void DownloadStored(const kernels::TransformerOps& ops, const Tensor& t, std::string* host) {
  host->assign(((t.numel * t.elem_size()) + 3) / 4 * 4, '\0');
  if (!t.bf16())
    ops.Download(reinterpret_cast<float*>(host->data()), t.value, t.numel);
  else
    ops.Download(reinterpret_cast<float*>(host->data()), reinterpret_cast<const float*>(t.value16),
                 (t.numel + 1) / 2);
}

absl::StatusOr<double> BackendSquaredNorm(const RankDevice& dev, const std::vector<Tensor>& tensors,
                                          bool lead) {
  std::vector<std::pair<const Tensor*, int64_t>> counted;  // tensor, columns
  int64_t cols_total = 0;
  for (const Tensor& t : tensors) {
    if (t.replicated && !lead) continue;
    const int64_t cols = t.shape.back();
    counted.emplace_back(&t, cols);
    cols_total += cols;
  }
  if (cols_total == 0) return 0.0;
  kernels::OpsBuffer sums(&dev.ops(), cols_total);
  int64_t off = 0;
  for (const auto& [t, cols] : counted) {
    dev.kernel().ColumnScores(t->grad, kernels::GradType::kFp32, t->numel / cols, cols, cols,
                              nullptr, sums.data() + off);
    off += cols;
  }
  std::vector<float> host(cols_total);
  dev.ops().Download(host.data(), sums.data(), cols_total);
  RETURN_IF_ERROR(dev.Synchronize());
  double sq = 0;
  for (float x : host) sq += x;
  return sq;
}

}  // namespace trainer
}  // namespace stallfree
