#include "trainer/data.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace stallfree {
namespace {

// A fresh directory under TEST_TMPDIR (bazel) or /tmp.
std::string TempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string templ = std::string(base != nullptr ? base : "/tmp") + "/data_test.XXXXXX";
  char* dir = mkdtemp(&templ[0]);
  EXPECT_NE(dir, nullptr);
  return templ;
}

std::string WriteFile(const std::string& path, const std::string& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  EXPECT_NE(f, nullptr) << path;
  if (f != nullptr) {
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
  }
  return path;
}

std::string Uint16Bytes(const std::vector<uint16_t>& ids) {
  std::string bytes;
  for (uint16_t id : ids) {
    bytes.push_back(static_cast<char>(id & 0xFF));
    bytes.push_back(static_cast<char>(id >> 8));
  }
  return bytes;
}

std::vector<uint16_t> Concat(const Corpus& c) {
  std::vector<uint16_t> all = c.train;
  all.insert(all.end(), c.eval.begin(), c.eval.end());
  return all;
}

bool Contains(absl::string_view haystack, absl::string_view needle) {
  return haystack.find(needle) != absl::string_view::npos;
}

TEST(LoadCorpus, BytesFileRoundTrips) {
  std::string text = "Hello, world!\n\xC3\xA9t\xC3\xA9 caf\xC3\xA9.\n";  // UTF-8: byte tokens
  std::string path = WriteFile(TempDir() + "/text.txt", text);
  absl::StatusOr<Corpus> c = LoadCorpus(path, DataFormat::kAuto, 0.0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->vocab, 256);
  EXPECT_EQ(c->source, path);
  EXPECT_TRUE(c->eval.empty());
  std::vector<uint16_t> want(text.begin(), text.end());
  for (uint16_t& t : want) t &= 0xFF;  // char may be signed
  EXPECT_EQ(c->train, want);
}

TEST(LoadCorpus, Uint16FileRoundTrips) {
  std::vector<uint16_t> ids = {0, 1, 255, 256, 513, 50256, 7, 65535, 42, 3};
  std::string dir = TempDir();
  for (const char* name : {"/ids.u16", "/ids.BIN"}) {
    std::string path = WriteFile(dir + name, Uint16Bytes(ids));
    absl::StatusOr<Corpus> c = LoadCorpus(path, DataFormat::kAuto, 0.0);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->train, ids) << name;
    EXPECT_EQ(c->vocab, 65536) << name;  // max id + 1
  }
  // An explicit format overrides the name; an explicit vocab is kept when large enough.
  std::vector<uint16_t> small = {5, 0, 9, 2};
  std::string path = WriteFile(dir + "/small.tokens", Uint16Bytes(small));
  absl::StatusOr<Corpus> c = LoadCorpus(path, DataFormat::kUint16, 0.0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->train, small);
  EXPECT_EQ(c->vocab, 10);
  c = LoadCorpus(path, DataFormat::kUint16, 0.0, /*vocab=*/10);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->vocab, 10);
  c = LoadCorpus(path, DataFormat::kUint16, 0.0, /*vocab=*/64);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->vocab, 64);
  // The same file read as bytes: one token per byte.
  c = LoadCorpus(path, DataFormat::kBytes, 0.0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->train, (std::vector<uint16_t>{5, 0, 0, 0, 9, 0, 2, 0}));
  EXPECT_EQ(c->vocab, 256);
}

TEST(LoadCorpus, EvalIsTheExactTail) {
  std::vector<uint16_t> ids(1000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint16_t>((i * 7919) % 1000);
  std::string path = WriteFile(TempDir() + "/ids.u16", Uint16Bytes(ids));
  for (double f : {0.0, 0.001, 0.1, 0.25, 0.5}) {
    absl::StatusOr<Corpus> c = LoadCorpus(path, DataFormat::kAuto, f);
    ASSERT_TRUE(c.ok()) << c.status();
    size_t want_eval = static_cast<size_t>(1000 * f + 0.5);
    EXPECT_EQ(c->eval.size(), want_eval) << f;
    EXPECT_EQ(c->train.size(), 1000 - want_eval) << f;
    EXPECT_EQ(Concat(*c), ids) << f;  // train then eval: contiguous, nothing shared or lost
  }
  // A tiny fraction of a tiny file still holds out one token and keeps one for training.
  std::string tiny = WriteFile(TempDir() + "/tiny.txt", "ab");
  absl::StatusOr<Corpus> c = LoadCorpus(tiny, DataFormat::kBytes, 0.01);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->train, (std::vector<uint16_t>{'a'}));
  EXPECT_EQ(c->eval, (std::vector<uint16_t>{'b'}));
}

