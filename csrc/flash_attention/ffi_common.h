// What the CPU and CUDA FFI handlers of flash attention share: the operand layout,
// the attribute names, and turning buffers into ForwardParams.
#pragma once

#include <string>
#include <vector>

#include "flash_attention/params.h"
#include "runtime/ffi_util.h"

namespace ejk::flash_attention {

// Bits of the `operands` attribute: which optional operands are real.
enum OperandFlag : int64_t {
  kHasBias = 1,
  kHasMask = 2,
  kHasSoftmaxAux = 4,
  kHasCuSeqlens = 8,
  kHasSegmentIds = 16,
  kHasDlse = 32,
  kNoBiasGrad = 64,  // backward: a bias is given but its gradient is not wanted
};

// Whether the backward writes dbias.
inline bool WantsBiasGrad(int64_t operands) { return (operands & kHasBias) && !(operands & kNoBiasGrad); }

inline std::vector<std::string> AllFeatures() {
  return {"causal",      "sliding_window", "logits_soft_cap", "softmax_aux", "bias",
          "attention_mask", "cum_seqlens",  "segment_ids",     "dropout",     "lse",
          "gqa",          "backward",       "bias_grad",       "softmax_aux_grad",
          "deterministic_backward"};
}

// The dropout seed operand's words, in the handler's memory (host for the CPU, device for
// CUDA), after its count and dtype are checked; p->dropout_origin points at the origin words
// where it has them (DropoutBatchHead). Null without dropout.
inline StatusOr<const uint32_t*> DropoutSeedWords(const xla::ffi::AnyBuffer& seed, ForwardParams* p) {
  if (p->dropout_prob <= 0.0f) return static_cast<const uint32_t*>(nullptr);
  EJK_RETURN_IF_ERROR(CheckDropoutSeedOperand(seed.element_count(), seed.element_type() == xla::ffi::DataType::U32 ||
                                                                        seed.element_type() == xla::ffi::DataType::S32));
  const auto* words = static_cast<const uint32_t*>(seed.untyped_data());
  if (seed.element_count() == kDropoutSeedWithOrigin) p->dropout_origin = words + 1;
  return words;
}

inline StatusOr<ForwardParams> BuildForwardParams(
    const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k, const xla::ffi::AnyBuffer& v,
    const xla::ffi::AnyBuffer& bias, const xla::ffi::AnyBuffer& mask,
    const xla::ffi::AnyBuffer& softmax_aux, const xla::ffi::AnyBuffer& cu_seqlens_q,
    const xla::ffi::AnyBuffer& cu_seqlens_k, const xla::ffi::AnyBuffer& q_segment_ids,
    const xla::ffi::AnyBuffer& kv_segment_ids, float softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, float logits_soft_cap, float dropout_prob,
    int64_t operands) {
  ForwardParams p;
  EJK_ASSIGN_OR_RETURN(p.q, ViewOf(q, "query"));
  EJK_ASSIGN_OR_RETURN(p.k, ViewOf(k, "key"));
  EJK_ASSIGN_OR_RETURN(p.v, ViewOf(v, "value"));
  EJK_ASSIGN_OR_RETURN(p.bias, OptionalViewOf(bias, "bias", operands & kHasBias));
  EJK_ASSIGN_OR_RETURN(p.mask, OptionalViewOf(mask, "attention_mask", operands & kHasMask));
  EJK_ASSIGN_OR_RETURN(p.softmax_aux,
                       OptionalViewOf(softmax_aux, "softmax_aux", operands & kHasSoftmaxAux));
  EJK_ASSIGN_OR_RETURN(p.cu_seqlens_q,
                       OptionalViewOf(cu_seqlens_q, "cum_seqlens_q", operands & kHasCuSeqlens));
  EJK_ASSIGN_OR_RETURN(p.cu_seqlens_k,
                       OptionalViewOf(cu_seqlens_k, "cum_seqlens_k", operands & kHasCuSeqlens));
  EJK_ASSIGN_OR_RETURN(p.q_segment_ids,
                       OptionalViewOf(q_segment_ids, "q_segment_ids", operands & kHasSegmentIds));
  EJK_ASSIGN_OR_RETURN(p.kv_segment_ids,
                       OptionalViewOf(kv_segment_ids, "kv_segment_ids", operands & kHasSegmentIds));
  p.softmax_scale = softmax_scale;
  p.causal = causal;
  p.window_left = window_left;
  p.window_right = window_right;
  p.logits_soft_cap = logits_soft_cap;
  p.dropout_prob = dropout_prob;
  return p;
}

}  // namespace ejk::flash_attention

