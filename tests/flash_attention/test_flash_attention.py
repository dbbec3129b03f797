"""Flash attention implementations against the materialised float64 reference.

Accuracy: an implementation's error (against float64) may be at most twice the error of the
materialised reference evaluated in the input dtype, plus a floor of about 1e-6 relative.
Inputs are fresh random draws every run; the seed is printed for reproduction.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from reference import attention_reference, dropout_keep_mask, dropout_threshold, fmix32, reference_grads

# Packed sequences, as (cum_seqlens_q, cum_seqlens_k, packed rows, packed keys).
# (q, k) lengths (20, 30), (0, 7), (1, 1), (9, 0), (20, 22); then padding rows 50..56 and
# padding keys 60..63.
VARLEN = ((0, 20, 20, 21, 30, 50), (0, 30, 37, 38, 38, 60), 57, 64)
# Several tiles of the CUDA kernels per sequence, tiles shared by neighbours: (q, k) lengths
# (150, 200), (0, 5), (1, 1), (77, 0), (260, 300); then padding rows 488..499 and padding
# keys 506..519.
VARLEN_TILES = ((0, 150, 150, 151, 228, 488), (0, 200, 205, 206, 206, 506), 500, 520)


def _packed(q_lengths: list[int], k_lengths: list[int], pad_q: int, pad_k: int) -> tuple:
    """A packed layout (VARLEN's form) of these lengths, with pad_q rows and pad_k keys after."""
    cu_q, cu_k = np.cumsum([0, *q_lengths]), np.cumsum([0, *k_lengths])
    return tuple(map(int, cu_q)), tuple(map(int, cu_k)), int(cu_q[-1]) + pad_q, int(cu_k[-1]) + pad_k


# Forty short sequences (0-5 queries, 0-4 keys) between two long ones: more sequences share a
# query tile than a warp has lanes. Rows 0..129, 130..224 (the short ones), 225..524, then 7
# padding rows; keys likewise with 170 and 280 and 5 padding keys.
VARLEN_MANY = _packed([130, *([1, 3, 0, 2, 5, 1, 4, 3] * 5), 300], [170, *([2, 1, 3, 0, 4, 1, 2, 2] * 5), 280], 7, 5)

DIFFERENTIABLE = ("query", "key", "value", "bias", "softmax_aux")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int = 2
    seq_q: int = 67
    seq_k: int = 67
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = False
    window: tuple[int, int] | None = None
    soft_cap: float | None = None
    sinks: bool = False
    bias: str | None = None  # broadcast form: "BH", "B1", "1H" or "11"
    bias_dtype: str | None = None  # default: the input dtype
    bias_constant: bool = False  # no gradient taken for the bias (a call without dbias)
    mask: str | None = None  # broadcast form, like bias
    # True: sorted ids (packed documents); "shuffled": ids in any order; "padding": key padding
    segments: bool | str = False
    varlen: tuple | None = None  # a packed layout: VARLEN or VARLEN_TILES
    dropout: float = 0.0
    deterministic: bool = False
    key_ramp: bool = False  # keys scaled from 4x (first) down to 1/4 (last): a row's max grows in jumps

    def features(self) -> list[str]:
        flags = {
            "causal": self.causal,
            "sliding_window": self.window is not None,
            "logits_soft_cap": self.soft_cap is not None,
            "softmax_aux": self.sinks,
            "bias": self.bias is not None,
            "attention_mask": self.mask is not None,
            "cum_seqlens": self.varlen is not None,
            "segment_ids": self.segments,
            "dropout": self.dropout > 0,
            "gqa": self.q_heads != self.kv_heads,
            "deterministic_backward": self.deterministic,
        }
        return [name for name, on in flags.items() if on]


# Each feature alone, then together; shapes, dtypes and GQA ratios vary across the cases.
CASES = [
    Case("plain_mha"),
    Case("plain_bf16_gqa4_d128_sq>sk", dtype="bfloat16", batch=1, seq_q=131, kv_heads=1, head_dim=128),
    Case("causal"),
    Case("causal_sq>sk_d128", batch=1, causal=True, seq_q=131, head_dim=128),  # rows that see nothing
    Case("causal_bf16_sq<sk_gqa4", dtype="bfloat16", batch=1, causal=True, seq_k=131, kv_heads=1),
    Case("window_left", window=(16, -1)),
    Case("window_right", window=(-1, 8), seq_k=100, q_heads=2, kv_heads=1),
    Case("window_both_sq>sk", window=(8, 8), seq_q=100),
    Case("causal_window_257", batch=1, causal=True, window=(24, -1), seq_q=257, seq_k=257, q_heads=2, kv_heads=1),
    Case("soft_cap_bf16_d256", dtype="bfloat16", soft_cap=4.0, batch=1, seq_q=40, seq_k=45, q_heads=2, kv_heads=1,
         head_dim=256),
    Case("sinks", sinks=True),
    Case("sinks_causal_sq>sk", sinks=True, causal=True, seq_q=100, seq_k=40),
    Case("bias_11_mha", bias="11", kv_heads=4),
    Case("bias_B1_bf16", bias="B1", dtype="bfloat16"),
    Case("bias_1H_f16_d256", bias="1H", dtype="float16", batch=1, seq_q=33, seq_k=70, q_heads=2, head_dim=256),
    Case("bias_BH_f32_with_bf16", dtype="bfloat16", bias="BH", bias_dtype="float32", kv_heads=1),
    Case("mask_BH", mask="BH"),
    Case("mask_11_f16_gqa4", mask="11", dtype="float16", kv_heads=1),
    Case("segments", segments=True),
    Case("varlen", varlen=VARLEN),
    Case("dropout", dropout=0.3),
    Case("dropout_causal_bias_gqa4", dropout=0.2, causal=True, bias="1H", kv_heads=1),
    Case("everything_bf16", dtype="bfloat16", causal=True, window=(40, -1), soft_cap=6.0, sinks=True,
         bias="B1", mask="1H", segments=True, dropout=0.1, seq_q=70, seq_k=90),
    Case("everything_varlen", varlen=VARLEN, causal=True, window=(12, 2), soft_cap=5.0, sinks=True,
         bias="1H", mask="11", dropout=0.15, kv_heads=1),
    # A bias and a mask over several tiles of the CUDA kernels, which read a fragment's adjacent
    # keys as one word where the keys are even in number and the pair starts even: packed
    # sequences starting at odd keys (VARLEN_TILES' third), a float32 bias (8-byte pairs).
    Case("varlen_tiles_bias_mask_deterministic_bf16", dtype="bfloat16", varlen=VARLEN_TILES, causal=True,
         bias="1H", mask="11", deterministic=True, q_heads=2, kv_heads=1, head_dim=128),
    Case("tiles_bias_f32_mask_f16_even_keys", dtype="float16", batch=2, seq_q=301, seq_k=260, q_heads=4,
         kv_heads=2, bias="BH", bias_dtype="float32", mask="B1", deterministic=True),
    # Several tiles of the CUDA kernels (128 x 64 and up), odd lengths, every head dim.
    Case("tiles_causal_d96_sq<sk", dtype="bfloat16", batch=1, seq_q=300, seq_k=517, q_heads=2, kv_heads=1, head_dim=96, causal=True),
    Case("tiles_window_d192_f16", dtype="float16", batch=1, seq_q=333, seq_k=333, q_heads=2, kv_heads=2,
         head_dim=192, window=(70, 5)),
    Case("tiles_d256_bf16_sinks_gqa", dtype="bfloat16", batch=1, seq_q=200, seq_k=259, q_heads=4, kv_heads=1,
         head_dim=256, sinks=True, causal=True),
    # The Hopper backward at d=256: 64-key blocks, GQA over several blocks and query tiles.
    Case("tiles_d256_f16_gqa_sq>sk", dtype="float16", batch=2, seq_q=201, seq_k=150, q_heads=4, kv_heads=2,
         head_dim=256),
    Case("tiles_d256_bf16_window_both", dtype="bfloat16", batch=1, seq_q=259, seq_k=259, q_heads=2, kv_heads=1,
         head_dim=256, window=(70, 9), soft_cap=7.0),
    # Dropout on the Hopper kernels, which hash each element's packed indices in both
    # directions: every head dim, tiles cut by masks, packed sequences, GQA, deterministic.
    Case("tiles_dropout_causal_bf16_d64_gqa", dtype="bfloat16", batch=2, seq_q=300, seq_k=300, q_heads=4,
         kv_heads=2, causal=True, dropout=0.2),
    Case("tiles_dropout_window_softcap_sinks_f16_d128_sq>sk", dtype="float16", batch=1, seq_q=259, seq_k=200,
         q_heads=2, kv_heads=1, head_dim=128, window=(50, 10), soft_cap=6.0, sinks=True, dropout=0.3),
    Case("tiles_dropout_varlen_causal_bf16_d128", dtype="bfloat16", varlen=VARLEN_TILES, causal=True, q_heads=2,
         kv_heads=1, head_dim=128, dropout=0.15),
    Case("tiles_dropout_d96_f16_sq<sk", dtype="float16", batch=1, seq_q=130, seq_k=333, q_heads=2, kv_heads=2,
         head_dim=96, dropout=0.25),
    Case("tiles_dropout_d192_bf16_causal", dtype="bfloat16", batch=1, seq_q=200, seq_k=200, q_heads=2,
         kv_heads=1, head_dim=192, causal=True, dropout=0.1),
    Case("tiles_dropout_d256_deterministic_bf16_gqa", dtype="bfloat16", batch=2, seq_q=201, seq_k=150, q_heads=4,
         kv_heads=2, head_dim=256, dropout=0.1, deterministic=True),
    Case("tiles_dropout_segments_causal_bf16_d128_gqa", dtype="bfloat16", batch=2, seq_q=300, seq_k=300, q_heads=4,
         kv_heads=2, head_dim=128, causal=True, segments=True, dropout=0.2),
    Case("tiles_dropout_segments_shuffled_deterministic_f16_d64_sq<sk", dtype="float16", batch=2, seq_q=200,
         seq_k=333, segments="shuffled", dropout=0.3, deterministic=True),
    # Dropout with a bias or a mask on the Hopper kernels (the dense kernels hash too): a bias of
    # the inputs' dtype with its gradient or without, a mask read as it is (keys a multiple of
    # 16) or folded, and a bias with a mask folded into one.
    Case("tiles_dropout_bias_causal_bf16_d64_gqa", dtype="bfloat16", batch=2, seq_q=300, seq_k=300, q_heads=4,
         kv_heads=2, causal=True, bias="1H", dropout=0.2),
    Case("tiles_dropout_mask_window_f16_d128_sq>sk", dtype="float16", batch=2, seq_q=259, seq_k=320, q_heads=2,
         kv_heads=1, head_dim=128, window=(90, 20), mask="B1", dropout=0.3),
    Case("tiles_dropout_bias_mask_deterministic_bf16_d128", dtype="bfloat16", batch=2, seq_q=301, seq_k=203,
         q_heads=2, kv_heads=2, head_dim=128, bias="BH", mask="11", dropout=0.15, deterministic=True),
    Case("tiles_dropout_constant_bias_causal_f16_d256", dtype="float16", batch=1, seq_q=200, seq_k=200, q_heads=2,
         kv_heads=1, head_dim=256, causal=True, bias="11", bias_constant=True, dropout=0.1),
    # d64's mask with dropout takes 64-query backward tiles (the head dim 40 call runs on d64's
    # kernels).
    Case("tiles_dropout_mask_causal_bf16_d64_gqa", dtype="bfloat16", batch=2, seq_q=301, seq_k=320, q_heads=4,
         kv_heads=2, causal=True, mask="B1", dropout=0.2),
    Case("tiles_dropout_mask_deterministic_f16_d40", dtype="float16", batch=2, seq_q=200, seq_k=272, q_heads=2,
         kv_heads=2, head_dim=40, mask="BH", dropout=0.3, deterministic=True),
    Case("tiles_dropout_mask_bf16_d192_sinks", dtype="bfloat16", batch=1, seq_q=150, seq_k=272, q_heads=2,
         kv_heads=2, head_dim=192, mask="BH", sinks=True, dropout=0.25),
    Case("tiles_dropout_bias_deterministic_f16_d96", dtype="float16", batch=2, seq_q=130, seq_k=264, q_heads=2,
         kv_heads=1, head_dim=96, bias="BH", dropout=0.2, deterministic=True),
    # A float32 bias with dropout: d64's 64-query backward tiles, d128 deterministic, and d192,
    # whose backward with a float32 bias runs on mma.sync after the Hopper forward.
    Case("tiles_dropout_bias_f32_causal_bf16_d64_gqa", dtype="bfloat16", batch=2, seq_q=300, seq_k=296, q_heads=4,
         kv_heads=2, causal=True, bias="1H", bias_dtype="float32", dropout=0.2),
    Case("tiles_dropout_bias_f32_deterministic_f16_d128", dtype="float16", batch=2, seq_q=201, seq_k=260, q_heads=2,
         kv_heads=2, head_dim=128, bias="BH", bias_dtype="float32", dropout=0.3, deterministic=True),
    Case("tiles_dropout_bias_f32_window_bf16_d192", dtype="bfloat16", batch=1, seq_q=259, seq_k=200, q_heads=2,
         kv_heads=1, head_dim=192, window=(60, 4), bias="11", bias_dtype="float32", dropout=0.15),
    # Dropout on calls the Hopper kernels run one batch row at a time, each row hashed as its own
    # batch index: a bias and a mask whose broadcasts cross ([1, H] with [B, 1]), and in
    # deterministic mode the gradient of a bias broadcast over the batch (a row's grid, kv heads
    # x 128-key blocks, fills the GPU).
    Case("tiles_dropout_bias_mask_per_row_causal_sinks_bf16_d128_gqa", dtype="bfloat16", batch=3, seq_q=259,
         seq_k=264, q_heads=4, kv_heads=2, head_dim=128, causal=True, sinks=True, bias="1H", mask="B1",
         dropout=0.2),
    Case("tiles_dropout_bias_mask_per_row_odd_keys_deterministic_f16_d96", dtype="float16", batch=2, seq_q=131,
         seq_k=197, q_heads=2, kv_heads=1, head_dim=96, window=(60, 10), bias="1H", mask="B1", dropout=0.3,
         deterministic=True),
    Case("tiles_dropout_deterministic_dbias_over_batch_causal_gqa_f16_d64", dtype="float16", batch=3, seq_q=200,
         seq_k=2100, q_heads=16, kv_heads=8, causal=True, bias="1H", dropout=0.15, deterministic=True),
    # Dropout with segment ids and a bias or a mask on the Hopper kernels: a bias with a key
    # padding mask (the mask becomes segment ids), ids in any order with a mask read as it is,
    # a float32 bias, and a bias and a mask folded per batch row.
    Case("tiles_dropout_segments_padding_bias_causal_bf16_d64_gqa", dtype="bfloat16", batch=3, seq_q=300,
         seq_k=300, q_heads=4, kv_heads=2, causal=True, segments="padding", bias="1H", dropout=0.1),
    Case("tiles_dropout_segments_shuffled_mask_deterministic_f16_d128_sq>sk", dtype="float16", batch=2,
         seq_q=270, seq_k=192, q_heads=2, kv_heads=1, head_dim=128, segments="shuffled", mask="B1", dropout=0.2,
         deterministic=True),
    Case("tiles_dropout_segments_bias_f32_window_bf16_d96", dtype="bfloat16", batch=2, seq_q=259, seq_k=264,
         q_heads=2, kv_heads=2, head_dim=96, window=(70, 9), segments=True, bias="BH", bias_dtype="float32",
         dropout=0.25),
    Case("tiles_dropout_segments_bias_mask_per_row_sinks_f16_d256", dtype="float16", batch=2, seq_q=200,
         seq_k=200, q_heads=2, kv_heads=1, head_dim=256, sinks=True, segments=True, bias="1H", mask="B1",
         dropout=0.15),
    # Head dims between built ones run on the next built head dim's kernels (80 -> 96, 40 -> 64,
    # 160 -> 192), which read the columns past the call's as zeros and store none of them.
    Case("tiles_d80_bf16_causal_gqa", dtype="bfloat16", batch=2, seq_q=300, seq_k=300, q_heads=4, kv_heads=2,
         head_dim=80, causal=True, sinks=True),
    Case("tiles_d40_f16_bias_dropout", dtype="float16", batch=2, seq_q=200, seq_k=264, q_heads=2,
         kv_heads=1, head_dim=40, bias="1H", dropout=0.1),
    Case("tiles_d160_bf16_window_deterministic", dtype="bfloat16", batch=1, seq_q=259, seq_k=259,
         q_heads=2, kv_heads=2, head_dim=160, window=(70, 9), deterministic=True),
    # The same on the mma.sync kernels: dropout with a bias and a soft cap (72 -> 96), a float32
    # bias at 232 (-> 256, which neither Hopper direction takes), a bias with packed sequences
    # (112 -> 128).
    Case("tiles_d72_bf16_dropout_bias_soft_cap", dtype="bfloat16", batch=2, seq_q=150, seq_k=190, q_heads=4,
         kv_heads=2, head_dim=72, bias="B1", soft_cap=8.0, dropout=0.15),
    Case("tiles_d232_f16_bias_f32_deterministic", dtype="float16", batch=1, seq_q=140, seq_k=203, q_heads=2,
         kv_heads=1, head_dim=232, causal=True, bias="1H", bias_dtype="float32", deterministic=True),
    Case("tiles_d112_bf16_varlen_bias", dtype="bfloat16", varlen=VARLEN_TILES, q_heads=2, kv_heads=1, head_dim=112,
         causal=True, bias="11"),
    # Dropout on mma.sync with packed sequences whose keys start at multiples of 16 and
    # elsewhere (rows hashing once per pair of keys and once per key) under a window.
    Case("tiles_d64_f16_varlen_bias_dropout_window", dtype="float16", varlen=VARLEN_TILES, q_heads=2, kv_heads=1,
         head_dim=64, window=(45, 7), bias="11", dropout=0.2),
    # A head dim that is not a multiple of 8 is zero-padded to one (36 -> 40) before the call.
    Case("tiles_d36_padded_bf16_soft_cap", dtype="bfloat16", batch=2, seq_q=131, seq_k=200, q_heads=2, kv_heads=1,
         head_dim=36, causal=True, soft_cap=5.0),
    # The Hopper forward visits key tiles last to first, so with the first keys the largest a
    # row's running max keeps rising: by more than the d256 kernel's slack (its O rescaled)
    # and by less (the stale max kept).
    Case("tiles_d256_bf16_growing_max", dtype="bfloat16", batch=1, seq_q=259, seq_k=400, q_heads=2, kv_heads=1,
         head_dim=256, key_ramp=True),
    Case("tiles_d256_f16_growing_max_causal_sinks", dtype="float16", batch=2, seq_q=300, seq_k=300, q_heads=2,
         kv_heads=2, head_dim=256, causal=True, sinks=True, key_ramp=True),
    # 1104 keys = six 176-key tiles of the Hopper kernel + a last tile of 48 (computed narrow);
    # 400 keys (at most 1024: 128-key tiles) = three + a last tile of 16.
    Case("tiles_d128_partial_last_key_tile", dtype="bfloat16", batch=1, seq_q=300, seq_k=1104, q_heads=4, kv_heads=2,
         head_dim=128, sinks=True),
    Case("tiles_d128_short_partial_last_key_tile", dtype="float16", batch=2, seq_q=300, seq_k=400, q_heads=4,
         kv_heads=2, head_dim=128),
    # More causal query tiles than an H100 has multiprocessors, three per head: the Hopper
    # forward's persistent blocks take several pairs of tiles, and each head's middle tile alone.
    Case("tiles_d128_causal_pairs", dtype="bfloat16", batch=17, seq_q=300, seq_k=300, q_heads=4, kv_heads=2,
         head_dim=128, causal=True),
    # The same at d64 (128-row tiles in pairs for causal calls of up to 1024 queries), with and
    # without a soft cap; past 1024 queries the three-warpgroup kernel (192-row tiles).
    Case("tiles_d64_causal_pairs", dtype="bfloat16", batch=9, seq_q=300, seq_k=300, q_heads=8, kv_heads=2,
         causal=True),
    Case("tiles_d64_causal_pairs_f16_soft_cap_sinks", dtype="float16", batch=2, seq_q=1000, seq_k=1000, q_heads=2,
         kv_heads=1, causal=True, soft_cap=5.0, sinks=True),
    Case("tiles_d64_causal_gqa_1100", dtype="bfloat16", batch=1, seq_q=1100, seq_k=1100, q_heads=4, kv_heads=2,
         causal=True),
    # A window with keys on both sides, Sq < Sk: the first query rows' last key tile is partial.
    Case("tiles_d128_window_both_sq<sk", dtype="bfloat16", batch=2, seq_q=260, seq_k=300, q_heads=4, kv_heads=2,
         head_dim=128, window=(150, 30)),
    # A band three key tiles wide: the second warpgroup's rows see only the upper keys of the
    # last key tile visited (or none of them), which it computes narrow.
    Case("tiles_d128_band_f16", dtype="float16", batch=1, seq_q=1100, seq_k=1100, q_heads=2, kv_heads=1,
         head_dim=128, causal=True, window=(250, -1)),
    # Packed sequences on the Hopper backward: query tiles shared by neighbouring sequences,
    # partial key blocks, keys or queries of a sequence alone, padding rows and keys.
    Case("varlen_tiles_causal_bf16_d128_gqa", dtype="bfloat16", varlen=VARLEN_TILES, q_heads=4, kv_heads=2,
         head_dim=128, causal=True),
    Case("varlen_tiles_f16_d128_sinks", dtype="float16", varlen=VARLEN_TILES, q_heads=2, kv_heads=2, head_dim=128,
         sinks=True),
    Case("varlen_tiles_window_bf16_d256_gqa_sinks", dtype="bfloat16", varlen=VARLEN_TILES, q_heads=4, kv_heads=1,
         head_dim=256, window=(90, 20), sinks=True),
    Case("varlen_tiles_causal_f16_d256_soft_cap", dtype="float16", varlen=VARLEN_TILES, q_heads=2, kv_heads=2,
         head_dim=256, causal=True, soft_cap=6.0),
    Case("varlen_tiles_window_bf16_d64_gqa", dtype="bfloat16", varlen=VARLEN_TILES, q_heads=4, kv_heads=2,
         window=(-1, 30)),
    Case("tiles_d128_deterministic", dtype="bfloat16", batch=2, seq_q=257, seq_k=190, q_heads=4, kv_heads=2,
         head_dim=128, bias="1H", deterministic=True),
    # The deterministic Hopper backward: key blocks add into each dQ tile in a fixed order, the
    # last first (up to 9 blocks per tile), with causal, unmasked and windowed walks, every
    # way of splitting a block between the consumer warpgroups, and segment ids (no tiles
    # skipped in this mode).
    Case("tiles_d128_deterministic_causal_gqa", dtype="bfloat16", batch=1, seq_q=1100, seq_k=1100, q_heads=4,
         kv_heads=2, head_dim=128, causal=True, deterministic=True),
    Case("tiles_d64_deterministic_f16_sq>sk", dtype="float16", batch=2, seq_q=700, seq_k=650, q_heads=2,
         kv_heads=1, deterministic=True),
    Case("tiles_d256_deterministic_window_soft_cap_sinks", dtype="bfloat16", batch=1, seq_q=400, seq_k=450,
         q_heads=2, kv_heads=1, head_dim=256, window=(150, 40), soft_cap=6.0, sinks=True, deterministic=True),
    Case("tiles_d96_deterministic_f16_segments", dtype="float16", batch=2, seq_q=300, seq_k=300, q_heads=2,
         kv_heads=2, head_dim=96, causal=True, segments=True, deterministic=True),
    Case("tiles_d192_deterministic_gqa", dtype="bfloat16", batch=1, seq_q=333, seq_k=520, q_heads=4, kv_heads=1,
         head_dim=192, deterministic=True),
    # A bias or mask alone on the Hopper kernels (bias of the input dtype): its tile per key or
    # query tile through shared memory,
    # broadcast over batch and heads, causal and window masks on top. The Hopper backward takes
    # a mask, and a bias at d96/d128, with its gradient (stored once per element, or summed
    # over a broadcast batch or heads) or without.
    Case("tiles_bias_hopper_causal_bf16_d128_gqa", dtype="bfloat16", batch=2, seq_q=300, seq_k=264, q_heads=4,
         kv_heads=2, head_dim=128, causal=True, bias="BH", bias_constant=True),
    Case("tiles_bias_hopper_dbias_bf16_d128", dtype="bfloat16", batch=1, seq_q=200, seq_k=264, q_heads=2,
         kv_heads=2, head_dim=128, bias="1H"),
    Case("tiles_bias_hopper_dbias_f16_d96_causal_gqa", dtype="float16", batch=2, seq_q=200, seq_k=136, q_heads=4,
         kv_heads=2, head_dim=96, causal=True, bias="BH"),
    Case("tiles_bias_hopper_dbias_bf16_d128_mqa_window", dtype="bfloat16", batch=2, seq_q=130, seq_k=200, q_heads=4,
         kv_heads=1, head_dim=128, window=(60, 10), bias="B1"),
    Case("tiles_bias_hopper_f16_d96_sinks_sq>sk", dtype="float16", batch=2, seq_q=260, seq_k=136, q_heads=2,
         kv_heads=1, head_dim=96, bias="B1", sinks=True, bias_constant=True),
    Case("tiles_bias_hopper_bf16_d64_window", dtype="bfloat16", batch=1, seq_q=333, seq_k=400, q_heads=4,
         kv_heads=2, window=(100, 20), bias="11"),
    Case("tiles_mask_hopper_f16_d64_window_sinks", dtype="float16", batch=1, seq_q=333, seq_k=400, q_heads=2,
         kv_heads=1, window=(100, 20), mask="1H", sinks=True),
    Case("tiles_mask_hopper_bf16_d128", dtype="bfloat16", batch=2, seq_q=200, seq_k=272, q_heads=4, kv_heads=2,
         head_dim=128, mask="BH"),
    Case("tiles_mask_hopper_causal_f16_d128_sq<sk", dtype="float16", batch=1, seq_q=150, seq_k=400, q_heads=2,
         kv_heads=1, head_dim=128, causal=True, mask="B1"),
    # An operand broadcast over the batch alone: the forward numbers its tiles batch-minor.
    Case("tiles_mask_hopper_1H_causal_gqa_bf16_d128", dtype="bfloat16", batch=3, seq_q=300, seq_k=272, q_heads=4,
         kv_heads=2, head_dim=128, causal=True, mask="1H"),
    Case("tiles_bias_hopper_1H_window_f16_d192", dtype="float16", batch=3, seq_q=200, seq_k=264, q_heads=2,
         kv_heads=1, head_dim=192, window=(60, 10), bias="1H"),
    # A bias of another dtype than the inputs' on the Hopper forward, as a float32 tile (64-key
    # tiles from d96, 128-key ones at d64): read as it is (float32, keys a multiple of 4), or
    # folded into float32 (odd keys, a 16-bit bias of the other type, with a mask, per batch
    # row where broadcasts cross); with segment ids. d256 runs it on mma.sync. The backward
    # takes a float32 bias at d96/d128 (two dS^T buffers) and at d64 (64-query tiles, the
    # warpgroups' dQ halves exchanged), with its gradient stored or summed, deterministic or not.
    Case("tiles_bias_f32_hopper_causal_gqa_bf16_d128", dtype="bfloat16", batch=2, seq_q=300, seq_k=260, q_heads=4,
         kv_heads=2, head_dim=128, causal=True, bias="BH", bias_dtype="float32"),
    Case("tiles_bias_f32_hopper_odd_keys_softcap_f16_d64", dtype="float16", batch=3, seq_q=333, seq_k=197, q_heads=4,
         kv_heads=1, soft_cap=5.0, bias="1H", bias_dtype="float32"),
    Case("tiles_bias_f16_hopper_window_mask_bf16_d192", dtype="bfloat16", batch=2, seq_q=200, seq_k=264, q_heads=2,
         kv_heads=1, head_dim=192, window=(60, 10), bias="1H", bias_dtype="float16", mask="B1"),
    Case("tiles_bias_f32_hopper_segments_sinks_f16_d96", dtype="float16", batch=2, seq_q=260, seq_k=136, q_heads=2,
         kv_heads=2, head_dim=96, segments=True, sinks=True, bias="B1", bias_dtype="float32"),
    Case("tiles_bias_f32_hopper_deterministic_softcap_bf16_d128", dtype="bfloat16", batch=2, seq_q=260, seq_k=200,
         q_heads=4, kv_heads=2, head_dim=128, soft_cap=5.0, bias="BH", bias_dtype="float32", deterministic=True),
    Case("tiles_bias_f32_hopper_deterministic_causal_gqa_bf16_d64", dtype="bfloat16", batch=2, seq_q=333,
         seq_k=264, q_heads=4, kv_heads=2, causal=True, bias="BH", bias_dtype="float32", deterministic=True),
    Case("tiles_bias_f32_hopper_segments_window_f16_d64", dtype="float16", batch=2, seq_q=200, seq_k=264,
         q_heads=2, kv_heads=1, window=(60, 10), segments=True, bias="B1", bias_dtype="float32"),
    # A bias of the other 16-bit dtype with a plane per (batch, head): its gradient is written
    # in its own dtype (Hopper backward up to d128, converted; mma.sync at d192).
    Case("tiles_bias_f16_hopper_dbias_causal_gqa_bf16_d128", dtype="bfloat16", batch=2, seq_q=200, seq_k=264,
         q_heads=4, kv_heads=2, head_dim=128, causal=True, bias="BH", bias_dtype="float16"),
    Case("tiles_bias_bf16_mma_dbias_window_f16_d192", dtype="float16", batch=1, seq_q=130, seq_k=200, q_heads=2,
         kv_heads=1, head_dim=192, window=(60, 10), bias="BH", bias_dtype="bfloat16"),
    Case("tiles_bias_f32_mma_bf16_d256", dtype="bfloat16", batch=1, seq_q=130, seq_k=136, q_heads=2, kv_heads=1,
         head_dim=256, bias="11", bias_dtype="float32"),
    # At d192 and d256 the Hopper forward takes 64-key tiles (a mask's tile reads half of a
    # 128-key box), the backward loads each query tile's into its P^T buffer. Folded operands,
    # segment ids, the bias's gradient (stores, sums over the batch or the heads), and
    # deterministic mode too.
    Case("tiles_bias_hopper_causal_gqa_bf16_d256", dtype="bfloat16", batch=1, seq_q=300, seq_k=264, q_heads=4,
         kv_heads=2, head_dim=256, causal=True, bias="BH"),
    Case("tiles_mask_hopper_window_f16_d192", dtype="float16", batch=1, seq_q=333, seq_k=400, q_heads=2,
         kv_heads=1, head_dim=192, window=(100, 20), mask="1H"),
    Case("tiles_bias_mask_hopper_per_row_softcap_bf16_d192", dtype="bfloat16", batch=2, seq_q=131, seq_k=200,
         q_heads=2, kv_heads=1, head_dim=192, soft_cap=5.0, bias="1H", mask="B1"),
    Case("tiles_mask_hopper_segments_sinks_f16_d256", dtype="float16", batch=2, seq_q=200, seq_k=304, q_heads=2,
         kv_heads=2, head_dim=256, segments=True, sinks=True, mask="BH"),
    Case("tiles_bias_hopper_odd_keys_f16_d256", dtype="float16", batch=1, seq_q=99, seq_k=197, q_heads=2,
         kv_heads=1, head_dim=256, bias="11"),
    Case("tiles_bias_hopper_mqa_window_f16_d192", dtype="float16", batch=2, seq_q=200, seq_k=136, q_heads=4,
         kv_heads=1, head_dim=192, window=(60, 10), bias="B1"),
    Case("tiles_bias_hopper_deterministic_softcap_bf16_d256", dtype="bfloat16", batch=1, seq_q=260, seq_k=136,
         q_heads=2, kv_heads=1, head_dim=256, soft_cap=5.0, bias="BH", deterministic=True),
    # The same in deterministic mode (a broadcast bias's gradient runs on mma.sync there).
    Case("tiles_bias_hopper_deterministic_bf16_d128_causal", dtype="bfloat16", batch=2, seq_q=300, seq_k=264,
         q_heads=4, kv_heads=2, head_dim=128, causal=True, bias="BH", deterministic=True),
    Case("tiles_bias_hopper_deterministic_f16_d96_gqa", dtype="float16", batch=1, seq_q=260, seq_k=136, q_heads=4,
         kv_heads=1, head_dim=96, bias="1H", bias_constant=True, deterministic=True),
    Case("tiles_mask_hopper_deterministic_f16_d64_window", dtype="float16", batch=1, seq_q=333, seq_k=400,
         q_heads=4, kv_heads=2, window=(100, 20), mask="1H", deterministic=True),
    Case("tiles_bias_hopper_dbias_bf16_d64_causal", dtype="bfloat16", batch=2, seq_q=300, seq_k=272, q_heads=4,
         kv_heads=2, causal=True, bias="BH"),
    # A [B, H] bias's gradient is stored in its own dtype, and without a causal mask, window or
    # segment ids every element is stored (zeros too), so nothing zeroes it first.
    Case("tiles_bias_hopper_dbias_unmasked_bf16_d128", dtype="bfloat16", batch=2, seq_q=200, seq_k=264, q_heads=4,
         kv_heads=2, head_dim=128, bias="BH"),
    Case("tiles_bias_mask_hopper_dbias_unmasked_f16_d96", dtype="float16", batch=1, seq_q=333, seq_k=200,
         q_heads=2, kv_heads=1, head_dim=96, bias="BH", mask="11"),
    Case("tiles_bias_hopper_deterministic_f16_d64", dtype="float16", batch=1, seq_q=333, seq_k=144, q_heads=2,
         kv_heads=1, bias="1H", deterministic=True),
    # Deterministic mode with the gradient of a bias broadcast over the batch: one batch row at
    # a time on Hopper where a row's grid (kv heads x 128-key blocks) fills the GPU, as here.
    Case("tiles_bias_hopper_deterministic_dbias_over_batch_bf16_d128", dtype="bfloat16", batch=2, seq_q=300,
         seq_k=1030, q_heads=16, kv_heads=16, head_dim=128, bias="1H", deterministic=True),
    Case("tiles_bias_hopper_deterministic_dbias_over_batch_causal_gqa_f16_d64", dtype="float16", batch=3, seq_q=200,
         seq_k=2100, q_heads=16, kv_heads=8, causal=True, bias="1H", deterministic=True),
    # A soft cap with a bias (added after the cap) or a mask.
    Case("tiles_bias_hopper_softcap_bf16_d128_causal", dtype="bfloat16", batch=2, seq_q=200, seq_k=264, q_heads=4,
         kv_heads=2, head_dim=128, causal=True, soft_cap=6.0, bias="1H"),
    Case("tiles_bias_hopper_softcap_f16_d64", dtype="float16", batch=1, seq_q=333, seq_k=400, q_heads=2,
         kv_heads=1, soft_cap=5.0, bias="BH"),
    Case("tiles_mask_hopper_softcap_bf16_d96_window", dtype="bfloat16", batch=2, seq_q=150, seq_k=272, q_heads=2,
         kv_heads=1, head_dim=96, window=(60, 10), soft_cap=8.0, mask="B1"),
    Case("tiles_bias_hopper_softcap_deterministic_bf16_d128", dtype="bfloat16", batch=1, seq_q=260, seq_k=136,
         q_heads=4, kv_heads=1, head_dim=128, soft_cap=4.0, bias="BH", deterministic=True),
    # A bias and a mask together: on Hopper folded into one bias (mask ? bias : -inf), at once
    # where one's batch and head dims cover the other's (the mask within the bias's shape, or
    # the bias within the mask's, its gradient then summed over the batch), one batch row at a
    # time where their broadcasts cross ([1, H] with [B, 1]: dbias and the sinks' gradient
    # added up over the rows).
    Case("tiles_bias_mask_hopper_causal_bf16_d128_gqa", dtype="bfloat16", batch=2, seq_q=300, seq_k=264, q_heads=4,
         kv_heads=2, head_dim=128, causal=True, bias="BH", mask="B1"),
    Case("tiles_bias_mask_hopper_f16_d64_window", dtype="float16", batch=2, seq_q=333, seq_k=400, q_heads=4,
         kv_heads=2, window=(100, 20), bias="1H", mask="BH"),
    Case("tiles_bias_mask_hopper_softcap_sinks_bf16_d96", dtype="bfloat16", batch=1, seq_q=260, seq_k=136,
         q_heads=2, kv_heads=1, head_dim=96, soft_cap=6.0, sinks=True, bias="11", mask="1H"),
    Case("tiles_bias_mask_hopper_segments_f16_d64", dtype="float16", batch=2, seq_q=300, seq_k=304, q_heads=2,
         kv_heads=1, segments=True, bias="BH", mask="11"),
    Case("tiles_bias_mask_hopper_deterministic_bf16_d128", dtype="bfloat16", batch=1, seq_q=260, seq_k=136,
         q_heads=4, kv_heads=1, head_dim=128, bias="1H", mask="1H", deterministic=True),
    Case("tiles_bias_mask_per_row_bf16_d128", dtype="bfloat16", batch=2, seq_q=200, seq_k=264, q_heads=2,
         kv_heads=2, head_dim=128, causal=True, bias="1H", mask="B1"),
    Case("tiles_bias_mask_per_row_f16_d64_sinks_segments", dtype="float16", batch=3, seq_q=300, seq_k=272,
         q_heads=4, kv_heads=2, sinks=True, segments=True, bias="B1", mask="1H"),
    # Rows that are not whole 16-byte units (seq_k not a multiple of 8 for a bias, of 16 for a
    # mask) fold into a bias of rows padded to 8 elements.
    Case("tiles_bias_hopper_odd_keys_bf16_d64", dtype="bfloat16", batch=2, seq_q=197, seq_k=197, q_heads=4,
         kv_heads=4, bias="1H"),
    Case("tiles_mask_hopper_odd_keys_causal_f16_d128", dtype="float16", batch=2, seq_q=150, seq_k=200, q_heads=2,
         kv_heads=1, head_dim=128, causal=True, mask="B1"),
    Case("tiles_bias_mask_hopper_odd_keys_per_row_softcap_bf16_d96", dtype="bfloat16", batch=2, seq_q=131,
         seq_k=131, q_heads=2, kv_heads=1, head_dim=96, soft_cap=5.0, bias="1H", mask="B1"),
    Case("tiles_bias_hopper_odd_keys_deterministic_f16_d128", dtype="float16", batch=1, seq_q=99, seq_k=301,
         q_heads=2, kv_heads=2, head_dim=128, bias="BH", deterministic=True),
    Case("tiles_bias_mask_per_row_deterministic_bf16_d96", dtype="bfloat16", batch=2, seq_q=260, seq_k=136,
         q_heads=2, kv_heads=1, head_dim=96, window=(60, 10), sinks=True, bias="1H", mask="B1", bias_constant=True,
         deterministic=True),
    Case("everything_f16", dtype="float16", window=(10, 20), soft_cap=8.0, sinks=True, bias="BH",
         mask="B1", segments=True, dropout=0.25),
    # Segment ids on the Hopper kernels: every tile masked element-wise, with and without a
    # causal or window mask, segments spanning several tiles, ids in any order; the backward
    # skips the query tiles outside its keys' segments (on both sides without a causal mask).
    Case("tiles_segments_causal_bf16_d128_gqa", dtype="bfloat16", batch=2, seq_q=300, seq_k=300, q_heads=4,
         kv_heads=2, head_dim=128, causal=True, segments=True),
    Case("tiles_segments_f16_d64_sinks_sq<sk", dtype="float16", batch=2, seq_q=200, seq_k=333, q_heads=4,
         kv_heads=2, sinks=True, segments=True),
    Case("tiles_segments_bf16_d256_window_soft_cap", dtype="bfloat16", batch=1, seq_q=259, seq_k=259, q_heads=2,
         kv_heads=1, head_dim=256, window=(70, 9), soft_cap=7.0, segments=True),
    Case("tiles_segments_shuffled_f16_d128_sq>sk", dtype="float16", batch=2, seq_q=270, seq_k=190, q_heads=2,
         kv_heads=2, head_dim=128, segments="shuffled"),
    Case("tiles_segments_causal_bf16_d64_soft_cap_1100", dtype="bfloat16", batch=1, seq_q=1100, seq_k=1100,
         q_heads=2, kv_heads=1, causal=True, soft_cap=5.0, segments=True),
    Case("tiles_segments_bf16_d128_gqa_sq>sk", dtype="bfloat16", batch=2, seq_q=710, seq_k=650, q_heads=6,
         kv_heads=2, head_dim=128, segments=True),
    # Key padding as segment ids: most key tiles hold one id, the queries' (the kernels then
    # test positions only), the tile at each row's length both.
    Case("tiles_segments_padding_causal_bf16_d64_gqa", dtype="bfloat16", batch=3, seq_q=700, seq_k=650,
         q_heads=4, kv_heads=2, causal=True, segments="padding"),
    Case("tiles_segments_padding_deterministic_f16_d128", dtype="float16", batch=2, seq_q=530, seq_k=530,
         q_heads=2, kv_heads=1, head_dim=128, segments="padding", deterministic=True),
    # With a bias (and its gradient) or a mask too; at d64 with a bias the backward reads the
    # query ids from global memory.
    Case("tiles_segments_bias_bf16_d64_gqa", dtype="bfloat16", batch=2, seq_q=400, seq_k=400, q_heads=4,
         kv_heads=2, segments=True, bias="1H"),
    Case("tiles_segments_bias_deterministic_f16_d64", dtype="float16", batch=1, seq_q=333, seq_k=264, q_heads=2,
         kv_heads=1, segments=True, bias="BH", deterministic=True),
    Case("tiles_segments_mask_causal_f16_d64", dtype="float16", batch=1, seq_q=400, seq_k=400, q_heads=2,
         kv_heads=1, causal=True, segments=True, mask="1H"),
    Case("tiles_segments_bias_causal_f16_d128_soft_cap", dtype="float16", batch=2, seq_q=300, seq_k=304, q_heads=2,
         kv_heads=1, head_dim=128, causal=True, soft_cap=6.0, segments=True, bias="BH"),
    Case("tiles_segments_mask_shuffled_bf16_d96_sq>sk", dtype="bfloat16", batch=2, seq_q=270, seq_k=192, q_heads=2,
         kv_heads=2, head_dim=96, segments="shuffled", mask="B1"),
    # The Hopper kernels at d=96, whose second 64-column block is half filled (zeros past the
    # head dim, never stored). Forward: 176-key tiles with O through each warp's shared tile,
    # 128-key tiles with O through the Q slot, a band's narrow edges, causal pairs, packed
    # sequences (O from registers). Backward: d128's layout with m64n96 dV and dK and a
    # padded dQ accumulator.
    Case("tiles_d96_bf16_176_key_tiles_sinks", dtype="bfloat16", batch=1, seq_q=300, seq_k=1104, q_heads=4,
         kv_heads=2, head_dim=96, sinks=True),
    Case("tiles_d96_f16_short_gqa", dtype="float16", batch=2, seq_q=300, seq_k=400, q_heads=4, kv_heads=1,
         head_dim=96),
    Case("tiles_d96_band_bf16", dtype="bfloat16", batch=1, seq_q=1100, seq_k=1100, q_heads=2, kv_heads=1,
         head_dim=96, causal=True, window=(250, -1)),
    Case("tiles_d96_causal_pairs_f16_soft_cap", dtype="float16", batch=5, seq_q=300, seq_k=300, q_heads=4,
         kv_heads=2, head_dim=96, causal=True, soft_cap=6.0),
    Case("varlen_tiles_window_bf16_d96", dtype="bfloat16", varlen=VARLEN_TILES, q_heads=2, kv_heads=1, head_dim=96,
         window=(60, 10)),
    Case("tiles_segments_f16_d96_causal", dtype="float16", batch=2, seq_q=300, seq_k=300, q_heads=2, kv_heads=2,
         head_dim=96, causal=True, segments=True),
    # The Hopper kernels at d=192: the forward's 112-key tiles of three 64-column blocks, the
    # backward in d256's layout (a fourth block of zeros, never stored).
    Case("tiles_d192_bf16_gqa_sinks_sq>sk", dtype="bfloat16", batch=2, seq_q=301, seq_k=250, q_heads=4, kv_heads=1,
         head_dim=192, sinks=True),
    Case("tiles_d192_f16_causal_soft_cap", dtype="float16", batch=1, seq_q=333, seq_k=400, q_heads=2, kv_heads=2,
         head_dim=192, causal=True, soft_cap=5.0),
    Case("tiles_d192_bf16_growing_max", dtype="bfloat16", batch=1, seq_q=259, seq_k=400, q_heads=2, kv_heads=1,
         head_dim=192, key_ramp=True),
    Case("varlen_tiles_causal_f16_d192_gqa", dtype="float16", varlen=VARLEN_TILES, q_heads=4, kv_heads=2,
         head_dim=192, causal=True),
    Case("tiles_segments_bf16_d192_shuffled", dtype="bfloat16", batch=1, seq_q=270, seq_k=300, q_heads=2,
         kv_heads=1, head_dim=192, segments="shuffled"),
    # The deterministic Hopper backward on packed sequences: a query tile shared by neighbours
    # takes the later sequences' key blocks first, then its own sequence's, last first.
    Case("varlen_tiles_deterministic_causal_bf16_d128_gqa", dtype="bfloat16", varlen=VARLEN_TILES, q_heads=4,
         kv_heads=2, head_dim=128, causal=True, deterministic=True),
    Case("varlen_tiles_deterministic_window_f16_d64", dtype="float16", varlen=VARLEN_TILES, q_heads=2, kv_heads=1,
         window=(60, 10), deterministic=True),
    Case("varlen_tiles_deterministic_bf16_d192_sinks", dtype="bfloat16", varlen=VARLEN_TILES, q_heads=2, kv_heads=2,
         head_dim=192, sinks=True, deterministic=True),
    Case("varlen_many_deterministic_bf16_d256", dtype="bfloat16", varlen=VARLEN_MANY, q_heads=2, kv_heads=1,
         head_dim=256, deterministic=True),
    Case("varlen_many_deterministic_causal_f16_d96_gqa", dtype="float16", varlen=VARLEN_MANY, q_heads=4,
         kv_heads=2, head_dim=96, causal=True, deterministic=True),
    Case("varlen_many_deterministic_window_bf16_d64", dtype="bfloat16", varlen=VARLEN_MANY, q_heads=2, kv_heads=2,
         causal=True, window=(20, -1), deterministic=True),
]


def make_inputs(case: Case, rng: np.random.Generator):
    """(q, k, v, arrays, static): arrays holds the optional operands that are present."""
    dtype = jnp.dtype(case.dtype)
    batch, seq_q, seq_k = case.batch, case.seq_q, case.seq_k
    if case.varlen is not None:
        batch, seq_q, seq_k = 1, case.varlen[2], case.varlen[3]

    def normal(*shape, scale=1.0, dt=dtype):
        return jnp.asarray(rng.standard_normal(shape) * scale, dt)

    q = normal(batch, seq_q, case.q_heads, case.head_dim, scale=1.5)
    k = normal(batch, seq_k, case.kv_heads, case.head_dim)
    if case.key_ramp:
        k = (k.astype(jnp.float32) * jnp.geomspace(4.0, 0.25, seq_k)[:, None, None]).astype(dtype)
    v = normal(batch, seq_k, case.kv_heads, case.head_dim)

    def broadcast_shape(form):
        return (batch if form[0] == "B" else 1, case.q_heads if form[1] == "H" else 1, seq_q, seq_k)

    arrays = {}
    if case.bias is not None:
        arrays["bias"] = normal(*broadcast_shape(case.bias), dt=jnp.dtype(case.bias_dtype or case.dtype))
    if case.mask is not None:
        mask = rng.random(broadcast_shape(case.mask)) < 0.85
        mask[..., rng.choice(seq_q, min(3, seq_q), replace=False), :] = False  # rows that see nothing
        arrays["attention_mask"] = jnp.asarray(mask)
    if case.sinks:
        arrays["softmax_aux"] = normal(case.q_heads, dt=jnp.float32)
    if case.varlen is not None:
        arrays["cum_seqlens_q"], arrays["cum_seqlens_k"] = (jnp.asarray(cu, jnp.int32) for cu in case.varlen[:2])
    if case.segments == "padding":
        # A key padding mask as ids: each row's keys past a random length are hidden.
        q_ids = np.zeros((batch, seq_q), np.int32)
        kv_ids = np.arange(seq_k)[None, :] >= rng.integers(seq_k // 2, seq_k + 1, (batch, 1))
    elif case.segments:
        # Segment 2 has queries but no keys, so its rows see nothing.
        q_ids = rng.integers(0, 4, (batch, seq_q))
        kv_ids = rng.choice([0, 1, 3], (batch, seq_k))
        if case.segments != "shuffled":
            q_ids, kv_ids = np.sort(q_ids, axis=1), np.sort(kv_ids, axis=1)
    if case.segments:
        arrays["q_segment_ids"] = jnp.asarray(q_ids, jnp.int32)
        arrays["kv_segment_ids"] = jnp.asarray(kv_ids, jnp.int32)
    if case.dropout > 0:
        arrays["dropout_seed"] = jnp.asarray(rng.integers(0, 2**32, dtype=np.uint32))
    static = {
        "softmax_scale": case.head_dim**-0.5,
        "causal": case.causal,
        "sliding_window": case.window,
        "logits_soft_cap": case.soft_cap,
        "dropout_prob": case.dropout,
        "deterministic": case.deterministic,
    }
    return q, k, v, arrays, static


def cotangents_for(q, rng):
    dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
    dlse = jnp.asarray(rng.standard_normal((q.shape[0], q.shape[2], q.shape[1])), jnp.float32)
    return dout, dlse


# Compiled programs are cached per implementation and static options, so tests that share
# shapes share compilations.
@functools.cache
def _forward_program(fn, static_items):
    static = dict(static_items)
    return jax.jit(lambda q, k, v, arrays: fn(q, k, v, **arrays, **static))


@functools.cache
def _vjp_program(fn, static_items):
    static = dict(static_items)

    def program(primals, rest, cotangents):
        def f(primals):
            p = dict(primals)
            return fn(p.pop("query"), p.pop("key"), p.pop("value"), **p, **rest, **static)

        outputs, vjp = jax.vjp(f, primals)
        return outputs, vjp(cotangents)[0]

    return jax.jit(program)


def forward(fn, q, k, v, arrays, static):
    return _forward_program(fn, tuple(static.items()))(q, k, v, arrays)


def forward_and_grads(fn, q, k, v, arrays, static, dout, dlse, constant=()):
    """((out, lse), grads): grads maps each differentiable input's name to its cotangent, but
    for the arrays named in `constant`, which are held fixed."""
    primals = {"query": q, "key": k, "value": v,
               **{n: arrays[n] for n in DIFFERENTIABLE if n in arrays and n not in constant}}
    rest = {n: x for n, x in arrays.items() if n not in primals}
    return _vjp_program(fn, tuple(static.items()))(primals, rest, (dout, dlse))


def summed_terms(name: str, q, k) -> int:
    """Terms summed into each element of out or d<name> (whose float32 rounding grows with the
    square root of their count): out and dquery sum over keys, dkey/dvalue over the query rows
    of their GQA group, a sink's or a broadcast bias's cotangent over rows and heads."""
    b, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    return {"out": sk, "query": sk, "key": sq * (hq // hk), "value": sq * (hq // hk), "softmax_aux": b * sq,
            "bias": b * hq}.get(name, 1)


def delta_error(dtype) -> float:
    """The relative error of a flash backward's delta_i = sum_d dout_id out_id (reference_grads):
    the output's rounding to its dtype (half an epsilon per element) in bf16/f16; in float32
    the two float32 sums that should cancel (delta and dP, in different orders), with a margin
    for the largest of many rows (3 epsilons: the XLA implementation on an H100 reached 1.1)."""
    return max(float(jnp.finfo(dtype).eps), 3 * float(jnp.finfo(jnp.float32).eps))


def assert_close(name: str, got, want, same_dtype, terms: int = 1, allowance=0.0) -> None:
    """|got - want| - allowance <= 2 |same_dtype - want| + ~1e-6 relative (x sqrt(terms) for
    sums of terms), in max norm; infinities must match. The same-dtype error counts at least
    the rounding of its result (half of the dtype's epsilon at the largest magnitude): an
    output of a few elements, such as a sink's gradient per head, can land closer than that by
    chance; and where `got` has the coarser dtype (the gradient of a bf16 bias with f16
    inputs), its rounding to that dtype. `allowance` (per element) is what the flash
    backward's delta may add to a gradient's error (reference_grads' delta_error)."""
    eps = max(float(jnp.finfo(same_dtype.dtype).eps), float(jnp.finfo(got.dtype).eps))
    got, want, approx = (np.asarray(x, np.float64) for x in (got, want, same_dtype))
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), f"{name}: NaN at {np.argwhere(np.isnan(got))[:5].tolist()}"
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite], want[~finite]), f"{name}: infinities differ from the reference"
    assert np.isfinite(got[finite]).all(), f"{name}: infinite where the reference is finite"
    if not finite.any():
        return
    err = (np.abs(got[finite] - want[finite]) - np.broadcast_to(allowance, want.shape)[finite]).max()
    ref_err = np.abs(approx[finite] - want[finite]).max()
    assert np.isfinite(ref_err), f"{name}: the same-dtype reference is not finite"
    ref_err = max(ref_err, 0.5 * eps * np.abs(want[finite]).max())
    floor = 2.0**-20 * max(1.0, np.abs(want[finite]).max()) * np.sqrt(terms)
    assert err <= 2 * ref_err + floor, (
        f"{name}: max error {err:.3g} (past the delta allowance) > 2 x same-dtype reference error "
        f"{ref_err:.3g} + {floor:.2g}"
    )


