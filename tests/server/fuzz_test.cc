// A bounded randomized client against a real stallfreed (under --config=asan in `make test`, a
// daemon built with AddressSanitizer and UBSan): >= 5,000 requests from fixed seeds, each an RPC
// with hostile field values (offset + length overflow, 2^63, NaN / inf hyper-parameters and
// scales, parameters of no rows, path-like and NUL-containing tags and names, wrong tokens and
// ids, out-of-order calls, raw garbage bodies). Every answer must carry a code that offload.proto documents for requests
// (INTERNAL would mean a system call failed), the daemon must still be running, and afterwards a
// good session must train normally: one AdamW step gives the value computed here by hand.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <algorithm>
#include <thread>
#include <sstream>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <type_traits>
#include <cstdio>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>

#include "client/client.h"
#include "common/tbb_sync.h"
#include "common/unix_socket.h"
#include "server/requests.h"
#include "server/session_record.h"
#include "testing/daemon_process.h"

namespace stallfree {
namespace {

using grpc::StatusCode;

constexpr int kRequestsPerSeed = 1300;
constexpr int kSeeds = 4;  // 5,200 requests

class Fuzzer {
 public:
  Fuzzer(Client* client, uint64_t seed) : client_(client), rng_(seed) {}

  // Sessions the fuzzer may aim at with their real tokens (some registered, some not).
  void AddTarget(const v1::SessionRef& ref) { targets_.push_back(ref); }

