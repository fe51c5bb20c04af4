// common/state_format.h: the header's hand-written codec against protobuf's own, which stays
// the format's schema (offload.proto, CheckpointHeader). Random headers encode to protobuf's
// bytes, byte for byte, and each side reads what the other wrote into the same fields; bytes of
// other writers (repeated fields unpacked, unknown fields, fields given twice) read as protobuf
// reads them; malformed bytes (every truncation, a length past the end, groups, varints of 11
// bytes or past 64 bits, bad keys) give DataLoss naming the fault and never crash (the test also
// runs under ASan: bazel test --config=asan //tests/common:state_format_test). And a whole file:
// WriteCheckpoint, then the readers, the arrays bit for bit, and the in-memory forms.
#include "common/state_format.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "stallfree/v1/offload.pb.h"

namespace stallfree {
namespace {

using Code = absl::StatusCode;

static_assert(kStateFp32 == v1::DTYPE_FP32 && kStateBf16 == v1::DTYPE_BF16,
              "StateParam::grad_dtype holds v1::DType's values");

v1::CheckpointHeader ToProto(const StateHeader& h) {
  v1::CheckpointHeader out;
  out.set_session_name(h.session_name);
  out.set_rank(h.rank);
  out.set_last_step(h.last_step);
  out.set_version(h.version);
  if (h.owner_uid.has_value()) out.set_owner_uid(*h.owner_uid);
  for (const StateHeader::Param& p : h.params) {
    v1::CheckpointHeader::Param* q = out.add_params();
    v1::ParamSpec* spec = q->mutable_spec();  // present, as every writer of the daemon's made it
    spec->set_name(p.spec.name);
    for (int64_t d : p.spec.shape) spec->add_shape(d);
    spec->set_grad_dtype(static_cast<v1::DType>(static_cast<int32_t>(p.spec.grad_dtype)));
    for (int64_t t : p.col_steps) q->add_col_steps(t);
  }
  return out;
}

// The fields of a parsed protobuf message, as the library's struct.
StateHeader FromProto(const v1::CheckpointHeader& h) {
  StateHeader out;
  out.session_name = h.session_name();
  out.rank = h.rank();
  out.last_step = h.last_step();
  out.version = h.version();
  if (h.has_owner_uid()) out.owner_uid = h.owner_uid();
  for (const auto& p : h.params()) {
    StateHeader::Param& q = out.params.emplace_back();
    q.spec.name = p.spec().name();
    q.spec.shape.assign(p.spec().shape().begin(), p.spec().shape().end());
    q.spec.grad_dtype = static_cast<uint32_t>(p.spec().grad_dtype());
    q.col_steps.assign(p.col_steps().begin(), p.col_steps().end());
  }
  return out;
}

std::string Describe(const StateHeader& h) {
  std::ostringstream s;
  s << "{name '" << h.session_name << "' (" << h.session_name.size() << " bytes), rank " << h.rank
    << ", last_step " << h.last_step << ", version " << h.version << ", owner ";
  if (h.owner_uid) s << *h.owner_uid; else s << "none";
  for (const auto& p : h.params) {
    s << ", {'" << p.spec.name << "' [";
    for (int64_t d : p.spec.shape) s << d << " ";
    s << "] dtype " << p.spec.grad_dtype << " steps [";
    for (int64_t t : p.col_steps) s << t << " ";
    s << "]}";
  }
  return s.str() + "}";
}

std::string Hex(const std::string& b) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : b) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

class RandomHeaders {
 public:
  explicit RandomHeaders(uint64_t seed) : rng_(seed) {}

