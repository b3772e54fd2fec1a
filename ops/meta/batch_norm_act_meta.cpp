// Meta kernels of hierpar::batch_norm_act and its backward: the same checks as the CPU and CUDA kernels,
// and outputs of the right shape, dtype and layout without data.
#include "batch_norm_act_shape.h"
#include "common.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace hierpar::detail::bn {
namespace {

// The outputs follow from the input and the geometry; forward_entry has checked the other arguments.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_meta(
    Geometry g, const at::Tensor& input, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool, double, double, Act, double,
    const std::optional<at::Tensor>&) {
  auto stats = input.options().dtype(stats_dtype(input.scalar_type()));
  return {at::empty(input.sizes(), input.options().memory_format(layout_of(input))), at::empty({g.c}, stats),
          at::empty({g.c}, stats)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_meta(
    Geometry g, const at::Tensor&, const at::Tensor& output, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor&,
    const at::Tensor&, bool, double, Act, double, std::array<bool, 3> output_mask) {
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
  hierpar::detail::bn::register_batch_norm_act<&hierpar::detail::bn::forward_meta, &hierpar::detail::bn::backward_meta>(m);
}
