// Meta kernels of hierpar::batch_norm_act and its backward: the same checks as the CPU and CUDA kernels,
// and outputs of the right shape, dtype and layout without data.
#include "batch_norm_act_shape.h"
#include "common.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace hierpar::detail::bn {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_meta(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps, c10::string_view activation, double slope,
    const std::optional<at::Tensor>& num_batches_tracked) {
  Act act = parse_activation(activation, "hierpar::batch_norm_act");
  Geometry g = check_forward(input, weight, bias, running_mean, running_var, training, momentum, eps, act, slope,
                             num_batches_tracked);
  auto stats = input.options().dtype(stats_dtype(input.scalar_type()));
  return {at::empty(input.sizes(), input.options().memory_format(layout_of(input))), at::empty({g.c}, stats),
          at::empty({g.c}, stats)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_meta(
    const at::Tensor& grad_output, const at::Tensor& output, const std::optional<at::Tensor>& input,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, double eps, c10::string_view activation, double slope,
    std::array<bool, 3> output_mask) {
  Act act = parse_activation(activation, "hierpar::batch_norm_act_backward");
  Geometry g = check_backward(grad_output, output, input, weight, bias, save_mean, save_invstd, eps, act, slope);
  const auto dtypes = param_grad_dtypes(output.scalar_type(), weight, bias);
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) grad_input = at::empty(output.sizes(), output.options().memory_format(layout_of(output)));
  if (output_mask[1]) grad_weight = at::empty({g.c}, output.options().dtype(dtypes.weight));
  if (output_mask[2]) grad_bias = at::empty({g.c}, output.options().dtype(dtypes.bias));
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace
}  // namespace hierpar::detail::bn

TORCH_LIBRARY_IMPL(hierpar, Meta, m) {
  m.impl("batch_norm_act", &hierpar::detail::bn::forward_meta);
  m.impl("batch_norm_act_backward", &hierpar::detail::bn::backward_meta);
}