  StateHeader Next() {
    StateHeader h;
    h.session_name = Name();
    h.rank = Pick<int32_t>({0, 1, 7, -1, -2, std::numeric_limits<int32_t>::min(),
                            std::numeric_limits<int32_t>::max(), Uniform(-1000, 1000)});
    h.last_step = Int64();
    h.version = Int64();
    switch (Uniform(0, 3)) {
      case 0: break;  // absent (a file of stallfreed 0.1.0)
      case 1: h.owner_uid = 0; break;
      case 2: h.owner_uid = std::numeric_limits<uint32_t>::max(); break;
      default: h.owner_uid = static_cast<uint32_t>(Uniform(1, 1 << 30)); break;
    }
    const int params = Uniform(0, 4);
    for (int i = 0; i < params; ++i) {
      StateHeader::Param& p = h.params.emplace_back();
      p.spec.name = Name();
      const int dims = Uniform(1, 8);
      for (int d = 0; d < dims; ++d)
        p.spec.shape.push_back(Pick<int64_t>({0, 1, Uniform(2, 300), int64_t{1} << 40, -1,
                                              std::numeric_limits<int64_t>::min(),
                                              std::numeric_limits<int64_t>::max()}));
      p.spec.grad_dtype = Pick<uint32_t>({0, 1, 2, 3, 0x7fffffffu, 0x80000000u, 0xffffffffu});
      const int cols = Uniform(0, 12);
      for (int c = 0; c < cols; ++c) p.col_steps.push_back(Int64());
    }
    return h;
  }

 private:
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  template <typename T>
  T Pick(std::vector<T> xs) {
    return xs[static_cast<size_t>(Uniform(0, static_cast<int>(xs.size()) - 1))];
  }
  int64_t Int64() {
    return Pick<int64_t>({0, 1, 127, 128, 16383, 16384, -1, -128, int64_t{1} << 62,
                          std::numeric_limits<int64_t>::min(),
                          std::numeric_limits<int64_t>::max(),
                          static_cast<int64_t>(rng_())});
  }
  // Valid UTF-8 (the schema's strings are; protobuf refuses others): empty, short, long (past
  // 127 and 16383 bytes: 2- and 3-byte lengths), with multi-byte characters.
  std::string Name() {
    static const char* kPieces[] = {"w", "layer.0.attn.qkv", "\xc3\xa9", "\xe4\xb8\xad", "_",
                                    "0", " ", "\xf0\x9f\x98\x80"};
    const int kind = Uniform(0, 4);
    const int n = kind == 0 ? 0 : kind == 1 ? Uniform(1, 4) : kind == 2 ? Uniform(40, 80)
                                                            : kind == 3 ? 5000 : 1;
    std::string s;
    for (int i = 0; i < n; ++i) s += kPieces[Uniform(0, 7)];
    return s;
  }

