#include "server/offload_session.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstring>
#include <thread>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "common/tbb_sync.h"

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/le_bytes.h"
#include "common/log.h"
#include "common/status.h"
#include "kernels/undo_log.h"
#include "server/requests.h"

namespace stallfree {
namespace {

using Clock = OffloadSession::Clock;

// The first of `cells` (landing cells, in element order) at element `at` or after.
template <class Cells>
typename Cells::const_iterator CellsFrom(const Cells& cells, uint64_t at) {
  return std::lower_bound(cells.begin(), cells.end(), at,
                          [](const auto& x, uint64_t a) { return x.at < a; });
}
constexpr uint64_t kPage = 4096;
constexpr int64_t kChunk = int64_t{1} << 16;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
int64_t Nanos(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
}

// Runs fn(begin, end) over [0, n) in chunks, in parallel on the current arena.
template <typename Fn>
void ParallelChunks(int64_t n, Fn fn) {
  if (n <= kChunk) {
    if (n > 0) fn(0, n);
    return;
  }
  stallfree::ParallelFor(tbb::blocked_range<int64_t>(0, n, kChunk),
                    [&](const tbb::blocked_range<int64_t>& r) { fn(r.begin(), r.end()); });
}

// A layout's parameters against a checkpoint header's (MatchCheckpointParams).
absl::Status MatchHeader(const SessionLayout& layout, const StateHeader& header,
                         const std::string& what) {
  return MatchCheckpointParams(header, RecordParamsOf(layout), what);
}

}  // namespace

absl::Status PinnedBudget::Reserve(uint64_t bytes) {
  const uint64_t before = reserved_.fetch_add(bytes);
  if (limit_ == 0 || before + bytes <= limit_) return absl::OkStatus();
  reserved_.fetch_sub(bytes);
  return absl::ResourceExhaustedError(absl::StrCat(
      "params: the session needs ", bytes, " bytes of pinned memory, but only ",
      limit_ - std::min(before, limit_), " of the daemon's budget of ", limit_,
      " bytes are free"));
}

OffloadSession::OffloadSession(uint64_t id, std::string token, std::string name, int32_t rank,
                               pid_t pid, Env env)
    : id_(id), token_(std::move(token)), name_(std::move(name)), rank_(rank),
      created_(Clock::now()), env_(env), strand_(std::make_shared<Strand>(env.arena)),
      pid_(pid) {}

OffloadSession::~OffloadSession() { Release(); }

void OffloadSession::Release() {
  std::unique_ptr<MappedRegion> region, state;
  uint64_t reserved, pinned;
  {
    MutexLock lock(&mu_);
    region = std::move(region_);
    state = std::move(state_);
    record_.reset();  // it and the journal point into the state
    journal_.reset();
    master_ = m_ = v_ = acc_ = nullptr;
    reserved = std::exchange(reserved_bytes_, 0);
    pinned = std::exchange(pinned_bytes_, 0);
  }
  // Unmapped before the counters say so.
  region.reset();
  state.reset();
  if (reserved > 0) env_.budget->Release(reserved);
  if (pinned > 0) env_.counters->pinned_bytes.fetch_sub(pinned);
}

// ---- Control.

absl::Status OffloadSession::BeginRegister(uint64_t layout_bytes) {
  MutexLock lock(&mu_);
  if (registered_ || registering_)
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id_, " already registered its parameters"));
  if (absl::Status st = env_.budget->Reserve(layout_bytes); !st.ok()) return st;
  registering_ = true;
  reserved_bytes_ = layout_bytes;
  return absl::OkStatus();
}

const SessionLayout* OffloadSession::layout() const {
  MutexLock lock(&mu_);
  return registered_ ? layout_.get() : nullptr;
}

absl::StatusOr<SessionFds> OffloadSession::Attach(uid_t uid, pid_t pid) {
  MutexLock lock(&mu_);
  if (closed_) return absl::NotFoundError(absl::StrCat("no session ", id_));
  if (!registered_)
    return absl::FailedPreconditionError("attach after RegisterParams: the region is not laid out");
  if (attached_)
    return absl::FailedPreconditionError(absl::StrCat("session ", id_, " is already attached"));
  attached_ = true;
  uid_ = uid;  // from SO_PEERCRED: the kernel's, never the request's
  pid_ = pid;
  identity_.uid = uid;
  identity_.generation = 1;
  identity_.adopt_nonce = 0;
  WriteIdentity();
  SF_LOG(kInfo, "session %d attached by pid %d uid %d", id_, pid, uid);
  return SessionFds{region_->fd(), region_->size(), state_->fd(), state_->size(),
                    identity_.generation};
}

absl::Status OffloadSession::CheckLoadable() const {
  MutexLock lock(&mu_);
  if (updated_once_ || update_running_)
    return absl::FailedPreconditionError(
        "LoadParams after the first Update would discard optimizer state");
  if (importing_)
    return absl::FailedPreconditionError(absl::StrCat(
        "LoadParams while an ImportState of session ", id_, " is in progress"));
  return absl::OkStatus();
}

absl::Status OffloadSession::BeginUpdate(int64_t step) {
  MutexLock lock(&mu_);
  if (update_running_)
    return absl::AbortedError(absl::StrCat("step: the update of step ", last_step_,
                                           " is still running for session ", id_));
  if (step <= last_step_)
    return absl::FailedPreconditionError(absl::StrCat(
        "step: ", step, " is not after the last update's step ", last_step_));
  if (importing_)
    return absl::FailedPreconditionError(absl::StrCat(
        "step: an ImportState of session ", id_, " is in progress; finish it first"));
  if (state_lost_)
    return absl::FailedPreconditionError(absl::StrCat(
        "step: an ImportState of session ", id_, " failed half way and left its state "
        "incomplete; import a whole state (or Restore a checkpoint) before the next Update"));
  update_running_ = true;
  last_step_ = step;
  return absl::OkStatus();
}

absl::Status OffloadSession::BeginRestore() {
  MutexLock lock(&mu_);
  if (update_running_)
    return absl::AbortedError(absl::StrCat("the update of step ", last_step_,
                                           " is still running for session ", id_));
  update_running_ = true;
  return absl::OkStatus();
}

absl::Status OffloadSession::Wait(int64_t min_version, Clock::time_point deadline,
                                  std::string bound, const WaitDone& done) {
  WaitResult ready;
  {
    MutexLock lock(&mu_);
    if (closed_) return absl::AbortedError(closed_message_);
    if (version_ == 0 || version_ < min_version) {
      if (!update_running_ && last_step_ < min_version)
        return absl::FailedPreconditionError(
            absl::StrCat("min_version: ", min_version,
                         " was never requested by an Update (last step ", last_step_, ")"));
      waiters_.push_back(Waiter{min_version, deadline, std::move(bound), done});
      return absl::OkStatus();
    }
    ready = {version_, ready_slot_, ready_dtype_, last_update_seconds_};  // the newest version
  }
  done(ready);
  return absl::OkStatus();
}

