#include "client/session_target.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"

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

absl::StatusOr<SessionTarget::Adopted> SessionTarget::Recover(uint64_t generation,
                                                             const absl::Status& why) {
  const double wait_s = reattach_s_.load();
  if (wait_s <= 0 || !absl::IsUnavailable(why)) return why;
  std::unique_lock<std::shared_mutex> alone(calls_mu_);
  if (s_->generation() != generation) {  // another thread re-attached since the call began
    MutexLock lock(&mu_);
    return adopted_;
  }
  absl::Status lost = why;
  for (int attempt = 0; attempt < kMaxRecoveries; ++attempt) {
    SF_LOG(kWarning, "session %d: %s; re-attaching (waiting up to %.0f s for a stallfreed)",
           s_->ref().session_id(), lost.ToString(), wait_s);
    absl::StatusOr<Session::Adopted> back = s_->Reattach(wait_s);
    // A daemon that cannot take the state back (torn, refused) is a lost daemon to the caller
    // as well: UNAVAILABLE, whose recovery is a checkpoint's.
    if (!back.ok())
      return absl::UnavailableError(
          absl::StrCat(back.status().ToString(), " (after: ", why.message(), ")"));
    Adopted a{back->version, back->pushes_since_update, back->handovers};
    bool resend = false;
    SentUpdate redo;
    int64_t pushes_before = 0;
    {
      MutexLock lock(&mu_);
      if (started_ > back->version && sent_.step == started_) {
        resend = true;
        redo = sent_;
        pushes_before = pushes_before_sent_;
      }
    }
    if (resend) {
      // The daemon that died had accepted the Update and not run it: its round's pushes must
      // all be there, and the Update goes again as it was.
      if (back->pushes_since_update != pushes_before)
        return absl::FailedPreconditionError(absl::StrCat(
            "the state taken back has ", back->pushes_since_update, " pushes after version ",
            back->version, ", but the Update of step ", redo.step, " followed ", pushes_before,
            ": restore a checkpoint"));
      absl::Status sent = SendUpdate(redo);
      // The daemon that took the session back is gone too: once more, with the next one.
      if (absl::IsUnavailable(sent)) {
        lost = sent;
        continue;
      }
      RETURN_IF_ERROR(sent);
      a.pushes_since_update = 0;  // counted from that Update on, as the daemon will
    }
    MutexLock lock(&mu_);
    adopted_ = a;
    ++reattached_;
    if (resend) ++resent_;
    SF_LOG(kInfo, "session %d: taken back at version %d%s", s_->ref().session_id(), a.version,
           resend ? absl::StrCat("; the Update of step ", redo.step, " sent again") : "");
    return a;
  }
  return absl::UnavailableError(absl::StrCat("stallfreed went away ", kMaxRecoveries,
                                             " times while session ", s_->ref().session_id(),
                                             " was taken back (last: ", lost.message(), ")"));
}

absl::Status SessionTarget::Resilient(const std::function<absl::Status()>& call,
                                      const std::function<bool(const Adopted&)>& done) {
  uint64_t generation;
  absl::Status st;
  {
    std::shared_lock<std::shared_mutex> shared(calls_mu_);
    generation = s_->generation();
    st = call();
  }
  // A daemon that dies again while the call is retried (a crash loop, an operator's second
  // restart) is recovered from again: each recovery waits up to reattach_s for a daemon, and a
  // call gives up after kMaxRecoveries of them.
  for (int recovered = 0; !st.ok() && recovered < kMaxRecoveries; ++recovered) {
    absl::StatusOr<Adopted> a = Recover(generation, st);
    if (!a.ok()) return a.status();
    if (done && done(*a)) return absl::OkStatus();
    std::shared_lock<std::shared_mutex> shared(calls_mu_);
    generation = s_->generation();
    st = call();
  }
  return st;
}

absl::Status SessionTarget::Push(int64_t step, uint32_t slot, float scale) {
  int64_t before;
  {
    MutexLock lock(&mu_);
    before = pushes_;
  }
  // Done already if the state taken back counts it.
  RETURN_IF_ERROR(Resilient([&] { return s_->Push(step, slot, scale).status(); },
                            [&](const Adopted& a) { return a.pushes_since_update > before; }));
  MutexLock lock(&mu_);
  ++pushes_;
  return absl::OkStatus();
}

absl::Status SessionTarget::SendUpdate(const SentUpdate& u) {
  v1::AdamWHyper h;
  h.set_lr(u.hyper.lr);
  h.set_beta1(u.hyper.beta1);
  h.set_beta2(u.hyper.beta2);
  h.set_eps(u.hyper.eps);
  h.set_weight_decay(u.hyper.weight_decay);
  return s_->UpdateWithPush(u.step, h, u.param_slot, ToProto(u.out), u.grad_slot, u.push_scale,
                            u.skip_params, u.hyper.predict);
}

