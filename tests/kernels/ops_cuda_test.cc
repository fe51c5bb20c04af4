// The CUDA transformer ops against the CPU backend on random inputs. A plain binary (run by hand
// or by make gpu-check): one "PASS|FAIL <name> max_err=<x> tol=<y>" line per check, where max_err
// is max |gpu - cpu| / max |cpu| over the compared buffer (padding included, so writes outside a
// strided view are caught too); exit status 1 if any check fails. Without a device it prints
// "SKIP: <reason>" and exits 0. It ends with a timing of the attention forward ("FIGURE ...").
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/ops.h"
#include "tests/kernels/cuda_test_util.h"

namespace {

using stallfree::kernels::AttentionShape;
using stallfree::kernels::CpuOps;
using stallfree::kernels::Trans;
using stallfree::kernels::TransformerOps;
using stallfree::testing::CheckOk;
using stallfree::testing::DeviceArray;

int g_failures = 0;

std::mt19937 g_rng(20240611);

std::vector<float> Uniform(size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(g_rng);
  return v;
}

std::vector<int32_t> RandomInts(size_t n, int32_t lo, int32_t hi) {
  std::uniform_int_distribution<int32_t> dist(lo, hi);
  std::vector<int32_t> v(n);
  for (int32_t& x : v) x = dist(g_rng);
  return v;
}

// max |gpu - cpu| / max |cpu| (finite cpu values). Equal infinities count as equal; a NaN, or an
// infinity on one side only, is an infinite error.
double MaxErr(const std::vector<float>& gpu, const std::vector<float>& cpu) {
  if (gpu.size() != cpu.size()) return std::numeric_limits<double>::infinity();
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double g = gpu[i], c = cpu[i];
    if (std::isnan(g) || std::isnan(c)) return std::numeric_limits<double>::infinity();
    if (std::isinf(g) || std::isinf(c)) {
      if (g != c) return std::numeric_limits<double>::infinity();
      continue;
    }
    max_diff = std::max(max_diff, std::fabs(g - c));
    max_ref = std::max(max_ref, std::fabs(c));
  }
  if (max_diff == 0) return 0;
  return max_diff / std::max(max_ref, 1e-30);
}

void Report(const std::string& name, double err, double tol) {
  const bool ok = err <= tol;
  if (!ok) ++g_failures;
  std::printf("%s %s max_err=%.3g tol=%.3g\n", ok ? "PASS" : "FAIL", name.c_str(), err, tol);
}

void Compare(const std::string& name, const std::vector<float>& gpu,
             const std::vector<float>& cpu, double tol) {
  Report(name, MaxErr(gpu, cpu), tol);
}

// The backend's first recorded error for this check, or "" (and the stream drained).
bool SyncOk(const TransformerOps& ops, const std::string& name) {
  const std::string e = ops.Synchronize();
  if (e.empty()) return true;
  ++g_failures;
  std::printf("FAIL %s: %s\n", name.c_str(), e.c_str());
  return false;
}

const char* TransName(Trans t) { return t == Trans::kYes ? "T" : "N"; }

// ---------------------------------------------------------------------------------------------

