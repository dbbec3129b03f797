// Flash attention forward for Hopper (sm_90a): TMA loads, wgmma, warp specialisation.
//
// One thread block computes kBlockM = 64 * kWarpgroups query rows of one (batch, head):
//   warpgroup 0  producer: one thread issues the bulk tensor copies (TMA) of Q (once) and of
//                K and V tiles into a kStages-deep shared-memory ring, each stage guarded by
//                a "full" mbarrier (transaction bytes) and an "empty" one (consumer warps);
//   warpgroups 1..kWarpgroups  consumers: each owns 64 query rows, runs S = Q K^T and
//                O += P V on the tensor cores (wgmma, P from registers) and the online softmax.
// Overlap: inside a consumer, S for the next key tile and P V for the current one are in
// flight while the softmax runs; across consumers, named barriers make the warpgroups take
// turns issuing their products so that one's softmax hides behind another's wgmma.
// Registers move from the producer to the consumers with setmaxnreg. Where shared memory holds
// two Q slots, the next tile's Q loads during the current one and O leaves through the
// finished tile's slot as a bulk tensor store.
//
// Key tiles are visited from the last to the first, so the tiles that need masking (the
// sequence end, the causal diagonal) come first; tiles that the causal/window masks hide
// entirely are never loaded, and only tiles on a mask boundary are masked element-wise.
// Rows and keys past the sequence come from TMA's zero fill (or, with packed sequences, from
// the neighbours, masked); stores skip them. Unmasked calls, bands (sliding windows much
// narrower than the keys) and short causal calls (query tiles in pairs of equal length) run
// on a persistent grid, other causal calls, packed ones included, on one block per tile.
//
// Features: bf16/f16, head dims 64/96/128/192/256, causal and sliding window (bottom-right aligned),
// GQA/MQA, soft cap, sinks, packed sequences (cu_seqlens), segment ids, lse output.
// Segment ids mask every key tile element-wise; given scratch, two small kernels first find,
// per query tile, the first and last key tile whose ids meet its rows', and the tile visits
// those and the ones between only (NarrowToSegments). A dense bias or attention mask (one of
// them, or both folded into a bias) comes as a [kBlockM x kBlockN] tile per key tile, loaded
// by TMA with the tile's V and read by the softmax from shared memory.
//
// Shared memory tiles are [rows][64] blocks of 128-byte rows in the 128-byte swizzle, one
// block per 64 columns of the head dimension, as TMA writes them and wgmma reads them: Q and
// K are K-major operands, V is the MN-major B operand of P V. At head dim 96 the second block
// holds columns 64-95 and TMA's zeros: S = Q K^T reads 96 columns, P V writes 96 (m64n96), and
// the stores stop at the head dim. A call at a head dim below the kernel's (a multiple of 8:
// 80 on d96's kernel) reads and stores the same way, up to its own.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "flash_attention/cuda.h"
#include "flash_attention/cuda_build_scope.h"
#include "flash_attention/params.h"
#include "flash_attention/semantics.h"
#include "runtime/fast_divisor.h"
#include "runtime/status.h"
#include "runtime/tensor.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define EJK_HOPPER_DEVICE_CODE 1
#else
#define EJK_HOPPER_DEVICE_CODE 0
#endif

namespace ejk::flash_attention::hopper {

// A tile shape of cuda_tiles.h (kTileD64, ...) as the compile-time constants the kernel and
// its launch take.
template <const ForwardTile& kTile>
struct TileConstants {
  static constexpr int kWarpgroups = kTile.warpgroups, kBlockN = kTile.block_n, kStages = kTile.stages,
                       kMaxPairedMBlocks = kTile.max_paired_m_blocks;
};

// The per-element features a kernel reads with each tile (a template parameter), as flags:
// segment ids (the keys' ids), a dense bias or attention mask ([kBlockM x kBlockN] tile), or
// segment ids with one of those; kBiasF32: a float32 bias with bf16/f16 inputs; kBiasWithGrad,
// backward kernels only: a bias whose gradient the kernel also writes; kDropout: dropout (no
// per-key-tile data: each element hashes its indices, semantics.h), alone, with segment ids,
// or with a bias or a mask.
// Every combination a kernel is built for has a name: nvcc's host stubs spell a kernel's enum
// template arguments by their enumerators.
enum class Elementwise : unsigned {
  kNone = 0,
  kSegmentIds = 1,
  kBias = 2,
  kMask = 4,
  kBiasWithGrad = 8 | kBias,
  kBiasF32 = 16 | kBias,
  kBiasF32WithGrad = kBiasWithGrad | kBiasF32,
  kSegmentIdsBias = kSegmentIds | kBias,
  kSegmentIdsMask = kSegmentIds | kMask,
  kSegmentIdsBiasWithGrad = kSegmentIds | kBiasWithGrad,
  kSegmentIdsBiasF32 = kSegmentIds | kBiasF32,
  kSegmentIdsBiasF32WithGrad = kSegmentIds | kBiasF32WithGrad,
  kDropout = 32,
  kSegmentIdsDropout = kSegmentIds | kDropout,
  kBiasDropout = kBias | kDropout,
  kBiasWithGradDropout = kBiasWithGrad | kDropout,
  kBiasF32Dropout = kBiasF32 | kDropout,
  kBiasF32WithGradDropout = kBiasF32WithGrad | kDropout,
  kMaskDropout = kMask | kDropout,
  kSegmentIdsBiasDropout = kSegmentIds | kBiasDropout,
  kSegmentIdsBiasWithGradDropout = kSegmentIds | kBiasWithGradDropout,
  kSegmentIdsBiasF32Dropout = kSegmentIds | kBiasF32Dropout,
  kSegmentIdsBiasF32WithGradDropout = kSegmentIds | kBiasF32WithGradDropout,
  kSegmentIdsMaskDropout = kSegmentIds | kMaskDropout,
};
constexpr Elementwise operator|(Elementwise a, Elementwise b) {
  return static_cast<Elementwise>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}
// Whether `features` include all of `part`'s flags.
constexpr bool Has(Elementwise features, Elementwise part) {
  return (static_cast<unsigned>(features) & static_cast<unsigned>(part)) == static_cast<unsigned>(part);
}
constexpr bool HasDense(Elementwise features) {
  return Has(features, Elementwise::kBias) || Has(features, Elementwise::kMask);
}

// A bias (bf16/f16, or f32) or mask (bytes) tile of kRows x kKeys in shared memory (none for
// other features): [kRows][128 bytes] blocks of kBlockKeys keys in the 128-byte swizzle, as TMA
// writes them from DenseOperand::map. The forward's are per key tile, the backward's per
// query tile. A mask tile of 64 keys takes a whole 128-key block and reads its first half.
template <Elementwise kFeature, int kRows, int kKeys>
struct DenseTile {
  static constexpr bool kBias = Has(kFeature, Elementwise::kBias);
  static constexpr bool kBiasF32 = Has(kFeature, Elementwise::kBiasF32);
  static constexpr bool kPresent = HasDense(kFeature);
  static constexpr int kBlockKeys = kBiasF32 ? 32 : kBias ? 64 : 128;
  static constexpr int kBlockBytes = kRows * 128;
  static constexpr int kBlocks = kPresent ? (kKeys + kBlockKeys - 1) / kBlockKeys : 0;
  static constexpr int kBytes = kBlocks * kBlockBytes;
  static_assert(!kPresent || kKeys % kBlockKeys == 0 || (!kBias && kKeys == 64), "a dense tile is whole blocks");
};

// What the kernels read of a bias or mask [Bb, Hb, Sq, Sk] (PrepareDenseOperand).
struct DenseOperand {
  CUtensorMap map;               // (Sk, Sq, Hb, Bb), boxes of 128 bytes x the tile's rows
  int per_batch, per_head;       // Bb > 1, Hb > 1 (a dimension of 1 broadcasts: coordinate 0)
  float bias_to_score;           // 1 / softmax scale (a bias in raw q.k units), or 1 / soft cap
};

// What the kDropout kernels read (PrepareDropoutOperand): the seed (a device scalar, null
// without dropout), the origin words of a call that is part of a larger one (DropoutBatchHead,
// else null), DropoutThreshold << 16, 1 / (1 - p), and the batch index the hash gives the
// launch's first row (nonzero where a call runs one batch row at a time).
struct DropoutOperand {
  const uint32_t* seed;
  const uint32_t* origin;
  uint32_t shifted_threshold;
  float scale;
  uint32_t first_batch;
};

template <int kHeadDim, int kWarpgroups, int kBlockN_, int kStages_, Elementwise kFeature = Elementwise::kNone>
struct SmemLayout {
  static constexpr int kBlockM = 64 * kWarpgroups;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 * (1 + kWarpgroups);
  // Registers: the producer warpgroup gives up all but 24 per thread, the consumers share what
  // it frees. setmaxnreg moves registers within the block's launch allocation, kThreads times
  // the per-thread count (a multiple of 8), not the multiprocessor's 65536: at two consumer
  // warpgroups that is 168 x 384, so a producer at 32 leaves the consumers 232, and asking
  // for 240 there hung the kernel (H200).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static constexpr int kConsumerShare =
      (kLaunchRegisters * kThreads - 128 * kProducerRegisters) / (128 * kWarpgroups) / 8 * 8;
  static constexpr int kConsumerRegisters = kConsumerShare > 240 ? 240 : kConsumerShare;
  // 64-column blocks of Q, K, V and O; the last one partly filled where 64 does not divide the
  // head dim (96).
  static constexpr int kColBlocks = (kHeadDim + 63) / 64;
  static constexpr int kQBlockBytes = kBlockM * 128;  // one 64-column block of Q
  static constexpr int kQTileBytes = kColBlocks * kQBlockBytes;
  static constexpr int kKvBlockBytes = kBlockN * 128;
  static constexpr int kKvTileBytes = kColBlocks * kKvBlockBytes;
  static constexpr int kKvBytes = 2 * kStages * kKvTileBytes;
  static constexpr int kBarrierBytes = 8 * (4 + 4 * kStages);
  // Segment ids: the kv segment ids of each stage's key tile, then per stage the smallest and
  // largest of them over the tile's keys in the sequence.
  static constexpr int kSegmentBytes = Has(kFeature, Elementwise::kSegmentIds) ? kStages * (kBlockN * 4 + 8) : 0;
  // A bias or mask tile per stage.
  using Dense = DenseTile<kFeature, kBlockM, kBlockN>;
  static constexpr bool kDense = Dense::kPresent;
  static constexpr int kDenseTileBytes = Dense::kBytes;
  static constexpr int kDenseBytes = kStages * kDenseTileBytes;
  // Two Q slots where shared memory allows: the next tile's Q loads during the current tile,
  // and a finished tile's slot stages its O for a bulk tensor store.
  static constexpr int kQStages =
      2 * kQTileBytes + kKvBytes + kDenseBytes + kBarrierBytes + kSegmentBytes + 1024 <= 232448 ? 2 : 1;
  // Causal tiles of short sequences on a persistent grid in pairs (ScheduledTile), where the
  // next tile's Q can load early (two Q slots). d256 (one Q slot) measured 3% slower paired at
  // 32 x 512 on H100; with three consumer warpgroups (d64) the pairing code alone slowed the
  // kernel, and three warpgroups in pairs were slower than two.
  static constexpr bool kPairedSchedule = kWarpgroups == 2 && kQStages == 2;
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQStages * kQTileBytes;
  static constexpr int kVOffset = kKOffset + kStages * kKvTileBytes;
  // With one Q slot, O goes through a 16-row x 128-byte tile per consumer warp where that
  // fits (176-key tiles at d128). With two, dense O leaves through the Q slot, and the code
  // for this path, unused there but for packed sequences, measured ~1% slower (code size).
  static constexpr int kWarpStoreBytes = 16 * 128;
  static constexpr int kDenseOffset = kVOffset + kStages * kKvTileBytes;
  static constexpr bool kWarpStaging = kQStages == 1 && kDenseOffset + kDenseBytes + 4 * kWarpgroups * kWarpStoreBytes +
                                                            kBarrierBytes + kSegmentBytes + 1024 <=
                                                        232448;
  static constexpr int kWarpStoreOffset = kDenseOffset + kDenseBytes;
  static constexpr int kBarrierOffset = kWarpStoreOffset + (kWarpStaging ? 4 * kWarpgroups * kWarpStoreBytes : 0);
  // q_full, q_empty per Q slot (two, used or not), then k_full, k_empty, v_full, v_empty per stage.
  static constexpr int kSegmentOffset = kBarrierOffset + kBarrierBytes;
  static constexpr int kSegmentRangeOffset = kSegmentOffset + kStages * kBlockN * 4;
  static constexpr int kBytes = kSegmentOffset + kSegmentBytes;
  static constexpr int kAllocBytes = kBytes + 1024;  // the swizzle wants 1024-byte alignment
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256 && kBlockM <= 256, "tile");
  static_assert(kAllocBytes <= 232448, "shared memory");
};

