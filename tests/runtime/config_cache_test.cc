#include "runtime/config_cache.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/log.h"
#include "test_util.h"

namespace ejk {
namespace {

namespace fs = std::filesystem;

using ejk::testing::TempDir;

CacheKey Key(std::string signature, std::string op = "test_op", int version = 1) {
  return CacheKey{std::move(op), version, std::move(signature), "causal=1", "cpu-model-x"};
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

int CountOccurrences(const std::string& text, const std::string& needle) {
  int count = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1))
    ++count;
  return count;
}

// --- CacheKey ---------------------------------------------------------------

TEST(CacheKeyTest, ToStringSeparatesFieldsUnambiguously) {
  CacheKey a{"op", 1, "a|b", "c", "d"};
  CacheKey b{"op", 1, "a", "b|c", "d"};
  EXPECT_NE(a.ToString(), b.ToString());
  EXPECT_EQ(a.ToString(), "op.v1|a\\|b|c|d");
  CacheKey c{"op", 1, "a\\", "|c", "d"};
  CacheKey d{"op", 1, "a\\|", "c", "d"};
  EXPECT_NE(c.ToString(), d.ToString());
  EXPECT_NE(Key("s", "op", 1).ToString(), Key("s", "op", 2).ToString());
}

TEST(CacheKeyTest, JsonRoundTrip) {
  CacheKey key = Key("f32[1,128,8,64]");
  StatusOr<CacheKey> back = CacheKey::FromJson(key.ToJson());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->ToString(), key.ToString());
  EXPECT_EQ(back->ToJson(), key.ToJson());
}

TEST(CacheKeyTest, FromJsonDumpsStructuredFieldsCanonically) {
  nlohmann::json a = {{"op", "attn"},
                      {"op_version", 2},
                      {"signature", {{"b", 1}, {"a", 2}}},
                      {"options", ""},
                      {"device", "cpu"}};
  StatusOr<CacheKey> key = CacheKey::FromJson(a);
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(key->signature, "{\"a\":2,\"b\":1}");
  EXPECT_EQ(key->op_version, 2);
}

TEST(CacheKeyTest, FromJsonRejectsBadKeys) {
  const nlohmann::json good = {
      {"op", "attn"}, {"op_version", 1}, {"signature", "s"}, {"options", ""}, {"device", "cpu"}};
  ASSERT_TRUE(CacheKey::FromJson(good).ok());
  for (const char* field : {"op", "op_version", "signature", "options", "device"}) {
    nlohmann::json missing = good;
    missing.erase(field);
    StatusOr<CacheKey> key = CacheKey::FromJson(missing);
    EXPECT_EQ(key.status().code(), StatusCode::kInvalidArgument) << field;
    EXPECT_NE(key.status().message().find(field), std::string::npos) << key.status().message();
  }
  for (const nlohmann::json& op : {nlohmann::json("../evil"), nlohmann::json(".hidden"),
                                   nlohmann::json(""), nlohmann::json(3), nlohmann::json("a/b")}) {
    nlohmann::json bad = good;
    bad["op"] = op;
    EXPECT_FALSE(CacheKey::FromJson(bad).ok()) << op;
  }
  for (const nlohmann::json& version :
       {nlohmann::json(-1), nlohmann::json(1.5), nlohmann::json("1")}) {
    nlohmann::json bad = good;
    bad["op_version"] = version;
    EXPECT_FALSE(CacheKey::FromJson(bad).ok()) << version;
  }
  EXPECT_FALSE(CacheKey::FromJson(nlohmann::json::array()).ok());
}

// --- MemoryConfigCache ------------------------------------------------------

TEST(MemoryConfigCacheTest, StoreLookupClear) {
  MemoryConfigCache cache;
  EXPECT_EQ(cache.Size(), 0u);
  EXPECT_FALSE(cache.Lookup(Key("a")).has_value());
  cache.Store(Key("a"), {{"block", 64}});
  cache.Store(Key("b"), {{"block", 32}});
  cache.Store(Key("a"), {{"block", 128}});
  EXPECT_EQ(cache.Size(), 2u);
  EXPECT_EQ(*cache.Lookup(Key("a")), (Config{{"block", 128}}));
  EXPECT_FALSE(cache.Lookup(Key("a", "other_op")).has_value());
  cache.Clear();
  EXPECT_EQ(cache.Size(), 0u);
  EXPECT_FALSE(cache.Lookup(Key("b")).has_value());
}

