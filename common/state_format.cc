#include "common/state_format.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/status.h"

namespace stallfree {
namespace {

constexpr char kMagic[8] = {'S', 'F', 'C', 'K', 'P', 'T', '1', '\n'};
constexpr size_t kIoChunk = size_t{8} << 20;
// Bytes checksummed and copied together in memory: the second pass over them finds them in L2
// (a run of a whole staging chunk would read every byte from memory twice).
constexpr uint64_t kCacheRun = uint64_t{256} << 10;

// DataLoss unless a checkpoint's stored trailer is the checksum of what came before it.
absl::Status CheckDigest(uint64_t stored, uint64_t computed, const std::string& what) {
  if (stored == computed) return absl::OkStatus();
  return absl::DataLossError(absl::StrFormat("%s is corrupt: checksum %016x, it says %016x", what,
                                             computed, stored));
}

// Whether bytes are UTF-8 as proto3 requires of a string field (protobuf refuses to parse a
// message whose string is not): no overlong forms, no surrogates, nothing past U+10FFFF.
bool ValidUtf8(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n;) {
    const uint8_t c = p[i];
    size_t len;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = cp << 6 | (p[i + k] & 0x3F);
    }
    static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

// ---- The header: offload.proto's CheckpointHeader in protobuf's wire format ----
//
// A field is a key (varint: field number << 3 | wire type) and its value: a varint (wire type
// 0), 8 bytes (1), a varint length and that many bytes (2: strings, messages, packed repeated
// scalars) or 4 bytes (5). Integers are varints of their two's complement as 64 bits, so that a
// negative int64, int32 or enum takes 10 bytes.

enum WireType : uint32_t {
  kVarint = 0,
  kFixed64 = 1,
  kLength = 2,
  kGroupStart = 3,
  kGroupEnd = 4,
  kFixed32 = 5,
};

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}

void PutKey(uint32_t field, WireType type, std::string* out) {
  PutVarint(uint64_t{field} << 3 | type, out);
}

// A string or a message's bytes (written even when empty: a message field is present).
void PutLength(uint32_t field, const std::string& bytes, std::string* out) {
  PutKey(field, kLength, out);
  PutVarint(bytes.size(), out);
  out->append(bytes);
}

// An int64, int32 or enum scalar, left out when 0 (proto3).
void PutInt(uint32_t field, int64_t v, std::string* out) {
  if (v == 0) return;
  PutKey(field, kVarint, out);
  PutVarint(static_cast<uint64_t>(v), out);
}

// A repeated int64, packed (proto3's default), left out when empty.
void PutPacked(uint32_t field, const std::vector<int64_t>& xs, std::string* out) {
  if (xs.empty()) return;
  size_t bytes = 0;
  for (int64_t x : xs) bytes += VarintSize(static_cast<uint64_t>(x));
  PutKey(field, kLength, out);
  PutVarint(bytes, out);
  for (int64_t x : xs) PutVarint(static_cast<uint64_t>(x), out);
}

// ParamSpec: 1 name (string), 2 shape (repeated int64), 3 grad_dtype (DType).
std::string EncodeParamSpec(const StateParam& p) {
  std::string out;
  if (!p.name.empty()) PutLength(1, p.name, &out);
  PutPacked(2, p.shape, &out);
  PutInt(3, static_cast<int32_t>(p.grad_dtype), &out);  // an enum is an int32
  return out;
}

// The fields of one message in [p, end) of the header that starts at `origin`, read in order.
struct WireReader {
  const uint8_t* origin;
  const uint8_t* p;
  const uint8_t* end;
  const char* message;  // the message's name in the schema, for errors
  uint32_t field = 0;   // the field whose key was read last (0: none yet)

  bool done() const { return p == end; }

  absl::Status Fault(const uint8_t* at, const std::string& what) const {
    return absl::DataLossError(absl::StrCat(
        "byte ", at - origin, " of the header (", message,
        field == 0 ? std::string() : absl::StrCat(" field ", field), "): ", what));
  }

