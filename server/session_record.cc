#include "server/session_record.h"

#include <openssl/sha.h>

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/le_bytes.h"

namespace stallfree {
namespace {

constexpr char kMagic[8] = {'S', 'F', 'S', 'E', 'S', 'S', '0', '1'};
// 2: commits count the handovers; 3: the work journal keeps handovers (its plan's room grew:
// SessionIdentity::format says which journal a state has).
static_assert(kRecordFormat == 3, "the formats this daemon reads: 2 and kRecordFormat");
constexpr uint32_t kMaxParams = 1 << 20;

uint64_t Align8(uint64_t n) { return (n + 7) & ~uint64_t{7}; }

uint64_t Digest(const uint8_t* p, uint64_t n) {
  Checksum64 c;
  c.Update(p, n);
  return c.Digest();
}

std::vector<uint8_t> EncodeIdentity(const SessionIdentity& id) {
  LeWriter w;
  w.Bytes(kMagic, sizeof kMagic);
  w.Put<uint32_t>(id.format);
  w.Put<uint32_t>(0);  // the identity's bytes, set below
  w.Put<uint32_t>(static_cast<uint32_t>(id.uid));
  w.Put<int32_t>(id.rank);
  w.Put<uint64_t>(id.generation);
  w.Put<uint64_t>(id.adopt_nonce);
  w.Bytes(id.token_sha256.data(), id.token_sha256.size());
  w.Put<uint64_t>(id.total_elems);
  w.Put<uint64_t>(id.state_stride);
  w.Put<uint64_t>(id.region_bytes);
  w.Put<uint64_t>(id.state_bytes);
  w.Put<uint32_t>(id.param_dtype);
  w.Put<uint32_t>(id.param_slots);
  w.Put<uint32_t>(static_cast<uint32_t>(id.params.size()));
  for (const RecordParam& p : id.params) {
    w.Str(p.name);
    w.Put<uint32_t>(p.grad_dtype);
    w.Put<uint32_t>(static_cast<uint32_t>(p.shape.size()));
    for (int64_t d : p.shape) w.Put<int64_t>(d);
  }
  w.Str(id.name);
  while (w.out.size() % 8 != 0) w.out.push_back(0);
  const uint32_t bytes = static_cast<uint32_t>(w.out.size() + 8);
  memcpy(w.out.data() + 12, &bytes, 4);
  w.Put<uint64_t>(Digest(w.out.data(), w.out.size()));
  return w.out;
}

int64_t Columns(const std::vector<int64_t>& shape) { return shape.empty() ? 0 : shape.back(); }

}  // namespace

const char* RecordBusyName(RecordBusy busy) {
  switch (busy) {
    case RecordBusy::kNone: return "nothing";
    case RecordBusy::kLoad: return "a LoadParams";
    case RecordBusy::kPush: return "a push";
    case RecordBusy::kUpdate: return "an Update";
    case RecordBusy::kRestore: return "a Restore or ImportState";
    case RecordBusy::kHandover: return "a handover (MigrateColumns)";
  }
  return "an unknown operation";
}

std::array<uint8_t, 32> TokenDigest(const std::string& token) {
  std::array<uint8_t, 32> out;
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), out.data());
  return out;
}