// Everything the kernel reads: tensor maps (by value, __grid_constant__) and scalars.
struct KernelParams {
  CUtensorMap tma_q, tma_k, tma_v;
  CUtensorMap tma_out;  // boxes of 64 rows: each consumer warpgroup stores its own rows
  DenseOperand dense;  // a bias or mask, boxes of kBlockM rows (dense kernels only)
  void* out;
  float* lse;
  const void* sinks;  // [Hq], any float dtype, or null
  int sink_dtype;
  int batch, seqlen_q, seqlen_k, num_q_heads, head_ratio;
  // Dense: m blocks per (batch, head). Packed sequences: an upper bound of the blocks of all
  // sequences (block i of the bound maps to a sequence and a block of it, or to nothing).
  int num_m_blocks;
  // Tiles come in sections of `section` (batch, head) pairs, m-block-major inside a section
  // (SectionedTile); 1 is plain head-major order.
  int section;
  // Persistent causal grid: each block takes pairs of m blocks of equal total length
  // (ScheduledTile); needs section 1.
  int paired;
  // The tile decode's divisors: num_m_blocks, num_q_heads, head_ratio, the pairs of m blocks
  // per head, section and section * num_m_blocks. A runtime division took ~200 cycles per tile
  // and thread on H100, on the path from one tile's last product to the next one's first.
  FastDivisor div_m_blocks, div_q_heads, div_head_ratio, div_m_block_pairs, div_section, div_section_tiles;
  const int* cu_seqlens_q;  // packed sequences (device memory), or null
  const int* cu_seqlens_k;
  int num_sequences;
  const int* q_segment_ids;   // [B, Sq] and [B, Sk] (kSegments kernels; never with packed sequences)
  const int* kv_segment_ids;
  // Segment ids, or null: [B, num_m_blocks] first and last key tile whose ids meet the query
  // tile's, (-1, -1) for none (PrepareSegmentBounds); the key tiles outside are hidden from all
  // of its rows.
  const int2* key_tile_bounds;
  int64_t out_row_stride, out_batch_stride;  // elements
  // The call's head dim: at most kHeadDim, whose columns past it TMA reads as zeros; the
  // tensor-map store clips them, the others stop at it.
  int head_dim;
  float softcap_pre;   // scale / cap (soft cap only)
  float logit_scale;   // maps the (capped) score to the log2 domain
  // Key j is visible to query i iff i + offset - left <= j < i + offset + right + 1 (and j < Sk),
  // offset = Sk - Sq of the sequence; left/right are clamped so that the sums stay in int32.
  int left, right;
  // Dense kernels: (batch, head) pairs numbered batch-minor (head * batch + b), so that tiles
  // dispatched together read the same tiles of a bias or mask broadcast over the batch
  // (TileHead); div_batch divides by the batch.
  int batch_inner;
  FastDivisor div_batch;
  DropoutOperand dropout;  // kDropout kernels only
};

// Host launcher, instantiated per head dim in cuda_hopper_forward_hdim*.cu.
template <int kHeadDim>
Status Launch(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);

// Segment ids, both directions: the first and last of `count` tiles whose id range (smallest,
// largest) meets `range`, or (-1, -1) if none does; one ballot per 32 tiles by the calling
// warp (every lane gets the answer). Tiles between the two may meet it or not (ids in any
// order), so callers mask them element-wise.
__device__ __forceinline__ int2 MeetingTiles(const int2* tiles, int count, int2 range, int lane) {
  int first = -1, last = -1;
  for (int base = 0; base < count; base += 32) {
    bool meets = false;
    if (base + lane < count) {
      const int2 tile = __ldg(tiles + base + lane);
      meets = tile.x <= range.y && tile.y >= range.x;
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, meets);
    if (ballot != 0) {
      if (first < 0) first = base + __ffs(ballot) - 1;
      last = base + 31 - __clz(ballot);
    }
  }
  return make_int2(first, last);
}

// Segment ids [batch, length] -> ranges[batch, ceil(length / block)]: each tile's smallest and
// largest id; with `padded` non-null, also the ids padded to [batch, that many tiles * block]
// (padding 0). On the stream, no synchronisation.
Status LaunchTileSegments(const int* ids, int2* ranges, int* padded, int64_t batch, int64_t length, int block,
                          cudaStream_t stream);

#if EJK_HOPPER_DEVICE_CODE
namespace device {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void MbarExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void TmaLoad4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                          int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// The Dense tile of a bias or mask whose first key and row are `key` and `row`, of (head,
// batch) where those dimensions do not broadcast, into shared memory at dst, completing on
// bar. Rows and keys past the tensor are zero-filled (masked or never stored).
template <class Dense>
__device__ __forceinline__ void LoadDenseTile(uint32_t dst, const DenseOperand& dense, uint32_t bar, int key, int row,
                                              int head, int batch) {
#pragma unroll
  for (int b = 0; b < Dense::kBlocks; ++b) {
    TmaLoad4d(dst + b * Dense::kBlockBytes, &dense.map, bar, key + b * Dense::kBlockKeys, row,
              dense.per_head ? head : 0, dense.per_batch ? batch : 0);
  }
}

// Shared -> global bulk tensor copy (rows outside the tensor are dropped), in this thread's
// bulk group; BulkWaitRead waits until its groups have read their shared memory.
__device__ __forceinline__ void TmaStore4d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
__device__ __forceinline__ void BulkCommit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void BulkWaitRead() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void BulkWaitAll() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Orders this thread's generic shared-memory accesses before its later async-proxy (TMA)
// accesses to shared memory.
__device__ __forceinline__ void FenceProxyAsyncShared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void StoreShared32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value) : "memory");
}

