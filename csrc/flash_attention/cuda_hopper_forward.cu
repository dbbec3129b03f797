// Hopper (sm_90a) flash attention forward: which calls it takes, tensor maps, dispatch.
// The kernel is in cuda_hopper_forward.cuh, instantiated per head dim.
#include <cudaTypedefs.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "flash_attention/cuda_hopper_forward.cuh"

namespace ejk::flash_attention {
namespace hopper {

// Compiled in cuda_hopper_forward_hdim*.cu.
#if EJK_FA_HEAD_DIM_ENABLED(64)
extern template Status Launch<64>(const CudaForwardArgs&, const CudaConfig&, cudaStream_t);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(96)
extern template Status Launch<96>(const CudaForwardArgs&, const CudaConfig&, cudaStream_t);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(128)
extern template Status Launch<128>(const CudaForwardArgs&, const CudaConfig&, cudaStream_t);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(192)
extern template Status Launch<192>(const CudaForwardArgs&, const CudaConfig&, cudaStream_t);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(256)
extern template Status Launch<256>(const CudaForwardArgs&, const CudaConfig&, cudaStream_t);
#endif

namespace {

// The driver's tensor-map encoder, found through the runtime (no link-time libcuda).
PFN_cuTensorMapEncodeTiled_v12000 EncodeTiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult result;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &result) !=
            cudaSuccess ||
        result != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

}  // namespace

Status MakeTensorMap(const TensorView& t, int box_rows, const char* name, CUtensorMap* map) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = EncodeTiled();
  if (encode == nullptr) return Status::Internal("hopper flash attention: cuTensorMapEncodeTiled unavailable");
  const int64_t batch = t.shape[0], seqlen = t.shape[1], heads = t.shape[2], dim = t.shape[3];
  const cuuint64_t global_dim[4] = {static_cast<cuuint64_t>(dim), static_cast<cuuint64_t>(heads),
                                    static_cast<cuuint64_t>(seqlen), static_cast<cuuint64_t>(batch)};
  const cuuint64_t global_stride[3] = {static_cast<cuuint64_t>(t.strides[2] * 2),
                                       static_cast<cuuint64_t>(t.strides[1] * 2),
                                       static_cast<cuuint64_t>(t.strides[0] * 2)};
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_stride[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, t.dtype == DType::kF16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                            4, t.data, global_dim, global_stride, box, element_stride, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status::Internal(std::string("hopper flash attention: tensor map for ") + name + " " + t.ToString() +
                            " failed (CUresult " + std::to_string(static_cast<int>(r)) + ")");
  }
  return Status::Ok();
}

namespace {

// A bias (bf16/f16/f32) or mask (bytes) [Bb, Hb, Sq, Sk] as a 4-d TMA map (Sk, Sq, Hb, Bb)
// with boxes of 128 bytes x box_rows x 1 x 1 in the 128-byte swizzle.
Status MakeDenseTensorMap(const TensorView& t, int box_rows, const char* name, CUtensorMap* map) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = EncodeTiled();
  if (encode == nullptr) return Status::Internal("hopper flash attention: cuTensorMapEncodeTiled unavailable");
  const int64_t element = DTypeSize(t.dtype);
  const cuuint64_t global_dim[4] = {static_cast<cuuint64_t>(t.shape[3]), static_cast<cuuint64_t>(t.shape[2]),
                                    static_cast<cuuint64_t>(t.shape[1]), static_cast<cuuint64_t>(t.shape[0])};
  const cuuint64_t global_stride[3] = {static_cast<cuuint64_t>(t.strides[2] * element),
                                       static_cast<cuuint64_t>(t.strides[1] * element),
                                       static_cast<cuuint64_t>(t.strides[0] * element)};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(128 / element), static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_stride[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = t.dtype == DType::kF16    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                   : t.dtype == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                   : t.dtype == DType::kF32  ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                                             : CU_TENSOR_MAP_DATA_TYPE_UINT8;
  const CUresult r = encode(map, type, 4, t.data, global_dim, global_stride, box, element_stride,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status::Internal(std::string("hopper flash attention: tensor map for ") + name + " " + t.ToString() +
                            " failed (CUresult " + std::to_string(static_cast<int>(r)) + ")");
  }
  return Status::Ok();
}

}  // namespace

