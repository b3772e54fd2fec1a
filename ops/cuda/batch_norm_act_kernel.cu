// CUDA kernels of hierpar::batch_norm_act and its backward, NCHW and channels_last natively, statistics in
// float32 (float64 for float64 inputs).
//
// Work layout. The input is seen as [M, C] "rows" per channel with M = N*H*W. A block owns `bx` channels
// (channels_last: bx consecutive channels, one per threadIdx.x, so a warp reads a contiguous row segment;
// NCHW: bx = 1 and all 256 threads walk one channel's planes) and a range ("split") of the M rows.
//  - Small problems (a split would cover all M rows with <= 4096 elements per block, or there are enough
//    channel groups to fill the GPU): one block per channel group does everything in ONE kernel: Welford
//    statistics, block combine, running-stat update, then normalise+affine+activation over the same
//    elements (the second read mostly hits L1/L2). The backward likewise: one kernel reduces
//    sum(dy') and sum(dy'*xhat) and then writes grad_input.
//  - Large problems: splits of the rows across blocks; each block writes a partial Welford state
//    (or partial sums), and the last block of a channel group to finish (atomic ticket) combines them and
//    writes the statistics; a second kernel applies the elementwise pass. Two kernels forward, two backward.
#include "batch_norm_act_shape.h"
#include "common.h"

#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

namespace hierpar::detail::bn {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 8;  // loads in flight per thread: the passes are latency-bound otherwise

// Which rows a block owns and how to address element (row i, channel c).
struct Tile {
  int64_t C, L, M;  // channels, H*W, rows per channel (N*H*W)
  int64_t chunk;    // rows per split
  int splits;
  at::cuda::detail::IntDivider<uint32_t> div_l;  // i -> (n, l) for NCHW
};

template <bool kCL>
__device__ __forceinline__ int64_t offset_of(const Tile& t, int64_t c, uint32_t i) {
  if constexpr (kCL) {
    return static_cast<int64_t>(i) * t.C + c;
  } else {
    auto nl = t.div_l.divmod(i);
    return (static_cast<int64_t>(nl.div) * t.C + c) * t.L + nl.mod;
  }
}

template <typename acc_t>
struct Welford {
  acc_t n, mean, m2;
  __device__ __forceinline__ void add(acc_t v) {
    n += acc_t(1);
    const acc_t d = v - mean;
    mean += d / n;
    m2 += d * (v - mean);
  }
  __device__ __forceinline__ void combine(const Welford& b) {
    if (b.n == acc_t(0)) return;
    if (n == acc_t(0)) {
      *this = b;
      return;
    }
    const acc_t total = n + b.n, d = b.mean - mean, wb = b.n / total;
    mean += d * wb;
    m2 += b.m2 + d * d * n * wb;
    n = total;
  }
};

template <typename acc_t>
struct Sums {
  acc_t dy, dy_xhat;
  __device__ __forceinline__ void combine(const Sums& b) {
    dy += b.dy;
    dy_xhat += b.dy_xhat;
  }
};

// Reduces `v` over threadIdx.y (for each threadIdx.x); the result is valid in threads with threadIdx.y == 0.
// blockDim.y is a power of two. `smem` holds blockDim.x * blockDim.y states.
template <typename State>
__device__ __forceinline__ State reduce_rows(State v, State* smem) {
  const int idx = threadIdx.y * blockDim.x + threadIdx.x;
  smem[idx] = v;
  __syncthreads();
  for (int off = blockDim.y / 2; off > 0; off >>= 1) {
    if (threadIdx.y < off) {
      State other = smem[idx + off * blockDim.x];
      v.combine(other);
      smem[idx] = v;
    }
    __syncthreads();
  }
  return v;
}

// After each block has written its partial state, returns true in the last block of this channel group to
// arrive (all partials then visible to it).
__device__ __forceinline__ bool last_block_of_group(int* counters) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    last = atomicAdd(&counters[blockIdx.x], 1) == static_cast<int>(gridDim.y) - 1;
  }
  __syncthreads();
  return last;
}

template <typename acc_t>
__device__ __forceinline__ acc_t activate(acc_t y, Act act, acc_t slope) {
  if (act == Act::relu) return y > acc_t(0) ? y : acc_t(0);
  if (act == Act::leaky_relu) return y > acc_t(0) ? y : y * slope;
  return y;
}

