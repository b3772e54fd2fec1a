// The small-C_out grad_input (small_cout.cuh): a CUDA-core kernel and a tensor-core one, and the entry point that
// picks one (hierpar::conv2d's forward is this pass, with its LeakyReLU applied as it stores).
#include "cuda/small_cout/small_cout.cuh"

namespace hierpar::detail {
namespace {

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
      wsm[j][c] = staged_weight(a, w, c0, c, cn, co, tap);
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
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = leaky(acc[i], a.grad_input_slope);
      if (active) store8(gin + (c0 + cs) * a.os.c, a.os.c, acc, min(8, cn - cs), vec_store);
    }
  }
}

// Persistent blocks walk the images n = blockIdx.z, + gridDim.z, ... With kRawRows the next image's grad_output rows
// are copied while this one multiplies and stores; otherwise (any strides) every element is loaded through the
// strides.
template <typename scalar_t, int CO, bool kRawRows>
__global__ void __launch_bounds__(kThreads, 2) small_cout_grad_input_mma_kernel(const SmallArgs a, int tiles_x,
                                                                             bool vec_store) {
  using T = GradInputTile<scalar_t>;
  using F = Tc<scalar_t>;
  using E = typename F::E;
  constexpr int LD = T::kWeightLd, OUT_LD = T::kOutLd, VEC = F::kVec, kWeightLoads = kCiChunk * 64 / kThreads;
  constexpr int kRaw = kRawBytes<sizeof(E)>;
  extern __shared__ __align__(16) uint16_t smem16[];
  E* const gs = reinterpret_cast<E*>(smem16);
  E* const wsm = gs + kGoElems;
  E* const outs = wsm + kCiChunk * LD;
  char* const raw = reinterpret_cast<char*>(outs + kMmaRows * kMmaCols * OUT_LD);
  const E* w = static_cast<const E*>(a.w);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  const int ix0 = (blockIdx.x % tiles_x) * kMmaCols, iy0 = (blockIdx.x / tiles_x) * kMmaRows, iy = iy0 + warp;
  const int c0 = blockIdx.y * kCiChunk, channels = min(kCiChunk, a.cin - c0);

  if constexpr (kRawRows) {
    if (blockIdx.z < a.batch) issue_raw_rows<CO, E>(a, blockIdx.z, iy0, ix0, raw);  // in flight with the weights'
    mma::cp_async_commit();
  }
  {
    E wv[kWeightLoads];
#pragma unroll
    for (int i = 0; i < kWeightLoads; ++i) {
      const int e = threadIdx.x + i * kThreads, k = e & 63, ci = e >> 6, co = k & 3, tap = k >> 2;
      wv[i] = 0;
      if (co < CO && ci < channels)
        wv[i] = w[(c0 + ci) * a.ws.n + co * a.ws.c + (tap >> 2) * a.ws.y + (tap & 3) * a.ws.x];
    }
#pragma unroll
    for (int i = 0; i < kWeightLoads; ++i) {
      const int e = threadIdx.x + i * kThreads;
      wsm[(e >> 6) * LD + (e & 63)] = wv[i];
    }
  }
  int buf = 0;
  for (int n = blockIdx.z; n < a.batch; n += gridDim.z, buf ^= 1) {
    if constexpr (kRawRows) {
      __syncthreads();  // the other raw buffer was spread, and the tile read, in the previous trip
      if (n + int(gridDim.z) < a.batch) {
        issue_raw_rows<CO, E>(a, n + gridDim.z, iy0, ix0, raw + (buf ^ 1) * kRaw);
        mma::cp_async_commit();
        mma::cp_async_wait<1>();
      } else {
        mma::cp_async_wait<0>();
      }
      __syncthreads();  // every thread's copies of image n have landed
      spread_raw_rows<CO>(a, iy0, ix0, raw + buf * kRaw, gs);
    } else {
      E gv[kGoLoads];
      load_grad_output<CO>(a, n, iy0, ix0, gv);
      __syncthreads();  // the previous image's reads of the tile are done
      store_grad_output(gs, gv);
    }
    __syncthreads();
    // A fragments of both 16-position tiles, K step s covering k = (ky*4 + kx)*4 + co in [s kK, (s + 1) kK):
    // position (iy, ix) reads grad_output row 2*warp + ky of the tile, column 2*(ix - ix0) + kx. Rows g + 8 are 8
    // positions = 16 grad_output columns further.
    constexpr int kSteps = 64 / F::kK;
    uint32_t af[2][kSteps][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const int ky = s * F::kK / 16, kx = s * F::kK % 16 / 4;
        const E* p = gs + ((2 * warp + ky) * kGoCols + 2 * (mt * 16 + g) + kx) * 4;
        F::load_a(af[mt][s], p, p + 64, t4);
      }
    // The warp's row of the output tile, [position][ci] in shared memory: fragment (row g (+8), ci 2*t4 (+1)).
    E* const out_row = outs + warp * kMmaCols * OUT_LD;
#pragma unroll
    for (int nt = 0; nt < kCiChunk / 8; ++nt) {
      if (nt * 8 >= channels) break;
      float acc[2][4] = {};
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        uint32_t bf[2];
        F::load_b(bf, wsm + (nt * 8 + g) * LD + s * F::kK, t4);
        mma::mma<scalar_t>(acc[0], af[0][s], bf);
        mma::mma<scalar_t>(acc[1], af[1][s], bf);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          F::store_pair(out_row + (mt * 16 + g + 8 * h) * OUT_LD + nt * 8 + 2 * t4,
                        leaky(acc[mt][2 * h], a.grad_input_slope), leaky(acc[mt][2 * h + 1], a.grad_input_slope));
    }
    __syncwarp();
    if (iy < a.H) {
      E* gi = static_cast<E*>(a.out) + n * a.os.n + iy * a.os.y;
      if (vec_store) {  // VEC channels a store
        for (int v = lane; v < kMmaCols * kCiChunk / VEC; v += 32) {
          const int col = v / (kCiChunk / VEC), q = v % (kCiChunk / VEC);
          if (ix0 + col < a.W && q * VEC < channels)
            *reinterpret_cast<uint4*>(gi + (ix0 + col) * a.os.x + c0 + q * VEC) =
                *reinterpret_cast<const uint4*>(out_row + col * OUT_LD + q * VEC);
        }
      } else {
        for (int v = lane; v < kMmaCols * kCiChunk; v += 32) {
          const int col = v / kCiChunk, c = v % kCiChunk;
          if (ix0 + col < a.W && c < channels) gi[(ix0 + col) * a.os.x + (c0 + c) * a.os.c] = out_row[col * OUT_LD + c];
        }
      }
    }
  }
}

}  // namespace