Status PrepareDenseOperand(const ForwardParams& p, int box_rows, DenseOperand* dense) {
  const TensorView& t = p.bias.present() ? p.bias : p.mask;
  dense->per_batch = dense->per_head = 0;
  // The score the kernels add a bias to: q.k, or with a soft cap tanh(scale q.k / cap).
  dense->bias_to_score = 1.0f / (p.logits_soft_cap > 0.0f ? p.logits_soft_cap : p.softmax_scale);
  if (!t.present()) return Status::Ok();
  dense->per_batch = t.dim(0) > 1;
  dense->per_head = t.dim(1) > 1;
  return MakeDenseTensorMap(t, box_rows, p.bias.present() ? "bias" : "mask", &dense->map);
}

bool DenseSharedAcrossBatch(const DenseOperand& dense, const Dims& d) {
  // A [1, 16] float32 bias at B = 4, d128 4096: 4.3 GB read from HBM per forward, 1.1 shared.
  return d.batch > 1 && dense.per_head && !dense.per_batch && !d.varlen;
}

void SetSection(int section, KernelParams* kp) {
  kp->section = section;
  kp->div_section = FastDivisor(section);
  kp->div_section_tiles = FastDivisor(section * kp->num_m_blocks);
}

Status PrepareKernelParams(const CudaForwardArgs& args, int block_m, int block_n, KernelParams* kp) {
  const ForwardParams& p = args.p;
  const Dims& d = args.dims;
  EJK_RETURN_IF_ERROR(MakeTensorMap(p.q, block_m, "query", &kp->tma_q));
  EJK_RETURN_IF_ERROR(MakeTensorMap(p.k, block_n, "key", &kp->tma_k));
  EJK_RETURN_IF_ERROR(MakeTensorMap(p.v, block_n, "value", &kp->tma_v));
  EJK_RETURN_IF_ERROR(MakeTensorMap(p.out, 64, "output", &kp->tma_out));
  EJK_RETURN_IF_ERROR(PrepareDenseOperand(p, block_m, &kp->dense));
  kp->out = p.out.data;
  kp->lse = p.lse.present() ? p.lse.ptr<float>() : nullptr;
  kp->sinks = p.softmax_aux.present() ? p.softmax_aux.data : nullptr;
  kp->sink_dtype = static_cast<int>(p.softmax_aux.dtype);
  kp->batch = static_cast<int>(d.batch);
  kp->seqlen_q = static_cast<int>(d.seqlen_q);
  kp->seqlen_k = static_cast<int>(d.seqlen_k);
  kp->num_q_heads = static_cast<int>(d.num_q_heads);
  kp->head_ratio = static_cast<int>(d.num_q_heads / d.num_kv_heads);
  kp->num_m_blocks = static_cast<int>((d.seqlen_q + block_m - 1) / block_m);
  kp->paired = 0;
  kp->cu_seqlens_q = nullptr;
  kp->cu_seqlens_k = nullptr;
  kp->num_sequences = 0;
  kp->q_segment_ids = p.q_segment_ids.present() ? p.q_segment_ids.ptr<int>() : nullptr;
  kp->kv_segment_ids = p.kv_segment_ids.present() ? p.kv_segment_ids.ptr<int>() : nullptr;
  kp->key_tile_bounds = nullptr;
  if (d.varlen) {
    kp->cu_seqlens_q = p.cu_seqlens_q.ptr<int>();
    kp->cu_seqlens_k = p.cu_seqlens_k.ptr<int>();
    kp->num_sequences = static_cast<int>(d.num_sequences);
    kp->num_m_blocks += kp->num_sequences + 1;  // each sequence (and the padding) may end in a partial block
  }
  kp->div_m_blocks = FastDivisor(kp->num_m_blocks);
  kp->div_q_heads = FastDivisor(kp->num_q_heads);
  kp->div_batch = FastDivisor(kp->batch);
  kp->batch_inner = DenseSharedAcrossBatch(kp->dense, d);
  kp->div_head_ratio = FastDivisor(kp->head_ratio);
  kp->div_m_block_pairs = FastDivisor((kp->num_m_blocks + 1) / 2);
  SetSection(1, kp);
  kp->head_dim = static_cast<int>(d.head_dim);
  kp->out_row_stride = d.num_q_heads * d.head_dim;
  kp->out_batch_stride = d.seqlen_q * d.num_q_heads * d.head_dim;
  constexpr float kLog2e = 1.4426950408889634f;
  if (p.logits_soft_cap > 0.0f) {
    kp->softcap_pre = p.softmax_scale / p.logits_soft_cap;
    kp->logit_scale = p.logits_soft_cap * kLog2e;
  } else {
    kp->softcap_pre = 0.0f;
    kp->logit_scale = p.softmax_scale * kLog2e;
  }
  WindowSides(ForwardCallOf(p, d), &kp->left, &kp->right);
  return PrepareDropoutOperand(p, args.dropout_seed, args.dropout_first_batch, &kp->dropout);
}

