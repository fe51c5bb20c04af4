#include "server/session_manager.h"

#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/tbb_sync.h"
#include "common/status.h"
#include "server/checkpoint.h"
#include "server/requests.h"

namespace stallfree {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

absl::Status ShuttingDown() { return absl::UnavailableError("stallfreed is shutting down"); }
absl::Status NoSession(uint64_t id) {
  return absl::NotFoundError(absl::StrCat("session.session_id: no session ", id));
}
absl::Status NoStateDir() {
  return absl::FailedPreconditionError(
      "stallfreed runs without a state directory; start it with --state_dir DIR");
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

// How long an unattached session whose named pid is not visible (a trainer in another pid
// namespace, or a dead one) may take to attach.
constexpr double kAttachGraceSeconds = 300;

// Liveness of a process, from /proc. Zombies count as gone.
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

SessionManager::SessionManager(DaemonOptions options, tbb::task_arena* arena)
    : options_(std::move(options)), arena_(arena), budget_(options_.pinned_budget_bytes),
      start_(Clock::now()) {}

SessionManager::~SessionManager() { Drain(); }

void SessionManager::Reject(const absl::Status& s) {
  counters_.rejected.fetch_add(1);
  SF_LOG(kDebug, "rejected request: %s", s.ToString());
}

void SessionManager::Fail(const absl::Status& s, const Done& done) {
  Reject(s);
  done(s);
}

absl::StatusOr<std::shared_ptr<OffloadSession>> SessionManager::Lookup(const v1::SessionRef& ref,
                                                                       const char* what,
                                                                       bool needs_registered) {
  std::shared_ptr<OffloadSession> s;
  {
    MutexLock lock(&mu_);
    if (draining_) return ShuttingDown();
    auto it = sessions_.find(ref.session_id());
    if (it == sessions_.end()) return NoSession(ref.session_id());
    s = it->second;
  }
  if (s->token() != ref.token())
    return absl::PermissionDeniedError(
        absl::StrCat("session.token: wrong token for session ", ref.session_id()));
  if (needs_registered && s->layout() == nullptr)
    return absl::FailedPreconditionError(absl::StrCat(what, " before RegisterParams"));
  return s;
}

absl::Status SessionManager::Post(const OffloadSession& s, std::function<void()> work) {
  if (s.strand().Post(std::move(work))) return absl::OkStatus();
  MutexLock lock(&mu_);
  return draining_ ? ShuttingDown() : NoSession(s.id());
}

void SessionManager::PostOrFail(const OffloadSession& s, std::function<void()> work,
                                const Done& done) {
  absl::Status st = Post(s, std::move(work));
  if (!st.ok()) Fail(st, done);
}

absl::Status SessionManager::RunDetached(std::function<void()> fn) {
  {
    MutexLock lock(&mu_);
    if (draining_) return ShuttingDown();
    ++detached_running_;
  }
  // What fn holds goes before the count does: nothing of the task outlives the wait in Drain.
  auto task = std::make_shared<std::function<void()>>(std::move(fn));
  TsanRelease(task.get());  // TBB's hand-off, made visible to TSan (common/tbb_sync.h)
  arena_->enqueue([this, task] {
    TsanAcquire(task.get());
    (*task)();
    *task = nullptr;
    MutexLock lock(&mu_);
    --detached_running_;
  });
  return absl::OkStatus();
}

absl::StatusOr<uid_t> SessionManager::CallerUid(const v1::CallerRef& caller, const char* what) {
  if (caller.caller_id() == 0)
    return absl::UnauthenticatedError(absl::StrCat(
        what, ": no caller credential; get one from the fd socket (send \"CALLER\\n\", "
        "offload.proto: CallerRef), as stallfreectl does"));
  MutexLock lock(&mu_);
  auto it = callers_.find(caller.caller_id());
  if (it == callers_.end() || it->second.token != caller.token())
    return absl::PermissionDeniedError(
        absl::StrCat("caller: no caller ", caller.caller_id(), " with that token"));
  return it->second.uid;
}

absl::StatusOr<uid_t> SessionManager::Identify(const v1::CallerRef& caller,
                                               const v1::SessionRef& session, const char* what) {
  if (session.session_id() == 0) return CallerUid(caller, what);
  ASSIGN_OR_RETURN(std::shared_ptr<OffloadSession> s, Lookup(session, what, false));
  std::optional<uid_t> uid = s->uid();
  if (!uid)
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": session ", s->id(), " has not attached to the fd socket, so its uid is unknown"));
  return *uid;
}

v1::CallerRef SessionManager::NewCaller(uid_t peer_uid, pid_t peer_pid) {
  v1::CallerRef ref;
  MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  ref.set_caller_id(id);
  ref.set_token(NewToken());
  callers_[id] = Caller{ref.token(), peer_uid};
  SF_LOG(kDebug, "caller %d: uid %d pid %d", id, peer_uid, peer_pid);
  return ref;
}

void SessionManager::DropCaller(uint64_t caller_id) {
  MutexLock lock(&mu_);
  callers_.erase(caller_id);
}

