// Integration tests against a real stallfreed process on a temporary unix socket.
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>
#include <gtest/gtest.h>

#include "client/client.h"
#include "common/bf16.h"
#include "common/unix_socket.h"
#include "testing/daemon_process.h"
#include "testing/hyper.h"
#include "tests/server/adamw_config.h"
#include "kernels/optimizer.h"
#include "server/session_record.h"

namespace stallfree {
namespace {

using Code = absl::StatusCode;
using testing::Daemon;

v1::AdamWHyper Hyper() { return testing::TestHyper(0.05); }

kernels::AdamWConfig Config(const v1::AdamWHyper& h, int64_t step) {
  return testing::ConfigOf(h, step);
}

// Trains two parameters (fp32 and bf16 gradients) through the daemon for several steps, two
// pushes per update, and compares with the reference kernel run locally on the same data.
void TrainAndCompare(const std::string& socket, int seed) {
  auto client = Client::Connect(socket);
  ASSERT_TRUE(client.ok()) << client.status();
  auto session = (*client)->OpenSession("t" + std::to_string(seed), seed);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  const int64_t nw = 64 * 33, nb = 100;
  ASSERT_TRUE(s.RegisterParams({{"w", {64, 33}, v1::DTYPE_FP32}, {"b", {nb}, v1::DTYPE_BF16}}).ok());
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> w(nw), b(nb);
  for (auto& x : w) x = normal(rng);
  for (auto& x : b) x = normal(rng);
  memcpy(s.StagingFp32("w"), w.data(), nw * 4);
  memcpy(s.StagingFp32("b"), b.data(), nb * 4);
  ASSERT_TRUE(s.LoadParams().ok());
  std::vector<float> mw(nw, 0), vw(nw, 0), mb(nb, 0), vb(nb, 0);
  const auto& k = kernels::ReferenceKernel();
  const v1::AdamWHyper h = Hyper();
  for (int64_t step = 1; step <= 5; ++step) {
    std::vector<float> accw(nw, 0), accb(nb, 0);
    for (uint32_t slot = 0; slot < 2; ++slot) {
      std::vector<float> gw(nw);
      std::vector<uint16_t> gb(nb);
      for (auto& x : gw) x = normal(rng);
      for (auto& x : gb) x = FloatToBf16(normal(rng));
      memcpy(s.GradSlot(slot, "w"), gw.data(), nw * 4);
      memcpy(s.GradSlot(slot, "b"), gb.data(), nb * 2);
      auto pushed = s.Push(step, slot, 0.5f);
      ASSERT_TRUE(pushed.ok()) << pushed.status();
      EXPECT_EQ(pushed->accumulated_pushes(), slot + 1);
      k.Accumulate(accw.data(), gw.data(), kernels::GradType::kFp32, 0.5f, nw);
      k.Accumulate(accb.data(), gb.data(), kernels::GradType::kBf16, 0.5f, nb);
    }
    const uint32_t pslot = step % 2;
    const v1::DType out = step == 5 ? v1::DTYPE_BF16 : v1::DTYPE_FP32;
    ASSERT_TRUE(s.Update(step, h, pslot, out).ok());
    auto fut = s.WaitUpdateAsync(step);
    k.AdamW(Config(h, step), w.data(), mw.data(), vw.data(), accw.data(), kernels::GradType::kFp32,
            nw, nullptr);
    k.AdamW(Config(h, step), b.data(), mb.data(), vb.data(), accb.data(), kernels::GradType::kFp32,
            nb, nullptr);
    auto ready = fut.get();
    ASSERT_TRUE(ready.ok()) << ready.status();
    EXPECT_EQ(ready->version(), step);
    EXPECT_EQ(ready->param_slot(), pslot);
    // Same kernel, same order of operations: bit for bit.
    if (out == v1::DTYPE_FP32) {
      ASSERT_EQ(0, memcmp(s.ParamsFp32(pslot, "w"), w.data(), nw * 4)) << "step " << step;
      ASSERT_EQ(0, memcmp(s.ParamsFp32(pslot, "b"), b.data(), nb * 4)) << "step " << step;
    } else {
      for (int64_t i = 0; i < nw; ++i) ASSERT_EQ(s.ParamsBf16(pslot, "w")[i], FloatToBf16(w[i]));
      for (int64_t i = 0; i < nb; ++i) ASSERT_EQ(s.ParamsBf16(pslot, "b")[i], FloatToBf16(b[i]));
    }
  }
  EXPECT_TRUE(s.Close().ok());
}

TEST(Daemon, TwoClientsAtOnceMatchReferenceAdamW) {
  Daemon d;
  std::thread a([&] { TrainAndCompare(d.socket(), 1); });
  std::thread b([&] { TrainAndCompare(d.socket(), 2); });
  a.join();
  b.join();
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok());
  auto stats = (*client)->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sessions_opened(), 2);
  EXPECT_EQ(stats->sessions_closed(), 2);
  EXPECT_EQ(stats->updates(), 10);
  EXPECT_EQ(stats->pushes(), 20);
  EXPECT_EQ(stats->sessions(), 0);
}

