// XLA FFI handlers of the CUDA flash attention and its registry entry.
//
// Each direction runs the Hopper kernel where it serves the call (sm_90, its feature subset)
// and the portable mma.sync kernel otherwise.
// Neither synchronises with the host: cu_seqlens and the dropout seed stay on the device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "flash_attention/cuda.h"
#include "flash_attention/cuda_build_scope.h"
#include "flash_attention/ffi_common.h"
#include "flash_attention/params.h"
#include "runtime/cuda_device.h"
#include "runtime/ffi_util.h"
#include "runtime/registry.h"

namespace ffi = xla::ffi;

namespace ejk::flash_attention {
namespace {

// Why the CUDA kernels cannot take a call of this dtype and head dim ("" when they can).
std::string UnsupportedReason(const std::string& dtype, int64_t head_dim) {
  if (dtype != "bfloat16" && dtype != "float16") {
    return "the CUDA kernels take bfloat16 or float16 inputs, got " + dtype;
  }
  if (dtype == "float16" && !kFloat16Built) return "float16 is not built (EJKERNEL_CUDA_FEATURES)";
  return HeadDimUnsupportedReason(head_dim);
}

StatusOr<CudaConfig> ConfigFromAttrs(int64_t block_q, int64_t block_k, int64_t num_warps,
                                     int64_t num_stages) {
  if (block_q < 1 || block_q > 256 || block_k < 1 || block_k > 256 || num_warps < 0 ||
      num_warps > 16 || num_stages < 0 || num_stages > 4) {
    return Status::InvalidArgument(
        "config: block_q and block_k in [1, 256], num_warps in [0, 16], num_stages in [0, 4] "
        "required, got block_q=" + std::to_string(block_q) + " block_k=" + std::to_string(block_k) +
        " num_warps=" + std::to_string(num_warps) + " num_stages=" + std::to_string(num_stages));
  }
  CudaConfig cfg;
  cfg.block_q = static_cast<int>(block_q);
  cfg.block_k = static_cast<int>(block_k);
  cfg.num_warps = static_cast<int>(num_warps);
  cfg.num_stages = static_cast<int>(num_stages);
  return cfg;
}

Status CheckSupported(const ForwardParams& p, const Dims& dims) {
  const std::string reason = UnsupportedReason(DTypeName(p.q.dtype), dims.head_dim);
  if (!reason.empty()) return Status::Unimplemented("flash attention CUDA: " + reason);
  return MmaSupports(p, dims);
}

// Device workspace of a call: the handler's last result, sized from shapes and flags alone
// (the Python front end asks the registry entry's workspace_bytes), so that XLA owns it and
// the launch can be captured into a command buffer. Where the Hopper kernels take the call on
// this device, their scratch (segment ranges, a folded bias: hopper::PlanFold); the
// backward takes the larger of its two kernels' needs, which one runs being decided per call.
size_t ForwardWorkspaceBytes(DType dtype, const Dims& dims, const hopper::ForwardCall& call) {
  return HopperSupportsKind(dtype, call, CurrentCudaDevice()).ok() ? ForwardHopperScratchBytes(dims, call) : 0;
}
size_t BackwardWorkspaceBytes(DType dtype, const Dims& dims, const hopper::ForwardCall& call, bool deterministic) {
  const bool hopper_takes = HopperSupportsKind(dtype, call, CurrentCudaDevice()).ok() &&
                           hopper::BackwardDenseUnsupportedReason(call).empty();
  const size_t hopper = hopper_takes ? BackwardHopperScratchBytes(dims, call, deterministic) : 0;
  return std::max(hopper, BackwardMmaScratchBytes(dims, deterministic));
}

// The workspace result, or an error naming both sizes when it is smaller than the call needs.
StatusOr<void*> WorkspaceOf(ffi::AnyBuffer& workspace, size_t needed, const char* pass) {
  if (workspace.size_bytes() < needed) {
    return Status::InvalidArgument(std::string("flash attention ") + pass + ": workspace has " +
                                   std::to_string(workspace.size_bytes()) + " bytes, the call needs " +
                                   std::to_string(needed) + " (size it with the registry's workspace_bytes)");
  }
  return needed > 0 ? workspace.untyped_data() : nullptr;
}

ffi::Error ForwardImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer softmax_aux,
                       ffi::AnyBuffer cu_seqlens_q, ffi::AnyBuffer cu_seqlens_k, ffi::AnyBuffer q_segment_ids,
                       ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer dropout_seed,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                       ffi::Result<ffi::AnyBuffer> workspace, float softmax_scale, bool causal,
                       int64_t window_left, int64_t window_right, float logits_soft_cap, float dropout_prob,
                       int64_t operands, int64_t block_q, int64_t block_k, int64_t num_threads,
                       int64_t num_warps, int64_t num_stages, bool deterministic) {
  CudaForwardArgs args;
  EJK_FFI_ASSIGN_OR_RETURN(args.p, BuildForwardParams(q, k, v, bias, mask, softmax_aux, cu_seqlens_q,
                                                      cu_seqlens_k, q_segment_ids, kv_segment_ids,
                                                      softmax_scale, causal, window_left,
                                                      window_right, logits_soft_cap, dropout_prob,
                                                      operands));
  EJK_FFI_ASSIGN_OR_RETURN(args.dropout_seed, DropoutSeedWords(dropout_seed, &args.p));
  EJK_FFI_ASSIGN_OR_RETURN(args.p.out, ViewOf(*out, "out"));
  EJK_FFI_ASSIGN_OR_RETURN(args.p.lse, ViewOf(*lse, "lse"));
  EJK_FFI_ASSIGN_OR_RETURN(args.dims, ValidateForward(args.p));
  EJK_FFI_ASSIGN_OR_RETURN(CudaConfig cfg, ConfigFromAttrs(block_q, block_k, num_warps, num_stages));
  if (Status s = CheckSupported(args.p, args.dims); !s.ok()) return ToFfiError(s);
  EJK_FFI_ASSIGN_OR_RETURN(args.scratch,
                           WorkspaceOf(*workspace,
                                       ForwardWorkspaceBytes(args.p.q.dtype, args.dims,
                                                             hopper::ForwardCallOf(args.p, args.dims)),
                                       "forward"));
  if (HopperSupports(args.p, args.dims, CurrentCudaDevice()).ok()) return ToFfiError(ForwardHopper(args, cfg, stream));
  return ToFfiError(ForwardMma(args, cfg, stream));
}

ffi::Error BackwardImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::AnyBuffer lse, ffi::AnyBuffer dlse,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer softmax_aux,
                        ffi::AnyBuffer cu_seqlens_q, ffi::AnyBuffer cu_seqlens_k, ffi::AnyBuffer q_segment_ids,
                        ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer dropout_seed,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::AnyBuffer> dsoftmax_aux, ffi::Result<ffi::AnyBuffer> workspace,
                        float softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                        float logits_soft_cap, float dropout_prob, int64_t operands, int64_t block_q,
                        int64_t block_k, int64_t num_threads, int64_t num_warps, int64_t num_stages,
                        bool deterministic) {
  CudaBackwardArgs args;
  BackwardParams& p = args.p;
  EJK_FFI_ASSIGN_OR_RETURN(p.fwd, BuildForwardParams(q, k, v, bias, mask, softmax_aux, cu_seqlens_q,
                                                     cu_seqlens_k, q_segment_ids, kv_segment_ids,
                                                     softmax_scale, causal, window_left,
                                                     window_right, logits_soft_cap, dropout_prob,
                                                     operands));
  EJK_FFI_ASSIGN_OR_RETURN(args.dropout_seed, DropoutSeedWords(dropout_seed, &p.fwd));
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
  p.deterministic = deterministic;
  EJK_FFI_ASSIGN_OR_RETURN(args.dims, ValidateBackward(p));
  EJK_FFI_ASSIGN_OR_RETURN(CudaConfig cfg, ConfigFromAttrs(block_q, block_k, num_warps, num_stages));
  if (Status s = CheckSupported(p.fwd, args.dims); !s.ok()) return ToFfiError(s);
  EJK_FFI_ASSIGN_OR_RETURN(
      void* scratch,
      WorkspaceOf(*workspace,
                  BackwardWorkspaceBytes(p.fwd.q.dtype, args.dims, hopper::ForwardCallOf(p.fwd, args.dims),
                                         p.deterministic),
                  "backward"));
  if (HopperBackwardSupports(p, args.dims, CurrentCudaDevice()).ok()) {
    return ToFfiError(BackwardHopper(args, scratch, stream));
  }
  return ToFfiError(BackwardMma(args, cfg, scratch, stream));
}