void TestGemm(const TransformerOps& gpu) {
  const int64_t m = 67, n = 45, k = 93;
  const float alpha = 0.75f, beta = -0.5f;
  for (Trans ta : {Trans::kNo, Trans::kYes}) {
    for (Trans tb : {Trans::kNo, Trans::kYes}) {
      // Stored shapes: A [m,k] or [k,m], B [k,n] or [n,k]; every leading dimension has padding.
      const int64_t a_rows = ta == Trans::kNo ? m : k, a_cols = ta == Trans::kNo ? k : m;
      const int64_t b_rows = tb == Trans::kNo ? k : n, b_cols = tb == Trans::kNo ? n : k;
      const int64_t lda = a_cols + 3, ldb = b_cols + 5, ldc = n + 7;
      std::vector<float> a = Uniform(a_rows * lda, -1, 1), b = Uniform(b_rows * ldb, -1, 1);
      std::vector<float> c = Uniform(m * ldc, -1, 1);
      const std::string tag = std::string(TransName(ta)) + TransName(tb);

      std::vector<float> c_cpu = c;
      CpuOps().Gemm(ta, tb, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c_cpu.data(), ldc);
      DeviceArray<float> da(a), db(b), dc(c);
      gpu.Gemm(ta, tb, m, n, k, alpha, da.get(), lda, db.get(), ldb, beta, dc.get(), ldc);
      if (SyncOk(gpu, "gemm_" + tag)) Compare("gemm_fp32_" + tag, dc.Get(), c_cpu, 1e-5);

      // bf16: the CPU fp32 GEMM on the bf16-rounded inputs is the reference (the products are
      // exact in fp32, so only the accumulation order differs).
      std::vector<uint16_t> a16(a.size()), b16(b.size());
      std::vector<float> ar(a.size()), br(b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        a16[i] = stallfree::FloatToBf16(a[i]);
        ar[i] = stallfree::Bf16ToFloat(a16[i]);
      }
      for (size_t i = 0; i < b.size(); ++i) {
        b16[i] = stallfree::FloatToBf16(b[i]);
        br[i] = stallfree::Bf16ToFloat(b16[i]);
      }
      std::vector<float> c16_cpu = c;
      CpuOps().Gemm(ta, tb, m, n, k, alpha, ar.data(), lda, br.data(), ldb, beta, c16_cpu.data(),
                    ldc);
      DeviceArray<uint16_t> da16(a16), db16(b16);
      DeviceArray<float> dc16(c);
      gpu.GemmBf16(ta, tb, m, n, k, alpha, da16.get(), lda, db16.get(), ldb, beta, dc16.get(),
                   ldc);
      if (SyncOk(gpu, "gemm_bf16_" + tag)) Compare("gemm_bf16_" + tag, dc16.Get(), c16_cpu, 1e-4);
    }
  }
}

void TestEmbedding(const TransformerOps& gpu) {
  const int64_t vocab = 50, dim = 300, n = 333;  // many repeated ids; dim > one block's threads
  std::vector<float> table = Uniform(vocab * dim, -1, 1);
  std::vector<int32_t> ids = RandomInts(n, 0, vocab - 1);
  ids[5] = ids[6] = ids[100] = 7;  // a run of equal ids next to each other and apart
  std::vector<float> out_cpu(n * dim);
  CpuOps().EmbeddingForward(table.data(), dim, ids.data(), n, out_cpu.data());
  DeviceArray<float> dtable_in(table), dout(std::vector<float>(n * dim, 0.0f));
  DeviceArray<int32_t> dids(ids);
  gpu.EmbeddingForward(dtable_in.get(), dim, dids.get(), n, dout.get());
  if (SyncOk(gpu, "embedding_fwd")) Compare("embedding_fwd", dout.Get(), out_cpu, 0);

  std::vector<float> grad = Uniform(n * dim, -1, 1);
  std::vector<float> dtable = Uniform(vocab * dim, -1, 1);  // accumulates onto existing values
  std::vector<float> dtable_cpu = dtable;
  CpuOps().EmbeddingBackward(grad.data(), dim, ids.data(), n, dtable_cpu.data());
  DeviceArray<float> dgrad(grad), ddtable(dtable);
  gpu.EmbeddingBackward(dgrad.get(), dim, dids.get(), n, ddtable.get());
  if (SyncOk(gpu, "embedding_bwd")) Compare("embedding_bwd", ddtable.Get(), dtable_cpu, 1e-5);
}

