// FdServer: the side unix socket that hands a session's memfds to its process (SCM_RIGHTS) and
// then watches the connection: when it closes, the session is reclaimed. One line per
// connection:
//  - "<session_id> <token>\n": the daemon checks the token, makes the peer's SO_PEERCRED uid and
//    pid the session's, and answers "OK <region_bytes>\n" with the region's fd.
//  - "<session_id> <token> STATE\n": the answer is "OK <region_bytes> <state_bytes>
//    <generation>\n" with two fds, the region's and the optimizer state's memfd, which the
//    client holds (never maps) so that the state outlives the daemon's process; the generation
//    is what a later ADOPT presents.
//  - "ADOPT <token> <generation> [<nonce>]\n" sent with those two fds (region first), by the
//    process of a session whose daemon went away, to a daemon started since:
//    SessionManager::Adopt (the nonce names the attempt, kept until one succeeds). The answer
//    is "OK <session_id> <generation> <version> <last_step> <pushes_since_update>
//    <handovers>\n": the session's new id, the generation to present next time, and where its
//    state stands.
//  - "CALLER\n": the answer is "OK <caller_id> <token>\n", a caller credential for the peer's
//    uid (offload.proto, CallerRef).
// A refusal is "ERR <code> <message>\n". What an answer grants stays valid while the connection
// stays open.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/socket.h>

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
  // The ADOPT line `line` with its descriptors (closed here on a refusal).
  void Adopt(int conn, const struct ucred& cred, const std::string& line, std::vector<int> fds);
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
