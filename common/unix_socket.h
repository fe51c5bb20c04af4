// Unix-domain socket helpers: listen/connect, peer credentials, and fd passing (SCM_RIGHTS).
// All functions return errors naming the call, the path or fd, and errno.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace stallfree {

// Creates a listening SOCK_STREAM socket at `path` (an existing stale socket file is removed),
// with permissions `mode`. Returns the fd (CLOEXEC).
absl::StatusOr<int> ListenUnix(const std::string& path, int mode = 0666);
// Connects to `path`. Returns the fd (CLOEXEC).
absl::StatusOr<int> ConnectUnix(const std::string& path);
// SO_PEERCRED of a connected socket.
absl::StatusOr<struct ucred> PeerCredentials(int sock);
// Sends `message` and, if fd >= 0, the descriptor as SCM_RIGHTS ancillary data.
absl::Status SendWithFd(int sock, const std::string& message, int fd);
// Sends `message` and the descriptors `fds` (none: a plain message) in one SCM_RIGHTS.
absl::Status SendWithFds(int sock, const std::string& message, const std::vector<int>& fds);
// Receives up to `max_bytes` of message and at most one descriptor (-1 if none was sent).
absl::Status RecvWithFd(int sock, size_t max_bytes, std::string* message, int* fd);
// Receives up to `max_bytes` of message and at most `max_fds` descriptors (in the order sent;
// the caller owns them). More descriptors than that: every one received is closed, and an
// InvalidArgument names the count.
absl::Status RecvWithFds(int sock, size_t max_bytes, std::string* message, std::vector<int>* fds,
                         size_t max_fds);
// Reads one '\n'-terminated line (without the newline), at most max_bytes, and the
// descriptors sent with it (SCM_RIGHTS), at most max_fds in all, in the order sent, into *fds
// (the caller owns them); on any error every one received is closed and *fds is empty.
absl::StatusOr<std::string> ReadLineWithFds(int sock, size_t max_bytes, std::vector<int>* fds,
                                            size_t max_fds);
// True if the peer of the connected socket `sock` has closed its end (or the connection broke),
// without waiting and without consuming data: for a connection on which the peer sends nothing
// more, such as a session's connection to the daemon's fd socket (the daemon's process going
// away closes it).
bool PeerClosed(int sock);

}  // namespace stallfree
