// Paged attention kernels (params.h semantics) for NVIDIA GPUs, sm_80 and later.
//
// Work unit: a query tile of one sequence and one kv head, i.e. a run of rows of the
// flattened (query position, q head of the GQA group) space, against one split of the
// tile's visible keys. Each K/V page is read once per tile for every q head of the group.
// One launch serves a ragged batch with two tile shapes:
//   - "small" tiles of 16 rows take the whole sequence when q_len * group <= 16 (decode,
//     short speculative steps); their four warps split each 64-key block between them,
//     so a decode step streams K/V at full rate with tensor-core math;
//   - "large" tiles of 64 rows (32 for head_dim 256) take longer sequences (prefill
//     chunks); each warp owns 16 rows against every key of the block, and blocks outside
//     the causal frontier and the window are skipped.
// The 1-D grid covers both from static shapes (no host sync): one small tile per (sequence,
// kv head, split) first, then the large tiles, numbered per sequence (LargeTileStart) and
// found on the device by a warp-wide search of query_start_loc. A block whose tile belongs
// to the other shape or to no sequence exits at once; every block then zeroes its share of
// the rows no sequence owns.
//
// K/V blocks of 64 keys stream through a multi-stage cp.async pipeline (16-byte copies,
// page ids fetched one block ahead); scores and outputs use mma.sync m16n8k16 (bf16 or f16
// operands, fp32 accumulation) and an fp32 online softmax in base 2. fp8 caches are staged
// as bytes and widened to f16 fragments in registers (exact: every e4m3 value, times 2^-8,
// is an f16); k_scale folds into the logit scale and v_scale into the output. The tensor
// cores take q as it is (bf16 or f16 with a cache of its dtype; bf16 q with an fp8 cache
// widens exactly to f16). Every other pairing (f32 q, q and cache of different 16-bit
// dtypes, f32 caches) and head dims other than 64/128/256 run on a SIMT kernel in fp32 (one
// warp per query row and head): rounding q to the cache's dtype would cost it precision.
//
// Decode tiles read every page once per call: their copies carry an L2 evict-first policy,
// so the stream (usually far larger than L2) leaves the code, metadata and partials of this
// and the next calls in L2.
//
// Split-KV (flash decoding): each split writes unnormalised fp32 outputs and (max, sum) in
// base 2 to the split workspace. Splits divide each tile's real key range (read on the
// device), so short sequences waste no blocks on empty splits. With head_dim <= 128 the
// tensor-core kernel balances a decode tile's splits dynamically (each starts on a few
// interleaved blocks, then claims one block at a time from a counter, so splits on SMs that
// stream faster take more), and the last split of every tile to finish (a second counter)
// merges the partials itself: no combine launch, no tail of unequal static shares. The
// counters live in the workspace; a small kernel zeroes them and the attention kernel
// launches behind it programmatically (sm_90+), waiting for it only before its first claim,
// so neither a memset nor a launch gap delays the K/V stream. Otherwise
// (head_dim 256, the SIMT kernel) splits are static and a combine kernel merges them.
// Sinks enter as one extra softmax term in split 0.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cuda/atomic>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "paged_attention/cuda_attention.cuh"
#include "runtime/cuda_device.h"
#include "runtime/cuda_mma.h"

namespace ejk::paged_attention {
namespace {

namespace cu = ::ejk::cuda;

constexpr int kThreads = 128;     // 4 warps per block, both tile shapes
constexpr int kBlockKeys = 64;    // keys per pipeline stage
constexpr int kSmallRows = 16;    // rows (query position x group head) of a small tile
constexpr int kLargeRows = 64;    // rows of a large tile (at most; 32 for head_dim 256)

// Large tiles of head_dim 256 have 32 rows, with two warps per row group (one per half of
// the output columns): a 16 x 256 fp32 output fragment alone would fill a warp's registers.
constexpr int LargeTileRows(int head_dim) { return head_dim > 128 ? 32 : kLargeRows; }
// Warps sharing one row group's output columns (2 halves for head_dim 256).
constexpr int WarpsD(int head_dim) { return head_dim > 128 ? 2 : 1; }
constexpr int kMaxHeadDim = 256;
constexpr float kLog2e = 1.4426950408889634f;

struct Args {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* kv_lens;
  const int32_t* block_tables;
  const int32_t* query_start_loc;
  const int32_t* num_seqs;
  const int32_t* kv_starts;  // null when absent
  const void* sinks;         // null when absent
  void* out;
  float* partial_o;   // [splits, T, Hq, D] fp32, split mode only
  float* partial_ml;  // [splits, T, Hq, 2] (max, sum) in base 2, split mode only
  // [T * Hq][2]: blocks claimed, splits finished, per tile (indexed by its first row's
  // (token, q head)); zero at launch; dynamic split mode only.
  unsigned int* split_counters;
  DType q_dtype, sinks_dtype, cache_dtype;
  int64_t num_tokens, num_q_heads, num_kv_heads, group, head_dim;
  int64_t num_pages, page_size, max_seqs, max_pages;
  int64_t page_stride, head_stride, slot_stride;  // cache strides, elements
  int page_shift;                                 // log2(page_size), or -1
  float logit_scale;     // softmax_scale * k_scale (times 2^8 for fp8 tiles: Fp8x2ToHalf2)
  float logit_scale2;    // the same times log2(e)
  float soft_cap;
  float v_scale;         // times 2^8 for fp8 tiles
  int64_t window_left;
  bool causal;
  int num_splits;
  int64_t large_tiles;  // per kv head and split; small tiles: max_seqs
  int64_t large_rows;   // rows of a large tile
  bool index_by_rows;   // large tile numbering: see LargeTileStart
  bool dynamic_splits;  // split mode with counters: claimed blocks, merge by the last split
};

__device__ __forceinline__ int64_t Clamp(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

__device__ __forceinline__ float LoadFloat(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case DType::kF16: return __half2float(static_cast<const __half*>(base)[i]);
    case DType::kF64: return static_cast<float>(static_cast<const double*>(base)[i]);
    case DType::kF8E4M3: return F8E4M3ToFloat(static_cast<const uint8_t*>(base)[i]);
    default: return 0.0f;
  }
}

__device__ __forceinline__ void StoreFloat(void* base, DType dtype, int64_t i, float x) {
  switch (dtype) {
    case DType::kF32: static_cast<float*>(base)[i] = x; break;
    case DType::kBF16: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16(x); break;
    case DType::kF16: static_cast<__half*>(base)[i] = __float2half(x); break;
    default: break;
  }
}

struct Seq {
  int64_t q_begin, q_len, kv_len, kv_start;
};

__device__ __forceinline__ int64_t NumSeqs(const Args& a) { return Clamp(a.num_seqs[0], 0, a.max_seqs); }

// An absent query_start_loc (null) means one query row per sequence (params.h).
__device__ __forceinline__ int64_t QueryStart(const Args& a, int64_t n) {
  return Clamp(QueryStartAt(a.query_start_loc, n), 0, a.num_tokens);
}

__device__ __forceinline__ Seq LoadSeq(const Args& a, int64_t n) {
  Seq s;
  s.q_begin = QueryStart(a, n);
  s.q_len = Clamp(QueryStart(a, n + 1), s.q_begin, a.num_tokens) - s.q_begin;
  s.kv_len = Clamp(a.kv_lens[n], 0, min(a.max_pages * a.page_size, int64_t{INT32_MAX} - 2 * kBlockKeys));
  s.kv_start = a.kv_starts != nullptr ? Clamp(a.kv_starts[n], 0, s.kv_len) : 0;
  return s;
}

// The largest n in [0, count) with key(n) <= target (key non-decreasing for valid metadata),
// or -1 when key(0) > target; every lane of the warp gets the same answer. Narrows the range
// 32-fold per step, so a few dependent loads cover thousands of sequences.
template <typename KeyFn>
__device__ __forceinline__ int64_t WarpUpperBound(int64_t count, int64_t target, KeyFn key) {
  const int lane = threadIdx.x % 32;
  int64_t lo = 0, hi = count;  // answer in [lo, hi) once key(lo) <= target is known
  bool first = true;
  while (hi - lo > 1 || first) {
    if (hi <= lo) return -1;
    const int64_t step = (hi - lo + 31) / 32;
    const int64_t idx = lo + lane * step;
    const bool pred = idx < hi && key(idx) <= target;
    const unsigned ballot = __ballot_sync(0xffffffffu, pred);
    if (first && (ballot & 1u) == 0) return -1;
    first = false;
    const int last = 31 - __clz(ballot);  // the prefix of true lanes ends here
    const int64_t new_lo = lo + last * step;
    hi = min(hi, new_lo + step);
    lo = new_lo;
  }
  return lo;
}

// Rows of `out` that no present sequence owns (before query_start_loc[0] or from
// query_start_loc[num_seqs] on) are zero; blocks share them out by their linear index.
__device__ void ZeroPaddingRows(const Args& a, int64_t num_seqs, int64_t block, int64_t num_blocks) {
  const int64_t first = QueryStart(a, 0);
  const int64_t last = max(first, QueryStart(a, num_seqs));
  const int64_t count = first + (a.num_tokens - last);
  const int64_t row_elems = a.num_q_heads * a.head_dim;
  const int64_t elem_bytes = a.q_dtype == DType::kF32 ? 4 : 2;
  for (int64_t i = block; i < count; i += num_blocks) {
    const int64_t row = i < first ? i : last + (i - first);
    char* base = static_cast<char*>(a.out) + row * row_elems * elem_bytes;
    if ((row_elems * elem_bytes) % 16 == 0) {
      for (int64_t c = threadIdx.x; c < row_elems * elem_bytes / 16; c += blockDim.x) {
        reinterpret_cast<uint4*>(base)[c] = make_uint4(0, 0, 0, 0);
      }
    } else {
      for (int64_t c = threadIdx.x; c < row_elems * elem_bytes / 2; c += blockDim.x) {
        reinterpret_cast<uint16_t*>(base)[c] = 0;
      }
    }
  }
}

__device__ __forceinline__ float SinkLog2(const Args& a, int64_t q_head) {
  return LoadFloat(a.sinks, a.sinks_dtype, q_head) * kLog2e;
}

// Soft-capped logit in base 2 from a raw dot product <q, k_stored>.
__device__ __forceinline__ float SoftCapLogit2(const Args& a, float dot) {
  return a.soft_cap * tanhf(dot * a.logit_scale / a.soft_cap) * kLog2e;
}

// Logit in base 2 from a raw dot product <q, k_stored>.
__device__ __forceinline__ float Logit2(const Args& a, float dot) {
  return a.soft_cap > 0.0f ? SoftCapLogit2(a, dot) : dot * a.logit_scale2;
}

// 2^x on the SFU; 2^-inf = 0.
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------------------
// Tensor-core tile kernel.

template <typename Elem>
struct ElemTraits;
template <>
struct ElemTraits<__nv_bfloat16> {
  static constexpr DType kDType = DType::kBF16;
};
template <>
struct ElemTraits<__half> {
  static constexpr DType kDType = DType::kF16;
};

// 16-byte chunk `chunk` of row `row` in a tile whose rows are `kChunks` chunks long: XOR
// swizzle, so the 8 row addresses of an ldmatrix phase hit distinct banks.
template <int kChunks>
__device__ __forceinline__ int SwizzledChunk(int row, int chunk) {
  constexpr int kMask = (kChunks >= 8 ? 8 : kChunks) - 1;
  return row * kChunks + (chunk ^ (row & kMask));
}

// Two e4m3 bytes (low byte first) as an f16x2 register holding each value times 2^-8.
// Shifting exponent and mantissa into f16 position is exact for every e4m3 value, normal or
// subnormal, because the exponent biases differ by 8; the 2^8 folds into the logit and
// output scales. Integer ops only, so sm_80 (no fp8 conversion instruction) stays cheap.
// e4m3fn has no infinities; its NaN (magnitude bits all ones) would shift to 1.875 (480 after
// scaling), so it gets the f16 exponent of all ones instead and stays NaN.
__device__ __forceinline__ uint32_t Fp8x2ToHalf2(uint16_t raw) {
  const uint32_t x = raw;
  const uint32_t nan = ((x & 0x007fu) == 0x007fu ? 0x00007c00u : 0u) | ((x & 0x7f00u) == 0x7f00u ? 0x7c000000u : 0u);
  return ((x & 0x007fu) << 7) | ((x & 0x0080u) << 8) | ((x & 0x7f00u) << 15) | ((x & 0x8000u) << 16) | nan;
}
constexpr float kFp8HalfScale = 256.0f;  // undoes Fp8x2ToHalf2's 2^-8

template <typename Elem>
__device__ __forceinline__ uint32_t PackElems(float lo, float hi) {
  return cu::PackFloat2<Elem>(lo, hi);
}

// Eight consecutive q elements (bf16 or f16, UsesMma) as Elem.
template <typename Elem>
__device__ __forceinline__ uint4 LoadQChunk(const Args& a, int64_t index) {
  const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.q) + index);
  if (a.q_dtype == ElemTraits<Elem>::kDType) return raw;
  float f[8];
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  for (int i = 0; i < 4; ++i) {
    const uint16_t lo = static_cast<uint16_t>(w[i] & 0xffffu), hi = static_cast<uint16_t>(w[i] >> 16);
    f[2 * i] = a.q_dtype == DType::kBF16 ? BF16ToFloat(lo) : F16ToFloat(lo);
    f[2 * i + 1] = a.q_dtype == DType::kBF16 ? BF16ToFloat(hi) : F16ToFloat(hi);
  }
  return make_uint4(PackElems<Elem>(f[0], f[1]), PackElems<Elem>(f[2], f[3]), PackElems<Elem>(f[4], f[5]),
                    PackElems<Elem>(f[6], f[7]));
}

