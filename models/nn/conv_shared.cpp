// hierpar::nn::Conv2d's and ConvTranspose2d's constructors around existing tensors (what hierpar::nn::converted
// builds on): the options checked as reset() checks them, the tensors' shapes checked against the options, and the
// tensors registered under reset()'s names without a copy or an initialisation.
#include "hierpar/nn/conv2d.h"
#include "hierpar/nn/conv_transpose.h"

#include "conv_module.h"

#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace hierpar::nn {
namespace {

// Registers `weight` (expected sizes `weight_sizes`) and `bias` ([out_channels], present exactly when `has_bias`) on
// `module` as reset() would register new ones: same names, same order, requires_grad as the tensors have it.
void register_given(torch::nn::Module& module, const std::string& layer, std::vector<int64_t> weight_sizes,
                    bool has_bias, int64_t out_channels, torch::Tensor& weight, torch::Tensor& bias) {
  TORCH_CHECK(weight.defined(), layer, ": weight: expected a tensor, got none");
  TORCH_CHECK(weight.sizes() == at::IntArrayRef(weight_sizes), layer, ": weight: expected sizes ",
              at::IntArrayRef(weight_sizes), " (from the options), got ", weight.sizes());
  if (has_bias) {
    TORCH_CHECK(bias.defined() && bias.dim() == 1 && bias.size(0) == out_channels, layer, ": bias: expected [",
                out_channels, "] (options.bias() is true), got ", bias.defined() ? bias.sizes() : at::IntArrayRef{});
  } else {
    TORCH_CHECK(!bias.defined(), layer, ": bias: expected none (options.bias() is false), got a tensor");
  }
  weight = module.register_parameter("weight", weight, weight.requires_grad());
  bias = module.register_parameter("bias", bias, bias.defined() && bias.requires_grad());
}

}  // namespace

Conv2dImpl::Conv2dImpl(const torch::nn::Conv2dOptions& options_, torch::Tensor weight_, torch::Tensor bias_)
    : options(options_), weight(std::move(weight_)), bias(std::move(bias_)) {
  detail::check_conv_channels("hierpar::nn::Conv2d", options.in_channels(), options.out_channels(), options.groups());
  if (std::holds_alternative<torch::enumtype::kSame>(options.padding())) {
    TORCH_CHECK((*options.stride())[0] == 1 && (*options.stride())[1] == 1,
                "hierpar::nn::Conv2d: padding kSame is not supported for strided convolutions (as in torch::nn)");
  }
  const auto& k = *options.kernel_size();
  register_given(*this, "hierpar::nn::Conv2d",
                 {options.out_channels(), options.in_channels() / options.groups(), k[0], k[1]}, options.bias(),
                 options.out_channels(), weight, bias);
}

ConvTranspose2dImpl::ConvTranspose2dImpl(const torch::nn::ConvTranspose2dOptions& options_, torch::Tensor weight_,
                                         torch::Tensor bias_)
    : options(options_), weight(std::move(weight_)), bias(std::move(bias_)) {
  TORCH_CHECK(std::holds_alternative<torch::enumtype::kZeros>(options.padding_mode()),
              "hierpar::nn::ConvTranspose2d: only padding_mode zeros is supported (as in torch::nn), got ",
              torch::enumtype::get_enum_name(options.padding_mode()));
  detail::check_conv_channels("hierpar::nn::ConvTranspose2d", options.in_channels(), options.out_channels(),
                              options.groups());
  const auto& k = *options.kernel_size();
  register_given(*this, "hierpar::nn::ConvTranspose2d",
                 {options.in_channels(), options.out_channels() / options.groups(), k[0], k[1]}, options.bias(),
                 options.out_channels(), weight, bias);
}

}  // namespace hierpar::nn
