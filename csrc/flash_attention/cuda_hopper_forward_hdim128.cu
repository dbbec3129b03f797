// Hopper flash attention forward kernels for head dim 128.
#include "flash_attention/cuda_hopper_forward.cuh"

namespace ejk::flash_attention::hopper {
#if EJK_FA_HEAD_DIM_ENABLED(128)
// Compiled in cuda_hopper_forward_segments_hdim128.cu, cuda_hopper_forward_dense_hdim128.cu,
// cuda_hopper_forward_segments_dense_hdim128.cu and cuda_hopper_forward_bias_f32_hdim128.cu.
extern template Status LaunchSegments<128>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchSegmentsDense<128>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                                cudaStream_t stream);
extern template Status LaunchDense<128>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
extern template Status LaunchBiasF32<128>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
template Status Launch<128>(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
#endif
}  // namespace ejk::flash_attention::hopper
