// XLA FFI handlers of the CPU flash attention, and its registry entry.
//
// Optional operands travel as zero-element placeholders; the `operands` attribute says
// which are real (OperandFlag bits), so absent ones become absent TensorViews.
#include <cstdint>

#include "flash_attention/ffi_common.h"
#include "flash_attention/params.h"
#include "runtime/ffi_util.h"
#include "runtime/registry.h"

namespace ffi = xla::ffi;

namespace ejk::flash_attention {
namespace {

CpuConfig CpuConfigFromAttrs(int64_t block_q, int64_t block_k, int64_t num_threads) {
  CpuConfig cfg;
  cfg.block_q = static_cast<int>(block_q);
  cfg.block_k = static_cast<int>(block_k);
  cfg.num_threads = static_cast<int>(num_threads);
  return cfg;
}

Status CheckCpuConfig(const CpuConfig& cfg) {
  if (cfg.block_q < 1 || cfg.block_q > 1024 || cfg.block_k < 1 || cfg.block_k > 4096 ||
      cfg.num_threads < 0) {
    return Status::InvalidArgument("config: block_q in [1, 1024], block_k in [1, 4096] and "
                                   "num_threads >= 0 required, got block_q=" +
                                   std::to_string(cfg.block_q) + " block_k=" +
                                   std::to_string(cfg.block_k) +
                                   " num_threads=" + std::to_string(cfg.num_threads));
  }
  return Status::Ok();
}

// The seed (host memory), and the origin words where the operand has them, checked against
// the call's heads: a part must lie inside the call it is a part of.
Status ReadSeed(const ffi::AnyBuffer& seed, ForwardParams* p) {
  EJK_ASSIGN_OR_RETURN(const uint32_t* words, DropoutSeedWords(seed, p));
  if (words == nullptr) return Status::Ok();
  p->dropout_seed = words[0];
  return p->dropout_origin == nullptr ? Status::Ok() : CheckDropoutOrigin(p->dropout_origin, p->q.dim(2));
}

ffi::Error ForwardImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                       ffi::AnyBuffer mask, ffi::AnyBuffer softmax_aux, ffi::AnyBuffer cu_seqlens_q,
                       ffi::AnyBuffer cu_seqlens_k, ffi::AnyBuffer q_segment_ids,
                       ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer dropout_seed,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                       ffi::Result<ffi::AnyBuffer> /*workspace: 0 bytes on the CPU*/,
                       float softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                       float logits_soft_cap, float dropout_prob, int64_t operands, int64_t block_q,
                       int64_t block_k, int64_t num_threads, int64_t num_warps,
                       int64_t num_stages, bool deterministic) {
  ForwardParams p;
  EJK_FFI_ASSIGN_OR_RETURN(p, BuildForwardParams(q, k, v, bias, mask, softmax_aux, cu_seqlens_q,
                                                 cu_seqlens_k, q_segment_ids, kv_segment_ids,
                                                 softmax_scale, causal, window_left, window_right,
                                                 logits_soft_cap, dropout_prob, operands));
  if (Status s = ReadSeed(dropout_seed, &p); !s.ok()) return ToFfiError(s);
  EJK_FFI_ASSIGN_OR_RETURN(p.out, ViewOf(*out, "out"));
  EJK_FFI_ASSIGN_OR_RETURN(p.lse, ViewOf(*lse, "lse"));
  const CpuConfig cfg = CpuConfigFromAttrs(block_q, block_k, num_threads);
  if (Status s = CheckCpuConfig(cfg); !s.ok()) return ToFfiError(s);
  return ToFfiError(ForwardCpu(p, cfg));
}

ffi::Error BackwardImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                        ffi::AnyBuffer dout, ffi::AnyBuffer lse, ffi::AnyBuffer dlse,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer softmax_aux,
                        ffi::AnyBuffer cu_seqlens_q, ffi::AnyBuffer cu_seqlens_k,
                        ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                        ffi::AnyBuffer dropout_seed, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> dsoftmax_aux,
                        ffi::Result<ffi::AnyBuffer> /*workspace: 0 bytes on the CPU*/,
                        float softmax_scale, bool causal, int64_t window_left,
                        int64_t window_right, float logits_soft_cap, float dropout_prob,
                        int64_t operands, int64_t block_q, int64_t block_k, int64_t num_threads,
                        int64_t num_warps, int64_t num_stages, bool deterministic) {
  BackwardParams p;
  EJK_FFI_ASSIGN_OR_RETURN(p.fwd, BuildForwardParams(q, k, v, bias, mask, softmax_aux, cu_seqlens_q,
                                                     cu_seqlens_k, q_segment_ids, kv_segment_ids,
                                                     softmax_scale, causal, window_left,
                                                     window_right, logits_soft_cap, dropout_prob,
                                                     operands));
  if (Status s = ReadSeed(dropout_seed, &p.fwd); !s.ok()) return ToFfiError(s);
  EJK_FFI_ASSIGN_OR_RETURN(p.fwd.out, ViewOf(out, "out"));
  EJK_FFI_ASSIGN_OR_RETURN(p.fwd.lse, ViewOf(lse, "lse"));
  EJK_FFI_ASSIGN_OR_RETURN(p.dout, ViewOf(dout, "dout"));
  EJK_FFI_ASSIGN_OR_RETURN(p.dlse, OptionalViewOf(dlse, "dlse", operands & kHasDlse));
  EJK_FFI_ASSIGN_OR_RETURN(p.dq, ViewOf(*dq, "dq"));
  EJK_FFI_ASSIGN_OR_RETURN(p.dk, ViewOf(*dk, "dk"));
  EJK_FFI_ASSIGN_OR_RETURN(p.dv, ViewOf(*dv, "dv"));
  EJK_FFI_ASSIGN_OR_RETURN(p.dbias, OptionalViewOf(*dbias, "dbias", WantsBiasGrad(operands)));
  EJK_FFI_ASSIGN_OR_RETURN(p.dsoftmax_aux,
                           OptionalViewOf(*dsoftmax_aux, "dsoftmax_aux", operands & kHasSoftmaxAux));
  p.deterministic = true;  // the CPU backward is always deterministic
  const CpuConfig cfg = CpuConfigFromAttrs(block_q, block_k, num_threads);
  if (Status s = CheckCpuConfig(cfg); !s.ok()) return ToFfiError(s);
  return ToFfiError(BackwardCpu(p, cfg));
}

}  // namespace
}  // namespace ejk::flash_attention

