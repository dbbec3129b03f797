// Flash attention forward on tensor cores with mma.sync (sm_80+): FlashAttention-2 style.
//
// One thread block per (query tile, query head, batch row); each warp owns 16 * kMTiles query
// rows and the whole key tile. Per key tile: S = Q K^T (mma.m16n8k16, K fragments from
// ldmatrix), logits and online softmax in registers (row statistics reduced over the quad of
// lanes sharing a row), P converted in registers from the C to the A fragment layout, and
// O += P V (V fragments from ldmatrix.trans). K and V tiles stream through a kStages-deep
// cp.async ring, K and V in separate commit groups so that S can start before V lands. Shared
// memory rows are padded by 16 bytes, which makes every ldmatrix and the epilogue's stores
// bank-conflict free. Q fragments stay in registers when they fit (kQInRegs), else they are
// re-read from shared memory per key tile.
//
// Variants (template flags, chosen per call):
//   kMasked:  rows see different key ranges (causal, sliding window, packed sequences). The
//             block loops only over the union of its rows' visible keys, and the per-element
//             range test runs only on tiles that cross some row's range edge.
//   kGeneral: bias, attention mask, segment ids or dropout (per-element feature code); also
//             a softmax scale <= 0, which the plain kernels' folded scale cannot take.
// Soft cap and sinks are uniform runtime branches. Plain and causal attention run no
// per-element feature code on interior tiles: the scale folds into the exponent's FFMA, and
// the O rescale is skipped when no row max of the warp moved.
//
// Tile configs (block_q, block_k, num_warps, num_stages) per head dim: the lists of
// cuda_tiles.h (kMmaTilesD64, ...), instantiated in cuda_mma_forward_hdim*.cu (DispatchTiles);
// ForwardMma turns a config that names none of them into the call's default
// (ChooseMmaForwardTile). A config whose shared memory exceeds the device's limit falls back
// to the next one that fits, in list order (sm_80 and sm_86 have less shared memory per block
// than sm_90).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <string>
#include <utility>

#include "flash_attention/cuda.h"
#include "flash_attention/cuda_build_scope.h"
#include "flash_attention/cuda_mma_features.cuh"
#include "runtime/cuda_mma.h"

