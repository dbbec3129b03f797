// Autotuning: times candidate configs on real inputs and picks the fastest.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/status.h"

#if EJK_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ejk {

using Config = nlohmann::json;

class Timer {
 public:
  virtual ~Timer();
  virtual Status Start() = 0;
  // Milliseconds since the last Start().
  virtual StatusOr<double> StopMs() = 0;
};

// Host wall time; right for synchronous (CPU) kernels.
class SteadyClockTimer : public Timer {
 public:
  Status Start() override;
  StatusOr<double> StopMs() override;

 private:
  bool started_ = false;
  std::chrono::steady_clock::time_point start_;
};

#if EJK_HAS_CUDA
// Device time between two events recorded on `stream`; StopMs() waits for the stop event.
class CudaEventTimer : public Timer {
 public:
  explicit CudaEventTimer(cudaStream_t stream);
  ~CudaEventTimer() override;
  CudaEventTimer(const CudaEventTimer&) = delete;
  CudaEventTimer& operator=(const CudaEventTimer&) = delete;

  Status Start() override;
  StatusOr<double> StopMs() override;

 private:
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
  Status init_status_;
  bool started_ = false;
};
#endif

struct AutotuneOptions {
  int warmup = 2;   // untimed runs per candidate
  int repeats = 5;  // timed runs per candidate; the median counts
};

struct AutotuneResult {
  Config best;
  double best_ms = 0.0;
  nlohmann::json timings_ms;  // compact config dump -> median ms, for every candidate that ran
  std::vector<std::pair<Config, std::string>> failures;  // candidate -> why it was skipped
};

// Runs each candidate `warmup` times, then `repeats` times between timer.Start() and
// timer.StopMs(). A candidate whose run or timing fails (error Status or exception) is
// skipped and recorded; ties go to the earlier candidate. Fails when no candidate runs.
StatusOr<AutotuneResult> Autotune(const std::vector<Config>& candidates,
                                  const std::function<Status(const Config&)>& run, Timer& timer,
                                  const AutotuneOptions& options = {});

// The same with a caller-provided measurement: `time_ms` makes one timed run of a config.
StatusOr<AutotuneResult> AutotuneTimed(
    const std::vector<Config>& candidates,
    const std::function<StatusOr<double>(const Config&)>& time_ms,
    const AutotuneOptions& options = {});

}  // namespace ejk
