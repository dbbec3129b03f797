// Flash attention forward, mma.sync kernels for head dim 192 (tiles: kMmaTilesD192, cuda_tiles.h).
#include "flash_attention/cuda_build_scope.h"

#if EJK_FA_HEAD_DIM_ENABLED(192)

#include "flash_attention/cuda_mma_forward.cuh"

namespace ejk::flash_attention {

Status ForwardMmaHeadDim192(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream) {
  using namespace mma;
  return DispatchTiles<192, kMmaTilesD192.size(), kMmaTilesD192>(args, cfg, stream);
}

}  // namespace ejk::flash_attention

#endif  // EJK_FA_HEAD_DIM_ENABLED(192)