EJK_EXPORT XLA_FFI_Error* EjkFlashAttentionForwardCpu(XLA_FFI_CallFrame* call_frame);
EJK_EXPORT XLA_FFI_Error* EjkFlashAttentionBackwardCpu(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(EjkFlashAttentionForwardCpu, ejk::flash_attention::ForwardImpl,
                              EJK_FLASH_ATTENTION_FORWARD_BINDING(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(EjkFlashAttentionBackwardCpu, ejk::flash_attention::BackwardImpl,
                              EJK_FLASH_ATTENTION_BACKWARD_BINDING(ffi::Ffi::Bind()));

namespace ejk::flash_attention {
namespace {

// Tile sizes for the CPU kernel: a query block whose f32 accumulator and a key tile stay
// in L2 (per core ~1 MiB on current x86 servers) with room for the K^T / V tiles.
Config CpuHeuristic(const nlohmann::json& signature) {
  const int64_t head_dim = signature.value("head_dim", 128);
  const int64_t seqlen_q = signature.value("seqlen_q", 1024);
  int block_q = head_dim >= 256 ? 32 : 64;
  if (seqlen_q < block_q) block_q = static_cast<int>(std::max<int64_t>(seqlen_q, 1));
  return Config{{"block_q", block_q}, {"block_k", head_dim >= 256 ? 64 : 128}, {"num_threads", 0}};
}

std::vector<Config> CpuCandidates(const nlohmann::json& signature) {
  std::vector<Config> configs;
  for (int block_q : {16, 32, 64, 128}) {
    for (int block_k : {64, 128, 256}) {
      configs.push_back(Config{{"block_q", block_q}, {"block_k", block_k}, {"num_threads", 0}});
    }
  }
  return configs;
}

KernelEntry CpuEntry() {
  KernelEntry e;
  e.op = "flash_attention";
  e.platform = Platform::kCpu;
  e.backend = Backend::kCpu;
  e.priority = 100;
  e.name = "flash_attention_cpu";
  e.op_version = kOpVersion;
  e.features = AllFeatures();
  e.ffi_targets = {{"ejkernel_flash_attention_fwd_cpu", "EjkFlashAttentionForwardCpu"},
                   {"ejkernel_flash_attention_bwd_cpu", "EjkFlashAttentionBackwardCpu"}};
  e.heuristic = CpuHeuristic;
  e.candidates = CpuCandidates;
  return e;
}

}  // namespace
}  // namespace ejk::flash_attention

EJK_REGISTER_KERNEL(flash_attention_cpu, ejk::flash_attention::CpuEntry());
