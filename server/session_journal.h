// The work journal: what lets a restarted daemon finish an Update, a push or a handover of
// columns that the daemon before it died in the middle of (SessionManager::Adopt), instead of
// refusing a torn state.
// It lives in the session's state memfd after the four fp32 arrays, so it outlives the daemon
// with them (session_record.h says why the memfd does).
//
// An operation (an Update, a push) runs over units: blocks of `unit` elements of the flat
// arrays (JournalGeometry), unit u covering elements [u * unit, (u + 1) * unit). Each unit
// is done by one worker, which keeps the unit's elements of the arrays the operation writes
// (master, m and v for an Update; the accumulator for a push) from before in a slot of its
// own until it has changed them, and finally sets the unit's bit in the done bitmap. Two ways:
// - copied first: the unit's elements are copied to the slot whole, then the slot's header
//   names the unit, then the work changes it (a push; an Update's unit that the work also
//   writes outside its kernels: one with handed-over columns landing in it);
// - in the kernels' pass (an Update): the header names the unit, and the CPU AdamW kernels
//   copy each vector's old values to a small ring in the slot and advance a mark in the header
//   (done so far, and the vector in flight) before they change it (kernels/undo_log.h). A copy
//   of the whole unit cost a fifth of the update's throughput (bench/optimizer_bench,
//   session_update_journaled_vs_without 0.76-0.78 at commit f6e1297): its 12 KiB fell out of L1
//   between units. The ring stays there. Consecutive units a worker takes run as one span (up
//   to 32): the header names the span's first unit and the mark counts from its start, so the
//   work's kernel calls are as long as without the journal (a call on 64 elements costs a sixth
//   of one on a 1024-element unit: optimizer_bench, adamw_columns_call_64_fraction_of_1024).
//
// After a crash at any instant, every unit is in one of three states: done (its bit is set: the
// arrays hold its result), in flight (named by a slot header, bit not set), or untouched. A unit
// in flight copied first has its old elements in the slot and anything in the arrays; one in
// the kernels' pass has its elements below the mark's `done` finished (a span's units before
// the one it stopped in too), the mark's window in the ring, and the rest untouched. Roll back
// the units in flight (RollBackTorn: the whole unit, or the window, and the span's units before
// it marked done) and run the operation again over the units not done (Run: a unit cut short in
// the kernels' pass from its `done` on, in the same slot): the result is the uninterrupted
// operation's, bit for bit, because every element computes from its own values only.
//
// The order that makes this hold (SIGKILL at any instruction; the memory is shared, so every
// store that retired is in it afterwards; x86's stores become visible in program order):
//   Begin: clear the slot headers and the bitmap, then write the operation (its sequence, the
//          record commit that announced it, its plan bytes, a checksum).
//   unit:  copy -> header (release) -> change the arrays -> done bit (release), or
//          header (done, no window) -> per vector: ring -> mark (release) -> change -> ...
//          -> done bit (release).
// An operation whose journal entry does not check out, or names another commit, never started
// its units: the arrays are as the commit before it left them.
//
// A handover swaps cells of the arrays with the staging area's: a swap keeps neither side's old
// values, so it runs as pieces of two phases instead (RunPieces): the piece's incoming cells
// saved in the slot, the header naming the piece (phase 1), the outgoing cells written to the
// staging area, the header's phase 2, the saved incoming cells written to the arrays, the done
// bit. A piece cut short is finished, not rolled back: in phase 1 the arrays are unchanged and
// the saved cells whole, in phase 2 the staging area is done. Its plan holds the answer too
// (the outgoing step counts), which stays there until the next journaled operation, so that a
// client whose answer died with a daemon gets it again (OffloadSession::HandOverAgain).
//
// Layout at the journal's offset, little-endian, JournalBytes long:
//   "SFJRNL01" u32 slots u32 unit | u64 units u64 plan_capacity
//   op:    u64 commit_sequence u32 kind u32 plan_bytes | plan[plan_capacity] | u64 checksum
//   u64 slot_header[slots] (kernels::UndoMark: unit + 1 in the low 43 bits, 0: none; the
//   window's length in the next 5, 31: copied whole when it went on from `done`; done + 1 in
//   the top 16, counted from the span's first unit; 0 there: copied first) |
//   u64 done[ceil(units / 64)]
//   (a handover's pieces: piece + 1 in the low 48 bits, its phase, 1 or 2, in the next 2) |
//   64-aligned: float slot_data[slots][3 * unit] (in the kernels' pass, its first
//   3 * kernels::kUndoRing floats are the ring: param's, m's, v's)
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace stallfree {

// The most elements a unit has: a multiple of 16 (64 bytes of fp32) and at most the CPU
// kernels' chunk, so that a unit's kernel call runs on the calling worker.
inline constexpr uint64_t kJournalMaxUnit = 1024;

// The journal's size and shape for a session of `total_elems` elements and `params`
// parameters: a pure function of them, so that a daemon that adopts the session finds the
// journal where the one that wrote it put it.
struct JournalGeometry {
  uint32_t slots = 0;          // workers that can run units at once
  uint64_t unit = 0;           // elements per unit (a multiple of 16, at most kJournalMaxUnit)
  uint64_t units = 0;          // ceil(total_elems / unit)
  uint64_t plan_capacity = 0;  // bytes of an operation's plan
  uint64_t bytes = 0;          // the whole journal, a multiple of 64
};
// `columns`: the parameters' columns in all (a handover's plan names up to a quarter of them).
JournalGeometry JournalGeometryFor(uint64_t total_elems, size_t params, uint64_t columns);

// Testing only: every unit of an operation waits this long half way through its work (0: none,
// the default), so that a test can stop the daemon inside an operation, with a unit half
// changed, at a point it chooses (stallfreed's --test_unit_delay_us).
void SetUnitDelayForTesting(int64_t microseconds);
// Testing only: each piece of a handover's exchange (RunPieces) waits this long between its two
// phases (stallfreed's --test_piece_delay_us).
void SetPieceDelayForTesting(int64_t microseconds);

// The operation a journal entry describes.
enum class JournalOp : uint32_t { kNone = 0, kUpdate = 1, kPush = 2, kHandover = 3 };

struct JournalEntry {
  uint64_t commit_sequence = 0;  // the record commit that announced it (busy)
  JournalOp kind = JournalOp::kNone;
  std::string plan;  // the operation's own encoding of its plan
};

class WorkJournal {
 public:
  // Over `data`, geometry.bytes of the state memfd (64-aligned).
  WorkJournal(uint8_t* data, const JournalGeometry& geometry) : data_(data), g_(geometry) {}

  // Writes the header of an empty journal (a new session).
  void Format();
  // DataLoss unless the header is this geometry's.
  absl::Status CheckHeader() const;

  // Starts an operation (see the order above). InvalidArgument if its plan does not fit
  // plan_capacity (the operation then runs without a journal entry: a crash inside it is not
  // recoverable, and the commit says so).
  absl::Status Begin(uint64_t commit_sequence, JournalOp kind, const std::string& plan);
  // The operation Begin wrote last: DataLoss if its checksum fails (Begin was cut short).
  absl::StatusOr<JournalEntry> Entry() const;
  // Forgets which units are done and which are in flight (an operation that must run again
  // whole, or one that runs without an entry).
  void ClearDone();

  // How a unit's elements from before are saved in its slot.
  enum class Saving {
    // By a copy of the whole unit before its work (at most 3 arrays; none when running a unit
    // again from its start gives its result anyway).
    kCopyFirst,
    // By the kernels as they change them, a vector at a time, in the same pass
    // (kernels/undo_log.h: the slot's header is the undo log's mark, the slot's data its ring).
    // The arrays are an AdamW's param, m and v, and the work writes them only through kernels
    // whose KeepsUndoLog() is true, in increasing order, each element once; a unit for which
    // `copy_first(u)` is true (the work also writes it otherwise) is copied first instead.
    kInKernels,
  };
  // Runs work(begin, end) over every unit of [0, elems) that is not done, in parallel on the
  // current task arena, each unit saved from `arrays` (each at least elems long) as `saving`
  // says and marked done after; a unit RollBackTorn found cut short in the kernels' pass goes on
  // from where it stopped (work(begin, end) then starts inside the unit). elems <= units * unit.
  // `skip(u)`, when given, leaves unit u out (nothing of it changes).
  void Run(uint64_t elems, const std::vector<float*>& arrays,
           const std::function<void(uint64_t, uint64_t)>& work,
           const std::function<bool(uint64_t)>& skip = nullptr,
           Saving saving = Saving::kCopyFirst,
           const std::function<bool(uint64_t)>& copy_first = nullptr);
  // Two-phase work over pieces 0..pieces-1 (a handover's exchange of columns between the arrays
  // and the staging area, whose swap keeps neither side's old values: OffloadSession::HandOver).
  // Per piece, in its worker's slot: save(piece, slot data) keeps what the piece will overwrite
  // on one side (at most 3 * unit floats); then the slot's header names the piece in its first
  // phase, first(piece, slot data) runs, the header names its second phase, second(piece, slot
  // data) runs, and the piece is marked done. first() must leave what save() kept and what
  // first() reads unchanged (it may run again), second() must give the same result run again.
  // A piece cut short is finished from where the header says (FinishTornPieces), never rolled
  // back: after its first phase the other side's old values exist only where first() put them.
  // pieces <= units.
  struct PhasedWork {
    std::function<void(uint64_t, float*)> save;
    std::function<void(uint64_t, const float*)> first;
    std::function<void(uint64_t, const float*)> second;
  };
  void RunPieces(uint64_t pieces, const PhasedWork& work);
  // Finishes the pieces a kill cut short (named by a slot's header, not done): from their first
  // phase or their second, as the header says; each then marked done. The next RunPieces does the
  // rest. DataLoss if a slot names a piece beyond `pieces`.
  absl::Status FinishTornPieces(uint64_t pieces, const PhasedWork& work);

  // Puts back the saved elements of the units in flight (named by a slot, not done): a unit
  // copied first whole, a unit cut short in the kernels' pass its window (and the next Run
  // goes on from there). DataLoss if a slot names a unit or elements beyond the journal.
  absl::Status RollBackTorn(uint64_t elems, const std::vector<float*>& arrays);

  bool done(uint64_t unit) const;
  uint64_t done_units() const;

 private:
  uint64_t* SlotHeaders() const;
  uint64_t* DoneBits() const;
  float* SlotData(uint32_t slot) const;
  uint64_t OpBytes() const;
  // Sets the done bits of units [first, first + n) (release).
  void MarkDone(uint64_t first, uint64_t n);
  // A piece whose slot header names it in `phase` (its incoming cells in `saved`): from there
  // to done (the header's phase 2 after the first phase; the testing delay before the second).
  void PieceFrom(uint64_t* header, uint64_t piece, uint64_t phase, const float* saved,
                 const PhasedWork& work, int64_t delay_us);
  // Runs worker(slot) for slots [0, tasks) in parallel on the current task arena (on this
  // thread alone when tasks is 1).
  void OnSlots(uint32_t tasks, const std::function<void(uint32_t)>& worker);
  // Copies elements [b, e) of `arrays` to a slot's `saved` data.
  void Save(const std::vector<float*>& arrays, uint64_t b, uint64_t e, float* saved) const;

  uint8_t* data_;
  JournalGeometry g_;
  // Per slot, the unit RollBackTorn found cut short in the kernels' pass and its first element
  // not done (relative to the unit): where the next Run goes on.
  std::map<uint32_t, std::pair<uint64_t, uint64_t>> resume_;
};

}  // namespace stallfree
