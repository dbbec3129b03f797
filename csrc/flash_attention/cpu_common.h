// Building blocks of the CPU flash attention kernels (cpu_forward.cc, cpu_backward.cc):
// SIMD vectors, exp and tanh on them, the register-blocked GEMM micro-kernel, tile loads
// with dtype conversion, per-thread scratch, and the key range each query row may see.
//
// Vectors are GCC/Clang vector extensions sized to the widest ISA the build targets, so
// the same code compiles to AVX-512, AVX2 or SSE; the micro-kernel's register blocking
// follows the number of vector registers.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include "flash_attention/params.h"
#include "flash_attention/semantics.h"
#include "runtime/tensor.h"

namespace ejk::flash_attention::cpu {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kTileRows = 6;  // 6 x 4 accumulators + 4 B vectors + 1 broadcast of 32 registers
constexpr int kTileVecs = 4;
#elif defined(__AVX__)
constexpr int kLanes = 8;
constexpr int kTileRows = 6;  // 6 x 2 accumulators + 2 + 1 of 16 registers
constexpr int kTileVecs = 2;
#else
constexpr int kLanes = 4;
constexpr int kTileRows = 4;
constexpr int kTileVecs = 2;
#endif

typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t VecI __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t VecU __attribute__((vector_size(kLanes * sizeof(uint32_t))));

constexpr float kInf = std::numeric_limits<float>::infinity();

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Unaligned access through under-aligned vector types.
typedef float UnalignedF __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
typedef int32_t UnalignedI __attribute__((vector_size(kLanes * sizeof(int32_t)), aligned(4)));
typedef uint32_t UnalignedU __attribute__((vector_size(kLanes * sizeof(uint32_t)), aligned(4)));

inline VecF LoadF(const float* p) { return *reinterpret_cast<const UnalignedF*>(p); }
inline void StoreF(float* p, VecF v) { *reinterpret_cast<UnalignedF*>(p) = v; }
inline VecI LoadI(const int32_t* p) { return *reinterpret_cast<const UnalignedI*>(p); }
inline VecU LoadU(const uint32_t* p) { return *reinterpret_cast<const UnalignedU*>(p); }
// x - 0 is x for every x, so this folds to a plain broadcast (x + 0 would not: -0 + 0 = +0).
inline VecF Splat(float x) { return x - VecF{}; }
inline VecI SplatI(int32_t x) { return x + VecI{}; }
inline VecU SplatU(uint32_t x) { return x + VecU{}; }
inline VecI Iota() {
  VecI v;
  for (int i = 0; i < kLanes; ++i) v[i] = i;
  return v;
}

inline VecF Fma(VecF a, VecF b, VecF c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

// mask lanes are all ones or all zeros (vector comparison results).
inline VecF Select(VecI mask, VecF a, VecF b) { return mask ? a : b; }
inline VecF Max(VecF a, VecF b) { return a > b ? a : b; }
inline VecF Min(VecF a, VecF b) { return a < b ? a : b; }

// exp(x) within 1.5 ulp (1 with FMA): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-7 Taylor
// polynomial (truncation below 1e-8 relative), 2^n put into the exponent bits. Arguments
// below -86 give exactly 0 (the true value is under 3e-38, and -inf must give 0);
// arguments are capped at 88 (exp(88) < FLT_MAX).
inline VecF Exp(VecF x) {
  const VecF shifter = Splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const VecF xc = Min(Max(x, Splat(-86.0f)), Splat(88.0f));
  const VecF t = Fma(xc, Splat(1.44269504088896341f), shifter);
  const VecF n = t - shifter;
  VecF r = Fma(n, Splat(-0.693145751953125f), xc);  // ln2 split so n * ln2_hi is exact
  r = Fma(n, Splat(-1.42860682030941723e-6f), r);
  VecF p = Splat(1.0f / 5040.0f);
  p = Fma(p, r, Splat(1.0f / 720.0f));
  p = Fma(p, r, Splat(1.0f / 120.0f));
  p = Fma(p, r, Splat(1.0f / 24.0f));
  p = Fma(p, r, Splat(1.0f / 6.0f));
  p = Fma(p, r, Splat(0.5f));
  p = Fma(p, r, Splat(1.0f));
  p = Fma(p, r, Splat(1.0f));
  const VecI exponent = (reinterpret_cast<VecI>(t) - reinterpret_cast<VecI>(shifter)) << 23;
  const VecF y = reinterpret_cast<VecF>(reinterpret_cast<VecI>(p) + exponent);
  return Select(x < Splat(-86.0f), Splat(0.0f), y);
}

// tanh(x) within 3 ulp: an odd Taylor polynomial near 0 (where 1 - 2 / (e^2x + 1)
// cancels), the exp form elsewhere.
inline VecF Tanh(VecF x) {
  const VecI sign = SplatI(static_cast<int32_t>(0x80000000u));
  const VecF ax = reinterpret_cast<VecF>(reinterpret_cast<VecI>(x) & ~sign);
  const VecF e = Exp(Min(ax + ax, Splat(88.0f)));
  const VecF large = Splat(1.0f) - Splat(2.0f) / (e + Splat(1.0f));
  const VecF x2 = x * x;
  VecF p = Splat(-1382.0f / 155925.0f);
  p = Fma(p, x2, Splat(62.0f / 2835.0f));
  p = Fma(p, x2, Splat(-17.0f / 315.0f));
  p = Fma(p, x2, Splat(2.0f / 15.0f));
  p = Fma(p, x2, Splat(-1.0f / 3.0f));
  const VecF small = Fma(x * x2, p, x);
  const VecF signed_large =
      reinterpret_cast<VecF>(reinterpret_cast<VecI>(large) | (reinterpret_cast<VecI>(x) & sign));
  return Select(ax < Splat(0.3f), small, signed_large);
}


// --- GEMM micro-kernel ----------------------------------------------------------------
//
// C[m][n] (op)= sum_k A(m, k) * B[k][n], for m < M and n < NV * kLanes, where
// A(m, k) = A[m * sam + k * sak] (any strides: A is read by scalar broadcasts) and B and C
// are row-major with leading dimensions ldb, ldc (multiples of kLanes are not required).
// Each micro-tile keeps kTileRows x kTileVecs accumulators in registers over the whole
// k loop, so B rows are loaded once per kTileRows rows of C.
enum class Accumulate { kOverwrite, kAdd, kScaleAdd };  // kScaleAdd: C = C * colscale + A B

// The r and v loops are unrolled completely so that the accumulators live in registers.
template <int R, int V, Accumulate kMode>
void MicroTile(int64_t K, const float* __restrict A, int64_t sam, int64_t sak,
               const float* __restrict B, int64_t ldb, float* __restrict C, int64_t ldc,
               const float* __restrict colscale) {
  VecF acc[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      if (kMode == Accumulate::kOverwrite) {
        acc[r][v] = VecF{};
      } else {
        acc[r][v] = LoadF(C + r * ldc + v * kLanes);
        if (kMode == Accumulate::kScaleAdd) acc[r][v] *= LoadF(colscale + v * kLanes);
      }
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    const float* a = A + k * sak;
    VecF bv[V];
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) bv[v] = LoadF(b + v * kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const VecF av = Splat(a[r * sam]);
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) acc[r][v] = Fma(av, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) StoreF(C + r * ldc + v * kLanes, acc[r][v]);
  }
}

using MicroTileFn = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t,
                             float*, int64_t, const float*);