// The host footprint, end to end: the cold part of 3 x Linear(1024, 1024) at top-k 0.1 (what
// ZenFlowAdamW registers by default) with bf16 gradients in and bf16 parameters out, one
// parameter slot. GetStats reports the session's true pinned bytes (region + state): 22.125 per
// registered element, under 20 per model parameter. The values load in chunks through the small
// staging area, and a round through the daemon equals the reference AdamW bit for bit.
TEST(Daemon, Bf16SessionPinsAbout22BytesPerRegisteredElement) {
  Daemon d;
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok()) << client.status();
  auto session = (*client)->OpenSession("footprint", 0);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  const int64_t rows = 1024, cols = 922, n = rows * cols;
  const std::vector<std::string> names = {"0.weight", "1.weight", "2.weight"};
  std::vector<ParamSpec> specs;
  for (const std::string& name : names) specs.push_back({name, {rows, cols}, v1::DTYPE_BF16});
  ASSERT_TRUE(s.RegisterParams(specs, v1::DTYPE_BF16, 1).ok());
  EXPECT_EQ(s.layout().param_slots(), 1u);
  EXPECT_EQ(s.layout().param_dtype(), v1::DTYPE_BF16);
  auto stats = (*client)->GetStats();
  ASSERT_TRUE(stats.ok());
  const uint64_t elems = 3 * n;
  EXPECT_EQ(stats->param_elements(), static_cast<int64_t>(elems));
  // The state: the session record's pages (server/session_record.h: two commits of 8 bytes a
  // column, 44 KiB here), then 16 bytes per element, its arrays 272 elements further apart (elems
  // is a multiple of 1024; StateStride staggers them within a page).
  std::vector<RecordParam> record;
  for (const std::string& name : names) record.push_back({name, {rows, cols}, v1::DTYPE_BF16});
  const uint64_t record_pages = (RecordBytes(record) + 4095) / 4096 * 4096;
  EXPECT_EQ(record_pages, 11u * 4096);
  // Then, from the next page, the work journal (server/session_journal.h): 17216 bytes of
  // header, entry (with room for a handover's plan: 24 bytes a column it can move) and bitmap,
  // and 2 slots of 3 x 1024 floats.
  const uint64_t journal_at = (record_pages + 16 * (elems + 272) + 4095) / 4096 * 4096;
  const uint64_t state = journal_at + 17216 + 2 * 3 * 1024 * 4;
  EXPECT_EQ(stats->pinned_bytes(), s.layout().region_bytes() + state);
  EXPECT_EQ(s.state_bytes(), state);
  const double per_elem = static_cast<double>(stats->pinned_bytes()) / elems;
  EXPECT_GE(per_elem, 22.125);
  // The padding and the record: 0.019 an element; the journal from its page on: 0.015.
  EXPECT_LE(per_elem, 22.125 + 0.035);
  EXPECT_LE(static_cast<double>(stats->pinned_bytes()) / (3 * (1024 * 1024 + 1024)), 20.0);

  // Too large for a whole load from the staging area; LoadValues chunks it.
  EXPECT_EQ(s.StagingFp32("1.weight"), nullptr);
  EXPECT_EQ(s.LoadParams().code(), Code::kInvalidArgument);
  ASSERT_LT(s.staging_floats(), elems);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> w(3, std::vector<float>(n));
  std::vector<std::pair<std::string, const float*>> values;
  for (int i = 0; i < 3; ++i) {
    for (float& x : w[i]) x = normal(rng);
    values.push_back({names[i], w[i].data()});
  }
  ASSERT_TRUE(s.LoadValues(values).ok());

  // One step: a bf16 push, an Update into the one bf16 slot.
  std::vector<std::vector<float>> acc(3, std::vector<float>(n, 0.0f));
  const auto& k = kernels::ReferenceKernel();
  for (int i = 0; i < 3; ++i) {
    std::vector<uint16_t> g(n);
    for (uint16_t& x : g) x = FloatToBf16(normal(rng));
    memcpy(s.GradSlot(0, names[i]), g.data(), n * 2);
    k.Accumulate(acc[i].data(), g.data(), kernels::GradType::kBf16, 1.0f, n);
  }
  ASSERT_TRUE(s.Push(1, 0).ok());
  const v1::AdamWHyper h = Hyper();
  EXPECT_EQ(s.Update(1, h, 1, v1::DTYPE_BF16).code(), Code::kInvalidArgument);  // no slot 1
  EXPECT_EQ(s.Update(1, h, 0, v1::DTYPE_FP32).code(), Code::kFailedPrecondition);
  EXPECT_EQ(s.ParamsBf16(1, names[0]), nullptr);
  EXPECT_EQ(s.ParamsFp32(0, names[0]), nullptr);
  v1::UpdateRequest req;  // out_dtype unspecified: the registered BF16
  req.set_step(1);
  *req.mutable_hyper() = h;
  ASSERT_TRUE(s.Update(req).ok());
  auto ready = s.WaitUpdate(1);
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_EQ(ready->dtype(), v1::DTYPE_BF16);
  std::vector<float> m(n), v(n);
  for (int i = 0; i < 3; ++i) {
    std::fill(m.begin(), m.end(), 0.0f);
    std::fill(v.begin(), v.end(), 0.0f);
    k.AdamW(Config(h, 1), w[i].data(), m.data(), v.data(), acc[i].data(),
            kernels::GradType::kFp32, n, nullptr);
    const uint16_t* got = s.ParamsBf16(0, names[i]);
    ASSERT_NE(got, nullptr);
    for (int64_t j = 0; j < n; ++j)
      ASSERT_EQ(got[j], FloatToBf16(w[i][j])) << names[i] << " [" << j << "]";
  }
  auto after = (*client)->GetStats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->pinned_bytes(), stats->pinned_bytes());
  EXPECT_TRUE(s.Close().ok());
}