  std::mt19937_64 rng_;
};

// Both ways and byte for byte: the library writes protobuf's bytes, and each reads the other's.
TEST(StateFormatTest, RandomHeadersMatchProtobufByteForByte) {
  RandomHeaders gen(20240611);
  for (int i = 0; i < 3000; ++i) {
    const StateHeader h = gen.Next();
    SCOPED_TRACE(::testing::Message() << "header " << i << " " << Describe(h).substr(0, 600));
    const v1::CheckpointHeader proto = ToProto(h);
    const std::string ours = EncodeStateHeader(h);
    const std::string theirs = proto.SerializeAsString();
    ASSERT_EQ(Hex(ours), Hex(theirs));

    v1::CheckpointHeader parsed;
    ASSERT_TRUE(parsed.ParseFromString(ours));
    EXPECT_TRUE(FromProto(parsed) == h);
    EXPECT_EQ(parsed.has_owner_uid(), h.owner_uid.has_value());

    absl::StatusOr<StateHeader> decoded = DecodeStateHeader(theirs.data(), theirs.size());
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_TRUE(*decoded == h) << Describe(*decoded).substr(0, 600);
  }
}

// One header's bytes, spelled out: the encoding pinned without protobuf in the loop.
TEST(StateFormatTest, KnownHeaderBytes) {
  StateHeader h;
  h.session_name = "s";
  h.rank = -1;
  h.last_step = 300;
  h.owner_uid = 0;
  h.params.push_back({{"w", {2, 3}, kStateBf16}, {1, -1, 0}});
  const std::string want =
      "0a0173"                                  // 1 session_name "s"
      "10ffffffffffffffffff01"                  // 2 rank -1: ten bytes
      "18ac02"                                  // 3 last_step 300 (version 0: left out)
      "2a19"                                    // 5 params, 25 bytes:
      "0a09" "0a0177" "12020203" "1802"         //   1 spec: name "w", shape packed [2 3], bf16
      "120c" "01ffffffffffffffffff01" "00"      //   2 col_steps packed [1 -1 0]
      "3000";                                   // 6 owner_uid 0, present
  EXPECT_EQ(Hex(EncodeStateHeader(h)), want);
  EXPECT_EQ(Hex(ToProto(h).SerializeAsString()), want);
}

// ---- Bytes as other writers may lay them out ----

void Varint(uint64_t v, std::string* out) {
  for (; v >= 0x80; v >>= 7) out->push_back(static_cast<char>(v | 0x80));
  out->push_back(static_cast<char>(v));
}
void Key(uint32_t field, uint32_t type, std::string* out) { Varint(field << 3 | type, out); }
void Len(uint32_t field, const std::string& bytes, std::string* out) {
  Key(field, 2, out);
  Varint(bytes.size(), out);
  *out += bytes;
}
// Unknown fields of every skippable wire type (0, 1, 2, 5), under high field numbers.
std::string Unknowns() {
  std::string u;
  Key(1000, 0, &u);
  Varint(~uint64_t{0}, &u);
  Key(1001, 1, &u);
  u.append("12345678", 8);
  Len(1002, std::string("\x08\x01 unknown \xff", 12), &u);
  Key(536870911, 5, &u);  // the largest field number
  u.append("abcd", 4);
  return u;
}

// What the library and protobuf read of `bytes`: the same, or both refuse.
void ExpectReadAsProtobufDoes(const std::string& bytes, const std::string& what) {
  SCOPED_TRACE(what + ": " + Hex(bytes));
  v1::CheckpointHeader proto;
  const bool proto_ok = proto.ParseFromString(bytes);
  absl::StatusOr<StateHeader> ours = DecodeStateHeader(bytes.data(), bytes.size());
  ASSERT_EQ(ours.ok(), proto_ok) << ours.status();
  if (!proto_ok) {
    EXPECT_EQ(ours.status().code(), Code::kDataLoss) << ours.status();
    EXPECT_NE(ours.status().message().find("of the header"), std::string::npos) << ours.status();
    return;
  }
  EXPECT_TRUE(*ours == FromProto(proto)) << Describe(*ours) << " vs "
                                         << Describe(FromProto(proto));
}

TEST(StateFormatTest, UnpackedRepeatedFieldsAndUnknownFieldsRead) {
  // ParamSpec: name, shape unpacked (one varint per element, a negative one too), an unknown
  // field, grad_dtype.
  std::string spec;
  Len(1, "w", &spec);
  for (int64_t d : {4, 300, -5}) {
    Key(2, 0, &spec);
    Varint(static_cast<uint64_t>(d), &spec);
  }
  spec += Unknowns();
  Key(3, 0, &spec);
  Varint(2, &spec);
  // Param: spec, col_steps half packed and half not, unknowns between.
  std::string param;
  Len(1, spec, &param);
  std::string packed;
  Varint(7, &packed);
  Varint(static_cast<uint64_t>(int64_t{-9}), &packed);
  Len(2, packed, &param);
  param += Unknowns();
  Key(2, 0, &param);
  Varint(11, &param);
  // The header: unknowns first and last, every field.
  std::string h = Unknowns();
  Len(1, "session", &h);
  Key(2, 0, &h);
  Varint(3, &h);
  Key(3, 0, &h);
  Varint(42, &h);
  Key(4, 0, &h);
  Varint(43, &h);
  Len(5, param, &h);
  Key(6, 0, &h);
  Varint(1000, &h);
  h += Unknowns();

  absl::StatusOr<StateHeader> got = DecodeStateHeader(h.data(), h.size());
  ASSERT_TRUE(got.ok()) << got.status();
  StateHeader want;
  want.session_name = "session";
  want.rank = 3;
  want.last_step = 42;
  want.version = 43;
  want.owner_uid = 1000;
  want.params.push_back({{"w", {4, 300, -5}, kStateBf16}, {7, -9, 11}});
  EXPECT_TRUE(*got == want) << Describe(*got);
  ExpectReadAsProtobufDoes(h, "unpacked and unknown fields");

  // Re-encoded, the unknowns are gone and the repeated fields packed: protobuf's bytes again.
  EXPECT_EQ(Hex(EncodeStateHeader(*got)), Hex(ToProto(want).SerializeAsString()));
}

TEST(StateFormatTest, FieldsGivenTwiceReadAsProtobufReadsThem) {
  std::string spec_a, spec_b;
  Len(1, "first", &spec_a);
  Len(2, std::string("\x01\x02", 2), &spec_a);
  Key(3, 0, &spec_a);
  Varint(1, &spec_a);
  Len(1, "second", &spec_b);
  Len(2, std::string("\x03", 1), &spec_b);
  std::string param;
  Len(1, spec_a, &param);
  Len(1, spec_b, &param);  // merged into the first: the name replaced, the shape appended
  std::string h;
  Key(2, 0, &h);
  Varint(5, &h);
  Key(2, 0, &h);
  Varint(6, &h);  // the last wins
  Len(1, "a", &h);
  Len(1, "b", &h);
  Len(5, param, &h);
  Len(5, param, &h);  // a second parameter
  Key(6, 0, &h);
  Varint(0, &h);  // present though 0
  ExpectReadAsProtobufDoes(h, "fields given twice");
  absl::StatusOr<StateHeader> got = DecodeStateHeader(h.data(), h.size());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->rank, 6);
  ASSERT_EQ(got->params.size(), 2u);
  EXPECT_EQ(got->params[0].spec.name, "second");
  EXPECT_EQ(got->params[0].spec.shape, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(got->params[0].spec.grad_dtype, kStateFp32);
  EXPECT_EQ(got->owner_uid, std::optional<uint32_t>(0));

  // A field of another wire type than the schema's is an unknown one (skipped), as protobuf
  // has it; a varint wider than the field keeps its low 32 bits.
  std::string odd;
  Len(2, "not a rank", &odd);
  Key(1, 0, &odd);
  Varint(7, &odd);
  Key(4, 5, &odd);
  odd.append("\x01\x02\x03\x04", 4);
  Key(2, 0, &odd);
  Varint(uint64_t{0x1234567800000009}, &odd);
  Key(6, 0, &odd);
  Varint(uint64_t{0x500000001}, &odd);
  ExpectReadAsProtobufDoes(odd, "other wire types");
  got = DecodeStateHeader(odd.data(), odd.size());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->rank, 9);
  EXPECT_EQ(got->owner_uid, std::optional<uint32_t>(1));
  EXPECT_EQ(got->session_name, "");
}

