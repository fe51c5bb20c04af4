#include "common/unix_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace stallfree {
namespace {
absl::StatusOr<sockaddr_un> MakeAddr(const std::string& path) {
  sockaddr_un addr;
  memset(&addr, 0, sizeof addr);
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket path '", path, "' is empty or longer than ",
                     sizeof(addr.sun_path) - 1, " bytes"));
  }
  memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}
}  // namespace

absl::StatusOr<int> ListenUnix(const std::string& path, int mode) {
  ASSIGN_OR_RETURN(sockaddr_un addr, MakeAddr(path));
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("socket", path);
  struct stat st;
  if (lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) unlink(path.c_str());
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    absl::Status s = ErrnoStatus("bind", path);
    close(fd);
    return s;
  }
  if (chmod(path.c_str(), mode) != 0) {
    absl::Status s = ErrnoStatus("chmod", path);
    close(fd);
    return s;
  }
  if (listen(fd, 128) != 0) {
    absl::Status s = ErrnoStatus("listen", path);
    close(fd);
    return s;
  }
  return fd;
}

absl::StatusOr<int> ConnectUnix(const std::string& path) {
  ASSIGN_OR_RETURN(sockaddr_un addr, MakeAddr(path));
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("socket", path);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect(", path, ") failed: ", strerror(err),
                                               " (errno ", err, ")"));
  }
  return fd;
}

absl::StatusOr<struct ucred> PeerCredentials(int sock) {
  struct ucred cred;
  socklen_t len = sizeof cred;
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return ErrnoStatus("getsockopt(SO_PEERCRED)", absl::StrCat("fd ", sock));
  }
  return cred;
}

absl::Status SendWithFd(int sock, const std::string& message, int fd) {
  return SendWithFds(sock, message, fd >= 0 ? std::vector<int>{fd} : std::vector<int>{});
}

absl::Status SendWithFds(int sock, const std::string& message, const std::vector<int>& fds) {
  struct iovec iov;
  iov.iov_base = const_cast<char*>(message.data());
  iov.iov_len = message.size();
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control;
  if (!fds.empty()) {
    const size_t bytes = fds.size() * sizeof(int);
    control.assign(CMSG_SPACE(bytes), 0);
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    struct cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(bytes);
    memcpy(CMSG_DATA(cmsg), fds.data(), bytes);
  }
  ssize_t n;
  do {
    n = sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return ErrnoStatus("sendmsg", absl::StrCat("fd ", sock));
  if (static_cast<size_t>(n) != message.size()) {
    return absl::InternalError(absl::StrCat("sendmsg(fd ", sock, ") sent ", n, " of ",
                                            message.size(), " bytes"));
  }
  return absl::OkStatus();
}

absl::Status RecvWithFd(int sock, size_t max_bytes, std::string* message, int* fd) {
  std::vector<int> fds;
  absl::Status st = RecvWithFds(sock, max_bytes, message, &fds, 1);
  *fd = fds.empty() ? -1 : fds[0];
  return st;
}

absl::Status RecvWithFds(int sock, size_t max_bytes, std::string* message, std::vector<int>* fds,
                         size_t max_fds) {
  fds->clear();
  message->assign(max_bytes, '\0');
  struct iovec iov;
  iov.iov_base = message->data();
  iov.iov_len = max_bytes;
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  // Room for one more than allowed, so that too many are seen (and closed), not truncated.
  std::vector<char> control(CMSG_SPACE((max_fds + 1) * sizeof(int)));
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t n;
  do {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return ErrnoStatus("recvmsg", absl::StrCat("fd ", sock));
  message->resize(n);
  for (struct cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds->push_back(fd);
      }
    }
  }
  if (fds->size() > max_fds || (msg.msg_flags & MSG_CTRUNC) != 0) {
    const size_t got = fds->size();
    for (int fd : *fds) close(fd);
    fds->clear();
    return absl::InvalidArgumentError(absl::StrCat("fd socket ", sock, ": ", got,
                                                   " descriptors sent, at most ", max_fds,
                                                   " expected"));
  }
  if (n == 0 && fds->empty()) {
    return absl::UnavailableError(absl::StrCat("fd socket ", sock, " closed by the peer"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadLineWithFds(int sock, size_t max_bytes, std::vector<int>* fds,
                                            size_t max_fds) {
  fds->clear();
  std::string line;
  auto fail = [&](absl::Status st) {
    for (int fd : *fds) close(fd);
    fds->clear();
    return st;
  };
  while (line.size() < max_bytes) {
    // One byte at a time, so that nothing after the line is consumed; the descriptors come
    // with the first byte of the message they were sent with.
    std::string byte;
    std::vector<int> got;
    absl::Status st = RecvWithFds(sock, 1, &byte, &got, max_fds - std::min(max_fds, fds->size()));
    fds->insert(fds->end(), got.begin(), got.end());
    if (!st.ok()) return fail(st);
    if (byte.empty()) return fail(absl::UnavailableError("peer closed before sending a full line"));
    if (byte[0] == '\n') return line;
    line.push_back(byte[0]);
  }
  return fail(absl::InvalidArgumentError(absl::StrCat("line longer than ", max_bytes, " bytes")));
}

bool PeerClosed(int sock) {
  struct pollfd p;
  p.fd = sock;
  p.events = POLLIN | POLLRDHUP;
  p.revents = 0;
  int r;
  do {
    r = poll(&p, 1, 0);
  } while (r < 0 && errno == EINTR);
  if (r <= 0) return false;
  if (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) return true;
  char c;
  const ssize_t n = recv(sock, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

}  // namespace stallfree
