// Reference CUDA flash attention forward: one warp per (batch, q head, query row), plain
// FP32 SIMT arithmetic, every feature of semantics.h. It is the correctness baseline for the
// tensor-core kernels on the GPU, not a fast path: its registry priority keeps automatic
// platform choice on XLA, and it runs only when platform="cuda" is asked for explicitly.
//
// Device memory holds cu_seqlens, so their values are clamped here instead of validated on
// the host (no host-device synchronisation in execute); shapes are validated as on the CPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "flash_attention/ffi_common.h"
#include "flash_attention/params.h"
#include "flash_attention/semantics.h"
#include "runtime/ffi_util.h"
#include "runtime/registry.h"

namespace ffi = xla::ffi;

namespace ejk::flash_attention {
namespace {

constexpr int kWarp = 32;
constexpr int kMaxHeadDim = 256;
constexpr int kDimsPerLane = kMaxHeadDim / kWarp;
constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ float Load(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case DType::kF16: return __half2float(static_cast<const __half*>(base)[i]);
    case DType::kF64: return static_cast<float>(static_cast<const double*>(base)[i]);
    default: return 0.0f;
  }
}

__device__ __forceinline__ void Store(void* base, DType dtype, int64_t i, float x) {
  switch (dtype) {
    case DType::kF32: static_cast<float*>(base)[i] = x; break;
    case DType::kBF16: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16(x); break;
    case DType::kF16: static_cast<__half*>(base)[i] = __float2half(x); break;
    default: break;
  }
}

__device__ __forceinline__ float WarpSum(float x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ int64_t Clamp(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

struct KernelArgs {
  ForwardParams p;
  const uint32_t* dropout_seed;  // device scalar, read only when dropout is on
  Dims dims;
  uint32_t dropout_threshold;
  float dropout_scale;
};

__global__ void __launch_bounds__(kWarpsPerBlock* kWarp)
    ReferenceForwardKernel(const KernelArgs args) {
  const ForwardParams& p = args.p;
  const Dims& d = args.dims;
  const int lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (row >= d.batch * d.num_q_heads * d.seqlen_q) return;
  const int64_t i = row % d.seqlen_q;
  const int64_t h = (row / d.seqlen_q) % d.num_q_heads;
  const int64_t b = row / (d.seqlen_q * d.num_q_heads);
  const int64_t kv_head = h / (d.num_q_heads / d.num_kv_heads);
  const int64_t D = d.head_dim;

  // The query's sequence: its key range and its local positions.
  int64_t q_begin = 0, q_len = d.seqlen_q, k_begin = 0, k_len = d.seqlen_k;
  bool padding_row = false;
  if (d.varlen) {
    const int32_t* cu_q = p.cu_seqlens_q.ptr<int32_t>();
    const int32_t* cu_k = p.cu_seqlens_k.ptr<int32_t>();
    padding_row = true;
    for (int64_t n = 0; n < d.num_sequences; ++n) {
      const int64_t qb = Clamp(cu_q[n], 0, d.seqlen_q), qe = Clamp(cu_q[n + 1], qb, d.seqlen_q);
      if (i >= qb && i < qe) {
        q_begin = qb;
        q_len = qe - qb;
        k_begin = Clamp(cu_k[n], 0, d.seqlen_k);
        k_len = Clamp(cu_k[n + 1], k_begin, d.seqlen_k) - k_begin;
        padding_row = false;
        break;
      }
    }
  }
  const int64_t local_i = i - q_begin;
  const int64_t offset = k_len - q_len;
  int64_t j_begin = 0, j_end = 0;
  if (!padding_row) {
    VisibleKeyRange(local_i, k_len, offset, p.causal, p.window_left, p.window_right, &j_begin, &j_end);
  }

  float q[kDimsPerLane], acc[kDimsPerLane];
  const int64_t q_base = ((b * d.seqlen_q + i) * d.num_q_heads + h) * D;
  for (int t = 0; t < kDimsPerLane; ++t) {
    const int64_t dim = lane + t * kWarp;
    q[t] = dim < D ? Load(p.q.data, p.q.dtype, q_base + dim) : 0.0f;
    acc[t] = 0.0f;
  }
  const bool has_sink = p.softmax_aux.present() && !padding_row;  // padding rows: out 0, lse -inf
  float running_max = has_sink ? Load(p.softmax_aux.data, p.softmax_aux.dtype, h) : -INFINITY;
  float running_sum = has_sink ? 1.0f : 0.0f;
  const uint32_t seed = p.dropout_prob > 0.0f ? *args.dropout_seed : 0u;
  const uint32_t row_key =
      DropoutRowKey(seed, static_cast<uint32_t>(b * d.num_q_heads + h), static_cast<uint32_t>(i));

  for (int64_t local_j = j_begin; local_j < j_end; ++local_j) {
    const int64_t j = k_begin + local_j;
    if (p.mask.present()) {
      const int64_t mb = p.mask.shape[0] == 1 ? 0 : b, mh = p.mask.shape[1] == 1 ? 0 : h;
      if (!static_cast<const uint8_t*>(p.mask.data)[((mb * p.mask.shape[1] + mh) * d.seqlen_q + i) * d.seqlen_k + j]) continue;
    }
    if (p.q_segment_ids.present() &&
        p.q_segment_ids.ptr<int32_t>()[b * d.seqlen_q + i] != p.kv_segment_ids.ptr<int32_t>()[b * d.seqlen_k + j]) {
      continue;
    }
    const int64_t k_base = ((b * d.seqlen_k + j) * d.num_kv_heads + kv_head) * D;
    float partial = 0.0f;
    for (int t = 0; t < kDimsPerLane; ++t) {
      const int64_t dim = lane + t * kWarp;
      if (dim < D) partial += q[t] * Load(p.k.data, p.k.dtype, k_base + dim);
    }
    float logit = SoftCap(WarpSum(partial) * p.softmax_scale, p.logits_soft_cap);
    if (p.bias.present()) {
      const int64_t bb = p.bias.shape[0] == 1 ? 0 : b, bh = p.bias.shape[1] == 1 ? 0 : h;
      logit += Load(p.bias.data, p.bias.dtype, ((bb * p.bias.shape[1] + bh) * d.seqlen_q + i) * d.seqlen_k + j);
    }
    const float new_max = fmaxf(running_max, logit);
    const float correction = __expf(running_max - new_max);
    const float weight = __expf(logit - new_max);
    running_sum = running_sum * correction + weight;
    running_max = new_max;
    const float kept = p.dropout_prob > 0.0f
                           ? (DropoutKeep(row_key, static_cast<uint32_t>(j), args.dropout_threshold)
                                  ? weight * args.dropout_scale
                                  : 0.0f)
                           : weight;
    for (int t = 0; t < kDimsPerLane; ++t) {
      const int64_t dim = lane + t * kWarp;
      const float value = dim < D ? Load(p.v.data, p.v.dtype, k_base + dim) : 0.0f;
      acc[t] = acc[t] * correction + kept * value;
    }
  }

  const bool empty = running_sum == 0.0f;
  const float inv_sum = empty ? 0.0f : 1.0f / running_sum;
  for (int t = 0; t < kDimsPerLane; ++t) {
    const int64_t dim = lane + t * kWarp;
    if (dim < D) Store(p.out.data, p.out.dtype, q_base + dim, acc[t] * inv_sum);
  }
  if (lane == 0) {
    p.lse.ptr<float>()[(b * d.num_q_heads + h) * d.seqlen_q + i] =
        empty ? -INFINITY : running_max + logf(running_sum);
  }
}

ffi::Error ForwardImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer softmax_aux,
                       ffi::AnyBuffer cu_seqlens_q, ffi::AnyBuffer cu_seqlens_k,
                       ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                       ffi::AnyBuffer dropout_seed, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> lse, float softmax_scale, bool causal,
                       int64_t window_left, int64_t window_right, float logits_soft_cap,
                       float dropout_prob, int64_t operands, int64_t block_q, int64_t block_k,
                       int64_t num_threads) {
  KernelArgs args;
  EJK_FFI_ASSIGN_OR_RETURN(args.p, BuildForwardParams(q, k, v, bias, mask, softmax_aux, cu_seqlens_q,
                                                      cu_seqlens_k, q_segment_ids, kv_segment_ids,
                                                      softmax_scale, causal, window_left,
                                                      window_right, logits_soft_cap, dropout_prob,
                                                      operands));
  EJK_FFI_ASSIGN_OR_RETURN(args.p.out, ViewOf(*out, "out"));
  EJK_FFI_ASSIGN_OR_RETURN(args.p.lse, ViewOf(*lse, "lse"));
  EJK_FFI_ASSIGN_OR_RETURN(args.dims, ValidateForward(args.p));
  if (args.dims.head_dim > kMaxHeadDim) {
    return ToFfiError(Status::InvalidArgument("query: the reference CUDA kernel supports head_dim <= 256, got " +
                                              args.p.q.ToString()));
  }
  if (dropout_prob > 0.0f && dropout_seed.element_count() != 1) {
    return ToFfiError(Status::InvalidArgument("dropout_seed must be one 32-bit integer"));
  }
  args.dropout_seed = static_cast<const uint32_t*>(dropout_seed.untyped_data());
  args.dropout_threshold = DropoutThreshold(dropout_prob);
  args.dropout_scale = dropout_prob > 0.0f ? 1.0f / (1.0f - dropout_prob) : 1.0f;
  const int64_t rows = args.dims.batch * args.dims.num_q_heads * args.dims.seqlen_q;
  if (rows == 0) return ffi::Error::Success();
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  ReferenceForwardKernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * kWarp, 0, stream>>>(args);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return ToFfiError(Status::Internal(std::string("flash attention reference kernel launch failed: ") +
                                       cudaGetErrorString(err)));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ejk::flash_attention

EJK_EXPORT XLA_FFI_Error* EjkFlashAttentionForwardCudaReference(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    EjkFlashAttentionForwardCudaReference, ejk::flash_attention::ForwardImpl,
    EJK_FLASH_ATTENTION_FORWARD_BINDING(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

namespace ejk::flash_attention {
namespace {

KernelEntry CudaReferenceEntry() {
  KernelEntry e;
  e.op = "flash_attention";
  e.platform = Platform::kCuda;
  e.backend = Backend::kGpu;
  e.priority = -100;  // below XLA (0): chosen only when asked for
  e.name = "flash_attention_cuda_reference";
  e.op_version = kOpVersion;
  for (const std::string& feature : AllFeatures()) {
    if (feature != "backward" && feature != "bias_grad" && feature != "softmax_aux_grad" &&
        feature != "deterministic_backward") {
      e.features.push_back(feature);
    }
  }
  e.ffi_targets = {{"ejkernel_flash_attention_fwd_cuda", "EjkFlashAttentionForwardCudaReference"}};
  e.heuristic = [](const nlohmann::json&) { return Config{{"block_q", 1}, {"block_k", 1}, {"num_threads", 0}}; };
  return e;
}

}  // namespace
}  // namespace ejk::flash_attention

EJK_REGISTER_KERNEL(flash_attention_cuda_reference, ejk::flash_attention::CudaReferenceEntry());
