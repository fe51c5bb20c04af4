// A gloo::rendezvous::Store over TCP. Rank 0 serves the key/value map on master_addr:port (one
// thread per connection); every rank, rank 0 included, is a client over one connection.
//
// Protocol (client -> server): u8 op, u32 key length, key, and for SET a u32 value length and
// the value. Replies: SET -> u8 1; CHECK -> u8 0/1 (present); GET -> u8 present, u32 length,
// value. wait() polls CHECK until the keys are present or the timeout passes.
//
// Gloo's Store interface reports errors by throwing: set/get/wait throw gloo::IoException (with
// the address and errno text). Create() does not throw; it returns a Status.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "gloo/rendezvous/store.h"

namespace stallfree {
namespace parallel {

class TcpStore : public gloo::rendezvous::Store {
 public:
  // is_server: also serve on addr:port (SO_REUSEADDR). The client connects with retries until
  // `timeout` passes (the server may not be up yet), then UNAVAILABLE naming the address.
  static absl::StatusOr<std::unique_ptr<TcpStore>> Create(const std::string& addr, int port,
                                                          bool is_server,
                                                          std::chrono::milliseconds timeout);
  ~TcpStore() override;

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  TcpStore(std::string addr, int port, std::chrono::milliseconds timeout)
      : addr_(std::move(addr)), port_(port), timeout_(timeout) {}
  absl::Status StartServer();
  absl::Status Connect();
  void ServeLoop();
  void ServeConnection(int fd);
  bool Check(const std::string& key);  // throws
  std::string Where() const;

  const std::string addr_;
  const int port_;
  const std::chrono::milliseconds timeout_;
  int client_fd_ = -1;
  std::mutex client_mu_;  // one request at a time on client_fd_

  // Server side.
  int listen_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread accept_thread_;
  std::mutex server_mu_;
  std::map<std::string, std::vector<char>> data_;
  std::vector<int> conn_fds_;
  std::vector<std::thread> conn_threads_;
};

}  // namespace parallel
}  // namespace stallfree
