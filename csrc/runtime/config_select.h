// Config selection. The first tier that yields a config wins:
//   explicit config, scoped overlay, in-memory cache, persistent cache,
//   autotuning (when the policy allows), heuristic; otherwise NotFound.
// Under AutotunePolicy::kAlways the two caches are skipped (explicit and overlay still win).
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "runtime/autotune.h"
#include "runtime/config_cache.h"
#include "runtime/status.h"

namespace ejk {

enum class AutotunePolicy { kNever, kIfMissing, kAlways };

const char* AutotunePolicyName(AutotunePolicy policy);  // "never", "missing", "always"
// EJKERNEL_AUTOTUNE: "0"/"never" -> kNever, "1"/"missing" -> kIfMissing, "always" -> kAlways;
// unset or empty -> kNever; anything else -> kNever with a warning. Read on every call.
AutotunePolicy AutotunePolicyFromEnv();
// The innermost ScopedAutotunePolicy of this thread, else AutotunePolicyFromEnv().
AutotunePolicy CurrentAutotunePolicy();

// Configs that override the caches for this thread while in scope. Keys are either a full
// CacheKey::ToString() or an op name (applying to every key of that op). Overlays nest: the
// innermost that matches wins, and within one overlay a full key beats an op name.
class ScopedOverlay {
 public:
  explicit ScopedOverlay(std::map<std::string, Config> configs);
  ~ScopedOverlay();
  ScopedOverlay(const ScopedOverlay&) = delete;
  ScopedOverlay& operator=(const ScopedOverlay&) = delete;

  static std::optional<Config> Find(const CacheKey& key);

 private:
  std::map<std::string, Config> configs_;
};

// Overrides the autotune policy for this thread while in scope.
class ScopedAutotunePolicy {
 public:
  explicit ScopedAutotunePolicy(AutotunePolicy policy);
  ~ScopedAutotunePolicy();
  ScopedAutotunePolicy(const ScopedAutotunePolicy&) = delete;
  ScopedAutotunePolicy& operator=(const ScopedAutotunePolicy&) = delete;

 private:
  std::optional<AutotunePolicy> previous_;
};

struct SelectionRequest {
  CacheKey key;
  std::optional<Config> explicit_config;
  std::function<std::vector<Config>()> candidates;         // may be empty
  std::function<StatusOr<double>(const Config&)> time_ms;  // one timed run; may be empty
  std::function<std::optional<Config>()> heuristic;        // may be empty
};

struct Selection {
  Config config;
  std::string source;  // "explicit", "overlay", "memory", "persistent", "autotune", "heuristic"
};

// Autotune winners go to both caches with their timings, persistent hits are copied to
// memory, heuristic results go to memory only. A failing autotune or persistent store is
// logged and selection goes on. Thread-safe when the caches are.
class ConfigSelector {
 public:
  // `memory` is required; `persistent` may be null.
  ConfigSelector(MemoryConfigCache* memory, PersistentConfigCache* persistent,
                 AutotuneOptions autotune_options = {});

  StatusOr<Selection> Select(const SelectionRequest& request);

 private:
  MemoryConfigCache* memory_;
  PersistentConfigCache* persistent_;
  AutotuneOptions autotune_options_;
};

}  // namespace ejk
