#include "runtime/registry.h"

#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace ejk {
namespace {

KernelEntry Entry(std::string op, Platform platform, Backend backend, int priority,
                  std::string name) {
  KernelEntry e;
  e.op = std::move(op);
  e.platform = platform;
  e.backend = backend;
  e.priority = priority;
  e.name = std::move(name);
  return e;
}

TEST(RegistryTest, LookupPicksHighestPriority) {
  Registry registry;
  ASSERT_TRUE(registry.Register(Entry("attn", Platform::kCpu, Backend::kCpu, 10, "low")).ok());
  ASSERT_TRUE(registry.Register(Entry("attn", Platform::kCpu, Backend::kCpu, 50, "high")).ok());
  ASSERT_TRUE(registry.Register(Entry("attn", Platform::kCpu, Backend::kCpu, 20, "mid")).ok());
  ASSERT_TRUE(registry.Register(Entry("attn", Platform::kCuda, Backend::kGpu, 99, "gpu")).ok());

  StatusOr<KernelEntry> cpu = registry.Lookup("attn", Platform::kCpu, Backend::kCpu);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  EXPECT_EQ(cpu->name, "high");
  StatusOr<KernelEntry> gpu = registry.Lookup("attn", Platform::kCuda, Backend::kGpu);
  ASSERT_TRUE(gpu.ok());
  EXPECT_EQ(gpu->name, "gpu");
}

TEST(RegistryTest, EqualPrioritiesResolveByName) {
  Registry registry;
  ASSERT_TRUE(registry.Register(Entry("op", Platform::kCpu, Backend::kCpu, 5, "zeta")).ok());
  ASSERT_TRUE(registry.Register(Entry("op", Platform::kCpu, Backend::kCpu, 5, "alpha")).ok());
  EXPECT_EQ(registry.Lookup("op", Platform::kCpu, Backend::kCpu)->name, "alpha");
}

TEST(RegistryTest, RejectsDuplicatesAndEmptyNames) {
  Registry registry;
  ASSERT_TRUE(registry.Register(Entry("attn", Platform::kCpu, Backend::kCpu, 1, "impl")).ok());
  Status dup = registry.Register(Entry("attn", Platform::kCpu, Backend::kCpu, 2, "impl"));
  EXPECT_EQ(dup.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dup.message().find("already registered"), std::string::npos);
  // The same name on another platform is a different implementation.
  EXPECT_TRUE(registry.Register(Entry("attn", Platform::kCuda, Backend::kGpu, 1, "impl")).ok());
  EXPECT_FALSE(registry.Register(Entry("", Platform::kCpu, Backend::kCpu, 1, "x")).ok());
  EXPECT_FALSE(registry.Register(Entry("attn", Platform::kCpu, Backend::kCpu, 1, "")).ok());
  EXPECT_EQ(registry.List().size(), 2u);
}

TEST(RegistryTest, LookupErrorsNameOpAndPlatform) {
  Registry registry;
  ASSERT_TRUE(registry.Register(Entry("attn", Platform::kCpu, Backend::kCpu, 1, "impl")).ok());
  StatusOr<KernelEntry> missing = registry.Lookup("attn", Platform::kCuda, Backend::kGpu);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("attn"), std::string::npos);
  EXPECT_NE(missing.status().message().find("cuda"), std::string::npos);
  EXPECT_EQ(registry.Lookup("other", Platform::kCpu, Backend::kCpu).status().code(),
            StatusCode::kNotFound);
}

TEST(RegistryTest, ListSortsByOpThenPriority) {
  Registry registry;
  ASSERT_TRUE(registry.Register(Entry("b_op", Platform::kCpu, Backend::kCpu, 1, "b1")).ok());
  ASSERT_TRUE(registry.Register(Entry("a_op", Platform::kCpu, Backend::kCpu, 1, "a1")).ok());
  ASSERT_TRUE(registry.Register(Entry("a_op", Platform::kCuda, Backend::kGpu, 7, "a7")).ok());
  ASSERT_TRUE(registry.Register(Entry("b_op", Platform::kCpu, Backend::kCpu, 3, "b3")).ok());
  std::vector<std::string> names;
  for (const KernelEntry& e : registry.List()) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{"a7", "a1", "b3", "b1"}));
}

