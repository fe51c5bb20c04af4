// When stallfreed goes away mid-run: how a rank tells that a failed daemon call means the daemon
// is gone (IsDaemonLoss), how the ranks agree on it (AgreeOnDaemon), and what RunRank does next
// (WaitForDaemon, then a resume from the last checkpoint; or DaemonGone, the error that says how
// to continue by hand).
//
// Internal to the trainer. AgreeOnDaemon is collective; the rest is per rank.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "client/client.h"
#include "trainer/gpt.h"
#include "trainer/world.h"

namespace stallfree {
namespace trainer {

// Where a run stands for recovery: the newest checkpoint every rank holds.
struct Progress {
  std::string checkpoint;  // its tag ("" before the first)
  int64_t checkpoint_step = 0;
  bool daemon_lost = false;  // the attempt ended because every rank agreed the daemon was gone
};

// This rank's link to stallfreed: both null in no-offload mode (no daemon to lose).
struct DaemonLink {
  Client* client = nullptr;
  const Session* session = nullptr;
};

// Whether `st`, the result of a call that involved the daemon, means the daemon went away (or
// came back without this rank's session). Decided by status code, never by message text:
//   - UNAVAILABLE: what client/client.cc returns when the transport cannot reach stallfreed
//     (Connect, a dropped or refused connection: gRPC's own code passed through FromGrpc), and
//     what the daemon answers while it shuts down;
//   - NOT_FOUND: what the daemon answers for a session it no longer has (closed, reclaimed, or a
//     restarted daemon that never had it), and ABORTED: what a call waiting on that session
//     (WaitUpdate) gets when it is closed or reclaimed meanwhile.
// The same codes also mean other things (NOT_FOUND: a checkpoint tag the daemon does not hold,
// a file of this rank's that is missing; ABORTED: an update still running; UNAVAILABLE: any
// other peer that refuses a connection), so a candidate is confirmed by asking the daemon: it is a
// loss if stallfreed does not answer ListSessions, or answers without this rank's session (its id,
// opened by this process). A session that registered no parameters is never listed (the daemon
// lists attached sessions), so for it only an unanswered ListSessions counts. Without a daemon
// link: never.
bool IsDaemonLoss(const absl::Status& st, const DaemonLink& daemon);

// Collective: st is this rank's result of a daemon call. If any rank lost the daemon, every rank
// marks progress->daemon_lost and returns UNAVAILABLE (RunRank then waits for the daemon or
// explains how to resume); otherwise this rank's own st.
absl::Status AgreeOnDaemon(const World& world, const DaemonLink& daemon, Progress* progress,
                           absl::Status st);

// Waits up to `seconds` for a daemon that answers SERVING at `socket`; its last answer if none.
absl::Status WaitForDaemon(const std::string& socket, int64_t seconds);

// The error of a run whose daemon is gone for good: the socket, the last checkpoint and the
// command that continues from it (UNAVAILABLE).
absl::Status DaemonGone(const TrainOptions& o, const Progress& p, const absl::Status& cause,
                        const std::string& why);

}  // namespace trainer
}  // namespace stallfree
