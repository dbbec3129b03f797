#include "flash_attention/cuda_tiles.h"

#include <algorithm>

#include "flash_attention/cuda_build_scope.h"

namespace ejk::flash_attention {

bool operator==(const CudaConfig& a, const CudaConfig& b) {
  return a.block_q == b.block_q && a.block_k == b.block_k && a.num_warps == b.num_warps &&
         a.num_stages == b.num_stages;
}

bool Requests(const CudaConfig& requested, const CudaConfig& tile) {
  return requested.block_q == tile.block_q && requested.block_k == tile.block_k &&
         (requested.num_warps == 0 || requested.num_warps == tile.num_warps) &&
         (requested.num_stages == 0 || requested.num_stages == tile.num_stages);
}

std::vector<CudaConfig> MmaForwardTiles(int64_t head_dim, bool per_element_features) {
  const auto list = [](const auto& tiles) { return std::vector<CudaConfig>(tiles.begin(), tiles.end()); };
  std::vector<CudaConfig> tiles;
  switch (head_dim) {
    case 64: tiles = list(kMmaTilesD64); break;
    case 96: tiles = list(kMmaTilesD96); break;
    case 128: tiles = list(kMmaTilesD128); break;
    case 192: tiles = list(kMmaTilesD192); break;
    case 256: tiles = list(kMmaTilesD256); break;
    default: return {};
  }
  if (per_element_features && head_dim <= 128) {
    const auto narrow = std::find(tiles.begin(), tiles.end(), CudaConfig{64, 64, 4, 2});
    if (narrow != tiles.end()) std::rotate(tiles.begin(), narrow, narrow + 1);
  }
  return tiles;
}

CudaConfig ChooseMmaForwardTile(int64_t head_dim, bool per_element_features, const CudaConfig& requested) {
  const std::vector<CudaConfig> tiles = MmaForwardTiles(head_dim, per_element_features);
  if (tiles.empty()) return CudaConfig{0, 0, 0, 0};
  for (const CudaConfig& t : tiles) {
    if (Requests(requested, t)) return t;
  }
  return tiles.front();
}

namespace hopper {

ForwardCall ForwardCallOf(const ForwardParams& p, const Dims& d) {
  ForwardCall c;
  c.head_dim = KernelHeadDim(d.head_dim);
  c.seqlen_q = d.seqlen_q;
  c.seqlen_k = d.seqlen_k;
  c.varlen = d.varlen;
  c.causal = p.causal;
  c.window_left = p.window_left;
  c.window_right = p.window_right;
  c.soft_cap = p.logits_soft_cap > 0.0f;
  c.segment_ids = p.q_segment_ids.present();
  c.dropout = p.dropout_prob > 0.0f;
  c.bias = p.bias.present();
  c.mask = p.mask.present();
  c.bias_f32 = c.bias && p.bias.dtype != p.q.dtype;
  c.bias_converts = c.bias_f32 && p.bias.dtype != DType::kF32;
  PlanFold(p.bias.dim(0), p.bias.dim(1), p.mask.dim(0), p.mask.dim(1), &c);  // an absent one's dims are ignored
  return c;
}

void FoldedShape(int64_t bias_batch, int64_t bias_heads, int64_t mask_batch, int64_t mask_heads,
                 int64_t* folded_batch, int64_t* folded_heads, bool* per_row) {
  const bool bias_covers = mask_batch <= bias_batch && mask_heads <= bias_heads;
  const bool mask_covers = bias_batch <= mask_batch && bias_heads <= mask_heads;
  *per_row = !bias_covers && !mask_covers;
  *folded_batch = *per_row ? 1 : std::max(bias_batch, mask_batch);
  *folded_heads = std::max(bias_heads, mask_heads);
}

void PlanFold(int64_t bias_batch, int64_t bias_heads, int64_t mask_batch, int64_t mask_heads, ForwardCall* c) {
  c->folded_batch = c->folded_heads = 0;
  c->fold_per_row = false;
  const bool folds = (c->bias && c->mask) || (c->bias && c->seqlen_k % (c->bias_f32 ? 4 : 8) != 0) ||
                     c->bias_converts || (c->mask && !c->bias && c->seqlen_k % 16 != 0);
  if (!folds) return;
  if (!c->bias) bias_batch = bias_heads = 1;
  if (!c->mask) mask_batch = mask_heads = 1;
  FoldedShape(bias_batch, bias_heads, mask_batch, mask_heads, &c->folded_batch, &c->folded_heads,
              &c->fold_per_row);
}

int64_t FoldedRowElements(int64_t seqlen_k) { return (seqlen_k + 7) / 8 * 8; }

size_t FoldedBiasBytes(const ForwardCall& c) {
  return static_cast<size_t>(c.folded_batch * c.folded_heads * c.seqlen_q * FoldedRowElements(c.seqlen_k)) *
         (c.bias_f32 ? 4 : 2);
}

std::string DenseUnsupportedReason(const ForwardCall& c) {
  if (!c.bias && !c.mask) return "";
  // A tile's first key must start 16 bytes into a row (TMA), which a sequence's need not.
  if (c.varlen) return "bias or mask with packed sequences is not supported";
  if (c.bias_f32 && c.head_dim > 192) {
    return "a bias of another dtype than the query's (read as float32) does not fit shared memory at head_dim " +
           std::to_string(c.head_dim);
  }
  // Rows of the tensor map the kernels read are whole 16-byte units, else the call folds.
  const bool rows_whole = c.seqlen_k % (c.bias ? (c.bias_f32 ? 4 : 8) : 16) == 0;
  if ((c.bias && c.mask) || c.bias_converts || !rows_whole) {
    if (c.folded_batch == 0) return "a bias or mask that needs folding, of unknown shapes";
  }
  return "";
}

std::string BackwardDenseUnsupportedReason(const ForwardCall& c) {
  if (c.bias_f32 && c.head_dim > 128) {
    return "a bias read as float32 (its dtype is not the inputs') at head_dim " + std::to_string(c.head_dim) +
           " does not fit shared memory (64 to 128 only)";
  }
  return DenseUnsupportedReason(c);
}

std::string DropoutUnsupportedReason(const ForwardCall& c) {
  if (!c.dropout || (!c.bias && !c.mask)) return "";
  if (c.soft_cap) return "dropout with a bias or an attention mask and a soft cap is not supported";
  return "";
}

void WindowSides(const ForwardCall& c, int* left, int* right) {
  const int64_t unbounded = c.seqlen_q + c.seqlen_k + 1;
  *right = static_cast<int>(c.causal ? (c.window_right >= 0 ? std::min<int64_t>(c.window_right, 0) : 0)
                                     : (c.window_right >= 0 ? std::min(c.window_right, unbounded) : unbounded));
  *left = static_cast<int>(c.window_left >= 0 ? std::min(c.window_left, unbounded) : unbounded);
}

bool IsBand(int left, int right, int64_t seqlen_k) {
  return 4 * (static_cast<int64_t>(left) + right + 1) <= seqlen_k;
}

bool CausalOrWindow(const ForwardCall& c) { return c.causal || c.window_left >= 0 || c.window_right >= 0; }

bool ShortCall(const ForwardCall& c, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  if (c.varlen || c.seqlen_q > max_seqlen_q || c.seqlen_k > max_seqlen_k) return false;
  int left, right;
  WindowSides(c, &left, &right);
  return !IsBand(left, right, c.seqlen_k);
}

std::vector<ForwardTile> ForwardTiles(const ForwardCall& c) {
  // Segment ids and dropout (per-element work in every tile) take the masked calls' tiles, and
  // no alternative is built for them.
  const bool per_element = c.segment_ids || c.dropout;
  const bool masked = per_element || CausalOrWindow(c);
  const bool short_call = !per_element && ShortCall(c, kShortSeqlen, kShortSeqlen);
  const bool dense = c.bias || c.mask;
  switch (c.head_dim) {
    case 64:
      if (dense) return {kTileDense};  // a float32 bias too
      if (per_element) return {kTileD64};
      if (masked && short_call) return {kTileD64Pairs, kTileD64};
      return {kTileD64, kTileD64Pairs};
    case 96:
    case 128:
      if (dense) return {c.bias_f32 ? kTileDenseNarrow : kTileDense};
      if (masked || c.soft_cap) return {kTileD128};
      if (short_call) return {kTileD128, kTileD128Wide};
      return {kTileD128Wide, kTileD128};
    case 192: return {dense ? kTileDenseNarrow : kTileD192};
    case 256: return {dense ? kTileDenseNarrow : kTileD256};
    default: return {};
  }
}

ForwardTile ChooseForwardTile(const ForwardCall& c, const CudaConfig& requested) {
  const std::vector<ForwardTile> tiles = ForwardTiles(c);
  for (const ForwardTile& t : tiles) {
    if (Requests(requested, t.config())) return t;
  }
  return tiles.empty() ? ForwardTile{} : tiles.front();
}

std::string ToString(const ForwardTile& t) {
  return std::to_string(t.block_m()) + "x" + std::to_string(t.block_n) + " (" + std::to_string(t.warpgroups) +
         " consumer warpgroups, " + std::to_string(t.stages) + " stages)";
}

}  // namespace hopper
}  // namespace ejk::flash_attention
