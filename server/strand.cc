#include "server/strand.h"

#include "common/tbb_sync.h"

namespace stallfree {

bool Strand::Post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return false;
    queue_.push_back(std::move(task));
    if (running_) return true;
    running_ = true;
  }
  std::shared_ptr<Strand> self = shared_from_this();
  TsanRelease(this);  // TBB's hand-off, made visible to TSan (common/tbb_sync.h)
  arena_->enqueue([self] {
    TsanAcquire(self.get());
    self->Drain();
  });
  return true;
}

void Strand::Close(std::function<void()> on_idle) {
  // on_idle may drop the last owner of this strand.
  std::shared_ptr<Strand> self = shared_from_this();
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    if (running_) {
      if (on_idle) on_idle_.push_back(std::move(on_idle));
      return;
    }
  }
  if (on_idle) on_idle();
}

void Strand::Drain() {
  for (;;) {
    std::function<void()> task;
    std::vector<std::function<void()>> on_idle;
    bool idle;
    {
      std::lock_guard<std::mutex> lock(mu_);
      idle = queue_.empty();
      if (idle) {
        running_ = false;
        on_idle.swap(on_idle_);
        idle_cv_.notify_all();
      } else {
        task = std::move(queue_.front());
        queue_.pop_front();
      }
    }
    if (idle) {
      for (auto& f : on_idle) f();
      return;
    }
    task();
  }
}

void Strand::WaitIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [this] { return !running_ && queue_.empty(); });
}

}  // namespace stallfree
