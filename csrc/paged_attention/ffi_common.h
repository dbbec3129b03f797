// What the CPU and CUDA FFI handlers of paged attention share: the operand, result and
// attribute layout of both targets (params.h documents it), the operand flag bits, the
// feature names, and turning buffers plus attributes into Params / CacheUpdateParams.
//
// A handler binds, e.g.
//   XLA_FFI_DEFINE_HANDLER_SYMBOL(Sym, Impl, EJK_PAGED_ATTENTION_BINDING(ffi::Ffi::Bind()));
// and a CUDA handler adds its contexts first:
//   EJK_PAGED_ATTENTION_BINDING(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
// so Impl takes the contexts, then the operands, results and attributes in the order below.
#pragma once

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "paged_attention/params.h"
#include "runtime/ffi_util.h"

namespace ejk::paged_attention {

// Bits of the `operands` attribute: which optional operands are real.
enum OperandFlag : int64_t {
  kHasKvStarts = 1,
  kHasSinks = 2,
};

inline std::vector<std::string> AllFeatures() {
  return {"sinks",     "sliding_window", "logits_soft_cap", "kv_starts", "fp8_cache",
          "cache_update", "head_major",  "token_major",     "gqa"};
}

// query_start_loc is absent when it has zero elements (a real one has N + 1 >= 1), so it needs
// no `operands` bit and callers that predate its absence keep working. Like an absent
// kv_starts it becomes a default view: present() is false and its data pointer is null.
inline StatusOr<TensorView> QueryStartLocOf(const xla::ffi::AnyBuffer& query_start_loc) {
  return OptionalViewOf(query_start_loc, "query_start_loc", query_start_loc.element_count() > 0);
}

// Attention params from the target's operands, result and attributes. Shapes and values
// are not checked here: Validate does that.
inline StatusOr<Params> BuildParams(
    const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& key_cache,
    const xla::ffi::AnyBuffer& value_cache, const xla::ffi::AnyBuffer& kv_lens,
    const xla::ffi::AnyBuffer& block_tables, const xla::ffi::AnyBuffer& query_start_loc,
    const xla::ffi::AnyBuffer& num_seqs, const xla::ffi::AnyBuffer& kv_starts,
    const xla::ffi::AnyBuffer& sinks, const xla::ffi::AnyBuffer& out, float softmax_scale,
    float logits_soft_cap, int64_t window_left, bool causal, int64_t kv_layout, float k_scale,
    float v_scale, int64_t operands) {
  Params p;
  EJK_ASSIGN_OR_RETURN(p.q, ViewOf(q, "q"));
  EJK_ASSIGN_OR_RETURN(p.key_cache, ViewOf(key_cache, "key_cache"));
  EJK_ASSIGN_OR_RETURN(p.value_cache, ViewOf(value_cache, "value_cache"));
  EJK_ASSIGN_OR_RETURN(p.kv_lens, ViewOf(kv_lens, "kv_lens"));
  EJK_ASSIGN_OR_RETURN(p.block_tables, ViewOf(block_tables, "block_tables"));
  EJK_ASSIGN_OR_RETURN(p.query_start_loc, QueryStartLocOf(query_start_loc));
  EJK_ASSIGN_OR_RETURN(p.num_seqs, ViewOf(num_seqs, "num_seqs"));
  EJK_ASSIGN_OR_RETURN(p.kv_starts, OptionalViewOf(kv_starts, "kv_starts", operands & kHasKvStarts));
  EJK_ASSIGN_OR_RETURN(p.sinks, OptionalViewOf(sinks, "sinks", operands & kHasSinks));
  EJK_ASSIGN_OR_RETURN(p.out, ViewOf(out, "out"));
  p.layout = static_cast<KvLayout>(kv_layout);
  p.softmax_scale = softmax_scale;
  p.logits_soft_cap = logits_soft_cap;
  p.window_left = window_left;
  p.causal = causal;
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  return p;
}

// The tile/split attributes as a Config; each must be >= 0 (block_kv >= 1) and fit an int.
// Backends add their own limits.
inline StatusOr<Config> ConfigFromAttrs(int64_t num_splits, int64_t block_kv, int64_t num_threads) {
  if (num_splits < 0 || num_splits > INT_MAX || block_kv < 1 || block_kv > INT_MAX ||
      num_threads < 0 || num_threads > INT_MAX) {
    return Status::InvalidArgument(
        "config: num_splits >= 0, block_kv >= 1 and num_threads >= 0 required, got num_splits=" +
        std::to_string(num_splits) + " block_kv=" + std::to_string(block_kv) +
        " num_threads=" + std::to_string(num_threads));
  }
  Config cfg;
  cfg.num_splits = static_cast<int>(num_splits);
  cfg.block_kv = static_cast<int>(block_kv);
  cfg.num_threads = static_cast<int>(num_threads);
  return cfg;
}

// Cache-update params. The caches are viewed through the results (where the update is
// written); the operand caches must match them in dtype and shape. When XLA honours the
// aliasing the operand and result are the same memory; otherwise the handler copies the
// operand cache into the result before the update.
inline StatusOr<CacheUpdateParams> BuildCacheUpdateParams(
    const xla::ffi::AnyBuffer& new_keys, const xla::ffi::AnyBuffer& new_values,
    const xla::ffi::AnyBuffer& key_cache, const xla::ffi::AnyBuffer& value_cache,
    const xla::ffi::AnyBuffer& kv_lens, const xla::ffi::AnyBuffer& block_tables,
    const xla::ffi::AnyBuffer& query_start_loc, const xla::ffi::AnyBuffer& num_seqs,
    const xla::ffi::AnyBuffer& key_cache_out, const xla::ffi::AnyBuffer& value_cache_out,
    int64_t kv_layout, float k_scale, float v_scale) {
  CacheUpdateParams p;
  EJK_ASSIGN_OR_RETURN(p.new_keys, ViewOf(new_keys, "new_keys"));
  EJK_ASSIGN_OR_RETURN(p.new_values, ViewOf(new_values, "new_values"));
  EJK_ASSIGN_OR_RETURN(TensorView key_in, ViewOf(key_cache, "key_cache"));
  EJK_ASSIGN_OR_RETURN(TensorView value_in, ViewOf(value_cache, "value_cache"));
  EJK_ASSIGN_OR_RETURN(p.key_cache, ViewOf(key_cache_out, "key_cache (result)"));
  EJK_ASSIGN_OR_RETURN(p.value_cache, ViewOf(value_cache_out, "value_cache (result)"));
  EJK_ASSIGN_OR_RETURN(p.kv_lens, ViewOf(kv_lens, "kv_lens"));
  EJK_ASSIGN_OR_RETURN(p.block_tables, ViewOf(block_tables, "block_tables"));
  EJK_ASSIGN_OR_RETURN(p.query_start_loc, QueryStartLocOf(query_start_loc));
  EJK_ASSIGN_OR_RETURN(p.num_seqs, ViewOf(num_seqs, "num_seqs"));
  const struct {
    const char* name;
    const TensorView* in;
    const TensorView* out;
  } caches[] = {{"key_cache", &key_in, &p.key_cache}, {"value_cache", &value_in, &p.value_cache}};
  for (const auto& c : caches) {
    bool same = c.in->dtype == c.out->dtype && c.in->rank == c.out->rank;
    for (int i = 0; same && i < c.in->rank; ++i) same = c.in->shape[i] == c.out->shape[i];
    if (!same) {
      return Status::InvalidArgument(std::string(c.name) + ": the result " + c.out->ToString() +
                                     " must match the operand " + c.in->ToString() +
                                     " (they alias)");
    }
  }
  p.layout = static_cast<KvLayout>(kv_layout);
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  return p;
}

}  // namespace ejk::paged_attention

