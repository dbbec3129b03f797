// Flash attention backward for Hopper (sm_90a): TMA loads, wgmma, warp specialisation.
//
// One thread block per (key tile of kBlockN keys, batch row, kv head). It keeps its K and V
// tile in shared memory and dK, dV in registers, and walks every query tile that can see its
// keys, for every query head of the kv group (GQA never materialises per-q-head dK/dV):
//   warp 0       loads K and V once, then Q, dO (TMA) and the rows' lse and D (bulk copies)
//                of each query tile into a 2- or 3-stage ring guarded by mbarriers;
//   warpgroups 1 and 2  consumers. Head dims 64/96/128 (kBlockN = 128, 64 keys each): S^T =
//                K Q^T and dP^T = V dO^T (wgmma, both operands from shared memory), P^T =
//                exp2(S^T * scale * log2 e - lse) and dS^T = P^T (dP^T - D) in registers,
//                where they already are the A operands of dV += P^T dO and dK += dS^T Q
//                (wgmma with A from registers). dS^T also goes to shared memory, from where
//                the two warpgroups compute dQ = dS K, each a 64 x 64 block of it, and add it
//                into the global accumulator straight from registers (vector reductions in
//                L2). Head dims 192/256 (kBlockN = 64, see Layout): each warpgroup computes S^T
//                and dP^T for 32 of the tile's queries, P^T and dS^T meet in shared memory,
//                and each warpgroup owns 128 columns of dV, dK and dQ (all operands from
//                shared memory).
// Registers move from the producer warpgroup to the consumers with setmaxnreg.
//
// Query tiles that the causal/window masks hide from every key of the block are never
// loaded; only tiles on a mask boundary or at the sequence end are masked element-wise.
// Rows past the sequence come from TMA's zero fill and have lse = +inf (P = 0).
//
// A dense bias or attention mask: each query tile's [kBlockM x kBlockN] tile of it comes by
// TMA with the tile's Q (splitting queries, into the stage's P^T buffer), and the consumers
// read their fragment's elements from shared memory (the bias into S^T before P^T, the mask
// like the causal one). The bias's gradient, where wanted, is dS^T, which each thread writes
// into dbias from registers (by atomics where the bias broadcasts, so that several (batch,
// head) pairs add into an element). With a soft cap the bias comes after it, and dbias is the
// logit's gradient before the cap's derivative. Segment ids may come with either.
//
// Segment ids: every query tile is masked element-wise, by its rows' ids (a bulk copy with the
// tile's lse) against the thread's keys' ids (loaded once). A block skips the query tiles
// before the first and after the last whose id range meets its keys' (NarrowToSegments):
// with packed documents in order, it walks the tiles of its keys' documents only.
//
// Packed sequences (cu_seqlens, batch 1): a block's keys lie in one sequence (sequence n's
// key blocks are numbered from cu_seqlens_k[n] / kBlockN + n on, which leaves room for each
// sequence's partial last block; blocks past their sequence's keys exit), masks are local to
// it, and keys past it (the next sequence's, loaded by TMA) are masked like those past a
// dense sequence's end. Its query tiles stay the batch row's kBlockM-row tiles, those of the
// dQ accumulator: a tile on a sequence boundary holds rows of the neighbours or padding, of
// finite lse, so it is masked element-wise by the sequence's query range too. Those rows
// receive only zeros, and the keys outside every sequence, which no block owns, have their
// dK and dV zeroed beforehand.
//
// Deterministic mode (its own kernels): the key blocks that see a query tile add their dQ
// into it in a fixed order, kept by two producer warps (see "Deterministic dQ" in the kernel).
//
// The dQ accumulator is tile-major: [B, Hq, m block] tiles of kBlockM * D floats in the
// consumers' register order (so that each warp's reductions cover contiguous bytes);
// cuda_hopper_backward.cu converts it into dq. Reducing from registers rather than through a
// shared-memory staging tile and a bulk reduction saves the tile's 64 KB of shared-memory
// traffic per query tile (by count, the S^T, dP^T and dQ products, N = 64 with both
// operands in shared memory, already read it near its bandwidth) and the two barriers that
// coupled the consumers to the reducing warp: 1-3% faster.
//
// Shared memory tiles are [rows][64] blocks of 128-byte rows in the 128-byte swizzle, as TMA
// writes them and wgmma reads them: K and Q are K-major operands of S^T, V and dO of dP^T;
// dO and Q are MN-major B operands of dV and dK; dS^T ([keys][queries]) and K are the
// MN-major A and B operands of dQ.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "flash_attention/cuda.h"
#include "flash_attention/cuda_hopper_forward.cuh"
#include "runtime/status.h"

namespace ejk::flash_attention::hopper_backward {

using hopper::Elementwise;

// Two ways to share a block between the consumer warpgroups:
//   head dims 64, 96 and 128 ("split keys"): kBlockN = 128 keys, each warpgroup owns 64 of
//     them, all their dK/dV columns, and the whole S^T/dP^T rows of its keys, so P^T and dS^T
//     are the register A operands of dV and dK. The consumers' S^T/dP^T accumulators hold
//     kBlockM / 2 floats each next to dK and dV (kHeadDim / 2 each), so the wider head dim
//     takes the shorter query tile. dQ is kBlockM * kPaddedDim = 8192 floats, a 64 x 64 block
//     per warpgroup. A float32 bias at head dim 64 takes 64-query tiles too (its 128-query
//     tile would be 64 KB per stage): dQ is then one 64 x 64 block, each warpgroup's product
//     covers its own 64 keys, and the two partial sums meet in shared memory (kDqExchange).
//   head dims 192 and 256 ("split queries"): dK and dV of 128 keys x 192 or 256 columns do
//     not fit in two warpgroups' registers, so kBlockN = 64 keys, and each warpgroup owns 128
//     columns of dK, dV and dQ and 32 query columns of S^T and dP^T (m64n32 products). P^T
//     and dS^T go through shared memory, from where both warpgroups read them as A operands.
// Head dims 96 and 192 run in the layout of 128 and 256: shared-memory tiles, the dQ
// accumulator and the consumers' split are those of the wider head dim, TMA zero-fills the
// columns past the head dim, S^T and dP^T sum over the real columns only, and nothing past
// them is stored. At 96 dV and dK are m64n96 products; at 192 the second warpgroup's 128
// columns hold 64 of padding (a split inside a 64-column swizzle block is not addressable
// by the MN-major operands of dV, dK and dQ). A call at a head dim below the kernel's (a
// multiple of 8: 80 on d96's kernel) runs the same way, its own columns past it zeros.
template <int kHeadDim>
struct PaddedHeadDim {
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256);
  static constexpr int kValue = kHeadDim == 96 ? 128 : kHeadDim == 192 ? 256 : kHeadDim;
};

// Query rows per tile, by padded head dim and whether the kernel takes narrow tiles: 64 rows
// instead of 128 at d64 where the consumers' registers hold more than the products (a float32
// bias tile is staged; a mask's bits beside dropout's row keys spilled 424 bytes at 128).
constexpr int BlockMOf(int padded_dim, bool narrow) { return padded_dim == 64 && !narrow ? 128 : 64; }
constexpr bool NarrowRows(Elementwise f) {
  return Has(f, Elementwise::kBiasF32) || Has(f, Elementwise::kMaskDropout);
}

