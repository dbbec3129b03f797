// Hopper (sm_90a) flash attention backward: which calls it takes, the small kernels around
// the main one (cuda_hopper_backward.cuh): per-row statistics, the sink gradient and the dQ
// conversion, tensor maps, dispatch.
//
// Scratch (sizes from shapes only): lse2 and delta [B, Hq, padded_q] f32, padded_q = Sq (for
// packed sequences, the packed length) rounded up to the query tile, then the tile-major f32
// dQ accumulator.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "flash_attention/cuda_head_dims.h"
#include "flash_attention/cuda_hopper_backward.cuh"

namespace ejk::flash_attention {
namespace hopper_backward {

#if EJK_FA_HEAD_DIM_ENABLED(64)
extern template Status Launch<64>(const KernelParams&, bool, bool, int, cudaStream_t);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(128)
extern template Status Launch<128>(const KernelParams&, bool, bool, int, cudaStream_t);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(256)
extern template Status Launch<256>(const KernelParams&, bool, bool, int, cudaStream_t);
#endif

namespace {

constexpr size_t kAlign = 256;
constexpr int kRowsPerBlock = 8;  // preprocessing: one warp per row
constexpr float kLog2e = 1.4426950408889634f;

size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

bool HeadDimBuilt(int64_t d) {
  switch (d) {
#if EJK_FA_HEAD_DIM_ENABLED(64)
    case 64: return true;
#endif
#if EJK_FA_HEAD_DIM_ENABLED(128)
    case 128: return true;
#endif
#if EJK_FA_HEAD_DIM_ENABLED(256)
    case 256: return true;
#endif
    default: return false;
  }
}

__global__ void ArchProbeKernel() {}

// Whether this build holds sm_90a machine code for the current (compute capability 9.0)
// device; without it the main kernel is an sm_80 stub that traps.
bool BuiltForSm90() {
  static const bool built = [] {
    cudaFuncAttributes attr;
    return cudaFuncGetAttributes(&attr, ArchProbeKernel) == cudaSuccess && attr.binaryVersion == 90;
  }();
  return built;
}

// Query rows per tile and keys per block (cuda_hopper_backward.cuh), for a built head dim.
int BlockMFor(int64_t head_dim) {
  return head_dim == 64 ? Layout<64>::kBlockM : head_dim == 128 ? Layout<128>::kBlockM : Layout<256>::kBlockM;
}
int BlockNFor(int64_t head_dim) {
  return head_dim == 64 ? Layout<64>::kBlockN : head_dim == 128 ? Layout<128>::kBlockN : Layout<256>::kBlockN;
}

struct ScratchLayout {
  int64_t num_m_blocks, padded_q, rows;
  size_t stat_bytes, dq_bytes;
};

ScratchLayout ScratchFor(const Dims& d) {
  ScratchLayout s;
  const int block_m = BlockMFor(d.head_dim);
  s.num_m_blocks = (d.seqlen_q + block_m - 1) / block_m;
  s.padded_q = s.num_m_blocks * block_m;
  s.rows = d.batch * d.num_q_heads * s.padded_q;
  s.stat_bytes = AlignUp(static_cast<size_t>(s.rows) * sizeof(float));
  s.dq_bytes = AlignUp(static_cast<size_t>(s.rows * d.head_dim) * sizeof(float));
  return s;
}

template <typename T>
__device__ __forceinline__ float Dot8(const uint4& x, const uint4& y) {
  const T* a = reinterpret_cast<const T*>(&x);
  const T* b = reinterpret_cast<const T*>(&y);
  float sum = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) sum = fmaf(static_cast<float>(a[e]), static_cast<float>(b[e]), sum);
  return sum;
}

// lse2 (lse in log2 units; -inf, a row that saw nothing, as +inf so that every recomputed P
// of it is 0) and delta = rowsum(dout * out) - dlse, [B, Hq, padded_q]; padding rows get +inf
// and 0.
template <typename T>
__global__ void __launch_bounds__(kRowsPerBlock * 32) PreprocessKernel(const T* out, const T* dout, const float* lse,
                                                                       const float* dlse, float* lse2, float* delta,
                                                                       int64_t rows, int32_t seqlen_q, int32_t padded_q,
                                                                       int32_t num_q_heads, int32_t head_dim) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t bh = row / padded_q, i = row % padded_q;
  if (i >= seqlen_q) {
    if (lane == 0) {
      lse2[row] = INFINITY;
      delta[row] = 0.0f;
    }
    return;
  }
  const int64_t b = bh / num_q_heads, h = bh % num_q_heads;
  const int64_t at = (b * seqlen_q + i) * num_q_heads + h;
  const T* o = out + at * head_dim;
  const T* d = dout + at * head_dim;
  float sum = 0.0f;
  for (int c = lane; c < head_dim / 8; c += 32) {
    sum += Dot8<T>(*reinterpret_cast<const uint4*>(o + c * 8), *reinterpret_cast<const uint4*>(d + c * 8));
  }
#pragma unroll
  for (int width = 16; width > 0; width /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, width);
  if (lane == 0) {
    const int64_t stat = bh * seqlen_q + i;
    const float l = lse[stat];
    lse2[row] = l == -INFINITY ? INFINITY : l * kLog2e;
    delta[row] = sum - (dlse != nullptr ? dlse[stat] : 0.0f);
  }
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
// rows outside every sequence are padding, which has no sink.
__global__ void __launch_bounds__(kSinkThreads) SinkGradKernel(const void* sinks, int sink_dtype, const float* lse,
                                                               const float* delta, float* dsink, int32_t batch,
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
  if (threadIdx.x == 0) dsink[h] = -partial[0];
}

__device__ __forceinline__ void StorePair(__half* at, float x, float y) {
  *reinterpret_cast<__half2*>(at) = __floats2half2_rn(x, y);
}
__device__ __forceinline__ void StorePair(__nv_bfloat16* at, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(x, y);
}

// dq[b, i, h, c..c+1] = scale * the accumulator's pair, read from its tile-major register
// order (cuda_hopper_backward.cuh): warpgroup w holds a 64 x 64 block, element 4j + 2r + c
// of thread t is row 16 (t / 32) + (t % 32) / 4 + 8r, column 8j + 2 (t % 4) + c of it.
template <typename T>
__global__ void ConvertDqKernel(const float* acc, T* dq, int64_t pairs, int32_t seqlen_q, int32_t num_q_heads,
                                int32_t head_dim, int32_t block_m, int32_t num_m_blocks, float scale) {
  for (int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; x < pairs;
       x += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int col = static_cast<int>(x % (head_dim / 2)) * 2;
    const int64_t bih = x / (head_dim / 2);
    const int h = static_cast<int>(bih % num_q_heads);
    const int64_t bi = bih / num_q_heads;
    const int i = static_cast<int>(bi % seqlen_q);
    const int64_t b = bi / seqlen_q;
    const int m_block = i / block_m, row_in_tile = i % block_m;
    // Query tiles of 64 rows hold 64-column blocks of the head dim (one per warpgroup at
    // head dim 128, two at 256), tiles of 128 rows one 64-row block per warpgroup.
    const int w = block_m == 64 ? col / 64 : row_in_tile / 64;
    const int row = block_m == 64 ? row_in_tile : row_in_tile % 64;
    const int c = col % 64;
    const int t = (row / 16) * 32 + (row % 8) * 4 + (c % 8) / 2;
    const int e = (c / 8) * 4 + ((row % 16) / 8) * 2;  // element 4j + 2r
    const int64_t tile = ((b * num_q_heads + h) * num_m_blocks + m_block) * static_cast<int64_t>(block_m) * head_dim;
    const float2 v = *reinterpret_cast<const float2*>(acc + tile + w * 4096 + ((e / 4) * 128 + t) * 4 + e % 4);
    StorePair(dq + x * 2, v.x * scale, v.y * scale);
  }
}

Status LastLaunch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string("hopper flash attention backward: ") + what + " launch failed: " +
                          cudaGetErrorString(err));
}

