// The wgmma tile kernels of the k4s2p1 fast path (k4s2p1.cuh; sm_90a code: this file is also built for it, see
// CMakeLists.txt): wgmma_conv_kernel (forward per phase and grad_input; no K split, channels_last output) and
// wgmma_wgrad_kernel (grad_weight, M-/N-major operands, split-K), for bf16/fp16 GEMMs whose operands allow
// 16-byte copies, with both operands read by the tensor cores from 128-byte-swizzled shared memory (no ldmatrix).
// wgmma_conv_kernel and wgmma_wgrad_kernel load their tiles with TMA (tensor-map boxes, an mbarrier per stage,
// zeros outside the image) where the channel counts are multiples of 64 and a tile's pixels are whole images or
// whole pixel rows of one image, else with per-thread cp.async gathers (bf16 batch 1024 channels_last, forward +
// backward in a CUDA graph on an H200: 256->128 95.2 us with TMA against 123.3 with cp.async, 128->64 116.8
// against 154.3; docs/conv_transpose.md).
#include "cuda/k4s2p1/k4s2p1.cuh"

#include <cuda.h>  // CUtensorMap and its enums only: the encoder comes from cudaGetDriverEntryPointByVersion
#include <cudaTypedefs.h>

namespace hierpar::detail::k4s2p1 {
namespace {

// ---- sm_90a: the convolution GEMMs (forward, grad_input) on wgmma ---------------------------------------------
// Same GEMMs and gather as implicit_gemm_kernel<scalar_t, BN, false, true>, for bf16 / fp16 with 16-byte
// copies, no K split and a channels-innermost output whose channel count allows 16-byte stores. The operands go
// into 128-byte-swizzled tiles that the tensor cores read straight from shared memory: two warpgroups, each
// m64 x BN, issue 4 wgmma (K = 16) per K-tile and no ldmatrix (Nsight Compute on the mma.sync kernel: 4-6 issued
// instructions per MMA and <= 51% tensor-pipe utilisation). A is K-major (a row = 64 elements of K). B is
// K-major [N][K] row-major (the forward weight prepacked per phase as [C_out][tap, C_in], grad_input's as
// [C_in][ky, kx, C_out]), or, with kDirectB (forward only), read in place from a weight whose C_out is
// innermost (GemmArgs' b_ld / b_sky / b_skx, C_in % 64 == 0) into N-major tiles: per 64 columns, one 128-byte
// row per K-element, as wgmma_wgrad_kernel's B; that spares the pack kernel (5 us of the 256->128 forward at
// batch 1024 bf16, where it runs before the GEMM on the same stream). 3 stages of (16 + BN / 8) KB, two CTAs per
// SM. (Measured slower on an H200: BM = 256 with one CTA of four warpgroups per SM, and a fourth stage for 3
// K-tiles in flight on the 64-wide tiles.)
template <int BN>
struct WgmmaTile {
  static constexpr int BM = 128, BK = 64;  // BK: 64 16-bit elements = one 128-byte swizzle row
  static_assert(BK * 2 == 128, "a K-tile row is one 128-byte swizzle row");
  static constexpr int A_BYTES = BM * 128, B_BYTES = BN * 128, STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int OUT_LD = BN + 8;  // staged output row (elements): 4-byte stores of a warp hit 32 banks
  // + slack to align the stages to 1024 bytes, + the TMA path's stage barriers (8 bytes each) after the stages
  static constexpr int SMEM_BYTES = kStages * STAGE_BYTES + 1024 + 8 * kStages;
  static_assert(BM * OUT_LD * 2 + BM * 8 <= kStages * STAGE_BYTES, "epilogue staging reuses the stages");
};

// The TMA descriptors of wgmma_conv_kernel / wgmma_wgrad_kernel<..., kTma = true> (unused otherwise): `act` views
// the NHWC activation as [batch][H][W][C] with a box of 64 channels x the K-tile's or CTA's pixels
// (encode_activation_map); `b` views B as [phase][N][K] (box 64 x BN), for the forward's kDirectB the weight as
// [C_in][kH][kW][C_out] (box 64 x 1 x 1 x 64, one per 64 columns), for grad_weight the input as [K][N] (box
// 64 x 64). All with the 128-byte swizzle, so each box lands as the K-, M- or N-major swizzled tile the wgmma
// descriptors describe.
struct WgmmaMaps {
  CUtensorMap act, b;
};

// One K-tile of the stage at `stage` (A then B, WgmmaTile's layout): 4 wgmma of K = 16 per warpgroup `wg`,
// committed as one group.
template <int BN, bool kDirectB, bool kF16>
__device__ inline void wgmma_conv_ktile(float (&acc)[BN / 2], uint32_t stage, int wg) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = WgmmaTile<BN>;
  const uint32_t a_tile = stage + wg * 64 * 128, b_tile = stage + T::A_BYTES;
  mma::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < T::BK / 16; ++kk) {
    const uint64_t da = mma::wgmma_desc_k_sw128(a_tile + kk * 32);
    // N-major B: 16 K-rows are two 8-row groups, 2 KB; the 64-column blocks are BK * 128 bytes apart.
    const uint64_t db = kDirectB ? mma::wgmma_desc_mn_sw128(b_tile + kk * 2048, T::BK * 128)
                                 : mma::wgmma_desc_k_sw128(b_tile + kk * 32);
    if constexpr (BN == 128)
      mma::wgmma_m64n128k16<kF16, kDirectB>(acc, da, db);
    else if constexpr (BN == 64)
      mma::wgmma_m64n64k16<kF16, kDirectB>(acc, da, db);
    else
      mma::wgmma_m64n32k16<kF16>(acc, da, db);
  }
  mma::wgmma_commit();
#endif
}

