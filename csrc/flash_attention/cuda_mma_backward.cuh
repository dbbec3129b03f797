// Flash attention backward on tensor cores (mma.sync m16n8k16, ldmatrix, cp.async), in the
// FlashAttention-2 arrangement: P is recomputed from q, k and the forward's lse.
//
// KvKernel: one thread block per (key tile, batch row, kv head). It keeps its K and V tile in
// shared memory and dK, dV in registers, and walks the query tiles that can see its keys for
// every query head of the kv group (GQA never materialises per-q-head dK/dV). Each warp owns
// 16 keys and computes S^T = K Q^T and dP^T = V dO^T, so P^T and dS^T are already the A
// operands of dV += P^T dO and dK += dS^T Q. dS^T also goes to shared memory, from where the
// block computes dQ += dS K and adds it into an f32 accumulator: on sm_90 through the Q/dO
// stage it has finished with and one bulk asynchronous reduction per row (the add happens in
// L2), on sm_80 with atomics.
// For head dims above 128 the accumulators would not fit one warp: warps come in pairs over
// the same 16 keys, one computing S^T and the other dP^T (exchanged through shared memory),
// and each pair member accumulating half of the head dim of dK and dV.
//
// DqKernel (deterministic mode): one thread block per (query tile, batch row, q head), warps
// owning 16 queries, walking its key tiles in order and keeping dQ in registers; KvKernel
// then skips dQ, so no floating-point atomics run anywhere. dbias (broadcast dims summed)
// uses atomics only outside deterministic mode; there a block owns every (batch, kv head)
// pair that sums into its dbias elements and adds them in a fixed order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "flash_attention/cuda_build_scope.h"
#include "flash_attention/cuda_mma_features.cuh"
#include "flash_attention/semantics.h"
#include "runtime/cuda_mma.h"
#include "runtime/status.h"