  absl::Status Varint(uint64_t* v) {
    const uint8_t* at = p;
    uint64_t x = 0;
    for (int i = 0; i < 10; ++i) {
      if (p == end) return Fault(at, "a truncated varint");
      const uint8_t b = *p++;
      if (i == 9 && b > 1)
        return Fault(at, (b & 0x80) != 0 ? "a varint longer than 10 bytes"
                                         : "a varint past 64 bits");
      x |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if ((b & 0x80) == 0) {
        *v = x;
        return absl::OkStatus();
      }
    }
    return Fault(at, "a varint longer than 10 bytes");  // not reached
  }

  // The next field's key: sets `field`, and *type its wire type (never a group's).
  absl::Status Key(uint32_t* type) {
    field = 0;
    const uint8_t* at = p;
    uint64_t key = 0;
    RETURN_IF_ERROR(Varint(&key));
    if (key > UINT32_MAX || key >> 3 == 0)
      return Fault(at, absl::StrCat("a key of field number ", key >> 3));
    field = static_cast<uint32_t>(key >> 3);
    *type = static_cast<uint32_t>(key & 7);
    if (*type == kGroupStart || *type == kGroupEnd)
      return Fault(at,
                   absl::StrCat("a group (wire type ", *type, "), which the schema has none of"));
    if (*type > kFixed32) return Fault(at, absl::StrCat("wire type ", *type, ", which is none"));
    return absl::OkStatus();
  }

  // A length-delimited value: a reader of its bytes, as `what`.
  absl::Status Length(const char* what, WireReader* inner) {
    const uint8_t* at = p;
    uint64_t n = 0;
    RETURN_IF_ERROR(Varint(&n));
    if (n > static_cast<uint64_t>(end - p))
      return Fault(at, absl::StrCat("a length of ", n, " bytes past the end (", end - p,
                                    " bytes left)"));
    *inner = WireReader{origin, p, p + n, what, field};
    p += n;
    return absl::OkStatus();
  }

  absl::Status Fixed(size_t n) {
    if (static_cast<size_t>(end - p) < n)
      return Fault(p, absl::StrCat("a truncated ", n, "-byte value"));
    p += n;
    return absl::OkStatus();
  }

  // The value of a field the schema does not have here (or not of this wire type): skipped.
  absl::Status Skip(uint32_t type) {
    uint64_t v = 0;
    WireReader ignored{};
    switch (type) {
      case kVarint: return Varint(&v);
      case kFixed64: return Fixed(8);
      case kLength: return Length(message, &ignored);
      default: return Fixed(4);  // kFixed32 (Key refused the others)
    }
  }

  absl::Status String(std::string* out) {
    WireReader s{};
    RETURN_IF_ERROR(Length(message, &s));
    if (!ValidUtf8(s.p, static_cast<size_t>(s.end - s.p)))
      return Fault(s.p, "a string that is not UTF-8 (proto3 refuses it)");
    out->assign(reinterpret_cast<const char*>(s.p), static_cast<size_t>(s.end - s.p));
    return absl::OkStatus();
  }

