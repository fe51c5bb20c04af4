#include "server/fd_store.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <map>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace stallfree {
namespace {

constexpr char kPrefix[] = "stallfree-";
constexpr char kState[] = "-state";
constexpr char kRegion[] = "-region";

// The FDNAME of a session's memfd: "stallfree-<key>-state" or "-region".
std::string Name(const std::string& key, const char* part) {
  return absl::StrCat(kPrefix, key, part);
}

void Send(const std::string& state, int* fds, unsigned n, const std::string& what) {
  const int r = sd_pid_notify_with_fds(0, 0, state.c_str(), fds, n);
  if (r < 0)
    SF_LOG(kWarning, "the service manager's fd store: %s failed: %s (errno %d)", what,
           strerror(-r), -r);
}

}  // namespace

bool FdStore::Available() {
  const char* s = getenv("NOTIFY_SOCKET");
  return s != nullptr && *s != '\0';
}

void FdStore::Keep(const std::string& key, int state_fd, int region_fd) {
  if (!Available() || key.empty()) return;
  int fds[2] = {state_fd, region_fd};
  const char* parts[2] = {kState, kRegion};
  for (int i = 0; i < 2; ++i)
    Send(absl::StrCat("FDSTORE=1\nFDNAME=", Name(key, parts[i])), &fds[i], 1,
         absl::StrCat("keeping ", Name(key, parts[i])));
}

void FdStore::Drop(const std::string& key) {
  if (!Available() || key.empty()) return;
  for (const char* part : {kState, kRegion})
    Send(absl::StrCat("FDSTOREREMOVE=1\nFDNAME=", Name(key, part)), nullptr, 0,
         absl::StrCat("dropping ", Name(key, part)));
}

std::vector<FdStore::Stored> FdStore::TakeStored() {
  char** names = nullptr;
  const int n = sd_listen_fds_with_names(/*unset_environment=*/1, &names);
  std::vector<Stored> out;
  if (n <= 0) {
    if (n < 0) SF_LOG(kWarning, "sd_listen_fds_with_names failed: %s", strerror(-n));
    return out;
  }
  std::map<std::string, Stored> by_key;
  for (int i = 0; i < n; ++i) {
    const int fd = SD_LISTEN_FDS_START + i;
    const std::string name = names != nullptr && names[i] != nullptr ? names[i] : "";
    std::string key = name;
    bool state = false, known = absl::StartsWith(key, kPrefix);
    if (known) {
      key = key.substr(strlen(kPrefix));
      state = absl::EndsWith(key, kState);
      known = state || absl::EndsWith(key, kRegion);
      if (known) key = key.substr(0, key.size() - strlen(state ? kState : kRegion));
      uint64_t ino;
      known = known && absl::SimpleAtoi(key, &ino);
    }
    if (!known) {
      SF_LOG(kWarning, "descriptor %d passed by the service manager ('%s') is not a session's; "
             "closed", fd, name);
      close(fd);
      continue;
    }
    Stored& s = by_key[key];
    s.key = key;
    int& slot = state ? s.state_fd : s.region_fd;
    if (slot >= 0) close(slot);
    slot = fd;
  }
  if (names != nullptr) {
    for (int i = 0; i < n; ++i) free(names[i]);
    free(names);
  }
  for (auto& [key, s] : by_key) {
    if (s.state_fd < 0 || s.region_fd < 0) {
      SF_LOG(kWarning, "session %s: the service manager passed only its %s; dropped", key,
             s.state_fd >= 0 ? "state" : "region");
      if (s.state_fd >= 0) close(s.state_fd);
      if (s.region_fd >= 0) close(s.region_fd);
      Drop(key);
      continue;
    }
    out.push_back(s);
  }
  return out;
}

}  // namespace stallfree
