// Paged attention on NVIDIA GPUs: the host-side entry points of the CUDA kernels.
// cuda_ffi.cu binds them to XLA; the kernels live in cuda_attention.cu and cuda_cache_update.cu.
//
// Every entry point takes validated params (Validate / ValidateCacheUpdate ran), device pointers
// only, enqueues on `stream` and never synchronises with the host. The metadata (kv_lens,
// block_tables, query_start_loc, num_seqs, kv_starts) lives in device memory: the kernels clamp
// every value they read, so bad metadata gives wrong numbers, never an out-of-bounds access.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "paged_attention/params.h"
#include "runtime/status.h"

namespace ejk::paged_attention {

// The most split-KV partitions one (query tile, kv head) may take (the combine's limit).
constexpr int kMaxCudaSplits = 128;

// Split-KV partitions per (query tile, kv head): cfg.num_splits when set, otherwise enough
// thread blocks for one full wave (two per SM), given the static shapes. At least 1.
int CudaNumSplits(const Dims& dims, const Config& cfg, int sm_count);

// Scratch for split partial results (fp32 outputs and softmax statistics) and the split
// counters (two 32-bit words per (token, q head)); 0 when num_splits is 1.
size_t CudaAttentionScratchBytes(const Dims& dims, int num_splits);

// Why the CUDA kernels cannot serve this head dim ("" when they can): above 256.
const char* CudaAttentionUnsupported(int64_t head_dim);

// Shared memory per block of the kernel serving these dtypes and head dim: the tensor-core
// kernel's (16-bit queries, a cache of their dtype or fp8), or 0 for the SIMT kernel.
int CudaAttentionSharedBytes(int64_t head_dim, DType q_dtype, DType cache_dtype);

// Attention over the paged cache. `scratch` holds CudaAttentionScratchBytes(dims, num_splits)
// bytes (may be null when that is 0).
Status CudaAttention(const Params& p, const Dims& dims, int num_splits, void* scratch, cudaStream_t stream);

// Writes the step's new keys and values into key_cache / value_cache in place.
Status CudaCacheUpdate(const CacheUpdateParams& p, const Dims& dims, cudaStream_t stream);

}  // namespace ejk::paged_attention
