#include "common/unix_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

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
  struct iovec iov;
  iov.iov_base = const_cast<char*>(message.data());
  iov.iov_len = message.size();
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    memset(control, 0, sizeof control);
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    struct cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
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
  *fd = -1;
  message->assign(max_bytes, '\0');
  struct iovec iov;
  iov.iov_base = message->data();
  iov.iov_len = max_bytes;
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return ErrnoStatus("recvmsg", absl::StrCat("fd ", sock));
  message->resize(n);
  for (struct cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      memcpy(fd, CMSG_DATA(c), sizeof(int));
    }
  }
  if (n == 0 && *fd < 0) {
    return absl::UnavailableError(absl::StrCat("fd socket ", sock, " closed by the peer"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadLine(int sock, size_t max_bytes) {
  std::string line;
  while (line.size() < max_bytes) {
    char c;
    ssize_t n = read(sock, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus("read", absl::StrCat("fd ", sock));
    if (n == 0) return absl::UnavailableError("peer closed before sending a full line");
    if (c == '\n') return line;
    line.push_back(c);
  }
  return absl::InvalidArgumentError(absl::StrCat("line longer than ", max_bytes, " bytes"));
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
