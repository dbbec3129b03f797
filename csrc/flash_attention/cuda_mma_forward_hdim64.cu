// Flash attention forward, mma.sync kernels for head dim 64 (tiles: kMmaTilesD64, cuda_tiles.h).
#include "flash_attention/cuda_build_scope.h"

#if EJK_FA_HEAD_DIM_ENABLED(64)

#include "flash_attention/cuda_mma_forward.cuh"

namespace ejk::flash_attention {

Status ForwardMmaHeadDim64(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  using namespace mma;
  return DispatchTiles<64, kMmaTilesD64.size(), kMmaTilesD64>(args, cfg, stream);
}

}  // namespace ejk::flash_attention

#endif  // EJK_FA_HEAD_DIM_ENABLED(64)
