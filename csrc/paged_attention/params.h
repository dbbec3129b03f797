// Paged (inference) attention: the parameters every backend takes, and their validation.
//
// One core serves every inference operation of the Python API (page_attention,
// ragged_page_attention v2/v3, ragged_decode_attention, unified_attention,
// prefill_page_attention): a packed ragged batch of query tokens attending, causally, to
// their sequence's keys in a paged KV cache.
//
// Shapes (all tensors contiguous, row-major):
//   q                [T, Hq, D]        f32 | bf16 | f16; T counts every query row, padding included
//   key_cache,
//   value_cache      [P, Hkv, S, D]    (KvLayout::kHeadMajor) or
//                    [P, S, Hkv, D]    (KvLayout::kTokenMajor); S = page size;
//                    f32 | bf16 | f16 | f8e4m3, both the same; Hq % Hkv == 0
//   kv_lens          [N] i32           keys of sequence n: positions 0 .. kv_lens[n] - 1
//   block_tables     [N, M] i32        page ids: key position j of sequence n is slot j % S of
//                                      page block_tables[n, j / S]
//   query_start_loc  [N + 1] i32, or   sequence n's queries are rows qsl[n] .. qsl[n+1] - 1 of q;
//                    absent            absent means one query row per sequence, qsl[n] = n
//                                      (decoding), and needs num_seqs <= T
//   num_seqs         [1] i32           sequences present (<= N); later entries are padding and
//                                      are never read as data
//   kv_starts        [N] i32, optional keys before kv_starts[n] are invisible
//   sinks            [Hq], optional    sink logits, any float dtype
//   out              [T, Hq, D]        dtype of q; rows no present sequence owns are written 0
//
// Semantics, for local query r (0 <= r < q_len = qsl[n+1] - qsl[n]) of sequence n, with
// the queries aligned to the end of their context: pos = kv_lens[n] - q_len + r, and key j
// is visible iff kv_starts[n] <= j < kv_lens[n], and (causal) j <= pos, and
// (window_left >= 0) j >= pos - window_left. Then, like flash attention (its semantics.h):
//   logit = SoftCap(softmax_scale * <q, k_j * k_scale>, logits_soft_cap)
//   lse   = log(exp(sink) + sum_visible exp(logit))     (the sink term only with sinks)
//   out   = sum_visible exp(logit - lse) * v_j * v_scale
// A query with no visible key and no sink gets out = 0.
//
// k_scale / v_scale dequantise fp8 caches (the stored value times the scale is the real one);
// they are 1 for other dtypes unless the caller wants them. A query scale folds into
// softmax_scale before the call.
#pragma once

#include <cstdint>

#include "runtime/status.h"
#include "runtime/tensor.h"

