// The C API that Python reaches through ctypes. Returned char* strings are malloc'd and
// freed with ejk_free. On failure a function returns NULL (or nonzero) and sets a
// thread-local message read by ejk_last_error(); every call clears it first. No exception
// crosses this boundary.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/config_cache.h"
#include "runtime/device.h"
#include "runtime/ffi_util.h"
#include "runtime/registry.h"

namespace ejk {
namespace {

thread_local std::string last_error;

void SetError(const std::string& message) { last_error = message; }

char* CopyToMalloc(const std::string& text) {
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (out == nullptr) {
    SetError("out of memory");
    return nullptr;
  }
  std::memcpy(out, text.c_str(), text.size() + 1);
  return out;
}

std::string Dump(const nlohmann::json& json) {
  return json.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Runs `body`, turning exceptions into ejk_last_error() and `failure`.
template <typename Result, typename Body>
Result Guarded(Result failure, Body&& body) {
  last_error.clear();
  try {
    return body();
  } catch (const std::exception& e) {
    SetError(std::string("ejkernel: ") + e.what());
  } catch (...) {
    SetError("ejkernel: unknown exception");
  }
  return failure;
}

char* ReturnJson(const nlohmann::json& json) { return CopyToMalloc(Dump(json)); }

char* ReturnError(const Status& status) {
  SetError(status.ToString());
  return nullptr;
}

StatusOr<nlohmann::json> ParseJson(const char* text, const char* what) {
  if (text == nullptr || *text == '\0')
    return Status::InvalidArgument(std::string(what) + " is empty");
  nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return Status::InvalidArgument(std::string(what) + " is not valid JSON");
  return json;
}

// Empty signatures are allowed: heuristics fall back to their defaults.
StatusOr<nlohmann::json> ParseSignature(const char* text) {
  if (text == nullptr || *text == '\0') return nlohmann::json::object();
  return ParseJson(text, "signature");
}

std::vector<std::string> SplitCommaList(const std::string& text) {
  std::vector<std::string> items;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    if (end > start) items.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return items;
}

std::string CompilerDescription() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("gcc ") + __VERSION__;
#else
  return "unknown";
#endif
}

PersistentConfigCache CacheAt(const char* cache_dir) {
  return PersistentConfigCache(cache_dir != nullptr ? cache_dir : "");
}

// The highest-priority entry of `op` on `platform` that `has` accepts.
template <typename Pred>
StatusOr<KernelEntry> BestEntryWith(const char* op, const char* platform, Pred has,
                                    const char* what) {
  if (op == nullptr || platform == nullptr)
    return Status::InvalidArgument("op and platform are required");
  EJK_ASSIGN_OR_RETURN(Platform p, ParsePlatform(platform));
  bool any = false;
  for (KernelEntry& e : Registry::Global().List()) {  // highest priority first
    if (e.op != op || e.platform != p) continue;
    if (has(e)) return std::move(e);
    any = true;
  }
  std::string message =
      std::string("no native implementation of op '") + op + "' on platform " + platform;
  return Status::NotFound(any ? message + " has " + what : message);
}

}  // namespace
}  // namespace ejk

using ejk::Guarded;

EJK_EXPORT const char* ejk_version(void) { return EJK_VERSION; }

EJK_EXPORT char* ejk_build_info_json(void) {
  return Guarded<char*>(nullptr, [] {
    return ejk::ReturnJson({
        {"version", EJK_VERSION},
        {"has_cuda", static_cast<bool>(EJK_HAS_CUDA)},
        {"cuda_archs", ejk::SplitCommaList(EJK_CUDA_ARCHS)},
        {"hopper_kernels", static_cast<bool>(EJK_CUDA_SM90A)},
        {"compiler", ejk::CompilerDescription()},
        {"cpu_isa", ejk::CompiledCpuIsa()},
    });
  });
}

EJK_EXPORT char* ejk_registry_list_json(void) {
  return Guarded<char*>(nullptr, [] {
    nlohmann::json list = nlohmann::json::array();
    for (const ejk::KernelEntry& e : ejk::Registry::Global().List()) {
      nlohmann::json targets = nlohmann::json::array();
      for (const ejk::FfiTarget& t : e.ffi_targets) {
        targets.push_back({{"target", t.target}, {"symbol", t.symbol}});
      }
      list.push_back({
          {"op", e.op},
          {"platform", ejk::PlatformName(e.platform)},
          {"backend", ejk::BackendName(e.backend)},
          {"priority", e.priority},
          {"name", e.name},
          {"op_version", e.op_version},
          {"features", e.features},
          {"ffi_targets", std::move(targets)},
      });
    }
    return ejk::ReturnJson(list);
  });
}

EJK_EXPORT char* ejk_device_fingerprint_json(const char* platform, int device) {
  return Guarded<char*>(nullptr, [&]() -> char* {
    if (platform == nullptr)
      return ejk::ReturnError(ejk::Status::InvalidArgument("platform is required"));
    ejk::StatusOr<ejk::Platform> p = ejk::ParsePlatform(platform);
    if (!p.ok()) return ejk::ReturnError(p.status());
    ejk::StatusOr<ejk::DeviceFingerprint> fp =
        *p == ejk::Platform::kCpu ? ejk::StatusOr<ejk::DeviceFingerprint>(ejk::CpuFingerprint())
                                  : ejk::CudaFingerprint(device);
    if (!fp.ok()) return ejk::ReturnError(fp.status());
    return ejk::ReturnJson(
        {{"platform", fp->platform}, {"key", fp->Key()}, {"fields", fp->fields}});
  });
}

EJK_EXPORT char* ejk_default_cache_dir(void) {
  return Guarded<char*>(nullptr, [] { return ejk::CopyToMalloc(ejk::DefaultCacheDir()); });
}

