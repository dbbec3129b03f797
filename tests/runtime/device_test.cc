#include "runtime/device.h"

#include <algorithm>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace ejk {
namespace {

TEST(DeviceTest, CpuFingerprintHasTheExpectedFields) {
  DeviceFingerprint fp = CpuFingerprint();
  EXPECT_EQ(fp.platform, "cpu");
  ASSERT_TRUE(fp.fields.is_object());
  ASSERT_TRUE(fp.fields.contains("model"));
  EXPECT_FALSE(fp.fields["model"].get<std::string>().empty());
  EXPECT_GE(fp.fields["logical_cores"].get<int64_t>(), 1);
  EXPECT_TRUE(fp.fields["isa"].is_array());
  EXPECT_TRUE(fp.fields["compiled_isa"].is_array());
}

TEST(DeviceTest, CpuFingerprintKeyIsStableAndCompact) {
  const std::string key = CpuFingerprint().Key();
  EXPECT_FALSE(key.empty());
  EXPECT_EQ(key.rfind("cpu|", 0), 0u) << key;
  EXPECT_EQ(CpuFingerprint().Key(), key);
  EXPECT_EQ(key.find('\n'), std::string::npos);
  EXPECT_NE(key.find("logical_cores="), std::string::npos);
}

TEST(DeviceTest, CompiledIsaIsListedInTheFingerprint) {
  const std::vector<std::string> compiled = CompiledCpuIsa();
  EXPECT_EQ(CpuFingerprint().fields["compiled_isa"].get<std::vector<std::string>>(), compiled);
#if defined(__AVX2__)
  EXPECT_NE(std::find(compiled.begin(), compiled.end(), "avx2"), compiled.end());
#endif
}

TEST(DeviceTest, KeyDependsOnlyOnContent) {
  DeviceFingerprint a{"cuda", {{"name", "GPU X"}, {"sm_count", 132}, {"tags", {"a", "b"}}}};
  DeviceFingerprint b{"cuda", {{"tags", {"a", "b"}}, {"sm_count", 132}, {"name", "GPU X"}}};
  EXPECT_EQ(a.Key(), b.Key());
  EXPECT_EQ(a.Key(), "cuda|name=GPU X|sm_count=132|tags=a+b");
  b.fields["sm_count"] = 114;
  EXPECT_NE(a.Key(), b.Key());
}

TEST(DeviceTest, CudaFingerprintWithoutCuda) {
#if !EJK_HAS_CUDA
  StatusOr<DeviceFingerprint> fp = CudaFingerprint(0);
  ASSERT_FALSE(fp.ok());
  EXPECT_EQ(fp.status().code(), StatusCode::kUnimplemented);
#else
  StatusOr<DeviceFingerprint> bad = CudaFingerprint(-1);
  EXPECT_FALSE(bad.ok());
#endif
}

}  // namespace
}  // namespace ejk
