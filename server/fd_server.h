// FdServer: the side unix socket that hands a session's memfd to its process (SCM_RIGHTS) and
// then watches the connection: when it closes, the session is reclaimed.
// Protocol: the client sends "<session_id> <token>\n"; the daemon checks SO_PEERCRED against
// the session's uid and answers "OK <region_bytes>\n" with the fd, or "ERR <message>\n".
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
  void Loop();
  void Handshake(int conn);

  SessionManager* sessions_;
  std::string path_;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::map<int, uint64_t> attached_;  // connection fd -> session id; Loop thread only.
};

}  // namespace stallfree