// Eight fp32 values into out (bf16 or f16, the dtype of q) at element `index`.
__device__ __forceinline__ void StoreOutChunk(const Args& a, int64_t index, const float (&v)[8]) {
  if (a.q_dtype == DType::kBF16) {
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.out) + index) =
        make_uint4(cu::PackFloat2<__nv_bfloat16>(v[0], v[1]), cu::PackFloat2<__nv_bfloat16>(v[2], v[3]),
                   cu::PackFloat2<__nv_bfloat16>(v[4], v[5]), cu::PackFloat2<__nv_bfloat16>(v[6], v[7]));
  } else {
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.out) + index) =
        make_uint4(cu::PackFloat2<__half>(v[0], v[1]), cu::PackFloat2<__half>(v[2], v[3]),
                   cu::PackFloat2<__half>(v[4], v[5]), cu::PackFloat2<__half>(v[6], v[7]));
  }
}

template <typename CacheT, int kD>
struct StageShape {
  static constexpr int kChunks = kD * static_cast<int>(sizeof(CacheT)) / 16;  // per key row
  static constexpr int kTileBytes = kBlockKeys * kD * static_cast<int>(sizeof(CacheT));
  static constexpr int kStages = std::min(4, std::max(2, 98304 / (2 * kTileBytes)));
  static constexpr int kLoads = kBlockKeys * kChunks / kThreads;  // 16-byte copies per thread per tile
  static constexpr int kKeyStep = kThreads / kChunks;              // keys between a thread's copies
};

template <typename Elem, typename CacheT, int kD>
struct SmemLayout {
  using Stage = StageShape<CacheT, kD>;
  static constexpr int kQBytes = kLargeRows * kD * 2;
  static constexpr int kEpiStride = kD + 8;  // floats per row of the epilogue buffer
  static constexpr int kEpiBytes = kLargeRows * kEpiStride * 4 + 4 * kLargeRows * 2 * 4 + kLargeRows * 2 * 4;
  static constexpr int kStageBytes = 2 * Stage::kTileBytes * Stage::kStages;
  static constexpr int kBytes = kQBytes + (kStageBytes > kEpiBytes ? kStageBytes : kEpiBytes);
};

// Four fp32 values into out (bf16 or f16, the dtype of q) at element `index`.
__device__ __forceinline__ void StoreOut4(const Args& a, int64_t index, float4 v) {
  if (a.q_dtype == DType::kBF16) {
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(a.out) + index) =
        make_uint2(cu::PackFloat2<__nv_bfloat16>(v.x, v.y), cu::PackFloat2<__nv_bfloat16>(v.z, v.w));
  } else {
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(a.out) + index) =
        make_uint2(cu::PackFloat2<__half>(v.x, v.y), cu::PackFloat2<__half>(v.z, v.w));
  }
}

// head_dim 256 tiles are at the register limit: they split statically and merge in the
// combine kernel.
constexpr int kMaxFusedHeadDim = 128;

// One row's merge weights exp2(m_s - m) / sum_s exp2(m_s - m) l_s, the splits spread over
// a warp's lanes (split lane + 32 j in x[j] = (m_s, l_s); absent splits are (-inf, 0)).
__device__ __forceinline__ void SplitWeights(const float2 (&x)[kMaxCudaSplits / 32], float (&w)[kMaxCudaSplits / 32]) {
  constexpr int kSplitRegs = kMaxCudaSplits / 32;
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < kSplitRegs; ++j) m = fmaxf(m, x[j].x);
  m = cu::LaneReduceMax(m, 16);
  const float base = m == -INFINITY ? 0.0f : m;
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kSplitRegs; ++j) {
    w[j] = x[j].x == -INFINITY ? 0.0f : FastExp2(x[j].x - base);
    sum += w[j] * x[j].y;
  }
  sum = cu::LaneReduceSum(sum, 16);
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
  for (int j = 0; j < kSplitRegs; ++j) w[j] *= inv;
}

