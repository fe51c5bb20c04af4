// SessionManager in process, without the daemon: the lifetimes of closed sessions. A session's
// strand task is held inside its `done` (on an arena thread) while more work waits behind it;
// then the session is closed or reclaimed and the manager destroyed. The manager must wait for
// that work, which uses it, and a closed session's memory must go right after its last task.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include "server/session_manager.h"

namespace stallfree {
namespace {

using Code = absl::StatusCode;
using namespace std::chrono_literals;

constexpr int64_t kNumel = 1 << 16;

// Calls f(done) and waits for done.
absl::Status Call(const std::function<void(SessionManager::Done)>& f) {
  std::promise<absl::Status> p;
  std::future<absl::Status> fut = p.get_future();
  f([&p](absl::Status s) { p.set_value(s); });
  return fut.get();
}

class SessionManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/stallfree-manager-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    DaemonOptions options;
    options.pin = PinPolicy::kOff;
    options.state_dir = dir_;
    options.worker_threads = 2;
    manager_ = std::make_unique<SessionManager>(options, &arena_);
  }
  void TearDown() override {
    if (!released_once_) Release();
    manager_.reset();
    if (system(("rm -rf " + dir_).c_str()) != 0) perror("rm");
  }

  // An open session of one parameter of kNumel elements, registered and loaded.
  v1::SessionRef OpenLoaded() {
    v1::OpenSessionRequest open;
    open.set_name("lifetime");
    open.set_pid(getpid());
    absl::StatusOr<v1::OpenSessionResponse> opened = manager_->Open(open);
    EXPECT_TRUE(opened.ok()) << opened.status();
    v1::RegisterParamsRequest reg;
    *reg.mutable_session() = opened->session();
    v1::ParamSpec* p = reg.add_params();
    p->set_name("w");
    p->add_shape(kNumel);
    p->set_grad_dtype(v1::DTYPE_FP32);
    v1::RegisterParamsResponse layout;
    EXPECT_TRUE(Call([&](auto done) { manager_->RegisterParams(reg, &layout, done); }).ok());
    v1::LoadParamsRequest load;
    *load.mutable_session() = opened->session();
    EXPECT_TRUE(Call([&](auto done) { manager_->LoadParams(load, done); }).ok());
    return opened->session();
  }

  // Holds the session's strand: a whole-slot push whose done blocks until release() is called.
  // Returns once the push is running; push_status_ gets its status.
  void HoldStrand(const v1::SessionRef& ref) {
    push_.set_step(1);
    *push_.mutable_session() = ref;
    std::promise<void> entered;
    manager_->PushGradients(push_, &push_resp_, [this, &entered](absl::Status s) {
      push_status_ = s;
      entered.set_value();
      if (!s.ok()) return;  // an error comes inline, on this thread
      released_.wait();
      manager_alive_after_release_.store(!destroyed_.load());
    });
    entered.get_future().wait();
    ASSERT_TRUE(push_status_.ok()) << push_status_;
  }
  void Release() {
    released_once_ = true;
    release_.set_value();
  }

  // Queues an Update behind the held push, and a waiter for it.
  void QueueUpdate(const v1::SessionRef& ref) {
    v1::UpdateRequest update;
    *update.mutable_session() = ref;
    update.set_step(1);
    update.mutable_hyper()->set_lr(1e-3);
    update.mutable_hyper()->set_beta1(0.9);
    update.mutable_hyper()->set_beta2(0.999);
    update.mutable_hyper()->set_eps(1e-8);
    ASSERT_TRUE(manager_->Update(update).ok());
    v1::WaitUpdateRequest wait;
    *wait.mutable_session() = ref;
    wait.set_min_version(1);
    manager_->WaitUpdate(wait, [this](absl::StatusOr<WaitResult> r) { wait_status_ = r.status(); });
  }

  // Destroys the manager on another thread; returns that thread. destroyed_ is set when done.
  // Returns once the destructor has begun: the manager refuses requests as it drains.
  std::thread DestroyManager() {
    SessionManager* const manager = manager_.get();
    std::thread destroyer([this] {
      manager_.reset();
      destroyed_.store(true);
    });
    // A condition, not a sleep: a request for no session is NOT_FOUND until Drain (the
    // destructor's first step) refuses it as UNAVAILABLE. The manager is still there: this
    // fixture's held task keeps the destructor waiting, which is what the tests check.
    v1::UpdateRequest probe;
    probe.mutable_session()->set_session_id(~uint64_t{0});
    while (manager->Update(probe).code() != Code::kUnavailable) std::this_thread::yield();
    return destroyer;
  }

