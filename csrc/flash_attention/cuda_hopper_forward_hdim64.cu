// Hopper flash attention forward kernels for head dim 64.
#include "flash_attention/cuda_hopper_forward.cuh"

namespace ejk::flash_attention::hopper {
#if EJK_FA_HEAD_DIM_ENABLED(64)
// Compiled in the other cuda_hopper_forward_*_hdim64.cu files.
extern template Status LaunchSegments<64>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchDropout<64>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchDenseDropout<64>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                              cudaStream_t stream);
extern template Status LaunchSegmentsDenseDropout<64>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                                      cudaStream_t stream);
extern template Status LaunchSegmentsDense<64>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                               cudaStream_t stream);
extern template Status LaunchDense<64>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchBiasF32<64>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
template Status Launch<64>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
#endif
}  // namespace ejk::flash_attention::hopper
