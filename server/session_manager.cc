#include "server/session_manager.h"

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "absl/strings/str_cat.h"
#include "common/bounds.h"
#include "common/log.h"
#include "common/status.h"
#include "server/checkpoint.h"

namespace stallfree {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kPage = 4096;
constexpr uint64_t kElemAlign = 16;  // 64 bytes of fp32.
constexpr int64_t kMaxNumel = int64_t{1} << 40;
constexpr int64_t kChunk = int64_t{1} << 16;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
int64_t Nanos(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
}

uint64_t ElementBytes(v1::DType t) { return t == v1::DTYPE_BF16 ? 2 : 4; }
kernels::GradType ToGradType(v1::DType t) {
  return t == v1::DTYPE_BF16 ? kernels::GradType::kBf16 : kernels::GradType::kFp32;
}

// Runs fn(begin, end) over [0, n) in chunks, in parallel on the current arena.
template <typename Fn>
void ParallelChunks(int64_t n, Fn fn) {
  if (n <= kChunk) {
    if (n > 0) fn(0, n);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, kChunk),
                    [&](const tbb::blocked_range<int64_t>& r) { fn(r.begin(), r.end()); });
}

std::string NewToken() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof bytes) {
    ssize_t n = getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      // getrandom cannot fail once the pool is initialised; fall back to /dev/urandom.
      std::ifstream f("/dev/urandom", std::ios::binary);
      f.read(reinterpret_cast<char*>(bytes), sizeof bytes);
      break;
    }
    got += static_cast<size_t>(n);
  }
  static const char* hex = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) {
    token.push_back(hex[b >> 4]);
    token.push_back(hex[b & 15]);
  }
  return token;
}

// Owner uid and liveness of a process, from /proc. Zombies count as gone.
bool ProcessAlive(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  if (!f) return false;
  std::string line;
  std::getline(f, line);
  size_t close_paren = line.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= line.size()) return false;
  char state = line[close_paren + 2];
  return state != 'Z' && state != 'X';
}

}  // namespace

struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  v1::DType grad_dtype = v1::DTYPE_FP32;
  uint64_t elem_offset = 0;  // into every fp32 array and the fp32 parameter slot.
  uint64_t grad_offset = 0;  // bytes into each gradient slot.
  int64_t rows = 1, cols = 1;  // [product of the leading dimensions, last dimension]
  // AdamW steps applied to each column; touched only by tasks on the session's strand.
  std::vector<int64_t> col_steps;
};

struct Waiter {
  int64_t min_version;
  Clock::time_point deadline;
  std::function<void(absl::StatusOr<WaitResult>)> done;
};

class Session {
 public:
  Session(uint64_t id, std::string token, const v1::OpenSessionRequest& req,
          tbb::task_arena* arena, std::atomic<uint64_t>* reserved, DaemonCounters* counters)
      : id(id), token(std::move(token)), name(req.name()), rank(req.rank()),
        created(Clock::now()), strand(std::make_shared<Strand>(arena)),
        pid(static_cast<pid_t>(req.pid())), reserved_(reserved), counters_(counters) {}

  ~Session() {
    if (reserved_bytes > 0) reserved_->fetch_sub(reserved_bytes);
    if (pinned_bytes > 0) counters_->pinned_bytes.fetch_sub(pinned_bytes);
  }

  uint8_t* GradSlot(uint32_t s) const {
    return region->data() + layout.grad_slot_offset() + s * layout.grad_slot_bytes();
  }
  uint8_t* ParamSlot(uint32_t s) const {
    return region->data() + layout.param_slot_offset() + s * layout.param_slot_bytes();
  }
  float* Staging() const { return reinterpret_cast<float*>(region->data() + layout.staging_offset()); }

  const uint64_t id;
  const std::string token;
  const std::string name;
  const int32_t rank;
  const Clock::time_point created;
  const std::shared_ptr<Strand> strand;

  std::mutex mu;  // guards everything below.
  // The opener's pid until the attach, then the kernel's pid of the attached process.
  pid_t pid;
  // The kernel's uid of the attached process (SO_PEERCRED): set once by Attach; nothing that
  // needs an owner (checkpoints, listings) works before.
  uid_t uid = static_cast<uid_t>(-1);
  bool registering = false;
  bool registered = false;
  bool attached = false;
  bool closed = false;
  bool update_running = false;
  bool updated_once = false;
  int64_t last_step = 0;
  int64_t version = 0;
  uint32_t ready_slot = 0;
  v1::DType ready_dtype = v1::DTYPE_FP32;
  double last_update_seconds = 0;
  int64_t pushes = 0, updates = 0, pushes_since_update = 0;
  std::vector<ParamInfo> params;
  std::map<std::string, size_t> index;
  uint64_t total_elems = 0;
  v1::RegionLayout layout;
  std::vector<Waiter> waiters;
  uint64_t reserved_bytes = 0;
  uint64_t pinned_bytes = 0;

  // Set once by the registration task, then immutable until destruction.
  std::unique_ptr<MappedRegion> region;
  std::unique_ptr<MappedRegion> state;
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  float* acc = nullptr;
  // True when the accumulator is logically zero but still holds the sums of the round before the
  // last Update (which no longer clears it: the next whole-slot push overwrites it instead, and
  // anything else zeroes it first; see PostAccumulate). Touched only by tasks on the strand.
  bool acc_stale = false;

 private:
  std::atomic<uint64_t>* reserved_;
  DaemonCounters* counters_;
};

SessionManager::SessionManager(DaemonOptions options, tbb::task_arena* arena)
    : options_(std::move(options)), arena_(arena), start_(Clock::now()) {}

SessionManager::~SessionManager() { Drain(); }

void SessionManager::Reject(const absl::Status& s) {
  counters_.rejected.fetch_add(1);
  SF_LOG(kDebug, "rejected request: %s", s.ToString());
}

void SessionManager::Fail(const absl::Status& s, const std::function<void(absl::Status)>& done) {
  Reject(s);
  done(s);
}

void SessionManager::RunDetached(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++detached_running_;
  }
  arena_->enqueue([this, fn = std::move(fn)] {
    fn();
    std::lock_guard<std::mutex> lock(mu_);
    if (--detached_running_ == 0) detached_cv_.notify_all();
  });
}

absl::StatusOr<uid_t> SessionManager::CallerUid(const v1::CallerRef& caller, const char* what) {
  if (caller.caller_id() == 0)
    return absl::UnauthenticatedError(absl::StrCat(
        what, ": no caller credential; get one from the fd socket (send \"CALLER\\n\", "
        "offload.proto: CallerRef), as stallfreectl does"));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = callers_.find(caller.caller_id());
  if (it == callers_.end() || it->second.token != caller.token())
    return absl::PermissionDeniedError(
        absl::StrCat("caller: no caller ", caller.caller_id(), " with that token"));
  return it->second.uid;
}

absl::StatusOr<uid_t> SessionManager::Identify(const v1::CallerRef& caller,
                                               const v1::SessionRef& session, const char* what) {
  if (session.session_id() == 0) return CallerUid(caller, what);
  ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(session));
  std::lock_guard<std::mutex> lock(s->mu);
  if (!s->attached)
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": session ", s->id, " has not attached to the fd socket, so its uid is unknown"));
  return s->uid;
}