namespace ejk::flash_attention {

// Per head dim entry points (cuda_mma_forward_hdim<d>.cu), for validated, supported calls.
Status ForwardMmaHeadDim64(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
Status ForwardMmaHeadDim96(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
Status ForwardMmaHeadDim128(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
Status ForwardMmaHeadDim192(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
Status ForwardMmaHeadDim256(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);

namespace mma {

template <int kHeadDim_, int kBlockQ_, int kBlockK_, int kWarps_, int kStages_>
struct TileConfig {
  static constexpr int kHeadDim = kHeadDim_, kBlockQ = kBlockQ_, kBlockK = kBlockK_, kWarps = kWarps_,
                       kStages = kStages_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMTiles = kBlockQ / (16 * kWarps);  // 16-row mma tiles per warp
  static constexpr int kKeyTiles = kBlockK / 8;             // n-tiles of S
  static constexpr int kDimTiles = kHeadDim / 8;            // n-tiles of O
  static constexpr int kDimSteps = kHeadDim / 16;           // k-steps of Q K^T
  static constexpr int kKeySteps = kBlockK / 16;            // k-steps of P V
  static constexpr int kChunksPerRow = kHeadDim / 8;        // 16-byte chunks per row
  static constexpr int kRowBytes = (kHeadDim + 8) * 2;      // padded: 16 * odd, conflict free
  static constexpr int kQBytes = kBlockQ * kRowBytes;
  static constexpr int kTileBytes = kBlockK * kRowBytes;
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kTileBytes;
  // Live f32 accumulators (O, S) plus Q fragments, per thread: keep Q in registers if small.
  static constexpr bool kQInRegs = kMTiles * (kHeadDim / 2 + kBlockK / 2 + kHeadDim / 4) <= 192;
  static_assert(kMTiles == 1 || kMTiles == 2, "block_q must be 16 or 32 rows per warp");
  static_assert(kBlockQ == 16 * kWarps * kMTiles, "block_q must be a multiple of 16 * num_warps");
  static_assert(kBlockK % 16 == 0 && kHeadDim % 16 == 0 && kStages >= 2, "bad tile");
};

struct ForwardKernelArgs {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  int32_t num_q_tiles;
  FeatureArgs f;
};

__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Rows [row0, row0 + kRows) of one head of a [*, rows, heads, D] tensor into padded shared
// memory; rows at or past `limit` and columns at or past `cols` (D <= kHeadDim) are
// zero-filled. Each thread copies one 16-byte column chunk
// of every kRowStep-th row (a row spans a power of two of chunk slots, the ones past the row
// idle), so its addresses advance by one stride: few registers, nothing for ptxas to hoist.
template <typename Cfg, int kRows, typename Element>
__device__ __forceinline__ void LoadRows(unsigned char* dst, const Element* src, int32_t row0, int32_t limit,
                                         int64_t row_stride, int32_t cols, int tid) {
  constexpr int kSlots = Cfg::kChunksPerRow <= 8 ? 8 : (Cfg::kChunksPerRow <= 16 ? 16 : 32);
  constexpr int kRowStep = Cfg::kThreads / kSlots;
  static_assert(Cfg::kThreads % kSlots == 0 && kRows % kRowStep == 0, "bad copy layout");
  const int ch = tid % kSlots, r0 = tid / kSlots;
  if (ch >= Cfg::kChunksPerRow) return;
  const Element* from = src + static_cast<int64_t>(row0 + r0) * row_stride + ch * 8;
  unsigned char* to = dst + r0 * Cfg::kRowBytes + ch * 16;
  const int64_t step = kRowStep * row_stride;
  const bool in_row = ch * 8 < cols;
#pragma unroll
  for (int k = 0; k < kRows / kRowStep; ++k) {
    const bool valid = in_row && row0 + r0 + k * kRowStep < limit;
    cuda::CpAsync16(to + k * kRowStep * Cfg::kRowBytes, valid ? from : src, valid);
    from += step;
  }
}

template <typename Element, typename Cfg, bool kMasked, bool kGeneral>
__global__ void __launch_bounds__(Cfg::kThreads) ForwardKernel(const ForwardKernelArgs a) {
  constexpr int kMT = Cfg::kMTiles, kNT = Cfg::kKeyTiles, kDT = Cfg::kDimTiles;
  constexpr int kBQ = Cfg::kBlockQ, kBK = Cfg::kBlockK, kStages = Cfg::kStages, kRowBytes = Cfg::kRowBytes;
  extern __shared__ __align__(128) unsigned char smem[];
  // key_begin, key_end, lo_max, hi_min; the first row's sequence's first key
  __shared__ int32_t block_range[5];
  __shared__ int2 row_bounds[kMasked && !kGeneral ? kBQ : 1];  // per row [lo, hi)

  const FeatureArgs& f = a.f;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, tq = lane % 4;
  // Last query tiles first: under a causal mask they are the longest.
  const int32_t tile = a.num_q_tiles - 1 - static_cast<int32_t>(blockIdx.x % a.num_q_tiles);
  const int32_t bh = static_cast<int32_t>(blockIdx.x / a.num_q_tiles);
  const int32_t h = bh % f.num_q_heads, b = bh / f.num_q_heads;
  const int32_t num_kv_heads = f.num_q_heads / f.group, kv_head = h / f.group;
  const int32_t Sq = f.seqlen_q, Sk = f.seqlen_k, i0 = tile * kBQ;
  const int32_t D = f.head_dim;  // <= Cfg::kHeadDim
  const int64_t q_stride = static_cast<int64_t>(f.num_q_heads) * D, kv_stride = static_cast<int64_t>(num_kv_heads) * D;
  const Element* q_head = static_cast<const Element*>(a.q) + (static_cast<int64_t>(b) * Sq * f.num_q_heads + h) * D;
  const int64_t kv_offset = (static_cast<int64_t>(b) * Sk * num_kv_heads + kv_head) * D;
  const Element* k_head = static_cast<const Element*>(a.k) + kv_offset;
  const Element* v_head = static_cast<const Element*>(a.v) + kv_offset;

  unsigned char* q_smem = smem;
  const auto k_smem = [&](int stage) { return smem + Cfg::kQBytes + stage * 2 * Cfg::kTileBytes; };
  const auto v_smem = [&](int stage) { return smem + Cfg::kQBytes + (stage * 2 + 1) * Cfg::kTileBytes; };

  LoadRows<Cfg, kBQ>(q_smem, q_head, i0, Sq, q_stride, D, tid);
  cuda::CpAsyncCommit();

  // Per-row state: visible keys, segment, dropout key, softmax statistics (log2 units).
  const int warp_row0 = warp * 16 * kMT;
  QueryRow rows[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int32_t i = i0 + warp_row0 + mt * 16 + g + 8 * hh;
      if constexpr (kMasked) {
        rows[mt][hh] = MakeQueryRow(f, b, h, i);
      } else if constexpr (kGeneral) {
        rows[mt][hh] = MakeQueryRow(f, b, h, i);
        rows[mt][hh].lo = 0;
        rows[mt][hh].hi = Sk;
        rows[mt][hh].real = true;
      } else {
        rows[mt][hh] = QueryRow{i, 0, Sk, 0, 0u, true};
      }
    }
  }

  int32_t key_begin = 0, key_end = Sk, lo_max = 0, hi_min = Sk;
  if constexpr (kMasked) {
    if (tid == 0) {
      block_range[0] = INT_MAX;
      block_range[1] = INT_MIN;
      block_range[2] = 0;
      block_range[3] = INT_MAX;
      block_range[4] = rows[0][0].key_begin;
    }
    __syncthreads();
    if (tq == 0) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const QueryRow& r = rows[mt][hh];
          if constexpr (!kGeneral) row_bounds[warp_row0 + mt * 16 + g + 8 * hh] = make_int2(r.lo, r.hi);
          if (i0 + warp_row0 + mt * 16 + g + 8 * hh < Sq) {
            atomicMax(&block_range[2], r.lo);
            atomicMin(&block_range[3], r.hi);
            if (r.lo < r.hi) {
              atomicMin(&block_range[0], r.lo);
              atomicMax(&block_range[1], r.hi);
            }
          }
        }
      }
    }
    __syncthreads();
    key_begin = block_range[0];
    // Dropout: tiles start a multiple of 16 keys into the first row's sequence, so that its
    // rows hash once per two elements (ApplyDropout); the keys added are masked.
    if (kGeneral && f.dropout) key_begin = max(0, key_begin - ((key_begin - block_range[4]) & 15));
    key_end = block_range[1];
    lo_max = block_range[2];
    hi_min = block_range[3];
  }
  const int32_t num_tiles = key_end > key_begin ? (key_end - key_begin + kBK - 1) / kBK : 0;
  // Scores enter the exponent as s * mult. Plain kernels keep raw q.k and fold the scale in
  // there (one FFMA per element; the launcher sends scale <= 0 to the general kernel); with
  // soft cap or per-element features the scores are logits in log2 units already.
  const float mult = kGeneral || f.soft_cap > 0.0f ? 1.0f : f.scale_log2;

  float m[kMT][2], l[kMT][2], o[kMT][kDT][4];
  {
    const bool sink = f.sink != nullptr;
    const float sink_logit = sink ? SinkLogit(f, h) * kLog2e : 0.0f;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const bool has_sink = sink && rows[mt][hh].real;  // padding rows: out 0, lse -inf
        m[mt][hh] = has_sink ? sink_logit : -INFINITY;
        l[mt][hh] = has_sink && tq == 0 ? 1.0f : 0.0f;  // l is summed over the quad at the end
      }
#pragma unroll
      for (int nt = 0; nt < kDT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][nt][e] = 0.0f;
      }
    }
  }

  const auto load_kv = [&](int32_t t) {
    if (t < num_tiles) {
      const int32_t j0 = key_begin + t * kBK;
      LoadRows<Cfg, kBK>(k_smem(t % kStages), k_head, j0, Sk, kv_stride, D, tid);
      cuda::CpAsyncCommit();
      LoadRows<Cfg, kBK>(v_smem(t % kStages), v_head, j0, Sk, kv_stride, D, tid);
      cuda::CpAsyncCommit();
    } else {
      cuda::CpAsyncCommit();
      cuda::CpAsyncCommit();
    }
  };
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) load_kv(t);

  // Per-lane ldmatrix offsets. Q (A, x4): row lane % 16, column 8 * (lane / 16). K (B, x4 for
  // two n-tiles): key lane % 8 + 8 * (lane / 16), dim 8 * (lane / 8 % 2). V (B, x4.trans for two
  // n-tiles): key lane % 8 + 8 * (lane / 8 % 2), dim 8 * (lane / 16).
  const int q_lane_offset = (warp_row0 + lane % 16) * kRowBytes + (lane / 16) * 16;
  const int k_lane_offset = (lane % 8 + 8 * (lane / 16)) * kRowBytes + (lane / 8 % 2) * 16;
  const int v_lane_offset = (lane % 8 + 8 * (lane / 8 % 2)) * kRowBytes + (lane / 16) * 16;

  cuda::CpAsyncWait<2 * (kStages - 1)>();
  __syncthreads();
  [[maybe_unused]] uint32_t q_frag[Cfg::kQInRegs ? kMT : 1][Cfg::kQInRegs ? Cfg::kDimSteps : 1][4];
  if constexpr (Cfg::kQInRegs) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int kk = 0; kk < Cfg::kDimSteps; ++kk) {
        cuda::LdMatrixX4(q_frag[mt][kk], q_smem + q_lane_offset + mt * 16 * kRowBytes + kk * 32);
      }
    }
  }

  for (int32_t t = 0; t < num_tiles; ++t) {
    const int32_t j0 = key_begin + t * kBK;
    cuda::CpAsyncWait<2 * kStages - 3>();  // K(t) landed
    __syncthreads();                        // ... for every thread; stage (t - 1) is free
    load_kv(t + kStages - 1);

    float s[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
      }
    }
    const unsigned char* ks = k_smem(t % kStages) + k_lane_offset;