// kFeature: segment ids (each stage also holds its query tile's ids where there is room), a
// dense bias or mask (each stage also holds its query tile's [kBlockM x kBlockN] tile of it;
// splitting queries, in the stage's P^T buffer), or both.
template <int kHeadDim, Elementwise kFeature = Elementwise::kNone>
struct Layout {
  static constexpr bool kSegments = Has(kFeature, Elementwise::kSegmentIds);
  static constexpr int kPaddedDim = PaddedHeadDim<kHeadDim>::kValue;
  static constexpr bool kSplitQueries = kPaddedDim == 256;
  static constexpr int kBlockM = BlockMOf(kPaddedDim, NarrowRows(kFeature));
  static constexpr int kBlockN = kSplitQueries ? 64 : 128;
  // One 64 x 64 dQ block per tile, which both warpgroups add to: each sends the other the
  // half of its columns the other reduces into the accumulator.
  static constexpr bool kDqExchange = kPaddedDim == 64 && kBlockM == 64;
  static constexpr int kThreads = 384;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static constexpr int kColBlocks = kPaddedDim / 64;
  static constexpr int kKvBlockBytes = kBlockN * 128;  // one 64-column block of K or V
  static constexpr int kKvTileBytes = kColBlocks * kKvBlockBytes;
  static constexpr int kQBlockBytes = kBlockM * 128;
  static constexpr int kQTileBytes = kColBlocks * kQBlockBytes;
  static constexpr int kDsBlockBytes = kBlockN * 128;  // dS^T (and P^T): kBlockN keys x 64 queries
  static constexpr int kDsBytes = kBlockM / 64 * kDsBlockBytes;
  // Split keys at head dim 128: the dQ of item i is issued with item i + 1's products (see the
  // kernel), so a dS^T buffer is rewritten only once both warpgroups' products from it are
  // complete: three buffers. (Head dim 64 measured 3-7% slower that way.) A float32 bias tile
  // (32 KB per stage) leaves room for two. With kDqExchange a warpgroup's products read only
  // its own rows of dS^T, done before it writes the next item's: one buffer.
  static constexpr bool kLateDq = kPaddedDim == 128 && !Has(kFeature, Elementwise::kBiasF32);
  static constexpr int kDsBuffers = kLateDq ? 3 : kDqExchange ? 1 : 2;
  static constexpr int kDqFloats = kBlockM * kPaddedDim;
  static constexpr int kDqExchangeBytes = kDqExchange ? kDqFloats * 4 : 0;
  // The bias or mask tile per stage. Splitting queries there is no room for it: it loads into
  // the stage's P^T buffer (two stages, P^T buffers by item parity), which the item's P^T
  // overwrites once both consumer warpgroups have read their rows of the tile.
  using Dense = hopper::DenseTile<kFeature, kBlockM, kBlockN>;
  static constexpr bool kDense = Dense::kPresent;
  static constexpr int kDenseTileBytes = Dense::kBytes;
  static constexpr int kDenseStageBytes = kSplitQueries ? 0 : kDenseTileBytes;
  // Bytes for `stages` stages of the Q/dO ring, with `q_id_bytes` of segment ids per stage
  // (the rest is fixed).
  static constexpr int BytesFor(int stages, int q_id_bytes) {
    return 2 * kKvTileBytes + stages * (2 * kQTileBytes + kDenseStageBytes) + kDsBuffers * kDsBytes +
           (kSplitQueries ? 2 * kDsBytes : 0) + kDqExchangeBytes + stages * (2 * kBlockM * 4 + q_id_bytes) +
           8 * (1 + 3 * stages);
  }
  static constexpr int kMaxBytes = 232448;
  static constexpr int kStagedQIdBytes = kSegments ? kBlockM * 4 : 0;
  // A third stage where it fits (head dim 128): the next items' loads then start two items ahead.
  static constexpr int kStages = BytesFor(3, kStagedQIdBytes) + 1024 <= kMaxBytes ? 3 : 2;
  // Each stage holds its query tile's segment ids where there is room; with a bias at head dim
  // 64 there is not (968 bytes spare), and the consumers read them from global memory.
  static constexpr int kQIdBytes = BytesFor(kStages, kStagedQIdBytes) <= kMaxBytes ? kStagedQIdBytes : 0;
  static constexpr bool kFits = BytesFor(kStages, kQIdBytes) <= kMaxBytes;
  // The 128-byte swizzle wants the tiles 1024-byte aligned, which the declaration of the
  // dynamic shared memory asks of the loader. Where there is room the kernel also rounds the
  // base up itself; a bias at head dim 64 leaves 968 bytes, so there it checks the base instead.
  static constexpr int kAlignSlack = BytesFor(kStages, kQIdBytes) + 1024 <= kMaxBytes ? 1024 : 0;
  static constexpr int kK = 0;
  static constexpr int kV = kK + kKvTileBytes;
  static constexpr int kQ = kV + kKvTileBytes;
  static constexpr int kDo = kQ + kStages * kQTileBytes;
  static constexpr int kDenseOffset = kDo + kStages * kQTileBytes;
  static constexpr int kDs = kDenseOffset + kStages * kDenseStageBytes;
  static constexpr int kP = kDs + kDsBuffers * kDsBytes;  // 2 buffers, split queries only
  static constexpr int kDqExchangeOffset = kP + (kSplitQueries ? 2 * kDsBytes : 0);
  static constexpr int kLse = kDqExchangeOffset + kDqExchangeBytes;
  static constexpr int kDelta = kLse + kStages * kBlockM * 4;
  static constexpr int kQIds = kDelta + kStages * kBlockM * 4;
  // Where stage s's bias or mask tile goes.
  static constexpr int DenseOffset(int s) { return kSplitQueries ? kP + s * kDsBytes : kDenseOffset + s * kDenseTileBytes; }
  static constexpr int kBarriers = kQIds + kStages * kQIdBytes;
  // kv_full, q_full[kStages], do_full[kStages], empty[kStages].
  static constexpr int kBytes = kBarriers + 8 * (1 + 3 * kStages);
  static constexpr int kAllocBytes = kBytes + kAlignSlack;
  static_assert(kDqFloats == (kDqExchange ? 4096 : 8192 * (kSplitQueries ? 2 : 1)),
                "dQ: 64 x 64 blocks, one (two) per consumer warpgroup, or one shared");
  static_assert(kBytes == BytesFor(kStages, kQIdBytes), "shared memory");
  static_assert(!kDense || !kSplitQueries || (kStages == 2 && kDenseTileBytes == kDsBytes), "dense tile in P^T");
};

// Everything the kernel reads: tensor maps (by value, __grid_constant__) and scalars.
struct KernelParams {
  CUtensorMap tma_q, tma_k, tma_v, tma_do;
  hopper::DenseOperand dense;  // a bias or mask, boxes of kBlockM rows (dense kernels only)
  // kBiasWithGrad: the bias's gradient, its strides (0 along a broadcast dimension), and
  // whether several (batch, head) pairs add into its elements (a broadcast dimension): then
  // f32 sums by atomics into zeroed memory, else each element is stored once, in f32 or in
  // the bias's 16-bit dtype (dbias_f32 == 0): the inputs' dtype, or with a bias read as
  // float32 (kBiasF32 kernels: converted) the other 16-bit dtype.
  void* dbias;
  int64_t dbias_stride_b, dbias_stride_h;
  int dbias_atomic, dbias_f32;
  void *dk, *dv;
  int dkv_f32;  // dK and dV stored unrounded in f32 (BackwardParams), else in the inputs' dtype
  const float* lse2;   // [B, Hq, padded_q] lse in log2 units, +inf for rows that see nothing
  const float* delta;  // [B, Hq, padded_q] rowsum(dO * O) - dlse
  float* dq_accum;
  int seqlen_q, seqlen_k, num_q_heads, num_kv_heads, group, num_m_blocks, padded_q;
  int head_dim;  // the call's: at most kHeadDim, whose columns past it are zeros, never stored
  // Packed sequences (device memory), or null: sequence n holds queries cu_seqlens_q[n] ..
  // cu_seqlens_q[n + 1] - 1 and keys likewise; seqlen_q/k are then the packed lengths.
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  int num_sequences;
  // Blocks in sections of `section` (batch, kv head) pairs, key tile major inside a section
  // (see the kernel); 1 is plain (batch, kv head)-major order. batch_inner: pairs numbered
  // batch-minor (kv head * batch + b), so that blocks dispatched together read the same tiles
  // of a bias or mask broadcast over the batch.
  int section, batch_inner;
  float softcap_pre;  // scale / cap (soft cap only)
  float logit_scale;  // maps the (capped) score to the log2 domain
  float dk_scale;     // softmax scale
  // Key j is visible to query i iff i + offset - left <= j <= i + offset + right (and j < Sk),
  // offset = Sk - Sq of the sequence; left/right are clamped so that the sums stay in int32.
  int left, right;
  // Segment ids (kSegments kernels; never with packed sequences): the queries' padded to
  // [B, padded_q] (so that each tile's are one bulk copy), the smallest and largest id of each
  // query tile's rows, [B, num_m_blocks], and the keys', [B, Sk].
  const int* q_segment_ids;
  const int2* q_tile_segments;
  const int* kv_segment_ids;
  // Deterministic mode, else null: per query tile and consumer warpgroup, [B, Hq,
  // num_m_blocks, 2], how many key blocks have added their dQ (zeroed before the launch). See
  // "Deterministic dQ" in the kernel.
  int* dq_turns;
  hopper::DropoutOperand dropout;  // kDropout kernels only
};

template <int kHeadDim>
Status Launch(const KernelParams& kp, bool f16, bool softcap, int batch, cudaStream_t stream);
// Calls with segment ids; instantiated per head dim in cuda_hopper_backward_segments_hdim*.cu.
template <int kHeadDim>
Status LaunchSegments(const KernelParams& kp, bool f16, bool softcap, int batch, cudaStream_t stream);
// Calls with a bias (its gradient or not) or a mask (`feature`), without or with segment ids;
// instantiated per head dim in cuda_hopper_backward_dense_hdim*.cu and
// cuda_hopper_backward_segments_dense_hdim*.cu.
template <int kHeadDim>
Status LaunchDense(const KernelParams& kp, bool f16, bool softcap, Elementwise feature, int batch, cudaStream_t stream);
template <int kHeadDim>
Status LaunchSegmentsDense(const KernelParams& kp, bool f16, bool softcap, Elementwise feature, int batch,
                           cudaStream_t stream);
// Calls with a float32 bias (`feature`: kBiasF32, or kBiasF32WithGrad for its gradient), with
// or without segment ids, at d64 to d128; instantiated in cuda_hopper_backward_bias_f32_hdim*.cu.
template <int kHeadDim>
Status LaunchBiasF32(const KernelParams& kp, bool f16, bool softcap, Elementwise feature, int batch,
                     cudaStream_t stream);