// The session's optimizer state lives in a memfd whose descriptor the session's process holds
// from the attach on (never mapped by the client library): after an Update the master there is
// AdamW's, bit for bit, and after the daemon is SIGKILLed the memory is still there, the same
// bytes, for whatever re-adopts it. (Also: the state's four arrays are staggered: m begins
// state_stride elements after the master.)
TEST(Daemon, TheStateOutlivesTheDaemonInTheSessionsOwnDescriptor) {
  Daemon d;
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok()) << client.status();
  auto session = (*client)->OpenSession("survivor", 0);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  const int64_t rows = 64, cols = 40, n = rows * cols;
  ASSERT_TRUE(s.RegisterParams({{"w", {rows, cols}, v1::DTYPE_FP32}}, v1::DTYPE_FP32, 1).ok());
  ASSERT_GE(s.state_fd(), 0);
  struct stat st;
  ASSERT_EQ(fstat(s.state_fd(), &st), 0);
  // The record's page (server/session_record.h), then 2560 elements: the arrays 2560 + 784
  // apart (272 past a multiple of 1024), 16 bytes each; then from the next page the work
  // journal (server/session_journal.h): 2496 bytes of header, entry and bitmap, and 2 slots
  // of 3 units of 256 elements.
  const uint64_t stride = 2560 + 784, arrays_at = 4096;
  const uint64_t state_bytes = (arrays_at + 16 * stride + 4095) / 4096 * 4096 + 2496 + 2 * 3 * 256 * 4;
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), state_bytes);
  EXPECT_EQ(s.state_bytes(), state_bytes);

  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<float> w(n), g(n);
  for (float& x : w) x = normal(rng);
  ASSERT_TRUE(s.LoadValues({{"w", w.data()}}).ok());
  for (float& x : g) x = normal(rng);
  memcpy(s.GradSlot(0, "w"), g.data(), n * 4);
  ASSERT_TRUE(s.Push(1, 0).ok());
  const v1::AdamWHyper h = Hyper();
  v1::UpdateRequest req;
  req.set_step(1);
  *req.mutable_hyper() = h;
  ASSERT_TRUE(s.Update(req).ok());
  ASSERT_TRUE(s.WaitUpdate(1).ok());
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  kernels::ReferenceKernel().AdamW(Config(h, 1), w.data(), m.data(), v.data(), g.data(),
                                   kernels::GradType::kFp32, n, nullptr);

  void* p = mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, s.state_fd(), 0);
  ASSERT_NE(p, MAP_FAILED) << strerror(errno);
  const float* state = reinterpret_cast<const float*>(static_cast<uint8_t*>(p) + arrays_at);
  auto check = [&](const char* when) {
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(state[i], w[i]) << when << ": master [" << i << "]";
      ASSERT_EQ(state[stride + i], m[i]) << when << ": m [" << i << "]";
      ASSERT_EQ(state[2 * stride + i], v[i]) << when << ": v [" << i << "]";
    }
  };
  check("after the Update");
  ASSERT_EQ(kill(d.pid(), SIGKILL), 0);
  for (int i = 0; i < 200 && kill(d.pid(), 0) == 0; ++i) {  // until the zombie is all it is
    int status = 0;
    if (waitpid(d.pid(), &status, WNOHANG) == d.pid()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  check("after the daemon's SIGKILL");
  munmap(p, st.st_size);
  // Mapped anew from the held descriptor alone: the same bytes.
  p = mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, s.state_fd(), 0);
  ASSERT_NE(p, MAP_FAILED) << strerror(errno);
  state = reinterpret_cast<const float*>(static_cast<uint8_t*>(p) + arrays_at);
  check("mapped again from the held descriptor");
  munmap(p, st.st_size);
}

