#include "trainer/gpt.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <set>
#include <thread>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/client.h"
#include "engine/partition.h"
#include "engine/repartition.h"
#include "common/checksum.h"
#include "common/log.h"
#include "common/status.h"
#include "kernels/ops.h"
#include "kernels/optimizer.h"
#include "parallel/distributed_model.h"
#include "trainer/data.h"
#include "trainer/device.h"
#include "trainer/plot.h"

namespace stallfree {
namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;
using parallel::DistributedModel;
using parallel::DistributedShard;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Where a shard's (or its gradients') tensors are: a host DistributedShard's vectors, or a
// BackendShard's device memory.
struct ShardPointers {
  float* embedding = nullptr;
  float* pos_embedding = nullptr;             // null without learned positions
  std::vector<std::array<float*, 4>> blocks;  // each TSP block's ln1, ln2, attn, mlp
  float* ln_f = nullptr;
  float* head = nullptr;  // null when tied
};

ShardPointers HostPointers(DistributedShard* s) {
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

// A shard's tensors in a backend's memory: one allocation, each tensor of the host shard at its
// own 256-byte-aligned offset. The backend must outlive it.
class BackendShard {
 public:
  // The layout of `host`; its values uploaded when `upload`, zeros otherwise.
  BackendShard(const kernels::TransformerOps& ops, const DistributedShard& host, bool upload) {
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

  const ShardPointers& pointers() const { return pointers_; }

  parallel::DistributedShardView View() const {
    parallel::DistributedShardView v;
    v.embedding = pointers_.embedding;
    v.pos_embedding = pointers_.pos_embedding;
    for (const auto& b : pointers_.blocks) v.tsp_blocks.push_back({b[0], b[1], b[2], b[3]});
    v.ln_f = pointers_.ln_f;
    v.head = pointers_.head;
    return v;
  }
  parallel::DistributedGradsView Grads() const {
    parallel::DistributedGradsView g;
    g.embedding = pointers_.embedding;
    g.pos_embedding = pointers_.pos_embedding;
    for (const auto& b : pointers_.blocks) g.tsp_blocks.push_back({b[0], b[1], b[2], b[3]});
    g.ln_f = pointers_.ln_f;
    g.head = pointers_.head;
    return g;
  }

 private:
  kernels::OpsBuffer buffer_;
  ShardPointers pointers_;
};

// Every tensor of a rank's shard, with the engine's view of it (2-D weights split as separate
// matrices; the TSP shard packs several per buffer).
struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  // The model's fp32 values and gradients, which the model computes with: an fp32 model's own
  // (the engine's parameters), a bf16 model's working copies (widened values, gradients before
  // their rounding).
  float* value;
  float* grad;
  int64_t numel;
  bool replicated;  // the same on every rank (its gradient is all-reduced)
  // A bf16 model's storage (null for fp32): the engine's value and gradient buffers.
  uint16_t* value16 = nullptr;
  uint16_t* grad16 = nullptr;

  bool bf16() const { return value16 != nullptr; }
  // The engine's (the model's stored) value and gradient, and their element size.
  void* stored_value() const {
    return bf16() ? static_cast<void*>(value16) : static_cast<void*>(value);
  }
  void* stored_grad() const {
    return bf16() ? static_cast<void*>(grad16) : static_cast<void*>(grad);
  }
  size_t elem_size() const { return bf16() ? 2 : 4; }
  v1::DType dtype() const { return bf16() ? v1::DTYPE_BF16 : v1::DTYPE_FP32; }
};

// A bf16 model's storage in a backend's memory (kernels/ops.h): one allocation holding every
// tensor's bf16 value and bf16 gradient, each at a 256-byte-aligned offset (so a tensor is also
// a whole number of floats from the start: Upload / Download move it as floats, exactly). Points
// the tensors' value16 / grad16 at it; zeros. The backend must outlive it.
class Bf16Storage {
 public:
  Bf16Storage(const kernels::TransformerOps& ops, std::vector<Tensor>* tensors) {
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
  bool ok() const { return !buffer_.empty() && buffer_.data() != nullptr; }

 private:
  kernels::OpsBuffer buffer_;
};

// A tensor's stored values moved between host memory (numel x elem_size bytes, `host` at least
// a whole number of floats long) and the backend: bf16 ones as whole floats (the storage's
// tensors are float-aligned and padded), bit for bit.
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
// Download's result is in *host after the backend's Synchronize().
void DownloadStored(const kernels::TransformerOps& ops, const Tensor& t, std::string* host) {
  host->assign(((t.numel * t.elem_size()) + 3) / 4 * 4, '\0');
  if (!t.bf16())
    ops.Download(reinterpret_cast<float*>(host->data()), t.value, t.numel);
  else
    ops.Download(reinterpret_cast<float*>(host->data()),
                 reinterpret_cast<const float*>(t.value16), (t.numel + 1) / 2);
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

// The squared global norm's share of this rank in backend memory: the sum over tensors of their
// squares, each tensor counted where the host loop would count it (sharded ones on every rank,
// replicated ones on the lead only). Per-column sums of squares on the device (fp32, the
// kernel's order), one Download, the sum over columns in double on the host.
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

// Warm-up then cosine decay to lr * min_ratio at the last step.
double LearningRate(const TrainOptions& o, int64_t step) {
  if (o.lr_warmup > 0 && step <= o.lr_warmup)
    return o.lr * static_cast<double>(step) / static_cast<double>(o.lr_warmup);
  const double span = std::max<int64_t>(1, o.steps - o.lr_warmup);
  const double progress = std::min(1.0, static_cast<double>(step - o.lr_warmup) / span);
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return o.lr * (o.min_lr_ratio + (1.0 - o.min_lr_ratio) * cosine);
}

// ---- Trainer checkpoint files ----

// Version 1 (fp32 models only): magic, step, data position, the shape key, the tensors (each its
// element count, then its fp32 values), the engine's state, a checksum. Version 2 adds the model
// dtype after the shape key (kFileFp32 / kFileBf16) and stores each tensor in it (bf16: 2 bytes
// an element). Both are read; version 2 is written.
constexpr char kMagicV1[8] = {'S', 'F', 'T', 'R', 'A', 'I', 'N', '1'};
constexpr char kMagicV2[8] = {'S', 'F', 'T', 'R', 'A', 'I', 'N', '2'};
constexpr int64_t kFileFp32 = 0, kFileBf16 = 1;

// What --model_dtype calls a model dtype.
const char* ModelDtypeName(v1::DType d) { return d == v1::DTYPE_BF16 ? "bf16" : "fp32"; }

struct RankState {
  int64_t step = 0;
  int64_t data_position = 0;
  std::vector<int64_t> shape;  // rank, D, layers, C, H, FF, vocab, T, B, mode, tied, learned
  v1::DType dtype = v1::DTYPE_FP32;  // the model's: how `tensors` hold the values
  // Each tensor's values, little-endian, numel x (4 or 2) bytes (fp32 or bf16 bits).
  std::vector<std::string> tensors;
  std::string engine;

  size_t elem_size() const { return dtype == v1::DTYPE_BF16 ? 2 : 4; }
  int64_t numel(size_t i) const { return static_cast<int64_t>(tensors[i].size() / elem_size()); }
};

void PutI64(std::string* out, int64_t x) { out->append(reinterpret_cast<const char*>(&x), 8); }

absl::Status WriteFileAtomically(const std::string& path, const std::string& content) {
  const std::string dir = path.substr(0, path.rfind('/'));
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus("open", tmp);
  size_t done = 0;
  while (done < content.size()) {
    ssize_t w = write(fd, content.data() + done, content.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      absl::Status st = ErrnoStatus("write", tmp);
      close(fd);
      unlink(tmp.c_str());
      return st;
    }
    done += static_cast<size_t>(w);
  }
  if (fsync(fd) != 0) {
    absl::Status st = ErrnoStatus("fsync", tmp);
    close(fd);
    unlink(tmp.c_str());
    return st;
  }
  close(fd);
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    absl::Status st = ErrnoStatus("rename", tmp);
    unlink(tmp.c_str());
    return st;
  }
  int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return ErrnoStatus("open", dir);
  const int rc = fsync(dfd);
  close(dfd);
  if (rc != 0) return ErrnoStatus("fsync", dir);
  return absl::OkStatus();
}

std::string EncodeState(const RankState& s) {
  std::string out(kMagicV2, 8);
  PutI64(&out, s.step);
  PutI64(&out, s.data_position);
  PutI64(&out, static_cast<int64_t>(s.shape.size()));
  for (int64_t x : s.shape) PutI64(&out, x);
  PutI64(&out, s.dtype == v1::DTYPE_BF16 ? kFileBf16 : kFileFp32);
  PutI64(&out, static_cast<int64_t>(s.tensors.size()));
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    PutI64(&out, s.numel(i));
    out.append(s.tensors[i].data(), s.numel(i) * s.elem_size());
  }
  PutI64(&out, static_cast<int64_t>(s.engine.size()));
  out += s.engine;
  Checksum64 sum;
  sum.Update(out.data(), out.size());
  const uint64_t digest = sum.Digest();
  out.append(reinterpret_cast<const char*>(&digest), 8);
  return out;
}

absl::StatusOr<RankState> DecodeState(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("no trainer checkpoint ", path));
  std::string in((std::istreambuf_iterator<char>(f)), {});
  auto corrupt = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat("trainer checkpoint ", path, " is ", why));
  };
  if (in.size() < 16 ||
      (memcmp(in.data(), kMagicV1, 8) != 0 && memcmp(in.data(), kMagicV2, 8) != 0))
    return corrupt("not a checkpoint");
  const bool v2 = memcmp(in.data(), kMagicV2, 8) == 0;
  Checksum64 sum;
  sum.Update(in.data(), in.size() - 8);
  uint64_t stored;
  memcpy(&stored, in.data() + in.size() - 8, 8);
  if (stored != sum.Digest()) return corrupt("corrupt or truncated (checksum mismatch)");
  size_t pos = 8;
  auto i64 = [&](int64_t* x) {
    if (pos + 8 > in.size() - 8) return false;
    memcpy(x, in.data() + pos, 8);
    pos += 8;
    return true;
  };
  RankState s;
  int64_t n = 0;
  if (!i64(&s.step) || !i64(&s.data_position) || !i64(&n) || n < 0 || n > 64)
    return corrupt("malformed");
  s.shape.resize(n);
  for (int64_t& x : s.shape)
    if (!i64(&x)) return corrupt("malformed");
  if (v2) {
    int64_t dtype;
    if (!i64(&dtype) || (dtype != kFileFp32 && dtype != kFileBf16))
      return corrupt("malformed (unknown model dtype)");
    s.dtype = dtype == kFileBf16 ? v1::DTYPE_BF16 : v1::DTYPE_FP32;
  }
  const int64_t elem = static_cast<int64_t>(s.elem_size());
  if (!i64(&n) || n < 0 || n > 100000) return corrupt("malformed");
  s.tensors.resize(n);
  for (auto& t : s.tensors) {
    int64_t len;
    if (!i64(&len) || len < 0 || len > static_cast<int64_t>(in.size()) ||
        pos + len * elem > in.size() - 8)
      return corrupt("malformed");
    t.assign(in.data() + pos, len * elem);
    pos += len * elem;
  }
  int64_t len;
  if (!i64(&len) || len < 0 || pos + len != in.size() - 8) return corrupt("malformed");
  s.engine.assign(in.data() + pos, len);
  return s;
}