TEST(LoadCorpus, ErrorsNameTheFileAndTheField) {
  std::string dir = TempDir();
  std::string missing = dir + "/no_such_file.txt";
  absl::StatusOr<Corpus> c = LoadCorpus(missing, DataFormat::kAuto, 0.1);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(c.status().message(), missing)) << c.status();
  EXPECT_TRUE(Contains(c.status().message(), "No such file")) << c.status();

  c = LoadCorpus(dir, DataFormat::kBytes, 0.1);  // a directory cannot be read as data
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound) << c.status();
  EXPECT_TRUE(Contains(c.status().message(), dir)) << c.status();

  std::string empty = WriteFile(dir + "/empty.txt", "");
  c = LoadCorpus(empty, DataFormat::kAuto, 0.1);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(c.status().message(), empty)) << c.status();
  EXPECT_TRUE(Contains(c.status().message(), "empty")) << c.status();

  std::string odd = WriteFile(dir + "/odd.u16", std::string("\x01\x00\x02", 3));
  c = LoadCorpus(odd, DataFormat::kAuto, 0.1);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(c.status().message(), odd)) << c.status();
  EXPECT_TRUE(Contains(c.status().message(), "odd byte count (3)")) << c.status();

  std::string ids = WriteFile(dir + "/ids.u16", Uint16Bytes({3, 99, 7, 120, 100}));
  c = LoadCorpus(ids, DataFormat::kAuto, 0.1, /*vocab=*/100);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(c.status().message(), "token id 120 at token offset 3")) << c.status();
  EXPECT_TRUE(Contains(c.status().message(), ids)) << c.status();

  std::string text = WriteFile(dir + "/text.txt", "ABC text");
  c = LoadCorpus(text, DataFormat::kBytes, 0.0, /*vocab=*/100);  // 't' = 116 >= 100
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(c.status().message(), "token id 116 at token offset 4")) << c.status();

  for (double f : {-0.1, 0.6, 1.0, std::nan("")}) {
    c = LoadCorpus(text, DataFormat::kBytes, f);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << f;
    EXPECT_TRUE(Contains(c.status().message(), "eval_fraction")) << c.status();
  }
  std::string one = WriteFile(dir + "/one.txt", "x");
  EXPECT_EQ(LoadCorpus(one, DataFormat::kBytes, 0.1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(LoadCorpus(one, DataFormat::kBytes, 0.0).ok());
}

TEST(ParseDataFormat, KnowsTheFlagValues) {
  DataFormat f;
  ASSERT_TRUE(ParseDataFormat("uint16", &f));
  EXPECT_EQ(f, DataFormat::kUint16);
  ASSERT_TRUE(ParseDataFormat("bytes", &f));
  EXPECT_EQ(f, DataFormat::kBytes);
  ASSERT_TRUE(ParseDataFormat("auto", &f));
  EXPECT_EQ(f, DataFormat::kAuto);
  EXPECT_FALSE(ParseDataFormat("u16", &f));
}

std::vector<uint16_t> Ramp(int n) {
  std::vector<uint16_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = static_cast<uint16_t>(i);
  return t;
}

// The batches of `steps` Next calls, inputs then targets, concatenated.
std::vector<int32_t> Batches(Batcher& b, int steps) {
  std::vector<int32_t> out;
  std::vector<int32_t> x(b.B() * b.T()), y(b.B() * b.T());
  for (int s = 0; s < steps; ++s) {
    b.Next(x.data(), y.data());
    out.insert(out.end(), x.begin(), x.end());
    out.insert(out.end(), y.begin(), y.end());
  }
  return out;
}

TEST(Batcher, RejectsDataShorterThanOneWindow) {
  std::vector<uint16_t> t = Ramp(16);
  absl::StatusOr<Batcher> b = Batcher::Create(&t, 4, 16, 1);  // needs 17 tokens
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(b.status().message(), "B = 4")) << b.status();
  EXPECT_TRUE(Contains(b.status().message(), "T = 16")) << b.status();
  EXPECT_TRUE(Contains(b.status().message(), "16 tokens")) << b.status();
  EXPECT_TRUE(Batcher::Create(&t, 4, 15, 1).ok());
  EXPECT_EQ(Batcher::Create(&t, 0, 4, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Batcher::Create(&t, 2, 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Batcher::Create(nullptr, 2, 4, 1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Batcher, TargetsAreInputsShiftedByOne) {
  std::vector<uint16_t> t = Ramp(1000);
  const int64_t B = 3, T = 8;
  absl::StatusOr<Batcher> b = Batcher::Create(&t, B, T, 7);
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<int32_t> x(B * T), y(B * T);
  for (int step = 0; step < 20; ++step) {
    b->Next(x.data(), y.data());
    for (int64_t r = 0; r < B; ++r) {
      EXPECT_EQ(x[r * T] % T, 0) << "windows start at multiples of T";
      for (int64_t i = 0; i < T; ++i) {
        EXPECT_EQ(x[r * T + i], x[r * T] + i);      // a contiguous window of the data
        EXPECT_EQ(y[r * T + i], x[r * T + i] + 1);  // the next token
      }
    }
  }
}

TEST(Batcher, AnEpochVisitsEveryWindowOnce) {
  // 101 tokens, T = 10: windows start at 0, 10, ..., 90 (window 9 ends at token 100).
  std::vector<uint16_t> t = Ramp(101);
  const int64_t B = 2, T = 10;
  absl::StatusOr<Batcher> b = Batcher::Create(&t, B, T, 3);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->windows_per_epoch(), 10);
  ASSERT_EQ(b->batches_per_epoch(), 5);
  std::vector<int32_t> x(B * T), y(B * T);
  std::vector<std::vector<int32_t>> orders;
  for (int epoch = 0; epoch < 3; ++epoch) {
    EXPECT_EQ(b->epoch(), epoch);
    std::vector<int32_t> starts;
    for (int64_t s = 0; s < b->batches_per_epoch(); ++s) {
      b->Next(x.data(), y.data());
      for (int64_t r = 0; r < B; ++r) starts.push_back(x[r * T]);
    }
    std::set<int32_t> seen(starts.begin(), starts.end());
    EXPECT_EQ(seen.size(), 10u) << "epoch " << epoch;
    EXPECT_EQ(*seen.begin(), 0);
    EXPECT_EQ(*seen.rbegin(), 90);
    orders.push_back(starts);
  }
  EXPECT_EQ(b->position(), 30);
  // Shuffled, and differently per epoch.
  EXPECT_NE(orders[0], orders[1]);
  EXPECT_NE(orders[1], orders[2]);
}

TEST(Batcher, SameSeedSameBatchesOtherSeedDiffers) {
  std::vector<uint16_t> t = Ramp(5000);
  absl::StatusOr<Batcher> a = Batcher::Create(&t, 4, 16, 42);
  absl::StatusOr<Batcher> b = Batcher::Create(&t, 4, 16, 42);
  absl::StatusOr<Batcher> c = Batcher::Create(&t, 4, 16, 43);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  // 312 windows: 4 epochs is 312 batches.
  const int steps = static_cast<int>(4 * a->batches_per_epoch());
  std::vector<int32_t> ra = Batches(*a, steps), rb = Batches(*b, steps), rc = Batches(*c, steps);
  EXPECT_EQ(ra, rb);
  EXPECT_NE(ra, rc);
}

TEST(Batcher, SeekContinuesExactlyLikeARunningBatcher) {
  std::vector<uint16_t> t = Ramp(2000);
  // B = 3 over 66 windows: batches straddle epoch boundaries.
  absl::StatusOr<Batcher> ran = Batcher::Create(&t, 3, 30, 9);
  ASSERT_TRUE(ran.ok());
  for (int k : {0, 1, 5, 22, 23, 60}) {
    absl::StatusOr<Batcher> a = Batcher::Create(&t, 3, 30, 9);
    ASSERT_TRUE(a.ok());
    Batches(*a, k);
    absl::StatusOr<Batcher> resumed = Batcher::Create(&t, 3, 30, 9);
    ASSERT_TRUE(resumed.ok());
    resumed->Seek(a->position());
    EXPECT_EQ(resumed->position(), 3 * k);
    EXPECT_EQ(Batches(*resumed, 30), Batches(*a, 30)) << "k = " << k;
  }
  // Seeking backwards replays.
  std::vector<int32_t> first = Batches(*ran, 4);
  ran->Seek(0);
  EXPECT_EQ(Batches(*ran, 4), first);
}

TEST(Batcher, SequentialOrderWalksTheEvalSplitInOrder) {
  Corpus c = DefaultCorpus(8192, 1);
  const int64_t B = 2, T = 32;
  absl::StatusOr<Batcher> b = Batcher::Create(&c.eval, B, T, 5, BatchOrder::kSequential);
  ASSERT_TRUE(b.ok()) << b.status();
  const int64_t windows = (static_cast<int64_t>(c.eval.size()) - 1) / T;
  EXPECT_EQ(b->windows_per_epoch(), windows);
  EXPECT_EQ(b->full_batches_per_epoch(), windows / B);
  std::vector<int32_t> x(B * T), y(B * T);
  for (int pass = 0; pass < 2; ++pass) {
    b->Seek(0);
    for (int64_t s = 0; s < b->full_batches_per_epoch(); ++s) {
      b->Next(x.data(), y.data());
      for (int64_t r = 0; r < B; ++r) {
        const int64_t w = s * B + r;
        for (int64_t i = 0; i < T; ++i) {
          ASSERT_EQ(x[r * T + i], c.eval[w * T + i]);
          ASSERT_EQ(y[r * T + i], c.eval[w * T + i + 1]);
        }
      }
    }
  }
}

// The text itself is common/corpus.h's (tests/common/corpus_test.cc); here its tokens and split.
TEST(DefaultCorpus, TheDefaultTextAsByteTokensWithItsLastTenthHeldOut) {
  const int64_t size = 200000;
  std::string text = DefaultCorpusText(size, 1);
  Corpus c = DefaultCorpus(size, 1);
  EXPECT_EQ(c.vocab, 256);
  EXPECT_EQ(static_cast<int64_t>(c.train.size() + c.eval.size()), size);
  EXPECT_EQ(static_cast<int64_t>(c.eval.size()), size / 10);
  EXPECT_EQ(Concat(c), std::vector<uint16_t>(text.begin(), text.end()));
  EXPECT_TRUE(Contains(c.source, "default corpus")) << c.source;
}

}  // namespace
}  // namespace stallfree