void TestRmsNorm(const TransformerOps& gpu, int64_t rows, int64_t dim) {
  const std::string tag = std::to_string(rows) + "x" + std::to_string(dim);
  const float eps = 1e-5f;
  std::vector<float> x = Uniform(rows * dim, -2, 2), w = Uniform(dim, 0.5f, 1.5f);
  std::vector<float> y_cpu(rows * dim), rstd_cpu(rows);
  CpuOps().RmsNormForward(x.data(), w.data(), rows, dim, eps, y_cpu.data(), rstd_cpu.data());
  DeviceArray<float> dx_in(x), dw_in(w), dy_out(y_cpu), drstd(rstd_cpu);
  gpu.RmsNormForward(dx_in.get(), dw_in.get(), rows, dim, eps, dy_out.get(), drstd.get());
  if (SyncOk(gpu, "rmsnorm_fwd_" + tag)) {
    Compare("rmsnorm_fwd_y_" + tag, dy_out.Get(), y_cpu, 1e-5);
    Compare("rmsnorm_fwd_rstd_" + tag, drstd.Get(), rstd_cpu, 1e-5);
  }

  // Backward from the CPU's rstd, so the two sides see identical inputs.
  DeviceArray<float> drstd_cpu(rstd_cpu);
  std::vector<float> dy = Uniform(rows * dim, -1, 1);
  std::vector<float> dwt = Uniform(dim, -1, 1);  // dw accumulates
  std::vector<float> dx_cpu(rows * dim), dw_cpu = dwt;
  CpuOps().RmsNormBackward(x.data(), w.data(), rstd_cpu.data(), dy.data(), rows, dim,
                           dx_cpu.data(), dw_cpu.data());
  DeviceArray<float> ddy(dy), ddx(std::vector<float>(rows * dim, 0.0f)), ddw(dwt);
  gpu.RmsNormBackward(dx_in.get(), dw_in.get(), drstd_cpu.get(), ddy.get(), rows, dim, ddx.get(),
                      ddw.get());
  if (SyncOk(gpu, "rmsnorm_bwd_" + tag)) {
    Compare("rmsnorm_bwd_dx_" + tag, ddx.Get(), dx_cpu, 1e-5);
    Compare("rmsnorm_bwd_dw_" + tag, ddw.Get(), dw_cpu, 1e-5);
  }
}

void TestSwiGlu(const TransformerOps& gpu) {
  const int64_t n = 10007;
  std::vector<float> gate = Uniform(n, -10, 10), up = Uniform(n, -2, 2), dout = Uniform(n, -1, 1);
  std::vector<float> out_cpu(n), dgate_cpu(n), dup_cpu(n);
  CpuOps().SwiGluForward(gate.data(), up.data(), n, out_cpu.data());
  CpuOps().SwiGluBackward(gate.data(), up.data(), dout.data(), n, dgate_cpu.data(),
                          dup_cpu.data());
  DeviceArray<float> dg(gate), du(up), ddo(dout), dout_f(out_cpu), ddg(out_cpu), ddu(out_cpu);
  gpu.SwiGluForward(dg.get(), du.get(), n, dout_f.get());
  gpu.SwiGluBackward(dg.get(), du.get(), ddo.get(), n, ddg.get(), ddu.get());
  if (SyncOk(gpu, "swiglu")) {
    Compare("swiglu_fwd", dout_f.Get(), out_cpu, 1e-5);
    Compare("swiglu_bwd_dgate", ddg.Get(), dgate_cpu, 1e-5);
    Compare("swiglu_bwd_dup", ddu.Get(), dup_cpu, 1e-5);
  }
}

