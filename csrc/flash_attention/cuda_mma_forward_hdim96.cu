// Flash attention forward, mma.sync kernels for head dim 96 (tile configs: cuda_mma_forward.cuh).
#include "flash_attention/cuda_build_scope.h"

#if EJK_FA_HEAD_DIM_ENABLED(96)

#include "flash_attention/cuda_mma_forward.cuh"

namespace ejk::flash_attention {

Status ForwardMmaHeadDim96(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  using namespace mma;
  return DispatchDType<TileConfig<96, 128, 64, 4, 2>, TileConfig<96, 128, 64, 8, 2>,
                       TileConfig<96, 64, 64, 4, 2>>(args, cfg, stream);
}

}  // namespace ejk::flash_attention

#endif  // EJK_FA_HEAD_DIM_ENABLED(96)
