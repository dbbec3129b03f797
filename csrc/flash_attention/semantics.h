// The meaning of every flash attention feature, in one place, for host and device code.
// The XLA implementation (python/ejkernel/kernels/flash_attention/_xla.py) and the float64
// reference in the tests implement exactly these formulas; change them together.
//
// For query i and key j of one sequence (indices local to the sequence, Sq queries and
// Sk keys), with scale s, soft cap c, bias b and sink logit a:
//   logit  = s * <q_i, k_j>
//   logit  = c * tanh(logit / c)                     if c > 0
//   logit += b[i, j]                                  if a bias is given
//   visible(i, j) = mask[i, j] && segment_q[i] == segment_k[j] && window/causal (below)
//   P[i, j] = exp(logit - lse_i) for visible keys, 0 otherwise,
//   lse_i   = log(exp(a) + sum_visible exp(logit))    (the exp(a) term only with sinks)
//   out_i   = sum_j dropout(P[i, j]) v_j
// A query with no visible key (and no sink) has out_i = 0 and lse_i = -inf. With packed
// sequences, rows past the last cu_seqlens_q offset are padding: out 0 and lse -inf, sinks or not.
//
// Causal and window masks are aligned bottom-right, like FlashAttention: with
// offset = Sk - Sq, key j is visible to query i iff
//   causal:             j <= i + offset
//   window_left  >= 0:  j >= i + offset - window_left
//   window_right >= 0:  j <= i + offset + window_right
// A negative window side means unbounded.
//
// Dropout keeps P[i, j] with probability 1 - p and scales it by 1 / (1 - p); whether an
// element is kept is a pure function of (seed, batch * num_q_heads + head, i, j), with i the
// query's index in the batch row (for packed sequences: its packed index) and j the key's
// index in its sequence (the batch row's without packed sequences), so forward and backward,
// and every platform, draw the same mask (DropoutKeep below).
#pragma once

#include <cmath>
#include <cstdint>

#include "runtime/tensor.h"

namespace ejk::flash_attention {

EJK_HOST_DEVICE bool KeyVisible(int64_t i, int64_t j, int64_t offset, bool causal,
                                int64_t window_left, int64_t window_right) {
  const int64_t diagonal = i + offset;
  if (causal && j > diagonal) return false;
  if (window_left >= 0 && j < diagonal - window_left) return false;
  if (window_right >= 0 && j > diagonal + window_right) return false;
  return true;
}

// The keys [*begin, *end) that the causal/window masks leave visible to query i, clipped
// to [0, num_keys). Used to skip fully masked key tiles.
EJK_HOST_DEVICE void VisibleKeyRange(int64_t i, int64_t num_keys, int64_t offset, bool causal,
                                     int64_t window_left, int64_t window_right, int64_t* begin,
                                     int64_t* end) {
  const int64_t diagonal = i + offset;
  int64_t lo = 0, hi = num_keys;
  if (window_left >= 0 && diagonal - window_left > lo) lo = diagonal - window_left;
  if (causal && diagonal + 1 < hi) hi = diagonal + 1;
  if (window_right >= 0 && diagonal + window_right + 1 < hi) hi = diagonal + window_right + 1;
  if (hi < lo) hi = lo;
  *begin = lo;
  *end = hi;
}

EJK_HOST_DEVICE float SoftCap(float logit, float cap) {
  return cap > 0.0f ? cap * tanhf(logit / cap) : logit;
}

// d(SoftCap)/d(logit), given the capped value: 1 - (capped / cap)^2.
EJK_HOST_DEVICE float SoftCapGrad(float capped, float cap) {
  if (cap <= 0.0f) return 1.0f;
  const float t = capped / cap;
  return 1.0f - t * t;
}

// MurmurHash3's 32-bit finaliser: a bijection with full avalanche. A template so the CPU
// kernel can run it on vectors of uint32 lanes too.
template <typename U32>
EJK_HOST_DEVICE U32 Fmix32(U32 x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return x;
}

// The (batch, head) index the dropout hash draws a row by. `origin` is null for a whole call,
// or, for a call that computes part of a larger one (one device's batch rows and heads of a
// call split over devices), the seed operand's words 1-3: the part's first batch row, its
// first q head and the larger call's q heads, so that every part draws the masks the whole
// call would. A pointer into the operand (device memory in CUDA kernels): the origin is
// known only at run time.
EJK_HOST_DEVICE uint32_t DropoutBatchHead(const uint32_t* origin, uint32_t num_q_heads, uint32_t batch,
                                          uint32_t head) {
  if (origin == nullptr) return batch * num_q_heads + head;
  return (origin[0] + batch) * origin[2] + origin[1] + head;
}

// Per-(batch, head) and per-row parts of the dropout hash, hoisted out of the loops.
EJK_HOST_DEVICE uint32_t DropoutHeadKey(uint32_t seed, uint32_t batch_head) {
  return Fmix32(batch_head ^ Fmix32(seed ^ 0x9e3779b9u));
}
EJK_HOST_DEVICE uint32_t DropoutRowKeyOfHead(uint32_t head_key, uint32_t query_index) {
  return Fmix32(query_index ^ head_key);
}
EJK_HOST_DEVICE uint32_t DropoutRowKey(uint32_t seed, uint32_t batch_head, uint32_t query_index) {
  return DropoutRowKeyOfHead(DropoutHeadKey(seed, batch_head), query_index);
}

// Each element draws 16 bits: keys j and j + 8 of each group of 16 (j % 16 < 8; j local to
// the sequence, as above) share one hash, Fmix32(j ^ row key), j taking its low half and
// j + 8 its high half, so that kernels whose threads hold keys 8 apart (the tensor cores'
// fragments) hash once per two elements. An element whose draw is below the threshold is
// dropped.
template <typename U32>
EJK_HOST_DEVICE U32 DropoutDraw(U32 row_key, U32 key_index) {
  return (Fmix32((key_index & ~8u) ^ row_key) >> ((key_index & 8u) << 1)) & 0xffffu;
}

// p * 2^16, below 2^16 for p in [0, 1).
inline uint32_t DropoutThreshold(float dropout_prob) {
  return static_cast<uint32_t>(static_cast<double>(dropout_prob) * 65536.0);
}

EJK_HOST_DEVICE bool DropoutKeep(uint32_t row_key, uint32_t key_index, uint32_t threshold) {
  return DropoutDraw(row_key, key_index) >= threshold;
}

// DropoutKeep of keys key_index and key_index + 8 of one row (key_index % 16 < 8) from their
// one hash, against the threshold moved into the top 16 bits (threshold << 16): one
// comparison per element in the Hopper kernels' inner loops.
EJK_HOST_DEVICE void DropoutKeepPair(uint32_t row_key, uint32_t key_index, uint32_t shifted_threshold, bool& keep,
                                     bool& keep_plus_8) {
  const uint32_t hash = Fmix32(key_index ^ row_key);
  keep = hash << 16 >= shifted_threshold;
  keep_plus_8 = hash >= shifted_threshold;
}

}  // namespace ejk::flash_attention