v1::CallerRef SessionManager::NewCaller(uid_t peer_uid, pid_t peer_pid) {
  v1::CallerRef ref;
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  ref.set_caller_id(id);
  ref.set_token(NewToken());
  callers_[id] = Caller{ref.token(), peer_uid};
  SF_LOG(kDebug, "caller %d: uid %d pid %d", id, peer_uid, peer_pid);
  return ref;
}

void SessionManager::DropCaller(uint64_t caller_id) {
  std::lock_guard<std::mutex> lock(mu_);
  callers_.erase(caller_id);
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Find(const v1::SessionRef& ref) {
  if (draining_.load()) return absl::UnavailableError("stallfreed is shutting down");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(ref.session_id());
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("session.session_id: no session ", ref.session_id()));
  }
  if (it->second->token != ref.token()) {
    return absl::PermissionDeniedError(
        absl::StrCat("session.token: wrong token for session ", ref.session_id()));
  }
  return it->second;
}

absl::StatusOr<v1::OpenSessionResponse> SessionManager::Open(const v1::OpenSessionRequest& req) {
  absl::Status bad;
  if (draining_.load()) bad = absl::UnavailableError("stallfreed is shutting down");
  else if (req.pid() <= 0 || req.pid() > INT32_MAX)
    bad = absl::InvalidArgumentError(absl::StrCat("pid: ", req.pid(), " is not a process id"));
  else if (req.name().size() > 256)
    bad = absl::InvalidArgumentError("name: longer than 256 bytes");
  if (!bad.ok()) {
    Reject(bad);
    return bad;
  }
  // The pid only keeps an unattached session alive (Housekeeping); it grants nothing.
  if (!ProcessAlive(static_cast<pid_t>(req.pid()))) {
    absl::Status st = absl::InvalidArgumentError(absl::StrCat(
        "pid: no process ", req.pid(), " is visible to the daemon (a trainer in another pid "
        "namespace needs the daemon's, e.g. hostPID in Kubernetes)"));
    Reject(st);
    return st;
  }
  v1::OpenSessionResponse resp;
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t id = next_id_++;
  auto session = std::make_shared<Session>(id, NewToken(), req, arena_, &reserved_bytes_,
                                           &counters_);
  sessions_[id] = session;
  counters_.sessions_opened.fetch_add(1);
  resp.mutable_session()->set_session_id(id);
  resp.mutable_session()->set_token(session->token);
  resp.set_fd_socket(options_.fd_socket_path);
  SF_LOG(kInfo, "session %d opened: name '%s' rank %d pid %d", id, req.name(), req.rank(),
         req.pid());
  return resp;
}

absl::StatusOr<uint64_t> SessionManager::Close(const v1::SessionRef& ref) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(ref));
  std::vector<Waiter> waiters;
  uint64_t bytes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions_.erase(s->id);
  }
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->closed = true;
    waiters.swap(s->waiters);
    bytes = s->reserved_bytes;
  }
  for (Waiter& w : waiters) w.done(absl::AbortedError("session closed while waiting"));
  counters_.sessions_closed.fetch_add(1);
  SF_LOG(kInfo, "session %d closed by its client; %d bytes freed", s->id, bytes);
  // Queued work keeps the session alive until it has run; the memory goes with the last task.
  return bytes;
}

void SessionManager::Reclaim(uint64_t id, const std::string& why) {
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return;
    s = it->second;
    sessions_.erase(it);
  }
  std::vector<Waiter> waiters;
  uint64_t bytes;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->closed = true;
    waiters.swap(s->waiters);
    bytes = s->reserved_bytes;
  }
  for (Waiter& w : waiters) w.done(absl::AbortedError("session reclaimed"));
  counters_.sessions_reclaimed.fetch_add(1);
  SF_LOG(kWarning, "session %d ('%s') reclaimed: %s; %d bytes freed", id, s->name, why, bytes);
}

void SessionManager::RegisterParams(const v1::RegisterParamsRequest& req,
                                    v1::RegisterParamsResponse* resp,
                                    std::function<void(absl::Status)> done) {
  auto fail = [&](absl::Status st) {
    Reject(st);
    done(st);
  };
  absl::StatusOr<std::shared_ptr<Session>> found = Find(req.session());
  if (!found.ok()) return fail(found.status());
  std::shared_ptr<Session> s = *found;

  // Validate and lay out without touching any memory.
  if (req.params_size() == 0) return fail(absl::InvalidArgumentError("params: empty"));
  std::vector<ParamInfo> params;
  std::map<std::string, size_t> index;
  uint64_t elems = 0, grad_bytes = 0;
  for (int i = 0; i < req.params_size(); ++i) {
    const v1::ParamSpec& p = req.params(i);
    const std::string field = absl::StrCat("params[", i, "]");
    if (p.name().empty() || p.name().size() > 1024)
      return fail(absl::InvalidArgumentError(field + ".name: empty or longer than 1024 bytes"));
    if (index.count(p.name()))
      return fail(absl::InvalidArgumentError(
          absl::StrCat(field, ".name: duplicate parameter '", p.name(), "'")));
    if (p.shape_size() == 0 || p.shape_size() > 8)
      return fail(absl::InvalidArgumentError(field + ".shape: needs 1 to 8 dimensions"));
    int64_t numel = 1;
    for (int d = 0; d < p.shape_size(); ++d) {
      if (p.shape(d) < 1 || p.shape(d) > kMaxNumel || numel > kMaxNumel / p.shape(d))
        return fail(absl::InvalidArgumentError(absl::StrCat(
            field, ".shape[", d, "]: ", p.shape(d),
            " is not a dimension >= 1, or the parameter exceeds 2^40 elements")));
      numel *= p.shape(d);
    }
    if (p.grad_dtype() != v1::DTYPE_FP32 && p.grad_dtype() != v1::DTYPE_BF16)
      return fail(absl::InvalidArgumentError(field + ".grad_dtype: must be FP32 or BF16"));
    ParamInfo info;
    info.name = p.name();
    info.shape.assign(p.shape().begin(), p.shape().end());
    info.numel = numel;
    info.grad_dtype = p.grad_dtype();
    info.elem_offset = elems;
    info.grad_offset = grad_bytes;
    info.cols = p.shape(p.shape_size() - 1);
    info.rows = numel / info.cols;
    uint64_t padded, padded_bytes;
    if (!AlignUp(static_cast<uint64_t>(numel), kElemAlign, &padded) ||
        !AddOverflow(elems, padded, &elems) ||
        !MulOverflow(padded, ElementBytes(p.grad_dtype()), &padded_bytes) ||
        !AddOverflow(grad_bytes, padded_bytes, &grad_bytes) ||
        elems > (uint64_t{1} << 44))
      return fail(absl::InvalidArgumentError("params: total size overflows"));
    index[info.name] = params.size();
    params.push_back(std::move(info));
  }
  v1::RegionLayout layout;
  uint64_t gslot, pslot, region_bytes, state_bytes;
  AlignUp(grad_bytes, kPage, &gslot);
  AlignUp(elems * 4, kPage, &pslot);
  region_bytes = 2 * gslot + 3 * pslot;
  state_bytes = 4 * elems * 4;
  layout.set_region_bytes(region_bytes);
  layout.set_grad_slot_offset(0);
  layout.set_grad_slot_bytes(gslot);
  layout.set_param_slot_offset(2 * gslot);
  layout.set_param_slot_bytes(pslot);
  layout.set_staging_offset(2 * gslot + 2 * pslot);
  layout.set_staging_bytes(pslot);
  for (const ParamInfo& p : params) {
    v1::ParamLayout* pl = layout.add_params();
    pl->set_name(p.name);
    pl->set_numel(p.numel);
    pl->set_grad_offset(p.grad_offset);
    pl->set_param_offset_fp32(p.elem_offset * 4);
    pl->set_param_offset_bf16(p.elem_offset * 2);
    pl->set_staging_offset(p.elem_offset * 4);
  }
  const uint64_t need = region_bytes + state_bytes;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    if (s->registered || s->registering)
      return fail(absl::FailedPreconditionError(
          absl::StrCat("session ", s->id, " already registered its parameters")));
    uint64_t before = reserved_bytes_.fetch_add(need);
    if (options_.pinned_budget_bytes > 0 && before + need > options_.pinned_budget_bytes) {
      reserved_bytes_.fetch_sub(need);
      return fail(absl::ResourceExhaustedError(absl::StrCat(
          "params: the session needs ", need, " bytes of pinned memory, but only ",
          options_.pinned_budget_bytes - std::min(before, options_.pinned_budget_bytes),
          " of the daemon's budget of ", options_.pinned_budget_bytes, " bytes are free")));
    }
    s->registering = true;
    s->reserved_bytes = need;
  }
  PinPolicy pin = options_.pin;
  s->strand->Post([this, s, resp, done, params = std::move(params), index = std::move(index),
                   layout, elems, pin, state_bytes]() mutable {
    auto region = MappedRegion::CreateMemfd(absl::StrCat("stallfree-session-", s->id),
                                            layout.region_bytes(), pin);
    absl::StatusOr<std::unique_ptr<MappedRegion>> state =
        region.ok() ? MappedRegion::CreateAnonymous(absl::StrCat("session ", s->id, " state"),
                                                    state_bytes, pin)
                    : region.status();
    if (region.ok() && state.ok()) {
      // Write every page of the region once now (before s->mu is taken: this takes seconds for
      // GBs): on a VM whose memory is backed lazily the first write to a 4 KiB page costs far
      // more than the write (~3-5 s/GB; MAP_POPULATE of shmem does not back it), and the slots'
      // first writes would otherwise land in the first steps' pushes and updates. The state is
      // already backed: CreateAnonymous populates it with huge pages.
      uint8_t* base = (*region)->data();
      ParallelChunks(static_cast<int64_t>((*region)->size() / kPage), [&](int64_t b, int64_t e) {
        memset(base + b * kPage, 0, (e - b) * kPage);
      });
    }
    std::lock_guard<std::mutex> lock(s->mu);
    s->registering = false;
    if (!region.ok() || !state.ok()) {
      reserved_bytes_.fetch_sub(s->reserved_bytes);
      s->reserved_bytes = 0;
      absl::Status st = region.ok() ? state.status() : region.status();
      Reject(st);
      done(st);
      return;
    }
    s->region = std::move(*region);
    s->state = std::move(*state);

    float* base = reinterpret_cast<float*>(s->state->data());
    s->master = base;
    s->m = base + elems;
    s->v = base + 2 * elems;
    s->acc = base + 3 * elems;
    for (ParamInfo& p : params) p.col_steps.assign(static_cast<size_t>(p.cols), 0);
    s->params = std::move(params);
    s->index = std::move(index);
    s->total_elems = elems;
    s->layout = layout;
    s->registered = true;
    s->pinned_bytes = s->region->size() + s->state->size();
    counters_.pinned_bytes.fetch_add(s->pinned_bytes);
    *resp->mutable_layout() = layout;
    SF_LOG(kInfo, "session %d registered %d parameters, %d elements; region %d bytes%s", s->id,
           s->params.size(), elems, layout.region_bytes(),
           s->region->locked() ? " (mlocked)" : " (not mlocked)");
    done(absl::OkStatus());
  });
}

