// Flash attention on NVIDIA GPUs: the host-side entry points of the CUDA kernels.
// cuda_ffi.cu binds them to XLA; the kernels live in cuda_mma_*.cu (portable tensor-core
// kernels, sm_80+) and cuda_hopper_*.cu (wgmma/TMA kernels, sm_90a).
//
// Every entry point takes validated params (ValidateForward/ValidateBackward ran), device
// pointers only, enqueues on `stream` and never synchronises with the host. cu_seqlens live
// in device memory: kernels clamp them instead of trusting them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "flash_attention/params.h"
#include "runtime/cuda_device.h"
#include "runtime/status.h"

namespace ejk::flash_attention {

// Tile configuration of the CUDA kernels (the framework's config for platform "cuda").
// block_q/block_k: query rows and keys per tile; num_warps: warps per thread block
// (0: the kernel's default for the tile); num_stages: K/V shared-memory pipeline depth.
struct CudaConfig {
  int block_q = 128;
  int block_k = 64;
  int num_warps = 0;
  int num_stages = 2;
};

// Scratch sub-buffers start on 256-byte boundaries: bytes rounded up to the next one.
inline size_t AlignScratch(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The dropout seed is a device scalar (uint32), read only when dropout is on.
struct CudaForwardArgs {
  ForwardParams p;
  Dims dims;
  const uint32_t* dropout_seed = nullptr;
  // ForwardHopperScratchBytes of device memory, or null: with segment ids, the Hopper kernels
  // then skip the key tiles outside each query tile's segments (a C++ caller may pass null).
  void* scratch = nullptr;
};

struct CudaBackwardArgs {
  BackwardParams p;
  Dims dims;
  const uint32_t* dropout_seed = nullptr;
};

// Portable tensor-core kernels (mma.sync, ldmatrix, cp.async): bf16/f16, head dims
// 64/96/128/192/256, every feature. Unsupported combinations return kUnimplemented with a
// message saying why (the caller has already checked MmaSupports).
Status MmaSupports(const ForwardParams& p, const Dims& dims);
Status ForwardMma(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);

// Backward scratch: f32 dQ accumulator, per-row softmax statistics; sized from shapes only.
size_t BackwardMmaScratchBytes(const Dims& dims, bool deterministic);
// Shared memory per block of the backward's kernels at this head dim (0 for one it lacks).
// The forward has a tile config that fits every sm_80+ GPU (99 KB); the backward needs more
// from head dim 128 up.
int BackwardMmaSharedBytes(int64_t head_dim);
Status BackwardMma(const CudaBackwardArgs& args, const CudaConfig& cfg, void* scratch, cudaStream_t stream);

// Hopper kernels (wgmma, TMA, warp specialisation), sm_90a only; a subset of the features.
// HopperSupports says which calls they take on `device`; the rest run on the mma.sync kernels.
Status HopperSupports(const ForwardParams& p, const Dims& dims, const CudaDeviceInfo& device);
Status ForwardHopper(const CudaForwardArgs& args, cudaStream_t stream);
// Scratch that lets ForwardHopper skip tiles (segment ids only; 0 otherwise); shapes only.
size_t ForwardHopperScratchBytes(const Dims& dims, bool segment_ids);

// Hopper backward (wgmma), sm_90a only; a subset of the features (HopperBackwardSupports
// says which); the rest run on BackwardMma. Scratch sized from shapes only.
Status HopperBackwardSupports(const BackwardParams& p, const Dims& dims, const CudaDeviceInfo& device);
size_t BackwardHopperScratchBytes(const Dims& dims, bool segment_ids, bool deterministic);
Status BackwardHopper(const CudaBackwardArgs& args, void* scratch, cudaStream_t stream);

}  // namespace ejk::flash_attention
