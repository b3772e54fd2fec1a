#pragma once
// Which kernels a convolution layer's call should run on: hierpar's or ATen's (cuDNN). hierpar::nn's Conv2d and
// ConvTranspose2d call conv2d_layer / conv_transpose2d_layer below, which ask before each call and take ATen's
// convolution where hierpar's kernels measured slower, so swapping in a hierpar layer never trades a faster kernel for
// a slower one. The operators hierpar::ops::conv2d and conv_transpose2d themselves always run hierpar's kernels. On the CPU the answer is always hierpar's op,
// which chooses between ATen and its reference kernels itself (docs/cpu.md). Switch::layer_routing off: always yes.
//
// The table (docs/architectures.md, "Which layer runs where"), measured on H100/H200 in the DCGAN's step:
//  - conv_transpose2d: a generator's projection (kernel 4, stride 1, padding 0) and a small-C_out output layer
//    (C_out <= 4, kernel 4, stride 2, padding 1), with dilation 1, one group and no output padding; the output
//    layer in TF32 NCHW only from batch 256 in a CUDA graph capture and 1024 eagerly. The middle k4s2p1 layers and
//    everything else run on cuDNN.
//  - conv2d: a small-C_in input layer (C_in <= 4, kernel 4, stride 2, padding 1, dilation 1, one group): in
//    bf16/fp16 (autocast included), or in float32 where its passes run as TF32 on tensor cores (TF32 allowed for
//    convolutions, a channels_last input, C_out % 16 == 0); a window over the whole input (stride 1, no padding,
//    dilation 1, one group, input H x W == kernel). Everything else on cuDNN.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>

namespace hierpar::ops {

// A convolution call as the routing sees it: plain values, so the table can be tested without a GPU.
struct ConvCall {
  bool cuda = false;
  at::ScalarType dtype = at::kFloat;  // the input's
  bool autocast = false;              // CUDA autocast on (the call then runs in the autocast dtype)
  bool channels_last = false;         // the input is channels_last
  bool tf32 = false;                  // TF32 allowed for convolutions (at::globalContext)
  int64_t batch = 1;                  // the input's N (1 unbatched)
  int64_t in_channels = 0, out_channels = 0, groups = 1;
  int64_t input_h = 0, input_w = 0, kernel_h = 0, kernel_w = 0;
  int64_t stride_h = 1, stride_w = 1, padding_h = 0, padding_w = 0, dilation_h = 1, dilation_w = 1;
  int64_t output_padding_h = 0, output_padding_w = 0;  // conv_transpose2d only
  bool captured = false;  // queued into a CUDA graph's capture: its replay pays GPU time alone, not the host's
};

bool hierpar_wins_conv_transpose2d(const ConvCall& call);
bool hierpar_wins_conv2d(const ConvCall& call);

// The same for a call's tensors and arguments (weight layouts as at::conv_transpose2d's and at::conv2d's), with the
// switch applied.
bool conv_transpose2d_on_hierpar(const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
                                 at::IntArrayRef padding, at::IntArrayRef output_padding, int64_t groups,
                                 at::IntArrayRef dilation);
bool conv2d_on_hierpar(const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups);

// What a layer runs (operators hierpar::conv2d_layer / conv_transpose2d_layer, CompositeImplicitAutograd): the call
// on hierpar's op where the table says so, else on ATen's convolution (cuDNN), with conv2d's optional LeakyReLU
// applied after it. Arguments as hierpar::ops::conv2d's and conv_transpose2d's.
at::Tensor conv2d_layer(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                        std::optional<double> leaky_relu_slope);
at::Tensor conv_transpose2d_layer(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                  at::IntArrayRef padding, at::IntArrayRef output_padding, int64_t groups,
                                  at::IntArrayRef dilation);

}  // namespace hierpar::ops
