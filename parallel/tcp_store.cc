#include "parallel/tcp_store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "gloo/common/error.h"

namespace stallfree {
namespace parallel {
namespace {

enum : uint8_t { kSet = 1, kGet = 2, kCheck = 3 };

// Full read/write; false on EOF or error (errno set; 0 on EOF).
bool ReadAll(int fd, void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = ::read(fd, p, n);
    if (r == 0) {
      errno = 0;
      return false;
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool WriteAll(int fd, const void* buf, size_t n) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t r = ::send(fd, p, n, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool WriteString(int fd, const char* data, size_t n) {
  uint32_t len = static_cast<uint32_t>(n);
  return WriteAll(fd, &len, sizeof(len)) && WriteAll(fd, data, n);
}

bool ReadString(int fd, std::string* out) {
  uint32_t len = 0;
  if (!ReadAll(fd, &len, sizeof(len))) return false;
  if (len > (1u << 30)) {
    errno = EPROTO;
    return false;
  }
  out->resize(len);
  return len == 0 || ReadAll(fd, &(*out)[0], len);
}

absl::StatusOr<sockaddr_in> MakeAddress(const std::string& addr, int port) {
  sockaddr_in sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("TCP store: master address '", addr, "' is not an IPv4 address"));
  }
  return sa;
}

}  // namespace

std::string TcpStore::Where() const { return absl::StrCat(addr_, ":", port_); }

absl::StatusOr<std::unique_ptr<TcpStore>> TcpStore::Create(const std::string& addr, int port,
                                                           bool is_server,
                                                           std::chrono::milliseconds timeout) {
  std::unique_ptr<TcpStore> store(new TcpStore(addr, port, timeout));
  if (is_server) RETURN_IF_ERROR(store->StartServer());
  RETURN_IF_ERROR(store->Connect());
  return store;
}

absl::Status TcpStore::StartServer() {
  ASSIGN_OR_RETURN(sockaddr_in sa, MakeAddress(addr_, port_));
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("socket", "TCP store server " + Where());
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    absl::Status s = ErrnoStatus("bind", "TCP store server " + Where());
    ::close(fd);
    return absl::UnavailableError(s.message());
  }
  if (::listen(fd, 128) != 0) {
    absl::Status s = ErrnoStatus("listen", "TCP store server " + Where());
    ::close(fd);
    return absl::UnavailableError(s.message());
  }
  listen_fd_ = fd;
  accept_thread_ = std::thread([this] { ServeLoop(); });
  return absl::OkStatus();
}

void TcpStore::ServeLoop() {
  while (!stopping_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    int r = ::poll(&p, 1, 50);
    if (r <= 0) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno != EINTR && errno != EAGAIN) {
        SF_LOG(kError, "TCP store %s: accept: %s (errno %d)", Where(), std::strerror(errno),
               errno);
      }
      continue;
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::lock_guard<std::mutex> lock(server_mu_);
    conn_fds_.push_back(fd);
    conn_threads_.emplace_back([this, fd] { ServeConnection(fd); });
  }
}

void TcpStore::ServeConnection(int fd) {
  for (;;) {
    uint8_t op = 0;
    std::string key;
    if (!ReadAll(fd, &op, 1) || !ReadString(fd, &key)) break;  // client gone or shutdown
    bool ok = true;
    if (op == kSet) {
      std::string value;
      if (!ReadString(fd, &value)) break;
      {
        std::lock_guard<std::mutex> lock(server_mu_);
        data_[key] = std::vector<char>(value.begin(), value.end());
      }
      uint8_t ack = 1;
      ok = WriteAll(fd, &ack, 1);
    } else if (op == kCheck || op == kGet) {
      std::vector<char> value;
      uint8_t present = 0;
      {
        std::lock_guard<std::mutex> lock(server_mu_);
        auto it = data_.find(key);
        if (it != data_.end()) {
          present = 1;
          if (op == kGet) value = it->second;
        }
      }
      ok = WriteAll(fd, &present, 1);
      if (ok && op == kGet) ok = WriteString(fd, value.data(), value.size());
    } else {
      SF_LOG(kError, "TCP store %s: bad request op %d; closing the connection", Where(), op);
      break;
    }
    if (!ok) break;
  }
}

absl::Status TcpStore::Connect() {
  ASSIGN_OR_RETURN(sockaddr_in sa, MakeAddress(addr_, port_));
  auto deadline = std::chrono::steady_clock::now() + timeout_;
  int last_errno = 0;
  for (;;) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return ErrnoStatus("socket", "TCP store client for " + Where());
    if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) {
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      client_fd_ = fd;
      return absl::OkStatus();
    }
    last_errno = errno;
    ::close(fd);
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  SF_LOG(kError, "TCP store: connect to %s failed for %d ms: %s (errno %d)", Where(),
         static_cast<int>(timeout_.count()), std::strerror(last_errno), last_errno);
  return absl::UnavailableError(absl::StrCat("TCP store server ", Where(), " unreachable within ",
                                             timeout_.count(), " ms: connect: ",
                                             std::strerror(last_errno), " (errno ", last_errno,
                                             ")"));
}