#if EJK_HOPPER_DEVICE_CODE
namespace device {

using namespace ejk::flash_attention::hopper::device;

// D[64x32] (+)= A[64x16] * B[16x32], both from shared memory; kTransA/kTransB: MN-major.
template <bool kF16, int kTransA, int kTransB>
__device__ __forceinline__ void WgmmaSST(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#define EJK_WGMMA_SS_N32(TYPE) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " " \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, %20;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB))
  if constexpr (kF16) {
    EJK_WGMMA_SS_N32("f16");
  } else {
    EJK_WGMMA_SS_N32("bf16");
  }
#undef EJK_WGMMA_SS_N32
}

// D[64x64] (+)= A[64x16] * B[16x64], both from shared memory; kTransA/kTransB: MN-major.
template <bool kF16, int kTransA, int kTransB>
__device__ __forceinline__ void WgmmaSST(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#define EJK_WGMMA_SS_N64(TYPE) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB))
  if constexpr (kF16) {
    EJK_WGMMA_SS_N64("f16");
  } else {
    EJK_WGMMA_SS_N64("bf16");
  }
#undef EJK_WGMMA_SS_N64
}

// D[64x128] (+)= A[64x16] * B[16x128], both from shared memory; kTransA/kTransB: MN-major.
template <bool kF16, int kTransA, int kTransB>
__device__ __forceinline__ void WgmmaSST(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#define EJK_WGMMA_SS_N128(TYPE) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB))
  if constexpr (kF16) {
    EJK_WGMMA_SS_N128("f16");
  } else {
    EJK_WGMMA_SS_N128("bf16");
  }
#undef EJK_WGMMA_SS_N128
}


// 1-d bulk copy of `bytes` (multiple of 16) from global into shared memory, completing on `bar`.
__device__ __forceinline__ void BulkLoad(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// *addr += v, element-wise, in L2 (no value returned).
__device__ __forceinline__ void RedAddF32x4(float* addr, float a, float b, float c, float d) {
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(addr), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}

// The packed sequence whose key blocks hold block x: the last n with
// cu_seqlens_k[n] / kBlockN + n <= x (offsets clamped), or 0. A 32-way search by each warp:
// one round of loads up to 32 sequences, two up to 1024.
template <int kBlockN>
__device__ __forceinline__ int FindSequence(const KernelParams& p, int x, int lane) {
  int lo = 0, count = p.num_sequences;  // the answer is in [lo, lo + count)
  while (count > 1) {
    const int step = (count + 31) / 32;
    const int probe = lane * step;
    const bool before =
        probe < count && Clamp(p.cu_seqlens_k[lo + probe], 0, p.seqlen_k) / kBlockN + lo + probe <= x;
    const unsigned ballot = __ballot_sync(0xffffffffu, before);
    const int last = ballot != 0 ? 31 - __clz(ballot) : 0;
    lo += last * step;
    count = min(step, count - last * step);
  }
  return lo;
}

// Segment ids: narrows the block's query tiles [m_lo, m_lo + m_count) to those from the first
// to the last whose id range meets the range of the block's keys' ids; the tiles outside are
// hidden from every key. (Packed documents in order: the tiles of the keys' documents.) Each
// warp computes it alone, with the same result.
template <int kBlockN>
__device__ __forceinline__ void NarrowToSegments(const KernelParams& p, int batch, int n0, int sk, int lane, int& m_lo,
                                                 int& m_count) {
  const int* kv_ids = p.kv_segment_ids + static_cast<int64_t>(batch) * p.seqlen_k;
  int lo = INT_MAX, hi = INT_MIN;
#pragma unroll
  for (int k = lane; k < kBlockN; k += 32) {
    if (n0 + k < sk) {
      const int id = __ldg(kv_ids + n0 + k);
      lo = min(lo, id);
      hi = max(hi, id);
    }
  }
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  const int2 meeting = hopper::MeetingTiles(p.q_tile_segments + static_cast<int64_t>(batch) * p.num_m_blocks + m_lo, m_count,
                                    make_int2(lo, hi), lane);
  m_lo += max(meeting.x, 0);
  m_count = meeting.x < 0 ? 0 : meeting.y - meeting.x + 1;
}

// The query tiles [lo, lo + count) of the batch row that key block nb of a sequence (queries
// q_begin + [0, sq), sk keys, window sides left and right) is visible to: those holding
// q_begin + [q_lo, q_hi). Both ends grow with nb, and only a first run of blocks (keys before
// every query's window) or a sequence without queries has count 0.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ void QueryTilesOf(int nb, int q_begin, int sq, int sk, int left, int right, int& lo,
                                             int& count) {
  const int offset = sk - sq;
  const int first_key = nb * kBlockN;
  const int k_last = min(first_key + kBlockN, sk) - 1;
  const int q_lo = q_begin + max(0, first_key - offset - right);
  const int q_hi = q_begin + min(sq, k_last - offset + left + 1);
  lo = q_lo / kBlockM;
  count = q_hi > q_lo ? (q_hi + kBlockM - 1) / kBlockM - lo : 0;
}

// The first of a sequence's key blocks whose query tiles (lo, count) satisfy `holds`, which
// then holds for every later block (a bisection); the block count if none.
template <int kBlockM, int kBlockN, typename Holds>
__device__ __forceinline__ int FirstBlockWhere(int q_begin, int sq, int sk, int left, int right, Holds holds) {
  int a = 0, b = (sk + kBlockN - 1) / kBlockN;
  while (a < b) {
    const int mid = (a + b) / 2;
    int lo, count;
    QueryTilesOf<kBlockM, kBlockN>(mid, q_begin, sq, sk, left, right, lo, count);
    if (holds(lo, count)) {
      b = mid;
    } else {
      a = mid + 1;
    }
  }
  return a;
}

// How many of a sequence's key blocks come before the first whose query tiles start after
// tile m.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int BlocksStartingBy(int m, int q_begin, int sq, int sk, int left, int right) {
  return FirstBlockWhere<kBlockM, kBlockN>(q_begin, sq, sk, left, right, [m](int lo, int) { return lo > m; });
}

// How many of a sequence's key blocks see query tile m: those from the first whose tiles end
// after m to the last whose tiles start by m (both ends grow with the block).
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int BlocksSeeing(int m, int q_begin, int sq, int sk, int left, int right) {
  const int first = FirstBlockWhere<kBlockM, kBlockN>(q_begin, sq, sk, left, right,
                                                      [m](int lo, int count) { return count > 0 && lo + count > m; });
  return max(0, BlocksStartingBy<kBlockM, kBlockN>(m, q_begin, sq, sk, left, right) - first);
}

__device__ __forceinline__ int LoadAcquire(const int* addr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(addr) : "memory");
  return v;
}

// *addr += 1 once every memory operation of the thread, and of the threads it synchronised
// with (a barrier), is visible to the GPU.
__device__ __forceinline__ void IncrementRelease(int* addr) {
  asm volatile("fence.acq_rel.gpu;\nred.relaxed.gpu.global.add.s32 [%0], 1;\n" ::"l"(addr) : "memory");
}

// Named barriers (0 is __syncthreads): 256 threads each, the kBarDq ones 160 (a consumer
// warpgroup and the producer warp that keeps its dQ turns).
constexpr int kBarDsReady = 1;   // split queries: both consumer warpgroups stored dS^T
constexpr int kBarDsStored = 2;  // split keys: + 2 wg + item parity: warpgroup wg stored its dS^T
constexpr int kBarDqGo = 6;      // + wg: deterministic mode, warpgroup wg's turn at a dQ tile came
constexpr int kBarDqDone = 8;    // + wg: warpgroup wg added its dQ into the tile
constexpr int kBarDenseRead = 10;  // split queries: both consumer warpgroups read the dense tile
constexpr int kBarDqSent = 11;     // kDqExchange: both consumer warpgroups stored their halves
constexpr int kBarDqTaken = 12;    // + wg: kDqExchange: warpgroup wg read the half sent to it

}  // namespace device
#endif  // EJK_HOPPER_DEVICE_CODE