  // A repeated int64's elements: one (unpacked, a varint) or a packed run of them, appended.
  absl::Status Int64s(uint32_t type, std::vector<int64_t>* out) {
    uint64_t v = 0;
    if (type == kVarint) {
      RETURN_IF_ERROR(Varint(&v));
      out->push_back(static_cast<int64_t>(v));
      return absl::OkStatus();
    }
    WireReader packed{};
    RETURN_IF_ERROR(Length(message, &packed));
    while (!packed.done()) {
      RETURN_IF_ERROR(packed.Varint(&v));
      out->push_back(static_cast<int64_t>(v));
    }
    return absl::OkStatus();
  }
};

// A ParamSpec's fields, merged into *p (a spec given twice is one: protobuf's merge).
absl::Status DecodeParamSpec(WireReader r, StateParam* p) {
  while (!r.done()) {
    uint32_t type = 0;
    RETURN_IF_ERROR(r.Key(&type));
    if (r.field == 1 && type == kLength) {
      RETURN_IF_ERROR(r.String(&p->name));
    } else if (r.field == 2 && (type == kVarint || type == kLength)) {
      RETURN_IF_ERROR(r.Int64s(type, &p->shape));
    } else if (r.field == 3 && type == kVarint) {
      uint64_t v = 0;
      RETURN_IF_ERROR(r.Varint(&v));
      p->grad_dtype = static_cast<uint32_t>(v);  // an int32: the low 32 bits
    } else {
      RETURN_IF_ERROR(r.Skip(type));
    }
  }
  return absl::OkStatus();
}

// A CheckpointHeader.Param's fields: 1 spec (ParamSpec), 2 col_steps (repeated int64).
absl::Status DecodeParam(WireReader r, StateHeader::Param* p) {
  while (!r.done()) {
    uint32_t type = 0;
    RETURN_IF_ERROR(r.Key(&type));
    if (r.field == 1 && type == kLength) {
      WireReader spec{};
      RETURN_IF_ERROR(r.Length("ParamSpec", &spec));
      RETURN_IF_ERROR(DecodeParamSpec(spec, &p->spec));
    } else if (r.field == 2 && (type == kVarint || type == kLength)) {
      RETURN_IF_ERROR(r.Int64s(type, &p->col_steps));
    } else {
      RETURN_IF_ERROR(r.Skip(type));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> CheckpointBodyBytes(const StateHeader& header);  // (below)

// ---- The prefix, in a file or in memory ----

// The header length in the first 16 bytes of a checkpoint of `total` bytes (total >= 16 +
// after), after its magic; the header must leave `after` bytes behind it (the checksum's 8, or 0
// where only the header is judged).
absl::StatusOr<uint64_t> HeaderLength(const char* first16, uint64_t total, uint64_t after,
                                      const std::string& what) {
  if (memcmp(first16, kMagic, 8) != 0)
    return absl::DataLossError(absl::StrCat(what, " is not a stallfree checkpoint (bad magic)"));
  uint64_t header_bytes = 0;
  memcpy(&header_bytes, first16 + 8, 8);
  if (header_bytes > total - 16 - after)
    return absl::DataLossError(absl::StrCat(what, " is truncated: its header needs ",
                                            header_bytes, " bytes, it has ", total));
  return header_bytes;
}

// The header of `header_bytes` bytes at text, decoded and its shapes' products in range
// (CheckpointBodyBytes); *body the bytes of the arrays it describes. DataLoss naming `what`.
absl::StatusOr<StateHeader> DecodeHeaderText(const char* text, uint64_t header_bytes,
                                             const std::string& what, uint64_t* body) {
  absl::StatusOr<StateHeader> header = DecodeStateHeader(text, static_cast<size_t>(header_bytes));
  absl::StatusOr<uint64_t> bytes =
      header.ok() ? CheckpointBodyBytes(*header) : absl::StatusOr<uint64_t>(header.status());
  if (!bytes.ok())
    return absl::DataLossError(
        absl::StrCat(what, " has a corrupt header: ", bytes.status().message()));
  *body = *bytes;
  return header;
}

// Internal unless `arrays` are one per parameter of `header`, each of its size.
absl::Status CheckArrays(const StateHeader& header, const std::vector<CheckpointArrays>& arrays,
                        const std::string& what) {
  if (arrays.size() != header.params.size())
    return absl::InternalError(absl::StrCat(what, ": ", arrays.size(), " arrays for ",
                                            header.params.size(), " parameters"));
  for (size_t i = 0; i < arrays.size(); ++i)
    if (arrays[i].numel != CheckpointParamNumel(header.params[i].spec).value_or(-1))
      return absl::InternalError(
          absl::StrCat(what, ": parameter ", i, "'s arrays are not its size"));
  return absl::OkStatus();
}

// ---- Files ----

absl::Status ReadAt(int fd, void* data, size_t n, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = pread(fd, p, std::min(n, kIoChunk), static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return FileError("pread", path, errno);
    if (r == 0) return absl::DataLossError(absl::StrCat("checkpoint ", path, " is truncated"));
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

// The header of an open checkpoint file. With `sized`, the arrays it describes must be in the
// file too (so that its shapes may size buffers); without, only the header is judged (the
// listing: a bad body is found by a full read).
absl::StatusOr<StateHeader> ReadHeaderFd(int fd, const std::string& path, uint64_t file_bytes,
                                         uint64_t* header_end, uint64_t* body,
                                         bool sized = true) {
  const std::string what = absl::StrCat("checkpoint ", path);
  if (file_bytes < 16)
    return absl::DataLossError(
        absl::StrCat(what, " is truncated: ", file_bytes, " bytes, not even a header"));
  char first16[16];
  RETURN_IF_ERROR(ReadAt(fd, first16, 16, 0, path));
  ASSIGN_OR_RETURN(uint64_t header_bytes, HeaderLength(first16, file_bytes, 0, what));
  std::string text(header_bytes, '\0');
  RETURN_IF_ERROR(ReadAt(fd, text.data(), header_bytes, 16, path));
  ASSIGN_OR_RETURN(StateHeader header, DecodeHeaderText(text.data(), header_bytes, what, body));
  // `sized`: the arrays its shapes describe in the file, before anyone sizes anything by them.
  const uint64_t room = file_bytes - 16 - header_bytes;  // for the arrays and the checksum
  if (sized && (room < 8 || *body > room - 8))
    return absl::DataLossError(absl::StrCat(
        what, " is truncated: ", file_bytes, " bytes, its header describes ", *body,
        " bytes of arrays after its ", 16 + header_bytes, " and an 8-byte checksum"));
  *header_end = 16 + header_bytes;
  return header;
}

absl::StatusOr<uint64_t> OpenForRead(const std::string& path, ScopedFd* fd) {
  fd->fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd->fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("no checkpoint ", path));
    return FileError("open", path, errno);
  }
  struct stat st;
  if (fstat(fd->fd, &st) != 0) return FileError("fstat", path, errno);
  return static_cast<uint64_t>(st.st_size);
}

// The header of the file at path (ReadHeaderFd); *file_bytes its size.
absl::StatusOr<StateHeader> ReadHeaderAt(const std::string& path, uint64_t* file_bytes,
                                         bool sized) {
  ScopedFd fd;
  ASSIGN_OR_RETURN(uint64_t size, OpenForRead(path, &fd));
  *file_bytes = size;
  uint64_t header_end = 0;
  uint64_t body = 0;
  return ReadHeaderFd(fd.fd, path, size, &header_end, &body, sized);
}

// Verifies an open checkpoint file: its header, that its size is what the header describes, and
// the checksum of everything before the trailer. *header_end: where the arrays start.
absl::StatusOr<StateHeader> VerifyFd(int fd, const std::string& path, uint64_t size,
                                     uint64_t* header_end) {
  uint64_t body = 0;
  ASSIGN_OR_RETURN(StateHeader header, ReadHeaderFd(fd, path, size, header_end, &body));
  const uint64_t want = *header_end + body + 8;
  if (size != want)
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " is ",
                                            size < want ? "truncated" : "too long", ": ", size,
                                            " bytes, its header describes ", want));
  Checksum64 sum;
  const size_t chunk = static_cast<size_t>(std::min<uint64_t>(kIoChunk, size - 8));
  std::unique_ptr<char[]> buf(new char[std::max<size_t>(chunk, 1)]);
  for (uint64_t off = 0; off < size - 8;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk, size - 8 - off));
    RETURN_IF_ERROR(ReadAt(fd, buf.get(), n, off, path));
    sum.Update(buf.get(), n);
    off += n;
  }
  uint64_t stored = 0;
  RETURN_IF_ERROR(ReadAt(fd, &stored, 8, size - 8, path));
  RETURN_IF_ERROR(CheckDigest(stored, sum.Digest(), absl::StrCat("checkpoint ", path)));
  return header;
}