__device__ __forceinline__ void MbarArriveCount(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void PrefetchTmaDescriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Named barriers (0 is __syncthreads): `Sync` waits, `Arrive` only counts.
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving register accesses across wgmma issue/wait points.
template <int N>
__device__ __forceinline__ void FenceRegisters(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void FenceRegisters(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle. byte offsets: `leading` between
// 64-column blocks of an MN-major operand (unused for K-major), `stride` between 8-row groups.
__device__ __forceinline__ uint64_t MakeDescriptor(uint32_t addr, uint32_t leading, uint32_t stride) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(leading >> 4) << 16) |
         (static_cast<uint64_t>(stride >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x within 1 ulp (MUFU.RCP alone, no Newton step and slow path): normalising O, whose
// result is rounded to bf16/f16.
__device__ __forceinline__ float FastReciprocal(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float Tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <bool kF16>
__device__ __forceinline__ uint32_t Pack(float lo, float hi) {
  uint32_t r;
  if constexpr (kF16) {
    __half2 h = __floats2half2_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&h);
  }
  return r;
}

__device__ __forceinline__ float LoadScalar(const void* base, int dtype, int i) {
  switch (static_cast<DType>(dtype)) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case DType::kF16: return __half2float(static_cast<const __half*>(base)[i]);
    case DType::kF64: return static_cast<float>(static_cast<const double*>(base)[i]);
    default: return 0.0f;
  }
}

// D[64x64] (+)= A[64x16] * B[16x64], A and B in shared memory (K-major); D is the first 32
// accumulators of d (the first 64 columns of a wider tile's fragment).
template <bool kF16, int kN>
__device__ __forceinline__ void WgmmaSSLeading64(float (&d)[kN], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  static_assert(kN >= 32, "fragment");
  if constexpr (kF16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
}

// D[64x64] (+)= A[64x16] * B[16x64], A and B in shared memory (K-major): 64-key tiles.
template <bool kF16>
__device__ __forceinline__ void WgmmaSS(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  WgmmaSSLeading64<kF16>(d, desc_a, desc_b, accumulate);
}

// D[64x80] (+)= A[64x16] * B[16x80], A and B in shared memory (K-major).
template <bool kF16>
__device__ __forceinline__ void WgmmaSS(float (&d)[40], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (kF16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n80k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
}

// D[64x112] (+)= A[64x16] * B[16x112], A and B in shared memory (K-major).
template <bool kF16>
__device__ __forceinline__ void WgmmaSS(float (&d)[56], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (kF16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %58, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n112k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55}, %56, %57, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %58, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n112k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55}, %56, %57, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
}

// D[64x128] (+)= A[64x16] * B[16x128], A and B in shared memory (K-major).
template <bool kF16>
__device__ __forceinline__ void WgmmaSS(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (kF16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
}

// D[64x176] (+)= A[64x16] * B[16x176], A and B in shared memory (K-major).
template <bool kF16>
__device__ __forceinline__ void WgmmaSS(float (&d)[88], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (kF16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n176k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, %88, %89, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n176k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, %88, %89, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
}

// D[64x64] (+)= A[64x16] * B[16x64], A in registers, B in shared memory (MN-major).
template <bool kF16>
__device__ __forceinline__ void WgmmaRS(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
  if constexpr (kF16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  }
}

// D[64x96] (+)= A[64x16] * B[16x96], A in registers, B in shared memory (MN-major).
template <bool kF16>
__device__ __forceinline__ void WgmmaRS(float (&d)[48], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
  if constexpr (kF16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n96k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, {%48, %49, %50, %51}, %52, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, {%48, %49, %50, %51}, %52, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  }
}

// D[64x128] (+)= A[64x16] * B[16x128], A in registers, B in shared memory (MN-major).
template <bool kF16>
__device__ __forceinline__ void WgmmaRS(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
  if constexpr (kF16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  }
}

// D[64x192] (+)= A[64x16] * B[16x192], A in registers, B in shared memory (MN-major).
template <bool kF16>
__device__ __forceinline__ void WgmmaRS(float (&d)[96], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
  if constexpr (kF16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  }
}

// D[64x256] (+)= A[64x16] * B[16x256], A in registers, B in shared memory (MN-major).
template <bool kF16>
__device__ __forceinline__ void WgmmaRS(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
  if constexpr (kF16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  }
}

// One tile of work: kBlockM query rows of one sequence and head, and its key tiles.
struct Tile {
  int q_begin, q_len, k_begin, k_len;  // the sequence's rows and keys in the (packed) arrays
  int m0;                              // first local row of the block
  int n_end, n_count;                  // key tiles [n_end - n_count, n_end)
  bool padding;                        // rows past the last packed sequence: no sink
};

__device__ __forceinline__ int Clamp(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Tile `tile` in sections of p.section (batch, head) pairs, in order -> its pair and its row
// of the section, the rows in order, each for every pair of the section. Rows run longest
// first (dense: m blocks from the last; packed: each sequence's blocks from its last), so
// blocks dispatched in tile order end with the shortest tiles of the last section (a causal
// grid finishes evenly), while concurrent blocks read the K and V of a few heads only, which
// stay in L2.
__device__ __forceinline__ void SectionedTile(const KernelParams& p, int tile, int* bh, int* row) {
  const int section_index = p.div_section_tiles.Div(tile);
  const int first = section_index * p.section;
  const int pairs = min(p.section, p.num_q_heads * p.batch - first);
  const int within = tile - section_index * p.div_section_tiles.divisor;
  // Only the last section may hold fewer pairs.
  *row = pairs == p.section ? p.div_section.Div(within) : within / pairs;
  *bh = first + within - *row * pairs;
}

// Dense tile `tile` -> its (batch, head) pair and m block, m blocks from the last.
__device__ __forceinline__ void DenseTile(const KernelParams& p, int tile, int* bh, int* m_block) {
  int row;
  if (p.section == 1) {  // every persistent grid
    *bh = p.div_m_blocks.Div(tile);
    row = tile - *bh * p.num_m_blocks;
  } else {
    SectionedTile(p, tile, bh, &row);
  }
  *m_block = p.num_m_blocks - 1 - row;
}

// Dense tiles: DenseTile's order. Packed sequences: the whole warp scans cu_seqlens (clamped)
// for the sequence holding block g of the packed order, each sequence's blocks from its last
// to its first; the rows past the last sequence form one more, key-less sequence.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ Tile DecodeTile(const KernelParams& p, int tile, int lane) {
  Tile t;
  t.padding = false;
  int m_block = -1;
  if (p.cu_seqlens_q == nullptr) {
    int bh;
    DenseTile(p, tile, &bh, &m_block);
    t.q_begin = 0;
    t.q_len = p.seqlen_q;
    t.k_begin = 0;
    t.k_len = p.seqlen_k;
  } else {
    t.q_begin = t.q_len = t.k_begin = t.k_len = 0;
    const int g = p.div_m_blocks.Mod(tile);
    int before = 0;  // blocks of the sequences already scanned
    for (int base = 0; base <= p.num_sequences; base += 32) {
      const int i = base + lane;
      int qb = 0, qe = 0, kb = 0, ke = 0;
      if (i <= p.num_sequences) {
        qb = Clamp(p.cu_seqlens_q[i], 0, p.seqlen_q);
        qe = i < p.num_sequences ? Clamp(p.cu_seqlens_q[i + 1], qb, p.seqlen_q) : p.seqlen_q;
        if (i < p.num_sequences) {
          kb = Clamp(p.cu_seqlens_k[i], 0, p.seqlen_k);
          ke = Clamp(p.cu_seqlens_k[i + 1], kb, p.seqlen_k);
        }
      }
      const int blocks = (qe - qb + kBlockM - 1) / kBlockM;
      int inclusive = blocks;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += v;
      }
      const unsigned hit = __ballot_sync(0xffffffffu, before + inclusive > g);
      if (hit != 0) {
        const int src = __ffs(hit) - 1;
        t.q_begin = __shfl_sync(0xffffffffu, qb, src);
        t.q_len = __shfl_sync(0xffffffffu, qe - qb, src);
        t.k_begin = __shfl_sync(0xffffffffu, kb, src);
        t.k_len = __shfl_sync(0xffffffffu, ke - kb, src);
        const int first = before + __shfl_sync(0xffffffffu, inclusive - blocks, src);
        m_block = __shfl_sync(0xffffffffu, blocks, src) - 1 - (g - first);
        t.padding = base + src == p.num_sequences;
        break;
      }
      before += __shfl_sync(0xffffffffu, inclusive, 31);
    }
  }
  if (m_block < 0) {  // past the packed blocks: nothing to do
    t.q_len = 0;
    m_block = 0;
  }
  t.m0 = m_block * kBlockM;
  const int m_last = min(t.m0 + kBlockM, t.q_len) - 1;
  const int offset = t.k_len - t.q_len;
  // Keys visible to some row of the block: [lo, hi).
  const int key_lo = max(0, t.m0 + offset - p.left);
  const int key_hi = min(t.k_len, m_last + offset + p.right + 1);
  const int n_begin = key_lo / kBlockN;
  t.n_end = key_hi > key_lo ? (key_hi + kBlockN - 1) / kBlockN : n_begin;
  t.n_count = t.n_end - n_begin;
  return t;
}

// The tile a block takes in its `round`-th turn; -1: no more tiles, kSkipRound: none this turn.
// A persistent grid walks the tiles back and forth (block b takes tile b, then
// 2 * grid - 1 - b, ...), which evens out small differences in length. Causal tiles, whose
// lengths fall linearly within a head, come in pairs instead: m blocks M - 1 - j and j of one
// head hold M + 1 key tiles together, and a block takes one pair per two turns (the middle
// block of an odd M alone), in head-major order. Every block then gets the same work, and
// concurrent blocks read the K and V of a few heads, which stay in L2.
// Only kernels with kPairs compile the pairing (SmemLayout::kPairedSchedule).
constexpr int kSkipRound = -2;
template <bool kPairs, bool kPackedSections>
__device__ __forceinline__ int ScheduledTile(const KernelParams& p, int round, int num_tiles) {
  if (kPairs && p.paired) {
    const int m = p.num_m_blocks;
    const int pair = blockIdx.x + (round >> 1) * gridDim.x;
    const int bh = p.div_m_block_pairs.Div(pair), j = pair - bh * p.div_m_block_pairs.divisor;
    if (bh >= p.num_q_heads * p.batch) return -1;
    // Head-major DenseTile order: tile bh * m + x is m block m - 1 - x.
    if ((round & 1) == 0) return bh * m + j;
    return j == m - 1 - j ? kSkipRound : bh * m + m - 1 - j;
  }
  const int k = round * gridDim.x + ((round & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
  if (k >= num_tiles) return -1;
  if (!kPackedSections || p.cu_seqlens_q == nullptr || p.section == 1) return k;
  // Packed sequences, one block per tile, in sections: the decode's head-major number of the
  // section's row-th block of the packed order.
  int bh, row;
  SectionedTile(p, k, &bh, &row);
  return bh * p.num_m_blocks + row;
}

// Segment ids: narrows a tile's key tiles to those between the first and the last whose ids
// meet its rows' (packed documents in order: the tiles of the rows' documents); bounds of
// (-1, -1) leave none.
__device__ __forceinline__ void NarrowToSegments(const KernelParams& p, int batch, int m_block, Tile& t) {
  if (p.key_tile_bounds == nullptr) return;
  const int2 bounds = __ldg(p.key_tile_bounds + static_cast<int64_t>(batch) * p.num_m_blocks + m_block);
  const int begin = max(t.n_end - t.n_count, bounds.x);
  const int end = min(t.n_end, bounds.y + 1);
  t.n_count = max(end - begin, 0);
  t.n_end = max(end, begin);
}

// The (head, batch) of a tile (recomputed where needed: kept in registers through the tile,
// they would make ptxas serialise the 176-key kernel's wgmma). kDense: the kernel reads a bias
// or mask, and its pairs may be numbered batch-minor (KernelParams::batch_inner).
template <bool kDense>
__device__ __forceinline__ void TileHead(const KernelParams& p, int tile, int* head, int* batch) {
  if (p.cu_seqlens_q == nullptr) {
    int bh, m_block;
    DenseTile(p, tile, &bh, &m_block);
    if (kDense && p.batch_inner) {
      *head = p.div_batch.Div(bh);
      *batch = bh - *head * p.batch;
    } else {
      *batch = p.div_q_heads.Div(bh);
      *head = bh - *batch * p.num_q_heads;
    }
  } else {
    *head = p.div_m_blocks.Div(tile);
    *batch = 0;
  }
}

}  // namespace device
#endif  // EJK_HOPPER_DEVICE_CODE

// kFeature: segment ids (never with packed sequences), a bias or a mask, or segment ids with
// one of those, applied element-wise in every key tile; or dropout.
template <int kHeadDim, int kWarpgroups, int kBlockN, int kStages, bool kF16, bool kSoftcap, Elementwise kFeature>
__global__ void __launch_bounds__(128 * (1 + kWarpgroups), 1) ForwardKernel(const __grid_constant__ KernelParams p) {
#if EJK_HOPPER_DEVICE_CODE
  using namespace device;
  using L = SmemLayout<kHeadDim, kWarpgroups, kBlockN, kStages, kFeature>;
  constexpr bool kSegments = Has(kFeature, Elementwise::kSegmentIds);
  constexpr bool kDense = L::kDense;
  constexpr bool kDropout = Has(kFeature, Elementwise::kDropout);
  // Features whose per-key-tile data the V barrier guards: the softmax waits for it.
  constexpr bool kStagedKeys = kSegments || kDense;
  constexpr int kBlockM = L::kBlockM;
  constexpr int kColBlocks = L::kColBlocks;
  constexpr bool kPairedSchedule = L::kPairedSchedule;
  // Causal packed calls run one block per tile in sections of heads (ScheduledTile); the wider
  // key tiles serve unmasked calls only, which stay on a persistent grid.
  constexpr bool kPackedSections = kBlockN <= 128;
  // Online softmax: a row's running max (log2 domain) is raised only when a key tile's max
  // exceeds it by more than kMaxSlack, and a warp whose rows all kept theirs skips rescaling
  // O. At d256 that rescale is 128 multiplies per thread per key tile against 40 scores, and
  // skipping it took 4-9% off the forward (H100, 4 x 4096); at d64 and d128 it measured
  // within noise or slower (the vote and the branch cost what the multiplies did), so 0 there.
  constexpr float kMaxSlack = kHeadDim >= 256 ? 8.0f : 0.0f;
  // Partial last key tiles (see issue_qk); not with three consumer warpgroups (d64), a soft
  // cap or a per-element feature, whose registers cannot hold the extra wgmma code paths:
  // ptxas would serialise every wgmma of the kernel.
  constexpr int kPartialN = 64;
  constexpr bool kPartialTiles =
      kPartialN < kBlockN && kWarpgroups == 2 && !kSoftcap && kFeature == Elementwise::kNone;
  // A band's other half-masked key tile, the last one visited, narrowed to its last kPartialN
  // keys for the warpgroups whose rows see no others: the d96/d128 masked kernels only, which
  // serve the bands.
  constexpr bool kTrailingTiles = kPartialTiles && (kHeadDim == 96 || kHeadDim == 128) && kBlockN == 128;
  // The key columns of a tile a product covers: all, the first kPartialN or the last ones.
  enum : int { kAllKeys, kLeadingKeys, kTrailingKeys };

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t smem = (SmemAddr(smem_raw) + 1023u) & ~1023u;
  constexpr int kQStages = L::kQStages;
  const auto q_smem = [&](int slot) { return smem + L::kQOffset + slot * L::kQTileBytes; };
  const uint32_t k_smem = smem + L::kKOffset;
  const uint32_t v_smem = smem + L::kVOffset;
  const uint32_t barriers = smem + L::kBarrierOffset;
  const auto q_full = [&](int slot) { return barriers + 8 * slot; };
  const auto q_empty = [&](int slot) { return barriers + 8 * (2 + slot); };
  const auto k_full = [&](int s) { return barriers + 8 * (4 + s); };
  const auto k_empty = [&](int s) { return barriers + 8 * (4 + kStages + s); };
  const auto v_full = [&](int s) { return barriers + 8 * (4 + 2 * kStages + s); };
  const auto v_empty = [&](int s) { return barriers + 8 * (4 + 3 * kStages + s); };

  if (threadIdx.x == 0) {
#pragma unroll
    for (int slot = 0; slot < kQStages; ++slot) {
      MbarInit(q_full(slot), 1);
      MbarInit(q_empty(slot), 4 * kWarpgroups);  // one arrival per consumer warp
    }
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      // With segment ids every thread that writes or reads a stage's ids arrives on its V
      // barriers itself (the producer warp's 32 lanes, each consumer thread).
      MbarInit(k_full(s), 1);
      MbarInit(v_full(s), kSegments ? 32 : 1);
      MbarInit(k_empty(s), 4 * kWarpgroups);
      MbarInit(v_empty(s), kSegments ? 128 * kWarpgroups : 4 * kWarpgroups);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    PrefetchTmaDescriptor(&p.tma_q);
    PrefetchTmaDescriptor(&p.tma_k);
    PrefetchTmaDescriptor(&p.tma_v);
    if constexpr (kQStages == 2) PrefetchTmaDescriptor(&p.tma_out);
    if constexpr (kDense) PrefetchTmaDescriptor(&p.dense.map);
  }
  __syncthreads();

  const int num_tiles = p.num_m_blocks * p.num_q_heads * p.batch;
  const int lane = threadIdx.x % 32;
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // Producer.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(L::kProducerRegisters));
    if (threadIdx.x < 32) {  // one warp decodes tiles, its first lane issues the copies
      // With segment ids the whole warp copies each key tile's ids into shared memory, guarded
      // by the tile's V barrier: V is held until the tile's P V has completed, long after its
      // softmax has read the ids.
      const bool issuer = kSegments ? lane == 0 : true;
      int kv_iter = 0, q_iter = 0;
      for (int round = 0;; ++round) {
        const int tile = ScheduledTile<kPairedSchedule, kPackedSections>(p, round, num_tiles);
        if (kPairedSchedule && tile == kSkipRound) continue;
        if (tile < 0) break;
        Tile t = DecodeTile<kBlockM, kBlockN>(p, tile, lane);
        int head, batch;
        TileHead<kDense>(p, tile, &head, &batch);
        if constexpr (kSegments) NarrowToSegments(p, batch, t.m0 / kBlockM, t);
        if (t.n_count == 0 || (!kSegments && lane != 0)) {
          kv_iter += t.n_count;
          q_iter += t.n_count > 0;
          continue;
        }
        const int q_slot = q_iter % kQStages;
        if (issuer) {
          MbarWait(q_empty(q_slot), ((q_iter / kQStages) & 1) ^ 1);
          MbarExpectTx(q_full(q_slot), L::kQTileBytes);
#pragma unroll
          for (int b = 0; b < kColBlocks; ++b) {
            TmaLoad4d(q_smem(q_slot) + b * L::kQBlockBytes, &p.tma_q, q_full(q_slot), b * 64, head, t.q_begin + t.m0,
                      batch);
          }
        }
        ++q_iter;
        const int kv_head = p.div_head_ratio.Div(head);
        for (int it = 0; it < t.n_count; ++it, ++kv_iter) {
          const int n = t.n_end - 1 - it;
          const int s = kv_iter % kStages;
          const uint32_t phase = (kv_iter / kStages) & 1;
          if (issuer) {
            MbarWait(k_empty(s), phase ^ 1);
            MbarExpectTx(k_full(s), L::kKvTileBytes);
#pragma unroll
            for (int b = 0; b < kColBlocks; ++b) {
              TmaLoad4d(k_smem + s * L::kKvTileBytes + b * L::kKvBlockBytes, &p.tma_k, k_full(s), b * 64, kv_head,
                        t.k_begin + n * kBlockN, batch);
            }
          }
          MbarWait(v_empty(s), phase ^ 1);
          if constexpr (kSegments) {
            // Keys past the sequence get any id: the kernel masks them by position.
            const int* ids = p.kv_segment_ids + static_cast<int64_t>(batch) * p.seqlen_k;
            int* stage_ids = reinterpret_cast<int*>(smem_raw + (smem - SmemAddr(smem_raw)) + L::kSegmentOffset) +
                             s * kBlockN;
            int smallest = INT_MAX, largest = INT_MIN;
            for (int i = lane; i < kBlockN; i += 32) {
              const int key = n * kBlockN + i;
              const int id = key < t.k_len ? __ldg(ids + key) : 0;
              stage_ids[i] = id;
              if (key < t.k_len) {
                smallest = min(smallest, id);
                largest = max(largest, id);
              }
            }
            smallest = __reduce_min_sync(0xffffffffu, smallest);
            largest = __reduce_max_sync(0xffffffffu, largest);
            if (lane == 0) {
              int* range = reinterpret_cast<int*>(smem_raw + (smem - SmemAddr(smem_raw)) + L::kSegmentRangeOffset) + 2 * s;
              range[0] = smallest;
              range[1] = largest;
            }
            if (!issuer) {  // lane 0 arrives with the transaction bytes below
              MbarArrive(v_full(s));
              continue;
            }
          }
          MbarExpectTx(v_full(s), L::kKvTileBytes + L::kDenseTileBytes);
          if constexpr (kDense) {
            LoadDenseTile<typename L::Dense>(smem + L::kDenseOffset + s * L::kDenseTileBytes, p.dense, v_full(s),
                                             t.k_begin + n * kBlockN, t.q_begin + t.m0, head, batch);
          }
#pragma unroll
          for (int b = 0; b < kColBlocks; ++b) {
            TmaLoad4d(v_smem + s * L::kKvTileBytes + b * L::kKvBlockBytes, &p.tma_v, v_full(s), b * 64, kv_head,
                      t.k_begin + n * kBlockN, batch);
          }
        }
      }
    }
    return;
  }

  // Consumers.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(L::kConsumerRegisters));
  const int wg = warpgroup - 1;
  const int warp = (threadIdx.x / 32) % 4;
  const int t4 = lane % 4;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;
  // Issue order among consumers: 0, 1, ..., kWarpgroups - 1, 0, ...; each waits on its own
  // barrier, then lets the next one go.
  const int own_barrier = 1 + wg, next_barrier = 1 + (wg + 1) % kWarpgroups;
  const auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) MbarArrive(bar);
  };
  const auto release_v = [&](uint32_t bar) {
    if constexpr (kSegments) {
      MbarArrive(bar);  // after this thread's reads of the stage's segment ids
    } else {
      release(bar);
    }
  };

  // With two Q slots and dense rows, O leaves through the tile's Q slot: the warpgroup writes
  // its rows there and one thread issues a bulk tensor store (rows past the sequence are
  // dropped by the tensor map's bounds), instead of ~32 scattered 4-byte global stores per
  // thread that held the consumers ~2.5 us per tile (H100). The slot goes back to the
  // producer at the warpgroup's next tile, once the store has read it. Packed sequences store
  // from registers: a tensor map cannot stop at a sequence's end.
  const bool stage_out = kQStages == 2 && p.cu_seqlens_q == nullptr;
  const bool store_issuer = threadIdx.x % 128 == 0;
  const int store_barrier = 1 + kWarpgroups + wg;
  int pending_slot = -1;  // the Q slot of this warpgroup's last staged store, not yet handed back

  int kv_iter = 0, q_iter = 0;
  for (int round = 0;; ++round) {
    const int tile = ScheduledTile<kPairedSchedule, kPackedSections>(p, round, num_tiles);
    if (kPairedSchedule && tile == kSkipRound) continue;
    if (tile < 0) break;
    Tile tl = DecodeTile<kBlockM, kBlockN>(p, tile, lane);
    int q_slot = -1;  // this tile's Q slot, if it has key tiles
    // Accumulator fragment (per warp 16 rows): element 4j + 2r + c is row g + 8r, column 8j + 2t + c.
    const int row0 = tl.m0 + wg * 64 + warp * 16 + lane / 4;
    // This thread's rows' segment ids (rows past the sequence are never stored).
    int q_segment[2] = {0, 0};
    if constexpr (kSegments) {
      int head, batch;
      TileHead<kDense>(p, tile, &head, &batch);
      NarrowToSegments(p, batch, tl.m0 / kBlockM, tl);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r;
        if (row < tl.q_len) q_segment[r] = __ldg(p.q_segment_ids + static_cast<int64_t>(batch) * p.seqlen_q + row);
      }
    }

    // Dropout: this thread's rows' part of the hash (DropoutRowKey), with packed query indices.
    uint32_t dropout_row_key[2] = {0u, 0u};
    if constexpr (kDropout) {
      int head, batch;
      TileHead<kDense>(p, tile, &head, &batch);
      const uint32_t seed = __ldg(p.dropout.seed);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        dropout_row_key[r] = DropoutRowKey(
            seed, DropoutBatchHead(p.dropout.origin, p.num_q_heads, p.dropout.first_batch + batch, head),
            static_cast<uint32_t>(tl.q_begin + row0 + 8 * r));
      }
    }

    float o[kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.0f;
    // Running max (log2 domain) and this thread's share of the running sum, per row.
    float row_max[2], row_sum[2];
    {
      const bool has_sink = p.sinks != nullptr && !tl.padding;
      int head, batch;
      TileHead<kDense>(p, tile, &head, &batch);
      const float sink = has_sink ? LoadScalar(p.sinks, p.sink_dtype, head) * kLog2e : -INFINITY;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        row_max[r] = sink;
        row_sum[r] = has_sink && t4 == 0 ? 1.0f : 0.0f;
      }
    }

    if (tl.n_count > 0) {
      float s[kBlockN / 2];
      uint32_t pr[kBlockN / 4];
      q_slot = q_iter % kQStages;
      const uint32_t q_tile = q_smem(q_slot);

      // S = Q K^T of one key tile, over `part` of its keys. kLeadingKeys: the first key tile
      // visited (the last one) when this warpgroup's rows see at most its first kPartialN keys:
      // S over those columns only (the mask hides the rest of s) and P V over as many keys,
      // instead of a mostly empty full tile. That is the sequence's end (S_k = 4096 with
      // 176-key tiles leaves 48 keys in the last one; measured +0.6% at B4 S4096 H16 d128 on
      // H100) or, with 128-key tiles, the causal diagonal for the first 64 rows.
      // kTrailingKeys: a window's last key tile visited when its last kPartialN keys are all
      // that this warpgroup's rows see (in a band, the second warpgroup's). Callers pass
      // constants, so no branch reaches the wgmma sequence.
      const auto issue_qk = [&](int stage, int part) {
        constexpr int kSkippedRows = kBlockN - kPartialN;
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
          const uint64_t desc_a =
              MakeDescriptor(q_tile + (kk / 4) * L::kQBlockBytes + wg * 64 * 128 + (kk % 4) * 32, 16, 1024);
          const uint32_t k_tile = k_smem + stage * L::kKvTileBytes + (kk / 4) * L::kKvBlockBytes + (kk % 4) * 32;
          if (part == kLeadingKeys) {
            WgmmaSSLeading64<kF16>(s, desc_a, MakeDescriptor(k_tile, 16, 1024), kk > 0);
          } else if (part == kTrailingKeys) {
            // Into the first 32 accumulators (a wgmma into the upper ones made ptxas serialise
            // every wgmma of the kernel, C7511); the caller moves them to their columns.
            static_assert(kSkippedRows % 8 == 0, "the K rows skipped must be whole swizzle atoms");
            WgmmaSSLeading64<kF16>(s, desc_a, MakeDescriptor(k_tile + kSkippedRows * 128, 16, 1024), kk > 0);
          } else {
            WgmmaSS<kF16>(s, desc_a, MakeDescriptor(k_tile, 16, 1024), kk > 0);
          }
        }
      };
      const auto issue_pv = [&](int stage, int part) {
        constexpr int kFirstStep = (kBlockN - kPartialN) / 16;
#pragma unroll
        for (int kk = part == kTrailingKeys ? kFirstStep : 0; kk < (part == kLeadingKeys ? kPartialN : kBlockN) / 16;
             ++kk) {
          const uint32_t a[4] = {pr[4 * kk], pr[4 * kk + 1], pr[4 * kk + 2], pr[4 * kk + 3]};
          const uint64_t desc_b =
              MakeDescriptor(v_smem + stage * L::kKvTileBytes + kk * 16 * 128, L::kKvBlockBytes, 1024);
          WgmmaRS<kF16>(o, a, desc_b, 1);
        }
      };
      // Soft cap, mask and online softmax of the scores in s (key tile n, in stage `stage`);
      // s becomes P (unnormalised), correction gets the factor for the rows' earlier
      // accumulators.
      const auto softmax = [&](int n, int stage, float (&correction)[2]) {
        if constexpr (kSoftcap) {
#pragma unroll
          for (int i = 0; i < kBlockN / 2; ++i) s[i] = Tanh(s[i] * p.softcap_pre);
        }
        const int c0 = n * kBlockN;
        const int offset = tl.k_len - tl.q_len;
        const int m_last = min(tl.m0 + kBlockM, tl.q_len) - 1;
        const bool masked = c0 + kBlockN > tl.k_len || c0 + kBlockN - 1 > tl.m0 + offset + p.right ||
                            c0 < m_last + offset - p.left;
        // Row r's visible columns of this thread's pairs: lo <= 8 j + c < hi.
        const auto visible_columns = [&](int r, int* lo, int* hi) {
          const int row = row0 + 8 * r;
          *hi = min(tl.k_len, row + offset + p.right + 1) - c0 - 2 * t4;
          *lo = row + offset - p.left - c0 - 2 * t4;
        };
        if constexpr (kDense) {
          // The tile's bias or mask, in the shared memory of the stage that holds it (the
          // caller waited for its V barrier). Row g + 8r of the warp's 16 is local row
          // wg * 64 + warp * 16 + g + 8r, whose 16-byte chunks are swizzled by g.
          const int g = lane / 4;
          const uint32_t tile = smem + L::kDenseOffset + stage * L::kDenseTileBytes + (wg * 64 + warp * 16 + g) * 128;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) {
              if constexpr (L::Dense::kBiasF32) {
                // Keys 8j + 2t, +1: 8 bytes of 16-byte chunk 2 (j % 4) + t / 2 of block j / 4.
                float2 bias;
                asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                             : "=f"(bias.x), "=f"(bias.y)
                             : "r"(tile + r * 8 * 128 + (j / 4) * L::Dense::kBlockBytes +
                                   (((2 * (j % 4) + t4 / 2) ^ g) * 16) + 8 * (t4 % 2))
                             : "memory");
                s[4 * j + 2 * r] = fmaf(bias.x, p.dense.bias_to_score, s[4 * j + 2 * r]);
                s[4 * j + 2 * r + 1] = fmaf(bias.y, p.dense.bias_to_score, s[4 * j + 2 * r + 1]);
              } else if constexpr (L::Dense::kBias) {
                // Keys 8j + 2t, +1: 16-byte chunk j % 8 of block j / 8.
                uint32_t pair;
                asm volatile("ld.shared.b32 %0, [%1];\n"
                             : "=r"(pair)
                             : "r"(tile + r * 8 * 128 + (j / 8) * L::Dense::kBlockBytes + (((j % 8) ^ g) * 16) + 4 * t4)
                             : "memory");
                float2 bias;
                if constexpr (kF16) {
                  bias = __half22float2(*reinterpret_cast<const __half2*>(&pair));
                } else {
                  bias = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pair));
                }
                s[4 * j + 2 * r] = fmaf(bias.x, p.dense.bias_to_score, s[4 * j + 2 * r]);
                s[4 * j + 2 * r + 1] = fmaf(bias.y, p.dense.bias_to_score, s[4 * j + 2 * r + 1]);
              } else {
                // Keys 8j + 2t, +1: bytes of 16-byte chunk j / 2 (of 8 per 128-key block).
                uint16_t pair;
                asm volatile("ld.shared.u16 %0, [%1];\n"
                             : "=h"(pair)
                             : "r"(tile + r * 8 * 128 + (j / 16) * L::Dense::kBlockBytes +
                                   ((((j / 2) % 8) ^ g) * 16) + (j % 2) * 8 + 2 * t4)
                             : "memory");
                if ((pair & 0xffu) == 0) s[4 * j + 2 * r] = -INFINITY;
                if ((pair >> 8) == 0) s[4 * j + 2 * r + 1] = -INFINITY;
              }
            }
          }
        }
        // With segment ids each key's id and position are tested, but in tiles that need no
        // position test and whose keys hold one id that both of this thread's rows have (most
        // tiles inside a document, or before padding). The ids and their range are in the shared
        // memory of the stage that holds the tile (the caller waited for its V barrier).
        if constexpr (kSegments) {
          int smallest, largest;
          asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n"
                       : "=r"(smallest), "=r"(largest)
                       : "r"(smem + L::kSegmentRangeOffset + 8 * stage)
                       : "memory");
          // Decided per warp: a lane whose tile needed no test passes it unchanged.
          if (__any_sync(0xffffffffu, masked || smallest != largest || smallest != q_segment[0] ||
                                          smallest != q_segment[1])) {
            const uint32_t ids = smem + L::kSegmentOffset + stage * (kBlockN * 4) + 8 * t4;
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) {
              int id0, id1;
              asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(id0), "=r"(id1) : "r"(ids + 32 * j) : "memory");
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                int lo, hi;
                visible_columns(r, &lo, &hi);
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                  const int col = 8 * j + c;
                  if (col >= hi || col < lo || (c ? id1 : id0) != q_segment[r]) s[4 * j + 2 * r + c] = -INFINITY;
                }
              }
            }
          }
        } else if (masked) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            int lo, hi;
            visible_columns(r, &lo, &hi);
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
              for (int c = 0; c < 2; ++c) {
                const int col = 8 * j + c;
                if (col >= hi || col < lo) s[4 * j + 2 * r + c] = -INFINITY;
              }
            }
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = -INFINITY;
#pragma unroll
          for (int j = 0; j < kBlockN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float new_max = fmaxf(row_max[r], mx * p.logit_scale);
          // A max that grew by at most kMaxSlack stays: P's entries stay below 2^kMaxSlack, and
          // the row's O and sum keep their scale (false while row_max is -inf).
          const bool keep = kMaxSlack > 0.0f && new_max - row_max[r] <= kMaxSlack;
          const float used = keep ? row_max[r] : new_max;
          const float base = used == -INFINITY ? 0.0f : used;
          correction[r] = keep ? 1.0f : Exp2(row_max[r] - base);
          row_max[r] = used;
          float sum = 0.0f;
#pragma unroll
          for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const float e = Exp2(fmaf(s[4 * j + 2 * r + c], p.logit_scale, -base));
              sum += e;  // the softmax's sum is over every visible key; dropout acts on P only
              s[4 * j + 2 * r + c] = e;
            }
          }
          if constexpr (kDropout) {
            // Keys 8 apart (column blocks 2jj and 2jj + 1) share a hash (DropoutKeepPair); key
            // indices are the sequence's, so every tile starts a group of 16.
            static_assert(kBlockN % 16 == 0, "pairs of column blocks");
            const uint32_t key0 = static_cast<uint32_t>(c0 + 2 * t4);
#pragma unroll
            for (int jj = 0; jj < kBlockN / 16; ++jj) {
#pragma unroll
              for (int c = 0; c < 2; ++c) {
                bool keep, keep_plus_8;
                DropoutKeepPair(dropout_row_key[r], key0 + 16 * jj + c, p.dropout.shifted_threshold, keep,
                                keep_plus_8);
                if (!keep) s[8 * jj + 2 * r + c] = 0.0f;
                if (!keep_plus_8) s[8 * jj + 4 + 2 * r + c] = 0.0f;
              }
            }
          }
          row_sum[r] = row_sum[r] * correction[r] + sum;
        }
      };
      const auto convert = [&]() {
#pragma unroll
        for (int i = 0; i < kBlockN / 4; ++i) pr[i] = Pack<kF16>(s[2 * i], s[2 * i + 1]);
      };
      const auto rescale = [&](const float (&correction)[2]) {
        if (kMaxSlack > 0.0f && !__any_sync(0xffffffffu, correction[0] != 1.0f || correction[1] != 1.0f)) return;
#pragma unroll
        for (int j = 0; j < kHeadDim / 8; ++j) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            o[4 * j + 2 * r] *= correction[r];
            o[4 * j + 2 * r + 1] *= correction[r];
          }
        }
      };

      if (wg == kWarpgroups - 1) NamedBarrierArrive(next_barrier, 256);
      MbarWait(q_full(q_slot), (q_iter / kQStages) & 1);

      float correction[2];
      int stage = kv_iter % kStages;
      // Keys visible to this warpgroup's rows end before wg_key_hi.
      const int wg_key_hi =
          min(tl.k_len, min(tl.m0 + wg * 64 + 63, tl.q_len - 1) + tl.k_len - tl.q_len + p.right + 1);
      // Broadcast from lane 0: a branch the compiler cannot prove warp-uniform moves the
      // wgmma descriptors of the whole tile loop out of uniform registers.
      const bool first_partial =
          kPartialTiles && __shfl_sync(0xffffffffu, wg_key_hi - (tl.n_end - 1) * kBlockN <= kPartialN, 0);
      // Likewise for the last key tile visited when the rows' keys begin in its last
      // kPartialN (and it is neither the first tile nor the second, which have their own
      // variants).
      bool last_trailing = false;
      if constexpr (kTrailingTiles) {
        const int wg_key_lo = tl.m0 + wg * 64 + tl.k_len - tl.q_len - p.left;
        last_trailing = __shfl_sync(
            0xffffffffu, tl.n_count >= 3 && wg_key_lo - (tl.n_end - tl.n_count) * kBlockN >= kBlockN - kPartialN, 0);
      }
      MbarWait(k_full(stage), (kv_iter / kStages) & 1);
      NamedBarrierSync(own_barrier, 256);
      const auto first_qk = [&](int part) {
        WgmmaFence();
        issue_qk(stage, part);
        WgmmaCommit();
        NamedBarrierArrive(next_barrier, 256);
        WgmmaWait<0>();
      };
      if (first_partial) {
        first_qk(kLeadingKeys);
      } else {
        first_qk(kAllKeys);
      }
      FenceRegisters(s);
      release(k_empty(stage));
      if (pending_slot >= 0) {  // issued a tile ago: the wait rarely waits
        if (store_issuer) {
          BulkWaitRead();
          MbarArriveCount(q_empty(pending_slot), 4);  // for the warpgroup's four warps
        }
        pending_slot = -1;
      }
      if constexpr (kStagedKeys) MbarWait(v_full(stage), (kv_iter / kStages) & 1);
      softmax(tl.n_end - 1, stage, correction);
      convert();

      // One key tile: S of tile `it` and P V of tile it - 1 in flight while the softmax runs.
      // Branches choosing between wgmma sequences hold whole steps (each ends with every
      // product complete): a branch around only part of one makes ptxas serialise wgmma.
      const auto step = [&](int it, int pv_part, int qk_part) {
        const int prev = stage;
        const uint32_t prev_phase = ((kv_iter + it - 1) / kStages) & 1;
        stage = (kv_iter + it) % kStages;
        MbarWait(k_full(stage), ((kv_iter + it) / kStages) & 1);
        MbarWait(v_full(prev), prev_phase);
        NamedBarrierSync(own_barrier, 256);
        FenceRegisters(pr);
        FenceRegisters(o);
        WgmmaFence();
        issue_qk(stage, qk_part);
        WgmmaCommit();
        issue_pv(prev, pv_part);
        WgmmaCommit();
        NamedBarrierArrive(next_barrier, 256);
        WgmmaWait<1>();
        FenceRegisters(s);
        if (qk_part == kTrailingKeys) {
          // S of the last kPartialN keys to their columns; the others are masked below.
          constexpr int kFirst = (kBlockN - kPartialN) / 2;
#pragma unroll
          for (int i = kPartialN / 2 - 1; i >= 0; --i) s[kFirst + i] = s[i];
#pragma unroll
          for (int i = 0; i < kFirst; ++i) s[i] = -INFINITY;
        }
        release(k_empty(stage));
        if constexpr (kStagedKeys) MbarWait(v_full(stage), ((kv_iter + it) / kStages) & 1);
        softmax(tl.n_end - 1 - it, stage, correction);
        WgmmaWait<0>();
        FenceRegisters(o);
        FenceRegisters(pr);
        release_v(v_empty(prev));
        rescale(correction);
        convert();
      };
      if (tl.n_count > 1) {
        if (first_partial) {
          step(1, kLeadingKeys, kAllKeys);
        } else {
          step(1, kAllKeys, kAllKeys);
        }
      }
      for (int it = 2; it < tl.n_count - (last_trailing ? 1 : 0); ++it) step(it, kAllKeys, kAllKeys);
      if (last_trailing) step(tl.n_count - 1, kAllKeys, kTrailingKeys);

      // Q is no longer read: the producer may load the next tile's (unless O leaves through it).
      if (!stage_out) release(q_empty(q_slot));
      MbarWait(v_full(stage), ((kv_iter + tl.n_count - 1) / kStages) & 1);
      NamedBarrierSync(own_barrier, 256);
      FenceRegisters(pr);
      FenceRegisters(o);
      // The last consumer's final turn has no successor (the first one is done with the tile).
      const auto last_pv = [&](int part) {
        WgmmaFence();
        issue_pv(stage, part);
        WgmmaCommit();
        if (wg != kWarpgroups - 1) NamedBarrierArrive(next_barrier, 256);
        WgmmaWait<0>();
      };
      if (tl.n_count == 1 && first_partial) {
        last_pv(kLeadingKeys);
      } else if (last_trailing) {
        last_pv(kTrailingKeys);
      } else {
        last_pv(kAllKeys);
      }
      FenceRegisters(o);
      release_v(v_empty(stage));
      kv_iter += tl.n_count;
      ++q_iter;
    }

    // Epilogue: normalise, store O (rows past the sequence are skipped) and the log-sum-exp.
    int head, batch;
    TileHead<kDense>(p, tile, &head, &batch);
    const bool staged = stage_out && q_slot >= 0;
    // The two rows' sums across their quads, as two interleaved chains.