#pragma unroll
    for (int kk = 0; kk < Cfg::kDimSteps; ++kk) {
      uint32_t qa[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        if constexpr (Cfg::kQInRegs) {
#pragma unroll
          for (int r = 0; r < 4; ++r) qa[mt][r] = q_frag[mt][kk][r];
        } else {
          cuda::LdMatrixX4(qa[mt], q_smem + q_lane_offset + mt * 16 * kRowBytes + kk * 32);
        }
      }
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t kb[4];
        cuda::LdMatrixX4(kb, ks + np * 16 * kRowBytes + kk * 32);
        const uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          cuda::Mma16816<Element>(s[mt][2 * np], qa[mt], b0);
          cuda::Mma16816<Element>(s[mt][2 * np + 1], qa[mt], b1);
        }
      }
    }

    const int32_t col0 = j0 + 2 * tq;
    const bool interior = kMasked ? (j0 >= lo_max && j0 + kBK <= hi_min) : (j0 + kBK <= Sk);
    // Row ranges of boundary tiles: masked plain kernels keep them in shared memory rather
    // than in registers.
    const auto boundary_rows = [&](int mt, QueryRow (&r)[2]) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        r[hh] = rows[mt][hh];
        if constexpr (kMasked && !kGeneral) {
          const int2 bounds = row_bounds[warp_row0 + mt * 16 + g + 8 * hh];
          r[hh].lo = bounds.x;
          r[hh].hi = bounds.y;
        }
      }
    };
    if (kGeneral || f.soft_cap > 0.0f) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        if (interior) {
          ScoresToLogits<kNT, kGeneral, false>(s[mt], f, rows[mt], b, h, col0);
        } else {
          QueryRow r[2];
          boundary_rows(mt, r);
          ScoresToLogits<kNT, kGeneral, true>(s[mt], f, r, b, h, col0);
        }
      }
    } else if (!interior) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        QueryRow r[2];
        boundary_rows(mt, r);
        MaskScores<kNT>(s[mt], r, col0);
      }
    }

    // Online softmax: new row max over the quad, P = exp2(s * mult - max), rescale l and O
    // (O only when some row's max moved: late tiles rarely move it).
    float alpha[kMT][2];
    bool unchanged = true;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hh], s[mt][nt][2 * hh + 1]));
        const float m_new = fmaxf(m[mt][hh], cuda::LaneReduceMax(mx, 2) * mult);
        // A row that has seen nothing keeps max -inf; exp2 against 0 then gives exact zeros.
        const float ref = m_new == -INFINITY ? 0.0f : m_new;
        alpha[mt][hh] = FastExp2(m[mt][hh] - ref);
        unchanged = unchanged && alpha[mt][hh] == 1.0f;
        m[mt][hh] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          s[mt][nt][2 * hh] = FastExp2(fmaf(s[mt][nt][2 * hh], mult, -ref));
          s[mt][nt][2 * hh + 1] = FastExp2(fmaf(s[mt][nt][2 * hh + 1], mult, -ref));
          sum += s[mt][nt][2 * hh] + s[mt][nt][2 * hh + 1];
        }
        l[mt][hh] = fmaf(l[mt][hh], alpha[mt][hh], sum);
      }
      if constexpr (kGeneral) {
        if (f.dropout) ApplyDropout<kNT>(s[mt], f, rows[mt], j0, tq);
      }
    }
    if (!__all_sync(0xffffffffu, unchanged)) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kDT; ++nt) {
          o[mt][nt][0] *= alpha[mt][0];
          o[mt][nt][1] *= alpha[mt][0];
          o[mt][nt][2] *= alpha[mt][1];
          o[mt][nt][3] *= alpha[mt][1];
        }
      }
    }

    cuda::CpAsyncWait<2 * kStages - 2>();  // V(t) landed
    __syncthreads();
    const unsigned char* vs = v_smem(t % kStages) + v_lane_offset;