TEST(MemoryConfigCacheTest, ConcurrentStores) {
  MemoryConfigCache cache;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&cache, t] {
      for (int i = 0; i < 250; ++i) {
        cache.Store(Key(std::to_string(t) + "_" + std::to_string(i)), {{"i", i}});
        cache.Lookup(Key("0_0"));
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(cache.Size(), 1000u);
}

// --- DefaultCacheDir --------------------------------------------------------

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_.has_value()) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(DefaultCacheDirTest, EnvironmentPrecedence) {
  ScopedEnv home("HOME", "/home/someone");
  {
    ScopedEnv ejk("EJKERNEL_CACHE_DIR", "/explicit/dir");
    ScopedEnv xdg("XDG_CACHE_HOME", "/xdg");
    EXPECT_EQ(DefaultCacheDir(), "/explicit/dir");
  }
  {
    ScopedEnv ejk("EJKERNEL_CACHE_DIR", "");
    ScopedEnv xdg("XDG_CACHE_HOME", "/xdg");
    EXPECT_EQ(DefaultCacheDir(), "/xdg/ejkernel");
  }
  {
    ScopedEnv ejk("EJKERNEL_CACHE_DIR", nullptr);
    ScopedEnv xdg("XDG_CACHE_HOME", nullptr);
    EXPECT_EQ(DefaultCacheDir(), "/home/someone/.cache/ejkernel");
  }
}

// --- PersistentConfigCache --------------------------------------------------

TEST(PersistentConfigCacheTest, RoundTripAndFileFormat) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/nested/cache";  // created on demand
  PersistentConfigCache cache(dir);
  EXPECT_EQ(cache.FileFor("test_op", 3), dir + "/test_op.v3.json");
  EXPECT_FALSE(cache.Lookup(Key("s1")).has_value());

  const Config config = {{"block_q", 64}, {"block_k", 128}};
  const nlohmann::json timings = {{"{\"block_q\":64}", 1.25}};
  ASSERT_TRUE(cache.Store(Key("s1"), config, timings).ok());
  ASSERT_TRUE(cache.Store(Key("s2"), {{"block_q", 32}}, {}).ok());

  EXPECT_EQ(*cache.Lookup(Key("s1")), config);
  EXPECT_EQ(*PersistentConfigCache(dir).Lookup(Key("s2")), (Config{{"block_q", 32}}));
  EXPECT_FALSE(cache.Lookup(Key("s3")).has_value());
  EXPECT_FALSE(cache.Lookup(Key("s1", "test_op", 2)).has_value());

  nlohmann::json doc = nlohmann::json::parse(ReadFile(cache.FileFor("test_op", 1)));
  EXPECT_EQ(doc["format"], "ejkernel-config-cache");
  EXPECT_EQ(doc["format_version"], 1);
  EXPECT_EQ(doc["op"], "test_op");
  EXPECT_EQ(doc["op_version"], 1);
  ASSERT_EQ(doc["entries"].size(), 2u);
  const nlohmann::json& entry = doc["entries"][Key("s1").ToString()];
  EXPECT_EQ(entry["config"], config);
  EXPECT_EQ(entry["timings_ms"], timings);
  EXPECT_EQ(entry["signature"], "s1");
  EXPECT_EQ(entry["options"], "causal=1");
  EXPECT_EQ(entry["device"], "cpu-model-x");
  EXPECT_GT(entry["created_unix"].get<int64_t>(), 1600000000);

  // Only the cache file and its lock file remain: no temporary files.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"test_op.v1.json", "test_op.v1.json.lock"}));
}

