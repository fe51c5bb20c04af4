// OffloadSession: one trainer session of stallfreed, its memory and its optimizer state.
//
// A session owns a memfd region (two gradient slots, one or two parameter slots of the
// registered parameter dtype, a staging area of about 1/32 of the fp32 state) and pinned fp32
// state (master, m, v, accumulator), all laid out flat: parameter i occupies elements
// [e_i, e_i + numel_i) of every fp32 array and of the parameter slots, e_i a multiple of 16
// (LayOutParams in requests.h).
//
// Two kinds of methods, two rules:
//  - Control methods (attach, claims of an update, versions, counters, waiters) are thread
//    safe: they take mu_, which guards the control state, and never block on optimizer work.
//  - Work methods (Allocate, LoadParams, Accumulate, Update, HandOver, Snapshot, Restore,
//    ReadBytes, WriteBytes) touch the memory and the fp32 state. Each runs on strand(): one at a
//    time, in the order they were posted, never two at once (a caller that owns the session
//    alone, with nothing posted to its strand, may call them directly). Their comments say
//    "On the strand".
// The layout and the memory are set once, by Allocate; Release frees the memory once the strand
// has closed and gone idle (or the destructor does).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <tbb/task_arena.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/histogram.h"
#include "common/mutex.h"
#include "common/region.h"
#include "kernels/optimizer.h"
#include "server/checkpoint.h"
#include "server/session_journal.h"
#include "server/session_record.h"
#include "server/strand.h"
#include "stallfree/v1/offload.pb.h"

namespace stallfree {

// Requests answered with an error, by RPC method and code (counted at the gRPC edge). Thread
// safe.
class RejectionCounts {
 public:
  void Add(const std::string& method, int code) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[{method, code}];
  }
  std::map<std::pair<std::string, int>, int64_t> Snapshot() const {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, int64_t> counts_;
};

// Daemon-wide counters, read by GetStats.
struct DaemonCounters {
  std::atomic<int64_t> sessions_opened{0};
  std::atomic<int64_t> sessions_closed{0};
  std::atomic<int64_t> sessions_reclaimed{0};
  std::atomic<uint64_t> pinned_bytes{0};
  std::atomic<int64_t> pushes{0};
  std::atomic<int64_t> updates{0};
  std::atomic<int64_t> accumulate_ns{0};
  std::atomic<int64_t> update_ns{0};
  std::atomic<uint64_t> bytes_in{0};
  std::atomic<uint64_t> bytes_out{0};
  std::atomic<int64_t> rejected{0};
  std::atomic<int64_t> migrated_columns{0};
  // Updates and pushes cut short by the daemon before, finished when a session was taken back.
  std::atomic<int64_t> updates_resumed{0};
  std::atomic<int64_t> pushes_resumed{0};
  // Handovers finished so (Resume), and answered again (HandOverAgain).
  std::atomic<int64_t> handovers_resumed{0};
  std::atomic<int64_t> handovers_answered_again{0};
  // Latencies and sizes, for the Prometheus endpoint (server/metrics.h).
  Histogram push_seconds{Histogram::Exponential(1e-5, 4, 12)};       // 10 us .. 42 s
  Histogram push_bytes{Histogram::Exponential(1024, 4, 14)};         // 1 KiB .. 64 GiB
  Histogram update_seconds{Histogram::Exponential(1e-5, 4, 12)};
  Histogram migrate_seconds{Histogram::Exponential(1e-5, 4, 12)};
  Histogram checkpoint_seconds{Histogram::Exponential(1e-4, 4, 12)};  // 100 us .. 7 min
  Histogram checkpoint_bytes{Histogram::Exponential(1024, 4, 16)};   // 1 KiB .. 1 TiB
  RejectionCounts rejections;
};

// The daemon's budget of pinned memory: every session's region and state together. Thread safe.
class PinnedBudget {
 public:
  explicit PinnedBudget(uint64_t limit_bytes) : limit_(limit_bytes) {}
  // Takes `bytes` (a session's region and state) from the budget; ResourceExhausted, naming
  // what is free, if they do not fit. A limit of 0 is no limit.
  absl::Status Reserve(uint64_t bytes);
  void Release(uint64_t bytes) { reserved_.fetch_sub(bytes); }

