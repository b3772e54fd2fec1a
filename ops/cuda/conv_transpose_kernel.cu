// CUDA kernels of hierpar::conv_transpose2d and its backward: cuBLAS GEMMs on the tensor cores plus
// hierpar's own col2im gather (forward, no atomics) and im2col (backward) kernels. No cuDNN, no
// at::convolution. Kernel 4 / stride 2 / padding 1 without bias (DCGAN's upsampling layers) takes the
// phase-decomposed implicit-GEMM path of k4s2p1/ instead (C_out >= 16), and with C_out <= 4 (bias
// or not) the kernels of small_cout/; this general path does the rest.
//
// Layouts, natively (no NCHW<->NHWC conversion of activations):
//  - channels_last (and any input whose [N*H*W, C_in] row view is dense, e.g. 1x1 spatial): the input IS a
//    row-major [N*H*W, C_in] matrix, so each GEMM is one strided-batched call over the groups;
//  - NCHW: one strided-batched call over the batch per group, with the input read as [C_in/G, H*W]^T.
//    grad_weight of an NCHW input contracts over (n, h, w), which has no single stride in NCHW: that one
//    GEMM reads a [C_in, N*H*W] copy of the input (the input is the smallest operand of these layers).
// The column buffer is [N*H*W, G * kH*kW * C_out/G] (see conv_transpose_shape.h).
// The copies that remain (weight repacks, the grad_weight scratch, inputs in neither layout, the k4s2p1 routes'
// NCHW -> channels_last conversions) go through permute_copy.h: a tiled transpose where the copy permutes.
//
// Direct 1x1 path: with a 1x1 input, no padding, dilation 1, output_padding 0, groups 1 and no bias, the
// output [N, C_out, kH, kW] is exactly the GEMM's [N, kH*kW*C_out] (channels_last) or [N, C_out*kH*kW]
// (NCHW) result, so the GEMM writes the output (and backward reads grad_output as its column buffer).
//
// Concurrency: when the backward computes grad_input and grad_weight with separate kernels (k4s2p1 and small
// C_out routes), grad_weight runs on a side stream alongside grad_input (ops/cuda/side_stream.h).
//
// Precision: fp32 GEMMs use TF32 tensor cores when at::globalContext().allowTF32CuDNN(CONV) is on (stock
// PyTorch's default for convolutions, which is what this op replaces); fp64 is exact-fp64; bf16/fp16
// multiply on the tensor cores with fp32 accumulation. col2im sums in fp32 (fp64 for double).
#include "common.h"
#include "conv_transpose_backends.h"
#include "conv_transpose_shape.h"
#include "cuda/conv_transpose_k4s2p1.h"
#include "cuda/device_caps.h"
#include "cuda/permute_copy.h"
#include "cuda/side_stream.h"

#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <ATen/ops/empty.h>
#include <ATen/ops/leaky_relu.h>
#include <ATen/ops/sum.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublas_v2.h>
#include <torch/library.h>

#include <array>
#include <climits>
#include <type_traits>

