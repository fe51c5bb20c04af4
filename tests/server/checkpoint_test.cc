// Checkpoint / Restore against a real stallfreed: a restored session continues bit for bit like
// the uninterrupted one; bad tags, corrupt, truncated and mismatched checkpoints are refused
// with the documented codes and change nothing; checkpoints belong to the uid that wrote them,
// and another uid (a child as 65534) can neither see, read, restore, replace nor delete them.
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "client/client.h"
#include "common/state_format.h"
#include "testing/daemon_process.h"
#include "testing/hyper.h"

namespace stallfree {
namespace {

using Code = absl::StatusCode;
using testing::Daemon;

v1::AdamWHyper Hyper() { return testing::TestHyper(0.01); }

// Where this process's checkpoints live: <state_dir>/<uid>.
std::string OwnDir(const std::string& state_dir) {
  return state_dir + "/" + std::to_string(getuid());
}

std::string FileBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

const std::vector<ParamSpec> kParams = {{"w", {16, 9}, v1::DTYPE_FP32},
                                        {"b", {9}, v1::DTYPE_BF16}};

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/stallfree-ckpt-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    tmp_ = tmpl;
  }
  void TearDown() override {
    if (system(("rm -rf " + tmp_).c_str()) != 0) perror("rm");
  }
  std::string tmp_;
};

// One session of kParams with deterministic initial values, loaded.
std::unique_ptr<Session> Open(Client* client, const std::string& name) {
  auto s = client->OpenSession(name, 0);
  EXPECT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE((*s)->RegisterParams(kParams).ok());
  float* w = (*s)->StagingFp32("w");
  float* b = (*s)->StagingFp32("b");
  for (int i = 0; i < 144; ++i) w[i] = 0.01f * i - 0.5f;
  for (int i = 0; i < 9; ++i) b[i] = 1.0f + 0.1f * i;
  EXPECT_TRUE((*s)->LoadParams().ok());
  return std::move(*s);
}

// Pushes step t's deterministic gradient (w's `nw` elements, then, with_b, the bf16 b's 9) and
// runs the Update of step t; returns the new w.
std::vector<float> Train(Session* s, int64_t t, int nw = 144, bool with_b = true) {
  std::mt19937 rng(static_cast<unsigned>(t));
  std::normal_distribution<float> normal;
  float* g = static_cast<float*>(s->GradSlot(0, "w"));
  for (int i = 0; i < nw; ++i) g[i] = normal(rng);
  if (with_b) {
    uint16_t* gb = static_cast<uint16_t*>(s->GradSlot(0, "b"));
    for (int i = 0; i < 9; ++i) gb[i] = static_cast<uint16_t>(0x3f80 + (rng() & 0xff));
  }
  EXPECT_TRUE(s->Push(t, 0).ok());
  EXPECT_TRUE(s->Update(t, Hyper(), 1, v1::DTYPE_FP32, /*column_steps=*/true).ok());
  auto ready = s->WaitUpdate(t);
  EXPECT_TRUE(ready.ok()) << ready.status();
  if (!ready.ok()) return {};
  const float* w = s->ParamsFp32(ready->param_slot(), "w");
  return std::vector<float>(w, w + nw);
}