// The merge of every split's partials for a large tile's rows, by the last split to finish.
// `item(r)` is row r's (token, q head) index; s_weight holds tile_rows * num_splits floats.
// Partials are read from L2 (other blocks wrote them) in batches of independent loads, so
// the merge is a short chain of L2 round trips, not one per split.
template <int kD, typename ItemFn>
__device__ __forceinline__ void MergeSplits(const Args& a, int tile_rows, ItemFn item, float* s_weight) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  constexpr int kWarps = kThreads / 32;
  constexpr int kSplitRegs = kMaxCudaSplits / 32;  // splits per lane
  const int splits = a.num_splits;
  const int64_t stride = a.num_tokens * a.num_q_heads;
  const float2* ml = reinterpret_cast<const float2*>(a.partial_ml);
  // Split weights exp2(m_s - m) / sum: a warp per row, the splits over the lanes; four rows
  // of a warp at a time.
  for (int r0 = warp; r0 < tile_rows; r0 += 4 * kWarps) {
    float2 x[4][kSplitRegs];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = r0 + i * kWarps;
      const int64_t it = r < tile_rows ? item(r) : 0;
#pragma unroll
      for (int j = 0; j < kSplitRegs; ++j) {
        const int sp = lane + 32 * j;
        x[i][j] = r < tile_rows && sp < splits ? __ldcg(ml + sp * stride + it) : make_float2(-INFINITY, 0.0f);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = r0 + i * kWarps;
      float w[kSplitRegs];
      SplitWeights(x[i], w);
#pragma unroll
      for (int j = 0; j < kSplitRegs; ++j) {
        const int sp = lane + 32 * j;
        if (r < tile_rows && sp < splits) s_weight[r * splits + sp] = w[j];
      }
    }
  }
  __syncthreads();
  // Outputs: a thread per four columns of a row, kUnits such column groups at a time, each
  // against kChunk splits per round.
  constexpr int kCol4 = kD / 4;
  constexpr int kUnits = 4, kChunk = 8;
  const int units = tile_rows * kCol4;
  for (int c0 = 0; c0 < units; c0 += kUnits * kThreads) {
    int64_t index[kUnits];
    int wrow[kUnits];
    bool live[kUnits];
    float4 acc[kUnits];
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
      const int c = c0 + u * kThreads + tid;
      live[u] = c < units;
      const int r = live[u] ? c / kCol4 : 0;
      index[u] = item(r) * kD + (c % kCol4) * 4;
      wrow[u] = r * splits;
      acc[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    for (int sp0 = 0; sp0 < splits; sp0 += kChunk) {
      float4 x[kUnits][kChunk];
#pragma unroll
      for (int u = 0; u < kUnits; ++u) {
#pragma unroll
        for (int k = 0; k < kChunk; ++k) {
          const int sp = sp0 + k;
          x[u][k] = live[u] && sp < splits
                        ? __ldcg(reinterpret_cast<const float4*>(a.partial_o + sp * stride * kD + index[u]))
                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnits; ++u) {
#pragma unroll
        for (int k = 0; k < kChunk; ++k) {
          const int sp = sp0 + k;
          const float ws = live[u] && sp < splits ? s_weight[wrow[u] + sp] : 0.0f;
          acc[u].x += ws * x[u][k].x; acc[u].y += ws * x[u][k].y;
          acc[u].z += ws * x[u][k].z; acc[u].w += ws * x[u][k].w;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
      if (live[u]) StoreOut4(a, index[u], acc[u]);
    }
  }
}

// MergeSplits for tiles of at most kSmallRows rows: the partials come through shared
// memory by cp.async, as many splits per round as `s_buf` holds (every copy of a round in
// flight at once), the first round issued before the weights are computed. s_weight holds
// kSmallRows * kMaxCudaSplits floats.
template <int kD, typename ItemFn>
__device__ __forceinline__ void MergeSplitsSmall(const Args& a, int tile_rows, ItemFn item, float* s_weight,
                                                 float* s_buf, int buf_floats) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  constexpr int kCol4 = kD / 4;
  constexpr int kUnits = (kSmallRows * kCol4 + kThreads - 1) / kThreads;  // float4 outputs per thread
  const int splits = a.num_splits;
  const int64_t stride = a.num_tokens * a.num_q_heads;
  const int units = tile_rows * kCol4;  // float4s per split
  const int per_round = min(splits, buf_floats / (units * 4));
  // Each thread copies the same float4s (units tid + k * kThreads) of every split: no index
  // division in the copy loop, which runs on the kernel's critical path.
  int64_t unit_index[kUnits];  // element index of the unit's first value in out (and in a split's partials)
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
    const int c = tid + k * kThreads;
    unit_index[k] = c < units ? item(c / kCol4) * kD + (c % kCol4) * 4 : 0;
  }
  auto issue = [&](int sp0) {
    const int n = min(per_round, splits - sp0);
#pragma unroll
    for (int k = 0; k < kUnits; ++k) {
      const int c = tid + k * kThreads;
      if (c < units) {
        const float* src = a.partial_o + unit_index[k] + sp0 * stride * kD;
        for (int sp = 0; sp < n; ++sp) cu::CpAsync16(s_buf + (sp * units + c) * 4, src + sp * stride * kD, true);
      }
    }
    cu::CpAsyncCommit();
  };
  // Each warp requests its first row's (max, sum) of every split before the partials, so
  // that both are one round trip (decode tiles have at most one row per warp).
  const float2* ml = reinterpret_cast<const float2*>(a.partial_ml);
  constexpr int kSplitRegs = kMaxCudaSplits / 32;
  auto load_ml = [&](int r, float2(&x)[kSplitRegs]) {
#pragma unroll
    for (int j = 0; j < kSplitRegs; ++j) {
      const int sp = lane + 32 * j;
      x[j] = sp < splits ? __ldcg(ml + sp * stride + item(r)) : make_float2(-INFINITY, 0.0f);
    }
  };
  float2 x[kSplitRegs];
  if (warp < tile_rows) load_ml(warp, x);
  issue(0);
  for (int r = warp; r < tile_rows; r += kThreads / 32) {
    if (r != warp) load_ml(r, x);
    float w[kSplitRegs];
    SplitWeights(x, w);
#pragma unroll
    for (int j = 0; j < kSplitRegs; ++j) {
      const int sp = lane + 32 * j;
      if (sp < splits) s_weight[r * splits + sp] = w[j];
    }
  }
  float4 acc[kUnits];
#pragma unroll
  for (int k = 0; k < kUnits; ++k) acc[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int sp0 = 0; sp0 < splits; sp0 += per_round) {
    cu::CpAsyncWait<0>();
    __syncthreads();  // the round's partials (and, first time, the weights)
    const int n = min(per_round, splits - sp0);
#pragma unroll
    for (int k = 0; k < kUnits; ++k) {
      const int c = tid + k * kThreads;
      if (c < units) {
        const float* w = s_weight + (c / kCol4) * splits + sp0;
#pragma unroll 8
        for (int sp = 0; sp < n; ++sp) {
          const float4 x = reinterpret_cast<const float4*>(s_buf)[sp * units + c];
          acc[k].x += w[sp] * x.x; acc[k].y += w[sp] * x.y; acc[k].z += w[sp] * x.z; acc[k].w += w[sp] * x.w;
        }
      }
    }
    __syncthreads();  // the buffer is free again
    if (sp0 + per_round < splits) issue(sp0 + per_round);
  }
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
    const int c = tid + k * kThreads;
    if (c < units) StoreOut4(a, unit_index[k], acc[k]);
  }
}