namespace hierpar::detail {
namespace {

constexpr int kThreads = 256;

int64_t blocks_for(int64_t total) {
  const int64_t max_blocks = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return std::max<int64_t>(1, std::min<int64_t>((total + kThreads - 1) / kThreads, max_blocks));
}

// Row-major C[m, n] = op(A)[m, k] x op(B)[k, n], `batch` times at the given element strides. A row-major
// matrix is cuBLAS's column-major transpose, so this calls cuBLAS for C^T = op(B)^T op(A)^T.
template <typename scalar_t>
void gemm_rows(int64_t m, int64_t n, int64_t k, const scalar_t* a, int64_t lda, int64_t stride_a, bool trans_a,
               const scalar_t* b, int64_t ldb, int64_t stride_b, bool trans_b, scalar_t* c, int64_t ldc,
               int64_t stride_c, int64_t batch) {
  TORCH_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && lda <= INT_MAX && ldb <= INT_MAX && ldc <= INT_MAX &&
                  batch <= INT_MAX,
              "conv_transpose2d (CUDA): a GEMM dimension exceeds cuBLAS's 32-bit limit");
  cudaDataType_t type;
  cublasComputeType_t compute;
  const float alpha_f = 1.f, beta_f = 0.f;
  const double alpha_d = 1.0, beta_d = 0.0;
  const void* alpha = &alpha_f;
  const void* beta = &beta_f;
  if constexpr (std::is_same_v<scalar_t, double>) {
    type = CUDA_R_64F;
    compute = CUBLAS_COMPUTE_64F;
    alpha = &alpha_d;
    beta = &beta_d;
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    type = CUDA_R_32F;
    compute = at::globalContext().allowTF32CuDNN(at::Float32Op::CONV) ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                      : CUBLAS_COMPUTE_32F;
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    type = CUDA_R_16BF;
    compute = CUBLAS_COMPUTE_32F;
  } else {
    type = CUDA_R_16F;
    compute = CUBLAS_COMPUTE_32F;
  }
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  TORCH_CUDABLAS_CHECK(cublasGemmStridedBatchedEx(
      handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(n), int(m), int(k), alpha,
      b, type, int(ldb), stride_b, a, type, int(lda), stride_a, beta, c, type, int(ldc), stride_c, int(batch), compute,
      CUBLAS_GEMM_DEFAULT));
}

// True when t [N, C, H, W] is, in memory, a dense row-major [N*H*W, C] matrix (channels_last, or any
// layout when H = W = 1); strides of size-1 dims do not matter.
bool is_row_matrix(const at::Tensor& t) {
  const int64_t expected[4] = {t.size(1) * t.size(2) * t.size(3), 1, t.size(3) * t.size(1), t.size(1)};
  for (int d = 0; d < 4; ++d) {
    if (t.size(d) > 1 && t.stride(d) != expected[d]) return false;
  }
  return true;
}

// Leaves room for the grid-stride loop's last step (at most one grid of threads past the end).
bool fits_int32(int64_t n) { return n < int64_t(INT_MAX) / 2; }

struct Strides4 {
  int64_t s[4];
};

// The coordinates of element i of a [.., c, b, a] array, innermost first: x in [0, a), y in [0, b), z in [0, c), and
// the outermost `rest`.
template <typename index_t>
__device__ __forceinline__ void unravel3(index_t i, index_t a, index_t b, index_t c, index_t& x, index_t& y,
                                         index_t& z, index_t& rest) {
  x = i % a;
  index_t t = i / a;
  y = t % b;
  t /= b;
  z = t % c;
  rest = t / c;
}

template <typename scalar_t, typename index_t, bool channels_last>
__global__ void col2im_kernel(ConvTranspose2dGeometry g, ColsStrides cs, const scalar_t* __restrict__ cols,
                              const scalar_t* __restrict__ bias, scalar_t* __restrict__ out, index_t total) {
  using acc_t = at::opmath_type<scalar_t>;
  const index_t out_c = index_t(g.out_channels), out_h = index_t(g.out_h), out_w = index_t(g.out_w);
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += index_t(blockDim.x) * gridDim.x) {
    index_t n, co, oy, ox;
    // i runs in the output's memory order, so writes are coalesced.
    if constexpr (channels_last) {
      unravel3(i, out_c, out_w, out_h, co, ox, oy, n);
    } else {
      unravel3(i, out_w, out_h, out_c, ox, oy, co, n);
    }
    acc_t acc = bias ? static_cast<acc_t>(bias[co]) : acc_t(0);
    acc += col2im_gather<acc_t, index_t>(g, cs, cols, n, co, oy, ox);
    out[i] = static_cast<scalar_t>(acc);
  }
}

// The divisors of im2col's index decomposition. With 32-bit indices, ATen's IntDivider divides by a multiply-high
// and a shift: with the compiler's integer division (six per element) the kernel was bound by it, 33 us for the
// 32->3 layer's 3.1M-element fp32 column buffer at batch 64 on the H200, ~16 MB of traffic.
template <typename index_t>
struct Im2colDividers {
  using u = std::make_unsigned_t<index_t>;
  using divider = at::cuda::detail::IntDivider<u>;
  divider cout_g, taps, groups, in_w, in_h, kw;
  explicit Im2colDividers(const ConvTranspose2dGeometry& g)
      : cout_g(u(g.cout_g())), taps(u(g.taps())), groups(u(g.groups)), in_w(u(g.in_w)), in_h(u(g.in_h)),
        kw(u(g.kernel_w)) {}
};

