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

// Marks TsanRelease(p) when it goes out of scope, an exception's way out included (a body that
// throws still hands what it touched back to the thread that catches it).
class TsanReleaseAtExit {
 public:
  explicit TsanReleaseAtExit(const void* p) : p_(p) {}
  ~TsanReleaseAtExit() { TsanRelease(p_); }
  TsanReleaseAtExit(const TsanReleaseAtExit&) = delete;
  TsanReleaseAtExit& operator=(const TsanReleaseAtExit&) = delete;

 private:
  const void* p_;
};

template <typename Range, typename Body>
void ParallelFor(const Range& range, const Body& body) {
  char start = 0, done = 0;
  TsanRelease(&start);
  try {
    tbb::parallel_for(range, [&](const Range& sub) {
      TsanAcquire(&start);
      TsanReleaseAtExit release(&done);
      body(sub);
    });
  } catch (...) {
    TsanAcquire(&done);
    throw;
  }
  TsanAcquire(&done);
}

template <typename F>
void ArenaExecute(tbb::task_arena& arena, const F& f) {
  char start = 0, done = 0;
  TsanRelease(&start);
  try {
    arena.execute([&] {
      TsanAcquire(&start);
      TsanReleaseAtExit release(&done);
      f();
    });
  } catch (...) {
    TsanAcquire(&done);
    throw;
  }
  TsanAcquire(&done);
}

}  // namespace stallfree
