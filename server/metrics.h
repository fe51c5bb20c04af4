// stallfreed's Prometheus endpoint: --metrics_address HOST:PORT serves GET /metrics in the text
// exposition format (version 0.0.4) over civetweb, the embedded server prometheus-cpp uses.
//
// What it exposes (names follow Prometheus' conventions: stallfree_ prefix, base units,
// _total for counters): every counter and gauge of GetStats; histograms of push, update,
// migrate and checkpoint latency and of push and checkpoint sizes; per-session series labelled
// by session id, name and rank (a closed session's series go with it); rejected requests by
// gRPC method and code; the process's RSS, mlocked bytes, threads, open fds and CPU time; and
// stallfree_build_info. Session names of every uid appear: bind it to loopback or a node-local
// address that only the node's monitoring reaches.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "server/session_manager.h"

struct mg_connection;
struct mg_context;

namespace stallfree {

// The exposition text, as one scrape sees it.
std::string RenderMetrics(SessionManager* sessions);

class MetricsServer {
 public:
  explicit MetricsServer(SessionManager* sessions) : sessions_(sessions) {}
  ~MetricsServer() { Stop(); }
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // address: HOST:PORT (PORT 0: any free port; port() says which).
  absl::Status Start(const std::string& address);
  void Stop();
  int port() const { return port_; }

 private:
  static int Handle(struct mg_connection* conn, void* self);

  SessionManager* sessions_;
  mg_context* ctx_ = nullptr;
  int port_ = 0;
};

}  // namespace stallfree
