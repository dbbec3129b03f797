// Hopper flash attention forward kernels for head dim 128 with dropout, segment ids and a bias
// or an attention mask.
#include "flash_attention/cuda_hopper_forward.cuh"

namespace ejk::flash_attention::hopper {
#if EJK_FA_HEAD_DIM_ENABLED(128) && EJK_FA_FEATURE_ENABLED(segment_ids)
template Status LaunchSegmentsDenseDropout<128>(const CudaForwardArgs& args, const CudaConfig& cfg,
                                                cudaStream_t stream);
#endif
}  // namespace ejk::flash_attention::hopper
