// The offload benchmarks' training data (bench/offload_quality_bench.cc), as token batches:
//   - MarkovCorpus: a synthetic order-2 Markov chain, for pre-training from scratch, with its
//     own cross-entropy as the loss floor;
//   - FineTuneTokens: the default corpus (common/corpus.h) rewritten into a shifted distribution
//     (new first names, vowels rotated), for fine-tuning a model pre-trained on the original;
//   - StreamBatch and CorpusBatches: [B, T] input / next-token target batches of either.
//
// Example (pre-training from scratch):
//   MarkovCorpus chain(/*vocab=*/128, /*seed=*/101);
//   std::vector<int32_t> stream = chain.Stream(steps * B * (T + 1), /*seed=*/202);
//   TokenBatch b = StreamBatch(stream, /*i=*/0, B, T);   // step 1's batch
//
// Everything here is deterministic for given seeds; nothing keeps state between calls, so all of
// it is thread safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "trainer/data.h"

namespace stallfree {
namespace bench {

// One step's data: B rows of T input tokens and their next-token targets, row-major.
struct TokenBatch {
  std::vector<int32_t> tokens, targets;
};

// An order-2 Markov chain over `vocab` tokens: the next token is one of 4 successors of the
// previous token (a fixed random table), with probabilities (.55, .25, .12, .08) rotated by the
// token before it (mod 4), mixed with 5% uniform noise. A bigram model gets part of the way; the
// rest needs attention to the token two back.
class MarkovCorpus {
 public:
  MarkovCorpus(int64_t vocab, uint32_t seed);
  // The probability of `next` after the tokens `a`, `b`.
  double Prob(int32_t a, int32_t b, int32_t next) const;
  // `n` tokens of the chain, started from two uniform tokens.
  std::vector<int32_t> Stream(int64_t n, uint32_t seed) const;
  // The chain's own cross-entropy on the targets of a stream: the loss floor.
  double TrueNll(const std::vector<int32_t>& s) const;

 private:
  int64_t vocab_;
  std::vector<int32_t> succ_;
};

// Batch i of a stream: B rows of T tokens, row r from the stream at (i * B + r) * (T + 1).
TokenBatch StreamBatch(const std::vector<int32_t>& stream, int64_t i, int64_t B, int64_t T);

// How many of the default corpus's first names FineTuneTokens replaces (all of them).
size_t FineTuneRenamedNames();

// DefaultCorpusText(bytes, seed) with every first name the generator draws from replaced by a
// name it never produces (Zbigniew, Oluwaseun, ...), one for one, as byte tokens; with `vowels`,
// also every vowel letter rotated (a->e->i->o->u->a, either case).
std::vector<uint16_t> FineTuneTokens(int64_t bytes, uint32_t seed, bool vowels);

// `n` batches of a Batcher over `tokens` into *out; for kSequential (held-out) at most the batches
// of one epoch's distinct windows. The Batcher's errors (too few tokens for one window).
absl::Status CorpusBatches(const std::vector<uint16_t>& tokens, int64_t n, int64_t B, int64_t T,
                           int64_t seed, BatchOrder order, std::vector<TokenBatch>* out);

}  // namespace bench
}  // namespace stallfree
