#include "runtime/config_cache.h"

#include <fcntl.h>
#include <pwd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <set>
#include <vector>

#include "runtime/log.h"

namespace ejk {
namespace {

namespace fs = std::filesystem;

constexpr const char* kFormat = "ejkernel-config-cache";
constexpr int kFormatVersion = 1;

std::string EscapeKeyField(const std::string& field) {
  std::string out;
  out.reserve(field.size());
  for (char c : field) {
    if (c == '\\' || c == '|') out += '\\';
    out += c;
  }
  return out;
}

StatusOr<std::string> KeyField(const nlohmann::json& json, const char* name) {
  auto it = json.find(name);
  if (it == json.end())
    return Status::InvalidArgument(std::string("cache key lacks \"") + name + "\"");
  if (it->is_string()) return it->get<std::string>();
  return it->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string ErrnoMessage(const std::string& what, const std::string& path, int err) {
  return what + " " + path + ": " + std::strerror(err);
}

// Closes a file descriptor on scope exit; closing a lock file's descriptor drops its flock.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

struct CacheFile {
  enum class State { kMissing, kValid, kInvalid };
  State state = State::kMissing;
  nlohmann::json doc;   // when kValid
  std::string problem;  // when kInvalid
};

StatusOr<std::optional<std::string>> ReadWholeFile(const std::string& path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return std::optional<std::string>();
    return Status::Internal(ErrnoMessage("cannot open", path, errno));
  }
  std::string text;
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::Internal(ErrnoMessage("cannot read", path, errno));
    }
    text.append(buf, static_cast<size_t>(n));
  }
  return std::optional<std::string>(std::move(text));
}

CacheFile ReadCacheFile(const std::string& path, const std::string& op, int op_version) {
  CacheFile file;
  StatusOr<std::optional<std::string>> text = ReadWholeFile(path);
  if (text.ok() && !text->has_value()) return file;
  file.state = CacheFile::State::kInvalid;
  if (!text.ok()) {
    file.problem = text.status().message();
    return file;
  }
  nlohmann::json doc = nlohmann::json::parse(**text, nullptr, /*allow_exceptions=*/false);
  auto field = [&doc](const char* name) -> const nlohmann::json& {
    static const nlohmann::json absent;
    auto it = doc.find(name);
    return it == doc.end() ? absent : *it;
  };
  if (doc.is_discarded() || !doc.is_object()) {
    file.problem = "not a JSON object";
  } else if (field("format") != kFormat) {
    file.problem = std::string("\"format\" is not \"") + kFormat + "\"";
  } else if (field("format_version") != kFormatVersion) {
    file.problem = "unsupported format_version " + field("format_version").dump();
  } else if (field("op") != op || field("op_version") != op_version) {
    file.problem = "it holds another op or op version";
  } else if (!field("entries").is_object()) {
    file.problem = "\"entries\" is not an object";
  } else {
    file.state = CacheFile::State::kValid;
    file.doc = std::move(doc);
  }
  return file;
}

// Paths already warned about, so a bad file is reported once per process, not per lookup.
std::mutex warned_mu;
std::set<std::string> warned_paths;

void WarnInvalidOnce(const std::string& path, const std::string& problem) {
  {
    std::lock_guard<std::mutex> lock(warned_mu);
    if (!warned_paths.insert(path).second) return;
  }
  Log(LogLevel::kWarning,
      "ignoring config cache file " + path + " (" + problem + "); the next store replaces it");
}

void ForgetWarning(const std::string& path) {
  std::lock_guard<std::mutex> lock(warned_mu);
  warned_paths.erase(path);
}

Status WriteAll(int fd, const std::string& data, const std::string& path) {
  size_t written = 0;
  while (written < data.size()) {
    ssize_t n = ::write(fd, data.data() + written, data.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::Internal(ErrnoMessage("cannot write", path, errno));
    }
    written += static_cast<size_t>(n);
  }
  return Status::Ok();
}

