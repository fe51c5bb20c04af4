// Spawn: a shell command in the background, in its own process group, for tests and benchmarks
// that kill what they start (a daemon, a trainer, a session holder). Returns its pid (reap it
// with waitpid).
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <string>

namespace stallfree {
namespace testing {

inline pid_t Spawn(const std::string& cmd) {
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

}  // namespace testing
}  // namespace stallfree