// Target "ejkernel_paged_attention_{cpu,cuda}": operands, result, attributes, in order.
#define EJK_PAGED_ATTENTION_BINDING(b)                                  \
  (b).Arg<xla::ffi::AnyBuffer>() /* q */                                \
      .Arg<xla::ffi::AnyBuffer>() /* key_cache */                       \
      .Arg<xla::ffi::AnyBuffer>() /* value_cache */                     \
      .Arg<xla::ffi::AnyBuffer>() /* kv_lens */                         \
      .Arg<xla::ffi::AnyBuffer>() /* block_tables */                    \
      .Arg<xla::ffi::AnyBuffer>() /* query_start_loc */                 \
      .Arg<xla::ffi::AnyBuffer>() /* num_seqs */                        \
      .Arg<xla::ffi::AnyBuffer>() /* kv_starts */                       \
      .Arg<xla::ffi::AnyBuffer>() /* sinks */                           \
      .Ret<xla::ffi::AnyBuffer>() /* out */                             \
      .Ret<xla::ffi::AnyBuffer>() /* split_workspace */                 \
      .Attr<float>("softmax_scale")                                     \
      .Attr<float>("logits_soft_cap")                                   \
      .Attr<int64_t>("window_left")                                     \
      .Attr<bool>("causal")                                             \
      .Attr<int64_t>("kv_layout")                                       \
      .Attr<float>("k_scale")                                           \
      .Attr<float>("v_scale")                                           \
      .Attr<int64_t>("operands")                                        \
      .Attr<int64_t>("num_splits")                                      \
      .Attr<int64_t>("block_kv")                                        \
      .Attr<int64_t>("num_threads")

// Target "ejkernel_paged_kv_cache_update_{cpu,cuda}": results 0 and 1 alias operands 2 and 3.
#define EJK_PAGED_KV_CACHE_UPDATE_BINDING(b)                            \
  (b).Arg<xla::ffi::AnyBuffer>() /* new_keys */                         \
      .Arg<xla::ffi::AnyBuffer>() /* new_values */                      \
      .Arg<xla::ffi::AnyBuffer>() /* key_cache */                       \
      .Arg<xla::ffi::AnyBuffer>() /* value_cache */                     \
      .Arg<xla::ffi::AnyBuffer>() /* kv_lens */                         \
      .Arg<xla::ffi::AnyBuffer>() /* block_tables */                    \
      .Arg<xla::ffi::AnyBuffer>() /* query_start_loc */                 \
      .Arg<xla::ffi::AnyBuffer>() /* num_seqs */                        \
      .Ret<xla::ffi::AnyBuffer>() /* key_cache */                       \
      .Ret<xla::ffi::AnyBuffer>() /* value_cache */                     \
      .Attr<int64_t>("kv_layout")                                       \
      .Attr<float>("k_scale")                                           \
      .Attr<float>("v_scale")
