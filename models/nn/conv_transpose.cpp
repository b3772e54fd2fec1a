#include "hierpar/nn/conv_transpose.h"

#include "hierpar/ops.h"
#include "hierpar/routing.h"
#include "conv_module.h"

#include <ostream>

namespace hierpar::nn {

ConvTranspose2dImpl::ConvTranspose2dImpl(const torch::nn::ConvTranspose2dOptions& options_)
    : options(options_) {
  reset();
}

void ConvTranspose2dImpl::reset() {
  TORCH_CHECK(std::holds_alternative<torch::enumtype::kZeros>(options.padding_mode()),
              "hierpar::nn::ConvTranspose2d: only padding_mode zeros is supported (as in torch::nn), got ",
              torch::enumtype::get_enum_name(options.padding_mode()));
  detail::check_conv_channels("hierpar::nn::ConvTranspose2d", options.in_channels(), options.out_channels(),
                              options.groups());
  detail::init_conv_parameters(*this, options, options.in_channels(), options.out_channels() / options.groups(),
                               weight, bias);
}

void ConvTranspose2dImpl::reset_parameters() { detail::reset_conv_parameters(weight, bias); }

void ConvTranspose2dImpl::pretty_print(std::ostream& stream) const {
  detail::print_conv_start(stream, "hierpar::nn::ConvTranspose2d", options);
  if (!detail::both(options.padding(), 0)) stream << ", padding=" << options.padding();
  if (!detail::both(options.dilation(), 1)) stream << ", dilation=" << options.dilation();
  if (!detail::both(options.output_padding(), 0)) stream << ", output_padding=" << options.output_padding();
  if (options.groups() != 1) stream << ", groups=" << options.groups();
  if (!options.bias()) stream << ", bias=" << std::boolalpha << false;
  stream << ")";
}

std::vector<int64_t> ConvTranspose2dImpl::output_padding_for(const torch::Tensor& input,
                                                             const std::optional<at::IntArrayRef>& output_size) const {
  if (!output_size.has_value()) return at::IntArrayRef(options.output_padding()).vec();
  TORCH_CHECK(input.dim() == 3 || input.dim() == 4,
              "hierpar::nn::ConvTranspose2d: input must be 3-d or 4-d, got ", input.dim(), "-d");
  at::IntArrayRef size = *output_size;
  if (size.size() == 4) size = size.slice(2);
  TORCH_CHECK(size.size() == 2, "hierpar::nn::ConvTranspose2d: output_size must have 2 or 4 elements (got ",
              output_size->size(), ")");
  const auto& s = *options.stride();
  const auto& p = *options.padding();
  const auto& k = *options.kernel_size();
  const auto& d = *options.dilation();
  std::vector<int64_t> min_sizes(2), max_sizes(2), result(2);
  for (int i = 0; i < 2; ++i) {
    // Dilation counts, as in Python's torch.nn.ConvTranspose2d (libtorch's C++ module omits it; the two
    // agree for dilation 1).
    min_sizes[i] = (input.size(input.dim() - 2 + i) - 1) * s[i] - 2 * p[i] + d[i] * (k[i] - 1) + 1;
    max_sizes[i] = min_sizes[i] + s[i] - 1;
  }
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK(size[i] >= min_sizes[i] && size[i] <= max_sizes[i],
                "hierpar::nn::ConvTranspose2d: requested an output size of ", size, ", but valid sizes range from ",
                at::IntArrayRef(min_sizes), " to ", at::IntArrayRef(max_sizes), " (for an input of ",
                input.sizes().slice(input.dim() - 2), ")");
    result[i] = size[i] - min_sizes[i];
  }
  return result;
}

torch::Tensor ConvTranspose2dImpl::forward(const torch::Tensor& input,
                                           const std::optional<at::IntArrayRef>& output_size) {
  const auto output_padding = output_padding_for(input, output_size);
  const std::optional<at::Tensor> b = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  return ops::conv_transpose2d_layer(input, weight, b, *options.stride(), *options.padding(), output_padding,
                                     options.groups(), *options.dilation());
}

}  // namespace hierpar::nn
