// Argument checks and output geometry of hierpar::max_pool2d and its backward, shared by the CPU, CUDA and
// Meta kernels so that all three accept, reject and size things the same way (at::max_pool2d's rules).
// Private to hierpar_ops.
#pragma once

#include "kernel_registration.h"

#include <ATen/core/Tensor.h>
#include <c10/core/MemoryFormat.h>
#include <c10/macros/Macros.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace hierpar::detail {

// The saved index is the row-major offset kh * kernel_w + kw of the chosen element inside its window, as
// uint8: windows of up to 256 elements (16x16, or 8x32, ...).
constexpr int64_t kMaxPoolMaxWindowArea = 256;
// With relu (max_pool2d(relu(x)) in one pass: max commutes with ReLU), a window whose maximum is <= 0 outputs 0 and
// chooses no element: its index is kMaxPoolNoTap, which no tap matches, so its gradient goes nowhere (as ReLU's
// backward drops it). Such windows have at most 255 elements.
constexpr uint8_t kMaxPoolNoTap = 255;

struct MaxPool2dGeometry {
  int64_t batch, channels, in_h, in_w, out_h, out_w;
  int64_t kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  bool batched;  // 4-d (N, C, H, W); a 3-d (C, H, W) input has batch 1 and gives 3-d outputs
  bool ceil_mode;
  bool relu = false;  // the forward pools relu(input) (kMaxPoolNoTap above)

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

// Checks the pooling parameters against an input of `input_sizes` (named `input_name` in messages) and
// returns the geometry. `op` prefixes every message.
MaxPool2dGeometry max_pool2d_geometry(const char* op, const char* input_name, at::IntArrayRef input_sizes,
                                      at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                      at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode);

inline bool is_pooling_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// hierpar::max_pool2d's checks of its input.
MaxPool2dGeometry max_pool2d_forward_geometry(const at::Tensor& input, at::IntArrayRef kernel_size,
                                              at::IntArrayRef stride, at::IntArrayRef padding,
                                              at::IntArrayRef dilation, bool ceil_mode, bool relu);

// hierpar::max_pool2d_backward's checks: grad_output and indices must be what max_pool2d gives for an input of
// input_size with these parameters.
MaxPool2dGeometry max_pool2d_backward_geometry(const at::Tensor& grad_output, const at::Tensor& indices,
                                               at::IntArrayRef input_size, at::IntArrayRef kernel_size,
                                               at::IntArrayRef stride, at::IntArrayRef padding,
                                               at::IntArrayRef dilation, bool ceil_mode);

// A backend's kernels of hierpar::max_pool2d and its backward (CPU, CUDA, Meta): the checks above, then the
// backend's kernel (Forward or Backward) with the geometry and the tensors.
template <auto Forward>
std::tuple<at::Tensor, at::Tensor> max_pool2d_entry(const at::Tensor& input, at::IntArrayRef kernel_size,
                                                    at::IntArrayRef stride, at::IntArrayRef padding,
                                                    at::IntArrayRef dilation, bool ceil_mode, bool relu) {
  return Forward(max_pool2d_forward_geometry(input, kernel_size, stride, padding, dilation, ceil_mode, relu), input);
}

template <auto Backward>
at::Tensor max_pool2d_backward_entry(const at::Tensor& grad_output, const at::Tensor& indices,
                                     at::IntArrayRef input_size, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                     at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  const auto g = max_pool2d_backward_geometry(grad_output, indices, input_size, kernel_size, stride, padding,
                                              dilation, ceil_mode);
  return Backward(g, grad_output, indices, input_size);
}

// Registers both ops' kernels of the backend whose kernels are Forward and Backward.
template <auto Forward, auto Backward>
void register_max_pool2d(torch::Library& m) {
  register_kernels<&max_pool2d_entry<Forward>, &max_pool2d_backward_entry<Backward>>(m, "max_pool2d",
                                                                                      "max_pool2d_backward");
}

// max_pool2d's outputs, uninitialised: the values in the input's dtype and the uint8 window offsets, both of
// g.output_sizes() in the input's layout.
std::tuple<at::Tensor, at::Tensor> new_max_pool2d_outputs(const MaxPool2dGeometry& g, const at::Tensor& input);

// A max_pool2d call as its CPU and CUDA kernels read and write it: the input dense in its own layout and the outputs
// of new_max_pool2d_outputs.
struct MaxPool2dForwardOperands {
  c10::MemoryFormat layout;
  at::Tensor input, output, indices;
};
MaxPool2dForwardOperands max_pool2d_forward_operands(const MaxPool2dGeometry& g, const at::Tensor& input);

// max_pool2d_backward's grad_input, uninitialised: input_size in the forward's layout, which the indices carry.
at::Tensor new_max_pool2d_grad_input(const at::Tensor& grad_output, const at::Tensor& indices,
                                     at::IntArrayRef input_size);

// A max_pool2d_backward call as its CPU and CUDA kernels read and write it: grad_output and the indices dense in the
// forward's layout (the indices'), and grad_input from new_max_pool2d_grad_input.
struct MaxPool2dBackwardOperands {
  c10::MemoryFormat layout;
  at::Tensor grad_output, indices, grad_input;
};
MaxPool2dBackwardOperands max_pool2d_backward_operands(const at::Tensor& grad_output, const at::Tensor& indices,
                                                       at::IntArrayRef input_size);

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

// relu's end of one window (MaxPool2dGeometry::relu): a maximum <= 0 becomes 0, chosen by no element. A NaN stays,
// with its tap: relu(NaN) is NaN and ReLU's backward passes a NaN input's gradient, as at::relu's does.
template <typename acc_t>
C10_HOST_DEVICE inline void relu_window(acc_t& best, uint8_t& tap) {
  if (best <= acc_t(0)) {
    best = acc_t(0);
    tap = kMaxPoolNoTap;
  }
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
