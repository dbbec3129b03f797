// Flash attention backward on tensor cores: host entry points and the small kernels around
// the main ones (cuda_mma_backward.cuh): per-row statistics, the sink gradient and the dQ
// conversion.
//
// Scratch (sizes from shapes and flags only): lse2 and delta [B, Hq, Sq] f32, then, outside
// deterministic mode, the f32 dQ accumulator [B, Sq, Hq, D].
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "flash_attention/cuda.h"
#include "flash_attention/cuda_build_scope.h"
#include "flash_attention/cuda_mma_backward.cuh"
#include "flash_attention/cuda_mma_features.cuh"
#include "runtime/cuda_mma.h"

namespace ejk::flash_attention {
namespace mma_backward {

#if EJK_FA_HEAD_DIM_ENABLED(64)
extern template Status LaunchHeadDim<64>(const KernelArgs&, bool, bool, bool, cudaStream_t);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(96)
extern template Status LaunchHeadDim<96>(const KernelArgs&, bool, bool, bool, cudaStream_t);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(128)
extern template Status LaunchHeadDim<128>(const KernelArgs&, bool, bool, bool, cudaStream_t);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(192)
extern template Status LaunchHeadDim<192>(const KernelArgs&, bool, bool, bool, cudaStream_t);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(256)
extern template Status LaunchHeadDim<256>(const KernelArgs&, bool, bool, bool, cudaStream_t);
#endif

namespace {

constexpr int kRowsPerBlock = 8;  // preprocessing: one warp per row

// delta = rowsum(dout * out) - dlse and lse in log2 units (-inf, a row that saw nothing, as
// +inf so that every recomputed P of it is 0), both [B, Hq, Sq]; rows in q's layout order.
template <typename T>
__global__ void __launch_bounds__(kRowsPerBlock * 32) PreprocessKernel(const T* out, const T* dout, const float* lse,
                                                                       const float* dlse, float* lse2, float* delta,
                                                                       int64_t rows, int32_t seqlen_q,
                                                                       int32_t num_q_heads, int32_t head_dim) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const T* o = out + row * head_dim;
  const T* d = dout + row * head_dim;
  float sum = 0.0f;
  for (int c = lane; c < head_dim / 8; c += 32) {
    sum += cuda::Dot8<T>(*reinterpret_cast<const uint4*>(o + c * 8), *reinterpret_cast<const uint4*>(d + c * 8));
  }
  sum = cuda::LaneReduceSum(sum, 16);
  if (lane == 0) {
    const int64_t h = row % num_q_heads, i = (row / num_q_heads) % seqlen_q, b = row / (num_q_heads * seqlen_q);
    const int64_t at = (b * num_q_heads + h) * seqlen_q + i;
    const float l = lse[at];
    lse2[at] = l == -INFINITY ? INFINITY : l * mma::kLog2e;
    delta[at] = sum - (dlse != nullptr ? dlse[at] : 0.0f);
  }
}

constexpr int kSinkThreads = 256;

// dsoftmax_aux[h] = -sum over real rows with finite lse of exp(aux_h - lse_i) * delta_i, in
// a fixed order (one block per head, fixed per-thread strides, fixed tree).
__global__ void __launch_bounds__(kSinkThreads) SinkGradKernel(const mma::FeatureArgs f, const float* lse,
                                                               const float* delta, float* dsink, int32_t batch) {
  __shared__ float partial[kSinkThreads];
  const int32_t h = blockIdx.x, Hq = f.num_q_heads, Sq = f.seqlen_q;
  int32_t real_begin = 0, real_end = Sq;
  if (f.cu_q != nullptr) {
    real_begin = mma::ClampIndex(__ldg(f.cu_q), 0, Sq);
    real_end = mma::ClampIndex(__ldg(f.cu_q + f.num_sequences), real_begin, Sq);
  }
  const float aux = mma::SinkLogit(f, h);
  float sum = 0.0f;
  for (int32_t b = 0; b < batch; ++b) {
    const int64_t base = (static_cast<int64_t>(b) * Hq + h) * Sq;
    for (int32_t i = real_begin + threadIdx.x; i < real_end; i += kSinkThreads) {
      const float l = lse[base + i];
      if (l != -INFINITY) sum += expf(aux - l) * delta[base + i];
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

template <typename T>
__global__ void ConvertDqKernel(const float* acc, T* dq, int64_t n4, float scale) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 x = reinterpret_cast<const float4*>(acc)[i];
    uint2 packed;
    packed.x = cuda::PackFloat2<T>(x.x * scale, x.y * scale);
    packed.y = cuda::PackFloat2<T>(x.z * scale, x.w * scale);
    reinterpret_cast<uint2*>(dq)[i] = packed;
  }
}

Status LastLaunch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string("flash attention backward: ") + what + " launch failed: " +
                          cudaGetErrorString(err));
}

Status Memset(void* ptr, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return Status::Ok();
  const cudaError_t err = cudaMemsetAsync(ptr, 0, bytes, stream);
  if (err == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string("flash attention backward: memset failed: ") + cudaGetErrorString(err));
}

Status LaunchMain(int64_t d, const KernelArgs& a, bool bf16, bool general, bool deterministic, cudaStream_t stream) {
  switch (KernelHeadDim(d)) {
#if EJK_FA_HEAD_DIM_ENABLED(64)
    case 64: return LaunchHeadDim<64>(a, bf16, general, deterministic, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(96)
    case 96: return LaunchHeadDim<96>(a, bf16, general, deterministic, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(128)
    case 128: return LaunchHeadDim<128>(a, bf16, general, deterministic, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(192)
    case 192: return LaunchHeadDim<192>(a, bf16, general, deterministic, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(256)
    case 256: return LaunchHeadDim<256>(a, bf16, general, deterministic, stream);
#endif
    default: return Status::Unimplemented("unreachable");
  }
}

template <int kD>
constexpr int SharedBytes() {
  return std::max(KvTile<kD>::kSmemBytes, DqTile<kD>::kSmemBytes);
}

}  // namespace
}  // namespace mma_backward

int BackwardMmaSharedBytes(int64_t head_dim) {
  using mma_backward::SharedBytes;
  switch (KernelHeadDim(head_dim)) {
    case 64: return SharedBytes<64>();
    case 96: return SharedBytes<96>();
    case 128: return SharedBytes<128>();
    case 192: return SharedBytes<192>();
    case 256: return SharedBytes<256>();
    default: return 0;
  }
}

size_t BackwardMmaScratchBytes(const Dims& dims, bool deterministic) {
  const size_t rows = static_cast<size_t>(dims.batch * dims.num_q_heads * dims.seqlen_q);
  size_t bytes = 2 * AlignScratch(rows * sizeof(float));
  if (!deterministic) bytes += AlignScratch(rows * static_cast<size_t>(dims.head_dim) * sizeof(float));
  return bytes;
}

Status BackwardMma(const CudaBackwardArgs& args, const CudaConfig& cfg, void* scratch, cudaStream_t stream) {
  using namespace mma_backward;
  (void)cfg;  // the tiles follow the head dim (cuda_mma_backward.cuh)
  const BackwardParams& p = args.p;
  const ForwardParams& fp = p.fwd;
  const Dims& d = args.dims;
  EJK_RETURN_IF_ERROR(CheckFeaturesBuilt(fp));
  const bool bf16 = fp.q.dtype == DType::kBF16;
  if (!bf16 && fp.q.dtype != DType::kF16) {
    return Status::Unimplemented(std::string("flash attention backward (mma): dtype ") + DTypeName(fp.q.dtype) +
                                 " not supported (bf16, f16 only)");
  }
  if (std::string why = HeadDimUnsupportedReason(d.head_dim); !why.empty()) {
    return Status::Unimplemented("flash attention backward (mma): " + why);
  }
  if (fp.dropout_prob > 0.0f && args.dropout_seed == nullptr) {
    return Status::InvalidArgument("flash attention backward: dropout needs a dropout_seed");
  }

  const int64_t rows = d.batch * d.num_q_heads * d.seqlen_q;
  const size_t stat_bytes = AlignScratch(static_cast<size_t>(rows) * sizeof(float));
  char* base = static_cast<char*>(scratch);
  KernelArgs a;
  a.f = mma::MakeFeatureArgs(fp, d, args.dropout_seed);
  a.q = fp.q.data;
  a.k = fp.k.data;
  a.v = fp.v.data;
  a.dout = p.dout.data;
  a.dq = p.dq.data;
  a.dk = p.dk.data;
  a.dv = p.dv.data;
  a.dkv_f32 = p.dk.dtype == DType::kF32;
  a.lse2 = reinterpret_cast<float*>(base);
  a.delta = reinterpret_cast<float*>(base + stat_bytes);
  a.dq_accum = p.deterministic ? nullptr : reinterpret_cast<float*>(base + 2 * stat_bytes);
  a.dbias = p.dbias.present() ? p.dbias.data : nullptr;
  a.dbias_f32 = !p.dbias.present() || p.dbias.dtype == DType::kF32;
  a.dbias_f16 = p.dbias.present() && p.dbias.dtype == DType::kF16;
  a.batch = static_cast<int32_t>(d.batch);
  a.num_kv_heads = static_cast<int32_t>(d.num_kv_heads);
  const bool bias_over_b = a.dbias != nullptr && fp.bias.dim(0) == 1 && d.batch > 1;
  const bool bias_over_h = a.dbias != nullptr && fp.bias.dim(1) == 1 && d.num_kv_heads > 1;
  // Deterministic: one block owns all the (batch, kv head) pairs summing into a dbias element.
  a.dbias_atomic = !p.deterministic && (bias_over_b || bias_over_h);
  a.pairs_b = p.deterministic && bias_over_b ? static_cast<int32_t>(d.batch) : 1;
  a.pairs_h = p.deterministic && bias_over_h ? static_cast<int32_t>(d.num_kv_heads) : 1;
  const bool general = mma::NeedsGeneral(a.f) || fp.logits_soft_cap > 0.0f;

  if (a.dbias != nullptr) EJK_RETURN_IF_ERROR(Memset(a.dbias, p.dbias.SizeBytes(), stream));
  if (a.dq_accum != nullptr) {
    EJK_RETURN_IF_ERROR(Memset(a.dq_accum, static_cast<size_t>(rows * d.head_dim) * sizeof(float), stream));
  }
  if (d.varlen) {
    // Keys and queries outside every sequence get no block.
    EJK_RETURN_IF_ERROR(Memset(p.dk.data, p.dk.SizeBytes(), stream));
    EJK_RETURN_IF_ERROR(Memset(p.dv.data, p.dv.SizeBytes(), stream));
    if (p.deterministic) EJK_RETURN_IF_ERROR(Memset(p.dq.data, p.dq.SizeBytes(), stream));
  }

  const int head_dim = static_cast<int>(d.head_dim);
  if (rows > 0) {
    const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
    const float* dlse = p.dlse.present() ? p.dlse.ptr<float>() : nullptr;
    if (bf16) {
      PreprocessKernel<__nv_bfloat16><<<blocks, kRowsPerBlock * 32, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(fp.out.data), static_cast<const __nv_bfloat16*>(p.dout.data),
          fp.lse.ptr<float>(), dlse, const_cast<float*>(a.lse2), const_cast<float*>(a.delta), rows,
          static_cast<int32_t>(d.seqlen_q), static_cast<int32_t>(d.num_q_heads), head_dim);
    } else {
      PreprocessKernel<__half><<<blocks, kRowsPerBlock * 32, 0, stream>>>(
          static_cast<const __half*>(fp.out.data), static_cast<const __half*>(p.dout.data), fp.lse.ptr<float>(), dlse,
          const_cast<float*>(a.lse2), const_cast<float*>(a.delta), rows, static_cast<int32_t>(d.seqlen_q),
          static_cast<int32_t>(d.num_q_heads), head_dim);
    }
    EJK_RETURN_IF_ERROR(LastLaunch("preprocess"));
  }
  if (p.dsoftmax_aux.present()) {
    SinkGradKernel<<<static_cast<unsigned>(d.num_q_heads), kSinkThreads, 0, stream>>>(
        a.f, fp.lse.ptr<float>(), a.delta, p.dsoftmax_aux.ptr<float>(), a.batch);
    EJK_RETURN_IF_ERROR(LastLaunch("sink gradient"));
  }
  if (d.seqlen_k == 0) {
    // No keys: every gradient of q, k, v is zero (dq never accumulates anything).
    if (p.deterministic) return Memset(p.dq.data, p.dq.SizeBytes(), stream);
  } else {
    EJK_RETURN_IF_ERROR(LaunchMain(d.head_dim, a, bf16, general, p.deterministic, stream));
  }
  if (a.dq_accum != nullptr && rows > 0) {
    const int64_t n4 = rows * d.head_dim / 4;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n4 + 255) / 256, 65536));
    if (bf16) {
      ConvertDqKernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(a.dq_accum, static_cast<__nv_bfloat16*>(p.dq.data),
                                                                 n4, fp.softmax_scale);
    } else {
      ConvertDqKernel<__half><<<blocks, 256, 0, stream>>>(a.dq_accum, static_cast<__half*>(p.dq.data), n4,
                                                          fp.softmax_scale);
    }
    EJK_RETURN_IF_ERROR(LastLaunch("dq conversion"));
  }
  return Status::Ok();
}

}  // namespace ejk::flash_attention
