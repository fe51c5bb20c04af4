// FdStore: stallfreed's side of systemd's file-descriptor store (sd_pid_notify_with_fds(3),
// FDSTORE=1; sd_listen_fds_with_names(3)). While a session lives, the service manager holds a
// copy of its region's and state's memfds, so that a daemon started again after a crash or a
// restart gets every session's state at once, before the sessions' processes re-attach: it
// finishes the work the daemon before it was cut short in (the work journal) then, and holds
// the state for them a while (SessionManager::HoldStored). The unit needs
// FileDescriptorStoreMax= (deploy/stallfreed.service). Without $NOTIFY_SOCKET every call is a
// no-op. Thread safe.
//
// A session's descriptors are named after its key, its state memfd's inode (unique while the
// memfd lives; SessionManager::FdKey): "stallfree-<key>-state" and "stallfree-<key>-region".
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace stallfree {

class FdStore {
 public:
  // Whether a service manager listens ($NOTIFY_SOCKET).
  static bool Available();

  // Hands copies of the session's two memfds to the service manager.
  static void Keep(const std::string& key, int state_fd, int region_fd);
  // Tells it to close them (the session is closed for good).
  static void Drop(const std::string& key);

  struct Stored {
    std::string key;
    int state_fd = -1, region_fd = -1;  // owned by the taker
  };
  // The sessions' descriptors the service manager passed this process at start
  // ($LISTEN_FDS, $LISTEN_FDNAMES); any other passed descriptor is closed. Once per process.
  static std::vector<Stored> TakeStored();
};

}  // namespace stallfree