// Warps: kWarpsM row groups of 16 x kWarpsD column halves of the output x kWarpsN key
// slices of each block (warps of one column pair score the same keys; each keeps half of
// the output, which keeps head_dim 256 within the register file). kClaims: the splits of
// the tile claim blocks dynamically (dynamic split mode, small tiles only).
template <typename Elem, typename CacheT, int kD, int kWarpsM, int kWarpsD, bool kClaims>
__device__ __forceinline__ void AttendTile(const Args& a, char* smem, const Seq& s, int64_t row0,
                                           int64_t kv_head, int split) {
  using Stage = StageShape<CacheT, kD>;
  using Layout = SmemLayout<Elem, CacheT, kD>;
  constexpr int kRows = 16 * kWarpsM;
  constexpr int kWarpsN = 4 / (kWarpsM * kWarpsD);
  constexpr int kWarpD = kD / kWarpsD;  // output columns per warp
  constexpr int kWarpKeys = kBlockKeys / kWarpsN;  // keys of each block a warp scores
  constexpr int kNT = kWarpKeys / 8;               // score n-tiles per warp
  constexpr int kDT = kWarpD / 8;                  // output n-tiles per warp
  constexpr int kQChunks = kD / 8;
  constexpr bool kFp8 = sizeof(CacheT) == 1;
  // Q fragments stay in registers for small tiles; large tiles (and fp8 widening) need the
  // registers for scores, so they reload Q from shared memory per block.
  constexpr bool kQInRegs = kD <= 128 && !kFp8 && kWarpsN > 1;
  constexpr bool kPrefetchPages = Stage::kLoads <= 8 && kD <= 128;  // page ids one block ahead
  // Small tiles read each page once per call; large ones share pages between tiles via L2.
  constexpr bool kReadOnce = kWarpsM * 16 == kSmallRows;
  static_assert(!kClaims || (kWarpsM * 16 == kSmallRows && kD <= kMaxFusedHeadDim), "claims: small tiles, fused merge");

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp % kWarpsM, wd = (warp / kWarpsM) % kWarpsD, wn = warp / (kWarpsM * kWarpsD);
  const int g = lane / 4, t4 = lane % 4;

  Elem* s_q = reinterpret_cast<Elem*>(smem);
  char* s_stage = smem + Layout::kQBytes;

  const int64_t G = a.group;
  const int64_t total_rows = s.q_len * G;
  const int64_t tile_rows = min(static_cast<int64_t>(kRows), total_rows - row0);
  const int64_t ctx_offset = s.kv_len - s.q_len;  // position of local query r is ctx_offset + r

  // Keys any row of the tile can see, then this split's share of them in whole blocks.
  const int64_t pos_first = ctx_offset + row0 / G;
  const int64_t pos_last = ctx_offset + (row0 + tile_rows - 1) / G;
  int64_t key_lo = s.kv_start, key_hi = s.kv_len;
  if (a.window_left >= 0) key_lo = max(key_lo, pos_first - a.window_left);
  if (a.causal) key_hi = min(key_hi, pos_last + 1);
  const int block_lo = static_cast<int>(key_lo / kBlockKeys * kBlockKeys);
  const int num_blocks = key_hi > key_lo ? static_cast<int>((key_hi - block_lo + kBlockKeys - 1) / kBlockKeys) : 0;
  // The tile's counter pair (dynamic split mode): indexed by its first row's (token, q head).
  auto counters = [&] {
    return a.split_counters + 2 * ((s.q_begin + row0 / G) * a.num_q_heads + kv_head * G + row0 % G);
  };

  // Static splits take a contiguous share of the blocks (0 .. num_blocks - 1 of the key
  // range). Claiming splits start on kInitial interleaved blocks each; then thread 0 claims
  // one block per iteration and writes its id one iteration after the atomic (whose latency
  // hides behind a block) into a ring in shared memory; the next barrier publishes it,
  // kStages + 1 iterations before the pipeline first needs it. Claims grow monotonically per
  // split, so the first id past the range ends the split. Ring and claim state stay in
  // shared memory: the kernel is at its register limit.
  const int per_split = (num_blocks + a.num_splits - 1) / a.num_splits;
  const int first_block = min(num_blocks, split * per_split);
  const int count = min(num_blocks, first_block + per_split) - first_block;
  const int kv_begin = block_lo + first_block * kBlockKeys;
  constexpr int kInitial = Stage::kStages + 2;
  constexpr int kRing = 8;
  static_assert(kInitial <= kRing, "claim ring too small");
  __shared__ int s_claims[kClaims ? kRing : 1];
  if constexpr (kClaims) {
    if (tid == 0) {
      for (int i = 0; i < kInitial; ++i) s_claims[i] = min(num_blocks, i * a.num_splits + split);
    }
    __syncthreads();
  }
  // First key of the split's i-th block, or -1 past its end.
  auto block_key = [&](int i) {
    if constexpr (kClaims) {
      const int b = s_claims[i % kRing];
      return b < num_blocks ? block_lo + b * kBlockKeys : -1;
    }
    return i < count ? kv_begin + i * kBlockKeys : -1;
  };

  // Visible keys [vis_lo, vis_hi) of this thread's two fragment rows (g and g + 8).
  // Keys fit int32 (kv_lens are int32), so the per-element mask compares 32-bit values.
  int vis_lo[2], vis_hi[2];
  for (int h = 0; h < 2; ++h) {
    const int r = wm * 16 + g + 8 * h;
    if (r < tile_rows) {
      const int64_t pos = ctx_offset + (row0 + r) / G;
      int64_t lo = s.kv_start;
      if (a.window_left >= 0) lo = max(lo, pos - a.window_left);
      const int64_t hi = a.causal ? min(s.kv_len, pos + 1) : s.kv_len;
      vis_lo[h] = static_cast<int>(Clamp(lo, 0, s.kv_len));
      vis_hi[h] = static_cast<int>(Clamp(hi, 0, s.kv_len));
    } else {
      vis_lo[h] = 0;
      vis_hi[h] = 0;
    }
  }
  // Keys every row of the warp sees: blocks inside need no mask.
  int warp_vis_lo = max(vis_lo[0], vis_lo[1]), warp_vis_hi = min(vis_hi[0], vis_hi[1]);
  for (int offset = 16; offset > 0; offset /= 2) {
    warp_vis_lo = max(warp_vis_lo, __shfl_xor_sync(0xffffffffu, warp_vis_lo, offset));
    warp_vis_hi = min(warp_vis_hi, __shfl_xor_sync(0xffffffffu, warp_vis_hi, offset));
  }

  // Cache copies: thread `tid` moves chunk tid % kChunks of keys tid / kChunks + i * kKeyStep.
  const int my_chunk = tid % Stage::kChunks;
  const int my_key = tid / Stage::kChunks;
  const int32_t* table = a.block_tables;  // this sequence's row (set by the caller)
  const char* k_base = static_cast<const char*>(a.k_cache);
  const char* v_base = static_cast<const char*>(a.v_cache);
  const int64_t head_offset = kv_head * a.head_stride;
  int32_t pages[Stage::kLoads];

  // Keys outside [key_begin, key_end) are hidden from every row of the tile: their slots are
  // neither read nor their page ids looked up (before kv_start they may be freed pages, and a
  // masked key's garbage would still reach O as 0 x NaN), the copies zero-fill them instead.
  const int key_begin = static_cast<int>(key_lo), key_end = static_cast<int>(key_hi);
  const int page_size = static_cast<int>(a.page_size);
  auto fetch_pages = [&](int block) {
    const int kv0 = block_key(block);
#pragma unroll
    for (int i = 0; i < Stage::kLoads; ++i) {
      const int j = kv0 + my_key + i * Stage::kKeyStep;
      int32_t page = 0;
      if (kv0 >= 0 && j >= key_begin && j < key_end) {
        page = __ldg(table + (a.page_shift >= 0 ? (j >> a.page_shift) : j / page_size));
      }
      pages[i] = page;
    }
  };
  auto issue_copies = [&](int block) {
    if constexpr (!kPrefetchPages) fetch_pages(block);
    const int stage = block % Stage::kStages;
    char* sk = s_stage + stage * 2 * Stage::kTileBytes;
    char* sv = sk + Stage::kTileBytes;
    const int kv0 = block_key(block);
#pragma unroll
    for (int i = 0; i < Stage::kLoads; ++i) {
      const int key = my_key + i * Stage::kKeyStep;
      const int j = kv0 + key;
      const bool valid = kv0 >= 0 && j >= key_begin && j < key_end;
      int64_t offset = 0;
      if (valid) {
        const int slot = a.page_shift >= 0 ? (j & (page_size - 1)) : j % page_size;
        const int64_t page = Clamp(pages[i], 0, a.num_pages - 1);
        offset = (page * a.page_stride + head_offset + slot * a.slot_stride) * static_cast<int64_t>(sizeof(CacheT)) +
                 my_chunk * 16;
      }
      const int dst = SwizzledChunk<Stage::kChunks>(key, my_chunk) * 16;
      if constexpr (kReadOnce) {
        const uint64_t policy = cu::L2EvictFirstPolicy();
        cu::CpAsync16(sk + dst, k_base + offset, valid, policy);
        cu::CpAsync16(sv + dst, v_base + offset, valid, policy);
      } else {
        cu::CpAsync16(sk + dst, k_base + offset, valid);
        cu::CpAsync16(sv + dst, v_base + offset, valid);
      }
    }
  };

  float o[kDT][4];
#pragma unroll
  for (int i = 0; i < kDT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  // Pipeline prologue: kStages - 1 blocks in flight, page ids of the next one requested.
  // Rolled up: every block runs this code cold, and instruction fetch misses are most of a
  // decode call's start-up, so it should be short. (Not for fp8 caches: there ptxas of CUDA
  // 13.0 then encodes some copies with an odd uniform descriptor register, an illegal
  // instruction; tests/runtime/test_cuda_sass.py checks the built library for that.)
  auto prologue_block = [&](int b) {
    if constexpr (kPrefetchPages) fetch_pages(b);
    issue_copies(b);
    cu::CpAsyncCommit();
  };
  if constexpr (kFp8) {
#pragma unroll
    for (int b = 0; b < Stage::kStages - 1; ++b) prologue_block(b);
  } else {
#pragma unroll 1
    for (int b = 0; b < Stage::kStages - 1; ++b) prologue_block(b);
  }
  if constexpr (kPrefetchPages) fetch_pages(Stage::kStages - 1);
  // Q tile -> shared memory as Elem (rows past the tile zero) while the first blocks load.
  for (int c = tid; c < kRows * kQChunks; c += kThreads) {
    const int r = c / kQChunks, ch = c % kQChunks;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < tile_rows) {
      const int64_t fr = row0 + r;
      const int64_t token = s.q_begin + fr / G;
      const int64_t head = kv_head * G + fr % G;
      v = LoadQChunk<Elem>(a, (token * a.num_q_heads + head) * a.head_dim + ch * 8);
    }
    reinterpret_cast<uint4*>(s_q)[SwizzledChunk<kQChunks>(r, ch)] = v;
  }

  __syncthreads();  // the Q tile

  uint32_t q_frag[kQInRegs ? kD / 16 : 1][4];
  auto load_q_frag = [&](int kk, uint32_t(&frag)[4]) {
    const int r = wm * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
    const int ch = kk * 2 + lane / 16;
    cu::LdMatrixX4(frag, reinterpret_cast<const char*>(s_q) + SwizzledChunk<kQChunks>(r, ch) * 16);
  };
  if constexpr (kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) load_q_frag(kk, q_frag[kk]);
  }

  // The claim counters are zeroed by the kernel launched before this one, which may still be
  // running (programmatic launch): everything above reads only data of earlier work.
  cu::WaitForPreviousGrid();
  unsigned int claimed = 0;  // thread 0: the last claim, not yet in the ring
  for (int block = 0; block < (kClaims ? num_blocks : count); ++block) {
    cu::CpAsyncWait<Stage::kStages - 2>();
    __syncthreads();
    if constexpr (kClaims) {
      if (block_key(block) < 0) break;
      if (tid == 0) {
        if (block > 0) s_claims[(block + kInitial - 1) % kRing] = min(num_blocks, kInitial * a.num_splits + static_cast<int>(claimed));
        claimed = atomicAdd(counters(), 1u);
      }
    }
    issue_copies(block + Stage::kStages - 1);
    cu::CpAsyncCommit();
    if constexpr (kPrefetchPages) fetch_pages(block + Stage::kStages);

    const int stage = block % Stage::kStages;
    const char* sk = s_stage + stage * 2 * Stage::kTileBytes;
    const char* sv = sk + Stage::kTileBytes;
    const int key_base = wn * kWarpKeys;  // this warp's keys within the block

    float sc[kNT][4];
#pragma unroll
    for (int i = 0; i < kNT; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t qa[4];
      if constexpr (kQInRegs) {
        qa[0] = q_frag[kk][0]; qa[1] = q_frag[kk][1]; qa[2] = q_frag[kk][2]; qa[3] = q_frag[kk][3];
      } else {
        load_q_frag(kk, qa);
      }
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t b0[2], b1[2];
        if constexpr (kFp8) {
          const int d = kk * 16 + 2 * t4;
          auto k_pair = [&](int key, int dd) {
            return Fp8x2ToHalf2(*reinterpret_cast<const uint16_t*>(
                sk + SwizzledChunk<Stage::kChunks>(key, dd / 16) * 16 + dd % 16));
          };
          const int key = key_base + np * 16 + g;
          b0[0] = k_pair(key, d);
          b0[1] = k_pair(key, d + 8);
          b1[0] = k_pair(key + 8, d);
          b1[1] = k_pair(key + 8, d + 8);
        } else {
          uint32_t kb[4];
          const int m = lane / 8;
          const int key = key_base + np * 16 + (m / 2) * 8 + lane % 8;
          cu::LdMatrixX4(kb, sk + SwizzledChunk<Stage::kChunks>(key, kk * 2 + m % 2) * 16);
          b0[0] = kb[0]; b0[1] = kb[1]; b1[0] = kb[2]; b1[1] = kb[3];
        }
        cu::Mma16816<Elem>(sc[2 * np], qa, b0);
        cu::Mma16816<Elem>(sc[2 * np + 1], qa, b1);
      }
    }

    // Logits (base 2), the mask only where the warp's keys cross a row's visible range,
    // online softmax, P as A fragments.
    const int kv0 = block_key(block) + key_base;
    if (a.soft_cap > 0.0f) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] = SoftCapLogit2(a, sc[nt][e]);
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] *= a.logit_scale2;
      }
    }
    if (kv0 < warp_vis_lo || kv0 + kWarpKeys > warp_vis_hi) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e / 2;
          const int j = kv0 + nt * 8 + 2 * t4 + (e & 1);
          if (j < vis_lo[h] || j >= vis_hi[h]) sc[nt][e] = -INFINITY;
        }
      }
    }
    float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      block_max[0] = fmaxf(block_max[0], fmaxf(sc[nt][0], sc[nt][1]));
      block_max[1] = fmaxf(block_max[1], fmaxf(sc[nt][2], sc[nt][3]));
    }
    float scale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      block_max[h] = cu::LaneReduceMax(block_max[h], 2);
      const float new_max = fmaxf(row_max[h], block_max[h]);
      const float base = new_max == -INFINITY ? 0.0f : new_max;
      scale[h] = FastExp2(row_max[h] - base);
      row_max[h] = new_max;
      block_max[h] = base;
      row_sum[h] *= scale[h];
    }
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e / 2;
        sc[nt][e] = FastExp2(sc[nt][e] - block_max[h]);
        row_sum[h] += sc[nt][e];
      }
    }
