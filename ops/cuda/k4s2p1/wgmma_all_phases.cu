// wgmma_forward_all_phases_kernel of the k4s2p1 fast path (k4s2p1.cuh; sm_90a code: this file is also built for
// it, see CMakeLists.txt): the forward with C_out <= 32, C_in % 64 == 0, the 4 phases of 128 input pixels per CTA
// from 9 shifted input tiles; its weight pack kernel and its launcher.
#include "cuda/k4s2p1/k4s2p1.cuh"

namespace hierpar::detail::k4s2p1 {
namespace {

// ---- sm_90a: the forward for C_out <= 32, all four output phases per CTA ---------------------------------------
// Phase (py, px) and tap (ty, tx) read the input at the shift (dy, dx) = (py - ty, px - tx) from the row's pixel,
// so the 16 (phase, tap) products use only 9 shifted copies of the input. A CTA takes 128 input pixels, loops K
// over (shift, C_in) (a K-tile of 64 channels lies in one shift: C_in % 64 == 0) and multiplies each gathered
// tile by the weights of the phases that use that shift: all 4 phases for (0, 0), 2 for the edges, 1 for the
// corners. The accumulators are 4 blocks of 32 columns, one per phase in the order slot = 2 px + py, so the
// 2-phase edges with dy = 0 (slots 2px, 2px+1) and (0, 0) (all) are one wider wgmma each (n64, n128). Against
// one phase per CTA (wgmma_conv_kernel, grid z = 4): the input is gathered 9 times instead of 16, a CTA writes
// 4x the output per setup and pipeline fill, and fewer, wider MMAs read A from shared memory.
// B (prepacked): [9 shifts][4 slots][32 co][C_in], zero where a phase does not use the shift or co >= C_out.
struct AllPhasesTile {
  static constexpr int BM = 128, BK = 64;
  static_assert(BK * 2 == 128, "a K-tile row is one 128-byte swizzle row");
  static constexpr int A_BYTES = BM * 128, B_BYTES = 128 * 128, STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int SLOT_LD = 40, ROW_LD = 4 * SLOT_LD + 8;  // staged output (elements): conflict-free stores
  static constexpr int SMEM_BYTES = kStages * STAGE_BYTES + 1024;
  static_assert(BM * ROW_LD * 2 + BM * 8 <= kStages * STAGE_BYTES, "epilogue staging reuses the stages");
};

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads, 2) wgmma_forward_all_phases_kernel(const GemmArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = AllPhasesTile;
  constexpr int BM = T::BM, BK = T::BK, VEC = 8;
  constexpr bool kF16 = std::is_same_v<scalar_t, c10::Half>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t sbase = smem_addr(smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int m0 = blockIdx.x * BM;
  const int ktiles = (a.K + BK - 1) / BK;  // 9 * C_in / 64
  const uint16_t* act = static_cast<const uint16_t*>(a.act);
  const uint16_t* bmat = static_cast<const uint16_t*>(a.b);
  const int rows_hw = a.rows_H * a.rows_W;
  const int sH = int(a.act_sH), sW = int(a.act_sW);

  constexpr int A_ITERS = BM / 32;
  const int a_c = tid & 7, a_r = tid >> 3;
  const uint32_t a_dst = a_r * 128 + ((a_c ^ (a_r & 7)) << 4);
  int row_off[A_ITERS];
  uint32_t row_shifts[A_ITERS];  // bit 3 (dy + 1) + (dx + 1): the shifted pixel is inside the input
#pragma unroll
  for (int i = 0; i < A_ITERS; ++i) {
    const int m = m0 + a_r + 32 * i;
    row_off[i] = 0;
    row_shifts[i] = 0;
    if (m < a.M) {
      const int n = m / rows_hw, rem = m - n * rows_hw, qy = rem / a.rows_W, qx = rem - qy * a.rows_W;
      row_off[i] = n * int(a.act_sN) + qy * sH + qx * sW;
#pragma unroll
      for (int s = 0; s < 9; ++s) {
        const int y = qy + s / 3 - 1, x = qx + s % 3 - 1;
        if (y >= 0 && y < a.act_H && x >= 0 && x < a.act_W) row_shifts[i] |= 1u << s;
      }
    }
  }
  // K-tile kt: shift kt / (C_in / 64), channels from (kt % (C_in / 64)) * 64; stepped, no division.
  int ld_shift = 0, ld_chan = 0;
  auto load = [&](int st) {
    const int dy = ld_shift / 3 - 1, dx = ld_shift % 3 - 1;
    unsigned char* dst = smem + st * T::STAGE_BYTES + a_dst;
    const int off = dy * sH + dx * sW + ld_chan + a_c * VEC;
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) {
      const bool ok = (row_shifts[i] >> ld_shift) & 1u;
      cp_async16(dst + i * 32 * 128, ok ? act + (row_off[i] + off) : act, ok);
    }
    // B rows (slot j, co a_r): only the slots whose phase uses this shift (the others are never read).
    const uint16_t* src = bmat + (int64_t(ld_shift) * 128 + a_r) * a.act_C + ld_chan + a_c * VEC;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int py = j & 1, px = j >> 1;
      if (py - dy >= 0 && py - dy <= 1 && px - dx >= 0 && px - dx <= 1)
        cp_async16(dst + T::A_BYTES + j * 32 * 128, src + int64_t(j) * 32 * a.act_C, true);
    }
    ld_chan += BK;
    if (ld_chan == a.act_C) {
      ld_chan = 0;
      ++ld_shift;
    }
  };