// kFeature: segment ids, a bias or a mask, or segment ids with one of those, applied
// element-wise in every query tile.
// kDeterministic: dQ added in a fixed order (p.dq_turns); its own kernels, so that the others
// carry none of its code.
template <int kHeadDim, bool kF16, bool kSoftcap, Elementwise kFeature, bool kDeterministic>
__global__ void __launch_bounds__(384, 1) BackwardKernel(const __grid_constant__ KernelParams p) {
#if EJK_HOPPER_DEVICE_CODE
  using namespace device;
  using L = Layout<kHeadDim, kFeature>;
  constexpr bool kSegments = L::kSegments;
  constexpr bool kMask = Has(kFeature, Elementwise::kMask);
  constexpr bool kBiasGrad = Has(kFeature, Elementwise::kBiasWithGrad);
  constexpr bool kDropout = Has(kFeature, Elementwise::kDropout);
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockN = L::kBlockN;
  constexpr int kColBlocks = L::kColBlocks;
  constexpr bool kSplitQueries = L::kSplitQueries;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  if constexpr (L::kAlignSlack == 0) {
    if ((SmemAddr(smem_raw) & 1023u) != 0) __trap();  // never, if the loader keeps the declaration
  }
  const uint32_t smem = (SmemAddr(smem_raw) + 1023u) & ~1023u;
  uint8_t* const smem_ptr = smem_raw + (smem - SmemAddr(smem_raw));
  const uint32_t k_smem = smem + L::kK;
  const uint32_t v_smem = smem + L::kV;
  const auto q_smem = [&](int s) { return smem + L::kQ + s * L::kQTileBytes; };
  const auto do_smem = [&](int s) { return smem + L::kDo + s * L::kQTileBytes; };
  const auto ds_smem = [&](int s) { return smem + L::kDs + s * L::kDsBytes; };
  const uint32_t kv_full = smem + L::kBarriers;
  const auto q_full = [&](int s) { return kv_full + 8 * (1 + s); };
  const auto do_full = [&](int s) { return kv_full + 8 * (1 + L::kStages + s); };
  const auto empty = [&](int s) { return kv_full + 8 * (1 + 2 * L::kStages + s); };

  // Block order: sections of p.section (batch, kv head) pairs; inside one, key tile 0 (the
  // longest under a causal mask) of every pair, then tile 1, ... Blocks are dispatched in
  // this order, so a causal grid ends with short tiles, and concurrent blocks read the Q and
  // dO of a few heads only. Deterministic mode walks the key tiles last to first (see
  // "Deterministic dQ").
  int n_block, kv_head, batch;
  {
    const int linear = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int per_section = p.section * gridDim.x;
    const int first = linear / per_section * p.section;
    const int pairs = min(p.section, static_cast<int>(gridDim.y * gridDim.z) - first);
    const int within = linear % per_section;
    const int pair = first + within % pairs;
    n_block = within / pairs;
    if constexpr (kDeterministic) n_block = gridDim.x - 1 - n_block;
    if (p.batch_inner) {
      batch = pair % static_cast<int>(gridDim.z);
      kv_head = pair / static_cast<int>(gridDim.z);
    } else {
      kv_head = pair % p.num_kv_heads;
      batch = pair / p.num_kv_heads;
    }
  }
  // The block's sequence: queries [q_begin, q_begin + sq) and keys [k_begin, k_begin + sk) of
  // the batch row. Packed sequences: n_block is in FindSequence's numbering; blocks past the
  // keys of their sequence exit.
  int seq = 0, q_begin = 0, k_begin = 0, sq = p.seqlen_q, sk = p.seqlen_k;
  if (p.cu_seqlens_k != nullptr) {
    seq = FindSequence<kBlockN>(p, n_block, threadIdx.x % 32);
    k_begin = Clamp(p.cu_seqlens_k[seq], 0, p.seqlen_k);
    sk = Clamp(p.cu_seqlens_k[seq + 1], k_begin, p.seqlen_k) - k_begin;
    q_begin = Clamp(p.cu_seqlens_q[seq], 0, p.seqlen_q);
    sq = Clamp(p.cu_seqlens_q[seq + 1], q_begin, p.seqlen_q) - q_begin;
    n_block -= k_begin / kBlockN + seq;
    if (n_block < 0 || n_block * kBlockN >= sk) return;
  }
  const int n0 = n_block * kBlockN;  // keys and queries from here on are local to the sequence
  const int offset = sk - sq;
  // The query tiles the block's keys are visible to. Query tiles are the batch row's
  // kBlockM-row tiles, those of the dQ accumulator, so with packed sequences a tile may hold
  // rows of the neighbours.
  int m_lo, m_count;
  QueryTilesOf<kBlockM, kBlockN>(n_block, q_begin, sq, sk, p.left, p.right, m_lo, m_count);
  // (Deterministic mode visits every tile of the range: see "Deterministic dQ".)
  if constexpr (kSegments && !kDeterministic) {
    NarrowToSegments<kBlockN>(p, batch, n0, sk, threadIdx.x % 32, m_lo, m_count);
  }
  const int items = m_count * p.group;  // item it: q head kv_head * group + it / m_count, m block m_lo + it % m_count

  if (threadIdx.x == 0) {
    MbarInit(kv_full, 1);
#pragma unroll
    for (int s = 0; s < L::kStages; ++s) {
      MbarInit(q_full(s), 1);
      MbarInit(do_full(s), 1);
      MbarInit(empty(s), 256);  // one arrival per consumer thread
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    PrefetchTmaDescriptor(&p.tma_q);
    PrefetchTmaDescriptor(&p.tma_k);
    PrefetchTmaDescriptor(&p.tma_v);
    PrefetchTmaDescriptor(&p.tma_do);
    if constexpr (L::kDense) PrefetchTmaDescriptor(&p.dense.map);
  }
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(L::kProducerRegisters));
    const int warp = threadIdx.x / 32;
    if (warp == 0 && lane == 0 && items > 0) {
      MbarExpectTx(kv_full, 2 * L::kKvTileBytes);
#pragma unroll
      for (int cb = 0; cb < kColBlocks; ++cb) {
        TmaLoad4d(k_smem + cb * L::kKvBlockBytes, &p.tma_k, kv_full, cb * 64, kv_head, k_begin + n0, batch);
        TmaLoad4d(v_smem + cb * L::kKvBlockBytes, &p.tma_v, kv_full, cb * 64, kv_head, k_begin + n0, batch);
      }
      for (int it = 0; it < items; ++it) {
        const int s = it % L::kStages;
        const uint32_t phase = (it / L::kStages) & 1;
        const int head = kv_head * p.group + it / m_count;
        const int m0 = (m_lo + it % m_count) * kBlockM;
        const int64_t row = (static_cast<int64_t>(batch) * p.num_q_heads + head) * p.padded_q + m0;
        MbarWait(empty(s), phase ^ 1);
        MbarExpectTx(q_full(s), L::kQTileBytes + kBlockM * 4 + L::kQIdBytes + L::kDenseTileBytes);
#pragma unroll
        for (int cb = 0; cb < kColBlocks; ++cb) {
          TmaLoad4d(q_smem(s) + cb * L::kQBlockBytes, &p.tma_q, q_full(s), cb * 64, head, m0, batch);
        }
        if constexpr (L::kDense) {  // never with packed sequences: k_begin is 0
          LoadDenseTile<typename L::Dense>(smem + L::DenseOffset(s), p.dense, q_full(s), n0, m0, head, batch);
        }
        BulkLoad(smem + L::kLse + s * kBlockM * 4, p.lse2 + row, kBlockM * 4, q_full(s));
        if constexpr (L::kQIdBytes > 0) {
          BulkLoad(smem + L::kQIds + s * L::kQIdBytes, p.q_segment_ids + static_cast<int64_t>(batch) * p.padded_q + m0,
                   L::kQIdBytes, q_full(s));
        }
        MbarExpectTx(do_full(s), L::kQTileBytes + kBlockM * 4);
#pragma unroll
        for (int cb = 0; cb < kColBlocks; ++cb) {
          TmaLoad4d(do_smem(s) + cb * L::kQBlockBytes, &p.tma_do, do_full(s), cb * 64, head, m0, batch);
        }
        BulkLoad(smem + L::kDelta + s * kBlockM * 4, p.delta + row, kBlockM * 4, do_full(s));
      }
    } else if (kDeterministic && (warp == 1 || warp == 2)) {
      // Deterministic dQ: the key blocks that see a query tile add their dQ into it one after
      // the other, the last key block first, each consumer warpgroup into its own columns (or
      // rows) after the same warpgroup of the block before; warp 1 + wg keeps the turns of
      // consumer warpgroup wg. Blocks are dispatched last key tile first, so a block waits
      // only for blocks dispatched before it (running or done: no deadlock); under
      // causal-like masks block nb reaches each tile after block nb + 1 did and never waits,
      // without masks it trails it by a tile. The block's turn at tile m is the number of
      // blocks after it that see m (this mode does not narrow the tiles to segments): of its
      // own sequence, those up to the last whose tiles start by m; with packed sequences
      // also every block of the later sequences that reach into m, which this warp's lanes
      // count a sequence each. That count relies on non-decreasing cu_seqlens (from which
      // each block number names one key block); where they are not, the blocks do not wait
      // for turns, so malformed offsets give unordered sums rather than a hang. The
      // consumers' reductions reach L2 before the count moves on: they arrive on a barrier
      // that this warp waits for before its release.
      const int served = warp - 1;
      bool ordered = true;
      for (int n = lane; n < p.num_sequences; n += 32) {
        ordered &= p.cu_seqlens_q[n] <= p.cu_seqlens_q[n + 1] && p.cu_seqlens_k[n] <= p.cu_seqlens_k[n + 1];
      }
      ordered = __all_sync(0xffffffffu, ordered);
      for (int it = 0; it < items; ++it) {
        const int head = kv_head * p.group + it / m_count;
        const int m_block = m_lo + it % m_count;
        int later = BlocksStartingBy<kBlockM, kBlockN>(m_block, q_begin, sq, sk, p.left, p.right) - n_block - 1;
        if (p.cu_seqlens_k != nullptr) {
          int seen = 0;
          for (int n = seq + 1 + lane; n < p.num_sequences; n += 32) {
            const int begin = Clamp(p.cu_seqlens_q[n], 0, p.seqlen_q);
            if (begin >= (m_block + 1) * kBlockM) break;  // and so do the later ones
            const int key_begin = Clamp(p.cu_seqlens_k[n], 0, p.seqlen_k);
            seen += BlocksSeeing<kBlockM, kBlockN>(m_block, begin, Clamp(p.cu_seqlens_q[n + 1], begin, p.seqlen_q) - begin,
                                                   Clamp(p.cu_seqlens_k[n + 1], key_begin, p.seqlen_k) - key_begin,
                                                   p.left, p.right);
          }
          later += __reduce_add_sync(0xffffffffu, seen);
        }
        int* turn = p.dq_turns + ((static_cast<int64_t>(batch) * p.num_q_heads + head) * p.num_m_blocks + m_block) * 2 +
                    served;
        if (lane == 0 && ordered) {
          while (LoadAcquire(turn) != later) {
          }
        }
        __syncwarp();
        NamedBarrierArrive(kBarDqGo + served, 160);
        NamedBarrierSync(kBarDqDone + served, 160);
        if (lane == 0) IncrementRelease(turn);
      }
    }
    return;
  }

  // Consumers.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(L::kConsumerRegisters));
  const int wg = warpgroup - 1;
  const int tid = threadIdx.x % 128;
  const int warp = tid / 32;
  const int g = lane / 4, t4 = lane % 4;
  // This thread's dK/dV rows (keys) within the block, key_row + 8 * r, and columns,
  // col0 + 8 j + 2 t4 + c.
  const int key_row = (kSplitQueries ? 0 : wg * 64) + warp * 16 + g;
  const int col0 = kSplitQueries ? wg * 128 : 0;
  // The segment ids of this thread's keys (those past the sequence are masked anyway).
  int kv_id[2] = {0, 0};
  if constexpr (kSegments) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = n0 + key_row + 8 * r;
      if (key < sk) kv_id[r] = __ldg(p.kv_segment_ids + static_cast<int64_t>(batch) * p.seqlen_k + key);
    }
  }
  constexpr int kAcc = kSplitQueries ? L::kPaddedDim / 4 : kHeadDim / 2;
  float dk[kAcc], dv[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) dk[i] = dv[i] = 0.0f;

  // P^T and dS^T (of q.k) from the recomputed S^T and dP^T (masks are applied by the caller);
  // dlogit gets the logit's gradient, which is also the bias's. Under a soft cap a bias comes
  // after it (semantics.h), in the capped score's units (bias_after_cap, dense kernels only).
  // z: dropout's multiplier of the element (0 or 1 / (1 - p); 1 without dropout): sc becomes
  // dropout(P) for dV, and dP the gradient of the kept probability.
  constexpr bool kBiasAfterCap = kSoftcap && L::Dense::kBias;
  const auto prob_and_grad = [&](float& sc, float& dp, float l, float d, float bias_after_cap, float z,
                                 float& dlogit) {
    float pv, ds;
    if constexpr (kSoftcap) {
      const float t = Tanh(sc * p.softcap_pre);
      pv = Exp2(fmaf(kBiasAfterCap ? t + bias_after_cap : t, p.logit_scale, -l));
      dlogit = pv * (kDropout ? fmaf(dp, z, -d) : dp - d);
      ds = dlogit * (1.0f - t * t);
    } else {
      pv = Exp2(fmaf(sc, p.logit_scale, -l));
      ds = dlogit = pv * (kDropout ? fmaf(dp, z, -d) : dp - d);
    }
    sc = kDropout ? pv * z : pv;
    dp = ds;
  };
  // Dropout: the seed, each query's DropoutRowKey, and the element multipliers z[c][r] of
  // (query c of a column pair, key row r of this thread); queries and keys are local to the
  // sequence, queries hashed as packed indices of the batch row, keys as they are.
  const uint32_t dropout_seed = kDropout ? __ldg(p.dropout.seed) : 0u;
  const auto dropout_row_key = [&](uint32_t head_key, int query) {
    return DropoutRowKeyOfHead(head_key, static_cast<uint32_t>(q_begin + query));
  };
  // Keys key_row and key_row + 8 share a hash (DropoutKeepPair: key_row % 16 < 8).
  const auto dropout_z = [&](const uint32_t (&row_keys)[2], float (&z)[2][2]) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      bool keep, keep_plus_8;
      DropoutKeepPair(row_keys[c], static_cast<uint32_t>(n0 + key_row), p.dropout.shifted_threshold, keep,
                      keep_plus_8);
      z[c][0] = keep ? p.dropout.scale : 0.0f;
      z[c][1] = keep_plus_8 ? p.dropout.scale : 0.0f;
    }
  };
  // Whether key (of the block) is hidden from query (of the tile), for tiles on a mask
  // boundary, at the sequence end, or holding rows of other sequences (packed sequences: their
  // lse is finite).
  const int right = offset + p.right, left = offset - p.left;
  const auto hidden = [&](int key, int query) {
    return (key >= sk) | (key > query + right) | (key < query + left) |
           (static_cast<unsigned>(query) >= static_cast<unsigned>(sq));  // no short circuit: no branches
  };
  // Whether a query of segment q_id is in another segment than this thread's key row r.
  const auto other_segment = [&](int q_id, int r) { return kSegments && q_id != kv_id[r]; };
  // Tiles reaching past the sequence's queries need the mask with packed sequences only:
  // elsewhere those rows are padding, with lse = +inf.
  const int q_fence = p.cu_seqlens_k != nullptr ? sq : p.padded_q;
  // dQ of warpgroup column block b (64 x 64 floats, 4096) into its tile in register order:
  // float4 (j, thread) holds accumulator elements 4j..4j+3, so each warp's reductions cover
  // 512 contiguous bytes. Columns past a padded head dim (64 b + 8 j on) are left out.
  // With kDqExchange, dq holds the 4 float4 of columns 32 wg on (j = 4 wg + jj).
  const auto add_dq = [&](const float* dq, int it, int b) {
    const int head = kv_head * p.group + it / m_count;
    const int m_block = m_lo + it % m_count;
    float* tile = p.dq_accum + ((static_cast<int64_t>(batch) * p.num_q_heads + head) * p.num_m_blocks + m_block) *
                                   static_cast<int64_t>(L::kDqFloats) + b * 4096;
    if constexpr (L::kDqExchange) {
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        RedAddF32x4(tile + ((4 * wg + jj) * 128 + tid) * 4, dq[4 * jj], dq[4 * jj + 1], dq[4 * jj + 2], dq[4 * jj + 3]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (kHeadDim == L::kPaddedDim || 64 * b + 8 * j < kHeadDim) {
          RedAddF32x4(tile + (j * 128 + tid) * 4, dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
        }
      }
    }
  };

  // kDqExchange: this warpgroup's partial dQ of item it (its keys' share) goes half to the
  // other warpgroup, through shared memory as float4 (half, jj, thread); the half it keeps
  // (float4 j = 4 wg + jj) gets the other's share added, into mine[4 jj..]. Each half is
  // rewritten once its reader signalled it read the previous item's (kBarDqTaken, one arrival
  // pending at most: the last item's is not signalled).
  const auto exchange_dq = [&](const float (&dq)[32], int it, float (&mine)[16]) {
    float4* const exchange = reinterpret_cast<float4*>(smem_ptr + L::kDqExchangeOffset);
    if (it > 0) NamedBarrierSync(kBarDqTaken + (1 - wg), 256);
    // Register indices must be constants: select between the halves, never index by wg.
    const bool first = wg == 0;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int lo = 4 * jj, hi = 16 + 4 * jj;
      exchange[(1 - wg) * 512 + jj * 128 + tid] =
          first ? make_float4(dq[hi], dq[hi + 1], dq[hi + 2], dq[hi + 3])
                : make_float4(dq[lo], dq[lo + 1], dq[lo + 2], dq[lo + 3]);
    }
    NamedBarrierSync(kBarDqSent, 256);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int lo = 4 * jj, hi = 16 + 4 * jj;
      const float4 other = exchange[wg * 512 + jj * 128 + tid];
#pragma unroll
      for (int e = 0; e < 4; ++e) mine[lo + e] = (first ? dq[lo + e] : dq[hi + e]);
      mine[lo] += other.x;
      mine[lo + 1] += other.y;
      mine[lo + 2] += other.z;
      mine[lo + 3] += other.w;
    }
    if (it + 1 < items) NamedBarrierArrive(kBarDqTaken + wg, 256);
  };

  // This warpgroup's dQ of item it into the accumulator (both of its blocks when splitting
  // queries, its half of the shared block with kDqExchange); in deterministic mode in the
  // tile's turn, which warp 1 + wg of the producer warpgroup waits for and passes on (see
  // "Deterministic dQ").
  const auto add_item_dq = [&](const float* dq, int it) {
    if constexpr (kDeterministic) NamedBarrierSync(kBarDqGo + wg, 160);
    if constexpr (kSplitQueries) {
      add_dq(dq, it, 2 * wg);
      add_dq(dq + 32, it, 2 * wg + 1);
    } else {
      add_dq(dq, it, L::kDqExchange ? 0 : wg);
    }
    if constexpr (kDeterministic) NamedBarrierArrive(kBarDqDone + wg, 160);
  };

  // Split keys: the dQ of an item is dS K over both warpgroups' keys (this warpgroup's 64 x 64
  // block of it), so it waits for the other warpgroup's dS^T. With kLateDq it is issued with
  // the next item's dV and dK, by when that dS^T is long stored: the warpgroups do not meet
  // midway, and one's element-wise work can run under the other's products. Each
  // warpgroup signals its stores on its own barrier per item parity; waiting for the other's
  // item i - 1 before signalling item i keeps at most one signal per barrier pending.
  const auto wait_other_ds = [&](int item) { NamedBarrierSync(kBarDsStored + 2 * (1 - wg) + (item & 1), 256); };
  // kDqExchange: over this warpgroup's 64 keys only.
  const auto issue_dq = [&](float (&dq)[32], int buffer) {
    constexpr int kDqRowBlocks = kBlockM / 64;
    const int dq_row_block = kDqRowBlocks == 2 ? wg : 0;
    const int dq_col_block = kDqRowBlocks == 2 || L::kDqExchange ? 0 : wg;
    const int first_key = L::kDqExchange ? wg * 64 : 0;
#pragma unroll
    for (int kk = 0; kk < (L::kDqExchange ? 4 : kBlockN / 16); ++kk) {
      const int key = first_key + kk * 16;
      const uint64_t desc_a = MakeDescriptor(ds_smem(buffer) + dq_row_block * L::kDsBlockBytes + key * 128, L::kDsBlockBytes, 1024);
      const uint64_t desc_b = MakeDescriptor(k_smem + dq_col_block * L::kKvBlockBytes + key * 128, L::kKvBlockBytes, 1024);
      WgmmaSST<kF16, 1, 1>(dq, desc_a, desc_b, kk > 0);
    }
  };
  // kBiasGrad: the logit's gradient into item it's [Sq, Sk] plane of dbias (dense calls: sq and
  // sk are the tensor's). Reductions and stores, no loads: a read-modify-write here stalled
  // the consumers on each load (forward+backward 22.1 against 9.3 ms, H100). Stores write
  // zeros too, so that an unmasked call needs no zeroing; sums add them too: skipping the
  // zeros of a mask hiding a random 10% of the keys cost 1.4 ms more than adding them (d128,
  // 4 x 4096, H16, 10.6 against 9.3 ms with every key shown).
  const auto store_dbias = [&](int it, int query, int key, float dlogit) {
    if (query < sq && key < sk) {
      const int64_t at = batch * p.dbias_stride_b + (kv_head * p.group + it / m_count) * p.dbias_stride_h +
                         static_cast<int64_t>(query) * sk + key;
      if (p.dbias_atomic) {
        atomicAdd(static_cast<float*>(p.dbias) + at, dlogit);
      } else if (p.dbias_f32) {
        static_cast<float*>(p.dbias)[at] = dlogit;
      } else if constexpr (kF16 != L::Dense::kBiasF32) {
        static_cast<__half*>(p.dbias)[at] = __float2half_rn(dlogit);
      } else {
        static_cast<__nv_bfloat16*>(p.dbias)[at] = __float2bfloat16_rn(dlogit);
      }
    }
  };
  // The dropout hash's (batch, head) index of the first item's head; item it's is it / m_count
  // more. Outside the loop: the origin words are loads the loop could not hoist past its stores.
  const uint32_t dropout_batch_head =
      kDropout ? DropoutBatchHead(p.dropout.origin, p.num_q_heads, p.dropout.first_batch + batch,
                                  static_cast<uint32_t>(kv_head * p.group))
               : 0u;
  if (items > 0) MbarWait(kv_full, 0);
  for (int it = 0; it < items; ++it) {
    const int s = it % L::kStages;
    const uint32_t phase = (it / L::kStages) & 1;
    const int m0 = (m_lo + it % m_count) * kBlockM - q_begin;  // local to the sequence
    const uint32_t head_key =
        kDropout ? DropoutHeadKey(dropout_seed, dropout_batch_head + static_cast<uint32_t>(it / m_count)) : 0u;
    if constexpr (kSplitQueries) {
      // S^T and dP^T for the block's 64 keys x this warpgroup's 32 queries.
      float sc[16], dp[16];
      const auto issue_scores = [&](float (&acc)[16], uint32_t a_base, uint32_t b_base) {
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
          const uint64_t desc_a = MakeDescriptor(a_base + (kk / 4) * L::kKvBlockBytes + (kk % 4) * 32, 16, 1024);
          const uint64_t desc_b = MakeDescriptor(b_base + (kk / 4) * L::kQBlockBytes + wg * 32 * 128 + (kk % 4) * 32, 16, 1024);
          WgmmaSST<kF16, 0, 0>(acc, desc_a, desc_b, kk > 0);
        }
      };
      MbarWait(q_full(s), phase);
      WgmmaFence();
      issue_scores(sc, k_smem, q_smem(s));
      WgmmaCommit();
      MbarWait(do_full(s), phase);
      issue_scores(dp, v_smem, do_smem(s));
      WgmmaCommit();
      WgmmaWait<0>();
      FenceRegisters(sc);
      FenceRegisters(dp);

      const float* lse = reinterpret_cast<const float*>(smem_ptr + L::kLse + s * kBlockM * 4);
      const float* delta = reinterpret_cast<const float*>(smem_ptr + L::kDelta + s * kBlockM * 4);
      const bool masked = kSegments || kMask || n0 + kBlockN > sk || n0 + kBlockN - 1 > m0 + offset + p.right ||
                          n0 < m0 + kBlockM - 1 + offset - p.left || m0 < 0 || m0 + kBlockM > q_fence;
      const int* q_ids = reinterpret_cast<const int*>(smem_ptr + L::kQIds + s * L::kQIdBytes);
      // The bias or mask of this thread's elements, read before either warpgroup overwrites the
      // stage's P^T buffer, which holds the tile: element (key key_row + 8 r, query 32 wg + 8 j
      // + 2 t4 + c) sits in row query, 16-byte chunk (key / 8 for a bias, key / 16 for a mask)
      // ^ (query % 8), and key_row % 8 == g.
      float bias_after_cap[16];  // kBiasAfterCap only
      uint32_t shown = 0xffffu;  // a mask's element i, bit i
      if constexpr (L::kDense) {
        const uint32_t dense_tile = smem + L::DenseOffset(s);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int i = 4 * j + 2 * r + c;
              const uint32_t row = dense_tile + (32 * wg + 8 * j + 2 * t4 + c) * 128;
              if constexpr (L::Dense::kBias) {
                uint16_t bits;
                asm volatile("ld.shared.u16 %0, [%1];\n"
                             : "=h"(bits)
                             : "r"(row + (((2 * warp + r) ^ (2 * t4 + c)) << 4) + 2 * g)
                             : "memory");
                const float bias = kF16 ? __half2float(__ushort_as_half(bits)) : __bfloat162float(__ushort_as_bfloat16(bits));
                if constexpr (kBiasAfterCap) {
                  bias_after_cap[i] = bias * p.dense.bias_to_score;
                } else {
                  sc[i] = fmaf(bias, p.dense.bias_to_score, sc[i]);
                }
              } else {
                uint16_t byte;
                asm volatile("ld.shared.u8 %0, [%1];\n" : "=h"(byte) : "r"(row + ((warp ^ (2 * t4 + c)) << 4) + g + 8 * r) : "memory");
                if (byte == 0) shown &= ~(1u << i);
              }
            }
          }
        }
        NamedBarrierSync(kBarDenseRead, 256);
      }
      // Columns are queries 32 wg + 8j + 2 t4 + c; P^T and dS^T go to [key][64 queries] in the
      // 128-byte swizzle: the pair (key, queries 8 (4 wg + j) + 2 t4 + {0, 1}) sits in 16-byte
      // chunk (4 wg + j) ^ (key % 8), and key % 8 == g.
      uint8_t* p_base = smem_ptr + L::kP + (it & 1) * L::kDsBytes;
      uint8_t* ds_base = smem_ptr + L::kDs + (it & 1) * L::kDsBytes;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int q_col = 32 * wg + 8 * j + 2 * t4;
        const float2 l2 = *reinterpret_cast<const float2*>(lse + q_col);
        const float2 d2 = *reinterpret_cast<const float2*>(delta + q_col);
        const int2 ids = kSegments ? *reinterpret_cast<const int2*>(q_ids + q_col) : int2{};
        float z[2][2] = {{1.0f, 1.0f}, {1.0f, 1.0f}};
        if constexpr (kDropout) {
          const uint32_t row_keys[2] = {dropout_row_key(head_key, m0 + q_col),
                                        dropout_row_key(head_key, m0 + q_col + 1)};
          dropout_z(row_keys, z);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int i = 4 * j + 2 * r + c;
            float dlogit;
            prob_and_grad(sc[i], dp[i], c ? l2.y : l2.x, c ? d2.y : d2.x, kBiasAfterCap ? bias_after_cap[i] : 0.0f,
                          z[c][r], dlogit);
            if (masked && (hidden(n0 + key_row + 8 * r, m0 + q_col + c) | other_segment(c ? ids.y : ids.x, r) |
                           (kMask && !((shown >> i) & 1u)))) {
              sc[i] = dp[i] = dlogit = 0.0f;
            }
            if constexpr (kBiasGrad) store_dbias(it, m0 + q_col + c, n0 + key_row + 8 * r, dlogit);
          }
          const int at = (key_row + 8 * r) * 128 + (((4 * wg + j) ^ g) << 4) + t4 * 4;
          *reinterpret_cast<uint32_t*>(p_base + at) = Pack<kF16>(sc[4 * j + 2 * r], sc[4 * j + 2 * r + 1]);
          *reinterpret_cast<uint32_t*>(ds_base + at) = Pack<kF16>(dp[4 * j + 2 * r], dp[4 * j + 2 * r + 1]);
        }
      }
      FenceProxyAsyncShared();
      NamedBarrierSync(kBarDsReady, 256);

      // dV += P^T dO and dK += dS^T Q over this warpgroup's 128 columns; dQ = dS K likewise.
      const uint32_t p_smem = smem + L::kP + (it & 1) * L::kDsBytes;
      const uint32_t dst_smem = ds_smem(it & 1);
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        WgmmaSST<kF16, 0, 1>(dv, MakeDescriptor(p_smem + kk * 32, 16, 1024),
                             MakeDescriptor(do_smem(s) + 2 * wg * L::kQBlockBytes + kk * 16 * 128, L::kQBlockBytes, 1024), 1);
      }
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        WgmmaSST<kF16, 0, 1>(dk, MakeDescriptor(dst_smem + kk * 32, 16, 1024),
                             MakeDescriptor(q_smem(s) + 2 * wg * L::kQBlockBytes + kk * 16 * 128, L::kQBlockBytes, 1024), 1);
      }
      float dq[64];
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        WgmmaSST<kF16, 1, 1>(dq, MakeDescriptor(dst_smem + kk * 16 * 128, L::kDsBlockBytes, 1024),
                             MakeDescriptor(k_smem + 2 * wg * L::kKvBlockBytes + kk * 16 * 128, L::kKvBlockBytes, 1024),
                             kk > 0);
      }
      WgmmaCommit();
      WgmmaWait<0>();
      FenceRegisters(dq);
      FenceRegisters(dk);
      FenceRegisters(dv);
      // Q, dO, lse and D of this stage are no longer read. Each thread fences its own reads of
      // lse and D (generic proxy) before the bulk copies that refill the stage and arrives
      // itself: a warp-level handoff left racecheck reporting these reads in some runs.
      FenceProxyAsyncShared();
      MbarArrive(empty(s));
      add_item_dq(dq, it);
    } else {
      // S^T and dP^T for this warpgroup's 64 keys x the tile's queries.
      float sc[kBlockM / 2], dp[kBlockM / 2];
      const auto issue_scores = [&](float (&acc)[kBlockM / 2], uint32_t a_base, uint32_t b_base) {
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
          const uint64_t desc_a = MakeDescriptor(a_base + (kk / 4) * L::kKvBlockBytes + wg * 64 * 128 + (kk % 4) * 32, 16, 1024);
          const uint64_t desc_b = MakeDescriptor(b_base + (kk / 4) * L::kQBlockBytes + (kk % 4) * 32, 16, 1024);
          if constexpr (kBlockM == 64) {
            WgmmaSST<kF16, 0, 0>(acc, desc_a, desc_b, kk > 0);
          } else {
            WgmmaSS<kF16>(acc, desc_a, desc_b, kk > 0);
          }
        }
      };
      // Both tiles before either product: one commit group for S^T and dP^T measured 2-7%
      // faster than waiting for dO between the two.
      MbarWait(q_full(s), phase);
      MbarWait(do_full(s), phase);
      WgmmaFence();
      issue_scores(sc, k_smem, q_smem(s));
      issue_scores(dp, v_smem, do_smem(s));
      WgmmaCommit();
      WgmmaWait<0>();
      FenceRegisters(sc);
      FenceRegisters(dp);

      // P^T and dS^T; columns are queries m0 + 8j + 2 t4 + c.
      const float* lse = reinterpret_cast<const float*>(smem_ptr + L::kLse + s * kBlockM * 4);
      const float* delta = reinterpret_cast<const float*>(smem_ptr + L::kDelta + s * kBlockM * 4);
      const bool masked = kSegments || kMask || n0 + kBlockN > sk || n0 + kBlockN - 1 > m0 + offset + p.right ||
                          n0 < m0 + kBlockM - 1 + offset - p.left || m0 < 0 || m0 + kBlockM > q_fence;
      // The tile's query ids: staged with the tile, or the padded copy in global memory.
      const int* q_ids = L::kQIdBytes > 0 || !kSegments
                             ? reinterpret_cast<const int*>(smem_ptr + L::kQIds + s * L::kQIdBytes)
                             : p.q_segment_ids + static_cast<int64_t>(batch) * p.padded_q + m0;
      // The bias or mask tile: element (query q, key wg * 64 + 16 warp + 8 r + g) sits in row q
      // of block key / Dense::kBlockKeys, 16-byte chunk ((key % Dense::kBlockKeys) / (4, 8 or
      // 16)) ^ (q % 8), and q % 8 == 2 t4 + c.
      const uint32_t dense_tile = smem + L::DenseOffset(s);
      const auto dense_at = [&](int j, int r, int c) {
        const int query = 8 * j + 2 * t4 + c;
        if constexpr (kMask) {
          return dense_tile + query * 128 + (((wg * 4 + warp) ^ (2 * t4 + c)) << 4) + g + 8 * r;
        } else if constexpr (L::Dense::kBiasF32) {
          return dense_tile + (2 * wg + warp / 2) * L::Dense::kBlockBytes + query * 128 +
                 (((4 * (warp % 2) + 2 * r + g / 4) ^ (2 * t4 + c)) << 4) + 4 * (g % 4);
        } else {
          return dense_tile + wg * L::Dense::kBlockBytes + query * 128 + (((2 * warp + r) ^ (2 * t4 + c)) << 4) + 2 * g;
        }
      };
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) {
        const float2 l2 = *reinterpret_cast<const float2*>(lse + 8 * j + 2 * t4);
        const float2 d2 = *reinterpret_cast<const float2*>(delta + 8 * j + 2 * t4);
        const int2 ids = kSegments ? *reinterpret_cast<const int2*>(q_ids + 8 * j + 2 * t4) : int2{};
        float z[2][2] = {{1.0f, 1.0f}, {1.0f, 1.0f}};
        if constexpr (kDropout) {
          const uint32_t row_keys[2] = {dropout_row_key(head_key, m0 + 8 * j + 2 * t4),
                                        dropout_row_key(head_key, m0 + 8 * j + 2 * t4 + 1)};
          dropout_z(row_keys, z);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int i = 4 * j + 2 * r + c;
            float bias_after_cap = 0.0f, dlogit;
            if constexpr (L::Dense::kBias) {
              float bias;
              if constexpr (L::Dense::kBiasF32) {
                asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(bias) : "r"(dense_at(j, r, c)) : "memory");
              } else {
                uint16_t bits;
                asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(bits) : "r"(dense_at(j, r, c)) : "memory");
                if constexpr (kF16) {
                  bias = __half2float(__ushort_as_half(bits));
                } else {
                  bias = __bfloat162float(__ushort_as_bfloat16(bits));
                }
              }
              if constexpr (kBiasAfterCap) {
                bias_after_cap = bias * p.dense.bias_to_score;
              } else {
                sc[i] = fmaf(bias, p.dense.bias_to_score, sc[i]);
              }
            }
            bool hidden_by_mask = false;
            if constexpr (kMask) {
              uint16_t shown;
              asm volatile("ld.shared.u8 %0, [%1];\n" : "=h"(shown) : "r"(dense_at(j, r, c)) : "memory");
              hidden_by_mask = shown == 0;
            }
            prob_and_grad(sc[i], dp[i], c ? l2.y : l2.x, c ? d2.y : d2.x, bias_after_cap,
                          z[c][r], dlogit);
            if (masked && (hidden(n0 + key_row + 8 * r, m0 + 8 * j + 2 * t4 + c) | other_segment(c ? ids.y : ids.x, r) |
                           hidden_by_mask)) {
              sc[i] = dp[i] = dlogit = 0.0f;
            }
            if constexpr (kBiasGrad) store_dbias(it, m0 + 8 * j + 2 * t4 + c, n0 + key_row + 8 * r, dlogit);
          }
        }
      }
      uint32_t pp[kBlockM / 4], pds[kBlockM / 4];