#pragma unroll
    for (int r = 0; r < 2; ++r) row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
#pragma unroll
    for (int r = 0; r < 2; ++r) row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = row_sum[r];
      // Dropout's 1 / (1 - p) for the kept probabilities comes with the normalisation.
      const float inv = sum > 0.0f ? (kDropout ? p.dropout.scale : 1.0f) * FastReciprocal(sum) : 0.0f;
      const int row = row0 + 8 * r;
      if (staged) {
        // The Q slot's layout (64-column blocks of 128-byte rows, 128-byte swizzle), as the
        // tensor map reads it; a warp's eight rows per store cover all 32 banks.
        const int local_row = row - tl.m0;
        const uint32_t base = q_smem(q_slot) + local_row * 128 + 4 * t4;
#pragma unroll
        for (int j = 0; j < kHeadDim / 8; ++j) {
          const uint32_t addr = base + (j / 8) * L::kQBlockBytes + (((j % 8) ^ (local_row % 8)) * 16);
          StoreShared32(addr, Pack<kF16>(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv));
        }
      } else if constexpr (L::kWarpStaging) {
#pragma unroll
        for (int j = 0; j < kHeadDim / 8; ++j) o[4 * j + 2 * r] *= inv, o[4 * j + 2 * r + 1] *= inv;
      } else if (row < tl.q_len) {
        uint16_t* out = static_cast<uint16_t*>(p.out) + batch * p.out_batch_stride +
                        static_cast<int64_t>(tl.q_begin + row) * p.out_row_stride +
                        static_cast<int64_t>(head) * p.head_dim + 2 * t4;
#pragma unroll
        for (int j = 0; j < kHeadDim / 8; ++j) {
          if (8 * j < p.head_dim) {
            *reinterpret_cast<uint32_t*>(out + 8 * j) =
                Pack<kF16>(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
          }
        }
      }
      // The hardware log2 (absolute error 2^-22 near 1, 2 ulp elsewhere) instead of log2f's
      // ~20-instruction polynomial: short calls 1-3% faster on H100.
      if (row < tl.q_len && t4 == 0 && p.lse != nullptr) {
        p.lse[(static_cast<int64_t>(batch) * p.num_q_heads + head) * p.seqlen_q + tl.q_begin + row] =
            sum > 0.0f ? (row_max[r] + __log2f(sum)) * kLn2 : -INFINITY;
      }
    }
    if constexpr (L::kWarpStaging) {  // one Q slot: nothing was staged
      // Each warp passes its 16 rows through its shared tile, 64 columns at a time, and
      // writes them back as 16-byte stores, each instruction four full 128-byte row
      // segments, instead of 4-byte stores touching 8 rows each.
      const uint32_t tile_smem = smem + L::kWarpStoreOffset + (wg * 4 + warp) * L::kWarpStoreBytes;
      const int warp_row = tl.m0 + wg * 64 + warp * 16;  // first of the warp's rows
      uint16_t* out = static_cast<uint16_t*>(p.out) + batch * p.out_batch_stride +
                      static_cast<int64_t>(head) * p.head_dim;
#pragma unroll
      for (int b = 0; b < kColBlocks; ++b) {
        const int chunks = min(8, (kHeadDim - 64 * b) / 8);  // 16-byte chunks of a row within kHeadDim
        const int stored = min(chunks, (p.head_dim - 64 * b) / 8);  // and within the call's head dim
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = lane / 4 + 8 * r;
#pragma unroll
          for (int j = 0; j < chunks; ++j) {
            const int jj = 8 * b + j;
            StoreShared32(tile_smem + row * 128 + ((j ^ (row % 8)) * 16) + 4 * t4,
                          Pack<kF16>(o[4 * jj + 2 * r], o[4 * jj + 2 * r + 1]));
          }
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = lane / 8 + 4 * i, chunk = lane % 8;
          uint32_t v0, v1, v2, v3;
          asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3)
                       : "r"(tile_smem + row * 128 + ((chunk ^ (row % 8)) * 16))
                       : "memory");
          if (warp_row + row < tl.q_len && chunk < stored) {
            *reinterpret_cast<uint4*>(out + static_cast<int64_t>(tl.q_begin + warp_row + row) * p.out_row_stride +
                                      b * 64 + chunk * 8) = make_uint4(v0, v1, v2, v3);
          }
        }
        __syncwarp();
      }
    }
    if (staged) {
      FenceProxyAsyncShared();
      NamedBarrierSync(store_barrier, 128);
      const int first_row = tl.m0 + wg * 64;
      if (store_issuer && first_row < tl.q_len) {
#pragma unroll
        for (int b = 0; b < kColBlocks; ++b) {
          TmaStore4d(&p.tma_out, q_smem(q_slot) + b * L::kQBlockBytes + wg * 64 * 128, b * 64, head, first_row, batch);
        }
        BulkCommit();
      }
      pending_slot = q_slot;
    }
  }
  // Shared memory must outlive the last store's reads.
  if (store_issuer) BulkWaitAll();
