// Tile configurations of the CUDA flash attention kernels: the framework's config type for
// platform "cuda", each kernel generation's tiles, and the rule that picks the Hopper
// forward's tile for a call. Plain C++, compiled in every build (the rule is unit-tested
// without a GPU); the kernels' dispatch (cuda_hopper_forward.cuh, cuda_mma_forward_hdim*.cu)
// and the registry's heuristic and autotuning candidates (cuda_ffi.cu) read it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "flash_attention/params.h"

namespace ejk::flash_attention {

// Tile configuration of the CUDA kernels (the framework's config for platform "cuda").
// block_q/block_k: query rows and keys per tile; num_warps: warps per thread block;
// num_stages: K/V shared-memory pipeline depth (0 matches any, in either).
struct CudaConfig {
  int block_q = 128;
  int block_k = 64;
  int num_warps = 0;
  int num_stages = 2;
};

bool operator==(const CudaConfig& a, const CudaConfig& b);
// Whether `requested` names `tile`: block_q and block_k equal, num_warps and num_stages equal
// or 0.
bool Requests(const CudaConfig& requested, const CudaConfig& tile);

// The mma.sync kernels' tiles per head dim, the default first: cuda_mma_forward_hdim*.cu
// instantiates each list (DispatchTiles). 32 query rows per warp (block_q = 32 * num_warps)
// halve the shared-memory traffic per mma and win wherever their accumulators fit in
// registers (head dims up to 128; measured ~35% on H100); above 128, O needs 8 warps.
inline constexpr std::array<CudaConfig, 3> kMmaTilesD64 = {{{128, 64, 4, 2}, {128, 128, 4, 2}, {64, 64, 4, 2}}};
inline constexpr std::array<CudaConfig, 3> kMmaTilesD96 = {{{128, 64, 4, 2}, {128, 64, 8, 2}, {64, 64, 4, 2}}};
inline constexpr std::array<CudaConfig, 4> kMmaTilesD128 = {
    {{128, 64, 4, 2}, {128, 32, 4, 2}, {128, 64, 8, 2}, {64, 64, 4, 2}}};
inline constexpr std::array<CudaConfig, 3> kMmaTilesD192 = {{{128, 64, 8, 2}, {64, 64, 4, 2}, {64, 32, 4, 2}}};
inline constexpr std::array<CudaConfig, 3> kMmaTilesD256 = kMmaTilesD192;

// The list above for this head dim, the call's default first; empty for a head dim the
// kernels lack. With per-element features (bias, attention mask, dropout, segment ids) the
// default up to head dim 128 is 64 x 64 (16 query rows per warp): the general kernels' feature
// reads next to two 16-row tiles' accumulators spilled, and on the H100 the 64-row tile runs
// bias, mask and causal-bias calls 1.0-1.8x (d128), 1.5-2.4x (d64) faster; above 128 the
// default stays.
std::vector<CudaConfig> MmaForwardTiles(int64_t head_dim, bool per_element_features);
// The first of MmaForwardTiles that `requested` names (Requests), else the default; all zeros
// for a head dim the kernels lack.
CudaConfig ChooseMmaForwardTile(int64_t head_dim, bool per_element_features, const CudaConfig& requested);

namespace hopper {

// A tile shape of the Hopper forward: `warpgroups` consumer warpgroups of 64 query rows (and
// one producer warpgroup), K/V tiles of `block_n` keys, `stages` of them in flight; causal
// calls of at most `max_paired_m_blocks` query tiles per head run on a persistent grid in
// pairs of equal total length (0: never).
struct ForwardTile {
  int warpgroups, block_n, stages, max_paired_m_blocks;

