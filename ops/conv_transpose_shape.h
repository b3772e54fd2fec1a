// Argument checks, output size and column-buffer geometry of hierpar::conv_transpose2d, shared by its
// CPU, CUDA and Meta kernels (private to hierpar_ops), so every backend accepts and rejects the same calls
// with the same messages and indexes the column buffer the same way.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/MemoryFormat.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <array>
#include <optional>

namespace hierpar::detail {

// Everything a kernel needs to know about one (batched, 4-d) transposed convolution.
//
// The column buffer ("cols") that forward and backward share: one row per input pixel (n, iy, ix), and per
// row, for each group g, kernel tap t = ky * kw + kx and output channel co_g of the group, one value:
//   cols[(n, iy, ix), g, t, co_g]  at  ((n * H + iy) * W + ix) * row_stride + g * group_stride
//                                       + t * cout_g + co_g.
// Forward: cols = input_rows x weight_g (weight seen as [C_in, kh, kw, C_out/groups]); each output pixel
// then gathers the cols entries of the input pixels it overlaps (col2im, no atomics).
// Backward: cols = im2col(grad_output) in the same layout; grad_input = cols x weight_g^T and
// grad_weight = input_rows^T x cols.
struct ConvTranspose2dGeometry {
  int64_t batch, in_channels, in_h, in_w;
  int64_t out_channels, out_h, out_w;
  int64_t groups, kernel_h, kernel_w;
  int64_t stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;

  C10_HOST_DEVICE int64_t cin_g() const { return in_channels / groups; }
  C10_HOST_DEVICE int64_t cout_g() const { return out_channels / groups; }
  C10_HOST_DEVICE int64_t taps() const { return kernel_h * kernel_w; }
  // Columns of one group in the cols buffer (= the GEMM's N in the forward).
  C10_HOST_DEVICE int64_t cols_per_group() const { return taps() * cout_g(); }
  C10_HOST_DEVICE int64_t in_pixels() const { return batch * in_h * in_w; }
};

// Where cols entries lie: row (input pixel) stride and group stride, in elements.
struct ColsStrides {
  int64_t row, group;
};

// Output-pixel gather of the forward (col2im): the sum over the kernel taps of the cols entries that land on
// output (n, co, oy, ox). Shared by the CPU loop and the CUDA kernel. `acc_t` accumulates.
// `index_t`: int64_t in general; the CUDA kernels use int32_t when every index fits (far fewer instructions
// for the divisions).
template <typename acc_t, typename index_t = int64_t, typename col_t>
C10_HOST_DEVICE inline acc_t col2im_gather(const ConvTranspose2dGeometry& g, ColsStrides cs, const col_t* cols,
                                           index_t n, index_t co, index_t oy, index_t ox) {
  const index_t cout_g = static_cast<index_t>(g.cout_g()), kh = static_cast<index_t>(g.kernel_h),
                kw = static_cast<index_t>(g.kernel_w), sh = static_cast<index_t>(g.stride_h),
                sw = static_cast<index_t>(g.stride_w), dh = static_cast<index_t>(g.dilation_h),
                dw = static_cast<index_t>(g.dilation_w), in_h = static_cast<index_t>(g.in_h),
                in_w = static_cast<index_t>(g.in_w), row_stride = static_cast<index_t>(cs.row);
  const index_t grp = co / cout_g, co_g = co - grp * cout_g;
  const col_t* base = cols + grp * static_cast<index_t>(cs.group) + co_g;
  acc_t acc = 0;
  for (index_t ky = 0; ky < kh; ++ky) {
    const index_t ty = oy + static_cast<index_t>(g.pad_h) - ky * dh;
    if (ty < 0 || ty % sh != 0) continue;
    const index_t iy = ty / sh;
    if (iy >= in_h) continue;
    for (index_t kx = 0; kx < kw; ++kx) {
      const index_t tx = ox + static_cast<index_t>(g.pad_w) - kx * dw;
      if (tx < 0 || tx % sw != 0) continue;
      const index_t ix = tx / sw;
      if (ix >= in_w) continue;
      const index_t row = (n * in_h + iy) * in_w + ix;
      acc += static_cast<acc_t>(base[row * row_stride + (ky * kw + kx) * cout_g]);
    }
  }
  return acc;
}

// Backward's im2col: for input pixel (n, iy, ix), tap (ky, kx) and output channel co, the grad_output
// element that this input pixel's contribution landed on, or nullptr where that falls in the padding.
// `go_strides` are grad_output's strides (n, c, h, w), so any memory layout reads in place.
template <typename scalar_t, typename index_t = int64_t>
C10_HOST_DEVICE inline const scalar_t* im2col_source(const ConvTranspose2dGeometry& g, const scalar_t* grad_output,
                                                     const int64_t* go_strides, index_t n, index_t iy, index_t ix,
                                                     index_t ky, index_t kx, index_t co) {
  const index_t oy = iy * static_cast<index_t>(g.stride_h) - static_cast<index_t>(g.pad_h) +
                     ky * static_cast<index_t>(g.dilation_h);
  const index_t ox = ix * static_cast<index_t>(g.stride_w) - static_cast<index_t>(g.pad_w) +
                     kx * static_cast<index_t>(g.dilation_w);
  if (oy < 0 || oy >= g.out_h || ox < 0 || ox >= g.out_w) return nullptr;
  return grad_output + n * go_strides[0] + co * go_strides[1] + oy * go_strides[2] + ox * go_strides[3];
}

// A 1- or 2-element int list (the schema's int[2]) as two values; `what` names the argument.
std::array<int64_t, 2> expand_pair(at::IntArrayRef values, const char* what);

// Checks the arguments of conv_transpose2d (and of its backward, which passes the same ones) and returns
// the geometry. `input` may be 3-d (unbatched, batch 1 then) or 4-d. Every message names the argument.
ConvTranspose2dGeometry check_conv_transpose2d(const at::Tensor& input, const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                               at::IntArrayRef padding, at::IntArrayRef output_padding,
                                               int64_t groups, at::IntArrayRef dilation);

// The forward output's memory format, chosen as at::conv_transpose2d chooses it: channels_last when the input or
// the weight is. So a channels_last weight makes a channels_last network even from an input whose layout is
// ambiguous (the generator's [N, nz, 1, 1] noise) or NCHW. (grad_input keeps the input's own layout.)
c10::MemoryFormat conv_transpose2d_output_layout(const at::Tensor& input4, const at::Tensor& weight);

// Checks grad_output against the forward's output shape (same batchedness as input) and its dtype/device.
void check_conv_transpose2d_grad_output(const at::Tensor& grad_output, const at::Tensor& input,
                                        const ConvTranspose2dGeometry& geometry);

// The backward's checks: its arguments as check_conv_transpose2d checks them (no bias), then grad_output.
ConvTranspose2dGeometry check_conv_transpose2d_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                        const at::Tensor& weight, at::IntArrayRef stride,
                                                        at::IntArrayRef padding, at::IntArrayRef output_padding,
                                                        int64_t groups, at::IntArrayRef dilation);

}  // namespace hierpar::detail