Status PrepareDropoutOperand(const ForwardParams& p, const uint32_t* seed, int64_t first_batch,
                             DropoutOperand* dropout) {
  const bool on = p.dropout_prob > 0.0f;
  if (on && seed == nullptr) return Status::InvalidArgument("hopper flash attention: dropout needs the seed");
  dropout->seed = on ? seed : nullptr;
  dropout->origin = on ? p.dropout_origin : nullptr;
  dropout->shifted_threshold = on ? DropoutThreshold(p.dropout_prob) << 16 : 0u;
  dropout->scale = on ? 1.0f / (1.0f - p.dropout_prob) : 1.0f;
  dropout->first_batch = static_cast<uint32_t>(first_batch);
  return Status::Ok();
}

namespace {

constexpr int kSegmentThreads = 256;
constexpr int kSegmentWarps = kSegmentThreads / 32;
// Scratch granularity: the segment kernels' tiles hold at least 64 rows and 64 keys.
constexpr int64_t kMinSegmentTile = 64;

unsigned SegmentBlocks(int64_t warps) { return static_cast<unsigned>((warps + kSegmentWarps - 1) / kSegmentWarps); }

// One warp per (batch row, tile of `block` ids); see LaunchTileSegments.
__global__ void __launch_bounds__(kSegmentThreads) TileSegmentsKernel(const int* ids, int2* ranges, int* padded,
                                                                      int32_t tiles, int32_t length, int32_t block,
                                                                      int32_t num_blocks) {
  const int32_t tile = blockIdx.x * kSegmentWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (tile >= tiles) return;  // whole warps
  const int32_t b = tile / num_blocks, first = tile % num_blocks * block;
  int lo = INT_MAX, hi = INT_MIN;
  for (int32_t i = first + lane; i < first + block; i += 32) {
    int id = 0;
    if (i < length) {
      id = ids[static_cast<int64_t>(b) * length + i];
      lo = min(lo, id);
      hi = max(hi, id);
    }
    if (padded != nullptr) padded[static_cast<int64_t>(b) * num_blocks * block + i] = id;
  }
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  if (lane == 0) ranges[tile] = make_int2(lo, hi);
}

// One warp per (batch row, query tile): the first and last key tile whose id range meets the
// query tile's (MeetingTiles).
__global__ void __launch_bounds__(kSegmentThreads) KeyTileBoundsKernel(const int2* q_ranges, const int2* k_ranges,
                                                                       int2* bounds, int32_t tiles,
                                                                       int32_t num_m_blocks, int32_t num_n_blocks) {
  const int32_t tile = blockIdx.x * kSegmentWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (tile >= tiles) return;  // whole warps
  const int2 meeting = MeetingTiles(k_ranges + static_cast<int64_t>(tile / num_m_blocks) * num_n_blocks,
                                    num_n_blocks, q_ranges[tile], lane);
  if (lane == 0) bounds[tile] = meeting;
}

// Upper bound of PrepareSegmentBounds' scratch: two arrays per query tile, one per key tile.
size_t SegmentScratchBytes(const Dims& d) {
  const auto tiles = [&](int64_t length) {
    return AlignScratch(static_cast<size_t>(d.batch * ((length + kMinSegmentTile - 1) / kMinSegmentTile)) * sizeof(int2));
  };
  return 2 * tiles(d.seqlen_q) + tiles(d.seqlen_k);
}

}  // namespace

