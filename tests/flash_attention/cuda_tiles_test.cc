// The CUDA kernels' tile configurations (cuda_tiles.h): the Hopper forward's rule, tuned on
// H100, for the calls its measurements were taken on, the alternatives offered for
// autotuning, and how a requested config picks a tile. Plain C++: runs without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "flash_attention/cuda_build_scope.h"
#include "flash_attention/cuda_tiles.h"
#include "flash_attention/params.h"
#include "runtime/tensor.h"

namespace ejk::flash_attention {
namespace {

using hopper::ForwardCall;
using hopper::ForwardTile;
using hopper::ForwardTiles;

ForwardCall Call(int64_t head_dim, int64_t seqlen_q, int64_t seqlen_k) {
  ForwardCall c;
  c.head_dim = head_dim;
  c.seqlen_q = seqlen_q;
  c.seqlen_k = seqlen_k;
  return c;
}

ForwardCall Causal(ForwardCall c) {
  c.causal = true;
  return c;
}

ForwardCall Window(ForwardCall c, int64_t left, int64_t right) {
  c.window_left = left;
  c.window_right = right;
  return c;
}

using Tiles = std::vector<ForwardTile>;

TEST(HopperForwardTiles, D64CausalShortCallsRunInPairsOfTwoWarpgroups) {
  EXPECT_EQ(ForwardTiles(Causal(Call(64, 512, 512))), (Tiles{hopper::kTileD64Pairs, hopper::kTileD64}));
  EXPECT_EQ(ForwardTiles(Causal(Call(64, 1024, 1024))), (Tiles{hopper::kTileD64Pairs, hopper::kTileD64}));
  // Longer, or a band, or packed: three warpgroups first.
  EXPECT_EQ(ForwardTiles(Causal(Call(64, 2048, 2048))), (Tiles{hopper::kTileD64, hopper::kTileD64Pairs}));
  EXPECT_EQ(ForwardTiles(Causal(Call(64, 512, 1025))), (Tiles{hopper::kTileD64, hopper::kTileD64Pairs}));
  EXPECT_EQ(ForwardTiles(Window(Call(64, 1024, 1024), 100, 0)), (Tiles{hopper::kTileD64, hopper::kTileD64Pairs}));
  ForwardCall packed = Causal(Call(64, 512, 512));
  packed.varlen = true;
  EXPECT_EQ(ForwardTiles(packed), (Tiles{hopper::kTileD64, hopper::kTileD64Pairs}));
}

TEST(HopperForwardTiles, D64UnmaskedTakesThreeWarpgroups) {
  EXPECT_EQ(ForwardTiles(Call(64, 512, 512)), (Tiles{hopper::kTileD64, hopper::kTileD64Pairs}));
  EXPECT_EQ(ForwardTiles(Call(64, 4096, 4096)), (Tiles{hopper::kTileD64, hopper::kTileD64Pairs}));
}

TEST(HopperForwardTiles, D128UnmaskedShortCallsTake128KeyTiles) {
  for (int64_t head_dim : {96, 128}) {
    EXPECT_EQ(ForwardTiles(Call(head_dim, 512, 512)), (Tiles{hopper::kTileD128, hopper::kTileD128Wide}));
    EXPECT_EQ(ForwardTiles(Call(head_dim, 1024, 1000)), (Tiles{hopper::kTileD128, hopper::kTileD128Wide}));
    EXPECT_EQ(ForwardTiles(Call(head_dim, 4096, 4096)), (Tiles{hopper::kTileD128Wide, hopper::kTileD128}));
    EXPECT_EQ(ForwardTiles(Call(head_dim, 512, 2048)), (Tiles{hopper::kTileD128Wide, hopper::kTileD128}));
    ForwardCall packed = Call(head_dim, 512, 512);
    packed.varlen = true;
    EXPECT_EQ(ForwardTiles(packed), (Tiles{hopper::kTileD128Wide, hopper::kTileD128}));
  }
}

TEST(HopperForwardTiles, D128MasksSoftCapAndSegmentIdsTake128KeyTilesOnly) {
  const Tiles narrow = {hopper::kTileD128};
  EXPECT_EQ(ForwardTiles(Causal(Call(128, 512, 512))), narrow);
  EXPECT_EQ(ForwardTiles(Causal(Call(128, 16384, 16384))), narrow);
  EXPECT_EQ(ForwardTiles(Window(Call(128, 16384, 16384), 1024, 0)), narrow);
  EXPECT_EQ(ForwardTiles(Window(Call(96, 4096, 4096), -1, 7)), narrow);  // one bounded side masks too
  ForwardCall capped = Call(128, 4096, 4096);
  capped.soft_cap = true;
  EXPECT_EQ(ForwardTiles(capped), narrow);
  ForwardCall segments = Call(128, 4096, 4096);
  segments.segment_ids = true;
  EXPECT_EQ(ForwardTiles(segments), narrow);
  segments.head_dim = 64;
  EXPECT_EQ(ForwardTiles(segments), (Tiles{hopper::kTileD64}));
}

// Dropout hashes every element of every tile: the per-element kernels' tiles, short calls too.
TEST(HopperForwardTiles, DropoutTakesThePerElementTiles) {
  for (int64_t head_dim : {96, 128}) {
    ForwardCall dropout = Call(head_dim, 4096, 4096);
    dropout.dropout = true;
    EXPECT_EQ(ForwardTiles(dropout), (Tiles{hopper::kTileD128})) << head_dim;
    EXPECT_EQ(ForwardTiles(Causal(dropout)), (Tiles{hopper::kTileD128})) << head_dim;
  }
  ForwardCall d64 = Causal(Call(64, 512, 512));
  d64.dropout = true;
  EXPECT_EQ(ForwardTiles(d64), (Tiles{hopper::kTileD64}));
  d64.seqlen_q = d64.seqlen_k = 4096;
  EXPECT_EQ(ForwardTiles(d64), (Tiles{hopper::kTileD64}));
}

TEST(HopperForwardTiles, DropoutRunsWithoutPerElementOperands) {
  ForwardCall c = Call(128, 4096, 4096);
  c.dropout = true;
  EXPECT_EQ(hopper::DropoutUnsupportedReason(c), "");
  c.varlen = true;
  c.causal = true;
  c.soft_cap = true;
  EXPECT_EQ(hopper::DropoutUnsupportedReason(c), "");
  c.varlen = false;
  c.segment_ids = true;
  EXPECT_EQ(hopper::DropoutUnsupportedReason(c), "");
}

// With a bias or a mask (folded or not), the kernels take dropout; not with a soft cap or
// segment ids.
TEST(HopperForwardTiles, DropoutWithABiasOrMask) {
  for (bool ForwardCall::*operand : {&ForwardCall::bias, &ForwardCall::mask}) {
    ForwardCall with = Causal(Call(64, 4096, 4096));
    with.dropout = true;
    with.*operand = true;
    EXPECT_EQ(hopper::DropoutUnsupportedReason(with), "");
    EXPECT_EQ(ForwardTiles(with), (Tiles{hopper::kTileDense}));  // the dense tile, not the per-element one
    with.head_dim = 256;
    EXPECT_EQ(ForwardTiles(with), (Tiles{hopper::kTileDenseNarrow}));
    ForwardCall segments = with;  // segment ids too (a key padding mask beside a bias)
    segments.segment_ids = true;
    EXPECT_EQ(hopper::DropoutUnsupportedReason(segments), "");
    EXPECT_EQ(ForwardTiles(segments), (Tiles{hopper::kTileDenseNarrow}));
    ForwardCall capped = with;
    capped.soft_cap = true;
    EXPECT_NE(hopper::DropoutUnsupportedReason(capped), "");
    capped.dropout = false;
    EXPECT_EQ(hopper::DropoutUnsupportedReason(capped), "");
  }
  ForwardCall f32 = Call(128, 4096, 4096);
  f32.dropout = f32.bias = f32.bias_f32 = true;  // a float32 bias: where the kernels read one
  EXPECT_EQ(hopper::DropoutUnsupportedReason(f32), "");
  EXPECT_EQ(ForwardTiles(f32), (Tiles{hopper::kTileDenseNarrow}));
  ForwardCall both = Call(128, 4096, 1000);
  both.dropout = both.bias = both.mask = true;
  // Folded whole, or one batch row at a time ([1, H] with [B, 1]: each row hashes as its batch
  // index, CudaForwardArgs::dropout_first_batch).
  hopper::PlanFold(4, 8, 4, 1, &both);
  EXPECT_FALSE(both.fold_per_row);
  EXPECT_EQ(hopper::DropoutUnsupportedReason(both), "");
  hopper::PlanFold(1, 8, 4, 1, &both);
  EXPECT_TRUE(both.fold_per_row);
  EXPECT_EQ(hopper::DropoutUnsupportedReason(both), "");
}

TEST(HopperForwardTiles, LargeHeadDimsHaveOneTileAndOthersNone) {
  EXPECT_EQ(ForwardTiles(Causal(Call(192, 512, 512))), (Tiles{hopper::kTileD192}));
  EXPECT_EQ(ForwardTiles(Call(192, 4096, 4096)), (Tiles{hopper::kTileD192}));
  EXPECT_EQ(ForwardTiles(Call(256, 4096, 4096)), (Tiles{hopper::kTileD256}));
  EXPECT_TRUE(ForwardTiles(Call(80, 4096, 4096)).empty());
  EXPECT_TRUE(ForwardTiles(Call(32, 512, 512)).empty());
}

TEST(HopperForwardTiles, ConfigNamesTheTile) {
  EXPECT_EQ(hopper::kTileD64.config(), (CudaConfig{192, 128, 16, 4}));
  EXPECT_EQ(hopper::kTileD64Pairs.config(), (CudaConfig{128, 128, 12, 4}));
  EXPECT_EQ(hopper::kTileD128Wide.config(), (CudaConfig{128, 176, 12, 2}));
  EXPECT_EQ(hopper::kTileD128.config(), (CudaConfig{128, 128, 12, 2}));
  EXPECT_EQ(hopper::kTileD192.config(), (CudaConfig{128, 112, 12, 2}));
  EXPECT_EQ(hopper::kTileD256.config(), (CudaConfig{128, 80, 12, 2}));
  EXPECT_EQ(hopper::kTileDense.config(), (CudaConfig{128, 128, 12, 2}));
  EXPECT_EQ(hopper::kTileDenseNarrow.config(), (CudaConfig{128, 64, 12, 2}));
  EXPECT_EQ(hopper::ToString(hopper::kTileD128Wide), "128x176 (2 consumer warpgroups, 2 stages)");
}

TEST(HopperForwardTiles, ChooseTakesTheRequestedAlternativeOrTheDefault) {
  const ForwardCall long_plain = Call(128, 4096, 4096);
  EXPECT_EQ(hopper::ChooseForwardTile(long_plain, hopper::kTileD128.config()), hopper::kTileD128);
  EXPECT_EQ(hopper::ChooseForwardTile(long_plain, {128, 128, 0, 0}), hopper::kTileD128);  // 0 matches any
  EXPECT_EQ(hopper::ChooseForwardTile(long_plain, {128, 128, 12, 3}), hopper::kTileD128Wide);  // not built
  EXPECT_EQ(hopper::ChooseForwardTile(long_plain, {128, 64, 4, 2}), hopper::kTileD128Wide);  // an mma.sync tile
  EXPECT_EQ(hopper::ChooseForwardTile(long_plain, CudaConfig{}), hopper::kTileD128Wide);
  // A tile the call's kind has no kernel for is not taken.
  EXPECT_EQ(hopper::ChooseForwardTile(Causal(long_plain), hopper::kTileD128Wide.config()), hopper::kTileD128);
  EXPECT_EQ(hopper::ChooseForwardTile(Causal(Call(64, 512, 512)), hopper::kTileD64.config()), hopper::kTileD64);
  EXPECT_EQ(hopper::ChooseForwardTile(Causal(Call(64, 512, 512)), {}), hopper::kTileD64Pairs);
}

TEST(CudaTiles, NoConfigNamesTilesOfBothGenerations) {
  // A config tuned for one kernel generation (a GPU with or without the Hopper kernels) runs
  // the other's default rather than some unrelated tile of it.
  const Tiles hopper_tiles = {hopper::kTileD64,  hopper::kTileD64Pairs, hopper::kTileD128Wide,
                              hopper::kTileD128, hopper::kTileD192,     hopper::kTileD256,
                              hopper::kTileDense, hopper::kTileDenseNarrow};
  for (int64_t head_dim : {64, 96, 128, 192, 256}) {
    const std::vector<CudaConfig> mma = MmaForwardTiles(head_dim, false);
    ASSERT_FALSE(mma.empty()) << head_dim;
    for (const CudaConfig& m : mma) {
      for (const ForwardTile& h : hopper_tiles) {
        EXPECT_FALSE(Requests(m, h.config()) || Requests(h.config(), m))
            << head_dim << ": " << m.block_q << "x" << m.block_k << " and " << hopper::ToString(h);
      }
    }
  }
  EXPECT_EQ(MmaForwardTiles(128, false).front(), (CudaConfig{128, 64, 4, 2}));
  EXPECT_EQ(MmaForwardTiles(256, false).front(), (CudaConfig{128, 64, 8, 2}));
  EXPECT_TRUE(MmaForwardTiles(80, false).empty());
}

TEST(MmaForwardTiles, PerElementFeaturesTakeTheNarrowTileUpTo128) {
  for (int64_t head_dim : {64, 96, 128}) {
    const std::vector<CudaConfig> plain = MmaForwardTiles(head_dim, false), general = MmaForwardTiles(head_dim, true);
    EXPECT_EQ(general.front(), (CudaConfig{64, 64, 4, 2})) << head_dim;
    EXPECT_TRUE(std::is_permutation(plain.begin(), plain.end(), general.begin(), general.end())) << head_dim;
    // The default follows the call; a named tile is taken as it is.
    const CudaConfig none{0, 0, 0, 0};
    EXPECT_EQ(ChooseMmaForwardTile(head_dim, true, none), (CudaConfig{64, 64, 4, 2})) << head_dim;
    EXPECT_EQ(ChooseMmaForwardTile(head_dim, false, none), plain.front()) << head_dim;
    EXPECT_EQ(ChooseMmaForwardTile(head_dim, true, plain.front()), plain.front()) << head_dim;
  }
  EXPECT_EQ(MmaForwardTiles(256, true), MmaForwardTiles(256, false));
  EXPECT_EQ(ChooseMmaForwardTile(80, true, CudaConfig{}), (CudaConfig{0, 0, 0, 0}));
}

// The call with a bias or with a mask.
ForwardCall WithBias(ForwardCall c) { return c.bias = true, c; }
ForwardCall WithMask(ForwardCall c) { return c.mask = true, c; }

TEST(HopperForwardTiles, BiasOrMaskTakesTheDenseTile) {
  for (int64_t head_dim : {64, 96, 128, 192, 256}) {
    const Tiles dense{head_dim > 128 ? hopper::kTileDenseNarrow : hopper::kTileDense};
    EXPECT_EQ(ForwardTiles(WithBias(Call(head_dim, 4096, 4096))), dense) << head_dim;
    EXPECT_EQ(ForwardTiles(Causal(WithMask(Call(head_dim, 512, 512)))), dense) << head_dim;
    EXPECT_EQ(hopper::DenseUnsupportedReason(WithBias(Call(head_dim, 300, 264))), "");
    EXPECT_EQ(hopper::DenseUnsupportedReason(WithMask(Call(head_dim, 300, 272))), "");
    ForwardCall capped = WithBias(Call(head_dim, 300, 264));
    capped.soft_cap = true;
    EXPECT_EQ(hopper::DenseUnsupportedReason(capped), "");
    EXPECT_EQ(ForwardTiles(capped), dense) << head_dim;
    ForwardCall segments = WithMask(Call(head_dim, 300, 272));
    segments.segment_ids = true;
    EXPECT_EQ(hopper::DenseUnsupportedReason(segments), "");
    EXPECT_EQ(ForwardTiles(segments), dense) << head_dim;
  }
  EXPECT_EQ(hopper::DenseUnsupportedReason(Call(256, 300, 300)), "");  // neither
}

// The call with a bias of another dtype than the query's: float32, or a 16-bit one converted.
ForwardCall WithBiasF32(ForwardCall c, bool converts = false) {
  c.bias = c.bias_f32 = true;
  c.bias_converts = converts;
  return c;
}

// A float32 bias doubles the tile's bytes: d64 keeps 128-key tiles, d96 to d192 take 64-key
// ones, and d256 has no room for it. The backward takes it from d64 to d128 (at d96/d128 two
// dS^T buffers instead of three, at d64 64-query tiles), converted (a bias of the other 16-bit
// dtype) or not.
TEST(HopperForwardTiles, Float32BiasTakesATileWithRoomForIt) {
  EXPECT_EQ(ForwardTiles(WithBiasF32(Call(64, 4096, 4096))), (Tiles{hopper::kTileDense}));
  for (int64_t head_dim : {96, 128, 192}) {
    const ForwardCall f32 = WithBiasF32(Call(head_dim, 300, 260));  // rows of whole 16-byte units
    EXPECT_EQ(hopper::DenseUnsupportedReason(f32), "") << head_dim;
    EXPECT_EQ(ForwardTiles(f32), (Tiles{hopper::kTileDenseNarrow})) << head_dim;
    EXPECT_EQ(ForwardTiles(Causal(f32)), (Tiles{hopper::kTileDenseNarrow})) << head_dim;
  }
  EXPECT_NE(hopper::DenseUnsupportedReason(WithBiasF32(Call(256, 300, 260))).find("shared memory"),
            std::string::npos);
  for (int64_t head_dim : {64, 96, 128}) {
    EXPECT_EQ(hopper::BackwardDenseUnsupportedReason(WithBiasF32(Call(head_dim, 300, 260))), "") << head_dim;
  }
  for (int64_t head_dim : {192, 256}) {
    EXPECT_NE(hopper::BackwardDenseUnsupportedReason(WithBiasF32(Call(head_dim, 300, 260))).find("shared memory"),
              std::string::npos)
        << head_dim;
  }
  ForwardCall converted = WithBiasF32(Call(128, 300, 256), /*converts=*/true);
  hopper::PlanFold(1, 1, 1, 1, &converted);
  EXPECT_EQ(hopper::DenseUnsupportedReason(converted), "");
  EXPECT_EQ(hopper::BackwardDenseUnsupportedReason(converted), "");
  ForwardCall converted_d192 = WithBiasF32(Call(192, 300, 256), /*converts=*/true);
  hopper::PlanFold(1, 1, 1, 1, &converted_d192);
  EXPECT_NE(hopper::BackwardDenseUnsupportedReason(converted_d192).find("float32"), std::string::npos);
  EXPECT_EQ(hopper::BackwardDenseUnsupportedReason(WithBias(Call(128, 300, 264))), "");
}

// A bias is read as it is where the kernels can: float32 rows of a multiple of 4 elements,
// 16-bit ones of 8. Any other dtype (f16 with bf16 inputs, float64) folds into float32.
TEST(HopperForwardTiles, Float32BiasFoldsWhereItMust) {
  const auto planned = [](ForwardCall c) {
    hopper::PlanFold(2, 3, 1, 1, &c);
    return c;
  };
  EXPECT_EQ(planned(WithBiasF32(Call(128, 300, 260))).folded_batch, 0);
  const ForwardCall odd = planned(WithBiasF32(Call(128, 300, 258)));
  EXPECT_EQ(odd.folded_batch, 2);
  EXPECT_EQ(odd.folded_heads, 3);
  EXPECT_EQ(hopper::FoldedBiasBytes(odd), size_t{2 * 3 * 300 * 264 * 4});
  const ForwardCall converted = planned(WithBiasF32(Call(128, 300, 256), /*converts=*/true));
  EXPECT_EQ(converted.folded_batch, 2);
  EXPECT_EQ(hopper::FoldedBiasBytes(converted), size_t{2 * 3 * 300 * 256 * 4});
  EXPECT_EQ(hopper::DenseUnsupportedReason(converted), "");
  // Unplanned, a conversion cannot be made.
  EXPECT_NE(hopper::DenseUnsupportedReason(WithBiasF32(Call(128, 300, 256), true)).find("unknown shapes"),
            std::string::npos);
  ForwardCall with_mask = WithMask(WithBiasF32(Call(96, 300, 256)));
  hopper::PlanFold(1, 3, 2, 1, &with_mask);  // crossed broadcasts: per row
  EXPECT_TRUE(with_mask.fold_per_row);
  EXPECT_EQ(hopper::FoldedBiasBytes(with_mask), size_t{3 * 300 * 256 * 4});
}

// A bias and a mask fold into one bias: at once where one's batch and head dims cover the
// other's, else per batch row.
TEST(HopperForwardTiles, BiasAndMaskFoldIntoOneBias) {
  int64_t batch = 0, heads = 0;
  bool per_row = true;
  hopper::FoldedShape(4, 8, 1, 8, &batch, &heads, &per_row);  // the bias covers the mask
  EXPECT_EQ(batch, 4);
  EXPECT_EQ(heads, 8);
  EXPECT_FALSE(per_row);
  hopper::FoldedShape(1, 8, 4, 8, &batch, &heads, &per_row);  // the mask covers the bias
  EXPECT_EQ(batch, 4);
  EXPECT_EQ(heads, 8);
  EXPECT_FALSE(per_row);
  hopper::FoldedShape(1, 1, 1, 1, &batch, &heads, &per_row);
  EXPECT_EQ(batch * heads, 1);
  // [1, H] with [B, 1] would fold into [B, H], larger than both: one row at a time.
  hopper::FoldedShape(1, 8, 4, 1, &batch, &heads, &per_row);
  EXPECT_EQ(batch, 1);
  EXPECT_EQ(heads, 8);
  EXPECT_TRUE(per_row);
  hopper::FoldedShape(4, 1, 1, 8, &batch, &heads, &per_row);
  EXPECT_EQ(batch, 1);
  EXPECT_EQ(heads, 8);
  EXPECT_TRUE(per_row);

  for (int64_t head_dim : {64, 96, 128}) {
    ForwardCall both = WithMask(WithBias(Call(head_dim, 300, 264)));  // seqlen_k: a bias's rule only
    both.folded_batch = 2;
    both.folded_heads = 3;
    EXPECT_EQ(hopper::DenseUnsupportedReason(both), "") << head_dim;
    EXPECT_EQ(ForwardTiles(both), (Tiles{hopper::kTileDense})) << head_dim;
    EXPECT_EQ(hopper::FoldedBiasBytes(both), size_t{2 * 3 * 300 * 264 * 2});
  }
  EXPECT_EQ(hopper::FoldedBiasBytes(WithBias(Call(128, 256, 256))), 0u);
}

TEST(HopperForwardTiles, BiasOrMaskTheDenseTileCannotTakeSaysWhy) {
  const auto reason = [](ForwardCall c) { return hopper::DenseUnsupportedReason(c); };
  EXPECT_NE(reason(WithMask(WithBias(Call(128, 256, 256)))).find("unknown shapes"), std::string::npos);
  ForwardCall packed = WithBias(Call(64, 256, 256));
  packed.varlen = true;
  EXPECT_NE(reason(packed).find("packed sequences"), std::string::npos);
  // Rows that are not whole 16-byte units need a fold, which needs the operand's shape.
  EXPECT_NE(reason(WithBias(Call(64, 256, 260))).find("unknown shapes"), std::string::npos);
  EXPECT_NE(reason(WithMask(Call(64, 256, 264))).find("unknown shapes"), std::string::npos);
}

// A bias alone or a mask alone folds where its rows are not whole 16-byte units, into rows
// padded to 8 elements.
TEST(HopperForwardTiles, OddRowsFold) {
  const auto planned = [](ForwardCall c, int64_t batch, int64_t heads) {
    hopper::PlanFold(batch, heads, batch, heads, &c);
    return c;
  };
  const ForwardCall bias_197 = planned(WithBias(Call(64, 197, 197)), 1, 12);
  EXPECT_EQ(bias_197.folded_batch, 1);
  EXPECT_EQ(bias_197.folded_heads, 12);
  EXPECT_FALSE(bias_197.fold_per_row);
  EXPECT_EQ(hopper::DenseUnsupportedReason(bias_197), "");
  EXPECT_EQ(hopper::FoldedBiasBytes(bias_197), size_t{12 * 197 * 200 * 2});
  const ForwardCall mask_264 = planned(WithMask(Call(128, 256, 264)), 2, 1);
  EXPECT_EQ(mask_264.folded_batch, 2);
  EXPECT_EQ(mask_264.folded_heads, 1);
  EXPECT_EQ(hopper::DenseUnsupportedReason(mask_264), "");
  EXPECT_EQ(hopper::FoldedBiasBytes(mask_264), size_t{2 * 256 * 264 * 2});
  // Whole rows read the operand as it is.
  EXPECT_EQ(planned(WithBias(Call(64, 200, 264)), 2, 2).folded_batch, 0);
  EXPECT_EQ(planned(WithMask(Call(64, 200, 272)), 2, 2).folded_batch, 0);
  EXPECT_EQ(hopper::FoldedRowElements(197), 200);
  EXPECT_EQ(hopper::FoldedRowElements(256), 256);
}

TEST(HopperForwardCall, FromParams) {
  ForwardParams p;
  p.causal = true;
  p.window_left = 64;
  p.logits_soft_cap = 30.0f;
  int32_t ids[4] = {0, 0, 1, 1};
  p.q_segment_ids = TensorView::Contiguous(ids, DType::kI32, {1, 4});
  Dims d{};
  d.head_dim = 96;
  d.seqlen_q = 300;
  d.seqlen_k = 400;
  d.varlen = false;
  const ForwardCall c = hopper::ForwardCallOf(p, d);
  EXPECT_EQ(c.head_dim, 96);
  EXPECT_EQ(c.seqlen_q, 300);
  EXPECT_EQ(c.seqlen_k, 400);
  EXPECT_TRUE(c.causal && c.soft_cap && c.segment_ids);
  EXPECT_FALSE(c.varlen);
  EXPECT_EQ(c.window_left, 64);
  EXPECT_EQ(c.window_right, -1);
  p.logits_soft_cap = 0.0f;
  p.q_segment_ids = TensorView();
  EXPECT_FALSE(hopper::ForwardCallOf(p, d).soft_cap || hopper::ForwardCallOf(p, d).segment_ids);
  EXPECT_FALSE(c.bias || c.mask);
  uint16_t q_data[1] = {}, bias_data[1] = {};
  uint8_t mask_data[1] = {};
  p.q = TensorView::Contiguous(q_data, DType::kBF16, {1, 1, 1, 1});
  p.bias = TensorView::Contiguous(bias_data, DType::kBF16, {1, 1, 1, 1});
  p.mask = TensorView::Contiguous(mask_data, DType::kBool, {1, 1, 1, 1});
  ForwardCall dense = hopper::ForwardCallOf(p, d);
  EXPECT_TRUE(dense.bias && dense.mask && !dense.bias_f32 && !dense.bias_converts);
  EXPECT_EQ(dense.folded_batch, 1);
  EXPECT_EQ(dense.folded_heads, 1);
  EXPECT_FALSE(dense.fold_per_row);
  p.bias.shape[1] = 5;  // [1, 5] with [3, 1]: per batch row
  p.mask.shape[0] = 3;
  EXPECT_TRUE(hopper::ForwardCallOf(p, d).fold_per_row);
  EXPECT_EQ(hopper::ForwardCallOf(p, d).folded_batch, 1);
  p.mask.shape[1] = 5;  // [3, 5] covers [1, 5]
  EXPECT_FALSE(hopper::ForwardCallOf(p, d).fold_per_row);
  EXPECT_EQ(hopper::ForwardCallOf(p, d).folded_batch, 3);
  EXPECT_EQ(hopper::ForwardCallOf(p, d).folded_heads, 5);
  p.bias.dtype = DType::kF16;
  EXPECT_TRUE(hopper::ForwardCallOf(p, d).bias_f32 && hopper::ForwardCallOf(p, d).bias_converts);
  p.bias.dtype = DType::kF32;
  EXPECT_TRUE(hopper::ForwardCallOf(p, d).bias_f32);
  EXPECT_FALSE(hopper::ForwardCallOf(p, d).bias_converts);
}

TEST(KernelHeadDim, MultiplesOf8RunOnTheNextBuiltHeadDim) {
  EXPECT_EQ(KernelHeadDim(8), 64);
  EXPECT_EQ(KernelHeadDim(40), 64);
  EXPECT_EQ(KernelHeadDim(64), 64);
  EXPECT_EQ(KernelHeadDim(72), 96);
  EXPECT_EQ(KernelHeadDim(80), 96);
  EXPECT_EQ(KernelHeadDim(96), 96);
  EXPECT_EQ(KernelHeadDim(104), 128);
  EXPECT_EQ(KernelHeadDim(136), 192);
  EXPECT_EQ(KernelHeadDim(200), 256);
  EXPECT_EQ(KernelHeadDim(256), 256);
  // Rows of the call's head dim must be whole 16-byte units; none is built past 256.
  for (const int64_t d : {0, -8, 4, 36, 100, 250, 264, 512}) EXPECT_EQ(KernelHeadDim(d), 0) << d;
}

TEST(HopperForwardCall, TakesTheKernelsHeadDim) {
  ForwardParams p;
  Dims d{};
  d.seqlen_q = d.seqlen_k = 256;
  for (const auto& [call_dim, kernel_dim] : {std::pair<int64_t, int64_t>{80, 96}, {40, 64}, {160, 192}, {36, 0}}) {
    d.head_dim = call_dim;
    const ForwardCall c = hopper::ForwardCallOf(p, d);
    EXPECT_EQ(c.head_dim, kernel_dim) << call_dim;
    EXPECT_EQ(ForwardTiles(c).empty(), kernel_dim == 0) << call_dim;
  }
}

TEST(HopperForwardCall, WindowSidesAndBands) {
  int left, right;
  hopper::WindowSides(Causal(Call(128, 100, 150)), &left, &right);
  EXPECT_EQ(left, 251);  // unbounded: Sq + Sk + 1
  EXPECT_EQ(right, 0);
  hopper::WindowSides(Causal(Window(Call(128, 100, 150), 10, 5)), &left, &right);
  EXPECT_EQ(left, 10);
  EXPECT_EQ(right, 0);  // causal hides what a right side would show
  hopper::WindowSides(Window(Call(128, 100, 150), 1000000, 5), &left, &right);
  EXPECT_EQ(left, 251);
  EXPECT_EQ(right, 5);
  EXPECT_TRUE(hopper::IsBand(1024, 0, 16384));
  EXPECT_TRUE(hopper::IsBand(255, 0, 1024));  // 4 x 256 keys fit
  EXPECT_FALSE(hopper::IsBand(256, 0, 1024));
  EXPECT_TRUE(hopper::CausalOrWindow(Window(Call(64, 8, 8), -1, 0)));
  EXPECT_FALSE(hopper::CausalOrWindow(Call(64, 8, 8)));
  EXPECT_TRUE(hopper::ShortCall(Causal(Call(64, 1024, 1024)), 1024, 1024));
  EXPECT_FALSE(hopper::ShortCall(Causal(Call(64, 1024, 1025)), 1024, 1024));
  EXPECT_FALSE(hopper::ShortCall(Window(Call(64, 1024, 1024), 255, 0), 1024, 1024));
}

}  // namespace
}  // namespace ejk::flash_attention