void TestCrossEntropy(const TransformerOps& gpu, int64_t rows, int64_t vocab) {
  const std::string tag = std::to_string(rows) + "x" + std::to_string(vocab);
  std::vector<float> logits = Uniform(rows * vocab, -6, 6);
  std::vector<int32_t> targets = RandomInts(rows, 0, vocab - 1);
  int64_t valid = 0;
  for (int64_t i = 0; i < rows; ++i) {
    if (i % 3 == 1) targets[i] = -1;  // ignored rows
    if (targets[i] >= 0) ++valid;
  }
  std::vector<float> loss_cpu(rows), lse_cpu(rows);
  CpuOps().CrossEntropyForward(logits.data(), rows, vocab, targets.data(), loss_cpu.data(),
                               lse_cpu.data());
  DeviceArray<float> dlogits_in(logits), dloss(loss_cpu), dlse(lse_cpu);
  DeviceArray<int32_t> dtargets(targets);
  gpu.CrossEntropyForward(dlogits_in.get(), rows, vocab, dtargets.get(), dloss.get(), dlse.get());
  if (SyncOk(gpu, "cross_entropy_fwd_" + tag)) {
    Compare("cross_entropy_fwd_loss_" + tag, dloss.Get(), loss_cpu, 1e-5);
    // lse of ignored rows is unspecified by the contract: compare the rows that count.
    std::vector<float> lse_gpu = dlse.Get(), a, b;
    for (int64_t i = 0; i < rows; ++i) {
      if (targets[i] >= 0) {
        a.push_back(lse_gpu[i]);
        b.push_back(lse_cpu[i]);
      }
    }
    Compare("cross_entropy_fwd_lse_" + tag, a, b, 1e-5);
  }

  const float dl = 1.0f / static_cast<float>(std::max<int64_t>(valid, 1));
  std::vector<float> dlogits_cpu(rows * vocab);
  CpuOps().CrossEntropyBackward(logits.data(), lse_cpu.data(), targets.data(), rows, vocab, dl,
                                dlogits_cpu.data());
  DeviceArray<float> dlse_cpu(lse_cpu), ddlogits(std::vector<float>(rows * vocab, 9.0f));
  gpu.CrossEntropyBackward(dlogits_in.get(), dlse_cpu.get(), dtargets.get(), rows, vocab, dl,
                           ddlogits.get());
  if (SyncOk(gpu, "cross_entropy_bwd_" + tag)) {
    Compare("cross_entropy_bwd_" + tag, ddlogits.Get(), dlogits_cpu, 1e-5);
  }
}

void TestAdd(const TransformerOps& gpu) {
  const int64_t n = 10003;
  std::vector<float> a = Uniform(n + 1, -1, 1), b = Uniform(n + 1, -1, 1);
  // Aligned (float4 path plus tail), misaligned (offset by one float: scalar path), and in place.
  for (int offset : {0, 1}) {
    const int64_t len = n - offset;
    std::vector<float> ref(len);
    for (int64_t i = 0; i < len; ++i) ref[i] = a[offset + i] + b[offset + i];
    DeviceArray<float> da(a), db(b), dout(std::vector<float>(n + 1, 0.0f));
    gpu.Add(da.get() + offset, db.get() + offset, len, dout.get() + offset);
    gpu.Add(da.get() + offset, db.get() + offset, len, da.get() + offset);  // out aliases a
    if (SyncOk(gpu, "add")) {
      std::vector<float> out = dout.Get(), inplace = da.Get();
      const std::string tag = offset == 0 ? "aligned" : "misaligned";
      Compare("add_" + tag, std::vector<float>(out.begin() + offset, out.begin() + offset + len),
              ref, 0);
      Compare("add_inplace_" + tag,
              std::vector<float>(inplace.begin() + offset, inplace.begin() + offset + len), ref, 0);
    }
  }
}

// The memory methods: zero-initialised allocation, fill (zero and non-zero), device copies,
// strided 2-D copy, bit-exact int32 round trip. Exact comparisons.
void TestMemory(const TransformerOps& gpu) {
  using stallfree::kernels::OpsBuffer;
  const int64_t rows = 33, cols = 17, src_ld = 40, dst_ld = 21, n = rows * src_ld;
  std::vector<float> src = Uniform(n, -1, 1);
  OpsBuffer a(&gpu, n), b(&gpu, n), c(&gpu, rows * dst_ld), z(&gpu, 1001);
  std::vector<float> zeros(1001, -1.0f), copy(n), got(rows * dst_ld);
  gpu.Download(zeros.data(), z.data(), z.size());
  gpu.Upload(a.data(), src.data(), n);
  gpu.CopyFloats(b.data(), a.data(), n);
  gpu.Download(copy.data(), b.data(), n);
  gpu.Fill(c.data(), rows * dst_ld, 2.5f);
  gpu.Copy2D(c.data() + 2, dst_ld, a.data() + 3, src_ld, rows, cols);
  gpu.Download(got.data(), c.data(), rows * dst_ld);
  const std::vector<int32_t> ints = {0, 1, -1, 7, 1 << 30};
  std::vector<int32_t> back(ints.size());
  OpsBuffer d(&gpu, static_cast<int64_t>(ints.size()));
  gpu.Upload(d.data(), reinterpret_cast<const float*>(ints.data()), d.size());
  gpu.Download(reinterpret_cast<float*>(back.data()), d.data(), d.size());
  OpsBuffer f(&gpu, 10);
  gpu.Fill(f.data(), 10, 0.0f);
  gpu.Fill(f.data() + 3, 4, -3.0f);
  std::vector<float> fill(10);
  gpu.Download(fill.data(), f.data(), 10);
  if (!SyncOk(gpu, "memory")) return;
  Compare("memory_alloc_zero", zeros, std::vector<float>(1001, 0.0f), 0);
  Compare("memory_copy", copy, src, 0);
  std::vector<float> want(rows * dst_ld, 2.5f);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) want[i * dst_ld + 2 + j] = src[i * src_ld + 3 + j];
  }
  Compare("memory_copy2d", got, want, 0);
  Report("memory_int_bits", back == ints ? 0 : 1, 0);
  Compare("memory_fill", fill, {0, 0, 0, -3, -3, -3, -3, 0, 0, 0}, 0);
}