// ---- Malformed bytes ----

void ExpectDataLoss(const std::string& bytes, const std::string& cause, const std::string& what) {
  absl::StatusOr<StateHeader> got = DecodeStateHeader(bytes.data(), bytes.size());
  ASSERT_FALSE(got.ok()) << what << ": " << Hex(bytes) << " read as " << Describe(*got);
  EXPECT_EQ(got.status().code(), Code::kDataLoss) << what << ": " << got.status();
  EXPECT_NE(got.status().message().find(cause), std::string::npos)
      << what << ": " << got.status() << " does not say '" << cause << "'";
}

TEST(StateFormatTest, EveryTruncationReadsAsProtobufReadsIt) {
  // A prefix that ends between top-level fields is a header of fewer fields (to protobuf too);
  // any other is refused. Each prefix is its own allocation, so ASan sees any read past it.
  RandomHeaders gen(7);
  int refused = 0, read = 0;
  for (int i = 0; i < 40; ++i) {
    StateHeader h = gen.Next();
    if (h.session_name.size() > 100) h.session_name = "long";  // (whole UTF-8 characters)
    for (auto& p : h.params)
      if (p.spec.name.size() > 100) p.spec.name = "p";
    const std::string full = EncodeStateHeader(h);
    for (size_t n = 0; n < full.size(); ++n) {
      const std::unique_ptr<char[]> prefix(new char[n]);  // (exactly n: a byte past it is ASan's)
      memcpy(prefix.get(), full.data(), n);
      absl::StatusOr<StateHeader> got = DecodeStateHeader(prefix.get(), n);
      got.ok() ? ++read : ++refused;
      ExpectReadAsProtobufDoes(full.substr(0, n), absl::StrCat("header ", i, " cut at ", n));
      if (::testing::Test::HasFailure()) return;
    }
  }
  EXPECT_GT(refused, 1000);
  EXPECT_GT(read, 40);
}