absl::StatusOr<SessionIdentity> ReadIdentityFromFd(int fd, uint64_t size) {
  auto read_at = [&](uint8_t* dst, uint64_t n, uint64_t at) -> absl::Status {
    uint64_t done = 0;
    while (done < n) {
      const ssize_t r = pread(fd, dst + done, n - done, static_cast<off_t>(at + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        return absl::DataLossError(absl::StrCat("the session record could not be read (",
                                                r < 0 ? strerror(errno) : "end of file", ")"));
      done += static_cast<uint64_t>(r);
    }
    return absl::OkStatus();
  };
  uint8_t head[16];
  if (size < sizeof head)
    return absl::DataLossError(absl::StrCat("the state is ", size, " bytes: no session record"));
  if (absl::Status st = read_at(head, sizeof head, 0); !st.ok()) return st;
  uint32_t bytes;
  memcpy(&bytes, head + 12, 4);
  // At most the record of kMaxParams parameters of 8 dimensions and long names.
  constexpr uint64_t kMaxIdentity = uint64_t{64} << 20;
  if (bytes < 24 || bytes > size || bytes > kMaxIdentity)
    return absl::DataLossError(absl::StrCat("the session record's identity claims ", bytes,
                                            " bytes of ", size));
  std::vector<uint8_t> buf(bytes);
  if (absl::Status st = read_at(buf.data(), bytes, 0); !st.ok()) return st;
  return SessionRecord(buf.data(), buf.size()).ReadIdentity();
}

uint64_t RecordBytes(const std::vector<RecordParam>& params) {
  SessionIdentity id;
  id.params = params;
  id.name.assign(kRecordMaxName, ' ');
  int64_t cols = 0;
  for (const RecordParam& p : params) cols += Columns(p.shape);
  return Align8(EncodeIdentity(id).size()) +
         2 * SessionRecord::CommitBytes(static_cast<uint64_t>(cols));
}

absl::Status SessionRecord::WriteIdentity(const SessionIdentity& id) {
  if (id.name.size() > kRecordMaxName || RecordBytes(id.params) > size_)
    return absl::InternalError(absl::StrCat("the session record needs ", RecordBytes(id.params),
                                            " bytes, it has ", size_));
  const std::vector<uint8_t> bytes = EncodeIdentity(id);
  if (identity_bytes_ != 0 && identity_bytes_ != bytes.size())
    return absl::InternalError("the session record's identity changed its size");
  memcpy(data_, bytes.data(), bytes.size());
  if (identity_bytes_ == 0) {  // set once: later writes (other threads) leave them as they are
    for (const RecordParam& p : id.params) cols_.push_back(Columns(p.shape));
    identity_bytes_ = bytes.size();
  }
  return absl::OkStatus();
}

absl::StatusOr<SessionIdentity> SessionRecord::ReadIdentity() const {
  auto loss = [](const std::string& what) {
    return absl::DataLossError(absl::StrCat("the session record's identity ", what));
  };
  if (size_ < 24 || memcmp(data_, kMagic, sizeof kMagic) != 0)
    return loss("is missing (no stallfree session record at the end of this state)");
  LeReader r(data_ + 8, size_ - 8);
  const uint32_t format = r.Get<uint32_t>();
  const uint32_t bytes = r.Get<uint32_t>();
  if (format != kRecordFormat && format != kRecordFormatNoHandovers)
    return loss(absl::StrCat("has format ", format, "; this stallfreed reads formats ",
                             kRecordFormatNoHandovers, " and ", kRecordFormat));
  if (bytes < 24 || bytes > size_ || bytes % 8 != 0)
    return loss(absl::StrCat("claims ", bytes, " bytes of ", size_));
  uint64_t sum;
  memcpy(&sum, data_ + bytes - 8, 8);
  if (sum != Digest(data_, bytes - 8)) return loss("fails its checksum");
  r = LeReader(data_ + 16, bytes - 24);
  SessionIdentity id;
  id.format = format;
  id.uid = static_cast<uid_t>(r.Get<uint32_t>());
  id.rank = r.Get<int32_t>();
  id.generation = r.Get<uint64_t>();
  id.adopt_nonce = r.Get<uint64_t>();
  r.Bytes(id.token_sha256.data(), id.token_sha256.size());
  id.total_elems = r.Get<uint64_t>();
  id.state_stride = r.Get<uint64_t>();
  id.region_bytes = r.Get<uint64_t>();
  id.state_bytes = r.Get<uint64_t>();
  id.param_dtype = r.Get<uint32_t>();
  id.param_slots = r.Get<uint32_t>();
  const uint32_t n = r.Get<uint32_t>();
  if (!r.ok() || n > kMaxParams) return loss("has a bad parameter count");
  id.params.resize(n);
  for (RecordParam& p : id.params) {
    r.Str(&p.name, 1024);
    p.grad_dtype = r.Get<uint32_t>();
    const uint32_t dims = r.Get<uint32_t>();
    if (!r.ok() || dims > 8) return loss("has a bad parameter");
    for (uint32_t d = 0; d < dims; ++d) p.shape.push_back(r.Get<int64_t>());
  }
  r.Str(&id.name, kRecordMaxName);
  if (!r.ok()) return loss("is cut short");
  return id;
}

absl::Status SessionRecord::Locate(uint64_t* identity_bytes, std::vector<int64_t>* cols) const {
  if (identity_bytes_ != 0) {
    *identity_bytes = identity_bytes_;
    *cols = cols_;
    return absl::OkStatus();
  }
  absl::StatusOr<SessionIdentity> id = ReadIdentity();
  if (!id.ok()) return id.status();
  memcpy(identity_bytes, data_ + 12, 4);
  *identity_bytes &= 0xffffffffu;
  cols->clear();
  for (const RecordParam& p : id->params) cols->push_back(Columns(p.shape));
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> SessionRecord::Commit(
    const SessionCommit& c, const std::vector<std::vector<int64_t>>* col_steps) {
  const std::vector<std::vector<int64_t>>& steps_of = col_steps ? *col_steps : c.col_steps;
  uint64_t at = 0;
  std::vector<int64_t> cols;
  if (absl::Status st = Locate(&at, &cols); !st.ok()) return st;
  int64_t total = 0;
  if (steps_of.size() != cols.size())
    return absl::InternalError("the commit's column steps do not match the identity");
  for (size_t i = 0; i < cols.size(); ++i) {
    if (static_cast<int64_t>(steps_of[i].size()) != cols[i])
      return absl::InternalError("the commit's column steps do not match the identity");
    total += cols[i];
  }
  const uint64_t slot = CommitBytes(static_cast<uint64_t>(total));
  if (at + 2 * slot > size_) return absl::InternalError("the session record is too small");
  if (next_sequence_ == 0) {
    absl::StatusOr<SessionCommit> newest = NewestCommit();
    next_sequence_ = newest.ok() ? newest->sequence + 1 : 1;
  }
  const uint64_t seq = next_sequence_++;
  LeWriter w;
  w.Put<uint64_t>(seq);
  w.Put<uint32_t>(static_cast<uint32_t>(c.busy));
  w.Put<uint32_t>((c.updated_once ? 1u : 0u) | (c.has_state ? 2u : 0u) | (c.acc_stale ? 4u : 0u) |
                  (c.journaled ? 8u : 0u));
  w.Put<int64_t>(c.busy_step);
  w.Put<int64_t>(c.version);
  w.Put<int64_t>(c.last_step);
  w.Put<int64_t>(c.pushes_since_update);
  w.Put<int64_t>(c.handovers);
  w.Put<uint32_t>(c.ready_slot);
  w.Put<uint32_t>(c.ready_dtype);
  // Slot 0 takes the odd sequence numbers, slot 1 the even ones: the other slot keeps the
  // previous commit whole while this one is written, in place (a 1-D parameter has a step count
  // per element: no copies).
  uint8_t* p = data_ + at + (seq % 2 == 1 ? 0 : slot);
  memcpy(p, w.out.data(), w.out.size());
  uint64_t off = w.out.size();
  for (const std::vector<int64_t>& steps : steps_of) {
    if (!steps.empty()) memcpy(p + off, steps.data(), steps.size() * 8);
    off += steps.size() * 8;
  }
  const uint64_t sum = Digest(p, off);
  memcpy(p + off, &sum, 8);
  return seq;
}

absl::StatusOr<SessionCommit> SessionRecord::NewestCommit() const {
  uint64_t at = 0;
  std::vector<int64_t> cols;
  if (absl::Status st = Locate(&at, &cols); !st.ok()) return st;
  uint64_t total = 0;
  for (int64_t c : cols) total += static_cast<uint64_t>(c);
  const uint64_t slot = CommitBytes(total);
  if (at + 2 * slot > size_) return absl::DataLossError("the session record is cut short");
  bool any_written = false;
  absl::StatusOr<SessionCommit> best = absl::NotFoundError("the session record has no commit");
  for (int s = 0; s < 2; ++s) {
    const uint8_t* p = data_ + at + s * slot;
    uint64_t seq, sum;
    memcpy(&seq, p, 8);
    if (seq == 0) continue;
    any_written = true;
    memcpy(&sum, p + slot - 8, 8);
    if (sum != Digest(p, slot - 8)) continue;  // torn: the other slot has the one before
    if (best.ok() && best->sequence > seq) continue;
    LeReader r(p, slot - 8);
    SessionCommit c;
    c.sequence = r.Get<uint64_t>();
    c.busy = static_cast<RecordBusy>(r.Get<uint32_t>());
    const uint32_t flags = r.Get<uint32_t>();
    c.updated_once = flags & 1;
    c.has_state = flags & 2;
    c.acc_stale = flags & 4;
    c.journaled = flags & 8;
    c.busy_step = r.Get<int64_t>();
    c.version = r.Get<int64_t>();
    c.last_step = r.Get<int64_t>();
    c.pushes_since_update = r.Get<int64_t>();
    c.handovers = r.Get<int64_t>();
    c.ready_slot = r.Get<uint32_t>();
    c.ready_dtype = r.Get<uint32_t>();
    for (int64_t n : cols) {
      c.col_steps.emplace_back(static_cast<size_t>(n));
      r.Bytes(c.col_steps.back().data(), static_cast<uint64_t>(n) * 8);
    }
    best = std::move(c);
  }
  if (!best.ok() && any_written)
    return absl::DataLossError("neither of the session record's commits checks out");
  return best;
}

}  // namespace stallfree
