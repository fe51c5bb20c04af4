// The work journal: what lets a restarted daemon finish an Update or a push that the daemon
// before it died in the middle of (SessionManager::Adopt), instead of refusing a torn state.
// It lives in the session's state memfd after the four fp32 arrays, so it outlives the daemon
// with them (session_record.h says why the memfd does).
//
// An operation (an Update, a push) runs over units: blocks of `unit` elements of the flat
// arrays (JournalGeometry), unit u covering elements [u * unit, (u + 1) * unit). Each unit
// is done by one worker, which first saves the unit's elements of the arrays the operation
// writes (master, m and v for an Update; the accumulator for a push) in a slot of its own,
// then names the unit in the slot's header, changes the arrays, and finally sets the unit's
// bit in the done bitmap. The saved copy stays in the worker's cache (a unit's three arrays are
// at most 12 KiB) and the unit's elements are in the cache when the work reads them, so the
// journal adds no traffic to memory; it adds the copy, measured at about a fifth of the
// update's throughput (bench/optimizer_bench, session_update_journaled_vs_without).
//
// After a crash at any instant, every unit is in one of three states: done (its bit is set: the
// arrays hold its result), in flight (named by a slot header, bit not set: the slot holds its
// elements from before, and the arrays may hold anything between), or untouched. Roll back the
// units in flight (RollBackTorn) and run the operation again over the units not done (Run): the
// result is the uninterrupted operation's, bit for bit, because every unit computes from its
// own elements only.
//
// The order that makes this hold (SIGKILL at any instruction; the memory is shared, so every
// store that retired is in it afterwards; x86's stores become visible in program order):
//   Begin: clear the slot headers and the bitmap, then write the operation (its sequence, the
//          record commit that announced it, its plan bytes, a checksum).
//   unit:  save -> header (release) -> change the arrays -> done bit (release).
// An operation whose journal entry does not check out, or names another commit, never started
// its units: the arrays are as the commit before it left them.
//
// Layout at the journal's offset, little-endian, JournalBytes long:
//   "SFJRNL01" u32 slots u32 unit | u64 units u64 plan_capacity
//   op:    u64 commit_sequence u32 kind u32 plan_bytes | plan[plan_capacity] | u64 checksum
//   u64 slot_header[slots] (unit + 1; 0: none) | u64 done[ceil(units / 64)]
//   64-aligned: float slot_data[slots][3 * unit]
#pragma once

#include <cstdint>
#include <functional>
#include <string>
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
JournalGeometry JournalGeometryFor(uint64_t total_elems, size_t params);

// Testing only: every unit of an operation waits this long half way through its work (0: none,
// the default), so that a test can stop the daemon inside an operation, with a unit half
// changed, at a point it chooses (stallfreed's --test_unit_delay_us).
void SetUnitDelayForTesting(int64_t microseconds);

// The operation a journal entry describes.
enum class JournalOp : uint32_t { kNone = 0, kUpdate = 1, kPush = 2 };

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

  // Runs work(begin, end) over every unit of [0, elems) that is not done, in parallel on the
  // current task arena, each unit saved first from `arrays` (at most 3, each at least elems
  // long; none when running a unit again from its start gives its result anyway) and marked
  // done after. elems <= units * unit. `skip(u)`, when given, leaves
  // unit u out (nothing of it changes).
  void Run(uint64_t elems, const std::vector<float*>& arrays,
           const std::function<void(uint64_t, uint64_t)>& work,
           const std::function<bool(uint64_t)>& skip = nullptr);
  // Puts back the saved elements of the units in flight (named by a slot, not done). DataLoss
  // if a slot names a unit beyond the journal.
  absl::Status RollBackTorn(uint64_t elems, const std::vector<float*>& arrays);

  bool done(uint64_t unit) const;
  uint64_t done_units() const;

 private:
  uint64_t* SlotHeaders() const;
  uint64_t* DoneBits() const;
  float* SlotData(uint32_t slot) const;
  uint64_t OpBytes() const;
  // Copies elements [b, e) of `arrays` to a slot's `saved` data.
  void Save(const std::vector<float*>& arrays, uint64_t b, uint64_t e, float* saved) const;

  uint8_t* data_;
  JournalGeometry g_;
};

}  // namespace stallfree
