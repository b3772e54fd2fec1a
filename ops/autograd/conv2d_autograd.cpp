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
using torch::autograd::Variable;
using torch::autograd::variable_list;

// Edges: input, weight, bias (empty when absent). With the fused LeakyReLU the output is saved too: its backward
// starts from the activation's.
struct Conv2dBackwardNode final : torch::autograd::Node {
  std::string name() const override { return "hierpar::Conv2dBackward"; }

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return variable_list(3);
    const std::array<bool, 3> mask{should_compute_output(0), should_compute_output(1), should_compute_output(2)};
    const at::Tensor grad = leaky_relu_slope ? at::leaky_relu_backward(grads[0], output.unpack(shared_from_this()),
                                                                       *leaky_relu_slope, /*self_is_result=*/true)
                                             : grads[0];
    if (torch::autograd::GradMode::is_enabled()) {  // create_graph: second derivatives (backward_node.h)
      const at::Tensor w = weight.unpack();
      auto [grad_input, grad_weight, grad_bias] = differentiable_convolution_backward(
          grad, input.unpack(), w, w.size(0), stride, padding, dilation, /*transposed=*/false, {0, 0}, groups, mask);
      return {grad_input, grad_weight, grad_bias};
    }
    auto [grad_input, grad_weight, grad_bias] =
        ops::conv2d_backward(grad, input.unpack(), weight.unpack(), stride, padding, dilation, groups, mask);
    return {grad_input, grad_weight, grad_bias};
  }
  void release_variables() override {
    input.reset_data();
    weight.reset_data();
    output.reset_data();
  }

  SavedVariable input, weight, output;
  std::vector<int64_t> stride, padding, dilation;
  int64_t groups = 1;
  std::optional<double> leaky_relu_slope;
};

at::Tensor conv2d_autograd(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                           int64_t groups, std::optional<double> leaky_relu_slope) {
  at::Tensor output;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    output = ops::conv2d(input, weight, bias, stride, padding, dilation, groups, leaky_relu_slope);
  }
  if (!torch::autograd::compute_requires_grad(input, weight, bias)) return output;
  auto node = new_backward_node<Conv2dBackwardNode>(input, weight, bias);
  node->input = SavedVariable(input, /*is_output=*/false);
  node->weight = SavedVariable(weight, /*is_output=*/false);
  node->stride = stride.vec();
  node->padding = padding.vec();
  node->dilation = dilation.vec();
  node->groups = groups;
  node->leaky_relu_slope = leaky_relu_slope;
  torch::autograd::set_history(output, node);
  if (leaky_relu_slope) node->output = SavedVariable(output, /*is_output=*/true);
  return output;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, std::array<bool, 3> output_mask) {
  const bool records_graph = torch::autograd::GradMode::is_enabled() &&
                             (grad_output.requires_grad() || input.requires_grad() || weight.requires_grad());
  TORCH_CHECK(!records_graph,
              "hierpar::conv2d_backward is not differentiable (it was asked to record a graph for inputs that require "
              "grad); for second derivatives differentiate hierpar::conv2d with create_graph=true");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return ops::conv2d_backward(grad_output, input, weight, stride, padding, dilation, groups, output_mask);
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, Autograd, m) {
  m.impl("conv2d", TORCH_FN(hierpar::detail::conv2d_autograd));
  m.impl("conv2d_backward", TORCH_FN(hierpar::detail::conv2d_backward_autograd));
}
