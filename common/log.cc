#include "common/log.h"

#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

#include "common/status.h"

namespace stallfree {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
const char* LevelName(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug: return "D";
    case LogLevel::kInfo: return "I";
    case LogLevel::kWarning: return "W";
    case LogLevel::kError: return "E";
  }
  return "?";
}
}  // namespace

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }
LogLevel GetLogLevel() { return static_cast<LogLevel>(g_level.load()); }

bool ParseLogLevel(const std::string& text, LogLevel* out) {
  if (text == "debug") *out = LogLevel::kDebug;
  else if (text == "info") *out = LogLevel::kInfo;
  else if (text == "warning") *out = LogLevel::kWarning;
  else if (text == "error") *out = LogLevel::kError;
  else return false;
  return true;
}

void LogLine(LogLevel level, const char* file, int line, const std::string& message) {
  struct timeval tv;
  gettimeofday(&tv, nullptr);
  struct tm tm;
  gmtime_r(&tv.tv_sec, &tm);
  const char* base = strrchr(file, '/');
  base = base ? base + 1 : file;
  std::string out = absl::StrFormat("%04d-%02d-%02dT%02d:%02d:%02d.%06ldZ %s %s:%d] %s\n",
                                    tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
                                    tm.tm_min, tm.tm_sec, static_cast<long>(tv.tv_usec),
                                    LevelName(level), base, line, message);
  ssize_t ignored = ::write(2, out.data(), out.size());
  (void)ignored;
}

absl::Status ErrnoStatus(const std::string& call, const std::string& object, int err) {
  std::string msg = absl::StrCat(call, "(", object, ") failed: ", strerror(err), " (errno ",
                                 err, ")");
  SF_LOG(kError, "%s", msg);
  if (err == ENOMEM || err == EAGAIN) return absl::ResourceExhaustedError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  if (err == ENOENT || err == ECONNREFUSED) return absl::UnavailableError(msg);
  return absl::InternalError(msg);
}

}  // namespace stallfree