// cols[(n, iy, ix), g, tap, co_g] = grad_output at the output pixel that tap of that input pixel hit, or 0.
template <typename scalar_t, typename index_t>
__global__ void im2col_kernel(ConvTranspose2dGeometry g, Im2colDividers<index_t> d,
                              const scalar_t* __restrict__ grad_output, Strides4 go, scalar_t* __restrict__ cols,
                              index_t total) {
  using u = std::make_unsigned_t<index_t>;
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += index_t(blockDim.x) * gridDim.x) {
    const auto co_g = d.cout_g.divmod(u(i));
    const auto tap = d.taps.divmod(co_g.div);
    const auto grp = d.groups.divmod(tap.div);
    const auto ix = d.in_w.divmod(grp.div);
    const auto iy = d.in_h.divmod(ix.div);
    const auto k = d.kw.divmod(tap.mod);
    const scalar_t* src = im2col_source<scalar_t, index_t>(
        g, grad_output, go.s, index_t(iy.div), index_t(iy.mod), index_t(ix.mod), index_t(k.div), index_t(k.mod),
        index_t(grp.mod * d.cout_g.divisor + co_g.mod));
    cols[i] = src ? *src : scalar_t(0);
  }
}

// The direct 1x1 case (see the file comment). `out_layout`: the memory format of the output / grad_output.
bool is_direct_1x1(const ConvTranspose2dGeometry& g, bool has_bias) {
  return g.in_h == 1 && g.in_w == 1 && g.pad_h == 0 && g.pad_w == 0 && g.dilation_h == 1 && g.dilation_w == 1 &&
         g.out_h == g.kernel_h && g.out_w == g.kernel_w && g.groups == 1 && !has_bias;
}

// The weight as GEMM matrices [G, C_in/G, J_g]: tap-major columns (kH, kW, C_out/G), the order of the
// cols buffer and of a channels_last output, or channel-major (C_out/G, kH, kW), the order of an NCHW one.
at::Tensor weight_matrix(const at::Tensor& weight, bool tap_major) {
  return contiguous_as(tap_major ? weight.permute({0, 2, 3, 1}) : weight, c10::MemoryFormat::Contiguous);
}

}  // namespace