// The fd socket hands the state's descriptor to the session's token only: a wrong token, a
// second attach of an attached session, and an unknown word after the token are each answered
// "ERR ..." without a descriptor.
TEST(Daemon, TheFdSocketGivesTheStateToTheSessionsTokenAlone) {
  Daemon d;
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok()) << client.status();
  auto session = (*client)->OpenSession("held", 0);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->RegisterParams({{"w", {8, 40}, v1::DTYPE_FP32}}).ok());
  auto stats = (*client)->GetStats();
  ASSERT_TRUE(stats.ok());
  const v1::SessionRef& ref = (*session)->ref();
  const std::string id = std::to_string(ref.session_id());
  for (const auto& [line, why] : std::vector<std::pair<std::string, std::string>>{
           {id + " not-the-token STATE\n", "wrong token"},
           {id + " " + ref.token() + " STATE\n", "already attached"},
           {id + " " + ref.token() + " EVERYTHING\n", "expected"}}) {
    SCOPED_TRACE(line);
    auto conn = ConnectUnix(stats->fd_socket());
    ASSERT_TRUE(conn.ok()) << conn.status();
    std::string reply;
    std::vector<int> fds;
    ASSERT_TRUE(SendWithFd(*conn, line, -1).ok());
    ASSERT_TRUE(RecvWithFds(*conn, 512, &reply, &fds, 2).ok());
    for (int fd : fds) close(fd);
    close(*conn);
    EXPECT_EQ(reply.rfind("ERR ", 0), 0u) << reply;
    EXPECT_NE(reply.find(why), std::string::npos) << reply;
    EXPECT_TRUE(fds.empty()) << fds.size() << " descriptors came with the refusal";
  }
  EXPECT_GE((*session)->state_fd(), 0);  // the session's own, untouched
}

TEST(Daemon, ConnectWithoutDaemonNamesTheSocket) {
  auto client = Client::Connect("/tmp/stallfree-no-such-dir/d.sock", 200);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), Code::kUnavailable);
  EXPECT_NE(client.status().message().find("/tmp/stallfree-no-such-dir/d.sock"),
            absl::string_view::npos);
  EXPECT_NE(client.status().message().find("stallfreed --socket"), absl::string_view::npos);
}

