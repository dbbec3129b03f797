// The current CUDA device's properties that kernels dispatch on, read once per device
// (attribute queries are host calls; handlers run on every step), and what they allow.
#pragma once

#include <cstdint>
#include <string>

// 1 when the build compiled sm_90a machine code (EJKERNEL_CUDA_ARCHS lists 90a; CMake sets
// it). Without it the Hopper kernels (wgmma, TMA) are stubs that trap, so nothing may
// launch them, even on an sm_90 device running code compiled for another architecture.
#ifndef EJK_CUDA_SM90A
#define EJK_CUDA_SM90A 0
#endif

namespace ejk {

struct CudaDeviceInfo {
  int major = 0, minor = 0;                 // compute capability; 0.0 when it cannot be read
  int sm_count = 1;                         // multiprocessors, at least 1
  int shared_memory_per_block = 48 * 1024;  // opt-in maximum of one block
  bool has_code = false;                    // this library holds code the device can run
  // The virtual architecture that code was compiled for (80 for compute_80 PTX or SASS, 90
  // for sm_90a; 0 without code): what the device code may use, e.g. griddepcontrol from 90
  // on. A newer GPU running PTX compiled for compute_80 reports 80.
  int code_arch = 0;
};

// Thread-safe; a device whose attributes cannot be read reports the defaults above.
const CudaDeviceInfo& CurrentCudaDevice();

// Why the Hopper kernels (wgmma, TMA) cannot run on `device` ("" when they can): they need
// compute capability 9.0 and sm_90a code in this build (compiled for `built_archs`).
std::string HopperUnsupportedReason(const CudaDeviceInfo& device, const std::string& built_archs);

// Whether kernels may be launched with programmatic stream serialisation on `device`: the
// code it runs waits for the previous grid (griddepcontrol, compiled from sm_90 on).
bool ProgrammaticLaunchRuns(const CudaDeviceInfo& device);

// Why this library's CUDA kernels cannot serve `device` ("" when they can): a compute
// capability below 8.0 (they use bf16 mma.sync), or no code for it in this build, which was
// compiled for `built_archs` (EJKERNEL_CUDA_ARCHS, comma-separated).
std::string CudaDeviceUnsupportedReason(const CudaDeviceInfo& device, const std::string& built_archs);

// Why `kernel` cannot run on `device` ("" when it can): it needs `needed_bytes` of shared
// memory per block, more than the device gives one.
std::string SharedMemoryUnsupportedReason(const CudaDeviceInfo& device, int64_t needed_bytes,
                                          const std::string& kernel);

}  // namespace ejk
