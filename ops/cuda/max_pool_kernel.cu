// CUDA kernels of hierpar::max_pool2d (uint8 window-offset indices) and of its gather backward, NCHW and
// channels_last natively (no layout conversions). Each forward also has a kRelu form that pools relu(input)
// (relu_window in max_pool_shape.h); a window it leaves unchosen matches no tap in the backward.
//
// General path, any parameters: one thread per output element (forward) or per input element (backward, a
// gather over the windows containing it, written once). Fast path for 2x2 stride-2 windows tiling the input
// (the common CNN pool): the windows are disjoint, so the backward writes the 4 inputs of each window directly
// (the chosen one gets the gradient, the others 0), and each thread moves 16-byte vectors:
//   NCHW: 4 adjacent windows of one output row per thread (two 8-element input row segments);
//   channels_last: 16 bytes of channels of one window per thread (4 vectors, one per tap).
#include "common.h"
#include "cuda/device_caps.h"
#include "max_pool_shape.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace hierpar::detail {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t(1) << 24;  // general kernels loop over the rest (grid-stride)

unsigned blocks_for(int64_t work, int64_t cap) {
  return static_cast<unsigned>(std::min<int64_t>((work + kThreads - 1) / kThreads, cap));
}

// 32-bit offsets suffice when both tensors have at most 2^30 elements: then the grid (at most one thread per
// element, rounded up to a block) stepping past the end stays below 2^31 too.
bool fits_int32(int64_t numel_a, int64_t numel_b) {
  constexpr int64_t limit = int64_t(1) << 30;
  return numel_a <= limit && numel_b <= limit;
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// at::max_pool2d's selection rule: a NaN always wins (so the last NaN is kept); ties keep the first maximum.
template <typename acc_t>
__device__ __forceinline__ bool takes_over(acc_t v, acc_t best) {
  return v > best || isnan(v);
}

// ---- general path --------------------------------------------------------------------------------------------

// The geometry in the kernels' index type.
template <typename index_t>
struct KernelGeometry {
  index_t channels, in_h, in_w, out_h, out_w;
  index_t kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  explicit KernelGeometry(const MaxPool2dGeometry& g)
      : channels(g.channels), in_h(g.in_h), in_w(g.in_w), out_h(g.out_h), out_w(g.out_w), kernel_h(g.kernel_h),
        kernel_w(g.kernel_w), stride_h(g.stride_h), stride_w(g.stride_w), pad_h(g.pad_h), pad_w(g.pad_w),
        dilation_h(g.dilation_h), dilation_w(g.dilation_w) {}
};

// Element i's (n, c, h, w) in a [N, channels, height, width] tensor laid out NCHW or channels_last.
template <bool channels_last, typename index_t>
__device__ __forceinline__ void unravel(index_t i, index_t channels, index_t height, index_t width, index_t& n,
                                        index_t& c, index_t& h, index_t& w) {
  if (channels_last) {
    c = i % channels;
    w = (i / channels) % width;
    h = (i / (channels * width)) % height;
    n = i / (channels * width * height);
  } else {
    w = i % width;
    h = (i / width) % height;
    c = (i / (width * height)) % channels;
    n = i / (width * height * channels);
  }
}

template <typename scalar_t, typename index_t, bool channels_last, bool kRelu>
__global__ void forward_general(const scalar_t* __restrict__ in, scalar_t* __restrict__ out,
                                uint8_t* __restrict__ idx, KernelGeometry<index_t> g, index_t total) {
  using acc_t = at::opmath_type<scalar_t>;
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += index_t(gridDim.x) * blockDim.x) {
    index_t n, c, oh, ow;
    unravel<channels_last>(i, g.channels, g.out_h, g.out_w, n, c, oh, ow);
    const index_t h0 = oh * g.stride_h - g.pad_h, w0 = ow * g.stride_w - g.pad_w;
    const auto th = valid_taps(h0, g.in_h, g.kernel_h, g.dilation_h);
    const auto tw = valid_taps(w0, g.in_w, g.kernel_w, g.dilation_w);
    acc_t best = -std::numeric_limits<acc_t>::infinity();
    uint8_t best_tap = first_tap(th, tw, g.kernel_w);
    for (index_t kh = th.begin; kh < th.end; ++kh) {
      const index_t ih = h0 + kh * g.dilation_h;
      for (index_t kw = tw.begin; kw < tw.end; ++kw) {
        const index_t iw = w0 + kw * g.dilation_w;
        const index_t element = channels_last ? ((n * g.in_h + ih) * g.in_w + iw) * g.channels + c
                                              : ((n * g.channels + c) * g.in_h + ih) * g.in_w + iw;
        const acc_t v = static_cast<acc_t>(in[element]);
        if (takes_over(v, best)) {
          best = v;
          best_tap = static_cast<uint8_t>(kh * g.kernel_w + kw);
        }
      }
    }
    if constexpr (kRelu) relu_window(best, best_tap);
    out[i] = static_cast<scalar_t>(best);
    idx[i] = best_tap;
  }
}