  tbb::task_arena arena_{2, 0};
  std::string dir_;
  std::unique_ptr<SessionManager> manager_;
  v1::PushGradientsRequest push_;
  v1::PushGradientsResponse push_resp_;
  absl::Status push_status_ = absl::UnknownError("not called");
  absl::Status wait_status_ = absl::UnknownError("not called");
  std::promise<void> release_;
  std::shared_future<void> released_ = release_.get_future().share();
  bool released_once_ = false;
  std::atomic<bool> destroyed_{false};
  // What the held task saw when released: the manager not destroyed yet.
  std::atomic<bool> manager_alive_after_release_{false};
};

// Close while a task runs and another waits behind it, then destroy the manager: the destructor
// waits for both (the queued Update counts into the manager when it runs).
v1::CloseSessionRequest CloseRequest(const v1::SessionRef& ref) {
  v1::CloseSessionRequest req;
  *req.mutable_session() = ref;
  return req;
}

TEST_F(SessionManagerTest, DestroyingTheManagerWaitsForAClosedSessionsWork) {
  const v1::SessionRef ref = OpenLoaded();
  ASSERT_NO_FATAL_FAILURE(HoldStrand(ref));
  ASSERT_NO_FATAL_FAILURE(QueueUpdate(ref));
  absl::StatusOr<uint64_t> freed = manager_->Close(CloseRequest(ref));
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_GT(*freed, uint64_t{kNumel} * 4 * 4);
  EXPECT_EQ(wait_status_.code(), Code::kAborted);  // the waiter goes with the close
  v1::Stats stats = manager_->GetStats();
  EXPECT_EQ(stats.sessions(), 0);
  EXPECT_EQ(stats.sessions_closed(), 1);
  EXPECT_GT(stats.pinned_bytes(), 0u);  // the running push still uses the memory

  std::thread destroyer = DestroyManager();
  EXPECT_FALSE(destroyed_.load()) << "the manager went while a closed session's task ran";
  Release();
  destroyer.join();
  EXPECT_TRUE(destroyed_.load());
  EXPECT_TRUE(manager_alive_after_release_.load()) << "the manager went before its task ended";
  EXPECT_TRUE(push_status_.ok()) << push_status_;
}

// The memory of a reclaimed session goes right after its last task (nobody calls Housekeeping
// here), the queued Update still runs, and the session is gone for new requests at once.
TEST_F(SessionManagerTest, ReclaimedSessionsMemoryGoesAfterItsLastTask) {
  const v1::SessionRef ref = OpenLoaded();
  ASSERT_NO_FATAL_FAILURE(HoldStrand(ref));
  ASSERT_NO_FATAL_FAILURE(QueueUpdate(ref));
  manager_->OnConnectionClosed(ref.session_id());
  EXPECT_EQ(wait_status_.code(), Code::kAborted);
  v1::PushGradientsResponse resp;
  EXPECT_EQ(Call([&](auto done) { manager_->PushGradients(push_, &resp, done); }).code(),
            Code::kNotFound);
  v1::Stats stats = manager_->GetStats();
  EXPECT_EQ(stats.sessions(), 0);
  EXPECT_EQ(stats.sessions_reclaimed(), 1);
  EXPECT_GT(stats.pinned_bytes(), 0u);
  EXPECT_EQ(stats.updates(), 0);

  Release();
  for (int i = 0; i < 500 && manager_->GetStats().pinned_bytes() > 0; ++i)
    std::this_thread::sleep_for(10ms);
  stats = manager_->GetStats();
  EXPECT_EQ(stats.pinned_bytes(), 0u);
  EXPECT_EQ(stats.updates(), 1);  // it ran before the memory went
  EXPECT_EQ(stats.pushes(), 1);
}

// A RunDetached task (a caller's ListCheckpoints) holds the destructor too.
TEST_F(SessionManagerTest, DestroyingTheManagerWaitsForDetachedWork) {
  const v1::CallerRef caller = manager_->NewCaller(getuid(), getpid());
  v1::ListCheckpointsRequest list;
  *list.mutable_caller() = caller;
  v1::ListCheckpointsResponse resp;
  std::promise<void> entered;
  absl::Status listed = absl::UnknownError("not called");
  manager_->ListCheckpoints(list, &resp, [&](absl::Status s) {
    listed = s;
    entered.set_value();
    if (!s.ok()) return;  // an error comes inline, on this thread
    released_.wait();
    manager_alive_after_release_.store(!destroyed_.load());
  });
  entered.get_future().wait();
  ASSERT_TRUE(listed.ok()) << listed;
  std::thread destroyer = DestroyManager();
  EXPECT_FALSE(destroyed_.load()) << "the manager went while a detached task ran";
  Release();
  destroyer.join();
  EXPECT_TRUE(destroyed_.load());
  EXPECT_TRUE(manager_alive_after_release_.load()) << "the manager went before its task ended";
}