absl::Status SessionTarget::UpdateWithPush(int64_t step, const AdamW& hyper,
                                           uint32_t param_slot, DType out, uint32_t grad_slot,
                                           float push_scale,
                                           const std::vector<std::string>& skip_params) {
  const SentUpdate u{step, hyper, param_slot, out, grad_slot, push_scale, skip_params};
  int64_t before;
  {
    MutexLock lock(&mu_);
    before = pushes_;
  }
  // Done already if the state taken back has its version.
  RETURN_IF_ERROR(Resilient([&] { return SendUpdate(u); },
                            [&](const Adopted& a) { return a.version >= step; }));
  MutexLock lock(&mu_);
  started_ = std::max(started_, step);
  sent_ = u;
  pushes_before_sent_ = before;
  pushes_ = 0;
  return absl::OkStatus();
}

absl::Status SessionTarget::WaitUpdate(int64_t min_version) {
  {
    // A version a WaitUpdate has already seen is ready (versions only grow until a Restore,
    // which forgets them): no round trip to the daemon.
    MutexLock lock(&mu_);
    if (seen_.version >= min_version && min_version > 0) return absl::OkStatus();
  }
  absl::StatusOr<v1::WaitUpdateResponse> got;
  // After a re-attach the Update is there or sent again (Recover): the wait goes on.
  RETURN_IF_ERROR(Resilient([&] {
    got = s_->WaitUpdate(min_version);
    return got.status();
  }));
  MutexLock lock(&mu_);
  if (got->version() > seen_.version) seen_ = {got->version(), got->update_seconds()};
  return absl::OkStatus();
}

absl::StatusOr<OffloadTarget::HandOver> SessionTarget::HandOverColumns(
    const std::vector<ColumnMove>& moves) {
  // Sent with the handovers the session finished before it: a handover the daemon that died
  // was in the middle of is finished by the one that takes the session back, and one done
  // before its answer reached this process is answered again (the session's journal keeps the
  // answer), so the call sent again after a re-attach exchanges nothing twice. A session this
  // target did not register has no count known: a lost daemon then fails the call if the
  // re-attach shows a handover done (sending it again would exchange the columns back).
  const int64_t before = s_->handovers();
  bool answer_lost = false;
  absl::StatusOr<v1::MigrateColumnsResponse> got;
  RETURN_IF_ERROR(Resilient(
      [&] {
        got = s_->HandOverColumns(moves, before >= 0 ? std::optional<int64_t>(before)
                                                     : std::nullopt);
        return got.status();
      },
      [&](const Adopted& a) { return answer_lost = before < 0 && a.handovers > 0; }));
  if (answer_lost)
    return absl::UnavailableError(absl::StrCat(
        "stallfreed went away as it answered a handover of columns of session ",
        s_->ref().session_id(), " (or may have: this process did not register it, so it cannot "
        "ask for the answer again); the handover's answer is lost: restore a checkpoint"));
  HandOver out;
  out.pushes = got->pushes();
  out.steps.emplace_back(got->steps().begin(), got->steps().end());
  for (const v1::OutgoingSteps& more : got->more())
    out.steps.emplace_back(more.steps().begin(), more.steps().end());
  return out;
}

absl::Status SessionTarget::Checkpoint(const std::string& tag) {
  return Resilient([&] { return s_->Checkpoint(tag).status(); });
}

absl::StatusOr<std::string> SessionTarget::ReadCheckpoint(const std::string& tag,
                                                          bool delete_after) {
  absl::StatusOr<std::string> got;
  RETURN_IF_ERROR(Resilient([&] {
    got = s_->ReadCheckpointBytes(tag, delete_after);
    return got.status();
  }));
  return got;
}

absl::StatusOr<std::string> SessionTarget::ExportState() {
  absl::StatusOr<std::string> got;
  RETURN_IF_ERROR(Resilient([&] {
    got = s_->ExportState();
    return got.status();
  }));
  return got;
}

absl::Status SessionTarget::Restore(const std::string& tag, DType out) {
  {
    MutexLock lock(&mu_);
    seen_ = UpdateSeen();
    started_ = pushes_ = 0;
  }
  return Resilient([&] { return s_->Restore(tag, ToProto(out)).status(); });
}

absl::Status SessionTarget::ImportState(const std::string& bytes, DType out) {
  {
    MutexLock lock(&mu_);
    seen_ = UpdateSeen();
    started_ = pushes_ = 0;
  }
  return Resilient(
      [&] { return s_->ImportState(bytes.data(), bytes.size(), ToProto(out)).status(); });
}

}  // namespace stallfree