#pragma unroll
    for (int i = 0; i < kDT; ++i) {
      o[i][0] *= scale[0]; o[i][1] *= scale[0];
      o[i][2] *= scale[1]; o[i][3] *= scale[1];
    }

#pragma unroll
    for (int kk = 0; kk < kWarpKeys / 16; ++kk) {
      uint32_t pa[4];
      pa[0] = PackElems<Elem>(sc[2 * kk][0], sc[2 * kk][1]);
      pa[1] = PackElems<Elem>(sc[2 * kk][2], sc[2 * kk][3]);
      pa[2] = PackElems<Elem>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
      pa[3] = PackElems<Elem>(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
      const int key0 = key_base + kk * 16;
#pragma unroll
      for (int dn = 0; dn < kWarpD / 16; ++dn) {
        const int dcol = wd * (kWarpD / 16) + dn;  // 16-column group of the output
        uint32_t b0[2], b1[2];
        if constexpr (kFp8) {
          // Two keys (2t, 2t + 1) of one output column: bytes from two rows.
          auto v_pair = [&](int key, int d) {
            const int chunk = d / 16, within = d % 16;
            const uint32_t x0 = static_cast<uint8_t>(sv[SwizzledChunk<Stage::kChunks>(key, chunk) * 16 + within]);
            const uint32_t x1 = static_cast<uint8_t>(sv[SwizzledChunk<Stage::kChunks>(key + 1, chunk) * 16 + within]);
            return Fp8x2ToHalf2(static_cast<uint16_t>(x0 | (x1 << 8)));
          };
          const int key = key0 + 2 * t4, d = dcol * 16 + g;
          b0[0] = v_pair(key, d);
          b0[1] = v_pair(key + 8, d);
          b1[0] = v_pair(key, d + 8);
          b1[1] = v_pair(key + 8, d + 8);
        } else {
          uint32_t vb[4];
          const int m = lane / 8;
          const int key = key0 + (m % 2) * 8 + lane % 8;
          cu::LdMatrixX4Trans(vb, sv + SwizzledChunk<Stage::kChunks>(key, dcol * 2 + m / 2) * 16);
          b0[0] = vb[0]; b0[1] = vb[1]; b1[0] = vb[2]; b1[1] = vb[3];
        }
        cu::Mma16816<Elem>(o[2 * dn], pa, b0);
        cu::Mma16816<Elem>(o[2 * dn + 1], pa, b1);
      }
    }
  }
  cu::CpAsyncWait<0>();
  __syncthreads();  // every warp is done with the stages: reuse them for the epilogue

  // Merge the warps that share rows (different key slices), plus the sink in split 0.
  float* s_epi = reinterpret_cast<float*>(s_stage);                        // [kWarpsN][kRows][kEpiStride]
  float* s_ml = s_epi + kLargeRows * Layout::kEpiStride;                    // [kWarpsN][kRows][2]
  float* s_row = s_ml + 4 * kLargeRows * 2;                                 // [kRows][2]: merged max, sum
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] = cu::LaneReduceSum(row_sum[h], 2);
    if (t4 == 0 && wd == 0) {
      const int r = wm * 16 + g + 8 * h;
      s_ml[(wn * kRows + r) * 2] = row_max[h];
      s_ml[(wn * kRows + r) * 2 + 1] = row_sum[h];
    }
  }
  __syncthreads();
  const bool with_sink = a.sinks != nullptr && split == 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = wm * 16 + g + 8 * h;
    float m = with_sink && r < tile_rows ? SinkLog2(a, kv_head * G + (row0 + r) % G) : -INFINITY;
    const float sink = m;
#pragma unroll
    for (int w = 0; w < kWarpsN; ++w) m = fmaxf(m, s_ml[(w * kRows + r) * 2]);
    const float base = m == -INFINITY ? 0.0f : m;
    float sum = sink == -INFINITY ? 0.0f : exp2f(sink - base);
#pragma unroll
    for (int w = 0; w < kWarpsN; ++w) sum += s_ml[(w * kRows + r) * 2 + 1] * exp2f(s_ml[(w * kRows + r) * 2] - base);
    const float mine = exp2f(row_max[h] - base);
    if (wn == 0 && wd == 0 && t4 == 0) {
      s_row[r * 2] = m;
      s_row[r * 2 + 1] = sum;
    }
    float* dst = s_epi + (wn * kRows + r) * Layout::kEpiStride + wd * kWarpD + 2 * t4;
