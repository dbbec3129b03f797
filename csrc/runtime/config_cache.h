// Config caches: in memory (per process) and persistent (JSON files shared between
// processes). Entries are keyed by op and op version, shape/dtype signature, static options
// and device fingerprint.
#pragma once

#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "runtime/status.h"

namespace ejk {

using Config = nlohmann::json;

struct CacheKey {
  std::string op;
  int op_version = 1;
  std::string signature;
  std::string options;
  std::string device;

  // "<op>.v<version>|<signature>|<options>|<device>", with '\' and '|' inside fields escaped
  // by '\', so distinct keys give distinct strings.
  std::string ToString() const;
  // Needs "op" (letters, digits, '_', '-', '.'; not starting with '.'), "op_version" (an
  // integer >= 0), "signature", "options" and "device". Those three are strings or any JSON,
  // which stands for its compact dump (object members in name order).
  static StatusOr<CacheKey> FromJson(const nlohmann::json& json);
  nlohmann::json ToJson() const;
};

// Ops name cache files, so only names that are safe as file names are accepted.
Status ValidateOpName(const std::string& op);

// Thread-safe.
class MemoryConfigCache {
 public:
  std::optional<Config> Lookup(const CacheKey& key) const;
  void Store(const CacheKey& key, const Config& config);
  void Clear();
  size_t Size() const;

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::string, Config> entries_;
};

// $EJKERNEL_CACHE_DIR, else $XDG_CACHE_HOME/ejkernel, else ~/.cache/ejkernel.
std::string DefaultCacheDir();

// One JSON file per op and op version:
//   {"format": "ejkernel-config-cache", "format_version": 1, "op": ..., "op_version": ...,
//    "entries": {"<CacheKey::ToString()>": {"config": {...}, "timings_ms": {...},
//                "signature": ..., "options": ..., "device": ..., "created_unix": <int>}}}
// Stores take an exclusive flock on "<file>.lock", re-read the file, and replace it with a
// rename, so concurrent writers (threads or processes) lose no entry and readers, which take
// no lock, see either the old or the new file. An unreadable, corrupt or foreign file is
// ignored with one warning and replaced by the next Store.
class PersistentConfigCache {
 public:
  explicit PersistentConfigCache(std::string dir = DefaultCacheDir());

  std::optional<Config> Lookup(const CacheKey& key) const;
  Status Store(const CacheKey& key, const Config& config, const nlohmann::json& timings_ms);
  // "<dir>/<op>.v<op_version>.json"
  std::string FileFor(const std::string& op, int op_version) const;

 private:
  std::string dir_;
};

}  // namespace ejk