TEST(PersistentConfigCacheTest, StoreOverwritesAnEntry) {
  TempDir tmp;
  PersistentConfigCache cache(tmp.path());
  ASSERT_TRUE(cache.Store(Key("s"), {{"v", 1}}, {}).ok());
  ASSERT_TRUE(cache.Store(Key("s"), {{"v", 2}}, {}).ok());
  EXPECT_EQ(*cache.Lookup(Key("s")), (Config{{"v", 2}}));
}

TEST(PersistentConfigCacheTest, RejectsUnsafeOpNames) {
  TempDir tmp;
  PersistentConfigCache cache(tmp.path());
  EXPECT_EQ(cache.Store(Key("s", "../escape"), {{"v", 1}}, {}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_FALSE(cache.Lookup(Key("s", "../escape")).has_value());
  EXPECT_FALSE(fs::exists(fs::path(tmp.path()).parent_path() / "escape.v1.json"));
}

struct BadFileCase {
  const char* name;
  std::string contents;
};

class PersistentConfigCacheBadFileTest : public ::testing::TestWithParam<BadFileCase> {};

TEST_P(PersistentConfigCacheBadFileTest, IgnoredWithOneWarningThenRepairedByStore) {
  TempDir tmp;
  PersistentConfigCache cache(tmp.path());
  const std::string file = cache.FileFor("test_op", 1);
  WriteFile(file, GetParam().contents);

  ::testing::internal::CaptureStderr();
  EXPECT_FALSE(cache.Lookup(Key("s")).has_value());
  EXPECT_FALSE(cache.Lookup(Key("s")).has_value());
  EXPECT_FALSE(PersistentConfigCache(tmp.path()).Lookup(Key("other")).has_value());
  Status stored = cache.Store(Key("s"), {{"fixed", true}}, {{"x", 1.0}});
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(stored.ok()) << stored.ToString();
  if (LogEnabled(LogLevel::kWarning)) {
    EXPECT_EQ(CountOccurrences(err, "ejkernel[warning]"), 1) << err;
    EXPECT_NE(err.find(file), std::string::npos) << err;
  }

  EXPECT_EQ(*cache.Lookup(Key("s")), (Config{{"fixed", true}}));
  nlohmann::json doc = nlohmann::json::parse(ReadFile(file));
  EXPECT_EQ(doc["format"], "ejkernel-config-cache");
  EXPECT_EQ(doc["entries"].size(), 1u);
}

INSTANTIATE_TEST_SUITE_P(
    BadFiles, PersistentConfigCacheBadFileTest,
    ::testing::Values(
        BadFileCase{"truncated", "{\"format\": \"ejkernel-config-cache\", \"format_ver"},
        BadFileCase{"binary", std::string("\x00\xff\x13garbage", 10)}, BadFileCase{"empty", ""},
        BadFileCase{"array", "[1, 2, 3]"},
        BadFileCase{"wrong_format",
                    R"({"format": "something-else", "format_version": 1, "op": "test_op",
                        "op_version": 1, "entries": {}})"},
        BadFileCase{"format_not_a_string",
                    R"({"format": 7, "format_version": 1, "op": "test_op", "op_version": 1,
                        "entries": {}})"},
        BadFileCase{"foreign_version",
                    R"({"format": "ejkernel-config-cache", "format_version": 99, "op": "test_op",
                        "op_version": 1, "entries": {"test_op.v1|s|causal=1|cpu-model-x":
                        {"config": {"old": 1}}}})"},
        BadFileCase{"other_op",
                    R"({"format": "ejkernel-config-cache", "format_version": 1, "op": "nope",
                        "op_version": 1, "entries": {}})"},
        BadFileCase{"entries_not_object",
                    R"({"format": "ejkernel-config-cache", "format_version": 1, "op": "test_op",
                        "op_version": 1, "entries": [1]})"}),
    [](const ::testing::TestParamInfo<BadFileCase>& info) { return std::string(info.param.name); });

