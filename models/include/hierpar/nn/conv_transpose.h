// hierpar::nn::ConvTranspose2d: torch::nn::ConvTranspose2d's options, parameters ("weight"
// [in, out/groups, kH, kW] and "bias" [out]) and initialisation on hierpar::conv_transpose2d, so state dicts
// interchange with torch::nn::ConvTranspose2d. Only padding_mode zeros is supported (as in torch).
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/container/any_value.h>
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
  // Around existing tensors instead of new ones (hierpar::nn::converted builds on it, from a
  // torch::nn::ConvTranspose2d's): `weight` [in, out/groups, kH, kW] and `bias` [out] (undefined when !options.bias())
  // are registered as they are, neither copied nor initialised, requires_grad kept, so that every holder of them (an
  // optimizer, another module) sees this layer's updates and this layer theirs. clone() still gives a copy with
  // tensors of its own.
  ConvTranspose2dImpl(const torch::nn::ConvTranspose2dOptions& options, torch::Tensor weight, torch::Tensor bias);

  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  // output_size ([H, W] or [N, C, H, W]) picks among the output sizes a stride > 1 allows, like
  // torch::nn::ConvTranspose2d; it overrides options.output_padding.
  torch::Tensor forward(const torch::Tensor& input, const std::optional<at::IntArrayRef>& output_size = std::nullopt);

  // The output_padding that forward(input, output_size) uses.
  std::vector<int64_t> output_padding_for(const torch::Tensor& input,
                                          const std::optional<at::IntArrayRef>& output_size) const;

  torch::nn::ConvTranspose2dOptions options;
  torch::Tensor weight, bias;

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(std::optional<at::IntArrayRef>())})
};
TORCH_MODULE(ConvTranspose2d);

}  // namespace hierpar::nn
