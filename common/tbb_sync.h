// oneTBB hand-offs that ThreadSanitizer can see. Debian's libtbb is not built with TSan, so the
// happens-before that TBB provides (work enqueued on one thread runs on another; a parallel_for's
// bodies run on workers and join the caller) is invisible to it, and every first touch of shared
// data on the other side is reported as a race. These mark those edges with TSan's own
// annotations (no-ops in other builds):
//   TsanRelease(p) before handing work to TBB, TsanAcquire(p) where it starts;
//   ParallelFor(range, body): tbb::parallel_for with both edges marked;
//   ArenaExecute(arena, f): task_arena::execute with both edges marked (f may run on a worker);
//   both then order TBB's own atomic writes to their wait's stack before this thread's next
//   use of it (TsanAcquireStackBelow).
#pragma once

#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <cstdint>

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace stallfree {

inline void TsanRelease(const void* p) {
#if defined(__SANITIZE_THREAD__)
  __tsan_release(const_cast<void*>(p));
#else
  (void)p;
#endif
}

inline void TsanAcquire(const void* p) {
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(const_cast<void*>(p));
#else
  (void)p;
#endif
}

// One hand-off to TBB and back: constructed before the work is handed over (the edge there),
// Enter() where each piece of it starts (the edge there, and one back when the piece ends, an
// exception's way out included), and the edge back to this thread when it goes out of scope,
// normally or with the exception TBB rethrows.
class TsanHandOff {
 public:
  TsanHandOff() { TsanRelease(&start_); }
  ~TsanHandOff() { TsanAcquire(&done_); }
  TsanHandOff(const TsanHandOff&) = delete;
  TsanHandOff& operator=(const TsanHandOff&) = delete;

  class Piece {
   public:
    explicit Piece(const char* done) : done_(done) {}
    ~Piece() { TsanRelease(done_); }
    Piece(const Piece&) = delete;
    Piece& operator=(const Piece&) = delete;

   private:
    const char* done_;
  };
  Piece Enter() const {
    TsanAcquire(&start_);
    return Piece(&done_);
  }

 private:
  char start_ = 0, done_ = 0;
};

// After a parallel_for (or an arena's execute) returned: its wait node, on this thread's stack,
// had its reference count decremented by the workers with atomics in TBB's inline code (compiled
// here, so TSan sees them), after the bodies ended; the order from those decrements to this
// thread's return is given by the wait in libtbb, which TSan does not see. The next frame at
// that address would then be reported as racing with a worker's decrement (found in a daemon
// under trainer_survival_test: the next parallel_for's wait node, initialized in the same frame
// of WorkJournal::OnSlots). So this thread acquires, as TSan counts it, every 4-byte word from 4
// KiB below this call up to `top`, the frame that ran the parallel_for: TSan orders each atomic
// write to a word before an acquire of it, and an acquire of a word no one released costs a
// lookup. (TSan's AnnotateNewMemory, which would forget those writes, does not reset anything in
// GCC's runtime.)
#if defined(__SANITIZE_THREAD__)
__attribute__((noinline)) inline void TsanAcquireStackBelow(const void* top) {
  volatile char here = 0;
  const uintptr_t low = (reinterpret_cast<uintptr_t>(&here) - 4096) & ~uintptr_t{3};
  for (uintptr_t a = low; a < reinterpret_cast<uintptr_t>(top); a += 4)
    __tsan_acquire(reinterpret_cast<void*>(a));
}
#define STALLFREE_TSAN_ACQUIRE_STACK() TsanAcquireStackBelow(__builtin_frame_address(0))
#else
#define STALLFREE_TSAN_ACQUIRE_STACK() ((void)0)
#endif

template <typename Range, typename Body>
void ParallelFor(const Range& range, const Body& body) {
  {
    const TsanHandOff hand_off;
    tbb::parallel_for(range, [&](const Range& sub) {
      const TsanHandOff::Piece piece = hand_off.Enter();
      body(sub);
    });
  }
  STALLFREE_TSAN_ACQUIRE_STACK();
}

template <typename F>
void ArenaExecute(tbb::task_arena& arena, const F& f) {
  {
    const TsanHandOff hand_off;
    arena.execute([&] {
      const TsanHandOff::Piece piece = hand_off.Enter();
      f();
    });
  }
  STALLFREE_TSAN_ACQUIRE_STACK();
}

}  // namespace stallfree
