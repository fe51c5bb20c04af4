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
std::atomic<int> g_format{static_cast<int>(LogFormat::kText)};

const char* LevelWord(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "?";
}

// A JSON string literal of s (quotes, backslashes and control characters escaped).
std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out + "\"";
}
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
void SetLogFormat(LogFormat format) { g_format.store(static_cast<int>(format)); }

bool ParseLogFormat(const std::string& text, LogFormat* out) {
  if (text == "text") *out = LogFormat::kText;
  else if (text == "json") *out = LogFormat::kJson;
  else return false;
  return true;
}
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
  const std::string time = absl::StrFormat(
      "%04d-%02d-%02dT%02d:%02d:%02d.%06ldZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
      tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<long>(tv.tv_usec));
  std::string out =
      static_cast<LogFormat>(g_format.load()) == LogFormat::kJson
          ? absl::StrFormat("{\"time\": \"%s\", \"level\": \"%s\", \"file\": %s, \"line\": %d, "
                            "\"message\": %s}\n",
                            time, LevelWord(level), JsonString(base), line, JsonString(message))
          : absl::StrFormat("%s %s %s:%d] %s\n", time, LevelName(level), base, line, message);
  ssize_t ignored = ::write(2, out.data(), out.size());
  (void)ignored;
}

absl::Status ErrnoStatus(const std::string& call, const std::string& object, int err) {
  std::string msg = absl::StrCat(call, "(", object, ") failed: ", strerror(err), " (errno ",
                                 err, ")");
  SF_LOG(kError, "%s", msg);
  if (err == ENOMEM || err == EAGAIN) return absl::ResourceExhaustedError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == ECONNREFUSED || err == ECONNRESET || err == EPIPE || err == ENOTCONN)
    return absl::UnavailableError(msg);
  return absl::InternalError(msg);
}

}  // namespace stallfree