absl::StatusOr<v1::OpenSessionResponse> SessionManager::Open(const v1::OpenSessionRequest& req) {
  absl::Status bad;
  if (req.pid() <= 0 || req.pid() > INT32_MAX)
    bad = absl::InvalidArgumentError(absl::StrCat("pid: ", req.pid(), " is not a process id"));
  else if (req.name().size() > 256)
    bad = absl::InvalidArgumentError("name: longer than 256 bytes");
  // The pid only keeps an unattached session alive (Housekeeping); it grants nothing. It may
  // be invisible here: a trainer in a container names its own pid namespace's.
  v1::OpenSessionResponse resp;
  {
    MutexLock lock(&mu_);
    if (draining_) bad = ShuttingDown();
    if (bad.ok()) {
      const uint64_t id = next_id_++;
      auto session = std::make_shared<OffloadSession>(
          id, NewToken(), req.name(), req.rank(), static_cast<pid_t>(req.pid()),
          OffloadSession::Env{arena_, &budget_, &counters_, options_.pin});
      sessions_[id] = session;
      resp.mutable_session()->set_session_id(id);
      resp.mutable_session()->set_token(session->token());
    }
  }
  if (!bad.ok()) {
    Reject(bad);
    return bad;
  }
  counters_.sessions_opened.fetch_add(1);
  resp.set_fd_socket(options_.fd_socket_path);
  SF_LOG(kInfo, "session %d opened: name '%s' rank %d pid %d", resp.session().session_id(),
         req.name(), req.rank(), req.pid());
  return resp;
}

std::shared_ptr<OffloadSession> SessionManager::Unregister(uint64_t id) {
  std::shared_ptr<OffloadSession> s;
  std::string stored;
  {
    MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return nullptr;
    s = std::move(it->second);
    sessions_.erase(it);
    closing_[id] = s;
    if (auto k = stored_.find(id); k != stored_.end()) {
      stored = k->second;
      stored_.erase(k);
    }
  }
  // Closed for good (its record says so): the service manager lets its copy go.
  if (!stored.empty() && drop_fds_) drop_fds_(stored);
  return s;
}

void SessionManager::Retire(const std::shared_ptr<OffloadSession>& s) {
  // The caller's reference keeps the session alive while on_idle runs inline; closing_'s keeps
  // it alive until on_idle runs on the arena, and keeps Drain (and so the manager) waiting.
  OffloadSession* session = s.get();
  session->strand().Close([this, session] {
    session->Release();
    MutexLock lock(&mu_);
    closing_.erase(session->id());
  });
}

absl::StatusOr<uint64_t> SessionManager::Close(const v1::CloseSessionRequest& req) {
  std::shared_ptr<OffloadSession> found;
  std::string by = "its client";
  if (req.session().token().empty() && req.caller().caller_id() != 0) {  // an administrator
    absl::StatusOr<uid_t> uid = CallerUid(req.caller(), "CloseSession");
    if (!uid.ok()) {
      Reject(uid.status());
      return uid.status();
    }
    {
      MutexLock lock(&mu_);
      auto it = sessions_.find(req.session().session_id());
      if (it != sessions_.end()) found = it->second;
    }
    const std::optional<uid_t> owner = found ? found->uid() : std::nullopt;
    if (found == nullptr || (*uid != 0 && owner != *uid)) {
      absl::Status st = NoSession(req.session().session_id());
      Reject(st);
      return st;
    }
    by = absl::StrCat("uid ", *uid, " (stallfreectl close)");
  } else {
    ASSIGN_OR_RETURN(found, Lookup(req.session(), "CloseSession", false));
  }
  std::shared_ptr<OffloadSession> s = Unregister(found->id());
  if (s == nullptr) return NoSession(found->id());  // reclaimed meanwhile
  const uint64_t bytes = s->MarkClosed("session closed while waiting");
  counters_.sessions_closed.fetch_add(1);
  SF_LOG(kInfo, "session %d closed by %s; %d bytes freed", s->id(), by, bytes);
  // Queued work still runs; the memory goes after the last task.
  Retire(s);
  return bytes;
}

void SessionManager::Reclaim(uint64_t id, const std::string& why) {
  std::shared_ptr<OffloadSession> s = Unregister(id);
  if (s == nullptr) return;
  const uint64_t bytes = s->MarkClosed("session reclaimed");
  counters_.sessions_reclaimed.fetch_add(1);
  SF_LOG(kWarning, "session %d ('%s') reclaimed: %s; %d bytes freed", id, s->name(), why, bytes);
  Retire(s);
}

void SessionManager::RegisterParams(const v1::RegisterParamsRequest& req,
                                    v1::RegisterParamsResponse* resp, Done done) {
  auto found = Lookup(req.session(), "RegisterParams", false);
  if (!found.ok()) return Fail(found.status(), done);
  std::shared_ptr<OffloadSession> s = *std::move(found);
  // Validate and lay out without touching any memory.
  absl::StatusOr<SessionLayout> layout = LayOutParams(req);
  if (!layout.ok()) return Fail(layout.status(), done);
  absl::Status st = s->BeginRegister(layout->pinned_bytes());
  if (!st.ok()) return Fail(st, done);
  PostOrFail(*s, [this, s, layout = *std::move(layout), resp, done]() mutable {
    absl::Status st = s->Allocate(std::move(layout));
    if (!st.ok()) return Fail(st, done);
    *resp->mutable_layout() = s->layout()->region;
    done(absl::OkStatus());
  }, done);
}

