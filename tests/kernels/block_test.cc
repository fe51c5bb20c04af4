// The CPU ops composed into PyTorch's pre-norm transformer block, forward and backward, against
// the tensors torch recorded in tests/testdata/torch/block_seed*/ (see each manifest.json):
//   h = x + attn(rmsnorm(x, ln1)),  y = h + mlp(rmsnorm(h, ln2)),  loss = sum(y * dy),
// with causal multi-head attention (no positional encoding, no biases) and the SwiGLU MLP
// mlp(n) = (silu(n Wg^T) * (n Wu^T)) Wd^T. q, k, v come from one fused [3C, C] projection, so the
// attention also runs on column slices of one buffer, as the layers use it.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/ops.h"
#include "tests/kernels/testdata.h"

namespace stallfree {
namespace kernels {
namespace {

// The number after "key": in manifest.json (a flat scan is enough for its fixed format).
double ManifestNumber(const std::string& json, const std::string& key) {
  const std::string tag = "\"" + key + "\":";
  const size_t at = json.find(tag);
  if (at == std::string::npos) return -1;
  return std::stod(json.substr(at + tag.size()));
}

struct BlockData {
  int64_t B = 0, T = 0, C = 0, H = 0, FF = 0;
  float eps = 0;
  std::vector<float> x, ln1, wq, wk, wv, wo, ln2, wg, wu, wd, dy;
  std::vector<float> y, grad_x, grad_ln1, grad_ln2, grad_wq, grad_wk, grad_wv, grad_wo, grad_wg,
      grad_wu, grad_wd;
};

// Loads one seed's directory; fails the test (fatally) on a missing file or a size that does
// not match the manifest's shapes.
void Load(const std::string& dir, BlockData* d) {
  std::ifstream mf(dir + "manifest.json");
  ASSERT_TRUE(mf.good()) << "missing " << dir << "manifest.json";
  std::stringstream ss;
  ss << mf.rdbuf();
  const std::string json = ss.str();
  d->B = static_cast<int64_t>(ManifestNumber(json, "B"));
  d->T = static_cast<int64_t>(ManifestNumber(json, "T"));
  d->C = static_cast<int64_t>(ManifestNumber(json, "C"));
  d->H = static_cast<int64_t>(ManifestNumber(json, "H"));
  d->FF = static_cast<int64_t>(ManifestNumber(json, "FF"));
  d->eps = static_cast<float>(ManifestNumber(json, "rmsnorm_eps"));
  ASSERT_GT(d->B * d->T * d->C * d->H * d->FF, 0) << "unreadable shapes in " << dir;
  ASSERT_GT(d->eps, 0.0f) << "unreadable rmsnorm_eps in " << dir;
  ASSERT_EQ(d->C % d->H, 0);
  const int64_t btc = d->B * d->T * d->C, cc = d->C * d->C, fc = d->FF * d->C;
  struct File {
    const char* name;
    std::vector<float>* dst;
    int64_t size;
  };
  const File files[] = {
      {"x", &d->x, btc},
      {"ln1", &d->ln1, d->C},
      {"Wq", &d->wq, cc},
      {"Wk", &d->wk, cc},
      {"Wv", &d->wv, cc},
      {"Wo", &d->wo, cc},
      {"ln2", &d->ln2, d->C},
      {"Wg", &d->wg, fc},
      {"Wu", &d->wu, fc},
      {"Wd", &d->wd, fc},
      {"dy", &d->dy, btc},
      {"y", &d->y, btc},
      {"grad_x", &d->grad_x, btc},
      {"grad_ln1", &d->grad_ln1, d->C},
      {"grad_ln2", &d->grad_ln2, d->C},
      {"grad_Wq", &d->grad_wq, cc},
      {"grad_Wk", &d->grad_wk, cc},
      {"grad_Wv", &d->grad_wv, cc},
      {"grad_Wo", &d->grad_wo, cc},
      {"grad_Wg", &d->grad_wg, fc},
      {"grad_Wu", &d->grad_wu, fc},
      {"grad_Wd", &d->grad_wd, fc},
  };
  for (const File& f : files) {
    const std::string path = dir + f.name + ".f32";
    *f.dst = testing::LoadF32(path);
    ASSERT_EQ(static_cast<int64_t>(f.dst->size()), f.size) << path << " (missing or wrong size)";
  }
}

struct BlockResult {
  std::vector<float> y, dx, dln1, dln2, dwq, dwk, dwv, dwo, dwg, dwu, dwd;
};

// Forward and backward of the block with the ops, as a layer stack would call them.
BlockResult RunBlock(const BlockData& d) {
  const TransformerOps& ops = CpuOps();
  const int64_t n = d.B * d.T, C = d.C, FF = d.FF, C3 = 3 * C;
  BlockResult r;

  // Fused projection weight [3C, C] = Wq | Wk | Wv stacked by rows.
  std::vector<float> wqkv;
  for (const std::vector<float>* w : {&d.wq, &d.wk, &d.wv}) {
    wqkv.insert(wqkv.end(), w->begin(), w->end());
  }
  AttentionShape s;
  s.batch = d.B;
  s.tq = s.tk = d.T;
  s.heads = d.H;
  s.head_dim = C / d.H;
  s.q_ld = s.k_ld = s.v_ld = C3;
  s.out_ld = C;
  std::vector<int32_t> pos(d.T);
  std::iota(pos.begin(), pos.end(), 0);

  // Forward.
  std::vector<float> n1(n * C), rstd1(n), qkv(n * C3), att(n * C), lse(d.B * d.H * d.T);
  std::vector<float> h(n * C), n2(n * C), rstd2(n), g(n * FF), u(n * FF), m(n * FF);
  std::vector<float> mlp(n * C);
  r.y.resize(n * C);
  ops.RmsNormForward(d.x.data(), d.ln1.data(), n, C, d.eps, n1.data(), rstd1.data());
  ops.Gemm(Trans::kNo, Trans::kYes, n, C3, C, 1, n1.data(), C, wqkv.data(), C, 0, qkv.data(), C3);
  ops.AttentionForward(s, qkv.data(), qkv.data() + C, qkv.data() + 2 * C, pos.data(), pos.data(),
                       att.data(), lse.data());
  ops.Gemm(Trans::kNo, Trans::kYes, n, C, C, 1, att.data(), C, d.wo.data(), C, 0, h.data(), C);
  ops.Add(d.x.data(), h.data(), n * C, h.data());
  ops.RmsNormForward(h.data(), d.ln2.data(), n, C, d.eps, n2.data(), rstd2.data());
  ops.Gemm(Trans::kNo, Trans::kYes, n, FF, C, 1, n2.data(), C, d.wg.data(), C, 0, g.data(), FF);
  ops.Gemm(Trans::kNo, Trans::kYes, n, FF, C, 1, n2.data(), C, d.wu.data(), C, 0, u.data(), FF);
  ops.SwiGluForward(g.data(), u.data(), n * FF, m.data());
  ops.Gemm(Trans::kNo, Trans::kYes, n, C, FF, 1, m.data(), FF, d.wd.data(), FF, 0, mlp.data(), C);
  ops.Add(h.data(), mlp.data(), n * C, r.y.data());

  // Backward of loss = sum(y * dy): dL/dy = dy, through both residual branches.
  const std::vector<float>& dy = d.dy;
  r.dwd.resize(FF * C);
  r.dwg.resize(FF * C);
  r.dwu.resize(FF * C);
  r.dwo.resize(C * C);
  r.dln1.assign(C, 0.0f);  // RMSNorm accumulates dw.
  r.dln2.assign(C, 0.0f);
  r.dx.resize(n * C);
  std::vector<float> dm(n * FF), dg(n * FF), du(n * FF), dn2(n * C), dh(n * C), datt(n * C);
  std::vector<float> dqkv(n * C3), dwqkv(C3 * C), dn1(n * C);
  // mlp = m Wd^T: dWd = dmlp^T m, dm = dmlp Wd.
  ops.Gemm(Trans::kYes, Trans::kNo, C, FF, n, 1, dy.data(), C, m.data(), FF, 0, r.dwd.data(), FF);
  ops.Gemm(Trans::kNo, Trans::kNo, n, FF, C, 1, dy.data(), C, d.wd.data(), FF, 0, dm.data(), FF);
  ops.SwiGluBackward(g.data(), u.data(), dm.data(), n * FF, dg.data(), du.data());
  ops.Gemm(Trans::kYes, Trans::kNo, FF, C, n, 1, dg.data(), FF, n2.data(), C, 0, r.dwg.data(), C);
  ops.Gemm(Trans::kYes, Trans::kNo, FF, C, n, 1, du.data(), FF, n2.data(), C, 0, r.dwu.data(), C);
  ops.Gemm(Trans::kNo, Trans::kNo, n, C, FF, 1, dg.data(), FF, d.wg.data(), C, 0, dn2.data(), C);
  ops.Gemm(Trans::kNo, Trans::kNo, n, C, FF, 1, du.data(), FF, d.wu.data(), C, 1, dn2.data(), C);
  ops.RmsNormBackward(h.data(), d.ln2.data(), rstd2.data(), dn2.data(), n, C, dh.data(),
                      r.dln2.data());
  ops.Add(dh.data(), dy.data(), n * C, dh.data());  // The residual's identity branch.
  // h = x + att Wo^T.
  ops.Gemm(Trans::kYes, Trans::kNo, C, C, n, 1, dh.data(), C, att.data(), C, 0, r.dwo.data(), C);
  ops.Gemm(Trans::kNo, Trans::kNo, n, C, C, 1, dh.data(), C, d.wo.data(), C, 0, datt.data(), C);
  ops.AttentionBackward(s, qkv.data(), qkv.data() + C, qkv.data() + 2 * C, pos.data(), pos.data(),
                        att.data(), lse.data(), datt.data(), dqkv.data(), dqkv.data() + C,
                        dqkv.data() + 2 * C);
  ops.Gemm(Trans::kYes, Trans::kNo, C3, C, n, 1, dqkv.data(), C3, n1.data(), C, 0, dwqkv.data(), C);
  ops.Gemm(Trans::kNo, Trans::kNo, n, C, C3, 1, dqkv.data(), C3, wqkv.data(), C, 0, dn1.data(), C);
  ops.RmsNormBackward(d.x.data(), d.ln1.data(), rstd1.data(), dn1.data(), n, C, r.dx.data(),
                      r.dln1.data());
  ops.Add(r.dx.data(), dh.data(), n * C, r.dx.data());
  r.dwq.assign(dwqkv.begin(), dwqkv.begin() + C * C);
  r.dwk.assign(dwqkv.begin() + C * C, dwqkv.begin() + 2 * C * C);
  r.dwv.assign(dwqkv.begin() + 2 * C * C, dwqkv.end());
  return r;
}

// fp32 against fp32 computed with a different operation order (torch's kernels vs ours): every
// element within 2e-5 of the reference tensor's largest magnitude. The worst element measured is
// under 1e-6 of it (the ratio is recorded in test.xml); a wrong formula anywhere in the chain
// moves elements by a sizeable fraction of the scale.
constexpr double kRelTol = 2e-5;

void ExpectTensorNear(const std::vector<float>& got, const std::vector<float>& want,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0, worst = 0;
  for (float w : want) scale = std::max(scale, static_cast<double>(std::fabs(w)));
  ASSERT_GT(scale, 0.0) << what << " reference is all zero";
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
    ASSERT_NEAR(got[i], want[i], kRelTol * scale) << what << " element " << i;
  }
  std::ostringstream rel;
  rel << worst / scale;
  ::testing::Test::RecordProperty(what + "_max_err_rel", rel.str());  // In test.xml.
}

class TorchBlock : public ::testing::TestWithParam<const char*> {};

TEST_P(TorchBlock, ReproducesForwardAndEveryGradient) {
  BlockData d;
  ASSERT_NO_FATAL_FAILURE(Load(std::string("tests/testdata/torch/") + GetParam() + "/", &d));
  const BlockResult r = RunBlock(d);
  ExpectTensorNear(r.y, d.y, "y");
  ExpectTensorNear(r.dx, d.grad_x, "grad_x");
  ExpectTensorNear(r.dln1, d.grad_ln1, "grad_ln1");
  ExpectTensorNear(r.dln2, d.grad_ln2, "grad_ln2");
  ExpectTensorNear(r.dwq, d.grad_wq, "grad_Wq");
  ExpectTensorNear(r.dwk, d.grad_wk, "grad_Wk");
  ExpectTensorNear(r.dwv, d.grad_wv, "grad_Wv");
  ExpectTensorNear(r.dwo, d.grad_wo, "grad_Wo");
  ExpectTensorNear(r.dwg, d.grad_wg, "grad_Wg");
  ExpectTensorNear(r.dwu, d.grad_wu, "grad_Wu");
  ExpectTensorNear(r.dwd, d.grad_wd, "grad_Wd");
}

INSTANTIATE_TEST_SUITE_P(Seeds, TorchBlock, ::testing::Values("block_seed1", "block_seed2"));

}  // namespace
}  // namespace kernels
}  // namespace stallfree