// Tensor i of a trainer file as fp32 values (bf16 ones widened, exactly).
std::vector<float> FileValuesAsFloat(const RankState& s, size_t i) {
  const int64_t n = s.numel(i);
  std::vector<float> out(n);
  if (s.dtype != v1::DTYPE_BF16) {
    memcpy(out.data(), s.tensors[i].data(), n * 4);
    return out;
  }
  for (int64_t j = 0; j < n; ++j) {
    uint16_t h;
    memcpy(&h, s.tensors[i].data() + 2 * j, 2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    memcpy(&out[j], &bits, 4);
  }
  return out;
}

absl::Status MakeDirs(const std::string& path) {
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i < path.size() && path[i] != '/') continue;
    const std::string prefix = path.substr(0, i);
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) return ErrnoStatus("mkdir", prefix);
  }
  return absl::OkStatus();
}

std::string RankFile(const TrainOptions& o, const std::string& tag, int rank) {
  return absl::StrCat(o.out_dir, "/checkpoints/", tag, ".rank", rank, ".trainer");
}

// The steps of this run's checkpoints that `rank` holds (<run>-step<N>.rank<r>.trainer), oldest
// first.
std::vector<int64_t> RunCheckpointSteps(const TrainOptions& o, int rank) {
  std::vector<int64_t> steps;
  const std::string dir = o.out_dir + "/checkpoints";
  const std::string prefix = o.run_name + "-step";
  const std::string suffix = absl::StrCat(".rank", rank, ".trainer");
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return steps;
  while (struct dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    const std::string n = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
    if (n.empty() || n.size() > 18 || n.find_first_not_of("0123456789") != std::string::npos)
      continue;
    steps.push_back(std::stoll(n));
  }
  closedir(d);
  std::sort(steps.begin(), steps.end());
  return steps;
}

// Removes this rank's checkpoints of the run beyond the newest o.keep_checkpoints: its trainer
// file and the daemon's state of the same tag. A failure is reported, not fatal: training goes
// on with the files left behind.
void PruneCheckpoints(const TrainOptions& o, int rank, ZenFlowEngine* engine) {
  if (o.keep_checkpoints <= 0) return;
  const std::vector<int64_t> steps = RunCheckpointSteps(o, rank);
  if (static_cast<int64_t>(steps.size()) <= o.keep_checkpoints) return;
  for (size_t i = 0; i + o.keep_checkpoints < steps.size(); ++i) {
    const std::string tag = absl::StrCat(o.run_name, "-step", steps[i]);
    absl::Status st = engine->DeleteCheckpoint(absl::StrCat(tag, ".r", rank));
    if (!st.ok() && !absl::IsNotFound(st))
      SF_LOG(kWarning, "rank %d: could not remove the daemon's checkpoint %s.r%d: %s", rank, tag,
             rank, st.ToString());
    const std::string file = RankFile(o, tag, rank);
    if (unlink(file.c_str()) != 0 && errno != ENOENT)
      ErrnoStatus("unlink", file).IgnoreError();  // logs the errno and the file
  }
}

// ---- --dump_init (TrainOptions::dump_init) ----

// The batches a run trains and evaluates on, [steps, B, T] and [eval batches, B, T] each.
struct DumpedBatches {
  std::vector<int32_t> tokens, targets, eval_tokens, eval_targets;
};

void AppendLe32(std::string* out, uint32_t x) {
  const char b[4] = {static_cast<char>(x & 0xff), static_cast<char>((x >> 8) & 0xff),
                     static_cast<char>((x >> 16) & 0xff), static_cast<char>(x >> 24)};
  out->append(b, 4);
}

std::string LittleEndian(const std::vector<float>& v) {
  std::string out;
  out.reserve(v.size() * 4);
  for (float x : v) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    AppendLe32(&out, bits);
  }
  return out;
}

std::string LittleEndian(const std::vector<int32_t>& v) {
  std::string out;
  out.reserve(v.size() * 4);
  for (int32_t x : v) AppendLe32(&out, static_cast<uint32_t>(x));
  return out;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') absl::StrAppend(&out, "\\", std::string(1, c));
    else if (c < 0x20) absl::StrAppend(&out, absl::StrFormat("\\u%04x", c));
    else out += static_cast<char>(c);
  }
  return out + "\"";
}

template <class T>
std::string JsonList(const std::vector<T>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if constexpr (std::is_floating_point_v<T>) {
      absl::StrAppend(&out, i > 0 ? ", " : "", absl::StrFormat("%.17g", v[i]));
    } else {
      absl::StrAppend(&out, i > 0 ? ", " : "", v[i]);
    }
  }
  return out + "]";
}

// Writes the dump directory: manifest.json, one <name>.f32 per tensor (downloaded from the
// backend), the batches. `lrs`: the rate of steps 1..steps; `eval_steps`: the evaluated steps.
absl::Status WriteInitDump(const TrainOptions& o, const parallel::ModelConfig& cfg, int64_t B,
                           int64_t T, const Corpus& corpus, const std::vector<Tensor>& tensors,
                           const RankDevice& dev, const DumpedBatches& batches,
                           const std::vector<double>& lrs, const std::vector<int64_t>& eval_steps) {
  RETURN_IF_ERROR(MakeDirs(o.dump_init));
  const std::string dir = o.dump_init + "/";
  std::string list;
  for (const Tensor& t : tensors) {
    std::vector<float> host(t.numel);
    dev.ops().Download(host.data(), t.value, t.numel);
    RETURN_IF_ERROR(dev.Synchronize());
    const std::string file = t.name + ".f32";
    RETURN_IF_ERROR(WriteFileAtomically(dir + file, LittleEndian(host)));
    absl::StrAppend(&list, list.empty() ? "" : ",\n", "    {\"name\": ", JsonString(t.name),
                    ", \"shape\": ", JsonList(t.shape), ", \"file\": ", JsonString(file), "}");
  }
  const int64_t eval_n = static_cast<int64_t>(batches.eval_tokens.size()) / (B * T);
  std::string batch_list;
  for (const auto& [name, data, n] :
       {std::make_tuple("tokens", &batches.tokens, o.steps),
        std::make_tuple("targets", &batches.targets, o.steps),
        std::make_tuple("eval_tokens", &batches.eval_tokens, eval_n),
        std::make_tuple("eval_targets", &batches.eval_targets, eval_n)}) {
    const std::string file = absl::StrCat(name, ".i32");
    RETURN_IF_ERROR(WriteFileAtomically(dir + file, LittleEndian(*data)));
    absl::StrAppend(&batch_list, batch_list.empty() ? "" : ",\n", "    \"", name,
                    "\": {\"file\": ", JsonString(file),
                    ", \"shape\": ", JsonList<int64_t>({n, B, T}), ", \"dtype\": \"int32\"}");
  }
  const ZenFlowConfig& e = o.engine;
  std::string manifest = absl::StrCat(
      "{\n  \"format\": \"stallfree-trainer-init/1\",\n",
      absl::StrFormat("  \"model\": {\"layers\": %d, \"d_model\": %d, \"heads\": %d, \"d_ff\": %d, "
                      "\"vocab\": %d, \"seq_len\": %d, \"max_seq\": %d, \"positions\": \"%s\", "
                      "\"tied_head\": %s, \"norm_eps\": %.17g},\n",
                      cfg.layers, cfg.C, cfg.H, cfg.FF, cfg.vocab, T, cfg.max_seq,
                      cfg.learned_positions ? "learned" : "none",
                      cfg.tied_head ? "true" : "false", static_cast<double>(cfg.eps)),
      absl::StrFormat("  \"optimizer\": {\"mode\": \"%s\", \"lr\": %.17g, \"lr_warmup\": %d, "
                      "\"min_lr_ratio\": %.17g, \"steps\": %d, \"clip\": %.17g, "
                      "\"weight_decay\": %.17g, \"beta1\": %.17g, \"beta2\": %.17g, "
                      "\"eps\": %.17g,\n    \"lr_per_step\": ",
                      OffloadModeName(e.mode), o.lr, o.lr_warmup, o.min_lr_ratio, o.steps, o.clip,
                      e.weight_decay, e.beta1, e.beta2, e.eps),
      JsonList(lrs), "},\n",
      absl::StrFormat("  \"data\": {\"source\": %s, \"batch\": %d, \"seed\": %d, "
                      "\"train_tokens\": %d, \"eval_tokens\": %d, \"eval_every\": %d, "
                      "\"eval_batches\": %d, \"eval_steps\": ",
                      JsonString(corpus.source), B, o.seed, corpus.train.size(),
                      corpus.eval.size(), o.eval_every, eval_n),
      JsonList(eval_steps), "},\n  \"tensors\": [\n", list, "\n  ],\n  \"batches\": {\n",
      batch_list, "\n  }\n}\n");
  return WriteFileAtomically(dir + "manifest.json", manifest);
}

// Sum over ranks of one double (through the float communicator in two halves, so the sum keeps
// double precision for values of similar magnitude).
absl::StatusOr<double> AllReduceSum(parallel::Communicator* comm, double x) {
  float parts[2] = {static_cast<float>(x), static_cast<float>(x - static_cast<float>(x))};
  RETURN_IF_ERROR(comm->AllReduce(parts, 2));
  return static_cast<double>(parts[0]) + static_cast<double>(parts[1]);
}

}  // namespace