namespace ejk::flash_attention::mma_backward {

using mma::FeatureArgs;
using mma::kLog2e;

// What the kernels read besides the feature arguments. Row statistics (lse in log2 units
// with -inf turned into +inf so that P = 0, and D_i) are [B, Hq, Sq] f32 from the
// preprocessing kernel; dq_accum is [B, Sq, Hq, D] f32 (null in deterministic mode).
struct KernelArgs {
  FeatureArgs f;
  const void *q, *k, *v, *dout;
  void *dq, *dk, *dv;
  const float* lse2;
  const float* delta;
  float* dq_accum;
  // [Bb, Hb, Sq, Sk] with f.bias_stride_*, null when not wanted: f32, or the bias's 16-bit
  // dtype (f16 or bf16, not necessarily T) where each element is written once (dbias_f32
  // false; never with dbias_atomic).
  void* dbias;
  bool dbias_atomic, dbias_f32, dbias_f16;
  bool dkv_f32;  // dK and dV stored unrounded in f32 (BackwardParams), else in T
  int32_t batch, num_kv_heads;
  int32_t pairs_b, pairs_h;  // (batch, kv head) pairs per KvKernel block
};

template <int kD>
struct KvTile {
  static constexpr bool kSplit = kD > 128;
  static constexpr int kBlockK = 64;
  static constexpr int kBlockQ = kSplit ? 32 : 64;
  static constexpr int kKeyGroups = kBlockK / 16;
  static constexpr int kWarps = kKeyGroups * (kSplit ? 2 : 1);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMinBlocks = kSplit ? 1 : 2;
  static constexpr int kQParts = kD == 128 ? 2 : 1;  // query parts per tile (register pressure)
  static constexpr int kDOut = kSplit ? kD / 2 : kD;  // dK/dV columns per warp
  static constexpr int kStride = kD + 8;              // padded rows: conflict-free ldmatrix
  static constexpr int kDsStride = kBlockQ + 8;
  static constexpr int kDqRowGroups = kBlockQ / 16;
  static constexpr int kDqColSplit = kWarps / kDqRowGroups;
  static constexpr int kDqCols = kD / kDqColSplit;
  static constexpr int kDqChunks = kDqCols > 96 ? 2 : 1;
  static constexpr int kDqChunk = kDqCols / kDqChunks;
  static constexpr int kTileBytes = kBlockK * kStride * 2;
  static constexpr int kQBytes = kBlockQ * kStride * 2;
  static constexpr int kOffV = kTileBytes;
  // Stage s holds Q_s and dO_s back to back; once dK and dV are updated it holds the f32
  // dQ tile on its way to global memory (rows padded to kDqStride floats).
  static constexpr int kOffQ = 2 * kTileBytes;
  static constexpr int kStageBytes = 2 * kQBytes;
  static constexpr int kOffDs = kOffQ + 2 * kStageBytes;
  static constexpr int kDqStride = kD + 4;
  static constexpr int kOffStats = kOffDs + kBlockK * kDsStride * 2;
  static constexpr int kOffX = kOffStats + 2 * 2 * kBlockQ * 4;
  static constexpr int kSmemBytes = kOffX + (kSplit ? kWarps * 16 * kBlockQ * 4 : 0);
  static_assert(kDOut % 16 == 0 && kDqChunk % 16 == 0, "tile shapes");
  static_assert(kBlockQ * kDqStride * 4 <= kStageBytes, "dQ staging must fit a Q/dO stage");
};

template <int kD>
struct DqTile {
  static constexpr int kBlockQ = 64;
  static constexpr int kBlockK = kD > 128 ? 32 : 64;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 128;
  static constexpr int kStride = kD + 8;
  static constexpr int kQBytes = kBlockQ * kStride * 2;
  static constexpr int kKBytes = kBlockK * kStride * 2;
  static constexpr int kOffDo = kQBytes;
  static constexpr int kOffK = 2 * kQBytes;
  static constexpr int kOffV = kOffK + 2 * kKBytes;
  static constexpr int kSmemBytes = kOffV + 2 * kKBytes;
};

// ---------------------------------------------------------------------------------------

// rows x kD elements from global rows `row_stride` apart into padded shared rows; rows at or
// past `valid` and columns at or past `cols` (the call's head dim) are zero-filled without
// reading.
template <typename T, int kD, int kThreads>
__device__ __forceinline__ void LoadRows(T* smem, const T* gmem, int64_t row_stride, int rows, int valid, int cols,
                                         const T* fallback) {
  constexpr int kChunks = kD / 8;
  for (int c = threadIdx.x; c < rows * kChunks; c += kThreads) {
    const int r = c / kChunks, x = c % kChunks;
    const bool ok = r < valid && x * 8 < cols;
    cuda::CpAsync16(smem + r * (kD + 8) + x * 8, ok ? gmem + r * row_stride + x * 8 : fallback, ok);
  }
}

// acc[16 x 8*kN] = A[16 rows of sa] * B[8*kN rows of sb]^T over kD columns (both row-major,
// padded stride kD + 8): S = Q K^T or, with keys as rows, S^T = K Q^T.
template <typename T, int kD, int kN>
__device__ __forceinline__ void RowsTimesRowsT(float (&acc)[kN][4], const T* sa, const T* sb, int lane) {
  constexpr int kStride = kD + 8;
#pragma unroll
  for (int n = 0; n < kN; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    uint32_t a[4];
    cuda::LdMatrixX4(a, sa + (lane % 16) * kStride + ks * 16 + (lane / 16) * 8);
#pragma unroll
    for (int np = 0; np < kN / 2; ++np) {
      uint32_t bb[4];
      cuda::LdMatrixX4(bb, sb + (np * 16 + (lane % 8) + (lane / 16) * 8) * kStride + ks * 16 + ((lane / 8) % 2) * 8);
      const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
      cuda::Mma16816<T>(acc[2 * np], a, b0);
      cuda::Mma16816<T>(acc[2 * np + 1], a, b1);
    }
  }
}

// acc[16 x 8*kN] += A * B where A (16 x 16*kK) comes as C fragments c[16 x 8*(2kK)] in
// registers and B is kK*16 rows of a row-major shared tile (stride `stride`), columns
// [col0, col0 + 8*kN).
template <typename T, int kK, int kN>
__device__ __forceinline__ void FragTimesRows(float (&acc)[kN][4], const float (&c)[2 * kK][4], const T* sb,
                                              int stride, int col0, int lane) {
#pragma unroll
  for (int ks = 0; ks < kK; ++ks) {
    const uint32_t a[4] = {cuda::PackFloat2<T>(c[2 * ks][0], c[2 * ks][1]),
                           cuda::PackFloat2<T>(c[2 * ks][2], c[2 * ks][3]),
                           cuda::PackFloat2<T>(c[2 * ks + 1][0], c[2 * ks + 1][1]),
                           cuda::PackFloat2<T>(c[2 * ks + 1][2], c[2 * ks + 1][3])};
#pragma unroll
    for (int np = 0; np < kN / 2; ++np) {
      uint32_t bb[4];
      cuda::LdMatrixX4Trans(bb, sb + (ks * 16 + lane % 16) * stride + col0 + np * 16 + (lane / 16) * 8);
      const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
      cuda::Mma16816<T>(acc[2 * np], a, b0);
      cuda::Mma16816<T>(acc[2 * np + 1], a, b1);
    }
  }
}

// sm_90 bulk asynchronous reduction of `bytes` (multiple of 16) f32s from shared memory into
// global memory, and the wait until its source has been read (no-ops before sm_90).
__device__ __forceinline__ void BulkReduceAdd(float* gmem, const float* smem, int bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
      "cp.async.bulk.commit_group;\n" ::"l"(gmem),
      "r"(cuda::SharedAddress(smem)), "r"(bytes)
      : "memory");
#endif
}

__device__ __forceinline__ void BulkWaitRead(bool issued) {
#if __CUDA_ARCH__ >= 900
  if (issued) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}

