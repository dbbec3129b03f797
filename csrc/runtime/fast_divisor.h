// Division by a divisor known at launch: a multiply-high, an add and a shift, instead of the
// conversion and reciprocal chain of a runtime integer division (about 200 cycles of latency
// per division on H100, where a kernel decodes its tile indices once per tile).
#pragma once

#include <cstdint>

#include "runtime/tensor.h"  // EJK_HOST_DEVICE

namespace ejk {

// n / d and n % d for 0 <= n < 2^31 and 1 <= d < 2^31 (Granlund and Montgomery's method with
// a 33-bit quotient estimate: shift = ceil(log2 d), multiplier = floor(2^32 (2^shift - d) / d) + 1;
// the add cannot overflow because the high half of n * multiplier is at most n < 2^31).
struct FastDivisor {
  int32_t divisor = 1;
  uint32_t multiplier = 1;
  uint32_t shift = 0;

  FastDivisor() = default;
  explicit FastDivisor(int32_t d) : divisor(d) {
    while (shift < 31 && (uint32_t{1} << shift) < static_cast<uint32_t>(d)) ++shift;
    const uint64_t excess = (uint64_t{1} << shift) - static_cast<uint64_t>(d);
    multiplier = static_cast<uint32_t>((excess << 32) / static_cast<uint64_t>(d) + 1);
  }

  EJK_HOST_DEVICE int32_t Div(int32_t n) const {
    const uint32_t u = static_cast<uint32_t>(n);
#if defined(__CUDA_ARCH__)
    const uint32_t high = __umulhi(u, multiplier);
#else
    const uint32_t high = static_cast<uint32_t>((static_cast<uint64_t>(u) * multiplier) >> 32);
#endif
    return static_cast<int32_t>((high + u) >> shift);
  }
  EJK_HOST_DEVICE int32_t Mod(int32_t n) const { return n - Div(n) * divisor; }
};

}  // namespace ejk