const std::vector<Preset>& Presets() {
  static const std::vector<Preset> presets = {
      {"tiny", 2, 64, 4, 128, 32, 4, "tests: ~0.1M parameters, a few ms per step"},
      {"demo", 12, 384, 6, 1024, 128, 4, "make demo: ~21M parameters (byte vocabulary)"},
      {"gpt2-small", 12, 768, 12, 2048, 1024, 8, "GPT-2 small's shape (~85M with bytes), GPUs"},
      {"1b", 20, 2048, 16, 5632, 2048, 8, "~1.0B parameters, GPUs"},
  };
  return presets;
}

absl::StatusOr<Preset> FindPreset(const std::string& name) {
  std::string known;
  for (const Preset& p : Presets()) {
    if (p.name == name) return p;
    known += (known.empty() ? "" : ", ") + p.name;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("preset: '", name, "' is not one of ", known));
}

absl::StatusOr<parallel::ModelConfig> ModelFromOptions(const TrainOptions& o, int64_t vocab,
                                                       int64_t seq_len, int D) {
  ASSIGN_OR_RETURN(Preset p, FindPreset(o.preset));
  parallel::ModelConfig cfg;
  cfg.vocab = vocab;
  cfg.layers = o.layers > 0 ? o.layers : p.layers;
  cfg.C = o.d_model > 0 ? o.d_model : p.d_model;
  cfg.H = o.heads > 0 ? o.heads : p.heads;
  cfg.FF = o.d_ff > 0 ? o.d_ff : p.d_ff;
  if (o.positions != "learned" && o.positions != "none")
    return absl::InvalidArgumentError(
        absl::StrCat("positions: '", o.positions, "' is not learned or none"));
  cfg.learned_positions = o.positions == "learned";
  cfg.max_seq = seq_len;
  cfg.tied_head = o.tied_head;
  RETURN_IF_ERROR(parallel::ValidateModelConfig(cfg));
  if (cfg.H % D != 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "heads: ", cfg.H, " attention heads do not divide over ", D, " ranks"));
  if (cfg.FF % D != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("d_ff: ", cfg.FF, " does not divide over ", D, " ranks"));
  if (seq_len % (2 * D) != 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "seq_len: ", seq_len, " is not a multiple of 2 x ", D, " ranks (TSP's zigzag chunks)"));
  return cfg;
}

namespace {

// The ranks of a run: this rank's TSP group and, with --dp N > 1, its data-parallel group.
// Global rank = replica * D + TSP rank. A sum over the world is a sum over the TSP group, then
// over the data-parallel group (likewise a barrier).
struct World {
  parallel::Communicator* tsp = nullptr;
  parallel::Communicator* dp = nullptr;  // null with one replica

  int D() const { return tsp->size(); }
  int N() const { return dp == nullptr ? 1 : dp->size(); }
  int replica() const { return dp == nullptr ? 0 : dp->rank(); }
  int rank() const { return replica() * D() + tsp->rank(); }
  absl::StatusOr<double> Sum(double x) const {
    ASSIGN_OR_RETURN(double sum, AllReduceSum(tsp, x));
    if (dp == nullptr) return sum;
    return AllReduceSum(dp, sum);
  }
  absl::Status Barrier() const {
    RETURN_IF_ERROR(tsp->Barrier());
    return dp == nullptr ? absl::OkStatus() : dp->Barrier();
  }
};

// The data-parallel partition of a rank's tensors over N replicas (engine/partition.h): a
// tensor of shape [..., cols] is rows = numel / cols rows (a 1-D one: numel rows of one column);
// replica q owns the row block blocks[q]. The all-gather after a step packs each replica's
// blocks into a slot of `slot` elements of the model's dtype (a bf16 model's: an even number, a
// whole number of floats), tensor i at `offset[i]` padded to its largest block.
struct DpPartition {
  struct Part {
    int64_t rows = 0, cols = 1;
    std::vector<RowBlock> blocks;  // per replica
    bool replicated = false;       // fewer rows than replicas: every replica holds it whole
    int64_t offset = 0;            // in a replica's slot (partitioned tensors)
  };
  std::vector<Part> parts;  // per tensor
  int64_t slot = 0;

  DpPartition(const std::vector<Tensor>& tensors, int N) {
    for (const Tensor& t : tensors) {
      Part p;
      const RowShape rc = RowsOf(t.shape);
      p.rows = rc.rows;
      p.cols = rc.cols;
      for (int q = 0; q < N; ++q) p.blocks.push_back(PartitionRows(p.rows, N, q));
      p.replicated = p.blocks[0].replicated;
      if (N > 1 && !p.replicated) {
        int64_t largest = 0;
        for (const RowBlock& b : p.blocks) largest = std::max(largest, b.rows());
        p.offset = slot;
        slot += largest * p.cols;
      }
      parts.push_back(std::move(p));
    }
    if (!tensors.empty() && tensors[0].bf16()) slot += slot % 2;
  }