#pragma unroll
      for (int i = 0; i < kBlockM / 4; ++i) {
        pp[i] = Pack<kF16>(sc[2 * i], sc[2 * i + 1]);
        pds[i] = Pack<kF16>(dp[2 * i], dp[2 * i + 1]);
      }
      // dS^T into shared memory, [query block][key][64 queries] in the 128-byte swizzle: the
      // pair (key, queries 8j + 2 t4 + {0, 1}) sits in 16-byte chunk (j % 8) ^ (key % 8), and
      // key % 8 == g. With kLateDq the buffer held item it - 3, whose dQ both warpgroups
      // completed before the other one stored item it - 1's dS^T.
      if (L::kLateDq && it > 0) wait_other_ds(it - 1);
      {
        uint8_t* ds_base = smem_ptr + L::kDs + (it % L::kDsBuffers) * L::kDsBytes;
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int key = key_row + 8 * r;
            *reinterpret_cast<uint32_t*>(ds_base + (j / 8) * L::kDsBlockBytes + key * 128 + (((j % 8) ^ g) << 4) +
                                         t4 * 4) = pds[2 * j + r];
          }
        }
      }
      FenceProxyAsyncShared();
      if constexpr (!L::kDqExchange) NamedBarrierArrive(kBarDsStored + 2 * wg + (it & 1), 256);

      // dV += P^T dO, dK += dS^T Q, and dQ.
      float dq[32];
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        const uint32_t a[4] = {pp[4 * kk], pp[4 * kk + 1], pp[4 * kk + 2], pp[4 * kk + 3]};
        WgmmaRS<kF16>(dv, a, MakeDescriptor(do_smem(s) + kk * 16 * 128, L::kQBlockBytes, 1024), 1);
      }
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        const uint32_t a[4] = {pds[4 * kk], pds[4 * kk + 1], pds[4 * kk + 2], pds[4 * kk + 3]};
        WgmmaRS<kF16>(dk, a, MakeDescriptor(q_smem(s) + kk * 16 * 128, L::kQBlockBytes, 1024), 1);
      }
      if constexpr (L::kLateDq) {
        // The previous item's dQ. Item 0 computes a discarded one from buffer 2, not written
        // before item 2: a branch around part of the products would make ptxas serialise every
        // wgmma. (Issuing it first and reducing it while dV and dK run measured 1-10% slower.)
        issue_dq(dq, (it + L::kDsBuffers - 1) % L::kDsBuffers);
      } else if constexpr (L::kDqExchange) {
        issue_dq(dq, 0);
      } else {
        WgmmaCommit();
        wait_other_ds(it);
        issue_dq(dq, it % L::kDsBuffers);
      }
      WgmmaCommit();
      WgmmaWait<0>();
      FenceRegisters(dq);
      FenceRegisters(dk);
      FenceRegisters(dv);
      FenceRegisters(pp);
      FenceRegisters(pds);
      // Q, dO, lse and D of this stage are no longer read. Each thread fences its own reads of
      // lse and D (generic proxy) before the bulk copies that refill the stage and arrives
      // itself: a warp-level handoff left racecheck reporting these reads in some runs.
      FenceProxyAsyncShared();
      MbarArrive(empty(s));
      if constexpr (L::kDqExchange) {
        float mine[16];
        exchange_dq(dq, it, mine);
        add_item_dq(mine, it);
      } else if (!L::kLateDq || it > 0) {
        add_item_dq(dq, L::kLateDq ? it - 1 : it);
      }
    }
  }
  if constexpr (L::kLateDq) {
    if (items > 0) {  // the last item's dQ
      float dq[32];
      wait_other_ds(items - 1);
      WgmmaFence();
      issue_dq(dq, (items - 1) % L::kDsBuffers);
      WgmmaCommit();
      WgmmaWait<0>();
      FenceRegisters(dq);
      add_item_dq(dq, items - 1);
    }
  }

  // Epilogue: dK (scaled) and dV rows of this thread's keys, up to the head dim.
  const int64_t row_stride = static_cast<int64_t>(p.num_kv_heads) * p.head_dim;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = n0 + key_row + 8 * r;
    if (key < sk) {
      const int64_t off = (static_cast<int64_t>(batch) * p.seqlen_k + k_begin + key) * row_stride +
                          static_cast<int64_t>(kv_head) * p.head_dim + col0 + 2 * t4;
#pragma unroll
      for (int j = 0; j < kAcc / 4; ++j) {
        if (col0 + 8 * j >= p.head_dim) break;
        const float2 dk2 = make_float2(dk[4 * j + 2 * r] * p.dk_scale, dk[4 * j + 2 * r + 1] * p.dk_scale);
        const float2 dv2 = make_float2(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
        if (p.dkv_f32) {
          *reinterpret_cast<float2*>(static_cast<float*>(p.dk) + off + 8 * j) = dk2;
          *reinterpret_cast<float2*>(static_cast<float*>(p.dv) + off + 8 * j) = dv2;
        } else {
          *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.dk) + off + 8 * j) = Pack<kF16>(dk2.x, dk2.y);
          *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.dv) + off + 8 * j) = Pack<kF16>(dv2.x, dv2.y);
        }
      }
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // a build without sm_90a code must fail loudly, not leave the outputs unwritten
#endif  // EJK_HOPPER_DEVICE_CODE
}

