// stallfree::SessionTarget: the ZenFlow engine's OffloadTarget (engine/offload_target.h) over a
// stallfreed session (client.h). It maps the engine's types onto offload.proto's and back; the
// session keeps its transport, its errors (client.h says what each code means) and its region.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "common/dtype.h"
#include "engine/offload_target.h"

namespace stallfree {

// offload.proto's DType of a DType, and back (UNSPECIFIED reads as FP32: the daemon's default).
v1::DType ToProto(DType t);
DType FromProto(v1::DType t);

class SessionTarget : public OffloadTarget {
 public:
  // Over `session`, which must outlive this target; or over one it owns.
  explicit SessionTarget(Session* session) : s_(session) {}
  explicit SessionTarget(std::unique_ptr<Session> session)
      : owned_(std::move(session)), s_(owned_.get()) {}
  Session* session() const { return s_; }

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
    return s_->LoadParams(ranges);
  }
  absl::Status Push(int64_t step, uint32_t slot, float scale) override;
  absl::Status UpdateWithPush(int64_t step, const AdamW& hyper, uint32_t param_slot, DType out,
                              uint32_t grad_slot, float push_scale,
                              const std::vector<std::string>& skip_params) override;
  absl::Status WaitUpdate(int64_t min_version) override;
  UpdateSeen LastUpdate() const override {
    absl::MutexLock lock(&mu_);
    return seen_;
  }
  absl::StatusOr<HandOver> HandOverColumns(const std::vector<ColumnMove>& moves) override;
  absl::Status Checkpoint(const std::string& tag) override;
  absl::Status Restore(const std::string& tag, DType out) override;
  absl::Status DeleteCheckpoint(const std::string& tag) override {
    return s_->DeleteCheckpoint(tag);
  }
  absl::StatusOr<std::string> ReadCheckpoint(const std::string& tag,
                                             bool delete_after) override {
    return s_->ReadCheckpointBytes(tag, delete_after);
  }
  absl::Status WriteCheckpoint(const std::string& tag, const std::string& bytes) override {
    return s_->WriteCheckpointBytes(tag, bytes);
  }
  absl::StatusOr<std::string> ExportState() override { return s_->ExportState(); }
  absl::Status ImportState(const std::string& bytes, DType out) override;
  // The newest Update this target started (UpdateWithPush) that a WaitUpdate has not returned
  // yet; 0 when none runs as far as the target knows (and after a Restore or an import).
  int64_t UnseenUpdate() const {
    absl::MutexLock lock(&mu_);
    return started_ > seen_.version ? started_ : 0;
  }

 private:
  std::unique_ptr<Session> owned_;
  Session* s_;
  mutable absl::Mutex mu_;  // WaitUpdate runs on the engine's thread and its copy thread
  UpdateSeen seen_ ABSL_GUARDED_BY(mu_);
  int64_t started_ ABSL_GUARDED_BY(mu_) = 0;  // the newest Update's version UpdateWithPush began
};

}  // namespace stallfree
