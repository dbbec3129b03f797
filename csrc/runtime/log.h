// Diagnostics on stderr, filtered by EJKERNEL_LOG_LEVEL (debug|info|warning|error;
// default warning).
#pragma once

#include <string>

namespace ejk {

enum class LogLevel { kDebug, kInfo, kWarning, kError };

const char* LogLevelName(LogLevel level);

// Whether messages at `level` are printed; the threshold is read from the environment once.
bool LogEnabled(LogLevel level);

// Prints "ejkernel[<level>]: <message>" to stderr when `level` passes the threshold.
void Log(LogLevel level, const std::string& message);

}  // namespace ejk