template <typename acc_t>
struct ForwardArgs {
  const acc_t* weight;  // nullable: 1
  const acc_t* bias;    // nullable: 0
  acc_t* running_mean;  // nullable
  acc_t* running_var;
  acc_t* save_mean;
  acc_t* save_invstd;
  acc_t* partial;  // [2, splits, C]: mean, m2 (split path)
  int* counters;   // [channel groups], zeroed (split path)
  acc_t momentum, eps, slope;
  Act act;
  bool training;
};

enum Mode : int { kStats = 1, kApply = 2 };

template <typename scalar_t, typename acc_t, bool kCL>
__global__ void __launch_bounds__(kThreads) batch_norm_act_forward_kernel(
    const scalar_t* __restrict__ x, scalar_t* __restrict__ out, Tile t, ForwardArgs<acc_t> a, int mode) {
  __shared__ Welford<acc_t> smem[kThreads];
  __shared__ acc_t s_mean[32], s_invstd[32];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = c < t.C;
  const int64_t i0 = static_cast<int64_t>(blockIdx.y) * t.chunk;
  const int64_t i1 = min(t.M, i0 + t.chunk);
  const int64_t step = blockDim.y;

  // Writes the statistics of channel c (from a state over all M rows) and updates the running stats.
  auto finalize = [&](const Welford<acc_t>& w) {
    const acc_t var = w.m2 / w.n;
    const acc_t invstd = acc_t(1) / sqrt(var + a.eps);
    a.save_mean[c] = w.mean;
    a.save_invstd[c] = invstd;
    if (a.running_mean) {
      const acc_t unbiased = var * (w.n / (w.n - acc_t(1)));
      a.running_mean[c] = (acc_t(1) - a.momentum) * a.running_mean[c] + a.momentum * w.mean;
      a.running_var[c] = (acc_t(1) - a.momentum) * a.running_var[c] + a.momentum * unbiased;
    }
    s_mean[threadIdx.x] = w.mean;
    s_invstd[threadIdx.x] = invstd;
  };

  if (mode & kStats) {
    Welford<acc_t> w{0, 0, 0};
    if (active) {
      int64_t i = i0 + threadIdx.y;
      for (; i + (kUnroll - 1) * step < i1; i += kUnroll * step) {
        acc_t v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = static_cast<acc_t>(x[offset_of<kCL>(t, c, i + u * step)]);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) w.add(v[u]);
      }
      for (; i < i1; i += step) w.add(static_cast<acc_t>(x[offset_of<kCL>(t, c, i)]));
    }
    w = reduce_rows(w, smem);
    if (t.splits == 1) {
      if (threadIdx.y == 0 && active) finalize(w);
    } else {
      if (threadIdx.y == 0 && active) {
        a.partial[static_cast<int64_t>(blockIdx.y) * t.C + c] = w.mean;
        a.partial[(static_cast<int64_t>(t.splits) + blockIdx.y) * t.C + c] = w.m2;
      }
      if (last_block_of_group(a.counters)) {
        Welford<acc_t> total{0, 0, 0};
        if (active) {
          for (int s = threadIdx.y; s < t.splits; s += blockDim.y) {
            const int64_t rows = min(t.M, (s + 1) * t.chunk) - s * t.chunk;
            Welford<acc_t> part{static_cast<acc_t>(rows), __ldcg(&a.partial[static_cast<int64_t>(s) * t.C + c]),
                                __ldcg(&a.partial[(static_cast<int64_t>(t.splits) + s) * t.C + c])};
            total.combine(part);
          }
        }
        total = reduce_rows(total, smem);
        if (threadIdx.y == 0 && active) finalize(total);
      }
    }
  } else if (threadIdx.y == 0 && active) {
    if (a.training) {  // split path: the statistics kernel wrote them
      s_mean[threadIdx.x] = a.save_mean[c];
      s_invstd[threadIdx.x] = a.save_invstd[c];
    } else {  // eval: the running statistics
      const acc_t mean = a.running_mean[c], invstd = acc_t(1) / sqrt(a.running_var[c] + a.eps);
      if (blockIdx.y == 0) {
        a.save_mean[c] = mean;
        a.save_invstd[c] = invstd;
      }
      s_mean[threadIdx.x] = mean;
      s_invstd[threadIdx.x] = invstd;
    }
  }
  if (!(mode & kApply)) return;
  __syncthreads();
  if (!active) return;
  const acc_t gamma = a.weight ? a.weight[c] : acc_t(1), beta = a.bias ? a.bias[c] : acc_t(0);
  const acc_t scale = gamma * s_invstd[threadIdx.x];
  const acc_t shift = beta - s_mean[threadIdx.x] * scale;
  int64_t i = i0 + threadIdx.y;
  for (; i + (kUnroll - 1) * step < i1; i += kUnroll * step) {
    int64_t off[kUnroll];
    acc_t v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      off[u] = offset_of<kCL>(t, c, i + u * step);
      v[u] = static_cast<acc_t>(x[off[u]]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) out[off[u]] = static_cast<scalar_t>(activate(v[u] * scale + shift, a.act, a.slope));
  }
  for (; i < i1; i += step) {
    const int64_t off = offset_of<kCL>(t, c, i);
    out[off] = static_cast<scalar_t>(activate(static_cast<acc_t>(x[off]) * scale + shift, a.act, a.slope));
  }
}

