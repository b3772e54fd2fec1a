// hierpar::conv2d on a conv_transpose2d backend, by duality (see conv2d_shape.h).
#include "conv2d_dual.h"

#include "common.h"
#include "conv2d_shape.h"

#include <ATen/ops/leaky_relu.h>
#include <ATen/ops/sum.h>

namespace hierpar::detail {

at::Tensor conv2d_on(const ConvTranspose2dBackend& backend, const ConvTranspose2dGeometry& dual,
                     const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     std::optional<double> leaky_relu_slope) {
  const bool unbatched = input.dim() == 3;
  const at::Tensor input4 = unbatched ? input.unsqueeze(0) : input;
  at::Tensor out = new_output({dual.batch, dual.in_channels, dual.in_h, dual.in_w}, input.options(),
                              conv2d_output_layout(input4, weight));
  // The dual transposed convolution's grad_input at grad_output = input; the activation as it is stored, unless a
  // bias has to come first.
  const bool has_bias = bias.has_value() && bias->defined();
  backend.backward(dual, /*grad_output4=*/input4, /*input4=*/at::Tensor(), weight, /*grad_input=*/out,
                   /*grad_weight=*/at::Tensor(), has_bias ? std::nullopt : leaky_relu_slope);
  // Separate passes: the dual grad_input kernels have no bias epilogue (the DCGAN convolutions have no bias).
  if (has_bias) {
    out.add_(bias->view({1, -1, 1, 1}));
    if (leaky_relu_slope) at::leaky_relu_(out, *leaky_relu_slope);
  }
  return unbatched ? out.squeeze(0) : out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_on(const ConvTranspose2dBackend& backend,
                                                                  const ConvTranspose2dGeometry& dual,
                                                                  const at::Tensor& grad_output,
                                                                  const at::Tensor& input, const at::Tensor& weight,
                                                                  std::array<bool, 3> output_mask) {
  const bool unbatched = input.dim() == 3;
  const at::Tensor input4 = unbatched ? input.unsqueeze(0) : input;
  const at::Tensor grad_output4 = unbatched ? grad_output.unsqueeze(0) : grad_output;
  at::Tensor grad_input, grad_weight, grad_bias;
  // The dual transposed convolution's forward of grad_output.
  auto compute_grad_input = [&] { backend.forward(dual, grad_output4, weight, /*bias=*/at::Tensor(), grad_input); };
  // The dual transposed convolution's grad_weight, its input being grad_output and its grad_output the input.
  auto compute_grad_weight = [&] {
    backend.backward(dual, /*grad_output4=*/input4, /*input4=*/grad_output4, weight, /*grad_input=*/at::Tensor(),
                     grad_weight, std::nullopt);
  };
  if (output_mask[0]) grad_input = new_output(input4.sizes(), input.options(), layout_of(input4));
  if (output_mask[1]) grad_weight = new_output(weight.sizes(), weight.options(), layout_of(weight));
  if (output_mask[0] && output_mask[1]) {
    // Separate kernels on the same operands, neither reading the other's result: concurrently on CUDA.
    backend.side_by_side(input.device(), compute_grad_input, compute_grad_weight);
  } else if (output_mask[0]) {
    compute_grad_input();
  } else if (output_mask[1]) {
    compute_grad_weight();
  }
  if (unbatched && grad_input.defined()) grad_input = grad_input.squeeze(0);
  if (output_mask[2]) {
    grad_bias = new_output({dual.in_channels}, input.options());
    const auto acc = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    grad_bias.copy_(at::sum(grad_output4, {0, 2, 3}, /*keepdim=*/false, acc));
  }
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace hierpar::detail