#pragma unroll
    for (int kk = 0; kk < Cfg::kKeySteps; ++kk) {
      uint32_t pa[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        pa[mt][0] = cuda::PackFloat2<Element>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = cuda::PackFloat2<Element>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = cuda::PackFloat2<Element>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = cuda::PackFloat2<Element>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < kDT / 2; ++dp) {
        uint32_t vb[4];
        cuda::LdMatrixX4Trans(vb, vs + kk * 16 * kRowBytes + dp * 32);
        const uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          cuda::Mma16816<Element>(o[mt][2 * dp], pa[mt], b0);
          cuda::Mma16816<Element>(o[mt][2 * dp + 1], pa[mt], b1);
        }
      }
    }
  }
  cuda::CpAsyncWait<0>();

  // Epilogue: normalise, stage the warp's rows in its own part of the Q tile, store 16 bytes
  // per lane. Only this warp reads those rows, so a warp barrier orders the reuse.
  const float keep_scale = kGeneral ? f.dropout_scale : 1.0f;
  float* lse_head = a.lse + (static_cast<int64_t>(b) * f.num_q_heads + h) * Sq;
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float sum = cuda::LaneReduceSum(l[mt][hh], 2);
      const bool empty = !(sum > 0.0f);
      const float inv = empty ? 0.0f : keep_scale / sum;
      const int local_row = warp_row0 + mt * 16 + g + 8 * hh;
      const int32_t i = i0 + local_row;
      if (tq == 0 && i < Sq) lse_head[i] = empty ? -INFINITY : (m[mt][hh] + __log2f(sum)) * kLn2;
      unsigned char* row = q_smem + local_row * kRowBytes + tq * 4;
