#include "runtime/config_select.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>

#include "runtime/log.h"

namespace ejk {
namespace {

thread_local std::vector<const std::map<std::string, Config>*> overlay_stack;
thread_local std::optional<AutotunePolicy> policy_override;

std::string ExceptionMessage(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace

const char* AutotunePolicyName(AutotunePolicy policy) {
  switch (policy) {
    case AutotunePolicy::kNever: return "never";
    case AutotunePolicy::kIfMissing: return "missing";
    case AutotunePolicy::kAlways: return "always";
  }
  return "unknown";
}

AutotunePolicy AutotunePolicyFromEnv() {
  const char* raw = std::getenv("EJKERNEL_AUTOTUNE");
  const std::string value = raw != nullptr ? raw : "";
  if (value.empty() || value == "0" || value == "never") return AutotunePolicy::kNever;
  if (value == "1" || value == "missing") return AutotunePolicy::kIfMissing;
  if (value == "always") return AutotunePolicy::kAlways;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) {
    Log(LogLevel::kWarning, "EJKERNEL_AUTOTUNE='" + value +
                                "' is not one of 0, never, 1, missing, always; autotuning is off");
  }
  return AutotunePolicy::kNever;
}

AutotunePolicy CurrentAutotunePolicy() {
  return policy_override.has_value() ? *policy_override : AutotunePolicyFromEnv();
}

// --- ScopedOverlay ----------------------------------------------------------

ScopedOverlay::ScopedOverlay(std::map<std::string, Config> configs) : configs_(std::move(configs)) {
  overlay_stack.push_back(&configs_);
}

ScopedOverlay::~ScopedOverlay() {
  // Normally the last one; searching keeps the stack right if scopes end out of order.
  auto it = std::find(overlay_stack.rbegin(), overlay_stack.rend(), &configs_);
  if (it != overlay_stack.rend()) overlay_stack.erase(std::next(it).base());
}

std::optional<Config> ScopedOverlay::Find(const CacheKey& key) {
  const std::string full_key = key.ToString();
  for (auto layer = overlay_stack.rbegin(); layer != overlay_stack.rend(); ++layer) {
    if (auto it = (*layer)->find(full_key); it != (*layer)->end()) return it->second;
    if (auto it = (*layer)->find(key.op); it != (*layer)->end()) return it->second;
  }
  return std::nullopt;
}

// --- ScopedAutotunePolicy ---------------------------------------------------

ScopedAutotunePolicy::ScopedAutotunePolicy(AutotunePolicy policy) : previous_(policy_override) {
  policy_override = policy;
}

ScopedAutotunePolicy::~ScopedAutotunePolicy() { policy_override = previous_; }

// --- ConfigSelector ---------------------------------------------------------

ConfigSelector::ConfigSelector(MemoryConfigCache* memory, PersistentConfigCache* persistent,
                               AutotuneOptions autotune_options)
    : memory_(memory), persistent_(persistent), autotune_options_(autotune_options) {}

StatusOr<Selection> ConfigSelector::Select(const SelectionRequest& request) {
  const CacheKey& key = request.key;
  if (request.explicit_config.has_value()) return Selection{*request.explicit_config, "explicit"};
  if (std::optional<Config> config = ScopedOverlay::Find(key)) return Selection{*config, "overlay"};

  const AutotunePolicy policy = CurrentAutotunePolicy();
  if (policy != AutotunePolicy::kAlways) {
    if (std::optional<Config> config = memory_->Lookup(key)) return Selection{*config, "memory"};
    if (persistent_ != nullptr) {
      if (std::optional<Config> config = persistent_->Lookup(key)) {
        memory_->Store(key, *config);
        return Selection{*config, "persistent"};
      }
    }
  }

  if (policy != AutotunePolicy::kNever && request.candidates && request.time_ms) {
    std::vector<Config> candidates;
    try {
      candidates = request.candidates();
    } catch (...) {
      Log(LogLevel::kWarning, "autotune of " + key.ToString() + ": listing candidates failed: " +
                                  ExceptionMessage(std::current_exception()));
    }
    if (!candidates.empty()) {
      StatusOr<AutotuneResult> tuned =
          AutotuneTimed(candidates, request.time_ms, autotune_options_);
      if (tuned.ok()) {
        memory_->Store(key, tuned->best);
        if (persistent_ != nullptr) {
          if (Status stored = persistent_->Store(key, tuned->best, tuned->timings_ms);
              !stored.ok()) {
            Log(LogLevel::kWarning, "could not persist the tuned config of " + key.ToString() +
                                        ": " + stored.ToString());
          }
        }
        return Selection{tuned->best, "autotune"};
      }
      Log(LogLevel::kWarning, "autotune of " + key.ToString() + " failed (" +
                                  tuned.status().ToString() + "); falling back to the heuristic");
    }
  }

  if (request.heuristic) {
    std::optional<Config> config;
    try {
      config = request.heuristic();
    } catch (...) {
      return Status::Internal("heuristic config of op '" + key.op +
                              "' failed: " + ExceptionMessage(std::current_exception()));
    }
    if (config.has_value()) {
      memory_->Store(key, *config);
      return Selection{*config, "heuristic"};
    }
  }
  return Status::NotFound("no config for op '" + key.op + "' (key " + key.ToString() +
                          "): none given, cached or tuned, and no heuristic applies");
}

}  // namespace ejk
