// Argument checks common to hierpar::conv2d and hierpar::conv_transpose2d (private to hierpar_ops); every message
// starts with `op`, the checked op's name ("hierpar::conv2d", "hierpar::conv2d_backward", ...).
#pragma once

#include "conv_transpose_shape.h"

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <vector>

namespace hierpar::detail {

// input and weight defined, input 3-d (unbatched) or 4-d, weight 4-d (`weight_dims` names its dimensions, e.g.
// "[C_out, C_in/groups, kH, kW]"), a floating dtype, and the weight's dtype and device equal to the input's.
void check_conv_operands(const char* op, const at::Tensor& input, const at::Tensor& weight, const char* weight_dims);

// A 1- or 2-element argument (`what`: its name) as its two spatial values.
std::array<int64_t, 2> conv_pair(const char* op, at::IntArrayRef values, const char* what);

// Positive stride and dilation, non-negative padding (`s`, `p`, `d`: the arguments as conv_pair gives them).
void check_conv_window(const char* op, const std::array<int64_t, 2>& s, const std::array<int64_t, 2>& p,
                       const std::array<int64_t, 2>& d, at::IntArrayRef stride, at::IntArrayRef padding,
                       at::IntArrayRef dilation);

// Sets g's kernel size (from the 4-d weight), stride, padding and dilation.
void set_conv_window(ConvTranspose2dGeometry& g, const at::Tensor& weight, const std::array<int64_t, 2>& s,
                     const std::array<int64_t, 2>& p, const std::array<int64_t, 2>& d);

// A defined bias must be 1-d with `out_channels` elements (`out_channels_is`: how they follow from the weight) and
// have the input's dtype and device.
void check_conv_bias(const char* op, const std::optional<at::Tensor>& bias, int64_t out_channels,
                     const char* out_channels_is, const at::Tensor& input);

// grad_output must be defined with the forward output's shape (`output_sizes`, 4-d; 3-d for an unbatched input),
// dtype and device.
void check_conv_grad_output(const char* op, const at::Tensor& grad_output, const at::Tensor& input,
                            std::vector<int64_t> output_sizes);

}  // namespace hierpar::detail