#pragma unroll
      for (int nt = 0; nt < kDT; ++nt) {
        *reinterpret_cast<uint32_t*>(row + nt * 16) =
            cuda::PackFloat2<Element>(o[mt][nt][2 * hh] * inv, o[mt][nt][2 * hh + 1] * inv);
      }
    }
  }
  __syncwarp();
  Element* out_head = static_cast<Element*>(a.out) + (static_cast<int64_t>(b) * Sq * f.num_q_heads + h) * D;
  constexpr int kWarpChunks = 16 * kMT * Cfg::kChunksPerRow;
#pragma unroll
  for (int c = lane; c < kWarpChunks; c += 32) {
    const int r = c / Cfg::kChunksPerRow, ch = c % Cfg::kChunksPerRow;
    const int32_t i = i0 + warp_row0 + r;
    if (i < Sq && ch * 8 < D) {
      *reinterpret_cast<uint4*>(out_head + static_cast<int64_t>(i) * q_stride + ch * 8) =
          *reinterpret_cast<const uint4*>(q_smem + (warp_row0 + r) * kRowBytes + ch * 16);
    }
  }
}

template <typename Element, typename Cfg, bool kMasked, bool kGeneral>
Status LaunchVariant(const ForwardKernelArgs& ka, unsigned grid, cudaStream_t stream) {
  const auto kernel = ForwardKernel<Element, Cfg, kMasked, kGeneral>;
  // The shared-memory limit is a per-device function attribute: raise it once per device.
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    return Status::Internal(std::string("flash attention forward: cudaGetDevice: ") + cudaGetErrorString(err));
  }
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit == 0 || !(configured.load(std::memory_order_acquire) & bit)) {
    if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
        err != cudaSuccess) {
      return Status::Internal(std::string("flash attention forward: cudaFuncSetAttribute: ") + cudaGetErrorString(err));
    }
    configured.fetch_or(bit, std::memory_order_acq_rel);
  }
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(ka);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return Status::Internal(std::string("flash attention forward kernel launch failed: ") + cudaGetErrorString(err));
  }
  return Status::Ok();
}