  // One random request; returns its code.
  StatusCode Next(std::string* method) {
    switch (Pick(19)) {
      case 0: *method = "OpenSession"; return Call(&v1::Offload::Stub::OpenSession, OpenReq());
      case 1: *method = "CloseSession"; {
        v1::CloseSessionRequest r;
        *r.mutable_session() = Ref(/*allow_real=*/Pick(10) == 0);  // rarely a real one
        return Call(&v1::Offload::Stub::CloseSession, r);
      }
      case 2: *method = "RegisterParams"; {
        v1::RegisterParamsRequest r;
        *r.mutable_session() = Ref(true);
        const int n = Pick(4);
        for (int i = 0; i < n; ++i) *r.add_params() = Spec();
        return Call(&v1::Offload::Stub::RegisterParams, r);
      }
      case 3: *method = "LoadParams"; {
        v1::LoadParamsRequest r;
        *r.mutable_session() = Ref(true);
        if (Pick(2)) r.add_names(Name());
        return Call(&v1::Offload::Stub::LoadParams, r);
      }
      case 4: *method = "PushGradients"; {
        v1::PushGradientsRequest r;
        *r.mutable_session() = Ref(true);
        r.set_step(I64());
        r.set_slot(static_cast<uint32_t>(U64()));
        r.set_scale(F32());
        const int n = Pick(3);
        for (int i = 0; i < n; ++i) {
          v1::GradRange* g = r.add_ranges();
          g->set_param(Name());
          g->set_offset(U64());
          g->set_length(U64());
          g->set_first_element(U64());
          g->set_dtype(static_cast<v1::DType>(Pick(5)));
        }
        return Call(&v1::Offload::Stub::PushGradients, r);
      }
      case 5: *method = "PushGradientsInline"; {
        v1::PushGradientsInlineRequest r;
        *r.mutable_session() = Ref(true);
        r.set_param(Name());
        r.set_data(Bytes(Pick(3) == 0 ? 4096 : 64));
        r.set_scale(F32());
        return Call(&v1::Offload::Stub::PushGradientsInline, r);
      }
      case 6: *method = "Update"; {
        v1::UpdateRequest r;
        *r.mutable_session() = Ref(true);
        r.set_step(I64());
        v1::AdamWHyper* h = r.mutable_hyper();
        h->set_lr(F64());
        h->set_beta1(F64());
        h->set_beta2(F64());
        h->set_eps(F64());
        h->set_weight_decay(F64());
        r.set_param_slot(static_cast<uint32_t>(U64()));
        r.set_out_dtype(static_cast<v1::DType>(Pick(5)));
        r.set_column_steps(Pick(2));
        r.set_fuse_push(Pick(2));
        r.set_fused_grad_slot(static_cast<uint32_t>(U64()));
        r.set_push_scale(F32());
        if (Pick(3) == 0) r.add_skip_params(Name());
        return Call(&v1::Offload::Stub::Update, r);
      }
      case 7: *method = "WaitUpdate"; {
        v1::WaitUpdateRequest r;
        *r.mutable_session() = Ref(true);
        r.set_min_version(I64());
        // A long timeout would only be the client's own wait.
        r.set_timeout_ms(static_cast<uint32_t>(1 + Pick(50)));  // 0 would mean 60 s
        return Call(&v1::Offload::Stub::WaitUpdate, r);
      }
      case 8: *method = "MigrateColumns"; {
        v1::MigrateColumnsRequest r;
        *r.mutable_session() = Ref(true);
        r.set_param(Name());
        const int n = Pick(4);
        for (int i = 0; i < n; ++i) {
          r.add_columns(I64());
          if (Pick(4)) r.add_steps(I64());
        }
        r.set_handover(Pick(2) == 0);
        if (Pick(2) == 0) r.set_handovers_before(I64());
        for (int m = Pick(3); m > 0; --m) {
          v1::ColumnHandover* h = r.add_more();
          h->set_param(Name());
          for (int i = Pick(3); i > 0; --i) {
            h->add_columns(I64());
            if (Pick(4)) h->add_steps(I64());
          }
        }
        return Call(&v1::Offload::Stub::MigrateColumns, r);
      }
      case 9: *method = "Checkpoint"; {
        v1::CheckpointRequest r;
        *r.mutable_session() = Ref(true);
        r.set_tag(Tag());
        return Call(&v1::Offload::Stub::Checkpoint, r);
      }
      case 10: *method = "Restore"; {
        v1::RestoreRequest r;
        *r.mutable_session() = Ref(true);
        r.set_tag(Tag());
        r.set_out_dtype(static_cast<v1::DType>(Pick(5)));
        return Call(&v1::Offload::Stub::Restore, r);
      }
      case 11: *method = "ListCheckpoints"; {
        v1::ListCheckpointsRequest r;
        if (Pick(2)) *r.mutable_session() = Ref(true);
        if (Pick(2)) *r.mutable_caller() = Caller();
        return Call(&v1::Offload::Stub::ListCheckpoints, r);
      }
      case 12: *method = "ReadCheckpoint"; {
        v1::ReadCheckpointRequest r;
        *r.mutable_session() = Ref(true);
        r.set_tag(Tag());
        r.set_offset(U64());
        r.set_delete_after(Pick(2));
        return Call(&v1::Offload::Stub::ReadCheckpoint, r);
      }
      case 13: *method = "WriteCheckpoint"; {
        v1::WriteCheckpointRequest r;
        *r.mutable_session() = Ref(true);
        r.set_tag(Tag());
        r.set_offset(U64());
        r.set_length(U64());
        r.set_total_bytes(U64());
        return Call(&v1::Offload::Stub::WriteCheckpoint, r);
      }
      case 14: *method = "DeleteCheckpoint"; {
        v1::DeleteCheckpointRequest r;
        if (Pick(2)) *r.mutable_session() = Ref(true);
        else *r.mutable_caller() = Caller();
        r.set_tag(Tag());
        return Call(&v1::Offload::Stub::DeleteCheckpoint, r);
      }
      case 15: *method = "ListSessions"; {
        v1::ListSessionsRequest r;
        if (Pick(2)) *r.mutable_caller() = Caller();
        return Call(&v1::Offload::Stub::ListSessions, r);
      }
      case 17: *method = "ExportState"; {
        v1::ExportStateRequest r;
        *r.mutable_session() = Ref(true);
        r.set_offset(Pick(2) ? 0 : U64());
        return Call(&v1::Offload::Stub::ExportState, r);
      }
      case 18: *method = "ImportState"; {
        // Whatever the staging area holds (often an export's first chunk) as a state's bytes.
        v1::ImportStateRequest r;
        *r.mutable_session() = Ref(true);
        r.set_offset(Pick(2) ? 0 : U64());
        r.set_length(U64());
        r.set_total_bytes(U64());
        r.set_out_dtype(static_cast<v1::DType>(Pick(5)));
        return Call(&v1::Offload::Stub::ImportState, r);
      }
      default: *method = "garbage"; return Garbage(method);
    }
  }

 private:
  int Pick(int n) { return static_cast<int>(rng_() % static_cast<uint64_t>(n)); }

