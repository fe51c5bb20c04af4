// oneTBB hand-offs that ThreadSanitizer can see. Debian's libtbb is not built with TSan, so the
// happens-before that TBB provides (work enqueued on one thread runs on another; a parallel_for's
// bodies run on workers and join the caller) is invisible to it, and every first touch of shared
// data on the other side is reported as a race. These mark those edges with TSan's own
// annotations (no-ops in other builds):
//   TsanRelease(p) before handing work to TBB, TsanAcquire(p) where it starts;
//   ParallelFor(range, body): tbb::parallel_for with both edges marked.
#pragma once

#include <tbb/parallel_for.h>

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

template <typename Range, typename Body>
void ParallelFor(const Range& range, const Body& body) {
  char start = 0, done = 0;
  TsanRelease(&start);
  tbb::parallel_for(range, [&](const Range& sub) {
    TsanAcquire(&start);
    body(sub);
    TsanRelease(&done);
  });
  TsanAcquire(&done);
}

}  // namespace stallfree