template <Accumulate kMode, int R, int... Vs>
constexpr std::array<MicroTileFn, sizeof...(Vs)> MicroTileRow(std::integer_sequence<int, Vs...>) {
  return {&MicroTile<R, Vs + 1, kMode>...};
}

template <Accumulate kMode, int... Rs>
constexpr std::array<std::array<MicroTileFn, kTileVecs>, sizeof...(Rs)> MicroTileTable(
    std::integer_sequence<int, Rs...>) {
  return {MicroTileRow<kMode, Rs + 1>(std::make_integer_sequence<int, kTileVecs>())...};
}

template <Accumulate kMode>
inline constexpr auto kMicroTiles =
    MicroTileTable<kMode>(std::make_integer_sequence<int, kTileRows>());

inline int64_t MicroTileCount(int64_t M, int64_t NV) {
  return (M + kTileRows - 1) / kTileRows * ((NV + kTileVecs - 1) / kTileVecs);
}

// Rows of up to three arrays to pull into cache a few lines at a time, between the
// micro-tiles of GEMMs: requested all at once, they would stall on full miss queues instead
// of overlapping with the arithmetic. (Rows of one head are strided by the other heads,
// which defeats the hardware prefetchers.)
class Prefetcher {
 public:
  void Add(const void* base, int64_t rows, int64_t stride_bytes, int64_t row_bytes) {
    if (rows > 0 && streams_ < 3) {
      stream_[streams_++] = {static_cast<const char*>(base), rows, stride_bytes, row_bytes};
      lines_left_ += rows * ((row_bytes + 63) / 64);
    }
  }
  // Spreads what was added over `steps` calls of Step.
  void Spread(int64_t steps) { per_step_ = (lines_left_ + steps - 1) / std::max<int64_t>(steps, 1); }
  void Step() {
    for (int64_t n = per_step_; n > 0 && current_ < streams_; --n) {
      Stream& s = stream_[current_];
      __builtin_prefetch(s.base + row_ * s.stride + offset_);
      offset_ += 64;
      if (offset_ >= s.row_bytes) {
        offset_ = 0;
        if (++row_ == s.rows) {
          row_ = 0;
          ++current_;
        }
      }
    }
  }