 private:
  const uint64_t limit_;
  std::atomic<uint64_t> reserved_{0};
};

// The newest version an Update made ready (WaitUpdate's answer).
struct WaitResult {
  int64_t version = 0;
  uint32_t slot = 0;
  v1::DType dtype = v1::DTYPE_FP32;
  double update_seconds = 0;
};

// One parameter as RegisterParams laid it out.
struct ParamLayout {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  v1::DType grad_dtype = v1::DTYPE_FP32;
  uint64_t elem_offset = 0;    // into every fp32 array and the parameter slots' elements.
  uint64_t grad_offset = 0;    // bytes into each gradient slot.
  int64_t rows = 1, cols = 1;  // [product of the leading dimensions, last dimension]

  kernels::GradType grad_type() const {
    return grad_dtype == v1::DTYPE_BF16 ? kernels::GradType::kBf16 : kernels::GradType::kFp32;
  }
  uint64_t grad_element_bytes() const { return grad_dtype == v1::DTYPE_BF16 ? 2 : 4; }
};

// A session's parameters and memory layout: made by LayOutParams (requests.h), immutable
// afterwards.
struct SessionLayout {
  std::vector<ParamLayout> params;
  std::map<std::string, size_t> index;  // name -> position in params
  uint64_t total_elems = 0;             // of every fp32 array, padding included
  // Elements from the start of one of the state's arrays (master, m, v, accumulator) to the
  // next: total_elems padded so that the arrays are staggered within a page (StateStride,
  // requests.h).
  uint64_t state_stride = 0;
  // The state memfd: the session record (server/session_record.h) in its first pages, then
  // master, m, v and accumulator (4 * state_stride floats) from byte arrays_offset.
  uint64_t arrays_offset = 0;
  // Then, from byte journal_offset (page-aligned), the work journal (session_journal.h).
  uint64_t journal_offset = 0;
  JournalGeometry journal;
  uint64_t state_bytes = 0;
  // The session record's format this layout is for (kRecordFormat; an adopted state of format 2
  // keeps its journal, with no room for a handover's plan).
  uint32_t record_format = kRecordFormat;
  v1::RegionLayout region;
  // The request's own param_dtype and param_slots (0: the layout of before), for the record.
  v1::DType requested_param_dtype = v1::DTYPE_UNSPECIFIED;
  uint32_t requested_param_slots = 0;

  // The position of parameter `name` in params, or -1.
  int64_t Find(const std::string& name) const {
    auto it = index.find(name);
    return it == index.end() ? -1 : static_cast<int64_t>(it->second);
  }
  // What the session pins: its region and its state.
  uint64_t pinned_bytes() const { return region.region_bytes() + state_bytes; }
};

// One contiguous run of gradient elements to add into the accumulator.
struct AccumulateJob {
  uint64_t acc_offset;  // elements into the accumulator
  // The gradient: `data` if not null (an inline push's bytes, valid until the push is done),
  // else region_offset bytes into the session's region (a gradient slot).
  const uint8_t* data;
  uint64_t region_offset;
  kernels::GradType type;
  int64_t count;
};

// A validated push (PushGradients, PushGradientsInline).
struct PushPlan {
  std::vector<AccumulateJob> jobs;
  bool whole = false;  // the jobs cover every element of every parameter (a whole-slot push)
  float scale = 1.0f;
  uint64_t bytes = 0;  // the gradient bytes the jobs read
};

// What a session's process receives on the fd socket (FdServer): the region it maps, and the
// optimizer state's memfd, which it holds without mapping so that the state outlives the
// daemon's process.
struct SessionFds {
  int region_fd = -1;
  uint64_t region_bytes = 0;
  int state_fd = -1;
  uint64_t state_bytes = 0;
  // The session record's generation (session_record.h): what a re-attach must present.
  uint64_t generation = 0;
};

// What an adopted session's process learns (SessionManager::Adopt): its new id, the generation
// to present next time, and where its state stands (the newest commit of its record).
struct AdoptResult {
  uint64_t session_id = 0;
  uint64_t generation = 0;
  int64_t version = 0;
  int64_t last_step = 0;
  int64_t pushes_since_update = 0;
  int64_t handovers = 0;  // HandOver calls finished, ever (SessionCommit::handovers)
};

// A validated Update (offload.proto, UpdateRequest).
struct UpdatePlan {
  kernels::AdamWConfig config;  // config.step: the request's step
  uint32_t param_slot = 0;
  v1::DType out = v1::DTYPE_FP32;
  bool column_steps = false;
  bool fuse_push = false;  // the whole-slot push of grad_slot with push_scale, in the same pass
  uint32_t grad_slot = 0;
  float push_scale = 1.0f;
  std::vector<char> skip;  // per parameter: left unchanged by this Update (column steps only)
};

// A validated MigrateColumns (a handover): columns[j] of parameter `param` takes steps[j].
struct MigratePlan {
  size_t param = 0;  // position in the layout
  std::vector<int64_t> columns;
  std::vector<int64_t> steps;
  uint64_t staging_at = 0;  // where its four blocks start, in floats into the staging area
};

// One validated copy of a LoadParams: `count` values from float `staging_at` of the staging
// area to elements [first, first + count) of parameter `param` (a position in the layout).
struct LoadJob {
  size_t param = 0;
  uint64_t first = 0;
  uint64_t count = 0;
  uint64_t staging_at = 0;
};

// Testing only: each handover's answer waits this long once the handover is done and committed
// (0: none, the default), so that a test can stop the daemon between the two
// (stallfreed's --test_answer_delay_us).
void SetHandoverAnswerDelayForTesting(int64_t microseconds);

// What a handover returns: the outgoing step counts, and how many pushes the handed-over
// accumulator block holds (0: it is zero).
struct MigrateResult {
  std::vector<int64_t> steps;
  int64_t pushes = 0;
};

class OffloadSession {
 public:
  using Clock = std::chrono::steady_clock;
  using WaitDone = std::function<void(absl::StatusOr<WaitResult>)>;

