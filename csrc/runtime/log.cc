#include "runtime/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ejk {
namespace {

LogLevel ThresholdFromEnv() {
  const char* value = std::getenv("EJKERNEL_LOG_LEVEL");
  if (value == nullptr) return LogLevel::kWarning;
  if (std::strcmp(value, "debug") == 0) return LogLevel::kDebug;
  if (std::strcmp(value, "info") == 0) return LogLevel::kInfo;
  if (std::strcmp(value, "error") == 0) return LogLevel::kError;
  return LogLevel::kWarning;
}

}  // namespace

const char* LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "unknown";
}

bool LogEnabled(LogLevel level) {
  static const LogLevel threshold = ThresholdFromEnv();
  return static_cast<int>(level) >= static_cast<int>(threshold);
}

void Log(LogLevel level, const std::string& message) {
  if (!LogEnabled(level)) return;
  // One stdio call per line, so lines from concurrent threads do not interleave.
  std::fprintf(stderr, "ejkernel[%s]: %s\n", LogLevelName(level), message.c_str());
}

}  // namespace ejk
