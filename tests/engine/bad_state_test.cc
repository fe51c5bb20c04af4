// Bad saved state: what a corrupt optimizer.pt hands the engine, the daemon and repartition.
//
// BadStateTest.CorruptStatesGiveClearErrors builds real states (engine blobs V2 / V3 / V4 of
// zenflow, predicted rounds, bf16, sync-offload and no-offload engines, fresh and mid-round; the
// daemon checkpoints of real sessions) and runs >= 10,000 deterministic mutations of them (bit
// flips, extreme bytes and 8-byte words, count fields set to huge values, every occurrence of a
// count set at once so that the fields that must agree still do, every count field of a blob
// set to each of six extreme values in turn, truncations of every length class, appended
// garbage, header shapes whose product overflows or wraps, with the checksum
// recomputed so the header is what is judged) through every reader: ParseEngineBlob, the
// engine's Restore (no-offload, zenflow, predicted) and RestoreBytes against a real daemon, the
// daemon checkpoint reader (ReadCheckpointHeader / ReadCheckpointArrays / WriteCheckpointChunk /
// ListCheckpointFiles) and Repartition. Each case must return OK or a clear error (a documented
// code and a message), throw nothing, and allocate nothing larger than 64 x its input + 1 MiB
// (a bound the test binary's operator new enforces on the test's thread); the daemon must still
// serve a good Restore afterwards.
//
// BadStateTest.RestoreIsAllOrNothingAgainstAFailingDaemon: a Restore whose daemon refuses or
// fails (a target that fails as a vanished daemon would, a tag the daemon does not hold, a
// daemon checkpoint of another layout) leaves the engine stepping bit for bit as an untouched
// engine does.
#include <sys/stat.h>
#include <sys/wait.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/session_target.h"
#include "common/checksum.h"
#include "common/state_format.h"
#include "engine/blob.h"
#include "engine/repartition.h"
#include "engine/zenflow.h"
#include "kernels/ops.h"
#include "kernels/optimizer.h"
#include "server/checkpoint.h"
#include "tests/engine/engine_fixture.h"

// ---- The allocation bound: operator new of this binary refuses, on a thread that set a bound,
// any single allocation above it (and records its size); the cases catch the bad_alloc.
namespace {
thread_local size_t t_alloc_limit = 0;  // 0: no bound
thread_local size_t t_alloc_over = 0;   // the allocation that broke it
}  // namespace