bool HasFeature(const nlohmann::json& signature, const char* feature) {
  const auto it = signature.find("features");
  return it != signature.end() && it->is_array() && std::find(it->begin(), it->end(), feature) != it->end();
}

// The batch and head dims of the signature's "bias_shape" or "mask_shape" ([B|1, H|1, Sq, Sk]),
// 1 and 1 where it has none.
void BroadcastDims(const nlohmann::json& signature, const char* key, int64_t* batch, int64_t* heads) {
  *batch = *heads = 1;
  const auto it = signature.find(key);
  if (it == signature.end() || !it->is_array() || it->size() != 4) return;
  if ((*it)[0].is_number_integer()) *batch = (*it)[0].get<int64_t>();
  if ((*it)[1].is_number_integer()) *heads = (*it)[1].get<int64_t>();
}

// A call as the Hopper kernels' dispatch sees it, from a registry signature: the shapes, the
// AttentionArgs.features() names, the window's sides, the bias dtype and the bias's and mask's
// shapes.
hopper::ForwardCall ForwardCallOfSignature(const nlohmann::json& signature) {
  hopper::ForwardCall call;
  const std::string dtype_name = signature.value("dtype", std::string());
  call.head_dim = KernelHeadDim(signature.value("head_dim", int64_t{0}));
  call.seqlen_q = signature.value("seqlen_q", int64_t{0});
  call.seqlen_k = signature.value("seqlen_k", int64_t{0});
  call.varlen = HasFeature(signature, "cum_seqlens");
  call.causal = HasFeature(signature, "causal");
  call.window_left = signature.value("window_left", int64_t{-1});
  call.window_right = signature.value("window_right", int64_t{-1});
  call.soft_cap = HasFeature(signature, "logits_soft_cap");
  call.segment_ids = HasFeature(signature, "segment_ids");
  call.dropout = HasFeature(signature, "dropout");
  call.bias = HasFeature(signature, "bias");
  call.mask = HasFeature(signature, "attention_mask");
  const std::string bias_dtype = signature.value("bias_dtype", dtype_name);
  call.bias_f32 = call.bias && bias_dtype != dtype_name;
  call.bias_converts = call.bias_f32 && bias_dtype != "float32";
  int64_t bias_batch, bias_heads, mask_batch, mask_heads;
  BroadcastDims(signature, "bias_shape", &bias_batch, &bias_heads);
  BroadcastDims(signature, "mask_shape", &mask_batch, &mask_heads);
  hopper::PlanFold(bias_batch, bias_heads, mask_batch, mask_heads, &call);
  return call;
}