void SessionManager::LoadParams(const v1::LoadParamsRequest& req,
                                std::function<void(absl::Status)> done) {
  auto fail = [&](absl::Status st) {
    Reject(st);
    done(st);
  };
  absl::StatusOr<std::shared_ptr<Session>> found = Find(req.session());
  if (!found.ok()) return fail(found.status());
  std::shared_ptr<Session> s = *found;
  std::vector<size_t> which;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    if (!s->registered)
      return fail(absl::FailedPreconditionError("LoadParams before RegisterParams"));
    if (s->updated_once || s->update_running)
      return fail(absl::FailedPreconditionError(
          "LoadParams after the first Update would discard optimizer state"));
    if (req.names_size() == 0) {
      for (size_t i = 0; i < s->params.size(); ++i) which.push_back(i);
    }
    for (int i = 0; i < req.names_size(); ++i) {
      auto it = s->index.find(req.names(i));
      if (it == s->index.end())
        return fail(absl::NotFoundError(
            absl::StrCat("names[", i, "]: no parameter '", req.names(i), "'")));
      which.push_back(it->second);
    }
  }
  s->strand->Post([s, which, done] {
    for (size_t i : which) {
      const ParamInfo& p = s->params[i];
      const uint64_t e = p.elem_offset;
      const float* src = s->Staging() + e;
      ParallelChunks(p.numel, [&](int64_t b, int64_t end) {
        memcpy(s->master + e + b, src + b, (end - b) * sizeof(float));
        memset(s->m + e + b, 0, (end - b) * sizeof(float));
        memset(s->v + e + b, 0, (end - b) * sizeof(float));
        memset(s->acc + e + b, 0, (end - b) * sizeof(float));
      });
      s->params[i].col_steps.assign(static_cast<size_t>(s->params[i].cols), 0);
    }
    done(absl::OkStatus());
  });
}

namespace {

// Makes a logically zero accumulator (Session::acc_stale) zero in memory. On the strand.
void ClearStaleAccumulator(Session* s) {
  if (!s->acc_stale) return;
  ParallelChunks(static_cast<int64_t>(s->total_elems), [&](int64_t b, int64_t e) {
    memset(s->acc + b, 0, (e - b) * sizeof(float));
  });
  s->acc_stale = false;
}

}  // namespace

void SessionManager::PostAccumulate(std::shared_ptr<Session> s, std::vector<AccumulateJob> jobs,
                                    bool whole, float scale, uint64_t bytes,
                                    v1::PushGradientsResponse* resp,
                                    std::function<void(absl::Status)> done) {
  s->strand->Post([this, s, jobs = std::move(jobs), whole, scale, bytes, resp, done] {
    const auto t0 = Clock::now();
    const kernels::OptimizerKernel& k = kernels::DefaultCpuKernel();
    // The first push after an Update: a whole-slot push writes every element of every parameter,
    // so it overwrites the stale sums (no clearing pass; the padding between parameters is never
    // written and stays zero); a partial one needs the zeroed accumulator.
    kernels::AccumulateMode mode = kernels::AccumulateMode::kAdd;
    if (s->acc_stale && whole) {
      mode = kernels::AccumulateMode::kOverwrite;
      s->acc_stale = false;
    }
    ClearStaleAccumulator(s.get());
    for (const AccumulateJob& j : jobs) {
      // The kernel runs in parallel over this arena itself.
      k.Accumulate(j.acc, j.src, j.type, scale, j.count, mode);
    }
    counters_.accumulate_ns.fetch_add(Nanos(Clock::now() - t0));
    counters_.pushes.fetch_add(1);
    counters_.bytes_in.fetch_add(bytes);
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->pushes++;
      s->pushes_since_update++;
      resp->set_accumulated_pushes(s->pushes_since_update);
    }
    resp->set_bytes(bytes);
    done(absl::OkStatus());
  });
}

