// hierpar::conv2d and its backward computed on a backend of hierpar::conv_transpose2d (private to hierpar_ops):
// the CPU and CUDA kernels of conv2d are these two functions with conv_transpose2d's CPU or CUDA backend, so the
// duality (conv2d_shape.h) is written once and no kernel exists twice.
#pragma once

#include "conv_transpose_backends.h"

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

namespace hierpar::detail {

struct ConvTranspose2dBackend {
  decltype(&run_conv_transpose2d_forward_cpu) forward;
  decltype(&run_conv_transpose2d_backward_cpu) backward;
};

at::Tensor conv2d_on(const ConvTranspose2dBackend& backend, const at::Tensor& input, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
                     at::IntArrayRef dilation, int64_t groups, std::optional<double> leaky_relu_slope);

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_on(
    const ConvTranspose2dBackend& backend, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
    int64_t groups, std::array<bool, 3> output_mask);

}  // namespace hierpar::detail