// The TMA mainloop of the wgmma kernels: thread 0 arms stage s's mbarrier with the stage's bytes and calls
// issue(k-tile, stage address, barrier) to start its copies, kStages - 1 K-tiles ahead; every thread waits for
// the barrier's phase of its K-tile and calls consume(stage address) to issue (and commit) its wgmma. As in the
// cp.async mainloops, a stage is refilled after the barrier at the top of the next K-tile, once both warpgroups
// have waited for their wgmma on it. The barriers sit after the stages (8 bytes each).
template <int kStageBytes, typename Issue, typename Consume>
__device__ inline void tma_pipeline(int ktiles, uint32_t sbase, Issue&& issue, Consume&& consume) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const uint32_t full = sbase + kStages * kStageBytes;
  const bool producer = threadIdx.x == 0;
  auto arm = [&](int kt) {
    const int s = kt % kStages;
    mma::mbarrier_arrive_expect_tx(full + 8 * s, kStageBytes);
    issue(kt, sbase + s * kStageBytes, full + 8 * s);
  };
  if (producer) {
    for (int s = 0; s < kStages; ++s) mma::mbarrier_init(full + 8 * s, 1);
    mma::fence_mbarrier_init();
  }
  __syncthreads();
  if (producer)
    for (int kt = 0; kt < kStages - 1 && kt < ktiles; ++kt) arm(kt);
  for (int kt = 0; kt < ktiles; ++kt) {
    if (kt > 0) __syncthreads();  // K-tile kt - 1's stage, which kt + 2 refills, is read by every warpgroup
    if (producer && kt + kStages - 1 < ktiles) arm(kt + kStages - 1);
    mma::mbarrier_wait_parity(full + 8 * (kt % kStages), (kt / kStages) & 1);
    consume(sbase + (kt % kStages) * kStageBytes);
    mma::wgmma_wait<0>();
  }
#endif
}

// The cp.async mainloop of the wgmma kernels: kStages - 1 K-tiles in flight while one is multiplied. load(stage,
// k-tile) issues this thread's copies of a K-tile into a stage, in K-tile order; consume(stage, k-tile) issues and
// commits the warpgroup's wgmma on it. Tile kt + kStages - 1 goes into the stage that tile kt - 1 used: every
// thread waited for its warpgroup's wgmma of kt - 1 before the barrier at the top of kt.
template <typename Load, typename Consume>
__device__ __forceinline__ void cp_async_wgmma_pipeline(int ktiles, Load&& load, Consume&& consume) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<kStages - 2>();
    mma::fence_proxy_async_shared();
    __syncthreads();
    consume(kt % kStages, kt);
    const int next = kt + kStages - 1;
    if (next < ktiles) load(next % kStages, next);
    cp_async_commit();
    mma::wgmma_wait<0>();
  }
  cp_async_wait<0>();
#endif
}

// wgmma_conv_kernel's operands by TMA: per K-tile one box for A (the tap's shifted view of the activation: out-of-
// image taps and rows past M come back as zeros, no tap masks, no per-row address arithmetic; the cp.async path
// issues 8-12 16-byte copies per thread and K-tile, and Nsight Compute found it issue-bound) and one (packed B)
// or BN / 64 (the weight in place) for B.
template <int BN, bool kDirectB, bool kF16>
__device__ inline void wgmma_conv_tma_mainloop(const GemmArgs& a, const WgmmaMaps& maps, uint32_t sbase,
                                               float (&acc)[BN / 2]) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = WgmmaTile<BN>;
  constexpr int BK = T::BK;
  const int wg = threadIdx.x >> 7;
  const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * BN, phase = blockIdx.z;
  const int py = phase >> 1, px = phase & 1;
  // The CTA's first row: image img0, pixel row my0 (0 when the box holds whole images).
  const int rows_hw = a.rows_H * a.rows_W, img0 = m0 / rows_hw, my0 = (m0 - img0 * rows_hw) / a.rows_W;
  const int y0 = a.src_scale * my0 + a.src_off + py, x0 = a.src_off + px;
  auto issue = [&](int kt, uint32_t dst, uint32_t bar) {
    const int k = kt * BK, tap = k / a.act_C, c0 = k - tap * a.act_C;  // act_C % 64 == 0: a K-tile is in one tap
    mma::tma_load_4d(dst, &maps.act, c0, x0 + a.src_dir * (tap & (a.taps_w - 1)),
                     y0 + a.src_dir * (tap >> a.taps_shift), img0, bar);
    if constexpr (kDirectB) {
      // The forward's kernel tap of phase (py, px) and tap (ty, tx) = (tap >> 1, tap & 1); K rows are C_in.
#pragma unroll
      for (int j = 0; j < BN / 64; ++j)
        mma::tma_load_4d(dst + T::A_BYTES + j * BK * 128, &maps.b, n0 + 64 * j, 1 - px + 2 * (tap & 1),
                         1 - py + 2 * (tap >> 1), c0, bar);
    } else {
      mma::tma_load_3d(dst + T::A_BYTES, &maps.b, k, n0, phase, bar);
    }
  };
  tma_pipeline<T::STAGE_BYTES>(a.K / BK, sbase, issue,
                               [&](uint32_t stage) { wgmma_conv_ktile<BN, kDirectB, kF16>(acc, stage, wg); });