#elif defined(__CUDA_ARCH__)
  __trap();  // a build without sm_90a code must fail loudly, not leave the outputs unwritten
#endif  // EJK_HOPPER_DEVICE_CODE
}

// Host side (cuda_hopper_forward.cu): tensor maps and scalars for one call.
// A bf16/f16 [B, S, H, D] tensor as a 4-d TMA map (D, H, S, B) with boxes of 64 x 1 x
// box_rows x 1 in the 128-byte swizzle (the backward's loads use it too).
Status MakeTensorMap(const TensorView& t, int box_rows, const char* name, CUtensorMap* map);
// The call's bias or mask, if any, for tiles of box_rows rows (the forward's and the backward's).
Status PrepareDenseOperand(const ForwardParams& p, int box_rows, DenseOperand* dense);
// The call's dropout for both directions' kernels; an error where dropout is on without a seed.
Status PrepareDropoutOperand(const ForwardParams& p, const uint32_t* seed, int64_t first_batch,
                             DropoutOperand* dropout);
// Whether the call's bias or mask has a plane per head and broadcasts over several batch rows:
// then both directions number their (batch, head) pairs batch-minor (batch_inner), so that the
// rows reading one plane's tiles run together and share them through L2.
bool DenseSharedAcrossBatch(const DenseOperand& dense, const Dims& d);
// Also the bias or mask (PrepareDenseOperand) for tiles of block_m rows.
Status PrepareKernelParams(const CudaForwardArgs& args, int block_m, int block_n, KernelParams* kp);
// Tiles in sections of `section` (batch, head) pairs (DenseTile, and ScheduledTile for packed
// sequences), with the divisors of their decode; PrepareKernelParams sets plain head-major
// order (1).
void SetSection(int section, KernelParams* kp);
// Segment ids with scratch (args.scratch): computes kp->key_tile_bounds for tiles of block_m
// queries and block_n keys on the stream; otherwise leaves it null (no tile is skipped).
Status PrepareSegmentBounds(const CudaForwardArgs& args, int block_m, int block_n, KernelParams* kp,
                            cudaStream_t stream);
