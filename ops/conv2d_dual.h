// hierpar::conv2d and its backward computed on a backend of hierpar::conv_transpose2d (private to hierpar_ops):
// the CPU and CUDA kernels of conv2d are these two functions with conv_transpose2d's CPU or CUDA backend, so the
// duality (conv2d_shape.h) is written once and no kernel exists twice.
#pragma once

#include "conv_transpose_backends.h"

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

at::Tensor conv2d_on(const ConvTranspose2dBackend& backend, const at::Tensor& input, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
                     at::IntArrayRef dilation, int64_t groups, std::optional<double> leaky_relu_slope);

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_on(
    const ConvTranspose2dBackend& backend, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
    int64_t groups, std::array<bool, 3> output_mask);

}  // namespace hierpar::detail
