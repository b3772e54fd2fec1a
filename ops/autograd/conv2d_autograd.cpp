// Autograd of hierpar::conv2d: a backward node (backward_node.h) that calls the registered
// hierpar::conv2d_backward with output_mask from the edges that need a gradient, so only the gradients autograd needs are
// computed. With the fused leaky_relu, the gradient first goes through leaky_relu's backward, whose mask comes from
// the saved output (a non-negative slope keeps the sign), so the pre-activation is never kept. Under create_graph the node takes ATen's differentiable
// convolution_backward instead, so second derivatives work. The backward op itself, called directly, is not
// differentiable: its Autograd kernel refuses to record a graph with a clear message.
#include "autograd/backward_node.h"
#include "hierpar/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/leaky_relu_backward.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace hierpar::detail {
namespace {

using torch::autograd::SavedVariable;

// Edges: input, weight, bias (empty when absent). With the fused LeakyReLU the output is saved too: its backward
// starts from the activation's.
struct Conv2dBackwardNode final : ConvBackwardNodeBase {
  std::string name() const override { return "hierpar::Conv2dBackward"; }

  at::Tensor from_output(const at::Tensor& grad_output) override {
    if (!leaky_relu_slope) return grad_output;
    return at::leaky_relu_backward(grad_output, output.unpack(shared_from_this()), *leaky_relu_slope,
                                   /*self_is_result=*/true);
  }
  Gradients first_gradients(const at::Tensor& grad, std::array<bool, 3> mask) override {
    return ops::conv2d_backward(grad, input.unpack(), weight.unpack(), stride, padding, dilation, groups, mask);
  }
  Gradients differentiable_gradients(const at::Tensor& grad, std::array<bool, 3> mask) override {
    const at::Tensor w = weight.unpack();
    return differentiable_convolution_backward(grad, input.unpack(), w, w.size(0), stride, padding, dilation,
                                               /*transposed=*/false, {0, 0}, groups, mask);
  }
  void release_variables() override {
    ConvBackwardNodeBase::release_variables();
    output.reset_data();
  }

  SavedVariable output;
  std::optional<double> leaky_relu_slope;
};

at::Tensor conv2d_autograd(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                           int64_t groups, std::optional<double> leaky_relu_slope) {
  auto [output, node] = record_conv<Conv2dBackwardNode>(
      [&] { return ops::conv2d(input, weight, bias, stride, padding, dilation, groups, leaky_relu_slope); }, input,
      weight, bias, stride, padding, dilation, groups);
  if (node && leaky_relu_slope) {
    node->leaky_relu_slope = leaky_relu_slope;
    node->output = SavedVariable(output, /*is_output=*/true);
  }
  return output;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, std::array<bool, 3> output_mask) {
  check_conv_backward_not_recorded("conv2d", grad_output, input, weight);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return ops::conv2d_backward(grad_output, input, weight, stride, padding, dilation, groups, output_mask);
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, Autograd, m) {
  m.impl("conv2d", TORCH_FN(hierpar::detail::conv2d_autograd));
  m.impl("conv2d_backward", TORCH_FN(hierpar::detail::conv2d_backward_autograd));
}
