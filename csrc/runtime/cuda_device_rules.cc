// The host-side rules over CudaDeviceInfo; plain C++, so CPU builds test them too.
#include "runtime/cuda_device.h"

#include <string>

namespace ejk {
namespace {

std::string Capability(const CudaDeviceInfo& device) {
  return std::to_string(device.major) + "." + std::to_string(device.minor);
}

std::string BuiltFor(const std::string& built_archs) {
  return "built for " + (built_archs.empty() ? std::string("no CUDA architecture") : built_archs);
}

}  // namespace

std::string HopperUnsupportedReason(const CudaDeviceInfo& device, const std::string& built_archs) {
  if (device.major != 9 || device.minor != 0) return "needs compute capability 9.0, got " + Capability(device);
  // The device runs the sm_90a code where the build has it (code_arch 90), else other code.
  if (!EJK_CUDA_SM90A || !device.has_code || device.code_arch < 90) {
    return "this build holds no sm_90a code (" + BuiltFor(built_archs) + ")";
  }
  return "";
}

bool ProgrammaticLaunchRuns(const CudaDeviceInfo& device) {
  return device.has_code && device.major >= 9 && device.code_arch >= 90;
}

std::string CudaDeviceUnsupportedReason(const CudaDeviceInfo& device, const std::string& built_archs) {
  if (device.major == 0) return "the CUDA device's compute capability cannot be read";
  if (device.major < 8) {
    return "the CUDA kernels need compute capability 8.0 or newer (bf16 tensor cores), this GPU has " +
           Capability(device);
  }
  if (!device.has_code) {
    return "this build holds no code for compute capability " + Capability(device) + " (" + BuiltFor(built_archs) +
           "; rebuild with EJKERNEL_CUDA_ARCHS including it)";
  }
  return "";
}

std::string SharedMemoryUnsupportedReason(const CudaDeviceInfo& device, int64_t needed_bytes,
                                          const std::string& kernel) {
  if (needed_bytes <= device.shared_memory_per_block) return "";
  return kernel + " needs " + std::to_string(needed_bytes) + " bytes of shared memory per block, this GPU (" +
         Capability(device) + ") gives " + std::to_string(device.shared_memory_per_block);
}

}  // namespace ejk
