// CPU kernels of hierpar::max_pool2d (uint8 window-offset indices) and of its backward. Without dilation they run
// on ATen's kernels, converting between ATen's int64 indices and the window offsets (ATen's backward is 30-60x
// faster than the gather below on the CPU, docs/cpu.md). The reference, for dilated windows, half-precision
// backward and HIERPAR_CPU_ATEN=0: a gather backward, where every grad_input element sums, over the windows that
// contain it, the gradients of those that chose it, and is written exactly once (no zero fill, no scatter).
// NCHW and channels_last, each in its own layout.
#include "common.h"
#include "max_pool_shape.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/max_pool2d_with_indices.h>
#include <ATen/ops/max_pool2d_with_indices_backward.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

namespace hierpar::detail {
namespace {

// Work items per parallel_for task, in elements touched: small planes are grouped, large ones split.
constexpr int64_t kGrainElements = 32768;

int64_t grain_for(int64_t elements_per_item) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, elements_per_item));
}

template <typename scalar_t>
void forward_nchw(const scalar_t* in, scalar_t* out, uint8_t* idx, const MaxPool2dGeometry& g) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = g.batch * g.channels * g.out_h;
  at::parallel_for(0, rows, grain_for(g.out_w * g.kernel_h * g.kernel_w), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t plane = row / g.out_h, oh = row % g.out_h;
      const scalar_t* src = in + plane * g.in_h * g.in_w;
      const int64_t h0 = oh * g.stride_h - g.pad_h;
      const auto th = valid_taps(h0, g.in_h, g.kernel_h, g.dilation_h);
      for (int64_t ow = 0; ow < g.out_w; ++ow) {
        const int64_t w0 = ow * g.stride_w - g.pad_w;
        const auto tw = valid_taps(w0, g.in_w, g.kernel_w, g.dilation_w);
        acc_t best = -std::numeric_limits<acc_t>::infinity();
        uint8_t best_tap = first_tap(th, tw, g.kernel_w);
        for (int64_t kh = th.begin; kh < th.end; ++kh) {
          const scalar_t* src_row = src + (h0 + kh * g.dilation_h) * g.in_w + w0;
          for (int64_t kw = tw.begin; kw < tw.end; ++kw) {
            const acc_t v = static_cast<acc_t>(src_row[kw * g.dilation_w]);
            // at::max_pool2d's rule: a NaN always wins (so the last NaN is kept); ties keep the first.
            if (v > best || std::isnan(v)) {
              best = v;
              best_tap = static_cast<uint8_t>(kh * g.kernel_w + kw);
            }
          }
        }
        if (g.relu) relu_window(best, best_tap);
        out[row * g.out_w + ow] = static_cast<scalar_t>(best);
        idx[row * g.out_w + ow] = best_tap;
      }
    }
  });
}

template <typename scalar_t>
void forward_channels_last(const scalar_t* in, scalar_t* out, uint8_t* idx, const MaxPool2dGeometry& g) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = g.channels;
  const int64_t positions = g.batch * g.out_h * g.out_w;
  at::parallel_for(0, positions, grain_for(C * g.kernel_h * g.kernel_w), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> best(C);
    for (int64_t pos = begin; pos < end; ++pos) {
      const int64_t ow = pos % g.out_w, oh = (pos / g.out_w) % g.out_h, n = pos / (g.out_w * g.out_h);
      const int64_t h0 = oh * g.stride_h - g.pad_h, w0 = ow * g.stride_w - g.pad_w;
      const auto th = valid_taps(h0, g.in_h, g.kernel_h, g.dilation_h);
      const auto tw = valid_taps(w0, g.in_w, g.kernel_w, g.dilation_w);
      uint8_t* best_tap = idx + pos * C;
      std::fill(best.begin(), best.end(), -std::numeric_limits<acc_t>::infinity());
      std::fill(best_tap, best_tap + C, first_tap(th, tw, g.kernel_w));
      for (int64_t kh = th.begin; kh < th.end; ++kh) {
        for (int64_t kw = tw.begin; kw < tw.end; ++kw) {
          const scalar_t* src =
              in + ((n * g.in_h + h0 + kh * g.dilation_h) * g.in_w + w0 + kw * g.dilation_w) * C;
          const auto tap = static_cast<uint8_t>(kh * g.kernel_w + kw);
          for (int64_t c = 0; c < C; ++c) {
            const acc_t v = static_cast<acc_t>(src[c]);
            if (v > best[c] || std::isnan(v)) {
              best[c] = v;
              best_tap[c] = tap;
            }
          }
        }
      }
      if (g.relu) {
        for (int64_t c = 0; c < C; ++c) relu_window(best[c], best_tap[c]);
      }
      scalar_t* dst = out + pos * C;
      for (int64_t c = 0; c < C; ++c) dst[c] = static_cast<scalar_t>(best[c]);
    }
  });
}

