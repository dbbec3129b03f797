#include "runtime/registry.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <tuple>

namespace ejk {

const char* PlatformName(Platform platform) {
  switch (platform) {
    case Platform::kCpu: return "cpu";
    case Platform::kCuda: return "cuda";
  }
  return "unknown";
}

const char* BackendName(Backend backend) {
  switch (backend) {
    case Backend::kCpu: return "cpu";
    case Backend::kGpu: return "gpu";
  }
  return "unknown";
}

StatusOr<Platform> ParsePlatform(const std::string& name) {
  if (name == "cpu") return Platform::kCpu;
  if (name == "cuda") return Platform::kCuda;
  return Status::InvalidArgument("unknown platform '" + name + "' (expected cpu or cuda)");
}

Status ReadSignatureCounts(const nlohmann::json& signature, const char* what,
                          std::initializer_list<std::pair<const char*, int64_t*>> fields) {
  for (const auto& [name, value] : fields) {
    const auto it = signature.find(name);
    if (it == signature.end() || !it->is_number_integer() || it->get<int64_t>() < 0) {
      return Status::InvalidArgument(std::string(what) + ": signature needs a non-negative integer '" + name +
                                     "', got " + signature.dump());
    }
    *value = it->get<int64_t>();
  }
  return Status::Ok();
}

Registry& Registry::Global() {
  // Never destroyed: registrations and lookups may happen during static init and teardown.
  static Registry* const registry = new Registry();
  return *registry;
}

Status Registry::Register(KernelEntry entry) {
  if (entry.op.empty()) return Status::InvalidArgument("kernel entry has an empty op name");
  if (entry.name.empty()) {
    return Status::InvalidArgument("kernel entry for op '" + entry.op + "' has an empty name");
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const KernelEntry& e : entries_) {
    if (e.op == entry.op && e.platform == entry.platform && e.backend == entry.backend &&
        e.name == entry.name) {
      return Status::InvalidArgument("kernel '" + entry.name + "' for op '" + entry.op + "' on " +
                                     PlatformName(entry.platform) + "/" +
                                     BackendName(entry.backend) + " is already registered");
    }
  }
  entries_.push_back(std::move(entry));
  return Status::Ok();
}

StatusOr<KernelEntry> Registry::Lookup(const std::string& op, Platform platform,
                                       Backend backend) const {
  std::lock_guard<std::mutex> lock(mu_);
  const KernelEntry* best = nullptr;
  for (const KernelEntry& e : entries_) {
    if (e.op != op || e.platform != platform || e.backend != backend) continue;
    if (best == nullptr || e.priority > best->priority ||
        (e.priority == best->priority && e.name < best->name)) {
      best = &e;
    }
  }
  if (best == nullptr) {
    return Status::NotFound("no native implementation of op '" + op + "' on platform " +
                            PlatformName(platform) + " (backend " + BackendName(backend) + ")");
  }
  return *best;
}

std::vector<KernelEntry> Registry::List() const {
  std::vector<KernelEntry> entries;
  {
    std::lock_guard<std::mutex> lock(mu_);
    entries = entries_;
  }
  std::sort(entries.begin(), entries.end(), [](const KernelEntry& a, const KernelEntry& b) {
    if (a.op != b.op) return a.op < b.op;
    if (a.priority != b.priority) return a.priority > b.priority;
    if (a.name != b.name) return a.name < b.name;
    return std::make_tuple(a.platform, a.backend) < std::make_tuple(b.platform, b.backend);
  });
  return entries;
}

namespace internal {

bool RegisterKernelOrDie(KernelEntry entry) {
  Status status = Registry::Global().Register(std::move(entry));
  if (!status.ok()) {
    std::fprintf(stderr, "ejkernel: kernel registration failed: %s\n", status.ToString().c_str());
    std::abort();
  }
  return true;
}

}  // namespace internal
}  // namespace ejk
