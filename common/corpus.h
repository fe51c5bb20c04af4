// The project's default training text: a generated English-like corpus shipped as code, so the
// demo, the benches and the Python package's stallfree.default_corpus_text need no download.
// The trainer tokenises and splits it (trainer/data.h, DefaultCorpus).
//
//   std::string text = DefaultCorpusText(1 << 20, /*seed=*/1);  // 1 MiB, the same everywhere
//
// Thread safety: DefaultCorpusText is a pure function.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace stallfree {

// Paragraphs of English sentences generated from a small fixed grammar (about 390 real words:
// names, nouns with a/an, adjectives, past-tense verbs, adverbs, prepositions, conjunctions),
// with capitalised sentence starts, commas, full stops, questions and quoted speech, each
// paragraph about one protagonist and a few topic nouns, one blank line between paragraphs.
// Printable ASCII and '\n' only. Exactly max(approx_bytes, 1024) bytes (the last sentence is
// cut); a shorter text with the same seed is a prefix of a longer one. Deterministic: uses only
// std::mt19937's raw outputs, so every platform gives the same bytes.
std::string DefaultCorpusText(int64_t approx_bytes = 1 << 20, uint32_t seed = 1);

// The first names its sentences draw from: what a text that must share no name with it renames
// (bench/corpus.h, the fine-tuning text).
inline constexpr size_t kCorpusNameCount = 30;
extern const char* const kCorpusNames[kCorpusNameCount];

}  // namespace stallfree
