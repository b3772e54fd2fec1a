// CUDA kernels of hierpar::conv2d and its backward: conv_transpose2d's CUDA backend with the dual arguments
// (conv2d_shape.h, conv2d_dual.h), so no cuDNN; the backend sets the device guard. DCGAN's first discriminator
// layer (C_in <= 4, kernel 4, stride 2, padding 1) is the dual of the small-C_out transposed convolution: its
// forward runs k4s2p1_small_cout_grad_input, its grad_input k4s2p1_small_cout_forward and its grad_weight
// k4s2p1_small_cout_grad_weight (ops/cuda/small_cout/), tensor-core kernels in bf16/fp16, and in
// fp32 as TF32 where convolutions may use TF32, when C_out % 16 == 0; k4s2p1 layers with C_in >= 16 take the implicit-GEMM kernels of k4s2p1/.
// With both gradients asked for, grad_weight runs on a side stream alongside grad_input (ops/cuda/side_stream.h).
#include "conv2d_dual.h"
#include "cuda/side_stream.h"

#include <torch/library.h>

namespace hierpar::detail {
namespace {

void on_two_streams(c10::Device device, c10::function_ref<void()> first, c10::function_ref<void()> second) {
  run_side_by_side(device, first, second);
}

constexpr ConvTranspose2dBackend kCuda{&run_conv_transpose2d_forward_cuda, &run_conv_transpose2d_backward_cuda,
                                       &on_two_streams};

at::Tensor conv2d_cuda(const ConvTranspose2dGeometry& dual, const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, std::optional<double> leaky_relu_slope) {
  return conv2d_on(kCuda, dual, input, weight, bias, leaky_relu_slope);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_cuda(const ConvTranspose2dGeometry& dual,
                                                                    const at::Tensor& grad_output,
                                                                    const at::Tensor& input, const at::Tensor& weight,
                                                                    std::array<bool, 3> output_mask) {
  return conv2d_backward_on(kCuda, dual, grad_output, input, weight, output_mask);
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, CUDA, m) {
  hierpar::detail::register_conv2d<&hierpar::detail::conv2d_cuda, &hierpar::detail::conv2d_backward_cuda>(m);
}
