// hierpar::nn::MaxPool2d: torch::nn::MaxPool2d's options and behaviour on hierpar::max_pool2d
// (uint8 window indices, gather backward).
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/options/pooling.h>
#include <torch/nn/pimpl.h>

namespace hierpar::nn {

class MaxPool2dImpl : public torch::nn::Cloneable<MaxPool2dImpl> {
 public:
  explicit MaxPool2dImpl(const torch::nn::MaxPool2dOptions& options);
  MaxPool2dImpl(torch::ExpandingArray<2> kernel_size) : MaxPool2dImpl(torch::nn::MaxPool2dOptions(kernel_size)) {}

  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  torch::Tensor forward(const torch::Tensor& input);
  // forward(relu(input)) in one kernel, values and gradients alike (max commutes with ReLU): no ReLU output is
  // written or kept, and no ReLU kernel runs forward or backward.
  torch::Tensor forward_relu(const torch::Tensor& input);

  torch::nn::MaxPool2dOptions options;
};
TORCH_MODULE(MaxPool2d);

}  // namespace hierpar::nn