EJK_EXPORT char* ejk_cache_lookup(const char* cache_dir, const char* key_json) {
  return Guarded<char*>(nullptr, [&]() -> char* {
    ejk::StatusOr<nlohmann::json> key_doc = ejk::ParseJson(key_json, "cache key");
    if (!key_doc.ok()) return ejk::ReturnError(key_doc.status());
    ejk::StatusOr<ejk::CacheKey> key = ejk::CacheKey::FromJson(*key_doc);
    if (!key.ok()) return ejk::ReturnError(key.status());
    std::optional<ejk::Config> config = ejk::CacheAt(cache_dir).Lookup(*key);
    return config.has_value() ? ejk::ReturnJson(*config) : nullptr;
  });
}

EJK_EXPORT int ejk_cache_store(const char* cache_dir, const char* key_json, const char* config_json,
                               const char* timings_json) {
  return Guarded<int>(1, [&]() -> int {
    auto fail = [](const ejk::Status& status) {
      ejk::SetError(status.ToString());
      return 1;
    };
    ejk::StatusOr<nlohmann::json> key_doc = ejk::ParseJson(key_json, "cache key");
    if (!key_doc.ok()) return fail(key_doc.status());
    ejk::StatusOr<ejk::CacheKey> key = ejk::CacheKey::FromJson(*key_doc);
    if (!key.ok()) return fail(key.status());
    ejk::StatusOr<nlohmann::json> config = ejk::ParseJson(config_json, "config");
    if (!config.ok()) return fail(config.status());
    if (!config->is_object())
      return fail(ejk::Status::InvalidArgument("config must be a JSON object"));
    nlohmann::json timings = nlohmann::json::object();
    if (timings_json != nullptr && *timings_json != '\0') {
      ejk::StatusOr<nlohmann::json> parsed = ejk::ParseJson(timings_json, "timings");
      if (!parsed.ok()) return fail(parsed.status());
      timings = std::move(*parsed);
    }
    ejk::PersistentConfigCache cache = ejk::CacheAt(cache_dir);
    ejk::Status stored = cache.Store(*key, *config, timings);
    return stored.ok() ? 0 : fail(stored);
  });
}

EJK_EXPORT char* ejk_op_heuristic_config(const char* op, const char* platform,
                                         const char* signature_json) {
  return Guarded<char*>(nullptr, [&]() -> char* {
    ejk::StatusOr<nlohmann::json> signature = ejk::ParseSignature(signature_json);
    if (!signature.ok()) return ejk::ReturnError(signature.status());
    auto entry = ejk::BestEntryWith(
        op, platform, [](const ejk::KernelEntry& e) { return static_cast<bool>(e.heuristic); },
        "a heuristic");
    if (!entry.ok()) return ejk::ReturnError(entry.status());
    return ejk::ReturnJson(entry->heuristic(*signature));
  });
}

EJK_EXPORT char* ejk_op_config_candidates(const char* op, const char* platform,
                                          const char* signature_json) {
  return Guarded<char*>(nullptr, [&]() -> char* {
    ejk::StatusOr<nlohmann::json> signature = ejk::ParseSignature(signature_json);
    if (!signature.ok()) return ejk::ReturnError(signature.status());
    auto entry = ejk::BestEntryWith(
        op, platform, [](const ejk::KernelEntry& e) { return static_cast<bool>(e.candidates); },
        "config candidates");
    if (!entry.ok()) return ejk::ReturnError(entry.status());
    nlohmann::json list = nlohmann::json::array();
    for (ejk::Config& config : entry->candidates(*signature)) list.push_back(std::move(config));
    return ejk::ReturnJson(list);
  });
}

// Workspace bytes of the best implementation of (op, platform) for a call with this signature
// in `pass`; 0 when it takes none; -1 on failure.
EJK_EXPORT int64_t ejk_op_workspace_bytes(const char* op, const char* platform, const char* pass,
                                          const char* signature_json) {
  return Guarded<int64_t>(-1, [&]() -> int64_t {
    auto fail = [](const ejk::Status& status) {
      ejk::SetError(status.ToString());
      return int64_t{-1};
    };
    ejk::StatusOr<nlohmann::json> signature = ejk::ParseSignature(signature_json);
    if (!signature.ok()) return fail(signature.status());
    if (pass == nullptr) return fail(ejk::Status::InvalidArgument("pass is required"));
    auto entry = ejk::BestEntryWith(op, platform, [](const ejk::KernelEntry&) { return true; }, "an entry");
    if (!entry.ok()) return fail(entry.status());
    if (!entry->workspace_bytes) return 0;
    ejk::StatusOr<int64_t> bytes = entry->workspace_bytes(*signature, pass);
    return bytes.ok() ? *bytes : fail(bytes.status());
  });
}

// "" when the best implementation of (op, platform) serves the signature, else the reason.
EJK_EXPORT char* ejk_op_unsupported_reason(const char* op, const char* platform,
                                           const char* signature_json) {
  return Guarded<char*>(nullptr, [&]() -> char* {
    ejk::StatusOr<nlohmann::json> signature = ejk::ParseSignature(signature_json);
    if (!signature.ok()) return ejk::ReturnError(signature.status());
    auto entry = ejk::BestEntryWith(op, platform, [](const ejk::KernelEntry&) { return true; }, "an entry");
    if (!entry.ok()) return ejk::ReturnError(entry.status());
    return ejk::CopyToMalloc(entry->unsupported ? entry->unsupported(*signature) : std::string());
  });
}

EJK_EXPORT const char* ejk_last_error(void) { return ejk::last_error.c_str(); }

EJK_EXPORT void ejk_free(char* ptr) { std::free(ptr); }