template <typename scalar_t, typename index_t, bool channels_last>
__global__ void backward_general(const scalar_t* __restrict__ grad_out, const uint8_t* __restrict__ idx,
                                 scalar_t* __restrict__ grad_in, KernelGeometry<index_t> g, index_t total) {
  using acc_t = at::opmath_type<scalar_t>;
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += index_t(gridDim.x) * blockDim.x) {
    index_t n, c, ih, iw;
    unravel<channels_last>(i, g.channels, g.in_h, g.in_w, n, c, ih, iw);
    const auto wh = covering_windows(ih, g.out_h, g.kernel_h, g.stride_h, g.pad_h, g.dilation_h);
    const auto ww = covering_windows(iw, g.out_w, g.kernel_w, g.stride_w, g.pad_w, g.dilation_w);
    acc_t sum = 0;
    for (index_t oh = wh.begin; oh < wh.end; ++oh) {
      const index_t kh = tap_at(ih, oh, g.stride_h, g.pad_h, g.dilation_h);
      if (kh < 0) continue;
      for (index_t ow = ww.begin; ow < ww.end; ++ow) {
        const index_t kw = tap_at(iw, ow, g.stride_w, g.pad_w, g.dilation_w);
        if (kw < 0) continue;
        const index_t element = channels_last ? ((n * g.out_h + oh) * g.out_w + ow) * g.channels + c
                                              : ((n * g.channels + c) * g.out_h + oh) * g.out_w + ow;
        if (idx[element] == kh * g.kernel_w + kw) sum += static_cast<acc_t>(grad_out[element]);
      }
    }
    grad_in[i] = static_cast<scalar_t>(sum);
  }
}

// ---- 2x2 stride-2 tiling fast path ------------------------------------------------------------------------------

// Picks the max of one 2x2 window given in tap order (top-left, top-right, bottom-left, bottom-right); kRelu: of
// its ReLU (relu_window).
template <bool kRelu, typename scalar_t>
__device__ __forceinline__ void pick_2x2(scalar_t a, scalar_t b, scalar_t c, scalar_t d, scalar_t& out,
                                         uint8_t& tap) {
  using acc_t = at::opmath_type<scalar_t>;
  acc_t best = static_cast<acc_t>(a);
  uint8_t t = 0;
  const acc_t vb = static_cast<acc_t>(b), vc = static_cast<acc_t>(c), vd = static_cast<acc_t>(d);
  // Starting from the first element equals starting from -inf: it takes over -inf unless it is -inf itself.
  if (takes_over(vb, best)) { best = vb; t = 1; }
  if (takes_over(vc, best)) { best = vc; t = 2; }
  if (takes_over(vd, best)) { best = vd; t = 3; }
  if constexpr (kRelu) relu_window(best, t);
  out = static_cast<scalar_t>(best);
  tap = t;
}

// NCHW: thread t covers windows [W j, W j + W) of output row r (= plane * out_h + oh), i.e. input rows 2r and
// 2r + 1. W = 4 when the output width allows (4-byte index stores, two 32-byte fp32 loads per row),
// else W = 1 (one 2-element load per row).
template <typename scalar_t, int kNchwWindows, bool kRelu>
__global__ void forward_2x2_nchw(const scalar_t* __restrict__ in, scalar_t* __restrict__ out,
                                 uint8_t* __restrict__ idx, int rows, int groups_per_row, int in_w) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= rows * groups_per_row) return;
  const int r = t / groups_per_row, j = t % groups_per_row;
  using InVec = Vec<scalar_t, 2 * kNchwWindows>;
  const InVec top = *reinterpret_cast<const InVec*>(in + (2 * int64_t(r)) * in_w + j * 2 * kNchwWindows);
  const InVec bottom = *reinterpret_cast<const InVec*>(in + (2 * int64_t(r) + 1) * in_w + j * 2 * kNchwWindows);
  Vec<scalar_t, kNchwWindows> o;
  Vec<uint8_t, kNchwWindows> k;
