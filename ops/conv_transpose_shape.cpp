// Argument checks of hierpar::conv_transpose2d shared by its CPU, CUDA and Meta kernels.
#include "conv_transpose_shape.h"

#include "common.h"
#include "conv_transpose_backends.h"
#include "conv_checks.h"

namespace hierpar::detail {

std::array<int64_t, 2> expand_pair(at::IntArrayRef values, const char* what) {
  return conv_pair("hierpar::conv_transpose2d", values, what);
}

ConvTranspose2dGeometry check_conv_transpose2d(const at::Tensor& input, const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                               at::IntArrayRef padding, at::IntArrayRef output_padding,
                                               int64_t groups, at::IntArrayRef dilation) {
  constexpr const char* name = "hierpar::conv_transpose2d";
  check_conv_operands(name, input, weight, "[C_in, C_out/groups, kH, kW]");
  const auto s = expand_pair(stride, "stride");
  const auto p = expand_pair(padding, "padding");
  const auto op = expand_pair(output_padding, "output_padding");
  const auto d = expand_pair(dilation, "dilation");
  check_conv_window(name, s, p, d, stride, padding, dilation);
  TORCH_CHECK(op[0] >= 0 && op[1] >= 0, "hierpar::conv_transpose2d: output_padding must be non-negative, got ",
              output_padding);
  for (int i = 0; i < 2; ++i) {
    // ATen's rule: an output_padding row or column must be reachable by some input pixel's kernel.
    TORCH_CHECK(op[i] < s[i] || op[i] < d[i], "hierpar::conv_transpose2d: output_padding (", op[i],
                ") must be smaller than either stride (", s[i], ") or dilation (", d[i], ") in spatial dim ", i);
  }
  TORCH_CHECK(groups > 0, "hierpar::conv_transpose2d: groups must be positive, got ", groups);

  const bool batched = input.dim() == 4;
  ConvTranspose2dGeometry g{};
  g.batch = batched ? input.size(0) : 1;
  g.in_channels = input.size(batched ? 1 : 0);
  g.in_h = input.size(batched ? 2 : 1);
  g.in_w = input.size(batched ? 3 : 2);
  TORCH_CHECK(g.in_channels > 0 && g.in_h > 0 && g.in_w > 0,
              "hierpar::conv_transpose2d: input must have non-zero channels, height and width, got shape ", input.sizes());
  TORCH_CHECK(g.in_channels % groups == 0, "hierpar::conv_transpose2d: groups (", groups,
              ") must divide the input channels (", g.in_channels, ")");
  TORCH_CHECK(weight.size(0) == g.in_channels, "hierpar::conv_transpose2d: weight.size(0) (", weight.size(0),
              ") must equal the input channels (", g.in_channels, "); weight is [C_in, C_out/groups, kH, kW]");
  TORCH_CHECK(weight.size(2) > 0 && weight.size(3) > 0,
              "hierpar::conv_transpose2d: weight's kernel size must be positive, got weight of shape ", weight.sizes());
  g.groups = groups;
  g.out_channels = weight.size(1) * groups;
  set_conv_window(g, weight, s, p, d);
  g.out_h = (g.in_h - 1) * s[0] - 2 * p[0] + d[0] * (g.kernel_h - 1) + op[0] + 1;
  g.out_w = (g.in_w - 1) * s[1] - 2 * p[1] + d[1] * (g.kernel_w - 1) + op[1] + 1;
  TORCH_CHECK(g.out_h > 0 && g.out_w > 0, "hierpar::conv_transpose2d: the output size [", g.out_h, ", ", g.out_w,
              "] is not positive: padding ", padding, " is too large for input size [", g.in_h, ", ", g.in_w,
              "], kernel [", g.kernel_h, ", ", g.kernel_w, "], stride ", stride, " and dilation ", dilation);

  check_conv_bias(name, bias, g.out_channels, "weight.size(1) * groups", input);
  return g;
}

void check_conv_transpose2d_grad_output(const at::Tensor& grad_output, const at::Tensor& input,
                                        const ConvTranspose2dGeometry& g) {
  check_conv_grad_output("hierpar::conv_transpose2d_backward", grad_output, input,
                         {g.batch, g.out_channels, g.out_h, g.out_w});
}

ConvTranspose2dGeometry check_conv_transpose2d_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                        const at::Tensor& weight, at::IntArrayRef stride,
                                                        at::IntArrayRef padding, at::IntArrayRef output_padding,
                                                        int64_t groups, at::IntArrayRef dilation) {
  const auto g = check_conv_transpose2d(input, weight, std::nullopt, stride, padding, output_padding, groups,
                                        dilation);
  check_conv_transpose2d_grad_output(grad_output, input, g);
  return g;
}

c10::MemoryFormat conv_transpose2d_output_layout(const at::Tensor& input4, const at::Tensor& weight) {
  const bool channels_last = layout_of(input4) == c10::MemoryFormat::ChannelsLast ||
                             layout_of(weight) == c10::MemoryFormat::ChannelsLast;
  return channels_last ? c10::MemoryFormat::ChannelsLast : c10::MemoryFormat::Contiguous;
}

at::Tensor conv_transpose2d_forward_on(ConvTranspose2dForwardFn run_forward, const ConvTranspose2dGeometry& g,
                                      const at::Tensor& input, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias) {
  const bool unbatched = input.dim() == 3;
  const at::Tensor input4 = unbatched ? input.unsqueeze(0) : input;
  at::Tensor out = new_output({g.batch, g.out_channels, g.out_h, g.out_w}, input.options(),
                              conv_transpose2d_output_layout(input4, weight));
  run_forward(g, input4, weight, bias.has_value() ? *bias : at::Tensor(), out);
  return unbatched ? out.squeeze(0) : out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_transpose2d_backward_on(
    ConvTranspose2dBackwardFn run_backward, void (*sum_grad_bias)(const at::Tensor& grad_output4, at::Tensor& grad_bias),
    const ConvTranspose2dGeometry& g, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, std::array<bool, 3> output_mask) {
  const bool unbatched = input.dim() == 3;
  const at::Tensor input4 = unbatched ? input.unsqueeze(0) : input;
  const at::Tensor grad_output4 = unbatched ? grad_output.unsqueeze(0) : grad_output;
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) grad_input = new_output(input4.sizes(), input.options(), layout_of(input4));
  if (output_mask[1]) grad_weight = new_output(weight.sizes(), weight.options(), layout_of(weight));
  if (output_mask[2]) {
    grad_bias = new_output({g.out_channels}, input.options());
    sum_grad_bias(grad_output4, grad_bias);
  }
  run_backward(g, grad_output4, input4, weight, grad_input, grad_weight, std::nullopt);
  if (unbatched && grad_input.defined()) grad_input = grad_input.squeeze(0);
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace hierpar::detail
