#include "runtime/autotune.h"

#include <chrono>
#include <map>
#include <stdexcept>
#include <thread>

#include <gtest/gtest.h>

namespace ejk {
namespace {

// Reports, for each timed run, the duration the running config asks for.
class FakeTimer : public Timer {
 public:
  Status Start() override {
    ++starts;
    return Status::Ok();
  }
  StatusOr<double> StopMs() override { return next_ms; }

  double next_ms = 0.0;
  int starts = 0;
};

TEST(AutotuneTest, PicksTheFastestWithAFakeTimer) {
  FakeTimer timer;
  std::map<int, int> runs;
  auto run = [&](const Config& c) {
    const int id = c["id"];
    ++runs[id];
    timer.next_ms = id == 2 ? 0.5 : 2.0 + id;
    return Status::Ok();
  };
  std::vector<Config> candidates = {{{"id", 0}}, {{"id", 1}}, {{"id", 2}}, {{"id", 3}}};
  StatusOr<AutotuneResult> result = Autotune(candidates, run, timer, {/*warmup=*/2, /*repeats=*/5});
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_EQ(result->best, (Config{{"id", 2}}));
  EXPECT_DOUBLE_EQ(result->best_ms, 0.5);
  EXPECT_EQ(result->timings_ms.size(), 4u);
  EXPECT_DOUBLE_EQ(result->timings_ms["{\"id\":3}"].get<double>(), 5.0);
  EXPECT_TRUE(result->failures.empty());
  for (const auto& [id, count] : runs) EXPECT_EQ(count, 7) << id;  // 2 warmup + 5 timed
}

TEST(AutotuneTest, UsesTheMedianOfRepeats) {
  const std::vector<double> a_samples = {9.0, 1.0, 1.0, 1.0, 100.0};  // one slow outlier
  const std::vector<double> b_samples = {2.0, 2.0, 2.0, 2.0, 2.0};
  size_t a_index = 0;
  auto time_ms = [&](const Config& c) -> StatusOr<double> {
    return c["id"] == "a" ? a_samples[a_index++ % a_samples.size()] : b_samples[0];
  };
  StatusOr<AutotuneResult> result =
      AutotuneTimed({{{"id", "a"}}, {{"id", "b"}}}, time_ms, {/*warmup=*/0, /*repeats=*/5});
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->best, (Config{{"id", "a"}}));
  EXPECT_DOUBLE_EQ(result->best_ms, 1.0);

  // An even count averages the middle two.
  a_index = 0;
  result = AutotuneTimed({{{"id", "a"}}}, time_ms, {/*warmup=*/1, /*repeats=*/4});
  ASSERT_TRUE(result.ok());
  EXPECT_DOUBLE_EQ(result->best_ms, 1.0);  // samples 1, 1, 1, 100
}

TEST(AutotuneTest, PicksTheFastestWithRealSleeps) {
  SteadyClockTimer timer;
  auto run = [](const Config& c) {
    std::this_thread::sleep_for(std::chrono::milliseconds(c["sleep_ms"].get<int>()));
    return Status::Ok();
  };
  StatusOr<AutotuneResult> result =
      Autotune({{{"sleep_ms", 12}}, {{"sleep_ms", 2}}, {{"sleep_ms", 25}}}, run, timer, {1, 3});
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->best, (Config{{"sleep_ms", 2}}));
  EXPECT_GE(result->best_ms, 2.0);
  EXPECT_GE(result->timings_ms["{\"sleep_ms\":25}"].get<double>(), 25.0);
}

TEST(AutotuneTest, SkipsFailingCandidates) {
  FakeTimer timer;
  auto run = [&](const Config& c) -> Status {
    const std::string kind = c["kind"];
    if (kind == "status") return Status::ResourceExhausted("too much shared memory");
    if (kind == "throws") throw std::runtime_error("launch failed");
    if (kind == "throws_other") throw 42;
    timer.next_ms = kind == "fast" ? 1.0 : 3.0;
    return Status::Ok();
  };
  std::vector<Config> candidates = {{{"kind", "status"}},
                                    {{"kind", "slow"}},
                                    {{"kind", "throws"}},
                                    {{"kind", "fast"}},
                                    {{"kind", "throws_other"}}};
  StatusOr<AutotuneResult> result = Autotune(candidates, run, timer);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_EQ(result->best, (Config{{"kind", "fast"}}));
  EXPECT_EQ(result->timings_ms.size(), 2u);
  ASSERT_EQ(result->failures.size(), 3u);
  EXPECT_EQ(result->failures[0].first, (Config{{"kind", "status"}}));
  EXPECT_NE(result->failures[0].second.find("too much shared memory"), std::string::npos);
  EXPECT_NE(result->failures[1].second.find("launch failed"), std::string::npos);
  EXPECT_EQ(result->failures[2].first, (Config{{"kind", "throws_other"}}));
}

TEST(AutotuneTest, AllFailingIsAnErrorListingThem) {
  FakeTimer timer;
  auto run = [](const Config& c) { return Status::Internal("bad " + c["n"].dump()); };
  StatusOr<AutotuneResult> result = Autotune({{{"n", 1}}, {{"n", 2}}}, run, timer);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("{\"n\":1}"), std::string::npos);
  EXPECT_NE(result.status().message().find("bad 2"), std::string::npos);
}

TEST(AutotuneTest, TimerFailureFailsTheCandidate) {
  class BrokenTimer : public Timer {
   public:
    Status Start() override { return Status::Internal("no clock"); }
    StatusOr<double> StopMs() override { return 0.0; }
  } timer;
  StatusOr<AutotuneResult> result = Autotune(
      {{{"n", 1}}}, [](const Config&) { return Status::Ok(); }, timer);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("no clock"), std::string::npos);
}

TEST(AutotuneTest, RejectsBadArguments) {
  FakeTimer timer;
  auto run = [](const Config&) { return Status::Ok(); };
  EXPECT_EQ(Autotune({}, run, timer).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Autotune({{{"n", 1}}}, run, timer, {0, 0}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Autotune({{{"n", 1}}}, run, timer, {-1, 1}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Autotune({{{"n", 1}}}, nullptr, timer).status().code(), StatusCode::kInvalidArgument);
}

TEST(SteadyClockTimerTest, MeasuresElapsedTime) {
  SteadyClockTimer timer;
  EXPECT_FALSE(timer.StopMs().ok());  // not started
  ASSERT_TRUE(timer.Start().ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  StatusOr<double> ms = timer.StopMs();
  ASSERT_TRUE(ms.ok());
  EXPECT_GE(*ms, 5.0);
  EXPECT_LT(*ms, 5000.0);
}

}  // namespace
}  // namespace ejk