TEST(Daemon, BadRequestsGetTheirCodesAndTheDaemonKeepsServing) {
  Daemon d({"--pinned_mib", "2048"});
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok());
  v1::Offload::Stub* stub = (*client)->stub();
  auto session = (*client)->OpenSession("bad", 0);
  ASSERT_TRUE(session.ok());
  Session& s = **session;
  const v1::SessionRef ref = s.ref();

  // Before registration.
  {
    v1::PushGradientsRequest r;
    *r.mutable_session() = ref;
    EXPECT_EQ(s.Push(r).status().code(), Code::kFailedPrecondition);
  }
  // RegisterParams validation.
  auto reg = [&](std::vector<int64_t> shape, v1::DType t, const std::string& name = "x") {
    v1::RegisterParamsRequest r;
    *r.mutable_session() = ref;
    auto* p = r.add_params();
    p->set_name(name);
    for (auto x : shape) p->add_shape(x);
    p->set_grad_dtype(t);
    grpc::ClientContext ctx;
    v1::RegisterParamsResponse resp;
    return FromGrpc(stub->RegisterParams(&ctx, r, &resp));
  };
  EXPECT_EQ(reg({0, 4}, v1::DTYPE_FP32).code(), Code::kInvalidArgument);
  EXPECT_EQ(reg({-3}, v1::DTYPE_FP32).code(), Code::kInvalidArgument);
  EXPECT_EQ(reg({1 << 30, 1 << 30}, v1::DTYPE_FP32).code(), Code::kInvalidArgument);
  EXPECT_EQ(reg({16}, v1::DTYPE_UNSPECIFIED).code(), Code::kInvalidArgument);
  EXPECT_EQ(reg({16}, v1::DTYPE_FP32, "").code(), Code::kInvalidArgument);
  absl::Status budget = reg({int64_t{1} << 28}, v1::DTYPE_FP32);  // 256M elements: > 2 GiB.
  EXPECT_EQ(budget.code(), Code::kResourceExhausted) << budget;
  EXPECT_NE(budget.message().find("budget"), absl::string_view::npos);

  // 32M elements: an update takes tens of milliseconds even on many cores, far longer than the
  // next RPC, so the second Update below reliably finds the first still running.
  const int64_t big = int64_t{32} << 20;
  ASSERT_TRUE(s.RegisterParams({{"w", {big}, v1::DTYPE_FP32}, {"h", {256}, v1::DTYPE_BF16}}).ok());
  EXPECT_EQ(reg({16}, v1::DTYPE_FP32, "again").code(), Code::kFailedPrecondition);

  auto push = [&](v1::GradRange range, uint32_t slot = 0) {
    v1::PushGradientsRequest r;
    r.set_step(1);
    r.set_slot(slot);
    *r.add_ranges() = range;
    return s.Push(r).status();
  };
  auto range = [](std::string p, uint64_t off, uint64_t len, uint64_t first = 0,
                  v1::DType t = v1::DTYPE_UNSPECIFIED) {
    v1::GradRange g;
    g.set_param(p);
    g.set_offset(off);
    g.set_length(len);
    g.set_first_element(first);
    g.set_dtype(t);
    return g;
  };
  const uint64_t slot_bytes = s.layout().grad_slot_bytes();
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  absl::Status st;
  EXPECT_EQ(push(range("w", 0, 64), 2).code(), Code::kInvalidArgument);                 // slot
  EXPECT_EQ(push(range("nope", 0, 64)).code(), Code::kNotFound);                       // param
  st = push(range("w", 64, max - 10));                                                  // overflow
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("ranges[0].offset/length"), absl::string_view::npos) << st;
  EXPECT_EQ(push(range("w", slot_bytes - 4, 8)).code(), Code::kInvalidArgument);       // past end
  EXPECT_EQ(push(range("w", max, 4)).code(), Code::kInvalidArgument);                  // offset
  EXPECT_EQ(push(range("w", 0, 6)).code(), Code::kInvalidArgument);                    // partial
  EXPECT_EQ(push(range("w", 2, 4)).code(), Code::kInvalidArgument);                    // misaligned
  EXPECT_EQ(push(range("h", 0, 64, 0, v1::DTYPE_FP32)).code(), Code::kFailedPrecondition);  // dtype
  EXPECT_EQ(push(range("h", 0, 64, 250)).code(), Code::kInvalidArgument);              // shape
  EXPECT_EQ(push(range("h", 0, 64, max)).code(), Code::kInvalidArgument);              // overflow
  {
    v1::PushGradientsRequest r;
    *r.mutable_session() = ref;
    r.mutable_session()->set_token("0000");
    grpc::ClientContext ctx;
    v1::PushGradientsResponse resp;
    EXPECT_EQ(FromGrpc(stub->PushGradients(&ctx, r, &resp)).code(), Code::kPermissionDenied);
    r.mutable_session()->set_session_id(999);
    grpc::ClientContext ctx2;
    EXPECT_EQ(FromGrpc(stub->PushGradients(&ctx2, r, &resp)).code(), Code::kNotFound);
  }
  // Update validation.
  v1::AdamWHyper h = Hyper();
  v1::AdamWHyper bad = h;
  bad.set_beta1(1.0);
  EXPECT_EQ(s.Update(1, bad, 0).code(), Code::kInvalidArgument);
  bad = h;
  bad.set_eps(-1e-8);
  EXPECT_EQ(s.Update(1, bad, 0).code(), Code::kInvalidArgument);
  bad.set_eps(std::numeric_limits<double>::infinity());
  EXPECT_EQ(s.Update(1, bad, 0).code(), Code::kInvalidArgument);
  EXPECT_EQ(s.Update(0, h, 0).code(), Code::kInvalidArgument);
  EXPECT_EQ(s.Update(1, h, 3).code(), Code::kInvalidArgument);
  ASSERT_TRUE(s.Update(5, h, 0).ok());
  st = s.Update(6, h, 1);  // the 32M-element update of step 5 is still running.
  EXPECT_EQ(st.code(), Code::kAborted) << st;
  ASSERT_TRUE(s.WaitUpdate(5).ok());
  EXPECT_EQ(s.Update(4, h, 1).code(), Code::kFailedPrecondition);  // step goes backwards.
  EXPECT_EQ(s.Update(5, h, 1).code(), Code::kFailedPrecondition);
  EXPECT_EQ(s.LoadParams().code(), Code::kFailedPrecondition);     // would discard state.
  EXPECT_EQ(s.WaitUpdate(9, 100).status().code(), Code::kFailedPrecondition);

  // The daemon still serves good requests on the same session.
  EXPECT_TRUE(push(range("h", 0, 512)).ok());
  EXPECT_TRUE(s.Update(6, h, 1).ok());
  auto ready = s.WaitUpdate(6);
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_EQ(ready->version(), 6);
  auto stats = (*client)->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GE(stats->rejected_requests(), 20);
}