// ---------------------------------------------------------------------------------------------
// Attention. Buffers are laid out as the layers do: q, k, v column slices of fused projections
// (with padding columns at the end of each row), so strides and out-of-view writes are tested.

struct AttnCase {
  std::string name;
  int64_t batch, tq, tk, heads, head_dim;
  bool fused_qkv;  // q, k, v in one [batch * t, ld] buffer (needs tq == tk); else q | kv
  std::vector<int32_t> q_pos, k_pos;
};

// Positions of t tokens in the zigzag order of rank `rank` of `ranks` ranks (its chunks r and
// 2 * ranks - 1 - r of 2 * ranks equal chunks), starting at `base`.
std::vector<int32_t> Zigzag(int64_t t, int ranks, int rank, int32_t base) {
  const int64_t chunks = 2 * ranks, len = t / chunks;
  std::vector<int32_t> pos;
  for (int64_t c : {static_cast<int64_t>(rank), chunks - 1 - rank}) {
    for (int64_t i = 0; i < len; ++i) pos.push_back(static_cast<int32_t>(base + c * len + i));
  }
  return pos;
}

void TestAttention(const TransformerOps& gpu, const AttnCase& tc) {
  const int64_t hd = tc.heads * tc.head_dim;
  AttentionShape s;
  s.batch = tc.batch;
  s.tq = tc.tq;
  s.tk = tc.tk;
  s.heads = tc.heads;
  s.head_dim = tc.head_dim;
  s.out_ld = hd + 3;
  int64_t q_off, k_off, v_off, q_rows, kv_rows, q_ld, kv_ld;
  if (tc.fused_qkv) {
    q_ld = kv_ld = 3 * hd + 5;
    q_off = 0, k_off = hd, v_off = 2 * hd;
  } else {
    q_ld = hd + 6;
    kv_ld = 2 * hd + 2;
    q_off = 0, k_off = 0, v_off = hd;
  }
  s.q_ld = q_ld;
  s.k_ld = s.v_ld = kv_ld;
  q_rows = tc.batch * tc.tq;
  kv_rows = tc.batch * tc.tk;

  // One buffer (fused) or two (q | kv); the gradients mirror them.
  std::vector<float> qbuf = Uniform(q_rows * q_ld, -2, 2);
  std::vector<float> kvbuf = tc.fused_qkv ? std::vector<float>() : Uniform(kv_rows * kv_ld, -2, 2);
  std::vector<float>& kvref = tc.fused_qkv ? qbuf : kvbuf;
  std::vector<float> out_cpu(q_rows * s.out_ld, 5.0f), lse_cpu(tc.batch * tc.heads * tc.tq, 5.0f);
  CpuOps().AttentionForward(s, qbuf.data() + q_off, kvref.data() + k_off, kvref.data() + v_off,
                            tc.q_pos.data(), tc.k_pos.data(), out_cpu.data(), lse_cpu.data());

  DeviceArray<float> dq_in(qbuf), dkv_in(tc.fused_qkv ? std::vector<float>(1) : kvbuf);
  float* dkv = tc.fused_qkv ? dq_in.get() : dkv_in.get();
  DeviceArray<int32_t> dqpos(tc.q_pos), dkpos(tc.k_pos);
  DeviceArray<float> dev_out(std::vector<float>(out_cpu.size(), 5.0f));
  DeviceArray<float> dev_lse(std::vector<float>(lse_cpu.size(), 5.0f));
  gpu.AttentionForward(s, dq_in.get() + q_off, dkv + k_off, dkv + v_off, dqpos.get(), dkpos.get(),
                       dev_out.get(), dev_lse.get());
  if (!SyncOk(gpu, "attention_fwd_" + tc.name)) return;
  std::vector<float> out_gpu = dev_out.Get(), lse_gpu = dev_lse.Get();
  Compare("attention_fwd_out_" + tc.name, out_gpu, out_cpu, 1e-4);
  Compare("attention_fwd_lse_" + tc.name, lse_gpu, lse_cpu, 1e-5);

  // Queries that see no key: out = 0 and lse = -inf exactly (checked on the GPU's own output,
  // whatever the CPU does).
  int masked = 0;
  bool masked_ok = true;
  for (int64_t i = 0; i < tc.tq; ++i) {
    bool sees = false;
    for (int64_t j = 0; j < tc.tk; ++j) sees |= tc.k_pos[j] <= tc.q_pos[i];
    if (sees) continue;
    ++masked;
    for (int64_t b = 0; b < tc.batch; ++b) {
      for (int64_t h = 0; h < tc.heads; ++h) {
        masked_ok &= std::isinf(lse_gpu[(b * tc.heads + h) * tc.tq + i]) &&
                     lse_gpu[(b * tc.heads + h) * tc.tq + i] < 0;
        for (int64_t d = 0; d < tc.head_dim; ++d) {
          masked_ok &= out_gpu[(b * tc.tq + i) * s.out_ld + h * tc.head_dim + d] == 0.0f;
        }
      }
    }
  }
  if (masked > 0) {
    Report("attention_fwd_masked_query_" + tc.name, masked_ok ? 0.0 : 1.0, 0);
  }

  // Backward from the CPU's out and lse, so both sides see identical inputs.
  std::vector<float> dout_grad = Uniform(out_cpu.size(), -1, 1);
  std::vector<float> gq_cpu(qbuf.size(), 3.0f), gkv_cpu(kvbuf.size(), 3.0f);
  std::vector<float>& gkvref = tc.fused_qkv ? gq_cpu : gkv_cpu;
  CpuOps().AttentionBackward(s, qbuf.data() + q_off, kvref.data() + k_off, kvref.data() + v_off,
                             tc.q_pos.data(), tc.k_pos.data(), out_cpu.data(), lse_cpu.data(),
                             dout_grad.data(), gq_cpu.data() + q_off, gkvref.data() + k_off,
                             gkvref.data() + v_off);
  DeviceArray<float> dout_cpu(out_cpu), dlse_cpu(lse_cpu), ddout(dout_grad);
  DeviceArray<float> dgq(std::vector<float>(qbuf.size(), 3.0f));
  DeviceArray<float> dgkv(std::vector<float>(std::max<size_t>(kvbuf.size(), 1), 3.0f));
  float* gkv = tc.fused_qkv ? dgq.get() : dgkv.get();
  gpu.AttentionBackward(s, dq_in.get() + q_off, dkv + k_off, dkv + v_off, dqpos.get(),
                        dkpos.get(), dout_cpu.get(), dlse_cpu.get(), ddout.get(),
                        dgq.get() + q_off, gkv + k_off, gkv + v_off);
  if (!SyncOk(gpu, "attention_bwd_" + tc.name)) return;
  // Fused: one buffer holds dq | dk | dv; compare each slice separately for a clearer report.
  const std::vector<float> gq = dgq.Get();
  const std::vector<float> gkv_host = tc.fused_qkv ? gq : dgkv.Get();
  auto slice = [](const std::vector<float>& buf, int64_t rows, int64_t ld, int64_t off,
                  int64_t width) {
    std::vector<float> out;
    for (int64_t r = 0; r < rows; ++r) {
      out.insert(out.end(), buf.begin() + r * ld + off, buf.begin() + r * ld + off + width);
    }
    return out;
  };
  Compare("attention_bwd_dq_" + tc.name, slice(gq, q_rows, q_ld, q_off, hd),
          slice(gq_cpu, q_rows, q_ld, q_off, hd), 2e-4);
  Compare("attention_bwd_dk_" + tc.name, slice(gkv_host, kv_rows, kv_ld, k_off, hd),
          slice(gkvref, kv_rows, kv_ld, k_off, hd), 2e-4);
  Compare("attention_bwd_dv_" + tc.name, slice(gkv_host, kv_rows, kv_ld, v_off, hd),
          slice(gkvref, kv_rows, kv_ld, v_off, hd), 2e-4);
  // Whole buffers: the padding columns must be untouched on both sides.
  Compare("attention_bwd_padding_" + tc.name, gq, gq_cpu, 2e-4);
  if (!tc.fused_qkv) Compare("attention_bwd_kv_padding_" + tc.name, gkv_host, gkv_cpu, 2e-4);
}

