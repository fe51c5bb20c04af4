#include "trainer/data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"

namespace stallfree {
namespace {

absl::Status ReadError(const char* what, const std::string& path, int err) {
  std::string msg =
      absl::StrCat("cannot ", what, " data file ", path, ": ", strerror(err), " (errno ", err, ")");
  SF_LOG(kError, "%s", msg);
  return absl::NotFoundError(msg);
}

// The whole file; NotFound with the path and errno text if it cannot be opened or read.
absl::StatusOr<std::vector<uint8_t>> ReadFile(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ReadError("open", path, errno);
  std::vector<uint8_t> bytes;
  struct stat st;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
    bytes.reserve(static_cast<size_t>(st.st_size));
  }
  uint8_t buf[1 << 16];
  for (;;) {
    ssize_t n = read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      close(fd);
      return ReadError("read", path, err);
    }
    if (n == 0) break;
    bytes.insert(bytes.end(), buf, buf + n);
  }
  close(fd);
  return bytes;
}

// SplitMix64: a well-mixed 64-bit hash, to derive each epoch's shuffle seed from (seed, epoch).
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

bool ParseDataFormat(const std::string& text, DataFormat* out) {
  if (text == "auto") {
    *out = DataFormat::kAuto;
  } else if (text == "bytes") {
    *out = DataFormat::kBytes;
  } else if (text == "uint16") {
    *out = DataFormat::kUint16;
  } else {
    return false;
  }
  return true;
}

absl::StatusOr<Corpus> SplitCorpus(std::vector<uint16_t> tokens, int64_t vocab, std::string source,
                                   double eval_fraction) {
  if (!(eval_fraction >= 0.0 && eval_fraction <= 0.5)) {
    return absl::InvalidArgumentError(
        absl::StrCat("eval_fraction must be in [0, 0.5], got ", eval_fraction));
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n == 0) return absl::InvalidArgumentError(absl::StrCat(source, " holds no tokens"));
  int64_t n_eval = 0;
  if (eval_fraction > 0.0) {
    if (n < 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, " holds 1 token: too few for a held-out split (eval_fraction ",
                       eval_fraction, ")"));
    }
    n_eval = std::llround(static_cast<double>(n) * eval_fraction);
    if (n_eval < 1) n_eval = 1;
    if (n_eval > n - 1) n_eval = n - 1;
  }
  Corpus corpus;
  corpus.eval.assign(tokens.end() - n_eval, tokens.end());
  tokens.resize(n - n_eval);
  corpus.train = std::move(tokens);
  corpus.vocab = vocab;
  corpus.source = std::move(source);
  return corpus;
}

absl::StatusOr<Corpus> LoadCorpus(const std::string& path, DataFormat format, double eval_fraction,
                                  int64_t vocab) {
  if (!(eval_fraction >= 0.0 && eval_fraction <= 0.5)) {
    return absl::InvalidArgumentError(
        absl::StrCat("eval_fraction must be in [0, 0.5], got ", eval_fraction));
  }
  if (vocab < 0) {
    return absl::InvalidArgumentError(absl::StrCat("vocab must be >= 0, got ", vocab));
  }
  if (format == DataFormat::kAuto) {
    format = absl::EndsWithIgnoreCase(path, ".u16") || absl::EndsWithIgnoreCase(path, ".bin")
                 ? DataFormat::kUint16
                 : DataFormat::kBytes;
  }
  ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadFile(path));
  if (bytes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("data file ", path, " is empty"));
  }
  const bool u16 = format == DataFormat::kUint16;
  if (u16 && bytes.size() % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("data file ", path, " has an odd byte count (", bytes.size(),
                     ") for uint16 token ids; pass --data_format=bytes for text"));
  }
  std::vector<uint16_t> tokens(u16 ? bytes.size() / 2 : bytes.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = u16 ? static_cast<uint16_t>(bytes[2 * i] | (bytes[2 * i + 1] << 8)) : bytes[i];
  }
  std::vector<uint8_t>().swap(bytes);

  if (vocab > 0) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat("data file ", path, ": token id ", tokens[i],
                                                       " at token offset ", i, " is >= vocab ",
                                                       vocab));
      }
    }
  } else if (u16) {
    uint16_t max_id = 0;
    for (uint16_t t : tokens) max_id = t > max_id ? t : max_id;
    vocab = int64_t{max_id} + 1;
  } else {
    vocab = 256;
  }
  return SplitCorpus(std::move(tokens), vocab, path, eval_fraction);
}

Corpus DefaultCorpus(int64_t approx_bytes, uint32_t seed) {
  std::string text = DefaultCorpusText(approx_bytes, seed);
  std::vector<uint16_t> tokens(text.begin(), text.end());
  // Each byte of the text is < 128, so the conversion above is exact.
  std::string source = absl::StrCat("default corpus (generated English-like text, ", text.size(),
                                    " bytes, seed ", seed, ")");
  // Cannot fail: >= 1024 tokens and a valid fraction.
  return *SplitCorpus(std::move(tokens), 256, std::move(source), kDefaultEvalFraction);
}

absl::StatusOr<Batcher> Batcher::Create(const std::vector<uint16_t>* tokens, int64_t B, int64_t T,
                                        uint64_t seed, BatchOrder order) {
  if (tokens == nullptr) return absl::InvalidArgumentError("Batcher: tokens is null");
  const int64_t n = static_cast<int64_t>(tokens->size());
  if (B <= 0 || T <= 0 || n < T + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Batcher: B = ", B, ", T = ", T, " needs B > 0, T > 0 and at least T + 1 = ", T + 1,
        " tokens for one window, but the data holds ", n, " tokens"));
  }
  return Batcher(tokens, B, T, seed, order);
}

Batcher::Batcher(const std::vector<uint16_t>* tokens, int64_t B, int64_t T, uint64_t seed,
                 BatchOrder order)
    : tokens_(tokens),
      B_(B),
      T_(T),
      seed_(seed),
      order_(order),
      // Window w needs tokens[w*T .. w*T+T]: w*T + T + 1 <= n.
      windows_((static_cast<int64_t>(tokens->size()) - 1) / T) {}

void Batcher::Seek(int64_t position) { position_ = position < 0 ? 0 : position; }

int64_t Batcher::WindowAt(int64_t position) {
  const int64_t epoch = position / windows_;
  const int64_t index = position % windows_;
  if (order_ == BatchOrder::kSequential) return index;
  if (epoch != perm_epoch_) {
    // Fisher-Yates with raw mt19937_64 outputs (std::shuffle's results are library-specific).
    std::mt19937_64 rng(Mix(seed_ ^ Mix(static_cast<uint64_t>(epoch))));
    perm_.resize(static_cast<size_t>(windows_));
    for (int64_t i = 0; i < windows_; ++i) perm_[i] = i;
    for (int64_t i = windows_ - 1; i > 0; --i) {
      int64_t j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
      std::swap(perm_[i], perm_[j]);
    }
    perm_epoch_ = epoch;
  }
  return perm_[index];
}

void Batcher::Next(int32_t* tokens, int32_t* targets) {
  const uint16_t* data = tokens_->data();
  for (int64_t b = 0; b < B_; ++b) {
    const uint16_t* window = data + WindowAt(position_) * T_;
    int32_t* x = tokens + b * T_;
    int32_t* y = targets + b * T_;
    for (int64_t t = 0; t < T_; ++t) {
      x[t] = window[t];
      y[t] = window[t + 1];
    }
    ++position_;
  }
}

}  // namespace stallfree
