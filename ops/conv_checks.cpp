// Argument checks common to hierpar::conv2d and hierpar::conv_transpose2d.
#include "conv_checks.h"

#include <c10/core/ScalarType.h>

namespace hierpar::detail {

void check_conv_operands(const char* op, const at::Tensor& input, const at::Tensor& weight, const char* weight_dims) {
  TORCH_CHECK(input.defined(), op, ": input is undefined");
  TORCH_CHECK(weight.defined(), op, ": weight is undefined");
  TORCH_CHECK(input.dim() == 3 || input.dim() == 4, op, ": input must be 3-d (unbatched) or 4-d [N, C_in, H, W], ",
              "got a ", input.dim(), "-d tensor of shape ", input.sizes());
  TORCH_CHECK(weight.dim() == 4, op, ": weight must be 4-d ", weight_dims, ", got a ", weight.dim(),
              "-d tensor of shape ", weight.sizes());
  const auto dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": input must be float32, float64, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(weight.scalar_type() == dtype, op, ": weight's dtype (", weight.scalar_type(),
              ") must equal input's dtype (", dtype, ")");
  TORCH_CHECK(weight.device() == input.device(), op, ": weight is on ", weight.device(), " but input is on ",
              input.device(), "; they must be on the same device");
}

std::array<int64_t, 2> conv_pair(const char* op, at::IntArrayRef values, const char* what) {
  TORCH_CHECK(values.size() == 1 || values.size() == 2, op, ": ", what, " must have 1 or 2 elements, got ",
              values.size());
  return {values[0], values.size() == 2 ? values[1] : values[0]};
}

void check_conv_window(const char* op, const std::array<int64_t, 2>& s, const std::array<int64_t, 2>& p,
                       const std::array<int64_t, 2>& d, at::IntArrayRef stride, at::IntArrayRef padding,
                       at::IntArrayRef dilation) {
  TORCH_CHECK(s[0] > 0 && s[1] > 0, op, ": stride must be positive, got ", stride);
  TORCH_CHECK(d[0] > 0 && d[1] > 0, op, ": dilation must be positive, got ", dilation);
  TORCH_CHECK(p[0] >= 0 && p[1] >= 0, op, ": padding must be non-negative, got ", padding);
}

void set_conv_window(ConvTranspose2dGeometry& g, const at::Tensor& weight, const std::array<int64_t, 2>& s,
                     const std::array<int64_t, 2>& p, const std::array<int64_t, 2>& d) {
  g.kernel_h = weight.size(2);
  g.kernel_w = weight.size(3);
  g.stride_h = s[0];
  g.stride_w = s[1];
  g.pad_h = p[0];
  g.pad_w = p[1];
  g.dilation_h = d[0];
  g.dilation_w = d[1];
}

void check_conv_bias(const char* op, const std::optional<at::Tensor>& bias, int64_t out_channels,
                     const char* out_channels_is, const at::Tensor& input) {
  if (!bias.has_value() || !bias->defined()) return;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_channels, op, ": bias must be 1-d with out_channels = ",
              out_channels_is, " = ", out_channels, " elements, got shape ", bias->sizes());
  TORCH_CHECK(bias->scalar_type() == input.scalar_type(), op, ": bias's dtype (", bias->scalar_type(),
              ") must equal input's dtype (", input.scalar_type(), ")");
  TORCH_CHECK(bias->device() == input.device(), op, ": bias is on ", bias->device(), " but input is on ",
              input.device(), "; they must be on the same device");
}

void check_conv_grad_output(const char* op, const at::Tensor& grad_output, const at::Tensor& input,
                            std::vector<int64_t> output_sizes) {
  TORCH_CHECK(grad_output.defined(), op, ": grad_output is undefined");
  if (input.dim() == 3) output_sizes.erase(output_sizes.begin());
  TORCH_CHECK(grad_output.sizes() == at::IntArrayRef(output_sizes), op, ": grad_output must have the forward ",
              "output's shape ", at::IntArrayRef(output_sizes), ", got ", grad_output.sizes());
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(), op, ": grad_output's dtype (",
              grad_output.scalar_type(), ") must equal input's dtype (", input.scalar_type(), ")");
  TORCH_CHECK(grad_output.device() == input.device(), op, ": grad_output is on ", grad_output.device(),
              " but input is on ", input.device());
}

}  // namespace hierpar::detail
