#include "runtime/tensor.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include <gtest/gtest.h>

namespace ejk {
namespace {

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

TEST(TensorViewTest, ContiguousStridesAndSizes) {
  float data[2 * 3 * 4];
  TensorView t = TensorView::Contiguous(data, DType::kF32, {2, 3, 4});
  EXPECT_EQ(t.rank, 3);
  EXPECT_EQ(t.strides[0], 12);
  EXPECT_EQ(t.strides[1], 4);
  EXPECT_EQ(t.strides[2], 1);
  EXPECT_EQ(t.NumElements(), 24);
  EXPECT_EQ(t.SizeBytes(), 96);
  EXPECT_TRUE(t.IsContiguous());
  EXPECT_TRUE(t.present());
  EXPECT_EQ(t.ToString(), "float32[2,3,4]");
  EXPECT_EQ(t.ptr<float>(), data);
}

TEST(TensorViewTest, AbsentAndOverRank) {
  TensorView absent;
  EXPECT_FALSE(absent.present());
  int64_t shape[kMaxRank + 1] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  TensorView too_big = TensorView::Contiguous(nullptr, DType::kF32, shape, kMaxRank + 1);
  EXPECT_EQ(too_big.rank, -1);
  EXPECT_FALSE(CheckTensor(too_big, "x", kMaxRank + 1, {DType::kF32}).ok());
}

TEST(TensorViewTest, NonContiguousDetected) {
  float data[8];
  TensorView t = TensorView::Contiguous(data, DType::kF32, {2, 4});
  t.strides[0] = 8;  // a row-padded layout
  EXPECT_FALSE(t.IsContiguous());
  // Size-1 dimensions may carry any stride.
  TensorView u = TensorView::Contiguous(data, DType::kF32, {1, 8});
  u.strides[0] = 123;
  EXPECT_TRUE(u.IsContiguous());
}

TEST(TensorViewTest, DTypeNamesAndSizes) {
  EXPECT_STREQ(DTypeName(DType::kBF16), "bfloat16");
  EXPECT_STREQ(DTypeName(DType::kF16), "float16");
  EXPECT_EQ(DTypeSize(DType::kF64), 8);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2);
  EXPECT_EQ(DTypeSize(DType::kBool), 1);
  EXPECT_TRUE(IsFloating(DType::kBF16));
  EXPECT_FALSE(IsFloating(DType::kI32));
}

TEST(TensorViewTest, DTypeFromNameInvertsDTypeName) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kF64, DType::kI32, DType::kI64, DType::kU32,
                  DType::kU8, DType::kBool, DType::kF8E4M3}) {
    DType parsed = DType::kBool;
    ASSERT_TRUE(DTypeFromName(DTypeName(d), &parsed)) << DTypeName(d);
    EXPECT_EQ(parsed, d);
  }
  DType untouched = DType::kI32;
  EXPECT_FALSE(DTypeFromName("float8_e5m2", &untouched));
  EXPECT_EQ(untouched, DType::kI32);
}

TEST(TensorViewTest, CheckTensorMessagesNameTheArgument) {
  uint16_t data[6];
  TensorView t = TensorView::Contiguous(data, DType::kBF16, {2, 3});
  EXPECT_TRUE(CheckTensor(t, "query", 2, {DType::kF32, DType::kBF16}).ok());

  Status rank = CheckTensor(t, "query", 4, {DType::kBF16});
  EXPECT_EQ(rank.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rank.message().find("query"), std::string::npos);
  EXPECT_NE(rank.message().find("bfloat16[2,3]"), std::string::npos);

  Status dtype = CheckTensor(t, "key", 2, {DType::kF32});
  EXPECT_NE(dtype.message().find("key"), std::string::npos);
  EXPECT_NE(dtype.message().find("float32"), std::string::npos);

  TensorView no_data = TensorView::Contiguous(nullptr, DType::kBF16, {2, 3});
  EXPECT_FALSE(CheckTensor(no_data, "value", 2, {DType::kBF16}).ok());
  TensorView empty = TensorView::Contiguous(nullptr, DType::kBF16, {0, 3});
  EXPECT_TRUE(CheckTensor(empty, "value", 2, {DType::kBF16}).ok());
}

// Every 16-bit pattern survives 16 -> f32 -> 16 (NaNs stay NaN).
TEST(HalfFloatTest, Bf16RoundTripsEveryPattern) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = BF16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(f)))) << h;
    } else {
      ASSERT_EQ(FloatToBF16(f), h) << h;
    }
  }
}

