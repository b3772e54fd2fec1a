// Schemas of hierpar::batch_norm_act and its backward, and their C++ entry points.
#include "hierpar/ops.h"
#include "typed_op.h"

#include <torch/library.h>

namespace hierpar::ops {

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_act(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps, c10::string_view activation, double slope,
    const std::optional<at::Tensor>& num_batches_tracked) {
  static const auto op = detail::typed_op<decltype(batch_norm_act)>("hierpar::batch_norm_act");
  return op.call(input, weight, bias, running_mean, running_var, training, momentum, eps, activation, slope,
                 num_batches_tracked);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_act_backward(
    const at::Tensor& grad_output, const at::Tensor& output, const std::optional<at::Tensor>& input,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, double eps, c10::string_view activation, double slope,
    std::array<bool, 3> output_mask) {
  static const auto op = detail::typed_op<decltype(batch_norm_act_backward)>("hierpar::batch_norm_act_backward");
  return op.call(grad_output, output, input, weight, bias, save_mean, save_invstd, training, eps, activation,
                 slope, output_mask);
}

}  // namespace hierpar::ops

TORCH_LIBRARY_FRAGMENT(hierpar, m) {
  m.def(
      "batch_norm_act(Tensor input, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, "
      "Tensor(b!)? running_var, bool training, float momentum, float eps, str activation='identity', "
      "float slope=0.01, Tensor(c!)? num_batches_tracked=None) -> (Tensor output, Tensor save_mean, "
      "Tensor save_invstd)");
  m.def(
      "batch_norm_act_backward(Tensor grad_output, Tensor output, Tensor? input, Tensor? weight, Tensor? bias, "
      "Tensor save_mean, Tensor save_invstd, bool training, float eps, str activation, float slope, "
      "bool[3] output_mask) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
}
