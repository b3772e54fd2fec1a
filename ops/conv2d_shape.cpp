// Argument checks of hierpar::conv2d shared by its CPU, CUDA and Meta kernels.
#include "conv2d_shape.h"

#include <c10/core/ScalarType.h>

#include <array>
#include <vector>

namespace hierpar::detail {
namespace {

std::array<int64_t, 2> pair_of(at::IntArrayRef values, const char* what) {
  TORCH_CHECK(values.size() == 1 || values.size() == 2, "hierpar::conv2d: ", what, " must have 1 or 2 elements, got ",
              values.size());
  return {values[0], values.size() == 2 ? values[1] : values[0]};
}

}  // namespace

ConvTranspose2dGeometry check_conv2d(const at::Tensor& input, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                     at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                                     std::optional<double> leaky_relu_slope) {
  TORCH_CHECK(input.defined(), "hierpar::conv2d: input is undefined");
  TORCH_CHECK(weight.defined(), "hierpar::conv2d: weight is undefined");
  TORCH_CHECK(input.dim() == 3 || input.dim() == 4, "hierpar::conv2d: input must be 3-d (unbatched) or 4-d [N, C_in, H, W], ",
              "got a ", input.dim(), "-d tensor of shape ", input.sizes());
  TORCH_CHECK(weight.dim() == 4, "hierpar::conv2d: weight must be 4-d [C_out, C_in/groups, kH, kW], got a ", weight.dim(),
              "-d tensor of shape ", weight.sizes());
  const auto dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
              "hierpar::conv2d: input must be float32, float64, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(weight.scalar_type() == dtype, "hierpar::conv2d: weight's dtype (", weight.scalar_type(),
              ") must equal input's dtype (", dtype, ")");
  TORCH_CHECK(weight.device() == input.device(), "hierpar::conv2d: weight is on ", weight.device(), " but input is on ",
              input.device(), "; they must be on the same device");

  const auto s = pair_of(stride, "stride");
  const auto p = pair_of(padding, "padding");
  const auto d = pair_of(dilation, "dilation");
  TORCH_CHECK(s[0] > 0 && s[1] > 0, "hierpar::conv2d: stride must be positive, got ", stride);
  TORCH_CHECK(d[0] > 0 && d[1] > 0, "hierpar::conv2d: dilation must be positive, got ", dilation);
  TORCH_CHECK(p[0] >= 0 && p[1] >= 0, "hierpar::conv2d: padding must be non-negative, got ", padding);
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
  g.kernel_h = weight.size(2);
  g.kernel_w = weight.size(3);
  g.stride_h = s[0];
  g.stride_w = s[1];
  g.pad_h = p[0];
  g.pad_w = p[1];
  g.dilation_h = d[0];
  g.dilation_w = d[1];

  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0),
                "hierpar::conv2d: bias must be 1-d with out_channels = weight.size(0) = ", weight.size(0),
                " elements, got shape ", bias->sizes());
    TORCH_CHECK(bias->scalar_type() == dtype, "hierpar::conv2d: bias's dtype (", bias->scalar_type(),
                ") must equal input's dtype (", dtype, ")");
    TORCH_CHECK(bias->device() == input.device(), "hierpar::conv2d: bias is on ", bias->device(), " but input is on ",
                input.device(), "; they must be on the same device");
  }
  return g;
}

c10::MemoryFormat conv2d_output_layout(const at::Tensor& input4, const at::Tensor& weight) {
  return conv_transpose2d_output_layout(input4, weight);
}

void check_conv2d_grad_output(const at::Tensor& grad_output, const at::Tensor& input,
                              const ConvTranspose2dGeometry& dual) {
  TORCH_CHECK(grad_output.defined(), "hierpar::conv2d_backward: grad_output is undefined");
  std::vector<int64_t> expected{dual.batch, dual.in_channels, dual.in_h, dual.in_w};
  if (input.dim() == 3) expected.erase(expected.begin());
  TORCH_CHECK(grad_output.sizes() == at::IntArrayRef(expected), "hierpar::conv2d_backward: grad_output must have the forward ",
              "output's shape ", at::IntArrayRef(expected), ", got ", grad_output.sizes());
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(), "hierpar::conv2d_backward: grad_output's dtype (",
              grad_output.scalar_type(), ") must equal input's dtype (", input.scalar_type(), ")");
  TORCH_CHECK(grad_output.device() == input.device(), "hierpar::conv2d_backward: grad_output is on ", grad_output.device(),
              " but input is on ", input.device());
}

}  // namespace hierpar::detail
