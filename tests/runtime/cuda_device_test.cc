#include "runtime/cuda_device.h"

#include <string>

#include <gtest/gtest.h>

namespace ejk {
namespace {

CudaDeviceInfo Device(int major, int minor, int shared_memory_per_block, bool has_code, int code_arch) {
  CudaDeviceInfo d;
  d.major = major;
  d.minor = minor;
  d.shared_memory_per_block = shared_memory_per_block;
  d.has_code = has_code;
  d.code_arch = has_code ? code_arch : 0;
  return d;
}

const CudaDeviceInfo kH100 = Device(9, 0, 232448, true, 90);
const CudaDeviceInfo kA100 = Device(8, 0, 166912, true, 80);
const CudaDeviceInfo kRtx4090 = Device(8, 9, 101376, true, 80);
const CudaDeviceInfo kB200FromPtx = Device(10, 0, 232448, true, 80);  // compute_80 PTX, JIT-compiled

TEST(CudaDeviceTest, SupportedDevicesHaveNoReason) {
  for (const CudaDeviceInfo& d : {kH100, kA100, kRtx4090, kB200FromPtx}) {
    EXPECT_EQ(CudaDeviceUnsupportedReason(d, "80,90a"), "") << d.major << "." << d.minor;
  }
}

TEST(CudaDeviceTest, OlderGpusAndMissingCodeAreNamed) {
  const std::string turing = CudaDeviceUnsupportedReason(Device(7, 5, 65536, true, 75), "80,90a");
  EXPECT_NE(turing.find("8.0 or newer"), std::string::npos) << turing;
  EXPECT_NE(turing.find("7.5"), std::string::npos) << turing;

  // A Hopper-only build on an A100: the reason names the device and what was built.
  const std::string no_code = CudaDeviceUnsupportedReason(Device(8, 0, 166912, false, 0), "90a");
  EXPECT_NE(no_code.find("no code for compute capability 8.0"), std::string::npos) << no_code;
  EXPECT_NE(no_code.find("built for 90a"), std::string::npos) << no_code;

  EXPECT_NE(CudaDeviceUnsupportedReason(CudaDeviceInfo{}, "80").find("cannot be read"), std::string::npos);
}

TEST(CudaDeviceTest, HopperKernelsNeedSm90aCodeOnAnSm90Device) {
  EXPECT_NE(HopperUnsupportedReason(kA100, "80,90a").find("needs compute capability 9.0, got 8.0"),
            std::string::npos);
  EXPECT_NE(HopperUnsupportedReason(kB200FromPtx, "80,90a").find("got 10.0"), std::string::npos);
  // An H100 running code compiled for compute_80 (a build without 90a).
  const std::string from_sm80 = HopperUnsupportedReason(Device(9, 0, 232448, true, 80), "80");
  EXPECT_NE(from_sm80.find("no sm_90a code (built for 80)"), std::string::npos) << from_sm80;
#if EJK_CUDA_SM90A
  EXPECT_EQ(HopperUnsupportedReason(kH100, "80,90a"), "");
#else
  EXPECT_NE(HopperUnsupportedReason(kH100, "").find("no sm_90a code (built for no CUDA architecture)"),
            std::string::npos);
#endif
}

TEST(CudaDeviceTest, ProgrammaticLaunchNeedsCodeThatWaits) {
  EXPECT_TRUE(ProgrammaticLaunchRuns(kH100));
  EXPECT_FALSE(ProgrammaticLaunchRuns(kA100));
  // Newer than sm_90 but running compute_80 code: the kernels hold no griddepcontrol.wait.
  EXPECT_FALSE(ProgrammaticLaunchRuns(kB200FromPtx));
  EXPECT_FALSE(ProgrammaticLaunchRuns(Device(9, 0, 232448, true, 80)));
}

TEST(CudaDeviceTest, SharedMemoryBeyondTheDevicesLimitIsNamed) {
  EXPECT_EQ(SharedMemoryUnsupportedReason(kA100, 114688, "kernel"), "");
  EXPECT_EQ(SharedMemoryUnsupportedReason(kRtx4090, 101376, "kernel"), "");
  const std::string reason = SharedMemoryUnsupportedReason(kRtx4090, 114688, "the backward at head_dim 128");
  EXPECT_EQ(reason,
            "the backward at head_dim 128 needs 114688 bytes of shared memory per block, this GPU (8.9) gives 101376");
}

}  // namespace
}  // namespace ejk
