// Flash attention forward, mma.sync kernels for head dim 256 (tiles: kMmaTilesD256, cuda_tiles.h).
#include "flash_attention/cuda_build_scope.h"

#if EJK_FA_HEAD_DIM_ENABLED(256)

#include "flash_attention/cuda_mma_forward.cuh"

namespace ejk::flash_attention {

Status ForwardMmaHeadDim256(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  using namespace mma;
  return DispatchTiles<256, kMmaTilesD256.size(), kMmaTilesD256>(args, cfg, stream);
}

}  // namespace ejk::flash_attention

#endif  // EJK_FA_HEAD_DIM_ENABLED(256)