// ---- Bytes in memory ----

// The header in `text`, of a checkpoint of `total` bytes, whose size must be the one the
// header describes (16 + header + arrays + 8).
absl::StatusOr<StateHeader> HeaderOfText(const char* text, uint64_t header_bytes,
                                         uint64_t total, const std::string& what) {
  uint64_t body = 0;
  ASSIGN_OR_RETURN(StateHeader header, DecodeHeaderText(text, header_bytes, what, &body));
  uint64_t want = 24 + header_bytes;  // no overflow: header_bytes <= total - 24
  const bool over = __builtin_add_overflow(want, body, &want);
  if (over || total != want)
    return absl::DataLossError(absl::StrCat(
        what, " is ", over || total < want ? "truncated" : "too long", ": ", total,
        " bytes, its header describes ", over ? "more than 2^64" : absl::StrCat(want)));
  return header;
}

}  // namespace

bool operator==(const StateParam& a, const StateParam& b) {
  return a.name == b.name && a.shape == b.shape && a.grad_dtype == b.grad_dtype;
}

bool operator==(const StateHeader::Param& a, const StateHeader::Param& b) {
  return a.spec == b.spec && a.col_steps == b.col_steps;
}

bool operator==(const StateHeader& a, const StateHeader& b) {
  return a.session_name == b.session_name && a.rank == b.rank && a.last_step == b.last_step &&
         a.version == b.version && a.owner_uid == b.owner_uid && a.params == b.params;
}