void SessionManager::PushGradients(const v1::PushGradientsRequest& req,
                                   v1::PushGradientsResponse* resp,
                                   std::function<void(absl::Status)> done) {
  auto fail = [&](absl::Status st) {
    Reject(st);
    done(st);
  };
  absl::StatusOr<std::shared_ptr<Session>> found = Find(req.session());
  if (!found.ok()) return fail(found.status());
  std::shared_ptr<Session> s = *found;
  if (req.slot() > 1)
    return fail(absl::InvalidArgumentError(absl::StrCat("slot: ", req.slot(), " is not 0 or 1")));
  std::vector<AccumulateJob> jobs;
  uint64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    if (!s->registered)
      return fail(absl::FailedPreconditionError("PushGradients before RegisterParams"));
    const uint64_t slot_bytes = s->layout.grad_slot_bytes();
    uint8_t* slot = s->GradSlot(req.slot());
    if (req.ranges_size() == 0) {
      for (const ParamInfo& p : s->params) {
        jobs.push_back({s->acc + p.elem_offset, slot + p.grad_offset, ToGradType(p.grad_dtype),
                        p.numel});
        bytes += p.numel * ElementBytes(p.grad_dtype);
      }
    }
    for (int i = 0; i < req.ranges_size(); ++i) {
      const v1::GradRange& r = req.ranges(i);
      const std::string field = absl::StrCat("ranges[", i, "]");
      auto it = s->index.find(r.param());
      if (it == s->index.end())
        return fail(absl::NotFoundError(
            absl::StrCat(field, ".param: no parameter '", r.param(), "'")));
      const ParamInfo& p = s->params[it->second];
      if (r.dtype() != v1::DTYPE_UNSPECIFIED && r.dtype() != p.grad_dtype)
        return fail(absl::FailedPreconditionError(absl::StrCat(
            field, ".dtype: ", v1::DType_Name(r.dtype()), " but '", p.name, "' was registered with ",
            v1::DType_Name(p.grad_dtype))));
      const uint64_t esize = ElementBytes(p.grad_dtype);
      absl::Status st = CheckRange(r.offset(), r.length(), slot_bytes, field + ".offset/length");
      if (!st.ok()) return fail(st);
      if (r.offset() % esize != 0 || r.length() % esize != 0)
        return fail(absl::InvalidArgumentError(absl::StrCat(
            field, ".offset/length: not a multiple of the ", esize, "-byte element")));
      const uint64_t count = r.length() / esize;
      st = CheckRange(r.first_element(), count, static_cast<uint64_t>(p.numel),
                      field + ".first_element");
      if (!st.ok())
        return fail(absl::InvalidArgumentError(absl::StrCat(
            field, ".first_element: elements [", r.first_element(), ", +", count,
            ") are outside parameter '", p.name, "' of ", p.numel, " elements")));
      jobs.push_back({s->acc + p.elem_offset + r.first_element(), slot + r.offset(),
                      ToGradType(p.grad_dtype), static_cast<int64_t>(count)});
      bytes += r.length();
    }
  }
  const float scale = req.scale() == 0.0f ? 1.0f : req.scale();
  PostAccumulate(s, std::move(jobs), /*whole=*/req.ranges_size() == 0, scale, bytes, resp,
                 std::move(done));
}

void SessionManager::PushGradientsInline(const v1::PushGradientsInlineRequest& req,
                                         v1::PushGradientsResponse* resp,
                                         std::function<void(absl::Status)> done) {
  auto fail = [&](absl::Status st) {
    Reject(st);
    done(st);
  };
  absl::StatusOr<std::shared_ptr<Session>> found = Find(req.session());
  if (!found.ok()) return fail(found.status());
  std::shared_ptr<Session> s = *found;
  AccumulateJob job;
  bool whole;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    if (!s->registered)
      return fail(absl::FailedPreconditionError("PushGradientsInline before RegisterParams"));
    auto it = s->index.find(req.param());
    if (it == s->index.end())
      return fail(absl::NotFoundError(absl::StrCat("param: no parameter '", req.param(), "'")));
    const ParamInfo& p = s->params[it->second];
    const uint64_t esize = ElementBytes(p.grad_dtype);
    if (req.data().size() % esize != 0 || req.data().size() / esize > static_cast<uint64_t>(p.numel))
      return fail(absl::InvalidArgumentError(absl::StrCat(
          "data: ", req.data().size(), " bytes is not a whole number of elements within '",
          p.name, "'")));
    job = {s->acc + p.elem_offset, reinterpret_cast<const uint8_t*>(req.data().data()),
           ToGradType(p.grad_dtype), static_cast<int64_t>(req.data().size() / esize)};
    whole = s->params.size() == 1 && job.count == p.numel;
  }
  const float scale = req.scale() == 0.0f ? 1.0f : req.scale();
  // req.data() stays valid until done(): gRPC keeps the request until the reactor finishes.
  PostAccumulate(s, {job}, whole, scale, req.data().size(), resp, std::move(done));
}

