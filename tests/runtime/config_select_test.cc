#include "runtime/config_select.h"

#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include "test_util.h"

namespace ejk {
namespace {


using ejk::testing::TempDir;

const Config kExplicit = {{"from", "explicit"}};
const Config kOverlay = {{"from", "overlay"}};
const Config kMemory = {{"from", "memory"}};
const Config kPersistent = {{"from", "persistent"}};
const Config kHeuristic = {{"from", "heuristic"}};

class ConfigSelectTest : public ::testing::Test {
 protected:
  ConfigSelectTest() : persistent_(tmp_.path()), selector_(&memory_, &persistent_, {1, 3}) {}

  // A request whose every tier can answer; tests knock tiers out to reach the next one.
  SelectionRequest FullRequest() {
    SelectionRequest r;
    r.key = key_;
    r.explicit_config = kExplicit;
    r.candidates = [] { return std::vector<Config>{{{"b", 1}}, {{"b", 2}}, {{"b", 3}}}; };
    r.time_ms = [this](const Config& c) -> StatusOr<double> {
      ++timed_runs_;
      const int b = c["b"];
      return b == 2 ? 1.0 : 5.0 + b;
    };
    r.heuristic = [] { return std::optional<Config>(kHeuristic); };
    return r;
  }

  StatusOr<Selection> Select(const SelectionRequest& r) { return selector_.Select(r); }

  TempDir tmp_;
  CacheKey key_{"select_op", 1, "f32[4,4]", "", "cpu-test"};
  MemoryConfigCache memory_;
  PersistentConfigCache persistent_;
  ConfigSelector selector_;
  int timed_runs_ = 0;
};

TEST_F(ConfigSelectTest, EachTierWinsOverTheOnesAfterIt) {
  ScopedAutotunePolicy policy(AutotunePolicy::kIfMissing);
  memory_.Store(key_, kMemory);
  ASSERT_TRUE(persistent_.Store(key_, kPersistent, {}).ok());
  ScopedOverlay overlay({{key_.ToString(), kOverlay}});
  SelectionRequest r = FullRequest();

  StatusOr<Selection> s = Select(r);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->source, "explicit");
  EXPECT_EQ(s->config, kExplicit);

  r.explicit_config.reset();
  s = Select(r);
  EXPECT_EQ(s->source, "overlay");
  EXPECT_EQ(s->config, kOverlay);

  {
    ScopedOverlay empty(std::map<std::string, Config>{});
    // Overlays hide nothing when they do not match, but an outer matching one still applies.
    EXPECT_EQ(Select(r)->source, "overlay");
  }
  EXPECT_EQ(timed_runs_, 0);
}

TEST_F(ConfigSelectTest, MemoryBeatsPersistentBeatsAutotune) {
  ScopedAutotunePolicy policy(AutotunePolicy::kIfMissing);
  SelectionRequest r = FullRequest();
  r.explicit_config.reset();
  memory_.Store(key_, kMemory);
  ASSERT_TRUE(persistent_.Store(key_, kPersistent, {}).ok());

  StatusOr<Selection> s = Select(r);
  EXPECT_EQ(s->source, "memory");
  EXPECT_EQ(s->config, kMemory);

  memory_.Clear();
  s = Select(r);
  EXPECT_EQ(s->source, "persistent");
  EXPECT_EQ(s->config, kPersistent);
  // The persistent hit was copied to memory.
  EXPECT_EQ(*memory_.Lookup(key_), kPersistent);
  EXPECT_EQ(Select(r)->source, "memory");
  EXPECT_EQ(timed_runs_, 0);
}

TEST_F(ConfigSelectTest, AutotuneBeatsHeuristicAndFillsBothCaches) {
  ScopedAutotunePolicy policy(AutotunePolicy::kIfMissing);
  SelectionRequest r = FullRequest();
  r.explicit_config.reset();

  StatusOr<Selection> s = Select(r);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->source, "autotune");
  EXPECT_EQ(s->config, (Config{{"b", 2}}));
  EXPECT_EQ(timed_runs_, 3 * (1 + 3));  // warmup 1 + repeats 3 per candidate

  EXPECT_EQ(*memory_.Lookup(key_), (Config{{"b", 2}}));
  EXPECT_EQ(*persistent_.Lookup(key_), (Config{{"b", 2}}));
  // The cache file records every candidate's median.
  std::ifstream in(persistent_.FileFor(key_.op, key_.op_version));
  nlohmann::json doc = nlohmann::json::parse(in);
  const nlohmann::json& timings = doc["entries"][key_.ToString()]["timings_ms"];
  EXPECT_EQ(timings.size(), 3u);
  EXPECT_DOUBLE_EQ(timings["{\"b\":2}"].get<double>(), 1.0);