template <int kHeadDim, bool kF16, bool kSoftcap, Elementwise kFeature>
Status LaunchKernel(const KernelParams& kp, int batch, cudaStream_t stream) {
  using L = Layout<kHeadDim, kFeature>;
  static_assert(L::kFits, "shared memory");
  void (*kernel)(const KernelParams) = kp.dq_turns != nullptr ? BackwardKernel<kHeadDim, kF16, kSoftcap, kFeature, true>
                                                              : BackwardKernel<kHeadDim, kF16, kSoftcap, kFeature, false>;
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kAllocBytes);
      err != cudaSuccess) {
    return Status::Internal(std::string("hopper flash attention backward: shared memory attribute: ") +
                            cudaGetErrorString(err));
  }
  // Packed sequences: the kernel's numbering ends before seqlen_k / kBlockN + num_sequences.
  const int n_blocks = kp.cu_seqlens_k != nullptr ? kp.seqlen_k / L::kBlockN + kp.num_sequences
                                                  : (kp.seqlen_k + L::kBlockN - 1) / L::kBlockN;
  const dim3 grid(n_blocks, kp.num_kv_heads, batch);
  // Keys hidden from earlier queries (causal-like masks) give the key tiles decreasing
  // lengths: sections of 4 pairs end the grid evenly (a list-scheduling model: 88% -> 99.7%
  // of the SMs busy for GQA 32/8 at 4 x 4096). Equal tiles keep the plain order.
  KernelParams ordered = kp;
  ordered.section = kp.right < kp.seqlen_q ? 4 : 1;
  kernel<<<grid, L::kThreads, L::kAllocBytes, stream>>>(ordered);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return Status::Internal(std::string("hopper flash attention backward: launch failed: ") + cudaGetErrorString(err));
  }
  return Status::Ok();
}

