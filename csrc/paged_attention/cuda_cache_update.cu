// Writing a step's new keys and values into the paged cache (params.h, CacheUpdateParams) on
// NVIDIA GPUs. One block per token row: warp 0 finds the row's sequence in query_start_loc
// (clamped, on the device), then every thread writes elements of all kv heads. Rows that no
// present sequence owns, and positions outside [0, kv_lens[n]), are left alone.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "paged_attention/cuda_attention.cuh"
#include "paged_attention/fp8.h"

namespace ejk::paged_attention {
namespace {

constexpr int kUpdateThreads = 128;

struct UpdateArgs {
  const void* new_keys;
  const void* new_values;
  void* key_cache;
  void* value_cache;
  const int32_t* kv_lens;
  const int32_t* block_tables;
  const int32_t* query_start_loc;  // null: one row per sequence (params.h)
  const int32_t* num_seqs;
  DType new_dtype_k, new_dtype_v, cache_dtype;
  int64_t num_tokens, num_kv_heads, head_dim, num_pages, page_size, max_seqs, max_pages;
  int64_t page_stride, head_stride, slot_stride;
  float k_scale, v_scale;
};

__device__ __forceinline__ int64_t Clamp(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

__device__ __forceinline__ float LoadFloat(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case DType::kF16: return __half2float(static_cast<const __half*>(base)[i]);
    case DType::kF64: return static_cast<float>(static_cast<const double*>(base)[i]);
    default: return 0.0f;
  }
}

// x in the cache dtype: fp8 stores x / scale (round to nearest even, saturated).
__device__ __forceinline__ void StoreCache(void* base, DType dtype, int64_t i, float x, float scale) {
  switch (dtype) {
    case DType::kF32: static_cast<float*>(base)[i] = x; break;
    case DType::kBF16: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x); break;
    case DType::kF16: static_cast<__half*>(base)[i] = __float2half_rn(x); break;
    case DType::kF8E4M3: static_cast<uint8_t*>(base)[i] = FloatToF8E4M3(x / scale); break;
    default: break;
  }
}

__global__ void __launch_bounds__(kUpdateThreads) CacheUpdateKernel(const UpdateArgs a) {
  __shared__ int64_t s_target;  // element offset of (page, head 0, slot) or -1
  const int64_t row = blockIdx.x;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int64_t num_seqs = Clamp(a.num_seqs[0], 0, a.max_seqs);
    auto start = [&](int64_t n) { return Clamp(QueryStartAt(a.query_start_loc, n), 0, a.num_tokens); };
    // The largest n with start(n) <= row, narrowing 32-fold per step.
    int64_t lo = 0, hi = num_seqs, found = -1;
    while (hi > lo) {
      const int64_t step = (hi - lo + 31) / 32;
      const int64_t idx = lo + lane * step;
      const unsigned ballot = __ballot_sync(0xffffffffu, idx < hi && start(idx) <= row);
      if (ballot == 0) break;
      const int last = 31 - __clz(ballot);
      found = lo + last * step;
      if (step == 1) break;
      lo = found;
      hi = min(hi, found + step);
    }
    int64_t target = -1;
    if (found >= 0) {
      const int64_t q_begin = start(found);
      const int64_t q_end = Clamp(start(found + 1), q_begin, a.num_tokens);
      const int64_t kv_len = Clamp(a.kv_lens[found], 0, a.max_pages * a.page_size);
      const int64_t pos = kv_len - (q_end - q_begin) + (row - q_begin);
      if (row < q_end && pos >= 0 && pos < kv_len) {
        const int64_t page = Clamp(a.block_tables[found * a.max_pages + pos / a.page_size], 0, a.num_pages - 1);
        target = page * a.page_stride + (pos % a.page_size) * a.slot_stride;
      }
    }
    if (lane == 0) s_target = target;
  }
  __syncthreads();
  const int64_t target = s_target;
  if (target < 0) return;
  const int64_t D = a.head_dim;
  for (int64_t i = threadIdx.x; i < a.num_kv_heads * D; i += kUpdateThreads) {
    const int64_t h = i / D, d = i % D;
    const int64_t dst = target + h * a.head_stride + d;
    const int64_t src = row * a.num_kv_heads * D + i;
    StoreCache(a.key_cache, a.cache_dtype, dst, LoadFloat(a.new_keys, a.new_dtype_k, src), a.k_scale);
    StoreCache(a.value_cache, a.cache_dtype, dst, LoadFloat(a.new_values, a.new_dtype_v, src), a.v_scale);
  }
}

}  // namespace

Status CudaCacheUpdate(const CacheUpdateParams& p, const Dims& dims, cudaStream_t stream) {
  if (dims.num_tokens == 0 || dims.num_kv_heads == 0 || dims.head_dim == 0) return Status::Ok();
  UpdateArgs a{};
  a.new_keys = p.new_keys.data;
  a.new_values = p.new_values.data;
  a.key_cache = p.key_cache.data;
  a.value_cache = p.value_cache.data;
  a.kv_lens = p.kv_lens.ptr<int32_t>();
  a.block_tables = p.block_tables.ptr<int32_t>();
  a.query_start_loc = QueryStartLoc(p.query_start_loc);
  a.num_seqs = p.num_seqs.ptr<int32_t>();
  a.new_dtype_k = p.new_keys.dtype;
  a.new_dtype_v = p.new_values.dtype;
  a.cache_dtype = p.key_cache.dtype;
  a.num_tokens = dims.num_tokens;
  a.num_kv_heads = dims.num_kv_heads;
  a.head_dim = dims.head_dim;
  a.num_pages = dims.num_pages;
  a.page_size = dims.page_size;
  a.max_seqs = dims.max_seqs;
  a.max_pages = dims.max_pages_per_seq;
  const int64_t S = dims.page_size, D = dims.head_dim, Hkv = dims.num_kv_heads;
  a.page_stride = S * Hkv * D;
  a.head_stride = p.layout == KvLayout::kHeadMajor ? S * D : D;
  a.slot_stride = p.layout == KvLayout::kHeadMajor ? D : Hkv * D;
  a.k_scale = p.k_scale;
  a.v_scale = p.v_scale;
  CacheUpdateKernel<<<static_cast<unsigned>(dims.num_tokens), kUpdateThreads, 0, stream>>>(a);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return Status::Internal(std::string("paged KV cache update: launch failed: ") + cudaGetErrorString(err));
  }
  return Status::Ok();
}

}  // namespace ejk::paged_attention