TEST_F(CheckpointTest, RestoredSessionContinuesBitForBit) {
  const std::string dir = tmp_ + "/ckpt";
  Daemon d({"--threads", "2", "--state_dir", dir}, "info");
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok()) << client.status();
  auto a = Open(client->get(), "a");
  for (int64_t t = 1; t <= 3; ++t) Train(a.get(), t);
  auto saved = a->Checkpoint("run1.step-3");
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->path(), OwnDir(dir) + "/run1.step-3.sfckpt");
  EXPECT_EQ(saved->version(), 3);
  struct stat st;
  ASSERT_EQ(stat(saved->path().c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), saved->bytes());
  ASSERT_EQ(stat(OwnDir(dir).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u) << "the uid's checkpoint directory";
  // The uninterrupted run.
  std::vector<std::vector<float>> expected;
  for (int64_t t = 4; t <= 6; ++t) expected.push_back(Train(a.get(), t));

  // A new session restores and continues.
  auto b = Open(client->get(), "b");
  auto restored = b->Restore("run1.step-3", v1::DTYPE_FP32);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->version(), 3);
  auto ready = b->WaitUpdate(3);
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_EQ(ready->param_slot(), 0u);
  for (int64_t t = 4; t <= 6; ++t) {
    std::vector<float> w = Train(b.get(), t);
    EXPECT_EQ(0, memcmp(w.data(), expected[t - 4].data(), 144 * 4)) << "step " << t;
  }
  // Steps continue from the checkpoint: an older step is refused after Restore.
  EXPECT_EQ(b->Update(2, Hyper(), 0).code(), Code::kFailedPrecondition);
  EXPECT_EQ(b->LoadParams().code(), Code::kFailedPrecondition);

  // No temporary file is left behind, and the listing shows the checkpoint.
  auto list = (*client)->ListCheckpoints();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->checkpoints_size(), 1);
  EXPECT_EQ(list->checkpoints(0).tag(), "run1.step-3");
  EXPECT_EQ(list->checkpoints(0).session_name(), "a");
  EXPECT_EQ(list->checkpoints(0).params(), 2);
  EXPECT_EQ(list->checkpoints(0).param_elements(), 153);
  EXPECT_EQ(list->checkpoints(0).owner_uid(), getuid());
  EXPECT_EQ(system(("test $(ls -A " + OwnDir(dir) + " | wc -l) -eq 1").c_str()), 0);
}

TEST_F(CheckpointTest, BadTagsCorruptAndTruncatedFilesAreRefused) {
  const std::string dir = tmp_ + "/ckpt";
  Daemon d({"--threads", "2", "--state_dir", dir}, "info");
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok());
  auto a = Open(client->get(), "a");
  Train(a.get(), 1);
  for (const char* tag : {"", "../x", "a/b", ".hidden", "x..y", "sp ace", "new\nline"}) {
    EXPECT_EQ(a->Checkpoint(tag).status().code(), Code::kInvalidArgument) << tag;
    EXPECT_EQ(a->Restore(tag).status().code(), Code::kInvalidArgument) << tag;
  }
  EXPECT_EQ(a->Checkpoint(std::string(129, 'x')).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(a->Restore("never-written").status().code(), Code::kNotFound);

  auto saved = a->Checkpoint("good");
  ASSERT_TRUE(saved.ok()) << saved.status();
  const std::string path = saved->path();
  std::string bytes;
  {
    std::ifstream f(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), {});
  }
  ASSERT_EQ(bytes.size(), saved->bytes());
  auto write = [&](const std::string& tag, const std::string& content) {
    std::ofstream f(OwnDir(dir) + "/" + tag + ".sfckpt", std::ios::binary);
    f.write(content.data(), content.size());
  };
  std::string flipped = bytes;
  flipped[flipped.size() / 2] ^= 0x10;  // one bit in the middle of the state arrays
  write("flipped", flipped);
  write("truncated", bytes.substr(0, bytes.size() - 100));
  write("tiny", bytes.substr(0, 10));
  write("garbage", std::string(4096, 'g'));

  auto b = Open(client->get(), "b");
  const std::vector<float> before(b->StagingFp32("w"), b->StagingFp32("w") + 144);
  for (const char* tag : {"flipped", "truncated", "tiny", "garbage"}) {
    auto r = b->Restore(tag);
    EXPECT_EQ(r.status().code(), Code::kDataLoss) << tag << ": " << r.status();
  }
  // Nothing changed: training b from here equals a fresh session's first step.
  auto c = Open(client->get(), "c");
  EXPECT_EQ(Train(b.get(), 1), Train(c.get(), 1));

  // A checkpoint of other parameters is refused before anything is read.
  auto other = client->get()->OpenSession("other", 0);
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE((*other)->RegisterParams({{"w", {16, 9}, v1::DTYPE_FP32}}).ok());
  auto r = (*other)->Restore("good");
  EXPECT_EQ(r.status().code(), Code::kFailedPrecondition) << r.status();
  auto shape = client->get()->OpenSession("shape", 0);
  ASSERT_TRUE((*shape)->RegisterParams({{"w", {9, 16}, v1::DTYPE_FP32},
                                        {"b", {9}, v1::DTYPE_BF16}}).ok());
  r = (*shape)->Restore("good");
  EXPECT_EQ(r.status().code(), Code::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("'w'"), std::string::npos) << r.status();

  auto list = (*client)->ListCheckpoints();
  ASSERT_TRUE(list.ok());
  int unreadable = 0;
  for (const auto& k : list->checkpoints()) unreadable += !k.error().empty();
  EXPECT_EQ(unreadable, 2);  // tiny, garbage (a bad body is only found by a full read)
}