#endif
}

template <typename scalar_t, int BN, bool kDirectB, bool kTma>
__global__ void __launch_bounds__(kThreads, 2)
    wgmma_conv_kernel(const GemmArgs a, const __grid_constant__ WgmmaMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = WgmmaTile<BN>;
  constexpr int BM = T::BM, BK = T::BK, VEC = 8;
  constexpr bool kF16 = std::is_same_v<scalar_t, c10::Half>;
  static_assert(!kDirectB || BN >= 64, "N-major B: whole 64-column blocks");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // Swizzle atoms (8 rows x 128 bytes) must start 1024-byte aligned in the shared window.
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t sbase = smem_addr(smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN, phase = blockIdx.z;
  const int py = phase >> 1, px = phase & 1;
  const int rows_hw = a.rows_H * a.rows_W;
  float acc[BN / 2];
#pragma unroll
  for (int e = 0; e < BN / 2; ++e) acc[e] = 0.f;

  if constexpr (kTma) {
    wgmma_conv_tma_mainloop<BN, kDirectB, kF16>(a, maps, sbase, acc);
  } else {
    const int ktiles = (a.K + BK - 1) / BK;
    const uint16_t* act = static_cast<const uint16_t*>(a.act);
    const uint16_t* bmat = static_cast<const uint16_t*>(a.b) + phase * a.b_phase_stride;
    const int sH = int(a.act_sH), sW = int(a.act_sW);

    // A: thread copies 16-byte chunk a_c of rows a_r + 32 i; per row, the unshifted source offset and a bit per
    // tap inside the source (rows past M have none: zeros); its K position (tap, channel) stepped per K-tile.
    constexpr int A_ITERS = BM / 32;
    const int a_c = tid & 7, a_r = tid >> 3;
    const uint32_t a_dst = a_r * 128 + ((a_c ^ (a_r & 7)) << 4);  // (a_r + 32 i) % 8 == a_r % 8
    int row_off[A_ITERS];
    uint32_t row_taps[A_ITERS];
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) {
      const int m = m0 + a_r + 32 * i;
      row_off[i] = 0;
      row_taps[i] = 0;
      if (m < a.M) conv_row_source(a, m, rows_hw, py, px, sH, sW, row_off[i], row_taps[i]);
    }
    int k_tap = (a_c * VEC) / a.act_C, k_chan = a_c * VEC - k_tap * a.act_C;
    auto load_a = [&](int s) {
      const int tap_off = a.src_dir * ((k_tap >> a.taps_shift) * sH + (k_tap & (a.taps_w - 1)) * sW) + k_chan;
      unsigned char* dst = smem + s * T::STAGE_BYTES + a_dst;
#pragma unroll
      for (int i = 0; i < A_ITERS; ++i) {
        const bool ok = k_tap < 32 && ((row_taps[i] >> k_tap) & 1u);  // taps past K have no bit
        cp_async16(dst + i * 32 * 128, ok ? act + (row_off[i] + tap_off) : act, ok);
      }
      k_chan += BK;
      while (k_chan >= a.act_C) {
        k_chan -= a.act_C;
        ++k_tap;
      }
    };
    // B, K-major: thread copies chunk a_c (same mapping) of rows a_r + 32 j of the [N][K] matrix.
    // B, N-major (kDirectB): chunk b_v of K-rows b_r + B_KROWS j, the K-tile lying in tap b_tap (C_in % 64 == 0).
    constexpr int B_ITERS = kDirectB ? BK * BN / 8 / kThreads : BN / 32;
    constexpr int B_VPR = BN / 8, B_KROWS = kThreads / B_VPR;
    const int b_v = tid % B_VPR, b_r = tid / B_VPR;
    const uint32_t b_dst =
        kDirectB ? (b_v >> 3) * (BK * 128) + b_r * 128 + (((b_v & 7) ^ (b_r & 7)) << 4) : a_dst;  // B_KROWS % 8 == 0
    const bool b_col_ok = n0 + b_v * VEC < a.N;
    int b_tap = 0, b_ci = 0;
    const uint16_t* b_src[kDirectB ? 1 : B_ITERS];
    bool b_row_ok[kDirectB ? 1 : B_ITERS];
    if constexpr (!kDirectB) {
#pragma unroll
      for (int j = 0; j < B_ITERS; ++j) {
        const int n = n0 + a_r + 32 * j;
        b_row_ok[j] = n < a.N;
        b_src[j] = bmat + int64_t(b_row_ok[j] ? n : 0) * a.K + a_c * VEC;
      }
    }
    auto load_b = [&](int s, int kt) {
      unsigned char* dst = smem + s * T::STAGE_BYTES + T::A_BYTES + b_dst;
      if constexpr (kDirectB) {
        const uint16_t* src = bmat + (1 - py + 2 * (b_tap >> 1)) * a.b_sky + (1 - px + 2 * (b_tap & 1)) * a.b_skx +
                              int64_t(b_ci + b_r) * a.b_ld + n0 + b_v * VEC;
#pragma unroll
        for (int j = 0; j < B_ITERS; ++j)
          cp_async16(dst + j * B_KROWS * 128, b_col_ok ? src + int64_t(j) * B_KROWS * a.b_ld : bmat, b_col_ok);
        b_ci += BK;
        if (b_ci == a.b_rows_per_tap) {
          b_ci = 0;
          ++b_tap;
        }
      } else {
        const bool k_ok = kt * BK + a_c * VEC < a.K;  // K % 8 == 0: a chunk is all in or all out
#pragma unroll
        for (int j = 0; j < B_ITERS; ++j) {
          const bool ok = k_ok && b_row_ok[j];
          cp_async16(dst + j * 32 * 128, ok ? b_src[j] + kt * BK : bmat, ok);
        }
      }
    };

    cp_async_wgmma_pipeline(
        ktiles,
        [&](int s, int kt) {
          load_a(s);
          load_b(s, kt);
        },
        [&](int s, int) { wgmma_conv_ktile<BN, kDirectB, kF16>(acc, sbase + s * T::STAGE_BYTES, wg); });
  }
  __syncthreads();  // every warpgroup's wgmma is done: the stages may be overwritten

  // Epilogue: the tile in shared memory as scalar_t [BM][OUT_LD], then 16-byte stores along the channels.
  scalar_t* tile = reinterpret_cast<scalar_t*>(smem);
  int64_t* row_base = reinterpret_cast<int64_t*>(smem + BM * T::OUT_LD * 2);
  if (tid < BM) {
    const int m = m0 + tid;
    int64_t rbase = -1;
    if (m < a.M) {
      const int n = m / rows_hw, rem = m - n * rows_hw, my = rem / a.rows_W, mx = rem - my * a.rows_W;
      rbase = n * a.c_sN + int64_t(a.dst_scale * my + py) * a.c_sH + int64_t(a.dst_scale * mx + px) * a.c_sW;
    }
    row_base[tid] = rbase;
  }
  {
    const int g = lane >> 2, t4 = lane & 3, r = wg * 64 + (warp & 3) * 16 + g;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      alignas(4) scalar_t lo[2] = {static_cast<scalar_t>(acc[4 * j]), static_cast<scalar_t>(acc[4 * j + 1])};
      alignas(4) scalar_t hi[2] = {static_cast<scalar_t>(acc[4 * j + 2]), static_cast<scalar_t>(acc[4 * j + 3])};
      *reinterpret_cast<uint32_t*>(tile + r * T::OUT_LD + 8 * j + 2 * t4) = *reinterpret_cast<const uint32_t*>(lo);
      *reinterpret_cast<uint32_t*>(tile + (r + 8) * T::OUT_LD + 8 * j + 2 * t4) =
          *reinterpret_cast<const uint32_t*>(hi);
    }
  }
  __syncthreads();
  scalar_t* c_out = static_cast<scalar_t*>(a.c);
  constexpr int VPR = BN / 8;  // 16-byte vectors per row