void TestAttentionCases(const TransformerOps& gpu) {
  {
    // tq != tk, q and a fused kv buffer, 3 heads, head_dim 64: this rank's zigzag queries
    // against gathered keys in a shuffled order; one query at a position before every key.
    AttnCase c{"zigzag_hd64", 2, 100, 150, 3, 64, false, {}, {}};
    c.q_pos = Zigzag(200, 2, 0, 10);  // chunks 0 and 3 of 4 (50 positions each)
    c.q_pos[37] = 3;                  // sees no key: keys start at 10
    c.k_pos.resize(c.tk);
    std::iota(c.k_pos.begin(), c.k_pos.end(), 10);
    std::shuffle(c.k_pos.begin(), c.k_pos.end(), g_rng);
    TestAttention(gpu, c);
  }
  {
    // Self-attention of one rank's zigzag tokens, q/k/v in one fused buffer, head_dim 32.
    AttnCase c{"fused_zigzag_hd32", 1, 130, 130, 2, 32, true, {}, {}};
    c.q_pos = Zigzag(260, 2, 0, 0);  // chunks 0 and 3 of 4 (65 positions each)
    c.k_pos = c.q_pos;
    TestAttention(gpu, c);
  }
  {
    // head_dim 128, queries late in the sequence against all keys in order.
    AttnCase c{"late_queries_hd128", 1, 70, 200, 2, 128, false, {}, {}};
    for (int64_t i = 0; i < c.tq; ++i) c.q_pos.push_back(static_cast<int32_t>(130 + i));
    for (int64_t j = 0; j < c.tk; ++j) c.k_pos.push_back(static_cast<int32_t>(j));
    TestAttention(gpu, c);
  }
  {
    // head_dim 48 (padded inside the kernel), early queries: most key tiles are skipped, and
    // keys no query sees get zero dk / dv.
    AttnCase c{"early_queries_hd48", 2, 70, 200, 2, 48, false, {}, {}};
    for (int64_t i = 0; i < c.tq; ++i) c.q_pos.push_back(static_cast<int32_t>(i));
    for (int64_t j = 0; j < c.tk; ++j) c.k_pos.push_back(static_cast<int32_t>(j));
    TestAttention(gpu, c);
  }
}

