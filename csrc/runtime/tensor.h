// Non-owning tensor views: a data pointer, a dtype, a shape and strides (in elements).
// Every kernel takes TensorViews; nothing here allocates.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>

#include "runtime/status.h"

#if defined(__CUDACC__)
#define EJK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define EJK_HOST_DEVICE inline
#endif

namespace ejk {

// kF8E4M3: float8 e4m3fn (no infinities, one NaN pattern), the usual quantised KV-cache type.
enum class DType : int32_t { kF32 = 0, kF16, kBF16, kF64, kI32, kI64, kU32, kU8, kBool, kF8E4M3 };

const char* DTypeName(DType dtype);
// The dtype DTypeName calls `name`; false (out untouched) for any other name.
bool DTypeFromName(const std::string& name, DType* out);
int64_t DTypeSize(DType dtype);
inline bool IsFloating(DType d) {
  return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16 || d == DType::kF64;
}

constexpr int kMaxRank = 8;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int rank = 0;
  int64_t shape[kMaxRank] = {};
  int64_t strides[kMaxRank] = {};  // in elements, not bytes

  // A contiguous (row-major) view. Rank above kMaxRank yields rank -1, which
  // every validator rejects.
  static TensorView Contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape);
  static TensorView Contiguous(void* data, DType dtype, const int64_t* shape, int rank);

  // Optional operands that are absent are default-constructed views (rank 0).
  EJK_HOST_DEVICE bool present() const { return rank > 0; }
  EJK_HOST_DEVICE int64_t dim(int i) const { return shape[i]; }
  int64_t NumElements() const;
  int64_t SizeBytes() const { return NumElements() * DTypeSize(dtype); }
  bool IsContiguous() const;
  // "f32[2,128,8,64]"
  std::string ToString() const;

  template <typename T>
  EJK_HOST_DEVICE T* ptr() const {
    return static_cast<T*>(data);
  }
};

// Checks rank, dtype membership and contiguity; `name` appears in the message.
Status CheckTensor(const TensorView& t, const char* name, int rank,
                   std::initializer_list<DType> allowed_dtypes);

// --- 16-bit float conversions (host and device) ---------------------------

EJK_HOST_DEVICE float BF16ToFloat(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even; NaN stays NaN.
EJK_HOST_DEVICE uint16_t FloatToBF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

EJK_HOST_DEVICE float F16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      u = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even, with overflow to inf and gradual underflow.
EJK_HOST_DEVICE uint16_t FloatToF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {  // subnormal or zero in f16
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t exp = abs >> 23;
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp;  // 14 + (113 - exp)
    uint32_t half_mant = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_mant & 1u))) ++half_mant;
    return static_cast<uint16_t>(sign | half_mant);
  }
  uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((r - (112u << 23)) >> 13));
}

// float8 e4m3fn -> float: 1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7f/0xff are NaN.
EJK_HOST_DEVICE float F8E4M3ToFloat(uint8_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x80u) << 24;
  const uint32_t exp = (bits >> 3) & 0xfu;
  const uint32_t mant = bits & 0x7u;
  uint32_t u;
  if (exp == 0xfu && mant == 0x7u) {
    u = sign | 0x7fc00000u;
  } else if (exp == 0) {  // zero or subnormal: mant * 2^-9
    float f = static_cast<float>(mant) * 0.001953125f;
    return sign ? -f : f;
  } else {
    u = sign | ((exp + 127 - 7) << 23) | (mant << 20);
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace ejk