TEST(Daemon, KilledClientIsReclaimedWhileOthersGoOn) {
  Daemon d;
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  pid_t child = fork();
  if (child == 0) {
    dup2(out[1], 1);
    execl("testing/session_holder", "session_holder", d.socket().c_str(), "4194304",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  char buf[64] = {0};
  ASSERT_GT(read(out[0], buf, sizeof buf - 1), 0);
  ASSERT_EQ(std::string(buf).rfind("ready", 0), 0u) << buf;

  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok());
  auto session = (*client)->OpenSession("survivor", 1);
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->RegisterParams({{"w", {1000}, v1::DTYPE_FP32}}).ok());
  auto before = (*client)->GetStats();
  ASSERT_TRUE(before.ok());
  EXPECT_EQ(before->sessions(), 2);
  EXPECT_GT(before->pinned_bytes(), uint64_t{4194304} * 4 * 5);

  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  v1::Stats after;
  for (int i = 0; i < 100; ++i) {
    auto s = (*client)->GetStats();
    ASSERT_TRUE(s.ok());
    after = *s;
    // Freeing is asynchronous: the memory goes when the session's last queued task ends.
    if (after.sessions_reclaimed() == 1 && after.sessions() == 1 &&
        after.pinned_bytes() < (uint64_t{1} << 20))
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(after.sessions_reclaimed(), 1);
  EXPECT_EQ(after.sessions(), 1);
  // Only the survivor's region and state remain: 1000 elements -> a few pages.
  EXPECT_LT(after.pinned_bytes(), uint64_t{1} << 20);
  EXPECT_NE(d.Log().find("reclaimed"), std::string::npos);
  // The survivor goes on.
  EXPECT_TRUE((*session)->Push(1, 0).ok());
  EXPECT_TRUE((*session)->Update(1, Hyper(), 0).ok());
  EXPECT_TRUE((*session)->WaitUpdate(1).ok());
}

// ListSessions and ListCheckpoints say who may ask: no credential is UNAUTHENTICATED, a forged
// one PERMISSION_DENIED.
TEST(Daemon, ListingsNeedACallerCredential) {
  Daemon d;
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok());
  v1::Offload::Stub* stub = (*client)->stub();
  v1::ListSessionsResponse sessions;
  v1::ListCheckpointsResponse checkpoints;
  {
    grpc::ClientContext ctx;
    EXPECT_EQ(stub->ListSessions(&ctx, v1::ListSessionsRequest(), &sessions).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    EXPECT_EQ(stub->ListCheckpoints(&ctx, v1::ListCheckpointsRequest(), &checkpoints).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  auto caller = (*client)->Caller();
  ASSERT_TRUE(caller.ok()) << caller.status();
  v1::ListSessionsRequest forged;
  forged.mutable_caller()->set_caller_id(caller->caller_id());
  forged.mutable_caller()->set_token(std::string(32, '0'));
  {
    grpc::ClientContext ctx;
    EXPECT_EQ(stub->ListSessions(&ctx, forged, &sessions).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  v1::ListSessionsRequest good;
  *good.mutable_caller() = *caller;
  {
    grpc::ClientContext ctx;
    EXPECT_TRUE(stub->ListSessions(&ctx, good, &sessions).ok());
  }
}

TEST(Daemon, SigtermFinishesRunningUpdateAndExitsZero) {
  Daemon d;
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok());
  auto session = (*client)->OpenSession("term", 0);
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->RegisterParams({{"w", {int64_t{8} << 20}, v1::DTYPE_FP32}}).ok());
  ASSERT_TRUE((*session)->Update(1, Hyper(), 0).ok());
  const int status = d.Terminate();
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
  const std::string log = d.Log();
  EXPECT_NE(log.find("signal 15"), std::string::npos) << log;
  EXPECT_NE(log.find("update of step 1 done"), std::string::npos) << log;
  EXPECT_NE(log.find("stallfreed stopped"), std::string::npos) << log;
  struct stat st;
  EXPECT_NE(stat(d.socket().c_str(), &st), 0) << "socket file left behind";
}

// A stallfreed at `socket` (its state under state_dir), started by hand so that it can take the
// socket of a daemon that went away; killed by the caller. -1 without a binary.
pid_t StartDaemonAt(const std::string& socket, const std::string& state_dir) {
  const std::string binary = testing::FindBinary("server/stallfreed");
  if (binary.empty()) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 2);
    execl(binary.c_str(), binary.c_str(), "--socket", socket.c_str(), "--state_dir",
          state_dir.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// The daemon a session lived in went away and another came back on its socket without the
// session: every call of the session is UNAVAILABLE (the new daemon's "no session" included),
// so callers decide by code. A live daemon's missing checkpoint stays NOT_FOUND.
TEST(Daemon, ASessionWhoseDaemonRestartedIsUnavailable) {
  Daemon d;
  ASSERT_TRUE(d.started()) << d.error();
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok()) << client.status();
  auto session = (*client)->OpenSession("lost", 0);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  ASSERT_TRUE(s.RegisterParams({{"w", {64}, v1::DTYPE_FP32}}).ok());
  ASSERT_TRUE(s.Push(1, 0).ok());
  const int status = d.Terminate();
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << "\n" << d.Log();

  const pid_t again = StartDaemonAt(d.socket(), d.dir() + "/state2");
  ASSERT_GT(again, 0);
  // Until the old client's channel has reconnected, the calls fail in the transport; then the
  // new daemon answers "no session". Both are UNAVAILABLE.
  absl::Status push;
  bool daemon_answered = false;
  for (int i = 0; i < 200 && !daemon_answered; ++i) {
    push = s.Push(2, 0).status();
    ASSERT_EQ(push.code(), Code::kUnavailable) << push;
    daemon_answered = push.message().find("no session") != absl::string_view::npos;
    if (!daemon_answered) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(daemon_answered) << "the new daemon never answered: " << push;
  EXPECT_NE(push.message().find("stallfreed went away"), absl::string_view::npos) << push;
  const absl::Status wait = s.WaitUpdate(1).status();
  EXPECT_EQ(wait.code(), Code::kUnavailable) << wait;
  const absl::Status restore = s.Restore("anything").status();
  EXPECT_EQ(restore.code(), Code::kUnavailable) << restore;

  // A session of the new daemon: its missing checkpoint is NOT_FOUND, its calls go on.
  auto fresh_client = Client::Connect(d.socket());
  ASSERT_TRUE(fresh_client.ok()) << fresh_client.status();
  auto fresh = (*fresh_client)->OpenSession("fresh", 0);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  ASSERT_TRUE((*fresh)->RegisterParams({{"w", {64}, v1::DTYPE_FP32}}).ok());
  EXPECT_EQ((*fresh)->Restore("never-written").status().code(), Code::kNotFound);
  EXPECT_TRUE((*fresh)->Push(1, 0).ok());
  kill(again, SIGKILL);
  waitpid(again, nullptr, 0);
}

// MigrateColumns is a handover or nothing: the daemon refuses what would lose state or touch
// memory it must not, refuses the quiescent swap of stallfree 0.1, and hands the columns' state
// out through the staging area.
TEST(Daemon, HandOverColumnsValidatesAndHandsTheStateOut) {
  Daemon d;
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok()) << client.status();
  auto session = (*client)->OpenSession("handover", 0);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  ASSERT_TRUE(s.RegisterParams({{"w", {4, 9}, v1::DTYPE_FP32}}).ok());
  std::vector<float> init(36);
  for (int i = 0; i < 36; ++i) init[i] = static_cast<float>(i);
  ASSERT_TRUE(s.LoadValues({{"w", init.data()}}).ok());
  auto code = [&](const std::vector<Session::ColumnMove>& moves) {
    return s.HandOverColumns(moves).status().code();
  };
  EXPECT_EQ(code({{"nope", {0}, {0}}}), Code::kNotFound);
  EXPECT_EQ(code({{"w", {9}, {0}}}), Code::kInvalidArgument);         // column out of range
  EXPECT_EQ(code({{"w", {1, 1}, {0, 0}}}), Code::kInvalidArgument);   // a column twice
  EXPECT_EQ(code({{"w", {1}, {}}}), Code::kInvalidArgument);          // no step for it
  EXPECT_EQ(code({{"w", {1}, {-1}}}), Code::kInvalidArgument);        // a negative step
  EXPECT_EQ(code({{"w", {0, 1, 2}, {0, 0, 0}}}), Code::kInvalidArgument);  // 4 x 4 x 3 > 36
  EXPECT_EQ(code({{"w", {1}, {0}}, {"w", {2}, {0}}}), Code::kInvalidArgument);  // w twice
  EXPECT_EQ(code({}), Code::kInvalidArgument);
  v1::MigrateColumnsRequest quiescent;
  *quiescent.mutable_session() = s.ref();
  quiescent.set_param("w");
  quiescent.add_columns(1);
  quiescent.add_steps(0);
  grpc::ClientContext ctx;
  v1::MigrateColumnsResponse resp;
  EXPECT_EQ(FromGrpc((*client)->stub()->MigrateColumns(&ctx, quiescent, &resp)).code(),
            Code::kInvalidArgument);

  // Columns 2 and 7 go out with their values (m, v zero after the load; nothing pushed: a zero
  // gradient block); the incoming blocks land at the next Update.
  float* staging = s.Staging();
  std::fill(staging, staging + 4 * 4 * 2, 5.0f);
  auto out = s.HandOverColumns({{"w", {2, 7}, {3, 4}}});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(std::vector<int64_t>(out->steps().begin(), out->steps().end()),
            (std::vector<int64_t>{0, 0}));
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(staging[r * 2 + 0], init[r * 9 + 2]) << r;
    EXPECT_EQ(staging[r * 2 + 1], init[r * 9 + 7]) << r;
    for (int a = 1; a < 4; ++a) EXPECT_EQ(staging[a * 8 + r * 2], 0.0f) << a << " " << r;
  }
  auto stats = (*client)->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->migrated_columns(), 4);
  EXPECT_EQ(s.handovers(), 1);
}

// With its count (handovers_before), a handover the session finished already is answered again
// from the work journal and nothing moves a second time (the client whose answer died with a
// daemon sends it again after re-attaching); a count that does not follow the session's, and a
// request that is not its last handover, are refused with the state unchanged.
TEST(Daemon, AHandoverSentAgainWithItsCountIsAnsweredAgainNotDoneTwice) {
  Daemon d;
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok()) << client.status();
  auto session = (*client)->OpenSession("again", 0);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  ASSERT_TRUE(s.RegisterParams({{"w", {4, 16}, v1::DTYPE_FP32}}).ok());
  EXPECT_EQ(s.handovers(), 0);
  std::vector<float> init(64);
  for (int i = 0; i < 64; ++i) init[i] = static_cast<float>(i);
  ASSERT_TRUE(s.LoadValues({{"w", init.data()}}).ok());
  float* staging = s.Staging();
  auto fill = [&](float x) { std::fill(staging, staging + 4 * 4 * 2, x); };
  auto column = [&](int block, int j) {  // block 0: values; j: the move's column
    std::vector<float> c;
    for (int r = 0; r < 4; ++r) c.push_back(staging[block * 8 + r * 2 + j]);
    return c;
  };
  auto steps = [](const absl::StatusOr<v1::MigrateColumnsResponse>& r) {
    return r.ok() ? std::vector<int64_t>(r->steps().begin(), r->steps().end())
                  : std::vector<int64_t>{-9};
  };
  auto migrated = [&] {
    auto st = (*client)->GetStats();
    return st.ok() ? st->migrated_columns() : -1;
  };
  fill(5.0f);
  auto first = s.HandOverColumns({{"w", {3, 11}, {7, 8}}}, 0);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(s.handovers(), 1);
  const std::vector<float> out3 = column(0, 0), out11 = column(0, 1);
  EXPECT_EQ(out3, (std::vector<float>{3, 19, 35, 51}));
  EXPECT_EQ(out11, (std::vector<float>{11, 27, 43, 59}));
  // Sent again with the same count: the same answer, the staging area untouched (a second
  // exchange would hand the incoming 5s back out), no column moved.
  auto again = s.HandOverColumns({{"w", {3, 11}, {7, 8}}}, 0);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(steps(again), steps(first));
  EXPECT_EQ(again->pushes(), first->pushes());
  EXPECT_EQ(column(0, 0), out3);
  EXPECT_EQ(column(0, 1), out11);
  EXPECT_EQ(migrated(), 4);
  EXPECT_EQ(s.handovers(), 1);
  // Another handover under the last one's count, a count ahead or behind: refused.
  EXPECT_EQ(s.HandOverColumns({{"w", {3, 12}, {7, 8}}}, 0).status().code(),
            Code::kFailedPrecondition);
  EXPECT_EQ(s.HandOverColumns({{"w", {3, 11}, {7, 9}}}, 0).status().code(),
            Code::kFailedPrecondition);
  EXPECT_EQ(s.HandOverColumns({{"w", {4}, {1}}}, 2).status().code(), Code::kFailedPrecondition);
  EXPECT_EQ(s.HandOverColumns({{"w", {4}, {1}}}, -1).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(migrated(), 4);
  EXPECT_EQ(column(0, 0), out3);
  // The next one, with its count: done. Column 3 goes out again with the state that came in
  // (5s, step 7).
  fill(6.0f);
  auto second = s.HandOverColumns({{"w", {3}, {2}}}, 1);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(steps(second), (std::vector<int64_t>{7}));
  EXPECT_EQ(staging[0], 5.0f);
  EXPECT_EQ(migrated(), 6);
  EXPECT_EQ(s.handovers(), 2);
}

}  // namespace
}  // namespace stallfree