  uint64_t U64() {
    static const uint64_t kEdge[] = {0, 1, 2, 3, 4, 7, 8, 15, 16, 4095, 4096, 65536,
                                     (uint64_t{1} << 31), (uint64_t{1} << 32) - 1,
                                     (uint64_t{1} << 40), (uint64_t{1} << 63),
                                     (uint64_t{1} << 63) - 1, ~uint64_t{0}, ~uint64_t{0} - 3};
    if (Pick(3)) return kEdge[Pick(sizeof kEdge / sizeof kEdge[0])];
    return rng_() >> Pick(64);
  }
  int64_t I64() {  // negated in unsigned arithmetic (no signed overflow at -2^63)
    const uint64_t u = U64();
    return static_cast<int64_t>(Pick(4) == 0 ? uint64_t{0} - u : u);
  }
  double F64() {
    static const double kEdge[] = {0.0, -0.0, 1e-3, 0.9, 0.999, 1.0, -1.0, 1e-308, 1e308,
                                   std::numeric_limits<double>::infinity(),
                                   -std::numeric_limits<double>::infinity(),
                                   std::numeric_limits<double>::quiet_NaN(),
                                   std::numeric_limits<double>::denorm_min()};
    return kEdge[Pick(sizeof kEdge / sizeof kEdge[0])];
  }
  float F32() { return static_cast<float>(F64()); }

  std::string Name() {
    static const char* kNames[] = {"w", "b", "", "w\0x", "../w", "w/..", "x", "a b"};
    std::string n = kNames[Pick(8)];
    if (Pick(8) == 0) n.push_back('\0');
    if (Pick(16) == 0) n = std::string(2000, 'n');
    return n;
  }
  std::string Tag() {
    static const char* kTags[] = {"t", "ok.tag-1", "", ".", "..", "../etc/passwd", "a/b", "/abs",
                                  ".hidden", "x..y", "sp ace", "0", "65534"};
    std::string t = kTags[Pick(13)];
    if (Pick(8) == 0) t += std::string(1, '\0') + "nul";
    if (Pick(16) == 0) t = std::string(Pick(2) ? 128 : 129, 't');
    return t;
  }
  std::string Bytes(size_t max) {
    std::string b(static_cast<size_t>(Pick(static_cast<int>(max) + 1)), '\0');
    for (char& c : b) c = static_cast<char>(rng_());
    return b;
  }
  v1::ParamSpec Spec() {
    v1::ParamSpec s;
    s.set_name(Name());
    const int dims = Pick(10);
    for (int d = 0; d < dims; ++d)  // a leading 0 at times: a rank's share of no rows
      s.add_shape(d == 0 && Pick(6) == 0 ? 0
                  : Pick(3)                ? static_cast<int64_t>(1 + Pick(64))
                                           : I64());
    s.set_grad_dtype(static_cast<v1::DType>(Pick(5)));
    return s;
  }
  v1::SessionRef Ref(bool allow_real) {
    v1::SessionRef r;
    if (allow_real && !targets_.empty() && Pick(3)) {
      r = targets_[Pick(static_cast<int>(targets_.size()))];
      if (Pick(6) == 0) r.set_token(r.token().substr(0, Pick(32)) + "ff");  // a wrong token
      return r;
    }
    r.set_session_id(U64());
    r.set_token(Pick(2) ? "" : std::string(32, 'a'));
    return r;
  }
  v1::CallerRef Caller() {
    v1::CallerRef c;
    if (Pick(2)) {
      auto real = client_->Caller();
      if (real.ok()) c = *real;
      if (Pick(3) == 0) c.set_token("0" + c.token());
      return c;
    }
    c.set_caller_id(U64());
    // Printable: a string field with invalid UTF-8 does not parse, which the garbage bodies
    // already cover.
    std::string token = Bytes(40);
    for (char& ch : token) ch = static_cast<char>('!' + static_cast<unsigned char>(ch) % 90);
    c.set_token(token);
    return c;
  }
  v1::OpenSessionRequest OpenReq() {
    v1::OpenSessionRequest r;
    r.set_name(Pick(8) ? Name() : std::string(300, 'n'));
    r.set_rank(static_cast<int32_t>(I64()));
    r.set_pid(Pick(2) ? static_cast<int64_t>(getpid()) : I64());
    return r;
  }