// A head_dim beyond the kernels' limit records an error (and launches nothing); the error is
// reported once.
void TestAttentionLimit(const TransformerOps& gpu) {
  AttentionShape s;
  s.tq = s.tk = 4;
  s.head_dim = 160;
  s.q_ld = s.k_ld = s.v_ld = s.out_ld = 160;
  gpu.AttentionForward(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
  const std::string first = gpu.Synchronize(), second = gpu.Synchronize();
  const bool ok = !first.empty() && second.empty();
  Report("attention_head_dim_limit_error", ok ? 0.0 : 1.0, 0);
}

// ---------------------------------------------------------------------------------------------

void TimeAttention(const TransformerOps& gpu) {
  const int64_t t = 2048, heads = 16, head_dim = 64, hd = heads * head_dim;
  AttentionShape s;
  s.tq = s.tk = t;
  s.heads = heads;
  s.head_dim = head_dim;
  s.q_ld = s.k_ld = s.v_ld = s.out_ld = hd;
  std::vector<int32_t> pos(t);
  std::iota(pos.begin(), pos.end(), 0);
  DeviceArray<float> q(Uniform(t * hd, -1, 1)), k(Uniform(t * hd, -1, 1)),
      v(Uniform(t * hd, -1, 1)), out(std::vector<float>(t * hd)),
      lse(std::vector<float>(heads * t)), dout(Uniform(t * hd, -1, 1)),
      dq(std::vector<float>(t * hd)), dk(std::vector<float>(t * hd)),
      dv(std::vector<float>(t * hd));
  DeviceArray<int32_t> dpos(pos);
  using Clock = std::chrono::steady_clock;
  auto run_fwd = [&] {
    gpu.AttentionForward(s, q.get(), k.get(), v.get(), dpos.get(), dpos.get(), out.get(),
                         lse.get());
  };
  auto run_bwd = [&] {
    gpu.AttentionBackward(s, q.get(), k.get(), v.get(), dpos.get(), dpos.get(), out.get(),
                          lse.get(), dout.get(), dq.get(), dk.get(), dv.get());
  };
  for (int i = 0; i < 3; ++i) run_fwd(), run_bwd();
  if (!SyncOk(gpu, "attention_timing_warmup")) return;
  const int iters = 20;
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) run_fwd();
  if (!SyncOk(gpu, "attention_timing_fwd")) return;
  const double fwd_s = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
  t0 = Clock::now();
  for (int i = 0; i < iters; ++i) run_bwd();
  if (!SyncOk(gpu, "attention_timing_bwd")) return;
  const double bwd_s = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
  // Causal: only the t (t + 1) / 2 visible pairs count; 2 GEMMs (QK^T, PV) of 2 flops per MAC.
  const double pairs = static_cast<double>(t) * (t + 1) / 2;
  const double fwd_flops = 4.0 * pairs * head_dim * heads;
  std::printf("INFO attention t=%lld heads=%lld head_dim=%lld causal: fwd %.3f ms, bwd %.3f ms "
              "(bwd counted as 2.5x fwd flops: %.2f TFLOP/s)\n",
              static_cast<long long>(t), static_cast<long long>(heads),
              static_cast<long long>(head_dim), fwd_s * 1e3, bwd_s * 1e3,
              2.5 * fwd_flops / bwd_s * 1e-12);
  std::printf("FIGURE attention_fwd_tflops %.2f TFLOP/s\n", fwd_flops / fwd_s * 1e-12);
}

}  // namespace

int main() {
  std::string why;
  if (!stallfree::kernels::cuda::DeviceAvailable(&why)) {
    std::printf("SKIP: %s\n", why.c_str());
    return 0;
  }
  std::string error;
  std::unique_ptr<TransformerOps> gpu = stallfree::kernels::cuda::NewCudaOps(nullptr, &error);
  if (gpu == nullptr) {
    std::printf("FAIL NewCudaOps: %s\n", error.c_str());
    return 1;
  }
  TestGemm(*gpu);
  TestEmbedding(*gpu);
  TestRmsNorm(*gpu, 70, 300);
  TestRmsNorm(*gpu, 600, 64);
  TestRmsNorm(*gpu, 5000, 96);
  TestSwiGlu(*gpu);
  TestCrossEntropy(*gpu, 37, 1000);
  TestCrossEntropy(*gpu, 4, 50257);
  TestAdd(*gpu);
  TestMemory(*gpu);
  TestAttentionCases(*gpu);
  TestAttentionLimit(*gpu);
  TimeAttention(*gpu);
  std::printf("%s ops_cuda_test: %d check(s) failed\n", g_failures == 0 ? "PASS" : "FAIL",
              g_failures);
  return g_failures == 0 ? 0 : 1;
}