  // What a session uses of the daemon; all of it must outlive the session.
  struct Env {
    tbb::task_arena* arena;
    PinnedBudget* budget;
    DaemonCounters* counters;
    PinPolicy pin;
  };

  // `pid`: the opener's claim, replaced by the kernel's at Attach.
  OffloadSession(uint64_t id, std::string token, std::string name, int32_t rank, pid_t pid,
                 Env env);
  ~OffloadSession();  // Release()
  OffloadSession(const OffloadSession&) = delete;
  OffloadSession& operator=(const OffloadSession&) = delete;

  uint64_t id() const { return id_; }
  const std::string& token() const { return token_; }
  const std::string& name() const { return name_; }
  // Where the work methods run.
  Strand& strand() const { return *strand_; }

  // ---- Control (thread safe).

  // Claims the registration and reserves `layout_bytes` of the budget; FailedPrecondition if
  // the session registered (or is registering), ResourceExhausted if the budget is short. The
  // claim ends with Allocate.
  absl::Status BeginRegister(uint64_t layout_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // The layout once the session has registered (valid while the session lives), else null.
  const SessionLayout* layout() const ABSL_LOCKS_EXCLUDED(mu_);
  // Makes the peer's kernel-reported uid and pid the session's; returns the region's and the
  // state's memfds (still the session's) and sizes. NotFound once the session closed.
  absl::StatusOr<SessionFds> Attach(uid_t uid, pid_t pid) ABSL_LOCKS_EXCLUDED(mu_);
  // FailedPrecondition once an Update ran or runs (LoadParams would discard optimizer state).
  absl::Status CheckLoadable() const ABSL_LOCKS_EXCLUDED(mu_);
  // Claims the Update of `step`: Aborted while an update or restore runs, FailedPrecondition
  // unless step is after the last one. The claim ends with Update.
  absl::Status BeginUpdate(int64_t step) ABSL_LOCKS_EXCLUDED(mu_);
  // Claims the session for a Restore (no Update, handover or LoadParams until it is done);
  // Aborted while an update runs. The claim ends with Restore.
  absl::Status BeginRestore() ABSL_LOCKS_EXCLUDED(mu_);
  // Calls done at once with the newest version if it is >= min_version, else when an Update
  // makes it ready, at ExpireWaiters after `deadline`, or at MarkClosed. An error (and done is
  // not called) if no Update up to min_version was requested, or the session closed. `bound`
  // says how long the wait was and whose bound it is, for the expiry's message.
  absl::Status Wait(int64_t min_version, Clock::time_point deadline, std::string bound,
                    const WaitDone& done) ABSL_LOCKS_EXCLUDED(mu_);
  // Fails the waiters whose deadline is before `now` (DeadlineExceeded, naming the version and
  // the bound; the Update goes on and a later Wait sees it).
  void ExpireWaiters(Clock::time_point now) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the session for its clients: its waiters fail with Aborted(waiter_message), Wait and
  // Attach refuse from now on. Returns the bytes it reserved (freed by Release). Work already
  // posted still runs; the caller closes the strand.
  uint64_t MarkClosed(const std::string& waiter_message) ABSL_LOCKS_EXCLUDED(mu_);
  // The process that keeps the session alive (the opener's pid until the attach).
  pid_t pid() const ABSL_LOCKS_EXCLUDED(mu_);
  // The kernel's uid of the attached process; none before the attach.
  std::optional<uid_t> uid() const ABSL_LOCKS_EXCLUDED(mu_);
  // For ListSessions and GetStats.
  v1::SessionInfo Info() const ABSL_LOCKS_EXCLUDED(mu_);

  // Takes back a session that another daemon process held (SessionManager::Adopt checked the
  // identity against the request, re-made `layout` from it and reserved its bytes of the
  // budget, which the session now holds; `commit` is the record's newest, not busy): takes the
  // mapped region and state as they are, restores the control state the commit holds, and
  // writes the identity with the next generation (new_generation false: leaves it as it is, for
  // a state the fd store passed, which its process adopts next). The session is registered and
  // attached (uid, pid) afterwards. Before any work is posted.
  void Adopt(SessionLayout layout, std::unique_ptr<MappedRegion> region,
             std::unique_ptr<MappedRegion> state, SessionIdentity identity,
             const SessionCommit& commit, uid_t uid, pid_t pid, uint64_t nonce,
             bool new_generation = true) ABSL_LOCKS_EXCLUDED(mu_);
  // The state's and the region's memfds (the session's), once registered or adopted.
  int StateFd() const ABSL_LOCKS_EXCLUDED(mu_);
  int RegionFd() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t generation() const ABSL_LOCKS_EXCLUDED(mu_);
  // After Adopt, before any work is posted: finishes the operation that the adopted commit says
  // was running when the daemon before died (an Update, a push or a handover with its work
  // journal entry, session_journal.h): the units in flight are rolled back (a handover's pieces
  // in flight finished) and the units not done run, so the state is the uninterrupted
  // operation's, bit for bit. An operation whose entry never
  // completed did not start: the state is the commit's. DataLoss for a journal that does not
  // check out. On the daemon's arena.
  absl::Status Resume(const SessionCommit& commit) ABSL_LOCKS_EXCLUDED(mu_);
  // Where the session stands: its id, generation, version, the step of its newest Update done
  // and the pushes since it.
  AdoptResult Standing() const ABSL_LOCKS_EXCLUDED(mu_);

  // Frees the region and the state, gives their reservation back to the budget and their
  // bytes to the pinned counter. Only once no work method can run any more (the strand closed
  // and idle, or the session being destroyed); idempotent.
  void Release() ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Work: each on the strand.

  // On the strand. Creates and backs the region and the state of `layout` (BeginRegister came
  // first), then publishes the layout: the session is registered. On failure the reservation
  // goes back and the session may register again.
  absl::Status Allocate(SessionLayout layout) ABSL_LOCKS_EXCLUDED(mu_);
  // On the strand. The jobs' elements take their values from the staging area; their moments
  // and accumulator start from zero, and so do the column steps of every parameter a job names.
  void LoadParams(const std::vector<LoadJob>& jobs);
  // On the strand. Adds plan.scale * each job's gradient into the accumulator. Returns the
  // pushes since the last Update, this one included.
  int64_t Accumulate(const PushPlan& plan) ABSL_LOCKS_EXCLUDED(mu_);
  // On the strand. The AdamW step of `plan` (BeginUpdate came first): master, moments, column
  // steps, the parameter slot; then the version is ready and its waiters are called.
  void Update(const UpdatePlan& plan) ABSL_LOCKS_EXCLUDED(mu_);
  // On the strand. The handovers of `plans` (MigrateColumnsRequest.handover; distinct
  // parameters): each column's state and accumulated gradient go to the four staging blocks
  // at its plan's staging_at, and the three incoming blocks take their place in the arrays,
  // for the next Update to write back in place of what it computes for those columns.
  // Journaled with its answer (JournalOp::kHandover): a daemon that adopts the session after a
  // kill inside the exchange finishes it (Resume).
  std::vector<MigrateResult> HandOver(const std::vector<MigratePlan>& plans);
  // On the strand. A handover that the client counts as the session's handovers_before + 1
  // (MigrateColumnsRequest.handovers_before): done as HandOver if the session has finished
  // handovers_before; answered again, nothing exchanged, if it has finished this one already
  // (its answer was lost with a daemon: the journal keeps it until the next journaled work);
  // FailedPrecondition otherwise, or when the journal's last handover moved other columns.
  absl::StatusOr<std::vector<MigrateResult>> HandOverAgain(const std::vector<MigratePlan>& plans,
                                                           int64_t handovers_before);
  // On the strand. Writes the checkpoint file `path` of the state (the accumulator as it is
  // logically), owned by `owner`. *version: the version it holds.
  absl::StatusOr<CheckpointWritten> Snapshot(const std::string& path, uid_t owner,
                                             int64_t* version) ABSL_LOCKS_EXCLUDED(mu_);
  // On the strand (BeginRestore came first). Reads checkpoint `tag` at `path` into the state if
  // `owner` owns it and its parameters are the session's, and writes the parameters to
  // parameter slot 0 as `out` (a dtype the slots hold: OutputDType in requests.h). Returns its
  // header; *file_bytes: the file's size. Nothing changes unless it succeeds.
  absl::StatusOr<StateHeader> Restore(const std::string& path, uid_t owner,
                                      const std::string& tag, v1::DType out,
                                      uint64_t* file_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // On the strand. ExportState: bytes [offset, offset + n) of the state as a checkpoint of it
  // (owned by `owner`, where known) into the staging area, n = min(staging bytes, *total - offset); returns
  // n. Offset 0 starts an export (*version: the version it holds); a later chunk must follow
  // the previous one (FailedPrecondition) with the state unchanged since (Aborted).
  absl::StatusOr<uint64_t> ExportChunk(uint64_t offset, std::optional<uid_t> owner,
                                       uint64_t* total,
                                       int64_t* version) ABSL_LOCKS_EXCLUDED(mu_);
  // On the strand. ImportState: `length` bytes from the staging area are bytes [offset, offset +
  // length) of a state of `total` bytes (CheckChunk checked them), straight into the state
  // (offload.proto, ImportStateRequest: the order, the header judged before anything changes,
  // the checksum at the end, what a failure half way leaves). Once complete, the parameters go
  // to parameter slot 0 as `out` and the session's version is the state's.
  struct Imported {
    bool complete = false;
    int64_t version = 0, last_step = 0;
  };
  absl::StatusOr<Imported> ImportChunk(uint64_t offset, uint64_t length, uint64_t total,
                                       v1::DType out) ABSL_LOCKS_EXCLUDED(mu_);
  // On the strand. Copies file bytes from `offset` into the staging area (as many as fit);
  // returns how many. *total: the file's size.
  absl::StatusOr<uint64_t> ReadBytes(const std::string& path, uint64_t offset, uint64_t* total);
  // On the strand. Appends `length` bytes from the staging area to the upload of `path`
  // (WriteCheckpointChunk); true when the file is complete.
  absl::StatusOr<bool> WriteBytes(const std::string& path, uint64_t offset, uint64_t length,
                                  uint64_t total, uid_t owner);

 private:
  // How a work method is about to use the accumulator.
  enum class AccumulatorUse {
    kPartialPush,  // adds into some elements
    kWholePush,    // writes every element of every parameter
    kUpdate,       // the step's gradient; logically zero after it
    kFusedUpdate,  // the step's gradient with the fused push's; logically zero after it
    kSnapshot,     // written to a checkpoint
    kRestored,     // a checkpoint's accumulator was just read into it
  };
  // The accumulator's one state machine (acc_stale_). After an Update the accumulator is
  // logically zero but still holds the round's sums: a whole-slot push then overwrites it
  // instead of a clearing pass, and a fused Update does not read it; anything else that reads
  // or adds to it zeroes it first. Returns true when the caller must treat the accumulator as
  // zero without reading it (kWholePush: overwrite; kFusedUpdate: no accumulator). On the
  // strand.
  bool PrepareAccumulator(AccumulatorUse use);

  // The header of a checkpoint of the state as it is now (the accumulator's logical value,
  // PrepareAccumulator(kSnapshot) first): FailedPrecondition between a handover and the next
  // Update, or after an import failed half way. On the strand.
  absl::StatusOr<StateHeader> SnapshotHeader(std::optional<uid_t> owner) ABSL_LOCKS_EXCLUDED(mu_);
  // After a Restore or an import has read a checkpoint of `header` into the state: its step
  // counts, the parameters to slot 0 as `out`, the version; the session has state. On the
  // strand.
  void Restored(const StateHeader& header, v1::DType out) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the import in progress after `why`: what it wrote is undone on a session that held no
  // state yet (zeros, as registered), else the state is lost until an import or a Restore
  // succeeds. Returns why. On the strand.
  absl::Status AbandonImport(absl::Status why) ABSL_LOCKS_EXCLUDED(mu_);

  // The record's commit of the state as it is now, `busy` naming the work method about to change
  // the arrays (kNone: none; a pending handover or a lost state says so itself), without its
  // column steps (WriteCommit writes col_steps_ themselves). On the strand.
  SessionCommit CommitOf(RecordBusy busy, int64_t busy_step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes a commit with col_steps_ to the record (an error is logged: the session works on, but
  // a daemon restart then cannot adopt it). On the strand.
  void CommitRecord(RecordBusy busy = RecordBusy::kNone, int64_t busy_step = 0)
      ABSL_LOCKS_EXCLUDED(mu_);
  void WriteCommit(const SessionCommit& commit);
  // Before a work method changes the arrays: the busy commit (with col_steps_), then the work
  // journal's entry of `op` with `plan` (JournalOp::kNone, or a plan too large for the
  // journal: none, and the commit says the operation cannot be finished by another daemon).
  // Returns the commit's sequence (0 if it failed). On the strand.
  uint64_t BeginWork(RecordBusy busy, int64_t busy_step, JournalOp op, const std::string& plan)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The work of a push and of an Update on the arrays (and the parameter slot), over the
  // journal's units that are not done; then their bookkeeping, commit and waiters. Update and
  // Accumulate run them after BeginWork, Resume after rolling back the units in flight. On the
  // strand. UpdateArrays returns the gradient bytes its fused push read.
  void AccumulateArrays(const PushPlan& plan);
  int64_t FinishPush() ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t UpdateArrays(const UpdatePlan& plan);
  void FinishUpdate(const UpdatePlan& plan, double secs, uint64_t fused_bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A handover's exchange over the journal's pieces (WorkJournal::RunPieces), the pieces a kill
  // cut short finished first (Resume's; none after a Begin); then the columns' landing marks,
  // the handover counted and committed. DataLoss from FinishTornPieces. On the strand.
  absl::Status ExchangeColumns(const std::vector<MigratePlan>& plans) ABSL_LOCKS_EXCLUDED(mu_);
  // Writes identity_ to the record.
  void WriteIdentity() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  uint8_t* GradSlot(uint32_t slot) const;
  uint8_t* ParamSlot(uint32_t slot) const;
  float* Staging() const;
  std::vector<CheckpointArrays> StateArrays() const;

  const uint64_t id_;
  const std::string token_;
  const std::string name_;
  const int32_t rank_;
  const Clock::time_point created_;
  const Env env_;
  const std::shared_ptr<Strand> strand_;

  mutable Mutex mu_;
  // The opener's pid until the attach, then the kernel's pid of the attached process.
  pid_t pid_ ABSL_GUARDED_BY(mu_);
  // The kernel's uid of the attached process (SO_PEERCRED): set once by Attach; nothing that
  // needs an owner (checkpoints, listings) works before.
  uid_t uid_ ABSL_GUARDED_BY(mu_) = static_cast<uid_t>(-1);
  bool registering_ ABSL_GUARDED_BY(mu_) = false;
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  bool attached_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::string closed_message_ ABSL_GUARDED_BY(mu_);
  bool update_running_ ABSL_GUARDED_BY(mu_) = false;  // an Update or a Restore
  bool importing_ ABSL_GUARDED_BY(mu_) = false;       // an ImportState is in progress
  // An import failed half way through a session that held state: refuse what would read it
  // (Update, Checkpoint, ExportState) until an import or a Restore succeeds.
  bool state_lost_ ABSL_GUARDED_BY(mu_) = false;
  bool updated_once_ ABSL_GUARDED_BY(mu_) = false;
  int64_t last_step_ ABSL_GUARDED_BY(mu_) = 0;  // of the newest Update claimed (BeginUpdate)
  // The step of the newest Update done (or restored): what the record commits as last_step, so
  // that an Update claimed and never run is claimed again after an adoption.
  int64_t committed_step_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t version_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t ready_slot_ ABSL_GUARDED_BY(mu_) = 0;
  v1::DType ready_dtype_ ABSL_GUARDED_BY(mu_) = v1::DTYPE_FP32;
  double last_update_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t pushes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t updates_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t pushes_since_update_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t handovers_ ABSL_GUARDED_BY(mu_) = 0;  // HandOver calls finished, ever
  struct Waiter {
    int64_t min_version;
    Clock::time_point deadline;
    std::string bound;
    WaitDone done;
  };
  std::vector<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t pinned_bytes_ ABSL_GUARDED_BY(mu_) = 0;

  // Set once by Allocate, on the strand, under mu_ together with registered_; immutable until
  // Release empties the memory (layout_ stays until destruction). The work methods read them
  // without mu_ (they run after Allocate, on the same strand); anything else reads them under
  // mu_ once registered_ is set (Attach, Info, layout()).
  std::unique_ptr<const SessionLayout> layout_;
  std::unique_ptr<MappedRegion> region_;
  std::unique_ptr<MappedRegion> state_;
  float* master_ = nullptr;
  float* m_ = nullptr;
  float* v_ = nullptr;
  float* acc_ = nullptr;
  // The session record at the start of the state memfd, and its identity (set by Allocate or
  // Adopt; uid and generation by Attach and Adopt).
  std::unique_ptr<SessionRecord> record_;
  SessionIdentity identity_ ABSL_GUARDED_BY(mu_);
  // The work journal after the arrays (set by Allocate or Adopt, with record_).
  std::unique_ptr<WorkJournal> journal_;

  // Work state: touched only by the work methods, on the strand.
  std::vector<std::vector<int64_t>> col_steps_;  // per parameter, per column: AdamW steps taken
  bool acc_stale_ = false;                        // see PrepareAccumulator
  // Bumped by every work method that changes the state, so that an export or an import spread
  // over several requests notices a change between its chunks.
  uint64_t epoch_ = 0;
  // The state holds something (LoadParams, an Update, a Restore or an import happened): a
  // failed import cannot simply zero it.
  bool has_state_ = false;
  std::unique_ptr<CheckpointExport> export_;  // the ExportState in progress
  uint64_t export_epoch_ = 0;
  int64_t export_version_ = 0;
  Clock::time_point export_start_;
  std::unique_ptr<CheckpointImport> import_;  // the ImportState in progress
  uint64_t import_epoch_ = 0;
  Clock::time_point import_start_;
  // Columns handed over since the last Update (HandOver): their incoming state is in the arrays
  // and their step count is marked (LandingMark) until that Update lands them.
  bool landing_pending_ = false;
  // A handed-over column's mark in col_steps_ (negative) for its incoming step count, and the
  // step count of a mark or a count.
  static int64_t LandingMark(int64_t step) { return -step - 1; }
  static int64_t StepOf(int64_t t) { return t < 0 ? -t - 1 : t; }
  // One element of a handed-over column, as it arrived, and one such column.
  struct LandingCell {
    uint64_t at;  // element offset in the arrays
    float master, m, v;
  };
  struct LandingColumn {
    size_t param;
    int64_t column, step;
  };
  // On the strand, as an Update begins: the marked columns' elements (sorted by offset) and
  // columns; their marks become the step count that the Update's own step (unless `skip` says
  // it skips the parameter) turns into the incoming one.
  std::vector<LandingCell> TakeLandings(const std::vector<char>* skip,
                                        std::vector<LandingColumn>* columns);
  // Writes the cells within elements [b, e) back to the arrays, and their values to the
  // parameter slot as bf16 (out16) or fp32 (out32) where not null.
  void LandCells(const std::vector<LandingCell>& cells, uint64_t b, uint64_t e, uint16_t* out16,
                 float* out32);
};

}  // namespace stallfree
