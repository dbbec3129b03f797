// XLA FFI handlers of the CUDA paged attention and KV-cache update, and the registry entry.
// Neither synchronises with the host: the metadata stays on the device and the kernels clamp it.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "paged_attention/cuda_attention.cuh"
#include "paged_attention/ffi_common.h"
#include "paged_attention/params.h"
#include "runtime/cuda_device.h"
#include "runtime/ffi_util.h"
#include "runtime/registry.h"

namespace ffi = xla::ffi;

namespace ejk::paged_attention {
namespace {

// The split count the caller resolved (0: resolve it here, the same way the heuristic does).
int ResolvedSplits(const Dims& dims, const Config& cfg) {
  return cfg.num_splits > 0 ? cfg.num_splits : CudaNumSplits(dims, cfg, CurrentCudaDevice().sm_count);
}

ffi::Error AttentionImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer key_cache,
                         ffi::AnyBuffer value_cache, ffi::AnyBuffer kv_lens,
                         ffi::AnyBuffer block_tables, ffi::AnyBuffer query_start_loc,
                         ffi::AnyBuffer num_seqs, ffi::AnyBuffer kv_starts, ffi::AnyBuffer sinks,
                         ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> split_workspace, float softmax_scale,
                         float logits_soft_cap, int64_t window_left, bool causal, int64_t kv_layout,
                         float k_scale, float v_scale, int64_t operands, int64_t num_splits,
                         int64_t block_kv, int64_t num_threads) {
  Params p;
  EJK_FFI_ASSIGN_OR_RETURN(
      p, BuildParams(q, key_cache, value_cache, kv_lens, block_tables, query_start_loc, num_seqs,
                     kv_starts, sinks, *out, softmax_scale, logits_soft_cap, window_left, causal,
                     kv_layout, k_scale, v_scale, operands));
  Config cfg;
  EJK_FFI_ASSIGN_OR_RETURN(cfg, ConfigFromAttrs(num_splits, block_kv, num_threads));
  Dims dims;
  EJK_FFI_ASSIGN_OR_RETURN(dims, Validate(p));
  if (const std::string reason = CudaAttentionUnsupported(dims.head_dim); !reason.empty()) {
    return ToFfiError(Status::Unimplemented("paged attention CUDA: " + reason + ", got q " + p.q.ToString()));
  }
  if (cfg.num_splits > kMaxCudaSplits) {
    return ToFfiError(Status::InvalidArgument("config: num_splits must be at most " + std::to_string(kMaxCudaSplits) +
                                              " on CUDA, got " + std::to_string(cfg.num_splits)));
  }
  const int splits = ResolvedSplits(dims, cfg);
  const size_t bytes = CudaAttentionScratchBytes(dims, splits);
  if (split_workspace->size_bytes() != bytes) {
    return ToFfiError(Status::InvalidArgument(
        "split_workspace: expected " + std::to_string(bytes) + " bytes for " + std::to_string(splits) +
        " splits (the registry's workspace_bytes), got " + std::to_string(split_workspace->size_bytes())));
  }
  return ToFfiError(CudaAttention(p, dims, splits, bytes > 0 ? split_workspace->untyped_data() : nullptr, stream));
}

ffi::Error CacheUpdateImpl(cudaStream_t stream, ffi::AnyBuffer new_keys, ffi::AnyBuffer new_values,
                           ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache, ffi::AnyBuffer kv_lens,
                           ffi::AnyBuffer block_tables, ffi::AnyBuffer query_start_loc,
                           ffi::AnyBuffer num_seqs, ffi::Result<ffi::AnyBuffer> key_cache_out,
                           ffi::Result<ffi::AnyBuffer> value_cache_out, int64_t kv_layout, float k_scale,
                           float v_scale) {
  CacheUpdateParams p;
  EJK_FFI_ASSIGN_OR_RETURN(
      p, BuildCacheUpdateParams(new_keys, new_values, key_cache, value_cache, kv_lens, block_tables,
                                query_start_loc, num_seqs, *key_cache_out, *value_cache_out, kv_layout,
                                k_scale, v_scale));
  Dims dims;
  EJK_FFI_ASSIGN_OR_RETURN(dims, ValidateCacheUpdate(p));
  // Results alias the operand caches; when XLA gives separate buffers, update a copy.
  const ffi::AnyBuffer* pairs[2][2] = {{&key_cache, &*key_cache_out}, {&value_cache, &*value_cache_out}};
  for (const auto& pair : pairs) {
    if (pair[0]->untyped_data() != pair[1]->untyped_data()) {
      if (cudaError_t err = cudaMemcpyAsync(pair[1]->untyped_data(), pair[0]->untyped_data(),
                                            pair[0]->size_bytes(), cudaMemcpyDeviceToDevice, stream);
          err != cudaSuccess) {
        return ToFfiError(Status::Internal(std::string("paged KV cache update: cache copy failed: ") +
                                           cudaGetErrorString(err)));
      }
    }
  }
  return ToFfiError(CudaCacheUpdate(p, dims, stream));
}

}  // namespace
}  // namespace ejk::paged_attention

EJK_EXPORT XLA_FFI_Error* EjkPagedAttentionCuda(XLA_FFI_CallFrame* call_frame);
EJK_EXPORT XLA_FFI_Error* EjkPagedKvCacheUpdateCuda(XLA_FFI_CallFrame* call_frame);

