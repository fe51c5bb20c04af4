// An undo log the CPU AdamW kernels keep as they change a range of their arrays, in the same
// pass, so that a process killed at any instruction in the middle leaves the range in a state
// that can be finished exactly (the daemon's work journal, server/session_journal.h, is its
// user).
//
// While a ScopedUndoLog is active on a thread, an AdamW kernel of a backend whose
// OptimizerKernel::KeepsUndoLog() is true, called on that thread on elements of the log's
// range, runs whole on the calling thread and, for each vector of elements it changes:
//   1. copies the vector's param, m and v values to the log's ring (a few hundred bytes that
//      stay in L1),
//   2. stores the mark: "the elements below this vector are done, and this vector's old values
//      are in the ring" (a release store),
//   3. then (after a compiler barrier) changes the vector's elements.
// So after a kill at any instruction, the mark says: elements below `done` hold their results,
// the `window` elements from `done` on hold anything and their old values are in the ring, and
// the rest are untouched. Putting the window back and running the range again from `done` on
// finishes it exactly. The calls on one range must go through it in increasing order, each
// element once; elements a call skips over (between two calls) are taken as done, unchanged.
//
// Why a ring and not a copy of the whole range: the copy's cache lines (12 KiB for a daemon unit
// of 1024 elements) fell out of L1 between ranges, and their misses took the fill buffers the
// update's memory streams need: a fifth of the update's throughput (server/session_journal.h;
// experimental builds showed the same stores into a few hot floats cost nothing).
//
// What a kill keeps is the stores in program order (the memory is shared: every store that
// retired is in it; x86-64 makes stores visible in program order).
//
// The mark is one 64-bit word: the owner's tag in the low 43 bits, the window's length in the
// next 5, done + 1 in the top 16. 0 in the top 16 means a range whose owner saved it whole
// before it began (UndoMarkWhole).
#pragma once

#include <cstdint>

namespace stallfree {
namespace kernels {

// The ring: kUndoRing floats per array, the three after one another (param, m, v); the window
// starting at element d is at d % 32 in each (two windows of at most 16 elements in a row never
// overlap).
inline constexpr uint64_t kUndoRing = 48;
inline constexpr uint64_t kUndoMaxWindow = 16;
inline constexpr uint64_t kUndoMaxElems = (uint64_t{1} << 16) - 2;
inline constexpr uint64_t kUndoTagMask = (uint64_t{1} << 43) - 1;

struct UndoLog {
  float* base[3] = {nullptr, nullptr, nullptr};  // element 0 of the range in param, m, v
  float* ring = nullptr;  // 3 * kUndoRing floats: ring[a * kUndoRing + j], array a's window
  uint64_t elems = 0;  // the range's length, at most kUndoMaxElems
  uint64_t* mark = nullptr;
  uint64_t tag = 0;  // below 2^43
};

inline uint64_t UndoMark(uint64_t tag, uint64_t done, uint64_t window) {
  return tag | window << 43 | (done + 1) << 48;
}
inline uint64_t UndoMarkTag(uint64_t mark) { return mark & kUndoTagMask; }
inline bool UndoMarkWhole(uint64_t mark) { return mark >> 48 == 0; }
inline uint64_t UndoMarkDone(uint64_t mark) { return UndoMarkWhole(mark) ? 0 : (mark >> 48) - 1; }
inline uint64_t UndoMarkWindow(uint64_t mark) { return (mark >> 43) & 31; }
inline uint64_t UndoRingAt(uint64_t done) { return done % 32; }

// The calling thread's active log (null: none).
const UndoLog* ActiveUndoLog();

// Makes `log` the calling thread's active log for its lifetime (the previous one after).
class ScopedUndoLog {
 public:
  explicit ScopedUndoLog(const UndoLog* log);
  ~ScopedUndoLog();
  ScopedUndoLog(const ScopedUndoLog&) = delete;
  ScopedUndoLog& operator=(const ScopedUndoLog&) = delete;

 private:
  const UndoLog* previous_;
};

}  // namespace kernels
}  // namespace stallfree