#pragma unroll
  for (int w = 0; w < kNchwWindows; ++w) {
    pick_2x2<kRelu>(top.v[2 * w], top.v[2 * w + 1], bottom.v[2 * w], bottom.v[2 * w + 1], o.v[w], k.v[w]);
  }
  const int64_t element = int64_t(r) * (in_w / 2) + j * kNchwWindows;
  *reinterpret_cast<Vec<scalar_t, kNchwWindows>*>(out + element) = o;
  *reinterpret_cast<Vec<uint8_t, kNchwWindows>*>(idx + element) = k;
}

template <typename scalar_t, int kNchwWindows>
__global__ void backward_2x2_nchw(const scalar_t* __restrict__ grad_out, const uint8_t* __restrict__ idx,
                                  scalar_t* __restrict__ grad_in, int rows, int groups_per_row, int in_w) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= rows * groups_per_row) return;
  const int r = t / groups_per_row, j = t % groups_per_row;
  const int64_t element = int64_t(r) * (in_w / 2) + j * kNchwWindows;
  const auto go = *reinterpret_cast<const Vec<scalar_t, kNchwWindows>*>(grad_out + element);
  const auto k = *reinterpret_cast<const Vec<uint8_t, kNchwWindows>*>(idx + element);
  const scalar_t zero = static_cast<scalar_t>(0);
  Vec<scalar_t, 2 * kNchwWindows> top, bottom;
#pragma unroll
  for (int w = 0; w < kNchwWindows; ++w) {
    top.v[2 * w] = k.v[w] == 0 ? go.v[w] : zero;
    top.v[2 * w + 1] = k.v[w] == 1 ? go.v[w] : zero;
    bottom.v[2 * w] = k.v[w] == 2 ? go.v[w] : zero;
    bottom.v[2 * w + 1] = k.v[w] == 3 ? go.v[w] : zero;
  }
  using InVec = Vec<scalar_t, 2 * kNchwWindows>;
  *reinterpret_cast<InVec*>(grad_in + (2 * int64_t(r)) * in_w + j * 2 * kNchwWindows) = top;
  *reinterpret_cast<InVec*>(grad_in + (2 * int64_t(r) + 1) * in_w + j * 2 * kNchwWindows) = bottom;
}

// channels_last: thread t covers channels [V j, V j + V) of window p (= (n * out_h + oh) * out_w + ow), whose
// top-left input element is at row 2 * (n * out_h + oh), column 2 * ow of the (N * H, W, C) view.
template <typename scalar_t>
constexpr int channels_per_thread() {
  return 16 / sizeof(scalar_t);
}

// Both kernels' shared thread -> slice mapping (a callback: a bool-returning helper changed the backward's SASS).
template <typename scalar_t, typename Body>
__device__ __forceinline__ void with_thread_slice(int windows, int out_w, int channels, Body body) {
  const int groups = channels / channels_per_thread<scalar_t>();
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= windows * groups) return;
  const int p = t / groups, j = t % groups;
  body(p, j, p / out_w, p % out_w);
}

template <typename scalar_t, bool kRelu>
__global__ void forward_2x2_channels_last(const scalar_t* __restrict__ in, scalar_t* __restrict__ out,
                                          uint8_t* __restrict__ idx, int windows, int out_w, int channels) {
  constexpr int V = channels_per_thread<scalar_t>();
  with_thread_slice<scalar_t>(windows, out_w, channels, [&](int p, int j, int r, int ow) {
    const int64_t row_stride = int64_t(2 * out_w) * channels;
    const scalar_t* src = in + 2 * int64_t(r) * row_stride + int64_t(2 * ow) * channels + j * V;
    using CVec = Vec<scalar_t, V>;
    const CVec a = *reinterpret_cast<const CVec*>(src);
    const CVec b = *reinterpret_cast<const CVec*>(src + channels);
    const CVec c = *reinterpret_cast<const CVec*>(src + row_stride);
    const CVec d = *reinterpret_cast<const CVec*>(src + row_stride + channels);
    CVec o;
    Vec<uint8_t, V> k;
#pragma unroll
    for (int v = 0; v < V; ++v) pick_2x2<kRelu>(a.v[v], b.v[v], c.v[v], d.v[v], o.v[v], k.v[v]);
    const int64_t element = int64_t(p) * channels + j * V;
    *reinterpret_cast<CVec*>(out + element) = o;
    *reinterpret_cast<Vec<uint8_t, V>*>(idx + element) = k;
  });
}