def assert_same(name: str, got, want, rel: float = 1e-5) -> None:
    """Agreement of two runs of one implementation that may only differ in summation order.

    Each run rounds its float32 sums to the result's dtype, so a sum that the two orders put
    on either side of a rounding boundary differs by one unit in the last place: in bf16 or
    f16 that is far more than `rel`, hence the dtype's epsilon per element on top."""
    dtype = np.asarray(got).dtype
    eps = float(jnp.finfo(dtype).eps) if jnp.issubdtype(dtype, jnp.floating) else 0.0
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=name)
    finite = np.isfinite(want)
    scale = max(1.0, np.abs(want[finite]).max(initial=0.0))
    bound = rel * scale + eps * np.abs(want[finite])
    excess = np.abs(got[finite] - want[finite]) - bound
    worst = int(np.argmax(excess)) if excess.size else 0
    assert excess.size == 0 or excess[worst] <= 0, (
        f"{name}: runs differ by {abs(got[finite][worst] - want[finite][worst]):.3g} at element {worst} "
        f"({got[finite][worst]} against {want[finite][worst]}), more than {bound[worst]:.3g}"
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_reference(impl, case: Case, rng):
    """out, lse and (where the implementation has a backward) every gradient."""
    check_against_reference(impl, impl.adapt(case), rng)


def random_varlen(rng: np.random.Generator, max_len: int) -> tuple:
    """A packed layout (VARLEN's form) of 1-5 sequences: empty and length-1 sequences on either
    side, lengths that differ between queries and keys, padding rows and keys after the last."""
    count = int(rng.integers(1, 6))

    def lengths():
        return [int(rng.choice([0, 1, rng.integers(2, max(3, max_len // count))])) for _ in range(count)]

    q_lengths, k_lengths = lengths(), lengths()
    pad_q, pad_k = int(rng.integers(0, 12)), int(rng.integers(0, 12))
    cu_q, cu_k, rows, keys = _packed(q_lengths, k_lengths, pad_q, pad_k)
    return cu_q, cu_k, rows or 1, keys or 1


def random_case(rng: np.random.Generator, name: str, max_len: int, max_scores: float) -> Case:
    """Features drawn independently (each with its own odds), shapes from a few keys up to
    max_len, with at most max_scores score elements (batch x heads x queries x keys)."""
    # 32, 80, 120, 136 and 200 run on the next built head dim's kernels; 36 is zero-padded to 40 first.
    head_dim = int(rng.choice([32, 36, 64, 64, 80, 96, 120, 128, 128, 136, 192, 200, 256]))
    kv_heads = int(rng.integers(1, 3))
    q_heads = kv_heads * int(rng.choice([1, 2, 4]))

    def length():
        return int(rng.choice([rng.integers(1, 24), rng.integers(24, max_len // 3), rng.integers(max_len // 3, max_len + 1)]))

    seq_q = length()
    seq_k = seq_q if rng.random() < 0.5 else length()
    batch = int(rng.integers(1, 4))
    while batch > 1 and batch * q_heads * seq_q * seq_k > max_scores:
        batch -= 1
    seq_q, seq_k = (max(1, int(s * min(1.0, (max_scores / (batch * q_heads * seq_q * seq_k)) ** 0.5))) for s in (seq_q, seq_k))

    def side():
        return int(rng.choice([-1, rng.integers(0, 16), rng.integers(16, max(17, seq_k))]))

    causal = bool(rng.random() < 0.4)
    window = None
    if rng.random() < 0.35:
        window = (side(), -1 if causal else side())
        if window == (-1, -1):
            window = (int(rng.integers(0, max(1, seq_k))), -1)
    varlen = segments = None
    draw = rng.random()
    if draw < 0.15:
        varlen = random_varlen(rng, max_len)
    elif draw < 0.3:
        segments = True if rng.random() < 0.7 else "shuffled"
    return Case(
        name, batch=batch, seq_q=seq_q, seq_k=seq_k, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        dtype=str(rng.choice(["float32", "bfloat16", "float16"])), causal=causal, window=window,
        soft_cap=float(rng.uniform(2.0, 10.0)) if rng.random() < 0.2 else None,
        sinks=bool(rng.random() < 0.25),
        bias=str(rng.choice(["BH", "B1", "1H", "11"])) if rng.random() < 0.12 else None,
        bias_dtype=str(rng.choice(["float32", "bfloat16", "float16"])) if rng.random() < 0.4 else None,
        mask=str(rng.choice(["BH", "B1", "1H", "11"])) if rng.random() < 0.1 else None,
        segments=segments or False, varlen=varlen,
        dropout=float(rng.uniform(0.05, 0.4)) if rng.random() < 0.1 else 0.0,
        deterministic=bool(rng.random() < 0.1), key_ramp=bool(rng.random() < 0.1),
    )


# Besides the fixed cases, every run draws EJK_RANDOM_CASES random ones per implementation
# (scripts/gpu_check.sh draws 300). CUDA cases reach 1300 queries and keys, ten or more of
# its kernels' tiles each way; the CPU and XLA ones stay short, for the CPU's sake.
RANDOM_CASES = int(os.environ.get("EJK_RANDOM_CASES", "4"))


@pytest.mark.parametrize("index", range(RANDOM_CASES))
def test_random_case_matches_reference(impl, index, rng):
    on_gpu = impl.name == "cuda"
    case = impl.adapt(random_case(rng, f"random{index}", max_len=1300 if on_gpu else 160,
                                  max_scores=4e6 if on_gpu else 3e5))
    print(case)  # with the printed seed, what a failure needs to be reproduced
    check_against_reference(impl, case, rng)


def poison_free_gpu_memory(nbytes: int = 1 << 26) -> None:
    """Fills a block of the GPU allocator's pool with all-ones bits (NaN in every float dtype)
    and frees it, so that the outputs allocated next from it show any element a kernel leaves
    unwritten."""
    if jax.default_backend() == "gpu":
        jnp.full((nbytes // 4,), 0xFFFFFFFF, jnp.uint32).block_until_ready().delete()


def check_against_reference(impl, case: Case, rng) -> None:
    """out, lse and (where the implementation has a backward) every gradient."""
    impl.require(*case.features())
    q, k, v, arrays, static = make_inputs(case, rng)
    kwargs = {**arrays, **static}
    with_grads = impl.supports("backward")
    constant = ("bias",) if case.bias_constant else ()
    poison_free_gpu_memory()
    if with_grads:
        dout, dlse = cotangents_for(q, rng)
        (out, lse), grads = forward_and_grads(impl.fn, q, k, v, arrays, static, dout, dlse, constant)
        want_out, want_lse, want, allowance = reference_grads(
            q, k, v, dout=dout, dlse=dlse, **kwargs, return_outputs=True, delta_error=delta_error(q.dtype))
        approx_out, approx_lse, approx = reference_grads(
            q, k, v, dout=dout, dlse=dlse, **kwargs, return_outputs=True, compute_dtype=q.dtype)
    else:
        out, lse = forward(impl.fn, q, k, v, arrays, static)
        want_out, want_lse = attention_reference(q, k, v, **kwargs)
        approx_out, approx_lse = attention_reference(q, k, v, **kwargs, compute_dtype=q.dtype)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert_close("out", out, want_out, approx_out, summed_terms("out", q, k))
    assert_close("lse", lse, want_lse, approx_lse)
    if with_grads:
        assert set(grads) == set(want) - set(constant)
        primals = {"query": q, "key": k, "value": v, **arrays}
        for name in grads:
            assert grads[name].dtype == primals[name].dtype, f"d{name}: dtype {grads[name].dtype}"
            assert_close(f"d{name}", grads[name], want[name], approx[name], summed_terms(name, q, k), allowance[name])


# Every forward tile the CUDA kernels are built with for a kind of call (what autotuning
# times; the backward takes no config), each against the reference. On a GPU with the Hopper
# kernels: d64 with two consumer warpgroups (in pairs where the call is short and causal) and
# with three, d96/d128 unmasked with 128- and 176-key tiles, short and long; elsewhere the
# mma.sync tiles.
TILE_CASES = [
    Case("tiles_d64_causal_short_gqa", dtype="bfloat16", batch=2, seq_q=300, seq_k=333, q_heads=4, kv_heads=2,
         causal=True),
    Case("tiles_d64_causal_long_soft_cap", dtype="float16", batch=1, seq_q=1300, seq_k=1300, q_heads=2,
         kv_heads=1, causal=True, soft_cap=8.0),
    Case("tiles_d64_plain_sinks", dtype="bfloat16", batch=1, seq_q=333, seq_k=520, q_heads=2, kv_heads=2,
         sinks=True),
    Case("tiles_d128_plain_short", dtype="bfloat16", batch=2, seq_q=400, seq_k=450, q_heads=2, kv_heads=1,
         head_dim=128),
    Case("tiles_d128_plain_long_f16", dtype="float16", batch=1, seq_q=1100, seq_k=1300, q_heads=2, kv_heads=2,
         head_dim=128, sinks=True),
    Case("tiles_d96_plain_varlen", dtype="bfloat16", q_heads=2, kv_heads=1, head_dim=96, varlen=VARLEN_TILES),
]


def _native_with_tile(platform: str, cfg, query, key, value, **kwargs):
    from ejkernel.kernels.flash_attention import AttentionArgs, flash_attention_native

    return flash_attention_native(platform, AttentionArgs(query, key, value, **kwargs), block_q=cfg.block_q,
                                  block_k=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@pytest.mark.parametrize("case", TILE_CASES, ids=lambda c: c.name)
def test_cuda_tiles_match_reference(impl, case: Case, rng):
    from ejkernel.kernels.flash_attention import config_candidates, normalize

    if impl.name != "cuda":
        pytest.skip("the CUDA kernels' tiles")
    q, k, v, arrays, static = make_inputs(case, rng)
    tiles = config_candidates("cuda", normalize(q, k, v, **arrays, **static))
    assert tiles, case
    for cfg in tiles:
        print(cfg)
        tiled = dataclasses.replace(impl, fn=functools.partial(_native_with_tile, "cuda", cfg))
        check_against_reference(tiled, case, rng)


def _cuda_gpu() -> bool:
    from ejkernel.kernels.flash_attention import native_features

    return jax.default_backend() == "gpu" and bool(native_features("cuda"))


def _hopper_gpu() -> bool:
    import ejkernel

    return (
        _cuda_gpu()
        and ejkernel.build_info().get("hopper_kernels", False)
        and getattr(jax.devices()[0], "compute_capability", "") == "9.0"
    )


@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm_90 GPU and the Hopper kernels")
def test_cuda_configs_are_the_hopper_tiles(rng):
    """The heuristic is the forward's tile rule (tuned on H100) and autotuning times its
    alternatives; calls the Hopper forward does not take get the mma.sync tiles."""
    from ejkernel.kernels.flash_attention import FlashAttentionConfig, config_candidates, heuristic_config, normalize
    from ejkernel.modules import FlashAttention
    from ejkernel.ops import ConfigCache, ConfigSelectorChain, Executor, policy_override

    def tile(block_q, block_k, num_warps, num_stages):
        return FlashAttentionConfig(block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages)

    def args(seq, head_dim, **kwargs):
        x = jnp.asarray(rng.standard_normal((2, seq, 4, head_dim)), jnp.bfloat16)
        return normalize(x, x, x, **kwargs)

    wide, narrow = tile(128, 176, 12, 2), tile(128, 128, 12, 2)
    assert config_candidates("cuda", args(4096, 128)) == [wide, narrow]
    assert config_candidates("cuda", args(1024, 96)) == [narrow, wide]
    assert config_candidates("cuda", args(4096, 128, causal=True)) == [narrow]
    assert config_candidates("cuda", args(512, 64, causal=True)) == [tile(128, 128, 12, 4), tile(192, 128, 16, 4)]
    assert heuristic_config("cuda", args(2048, 64, causal=True)) == tile(192, 128, 16, 4)
    assert heuristic_config("cuda", args(4096, 256)) == tile(128, 80, 12, 2)
    bias = jnp.asarray(rng.standard_normal((1, 1, 512, 512)), jnp.bfloat16)
    assert config_candidates("cuda", args(512, 128, bias=bias)) == [narrow]
    mask = jnp.asarray(rng.random((2, 1, 512, 512)) < 0.5)
    assert heuristic_config("cuda", args(512, 64, attention_mask=mask, causal=True)) == narrow
    assert heuristic_config("cuda", args(512, 128, bias=bias, logits_soft_cap=5.0)) == narrow
    # A bias with a mask folds into one bias (at once, or per batch row where broadcasts cross).
    assert heuristic_config("cuda", args(512, 128, bias=bias, attention_mask=mask)) == narrow
    bias_1h = jnp.asarray(rng.standard_normal((1, 4, 512, 512)), jnp.bfloat16)
    assert heuristic_config("cuda", args(512, 128, bias=bias_1h, attention_mask=mask)) == narrow
    # Above head dim 128 a bias or mask takes 64-key tiles.
    assert heuristic_config("cuda", args(512, 256, bias=bias)) == tile(128, 64, 12, 2)
    assert config_candidates("cuda", args(512, 192, attention_mask=mask)) == [tile(128, 64, 12, 2)]
    # A float32 bias takes 64-key tiles from d96 (128-key ones at d64); at d256 it runs on the
    # mma.sync kernels.
    bias_f32 = bias.astype(jnp.float32)
    assert heuristic_config("cuda", args(512, 128, bias=bias_f32)) == tile(128, 64, 12, 2)
    assert heuristic_config("cuda", args(512, 64, bias=bias_f32)) == narrow
    assert heuristic_config("cuda", args(512, 256, bias=bias_f32)) == tile(128, 64, 8, 2)
    # Head dims between built ones take the tiles of the head dim whose kernels run them.
    assert config_candidates("cuda", args(4096, 80)) == [wide, narrow]
    assert heuristic_config("cuda", args(4096, 200)) == tile(128, 80, 12, 2)

    q = jnp.asarray(rng.standard_normal((2, 1500, 4, 128)), jnp.bfloat16)
    tuner = Executor(ConfigSelectorChain(cache=ConfigCache(), persistent=False))
    with policy_override(autotune=True):
        inv, cfg = tuner.prepare(FlashAttention(), (q, q, q), {})
    assert inv.platform.value == "cuda" and cfg in (wide, narrow)


@pytest.mark.skipif(not _cuda_gpu(), reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("head_dim, padded", [(40, None), (80, None), (136, None), (36, 40), (100, 104)])
def test_cuda_head_dims_between_built_ones(head_dim, padded, rng, caplog):
    """A multiple of 8 runs on the next built head dim's kernels as it is, without copies; any
    other head dim is zero-padded to the next multiple of 8 first (logged at DEBUG)."""
    from ejkernel.modules import flash_attention

    x = jnp.asarray(rng.standard_normal((1, 70, 2, head_dim)), jnp.bfloat16)
    with caplog.at_level(logging.DEBUG, logger="ejkernel"):
        out = flash_attention(x, x, x, causal=True, platform="cuda")
    want = flash_attention(*(x.astype(jnp.float32),) * 3, causal=True, platform="xla")
    assert out.shape == x.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=2e-2, rtol=0)
    padding = [r.getMessage() for r in caplog.records if "runs zero-padded" in r.getMessage()]
    want_padding = f"flash_attention on cuda: head_dim {head_dim} runs zero-padded to {padded}"
    assert padding == ([] if padded is None else [want_padding])


@pytest.mark.parametrize(
    "case",
    [Case("masked", bias="B1", mask="11"), Case("masked_mask_alone", seq_k=80, mask="11"),
     Case("masked_by_bias", seq_k=80, bias="11")],
    ids=lambda c: c.name,
)
def test_fully_masked_is_zero_and_finite(impl, case, rng):
    """Nothing visible anywhere, by a mask or by a bias of -inf: out 0, lse -inf, and zero (not
    NaN) gradients, dbias included (alone, at 80 keys, they run on the Hopper kernels)."""
    case = impl.adapt(case)
    impl.require("backward", *case.features())
    q, k, v, arrays, static = make_inputs(case, rng)
    if case.mask is not None:
        arrays["attention_mask"] = jnp.zeros((1, 1, q.shape[1], k.shape[1]), bool)
    else:
        arrays["bias"] = jnp.full((1, 1, q.shape[1], k.shape[1]), -jnp.inf, arrays["bias"].dtype)
    (out, lse), grads = forward_and_grads(impl.fn, q, k, v, arrays, static, *cotangents_for(q, rng))
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
    assert np.all(np.asarray(lse) == -np.inf)
    for name, g in grads.items():
        np.testing.assert_array_equal(np.asarray(g, np.float32), 0.0, err_msg=name)


# Bias and mask shapes that broadcast over the query or key dims too, NumPy style (rank below
# 4 gets leading 1s); batch 2, 4 query heads, 37 queries, 41 keys. A mask over keys alone or
# queries alone, shared by the heads, runs as segment ids; the rest is materialised.
BROADCAST_OPERANDS = [
    ("bias_key_padding", (2, 1, 1, 41), None),
    ("bias_per_head_queries_rank3", (4, 37, 1), None),
    ("bias_rank2", (37, 41), None),
    ("mask_key_padding", None, (2, 1, 1, 41)),
    ("mask_query_rows_shared", None, (1, 1, 37, 1)),
    ("mask_keys_per_head", None, (1, 4, 1, 41)),
    ("bias_with_key_padding_mask", (1, 4, 37, 41), (2, 1, 1, 41)),
]


@pytest.mark.parametrize("name,bias_shape,mask_shape", BROADCAST_OPERANDS, ids=[o[0] for o in BROADCAST_OPERANDS])
def test_bias_and_mask_broadcast_over_queries_and_keys(impl, name, bias_shape, mask_shape, rng):
    """Through the public API: out, lse and every gradient against the reference given the
    operands broadcast in full; the bias's gradient summed back to its own shape."""
    from ejkernel.modules import flash_attention

    case = impl.adapt(Case(name, dtype="float32", batch=2, seq_q=37, seq_k=41, q_heads=4, kv_heads=2, causal=True))
    impl.require("backward")
    q, k, v, _, static = make_inputs(case, rng)
    full = (2, 4, 37, 41)
    arrays, reference_arrays = {}, {}
    if bias_shape is not None:
        arrays["bias"] = jnp.asarray(rng.standard_normal(bias_shape), q.dtype)
        reference_arrays["bias"] = jnp.broadcast_to(arrays["bias"], full)
    if mask_shape is not None:
        mask = rng.random(mask_shape) < 0.8
        mask.reshape(-1)[:2] = False  # hidden rows or keys, whatever the draw
        arrays["attention_mask"] = jnp.asarray(mask)
        reference_arrays["attention_mask"] = jnp.broadcast_to(arrays["attention_mask"], full)

    def public(query, key, value, **kwargs):
        kwargs.pop("deterministic")
        return flash_attention(query, key, value, return_lse=True, platform=impl.name, **kwargs)

    dout, dlse = cotangents_for(q, rng)
    (out, lse), grads = forward_and_grads(public, q, k, v, arrays, static, dout, dlse)
    kwargs = {**reference_arrays, **static}
    want_out, want_lse, want, allowance = reference_grads(
        q, k, v, dout=dout, dlse=dlse, **kwargs, return_outputs=True, delta_error=delta_error(q.dtype))
    approx_out, approx_lse, approx = reference_grads(
        q, k, v, dout=dout, dlse=dlse, **kwargs, return_outputs=True, compute_dtype=q.dtype)
    assert_close("out", out, want_out, approx_out, summed_terms("out", q, k))
    assert_close("lse", lse, want_lse, approx_lse)
    for grad_name in ("query", "key", "value"):
        assert_close(f"d{grad_name}", grads[grad_name], want[grad_name], approx[grad_name],
                     summed_terms(grad_name, q, k), allowance[grad_name])
    if bias_shape is not None:
        compact = arrays["bias"].shape
        padded = (1,) * (4 - len(compact)) + compact
        summed_dims = tuple(i for i in range(4) if padded[i] == 1 and full[i] > 1)

        def fold(x):
            return np.sum(np.asarray(x, np.float64), axis=summed_dims, keepdims=True).reshape(compact)

        assert grads["bias"].shape == compact and grads["bias"].dtype == q.dtype
        terms = int(np.prod([full[i] for i in summed_dims]))
        assert_close("dbias", grads["bias"], fold(want["bias"]), fold(approx["bias"]), terms,
                     fold(allowance["bias"]))


def test_key_padding_mask_runs_as_segment_ids(rng):
    """A mask over keys alone (padding) reaches the platforms as segment ids; one with its own
    plane per head stays a mask, materialised to [Sq, Sk] planes."""
    from ejkernel.kernels.flash_attention import normalize, normalize_shapes

    q = jnp.asarray(rng.standard_normal((2, 37, 4, 32)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 41, 2, 32)), jnp.float32)
    padding = jnp.asarray(rng.random((2, 1, 1, 41)) < 0.7)
    args = normalize(q, k, k, attention_mask=padding)
    assert args.attention_mask is None
    np.testing.assert_array_equal(np.asarray(args.kv_segment_ids), np.where(np.asarray(padding)[:, 0, 0], 0, 1))
    np.testing.assert_array_equal(np.asarray(args.q_segment_ids), 0)
    shapes = normalize_shapes(q, k, k, attention_mask=padding)
    assert shapes.attention_mask is None and shapes.kv_segment_ids.shape == (2, 41)
    per_head = normalize(q, k, k, attention_mask=jnp.ones((1, 4, 1, 41), bool), bias=jnp.ones((37, 1)))
    assert per_head.attention_mask.shape == (1, 4, 37, 41) and per_head.bias.shape == (1, 1, 37, 41)
    # With segment ids of its own, the call keeps the mask (materialised).
    ids = jnp.zeros((2, 37), jnp.int32), jnp.zeros((2, 41), jnp.int32)
    with_ids = normalize(q, k, k, attention_mask=padding, q_segment_ids=ids[0], kv_segment_ids=ids[1])
    assert with_ids.attention_mask.shape == (2, 1, 37, 41)


def test_fmix32_known_values():
    assert int(fmix32(0)) == 0
    assert int(fmix32(1)) == 0x514E28B7
    assert int(fmix32(2)) == 0x30F4C306
    assert dropout_threshold(0.5) == 2**15  # 16-bit draws
    assert dropout_threshold(0.0) == 0


def test_reference_keeps_x64_to_itself(rng):
    q = rng.standard_normal((1, 5, 1, 8)).astype(np.float32)
    out, lse = attention_reference(q, q, q, softmax_scale=0.5)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert jnp.asarray(1.0).dtype == jnp.float32


def test_dropout_mask_is_the_hash(impl, rng):
    """Uniform attention over one-hot values makes out reveal the kept mask:
    out[b, i, h, j] = keep[b, h, i, j] / (seq_k (1 - p))."""
    impl.require("dropout", "gqa")
    batch, seq_q, seq_k, q_heads, kv_heads, prob = 2, 40, 64, 4, 2, 0.3
    dtype = jnp.bfloat16 if impl.low_precision_only else jnp.float32
    seed = int(rng.integers(0, 2**32))
    q = jnp.asarray(rng.standard_normal((batch, seq_q, q_heads, seq_k)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, seq_k, kv_heads, seq_k)), dtype)
    v = jnp.broadcast_to(jnp.eye(seq_k, dtype=dtype)[None, :, None, :], k.shape)
    static = {"softmax_scale": 0.0, "causal": False, "sliding_window": None, "logits_soft_cap": None,
              "dropout_prob": prob}
    out, _ = forward(impl.fn, q, k, v, {"dropout_seed": jnp.asarray(seed, jnp.uint32)}, static)
    scaled = np.asarray(out).transpose(0, 2, 1, 3) * seq_k * (1 - prob)
    want = dropout_keep_mask(seed, batch, q_heads, seq_q, seq_k, prob)
    np.testing.assert_array_equal(scaled > 0.5, want)
    np.testing.assert_allclose(scaled[want], 1.0, rtol=1e-2 if impl.low_precision_only else 1e-5)
    kept = want.mean()
    assert abs(kept - (1 - prob)) < 0.02, f"kept fraction {kept:.4f}, expected about {1 - prob}"


def test_dropout_is_deterministic(impl, rng):
    case = Case("dropout", dropout=0.4, causal=True, deterministic=True)
    case = impl.adapt(case)
    impl.require("backward", *case.features())
    q, k, v, arrays, static = make_inputs(case, rng)
    seed = int(arrays["dropout_seed"])
    cotangents = cotangents_for(q, rng)
    (out1, lse1), grads1 = forward_and_grads(impl.fn, q, k, v, arrays, static, *cotangents)
    (out2, lse2), grads2 = forward_and_grads(impl.fn, q, k, v, arrays, static, *cotangents)
    for name, a, b in [("out", out1, out2), ("lse", lse1, lse2)] + [(n, grads1[n], grads2[n]) for n in grads1]:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    out3, lse3 = forward(impl.fn, q, k, v, {**arrays, "dropout_seed": jnp.asarray(seed ^ 1, jnp.uint32)}, static)
    assert not np.array_equal(np.asarray(out1), np.asarray(out3))
    np.testing.assert_array_equal(np.asarray(lse1), np.asarray(lse3))  # dropout acts after the softmax


@pytest.mark.parametrize("case", [c for c in CASES if c.deterministic and not c.dropout], ids=lambda c: c.name)
def test_deterministic_backward_repeats_bitwise(impl, case: Case, rng):
    """Two runs of a deterministic backward give the same bits (the cases' values are checked
    against the reference in test_matches_reference)."""
    case = impl.adapt(case)
    impl.require("backward", *case.features())
    q, k, v, arrays, static = make_inputs(case, rng)
    cotangents = cotangents_for(q, rng)
    _, grads1 = forward_and_grads(impl.fn, q, k, v, arrays, static, *cotangents)
    _, grads2 = forward_and_grads(impl.fn, q, k, v, arrays, static, *cotangents)
    for name in grads1:
        np.testing.assert_array_equal(np.asarray(grads1[name]), np.asarray(grads2[name]), err_msg=f"d{name}")


# (case, inputs mapped by vmap (None: all), whether the native forward and backward fold the
# mapped axis into the batch: one call, not a loop over the mapped elements).
VMAP_CASES = [
    (Case("vmap_sinks", batch=1, seq_q=37, seq_k=50, causal=True, bias="1H", sinks=True), None, True, True),
    (Case("vmap_shared_sinks", seq_q=37, seq_k=50, bias="BH", sinks=True), {"query", "key", "value", "bias"},
     True, True),
    (Case("vmap_bias_per_row", seq_q=45, seq_k=70, causal=True, bias="BH"), None, True, True),
    (Case("vmap_shared_kv_and_bias", seq_q=40, seq_k=56, bias="1H", bias_constant=True, mask="1H", segments=True),
     {"query", "q_segment_ids", "kv_segment_ids"}, True, True),
    (Case("vmap_shared_bias_grad", seq_q=40, seq_k=56, bias="11", window=(9, 4)),
     {"query", "key", "value"}, True, False),
    # One batch row per element (per-example gradients): the backward copies the shared bias
    # per element, the size of its per-element gradient, and folds (with mapped sinks, into
    # the heads; the forward, which would not copy a per-head bias, runs per element there).
    (Case("vmap_shared_bias_grad_one_row", batch=1, seq_q=40, seq_k=56, bias="1H", causal=True),
     {"query", "key", "value"}, True, True),
    (Case("vmap_mapped_sinks_shared_bias_grad_one_row", batch=1, seq_q=40, seq_k=56, bias="1H", sinks=True),
     {"query", "key", "value", "softmax_aux"}, False, True),
    (Case("vmap_dropout", seq_q=40, seq_k=56, dropout=0.2), None, False, False),
    # Packed sequences fold end to end along the sequence axis, each element's padding rows and
    # keys in sequences of their own.
    (Case("vmap_packed", varlen=VARLEN, causal=True, window=(12, 2), soft_cap=5.0), None, True, True),
    (Case("vmap_packed_shared_kv", varlen=VARLEN, causal=True), {"query"}, True, True),
    # Sinks (one per head) fold the mapped axis into the heads instead, each element's heads
    # (and GQA groups) a run of them: mapped sinks, and packed sequences with shared ones.
    (Case("vmap_mapped_sinks_gqa", q_heads=4, kv_heads=2, seq_q=37, seq_k=50, causal=True, sinks=True,
          segments=True, bias="BH"), {"query", "key", "value", "softmax_aux", "bias"}, True, True),
    (Case("vmap_packed_sinks", varlen=VARLEN, sinks=True), {"query", "key", "value"}, True, True),
    # Keys and values the elements share: the forward folds the elements' q heads into each
    # key/value head's group (no copy of the keys); the backward, which owes each element its
    # own dK and dV, folds with the keys copied per element.
    (Case("vmap_mapped_sinks_shared_kv", seq_q=37, seq_k=50, sinks=True), {"query", "softmax_aux"}, True, True),
    (Case("vmap_shared_kv_gqa", q_heads=4, kv_heads=2, seq_q=37, seq_k=50, causal=True, sinks=True, bias="BH",
          mask="B1"), {"query", "softmax_aux", "bias"}, True, True),
    (Case("vmap_mapped_sinks_shared_value", seq_q=37, seq_k=50, sinks=True), {"query", "key", "softmax_aux"},
     True, True),
    (Case("vmap_packed_shared_kv_gqa", varlen=VARLEN, q_heads=6, kv_heads=2, causal=True, window=(12, 2)),
     {"query"}, True, True),
    # A shared bias or mask broadcast over the heads folds as it is; the gradient of a shared
    # bias does not fold (it would sum the elements').
    (Case("vmap_mapped_sinks_shared_mask", q_heads=4, kv_heads=2, seq_q=37, seq_k=50, sinks=True, mask="B1",
          bias="1H", bias_constant=True), {"query", "key", "value", "softmax_aux", "bias"}, True, True),
    (Case("vmap_mapped_sinks_shared_bias_grad", seq_q=37, seq_k=50, sinks=True, bias="B1"),
     {"query", "key", "value", "softmax_aux"}, True, False),
    (Case("vmap_packed_bias", varlen=VARLEN, causal=True, bias="1H", mask="11"), {"query", "key", "value", "bias"},
     True, True),
]


@pytest.mark.parametrize("case,mapped,folds_forward,folds_backward", VMAP_CASES, ids=lambda c: getattr(c, "name", ""))
def test_vmap(impl, rng, case, mapped, folds_forward, folds_backward):
    """vmap of the forward and of per-example gradients, over some inputs (the others shared),
    against one call per mapped element; the native kernels fold the mapped axis into the batch
    where that gives the same result."""
    case = impl.adapt(case)
    impl.require(*case.features())
    made = [make_inputs(case, rng) for _ in range(3)]
    static = made[0][4]
    flat = [{"query": q, "key": k, "value": v, **arrays} for q, k, v, arrays, _ in made]
    is_mapped = {name: mapped is None or name in mapped for name in flat[0]}
    # Each element's inputs, the shared ones element 0's; the vmapped call's, stacked where mapped.
    per_element = [{name: x if is_mapped[name] else flat[0][name] for name, x in e.items()} for e in flat]
    stacked = {name: jnp.stack([e[name] for e in flat]) if is_mapped[name] else flat[0][name] for name in flat[0]}

    def split(inputs):
        return inputs["query"], inputs["key"], inputs["value"], {
            n: x for n, x in inputs.items() if n not in ("query", "key", "value")}

    args = split(stacked)
    q_axis, k_axis, v_axis, array_axes = split({name: 0 if on else None for name, on in is_mapped.items()})
    in_axes = (q_axis, k_axis, v_axis, array_axes)
    constant = {"bias"} if case.bias_constant else set()

    def attention(q, k, v, arrays):
        return impl.fn(q, k, v, **arrays, **static)

    def loss(q, k, v, arrays, differentiated):
        out, lse = attention(q, k, v, {**arrays, **differentiated})
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    def grad(q, k, v, arrays):
        fixed = {n: x for n, x in arrays.items() if n not in DIFFERENTIABLE or n in constant}
        free = {n: x for n, x in arrays.items() if n not in fixed}
        return jax.grad(loss, argnums=(0, 1, 2, 4))(q, k, v, fixed, free)

    if impl.name != "xla":  # one FFI call, or a loop over the mapped elements
        assert ("scan" not in str(jax.make_jaxpr(jax.vmap(attention, in_axes))(*args))) == folds_forward
        if impl.supports("backward"):
            backward = str(jax.make_jaxpr(jax.vmap(grad, in_axes))(*args))
            assert backward.count("scan") == (not folds_forward) + (not folds_backward)
    got_out, got_lse = jax.jit(jax.vmap(attention, in_axes))(*args)
    for n, e in enumerate(per_element):
        out, lse = forward(impl.fn, *split(e), static)
        assert_same("out", got_out[n], out)
        assert_same("lse", got_lse[n], lse)
    if not impl.supports("backward"):
        return
    got = jax.jit(jax.vmap(grad, in_axes))(*args)
    for n, e in enumerate(per_element):
        want = jax.tree.leaves(jax.jit(grad)(*split(e)))
        for leaf, (a, b) in enumerate(zip(jax.tree.leaves(got), want)):
            assert_same(f"gradient leaf {leaf}", a[n], b)


def test_grad_and_checkpoint(impl, rng):
    """jax.grad of a scalar loss, with and without jax.checkpoint, against the reference."""
    case = Case("checkpoint", seq_q=45, seq_k=70, causal=True, bias="B1", sinks=True, soft_cap=5.0)
    case = impl.adapt(case)
    impl.require("backward", *case.features())
    q, k, v, arrays, static = make_inputs(case, rng)
    dout, dlse = cotangents_for(q, rng)

    def attention(q, k, v, bias, aux):
        return impl.fn(q, k, v, bias=bias, softmax_aux=aux, **static)

    def loss(attention, *args):  # linear in (out, lse), so its cotangents are (dout, dlse)
        out, lse = attention(*args)
        return jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse)

    args = (q, k, v, arrays["bias"], arrays["softmax_aux"])
    plain = jax.jit(jax.grad(functools.partial(loss, attention), argnums=range(5)))(*args)
    remat = jax.jit(jax.grad(functools.partial(loss, jax.checkpoint(attention)), argnums=range(5)))(*args)
    for name, a, b in zip(DIFFERENTIABLE, plain, remat):
        assert_same(name, a, b)
    want, allowance = reference_grads(q, k, v, dout=dout, dlse=dlse, **arrays, **static,
                                      delta_error=delta_error(q.dtype))
    approx = reference_grads(q, k, v, dout=dout, dlse=dlse, **arrays, **static, compute_dtype=q.dtype)
    for name, g in zip(DIFFERENTIABLE, plain):
        assert_close(f"d{name}", g, want[name], approx[name], summed_terms(name, q, k), allowance[name])


def test_integer_and_bool_inputs_get_float0_cotangents(impl, rng):
    case = Case("float0", mask="BH", segments=True, dropout=0.2)
    case = impl.adapt(case)
    impl.require("backward", *case.features())
    q, k, v, arrays, static = make_inputs(case, rng)
    non_float = {n: arrays[n] for n in ("attention_mask", "q_segment_ids", "kv_segment_ids", "dropout_seed")}

    @jax.jit
    def grads(q, non_float):
        out, vjp_fn = jax.vjp(lambda q, nf: impl.fn(q, k, v, **nf, **static)[0], q, non_float)
        return vjp_fn(jnp.ones_like(out))

    dq, dnf = grads(q, non_float)
    assert dq.dtype == q.dtype and np.isfinite(np.asarray(dq, np.float32)).all()
    for name, ct in dnf.items():
        assert ct.dtype == jax.dtypes.float0, f"{name}: cotangent dtype {ct.dtype}"


# batch_bf16: a bf16 bias shared by the shards, each holding one batch row (on 4 devices), whose
# gradient must be summed in float32 although each shard's call has a plane per batch row.
@pytest.mark.parametrize("axis", ["batch", "heads", "batch_bf16"])
def test_shard_map(impl, rng, axis):
    devices = min(4, jax.device_count())
    if devices < 2:
        pytest.skip("needs several devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    case = Case("shard", batch=4, q_heads=8, kv_heads=4, seq_q=40, seq_k=56, causal=True, bias="1H", sinks=True)
    if axis == "batch_bf16" and impl.name == "xla":
        pytest.skip("JAX's autodiff of the XLA implementation sums the shards' bf16 gradients in bf16")
    case = impl.adapt(dataclasses.replace(case, dtype="bfloat16") if axis == "batch_bf16" else case)
    impl.require("backward", *case.features())
    q, k, v, arrays, static = make_inputs(case, rng)
    mesh = jax.make_mesh((devices,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    if axis.startswith("batch"):
        qkv, bias, aux, lse = P("x"), P(), P(), P("x")
    else:  # q heads and kv heads split alike, so every shard keeps its GQA groups
        qkv, bias, aux, lse = P(None, None, "x"), P(None, "x"), P("x"), P(None, "x")

    def attention(q, k, v, bias, aux):
        return impl.fn(q, k, v, bias=bias, softmax_aux=aux, **static)

    sharded = jax.shard_map(attention, mesh=mesh, in_specs=(qkv, qkv, qkv, bias, aux), out_specs=(qkv, lse))

    def loss(attention, *args):
        out, lse = attention(*args)
        return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    args = (q, k, v, arrays["bias"], arrays["softmax_aux"])
    for name, a, b in zip(("out", "lse"), jax.jit(sharded)(*args), jax.jit(attention)(*args)):
        assert_same(name, a, b)
    grads = jax.jit(jax.grad(functools.partial(loss, sharded), argnums=range(5)))(*args)
    want = jax.jit(jax.grad(functools.partial(loss, attention), argnums=range(5)))(*args)
    for name, a, b in zip(DIFFERENTIABLE, grads, want):
        assert_same(name, a, b)


# jit over sharded arrays: (case, mesh shape (None: one axis over 4 devices, or 2 where there
# are 2), spec of q, k and v (k and v replicated where None), whether the native kernels run
# split: True where the compiled program gathers nothing, "keys" where it gathers only the
# keys and values (the query's rows stay split), False where it gathers).
JIT_SHARDED_CASES = {
    "batch": (Case("jit_batch", batch=4, q_heads=8, kv_heads=4, causal=True, bias="1H", sinks=True, segments=True),
              None, P("x"), True),
    # One batch row per device (on 4): the bf16 bias's gradient is a float32 sum all the same.
    "batch_bf16_bias": (Case("jit_batch_bf16", batch=4, q_heads=4, kv_heads=2, dtype="bfloat16", bias="1H"),
                        None, P("x"), True),
    "heads_gqa": (Case("jit_heads", q_heads=8, kv_heads=4, window=(20, 3), bias="BH", mask="B1"),
                  None, P(None, None, "x"), True),
    "batch_and_heads": (Case("jit_2d", batch=4, q_heads=4, kv_heads=2, soft_cap=20.0, bias="11", sinks=True),
                        (2, 2), P("x", None, "y"), True),
    "packed_heads": (Case("jit_packed", q_heads=8, kv_heads=4, varlen=VARLEN, causal=True), None, P(None, None, "x"),
                     True),
    # Dropout: each device draws the masks of its rows by their place in the whole call.
    "dropout": (Case("jit_dropout", batch=4, q_heads=4, kv_heads=2, dropout=0.2, bias="1H"), None, P("x"), True),
    "dropout_heads": (Case("jit_dropout_heads", q_heads=8, kv_heads=4, dropout=0.25, window=(30, 0)), None,
                      P(None, None, "x"), True),
    "dropout_batch_and_heads": (Case("jit_dropout_2d", batch=2, q_heads=4, kv_heads=2, dropout=0.3, causal=True,
                                     sinks=True), (2, 2), P("x", None, "y"), True),
    # A split sequence: the call splits over heads instead (all-to-all, no gather); with the
    # batch split too; with dropout, whose origin then counts the heads moved there.
    "sequence": (Case("jit_seq", q_heads=8, kv_heads=4, seq_q=68, seq_k=72, causal=True, sinks=True), None,
                 P(None, "x"), True),
    "batch_and_sequence": (Case("jit_batch_seq", batch=2, q_heads=4, kv_heads=2, seq_q=36, seq_k=44, bias="B1"),
                           (2, 2), P("x", "y"), True),
    "dropout_sequence": (Case("jit_dropout_seq", q_heads=8, kv_heads=4, seq_q=60, seq_k=60, dropout=0.2, causal=True),
                         None, P(None, "x"), True),
    # A split sequence whose heads cannot take it (MQA): the rows stay split, each device gets
    # all the keys; causal and windowed rows run as packed sequences aligned where the whole
    # call aligns them, the first device's rows seeing no key where seq_q > seq_k. Each device's
    # part of dK and dV is float32, rounded once summed (in bf16 as in float32).
    "sequence_rows": (Case("jit_rows", q_heads=4, kv_heads=1, seq_q=68, seq_k=72, causal=True, window=(20, 0),
                           sinks=True), None, P(None, "x"), "keys"),
    "sequence_rows_fewer_keys": (Case("jit_rows_short", q_heads=4, kv_heads=1, seq_q=68, seq_k=40, causal=True,
                                      soft_cap=15.0), None, P(None, "x"), "keys"),
    "sequence_rows_bf16": (Case("jit_rows_bf16", q_heads=4, kv_heads=1, seq_q=68, seq_k=68, dtype="bfloat16",
                                causal=True), None, P(None, "x"), "keys"),
    "sequence_rows_unmasked": (Case("jit_rows_full", q_heads=2, kv_heads=1, seq_q=36, seq_k=52, sinks=True,
                                    deterministic=True), None, P(None, "x"), "keys"),
    # Heads split over one axis, the sequence over the other, where the heads cannot take it.
    "heads_and_sequence_rows": (Case("jit_heads_rows", q_heads=4, kv_heads=2, seq_q=36, seq_k=36, causal=True),
                                (2, 2), P(None, "y", "x"), "keys"),
    # Not split: key/value heads that do not divide over the devices, split along heads; a
    # sequence whose heads cannot take it, with a bias (its planes are not split by rows).
    "heads_indivisible": (Case("jit_mqa", q_heads=8, kv_heads=1), None, (P(None, None, "x"), None), False),
    "sequence_indivisible": (Case("jit_seq_mqa", q_heads=4, kv_heads=1, seq_q=68, seq_k=72, causal=True,
                                  bias="B1"), None, P(None, "x"), False),
}


@pytest.mark.parametrize("layout", sorted(JIT_SHARDED_CASES))
def test_jit_sharded(impl, rng, layout):
    """Under jit with sharded q, k and v, a native call runs on each device's batch rows and
    heads, a split sequence moved to the heads (no all-gather in the compiled program), and
    every result equals the call's on one device, gradients (summed over devices where a bias
    or the sinks are shared) included."""
    check_jit_sharded(impl, rng, layout)


@pytest.mark.parametrize("layout", ["batch", "dropout_batch_and_heads"])
def test_jit_sharded_gspmd(impl, rng, layout):
    """The same under XLA's older partitioner (GSPMD), which asks the sharding callbacks
    rather than Shardy's rule."""
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        check_jit_sharded(impl, rng, layout)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)


def check_jit_sharded(impl, rng, layout):
    case, mesh_shape, spec, split = JIT_SHARDED_CASES[layout]
    if layout == "batch_bf16_bias" and impl.name == "xla":
        pytest.skip("XLA partitions the XLA implementation itself, summing the devices' bf16 gradients in bf16")
    q_spec, kv_spec = spec if isinstance(spec, tuple) else (spec, spec)
    if mesh_shape is None:
        mesh_shape = (4 if jax.device_count() >= 4 else 2,)
    if jax.device_count() < math.prod(mesh_shape):
        pytest.skip("needs several devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    case = impl.adapt(case)
    impl.require("backward", *case.features())
    q, k, v, arrays, static = make_inputs(case, rng)
    mesh = jax.make_mesh(mesh_shape, ("x", "y")[: len(mesh_shape)],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(mesh_shape))
    sharded = [jax.device_put(x, jax.sharding.NamedSharding(mesh, s or P())) for x, s in zip((q, k, v), (q_spec, kv_spec, kv_spec))]
    differentiable = {n: a for n, a in arrays.items() if n in DIFFERENTIABLE}
    fixed = {n: a for n, a in arrays.items() if n not in DIFFERENTIABLE}

    def attention(q, k, v, differentiable):
        return impl.fn(q, k, v, **differentiable, **fixed, **static)

    def loss(q, k, v, differentiable):
        out, lse = attention(q, k, v, differentiable)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    forward, backward = jax.jit(attention), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    for name, got, want in zip(("out", "lse"), forward(*sharded, differentiable), forward(q, k, v, differentiable)):
        assert_same(name, got, want)
    got = jax.tree.leaves(backward(*sharded, differentiable))
    want = jax.tree.leaves(backward(q, k, v, differentiable))
    # A rows split runs its rows as packed sequences, whose key tiles sum in another order: a
    # 16-bit output may then differ in its last place, and the loss's cotangent (2 out) with
    # it, which moves the gradients by a fraction of the dtype's epsilon of their scale.
    rel = 1e-5 if split != "keys" or case.dtype == "float32" else float(jnp.finfo(case.dtype).eps) / 32
    for got_grad, want_grad in zip(got, want):
        assert_same("gradient", got_grad, want_grad, rel)
    if split and impl.name != "xla":
        # The one gather allowed (and, with the rows split, the keys and values' or a part of
        # their heads, which XLA may reshape first, dropping a single head): the [heads]
        # gradient of replicated sinks, from a call split over heads.
        def allowed(dims):
            sizes = [int(x) for x in dims.split(",")]
            return len(sizes) == 1 or split == "keys" and case.seq_k in sizes and k.size % math.prod(sizes) == 0

        for fn in (forward, backward):
            program = fn.lower(*sharded, differentiable).compile().as_text()
            gathered = [re.findall(r"\w+\[([\d,]*)\]", line.split(" all-gather(")[0].split("=", 1)[1])
                        for line in program.splitlines() if " all-gather(" in line]
            assert all(allowed(dims) for shapes in gathered for dims in shapes), (
                f"{layout}: the program gathers {gathered}")
        assert forward(*sharded, differentiable)[0].sharding.spec == q_spec


# A backward asked for float32 dK and dV (the parts of a split of the query's rows) on each
# kernel: Hopper with GQA, causal with packed sequences (how a rows split runs), deterministic
# with dropout, a bias and a mask; a bias with packed sequences on mma.sync.
FLOAT32_KEYS_CASES = ["tiles_d64_causal_gqa_1100", "varlen_tiles_causal_bf16_d128_gqa",
                      "tiles_dropout_bias_mask_deterministic_bf16_d128", "tiles_d64_f16_varlen_bias_dropout_window"]


@pytest.mark.parametrize("name", FLOAT32_KEYS_CASES)
def test_float32_keys(impl, rng, name):
    """dK and dV written in float32 are the call's own unrounded: rounded once, they equal
    its 16-bit dK and dV, and they are not already rounded."""
    from ejkernel.kernels.flash_attention import _ffi

    if impl.name == "xla":
        pytest.skip("the XLA implementation has no FFI backward")
    case = impl.adapt(next(c for c in CASES if c.name == name))
    impl.require("backward", *case.features())
    q, k, v, arrays, static = make_inputs(case, rng)
    dout, dlse = cotangents_for(q, rng)
    _, want = forward_and_grads(impl.fn, q, k, v, arrays, static, dout, dlse)
    original, seen = _ffi._backward_kernel, []

    def widened(static, operands, dbias_dtype, float32_keys=False):
        kernel = original(static, operands, dbias_dtype, float32_keys=True)

        def call(q, k, v, *args):
            dq, dk, dv, *rest = kernel(q, k, v, *args)
            assert dk.dtype == dv.dtype == jnp.float32
            jax.debug.callback(lambda dk, dv: seen.append((np.asarray(dk), np.asarray(dv))), dk, dv)
            return (dq, dk.astype(k.dtype), dv.astype(v.dtype), *rest)

        return call

    _ffi._backward_kernel = widened
    _ffi._backward_call.cache_clear()
    try:
        # A function of its own, so that the cached program is traced again with `widened`.
        _, got = forward_and_grads(lambda *a, **kw: impl.fn(*a, **kw), q, k, v, arrays, static, dout, dlse)
        jax.effects_barrier()
    finally:
        _ffi._backward_kernel = original
        _ffi._backward_call.cache_clear()
    for n in want:
        assert_same(n, got[n], want[n])
    (dk, dv), = seen
    if q.dtype != jnp.float32:
        for n, x in (("key", dk), ("value", dv)):
            assert not np.array_equal(x, x.astype(q.dtype).astype(np.float32)), f"d{n} arrived rounded"


# The XLA implementation's own properties.


@pytest.mark.parametrize("blocks", [(8, 8), (24, 40), (128, 128)])
def test_xla_block_sizes(blocks, rng):
    from ejkernel.kernels.flash_attention._xla import flash_attention_xla

    fn = functools.partial(flash_attention_xla, block_q=blocks[0], block_k=blocks[1])
    case = Case("blocks", seq_q=75, seq_k=61, causal=True, window=(20, 3), bias="B1", sinks=True, dropout=0.1)
    q, k, v, arrays, static = make_inputs(case, rng)
    dout, dlse = cotangents_for(q, rng)
    (out, lse), grads = forward_and_grads(fn, q, k, v, arrays, static, dout, dlse)
    kwargs = dict(dout=dout, dlse=dlse, **arrays, **static, return_outputs=True)
    want_out, want_lse, want, allowance = reference_grads(q, k, v, **kwargs, delta_error=delta_error(q.dtype))
    approx_out, approx_lse, approx = reference_grads(q, k, v, **kwargs, compute_dtype=q.dtype)
    assert_close("out", out, want_out, approx_out, summed_terms("out", q, k))
    assert_close("lse", lse, want_lse, approx_lse)
    for name in want:
        assert_close(f"d{name}", grads[name], want[name], approx[name], summed_terms(name, q, k), allowance[name])


def test_xla_small_inputs_use_small_blocks():
    from ejkernel.kernels.flash_attention._xla import _block_size

    assert _block_size(128, 5) == 8
    assert _block_size(128, 67) == 72
    assert _block_size(128, 1000) == 128
    assert _block_size(16, 5) == 8


@pytest.mark.parametrize("seq_q,seq_k", [(0, 9), (9, 0)])
def test_xla_empty_sequences(seq_q, seq_k, rng):
    from ejkernel.kernels.flash_attention._xla import flash_attention_xla

    q = jnp.asarray(rng.standard_normal((1, seq_q, 2, 8)), jnp.float32)
    k = v = jnp.asarray(rng.standard_normal((1, seq_k, 2, 8)), jnp.float32)
    aux = jnp.asarray(rng.standard_normal(2), jnp.float32)
    out, lse = flash_attention_xla(q, k, v, softmax_aux=aux, softmax_scale=1.0)
    assert out.shape == q.shape and lse.shape == (1, 2, seq_q)
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    np.testing.assert_array_equal(np.asarray(lse), np.broadcast_to(np.asarray(aux)[None, :, None], lse.shape))


@pytest.mark.parametrize("causal", [False, True])
def test_xla_memory_is_linear(causal):
    """Neither pass allocates anything near a [seq_q, seq_k] score matrix: temporaries stay
    a few copies of the inputs (one score matrix would be 128 of them here)."""
    from ejkernel.kernels.flash_attention._xla import flash_attention_xla

    seq, head_dim = 8192, 64
    q = jax.ShapeDtypeStruct((1, seq, 1, head_dim), jnp.float32)

    def loss(q, k, v):
        out, lse = flash_attention_xla(q, k, v, softmax_scale=0.125, causal=causal)
        return jnp.sum(out) + jnp.sum(lse)

    input_bytes = seq * head_dim * 4
    for fn in (loss, jax.grad(loss, argnums=(0, 1, 2))):
        temp = jax.jit(fn).lower(q, q, q).compile().memory_analysis().temp_size_in_bytes
        assert temp < 8 * input_bytes, f"{temp} bytes of temporaries for {input_bytes}-byte inputs"


@pytest.mark.parametrize("sequences", [24, 1])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "plain"])
def test_cuda_packed_tiles_outnumber_the_blocks(impl, sequences, causal, rng):
    """Packed sequences of fresh random lengths (empty and length-1 ones among many, or one
    followed by padding rows), with more tiles than several rounds of the Hopper forward's
    persistent grid take."""
    if impl.name != "cuda":
        pytest.skip("the CUDA kernels' tile schedule")
    if sequences == 1:
        q_lengths = k_lengths = [int(rng.integers(1500, 2500))]
    else:
        q_lengths, k_lengths = ([int(x) for x in rng.choice([0, 1, *range(2, 400)], sequences)] for _ in range(2))
    layout = _packed(q_lengths, k_lengths, int(rng.integers(0, 140)), int(rng.integers(0, 12)))
    check_against_reference(impl, Case("packed_many_tiles", dtype="bfloat16", varlen=layout, q_heads=16, kv_heads=4,
                                       head_dim=128, causal=causal), rng)


def test_cuda_long_packed_sequence_matches_the_plain_call(impl, rng):
    """One causal packed sequence of at least 16384 rows (one block per tile in the Hopper
    forward, in sections of heads), with or without padding rows after it, against the plain
    call on the sequence's rows: the same tiles, so the same outputs and LSE up to rounding."""
    if impl.name != "cuda":
        pytest.skip("the CUDA kernels' tile schedule")
    from ejkernel.modules import flash_attention

    length = int(rng.integers(16384, 16900))
    rows = length + int(rng.choice([0, int(rng.integers(1, 140))]))
    q, k, v = (jnp.asarray(rng.standard_normal((1, rows, 8, 128)), jnp.bfloat16) for _ in range(3))
    cu = jnp.asarray([0, length], jnp.int32)
    out, lse = flash_attention(q, k, v, causal=True, cum_seqlens_q=cu, cum_seqlens_k=cu, platform="cuda",
                               return_lse=True)
    ref, ref_lse = flash_attention(q[:, :length], k[:, :length], v[:, :length], causal=True, platform="cuda",
                                   return_lse=True)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out)), "non-finite outputs (padding rows included)"
    error = np.linalg.norm(out[:, :length] - ref) / np.linalg.norm(ref)
    assert error < 1e-2, f"packed against plain: relative error {error:.3g} (rows {rows}, sequence {length})"
    lse_error = np.max(np.abs(np.asarray(lse)[..., :length] - np.asarray(ref_lse)))
    assert lse_error < 1e-3, f"packed against plain: LSE off by {lse_error:.3g} (rows {rows}, sequence {length})"


@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm_90 GPU and the Hopper kernels")
def test_cuda_deterministic_backward_survives_unordered_cum_seqlens(rng):
    """Offsets traced under jit are not checked; decreasing ones give meaningless values, but
    the deterministic backward, whose key blocks wait for each other's dQ turns, still ends."""
    from ejkernel.modules import flash_attention

    q, k, v = (jnp.asarray(rng.standard_normal((1, 400, 2, 128)), jnp.bfloat16) for _ in range(3))
    cu_q, cu_k = jnp.array([0, 300, 100, 400], jnp.int32), jnp.array([0, 350, 120, 400], jnp.int32)

    @jax.jit
    def grads(q, k, v, cu_q, cu_k):
        def loss(q, k, v):
            out = flash_attention(q, k, v, causal=True, cum_seqlens_q=cu_q, cum_seqlens_k=cu_k, deterministic=True,
                                  platform="cuda")
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    for grad, x in zip(jax.block_until_ready(grads(q, k, v, cu_q, cu_k)), (q, k, v)):
        assert grad.shape == x.shape