  // Tensor i's view for replica q's engine: its block's rows (the whole tensor when N is 1) of
  // the stored value and gradient.
  EngineParam View(const Tensor& t, size_t i, int q, int N) const {
    if (N == 1) return EngineParam{t.name, t.shape, t.stored_value(), t.stored_grad(), t.dtype()};
    const Part& p = parts[i];
    const RowBlock& b = p.blocks[q];
    std::vector<int64_t> shape = t.shape.size() >= 2 ? std::vector<int64_t>{b.rows(), p.cols}
                                                     : std::vector<int64_t>{b.rows()};
    const int64_t skip = b.begin * p.cols * static_cast<int64_t>(t.elem_size());  // bytes
    return EngineParam{t.name, std::move(shape), static_cast<char*>(t.stored_value()) + skip,
                       static_cast<char*>(t.stored_grad()) + skip, t.dtype()};
  }
};

// Where a run stands for recovery: the newest checkpoint every rank holds.
struct Progress {
  std::string checkpoint;  // its tag ("" before the first)
  int64_t checkpoint_step = 0;
  bool daemon_lost = false;  // the attempt ended because every rank agreed the daemon was gone
};

// A status of a daemon call that means the daemon went away (or came back without the session):
// the connection is gone, or the session is unknown to the daemon answering now.
bool IsDaemonLoss(const absl::Status& st) {
  if (st.ok()) return false;
  if (absl::IsUnavailable(st)) return true;
  const std::string m(st.message());
  return (absl::IsNotFound(st) && m.find("no session") != std::string::npos) ||
         (absl::IsAborted(st) && (m.find("session closed") != std::string::npos ||
                                  m.find("session reclaimed") != std::string::npos));
}

// Collective: st is this rank's result of a daemon call. If any rank lost the daemon, every rank
// marks progress->daemon_lost and returns UNAVAILABLE (RunRank then waits for the daemon or
// explains how to resume); otherwise this rank's own st.
absl::Status AgreeOnDaemon(const World& world, Progress* progress, absl::Status st) {
  ASSIGN_OR_RETURN(double lost, world.Sum(IsDaemonLoss(st) ? 1.0 : 0.0));
  if (lost == 0) return st;
  progress->daemon_lost = true;
  return absl::UnavailableError(IsDaemonLoss(st) ? std::string(st.message())
                                                 : "another rank lost stallfreed");
}

// Rewrites metrics.csv without the rows after `step` (a resumed run writes them again).
absl::Status TruncateMetrics(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return absl::OkStatus();
  std::string line, kept;
  bool header = true;
  while (std::getline(in, line)) {
    if (header || std::atoll(line.c_str()) <= step) kept += line + "\n";
    header = false;
  }
  return WriteFileAtomically(path, kept);
}

// ---- Resuming (TrainOptions::resume), with the same --dp or another ----

// Where a trainer file's shape key (TrainAttempt's shape_key) holds what: the TSP rank and size,
// the model, the per-replica batch, the mode, then (--dp N > 1) N and the replica.
constexpr size_t kKeyTspRank = 0, kKeyD = 1, kKeyBatch = 8, kKeyFields = 12, kDpKey = 12;

int64_t WrittenDp(const RankState& st) {
  return st.shape.size() > kDpKey ? st.shape[kDpKey] : 1;
}

// Whether two keys describe the same model, TSP rank and size, and mode (the batch and the
// data-parallel fields aside).
bool SameModel(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  if (a.size() < kKeyFields || b.size() < kKeyFields) return false;
  for (size_t i = 0; i < kKeyFields; ++i)
    if (i != kKeyBatch && a[i] != b[i]) return false;
  return true;
}

// st with `what` before its message (same code).
absl::Status Annotate(const absl::Status& st, const std::string& what) {
  return absl::Status(st.code(), absl::StrCat(what, ": ", st.message()));
}

// What a rank restores: the step, the data position and the whole tensors (every file of the
// checkpoint holds them), its engine's state, and the daemon checkpoint tag Restore reads.
struct ResumeState {
  RankState st;
  std::string daemon_tag;
  bool uploaded = false;  // daemon_tag was written for this resume: remove it after Restore
  int64_t written_dp = 1;
  std::vector<std::string> missing;  // daemon checkpoints of the sources that were not found
};

// Reads the checkpoint o.resume for this rank (global rank `rank`, TSP rank key[0] of D, replica
// `replica` of N). Written with the same --dp: the rank's own trainer file and daemon tag.
// Written with another (N' replicas of the same D): the old replicas j at this TSP position
// (global ranks j D + p) whose row blocks overlap this replica's (SourceRanks), each one's engine
// state from its trainer file and its daemon checkpoint's bytes through the session, cut and
// joined for this replica by Repartition (engine/repartition.h); the daemon part is uploaded as
// "<tag>.dp<N>.r<rank>" (Session::WriteCheckpointBytes, as the PyTorch optimizer's
// load_state_dict does) for the engine's Restore. A rank reads only its sources. The global batch
// must stay the same (N' B' = N B: the data stream continues at the same window).
absl::StatusOr<ResumeState> ReadResume(const TrainOptions& o, const std::vector<int64_t>& key,
                                       int N, int replica, int rank,
                                       const std::vector<Tensor>& tensors, Session* session) {
  const std::string& tag = o.resume;
  const int p = static_cast<int>(key[kKeyTspRank]);
  const int64_t D = key[kKeyD], B = key[kKeyBatch];
  auto nproc_error = [&](int64_t written) {
    return absl::FailedPreconditionError(absl::StrCat(
        "resume: checkpoint '", tag, "' was written by a run with --nproc ", written,
        " (TSP ranks per replica), and this run has --nproc ", D, "; the TSP size must stay the "
        "same at a resume (only --dp may change): resume with --nproc ", written));
  };
  // What wrote the checkpoint: its replica 0's file at this TSP position (global rank p), which
  // every run of D TSP ranks has.
  absl::StatusOr<RankState> head = DecodeState(RankFile(o, tag, p));
  if (absl::IsNotFound(head.status()) && p > 0) {
    absl::StatusOr<RankState> zero = DecodeState(RankFile(o, tag, 0));
    if (zero.ok() && zero->shape.size() >= kKeyFields && zero->shape[kKeyD] != D)
      return nproc_error(zero->shape[kKeyD]);
  }
  RETURN_IF_ERROR(head.status());
  if (head->shape.size() < kKeyFields)
    return absl::DataLossError(absl::StrCat("resume: ", RankFile(o, tag, p),
                                            " has a malformed header"));
  if (head->shape[kKeyD] != D) return nproc_error(head->shape[kKeyD]);
  auto dtype_error = [&](const RankState& written, const std::string& file) {
    return absl::FailedPreconditionError(absl::StrCat(
        "resume: checkpoint '", tag, "' (", file, ") holds a --model_dtype ",
        ModelDtypeName(written.dtype), " model, and this run has --model_dtype ",
        ModelDtypeName(o.model_dtype), "; a resume keeps the model's storage: resume with "
        "--model_dtype ", ModelDtypeName(written.dtype), " (a new run with --init_from ",
        o.out_dir, "/checkpoints/", tag, " --model_dtype ", ModelDtypeName(o.model_dtype),
        " starts from its weights with a fresh optimizer)"));
  };
  if (head->dtype != o.model_dtype) return dtype_error(*head, RankFile(o, tag, p));
  if (!SameModel(head->shape, key) || head->tensors.size() != tensors.size())
    return absl::FailedPreconditionError(absl::StrCat(
        "resume: checkpoint '", tag, "' was written by a run with another model, batch, "
        "rank count or mode"));
  ResumeState out;
  const int64_t old_n = WrittenDp(*head), old_b = head->shape[kKeyBatch];
  out.written_dp = old_n;
  if (old_n * old_b != N * B) {
    const int64_t global = old_n * old_b;
    return absl::FailedPreconditionError(absl::StrCat(
        "resume: checkpoint '", tag, "' was written by a run with --dp ", old_n, " --batch ",
        old_b, " (a global batch of ", global, " sequences), and this run has --dp ", N,
        " --batch ", B, " (", N * B, "); a resume keeps the global batch: ",
        global % N == 0 ? absl::StrCat("pass --batch ", global / N)
                        : absl::StrCat("no --batch gives ", global, " sequences over ", N,
                                       " replicas; choose a --dp that divides ", global)));
  }
  if (old_n == N) {
    if (rank == p) {
      out.st = *std::move(head);
    } else {
      ASSIGN_OR_RETURN(out.st, DecodeState(RankFile(o, tag, rank)));
      if (out.st.dtype != o.model_dtype) return dtype_error(out.st, RankFile(o, tag, rank));
    }
    if (out.st.shape != key || out.st.tensors.size() != tensors.size())
      return absl::FailedPreconditionError(absl::StrCat(
          "resume: checkpoint '", tag, "' was written by a run with another model, batch, "
          "rank count or mode"));
    out.daemon_tag = absl::StrCat(tag, ".r", rank);
    return out;
  }
  // Another --dp: this replica's blocks from the old replicas' (engine/repartition.h).
  std::vector<WholeParam> whole;
  for (const Tensor& t : tensors) whole.push_back({t.name, t.shape});
  const std::vector<int> sources = SourceRanks(whole, static_cast<int>(old_n), N, replica);
  std::vector<PartitionedState> states(old_n);
  std::vector<const PartitionedState*> old(old_n, nullptr);
  for (int j : sources) {
    const int from = static_cast<int>(j * D + p);
    if (j == 0) {
      states[j].engine = head->engine;
    } else {
      const std::string file = RankFile(o, tag, from);
      ASSIGN_OR_RETURN(RankState sj, DecodeState(file));
      if (sj.dtype != o.model_dtype) return dtype_error(sj, file);
      const bool same = SameModel(sj.shape, head->shape) && WrittenDp(sj) == old_n &&
                        sj.shape.size() > kDpKey + 1 && sj.shape[kDpKey + 1] == j &&
                        sj.shape[kKeyBatch] == old_b;
      if (!same)
        return absl::FailedPreconditionError(absl::StrCat(
            "resume: ", file, " is not replica ", j, " of the --dp ", old_n, " run that wrote ",
            RankFile(o, tag, p)));
      if (sj.step != head->step || sj.data_position != head->data_position)
        return absl::FailedPreconditionError(absl::StrCat(
            "resume: the files of checkpoint '", tag, "' disagree: ", file, " is at step ",
            sj.step, ", ", RankFile(o, tag, p), " at step ", head->step));
      states[j].engine = std::move(sj.engine);
    }
    if (session != nullptr) {
      const std::string daemon_tag = absl::StrCat(tag, ".r", from);
      absl::StatusOr<std::string> bytes =
          session->ReadCheckpointBytes(daemon_tag, /*delete_after=*/false);
      if (bytes.ok()) {
        states[j].daemon = *std::move(bytes);
      } else if (absl::IsNotFound(bytes.status())) {
        out.missing.push_back(daemon_tag);  // none: nothing was offloaded yet (or it is lost)
      } else {
        return Annotate(bytes.status(),
                        absl::StrCat("resume: reading the daemon's checkpoint ", daemon_tag));
      }
    }
    old[j] = &states[j];
  }
  absl::StatusOr<PartitionedState> mine =
      Repartition(whole, old, N, replica, o.out_dir + "/checkpoints");
  if (!mine.ok())
    return Annotate(mine.status(),
                    absl::StrCat("resume: re-partitioning checkpoint '", tag, "' (--dp ", old_n,
                                 ", rank j = its replica j, global rank j x ", D, " + ", p,
                                 ") for replica ", replica, " of --dp ", N));
  states.clear();
  out.st = *std::move(head);
  out.st.shape = key;
  out.st.engine = std::move(mine->engine);
  out.daemon_tag = absl::StrCat(tag, ".dp", N, ".r", rank);
  if (!mine->daemon.empty()) {
    RETURN_IF_ERROR(session->WriteCheckpointBytes(out.daemon_tag, mine->daemon));
    out.uploaded = true;
  }
  return out;
}

absl::Status TrainAttempt(const TrainOptions& o, const World& world, int local_rank,
                          Progress* progress) {
  parallel::Communicator* const comm = world.tsp;  // the TSP group
  // rank: the global rank (files, daemon sessions and tags); lead: global rank 0 (prints and
  // writes the metrics); tsp_lead: TSP rank 0 (counts the replicated tensors in the norm).
  const int D = world.D(), N = world.N(), replica = world.replica(), rank = world.rank();
  const bool lead = rank == 0, tsp_lead = comm->rank() == 0;
  ASSIGN_OR_RETURN(Preset preset, FindPreset(o.preset));
  const int64_t T = o.seq_len > 0 ? o.seq_len : preset.seq_len;
  const int64_t B = o.batch > 0 ? o.batch : preset.batch;
  if (o.steps < 1) return absl::InvalidArgumentError("steps: must be >= 1");
  if (o.keep_checkpoints < 0)
    return absl::InvalidArgumentError("keep_checkpoints: must be >= 0 (0 keeps every one)");
  if (!o.init_from.empty() && !o.resume.empty())
    return absl::InvalidArgumentError("init_from: cannot be combined with --resume");
  if (!o.dump_init.empty() && D * N != 1)
    return absl::InvalidArgumentError(absl::StrCat(
        "dump_init: writes a single rank's whole model, and this run has ", D * N,
        " ranks; run it with --nproc 1 --dp 1"));
  if (!o.dump_init.empty() && !o.resume.empty())
    return absl::InvalidArgumentError(
        "dump_init: writes a run's starting point, and a resumed run starts from a checkpoint's "
        "optimizer state; drop --resume (--init_from is fine: its weights are dumped)");
  RETURN_IF_ERROR(o.engine.Validate());
  if (o.model_dtype != v1::DTYPE_FP32 && o.model_dtype != v1::DTYPE_BF16)
    return absl::InvalidArgumentError("model_dtype: must be fp32 or bf16");
  const bool bf16 = o.model_dtype == v1::DTYPE_BF16;
  if (bf16 && !o.dump_init.empty())
    return absl::InvalidArgumentError(
        "dump_init: writes an fp32 model's starting point for a re-implementation that follows "
        "it in fp32, and this run has --model_dtype bf16; run it with --model_dtype fp32");

  // Data.
  Corpus corpus;
  if (o.data.empty()) {
    corpus = DefaultCorpus();
    if (o.eval_fraction != kDefaultEvalFraction) {
      std::vector<uint16_t> all = corpus.train;
      all.insert(all.end(), corpus.eval.begin(), corpus.eval.end());
      ASSIGN_OR_RETURN(corpus, SplitCorpus(std::move(all), corpus.vocab, corpus.source,
                                           o.eval_fraction));
    }
  } else {
    DataFormat format;
    if (!ParseDataFormat(o.format, &format))
      return absl::InvalidArgumentError(
          absl::StrCat("format: '", o.format, "' is not auto, bytes or uint16"));
    ASSIGN_OR_RETURN(corpus, LoadCorpus(o.data, format, o.eval_fraction));
  }
  ASSIGN_OR_RETURN(parallel::ModelConfig cfg, ModelFromOptions(o, corpus.vocab, T, D));
  // The global batch (N replicas x B sequences), the same on every rank; replica i trains on
  // (and evaluates) its sequences [i B, (i + 1) B).
  ASSIGN_OR_RETURN(Batcher batcher, Batcher::Create(&corpus.train, N * B, T, o.seed));
  const bool have_eval = !corpus.eval.empty() && static_cast<int64_t>(corpus.eval.size()) > T;
  absl::StatusOr<Batcher> eval_batcher =
      have_eval ? Batcher::Create(&corpus.eval, N * B, T, o.seed, BatchOrder::kSequential)
                : absl::StatusOr<Batcher>(absl::NotFoundError("no eval split"));

  // The device (before everything that lives in its memory or uses its backends).
  ASSIGN_OR_RETURN(std::unique_ptr<RankDevice> dev, OpenRankDevice(o.device, local_rank, comm));
  const kernels::TransformerOps& ops = dev->ops();
  // The data-parallel group on the device's memory (Gloo on the CPU, NCCL on a GPU).
  parallel::Communicator* dp_dev = nullptr;
  if (N > 1) {
    ASSIGN_OR_RETURN(dp_dev, dev->OpenGroup(world.dp));
  }

  // Model and gradients (the same layout, zeroed): host vectors on the CPU; on a GPU, the shard
  // uploaded into device memory and gradients allocated there (the host copy is then dropped).
  DistributedModel model(cfg, parallel::Layout::kTsp, dev->model_comm());
  RETURN_IF_ERROR(model.Validate());
  ASSIGN_OR_RETURN(DistributedShard w, model.Shard(parallel::InitModelWeights(cfg, o.seed)));
  DistributedShard g;
  std::unique_ptr<BackendShard> dw, dg;
  parallel::DistributedShardView wv;
  parallel::DistributedGradsView gv;
  if (dev->host()) {
    g = w;
  } else {
    dw = std::make_unique<BackendShard>(ops, w, /*upload=*/true);
    dg = std::make_unique<BackendShard>(ops, w, /*upload=*/false);
    RETURN_IF_ERROR(dev->Synchronize());
    wv = dw->View();
    gv = dg->Grads();
    w = DistributedShard();
  }
  std::vector<Tensor> tensors =
      dev->host() ? ShardTensors(cfg, D, HostPointers(&w), HostPointers(&g))
                  : ShardTensors(cfg, D, dw->pointers(), dg->pointers());
  int64_t params_local = 0, params_total = 0;
  for (const Tensor& t : tensors) {
    params_local += t.numel;
    params_total += t.replicated ? t.numel : t.numel * D;
  }
  // A bf16 model: its storage (the engine's parameters) beside the fp32 working copies in w / g
  // (or dw / dg). The values start as the rounding of the fp32 initialisation, widened back into
  // the working copies; `widened` says whether the working values are the stored ones (every
  // change of the stored values clears it, each forward widens them first if not).
  std::unique_ptr<Bf16Storage> storage;
  bool widened = true;
  // Working values := the stored bf16 values, widened (exact).
  auto widen = [&]() -> absl::Status {
    if (!bf16 || widened) return absl::OkStatus();
    for (const Tensor& t : tensors) dev->kernel().Bf16ToFloat(t.value16, t.value, t.numel);
    RETURN_IF_ERROR(dev->Synchronize());
    widened = true;
    return absl::OkStatus();
  };
  // Stored values := the working fp32 values rounded to nearest even, then widened back (the
  // working copies then hold the bf16 model exactly).
  auto round_values = [&]() -> absl::Status {
    if (!bf16) return absl::OkStatus();
    for (const Tensor& t : tensors) dev->kernel().FloatToBf16(t.value, t.value16, t.numel);
    widened = false;
    return widen();
  };
  if (bf16) {
    storage = std::make_unique<Bf16Storage>(ops, &tensors);
    if (!storage->ok() && params_local > 0)
      return absl::ResourceExhaustedError(absl::StrCat(
          "model_dtype bf16: cannot allocate the bf16 weights and gradients (",
          4 * params_local, " bytes) on ", dev->name()));
    RETURN_IF_ERROR(round_values());
  }

  // Engine and daemon session.
  std::unique_ptr<Client> client;
  std::unique_ptr<Session> session;
  if (o.engine.mode != OffloadMode::kNoOffload) {
    if (o.socket.empty())
      return absl::InvalidArgumentError(absl::StrCat(
          "socket: mode ", OffloadModeName(o.engine.mode),
          " needs stallfreed; start one (stallfreed --socket PATH) and pass --socket PATH"));
    ASSIGN_OR_RETURN(client, Client::Connect(o.socket));
    // One session per rank, named with the global rank.
    ASSIGN_OR_RETURN(session, client->OpenSession(absl::StrCat("gpt-", o.preset, "-", o.run_name,
                                                               ".rank", rank),
                                                  rank));
  }
  // The engine over this replica's row blocks (the whole tensors with one replica).
  const DpPartition partition(tensors, N);
  std::vector<EngineParam> eparams;
  std::set<std::string> replicated_params;  // held whole by every replica
  for (size_t i = 0; i < tensors.size(); ++i) {
    eparams.push_back(partition.View(tensors[i], i, replica, N));
    if (partition.parts[i].replicated) replicated_params.insert(tensors[i].name);
  }
  ASSIGN_OR_RETURN(std::unique_ptr<ZenFlowEngine> engine,
                   ZenFlowEngine::Create(o.engine, eparams, dev->kernel(), ops, session.get()));
  if (N > 1) {
    // A partitioned weight's block scores sum to the whole weight's: every replica selects the
    // same hot columns. Replicated ones have the same (averaged) gradient on every replica.
    engine->set_score_reduce([dp_dev, replicated_params](const std::string& name, float* scores,
                                                         int64_t cols) -> absl::Status {
      if (replicated_params.count(name) > 0) return absl::OkStatus();
      return dp_dev->AllReduce(scores, cols);
    });
  }
  // Data-parallel buffers (device memory): the all-gather's slots (N x partition.slot elements
  // of the model's dtype; a bf16 slot is an even number of elements, moved as floats: the
  // collective copies their bits).
  auto slot_floats = [&](int64_t slot) { return bf16 ? slot / 2 : slot; };
  kernels::OpsBuffer dp_send, dp_recv;
  // A bf16 model's whole-block copies: GatherColumns / ScatterColumns of every column (0, 1, ...
  // up to the widest tensor's; int64 as 2 floats).
  kernels::OpsBuffer all_columns;
  if (N > 1) {
    const int64_t floats = std::max<int64_t>(slot_floats(partition.slot), 1);
    dp_send = kernels::OpsBuffer(&ops, floats);
    dp_recv = kernels::OpsBuffer(&ops, N * floats);
    ops.Fill(dp_send.data(), floats, 0.0f);  // the padding
    if (bf16) {
      int64_t widest = 1;
      for (const DpPartition::Part& p : partition.parts) widest = std::max(widest, p.cols);
      std::vector<int64_t> idx(widest);
      std::iota(idx.begin(), idx.end(), int64_t{0});
      all_columns = kernels::OpsBuffer(&ops, 2 * widest);
      ops.Upload(all_columns.data(), reinterpret_cast<const float*>(idx.data()), 2 * widest);
      RETURN_IF_ERROR(dev->Synchronize());
    }
  }
  double sum_dp = 0;  // seconds in the data-parallel collectives
  // Gradients := their mean over the replicas (one all-reduce of them all).
  auto average_grads = [&]() -> absl::Status {
    if (N == 1) return absl::OkStatus();
    const auto t0 = Clock::now();
    // Each tensor's gradient all-reduced where it lies (issued together, waited together: no
    // copy of the gradients), then scaled by 1/N in place.
    std::vector<std::shared_ptr<parallel::Work>> works;
    for (const Tensor& t : tensors) works.push_back(dp_dev->IAllReduce(t.grad, t.numel));
    for (auto& w : works) RETURN_IF_ERROR(w->Wait());
    for (const Tensor& t : tensors)
      dev->kernel().Accumulate(t.grad, t.grad, kernels::GradType::kFp32,
                               1.0f / static_cast<float>(N), t.numel,
                               kernels::AccumulateMode::kOverwrite);
    RETURN_IF_ERROR(dev->Synchronize());
    sum_dp += Since(t0);
    return absl::OkStatus();
  };
  // Between round boundaries a zenflow step changes only the hot columns of the weights the
  // engine splits (and the tensors wholly on the device): the cold columns change only where a
  // daemon update lands, at a boundary. So those steps gather only the hot columns of the split
  // weights, packed [rows, k] at hot_offset[i] in a slot of hot_slot elements (of the model's
  // dtype; even for bf16); boundary steps (and Flush) gather everything (a bf16 model's blocks
  // through all_columns). hot_idx[i]: the hot columns on the device (int64 as 2 floats),
  // refreshed at the first such step after a boundary (reselections happen only there).
  // The layout is made at the first such step (the hot sets exist from step 1's selection on;
  // their sizes never change).
  std::vector<int64_t> hot_k(tensors.size(), 0), hot_offset(tensors.size(), 0);
  std::vector<kernels::OpsBuffer> hot_idx(tensors.size());
  int64_t hot_slot = -1;  // -1: no layout yet
  bool hot_stale = true;
  // Every replica's updated blocks to every replica: one all-gather of the packed blocks (of
  // their hot columns only where `hot_only`).
  auto gather_blocks = [&](bool hot_only) -> absl::Status {
    if (N == 1 || partition.slot == 0) return absl::OkStatus();
    const auto t0 = Clock::now();
    if (!hot_only) {
      hot_stale = true;
    } else if (hot_stale) {
      const bool layout = hot_slot < 0;
      if (layout) hot_slot = 0;
      for (size_t i = 0; i < tensors.size(); ++i) {
        const DpPartition::Part& p = partition.parts[i];
        if (p.replicated) continue;
        std::vector<int64_t> hot;
        if (!engine->OnDevice(i)) {
          ASSIGN_OR_RETURN(hot, engine->HotColumns(tensors[i].name));
        }
        if (layout) {
          int64_t largest = 0;
          for (const RowBlock& b : p.blocks) largest = std::max(largest, b.rows());
          hot_k[i] = static_cast<int64_t>(hot.size());
          if (hot_k[i] > 0) hot_idx[i] = kernels::OpsBuffer(&ops, 2 * hot_k[i]);
          hot_offset[i] = hot_slot;
          hot_slot += largest * (hot_k[i] > 0 ? hot_k[i] : p.cols);
        }
        if (static_cast<int64_t>(hot.size()) != hot_k[i])
          return absl::InternalError(absl::StrCat("the hot set of '", tensors[i].name,
                                                  "' changed size"));
        if (hot_k[i] > 0)
          ops.Upload(hot_idx[i].data(), reinterpret_cast<const float*>(hot.data()),
                     2 * hot_k[i]);
      }
      if (layout && bf16) hot_slot += hot_slot % 2;
      hot_stale = false;
    }
    const int64_t slot = hot_only ? hot_slot : partition.slot;
    const size_t elem = bf16 ? 2 : 4;
    // Replica q's block of tensor i to or from `packed` (the block's place in a slot).
    auto pack = [&](size_t i, int q, char* packed, bool unpack) {
      const DpPartition::Part& p = partition.parts[i];
      const RowBlock& b = p.blocks[q];
      char* rows = static_cast<char*>(tensors[i].stored_value()) + b.begin * p.cols * elem;
      const bool hot = hot_only && hot_k[i] > 0;
      if (hot || bf16) {
        const int64_t* idx = reinterpret_cast<const int64_t*>(
            hot ? hot_idx[i].data() : all_columns.data());
        const int64_t k = hot ? hot_k[i] : p.cols;
        if (unpack)
          dev->kernel().ScatterColumns(packed, elem, b.rows(), p.cols, idx, k, rows);
        else
          dev->kernel().GatherColumns(rows, elem, b.rows(), p.cols, idx, k, packed);
      } else if (unpack) {
        ops.CopyFloats(reinterpret_cast<float*>(rows), reinterpret_cast<const float*>(packed),
                       b.rows() * p.cols);
      } else {
        ops.CopyFloats(reinterpret_cast<float*>(packed), reinterpret_cast<const float*>(rows),
                       b.rows() * p.cols);
      }
    };
    auto at = [&](const kernels::OpsBuffer& buf, int64_t slot_index, size_t i) {
      const int64_t off = hot_only ? hot_offset[i] : partition.parts[i].offset;
      return reinterpret_cast<char*>(buf.data()) + (slot_index * slot + off) * elem;
    };
    for (size_t i = 0; i < tensors.size(); ++i)
      if (!partition.parts[i].replicated) pack(i, replica, at(dp_send, 0, i), false);
    RETURN_IF_ERROR(dp_dev->AllGather(dp_send.data(), dp_recv.data(), slot_floats(slot)));
    for (int q = 0; q < N; ++q) {
      if (q == replica) continue;
      for (size_t i = 0; i < tensors.size(); ++i)
        if (!partition.parts[i].replicated) pack(i, q, at(dp_recv, q, i), true);
    }
    RETURN_IF_ERROR(dev->Synchronize());
    widened = !bf16;  // other replicas' blocks (and this one's update) are new
    sum_dp += Since(t0);
    return absl::OkStatus();
  };

  // What a checkpoint must match: the TSP rank and size, the model, the per-replica batch, the
  // mode, and with --dp N > 1 N and the replica (a run with one replica writes the key of the
  // runs before --dp, whose checkpoints it resumes).
  std::vector<int64_t> shape_key = {comm->rank(), D,     cfg.layers, cfg.C, cfg.H,
                                    cfg.FF,       cfg.vocab, T,      B,
                                    static_cast<int64_t>(o.engine.mode),
                                    cfg.tied_head, cfg.learned_positions};
  if (N > 1) shape_key.insert(shape_key.end(), {N, replica});
  auto written_dp = [&](const RankState& st) -> int64_t { return WrittenDp(st); };
  int64_t start = 0;
  if (!o.resume.empty()) {
    // Every rank reads its sources (ReadResume), then all agree, so that one rank's error ends
    // every rank (a lost daemon as everywhere else: AgreeOnDaemon).
    absl::StatusOr<ResumeState> read =
        ReadResume(o, shape_key, N, replica, rank, tensors, session.get());
    const absl::Status agreed = AgreeOnDaemon(world, progress, read.status());
    if (progress->daemon_lost) return agreed;
    ASSIGN_OR_RETURN(double failed, world.Sum(read.ok() ? 0.0 : 1.0));
    if (!read.ok()) return read.status();
    if (failed > 0)
      return absl::FailedPreconditionError(absl::StrCat(
          "resume: another rank could not resume from '", o.resume, "' (its error says why)"));
    ResumeState rs = *std::move(read);
    RankState& st = rs.st;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (st.numel(i) != tensors[i].numel)
        return absl::DataLossError(absl::StrCat("resume: tensor '", tensors[i].name,
                                                "' has the wrong size in the checkpoint"));
      UploadStored(ops, tensors[i], st.tensors[i]);  // the stored values, as they were
    }
    RETURN_IF_ERROR(dev->Synchronize());
    widened = !bf16;
    RETURN_IF_ERROR(widen());
    st.tensors.clear();
    absl::Status restored = engine->Restore(rs.daemon_tag, st.engine);
    if (rs.uploaded) {  // the re-partitioned daemon state was only for this Restore
      absl::Status del = session->DeleteCheckpoint(rs.daemon_tag);
      if (restored.ok() && !del.ok() && !absl::IsNotFound(del)) restored = del;
    }
    if (!restored.ok() && !rs.missing.empty())
      restored = Annotate(restored, absl::StrCat("the daemon holds no checkpoint ",
                                                 rs.missing.front(), " of the writing run"));
    RETURN_IF_ERROR(AgreeOnDaemon(world, progress, restored));
    batcher.Seek(st.data_position);
    start = st.step;
    if (lead) {
      if (rs.written_dp == N)
        printf("resumed from checkpoint '%s' at step %ld\n", o.resume.c_str(), (long)start);
      else
        printf("resumed from checkpoint '%s' at step %ld (written with --dp %ld, re-partitioned "
               "for --dp %d)\n",
               o.resume.c_str(), (long)start, (long)rs.written_dp, N);
    }
  }

