#pragma once
// GPU utilisation as the driver reports it (NVML's "percent of time a kernel was running" over its last sample
// period), sampled on a thread while a workload runs: what seed 004's GpuUsageMaximize optimises. NVML is loaded
// at run time (libnvidia-ml.so.1, part of the driver), so nothing links against it.
#include <c10/core/Device.h>

#include <condition_variable>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace hierpar::strategy {

class UtilizationSampler {
 public:
  // Starts sampling `device` (a CUDA device) every `period`; without NVML or a CUDA device, samples nothing.
  explicit UtilizationSampler(const c10::Device& device,
                              std::chrono::milliseconds period = std::chrono::milliseconds(100));
  ~UtilizationSampler();
  UtilizationSampler(const UtilizationSampler&) = delete;
  UtilizationSampler& operator=(const UtilizationSampler&) = delete;

  // Stops sampling; the samples taken (percent), in order.
  std::vector<double> stop();

  // Whether this process can sample `device` (NVML loaded and the device found in it).
  static bool available(const c10::Device& device);

 private:
  void* handle_ = nullptr;  // the NVML device
  std::chrono::milliseconds period_;
  bool running_ = false;  // guarded by mutex_
  std::mutex mutex_;
  std::condition_variable woken_;
  std::vector<double> samples_;
  std::thread thread_;
};

// The seed's statistic: the mean of the top half of the samples (the busiest half, so that start-up and the
// gaps between measured steps do not count); nullopt without samples.
std::optional<double> top_half_mean(std::vector<double> samples);

}  // namespace hierpar::strategy