 private:
  struct Stream {
    const char* base;
    int64_t rows, stride, row_bytes;
  };
  Stream stream_[3] = {};
  int streams_ = 0, current_ = 0;
  int64_t lines_left_ = 0, per_step_ = 0, row_ = 0, offset_ = 0;
};

// `prefetch` (optional) takes one Step per micro-tile.
template <Accumulate kMode>
void Gemm(int64_t M, int64_t NV, int64_t K, const float* A, int64_t sam, int64_t sak,
          const float* B, int64_t ldb, float* C, int64_t ldc, const float* colscale = nullptr,
          Prefetcher* prefetch = nullptr) {
  for (int64_t v0 = 0; v0 < NV; v0 += kTileVecs) {
    const int nv = static_cast<int>(std::min<int64_t>(kTileVecs, NV - v0));
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int nr = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
      if (prefetch) prefetch->Step();
      kMicroTiles<kMode>[nr - 1][nv - 1](K, A + m0 * sam, sam, sak, B + v0 * kLanes, ldb,
                                         C + m0 * ldc + v0 * kLanes, ldc,
                                         colscale ? colscale + v0 * kLanes : nullptr);
    }
  }
}

// --- tensor access --------------------------------------------------------------------

inline float LoadScalar(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kBF16: return BF16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kF16: return F16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kF64: return static_cast<float>(static_cast<const double*>(base)[i]);
    default: return 0.0f;
  }
}

// n consecutive elements of `base` (dtype) from element `offset`, as f32.
inline void ConvertRow(const void* base, DType dtype, int64_t offset, int64_t n, float* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, static_cast<const float*>(base) + offset, n * sizeof(float));
      break;
    case DType::kBF16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
        std::memcpy(dst + i, &bits, sizeof(float));
      }
      break;
    }
    case DType::kF16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      int64_t i = 0;
#if defined(__F16C__)
      for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                      reinterpret_cast<const __m128i*>(src + i))));
      }
#endif
      for (; i < n; ++i) dst[i] = F16ToFloat(src[i]);
      break;
    }
    case DType::kF64: {
      const double* src = static_cast<const double*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
      break;
    }
    default: std::memset(dst, 0, n * sizeof(float));
  }
}

// dst[c] += t[offset + c] for c < n (a bias row).
inline void AddRow(const void* base, DType dtype, int64_t offset, int64_t n, float* dst,
                   float* tmp) {
  if (dtype == DType::kF32) {
    const float* src = static_cast<const float*>(base) + offset;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
    return;
  }
  ConvertRow(base, dtype, offset, n, tmp);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] += tmp[i];
}

// Rows [row, row + rows) of a [.., rows, cols] slice (row stride `stride`, first element at
// `offset`) as f32 into dst[r * ld + c], zero-filling columns [cols, ld).
inline void LoadRows(const TensorView& t, int64_t offset, int64_t stride, int64_t rows,
                     int64_t cols, float* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    ConvertRow(t.data, t.dtype, offset + r * stride, cols, dst + r * ld);
    std::fill(dst + r * ld + cols, dst + (r + 1) * ld, 0.0f);
  }
}

// The same rows transposed: dst[c * ld + r], columns zero-filled for r in [rows, ld).
inline void LoadRowsTransposed(const TensorView& t, int64_t offset, int64_t stride, int64_t rows,
                               int64_t cols, float* dst, int64_t ld, float* tmp) {
  for (int64_t r = 0; r < rows; ++r) {
    ConvertRow(t.data, t.dtype, offset + r * stride, cols, tmp);
    for (int64_t c = 0; c < cols; ++c) dst[c * ld + r] = tmp[c];
  }
  for (int64_t c = 0; c < cols; ++c) std::fill(dst + c * ld + rows, dst + (c + 1) * ld, 0.0f);
}