  float acc[4][16];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 16; ++e) acc[j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load(s);
    cp_async_commit();
  }
  const int tiles_per_shift = a.act_C / BK;
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<kStages - 2>();
    mma::fence_proxy_async_shared();
    __syncthreads();
    const int st = kt % kStages, shift = kt / tiles_per_shift;
    const uint32_t a_tile = sbase + st * T::STAGE_BYTES + wg * 64 * 128;
    const uint32_t b_tile = sbase + st * T::STAGE_BYTES + T::A_BYTES;
    mma::wgmma_fence();
    // One unrolled K loop per shift (the accumulator blocks each shift updates are fixed per loop).
    auto k_loop = [&](auto&& mma_step) {
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) mma_step(mma::wgmma_desc_k_sw128(a_tile + kk * 32), b_tile + kk * 32);
    };
    auto db = [](uint32_t b, int slot) { return mma::wgmma_desc_k_sw128(b + slot * 32 * 128); };
    switch (shift) {  // (dy, dx) = (shift / 3 - 1, shift % 3 - 1); slot = 2 px + py
      case 0:  // (-1, -1): phase (0, 0)
        k_loop([&](uint64_t da, uint32_t b) { mma::wgmma_m64n32k16_blocks<kF16>(acc[0], da, db(b, 0)); });
        break;
      case 1:  // (-1, 0): phases (0, 0), (0, 1)
        k_loop([&](uint64_t da, uint32_t b) {
          mma::wgmma_m64n32k16_blocks<kF16>(acc[0], da, db(b, 0));
          mma::wgmma_m64n32k16_blocks<kF16>(acc[2], da, db(b, 2));
        });
        break;
      case 2:  // (-1, 1): (0, 1)
        k_loop([&](uint64_t da, uint32_t b) { mma::wgmma_m64n32k16_blocks<kF16>(acc[2], da, db(b, 2)); });
        break;
      case 3:  // (0, -1): (0, 0), (1, 0) = slots 0, 1
        k_loop([&](uint64_t da, uint32_t b) { mma::wgmma_m64n64k16_blocks<kF16>(acc[0], acc[1], da, db(b, 0)); });
        break;
      case 4:  // (0, 0): all four
        k_loop([&](uint64_t da, uint32_t b) {
          mma::wgmma_m64n128k16_blocks<kF16>(acc[0], acc[1], acc[2], acc[3], da, db(b, 0));
        });
        break;
      case 5:  // (0, 1): (0, 1), (1, 1) = slots 2, 3
        k_loop([&](uint64_t da, uint32_t b) { mma::wgmma_m64n64k16_blocks<kF16>(acc[2], acc[3], da, db(b, 2)); });
        break;
      case 6:  // (1, -1): (1, 0)
        k_loop([&](uint64_t da, uint32_t b) { mma::wgmma_m64n32k16_blocks<kF16>(acc[1], da, db(b, 1)); });
        break;
      case 7:  // (1, 0): (1, 0), (1, 1)
        k_loop([&](uint64_t da, uint32_t b) {
          mma::wgmma_m64n32k16_blocks<kF16>(acc[1], da, db(b, 1));
          mma::wgmma_m64n32k16_blocks<kF16>(acc[3], da, db(b, 3));
        });
        break;
      default:  // (1, 1): (1, 1)
        k_loop([&](uint64_t da, uint32_t b) { mma::wgmma_m64n32k16_blocks<kF16>(acc[3], da, db(b, 3)); });
        break;
    }
    mma::wgmma_commit();
    if (kt + kStages - 1 < ktiles) load((kt + kStages - 1) % kStages);
    cp_async_commit();
    mma::wgmma_wait<0>();
  }
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue: [BM][slot][co] in shared memory, then per (row, phase) up to 4 16-byte stores of 8 channels.
  scalar_t* tile = reinterpret_cast<scalar_t*>(smem);
  int64_t* row_base = reinterpret_cast<int64_t*>(smem + BM * T::ROW_LD * 2);
  if (tid < BM) {
    const int m = m0 + tid;
    int64_t rbase = -1;
    if (m < a.M) {
      const int n = m / rows_hw, rem = m - n * rows_hw, qy = rem / a.rows_W, qx = rem - qy * a.rows_W;
      rbase = n * a.c_sN + int64_t(2 * qy) * a.c_sH + int64_t(2 * qx) * a.c_sW;
    }
    row_base[tid] = rbase;
  }
  {
    const int g = lane >> 2, t4 = lane & 3, r = wg * 64 + (warp & 3) * 16 + g;
#pragma unroll
    for (int slot = 0; slot < 4; ++slot)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float* d = acc[slot] + 4 * j;
        alignas(4) scalar_t lo[2] = {static_cast<scalar_t>(d[0]), static_cast<scalar_t>(d[1])};
        alignas(4) scalar_t hi[2] = {static_cast<scalar_t>(d[2]), static_cast<scalar_t>(d[3])};
        const int col = slot * T::SLOT_LD + 8 * j + 2 * t4;
        *reinterpret_cast<uint32_t*>(tile + r * T::ROW_LD + col) = *reinterpret_cast<const uint32_t*>(lo);
        *reinterpret_cast<uint32_t*>(tile + (r + 8) * T::ROW_LD + col) = *reinterpret_cast<const uint32_t*>(hi);
      }
  }
  __syncthreads();
  scalar_t* c_out = static_cast<scalar_t*>(a.c);