// ReadCheckpoint / WriteCheckpoint move a checkpoint's bytes through the staging area in chunks
// (the PyTorch optimizer's state_dict): the bytes read equal the file, bytes written back restore
// a session that continues bit for bit, a corrupt or out-of-order upload is refused and leaves
// nothing behind, and no session reaches another's checkpoint through them.
TEST_F(CheckpointTest, CheckpointBytesRoundTripThroughTheStagingArea) {
  const std::string dir = tmp_ + "/ckpt";
  Daemon d({"--threads", "2", "--state_dir", dir}, "info");
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok());
  // 2560 elements: a 12 KiB staging area, a ~41 KB file, so the bytes move in 4 chunks.
  const std::vector<ParamSpec> big = {{"w", {64, 40}, v1::DTYPE_FP32}};
  auto open = [&](const std::string& name) {
    auto s = (*client)->OpenSession(name, 0);
    EXPECT_TRUE(s.ok());
    EXPECT_TRUE((*s)->RegisterParams(big).ok());
    float* w = (*s)->StagingFp32("w");
    for (int i = 0; i < 2560; ++i) w[i] = 0.001f * i - 1.0f;
    EXPECT_TRUE((*s)->LoadParams().ok());
    return std::move(*s);
  };
  auto train = [](Session* s, int64_t t) {
    std::mt19937 rng(static_cast<unsigned>(t));
    std::normal_distribution<float> normal;
    float* g = static_cast<float*>(s->GradSlot(0, "w"));
    for (int i = 0; i < 2560; ++i) g[i] = normal(rng);
    EXPECT_TRUE(s->Push(t, 0).ok());
    EXPECT_TRUE(s->Update(t, Hyper(), 1, v1::DTYPE_FP32, /*column_steps=*/true).ok());
    auto ready = s->WaitUpdate(t);
    EXPECT_TRUE(ready.ok()) << ready.status();
    const float* w = s->ParamsFp32(ready->param_slot(), "w");
    return std::vector<float>(w, w + 2560);
  };
  auto a = open("a");
  for (int64_t t = 1; t <= 2; ++t) train(a.get(), t);
  ASSERT_GT(a->layout().staging_bytes(), 0u);
  auto saved = a->Checkpoint("orig");
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_GT(saved->bytes(), 3 * a->layout().staging_bytes());
  std::string on_disk;
  {
    std::ifstream f(saved->path(), std::ios::binary);
    on_disk.assign(std::istreambuf_iterator<char>(f), {});
  }
  auto bytes = a->ReadCheckpointBytes("orig", /*delete_after=*/false);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, on_disk);
  std::vector<std::vector<float>> expected;
  for (int64_t t = 3; t <= 4; ++t) expected.push_back(train(a.get(), t));

  // Written back under another tag: the same bytes, and a session restored from it continues
  // as the uninterrupted one.
  auto b = open("b");
  ASSERT_TRUE(b->WriteCheckpointBytes("copy", *bytes).ok());
  {
    std::ifstream f(OwnDir(dir) + "/copy.sfckpt", std::ios::binary);
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(f), {}), on_disk);
  }
  ASSERT_TRUE(b->Restore("copy").ok());
  for (int64_t t = 3; t <= 4; ++t) EXPECT_EQ(train(b.get(), t), expected[t - 3]) << "step " << t;

  // A corrupt upload (one flipped bit) or a truncated one is refused at its last chunk, and
  // neither it nor its upload file stays.
  std::string flipped = *bytes;
  flipped[flipped.size() / 2] ^= 0x04;
  EXPECT_EQ(b->WriteCheckpointBytes("bad", flipped).code(), Code::kDataLoss);
  std::string cut = bytes->substr(0, bytes->size() - 8);
  EXPECT_EQ(b->WriteCheckpointBytes("cut", cut).code(), Code::kDataLoss);
  EXPECT_EQ(b->Restore("bad").status().code(), Code::kNotFound);
  // Out of order: a chunk at an offset the upload has not reached; a chunk beyond the staging
  // area; a bad tag.
  v1::WriteCheckpointRequest req;
  *req.mutable_session() = b->ref();
  req.set_tag("gap");
  req.set_offset(4096);
  req.set_length(16);
  req.set_total_bytes(bytes->size());
  v1::WriteCheckpointResponse resp;
  {
    grpc::ClientContext ctx;
    EXPECT_EQ((*client)->stub()->WriteCheckpoint(&ctx, req, &resp).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  req.set_offset(0);
  req.set_length(b->layout().staging_bytes() + 1);
  req.set_total_bytes(b->layout().staging_bytes() + 1);
  {
    grpc::ClientContext ctx;
    EXPECT_EQ((*client)->stub()->WriteCheckpoint(&ctx, req, &resp).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  EXPECT_EQ(b->WriteCheckpointBytes("../x", *bytes).code(), Code::kInvalidArgument);
  // Sessions of one uid share its checkpoints (a resumed job reads its earlier run's): b reads
  // a's "orig"; a corrupt upload over it is refused and leaves it as it was.
  auto of_a = b->ReadCheckpointBytes("orig", false);
  ASSERT_TRUE(of_a.ok()) << of_a.status();
  EXPECT_EQ(*of_a, on_disk);
  EXPECT_EQ(b->WriteCheckpointBytes("orig", flipped).code(), Code::kDataLoss);
  EXPECT_EQ(FileBytes(OwnDir(dir) + "/orig.sfckpt"), on_disk);
  // Only orig.sfckpt and copy.sfckpt remain (no upload files).
  EXPECT_EQ(system(("test $(ls -A " + OwnDir(dir) + " | wc -l) -eq 2").c_str()), 0);

  // delete_after removes the file once read; DeleteCheckpoint removes one; then NOT_FOUND.
  auto again = a->ReadCheckpointBytes("orig", /*delete_after=*/true);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, on_disk);
  EXPECT_EQ(a->ReadCheckpointBytes("orig", false).status().code(), Code::kNotFound);
  EXPECT_TRUE(b->DeleteCheckpoint("copy").ok());
  EXPECT_EQ(b->DeleteCheckpoint("copy").code(), Code::kNotFound);
  EXPECT_EQ(system(("test $(ls -A " + OwnDir(dir) + " | wc -l) -eq 0").c_str()), 0);
}

// The attack of issue 13, as uid 65534 against root's checkpoint "secret" (tenant_probe.cc runs
// it): with its own session and with one that names root's pid in OpenSession, every attempt on
// "secret" is refused (NOT_FOUND: a tag names only the caller's own files; FAILED_PRECONDITION
// before the spoofed session attached, when its uid is not known yet), its own checkpoint under
// the same tag lands in its own directory, it sees none of root's sessions or checkpoints, root
// sees its session with the kernel's uid and pid, and root's file is byte for byte unchanged and
// still restores.
TEST_F(CheckpointTest, AnotherUidCannotSeeReadRestoreReplaceOrDeleteACheckpoint) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the probe under another uid";
  const std::string dir = tmp_ + "/ckpt";
  chmod(tmp_.c_str(), 0755);
  Daemon d({"--threads", "2", "--state_dir", dir}, "info");
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok());
  auto victim = Open(client->get(), "victim");
  Train(victim.get(), 1);
  auto saved = victim->Checkpoint("secret");
  ASSERT_TRUE(saved.ok()) << saved.status();
  const std::string secret = FileBytes(saved->path());
  ASSERT_EQ(secret.size(), saved->bytes());

  // uid 65534 cannot reach the runfiles under /root: run a copy from the test's directory.
  const std::string built = testing::FindBinary("tests/server/tenant_probe");
  ASSERT_FALSE(built.empty());
  const std::string probe = tmp_ + "/tenant_probe";
  ASSERT_EQ(system(("cp " + built + " " + probe + " && chmod 0755 " + probe).c_str()), 0);
  signal(SIGPIPE, SIG_IGN);
  int out[2], in[2];
  ASSERT_EQ(pipe(out), 0);
  ASSERT_EQ(pipe(in), 0);
  const std::string victim_pid = std::to_string(getpid());
  pid_t child = fork();
  if (child == 0) {
    dup2(out[1], 1);
    dup2(in[0], 0);
    if (setgroups(0, nullptr) != 0 || setgid(65534) != 0 || setuid(65534) != 0) _exit(120);
    execl(probe.c_str(), probe.c_str(), d.socket().c_str(), victim_pid.c_str(), "secret",
          static_cast<char*>(nullptr));
    _exit(121);
  }
  close(out[1]);
  close(in[0]);
  FILE* from = fdopen(out[0], "r");
  std::map<std::string, std::string> said;  // attempt -> "CODE [detail]"
  char line[4096];
  std::string attached;
  while (fgets(line, sizeof line, from) != nullptr) {
    std::string l(line);
    if (!l.empty() && l.back() == '\n') l.pop_back();
    const size_t sp = l.find(' ');
    if (l.rfind("attached ", 0) == 0) {
      attached = l.substr(sp + 1);
      break;
    }
    said[l.substr(0, sp)] = sp == std::string::npos ? "" : l.substr(sp + 1);
  }
  if (attached.empty()) {  // the probe stopped early: say how
    int status = 0;
    waitpid(child, &status, 0);
    FAIL() << "the probe exited before it attached: status " << WEXITSTATUS(status)
           << " (120: setuid, 121: exec; 2-7: its setup)";
  }
  // While the probe holds its sessions: root sees them, with the kernel's uid and pid.
  auto sessions = (*client)->ListSessions();
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  int spoofed = 0;
  for (const v1::SessionInfo& info : *sessions) {
    if (info.name() != "spoofed" && info.name() != "own") continue;
    ++spoofed;
    EXPECT_EQ(info.uid(), 65534u) << info.name();
    EXPECT_EQ(info.pid(), child) << info.name() << ": the kernel's pid, not the claimed one";
  }
  EXPECT_EQ(spoofed, 2);
  ASSERT_EQ(write(in[1], "done\n", 5), 5);
  close(in[1]);
  fclose(from);
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0) << "the probe's setup failed";
  ASSERT_FALSE(attached.empty());

  auto code = [&](const std::string& attempt) {
    auto it = said.find(attempt);
    return it == said.end() ? std::string("(missing)") : it->second.substr(0, it->second.find(' '));
  };
  EXPECT_EQ(said["list-checkpoints"], "OK []");
  EXPECT_EQ(said["list-sessions"], "OK []");
  EXPECT_EQ(code("spoofed-open"), "OK");
  EXPECT_EQ(code("spoofed-register"), "OK");
  EXPECT_EQ(code("spoofed-restore-before-attach"), "FAILED_PRECONDITION");
  EXPECT_EQ(code("spoofed-checkpoint-before-attach"), "FAILED_PRECONDITION");
  EXPECT_EQ(code("spoofed-read-before-attach"), "FAILED_PRECONDITION");
  EXPECT_EQ(code("spoofed-attach"), "OK");
  for (const char* attempt : {"spoofed-restore", "spoofed-read", "spoofed-delete", "own-restore",
                              "own-read", "own-delete", "caller-delete"})
    EXPECT_EQ(code(attempt), "NOT_FOUND") << attempt;
  EXPECT_EQ(said["own-checkpoint"], "OK " + dir + "/65534/secret.sfckpt");
  EXPECT_EQ(code("own-upload"), "OK");

  // Root's file is unchanged, root's listing shows both owners, and root still restores it.
  EXPECT_EQ(FileBytes(saved->path()), secret);
  auto list = (*client)->ListCheckpoints();
  ASSERT_TRUE(list.ok());
  std::set<std::string> owners;
  for (const auto& k : list->checkpoints())
    owners.insert(k.tag() + "@" + std::to_string(k.owner_uid()));
  EXPECT_EQ(owners, (std::set<std::string>{"secret@0", "secret@65534"}));
  auto again = Open(client->get(), "victim-again");
  EXPECT_TRUE(again->Restore("secret").ok());
}