void SessionManager::LoadParams(const v1::LoadParamsRequest& req, Done done) {
  auto found = Lookup(req.session(), "LoadParams", true);
  if (!found.ok()) return Fail(found.status(), done);
  std::shared_ptr<OffloadSession> s = *std::move(found);
  absl::Status st = s->CheckLoadable();
  if (!st.ok()) return Fail(st, done);
  absl::StatusOr<std::vector<LoadJob>> jobs = PlanLoad(req, *s->layout());
  if (!jobs.ok()) return Fail(jobs.status(), done);
  PostOrFail(*s, [s, jobs = *std::move(jobs), done] {
    s->LoadParams(jobs);
    done(absl::OkStatus());
  }, done);
}

void SessionManager::PostAccumulate(std::shared_ptr<OffloadSession> s,
                                    absl::StatusOr<PushPlan> plan,
                                    v1::PushGradientsResponse* resp, Done done) {
  if (!plan.ok()) return Fail(plan.status(), done);
  PostOrFail(*s, [s, plan = *std::move(plan), resp, done] {
    resp->set_accumulated_pushes(s->Accumulate(plan));
    resp->set_bytes(plan.bytes);
    done(absl::OkStatus());
  }, done);
}

void SessionManager::PushGradients(const v1::PushGradientsRequest& req,
                                   v1::PushGradientsResponse* resp, Done done) {
  auto found = Lookup(req.session(), "PushGradients", true);
  if (!found.ok()) return Fail(found.status(), done);
  std::shared_ptr<OffloadSession> s = *std::move(found);
  PostAccumulate(s, PlanPush(req, *s->layout()), resp, std::move(done));
}

void SessionManager::PushGradientsInline(const v1::PushGradientsInlineRequest& req,
                                         v1::PushGradientsResponse* resp, Done done) {
  auto found = Lookup(req.session(), "PushGradientsInline", true);
  if (!found.ok()) return Fail(found.status(), done);
  std::shared_ptr<OffloadSession> s = *std::move(found);
  // The plan points into req.data(), which stays valid until done(): gRPC keeps the request
  // until the reactor finishes.
  PostAccumulate(s, PlanPush(req, *s->layout()), resp, std::move(done));
}

absl::Status SessionManager::Update(const v1::UpdateRequest& req) {
  auto rejected = [&](absl::Status st) {
    Reject(st);
    return st;
  };
  auto found = Lookup(req.session(), "Update", true);
  if (!found.ok()) return rejected(found.status());
  std::shared_ptr<OffloadSession> s = *std::move(found);
  absl::StatusOr<UpdatePlan> plan = PlanUpdate(req, *s->layout(), s->id());
  if (!plan.ok()) return rejected(plan.status());
  absl::Status st = s->BeginUpdate(req.step());
  if (!st.ok()) return rejected(st);
  st = Post(*s, [s, plan = *std::move(plan)] { s->Update(plan); });
  if (!st.ok()) return rejected(st);
  return absl::OkStatus();
}

void SessionManager::MigrateColumns(const v1::MigrateColumnsRequest& req,
                                    v1::MigrateColumnsResponse* resp, Done done) {
  auto found = Lookup(req.session(), "MigrateColumns", true);
  if (!found.ok()) return Fail(found.status(), done);
  std::shared_ptr<OffloadSession> s = *std::move(found);
  // A handover needs no quiescent session: the strand orders it after the earlier work.
  absl::StatusOr<std::vector<MigratePlan>> plans = PlanMigrate(req, *s->layout());
  if (!plans.ok()) return Fail(plans.status(), done);
  std::optional<int64_t> before;
  if (req.has_handovers_before()) {
    if (req.handovers_before() < 0)
      return Fail(absl::InvalidArgumentError(absl::StrCat(
                      "handovers_before: ", req.handovers_before(), " is negative")),
                  done);
    before = req.handovers_before();
  }
  PostOrFail(*s, [this, s, plans = *std::move(plans), before, resp, done] {
    absl::StatusOr<std::vector<MigrateResult>> got =
        before ? s->HandOverAgain(plans, *before) : s->HandOver(plans);
    if (!got.ok()) return Fail(got.status(), done);
    const std::vector<MigrateResult>& results = *got;
    for (size_t i = 0; i < results.size(); ++i) {
      auto* steps = i == 0 ? resp->mutable_steps() : resp->add_more()->mutable_steps();
      for (int64_t t : results[i].steps) steps->Add(t);
      resp->set_pushes(results[i].pushes);
    }
    done(absl::OkStatus());
  }, done);
}

absl::StatusOr<SessionManager::Owned> SessionManager::LookupForCheckpoint(
    const v1::SessionRef& ref, const std::string& tag, const char* what) {
  ASSIGN_OR_RETURN(std::shared_ptr<OffloadSession> s, Lookup(ref, what, true));
  if (options_.state_dir.empty()) return NoStateDir();
  RETURN_IF_ERROR(ValidateCheckpointTag(tag));
  std::optional<uid_t> uid = s->uid();
  if (!uid)
    return absl::FailedPreconditionError(absl::StrCat(
        what, " before the session's process attached to the fd socket (a checkpoint belongs "
        "to the uid the kernel reports for that process)"));
  return Owned{s, *uid, CheckpointPath(options_.state_dir, *uid, tag)};
}