#pragma unroll
  for (int v = tid; v < BM * 16; v += kThreads) {
    const int r = v >> 4, slot = (v >> 2) & 3, cv = v & 3, co = cv * 8;
    const int64_t rbase = row_base[r];
    if (rbase >= 0 && co < a.N)
      *reinterpret_cast<uint4*>(c_out + rbase + (slot & 1) * a.c_sH + (slot >> 1) * a.c_sW + co) =
          *reinterpret_cast<const uint4*>(tile + r * T::ROW_LD + slot * T::SLOT_LD + co);
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// B of wgmma_forward_all_phases_kernel: packed[shift][slot][co < 32][ci] = w[ci, co, 1 + py - 2dy, 1 + px - 2dx]
// (tap ty = py - dy, ky = 1 - py + 2 ty), zero where the tap is outside {0, 1} or co >= C_out.
template <typename scalar_t>
__global__ void pack_all_phases_weight_kernel(const scalar_t* __restrict__ w, int64_t s0, int64_t s1, int64_t s2,
                                              int64_t s3, int cin, int cout, scalar_t* __restrict__ packed) {
  const int total = 9 * 4 * 32 * cin;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
    const int ci = i % cin, r = i / cin, co = r % 32, slot = (r / 32) % 4, shift = r / 128;
    const int dy = shift / 3 - 1, dx = shift % 3 - 1, py = slot & 1, px = slot >> 1;
    const int ty = py - dy, tx = px - dx;
    const bool used = co < cout && ty >= 0 && ty <= 1 && tx >= 0 && tx <= 1;
    packed[i] = used ? w[ci * s0 + co * s1 + (1 - py + 2 * ty) * s2 + (1 - px + 2 * tx) * s3] : scalar_t(0);
  }
}

}  // namespace

template <typename scalar_t>
void launch_wgmma_all_phases(const ConvTranspose2dGeometry& g, const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& out) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    TORCH_INTERNAL_ASSERT(false, "conv_transpose2d: the wgmma kernel has no fp32 variant");
  } else {
    auto stream = at::cuda::getCurrentCUDAStream();
    const int cin = int(g.in_channels), cout = int(g.out_channels);
    at::Tensor packed = at::empty({9, 4, 32, cin}, weight.options());
    const int total = 9 * 4 * 32 * cin;
    pack_all_phases_weight_kernel<scalar_t><<<std::min((total + 255) / 256, 1024), 256, 0, stream>>>(
        weight.const_data_ptr<scalar_t>(), weight.stride(0), weight.stride(1), weight.stride(2), weight.stride(3),
        cin, cout, packed.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    GemmArgs a = input_pixel_gemm<scalar_t>(g, x);
    a.M = int(g.in_pixels());
    a.N = cout;
    a.K = 9 * cin;
    a.b = packed.const_data_ptr<scalar_t>();
    a.splits = 1;
    set_output<scalar_t>(a, out.data_ptr(), dense_strides(cout, g.out_h, g.out_w, true), false);
    constexpr int smem = AllPhasesTile::SMEM_BYTES;
    C10_CUDA_CHECK(cudaFuncSetAttribute(wgmma_forward_all_phases_kernel<scalar_t>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    wgmma_forward_all_phases_kernel<scalar_t><<<(a.M + 127) / 128, kThreads, smem, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template void launch_wgmma_all_phases<float>(const ConvTranspose2dGeometry&, const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&);
template void launch_wgmma_all_phases<at::BFloat16>(const ConvTranspose2dGeometry&, const at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&);
template void launch_wgmma_all_phases<at::Half>(const ConvTranspose2dGeometry&, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&);

}  // namespace hierpar::detail::k4s2p1