template <typename acc_t>
struct BackwardArgs {
  const acc_t* weight;
  const acc_t* bias;
  const acc_t* save_mean;
  const acc_t* save_invstd;
  acc_t* grad_weight;  // sum(dy' * xhat) per channel, always written when reducing
  acc_t* grad_bias;    // sum(dy') per channel
  acc_t* partial;      // [2, splits, C] (split path)
  int* counters;
  acc_t slope;
  Act act;
  bool training;
};

// dy' (the gradient at the pre-activation) and xhat of one element. The activation's derivative comes
// from the output's sign (out > 0 exactly when y > 0, slope > 0); xhat from the input when it is given,
// otherwise by inverting the activation (y = out / slope for out <= 0) and the affine map.
template <typename scalar_t, typename acc_t>
struct ElementGrad {
  const scalar_t* __restrict__ out;
  const scalar_t* __restrict__ dy;
  const scalar_t* __restrict__ x;  // nullable
  acc_t mean, invstd, beta, inv_gamma, slope;
  Act act;
  __device__ __forceinline__ void operator()(int64_t off, acc_t& g, acc_t& xhat) const {
    const acc_t o = static_cast<acc_t>(out[off]);
    g = static_cast<acc_t>(dy[off]);
    if (act == Act::relu) g = o > acc_t(0) ? g : acc_t(0);
    else if (act == Act::leaky_relu) g = o > acc_t(0) ? g : g * slope;
    if (x) {
      xhat = (static_cast<acc_t>(x[off]) - mean) * invstd;
    } else {
      const acc_t y = (act == Act::leaky_relu && !(o > acc_t(0))) ? o / slope : o;
      xhat = (y - beta) * inv_gamma;
    }
  }
};