TEST(StateFormatTest, MalformedBytesAreDataLoss) {
  StateHeader h;
  h.session_name = "session";
  h.params.push_back({{"w", {2, 3}, kStateFp32}, {1, 2, 3}});
  const std::string good = EncodeStateHeader(h);

  // A length past the end: of a string, of a message, of a packed run, and one of 2^63.
  ExpectDataLoss(std::string("\x0a\x05" "abc", 5), "past the end", "a string");
  ExpectDataLoss(std::string("\x2a\x7f\x0a\x00", 4), "past the end", "a parameter");
  {
    std::string param;
    Len(1, "", &param);
    param += std::string("\x12\x09\x01\x02", 4);  // col_steps: 9 bytes announced, 2 there
    std::string bad;
    Len(5, param, &bad);
    ExpectDataLoss(bad, "past the end", "a packed run");
    ExpectDataLoss(bad, "CheckpointHeader.Param field 2", "names the field");
  }
  {
    std::string bad;
    Key(1, 2, &bad);
    Varint(uint64_t{1} << 63, &bad);
    ExpectDataLoss(bad, "past the end", "a length of 2^63");
  }
  // Groups (wire types 3 and 4), at the top and inside a spec; wire types 6 and 7; field 0.
  for (uint32_t type : {3u, 4u}) {
    std::string bad = good;
    Key(7, type, &bad);
    ExpectDataLoss(bad, "group", absl::StrCat("wire type ", type));
    std::string spec, param, nested;
    Key(9, type, &spec);
    Len(1, spec, &param);
    Len(5, param, &nested);
    ExpectDataLoss(nested, "group", absl::StrCat("wire type ", type, " in a spec"));
    ExpectDataLoss(nested, "ParamSpec", "names the message");
  }
  for (uint32_t type : {6u, 7u}) {
    std::string bad;
    Key(1, type, &bad);
    ExpectDataLoss(bad, absl::StrCat("wire type ", type), "an invalid wire type");
  }
  ExpectDataLoss(std::string("\x00\x01", 2), "field number 0", "field 0");
  ExpectDataLoss(std::string("\x80\x80\x80\x80\x80\x01\x00", 7), "field number",
                 "a key past 32 bits");
  // Varints: 11 bytes (as a value, a key, a length, a packed element), and 10 past 64 bits.
  const std::string eleven = std::string(10, '\xff') + '\x01';
  ExpectDataLoss("\x18" + eleven, "longer than 10 bytes", "an 11-byte value");
  ExpectDataLoss(eleven, "longer than 10 bytes", "an 11-byte key");
  ExpectDataLoss("\x0a" + eleven, "longer than 10 bytes", "an 11-byte length");
  {
    std::string param, bad;
    Len(2, eleven, &param);
    Len(5, param, &bad);
    ExpectDataLoss(bad, "longer than 10 bytes", "an 11-byte step count");
  }
  ExpectDataLoss("\x18" + std::string(9, '\xff') + '\x02', "past 64 bits", "a 65-bit value");
  ExpectDataLoss(std::string("\x18\x80", 2), "truncated varint", "a value cut short");
  // Fixed-size unknowns cut short.
  ExpectDataLoss(std::string("\x39" "1234567", 8), "truncated 8-byte", "a fixed64");
  ExpectDataLoss(std::string("\x3d" "123", 4), "truncated 4-byte", "a fixed32");

  // Through the format's readers: a checkpoint with such a header is a corrupt one.
  std::string file("SFCKPT1\n", 8);
  const std::string header = "\x18" + eleven;
  const uint64_t header_bytes = header.size();
  file.append(reinterpret_cast<const char*>(&header_bytes), 8);
  file += header;
  file.append(8, '\0');
  absl::StatusOr<StateHeader> verified = VerifyCheckpointBytes(file.data(), file.size(), "bytes x");
  ASSERT_FALSE(verified.ok());
  EXPECT_EQ(verified.status().code(), Code::kDataLoss);
  EXPECT_NE(verified.status().message().find("bytes x has a corrupt header: byte 1 of the header"),
            std::string::npos)
      << verified.status();
}

