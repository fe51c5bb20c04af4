#include "common/corpus.h"

#include <cstring>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace stallfree {

const char* const kCorpusNames[kCorpusNameCount] = {
    "Anna",  "Tom",   "Maria", "Jack",   "Lucy",  "Peter", "Sara",  "David", "Emma", "Oliver",
    "Grace", "Henry", "Alice", "Samuel", "Clara", "Leo",   "Nora",  "Felix", "Ruth", "Oscar",
    "Ella",  "Hugo",  "Ivy",   "Martin", "Rosa",  "Simon", "Julia", "Adam",  "Mia",  "Victor"};

namespace {

// People and animals: the subjects of sentences.
const char* const kBeings[] = {
    "cat",      "dog",    "horse",    "bird",     "fox",       "rabbit",    "owl",     "farmer",
    "teacher",  "doctor", "sailor",   "baker",    "painter",   "king",      "queen",   "child",
    "girl",     "boy",    "friend",   "stranger", "neighbour", "elephant",  "owner",   "artist",
    "engineer", "uncle",  "aunt",     "officer",  "mouse",     "goat",      "student", "soldier",
    "pilot",    "writer", "merchant", "captain",  "gardener",  "fisherman", "nurse",   "judge"};

// Things and places: objects of verbs and prepositions.
const char* const kThings[] = {
    "house",   "garden",   "river",   "forest",     "mountain", "village",  "city",    "road",
    "bridge",  "window",   "door",    "table",      "chair",    "book",     "letter",  "map",
    "key",     "box",      "basket",  "lamp",       "candle",   "boat",     "ship",    "train",
    "car",     "bicycle",  "wagon",   "apple",      "orange",   "egg",      "onion",   "cake",
    "loaf",    "cup",      "kettle",  "meadow",     "field",    "hill",     "lake",    "island",
    "harbour", "market",   "school",  "church",     "castle",   "tower",    "cottage", "kitchen",
    "library", "song",     "story",   "secret",     "question", "answer",   "idea",    "umbrella",
    "coat",    "hat",      "shoe",    "ring",       "coin",     "stone",    "tree",    "flower",
    "leaf",    "storm",    "cloud",   "star",       "moon",     "valley",   "engine",  "clock",
    "mirror",  "painting", "picture", "photograph", "blanket",  "envelope", "ladder",  "rope",
    "hammer",  "needle",   "pencil",  "violin"};

const char* const kAdjectives[] = {
    "old",     "young",   "small",   "large",  "quiet",  "loud",    "bright",  "dark",  "happy",
    "sad",     "tired",   "clever",  "brave",  "gentle", "strange", "famous",  "empty", "heavy",
    "light",   "warm",    "cold",    "wet",    "dry",    "green",   "red",     "blue",  "yellow",
    "white",   "black",   "golden",  "wooden", "broken", "new",     "ancient", "busy",  "lonely",
    "curious", "careful", "simple",  "hungry", "proud",  "silent",  "narrow",  "wide",  "tall",
    "little",  "round",   "sharp",   "soft",   "rough",  "clean",   "dusty",   "early", "late",
    "orange",  "elegant", "awkward", "eager",  "odd",    "open",    "kind",    "grey"};

// Transitive verbs, past tense.
const char* const kVerbs[] = {
    "found",   "saw",     "watched",  "carried",   "opened",     "closed",  "painted",  "bought",
    "sold",    "built",   "followed", "visited",   "lost",       "kept",    "cleaned",  "fixed",
    "moved",   "pushed",  "pulled",   "lifted",    "dropped",    "noticed", "liked",    "loved",
    "feared",  "praised", "warned",   "helped",    "met",        "called",  "answered", "chased",
    "caught",  "hid",     "showed",   "brought",   "wanted",     "needed",  "borrowed", "returned",
    "touched", "counted", "measured", "described", "remembered", "forgot",  "admired",  "guarded",
    "packed",  "wrapped"};

// Intransitive verbs, past tense.
const char* const kIntransitive[] = {
    "slept",  "laughed", "smiled",   "waited",   "walked",   "ran",       "sang",    "danced",
    "cried",  "rested",  "worked",   "listened", "shouted",  "whispered", "arrived", "left",
    "stayed", "fell",    "jumped",   "swam",     "played",   "wondered",  "hurried", "returned",
    "paused", "sighed",  "trembled", "vanished", "appeared", "stopped"};

const char* const kAdverbs[] = {
    "slowly",   "quickly",   "quietly",   "loudly",   "carefully", "happily", "sadly",
    "suddenly", "gently",    "bravely",   "politely", "softly",    "eagerly", "calmly",
    "proudly",  "silently",  "patiently", "warmly",   "nervously", "boldly",  "again",
    "today",    "yesterday", "together",  "alone",    "early",     "late",    "outside"};

const char* const kPrepositions[] = {"near",   "under",  "behind", "beside", "across",
                                     "inside", "over",   "past",   "around", "through",
                                     "toward", "beyond", "along",  "below",  "above"};

const char* const kDeterminers[] = {"the",  "the",  "the", "a",    "a",     "every",
                                    "this", "that", "my",  "your", "their", "our"};

const char* const kConjunctions[] = {"and",      "but",  "because", "while", "so",
                                     "although", "when", "before",  "after", "until"};

const char* const kSaidVerbs[] = {"said",     "whispered", "shouted",   "replied",
                                  "answered", "called",    "explained", "admitted"};
const char* const kAskedVerbs[] = {"asked", "wondered", "whispered", "called"};

const char* const kQuestionWords[] = {"Where is",      "Who found",         "Why did you move",
                                      "Have you seen", "Can you see",       "Who painted",
                                      "Did you bring", "Where did you hide"};

const char* const kTimes[] = {"In the morning", "That evening", "At noon",     "Later",
                              "On Sunday",      "After dinner", "Before dawn", "Once",
                              "In the spring",  "Every winter", "At last",     "Then"};

template <size_t N>
constexpr uint32_t Count(const char* const (&)[N]) {
  return static_cast<uint32_t>(N);
}

// Text generator state. Only raw std::mt19937 outputs are used (never std distributions,
// whose results differ between standard libraries); the tiny modulo bias is irrelevant here.
class TextGenerator {
 public:
  explicit TextGenerator(uint32_t seed) : rng_(seed) {}