Status LaunchTileSegments(const int* ids, int2* ranges, int* padded, int64_t batch, int64_t length, int block,
                          cudaStream_t stream) {
  const int32_t num_blocks = static_cast<int32_t>((length + block - 1) / block);
  const int32_t tiles = static_cast<int32_t>(batch * num_blocks);
  TileSegmentsKernel<<<SegmentBlocks(tiles), kSegmentThreads, 0, stream>>>(ids, ranges, padded, tiles,
                                                                            static_cast<int32_t>(length), block,
                                                                            num_blocks);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return Status::Internal(std::string("hopper flash attention: segment ranges launch failed: ") +
                            cudaGetErrorString(err));
  }
  return Status::Ok();
}

Status PrepareSegmentBounds(const CudaForwardArgs& args, int block_m, int block_n, KernelParams* kp,
                            cudaStream_t stream) {
  if (args.scratch == nullptr || kp->q_segment_ids == nullptr) return Status::Ok();
  const Dims& d = args.dims;
  const int32_t num_n_blocks = static_cast<int32_t>((d.seqlen_k + block_n - 1) / block_n);
  const int32_t q_tiles = static_cast<int32_t>(d.batch * kp->num_m_blocks);
  char* base = static_cast<char*>(args.scratch);
  int2* q_ranges = reinterpret_cast<int2*>(base);
  int2* bounds = reinterpret_cast<int2*>(base + AlignScratch(q_tiles * sizeof(int2)));
  int2* k_ranges = reinterpret_cast<int2*>(base + 2 * AlignScratch(q_tiles * sizeof(int2)));
  EJK_RETURN_IF_ERROR(LaunchTileSegments(kp->q_segment_ids, q_ranges, nullptr, d.batch, d.seqlen_q, block_m, stream));
  EJK_RETURN_IF_ERROR(LaunchTileSegments(kp->kv_segment_ids, k_ranges, nullptr, d.batch, d.seqlen_k, block_n, stream));
  KeyTileBoundsKernel<<<SegmentBlocks(q_tiles), kSegmentThreads, 0, stream>>>(q_ranges, k_ranges, bounds, q_tiles,
                                                                               kp->num_m_blocks, num_n_blocks);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return Status::Internal(std::string("hopper flash attention: segment bounds launch failed: ") +
                            cudaGetErrorString(err));
  }
  kp->key_tile_bounds = bounds;
  return Status::Ok();
}

namespace {

constexpr int kFoldThreads = 256;
// Chunks of 8 elements each thread folds, at most (fewer blocks to schedule).
constexpr int kFoldChunksPerThread = 4;

// A bias and a mask with rows of whole 16-byte units: one 16-byte chunk (8 elements) per step,
// out = mask ? bias : -inf, element-wise on the 16-bit patterns. Planes (Sq x Sk, a multiple of 8 elements) go by (blockIdx.z, blockIdx.y) =
// (batch, head); a stride of 0 broadcasts the operand over that dimension.
__global__ void __launch_bounds__(kFoldThreads) FoldBiasAndMaskKernel(
    const uint4* bias, const uint2* mask, uint4* out, int64_t plane_chunks, int64_t bias_batch_stride,
    int64_t bias_head_stride, int64_t mask_batch_stride, int64_t mask_head_stride, int32_t batch, int32_t heads,
    uint32_t neg_inf) {
  for (int32_t b = blockIdx.z; b < batch; b += gridDim.z) {
    for (int32_t h = blockIdx.y; h < heads; h += gridDim.y) {
      const uint4* bias_plane = bias + b * bias_batch_stride + h * bias_head_stride;
      const uint2* mask_plane = mask + b * mask_batch_stride + h * mask_head_stride;
      uint4* out_plane = out + (static_cast<int64_t>(b) * heads + h) * plane_chunks;
      for (int64_t c = static_cast<int64_t>(blockIdx.x) * kFoldThreads + threadIdx.x; c < plane_chunks;
           c += static_cast<int64_t>(gridDim.x) * kFoldThreads) {
        uint4 v = bias_plane[c];
        const uint2 m = mask_plane[c];
        uint32_t* words = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const uint32_t keep = ((e < 4 ? m.x : m.y) >> (8 * (e % 4))) & 0xffu;
          const int shift = 16 * (e % 2);
          if (keep == 0) words[e / 2] = (words[e / 2] & ~(0xffffu << shift)) | (neg_inf << shift);
        }
        out_plane[c] = v;
      }
    }
  }
}