// Writes `data` to a temporary file beside `path`, syncs it and renames it over `path`.
Status ReplaceFileAtomically(const std::string& path, const std::string& data) {
  std::string temp = path + ".tmp.XXXXXX";
  std::vector<char> temp_buf(temp.begin(), temp.end());
  temp_buf.push_back('\0');
  FileDescriptor fd(::mkstemp(temp_buf.data()));
  if (fd.get() < 0) return Status::FailedPrecondition(ErrnoMessage("cannot create", temp, errno));
  temp = temp_buf.data();
  Status status = WriteAll(fd.get(), data, temp);
  if (status.ok() && ::fchmod(fd.get(), 0644) != 0) {
    status = Status::Internal(ErrnoMessage("cannot chmod", temp, errno));
  }
  if (status.ok() && ::fsync(fd.get()) != 0) {
    status = Status::Internal(ErrnoMessage("cannot fsync", temp, errno));
  }
  if (status.ok() && ::close(fd.release()) != 0) {
    status = Status::Internal(ErrnoMessage("cannot close", temp, errno));
  }
  if (status.ok() && ::rename(temp.c_str(), path.c_str()) != 0) {
    status = Status::Internal(ErrnoMessage("cannot rename " + temp + " to", path, errno));
  }
  if (!status.ok()) {
    ::unlink(temp.c_str());
    return status;
  }
  // Persist the rename itself; failure here only weakens durability, not correctness.
  FileDescriptor dir(
      ::open(fs::path(path).parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.get() >= 0) ::fsync(dir.get());
  return Status::Ok();
}

}  // namespace

// --- CacheKey ---------------------------------------------------------------

std::string CacheKey::ToString() const {
  return EscapeKeyField(op) + ".v" + std::to_string(op_version) + "|" + EscapeKeyField(signature) +
         "|" + EscapeKeyField(options) + "|" + EscapeKeyField(device);
}

StatusOr<CacheKey> CacheKey::FromJson(const nlohmann::json& json) {
  if (!json.is_object()) return Status::InvalidArgument("cache key must be a JSON object");
  CacheKey key;
  auto op = json.find("op");
  if (op == json.end() || !op->is_string()) {
    return Status::InvalidArgument("cache key needs \"op\" as a string");
  }
  key.op = op->get<std::string>();
  EJK_RETURN_IF_ERROR(ValidateOpName(key.op));
  auto version = json.find("op_version");
  if (version == json.end() || !version->is_number_integer() || *version < 0 ||
      *version > INT_MAX) {
    return Status::InvalidArgument("cache key needs \"op_version\" as an integer >= 0");
  }
  key.op_version = version->get<int>();
  EJK_ASSIGN_OR_RETURN(key.signature, KeyField(json, "signature"));
  EJK_ASSIGN_OR_RETURN(key.options, KeyField(json, "options"));
  EJK_ASSIGN_OR_RETURN(key.device, KeyField(json, "device"));
  return key;
}

nlohmann::json CacheKey::ToJson() const {
  return {{"op", op},
          {"op_version", op_version},
          {"signature", signature},
          {"options", options},
          {"device", device}};
}

Status ValidateOpName(const std::string& op) {
  bool ok = !op.empty() && op[0] != '.';
  for (char c : op) {
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                c == '_' || c == '-' || c == '.');
  }
  if (ok) return Status::Ok();
  return Status::InvalidArgument(
      "invalid op name '" + op +
      "' (letters, digits, '_', '-' and '.' only; not starting with '.')");
}

// --- MemoryConfigCache ------------------------------------------------------

std::optional<Config> MemoryConfigCache::Lookup(const CacheKey& key) const {
  const std::string k = key.ToString();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(k);
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

void MemoryConfigCache::Store(const CacheKey& key, const Config& config) {
  std::string k = key.ToString();
  std::lock_guard<std::mutex> lock(mu_);
  entries_[std::move(k)] = config;
}

void MemoryConfigCache::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.clear();
}