// ... and until its writes to global memory are done.
__device__ __forceinline__ void BulkWaitAll(bool issued) {
#if __CUDA_ARCH__ >= 900
  if (issued) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

// Per-block view of one sequence: local query/key indices, their offsets in the batch row.
struct Seq {
  int32_t q_begin, q_len, k_begin, k_len;
};

__device__ __forceinline__ bool LocalVisible(const FeatureArgs& f, const Seq& s, int32_t i, int32_t j) {
  return i < s.q_len && j < s.k_len &&
         KeyVisible(i, j, s.k_len - s.q_len, f.causal, f.window_left, f.window_right);
}

// Whether every (query, key) of the tiles passes the bounds, causal and window tests.
__device__ __forceinline__ bool TileFullyVisible(const FeatureArgs& f, const Seq& s, int32_t i0, int32_t bq,
                                                 int32_t j0, int32_t bk) {
  if (i0 + bq > s.q_len || j0 + bk > s.k_len) return false;
  const int64_t offset = s.k_len - s.q_len;
  if (f.causal || f.window_right >= 0) {
    const int64_t right = f.causal ? 0 : f.window_right;  // causal caps any right window at 0
    if (j0 + bk - 1 > i0 + offset + right) return false;
  }
  if (f.window_left >= 0 && j0 < i0 + bq - 1 + offset - f.window_left) return false;
  return true;
}

// The dropout multipliers (0 or 1 / (1 - p)) of keys j and j + 8 of a row (local, j % 16 < 8),
// from one hash (DropoutKeepPair).
__device__ __forceinline__ void DropoutPairMultipliers(const FeatureArgs& f, uint32_t row_key, int32_t j, float& z,
                                                       float& z_plus_8) {
  bool keep, keep_plus_8;
  DropoutKeepPair(row_key, static_cast<uint32_t>(j), f.dropout_threshold << 16, keep, keep_plus_8);
  z = keep ? f.dropout_scale : 0.0f;
  z_plus_8 = keep_plus_8 ? f.dropout_scale : 0.0f;
}

// The gradient of one (query i, key j) element, local indices. In: raw = q.k, dp = dO.v,
// and (kGeneral) the element's bias, mask/segment verdict (mma::ReadElements) and dropout
// multiplier z (DropoutPairMultipliers; 1 without dropout). Out: pk = dropout(P) (for dV),
// ds = dL/d(scale * q.k) (for dK, dQ), and returns dL/d(logit) (for dbias), all 0 where
// (i, j) is not visible.
template <bool kGeneral>
__device__ __forceinline__ float ElementGrad(const FeatureArgs& f, const Seq& s, bool check, int32_t i, int32_t j,
                                             float lse2, float delta, float z, float bias, bool shown,
                                             float& raw_to_pk, float& dp_to_ds) {
  if constexpr (!kGeneral) {
    float p = exp2f(fmaf(raw_to_pk, f.scale_log2, -lse2));
    if (check && !LocalVisible(f, s, i, j)) p = 0.0f;
    const float ds = p * (dp_to_ds - delta);
    raw_to_pk = p;
    dp_to_ds = ds;
    return ds;
  } else {
    const bool visible = (!check || LocalVisible(f, s, i, j)) && shown;
    float t = 0.0f, logit = raw_to_pk * f.scale;
    if (f.soft_cap > 0.0f) {
      t = tanhf(logit / f.soft_cap);
      logit = f.soft_cap * t;
    }
    logit += bias;
    const float p = visible ? exp2f(fmaf(logit, kLog2e, -lse2)) : 0.0f;
    const float dlogit = p * (fmaf(dp_to_ds, z, -delta));
    raw_to_pk = p * z;
    dp_to_ds = f.soft_cap > 0.0f ? dlogit * (1.0f - t * t) : dlogit;
    return dlogit;
  }
}

// Sequence n of a packed batch and the key tile of it that block `tile` handles: blocks are
// numbered through the sequences' tiles in order. False when the block has no tile.
__device__ __forceinline__ bool FindTile(const FeatureArgs& f, bool keys, int32_t block_tile, int32_t tile_size,
                                         Seq* s, int32_t* tile) {
  if (f.cu_q == nullptr) {
    *s = Seq{0, f.seqlen_q, 0, f.seqlen_k};
    *tile = block_tile;
    return true;
  }
  int32_t t = block_tile;
  for (int32_t n = 0; n < f.num_sequences; ++n) {
    const mma::SeqBounds sb = mma::SequenceAt(f, n);
    const int32_t len = keys ? sb.k_end - sb.k_begin : sb.q_end - sb.q_begin;
    const int32_t tiles = (len + tile_size - 1) / tile_size;
    if (t < tiles) {
      *s = Seq{sb.q_begin, sb.q_end - sb.q_begin, sb.k_begin, sb.k_end - sb.k_begin};
      *tile = t;
      return true;
    }
    t -= tiles;
  }
  return false;
}

// ---------------------------------------------------------------------------------------

template <typename T, int kD, bool kGeneral>
__global__ void __launch_bounds__(KvTile<kD>::kThreads, KvTile<kD>::kMinBlocks) KvKernel(const KernelArgs a) {
  using C = KvTile<kD>;
  constexpr int kPartRows = C::kBlockQ / C::kQParts;
  constexpr int kNqp = kPartRows / 8;  // n-tiles of queries in S^T of one part
  constexpr int kNd = C::kDOut / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* s_k = reinterpret_cast<T*>(smem);
  T* s_v = reinterpret_cast<T*>(smem + C::kOffV);
  T* s_ds = reinterpret_cast<T*>(smem + C::kOffDs);
  float* s_stats = reinterpret_cast<float*>(smem + C::kOffStats);
  float* s_x = reinterpret_cast<float*>(smem + C::kOffX);
  const FeatureArgs& f = a.f;

  Seq s;
  int32_t tile;
  if (!FindTile(f, true, blockIdx.x, C::kBlockK, &s, &tile)) return;
  const int32_t j0 = tile * C::kBlockK;
  if (j0 >= s.k_len) return;
  const int32_t kv_valid = min(C::kBlockK, s.k_len - j0);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int kg = warp % C::kKeyGroups, half = warp / C::kKeyGroups;
  const int32_t D = f.head_dim, Sq = f.seqlen_q, Sk = f.seqlen_k, Hq = f.num_q_heads, Hkv = a.num_kv_heads;
  const int32_t group = f.group;
  const uint32_t seed = (kGeneral && f.dropout) ? __ldg(f.dropout_seed) : 0u;

  // Query tiles that can see a key of this tile.
  int64_t qb, qe_first, qb_last, qe;
  mma::VisibleQueryRange(j0, s.q_len, s.k_len - s.q_len, f.causal, f.window_left, f.window_right, &qb, &qe_first);
  mma::VisibleQueryRange(j0 + kv_valid - 1, s.q_len, s.k_len - s.q_len, f.causal, f.window_left, f.window_right,
                         &qb_last, &qe);
  const int32_t qt_lo = static_cast<int32_t>(qb / C::kBlockQ);
  const int32_t nq = qe > qb ? static_cast<int32_t>((qe + C::kBlockQ - 1) / C::kBlockQ) - qt_lo : 0;
  const int32_t items = nq * group;

  const int32_t groups_h = Hkv / a.pairs_h;
  const int32_t b_first = (blockIdx.y / groups_h) * a.pairs_b, kvh_first = (blockIdx.y % groups_h) * a.pairs_h;
  const int64_t q_row_stride = static_cast<int64_t>(Hq) * D, kv_row_stride = static_cast<int64_t>(Hkv) * D;

  for (int32_t pair = 0; pair < a.pairs_b * a.pairs_h; ++pair) {
    const int32_t b = b_first + pair / a.pairs_h, kvh = kvh_first + pair % a.pairs_h;
    const int64_t kv_off = ((static_cast<int64_t>(b) * Sk + s.k_begin + j0) * Hkv + kvh) * D;
    LoadRows<T, kD, C::kThreads>(s_k, static_cast<const T*>(a.k) + kv_off, kv_row_stride, C::kBlockK, kv_valid, D,
                                 static_cast<const T*>(a.k));
    LoadRows<T, kD, C::kThreads>(s_v, static_cast<const T*>(a.v) + kv_off, kv_row_stride, C::kBlockK, kv_valid, D,
                                 static_cast<const T*>(a.v));

    float dk[kNd][4], dv[kNd][4];
#pragma unroll
    for (int n = 0; n < kNd; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;
    }

    // Work item `it`: q head kvh * group + it / nq, query tile qt_lo + it % nq.
    float next_lse2 = INFINITY, next_delta = 0.0f;
    auto issue = [&](int32_t it, int stage) {
      const int32_t h = kvh * group + it / nq, i0 = (qt_lo + it % nq) * C::kBlockQ;
      const int32_t valid = min(C::kBlockQ, s.q_len - i0);
      const int64_t q_off = ((static_cast<int64_t>(b) * Sq + s.q_begin + i0) * Hq + h) * D;
      LoadRows<T, kD, C::kThreads>(reinterpret_cast<T*>(smem + C::kOffQ + stage * C::kStageBytes),
                                   static_cast<const T*>(a.q) + q_off, q_row_stride, C::kBlockQ, valid, D,
                                   static_cast<const T*>(a.q));
      LoadRows<T, kD, C::kThreads>(reinterpret_cast<T*>(smem + C::kOffQ + stage * C::kStageBytes + C::kQBytes),
                                   static_cast<const T*>(a.dout) + q_off, q_row_stride, C::kBlockQ, valid, D,
                                   static_cast<const T*>(a.dout));
      cuda::CpAsyncCommit();
      if (tid < C::kBlockQ) {
        next_lse2 = INFINITY;
        next_delta = 0.0f;
        if (tid < valid) {
          const int64_t row = (static_cast<int64_t>(b) * Hq + h) * Sq + s.q_begin + i0 + tid;
          next_lse2 = __ldg(a.lse2 + row);
          next_delta = __ldg(a.delta + row);
        }
      }
    };
    if (items > 0) {
      issue(0, 0);
    } else {
      cuda::CpAsyncCommit();
    }
    // The dropout hash's (batch, head) index of the first item's head; item it's is it / nq more.
    const uint32_t dropout_batch_head =
        kGeneral && f.dropout ? DropoutBatchHead(f.dropout_origin, static_cast<uint32_t>(Hq), static_cast<uint32_t>(b),
                                                 static_cast<uint32_t>(kvh * group))
                              : 0u;

    for (int32_t it = 0; it < items; ++it) {
      const int stage = it & 1;
      const int32_t h = kvh * group + it / nq, i0 = (qt_lo + it % nq) * C::kBlockQ;
      float* stats = s_stats + stage * 2 * C::kBlockQ;
      if (tid < C::kBlockQ) {
        stats[tid] = next_lse2;
        stats[C::kBlockQ + tid] = next_delta;
      }
      // The previous item is done: its stage (dQ staging included) may be overwritten.
      BulkWaitRead(tid < C::kBlockQ);
      __syncthreads();
      if (it + 1 < items) {
        issue(it + 1, stage ^ 1);
        cuda::CpAsyncWait<1>();
      } else {
        cuda::CpAsyncWait<0>();
      }
      __syncthreads();
      unsigned char* stage_base = smem + C::kOffQ + stage * C::kStageBytes;
      const T* s_q = reinterpret_cast<const T*>(stage_base);
      const T* s_do = reinterpret_cast<const T*>(stage_base + C::kQBytes);

      const bool check = !TileFullyVisible(f, s, i0, C::kBlockQ, j0, C::kBlockK);
      const bool write_dbias = kGeneral && a.dbias != nullptr && half == 0;
      const uint32_t head_key =
          kGeneral && f.dropout ? DropoutHeadKey(seed, dropout_batch_head + static_cast<uint32_t>(it / nq)) : 0u;
      // Query parts of the tile one after another, to keep S^T and dP^T small next to dK, dV.
#pragma unroll 1
      for (int qp = 0; qp < C::kQParts; ++qp) {
        const T* s_qp = s_q + qp * kPartRows * C::kStride;
        const T* s_dop = s_do + qp * kPartRows * C::kStride;
        float sc[kNqp][4], dp[kNqp][4];
        if constexpr (!C::kSplit) {
          RowsTimesRowsT<T, kD, kNqp>(sc, s_k + kg * 16 * C::kStride, s_qp, lane);
          RowsTimesRowsT<T, kD, kNqp>(dp, s_v + kg * 16 * C::kStride, s_dop, lane);
        } else {
          // One pair member computes S^T, the other dP^T; they swap through shared memory.
          if (half == 0) {
            RowsTimesRowsT<T, kD, kNqp>(sc, s_k + kg * 16 * C::kStride, s_qp, lane);
          } else {
            RowsTimesRowsT<T, kD, kNqp>(dp, s_v + kg * 16 * C::kStride, s_dop, lane);
          }
          float* x_mine = s_x + warp * 16 * C::kBlockQ;
#pragma unroll
          for (int n = 0; n < kNqp; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) x_mine[(n * 4 + e) * 32 + lane] = half == 0 ? sc[n][e] : dp[n][e];
          }
          __syncthreads();
          const float* x_other = s_x + (warp ^ C::kKeyGroups) * 16 * C::kBlockQ;
#pragma unroll
          for (int n = 0; n < kNqp; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float v = x_other[(n * 4 + e) * 32 + lane];
              if (half == 0) {
                dp[n][e] = v;
              } else {
                sc[n][e] = v;
              }
            }
          }
        }

        const auto element_query = [&](int n, int e) { return qp * kPartRows + n * 8 + 2 * t4 + (e & 1); };
        const auto element_key = [&](int e) { return kg * 16 + g + (e >> 1) * 8; };
        float bias[kNqp][4];
        bool shown[kNqp][4];
        float z[kNqp][4];
        if constexpr (kGeneral) {
          mma::ReadElements<kNqp, false>(f, b, h, [&](int n, int e) {
            return make_int2(s.q_begin + i0 + element_query(n, e), s.k_begin + j0 + element_key(e));
          }, bias, shown);
          // Elements e and e + 2 hold keys 8 apart, the first with (key % 16) < 8.
#pragma unroll
          for (int n = 0; n < kNqp; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              z[n][e] = z[n][e + 2] = 1.0f;
              if (f.dropout) {
                const uint32_t row_key =
                    DropoutRowKeyOfHead(head_key, static_cast<uint32_t>(s.q_begin + i0 + element_query(n, e)));
                DropoutPairMultipliers(f, row_key, j0 + element_key(e), z[n][e], z[n][e + 2]);
              }
            }
          }
        }
#pragma unroll
        for (int n = 0; n < kNqp; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int32_t qi = element_query(n, e), kj = element_key(e);
            const float dlogit =
                ElementGrad<kGeneral>(f, s, check, i0 + qi, j0 + kj, stats[qi], stats[C::kBlockQ + qi],
                                      kGeneral ? z[n][e] : 1.0f, kGeneral ? bias[n][e] : 0.0f,
                                      kGeneral ? shown[n][e] : true, sc[n][e], dp[n][e]);
            if constexpr (kGeneral) {
              // Every element inside the sequence, zeros included (the Hopper backward's rule).
              if (write_dbias && i0 + qi < s.q_len && j0 + kj < s.k_len) {
                const int64_t at = b * f.bias_stride_b + h * f.bias_stride_h +
                                   static_cast<int64_t>(s.q_begin + i0 + qi) * Sk + s.k_begin + j0 + kj;
                if (a.dbias_atomic) {
                  atomicAdd(static_cast<float*>(a.dbias) + at, dlogit);
                } else if (a.dbias_f32) {
                  static_cast<float*>(a.dbias)[at] += dlogit;
                } else if (a.dbias_f16) {
                  static_cast<__half*>(a.dbias)[at] = __float2half_rn(dlogit);
                } else {
                  static_cast<__nv_bfloat16*>(a.dbias)[at] = __float2bfloat16_rn(dlogit);
                }
              }
            }
          }
        }

        // dV += P^T dO, dK += dS^T Q over this warp's half of the head dim.
        FragTimesRows<T, kNqp / 2, kNd>(dv, sc, s_dop, C::kStride, half * C::kDOut, lane);
        FragTimesRows<T, kNqp / 2, kNd>(dk, dp, s_qp, C::kStride, half * C::kDOut, lane);

        if (a.dq_accum != nullptr && half == 0) {
#pragma unroll
          for (int n = 0; n < kNqp; ++n) {
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
              T* at = s_ds + (kg * 16 + g + (e >> 1) * 8) * C::kDsStride + qp * kPartRows + n * 8 + 2 * t4;
              *reinterpret_cast<uint32_t*>(at) = cuda::PackFloat2<T>(dp[n][e], dp[n][e + 1]);
            }
          }
        }
      }

      if (a.dq_accum != nullptr) {
        __syncthreads();
        // dQ[rows, cols] += dS K over the block's keys.
        const int rg = warp % C::kDqRowGroups, cs = warp / C::kDqRowGroups;
        const int m0 = rg * 16;
#pragma unroll
        for (int chunk = 0; chunk < C::kDqChunks; ++chunk) {
          const int col0 = cs * C::kDqCols + chunk * C::kDqChunk;
          constexpr int kNc = C::kDqChunk / 8;
          float acc[kNc][4];
#pragma unroll
          for (int n = 0; n < kNc; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
          for (int ks = 0; ks < C::kBlockK / 16; ++ks) {
            uint32_t af[4];
            const int mi = lane / 8;
            cuda::LdMatrixX4Trans(af, s_ds + (ks * 16 + lane % 8 + 8 * (mi / 2)) * C::kDsStride + m0 + 8 * (mi % 2));
#pragma unroll
            for (int np = 0; np < kNc / 2; ++np) {
              uint32_t bb[4];
              cuda::LdMatrixX4Trans(bb, s_k + (ks * 16 + lane % 16) * C::kStride + col0 + np * 16 + (lane / 16) * 8);
              const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
              cuda::Mma16816<T>(acc[2 * np], af, b0);
              cuda::Mma16816<T>(acc[2 * np + 1], af, b1);
            }
          }
#if __CUDA_ARCH__ >= 900
          float* staging = reinterpret_cast<float*>(stage_base);
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            float* row = staging + (m0 + g + e2 * 8) * C::kDqStride + col0 + 2 * t4;
#pragma unroll
            for (int n = 0; n < kNc; ++n) {
              *reinterpret_cast<float2*>(row + n * 8) = make_float2(acc[n][2 * e2], acc[n][2 * e2 + 1]);
            }
          }
#else
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const int32_t qi = i0 + m0 + g + e2 * 8;
            if (qi < s.q_len) {
              float* row = a.dq_accum + ((static_cast<int64_t>(b) * Sq + s.q_begin + qi) * Hq + h) * D + col0 + 2 * t4;
#pragma unroll
              for (int n = 0; n < kNc; ++n) {
                if (col0 + n * 8 < D) {
                  atomicAdd(row + n * 8, acc[n][2 * e2]);
                  atomicAdd(row + n * 8 + 1, acc[n][2 * e2 + 1]);
                }
              }
            }
          }
#endif
        }
