// The small-C_out forward (small_cout.cuh): a CUDA-core kernel for any strides and dtype, a tensor-core one for
// channels-innermost 16-bit inputs and TF32, and the entry point that picks one; also the path's shape predicate.
#include "cuda/small_cout/small_cout.cuh"

namespace hierpar::detail {
namespace {

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
        wsm[c][r] = staged_weight(a, w, c0, c, cn, co, tap);
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

template <typename scalar_t, int CO, int CH>
__global__ void __launch_bounds__(kThreads, 2) small_cout_forward_mma_kernel(const SmallArgs a, bool vec_store) {
  using T = ForwardTile<scalar_t, CH>;
  using F = Tc<scalar_t>;
  using E = typename F::E;
  constexpr int HX = T::HX, LD = T::LD, VEC = F::kVec;
  constexpr int kWeightLoads = 9 * 16 * CH / kThreads;
  extern __shared__ __align__(16) uint16_t smem16[];
  E* const smem = reinterpret_cast<E*>(smem16);
  E* const wsm = smem + 2 * T::kTileElems;
  const E* x = static_cast<const E*>(a.x);
  const E* w = static_cast<const E*>(a.w);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  const int qx0 = blockIdx.x * kMmaCols, qy0 = blockIdx.y * kMmaRows, qy = qy0 + warp;
  const bool one_chunk = a.cin == CH;
  E* const out_rows = wsm + T::kWeightElems + warp * 2 * T::kOutRowElems;  // this warp's two output rows

  auto issue_tile = [&](int n, int c0, E* xs) {
    for (int v = threadIdx.x; v < T::HY * HX * (CH / VEC); v += kThreads) {
      const int p = v / (CH / VEC), cv = v % (CH / VEC), hy = p / HX, hx = p - hy * HX, y = qy0 - 1 + hy,
                xx = qx0 - 1 + hx;
      const bool in = y >= 0 && y < a.H && xx >= 0 && xx < a.W;
      cp_async16(xs + p * LD + cv * VEC, in ? x + n * a.xs.n + y * a.xs.y + xx * a.xs.x + c0 + cv * VEC : x, in);
    }
    mma::cp_async_commit();
  };
  // All loads before the first store (one memory latency, not kWeightLoads of them).
  auto stage_weights = [&](int c0) {
    E wv[kWeightLoads];
#pragma unroll
    for (int i = 0; i < kWeightLoads; ++i) {
      const int e = threadIdx.x + i * kThreads, ci = e % CH, nn = (e / CH) & 15, d = e / (16 * CH);
      const int py = nn >> 3, px = (nn >> 2) & 1, co = nn & 3;
      const int ky = py + 1 - 2 * (d / 3 - 1), kx = px + 1 - 2 * (d % 3 - 1);
      wv[i] = 0;
      if (co < CO && ky >= 0 && ky < 4 && kx >= 0 && kx < 4)
        wv[i] = w[(c0 + ci) * a.ws.n + co * a.ws.c + ky * a.ws.y + kx * a.ws.x];
    }
#pragma unroll
    for (int i = 0; i < kWeightLoads; ++i) {
      const int e = threadIdx.x + i * kThreads;
      wsm[(e / CH) * LD + e % CH] = wv[i];
    }
  };

  int n = blockIdx.z, c0 = 0, buf = 0;
  if (n < a.batch) issue_tile(n, 0, smem);
  if (one_chunk) stage_weights(0);  // read only after the loop's second barrier
  float acc[2][2][4] = {};          // [16-position tile][py][fragment]
  while (n < a.batch) {
    int next_n = n, next_c0 = c0 + CH;
    if (next_c0 == a.cin) next_n += gridDim.z, next_c0 = 0;
    __syncthreads();  // the previous step's reads of the other buffer (and of the weights) are done
    if (!one_chunk) stage_weights(c0);
    if (next_n < a.batch) {
      issue_tile(next_n, next_c0, smem + (buf ^ 1) * T::kTileElems);
      mma::cp_async_wait<1>();  // this step's tile has landed; the next one stays in flight
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();
    const E* xs = smem + buf * T::kTileElems;
#pragma unroll
    for (int d = 0; d < 9; ++d) {
      const int dy = d / 3 - 1, dx = d % 3 - 1;
#pragma unroll
      for (int kk = 0; kk < CH; kk += F::kK) {
        uint32_t bf[2][2];
#pragma unroll
        for (int py = 0; py < 2; ++py) F::load_b(bf[py], wsm + (d * 16 + py * 8 + g) * LD + kk, t4);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          uint32_t af[4];
          const int pix = (warp + 1 + dy) * HX + mt * 16 + 1 + dx;  // the tile's first position
          if constexpr (F::kTf32)
            F::load_a(af, xs + (pix + g) * LD + kk, xs + (pix + g + 8) * LD + kk, t4);
          else
            ldmatrix_x4(af, smem_addr(xs + (pix + (lane & 15)) * LD + kk) + (lane >> 4) * 16);
          if (dy <= 0) mma::mma<scalar_t>(acc[mt][0], af, bf[0]);
          if (dy >= 0) mma::mma<scalar_t>(acc[mt][1], af, bf[1]);
        }
      }
    }
    // The image's last chunk: store. C fragment: position row g (+8), column n = py*8 + 2*t4 (+1) =
    // (px = t4 / 2, co = 2 * (t4 % 2) (+1)).
    if (next_c0 == 0) {
      const scalar_t* bias = static_cast<const scalar_t*>(a.bias);
      const int px = t4 >> 1, co0 = (t4 & 1) * 2;
      scalar_t* out = static_cast<scalar_t*>(a.out) + n * a.os.n;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int col = mt * 16 + g + 8 * h, qx = qx0 + col;
#pragma unroll
          for (int py = 0; py < 2; ++py)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int co = co0 + e;
              if (co >= CO) continue;
              const float b = bias != nullptr ? static_cast<float>(bias[co]) : 0.f;
              const float v = acc[mt][py][2 * h + e] + b;
              if (vec_store)  // staged as the output rows' bytes: pixel (2 col + px) x CO channels
                out_rows[py * T::kOutRowElems + (2 * col + px) * CO + co] = F::bits(v);
              else if (qy < a.H && qx < a.W)
                out[co * a.os.c + (2 * qy + py) * a.os.y + (2 * qx + px) * a.os.x] = static_cast<scalar_t>(v);
            }
        }
      if (vec_store && qy < a.H) {
        __syncwarp();
        // Output row 2 qy + py, pixels [2 qx0, min(2 W, 2 qx0 + 2 kMmaCols)): contiguous, 16-byte aligned.
        const int units = (min(2 * a.W, 2 * qx0 + 2 * kMmaCols) - 2 * qx0) * CO / VEC;
        for (int v = lane; v < 2 * units; v += 32) {
          const int py = v / units, u = v - py * units;
          *reinterpret_cast<uint4*>(out + (2 * qy + py) * a.os.y + 2 * qx0 * CO + u * VEC) =
              *reinterpret_cast<const uint4*>(out_rows + py * T::kOutRowElems + u * VEC);
        }
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int py = 0; py < 2; ++py)
#pragma unroll
          for (int f = 0; f < 4; ++f) acc[mt][py][f] = 0.f;
    }
    n = next_n;
    c0 = next_c0;
    buf ^= 1;
  }
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
  SmallArgs a = small_args(g, input4, /*grad_output=*/at::Tensor(), weight, out);
  a.bias = bias.defined() ? bias.const_data_ptr() : nullptr;
  auto stream = at::cuda::getCurrentCUDAStream();
  if (mma_applies(g, input4.scalar_type(), forward_mma_smem(input4.scalar_type())) && reads_by_vectors(input4)) {
    const int tiles_x = (a.W + kMmaCols - 1) / kMmaCols, tiles_y = (a.H + kMmaRows - 1) / kMmaRows;
    dispatch_small(input4.scalar_type(), a.cout, [&](auto tag, auto co) {
      using scalar_t = decltype(tag);
      constexpr int CO = decltype(co)::value;
      auto launch = [&](auto kernel, int smem) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        const dim3 grid(tiles_x, tiles_y, persistent_image_blocks(kernel, smem, tiles_x * tiles_y, a.batch));
        kernel<<<grid, kThreads, smem, stream>>>(a, rows_are_byte_spans(out));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if constexpr (Tc<scalar_t>::kTf32)  // 16-channel chunks only (see ForwardTile)
        launch(small_cout_forward_mma_kernel<scalar_t, CO, 16>, ForwardTile<scalar_t, 16>::kSmemBytes);
      else if (a.cin % 32 == 0)
        launch(small_cout_forward_mma_kernel<scalar_t, CO, 32>, ForwardTile<scalar_t, 32>::kSmemBytes);
      else
        launch(small_cout_forward_mma_kernel<scalar_t, CO, 16>, ForwardTile<scalar_t, 16>::kSmemBytes);
    });
    return;
  }
  const bool channels_inner = a.xs.c == 1;
  const dim3 grid((a.W + kTileX - 1) / kTileX, (a.H + kTileY - 1) / kTileY, std::min(a.batch, 65535));
  dispatch_small(input4.scalar_type(), a.cout, [&](auto tag, auto co) {
    using scalar_t = decltype(tag);
    small_cout_forward_kernel<scalar_t, decltype(co)::value><<<grid, kThreads, 0, stream>>>(a, channels_inner);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace hierpar::detail