// CheckpointHeader: 1 session_name (string), 2 rank (int32), 3 last_step (int64), 4 version
// (int64), 5 params (repeated Param), 6 owner_uid (optional uint32).
std::string EncodeStateHeader(const StateHeader& header) {
  std::string out;
  if (!header.session_name.empty()) PutLength(1, header.session_name, &out);
  PutInt(2, header.rank, &out);
  PutInt(3, header.last_step, &out);
  PutInt(4, header.version, &out);
  for (const StateHeader::Param& p : header.params) {
    std::string param;
    PutLength(1, EncodeParamSpec(p.spec), &param);
    PutPacked(2, p.col_steps, &param);
    PutLength(5, param, &out);
  }
  if (header.owner_uid.has_value()) {  // present: written even when 0
    PutKey(6, kVarint, &out);
    PutVarint(*header.owner_uid, &out);
  }
  return out;
}

absl::StatusOr<StateHeader> DecodeStateHeader(const void* data, size_t size) {
  const uint8_t* begin = static_cast<const uint8_t*>(data);
  WireReader r{begin, begin, begin + size, "CheckpointHeader"};
  StateHeader header;
  while (!r.done()) {
    uint32_t type = 0;
    uint64_t v = 0;
    RETURN_IF_ERROR(r.Key(&type));
    if (r.field == 1 && type == kLength) {
      RETURN_IF_ERROR(r.String(&header.session_name));
    } else if (r.field >= 2 && r.field <= 4 && type == kVarint) {
      RETURN_IF_ERROR(r.Varint(&v));
      if (r.field == 2) header.rank = static_cast<int32_t>(static_cast<uint32_t>(v));
      if (r.field == 3) header.last_step = static_cast<int64_t>(v);
      if (r.field == 4) header.version = static_cast<int64_t>(v);
    } else if (r.field == 5 && type == kLength) {
      WireReader param{};
      RETURN_IF_ERROR(r.Length("CheckpointHeader.Param", &param));
      RETURN_IF_ERROR(DecodeParam(param, &header.params.emplace_back()));
    } else if (r.field == 6 && type == kVarint) {
      RETURN_IF_ERROR(r.Varint(&v));
      header.owner_uid = static_cast<uint32_t>(v);  // a uint32: the low 32 bits
    } else {
      RETURN_IF_ERROR(r.Skip(type));
    }
  }
  return header;
}

