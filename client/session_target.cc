#include "client/session_target.h"

#include <algorithm>
#include <utility>

namespace stallfree {

v1::DType ToProto(DType t) { return t == DType::kBf16 ? v1::DTYPE_BF16 : v1::DTYPE_FP32; }
DType FromProto(v1::DType t) { return t == v1::DTYPE_BF16 ? DType::kBf16 : DType::kFp32; }

absl::Status SessionTarget::Register(const std::vector<Param>& params, DType param_dtype,
                                     uint32_t param_slots) {
  std::vector<ParamSpec> specs;
  specs.reserve(params.size());
  for (const Param& p : params) specs.push_back({p.name, p.shape, ToProto(p.grad_dtype)});
  return s_->RegisterParams(specs, ToProto(param_dtype), param_slots);
}

absl::StatusOr<int64_t> SessionTarget::ParamNumel(const std::string& name) const {
  absl::StatusOr<const v1::ParamLayout*> p = s_->Param(name);
  if (!p.ok()) return p.status();
  return static_cast<int64_t>((*p)->numel());
}

const void* SessionTarget::ParamSlot(uint32_t slot, const std::string& name, DType out) const {
  if (out == DType::kBf16) return s_->ParamsBf16(slot, name);
  return s_->ParamsFp32(slot, name);
}

absl::Status SessionTarget::Push(int64_t step, uint32_t slot, float scale) {
  return s_->Push(step, slot, scale).status();
}

absl::Status SessionTarget::UpdateWithPush(int64_t step, const AdamW& hyper,
                                           uint32_t param_slot, DType out, uint32_t grad_slot,
                                           float push_scale,
                                           const std::vector<std::string>& skip_params) {
  v1::AdamWHyper h;
  h.set_lr(hyper.lr);
  h.set_beta1(hyper.beta1);
  h.set_beta2(hyper.beta2);
  h.set_eps(hyper.eps);
  h.set_weight_decay(hyper.weight_decay);
  absl::Status st = s_->UpdateWithPush(step, h, param_slot, ToProto(out), grad_slot, push_scale,
                                       skip_params, hyper.predict);
  if (st.ok()) {
    absl::MutexLock lock(&mu_);
    started_ = std::max(started_, step);
  }
  return st;
}

absl::Status SessionTarget::WaitUpdate(int64_t min_version) {
  {
    // A version a WaitUpdate has already seen is ready (versions only grow until a Restore,
    // which forgets them): no round trip to the daemon.
    absl::MutexLock lock(&mu_);
    if (seen_.version >= min_version && min_version > 0) return absl::OkStatus();
  }
  absl::StatusOr<v1::WaitUpdateResponse> got = s_->WaitUpdate(min_version);
  if (!got.ok()) return got.status();
  absl::MutexLock lock(&mu_);
  if (got->version() > seen_.version) seen_ = {got->version(), got->update_seconds()};
  return absl::OkStatus();
}

absl::StatusOr<OffloadTarget::HandOver> SessionTarget::HandOverColumns(
    const std::vector<ColumnMove>& moves) {
  absl::StatusOr<v1::MigrateColumnsResponse> got = s_->HandOverColumns(moves);
  if (!got.ok()) return got.status();
  HandOver out;
  out.pushes = got->pushes();
  out.steps.emplace_back(got->steps().begin(), got->steps().end());
  for (const v1::OutgoingSteps& more : got->more())
    out.steps.emplace_back(more.steps().begin(), more.steps().end());
  return out;
}

absl::Status SessionTarget::Checkpoint(const std::string& tag) {
  return s_->Checkpoint(tag).status();
}

absl::Status SessionTarget::Restore(const std::string& tag, DType out) {
  {
    absl::MutexLock lock(&mu_);
    seen_ = UpdateSeen();
    started_ = 0;
  }
  return s_->Restore(tag, ToProto(out)).status();
}

absl::Status SessionTarget::ImportState(const std::string& bytes, DType out) {
  {
    absl::MutexLock lock(&mu_);
    seen_ = UpdateSeen();
    started_ = 0;
  }
  return s_->ImportState(bytes.data(), bytes.size(), ToProto(out)).status();
}

}  // namespace stallfree
