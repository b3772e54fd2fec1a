// Meta kernels of hierpar::conv2d and its backward: the same checks and output shapes/layouts as the CPU and
// CUDA kernels, no data.
#include "common.h"
#include "conv2d_shape.h"
#include "meta/conv_gradients.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace hierpar::detail {
namespace {

at::Tensor conv2d_meta(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                       std::optional<double> leaky_relu_slope) {
  const auto dual = check_conv2d(input, weight, bias, stride, padding, dilation, groups, leaky_relu_slope);
  const bool unbatched = input.dim() == 3;
  const auto layout = conv2d_output_layout(unbatched ? input.unsqueeze(0) : input, weight);
  at::Tensor out =
      at::empty({dual.batch, dual.in_channels, dual.in_h, dual.in_w}, input.options().memory_format(layout));
  return unbatched ? out.squeeze(0) : out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_meta(const at::Tensor& grad_output,
                                                                    const at::Tensor& input, const at::Tensor& weight,
                                                                    at::IntArrayRef stride, at::IntArrayRef padding,
                                                                    at::IntArrayRef dilation, int64_t groups,
                                                                    std::array<bool, 3> output_mask) {
  const auto dual = check_conv2d(input, weight, std::nullopt, stride, padding, dilation, groups);
  check_conv2d_grad_output(grad_output, input, dual);
  return empty_conv_gradients(input, weight, dual.in_channels, output_mask);
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, Meta, m) {
  m.impl("conv2d", TORCH_FN(hierpar::detail::conv2d_meta));
  m.impl("conv2d_backward", TORCH_FN(hierpar::detail::conv2d_backward_meta));
}
