// Hopper flash attention forward kernels for head dim 128.
#include "flash_attention/cuda_hopper_forward.cuh"

namespace ejk::flash_attention::hopper {
#if EJK_FA_HEAD_DIM_ENABLED(128)
// Compiled in the other cuda_hopper_forward_*_hdim128.cu files.
extern template Status LaunchSegments<128>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchDropout<128>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchDenseDropout<128>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                               cudaStream_t stream);
extern template Status LaunchSegmentsDenseDropout<128>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                                      cudaStream_t stream);
extern template Status LaunchSegmentsDense<128>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                                cudaStream_t stream);
extern template Status LaunchDense<128>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchBiasF32<128>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
template Status Launch<128>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
#endif
}  // namespace ejk::flash_attention::hopper