#pragma unroll
    for (int i = 0; i < kDT; ++i) {
      *reinterpret_cast<float2*>(dst + i * 8) = make_float2(o[i][2 * h] * mine, o[i][2 * h + 1] * mine);
    }
  }
  __syncthreads();

  const bool split_mode = a.num_splits > 1;
  for (int c = tid; c < kRows * kQChunks; c += kThreads) {
    const int r = c / kQChunks, ch = c % kQChunks;
    if (r >= tile_rows) continue;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarpsN; ++w) {
      const float4* src = reinterpret_cast<const float4*>(s_epi + (w * kRows + r) * Layout::kEpiStride + ch * 8);
      const float4 x = src[0], y = src[1];
      v[0] += x.x; v[1] += x.y; v[2] += x.z; v[3] += x.w; v[4] += y.x; v[5] += y.y; v[6] += y.z; v[7] += y.w;
    }
    const int64_t fr = row0 + r;
    const int64_t token = s.q_begin + fr / G;
    const int64_t head = kv_head * G + fr % G;
    const int64_t index = (token * a.num_q_heads + head) * a.head_dim + ch * 8;
    if (split_mode) {
      const int64_t slot = static_cast<int64_t>(split) * a.num_tokens * a.num_q_heads * a.head_dim + index;
      float4* dst = reinterpret_cast<float4*>(a.partial_o + slot);
      dst[0] = make_float4(v[0] * a.v_scale, v[1] * a.v_scale, v[2] * a.v_scale, v[3] * a.v_scale);
      dst[1] = make_float4(v[4] * a.v_scale, v[5] * a.v_scale, v[6] * a.v_scale, v[7] * a.v_scale);
      if (ch == 0) {
        const int64_t ml = (static_cast<int64_t>(split) * a.num_tokens + token) * a.num_q_heads + head;
        a.partial_ml[2 * ml] = s_row[r * 2];
        a.partial_ml[2 * ml + 1] = s_row[r * 2 + 1];
      }
    } else {
      const float sum = s_row[r * 2 + 1];
      const float inv = sum > 0.0f ? a.v_scale / sum : 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] *= inv;
      StoreOutChunk(a, index, v);
    }
  }
  if constexpr (kD <= kMaxFusedHeadDim) {
    if (!split_mode || !a.dynamic_splits) return;
    static_assert(Layout::kBytes - Layout::kQBytes >= kLargeRows * kMaxCudaSplits * 4, "merge weights");
    // The last split of the tile to get here merges. The barrier orders the block's partial
    // writes before thread 0's count, whose release publishes them and whose acquire (in
    // the last split) orders the merge's reads after every other split's count.
    auto item = [&](int r) {
      const int64_t fr = row0 + r;
      return (s.q_begin + fr / G) * a.num_q_heads + kv_head * G + fr % G;
    };
    // Small tiles look their rows' (token, q head) up before the count: the 64-bit
    // divisions stay off the merge's critical path.
    __shared__ int64_t s_item[kRows <= kSmallRows ? kSmallRows : 1];
    if constexpr (kRows <= kSmallRows) {
      if (tid < tile_rows) s_item[tid] = item(tid);
    }
    __shared__ bool s_last;
    __syncthreads();
    if (tid == 0) {
      ::cuda::atomic_ref<unsigned int, ::cuda::thread_scope_device> finished(counters()[1]);
      s_last = finished.fetch_add(1u, ::cuda::memory_order_acq_rel) == static_cast<unsigned int>(a.num_splits - 1);
    }
    __syncthreads();
    if (!s_last) return;
    if constexpr (kRows <= kSmallRows) {
      static_assert(Layout::kQBytes >= kSmallRows * kMaxCudaSplits * 4, "merge weights");
      MergeSplitsSmall<kD>(a, static_cast<int>(tile_rows), [&](int r) { return s_item[r]; },
                           reinterpret_cast<float*>(s_q), s_epi, (Layout::kBytes - Layout::kQBytes) / 4);
    } else {
      MergeSplits<kD>(a, static_cast<int>(tile_rows), item, s_epi);
    }
  }
}

// First large tile of sequence n. With u = query_start_loc[n] * group (its first flattened
// row), tiles floor(u / rows) + e(n) .. onwards are its own, where e grows by at least 1 per
// sequence that needs large tiles (more than kSmallRows rows): e(n) = n, or, when that
// numbers fewer tiles (few long sequences among many short ones is the other case),
// e(n) = floor(u / (kSmallRows + 1)). Either way the grid size is static.
__device__ __forceinline__ int64_t LargeTileStart(const Args& a, int64_t n) {
  const int64_t u = QueryStart(a, n) * a.group;
  return u / a.large_rows + (a.index_by_rows ? u / (kSmallRows + 1) : n);
}

template <typename Elem, typename CacheT, int kD>
__global__ void __launch_bounds__(kThreads, 2) PagedAttentionKernel(const Args a) {
  extern __shared__ __align__(128) char smem[];
  // The split combine may launch once every block has started (it waits for this grid's end).
  cu::AllowDependentLaunch();
  const int64_t num_seqs = NumSeqs(a);
  // Blocks in launch order: small tiles first (each spans a whole context, the longest
  // work), then large tiles, last tile of the packed batch first (causal: most keys).
  const int64_t small_blocks = a.max_seqs * a.num_kv_heads * a.num_splits;
  int64_t id = blockIdx.x;
  Args args = a;
  if (id < small_blocks) {
    const int64_t n = id % a.max_seqs;
    id /= a.max_seqs;
    const int64_t kv_head = id % a.num_kv_heads;
    const int split = static_cast<int>(id / a.num_kv_heads);
    const Seq s = LoadSeq(a, n);  // in bounds for any n < max_seqs: read before the check
    const int64_t rows = s.q_len * a.group;
    if (n < num_seqs && rows > 0 && rows <= kSmallRows) {
      args.block_tables = a.block_tables + n * a.max_pages;
      if (kD <= kMaxFusedHeadDim && a.dynamic_splits) {
        AttendTile<Elem, CacheT, kD, kSmallRows / 16, WarpsD(kD), kD <= kMaxFusedHeadDim>(args, smem, s, 0, kv_head,
                                                                                        split);
      } else {
        AttendTile<Elem, CacheT, kD, kSmallRows / 16, WarpsD(kD), false>(args, smem, s, 0, kv_head, split);
      }
    }
  } else if (a.large_tiles > 0) {
    id -= small_blocks;
    const int64_t t = a.large_tiles - 1 - id % a.large_tiles;
    id /= a.large_tiles;
    const int64_t kv_head = id % a.num_kv_heads;
    const int split = static_cast<int>(id / a.num_kv_heads);
    auto start = [&](int64_t n) { return LargeTileStart(a, n); };
    const int64_t n = WarpUpperBound(num_seqs, t, start);
    if (n >= 0) {
      const Seq s = LoadSeq(a, n);
      const int64_t rows = s.q_len * a.group;
      const int64_t row0 = (t - start(n)) * LargeTileRows(kD);
      if (rows > kSmallRows && row0 < rows) {
        args.block_tables = a.block_tables + n * a.max_pages;
        AttendTile<Elem, CacheT, kD, LargeTileRows(kD) / 16, WarpsD(kD), false>(args, smem, s, row0, kv_head, split);
      }
    }
  }
  ZeroPaddingRows(a, num_seqs, blockIdx.x, gridDim.x);
}

// ---------------------------------------------------------------------------------------
// SIMT kernel: one warp per (token row, q head, split); any cache dtype, head_dim <= 256.

constexpr int kSimtWarps = 4;
constexpr int kSimtDims = kMaxHeadDim / 32;

