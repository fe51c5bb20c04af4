// FdServer: the side unix socket that hands a session's memfd to its process (SCM_RIGHTS) and
// then watches the connection: when it closes, the session is reclaimed.
// Protocol: the client sends "<session_id> <token>\n"; the daemon checks the token, makes the
// peer's SO_PEERCRED uid and pid the session's, and answers "OK <region_bytes>\n" with the
// region's fd, or "ERR <message>\n". With "<session_id> <token> STATE\n" the answer is
// "OK <region_bytes> <state_bytes>\n" with two fds: the region's and the optimizer state's
// memfd, which the client holds (never maps) so that the state outlives the daemon's process. Or it sends "CALLER\n" and receives "OK <caller_id> <token>\n", a
// caller credential for its uid (offload.proto, CallerRef). Either stays valid while the
// connection stays open.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "server/session_manager.h"

namespace stallfree {

class FdServer {
 public:
  explicit FdServer(SessionManager* sessions) : sessions_(sessions) {}
  ~FdServer();
  FdServer(const FdServer&) = delete;
  FdServer& operator=(const FdServer&) = delete;

  absl::Status Start(const std::string& path);
  void Stop();

 private:
  // What an open connection stands for: a session (its liveness) or a caller credential.
  struct Peer {
    bool caller = false;
    uint64_t id = 0;
  };
  void Loop();
  void Handshake(int conn);
  // Watches conn for its close (then the session is reclaimed or the caller dropped).
  bool Watch(int conn, Peer peer);

  SessionManager* sessions_;
  std::string path_;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::map<int, Peer> attached_;  // connection fd -> what it stands for; Loop thread only.
};

}  // namespace stallfree
