// Autograd kernels of hierpar::max_pool2d and hierpar::max_pool2d_backward.
//
// max_pool2d saves only its uint8 indices (and the input's sizes) and differentiates through the registered
// gather backward. max_pool2d_backward is linear in grad_output: its derivative routes each window the
// grad_input-shaped gradient at the element that window chose, i.e. a gather with the same indices (the
// derivative of at::max_pool2d's backward is the same selection), so double backward works; that gather is
// written with ATen ops (gather is itself differentiable), as it only runs for higher-order gradients.
#include "hierpar/ops.h"
#include "max_pool_shape.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/gather.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

namespace hierpar::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Variable;
using torch::autograd::variable_list;

struct PoolArgs {
  std::vector<int64_t> kernel_size, stride, padding, dilation;
  bool ceil_mode;

  void save(AutogradContext* ctx) const {
    ctx->saved_data["kernel_size"] = kernel_size;
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["ceil_mode"] = ceil_mode;
  }
  static PoolArgs load(AutogradContext* ctx) {
    return {ctx->saved_data["kernel_size"].toIntVector(), ctx->saved_data["stride"].toIntVector(),
            ctx->saved_data["padding"].toIntVector(), ctx->saved_data["dilation"].toIntVector(),
            ctx->saved_data["ceil_mode"].toBool()};
  }
};

// For every window, `source` (shaped like the pooled input) at the element the window chose; 0 for a window
// lying entirely in the padding (its index points at padding) and for one that chose none (kMaxPoolNoTap, past the
// window's taps). The transpose of max_pool2d_backward.
at::Tensor gather_chosen(const at::Tensor& source, const at::Tensor& indices, const PoolArgs& a) {
  const auto g = max_pool2d_geometry("hierpar::max_pool2d_backward (double backward)", "grad_input",
                                     source.sizes(), a.kernel_size, a.stride, a.padding, a.dilation, a.ceil_mode);
  const auto opts = indices.options().dtype(at::kLong);
  const at::Tensor tap = indices.to(at::kLong);
  const at::Tensor ih = at::arange(g.out_h, opts).mul(g.stride_h).sub(g.pad_h).view({g.out_h, 1})
                           .add(tap.div(g.kernel_w, "floor").mul(g.dilation_h));
  const at::Tensor iw = at::arange(g.out_w, opts).mul(g.stride_w).sub(g.pad_w)
                           .add(tap.remainder(g.kernel_w).mul(g.dilation_w));
  const at::Tensor inside = ih.ge(0).logical_and(ih.lt(g.in_h)).logical_and(iw.ge(0)).logical_and(iw.lt(g.in_w))
                                .logical_and(tap.lt(g.kernel_h * g.kernel_w));
  const at::Tensor flat = ih.clamp(0, g.in_h - 1).mul(g.in_w).add(iw.clamp(0, g.in_w - 1)).flatten(-2);
  const at::Tensor picked = at::gather(source.flatten(-2), -1, flat).view(indices.sizes());
  return picked.masked_fill(inside.logical_not(), 0);
}

class MaxPool2dBackwardFunction : public torch::autograd::Function<MaxPool2dBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Variable& grad_output, const Variable& indices,
                               at::IntArrayRef input_size, const PoolArgs& args) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({indices});
    args.save(ctx);
    return {ops::max_pool2d_backward(grad_output, indices, input_size, args.kernel_size, args.stride, args.padding,
                                     args.dilation, args.ceil_mode)};
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grads) {
    const auto indices = ctx->get_saved_variables()[0];
    if (!grads[0].defined()) return {Variable(), Variable(), Variable(), Variable()};
    return {gather_chosen(grads[0], indices, PoolArgs::load(ctx)), Variable(), Variable(), Variable()};
  }
};

// max_pool2d's backward node, written as ATen's generated ones are: its arguments as members and the indices as a
// SavedVariable, no per-call map of saved values (a torch::autograd::Function's ctx->saved_data cost a few
// microseconds of host time per call; docs/overhead.md). The indices get no gradient edge: non-differentiable.
struct MaxPool2dBackwardNode final : torch::autograd::Node {
  std::string name() const override { return "hierpar::MaxPool2dBackward"; }

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {Variable()};
    // Through the dispatcher, so that with create_graph max_pool2d_backward's own Autograd kernel records it.
    return {ops::max_pool2d_backward(grads[0], indices.unpack(), input_size, args.kernel_size, args.stride,
                                     args.padding, args.dilation, args.ceil_mode)};
  }
  void release_variables() override { indices.reset_data(); }

  torch::autograd::SavedVariable indices;
  std::vector<int64_t> input_size;
  PoolArgs args;
};

std::tuple<at::Tensor, at::Tensor> max_pool2d_autograd(const at::Tensor& input, at::IntArrayRef kernel_size,
                                                       at::IntArrayRef stride, at::IntArrayRef padding,
                                                       at::IntArrayRef dilation, bool ceil_mode, bool relu) {
  if (!(at::GradMode::is_enabled() && input.requires_grad())) {  // nothing to record: skip the Function's cost
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode, relu);
  }
  // With relu the backward is the same gather: the windows that chose no element pass no gradient.
  auto [output, indices] = [&] {
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode, relu);
  }();
  const std::shared_ptr<MaxPool2dBackwardNode> node(new MaxPool2dBackwardNode(), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  node->indices = torch::autograd::SavedVariable(indices, /*is_output=*/false);
  node->input_size = input.sizes().vec();
  node->args = PoolArgs{kernel_size.vec(), stride.vec(), padding.vec(), dilation.vec(), ceil_mode};
  torch::autograd::set_history(output, node);
  return {output, indices};
}

at::Tensor max_pool2d_backward_autograd(const at::Tensor& grad_output, const at::Tensor& indices,
                                        at::IntArrayRef input_size, at::IntArrayRef kernel_size,
                                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                                        bool ceil_mode) {
  if (!(at::GradMode::is_enabled() && grad_output.requires_grad())) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::max_pool2d_backward(grad_output, indices, input_size, kernel_size, stride, padding, dilation,
                                    ceil_mode);
  }
  return MaxPool2dBackwardFunction::apply(
      grad_output, indices, input_size,
      PoolArgs{kernel_size.vec(), stride.vec(), padding.vec(), dilation.vec(), ceil_mode})[0];
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, Autograd, m) {
  m.impl("max_pool2d", &hierpar::detail::max_pool2d_autograd);
  m.impl("max_pool2d_backward", &hierpar::detail::max_pool2d_backward_autograd);
}
