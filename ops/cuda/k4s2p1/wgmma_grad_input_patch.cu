// wgmma_grad_input_patch_kernel of the k4s2p1 fast path (k4s2p1.cuh; sm_90a code: this file is also built for
// it, see CMakeLists.txt): grad_input with C_out == 32, C_in % 64 == 0, every K-tile read from one staged
// grad_output patch per 8 x 16 input pixels; and its launcher.
#include "cuda/k4s2p1/k4s2p1.cuh"
#include "cuda/permute_copy.h"

namespace hierpar::detail::k4s2p1 {
namespace {

// ---- sm_90a: grad_input for C_out == 32 from a staged grad_output patch ----------------------------------------
// grad_input[n, iy, ix, ci] = sum over ky, kx, co of go[n, 2iy - 1 + ky, 2ix - 1 + kx, co] * w[ci, co, ky, kx].
// With C_out = 32, two horizontally adjacent grad_output pixels are 128 bytes, one 64-element K-row: K-tile
// (ky, kx / 2) of input pixel (iy, ix) is the pixel pair starting at column 2ix - 1 + 2 (kx / 2) of grad_output
// row 2iy - 1 + ky (K order (ky, kx, co), as the [C_in][ky, kx, co] weight). A tile of 8 x 16 input pixels reads
// the 18 x 34 grad_output pixels starting at (2 iy0 - 1, 2 ix0 - 1): they are copied into shared memory once per
// tile (zero outside the image), and wgmma reads every K-tile straight out of that patch instead of a gathered
// copy per K-tile (wgmma_conv_kernel gathers each grad_output pixel 4 times, 1 KB per input pixel, plus the
// whole weight slice per CTA). The GEMM is computed transposed, grad_input^T[ci][pixel] = W[ci][K] x patch^T,
// so that the wgmma is m64 (the 64 input channels) x n128 (the tile's pixels): an n64 shape (pixels as M)
// measured ~250 TFLOP/s at best here, operand traffic from shared memory being twice that of n128 per MMA.
// The patch is in wgmma's no-swizzle K-major layout (core matrix = 8 rows x 16 bytes, contiguous): 16 planes
// (row parity p, 16-byte chunk c of the 128-byte pair) of [pair column u][row / 2] 16-byte slots, pair u =
// grad_output columns 2 ix0 - 1 + 2u, +1. The 8 input rows of one input column at one (ky, kx / 2) are then 8
// consecutive slots (one core matrix of B; pixel n = 8 ix + iy), the next input column is the next pair column
// (the descriptor's stride offset: 9 slots), the next 8 K-elements the next chunk plane (its leading offset).
// Plane size 17 x 9 x 16 = 2448 bytes = 16 mod 128 (like the 144-byte column pitch): a warp's copies spread over
// all banks. The weight slice of the CTA's 64 input channels, [ci][K = 512] as [K / 8][ci] core matrices
// (64 KB), stays in shared memory for the CTA's lifetime (persistent CTAs, one per SM). The CTA's three
// warpgroups work independently (named barriers), each on its own tiles with its own patch buffer: while one
// copies its next patch or stores its output, the others keep the tensor cores busy.
struct GradInputPatchTile {
  static constexpr int TH = 8, TW = 16;                   // input pixels per tile (rows x columns)
  static constexpr int PR = 2 * TH + 2, PC = 2 * TW + 2;  // grad_output rows / columns of the patch
  static constexpr int R = PR / 2, U = PC / 2;            // slot rows per parity, pair columns
  static constexpr int PLANE = R * U * 16;                // bytes of one (parity, chunk) plane
  static constexpr int PATCH_BYTES = 2 * 8 * PLANE;
  static constexpr int BM = 64, K = 512;                  // input channels per CTA, 16 taps x 32
  static constexpr int W_BYTES = BM * K * 2;
  static constexpr int WARPGROUPS = 3, THREADS = 128 * WARPGROUPS;
  static constexpr int OUT_LD = BM + 8;  // staged output row [pixel][ci] (elements): 16-byte rows, no conflicts
  static constexpr int SMEM_BYTES = W_BYTES + WARPGROUPS * PATCH_BYTES + 128;  // + slack to align to 128 bytes
  static_assert(PLANE % 128 == 16 && (R * 16) % 128 == 16, "planes and pair columns on successive bank groups");
  static_assert(PATCH_BYTES % 128 == 0 && TH * TW * OUT_LD * 2 <= PATCH_BYTES, "output staged in the patch");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Descriptor of a K-major operand without swizzle: core matrices of 8 rows x 16 bytes stored contiguously, the
// next 8 K-elements `k_bytes` further (leading-byte offset), the next 8 rows `mn_bytes` further (stride offset).
__device__ inline uint64_t wgmma_desc_k_interleave(uint32_t smem_byte_addr, uint32_t k_bytes, uint32_t mn_bytes) {
  return uint64_t((smem_byte_addr & 0x3FFFF) >> 4) | (uint64_t(k_bytes >> 4) << 16) | (uint64_t(mn_bytes >> 4) << 32);
}
// Barrier of the 128 threads of one warpgroup (ids 1.., 0 being __syncthreads').
__device__ inline void warpgroup_barrier(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }
#endif

template <typename scalar_t>
__global__ void __launch_bounds__(GradInputPatchTile::THREADS, 1)
    wgmma_grad_input_patch_kernel(const GemmArgs a, int tiles_y, int tiles_x, int tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = GradInputPatchTile;
  constexpr bool kF16 = std::is_same_v<scalar_t, c10::Half>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((128 - (smem_addr(smem_raw) & 127)) & 127);
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, lane = tid & 31, warp4 = (tid >> 5) & 3;
  unsigned char* patch = smem + T::W_BYTES + wg * T::PATCH_BYTES;
  const uint32_t w_base = smem_addr(smem), p_base = smem_addr(patch);
  const int n0 = blockIdx.y * T::BM;
  const uint16_t* go = static_cast<const uint16_t*>(a.act);
  const int sH = int(a.act_sH);

  // The weight slice, once: 16-byte chunk kc (8 K-elements) of input channel ci to kc * 1024 + ci * 16. A warp
  // copies 16 channels x 2 chunks: whole 32-byte sectors from global, 4 conflict-free wavefronts into shared.
  {
    const uint16_t* wsrc = static_cast<const uint16_t*>(a.b) + int64_t(n0) * T::K;
    for (int q = tid; q < T::BM * T::K / 8; q += T::THREADS) {
      const int ci = (q >> 1) & 63, kc = ((q >> 7) << 1) | (q & 1);
      cp_async16(smem + kc * 1024 + ci * 16, wsrc + ci * T::K + kc * 8, true);
    }
    cp_async_commit();
    cp_async_wait<0>();
    mma::fence_proxy_async_shared();
    __syncthreads();
  }

  scalar_t* c_out = static_cast<scalar_t*>(a.c);
  const scalar_t* stage = reinterpret_cast<const scalar_t*>(patch);
  for (int tile = blockIdx.x * T::WARPGROUPS + wg; tile < tiles; tile += gridDim.x * T::WARPGROUPS) {
    const int tx = tile % tiles_x, rest = tile / tiles_x, ty = rest % tiles_y, n = rest / tiles_y;
    {  // the patch, by this warpgroup: consecutive threads copy consecutive 16 bytes of a grad_output row
      const int oy0 = 2 * T::TH * ty - 1, ox0 = 2 * T::TW * tx - 1;
      const uint16_t* src = go + n * int(a.act_sN);
      for (int q = wtid; q < T::PR * T::PC * 4; q += 128) {  // 16-byte copies: 4 per 32-channel pixel
        const int pr = q / (T::PC * 4), rem = q - pr * (T::PC * 4), pc = rem >> 2, c4 = rem & 3;
        const int oy = oy0 + pr, ox = ox0 + pc;
        const bool ok = oy >= 0 && oy < a.act_H && ox >= 0 && ox < a.act_W;
        const int plane = (pr & 1) * 8 + ((pc & 1) << 2) + c4;
        cp_async16(patch + plane * T::PLANE + (pc >> 1) * (T::R * 16) + (pr >> 1) * 16,
                   ok ? src + oy * sH + ox * 32 + c4 * 8 : go, ok);
      }
      cp_async_commit();
      cp_async_wait<0>();
      mma::fence_proxy_async_shared();
      warpgroup_barrier(1 + wg);
    }

    // acc = W[64 ci][512] x patch^T[512][128 pixels]: 8 K-tiles (ky, kx / 2) x 4 wgmma (K = 16) each.
    float acc[64];
#pragma unroll
    for (int e = 0; e < 64; ++e) acc[e] = 0.f;
    mma::wgmma_fence();
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      const int ky = kt >> 1, kxp = kt & 1;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {  // chunks 2 kk, 2 kk + 1 of the pair
        const uint32_t w_addr = w_base + (kt * 8 + 2 * kk) * 1024;
        const uint32_t p_addr =
            p_base + ((ky & 1) * 8 + 2 * kk) * T::PLANE + kxp * (T::R * 16) + (ky >> 1) * 16;
        mma::wgmma_m64n128k16<kF16>(acc, wgmma_desc_k_interleave(w_addr, 1024, 128),
                                    wgmma_desc_k_interleave(p_addr, T::PLANE, T::R * 16));
      }
    }
    mma::wgmma_commit();
    mma::wgmma_wait<0>();
    warpgroup_barrier(1 + wg);  // the warpgroup is done reading the patch: stage the output in it

    // Accumulator row 16 warp4 + g (+ 8) = channel, column 8 j + 2 t4 (+ 1) = pixel (iy 2 t4 (+ 1), ix j).
    {
      scalar_t* st = reinterpret_cast<scalar_t*>(patch);
      const int g = lane >> 2, t4 = lane & 3, ci = 16 * warp4 + g;
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pix = 8 * j + 2 * t4 + (e & 1);
          st[pix * T::OUT_LD + ci + 8 * (e >> 1)] = static_cast<scalar_t>(acc[4 * j + e]);
        }
    }
    warpgroup_barrier(1 + wg);
    // 128 pixels x 8 16-byte vectors of channels: 8 per thread, a pixel's 128 bytes by 8 consecutive threads.
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int v = wtid + 128 * i, pix = v >> 3, cv = v & 7;
      const int iy = T::TH * ty + (pix & 7), ix = T::TW * tx + (pix >> 3);
      if (iy < a.rows_H && ix < a.rows_W)
        *reinterpret_cast<uint4*>(c_out + n * a.c_sN + iy * a.c_sH + ix * a.c_sW + n0 + cv * 8) =
            *reinterpret_cast<const uint4*>(stage + pix * T::OUT_LD + cv * 8);
    }
    warpgroup_barrier(1 + wg);  // the staged output is read: the next patch may overwrite it
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace

template <typename scalar_t>
void launch_wgmma_grad_input_patch(const ConvTranspose2dGeometry& g, const at::Tensor& go, const at::Tensor& weight,
                                   const at::Tensor& grad_input) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    TORCH_INTERNAL_ASSERT(false, "conv_transpose2d: the wgmma kernel has no fp32 variant");
  } else {
    using T = GradInputPatchTile;
    const int cin = int(g.in_channels);
    // [C_in][ky, kx, co]: K-major rows of 16 * 32 = 512 elements.
    const at::Tensor wt = contiguous_as(weight.permute({0, 2, 3, 1}), at::MemoryFormat::Contiguous);
    GemmArgs a = input_pixel_gemm<scalar_t>(g, go);
    a.b = wt.const_data_ptr<scalar_t>();
    a.N = cin;
    a.splits = 1;
    set_output<scalar_t>(a, grad_input.mutable_data_ptr<scalar_t>(), dense_strides(cin, g.in_h, g.in_w, true), false);
    const int tiles_y = int((g.in_h + T::TH - 1) / T::TH), tiles_x = int((g.in_w + T::TW - 1) / T::TW);
    const int tiles = int(g.batch) * tiles_y * tiles_x;
    const int blocks_n = cin / T::BM;
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const dim3 grid(std::max(1, std::min((tiles + T::WARPGROUPS - 1) / T::WARPGROUPS, sms / blocks_n)), blocks_n);
    constexpr int smem = T::SMEM_BYTES;
    C10_CUDA_CHECK(cudaFuncSetAttribute(wgmma_grad_input_patch_kernel<scalar_t>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    wgmma_grad_input_patch_kernel<scalar_t>
        <<<grid, T::THREADS, smem, at::cuda::getCurrentCUDAStream()>>>(a, tiles_y, tiles_x, tiles);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template void launch_wgmma_grad_input_patch<float>(const ConvTranspose2dGeometry&, const at::Tensor&,
                                                   const at::Tensor&, const at::Tensor&);
template void launch_wgmma_grad_input_patch<at::BFloat16>(const ConvTranspose2dGeometry&, const at::Tensor&,
                                                          const at::Tensor&, const at::Tensor&);
template void launch_wgmma_grad_input_patch<at::Half>(const ConvTranspose2dGeometry&, const at::Tensor&,
                                                      const at::Tensor&, const at::Tensor&);

}  // namespace hierpar::detail::k4s2p1