// An element of a bias as the folded bias holds it: the same 16 bits (In = Out = uint16_t), or
// converted to float32.
template <class Out, class In>
__device__ __forceinline__ Out FoldedElement(In v) {
  if constexpr (std::is_same_v<In, Out>) {
    return v;
  } else {
    return static_cast<Out>(v);
  }
}

// Any row length or dtype (a bias or mask alone, rows not whole 16-byte units, a bias converted
// to float32): one element per thread and step, into rows of `row` elements (the padding past
// seqlen_k gets 0); rows of a plane go by blockIdx.x. A null bias is 0; a null mask keeps
// everything. Strides in elements.
template <class In, class Out>
__global__ void __launch_bounds__(kFoldThreads) FoldRowsKernel(
    const In* bias, const uint8_t* mask, Out* out, int32_t seqlen_q, int32_t seqlen_k, int32_t row,
    int64_t bias_batch_stride, int64_t bias_head_stride, int64_t mask_batch_stride, int64_t mask_head_stride,
    int32_t batch, int32_t heads, Out neg_inf) {
  for (int32_t b = blockIdx.z; b < batch; b += gridDim.z) {
    for (int32_t h = blockIdx.y; h < heads; h += gridDim.y) {
      const int64_t out_plane = (static_cast<int64_t>(b) * heads + h) * seqlen_q * row;
      for (int32_t i = blockIdx.x; i < seqlen_q; i += gridDim.x) {
        const int64_t bias_row = b * bias_batch_stride + h * bias_head_stride + static_cast<int64_t>(i) * seqlen_k;
        const int64_t mask_row = b * mask_batch_stride + h * mask_head_stride + static_cast<int64_t>(i) * seqlen_k;
        for (int32_t j = threadIdx.x; j < row; j += kFoldThreads) {
          Out v = 0;
          if (j < seqlen_k) {
            if (bias != nullptr) v = FoldedElement<Out>(bias[bias_row + j]);
            if (mask != nullptr && mask[mask_row + j] == 0) v = neg_inf;
          }
          out[out_plane + static_cast<int64_t>(i) * row + j] = v;
        }
      }
    }
  }
}

}  // namespace