absl::Status SessionManager::Update(const v1::UpdateRequest& req) {
  auto fail = [&](absl::Status st) {
    Reject(st);
    return st;
  };
  ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(req.session()));
  const v1::AdamWHyper& h = req.hyper();
  if (!(h.lr() >= 0.0) || !std::isfinite(h.lr()))
    return fail(absl::InvalidArgumentError("hyper.lr: must be finite and >= 0"));
  if (!(h.beta1() >= 0.0 && h.beta1() < 1.0))
    return fail(absl::InvalidArgumentError("hyper.beta1: must be in [0, 1)"));
  if (!(h.beta2() >= 0.0 && h.beta2() < 1.0))
    return fail(absl::InvalidArgumentError("hyper.beta2: must be in [0, 1)"));
  if (!(h.eps() > 0.0) || !std::isfinite(h.eps()))
    return fail(absl::InvalidArgumentError("hyper.eps: must be finite and > 0"));
  if (!(h.weight_decay() >= 0.0) || !std::isfinite(h.weight_decay()))
    return fail(absl::InvalidArgumentError("hyper.weight_decay: must be finite and >= 0"));
  if (req.param_slot() > 1)
    return fail(absl::InvalidArgumentError(
        absl::StrCat("param_slot: ", req.param_slot(), " is not 0 or 1")));
  if (req.out_dtype() != v1::DTYPE_UNSPECIFIED && req.out_dtype() != v1::DTYPE_FP32 &&
      req.out_dtype() != v1::DTYPE_BF16)
    return fail(absl::InvalidArgumentError("out_dtype: must be FP32 or BF16"));
  if (req.step() < 1)
    return fail(absl::InvalidArgumentError(absl::StrCat("step: ", req.step(), " is not >= 1")));
  // The fused push (offload.proto): only at a column-step boundary, from a real slot.
  const bool fuse = req.fuse_push();
  if (fuse && !req.column_steps())
    return fail(absl::InvalidArgumentError("fuse_push: only with column_steps"));
  if (fuse && req.fused_grad_slot() > 1)
    return fail(absl::InvalidArgumentError(
        absl::StrCat("fused_grad_slot: ", req.fused_grad_slot(), " is not 0 or 1")));
  if (req.skip_params_size() > 0 && !req.column_steps())
    return fail(absl::InvalidArgumentError("skip_params: only with column_steps"));
  const uint32_t grad_slot = req.fused_grad_slot();
  const float push_scale = req.push_scale() == 0.0f ? 1.0f : req.push_scale();
  const v1::DType out = req.out_dtype() == v1::DTYPE_BF16 ? v1::DTYPE_BF16 : v1::DTYPE_FP32;
  std::vector<char> skip;  // the parameters this Update skips, by index
  {
    std::lock_guard<std::mutex> lock(s->mu);
    if (!s->registered) return fail(absl::FailedPreconditionError("Update before RegisterParams"));
    skip.assign(s->params.size(), 0);
    for (const std::string& name : req.skip_params()) {
      auto it = s->index.find(name);
      if (it == s->index.end())
        return fail(absl::InvalidArgumentError(
            absl::StrCat("skip_params: no parameter '", name, "' in session ", s->id)));
      if (skip[it->second]++)
        return fail(absl::InvalidArgumentError(absl::StrCat("skip_params: '", name, "' twice")));
    }
    if (s->update_running)
      return fail(absl::AbortedError(absl::StrCat(
          "step: the update of step ", s->last_step, " is still running for session ", s->id)));
    if (req.step() <= s->last_step)
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "step: ", req.step(), " is not after the last update's step ", s->last_step)));
    s->update_running = true;
    s->last_step = req.step();
  }
  kernels::AdamWConfig cfg;
  cfg.lr = h.lr();
  cfg.beta1 = h.beta1();
  cfg.beta2 = h.beta2();
  cfg.eps = h.eps();
  cfg.weight_decay = h.weight_decay();
  cfg.step = req.step();
  const uint32_t slot = req.param_slot();
  const bool column_steps = req.column_steps();
  s->strand->Post([this, s, cfg, slot, out, column_steps, fuse, grad_slot, push_scale, skip] {
    const auto t0 = Clock::now();
    const kernels::OptimizerKernel& k = kernels::DefaultCpuKernel();
    uint8_t* dst = s->ParamSlot(slot);
    float* out32 = reinterpret_cast<float*>(dst);
    uint16_t* out16 = reinterpret_cast<uint16_t*>(dst);
    // With the fused push and nothing pushed since the last Update, the sums are the pushed
    // gradients alone: the stale accumulator is neither read nor cleared.
    const bool acc_zero = s->acc_stale;
    // No push since the last Update: the gradient is zero, not the stale sums.
    if (!fuse) ClearStaleAccumulator(s.get());
    uint64_t fused_bytes = 0;
    if (!column_steps) {
      ParallelChunks(static_cast<int64_t>(s->total_elems), [&](int64_t b, int64_t e) {
        const int64_t n = e - b;
        k.AdamW(cfg, s->master + b, s->m + b, s->v + b, s->acc + b, kernels::GradType::kFp32, n,
                out == v1::DTYPE_BF16 ? out16 + b : nullptr);
        if (out == v1::DTYPE_FP32) memcpy(out32 + b, s->master + b, n * sizeof(float));
      });
      for (ParamInfo& p : s->params) std::fill(p.col_steps.begin(), p.col_steps.end(), cfg.step);
    } else {
      std::vector<float> step_size, bc2;
      for (size_t i = 0; i < s->params.size(); ++i) {
        ParamInfo& p = s->params[i];
        if (skip[i]) {  // unchanged; its current value goes out like the others'
          if (out == v1::DTYPE_BF16)
            k.FloatToBf16(s->master + p.elem_offset, out16 + p.elem_offset, p.numel);
          continue;
        }
        for (int64_t& t : p.col_steps) ++t;
        step_size.resize(p.col_steps.size());
        bc2.resize(p.col_steps.size());
        kernels::MakeColumnConstants(cfg, p.col_steps.data(), p.cols, step_size.data(),
                                     bc2.data());
        const uint64_t e = p.elem_offset;
        if (fuse) {
          // The whole-slot push of grad_slot and this step in one pass (one read of the
          // accumulator, no write): bit-identical to Accumulate and then AdamWColumns.
          k.AccumulateAdamWColumns(cfg, step_size.data(), bc2.data(), s->master + e, s->m + e,
                                   s->v + e, acc_zero ? nullptr : s->acc + e,
                                   s->GradSlot(grad_slot) + p.grad_offset,
                                   ToGradType(p.grad_dtype), push_scale, p.rows, p.cols,
                                   out == v1::DTYPE_BF16 ? out16 + e : nullptr);
          fused_bytes += p.numel * ElementBytes(p.grad_dtype);
        } else {
          k.AdamWColumns(cfg, step_size.data(), bc2.data(), s->master + e, s->m + e, s->v + e,
                         s->acc + e, kernels::GradType::kFp32, p.rows, p.cols,
                         out == v1::DTYPE_BF16 ? out16 + e : nullptr);
        }
      }
      if (out == v1::DTYPE_FP32) {
        ParallelChunks(static_cast<int64_t>(s->total_elems), [&](int64_t b, int64_t e) {
          memcpy(out32 + b, s->master + b, (e - b) * sizeof(float));
        });
      }
    }
    // The accumulator is now logically zero; the next push overwrites or clears it.
    s->acc_stale = true;
    const double secs = Seconds(Clock::now() - t0);
    counters_.update_ns.fetch_add(static_cast<int64_t>(secs * 1e9));
    counters_.updates.fetch_add(1);
    counters_.bytes_out.fetch_add(s->total_elems * (out == v1::DTYPE_BF16 ? 2 : 4));
    if (fuse) {  // counted as the push it replaces
      counters_.pushes.fetch_add(1);
      counters_.bytes_in.fetch_add(fused_bytes);
    }
    std::vector<Waiter> ready;
    WaitResult result;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->update_running = false;
      s->updated_once = true;
      s->version = cfg.step;
      s->ready_slot = slot;
      s->ready_dtype = out;
      s->last_update_seconds = secs;
      s->updates++;
      if (fuse) s->pushes++;
      s->pushes_since_update = 0;
      result = {s->version, slot, out, secs};
      for (auto it = s->waiters.begin(); it != s->waiters.end();) {
        if (it->min_version <= s->version) {
          ready.push_back(std::move(*it));
          it = s->waiters.erase(it);
        } else {
          ++it;
        }
      }
    }
    SF_LOG(kDebug, "session %d: update of step %d done in %.3f s", s->id, cfg.step, secs);
    for (Waiter& w : ready) w.done(result);
  });
  return absl::OkStatus();
}