// Multiprocessors of the current device: the persistent grid's size.
StatusOr<int> CurrentDeviceSms();
// Writes the call's folded bias (PlanFold: call.folded_batch x call.folded_heads planes) to
// `out` (FoldedBiasBytes, 16-byte aligned) on the stream and returns its view in *folded:
// mask ? bias : -inf, which the kernels read exactly as the mask, in rows of
// FoldedRowElements. For a call run per batch row, `p` is one row's (ForwardParamsOfRow).
Status FoldBiasAndMask(const ForwardParams& p, const ForwardCall& call, void* out, cudaStream_t stream,
                       TensorView* folded);
// Batch row b of a [B, ...] operand; a broadcast ([1, ...]) or absent one as it is.
TensorView BatchRow(const TensorView& t, int64_t b);
// Batch row b of a call without packed sequences or dropout (a bias and mask folded per row).
ForwardParams ForwardParamsOfRow(const ForwardParams& p, int64_t b);

template <int kHeadDim, class C, bool kMasked, bool kF16, bool kSoftcap, Elementwise kFeature>
Status LaunchConfig(const CudaForwardArgs& args, cudaStream_t stream) {
  using L = SmemLayout<kHeadDim, C::kWarpgroups, C::kBlockN, C::kStages, kFeature>;
  constexpr bool kSegments = Has(kFeature, Elementwise::kSegmentIds);
  static_assert(C::kMaxPairedMBlocks == 0 || L::kPairedSchedule, "pairs need two Q slots and two consumer warpgroups");
  KernelParams kp;
  EJK_RETURN_IF_ERROR(PrepareKernelParams(args, L::kBlockM, L::kBlockN, &kp));
  if constexpr (kSegments) EJK_RETURN_IF_ERROR(PrepareSegmentBounds(args, L::kBlockM, L::kBlockN, &kp, stream));
  EJK_ASSIGN_OR_RETURN(const int num_sms, CurrentDeviceSms());
  void (*kernel)(const KernelParams) =
      ForwardKernel<kHeadDim, C::kWarpgroups, C::kBlockN, C::kStages, kF16, kSoftcap, kFeature>;
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kAllocBytes);
      err != cudaSuccess) {
    return Status::Internal(std::string("hopper flash attention: shared memory attribute: ") + cudaGetErrorString(err));
  }
  // A persistent grid's producer loads the next tile's Q, K and V while the consumers finish
  // the current one. Tiles of (nearly) equal length walk back and forth: no mask, or a band.
  // Short causal calls go in pairs of equal total length (C::kMaxPairedMBlocks).
  const ForwardCall call = ForwardCallOf(args.p, args.dims);
  const bool band = IsBand(kp.left, kp.right, kp.seqlen_k);
  // Segment ids take the masked kernels' tiles whether or not a causal or window mask is on.
  const bool mask_on = kMasked && (!kSegments || CausalOrWindow(call));
  kp.paired = mask_on && C::kMaxPairedMBlocks > 0 && kp.cu_seqlens_q == nullptr &&
              ShortCall(call, int64_t{L::kBlockM} * C::kMaxPairedMBlocks, args.dims.seqlen_k);
  const int64_t tiles = static_cast<int64_t>(kp.num_m_blocks) * kp.num_q_heads * kp.batch;
  const int64_t units =
      kp.paired ? (kp.num_m_blocks + 1) / 2 * static_cast<int64_t>(kp.num_q_heads) * kp.batch : tiles;
  const bool persistent = kp.paired || !mask_on || band;
  const unsigned grid = static_cast<unsigned>(persistent && units > num_sms ? num_sms : units);
  // Other causal calls, packed ones included: one block per tile, dispatched in tile order, in
  // sections of a few heads (K and V rows of 1024 columns in all), longest tiles first. In
  // head-major order the last tiles dispatched include whole-row ones that run long after the
  // rest (causal 4 x 4096 at d128: 486 -> 546 TFLOP/s on H100; sections of 4 heads: slower at
  // d128, faster at d256). Packed causal calls, whose sequences' lengths the host does not
  // know, took 0.84-0.95x the time of a persistent grid walked back and forth at d128 (16,
  // 64 and 4 random lengths around 2048, 512 and 8192), 0.73x for one sequence of 4096, 0.72x
  // at d256, 1.05x for 64 sequences of 512; for one sequence of 16384, 0.93-1.02x the time of
  // pairs of equal length.
  SetSection(persistent ? 1 : std::max(1, 1024 / kHeadDim), &kp);
  kernel<<<grid, L::kThreads, L::kAllocBytes, stream>>>(kp);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return Status::Internal(std::string("hopper flash attention: launch failed: ") + cudaGetErrorString(err));
  }
  return Status::Ok();
}

