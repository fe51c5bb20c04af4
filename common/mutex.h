// Mutex / MutexLock: std::mutex with Clang's thread-safety annotations, so that
// ABSL_GUARDED_BY(mu_) is checked by clang -Wthread-safety, while ThreadSanitizer still sees every
// lock (it intercepts pthread mutexes; Debian's libabsl is not built with TSan, so it cannot see
// the happens-before of absl::Mutex, and `make test-tsan` would report races that are none).
// Await(cond) blocks until cond() holds, re-checking it whenever another thread unlocks.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace stallfree {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    // Notify before unlocking: once unlocked, a waiter may return from Await and destroy the
    // object that holds this mutex (found by TSan: ~SessionManager after Drain's Await).
    if (waiters_ > 0) cv_.notify_all();
    mu_.unlock();
  }
  // With the mutex held: releases it until cond() holds (checked under the mutex), then returns
  // with it held again. Waits in slices, so a condition made true without an Unlock (none here)
  // is still seen within 10 ms.
  template <typename Cond>
  void Await(Cond cond) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    ++waiters_;
    while (!cond()) cv_.wait_for(lock, std::chrono::milliseconds(10));
    --waiters_;
    lock.release();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int waiters_ = 0;  // threads in Await; read and written under mu_
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace stallfree
