#include "hierpar/nn/conv2d.h"

#include "hierpar/ops.h"
#include "hierpar/routing.h"
#include "conv_module.h"

#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/pad.h>

#include <array>
#include <ostream>

namespace hierpar::nn {
namespace {

// Per spatial dim (H, W): the padding before and after, as torch::nn::Conv2d resolves options.padding().
std::array<std::array<int64_t, 2>, 2> padding_of(const torch::nn::Conv2dOptions& o) {
  std::array<std::array<int64_t, 2>, 2> result{};
  for (int i = 0; i < 2; ++i) {
    if (const auto* explicit_padding = std::get_if<torch::ExpandingArray<2>>(&o.padding())) {
      result[i] = {(**explicit_padding)[i], (**explicit_padding)[i]};
    } else if (std::holds_alternative<torch::enumtype::kSame>(o.padding())) {
      const int64_t total = (*o.dilation())[i] * ((*o.kernel_size())[i] - 1);
      result[i] = {total / 2, total - total / 2};
    }  // kValid: none
  }
  return result;
}

}  // namespace

Conv2dImpl::Conv2dImpl(const torch::nn::Conv2dOptions& options_) : options(options_) { reset(); }

void Conv2dImpl::reset() {
  detail::check_conv_channels("hierpar::nn::Conv2d", options.in_channels(), options.out_channels(), options.groups());
  if (std::holds_alternative<torch::enumtype::kSame>(options.padding())) {
    TORCH_CHECK((*options.stride())[0] == 1 && (*options.stride())[1] == 1,
                "hierpar::nn::Conv2d: padding kSame is not supported for strided convolutions (as in torch::nn)");
  }
  detail::init_conv_parameters(*this, options, options.out_channels(), options.in_channels() / options.groups(),
                               weight, bias);
}

void Conv2dImpl::reset_parameters() { detail::reset_conv_parameters(weight, bias); }

void Conv2dImpl::pretty_print(std::ostream& stream) const {
  detail::print_conv_start(stream, "hierpar::nn::Conv2d", options);
  if (const auto* explicit_padding = std::get_if<torch::ExpandingArray<2>>(&options.padding())) {
    if (!detail::both(*explicit_padding, 0)) stream << ", padding=" << *explicit_padding;
  } else {
    stream << ", padding=" << (std::holds_alternative<torch::enumtype::kSame>(options.padding()) ? "'same'" : "'valid'");
  }
  if (!detail::both(options.dilation(), 1)) stream << ", dilation=" << options.dilation();
  if (options.groups() != 1) stream << ", groups=" << options.groups();
  if (!options.bias()) stream << ", bias=" << std::boolalpha << false;
  if (!std::holds_alternative<torch::enumtype::kZeros>(options.padding_mode())) {
    stream << ", padding_mode=" << torch::enumtype::get_enum_name(options.padding_mode());
  }
  stream << ")";
}

torch::Tensor Conv2dImpl::forward(const torch::Tensor& input) { return convolve(input, std::nullopt); }

torch::Tensor Conv2dImpl::forward_with_leaky_relu(const torch::Tensor& input, double negative_slope) {
  return convolve(input, negative_slope);
}

torch::Tensor Conv2dImpl::convolve(const torch::Tensor& input, std::optional<double> leaky_relu_slope) {
  const auto pad = padding_of(options);
  const std::optional<at::Tensor> b = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  auto conv = [&](const torch::Tensor& x, at::IntArrayRef padding) {
    return ops::conv2d_layer(x, weight, b, *options.stride(), padding, *options.dilation(), options.groups(),
                             leaky_relu_slope);
  };
  if (!std::holds_alternative<torch::enumtype::kZeros>(options.padding_mode())) {
    // reflect / replicate / circular: pad the input, then convolve without padding (torch::nn's order).
    const char* mode = std::holds_alternative<torch::enumtype::kReflect>(options.padding_mode())     ? "reflect"
                       : std::holds_alternative<torch::enumtype::kReplicate>(options.padding_mode()) ? "replicate"
                                                                                                      : "circular";
    return conv(at::pad(input, {pad[1][0], pad[1][1], pad[0][0], pad[0][1]}, mode), {0, 0});
  }
  if (pad[0][0] == pad[0][1] && pad[1][0] == pad[1][1]) return conv(input, {pad[0][0], pad[1][0]});
  // kSame with an odd total: the extra row/column goes after (as at::conv2d's "same"), zero-padded here.
  return conv(at::constant_pad_nd(input, {0, pad[1][1] - pad[1][0], 0, pad[0][1] - pad[0][0]}, 0),
              {pad[0][0], pad[1][0]});
}

}  // namespace hierpar::nn
