// A daemon killed between a session's calls loses nothing: the session's process holds the
// region's and the state's memfds, and a daemon started on the same socket takes the session
// back (Session::Reattach, the fd socket's ADOPT) from the record at the start of the state
// (server/session_record.h). The run goes on bit for bit, with no step recomputed; and only the
// session's own process, with its token and its current generation, can take it back.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <thread>

#include "client/client.h"
#include "client/session_target.h"
#include "common/status.h"
#include "common/unix_socket.h"
#include "kernels/optimizer.h"
#include "server/requests.h"
#include "server/session_journal.h"
#include "server/session_record.h"
#include "testing/daemon_process.h"
#include "testing/fake_service_manager.h"
#include "testing/hyper.h"
#include "tests/server/adamw_config.h"

namespace stallfree {
namespace {

using Code = absl::StatusCode;
using testing::Daemon;

kernels::AdamWConfig Config(const v1::AdamWHyper& h, int64_t step) {
  return testing::ConfigOf(h, step);
}

constexpr int64_t kRows = 64, kCols = 40, kN = kRows * kCols;

// A session of one [64, 40] fp32 parameter with one fp32 parameter slot, loaded with `w`.
struct Opened {
  std::unique_ptr<Client> client;
  std::unique_ptr<Session> session;
};
Opened Open(const std::string& socket, const std::vector<float>& w) {
  Opened r;
  auto client = Client::Connect(socket, 3000, 20);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return r;
  r.client = *std::move(client);
  auto session = r.client->OpenSession("adoptee", 3);
  EXPECT_TRUE(session.ok()) << session.status();
  if (!session.ok()) return r;
  r.session = *std::move(session);
  EXPECT_TRUE(
      r.session->RegisterParams({{"w", {kRows, kCols}, v1::DTYPE_FP32}}, v1::DTYPE_FP32, 1).ok());
  EXPECT_TRUE(r.session->LoadValues({{"w", w.data()}}).ok());
  return r;
}

absl::Status Push(Session& s, const std::vector<float>& g, int64_t step) {
  memcpy(s.GradSlot(0, "w"), g.data(), kN * 4);
  return s.Push(step, 0).status();
}

absl::Status Update(Session& s, const v1::AdamWHyper& h, int64_t step) {
  v1::UpdateRequest req;
  req.set_step(step);
  *req.mutable_hyper() = h;
  RETURN_IF_ERROR(s.Update(req));
  return s.WaitUpdate(step).status();
}

// The registration of a session of one fp32 [rows, cols] parameter "w" with one fp32 parameter
// slot.
v1::RegisterParamsRequest Registration(int64_t rows, int64_t cols) {
  v1::RegisterParamsRequest reg;
  reg.set_param_dtype(v1::DTYPE_FP32);
  reg.set_param_slots(1);
  v1::ParamSpec* p = reg.add_params();
  p->set_name("w");
  p->add_shape(rows);
  p->add_shape(cols);
  p->set_grad_dtype(v1::DTYPE_FP32);
  return reg;
}

// Where such a session keeps its state in its memfd: the daemon's own layout rules
// (requests.h).
SessionLayout StateLayout(int64_t rows, int64_t cols) {
  absl::StatusOr<SessionLayout> layout = LayOutParams(Registration(rows, cols));
  EXPECT_TRUE(layout.ok()) << layout.status();
  return layout.ok() ? *std::move(layout) : SessionLayout();
}

// The state's master, m and v as the session's held memfd has them.
struct Arrays {
  std::vector<float> master, m, v;
};
Arrays ReadState(int fd, int64_t rows = kRows, int64_t cols = kCols) {
  const SessionLayout layout = StateLayout(rows, cols);
  const int64_t n = rows * cols;
  struct stat st;
  EXPECT_EQ(fstat(fd, &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), layout.state_bytes);
  void* p = mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
  EXPECT_NE(p, MAP_FAILED) << strerror(errno);
  const uint64_t stride = layout.state_stride;
  const float* a =
      reinterpret_cast<const float*>(static_cast<const uint8_t*>(p) + layout.arrays_offset);
  Arrays out{{a, a + n}, {a + stride, a + stride + n}, {a + 2 * stride, a + 2 * stride + n}};
  munmap(p, st.st_size);
  return out;
}

// The accumulator as the held memfd has it.
std::vector<float> ReadAccumulator(int fd, int64_t rows, int64_t cols) {
  const SessionLayout layout = StateLayout(rows, cols);
  void* p = mmap(nullptr, layout.state_bytes, PROT_READ, MAP_SHARED, fd, 0);
  EXPECT_NE(p, MAP_FAILED) << strerror(errno);
  if (p == MAP_FAILED) return {};
  const float* acc = reinterpret_cast<const float*>(static_cast<const uint8_t*>(p) +
                                                    layout.arrays_offset) +
                     3 * layout.state_stride;
  std::vector<float> out(acc, acc + rows * cols);
  munmap(p, layout.state_bytes);
  return out;
}

// A raw ADOPT on the daemon's fd socket with these descriptors: the daemon's answer line.
std::string RawAdopt(const std::string& fd_socket, const std::string& line,
                     const std::vector<int>& fds) {
  absl::StatusOr<int> conn = ConnectUnix(fd_socket);
  if (!conn.ok()) return conn.status().ToString();
  std::string reply;
  std::vector<int> got;
  absl::Status st = SendWithFds(*conn, line, fds);
  if (st.ok()) st = RecvWithFds(*conn, 512, &reply, &got, 0);
  close(*conn);
  return st.ok() ? reply : st.ToString();
}

std::string FdSocket(Client& c) {
  auto stats = c.GetStats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  return stats.ok() ? stats->fd_socket() : "";
}

// SIGKILL of the daemon in the middle of a round (one push after the Update of step 1), a new
// daemon on the same socket, Reattach: the session's version, step and pushes are where they
// were, and the rest of the run equals AdamW's run locally bit for bit (no step recomputed, no
// push repeated). The same again after a second kill (generation 3).
// A session's state as the test reads it through the memfd its process holds (read only):
// its record and its work journal.
struct StateView {
  StateView(int fd, int64_t rows, int64_t cols)
      : layout(StateLayout(rows, cols)),
        p(static_cast<uint8_t*>(
            mmap(nullptr, layout.state_bytes, PROT_READ, MAP_SHARED, fd, 0))),
        record(ok() ? p : nullptr, layout.arrays_offset),
        journal(ok() ? p + layout.journal_offset : nullptr, layout.journal) {
    EXPECT_TRUE(ok()) << strerror(errno);
  }
  ~StateView() {
    if (ok()) munmap(p, layout.state_bytes);
  }
  bool ok() const { return p != MAP_FAILED; }
  const SessionLayout layout;
  uint8_t* const p;
  const SessionRecord record;
  const WorkJournal journal;
};

// What the journaled kill tests run: weights of n elements, six gradients (two a round for
// three rounds) and AdamW's settings, from `seed`.
struct Rounds {
  std::vector<float> w;
  std::vector<std::vector<float>> grads;
  OffloadTarget::AdamW hyper;
};
Rounds MakeRounds(int64_t n, uint32_t seed) {
  Rounds r;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  r.w.resize(n);
  for (float& x : r.w) x = normal(rng);
  r.grads.assign(6, std::vector<float>(n));
  for (auto& g : r.grads)
    for (float& x : g) x = normal(rng);
  r.hyper.lr = 0.01;
  r.hyper.weight_decay = 0.01;
  return r;
}

// A session named `name` on the daemon at `socket`, registered as one fp32 weight of
// rows x cols and loaded with w, behind a SessionTarget that re-attaches for up to 60 s (null on
// failure, which the test is told).
struct Target {
  std::unique_ptr<Client> client;
  std::unique_ptr<SessionTarget> target;
};
Target OpenTarget(const std::string& socket, const std::string& name, int64_t rows,
                  int64_t cols, const std::vector<float>& w) {
  Target t;
  auto client = Client::Connect(socket, 3000, 60);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return t;
  t.client = *std::move(client);
  auto session = t.client->OpenSession(name, 0);
  EXPECT_TRUE(session.ok()) << session.status();
  if (!session.ok()) return t;
  t.target = std::make_unique<SessionTarget>(std::move(*session), 60);
  Session& s = *t.target->session();
  EXPECT_TRUE(s.RegisterParams({{"w", {rows, cols}, v1::DTYPE_FP32}}, v1::DTYPE_FP32, 1).ok());
  EXPECT_TRUE(s.LoadValues({{"w", w.data()}}).ok());
  return t;
}

TEST(Adopt, ARestartedDaemonTakesTheSessionBackAndTheRunGoesOnBitForBit) {
  Daemon d;
  ASSERT_TRUE(d.started()) << d.error();
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> w(kN);
  for (float& x : w) x = normal(rng);
  Opened r = Open(d.socket(), w);
  ASSERT_NE(r.session, nullptr);
  Session& s = *r.session;
  EXPECT_EQ(s.generation(), 1u);
  const v1::AdamWHyper h = testing::TestHyper(0.05);
  std::vector<float> m(kN, 0.0f), v(kN, 0.0f);
  const kernels::OptimizerKernel& ref = kernels::ReferenceKernel();
  auto grad = [&] {
    std::vector<float> g(kN);
    for (float& x : g) x = normal(rng);
    return g;
  };
  for (int64_t step = 1; step <= 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // Two pushes a round; the daemon dies after the first push of rounds 2 and 4.
    std::vector<float> g1 = grad(), g2 = grad(), sum(kN);
    for (int64_t i = 0; i < kN; ++i) sum[i] = g1[i] + g2[i];
    ASSERT_TRUE(Push(s, g1, step).ok());
    if (step == 2 || step == 4) {
      const uint64_t old_id = s.ref().session_id();
      d.Kill();
      d.Restart();
      // The old session is gone with its daemon: the next call says so.
      absl::Status lost = Push(s, g2, step);
      ASSERT_EQ(lost.code(), Code::kUnavailable) << lost;
      absl::StatusOr<Session::Adopted> back = s.Reattach(30);
      ASSERT_TRUE(back.ok()) << back.status() << "\n" << d.Log();
      EXPECT_EQ(back->version, step - 1);
      EXPECT_EQ(back->last_step, step - 1);
      EXPECT_EQ(back->pushes_since_update, 1) << "the failed push did not happen";
      EXPECT_EQ(s.generation(), step == 2 ? 2u : 3u);
      EXPECT_NE(s.ref().session_id(), 0u);
      (void)old_id;
      auto listed = r.client->ListSessions();
      ASSERT_TRUE(listed.ok()) << listed.status();
      ASSERT_EQ(listed->size(), 1u);
      EXPECT_EQ((*listed)[0].session_id(), s.ref().session_id());
      EXPECT_EQ((*listed)[0].name(), "adoptee");
      EXPECT_EQ((*listed)[0].rank(), 3);
      EXPECT_EQ((*listed)[0].version(), step - 1);
    }
    ASSERT_TRUE(Push(s, g2, step).ok());
    ASSERT_TRUE(Update(s, h, step).ok());
    ref.AdamW(Config(h, step), w.data(), m.data(), v.data(), sum.data(), kernels::GradType::kFp32,
              kN, nullptr);
    const float* out = s.ParamsFp32(0, "w");
    for (int64_t i = 0; i < kN; ++i) ASSERT_EQ(out[i], w[i]) << "parameter slot [" << i << "]";
  }
  const Arrays a = ReadState(s.state_fd());
  EXPECT_EQ(a.master, w);
  EXPECT_EQ(a.m, m);
  EXPECT_EQ(a.v, v);
  EXPECT_TRUE(s.Close().ok());
}

// Only the session's process, with the token and the current generation, takes the session
// back; each refusal leaves the state as it was, and the rightful Reattach still works after
// them: a forged token, a stale generation, another uid (when the test runs as root), a record
// with a bad checksum, and a record whose newest commit says an Update was running that has no
// work journal entry (torn).
TEST(Adopt, TakingASessionBackIsRefusedToAnyoneButItsOwnerAndToATornState) {
  Daemon d;
  ASSERT_TRUE(d.started()) << d.error();
  std::vector<float> w(kN, 0.5f), g(kN, 0.25f);
  Opened r = Open(d.socket(), w);
  ASSERT_NE(r.session, nullptr);
  Session& s = *r.session;
  const v1::AdamWHyper h = testing::TestHyper(0.05);
  ASSERT_TRUE(Push(s, g, 1).ok());
  ASSERT_TRUE(Update(s, h, 1).ok());
  const Arrays before = ReadState(s.state_fd());
  const std::string fd_socket = FdSocket(*r.client);
  ASSERT_FALSE(fd_socket.empty());
  d.Kill();
  d.Restart();
  const std::vector<int> fds = {s.region_fd(), s.state_fd()};
  const std::string token = s.ref().token();
  auto refused = [&](const std::string& line, const std::string& code, const std::string& says) {
    SCOPED_TRACE(line);
    const std::string reply = RawAdopt(fd_socket, line, fds);
    EXPECT_EQ(reply.rfind("ERR " + code, 0), 0u) << reply;
    EXPECT_NE(reply.find(says), std::string::npos) << reply;
  };
  refused("ADOPT forged-token 1\n", "PERMISSION_DENIED", "wrong token");
  refused("ADOPT " + token + " 0\n", "FAILED_PRECONDITION", "generation 0 is stale");
  {  // the right line without the descriptors: malformed
    const std::string reply = RawAdopt(fd_socket, "ADOPT " + token + " 1\n", {});
    EXPECT_EQ(reply.rfind("ERR INVALID_ARGUMENT", 0), 0u) << reply;
  }
  if (geteuid() == 0) {  // another uid, with the very descriptors and token
    const pid_t child = fork();
    if (child == 0) {
      if (setuid(65534) != 0) _exit(2);
      const std::string reply = RawAdopt(fd_socket, "ADOPT " + token + " 1\n", fds);
      _exit(reply.rfind("ERR PERMISSION_DENIED", 0) == 0 &&
                    reply.find("belongs to uid") != std::string::npos
                ? 0
                : 1);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "uid 65534 was not refused: exit " << status;
  }
  // The record, edited through the held descriptor: a flipped identity byte, then a commit that
  // says an Update of step 2 was running.
  struct stat st;
  ASSERT_EQ(fstat(s.state_fd(), &st), 0);
  uint8_t* p = static_cast<uint8_t*>(
      mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, s.state_fd(), 0));
  ASSERT_NE(p, MAP_FAILED) << strerror(errno);
  p[40] ^= 1;  // in the token digest
  refused("ADOPT " + token + " 1\n", "DATA_LOSS", "checksum");
  p[40] ^= 1;
  SessionRecord record(p, StateLayout(kRows, kCols).arrays_offset);
  absl::StatusOr<SessionCommit> newest = record.NewestCommit();
  ASSERT_TRUE(newest.ok()) << newest.status();
  EXPECT_EQ(newest->version, 1);
  EXPECT_EQ(newest->busy, RecordBusy::kNone);
  SessionCommit torn = *newest;
  torn.busy = RecordBusy::kUpdate;
  torn.busy_step = 2;
  torn.journaled = false;  // an Update without its work journal entry: not finishable
  ASSERT_TRUE(record.Commit(torn).ok());
  refused("ADOPT " + token + " 1\n", "FAILED_PRECONDITION",
          "in the middle of an Update of step 2");
  ASSERT_TRUE(record.Commit(*newest).ok());  // whole again, as the daemon left it
  munmap(p, st.st_size);

  const Arrays after = ReadState(s.state_fd());
  EXPECT_EQ(after.master, before.master);
  EXPECT_EQ(after.m, before.m);
  EXPECT_EQ(after.v, before.v);
  absl::StatusOr<Session::Adopted> back = s.Reattach(30);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << d.Log();
  EXPECT_EQ(back->version, 1);
  // The generation it had is stale now: a second ADOPT with it is refused.
  refused("ADOPT " + token + " 1\n", "FAILED_PRECONDITION", "generation 1 is stale");
  absl::Status pushed = Push(s, g, 2);
  ASSERT_TRUE(pushed.ok()) << pushed << "\n" << d.Log();
  absl::Status updated = Update(s, h, 2);
  EXPECT_TRUE(updated.ok()) << updated;
}

// An adoption whose answer never arrived (the daemon that adopted the session died first) is
// retried by the same process with the generation before and the same nonce, and let in; the
// generation before with another nonce is stale, as ever.
TEST(Adopt, AnAdoptionWhoseAnswerWasLostIsLetInAgainByItsNonceAlone) {
  Daemon d;
  ASSERT_TRUE(d.started()) << d.error();
  std::vector<float> w(kN, 0.5f);
  Opened r = Open(d.socket(), w);
  ASSERT_NE(r.session, nullptr);
  Session& s = *r.session;
  const std::string fd_socket = FdSocket(*r.client);
  const std::vector<int> fds = {s.region_fd(), s.state_fd()};
  const std::string token = s.ref().token();
  d.Kill();
  d.Restart();
  // Adopted, and the daemon dies with the answer's connection still open (not a client's exit).
  absl::StatusOr<int> conn = ConnectUnix(fd_socket);
  ASSERT_TRUE(conn.ok()) << conn.status();
  std::string reply;
  std::vector<int> got;
  ASSERT_TRUE(SendWithFds(*conn, "ADOPT " + token + " 1 777\n", fds).ok());
  ASSERT_TRUE(RecvWithFds(*conn, 512, &reply, &got, 0).ok());
  EXPECT_EQ(reply.rfind("OK ", 0), 0u) << reply;
  d.Kill();
  close(*conn);
  d.Restart();
  std::string again = RawAdopt(fd_socket, "ADOPT " + token + " 1 778\n", fds);
  EXPECT_EQ(again.rfind("ERR FAILED_PRECONDITION generation 1 is stale", 0), 0u) << again;
  again = RawAdopt(fd_socket, "ADOPT " + token + " 1\n", fds);
  EXPECT_EQ(again.rfind("ERR FAILED_PRECONDITION generation 1 is stale", 0), 0u) << again;
  // Adopted again, and that answer lost too: the record is two generations ahead.
  conn = ConnectUnix(fd_socket);
  ASSERT_TRUE(conn.ok()) << conn.status();
  ASSERT_TRUE(SendWithFds(*conn, "ADOPT " + token + " 1 777\n", fds).ok());
  ASSERT_TRUE(RecvWithFds(*conn, 512, &reply, &got, 0).ok());
  EXPECT_EQ(reply.rfind("OK ", 0), 0u) << reply;
  d.Kill();
  close(*conn);
  d.Restart();
  again = RawAdopt(fd_socket, "ADOPT " + token + " 1 777\n", fds);
  EXPECT_EQ(again.rfind("OK ", 0), 0u) << again;
  std::istringstream in(again.substr(3));
  uint64_t id = 0, generation = 0;
  in >> id >> generation;
  EXPECT_EQ(generation, 4u);
}

// An Update the daemon accepted and had not run when it died (queued behind a long checkpoint)
// is sent again by the SessionTarget once the session is taken back, its round's push intact;
// the checkpoint that the kill broke, on another thread, is sent again too. The parameters then
// equal those of the same calls on a daemon never killed, bit for bit.
TEST(Adopt, AnUpdateAcceptedAndNeverRunIsSentAgainAfterTheReattach) {
  const int64_t rows = 2048, cols = 4096, n = rows * cols;  // 128 MiB of state: a slow checkpoint
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  std::vector<float> w(n), g1(n), g2(n);
  for (auto* v : {&w, &g1, &g2})
    for (float& x : *v) x = normal(rng);
  OffloadTarget::AdamW hyper;
  hyper.lr = 0.01;
  hyper.weight_decay = 0.01;
  // The same calls, once on a daemon killed between the Update's acceptance and its run, once
  // on one never killed.
  auto run = [&](bool kill, int64_t* resent) -> std::vector<float> {
    Daemon d({"--threads", "1"});
    EXPECT_TRUE(d.started()) << d.error();
    auto client = Client::Connect(d.socket(), 3000, 60);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return {};
    auto session = (*client)->OpenSession("queued", 0);
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return {};
    SessionTarget t(std::move(*session), 60);
    Session& s = *t.session();
    EXPECT_TRUE(s.RegisterParams({{"w", {rows, cols}, v1::DTYPE_FP32}}, v1::DTYPE_FP32, 1).ok());
    EXPECT_TRUE(s.LoadValues({{"w", w.data()}}).ok());
    memcpy(s.GradSlot(0, "w"), g1.data(), n * 4);
    EXPECT_TRUE(t.Push(1, 0, 1.0f).ok());
    std::thread checkpoint([&] {
      absl::Status st = t.Checkpoint("slow");
      EXPECT_TRUE(st.ok()) << st;
    });
    // Until the checkpoint's file is being written (the daemon's strand is in it).
    auto writing = [&] {
      std::error_code ec;
      for (const auto& e : std::filesystem::recursive_directory_iterator(d.dir() + "/state", ec))
        if (e.is_regular_file()) return true;
      return false;
    };
    for (int i = 0; i < 1000 && !writing(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    memcpy(s.GradSlot(1, "w"), g2.data(), n * 4);
    EXPECT_TRUE(t.UpdateWithPush(1, hyper, 0, DType::kFp32, 1, 0.5f, {}).ok());
    if (kill) {
      d.Kill();
      d.Restart();
    }
    absl::Status waited = t.WaitUpdate(1);
    EXPECT_TRUE(waited.ok()) << waited << "\n" << d.Log();
    checkpoint.join();
    *resent = t.resent_updates();
    const float* out = s.ParamsFp32(0, "w");
    return out == nullptr ? std::vector<float>() : std::vector<float>(out, out + n);
  };
  int64_t resent = 0, none = 0;
  const std::vector<float> got = run(true, &resent);
  const std::vector<float> want = run(false, &none);
  ASSERT_EQ(got.size(), static_cast<size_t>(n));
  EXPECT_EQ(resent, 1) << "the Update ran before the kill: the checkpoint was too fast";
  EXPECT_EQ(none, 0);
  EXPECT_TRUE(got == want) << "the parameters differ from the uninterrupted calls'";
}

// A daemon SIGKILLed at any instant of a push, an Update or a handover's exchange, after a
// handover and before its answer, or between a handover and the Update that lands its columns,
// loses nothing: the daemon that takes the session back finishes the operation from its work
// journal (server/session_journal.h), answers the handover sent again from it without a second
// exchange, and lands the handed-over columns from the arrays, where they wait marked; the run
// equals the same calls on a daemon never killed, bit for bit (the handed-back columns and their
// step counts too), with no Update sent again and no step recomputed. The kills are aimed
// through the held descriptor: a watcher thread reads the record's newest commit and the
// journal's done units, and kills once the running operation's units reach a chosen share (1
// worker thread, 4096 units of 1024 elements, each slowed by 20 us through the daemon's testing
// flag --test_unit_delay_us; a handover's 32 pieces by 2 ms, --test_piece_delay_us; its answer
// held 20 ms, --test_answer_delay_us); it then starts a daemon on the same socket, and the SessionTarget's call that the kill broke
// re-attaches and returns as if nothing happened. Each kill must land inside its operation:
// some units done, not all.
TEST(Adopt, ADaemonKilledInsideAPushOrAnUpdateIsFinishedByTheNextBitForBit) {
  const int64_t rows = 1024, cols = 4096, n = rows * cols;
  const Rounds data = MakeRounds(n, 11);
  const std::vector<float>& w = data.w;
  const std::vector<std::vector<float>>& grads = data.grads;
  const OffloadTarget::AdamW& hyper = data.hyper;
  struct Kill {
    RecordBusy what;  // kNone: after the round's handover, before its Update
    int64_t step;  // the Update's step, or the step of the round the push or handover belongs to
    double share;  // of the units (a handover's pieces) done when the kill is sent
    bool unanswered = false;  // kHandover: after its exchange, before its answer arrived
  };
  // Rounds 2 and 3 each hand 32 columns over (32 journal pieces of 1024 cells).
  const int64_t moved = 32;
  auto moves = [&](int64_t step) {
    OffloadTarget::ColumnMove m{"w", {}, {}};
    for (int64_t j = 0; j < moved; ++j) {
      m.columns.push_back(step * 7 + j * 113);  // distinct, below cols
      m.steps.push_back(step + j % 3);
    }
    return std::vector<OffloadTarget::ColumnMove>{m};
  };
  struct Outcome {
    std::vector<float> slot, outgoing;
    std::vector<std::vector<int64_t>> outgoing_steps;
    // Per handover, the daemon's handovers_resumed and handovers_answered_again after it.
    std::vector<std::pair<int64_t, int64_t>> handover_stats;
    std::vector<std::vector<float>> after_push, after_update;  // the accumulator, the slot
    Arrays state;
    int landed = 0;
    int64_t reattached = 0, resent = 0;
  };
  auto run = [&](const std::vector<Kill>& kills) {
    Outcome o;
    // Units slowed (testing only) where kills are aimed, so that each lands inside its operation.
    std::vector<std::string> flags = {"--threads", "1"};
    if (!kills.empty())
      flags.insert(flags.end(), {"--test_unit_delay_us", "20", "--test_piece_delay_us", "2000",
                                 "--test_answer_delay_us", "20000"});
    Daemon d(flags);
    EXPECT_TRUE(d.started()) << d.error();
    Target opened = OpenTarget(d.socket(), "journaled", rows, cols, w);
    if (opened.target == nullptr) return o;
    SessionTarget& t = *opened.target;
    Session& s = *t.session();
    const StateView view(s.state_fd(), rows, cols);
    if (!view.ok()) return o;
    const SessionLayout& layout = view.layout;
    const SessionRecord& record = view.record;
    const WorkJournal& journal = view.journal;
    std::atomic<bool> stop{false};
    // The step of the round whose handover's answer has arrived last.
    std::atomic<int64_t> answered{0};
    const uint64_t pieces = (rows * moved + layout.journal.unit - 1) / layout.journal.unit;
    std::thread watcher([&] {
      for (const Kill& k : kills) {
        const uint64_t all = k.what == RecordBusy::kHandover ? pieces : layout.journal.units;
        const uint64_t target = static_cast<uint64_t>(k.share * all);
        auto running = [&] {
          absl::StatusOr<SessionCommit> c = record.NewestCommit();
          if (!c.ok()) return false;
          if (k.unanswered)  // the round's handover counted, its answer not arrived
            return c->busy == RecordBusy::kNone && c->handovers == k.step - 1 &&
                   answered.load() < k.step;
          if (c->busy != k.what) return false;
          if (k.what == RecordBusy::kUpdate) return c->busy_step == k.step;
          if (k.what == RecordBusy::kPush || k.what == RecordBusy::kHandover)
            return c->version == k.step - 1;
          // Handed-over columns are marked with negative step counts until the Update lands them.
          bool marked = false;
          for (int64_t t : c->col_steps[0]) marked = marked || t < 0;
          return marked && c->version == k.step - 1 && answered.load() == k.step;
        };
        while (!stop.load() && !(running() && journal.done_units() >= target)) {
        }
        if (stop.load()) {
          ADD_FAILURE() << "the kill at " << RecordBusyName(k.what) << " of step " << k.step
                        << " never came: the operation was over before the watcher saw it";
          return;
        }
        d.Kill();
        const uint64_t done = journal.done_units();
        if (k.what == RecordBusy::kNone || k.unanswered ? running()
                                                        : running() && done > 0 && done < all)
          ++o.landed;
        d.Restart();
      }
    });
    for (int64_t step = 1; step <= 3; ++step) {
      memcpy(s.GradSlot(0, "w"), grads[2 * step - 2].data(), n * 4);
      absl::Status pushed = t.Push(step, 0, 1.0f);
      EXPECT_TRUE(pushed.ok()) << pushed << "\n" << d.Log();
      o.after_push.push_back(ReadAccumulator(s.state_fd(), rows, cols));
      if (step >= 2) {
        // Columns handed over to the daemon (their state as a device would send it), and the
        // daemon's handed back; then a pause in which a kill finds them not landed yet.
        float* staging = s.Staging();
        for (int64_t i = 0; i < 4 * rows * moved; ++i)
          staging[i] = 0.001f * static_cast<float>((i + step) % 997);
        absl::StatusOr<OffloadTarget::HandOver> got = t.HandOverColumns(moves(step));
        EXPECT_TRUE(got.ok()) << got.status() << "\n" << d.Log();
        if (got.ok()) {
          o.outgoing.insert(o.outgoing.end(), staging, staging + 4 * rows * moved);
          o.outgoing_steps.push_back(got->steps[0]);
          o.outgoing_steps.push_back({got->pushes});
        }
        // The daemon that answered (the watcher's next kill waits for `answered`).
        auto c = Client::Connect(d.socket(), 3000);
        absl::StatusOr<v1::Stats> st = c.ok() ? (*c)->GetStats() : c.status();
        EXPECT_TRUE(st.ok()) << st.status();
        if (st.ok())
          o.handover_stats.push_back({st->handovers_resumed(), st->handovers_answered_again()});
        answered.store(step);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      memcpy(s.GradSlot(1, "w"), grads[2 * step - 1].data(), n * 4);
      absl::Status sent = t.UpdateWithPush(step, hyper, 0, DType::kFp32, 1, 0.5f, {});
      EXPECT_TRUE(sent.ok()) << sent << "\n" << d.Log();
      absl::Status waited = t.WaitUpdate(step);
      EXPECT_TRUE(waited.ok()) << waited << "\n" << d.Log();
      const float* now = s.ParamsFp32(0, "w");
      o.after_update.emplace_back(now, now + n);
    }
    stop.store(true);
    watcher.join();
    const float* out = s.ParamsFp32(0, "w");
    if (out != nullptr) o.slot.assign(out, out + n);
    o.state = ReadState(s.state_fd(), rows, cols);
    o.reattached = t.reattached();
    o.resent = t.resent_updates();
    return o;
  };
  const std::vector<Kill> kills = {{RecordBusy::kPush, 1, 0.5},
                                   {RecordBusy::kUpdate, 1, 0.3},
                                   {RecordBusy::kHandover, 2, 0.25},
                                   {RecordBusy::kNone, 2, 0},
                                   {RecordBusy::kUpdate, 2, 0.8},
                                   {RecordBusy::kPush, 3, 0.1},
                                   {RecordBusy::kHandover, 3, 0, /*unanswered=*/true},
                                   {RecordBusy::kUpdate, 3, 0.05}};
  const Outcome got = run(kills);
  const Outcome want = run({});
  EXPECT_EQ(got.landed, static_cast<int>(kills.size())) << "kills that landed inside";
  EXPECT_EQ(got.reattached, static_cast<int64_t>(kills.size()));
  EXPECT_EQ(got.resent, 0) << "an Update was sent again: the daemon did not finish it";
  ASSERT_EQ(got.slot.size(), static_cast<size_t>(n));
  for (size_t i = 0; i < want.after_push.size() && i < got.after_push.size(); ++i) {
    EXPECT_TRUE(got.after_push[i] == want.after_push[i]) << "the accumulator after push " << i + 1;
    EXPECT_TRUE(got.after_update[i] == want.after_update[i]) << "the slot after Update " << i + 1;
  }
  EXPECT_TRUE(got.slot == want.slot) << "the parameters differ from the uninterrupted run's";
  EXPECT_TRUE(got.outgoing == want.outgoing) << "the handed-back columns differ";
  EXPECT_EQ(got.outgoing.size(), static_cast<size_t>(2 * 4 * rows * moved));
  EXPECT_EQ(got.outgoing_steps, want.outgoing_steps) << "the handed-back step counts differ";
  // The kill inside round 2's exchange: finished by the next daemon, then answered again; the
  // kill before round 3's answer: answered again, nothing exchanged twice.
  using Stats = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(got.handover_stats, (Stats{{1, 1}, {0, 1}}));
  EXPECT_EQ(want.handover_stats, (Stats{{0, 0}, {0, 0}}));
  EXPECT_TRUE(got.state.master == want.state.master);
  EXPECT_TRUE(got.state.m == want.state.m);
  EXPECT_TRUE(got.state.v == want.state.v);
}

// Under systemd (a fake service manager here), the daemon keeps each attached session's memfds
// in the service manager's fd store. A daemon started again after a kill inside an Update gets
// them at start and finishes that Update before the session's process re-attaches (which then
// finds the step done: nothing is sent again, and the store is not given a second copy); a
// state whose process does not re-attach within --fd_store_hold_s is dropped from the store (the
// process still holds it, re-attaches later, and the store gets it again); a close drops it for
// good. The run equals one without systemd or kills, bit for bit.
TEST(Adopt, UnderSystemdTheFdStoreHandsTheStateToTheNextDaemonAtStart) {
  const int64_t rows = 256, cols = 4096, n = rows * cols;
  const Rounds data = MakeRounds(n, 12);
  auto run = [&](bool systemd) {
    std::vector<float> slot;
    char tmpl[] = "/tmp/stallfree-sm-XXXXXX";
    const std::string dir = mkdtemp(tmpl);
    testing::FakeServiceManager sm(dir + "/notify");
    EXPECT_TRUE(sm.bound());
    std::vector<std::string> flags = {"--threads", "1", "--fd_store_hold_s", "2"};
    if (systemd) flags.insert(flags.end(), {"--test_unit_delay_us", "20"});
    Daemon d(flags, "debug", systemd ? std::vector<std::string>{sm.Env()}
                                     : std::vector<std::string>{});
    EXPECT_TRUE(d.started()) << d.error();
    Target opened = OpenTarget(d.socket(), "stored", rows, cols, data.w);
    if (opened.target == nullptr) return slot;
    SessionTarget& t = *opened.target;
    Session& s = *t.session();
    struct stat st;
    EXPECT_EQ(fstat(s.state_fd(), &st), 0);
    const std::string state = "stallfree-" + std::to_string(st.st_ino) + "-state";
    const std::string region = "stallfree-" + std::to_string(st.st_ino) + "-region";
    if (systemd)
      EXPECT_TRUE(testing::FakeServiceManager::WaitFor(
          [&] { return sm.stored(state) == 1 && sm.stored(region) == 1; }, 5))
          << "the attached session's memfds never reached the store\n" << d.Log();
    const StateView view(s.state_fd(), rows, cols);
    if (!view.ok()) return slot;
    const SessionLayout& layout = view.layout;
    const SessionRecord& record = view.record;
    const WorkJournal& journal = view.journal;
    std::thread killer;
    for (int64_t step = 1; step <= 3; ++step) {
      if (systemd && step == 3) {
        // Killed between calls and started again with the store's descriptors; the process
        // stays away past the hold: the store lets them go.
        d.Kill();
        d.Restart(sm.Stored());
        auto held_states = [&] {  // -1 while the new daemon does not answer yet
          auto c = Client::Connect(d.socket(), 3000);
          if (!c.ok()) return int64_t{-1};
          auto st = (*c)->GetStats();
          return st.ok() ? st->held_states() : int64_t{-1};
        };
        EXPECT_TRUE(testing::FakeServiceManager::WaitFor([&] { return held_states() == 1; }, 1.5))
            << "GetStats did not count the held state\n" << d.Log();
        EXPECT_TRUE(testing::FakeServiceManager::WaitFor(
            [&] { return sm.removed(state) == 1 && sm.removed(region) == 1; }, 10))
            << "a held state outlived --fd_store_hold_s\n" << d.Log();
        EXPECT_EQ(held_states(), 0);
      }
      memcpy(s.GradSlot(0, "w"), data.grads[2 * step - 2].data(), n * 4);
      absl::Status pushed = t.Push(step, 0, 1.0f);
      EXPECT_TRUE(pushed.ok()) << pushed << "\n" << d.Log();
      if (systemd && step == 2) {
        killer = std::thread([&] {
          auto inside = [&] {
            absl::StatusOr<SessionCommit> c = record.NewestCommit();
            return c.ok() && c->busy == RecordBusy::kUpdate && c->busy_step == 2 &&
                   journal.done_units() >= layout.journal.units / 3;
          };
          const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
          while (!inside() && std::chrono::steady_clock::now() < end) {
          }
          d.Kill();
          const uint64_t done = journal.done_units();
          EXPECT_TRUE(inside() && done < layout.journal.units) << "the kill missed the Update";
          d.Restart(sm.Stored());
        });
      }
      memcpy(s.GradSlot(1, "w"), data.grads[2 * step - 1].data(), n * 4);
      absl::Status sent = t.UpdateWithPush(step, data.hyper, 0, DType::kFp32, 1, 0.5f, {});
      EXPECT_TRUE(sent.ok()) << sent << "\n" << d.Log();
      absl::Status waited = t.WaitUpdate(step);
      EXPECT_TRUE(waited.ok()) << waited << "\n" << d.Log();
      if (killer.joinable()) killer.join();
    }
    const float* out = s.ParamsFp32(0, "w");
    if (out != nullptr) slot.assign(out, out + n);
    if (systemd) {
      const std::string log = d.Log();
      EXPECT_NE(log.find("from the service manager's fd store: version 2"), std::string::npos)
          << "the next daemon did not finish the Update at start\n" << log;
      EXPECT_EQ(t.resent_updates(), 0) << "an Update was sent again";
      EXPECT_EQ(t.reattached(), 2);
      // Once at the attach, once after the held copy was dropped; never for the held state.
      EXPECT_EQ(sm.stored(state), 2);
      EXPECT_TRUE(s.Close().ok());
      EXPECT_TRUE(testing::FakeServiceManager::WaitFor(
          [&] { return sm.removed(state) == 2 && sm.removed(region) == 2; }, 5))
          << "a closed session's memfds stayed in the store\n" << d.Log();
    }
    std::filesystem::remove_all(dir);
    return slot;
  };
  const std::vector<float> got = run(true);
  const std::vector<float> want = run(false);
  ASSERT_EQ(got.size(), static_cast<size_t>(n));
  EXPECT_TRUE(got == want) << "the parameters differ from the uninterrupted run's";
}

// A state of the record format before handovers were journaled (2: its work journal's plan has
// no room for a handover's, and so its state is smaller), as the daemon of commit 0e18780 left
// it, is taken back by this daemon with the journal it has: the run goes on bit for bit, the
// state keeps its format (the next daemon lays it out the same), and its handovers run without
// a journal entry (one sent again is refused, not done twice). The old state is made from a live
// one: its bytes up to the journal, the identity's format and size set back, the old journal.
TEST(Adopt, AStateOfTheFormatBeforeJournaledHandoversIsTakenBack) {
  const int64_t rows = 16, cols = 4096, n = rows * cols;
  const v1::RegisterParamsRequest reg = Registration(rows, cols);
  const absl::StatusOr<SessionLayout> now = LayOutParams(reg);
  const absl::StatusOr<SessionLayout> before = LayOutParams(reg, kRecordFormatNoHandovers);
  ASSERT_TRUE(now.ok() && before.ok());
  ASSERT_LT(before->state_bytes, now->state_bytes) << "the formats' layouts do not differ here";
  ASSERT_EQ(before->journal_offset, now->journal_offset);
  const Rounds data = MakeRounds(n, 13);
  const v1::AdamWHyper h = testing::TestHyper(0.05);
  auto run = [&](bool old_format) {
    std::vector<float> master;
    Daemon d;
    EXPECT_TRUE(d.started()) << d.error();
    auto client = Client::Connect(d.socket(), 3000, 20);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return master;
    auto opened = (*client)->OpenSession("old-format", 0);
    EXPECT_TRUE(opened.ok()) << opened.status();
    if (!opened.ok()) return master;
    Session& s = **opened;
    EXPECT_TRUE(s.RegisterParams({{"w", {rows, cols}, v1::DTYPE_FP32}}, v1::DTYPE_FP32, 1).ok());
    EXPECT_TRUE(s.LoadValues({{"w", data.w.data()}}).ok());
    memcpy(s.GradSlot(0, "w"), data.grads[0].data(), n * 4);
    EXPECT_TRUE(s.Push(1, 0).ok());
    EXPECT_TRUE(Update(s, h, 1).ok());
    v1::SessionRef ref = s.ref();
    int state_fd = s.state_fd();
    int old_fd = -1, adopter = -1;
    uint8_t* old = nullptr;
    if (old_format) {
      const std::string fd_socket = FdSocket(**client);
      d.Kill();
      d.Restart();
      old_fd = memfd_create("old-format state", MFD_ALLOW_SEALING);
      EXPECT_GE(old_fd, 0) << strerror(errno);
      EXPECT_EQ(ftruncate(old_fd, static_cast<off_t>(before->state_bytes)), 0);
      old = static_cast<uint8_t*>(mmap(nullptr, before->state_bytes, PROT_READ | PROT_WRITE,
                                       MAP_SHARED, old_fd, 0));
      EXPECT_NE(old, MAP_FAILED) << strerror(errno);
      if (old == MAP_FAILED) return master;
      EXPECT_EQ(pread(state_fd, old, before->journal_offset, 0),
                static_cast<ssize_t>(before->journal_offset));
      WorkJournal(old + before->journal_offset, before->journal).Format();
      SessionRecord record(old, before->arrays_offset);
      absl::StatusOr<SessionIdentity> id = record.ReadIdentity();
      EXPECT_TRUE(id.ok()) << id.status();
      if (!id.ok()) return master;
      EXPECT_EQ(id->format, kRecordFormat);
      id->format = kRecordFormatNoHandovers;
      id->state_bytes = before->state_bytes;
      EXPECT_TRUE(record.WriteIdentity(*id).ok());
      EXPECT_EQ(fcntl(old_fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0) << strerror(errno);
      // The adopting connection stays open: the daemon holds a session while its process is
      // connected.
      absl::StatusOr<int> conn = ConnectUnix(fd_socket);
      EXPECT_TRUE(conn.ok()) << conn.status();
      if (!conn.ok()) return master;
      adopter = *conn;
      std::string reply;
      std::vector<int> got_fds;
      absl::Status sent = SendWithFds(
          adopter, absl::StrCat("ADOPT ", ref.token(), " ", s.generation(), "\n"),
          {s.region_fd(), old_fd});
      if (sent.ok()) sent = RecvWithFds(adopter, 512, &reply, &got_fds, 0);
      EXPECT_TRUE(sent.ok()) << sent;
      EXPECT_EQ(reply.rfind("OK ", 0), 0u) << reply << "\n" << d.Log();
      uint64_t new_id = 0;
      std::istringstream(reply.substr(3)) >> new_id;
      ref.set_session_id(new_id);
      state_fd = old_fd;
      // The client's channel may still hold the dead daemon's connection.
      for (int i = 0; i < 100 && !(*client)->Health().ok(); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    auto call = [&](auto rpc, auto req, auto* resp) {
      *req.mutable_session() = ref;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
      return FromGrpc(((*client)->stub()->*rpc)(&ctx, req, resp));
    };
    memcpy(s.GradSlot(0, "w"), data.grads[1].data(), n * 4);
    v1::PushGradientsRequest push;
    push.set_step(2);
    v1::PushGradientsResponse pushed;
    absl::Status st = call(&v1::Offload::Stub::PushGradients, push, &pushed);
    EXPECT_TRUE(st.ok()) << st;
    // A handover of 200 columns (its plan, 4824 bytes, does not fit the old journal's room of
    // 2368), then the Update that lands it.
    std::fill(s.Staging(), s.Staging() + 4 * rows * 200, 0.125f);
    v1::MigrateColumnsRequest hand;
    hand.set_handover(true);
    hand.set_param("w");
    for (int64_t j = 0; j < 200; ++j) {
      hand.add_columns(5 + 20 * j);
      hand.add_steps(1);
    }
    hand.set_handovers_before(0);
    v1::MigrateColumnsResponse handed;
    st = call(&v1::Offload::Stub::MigrateColumns, hand, &handed);
    EXPECT_TRUE(st.ok()) << st;
    if (old_format) {  // no journal entry to answer it again from: refused, nothing moved
      EXPECT_EQ(before->journal.plan_capacity, 2368u);
      v1::MigrateColumnsResponse again;
      EXPECT_EQ(call(&v1::Offload::Stub::MigrateColumns, hand, &again).code(),
                Code::kFailedPrecondition);
    }
    v1::UpdateRequest update;
    update.set_step(2);
    *update.mutable_hyper() = h;
    v1::UpdateResponse updated;
    EXPECT_TRUE(call(&v1::Offload::Stub::Update, update, &updated).ok());
    v1::WaitUpdateRequest wait;
    wait.set_min_version(2);
    v1::WaitUpdateResponse waited;
    EXPECT_TRUE(call(&v1::Offload::Stub::WaitUpdate, wait, &waited).ok());
    const SessionLayout& layout = old_format ? *before : *now;
    std::vector<uint8_t> bytes(layout.arrays_offset + 4 * n);
    EXPECT_EQ(pread(state_fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
    const float* m = reinterpret_cast<const float*>(bytes.data() + layout.arrays_offset);
    master.assign(m, m + n);
    if (old_format) {
      absl::StatusOr<SessionIdentity> id =
          SessionRecord(old, before->arrays_offset).ReadIdentity();
      EXPECT_TRUE(id.ok()) << id.status();
      if (id.ok()) EXPECT_EQ(id->format, kRecordFormatNoHandovers) << "the format changed";
      munmap(old, before->state_bytes);
      close(old_fd);
      close(adopter);
    }
    return master;
  };
  const std::vector<float> got = run(true), want = run(false);
  ASSERT_EQ(got.size(), static_cast<size_t>(n));
  EXPECT_TRUE(got == want) << "the parameters differ from the run of the current format";
}

// A session its daemon closed (here an operator's close) is not taken back, by that daemon or
// a later one: its record says so (generation 0).
TEST(Adopt, ASessionItsDaemonClosedIsNotTakenBack) {
  Daemon d;
  ASSERT_TRUE(d.started()) << d.error();
  std::vector<float> w(kN, 0.5f);
  Opened r = Open(d.socket(), w);
  ASSERT_NE(r.session, nullptr);
  ASSERT_TRUE(r.client->CloseSession(r.session->ref().session_id()).ok());
  // The daemon keeps the closed session's connection: no re-attach while it runs.
  absl::StatusOr<Session::Adopted> same = r.session->Reattach(0.2);
  EXPECT_EQ(same.status().code(), Code::kFailedPrecondition) << same.status();
  d.Kill();
  d.Restart();
  absl::StatusOr<Session::Adopted> later = r.session->Reattach(5);
  EXPECT_EQ(later.status().code(), Code::kFailedPrecondition) << later.status();
  EXPECT_NE(later.status().message().find("closed by the daemon"), std::string::npos)
      << later.status();
}

// Reattach with no daemon at the socket waits its bound and names the socket; while the daemon
// that holds the session still runs it is refused.
TEST(Adopt, ReattachWaitsItsBoundAndNamesTheSocket) {
  Daemon d;
  ASSERT_TRUE(d.started()) << d.error();
  std::vector<float> w(kN, 0.5f);
  Opened r = Open(d.socket(), w);
  ASSERT_NE(r.session, nullptr);
  absl::StatusOr<Session::Adopted> early = r.session->Reattach(0.3);
  EXPECT_EQ(early.status().code(), Code::kFailedPrecondition) << early.status();
  EXPECT_NE(early.status().message().find("still connected"), std::string::npos)
      << early.status();
  const std::string fd_socket = FdSocket(*r.client);
  d.Kill();
  unlink(fd_socket.c_str());
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<Session::Adopted> none = r.session->Reattach(1.5);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(none.status().code(), Code::kUnavailable) << none.status();
  EXPECT_NE(none.status().message().find(fd_socket), std::string::npos) << none.status();
  EXPECT_GE(took, 1.4);
  EXPECT_LT(took, 5);
}

}  // namespace
}  // namespace stallfree
