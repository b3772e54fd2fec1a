#include "hierpar/strategy/gpu_utilization.h"

#include <algorithm>
#include <numeric>
#include <optional>

#include <dlfcn.h>

#ifdef HIERPAR_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace hierpar::strategy {
namespace {

// The few NVML entry points used, declared here (the driver's C ABI; no nvml.h is needed to build).
struct Nvml {
  using Device = void*;
  struct Utilization {
    unsigned int gpu, memory;
  };
  int (*init)() = nullptr;
  int (*by_pci_bus_id)(const char*, Device*) = nullptr;
  int (*utilization)(Device, Utilization*) = nullptr;

  static const Nvml* get() {
    static const std::optional<Nvml> loaded = []() -> std::optional<Nvml> {
      void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
      if (lib == nullptr) return std::nullopt;
      Nvml nvml;
      nvml.init = reinterpret_cast<int (*)()>(::dlsym(lib, "nvmlInit_v2"));
      nvml.by_pci_bus_id = reinterpret_cast<int (*)(const char*, Device*)>(::dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
      nvml.utilization = reinterpret_cast<int (*)(Device, Utilization*)>(::dlsym(lib, "nvmlDeviceGetUtilizationRates"));
      if (nvml.init == nullptr || nvml.by_pci_bus_id == nullptr || nvml.utilization == nullptr || nvml.init() != 0)
        return std::nullopt;
      return nvml;
    }();
    return loaded ? &*loaded : nullptr;
  }
};

// NVML numbers devices its own way: the CUDA device is found by its PCI bus id.
void* nvml_device(const c10::Device& device) {
#ifdef HIERPAR_WITH_CUDA
  const Nvml* nvml = Nvml::get();
  if (nvml == nullptr || !device.is_cuda()) return nullptr;
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, device.has_index() ? device.index() : 0) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  Nvml::Device handle = nullptr;
  return nvml->by_pci_bus_id(bus_id, &handle) == 0 ? handle : nullptr;
#else
  (void)device;
  return nullptr;
#endif
}

}  // namespace

bool UtilizationSampler::available(const c10::Device& device) { return nvml_device(device) != nullptr; }

UtilizationSampler::UtilizationSampler(const c10::Device& device, std::chrono::milliseconds period)
    : handle_(nvml_device(device)), period_(period) {
  if (handle_ == nullptr) return;
  running_ = true;
  thread_ = std::thread([this] {
    const Nvml* nvml = Nvml::get();
    std::unique_lock<std::mutex> lock(mutex_);
    while (running_) {
      Nvml::Utilization u{};
      if (nvml->utilization(handle_, &u) == 0) samples_.push_back(u.gpu);
      // Woken by stop(): a sleep would hold stop() up to a period (tune's trials pay it at every batch).
      woken_.wait_for(lock, period_, [this] { return !running_; });
    }
  });
}

UtilizationSampler::~UtilizationSampler() { stop(); }

std::vector<double> UtilizationSampler::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = false;
  }
  woken_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  return samples_;
}

std::optional<double> top_half_mean(std::vector<double> samples) {
  if (samples.empty()) return std::nullopt;
  std::sort(samples.begin(), samples.end(), std::greater<>());
  const size_t half = (samples.size() + 1) / 2;
  return std::accumulate(samples.begin(), samples.begin() + static_cast<std::ptrdiff_t>(half), 0.0) /
         static_cast<double>(half);
}

}  // namespace hierpar::strategy
