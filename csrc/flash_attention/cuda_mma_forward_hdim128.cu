// Flash attention forward, mma.sync kernels for head dim 128 (tiles: kMmaTilesD128, cuda_tiles.h).
#include "flash_attention/cuda_build_scope.h"

#if EJK_FA_HEAD_DIM_ENABLED(128)

#include "flash_attention/cuda_mma_forward.cuh"

namespace ejk::flash_attention {

Status ForwardMmaHeadDim128(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  using namespace mma;
  return DispatchTiles<128, kMmaTilesD128.size(), kMmaTilesD128>(args, cfg, stream);
}

}  // namespace ejk::flash_attention

#endif  // EJK_FA_HEAD_DIM_ENABLED(128)
