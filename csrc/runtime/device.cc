#include "runtime/device.h"

#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <sstream>

#if EJK_HAS_CUDA
#include <cuda_runtime.h>
#endif

namespace ejk {
namespace {

// /proc/cpuinfo flags that decide which kernel code paths are usable (x86 and arm names).
constexpr const char* kKernelIsaFlags[] = {
    "avx",         "avx2",        "fma",         "f16c",     "avx512f",  "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    "asimd",       "asimdhp",     "fphp",        "bf16",     "i8mm",     "sve",      "sve2",
};

std::string Trim(const std::string& s) {
  const size_t begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  const size_t end = s.find_last_not_of(" \t");
  return s.substr(begin, end - begin + 1);
}

// Collapses runs of blanks so the key does not depend on the kernel's column padding.
std::string CollapseSpaces(const std::string& s) {
  std::string out;
  for (char c : s) {
    const bool blank = c == ' ' || c == '\t';
    if (blank && (out.empty() || out.back() == ' ')) continue;
    out += blank ? ' ' : c;
  }
  return Trim(out);
}

// The first value of each of the named /proc/cpuinfo fields.
std::map<std::string, std::string> ReadCpuinfo(std::initializer_list<const char*> names) {
  std::map<std::string, std::string> found;
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (found.size() < names.size() && std::getline(in, line)) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string name = Trim(line.substr(0, colon));
    for (const char* wanted : names) {
      if (name == wanted && !found.count(name)) found[name] = Trim(line.substr(colon + 1));
    }
  }
  return found;
}

std::vector<std::string> KernelIsaFlags(const std::string& flags_line) {
  std::istringstream words(flags_line);
  std::vector<std::string> present{std::istream_iterator<std::string>(words),
                                   std::istream_iterator<std::string>()};
  std::vector<std::string> relevant;
  for (const char* flag : kKernelIsaFlags) {
    if (std::find(present.begin(), present.end(), flag) != present.end()) relevant.push_back(flag);
  }
  return relevant;
}

std::string FieldValue(const nlohmann::json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_array()) {
    std::string joined;
    for (const auto& item : value) {
      if (!joined.empty()) joined += '+';
      joined += FieldValue(item);
    }
    return joined;
  }
  return value.dump();
}

DeviceFingerprint ComputeCpuFingerprint() {
  const auto info = ReadCpuinfo({"model name", "flags", "Features"});
  std::string model;
  if (auto it = info.find("model name"); it != info.end()) model = CollapseSpaces(it->second);
  if (model.empty()) {
    struct utsname names;
    model = uname(&names) == 0 ? names.machine : "unknown";
  }
  std::string flags;
  if (auto it = info.find("flags"); it != info.end()) flags = it->second;
  if (auto it = info.find("Features"); it != info.end()) flags = it->second;

  DeviceFingerprint fp;
  fp.platform = "cpu";
  fp.fields = {
      {"model", model},
      {"logical_cores", static_cast<int64_t>(sysconf(_SC_NPROCESSORS_ONLN))},
      {"isa", KernelIsaFlags(flags)},
      {"compiled_isa", CompiledCpuIsa()},
  };
  return fp;
}

}  // namespace

std::string DeviceFingerprint::Key() const {
  std::string key = platform;
  if (fields.is_object()) {
    for (const auto& [name, value] : fields.items()) key += "|" + name + "=" + FieldValue(value);
  }
  return key;
}

std::vector<std::string> CompiledCpuIsa() {
  std::vector<std::string> isa;
#if defined(__AVX__)
  isa.push_back("avx");
#endif
#if defined(__AVX2__)
  isa.push_back("avx2");
#endif
#if defined(__FMA__)
  isa.push_back("fma");
#endif
#if defined(__F16C__)
  isa.push_back("f16c");
#endif
#if defined(__AVX512F__)
  isa.push_back("avx512f");
#endif
#if defined(__AVX512BW__)
  isa.push_back("avx512bw");
#endif
#if defined(__AVX512VL__)
  isa.push_back("avx512vl");
#endif
#if defined(__AVX512VNNI__)
  isa.push_back("avx512_vnni");
#endif
#if defined(__AVX512BF16__)
  isa.push_back("avx512_bf16");
#endif
#if defined(__AVX512FP16__)
  isa.push_back("avx512_fp16");
#endif
#if defined(__AMX_TILE__)
  isa.push_back("amx_tile");
#endif
#if defined(__AMX_BF16__)
  isa.push_back("amx_bf16");
#endif
#if defined(__AMX_INT8__)
  isa.push_back("amx_int8");
#endif
#if defined(__ARM_NEON)
  isa.push_back("asimd");
#endif
#if defined(__ARM_FEATURE_FP16_VECTOR_ARITHMETIC)
  isa.push_back("asimdhp");
#endif
#if defined(__ARM_FEATURE_BF16)
  isa.push_back("bf16");
#endif
#if defined(__ARM_FEATURE_MATMUL_INT8)
  isa.push_back("i8mm");
#endif
#if defined(__ARM_FEATURE_SVE)
  isa.push_back("sve");
#endif
#if defined(__ARM_FEATURE_SVE2)
  isa.push_back("sve2");
#endif
  return isa;
}

DeviceFingerprint CpuFingerprint() {
  static const DeviceFingerprint fingerprint = ComputeCpuFingerprint();
  return fingerprint;
}

#if EJK_HAS_CUDA

namespace {

Status CudaError(const char* what, cudaError_t err) {
  return Status::Internal(std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                          cudaGetErrorString(err) + ")");
}

StatusOr<DeviceFingerprint> ComputeCudaFingerprint(int device) {
  int count = 0;
  if (cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    return CudaError("cudaGetDeviceCount", err);
  }
  if (device < 0 || device >= count) {
    return Status::InvalidArgument("CUDA device " + std::to_string(device) + " out of range (" +
                                   std::to_string(count) + " devices)");
  }
  cudaDeviceProp prop;
  if (cudaError_t err = cudaGetDeviceProperties(&prop, device); err != cudaSuccess) {
    return CudaError("cudaGetDeviceProperties", err);
  }
  int driver_version = 0;
  if (cudaError_t err = cudaDriverGetVersion(&driver_version); err != cudaSuccess) {
    return CudaError("cudaDriverGetVersion", err);
  }
  int runtime_version = 0;
  if (cudaError_t err = cudaRuntimeGetVersion(&runtime_version); err != cudaSuccess) {
    return CudaError("cudaRuntimeGetVersion", err);
  }
  DeviceFingerprint fp;
  fp.platform = "cuda";
  fp.fields = {
      {"name", std::string(prop.name)},
      {"compute_capability", "sm_" + std::to_string(prop.major) + std::to_string(prop.minor)},
      {"sm_count", prop.multiProcessorCount},
      {"total_memory_mib", static_cast<int64_t>(prop.totalGlobalMem >> 20)},
      {"driver_version", driver_version},
      {"runtime_version", runtime_version},
  };
  return fp;
}

}  // namespace

StatusOr<DeviceFingerprint> CudaFingerprint(int device) {
  static std::mutex mu;
  static std::map<int, DeviceFingerprint> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(device); it != cache.end()) return it->second;
  EJK_ASSIGN_OR_RETURN(DeviceFingerprint fp, ComputeCudaFingerprint(device));
  cache.emplace(device, fp);
  return fp;
}

#else

StatusOr<DeviceFingerprint> CudaFingerprint(int device) {
  return Status::Unimplemented("built without CUDA");
}

#endif

}  // namespace ejk