namespace ejk::paged_attention {

// Version of the operation's configs and cache entries; bump when a config's meaning changes.
constexpr int kOpVersion = 1;

enum class KvLayout : int64_t { kHeadMajor = 0, kTokenMajor = 1 };

// query_start_loc is absent as a default view (what the FFI handlers make of a zero-element
// operand, so its data pointer is null) or as an int32[0] view; QueryStartLoc reads both.
// Decode callers leave it out so that XLA launches no iota kernel to build [0, 1, ..., N].
struct Params {
  TensorView q, key_cache, value_cache;
  TensorView kv_lens, block_tables, query_start_loc, num_seqs;  // query_start_loc optional
  TensorView kv_starts, sinks;  // optional
  KvLayout layout = KvLayout::kHeadMajor;
  float softmax_scale = 1.0f;
  float logits_soft_cap = 0.0f;  // 0: off; otherwise > 0
  int64_t window_left = -1;      // < 0: unbounded
  bool causal = true;
  float k_scale = 1.0f, v_scale = 1.0f;
  TensorView out;
};

// Tile and split configuration (the framework's config type for this op).
//   num_splits: split-KV partitions per (sequence, kv head) for flash decoding; 0 = heuristic
//               from the device's SM count and the batch
//   block_kv:   keys per inner tile
//   num_threads: CPU threads (0 = all)
struct Config {
  int num_splits = 0;
  int block_kv = 64;
  int num_threads = 0;
};

struct Dims {
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim;
  int64_t num_pages, page_size, max_seqs, max_pages_per_seq;
};

// query_start_loc's entries, or null when it is absent (a default view or int32[0]; for a
// view that passed Validate).
inline const int32_t* QueryStartLoc(const TensorView& query_start_loc) {
  return query_start_loc.present() && query_start_loc.shape[0] > 0
             ? query_start_loc.ptr<int32_t>()
             : nullptr;
}

// The first query row of sequence n: qsl[n], or n when query_start_loc is absent (null).
EJK_HOST_DEVICE int64_t QueryStartAt(const int32_t* qsl, int64_t n) {
  return qsl != nullptr ? qsl[n] : n;
}

// Checks every shape, dtype and attribute; the message names the argument and its shape.
// Does not read tensor data.
StatusOr<Dims> Validate(const Params& p);

// Reads the int32 metadata (host memory only): 0 <= num_seqs <= N; query_start_loc starts at
// 0, is non-decreasing and ends within T (absent: num_seqs <= T); kv_lens[n] >= q_len of n
// and <= M * S; every page id a present sequence uses lies in [0, P); kv_starts[n] in
// [0, kv_lens[n]].
// Device kernels cannot afford this check before launch: they clamp instead, so a bad value
// gives wrong numbers for its sequence, never an out-of-bounds access.
Status ValidateMetadataValues(const Params& p, const Dims& dims);

// Writing a step's new keys and values into the cache (ragged_page_attention_v3), in place:
//   new_keys, new_values [T, Hkv, D] any float dtype; row r of sequence n goes to key
//   position kv_lens[n] - q_len + (r - qsl[n]), quantised as value / scale when the cache is
//   fp8 (and rounded to the cache dtype otherwise). The metadata is as in Params (an
//   absent query_start_loc included).
struct CacheUpdateParams {
  TensorView new_keys, new_values;
  TensorView key_cache, value_cache;  // read and written (aliased in and out)
  TensorView kv_lens, block_tables, query_start_loc, num_seqs;
  KvLayout layout = KvLayout::kHeadMajor;
  float k_scale = 1.0f, v_scale = 1.0f;
};

StatusOr<Dims> ValidateCacheUpdate(const CacheUpdateParams& p);

// CPU implementations (host memory): validate shapes and metadata values, then run.
Status AttentionCpu(const Params& p, const Config& cfg);
Status CacheUpdateCpu(const CacheUpdateParams& p);

}  // namespace ejk::paged_attention

// XLA FFI layouts, shared by the CPU and CUDA handlers and the Python caller.
//
// Target "ejkernel_paged_attention_{cpu,cuda}":
//   operands: q, key_cache, value_cache, kv_lens, block_tables, query_start_loc, num_seqs,
//             kv_starts, sinks   (absent optionals: zero-element placeholders; a zero-element
//             query_start_loc is absent, no `operands` bit needed since a real one has N + 1 >= 1
//             entries)
//   results:  out, split_workspace
//   attrs:    softmax_scale f32, logits_soft_cap f32, window_left i64, causal bool,
//             kv_layout i64, k_scale f32, v_scale f32, operands i64 (bit 1: kv_starts,
//             bit 2: sinks), num_splits i64, block_kv i64, num_threads i64
//   split_workspace: uint8, as many bytes as the registry entry's workspace_bytes says for
//             (num_tokens, num_q_heads, head_dim, num_splits) (CUDA: 4 * T * Hq * (num_splits *
//             (D + 2) + 2) when num_splits > 1, else 0): the split-KV partial results (outputs,
//             softmax statistics) and two 32-bit counters per (token, q head), a result so that
//             no call allocates (the handler stays valid inside CUDA graphs). num_splits is the
//             resolved count (>= 1; the registry heuristic resolves 0); backends that do not
//             split take 0 bytes.
//
// Target "ejkernel_paged_kv_cache_update_{cpu,cuda}":
//   operands: new_keys, new_values, key_cache, value_cache, kv_lens, block_tables,
//             query_start_loc (zero elements: absent), num_seqs
//   results:  key_cache, value_cache (aliased to operands 2 and 3)
//   attrs:    kv_layout i64, k_scale f32, v_scale f32

namespace ejk::paged_attention {

// ValidateMetadataValues for the cache update: the page ids checked are those of the key
// positions the new rows are written to.
Status ValidateCacheUpdateMetadataValues(const CacheUpdateParams& p, const Dims& dims);

}  // namespace ejk::paged_attention
