// The CPU and CUDA backends of hierpar::conv_transpose2d as functions of a geometry and caller-allocated
// outputs (private to hierpar_ops). The registered conv_transpose2d ops check their arguments, allocate and
// call these; hierpar::conv2d calls them with the dual arguments (a convolution is the grad_input of the
// transposed convolution with the same weight, see conv2d_shape.h), so both ops run the same kernels.
#pragma once

#include "conv_transpose_shape.h"
#include "kernel_registration.h"

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

namespace hierpar::detail {

// out = conv_transpose2d(input4, weight) + bias. input4: 4-d, any strides. out: [N, C_out, H_out, W_out],
// dense (contiguous or channels_last). bias: undefined or [C_out].
void run_conv_transpose2d_forward_cpu(const ConvTranspose2dGeometry& g, const at::Tensor& input4,
                                      const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& out);
void run_conv_transpose2d_forward_cuda(const ConvTranspose2dGeometry& g, const at::Tensor& input4,
                                       const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& out);

// grad_input [N, C_in, H, W] and grad_weight (weight's shape) of conv_transpose2d, each undefined when not asked
// for, else allocated by the caller: grad_input dense (contiguous or channels_last), grad_weight any strides.
// input4 is read only for grad_weight (it may be undefined otherwise). grad_bias is the caller's (a sum).
// With grad_input_leaky_relu_slope, grad_input is leaky_relu(grad_input, slope): hierpar::conv2d's fused
// activation, applied as the small-C_out CUDA kernels store (a separate in-place pass on the other routes).
void run_conv_transpose2d_backward_cpu(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4,
                                       const at::Tensor& input4, const at::Tensor& weight,
                                       const at::Tensor& grad_input, const at::Tensor& grad_weight,
                                       std::optional<double> grad_input_leaky_relu_slope);
void run_conv_transpose2d_backward_cuda(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4,
                                        const at::Tensor& input4, const at::Tensor& weight,
                                        const at::Tensor& grad_input, const at::Tensor& grad_weight,
                                        std::optional<double> grad_input_leaky_relu_slope);

using ConvTranspose2dForwardFn = decltype(&run_conv_transpose2d_forward_cpu);
using ConvTranspose2dBackwardFn = decltype(&run_conv_transpose2d_backward_cpu);

// The registered conv_transpose2d and conv_transpose2d_backward kernels of the CPU and CUDA backends once their
// arguments are checked (`g` from check_conv_transpose2d or check_conv_transpose2d_backward): they allocate the
// outputs, see unbatched (3-d) inputs with batch 1 and run the backend's `run_forward` / `run_backward`.
// `sum_grad_bias` writes grad_output4's sum over (n, h, w) into grad_bias [C_out]; it runs before `run_backward`.
at::Tensor conv_transpose2d_forward_on(ConvTranspose2dForwardFn run_forward, const ConvTranspose2dGeometry& g,
                                      const at::Tensor& input, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_transpose2d_backward_on(
    ConvTranspose2dBackwardFn run_backward, void (*sum_grad_bias)(const at::Tensor& grad_output4, at::Tensor& grad_bias),
    const ConvTranspose2dGeometry& g, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, std::array<bool, 3> output_mask);

// The CPU kernels run float32/float64 on ATen's (Switch::cpu_aten; the reference above computes in the same
// precision, 1.3-3.5x slower on the DCGAN's layers, docs/cpu.md), half types on the reference (float32 arithmetic).
bool cpu_conv_on_aten(const at::Tensor& input);

// ATen's convolution backward for hierpar::conv_transpose2d (transposed, `g` its geometry) or hierpar::conv2d
// (`g` the dual geometry, conv2d_shape.h), with hierpar's conventions: 3-d (unbatched) inputs, grad_input in the
// input's layout and grad_weight in the weight's.
std::tuple<at::Tensor, at::Tensor, at::Tensor> aten_convolution_backward(const ConvTranspose2dGeometry& g,
                                                                        bool transposed, const at::Tensor& grad_output,
                                                                        const at::Tensor& input, const at::Tensor& weight,
                                                                        std::array<bool, 3> output_mask);

// A backend's kernels of hierpar::conv_transpose2d and its backward (CPU, CUDA, Meta): the checks of
// conv_transpose_shape.h, then the backend's kernel (Forward or Backward) with the geometry and the tensors.
template <auto Forward>
at::Tensor conv_transpose2d_entry(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                  at::IntArrayRef padding, at::IntArrayRef output_padding, int64_t groups,
                                  at::IntArrayRef dilation) {
  const auto g = check_conv_transpose2d(input, weight, bias, stride, padding, output_padding, groups, dilation);
  return Forward(g, input, weight, bias);
}

template <auto Backward>
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_transpose2d_backward_entry(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef output_padding, int64_t groups, at::IntArrayRef dilation,
    std::array<bool, 3> output_mask) {
  const auto g =
      check_conv_transpose2d_backward(grad_output, input, weight, stride, padding, output_padding, groups, dilation);
  return Backward(g, grad_output, input, weight, output_mask);
}

// Registers both ops' kernels of the backend whose kernels are Forward and Backward.
template <auto Forward, auto Backward>
void register_conv_transpose2d(torch::Library& m) {
  register_kernels<&conv_transpose2d_entry<Forward>, &conv_transpose2d_backward_entry<Backward>>(
      m, "conv_transpose2d", "conv_transpose2d_backward");
}

}  // namespace hierpar::detail
