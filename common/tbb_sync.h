// oneTBB hand-offs that ThreadSanitizer can see. Debian's libtbb is not built with TSan, so the
// happens-before that TBB provides (work enqueued on one thread runs on another; a parallel_for's
// bodies run on workers and join the caller) is invisible to it, and every first touch of shared
// data on the other side is reported as a race. These mark those edges with TSan's own
// annotations (no-ops in other builds):
//   TsanRelease(p) before handing work to TBB, TsanAcquire(p) where it starts;
//   ParallelFor(range, body): tbb::parallel_for with both edges marked;
//   ArenaExecute(arena, f): task_arena::execute with both edges marked (f may run on a worker).
#pragma once

#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

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

template <typename Range, typename Body>
void ParallelFor(const Range& range, const Body& body) {
  const TsanHandOff hand_off;
  tbb::parallel_for(range, [&](const Range& sub) {
    const TsanHandOff::Piece piece = hand_off.Enter();
    body(sub);
  });
}

template <typename F>
void ArenaExecute(tbb::task_arena& arena, const F& f) {
  const TsanHandOff hand_off;
  arena.execute([&] {
    const TsanHandOff::Piece piece = hand_off.Enter();
    f();
  });
}

}  // namespace stallfree
