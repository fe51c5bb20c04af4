#include "bench/corpus.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>

#include "common/corpus.h"

namespace stallfree {
namespace bench {
namespace {

// A successor's probability by its rank, before the rotation by the token two back.
constexpr double kSuccessorProb[4] = {0.55, 0.25, 0.12, 0.08};
// The uniform noise's share, and the successors' share (1 - kNoise).
constexpr double kNoise = 0.05, kSignal = 0.95;

// The names that replace DefaultCorpusText's first names (kCorpusNames), one for one, in the
// fine-tuning text: none occurs in the pre-training text.
const char* const kNewNames[] = {
    "Zbigniew", "Oluwaseun", "Xiomara",   "Kwabena",  "Yevgenia", "Thandiwe", "Quirin", "Bjarke",
    "Ngozi",    "Wojciech",  "Aoife",     "Ezequiel", "Siobhan",  "Tadeusz",  "Yuki",   "Dzifa",
    "Gwyneth",  "Zsofia",    "Kazimierz", "Ifeoma",   "Hjalmar",  "Xochitl",  "Uzoma",  "Radek",
    "Jovanka",  "Phuong",    "Eitan",     "Svetlana", "Okwudili", "Ysolde"};
constexpr size_t kNames = sizeof(kNewNames) / sizeof(kNewNames[0]);
static_assert(kNames == kCorpusNameCount, "one new name per corpus name");

bool IsLetter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

// `word` renamed (if it is a corpus name) and, with `vowels`, its vowels rotated, appended to
// *out as byte tokens.
void AppendShiftedWord(std::string word, bool vowels, std::vector<uint16_t>* out) {
  for (size_t k = 0; k < kNames; ++k)
    if (word == kCorpusNames[k]) word = kNewNames[k];
  for (char c : word) {
    if (vowels) {
      static const char kFrom[] = "aeiouAEIOU", kTo[] = "eiouaEIOUA";
      if (const char* v = std::strchr(kFrom, c)) c = kTo[v - kFrom];
    }
    out->push_back(static_cast<uint8_t>(c));
  }
}

}  // namespace

MarkovCorpus::MarkovCorpus(int64_t vocab, uint32_t seed) : vocab_(vocab), succ_(vocab * 4) {
  std::mt19937 rng(seed);
  for (int64_t a = 0; a < vocab; ++a) {
    std::vector<int32_t> perm(vocab);
    for (int64_t i = 0; i < vocab; ++i) perm[i] = static_cast<int32_t>(i);
    for (int j = 0; j < 4; ++j) {
      std::uniform_int_distribution<int64_t> pick(j, vocab - 1);
      std::swap(perm[j], perm[pick(rng)]);
      succ_[a * 4 + j] = perm[j];
    }
  }
}

double MarkovCorpus::Prob(int32_t a, int32_t b, int32_t next) const {
  double p = kNoise / static_cast<double>(vocab_);
  for (int j = 0; j < 4; ++j)
    if (succ_[b * 4 + j] == next) p += kSignal * kSuccessorProb[(j + a) % 4];
  return p;
}

std::vector<int32_t> MarkovCorpus::Stream(int64_t n, uint32_t seed) const {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::uniform_int_distribution<int32_t> any(0, static_cast<int32_t>(vocab_ - 1));
  std::vector<int32_t> s = {any(rng), any(rng)};
  while (static_cast<int64_t>(s.size()) < n) {
    const int32_t a = s[s.size() - 2], b = s.back();
    double r = u(rng);
    int32_t next = -1;
    if (r < kNoise) {
      next = any(rng);
    } else {
      r = (r - kNoise) / kSignal;
      for (int j = 0; j < 4 && next < 0; ++j) {
        r -= kSuccessorProb[(j + a) % 4];
        if (r < 0 || j == 3) next = succ_[b * 4 + j];
      }
    }
    s.push_back(next);
  }
  return s;
}

double MarkovCorpus::TrueNll(const std::vector<int32_t>& s) const {
  double nll = 0;
  for (size_t i = 2; i < s.size(); ++i) nll -= std::log(Prob(s[i - 2], s[i - 1], s[i]));
  return nll / static_cast<double>(s.size() - 2);
}

TokenBatch StreamBatch(const std::vector<int32_t>& stream, int64_t i, int64_t B, int64_t T) {
  TokenBatch b;
  for (int64_t r = 0; r < B; ++r) {
    const int64_t off = (i * B + r) * (T + 1);
    for (int64_t t = 0; t < T; ++t) {
      b.tokens.push_back(stream[off + t]);
      b.targets.push_back(stream[off + t + 1]);
    }
  }
  return b;
}

size_t FineTuneRenamedNames() { return kNames; }

std::vector<uint16_t> FineTuneTokens(int64_t bytes, uint32_t seed, bool vowels) {
  const std::string text = DefaultCorpusText(bytes, seed);
  std::vector<uint16_t> out;
  out.reserve(text.size() + text.size() / 8);
  for (size_t i = 0; i < text.size();) {
    if (!IsLetter(text[i])) {
      out.push_back(static_cast<uint8_t>(text[i++]));
      continue;
    }
    size_t j = i;
    while (j < text.size() && IsLetter(text[j])) ++j;
    AppendShiftedWord(text.substr(i, j - i), vowels, &out);
    i = j;
  }
  return out;
}

absl::Status CorpusBatches(const std::vector<uint16_t>& tokens, int64_t n, int64_t B, int64_t T,
                           int64_t seed, BatchOrder order, std::vector<TokenBatch>* out) {
  auto batcher = Batcher::Create(&tokens, B, T, static_cast<uint64_t>(seed), order);
  if (!batcher.ok()) return batcher.status();
  if (order == BatchOrder::kSequential)
    n = std::min(n, std::max<int64_t>(1, batcher->full_batches_per_epoch()));
  out->clear();
  for (int64_t i = 0; i < n; ++i) {
    TokenBatch b;
    b.tokens.resize(static_cast<size_t>(B * T));
    b.targets.resize(static_cast<size_t>(B * T));
    batcher->Next(b.tokens.data(), b.targets.data());
    out->push_back(std::move(b));
  }
  return absl::OkStatus();
}

}  // namespace bench
}  // namespace stallfree