template <typename scalar_t>
__global__ void backward_2x2_channels_last(const scalar_t* __restrict__ grad_out, const uint8_t* __restrict__ idx,
                                           scalar_t* __restrict__ grad_in, int windows, int out_w, int channels) {
  constexpr int V = channels_per_thread<scalar_t>();
  with_thread_slice<scalar_t>(windows, out_w, channels, [&](int p, int j, int r, int ow) {
    using CVec = Vec<scalar_t, V>;
    const int64_t element = int64_t(p) * channels + j * V;
    const CVec go = *reinterpret_cast<const CVec*>(grad_out + element);
    const auto k = *reinterpret_cast<const Vec<uint8_t, V>*>(idx + element);
    const scalar_t zero = static_cast<scalar_t>(0);
    CVec a, b, c, d;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      a.v[v] = k.v[v] == 0 ? go.v[v] : zero;
      b.v[v] = k.v[v] == 1 ? go.v[v] : zero;
      c.v[v] = k.v[v] == 2 ? go.v[v] : zero;
      d.v[v] = k.v[v] == 3 ? go.v[v] : zero;
    }
    const int64_t row_stride = int64_t(2 * out_w) * channels;
    scalar_t* dst = grad_in + 2 * int64_t(r) * row_stride + int64_t(2 * ow) * channels + j * V;
    *reinterpret_cast<CVec*>(dst) = a;
    *reinterpret_cast<CVec*>(dst + channels) = b;
    *reinterpret_cast<CVec*>(dst + row_stride) = c;
    *reinterpret_cast<CVec*>(dst + row_stride + channels) = d;
  });
}

// ---- host side --------------------------------------------------------------------------------------------------

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Which fast-path kernel, if any, fits: the tiling, vector widths dividing the row or channels, aligned
// pointers (`big`: the input-sized tensor, `small`: the output-sized one), and 32-bit indexing.
enum class FastPath { none, nchw4, nchw1, channels_last };

FastPath fast_path_for(const MaxPool2dGeometry& g, c10::MemoryFormat layout, int64_t element_size,
                       const void* big, const void* small, const void* indices) {
  if (!g.tiles_2x2() || !fits_int32(g.batch * g.channels * g.in_h * g.in_w, 0)) return FastPath::none;
  if (layout == c10::MemoryFormat::ChannelsLast) {
    const int64_t v = 16 / element_size;
    if (g.channels % v == 0 && aligned(big, 16) && aligned(small, 16) && aligned(indices, v)) {
      return FastPath::channels_last;
    }
    return FastPath::none;
  }
  if (g.out_w % 4 == 0 && aligned(big, 8 * element_size) && aligned(small, 4 * element_size) && aligned(indices, 4)) {
    return FastPath::nchw4;
  }
  return aligned(big, 2 * element_size) ? FastPath::nchw1 : FastPath::none;
}

// The forward's or the backward's kernel of each path, for the one launcher below: both directions' kernels take
// their three tensors (in the direction's own order), then the same geometry, on the same grids. kRelu picks the
// forward that pools relu(input); the backward is the same gather either way.
template <bool kBackward, bool kRelu, typename scalar_t, typename index_t, bool channels_last>
auto general_kernel() {
  if constexpr (kBackward) return backward_general<scalar_t, index_t, channels_last>;
  else return forward_general<scalar_t, index_t, channels_last, kRelu>;
}

template <bool kBackward, bool kRelu, typename scalar_t, int kNchwWindows>
auto nchw_kernel() {
  if constexpr (kBackward) return backward_2x2_nchw<scalar_t, kNchwWindows>;
  else return forward_2x2_nchw<scalar_t, kNchwWindows, kRelu>;
}

template <bool kBackward, bool kRelu, typename scalar_t>
auto channels_last_kernel() {
  if constexpr (kBackward) return backward_2x2_channels_last<scalar_t>;
  else return forward_2x2_channels_last<scalar_t, kRelu>;
}