void SessionManager::MigrateColumns(const v1::MigrateColumnsRequest& req,
                                    v1::MigrateColumnsResponse* resp,
                                    std::function<void(absl::Status)> done) {
  auto fail = [&](absl::Status st) {
    Reject(st);
    done(st);
  };
  absl::StatusOr<std::shared_ptr<Session>> found = Find(req.session());
  if (!found.ok()) return fail(found.status());
  std::shared_ptr<Session> s = *found;
  const int64_t n = req.columns_size();
  size_t which;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    if (!s->registered)
      return fail(absl::FailedPreconditionError("MigrateColumns before RegisterParams"));
    auto it = s->index.find(req.param());
    if (it == s->index.end())
      return fail(absl::NotFoundError(absl::StrCat("param: no parameter '", req.param(), "'")));
    which = it->second;
    const ParamInfo& p = s->params[which];
    if (n == 0) return fail(absl::InvalidArgumentError("columns: empty"));
    if (req.steps_size() != n)
      return fail(absl::InvalidArgumentError(absl::StrCat(
          "steps: ", req.steps_size(), " step counts for ", n, " columns")));
    // 3 blocks of [rows, n] must fit in the parameter's staging area of rows * cols floats.
    if (n > p.cols / 3)
      return fail(absl::InvalidArgumentError(absl::StrCat(
          "columns: ", n, " columns of '", p.name, "' need ", 3 * n * p.rows,
          " staging floats, but the parameter's staging area holds ", p.numel,
          "; move at most ", p.cols / 3, " columns per call")));
    std::vector<bool> seen(static_cast<size_t>(p.cols), false);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t c = req.columns(j);
      if (c < 0 || c >= p.cols)
        return fail(absl::InvalidArgumentError(absl::StrCat(
            "columns[", j, "]: ", c, " is outside [0, ", p.cols, ") of '", p.name, "'")));
      if (seen[c])
        return fail(absl::InvalidArgumentError(
            absl::StrCat("columns[", j, "]: column ", c, " appears twice")));
      seen[c] = true;
      if (req.steps(j) < 0)
        return fail(absl::InvalidArgumentError(
            absl::StrCat("steps[", j, "]: ", req.steps(j), " is negative")));
    }
    if (s->update_running)
      return fail(absl::AbortedError(absl::StrCat(
          "the update of step ", s->last_step, " is still running for session ", s->id,
          "; wait for it before migrating columns")));
    if (s->pushes_since_update > 0)
      return fail(absl::FailedPreconditionError(absl::StrCat(
          s->pushes_since_update, " gradient pushes since the last Update are pending; "
          "migrate columns only between an Update and the next push")));
  }
  std::vector<int64_t> columns(req.columns().begin(), req.columns().end());
  std::vector<int64_t> steps(req.steps().begin(), req.steps().end());
  s->strand->Post([this, s, which, columns = std::move(columns), steps = std::move(steps), resp,
                   done] {
    ParamInfo& p = s->params[which];
    const int64_t n = static_cast<int64_t>(columns.size());
    float* staging = s->Staging() + p.elem_offset;
    float* state[3] = {s->master + p.elem_offset, s->m + p.elem_offset, s->v + p.elem_offset};
    for (int a = 0; a < 3; ++a) {
      float* block = staging + a * p.rows * n;
      for (int64_t r = 0; r < p.rows; ++r) {
        float* row = state[a] + r * p.cols;
        for (int64_t j = 0; j < n; ++j) std::swap(block[r * n + j], row[columns[j]]);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      resp->add_steps(p.col_steps[columns[j]]);
      p.col_steps[columns[j]] = steps[j];
    }
    counters_.migrated_columns.fetch_add(2 * n);
    done(absl::OkStatus());
  });
}

