// Minimal leveled logging to stderr: "<time> <level> <file>:<line>] message".
// Thread safe: each line is written with one write(2).
#pragma once

#include <string>

#include "absl/strings/str_format.h"

namespace stallfree {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// Parses "debug", "info", "warning", "error"; false if unknown.
bool ParseLogLevel(const std::string& text, LogLevel* out);
// text (default): "2026-12-03T08:25:26.123456Z I file.cc:12] message"; json: one object a line,
// {"time": ..., "level": "info", "file": "file.cc", "line": 12, "message": ...}, for journald
// and log shippers.
enum class LogFormat { kText, kJson };
void SetLogFormat(LogFormat format);
bool ParseLogFormat(const std::string& text, LogFormat* out);
void LogLine(LogLevel level, const char* file, int line, const std::string& message);

}  // namespace stallfree

#define SF_LOG(level, ...)                                                        \
  do {                                                                            \
    if (::stallfree::LogLevel::level >= ::stallfree::GetLogLevel())               \
      ::stallfree::LogLine(::stallfree::LogLevel::level, __FILE__, __LINE__,      \
                           ::absl::StrFormat(__VA_ARGS__));                       \
  } while (0)
