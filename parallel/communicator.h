// Collective and point-to-point communication between the ranks of one parallel group: the one
// interface TSP, the baselines and the trainer use, with a Gloo backend (CPU buffers; ranks are
// processes, TCP over loopback or the node's network) and an NCCL backend (device buffers).
//
// Semantics (the same on every backend)
// - Buffers hold `count` fp32 elements in the backend's memory (host for Gloo, device for NCCL).
// - Every rank of the group must issue the same collectives in the same order (as MPI/NCCL).
// - The I* forms start the operation and return a Work handle; the plain forms are I* + Wait.
//   Operations issued by one thread run in issue order; a buffer must not be touched until its
//   Work has completed. A Work must be waited on (or destroyed) before its Communicator.
// - Errors are absl::Status: a peer that died or a timeout gives UNAVAILABLE or
//   DEADLINE_EXCEEDED with the rank and operation named, within CommOptions::timeout; a
//   communicator that reported such an error is broken and every later call fails at once.
// - Counters: bytes this rank sent and received per operation kind, as the algorithm actually
//   moved them (Gloo: counted at the transport; NCCL: the ring algorithm's volume).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace stallfree {
namespace parallel {

enum class OpKind {
  kBroadcast = 0,
  kReduce,
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kSend,
  kRecv,
  kBarrier,
  kNumKinds
};
const char* OpKindName(OpKind kind);

struct OpCounter {
  int64_t calls = 0;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
};
using OpCounters = std::array<OpCounter, static_cast<size_t>(OpKind::kNumKinds)>;

// A started operation.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation is complete (for NCCL: until the host has synchronised with it).
  virtual absl::Status Wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;

  // buf on every rank := root's buf.
  virtual std::shared_ptr<Work> IBroadcast(float* buf, int64_t count, int root) = 0;
  // recv (root only; may be null elsewhere) := sum over ranks of send. send == recv allowed.
  virtual std::shared_ptr<Work> IReduce(const float* send, float* recv, int64_t count,
                                        int root) = 0;
  // recv [size * count] := the ranks' send [count], in rank order.
  virtual std::shared_ptr<Work> IAllGather(const float* send, float* recv, int64_t count) = 0;
  // recv [count] := sum over ranks of send[rank * count .. (rank + 1) * count).
  virtual std::shared_ptr<Work> IReduceScatter(const float* send, float* recv,
                                               int64_t count) = 0;
  // buf := sum over ranks of buf.
  virtual std::shared_ptr<Work> IAllReduce(float* buf, int64_t count) = 0;
  // Point to point. A send is matched by the recv with the same peer pair and tag; tags < 2^20.
  virtual std::shared_ptr<Work> ISend(const float* buf, int64_t count, int peer, int tag) = 0;
  virtual std::shared_ptr<Work> IRecv(float* buf, int64_t count, int peer, int tag) = 0;
  virtual absl::Status Barrier() = 0;

  // Blocking forms.
  absl::Status Broadcast(float* buf, int64_t count, int root) {
    return IBroadcast(buf, count, root)->Wait();
  }
  absl::Status Reduce(const float* send, float* recv, int64_t count, int root) {
    return IReduce(send, recv, count, root)->Wait();
  }
  absl::Status AllGather(const float* send, float* recv, int64_t count) {
    return IAllGather(send, recv, count)->Wait();
  }
  absl::Status ReduceScatter(const float* send, float* recv, int64_t count) {
    return IReduceScatter(send, recv, count)->Wait();
  }
  absl::Status AllReduce(float* buf, int64_t count) { return IAllReduce(buf, count)->Wait(); }
  absl::Status Send(const float* buf, int64_t count, int peer, int tag) {
    return ISend(buf, count, peer, tag)->Wait();
  }
  absl::Status Recv(float* buf, int64_t count, int peer, int tag) {
    return IRecv(buf, count, peer, tag)->Wait();
  }

  // Counters since creation or the last ResetCounters().
  virtual OpCounters counters() const = 0;
  virtual void ResetCounters() = 0;
};

// How a rank finds its group.
struct CommOptions {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  // Rendezvous: a directory shared by the ranks (file store), or, if store_dir is empty, a TCP
  // store served by rank 0 at master_addr:master_port.
  std::string store_dir;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // The interface address Gloo's transport binds (loopback for one host).
  std::string transport_addr = "127.0.0.1";
  // Bound on rendezvous and on every operation; a dead peer is reported within it.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  // Namespaces the store's keys, so several groups can share a store.
  std::string group = "default";

  // From the usual launcher environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
  // MASTER_PORT, and STALLFREE_STORE_DIR / STALLFREE_COMM_TIMEOUT_MS. Missing RANK or
  // WORLD_SIZE means a single rank; malformed values are INVALID_ARGUMENT.
  static absl::StatusOr<CommOptions> FromEnvironment();
};

// Gloo backend (CPU). Blocks until every rank has joined or options.timeout passes.
absl::StatusOr<std::unique_ptr<Communicator>> NewGlooCommunicator(const CommOptions& options);

// This rank's place in one group of a world split into groups (e.g. the TSP group of its
// replica and the data-parallel group of its TSP index): the same `name` on every member, a
// different one per group.
struct GroupMembership {
  std::string name;
  int rank = 0;  // this rank's index in the group
  int size = 1;
};

// Gloo communicators for several groups of one world (`world`: this rank, the world size, the
// rendezvous as in NewGlooCommunicator) over the world's one store (the TCP store that world
// rank 0 serves, or the file store), each group's keys under "<world.group>/<name>", one TCP
// transport device shared by them. Every rank of the world calls it once with the groups it
// belongs to; the groups connect one after the other, so list them in an order every rank
// agrees on (e.g. each rank its TSP group first, then its data-parallel group), or a group can
// wait for a member still connecting another one until the timeout. Returns the communicators
// in the order of `groups`; a group of size 1 needs no peer. The communicators keep the store
// (world rank 0's serves the others' rendezvous), so keep rank 0's alive while others connect.
//
//   // N replicas of a D-rank group, global rank = replica * D + index:
//   NewGlooGroups(world, {{absl::StrCat("tsp", replica), index, D},
//                         {absl::StrCat("dp", index), replica, N}});
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> NewGlooGroups(
    const CommOptions& world, const std::vector<GroupMembership>& groups);

}  // namespace parallel
}  // namespace stallfree