// ---- A whole file ----

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Strings are proto3's: protobuf refuses a header whose name is not UTF-8, and so does the
// library (before it, such a file was a corrupt header; a name taken as it came would reach the
// listing's CheckpointInfo, which protobuf readers then refuse). Valid multi-byte names read.
TEST(StateFormatTest, NamesThatAreNotUtf8AreRefusedAsProtobufRefusesThem) {
  struct Case {
    std::string name;
    bool valid;
  };
  const std::vector<Case> cases = {
      {"caf\xc3\xa9", true},             // U+00E9
      {"\xe2\x82\xac-\xf0\x9f\x98\x80", true},  // U+20AC, U+1F600
      {"\xc0\x80", false},               // an overlong NUL
      {"\xed\xa0\x80", false},           // a surrogate
      {"\xf4\x90\x80\x80", false},       // past U+10FFFF
      {"ab\xc3", false},                  // cut short
      {"\x80", false},                    // a continuation byte alone
  };
  for (const Case& c : cases) {
    for (bool in_spec : {false, true}) {  // the session's name, and a parameter's
      // Field 1 (session_name), or field 5 (params) holding field 1 (spec) holding field 1.
      std::string bytes;
      if (!in_spec) {
        bytes = std::string("\x0a") + static_cast<char>(c.name.size()) + c.name;
      } else {
        const std::string spec = std::string("\x0a") + static_cast<char>(c.name.size()) + c.name;
        const std::string param = std::string("\x0a") + static_cast<char>(spec.size()) + spec;
        bytes = std::string("\x2a") + static_cast<char>(param.size()) + param;
      }
      v1::CheckpointHeader proto;
      EXPECT_EQ(proto.ParseFromString(bytes), c.valid) << Hex(bytes);
      if (c.valid) {
        absl::StatusOr<StateHeader> got = DecodeStateHeader(bytes.data(), bytes.size());
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_EQ(in_spec ? got->params.at(0).spec.name : got->session_name, c.name);
      } else {
        ExpectDataLoss(bytes, "not UTF-8", Hex(bytes));
      }
    }
  }
}