Status FoldBiasAndMask(const ForwardParams& p, const ForwardCall& call, void* out, cudaStream_t stream,
                       TensorView* folded) {
  const TensorView& bias = p.bias;
  const TensorView& mask = p.mask;
  if (call.folded_batch == 0 || (bias.present() && (bias.dtype != p.q.dtype) != call.bias_f32) ||
      (p.q.dtype != DType::kBF16 && p.q.dtype != DType::kF16) || reinterpret_cast<uintptr_t>(out) % 16 != 0) {
    return Status::InvalidArgument("hopper flash attention: this bias or mask does not fold (PlanFold)");
  }
  const int64_t row = FoldedRowElements(call.seqlen_k);
  // Element strides of an operand's planes (0 along a broadcast dimension), in units of `unit`.
  const auto strides = [&](const TensorView& t, int64_t unit, int64_t* batch_stride, int64_t* head_stride) {
    const int64_t plane = call.seqlen_q * call.seqlen_k / unit;
    *head_stride = t.present() && t.dim(1) > 1 ? plane : 0;
    *batch_stride = t.present() && t.dim(0) > 1 ? t.dim(1) * plane : 0;
  };
  const dim3 planes(1, static_cast<unsigned>(std::min<int64_t>(call.folded_heads, 65535)),
                    static_cast<unsigned>(std::min<int64_t>(call.folded_batch, 65535)));
  const uint16_t neg_inf = p.q.dtype == DType::kF16 ? 0xfc00u : 0xff80u;  // -inf in f16 / bf16
  int64_t bias_b, bias_h, mask_b, mask_h;
  const auto fold_rows = [&](auto in, auto folded_out, auto folded_neg_inf) {
    strides(bias, 1, &bias_b, &bias_h);
    strides(mask, 1, &mask_b, &mask_h);
    dim3 grid = planes;
    grid.x = static_cast<unsigned>(std::clamp<int64_t>(call.seqlen_q, 1, INT32_MAX));
    FoldRowsKernel<<<grid, kFoldThreads, 0, stream>>>(
        bias.present() ? static_cast<decltype(in)>(bias.data) : nullptr,
        mask.present() ? static_cast<const uint8_t*>(mask.data) : nullptr, folded_out,
        static_cast<int32_t>(call.seqlen_q), static_cast<int32_t>(call.seqlen_k), static_cast<int32_t>(row), bias_b,
        bias_h, mask_b, mask_h, static_cast<int32_t>(call.folded_batch), static_cast<int32_t>(call.folded_heads),
        folded_neg_inf);
  };
  if (call.bias_f32) {
    float* folded_out = static_cast<float*>(out);
    switch (bias.dtype) {
      case DType::kF32: fold_rows(static_cast<const float*>(nullptr), folded_out, -INFINITY); break;
      case DType::kF64: fold_rows(static_cast<const double*>(nullptr), folded_out, -INFINITY); break;
      case DType::kBF16: fold_rows(static_cast<const __nv_bfloat16*>(nullptr), folded_out, -INFINITY); break;
      case DType::kF16: fold_rows(static_cast<const __half*>(nullptr), folded_out, -INFINITY); break;
      default:
        return Status::InvalidArgument(std::string("hopper flash attention: no fold for a bias of dtype ") +
                                       DTypeName(bias.dtype));
    }
  } else if (bias.present() && mask.present() && call.seqlen_k % 8 == 0) {
    // Whole 16-byte chunks.
    const int64_t unit = 8, plane_chunks = call.seqlen_q * call.seqlen_k / unit;
    strides(bias, unit, &bias_b, &bias_h);
    strides(mask, unit, &mask_b, &mask_h);
    dim3 grid = planes;
    grid.x = static_cast<unsigned>(std::clamp<int64_t>(
        (plane_chunks + kFoldThreads * kFoldChunksPerThread - 1) / (kFoldThreads * kFoldChunksPerThread), 1,
        INT32_MAX));
    FoldBiasAndMaskKernel<<<grid, kFoldThreads, 0, stream>>>(
        static_cast<const uint4*>(bias.data), static_cast<const uint2*>(mask.data), static_cast<uint4*>(out),
        plane_chunks, bias_b, bias_h, mask_b, mask_h, static_cast<int32_t>(call.folded_batch),
        static_cast<int32_t>(call.folded_heads), neg_inf);
  } else {
    fold_rows(static_cast<const uint16_t*>(nullptr), static_cast<uint16_t*>(out), neg_inf);
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return Status::Internal(std::string("hopper flash attention: bias and mask fold launch failed: ") +
                            cudaGetErrorString(err));
  }
  TensorView view = TensorView::Contiguous(out, call.bias_f32 ? DType::kF32 : p.q.dtype,
                                           {call.folded_batch, call.folded_heads, call.seqlen_q, row});
  view.shape[3] = call.seqlen_k;  // the padding is past the last key
  *folded = view;
  return Status::Ok();
}

TensorView BatchRow(const TensorView& t, int64_t b) {
  if (!t.present() || t.dim(0) == 1) return t;
  TensorView row = t;
  row.data = static_cast<char*>(t.data) + b * t.strides[0] * DTypeSize(t.dtype);
  row.shape[0] = 1;
  return row;
}

ForwardParams ForwardParamsOfRow(const ForwardParams& p, int64_t b) {
  ForwardParams row = p;
  for (TensorView* t : {&row.q, &row.k, &row.v, &row.bias, &row.mask, &row.q_segment_ids, &row.kv_segment_ids,
                        &row.out, &row.lse}) {
    *t = BatchRow(*t, b);
  }
  return row;
}

StatusOr<int> CurrentDeviceSms() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
    return Status::Internal("hopper flash attention: cannot read the multiprocessor count");
  }
  return sms;
}

}  // namespace hopper

namespace {
Status HopperUnsupported(const std::string& why) { return Status::Unimplemented("hopper flash attention: " + why); }
}  // namespace

Status HopperSupportsKind(DType dtype, const hopper::ForwardCall& call, const CudaDeviceInfo& device) {
  if (std::string why = HopperUnsupportedReason(device, EJK_CUDA_ARCHS); !why.empty()) return HopperUnsupported(why);
  if (dtype != DType::kBF16 && dtype != DType::kF16) {
    return HopperUnsupported(std::string("query dtype must be bf16 or f16, got ") + DTypeName(dtype));
  }
  if (call.head_dim == 0) return HopperUnsupported("no kernel is built for the call's head dim (KernelHeadDim)");
  if (std::string why = hopper::DenseUnsupportedReason(call); !why.empty()) return HopperUnsupported(why);
  if (std::string why = hopper::DropoutUnsupportedReason(call); !why.empty()) return HopperUnsupported(why);
  return Status::Ok();
}

