// Definitions of ops/max_pool_shape.h's checks. They live in a C++ translation unit so that the CUDA kernels
// only call them: every argument check and message is compiled once, by the host compiler.
#include "max_pool_shape.h"

#include "common.h"

#include <tuple>
#include <utility>

namespace hierpar::detail {

namespace {

std::pair<int64_t, int64_t> pair_arg(const char* op, const char* name, at::IntArrayRef value) {
  TORCH_CHECK(value.size() == 1 || value.size() == 2, op, ": ", name,
              " must be a single int or a pair of ints (height, width), got ", value);
  return {value.front(), value.back()};
}

// at::max_pool2d's output length: floor (or ceil) of the window count, where with ceil_mode the last window
// must start inside the input or its left padding (a window starting in the right padding is dropped).
int64_t pooled_size(int64_t in, int64_t kernel, int64_t pad, int64_t stride, int64_t dilation, bool ceil_mode) {
  const int64_t span = in + 2 * pad - dilation * (kernel - 1) - 1;  // >= 0: checked by the caller
  int64_t out = (span + (ceil_mode ? stride - 1 : 0)) / stride + 1;
  if (ceil_mode && (out - 1) * stride >= in + pad) --out;
  return out;
}

}  // namespace

MaxPool2dGeometry max_pool2d_geometry(const char* op, const char* input_name, at::IntArrayRef input_sizes,
                                      at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                      at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  TORCH_CHECK(input_sizes.size() == 3 || input_sizes.size() == 4, op, ": expected ", input_name,
              " of 3 (C, H, W) or 4 (N, C, H, W) dimensions, got ", input_sizes.size(), " dimensions (sizes ",
              input_sizes, ")");
  MaxPool2dGeometry g{};
  g.batched = input_sizes.size() == 4;
  g.batch = g.batched ? input_sizes[0] : 1;
  g.channels = input_sizes[input_sizes.size() - 3];
  g.in_h = input_sizes[input_sizes.size() - 2];
  g.in_w = input_sizes[input_sizes.size() - 1];
  TORCH_CHECK(g.channels > 0 && g.in_h > 0 && g.in_w > 0, op, ": ", input_name,
              " must have non-zero channels, height and width (only the batch may be empty), got sizes ",
              input_sizes);

  std::tie(g.kernel_h, g.kernel_w) = pair_arg(op, "kernel_size", kernel_size);
  if (stride.empty()) {
    g.stride_h = g.kernel_h;
    g.stride_w = g.kernel_w;
  } else {
    std::tie(g.stride_h, g.stride_w) = pair_arg(op, "stride", stride);
  }
  std::tie(g.pad_h, g.pad_w) = pair_arg(op, "padding", padding);
  std::tie(g.dilation_h, g.dilation_w) = pair_arg(op, "dilation", dilation);
  g.ceil_mode = ceil_mode;

  TORCH_CHECK(g.kernel_h > 0 && g.kernel_w > 0, op, ": kernel_size must be positive, got ", kernel_size);
  TORCH_CHECK(g.stride_h > 0 && g.stride_w > 0, op, ": stride must be positive, got ", stride);
  TORCH_CHECK(g.dilation_h > 0 && g.dilation_w > 0, op, ": dilation must be positive, got ", dilation);
  TORCH_CHECK(g.pad_h >= 0 && g.pad_w >= 0, op, ": padding must be non-negative, got ", padding);
  TORCH_CHECK(g.pad_h <= g.kernel_h / 2 && g.pad_w <= g.kernel_w / 2, op,
              ": padding must be at most half of kernel_size, got padding ", padding, " and kernel_size ",
              kernel_size);
  TORCH_CHECK(g.kernel_h * g.kernel_w <= kMaxPoolMaxWindowArea, op, ": kernel_size ", kernel_size, " has ",
              g.kernel_h * g.kernel_w, " elements per window; the uint8 indices address at most ",
              kMaxPoolMaxWindowArea, " (e.g. 16x16)");
  const int64_t span_h = g.dilation_h * (g.kernel_h - 1) + 1, span_w = g.dilation_w * (g.kernel_w - 1) + 1;
  TORCH_CHECK(span_h <= g.in_h + 2 * g.pad_h && span_w <= g.in_w + 2 * g.pad_w, op, ": kernel_size ", kernel_size,
              " with dilation ", dilation, " spans ", span_h, "x", span_w, ", larger than the padded ", input_name,
              " (", g.in_h + 2 * g.pad_h, "x", g.in_w + 2 * g.pad_w, "): the output would be empty");

  g.out_h = pooled_size(g.in_h, g.kernel_h, g.pad_h, g.stride_h, g.dilation_h, ceil_mode);
  g.out_w = pooled_size(g.in_w, g.kernel_w, g.pad_w, g.stride_w, g.dilation_w, ceil_mode);
  return g;
}

MaxPool2dGeometry max_pool2d_forward_geometry(const at::Tensor& input, at::IntArrayRef kernel_size,
                                              at::IntArrayRef stride, at::IntArrayRef padding,
                                              at::IntArrayRef dilation, bool ceil_mode, bool relu) {
  constexpr const char* op = "hierpar::max_pool2d";
  TORCH_CHECK(is_pooling_dtype(input.scalar_type()), op,
              ": input must be float32, float64, float16 or bfloat16, got ", input.scalar_type());
  MaxPool2dGeometry g = max_pool2d_geometry(op, "input", input.sizes(), kernel_size, stride, padding, dilation,
                                            ceil_mode);
  TORCH_CHECK(!relu || g.kernel_h * g.kernel_w < kMaxPoolMaxWindowArea, op, ": with relu, kernel_size ", kernel_size,
              " has ", g.kernel_h * g.kernel_w, " elements per window; at most ", kMaxPoolMaxWindowArea - 1,
              " (index ", int(kMaxPoolNoTap), " marks a window that chose no element)");
  g.relu = relu;
  return g;
}

MaxPool2dGeometry max_pool2d_backward_geometry(const at::Tensor& grad_output, const at::Tensor& indices,
                                               at::IntArrayRef input_size, at::IntArrayRef kernel_size,
                                               at::IntArrayRef stride, at::IntArrayRef padding,
                                               at::IntArrayRef dilation, bool ceil_mode) {
  constexpr const char* op = "hierpar::max_pool2d_backward";
  TORCH_CHECK(is_pooling_dtype(grad_output.scalar_type()), op,
              ": grad_output must be float32, float64, float16 or bfloat16, got ", grad_output.scalar_type());
  TORCH_CHECK(indices.scalar_type() == at::kByte, op,
              ": indices must be uint8 (the window offsets hierpar::max_pool2d returns), got ",
              indices.scalar_type());
  TORCH_CHECK(grad_output.device() == indices.device(), op, ": grad_output (on ", grad_output.device(),
              ") and indices (on ", indices.device(), ") must be on the same device");
  auto g = max_pool2d_geometry(op, "input_size", input_size, kernel_size, stride, padding, dilation, ceil_mode);
  const auto expected = g.output_sizes();
  TORCH_CHECK(grad_output.sizes() == at::IntArrayRef(expected), op, ": grad_output must have sizes ",
              at::IntArrayRef(expected), " (the output size for input_size ", input_size, "), got ",
              grad_output.sizes());
  TORCH_CHECK(indices.sizes() == at::IntArrayRef(expected), op, ": indices must have sizes ",
              at::IntArrayRef(expected), " (the output size for input_size ", input_size, "), got ",
              indices.sizes());
  return g;
}

std::tuple<at::Tensor, at::Tensor> new_max_pool2d_outputs(const MaxPool2dGeometry& g, const at::Tensor& input) {
  const auto layout = layout_of(input);
  return {new_output(g.output_sizes(), input.options(), layout),
          new_output(g.output_sizes(), input.options().dtype(at::kByte), layout)};
}

MaxPool2dForwardOperands max_pool2d_forward_operands(const MaxPool2dGeometry& g, const at::Tensor& input) {
  MaxPool2dForwardOperands f;
  f.layout = layout_of(input);
  f.input = input.contiguous(f.layout);
  std::tie(f.output, f.indices) = new_max_pool2d_outputs(g, input);
  return f;
}

at::Tensor new_max_pool2d_grad_input(const at::Tensor& grad_output, const at::Tensor& indices,
                                     at::IntArrayRef input_size) {
  return new_output(input_size, grad_output.options(), layout_of(indices));
}

MaxPool2dBackwardOperands max_pool2d_backward_operands(const at::Tensor& grad_output, const at::Tensor& indices,
                                                       at::IntArrayRef input_size) {
  MaxPool2dBackwardOperands b;
  b.layout = layout_of(indices);
  b.grad_output = grad_output.contiguous(b.layout);
  b.indices = indices.contiguous(b.layout);
  b.grad_input = new_max_pool2d_grad_input(grad_output, indices, input_size);
  return b;
}

}  // namespace hierpar::detail
