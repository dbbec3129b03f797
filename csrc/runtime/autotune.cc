#include "runtime/autotune.h"

#include <algorithm>
#include <exception>

namespace ejk {
namespace {

std::string ConfigText(const Config& config) {
  return config.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Exceptions from caller code must not escape autotuning; they fail the candidate instead.
StatusOr<double> TimeOnce(const std::function<StatusOr<double>(const Config&)>& time_ms,
                          const Config& config) {
  try {
    return time_ms(config);
  } catch (const std::exception& e) {
    return Status::Internal(std::string("exception: ") + e.what());
  } catch (...) {
    return Status::Internal("unknown exception");
  }
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 == 1 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

}  // namespace

Timer::~Timer() = default;

Status SteadyClockTimer::Start() {
  start_ = std::chrono::steady_clock::now();
  started_ = true;
  return Status::Ok();
}

StatusOr<double> SteadyClockTimer::StopMs() {
  if (!started_) return Status::FailedPrecondition("timer stopped before it was started");
  started_ = false;
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_)
      .count();
}

#if EJK_HAS_CUDA

namespace {
Status CudaStatus(const char* what, cudaError_t err) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                          cudaGetErrorString(err) + ")");
}
}  // namespace

CudaEventTimer::CudaEventTimer(cudaStream_t stream) : stream_(stream) {
  init_status_ = CudaStatus("cudaEventCreate", cudaEventCreate(&start_));
  if (init_status_.ok()) init_status_ = CudaStatus("cudaEventCreate", cudaEventCreate(&stop_));
}

CudaEventTimer::~CudaEventTimer() {
  if (start_ != nullptr) cudaEventDestroy(start_);
  if (stop_ != nullptr) cudaEventDestroy(stop_);
}

Status CudaEventTimer::Start() {
  EJK_RETURN_IF_ERROR(init_status_);
  EJK_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(start_, stream_)));
  started_ = true;
  return Status::Ok();
}

StatusOr<double> CudaEventTimer::StopMs() {
  if (!started_) return Status::FailedPrecondition("timer stopped before it was started");
  started_ = false;
  EJK_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(stop_, stream_)));
  EJK_RETURN_IF_ERROR(CudaStatus("cudaEventSynchronize", cudaEventSynchronize(stop_)));
  float ms = 0.0f;
  EJK_RETURN_IF_ERROR(CudaStatus("cudaEventElapsedTime", cudaEventElapsedTime(&ms, start_, stop_)));
  return static_cast<double>(ms);
}

#endif

StatusOr<AutotuneResult> AutotuneTimed(
    const std::vector<Config>& candidates,
    const std::function<StatusOr<double>(const Config&)>& time_ms, const AutotuneOptions& options) {
  if (candidates.empty()) return Status::InvalidArgument("autotune: no candidate configs");
  if (!time_ms) return Status::InvalidArgument("autotune: no way to time a candidate");
  if (options.warmup < 0 || options.repeats < 1) {
    return Status::InvalidArgument("autotune: warmup >= 0 and repeats >= 1 required, got warmup=" +
                                   std::to_string(options.warmup) +
                                   " repeats=" + std::to_string(options.repeats));
  }
  AutotuneResult result;
  result.timings_ms = nlohmann::json::object();
  bool have_best = false;
  for (const Config& config : candidates) {
    Status failure;
    std::vector<double> samples;
    for (int i = 0; i < options.warmup + options.repeats && failure.ok(); ++i) {
      StatusOr<double> ms = TimeOnce(time_ms, config);
      if (!ms.ok()) {
        failure = ms.status();
      } else if (i >= options.warmup) {
        samples.push_back(*ms);
      }
    }
    if (!failure.ok()) {
      result.failures.emplace_back(config, failure.ToString());
      continue;
    }
    const double median = Median(std::move(samples));
    result.timings_ms[ConfigText(config)] = median;
    if (!have_best || median < result.best_ms) {
      result.best = config;
      result.best_ms = median;
      have_best = true;
    }
  }
  if (!have_best) {
    std::string message = "autotune: every candidate failed:";
    for (const auto& [config, why] : result.failures)
      message += " " + ConfigText(config) + ": " + why + ";";
    message.pop_back();
    return Status::Internal(message);
  }
  return result;
}

StatusOr<AutotuneResult> Autotune(const std::vector<Config>& candidates,
                                  const std::function<Status(const Config&)>& run, Timer& timer,
                                  const AutotuneOptions& options) {
  if (!run) return Status::InvalidArgument("autotune: no run function");
  auto time_ms = [&run, &timer](const Config& config) -> StatusOr<double> {
    EJK_RETURN_IF_ERROR(timer.Start());
    Status status = run(config);
    // Stop even when the run failed, so the timer is not left started.
    StatusOr<double> ms = timer.StopMs();
    EJK_RETURN_IF_ERROR(status);
    return ms;
  };
  return AutotuneTimed(candidates, time_ms, options);
}

}  // namespace ejk