#if __CUDA_ARCH__ >= 900
        // One bulk reduction (add in L2) per row of the tile.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        if (tid < min(C::kBlockQ, s.q_len - i0)) {
          float* dst = a.dq_accum + ((static_cast<int64_t>(b) * Sq + s.q_begin + i0 + tid) * Hq + h) * D;
          BulkReduceAdd(dst, reinterpret_cast<float*>(stage_base) + tid * C::kDqStride, D * 4);
        }
#endif
      }
    }

    BulkWaitAll(tid < C::kBlockQ);
    // dK (scaled) and dV rows of this warp's keys.
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2) {
      const int32_t kj = kg * 16 + g + e2 * 8;
      if (kj < kv_valid) {
        const int64_t off = ((static_cast<int64_t>(b) * Sk + s.k_begin + j0 + kj) * Hkv + kvh) * D + half * C::kDOut +
                            2 * t4;
#pragma unroll
        for (int n = 0; n < kNd; ++n) {
          if (half * C::kDOut + n * 8 >= D) break;
          const float2 dk2 = make_float2(dk[n][2 * e2] * f.scale, dk[n][2 * e2 + 1] * f.scale);
          const float2 dv2 = make_float2(dv[n][2 * e2], dv[n][2 * e2 + 1]);
          if (a.dkv_f32) {
            *reinterpret_cast<float2*>(static_cast<float*>(a.dk) + off + n * 8) = dk2;
            *reinterpret_cast<float2*>(static_cast<float*>(a.dv) + off + n * 8) = dv2;
          } else {
            *reinterpret_cast<uint32_t*>(static_cast<T*>(a.dk) + off + n * 8) = cuda::PackFloat2<T>(dk2.x, dk2.y);
            *reinterpret_cast<uint32_t*>(static_cast<T*>(a.dv) + off + n * 8) = cuda::PackFloat2<T>(dv2.x, dv2.y);
          }
        }
      }
    }
    // The next pair reloads K and V: every copy must have landed and every warp be done reading.
    cuda::CpAsyncWait<0>();
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------

