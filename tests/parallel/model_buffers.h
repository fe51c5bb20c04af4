// The DistributedModel's shard (or its gradients) in a backend's memory, for the workers that
// check the model's view form (model_worker.cc on CpuOps, model_nccl_worker.cc on CUDA): upload a
// DistributedShard, take its DistributedShardView / DistributedGradsView, download it back, and
// list its tensors by name.
#pragma once

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/ops.h"
#include "parallel/distributed_model.h"
#include "parallel/reference_block.h"
#include "parallel/tsp_block.h"
#include "tests/parallel/worker_check.h"

namespace stallfree {
namespace testing {

// Every tensor of a shard (or its gradients) with its name: embedding, pos_embedding and head
// when non-empty, ln_f, and each block's tensors ("block<l>.<field>").
inline std::vector<std::pair<std::string, const std::vector<float>*>> NamedTensors(
    const parallel::DistributedShard& s) {
  std::vector<std::pair<std::string, const std::vector<float>*>> t;
  t.emplace_back("embedding", &s.embedding);
  if (!s.pos_embedding.empty()) t.emplace_back("pos_embedding", &s.pos_embedding);
  for (size_t l = 0; l < s.tsp_blocks.size(); ++l) {
    const parallel::TspShard& b = s.tsp_blocks[l];
    t.emplace_back(absl::StrCat("block", l, ".ln1"), &b.ln1);
    t.emplace_back(absl::StrCat("block", l, ".ln2"), &b.ln2);
    t.emplace_back(absl::StrCat("block", l, ".attn"), &b.attn);
    t.emplace_back(absl::StrCat("block", l, ".mlp"), &b.mlp);
  }
  for (size_t l = 0; l < s.tpsp_blocks.size(); ++l) {
    const std::vector<const std::vector<float>*> f = s.tpsp_blocks[l].Tensors();
    for (size_t i = 0; i < f.size(); ++i) {
      t.emplace_back(absl::StrCat("block", l, ".", parallel::BlockTensorNames()[i]), f[i]);
    }
  }
  t.emplace_back("ln_f", &s.ln_f);
  if (!s.head.empty()) t.emplace_back("head", &s.head);
  return t;
}

// s with every element 0 (the same shapes).
inline parallel::DistributedShard ZerosLike(const parallel::DistributedShard& s) {
  parallel::DistributedShard z = s;
  std::vector<std::vector<float>*> fields = {&z.embedding, &z.pos_embedding, &z.ln_f, &z.head};
  for (parallel::TspShard& b : z.tsp_blocks) {
    for (std::vector<float>* f : {&b.ln1, &b.ln2, &b.attn, &b.mlp}) fields.push_back(f);
  }
  for (parallel::BlockWeights& b : z.tpsp_blocks) {
    for (std::vector<float>* f : b.Tensors()) fields.push_back(f);
  }
  for (std::vector<float>* f : fields) std::fill(f->begin(), f->end(), 0.0f);
  return z;
}

// A DistributedShard's tensors as OpsBuffers of one backend (an empty tensor stays empty, so its
// view pointer is null: no pos_embedding without learned positions, no head when tied).
struct ModelBuffers {
  kernels::OpsBuffer embedding, pos_embedding, ln_f, head;
  std::vector<std::vector<kernels::OpsBuffer>> tsp;  // per block: ln1, ln2, attn, mlp
  std::vector<BlockBuffers> tpsp;

  static ModelBuffers Upload(const kernels::TransformerOps& ops,
                             const parallel::DistributedShard& s) {
    ModelBuffers b;
    b.embedding = testing::Upload(ops, s.embedding);
    b.pos_embedding = testing::Upload(ops, s.pos_embedding);
    b.ln_f = testing::Upload(ops, s.ln_f);
    b.head = testing::Upload(ops, s.head);
    for (const parallel::TspShard& t : s.tsp_blocks) {
      std::vector<kernels::OpsBuffer> f;
      for (const std::vector<float>* v : {&t.ln1, &t.ln2, &t.attn, &t.mlp}) {
        f.push_back(testing::Upload(ops, *v));
      }
      b.tsp.push_back(std::move(f));
    }
    for (const parallel::BlockWeights& t : s.tpsp_blocks) {
      b.tpsp.push_back(BlockBuffers::Upload(ops, t));
    }
    return b;
  }

  // Valid once ops.Synchronize() has returned.
  parallel::DistributedShard Download(const kernels::TransformerOps& ops) const {
    parallel::DistributedShard s;
    s.embedding = testing::Download(ops, embedding);
    s.pos_embedding = testing::Download(ops, pos_embedding);
    s.ln_f = testing::Download(ops, ln_f);
    s.head = testing::Download(ops, head);
    for (const std::vector<kernels::OpsBuffer>& f : tsp) {
      parallel::TspShard t;
      t.ln1 = testing::Download(ops, f[0]);
      t.ln2 = testing::Download(ops, f[1]);
      t.attn = testing::Download(ops, f[2]);
      t.mlp = testing::Download(ops, f[3]);
      s.tsp_blocks.push_back(std::move(t));
    }
    for (const BlockBuffers& t : tpsp) s.tpsp_blocks.push_back(t.Download(ops));
    return s;
  }

  parallel::DistributedShardView view() const {
    parallel::DistributedShardView v;
    v.embedding = embedding.data();
    v.pos_embedding = pos_embedding.data();
    v.ln_f = ln_f.data();
    v.head = head.data();
    for (const std::vector<kernels::OpsBuffer>& f : tsp) {
      v.tsp_blocks.push_back({f[0].data(), f[1].data(), f[2].data(), f[3].data()});
    }
    for (const BlockBuffers& t : tpsp) v.tpsp_blocks.push_back(t.view());
    return v;
  }

  parallel::DistributedGradsView grads() const {
    parallel::DistributedGradsView g;
    g.embedding = embedding.data();
    g.pos_embedding = pos_embedding.data();
    g.ln_f = ln_f.data();
    g.head = head.data();
    for (const std::vector<kernels::OpsBuffer>& f : tsp) {
      g.tsp_blocks.push_back({f[0].data(), f[1].data(), f[2].data(), f[3].data()});
    }
    for (const BlockBuffers& t : tpsp) g.tpsp_blocks.push_back(t.grads());
    return g;
  }
};

}  // namespace testing
}  // namespace stallfree
