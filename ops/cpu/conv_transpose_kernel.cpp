// CPU kernels of hierpar::conv_transpose2d and its backward: float32/float64 on ATen's kernels
// (cpu_conv_on_aten), else per-group GEMMs (at::bmm) on a column buffer, with hierpar's own col2im gather
// (forward) and im2col (backward), see conv_transpose_shape.h.
// Arithmetic is in float64 for double inputs and float32 otherwise (bf16/fp16 inputs widen exactly), so
// the CPU path is the accurate reference the CUDA path is compared with. Outputs follow the input's memory
// format (grad_weight the weight's).
#include "common.h"
#include "conv_transpose_backends.h"
#include "conv_transpose_shape.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/conv_transpose2d.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/leaky_relu.h>
#include <ATen/ops/sum.h>
#include <torch/library.h>

namespace hierpar::detail {
namespace {

at::ScalarType acc_type_of(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// input [N, C_in, H, W] (any layout) as per-group row matrices [G, N*H*W, C_in/G] in `acc`.
at::Tensor input_rows(const at::Tensor& input4, const ConvTranspose2dGeometry& g, at::ScalarType acc) {
  return input4.to(acc).permute({0, 2, 3, 1}).reshape({g.in_pixels(), g.groups, g.cin_g()}).transpose(0, 1);
}

// weight [C_in, C_out/G, kH, kW] as [G, C_in/G, kH * kW * C_out/G] (tap-major, channel-minor columns).
at::Tensor weight_matrices(const at::Tensor& weight, const ConvTranspose2dGeometry& g, at::ScalarType acc) {
  return weight.to(acc).permute({0, 2, 3, 1}).reshape({g.groups, g.cin_g(), g.cols_per_group()});
}

}  // namespace

void run_conv_transpose2d_forward_cpu(const ConvTranspose2dGeometry& g, const at::Tensor& input4,
                                      const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& out) {
  if (out.numel() == 0) return;
  const auto acc = acc_type_of(input4.scalar_type());
  // cols [G, N*H*W, taps * C_out/G]
  const at::Tensor cols = at::bmm(input_rows(input4, g, acc), weight_matrices(weight, g, acc)).contiguous();
  const ColsStrides cs{g.cols_per_group(), g.in_pixels() * g.cols_per_group()};
  const at::Tensor bias_acc = bias.defined() ? bias.to(acc).contiguous() : at::Tensor();
  at::Tensor result = at::empty({g.batch, g.out_channels, g.out_h, g.out_w}, input4.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES(acc, "conv_transpose2d_cpu_col2im", [&] {
    const scalar_t* cols_p = cols.const_data_ptr<scalar_t>();
    const scalar_t* bias_p = bias_acc.defined() ? bias_acc.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* res_p = result.mutable_data_ptr<scalar_t>();
    // One task per output row (n, co, oy).
    at::parallel_for(0, g.batch * g.out_channels * g.out_h, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t oy = r % g.out_h, co = (r / g.out_h) % g.out_channels, n = r / (g.out_h * g.out_channels);
        const scalar_t b = bias_p ? bias_p[co] : scalar_t(0);
        for (int64_t ox = 0; ox < g.out_w; ++ox) {
          res_p[r * g.out_w + ox] = b + col2im_gather<scalar_t>(g, cs, cols_p, n, co, oy, ox);
        }
      }
    });
  });
  out.copy_(result);
}

void run_conv_transpose2d_backward_cpu(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4,
                                       const at::Tensor& input4, const at::Tensor& weight,
                                       const at::Tensor& grad_input, const at::Tensor& grad_weight,
                                       std::optional<double> grad_input_leaky_relu_slope) {
  if (!grad_input.defined() && !grad_weight.defined()) return;
  if (g.in_pixels() == 0 || g.out_channels == 0) {
    // No input pixels (batch 0) or no output channels: the sums are empty.
    if (grad_input.defined()) grad_input.zero_();
    if (grad_weight.defined()) grad_weight.zero_();
    return;
  }
  const auto acc = acc_type_of(grad_output4.scalar_type());
  const at::Tensor go_acc = grad_output4.to(acc);
  // cols [G, N*H*W, taps * C_out/G] = im2col(grad_output)
  at::Tensor cols = at::empty({g.groups, g.in_pixels(), g.cols_per_group()}, go_acc.options());
  AT_DISPATCH_FLOATING_TYPES(acc, "conv_transpose2d_cpu_im2col", [&] {
    const scalar_t* go_p = go_acc.const_data_ptr<scalar_t>();
    const int64_t go_strides[4] = {go_acc.stride(0), go_acc.stride(1), go_acc.stride(2), go_acc.stride(3)};
    scalar_t* cols_p = cols.mutable_data_ptr<scalar_t>();
    const int64_t cout_g = g.cout_g();
    at::parallel_for(0, g.groups * g.in_pixels(), 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t grp = r / g.in_pixels(), pix = r % g.in_pixels();
        const int64_t ix = pix % g.in_w, iy = (pix / g.in_w) % g.in_h, n = pix / (g.in_w * g.in_h);
        scalar_t* dst = cols_p + r * g.cols_per_group();
        for (int64_t ky = 0; ky < g.kernel_h; ++ky) {
          for (int64_t kx = 0; kx < g.kernel_w; ++kx) {
            for (int64_t c = 0; c < cout_g; ++c) {
              const scalar_t* src = im2col_source(g, go_p, go_strides, n, iy, ix, ky, kx, grp * cout_g + c);
              *dst++ = src ? *src : scalar_t(0);
            }
          }
        }
      }
    });
  });
  if (grad_input.defined()) {
    // [G, N*H*W, C_in/G] -> [N, C_in, H, W]
    const at::Tensor rows = at::bmm(cols, weight_matrices(weight, g, acc).transpose(1, 2));
    grad_input.copy_(rows.transpose(0, 1).reshape({g.batch, g.in_h, g.in_w, g.in_channels}).permute({0, 3, 1, 2}));
    if (grad_input_leaky_relu_slope) {
      at::Tensor in_place = grad_input;  // a handle on the same storage (the parameter is const)
      at::leaky_relu_(in_place, *grad_input_leaky_relu_slope);
    }
  }
  if (grad_weight.defined()) {
    // [G, C_in/G, taps * C_out/G] -> [C_in, C_out/G, kH, kW]
    const at::Tensor gw = at::bmm(input_rows(input4, g, acc).transpose(1, 2), cols);
    grad_weight.copy_(gw.reshape({g.in_channels, g.kernel_h, g.kernel_w, g.cout_g()}).permute({0, 3, 1, 2}));
  }
}