// Operands and attributes, in order; the CPU and CUDA handlers bind the same layout. The
// last result of each is the call's device workspace, sized by the registry entry's
// workspace_bytes (0 bytes on the CPU): XLA owns it, so a handler that allocates nothing can
// be captured into a command buffer.
#define EJK_FLASH_ATTENTION_OPTIONAL_OPERANDS(b)                                       \
  (b).Arg<xla::ffi::AnyBuffer>() /* bias */                                            \
      .Arg<xla::ffi::AnyBuffer>() /* attention_mask */                                 \
      .Arg<xla::ffi::AnyBuffer>() /* softmax_aux */                                    \
      .Arg<xla::ffi::AnyBuffer>() /* cum_seqlens_q */                                  \
      .Arg<xla::ffi::AnyBuffer>() /* cum_seqlens_k */                                  \
      .Arg<xla::ffi::AnyBuffer>() /* q_segment_ids */                                  \
      .Arg<xla::ffi::AnyBuffer>() /* kv_segment_ids */                                 \
      .Arg<xla::ffi::AnyBuffer>() /* dropout_seed */

#define EJK_FLASH_ATTENTION_ATTRIBUTES(b)                                              \
  (b).Attr<float>("softmax_scale")                                                     \
      .Attr<bool>("causal")                                                            \
      .Attr<int64_t>("window_left")                                                    \
      .Attr<int64_t>("window_right")                                                   \
      .Attr<float>("logits_soft_cap")                                                  \
      .Attr<float>("dropout_prob")                                                     \
      .Attr<int64_t>("operands")                                                       \
      .Attr<int64_t>("block_q")                                                        \
      .Attr<int64_t>("block_k")                                                        \
      .Attr<int64_t>("num_threads")                                                   \
      .Attr<int64_t>("num_warps")                                                     \
      .Attr<int64_t>("num_stages")                                                    \
      .Attr<bool>("deterministic")

#define EJK_FLASH_ATTENTION_FORWARD_BINDING(b)                                         \
  EJK_FLASH_ATTENTION_ATTRIBUTES(                                                      \
      EJK_FLASH_ATTENTION_OPTIONAL_OPERANDS((b).Arg<xla::ffi::AnyBuffer>() /* query */ \
                                                .Arg<xla::ffi::AnyBuffer>() /* key */  \
                                                .Arg<xla::ffi::AnyBuffer>() /* value */) \
          .Ret<xla::ffi::AnyBuffer>() /* out */                                        \
          .Ret<xla::ffi::AnyBuffer>() /* lse */                                        \
          .Ret<xla::ffi::AnyBuffer>() /* workspace */)

#define EJK_FLASH_ATTENTION_BACKWARD_BINDING(b)                                        \
  EJK_FLASH_ATTENTION_ATTRIBUTES(                                                      \
      EJK_FLASH_ATTENTION_OPTIONAL_OPERANDS((b).Arg<xla::ffi::AnyBuffer>() /* query */ \
                                                .Arg<xla::ffi::AnyBuffer>() /* key */  \
                                                .Arg<xla::ffi::AnyBuffer>() /* value */ \
                                                .Arg<xla::ffi::AnyBuffer>() /* out */  \
                                                .Arg<xla::ffi::AnyBuffer>() /* dout */ \
                                                .Arg<xla::ffi::AnyBuffer>() /* lse */  \
                                                .Arg<xla::ffi::AnyBuffer>() /* dlse */) \
          .Ret<xla::ffi::AnyBuffer>() /* dq */                                         \
          .Ret<xla::ffi::AnyBuffer>() /* dk */                                         \
          .Ret<xla::ffi::AnyBuffer>() /* dv */                                         \
          .Ret<xla::ffi::AnyBuffer>() /* dbias */                                      \
          .Ret<xla::ffi::AnyBuffer>() /* dsoftmax_aux */                               \
          .Ret<xla::ffi::AnyBuffer>() /* workspace */)