template <typename scalar_t>
void backward_nchw(const scalar_t* grad_out, const uint8_t* idx, scalar_t* grad_in, const MaxPool2dGeometry& g) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = g.batch * g.channels * g.in_h;
  at::parallel_for(0, rows, grain_for(g.in_w * 4), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t plane = row / g.in_h, ih = row % g.in_h;
      const scalar_t* go = grad_out + plane * g.out_h * g.out_w;
      const uint8_t* ix = idx + plane * g.out_h * g.out_w;
      const auto wh = covering_windows(ih, g.out_h, g.kernel_h, g.stride_h, g.pad_h, g.dilation_h);
      for (int64_t iw = 0; iw < g.in_w; ++iw) {
        const auto ww = covering_windows(iw, g.out_w, g.kernel_w, g.stride_w, g.pad_w, g.dilation_w);
        acc_t sum = 0;
        for (int64_t oh = wh.begin; oh < wh.end; ++oh) {
          const int64_t kh = tap_at(ih, oh, g.stride_h, g.pad_h, g.dilation_h);
          if (kh < 0) continue;
          for (int64_t ow = ww.begin; ow < ww.end; ++ow) {
            const int64_t kw = tap_at(iw, ow, g.stride_w, g.pad_w, g.dilation_w);
            if (kw >= 0 && ix[oh * g.out_w + ow] == kh * g.kernel_w + kw) {
              sum += static_cast<acc_t>(go[oh * g.out_w + ow]);
            }
          }
        }
        grad_in[row * g.in_w + iw] = static_cast<scalar_t>(sum);
      }
    }
  });
}

template <typename scalar_t>
void backward_channels_last(const scalar_t* grad_out, const uint8_t* idx, scalar_t* grad_in,
                            const MaxPool2dGeometry& g) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = g.channels;
  const int64_t positions = g.batch * g.in_h * g.in_w;
  at::parallel_for(0, positions, grain_for(C * 4), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> sum(C);
    for (int64_t pos = begin; pos < end; ++pos) {
      const int64_t iw = pos % g.in_w, ih = (pos / g.in_w) % g.in_h, n = pos / (g.in_w * g.in_h);
      const auto wh = covering_windows(ih, g.out_h, g.kernel_h, g.stride_h, g.pad_h, g.dilation_h);
      const auto ww = covering_windows(iw, g.out_w, g.kernel_w, g.stride_w, g.pad_w, g.dilation_w);
      std::fill(sum.begin(), sum.end(), acc_t(0));
      for (int64_t oh = wh.begin; oh < wh.end; ++oh) {
        const int64_t kh = tap_at(ih, oh, g.stride_h, g.pad_h, g.dilation_h);
        if (kh < 0) continue;
        for (int64_t ow = ww.begin; ow < ww.end; ++ow) {
          const int64_t kw = tap_at(iw, ow, g.stride_w, g.pad_w, g.dilation_w);
          if (kw < 0) continue;
          const int64_t window = (n * g.out_h + oh) * g.out_w + ow;
          const scalar_t* go = grad_out + window * C;
          const uint8_t* ix = idx + window * C;
          const int64_t tap = kh * g.kernel_w + kw;
          for (int64_t c = 0; c < C; ++c) {
            if (ix[c] == tap) sum[c] += static_cast<acc_t>(go[c]);
          }
        }
      }
      scalar_t* dst = grad_in + pos * C;
      for (int64_t c = 0; c < C; ++c) dst[c] = static_cast<scalar_t>(sum[c]);
    }
  });
}

// ---- the common case on ATen's kernels --------------------------------------------------------------------
// With dilation 1 every window holds input elements (padding <= kernel / 2, and ceil_mode's last window starts
// inside the input), so ATen's int64 index (h * W + w) and hierpar's uint8 window offset convert both ways.

// Calls f(oh, first) for each output row: the out_w (NCHW) or out_w * channels (channels_last) elements from
// element `first` of an output of `g` laid out densely in `layout`, all in row oh.
template <typename F>
void for_each_output_row(const MaxPool2dGeometry& g, c10::MemoryFormat layout, const F& f) {
  const int64_t per_row = layout == c10::MemoryFormat::ChannelsLast ? g.out_w * g.channels : g.out_w;
  if (per_row == 0) return;
  const int64_t rows = g.batch * g.channels * g.out_h * g.out_w / per_row;
  at::parallel_for(0, rows, grain_for(per_row), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) f(r % g.out_h, r * per_row);
  });
}

