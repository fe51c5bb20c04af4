// NCCL backend of parallel::Communicator: buffers are device pointers on `device`; every
// operation is enqueued on one CUDA stream and completes asynchronously.
//
// Creation: rank 0 makes an ncclUniqueId and broadcasts its 128 bytes (as 32 floats) through
// `bootstrap`, any communicator of the same group (typically the Gloo one, CPU); the NCCL group
// has bootstrap->rank() / bootstrap->size(). This is a collective over `bootstrap`.
//
// Differences from the common semantics in communicator.h:
// - Point to point: NCCL matches a send and a recv by their order per peer pair, not by tag.
//   Tags are range-checked (0 <= tag < 2^20) but never compared; sends to one peer must be
//   issued in the same order as the peer issues the matching recvs. ISend/IRecv are batched:
//   consecutive ISend/IRecv calls are held and issued as one NCCL group when the next
//   collective is issued, Barrier() runs, or any of their Works is waited on. So the usual
//   exchange `ISend(next); IRecv(prev); Wait; Wait` makes progress on every rank.
// - Work::Wait() waits for the operation's CUDA event, polling ncclCommGetAsyncError; after
//   `timeout` without completion (counted from the Wait call) or on an asynchronous NCCL error
//   the communicator is aborted (ncclCommAbort) and Wait returns DEADLINE_EXCEEDED or
//   UNAVAILABLE naming the operation and rank; every later call fails at once. The
//   communicator is non-blocking (ncclConfig_t::blocking = 0), so initialisation and
//   connection setup are bounded by `timeout` too.
// - Counters are the ring algorithm's volume per rank, not what NCCL's chosen algorithm (tree,
//   NVLS, ...) moved: all-reduce 2(D-1)/D * N * 4 bytes sent and received; all-gather and
//   reduce-scatter (D-1)/D * total * 4; broadcast and reduce as a ring pipeline (every rank
//   but the chain's last sends N * 4, every rank but its first receives N * 4); send/recv exact;
//   barrier an all-reduce of one float.
//
// Thread safety: all methods may be called from any thread (a mutex orders issue); one thread
// issuing gives the documented issue order. Works may outlive the communicator.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"

namespace stallfree {
namespace parallel {

// `stream` is the cudaStream_t the operations run on (not owned); nullptr: the communicator
// creates (and owns) a non-blocking stream on `device`; it does not synchronise with the legacy
// default stream, so data written by other streams (or by cudaMemcpy, which may return before a
// pageable copy reaches the device) must be made ready first, e.g. cudaDeviceSynchronize or an
// event. `bootstrap` is used only during this call.
absl::StatusOr<std::unique_ptr<Communicator>> NewNcclCommunicator(
    Communicator* bootstrap, int device, void* stream,
    std::chrono::milliseconds timeout = std::chrono::seconds(60));

// True if the CUDA driver works and at least `needed_devices` devices are visible; otherwise
// false with the reason in *why (if non-null).
bool NcclDeviceAvailable(int needed_devices, std::string* why);

}  // namespace parallel
}  // namespace stallfree