void k4s2p1_small_cout_grad_input(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4,
                                  const at::Tensor& weight, const at::Tensor& grad_input,
                                  std::optional<double> leaky_relu_slope) {
  c10::cuda::CUDAGuard device_guard(grad_output4.device());
  SmallArgs a = small_args(g, /*x=*/at::Tensor(), grad_output4, weight, grad_input);
  a.grad_input_slope = float(leaky_relu_slope.value_or(1.0));
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto dtype = grad_output4.scalar_type();
  // fp32 (TF32) takes the tensor-core kernel where grad_output's channels are innermost (one channel always is):
  // reading an NCHW one element by element (a pixel's channels in C_out planes), it measured 39.7 us against the
  // CUDA-core kernel's 18.6 (batch 64, 32 -> 3, H200).
  if (mma_applies(g, dtype, grad_input_mma_smem(dtype)) && (dtype != at::kFloat || a.gos.c == 1 || a.cout == 1)) {
    const int tiles_x = (a.W + kMmaCols - 1) / kMmaCols, tiles_y = (a.H + kMmaRows - 1) / kMmaRows;
    const int chunks = (a.cin + kCiChunk - 1) / kCiChunk;
    const int64_t vec = vec_of(grad_input);
    const bool vec_store = a.os.c == 1 && a.os.x % vec == 0 && a.os.y % vec == 0 && a.os.n % vec == 0 &&
                           reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
    const bool raw_rows = rows_are_byte_spans(grad_output4);
    dispatch_small(grad_output4.scalar_type(), a.cout, [&](auto tag, auto co) {
      using scalar_t = decltype(tag);
      constexpr int CO = decltype(co)::value;
      auto launch = [&](auto kernel) {
        constexpr int smem = GradInputTile<scalar_t>::kSmemBytes;
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        const int depth = persistent_image_blocks(kernel, smem, tiles_x * tiles_y * chunks, a.batch);
        kernel<<<dim3(tiles_x * tiles_y, chunks, depth), kThreads, smem, stream>>>(a, tiles_x, vec_store);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (raw_rows)
        launch(small_cout_grad_input_mma_kernel<scalar_t, CO, true>);
      else
        launch(small_cout_grad_input_mma_kernel<scalar_t, CO, false>);
    });
    return;
  }
  const int total = a.batch * a.H * a.W;
  const bool vec = a.os.c == 1 && a.cin % 8 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
  dispatch_small(grad_output4.scalar_type(), a.cout, [&](auto tag, auto co) {
    small_cout_grad_input_kernel<decltype(tag), decltype(co)::value>
        <<<(total + kThreads - 1) / kThreads, kThreads, 0, stream>>>(a, vec);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace hierpar::detail
