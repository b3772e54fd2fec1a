// Autograd kernels of hierpar::batch_norm_act (a torch::autograd::Function whose backward is the registered
// hierpar::batch_norm_act_backward op) and of the backward op itself (double backward: a clear error).
//
// What is saved: the OUTPUT (plus weight, bias and the fp32 statistics) for identity and leaky_relu, whose
// backward recovers the pre-activation by inverting the activation; for relu the INPUT as well, because
// the negative half of the pre-activation is lost and grad_input needs xhat at every element (see
// docs/batch_norm_act.md). The running statistics and num_batches_tracked are updated in place and are not
// differentiable.
#include "hierpar/ops.h"

#include <ATen/core/Tensor.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <string>

namespace hierpar::detail::bn {
namespace {

using torch::autograd::AutogradContext;
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

class BatchNormActFunction : public torch::autograd::Function<BatchNormActFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
                               const std::optional<at::Tensor>& running_var, bool training, double momentum,
                               double eps, c10::string_view activation, double slope,
                               const std::optional<at::Tensor>& num_batches_tracked) {
    at::Tensor output, save_mean, save_invstd;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(output, save_mean, save_invstd) = hierpar::ops::batch_norm_act(
          input, weight, bias, running_mean, running_var, training, momentum, eps, activation, slope,
          num_batches_tracked);
    }
    bump_buffers(training, running_mean, running_var, num_batches_tracked);
    const bool relu = activation == "relu";
    ctx->save_for_backward({relu ? input : at::Tensor(), output, present(weight) ? *weight : at::Tensor(),
                            present(bias) ? *bias : at::Tensor(), save_mean, save_invstd});
    ctx->saved_data["training"] = training;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["activation"] = std::string(activation.data(), activation.size());
    ctx->saved_data["slope"] = slope;
    ctx->saved_data["has_weight"] = present(weight);
    ctx->saved_data["has_bias"] = present(bias);
    ctx->mark_non_differentiable({save_mean, save_invstd});
    // The statistics never receive a gradient and an undefined grad_output means no gradient at all, so
    // the engine need not materialise zeros for them: with the default it launched two fill kernels per
    // backward (zeros for save_mean's and save_invstd's gradients), 26 a DCGAN step.
    ctx->set_materialize_grads(false);
    return {output, save_mean, save_invstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(11);  // one per forward argument
    const at::Tensor& grad_output = grads[0];
    if (!grad_output.defined()) return result;
    auto saved = ctx->get_saved_variables();
    const bool has_weight = ctx->saved_data["has_weight"].toBool();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    // needs_input_grad counts only the tensor arguments that were present (input, weight?, bias?, ...).
    std::array<bool, 3> mask{ctx->needs_input_grad(0), has_weight && ctx->needs_input_grad(1),
                             has_bias && ctx->needs_input_grad(has_weight ? 2 : 1)};
    auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
    auto [grad_input, grad_weight, grad_bias] = hierpar::ops::batch_norm_act_backward(
        grad_output, saved[1], opt(saved[0]), opt(saved[2]), opt(saved[3]), saved[4], saved[5],
        ctx->saved_data["training"].toBool(), ctx->saved_data["eps"].toDouble(),
        ctx->saved_data["activation"].toStringRef(), ctx->saved_data["slope"].toDouble(), mask);
    result[0] = grad_input;
    result[1] = grad_weight;
    result[2] = grad_bias;
    return result;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_autograd(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps, c10::string_view activation, double slope,
    const std::optional<at::Tensor>& num_batches_tracked) {
  auto requires = [](const std::optional<at::Tensor>& t) { return present(t) && t->requires_grad(); };
  if (!at::GradMode::is_enabled() || !(input.requires_grad() || requires(weight) || requires(bias))) {
    // Nothing to differentiate (inference, or frozen inputs and parameters): no Function node, no saved
    // tensors, only the kernel and the running statistics' version bump.
    at::Tensor output, save_mean, save_invstd;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(output, save_mean, save_invstd) = hierpar::ops::batch_norm_act(
          input, weight, bias, running_mean, running_var, training, momentum, eps, activation, slope,
          num_batches_tracked);
    }
    bump_buffers(training, running_mean, running_var, num_batches_tracked);
    return {output, save_mean, save_invstd};
  }
  auto r = BatchNormActFunction::apply(input, weight, bias, running_mean, running_var, training, momentum, eps,
                                       activation, slope, num_batches_tracked);
  return {r[0], r[1], r[2]};
}

// The backward is not itself differentiated: with create_graph (grad mode on and a differentiable input)
// it says so instead of silently returning a graph-less gradient.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& output, const std::optional<at::Tensor>& input,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, double eps, c10::string_view activation, double slope,
    std::array<bool, 3> output_mask) {
  auto requires = [](const std::optional<at::Tensor>& t) { return present(t) && t->requires_grad(); };
  const bool differentiable = grad_output.requires_grad() || output.requires_grad() || requires(input) ||
                              requires(weight) || requires(bias);
  TORCH_CHECK(!(at::GradMode::is_enabled() && differentiable),
              "hierpar::batch_norm_act_backward: double backward is not supported");
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
