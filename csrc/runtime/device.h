// Device fingerprints: what a tuned config depends on, as part of config cache keys.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/status.h"

namespace ejk {

struct DeviceFingerprint {
  std::string platform;   // "cpu" or "cuda"
  nlohmann::json fields;  // an object of strings, numbers and lists of strings
  // "<platform>|<field>=<value>|..." with fields in name order and lists joined by '+'.
  std::string Key() const;
};

// The ISA extensions this library was compiled for (e.g. "avx2", "avx512f").
std::vector<std::string> CompiledCpuIsa();

// Model, logical core count, the kernel-relevant ISA flags of the running CPU, and the
// compiled ISA. Computed once per process.
DeviceFingerprint CpuFingerprint();

// Name, compute capability ("sm_90"), SM count, memory, driver and runtime versions.
// Cached per device. Unimplemented when built without CUDA.
StatusOr<DeviceFingerprint> CudaFingerprint(int device);

}  // namespace ejk
