// Which head dims and features the CUDA flash attention kernels are built for: all of them,
// unless a development build restricts them to cut compile time.
// - Head dims: EJK_FA_HEAD_DIMS_RESTRICTED builds only the head dims d with EJK_FA_HEAD_DIM_<d>
//   defined (CMake option EJKERNEL_CUDA_HEAD_DIMS). EJK_FA_HEAD_DIM_ENABLED(d) is 0 or 1, usable
//   in #if and in C++ expressions.
// - Features: EJK_FA_FEATURES_RESTRICTED builds only those with EJK_FA_FEATURE_<name> defined
//   (CMake option EJKERNEL_CUDA_FEATURES): float16 inputs, logits_soft_cap and segment_ids,
//   the axes along which the kernels are instantiated (the mma.sync kernels' per-element
//   variant, which also serves bias, masks and dropout, is always built). The dispatchers skip
//   a left-out feature's kernels with `if constexpr` on the k*Built flags below, and every
//   CUDA entry point rejects a call that needs one (CheckFeaturesBuilt).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "flash_attention/params.h"
#include "runtime/status.h"

#define EJK_FA_HEAD_DIM_ENABLED(d) EJK_FA_HEAD_DIM_ENABLED_##d

#if !defined(EJK_FA_HEAD_DIMS_RESTRICTED) || defined(EJK_FA_HEAD_DIM_64)
#define EJK_FA_HEAD_DIM_ENABLED_64 1
#else
#define EJK_FA_HEAD_DIM_ENABLED_64 0
#endif
#if !defined(EJK_FA_HEAD_DIMS_RESTRICTED) || defined(EJK_FA_HEAD_DIM_96)
#define EJK_FA_HEAD_DIM_ENABLED_96 1
#else
#define EJK_FA_HEAD_DIM_ENABLED_96 0
#endif
#if !defined(EJK_FA_HEAD_DIMS_RESTRICTED) || defined(EJK_FA_HEAD_DIM_128)
#define EJK_FA_HEAD_DIM_ENABLED_128 1
#else
#define EJK_FA_HEAD_DIM_ENABLED_128 0
#endif
#if !defined(EJK_FA_HEAD_DIMS_RESTRICTED) || defined(EJK_FA_HEAD_DIM_192)
#define EJK_FA_HEAD_DIM_ENABLED_192 1
#else
#define EJK_FA_HEAD_DIM_ENABLED_192 0
#endif
#if !defined(EJK_FA_HEAD_DIMS_RESTRICTED) || defined(EJK_FA_HEAD_DIM_256)
#define EJK_FA_HEAD_DIM_ENABLED_256 1
#else
#define EJK_FA_HEAD_DIM_ENABLED_256 0
#endif

#define EJK_FA_FEATURE_ENABLED(name) EJK_FA_FEATURE_ENABLED_##name

#if !defined(EJK_FA_FEATURES_RESTRICTED) || defined(EJK_FA_FEATURE_float16)
#define EJK_FA_FEATURE_ENABLED_float16 1
#else
#define EJK_FA_FEATURE_ENABLED_float16 0
#endif
#if !defined(EJK_FA_FEATURES_RESTRICTED) || defined(EJK_FA_FEATURE_logits_soft_cap)
#define EJK_FA_FEATURE_ENABLED_logits_soft_cap 1
#else
#define EJK_FA_FEATURE_ENABLED_logits_soft_cap 0
#endif
#if !defined(EJK_FA_FEATURES_RESTRICTED) || defined(EJK_FA_FEATURE_segment_ids)
#define EJK_FA_FEATURE_ENABLED_segment_ids 1
#else
#define EJK_FA_FEATURE_ENABLED_segment_ids 0
#endif

namespace ejk::flash_attention {

// Whether this build has kernels for head dim d (one of 64, 96, 128, 192, 256).
constexpr bool HeadDimBuilt(int64_t d) {
  return (d == 64 && EJK_FA_HEAD_DIM_ENABLED(64)) || (d == 96 && EJK_FA_HEAD_DIM_ENABLED(96)) ||
         (d == 128 && EJK_FA_HEAD_DIM_ENABLED(128)) || (d == 192 && EJK_FA_HEAD_DIM_ENABLED(192)) ||
         (d == 256 && EJK_FA_HEAD_DIM_ENABLED(256));
}

// The head dim of the kernels that run a call at head dim d: the smallest built one of at
// least d. d must be a multiple of 8 (rows of whole 16-byte units, as TMA and the 16-byte
// copies read them); the kernels read columns past d as zeros, which add nothing to q.k and
// give output columns of zeros, and store none of them. 0 where no built kernel takes d.
inline constexpr std::array<int64_t, 5> kKernelHeadDims = {64, 96, 128, 192, 256};
constexpr int64_t KernelHeadDim(int64_t d) {
  if (d <= 0 || d % 8 != 0) return 0;
  for (const int64_t built : kKernelHeadDims) {
    if (built >= d && HeadDimBuilt(built)) return built;
  }
  return 0;
}

// Why no built kernel takes head dim d, "" when one does (KernelHeadDim).
inline std::string HeadDimUnsupportedReason(int64_t d) {
  if (KernelHeadDim(d) != 0) return "";
  std::string built;
  for (const int64_t k : kKernelHeadDims) {
    if (HeadDimBuilt(k)) built += (built.empty() ? "" : ", ") + std::to_string(k);
  }
  return "head_dim " + std::to_string(d) + " is not built (the CUDA kernels take multiples of 8 up to the largest " +
         "built head dim; built: " + built + ")";
}

inline constexpr bool kFloat16Built = EJK_FA_FEATURE_ENABLED(float16) != 0;
inline constexpr bool kSoftCapBuilt = EJK_FA_FEATURE_ENABLED(logits_soft_cap) != 0;
inline constexpr bool kSegmentIdsBuilt = EJK_FA_FEATURE_ENABLED(segment_ids) != 0;

// The registry's feature names that this build leaves out.
inline std::vector<std::string> FeaturesNotBuilt() {
  std::vector<std::string> out;
  if (!kSoftCapBuilt) out.push_back("logits_soft_cap");
  if (!kSegmentIdsBuilt) out.push_back("segment_ids");
  return out;
}

inline Status FeatureNotBuilt(const std::string& feature) {
  return Status::Unimplemented("flash attention CUDA: " + feature +
                               " is not built (CMake option EJKERNEL_CUDA_FEATURES)");
}

// Ok, or the error for the first feature of the call that the build left out.
inline Status CheckFeaturesBuilt(const ForwardParams& p) {
  if (!kFloat16Built && p.q.dtype == DType::kF16) return FeatureNotBuilt("float16");
  if (!kSoftCapBuilt && p.logits_soft_cap > 0.0f) return FeatureNotBuilt("logits_soft_cap");
  if (!kSegmentIdsBuilt && p.q_segment_ids.present()) return FeatureNotBuilt("segment_ids");
  return Status::Ok();
}

}  // namespace ejk::flash_attention