// The index conversions read the geometry into locals once per row: stores through uint8_t* may alias anything,
// so fields read through a reference would be reloaded at every element.
struct RowGeometry {
  int64_t in_h, in_w, kernel_h, kernel_w, stride_w, pad_w, channels, out_w;
  RowGeometry(const MaxPool2dGeometry& g, c10::MemoryFormat layout)
      : in_h(g.in_h), in_w(g.in_w), kernel_h(g.kernel_h), kernel_w(g.kernel_w), stride_w(g.stride_w), pad_w(g.pad_w),
        channels(layout == c10::MemoryFormat::ChannelsLast ? g.channels : 1), out_w(g.out_w) {}
};

bool aten_applies(const MaxPool2dGeometry& g) {
  return switch_on(Switch::cpu_aten) && g.dilation_h == 1 && g.dilation_w == 1;
}

std::tuple<at::Tensor, at::Tensor> max_pool2d_aten(const MaxPool2dGeometry& g, const at::Tensor& input) {
  const auto layout = layout_of(input);
  auto [output, index] = at::max_pool2d_with_indices(input, {g.kernel_h, g.kernel_w}, {g.stride_h, g.stride_w},
                                                     {g.pad_h, g.pad_w}, {g.dilation_h, g.dilation_w}, g.ceil_mode);
  output = with_layout_strides(output, layout);
  index = index.contiguous(layout);
  at::Tensor taps = new_output(g.output_sizes(), input.options().dtype(at::kByte), layout);
  if (taps.numel() == 0) return {output, taps};
  const int64_t* index_p = index.const_data_ptr<int64_t>();
  uint8_t* taps_p = taps.mutable_data_ptr<uint8_t>();
  for_each_output_row(g, layout, [&](int64_t oh, int64_t first) {
    const RowGeometry r(g, layout);
    const int64_t h0 = oh * g.stride_h - g.pad_h;
    const int64_t* ip = index_p + first;
    uint8_t* tp = taps_p + first;
    for (int64_t ow = 0; ow < r.out_w; ++ow) {
      const int64_t w0 = ow * r.stride_w - r.pad_w;
      for (int64_t c = 0; c < r.channels; ++c, ++ip, ++tp) {
        // The row as a count of row starts passed, kernel_h - 1 comparisons: no 64-bit division, and no branch
        // on the data (which row of a window holds its maximum is random).
        const int64_t h_first = std::max<int64_t>(h0, 0);
        int64_t h = h_first;
        for (int64_t k = 1; k < r.kernel_h; ++k) h += *ip >= (h_first + k) * r.in_w;
        *tp = static_cast<uint8_t>((h - h0) * r.kernel_w + (*ip - h * r.in_w - w0));
      }
    }
  });
  if (g.relu) {  // relu_window on ATen's output (NaN <= 0 is false: a NaN stays)
    const at::Tensor none_chosen = output.le(0);
    output.masked_fill_(none_chosen, 0);
    taps.masked_fill_(none_chosen, kMaxPoolNoTap);
  }
  return {output, taps};
}