  uint32_t Pick(uint32_t n) { return static_cast<uint32_t>(rng_() % n); }
  bool Chance(uint32_t percent) { return rng_() % 100 < percent; }
  template <size_t N>
  const char* PickWord(const char* const (&words)[N]) {
    return words[Pick(Count(words))];
  }

  // A paragraph of 3-7 sentences about one named protagonist, one being and two things.
  void Paragraph(std::string* out) {
    name_ = PickWord(kCorpusNames);
    being_ = PickWord(kBeings);
    for (const char*& thing : things_) thing = PickWord(kThings);
    int sentences = 3 + static_cast<int>(Pick(5));
    for (int i = 0; i < sentences; ++i) {
      if (i > 0) out->push_back(' ');
      Sentence(out);
    }
    out->append("\n\n");
  }

 private:
  // The paragraph's topic words come up more often than others: structure beyond a sentence.
  const char* Being() { return Chance(50) ? being_ : PickWord(kBeings); }
  const char* Thing() { return Chance(60) ? things_[Pick(2)] : PickWord(kThings); }

  // "the old cat", "an orange"; every word list entry that starts with a vowel letter also
  // starts with a vowel sound, so the first letter picks "a" or "an".
  std::string Phrase(const char* noun) {
    std::string det = PickWord(kDeterminers);
    std::string rest;
    if (Chance(45)) rest = absl::StrCat(PickWord(kAdjectives), " ");
    rest += noun;
    if (det == "a" && std::strchr("aeiou", rest[0]) != nullptr) det = "an";
    return absl::StrCat(det, " ", rest);
  }
  // A person or animal: a name or a noun phrase.
  std::string Subject() {
    if (Chance(30)) return Chance(60) ? name_ : PickWord(kCorpusNames);
    return Phrase(Being());
  }
  // Anything a past-tense verb can act on; never repeats a named subject.
  std::string Object(const std::string& subject) {
    if (Chance(15)) {
      std::string name = Chance(50) ? name_ : PickWord(kCorpusNames);
      if (name != subject) return name;
    }
    return Phrase(Chance(25) ? Being() : Thing());
  }

  std::string PrepPhrase() { return absl::StrCat(PickWord(kPrepositions), " ", Phrase(Thing())); }

  // subject + verb phrase, lower case.
  std::string Clause() {
    std::string s = Subject();
    uint32_t kind = Pick(4);
    if (kind <= 1) {
      absl::StrAppend(&s, " ", PickWord(kVerbs), " ", Object(s));
      if (Chance(30)) absl::StrAppend(&s, " ", PrepPhrase());
    } else if (kind == 2) {
      absl::StrAppend(&s, " ", PickWord(kIntransitive));
      if (Chance(50)) absl::StrAppend(&s, " ", PickWord(kAdverbs));
    } else {
      absl::StrAppend(&s, " ", PickWord(kIntransitive), " ", PrepPhrase());
    }
    return s;
  }

  void Sentence(std::string* out) {
    std::string s;
    uint32_t kind = Pick(10);
    if (kind < 5) {
      s = Clause();
      if (Chance(35)) absl::StrAppend(&s, ", ", PickWord(kConjunctions), " ", Clause());
      s += ".";
    } else if (kind < 7) {
      s = absl::StrCat(PickWord(kTimes), ", ", Clause(), ".");
    } else if (kind < 9) {
      // Quoted speech: "Where is the key?" asked Anna.  /  "The dog slept," said Tom.
      std::string quote;
      const char* verb;
      if (Chance(50)) {
        quote = absl::StrCat(PickWord(kQuestionWords), " ", Phrase(Thing()), "?");
        verb = PickWord(kAskedVerbs);
      } else {
        quote = Clause() + ",";
        quote[0] = absl::ascii_toupper(quote[0]);
        verb = PickWord(kSaidVerbs);
      }
      s = absl::StrCat("\"", quote, "\" ", verb, " ", Chance(70) ? name_ : PickWord(kCorpusNames), ".");
      out->append(s);
      return;
    } else {
      s = absl::StrCat("There was ", Phrase(Chance(50) ? Being() : Thing()), " ", PrepPhrase(),
                       ".");
    }
    s[0] = absl::ascii_toupper(s[0]);
    out->append(s);
  }

  std::mt19937 rng_;
  const char* name_ = "";
  const char* being_ = "";
  const char* things_[2] = {"", ""};
};

}  // namespace

std::string DefaultCorpusText(int64_t approx_bytes, uint32_t seed) {
  const int64_t size = approx_bytes < 1024 ? 1024 : approx_bytes;
  TextGenerator gen(seed);
  std::string text;
  text.reserve(static_cast<size_t>(size) + 4096);
  while (static_cast<int64_t>(text.size()) < size) gen.Paragraph(&text);
  text.resize(static_cast<size_t>(size));
  return text;
}

}  // namespace stallfree