void SessionManager::Checkpoint(const v1::CheckpointRequest& req, v1::CheckpointResponse* resp,
                                Done done) {
  absl::StatusOr<Owned> found = LookupForCheckpoint(req.session(), req.tag(), "Checkpoint");
  if (!found.ok()) return Fail(found.status(), done);
  const Owned& o = *found;
  PostOrFail(*o.session, [this, s = o.session, uid = o.uid, path = o.path, resp, done] {
    absl::Status dir = EnsureOwnerDir(options_.state_dir, uid);
    if (!dir.ok()) return Fail(dir, done);
    int64_t version = 0;
    absl::StatusOr<CheckpointWritten> out = s->Snapshot(path, uid, &version);
    if (!out.ok()) return Fail(out.status(), done);
    resp->set_path(out->path);
    resp->set_bytes(out->bytes);
    resp->set_checksum(absl::StrCat(absl::Hex(out->checksum, absl::kZeroPad16)));
    resp->set_version(version);
    done(absl::OkStatus());
  }, done);
}

void SessionManager::Restore(const v1::RestoreRequest& req, v1::RestoreResponse* resp,
                             Done done) {
  if (req.out_dtype() != v1::DTYPE_UNSPECIFIED && req.out_dtype() != v1::DTYPE_FP32 &&
      req.out_dtype() != v1::DTYPE_BF16)
    return Fail(absl::InvalidArgumentError("out_dtype: must be FP32 or BF16"), done);
  absl::StatusOr<Owned> found = LookupForCheckpoint(req.session(), req.tag(), "Restore");
  if (!found.ok()) return Fail(found.status(), done);
  const Owned& o = *found;
  absl::StatusOr<v1::DType> dtype = OutputDType(req.out_dtype(), *o.session->layout(), "out_dtype");
  if (!dtype.ok()) return Fail(dtype.status(), done);
  const v1::DType out = *dtype;
  absl::Status st = o.session->BeginRestore();
  if (!st.ok()) return Fail(st, done);
  // Every file access on the strand, none on the gRPC thread.
  PostOrFail(*o.session, [this, s = o.session, uid = o.uid, path = o.path, tag = req.tag(), out,
                          resp, done] {
    uint64_t file_bytes = 0;
    absl::StatusOr<StateHeader> header = s->Restore(path, uid, tag, out, &file_bytes);
    if (!header.ok()) return Fail(header.status(), done);
    resp->set_version(header->version);
    resp->set_last_step(header->last_step);
    resp->set_bytes(file_bytes);
    done(absl::OkStatus());
  }, done);
}

void SessionManager::ReadCheckpoint(const v1::ReadCheckpointRequest& req,
                                    v1::ReadCheckpointResponse* resp, Done done) {
  absl::StatusOr<Owned> found = LookupForCheckpoint(req.session(), req.tag(), "ReadCheckpoint");
  if (!found.ok()) return Fail(found.status(), done);
  const Owned& o = *found;
  PostOrFail(*o.session, [this, s = o.session, path = o.path, offset = req.offset(),
                          delete_after = req.delete_after(), resp, done] {
    uint64_t total = 0;
    absl::StatusOr<uint64_t> n = s->ReadBytes(path, offset, &total);
    absl::Status st = n.status();
    if (st.ok() && delete_after && offset + *n == total) st = DeleteCheckpointFile(path);
    if (!st.ok()) return Fail(st, done);
    resp->set_total_bytes(total);
    resp->set_length(*n);
    done(absl::OkStatus());
  }, done);
}

void SessionManager::WriteCheckpoint(const v1::WriteCheckpointRequest& req,
                                     v1::WriteCheckpointResponse* resp, Done done) {
  absl::StatusOr<Owned> found = LookupForCheckpoint(req.session(), req.tag(), "WriteCheckpoint");
  if (!found.ok()) return Fail(found.status(), done);
  const Owned& o = *found;
  absl::Status st = CheckChunk(req, *o.session->layout());
  if (!st.ok()) return Fail(st, done);
  PostOrFail(*o.session, [this, s = o.session, uid = o.uid, path = o.path,
                          offset = req.offset(), length = req.length(),
                          total = req.total_bytes(), resp, done] {
    absl::Status dir = EnsureOwnerDir(options_.state_dir, uid);
    if (!dir.ok()) return Fail(dir, done);
    absl::StatusOr<bool> complete = s->WriteBytes(path, offset, length, total, uid);
    if (!complete.ok()) return Fail(complete.status(), done);
    resp->set_complete(*complete);
    done(absl::OkStatus());
  }, done);
}