  // Tuned once: later selections come from memory.
  EXPECT_EQ(Select(r)->source, "memory");
  EXPECT_EQ(timed_runs_, 12);
}

TEST_F(ConfigSelectTest, HeuristicWhenAutotuningIsOffGoesToMemoryOnly) {
  ScopedAutotunePolicy policy(AutotunePolicy::kNever);
  SelectionRequest r = FullRequest();
  r.explicit_config.reset();
  StatusOr<Selection> s = Select(r);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->source, "heuristic");
  EXPECT_EQ(s->config, kHeuristic);
  EXPECT_EQ(timed_runs_, 0);
  EXPECT_EQ(*memory_.Lookup(key_), kHeuristic);
  EXPECT_FALSE(persistent_.Lookup(key_).has_value());
}

TEST_F(ConfigSelectTest, HeuristicWhenNothingCanBeTuned) {
  ScopedAutotunePolicy policy(AutotunePolicy::kIfMissing);
  SelectionRequest r = FullRequest();
  r.explicit_config.reset();
  r.candidates = nullptr;
  EXPECT_EQ(Select(r)->source, "heuristic");
}

TEST_F(ConfigSelectTest, FailedAutotuneFallsBackToHeuristic) {
  ScopedAutotunePolicy policy(AutotunePolicy::kIfMissing);
  SelectionRequest r = FullRequest();
  r.explicit_config.reset();
  r.time_ms = [](const Config&) -> StatusOr<double> { return Status::Internal("kernel failed"); };
  ::testing::internal::CaptureStderr();
  StatusOr<Selection> s = Select(r);
  ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->source, "heuristic");
  EXPECT_FALSE(persistent_.Lookup(key_).has_value());
}

TEST_F(ConfigSelectTest, NothingYieldsAConfigIsNotFound) {
  ScopedAutotunePolicy policy(AutotunePolicy::kIfMissing);
  SelectionRequest r;
  r.key = key_;
  StatusOr<Selection> s = Select(r);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kNotFound);
  EXPECT_NE(s.status().message().find("select_op"), std::string::npos);

  r.heuristic = [] { return std::optional<Config>(); };  // declines
  EXPECT_EQ(Select(r).status().code(), StatusCode::kNotFound);
}

TEST_F(ConfigSelectTest, ThrowingHeuristicIsAnError) {
  SelectionRequest r;
  r.key = key_;
  r.heuristic = []() -> std::optional<Config> { throw std::runtime_error("bad signature"); };
  StatusOr<Selection> s = Select(r);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("bad signature"), std::string::npos);
}

TEST_F(ConfigSelectTest, AlwaysSkipsTheCachesButNotExplicitOrOverlay) {
  ScopedAutotunePolicy policy(AutotunePolicy::kAlways);
  memory_.Store(key_, kMemory);
  ASSERT_TRUE(persistent_.Store(key_, kPersistent, {}).ok());
  SelectionRequest r = FullRequest();
  EXPECT_EQ(Select(r)->source, "explicit");
  r.explicit_config.reset();
  {
    ScopedOverlay overlay({{key_.op, kOverlay}});
    EXPECT_EQ(Select(r)->source, "overlay");
  }
  StatusOr<Selection> s = Select(r);
  EXPECT_EQ(s->source, "autotune");
  EXPECT_EQ(s->config, (Config{{"b", 2}}));
  // The new winner replaced the cached configs.
  EXPECT_EQ(*memory_.Lookup(key_), (Config{{"b", 2}}));
  EXPECT_EQ(*persistent_.Lookup(key_), (Config{{"b", 2}}));
  EXPECT_EQ(Select(r)->source, "autotune");  // and tunes again every time
  EXPECT_EQ(timed_runs_, 24);
}

TEST_F(ConfigSelectTest, OverlaysNestInnermostWins) {
  SelectionRequest r;
  r.key = key_;
  EXPECT_FALSE(ScopedOverlay::Find(key_).has_value());
  {
    ScopedOverlay outer({{key_.ToString(), {{"level", "outer-key"}}}});
    EXPECT_EQ(Select(r)->config, (Config{{"level", "outer-key"}}));
    {
      // An op-wide entry of an inner overlay beats an exact key of an outer one.
      ScopedOverlay inner({{key_.op, {{"level", "inner-op"}}}});
      EXPECT_EQ(Select(r)->config, (Config{{"level", "inner-op"}}));
      {
        // Within one overlay the exact key beats the op-wide entry.
        ScopedOverlay innermost({{key_.op, {{"level", "innermost-op"}}},
                                 {key_.ToString(), {{"level", "innermost-key"}}}});
        EXPECT_EQ(Select(r)->config, (Config{{"level", "innermost-key"}}));
        CacheKey other_shape = key_;
        other_shape.signature = "f32[8,8]";
        EXPECT_EQ(*ScopedOverlay::Find(other_shape), (Config{{"level", "innermost-op"}}));
      }
      EXPECT_EQ(Select(r)->config, (Config{{"level", "inner-op"}}));
    }
    EXPECT_EQ(Select(r)->config, (Config{{"level", "outer-key"}}));
    CacheKey other_op = key_;
    other_op.op = "unrelated_op";
    EXPECT_FALSE(ScopedOverlay::Find(other_op).has_value());
  }
  EXPECT_FALSE(ScopedOverlay::Find(key_).has_value());
  EXPECT_EQ(memory_.Size(), 0u);  // overlays never reach the caches
}