namespace {

v1::ParamSpec SpecOf(const ParamInfo& p) {
  v1::ParamSpec spec;
  spec.set_name(p.name);
  for (int64_t d : p.shape) spec.add_shape(d);
  spec.set_grad_dtype(p.grad_dtype);
  return spec;
}

// A session's parameters against a checkpoint header's: FailedPrecondition naming the first
// difference.
absl::Status MatchHeader(const Session& s, const v1::CheckpointHeader& header,
                         const std::string& tag) {
  if (header.params_size() != static_cast<int>(s.params.size()))
    return absl::FailedPreconditionError(absl::StrCat(
        "tag: checkpoint '", tag, "' has ", header.params_size(),
        " parameters, the session registered ", s.params.size()));
  for (size_t i = 0; i < s.params.size(); ++i) {
    const v1::CheckpointHeader::Param& hp = header.params(static_cast<int>(i));
    if (hp.spec().SerializeAsString() != SpecOf(s.params[i]).SerializeAsString() ||
        hp.col_steps_size() != s.params[i].cols)
      return absl::FailedPreconditionError(absl::StrCat(
          "tag: parameter ", i, " of checkpoint '", tag, "' is '", hp.spec().name(),
          "' with another name, shape or dtype than the session's '", s.params[i].name, "'"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SessionManager::Owned> SessionManager::FindForCheckpoint(
    const v1::SessionRef& ref, const std::string& tag, const char* what) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(ref));
  if (options_.state_dir.empty())
    return absl::FailedPreconditionError(
        "stallfreed runs without a state directory; start it with --state_dir DIR");
  RETURN_IF_ERROR(ValidateCheckpointTag(tag));
  std::lock_guard<std::mutex> lock(s->mu);
  if (!s->registered)
    return absl::FailedPreconditionError(absl::StrCat(what, " before RegisterParams"));
  if (!s->attached)
    return absl::FailedPreconditionError(absl::StrCat(
        what, " before the session's process attached to the fd socket (a checkpoint belongs "
        "to the uid the kernel reports for that process)"));
  return Owned{s, s->uid, CheckpointPath(options_.state_dir, s->uid, tag)};
}

void SessionManager::Checkpoint(const v1::CheckpointRequest& req, v1::CheckpointResponse* resp,
                                std::function<void(absl::Status)> done) {
  absl::StatusOr<Owned> found = FindForCheckpoint(req.session(), req.tag(), "Checkpoint");
  if (!found.ok()) return Fail(found.status(), done);
  std::shared_ptr<Session> s = found->session;
  s->strand->Post([this, s, uid = found->uid, path = found->path, resp, done] {
    absl::Status dir = EnsureOwnerDir(options_.state_dir, uid);
    if (!dir.ok()) return Fail(dir, done);
    // The file holds the logical accumulator: zero after an Update.
    ClearStaleAccumulator(s.get());
    v1::CheckpointHeader header;
    std::vector<CheckpointArrays> arrays;
    header.set_session_name(s->name);
    header.set_rank(s->rank);
    header.set_owner_uid(uid);
    {
      std::lock_guard<std::mutex> lock(s->mu);
      header.set_last_step(s->last_step);
      header.set_version(s->version);
    }
    for (const ParamInfo& p : s->params) {
      v1::CheckpointHeader::Param* hp = header.add_params();
      *hp->mutable_spec() = SpecOf(p);
      for (int64_t t : p.col_steps) hp->add_col_steps(t);
      const uint64_t e = p.elem_offset;
      arrays.push_back({s->master + e, s->m + e, s->v + e, s->acc + e, p.numel});
    }
    const auto t0 = Clock::now();
    absl::StatusOr<CheckpointWritten> out = stallfree::WriteCheckpoint(path, header, arrays);
    if (!out.ok()) return Fail(out.status(), done);
    resp->set_path(out->path);
    resp->set_bytes(out->bytes);
    resp->set_checksum(absl::StrCat(absl::Hex(out->checksum, absl::kZeroPad16)));
    resp->set_version(header.version());
    SF_LOG(kInfo, "session %d: checkpoint %s, %d bytes in %.3f s", s->id, out->path, out->bytes,
           Seconds(Clock::now() - t0));
    done(absl::OkStatus());
  });
}

void SessionManager::Restore(const v1::RestoreRequest& req, v1::RestoreResponse* resp,
                             std::function<void(absl::Status)> done) {
  if (req.out_dtype() != v1::DTYPE_UNSPECIFIED && req.out_dtype() != v1::DTYPE_FP32 &&
      req.out_dtype() != v1::DTYPE_BF16)
    return Fail(absl::InvalidArgumentError("out_dtype: must be FP32 or BF16"), done);
  absl::StatusOr<Owned> found = FindForCheckpoint(req.session(), req.tag(), "Restore");
  if (!found.ok()) return Fail(found.status(), done);
  std::shared_ptr<Session> s = found->session;
  const v1::DType out = req.out_dtype() == v1::DTYPE_BF16 ? v1::DTYPE_BF16 : v1::DTYPE_FP32;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    if (s->update_running)
      return Fail(absl::AbortedError(absl::StrCat("the update of step ", s->last_step,
                                                  " is still running for session ", s->id)),
                  done);
    s->update_running = true;  // no Update, Migrate or LoadParams until the restore is done
  }
  // Every file access on the strand, none on the gRPC thread.
  s->strand->Post([this, s, uid = found->uid, path = found->path, tag = req.tag(), out, resp,
                   done] {
    uint64_t file_bytes = 0;
    absl::StatusOr<v1::CheckpointHeader> header = ReadCheckpointHeader(path, &file_bytes);
    absl::Status st = header.status();
    if (st.ok() && header->has_owner_uid() && header->owner_uid() != uid)
      st = absl::PermissionDeniedError(absl::StrCat("tag: checkpoint '", tag,
                                                    "' belongs to uid ", header->owner_uid()));
    if (st.ok()) st = MatchHeader(*s, *header, tag);
    if (st.ok()) {
      std::vector<CheckpointArrays> arrays;
      for (const ParamInfo& p : s->params) {
        const uint64_t e = p.elem_offset;
        arrays.push_back({s->master + e, s->m + e, s->v + e, s->acc + e, p.numel});
      }
      st = ReadCheckpointArrays(path, *header, arrays);
    }
    if (st.ok()) {
      s->acc_stale = false;  // the accumulator now holds the checkpoint's
      uint8_t* dst = s->ParamSlot(0);
      for (size_t i = 0; i < s->params.size(); ++i) {
        ParamInfo& p = s->params[i];
        const auto& steps = header->params(static_cast<int>(i)).col_steps();
        p.col_steps.assign(steps.begin(), steps.end());
        const float* src = s->master + p.elem_offset;
        if (out == v1::DTYPE_BF16)
          kernels::DefaultCpuKernel().FloatToBf16(
              src, reinterpret_cast<uint16_t*>(dst) + p.elem_offset, p.numel);
        else
          memcpy(reinterpret_cast<float*>(dst) + p.elem_offset, src, p.numel * sizeof(float));
      }
    }
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->update_running = false;
      if (st.ok()) {
        s->last_step = header->last_step();
        s->version = header->version();
        s->updated_once = true;
        s->ready_slot = 0;
        s->ready_dtype = out;
        s->pushes_since_update = 0;
      }
    }
    if (!st.ok()) return Fail(st, done);
    resp->set_version(header->version());
    resp->set_last_step(header->last_step());
    resp->set_bytes(file_bytes);
    SF_LOG(kInfo, "session %d: restored %s (version %d)", s->id, path, header->version());
    done(absl::OkStatus());
  });
}

void SessionManager::ReadCheckpoint(const v1::ReadCheckpointRequest& req,
                                    v1::ReadCheckpointResponse* resp,
                                    std::function<void(absl::Status)> done) {
  absl::StatusOr<Owned> found = FindForCheckpoint(req.session(), req.tag(), "ReadCheckpoint");
  if (!found.ok()) return Fail(found.status(), done);
  std::shared_ptr<Session> s = found->session;
  s->strand->Post([this, s, path = found->path, req, resp, done] {
    uint64_t total = 0;
    absl::StatusOr<uint64_t> n = stallfree::ReadCheckpointBytes(path, req.offset(), s->Staging(),
                                                                s->layout.staging_bytes(), &total);
    absl::Status st = n.status();
    if (st.ok() && req.delete_after() && req.offset() + *n == total)
      st = DeleteCheckpointFile(path);
    if (!st.ok()) return Fail(st, done);
    resp->set_total_bytes(total);
    resp->set_length(*n);
    done(absl::OkStatus());
  });
}

void SessionManager::WriteCheckpoint(const v1::WriteCheckpointRequest& req,
                                     v1::WriteCheckpointResponse* resp,
                                     std::function<void(absl::Status)> done) {
  absl::StatusOr<Owned> found = FindForCheckpoint(req.session(), req.tag(), "WriteCheckpoint");
  if (!found.ok()) return Fail(found.status(), done);
  std::shared_ptr<Session> s = found->session;
  if (req.length() > s->layout.staging_bytes())
    return Fail(absl::InvalidArgumentError(absl::StrCat(
                    "length: ", req.length(), " bytes, the staging area holds ",
                    s->layout.staging_bytes())),
                done);
  if (req.offset() > req.total_bytes() || req.length() > req.total_bytes() - req.offset())
    return Fail(absl::InvalidArgumentError(absl::StrCat("offset + length: ", req.offset(), " + ",
                                                        req.length(), " exceeds total_bytes ",
                                                        req.total_bytes())),
                done);
  s->strand->Post([this, s, uid = found->uid, path = found->path, req, resp, done] {
    absl::Status dir = EnsureOwnerDir(options_.state_dir, uid);
    if (!dir.ok()) return Fail(dir, done);
    absl::StatusOr<bool> complete = WriteCheckpointChunk(path, req.offset(), s->Staging(),
                                                         req.length(), req.total_bytes(), uid);
    if (!complete.ok()) return Fail(complete.status(), done);
    resp->set_complete(*complete);
    if (*complete)
      SF_LOG(kInfo, "session %d: received checkpoint %s, %d bytes", s->id, path,
             req.total_bytes());
    done(absl::OkStatus());
  });
}

void SessionManager::DeleteCheckpoint(const v1::DeleteCheckpointRequest& req,
                                      std::function<void(absl::Status)> done) {
  if (req.session().session_id() != 0) {  // a session: on its strand, after its queued work
    absl::StatusOr<Owned> found = FindForCheckpoint(req.session(), req.tag(), "DeleteCheckpoint");
    if (!found.ok()) return Fail(found.status(), done);
    found->session->strand->Post([this, path = found->path, done] {
      absl::Status st = DeleteCheckpointFile(path);
      if (!st.ok()) return Fail(st, done);
      done(st);
    });
    return;
  }
  absl::StatusOr<uid_t> uid = CallerUid(req.caller(), "DeleteCheckpoint");
  absl::Status st = uid.status();
  if (st.ok() && options_.state_dir.empty())
    st = absl::FailedPreconditionError(
        "stallfreed runs without a state directory; start it with --state_dir DIR");
  if (st.ok()) st = ValidateCheckpointTag(req.tag());
  if (!st.ok()) return Fail(st, done);
  RunDetached([this, path = CheckpointPath(options_.state_dir, *uid, req.tag()), done] {
    absl::Status st = DeleteCheckpointFile(path);
    if (!st.ok()) return Fail(st, done);
    done(st);
  });
}

void SessionManager::ListCheckpoints(const v1::ListCheckpointsRequest& req,
                                     v1::ListCheckpointsResponse* resp,
                                     std::function<void(absl::Status)> done) {
  absl::StatusOr<uid_t> uid = Identify(req.caller(), req.session(), "ListCheckpoints");
  absl::Status st = uid.status();
  if (st.ok() && options_.state_dir.empty())
    st = absl::FailedPreconditionError(
        "stallfreed runs without a state directory; start it with --state_dir DIR");
  if (!st.ok()) return Fail(st, done);
  // Directory reads and header reads: off the gRPC thread.
  RunDetached([this, uid = *uid, resp, done] {
    absl::StatusOr<std::vector<v1::CheckpointInfo>> list =
        ListCheckpointFiles(options_.state_dir, uid, /*all=*/uid == 0);
    if (!list.ok()) return Fail(list.status(), done);
    resp->set_state_dir(options_.state_dir);
    for (v1::CheckpointInfo& info : *list) *resp->add_checkpoints() = std::move(info);
    done(absl::OkStatus());
  });
}

void SessionManager::WaitUpdate(const v1::WaitUpdateRequest& req,
                                std::function<void(absl::StatusOr<WaitResult>)> done) {
  absl::StatusOr<std::shared_ptr<Session>> found = Find(req.session());
  if (!found.ok()) {
    Reject(found.status());
    return done(found.status());
  }
  std::shared_ptr<Session> s = *found;
  const uint32_t timeout_ms = req.timeout_ms() == 0 ? 60000 : req.timeout_ms();
  std::unique_lock<std::mutex> lock(s->mu);
  if (s->version > 0 && s->version >= req.min_version()) {  // already there: the newest version.
    WaitResult r{s->version, s->ready_slot, s->ready_dtype, s->last_update_seconds};
    lock.unlock();
    return done(r);
  }
  if (!s->update_running && s->last_step < req.min_version()) {
    lock.unlock();
    absl::Status st = absl::FailedPreconditionError(absl::StrCat(
        "min_version: ", req.min_version(), " was never requested by an Update (last step ",
        s->last_step, ")"));
    Reject(st);
    return done(st);
  }
  s->waiters.push_back(
      Waiter{req.min_version(), Clock::now() + std::chrono::milliseconds(timeout_ms), std::move(done)});
}

absl::StatusOr<std::pair<int, uint64_t>> SessionManager::Attach(uint64_t session_id,
                                                                const std::string& token,
                                                                uid_t peer_uid, pid_t peer_pid) {
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end())
      return absl::NotFoundError(absl::StrCat("no session ", session_id));
    s = it->second;
  }
  if (s->token != token)
    return absl::PermissionDeniedError(absl::StrCat("wrong token for session ", session_id));
  std::lock_guard<std::mutex> lock(s->mu);
  if (!s->registered)
    return absl::FailedPreconditionError("attach after RegisterParams: the region is not laid out");
  if (s->attached)
    return absl::FailedPreconditionError(absl::StrCat("session ", session_id, " is already attached"));
  s->attached = true;
  s->uid = peer_uid;  // from SO_PEERCRED: the kernel's, never the request's
  s->pid = peer_pid;
  SF_LOG(kInfo, "session %d attached by pid %d uid %d", session_id, peer_pid, peer_uid);
  return std::make_pair(s->region->fd(), s->region->size());
}