namespace {

// The transposed convolution's output_padding: what its output size has beyond the plain formula's.
std::array<int64_t, 2> output_padding_of(const ConvTranspose2dGeometry& g) {
  return {g.out_h - ((g.in_h - 1) * g.stride_h - 2 * g.pad_h + g.dilation_h * (g.kernel_h - 1) + 1),
          g.out_w - ((g.in_w - 1) * g.stride_w - 2 * g.pad_w + g.dilation_w * (g.kernel_w - 1) + 1)};
}

}  // namespace

bool cpu_conv_on_aten(const at::Tensor& input) {
  return switch_on(Switch::cpu_aten) && (input.scalar_type() == at::kFloat || input.scalar_type() == at::kDouble);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aten_convolution_backward(const ConvTranspose2dGeometry& g,
                                                                        bool transposed, const at::Tensor& grad_output,
                                                                        const at::Tensor& input, const at::Tensor& weight,
                                                                        std::array<bool, 3> output_mask) {
  const bool unbatched = input.dim() == 3;
  const at::Tensor input4 = unbatched ? input.unsqueeze(0) : input;
  const at::Tensor grad_output4 = unbatched ? grad_output.unsqueeze(0) : grad_output;
  const std::array<int64_t, 2> output_padding = transposed ? output_padding_of(g) : std::array<int64_t, 2>{0, 0};
  // conv2d's output channels are its dual's input channels.
  const std::array<int64_t, 1> bias_sizes{transposed ? g.out_channels : g.in_channels};
  auto [grad_input, grad_weight, grad_bias] = at::convolution_backward(
      grad_output4, input4, weight, output_mask[2] ? at::OptionalIntArrayRef(bias_sizes) : std::nullopt,
      {g.stride_h, g.stride_w}, {g.pad_h, g.pad_w}, {g.dilation_h, g.dilation_w}, transposed, output_padding,
      g.groups, output_mask);
  if (grad_input.defined()) {
    grad_input = with_layout_strides(grad_input, layout_of(input4));
    if (unbatched) grad_input = grad_input.squeeze(0);
  }
  if (grad_weight.defined()) grad_weight = with_layout_strides(grad_weight, layout_of(weight));
  return {grad_input, grad_weight, grad_bias};
}

namespace {

at::Tensor conv_transpose2d_cpu(const ConvTranspose2dGeometry& g, const at::Tensor& input, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.device().is_cpu(), "hierpar::conv_transpose2d (CPU kernel): input must be on the CPU");
  if (cpu_conv_on_aten(input)) {
    const bool unbatched = input.dim() == 3;
    const at::Tensor input4 = unbatched ? input.unsqueeze(0) : input;
    const at::Tensor out = with_layout_strides(
        at::conv_transpose2d(input4, weight, bias, {g.stride_h, g.stride_w}, {g.pad_h, g.pad_w}, output_padding_of(g),
                             g.groups, {g.dilation_h, g.dilation_w}),
        conv_transpose2d_output_layout(input4, weight));
    return unbatched ? out.squeeze(0) : out;
  }
  return conv_transpose2d_forward_on(&run_conv_transpose2d_forward_cpu, g, input, weight, bias);
}

// In the accumulation type, then rounded once to grad_bias's dtype.
void sum_grad_bias_cpu(const at::Tensor& grad_output4, at::Tensor& grad_bias) {
  grad_bias.copy_(at::sum(grad_output4.to(acc_type_of(grad_output4.scalar_type())), {0, 2, 3}));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_transpose2d_backward_cpu(
    const ConvTranspose2dGeometry& g, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    std::array<bool, 3> output_mask) {
  TORCH_CHECK(input.device().is_cpu(), "hierpar::conv_transpose2d_backward (CPU kernel): input must be on the CPU");
  if (cpu_conv_on_aten(input)) return aten_convolution_backward(g, /*transposed=*/true, grad_output, input, weight, output_mask);
  return conv_transpose2d_backward_on(&run_conv_transpose2d_backward_cpu, &sum_grad_bias_cpu, g, grad_output, input,
                                      weight, output_mask);
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, CPU, m) {
  hierpar::detail::register_conv_transpose2d<&hierpar::detail::conv_transpose2d_cpu,
                                             &hierpar::detail::conv_transpose2d_backward_cpu>(m);
}
