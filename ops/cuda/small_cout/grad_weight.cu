// The small-C_out grad_weight (small_cout.cuh): tensor-core partial sums per block, added in a fixed order by a
// second kernel; its predicate (other calls take the general path) and entry point.
#include "cuda/small_cout/small_cout.cuh"

namespace hierpar::detail {
namespace {

template <typename scalar_t, int CO, bool kRawRows>
__global__ void __launch_bounds__(kThreads, 2) small_cout_grad_weight_mma_kernel(const SmallArgs a, int tiles_x,
                                                                                 int tiles, float* partial) {
  using T = WgradTile<scalar_t>;
  using F = Tc<scalar_t>;
  using E = typename F::E;
  constexpr int NT = kWgradTiles<CO>, LD = T::kXLd, VEC = F::kVec;
  extern __shared__ __align__(16) uint16_t smem16[];
  E* const smem = reinterpret_cast<E*>(smem16);
  auto xs = [&](int buf) { return smem + buf * T::kStageElems; };  // [position][ci of the chunk]
  auto gs = [&](int buf) { return smem + buf * T::kStageElems + kMmaRows * kMmaCols * LD; };
  auto raw = [&](int buf) { return reinterpret_cast<char*>(smem16) + T::kSmemBytes + buf * kRawBytes<sizeof(E)>; };
  const E* x = static_cast<const E*>(a.x);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  const int c0 = blockIdx.y * kCiChunk;
  const int tiles_per_image = tiles_x * ((a.H + kMmaRows - 1) / kMmaRows);
  auto tile_origin = [&](int tile, int& n, int& iy0, int& ix0) {
    n = tile / tiles_per_image;
    const int t = tile - n * tiles_per_image;
    ix0 = (t % tiles_x) * kMmaCols;
    iy0 = (t / tiles_x) * kMmaRows;
  };
  // The input tile by 16-byte asynchronous copies, the grad_output tile as raw rows (kRawRows) or into registers:
  // both in flight while the previous tile is multiplied.
  E gv[kRawRows ? 1 : kGoLoads];
  auto issue_loads = [&](int tile, int buf) {
    int n, iy0, ix0;
    tile_origin(tile, n, iy0, ix0);
    for (int v = threadIdx.x; v < kMmaRows * kMmaCols * (kCiChunk / VEC); v += kThreads) {
      const int p = v / (kCiChunk / VEC), cv = v % (kCiChunk / VEC), y = iy0 + p / kMmaCols, xx = ix0 + p % kMmaCols;
      const int c = c0 + cv * VEC;
      const bool in = y < a.H && xx < a.W && c < a.cin;
      cp_async16(xs(buf) + p * LD + cv * VEC, in ? x + n * a.xs.n + y * a.xs.y + xx * a.xs.x + c : x, in);
    }
    if constexpr (kRawRows) {
      issue_raw_rows<CO, E>(a, n, iy0, ix0, raw(buf));
      mma::cp_async_commit();
    } else {
      mma::cp_async_commit();
      load_grad_output<CO>(a, n, iy0, ix0, reinterpret_cast<E(&)[kGoLoads]>(gv));
    }
  };
  // After the tile's copies have landed and a barrier: its grad_output tile in gs(buf).
  auto finish_grad_output = [&](int tile, int buf) {
    if constexpr (kRawRows) {
      int n, iy0, ix0;
      tile_origin(tile, n, iy0, ix0);
      spread_raw_rows<CO>(a, iy0, ix0, raw(buf), gs(buf));
    } else {
      store_grad_output(gs(buf), reinterpret_cast<const E(&)[kGoLoads]>(gv));
    }
  };

  float acc[2][NT][4] = {};  // [ci tile][(tap, co) tile][fragment]
  int tile = blockIdx.x, buf = 0;
  if (tile < tiles) issue_loads(tile, 0);
  mma::cp_async_wait<0>();
  __syncthreads();
  if (tile < tiles) finish_grad_output(tile, 0);
  __syncthreads();
  for (; tile < tiles; tile += gridDim.x, buf ^= 1) {
    const int next = tile + gridDim.x;
    if (next < tiles) issue_loads(next, buf ^ 1);  // buffer buf ^ 1 was last read before the previous barrier
    const E* xb = xs(buf);
    const E* gb = gs(buf);
#pragma unroll
    for (int ks = 0; ks < kMmaCols / F::kK; ++ks) {
      const int pos0 = warp * kMmaCols + ks * F::kK;  // the K step's positions: row `warp`, kK columns
      uint32_t af[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        if constexpr (F::kTf32) {  // (ci g (+8), position t4 (+4))
          const E* p = xb + (pos0 + t4) * LD + mt * 16 + g;
          af[mt][0] = F::word(p);
          af[mt][1] = F::word(p + 8);
          af[mt][2] = F::word(p + 4 * LD);
          af[mt][3] = F::word(p + 4 * LD + 8);
        } else {
          const int q = lane >> 3, k = (q >> 1) * 8 + (lane & 7), moff = (q & 1) * 8;
          ldmatrix_x4_trans(af[mt], smem_addr(xb + (pos0 + k) * LD + mt * 16 + moff));
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        // Column g of N tile nt is (tap, co) = ((8 nt + g) / C_out, (8 nt + g) % C_out), tap = 4 ky + kx.
        const int nn = nt * 8 + g, tap = nn / CO, co = nn - tap * CO;
        uint32_t bf[2] = {0, 0};
        if (nn < 16 * CO) {
          // Position col of the K step reads grad_output column 2 col + kx of the tile (4 channels a pixel).
          const E* row = gb + ((2 * warp + (tap >> 2)) * kGoCols + 2 * ks * F::kK + (tap & 3)) * 4 + co;
          auto tap_word = [&](int col) -> uint32_t {
            if constexpr (F::kTf32)
              return F::word(row + 8 * col);
            else
              return uint32_t(row[8 * col]) | uint32_t(row[8 * col + 8]) << 16;
          };
          bf[0] = tap_word(F::kPack * t4);
          bf[1] = tap_word(F::kPack * t4 + F::kK / 2);
        }
        mma::mma<scalar_t>(acc[0][nt], af[0], bf);
        mma::mma<scalar_t>(acc[1][nt], af[1], bf);
      }
    }
    mma::cp_async_wait<0>();
    if constexpr (kRawRows) __syncthreads();  // every thread's raw rows of the next tile have landed
    if (next < tiles) finish_grad_output(next, buf ^ 1);
    __syncthreads();
  }
  // The 8 warps' sums, added in warp order (in the now idle stage memory), then this block's partial sum
  // [ci][(tap, co)].
  constexpr int kWidth = 8 * NT;
  float* sums = reinterpret_cast<float*>(smem16);
  static_assert(kCiChunk * kWidth * 4 <= T::kSmemBytes, "the warp sums fit in the stage memory");
  for (int wi = 0; wi < 8; ++wi) {
    if (warp == wi) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = (mt * 16 + g + 8 * (e >> 1)) * kWidth + nt * 8 + 2 * t4 + (e & 1);
            sums[i] = wi == 0 ? acc[mt][nt][e] : sums[i] + acc[mt][nt][e];
          }
    }
    __syncthreads();
  }
  float* dst = partial + (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * (kCiChunk * 16 * CO);
  for (int i = threadIdx.x; i < kCiChunk * 16 * CO; i += kThreads) dst[i] = sums[(i / (16 * CO)) * kWidth + i % (16 * CO)];
}

// grad_weight[ci, co, ky, kx] = the blocks' partial sums ([ci][(tap, co)] per block). A warp per output: lane l adds
// blocks l, l + 32, ... in order, then the lanes' sums are added by a fixed butterfly, so the result does not depend
// on timing. (A thread per output adding all blocks in turn took ~14 us at batch 1024: a few hundred dependent adds
// on 6 SMs.)
template <typename scalar_t>
__global__ void small_cout_grad_weight_finish_kernel(const float* partial, int blocks, int cin, int cout,
                                                     Strides4d gws, scalar_t* gw) {
  const int i = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x & 31;
  if (i >= cin * cout * 16) return;  // whole warps: i is the same for the 32 lanes
  const int ci = i / (cout * 16), r = i - ci * cout * 16, co = r / 16, tap = r % 16;
  const int width = 16 * cout;
  const float* p = partial + (int64_t(ci / kCiChunk) * blocks * kCiChunk + ci % kCiChunk) * width + tap * cout + co;
  float s = 0.f;
  for (int b = lane; b < blocks; b += 32) s += p[int64_t(b) * kCiChunk * width];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
  if (lane == 0) gw[ci * gws.n + co * gws.c + (tap >> 2) * gws.y + (tap & 3) * gws.x] = static_cast<scalar_t>(s);
}


}  // namespace

bool k4s2p1_small_cout_grad_weight_applies(const ConvTranspose2dGeometry& g, const at::Tensor& input4) {
  return k4s2p1_small_cout_applies(g, input4.scalar_type()) &&
         mma_applies(g, input4.scalar_type(), grad_weight_mma_smem(input4.scalar_type())) &&
         reads_by_vectors(input4);
}

void k4s2p1_small_cout_grad_weight(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4,
                                   const at::Tensor& input4, const at::Tensor& grad_weight) {
  c10::cuda::CUDAGuard device_guard(grad_output4.device());
  SmallArgs a = small_args(g, input4, grad_output4, /*weight=*/at::Tensor(), /*out=*/at::Tensor());
  const int tiles_x = (a.W + kMmaCols - 1) / kMmaCols, tiles_y = (a.H + kMmaRows - 1) / kMmaRows;
  const int tiles = a.batch * tiles_x * tiles_y, chunks = (a.cin + kCiChunk - 1) / kCiChunk;
  auto stream = at::cuda::getCurrentCUDAStream();
  const Strides4d gws = strides_of(grad_weight);
  const int outputs = a.cin * a.cout * 16;
  dispatch_small(grad_output4.scalar_type(), a.cout, [&](auto tag, auto co) {
    using scalar_t = decltype(tag);
    constexpr int CO = decltype(co)::value;
    // As many blocks as fit on the GPU at once, each summing many tiles: the partial sums stay small
    // (blocks x C_in x 16 C_out floats) and no block waits for a second wave.
    auto launch = [&](auto kernel, int smem) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      int per_sm = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
      const int resident = std::max(1, per_sm) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
      const int blocks = std::min(tiles, std::max(1, resident / chunks));
      at::Tensor partial =
          at::empty({int64_t(chunks) * blocks * kCiChunk * 16 * CO}, grad_output4.options().dtype(at::kFloat));
      kernel<<<dim3(blocks, chunks), kThreads, smem, stream>>>(a, tiles_x, tiles, partial.mutable_data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return std::make_pair(partial, blocks);
    };
    const auto [partial, blocks] =
        rows_are_byte_spans(grad_output4)
            ? launch(small_cout_grad_weight_mma_kernel<scalar_t, CO, true>, WgradTile<scalar_t>::kRawSmemBytes)
            : launch(small_cout_grad_weight_mma_kernel<scalar_t, CO, false>, WgradTile<scalar_t>::kSmemBytes);
    small_cout_grad_weight_finish_kernel<scalar_t><<<(outputs * 32 + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
        partial.template const_data_ptr<float>(), blocks, a.cin, a.cout, gws, grad_weight.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace hierpar::detail
