// Small-C_out kernels of hierpar::conv_transpose2d for kernel 4, stride 2, padding 1 (DCGAN's last layer,
// 32 -> 3 channels): CUDA-core kernels with fp32 accumulation, reading every tensor through its strides (NCHW,
// channels_last or any other 4-d layout: no conversion copies, no weight packing).
//
// Why not the implicit GEMM of conv_transpose_k4s2p1.cu: with C_out <= 4 the forward GEMM's N fills 4 of a
// 16-wide MMA tile, grad_input's A operand gathers 3-channel pixels (no 16-byte loads) and grad_weight's M is
// 48; the layer is memory-bound anyway (batch 1024 bf16: ~250 MB, a ~60 us floor), so the arithmetic runs on
// the CUDA cores from shared memory and each kernel reads its inputs about once.
//  - forward: a block is a 32 x 8 tile of input positions (one thread each); per 16-channel chunk it stages
//    the tile plus a one-pixel halo (fp32, channel-major so the threads' reads are conflict-free) and the
//    chunk's weights, and each thread accumulates the 4 output pixels (2qy + py, 2qx + px) x C_out it owns
//    from the 3 x 3 input neighbourhood: out[2q + p] += x[q + d] * w[p + 1 - 2d] for d in {-1, 0, 1}.
//  - grad_input: a thread per input pixel keeps the 4 x 4 x C_out grad_output patch its taps read in registers
//    and produces 8 input channels at a time against weights staged in shared memory ([tap, co][ci]).
//  grad_weight is not here: a CUDA-core reduction over every input pixel (one thread per (ci, co) summing 16
//  taps) measured 1225 us at batch 1024 bf16 against stock's 227, while the general path's im2col + cuBLAS
//  GEMM takes well under the 1033 us of its whole backward; conv_transpose_kernel.cu sends grad_weight there.
#include "common.h"
#include "cuda/conv_transpose_k4s2p1.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>

namespace hierpar::detail {
namespace {

// Element strides of a 4-d tensor in (n, c, y, x) order.
struct Strides4d {
  int64_t n, c, y, x;
};
Strides4d strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)}; }

struct SmallArgs {
  int batch, cin, cout, H, W;  // input size; the output is 2H x 2W
  const void* x;
  Strides4d xs;
  const void* go;  // grad_output
  Strides4d gos;
  const void* w;  // [C_in, C_out, 4, 4] by strides
  Strides4d ws;
  const void* bias;  // nullptr when none
  void* out;         // forward output or grad_input
  Strides4d os;
};

constexpr int kThreads = 256;

// ---- forward ------------------------------------------------------------------------------------------------
constexpr int kTileX = 32, kTileY = 8, kChunkC = 16;
static_assert(kTileX * kTileY == kThreads, "one thread per input position of the tile");