TEST(RegistryTest, EntriesKeepTheirCallbacks) {
  Registry registry;
  KernelEntry e = Entry("attn", Platform::kCpu, Backend::kCpu, 1, "impl");
  e.features = {"causal"};
  e.ffi_targets = {{"target_fwd", "SymbolFwd"}};
  e.heuristic = [](const nlohmann::json& sig) { return Config{{"block", sig.value("n", 0) * 2}}; };
  ASSERT_TRUE(registry.Register(e).ok());
  StatusOr<KernelEntry> found = registry.Lookup("attn", Platform::kCpu, Backend::kCpu);
  ASSERT_TRUE(found.ok());
  ASSERT_TRUE(static_cast<bool>(found->heuristic));
  EXPECT_EQ(found->heuristic({{"n", 21}}), (Config{{"block", 42}}));
  EXPECT_FALSE(static_cast<bool>(found->candidates));
  EXPECT_EQ(found->ffi_targets.at(0).symbol, "SymbolFwd");
}

TEST(RegistryTest, Names) {
  EXPECT_STREQ(PlatformName(Platform::kCpu), "cpu");
  EXPECT_STREQ(PlatformName(Platform::kCuda), "cuda");
  EXPECT_STREQ(BackendName(Backend::kCpu), "cpu");
  EXPECT_STREQ(BackendName(Backend::kGpu), "gpu");
  EXPECT_EQ(*ParsePlatform("cuda"), Platform::kCuda);
  EXPECT_FALSE(ParsePlatform("tpu").ok());
}

TEST(RegistryTest, ReadSignatureCounts) {
  int64_t tokens = -1, heads = -1;
  const nlohmann::json good = {{"num_tokens", 37}, {"num_heads", 0}, {"dtype", "bfloat16"}};
  ASSERT_TRUE(ReadSignatureCounts(good, "op", {{"num_tokens", &tokens}, {"num_heads", &heads}}).ok());
  EXPECT_EQ(tokens, 37);
  EXPECT_EQ(heads, 0);
  for (const nlohmann::json& bad : {nlohmann::json{{"num_tokens", 3}},                       // missing
                                    nlohmann::json{{"num_tokens", 3}, {"num_heads", -2}},    // negative
                                    nlohmann::json{{"num_tokens", 3}, {"num_heads", 2.5}},   // not an integer
                                    nlohmann::json{{"num_tokens", 3}, {"num_heads", "8"}}}) {
    const Status s = ReadSignatureCounts(bad, "op workspace", {{"num_tokens", &tokens}, {"num_heads", &heads}});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad.dump();
    EXPECT_NE(s.message().find("op workspace: signature needs a non-negative integer 'num_heads'"), std::string::npos)
        << s.message();
  }
}

KernelEntry StaticEntry() {
  return Entry("ejk_registry_test_static_op", Platform::kCpu, Backend::kCpu, 3, "static_impl");
}

}  // namespace
}  // namespace ejk

EJK_REGISTER_KERNEL(registry_test_static, ejk::StaticEntry());

namespace ejk {
namespace {

TEST(RegistryTest, StaticRegistrationReachesTheGlobalRegistry) {
  StatusOr<KernelEntry> e =
      Registry::Global().Lookup("ejk_registry_test_static_op", Platform::kCpu, Backend::kCpu);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(e->name, "static_impl");
  EXPECT_EQ(e->priority, 3);
}

TEST(RegistryDeathTest, FailedStaticRegistrationAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(internal::RegisterKernelOrDie(StaticEntry()), "already registered");
}

TEST(RegistryTest, ConcurrentRegistrationAndLookup) {
  Registry registry;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&registry, t] {
      for (int i = 0; i < 100; ++i) {
        ASSERT_TRUE(registry
                        .Register(Entry("op", Platform::kCpu, Backend::kCpu, i,
                                        "t" + std::to_string(t) + "_" + std::to_string(i)))
                        .ok());
        ASSERT_TRUE(registry.Lookup("op", Platform::kCpu, Backend::kCpu).ok());
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(registry.List().size(), 400u);
  EXPECT_EQ(registry.Lookup("op", Platform::kCpu, Backend::kCpu)->priority, 99);
}

}  // namespace
}  // namespace ejk