// Workspace bytes for pass "forward" or "backward" of a call with this signature
// (AttentionArgs.signature(), plus "deterministic").
StatusOr<int64_t> CudaWorkspaceBytes(const nlohmann::json& signature, const std::string& pass) {
  Dims dims{};
  EJK_RETURN_IF_ERROR(ReadSignatureCounts(signature, "flash attention workspace",
                                          {{"batch", &dims.batch},
                                           {"seqlen_q", &dims.seqlen_q},
                                           {"seqlen_k", &dims.seqlen_k},
                                           {"num_q_heads", &dims.num_q_heads},
                                           {"num_kv_heads", &dims.num_kv_heads},
                                           {"head_dim", &dims.head_dim}}));
  DType dtype;
  if (!DTypeFromName(signature.value("dtype", std::string()), &dtype)) return int64_t{0};  // no CUDA kernel takes it
  const hopper::ForwardCall call = ForwardCallOfSignature(signature);
  if (pass == "forward") return static_cast<int64_t>(ForwardWorkspaceBytes(dtype, dims, call));
  if (pass == "backward") {
    return static_cast<int64_t>(BackwardWorkspaceBytes(dtype, dims, call, signature.value("deterministic", false)));
  }
  return Status::InvalidArgument("flash attention workspace: pass must be 'forward' or 'backward', got '" + pass + "'");
}

}  // namespace
}  // namespace ejk::flash_attention

EJK_EXPORT XLA_FFI_Error* EjkFlashAttentionForwardCuda(XLA_FFI_CallFrame* call_frame);
EJK_EXPORT XLA_FFI_Error* EjkFlashAttentionBackwardCuda(XLA_FFI_CallFrame* call_frame);

