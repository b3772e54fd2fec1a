// Autograd kernels of hierpar::batch_norm_act (a backward node, backward_node.h, that calls the registered
// hierpar::batch_norm_act_backward op) and of the backward op itself.
//
// What is saved (plus weight, bias and the fp32 statistics): for identity the INPUT, as ATen's batch norm keeps it,
// so that an in-place op on the output (a ReLU(inplace=True) after BatchNorm2d) leaves the backward intact; for
// leaky_relu the OUTPUT, whose backward recovers the pre-activation by inverting the activation (an in-place op on it
// is then refused by autograd's version check, as after a stock LeakyReLU); for relu both, because the negative half
// of the pre-activation is lost and grad_input needs xhat at every element (see docs/batch_norm_act.md). The running
// statistics and num_batches_tracked are updated in place and are not differentiable.
//
// Second derivatives (create_graph: R1 and gradient penalties) need the input, which leaky_relu keeps only inside a
// DoubleBackwardScope; the node then differentiates through ATen's differentiable ops (native_batch_norm_backward,
// whose own derivative ATen has, and the activations' backward).
#include "autograd/backward_node.h"
#include "hierpar/ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/leaky_relu_backward.h>
#include <ATen/ops/native_batch_norm_backward.h>
#include <ATen/ops/threshold_backward.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <string>

namespace hierpar::ops {
namespace {
thread_local int double_backward_scopes = 0;
}
DoubleBackwardScope::DoubleBackwardScope() { ++double_backward_scopes; }
DoubleBackwardScope::~DoubleBackwardScope() { --double_backward_scopes; }
bool DoubleBackwardScope::active() { return double_backward_scopes > 0; }
}  // namespace hierpar::ops

namespace hierpar::detail::bn {
namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The buffers a training forward updates in place: new versions, seen by anyone holding a saved copy.
void bump_buffers(bool training, const std::optional<at::Tensor>& running_mean,
                  const std::optional<at::Tensor>& running_var, const std::optional<at::Tensor>& num_batches_tracked) {
  if (!training) return;
  for (const auto* buffer : {&running_mean, &running_var, &num_batches_tracked}) {
    if (present(*buffer)) torch::autograd::impl::bump_version(**buffer);
  }
}

// Edges: input, weight, bias (empty when absent). Only the output gets a gradient edge: the statistics are
// non-differentiable outputs, so the engine materialises no zeros for them (with a Function it launched two fill
// kernels per backward for them, 26 a DCGAN step).
struct BatchNormActBackwardNode final : torch::autograd::Node {
  std::string name() const override { return "hierpar::BatchNormActBackward"; }

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return variable_list(3);
    const std::array<bool, 3> mask{should_compute_output(0), should_compute_output(1), should_compute_output(2)};
    if (at::GradMode::is_enabled()) return differentiable_backward(grads[0], mask);
    auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
    const at::Tensor x = input.unpack();
    // Identity keeps only the input: the op reads the output's values for the activation alone, so the input
    // stands in for it (same shape and layout).
    const at::Tensor out = activation == "identity" ? x : output.unpack(shared_from_this());
    auto [grad_input, grad_weight, grad_bias] = hierpar::ops::batch_norm_act_backward(
        grads[0], out, opt(x), opt(weight.unpack()), opt(bias.unpack()), save_mean.unpack(), save_invstd.unpack(),
        training, eps, activation, slope, mask);
    return {grad_input, grad_weight, grad_bias};
  }
  void release_variables() override {
    for (SavedVariable* v : {&input, &output, &weight, &bias, &save_mean, &save_invstd}) v->reset_data();
  }

