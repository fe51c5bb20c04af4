// Strand: runs posted tasks one at a time, in order, on a oneTBB arena. Post() never blocks on
// the work (it only takes a short lock), so gRPC threads can post and return.
// Thread safe. The arena must outlive the strand and every task posted to it.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>

#include <tbb/task_arena.h>

namespace stallfree {

class Strand : public std::enable_shared_from_this<Strand> {
 public:
  explicit Strand(tbb::task_arena* arena) : arena_(arena) {}
  Strand(const Strand&) = delete;
  Strand& operator=(const Strand&) = delete;

  void Post(std::function<void()> task);
  // Blocks until no task is queued or running. Only for shutdown and tests.
  void WaitIdle();

 private:
  void Drain();

  tbb::task_arena* arena_;
  std::mutex mu_;
  std::condition_variable idle_cv_;
  std::deque<std::function<void()>> queue_;
  bool running_ = false;
};

}  // namespace stallfree