template <typename T, int kD, bool kGeneral>
__global__ void __launch_bounds__(DqTile<kD>::kThreads, 2) DqKernel(const KernelArgs a) {
  using C = DqTile<kD>;
  constexpr int kNk = C::kBlockK / 8;
  constexpr int kNd = kD / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* s_q = reinterpret_cast<T*>(smem);
  T* s_do = reinterpret_cast<T*>(smem + C::kOffDo);
  const FeatureArgs& f = a.f;

  Seq s;
  int32_t tile;
  if (!FindTile(f, false, blockIdx.x, C::kBlockQ, &s, &tile)) return;
  const int32_t i0 = tile * C::kBlockQ;
  if (i0 >= s.q_len) return;
  const int32_t q_valid = min(C::kBlockQ, s.q_len - i0);
  const int32_t Hq = f.num_q_heads, Sq = f.seqlen_q, Sk = f.seqlen_k, Hkv = a.num_kv_heads, D = f.head_dim;
  const int32_t b = blockIdx.y / Hq, h = blockIdx.y % Hq, kvh = h / f.group;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const uint32_t seed = (kGeneral && f.dropout) ? __ldg(f.dropout_seed) : 0u;

  int64_t jb, je_first, jb_last, je;
  VisibleKeyRange(i0, s.k_len, s.k_len - s.q_len, f.causal, f.window_left, f.window_right, &jb, &je_first);
  VisibleKeyRange(i0 + q_valid - 1, s.k_len, s.k_len - s.q_len, f.causal, f.window_left, f.window_right, &jb_last,
                  &je);
  const int32_t kt_lo = static_cast<int32_t>(jb / C::kBlockK);
  const int32_t nk = je > jb ? static_cast<int32_t>((je + C::kBlockK - 1) / C::kBlockK) - kt_lo : 0;

  const int64_t q_row_stride = static_cast<int64_t>(Hq) * D, kv_row_stride = static_cast<int64_t>(Hkv) * D;
  const int64_t q_off = ((static_cast<int64_t>(b) * Sq + s.q_begin + i0) * Hq + h) * D;
  LoadRows<T, kD, C::kThreads>(s_q, static_cast<const T*>(a.q) + q_off, q_row_stride, C::kBlockQ, q_valid, D,
                               static_cast<const T*>(a.q));
  LoadRows<T, kD, C::kThreads>(s_do, static_cast<const T*>(a.dout) + q_off, q_row_stride, C::kBlockQ, q_valid, D,
                               static_cast<const T*>(a.dout));
  auto issue = [&](int32_t it, int stage) {
    const int32_t j0 = (kt_lo + it) * C::kBlockK;
    const int32_t valid = min(C::kBlockK, s.k_len - j0);
    const int64_t kv_off = ((static_cast<int64_t>(b) * Sk + s.k_begin + j0) * Hkv + kvh) * D;
    LoadRows<T, kD, C::kThreads>(reinterpret_cast<T*>(smem + C::kOffK + stage * C::kKBytes),
                                 static_cast<const T*>(a.k) + kv_off, kv_row_stride, C::kBlockK, valid, D,
                                 static_cast<const T*>(a.k));
    LoadRows<T, kD, C::kThreads>(reinterpret_cast<T*>(smem + C::kOffV + stage * C::kKBytes),
                                 static_cast<const T*>(a.v) + kv_off, kv_row_stride, C::kBlockK, valid, D,
                                 static_cast<const T*>(a.v));
    cuda::CpAsyncCommit();
  };
  if (nk > 0) {
    issue(0, 0);
  } else {
    cuda::CpAsyncCommit();
  }

  float lse2[2], delta[2];
  uint32_t row_keys[2] = {0u, 0u};  // dropout's, of this thread's two queries
  const uint32_t head_key =
      kGeneral && f.dropout ? DropoutHeadKey(seed, DropoutBatchHead(f.dropout_origin, static_cast<uint32_t>(Hq),
                                                                    static_cast<uint32_t>(b), static_cast<uint32_t>(h)))
                            : 0u;
#pragma unroll
  for (int e2 = 0; e2 < 2; ++e2) {
    const int32_t qi = warp * 16 + g + e2 * 8;
    lse2[e2] = INFINITY;
    delta[e2] = 0.0f;
    if (kGeneral && f.dropout) row_keys[e2] = DropoutRowKeyOfHead(head_key, static_cast<uint32_t>(s.q_begin + i0 + qi));
    if (qi < q_valid) {
      const int64_t row = (static_cast<int64_t>(b) * Hq + h) * Sq + s.q_begin + i0 + qi;
      lse2[e2] = __ldg(a.lse2 + row);
      delta[e2] = __ldg(a.delta + row);
    }
  }
  float acc[kNd][4];
#pragma unroll
  for (int n = 0; n < kNd; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

  for (int32_t it = 0; it < nk; ++it) {
    const int stage = it & 1;
    const int32_t j0 = (kt_lo + it) * C::kBlockK;
    if (it + 1 < nk) {
      issue(it + 1, stage ^ 1);
      cuda::CpAsyncWait<1>();
    } else {
      cuda::CpAsyncWait<0>();
    }
    __syncthreads();
    const T* s_k = reinterpret_cast<const T*>(smem + C::kOffK + stage * C::kKBytes);
    const T* s_v = reinterpret_cast<const T*>(smem + C::kOffV + stage * C::kKBytes);
    float sc[kNk][4], dp[kNk][4];
    RowsTimesRowsT<T, kD, kNk>(sc, s_q + warp * 16 * C::kStride, s_k, lane);
    RowsTimesRowsT<T, kD, kNk>(dp, s_do + warp * 16 * C::kStride, s_v, lane);
    const bool check = !TileFullyVisible(f, s, i0, C::kBlockQ, j0, C::kBlockK);
    const auto element_query = [&](int e) { return warp * 16 + g + (e >> 1) * 8; };
    const auto element_key = [&](int n, int e) { return n * 8 + 2 * t4 + (e & 1); };
    float bias[kNk][4];
    bool shown[kNk][4];
    float z[kNk][4];
    if constexpr (kGeneral) {
      mma::ReadElements<kNk, true>(f, b, h, [&](int n, int e) {
        return make_int2(s.q_begin + i0 + element_query(e), s.k_begin + j0 + element_key(n, e));
      }, bias, shown);
      // Fragments n and n + 1 (n even) hold keys 8 apart, the first with (key % 16) < 8.
#pragma unroll
      for (int n = 0; n < kNk; n += 2) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          z[n][e] = z[n + 1][e] = 1.0f;
          if (f.dropout) DropoutPairMultipliers(f, row_keys[e >> 1], j0 + element_key(n, e), z[n][e], z[n + 1][e]);
        }
      }
    }
#pragma unroll
    for (int n = 0; n < kNk; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        ElementGrad<kGeneral>(f, s, check, i0 + element_query(e), j0 + element_key(n, e), lse2[e >> 1],
                              delta[e >> 1], kGeneral ? z[n][e] : 1.0f, kGeneral ? bias[n][e] : 0.0f,
                              kGeneral ? shown[n][e] : true, sc[n][e], dp[n][e]);
      }
    }
    FragTimesRows<T, kNk / 2, kNd>(acc, dp, s_k, C::kStride, 0, lane);
    __syncthreads();
  }
  cuda::CpAsyncWait<0>();  // with no key tile, the Q and dO copies are still pending