void run_conv_transpose2d_forward_cuda(const ConvTranspose2dGeometry& g, const at::Tensor& input4,
                                       const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& out) {
  if (out.numel() == 0) return;
  c10::cuda::CUDAGuard device_guard(input4.device());
  check_device_code(input4.get_device());
  // Where out's strides are those of both layouts (one channel, or 1x1), the one that spares converting the input.
  const bool out_cl = out.is_contiguous(c10::MemoryFormat::ChannelsLast) &&
                      (!out.is_contiguous() || layout_of(input4) == c10::MemoryFormat::ChannelsLast);
  TORCH_INTERNAL_ASSERT(out_cl || out.is_contiguous(), "conv_transpose2d (CUDA): out must be dense");
  const bool has_bias = bias.defined();
  if (k4s2p1_small_cout_applies(g, input4.scalar_type())) {
    k4s2p1_small_cout_forward(g, input4, weight, has_bias ? bias.contiguous() : at::Tensor(), out);
    return;
  }
  if (!has_bias && k4s2p1_fast_path_applies(g, input4.scalar_type())) {
    k4s2p1_forward(g, input4, weight, out, out_cl);
    return;
  }
  // In the output's layout: a no-op unless the input is a non-dense view, or NCHW with a channels_last weight.
  const at::Tensor x = contiguous_as(input4, out_cl ? c10::MemoryFormat::ChannelsLast : c10::MemoryFormat::Contiguous);
  const bool direct = is_direct_1x1(g, has_bias) && is_row_matrix(x);
  const at::Tensor w = weight_matrix(weight, /*tap_major=*/!direct || out_cl);
  const at::Tensor b = has_bias ? bias.contiguous() : at::Tensor();
  const int64_t hw = g.in_h * g.in_w, cin_g = g.cin_g(), jg = g.cols_per_group(), j = jg * g.groups;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input4.scalar_type(), "conv_transpose2d_cuda", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    if (direct) {
      gemm_rows<scalar_t>(g.batch, jg, cin_g, xp, g.in_channels, 0, false, wp, jg, 0, false,
                          out.mutable_data_ptr<scalar_t>(), jg, 0, 1);
      return;
    }
    at::Tensor cols = at::empty({g.in_pixels(), j}, input4.options());
    scalar_t* cp = cols.mutable_data_ptr<scalar_t>();
    if (is_row_matrix(x)) {
      gemm_rows<scalar_t>(g.in_pixels(), jg, cin_g, xp, g.in_channels, cin_g, false, wp, jg, cin_g * jg, false, cp,
                          j, jg, g.groups);
    } else {
      for (int64_t grp = 0; grp < g.groups; ++grp) {
        gemm_rows<scalar_t>(hw, jg, cin_g, xp + grp * cin_g * hw, hw, g.in_channels * hw, true, wp + grp * cin_g * jg,
                            jg, 0, false, cp + grp * jg, j, hw * j, g.batch);
      }
    }
    const ColsStrides cs{j, jg};
    const scalar_t* bp = has_bias ? b.const_data_ptr<scalar_t>() : nullptr;
    const int64_t total = out.numel();
    auto stream = at::cuda::getCurrentCUDAStream();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    // 32-bit indexing when every output and cols index fits (the grid-stride step stays below 2^31 too).
    const bool small = fits_int32(total) && fits_int32(cols.numel());
    if (out_cl && small) {
      col2im_kernel<scalar_t, int32_t, true><<<blocks_for(total), kThreads, 0, stream>>>(g, cs, cp, bp, op, int32_t(total));
    } else if (out_cl) {
      col2im_kernel<scalar_t, int64_t, true><<<blocks_for(total), kThreads, 0, stream>>>(g, cs, cp, bp, op, total);
    } else if (small) {
      col2im_kernel<scalar_t, int32_t, false><<<blocks_for(total), kThreads, 0, stream>>>(g, cs, cp, bp, op, int32_t(total));
    } else {
      col2im_kernel<scalar_t, int64_t, false><<<blocks_for(total), kThreads, 0, stream>>>(g, cs, cp, bp, op, total);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

namespace {

// The backward, every kernel on the current stream (see run_conv_transpose2d_backward_cuda).
void backward_on_current_stream(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4,
                                const at::Tensor& input4, const at::Tensor& weight, const at::Tensor& grad_input,
                                const at::Tensor& grad_weight, std::optional<double> grad_input_leaky_relu_slope) {
  // The gradients the general (column buffer + cuBLAS) path below still has to compute.
  bool general_input = grad_input.defined(), general_weight = grad_weight.defined();
  if (!general_input && !general_weight) return;
  // The activation on the routes whose kernels do not apply it as they store.
  bool activation_pending = general_input && grad_input_leaky_relu_slope.has_value();
  auto finish = [&] {
    if (!activation_pending) return;
    at::Tensor in_place = grad_input;  // a handle on the same storage (the parameter is const)
    at::leaky_relu_(in_place, *grad_input_leaky_relu_slope);
  };
  c10::cuda::CUDAGuard device_guard(grad_output4.device());
  const at::Tensor& go = grad_output4;
  const auto dtype = go.scalar_type();
  // grad_input is dense in one layout; a row matrix [N*H*W, C_in] when channels_last (or 1x1).
  const bool gi_rows = general_input && is_row_matrix(grad_input);
  TORCH_INTERNAL_ASSERT(!general_input || gi_rows || grad_input.is_contiguous(),
                        "conv_transpose2d_backward (CUDA): grad_input must be dense");
  if (g.in_pixels() == 0 || g.out_channels == 0) {
    if (general_input) grad_input.zero_();  // leaky_relu(0) = 0
    if (general_weight) grad_weight.zero_();
    return;
  }
  if (k4s2p1_small_cout_applies(g, dtype)) {
    if (general_input) {
      k4s2p1_small_cout_grad_input(g, go, weight, grad_input, grad_input_leaky_relu_slope);
      general_input = activation_pending = false;
    }
    if (general_weight && k4s2p1_small_cout_grad_weight_applies(g, input4)) {
      k4s2p1_small_cout_grad_weight(g, go, input4, grad_weight);
      general_weight = false;
    }
  } else if (k4s2p1_fast_path_applies(g, dtype)) {
    k4s2p1_backward(g, go, input4, weight, grad_input, !general_input || !grad_input.is_contiguous(), grad_weight);
    general_input = general_weight = false;
  }
  if (!general_input && !general_weight) return finish();
  // grad_weight contracts the input in its own layout.
  const at::Tensor x = general_weight ? contiguous_as(input4, layout_of(input4)) : at::Tensor();
  const bool x_rows = general_weight && is_row_matrix(x);
  // Direct 1x1: grad_output, dense in either layout, is the column buffer itself.
  const bool go_cl = go.is_contiguous(c10::MemoryFormat::ChannelsLast);
  const bool direct = is_direct_1x1(g, false) && (!general_input || gi_rows) && (!general_weight || x_rows) &&
                      (go_cl || go.is_contiguous());
  const bool tap_major = !direct || go_cl;
  const at::Tensor w = weight_matrix(weight, tap_major);
  const int64_t hw = g.in_h * g.in_w, cin_g = g.cin_g(), jg = g.cols_per_group(), j = jg * g.groups;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "conv_transpose2d_backward_cuda", [&] {
    at::Tensor cols;
    if (direct) {
      cols = go;
    } else {
      cols = at::empty({g.in_pixels(), j}, go.options());
      const int64_t total = cols.numel();
      const Strides4 gs{{go.stride(0), go.stride(1), go.stride(2), go.stride(3)}};
      auto stream = at::cuda::getCurrentCUDAStream();
      if (fits_int32(total)) {
        im2col_kernel<scalar_t, int32_t><<<blocks_for(total), kThreads, 0, stream>>>(
            g, Im2colDividers<int32_t>(g), go.const_data_ptr<scalar_t>(), gs, cols.mutable_data_ptr<scalar_t>(),
            int32_t(total));
      } else {
        im2col_kernel<scalar_t, int64_t><<<blocks_for(total), kThreads, 0, stream>>>(
            g, Im2colDividers<int64_t>(g), go.const_data_ptr<scalar_t>(), gs, cols.mutable_data_ptr<scalar_t>(),
            total);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    const scalar_t* cp = cols.const_data_ptr<scalar_t>();
    if (general_input) {
      const scalar_t* wp = w.const_data_ptr<scalar_t>();
      scalar_t* gip = grad_input.mutable_data_ptr<scalar_t>();
      if (gi_rows) {
        gemm_rows<scalar_t>(g.in_pixels(), cin_g, jg, cp, j, jg, false, wp, jg, cin_g * jg, true, gip,
                            g.in_channels, cin_g, g.groups);
      } else {
        for (int64_t grp = 0; grp < g.groups; ++grp) {
          gemm_rows<scalar_t>(cin_g, hw, jg, wp + grp * cin_g * jg, jg, 0, false, cp + grp * jg, j, hw * j, true,
                              gip + grp * cin_g * hw, hw, g.in_channels * hw, g.batch);
        }
      }
    }
    if (general_weight) {
      // The GEMM writes [C_in, J_g] in the column order `tap_major` says; straight into grad_weight
      // when that is its memory order, else into a scratch matrix copied over (weights are small).
      const bool weight_cl = layout_of(grad_weight) == c10::MemoryFormat::ChannelsLast;
      const bool in_place = (tap_major == weight_cl || (g.kernel_h == 1 && g.kernel_w == 1)) &&
                            grad_weight.is_contiguous(layout_of(grad_weight));
      at::Tensor gw = in_place ? grad_weight
                               : at::empty(tap_major ? at::IntArrayRef{g.in_channels, g.kernel_h, g.kernel_w,
                                                                       g.cout_g()}
                                                     : weight.sizes(),
                                           weight.options());
      scalar_t* gwp = gw.mutable_data_ptr<scalar_t>();
      if (x_rows) {
        gemm_rows<scalar_t>(cin_g, jg, g.in_pixels(), x.const_data_ptr<scalar_t>(), g.in_channels, cin_g, true,
                            cp, j, jg, false, gwp, jg, cin_g * jg, g.groups);
      } else {
        const at::Tensor xt = contiguous_as(x.transpose(0, 1), c10::MemoryFormat::Contiguous);  // [C_in, N*H*W]
        gemm_rows<scalar_t>(cin_g, jg, g.in_pixels(), xt.const_data_ptr<scalar_t>(), g.in_pixels(),
                            cin_g * g.in_pixels(), false, cp, j, jg, false, gwp, jg, cin_g * jg, g.groups);
      }
      if (!in_place) permute_copy_(grad_weight, tap_major ? gw.permute({0, 3, 1, 2}) : gw);
    }
  });
  finish();
}

// True when grad_input and grad_weight are computed by separate kernels that share no intermediate: the
// small-C_out kernels (grad_weight by its own kernel or by the general path with no grad_input) and the
// k4s2p1 implicit GEMMs. The general path is left on one stream: there both GEMMs read one im2col column
// buffer (a split would build it twice), and in the DCGAN it computes both only for a generator's first
// layer whose input needs a gradient (1x1 input, direct GEMMs, batch-sized).
bool gradients_computed_apart(const ConvTranspose2dGeometry& g, at::ScalarType dtype) {
  return g.in_pixels() > 0 && g.out_channels > 0 &&
         (k4s2p1_small_cout_applies(g, dtype) || k4s2p1_fast_path_applies(g, dtype));
}

}  // namespace

void run_conv_transpose2d_backward_cuda(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4,
                                        const at::Tensor& input4, const at::Tensor& weight,
                                        const at::Tensor& grad_input, const at::Tensor& grad_weight,
                                        std::optional<double> grad_input_leaky_relu_slope) {
  c10::cuda::CUDAGuard device_guard(grad_output4.device());
  check_device_code(grad_output4.get_device());
  if (!grad_input.defined() || !grad_weight.defined() || !gradients_computed_apart(g, grad_output4.scalar_type())) {
    backward_on_current_stream(g, grad_output4, input4, weight, grad_input, grad_weight, grad_input_leaky_relu_slope);
    return;
  }
  // Both asked for, from separate kernels: grad_weight on a side stream, concurrently with grad_input
  // (ops/cuda/side_stream.h: fork/join by events, safe in CUDA graph capture and with the caching allocator).
  // Each half is exactly the call that computes that gradient alone, so the values are those of a
  // one-gradient call. The implicit GEMMs of both read grad_output channels_last, grad_weight's the input too:
  // converted here, on the current stream, by one launch (no-ops when they already are), not once per half.
  const std::array<at::Tensor, 2> activations =
      k4s2p1_small_cout_applies(g, grad_output4.scalar_type())
          ? std::array<at::Tensor, 2>{grad_output4, input4}
          : contiguous_as(grad_output4, input4, at::MemoryFormat::ChannelsLast);
  const at::Tensor &go = activations[0], &x = activations[1];
  run_side_by_side(
      go.device(),
      [&] { backward_on_current_stream(g, go, x, weight, grad_input, at::Tensor(), grad_input_leaky_relu_slope); },
      [&] { backward_on_current_stream(g, go, x, weight, at::Tensor(), grad_weight, std::nullopt); });
}

namespace {

at::Tensor conv_transpose2d_cuda(const ConvTranspose2dGeometry& g, const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.is_cuda(), "conv_transpose2d (CUDA kernel): input must be a CUDA tensor");
  c10::cuda::CUDAGuard device_guard(input.device());
  return conv_transpose2d_forward_on(&run_conv_transpose2d_forward_cuda, g, input, weight, bias);
}

void sum_grad_bias_cuda(const at::Tensor& grad_output4, at::Tensor& grad_bias) {
  at::sum_out(grad_bias, grad_output4, {0, 2, 3});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_transpose2d_backward_cuda(
    const ConvTranspose2dGeometry& g, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    std::array<bool, 3> output_mask) {
  TORCH_CHECK(input.is_cuda(), "conv_transpose2d_backward (CUDA kernel): input must be a CUDA tensor");
  c10::cuda::CUDAGuard device_guard(input.device());
  return conv_transpose2d_backward_on(&run_conv_transpose2d_backward_cuda, &sum_grad_bias_cuda, g, grad_output, input,
                                      weight, output_mask);
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, CUDA, m) {
  hierpar::detail::register_conv_transpose2d<&hierpar::detail::conv_transpose2d_cuda,
                                             &hierpar::detail::conv_transpose2d_backward_cuda>(m);
}
