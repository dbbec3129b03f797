// Hopper flash attention backward kernels for head dim 256 with dropout.
#include "flash_attention/cuda_build_scope.h"

#if EJK_FA_HEAD_DIM_ENABLED(256)
#include "flash_attention/cuda_hopper_backward.cuh"

namespace ejk::flash_attention::hopper_backward {
template Status LaunchDropout<256>(const KernelParams&, bool, bool, int, cudaStream_t);
}  // namespace ejk::flash_attention::hopper_backward
#endif
