#include "server/strand.h"

namespace stallfree {

void Strand::Post(std::function<void()> task) {
  bool start = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
    if (!running_) {
      running_ = true;
      start = true;
    }
  }
  if (start) {
    std::shared_ptr<Strand> self = shared_from_this();
    arena_->enqueue([self] { self->Drain(); });
  }
}

void Strand::Drain() {
  for (;;) {
    std::function<void()> task;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (queue_.empty()) {
        running_ = false;
        idle_cv_.notify_all();
        return;
      }
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void Strand::WaitIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [this] { return !running_ && queue_.empty(); });
}

}  // namespace stallfree