template <typename scalar_t, typename acc_t, bool kCL>
__global__ void __launch_bounds__(kThreads) batch_norm_act_backward_kernel(
    const scalar_t* __restrict__ dy, const scalar_t* __restrict__ out, const scalar_t* __restrict__ x,
    scalar_t* __restrict__ dx, Tile t, BackwardArgs<acc_t> a, int mode) {
  __shared__ Sums<acc_t> smem[kThreads];
  __shared__ acc_t s_mean_dy[32], s_mean_dy_xhat[32];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = c < t.C;
  const int64_t i0 = static_cast<int64_t>(blockIdx.y) * t.chunk;
  const int64_t i1 = min(t.M, i0 + t.chunk);
  const int64_t step = blockDim.y;
  const acc_t gamma = active && a.weight ? a.weight[c] : acc_t(1);
  ElementGrad<scalar_t, acc_t> eg{out,
                                  dy,
                                  x,
                                  active ? a.save_mean[c] : acc_t(0),
                                  active ? a.save_invstd[c] : acc_t(0),
                                  active && a.bias ? a.bias[c] : acc_t(0),
                                  // gamma == 0: xhat is not recoverable; it enters grad_input only times
                                  // gamma (0 is exact there) and grad_weight (NaN, below).
                                  gamma != acc_t(0) ? acc_t(1) / gamma : acc_t(0),
                                  a.slope,
                                  a.act};
  const acc_t inv_m = acc_t(1) / static_cast<acc_t>(t.M);
  auto finalize = [&](const Sums<acc_t>& s) {
    a.grad_bias[c] = s.dy;
    a.grad_weight[c] = (gamma == acc_t(0) && !x) ? std::numeric_limits<acc_t>::quiet_NaN() : s.dy_xhat;
    s_mean_dy[threadIdx.x] = s.dy * inv_m;
    s_mean_dy_xhat[threadIdx.x] = s.dy_xhat * inv_m;
  };

  if (mode & kStats) {
    Sums<acc_t> s{0, 0};
    if (active) {
      int64_t i = i0 + threadIdx.y;
      for (; i + (kUnroll - 1) * step < i1; i += kUnroll * step) {
        acc_t g[kUnroll], xh[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) eg(offset_of<kCL>(t, c, i + u * step), g[u], xh[u]);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          s.dy += g[u];
          s.dy_xhat += g[u] * xh[u];
        }
      }
      for (; i < i1; i += step) {
        acc_t g, xh;
        eg(offset_of<kCL>(t, c, i), g, xh);
        s.dy += g;
        s.dy_xhat += g * xh;
      }
    }
    s = reduce_rows(s, smem);
    if (t.splits == 1) {
      if (threadIdx.y == 0 && active) finalize(s);
    } else {
      if (threadIdx.y == 0 && active) {
        a.partial[static_cast<int64_t>(blockIdx.y) * t.C + c] = s.dy;
        a.partial[(static_cast<int64_t>(t.splits) + blockIdx.y) * t.C + c] = s.dy_xhat;
      }
      if (last_block_of_group(a.counters)) {
        Sums<acc_t> total{0, 0};
        if (active) {
          for (int sp = threadIdx.y; sp < t.splits; sp += blockDim.y) {
            total.dy += __ldcg(&a.partial[static_cast<int64_t>(sp) * t.C + c]);
            total.dy_xhat += __ldcg(&a.partial[(static_cast<int64_t>(t.splits) + sp) * t.C + c]);
          }
        }
        total = reduce_rows(total, smem);
        if (threadIdx.y == 0 && active) finalize(total);
      }
    }
  } else if (threadIdx.y == 0 && active && a.training) {  // split path: the reduction kernel's sums
    s_mean_dy[threadIdx.x] = a.grad_bias[c] * inv_m;
    s_mean_dy_xhat[threadIdx.x] = a.grad_weight[c] * inv_m;
  }
  if (!(mode & kApply)) return;
  __syncthreads();
  if (!active) return;
  const acc_t k = gamma * eg.invstd;
  const acc_t mean_dy = a.training ? s_mean_dy[threadIdx.x] : acc_t(0);
  // NaN (gamma == 0, from the output) must not reach grad_input: xhat is 0 there and k is 0.
  acc_t mean_dy_xhat = a.training ? s_mean_dy_xhat[threadIdx.x] : acc_t(0);
  if (mean_dy_xhat != mean_dy_xhat) mean_dy_xhat = acc_t(0);
  int64_t i = i0 + threadIdx.y;
  for (; i + (kUnroll - 1) * step < i1; i += kUnroll * step) {
    int64_t off[kUnroll];
    acc_t g[kUnroll], xh[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      off[u] = offset_of<kCL>(t, c, i + u * step);
      eg(off[u], g[u], xh[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dx[off[u]] = static_cast<scalar_t>(k * (g[u] - mean_dy - xh[u] * mean_dy_xhat));
  }
  for (; i < i1; i += step) {
    const int64_t off = offset_of<kCL>(t, c, i);
    acc_t g, xh;
    eg(off, g, xh);
    dx[off] = static_cast<scalar_t>(k * (g - mean_dy - xh * mean_dy_xhat));
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Block shape and the split of the rows; see the file comment.
struct Plan {
  dim3 block;
  int64_t groups;
  Tile tile;
};

Plan plan_for(const Geometry& g, bool channels_last) {
  Plan p;
  int bx = 1;
  if (channels_last) {
    while (bx < 32 && bx < g.c) bx *= 2;
  }
  p.block = dim3(bx, kThreads / bx);
  p.groups = ceil_div(g.c, bx);
  const int64_t M = g.reduce();
  TORCH_CHECK(M < (int64_t(1) << 31), "hierpar::batch_norm_act: input: at most 2^31 - 1 elements per channel "
              "(N*H*W), got ", M);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t splits = 1;
  // One block per channel group only when that block has little to do (<= 4096 elements) or the groups
  // alone fill the GPU; otherwise aim at ~8 blocks per SM, each with >= 4096 elements.
  if (M * bx > 4096 && p.groups < 2 * sms) {
    const int64_t min_rows = std::max<int64_t>(4096 / bx, p.block.y);
    splits = std::max<int64_t>(1, std::min(ceil_div(8 * sms, p.groups), ceil_div(M, min_rows)));
    splits = std::min<int64_t>(splits, 65535);
  }
  const int64_t chunk = ceil_div(M, splits);
  splits = ceil_div(M, chunk);
  p.tile = Tile{g.c, g.l, M, chunk, static_cast<int>(splits),
                at::cuda::detail::IntDivider<uint32_t>(static_cast<uint32_t>(std::max<int64_t>(g.l, 1)))};
  return p;
}

// A [C] parameter as a contiguous tensor of the accumulation type (a no-op when it already is one).
at::Tensor as_acc(const std::optional<at::Tensor>& p, c10::ScalarType acc) {
  return present(p) ? p->to(acc).contiguous() : at::Tensor();
}

template <typename T>
T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cuda(
    const at::Tensor& input_, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps, c10::string_view activation, double slope) {
  Act act = parse_activation(activation, "hierpar::batch_norm_act");
  Geometry g = check_forward(input_, weight, bias, running_mean, running_var, training, momentum, eps, act, slope);
  c10::cuda::CUDAGuard guard(input_.device());
  auto layout = layout_of(input_);
  const bool cl = layout == c10::MemoryFormat::ChannelsLast;
  at::Tensor input = input_.contiguous(layout);
  const auto acc = stats_dtype(input.scalar_type());
  at::Tensor out = new_output(input.sizes(), input.options(), layout);
  at::Tensor save_mean = new_output({g.c}, input.options().dtype(acc));
  at::Tensor save_invstd = new_output({g.c}, input.options().dtype(acc));
  if (input.numel() == 0) {  // eval with an empty batch (training rejects it): nothing to normalise
    save_mean.copy_(*running_mean);
    save_invstd.copy_(running_var->to(acc).add(eps).rsqrt());
    return {out, save_mean, save_invstd};
  }

  at::Tensor w = as_acc(weight, acc), b = as_acc(bias, acc);
  at::Tensor rm = as_acc(running_mean, acc), rv = as_acc(running_var, acc);
  Plan plan = plan_for(g, cl);
  const bool split = training && plan.tile.splits > 1;
  at::Tensor partial, counters;
  if (split) {
    partial = at::empty({2, plan.tile.splits, g.c}, input.options().dtype(acc));
    counters = at::zeros({plan.groups}, input.options().dtype(at::kInt));
  }
  const dim3 grid(static_cast<unsigned>(plan.groups), static_cast<unsigned>(plan.tile.splits));
  auto stream = at::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "batch_norm_act_cuda", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    ForwardArgs<acc_t> args{ptr_or_null<acc_t>(w),
                            ptr_or_null<acc_t>(b),
                            training ? ptr_or_null<acc_t>(rm) : nullptr,
                            training ? ptr_or_null<acc_t>(rv) : nullptr,
                            save_mean.data_ptr<acc_t>(),
                            save_invstd.data_ptr<acc_t>(),
                            ptr_or_null<acc_t>(partial),
                            ptr_or_null<int>(counters),
                            static_cast<acc_t>(momentum),
                            static_cast<acc_t>(eps),
                            static_cast<acc_t>(slope),
                            act,
                            training};
    if (!training) {  // eval reads the running statistics
      args.running_mean = rm.data_ptr<acc_t>();
      args.running_var = rv.data_ptr<acc_t>();
    }
    auto launch = [&](int mode) {
      const scalar_t* xp = input.const_data_ptr<scalar_t>();
      scalar_t* op = out.mutable_data_ptr<scalar_t>();
      if (cl) {
        batch_norm_act_forward_kernel<scalar_t, acc_t, true><<<grid, plan.block, 0, stream>>>(xp, op, plan.tile, args, mode);
      } else {
        batch_norm_act_forward_kernel<scalar_t, acc_t, false><<<grid, plan.block, 0, stream>>>(xp, op, plan.tile, args, mode);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (!training) {
      launch(kApply);
    } else if (!split) {
      launch(kStats | kApply);
    } else {
      launch(kStats);
      launch(kApply);
    }
  });

  if (training && present(running_mean)) {  // running stats kept in another dtype or not contiguous
    if (!rm.is_same(*running_mean)) running_mean->copy_(rm);
    if (!rv.is_same(*running_var)) running_var->copy_(rv);
  }
  return {out, save_mean, save_invstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad_output_, const at::Tensor& output_, const std::optional<at::Tensor>& input_,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, double eps, c10::string_view activation, double slope,
    std::array<bool, 3> output_mask) {
  Act act = parse_activation(activation, "hierpar::batch_norm_act_backward");
  Geometry g = check_backward(grad_output_, output_, input_, weight, bias, save_mean, save_invstd, eps, act, slope);
  c10::cuda::CUDAGuard guard(output_.device());
  auto layout = layout_of(output_);
  const bool cl = layout == c10::MemoryFormat::ChannelsLast;
  at::Tensor output = output_.contiguous(layout);
  at::Tensor grad_output = grad_output_.contiguous(layout);
  at::Tensor input = present(input_) ? input_->contiguous(layout) : at::Tensor();
  const auto acc = stats_dtype(output.scalar_type());
  at::Tensor w = as_acc(weight, acc), b = as_acc(bias, acc);
  at::Tensor mean = save_mean.contiguous(), invstd = save_invstd.contiguous();

  const bool need_sums = output_mask[1] || output_mask[2] || (output_mask[0] && training);
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) grad_input = new_output(output.sizes(), output.options(), layout);
  // Sums land in accumulation-type [C] buffers; they are the parameter gradients when requested.
  at::Tensor sum_dy_xhat = need_sums ? new_output({g.c}, output.options().dtype(acc)) : at::Tensor();
  at::Tensor sum_dy = need_sums ? new_output({g.c}, output.options().dtype(acc)) : at::Tensor();
  if (output.numel() == 0) {
    if (need_sums) {
      sum_dy.zero_();
      sum_dy_xhat.zero_();
    }
  } else if (need_sums || output_mask[0]) {
    Plan plan = plan_for(g, cl);
    const bool split = need_sums && plan.tile.splits > 1;
    at::Tensor partial, counters;
    if (split) {
      partial = at::empty({2, plan.tile.splits, g.c}, output.options().dtype(acc));
      counters = at::zeros({plan.groups}, output.options().dtype(at::kInt));
    }
    const dim3 grid(static_cast<unsigned>(plan.groups), static_cast<unsigned>(plan.tile.splits));
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, output.scalar_type(), "batch_norm_act_backward_cuda", [&] {
      using acc_t = at::acc_type<scalar_t, true>;
      BackwardArgs<acc_t> args{ptr_or_null<acc_t>(w),
                               ptr_or_null<acc_t>(b),
                               mean.data_ptr<acc_t>(),
                               invstd.data_ptr<acc_t>(),
                               ptr_or_null<acc_t>(sum_dy_xhat),
                               ptr_or_null<acc_t>(sum_dy),
                               ptr_or_null<acc_t>(partial),
                               ptr_or_null<int>(counters),
                               static_cast<acc_t>(slope),
                               act,
                               training};
      auto launch = [&](int mode) {
        const scalar_t* dyp = grad_output.const_data_ptr<scalar_t>();
        const scalar_t* op = output.const_data_ptr<scalar_t>();
        const scalar_t* xp = input.defined() ? input.const_data_ptr<scalar_t>() : nullptr;
        scalar_t* dxp = grad_input.defined() ? grad_input.mutable_data_ptr<scalar_t>() : nullptr;
        if (cl) {
          batch_norm_act_backward_kernel<scalar_t, acc_t, true><<<grid, plan.block, 0, stream>>>(dyp, op, xp, dxp, plan.tile, args, mode);
        } else {
          batch_norm_act_backward_kernel<scalar_t, acc_t, false><<<grid, plan.block, 0, stream>>>(dyp, op, xp, dxp, plan.tile, args, mode);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      const int apply = output_mask[0] ? kApply : 0;
      if (!need_sums) {
        launch(kApply);
      } else if (!split) {
        launch(kStats | apply);
      } else {
        launch(kStats);
        if (apply) launch(kApply);
      }
    });
  }
  auto param_dtype = present(weight) ? weight->scalar_type() : acc;
  if (output_mask[1]) grad_weight = sum_dy_xhat.scalar_type() == param_dtype ? sum_dy_xhat : sum_dy_xhat.to(param_dtype);
  if (output_mask[2]) {
    auto bias_dtype = present(bias) ? bias->scalar_type() : param_dtype;
    grad_bias = sum_dy.scalar_type() == bias_dtype ? sum_dy : sum_dy.to(bias_dtype);
  }
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace
}  // namespace hierpar::detail::bn

TORCH_LIBRARY_IMPL(hierpar, CUDA, m) {
  m.impl("batch_norm_act", &hierpar::detail::bn::forward_cuda);
  m.impl("batch_norm_act_backward", &hierpar::detail::bn::backward_cuda);
}
