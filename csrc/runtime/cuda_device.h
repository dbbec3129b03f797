// The current CUDA device's properties that kernels dispatch on, read once per device
// (attribute queries are host calls; handlers run on every step).
#pragma once

namespace ejk {

struct CudaDeviceInfo {
  int major = 0, minor = 0;  // compute capability; 0.0 when it cannot be read
  int sm_count = 1;          // multiprocessors, at least 1
};

// Thread-safe; a device whose attributes cannot be read reports the defaults above.
const CudaDeviceInfo& CurrentCudaDevice();

}  // namespace ejk
