// Strand: runs posted tasks one at a time, in order, on a oneTBB arena. Post() never blocks on
// the work (it only takes a short lock), so gRPC threads can post and return.
//
// A strand can be closed: it then refuses every later Post, and calls the closer's on_idle
// once its last task has finished. A closed strand that is idle stays idle, so whoever waits
// for that moment knows no task of the strand will run again.
// Thread safe. The arena must outlive the strand and every task posted to it.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include <tbb/task_arena.h>

namespace stallfree {

class Strand : public std::enable_shared_from_this<Strand> {
 public:
  explicit Strand(tbb::task_arena* arena) : arena_(arena) {}
  Strand(const Strand&) = delete;
  Strand& operator=(const Strand&) = delete;

  // Queues task after every task posted before it. False once Close was called: the task is
  // dropped without running.
  bool Post(std::function<void()> task);
  // Refuses every later Post. on_idle (if not empty) runs once no task is queued or running:
  // at once on this thread if none is, else on the arena thread of the last task, after it.
  // May be called more than once; each on_idle runs once.
  void Close(std::function<void()> on_idle);
  // Blocks until no task is queued or running. Only for shutdown and tests.
  void WaitIdle();

 private:
  void Drain();

  tbb::task_arena* arena_;
  std::mutex mu_;
  std::condition_variable idle_cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  bool running_ = false;                     // guarded by mu_
  bool closed_ = false;                      // guarded by mu_
  std::vector<std::function<void()>> on_idle_;  // guarded by mu_
};

}  // namespace stallfree