  template <typename Req, typename Resp>
  StatusCode Call(grpc::Status (v1::Offload::Stub::*rpc)(grpc::ClientContext*, const Req&, Resp*),
                  const Req& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    Resp resp;
    grpc::Status st = (client_->stub()->*rpc)(&ctx, req, &resp);
    if constexpr (std::is_same<Resp, v1::OpenSessionResponse>::value) {
      // New sessions join the targets (their tokens are real).
      if (st.ok() && targets_.size() < 64) targets_.push_back(resp.session());
    }
    return st.error_code();
  }

  // Raw bytes as the body of a random method (the generic stub skips protobuf).
  StatusCode Garbage(std::string* method) {
    static const char* kMethods[] = {"OpenSession", "RegisterParams", "PushGradients", "Update",
                                     "MigrateColumns", "Checkpoint", "WriteCheckpoint",
                                     "ImportState", "ListSessions", "NoSuchMethod"};
    *method = std::string("garbage:") + kMethods[Pick(10)];
    grpc::GenericStub stub(channel());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const std::string body = Bytes(256);
    grpc::Slice slice(body);
    grpc::ByteBuffer request(&slice, 1), response;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status result;
    static char handoff;  // gRPC's callback hand-off, made visible to TSan
    TsanRelease(&handoff);
    stub.UnaryCall(&ctx, "/stallfree.v1.Offload/" + method->substr(8), grpc::StubOptions(),
                   &request, &response, [&](grpc::Status s) {
                     TsanAcquire(&handoff);
                     std::lock_guard<std::mutex> lock(mu);
                     result = s;
                     done = true;
                     cv.notify_all();
                   });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    return result.error_code();
  }

  std::shared_ptr<grpc::Channel> channel() {
    if (!channel_)
      channel_ = grpc::CreateChannel("unix:" + client_->socket_path(),
                                     grpc::InsecureChannelCredentials());
    return channel_;
  }

  Client* client_;
  std::mt19937_64 rng_;
  std::vector<v1::SessionRef> targets_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST(Fuzz, HostileRequestsGetDocumentedCodesAndTheDaemonServesOn) {
  testing::Daemon d({"--threads", "2", "--pinned_mib", "256"}, "warning");
  ASSERT_TRUE(d.started()) << d.error();
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok()) << client.status();
  // Targets: a registered, loaded and updated session; a registered one; an open one.
  auto trained = (*client)->OpenSession("fuzz-trained", 0);
  ASSERT_TRUE(trained.ok());
  ASSERT_TRUE((*trained)->RegisterParams({{"w", {8, 16}, v1::DTYPE_FP32},
                                          {"b", {16}, v1::DTYPE_BF16}}).ok());
  ASSERT_TRUE((*trained)->LoadParams().ok());
  auto registered = (*client)->OpenSession("fuzz-registered", 1);
  ASSERT_TRUE(registered.ok());
  ASSERT_TRUE((*registered)->RegisterParams({{"w", {4, 9}, v1::DTYPE_BF16}}).ok());
  auto open = (*client)->OpenSession("fuzz-open", 2);
  ASSERT_TRUE(open.ok());

  // The codes a request may get (offload.proto); garbage bodies may also get gRPC's own
  // UNIMPLEMENTED (no such method) or INTERNAL (the body does not parse).
  const std::set<StatusCode> documented = {
      StatusCode::OK, StatusCode::INVALID_ARGUMENT, StatusCode::NOT_FOUND,
      StatusCode::PERMISSION_DENIED, StatusCode::UNAUTHENTICATED, StatusCode::FAILED_PRECONDITION,
      StatusCode::ABORTED, StatusCode::RESOURCE_EXHAUSTED, StatusCode::DEADLINE_EXCEEDED,
      StatusCode::DATA_LOSS};
  std::map<std::string, std::map<int, int>> seen;  // method -> code -> count
  std::map<std::string, double> spent;              // method -> seconds
  int requests = 0;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    Fuzzer f(client->get(), seed);
    for (const auto* s : {trained->get(), registered->get(), open->get()}) f.AddTarget(s->ref());
    for (int i = 0; i < kRequestsPerSeed; ++i, ++requests) {
      std::string method;
      const auto t0 = std::chrono::steady_clock::now();
      const StatusCode code = f.Next(&method);
      seen[method][code]++;
      spent[method] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const bool garbage = method.rfind("garbage:", 0) == 0;
      const bool ok =
          documented.count(code) > 0 ||
          (garbage && (code == StatusCode::UNIMPLEMENTED || code == StatusCode::INTERNAL));
      ASSERT_TRUE(ok) << "seed " << seed << " request " << i << ": " << method << " got code "
                      << code << "\n" << d.Log();
      ASSERT_EQ(kill(d.pid(), 0), 0) << "the daemon died at seed " << seed << " request " << i;
    }
  }
  EXPECT_GE(requests, 5000);
  for (const auto& [method, codes] : seen) {
    std::string line = method + ":";
    for (const auto& [code, n] : codes)
      line += " " + std::to_string(code) + "x" + std::to_string(n);
    printf("%s (%.2f s)\n", line.c_str(), spent[method]);
  }

