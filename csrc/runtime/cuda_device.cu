#include "runtime/cuda_device.h"

#include <cuda_runtime.h>

#include <array>
#include <mutex>

namespace ejk {

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
  });
  return infos[device];
}

}  // namespace ejk