template <typename scalar_t, int CO>
__global__ void __launch_bounds__(kThreads) small_cout_forward_kernel(const SmallArgs a, bool channels_inner) {
  constexpr int HX = kTileX + 2, HY = kTileY + 2, HALO = HX * HY;
  __shared__ float xsm[kChunkC][HY][HX];
  __shared__ __align__(16) float wsm[kChunkC][16 * CO];  // [ci][(ky, kx, co)]
  const scalar_t* x = static_cast<const scalar_t*>(a.x);
  const scalar_t* w = static_cast<const scalar_t*>(a.w);
  const scalar_t* bias = static_cast<const scalar_t*>(a.bias);
  scalar_t* out = static_cast<scalar_t*>(a.out);
  const int tx = threadIdx.x % kTileX, ty = threadIdx.x / kTileX;
  const int qx0 = blockIdx.x * kTileX, qy0 = blockIdx.y * kTileY;
  const int qx = qx0 + tx, qy = qy0 + ty;

  for (int n = blockIdx.z; n < a.batch; n += gridDim.z) {
    float acc[4][CO];  // [py * 2 + px][co]
#pragma unroll
    for (int co = 0; co < CO; ++co) {
      const float b = bias != nullptr && co < a.cout ? static_cast<float>(bias[co]) : 0.f;
#pragma unroll
      for (int p = 0; p < 4; ++p) acc[p][co] = b;
    }
    const scalar_t* xn = x + n * a.xs.n;
    for (int c0 = 0; c0 < a.cin; c0 += kChunkC) {
      const int cn = min(kChunkC, a.cin - c0);
      __syncthreads();  // the previous chunk's reads are done
      for (int e = threadIdx.x; e < kChunkC * HALO; e += kThreads) {
        // Global reads follow the layout: channel-fastest for channels_last, pixel-fastest for NCHW.
        const int c = channels_inner ? e % kChunkC : e / HALO;
        const int p = channels_inner ? e / kChunkC : e % HALO;
        const int hy = p / HX, hx = p - hy * HX, y = qy0 - 1 + hy, xx = qx0 - 1 + hx;
        float v = 0.f;
        if (c < cn && y >= 0 && y < a.H && xx >= 0 && xx < a.W)
          v = static_cast<float>(xn[(c0 + c) * a.xs.c + y * a.xs.y + xx * a.xs.x]);
        xsm[c][hy][hx] = v;
      }
      for (int e = threadIdx.x; e < kChunkC * 16 * CO; e += kThreads) {
        const int c = e / (16 * CO), r = e - c * (16 * CO), tap = r / CO, co = r - tap * CO;
        float v = 0.f;
        if (c < cn && co < a.cout)
          v = static_cast<float>(w[(c0 + c) * a.ws.n + co * a.ws.c + (tap >> 2) * a.ws.y + (tap & 3) * a.ws.x]);
        wsm[c][r] = v;
      }
      __syncthreads();
#pragma unroll 2
      for (int c = 0; c < cn; ++c) {
        float xv[3][3];
#pragma unroll
        for (int dy = 0; dy < 3; ++dy)
#pragma unroll
          for (int dx = 0; dx < 3; ++dx) xv[dy][dx] = xsm[c][ty + dy][tx + dx];
        float wv[16 * CO];
#pragma unroll
        for (int i = 0; i < 4 * CO; ++i) {
          const float4 q = reinterpret_cast<const float4*>(wsm[c])[i];
          wv[4 * i] = q.x;
          wv[4 * i + 1] = q.y;
          wv[4 * i + 2] = q.z;
          wv[4 * i + 3] = q.w;
        }
        // Output phase (py, px), tap (ty, tx): input offset d = p - t, kernel index k = 1 - p + 2t.
#pragma unroll
        for (int py = 0; py < 2; ++py)
#pragma unroll
          for (int px = 0; px < 2; ++px)
#pragma unroll
            for (int tty = 0; tty < 2; ++tty)
#pragma unroll
              for (int ttx = 0; ttx < 2; ++ttx) {
                const float v = xv[py - tty + 1][px - ttx + 1];
                const int tap = (1 - py + 2 * tty) * 4 + (1 - px + 2 * ttx);
#pragma unroll
                for (int co = 0; co < CO; ++co) acc[py * 2 + px][co] = fmaf(v, wv[tap * CO + co], acc[py * 2 + px][co]);
              }
      }
    }
    if (qy < a.H && qx < a.W) {
      scalar_t* on = out + n * a.os.n;
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const int64_t pix = (2 * qy + (p >> 1)) * a.os.y + (2 * qx + (p & 1)) * a.os.x;
#pragma unroll
        for (int co = 0; co < CO; ++co)
          if (co < a.cout) on[pix + co * a.os.c] = static_cast<scalar_t>(acc[p][co]);
      }
    }
  }
}

// ---- grad_input ---------------------------------------------------------------------------------------------
constexpr int kGiChunk = 64;  // input channels whose weights are staged at a time