TcpStore::~TcpStore() {
  if (client_fd_ >= 0) ::close(client_fd_);
  if (listen_fd_ >= 0) {
    stopping_.store(true);
    accept_thread_.join();
    ::close(listen_fd_);
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(server_mu_);
      for (int fd : conn_fds_) ::shutdown(fd, SHUT_RDWR);
      threads.swap(conn_threads_);
    }
    for (std::thread& t : threads) t.join();
    for (int fd : conn_fds_) ::close(fd);
  }
}

namespace {
[[noreturn]] void ThrowIo(const std::string& what, const std::string& where) {
  int err = errno;
  std::string reason = err == 0 ? "connection closed by the server" : std::strerror(err);
  SF_LOG(kError, "TCP store %s: %s: %s (errno %d)", where, what, reason, err);
  throw gloo::IoException(
      absl::StrCat("TCP store ", where, ": ", what, ": ", reason, " (errno ", err, ")"));
}
}  // namespace

void TcpStore::set(const std::string& key, const std::vector<char>& data) {
  std::lock_guard<std::mutex> lock(client_mu_);
  uint8_t op = kSet, ack = 0;
  if (!WriteAll(client_fd_, &op, 1) || !WriteString(client_fd_, key.data(), key.size()) ||
      !WriteString(client_fd_, data.data(), data.size()) || !ReadAll(client_fd_, &ack, 1)) {
    ThrowIo("set '" + key + "'", Where());
  }
}

bool TcpStore::Check(const std::string& key) {
  std::lock_guard<std::mutex> lock(client_mu_);
  uint8_t op = kCheck, present = 0;
  if (!WriteAll(client_fd_, &op, 1) || !WriteString(client_fd_, key.data(), key.size()) ||
      !ReadAll(client_fd_, &present, 1)) {
    ThrowIo("check '" + key + "'", Where());
  }
  return present != 0;
}

void TcpStore::wait(const std::vector<std::string>& keys,
                    const std::chrono::milliseconds& timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const std::string& key : keys) {
    while (!Check(key)) {
      if (std::chrono::steady_clock::now() >= deadline) {
        throw gloo::IoException(absl::StrCat("TCP store ", Where(), ": timed out after ",
                                             timeout.count(), " ms waiting for key '", key,
                                             "'"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
}

std::vector<char> TcpStore::get(const std::string& key) {
  wait({key}, timeout_);
  std::lock_guard<std::mutex> lock(client_mu_);
  uint8_t op = kGet, present = 0;
  std::string value;
  if (!WriteAll(client_fd_, &op, 1) || !WriteString(client_fd_, key.data(), key.size()) ||
      !ReadAll(client_fd_, &present, 1) || !ReadString(client_fd_, &value)) {
    ThrowIo("get '" + key + "'", Where());
  }
  if (!present) throw gloo::IoException("TCP store " + Where() + ": key '" + key + "' vanished");
  return std::vector<char>(value.begin(), value.end());
}

}  // namespace parallel
}  // namespace stallfree
