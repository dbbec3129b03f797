// Registry of native implementations, keyed by (op, platform, backend) and ranked by
// priority. Ops register at load time with EJK_REGISTER_KERNEL; Python reads the registry
// through the C API to find FFI targets, heuristics and autotuning candidates.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/status.h"

namespace ejk {

using Config = nlohmann::json;

enum class Platform { kCpu, kCuda };
enum class Backend { kCpu, kGpu };

const char* PlatformName(Platform platform);  // "cpu", "cuda"
const char* BackendName(Backend backend);     // "cpu", "gpu"
StatusOr<Platform> ParsePlatform(const std::string& name);

// Reads the named non-negative integers of a signature (for a workspace_bytes rule, say);
// the error names `what`, the first missing or bad field and the signature.
Status ReadSignatureCounts(const nlohmann::json& signature, const char* what,
                          std::initializer_list<std::pair<const char*, int64_t*>> fields);

// An XLA custom-call target name and the exported C symbol of its handler.
struct FfiTarget {
  std::string target;
  std::string symbol;
};

struct KernelEntry {
  std::string op;  // e.g. "flash_attention"
  Platform platform = Platform::kCpu;
  Backend backend = Backend::kCpu;
  int priority = 0;
  std::string name;  // implementation name, e.g. "flash_attention_cpu"
  int op_version = 1;
  std::vector<std::string> features;  // e.g. "causal", "dropout"
  std::vector<FfiTarget> ffi_targets;
  std::function<Config(const nlohmann::json& signature)> heuristic;                // may be empty
  std::function<std::vector<Config>(const nlohmann::json& signature)> candidates;  // may be empty
  // Why this implementation cannot serve a call with this signature (dtype, head_dim, ...),
  // or "" when it can; callers fall back to another platform and log the reason. May be empty.
  std::function<std::string(const nlohmann::json& signature)> unsupported;
  // Bytes of device workspace that a call with this signature needs in `pass` ("forward",
  // "backward"); its handler takes them as its last result. Empty: the handlers take none.
  std::function<StatusOr<int64_t>(const nlohmann::json& signature, const std::string& pass)> workspace_bytes;
};

// Thread-safe.
class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // The process-wide registry that EJK_REGISTER_KERNEL fills.
  static Registry& Global();

  // Fails on an empty op or name, or a duplicate (op, platform, backend, name).
  Status Register(KernelEntry entry);
  // The highest-priority entry (ties: smallest name); NotFound names the op and platform.
  StatusOr<KernelEntry> Lookup(const std::string& op, Platform platform, Backend backend) const;
  // Sorted by op, then priority (highest first), then name.
  std::vector<KernelEntry> List() const;

 private:
  mutable std::mutex mu_;
  std::vector<KernelEntry> entries_;
};

namespace internal {
// Registers in Registry::Global(); prints the error and aborts on failure, since a broken
// registration is a build defect that must not go unnoticed.
bool RegisterKernelOrDie(KernelEntry entry);
}  // namespace internal

}  // namespace ejk

// Registers a KernelEntry at load time. Use at namespace scope:
//   EJK_REGISTER_KERNEL(flash_attention_cpu, MakeCpuEntry());
#define EJK_REGISTER_KERNEL(unique_id, ...)                              \
  [[maybe_unused]] static const bool ejk_kernel_registered_##unique_id = \
      ::ejk::internal::RegisterKernelOrDie(__VA_ARGS__)