#pragma unroll
  for (int e2 = 0; e2 < 2; ++e2) {
    const int32_t qi = warp * 16 + g + e2 * 8;
    if (qi < q_valid) {
      T* row = static_cast<T*>(a.dq) + ((static_cast<int64_t>(b) * Sq + s.q_begin + i0 + qi) * Hq + h) * D + 2 * t4;
#pragma unroll
      for (int n = 0; n < kNd; ++n) {
        if (n * 8 >= D) break;
        *reinterpret_cast<uint32_t*>(row + n * 8) =
            cuda::PackFloat2<T>(acc[n][2 * e2] * f.scale, acc[n][2 * e2 + 1] * f.scale);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------

template <typename Kernel>
Status Launch(Kernel kernel, dim3 grid, int threads, int smem, const KernelArgs& a, cudaStream_t stream) {
  if (grid.x == 0 || grid.y == 0) return Status::Ok();
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err == cudaSuccess) {
    kernel<<<grid, threads, smem, stream>>>(a);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) {
    return Status::Internal(std::string("flash attention backward kernel launch failed: ") + cudaGetErrorString(err));
  }
  return Status::Ok();
}

// Grid sizes: key (or query) tiles, with packed sequences an upper bound that the blocks
// past the last sequence's tiles leave idle.
inline unsigned TileBlocks(const FeatureArgs& f, int64_t length, int tile) {
  const int64_t tiles = (length + tile - 1) / tile + (f.cu_q != nullptr ? f.num_sequences : 0);
  return static_cast<unsigned>(tiles);
}

template <typename T, int kD, bool kGeneral>
Status LaunchTyped(const KernelArgs& a, bool deterministic, cudaStream_t stream) {
  using Kv = KvTile<kD>;
  const FeatureArgs& f = a.f;
  const dim3 kv_grid(TileBlocks(f, f.seqlen_k, Kv::kBlockK),
                     static_cast<unsigned>((a.batch / a.pairs_b) * (a.num_kv_heads / a.pairs_h)));
  EJK_RETURN_IF_ERROR(Launch(KvKernel<T, kD, kGeneral>, kv_grid, Kv::kThreads, Kv::kSmemBytes, a, stream));
  if (deterministic) {
    using Dq = DqTile<kD>;
    const dim3 dq_grid(TileBlocks(f, f.seqlen_q, Dq::kBlockQ), static_cast<unsigned>(a.batch * f.num_q_heads));
    EJK_RETURN_IF_ERROR(Launch(DqKernel<T, kD, kGeneral>, dq_grid, Dq::kThreads, Dq::kSmemBytes, a, stream));
  }
  return Status::Ok();
}

template <typename T, int kD>
Status LaunchVariant(const KernelArgs& a, bool general, bool deterministic, cudaStream_t stream) {
  return general ? LaunchTyped<T, kD, true>(a, deterministic, stream)
                 : LaunchTyped<T, kD, false>(a, deterministic, stream);
}

// The dK/dV (and, outside deterministic mode, dQ accumulation) kernels for one head dim;
// instantiated in cuda_mma_backward_hdim<d>.cu.
template <int kD>
Status LaunchHeadDim(const KernelArgs& a, bool bf16, bool general, bool deterministic, cudaStream_t stream) {
  if (bf16) return LaunchVariant<__nv_bfloat16, kD>(a, general, deterministic, stream);
  if constexpr (kFloat16Built) {
    return LaunchVariant<__half, kD>(a, general, deterministic, stream);
  } else {
    return FeatureNotBuilt("float16");
  }
}

}  // namespace ejk::flash_attention::mma_backward
