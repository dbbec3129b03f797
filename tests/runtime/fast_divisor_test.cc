#include "runtime/fast_divisor.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace ejk {
namespace {

constexpr int32_t kMaxInt = std::numeric_limits<int32_t>::max();

void ExpectExact(const FastDivisor& f, int32_t n) {
  ASSERT_EQ(f.Div(n), n / f.divisor) << n << " / " << f.divisor;
  ASSERT_EQ(f.Mod(n), n % f.divisor) << n << " % " << f.divisor;
}

// Every dividend below 2^16 and the numerators next to multiples of d, for the small
// divisors kernels meet (heads, blocks, pairs) and every power of two.
TEST(FastDivisorTest, SmallDivisorsExhaustiveAndAtMultiples) {
  std::vector<int32_t> divisors;
  for (int32_t d = 1; d <= 1000; ++d) divisors.push_back(d);
  for (int s = 0; s < 31; ++s) {
    const int32_t p = int32_t{1} << s;
    for (int32_t d : {p - 1, p, p + 1}) {
      if (d >= 1) divisors.push_back(d);
    }
  }
  divisors.push_back(kMaxInt);
  for (int32_t d : divisors) {
    const FastDivisor f(d);
    if (d <= 64) {
      for (int32_t n = 0; n < (1 << 16); ++n) ExpectExact(f, n);
    }
    for (int64_t q : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{kMaxInt} / d - 1, int64_t{kMaxInt} / d}) {
      for (int64_t delta = -1; delta <= 1; ++delta) {
        const int64_t n = q * d + delta;
        if (n >= 0 && n <= kMaxInt) ExpectExact(f, static_cast<int32_t>(n));
      }
    }
    ExpectExact(f, 0);
    ExpectExact(f, kMaxInt);
  }
}

TEST(FastDivisorTest, RandomDivisorsAndDividends) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int32_t> any(0, kMaxInt);
  for (int i = 0; i < 2000; ++i) {
    // Divisors spread over every magnitude, not only near 2^31.
    const int32_t d = std::max<int32_t>(1, any(rng) >> (rng() % 31));
    const FastDivisor f(d);
    for (int j = 0; j < 200; ++j) ExpectExact(f, any(rng));
  }
}

TEST(FastDivisorTest, DefaultDividesByOne) {
  const FastDivisor f;
  EXPECT_EQ(f.divisor, 1);
  ExpectExact(f, 0);
  ExpectExact(f, 12345);
  ExpectExact(f, kMaxInt);
}

}  // namespace
}  // namespace ejk
