// Meta kernels of hierpar::max_pool2d and its backward: the same checks, sizes, dtypes (uint8 indices) and
// memory formats as the CPU and CUDA kernels, without data (for shape inference, torch.compile, fake tensors).
#include "max_pool_shape.h"

#include <torch/library.h>

namespace hierpar::detail {
namespace {

std::tuple<at::Tensor, at::Tensor> max_pool2d_meta(const at::Tensor& input, at::IntArrayRef kernel_size,
                                                   at::IntArrayRef stride, at::IntArrayRef padding,
                                                   at::IntArrayRef dilation, bool ceil_mode) {
  return new_max_pool2d_outputs(max_pool2d_forward_geometry(input, kernel_size, stride, padding, dilation, ceil_mode),
                                input);
}

at::Tensor max_pool2d_backward_meta(const at::Tensor& grad_output, const at::Tensor& indices,
                                    at::IntArrayRef input_size, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                    at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  max_pool2d_backward_geometry(grad_output, indices, input_size, kernel_size, stride, padding, dilation, ceil_mode);
  return new_max_pool2d_grad_input(grad_output, indices, input_size);
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, Meta, m) {
  m.impl("max_pool2d", &hierpar::detail::max_pool2d_meta);
  m.impl("max_pool2d_backward", &hierpar::detail::max_pool2d_backward_meta);
}