// Writes 8 channels (count of them valid) at p with channel stride sc; one or two 16-byte stores when `vec`.
template <typename scalar_t>
__device__ inline void store8(scalar_t* p, int64_t sc, const float (&v)[8], int count, bool vec) {
  if (vec && count == 8) {
    alignas(16) scalar_t packed[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) packed[i] = static_cast<scalar_t>(v[i]);
#pragma unroll
    for (int q = 0; q < int(8 * sizeof(scalar_t)) / 16; ++q)
      reinterpret_cast<uint4*>(p)[q] = reinterpret_cast<const uint4*>(packed)[q];
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (i < count) p[i * sc] = static_cast<scalar_t>(v[i]);
  }
}

template <typename scalar_t, int CO>
__global__ void __launch_bounds__(kThreads) small_cout_grad_input_kernel(const SmallArgs a, bool vec_store) {
  __shared__ __align__(16) float wsm[16 * CO][kGiChunk];  // [(ky, kx, co)][ci]
  const scalar_t* go = static_cast<const scalar_t*>(a.go);
  const scalar_t* w = static_cast<const scalar_t*>(a.w);
  scalar_t* gi = static_cast<scalar_t*>(a.out);
  const int hw = a.H * a.W;
  const int idx = blockIdx.x * kThreads + threadIdx.x;
  const bool active = idx < a.batch * hw;
  const int n = active ? idx / hw : 0, rem = idx - n * hw, iy = rem / a.W, ix = rem - iy * a.W;

  // The grad_output patch this input pixel's 16 taps landed on (zero where a tap fell in the padding).
  float gv[16 * CO];
  const scalar_t* gon = go + n * a.gos.n;
#pragma unroll
  for (int ky = 0; ky < 4; ++ky)
#pragma unroll
    for (int kx = 0; kx < 4; ++kx) {
      const int oy = 2 * iy - 1 + ky, ox = 2 * ix - 1 + kx;
      const bool in = active && oy >= 0 && oy < 2 * a.H && ox >= 0 && ox < 2 * a.W;
#pragma unroll
      for (int co = 0; co < CO; ++co)
        gv[(ky * 4 + kx) * CO + co] =
            in && co < a.cout ? static_cast<float>(gon[co * a.gos.c + oy * a.gos.y + ox * a.gos.x]) : 0.f;
    }

  scalar_t* gin = gi + n * a.os.n + iy * a.os.y + ix * a.os.x;
#pragma unroll 1
  for (int c0 = 0; c0 < a.cin; c0 += kGiChunk) {
    const int cn = min(kGiChunk, a.cin - c0);
    __syncthreads();
    for (int e = threadIdx.x; e < 16 * CO * kGiChunk; e += kThreads) {
      const int j = e / kGiChunk, c = e - j * kGiChunk, tap = j / CO, co = j - tap * CO;
      float v = 0.f;
      if (c < cn && co < a.cout)
        v = static_cast<float>(w[(c0 + c) * a.ws.n + co * a.ws.c + (tap >> 2) * a.ws.y + (tap & 3) * a.ws.x]);
      wsm[j][c] = v;
    }
    __syncthreads();
#pragma unroll 1
    for (int cs = 0; cs < cn; cs += 8) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 16 * CO; ++j) {
        const float4 w0 = *reinterpret_cast<const float4*>(&wsm[j][cs]);
        const float4 w1 = *reinterpret_cast<const float4*>(&wsm[j][cs + 4]);
        acc[0] = fmaf(gv[j], w0.x, acc[0]);
        acc[1] = fmaf(gv[j], w0.y, acc[1]);
        acc[2] = fmaf(gv[j], w0.z, acc[2]);
        acc[3] = fmaf(gv[j], w0.w, acc[3]);
        acc[4] = fmaf(gv[j], w1.x, acc[4]);
        acc[5] = fmaf(gv[j], w1.y, acc[5]);
        acc[6] = fmaf(gv[j], w1.z, acc[6]);
        acc[7] = fmaf(gv[j], w1.w, acc[7]);
      }
      if (active) store8(gin + (c0 + cs) * a.os.c, a.os.c, acc, min(8, cn - cs), vec_store);
    }
  }
}