// Not under TSan (make test-tsan): there the replaced new and delete would be the test binary's
// malloc and free calls for memory that Debian's uninstrumented gRPC hands between its threads,
// which TSan reports as races (its suppressions name gRPC's own calls, not these). The bound is
// checked by the plain and ASan runs of make test.
#if !defined(__SANITIZE_THREAD__)
void* operator new(size_t n) {
  if (t_alloc_limit != 0 && n > t_alloc_limit) {
    t_alloc_over = n;
    throw std::bad_alloc();
  }
  if (void* p = malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) { return operator new(n); }
// The nothrow forms too (libraries such as gRPC use them): every plain new of the binary is then
// malloc, every plain delete free, which ASan checks as a matching pair.
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  try {
    return operator new(n);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](size_t n, const std::nothrow_t& tag) noexcept { return operator new(n, tag); }
void operator delete(void* p) noexcept { free(p); }
void operator delete[](void* p) noexcept { free(p); }
void operator delete(void* p, size_t) noexcept { free(p); }
void operator delete[](void* p, size_t) noexcept { free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { free(p); }
#endif  // !__SANITIZE_THREAD__

namespace stallfree {
namespace {

using engine_test::Config;
using engine_test::FillGrads;
using engine_test::Lr;
using engine_test::SmallModel;
using engine_test::Tensor;
using engine_test::Tensor16;

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();

template <typename T>
std::vector<EngineParam> Params(std::vector<engine_test::ModelTensor<T>>* ts, DType dtype) {
  std::vector<EngineParam> ps;
  for (auto& t : *ts) ps.push_back({t.name, t.shape, t.value.data(), t.grad.data(), dtype});
  return ps;
}

// ---- Cases: each under the bound, its outcome tallied ----

struct Tally {
  int cases = 0;
  std::map<absl::StatusCode, int> codes;
  int failures = 0;  // cases that threw, allocated too much or gave an unclear error
};

// Runs one case: `f` returns its status. False (the test failed, naming the case) if it threw,
// allocated more than 64 x `input` + 1 MiB at once, or gave an error without a documented code
// or without a message.
bool RunCase(const std::string& what, size_t input, Tally* tally,
             const std::function<absl::Status()>& f) {
  ++tally->cases;
  const size_t bound = 64 * input + (size_t{1} << 20);
  absl::Status st;
  try {
    t_alloc_limit = bound;
    st = f();
    t_alloc_limit = 0;
  } catch (const std::bad_alloc&) {
    t_alloc_limit = 0;
    ++tally->failures;
    ADD_FAILURE() << what << ": an allocation of " << t_alloc_over << " bytes from "
                  << input << " bytes of input (the bound is " << bound << ")";
    return false;
  } catch (const std::exception& e) {
    t_alloc_limit = 0;
    ++tally->failures;
    ADD_FAILURE() << what << ": threw " << e.what();
    return false;
  }
  ++tally->codes[st.code()];
  switch (st.code()) {
    case absl::StatusCode::kOk:
      return true;
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:  // the daemon: a checkpoint of another layout
    case absl::StatusCode::kPermissionDenied:    // the daemon: another uid's checkpoint
      if (!st.message().empty()) return true;
      break;
    default:
      break;
  }
  ++tally->failures;
  ADD_FAILURE() << what << ": not a clear error: " << st;
  return false;
}

// ---- Mutations ----

// The extreme values a count or size field is set to: negative, huge, the sizes at which
// n * 4 or n * 8 wraps to a small number, the input's own size.
std::vector<int64_t> Extremes(size_t len) {
  const int64_t l = static_cast<int64_t>(len);
  return {kI64Max,
          kI64Min,
          -1,
          -(int64_t{1} << 31),
          int64_t{1} << 31,
          int64_t{1} << 32,
          int64_t{1} << 40,
          (int64_t{1} << 40) + 1,
          int64_t{1} << 61,
          int64_t{1} << 62,
          (int64_t{1} << 62) + 3,  // x 4 wraps to 12
          (int64_t{1} << 61) + 2,  // x 8 wraps to 16
          kI64Max - 7,
          l,
          l / 4,
          l / 4 + 1,
          l / 8 + 1};
}

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}
  static constexpr int kKinds = 8;

  // Mutation `kind` of `in` (a random one of that kind); *what says which.
  std::string Mutate(const std::string& in, int kind, std::string* what) {
    std::string s = in;
    const std::vector<int64_t> ext = Extremes(in.size());
    switch (kind) {
      case 0: {  // bit flips
        const int n = 1 + Pick(3);
        *what = absl::StrCat(n, " bit flips at");
        for (int i = 0; i < n && !s.empty(); ++i) {
          const size_t at = Pick(s.size());
          s[at] ^= static_cast<char>(1 << Pick(8));
          absl::StrAppend(what, " ", at);
        }
        return s;
      }
      case 1: {  // bytes overwritten with extreme values
        static const unsigned char kBytes[] = {0x00, 0xFF, 0x7F, 0x80};
        const int n = 1 + Pick(4);
        const unsigned char b = kBytes[Pick(4)];
        const size_t at = s.empty() ? 0 : Pick(s.size());
        for (int i = 0; i < n && at + i < s.size(); ++i) s[at + i] = static_cast<char>(b);
        *what = absl::StrCat(n, " bytes of ", b, " at ", at);
        return s;
      }
      case 2: {  // an 8-byte word at a random 4-aligned offset set to an extreme value
        if (s.size() < 8) return s + "x";
        const size_t at = Pick((s.size() - 8) / 4 + 1) * 4;
        const int64_t x = ext[Pick(ext.size())];
        memcpy(&s[at], &x, 8);
        *what = absl::StrCat("word at ", at, " = ", x);
        return s;
      }
      case 3: {  // a count field (a small non-negative word) set to an extreme value
        const std::vector<size_t> c = Counts(s);
        if (c.empty()) return s.substr(0, s.size() / 2);
        const size_t at = c[Pick(c.size())];
        const int64_t x = ext[Pick(ext.size())];
        memcpy(&s[at], &x, 8);
        *what = absl::StrCat("count at ", at, " = ", x);
        return s;
      }
      case 4: {  // every occurrence of one count's value set at once (numel and its arrays')
        const std::vector<size_t> c = Counts(s);
        if (c.empty()) return s + std::string(8, '\xff');
        int64_t v;
        memcpy(&v, &s[c[Pick(c.size())]], 8);
        const int64_t x = ext[Pick(ext.size())];
        int n = 0;
        for (size_t at : c) {
          int64_t w;
          memcpy(&w, &s[at], 8);
          if (w == v) {
            memcpy(&s[at], &x, 8);
            ++n;
          }
        }
        *what = absl::StrCat(n, " counts of ", v, " = ", x);
        return s;
      }
      case 5: {  // truncation: every length class
        size_t len;
        switch (Pick(5)) {
          case 0: len = Pick(std::min<size_t>(s.size(), 64)); break;  // nothing, a few words
          case 1: len = s.size() - 1 - Pick(std::min<size_t>(s.size(), 16)); break;  // the end
          case 2: {  // at a field's boundary
            const std::vector<size_t> c = Counts(s);
            len = c.empty() ? s.size() / 2 : c[Pick(c.size())] + Pick(9);
            break;
          }
          case 3: len = s.size() / 2; break;
          default: len = Pick(s.size()); break;
        }
        len = std::min(len, s.size() > 0 ? s.size() - 1 : 0);
        *what = absl::StrCat("cut to ", len, " of ", s.size());
        return s.substr(0, len);
      }
      case 6: {  // oversized: garbage appended
        static const size_t kSizes[] = {1, 4, 8, 24, 4096, 65536};
        const size_t n = kSizes[Pick(6)];
        const bool ff = Pick(2) == 0;
        for (size_t i = 0; i < n; ++i) s.push_back(ff ? '\xff' : static_cast<char>(Pick(256)));
        *what = absl::StrCat(n, ff ? " bytes of 0xff" : " random bytes", " appended");
        return s;
      }
      default: {  // a count set huge, then cut
        std::string first;
        s = Mutate(in, 3, &first);
        const size_t len = s.empty() ? 0 : Pick(s.size());
        *what = absl::StrCat(first, ", cut to ", len);
        return s.substr(0, len);
      }
    }
  }

  // Every count field of `in` set to each of a few extreme values, in turn.
  static std::vector<std::pair<std::string, std::string>> Sweep(const std::string& in) {
    std::vector<std::pair<std::string, std::string>> out;
    for (size_t at : Counts(in))
      for (int64_t x : {int64_t{-1}, kI64Min, int64_t{1} << 31, (int64_t{1} << 40) + 1,
                        (int64_t{1} << 62) + 3, kI64Max}) {
        std::string s = in;
        memcpy(&s[at], &x, 8);
        out.emplace_back(absl::StrCat("count at ", at, " = ", x), std::move(s));
      }
    return out;
  }

  size_t Pick(size_t n) {
    return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_);
  }

 private:
  // The 4-aligned offsets of words that look like counts (0 .. 2^20): the blob's scalars and
  // array lengths, a checkpoint's header length.
  static std::vector<size_t> Counts(const std::string& s) {
    std::vector<size_t> out;
    for (size_t at = 0; at + 8 <= s.size(); at += 4) {
      int64_t w;
      memcpy(&w, &s[at], 8);
      if (w >= 0 && w <= (int64_t{1} << 20)) out.push_back(at);
    }
    return out;
  }

  std::mt19937_64 rng_;
};

// ---- The daemon's checkpoint files, taken apart and put together ----

struct CkptParts {
  StateHeader header;
  std::string body;  // the arrays
};

bool Split(const std::string& file, CkptParts* out) {
  if (file.size() < 24) return false;
  uint64_t hb;
  memcpy(&hb, &file[8], 8);
  if (hb > file.size() - 24) return false;
  absl::StatusOr<StateHeader> header = DecodeStateHeader(file.data() + 16, hb);
  if (!header.ok()) return false;
  out->header = *std::move(header);
  out->body = file.substr(16 + hb, file.size() - 24 - hb);
  return true;
}

// The file with the trailer's checksum recomputed over what precedes it.
std::string Reseal(std::string file) {
  if (file.size() < 8) return file;
  Checksum64 sum;
  sum.Update(file.data(), file.size() - 8);
  const uint64_t d = sum.Digest();
  memcpy(&file[file.size() - 8], &d, 8);
  return file;
}

std::string Join(const StateHeader& header, const std::string& body) {
  const std::string text = EncodeStateHeader(header);
  std::string f("SFCKPT1\n", 8);
  const uint64_t hb = text.size();
  f.append(reinterpret_cast<const char*>(&hb), 8);
  f += text;
  f += body;
  f.append(8, '\0');
  return Reseal(f);
}

// A mutation of a daemon checkpoint: a byte-level one (Mutator), often resealed so that the
// header, not the checksum, is what the reader judges; or a header whose shapes, parameters,
// step counts or length lie.
std::string MutateCheckpoint(const std::string& file, Mutator* mu, std::string* what) {
  CkptParts parts;
  if (mu->Pick(3) != 0 || !Split(file, &parts)) {
    std::string s = mu->Mutate(file, static_cast<int>(mu->Pick(Mutator::kKinds)), what);
    if (mu->Pick(2) == 0) {
      absl::StrAppend(what, ", resealed");
      return Reseal(s);
    }
    return s;
  }
  StateHeader& h = parts.header;
  const size_t p = mu->Pick(h.params.size());
  std::vector<int64_t>* shape = &h.params[p].spec.shape;
  const std::vector<int64_t> ext = Extremes(file.size());
  switch (mu->Pick(7)) {
    case 0: {  // one dimension set to an extreme value
      const size_t d = mu->Pick(shape->size());
      const int64_t x = ext[mu->Pick(ext.size())];
      (*shape)[d] = x;
      *what = absl::StrCat("param ", p, " dim ", d, " = ", x);
      break;
    }
    case 1: {  // dimensions whose product overflows int64
      shape->clear();
      for (int k = 0; k < 2 + static_cast<int>(mu->Pick(3)); ++k) shape->push_back(int64_t{1} << 40);
      *what = absl::StrCat("param ", p, " shape of 2^40s");
      break;
    }
    case 2: {  // x (2^60 + 1) = (2^20 + 1)(2^40 - 2^20 + 1): 16 x numel wraps to the truth
      shape->push_back((int64_t{1} << 20) + 1);
      shape->push_back((int64_t{1} << 40) - (int64_t{1} << 20) + 1);
      *what = absl::StrCat("param ", p, " shape x (2^60 + 1)");
      break;
    }
    case 3: {  // a huge (in range) dimension on a truncated body
      shape->clear();
      shape->push_back(int64_t{1} << 40);
      *what = absl::StrCat("param ", p, " shape [2^40]");
      break;
    }
    case 4: {  // no dimensions, or nine
      shape->clear();
      if (mu->Pick(2) == 0) shape->assign(9, 1);
      *what = absl::StrCat("param ", p, " with ", shape->size(), " dimensions");
      break;
    }
    case 5: {  // many parameters, each claiming a large array
      StateHeader::Param q = h.params[p];
      q.spec.shape = {int64_t{1} << 30};
      h.params.insert(h.params.end(), 64, q);
      *what = "64 parameters of 2^30 elements added";
      break;
    }
    default: {  // the header's length field
      std::string f = Join(h, parts.body);
      const int64_t x = ext[mu->Pick(ext.size())];
      memcpy(&f[8], &x, 8);
      *what = absl::StrCat("header length = ", x);
      return Reseal(f);
    }
  }
  return Join(h, parts.body);
}

// ---- The fixture: a real daemon, real engines and their states ----

// A target whose Restore fails as one over a daemon that went away would (everything else is
// the real session's).
class VanishingOnRestore : public SessionTarget {
 public:
  using SessionTarget::SessionTarget;
  absl::Status Restore(const std::string& tag, DType) override {
    ++calls;
    return absl::UnavailableError(absl::StrCat("Restore of '", tag, "': the daemon went away"));
  }
  int calls = 0;
};

// A model, its session and its engine.
struct Rig {
  std::vector<Tensor> model;
  std::vector<Tensor16> model16;
  std::unique_ptr<SessionTarget> session;
  std::unique_ptr<ZenFlowEngine> engine;
};

class BadStateTest : public engine_test::EngineTest {
 protected:
  static constexpr int kSeed = 11;

  // An engine of `cfg` over a fresh copy of the model (bf16 parameters with `bf16`), on a new
  // session (none for no-offload) or on `target`.
  std::unique_ptr<Rig> MakeRig(const ZenFlowConfig& cfg, bool bf16 = false,
                               std::unique_ptr<SessionTarget> target = nullptr) {
    auto r = std::make_unique<Rig>();
    std::vector<EngineParam> params;
    if (bf16) {
      r->model16 = SmallModel<uint16_t>(kSeed);
      params = Params(&r->model16, DType::kBf16);
    } else {
      r->model = SmallModel<float>(kSeed);
      params = Params(&r->model, DType::kFp32);
    }
    if (target) {
      r->session = std::move(target);
    } else if (cfg.mode != OffloadMode::kNoOffload) {
      r->session = NewSession(absl::StrCat("bad-state-", sessions_++));
    }
    auto e = ZenFlowEngine::Create(cfg, params, kernels::DefaultCpuKernel(), kernels::CpuOps(),
                                   r->session.get());
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return nullptr;
    r->engine = std::move(*e);
    return r;
  }
  // Steps from..to of the rig (the fixture's gradients and learning rates).
  void Steps(Rig* r, int64_t from, int64_t to) {
    for (int64_t t = from; t <= to; ++t) {
      if (!r->model16.empty()) {
        FillGrads(&r->model16, t, kSeed);
      } else {
        FillGrads(&r->model, t, kSeed);
      }
      ASSERT_TRUE(r->engine->Step(Lr(t)).ok()) << "step " << t;
    }
  }
  std::unique_ptr<VanishingOnRestore> Vanishing() {
    auto s = client_->OpenSession(absl::StrCat("bad-state-", sessions_++), 0);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::make_unique<VanishingOnRestore>(std::move(*s)) : nullptr;
  }
  bool DaemonAlive() const {
    return kill(daemon_->pid(), 0) == 0 && waitpid(daemon_->pid(), nullptr, WNOHANG) == 0;
  }
  int sessions_ = 0;
};

ZenFlowConfig Zen() { return Config(OffloadMode::kZenFlow, 2, 2, false); }
ZenFlowConfig Predicted() {
  ZenFlowConfig c = Zen();
  c.predict_cold = true;
  return c;
}

TEST_F(BadStateTest, CorruptStatesGiveClearErrors) {
  const auto t0 = std::chrono::steady_clock::now();
  // The states: a snapshot mid-round (step 5, S = 2: an Update pending) of each kind of engine.
  struct Source {
    std::string name;
    ZenFlowConfig cfg;
    bool bf16;
    int64_t steps;
    ZenFlowEngine::Snapshot snap;
  };
  std::vector<Source> sources = {
      {"zenflow", Zen(), false, 5, {}},          // V2, loaded, Update pending
      {"predicted", Predicted(), false, 5, {}},  // V4: the pending prediction, the round
      {"bf16", Zen(), true, 5, {}},              // V3: dtypes, masters
      {"sync", Config(OffloadMode::kSyncOffload, 1, 0, false), false, 3, {}},
      {"none", Config(OffloadMode::kNoOffload, 1, 0, false), false, 3, {}},
      {"fresh", Zen(), false, 0, {}},  // before the first step: nothing selected
  };
  for (Source& s : sources) {
    std::unique_ptr<Rig> r = MakeRig(s.cfg, s.bf16);
    ASSERT_NE(r, nullptr);
    Steps(r.get(), 1, s.steps);
    auto snap = r->engine->CheckpointBytes();
    ASSERT_TRUE(snap.ok()) << s.name << ": " << snap.status();
    s.snap = *snap;
    // Each restores whole (the mutations start from good states).
    std::unique_ptr<Rig> again = MakeRig(s.cfg, s.bf16);
    ASSERT_NE(again, nullptr);
    ASSERT_TRUE(again->engine->RestoreBytes(s.snap.engine, s.snap.daemon).ok()) << s.name;
  }
  ASSERT_FALSE(sources[0].snap.daemon.empty());
  ASSERT_FALSE(sources[3].snap.daemon.empty());
  Tally tally;
  Mutator mu(20240611);

  // 1. ParseEngineBlob: every source's blob, 1,000 mutations each.
  for (const Source& s : sources) {
    for (int i = 0; i < 1000; ++i) {
      std::string what;
      const std::string bad = mu.Mutate(s.snap.engine, i % Mutator::kKinds, &what);
      if (!RunCase(absl::StrCat("ParseEngineBlob ", s.name, " #", i, " (", what, ")"), bad.size(),
                   &tally, [&] { return ParseEngineBlob(bad).status(); }))
        return;
    }
  }

  // 1b. Every count field of the blobs that offload set to each extreme value, in turn: through
  // ParseEngineBlob and Repartition (one rank's state to one rank: the whole parameters).
  std::vector<WholeParam> whole;
  for (const Tensor& t : SmallModel<float>(kSeed)) whole.push_back({t.name, t.shape});
  for (size_t k : {size_t{0}, size_t{1}, size_t{3}}) {
    const Source& s = sources[k];
    for (const auto& [what, bad] : Mutator::Sweep(s.snap.engine)) {
      if (!RunCase(absl::StrCat("ParseEngineBlob ", s.name, " (", what, ")"), bad.size(), &tally,
                   [&] { return ParseEngineBlob(bad).status(); }))
        return;
      const PartitionedState state{bad, s.snap.daemon};
      if (!RunCase(absl::StrCat("Repartition ", s.name, " (engine ", what, ")"),
                   bad.size() + s.snap.daemon.size(), &tally, [&] {
                     return Repartition(whole, {&state}, 1, 0).status();
                   }))
        return;
    }
  }

  // 2. The engine's Restore: a fresh engine per case that restored (Restore needs one); the
  // zenflow ones against the daemon's checkpoint of the source (a real daemon Restore).
  for (size_t k : {size_t{0}, size_t{1}, size_t{4}}) {
    const Source& s = sources[k];
    const std::string tag = absl::StrCat("fuzz-", s.name);
    std::unique_ptr<Rig> r;
    const int n = k == 4 ? 1200 : 600;
    for (int i = 0; i < n; ++i) {
      if (r == nullptr) {
        r = MakeRig(s.cfg);
        ASSERT_NE(r, nullptr);
        if (!s.snap.daemon.empty() && i == 0) {
          ASSERT_TRUE(r->session->WriteCheckpoint(tag, s.snap.daemon).ok());
        }
      }
      std::string what;
      const std::string bad = mu.Mutate(s.snap.engine, i % Mutator::kKinds, &what);
      absl::Status st;
      if (!RunCase(absl::StrCat("Restore ", s.name, " #", i, " (", what, ")"), bad.size(), &tally,
                   [&] { return st = r->engine->Restore(tag, bad); }))
        return;
      // Refused: the engine is as it was (all or nothing); restored: the next case needs a
      // fresh one.
      ASSERT_TRUE(st.ok() || r->engine->step() == 0) << "case " << i << " (" << what << "): "
                                                     << st << " left the engine at step "
                                                     << r->engine->step();
      if (st.ok()) r.reset();
    }
  }

  // 3. The daemon's checkpoint reader, as the daemon (ReadCheckpointHeader, then the arrays the
  // header sizes; an upload's WriteCheckpointChunk; the listing) and as a client would use it.
  const uid_t uid = getuid();
  const std::string state_dir = absl::StrCat(daemon_->dir(), "/fuzz-state");
  ASSERT_EQ(mkdir(state_dir.c_str(), 0700), 0);
  ASSERT_TRUE(EnsureOwnerDir(state_dir, uid).ok());
  const std::string path = CheckpointPath(state_dir, uid, "fuzz");
  for (int i = 0; i < 2400; ++i) {
    const Source& s = sources[i % 2 == 0 ? 0 : 3];
    std::string what;
    const std::string bad = MutateCheckpoint(s.snap.daemon, &mu, &what);
    FILE* f = fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(fwrite(bad.data(), 1, bad.size(), f), bad.size());
    ASSERT_EQ(fclose(f), 0);
    const std::string name = absl::StrCat("checkpoint ", s.name, " #", i, " (", what, ")");
    if (!RunCase(name + " read", bad.size(), &tally, [&]() -> absl::Status {
          uint64_t bytes = 0;
          absl::StatusOr<StateHeader> h = ReadCheckpointHeader(path, &bytes);
          if (!h.ok()) return h.status();
          // What a reader sizes by the header it was given.
          std::vector<std::vector<float>> a(4 * h->params.size());
          std::vector<CheckpointArrays> arrays;
          for (size_t p = 0; p < h->params.size(); ++p) {
            absl::StatusOr<int64_t> numel = CheckpointParamNumel(h->params[p].spec);
            if (!numel.ok()) return numel.status();
            for (int q = 0; q < 4; ++q) a[4 * p + q].resize(static_cast<size_t>(*numel));
            arrays.push_back({a[4 * p].data(), a[4 * p + 1].data(), a[4 * p + 2].data(),
                              a[4 * p + 3].data(), *numel});
          }
          return ReadCheckpointArrays(path, *h, arrays);
        }))
      return;
    if (!RunCase(name + " list", bad.size(), &tally, [&]() -> absl::Status {
          auto list = ListCheckpointFiles(state_dir, uid, false);
          if (!list.ok()) return list.status();
          if (list->size() != 1) return absl::InternalError("the listing lost the file");
          if (!(*list)[0].error().empty()) return absl::DataLossError((*list)[0].error());
          return absl::OkStatus();
        }))
      return;
    const std::string up = CheckpointPath(state_dir, uid, "upload");
    if (!RunCase(name + " upload", bad.size(), &tally, [&]() -> absl::Status {
          return WriteCheckpointChunk(up, 0, bad.data(), bad.size(), bad.size(), uid).status();
        }))
      return;
    unlink(up.c_str());
  }

  // 4. Repartition: a one-rank run's state (the whole parameters) to 1 and to 2 ranks, its
  // engine blob or its daemon checkpoint mutated.
  for (size_t k : {size_t{0}, size_t{1}, size_t{3}}) {
    const Source& s = sources[k];
    for (int i = 0; i < 700; ++i) {
      PartitionedState bad{s.snap.engine, s.snap.daemon};
      std::string what;
      if (i % 2 == 0) bad.engine = mu.Mutate(s.snap.engine, (i / 2) % Mutator::kKinds, &what);
      else bad.daemon = MutateCheckpoint(s.snap.daemon, &mu, &what);
      const int world = 1 + i % 3 / 2, rank = i % 3 == 2 ? static_cast<int>(i / 3 % 2) : 0;
      if (!RunCase(absl::StrCat("Repartition ", s.name, " -> ", world, " #", i, " (",
                                i % 2 == 0 ? "engine " : "daemon ", what, ")"),
                   bad.engine.size() + bad.daemon.size(), &tally, [&] {
                     return Repartition(whole, {&bad}, world, rank).status();
                   }))
        return;
    }
  }

  // 5. optimizer.pt as the PyTorch optimizer loads it: RestoreBytes (the daemon checkpoint
  // uploaded to the real daemon, which verifies and restores it, then the engine blob).
  {
    const Source& s = sources[0];
    std::unique_ptr<Rig> r;
    for (int i = 0; i < 360; ++i) {
      if (r == nullptr) {
        r = MakeRig(s.cfg);
        ASSERT_NE(r, nullptr);
      }
      std::string what;
      PartitionedState bad{s.snap.engine, s.snap.daemon};
      if (i % 3 == 0) bad.engine = mu.Mutate(s.snap.engine, (i / 3) % Mutator::kKinds, &what);
      else bad.daemon = MutateCheckpoint(s.snap.daemon, &mu, &what);
      absl::Status st;
      // CheckState (what the PyTorch optimizer asks before it frees anything) judges the state
      // as RestoreBytes does: the same code, without a daemon.
      const absl::Status checked = r->engine->CheckState(bad.engine, bad.daemon);
      if (!RunCase(absl::StrCat("RestoreBytes #", i, " (", i % 3 == 0 ? "engine " : "daemon ",
                                what, ")"),
                   bad.engine.size() + bad.daemon.size(), &tally,
                   [&] { return st = r->engine->RestoreBytes(bad.engine, bad.daemon); }))
        return;
      ASSERT_EQ(checked.code(), st.code()) << "RestoreBytes #" << i << " (" << what
                                           << "): CheckState said " << checked
                                           << ", RestoreBytes " << st;
      ASSERT_TRUE(st.ok() || r->engine->step() == 0) << "RestoreBytes #" << i << " (" << what
                                                     << "): " << st << " left the engine at step "
                                                     << r->engine->step();
      if (st.ok()) r.reset();
    }
  }

  // The daemon survived all of it and restores a good state.
  EXPECT_TRUE(DaemonAlive());
  std::unique_ptr<Rig> good = MakeRig(sources[0].cfg);
  ASSERT_NE(good, nullptr);
  EXPECT_TRUE(good->engine->RestoreBytes(sources[0].snap.engine, sources[0].snap.daemon).ok());
  EXPECT_EQ(good->engine->step(), 5);

  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string codes;
  for (const auto& [code, n] : tally.codes)
    absl::StrAppend(&codes, " ", absl::StatusCodeToString(code), " ", n);
  printf("%d cases in %.1f s:%s\n", tally.cases, secs, codes.c_str());
  EXPECT_GE(tally.cases, 10000);
  EXPECT_EQ(tally.failures, 0);
  // The mutations reach past the first check: some restore, most are refused.
  EXPECT_GT(tally.codes[absl::StatusCode::kOk], 100);
  EXPECT_GT(tally.codes[absl::StatusCode::kDataLoss], 1000);
}

// A Restore whose daemon refuses or fails leaves the engine exactly as it was: it then steps
// bit for bit as an engine that never saw the Restore.
TEST_F(BadStateTest, RestoreIsAllOrNothingAgainstAFailingDaemon) {
  const ZenFlowConfig cfg = Zen();
  // The state to restore: zenflow at step 5 (mid-round), and a sync-offload engine's daemon
  // checkpoint (every parameter offloaded: another layout than zenflow's session).
  std::unique_ptr<Rig> src = MakeRig(cfg);
  ASSERT_NE(src, nullptr);
  Steps(src.get(), 1, 5);
  const std::string tag = "all-or-nothing";
  auto blob = src->engine->Checkpoint(tag);
  ASSERT_TRUE(blob.ok()) << blob.status();
  std::unique_ptr<Rig> sync = MakeRig(Config(OffloadMode::kSyncOffload, 1, 0, false));
  ASSERT_NE(sync, nullptr);
  Steps(sync.get(), 1, 2);
  auto other = sync->engine->CheckpointBytes();
  ASSERT_TRUE(other.ok()) << other.status();

  for (int how = 0; how < 3; ++how) {
    std::unique_ptr<Rig> r;
    absl::Status st;
    std::string what;
    if (how == 0) {
      what = "a target whose Restore fails (the daemon went away)";
      std::unique_ptr<VanishingOnRestore> v = Vanishing();
      ASSERT_NE(v, nullptr);
      VanishingOnRestore* vp = v.get();
      r = MakeRig(cfg, false, std::move(v));
      ASSERT_NE(r, nullptr);
      st = r->engine->Restore(tag, *blob);
      EXPECT_EQ(vp->calls, 1) << what;
      EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << what << ": " << st;
    } else if (how == 1) {
      what = "a tag the daemon does not hold";
      r = MakeRig(cfg);
      ASSERT_NE(r, nullptr);
      st = r->engine->Restore(tag + "-none", *blob);
      EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << what << ": " << st;
    } else {
      what = "a daemon checkpoint of another layout";
      r = MakeRig(cfg);
      ASSERT_NE(r, nullptr);
      st = r->engine->RestoreBytes(*blob, other->daemon);
      EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << what << ": " << st;
    }
    SCOPED_TRACE(what);
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(r->engine->step(), 0);
    // The untouched twin, and the same steps on both.
    std::unique_ptr<Rig> twin = MakeRig(cfg);
    ASSERT_NE(twin, nullptr);
    for (int64_t t = 1; t <= 7; ++t) {
      Steps(r.get(), t, t);
      Steps(twin.get(), t, t);
      EXPECT_EQ(r->engine->last_timings().boundary, twin->engine->last_timings().boundary);
      for (size_t i = 0; i < r->model.size(); ++i)
        ASSERT_EQ(0, memcmp(r->model[i].value.data(), twin->model[i].value.data(),
                            r->model[i].value.size() * sizeof(float)))
            << r->model[i].name << " after step " << t;
    }
  }
  // The refusals consumed nothing: a fresh engine restores the checkpoint.
  std::unique_ptr<Rig> ok = MakeRig(cfg);
  ASSERT_NE(ok, nullptr);
  ASSERT_TRUE(ok->engine->Restore(tag, *blob).ok());
  EXPECT_EQ(ok->engine->step(), 5);
}

}  // namespace
}  // namespace stallfree
