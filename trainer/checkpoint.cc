#include "trainer/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/checksum.h"
#include "common/log.h"
#include "common/status.h"

namespace stallfree {
namespace trainer {
namespace {

constexpr char kMagicV1[8] = {'S', 'F', 'T', 'R', 'A', 'I', 'N', '1'};
constexpr char kMagicV2[8] = {'S', 'F', 'T', 'R', 'A', 'I', 'N', '2'};
constexpr int64_t kFileFp32 = 0, kFileBf16 = 1;

void PutI64(std::string* out, int64_t x) { out->append(reinterpret_cast<const char*>(&x), 8); }

// The fields of a verified file's bytes, read in order (each bounded by the trailer).
class Reader {
 public:
  explicit Reader(const std::string& in) : in_(in) {}
  bool I64(int64_t* x) {
    if (pos_ + 8 > in_.size() - 8) return false;
    memcpy(x, in_.data() + pos_, 8);
    pos_ += 8;
    return true;
  }
  // n bytes into *out; false if they run into the trailer.
  bool Bytes(int64_t n, std::string* out) {
    if (n < 0 || pos_ + static_cast<size_t>(n) > in_.size() - 8) return false;
    out->assign(in_.data() + pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return true;
  }
  // Whether exactly n bytes are left before the trailer.
  bool Left(int64_t n) const { return n >= 0 && pos_ + static_cast<size_t>(n) == in_.size() - 8; }

 private:
  const std::string& in_;
  size_t pos_ = 8;  // after the magic
};

}  // namespace


int64_t WrittenDp(const RankState& st) { return st.shape.size() > kDpKey ? st.shape[kDpKey] : 1; }

bool SameModel(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  if (a.size() < kKeyFields || b.size() < kKeyFields) return false;
  for (size_t i = 0; i < kKeyFields; ++i)
    if (i != kKeyBatch && a[i] != b[i]) return false;
  return true;
}

std::string EncodeState(const RankState& s) {
  std::string out(kMagicV2, 8);
  PutI64(&out, s.step);
  PutI64(&out, s.data_position);
  PutI64(&out, static_cast<int64_t>(s.shape.size()));
  for (int64_t x : s.shape) PutI64(&out, x);
  PutI64(&out, s.dtype == DType::kBf16 ? kFileBf16 : kFileFp32);
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
  Reader r(in);
  RankState s;
  int64_t n = 0;
  if (!r.I64(&s.step) || !r.I64(&s.data_position) || !r.I64(&n) || n < 0 || n > 64)
    return corrupt("malformed");
  s.shape.resize(n);
  for (int64_t& x : s.shape)
    if (!r.I64(&x)) return corrupt("malformed");
  if (v2) {
    int64_t dtype;
    if (!r.I64(&dtype) || (dtype != kFileFp32 && dtype != kFileBf16))
      return corrupt("malformed (unknown model dtype)");
    s.dtype = dtype == kFileBf16 ? DType::kBf16 : DType::kFp32;
  }
  const int64_t elem = static_cast<int64_t>(s.elem_size());
  if (!r.I64(&n) || n < 0 || n > 100000) return corrupt("malformed");
  s.tensors.resize(n);
  for (auto& t : s.tensors) {
    int64_t len;
    if (!r.I64(&len) || len < 0 || len > static_cast<int64_t>(in.size()) ||
        !r.Bytes(len * elem, &t))
      return corrupt("malformed");
  }
  int64_t len;
  if (!r.I64(&len) || !r.Left(len) || !r.Bytes(len, &s.engine)) return corrupt("malformed");
  return s;
}

std::vector<float> FileValuesAsFloat(const RankState& s, size_t i) {
  const int64_t n = s.numel(i);
  std::vector<float> out(n);
  if (s.dtype != DType::kBf16) {
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

std::string RankFile(const std::string& out_dir, const std::string& tag, int rank) {
  return absl::StrCat(out_dir, "/checkpoints/", tag, ".rank", rank, ".trainer");
}

absl::Status WriteRankFile(const std::string& out_dir, const std::string& tag, int rank,
                           const RankState& s) {
  return WriteFileAtomically(RankFile(out_dir, tag, rank), EncodeState(s));
}

std::vector<int64_t> RunCheckpointSteps(const std::string& out_dir, const std::string& run_name,
                                        int rank) {
  std::vector<int64_t> steps;
  const std::string dir = out_dir + "/checkpoints";
  const std::string prefix = run_name + "-step";
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

void PruneCheckpoints(const std::string& out_dir, const std::string& run_name, int64_t keep,
                      int rank, ZenFlowEngine* engine) {
  if (keep <= 0) return;
  const std::vector<int64_t> steps = RunCheckpointSteps(out_dir, run_name, rank);
  if (static_cast<int64_t>(steps.size()) <= keep) return;
  for (size_t i = 0; i + keep < steps.size(); ++i) {
    const std::string tag = absl::StrCat(run_name, "-step", steps[i]);
    absl::Status st = engine->DeleteCheckpoint(absl::StrCat(tag, ".r", rank));
    if (!st.ok() && !absl::IsNotFound(st))
      SF_LOG(kWarning, "rank %d: could not remove the daemon's checkpoint %s.r%d: %s", rank, tag,
             rank, st.ToString());
    const std::string file = RankFile(out_dir, tag, rank);
    if (unlink(file.c_str()) != 0 && errno != ENOENT)
      ErrnoStatus("unlink", file).IgnoreError();  // logs the errno and the file
  }
}

}  // namespace trainer
}  // namespace stallfree