TEST_F(ConfigSelectTest, OverlaysAndPolicyAreThreadLocal) {
  ScopedOverlay overlay({{key_.op, kOverlay}});
  ScopedAutotunePolicy policy(AutotunePolicy::kAlways);
  bool other_thread_sees_overlay = true;
  AutotunePolicy other_thread_policy = AutotunePolicy::kAlways;
  std::thread([&] {
    ScopedAutotunePolicy local(AutotunePolicy::kNever);
    other_thread_sees_overlay = ScopedOverlay::Find(key_).has_value();
    other_thread_policy = CurrentAutotunePolicy();
  }).join();
  EXPECT_FALSE(other_thread_sees_overlay);
  EXPECT_EQ(other_thread_policy, AutotunePolicy::kNever);
  EXPECT_EQ(CurrentAutotunePolicy(), AutotunePolicy::kAlways);
}

class ScopedAutotuneEnv {
 public:
  explicit ScopedAutotuneEnv(const char* value) {
    if (const char* old = ::getenv("EJKERNEL_AUTOTUNE")) old_ = old;
    if (value != nullptr) {
      ::setenv("EJKERNEL_AUTOTUNE", value, 1);
    } else {
      ::unsetenv("EJKERNEL_AUTOTUNE");
    }
  }
  ~ScopedAutotuneEnv() {
    if (old_.has_value()) {
      ::setenv("EJKERNEL_AUTOTUNE", old_->c_str(), 1);
    } else {
      ::unsetenv("EJKERNEL_AUTOTUNE");
    }
  }

 private:
  std::optional<std::string> old_;
};

TEST(AutotunePolicyTest, FromEnvironment) {
  const std::pair<const char*, AutotunePolicy> cases[] = {
      {nullptr, AutotunePolicy::kNever},   {"", AutotunePolicy::kNever},
      {"0", AutotunePolicy::kNever},       {"never", AutotunePolicy::kNever},
      {"1", AutotunePolicy::kIfMissing},   {"missing", AutotunePolicy::kIfMissing},
      {"always", AutotunePolicy::kAlways},
  };
  for (const auto& [value, expected] : cases) {
    ScopedAutotuneEnv env(value);
    EXPECT_EQ(AutotunePolicyFromEnv(), expected) << (value ? value : "(unset)");
    EXPECT_EQ(CurrentAutotunePolicy(), expected);
  }
  ScopedAutotuneEnv env("sometimes");
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(AutotunePolicyFromEnv(), AutotunePolicy::kNever);
  ::testing::internal::GetCapturedStderr();
}

TEST(AutotunePolicyTest, ScopedOverrideNestsAndRestores) {
  ScopedAutotuneEnv env("1");
  EXPECT_EQ(CurrentAutotunePolicy(), AutotunePolicy::kIfMissing);
  {
    ScopedAutotunePolicy outer(AutotunePolicy::kNever);
    EXPECT_EQ(CurrentAutotunePolicy(), AutotunePolicy::kNever);
    {
      ScopedAutotunePolicy inner(AutotunePolicy::kAlways);
      EXPECT_EQ(CurrentAutotunePolicy(), AutotunePolicy::kAlways);
    }
    EXPECT_EQ(CurrentAutotunePolicy(), AutotunePolicy::kNever);
  }
  EXPECT_EQ(CurrentAutotunePolicy(), AutotunePolicy::kIfMissing);
  EXPECT_STREQ(AutotunePolicyName(AutotunePolicy::kIfMissing), "missing");
}

TEST_F(ConfigSelectTest, EnvironmentPolicyDrivesSelectionWithoutOverride) {
  SelectionRequest r = FullRequest();
  r.explicit_config.reset();
  {
    ScopedAutotuneEnv env("0");
    EXPECT_EQ(Select(r)->source, "heuristic");
  }
  memory_.Clear();
  ScopedAutotuneEnv env("missing");
  EXPECT_EQ(Select(r)->source, "autotune");
}

}  // namespace
}  // namespace ejk