#pragma unroll
  for (int v = tid; v < BM * VPR; v += kThreads) {
    const int r = v / VPR, cv = v % VPR, n = n0 + cv * 8;
    const int64_t rbase = row_base[r];
    if (rbase >= 0 && n < a.N)
      *reinterpret_cast<uint4*>(c_out + rbase + n) = *reinterpret_cast<const uint4*>(tile + r * T::OUT_LD + cv * 8);
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// ---- sm_90a: grad_weight on wgmma -----------------------------------------------------------------------------
// gw^T[(ky, kx, co), ci] = sum over input pixels p of grad_output[p's tap pixel, co] * x[p, ci]: both operands
// are contiguous along M / N (channels), so they go into shared memory M-/N-major (transposed operands of
// wgmma): a K-tile of 64 pixels is, per 64-channel block, 64 rows (one per pixel) of 128 bytes, chunk c of row k
// at c ^ (k % 8); blocks 8 KB apart (the descriptor's leading-byte offset), 8-row groups 1 KB apart (its
// stride-byte offset). Split over K (pixels) as planned by plan_splits; each CTA adds its fp32 tile into the
// dense [M][N] workspace with 16-byte atomics, and the last one of each tile writes it to grad_weight (a.c,
// scalar_t, through its strides). Tile 128 x BN x 64, BN in {128, 64}, 3 stages, two CTAs per SM.
template <int BN>
struct WgmmaWgradTile {
  static constexpr int BM = 128, BK = 64;
  static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int OUT_LD = BN + 4;  // staged fp32 output row
  static constexpr int SMEM_BYTES = kStages * STAGE_BYTES + 1024 + 8 * kStages;  // + alignment, TMA barriers
  static_assert(BM * OUT_LD * 4 <= kStages * STAGE_BYTES, "epilogue staging reuses the stages");
};

// One K-tile of wgmma_wgrad_kernel's stage at `stage` (A, then B, both M-/N-major): 4 wgmma of K = 16 per
// warpgroup `wg` (its 64-channel block of A), committed as one group.
template <int BN, bool kF16>
__device__ inline void wgmma_wgrad_ktile(float (&acc)[BN / 2], uint32_t stage, int wg) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = WgmmaWgradTile<BN>;
  const uint32_t a_tile = stage + wg * (T::BK * 128), b_tile = stage + T::A_BYTES;
  mma::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < T::BK / 16; ++kk) {  // 16 pixels = two 8-row groups = 2 KB further
    const uint64_t da = mma::wgmma_desc_mn_sw128(a_tile + kk * 2048, T::BK * 128);
    const uint64_t db = mma::wgmma_desc_mn_sw128(b_tile + kk * 2048, T::BK * 128);
    if constexpr (BN == 128)
      mma::wgmma_m64n128k16_tt<kF16>(acc, da, db);
    else
      mma::wgmma_m64n64k16_tt<kF16>(acc, da, db);
  }
  mma::wgmma_commit();
