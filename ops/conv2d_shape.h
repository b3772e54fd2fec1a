// Argument checks of hierpar::conv2d and the transposed convolution it is computed as (private to hierpar_ops),
// shared by its CPU, CUDA and Meta kernels.
//
// Duality. conv2d(x, w, stride s, padding p, dilation d, groups) with w [C_out, C_in/groups, kH, kW]:
//   y[n, co, oy, ox] = sum over ci of co's group, ky, kx of x[n, ci, oy*s - p + ky*d, ox*s - p + kx*d] * w[co, ci_g, ky, kx].
// conv_transpose2d's grad_input with weight W [C_in_t, C_out_t/groups, kH, kW] at grad_output G reads
//   gu[n, i, iy, ix] = sum over c of i's group, ky, kx of G[n, c, iy*s - p + ky*d, ix*s - p + kx*d] * W[i, c_g, ky, kx],
// the same sum with i = co, c = ci, W = w (so C_in_t = C_out, C_out_t = C_in) and G = x. Its shapes match when
// the transposed convolution's input is y's size and its output x's size: (H_out - 1) s - 2p + d (kH - 1) + 1 +
// output_padding = H with output_padding = (H + 2p - d (kH - 1) - 1) mod s (< s, so always a valid one). Hence
//   conv2d forward       = conv_transpose2d grad_input  (grad_output = x, weight = w),
//   conv2d grad_input    = conv_transpose2d forward     (input = grad_y, weight = w),
//   conv2d grad_weight   = conv_transpose2d grad_weight (input = grad_y, grad_output = x),
// and conv2d's grad_bias is the sum of grad_y over (n, h, w).
#pragma once

#include "conv_transpose_shape.h"

#include <ATen/core/Tensor.h>
#include <c10/core/MemoryFormat.h>

#include <optional>

namespace hierpar::detail {

// Checks the arguments of conv2d (and of its backward) and returns the geometry of the dual transposed
// convolution: input = conv2d's output [N, C_out, H_out, W_out], output = conv2d's input [N, C_in, H, W], same
// weight, stride, padding, dilation and groups. `input` may be 3-d (unbatched) or 4-d. Every message names the
// argument.
ConvTranspose2dGeometry check_conv2d(const at::Tensor& input, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                     at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                                     std::optional<double> leaky_relu_slope = std::nullopt);

// The forward output's memory format: at::conv2d's rule, channels_last when the input or the weight is (on the
// CPU and on CUDA alike, as for at::conv_transpose2d), so this is conv_transpose2d_output_layout itself.
// grad_input keeps the input's layout and grad_weight the weight's, as in hierpar::conv_transpose2d.
c10::MemoryFormat conv2d_output_layout(const at::Tensor& input4, const at::Tensor& weight);

// Checks grad_output against the forward's output shape (same batchedness as input), dtype and device.
void check_conv2d_grad_output(const at::Tensor& grad_output, const at::Tensor& input,
                              const ConvTranspose2dGeometry& dual);

}  // namespace hierpar::detail
