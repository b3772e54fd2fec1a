// Argument checks of hierpar::conv2d shared by its CPU, CUDA and Meta kernels.
#include "conv2d_shape.h"

#include "conv_checks.h"

namespace hierpar::detail {

ConvTranspose2dGeometry check_conv2d(const at::Tensor& input, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                     at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                                     std::optional<double> leaky_relu_slope) {
  constexpr const char* name = "hierpar::conv2d";
  check_conv_operands(name, input, weight, "[C_out, C_in/groups, kH, kW]");
  const auto s = conv_pair(name, stride, "stride");
  const auto p = conv_pair(name, padding, "padding");
  const auto d = conv_pair(name, dilation, "dilation");
  check_conv_window(name, s, p, d, stride, padding, dilation);
  TORCH_CHECK(groups > 0, "hierpar::conv2d: groups must be positive, got ", groups);
  // The backward recovers the activation's mask from the output's sign, which a negative slope flips.
  TORCH_CHECK(!leaky_relu_slope || *leaky_relu_slope >= 0, "hierpar::conv2d: leaky_relu_slope must be non-negative, got ",
              leaky_relu_slope.value_or(0));

  const bool batched = input.dim() == 4;
  const int64_t in_channels = input.size(batched ? 1 : 0), h = input.size(batched ? 2 : 1),
                w = input.size(batched ? 3 : 2);
  TORCH_CHECK(in_channels > 0 && h > 0 && w > 0,
              "hierpar::conv2d: input must have non-zero channels, height and width, got shape ", input.sizes());
  TORCH_CHECK(in_channels % groups == 0, "hierpar::conv2d: groups (", groups, ") must divide the input channels (",
              in_channels, ")");
  TORCH_CHECK(weight.size(1) * groups == in_channels, "hierpar::conv2d: weight.size(1) (", weight.size(1), ") times groups (",
              groups, ") must equal the input channels (", in_channels, "); weight is [C_out, C_in/groups, kH, kW]");
  TORCH_CHECK(weight.size(0) > 0 && weight.size(0) % groups == 0, "hierpar::conv2d: weight.size(0) (the output channels, ",
              weight.size(0), ") must be a positive multiple of groups (", groups, ")");
  TORCH_CHECK(weight.size(2) > 0 && weight.size(3) > 0,
              "hierpar::conv2d: weight's kernel size must be positive, got weight of shape ", weight.sizes());
  const int64_t in_size[2] = {h, w};
  int64_t out_size[2];
  for (int i = 0; i < 2; ++i) {
    const int64_t span = in_size[i] + 2 * p[i] - d[i] * (weight.size(2 + i) - 1) - 1;  // >= 0 when one window fits
    out_size[i] = span >= 0 ? span / s[i] + 1 : 0;
  }
  TORCH_CHECK(out_size[0] > 0 && out_size[1] > 0, "hierpar::conv2d: the padded input [", h + 2 * p[0], ", ", w + 2 * p[1],
              "] (input size plus twice padding ", padding, ") is smaller than the dilated kernel [",
              d[0] * (weight.size(2) - 1) + 1, ", ", d[1] * (weight.size(3) - 1) + 1, "]");

  ConvTranspose2dGeometry g{};
  g.batch = batched ? input.size(0) : 1;
  g.in_channels = weight.size(0);
  g.in_h = out_size[0];
  g.in_w = out_size[1];
  g.out_channels = in_channels;
  g.out_h = h;
  g.out_w = w;
  g.groups = groups;
  set_conv_window(g, weight, s, p, d);
  check_conv_bias(name, bias, weight.size(0), "weight.size(0)", input);
  return g;
}

c10::MemoryFormat conv2d_output_layout(const at::Tensor& input4, const at::Tensor& weight) {
  return conv_transpose2d_output_layout(input4, weight);
}

void check_conv2d_grad_output(const at::Tensor& grad_output, const at::Tensor& input,
                              const ConvTranspose2dGeometry& dual) {
  check_conv_grad_output("hierpar::conv2d_backward", grad_output, input,
                         {dual.batch, dual.in_channels, dual.in_h, dual.in_w});
}

}  // namespace hierpar::detail
