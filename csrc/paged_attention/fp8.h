// float -> float8 e4m3fn, for quantising keys and values into an fp8 KV cache (host and
// device). The inverse, F8E4M3ToFloat, lives in runtime/tensor.h.
#pragma once

#include <cstdint>
#include <cstring>

#include "runtime/tensor.h"

namespace ejk::paged_attention {

// Round to nearest even, saturating: finite values beyond the largest e4m3fn magnitude
// (448) and infinities become +-448; NaN becomes the NaN pattern (0x7f, signed).
EJK_HOST_DEVICE uint8_t FloatToF8E4M3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7fu;     // NaN
  if (abs >= 0x43e00000u) return sign | 0x7eu;    // >= 448 (and inf): saturate
  if (abs >= 0x3c800000u) {                       // >= 2^-6: normal in e4m3
    // Drop 20 mantissa bits with round-to-nearest-even, then rebias the exponent
    // (127 -> 7); a carry out of the mantissa bumps the exponent, as it should.
    const uint32_t r = abs + 0x7ffffu + ((abs >> 20) & 1u);
    return sign | static_cast<uint8_t>((r >> 20) - (120u << 3));
  }
  // Subnormal in e4m3: a multiple of 2^-9. The value is m * 2^(e - 150) with the implicit
  // bit in m, so in units of 2^-9 it is m >> (141 - e).
  const uint32_t e = abs >> 23;
  const uint32_t shift = 141u - e;  // >= 21 here
  if (e == 0 || shift >= 25u) return sign;  // below 2^-10 (half the smallest step): 0
  const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // q == 8 is 2^-6, the smallest normal
  return sign | static_cast<uint8_t>(q);
}

}  // namespace ejk::paged_attention