  // The daemon serves a good session normally: one AdamW step of w = 1 with gradient 0.5, lr
  // 0.01, betas (0.9, 0.999), eps 1e-8, no decay: m^ = 0.5, v^ = 0.25, w = 1 - 0.01 * 0.5 /
  // (0.5 + 1e-8).
  auto good = (*client)->OpenSession("good", 0);
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_TRUE((*good)->RegisterParams({{"w", {4}, v1::DTYPE_FP32}}).ok());
  float* w0 = (*good)->StagingFp32("w");
  for (int i = 0; i < 4; ++i) w0[i] = 1.0f;
  ASSERT_TRUE((*good)->LoadParams().ok());
  float* g = static_cast<float*>((*good)->GradSlot(0, "w"));
  for (int i = 0; i < 4; ++i) g[i] = 0.5f;
  ASSERT_TRUE((*good)->Push(1, 0).ok());
  v1::AdamWHyper h;
  h.set_lr(0.01);
  h.set_beta1(0.9);
  h.set_beta2(0.999);
  h.set_eps(1e-8);
  ASSERT_TRUE((*good)->Update(1, h, 1).ok());
  auto ready = (*good)->WaitUpdate(1);
  ASSERT_TRUE(ready.ok()) << ready.status();
  const float* w = (*good)->ParamsFp32(ready->param_slot(), "w");
  const double want = 1.0 - 0.01 * 0.5 / (0.5 + 1e-8);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(w[i], want, 1e-6) << i;
  // A non-finite scale never reaches the accumulator.
  for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ((*good)->Push(2, 0, bad).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ((*good)
                  ->UpdateWithPush(2, h, 0, v1::DTYPE_FP32, /*grad_slot=*/0, /*push_scale=*/bad)
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
  auto stats = (*client)->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GT(stats->rejected_requests(), 1000);
}

// A memfd holding `bytes` (of `size` bytes when larger: sparse), sealed against shrinking and
// growing as a session's state is, unless seal is false.
int Memfd(const std::string& bytes, uint64_t size, bool seal) {
  const int fd = memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  if (ftruncate(fd, static_cast<off_t>(std::max<uint64_t>(size, bytes.size()))) != 0 ||
      pwrite(fd, bytes.data(), bytes.size(), 0) != static_cast<ssize_t>(bytes.size())) {
    close(fd);
    return -1;
  }
  if (seal) fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
  return fd;
}

std::string ReadAll(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return "";
  std::string out(static_cast<size_t>(st.st_size), '\0');
  if (pread(fd, out.data(), out.size(), 0) != static_cast<ssize_t>(out.size())) return "";
  return out;
}

// A state whose record checks out (identity and a commit written by SessionRecord) for a
// registration of random parameters, owned by this uid with `token` and `generation`: sized as
// this daemon lays it out (sparse beyond the record) when `consistent`, else as given.
std::string CraftedRecord(std::mt19937_64& rng, const std::string& token, uint64_t generation,
                          bool consistent, uint64_t* size) {
  v1::RegisterParamsRequest req;
  const int n = 1 + static_cast<int>(rng() % 3);
  for (int i = 0; i < n; ++i) {
    v1::ParamSpec* p = req.add_params();
    p->set_name(rng() % 5 == 0 ? std::string("a\0b", 3) : "p" + std::to_string(i));
    // Rows up to 2^26 (a state of up to 4 GiB a parameter, sparse here), columns up to 64.
    if (rng() % 2)
      p->add_shape(rng() % 3 == 0 ? static_cast<int64_t>(1) << (10 + rng() % 17)
                                  : 1 + static_cast<int64_t>(rng() % 64));
    p->add_shape(1 + static_cast<int64_t>(rng() % 64));
    p->set_grad_dtype(rng() % 2 ? v1::DTYPE_FP32 : v1::DTYPE_BF16);
  }
  req.set_param_slots(1 + rng() % 2);
  absl::StatusOr<SessionLayout> layout = LayOutParams(req);
  if (!layout.ok()) return "";
  SessionIdentity id;
  id.uid = getuid();
  id.generation = generation;
  id.token_sha256 = TokenDigest(token);
  id.name = "crafted";
  id.param_slots = req.param_slots();
  id.params = RecordParamsOf(*layout);
  id.total_elems = layout->total_elems;
  id.state_stride = layout->state_stride;
  id.region_bytes = layout->region.region_bytes();
  id.state_bytes = consistent ? layout->state_bytes : layout->state_bytes + 4096 * (rng() % 3);
  std::string bytes(layout->arrays_offset, '\0');
  SessionRecord record(reinterpret_cast<uint8_t*>(bytes.data()), bytes.size());
  if (!record.WriteIdentity(id).ok()) return "";
  SessionCommit c;
  for (const ParamLayout& p : layout->params) c.col_steps.emplace_back(p.cols, 1);
  c.busy = static_cast<RecordBusy>(rng() % 2 ? 0 : rng() % 9);
  c.ready_slot = static_cast<uint32_t>(rng() % 3);
  c.ready_dtype = static_cast<uint32_t>(rng() % 4);
  c.version = rng() % 4 == 0 ? -1 : 3;
  if (!record.Commit(c).ok()) return "";
  *size = id.state_bytes;
  return bytes;
}

// Hostile ADOPTs on the fd socket (fd_server.h), from fixed seeds: malformed lines, no, one or
// three descriptors, descriptors that are no memfd (a pipe, /dev/null), unsealed or cut-short
// copies of a real session's state, copies with flipped bytes, and records that check out but
// claim hostile layouts (sparse states far over the pinned budget, states whose size disagrees,
// commits out of range or busy). Every answer is "ERR <a documented code>" (or "OK" for a whole
// copy of a real state under its own token, which is then dropped), the daemon stays up and
// its pinned memory returns to what the real sessions hold, and the real session trains on.
TEST(Fuzz, HostileAdoptionsGetDocumentedCodesAndTheDaemonServesOn) {
  testing::Daemon d({"--threads", "2", "--pinned_mib", "256"}, "warning");
  ASSERT_TRUE(d.started()) << d.error();
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok()) << client.status();
  auto victim = (*client)->OpenSession("victim", 0);
  ASSERT_TRUE(victim.ok());
  Session& v = **victim;
  ASSERT_TRUE(v.RegisterParams({{"w", {8, 16}, v1::DTYPE_FP32}}, v1::DTYPE_FP32, 1).ok());
  ASSERT_TRUE(v.LoadParams().ok());
  auto stats = (*client)->GetStats();
  ASSERT_TRUE(stats.ok());
  const std::string fd_socket = stats->fd_socket();
  const uint64_t pinned_before = stats->pinned_bytes();
  const std::string real = ReadAll(v.state_fd());
  ASSERT_FALSE(real.empty());
  const std::string token = v.ref().token();
  const std::set<std::string> documented = {"INVALID_ARGUMENT", "PERMISSION_DENIED",
                                            "FAILED_PRECONDITION", "DATA_LOSS",
                                            "RESOURCE_EXHAUSTED", "UNAVAILABLE"};
  std::map<std::string, int> seen;
  int adopted = 0;
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(null_fd, 0);
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    std::mt19937_64 rng(seed);
    for (int i = 0; i < 150; ++i) {
      std::string tok = rng() % 3 ? token : (rng() % 2 ? "forged" : std::string(200, 'x'));
      const uint64_t gen = std::vector<uint64_t>{0, 1, 2, ~uint64_t{0}}[rng() % 4];
      std::string line = "ADOPT " + tok + " " + std::to_string(gen) + "\n";
      switch (rng() % 8) {
        case 0: line = "ADOPT\n"; break;
        case 1: line = "ADOPT " + tok + " x\n"; break;
        case 2: line = "ADOPT " + tok + " 1 extra\n"; break;
        case 3: line = "ADOPT " + tok + " -1\n"; break;
        default: break;
      }
      std::vector<int> owned;  // closed after the exchange
      std::string state = real;
      uint64_t size = real.size();
      bool seal = true;
      switch (rng() % 7) {
        case 0:  // flipped bytes
          for (int k = 0; k < 1 + static_cast<int>(rng() % 4); ++k)
            state[rng() % std::min<size_t>(state.size(), 8192)] ^= 1 + rng() % 255;
          break;
        case 1: seal = false; break;
        case 2: state.resize(rng() % state.size()); size = state.size(); break;
        case 3: state = CraftedRecord(rng, tok, gen, rng() % 2, &size); break;
        case 4: state = std::string(rng() % 9000, static_cast<char>(rng())); size = state.size(); break;
        default: break;
      }
      int sfd = -1;
      const uint64_t kind = rng() % 10;
      if (kind == 0) {
        int p[2];
        ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
        owned = {p[0], p[1]};
        sfd = p[0];
      } else if (kind == 1) {
        sfd = null_fd;
      } else {
        sfd = Memfd(state, size, seal);
        ASSERT_GE(sfd, 0) << strerror(errno) << ": " << size << " bytes";
        owned.push_back(sfd);
      }
      std::vector<int> fds = {v.region_fd(), sfd};
      switch (rng() % 6) {
        case 0: fds.clear(); break;
        case 1: fds = {sfd}; break;
        case 2: fds.push_back(null_fd); break;
        case 3: fds = {sfd, sfd}; break;
        default: break;
      }
      absl::StatusOr<int> conn = ConnectUnix(fd_socket);
      ASSERT_TRUE(conn.ok()) << conn.status();
      std::string reply;
      std::vector<int> got;
      absl::Status st = SendWithFds(*conn, line, fds);
      if (st.ok()) st = RecvWithFds(*conn, 512, &reply, &got, 0);
      close(*conn);  // an adopted copy goes with its connection
      for (int fd : owned) close(fd);
      ASSERT_TRUE(st.ok()) << "seed " << seed << " request " << i << ": " << st;
      if (reply.rfind("OK ", 0) == 0) {
        ++adopted;
        ++seen["OK"];
      } else {
        std::istringstream in(reply);
        std::string err, code;
        in >> err >> code;
        ASSERT_EQ(err, "ERR") << reply;
        ASSERT_TRUE(documented.count(code)) << "seed " << seed << " request " << i << ": "
                                            << line << " got " << reply << "\n" << d.Log();
        ++seen[code];
      }
      ASSERT_EQ(kill(d.pid(), 0), 0) << "the daemon died at seed " << seed << " request " << i;
    }
  }
  close(null_fd);
  std::string summary;
  for (const auto& [code, n] : seen) summary += " " + code + "x" + std::to_string(n);
  printf("adoptions:%s\n", summary.c_str());
  EXPECT_GE(seen["DATA_LOSS"], 10);
  EXPECT_GE(seen["PERMISSION_DENIED"], 10);
  EXPECT_GE(seen["FAILED_PRECONDITION"], 10);
  EXPECT_GE(seen["INVALID_ARGUMENT"], 10);
  EXPECT_GE(seen["RESOURCE_EXHAUSTED"], 1);
  // The copies adopted went with their connections: the daemon's pinned memory is the real
  // session's again.
  for (int i = 0; i < 200; ++i) {
    auto now = (*client)->GetStats();
    ASSERT_TRUE(now.ok());
    if (now->pinned_bytes() == pinned_before) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  auto after = (*client)->GetStats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->pinned_bytes(), pinned_before) << adopted << " copies adopted";
  // The real session trains on.
  float* g = static_cast<float*>(v.GradSlot(0, "w"));
  for (int i = 0; i < 128; ++i) g[i] = 0.5f;
  ASSERT_TRUE(v.Push(1, 0).ok());
  v1::AdamWHyper h;
  h.set_lr(0.01);
  h.set_beta1(0.9);
  h.set_beta2(0.999);
  h.set_eps(1e-8);
  ASSERT_TRUE(v.Update(1, h, 0).ok());
  EXPECT_TRUE(v.WaitUpdate(1).ok());
}

}  // namespace
}  // namespace stallfree