void OffloadSession::ExpireWaiters(Clock::time_point now) {
  std::vector<Waiter> expired;
  {
    MutexLock lock(&mu_);
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->deadline <= now) {
        expired.push_back(std::move(*it));
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // The daemon is alive and the Update goes on: the caller may wait again (offload.proto).
  for (Waiter& w : expired)
    w.done(absl::DeadlineExceededError(absl::StrCat(
        "min_version: version ", w.min_version, " not ready after ", w.bound,
        ": its Update is still queued or running; the session is intact, and a WaitUpdate "
        "again returns it once it is done")));
}

uint64_t OffloadSession::MarkClosed(const std::string& waiter_message) {
  std::vector<Waiter> waiters;
  uint64_t bytes;
  {
    MutexLock lock(&mu_);
    closed_ = true;
    closed_message_ = waiter_message;
    waiters.swap(waiters_);
    bytes = reserved_bytes_;
    // Generation 0: closed by its daemon (Close, an operator's close, a reclaim), never to be
    // taken back by a later one (SessionManager::Adopt).
    if (registered_ && record_ != nullptr) {
      identity_.generation = 0;
      WriteIdentity();
    }
  }
  for (Waiter& w : waiters) w.done(absl::AbortedError(waiter_message));
  return bytes;
}

pid_t OffloadSession::pid() const {
  MutexLock lock(&mu_);
  return pid_;
}

std::optional<uid_t> OffloadSession::uid() const {
  MutexLock lock(&mu_);
  if (!attached_) return std::nullopt;
  return uid_;
}

v1::SessionInfo OffloadSession::Info() const {
  v1::SessionInfo info;
  MutexLock lock(&mu_);
  info.set_session_id(id_);
  info.set_name(name_);
  info.set_rank(rank_);
  info.set_pid(pid_);
  if (attached_) info.set_uid(uid_);
  info.set_attached(attached_);
  if (registered_) {
    info.set_params(static_cast<int64_t>(layout_->params.size()));
    int64_t elems = 0;
    for (const ParamLayout& p : layout_->params) elems += p.numel;
    info.set_param_elements(elems);
    info.set_region_bytes(layout_->region.region_bytes());
  }
  info.set_pinned_bytes(pinned_bytes_);
  info.set_last_step(last_step_);
  info.set_version(version_);
  info.set_pushes(pushes_);
  info.set_updates(updates_);
  info.set_update_running(update_running_);
  info.set_age_seconds(Seconds(Clock::now() - created_));
  return info;
}

uint64_t OffloadSession::generation() const {
  MutexLock lock(&mu_);
  return identity_.generation;
}

void OffloadSession::Adopt(SessionLayout layout, std::unique_ptr<MappedRegion> region,
                           std::unique_ptr<MappedRegion> state, SessionIdentity identity,
                           const SessionCommit& commit, uid_t uid, pid_t pid,
                           uint64_t nonce, bool new_generation) {
  // The work state, before the session is published (nothing is posted to it yet).
  col_steps_ = commit.col_steps;
  landing_pending_ = false;
  for (const std::vector<int64_t>& steps : col_steps_)
    for (int64_t t : steps) landing_pending_ = landing_pending_ || t < 0;
  acc_stale_ = commit.acc_stale;
  has_state_ = commit.has_state;
  MutexLock lock(&mu_);
  reserved_bytes_ = layout.pinned_bytes();
  region_ = std::move(region);
  state_ = std::move(state);
  record_ = std::make_unique<SessionRecord>(state_->data(), layout.arrays_offset);
  journal_ = std::make_unique<WorkJournal>(state_->data() + layout.journal_offset, layout.journal);
  float* base = reinterpret_cast<float*>(state_->data() + layout.arrays_offset);
  const uint64_t stride = layout.state_stride;
  master_ = base;
  m_ = base + stride;
  v_ = base + 2 * stride;
  acc_ = base + 3 * stride;
  layout_ = std::make_unique<const SessionLayout>(std::move(layout));
  registered_ = attached_ = true;
  uid_ = uid;
  pid_ = pid;
  updated_once_ = commit.updated_once;
  version_ = commit.version;
  last_step_ = committed_step_ = commit.last_step;
  pushes_since_update_ = commit.pushes_since_update;
  handovers_ = commit.handovers;
  ready_slot_ = commit.ready_slot;
  ready_dtype_ = static_cast<v1::DType>(commit.ready_dtype);
  identity_ = std::move(identity);
  if (new_generation) {  // not for a state the fd store passed (its process adopts it next)
    ++identity_.generation;
    identity_.adopt_nonce = nonce;
    WriteIdentity();
  }
  pinned_bytes_ = region_->size() + state_->size();
  env_.counters->pinned_bytes.fetch_add(pinned_bytes_);
  if (new_generation)
    SF_LOG(kInfo, "session %d adopted (generation %d) by pid %d uid %d: version %d, %d pushes "
           "since it", id_, identity_.generation, pid, uid, version_, pushes_since_update_);
  else
    SF_LOG(kInfo, "session '%s' (uid %d, generation %d) taken from the service manager's fd "
           "store: version %d, %d pushes since it", name_, uid, identity_.generation, version_,
           pushes_since_update_);
}

int OffloadSession::StateFd() const {
  MutexLock lock(&mu_);
  return state_ == nullptr ? -1 : state_->fd();
}

int OffloadSession::RegionFd() const {
  MutexLock lock(&mu_);
  return region_ == nullptr ? -1 : region_->fd();
}

SessionCommit OffloadSession::CommitOf(RecordBusy busy, int64_t busy_step) {
  SessionCommit c;
  c.busy = busy;
  if (busy == RecordBusy::kNone && state_lost_) c.busy = RecordBusy::kRestore;
  c.busy_step = busy_step;
  c.updated_once = updated_once_;
  c.has_state = has_state_;
  c.acc_stale = acc_stale_;
  c.version = version_;
  c.last_step = committed_step_;
  c.pushes_since_update = pushes_since_update_;
  c.handovers = handovers_;
  c.ready_slot = ready_slot_;
  c.ready_dtype = static_cast<uint32_t>(ready_dtype_);
  return c;  // the column steps: WriteCommit takes col_steps_ as they are
}

void OffloadSession::WriteCommit(const SessionCommit& commit) {
  absl::StatusOr<uint64_t> seq = record_->Commit(commit, &col_steps_);
  if (!seq.ok())
    SF_LOG(kError, "session %d: its record's commit failed (%s): a restarted daemon could not "
           "adopt it", id_, seq.status().ToString());
}

void OffloadSession::CommitRecord(RecordBusy busy, int64_t busy_step) {
  SessionCommit c;
  {
    MutexLock lock(&mu_);
    c = CommitOf(busy, busy_step);
  }
  WriteCommit(c);
}

void OffloadSession::WriteIdentity() {
  absl::Status st = record_->WriteIdentity(identity_);
  if (!st.ok())
    SF_LOG(kError, "session %d: its record's identity was not written (%s)", id_, st.ToString());
}

// ---- Work.

uint8_t* OffloadSession::GradSlot(uint32_t s) const {
  const v1::RegionLayout& l = layout_->region;
  return region_->data() + l.grad_slot_offset() + s * l.grad_slot_bytes();
}

uint8_t* OffloadSession::ParamSlot(uint32_t s) const {
  const v1::RegionLayout& l = layout_->region;
  return region_->data() + l.param_slot_offset() + s * l.param_slot_bytes();
}

float* OffloadSession::Staging() const {
  return reinterpret_cast<float*>(region_->data() + layout_->region.staging_offset());
}

std::vector<CheckpointArrays> OffloadSession::StateArrays() const {
  std::vector<CheckpointArrays> arrays;
  for (const ParamLayout& p : layout_->params) {
    const uint64_t e = p.elem_offset;
    arrays.push_back({master_ + e, m_ + e, v_ + e, acc_ + e, p.numel});
  }
  return arrays;
}

bool OffloadSession::PrepareAccumulator(AccumulatorUse use) {
  const bool stale = acc_stale_;
  switch (use) {
    case AccumulatorUse::kWholePush:
      // Every element of every parameter is written: the stale sums are overwritten (no
      // clearing pass; the padding between parameters is never written and stays zero).
      acc_stale_ = false;
      return stale;
    case AccumulatorUse::kFusedUpdate:
      // Nothing pushed since the last Update: the sums are the fused push's gradients alone;
      // the stale accumulator is neither read nor cleared.
      acc_stale_ = true;
      return stale;
    case AccumulatorUse::kRestored:
      acc_stale_ = false;
      return false;
    case AccumulatorUse::kPartialPush:
    case AccumulatorUse::kUpdate:  // no push since the last Update: a zero gradient
    case AccumulatorUse::kSnapshot:  // the file holds the logical accumulator
      if (stale) {
        ParallelChunks(static_cast<int64_t>(layout_->total_elems), [&](int64_t b, int64_t e) {
          memset(acc_ + b, 0, (e - b) * sizeof(float));
        });
      }
      // An Update consumes the sums: logically zero after it.
      acc_stale_ = use == AccumulatorUse::kUpdate;
      return false;
  }
  return false;
}

absl::Status OffloadSession::Allocate(SessionLayout layout) {
  const v1::RegionLayout& rl = layout.region;
  auto region = MappedRegion::CreateMemfd(absl::StrCat("stallfree-session-", id_),
                                          rl.region_bytes(), env_.pin);
  // The optimizer state in a memfd too, whose descriptor the session's process receives with
  // the region's (Attach) and holds, so that the daemon's exit does not free it. Measured as
  // fast for the update as the daemon's anonymous huge-page memory (bench/optimizer_bench,
  // session_update_state_memfd_vs_anonymous).
  absl::StatusOr<std::unique_ptr<MappedRegion>> state =
      region.ok() ? MappedRegion::CreateMemfd(absl::StrCat("stallfree-session-", id_, "-state"),
                                              layout.state_bytes, env_.pin)
                  : region.status();
  if (region.ok() && state.ok()) {
    // Write every page of the region and the state once now (before mu_ is taken: this takes
    // seconds for GBs): on a VM whose memory is backed lazily the first write to a 4 KiB page
    // costs far more than the write (~3-5 s/GB; MAP_POPULATE of shmem does not back it), and the
    // first writes would otherwise land in the first steps' pushes and updates.
    for (MappedRegion* r : {region->get(), state->get()}) {
      uint8_t* base = r->data();
      const uint64_t size = r->size();
      ParallelChunks(static_cast<int64_t>((size + kPage - 1) / kPage), [&](int64_t b, int64_t e) {
        const uint64_t lo = b * kPage, hi = std::min<uint64_t>(size, e * kPage);
        memset(base + lo, 0, hi - lo);
      });
    }
  }
  mu_.Lock();
  registering_ = false;
  if (!region.ok() || !state.ok()) {
    env_.budget->Release(reserved_bytes_);
    reserved_bytes_ = 0;
    mu_.Unlock();
    return region.ok() ? state.status() : region.status();
  }
  const uint64_t elems = layout.total_elems;
  col_steps_.clear();
  for (const ParamLayout& p : layout.params) col_steps_.emplace_back(p.cols, 0);
  region_ = std::move(*region);
  state_ = std::move(*state);
  record_ = std::make_unique<SessionRecord>(state_->data(), layout.arrays_offset);
  identity_.format = layout.record_format;
  identity_.rank = rank_;
  identity_.name = name_;
  identity_.token_sha256 = TokenDigest(token_);
  identity_.param_dtype = static_cast<uint32_t>(layout.requested_param_dtype);
  identity_.param_slots = layout.requested_param_slots;
  for (const ParamLayout& p : layout.params)
    identity_.params.push_back({p.name, p.shape, static_cast<uint32_t>(p.grad_dtype)});
  identity_.total_elems = layout.total_elems;
  identity_.state_stride = layout.state_stride;
  identity_.region_bytes = rl.region_bytes();
  identity_.state_bytes = layout.state_bytes;
  WriteIdentity();
  journal_ = std::make_unique<WorkJournal>(state_->data() + layout.journal_offset, layout.journal);
  journal_->Format();
  float* base = reinterpret_cast<float*>(state_->data() + layout.arrays_offset);
  master_ = base;
  const uint64_t stride = layout.state_stride;
  m_ = base + stride;
  v_ = base + 2 * stride;
  acc_ = base + 3 * stride;
  layout_ = std::make_unique<const SessionLayout>(std::move(layout));
  registered_ = true;
  pinned_bytes_ = region_->size() + state_->size();
  env_.counters->pinned_bytes.fetch_add(pinned_bytes_);
  SF_LOG(kInfo, "session %d registered %d parameters, %d elements; region %d bytes%s", id_,
         layout_->params.size(), elems, rl.region_bytes(),
         region_->locked() ? " (mlocked)" : " (not mlocked)");
  mu_.Unlock();
  CommitRecord();  // its column steps written outside mu_ (a 1-D parameter has one per element)
  return absl::OkStatus();
}

void OffloadSession::LoadParams(const std::vector<LoadJob>& jobs) {
  ++epoch_;
  CommitRecord(RecordBusy::kLoad);
  has_state_ = true;
  for (const LoadJob& job : jobs) {
    const ParamLayout& p = layout_->params[job.param];
    const uint64_t e = p.elem_offset + job.first;
    const float* src = Staging() + job.staging_at;
    ParallelChunks(static_cast<int64_t>(job.count), [&](int64_t b, int64_t end) {
      memcpy(master_ + e + b, src + b, (end - b) * sizeof(float));
      memset(m_ + e + b, 0, (end - b) * sizeof(float));
      memset(v_ + e + b, 0, (end - b) * sizeof(float));
      memset(acc_ + e + b, 0, (end - b) * sizeof(float));
    });
    col_steps_[job.param].assign(static_cast<size_t>(p.cols), 0);
  }
  CommitRecord();
}

namespace {

// The plans of the journaled operations (session_journal.h), as the work journal keeps them.
std::string EncodeUpdatePlan(const UpdatePlan& plan) {
  LeWriter w;
  const kernels::AdamWConfig& c = plan.config;
  w.Put<double>(c.lr);
  w.Put<double>(c.beta1);
  w.Put<double>(c.beta2);
  w.Put<double>(c.eps);
  w.Put<double>(c.weight_decay);
  w.Put<int64_t>(c.step);
  w.Put<float>(c.grad_scale);
  w.Put<uint8_t>(c.predict_out ? 1 : 0);
  w.Put<uint32_t>(plan.param_slot);
  w.Put<uint32_t>(static_cast<uint32_t>(plan.out));
  w.Put<uint8_t>(plan.column_steps ? 1 : 0);
  w.Put<uint8_t>(plan.fuse_push ? 1 : 0);
  w.Put<uint32_t>(plan.grad_slot);
  w.Put<float>(plan.push_scale);
  w.Put<uint32_t>(static_cast<uint32_t>(plan.skip.size()));
  w.Bytes(plan.skip.data(), plan.skip.size());
  return std::string(w.out.begin(), w.out.end());
}

// The journal's bytes are the session process's to write (it holds the memfd): everything is
// checked against the layout, as a request would be.
absl::StatusOr<UpdatePlan> DecodeUpdatePlan(const std::string& bytes, const SessionLayout& layout) {
  LeReader r(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  UpdatePlan plan;
  kernels::AdamWConfig& c = plan.config;
  c.lr = r.Get<double>();
  c.beta1 = r.Get<double>();
  c.beta2 = r.Get<double>();
  c.eps = r.Get<double>();
  c.weight_decay = r.Get<double>();
  c.step = r.Get<int64_t>();
  c.grad_scale = r.Get<float>();
  c.predict_out = r.Get<uint8_t>() != 0;
  plan.param_slot = r.Get<uint32_t>();
  plan.out = static_cast<v1::DType>(r.Get<uint32_t>());
  plan.column_steps = r.Get<uint8_t>() != 0;
  plan.fuse_push = r.Get<uint8_t>() != 0;
  plan.grad_slot = r.Get<uint32_t>();
  plan.push_scale = r.Get<float>();
  const uint32_t nskip = r.Get<uint32_t>();
  if (r.ok() && nskip <= layout.params.size()) {
    plan.skip.resize(nskip);
    r.Bytes(plan.skip.data(), nskip);
  }
  if (!r.ok() || nskip != (plan.column_steps ? layout.params.size() : nskip) || c.step < 1 ||
      plan.param_slot >= layout.region.param_slots() || plan.grad_slot > 1 ||
      (plan.out != v1::DTYPE_FP32 && plan.out != v1::DTYPE_BF16) ||
      (plan.out == v1::DTYPE_FP32 && layout.region.param_dtype() == v1::DTYPE_BF16))
    return absl::DataLossError("the work journal's Update plan does not fit the session");
  return plan;
}

std::string EncodePushPlan(const PushPlan& plan) {
  LeWriter w;
  w.Put<float>(plan.scale);
  w.Put<uint8_t>(plan.whole ? 1 : 0);
  w.Put<uint64_t>(plan.bytes);
  w.Put<uint32_t>(static_cast<uint32_t>(plan.jobs.size()));
  for (const AccumulateJob& j : plan.jobs) {
    w.Put<uint64_t>(j.acc_offset);
    w.Put<uint64_t>(j.region_offset);
    w.Put<uint32_t>(static_cast<uint32_t>(j.type));
    w.Put<int64_t>(j.count);
  }
  return std::string(w.out.begin(), w.out.end());
}

absl::StatusOr<PushPlan> DecodePushPlan(const std::string& bytes, const SessionLayout& layout) {
  LeReader r(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  PushPlan plan;
  plan.scale = r.Get<float>();
  plan.whole = r.Get<uint8_t>() != 0;
  plan.bytes = r.Get<uint64_t>();
  const uint32_t n = r.Get<uint32_t>();
  bool ok = r.ok() && n <= bytes.size() / 28 && std::isfinite(plan.scale);
  for (uint32_t i = 0; ok && i < n; ++i) {
    AccumulateJob j{};
    j.acc_offset = r.Get<uint64_t>();
    j.region_offset = r.Get<uint64_t>();
    const uint32_t type = r.Get<uint32_t>();
    j.count = r.Get<int64_t>();
    j.type = type == static_cast<uint32_t>(kernels::GradType::kBf16) ? kernels::GradType::kBf16
                                                                       : kernels::GradType::kFp32;
    const uint64_t esize = j.type == kernels::GradType::kBf16 ? 2 : 4;
    const uint64_t count = static_cast<uint64_t>(j.count);
    ok = r.ok() && j.count >= 0 && j.acc_offset <= layout.total_elems &&
         count <= layout.total_elems - j.acc_offset &&
         j.region_offset <= layout.region.staging_offset() &&
         count <= (layout.region.staging_offset() - j.region_offset) / esize &&
         type <= static_cast<uint32_t>(kernels::GradType::kBf16);
    j.data = nullptr;
    plan.jobs.push_back(j);
  }
  if (!ok) return absl::DataLossError("the work journal's push plan does not fit the session");
  return plan;
}

// A handover's journal plan: the request's plans and the answer (outgoing step counts, the
// pushes in the handed-over accumulator), so that the daemon that finishes a cut-short exchange
// needs nothing else, and the answer can be given again (OffloadSession::HandOverAgain).
//   u32 plans i64 pushes | per plan: u32 param u64 n, then n x (i64 column i64 step_in
//   i64 step_out)
std::string EncodeHandoverPlan(const std::vector<MigratePlan>& plans,
                               const std::vector<MigrateResult>& results) {
  LeWriter w;
  w.Put<uint32_t>(static_cast<uint32_t>(plans.size()));
  w.Put<int64_t>(results.empty() ? 0 : results[0].pushes);
  for (size_t i = 0; i < plans.size(); ++i) {
    w.Put<uint32_t>(static_cast<uint32_t>(plans[i].param));
    w.Put<uint64_t>(plans[i].columns.size());
    for (size_t j = 0; j < plans[i].columns.size(); ++j) {
      w.Put<int64_t>(plans[i].columns[j]);
      w.Put<int64_t>(plans[i].steps[j]);
      w.Put<int64_t>(results[i].steps[j]);
    }
  }
  return std::string(w.out.begin(), w.out.end());
}

// The journal's bytes are the session process's to write: the plans are checked as a request's
// (PlanMigrate), the answer's counts as the record's.
absl::Status DecodeHandoverPlan(const std::string& bytes, const SessionLayout& layout,
                                std::vector<MigratePlan>* plans,
                                std::vector<MigrateResult>* results) {
  LeReader r(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  const uint32_t n_plans = r.Get<uint32_t>();
  const int64_t pushes = r.Get<int64_t>();
  bool ok = r.ok() && n_plans >= 1 && n_plans <= layout.params.size() && pushes >= 0;
  v1::MigrateColumnsRequest req;
  req.set_handover(true);
  results->assign(ok ? n_plans : 0, MigrateResult{});
  for (uint32_t i = 0; ok && i < n_plans; ++i) {
    const uint32_t param = r.Get<uint32_t>();
    const uint64_t n = r.Get<uint64_t>();
    ok = r.ok() && param < layout.params.size() && n <= bytes.size() / 24;
    if (!ok) break;
    v1::ColumnHandover h;
    h.set_param(layout.params[param].name);
    for (uint64_t j = 0; ok && j < n; ++j) {
      h.add_columns(r.Get<int64_t>());
      h.add_steps(r.Get<int64_t>());
      (*results)[i].steps.push_back(r.Get<int64_t>());
      ok = r.ok() && (*results)[i].steps.back() >= 0;
    }
    (*results)[i].pushes = pushes;
    if (i == 0) {
      req.set_param(h.param());
      *req.mutable_columns() = h.columns();
      *req.mutable_steps() = h.steps();
    } else {
      *req.add_more() = std::move(h);
    }
  }
  if (!ok || r.at() != bytes.size())
    return absl::DataLossError("the work journal's handover plan does not fit the session");
  absl::StatusOr<std::vector<MigratePlan>> planned = PlanMigrate(req, layout);
  if (!planned.ok())
    return absl::DataLossError(absl::StrCat("the work journal's handover plan does not fit the "
                                            "session: ", planned.status().message()));
  *plans = *std::move(planned);
  return absl::OkStatus();
}

}  // namespace

uint64_t OffloadSession::BeginWork(RecordBusy busy, int64_t busy_step, JournalOp op,
                                   const std::string& plan) {
  SessionCommit c;
  {
    MutexLock lock(&mu_);
    c = CommitOf(busy, busy_step);
  }
  c.journaled = op != JournalOp::kNone && plan.size() <= layout_->journal.plan_capacity;
  absl::StatusOr<uint64_t> seq = record_->Commit(c, &col_steps_);
  if (!seq.ok()) {
    SF_LOG(kError, "session %d: its record's commit failed (%s): a restarted daemon could not "
           "adopt it", id_, seq.status().ToString());
    journal_->ClearDone();
    return 0;
  }
  if (!c.journaled) {
    journal_->ClearDone();
    return *seq;
  }
  if (absl::Status st = journal_->Begin(*seq, op, plan); !st.ok())
    SF_LOG(kError, "session %d: %s", id_, st.ToString());
  return *seq;
}

int64_t OffloadSession::Accumulate(const PushPlan& plan) {
  ++epoch_;
  // A push of a request's own bytes cannot be finished by another daemon (the bytes die with
  // this one): it runs without a journal entry.
  bool from_region = true;
  for (const AccumulateJob& j : plan.jobs) from_region = from_region && j.data == nullptr;
  BeginWork(RecordBusy::kPush, 0, from_region ? JournalOp::kPush : JournalOp::kNone,
            from_region ? EncodePushPlan(plan) : std::string());
  const auto t0 = Clock::now();
  AccumulateArrays(plan);
  const auto took = Clock::now() - t0;
  env_.counters->accumulate_ns.fetch_add(Nanos(took));
  env_.counters->push_seconds.Observe(Seconds(took));
  env_.counters->push_bytes.Observe(static_cast<double>(plan.bytes));
  env_.counters->pushes.fetch_add(1);
  env_.counters->bytes_in.fetch_add(plan.bytes);
  return FinishPush();
}

void OffloadSession::AccumulateArrays(const PushPlan& plan) {
  const kernels::OptimizerKernel& k = kernels::DefaultCpuKernel();
  // A stale accumulator is overwritten (a whole push) or cleared and redone whole (Resume): a
  // unit cut short is run again from its start without its old elements, which are not saved
  // (the common ZenFlow push, the round's first, copies nothing).
  const bool save = !acc_stale_;
  const bool overwrite =
      PrepareAccumulator(plan.whole ? AccumulatorUse::kWholePush : AccumulatorUse::kPartialPush);
  const kernels::AccumulateMode mode =
      overwrite ? kernels::AccumulateMode::kOverwrite : kernels::AccumulateMode::kAdd;
  // Each journal unit adds the jobs' elements within it, in the jobs' order (an element two
  // jobs name gets their sums in that order, as one job after the other would give).
  const uint64_t total = layout_->total_elems;
  const uint64_t unit = layout_->journal.unit;
  const uint64_t units = (total + unit - 1) / unit;
  std::vector<uint32_t> first(units + 1, 0);  // per unit, its pieces in `pieces`
  for (const AccumulateJob& j : plan.jobs) {
    if (j.count <= 0) continue;
    const uint64_t u0 = j.acc_offset / unit;
    const uint64_t u1 = (j.acc_offset + j.count - 1) / unit;
    for (uint64_t u = u0; u <= u1; ++u) ++first[u + 1];
  }
  for (uint64_t u = 0; u < units; ++u) first[u + 1] += first[u];
  std::vector<uint32_t> pieces(first[units]);  // job indices, by unit
  {
    std::vector<uint32_t> fill(first.begin(), first.end() - 1);
    for (uint32_t i = 0; i < plan.jobs.size(); ++i) {
      const AccumulateJob& j = plan.jobs[i];
      if (j.count <= 0) continue;
      const uint64_t u0 = j.acc_offset / unit;
      const uint64_t u1 = (j.acc_offset + j.count - 1) / unit;
      for (uint64_t u = u0; u <= u1; ++u) pieces[fill[u]++] = i;
    }
  }
  journal_->Run(
      total, save ? std::vector<float*>{acc_} : std::vector<float*>{},
      [&](uint64_t b, uint64_t e) {
        const uint64_t u = b / unit;
        for (uint32_t at = first[u]; at < first[u + 1]; ++at) {
          const AccumulateJob& j = plan.jobs[pieces[at]];
          const uint64_t lo = std::max(b, j.acc_offset);
          const uint64_t hi = std::min(e, j.acc_offset + static_cast<uint64_t>(j.count));
          const uint64_t esize = j.type == kernels::GradType::kBf16 ? 2 : 4;
          const uint8_t* src =
              (j.data != nullptr ? j.data : region_->data() + j.region_offset) +
              (lo - j.acc_offset) * esize;
          k.Accumulate(acc_ + lo, src, j.type, plan.scale, static_cast<int64_t>(hi - lo), mode);
        }
      },
      [&](uint64_t u) { return first[u] == first[u + 1]; });
}

int64_t OffloadSession::FinishPush() {
  SessionCommit c;
  int64_t pushes;
  {
    MutexLock lock(&mu_);
    pushes_++;
    pushes = ++pushes_since_update_;
    c = CommitOf(RecordBusy::kNone, 0);
  }
  WriteCommit(c);
  return pushes;
}

void OffloadSession::Update(const UpdatePlan& plan) {
  ++epoch_;
  BeginWork(RecordBusy::kUpdate, plan.config.step, JournalOp::kUpdate, EncodeUpdatePlan(plan));
  const auto t0 = Clock::now();
  const uint64_t fused_bytes = UpdateArrays(plan);
  FinishUpdate(plan, Seconds(Clock::now() - t0), fused_bytes);
}

uint64_t OffloadSession::UpdateArrays(const UpdatePlan& plan) {
  has_state_ = true;
  const kernels::OptimizerKernel& k = kernels::DefaultCpuKernel();
  const kernels::AdamWConfig& cfg = plan.config;
  const bool bf16 = plan.out == v1::DTYPE_BF16;
  uint8_t* dst = ParamSlot(plan.param_slot);
  float* out32 = reinterpret_cast<float*>(dst);
  uint16_t* out16 = reinterpret_cast<uint16_t*>(dst);
  const bool acc_zero =
      PrepareAccumulator(plan.fuse_push ? AccumulatorUse::kFusedUpdate : AccumulatorUse::kUpdate);
  const uint64_t total = layout_->total_elems;
  const std::vector<float*> arrays = {master_, m_, v_};
  // The kernels write the parameter slot in the update's own pass (bf16, or fp32 with streaming
  // stores: no second pass over the master); with predict (column steps only) the value
  // predicted one step ahead, 2 p_new - p_old.
  auto out_at = [&](uint64_t e) {
    return bf16 ? kernels::ParamOut(out16 + e) : kernels::ParamOut::Fp32(out32 + e);
  };
  uint64_t fused_bytes = 0;
  // Columns handed over in this round arrived from the device with the round's step taken
  // there: the pass computes them like the others, and each unit then writes their state back
  // (and their values out as they are: their change is zero, so the prediction is the value)
  // before it is done, so that a unit done or rolled back holds them as they arrived.
  std::vector<LandingColumn> landed;
  const std::vector<LandingCell> cells =
      TakeLandings(plan.column_steps ? &plan.skip : nullptr, &landed);
  uint16_t* land16 = bf16 ? out16 : nullptr;
  float* land32 = bf16 ? nullptr : out32;
  auto finish = [&] {
    for (const LandingColumn& l : landed) col_steps_[l.param][l.column] = l.step;
    landing_pending_ = false;
  };
  // The kernels save each unit's elements as they change them (the journal's undo log), where
  // they keep one (the CPU backends; the oracle, forced by STALLFREE_CPU_KERNEL, does not); a
  // unit that handed-over columns land in is copied first, since LandCells writes it too.
  const WorkJournal::Saving saving = k.KeepsUndoLog() ? WorkJournal::Saving::kInKernels
                                                      : WorkJournal::Saving::kCopyFirst;
  const uint64_t unit = layout_->journal.unit;
  auto lands_in = [&](uint64_t u) {
    auto it = CellsFrom(cells, u * unit);
    return it != cells.end() && it->at < (u + 1) * unit;
  };
  if (!plan.column_steps) {
    journal_->Run(
        total, arrays,
        [&](uint64_t b, uint64_t e) {
          k.AdamW(cfg, master_ + b, m_ + b, v_ + b, acc_ + b, kernels::GradType::kFp32,
                  static_cast<int64_t>(e - b), out_at(b));
          LandCells(cells, b, e, land16, land32);
        },
        nullptr, saving, lands_in);
    for (std::vector<int64_t>& steps : col_steps_) std::fill(steps.begin(), steps.end(), cfg.step);
    finish();
    return 0;
  }
  const std::vector<ParamLayout>& params = layout_->params;
  std::vector<std::vector<float>> step_size(params.size()), bc2(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (plan.skip[i]) continue;
    std::vector<int64_t>& steps = col_steps_[i];
    for (int64_t& t : steps) ++t;
    step_size[i].resize(steps.size());
    bc2[i].resize(steps.size());
    kernels::MakeColumnConstants(cfg, steps.data(), params[i].cols, step_size[i].data(),
                                 bc2[i].data());
    if (plan.fuse_push) fused_bytes += params[i].numel * params[i].grad_element_bytes();
  }
  // Elements [lo, hi) of parameter i: a skipped one's current value goes out like the others'
  // (predicted: 2 p - p = p exactly); the others' AdamW over the whole rows and row pieces the
  // range holds.
  auto piece = [&](size_t i, uint64_t lo, uint64_t hi) {
    const ParamLayout& p = params[i];
    const uint64_t e0 = p.elem_offset;
    if (plan.skip[i]) {
      if (bf16) k.FloatToBf16(master_ + e0 + lo, out16 + e0 + lo, static_cast<int64_t>(hi - lo));
      else memcpy(out32 + e0 + lo, master_ + e0 + lo, (hi - lo) * sizeof(float));
      return;
    }
    const uint64_t cols = static_cast<uint64_t>(p.cols);
    for (uint64_t at = lo; at < hi;) {
      const uint64_t c0 = at % cols;
      const int64_t nr = c0 != 0 || hi - at < cols ? 1 : static_cast<int64_t>((hi - at) / cols);
      const int64_t nc = nr > 1 || (c0 == 0 && hi - at >= cols)
                             ? p.cols
                             : static_cast<int64_t>(std::min(cols - c0, hi - at));
      const uint64_t x = e0 + at;
      if (plan.fuse_push) {
        // The whole-slot push of grad_slot and this step in one pass (one read of the
        // accumulator, no write): bit-identical to Accumulate and then AdamWColumns.
        k.AccumulateAdamWColumns(cfg, step_size[i].data() + c0, bc2[i].data() + c0, master_ + x,
                                 m_ + x, v_ + x, acc_zero ? nullptr : acc_ + x,
                                 GradSlot(plan.grad_slot) + p.grad_offset +
                                     at * p.grad_element_bytes(),
                                 p.grad_type(), plan.push_scale, nr, nc, out_at(x));
      } else {
        k.AdamWColumns(cfg, step_size[i].data() + c0, bc2[i].data() + c0, master_ + x, m_ + x,
                       v_ + x, acc_ + x, kernels::GradType::kFp32, nr, nc, out_at(x));
      }
      at += static_cast<uint64_t>(nr * nc);
    }
  };
  journal_->Run(total, arrays, [&](uint64_t b, uint64_t e) {
    // The parameters that overlap [b, e) (laid out in order, padding between them).
    size_t i = static_cast<size_t>(
        std::upper_bound(params.begin(), params.end(), b,
                         [](uint64_t x, const ParamLayout& p) { return x < p.elem_offset; }) -
        params.begin());
    if (i > 0) --i;
    for (; i < params.size() && params[i].elem_offset < e; ++i) {
      const uint64_t start = params[i].elem_offset;
      const uint64_t end = start + static_cast<uint64_t>(params[i].numel);
      const uint64_t lo = std::max(b, start), hi = std::min(e, end);
      if (lo < hi) piece(i, lo - start, hi - start);
    }
    LandCells(cells, b, e, land16, land32);
  }, nullptr, saving, lands_in);
  finish();
  return fused_bytes;
}

void OffloadSession::FinishUpdate(const UpdatePlan& plan, double secs, uint64_t fused_bytes) {
  const kernels::AdamWConfig& cfg = plan.config;
  const bool bf16 = plan.out == v1::DTYPE_BF16;
  DaemonCounters* counters = env_.counters;
  counters->update_ns.fetch_add(static_cast<int64_t>(secs * 1e9));
  counters->update_seconds.Observe(secs);
  counters->updates.fetch_add(1);
  counters->bytes_out.fetch_add(layout_->total_elems * (bf16 ? 2 : 4));
  if (plan.fuse_push) {  // counted as the push it replaces
    counters->pushes.fetch_add(1);
    counters->bytes_in.fetch_add(fused_bytes);
  }
  std::vector<Waiter> ready;
  WaitResult result;
  {
    MutexLock lock(&mu_);
    update_running_ = false;
    updated_once_ = true;
    version_ = cfg.step;
    committed_step_ = cfg.step;
    last_step_ = std::max(last_step_, cfg.step);
    ready_slot_ = plan.param_slot;
    ready_dtype_ = plan.out;
    last_update_seconds_ = secs;
    updates_++;
    if (plan.fuse_push) pushes_++;
    pushes_since_update_ = 0;
    result = {version_, plan.param_slot, plan.out, secs};
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->min_version <= version_) {
        ready.push_back(std::move(*it));
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Committed before anyone hears of the version: a version a client saw is one the record has.
  CommitRecord();
  SF_LOG(kDebug, "session %d: update of step %d done in %.3f s", id_, cfg.step, secs);
  for (Waiter& w : ready) w.done(result);
}

absl::Status OffloadSession::Resume(const SessionCommit& commit) {
  RETURN_IF_ERROR(journal_->CheckHeader());
  if (commit.busy == RecordBusy::kNone) return absl::OkStatus();
  absl::StatusOr<JournalEntry> entry = journal_->Entry();
  if (!entry.ok() || entry->commit_sequence != commit.sequence) {
    // Begin never finished: no unit started, the arrays are the commit's.
    SF_LOG(kInfo, "session %d: the daemon before stopped as its %s began: nothing of it ran, "
           "and the state is where its commit says", id_, RecordBusyName(commit.busy));
    CommitRecord();
    return absl::OkStatus();
  }
  const JournalOp op = commit.busy == RecordBusy::kHandover ? JournalOp::kHandover
                       : commit.busy == RecordBusy::kUpdate   ? JournalOp::kUpdate
                       : commit.busy == RecordBusy::kPush     ? JournalOp::kPush
                                                              : JournalOp::kNone;
  if (op == JournalOp::kNone || entry->kind != op)
    return absl::DataLossError(absl::StrCat("the work journal's entry is not ",
                                            RecordBusyName(commit.busy),
                                            ", which its commit names"));
  if (op == JournalOp::kHandover) {
    std::vector<MigratePlan> plans;
    std::vector<MigrateResult> results;  // (the answer: decoded, and so checked, here unused)
    RETURN_IF_ERROR(DecodeHandoverPlan(entry->plan, *layout_, &plans, &results));
    const uint64_t done = journal_->done_units();
    RETURN_IF_ERROR(ExchangeColumns(plans));
    env_.counters->handovers_resumed.fetch_add(1);
    SF_LOG(kWarning, "session %d: a handover of columns cut short by the daemon before (%d "
           "pieces done) finished", id_, done);
    return absl::OkStatus();
  }
  const bool update = op == JournalOp::kUpdate;
  const auto t0 = Clock::now();
  const uint64_t total = layout_->total_elems;
  if (update) {
    absl::StatusOr<UpdatePlan> plan = DecodeUpdatePlan(entry->plan, *layout_);
    if (!plan.ok()) return plan.status();
    if (plan->config.step != commit.busy_step)
      return absl::DataLossError("the work journal's Update is not the step its commit names");
    RETURN_IF_ERROR(journal_->RollBackTorn(total, {master_, m_, v_}));
    const uint64_t done = journal_->done_units();
    const uint64_t fused_bytes = UpdateArrays(*plan);
    FinishUpdate(*plan, Seconds(Clock::now() - t0), fused_bytes);
    env_.counters->updates_resumed.fetch_add(1);
    SF_LOG(kWarning, "session %d: the Update of step %d, cut short by the daemon before (%d of "
           "%d units done), finished", id_, plan->config.step, done, layout_->journal.units);
    return absl::OkStatus();
  }
  absl::StatusOr<PushPlan> plan = DecodePushPlan(entry->plan, *layout_);
  if (!plan.ok()) return plan.status();
  // A push onto a stale accumulator saved nothing (AccumulateArrays): a whole one overwrites the
  // units not done, the one in flight included; one that began by clearing it is redone whole
  // from the cleared one.
  if (!commit.acc_stale) RETURN_IF_ERROR(journal_->RollBackTorn(total, {acc_}));
  if (commit.acc_stale && !plan->whole) journal_->ClearDone();
  const uint64_t done = journal_->done_units();
  AccumulateArrays(*plan);
  const int64_t pushes = FinishPush();
  env_.counters->pushes_resumed.fetch_add(1);
  SF_LOG(kWarning, "session %d: a push cut short by the daemon before (%d units done) finished: "
         "%d pushes since the last Update", id_, done, pushes);
  return absl::OkStatus();
}

AdoptResult OffloadSession::Standing() const {
  MutexLock lock(&mu_);
  return AdoptResult{id_,           identity_.generation, version_, committed_step_,
                     pushes_since_update_, handovers_};
}

namespace {
std::atomic<int64_t> answer_delay_us{0};
}  // namespace

void SetHandoverAnswerDelayForTesting(int64_t microseconds) { answer_delay_us.store(microseconds); }

std::vector<MigrateResult> OffloadSession::HandOver(const std::vector<MigratePlan>& plans) {
  ++epoch_;
  // Each column's state and its share of the round (the accumulator as it is logically) go out
  // to the four staging blocks; the incoming state lands in the arrays at once, and its column
  // is marked with its incoming step count (LandingMark), so that the round's Update writes it
  // back in place of what it computes there. The arrays and the marks are all a restarted
  // daemon needs: nothing waits in this process's memory. The exchange is journaled with its
  // answer (ExchangeColumns): a daemon that adopts the session after a kill inside it finishes
  // it, and a client whose answer was lost gets it again (HandOverAgain).
  std::vector<MigrateResult> results(plans.size());
  int64_t pushes = 0;
  if (!acc_stale_) {
    MutexLock lock(&mu_);
    pushes = std::max<int64_t>(1, pushes_since_update_);
  }
  for (size_t i = 0; i < plans.size(); ++i) {
    for (int64_t c : plans[i].columns)
      results[i].steps.push_back(StepOf(col_steps_[plans[i].param][c]));
    results[i].pushes = pushes;
  }
  BeginWork(RecordBusy::kHandover, 0, JournalOp::kHandover, EncodeHandoverPlan(plans, results));
  ExchangeColumns(plans).IgnoreError();  // (a fresh journal: no torn piece to refuse)
  const int64_t delay_us = answer_delay_us.load(std::memory_order_relaxed);
  if (delay_us > 0) {
    // Testing: the answer waits, done and committed, as a crash can find it.
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
  }
  return results;
}

absl::Status OffloadSession::ExchangeColumns(const std::vector<MigratePlan>& plans) {
  const auto t0 = Clock::now();
  // The cells of the exchange: plan after plan, each [rows, n] row-major (its staging blocks'
  // order), cut into pieces of a journal unit. A piece keeps its incoming values (the staging
  // blocks' first three) in its slot, writes the outgoing state to the staging blocks (first
  // phase: the arrays unchanged), then the kept incoming values to the arrays (second phase).
  std::vector<uint64_t> first_cell(plans.size() + 1, 0);
  for (size_t i = 0; i < plans.size(); ++i) {
    const uint64_t rows = static_cast<uint64_t>(layout_->params[plans[i].param].rows);
    first_cell[i + 1] = first_cell[i] + rows * plans[i].columns.size();
  }
  const uint64_t unit = layout_->journal.unit;
  const uint64_t pieces = (first_cell.back() + unit - 1) / unit;
  // Calls fn(plan, b, e, o) for the plan's cells [b, e) within the piece, o: where the first of
  // them is in the piece.
  auto segments = [&](uint64_t piece, auto fn) {
    const uint64_t lo = piece * unit, hi = std::min(first_cell.back(), lo + unit);
    for (size_t i = 0; i < plans.size(); ++i) {
      const uint64_t b = std::max(lo, first_cell[i]), e = std::min(hi, first_cell[i + 1]);
      if (b < e) fn(i, b - first_cell[i], e - first_cell[i], b - lo);
    }
  };
  auto block = [&](size_t i, int a) {
    const int64_t rows = layout_->params[plans[i].param].rows;
    return Staging() + plans[i].staging_at + a * rows * plans[i].columns.size();
  };
  // Calls fn(c, at) for the plan's cells [b, e), at: the cell's element in the arrays (row c / n,
  // the plan's column c % n), stepping along the rows (no division per cell).
  auto cells = [&](size_t i, uint64_t b, uint64_t e, auto fn) {
    const ParamLayout& p = layout_->params[plans[i].param];
    const std::vector<int64_t>& columns = plans[i].columns;
    const uint64_t n = columns.size(), cols = static_cast<uint64_t>(p.cols);
    uint64_t row = p.elem_offset + b / n * cols, j = b % n;
    for (uint64_t c = b; c < e; ++c) {
      fn(c, row + static_cast<uint64_t>(columns[j]));
      if (++j == n) {
        j = 0;
        row += cols;
      }
    }
  };
  float* state[4] = {master_, m_, v_, acc_};
  const bool acc_stale = acc_stale_;
  WorkJournal::PhasedWork work;
  work.save = [&](uint64_t piece, float* slot) {
    segments(piece, [&](size_t i, uint64_t b, uint64_t e, uint64_t o) {
      for (int a = 0; a < 3; ++a)
        memcpy(slot + a * unit + o, block(i, a) + b, (e - b) * sizeof(float));
    });
  };
  work.first = [&](uint64_t piece, const float*) {
    segments(piece, [&](size_t i, uint64_t b, uint64_t e, uint64_t) {
      float* out[4] = {block(i, 0), block(i, 1), block(i, 2), block(i, 3)};
      cells(i, b, e, [&](uint64_t c, uint64_t at) {
        for (int a = 0; a < 3; ++a) out[a][c] = state[a][at];
        out[3][c] = acc_stale ? 0.0f : state[3][at];
      });
    });
  };
  work.second = [&](uint64_t piece, const float* slot) {
    segments(piece, [&](size_t i, uint64_t b, uint64_t e, uint64_t o) {
      cells(i, b, e, [&](uint64_t c, uint64_t at) {
        for (int a = 0; a < 3; ++a) state[a][at] = slot[a * unit + o + (c - b)];
      });
    });
  };
  // Pieces a kill cut short (none on a journal Begin cleared) are finished first.
  RETURN_IF_ERROR(journal_->FinishTornPieces(pieces, work));
  journal_->RunPieces(pieces, work);
  int64_t moved = 0;
  for (const MigratePlan& plan : plans) {
    for (size_t j = 0; j < plan.columns.size(); ++j)
      col_steps_[plan.param][plan.columns[j]] = LandingMark(plan.steps[j]);
    moved += static_cast<int64_t>(plan.columns.size());
  }
  landing_pending_ = landing_pending_ || moved > 0;
  env_.counters->migrated_columns.fetch_add(2 * moved);
  env_.counters->migrate_seconds.Observe(Seconds(Clock::now() - t0));
  {
    MutexLock lock(&mu_);
    ++handovers_;
  }
  CommitRecord();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<MigrateResult>> OffloadSession::HandOverAgain(
    const std::vector<MigratePlan>& plans, int64_t handovers_before) {
  int64_t count;
  {
    MutexLock lock(&mu_);
    count = handovers_;
  }
  if (count == handovers_before) return HandOver(plans);
  if (count - 1 != handovers_before)  // (count >= 0: no overflow)
    return absl::FailedPreconditionError(absl::StrCat(
        "handovers_before: session ", id_, " has finished ", count, " handovers, not ",
        handovers_before, " or ", handovers_before + 1, ": this handover does not follow the "
        "session's last one; restore a checkpoint"));
  // Done already (by the daemon that died before answering, or finished by this one when it
  // took the session back): the answer again from the journal, if it is this handover's.
  absl::StatusOr<JournalEntry> entry = journal_->Entry();
  std::vector<MigratePlan> last;
  std::vector<MigrateResult> results;
  bool same = entry.ok() && entry->kind == JournalOp::kHandover &&
              DecodeHandoverPlan(entry->plan, *layout_, &last, &results).ok() &&
              last.size() == plans.size();
  for (size_t i = 0; same && i < plans.size(); ++i)
    same = last[i].param == plans[i].param && last[i].columns == plans[i].columns &&
           last[i].steps == plans[i].steps;
  if (!same)
    return absl::FailedPreconditionError(absl::StrCat(
        "handovers_before: session ", id_, "'s handover number ", count, " was done, but its "
        "answer is no longer kept or it moved other columns; restore a checkpoint"));
  env_.counters->handovers_answered_again.fetch_add(1);
  SF_LOG(kWarning, "session %d: handover %d was done before its answer was lost; answered again",
         id_, count);
  return results;
}

std::vector<OffloadSession::LandingCell> OffloadSession::TakeLandings(
    const std::vector<char>* skip, std::vector<LandingColumn>* columns) {
  std::vector<LandingCell> cells;
  if (!landing_pending_) return cells;
  for (size_t i = 0; i < layout_->params.size(); ++i) {
    const ParamLayout& p = layout_->params[i];
    std::vector<int64_t>& steps = col_steps_[i];
    for (int64_t c = 0; c < p.cols; ++c) {
      if (steps[c] >= 0) continue;
      const int64_t step = StepOf(steps[c]);
      columns->push_back({i, c, step});
      // The Update about to run adds its step to every column it does not skip.
      steps[c] = skip != nullptr && (*skip)[i] ? step : step - 1;
      for (int64_t r = 0; r < p.rows; ++r) {
        const uint64_t at = p.elem_offset + static_cast<uint64_t>(r * p.cols + c);
        cells.push_back({at, master_[at], m_[at], v_[at]});
      }
    }
  }
  std::sort(cells.begin(), cells.end(),
            [](const LandingCell& x, const LandingCell& y) { return x.at < y.at; });
  return cells;
}

void OffloadSession::LandCells(const std::vector<LandingCell>& cells, uint64_t b, uint64_t e,
                               uint16_t* out16, float* out32) {
  auto it = CellsFrom(cells, b);
  for (; it != cells.end() && it->at < e; ++it) {
    master_[it->at] = it->master;
    m_[it->at] = it->m;
    v_[it->at] = it->v;
    if (out16 != nullptr) out16[it->at] = FloatToBf16(it->master);
    if (out32 != nullptr) out32[it->at] = it->master;
  }
}

absl::StatusOr<StateHeader> OffloadSession::SnapshotHeader(std::optional<uid_t> owner) {
  if (landing_pending_)
      return absl::FailedPreconditionError(absl::StrCat(
          "session ", id_, " handed columns over in the middle of a round; checkpoint after the "
          "round's Update"));
  StateHeader header;
  header.session_name = name_;
  header.rank = rank_;
  if (owner) header.owner_uid = *owner;
  {
    MutexLock lock(&mu_);
    if (state_lost_)
      return absl::FailedPreconditionError(absl::StrCat(
          "session ", id_, ": an ImportState failed half way and left its state incomplete; "
          "there is nothing whole to checkpoint until an import or a Restore succeeds"));
    header.last_step = last_step_;
    header.version = version_;
  }
  PrepareAccumulator(AccumulatorUse::kSnapshot);
  const std::vector<StateParam> specs = RecordParamsOf(*layout_);
  for (size_t i = 0; i < specs.size(); ++i) header.params.push_back({specs[i], col_steps_[i]});
  return header;
}

absl::StatusOr<CheckpointWritten> OffloadSession::Snapshot(const std::string& path, uid_t owner,
                                                           int64_t* version) {
  ASSIGN_OR_RETURN(StateHeader header, SnapshotHeader(owner));
  const auto t0 = Clock::now();
  absl::StatusOr<CheckpointWritten> out = WriteCheckpoint(path, header, StateArrays());
  if (!out.ok()) return out.status();
  const double took = Seconds(Clock::now() - t0);
  env_.counters->checkpoint_seconds.Observe(took);
  env_.counters->checkpoint_bytes.Observe(static_cast<double>(out->bytes));
  SF_LOG(kInfo, "session %d: checkpoint %s, %d bytes in %.3f s", id_, out->path, out->bytes,
         took);
  *version = header.version;
  return out;
}

absl::StatusOr<StateHeader> OffloadSession::Restore(const std::string& path, uid_t owner,
                                                    const std::string& tag, v1::DType out,
                                                    uint64_t* file_bytes) {
  absl::StatusOr<StateHeader> header = ReadCheckpointHeader(path, file_bytes);
  absl::Status st = header.status();
  if (st.ok() && header->owner_uid.has_value() && *header->owner_uid != owner)
    st = absl::PermissionDeniedError(
        absl::StrCat("tag: checkpoint '", tag, "' belongs to uid ", *header->owner_uid));
  if (st.ok()) st = MatchHeader(*layout_, *header, absl::StrCat("tag: checkpoint '", tag, "'"));
  if (st.ok()) {
    // The reads verify the whole file before the first byte goes into the state.
    CommitRecord(RecordBusy::kRestore);
    st = ReadCheckpointArrays(path, *header, StateArrays());
    if (!st.ok()) CommitRecord();
  }
  if (st.ok()) Restored(*header, out);
  {
    MutexLock lock(&mu_);
    update_running_ = false;
  }
  if (!st.ok()) return st;
  SF_LOG(kInfo, "session %d: restored %s (version %d)", id_, path, header->version);
  return header;
}

void OffloadSession::Restored(const StateHeader& header, v1::DType out) {
  ++epoch_;
  has_state_ = true;
  PrepareAccumulator(AccumulatorUse::kRestored);
  uint8_t* dst = ParamSlot(0);
  for (size_t i = 0; i < layout_->params.size(); ++i) {
    const ParamLayout& p = layout_->params[i];
    col_steps_[i] = header.params[i].col_steps;
    const float* src = master_ + p.elem_offset;
    if (out == v1::DTYPE_BF16)
      kernels::DefaultCpuKernel().FloatToBf16(
          src, reinterpret_cast<uint16_t*>(dst) + p.elem_offset, p.numel);
    else
      memcpy(reinterpret_cast<float*>(dst) + p.elem_offset, src, p.numel * sizeof(float));
  }
  landing_pending_ = false;
  MutexLock lock(&mu_);
  last_step_ = committed_step_ = header.last_step;
  version_ = header.version;
  updated_once_ = true;
  ready_slot_ = 0;
  ready_dtype_ = out;
  pushes_since_update_ = 0;
  state_lost_ = false;
  WriteCommit(CommitOf(RecordBusy::kNone, 0));
}

absl::StatusOr<uint64_t> OffloadSession::ExportChunk(uint64_t offset, std::optional<uid_t> owner,
                                                     uint64_t* total, int64_t* version) {
  if (offset == 0) {
    export_.reset();
    ASSIGN_OR_RETURN(StateHeader header, SnapshotHeader(owner));
    export_ = std::make_unique<CheckpointExport>(header, StateArrays());
    if (!export_->status().ok()) {
      const absl::Status st = export_->status();
      export_.reset();
      return st;
    }
    export_epoch_ = epoch_;
    export_version_ = header.version;
    export_start_ = Clock::now();
  } else if (export_ == nullptr || offset != export_->done()) {
    const std::string was = export_ == nullptr
                                ? std::string("no export is in progress")
                                : absl::StrCat("the export is at ", export_->done());
    export_.reset();
    return absl::FailedPreconditionError(
        absl::StrCat("offset: ", offset, ", but ", was, "; start again at offset 0"));
  } else if (epoch_ != export_epoch_) {
    export_.reset();
    return absl::AbortedError(absl::StrCat(
        "offset: ", offset, ": session ", id_, "'s state changed since the export began (a "
        "push, Update, handover, load or restore); start again at offset 0"));
  }
  const uint64_t n = export_->Next(Staging(), layout_->region.staging_bytes());
  *total = export_->total();
  *version = export_version_;
  if (export_->done() == export_->total()) {
    const double took = Seconds(Clock::now() - export_start_);
    env_.counters->checkpoint_seconds.Observe(took);
    env_.counters->checkpoint_bytes.Observe(static_cast<double>(*total));
    SF_LOG(kInfo, "session %d: exported its state (version %d), %d bytes in %.3f s", id_,
           export_version_, *total, took);
    export_.reset();
  }
  return n;
}

absl::Status OffloadSession::AbandonImport(absl::Status why) {
  const bool wrote = import_ != nullptr && import_->writing();
  import_.reset();
  bool lost = false;
  if (wrote) {
    ++epoch_;
    if (!has_state_) {
      // Nothing was there before: back to the zeros of a fresh registration.
      ParallelChunks(static_cast<int64_t>(layout_->total_elems), [&](int64_t b, int64_t e) {
        for (float* a : {master_, m_, v_, acc_}) memset(a + b, 0, (e - b) * sizeof(float));
      });
      for (std::vector<int64_t>& steps : col_steps_) std::fill(steps.begin(), steps.end(), 0);
      acc_stale_ = false;
    } else {
      lost = true;
    }
  }
  {
    MutexLock lock(&mu_);
    importing_ = false;
    if (lost) state_lost_ = true;
    WriteCommit(CommitOf(RecordBusy::kNone, 0));  // busy while the state is lost
  }
  SF_LOG(kWarning, "session %d: import abandoned (%s)%s", id_, why.ToString(),
         lost ? "; its state is incomplete until an import or a Restore succeeds"
              : wrote ? "; its state is zero again, as registered" : "");
  return why;
}

absl::StatusOr<OffloadSession::Imported> OffloadSession::ImportChunk(uint64_t offset,
                                                                     uint64_t length,
                                                                     uint64_t total,
                                                                     v1::DType out) {
  if (offset == 0) {
    if (import_ != nullptr) AbandonImport(absl::CancelledError("a new import began")).IgnoreError();
    {
      MutexLock lock(&mu_);
      if (update_running_)
        return absl::AbortedError(absl::StrCat("the update of step ", last_step_,
                                               " is still running for session ", id_));
      importing_ = true;
    }
    // The import writes the arrays from its first chunk on: a crash before it completes leaves
    // them torn.
    CommitRecord(RecordBusy::kRestore);
    import_ = std::make_unique<CheckpointImport>(
        total, absl::StrCat("the state imported into session ", id_));
    import_epoch_ = epoch_;
    import_start_ = Clock::now();
  } else if (import_ == nullptr || offset != import_->done() || total != import_->total()) {
    const std::string was =
        import_ == nullptr
            ? std::string("no import is in progress")
            : absl::StrCat("the import is at ", import_->done(), " of ", import_->total());
    return AbandonImport(absl::FailedPreconditionError(
        absl::StrCat("offset: ", offset, " of ", total, ", but ", was,
                     "; start again at offset 0")));
  } else if (epoch_ != import_epoch_) {
    return AbandonImport(absl::AbortedError(absl::StrCat(
        "offset: ", offset, ": session ", id_, "'s state changed since the import began (a "
        "push, Update, handover, load or restore)")));
  }
  absl::StatusOr<bool> complete = import_->Take(
      Staging(), length,
      [this](const StateHeader& header)
          -> absl::StatusOr<std::vector<CheckpointArrays>> {
        RETURN_IF_ERROR(MatchHeader(*layout_, header, "state: the imported state"));
        return StateArrays();
      });
  if (!complete.ok()) return AbandonImport(complete.status());
  Imported got;
  if (!*complete) return got;
  const StateHeader header = import_->header();
  const double took = Seconds(Clock::now() - import_start_);
  import_.reset();
  Restored(header, out);
  {
    MutexLock lock(&mu_);
    importing_ = false;
  }
  env_.counters->checkpoint_seconds.Observe(took);
  env_.counters->checkpoint_bytes.Observe(static_cast<double>(total));
  SF_LOG(kInfo, "session %d: imported a state (version %d), %d bytes in %.3f s", id_,
         header.version, total, took);
  got.complete = true;
  got.version = header.version;
  got.last_step = header.last_step;
  return got;
}

absl::StatusOr<uint64_t> OffloadSession::ReadBytes(const std::string& path, uint64_t offset,
                                                   uint64_t* total) {
  return ReadCheckpointBytes(path, offset, Staging(), layout_->region.staging_bytes(), total);
}

absl::StatusOr<bool> OffloadSession::WriteBytes(const std::string& path, uint64_t offset,
                                                uint64_t length, uint64_t total, uid_t owner) {
  absl::StatusOr<bool> complete =
      WriteCheckpointChunk(path, offset, Staging(), length, total, owner);
  if (complete.ok() && *complete)
    SF_LOG(kInfo, "session %d: received checkpoint %s, %d bytes", id_, path, total);
  return complete;
}

}  // namespace stallfree
