// hierpar::conv2d_layer and hierpar::conv_transpose2d_layer: what a convolution layer runs, as one operator. Each
// asks the routing table (hierpar/routing.h) and calls hierpar's op or ATen's convolution, so hierpar::nn's C++
// layers, its Python layers and TorchScript share one decision. Registered as CompositeImplicitAutograd: autograd
// differentiates whichever op was called, and torch.compile traces through the decision (made once per compiled
// shape, from the tensors' metadata), so a layer adds no graph break (docs/python.md).
#include "hierpar/ops.h"
#include "hierpar/routing.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/conv2d.h>
#include <ATen/ops/conv_transpose2d.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/leaky_relu.h>
#include <torch/library.h>

namespace hierpar::ops {
namespace {

// The cuDNN route: for a batched real input at::convolution, which at::conv2d and at::conv_transpose2d call after
// their unbatched-input and complex checks (the same kernels and autograd node, one dispatch fewer, so the layer's
// host cost stays under stock's); anything else through those functions.
at::Tensor aten_convolution(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                            at::IntArrayRef output_padding, int64_t groups) {
  if (input.dim() == 4 && !input.is_complex()) {
    const int64_t no_output_padding[2] = {0, 0};
    return at::convolution(input, weight, bias, stride, padding, dilation, transposed,
                           transposed ? output_padding : at::IntArrayRef(no_output_padding), groups);
  }
  return transposed ? at::conv_transpose2d(input, weight, bias, stride, padding, output_padding, groups, dilation)
                    : at::conv2d(input, weight, bias, stride, padding, dilation, groups);
}

}  // namespace

at::Tensor conv2d_layer(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                        std::optional<double> leaky_relu_slope) {
  if (conv2d_on_hierpar(input, weight, stride, padding, dilation, groups)) {
    return ops::conv2d(input, weight, bias, stride, padding, dilation, groups, leaky_relu_slope);
  }
  const at::Tensor output = aten_convolution(input, weight, bias, stride, padding, dilation, /*transposed=*/false, {},
                                             groups);
  return leaky_relu_slope ? at::leaky_relu(output, *leaky_relu_slope) : output;
}

at::Tensor conv_transpose2d_layer(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                  at::IntArrayRef padding, at::IntArrayRef output_padding, int64_t groups,
                                  at::IntArrayRef dilation) {
  if (conv_transpose2d_on_hierpar(input, weight, stride, padding, output_padding, groups, dilation)) {
    return ops::conv_transpose2d(input, weight, bias, stride, padding, output_padding, groups, dilation);
  }
  return aten_convolution(input, weight, bias, stride, padding, dilation, /*transposed=*/true, output_padding, groups);
}

}  // namespace hierpar::ops

TORCH_LIBRARY_FRAGMENT(hierpar, m) {
  m.def("conv2d_layer(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[2] padding, int[2] dilation, "
        "int groups, float? leaky_relu_slope=None) -> Tensor");
  m.def("conv_transpose2d_layer(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[2] padding, "
        "int[2] output_padding, int groups, int[2] dilation) -> Tensor");
}

TORCH_LIBRARY_IMPL(hierpar, CompositeImplicitAutograd, m) {
  m.impl("conv2d_layer", TORCH_FN(hierpar::ops::conv2d_layer));
  m.impl("conv_transpose2d_layer", TORCH_FN(hierpar::ops::conv_transpose2d_layer));
}