Status LaunchMain(int64_t head_dim, const KernelParams& kp, bool f16, bool softcap, int batch, cudaStream_t stream) {
  switch (head_dim) {
#if EJK_FA_HEAD_DIM_ENABLED(64)
    case 64: return Launch<64>(kp, f16, softcap, batch, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(128)
    case 128: return Launch<128>(kp, f16, softcap, batch, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(256)
    case 256: return Launch<256>(kp, f16, softcap, batch, stream);
#endif
    default: return Status::Unimplemented("hopper flash attention backward: head_dim " + std::to_string(head_dim));
  }
}

}  // namespace
}  // namespace hopper_backward

Status HopperBackwardSupports(const BackwardParams& p, const Dims& dims, int device_major, int device_minor) {
  const auto no = [](const std::string& why) {
    return Status::Unimplemented("hopper flash attention backward: " + why);
  };
  const ForwardParams& f = p.fwd;
  if (device_major != 9 || device_minor != 0) {
    return no("needs compute capability 9.0, got " + std::to_string(device_major) + "." + std::to_string(device_minor));
  }
  if (!hopper_backward::BuiltForSm90()) return no("the library holds no sm_90a code");
  if (f.q.dtype != DType::kBF16 && f.q.dtype != DType::kF16) return no("query dtype must be bf16 or f16, got " + f.q.ToString());
  if (!hopper_backward::HeadDimBuilt(dims.head_dim)) {
    return no("head_dim must be 64, 128 or 256 (as built), got " + std::to_string(dims.head_dim));
  }
  if (f.bias.present()) return no("bias is not supported");
  if (f.mask.present()) return no("mask is not supported");
  if (f.q_segment_ids.present() || f.kv_segment_ids.present()) return no("segment ids are not supported");
  if (f.dropout_prob > 0.0f) return no("dropout is not supported");
  if (p.deterministic) return no("deterministic mode is not supported");
  if (dims.batch == 0 || dims.seqlen_q == 0 || dims.seqlen_k == 0) return no("empty sequences are not supported");
  if (dims.seqlen_q + dims.seqlen_k >= (int64_t{1} << 30)) return no("sequence lengths too large");
  if (dims.batch >= 65536 || dims.num_kv_heads >= 65536) return no("batch and num_kv_heads must be below 65536");
  if (dims.varlen && dims.num_sequences >= (int64_t{1} << 30)) return no("too many packed sequences");
  for (const TensorView* t : {&f.q, &f.k, &f.v, &f.out, &p.dout, &p.dq, &p.dk, &p.dv}) {
    if (reinterpret_cast<uintptr_t>(t->data) % 16 != 0) return no("tensors must be 16-byte aligned");
  }
  return Status::Ok();
}