void SessionManager::OnConnectionClosed(uint64_t session_id) {
  Reclaim(session_id, "its fd socket closed (client exited)");
}

void SessionManager::Housekeeping() {
  std::vector<std::pair<uint64_t, pid_t>> check;
  std::vector<std::function<void()>> expired;
  const auto now = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, s] : sessions_) {
      std::lock_guard<std::mutex> slock(s->mu);
      check.emplace_back(id, s->pid);
      for (auto it = s->waiters.begin(); it != s->waiters.end();) {
        if (it->deadline <= now) {
          auto done = std::move(it->done);
          int64_t want = it->min_version;
          expired.push_back([done, want] {
            done(absl::DeadlineExceededError(
                absl::StrCat("min_version: version ", want, " not ready before timeout_ms")));
          });
          it = s->waiters.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
  for (auto& f : expired) f();
  for (auto& [id, pid] : check) {
    if (!ProcessAlive(pid)) Reclaim(id, absl::StrCat("process ", pid, " is gone"));
  }
}

void SessionManager::Drain() {
  draining_.store(true);
  std::vector<std::shared_ptr<Session>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, s] : sessions_) all.push_back(s);
  }
  for (auto& s : all) s->strand->WaitIdle();
  std::unique_lock<std::mutex> lock(mu_);
  detached_cv_.wait(lock, [this] { return detached_running_ == 0; });
}

absl::StatusOr<std::vector<v1::SessionInfo>> SessionManager::ListSessions(
    const v1::CallerRef& caller) {
  absl::StatusOr<uid_t> uid = CallerUid(caller, "ListSessions");
  if (!uid.ok()) {
    Reject(uid.status());
    return uid.status();
  }
  std::vector<v1::SessionInfo> out;
  for (v1::SessionInfo& info : AllSessions())
    if (*uid == 0 || (info.attached() && info.uid() == *uid)) out.push_back(std::move(info));
  return out;
}

std::vector<v1::SessionInfo> SessionManager::AllSessions() {
  std::vector<std::shared_ptr<Session>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, s] : sessions_) all.push_back(s);
  }
  std::vector<v1::SessionInfo> out;
  const auto now = Clock::now();
  for (auto& s : all) {
    v1::SessionInfo info;
    std::lock_guard<std::mutex> lock(s->mu);
    info.set_session_id(s->id);
    info.set_name(s->name);
    info.set_rank(s->rank);
    info.set_pid(s->pid);
    if (s->attached) info.set_uid(s->uid);
    info.set_attached(s->attached);
    info.set_params(static_cast<int64_t>(s->params.size()));
    int64_t elems = 0;
    for (const ParamInfo& p : s->params) elems += p.numel;
    info.set_param_elements(elems);
    info.set_region_bytes(s->registered ? s->layout.region_bytes() : 0);
    info.set_pinned_bytes(s->pinned_bytes);
    info.set_last_step(s->last_step);
    info.set_version(s->version);
    info.set_pushes(s->pushes);
    info.set_updates(s->updates);
    info.set_update_running(s->update_running);
    info.set_age_seconds(Seconds(now - s->created));
    out.push_back(std::move(info));
  }
  return out;
}

v1::Stats SessionManager::GetStats() {
  v1::Stats st;
  std::vector<v1::SessionInfo> sessions = AllSessions();
  st.set_sessions(static_cast<int64_t>(sessions.size()));
  int64_t params = 0, elems = 0;
  for (const auto& s : sessions) {
    params += s.params();
    elems += s.param_elements();
  }
  st.set_sessions_opened(counters_.sessions_opened.load());
  st.set_sessions_closed(counters_.sessions_closed.load());
  st.set_sessions_reclaimed(counters_.sessions_reclaimed.load());
  st.set_params(params);
  st.set_param_elements(elems);
  st.set_param_bytes(static_cast<uint64_t>(elems) * 4);
  st.set_pinned_bytes(counters_.pinned_bytes.load());
  st.set_pinned_budget_bytes(options_.pinned_budget_bytes);
  st.set_pushes(counters_.pushes.load());
  st.set_updates(counters_.updates.load());
  st.set_accumulate_seconds(counters_.accumulate_ns.load() * 1e-9);
  st.set_update_seconds(counters_.update_ns.load() * 1e-9);
  st.set_bytes_in(counters_.bytes_in.load());
  st.set_bytes_out(counters_.bytes_out.load());
  st.set_rejected_requests(counters_.rejected.load());
  st.set_worker_threads(options_.worker_threads);
  st.set_uptime_seconds(Seconds(Clock::now() - start_));
  st.set_version("stallfreed 0.1.0");
  st.set_mlock_enabled(options_.pin != PinPolicy::kOff);
  st.set_migrated_columns(counters_.migrated_columns.load());
  st.set_fd_socket(options_.fd_socket_path);
  return st;
}

}  // namespace stallfree