TEST_F(CheckpointTest, WithoutStateDirectoryCheckpointsAreOff) {
  Daemon d({"--threads", "2", "--state_dir", ""}, "info");
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok());
  auto a = Open(client->get(), "a");
  auto st = a->Checkpoint("x").status();
  EXPECT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_NE(st.message().find("--state_dir"), std::string::npos) << st;
  EXPECT_EQ(a->Restore("x").status().code(), Code::kFailedPrecondition);
}

// The state directory removed under a running daemon: a checkpoint is FAILED_PRECONDITION naming
// it (ENOENT was UNAVAILABLE, which clients read as a lost daemon), a missing tag NOT_FOUND, and
// the daemon goes on serving.
TEST_F(CheckpointTest, AMissingStateDirectoryIsAFailedPreconditionNotALostDaemon) {
  const std::string dir = tmp_ + "/ckpt";
  Daemon d({"--threads", "2", "--state_dir", dir}, "info");
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok()) << client.status();
  auto a = Open(client->get(), "a");
  ASSERT_EQ(system(("rm -rf " + dir).c_str()), 0);
  const absl::Status saved = a->Checkpoint("x").status();
  EXPECT_EQ(saved.code(), Code::kFailedPrecondition) << saved;
  EXPECT_NE(saved.message().find("state directory " + dir + " is missing"), std::string::npos)
      << saved;
  EXPECT_NE(saved.message().find("errno"), std::string::npos) << saved;
  EXPECT_EQ(a->Restore("x").status().code(), Code::kNotFound);
  auto listed = (*client)->ListCheckpoints();  // root lists every uid's: state_dir itself
  if (getuid() == 0) {
    EXPECT_EQ(listed.status().code(), Code::kFailedPrecondition) << listed.status();
  } else {
    EXPECT_TRUE(listed.ok()) << listed.status();
  }
  EXPECT_NE(d.Log().find("mkdir(" + dir + "/"), std::string::npos) << "not logged";
  Train(a.get(), 1);
  auto health = (*client)->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "SERVING");
}

