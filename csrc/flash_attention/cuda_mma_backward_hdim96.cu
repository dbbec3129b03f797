// Flash attention backward kernels for head dim 96 (cuda_mma_backward.cuh); one file per head
// dim so that they compile in parallel.
#include "flash_attention/cuda_build_scope.h"

#if EJK_FA_HEAD_DIM_ENABLED(96)
#include "flash_attention/cuda_mma_backward.cuh"

namespace ejk::flash_attention::mma_backward {
template Status LaunchHeadDim<96>(const KernelArgs&, bool, bool, bool, cudaStream_t);
}  // namespace ejk::flash_attention::mma_backward
#endif