// After Drain every request is refused (UNAVAILABLE), also the ones that run detached.
TEST_F(SessionManagerTest, DrainRefusesNewWork) {
  const v1::SessionRef ref = OpenLoaded();
  manager_->Drain();
  push_.set_step(1);
  *push_.mutable_session() = ref;
  v1::PushGradientsResponse resp;
  EXPECT_EQ(Call([&](auto done) { manager_->PushGradients(push_, &resp, done); }).code(),
            Code::kUnavailable);
  v1::OpenSessionRequest open;
  open.set_pid(getpid());
  EXPECT_EQ(manager_->Open(open).status().code(), Code::kUnavailable);
  v1::DeleteCheckpointRequest del;
  *del.mutable_caller() = manager_->NewCaller(getuid(), getpid());
  del.set_tag("x");
  EXPECT_EQ(Call([&](auto done) { manager_->DeleteCheckpoint(del, done); }).code(),
            Code::kUnavailable);
  EXPECT_EQ(manager_->GetStats().sessions(), 1);
}

// Bounded waits (issue 30): an Update slower than the wait, here held behind a running push
// while the daemon stays alive. The daemon's wait (options.update_wait, stallfreed
// --update_wait_s; a request's timeout_ms instead when it names one) ends with DEADLINE_EXCEEDED
// naming the version, the bound and whose it is, and that is all: the Update goes on, a
// WaitUpdate again returns it once done, and the session trains on (a retryable condition, not
// a broken session; before, the daemon waited an implicit 60 s and said only "not ready before
// timeout_ms").
TEST_F(SessionManagerTest, AnUpdateSlowerThanTheWaitIsDeadlineExceededAndTheSessionGoesOn) {
  DaemonOptions options;
  options.pin = PinPolicy::kOff;
  options.state_dir = dir_;
  options.worker_threads = 2;
  options.update_wait = 50ms;
  manager_ = std::make_unique<SessionManager>(options, &arena_);
  EXPECT_EQ(manager_->GetStats().update_wait_seconds(), 0.05);
  const v1::SessionRef ref = OpenLoaded();
  ASSERT_NO_FATAL_FAILURE(HoldStrand(ref));
  v1::UpdateRequest update;
  *update.mutable_session() = ref;
  update.set_step(1);
  update.mutable_hyper()->set_lr(1e-3);
  update.mutable_hyper()->set_beta1(0.9);
  update.mutable_hyper()->set_beta2(0.999);
  update.mutable_hyper()->set_eps(1e-8);
  ASSERT_TRUE(manager_->Update(update).ok());
  // Waits for version `v` (timeout_ms 0: the daemon's wait), calling Housekeeping (which
  // expires waits) as the daemon's housekeeping thread does, until done or 10 s.
  auto wait = [&](int64_t v, uint32_t timeout_ms) -> absl::StatusOr<WaitResult> {
    v1::WaitUpdateRequest req;
    *req.mutable_session() = ref;
    req.set_min_version(v);
    req.set_timeout_ms(timeout_ms);
    auto p = std::make_shared<std::promise<absl::StatusOr<WaitResult>>>();
    std::future<absl::StatusOr<WaitResult>> f = p->get_future();
    manager_->WaitUpdate(req, [p](absl::StatusOr<WaitResult> r) { p->set_value(std::move(r)); });
    for (int i = 0; i < 1000 && f.wait_for(10ms) != std::future_status::ready; ++i)
      manager_->Housekeeping();
    if (f.wait_for(0ms) != std::future_status::ready)
      return absl::InternalError("the wait neither ended nor expired within 10 s");
    return f.get();
  };
  absl::StatusOr<WaitResult> slow = wait(1, 0);
  EXPECT_EQ(slow.status().code(), Code::kDeadlineExceeded) << slow.status();
  EXPECT_NE(slow.status().message().find(
                "version 1 not ready after 0.05 s (stallfreed --update_wait_s): its Update is "
                "still queued or running; the session is intact"),
            std::string::npos)
      << slow.status();
  slow = wait(1, 30);
  EXPECT_EQ(slow.status().code(), Code::kDeadlineExceeded) << slow.status();
  EXPECT_NE(slow.status().message().find("not ready after 0.03 s (the request's timeout_ms)"),
            std::string::npos)
      << slow.status();
  EXPECT_EQ(manager_->GetStats().updates(), 0);  // still held

  Release();
  absl::StatusOr<WaitResult> done = wait(1, 10000);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->version, 1);
  EXPECT_TRUE(push_status_.ok()) << push_status_;
  // The session goes on: the next round's push, Update and wait.
  v1::PushGradientsRequest push = push_;
  push.set_step(2);
  v1::PushGradientsResponse resp;
  ASSERT_TRUE(Call([&](auto d) { manager_->PushGradients(push, &resp, d); }).ok());
  update.set_step(2);
  ASSERT_TRUE(manager_->Update(update).ok());
  done = wait(2, 10000);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->version, 2);
  EXPECT_EQ(manager_->GetStats().updates(), 2);
}

}  // namespace
}  // namespace stallfree
