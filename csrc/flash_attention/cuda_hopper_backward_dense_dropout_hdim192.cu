// Hopper flash attention backward kernels for head dim 192 with dropout and a bias or an
// attention mask.
#include "flash_attention/cuda_build_scope.h"

#if EJK_FA_HEAD_DIM_ENABLED(192)
#include "flash_attention/cuda_hopper_backward.cuh"

namespace ejk::flash_attention::hopper_backward {
template Status LaunchDenseDropout<192>(const KernelParams&, bool, bool, Elementwise, int, cudaStream_t);
}  // namespace ejk::flash_attention::hopper_backward
#endif
