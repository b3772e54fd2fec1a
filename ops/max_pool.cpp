// Schemas of hierpar::max_pool2d and its backward, and their C++ entry points.
#include "hierpar/ops.h"
#include "typed_op.h"

#include <torch/library.h>

namespace hierpar::ops {

std::tuple<at::Tensor, at::Tensor> max_pool2d(const at::Tensor& input, at::IntArrayRef kernel_size,
                                              at::IntArrayRef stride, at::IntArrayRef padding,
                                              at::IntArrayRef dilation, bool ceil_mode, bool relu) {
  static const auto op = detail::typed_op<decltype(max_pool2d)>("hierpar::max_pool2d");
  return op.call(input, kernel_size, stride, padding, dilation, ceil_mode, relu);
}

at::Tensor max_pool2d_backward(const at::Tensor& grad_output, const at::Tensor& indices,
                               at::IntArrayRef input_size, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                               at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  static const auto op = detail::typed_op<decltype(max_pool2d_backward)>("hierpar::max_pool2d_backward");
  return op.call(grad_output, indices, input_size, kernel_size, stride, padding, dilation, ceil_mode);
}

}  // namespace hierpar::ops

TORCH_LIBRARY_FRAGMENT(hierpar, m) {
  m.def(
      "max_pool2d(Tensor input, int[2] kernel_size, int[2] stride=[], int[2] padding=0, int[2] dilation=1, "
      "bool ceil_mode=False, bool relu=False) -> (Tensor output, Tensor indices)");
  m.def(
      "max_pool2d_backward(Tensor grad_output, Tensor indices, int[] input_size, int[2] kernel_size, "
      "int[2] stride, int[2] padding, int[2] dilation, bool ceil_mode) -> Tensor");
}