void SessionManager::DeleteCheckpoint(const v1::DeleteCheckpointRequest& req, Done done) {
  auto remove = [this, done](const std::string& path) {
    absl::Status st = DeleteCheckpointFile(path);
    if (!st.ok()) return Fail(st, done);
    done(st);
  };
  if (req.session().session_id() != 0) {  // a session: on its strand, after its queued work
    absl::StatusOr<Owned> found =
        LookupForCheckpoint(req.session(), req.tag(), "DeleteCheckpoint");
    if (!found.ok()) return Fail(found.status(), done);
    return PostOrFail(*found->session, [remove, path = found->path] { remove(path); }, done);
  }
  absl::StatusOr<uid_t> uid = CallerUid(req.caller(), "DeleteCheckpoint");
  absl::Status st = uid.status();
  if (st.ok() && options_.state_dir.empty()) st = NoStateDir();
  if (st.ok()) st = ValidateCheckpointTag(req.tag());
  if (st.ok())
    st = RunDetached(
        [remove, path = CheckpointPath(options_.state_dir, *uid, req.tag())] { remove(path); });
  if (!st.ok()) Fail(st, done);
}

void SessionManager::ExportState(const v1::ExportStateRequest& req,
                                 v1::ExportStateResponse* resp, Done done) {
  auto found = Lookup(req.session(), "ExportState", true);
  if (!found.ok()) return Fail(found.status(), done);
  std::shared_ptr<OffloadSession> s = *std::move(found);
  PostOrFail(*s, [this, s, offset = req.offset(), resp, done] {
    uint64_t total = 0;
    int64_t version = 0;
    absl::StatusOr<uint64_t> n = s->ExportChunk(offset, s->uid(), &total, &version);
    if (!n.ok()) return Fail(n.status(), done);
    resp->set_total_bytes(total);
    resp->set_length(*n);
    resp->set_version(version);
    done(absl::OkStatus());
  }, done);
}

void SessionManager::ImportState(const v1::ImportStateRequest& req,
                                 v1::ImportStateResponse* resp, Done done) {
  if (req.out_dtype() != v1::DTYPE_UNSPECIFIED && req.out_dtype() != v1::DTYPE_FP32 &&
      req.out_dtype() != v1::DTYPE_BF16)
    return Fail(absl::InvalidArgumentError("out_dtype: must be FP32 or BF16"), done);
  auto found = Lookup(req.session(), "ImportState", true);
  if (!found.ok()) return Fail(found.status(), done);
  std::shared_ptr<OffloadSession> s = *std::move(found);
  absl::Status st = CheckChunk(req, *s->layout());
  if (!st.ok()) return Fail(st, done);
  absl::StatusOr<v1::DType> dtype = OutputDType(req.out_dtype(), *s->layout(), "out_dtype");
  if (!dtype.ok()) return Fail(dtype.status(), done);
  PostOrFail(*s, [this, s, offset = req.offset(), length = req.length(),
                  total = req.total_bytes(), out = *dtype, resp, done] {
    absl::StatusOr<OffloadSession::Imported> got = s->ImportChunk(offset, length, total, out);
    if (!got.ok()) return Fail(got.status(), done);
    resp->set_complete(got->complete);
    resp->set_version(got->version);
    resp->set_last_step(got->last_step);
    done(absl::OkStatus());
  }, done);
}

void SessionManager::ListCheckpoints(const v1::ListCheckpointsRequest& req,
                                     v1::ListCheckpointsResponse* resp, Done done) {
  absl::StatusOr<uid_t> uid = Identify(req.caller(), req.session(), "ListCheckpoints");
  absl::Status st = uid.status();
  if (st.ok() && options_.state_dir.empty()) st = NoStateDir();
  // Directory reads and header reads: off the gRPC thread.
  if (st.ok())
    st = RunDetached([this, uid = *uid, resp, done] {
      absl::StatusOr<std::vector<v1::CheckpointInfo>> list =
          ListCheckpointFiles(options_.state_dir, uid, /*all=*/uid == 0);
      if (!list.ok()) return Fail(list.status(), done);
      resp->set_state_dir(options_.state_dir);
      for (v1::CheckpointInfo& info : *list) *resp->add_checkpoints() = std::move(info);
      done(absl::OkStatus());
    });
  if (!st.ok()) Fail(st, done);
}

void SessionManager::WaitUpdate(const v1::WaitUpdateRequest& req, OffloadSession::WaitDone done) {
  auto found = Lookup(req.session(), "WaitUpdate", false);
  absl::Status st = found.status();
  if (st.ok()) {
    // The request's own wait, else the daemon's (--update_wait_s); the expiry names which.
    const bool own = req.timeout_ms() > 0;
    const std::chrono::milliseconds wait =
        own ? std::chrono::milliseconds(req.timeout_ms()) : options_.update_wait;
    std::string bound = absl::StrCat(
        wait.count() / 1000.0, " s",
        own ? " (the request's timeout_ms)" : " (stallfreed --update_wait_s)");
    st = (*found)->Wait(req.min_version(), Clock::now() + wait, std::move(bound), done);
  }
  if (!st.ok()) {
    Reject(st);
    done(st);
  }
}

