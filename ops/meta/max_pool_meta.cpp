// Meta kernels of hierpar::max_pool2d and its backward: the same checks, sizes, dtypes (uint8 indices) and
// memory formats as the CPU and CUDA kernels, without data (for shape inference, torch.compile, fake tensors).
#include "max_pool_shape.h"

#include <torch/library.h>

namespace hierpar::detail {
namespace {

at::Tensor max_pool2d_backward_meta(const MaxPool2dGeometry&, const at::Tensor& grad_output, const at::Tensor& indices,
                                    at::IntArrayRef input_size) {
  return new_max_pool2d_grad_input(grad_output, indices, input_size);
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, Meta, m) {
  hierpar::detail::register_max_pool2d<&hierpar::detail::new_max_pool2d_outputs,
                                       &hierpar::detail::max_pool2d_backward_meta>(m);
}
