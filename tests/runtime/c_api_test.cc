// The C API as Python's ctypes sees it: JSON strings in and out, errors through
// ejk_last_error().
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "runtime/config_cache.h"
#include "runtime/device.h"
#include "runtime/registry.h"
#include "test_util.h"

extern "C" {
const char* ejk_version(void);
char* ejk_build_info_json(void);
char* ejk_registry_list_json(void);
char* ejk_device_fingerprint_json(const char* platform, int device);
char* ejk_default_cache_dir(void);
char* ejk_cache_lookup(const char* cache_dir, const char* key_json);
int ejk_cache_store(const char* cache_dir, const char* key_json, const char* config_json,
                    const char* timings_json);
char* ejk_op_heuristic_config(const char* op, const char* platform, const char* signature_json);
char* ejk_op_config_candidates(const char* op, const char* platform, const char* signature_json);
char* ejk_op_unsupported_reason(const char* op, const char* platform, const char* signature_json);
int64_t ejk_op_workspace_bytes(const char* op, const char* platform, const char* pass, const char* signature_json);
const char* ejk_last_error(void);
void ejk_free(char*);
}

namespace ejk {
namespace {

namespace fs = std::filesystem;

using ejk::testing::TempDir;

// Takes ownership of a returned string, as Python's _take_string does.
std::optional<std::string> Take(char* text) {
  if (text == nullptr) return std::nullopt;
  std::string copy(text);
  ejk_free(text);
  return copy;
}

nlohmann::json TakeJson(char* text) {
  std::optional<std::string> s = Take(text);
  EXPECT_TRUE(s.has_value()) << ejk_last_error();
  return s.has_value() ? nlohmann::json::parse(*s) : nlohmann::json();
}

std::string LastError() { return ejk_last_error(); }

constexpr const char* kOp = "ejk_c_api_test_op";

// Two CPU entries: the higher-priority one has neither heuristic nor candidates, so the
// C API must skip it.
void RegisterTestEntries() {
  static const bool registered = [] {
    KernelEntry bare;
    bare.op = kOp;
    bare.name = "bare";
    bare.priority = 50;
    bare.features = {"causal"};
    bare.ffi_targets = {{"ejk_test_fwd", "EjkTestForward"}};
    KernelEntry tuned;
    tuned.op = kOp;
    tuned.name = "tuned";
    tuned.priority = 10;
    tuned.op_version = 3;
    tuned.heuristic = [](const nlohmann::json& sig) {
      if (sig.value("explode", false)) throw std::runtime_error("heuristic exploded");
      return Config{{"block", sig.value("seqlen", 128) / 2}};
    };
    tuned.candidates = [](const nlohmann::json& sig) {
      return std::vector<Config>{{{"block", 16}}, {{"block", 32}}};
    };
    KernelEntry gpu = tuned;
    gpu.platform = Platform::kCuda;
    gpu.backend = Backend::kGpu;
    gpu.name = "tuned_gpu";
    gpu.heuristic = [](const nlohmann::json&) { return Config{{"block", "gpu"}}; };
    gpu.unsupported = [](const nlohmann::json& sig) {
      return sig.value("head_dim", 0) > 256 ? std::string("head_dim above 256") : std::string();
    };
    gpu.workspace_bytes = [](const nlohmann::json& sig, const std::string& pass) -> StatusOr<int64_t> {
      if (pass != "backward") return Status::InvalidArgument("pass '" + pass + "' unknown");
      return sig.value("rows", int64_t{0}) * 4;
    };
    return Registry::Global().Register(bare).ok() && Registry::Global().Register(tuned).ok() &&
           Registry::Global().Register(gpu).ok();
  }();
  ASSERT_TRUE(registered);
}

std::string KeyJson(const std::string& signature) {
  return nlohmann::json{{"op", "c_api_op"},
                        {"op_version", 2},
                        {"signature", signature},
                        {"options", "causal"},
                        {"device", "cpu-test"}}
      .dump();
}

TEST(CApiTest, VersionAndBuildInfo) {
  EXPECT_STREQ(ejk_version(), EJK_VERSION);
  nlohmann::json info = TakeJson(ejk_build_info_json());
  EXPECT_EQ(info["version"], EJK_VERSION);
  EXPECT_EQ(info["has_cuda"], static_cast<bool>(EJK_HAS_CUDA));
  EXPECT_TRUE(info["cuda_archs"].is_array());
  if (std::string(EJK_CUDA_ARCHS).empty()) {
    EXPECT_TRUE(info["cuda_archs"].empty());
  }
  EXPECT_EQ(info["hopper_kernels"], static_cast<bool>(EJK_CUDA_SM90A));
  EXPECT_FALSE(info["compiler"].get<std::string>().empty());
  EXPECT_EQ(info["cpu_isa"].get<std::vector<std::string>>(), CompiledCpuIsa());
  EXPECT_EQ(LastError(), "");
}

TEST(CApiTest, RegistryList) {
  RegisterTestEntries();
  nlohmann::json list = TakeJson(ejk_registry_list_json());
  ASSERT_TRUE(list.is_array());
  std::vector<nlohmann::json> ours;
  for (const auto& e : list) {
    if (e["op"] == kOp) ours.push_back(e);
  }
  ASSERT_EQ(ours.size(), 3u);
  // Priority first (50, then 10 and 10), then name.
  EXPECT_EQ(ours[0]["name"], "bare");
  EXPECT_EQ(ours[0]["platform"], "cpu");
  EXPECT_EQ(ours[0]["backend"], "cpu");
  EXPECT_EQ(ours[0]["priority"], 50);
  EXPECT_EQ(ours[0]["op_version"], 1);
  EXPECT_EQ(ours[0]["features"], nlohmann::json({"causal"}));
  EXPECT_EQ(ours[0]["ffi_targets"],
            nlohmann::json::parse(R"([{"target": "ejk_test_fwd", "symbol": "EjkTestForward"}])"));
  EXPECT_EQ(ours[1]["name"], "tuned");
  EXPECT_EQ(ours[1]["op_version"], 3);
  EXPECT_EQ(ours[2]["name"], "tuned_gpu");
  EXPECT_EQ(ours[2]["platform"], "cuda");
  EXPECT_EQ(ours[2]["backend"], "gpu");
}

TEST(CApiTest, HeuristicAndCandidates) {
  RegisterTestEntries();
  EXPECT_EQ(TakeJson(ejk_op_heuristic_config(kOp, "cpu", R"({"seqlen": 512})")),
            (nlohmann::json{{"block", 256}}));
  EXPECT_EQ(TakeJson(ejk_op_heuristic_config(kOp, "cpu", nullptr)),
            (nlohmann::json{{"block", 64}}));
  EXPECT_EQ(TakeJson(ejk_op_heuristic_config(kOp, "cuda", "{}")),
            (nlohmann::json{{"block", "gpu"}}));
  EXPECT_EQ(TakeJson(ejk_op_config_candidates(kOp, "cpu", "{}")),
            nlohmann::json::parse(R"([{"block": 16}, {"block": 32}])"));
}

TEST(CApiTest, UnsupportedReason) {
  RegisterTestEntries();
  // The best entry decides; one without a rule serves every signature.
  EXPECT_EQ(Take(ejk_op_unsupported_reason(kOp, "cpu", R"({"head_dim": 512})")), "");
  EXPECT_EQ(Take(ejk_op_unsupported_reason(kOp, "cuda", R"({"head_dim": 128})")), "");
  EXPECT_EQ(Take(ejk_op_unsupported_reason(kOp, "cuda", R"({"head_dim": 512})")), "head_dim above 256");
  EXPECT_EQ(ejk_op_unsupported_reason("no_such_op", "cuda", "{}"), nullptr);
  EXPECT_NE(LastError().find("no_such_op"), std::string::npos) << LastError();
}

TEST(CApiTest, WorkspaceBytes) {
  RegisterTestEntries();
  // The best entry decides; one without a workspace rule takes none.
  EXPECT_EQ(ejk_op_workspace_bytes(kOp, "cuda", "backward", R"({"rows": 1000})"), 4000);
  EXPECT_EQ(ejk_op_workspace_bytes(kOp, "cpu", "backward", R"({"rows": 1000})"), 0);
  EXPECT_EQ(LastError(), "");
  EXPECT_EQ(ejk_op_workspace_bytes(kOp, "cuda", "sideways", "{}"), -1);
  EXPECT_NE(LastError().find("sideways"), std::string::npos) << LastError();
  EXPECT_EQ(ejk_op_workspace_bytes(kOp, "cuda", nullptr, "{}"), -1);
  EXPECT_NE(LastError().find("pass"), std::string::npos) << LastError();
  EXPECT_EQ(ejk_op_workspace_bytes(kOp, "cuda", "backward", "{not json"), -1);
  EXPECT_NE(LastError().find("JSON"), std::string::npos) << LastError();
  EXPECT_EQ(ejk_op_workspace_bytes("no_such_op", "cuda", "backward", "{}"), -1);
  EXPECT_NE(LastError().find("no_such_op"), std::string::npos) << LastError();
}

TEST(CApiTest, HeuristicErrorsSetLastError) {
  RegisterTestEntries();
  EXPECT_EQ(ejk_op_heuristic_config("no_such_op", "cpu", "{}"), nullptr);
  EXPECT_NE(LastError().find("no_such_op"), std::string::npos) << LastError();
  EXPECT_EQ(ejk_op_config_candidates("no_such_op", "cpu", "{}"), nullptr);
  EXPECT_NE(LastError().find("no_such_op"), std::string::npos);
  EXPECT_EQ(ejk_op_heuristic_config(kOp, "tpu", "{}"), nullptr);
  EXPECT_NE(LastError().find("tpu"), std::string::npos);
  EXPECT_EQ(ejk_op_heuristic_config(kOp, "cpu", "{not json"), nullptr);
  EXPECT_NE(LastError().find("JSON"), std::string::npos);
  EXPECT_EQ(ejk_op_heuristic_config(nullptr, "cpu", "{}"), nullptr);
  EXPECT_NE(LastError(), "");
  // An exception inside a heuristic stays on the C++ side.
  EXPECT_EQ(ejk_op_heuristic_config(kOp, "cpu", R"({"explode": true})"), nullptr);
  EXPECT_NE(LastError().find("heuristic exploded"), std::string::npos) << LastError();
  // The next successful call clears the error.
  EXPECT_NE(Take(ejk_op_heuristic_config(kOp, "cpu", "{}")), std::nullopt);
  EXPECT_EQ(LastError(), "");
}

TEST(CApiTest, DeviceFingerprint) {
  nlohmann::json cpu = TakeJson(ejk_device_fingerprint_json("cpu", 0));
  EXPECT_EQ(cpu["platform"], "cpu");
  EXPECT_EQ(cpu["key"], CpuFingerprint().Key());
  EXPECT_EQ(cpu["fields"], CpuFingerprint().fields);

  EXPECT_EQ(ejk_device_fingerprint_json("tpu", 0), nullptr);
  EXPECT_NE(LastError().find("tpu"), std::string::npos);
#if !EJK_HAS_CUDA
  EXPECT_EQ(ejk_device_fingerprint_json("cuda", 0), nullptr);
  EXPECT_NE(LastError().find("built without CUDA"), std::string::npos) << LastError();
#endif
  EXPECT_EQ(ejk_device_fingerprint_json(nullptr, 0), nullptr);
  EXPECT_NE(LastError(), "");
}

TEST(CApiTest, CacheRoundTrip) {
  TempDir tmp;
  const std::string key = KeyJson("f32[2,2]");
  EXPECT_EQ(ejk_cache_lookup(tmp.path().c_str(), key.c_str()), nullptr);
  EXPECT_EQ(LastError(), "");  // simply missing

  ASSERT_EQ(ejk_cache_store(tmp.path().c_str(), key.c_str(), R"({"block_q": 64})",
                            R"({"{\"block_q\":64}": 0.5})"),
            0)
      << LastError();
  EXPECT_EQ(TakeJson(ejk_cache_lookup(tmp.path().c_str(), key.c_str())),
            (nlohmann::json{{"block_q", 64}}));
  EXPECT_EQ(LastError(), "");
  // The C++ cache reads what the C API wrote.
  StatusOr<CacheKey> parsed = CacheKey::FromJson(nlohmann::json::parse(key));
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(*PersistentConfigCache(tmp.path()).Lookup(*parsed), (Config{{"block_q", 64}}));

  // Timings may be omitted.
  const std::string other = KeyJson("f32[4,4]");
  ASSERT_EQ(ejk_cache_store(tmp.path().c_str(), other.c_str(), R"({"block_q": 32})", nullptr), 0);
  EXPECT_EQ(TakeJson(ejk_cache_lookup(tmp.path().c_str(), other.c_str())),
            (nlohmann::json{{"block_q", 32}}));
}

TEST(CApiTest, CacheDirDefaultsToTheEnvironment) {
  TempDir tmp;
  const char* old = ::getenv("EJKERNEL_CACHE_DIR");
  const std::optional<std::string> saved = old ? std::optional<std::string>(old) : std::nullopt;
  ::setenv("EJKERNEL_CACHE_DIR", tmp.path().c_str(), 1);
  EXPECT_EQ(Take(ejk_default_cache_dir()), tmp.path());
  const std::string key = KeyJson("default-dir");
  EXPECT_EQ(ejk_cache_store(nullptr, key.c_str(), R"({"v": 1})", "{}"), 0) << LastError();
  EXPECT_EQ(TakeJson(ejk_cache_lookup("", key.c_str())), (nlohmann::json{{"v", 1}}));
  EXPECT_TRUE(fs::exists(fs::path(tmp.path()) / "c_api_op.v2.json"));
  if (saved.has_value()) {
    ::setenv("EJKERNEL_CACHE_DIR", saved->c_str(), 1);
  } else {
    ::unsetenv("EJKERNEL_CACHE_DIR");
  }
}

TEST(CApiTest, CacheErrorsSetLastError) {
  TempDir tmp;
  const char* dir = tmp.path().c_str();
  const std::string key = KeyJson("s");

  EXPECT_EQ(ejk_cache_lookup(dir, "{broken"), nullptr);
  EXPECT_NE(LastError(), "");
  EXPECT_EQ(ejk_cache_lookup(dir, nullptr), nullptr);
  EXPECT_NE(LastError(), "");
  EXPECT_EQ(ejk_cache_lookup(dir, R"({"op": "x"})"), nullptr);
  EXPECT_NE(LastError().find("op_version"), std::string::npos) << LastError();

  EXPECT_NE(ejk_cache_store(dir, key.c_str(), "[1, 2]", "{}"), 0);
  EXPECT_NE(LastError().find("object"), std::string::npos) << LastError();
  EXPECT_NE(ejk_cache_store(dir, key.c_str(), "{", "{}"), 0);
  EXPECT_NE(LastError(), "");
  EXPECT_NE(ejk_cache_store(dir, key.c_str(), "{}", "{oops"), 0);
  EXPECT_NE(LastError(), "");
  EXPECT_NE(ejk_cache_store(dir, R"({"op": "../x", "op_version": 1, "signature": "", "options": "",
                                     "device": ""})",
                            "{}", "{}"),
            0);
  EXPECT_NE(LastError().find("op name"), std::string::npos) << LastError();

  const std::string blocker = tmp.path() + "/file";
  std::fclose(std::fopen(blocker.c_str(), "w"));
  EXPECT_NE(ejk_cache_store((blocker + "/cache").c_str(), key.c_str(), "{}", "{}"), 0);
  EXPECT_NE(LastError().find(blocker), std::string::npos) << LastError();

  EXPECT_EQ(ejk_cache_store(dir, key.c_str(), "{}", "{}"), 0);
  EXPECT_EQ(LastError(), "");
}

TEST(CApiTest, LastErrorIsPerThread) {
  EXPECT_EQ(ejk_device_fingerprint_json("tpu", 0), nullptr);
  std::string other_thread_error = "unset";
  std::thread([&] { other_thread_error = ejk_last_error(); }).join();
  EXPECT_EQ(other_thread_error, "");
  EXPECT_NE(LastError(), "");
}

TEST(CApiTest, FreeAcceptsNull) { ejk_free(nullptr); }

}  // namespace
}  // namespace ejk