// The backward on ATen's (zero fill, then one scatter-add per window), float32/float64 only: ATen adds
// overlapping windows' half-precision gradients in half precision, the reference in float32. A window that chose
// no element (relu's kMaxPoolNoTap, in windows of fewer than 256 elements) points at its first element with a zero
// gradient. Undefined when an offset names no input element (indices that max_pool2d did not make): the reference
// ignores those.
at::Tensor max_pool2d_backward_aten(const MaxPool2dGeometry& g, const at::Tensor& grad_output,
                                    const at::Tensor& indices, at::IntArrayRef input_size) {
  const auto layout = layout_of(indices);
  const at::Tensor taps = indices.contiguous(layout);
  at::Tensor index = at::empty(taps.sizes(), taps.options().dtype(at::kLong).memory_format(layout));
  const uint8_t* taps_p = taps.const_data_ptr<uint8_t>();
  int64_t* index_p = index.mutable_data_ptr<int64_t>();
  // Each offset's row and column in the window and its flat distance from the window's first element, looked
  // up (no division per element); offsets past the window get row kernel_h, which the checks refuse.
  std::array<int64_t, 256> tap_h, tap_w, tap_delta;
  const int64_t area = g.kernel_h * g.kernel_w;
  for (int64_t t = 0; t < 256; ++t) {
    tap_h[t] = t < area ? t / g.kernel_w : g.kernel_h;
    tap_w[t] = t % g.kernel_w;
    tap_delta[t] = tap_h[t] * g.in_w + tap_w[t];
  }
  const bool none_possible = area <= kMaxPoolNoTap;  // else 255 is a tap
  if (none_possible) tap_h[kMaxPoolNoTap] = tap_w[kMaxPoolNoTap] = tap_delta[kMaxPoolNoTap] = 0;
  std::atomic<bool> valid{true}, none_chosen{false};
  for_each_output_row(g, layout, [&](int64_t oh, int64_t first) {
    const RowGeometry r(g, layout);
    const int64_t h0 = oh * g.stride_h - g.pad_h;
    const bool rows_inside = h0 >= 0 && h0 + r.kernel_h <= r.in_h;
    const uint8_t* tp = taps_p + first;
    int64_t* ip = index_p + first;
    bool ok = true, none = false;
    for (int64_t ow = 0; ow < r.out_w; ++ow) {
      const int64_t w0 = ow * r.stride_w - r.pad_w;
      if (rows_inside && w0 >= 0 && w0 + r.kernel_w <= r.in_w) {
        // A window inside the input (all of them without padding): every offset in it names an input element.
        const int64_t base = h0 * r.in_w + w0;
        for (int64_t c = 0; c < r.channels; ++c, ++ip, ++tp) {
          ok &= tap_h[*tp] < r.kernel_h;
          none |= none_possible && *tp == kMaxPoolNoTap;
          *ip = base + tap_delta[*tp];
        }
        continue;
      }
      for (int64_t c = 0; c < r.channels; ++c, ++ip, ++tp) {
        if (none_possible && *tp == kMaxPoolNoTap) {  // the window's first element (dilation 1: inside the input)
          none = true;
          *ip = std::max<int64_t>(h0, 0) * r.in_w + std::max<int64_t>(w0, 0);
          continue;
        }
        const int64_t kh = tap_h[*tp], h = h0 + kh, w = w0 + tap_w[*tp];
        ok &= kh < r.kernel_h && h >= 0 && h < r.in_h && w >= 0 && w < r.in_w;
        *ip = h * r.in_w + w;
      }
    }
    if (!ok) valid.store(false, std::memory_order_relaxed);
    if (none) none_chosen.store(true, std::memory_order_relaxed);
  });
  if (!valid.load()) return {};
  // ATen reads only the sizes and layout of its `self` argument (the forward's input).
  const at::Tensor input_like = at::empty(input_size, grad_output.options().memory_format(layout));
  at::Tensor scattered = grad_output.contiguous(layout);
  if (none_chosen.load()) scattered = scattered.masked_fill(taps.eq(kMaxPoolNoTap), 0);
  const at::Tensor grad_input = at::max_pool2d_with_indices_backward(
      scattered, input_like, {g.kernel_h, g.kernel_w}, {g.stride_h, g.stride_w},
      {g.pad_h, g.pad_w}, {g.dilation_h, g.dilation_w}, g.ceil_mode, index);
  return with_layout_strides(grad_input, layout);
}

std::tuple<at::Tensor, at::Tensor> max_pool2d_cpu(const MaxPool2dGeometry& g, const at::Tensor& input) {
  if (aten_applies(g)) return max_pool2d_aten(g, input);
  const auto f = max_pool2d_forward_operands(g, input);
  if (f.output.numel() == 0) return {f.output, f.indices};
  const bool channels_last = f.layout == c10::MemoryFormat::ChannelsLast;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, f.input.scalar_type(), "hierpar::max_pool2d (CPU)", [&] {
    (channels_last ? forward_channels_last<scalar_t> : forward_nchw<scalar_t>)(
        f.input.const_data_ptr<scalar_t>(), f.output.mutable_data_ptr<scalar_t>(),
        f.indices.mutable_data_ptr<uint8_t>(), g);
  });
  return {f.output, f.indices};
}

at::Tensor max_pool2d_backward_cpu(const MaxPool2dGeometry& g, const at::Tensor& grad_output,
                                   const at::Tensor& indices, at::IntArrayRef input_size) {
  const auto dtype = grad_output.scalar_type();
  if (aten_applies(g) && (dtype == at::kFloat || dtype == at::kDouble)) {
    at::Tensor grad_input = max_pool2d_backward_aten(g, grad_output, indices, input_size);
    if (grad_input.defined()) return grad_input;
  }
  const auto b = max_pool2d_backward_operands(grad_output, indices, input_size);
  if (b.grad_input.numel() == 0) return b.grad_input;
  const bool channels_last = b.layout == c10::MemoryFormat::ChannelsLast;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.grad_output.scalar_type(),
                                  "hierpar::max_pool2d_backward (CPU)", [&] {
    (channels_last ? backward_channels_last<scalar_t> : backward_nchw<scalar_t>)(
        b.grad_output.const_data_ptr<scalar_t>(), b.indices.const_data_ptr<uint8_t>(),
        b.grad_input.mutable_data_ptr<scalar_t>(), g);
  });
  return b.grad_input;
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, CPU, m) {
  hierpar::detail::register_max_pool2d<&hierpar::detail::max_pool2d_cpu, &hierpar::detail::max_pool2d_backward_cpu>(m);
}
