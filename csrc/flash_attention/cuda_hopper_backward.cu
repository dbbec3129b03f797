// Hopper (sm_90a) flash attention backward: which calls it takes, the small kernels around
// the main one (cuda_hopper_backward.cuh): per-row statistics, the sink gradient and the dQ
// conversion, tensor maps, dispatch.
//
// Scratch (sizes from shapes only): lse2 and delta [B, Hq, padded_q] f32, padded_q = Sq (for
// packed sequences, the packed length) rounded up to the query tile, then the tile-major f32
// dQ accumulator, then (segment ids only) the query segment ids padded to [B, padded_q] and
// the smallest and largest id of each query tile, [B, num_m_blocks] int2, then
// (deterministic mode only) the dQ turn counters, [B, Hq, num_m_blocks, 2] int32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "flash_attention/cuda_build_scope.h"
#include "flash_attention/cuda_hopper_backward.cuh"
#include "runtime/cuda_mma.h"

namespace ejk::flash_attention {
namespace hopper_backward {

#if EJK_FA_HEAD_DIM_ENABLED(64)
extern template Status Launch<64>(const KernelParams&, bool, bool, int, cudaStream_t);
extern template Status LaunchSegments<64>(const KernelParams&, bool, bool, int, cudaStream_t);
extern template Status LaunchDropout<64>(const KernelParams&, bool, bool, int, cudaStream_t);
extern template Status LaunchDenseDropout<64>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
extern template Status LaunchSegmentsDenseDropout<64>(const KernelParams&, bool, bool, Elementwise, int,
                                                      cudaStream_t);
extern template Status LaunchDense<64>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
extern template Status LaunchSegmentsDense<64>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
extern template Status LaunchBiasF32<64>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(96)
extern template Status Launch<96>(const KernelParams&, bool, bool, int, cudaStream_t);
extern template Status LaunchSegments<96>(const KernelParams&, bool, bool, int, cudaStream_t);
extern template Status LaunchDropout<96>(const KernelParams&, bool, bool, int, cudaStream_t);
extern template Status LaunchDenseDropout<96>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
extern template Status LaunchSegmentsDenseDropout<96>(const KernelParams&, bool, bool, Elementwise, int,
                                                      cudaStream_t);
extern template Status LaunchDense<96>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
extern template Status LaunchSegmentsDense<96>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
extern template Status LaunchBiasF32<96>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(128)
extern template Status Launch<128>(const KernelParams&, bool, bool, int, cudaStream_t);
extern template Status LaunchSegments<128>(const KernelParams&, bool, bool, int, cudaStream_t);
extern template Status LaunchDropout<128>(const KernelParams&, bool, bool, int, cudaStream_t);
extern template Status LaunchDenseDropout<128>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
extern template Status LaunchSegmentsDenseDropout<128>(const KernelParams&, bool, bool, Elementwise, int,
                                                      cudaStream_t);
extern template Status LaunchDense<128>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
extern template Status LaunchSegmentsDense<128>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
extern template Status LaunchBiasF32<128>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(192)
extern template Status Launch<192>(const KernelParams&, bool, bool, int, cudaStream_t);
extern template Status LaunchSegments<192>(const KernelParams&, bool, bool, int, cudaStream_t);
extern template Status LaunchDropout<192>(const KernelParams&, bool, bool, int, cudaStream_t);
extern template Status LaunchDenseDropout<192>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
extern template Status LaunchSegmentsDenseDropout<192>(const KernelParams&, bool, bool, Elementwise, int,
                                                      cudaStream_t);
extern template Status LaunchDense<192>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
extern template Status LaunchSegmentsDense<192>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(256)
extern template Status Launch<256>(const KernelParams&, bool, bool, int, cudaStream_t);
extern template Status LaunchSegments<256>(const KernelParams&, bool, bool, int, cudaStream_t);
extern template Status LaunchDropout<256>(const KernelParams&, bool, bool, int, cudaStream_t);
extern template Status LaunchDenseDropout<256>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
extern template Status LaunchSegmentsDenseDropout<256>(const KernelParams&, bool, bool, Elementwise, int,
                                                      cudaStream_t);
extern template Status LaunchDense<256>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
extern template Status LaunchSegmentsDense<256>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
#endif

namespace {

constexpr int kPreprocessThreads = 256;
constexpr int kConvertThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;

// The head dim whose layout a call's head dim runs in (that of its kernels' head dim), its
// query rows per tile and keys per block (cuda_hopper_backward.cuh).
int PaddedDimFor(int64_t head_dim) {
  const int kernel_head_dim = static_cast<int>(KernelHeadDim(head_dim));
  switch (kernel_head_dim) {
    case 96: return PaddedHeadDim<96>::kValue;
    case 192: return PaddedHeadDim<192>::kValue;
    default: return kernel_head_dim;
  }
}
int BlockMFor(int64_t head_dim, bool narrow) { return BlockMOf(PaddedDimFor(head_dim), narrow); }
int BlockNFor(int64_t head_dim) {
  const int padded = PaddedDimFor(head_dim);
  return padded == 64 ? Layout<64>::kBlockN : padded == 128 ? Layout<128>::kBlockN : Layout<256>::kBlockN;
}

struct ScratchLayout {
  int64_t num_m_blocks, padded_q, rows;
  size_t stat_bytes, dq_bytes;
  size_t q_id_bytes, tile_segment_bytes;  // segment ids only, else 0
  size_t turn_bytes;                      // deterministic mode only, else 0
};

// Whether the call's kernel takes narrow query tiles (NarrowRows of its features): it reads a
// float32 bias (folded into one where its dtype was another), or a mask as it is with dropout.
bool NarrowRowsFor(const hopper::ForwardCall& c) {
  return c.bias_f32 || (c.mask && !c.bias && c.folded_batch == 0 && c.dropout);
}

ScratchLayout ScratchFor(const Dims& d, bool segments, bool deterministic, bool narrow) {
  ScratchLayout s;
  const int block_m = BlockMFor(d.head_dim, narrow);
  s.num_m_blocks = (d.seqlen_q + block_m - 1) / block_m;
  s.padded_q = s.num_m_blocks * block_m;
  s.rows = d.batch * d.num_q_heads * s.padded_q;
  s.stat_bytes = AlignScratch(static_cast<size_t>(s.rows) * sizeof(float));
  s.dq_bytes = AlignScratch(static_cast<size_t>(s.rows * PaddedDimFor(d.head_dim)) * sizeof(float));
  s.q_id_bytes = segments ? AlignScratch(static_cast<size_t>(d.batch * s.padded_q) * sizeof(int32_t)) : 0;
  s.tile_segment_bytes = segments ? AlignScratch(static_cast<size_t>(d.batch * s.num_m_blocks) * sizeof(int2)) : 0;
  s.turn_bytes =
      deterministic ? AlignScratch(static_cast<size_t>(d.batch * d.num_q_heads * s.num_m_blocks * 2) * sizeof(int32_t)) : 0;
  return s;
}

bool HasSegments(const BackwardParams& p) { return p.fwd.q_segment_ids.present(); }

// Whether several (batch, q head) pairs add into each element of dbias: the kernel sums them
// by atomics. (dbias, not fwd.bias: a folded bias has the mask's broadcast dims too.)
bool DbiasSummed(const BackwardParams& p, const Dims& d) {
  return p.dbias.present() && BiasGradSummed(p.dbias, d);
}

// Deterministic mode adds up the gradient of a bias broadcast over the batch (not the heads)
// one batch row at a time: within a row each element has one writer, and the rows add in
// stream order. Taken where one row's grid (kv heads x key blocks) fills the GPU; else the
// rows' launches would cost more than the mma.sync kernel's single pass.
bool DeterministicRowsSumDbias(const BackwardParams& p, const Dims& d,
                               const CudaDeviceInfo& device = CurrentCudaDevice()) {
  if (!p.deterministic || !p.dbias.present() || d.batch == 1 || p.dbias.dim(0) != 1 ||
      p.dbias.dim(1) != d.num_q_heads) {
    return false;
  }
  const int64_t block_n = BlockNFor(d.head_dim);
  return d.num_kv_heads * ((d.seqlen_k + block_n - 1) / block_n) >= device.sm_count;
}

// lse2 (lse in log2 units; -inf, a row that saw nothing, as +inf so that every recomputed P
// of it is 0) and delta = rowsum(dout * out) - dlse, [B, Hq, padded_q]; padding rows get +inf
// and 0. Rows go in out's memory order, (b, i, h) with i < padded_q, and padded_dim / 8 lanes
// share one, each with 16 bytes of out and dout (none past head_dim), so that a warp reads
// contiguous memory. (With one warp per row in [B, Hq, padded_q] order, half of a d128 warp
// idled and each row's 256 bytes lay 4 KB from the next.) Each thread also zeroes 8 floats
// of the dQ accumulator (rows * padded_dim of them), which saves a separate pass over it.
// Rows number below 2^31 (HopperBackwardSupports).
template <typename T>
__global__ void __launch_bounds__(kPreprocessThreads) PreprocessKernel(const T* out, const T* dout, const float* lse,
                                                                       const float* dlse, float* lse2, float* delta,
                                                                       float* dq_accum, int32_t rows, int32_t seqlen_q,
                                                                       int32_t padded_q, int32_t num_q_heads,
                                                                       int32_t head_dim, int32_t padded_dim) {
  const int lanes_per_row = padded_dim / 8;
  const int64_t row64 = static_cast<int64_t>(blockIdx.x) * (kPreprocessThreads / lanes_per_row) + threadIdx.x / lanes_per_row;
  const int chunk = threadIdx.x % lanes_per_row;
  // Every lane takes part in the shuffles: rows past the end load nothing and store nothing.
  const bool real_row = row64 < rows;
  if (real_row) {
    float4* zero = reinterpret_cast<float4*>(dq_accum) + (row64 * lanes_per_row + chunk) * 2;
    zero[0] = zero[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  const int32_t row = real_row ? static_cast<int32_t>(row64) : 0;
  const int32_t h = row % num_q_heads, bi = row / num_q_heads;
  const int32_t b = bi / padded_q, i = real_row ? bi % padded_q : seqlen_q;
  float sum = 0.0f;
  if (i < seqlen_q && chunk * 8 < head_dim) {
    const int64_t at = ((static_cast<int64_t>(b) * seqlen_q + i) * num_q_heads + h) * head_dim + chunk * 8;
    sum = cuda::Dot8<T>(*reinterpret_cast<const uint4*>(out + at), *reinterpret_cast<const uint4*>(dout + at));
  }
  // The same tree as a 32-lane reduction whose upper lanes hold zeros: results are unchanged.
  for (int width = lanes_per_row / 2; width > 0; width /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, width);
  if (!real_row || chunk != 0) return;
  const int64_t bh = static_cast<int64_t>(b) * num_q_heads + h;
  const int64_t padded = bh * padded_q + i;
  if (i >= seqlen_q) {
    lse2[padded] = INFINITY;
    delta[padded] = 0.0f;
    return;
  }
  const int64_t stat = bh * seqlen_q + i;
  const float l = lse[stat];
  lse2[padded] = l == -INFINITY ? INFINITY : l * kLog2e;
  delta[padded] = sum - (dlse != nullptr ? dlse[stat] : 0.0f);
}

constexpr int kSinkThreads = 256;

__device__ __forceinline__ float LoadScalar(const void* base, int dtype, int i) {
  switch (static_cast<DType>(dtype)) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case DType::kF16: return __half2float(static_cast<const __half*>(base)[i]);
    case DType::kF64: return static_cast<float>(static_cast<const double*>(base)[i]);
    default: return 0.0f;
  }
}

// dsoftmax_aux[h] = -sum over rows with finite lse of exp(aux_h - lse_i) * delta_i, in a
// fixed order (one block per head, fixed per-thread strides, fixed tree). Packed sequences:
// rows outside every sequence are padding, which has no sink. With `add`, the sum is added to
// dsink (the later rows of a call run per batch row).
__global__ void __launch_bounds__(kSinkThreads) SinkGradKernel(const void* sinks, int sink_dtype, const float* lse,
                                                               const float* delta, float* dsink, bool add,
                                                               int32_t batch,
                                                               int32_t num_q_heads, int32_t seqlen_q,
                                                               int32_t padded_q, const int* cu_seqlens_q,
                                                               int32_t num_sequences) {
  __shared__ float partial[kSinkThreads];
  const int32_t h = blockIdx.x;
  const float aux = LoadScalar(sinks, sink_dtype, h);
  int32_t begin = 0, end = seqlen_q;
  if (cu_seqlens_q != nullptr) {
    begin = min(max(cu_seqlens_q[0], 0), seqlen_q);
    end = min(max(cu_seqlens_q[num_sequences], begin), seqlen_q);
  }
  float sum = 0.0f;
  for (int32_t b = 0; b < batch; ++b) {
    const int64_t bh = static_cast<int64_t>(b) * num_q_heads + h;
    for (int32_t i = begin + threadIdx.x; i < end; i += kSinkThreads) {
      const float l = lse[bh * seqlen_q + i];
      if (l != -INFINITY) sum += expf(aux - l) * delta[bh * padded_q + i];
    }
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int width = kSinkThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) dsink[h] = (add ? dsink[h] : 0.0f) - partial[0];
}

// dq = scale * the tile-major accumulator (cuda_hopper_backward.cuh), one block per 64 x 64
// block of it. Warpgroup w's block holds, as float4 number 128 j + t, rows 16 (t / 32) +
// (t % 32) / 4 + {0, 8} of columns 8j + 2 (t % 4) + {0, 1}; query tiles of 64 rows hold
// 64-column blocks of the padded head dim (one per warpgroup at 128, two at 256), tiles of
// 128 rows one 64-row block per warpgroup. The block reads it in order (four 16-byte loads
// per thread), and writes it out through shared memory as whole 128-byte row segments:
// stored straight from the accumulator's order, each warp instruction wrote 4 bytes into 16
// rows, at about half the HBM bandwidth. Columns from head_dim on are padding: not written.
template <typename T>
__global__ void __launch_bounds__(kConvertThreads) ConvertDqKernel(const float* acc, T* dq, int32_t seqlen_q,
                                                                   int32_t num_q_heads, int32_t head_dim,
                                                                   int32_t padded_dim, int32_t block_m,
                                                                   int32_t num_m_blocks, float scale) {
  const int32_t blocks_per_tile = block_m * padded_dim / 4096;
  const int32_t tile = blockIdx.x / blocks_per_tile, w = blockIdx.x % blocks_per_tile;
  const int32_t col0 = block_m == 64 ? 64 * w : 0;
  if (col0 >= head_dim) return;
  // 64 rows of 128 bytes; the 16-byte chunk k of row r sits at position k ^ (r % 8), so that
  // both the scattered 4-byte writes and the row reads are free of bank conflicts.
  __shared__ uint4 staged[64 * 8];
  uint32_t* staged_words = reinterpret_cast<uint32_t*>(staged);
  const float4* src = reinterpret_cast<const float4*>(acc) + static_cast<int64_t>(blockIdx.x) * 1024;
#pragma unroll
  for (int k = 0; k < 1024 / kConvertThreads; ++k) {
    const int x = k * kConvertThreads + threadIdx.x;
    const float4 v = src[x];
    const int j = x / 128, t = x % 128;
    const int g = 16 * (t / 32) + (t % 32) / 4;
    const int word = (j ^ (g % 8)) * 4 + t % 4;
    staged_words[g * 32 + word] = cuda::PackFloat2<T>(v.x * scale, v.y * scale);
    staged_words[(g + 8) * 32 + word] = cuda::PackFloat2<T>(v.z * scale, v.w * scale);
  }
  __syncthreads();
  const int32_t m_block = tile % num_m_blocks, bh = tile / num_m_blocks;
  const int32_t b = bh / num_q_heads, h = bh % num_q_heads;
  const int64_t row_stride = static_cast<int64_t>(num_q_heads) * head_dim;
  T* head_out = dq + static_cast<int64_t>(b) * seqlen_q * row_stride + static_cast<int64_t>(h) * head_dim + col0;
#pragma unroll
  for (int k = 0; k < 64 * 8 / kConvertThreads; ++k) {
    const int row = k * (kConvertThreads / 8) + threadIdx.x / 8, chunk = threadIdx.x % 8;
    const int32_t i = m_block * block_m + (block_m == 64 ? row : 64 * w + row);
    if (i < seqlen_q && col0 + chunk * 8 < head_dim) {
      *reinterpret_cast<uint4*>(head_out + static_cast<int64_t>(i) * row_stride + chunk * 8) =
          staged[row * 8 + (chunk ^ (row % 8))];
    }
  }
}

Status LastLaunch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string("hopper flash attention backward: ") + what + " launch failed: " +
                          cudaGetErrorString(err));
}

// Segment ids, a bias, a mask or dropout take their own kernels (compiled in
// cuda_hopper_backward_segments_hdim*.cu, cuda_hopper_backward_dense_hdim*.cu,
// cuda_hopper_backward_bias_f32_hdim*.cu, cuda_hopper_backward_dropout_hdim*.cu,
// cuda_hopper_backward_dense_dropout_hdim*.cu and cuda_hopper_backward_segments_dense_dropout_hdim*.cu).
template <int kHeadDim>
Status LaunchHeadDim(const KernelParams& kp, bool f16, bool softcap, Elementwise feature, int batch,
                     cudaStream_t stream) {
  if (kp.dropout.seed != nullptr) {
    if (feature == Elementwise::kNone) return LaunchDropout<kHeadDim>(kp, f16, softcap, batch, stream);
    if (kp.q_segment_ids == nullptr) return LaunchDenseDropout<kHeadDim>(kp, f16, softcap, feature, batch, stream);
    if constexpr (kSegmentIdsBuilt) {
      return LaunchSegmentsDenseDropout<kHeadDim>(kp, f16, softcap, feature, batch, stream);
    } else {
      return FeatureNotBuilt("segment_ids");
    }
  }
  if (Has(feature, Elementwise::kBiasF32)) {
    if constexpr (kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128) {
      return LaunchBiasF32<kHeadDim>(kp, f16, softcap, feature, batch, stream);
    } else {
      return Status::Internal("hopper flash attention backward: no float32 bias kernel at head_dim " +
                              std::to_string(kHeadDim));
    }
  }
  if (feature != Elementwise::kNone) {  // a bias or a mask
    if (kp.q_segment_ids != nullptr) {
      if constexpr (kSegmentIdsBuilt) {
        return LaunchSegmentsDense<kHeadDim>(kp, f16, softcap, feature, batch, stream);
      } else {
        return FeatureNotBuilt("segment_ids");
      }
    }
    return LaunchDense<kHeadDim>(kp, f16, softcap, feature, batch, stream);
  }
  if (kp.q_segment_ids == nullptr) return Launch<kHeadDim>(kp, f16, softcap, batch, stream);
  if constexpr (kSegmentIdsBuilt) {
    return LaunchSegments<kHeadDim>(kp, f16, softcap, batch, stream);
  } else {
    return FeatureNotBuilt("segment_ids");
  }
}

Status LaunchMain(int64_t head_dim, const KernelParams& kp, bool f16, bool softcap, Elementwise feature, int batch,
                  cudaStream_t stream) {
  switch (KernelHeadDim(head_dim)) {
#if EJK_FA_HEAD_DIM_ENABLED(64)
    case 64: return LaunchHeadDim<64>(kp, f16, softcap, feature, batch, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(96)
    case 96: return LaunchHeadDim<96>(kp, f16, softcap, feature, batch, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(128)
    case 128: return LaunchHeadDim<128>(kp, f16, softcap, feature, batch, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(192)
    case 192: return LaunchHeadDim<192>(kp, f16, softcap, feature, batch, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(256)
    case 256: return LaunchHeadDim<256>(kp, f16, softcap, feature, batch, stream);
#endif
    default: return Status::Unimplemented("hopper flash attention backward: head_dim " + std::to_string(head_dim));
  }
}

}  // namespace
}  // namespace hopper_backward

Status HopperBackwardSupports(const BackwardParams& p, const Dims& dims, const CudaDeviceInfo& device) {
  EJK_RETURN_IF_ERROR(CheckFeaturesBuilt(p.fwd));
  const auto no = [](const std::string& why) {
    return Status::Unimplemented("hopper flash attention backward: " + why);
  };
  const ForwardParams& f = p.fwd;
  if (std::string why = HopperUnsupportedReason(device, EJK_CUDA_ARCHS); !why.empty()) return no(why);
  if (f.q.dtype != DType::kBF16 && f.q.dtype != DType::kF16) return no("query dtype must be bf16 or f16, got " + f.q.ToString());
  if (std::string why = HeadDimUnsupportedReason(dims.head_dim); !why.empty()) return no(why);
  const hopper::ForwardCall call = hopper::ForwardCallOf(f, dims);
  if (f.bias.present() || f.mask.present()) {
    // The forward's rule (one of them, not with packed sequences, ...), then the backward's own.
    if (std::string why = hopper::BackwardDenseUnsupportedReason(call); !why.empty()) {
      return no(why);
    }
    if (p.deterministic && p.dbias.present() && p.dbias.dim(1) != dims.num_q_heads) {
      return no("deterministic mode with the gradient of a bias broadcast over the heads is not supported");
    }
    if (p.deterministic && p.dbias.present() && p.dbias.dim(0) != dims.batch &&
        !hopper_backward::DeterministicRowsSumDbias(p, dims, device)) {
      return no("deterministic mode with the gradient of a bias broadcast over the batch needs rows whose grid "
                "fills the GPU (num_kv_heads * key blocks >= multiprocessors)");
    }
  }
  if (std::string why = hopper::DropoutUnsupportedReason(call); !why.empty()) return no(why);
  if (dims.batch == 0 || dims.seqlen_q == 0 || dims.seqlen_k == 0) return no("empty sequences are not supported");
  if (dims.seqlen_q + dims.seqlen_k >= (int64_t{1} << 30)) return no("sequence lengths too large");
  if (dims.batch >= 65536 || dims.num_kv_heads >= 65536) return no("batch and num_kv_heads must be below 65536");
  if (dims.varlen && dims.num_sequences >= (int64_t{1} << 30)) return no("too many packed sequences");
  if (hopper_backward::ScratchFor(dims, call.segment_ids, p.deterministic, hopper_backward::NarrowRowsFor(call)).rows >=
      (int64_t{1} << 31)) {
    return no("batch * num_q_heads * seqlen_q must be below 2^31");
  }
  for (const TensorView* t : {&f.q, &f.k, &f.v, &f.out, &p.dout, &p.dq, &p.dk, &p.dv, &f.bias, &f.mask}) {
    if (reinterpret_cast<uintptr_t>(t->data) % 16 != 0) return no("tensors must be 16-byte aligned");
  }
  return Status::Ok();
}

namespace hopper_backward {
namespace {

// Bytes of the kernels' own scratch at the start of BackwardHopper's (the folded bias follows).
size_t KernelScratchBytes(const Dims& dims, const hopper::ForwardCall& call, bool deterministic) {
  if (KernelHeadDim(dims.head_dim) == 0) return 0;
  const ScratchLayout s = ScratchFor(dims, call.segment_ids, deterministic, NarrowRowsFor(call));
  return AlignScratch(2 * s.stat_bytes + s.dq_bytes + s.q_id_bytes + s.tile_segment_bytes + s.turn_bytes);
}

// How one batch row of a call run row by row treats the gradients its rows share: dsoftmax_aux
// always, dbias where the bias broadcasts over the batch (then added by atomics: each element
// once per row, so the rows' sums come in a fixed order). The first row overwrites, the others
// add.
struct SharedGrads {
  bool dbias_shared = false;
  bool add = false;
};

// narrow: NarrowRowsFor of the call (before its fold).
Status Run(const CudaBackwardArgs& args, bool narrow, void* scratch, cudaStream_t stream, SharedGrads shared = {});

}  // namespace
}  // namespace hopper_backward

size_t BackwardHopperScratchBytes(const Dims& dims, const hopper::ForwardCall& call, bool deterministic) {
  return hopper_backward::KernelScratchBytes(dims, call, deterministic) + hopper::FoldedBiasBytes(call);
}

Status BackwardHopper(const CudaBackwardArgs& args, void* scratch, cudaStream_t stream) {
  const ForwardParams& f = args.p.fwd;
  EJK_RETURN_IF_ERROR(HopperBackwardSupports(args.p, args.dims, CurrentCudaDevice()));
  const hopper::ForwardCall call = hopper::ForwardCallOf(f, args.dims);
  const bool rows_sum_dbias = hopper_backward::DeterministicRowsSumDbias(args.p, args.dims);
  const bool narrow = hopper_backward::NarrowRowsFor(call);
  if (call.folded_batch == 0 && !rows_sum_dbias) return hopper_backward::Run(args, narrow, scratch, stream);
  // The forward's folded bias, again (per batch row where the forward's was): the kernels read
  // it, and dbias keeps the bias's shape (zero where the mask hides a key: P is 0 there).
  char* at = static_cast<char*>(scratch) +
             hopper_backward::KernelScratchBytes(args.dims, call, args.p.deterministic);
  CudaBackwardArgs whole = args;
  if (call.folded_batch != 0 && !call.fold_per_row) {
    EJK_RETURN_IF_ERROR(hopper::FoldBiasAndMask(f, call, at, stream, &whole.p.fwd.bias));
    whole.p.fwd.mask = TensorView{};
  }
  const int64_t rows = call.fold_per_row || rows_sum_dbias ? args.dims.batch : 1;
  for (int64_t b = 0; b < rows; ++b) {
    CudaBackwardArgs one = whole;
    hopper_backward::SharedGrads shared;
    if (rows > 1) {
      BackwardParams& row = one.p;
      row.fwd = hopper::ForwardParamsOfRow(whole.p.fwd, b);
      for (TensorView* t : {&row.dout, &row.dlse, &row.dq, &row.dk, &row.dv, &row.dbias}) *t = hopper::BatchRow(*t, b);
      one.dims.batch = 1;
      one.dropout_first_batch = b;
      shared.dbias_shared = args.p.dbias.present() && args.p.dbias.dim(0) == 1 && args.dims.batch > 1;
      shared.add = b > 0;
    }
    if (call.fold_per_row) {
      EJK_RETURN_IF_ERROR(hopper::FoldBiasAndMask(one.p.fwd, call, at, stream, &one.p.fwd.bias));
      one.p.fwd.mask = TensorView{};
    }
    EJK_RETURN_IF_ERROR(hopper_backward::Run(one, narrow, scratch, stream, shared));
  }
  return Status::Ok();
}

namespace hopper_backward {
namespace {

Status Run(const CudaBackwardArgs& args, bool narrow, void* scratch, cudaStream_t stream, SharedGrads shared) {
  const BackwardParams& p = args.p;
  const ForwardParams& f = p.fwd;
  const Dims& d = args.dims;
  // A bias of another dtype than the inputs' arrives here as float32 (folded where it was not).
  const bool bias_f32 = f.bias.present() && f.bias.dtype == DType::kF32;
  const ScratchLayout sl = ScratchFor(d, HasSegments(p), p.deterministic, narrow);
  const int block_m = BlockMFor(d.head_dim, narrow);
  const bool f16 = f.q.dtype == DType::kF16;
  char* base = static_cast<char*>(scratch);

  KernelParams kp;
  EJK_RETURN_IF_ERROR(hopper::MakeTensorMap(f.q, block_m, "query", &kp.tma_q));
  const int block_n = BlockNFor(d.head_dim);
  EJK_RETURN_IF_ERROR(hopper::MakeTensorMap(f.k, block_n, "key", &kp.tma_k));
  EJK_RETURN_IF_ERROR(hopper::MakeTensorMap(f.v, block_n, "value", &kp.tma_v));
  EJK_RETURN_IF_ERROR(hopper::MakeTensorMap(p.dout, block_m, "dout", &kp.tma_do));
  kp.dk = p.dk.data;
  kp.dv = p.dv.data;
  kp.dkv_f32 = p.dk.dtype == DType::kF32;
  float* lse2 = reinterpret_cast<float*>(base);
  float* delta = reinterpret_cast<float*>(base + sl.stat_bytes);
  kp.lse2 = lse2;
  kp.delta = delta;
  kp.dq_accum = reinterpret_cast<float*>(base + 2 * sl.stat_bytes);
  kp.seqlen_q = static_cast<int>(d.seqlen_q);
  kp.seqlen_k = static_cast<int>(d.seqlen_k);
  kp.num_q_heads = static_cast<int>(d.num_q_heads);
  kp.num_kv_heads = static_cast<int>(d.num_kv_heads);
  kp.group = static_cast<int>(d.num_q_heads / d.num_kv_heads);
  kp.num_m_blocks = static_cast<int>(sl.num_m_blocks);
  kp.section = 1;
  kp.padded_q = static_cast<int>(sl.padded_q);
  kp.head_dim = static_cast<int>(d.head_dim);
  kp.cu_seqlens_q = d.varlen ? f.cu_seqlens_q.ptr<int>() : nullptr;
  kp.cu_seqlens_k = d.varlen ? f.cu_seqlens_k.ptr<int>() : nullptr;
  kp.num_sequences = d.varlen ? static_cast<int>(d.num_sequences) : 0;
  if (f.logits_soft_cap > 0.0f) {
    kp.softcap_pre = f.softmax_scale / f.logits_soft_cap;
    kp.logit_scale = f.logits_soft_cap * kLog2e;
  } else {
    kp.softcap_pre = 0.0f;
    kp.logit_scale = f.softmax_scale * kLog2e;
  }
  kp.dk_scale = f.softmax_scale;
  hopper::WindowSides(hopper::ForwardCallOf(f, d), &kp.left, &kp.right);
  kp.q_segment_ids = nullptr;
  kp.q_tile_segments = nullptr;
  kp.kv_segment_ids = nullptr;
  kp.dq_turns = nullptr;
  EJK_RETURN_IF_ERROR(hopper::PrepareDropoutOperand(f, args.dropout_seed, args.dropout_first_batch, &kp.dropout));
  EJK_RETURN_IF_ERROR(hopper::PrepareDenseOperand(f, block_m, &kp.dense));
  kp.batch_inner = hopper::DenseSharedAcrossBatch(kp.dense, d);
  kp.dbias = nullptr;
  kp.dbias_stride_b = kp.dbias_stride_h = 0;
  kp.dbias_atomic = 0;
  kp.dbias_f32 = 1;
  if (p.dbias.present()) {
    const int64_t plane = d.seqlen_q * d.seqlen_k;
    kp.dbias = p.dbias.data;
    kp.dbias_f32 = p.dbias.dtype == DType::kF32;
    kp.dbias_stride_h = p.dbias.dim(1) > 1 ? plane : 0;
    kp.dbias_stride_b = p.dbias.dim(0) > 1 ? p.dbias.dim(1) * plane : 0;
    kp.dbias_atomic = DbiasSummed(p, d) || shared.dbias_shared;
  }
  if (HasSegments(p)) {
    char* segments = base + 2 * sl.stat_bytes + sl.dq_bytes;
    int* q_ids_padded = reinterpret_cast<int*>(segments);
    int2* tile_segments = reinterpret_cast<int2*>(segments + sl.q_id_bytes);
    EJK_RETURN_IF_ERROR(hopper::LaunchTileSegments(f.q_segment_ids.ptr<int>(), tile_segments, q_ids_padded, d.batch,
                                                   d.seqlen_q, block_m, stream));
    kp.q_segment_ids = q_ids_padded;
    kp.q_tile_segments = tile_segments;
    kp.kv_segment_ids = f.kv_segment_ids.ptr<int>();
  }

  const auto zero = [&](void* ptr, size_t bytes) {
    const cudaError_t err = cudaMemsetAsync(ptr, 0, bytes, stream);
    return err == cudaSuccess ? Status::Ok()
                              : Status::Internal(std::string("hopper flash attention backward: memset failed: ") +
                                                 cudaGetErrorString(err));
  };
  // Sums start from zero, and stores reach every element unless a mask (causal, window,
  // segment ids) lets key blocks skip query tiles.
  const bool tiles_skipped = f.causal || f.window_left >= 0 || f.window_right >= 0 || HasSegments(p);
  if (kp.dbias != nullptr && (kp.dbias_atomic ? !(shared.dbias_shared && shared.add) : tiles_skipped)) {
    EJK_RETURN_IF_ERROR(zero(kp.dbias, p.dbias.SizeBytes()));
  }
  if (p.deterministic) {
    kp.dq_turns = reinterpret_cast<int*>(base + 2 * sl.stat_bytes + sl.dq_bytes + sl.q_id_bytes + sl.tile_segment_bytes);
    EJK_RETURN_IF_ERROR(zero(kp.dq_turns, sl.turn_bytes));
  }
  if (d.varlen) {
    // Keys outside every sequence get no block: their dK and dV are zero.
    EJK_RETURN_IF_ERROR(zero(p.dk.data, p.dk.SizeBytes()));
    EJK_RETURN_IF_ERROR(zero(p.dv.data, p.dv.SizeBytes()));
  }
  const int head_dim = static_cast<int>(d.head_dim);
  const int padded_dim = PaddedDimFor(d.head_dim);
  {
    const int rows_per_block = kPreprocessThreads / (padded_dim / 8);
    const unsigned blocks = static_cast<unsigned>((sl.rows + rows_per_block - 1) / rows_per_block);
    const int32_t rows = static_cast<int32_t>(sl.rows);
    const float* dlse = p.dlse.present() ? p.dlse.ptr<float>() : nullptr;
    if (f16) {
      PreprocessKernel<__half><<<blocks, kPreprocessThreads, 0, stream>>>(
          static_cast<const __half*>(f.out.data), static_cast<const __half*>(p.dout.data), f.lse.ptr<float>(), dlse,
          lse2, delta, kp.dq_accum, rows, kp.seqlen_q, kp.padded_q, kp.num_q_heads, head_dim,
          padded_dim);
    } else {
      PreprocessKernel<__nv_bfloat16><<<blocks, kPreprocessThreads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(f.out.data), static_cast<const __nv_bfloat16*>(p.dout.data),
          f.lse.ptr<float>(), dlse, lse2, delta, kp.dq_accum, rows, kp.seqlen_q, kp.padded_q, kp.num_q_heads, head_dim,
          padded_dim);
    }
    EJK_RETURN_IF_ERROR(LastLaunch("preprocess"));
  }
  if (p.dsoftmax_aux.present()) {
    SinkGradKernel<<<static_cast<unsigned>(d.num_q_heads), kSinkThreads, 0, stream>>>(
        f.softmax_aux.data, static_cast<int>(f.softmax_aux.dtype), f.lse.ptr<float>(), delta,
        p.dsoftmax_aux.ptr<float>(), shared.add, static_cast<int32_t>(d.batch), kp.num_q_heads, kp.seqlen_q,
        kp.padded_q, kp.cu_seqlens_q, kp.num_sequences);
    EJK_RETURN_IF_ERROR(LastLaunch("sink gradient"));
  }
  const Elementwise feature =
      f.bias.present() ? (bias_f32 ? (p.dbias.present() ? Elementwise::kBiasF32WithGrad : Elementwise::kBiasF32)
                                   : (p.dbias.present() ? Elementwise::kBiasWithGrad : Elementwise::kBias))
      : f.mask.present() ? Elementwise::kMask
                         : Elementwise::kNone;
  EJK_RETURN_IF_ERROR(
      LaunchMain(d.head_dim, kp, f16, f.logits_soft_cap > 0.0f, feature, static_cast<int>(d.batch), stream));
  {
    const unsigned blocks = static_cast<unsigned>(sl.rows * padded_dim / 4096);  // 64 x 64 blocks
    if (f16) {
      ConvertDqKernel<__half><<<blocks, kConvertThreads, 0, stream>>>(kp.dq_accum, static_cast<__half*>(p.dq.data),
                                                                     kp.seqlen_q, kp.num_q_heads, head_dim, padded_dim, block_m,
                                                                     kp.num_m_blocks, f.softmax_scale);
    } else {
      ConvertDqKernel<__nv_bfloat16><<<blocks, kConvertThreads, 0, stream>>>(
          kp.dq_accum, static_cast<__nv_bfloat16*>(p.dq.data), kp.seqlen_q, kp.num_q_heads, head_dim, padded_dim, block_m,
          kp.num_m_blocks, f.softmax_scale);
    }
    EJK_RETURN_IF_ERROR(LastLaunch("dq conversion"));
  }
  return Status::Ok();
}

}  // namespace
}  // namespace hopper_backward
}  // namespace ejk::flash_attention