// dst[offset + c] = scale * src[c] for c < n, rounded to dtype (f32, bf16 or f16).
inline void StoreRow(const float* src, int64_t n, float scale, void* base, DType dtype,
                     int64_t offset) {
  switch (dtype) {
    case DType::kF32: {
      float* dst = static_cast<float*>(base) + offset;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * scale;
      break;
    }
    case DType::kBF16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBF16(src[i] * scale);
      break;
    }
    case DType::kF16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = FloatToF16(src[i] * scale);
      break;
    }
    default: break;
  }
}

// --- scratch and threads --------------------------------------------------------------

// A 64-byte aligned float array (rows of tiles start on cache lines).
class FloatBuffer {
 public:
  FloatBuffer() = default;
  explicit FloatBuffer(int64_t n) {
    const size_t bytes = static_cast<size_t>(RoundUp(std::max<int64_t>(n, 1) * 4, 64));
    data_.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    if (!data_) throw std::bad_alloc();
  }
  float* get() const { return data_.get(); }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
};

inline int NumThreads(const CpuConfig& cfg, int64_t tasks) {
#ifdef _OPENMP
  const int64_t n = cfg.num_threads > 0 ? cfg.num_threads : omp_get_max_threads();
#else
  const int64_t n = 1;
#endif
  return static_cast<int>(std::max<int64_t>(1, std::min(n, tasks)));
}

inline int ThreadIndex() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline Status CheckConfig(const CpuConfig& cfg) {
  if (cfg.block_q < 1 || cfg.block_k < 1 || cfg.num_threads < 0) {
    return Status::InvalidArgument(
        "config: block_q >= 1, block_k >= 1 and num_threads >= 0 required, got block_q=" +
        std::to_string(cfg.block_q) + " block_k=" + std::to_string(cfg.block_k) +
        " num_threads=" + std::to_string(cfg.num_threads));
  }
  return Status::Ok();
}

// --- visibility -----------------------------------------------------------------------

// The smallest and largest of n >= 1 segment ids. Two blocks whose ranges miss each other
// share no id (no query of one sees a key of the other); two of the same single id need no
// per-element test.
struct IdRange {
  int32_t lo, hi;
  bool Misses(IdRange o) const { return hi < o.lo || o.hi < lo; }
  bool SameSingleId(IdRange o) const { return lo == hi && o.lo == o.hi && lo == o.lo; }
};

inline IdRange IdRangeOf(const int32_t* ids, int64_t n) {
  const auto [lo, hi] = std::minmax_element(ids, ids + n);
  return {*lo, *hi};
}

// For every query row i (packed index with cu_seqlens): the keys [lo, hi) that causal,
// window and sequence packing leave visible (in the batch row's key array), and whether the
// row belongs to a sequence (rows past cu_seqlens_q[N] do not: no keys and no sink).
// Segment ids and the mask are checked per element on top of this.
struct RowRanges {
  std::vector<int32_t> lo, hi;
  std::vector<uint32_t> key_begin;  // the row's sequence's first key (dropout hashes keys from it)
  std::vector<uint8_t> real;
};

inline RowRanges ComputeRowRanges(const ForwardParams& p, const Dims& d) {
  RowRanges rr;
  rr.lo.assign(d.seqlen_q, 0);
  rr.hi.assign(d.seqlen_q, 0);
  rr.key_begin.assign(d.seqlen_q, 0);
  rr.real.assign(d.seqlen_q, 0);
  const int32_t* cu_q = d.varlen ? p.cu_seqlens_q.ptr<int32_t>() : nullptr;
  const int32_t* cu_k = d.varlen ? p.cu_seqlens_k.ptr<int32_t>() : nullptr;
  const int64_t num_seq = d.varlen ? d.num_sequences : 1;
  for (int64_t n = 0; n < num_seq; ++n) {
    const int64_t q_begin = d.varlen ? cu_q[n] : 0, q_end = d.varlen ? cu_q[n + 1] : d.seqlen_q;
    const int64_t k_begin = d.varlen ? cu_k[n] : 0, k_end = d.varlen ? cu_k[n + 1] : d.seqlen_k;
    const int64_t q_len = q_end - q_begin, k_len = k_end - k_begin;
    for (int64_t i = q_begin; i < q_end; ++i) {
      int64_t lo, hi;
      VisibleKeyRange(i - q_begin, k_len, k_len - q_len, p.causal, p.window_left, p.window_right,
                      &lo, &hi);
      rr.lo[i] = static_cast<int32_t>(k_begin + lo);
      rr.hi[i] = static_cast<int32_t>(k_begin + hi);
      rr.key_begin[i] = static_cast<uint32_t>(k_begin);
      rr.real[i] = 1;
    }
  }
  return rr;
}

}  // namespace ejk::flash_attention::cpu