TEST(HalfFloatTest, F16RoundTripsEveryPattern) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = F16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(f)))) << h;
    } else {
      ASSERT_EQ(FloatToF16(f), h) << h;
    }
  }
}

TEST(HalfFloatTest, KnownValues) {
  EXPECT_EQ(FloatToF16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToF16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(F16ToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(FloatToBF16(1.0f), 0x3f80);
  EXPECT_EQ(BF16ToFloat(0xc040), -3.0f);
  EXPECT_EQ(FloatToF16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBF16(-0.0f), 0x8000);
}

TEST(HalfFloatTest, RoundsToNearestEven) {
  // bf16 keeps 7 fraction bits: ulp(1) = 2^-7, so 2^-8 is a tie.
  EXPECT_EQ(BF16ToFloat(FloatToBF16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  EXPECT_EQ(BF16ToFloat(FloatToBF16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_EQ(BF16ToFloat(FloatToBF16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20))),
            1.0f + std::ldexp(1.0f, -7));
  // f16 keeps 10 fraction bits: ulp(1) = 2^-10.
  EXPECT_EQ(F16ToFloat(FloatToF16(1.0f + std::ldexp(1.0f, -11))), 1.0f);
  EXPECT_EQ(F16ToFloat(FloatToF16(1.0f + 3 * std::ldexp(1.0f, -11))), 1.0f + std::ldexp(1.0f, -9));
  // Overflow: 65520 is the tie between 65504 and 2^16, which rounds to inf.
  EXPECT_EQ(F16ToFloat(FloatToF16(65519.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(F16ToFloat(FloatToF16(65520.0f))));
  EXPECT_EQ(FloatToF16(-1e10f), 0xfc00);
  EXPECT_EQ(FloatToBF16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
  // Subnormals: 2^-25 is the tie between 0 and the smallest subnormal.
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(FloatToF16(1.5f * std::ldexp(1.0f, -25)), 0x0001);
  EXPECT_EQ(FloatToF16(3 * std::ldexp(1.0f, -25)), 0x0002);  // tie 1.5 ulp -> even 2
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -26)), 0x0000);
  EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(FromBits(0x7f800001u)))));  // signalling NaN
}

// Round-to-nearest-even reference in double: scale to units of the target ulp and let
// nearbyint (default mode: ties to even) round.
double RoundReference(double a, int fraction_bits, int min_exponent, double overflow_at) {
  if (a == 0.0 || std::isinf(a)) return a;
  const int exponent = std::max(static_cast<int>(std::floor(std::log2(a))), min_exponent);
  const double ulp = std::ldexp(1.0, exponent - fraction_bits);
  const double rounded = std::nearbyint(a / ulp) * ulp;
  return rounded >= overflow_at ? std::numeric_limits<double>::infinity() : rounded;
}

TEST(HalfFloatTest, RandomFloatsMatchReferenceRounding) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<uint32_t> bits;
  // Half the samples have exponents around the f16 range, where its rounding is exercised.
  std::uniform_int_distribution<uint32_t> near_f16_exponent(127 - 30, 127 + 17);
  for (int i = 0; i < 400000; ++i) {
    uint32_t u = bits(rng);
    if (i % 2 == 0) u = (u & 0x807fffffu) | (near_f16_exponent(rng) << 23);
    const float f = FromBits(u);
    if (std::isnan(f)) continue;
    const double a = std::fabs(static_cast<double>(f));
    const double sign = std::signbit(f) ? -1.0 : 1.0;

    const double f16_ref = sign * RoundReference(a, 10, -14, 65536.0);
    ASSERT_EQ(static_cast<double>(F16ToFloat(FloatToF16(f))), f16_ref) << "f16 of " << f;

    const double bf16_ref = sign * RoundReference(a, 7, -126, std::ldexp(1.0, 128));
    ASSERT_EQ(static_cast<double>(BF16ToFloat(FloatToBF16(f))), bf16_ref) << "bf16 of " << f;
  }
}

}  // namespace
}  // namespace ejk

namespace ejk {
namespace {

TEST(TensorViewTest, EmptyContiguousViewPassesChecks) {
  float dummy = 0.0f;
  const TensorView empty = TensorView::Contiguous(&dummy, DType::kF32, {2, 0, 3});
  EXPECT_TRUE(empty.IsContiguous());
  EXPECT_TRUE(CheckTensor(empty, "empty", 3, {DType::kF32}).ok());
}

}  // namespace
}  // namespace ejk