size_t BackwardHopperScratchBytes(const Dims& dims, const BackwardParams&) {
  if (!hopper_backward::HeadDimBuilt(dims.head_dim)) return 0;
  const hopper_backward::ScratchLayout s = hopper_backward::ScratchFor(dims);
  return 2 * s.stat_bytes + s.dq_bytes;
}

Status BackwardHopper(const CudaBackwardArgs& args, void* scratch, cudaStream_t stream) {
  using namespace hopper_backward;
  const BackwardParams& p = args.p;
  const ForwardParams& f = p.fwd;
  const Dims& d = args.dims;
  EJK_RETURN_IF_ERROR(HopperBackwardSupports(p, d, 9, 0));
  const ScratchLayout sl = ScratchFor(d);
  const int block_m = BlockMFor(d.head_dim);
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
  hopper::WindowSides(f, d, &kp.left, &kp.right);

  const auto zero = [&](void* ptr, size_t bytes) {
    const cudaError_t err = cudaMemsetAsync(ptr, 0, bytes, stream);
    return err == cudaSuccess ? Status::Ok()
                              : Status::Internal(std::string("hopper flash attention backward: memset failed: ") +
                                                 cudaGetErrorString(err));
  };
  EJK_RETURN_IF_ERROR(zero(kp.dq_accum, sl.dq_bytes));
  if (d.varlen) {
    // Keys outside every sequence get no block: their dK and dV are zero.
    EJK_RETURN_IF_ERROR(zero(p.dk.data, p.dk.SizeBytes()));
    EJK_RETURN_IF_ERROR(zero(p.dv.data, p.dv.SizeBytes()));
  }
  const int head_dim = static_cast<int>(d.head_dim);
  {
    const unsigned blocks = static_cast<unsigned>((sl.rows + kRowsPerBlock - 1) / kRowsPerBlock);
    const float* dlse = p.dlse.present() ? p.dlse.ptr<float>() : nullptr;
    if (f16) {
      PreprocessKernel<__half><<<blocks, kRowsPerBlock * 32, 0, stream>>>(
          static_cast<const __half*>(f.out.data), static_cast<const __half*>(p.dout.data), f.lse.ptr<float>(), dlse,
          lse2, delta, sl.rows, kp.seqlen_q, kp.padded_q, kp.num_q_heads, head_dim);
    } else {
      PreprocessKernel<__nv_bfloat16><<<blocks, kRowsPerBlock * 32, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(f.out.data), static_cast<const __nv_bfloat16*>(p.dout.data),
          f.lse.ptr<float>(), dlse, lse2, delta, sl.rows, kp.seqlen_q, kp.padded_q, kp.num_q_heads, head_dim);
    }
    EJK_RETURN_IF_ERROR(LastLaunch("preprocess"));
  }
  if (p.dsoftmax_aux.present()) {
    SinkGradKernel<<<static_cast<unsigned>(d.num_q_heads), kSinkThreads, 0, stream>>>(
        f.softmax_aux.data, static_cast<int>(f.softmax_aux.dtype), f.lse.ptr<float>(), delta,
        p.dsoftmax_aux.ptr<float>(), static_cast<int32_t>(d.batch), kp.num_q_heads, kp.seqlen_q, kp.padded_q,
        kp.cu_seqlens_q, kp.num_sequences);
    EJK_RETURN_IF_ERROR(LastLaunch("sink gradient"));
  }
  EJK_RETURN_IF_ERROR(LaunchMain(d.head_dim, kp, f16, f.logits_soft_cap > 0.0f, static_cast<int>(d.batch), stream));
  {
    const int64_t pairs = d.batch * d.seqlen_q * d.num_q_heads * d.head_dim / 2;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((pairs + 255) / 256, 65536));
    if (f16) {
      ConvertDqKernel<__half><<<blocks, 256, 0, stream>>>(kp.dq_accum, static_cast<__half*>(p.dq.data), pairs,
                                                          kp.seqlen_q, kp.num_q_heads, head_dim, block_m,
                                                          kp.num_m_blocks, f.softmax_scale);
    } else {
      ConvertDqKernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(kp.dq_accum, static_cast<__nv_bfloat16*>(p.dq.data),
                                                                 pairs, kp.seqlen_q, kp.num_q_heads, head_dim, block_m,
                                                                 kp.num_m_blocks, f.softmax_scale);
    }
    EJK_RETURN_IF_ERROR(LastLaunch("dq conversion"));
  }
  return Status::Ok();
}

}  // namespace ejk::flash_attention