__global__ void __launch_bounds__(kSimtWarps * 32) PagedAttentionSimtKernel(const Args a) {
  cu::AllowDependentLaunch();  // as PagedAttentionKernel
  const int lane = threadIdx.x % 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kSimtWarps + threadIdx.x / 32;
  const int split = blockIdx.y;
  if (item >= a.num_tokens * a.num_q_heads) return;
  const int64_t token = item / a.num_q_heads, head = item % a.num_q_heads;
  const int64_t num_seqs = NumSeqs(a);
  const int64_t n = WarpUpperBound(num_seqs, token, [&](int64_t i) { return QueryStart(a, i); });
  Seq s{};
  bool owned = false;
  if (n >= 0) {
    s = LoadSeq(a, n);
    owned = token < s.q_begin + s.q_len;
  }
  const int64_t D = a.head_dim;
  const int64_t out_index = item * D;
  if (!owned) {
    if (split == 0) {
      for (int64_t d = lane; d < D; d += 32) StoreFloat(a.out, a.q_dtype, out_index + d, 0.0f);
    }
    return;
  }
  const int64_t kv_head = head / a.group;
  const int64_t pos = s.kv_len - s.q_len + (token - s.q_begin);
  int64_t lo = s.kv_start, hi = a.causal ? min(s.kv_len, pos + 1) : s.kv_len;
  if (a.window_left >= 0) lo = max(lo, pos - a.window_left);
  const int64_t total = hi > lo ? hi - lo : 0;
  const int64_t per_split = (total + a.num_splits - 1) / a.num_splits;
  const int64_t begin = lo + min(total, split * per_split);
  const int64_t end = lo + min(total, (split + 1) * per_split);

  float q[kSimtDims], acc[kSimtDims];
#pragma unroll
  for (int i = 0; i < kSimtDims; ++i) {
    const int64_t d = lane + 32 * i;
    q[i] = d < D ? LoadFloat(a.q, a.q_dtype, out_index + d) : 0.0f;
    acc[i] = 0.0f;
  }
  const int32_t* table = a.block_tables + n * a.max_pages;
  float m = -INFINITY, l = 0.0f;
  if (a.sinks != nullptr && split == 0) {
    m = SinkLog2(a, head);
    l = 1.0f;
  }
  for (int64_t j = begin; j < end; ++j) {
    const int64_t page = Clamp(table[j / a.page_size], 0, a.num_pages - 1);
    const int64_t base = page * a.page_stride + kv_head * a.head_stride + (j % a.page_size) * a.slot_stride;
    float partial = 0.0f;
#pragma unroll
    for (int i = 0; i < kSimtDims; ++i) {
      const int64_t d = lane + 32 * i;
      if (d < D) partial += q[i] * LoadFloat(a.k_cache, a.cache_dtype, base + d);
    }
    const float x = Logit2(a, cu::LaneReduceSum(partial, 16));
    const float new_m = fmaxf(m, x);
    const float corr = exp2f(m - new_m);
    const float p = exp2f(x - new_m);
    l = l * corr + p;
    m = new_m;
#pragma unroll
    for (int i = 0; i < kSimtDims; ++i) {
      const int64_t d = lane + 32 * i;
      const float v = d < D ? LoadFloat(a.v_cache, a.cache_dtype, base + d) : 0.0f;
      acc[i] = acc[i] * corr + p * v;
    }
  }
  if (a.num_splits > 1) {
    const int64_t slot = (static_cast<int64_t>(split) * a.num_tokens * a.num_q_heads + item);
#pragma unroll
    for (int i = 0; i < kSimtDims; ++i) {
      const int64_t d = lane + 32 * i;
      if (d < D) a.partial_o[slot * D + d] = acc[i] * a.v_scale;
    }
    if (lane == 0) {
      a.partial_ml[2 * slot] = m;
      a.partial_ml[2 * slot + 1] = l;
    }
  } else {
    const float inv = l > 0.0f ? a.v_scale / l : 0.0f;
#pragma unroll
    for (int i = 0; i < kSimtDims; ++i) {
      const int64_t d = lane + 32 * i;
      if (d < D) StoreFloat(a.out, a.q_dtype, out_index + d, acc[i] * inv);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Split combine: one block per (token row, q head) of a present sequence. Every split's
// partial output column is requested before the weights are known (one round trip to L2,
// not one per split); the weights go through shared memory.

constexpr int kCombineThreads = 128;
constexpr int kMaxSplits = kMaxCudaSplits;
constexpr int kCombineBatch = 32;  // splits per round of loads

__global__ void __launch_bounds__(kCombineThreads) CombineSplitsKernel(const Args a) {
  cu::WaitForPreviousGrid();  // the attention kernel's partials
  cu::AllowDependentLaunch();
  __shared__ float s_weight[kMaxSplits];
  __shared__ float s_red[kCombineThreads / 32];
  const int tid = threadIdx.x;
  const int64_t item = blockIdx.x;
  const int64_t token = item / a.num_q_heads;
  const int64_t num_seqs = NumSeqs(a);
  const int64_t first = QueryStart(a, 0);
  if (token < first || token >= max(first, QueryStart(a, num_seqs))) return;  // padding: zeroed
  const int64_t stride = a.num_tokens * a.num_q_heads;
  const int splits = a.num_splits;
  const int64_t D = a.head_dim;
  // This thread's first output column, all splits of the first batch in flight.
  const int64_t d0 = tid;
  float x[kCombineBatch];
#pragma unroll
  for (int k = 0; k < kCombineBatch; ++k) {
    x[k] = d0 < D && k < splits ? __ldcg(a.partial_o + (k * stride + item) * D + d0) : 0.0f;
  }
  const float m_mine = tid < splits ? __ldcg(a.partial_ml + 2 * (tid * stride + item)) : -INFINITY;
  const float l_mine = tid < splits ? __ldcg(a.partial_ml + 2 * (tid * stride + item) + 1) : 0.0f;
  float m = cu::LaneReduceMax(m_mine, 16);
  if (tid % 32 == 0) s_red[tid / 32] = m;
  __syncthreads();
  m = fmaxf(fmaxf(s_red[0], s_red[1]), fmaxf(s_red[2], s_red[3]));
  const float base = m == -INFINITY ? 0.0f : m;
  const float w = m_mine == -INFINITY ? 0.0f : exp2f(m_mine - base);
  if (tid < splits) s_weight[tid] = w;
  float sum = cu::LaneReduceSum(w * l_mine, 16);
  __syncthreads();
  if (tid % 32 == 0) s_red[tid / 32] = sum;
  __syncthreads();
  sum = s_red[0] + s_red[1] + s_red[2] + s_red[3];
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  // Splits without keys have weight 0 and may hold anything: they are skipped, not scaled.
  auto weighted = [&](int s, float v) { return s < splits && s_weight[s] != 0.0f ? v * s_weight[s] : 0.0f; };
  for (int64_t d = d0; d < D; d += kCombineThreads) {
    float acc = 0.0f;
    for (int s0 = 0; s0 < splits; s0 += kCombineBatch) {
      if (d != d0 || s0 != 0) {
#pragma unroll
        for (int k = 0; k < kCombineBatch; ++k) {
          x[k] = s0 + k < splits ? __ldcg(a.partial_o + ((s0 + k) * stride + item) * D + d) : 0.0f;
        }
      }
#pragma unroll
      for (int k = 0; k < kCombineBatch; ++k) acc += weighted(s0 + k, x[k]);
    }
    StoreFloat(a.out, a.q_dtype, item * D + d, acc * inv);
  }
}

// ---------------------------------------------------------------------------------------
// Host side.

bool MmaHeadDim(int64_t d) { return d == 64 || d == 128 || d == 256; }

bool UsesMma(int64_t head_dim, DType q_dtype, DType cache_dtype) {
  const bool q_16bit = q_dtype == DType::kBF16 || q_dtype == DType::kF16;
  return MmaHeadDim(head_dim) && q_16bit && (cache_dtype == q_dtype || cache_dtype == DType::kF8E4M3);
}

// Large tiles per kv head and split (LargeTileStart's numbering), and which numbering.
void SetLargeTiles(const Dims& d, Args* a) {
  const int64_t rows = d.num_tokens * (d.num_q_heads / d.num_kv_heads);
  a->large_rows = LargeTileRows(static_cast<int>(d.head_dim));
  const int64_t by_seq = rows / a->large_rows + d.max_seqs;
  const int64_t by_rows = rows / a->large_rows + rows / (kSmallRows + 1);
  a->index_by_rows = by_rows < by_seq;
  a->large_tiles = std::min(by_seq, by_rows);
}

// Programmatic dependent launch needs an sm_90+ GPU running code that holds the waits.
bool ProgrammaticLaunchSupported() { return ProgrammaticLaunchRuns(CurrentCudaDevice()); }

// Zeroes the dynamic splits' claim counters and lets the attention kernel launch at once:
// its blocks load Q and their first key blocks while this runs, and wait for it only before
// their first claim. Replaces a memset and a launch gap on the decode path.
__global__ void __launch_bounds__(256) ZeroCountersKernel(unsigned int* counters, int64_t n) {
  cu::AllowDependentLaunch();
  for (int64_t i = blockIdx.x * int64_t{256} + threadIdx.x; i < n; i += gridDim.x * int64_t{256}) counters[i] = 0;
}

template <typename Elem, typename CacheT, int kD>
Status LaunchMma(const Args& a, cudaStream_t stream) {
  constexpr int kSmem = SmemLayout<Elem, CacheT, kD>::kBytes;
  auto kernel = PagedAttentionKernel<Elem, CacheT, kD>;
  static std::array<std::atomic<bool>, 64> configured{};  // per device
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64 || !configured[device].load()) {
    if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
        err != cudaSuccess) {
      return Status::Internal(std::string("paged attention: cannot reserve shared memory: ") + cudaGetErrorString(err));
    }
    if (device >= 0 && device < 64) configured[device].store(true);
  }
  // At least one block: with no sequence slots it still zeroes the padding rows.
  const int64_t blocks = std::max<int64_t>(1, (a.large_tiles + a.max_seqs) * a.num_kv_heads * a.num_splits);
  if (blocks > INT32_MAX) return Status::InvalidArgument("paged attention CUDA: too many query tiles");
  // After the counters' zeroing kernel (dynamic splits) the kernel launches programmatically.
  if (cudaError_t err = cu::LaunchAfterPrevious(a.dynamic_splits && ProgrammaticLaunchSupported(), kernel,
                                                dim3(static_cast<unsigned>(blocks)), dim3(kThreads), kSmem, stream, a);
      err != cudaSuccess) {
    return Status::Internal(std::string("paged attention: attention kernel launch failed: ") + cudaGetErrorString(err));
  }
  return Status::Ok();
}

template <int kD>
Status LaunchMmaForDim(const Args& a, cudaStream_t stream) {
  switch (a.cache_dtype) {
    case DType::kBF16: return LaunchMma<__nv_bfloat16, __nv_bfloat16, kD>(a, stream);
    case DType::kF16: return LaunchMma<__half, __half, kD>(a, stream);
    default: return LaunchMma<__half, uint8_t, kD>(a, stream);
  }
}

Status LastLaunchError(const char* what) {
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return Status::Internal(std::string("paged attention: ") + what + " launch failed: " + cudaGetErrorString(err));
  }
  return Status::Ok();
}

}  // namespace

