#include "server/fd_server.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "common/unix_socket.h"

namespace stallfree {

FdServer::~FdServer() { Stop(); }

absl::Status FdServer::Start(const std::string& path) {
  path_ = path;
  ASSIGN_OR_RETURN(listen_fd_, ListenUnix(path, 0666));
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) return ErrnoStatus("epoll_create1", path);
  wake_fd_ = eventfd(0, EFD_CLOEXEC);
  if (wake_fd_ < 0) return ErrnoStatus("eventfd", path);
  for (int fd : {listen_fd_, wake_fd_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0)
      return ErrnoStatus("epoll_ctl(ADD)", absl::StrCat("fd ", fd));
  }
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void FdServer::Stop() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  uint64_t one = 1;
  ssize_t ignored = write(wake_fd_, &one, sizeof one);
  (void)ignored;
  thread_.join();
  for (auto& [fd, id] : attached_) close(fd);
  attached_.clear();
  close(listen_fd_);
  close(epoll_fd_);
  close(wake_fd_);
  unlink(path_.c_str());
}

void FdServer::Handshake(int conn) {
  // A short receive timeout so a silent peer cannot stall the loop.
  timeval tv{2, 0};
  setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  auto reply_error = [&](const absl::Status& st) {
    SF_LOG(kWarning, "fd socket: refused: %s", st.ToString());
    SendWithFd(conn, absl::StrCat("ERR ", absl::StatusCodeToString(st.code()), " ", st.message(), "\n"), -1)
        .IgnoreError();
    close(conn);
  };
  absl::StatusOr<struct ucred> cred = PeerCredentials(conn);
  if (!cred.ok()) return reply_error(cred.status());
  // Descriptors come only with "ADOPT"; sent with anything else they are closed unread.
  std::vector<int> fds_in;
  absl::StatusOr<std::string> line = ReadLineWithFds(conn, 256, &fds_in, 2);
  if (!line.ok()) return reply_error(line.status());
  if (line->rfind("ADOPT ", 0) == 0) return Adopt(conn, *cred, *line, std::move(fds_in));
  for (int fd : fds_in) close(fd);
  if (*line == "CALLER") {  // a caller credential for the peer's uid, while this stays open
    const v1::CallerRef caller = sessions_->NewCaller(cred->uid, cred->pid);
    if (!SendWithFd(conn, absl::StrCat("OK ", caller.caller_id(), " ", caller.token(), "\n"), -1)
             .ok() ||
        !Watch(conn, Peer{true, caller.caller_id()})) {
      close(conn);
      sessions_->DropCaller(caller.caller_id());
    }
    return;
  }
  std::istringstream in(*line);
  uint64_t id = 0;
  std::string token, more;
  // "STATE": the client holds the optimizer state's memfd too (clients before it ask for the
  // region alone).
  if (!(in >> id >> token) || ((in >> more) && more != "STATE")) {
    return reply_error(absl::InvalidArgumentError(
        "expected '<session_id> <token> [STATE]' or 'CALLER'"));
  }
  const bool state = more == "STATE";
  auto fds = sessions_->Attach(id, token, cred->uid, cred->pid);
  if (!fds.ok()) return reply_error(fds.status());
  absl::Status st =
      state ? SendWithFds(conn, absl::StrCat("OK ", fds->region_bytes, " ", fds->state_bytes, " ",
                                             fds->generation, "\n"),
                          {fds->region_fd, fds->state_fd})
            : SendWithFd(conn, absl::StrCat("OK ", fds->region_bytes, "\n"), fds->region_fd);
  if (!st.ok()) {
    close(conn);
    sessions_->OnConnectionClosed(id);
    return;
  }
  if (!Watch(conn, Peer{false, id})) {
    close(conn);
    sessions_->OnConnectionClosed(id);
  }
}

void FdServer::Adopt(int conn, const struct ucred& cred, const std::string& line,
                     std::vector<int> fds) {
  std::istringstream in(line.substr(6));
  std::string token, more;
  uint64_t generation = 0, nonce = 0;
  bool ok = static_cast<bool>(in >> token >> generation);
  if (ok && !(in >> std::ws).eof()) ok = static_cast<bool>(in >> nonce) && !(in >> more);
  if (!ok || fds.size() != 2) {
    for (int fd : fds) close(fd);
    SF_LOG(kWarning, "fd socket: refused an adoption by pid %d: malformed", cred.pid);
    SendWithFd(conn,
               "ERR INVALID_ARGUMENT expected 'ADOPT <token> <generation> [<nonce>]' with the "
               "region's and the state's descriptors\n",
               -1)
        .IgnoreError();
    close(conn);
    return;
  }
  absl::StatusOr<AdoptResult> got =
      sessions_->Adopt(token, generation, nonce, fds[0], fds[1], cred.uid, cred.pid);
  if (!got.ok()) {
    SF_LOG(kWarning, "fd socket: refused an adoption by pid %d uid %d: %s", cred.pid, cred.uid,
           got.status().ToString());
    SendWithFd(conn, absl::StrCat("ERR ", absl::StatusCodeToString(got.status().code()), " ",
                                  got.status().message(), "\n"), -1).IgnoreError();
    close(conn);
    return;
  }
  absl::Status st = SendWithFd(
      conn, absl::StrCat("OK ", got->session_id, " ", got->generation, " ", got->version, " ",
                         got->last_step, " ", got->pushes_since_update, " ", got->handovers,
                         "\n"), -1);
  if (!st.ok() || !Watch(conn, Peer{false, got->session_id})) {
    close(conn);
    sessions_->OnConnectionClosed(got->session_id);
  }
}

bool FdServer::Watch(int conn, Peer peer) {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLHUP;
  ev.data.fd = conn;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, conn, &ev) != 0) {
    ErrnoStatus("epoll_ctl(ADD)", absl::StrCat("connection of ", peer.caller ? "caller " : "session ",
                                               peer.id))
        .IgnoreError();
    return false;
  }
  attached_[conn] = peer;
  return true;
}

void FdServer::Loop() {
  epoll_event events[64];
  while (!stop_.load()) {
    int n = epoll_wait(epoll_fd_, events, 64, 500);
    if (n < 0) {
      if (errno == EINTR) continue;
      ErrnoStatus("epoll_wait", path_).IgnoreError();
      return;
    }
    for (int i = 0; i < n; ++i) {
      int fd = events[i].data.fd;
      if (fd == wake_fd_) continue;
      if (fd == listen_fd_) {
        int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (conn < 0) {
          ErrnoStatus("accept4", path_).IgnoreError();
          continue;
        }
        Handshake(conn);
        continue;
      }
      // An attached connection: any readable event is EOF or garbage; either ends the session.
      char buf[64];
      ssize_t r = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      if (r > 0 && !(events[i].events & (EPOLLHUP | EPOLLRDHUP))) continue;
      auto it = attached_.find(fd);
      const Peer peer = it == attached_.end() ? Peer{} : it->second;
      epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
      close(fd);
      if (it != attached_.end()) attached_.erase(it);
      if (peer.id != 0 && peer.caller) sessions_->DropCaller(peer.id);
      if (peer.id != 0 && !peer.caller) sessions_->OnConnectionClosed(peer.id);
    }
  }
}

}  // namespace stallfree