// Both launches depend only on shapes and attributes, and neither allocates (the workspace
// is a result): safe inside CUDA graphs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    EjkFlashAttentionForwardCuda, ejk::flash_attention::ForwardImpl,
    EJK_FLASH_ATTENTION_FORWARD_BINDING(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    EjkFlashAttentionBackwardCuda, ejk::flash_attention::BackwardImpl,
    EJK_FLASH_ATTENTION_BACKWARD_BINDING(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

namespace ejk::flash_attention {
namespace {

// Why the CUDA kernels cannot serve a call with this signature on the current device ("" when
// they can): its dtype or head dim; a GPU this build has no code for; or, on GPUs with less
// shared memory per block than the A100 and H100 (sm_86/89: 99 KB), a head dim whose
// backward does not fit. Those calls take XLA instead of failing at the launch.
std::string CudaUnsupportedReason(const nlohmann::json& signature) {
  const int64_t head_dim = signature.value("head_dim", 0);
  std::string reason = UnsupportedReason(signature.value("dtype", std::string()), head_dim);
  if (!reason.empty()) return reason;
  const CudaDeviceInfo& device = CurrentCudaDevice();
  reason = CudaDeviceUnsupportedReason(device, EJK_CUDA_ARCHS);
  if (!reason.empty()) return reason;
  return SharedMemoryUnsupportedReason(device, BackwardMmaSharedBytes(head_dim),
                                       "the flash attention backward at head_dim " + std::to_string(head_dim));
}

// The tiles of the kernel that runs calls like this one on the current device, the default
// first: the Hopper forward's where it takes them, else the mma.sync kernels'; none for calls
// no CUDA kernel takes. The signature is ForwardCallOfSignature's.
std::vector<CudaConfig> CudaForwardTiles(const nlohmann::json& signature) {
  const int64_t head_dim = signature.value("head_dim", int64_t{0});
  const std::string dtype_name = signature.value("dtype", std::string());
  DType dtype;
  if (!UnsupportedReason(dtype_name, head_dim).empty() || !DTypeFromName(dtype_name, &dtype)) return {};
  const hopper::ForwardCall call = ForwardCallOfSignature(signature);
  if (HopperSupportsKind(dtype, call, CurrentCudaDevice()).ok()) {
    std::vector<CudaConfig> tiles;
    for (const hopper::ForwardTile& t : hopper::ForwardTiles(call)) tiles.push_back(t.config());
    return tiles;
  }
  return MmaForwardTiles(KernelHeadDim(head_dim),
                         HasFeature(signature, "bias") || HasFeature(signature, "attention_mask") ||
                             HasFeature(signature, "dropout") || HasFeature(signature, "segment_ids"));
}

Config ConfigJson(const CudaConfig& c) {
  return Config{{"block_q", c.block_q}, {"block_k", c.block_k}, {"num_threads", 0},
                {"num_warps", c.num_warps}, {"num_stages", c.num_stages}};
}

// The default tile, tuned on H100 (cuda_tiles.h); an empty config for calls no CUDA kernel
// takes (they run on XLA).
Config CudaHeuristic(const nlohmann::json& signature) {
  const std::vector<CudaConfig> tiles = CudaForwardTiles(signature);
  return tiles.empty() ? Config::object() : ConfigJson(tiles.front());
}

// Every tile built for calls like this one: what autotuning times. The backward's tiles follow
// the head dim and take no config.
std::vector<Config> CudaCandidates(const nlohmann::json& signature) {
  std::vector<Config> configs;
  for (const CudaConfig& c : CudaForwardTiles(signature)) configs.push_back(ConfigJson(c));
  return configs;
}

KernelEntry CudaEntry() {
  KernelEntry e;
  e.op = "flash_attention";
  e.platform = Platform::kCuda;
  e.backend = Backend::kGpu;
  e.priority = 100;
  e.name = "flash_attention_cuda";
  e.op_version = kOpVersion;
  // Features a development build left out (EJKERNEL_CUDA_FEATURES) fall back to XLA.
  const std::vector<std::string> not_built = FeaturesNotBuilt();
  for (const std::string& feature : AllFeatures()) {
    if (std::find(not_built.begin(), not_built.end(), feature) == not_built.end()) e.features.push_back(feature);
  }
  e.ffi_targets = {{"ejkernel_flash_attention_fwd_cuda", "EjkFlashAttentionForwardCuda"},
                   {"ejkernel_flash_attention_bwd_cuda", "EjkFlashAttentionBackwardCuda"}};
  e.heuristic = CudaHeuristic;
  e.candidates = CudaCandidates;
  e.workspace_bytes = CudaWorkspaceBytes;
  e.unsupported = CudaUnsupportedReason;
  return e;
}

}  // namespace
}  // namespace ejk::flash_attention

EJK_REGISTER_KERNEL(flash_attention_cuda, ejk::flash_attention::CudaEntry());
