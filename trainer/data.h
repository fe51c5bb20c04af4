// The GPT trainer's data: a token corpus split into train and held-out eval parts, and a
// Batcher that cuts it into [B, T] input / next-token target batches.
//
// Sources:
//   - LoadCorpus(path, ...): a user's file, either UTF-8 (or any) text read as one token per
//     byte (vocab 256), or a flat file of little-endian uint16 token ids.
//   - DefaultCorpus(...): the generated English-like text of common/corpus.h (DefaultCorpusText,
//     the same bytes on every machine and standard library) as byte tokens.
//
// Example:
//   ASSIGN_OR_RETURN(Corpus corpus, LoadCorpus(path, DataFormat::kAuto, 0.1));
//   ASSIGN_OR_RETURN(Batcher train, Batcher::Create(&corpus.train, B, T, seed));
//   std::vector<int32_t> x(B * T), y(B * T);
//   train.Next(x.data(), y.data());          // one training batch
//   ... checkpoint train.position(); on resume: train.Seek(saved_position);
//
// Thread safety: a Batcher is not thread safe; distinct Batchers may be used concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/corpus.h"

namespace stallfree {

// How a data file's bytes become tokens.
//   kBytes:  one token per byte, vocab 256 (UTF-8 text is learned byte by byte).
//   kUint16: consecutive little-endian uint16 token ids (an even number of bytes).
//   kAuto:   kUint16 if the file name ends in ".u16" or ".bin" (any letter case), else kBytes.
enum class DataFormat { kAuto, kBytes, kUint16 };

// Parses "auto", "bytes", "uint16" (the --data_format flag); false if unknown.
bool ParseDataFormat(const std::string& text, DataFormat* out);

// A tokenised corpus. `eval` is the contiguous tail of the token stream and `train` everything
// before it: no token is in both.
struct Corpus {
  std::vector<uint16_t> train;
  std::vector<uint16_t> eval;
  int64_t vocab = 0;   // every token id is < vocab
  std::string source;  // the file path, or a description of the generated corpus
};

// Splits `tokens` into train and the last `eval_fraction` of them (rounded to the nearest token,
// at least one token when eval_fraction > 0, and leaving at least one for train).
// InvalidArgument if eval_fraction is outside [0, 0.5] or NaN, if tokens is empty, or if
// eval_fraction > 0 and there are fewer than 2 tokens. `vocab` and `source` are copied in;
// the token ids are not checked here.
absl::StatusOr<Corpus> SplitCorpus(std::vector<uint16_t> tokens, int64_t vocab, std::string source,
                                   double eval_fraction);

// Reads a data file and splits it as SplitCorpus does.
// `vocab` = 0: the vocabulary is 256 for bytes, max id + 1 for uint16. `vocab` > 0: every id
// must be < vocab (a model with a padded vocabulary), and Corpus::vocab = vocab.
// Errors:
//   NotFound         the file is missing or cannot be read (message: path and errno text).
//   InvalidArgument  the file is empty; a uint16 file has an odd byte count; an id >= vocab
//                    (message: the first such id and its token offset); vocab < 0;
//                    eval_fraction outside [0, 0.5].
absl::StatusOr<Corpus> LoadCorpus(const std::string& path, DataFormat format, double eval_fraction,
                                  int64_t vocab = 0);

// The fraction of DefaultCorpus held out for evaluation.
inline constexpr double kDefaultEvalFraction = 0.1;

// DefaultCorpusText as byte tokens (vocab 256), split with kDefaultEvalFraction.
Corpus DefaultCorpus(int64_t approx_bytes = 1 << 20, uint32_t seed = 1);

// The order in which a Batcher visits windows.
//   kShuffled:   epoch e visits every window once in a permutation derived from (seed, e).
//   kSequential: every epoch visits windows 0, 1, 2, ... in order (evaluation).
enum class BatchOrder { kShuffled, kSequential };

// Cuts a token stream into windows of T+1 tokens starting at multiples of T (window w covers
// tokens[w*T .. w*T+T]; the T+1st token is only a target, so windows do not overlap as inputs
// and an epoch covers the data once; a tail of fewer than T tokens after the last window is
// unused). Each batch row is the next window in the visiting order; a batch may straddle two
// epochs when the windows per epoch are not a multiple of B.
//
// The batches depend only on (tokens, B, T, seed, order, position): two Batchers built alike
// produce identical batches, and Seek(k) on a fresh Batcher continues exactly like one that
// has already produced k windows.
//
// `*tokens` must outlive the Batcher and not change while it is in use.
class Batcher {
 public:
  // InvalidArgument (naming B, T and the token count) unless B > 0, T > 0 and the tokens hold
  // at least one window of T+1 tokens; also if tokens is null.
  static absl::StatusOr<Batcher> Create(const std::vector<uint16_t>* tokens, int64_t B, int64_t T,
                                        uint64_t seed, BatchOrder order = BatchOrder::kShuffled);

  Batcher(Batcher&&) = default;
  Batcher& operator=(Batcher&&) = default;
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  // Fills tokens[b*T + t] = window_b[t] and targets[b*T + t] = window_b[t + 1] for the next
  // B windows ([B, T] row-major each), and advances position() by B.
  void Next(int32_t* tokens, int32_t* targets);

  // Windows consumed so far (B per Next call), across epochs.
  int64_t position() const { return position_; }
  // Continues from `position` windows into the stream (a checkpointed position()).
  // Precondition: position >= 0 (a negative value is treated as 0).
  void Seek(int64_t position);

  int64_t epoch() const { return position_ / windows_; }
  int64_t windows_per_epoch() const { return windows_; }
  // Batches that cover an epoch: ceil(windows / B). The last one may reach into the next epoch.
  int64_t batches_per_epoch() const { return (windows_ + B_ - 1) / B_; }
  // Batches made only of one epoch's windows, each window at most once: windows / B. For an
  // evaluation loss over distinct windows: kSequential, Seek(0), then this many Next calls
  // (it is 0 when the eval split holds fewer than B windows; then use batches_per_epoch()).
  int64_t full_batches_per_epoch() const { return windows_ / B_; }
  int64_t B() const { return B_; }
  int64_t T() const { return T_; }

 private:
  Batcher(const std::vector<uint16_t>* tokens, int64_t B, int64_t T, uint64_t seed,
          BatchOrder order);
  // The start window index of the window at stream position `position`.
  int64_t WindowAt(int64_t position);

  const std::vector<uint16_t>* tokens_;
  int64_t B_, T_;
  uint64_t seed_;
  BatchOrder order_;
  int64_t windows_;
  int64_t position_ = 0;
  int64_t perm_epoch_ = -1;  // the epoch whose permutation perm_ holds
  std::vector<int64_t> perm_;
};

}  // namespace stallfree
