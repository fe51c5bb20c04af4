// The session record: what a restarted daemon needs to take a session back from its memfds
// (SessionManager::Adopt), kept in the first pages of the session's state memfd, before the
// four fp32 arrays (and the work journal after them, session_journal.h), by the daemon that
// holds the session. The session's process holds that memfd too, so the record outlives the
// daemon with the state it describes.
//
// Two parts, each with its own checksum (Checksum64 of its bytes before it):
//  - The identity, written when the session registers and again when it attaches and at every
//    adoption: who owns it (the attached process's uid; the SHA-256 of its token, never the
//    token), its generation (1 at the first attach, +1 at each adoption: a stale copy of the
//    session's descriptors cannot take it back; 0 once the daemon closed the session), its name
//    and rank, and its registration (the
//    RegisterParams request's parameters, dtype and slots) with the layout it gave (total
//    elements, state stride, region and state bytes), so that a daemon whose layout rules
//    differ refuses the session instead of misreading it.
//  - Two commit slots, written alternately (the older one, with the next sequence number), so
//    that a crash while one is written leaves the other whole. A commit holds the control state
//    that the arrays do not: the version and step, pushes since the last Update, the parameter
//    slot and dtype of the newest version, the accumulator's state, the per-column step counts,
//    and `busy`: the work method that was changing the arrays when the commit was written (set
//    before it starts, cleared by the commit after it). A session whose newest commit is busy
//    died in the middle of changing its state: a journaled Update, push or handover (the commit
//    says so) is finished from the work journal by the daemon that adopts it; any other busy
//    state may be torn, and it is not adopted.
//
// Layout, little-endian, at byte `RecordOffset` of the state memfd, RecordBytes long:
//   identity:  "SFSESS01" u32 format u32 bytes | u32 uid u32 rank u64 generation u64 adopt_nonce
//              u8[32] token_sha256 | u64 total_elems u64 state_stride u64 region_bytes
//              u64 state_bytes | u32 param_dtype u32 param_slots u32 nparams
//              per parameter: u32 name_bytes, name, u32 grad_dtype, u32 ndims, i64 dims[ndims]
//              u32 name_bytes, name | u64 checksum
//   then, 8-aligned, two slots of CommitBytes each:
//              u64 sequence (0: never written) u32 busy u32 flags i64 busy_step i64 version
//              i64 last_step i64 pushes_since_update i64 handovers u32 ready_slot u32 ready_dtype
//              i64 col_steps[total columns] | u64 checksum
#pragma once

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/state_format.h"