absl::StatusOr<int64_t> CheckpointParamNumel(const StateParam& p) {
  if (p.shape.empty() || p.shape.size() > 8)
    return absl::DataLossError(absl::StrCat("parameter '", p.name, "': ", p.shape.size(),
                                            " dimensions, not 1 to 8"));
  // The leading dimension may be 0, as a session's (a rank's share of no rows).
  int64_t numel = 1;
  for (size_t i = 0; i < p.shape.size(); ++i) {
    const int64_t d = p.shape[i], least = i == 0 ? 0 : 1;
    if (d < least || d > (int64_t{1} << 40))
      return absl::DataLossError(absl::StrCat("parameter '", p.name, "': dimension ", d,
                                              " is outside [", least, ", 2^40]"));
    // numel * 16 (its four fp32 arrays) must fit too: numel <= INT64_MAX / 16.
    if (__builtin_mul_overflow(numel, d, &numel) || numel > INT64_MAX / 16)
      return absl::DataLossError(
          absl::StrCat("parameter '", p.name, "': its shape's product overflows"));
  }
  return numel;
}

namespace {

// The bytes of the arrays a header describes (4 x numel fp32 a parameter): DataLoss naming the
// parameter when a shape is out of range or the sum overflows.
absl::StatusOr<uint64_t> CheckpointBodyBytes(const StateHeader& header) {
  uint64_t body = 0;
  for (const StateHeader::Param& p : header.params) {
    ASSIGN_OR_RETURN(int64_t numel, CheckpointParamNumel(p.spec));
    const uint64_t bytes = static_cast<uint64_t>(numel) * 4 * sizeof(float);  // no overflow
    if (__builtin_add_overflow(body, bytes, &body))
      return absl::DataLossError(
          absl::StrCat("parameter '", p.spec.name, "': the arrays' bytes overflow"));
  }
  return body;
}

}  // namespace

absl::StatusOr<CheckpointWritten> WriteCheckpoint(const std::string& path,
                                                  const StateHeader& header,
                                                  const std::vector<CheckpointArrays>& arrays) {
  // The format's one statement is CheckpointExport's: its runs go to the file as they lie.
  CheckpointExport bytes(header, arrays);
  RETURN_IF_ERROR(bytes.status());
  ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> file, AtomicFileWriter::Open(path, 0600));
  for (;;) {
    const auto [at, n] = bytes.NextRun(UINT64_MAX);
    if (n == 0) break;
    RETURN_IF_ERROR(file->Append(at, n));
  }
  RETURN_IF_ERROR(file->Commit());
  CheckpointWritten out;
  out.path = path;
  out.bytes = bytes.total();
  out.checksum = bytes.digest();
  return out;
}

absl::StatusOr<StateHeader> ReadCheckpointHeader(const std::string& path, uint64_t* file_bytes) {
  return ReadHeaderAt(path, file_bytes, /*sized=*/true);
}

absl::StatusOr<StateHeader> PeekCheckpointHeader(const std::string& path, uint64_t* file_bytes) {
  return ReadHeaderAt(path, file_bytes, /*sized=*/false);
}