size_t MemoryConfigCache::Size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

// --- PersistentConfigCache --------------------------------------------------

std::string DefaultCacheDir() {
  auto env = [](const char* name) -> std::string {
    const char* value = std::getenv(name);
    return value != nullptr ? value : "";
  };
  if (std::string dir = env("EJKERNEL_CACHE_DIR"); !dir.empty()) return dir;
  if (std::string xdg = env("XDG_CACHE_HOME"); !xdg.empty())
    return (fs::path(xdg) / "ejkernel").string();
  std::string home = env("HOME");
  if (home.empty()) {
    if (const passwd* pw = ::getpwuid(::getuid()); pw != nullptr && pw->pw_dir != nullptr)
      home = pw->pw_dir;
  }
  if (home.empty()) {
    std::error_code ec;
    return (fs::temp_directory_path(ec) / "ejkernel").string();
  }
  return (fs::path(home) / ".cache" / "ejkernel").string();
}

PersistentConfigCache::PersistentConfigCache(std::string dir)
    : dir_(dir.empty() ? DefaultCacheDir() : std::move(dir)) {}

std::string PersistentConfigCache::FileFor(const std::string& op, int op_version) const {
  return (fs::path(dir_) / (op + ".v" + std::to_string(op_version) + ".json")).string();
}

std::optional<Config> PersistentConfigCache::Lookup(const CacheKey& key) const {
  if (!ValidateOpName(key.op).ok()) return std::nullopt;
  const std::string path = FileFor(key.op, key.op_version);
  CacheFile file = ReadCacheFile(path, key.op, key.op_version);
  if (file.state == CacheFile::State::kInvalid) WarnInvalidOnce(path, file.problem);
  if (file.state != CacheFile::State::kValid) return std::nullopt;
  const nlohmann::json& entries = file.doc["entries"];
  auto entry = entries.find(key.ToString());
  if (entry == entries.end() || !entry->is_object()) return std::nullopt;
  auto config = entry->find("config");
  if (config == entry->end() || config->is_null()) return std::nullopt;
  return *config;
}

Status PersistentConfigCache::Store(const CacheKey& key, const Config& config,
                                    const nlohmann::json& timings_ms) {
  EJK_RETURN_IF_ERROR(ValidateOpName(key.op));
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) {
    return Status::FailedPrecondition("cannot create config cache directory " + dir_ + ": " +
                                      ec.message());
  }
  const std::string path = FileFor(key.op, key.op_version);
  const std::string lock_path = path + ".lock";
  FileDescriptor lock(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (lock.get() < 0)
    return Status::FailedPrecondition(ErrnoMessage("cannot open", lock_path, errno));
  while (::flock(lock.get(), LOCK_EX) != 0) {
    if (errno != EINTR) return Status::Internal(ErrnoMessage("cannot lock", lock_path, errno));
  }

  CacheFile file = ReadCacheFile(path, key.op, key.op_version);
  if (file.state == CacheFile::State::kInvalid) WarnInvalidOnce(path, file.problem);
  nlohmann::json doc = std::move(file.doc);
  if (file.state != CacheFile::State::kValid) {
    doc = {{"format", kFormat},
           {"format_version", kFormatVersion},
           {"op", key.op},
           {"op_version", key.op_version},
           {"entries", nlohmann::json::object()}};
  }
  doc["entries"][key.ToString()] = {
      {"config", config},           {"timings_ms", timings_ms},
      {"signature", key.signature}, {"options", key.options},
      {"device", key.device},       {"created_unix", static_cast<int64_t>(std::time(nullptr))},
  };
  EJK_RETURN_IF_ERROR(ReplaceFileAtomically(
      path, doc.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n"));
  ForgetWarning(path);
  return Status::Ok();
}

}  // namespace ejk
