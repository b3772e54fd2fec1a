// CPU kernels of hierpar::conv2d and its backward: conv_transpose2d's CPU backend with the dual arguments
// (conv2d_shape.h, conv2d_dual.h).
#include "conv2d_dual.h"

#include <torch/library.h>

namespace hierpar::detail {
namespace {

void one_after_the_other(c10::Device, c10::function_ref<void()> first, c10::function_ref<void()> second) {
  first();
  second();
}

constexpr ConvTranspose2dBackend kCpu{&run_conv_transpose2d_forward_cpu, &run_conv_transpose2d_backward_cpu,
                                      &one_after_the_other};

at::Tensor conv2d_cpu(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                      std::optional<double> leaky_relu_slope) {
  return conv2d_on(kCpu, input, weight, bias, stride, padding, dilation, groups, leaky_relu_slope);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_cpu(const at::Tensor& grad_output,
                                                                   const at::Tensor& input, const at::Tensor& weight,
                                                                   at::IntArrayRef stride, at::IntArrayRef padding,
                                                                   at::IntArrayRef dilation, int64_t groups,
                                                                   std::array<bool, 3> output_mask) {
  return conv2d_backward_on(kCpu, grad_output, input, weight, stride, padding, dilation, groups, output_mask);
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, CPU, m) {
  m.impl("conv2d", TORCH_FN(hierpar::detail::conv2d_cpu));
  m.impl("conv2d_backward", TORCH_FN(hierpar::detail::conv2d_backward_cpu));
}