// Launches the tile ChooseForwardTile picks for the call. The shapes built for calls of this
// kind are ForwardTiles' (cuda_tiles.h): d64's two, d96/d128's 176-key tile for unmasked calls
// without a soft cap besides the 128-key one, kTileDense for a bias or mask (kTileDenseNarrow
// above d128, and for a float32 bias at d96/d128), and one otherwise.
template <int kHeadDim, bool kMasked, bool kF16, bool kSoftcap, Elementwise kFeature>
Status LaunchKernel(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  const ForwardTile tile = ChooseForwardTile(ForwardCallOf(args.p, args.dims), cfg);
  if constexpr (kHeadDim == 64) {
    if constexpr (HasDense(kFeature)) {
      if (tile == kTileDense) {
        return LaunchConfig<kHeadDim, TileConstants<kTileDense>, kMasked, kF16, kSoftcap, kFeature>(args, stream);
      }
    } else if constexpr (kFeature == Elementwise::kNone) {
      if (tile == kTileD64Pairs) {
        return LaunchConfig<kHeadDim, TileConstants<kTileD64Pairs>, kMasked, kF16, kSoftcap, kFeature>(args, stream);
      }
    }
    if constexpr (!HasDense(kFeature)) {
      if (tile == kTileD64) {
        return LaunchConfig<kHeadDim, TileConstants<kTileD64>, kMasked, kF16, kSoftcap, kFeature>(args, stream);
      }
    }
  } else if constexpr (kHeadDim == 96 || kHeadDim == 128) {
    if constexpr (Has(kFeature, Elementwise::kBiasF32)) {
      if (tile == kTileDenseNarrow) {
        return LaunchConfig<kHeadDim, TileConstants<kTileDenseNarrow>, kMasked, kF16, kSoftcap, kFeature>(args,
                                                                                                          stream);
      }
    } else if constexpr (HasDense(kFeature)) {
      if (tile == kTileDense) {
        return LaunchConfig<kHeadDim, TileConstants<kTileDense>, kMasked, kF16, kSoftcap, kFeature>(args, stream);
      }
    } else if constexpr (!kMasked && !kSoftcap && kFeature == Elementwise::kNone) {
      if (tile == kTileD128Wide) {
        return LaunchConfig<kHeadDim, TileConstants<kTileD128Wide>, kMasked, kF16, kSoftcap, kFeature>(args, stream);
      }
    }
    if constexpr (!HasDense(kFeature)) {
      if (tile == kTileD128) {
        return LaunchConfig<kHeadDim, TileConstants<kTileD128>, kMasked, kF16, kSoftcap, kFeature>(args, stream);
      }
    }
  } else {
    static_assert(kHeadDim == 192 || kHeadDim == 256, "head dims 64, 96, 128, 192 and 256");
    if constexpr (HasDense(kFeature)) {
      if (tile == kTileDenseNarrow) {
        return LaunchConfig<kHeadDim, TileConstants<kTileDenseNarrow>, kMasked, kF16, kSoftcap, kFeature>(args,
                                                                                                          stream);
      }
    } else if constexpr (kHeadDim == 192) {
      if (tile == kTileD192) {
        return LaunchConfig<kHeadDim, TileConstants<kTileD192>, kMasked, kF16, kSoftcap, kFeature>(args, stream);
      }
    } else {
      if (tile == kTileD256) {
        return LaunchConfig<kHeadDim, TileConstants<kTileD256>, kMasked, kF16, kSoftcap, kFeature>(args, stream);
      }
    }
  }
  return Status::Internal("hopper flash attention: no kernel built for tile " + ToString(tile) + " at head_dim " +
                          std::to_string(kHeadDim));
}