  constexpr int block_m() const { return 64 * warpgroups; }
  // As the framework's config: block_q x block_k, the block's warps (producer included).
  CudaConfig config() const { return {block_m(), block_n, 4 * (warpgroups + 1), stages}; }
  bool operator==(const ForwardTile& o) const {
    return warpgroups == o.warpgroups && block_n == o.block_n && stages == o.stages &&
           max_paired_m_blocks == o.max_paired_m_blocks;
  }
};

// The shapes the kernels are built with. Consumers hold O (D/2 floats per thread), S
// (block_n/2) and P (block_n/4) in registers; shared memory holds Q and the K/V stages.
// Measured on H100 (notes/flash_attention.md):
// - d64: three consumer warpgroups keep the tensor cores fed (two were slower on every
//   non-causal length, 32 x 512 222 -> 252 us). Causal calls of up to 1024 queries and keys
//   take two warpgroups with their tiles in pairs: 32 x 512 238 -> 209 us, 16 x 1024
//   317 -> 285 us, but 8 x 2048 423 -> 440 us and 4 x 4096 688 -> 742 us (three warpgroups
//   in pairs: 32 x 512 281 us).
// - d128, and d96, which keeps Q, K and V in d128's 64-column blocks (TMA fills the columns
//   past the head dim with zeros, which no product reads): unmasked calls take 176-key tiles
//   with one Q slot; causal and window masks waste less on the diagonal with 128-key tiles,
//   whose two Q slots also let the next tile's Q load early; the soft cap needs their
//   registers; and unmasked calls of up to 1024 queries and keys run faster on them
//   (32 x 512 169 -> 160 us, 16 x 1024 260 -> 253 us, 8 x 2048 even, 4 x 4096 +5%).
//   Causal pairs on them: 32 x 512 -11%, 16 x 1024
//   -7%, 8 x 2048 -2%, 3 x 1999 -6% against one block per tile, but 1 x 16384 +6% (1024
//   pairs on 132 SMs leave a tail that hardware dispatch of single tiles avoids): up to 16
//   query tiles. Pairs need two Q slots and two consumer warpgroups (SmemLayout).
// - d192: O takes 96 registers per thread; two stages of 112-key tiles and one Q slot fill
//   216 KB. 96-key tiles (room for O through shared memory) measured 26-30% slower (ptxas
//   serialised their wgmma).
// - d256: 80-key tiles, one Q slot.
// - A dense bias or attention mask: its [128 x 128] tile per key tile goes through shared
//   memory with K and V, two stages of all three; at d96/d128 that leaves room for one Q slot
//   (a bias) or two (a mask). d192 and d256 take 64-key tiles: at d256 one Q slot (64 KB),
//   two stages of K and V (128 KB) and of the tile (a bias's 16 KB, or a mask's 128-key box
//   of which the tile reads half) fill 224 KB. A float32 bias (a bias whose dtype is not the
//   query's) doubles the tile: d64 keeps 128-key tiles (2 x 64 KB of bias, 224 KB in all),
//   d96 to d192 take 64-key ones (at d192 one Q slot, 208 KB), and at d256 it does not fit.
inline constexpr ForwardTile kTileD64 = {3, 128, 4, 0};
inline constexpr ForwardTile kTileD64Pairs = {2, 128, 4, 8};
inline constexpr ForwardTile kTileD128Wide = {2, 176, 2, 0};
inline constexpr ForwardTile kTileD128 = {2, 128, 2, 16};
inline constexpr ForwardTile kTileD192 = {2, 112, 2, 0};
inline constexpr ForwardTile kTileD256 = {2, 80, 2, 0};
inline constexpr ForwardTile kTileDense = {2, 128, 2, 0};
inline constexpr ForwardTile kTileDenseNarrow = {2, 64, 2, 0};
// Calls of at most this many queries and keys (no band, no packed sequences) are short: their
// tiles' start-up and epilogue weigh more.
inline constexpr int64_t kShortSeqlen = 1024;

// A call as the Hopper forward's tile choice and masks see it: from its params (the dispatch),
// or from the registry signature (the heuristic and the autotuning candidates).
struct ForwardCall {
  int64_t head_dim = 0;  // the kernels' (KernelHeadDim), 0 where none is built
  int64_t seqlen_q = 0, seqlen_k = 0;  // packed lengths for packed sequences
  bool varlen = false;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // < 0: unbounded side
  bool soft_cap = false;
  bool segment_ids = false;
  bool dropout = false;
  bool bias = false, mask = false;  // a dense bias / attention mask ([B|1, H|1, Sq, Sk])
  // The kernels read the bias as float32: its dtype is not the query's. bias_converts: nor is it
  // float32 (the fold converts it).
  bool bias_f32 = false, bias_converts = false;
  // Where the kernels read a folded bias (PlanFold): its batch and head dims (0: no fold), and
  // whether the call runs one batch row at a time.
  int64_t folded_batch = 0, folded_heads = 0;
  bool fold_per_row = false;
};

ForwardCall ForwardCallOf(const ForwardParams& p, const Dims& d);

// The Hopper kernels read one dense operand whose rows are whole 16-byte units (a tensor map's
// strides): a bias of the query's dtype or of float32, or a mask. Other calls reach them with a
// folded bias, written to the workspace before each direction: mask ? bias : -inf (0 for the
// bias of a mask alone; the kernels treat -inf exactly like the mask), in rows padded to a
// multiple of 8 elements, of the bias's dtype (float32 for a 16-bit bias of the other 16-bit
// type, or a float64 one). That is a bias with a mask, a bias of another dtype than the query's
// or float32, a bias whose seqlen_k is not a multiple of 8 (4 for float32), and a mask whose
// seqlen_k is not a multiple of 16. The folded bias is never larger than the larger operand:
// where one's batch and head dims cover the other's the whole call folds at once; where their
// broadcasts cross ([1, H] with [B, 1]) the call runs one batch row at a time, each folded
// into [1, H].
// FoldedShape: the folded dims of a bias and a mask, and whether the call runs per row.
void FoldedShape(int64_t bias_batch, int64_t bias_heads, int64_t mask_batch, int64_t mask_heads,
                 int64_t* folded_batch, int64_t* folded_heads, bool* per_row);
// PlanFold: sets c's fold from its bias's and mask's batch and head dims (those of an absent
// operand are ignored); leaves it off where the kernels read the operand as it is.
void PlanFold(int64_t bias_batch, int64_t bias_heads, int64_t mask_batch, int64_t mask_heads, ForwardCall* c);
// Elements per row of a folded bias: seqlen_k rounded up to a multiple of 8.
int64_t FoldedRowElements(int64_t seqlen_k);
// Bytes of a call's folded bias (one batch row's where it runs per row), 0 for calls without
// one.
size_t FoldedBiasBytes(const ForwardCall& c);

// Why the Hopper forward does not take this call's bias or attention mask, "" when it does (or
// the call has neither). It takes a bias, a mask, or both (folded where needed, PlanFold), not
// with packed sequences, with or without segment ids; a float32 bias up to head dim 192.
std::string DenseUnsupportedReason(const ForwardCall& c);
// The same for the Hopper backward, which takes a bias read as float32 (one whose dtype is not
// the inputs') from d64 to d128 only; HopperBackwardSupports adds the rules that depend on the
// gradients asked for.
std::string BackwardDenseUnsupportedReason(const ForwardCall& c);

// Why the Hopper kernels (both directions) do not take this call's dropout, "" when they do (or
// the call has none). With a bias or an attention mask they take it where they take the
// operand (DenseUnsupportedReason), with or without segment ids, without a soft cap.
std::string DropoutUnsupportedReason(const ForwardCall& c);

// The visible keys' sides for the kernels: key j is visible to query i iff
// i + offset - left <= j < i + offset + right + 1. Sides beyond Sq + Sk hide nothing and are
// clamped, which keeps the kernels' sums in int32.
void WindowSides(const ForwardCall& c, int* left, int* right);
// A sliding window much narrower than the keys: all but the first few query tiles hold the
// same number of key tiles.
bool IsBand(int left, int right, int64_t seqlen_k);
// A causal or sliding-window mask is on.
bool CausalOrWindow(const ForwardCall& c);
// No band, no packed sequences, at most max_seqlen_q queries and max_seqlen_k keys.
bool ShortCall(const ForwardCall& c, int64_t max_seqlen_q, int64_t max_seqlen_k);

// The tiles the Hopper forward can run this call with, the default (the rule above, tuned on
// H100) first, then the alternatives built and tested for calls of its kind: d64 without
// segment ids or dropout, two warpgroups or three; d96/d128 without masks, soft cap, segment
// ids or dropout, 128-key tiles or 176; a bias or mask, kTileDense (kTileDenseNarrow at d192/d256, and for a
// float32 bias from d96). Empty for a head dim without Hopper kernels.
std::vector<ForwardTile> ForwardTiles(const ForwardCall& c);
// The first of ForwardTiles(c) that `requested` names (Requests), else the default.
ForwardTile ChooseForwardTile(const ForwardCall& c, const CudaConfig& requested);

std::string ToString(const ForwardTile& t);

}  // namespace hopper
}  // namespace ejk::flash_attention
