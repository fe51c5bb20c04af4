// Test helper: another tenant's attempts on a victim's checkpoint, run by checkpoint_test as
// uid 65534. Usage: tenant_probe SOCKET VICTIM_PID TAG
// Prints one line per attempt, "<attempt> <status code name> [detail]", in this order:
//   1. listings through its own caller credential (what it sees of the victim);
//   2. a session that names the victim's pid in OpenSession (spoofed): checkpoint RPCs before
//      it attaches, then after it attached (its uid is then the kernel's: 65534);
//   3. a session of its own (client library): reading, restoring and deleting TAG, then
//      checkpointing and uploading under TAG itself (which must land in its own directory).
// Then prints "attached <session_id>" and waits for a line on stdin (the test looks at the
// daemon's sessions meanwhile), and exits 0; non-zero exit: setup failed.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <string>

#include "client/client.h"
#include "common/unix_socket.h"

namespace stallfree {
namespace {

void Say(const std::string& what, const absl::Status& st, const std::string& detail = "") {
  printf("%s %s%s%s\n", what.c_str(), absl::StatusCodeToString(st.code()).c_str(),
         detail.empty() ? "" : " ", detail.c_str());
  fflush(stdout);
}

int Probe(const std::string& socket, int64_t victim_pid, const std::string& tag) {
  auto client = Client::Connect(socket);
  if (!client.ok()) return 2;
  Client& c = **client;

  // 1. Listings.
  auto ckpts = c.ListCheckpoints();
  std::string seen;
  if (ckpts.ok())
    for (const auto& k : ckpts->checkpoints()) seen += k.tag() + ",";
  Say("list-checkpoints", ckpts.status(), "[" + seen + "]");
  auto sessions = c.ListSessions();
  seen.clear();
  if (sessions.ok())
    for (const auto& s : *sessions) seen += s.name() + ",";
  Say("list-sessions", sessions.status(), "[" + seen + "]");

  // 2. The spoofed session, through the raw stub.
  v1::Offload::Stub* stub = c.stub();
  v1::OpenSessionRequest open;
  open.set_name("spoofed");
  open.set_pid(victim_pid);
  v1::OpenSessionResponse opened;
  {
    grpc::ClientContext ctx;
    Say("spoofed-open", FromGrpc(stub->OpenSession(&ctx, open, &opened)));
  }
  v1::RegisterParamsRequest reg;
  *reg.mutable_session() = opened.session();
  reg.add_params()->set_name("w");
  reg.mutable_params(0)->add_shape(16);
  reg.mutable_params(0)->add_shape(9);
  reg.mutable_params(0)->set_grad_dtype(v1::DTYPE_FP32);
  {
    grpc::ClientContext ctx;
    v1::RegisterParamsResponse resp;
    Say("spoofed-register", FromGrpc(stub->RegisterParams(&ctx, reg, &resp)));
  }
  auto checkpoint = [&](const std::string& what) {
    v1::CheckpointRequest req;
    *req.mutable_session() = opened.session();
    req.set_tag(tag);
    v1::CheckpointResponse resp;
    grpc::ClientContext ctx;
    absl::Status st = FromGrpc(stub->Checkpoint(&ctx, req, &resp));
    Say(what, st, resp.path());
  };
  auto restore = [&](const std::string& what) {
    v1::RestoreRequest req;
    *req.mutable_session() = opened.session();
    req.set_tag(tag);
    v1::RestoreResponse resp;
    grpc::ClientContext ctx;
    Say(what, FromGrpc(stub->Restore(&ctx, req, &resp)));
  };
  auto read = [&](const std::string& what) {
    v1::ReadCheckpointRequest req;
    *req.mutable_session() = opened.session();
    req.set_tag(tag);
    v1::ReadCheckpointResponse resp;
    grpc::ClientContext ctx;
    Say(what, FromGrpc(stub->ReadCheckpoint(&ctx, req, &resp)));
  };
  auto remove = [&](const std::string& what) {
    v1::DeleteCheckpointRequest req;
    *req.mutable_session() = opened.session();
    req.set_tag(tag);
    v1::DeleteCheckpointResponse resp;
    grpc::ClientContext ctx;
    Say(what, FromGrpc(stub->DeleteCheckpoint(&ctx, req, &resp)));
  };
  restore("spoofed-restore-before-attach");
  checkpoint("spoofed-checkpoint-before-attach");
  read("spoofed-read-before-attach");
  auto conn = ConnectUnix(opened.fd_socket());
  if (!conn.ok()) return 3;
  const std::string hello = std::to_string(opened.session().session_id()) + " " +
                            opened.session().token() + "\n";
  std::string reply;
  int fd = -1;
  if (!SendWithFd(*conn, hello, -1).ok() || !RecvWithFd(*conn, 512, &reply, &fd).ok()) return 4;
  Say("spoofed-attach", reply.rfind("OK ", 0) == 0 ? absl::OkStatus()
                                                   : absl::PermissionDeniedError(reply));
  restore("spoofed-restore");
  read("spoofed-read");
  remove("spoofed-delete");

  // 3. A session of its own.
  auto own = c.OpenSession("own", 0);
  if (!own.ok()) return 5;
  Session& s = **own;
  if (!s.RegisterParams({{"w", {16, 9}, v1::DTYPE_FP32}, {"b", {9}, v1::DTYPE_BF16}}).ok())
    return 6;
  if (!s.LoadParams().ok()) return 7;
  Say("own-restore", s.Restore(tag).status());
  Say("own-read", s.ReadCheckpointBytes(tag, /*delete_after=*/true).status());
  Say("own-delete", s.DeleteCheckpoint(tag));
  Say("caller-delete", c.DeleteCheckpoint(tag));
  auto written = s.Checkpoint(tag);
  Say("own-checkpoint", written.status(), written.ok() ? written->path() : "");
  auto bytes = s.ReadCheckpointBytes(tag, false);
  Say("own-upload", bytes.ok() ? s.WriteCheckpointBytes(tag, *bytes) : bytes.status());

  printf("attached %lu\n", (unsigned long)opened.session().session_id());
  fflush(stdout);
  std::string line;
  std::getline(std::cin, line);
  close(*conn);
  return 0;
}

}  // namespace
}  // namespace stallfree

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: tenant_probe SOCKET VICTIM_PID TAG\n");
    return 2;
  }
  return stallfree::Probe(argv[1], atoll(argv[2]), argv[3]);
}
