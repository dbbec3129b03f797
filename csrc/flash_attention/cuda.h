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

#include "flash_attention/cuda_tiles.h"
#include "flash_attention/params.h"
#include "runtime/cuda_device.h"
#include "runtime/status.h"

namespace ejk::flash_attention {

// Scratch sub-buffers start on 256-byte boundaries: bytes rounded up to the next one.
inline size_t AlignScratch(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The dropout seed is a device scalar (uint32), read only when dropout is on.
// dropout_first_batch: the batch index the dropout hash gives the call's first row, so that a
// call run one batch row at a time drops what the whole call would.
struct CudaForwardArgs {
  ForwardParams p;
  Dims dims;
  const uint32_t* dropout_seed = nullptr;
  int64_t dropout_first_batch = 0;
  // ForwardHopperScratchBytes of device memory, or null: with segment ids, the Hopper kernels
  // then skip the key tiles outside each query tile's segments (a C++ caller may pass null);
  // a call with a folded bias (hopper::PlanFold) needs it.
  void* scratch = nullptr;
};

struct CudaBackwardArgs {
  BackwardParams p;
  Dims dims;
  const uint32_t* dropout_seed = nullptr;
  int64_t dropout_first_batch = 0;
};

// Portable tensor-core kernels (mma.sync, ldmatrix, cp.async): bf16/f16, head dims
// 64/96/128/192/256, every feature. Unsupported combinations return kUnimplemented with a
// message saying why (the caller has already checked MmaSupports). `cfg` picks one of
// MmaForwardTiles (any other config runs the default).
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
// HopperSupportsKind is the part of it that depends only on the dtype, the shapes and the
// features (the registry asks it of a call's signature).
Status HopperSupportsKind(DType dtype, const hopper::ForwardCall& call, const CudaDeviceInfo& device);
Status HopperSupports(const ForwardParams& p, const Dims& dims, const CudaDeviceInfo& device);
// `cfg` picks one of hopper::ForwardTiles for the call (any other config runs the default).
Status ForwardHopper(const CudaForwardArgs& args, const CudaConfig& cfg, cudaStream_t stream);
// ForwardHopper's scratch, from shapes and features only: segment ranges that let it skip
// tiles, then a folded bias (hopper::PlanFold).
size_t ForwardHopperScratchBytes(const Dims& dims, const hopper::ForwardCall& call);

// Hopper backward (wgmma), sm_90a only; a subset of the features (HopperBackwardSupports
// says which); the rest run on BackwardMma. Scratch sized from shapes and features only (the
// folded bias last, as in the forward).
Status HopperBackwardSupports(const BackwardParams& p, const Dims& dims, const CudaDeviceInfo& device);
size_t BackwardHopperScratchBytes(const Dims& dims, const hopper::ForwardCall& call, bool deterministic);
Status BackwardHopper(const CudaBackwardArgs& args, void* scratch, cudaStream_t stream);

}  // namespace ejk::flash_attention