template <int kHeadDim, bool kSoftcap, Elementwise kFeature>
Status LaunchDType(const KernelParams& kp, bool f16, int batch, cudaStream_t stream) {
  if (!f16) return LaunchKernel<kHeadDim, false, kSoftcap, kFeature>(kp, batch, stream);
  if constexpr (kFloat16Built) {
    return LaunchKernel<kHeadDim, true, kSoftcap, kFeature>(kp, batch, stream);
  } else {
    return FeatureNotBuilt("float16");
  }
}

template <int kHeadDim, Elementwise kFeature>
Status LaunchVariant(const KernelParams& kp, bool f16, bool softcap, int batch, cudaStream_t stream) {
  if (!softcap) return LaunchDType<kHeadDim, false, kFeature>(kp, f16, batch, stream);
  if constexpr (kSoftCapBuilt) {
    return LaunchDType<kHeadDim, true, kFeature>(kp, f16, batch, stream);
  } else {
    return FeatureNotBuilt("logits_soft_cap");
  }
}

template <int kHeadDim>
Status Launch(const KernelParams& kp, bool f16, bool softcap, int batch, cudaStream_t stream) {
  return LaunchVariant<kHeadDim, Elementwise::kNone>(kp, f16, softcap, batch, stream);
}

template <int kHeadDim>
Status LaunchSegments(const KernelParams& kp, bool f16, bool softcap, int batch, cudaStream_t stream) {
  return LaunchVariant<kHeadDim, Elementwise::kSegmentIds>(kp, f16, softcap, batch, stream);
}