// Both handlers' launches depend only on shapes and attributes, and neither allocates (the
// split workspace is a result): safe inside CUDA graphs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(EjkPagedAttentionCuda, ejk::paged_attention::AttentionImpl,
                              EJK_PAGED_ATTENTION_BINDING(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(EjkPagedKvCacheUpdateCuda, ejk::paged_attention::CacheUpdateImpl,
                              EJK_PAGED_KV_CACHE_UPDATE_BINDING(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

namespace ejk::paged_attention {
namespace {

::ejk::Config MakeConfig(int num_splits) {
  return ::ejk::Config{{"num_splits", num_splits}, {"block_kv", 64}, {"num_threads", 0}};
}

// Splits sized from the device's SM count and the static shapes (one full wave of blocks),
// resolved here so the caller can size the split workspace; the kernels stream 64-key
// blocks whatever block_kv says.
::ejk::Config CudaHeuristic(const nlohmann::json& signature) {
  Dims dims{};
  dims.num_tokens = signature.value("num_tokens", int64_t{1});
  dims.num_q_heads = signature.value("num_q_heads", int64_t{1});
  dims.num_kv_heads = signature.value("num_kv_heads", int64_t{1});
  dims.head_dim = signature.value("head_dim", int64_t{128});
  dims.num_pages = signature.value("num_pages", int64_t{1});
  dims.page_size = signature.value("page_size", int64_t{16});
  dims.max_seqs = signature.value("max_seqs", int64_t{1});
  dims.max_pages_per_seq = signature.value("max_pages_per_seq", int64_t{1});
  return MakeConfig(CudaNumSplits(dims, Config{}, CurrentCudaDevice().sm_count));
}

// The split workspace of a call with this signature (num_tokens, num_q_heads, head_dim and
// the resolved num_splits), in bytes.
StatusOr<int64_t> CudaWorkspaceBytes(const nlohmann::json& signature, const std::string& pass) {
  if (pass != "forward") return Status::InvalidArgument("paged attention has no '" + pass + "' pass");
  Dims dims{};
  EJK_RETURN_IF_ERROR(ReadSignatureCounts(
      signature, "paged attention workspace",
      {{"num_tokens", &dims.num_tokens}, {"num_q_heads", &dims.num_q_heads}, {"head_dim", &dims.head_dim}}));
  // The handler checks the count itself (at most kMaxCudaSplits); this only sizes for it.
  const int64_t splits = signature.value("num_splits", int64_t{0});
  if (splits < 1 || splits > std::numeric_limits<int>::max()) {
    return Status::InvalidArgument("paged attention workspace: num_splits must be resolved (>= 1), got " +
                                   std::to_string(splits));
  }
  return static_cast<int64_t>(CudaAttentionScratchBytes(dims, static_cast<int>(splits)));
}

std::vector<::ejk::Config> CudaCandidates(const nlohmann::json&) {
  std::vector<::ejk::Config> configs;
  for (int splits : {1, 2, 4, 8, 16, 32, 64}) configs.push_back(MakeConfig(splits));
  return configs;
}

// Why the CUDA kernels cannot serve a call with this signature on the current device ("" when
// they can): its head dim, a GPU this build has no code for, or (GPUs giving a block less
// shared memory than the A100 and H100, e.g. 99 KB on sm_86/89) a tensor-core tile that does
// not fit. Those calls take XLA instead of failing at the launch.
std::string CudaUnsupportedReason(const nlohmann::json& signature) {
  const int64_t head_dim = signature.value("head_dim", 0);
  if (const std::string reason = CudaAttentionUnsupported(head_dim); !reason.empty()) {
    return reason + ", got " + std::to_string(head_dim);
  }
  const CudaDeviceInfo& device = CurrentCudaDevice();
  if (std::string reason = CudaDeviceUnsupportedReason(device, EJK_CUDA_ARCHS); !reason.empty()) return reason;
  DType dtype, cache_dtype;
  if (!DTypeFromName(signature.value("dtype", std::string()), &dtype) ||
      !DTypeFromName(signature.value("cache_dtype", std::string()), &cache_dtype)) {
    return "";  // the call's own validation names bad dtypes
  }
  return SharedMemoryUnsupportedReason(device, CudaAttentionSharedBytes(head_dim, dtype, cache_dtype),
                                       "paged attention at head_dim " + std::to_string(head_dim));
}

KernelEntry CudaEntry() {
  KernelEntry e;
  e.op = "paged_attention";
  e.platform = Platform::kCuda;
  e.backend = Backend::kGpu;
  e.priority = 100;
  e.name = "paged_attention_cuda";
  e.op_version = kOpVersion;
  e.features = AllFeatures();
  e.ffi_targets = {{"ejkernel_paged_attention_cuda", "EjkPagedAttentionCuda"},
                   {"ejkernel_paged_kv_cache_update_cuda", "EjkPagedKvCacheUpdateCuda"}};
  e.heuristic = CudaHeuristic;
  e.candidates = CudaCandidates;
  e.workspace_bytes = CudaWorkspaceBytes;
  e.unsupported = CudaUnsupportedReason;
  return e;
}

}  // namespace
}  // namespace ejk::paged_attention

EJK_REGISTER_KERNEL(paged_attention_cuda, ejk::paged_attention::CudaEntry());