TEST(StateFormatTest, WrittenFileReadsBackBitForBit) {
  const char* tmp = getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/state.sfckpt";
  StateHeader h;
  h.session_name = "file";
  h.rank = 2;
  h.last_step = 17;
  h.version = 17;
  h.owner_uid = getuid();
  h.params.push_back({{"w", {5, 3}, kStateFp32}, {17, 0, -1}});
  h.params.push_back({{"b", {0, 4}, kStateBf16}, {1, 2, 3, 4}});  // a share of no rows
  h.params.push_back({{"s", {7}, kStateFp32}, {9, 9, 9, 9, 9, 9, 8}});
  // Arrays of every bit pattern class: NaNs with payloads, infinities, denormals, -0.
  std::mt19937 rng(3);
  std::vector<std::vector<float>> arrays;
  std::vector<CheckpointArrays> views;
  for (const auto& p : h.params) {
    const int64_t numel = *CheckpointParamNumel(p.spec);
    for (int k = 0; k < 4; ++k) {
      std::vector<float>& a = arrays.emplace_back(numel);
      for (float& x : a) {
        const uint32_t bits = static_cast<uint32_t>(rng());
        memcpy(&x, &bits, 4);
      }
    }
  }
  for (size_t i = 0; i < h.params.size(); ++i)
    views.push_back({arrays[4 * i].data(), arrays[4 * i + 1].data(), arrays[4 * i + 2].data(),
                     arrays[4 * i + 3].data(), static_cast<int64_t>(arrays[4 * i].size())});

  absl::StatusOr<CheckpointWritten> written = WriteCheckpoint(path, h, views);
  ASSERT_TRUE(written.ok()) << written.status();
  const std::string file = ReadAll(path);
  ASSERT_EQ(file.size(), written->bytes);
  // The header on disk is protobuf's serialization of the same message.
  uint64_t header_bytes = 0;
  memcpy(&header_bytes, file.data() + 8, 8);
  EXPECT_EQ(Hex(file.substr(16, header_bytes)), Hex(ToProto(h).SerializeAsString()));
  // The rest of the layout, read here by hand: the magic, each parameter's master, m, v and
  // accumulator after the header in order, and the trailer, the checksum of all before it.
  EXPECT_EQ(file.substr(0, 8), std::string("SFCKPT1\n", 8));
  size_t at = 16 + header_bytes;
  for (const auto& a : arrays) {
    std::vector<float> stored(a.size());
    if (!a.empty()) memcpy(stored.data(), file.data() + at, a.size() * sizeof(float));
    EXPECT_TRUE(SameBits(stored, a)) << "the array at byte " << at;
    at += a.size() * sizeof(float);
  }
  ASSERT_EQ(at + 8, file.size());
  Checksum64 sum;
  sum.Update(file.data(), at);
  uint64_t trailer = 0;
  memcpy(&trailer, file.data() + at, 8);
  EXPECT_EQ(trailer, sum.Digest());

  uint64_t size = 0;
  absl::StatusOr<StateHeader> header = ReadCheckpointHeader(path, &size);
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(size, file.size());
  EXPECT_TRUE(*header == h) << Describe(*header);
  std::vector<std::vector<float>> back;
  std::vector<CheckpointArrays> into;
  for (const auto& a : arrays) back.emplace_back(a.size(), 0.0f);
  for (size_t i = 0; i < h.params.size(); ++i)
    into.push_back({back[4 * i].data(), back[4 * i + 1].data(), back[4 * i + 2].data(),
                    back[4 * i + 3].data(), static_cast<int64_t>(back[4 * i].size())});
  ASSERT_TRUE(ReadCheckpointArrays(path, *header, into).ok());
  for (size_t k = 0; k < arrays.size(); ++k)
    EXPECT_TRUE(SameBits(back[k], arrays[k])) << "array " << k;

  // In memory: the export's bytes are the file's; they verify, and import chunk by chunk.
  CheckpointExport exported(h, views);
  std::string bytes(exported.total(), '\0');
  ASSERT_EQ(exported.Next(bytes.data(), bytes.size()), bytes.size());
  EXPECT_EQ(exported.digest(), written->checksum);
  EXPECT_TRUE(bytes == file);
  absl::StatusOr<StateHeader> verified = VerifyCheckpointBytes(bytes.data(), bytes.size(), "x");
  ASSERT_TRUE(verified.ok()) << verified.status();
  EXPECT_TRUE(*verified == h);
  for (auto& a : back) std::fill(a.begin(), a.end(), 0.0f);
  CheckpointImport import(bytes.size(), "the import");
  absl::StatusOr<bool> done = false;
  for (size_t at = 0; at < bytes.size(); at += 13) {
    done = import.Take(bytes.data() + at, std::min<size_t>(13, bytes.size() - at),
                       [&](const StateHeader& got) -> absl::StatusOr<std::vector<CheckpointArrays>> {
                         EXPECT_TRUE(got == h);
                         return into;
                       });
    ASSERT_TRUE(done.ok()) << done.status();
  }
  EXPECT_TRUE(*done);
  for (size_t k = 0; k < arrays.size(); ++k)
    EXPECT_TRUE(SameBits(back[k], arrays[k])) << "array " << k;

  // The header's parameters against a session's.
  std::vector<StateParam> specs;
  for (const auto& p : h.params) specs.push_back(p.spec);
  EXPECT_TRUE(MatchCheckpointParams(h, specs, "tag: checkpoint 'f'").ok());
  specs[1].grad_dtype = kStateFp32;
  absl::Status differ = MatchCheckpointParams(h, specs, "tag: checkpoint 'f'");
  EXPECT_EQ(differ.code(), Code::kFailedPrecondition);
  EXPECT_NE(differ.message().find("parameter 1 of checkpoint 'f' is 'b'"), std::string::npos)
      << differ;
  specs[1].grad_dtype = h.params[1].spec.grad_dtype;
  StateHeader fewer_steps = h;
  fewer_steps.params[2].col_steps.pop_back();
  absl::Status steps = MatchCheckpointParams(fewer_steps, specs, "tag: checkpoint 'f'");
  EXPECT_EQ(steps.code(), Code::kFailedPrecondition);
  EXPECT_NE(steps.message().find("6 column step counts for 7 columns"), std::string::npos)
      << steps;

  // Headers that differ in any one field are not equal (what every round trip above relies on).
  std::vector<StateHeader> one_off(9, h);
  one_off[0].session_name += "x";
  one_off[1].rank += 1;
  one_off[2].last_step += 1;
  one_off[3].version += 1;
  one_off[4].owner_uid = std::nullopt;
  one_off[5].params[0].spec.name = "v";
  one_off[6].params[0].spec.shape[1] += 1;
  one_off[7].params[1].spec.grad_dtype = kStateFp32;
  one_off[8].params[2].col_steps[0] += 1;
  for (size_t i = 0; i < one_off.size(); ++i) EXPECT_FALSE(one_off[i] == h) << "field " << i;
  StateHeader fewer_params = h;
  fewer_params.params.pop_back();
  EXPECT_FALSE(fewer_params == h);
}