#endif
}

// wgmma_wgrad_kernel's operands by TMA (maps from wgmma_wgrad_tma_maps): per K-tile of 64 input pixels, A is two
// boxes of 64 grad_output channels of one tap each (the tile's rows m0 and m0 + 64; C_out % 64 == 0) over the
// 64 pixels' tap positions (stride 2; outside the image: zeros), and B is BN / 64 boxes of the dense [pixel][C_in]
// input (pixels past K: zeros).
template <int BN, bool kF16>
__device__ inline void wgmma_wgrad_tma_mainloop(const GemmArgs& a, const WgmmaMaps& maps, uint32_t sbase,
                                                int kt_begin, int nk, float (&acc)[BN / 2]) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = WgmmaWgradTile<BN>;
  constexpr int BK = T::BK;
  const int wg = threadIdx.x >> 7, m0 = blockIdx.x * T::BM, n0 = blockIdx.y * BN;
  const int rows_hw = a.rows_H * a.rows_W;
  auto issue = [&](int i, uint32_t dst, uint32_t bar) {
    const int p0 = (kt_begin + i) * BK, img = p0 / rows_hw, my = (p0 - img * rows_hw) / a.rows_W;
    const int y0 = a.src_scale * my + a.src_off, x0 = a.src_off;
#pragma unroll
    for (int blk = 0; blk < 2; ++blk) {
      const int m = m0 + 64 * blk, tap = m / a.act_C, co = m - tap * a.act_C;
      mma::tma_load_4d(dst + blk * BK * 128, &maps.act, co, x0 + a.src_dir * (tap & (a.taps_w - 1)),
                       y0 + a.src_dir * (tap >> a.taps_shift), img, bar);
    }
#pragma unroll
    for (int j = 0; j < BN / 64; ++j) mma::tma_load_2d(dst + T::A_BYTES + j * BK * 128, &maps.b, n0 + 64 * j, p0, bar);
  };
  tma_pipeline<T::STAGE_BYTES>(nk, sbase, issue, [&](uint32_t stage) { wgmma_wgrad_ktile<BN, kF16>(acc, stage, wg); });
#endif
}