template <typename F>
void dispatch_small(at::ScalarType dtype, int cout, F&& f) {
  auto by_cout = [&](auto tag) {
    switch (cout) {
      case 1: f(tag, std::integral_constant<int, 1>{}); break;
      case 2: f(tag, std::integral_constant<int, 2>{}); break;
      case 3: f(tag, std::integral_constant<int, 3>{}); break;
      default: f(tag, std::integral_constant<int, 4>{}); break;
    }
  };
  switch (dtype) {
    case at::kFloat: by_cout(float{}); break;
    case at::kBFloat16: by_cout(at::BFloat16{}); break;
    case at::kHalf: by_cout(at::Half{}); break;
    default: TORCH_CHECK(false, "conv_transpose2d: the small-C_out path has no ", dtype, " kernel");
  }
}

SmallArgs base_args(const ConvTranspose2dGeometry& g, const at::Tensor& weight) {
  SmallArgs a{};
  a.batch = int(g.batch);
  a.cin = int(g.in_channels);
  a.cout = int(g.out_channels);
  a.H = int(g.in_h);
  a.W = int(g.in_w);
  a.w = weight.const_data_ptr();
  a.ws = strides_of(weight);
  return a;
}

}  // namespace

bool k4s2p1_small_cout_applies(const ConvTranspose2dGeometry& g, at::ScalarType dtype) {
  const bool shape = g.kernel_h == 4 && g.kernel_w == 4 && g.stride_h == 2 && g.stride_w == 2 && g.pad_h == 1 &&
                     g.pad_w == 1 && g.dilation_h == 1 && g.dilation_w == 1 && g.groups == 1 &&
                     g.out_h == 2 * g.in_h && g.out_w == 2 * g.in_w;
  if (!shape || g.out_channels > kSmallCoutMax || g.in_channels * g.out_channels > 1024) return false;
  // 32-bit pixel and element indices within one image, 32-bit pixel counts overall (offsets are 64-bit).
  if (g.in_pixels() >= INT_MAX / 4 || 4 * g.in_h * g.in_w * std::max(g.in_channels, g.out_channels) >= INT_MAX)
    return false;
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

void k4s2p1_small_cout_forward(const ConvTranspose2dGeometry& g, const at::Tensor& input4, const at::Tensor& weight,
                               const at::Tensor& bias, const at::Tensor& out) {
  c10::cuda::CUDAGuard device_guard(input4.device());
  SmallArgs a = base_args(g, weight);
  a.x = input4.const_data_ptr();
  a.xs = strides_of(input4);
  a.bias = bias.defined() ? bias.const_data_ptr() : nullptr;
  a.out = out.mutable_data_ptr();
  a.os = strides_of(out);
  const bool channels_inner = a.xs.c == 1;
  const dim3 grid((a.W + kTileX - 1) / kTileX, (a.H + kTileY - 1) / kTileY, std::min(a.batch, 65535));
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_small(input4.scalar_type(), a.cout, [&](auto tag, auto co) {
    using scalar_t = decltype(tag);
    small_cout_forward_kernel<scalar_t, decltype(co)::value><<<grid, kThreads, 0, stream>>>(a, channels_inner);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void k4s2p1_small_cout_grad_input(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4,
                                  const at::Tensor& weight, const at::Tensor& grad_input) {
  c10::cuda::CUDAGuard device_guard(grad_output4.device());
  SmallArgs a = base_args(g, weight);
  a.go = grad_output4.const_data_ptr();
  a.gos = strides_of(grad_output4);
  a.out = grad_input.mutable_data_ptr();
  a.os = strides_of(grad_input);
  auto stream = at::cuda::getCurrentCUDAStream();
  const int total = a.batch * a.H * a.W;
  const bool vec = a.os.c == 1 && a.cin % 8 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
  dispatch_small(grad_output4.scalar_type(), a.cout, [&](auto tag, auto co) {
    small_cout_grad_input_kernel<decltype(tag), decltype(co)::value>
        <<<(total + kThreads - 1) / kThreads, kThreads, 0, stream>>>(a, vec);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace hierpar::detail