absl::Status ReadCheckpointArrays(const std::string& path, const StateHeader& expected,
                                  const std::vector<CheckpointArrays>& arrays) {
  ScopedFd fd;
  ASSIGN_OR_RETURN(uint64_t size, OpenForRead(path, &fd));
  uint64_t header_end = 0;
  // Pass 1: the size and the checksum.
  ASSIGN_OR_RETURN(StateHeader header, VerifyFd(fd.fd, path, size, &header_end));
  if (header != expected)
    return absl::AbortedError(absl::StrCat("checkpoint ", path, " changed while it was read"));
  RETURN_IF_ERROR(CheckArrays(header, arrays, absl::StrCat("checkpoint ", path)));
  // Pass 2: the arrays (same open file, so the same bytes).
  uint64_t off = header_end;
  for (const CheckpointArrays& a : arrays) {
    for (float* x : {a.master, a.m, a.v, a.acc}) {
      RETURN_IF_ERROR(ReadAt(fd.fd, x, a.numel * sizeof(float), off, path));
      off += a.numel * sizeof(float);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<StateHeader> VerifyCheckpointFd(int fd, const std::string& path, uint64_t size) {
  uint64_t header_end = 0;
  return VerifyFd(fd, path, size, &header_end);
}

absl::StatusOr<uint64_t> ReadCheckpointBytes(const std::string& path, uint64_t offset, void* dst,
                                             uint64_t capacity, uint64_t* file_bytes) {
  ScopedFd fd;
  ASSIGN_OR_RETURN(uint64_t size, OpenForRead(path, &fd));
  *file_bytes = size;
  if (offset > size)
    return absl::InvalidArgumentError(
        absl::StrCat("offset: ", offset, " is beyond the checkpoint's ", size, " bytes"));
  const uint64_t n = std::min(capacity, size - offset);
  RETURN_IF_ERROR(ReadAt(fd.fd, dst, n, offset, path));
  return n;
}

absl::Status MatchCheckpointParams(const StateHeader& header, const std::vector<StateParam>& specs,
                                   const std::string& what) {
  const size_t colon = what.find(": ");
  const std::string field = what.substr(0, colon), name = what.substr(colon + 2);
  if (header.params.size() != specs.size())
    return absl::FailedPreconditionError(absl::StrCat(
        what, " has ", header.params.size(), " parameters, the session registered ",
        specs.size()));
  for (size_t i = 0; i < specs.size(); ++i) {
    const StateHeader::Param& hp = header.params[i];
    const int64_t cols = specs[i].shape.empty() ? 1 : specs[i].shape.back();
    if (hp.spec != specs[i])
      return absl::FailedPreconditionError(absl::StrCat(
          field, ": parameter ", i, " of ", name, " is '", hp.spec.name,
          "' with another name, shape or dtype than the session's '", specs[i].name, "'"));
    if (static_cast<int64_t>(hp.col_steps.size()) != cols)
      return absl::FailedPreconditionError(absl::StrCat(
          field, ": parameter ", i, " of ", name, " ('", hp.spec.name, "') has ",
          hp.col_steps.size(), " column step counts for ", cols, " columns"));
  }
  return absl::OkStatus();
}

absl::StatusOr<StateHeader> VerifyCheckpointBytes(
    const void* data, uint64_t size, const std::string& what,
    const std::function<absl::Status(const StateHeader&)>& judge) {
  const char* p = static_cast<const char*>(data);
  if (size < 24)
    return absl::DataLossError(
        absl::StrCat(what, " is truncated: ", size, " bytes, not even a header"));
  ASSIGN_OR_RETURN(uint64_t header_bytes, HeaderLength(p, size, 8, what));
  ASSIGN_OR_RETURN(StateHeader header, HeaderOfText(p + 16, header_bytes, size, what));
  if (judge) RETURN_IF_ERROR(judge(header));
  Checksum64 sum;
  sum.Update(p, size - 8);
  uint64_t stored = 0;
  memcpy(&stored, p + size - 8, 8);
  RETURN_IF_ERROR(CheckDigest(stored, sum.Digest(), what));
  return header;
}

CheckpointExport::CheckpointExport(const StateHeader& header,
                                   std::vector<CheckpointArrays> arrays) {
  status_ = CheckArrays(header, arrays, "the state's export");
  if (!status_.ok()) return;
  const std::string text = EncodeStateHeader(header);
  const uint64_t header_bytes = text.size();
  prefix_.assign(kMagic, 8);
  prefix_.append(reinterpret_cast<const char*>(&header_bytes), 8);
  prefix_.append(text);
  pieces_.push_back({prefix_.data(), prefix_.size()});
  total_ = prefix_.size() + 8;
  for (const CheckpointArrays& a : arrays)
    for (const float* x : {a.master, a.m, a.v, a.acc}) {
      pieces_.push_back({reinterpret_cast<const char*>(x), a.numel * sizeof(float)});
      total_ += a.numel * sizeof(float);
    }
  pieces_.push_back({reinterpret_cast<const char*>(&digest_), 8});
}

std::pair<const char*, uint64_t> CheckpointExport::NextRun(uint64_t max) {
  while (piece_ < pieces_.size() && in_piece_ == pieces_[piece_].bytes) {  // empty arrays
    ++piece_;
    in_piece_ = 0;
  }
  if (piece_ == pieces_.size() || max == 0) return {nullptr, 0};
  const Piece& p = pieces_[piece_];
  const bool trailer = piece_ + 1 == pieces_.size();
  if (trailer && in_piece_ == 0) digest_ = sum_.Digest();  // everything before it is out
  // At most kCacheRun: whoever reads the run after it was checksummed finds it in L2.
  const uint64_t k = std::min({max, p.bytes - in_piece_, kCacheRun});
  const char* at = p.data + in_piece_;
  if (!trailer) sum_.Update(at, k);
  in_piece_ += k;
  done_ += k;
  return {at, k};
}

uint64_t CheckpointExport::Next(void* dst, uint64_t capacity) {
  char* out = static_cast<char*>(dst);
  uint64_t n = 0;
  for (;;) {
    const auto [at, k] = NextRun(capacity - n);
    if (k == 0) return n;
    memcpy(out + n, at, k);
    n += k;
  }
}

CheckpointImport::CheckpointImport(uint64_t total, std::string what)
    : total_(total), what_(std::move(what)) {}

absl::Status CheckpointImport::TakePrefix(const Accept& accept) {
  if (prefix_.size() == 16) {
    ASSIGN_OR_RETURN(header_bytes_, HeaderLength(prefix_.data(), total_, 8, what_));
    if (header_bytes_ > 0) return absl::OkStatus();  // the header's bytes come next
  }
  if (prefix_.size() < 16 + header_bytes_) return absl::OkStatus();
  ASSIGN_OR_RETURN(header_, HeaderOfText(prefix_.data() + 16, header_bytes_, total_, what_));
  ASSIGN_OR_RETURN(std::vector<CheckpointArrays> arrays, accept(header_));
  RETURN_IF_ERROR(CheckArrays(header_, arrays, what_));
  for (const CheckpointArrays& a : arrays)
    for (float* x : {a.master, a.m, a.v, a.acc})
      pieces_.emplace_back(reinterpret_cast<char*>(x), a.numel * sizeof(float));
  have_header_ = true;
  std::string().swap(prefix_);
  return absl::OkStatus();
}

absl::StatusOr<bool> CheckpointImport::Take(const void* src, uint64_t n, const Accept& accept) {
  const char* in = static_cast<const char*>(src);
  if (total_ < 24)
    return absl::DataLossError(
        absl::StrCat(what_, " is truncated: ", total_, " bytes, not even a header"));
  if (n > total_ - done_)
    return absl::InvalidArgumentError(absl::StrCat("length: ", n, " bytes at ", done_,
                                                   " pass the state's ", total_));
  while (n > 0) {
    uint64_t k = 0;
    if (!have_header_) {
      // The prefix, kept whole: the first 16 bytes, then the header they announce (never
      // more than has arrived).
      const uint64_t want = prefix_.size() < 16 ? 16 : 16 + header_bytes_;
      k = std::min(n, want - prefix_.size());
      prefix_.append(in, k);
      sum_.Update(in, k);
      done_ += k;
      if (prefix_.size() == want) RETURN_IF_ERROR(TakePrefix(accept));
    } else if (piece_ < pieces_.size()) {
      auto& [data, bytes] = pieces_[piece_];
      k = std::min({n, bytes - in_piece_, kCacheRun});
      if (k > 0) {  // (an array of no rows has no data)
        memcpy(data + in_piece_, in, k);
        writing_ = true;
      }
      sum_.Update(in, k);
      done_ += k;
      in_piece_ += k;
      if (in_piece_ == bytes) {
        ++piece_;
        in_piece_ = 0;
      }
    } else {
      k = std::min<uint64_t>(n, 8 - trailer_n_);
      memcpy(trailer_ + trailer_n_, in, k);
      trailer_n_ += k;
      done_ += k;
    }
    in += k;
    n -= k;
  }
  if (done_ < total_) return false;
  uint64_t stored = 0;
  memcpy(&stored, trailer_, 8);
  RETURN_IF_ERROR(CheckDigest(stored, sum_.Digest(), what_));
  return true;
}

}  // namespace stallfree