// Dropout, with or without segment ids.
template <int kHeadDim>
Status LaunchDropout(const KernelParams& kp, bool f16, bool softcap, int batch, cudaStream_t stream) {
  if (kp.q_segment_ids == nullptr) return LaunchVariant<kHeadDim, Elementwise::kDropout>(kp, f16, softcap, batch, stream);
  if constexpr (kSegmentIdsBuilt) {
    return LaunchVariant<kHeadDim, Elementwise::kSegmentIdsDropout>(kp, f16, softcap, batch, stream);
  } else {
    return FeatureNotBuilt("segment_ids");
  }
}

// Dropout with `feature` (a bias, its gradient or not, read as float32 from head dim 64 to 128
// where its dtype is not the query's, or a mask) and kWith (segment ids, or nothing), without a
// soft cap (hopper::DropoutUnsupportedReason).
template <int kHeadDim, Elementwise kWith>
Status LaunchDenseDropoutWith(const KernelParams& kp, bool f16, bool softcap, Elementwise feature, int batch,
                              cudaStream_t stream) {
  if (softcap) {
    return Status::Internal("hopper flash attention backward: no dropout kernel with a bias or mask and a soft cap");
  }
  constexpr Elementwise kDropoutWith = kWith | Elementwise::kDropout;
  switch (feature) {
    case Elementwise::kMask:
      return LaunchDType<kHeadDim, false, kDropoutWith | Elementwise::kMask>(kp, f16, batch, stream);
    case Elementwise::kBias:
      return LaunchDType<kHeadDim, false, kDropoutWith | Elementwise::kBias>(kp, f16, batch, stream);
    case Elementwise::kBiasWithGrad:
      return LaunchDType<kHeadDim, false, kDropoutWith | Elementwise::kBiasWithGrad>(kp, f16, batch, stream);
    default: break;
  }
  if constexpr (kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128) {
    if (feature == Elementwise::kBiasF32) {
      return LaunchDType<kHeadDim, false, kDropoutWith | Elementwise::kBiasF32>(kp, f16, batch, stream);
    }
    if (feature == Elementwise::kBiasF32WithGrad) {
      return LaunchDType<kHeadDim, false, kDropoutWith | Elementwise::kBiasF32WithGrad>(kp, f16, batch, stream);
    }
  }
  return Status::Internal("hopper flash attention backward: no dropout kernel for this bias at head_dim " +
                          std::to_string(kHeadDim));
}

// Instantiated per head dim in cuda_hopper_backward_dense_dropout_hdim*.cu.
template <int kHeadDim>
Status LaunchDenseDropout(const KernelParams& kp, bool f16, bool softcap, Elementwise feature, int batch,
                          cudaStream_t stream) {
  return LaunchDenseDropoutWith<kHeadDim, Elementwise::kNone>(kp, f16, softcap, feature, batch, stream);
}

// Instantiated per head dim in cuda_hopper_backward_segments_dense_dropout_hdim*.cu.
template <int kHeadDim>
Status LaunchSegmentsDenseDropout(const KernelParams& kp, bool f16, bool softcap, Elementwise feature, int batch,
                                  cudaStream_t stream) {
  return LaunchDenseDropoutWith<kHeadDim, Elementwise::kSegmentIds>(kp, f16, softcap, feature, batch, stream);
}

// `feature` (a bias, its gradient or not, or a mask) with kWith (segment ids, or nothing).
template <int kHeadDim, Elementwise kWith>
Status LaunchDenseWith(const KernelParams& kp, bool f16, bool softcap, Elementwise feature, int batch,
                       cudaStream_t stream) {
  if (feature == Elementwise::kMask) {
    return LaunchVariant<kHeadDim, kWith | Elementwise::kMask>(kp, f16, softcap, batch, stream);
  }
  if (feature == Elementwise::kBias) {
    return LaunchVariant<kHeadDim, kWith | Elementwise::kBias>(kp, f16, softcap, batch, stream);
  }
  if (feature == Elementwise::kBiasWithGrad) {
    return LaunchVariant<kHeadDim, kWith | Elementwise::kBiasWithGrad>(kp, f16, softcap, batch, stream);
  }
  return Status::Internal("hopper flash attention backward: not a bias or mask feature");
}

template <int kHeadDim>
Status LaunchDense(const KernelParams& kp, bool f16, bool softcap, Elementwise feature, int batch, cudaStream_t stream) {
  return LaunchDenseWith<kHeadDim, Elementwise::kNone>(kp, f16, softcap, feature, batch, stream);
}

template <int kHeadDim>
Status LaunchBiasF32(const KernelParams& kp, bool f16, bool softcap, Elementwise feature, int batch,
                     cudaStream_t stream) {
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128,
                "a float32 bias tile fits the split-keys layout of d64 to d128");
  const bool grad = feature == Elementwise::kBiasF32WithGrad;
  if (kp.q_segment_ids != nullptr) {
    if constexpr (kSegmentIdsBuilt) {
      return grad ? LaunchVariant<kHeadDim, Elementwise::kSegmentIdsBiasF32WithGrad>(kp, f16, softcap, batch, stream)
                  : LaunchVariant<kHeadDim, Elementwise::kSegmentIdsBiasF32>(kp, f16, softcap, batch, stream);
    } else {
      return FeatureNotBuilt("segment_ids");
    }
  }
  return grad ? LaunchVariant<kHeadDim, Elementwise::kBiasF32WithGrad>(kp, f16, softcap, batch, stream)
              : LaunchVariant<kHeadDim, Elementwise::kBiasF32>(kp, f16, softcap, batch, stream);
}

template <int kHeadDim>
Status LaunchSegmentsDense(const KernelParams& kp, bool f16, bool softcap, Elementwise feature, int batch,
                           cudaStream_t stream) {
  return LaunchDenseWith<kHeadDim, Elementwise::kSegmentIds>(kp, f16, softcap, feature, batch, stream);
}

}  // namespace ejk::flash_attention::hopper_backward
