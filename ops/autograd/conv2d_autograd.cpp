// Autograd of hierpar::conv2d: a torch::autograd::Function whose backward calls the registered
// hierpar::conv2d_backward with output_mask from needs_input_grad, so only the gradients autograd needs are
// computed. With the fused leaky_relu, the gradient first goes through leaky_relu's backward, whose mask comes from
// the saved output (a non-negative slope keeps the sign), so the pre-activation is never kept. As for conv_transpose2d, the backward op is not differentiable: its Autograd kernel refuses to record
// a graph (double backward) with a clear message instead of silently returning wrong second derivatives.
#include "hierpar/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/leaky_relu_backward.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace hierpar::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Variable;
using torch::autograd::variable_list;

class Conv2dFunction : public torch::autograd::Function<Conv2dFunction> {
 public:
  static Variable forward(AutogradContext* ctx, const Variable& input, const Variable& weight,
                          const std::optional<Variable>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
                          at::IntArrayRef dilation, int64_t groups, std::optional<double> leaky_relu_slope) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto output = ops::conv2d(input, weight, bias, stride, padding, dilation, groups, leaky_relu_slope);
    ctx->save_for_backward({input, weight, leaky_relu_slope ? output : Variable()});
    ctx->saved_data["leaky_relu_slope"] = leaky_relu_slope.value_or(-1.0);  // < 0: none (the op rejects those)
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["stride"] = stride.vec();
    ctx->saved_data["padding"] = padding.vec();
    ctx->saved_data["dilation"] = dilation.vec();
    ctx->saved_data["groups"] = groups;
    return output;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    // Edges are the tensor arguments present: input (0), weight (1) and, when given, bias (2).
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                   has_bias && ctx->needs_input_grad(2)};
    const double slope = ctx->saved_data["leaky_relu_slope"].toDouble();
    const auto grad = slope >= 0 ? at::leaky_relu_backward(grad_outputs[0], saved[2], slope, /*self_is_result=*/true)
                                 : grad_outputs[0];
    auto [grad_input, grad_weight, grad_bias] = ops::conv2d_backward(
        grad, saved[0], saved[1], ctx->saved_data["stride"].toIntVector(),
        ctx->saved_data["padding"].toIntVector(), ctx->saved_data["dilation"].toIntVector(),
        ctx->saved_data["groups"].toInt(), mask);
    // One entry per forward argument: input, weight, bias, stride, padding, dilation, groups, leaky_relu_slope.
    return {grad_input, grad_weight, grad_bias, Variable(), Variable(), Variable(), Variable(), Variable()};
  }
};

at::Tensor conv2d_autograd(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                           int64_t groups, std::optional<double> leaky_relu_slope) {
  return Conv2dFunction::apply(input, weight, bias, stride, padding, dilation, groups, leaky_relu_slope);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, std::array<bool, 3> output_mask) {
  const bool records_graph = torch::autograd::GradMode::is_enabled() &&
                             (grad_output.requires_grad() || input.requires_grad() || weight.requires_grad());
  TORCH_CHECK(!records_graph,
              "hierpar::conv2d: double backward is not supported (the backward was asked to build a graph, e.g. "
              "backward/autograd::grad with create_graph=true, on inputs that require grad)");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return ops::conv2d_backward(grad_output, input, weight, stride, padding, dilation, groups, output_mask);
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, Autograd, m) {
  m.impl("conv2d", TORCH_FN(hierpar::detail::conv2d_autograd));
  m.impl("conv2d_backward", TORCH_FN(hierpar::detail::conv2d_backward_autograd));
}
