// Autograd of hierpar::conv_transpose2d: a backward node (backward_node.h) that calls the registered
// hierpar::conv_transpose2d_backward with output_mask from the edges that need a gradient, so only the gradients autograd
// needs are computed. Under create_graph the node takes ATen's differentiable convolution_backward instead,
// so second derivatives work. The backward op itself, called directly, is not differentiable: its Autograd kernel
// refuses to record a graph with a clear message instead of silently returning wrong second derivatives.
#include "autograd/backward_node.h"
#include "hierpar/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace hierpar::detail {
namespace {

// Edges: input, weight, bias (empty when absent).
struct ConvTranspose2dBackwardNode final : ConvBackwardNodeBase {
  std::string name() const override { return "hierpar::ConvTranspose2dBackward"; }

  Gradients first_gradients(const at::Tensor& grad, std::array<bool, 3> mask) override {
    return ops::conv_transpose2d_backward(grad, input.unpack(), weight.unpack(), stride, padding, output_padding,
                                          groups, dilation, mask);
  }
  Gradients differentiable_gradients(const at::Tensor& grad, std::array<bool, 3> mask) override {
    return differentiable_convolution_backward(grad, input.unpack(), weight.unpack(),
                                               weight.unpack().size(1) * groups, stride, padding, dilation,
                                               /*transposed=*/true, output_padding, groups, mask);
  }

  std::vector<int64_t> output_padding;
};

at::Tensor conv_transpose2d_autograd(const at::Tensor& input, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                     at::IntArrayRef padding, at::IntArrayRef output_padding, int64_t groups,
                                     at::IntArrayRef dilation) {
  auto [output, node] = record_conv<ConvTranspose2dBackwardNode>(
      [&] { return ops::conv_transpose2d(input, weight, bias, stride, padding, output_padding, groups, dilation); },
      input, weight, bias, stride, padding, dilation, groups);
  if (node) node->output_padding = output_padding.vec();
  return output;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_transpose2d_backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef output_padding, int64_t groups, at::IntArrayRef dilation,
    std::array<bool, 3> output_mask) {
  check_conv_backward_not_recorded("conv_transpose2d", grad_output, input, weight);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return ops::conv_transpose2d_backward(grad_output, input, weight, stride, padding, output_padding, groups,
                                        dilation, output_mask);
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, Autograd, m) {
  m.impl("conv_transpose2d", TORCH_FN(hierpar::detail::conv_transpose2d_autograd));
  m.impl("conv_transpose2d_backward", TORCH_FN(hierpar::detail::conv_transpose2d_backward_autograd));
}
