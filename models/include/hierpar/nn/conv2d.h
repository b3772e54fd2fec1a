// hierpar::nn::Conv2d: torch::nn::Conv2d's options, parameters ("weight" [out, in/groups, kH, kW] and "bias" [out])
// and initialisation on hierpar::conv2d, so state dicts interchange with torch::nn::Conv2d. Padding as in torch:
// explicit, kValid or kSame (stride 1; an odd total pads the right/bottom one more), every padding_mode.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/options/conv.h>
#include <torch/nn/pimpl.h>

#include <optional>

namespace hierpar::nn {

class Conv2dImpl : public torch::nn::Cloneable<Conv2dImpl> {
 public:
  explicit Conv2dImpl(const torch::nn::Conv2dOptions& options);
  Conv2dImpl(int64_t in_channels, int64_t out_channels, torch::ExpandingArray<2> kernel_size)
      : Conv2dImpl(torch::nn::Conv2dOptions(in_channels, out_channels, kernel_size)) {}
  // Around existing tensors instead of new ones (hierpar::nn::converted builds on it, from a torch::nn::Conv2d's):
  // `weight` [out, in/groups, kH, kW] and `bias` [out] (undefined when !options.bias()) are registered as they are,
  // neither copied nor initialised, requires_grad kept, so that every holder of them (an optimizer, another module)
  // sees this layer's updates and this layer theirs. clone() still gives a copy with tensors of its own.
  Conv2dImpl(const torch::nn::Conv2dOptions& options, torch::Tensor weight, torch::Tensor bias);

  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  torch::Tensor forward(const torch::Tensor& input);
  // leaky_relu(forward(input), negative_slope) (negative_slope >= 0), the activation applied as the kernels store
  // where they can (C_in <= 4, kernel 4, stride 2, padding 1, no bias, on CUDA): a discriminator's first layer.
  torch::Tensor forward_with_leaky_relu(const torch::Tensor& input, double negative_slope);

  torch::nn::Conv2dOptions options;
  torch::Tensor weight, bias;

 private:
  torch::Tensor convolve(const torch::Tensor& input, std::optional<double> leaky_relu_slope);
};
TORCH_MODULE(Conv2d);

}  // namespace hierpar::nn
