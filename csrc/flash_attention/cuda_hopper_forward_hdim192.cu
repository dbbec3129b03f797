// Hopper flash attention forward kernels for head dim 192.
#include "flash_attention/cuda_hopper_forward.cuh"

namespace ejk::flash_attention::hopper {
#if EJK_FA_HEAD_DIM_ENABLED(192)
// Compiled in the other cuda_hopper_forward_*_hdim192.cu files.
extern template Status LaunchSegments<192>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchDropout<192>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchDenseDropout<192>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                               cudaStream_t stream);
extern template Status LaunchSegmentsDenseDropout<192>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                                      cudaStream_t stream);
extern template Status LaunchSegmentsDense<192>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                                cudaStream_t stream);
extern template Status LaunchDense<192>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchBiasF32<192>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
template Status Launch<192>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
#endif
}  // namespace ejk::flash_attention::hopper
