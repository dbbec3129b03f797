// Formatting shared by validation messages.
#pragma once

#include <cstdio>
#include <string>

namespace ejk {

// Shortest "%g" form: 0.125, 1e-06, inf, nan.
inline std::string FormatFloat(float x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(x));
  return buf;
}

}  // namespace ejk