Status HopperSupports(const ForwardParams& p, const Dims& dims, const CudaDeviceInfo& device) {
  EJK_RETURN_IF_ERROR(CheckFeaturesBuilt(p));
  EJK_RETURN_IF_ERROR(HopperSupportsKind(p.q.dtype, hopper::ForwardCallOf(p, dims), device));
  if (!(p.softmax_scale > 0.0f)) return HopperUnsupported("softmax_scale must be positive");
  if (dims.seqlen_k == 0) return HopperUnsupported("seqlen_k must be positive");
  if (dims.seqlen_q + dims.seqlen_k >= (int64_t{1} << 30)) return HopperUnsupported("sequence lengths too large");
  if (((dims.seqlen_q + 63) / 64 + dims.num_sequences + 1) * dims.num_q_heads * dims.batch >= (int64_t{1} << 31)) {
    return HopperUnsupported("too many query tiles (batch * num_q_heads * seqlen_q / 64 must be < 2^31)");
  }
  for (const TensorView* t : {&p.q, &p.k, &p.v, &p.out, &p.bias, &p.mask}) {
    if (reinterpret_cast<uintptr_t>(t->data) % 16 != 0) return HopperUnsupported("tensors must be 16-byte aligned");
  }
  return Status::Ok();
}

namespace {

// Bytes of the segment ranges at the start of ForwardHopper's scratch (the folded bias follows).
size_t SegmentPartBytes(const Dims& dims, bool segment_ids) {
  return segment_ids && KernelHeadDim(dims.head_dim) != 0 ? hopper::SegmentScratchBytes(dims) : 0;
}

Status LaunchHeadDim(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  switch (KernelHeadDim(args.dims.head_dim)) {
#if EJK_FA_HEAD_DIM_ENABLED(64)
    case 64: return hopper::Launch<64>(args, cfg, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(96)
    case 96: return hopper::Launch<96>(args, cfg, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(128)
    case 128: return hopper::Launch<128>(args, cfg, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(192)
    case 192: return hopper::Launch<192>(args, cfg, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(256)
    case 256: return hopper::Launch<256>(args, cfg, stream);
#endif
    default: return Status::Unimplemented("hopper flash attention: head_dim " + std::to_string(args.dims.head_dim));
  }
}

}  // namespace

size_t ForwardHopperScratchBytes(const Dims& dims, const hopper::ForwardCall& call) {
  return SegmentPartBytes(dims, call.segment_ids) + hopper::FoldedBiasBytes(call);
}

Status ForwardHopper(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  EJK_RETURN_IF_ERROR(HopperSupports(args.p, args.dims, CurrentCudaDevice()));
  if (args.dims.batch == 0 || args.dims.seqlen_q == 0 || args.dims.num_q_heads == 0) return Status::Ok();
  const hopper::ForwardCall call = hopper::ForwardCallOf(args.p, args.dims);
  if (call.folded_batch == 0) return LaunchHeadDim(args, cfg, stream);
  if (args.scratch == nullptr) {
    return Status::InvalidArgument("hopper flash attention: a call with a folded bias (hopper::PlanFold) needs the "
                                   "scratch (ForwardHopperScratchBytes)");
  }
  char* at = static_cast<char*>(args.scratch) + SegmentPartBytes(args.dims, args.p.q_segment_ids.present());
  // Crossed broadcasts: one batch row at a time, each row's fold reusing the same memory (the
  // stream orders a row's fold after the previous row's kernel).
  const int64_t rows = call.fold_per_row ? args.dims.batch : 1;
  for (int64_t b = 0; b < rows; ++b) {
    CudaForwardArgs folded = args;
    if (call.fold_per_row) {
      folded.p = hopper::ForwardParamsOfRow(args.p, b);
      folded.dims.batch = 1;
      folded.dropout_first_batch = b;
    }
    EJK_RETURN_IF_ERROR(hopper::FoldBiasAndMask(folded.p, call, at, stream, &folded.p.bias));
    folded.p.mask = TensorView{};
    EJK_RETURN_IF_ERROR(LaunchHeadDim(folded, cfg, stream));
  }
  return Status::Ok();
}

}  // namespace ejk::flash_attention