template <typename scalar_t, int BN, bool kTma>
__global__ void __launch_bounds__(kThreads, 2)
    wgmma_wgrad_kernel(const GemmArgs a, const __grid_constant__ WgmmaMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = WgmmaWgradTile<BN>;
  constexpr int BM = T::BM, BK = T::BK, VEC = 8;
  constexpr bool kF16 = std::is_same_v<scalar_t, c10::Half>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t sbase = smem_addr(smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN, split = blockIdx.z;
  const int ktiles = (a.K + BK - 1) / BK;
  const int kt_begin = split * a.ktiles_per_split, kt_end = min(ktiles, kt_begin + a.ktiles_per_split);
  const int nk = kt_end - kt_begin;
  float acc[BN / 2];
#pragma unroll
  for (int e = 0; e < BN / 2; ++e) acc[e] = 0.f;
  if constexpr (kTma) {
    wgmma_wgrad_tma_mainloop<BN, kF16>(a, maps, sbase, kt_begin, nk, acc);
  } else {
    const uint16_t* act = static_cast<const uint16_t*>(a.act);
    const uint16_t* bmat = static_cast<const uint16_t*>(a.b);
    const int rows_hw = a.rows_H * a.rows_W;
    const int sH = int(a.act_sH), sW = int(a.act_sW);

    // A: thread's M chunk (8 channels of one tap: act_C % 8 == 0) is fixed; its K rows (pixels) a_r + 16 i are
    // stepped by BK pixels per K-tile with one carry per coordinate.
    constexpr int A_ITERS = BK / 16;
    const int a_v = tid & 15, a_r = tid >> 4;
    const uint32_t a_dst = (a_v >> 3) * (BK * 128) + a_r * 128 + (((a_v & 7) ^ (a_r & 7)) << 4);
    const int m = m0 + a_v * VEC;
    const bool m_ok = m < a.M;
    const int tap = m / a.act_C, w_c = m - tap * a.act_C;
    const int w_ty = tap >> a.taps_shift, w_tx = tap & (a.taps_w - 1);
    PixelCursor pix[A_ITERS];
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) pix[i].start(a, kt_begin * BK + a_r + 16 * i, rows_hw);
    const PixelCursor pix_step = pixel_step(a, BK, rows_hw);
    auto load_a = [&](int s, int kt) {
      unsigned char* dst = smem + s * T::STAGE_BYTES + a_dst;
#pragma unroll
      for (int i = 0; i < A_ITERS; ++i) {
        const int y = a.src_scale * pix[i].y + a.src_off + a.src_dir * w_ty;
        const int x = a.src_scale * pix[i].x + a.src_off + a.src_dir * w_tx;
        const bool ok = m_ok && kt * BK + a_r + 16 * i < a.K && y >= 0 && y < a.act_H && x >= 0 && x < a.act_W;
        cp_async16(dst + i * 16 * 128, ok ? act + (pix[i].nb + y * sH + x * sW + w_c) : act, ok);
        pix[i].advance(a, pix_step);
      }
    };
    // B: x as a dense [K pixels][N channels] matrix; thread's chunk b_v of rows b_r + B_ROWS j.
    constexpr int B_VPR = BN / VEC, B_ROWS = kThreads / B_VPR, B_ITERS = BK / B_ROWS;
    const int b_v = tid % B_VPR, b_r = tid / B_VPR;
    const uint32_t b_dst = T::A_BYTES + (b_v >> 3) * (BK * 128) + b_r * 128 + (((b_v & 7) ^ (b_r & 7)) << 4);
    const bool n_ok = n0 + b_v * VEC < a.N;
    const uint16_t* b_col = bmat + n0 + b_v * VEC;
    auto load_b = [&](int s, int kt) {
      unsigned char* dst = smem + s * T::STAGE_BYTES + b_dst;
#pragma unroll
      for (int j = 0; j < B_ITERS; ++j) {
        const int p = kt * BK + b_r + B_ROWS * j;  // (b_r + B_ROWS j) % 8 == b_r % 8: B_ROWS is 16 or 32
        const bool ok = n_ok && p < a.K;
        cp_async16(dst + j * B_ROWS * 128, ok ? b_col + int64_t(p) * a.N : bmat, ok);
      }
    };

    cp_async_wgmma_pipeline(
        nk,
        [&](int s, int i) {
          load_a(s, kt_begin + i);
          load_b(s, kt_begin + i);
        },
        [&](int s, int) { wgmma_wgrad_ktile<BN, kF16>(acc, sbase + s * T::STAGE_BYTES, wg); });
  }
  __syncthreads();  // every warpgroup's wgmma is done: the stages may be overwritten

  // Epilogue: the fp32 tile in shared memory; with K split, 16-byte atomic adds along N into the dense [M][N]
  // workspace, and the tile's last CTA to finish reads the sums back into shared memory. Then the tile goes to
  // grad_weight, converted, through its strides (row m = (ky, kx, co), column ci): no ATen copy of the workspace
  // into grad_weight follows (one kernel fewer per backward, at the same time as a separate copy).
  float* tile = reinterpret_cast<float*>(smem);
  {
    const int g = lane >> 2, t4 = lane & 3, r = wg * 64 + (warp & 3) * 16 + g;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      *reinterpret_cast<float2*>(tile + r * T::OUT_LD + 8 * j + 2 * t4) = make_float2(acc[4 * j], acc[4 * j + 1]);
      *reinterpret_cast<float2*>(tile + (r + 8) * T::OUT_LD + 8 * j + 2 * t4) =
          make_float2(acc[4 * j + 2], acc[4 * j + 3]);
    }
  }
  __syncthreads();
  constexpr int VPR = BN / 4;
  if (gridDim.z > 1) {
#pragma unroll 4
    for (int v = tid; v < BM * VPR; v += kThreads) {
      const int r = v / VPR, cv = v % VPR, row = m0 + r, n = n0 + cv * 4;
      if (row < a.M && n < a.N) {
        const float* t = tile + r * T::OUT_LD + cv * 4;
        atomicAdd(reinterpret_cast<float4*>(a.ws + int64_t(row) * a.N + n), make_float4(t[0], t[1], t[2], t[3]));
      }
    }
    // Release this CTA's adds before counting it (and acquire the others' after): the threadFenceReduction
    // pattern of the CUDA samples.
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(a.tile_done + blockIdx.y * gridDim.x + blockIdx.x, 1u) == gridDim.z - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
#pragma unroll 4
    for (int v = tid; v < BM * VPR; v += kThreads) {
      const int r = v / VPR, cv = v % VPR, row = m0 + r, n = n0 + cv * 4;
      if (row < a.M && n < a.N)
        *reinterpret_cast<float4*>(tile + r * T::OUT_LD + cv * 4) =
            __ldcg(reinterpret_cast<const float4*>(a.ws + int64_t(row) * a.N + n));
    }
    __syncthreads();
  }
  // A thread owns row r (consecutive lanes: consecutive co, i.e. consecutive addresses of a channels_last
  // weight) and every (kThreads / BM)-th column.
  static_assert(kThreads % BM == 0, "row ownership");
  const int r = tid % BM, row = m0 + r;
  if (row < a.M) {
    const int tap = row / a.act_C, co = row - tap * a.act_C;
    const int64_t rbase = co * a.c_sN + (tap >> a.taps_shift) * a.c_sH + (tap & (a.taps_w - 1)) * a.c_sW;
    scalar_t* out = static_cast<scalar_t*>(a.c);
#pragma unroll 4
    for (int c = tid / BM; c < BN; c += kThreads / BM)
      if (n0 + c < a.N) out[rbase + (n0 + c) * a.c_sC] = static_cast<scalar_t>(tile[r * T::OUT_LD + c]);
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// cuTensorMapEncodeTiled from the driver the runtime loaded (no link against libcuda), or null if it has none.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const auto encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encoder;
}