int CudaNumSplits(const Dims& dims, const Config& cfg, int sm_count) {
  // One split per 256 keys of the longest possible context at most.
  const int64_t max_keys = dims.max_pages_per_seq * dims.page_size;
  const int64_t max_splits = std::max<int64_t>(1, std::min<int64_t>(kMaxSplits, (max_keys + 255) / 256));
  if (cfg.num_splits > 0) return static_cast<int>(std::min<int64_t>(cfg.num_splits, max_splits));
  if (dims.num_kv_heads == 0) return 1;
  // Partial outputs are written and read back once: keep them small next to the cache reads.
  const int64_t partial_bytes = dims.num_tokens * dims.num_q_heads * (dims.head_dim + 2) * 4;
  const int64_t heuristic_max = std::min<int64_t>(max_splits, std::max<int64_t>(1, (int64_t{32} << 20) / std::max<int64_t>(1, partial_bytes)));
  // Tiles the batch has at least: one per sequence (decode) or per 64 rows (prefill).
  const int64_t group = dims.num_q_heads / dims.num_kv_heads;
  const int64_t tiles = std::max(std::min(dims.max_seqs, dims.num_tokens), dims.num_tokens * group / LargeTileRows(static_cast<int>(dims.head_dim)));
  const int64_t items = std::max<int64_t>(1, tiles * dims.num_kv_heads);
  // Equal-length splits finish together, so the last wave of blocks (two resident per SM)
  // should be nearly full: the fewest splits whose waves are 95% used, else the best.
  const double slots = 2.0 * sm_count;
  int best = 1;
  double best_use = 0.0;
  for (int64_t s = 1; s <= heuristic_max; ++s) {
    const double waves = items * s / slots;
    const double use = waves / std::ceil(waves);
    if (use >= 0.95) return static_cast<int>(s);
    if (use > best_use + 1e-9) {
      best_use = use;
      best = static_cast<int>(s);
    }
    if (waves > 8.0) break;
  }
  return best;
}

size_t CudaAttentionScratchBytes(const Dims& dims, int num_splits) {
  if (num_splits <= 1) return 0;
  const size_t rows = static_cast<size_t>(dims.num_tokens) * dims.num_q_heads;
  return rows * (num_splits * (dims.head_dim + 2) + 2) * sizeof(float);
}

int CudaAttentionSharedBytes(int64_t head_dim, DType q_dtype, DType cache_dtype) {
  if (!UsesMma(head_dim, q_dtype, cache_dtype)) return 0;
  const bool fp8_cache = cache_dtype == DType::kF8E4M3;
  switch (head_dim) {
    case 64: return fp8_cache ? SmemLayout<__half, uint8_t, 64>::kBytes : SmemLayout<__half, __half, 64>::kBytes;
    case 128: return fp8_cache ? SmemLayout<__half, uint8_t, 128>::kBytes : SmemLayout<__half, __half, 128>::kBytes;
    case 256: return fp8_cache ? SmemLayout<__half, uint8_t, 256>::kBytes : SmemLayout<__half, __half, 256>::kBytes;
    default: return 0;
  }
}

const char* CudaAttentionUnsupported(int64_t head_dim) {
  return head_dim > kMaxHeadDim ? "the CUDA kernels support head_dim <= 256" : "";
}

Status CudaAttention(const Params& p, const Dims& dims, int num_splits, void* scratch, cudaStream_t stream) {
  if (dims.head_dim > kMaxHeadDim) {
    return Status::Unimplemented("paged attention CUDA: head_dim <= 256 required, got q " + p.q.ToString());
  }
  if (dims.num_tokens == 0 || dims.num_q_heads == 0 || dims.head_dim == 0) return Status::Ok();
  Args a{};
  a.q = p.q.data;
  a.k_cache = p.key_cache.data;
  a.v_cache = p.value_cache.data;
  a.kv_lens = p.kv_lens.ptr<int32_t>();
  a.block_tables = p.block_tables.ptr<int32_t>();
  a.query_start_loc = QueryStartLoc(p.query_start_loc);
  a.num_seqs = p.num_seqs.ptr<int32_t>();
  a.kv_starts = p.kv_starts.present() ? p.kv_starts.ptr<int32_t>() : nullptr;
  a.sinks = p.sinks.present() ? p.sinks.data : nullptr;
  a.out = p.out.data;
  a.q_dtype = p.q.dtype;
  a.sinks_dtype = p.sinks.present() ? p.sinks.dtype : DType::kF32;
  a.cache_dtype = p.key_cache.dtype;
  a.num_tokens = dims.num_tokens;
  a.num_q_heads = dims.num_q_heads;
  a.num_kv_heads = dims.num_kv_heads;
  a.group = dims.num_q_heads / dims.num_kv_heads;
  a.head_dim = dims.head_dim;
  a.num_pages = dims.num_pages;
  a.page_size = dims.page_size;
  a.max_seqs = dims.max_seqs;
  a.max_pages = dims.max_pages_per_seq;
  const int64_t S = dims.page_size, D = dims.head_dim, Hkv = dims.num_kv_heads;
  a.page_stride = S * Hkv * D;
  if (p.layout == KvLayout::kHeadMajor) {
    a.head_stride = S * D;
    a.slot_stride = D;
  } else {
    a.head_stride = D;
    a.slot_stride = Hkv * D;
  }
  a.page_shift = -1;
  for (int shift = 0; shift < 31; ++shift) {
    if ((int64_t{1} << shift) == S) a.page_shift = shift;
  }
  a.logit_scale = p.softmax_scale * p.k_scale;
  a.logit_scale2 = a.logit_scale * kLog2e;
  a.soft_cap = p.logits_soft_cap;
  a.v_scale = p.v_scale;
  a.window_left = p.window_left;
  a.causal = p.causal;
  if (num_splits > kMaxSplits) {
    return Status::InvalidArgument("paged attention CUDA: num_splits must be at most " + std::to_string(kMaxSplits) +
                                   ", got " + std::to_string(num_splits));
  }
  a.num_splits = std::max(1, num_splits);
  if (a.num_splits > 1) {
    if (scratch == nullptr) return Status::Internal("paged attention CUDA: split mode without scratch");
    a.partial_o = static_cast<float*>(scratch);
    const size_t rows = static_cast<size_t>(dims.num_tokens) * dims.num_q_heads;
    a.partial_ml = a.partial_o + a.num_splits * rows * D;
    a.split_counters = reinterpret_cast<unsigned int*>(a.partial_ml + a.num_splits * rows * 2);
    a.dynamic_splits = UsesMma(dims.head_dim, a.q_dtype, a.cache_dtype) && D <= kMaxFusedHeadDim;
    if (a.dynamic_splits) {
      const int64_t counters = static_cast<int64_t>(rows) * 2;
      ZeroCountersKernel<<<static_cast<unsigned>(std::min<int64_t>(1024, (counters + 255) / 256)), 256, 0, stream>>>(
          a.split_counters, counters);
      EJK_RETURN_IF_ERROR(LastLaunchError("split counter reset"));
    }
  }
  if (UsesMma(dims.head_dim, a.q_dtype, a.cache_dtype)) {
    SetLargeTiles(dims, &a);
    if (a.cache_dtype == DType::kF8E4M3) {
      a.logit_scale *= kFp8HalfScale;
      a.logit_scale2 *= kFp8HalfScale;
      a.v_scale *= kFp8HalfScale;
    }
    EJK_RETURN_IF_ERROR(D == 64    ? LaunchMmaForDim<64>(a, stream)
                        : D == 128 ? LaunchMmaForDim<128>(a, stream)
                                   : LaunchMmaForDim<256>(a, stream));
    EJK_RETURN_IF_ERROR(LastLaunchError("attention kernel"));
  } else {
    const int64_t items = dims.num_tokens * dims.num_q_heads;
    const dim3 grid(static_cast<unsigned>((items + kSimtWarps - 1) / kSimtWarps), static_cast<unsigned>(a.num_splits));
    PagedAttentionSimtKernel<<<grid, kSimtWarps * 32, 0, stream>>>(a);
    EJK_RETURN_IF_ERROR(LastLaunchError("SIMT attention kernel"));
  }
  if (a.num_splits > 1 && !a.dynamic_splits) {
    if (cudaError_t err = cu::LaunchAfterPrevious(ProgrammaticLaunchSupported(), CombineSplitsKernel,
                                                  dim3(static_cast<unsigned>(dims.num_tokens * dims.num_q_heads)),
                                                  dim3(kCombineThreads), 0, stream, a);
        err != cudaSuccess) {
      return Status::Internal(std::string("paged attention: split combine launch failed: ") + cudaGetErrorString(err));
    }
  }
  return Status::Ok();
}

}  // namespace ejk::paged_attention
