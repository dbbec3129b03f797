// Which head dims the CUDA flash attention kernels are built for: all of them, unless the
// build defines EJK_FA_HEAD_DIMS_RESTRICTED, which builds only the head dims d with
// EJK_FA_HEAD_DIM_<d> defined (CMake option EJKERNEL_CUDA_HEAD_DIMS) to cut compile time.
// EJK_FA_HEAD_DIM_ENABLED(d) is 0 or 1, usable in #if and in C++ expressions.
#pragma once

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