namespace stallfree {

// One registered parameter, as RegisterParams named it: the state format's parameter, which a
// checkpoint's header holds too.
using RecordParam = StateParam;

// The record's format: 3 since the work journal keeps handovers (its plan's room holds a
// handover's plan: JournalGeometryFor); a daemon reads format 2 as well, a state of the daemon
// before that, and keeps its journal as it was laid out (its handovers then run unjournaled).
inline constexpr uint32_t kRecordFormat = 3;
inline constexpr uint32_t kRecordFormatNoHandovers = 2;

struct SessionIdentity {
  // The record's format (kRecordFormat for a new session; an adopted one keeps its own).
  uint32_t format = kRecordFormat;
  uid_t uid = static_cast<uid_t>(-1);  // -1 until the session's process attached
  int32_t rank = 0;
  uint64_t generation = 0;
  // The nonce of the ADOPT that gave this generation (0: none): the same process retrying an
  // adoption whose answer it never got presents it with the generation before.
  uint64_t adopt_nonce = 0;
  std::array<uint8_t, 32> token_sha256{};
  std::string name;
  // The registration, and the layout it gave.
  uint32_t param_dtype = 0;  // RegisterParamsRequest.param_dtype
  uint32_t param_slots = 0;  // RegisterParamsRequest.param_slots (0: the layout of before)
  std::vector<RecordParam> params;
  uint64_t total_elems = 0, state_stride = 0, region_bytes = 0, state_bytes = 0;
};

// The work method a commit says was changing the arrays (SessionCommit::busy).
enum class RecordBusy : uint32_t {
  kNone = 0,
  kLoad = 1,      // LoadParams
  kPush = 2,      // Accumulate
  kUpdate = 3,    // Update
  kRestore = 4,   // Restore or ImportState
  kHandover = 5,  // HandOver (MigrateColumns), exchanging columns between staging and arrays
};
const char* RecordBusyName(RecordBusy busy);

struct SessionCommit {
  uint64_t sequence = 0;
  RecordBusy busy = RecordBusy::kNone;
  int64_t busy_step = 0;  // the step of the busy Update or push, when it has one
  bool updated_once = false;
  bool has_state = false;
  bool acc_stale = false;  // OffloadSession::PrepareAccumulator
  // A busy commit's operation has its entry in the work journal (session_journal.h): a daemon
  // that adopts the session finishes it. Without one (a plan too large for the journal, an
  // inline push's bytes that died with the daemon) a busy commit is a torn state.
  bool journaled = false;
  int64_t version = 0;
  int64_t last_step = 0;
  int64_t pushes_since_update = 0;
  // HandOver calls the session has finished, ever: a client whose handover's answer was lost
  // tells by it whether the handover happened.
  int64_t handovers = 0;
  uint32_t ready_slot = 0;
  uint32_t ready_dtype = 0;  // v1::DType
  std::vector<std::vector<int64_t>> col_steps;  // per parameter, per column
};

// The identity of the record at the start of file `fd` (`size` bytes), read with pread: no
// mapping, so that a descriptor's claims are judged before anything of it is mapped or
// populated. DataLoss as ReadIdentity, or naming the failed read.
absl::StatusOr<SessionIdentity> ReadIdentityFromFd(int fd, uint64_t size);

// SHA-256 of a session token.
std::array<uint8_t, 32> TokenDigest(const std::string& token);

// The longest session name a record holds (OpenSession's limit).
inline constexpr size_t kRecordMaxName = 256;
// The record's size for a session of these parameters (identity's names and shapes, with room
// for a name of kRecordMaxName bytes; commits' columns), a multiple of 8.
uint64_t RecordBytes(const std::vector<RecordParam>& params);

// A session's record in memory `data` of `size` bytes (RecordBytes). Once this object wrote the
// identity (its first WriteIdentity, before any other thread uses it), the identity and the
// commits may be written from two threads at once: they are different bytes, and the commits
// do not read the identity again. Each of them from one thread at a time.
class SessionRecord {
 public:
  SessionRecord(uint8_t* data, uint64_t size) : data_(data), size_(size) {}

  // Writes the identity; the commit slots' place follows from it (written once per session
  // with the same parameters: later writes change only the uid, generation, adoption nonce and
  // token digest).
  absl::Status WriteIdentity(const SessionIdentity& id);
  // Reads and verifies the identity: DataLoss naming the fault (magic, format, size, checksum).
  absl::StatusOr<SessionIdentity> ReadIdentity() const;
  // Writes `commit` with the next sequence number into the older slot, in place; returns that
  // number. Its column steps are *col_steps when given (the caller's own, not copied), else
  // commit.col_steps; they must have the identity's parameters' columns.
  absl::StatusOr<uint64_t> Commit(const SessionCommit& commit,
                                  const std::vector<std::vector<int64_t>>* col_steps = nullptr);
  // The newest whole commit: DataLoss if neither slot checks out, NotFound if none was written.
  absl::StatusOr<SessionCommit> NewestCommit() const;

  // A commit slot's bytes for parameters of `total_cols` columns in all (the layout above).
  static uint64_t CommitBytes(uint64_t total_cols) { return 64 + 8 * total_cols + 8; }

 private:
  // The identity's size and its parameters' columns: what WriteIdentity wrote, else read from
  // the bytes (ReadIdentity checks them).
  absl::Status Locate(uint64_t* identity_bytes, std::vector<int64_t>* cols) const;

  uint8_t* data_;
  uint64_t size_;
  uint64_t next_sequence_ = 0;  // 0: not known yet (read from the slots at the first Commit)
  uint64_t identity_bytes_ = 0;  // set by WriteIdentity (the same for every write of a session)
  std::vector<int64_t> cols_;
};

}  // namespace stallfree