template <typename Element, typename Cfg>
Status LaunchForward(const CudaForwardArgs& args, cudaStream_t stream) {
  const ForwardParams& p = args.p;
  const Dims& d = args.dims;
  ForwardKernelArgs ka;
  ka.q = p.q.data;
  ka.k = p.k.data;
  ka.v = p.v.data;
  ka.out = p.out.data;
  ka.lse = p.lse.ptr<float>();
  ka.f = MakeFeatureArgs(p, d, args.dropout_seed);
  const int64_t num_q_tiles = (d.seqlen_q + Cfg::kBlockQ - 1) / Cfg::kBlockQ;
  const int64_t blocks = num_q_tiles * d.num_q_heads * d.batch;
  if (blocks == 0) return Status::Ok();
  if (blocks > INT32_MAX) {
    return Status::Unimplemented("flash attention forward: " + std::to_string(blocks) +
                                 " query tiles exceed the launch grid");
  }
  ka.num_q_tiles = static_cast<int32_t>(num_q_tiles);
  const unsigned grid = static_cast<unsigned>(blocks);
  const bool masked = NeedsRanges(ka.f);
  const bool general = NeedsGeneral(ka.f) || (ka.f.soft_cap == 0.0f && !(ka.f.scale_log2 > 0.0f));
  if (masked) {
    return general ? LaunchVariant<Element, Cfg, true, true>(ka, grid, stream)
                   : LaunchVariant<Element, Cfg, true, false>(ka, grid, stream);
  }
  return general ? LaunchVariant<Element, Cfg, false, true>(ka, grid, stream)
                 : LaunchVariant<Element, Cfg, false, false>(ka, grid, stream);
}

template <typename Cfg>
bool Matches(const CudaConfig& c) {
  return Requests(c, {Cfg::kBlockQ, Cfg::kBlockK, Cfg::kWarps, Cfg::kStages});
}

// Launches Cfg unless a config was launched already, Cfg is not wanted or does not fit.
template <typename Element, typename Cfg>
Status TryLaunch(bool wanted, int smem_limit, const CudaForwardArgs& args, cudaStream_t stream, bool* launched) {
  if (*launched || !wanted || Cfg::kSmemBytes > smem_limit) return Status::Ok();
  *launched = true;
  return LaunchForward<Element, Cfg>(args, stream);
}

// Runs the first of Cfgs that matches `cfg` and fits the device's shared memory; else the
// first that fits, in list order (the first is the default).
template <typename Element, typename... Cfgs>
Status DispatchConfigs(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  // sm_86/87/89/120 give a block 99 KB, the least of any sm_80+ GPU: some config must fit it.
  static_assert(((Cfgs::kSmemBytes <= 99 * 1024) || ...), "no tile config fits 99 KB of shared memory");
  const int smem_limit = CurrentCudaDevice().shared_memory_per_block;
  bool launched = false;
  // Braced initialisers run in order: the requested config first, then the fallbacks.
  const Status results[] = {TryLaunch<Element, Cfgs>(Matches<Cfgs>(cfg), smem_limit, args, stream, &launched)...,
                            TryLaunch<Element, Cfgs>(true, smem_limit, args, stream, &launched)...};
  if (!launched) {
    return Status::Unimplemented("flash attention forward: no tile config fits the device's " +
                                 std::to_string(smem_limit) + " bytes of shared memory per block");
  }
  for (const Status& s : results) {
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

template <typename... Cfgs>
Status DispatchDType(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  if (args.p.q.dtype == DType::kBF16) return DispatchConfigs<__nv_bfloat16, Cfgs...>(args, cfg, stream);
  if constexpr (kFloat16Built) {
    return DispatchConfigs<__half, Cfgs...>(args, cfg, stream);
  } else {
    return FeatureNotBuilt("float16");
  }
}

// The kernels of a tile list of cuda_tiles.h at kHeadDim, in its order.
template <int kHeadDim, size_t kCount, const std::array<CudaConfig, kCount>& kTiles, size_t... kIndex>
Status DispatchTiles(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream,
                     std::index_sequence<kIndex...>) {
  return DispatchDType<TileConfig<kHeadDim, kTiles[kIndex].block_q, kTiles[kIndex].block_k, kTiles[kIndex].num_warps,
                                  kTiles[kIndex].num_stages>...>(args, cfg, stream);
}
template <int kHeadDim, size_t kCount, const std::array<CudaConfig, kCount>& kTiles>
Status DispatchTiles(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  return DispatchTiles<kHeadDim, kCount, kTiles>(args, cfg, stream, std::make_index_sequence<kCount>());
}

}  // namespace mma
}  // namespace ejk::flash_attention
