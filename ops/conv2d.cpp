// Schemas of hierpar::conv2d and its backward, and their C++ entry points. The kernels are
// hierpar::conv_transpose2d's, called with the dual arguments (see conv2d_shape.h).
#include "hierpar/ops.h"
#include "typed_op.h"

#include <torch/library.h>

namespace hierpar::ops {

at::Tensor conv2d(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                  std::optional<double> leaky_relu_slope) {
  static const auto op = detail::typed_op<decltype(conv2d)>("hierpar::conv2d");
  return op.call(input, weight, bias, stride, padding, dilation, groups, leaky_relu_slope);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                               const at::Tensor& weight, at::IntArrayRef stride,
                                                               at::IntArrayRef padding, at::IntArrayRef dilation,
                                                               int64_t groups, std::array<bool, 3> output_mask) {
  static const auto op = detail::typed_op<decltype(conv2d_backward)>("hierpar::conv2d_backward");
  return op.call(grad_output, input, weight, stride, padding, dilation, groups, output_mask);
}

}  // namespace hierpar::ops

TORCH_LIBRARY_FRAGMENT(hierpar, m) {
  m.def(
      "conv2d(Tensor input, Tensor weight, Tensor? bias=None, int[2] stride=1, int[2] padding=0, "
      "int[2] dilation=1, int groups=1, float? leaky_relu_slope=None) -> Tensor");
  m.def(
      "conv2d_backward(Tensor grad_output, Tensor input, Tensor weight, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups, bool[3] output_mask) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
}