TEST(PersistentConfigCacheTest, UnwritableDirectoryIsAnError) {
  TempDir tmp;
  const std::string blocker = tmp.path() + "/a_file";
  WriteFile(blocker, "not a directory");
  // Running as root ignores permission bits, but no one can create a directory under a file.
  PersistentConfigCache cache(blocker + "/cache");
  Status stored = cache.Store(Key("s"), {{"v", 1}}, {});
  EXPECT_FALSE(stored.ok());
  EXPECT_NE(stored.message().find(blocker), std::string::npos) << stored.ToString();
  EXPECT_FALSE(cache.Lookup(Key("s")).has_value());
}

TEST(PersistentConfigCacheTest, UnreplaceableFileIsAnError) {
  TempDir tmp;
  PersistentConfigCache cache(tmp.path());
  fs::create_directories(cache.FileFor("test_op", 1) + "/occupied");  // a directory in the way
  ::testing::internal::CaptureStderr();
  Status stored = cache.Store(Key("s"), {{"v", 1}}, {});
  ::testing::internal::GetCapturedStderr();
  EXPECT_FALSE(stored.ok());
  // The failed write leaves no temporary file behind.
  int files = 0;
  for (const auto& e : fs::directory_iterator(tmp.path())) files += e.is_regular_file() ? 1 : 0;
  EXPECT_EQ(files, 1);  // the lock file
}

TEST(PersistentConfigCacheTest, ConcurrentThreadsLoseNoEntry) {
  TempDir tmp;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 40;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&tmp, t] {
      PersistentConfigCache cache(tmp.path());
      for (int i = 0; i < kPerThread; ++i) {
        const std::string sig = "t" + std::to_string(t) + "_" + std::to_string(i);
        ASSERT_TRUE(cache.Store(Key(sig), {{"sig", sig}}, {}).ok());
        cache.Lookup(Key("t0_0"));
      }
    });
  }
  for (std::thread& th : threads) th.join();
  PersistentConfigCache cache(tmp.path());
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kPerThread; ++i) {
      const std::string sig = "t" + std::to_string(t) + "_" + std::to_string(i);
      std::optional<Config> found = cache.Lookup(Key(sig));
      ASSERT_TRUE(found.has_value()) << sig;
      EXPECT_EQ((*found)["sig"], sig);
    }
  }
}

// Two real processes store distinct entries into one cache file at the same time; the
// file lock and the re-read under it must keep every entry.
TEST(PersistentConfigCacheTest, ConcurrentProcessesLoseNoEntry) {
  TempDir tmp;
  constexpr int kProcesses = 2;
  constexpr int kPerProcess = 150;
  int start_gate[2];
  ASSERT_EQ(::pipe(start_gate), 0);
  std::vector<pid_t> children;
  for (int p = 0; p < kProcesses; ++p) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(start_gate[1]);
      // Blocks until the parent closes its end, so both children start together.
      char byte;
      ssize_t n;
      do {
        n = ::read(start_gate[0], &byte, 1);
      } while (n < 0 && errno == EINTR);
      PersistentConfigCache cache(tmp.path());
      int failures = 0;
      for (int i = 0; i < kPerProcess; ++i) {
        const std::string sig = "p" + std::to_string(p) + "_" + std::to_string(i);
        if (!cache.Store(Key(sig), {{"sig", sig}}, {{"ms", i}}).ok()) ++failures;
      }
      ::_exit(failures == 0 ? 0 : 1);
    }
    children.push_back(pid);
  }
  ::close(start_gate[0]);
  ::close(start_gate[1]);
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0);
  }

  PersistentConfigCache cache(tmp.path());
  nlohmann::json doc = nlohmann::json::parse(ReadFile(cache.FileFor("test_op", 1)));
  EXPECT_EQ(doc["entries"].size(), static_cast<size_t>(kProcesses * kPerProcess));
  for (int p = 0; p < kProcesses; ++p) {
    for (int i = 0; i < kPerProcess; ++i) {
      const std::string sig = "p" + std::to_string(p) + "_" + std::to_string(i);
      std::optional<Config> found = cache.Lookup(Key(sig));
      ASSERT_TRUE(found.has_value()) << sig;
      EXPECT_EQ((*found)["sig"], sig);
    }
  }
}

}  // namespace
}  // namespace ejk
