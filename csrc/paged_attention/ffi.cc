// XLA FFI handlers of the CPU paged attention and KV-cache update, and the registry entry.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "paged_attention/ffi_common.h"
#include "paged_attention/params.h"
#include "runtime/ffi_util.h"
#include "runtime/registry.h"

namespace ffi = xla::ffi;

namespace ejk::paged_attention {
namespace {

ffi::Error AttentionImpl(ffi::AnyBuffer q, ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                         ffi::AnyBuffer kv_lens, ffi::AnyBuffer block_tables,
                         ffi::AnyBuffer query_start_loc, ffi::AnyBuffer num_seqs,
                         ffi::AnyBuffer kv_starts, ffi::AnyBuffer sinks,
                         ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> /*split_workspace: the CPU does not split*/,
                         float softmax_scale,
                         float logits_soft_cap, int64_t window_left, bool causal,
                         int64_t kv_layout, float k_scale, float v_scale, int64_t operands,
                         int64_t num_splits, int64_t block_kv, int64_t num_threads) {
  Params p;
  EJK_FFI_ASSIGN_OR_RETURN(
      p, BuildParams(q, key_cache, value_cache, kv_lens, block_tables, query_start_loc, num_seqs,
                     kv_starts, sinks, *out, softmax_scale, logits_soft_cap, window_left, causal,
                     kv_layout, k_scale, v_scale, operands));
  Config cfg;
  EJK_FFI_ASSIGN_OR_RETURN(cfg, ConfigFromAttrs(num_splits, block_kv, num_threads));
  return ToFfiError(AttentionCpu(p, cfg));
}

ffi::Error CacheUpdateImpl(ffi::AnyBuffer new_keys, ffi::AnyBuffer new_values,
                           ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                           ffi::AnyBuffer kv_lens, ffi::AnyBuffer block_tables,
                           ffi::AnyBuffer query_start_loc, ffi::AnyBuffer num_seqs,
                           ffi::Result<ffi::AnyBuffer> key_cache_out,
                           ffi::Result<ffi::AnyBuffer> value_cache_out, int64_t kv_layout,
                           float k_scale, float v_scale) {
  CacheUpdateParams p;
  EJK_FFI_ASSIGN_OR_RETURN(
      p, BuildCacheUpdateParams(new_keys, new_values, key_cache, value_cache, kv_lens,
                                block_tables, query_start_loc, num_seqs, *key_cache_out,
                                *value_cache_out, kv_layout, k_scale, v_scale));
  // Results alias the operand caches; when XLA gives separate buffers, the update is
  // applied to a copy.
  const ffi::AnyBuffer* pairs[2][2] = {{&key_cache, &*key_cache_out},
                                       {&value_cache, &*value_cache_out}};
  for (const auto& pair : pairs) {
    if (pair[0]->untyped_data() != pair[1]->untyped_data()) {
      std::memmove(pair[1]->untyped_data(), pair[0]->untyped_data(), pair[0]->size_bytes());
    }
  }
  return ToFfiError(CacheUpdateCpu(p));
}

}  // namespace
}  // namespace ejk::paged_attention

EJK_EXPORT XLA_FFI_Error* EjkPagedAttentionCpu(XLA_FFI_CallFrame* call_frame);
EJK_EXPORT XLA_FFI_Error* EjkPagedKvCacheUpdateCpu(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(EjkPagedAttentionCpu, ejk::paged_attention::AttentionImpl,
                              EJK_PAGED_ATTENTION_BINDING(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(EjkPagedKvCacheUpdateCpu, ejk::paged_attention::CacheUpdateImpl,
                              EJK_PAGED_KV_CACHE_UPDATE_BINDING(ffi::Ffi::Bind()));

namespace ejk::paged_attention {
namespace {

// One pass over the keys per (sequence, kv head, query block); the key tile bounds the
// f32 scratch (K^T and V tiles of block_kv x head_dim) that stays in L1/L2.
::ejk::Config CpuHeuristic(const nlohmann::json& signature) {
  const int64_t head_dim = signature.value("head_dim", 128);
  return ::ejk::Config{{"num_splits", 1}, {"block_kv", head_dim > 128 ? 64 : 128}, {"num_threads", 0}};
}

std::vector<::ejk::Config> CpuCandidates(const nlohmann::json& signature) {
  std::vector<::ejk::Config> configs;
  for (int block_kv : {32, 64, 128, 256}) {
    configs.push_back(::ejk::Config{{"num_splits", 1}, {"block_kv", block_kv}, {"num_threads", 0}});
  }
  return configs;
}

KernelEntry CpuEntry() {
  KernelEntry e;
  e.op = "paged_attention";
  e.platform = Platform::kCpu;
  e.backend = Backend::kCpu;
  e.priority = 100;
  e.name = "paged_attention_cpu";
  e.op_version = kOpVersion;
  e.features = AllFeatures();
  e.ffi_targets = {{"ejkernel_paged_attention_cpu", "EjkPagedAttentionCpu"},
                   {"ejkernel_paged_kv_cache_update_cpu", "EjkPagedKvCacheUpdateCpu"}};
  e.heuristic = CpuHeuristic;
  e.candidates = CpuCandidates;
  return e;
}

}  // namespace
}  // namespace ejk::paged_attention

EJK_REGISTER_KERNEL(paged_attention_cpu, ejk::paged_attention::CpuEntry());
