#include "common/shared_flags.h"

#include "common/cli.h"

#include <torch/cuda.h>

namespace hierpar::examples {

torch::Device parse_device(const std::string& name) {
  if (name.empty()) return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  if (name == "cpu") return torch::kCPU;
  if (name == "cuda" || name.rfind("cuda:", 0) == 0) {
    int64_t index = 0;
    if (name.size() > 5) {
      const std::string digits = name.substr(5);
      if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 3)
        throw FlagError("--device: expected cpu, cuda or cuda:N, got '" + name + "'");
      index = std::stoll(digits);
    }
    const int64_t count = torch::cuda::device_count();
    if (index >= count)
      throw FlagError("--device " + name + ": this machine has " + std::to_string(count) + " CUDA device(s)");
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  throw FlagError("--device: expected cpu, cuda or cuda:N, got '" + name + "'");
}

LayerSet parse_layers(const std::string& name) {
  if (name != "stock" && name != "hierpar") throw FlagError("--layers: expected stock or hierpar, got '" + name + "'");
  return hierpar::parse_layer_set(name);
}

}  // namespace hierpar::examples