absl::StatusOr<SessionFds> SessionManager::Attach(uint64_t session_id, const std::string& token,
                                                  uid_t peer_uid, pid_t peer_pid) {
  std::shared_ptr<OffloadSession> s;
  {
    MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end())
      return absl::NotFoundError(absl::StrCat("no session ", session_id));
    s = it->second;
  }
  if (s->token() != token)
    return absl::PermissionDeniedError(absl::StrCat("wrong token for session ", session_id));
  absl::StatusOr<SessionFds> fds = s->Attach(peer_uid, peer_pid);
  // From here a daemon started again takes the session back: the service manager keeps a copy.
  if (fds.ok() && keep_fds_) {
    const std::string key = FdKey(fds->state_fd);
    {
      MutexLock lock(&mu_);
      stored_[session_id] = key;
    }
    keep_fds_(key, fds->state_fd, fds->region_fd);
  }
  return fds;
}

void SessionManager::SetFdStore(std::function<void(const std::string&, int, int)> keep,
                                std::function<void(const std::string&)> drop) {
  keep_fds_ = std::move(keep);
  drop_fds_ = std::move(drop);
}

std::string SessionManager::FdKey(int state_fd) {
  struct stat st;
  if (fstat(state_fd, &st) != 0) return "";
  return absl::StrCat(st.st_ino);
}

absl::Status SessionManager::HoldStored(const std::string& key, int region_fd, int state_fd,
                                        std::chrono::seconds hold) {
  absl::StatusOr<AdoptResult> held =
      AdoptImpl(nullptr, 0, 0, region_fd, state_fd, /*peer_uid=*/0, /*peer_pid=*/0);
  if (!held.ok()) {
    SF_LOG(kWarning, "session state %s from the service manager's fd store is not taken back "
           "(%s); dropped from the store", key, held.status().ToString());
    if (drop_fds_) drop_fds_(key);
    return held.status();
  }
  {
    MutexLock lock(&mu_);
    held_[key] = Clock::now() + hold;
  }
  SF_LOG(kInfo, "session state %s from the service manager's fd store: version %d, %d pushes "
         "since it; held %d s for its process to re-attach", key, held->version,
         held->pushes_since_update, hold.count());
  return absl::OkStatus();
}

absl::StatusOr<AdoptResult> SessionManager::Adopt(const std::string& token, uint64_t generation,
                                                  uint64_t nonce, int region_fd, int state_fd,
                                                  uid_t peer_uid, pid_t peer_pid) {
  return AdoptImpl(&token, generation, nonce, region_fd, state_fd, peer_uid, peer_pid);
}

