// Hopper flash attention forward kernels for head dim 256.
#include "flash_attention/cuda_hopper_forward.cuh"

namespace ejk::flash_attention::hopper {
#if EJK_FA_HEAD_DIM_ENABLED(256)
// Compiled in the other cuda_hopper_forward_*_hdim256.cu files.
extern template Status LaunchSegments<256>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchDropout<256>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchDenseDropout<256>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                               cudaStream_t stream);
extern template Status LaunchSegmentsDenseDropout<256>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                                      cudaStream_t stream);
extern template Status LaunchSegmentsDense<256>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                                cudaStream_t stream);
extern template Status LaunchDense<256>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
template Status Launch<256>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
#endif
}  // namespace ejk::flash_attention::hopper
