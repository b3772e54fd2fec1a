// Schemas of hierpar::conv_transpose2d and its backward, and their C++ entry points.
#include "hierpar/ops.h"
#include "typed_op.h"

#include <torch/library.h>

namespace hierpar::ops {

at::Tensor conv_transpose2d(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef output_padding,
                            int64_t groups, at::IntArrayRef dilation) {
  static const auto op = detail::typed_op<decltype(conv_transpose2d)>("hierpar::conv_transpose2d");
  return op.call(input, weight, bias, stride, padding, output_padding, groups, dilation);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_transpose2d_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef output_padding, int64_t groups, at::IntArrayRef dilation,
    std::array<bool, 3> output_mask) {
  static const auto op = detail::typed_op<decltype(conv_transpose2d_backward)>("hierpar::conv_transpose2d_backward");
  return op.call(grad_output, input, weight, stride, padding, output_padding, groups, dilation, output_mask);
}

}  // namespace hierpar::ops

TORCH_LIBRARY_FRAGMENT(hierpar, m) {
  m.def(
      "conv_transpose2d(Tensor input, Tensor weight, Tensor? bias=None, int[2] stride=1, int[2] padding=0, "
      "int[2] output_padding=0, int groups=1, int[2] dilation=1) -> Tensor");
  m.def(
      "conv_transpose2d_backward(Tensor grad_output, Tensor input, Tensor weight, int[2] stride, "
      "int[2] padding, int[2] output_padding, int groups, int[2] dilation, bool[3] output_mask) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
}