  if (!o.init_from.empty()) {
    // Another run's weights, a fresh optimizer: fine-tuning from a checkpoint in any mode.
    const std::string file = absl::StrCat(o.init_from, ".rank", rank, ".trainer");
    ASSIGN_OR_RETURN(RankState st, DecodeState(file));
    std::vector<int64_t> want = shape_key, got = st.shape;
    if (got.size() == want.size()) got[9] = want[9];  // the mode may differ
    if (written_dp(st) != N)
      return absl::FailedPreconditionError(absl::StrCat(
          "init_from: ", file, " was written by a run with --dp ", written_dp(st),
          ", and this run has --dp ", N, "; use the same --dp"));
    if (got != want || st.tensors.size() != tensors.size())
      return absl::FailedPreconditionError(absl::StrCat(
          "init_from: ", file, " holds another model, batch or rank count"));
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (st.numel(i) != tensors[i].numel)
        return absl::DataLossError(absl::StrCat("init_from: tensor '", tensors[i].name,
                                                "' has the wrong size in ", file));
      // Into the working fp32 values (a bf16 file's widened, exact); a bf16 model rounds them
      // below (a bf16 file's: back to the same bits).
      const std::vector<float> values = FileValuesAsFloat(st, i);
      ops.Upload(tensors[i].value, values.data(), tensors[i].numel);
    }
    RETURN_IF_ERROR(dev->Synchronize());
    RETURN_IF_ERROR(round_values());
    if (lead)
      printf("initialised from %s (step %ld of that run); its %s weights%s; optimizer state and "
             "data order new\n",
             o.init_from.c_str(), (long)st.step, ModelDtypeName(st.dtype),
             st.dtype == o.model_dtype ? ""
             : bf16 ? ", rounded to bf16"
                    : ", widened to fp32");
  }

  // Output files (rank 0).
  const std::string csv_path = o.out_dir + "/metrics.csv";
  std::FILE* csv = nullptr;
  RETURN_IF_ERROR(MakeDirs(o.out_dir + "/checkpoints"));
  if (lead) {
    const bool append = start > 0;
    if (append) RETURN_IF_ERROR(TruncateMetrics(csv_path, start));
    csv = std::fopen(csv_path.c_str(), append ? "a" : "w");
    if (csv == nullptr) return ErrnoStatus("fopen", csv_path);
    if (!append)
      std::fprintf(csv,
                   "step,loss,eval_loss,lr,tokens_per_s,step_s,compute_s,optimizer_s,copies_s,"
                   "stall_s,bytes_to_host,bytes_to_device,grad_norm\n");
    const std::string batch =
        N == 1 ? absl::StrCat(B)
               : absl::StrCat(B, " per replica (global ", N * B, ")");
    const std::string ranks =
        N == 1 ? absl::StrCat(D, " ranks")
               : absl::StrCat(D, " TSP ranks, x ", N, " data-parallel replicas (", N * D,
                              " ranks; each rank's optimizer state 1/", N, " of its shard's)");
    printf("training %s: preset %s, %ld layers, d_model %ld, %ld heads, d_ff %ld, seq %ld, "
           "batch %s, vocab %ld: %.2fM parameters (%.2fM on each of %s); %s weights and "
           "gradients; mode %s; device %s; data %s (%zu train / %zu eval tokens)\n",
           o.run_name.c_str(), o.preset.c_str(), (long)cfg.layers, (long)cfg.C, (long)cfg.H,
           (long)cfg.FF, (long)T, batch.c_str(), (long)cfg.vocab, params_total / 1e6,
           params_local / 1e6, ranks.c_str(), ModelDtypeName(o.model_dtype),
           OffloadModeName(o.engine.mode), dev->name().c_str(), corpus.source.c_str(),
           corpus.train.size(),
           corpus.eval.size());
    std::fflush(stdout);
  }

  const int64_t last_step = o.stop_at > 0 ? std::min(o.stop_at, o.steps) : o.steps;
  auto evaluates = [&](int64_t step) {
    return (o.eval_every > 0 && step % o.eval_every == 0) || step == last_step;
  };
  const int64_t eval_n =
      have_eval ? std::max<int64_t>(
                      1, std::min(o.eval_batches, std::max(eval_batcher->full_batches_per_epoch(),
                                                           static_cast<int64_t>(1))))
                : 0;
  // The global batch; this replica's sequences start at `mine`.
  std::vector<int32_t> tokens(N * B * T), targets(N * B * T);
  const int64_t mine = static_cast<int64_t>(replica) * B * T;

  // --dump_init: the batches of steps 1..steps and of an evaluation, drawn by the batchers
  // themselves (then rewound), the weights, the configuration. The loop below checks that it
  // trains and evaluates on exactly these batches.
  DumpedBatches dumped;
  if (!o.dump_init.empty()) {
    const int64_t position = batcher.position();
    for (int64_t step = 1; step <= o.steps; ++step) {
      batcher.Next(tokens.data(), targets.data());
      dumped.tokens.insert(dumped.tokens.end(), tokens.begin(), tokens.end());
      dumped.targets.insert(dumped.targets.end(), targets.begin(), targets.end());
    }
    batcher.Seek(position);
    if (have_eval) eval_batcher->Seek(0);
    for (int64_t i = 0; i < eval_n; ++i) {
      eval_batcher->Next(tokens.data(), targets.data());
      dumped.eval_tokens.insert(dumped.eval_tokens.end(), tokens.begin(), tokens.end());
      dumped.eval_targets.insert(dumped.eval_targets.end(), targets.begin(), targets.end());
    }
    std::vector<double> lrs;
    std::vector<int64_t> eval_steps;
    for (int64_t step = 1; step <= o.steps; ++step) {
      lrs.push_back(LearningRate(o, step));
      if (step <= last_step && evaluates(step) && have_eval) eval_steps.push_back(step);
    }
    RETURN_IF_ERROR(
        WriteInitDump(o, cfg, B, T, corpus, tensors, *dev, dumped, lrs, eval_steps));
    if (lead) {
      printf("wrote the initial weights, configuration and batches to %s\n", o.dump_init.c_str());
      std::fflush(stdout);
    }
  }
  // Whether the current tokens / targets are batch `index` of the dumped ones (true without a
  // dump).
  auto is_dumped = [&](const std::vector<int32_t>& want_tokens,
                       const std::vector<int32_t>& want_targets, int64_t index) {
    if (o.dump_init.empty()) return true;
    const int64_t at = index * B * T;
    return std::equal(tokens.begin(), tokens.end(), want_tokens.begin() + at) &&
           std::equal(targets.begin(), targets.end(), want_targets.begin() + at);
  };
  // The model's forward on this rank's device (the CPU API on host memory, the view form on a
  // GPU); cache may be null (no backward).
  auto forward = [&](parallel::DistributedCache* cache) -> absl::StatusOr<double> {
    RETURN_IF_ERROR(widen());  // a bf16 model's working values are its stored ones
    if (dev->host())
      return model.Forward(ops, w, tokens.data() + mine, targets.data() + mine, B, T, cache);
    return model.Forward(ops, wv, tokens.data() + mine, targets.data() + mine, B, T, cache);
  };
  // The mean over the replicas of a loss (each over its share of the global batch).
  auto replica_mean = [&](double x) -> absl::StatusOr<double> {
    if (N == 1) return x;
    ASSIGN_OR_RETURN(double sum, AllReduceSum(world.dp, x));
    return sum / N;
  };
  auto evaluate = [&]() -> absl::StatusOr<double> {
    if (!have_eval) return std::nan("");
    Batcher& eb = *eval_batcher;
    eb.Seek(0);
    double sum = 0;
    for (int64_t i = 0; i < eval_n; ++i) {
      eb.Next(tokens.data(), targets.data());
      if (!is_dumped(dumped.eval_tokens, dumped.eval_targets, i))
        return absl::InternalError(absl::StrCat(
            "dump_init: evaluation batch ", i, " differs from the dumped one (a trainer bug)"));
      ASSIGN_OR_RETURN(double local, forward(nullptr));
      ASSIGN_OR_RETURN(double loss, replica_mean(local));
      sum += loss;
    }
    return sum / static_cast<double>(eval_n);
  };
  auto checkpoint = [&](int64_t step) -> absl::Status {
    const std::string tag = absl::StrCat(o.run_name, "-step", step);
    RankState st;
    st.step = step;
    st.data_position = batcher.position();
    st.shape = shape_key;
    st.dtype = o.model_dtype;
    st.tensors.resize(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) DownloadStored(ops, tensors[i], &st.tensors[i]);
    RETURN_IF_ERROR(dev->Synchronize());
    for (size_t i = 0; i < tensors.size(); ++i)  // drop a bf16 tensor's padding to whole floats
      st.tensors[i].resize(tensors[i].numel * tensors[i].elem_size());
    absl::StatusOr<std::string> engine_state = engine->Checkpoint(absl::StrCat(tag, ".r", rank));
    RETURN_IF_ERROR(AgreeOnDaemon(world, progress, engine_state.status()));
    st.engine = std::move(*engine_state);
    RETURN_IF_ERROR(WriteFileAtomically(RankFile(o, tag, rank), EncodeState(st)));
    RETURN_IF_ERROR(world.Barrier());  // every rank holds the new one before any old one goes
    progress->checkpoint = tag;
    progress->checkpoint_step = step;
    PruneCheckpoints(o, rank, engine.get());
    if (lead) {
      printf("checkpoint '%s' written (step %ld; resume with --resume %s)\n", tag.c_str(),
             (long)step, tag.c_str());
      std::fflush(stdout);
    }
    return absl::OkStatus();
  };

  std::vector<double> losses;
  double first_loss = std::nan(""), last_eval = std::nan("");
  double sum_step = 0, sum_compute = 0, sum_opt = 0, sum_copies = 0, sum_stall = 0;
  double sum_traffic = 0, migrated = 0;
  int64_t timed = 0, reselections = 0;
  for (int64_t step = start + 1; step <= last_step; ++step) {
    const auto t0 = Clock::now();
    batcher.Next(tokens.data(), targets.data());
    if (!is_dumped(dumped.tokens, dumped.targets, step - 1))
      return absl::InternalError(absl::StrCat(
          "dump_init: step ", step, "'s batch differs from the dumped one (a trainer bug)"));
    for (const Tensor& t : tensors) ops.Fill(t.grad, t.numel, 0.0f);
    parallel::DistributedCache cache;
    ASSIGN_OR_RETURN(double local_loss, forward(&cache));
    if (dev->host()) {
      RETURN_IF_ERROR(model.Backward(ops, w, cache, &g));
    } else {
      RETURN_IF_ERROR(model.Backward(ops, wv, cache, gv));
      RETURN_IF_ERROR(dev->Synchronize());  // the compute time covers the queued work
    }
    const double compute = Since(t0);
    ASSIGN_OR_RETURN(double loss, replica_mean(local_loss));
    RETURN_IF_ERROR(average_grads());
    // Clip by the global norm: sharded tensors count on their owner, replicated ones once (the
    // gradients, averaged, are the same on every replica: the norm is the TSP group's).
    double sq = 0;
    if (dev->host()) {
      for (const Tensor& t : tensors) {
        if (t.replicated && !tsp_lead) continue;
        for (int64_t i = 0; i < t.numel; ++i) sq += static_cast<double>(t.grad[i]) * t.grad[i];
      }
    } else {
      ASSIGN_OR_RETURN(sq, BackendSquaredNorm(*dev, tensors, tsp_lead));
    }
    ASSIGN_OR_RETURN(double total_sq, AllReduceSum(comm, sq));
    const double norm = std::sqrt(total_sq);
    if (o.clip > 0 && norm > o.clip) {
      const float scale = static_cast<float>(o.clip / norm);
      if (dev->host()) {
        for (const Tensor& t : tensors)
          for (int64_t i = 0; i < t.numel; ++i) t.grad[i] *= scale;
      } else {
        // g = scale * g in place (an element-wise overwrite: each element is read, then written,
        // by the same thread), in stream order before the engine reads the gradients.
        for (const Tensor& t : tensors)
          dev->kernel().Accumulate(t.grad, t.grad, kernels::GradType::kFp32, scale, t.numel,
                                   kernels::AccumulateMode::kOverwrite);
      }
    }
    if (bf16) {
      // The gradient the engine reads: the averaged, clipped fp32 gradient rounded once to
      // nearest even.
      for (const Tensor& t : tensors) dev->kernel().FloatToBf16(t.grad, t.grad16, t.numel);
    }
    const double lr = LearningRate(o, step);
    RETURN_IF_ERROR(AgreeOnDaemon(world, progress, engine->Step(lr)));
    widened = !bf16;  // the step wrote new stored values
    RETURN_IF_ERROR(gather_blocks(o.engine.mode == OffloadMode::kZenFlow &&
                                  !engine->last_timings().boundary));
    const StepTimings& tm = engine->last_timings();
    const double step_s = Since(t0);
    if (step == start + 1) first_loss = loss;  // this process's first step (a resume's too)
    losses.push_back(loss);
    double eval = std::nan("");
    if (evaluates(step)) {
      ASSIGN_OR_RETURN(eval, evaluate());
      last_eval = eval;
    }
    if (step > start + 1 || o.steps - start == 1) {  // the first step pays allocation and setup
      sum_step += step_s;
      sum_compute += compute;
      sum_opt += tm.optimizer;
      sum_copies += tm.copies;
      sum_stall += tm.stall;
      ++timed;
    }
    sum_traffic += static_cast<double>(tm.bytes_to_host + tm.bytes_to_device);
    migrated += static_cast<double>(tm.migrated_columns);
    reselections += tm.reselected ? 1 : 0;
    if (lead) {
      const double tps = static_cast<double>(N * B * T) / step_s;
      std::fprintf(csv, "%ld,%.9g,%.9g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%lu,%lu,%.6g\n",
                   (long)step, loss, eval, lr, tps, step_s, compute, tm.optimizer, tm.copies,
                   tm.stall, (unsigned long)tm.bytes_to_host, (unsigned long)tm.bytes_to_device,
                   norm);
      std::fflush(csv);
      if (!o.quiet) {
        printf("step %4ld/%ld  loss %.4f  lr %.2e  |g| %.3f  %6.0f tok/s  step %.3f s "
               "(compute %.3f, optimizer %.3f, copies %.3f, stall %.3f)\n",
               (long)step, (long)o.steps, loss, lr, norm, tps, step_s, compute, tm.optimizer,
               tm.copies, tm.stall);
      }
      if (!std::isnan(eval)) printf("eval step %ld  loss %.4f\n", (long)step, eval);
      std::fflush(stdout);
    }
    if ((o.checkpoint_every > 0 && step % o.checkpoint_every == 0) || step == last_step)
      RETURN_IF_ERROR(checkpoint(step));
  }
  RETURN_IF_ERROR(AgreeOnDaemon(world, progress, engine->Flush()));
  widened = !bf16;
  // The engine's accounting of the buffers it was given (DeviceFootprint::params: value and
  // gradient, numel x dtype bytes each) and of its own, over the elements it updates.
  const DeviceFootprint footprint = engine->Footprint();
  int64_t engine_elements = 0;
  for (const EngineParam& p : eparams) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    engine_elements += n;
  }
  RETURN_IF_ERROR(gather_blocks(false));  // the flushed cold columns of every replica's blocks
  // Traffic over every rank (each moves its own shards): one all-reduce for the whole run.
  ASSIGN_OR_RETURN(sum_traffic, world.Sum(sum_traffic));
  // Columns migrated between the device and the daemon (every rank's engine, each of its own
  // blocks), and this rank's reselections (the same on every rank).
  ASSIGN_OR_RETURN(migrated, world.Sum(migrated));
  // The daemon's share of the run: this run's sessions' registered elements and pinned bytes
  // (summed over the ranks), and the daemon's GetStats (every session it holds now) read by
  // rank 0 while every rank's session is still open (between the sum and the final barrier).
  double run_elements = 0, run_pinned = 0;
  if (client != nullptr && session != nullptr) {
    absl::StatusOr<std::vector<v1::SessionInfo>> sessions = client->ListSessions();
    if (sessions.ok()) {
      for (const v1::SessionInfo& si : *sessions) {
        if (si.session_id() != session->ref().session_id()) continue;
        run_elements = static_cast<double>(si.param_elements());
        run_pinned = static_cast<double>(si.pinned_bytes());
      }
    }
  }
  ASSIGN_OR_RETURN(run_elements, world.Sum(run_elements));
  ASSIGN_OR_RETURN(run_pinned, world.Sum(run_pinned));
  v1::Stats daemon_stats;
  if (lead && client != nullptr) {
    absl::StatusOr<v1::Stats> stats = client->GetStats();
    if (stats.ok()) daemon_stats = *stats;
  }

  if (lead) {
    std::fclose(csv);
    const int64_t n = static_cast<int64_t>(losses.size());
    const int64_t tail = std::min<int64_t>(10, n);
    const double final_loss =
        n > 0 ? std::accumulate(losses.end() - tail, losses.end(), 0.0) / tail : std::nan("");
    const double steps_done = std::max<int64_t>(timed, 1);
    const double model_bf16 = 2.0 * static_cast<double>(params_total);
    // Bytes per parameter of this rank: the model's weights and gradients as stored (the
    // engine's parameters), a bf16 model's fp32 working copies, the engine's own device state.
    const double elements = static_cast<double>(std::max<int64_t>(engine_elements, 1));
    const double stored_bytes = static_cast<double>(footprint.params) / elements;
    const double working_bytes = bf16 ? 8.0 : 0.0;  // fp32 value and gradient per element
    const double engine_bytes = static_cast<double>(footprint.engine()) / elements;
    const std::string plot = o.out_dir + "/train.png";
    absl::Status plotted = WritePlot(plot, {{OffloadModeName(o.engine.mode), csv_path}},
                                     absl::StrCat(o.run_name, ": ", o.preset, ", D=", D));
    std::string summary = absl::StrFormat(
        "{\"mode\": \"%s\", \"D\": %d, \"dp\": %d, \"batch\": %ld, \"global_batch\": %ld, "
        "\"preset\": \"%s\", \"params\": %ld, \"steps\": %ld, "
        "\"first_step\": %ld, \"last_step\": %ld, \"first_loss\": %.6f, "
        "\"final_train_loss\": %.6f, \"final_eval_loss\": %.6f, "
        "\"tokens_per_s\": %.3f, \"step_s\": %.6f, \"compute_s\": %.6f, \"optimizer_s\": %.6f, "
        "\"copies_s\": %.6f, \"stall_s\": %.6f, \"stall_share\": %.6f, "
        "\"host_traffic_per_step_over_bf16_model\": %.6f, \"dp_collectives_s\": %.6f, "
        "\"reselections\": %ld, \"migrated_columns\": %.0f, "
        "\"run_param_elements\": %.0f, \"run_pinned_bytes\": %.0f, "
        "\"daemon_sessions\": %ld, \"daemon_param_elements\": %ld, "
        "\"daemon_pinned_bytes\": %lu, \"model_dtype\": \"%s\", "
        "\"model_bytes_per_param\": %.4f, \"working_bytes_per_param\": %.4f, "
        "\"engine_device_bytes_per_param\": %.4f}\n",
        OffloadModeName(o.engine.mode), D, N, (long)B, (long)(N * B), o.preset,
        (long)params_total, (long)o.steps,
        (long)(start + 1), (long)last_step, first_loss, final_loss, last_eval,
        static_cast<double>(N * B * T) * steps_done / sum_step,
        sum_step / steps_done, sum_compute / steps_done, sum_opt / steps_done,
        sum_copies / steps_done, sum_stall / steps_done, sum_stall / std::max(sum_step, 1e-12),
        sum_traffic / std::max<double>(n, 1) / model_bf16, sum_dp / std::max<double>(n, 1),
        (long)reselections, migrated, run_elements, run_pinned, (long)daemon_stats.sessions(),
        (long)daemon_stats.param_elements(), (unsigned long)daemon_stats.pinned_bytes(),
        ModelDtypeName(o.model_dtype), stored_bytes, working_bytes, engine_bytes);
    RETURN_IF_ERROR(WriteFileAtomically(o.out_dir + "/summary.json", summary));
    const std::string ran =
        start == 0 && last_step == o.steps
            ? absl::StrCat(o.steps, " steps")
            : absl::StrCat("steps ", start + 1, "-", last_step, " of ", o.steps,
                           start > 0 ? absl::StrCat(" (resumed after step ", start, ")") : "",
                           last_step < o.steps ? " (stopped early: --stop_at)" : "");
    printf("\n== summary: %s, %s, D = %d%s, %.2fM parameters, %s\n", o.run_name.c_str(),
           OffloadModeName(o.engine.mode), D,
           N == 1 ? "" : absl::StrCat(" x dp ", N).c_str(), params_total / 1e6, ran.c_str());
    printf("  train loss   %.4f -> %.4f (step %ld -> the mean of the last %ld steps)\n",
           first_loss, final_loss, (long)(start + 1), (long)tail);
    printf("  eval loss    %.4f\n", last_eval);
    printf("  throughput   %.0f tokens/s\n",
           static_cast<double>(N * B * T) * steps_done / sum_step);
    printf("  step time    %.3f s: compute %.3f, optimizer %.3f, copies %.3f, stall %.3f "
           "(stall share %.1f%%)\n",
           sum_step / steps_done, sum_compute / steps_done, sum_opt / steps_done,
           sum_copies / steps_done, sum_stall / steps_done,
           100.0 * sum_stall / std::max(sum_step, 1e-12));
    printf("  model        %s weights and gradients: %.2f bytes per parameter%s; the engine's "
           "device-side state %.2f bytes per parameter (rank 0)\n",
           ModelDtypeName(o.model_dtype), stored_bytes,
           bf16 ? absl::StrFormat(" (and %.2f of fp32 working copies for the fp32 compute)",
                                  working_bytes).c_str()
                : "",
           engine_bytes);
    printf("  host traffic %.3f x the model's bf16 size per step\n",
           sum_traffic / std::max<double>(n, 1) / model_bf16);
    if (N > 1)
      printf("  data parallel %.3f s per step in the gradient all-reduce and the parameter "
             "all-gather\n",
             sum_dp / std::max<double>(n, 1));
    if (client != nullptr)
      printf("  daemon       this run's %ld sessions: %.0f registered elements, %.1f MB pinned "
             "(the daemon: %ld sessions, %ld elements, %.1f MB pinned)\n",
             (long)(N * D), run_elements, run_pinned / 1e6, (long)daemon_stats.sessions(),
             (long)daemon_stats.param_elements(), daemon_stats.pinned_bytes() / 1e6);
    printf("  metrics      %s, %s/summary.json\n", csv_path.c_str(), o.out_dir.c_str());
    if (plotted.ok()) printf("  plot         %s\n", plot.c_str());
    else printf("  plot         not drawn: %s\n", std::string(plotted.message()).c_str());
    std::fflush(stdout);
  }
  return world.Barrier();
}