// The arrays a caller gives must be the header's, one per parameter and each of its size:
// otherwise nothing is written or read (a daemon's bug, not a bad file: Internal).
TEST(StateFormatTest, ArraysThatAreNotTheHeadersAreRefusedBeforeAnyByteMoves) {
  const char* tmp = getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp != nullptr ? tmp : "/tmp");
  StateHeader h;
  h.session_name = "fit";
  h.params.push_back({{"w", {2, 3}, kStateFp32}, {1, 1, 1}});
  h.params.push_back({{"s", {4}, kStateFp32}, {1, 1, 1, 1}});
  std::vector<std::vector<float>> arrays(8);
  for (int k = 0; k < 8; ++k) arrays[k].assign(k < 4 ? 6 : 4, 1.5f + k);
  auto views = [&](int64_t numel0) {
    return std::vector<CheckpointArrays>{
        {arrays[0].data(), arrays[1].data(), arrays[2].data(), arrays[3].data(), numel0},
        {arrays[4].data(), arrays[5].data(), arrays[6].data(), arrays[7].data(), 4}};
  };
  const std::string bad = dir + "/bad.sfckpt";
  absl::StatusOr<CheckpointWritten> one = WriteCheckpoint(bad, h, {views(6)[0]});
  EXPECT_EQ(one.status().code(), Code::kInternal) << one.status();
  EXPECT_NE(one.status().message().find("1 arrays for 2 parameters"), std::string::npos);
  absl::StatusOr<CheckpointWritten> small = WriteCheckpoint(bad, h, views(5));
  EXPECT_EQ(small.status().code(), Code::kInternal) << small.status();
  EXPECT_NE(small.status().message().find("parameter 0's arrays are not its size"),
            std::string::npos);
  EXPECT_NE(access(bad.c_str(), F_OK), 0) << "no file for a refused write";

  const std::string good = dir + "/fit.sfckpt";
  ASSERT_TRUE(WriteCheckpoint(good, h, views(6)).ok());
  for (auto& a : arrays) std::fill(a.begin(), a.end(), -2.0f);
  absl::Status read = ReadCheckpointArrays(good, h, views(7));
  EXPECT_EQ(read.code(), Code::kInternal) << read;
  for (const auto& a : arrays)
    for (float x : a) ASSERT_EQ(x, -2.0f) << "an array changed by a refused read";
  EXPECT_TRUE(ReadCheckpointArrays(good, h, views(6)).ok());
  EXPECT_EQ(arrays[0][0], 1.5f);
}

// A state whose arrays are all empty (shares of no rows) puts nothing into the caller's arrays:
// an import of it that fails at the checksum says so (writing() false).
TEST(StateFormatTest, AnImportOfEmptyArraysThatFailsHasWrittenNothing) {
  StateHeader h;
  h.session_name = "empty";
  h.params.push_back({{"w", {0, 4}, kStateFp32}, {1, 1, 1, 1}});
  std::vector<CheckpointArrays> none = {{nullptr, nullptr, nullptr, nullptr, 0}};
  CheckpointExport exported(h, none);
  std::string bytes(exported.total(), '\0');
  ASSERT_EQ(exported.Next(bytes.data(), bytes.size()), bytes.size());
  bytes.back() ^= 1;  // the checksum
  CheckpointImport import(bytes.size(), "the import");
  absl::StatusOr<bool> done = import.Take(
      bytes.data(), bytes.size(),
      [&](const StateHeader&) -> absl::StatusOr<std::vector<CheckpointArrays>> { return none; });
  EXPECT_EQ(done.status().code(), Code::kDataLoss) << done.status();
  EXPECT_FALSE(import.writing());
}

}  // namespace
}  // namespace stallfree
