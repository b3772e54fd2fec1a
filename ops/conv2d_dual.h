// hierpar::conv2d and its backward computed on a backend of hierpar::conv_transpose2d (private to hierpar_ops):
// the CPU and CUDA kernels of conv2d are these two functions with conv_transpose2d's CPU or CUDA backend, so the
// duality (conv2d_shape.h) is written once and no kernel exists twice.
#pragma once

#include "conv2d_shape.h"
#include "conv_transpose_backends.h"
#include "kernel_registration.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/FunctionRef.h>

#include <array>
#include <optional>
#include <tuple>

namespace hierpar::detail {

struct ConvTranspose2dBackend {
  ConvTranspose2dForwardFn forward;
  ConvTranspose2dBackwardFn backward;
  // Runs two independent computations on `device` (neither reads what the other writes) and returns when both
  // are done as far as the caller's stream order goes: on the CPU one after the other; on CUDA the second on a
  // side stream concurrently with the first (ops/cuda/side_stream.h).
  void (*side_by_side)(c10::Device device, c10::function_ref<void()> first, c10::function_ref<void()> second);
};

// conv2d and its backward on `backend`, their arguments checked (`dual` from conv2d_entry or
// conv2d_backward_entry below).
at::Tensor conv2d_on(const ConvTranspose2dBackend& backend, const ConvTranspose2dGeometry& dual,
                     const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     std::optional<double> leaky_relu_slope);

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_on(const ConvTranspose2dBackend& backend,
                                                                  const ConvTranspose2dGeometry& dual,
                                                                  const at::Tensor& grad_output,
                                                                  const at::Tensor& input, const at::Tensor& weight,
                                                                  std::array<bool, 3> output_mask);

// A backend's kernels of hierpar::conv2d and its backward (CPU, CUDA, Meta): the checks of conv2d_shape.h, then
// the backend's kernel (Forward or Backward) with the dual geometry and the tensors.
template <auto Forward>
at::Tensor conv2d_entry(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                        std::optional<double> leaky_relu_slope) {
  const auto dual = check_conv2d(input, weight, bias, stride, padding, dilation, groups, leaky_relu_slope);
  return Forward(dual, input, weight, bias, leaky_relu_slope);
}

template <auto Backward>
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_entry(const at::Tensor& grad_output,
                                                                     const at::Tensor& input, const at::Tensor& weight,
                                                                     at::IntArrayRef stride, at::IntArrayRef padding,
                                                                     at::IntArrayRef dilation, int64_t groups,
                                                                     std::array<bool, 3> output_mask) {
  const auto dual = check_conv2d(input, weight, std::nullopt, stride, padding, dilation, groups);
  check_conv2d_grad_output(grad_output, input, dual);
  return Backward(dual, grad_output, input, weight, output_mask);
}

// Registers both ops' kernels of the backend whose kernels are Forward and Backward.
template <auto Forward, auto Backward>
void register_conv2d(torch::Library& m) {
  register_kernels<&conv2d_entry<Forward>, &conv2d_backward_entry<Backward>>(m, "conv2d", "conv2d_backward");
}

}  // namespace hierpar::detail