absl::StatusOr<AdoptResult> SessionManager::AdoptImpl(const std::string* token,
                                                      uint64_t generation, uint64_t nonce,
                                                      int region_fd, int state_fd,
                                                      uid_t peer_uid, pid_t peer_pid) {
  // token null: the service manager's fd store passed the state at start (HoldStored): no
  // process presents it, so nothing of the owner's is checked, the generation stays, and the
  // session is not published.
  const bool from_store = token == nullptr;
  auto refuse = [&](absl::Status st) {
    if (region_fd >= 0) close(region_fd);
    if (state_fd >= 0) close(state_fd);
    Reject(st);
    return st;
  };
  {
    MutexLock lock(&mu_);
    if (draining_) return refuse(ShuttingDown());
  }
  struct stat st;
  if (fstat(state_fd, &st) != 0) return refuse(ErrnoStatus("fstat", "the adopted state's memfd"));
  // Judged before anything of it is mapped: what the sender claims decides how much memory the
  // daemon commits, and the budget must allow it first.
  absl::StatusOr<SessionIdentity> id =
      ReadIdentityFromFd(state_fd, static_cast<uint64_t>(st.st_size));
  if (!id.ok()) return refuse(id.status());
  const std::string key = FdKey(state_fd);
  if (from_store) {
    peer_uid = id->uid;
    generation = id->generation;
  } else if (id->uid != peer_uid)
    return refuse(absl::PermissionDeniedError(absl::StrCat(
        "the state belongs to uid ", id->uid, ", not to uid ", peer_uid)));
  if (!from_store && id->token_sha256 != TokenDigest(*token))
    return refuse(absl::PermissionDeniedError("wrong token for the adopted state"));
  if (id->generation == 0)
    return refuse(absl::FailedPreconditionError(
        "the session was closed by the daemon that held it (a close, an operator's stallfreectl "
        "close, or its process's exit): it is not taken back"));
  // The same attempt again: its adoption went through in a daemon that died before answering
  // (as many times as the record's generation is ahead: each carried the attempt's nonce).
  const bool retried = nonce != 0 && id->adopt_nonce == nonce && id->generation > generation;
  if (id->generation != generation && !retried)
    return refuse(absl::FailedPreconditionError(absl::StrCat(
        "generation ", generation, " is stale: the state is at generation ", id->generation,
        " (another process adopted it since)")));
  // The same registration, laid out by this daemon's rules: the same layout, or a refusal.
  v1::RegisterParamsRequest reg;
  reg.set_param_dtype(static_cast<v1::DType>(id->param_dtype));
  reg.set_param_slots(id->param_slots);
  for (const RecordParam& p : id->params) {
    v1::ParamSpec* spec = reg.add_params();
    spec->set_name(p.name);
    for (int64_t d : p.shape) spec->add_shape(d);
    spec->set_grad_dtype(static_cast<v1::DType>(p.grad_dtype));
  }
  absl::StatusOr<SessionLayout> layout = LayOutParams(reg, id->format);
  if (!layout.ok()) return refuse(absl::DataLossError(absl::StrCat(
      "the adopted state's registration does not lay out: ", layout.status().message())));
  if (layout->total_elems != id->total_elems || layout->state_stride != id->state_stride ||
      layout->region.region_bytes() != id->region_bytes ||
      layout->state_bytes != id->state_bytes ||
      layout->state_bytes != static_cast<uint64_t>(st.st_size))
    return refuse(absl::FailedPreconditionError(absl::StrCat(
        "the adopted state was laid out differently (", id->region_bytes, " region bytes, ",
        id->state_bytes, " state bytes) from what this stallfreed lays out (",
        layout->region.region_bytes(), ", ", layout->state_bytes,
        "): restore it from a checkpoint with the stallfreed that wrote it")));
  const uint64_t pinned = layout->pinned_bytes();
  if (absl::Status st = budget_.Reserve(pinned); !st.ok()) return refuse(st);
  auto unreserve = [&](absl::Status why) {
    budget_.Release(pinned);
    return refuse(why);
  };
  // Mapped whole (MapFd checks that it is sealed against shrinking: the sender cannot cut it
  // under the daemon).
  absl::StatusOr<std::unique_ptr<MappedRegion>> state =
      MappedRegion::MapFd(std::exchange(state_fd, -1), static_cast<uint64_t>(st.st_size));
  if (!state.ok()) return unreserve(state.status());
  // The identity again, from the mapping the daemon will use (the sender holds the descriptor
  // and could have changed it since the read above).
  absl::StatusOr<SessionIdentity> mapped =
      SessionRecord((*state)->data(), layout->arrays_offset).ReadIdentity();
  if (!mapped.ok()) return unreserve(mapped.status());
  if (mapped->uid != id->uid || mapped->token_sha256 != id->token_sha256 ||
      mapped->generation != id->generation || mapped->state_bytes != id->state_bytes ||
      mapped->params.size() != id->params.size())
    return unreserve(absl::FailedPreconditionError("the adopted state changed while it was read"));
  absl::StatusOr<SessionCommit> commit =
      SessionRecord((*state)->data(), layout->arrays_offset).NewestCommit();
  if (!commit.ok()) return unreserve(commit.status());
  bool sane = commit->version >= 0 && commit->last_step >= 0 &&
              commit->pushes_since_update >= 0 &&
              commit->ready_slot < layout->region.param_slots() &&
              (commit->ready_dtype == v1::DTYPE_FP32 || commit->ready_dtype == v1::DTYPE_BF16);
  // A negative count marks a column handed over and not landed yet (OffloadSession::HandOver).
  for (const std::vector<int64_t>& steps : commit->col_steps)
    for (int64_t t : steps) sane = sane && t >= -(int64_t{1} << 62);
  if (!sane)
    return unreserve(absl::DataLossError("the session record's commit holds values out of range"));
  // An Update, a push or a handover with its work journal entry is finished by this daemon
  // (Resume); any other work cut short may have torn the state.
  const bool resumable =
      (commit->busy == RecordBusy::kUpdate || commit->busy == RecordBusy::kPush ||
       commit->busy == RecordBusy::kHandover) &&
      commit->journaled;
  if (commit->busy != RecordBusy::kNone && !resumable)
    return unreserve(absl::FailedPreconditionError(absl::StrCat(
        "the daemon that held the state stopped in the middle of ", RecordBusyName(commit->busy),
        commit->busy_step > 0 ? absl::StrCat(" of step ", commit->busy_step) : std::string(),
        ": the state may be torn; restore it from a checkpoint")));
  absl::StatusOr<std::unique_ptr<MappedRegion>> region =
      MappedRegion::MapFd(std::exchange(region_fd, -1), layout->region.region_bytes());
  if (!region.ok()) return unreserve(region.status());
  if (absl::Status locked = (*state)->Lock(options_.pin); !locked.ok()) return unreserve(locked);
  if (absl::Status locked = (*region)->Lock(options_.pin); !locked.ok()) return unreserve(locked);
  std::shared_ptr<OffloadSession> session;
  uint64_t new_id;
  {
    MutexLock lock(&mu_);
    if (draining_) return unreserve(ShuttingDown());
    new_id = from_store ? 0 : next_id_++;
    session = std::make_shared<OffloadSession>(
        new_id, from_store ? std::string() : *token, id->name, id->rank, peer_pid,
        OffloadSession::Env{arena_, &budget_, &counters_, options_.pin});
  }
  const SessionCommit c = *commit;
  session->Adopt(*std::move(layout), *std::move(region), *std::move(state), *std::move(id), c,
                 peer_uid, peer_pid, nonce, /*new_generation=*/!from_store);
  // The work the daemon before died in, finished before anyone can reach the session.
  absl::Status resumed;
  ArenaExecute(*arena_, [&] { resumed = session->Resume(c); });
  if (!resumed.ok()) {
    session->Release();  // the memory and its reservation
    Reject(resumed);
    return resumed;
  }
  if (from_store) {
    const AdoptResult standing = session->Standing();
    session->Release();  // the record as Resume committed it: its process takes it back
    return standing;
  }
  bool keep = false;
  {
    MutexLock lock(&mu_);
    sessions_[new_id] = session;
    // Held since this daemon started: the service manager has its descriptors already.
    keep = held_.erase(key) == 0;
    stored_[new_id] = key;
  }
  if (keep && keep_fds_) keep_fds_(key, session->StateFd(), session->RegionFd());
  counters_.sessions_opened.fetch_add(1);
  return session->Standing();
}

