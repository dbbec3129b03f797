// Flash attention: the parameters every backend (CPU, CUDA) takes, and their validation.
// semantics.h defines what each feature means.
#pragma once

#include <cstdint>
#include <string>

#include "runtime/status.h"
#include "runtime/tensor.h"

namespace ejk::flash_attention {

// Version of the operation's configs and cache entries; bump when a config's meaning changes.
constexpr int kOpVersion = 3;

// Tile configuration of the CPU kernel.
struct CpuConfig {
  int block_q = 64;   // query rows per task
  int block_k = 128;  // keys per inner tile
  int num_threads = 0;  // 0: all hardware threads
};

// Shapes (all tensors contiguous, row-major):
//   q            [B, Sq, Hq, D]      f32 | bf16 | f16
//   k, v         [B, Sk, Hkv, D]     same dtype as q; Hq % Hkv == 0
//   bias         [Bb, Hb, Sq, Sk]    optional, any float dtype; Bb in {1, B}, Hb in {1, Hq}
//   mask         [Bm, Hm, Sq, Sk]    optional, bool (1 byte; nonzero = attend); same broadcast
//   softmax_aux  [Hq]                optional sink logits, any float dtype
//   cu_seqlens_q, cu_seqlens_k [N+1] optional int32, together; then B == 1 and sequence n
//                                    holds rows [cu[n], cu[n+1]); rows past cu[N] are padding
//   q_segment_ids [B, Sq], kv_segment_ids [B, Sk]  optional int32, together
//   out          [B, Sq, Hq, D]      dtype of q
//   lse          [B, Hq, Sq]         f32 (natural log)
struct ForwardParams {
  TensorView q, k, v;
  TensorView bias, mask, softmax_aux;
  TensorView cu_seqlens_q, cu_seqlens_k;
  TensorView q_segment_ids, kv_segment_ids;
  float softmax_scale = 1.0f;
  bool causal = false;
  int64_t window_left = -1;   // < 0: unbounded
  int64_t window_right = -1;  // < 0: unbounded
  float logits_soft_cap = 0.0f;  // 0: off; otherwise > 0
  float dropout_prob = 0.0f;     // in [0, 1)
  uint32_t dropout_seed = 0;
  // The seed operand's words 1-3 where it has them (DropoutBatchHead), else null. Like the
  // tensors, host memory for the CPU kernel and device memory for the CUDA kernels.
  const uint32_t* dropout_origin = nullptr;

  TensorView out, lse;
};

// Backward: the forward's inputs, plus its outputs and the outputs' cotangents.
//   dlse         [B, Hq, Sq] f32, optional: cotangent of lse (d lse_i / d logit_ij = P_ij,
//                so it enters as D_i = rowsum(dout_i * out_i) - dlse_i)
//   dq, dk, dv   like q, k, v; dk and dv may both be f32 instead, unrounded, for a caller that
//                adds several calls' parts (a split of the query's rows) before rounding once
//   dbias        like bias (present iff bias is present and its gradient is wanted): f32, or
//                a bf16/f16 bias's own dtype where the bias has a plane per (batch, q head)
//                (!BiasGradSummed): each element is then written once, rounded once
//   dsoftmax_aux [Hq] f32 (present iff softmax_aux is present and its gradient is wanted)
struct BackwardParams {
  ForwardParams fwd;  // fwd.out and fwd.lse are inputs here
  TensorView dout, dlse;
  TensorView dq, dk, dv;
  TensorView dbias, dsoftmax_aux;
  bool deterministic = false;
};

// Derived sizes, filled by validation.
struct Dims {
  int64_t batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim, num_sequences;
  bool varlen;
};

// Whether several (batch, q head) pairs add into each element of the bias's gradient: the
// bias (or dbias, its shape) broadcasts over the batch or the heads. Such sums are kept in f32.
inline bool BiasGradSummed(const TensorView& bias_shaped, const Dims& d) {
  return bias_shaped.dim(0) != d.batch || bias_shaped.dim(1) != d.num_q_heads;
}

// Checks every shape, dtype and attribute; the message names the argument and its shape.
// Does not read tensor data.
StatusOr<Dims> ValidateForward(const ForwardParams& p);
StatusOr<Dims> ValidateBackward(const BackwardParams& p);
// The dropout seed operand: one 32-bit integer, or kDropoutSeedWithOrigin of them, the seed
// and the origin words of DropoutBatchHead (semantics.h).
constexpr int64_t kDropoutSeedWithOrigin = 4;
Status CheckDropoutSeedOperand(int64_t element_count, bool is_32_bit_integer);
// Origin words (host memory) of a part with num_q_heads heads: its heads lie inside the call's.
Status CheckDropoutOrigin(const uint32_t* origin, int64_t num_q_heads);
// Reads cu_seqlens (host memory): starts at 0, non-decreasing, ends within the array.
Status ValidateCuSeqlensValues(const ForwardParams& p, const Dims& dims);

// CPU kernels (cpu.cc). Validate, then run; host memory only.
Status ForwardCpu(const ForwardParams& p, const CpuConfig& cfg);
Status BackwardCpu(const BackwardParams& p, const CpuConfig& cfg);

}  // namespace ejk::flash_attention
