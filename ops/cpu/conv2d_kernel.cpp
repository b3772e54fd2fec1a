// CPU kernels of hierpar::conv2d and its backward: float32/float64 on ATen's kernels (cpu_conv_on_aten), else
// conv_transpose2d's CPU backend with the dual arguments (conv2d_shape.h, conv2d_dual.h).
#include "common.h"
#include "conv2d_dual.h"
#include "conv2d_shape.h"

#include <ATen/ops/conv2d.h>
#include <ATen/ops/leaky_relu.h>
#include <torch/library.h>

namespace hierpar::detail {
namespace {

void one_after_the_other(c10::Device, c10::function_ref<void()> first, c10::function_ref<void()> second) {
  first();
  second();
}

// Whether some output position of the convolution reads only padding along a spatial dimension (every tap of its
// window falls outside the input).
bool has_padding_only_outputs(at::IntArrayRef input_hw, at::IntArrayRef kernel_hw, at::IntArrayRef stride,
                              at::IntArrayRef padding, at::IntArrayRef dilation) {
  auto at_or_first = [](at::IntArrayRef a, size_t i) { return a.size() > i ? a[i] : a[0]; };
  for (size_t i = 0; i < 2; ++i) {
    const int64_t in = input_hw[i], k = kernel_hw[i], s = at_or_first(stride, i), p = at_or_first(padding, i),
                  d = at_or_first(dilation, i);
    const int64_t out = (in + 2 * p - d * (k - 1) - 1) / s + 1;
    for (int64_t o = 0; o < out; ++o) {
      bool reads_input = false;
      for (int64_t t = 0; t < k && !reads_input; ++t) {
        const int64_t at = o * s - p + t * d;
        reads_input = at >= 0 && at < in;
      }
      if (!reads_input) return true;
    }
  }
  return false;
}

constexpr ConvTranspose2dBackend kCpu{&run_conv_transpose2d_forward_cpu, &run_conv_transpose2d_backward_cpu,
                                      &one_after_the_other};

at::Tensor conv2d_cpu(const ConvTranspose2dGeometry& dual, const at::Tensor& input, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias, std::optional<double> leaky_relu_slope) {
  if (cpu_conv_on_aten(input)) {
    const std::array<int64_t, 2> stride{dual.stride_h, dual.stride_w}, padding{dual.pad_h, dual.pad_w},
        dilation{dual.dilation_h, dual.dilation_w};
    const bool unbatched = input.dim() == 3;
    const at::Tensor input4 = unbatched ? input.unsqueeze(0) : input;
    // ATen's float32 CPU convolution (oneDNN's brgemm kernel, torch 2.11) crashed with SIGSEGV on calls with a bias
    // whose output has positions reading only padding (e.g. width 1, padding 1, stride 2, dilation 2); there the
    // bias is added after the convolution instead.
    const bool bias_after = bias.has_value() && bias->defined() &&
                            has_padding_only_outputs(input4.sizes().slice(2), weight.sizes().slice(2), stride,
                                                     padding, dilation);
    at::Tensor out =
        at::conv2d(input4, weight, bias_after ? std::nullopt : bias, stride, padding, dilation, dual.groups);
    if (bias_after) out.add_(bias->view({1, -1, 1, 1}));
    if (leaky_relu_slope) at::leaky_relu_(out, *leaky_relu_slope);
    out = with_layout_strides(out, conv2d_output_layout(input4, weight));
    return unbatched ? out.squeeze(0) : out;
  }
  return conv2d_on(kCpu, dual, input, weight, bias, leaky_relu_slope);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_cpu(const ConvTranspose2dGeometry& dual,
                                                                   const at::Tensor& grad_output,
                                                                   const at::Tensor& input, const at::Tensor& weight,
                                                                   std::array<bool, 3> output_mask) {
  if (cpu_conv_on_aten(input))
    return aten_convolution_backward(dual, /*transposed=*/false, grad_output, input, weight, output_mask);
  return conv2d_backward_on(kCpu, dual, grad_output, input, weight, output_mask);
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, CPU, m) {
  hierpar::detail::register_conv2d<&hierpar::detail::conv2d_cpu, &hierpar::detail::conv2d_backward_cpu>(m);
}
