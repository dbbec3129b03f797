// Flash attention forward on mma.sync tensor cores: what the kernels take, and the dispatch
// to the per head dim instantiations (cuda_mma_forward_hdim<d>.cu).
#include <cstdint>
#include <string>

#include "flash_attention/cuda.h"
#include "flash_attention/cuda_build_scope.h"
#include "flash_attention/cuda_mma_forward.cuh"

namespace ejk::flash_attention {
namespace {

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

Status MmaSupports(const ForwardParams& p, const Dims& dims) {
  EJK_RETURN_IF_ERROR(CheckFeaturesBuilt(p));
  const std::string prefix = "flash attention mma.sync kernels: ";
  if (p.q.dtype != DType::kBF16 && p.q.dtype != DType::kF16) {
    return Status::Unimplemented(prefix + "inputs must be bfloat16 or float16 (tensor cores take 16-bit operands), got " +
                                 DTypeName(p.q.dtype) + " query " + p.q.ToString());
  }
  if (std::string why = HeadDimUnsupportedReason(dims.head_dim); !why.empty()) {
    return Status::Unimplemented(prefix + why + " (query " + p.q.ToString() + ")");
  }
  if (!Aligned16(p.q.data) || !Aligned16(p.k.data) || !Aligned16(p.v.data) || !Aligned16(p.out.data)) {
    return Status::Unimplemented(prefix + "query, key, value and out must be 16-byte aligned");
  }
  return Status::Ok();
}

Status ForwardMma(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  EJK_RETURN_IF_ERROR(MmaSupports(args.p, args.dims));
  if (args.p.dropout_prob > 0.0f && args.dropout_seed == nullptr) {
    return Status::InvalidArgument("dropout_seed: required when dropout_prob > 0");
  }
  const ForwardParams& p = args.p;
  const bool per_element =
      p.bias.present() || p.mask.present() || p.dropout_prob > 0.0f || p.q_segment_ids.present();
  const int64_t kernel_head_dim = KernelHeadDim(args.dims.head_dim);
  const CudaConfig tile = ChooseMmaForwardTile(kernel_head_dim, per_element, cfg);
  switch (kernel_head_dim) {
#if EJK_FA_HEAD_DIM_ENABLED(64)
    case 64: return ForwardMmaHeadDim64(args, tile, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(96)
    case 96: return ForwardMmaHeadDim96(args, tile, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(128)
    case 128: return ForwardMmaHeadDim128(args, tile, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(192)
    case 192: return ForwardMmaHeadDim192(args, tile, stream);
#endif
#if EJK_FA_HEAD_DIM_ENABLED(256)
    case 256: return ForwardMmaHeadDim256(args, tile, stream);
#endif
    default: break;
  }
  return Status::Unimplemented("flash attention mma.sync kernels: head_dim " + std::to_string(args.dims.head_dim) +
                               " is not built");
}

}  // namespace ejk::flash_attention
