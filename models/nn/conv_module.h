// What hierpar::nn::Conv2d and ConvTranspose2d share as torch::nn's modules: the argument checks, the parameters
// (registered and initialised as torch::nn's, so that state dicts interchange and a seed draws the same values)
// and the repr's start. Private to the layers.
#pragma once

#include <torch/nn/init.h>
#include <torch/nn/module.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <tuple>

namespace hierpar::nn::detail {

// `name`: the module's, for the messages.
inline void check_conv_channels(const std::string& name, int64_t in_channels, int64_t out_channels, int64_t groups) {
  TORCH_CHECK(in_channels > 0 && out_channels > 0, name, ": in_channels and out_channels must be positive, got ",
              in_channels, " and ", out_channels);
  TORCH_CHECK(groups > 0, name, ": groups must be positive, got ", groups);
  TORCH_CHECK(in_channels % groups == 0, name, ": in_channels must be divisible by groups");
  TORCH_CHECK(out_channels % groups == 0, name, ": out_channels must be divisible by groups");
}

// torch::nn's initialisation: kaiming_uniform(a = sqrt(5)) and a bias from U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
// fan_in being weight.size(1) * kH * kW (for a transposed weight too, as in torch::nn).
inline void reset_conv_parameters(torch::Tensor& weight, torch::Tensor& bias) {
  torch::nn::init::kaiming_uniform_(weight, /*a=*/std::sqrt(5.0));
  if (bias.defined()) {
    const auto fan_in = std::get<0>(torch::nn::init::_calculate_fan_in_and_fan_out(weight));
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

// Registers "weight" [d0, d1, kH, kW] and "bias" [out_channels] (undefined without one; Options: the module's),
// initialised as above.
template <typename Options>
void init_conv_parameters(torch::nn::Module& module, const Options& options, int64_t d0, int64_t d1,
                          torch::Tensor& weight, torch::Tensor& bias) {
  const auto& k = *options.kernel_size();
  weight = module.register_parameter("weight", torch::empty({d0, d1, k[0], k[1]}));
  if (options.bias()) {
    bias = module.register_parameter("bias", torch::empty({options.out_channels()}));
  } else {
    bias = module.register_parameter("bias", torch::Tensor(), /*requires_grad=*/false);
  }
  reset_conv_parameters(weight, bias);
}

// Whether both values of a pair are v (the repr leaves such defaults out, as torch's does).
inline bool both(const torch::ExpandingArray<2>& pair, int64_t v) { return (*pair)[0] == v && (*pair)[1] == v; }

// "name(in_channels, out_channels, kernel_size=..., stride=...", the repr's start (Options: the module's).
template <typename Options>
void print_conv_start(std::ostream& stream, const char* name, const Options& options) {
  stream << name << "(" << options.in_channels() << ", " << options.out_channels()
         << ", kernel_size=" << options.kernel_size() << ", stride=" << options.stride();
}

}  // namespace hierpar::nn::detail