  // Under create_graph: the same gradients from ATen's differentiable ops, so that they can be differentiated again.
  variable_list differentiable_backward(const at::Tensor& grad, std::array<bool, 3> mask) {
    const at::Tensor x = input.unpack();
    TORCH_CHECK(x.defined(), "hierpar::batch_norm_act: a second derivative (create_graph) needs the layer's input, which ",
                activation, " does not keep: run the forward inside a hierpar::ops::DoubleBackwardScope (the "
                "trainer's R1 penalty does)");
    at::Tensor g = grad;
    if (activation == "relu") {
      g = at::threshold_backward(grad, output.unpack(shared_from_this()), 0);
    } else if (activation == "leaky_relu") {
      g = at::leaky_relu_backward(grad, output.unpack(shared_from_this()), slope, /*self_is_result=*/true);
    }
    const at::Tensor w = weight.unpack();
    const at::Tensor mean = save_mean.unpack(), invstd = save_invstd.unpack();
    if (training) {
      auto [gi, gw, gb] = at::native_batch_norm_backward(g, x, w, std::nullopt, std::nullopt, mean, invstd,
                                                         /*train=*/true, eps, mask);
      return {gi, gw, gb};
    }
    // Eval: an affine map per channel with the running statistics as constants.
    std::vector<int64_t> channel_shape(x.dim(), 1);
    channel_shape[1] = x.size(1);
    std::vector<int64_t> reduce;
    for (int64_t d = 0; d < x.dim(); ++d) {
      if (d != 1) reduce.push_back(d);
    }
    const at::Tensor scale = (w.defined() ? w.mul(invstd) : invstd).view(channel_shape);
    at::Tensor gi, gw, gb;
    if (mask[0]) gi = g.mul(scale).to(x.scalar_type());
    if (mask[1] && w.defined()) gw = g.mul(x.sub(mean.view(channel_shape)).mul(invstd.view(channel_shape))).sum(reduce);
    if (mask[2]) gb = g.sum(reduce);
    return {gi, gw, gb};
  }

  SavedVariable input, output, weight, bias, save_mean, save_invstd;
  bool training = true;
  double eps = 1e-5, slope = 0.01;
  std::string activation;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_autograd(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps, c10::string_view activation, double slope,
    const std::optional<at::Tensor>& num_batches_tracked) {
  at::Tensor output, save_mean, save_invstd;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(output, save_mean, save_invstd) = hierpar::ops::batch_norm_act(
        input, weight, bias, running_mean, running_var, training, momentum, eps, activation, slope,
        num_batches_tracked);
  }
  bump_buffers(training, running_mean, running_var, num_batches_tracked);
  // Nothing to differentiate (inference, or frozen inputs and parameters): no node, no saved tensors.
  if (!torch::autograd::compute_requires_grad(input, weight, bias)) return {output, save_mean, save_invstd};
  auto node = new_backward_node<BatchNormActBackwardNode>(input, weight, bias);
  const bool identity = activation == "identity";
  if (identity || activation == "relu" || hierpar::ops::DoubleBackwardScope::active()) {
    node->input = SavedVariable(input, /*is_output=*/false);
  }
  if (present(weight)) node->weight = SavedVariable(*weight, /*is_output=*/false);
  if (present(bias)) node->bias = SavedVariable(*bias, /*is_output=*/false);
  node->save_mean = SavedVariable(save_mean, /*is_output=*/false);
  node->save_invstd = SavedVariable(save_invstd, /*is_output=*/false);
  node->training = training;
  node->eps = eps;
  node->slope = slope;
  node->activation = std::string(activation.data(), activation.size());
  torch::autograd::set_history(output, node);
  if (!identity) node->output = SavedVariable(output, /*is_output=*/true);
  return {output, save_mean, save_invstd};
}

// The backward op called directly is not itself differentiated (the node above differentiates under create_graph):
// with grad mode on and a differentiable input it says so instead of silently returning a graph-less gradient.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& output, const std::optional<at::Tensor>& input,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, double eps, c10::string_view activation, double slope,
    std::array<bool, 3> output_mask) {
  auto requires = [](const std::optional<at::Tensor>& t) { return present(t) && t->requires_grad(); };
  const bool differentiable = grad_output.requires_grad() || output.requires_grad() || requires(input) ||
                              requires(weight) || requires(bias);
  TORCH_CHECK(!(at::GradMode::is_enabled() && differentiable),
              "hierpar::batch_norm_act_backward: this op is not differentiable; for second derivatives "
              "differentiate hierpar::batch_norm_act with create_graph=true");
  at::AutoDispatchBelowADInplaceOrView guard;
  return hierpar::ops::batch_norm_act_backward(grad_output, output, input, weight, bias, save_mean, save_invstd,
                                               training, eps, activation, slope, output_mask);
}

}  // namespace
}  // namespace hierpar::detail::bn

TORCH_LIBRARY_IMPL(hierpar, Autograd, m) {
  m.impl("batch_norm_act", &hierpar::detail::bn::forward_autograd);
  m.impl("batch_norm_act_backward", &hierpar::detail::bn::backward_autograd);
}
