// hierpar::nn::ConvTranspose2d: torch::nn::ConvTranspose2d's options, parameters and initialisation on
// hierpar::conv_transpose2d.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/options/conv.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <vector>

namespace hierpar::nn {

class ConvTranspose2dImpl : public torch::nn::Cloneable<ConvTranspose2dImpl> {
 public:
  explicit ConvTranspose2dImpl(const torch::nn::ConvTranspose2dOptions& options);
  ConvTranspose2dImpl(int64_t in_channels, int64_t out_channels, torch::ExpandingArray<2> kernel_size)
      : ConvTranspose2dImpl(torch::nn::ConvTranspose2dOptions(in_channels, out_channels, kernel_size)) {}

  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  // output_size picks among the output sizes a stride > 1 allows, like torch::nn::ConvTranspose2d.
  torch::Tensor forward(const torch::Tensor& input, const std::optional<at::IntArrayRef>& output_size = std::nullopt);

  torch::nn::ConvTranspose2dOptions options;
  torch::Tensor weight, bias;
};
TORCH_MODULE(ConvTranspose2d);

}  // namespace hierpar::nn