// Launches one direction's kernel of `path`. total: the elements written (the general kernels' threads);
// read_numel: the elements of the other tensor read. The general kernels index in 32 bits when every offset fits
// (the common case), else in 64.
template <bool kBackward, bool kRelu, typename scalar_t, typename A, typename B, typename C>
void launch(FastPath path, const MaxPool2dGeometry& g, c10::MemoryFormat layout, int64_t read_numel, int64_t total,
            cudaStream_t stream, A a, B b, C c) {
  const int rows = g.batch * g.channels * g.out_h;
  switch (path) {
    case FastPath::nchw4:
      nchw_kernel<kBackward, kRelu, scalar_t, 4>()<<<blocks_for(int64_t(rows) * (g.out_w / 4), INT32_MAX), kThreads, 0,
                                              stream>>>(a, b, c, rows, g.out_w / 4, g.in_w);
      break;
    case FastPath::nchw1:
      nchw_kernel<kBackward, kRelu, scalar_t, 1>()<<<blocks_for(int64_t(rows) * g.out_w, INT32_MAX), kThreads, 0, stream>>>(
          a, b, c, rows, g.out_w, g.in_w);
      break;
    case FastPath::channels_last: {
      const int windows = g.batch * g.out_h * g.out_w;
      const int work = windows * (g.channels / channels_per_thread<scalar_t>());
      channels_last_kernel<kBackward, kRelu, scalar_t>()<<<blocks_for(work, INT32_MAX), kThreads, 0, stream>>>(
          a, b, c, windows, g.out_w, g.channels);
      break;
    }
    case FastPath::none: {
      auto launch_general = [&](auto index_zero) {
        using index_t = decltype(index_zero);
        const KernelGeometry<index_t> kg(g);
        const unsigned blocks = blocks_for(total, kMaxBlocks);
        if (layout == c10::MemoryFormat::ChannelsLast) {
          general_kernel<kBackward, kRelu, scalar_t, index_t, true>()<<<blocks, kThreads, 0, stream>>>(a, b, c, kg,
                                                                                              index_t(total));
        } else {
          general_kernel<kBackward, kRelu, scalar_t, index_t, false>()<<<blocks, kThreads, 0, stream>>>(a, b, c, kg,
                                                                                               index_t(total));
        }
      };
      if (fits_int32(read_numel, total)) launch_general(int32_t(0)); else launch_general(int64_t(0));
      break;
    }
  }
}

std::tuple<at::Tensor, at::Tensor> max_pool2d_cuda(const MaxPool2dGeometry& g, const at::Tensor& input) {
  const c10::cuda::CUDAGuard guard(input.device());
  check_device_code(input.get_device());
  const auto f = max_pool2d_forward_operands(g, input);
  const int64_t total = f.output.numel();
  if (total == 0) return {f.output, f.indices};
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, f.input.scalar_type(), "hierpar::max_pool2d (CUDA)", [&] {
    const scalar_t* in = f.input.const_data_ptr<scalar_t>();
    scalar_t* out = f.output.mutable_data_ptr<scalar_t>();
    uint8_t* idx = f.indices.mutable_data_ptr<uint8_t>();
    const FastPath path = fast_path_for(g, f.layout, sizeof(scalar_t), in, out, idx);
    if (g.relu) {
      launch</*kBackward=*/false, /*kRelu=*/true, scalar_t>(path, g, f.layout, f.input.numel(), total, stream, in, out,
                                                            idx);
    } else {
      launch</*kBackward=*/false, /*kRelu=*/false, scalar_t>(path, g, f.layout, f.input.numel(), total, stream, in,
                                                             out, idx);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {f.output, f.indices};
}

at::Tensor max_pool2d_backward_cuda(const MaxPool2dGeometry& g, const at::Tensor& grad_output,
                                    const at::Tensor& indices, at::IntArrayRef input_size) {
  const c10::cuda::CUDAGuard guard(grad_output.device());
  check_device_code(grad_output.get_device());
  const auto b = max_pool2d_backward_operands(grad_output, indices, input_size);
  const int64_t total = b.grad_input.numel();
  if (total == 0) return b.grad_input;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.grad_output.scalar_type(),
                                  "hierpar::max_pool2d_backward (CUDA)", [&] {
    const scalar_t* gout = b.grad_output.const_data_ptr<scalar_t>();
    const uint8_t* idx = b.indices.const_data_ptr<uint8_t>();
    scalar_t* gin = b.grad_input.mutable_data_ptr<scalar_t>();
    launch</*kBackward=*/true, /*kRelu=*/false, scalar_t>(fast_path_for(g, b.layout, sizeof(scalar_t), gin, gout, idx),
                                                          g, b.layout, b.grad_output.numel(), total, stream, gout, idx,
                                                          gin);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return b.grad_input;
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, CUDA, m) {
  hierpar::detail::register_max_pool2d<&hierpar::detail::max_pool2d_cuda,
                                       &hierpar::detail::max_pool2d_backward_cuda>(m);
}
