// stallfree::SessionTarget: the ZenFlow engine's OffloadTarget (engine/offload_target.h) over a
// stallfreed session (client.h). It maps the engine's types onto offload.proto's and back; the
// session keeps its transport, its errors (client.h says what each code means) and its region.
//
// Surviving the daemon (reattach_s > 0): a call that finds the daemon gone (UNAVAILABLE)
// re-attaches the session to the daemon at the same socket (Session::Reattach, which waits up
// to reattach_s for one), then finishes what the daemon that died had not: the Update this
// target started if the state's record says it never ran (sent again as it was: the gradient
// slot it reads is untouched until its WaitUpdate, the engine's rule), then the call itself
// unless the record says that it happened (a push the record counts, an Update it has). The
// engine sees nothing but a slow call. One thread re-attaches, with every other call held back
// until the Update is sent again; another that finds the daemon gone meanwhile uses what it
// found. A handover goes with the session's handover count, so that one the daemon that died
// finished (or was in the middle of: the next daemon finishes it) is answered again, not done
// twice. A state the record says is torn (the daemon died inside work that has no journal entry:
// a LoadParams, a Restore, a push of a request's own bytes) is not taken back: the call fails
// with the daemon's FAILED_PRECONDITION, and the caller restores a checkpoint.
#pragma once

#include <atomic>
#include <functional>
#include <shared_mutex>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "client/client.h"
#include "common/dtype.h"
#include "engine/offload_target.h"

namespace stallfree {

// offload.proto's DType of a DType, and back (UNSPECIFIED reads as FP32: the daemon's default).
v1::DType ToProto(DType t);
DType FromProto(v1::DType t);

class SessionTarget : public OffloadTarget {
 public:
  // Over `session`, which must outlive this target; or over one it owns. reattach_s: see the
  // top of this file (0: a lost daemon fails the call).
  explicit SessionTarget(Session* session, double reattach_s = 0)
      : s_(session), reattach_s_(reattach_s) {}
  explicit SessionTarget(std::unique_ptr<Session> session, double reattach_s = 0)
      : owned_(std::move(session)), s_(owned_.get()), reattach_s_(reattach_s) {}
  Session* session() const { return s_; }
  // From now on a lost daemon fails the call at once (reattach_s 0).
  void StopReattaching() { reattach_s_.store(0); }
  // How many times this target re-attached its session to a new daemon.
  int64_t reattached() const {
    MutexLock lock(&mu_);
    return reattached_;
  }
  // How many Updates it sent again after a re-attach (accepted by the daemon that died, never
  // run there).
  int64_t resent_updates() const {
    MutexLock lock(&mu_);
    return resent_;
  }

  absl::Status Register(const std::vector<Param>& params, DType param_dtype,
                        uint32_t param_slots) override;
  size_t registered_params() const override { return s_->layout().params_size(); }
  DType param_dtype() const override { return FromProto(s_->layout().param_dtype()); }
  uint32_t param_slots() const override { return s_->layout().param_slots(); }
  absl::StatusOr<int64_t> ParamNumel(const std::string& name) const override;
  void* GradSlot(uint32_t slot, const std::string& name) const override {
    return s_->GradSlot(slot, name);
  }
  const void* ParamSlot(uint32_t slot, const std::string& name, DType out) const override;
  float* Staging() const override { return s_->Staging(); }
  uint64_t staging_floats() const override { return s_->staging_floats(); }
  absl::Status LoadParams(const std::vector<LoadRange>& ranges) override {
    return Resilient([&] { return s_->LoadParams(ranges); });
  }
  absl::Status Push(int64_t step, uint32_t slot, float scale) override;
  absl::Status UpdateWithPush(int64_t step, const AdamW& hyper, uint32_t param_slot, DType out,
                              uint32_t grad_slot, float push_scale,
                              const std::vector<std::string>& skip_params) override;
  absl::Status WaitUpdate(int64_t min_version) override;
  UpdateSeen LastUpdate() const override {
    MutexLock lock(&mu_);
    return seen_;
  }
  absl::StatusOr<HandOver> HandOverColumns(const std::vector<ColumnMove>& moves) override;
  absl::Status Checkpoint(const std::string& tag) override;
  absl::Status Restore(const std::string& tag, DType out) override;
  absl::Status DeleteCheckpoint(const std::string& tag) override {
    return Resilient([&] { return s_->DeleteCheckpoint(tag); });
  }
  absl::StatusOr<std::string> ReadCheckpoint(const std::string& tag,
                                             bool delete_after) override;
  absl::Status WriteCheckpoint(const std::string& tag, const std::string& bytes) override {
    return Resilient([&] { return s_->WriteCheckpointBytes(tag, bytes); });
  }
  absl::StatusOr<std::string> ExportState() override;
  absl::Status ImportState(const std::string& bytes, DType out) override;
  // The newest Update this target started (UpdateWithPush) that a WaitUpdate has not returned
  // yet; 0 when none runs as far as the target knows (and after a Restore or an import).
  int64_t UnseenUpdate() const {
    MutexLock lock(&mu_);
    return started_ > seen_.version ? started_ : 0;
  }

 private:
  // An Update as UpdateWithPush sent it, to send again if the daemon died before it ran.
  struct SentUpdate {
    int64_t step = 0;
    AdamW hyper;
    uint32_t param_slot = 0;
    DType out = DType::kFp32;
    uint32_t grad_slot = 0;
    float push_scale = 1.0f;
    std::vector<std::string> skip_params;
  };
  absl::Status SendUpdate(const SentUpdate& u);
  // How many times one call, or one recovery, re-attaches at most while the daemon keeps dying.
  static constexpr int kMaxRecoveries = 64;
  // Where the session's state stands after the newest re-attach and what it finished.
  struct Adopted {
    int64_t version = 0;
    int64_t pushes_since_update = 0;
    int64_t handovers = 0;
  };
  // After `call` failed with `why`: UNAVAILABLE with reattach on, the state where it stands once
  // the session is re-attached (by this thread, or by another since the call began at
  // `generation`) and the started Update finished (a daemon that dies while the Update is sent
  // again is re-attached from too); else why.
  absl::StatusOr<Adopted> Recover(uint64_t generation, const absl::Status& why);
  // call(); on a lost daemon Recover, then, unless done(what Recover found) says the call
  // happened, call() again (and so on, while the daemon keeps going away, at most 64 times).
  absl::Status Resilient(const std::function<absl::Status()>& call,
                         const std::function<bool(const Adopted&)>& done = nullptr);

  std::unique_ptr<Session> owned_;
  Session* s_;
  std::atomic<double> reattach_s_;
  mutable Mutex mu_;  // WaitUpdate runs on the engine's thread and its copy thread
  UpdateSeen seen_ ABSL_GUARDED_BY(mu_);
  int64_t started_ ABSL_GUARDED_BY(mu_) = 0;  // the newest Update's version UpdateWithPush began
  int64_t pushes_ ABSL_GUARDED_BY(mu_) = 0;   // pushes done since the newest Update began
  SentUpdate sent_ ABSL_GUARDED_BY(mu_);      // the newest Update sent
  int64_t pushes_before_sent_ ABSL_GUARDED_BY(mu_) = 0;  // the pushes of its round before it
  Adopted adopted_ ABSL_GUARDED_BY(mu_);
  int64_t reattached_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t resent_ ABSL_GUARDED_BY(mu_) = 0;
  // Shared by each attempt of a call, exclusive while Recover re-attaches and sends the Update
  // again: no call reaches the session taken back before it is where the target left it.
  std::shared_mutex calls_mu_;
};

}  // namespace stallfree
