#include "autograd/backward_node.h"

#include <ATen/ops/convolution_backward.h>

namespace hierpar::detail {

std::tuple<at::Tensor, at::Tensor, at::Tensor> differentiable_convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, int64_t out_channels,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
    at::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> mask) {
  const bool unbatched = input.dim() == 3;
  const std::array<int64_t, 1> bias_sizes{out_channels};
  auto [grad_input, grad_weight, grad_bias] = at::convolution_backward(
      unbatched ? grad_output.unsqueeze(0) : grad_output, unbatched ? input.unsqueeze(0) : input, weight,
      at::OptionalIntArrayRef(bias_sizes), stride, padding, dilation, transposed, output_padding, groups, mask);
  if (unbatched && grad_input.defined()) grad_input = grad_input.squeeze(0);
  return {grad_input, grad_weight, grad_bias};
}

void check_conv_backward_not_recorded(const char* op, const at::Tensor& grad_output, const at::Tensor& input,
                                      const at::Tensor& weight) {
  const bool records_graph = torch::autograd::GradMode::is_enabled() &&
                             (grad_output.requires_grad() || input.requires_grad() || weight.requires_grad());
  TORCH_CHECK(!records_graph, "hierpar::", op, "_backward is not differentiable (it was asked to record a graph for ",
              "inputs that require grad); for second derivatives differentiate hierpar::", op,
              " with create_graph=true");
}

}  // namespace hierpar::detail
