// The fast CUDA path of hierpar::conv_transpose2d for kernel 4, stride 2, padding 1 (DCGAN's upsampling
// layers): phase-decomposed implicit GEMMs on the tensor cores, no column buffer (see
// conv_transpose_k4s2p1.cu). Private to hierpar_ops; conv_transpose_kernel.cu calls it when it applies.
#pragma once

#include "conv_transpose_shape.h"

#include <ATen/core/Tensor.h>

namespace hierpar::detail {

// True when the fast path computes this call: kernel 4x4, stride 2, padding 1, dilation 1, output_padding 0,
// groups 1, C_out >= 16, dtype bf16/fp16, or fp32 with TF32 allowed for convolutions, and 32-bit element indices. The
// caller also requires no bias (the DCGAN layers have none; a bias goes the general path).
bool k4s2p1_fast_path_applies(const ConvTranspose2dGeometry& g, at::ScalarType dtype);

// out: [N, C_out, 2H, 2W], allocated by the caller, dense in `out_channels_last`'s layout. input4: 4-d.
void k4s2p1_forward(const ConvTranspose2dGeometry& g, const at::Tensor& input4, const at::Tensor& weight,
                    const at::Tensor& out, bool out_channels_last);

// Either output may be undefined (not asked for). grad_input is dense in `grad_input_channels_last`'s layout;
// grad_weight may have any layout.
void k4s2p1_backward(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4, const at::Tensor& input4,
                     const at::Tensor& weight, const at::Tensor& grad_input, bool grad_input_channels_last,
                     const at::Tensor& grad_weight);

}  // namespace hierpar::detail
