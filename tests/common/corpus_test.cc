// common/corpus.h: the default text is deterministic, of the requested size, a prefix of a
// longer one, printable English-like prose with the structure a small model can learn, and the
// same bytes on every machine.
#include "common/corpus.h"

#include <gtest/gtest.h>

#include <cctype>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>

namespace stallfree {
namespace {

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST(DefaultCorpusText, DeterministicEnglishLikeTextOfTheRequestedSize) {
  const int64_t size = 200000;
  std::string text = DefaultCorpusText(size, 1);
  EXPECT_EQ(static_cast<int64_t>(text.size()), size);
  EXPECT_EQ(text, DefaultCorpusText(size, 1));
  EXPECT_NE(text, DefaultCorpusText(size, 2));
  EXPECT_EQ(DefaultCorpusText(5000, 1), text.substr(0, 5000));  // a prefix of a longer one

  std::set<char> distinct(text.begin(), text.end());
  EXPECT_GT(distinct.size(), 40u);
  for (char ch : text) {
    ASSERT_TRUE(ch == '\n' || (ch >= 0x20 && ch < 0x7F)) << static_cast<int>(ch);
  }
  // Structure a small model can learn: paragraphs, sentences, capitals, words, speech.
  EXPECT_TRUE(Contains(text, "\n\n"));
  EXPECT_TRUE(Contains(text, ". "));
  EXPECT_TRUE(Contains(text, "?\""));
  EXPECT_TRUE(Contains(text, " the "));
  EXPECT_TRUE(Contains(text, " an "));
  EXPECT_EQ(text.find("  "), std::string::npos);
  EXPECT_TRUE(std::isupper(static_cast<unsigned char>(text[0])));
  // Every sentence after a full stop starts with a capital or a quote.
  for (size_t i = text.find(". "); i != std::string::npos; i = text.find(". ", i + 1)) {
    char next = text[i + 2];
    EXPECT_TRUE(std::isupper(static_cast<unsigned char>(next)) || next == '"')
        << text.substr(i, 40);
  }
  // Spaces make up a word-like share of the text (average word ~5 letters).
  size_t spaces = 0;
  for (char ch : text) spaces += ch == ' ';
  EXPECT_GT(spaces, text.size() / 9);
  EXPECT_LT(spaces, text.size() / 3);

  EXPECT_EQ(DefaultCorpusText(10, 1).size(), 1024u);
}

TEST(DefaultCorpusText, SameBytesOnEveryMachine) {
  // A fingerprint of the default text (FNV-1a of the first 64 KiB, seed 1): it changes only if
  // the grammar changes, never across platforms or standard libraries.
  std::string text = DefaultCorpusText(1 << 16, 1);
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : text) h = (h ^ ch) * 1099511628211ull;
  std::printf("default corpus fingerprint %016llx; begins: %s\n",
              static_cast<unsigned long long>(h), text.substr(0, 160).c_str());
  EXPECT_EQ(h, 0x8e071fb3f343f561ull) << "update the fingerprint if the grammar changed on purpose";
}

}  // namespace
}  // namespace stallfree