// Waits up to `seconds` for a daemon that answers SERVING at `socket`.
absl::Status WaitForDaemon(const std::string& socket, int64_t seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  absl::Status last = absl::UnavailableError("not tried");
  while (std::chrono::steady_clock::now() < deadline) {
    auto client = Client::Connect(socket, 1000);
    if (client.ok()) {
      auto health = (*client)->Health();
      if (health.ok() && *health == "SERVING") return absl::OkStatus();
      last = health.ok() ? absl::UnavailableError(*health) : health.status();
    } else {
      last = client.status();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  return last;
}

// The error of a run whose daemon is gone for good: the socket, the last checkpoint and the
// command that continues from it.
absl::Status DaemonGone(const TrainOptions& o, const Progress& p, const absl::Status& cause,
                        const std::string& why) {
  std::string next;
  if (p.checkpoint.empty()) {
    next = absl::StrCat("no checkpoint was written yet: restart stallfreed and run the same "
                        "command again (--checkpoint_every N loses less next time)");
  } else {
    next = absl::StrCat("the last checkpoint is '", p.checkpoint, "' (step ", p.checkpoint_step,
                        "): restart stallfreed (stallfreed --socket ", o.socket,
                        " --state_dir <the same directory>) and continue with: ",
                        o.command_line.empty() ? "trainer <the same flags>" : o.command_line,
                        " --resume ", p.checkpoint);
  }
  return absl::UnavailableError(absl::StrCat("stallfreed at ", o.socket, " went away (",
                                             cause.message(), ")", why, "; ", next));
}

}  // namespace

absl::Status RunRank(const TrainOptions& options, parallel::Communicator* comm, int local_rank) {
  return RunRank(options, RankGroups{comm, nullptr}, local_rank);
}

absl::Status RunRank(const TrainOptions& options, const RankGroups& groups, int local_rank) {
  if (groups.tsp == nullptr)
    return absl::InvalidArgumentError("RunRank: no TSP group (RankGroups::tsp is null)");
  World world;
  world.tsp = groups.tsp;
  world.dp = groups.dp != nullptr && groups.dp->size() > 1 ? groups.dp : nullptr;
  TrainOptions o = options;
  Progress progress;
  progress.checkpoint = o.resume;
  for (;;) {
    progress.daemon_lost = false;
    absl::Status st = TrainAttempt(o, world, local_rank, &progress);
    if (st.ok() || !progress.daemon_lost) return st;
    // Every rank is here: the loss was agreed on (AgreeOnDaemon).
    const bool lead = world.rank() == 0;
    if (o.reconnect_s <= 0) return DaemonGone(o, progress, st, "");
    if (lead) {
      printf("stallfreed at %s went away (%s); waiting up to %ld s for it (--reconnect_s)\n",
             o.socket.c_str(), std::string(st.message()).c_str(), (long)o.reconnect_s);
      std::fflush(stdout);
    }
    const absl::Status back = WaitForDaemon(o.socket, o.reconnect_s);
    ASSIGN_OR_RETURN(double missing, world.Sum(back.ok() ? 0.0 : 1.0));
    if (missing > 0)
      return DaemonGone(o, progress, st,
                        absl::StrCat(" and did not answer within --reconnect_s ", o.reconnect_s,
                                     " s (", back.ok() ? "on another rank" : back.message(), ")"));
    if (!progress.checkpoint.empty()) {
      o.resume = progress.checkpoint;
      o.init_from.clear();
    }
    if (lead) {
      if (progress.checkpoint.empty())
        printf("stallfreed is back; no checkpoint yet, so the run starts over\n");
      else
        printf("stallfreed is back; continuing from checkpoint '%s' (step %ld): the steps since "
               "are computed again\n",
               progress.checkpoint.c_str(), (long)progress.checkpoint_step);
      std::fflush(stdout);
    }
  }
}

}  // namespace trainer
}  // namespace stallfree
