// Argument checks of hierpar::conv_transpose2d shared by its CPU, CUDA and Meta kernels.
#include "conv_transpose_shape.h"

#include "common.h"

#include <c10/core/ScalarType.h>

namespace hierpar::detail {

std::array<int64_t, 2> expand_pair(at::IntArrayRef values, const char* what) {
  TORCH_CHECK(values.size() == 1 || values.size() == 2, "hierpar::conv_transpose2d: ", what,
              " must have 1 or 2 elements, got ", values.size());
  return {values[0], values.size() == 2 ? values[1] : values[0]};
}

ConvTranspose2dGeometry check_conv_transpose2d(const at::Tensor& input, const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                               at::IntArrayRef padding, at::IntArrayRef output_padding,
                                               int64_t groups, at::IntArrayRef dilation) {
  TORCH_CHECK(input.defined(), "hierpar::conv_transpose2d: input is undefined");
  TORCH_CHECK(weight.defined(), "hierpar::conv_transpose2d: weight is undefined");
  TORCH_CHECK(input.dim() == 3 || input.dim() == 4,
              "hierpar::conv_transpose2d: input must be 3-d (unbatched) or 4-d [N, C_in, H, W], got a ", input.dim(),
              "-d tensor of shape ", input.sizes());
  TORCH_CHECK(weight.dim() == 4, "hierpar::conv_transpose2d: weight must be 4-d [C_in, C_out/groups, kH, kW], got a ",
              weight.dim(), "-d tensor of shape ", weight.sizes());
  const auto dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
              "hierpar::conv_transpose2d: input must be float32, float64, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(weight.scalar_type() == dtype, "hierpar::conv_transpose2d: weight's dtype (", weight.scalar_type(),
              ") must equal input's dtype (", dtype, ")");
  TORCH_CHECK(weight.device() == input.device(), "hierpar::conv_transpose2d: weight is on ", weight.device(),
              " but input is on ", input.device(), "; they must be on the same device");

  const auto s = expand_pair(stride, "stride");
  const auto p = expand_pair(padding, "padding");
  const auto op = expand_pair(output_padding, "output_padding");
  const auto d = expand_pair(dilation, "dilation");
  TORCH_CHECK(s[0] > 0 && s[1] > 0, "hierpar::conv_transpose2d: stride must be positive, got ", stride);
  TORCH_CHECK(d[0] > 0 && d[1] > 0, "hierpar::conv_transpose2d: dilation must be positive, got ", dilation);
  TORCH_CHECK(p[0] >= 0 && p[1] >= 0, "hierpar::conv_transpose2d: padding must be non-negative, got ", padding);
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
  g.kernel_h = weight.size(2);
  g.kernel_w = weight.size(3);
  g.stride_h = s[0];
  g.stride_w = s[1];
  g.pad_h = p[0];
  g.pad_w = p[1];
  g.dilation_h = d[0];
  g.dilation_w = d[1];
  g.out_h = (g.in_h - 1) * s[0] - 2 * p[0] + d[0] * (g.kernel_h - 1) + op[0] + 1;
  g.out_w = (g.in_w - 1) * s[1] - 2 * p[1] + d[1] * (g.kernel_w - 1) + op[1] + 1;
  TORCH_CHECK(g.out_h > 0 && g.out_w > 0, "hierpar::conv_transpose2d: the output size [", g.out_h, ", ", g.out_w,
              "] is not positive: padding ", padding, " is too large for input size [", g.in_h, ", ", g.in_w,
              "], kernel [", g.kernel_h, ", ", g.kernel_w, "], stride ", stride, " and dilation ", dilation);

  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == g.out_channels,
                "hierpar::conv_transpose2d: bias must be 1-d with out_channels = weight.size(1) * groups = ",
                g.out_channels, " elements, got shape ", bias->sizes());
    TORCH_CHECK(bias->scalar_type() == dtype, "hierpar::conv_transpose2d: bias's dtype (", bias->scalar_type(),
                ") must equal input's dtype (", dtype, ")");
    TORCH_CHECK(bias->device() == input.device(), "hierpar::conv_transpose2d: bias is on ", bias->device(),
                " but input is on ", input.device(), "; they must be on the same device");
  }
  return g;
}

void check_conv_transpose2d_grad_output(const at::Tensor& grad_output, const at::Tensor& input,
                                        const ConvTranspose2dGeometry& g) {
  TORCH_CHECK(grad_output.defined(), "hierpar::conv_transpose2d_backward: grad_output is undefined");
  std::vector<int64_t> expected{g.batch, g.out_channels, g.out_h, g.out_w};
  if (input.dim() == 3) expected.erase(expected.begin());
  TORCH_CHECK(grad_output.sizes() == at::IntArrayRef(expected), "hierpar::conv_transpose2d_backward: grad_output must have ",
              "the forward output's shape ", at::IntArrayRef(expected), ", got ", grad_output.sizes());
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(), "hierpar::conv_transpose2d_backward: grad_output's dtype (",
              grad_output.scalar_type(), ") must equal input's dtype (", input.scalar_type(), ")");
  TORCH_CHECK(grad_output.device() == input.device(), "hierpar::conv_transpose2d_backward: grad_output is on ",
              grad_output.device(), " but input is on ", input.device());
}

c10::MemoryFormat conv_transpose2d_output_layout(const at::Tensor& input4, const at::Tensor& weight) {
  const bool channels_last = layout_of(input4) == c10::MemoryFormat::ChannelsLast ||
                             layout_of(weight) == c10::MemoryFormat::ChannelsLast;
  return channels_last ? c10::MemoryFormat::ChannelsLast : c10::MemoryFormat::Contiguous;
}

}  // namespace hierpar::detail