// A session of 2560 elements (a 12 KiB staging area, a ~41 KB state: several chunks), with
// deterministic initial values loaded unless `load` is false (registered only).
std::unique_ptr<Session> OpenBig(Client* client, const std::string& name, bool load = true) {
  auto s = client->OpenSession(name, 0);
  EXPECT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE((*s)->RegisterParams({{"w", {64, 40}, v1::DTYPE_FP32}}).ok());
  if (load) {
    float* w = (*s)->StagingFp32("w");
    for (int i = 0; i < 2560; ++i) w[i] = 0.001f * i - 1.0f;
    EXPECT_TRUE((*s)->LoadParams().ok());
  }
  return std::move(*s);
}

// Step t of OpenBig's session: a deterministic gradient, the Update; the new w.
std::vector<float> TrainBig(Session* s, int64_t t) { return Train(s, t, 2560, false); }

// ExportState / ImportState (issue 30, item 4): the state moves through the staging area
// straight out of and into the session's pinned memory, on a daemon with no state directory at
// all; an imported session continues bit for bit; a state that is cut, of other parameters or
// out of order is refused before anything changes; a corrupt one (its checksum) leaves a
// session that held nothing as registered and one that held state refusing to go on until a
// whole import; a change between an export's chunks aborts it.
TEST_F(CheckpointTest, StateMovesThroughTheStagingAreaWithNoFile) {
  Daemon d({"--threads", "2", "--state_dir", ""}, "info");
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok());
  auto a = OpenBig(client->get(), "a");
  for (int64_t t = 1; t <= 2; ++t) TrainBig(a.get(), t);
  EXPECT_EQ(a->Checkpoint("x").status().code(), Code::kFailedPrecondition);  // no directory
  int64_t version = 0;
  auto bytes = a->ExportState(&version);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(version, 2);
  ASSERT_GT(bytes->size(), 3 * a->layout().staging_bytes());
  auto header = VerifyCheckpointBytes(bytes->data(), bytes->size(), "the export");
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->version, 2);
  EXPECT_EQ(header->owner_uid, getuid());
  ASSERT_EQ(header->params.size(), 1u);
  EXPECT_EQ(header->params[0].spec.name, "w");
  std::vector<std::vector<float>> expected;
  for (int64_t t = 3; t <= 4; ++t) expected.push_back(TrainBig(a.get(), t));

  // Into a session that has trained on its own: it continues as a did.
  auto b = OpenBig(client->get(), "b");
  TrainBig(b.get(), 1);
  auto imported = b->ImportState(bytes->data(), bytes->size(), v1::DTYPE_FP32);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_TRUE(imported->complete());
  EXPECT_EQ(imported->version(), 2);
  EXPECT_EQ(imported->last_step(), 2);
  auto ready = b->WaitUpdate(2);
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_EQ(ready->param_slot(), 0u);
  // Exported again before it steps: the same bytes (but the session's name in the header).
  auto again = b->ExportState();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->size(), bytes->size() + 0);  // "a" and "b": names of one byte

  // Refused before anything changes: cut short, nothing, other parameters, chunks out of
  // order, a chunk beyond the staging area.
  std::string cut = bytes->substr(0, bytes->size() - 8);
  auto r = b->ImportState(cut.data(), cut.size());
  EXPECT_EQ(r.status().code(), Code::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("truncated"), std::string::npos) << r.status();
  EXPECT_EQ(b->ImportState(nullptr, 0).status().code(), Code::kDataLoss);
  auto other = client->get()->OpenSession("other", 0);
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE((*other)->RegisterParams({{"w", {40, 64}, v1::DTYPE_FP32}}).ok());
  r = (*other)->ImportState(bytes->data(), bytes->size());
  EXPECT_EQ(r.status().code(), Code::kFailedPrecondition) << r.status();
  {
    v1::ImportStateRequest req;
    *req.mutable_session() = b->ref();
    req.set_offset(4096);
    req.set_length(16);
    req.set_total_bytes(bytes->size());
    v1::ImportStateResponse resp;
    grpc::ClientContext ctx;
    EXPECT_EQ((*client)->stub()->ImportState(&ctx, req, &resp).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
    req.set_offset(0);
    req.set_length(b->layout().staging_bytes() + 1);
    grpc::ClientContext ctx2;
    EXPECT_EQ((*client)->stub()->ImportState(&ctx2, req, &resp).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  for (int64_t t = 3; t <= 4; ++t)
    EXPECT_EQ(TrainBig(b.get(), t), expected[t - 3]) << "step " << t << " after the refusals";

  // A corrupt state into a session that held nothing (registered, not loaded): DATA_LOSS at
  // the last chunk, and the session is as registered: its export equals an untouched one's.
  std::string flipped = *bytes;
  flipped[flipped.size() / 2] ^= 0x04;
  auto fresh = OpenBig(client->get(), "fresh", /*load=*/false);
  auto untouched = OpenBig(client->get(), "fresh", /*load=*/false);
  r = fresh->ImportState(flipped.data(), flipped.size());
  EXPECT_EQ(r.status().code(), Code::kDataLoss) << r.status();
  auto fresh_state = fresh->ExportState();
  auto untouched_state = untouched->ExportState();
  ASSERT_TRUE(fresh_state.ok() && untouched_state.ok());
  EXPECT_TRUE(*fresh_state == *untouched_state) << "a refused import left its bytes";
  EXPECT_TRUE(fresh->ImportState(bytes->data(), bytes->size()).ok());
  for (int64_t t = 3; t <= 4; ++t) EXPECT_EQ(TrainBig(fresh.get(), t), expected[t - 3]);

  // The same into a session that held state: its state is incomplete, so Update and an export
  // are refused until a whole import mends it.
  auto c = OpenBig(client->get(), "c");
  TrainBig(c.get(), 1);
  r = c->ImportState(flipped.data(), flipped.size());
  EXPECT_EQ(r.status().code(), Code::kDataLoss) << r.status();
  EXPECT_EQ(c->Update(5, Hyper(), 0, v1::DTYPE_FP32, true).code(), Code::kFailedPrecondition);
  EXPECT_EQ(c->ExportState().status().code(), Code::kFailedPrecondition);
  ASSERT_TRUE(c->ImportState(bytes->data(), bytes->size()).ok());
  for (int64_t t = 3; t <= 4; ++t) EXPECT_EQ(TrainBig(c.get(), t), expected[t - 3]);

  // An export whose session changes between two chunks (a push) is aborted; one that skips
  // ahead is refused.
  v1::ExportStateRequest req;
  *req.mutable_session() = c->ref();
  v1::ExportStateResponse resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE((*client)->stub()->ExportState(&ctx, req, &resp).ok());
  }
  ASSERT_LT(resp.length(), resp.total_bytes());
  ASSERT_TRUE(c->Push(5, 0).ok());
  req.set_offset(resp.length());
  {
    grpc::ClientContext ctx;
    EXPECT_EQ((*client)->stub()->ExportState(&ctx, req, &resp).error_code(),
              grpc::StatusCode::ABORTED);
  }
  {
    grpc::ClientContext ctx;
    EXPECT_EQ((*client)->stub()->ExportState(&ctx, req, &resp).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  EXPECT_TRUE(c->ExportState().ok());
}

// With a state directory the export is byte for byte the checkpoint file Checkpoint writes,
// and moving a state out and in writes nothing there.
TEST_F(CheckpointTest, ExportedStateIsTheCheckpointFileAndNothingIsWritten) {
  const std::string dir = tmp_ + "/ckpt";
  Daemon d({"--threads", "2", "--state_dir", dir}, "info");
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok());
  auto a = OpenBig(client->get(), "a");
  for (int64_t t = 1; t <= 2; ++t) TrainBig(a.get(), t);
  auto saved = a->Checkpoint("orig");
  ASSERT_TRUE(saved.ok()) << saved.status();
  const std::string on_disk = FileBytes(saved->path());
  ASSERT_TRUE(a->DeleteCheckpoint("orig").ok());
  auto bytes = a->ExportState();
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_TRUE(*bytes == on_disk);
  auto b = OpenBig(client->get(), "b");
  ASSERT_TRUE(b->ImportState(bytes->data(), bytes->size()).ok());
  EXPECT_EQ(TrainBig(b.get(), 3), TrainBig(a.get(), 3));
  EXPECT_EQ(system(("test $(ls -A " + OwnDir(dir) + " | wc -l) -eq 0").c_str()), 0);
}

// What interrupted writes leave (an upload's or an atomic write's hidden file, the transient
// checkpoints of clients before ExportState) is removed when the daemon starts; checkpoints and
// other files stay.
TEST_F(CheckpointTest, LeftoversOfInterruptedWritesAreSweptAtStart) {
  const std::string dir = tmp_ + "/ckpt";
  const std::string own = OwnDir(dir);
  ASSERT_EQ(system(("mkdir -p " + own + " " + dir + "/12345").c_str()), 0);
  const std::vector<std::string> leftovers = {
      own + "/.run.sfckpt.upload", own + "/.run.sfckpt.tmp.4242.0",
      own + "/bytes-4242-0-9f3a2b1c.sfckpt", dir + "/12345/.x.dp2.r1.sfckpt.upload",
      dir + "/bytes-7-1-ab.sfckpt"};
  const std::vector<std::string> kept = {own + "/run.sfckpt", own + "/bytes-mine.sfckpt",
                                         own + "/bytes-1-2-xyz.sfckpt", own + "/.keep",
                                         dir + "/12345/other.sfckpt"};
  for (const std::string& path : leftovers) std::ofstream(path) << "x";
  for (const std::string& path : kept) std::ofstream(path) << "x";
  Daemon d({"--threads", "1", "--state_dir", dir}, "info");
  auto client = Client::Connect(d.socket());
  ASSERT_TRUE(client.ok());
  struct stat st;
  for (const std::string& path : leftovers) EXPECT_NE(stat(path.c_str(), &st), 0) << path;
  for (const std::string& path : kept) EXPECT_EQ(stat(path.c_str(), &st), 0) << path;
  EXPECT_NE(d.Log().find("removed " + own + "/.run.sfckpt.upload"), std::string::npos);
}

}  // namespace
}  // namespace stallfree