// A 16-bit tensor of `rank` dims (innermost first; strides in bytes, of dims 1..rank-1) with 128-byte-swizzled
// boxes, zeros outside it.
bool encode_tensor_map(CUtensorMap& map, const void* base, cuuint32_t rank, const cuuint64_t* dims,
                       const cuuint64_t* strides, const cuuint32_t* box, const cuuint32_t* element_strides) {
  const auto encode = tensor_map_encoder();
  return encode &&
         encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, rank, const_cast<void*>(base), dims, strides, box,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The gathered activation of a TMA path as [batch][H][W][C], boxes of 64 channels x `rows` pixel rows (row =
// one pixel of the rows_H x rows_W grid; `rows` a power of two <= 128): whole images (rows_H * rows_W divides
// `rows`) or whole pixel rows of one image (rows_W divides `rows`, `rows` divides rows_H * rows_W), every
// src_scale-th pixel (a TMA element stride), <= 256 elements per box dimension; channels a multiple of 64 (a
// 64-element row of a tile in one tap). False where the shapes allow none of this.
bool encode_activation_map(const GemmArgs& a, int rows, int batch, CUtensorMap& map) {
  const int rows_hw = a.rows_H * a.rows_W;
  if (a.act_C % 64 != 0 || (a.src_scale != 1 && a.src_scale != 2) || !aligned16(a.act)) return false;
  int box_imgs = 1, box_rows = 0;
  if (rows % rows_hw == 0) {
    box_imgs = rows / rows_hw;
    box_rows = a.rows_H;
  } else if (rows_hw % rows == 0 && rows % a.rows_W == 0) {
    box_rows = rows / a.rows_W;
  } else {
    return false;
  }
  const cuuint32_t scale = cuuint32_t(a.src_scale);
  if (scale * a.rows_W > 256 || scale * box_rows > 256 || box_imgs > 256) return false;
  const cuuint64_t dims[4] = {cuuint64_t(a.act_C), cuuint64_t(a.act_W), cuuint64_t(a.act_H), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {cuuint64_t(a.act_sW) * 2, cuuint64_t(a.act_sH) * 2, cuuint64_t(a.act_sN) * 2};
  const cuuint32_t box[4] = {64, scale * a.rows_W, scale * box_rows, cuuint32_t(box_imgs)};
  const cuuint32_t element_strides[4] = {1, scale, scale, 1};
  return encode_tensor_map(map, a.act, 4, dims, strides, box, element_strides);
}

// Whether wgmma_conv_kernel's operands can be loaded by TMA (A's box exactly the CTA's 128 rows), and if so
// their maps. HIERPAR_K4S2P1_TMA=0 keeps the cp.async gathers (same-process timings).
bool wgmma_tma_maps(const GemmArgs& a, int phases, bool direct_b, int bn, WgmmaMaps& maps) {
  if (!switch_on(Switch::k4s2p1_tma) || a.K % 64 != 0 || !aligned16(a.b) ||
      !encode_activation_map(a, 128, a.M / (a.rows_H * a.rows_W), maps.act))
    return false;
  const cuuint32_t ones[4] = {1, 1, 1, 1};
  if (direct_b) {  // the weight in place, C_out innermost: [C_in][kH][kW][C_out]
    if (a.b_ld % 8 != 0 || a.b_sky % 8 != 0 || a.b_skx % 8 != 0) return false;
    const cuuint64_t dims[4] = {cuuint64_t(a.N), 4, 4, cuuint64_t(a.b_rows_per_tap)};
    const cuuint64_t strides[3] = {cuuint64_t(a.b_skx) * 2, cuuint64_t(a.b_sky) * 2, cuuint64_t(a.b_ld) * 2};
    const cuuint32_t box[4] = {64, 1, 1, 64};
    return encode_tensor_map(maps.b, a.b, 4, dims, strides, box, ones);
  }
  // Packed K-major B, one [N][K] matrix per phase.
  TORCH_INTERNAL_ASSERT(a.b_phase_stride == 0 || a.b_phase_stride == int64_t(a.N) * a.K);
  const cuuint64_t dims[3] = {cuuint64_t(a.K), cuuint64_t(a.N), cuuint64_t(phases)};
  const cuuint64_t strides[2] = {cuuint64_t(a.K) * 2, cuuint64_t(a.N) * a.K * 2};
  const cuuint32_t box[3] = {64, cuuint32_t(bn), 1};
  return encode_tensor_map(maps.b, a.b, 3, dims, strides, box, ones);
}

// Whether wgmma_wgrad_kernel's operands can be loaded by TMA (A's box: one K-tile of 64 input pixels), and if so
// their maps: B the dense [K pixels][N channels] input, boxes of 64 x 64.
bool wgmma_wgrad_tma_maps(const GemmArgs& a, int bn, WgmmaMaps& maps) {
  const int batch = (a.K + a.rows_H * a.rows_W - 1) / (a.rows_H * a.rows_W);
  if (!switch_on(Switch::k4s2p1_tma) || !aligned16(a.b) || !encode_activation_map(a, 64, batch, maps.act))
    return false;
  const cuuint64_t dims[2] = {cuuint64_t(a.N), cuuint64_t(a.K)};
  const cuuint64_t strides[1] = {cuuint64_t(a.N) * 2};
  const cuuint32_t box[2] = {64, 64}, ones[2] = {1, 1};
  return bn % 64 == 0 && encode_tensor_map(maps.b, a.b, 2, dims, strides, box, ones);
}

template <typename scalar_t, int BN, bool kDirectB>
void launch_wgmma_tile(const GemmArgs& a, int phases, cudaStream_t stream) {
  constexpr int smem = WgmmaTile<BN>::SMEM_BYTES;
  WgmmaMaps maps{};
  auto kernel = wgmma_tma_maps(a, phases, kDirectB, BN, maps) ? wgmma_conv_kernel<scalar_t, BN, kDirectB, true>
                                                              : wgmma_conv_kernel<scalar_t, BN, kDirectB, false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid((a.M + 127) / 128, (a.N + BN - 1) / BN, phases);
  kernel<<<grid, kThreads, smem, stream>>>(a, maps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int wgmma_wgrad_bn(const GemmArgs& a) { return a.N > 64 ? 128 : 64; }

}  // namespace

// direct_b: B is the forward's weight in place (N-major, tiles of 64 or 128 columns), else packed K-major.
template <typename scalar_t>
void launch_wgmma(const GemmArgs& a, int phases, bool direct_b) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    TORCH_INTERNAL_ASSERT(false, "conv_transpose2d: the wgmma kernel has no fp32 variant");
  } else {
    auto stream = at::cuda::getCurrentCUDAStream();
    switch (pick_bn(a.N)) {
      case 128:
        direct_b ? launch_wgmma_tile<scalar_t, 128, true>(a, phases, stream)
                 : launch_wgmma_tile<scalar_t, 128, false>(a, phases, stream);
        break;
      case 64:
        direct_b ? launch_wgmma_tile<scalar_t, 64, true>(a, phases, stream)
                 : launch_wgmma_tile<scalar_t, 64, false>(a, phases, stream);
        break;
      default:
        TORCH_INTERNAL_ASSERT(!direct_b, "conv_transpose2d: 32-wide wgmma tiles take a packed B");
        launch_wgmma_tile<scalar_t, 32, false>(a, phases, stream);
        break;
    }
  }
}

int64_t wgmma_wgrad_tiles(const GemmArgs& a) {
  return int64_t((a.M + 127) / 128) * ((a.N + wgmma_wgrad_bn(a) - 1) / wgmma_wgrad_bn(a));
}

template <typename scalar_t>
void launch_wgmma_wgrad(const GemmArgs& a) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    TORCH_INTERNAL_ASSERT(false, "conv_transpose2d: the wgmma kernel has no fp32 variant");
  } else {
    auto stream = at::cuda::getCurrentCUDAStream();
    auto go = [&](auto bn_tag) {
      constexpr int BN = decltype(bn_tag)::value;
      constexpr int smem = WgmmaWgradTile<BN>::SMEM_BYTES;
      WgmmaMaps maps{};
      auto kernel = wgmma_wgrad_tma_maps(a, BN, maps) ? wgmma_wgrad_kernel<scalar_t, BN, true>
                                                      : wgmma_wgrad_kernel<scalar_t, BN, false>;
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const dim3 grid((a.M + 127) / 128, (a.N + BN - 1) / BN, a.splits);
      kernel<<<grid, kThreads, smem, stream>>>(a, maps);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (wgmma_wgrad_bn(a) == 128)
      go(std::integral_constant<int, 128>{});
    else
      go(std::integral_constant<int, 64>{});
  }
}

template void launch_wgmma<float>(const GemmArgs&, int, bool);
template void launch_wgmma<at::BFloat16>(const GemmArgs&, int, bool);
template void launch_wgmma<at::Half>(const GemmArgs&, int, bool);
template void launch_wgmma_wgrad<float>(const GemmArgs&);
template void launch_wgmma_wgrad<at::BFloat16>(const GemmArgs&);
template void launch_wgmma_wgrad<at::Half>(const GemmArgs&);

}  // namespace hierpar::detail::k4s2p1