template <int kHeadDim, bool kMasked, bool kSoftcap, Elementwise kFeature>
Status LaunchDType(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  if (args.p.q.dtype != DType::kF16) {
    return LaunchKernel<kHeadDim, kMasked, false, kSoftcap, kFeature>(args, cfg, stream);
  }
  if constexpr (kFloat16Built) {
    return LaunchKernel<kHeadDim, kMasked, true, kSoftcap, kFeature>(args, cfg, stream);
  } else {
    return FeatureNotBuilt("float16");
  }
}

template <int kHeadDim, bool kMasked, Elementwise kFeature>
Status LaunchMasked(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  if (args.p.logits_soft_cap <= 0.0f) return LaunchDType<kHeadDim, kMasked, false, kFeature>(args, cfg, stream);
  if constexpr (kSoftCapBuilt) {
    return LaunchDType<kHeadDim, kMasked, true, kFeature>(args, cfg, stream);
  } else {
    return FeatureNotBuilt("logits_soft_cap");
  }
}

// The kernel of kFeature, masked where the call is causal or windowed. kWithSoftcap: the soft
// cap is dispatched on (else the feature is built without one).
template <int kHeadDim, Elementwise kFeature, bool kWithSoftcap = true>
Status LaunchMaskedIfNeeded(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  const bool masked = CausalOrWindow(ForwardCallOf(args.p, args.dims));
  if constexpr (kWithSoftcap) {
    return masked ? LaunchMasked<kHeadDim, true, kFeature>(args, cfg, stream)
                  : LaunchMasked<kHeadDim, false, kFeature>(args, cfg, stream);
  } else {
    return masked ? LaunchDType<kHeadDim, true, false, kFeature>(args, cfg, stream)
                  : LaunchDType<kHeadDim, false, false, kFeature>(args, cfg, stream);
  }
}

// Calls with segment ids (the masked kernels' tiles, every key tile masked element-wise);
// instantiated per head dim in cuda_hopper_forward_segments_hdim*.cu.
template <int kHeadDim>
Status LaunchSegments(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  return LaunchMasked<kHeadDim, true, Elementwise::kSegmentIds>(args, cfg, stream);
}

// Calls with a float32 bias and bf16/f16 inputs (DenseUnsupportedReason: up to head dim 192),
// with or without segment ids; instantiated per head dim in cuda_hopper_forward_bias_f32_hdim*.cu.
template <int kHeadDim>
Status LaunchBiasF32(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  static_assert(kHeadDim <= 192, "a float32 bias tile does not fit beside d256's tiles");
  if (args.p.q_segment_ids.present()) {
    if constexpr (kSegmentIdsBuilt) {
      return LaunchMasked<kHeadDim, true, Elementwise::kSegmentIdsBiasF32>(args, cfg, stream);
    } else {
      return FeatureNotBuilt("segment_ids");
    }
  }
  return LaunchMaskedIfNeeded<kHeadDim, Elementwise::kBiasF32>(args, cfg, stream);
}

// Calls with a bias of the query's dtype or an attention mask (DenseUnsupportedReason: one of
// them, or both folded into a bias); instantiated per head dim in cuda_hopper_forward_dense_hdim*.cu.
template <int kHeadDim>
Status LaunchDense(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  if (args.p.bias.present()) return LaunchMaskedIfNeeded<kHeadDim, Elementwise::kBias>(args, cfg, stream);
  return LaunchMaskedIfNeeded<kHeadDim, Elementwise::kMask>(args, cfg, stream);
}

// Calls with dropout without a bias or mask, with or without segment ids;
// instantiated per head dim in cuda_hopper_forward_dropout_hdim*.cu.
template <int kHeadDim>
Status LaunchDropout(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  if (args.p.q_segment_ids.present()) {
    if constexpr (kSegmentIdsBuilt) {
      return LaunchMasked<kHeadDim, true, Elementwise::kSegmentIdsDropout>(args, cfg, stream);
    } else {
      return FeatureNotBuilt("segment_ids");
    }
  }
  return LaunchMaskedIfNeeded<kHeadDim, Elementwise::kDropout>(args, cfg, stream);
}

// Dropout with kFeature (a bias or an attention mask, with or without segment ids). Segment ids
// take the masked kernels whether or not a causal or window mask is on; no soft cap
// (DropoutUnsupportedReason).
template <int kHeadDim, Elementwise kFeature>
Status LaunchDropoutFeature(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  if constexpr (Has(kFeature, Elementwise::kSegmentIds)) {
    return LaunchDType<kHeadDim, true, false, kFeature>(args, cfg, stream);
  } else {
    return LaunchMaskedIfNeeded<kHeadDim, kFeature, false>(args, cfg, stream);
  }
}

// Calls with dropout and a bias or an attention mask (both folded into one bias where needed;
// a bias of another dtype than the query's read as float32, up to head dim 192), with kWith
// (segment ids, or nothing), without a soft cap (DropoutUnsupportedReason).
template <int kHeadDim, Elementwise kWith>
Status LaunchDenseDropoutWith(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  const ForwardParams& p = args.p;
  if (p.logits_soft_cap > 0.0f) {
    return Status::Internal("hopper flash attention: no dropout kernel with a bias or mask and a soft cap");
  }
  if (p.bias.present() && p.bias.dtype == DType::kF32) {
    if constexpr (kHeadDim <= 192) {
      return LaunchDropoutFeature<kHeadDim, kWith | Elementwise::kBiasF32Dropout>(args, cfg, stream);
    } else {
      return Status::Internal("hopper flash attention: no float32 bias kernel at head_dim 256");
    }
  }
  if (p.bias.present()) return LaunchDropoutFeature<kHeadDim, kWith | Elementwise::kBiasDropout>(args, cfg, stream);
  return LaunchDropoutFeature<kHeadDim, kWith | Elementwise::kMaskDropout>(args, cfg, stream);
}

// Instantiated per head dim in cuda_hopper_forward_dense_dropout_hdim*.cu.
template <int kHeadDim>
Status LaunchDenseDropout(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  return LaunchDenseDropoutWith<kHeadDim, Elementwise::kNone>(args, cfg, stream);
}

// Instantiated per head dim in cuda_hopper_forward_segments_dense_dropout_hdim*.cu.
template <int kHeadDim>
Status LaunchSegmentsDenseDropout(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  return LaunchDenseDropoutWith<kHeadDim, Elementwise::kSegmentIds>(args, cfg, stream);
}

// Calls with segment ids and a bias or an attention mask (DenseUnsupportedReason); instantiated
// per head dim in cuda_hopper_forward_segments_dense_hdim*.cu.
template <int kHeadDim>
Status LaunchSegmentsDense(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  if (args.p.bias.present()) {
    return LaunchMasked<kHeadDim, true, Elementwise::kSegmentIds | Elementwise::kBias>(args, cfg, stream);
  }
  return LaunchMasked<kHeadDim, true, Elementwise::kSegmentIds | Elementwise::kMask>(args, cfg, stream);
}

template <int kHeadDim>
Status Launch(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  if (args.p.dropout_prob > 0.0f) {
    if (!args.p.bias.present() && !args.p.mask.present()) return LaunchDropout<kHeadDim>(args, cfg, stream);
    if (!args.p.q_segment_ids.present()) return LaunchDenseDropout<kHeadDim>(args, cfg, stream);
    if constexpr (kSegmentIdsBuilt) {
      return LaunchSegmentsDenseDropout<kHeadDim>(args, cfg, stream);
    } else {
      return FeatureNotBuilt("segment_ids");
    }
  }
  // A bias of another dtype than the query's arrives here as float32 (folded where it was not).
  if (args.p.bias.present() && args.p.bias.dtype == DType::kF32) {
    if constexpr (kHeadDim <= 192) {
      return LaunchBiasF32<kHeadDim>(args, cfg, stream);
    } else {
      return Status::Internal("hopper flash attention: no float32 bias kernel at head_dim 256");
    }
  }
  if (args.p.q_segment_ids.present()) {
    if constexpr (kSegmentIdsBuilt) {
      if (args.p.bias.present() || args.p.mask.present()) return LaunchSegmentsDense<kHeadDim>(args, cfg, stream);
      return LaunchSegments<kHeadDim>(args, cfg, stream);
    } else {
      return FeatureNotBuilt("segment_ids");
    }
  }
  if (args.p.bias.present() || args.p.mask.present()) return LaunchDense<kHeadDim>(args, cfg, stream);
  return LaunchMaskedIfNeeded<kHeadDim, Elementwise::kNone>(args, cfg, stream);
}

}  // namespace ejk::flash_attention::hopper