void SessionManager::OnConnectionClosed(uint64_t session_id) {
  Reclaim(session_id, "its fd socket closed (client exited)");
}

std::vector<std::shared_ptr<OffloadSession>> SessionManager::OpenSessions() {
  std::vector<std::shared_ptr<OffloadSession>> all;
  MutexLock lock(&mu_);
  for (auto& [id, s] : sessions_) all.push_back(s);
  return all;
}

void SessionManager::Housekeeping() {
  const std::vector<std::shared_ptr<OffloadSession>> open = OpenSessions();
  const auto now = Clock::now();
  std::vector<std::string> expired;
  {
    MutexLock lock(&mu_);
    for (auto it = held_.begin(); it != held_.end();) {
      if (it->second > now) {
        ++it;
        continue;
      }
      expired.push_back(it->first);
      it = held_.erase(it);
    }
  }
  for (const std::string& key : expired) {
    SF_LOG(kWarning, "session state %s from the service manager's fd store: its process did not "
           "re-attach in time; dropped from the store (its process, if alive, still holds it)",
           key);
    if (drop_fds_) drop_fds_(key);
  }
  for (const auto& s : open) s->ExpireWaiters(now);
  for (const auto& s : open) {
    const pid_t pid = s->pid();
    if (ProcessAlive(pid)) continue;
    const v1::SessionInfo info = s->Info();
    if (info.attached()) {  // the kernel's pid: gone for sure
      Reclaim(s->id(), absl::StrCat("process ", pid, " is gone"));
    } else if (info.age_seconds() > kAttachGraceSeconds) {
      // The pid OpenSession named is not visible: a dead opener, or one in another pid
      // namespace that never attached.
      Reclaim(s->id(), absl::StrCat("not attached within ", kAttachGraceSeconds,
                                    " s, and its process ", pid, " is not visible"));
    }
  }
}

void SessionManager::Drain() {
  std::vector<std::shared_ptr<OffloadSession>> open;
  {
    MutexLock lock(&mu_);
    draining_ = true;
    for (auto& [id, s] : sessions_) open.push_back(s);
  }
  // From here no strand takes new work; each finishes what it has.
  for (const auto& s : open) s->strand().Close(nullptr);
  for (const auto& s : open) s->strand().WaitIdle();
  MutexLock lock(&mu_);
  mu_.Await([this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return Settled(); });
}

absl::Status SessionManager::AuthorizeOperator(const v1::CallerRef& caller, const char* what) {
  absl::StatusOr<uid_t> uid = CallerUid(caller, what);
  absl::Status st = uid.status();
  if (st.ok() && *uid != 0 && *uid != getuid())
    st = absl::PermissionDeniedError(absl::StrCat(
        what, ": shows every uid's sessions, so only root and the daemon's uid (", getuid(),
        ") may ask; uid ", *uid, " may not"));
  if (!st.ok()) Reject(st);
  return st;
}

std::vector<v1::SessionInfo> SessionManager::AllSessionInfo() {
  std::vector<v1::SessionInfo> out;
  for (const auto& s : OpenSessions()) out.push_back(s->Info());
  return out;
}

absl::StatusOr<std::vector<v1::SessionInfo>> SessionManager::ListSessions(
    const v1::CallerRef& caller) {
  absl::StatusOr<uid_t> uid = CallerUid(caller, "ListSessions");
  if (!uid.ok()) {
    Reject(uid.status());
    return uid.status();
  }
  std::vector<v1::SessionInfo> out;
  for (const auto& s : OpenSessions()) {
    v1::SessionInfo info = s->Info();
    if (*uid == 0 || (info.attached() && info.uid() == *uid)) out.push_back(std::move(info));
  }
  return out;
}

v1::Stats SessionManager::GetStats() {
  v1::Stats st;
  int64_t sessions = 0, params = 0, elems = 0, running = 0;
  for (const auto& s : OpenSessions()) {
    const v1::SessionInfo info = s->Info();
    ++sessions;
    running += info.update_running() ? 1 : 0;
    params += info.params();
    elems += info.param_elements();
  }
  st.set_sessions(sessions);
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
  st.set_updates_running(running);
  st.set_updates_resumed(counters_.updates_resumed.load());
  {
    MutexLock lock(&mu_);
    st.set_held_states(static_cast<int64_t>(held_.size()));
  }
  st.set_pushes_resumed(counters_.pushes_resumed.load());
  st.set_handovers_resumed(counters_.handovers_resumed.load());
  st.set_handovers_answered_again(counters_.handovers_answered_again.load());
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
  st.set_update_wait_seconds(options_.update_wait.count() / 1000.0);
  return st;
}

}  // namespace stallfree
