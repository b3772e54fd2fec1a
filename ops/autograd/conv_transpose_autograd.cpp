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

using torch::autograd::SavedVariable;
using torch::autograd::Variable;
using torch::autograd::variable_list;

// Edges: input, weight, bias (empty when absent).
struct ConvTranspose2dBackwardNode final : torch::autograd::Node {
  std::string name() const override { return "hierpar::ConvTranspose2dBackward"; }

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return variable_list(3);
    const std::array<bool, 3> mask{should_compute_output(0), should_compute_output(1), should_compute_output(2)};
    if (torch::autograd::GradMode::is_enabled()) {  // create_graph: second derivatives (backward_node.h)
      auto [grad_input, grad_weight, grad_bias] = differentiable_convolution_backward(
          grads[0], input.unpack(), weight.unpack(), weight.unpack().size(1) * groups, stride, padding, dilation,
          /*transposed=*/true, output_padding, groups, mask);
      return {grad_input, grad_weight, grad_bias};
    }
    auto [grad_input, grad_weight, grad_bias] = ops::conv_transpose2d_backward(
        grads[0], input.unpack(), weight.unpack(), stride, padding, output_padding, groups, dilation, mask);
    return {grad_input, grad_weight, grad_bias};
  }
  void release_variables() override {
    input.reset_data();
    weight.reset_data();
  }

  SavedVariable input, weight;
  std::vector<int64_t> stride, padding, output_padding, dilation;
  int64_t groups = 1;
};

at::Tensor conv_transpose2d_autograd(const at::Tensor& input, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                     at::IntArrayRef padding, at::IntArrayRef output_padding, int64_t groups,
                                     at::IntArrayRef dilation) {
  at::Tensor output;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    output = ops::conv_transpose2d(input, weight, bias, stride, padding, output_padding, groups, dilation);
  }
  if (!torch::autograd::compute_requires_grad(input, weight, bias)) return output;
  auto node = new_backward_node<ConvTranspose2dBackwardNode>(input, weight, bias);
  node->input = SavedVariable(input, /*is_output=*/false);
  node->weight = SavedVariable(weight, /*is_output=*/false);
  node->stride = stride.vec();
  node->padding = padding.vec();
  node->output_padding = output_padding.vec();
  node->dilation = dilation.vec();
  node->groups = groups;
  torch::autograd::set_history(output, node);
  return output;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_transpose2d_backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef output_padding, int64_t groups, at::IntArrayRef dilation,
    std::array<bool, 3> output_mask) {
  const bool records_graph = torch::autograd::GradMode::is_enabled() &&
                             (grad_output.requires_grad() || input.requires_grad() || weight.requires_grad());
  TORCH_CHECK(!records_graph,
              "hierpar::conv_transpose2d_backward is not differentiable (it was asked to record a graph for inputs "
              "that require grad); for second derivatives differentiate hierpar::conv_transpose2d with create_graph=true");
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
