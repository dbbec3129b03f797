#include "runtime/cuda_device.h"

#include <cuda_runtime.h>

#include <array>
#include <mutex>

namespace ejk {
namespace {

// Compiled for every architecture of the build like every kernel: its attributes can be
// read exactly when the library holds code (machine code or PTX) the device can run.
__global__ void CodeProbeKernel() {}

}  // namespace

const CudaDeviceInfo& CurrentCudaDevice() {
  constexpr int kMaxDevices = 64;
  static std::array<CudaDeviceInfo, kMaxDevices> infos;
  static std::array<std::once_flag, kMaxDevices> read;
  static const CudaDeviceInfo unknown;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return unknown;
  std::call_once(read[device], [device] {
    CudaDeviceInfo& info = infos[device];
    int value = 0;
    if (cudaDeviceGetAttribute(&value, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess) info.major = value;
    if (cudaDeviceGetAttribute(&value, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess) info.minor = value;
    if (cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device) == cudaSuccess && value > 0) {
      info.sm_count = value;
    }
    if (cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess && value > 0) {
      info.shared_memory_per_block = value;
    }
    cudaFuncAttributes attributes;
    info.has_code = cudaFuncGetAttributes(&attributes, CodeProbeKernel) == cudaSuccess;
    if (info.has_code) {
      info.code_arch = attributes.ptxVersion;
    } else {
      cudaGetLastError();  // clear the failed query, or the next launch's check would report it
    }
  });
  return infos[device];
}

}  // namespace ejk
