// Hopper flash attention forward kernels for head dim 96.
#include "flash_attention/cuda_hopper_forward.cuh"

namespace ejk::flash_attention::hopper {
#if EJK_FA_HEAD_DIM_ENABLED(96)
// Compiled in the other cuda_hopper_forward_*_hdim96.cu files.
extern template Status LaunchSegments<96>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchDropout<96>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchDenseDropout<96>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                              cudaStream_t stream);
extern template Status LaunchSegmentsDenseDropout<96>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                                      cudaStream_t stream);
extern template Status LaunchSegmentsDense<96>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                               cudaStream_t stream);
extern template Status LaunchDense<96>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchBiasF32<96>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
template Status Launch<96>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
#endif
}  // namespace ejk::flash_attention::hopper
