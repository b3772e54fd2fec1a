// The fast CUDA paths of hierpar::conv_transpose2d for kernel 4, stride 2, padding 1 (DCGAN's upsampling
// layers). Private to hierpar_ops; conv_transpose_kernel.cu calls them when they apply.
//  - k4s2p1/ (entry.cu, implicit_gemm.cu, wgmma_*.cu, sm90a_probe.cu): phase-decomposed implicit GEMMs on the
//    tensor cores (C_out >= 16): mma.sync, and wgmma on Hopper for bf16/fp16;
//  - small_cout/ (forward.cu, grad_input.cu, grad_weight.cu): kernels for C_out <= kSmallCoutMax (the RGB /
//    grayscale layer): mma.sync for bf16/fp16 and TF32 (fp32 with TF32 on for convolutions) with C_in % 16 == 0, CUDA cores otherwise.
#pragma once

#include "conv_transpose_shape.h"

#include <ATen/core/Tensor.h>

#include <optional>

namespace hierpar::detail {

// True when the GEMM fast path computes this call: kernel 4x4, stride 2, padding 1, dilation 1,
// output_padding 0, groups 1, C_out >= 16, dtype bf16/fp16, or fp32 with TF32 allowed for convolutions, and
// 32-bit element indices. The caller also requires no bias (the DCGAN layers have none; a bias goes the
// general path).
bool k4s2p1_fast_path_applies(const ConvTranspose2dGeometry& g, at::ScalarType dtype);

// out: [N, C_out, 2H, 2W], allocated by the caller, dense in `out_channels_last`'s layout. input4: 4-d.
void k4s2p1_forward(const ConvTranspose2dGeometry& g, const at::Tensor& input4, const at::Tensor& weight,
                    const at::Tensor& out, bool out_channels_last);

// Either output may be undefined (not asked for). grad_input is dense in `grad_input_channels_last`'s layout;
// grad_weight may have any layout. input4 is read only for grad_weight (it may be undefined otherwise).
void k4s2p1_backward(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4, const at::Tensor& input4,
                     const at::Tensor& weight, const at::Tensor& grad_input, bool grad_input_channels_last,
                     const at::Tensor& grad_weight);

constexpr int64_t kSmallCoutMax = 4;

// True when the small-C_out kernels compute this call: the k4s2p1 shape as above, C_out <= kSmallCoutMax,
// C_in * C_out <= 1024, fp32 / bf16 / fp16. Any layout, any bias. fp32 follows the TF32 flag of convolutions
// (allowTF32CuDNN(CONV)): TF32 tensor cores where it is on and the tensor-core kernels apply, true fp32 otherwise.
bool k4s2p1_small_cout_applies(const ConvTranspose2dGeometry& g, at::ScalarType dtype);

// Every tensor is read / written through its strides (out and grad_input are allocated by the caller).
// bias may be undefined.
void k4s2p1_small_cout_forward(const ConvTranspose2dGeometry& g, const at::Tensor& input4, const at::Tensor& weight,
                               const at::Tensor& bias, const at::Tensor& out);
// With leaky_relu_slope, grad_input is stored as leaky_relu(grad_input, slope) (hierpar::conv2d's fused activation).
void k4s2p1_small_cout_grad_input(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4,
                                  const at::Tensor& weight, const at::Tensor& grad_input,
                                  std::optional<double> leaky_relu_slope = std::nullopt);
// grad_weight has a kernel here for bf16 / fp16 / fp32-as-TF32 with C_in % 16 == 0 and an input whose channels are
// innermost (channels_last); the other cases take the general path (column buffer + cuBLAS).
bool k4s2p1_small_cout_grad_weight_applies(const ConvTranspose2dGeometry& g, const at::Tensor& input4);
void k4s2p1_small_cout_grad_weight(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4,
                                   const at::Tensor& input4, const at::Tensor& grad_weight);

}  // namespace hierpar::detail
