// Argument checks and output geometry of hierpar::max_pool2d and its backward, shared by the CPU, CUDA and
// Meta kernels so that all three accept, reject and size things the same way (at::max_pool2d's rules).
// Private to hierpar_ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace hierpar::detail {

// The saved index is the row-major offset kh * kernel_w + kw of the chosen element inside its window, as
// uint8: windows of up to 256 elements (16x16, or 8x32, ...).
constexpr int64_t kMaxPoolMaxWindowArea = 256;

struct MaxPool2dGeometry {
  int64_t batch, channels, in_h, in_w, out_h, out_w;
  int64_t kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  bool batched;  // 4-d (N, C, H, W); a 3-d (C, H, W) input has batch 1 and gives 3-d outputs

  std::vector<int64_t> output_sizes() const {
    if (batched) return {batch, channels, out_h, out_w};
    return {channels, out_h, out_w};
  }
  // 2x2 windows with stride 2, no padding or dilation, tiling the input exactly: every input element is in
  // exactly one window, which the CUDA kernels exploit (vector loads, 4 gradient writes per window).
  bool tiles_2x2() const {
    return kernel_h == 2 && kernel_w == 2 && stride_h == 2 && stride_w == 2 && pad_h == 0 && pad_w == 0 &&
           dilation_h == 1 && dilation_w == 1 && in_h == 2 * out_h && in_w == 2 * out_w;
  }
};

namespace max_pool_shape {

inline std::pair<int64_t, int64_t> pair_arg(const char* op, const char* name, at::IntArrayRef value) {
  TORCH_CHECK(value.size() == 1 || value.size() == 2, op, ": ", name,
              " must be a single int or a pair of ints (height, width), got ", value);
  return {value.front(), value.back()};
}

// at::max_pool2d's output length: floor (or ceil) of the window count, where with ceil_mode the last window
// must start inside the input or its left padding (a window starting in the right padding is dropped).
inline int64_t pooled_size(int64_t in, int64_t kernel, int64_t pad, int64_t stride, int64_t dilation,
                           bool ceil_mode) {
  const int64_t span = in + 2 * pad - dilation * (kernel - 1) - 1;  // >= 0: checked by the caller
  int64_t out = (span + (ceil_mode ? stride - 1 : 0)) / stride + 1;
  if (ceil_mode && (out - 1) * stride >= in + pad) --out;
  return out;
}

}  // namespace max_pool_shape

// Checks the pooling parameters against an input of `input_sizes` (named `input_name` in messages) and
// returns the geometry. `op` prefixes every message.
inline MaxPool2dGeometry max_pool2d_geometry(const char* op, const char* input_name, at::IntArrayRef input_sizes,
                                             at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                             at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  using max_pool_shape::pair_arg;
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

  g.out_h = max_pool_shape::pooled_size(g.in_h, g.kernel_h, g.pad_h, g.stride_h, g.dilation_h, ceil_mode);
  g.out_w = max_pool_shape::pooled_size(g.in_w, g.kernel_w, g.pad_w, g.stride_w, g.dilation_w, ceil_mode);
  return g;
}

inline bool is_pooling_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// hierpar::max_pool2d's checks of its input.
inline MaxPool2dGeometry max_pool2d_forward_geometry(const at::Tensor& input, at::IntArrayRef kernel_size,
                                                     at::IntArrayRef stride, at::IntArrayRef padding,
                                                     at::IntArrayRef dilation, bool ceil_mode) {
  constexpr const char* op = "hierpar::max_pool2d";
  TORCH_CHECK(is_pooling_dtype(input.scalar_type()), op,
              ": input must be float32, float64, float16 or bfloat16, got ", input.scalar_type());
  return max_pool2d_geometry(op, "input", input.sizes(), kernel_size, stride, padding, dilation, ceil_mode);
}

// hierpar::max_pool2d_backward's checks: grad_output and indices must be what max_pool2d gives for an input of
// input_size with these parameters.
inline MaxPool2dGeometry max_pool2d_backward_geometry(const at::Tensor& grad_output, const at::Tensor& indices,
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

// The kernel taps k in [begin, end) of one window dimension whose input coordinate start + k * dilation lies
// inside [0, size). Requires start < size (the ceil_mode rule guarantees it); empty when begin == end.
// index_t: int64_t, or int32_t in CUDA kernels whose tensors allow it (32-bit division is much cheaper).
template <typename index_t>
struct TapRange {
  index_t begin, end;
};
template <typename index_t>
C10_HOST_DEVICE inline TapRange<index_t> valid_taps(index_t start, index_t size, index_t kernel, index_t dilation) {
  const index_t begin = start < 0 ? (-start + dilation - 1) / dilation : 0;
  index_t end = (size - start + dilation - 1) / dilation;
  end = end < kernel ? end : kernel;
  return {begin, end > begin ? end : begin};
}

// The output positions o in [begin, end) of one dimension whose window contains input coordinate i at some
// tap: o * stride - pad + k * dilation == i with 0 <= k < kernel (the caller checks divisibility by dilation).
template <typename index_t>
C10_HOST_DEVICE inline TapRange<index_t> covering_windows(index_t i, index_t out_size, index_t kernel, index_t stride,
                                                          index_t pad, index_t dilation) {
  const index_t hi = i + pad;                          // o * stride <= hi
  const index_t lo = hi - (kernel - 1) * dilation;     // o * stride >= lo
  const index_t begin = lo <= 0 ? 0 : (lo + stride - 1) / stride;
  index_t end = hi / stride + 1;
  end = end < out_size ? end : out_size;
  return {begin, end > begin ? end : begin};
}

// The tap of window o (one dimension) that lands on input coordinate i, or -1 when i falls between taps.
template <typename index_t>
C10_HOST_DEVICE inline index_t tap_at(index_t i, index_t o, index_t stride, index_t pad, index_t dilation) {
  const index_t offset = i + pad - o * stride;
  return offset % dilation == 0 ? offset / dilation : -1;
}

// The offset saved for a window: its first valid element's (at::max_pool2d keeps that one when every value
// is -inf); 0 for a window lying entirely in the padding, which therefore routes its gradient nowhere.
template <typename index_t>
C10_HOST_DEVICE inline uint8_t first_tap(const TapRange<index_t>& h, const TapRange<index_t>& w, index_t kernel_w) {
  return (h.begin < h.end && w.begin < w.end) ? static_cast<uint8_t>(h.begin * kernel_w + w.begin) : 0;
}

}  // namespace hierpar::detail
