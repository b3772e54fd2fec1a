// Fast CUDA path of hierpar::conv_transpose2d for kernel 4, stride 2, padding 1 (groups 1, dilation 1,
// output_padding 0): three implicit GEMMs on the tensor cores, with no column buffer and no gather pass.
//
// Output phase (py, px) = (oy % 2, ox % 2) of a k4 s2 p1 transposed convolution is an ordinary 2x2
// convolution of the input: out[n, 2qy+py, 2qx+px, co] = sum over ty, tx in {0, 1} and ci of
//   x[n, qy + py - ty, qx + px - tx, ci] * w[ci, co, 1 - py + 2ty, 1 - px + 2tx]      (zero outside x).
//  - forward:     per phase (grid z), M = N*H*W rows (n, qy, qx), N = C_out, K = 4*C_in (tap, ci); the weight
//                 is prepacked per phase as [4 taps * C_in, C_out];
//  - grad_input:  the stride-2, padding-1, 4x4 convolution of grad_output: M = N*H*W (n, iy, ix), N = C_in,
//                 K = 16*C_out, A gathered from grad_output at (2iy - 1 + ky, 2ix - 1 + kx); weight as
//                 [(ky, kx, co), ci];
//  - grad_weight: its transpose gw^T[(ky, kx, co), ci] = sum over input pixels p of
//                 grad_output[p's tap pixel, co] * x[p, ci]: M = 16*C_out, N = C_in, K = N*H*W, split over K
//                 with fp32 atomics into a workspace.
// Both A forms are "row r, column k -> an NHWC activation element at a spatial offset", so one kernel
// template (kWgrad picks the A form) covers the three.
//
// Layouts: the activations are read as NHWC. A channels_last input / grad_output is used in place; an NCHW
// one is copied to channels_last first (the tiled transpose of permute_copy.h; stock cuDNN converts too).
// Outputs are written straight in the caller's layout by the epilogue (NCHW or NHWC), so there is no
// conversion on the way out; grad_weight likewise when the weight is channels_last, through an fp32 workspace
// and one transposing copy otherwise (see k4s2p1_backward). Grids too small to fill the GPU split K and
// accumulate in an fp32 workspace (then one copy to the output).
// A channels_last weight is read in place by the forward (its rows (tap, ci) are C_out-contiguous) and, in
// fp32, by grad_input (K-major B); other weights are packed / copied first.
//
// Tiles: 128 x BN x (64 16-bit | 32 fp32 elements: 128 bytes of K), BN in {128, 64, 32, 16} chosen from the
// GEMM's N, 8 warps (warp tiles 64x32 at BN = 128). Mainloop: a 3-stage cp.async pipeline in dynamic shared
// memory (105 KB at most: two CTAs per SM; 16-byte copies, zero-filled at the borders through a source size of
// 0), fragments read with ldmatrix (.trans for the N- or M-contiguous operands) and multiplied with mma.sync
// (bf16/fp16 m16n8k16, TF32 m16n8k8; fp32 accumulation). Rows are padded so ldmatrix and the fp32 scalar
// fragment loads are free of bank conflicts. The gather addresses are set up once per CTA (per M row: source
// offset and a bit mask of the taps inside the image) and stepped per K-tile, with no integer division in the
// mainloop (with 3-4 divisions per 16-byte copy, Nsight Compute showed 10.7 issued instructions per MMA, the XU
// pipe at 14-25% and the tensor pipe at 11-27%). Channel counts that allow no 16-byte copy (not a multiple of 8 for
// 16-bit, 4 for fp32) are loaded with scalar loads into the same stages (synchronously), so any channel count
// is handled.
//
// Hopper (sm_90a code; this file is also built for it, see CMakeLists.txt): bf16/fp16 GEMMs whose operands
// allow 16-byte copies run on wgmma instead, with both operands read by the tensor cores from 128-byte-swizzled
// shared memory (no ldmatrix): wgmma_conv_kernel (forward per phase and grad_input; no K split, channels_last
// output), wgmma_wgrad_kernel (grad_weight, M-/N-major operands, split-K) and
// wgmma_forward_all_phases_kernel (forward with C_out <= 32, C_in % 64 == 0: the 4 phases of 128 input pixels
// per CTA from 9 shifted input tiles) and wgmma_grad_input_patch_kernel (grad_input with C_out == 32,
// C_in % 64 == 0: every K-tile read from one staged grad_output patch per 8 x 16 input pixels). A probe tells whether the driver loaded the sm_90a code; everything else
// (fp32/TF32, odd channel counts, NCHW outputs of the convolutions, small split grids) keeps mma.sync.
// wgmma_conv_kernel and wgmma_wgrad_kernel load their tiles with TMA (tensor-map boxes, an mbarrier per stage,
// zeros outside the image) where the channel counts are multiples of 64 and a tile's pixels are whole images or
// whole pixel rows of one image, else with per-thread cp.async gathers (bf16 batch 1024 channels_last, forward +
// backward in a CUDA graph on an H200: 256->128 95.2 us with TMA against 123.3 with cp.async, 128->64 116.8
// against 154.3; docs/conv_transpose.md).
// HIERPAR_WGMMA=0 / HIERPAR_WGMMA_ALL_PHASES=0 / HIERPAR_WGMMA_GRAD_INPUT_PATCH=0 switch them off,
// HIERPAR_K4S2P1_TMA=0 keeps the cp.async loads,
// HIERPAR_K4S2P1_WEIGHT_IN_PLACE=0 packs / copies channels_last weights as other ones and
// HIERPAR_K4S2P1_SPLIT_TARGET=n plans K splits for n CTAs per SM, for same-process timings.
#include "common.h"
#include "cuda/conv_transpose_k4s2p1.h"
#include "cuda/device_caps.h"
#include "cuda/mma.cuh"
#include "cuda/permute_copy.h"
#include "hierpar/switches.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>  // CUtensorMap and its enums only: the encoder comes from cudaGetDriverEntryPointByVersion
#include <cuda_bf16.h>
#include <cudaTypedefs.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstdint>
#include <optional>
#include <type_traits>

namespace hierpar::detail {
namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr int kStages = 3;

// kBT: B is given K-major ([N][K], fp32 only), staged as [BN][BK + 4] (rows 144 bytes apart: the scalar
// fragment loads by (n = lane / 4, k = lane % 4) hit 32 distinct banks).
template <typename scalar_t, int BN_, bool kWgrad, bool kBT = false>
struct Tile {
  static constexpr int ESZ = int(sizeof(scalar_t));
  static constexpr int BM = 128, BN = BN_;
  static constexpr int BK = 128 / ESZ;  // 128 bytes of K per tile row (64 16-bit / 32 fp32 elements)
  static constexpr int VEC = 16 / ESZ;  // elements per 16-byte copy
  static constexpr int KSTEP = ESZ == 4 ? 8 : 16;  // the MMA's K
  static constexpr int WN = BN >= 128 ? 4 : (BN >= 32 ? 2 : 1);
  static constexpr int WM = 8 / WN;
  static constexpr int WARP_M = BM / WM, WARP_N = BN / WN;
  static constexpr int MI = WARP_M / 16, NI = WARP_N / 8;
  // A in smem: [BM][BK] (K-contiguous) for the convolutions, [BK][BM] (M-contiguous) for grad_weight, whose A
  // is contiguous along M (the output channels of one tap). Padding: K-contiguous rows are 144 bytes apart (an
  // odd multiple of 16: the 8 rows of an ldmatrix hit all 32 banks, and 8 lanes' 16-byte cp.async of one row
  // fill 32 distinct banks); M/N-contiguous rows get 8 elements, an odd multiple of 16 bytes for 16-bit
  // (ldmatrix.trans) and 8 words mod 32 for fp32 (scalar fragment loads by (k = lane % 4, n = lane / 4)).
  static constexpr int LDA = kWgrad ? BM + 8 : BK + VEC;
  static constexpr int A_ELEMS = kWgrad ? BK * LDA : BM * LDA;
  static constexpr int LDB = kBT ? BK + 4 : BN + 8;
  static constexpr int B_ELEMS = kBT ? BN * LDB : BK * LDB;
  static constexpr int STAGE_BYTES = (A_ELEMS + B_ELEMS) * ESZ;
  static constexpr int SMEM_BYTES = kStages * STAGE_BYTES;  // <= 105 KB: two CTAs per SM
  static_assert(MI >= 1 && NI >= 2 && NI % 2 == 0 && WM * WARP_M == BM && WN * WARP_N == BN, "warp tiling");
  static_assert(!kBT || (ESZ == 4 && !kWgrad), "K-major B: the fp32 convolutions only");
  static_assert((A_ELEMS * ESZ) % 16 == 0 && STAGE_BYTES % 16 == 0, "16-byte aligned stages");
};

// One GEMM's operands. "act" is the gathered NHWC activation (forward: x; grad_input and grad_weight:
// grad_output): element (n, y, x, c) at n*act_sN + y*act_sH + x*act_sW + c. A row of the pixel grid
// [batch, rows_H, rows_W] (the GEMM's M for the convolutions, its K for grad_weight) plus a tap (ty, tx)
// reads act at y = src_scale * row_y + src_off + phase_y + src_dir * ty (and likewise x).
struct GemmArgs {
  int M, N, K;
  int splits, ktiles_per_split;
  bool a_vec, b_vec, c_vec, c_atomic, c_atomic4;  // c_atomic4: 16-byte fp32 atomics (N % 4 == 0)
  const void* act;
  int64_t act_sN, act_sH, act_sW;
  int act_H, act_W, act_C;
  int rows_H, rows_W;
  int taps_w, taps_shift, ntaps;  // taps per kernel row (a power of two: 2 or 4), its log2, taps in all
  int src_scale, src_off, src_dir;
  // B, N-contiguous rows: row k = (tap t, r) with r = k - t * b_rows_per_tap at
  //   b + phase * b_phase_stride + r * b_ld + ky * b_sky + kx * b_skx,
  // ky = 1 - py + 2 (t >> 1), kx = 1 - px + 2 (t & 1) (the forward's kernel tap). A packed [K, N] matrix is
  // b_ld = N, b_rows_per_tap = K, b_sky = b_skx = 0; the forward's weight read in place (C_out innermost, e.g.
  // channels_last, C_in a multiple of the K-tile so that a K-tile lies in one tap) is b_ld = its C_in stride,
  // b_rows_per_tap = C_in and b_sky / b_skx its kH / kW strides. K-major B (kernels that take it): [N][K] rows
  // b_ld apart.
  const void* b;
  int64_t b_phase_stride, b_ld, b_sky, b_skx;
  int b_rows_per_tap;
  void* c;  // scalar_t, or float when c_atomic
  // Convolutions: output pixel (n, y, x) at n*c_sN + y*c_sH + x*c_sW, channel stride c_sC.
  // grad_weight: row m = (ky, kx, co) at co*c_sN + ky*c_sH + kx*c_sW, column (ci) stride c_sC.
  int64_t c_sN, c_sH, c_sW, c_sC;
  int dst_scale;  // output pixel = dst_scale * row pixel + phase
  // wgmma grad_weight: the K splits' fp32 sums go into the dense [M][N] workspace `ws`; the last CTA of each
  // output tile to finish (counted in tile_done, zeroed with the workspace) writes the tile to c.
  float* ws;
  unsigned* tile_done;
};

template <typename scalar_t>
using bits_t = std::conditional_t<sizeof(scalar_t) == 2, uint16_t, uint32_t>;

using mma::cp_async16;
using mma::cp_async_commit;
using mma::cp_async_wait;
using mma::ldmatrix_x4;
using mma::ldmatrix_x4_trans;
using mma::smem_addr;
using mma::to_tf32;

// grad_weight's K rows are input pixels. A thread's pixel of one K row, as its image's offset and its (y, x) in
// the rows_H x rows_W grid, moves BK pixels a K-tile by additions: BK % rows_W < rows_W and the row step
// (BK / rows_W) % rows_H < rows_H, so each coordinate carries at most once.
struct PixelCursor {
  int nb, y, x;
  __device__ __forceinline__ void start(const GemmArgs& a, int pixel, int rows_hw) {
    const int n = pixel / rows_hw, rem = pixel - n * rows_hw;
    nb = n * int(a.act_sN);
    y = rem / a.rows_W;
    x = rem - y * a.rows_W;
  }
  __device__ __forceinline__ void advance(const GemmArgs& a, PixelCursor step) {
    x += step.x;
    if (x >= a.rows_W) {
      x -= a.rows_W;
      ++y;
    }
    y += step.y;
    if (y >= a.rows_H) {
      y -= a.rows_H;
      nb += int(a.act_sN);
    }
    nb += step.nb;
  }
};

// The PixelCursor::advance step of `pixels` pixels.
__device__ __forceinline__ PixelCursor pixel_step(const GemmArgs& a, int pixels, int rows_hw) {
  PixelCursor step;
  step.x = pixels % a.rows_W;
  step.y = (pixels / a.rows_W) % a.rows_H;
  step.nb = (pixels / rows_hw) * int(a.act_sN);
  return step;
}

// kVec: a.a_vec and a.b_vec hold, so the kernel has only the 16-byte-copy paths (no scalar fallback code in
// the mainloop: fewer instructions, no branches, a smaller instruction footprint).
// Two CTAs per SM (128 registers); three for BN <= 32 (70 KB of shared memory, <= 80 registers), which have
// short K loops (64->32 forward: K = 256) and gain from a third CTA covering the pipeline fill and epilogue.
// kBT: B K-major (Tile); with kVec only.
template <typename scalar_t, int BN, bool kWgrad, bool kVec, bool kBT = false>
__global__ void __launch_bounds__(kThreads, BN <= 32 ? 3 : 2) implicit_gemm_kernel(const GemmArgs a) {
  using T = Tile<scalar_t, BN, kWgrad, kBT>;
  using bits = bits_t<scalar_t>;
  constexpr int BM = T::BM, BK = T::BK, VEC = T::VEC, ESZ = T::ESZ;
  constexpr bool kF32 = ESZ == 4;
  static_assert(T::SMEM_BYTES >= 8 * 256 * 4 + BM * 8, "epilogue scratch reuses the operand stages");
  extern __shared__ __align__(128) unsigned char smem[];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / T::WN, wn = warp % T::WN;
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
  const int phase = blockIdx.z / a.splits, split = blockIdx.z % a.splits;
  const int py = phase >> 1, px = phase & 1;
  const int ktiles = (a.K + BK - 1) / BK;
  const int kt_begin = split * a.ktiles_per_split;
  const int kt_end = min(ktiles, kt_begin + a.ktiles_per_split);
  const bits* act = static_cast<const bits*>(a.act);
  const bits* bmat = static_cast<const bits*>(a.b) + phase * a.b_phase_stride;
  const int rows_hw = a.rows_H * a.rows_W;

  // ---- A: the gather, with its addresses kept incrementally (no integer division per K-tile) ---------------
  // load_a is called for K-tiles kt_begin, kt_begin + 1, ... in this order (the pipeline's order), so each
  // thread carries where its next copies come from and steps it by BK.
  constexpr int A_VPR = kWgrad ? BM / VEC : BK / VEC;  // 16-byte vectors per smem row
  constexpr int A_ROWS_PER_PASS = kThreads / A_VPR;
  constexpr int A_ITERS = (kWgrad ? BK : BM) / A_ROWS_PER_PASS;
  static_assert(A_ITERS * A_ROWS_PER_PASS == (kWgrad ? BK : BM), "A tile mapping");
  const int a_v = tid % A_VPR, a_r = tid / A_VPR;
  const int sH = int(a.act_sH), sW = int(a.act_sW);  // 32-bit element offsets (k4s2p1_fast_path_applies)
  auto in_src = [&](int y, int x) { return y >= 0 && y < a.act_H && x >= 0 && x < a.act_W; };
  auto a_stage = [&](int s) { return reinterpret_cast<bits*>(smem + s * T::STAGE_BYTES); };
  auto b_stage = [&](int s) { return reinterpret_cast<bits*>(smem + s * T::STAGE_BYTES + T::A_ELEMS * ESZ); };

  // Convolutions: per M row of this thread, the offset of its unshifted source pixel and a bit per tap that is
  // inside the source (rows past M: no bit, so they read zeros); this thread's K position as (tap, channel).
  int row_off[kWgrad ? 1 : A_ITERS];
  uint32_t row_taps[kWgrad ? 1 : A_ITERS];
  int k_tap = 0, k_chan = 0;
  // grad_weight: the M column (tap, channel) of this thread's vector, fixed over K; per K row (input pixel) of
  // this thread, the pixel's batch offset and coordinates, stepped by BK pixels per K-tile.
  int w_ty = 0, w_tx = 0, w_c = 0;
  bool w_valid = false;
  PixelCursor pix[kWgrad ? A_ITERS : 1], pix_step;
  if constexpr (!kWgrad) {
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) {
      const int m = m0 + a_r + i * A_ROWS_PER_PASS;
      row_off[i] = 0;
      row_taps[i] = 0;
      if (m < a.M) {
        const int n = m / rows_hw, rem = m - n * rows_hw, my = rem / a.rows_W, mx = rem - my * a.rows_W;
        const int y0 = a.src_scale * my + a.src_off + py, x0 = a.src_scale * mx + a.src_off + px;
        row_off[i] = n * int(a.act_sN) + y0 * sH + x0 * sW;
        for (int t = 0; t < a.ntaps; ++t) {
          const int ty = t >> a.taps_shift, tx = t & (a.taps_w - 1);
          if (in_src(y0 + a.src_dir * ty, x0 + a.src_dir * tx)) row_taps[i] |= 1u << t;
        }
      }
    }
    const int k0 = kt_begin * BK + a_v * VEC;
    k_tap = k0 / a.act_C;
    k_chan = k0 - k_tap * a.act_C;
  } else {
    const int m = m0 + a_v * VEC;
    w_valid = m < a.M;
    const int t = m / a.act_C;
    w_c = m - t * a.act_C;
    w_ty = t >> a.taps_shift;
    w_tx = t & (a.taps_w - 1);
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) pix[i].start(a, kt_begin * BK + a_r + i * A_ROWS_PER_PASS, rows_hw);
    pix_step = pixel_step(a, BK, rows_hw);
  }

  // Issues the copies of K-tile kt into stage s: cp.async where 16-byte copies apply, else scalar loads stored
  // synchronously (both are visible after the barrier that precedes the stage's use).
  auto load_a = [&](int s, int kt) {
    bits* As = a_stage(s);
    if constexpr (!kWgrad) {
      const int tap_off = a.src_dir * ((k_tap >> a.taps_shift) * sH + (k_tap & (a.taps_w - 1)) * sW) + k_chan;
#pragma unroll
      for (int i = 0; i < A_ITERS; ++i) {
        bits* dst = As + (a_r + i * A_ROWS_PER_PASS) * T::LDA + a_v * VEC;
        if (kVec || a.a_vec) {  // act_C % VEC == 0: the vector lies in one tap; taps past K have no bit
          const bool ok = k_tap < 32 && ((row_taps[i] >> k_tap) & 1u);
          cp_async16(dst, ok ? act + (row_off[i] + tap_off) : act, ok);
        } else {
          uint4 v = make_uint4(0, 0, 0, 0);
          bits* e = reinterpret_cast<bits*>(&v);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const int kj = kt * BK + a_v * VEC + j;
            const int t = kj / a.act_C, c = kj - t * a.act_C;
            if (kj < a.K && ((row_taps[i] >> t) & 1u)) {
              const int ty = t >> a.taps_shift, tx = t & (a.taps_w - 1);
              e[j] = act[row_off[i] + a.src_dir * (ty * sH + tx * sW) + c];
            }
          }
          *reinterpret_cast<uint4*>(dst) = v;
        }
      }
      k_chan += BK;
      while (k_chan >= a.act_C) {
        k_chan -= a.act_C;
        ++k_tap;
      }
    } else {
#pragma unroll
      for (int i = 0; i < A_ITERS; ++i) {
        const int r = a_r + i * A_ROWS_PER_PASS;
        bits* dst = As + r * T::LDA + a_v * VEC;
        const bool p_ok = kt * BK + r < a.K;  // input pixel (the GEMM's K) exists
        const int y0 = a.src_scale * pix[i].y + a.src_off, x0 = a.src_scale * pix[i].x + a.src_off;
        if (kVec || a.a_vec) {
          const int y = y0 + a.src_dir * w_ty, x = x0 + a.src_dir * w_tx;
          const bool ok = p_ok && w_valid && in_src(y, x);
          cp_async16(dst, ok ? act + (pix[i].nb + y * sH + x * sW + w_c) : act, ok);
        } else {
          uint4 v = make_uint4(0, 0, 0, 0);
          bits* e = reinterpret_cast<bits*>(&v);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const int m = m0 + a_v * VEC + j;
            if (p_ok && m < a.M) {
              const int t = m / a.act_C, c = m - t * a.act_C, ty = t >> a.taps_shift, tx = t & (a.taps_w - 1);
              const int y = y0 + a.src_dir * ty, x = x0 + a.src_dir * tx;
              if (in_src(y, x)) e[j] = act[pix[i].nb + y * sH + x * sW + c];
            }
          }
          *reinterpret_cast<uint4*>(dst) = v;
        }
        pix[i].advance(a, pix_step);  // the next K-tile
      }
    }
  };

  // ---- B: N-contiguous rows (see GemmArgs: a packed [K, N] matrix, the weight in place for the forward, or
  // the dense NHWC input for grad_weight), or K-major [N][K] rows (kBT) --------------------------------------
  // A thread copies the same column vector of rows b_kr, b_kr + B_ROWS_PER_PASS, ... of every K-tile. The
  // K-tile's first row is (tap b_tap, row b_row of the tap), stepped per K-tile like A's K position.
  constexpr int B_VPR = kBT ? BK / VEC : BN / VEC;
  constexpr int B_VECS = kBT ? BN * B_VPR : BK * B_VPR;
  constexpr int B_ITERS = (B_VECS + kThreads - 1) / kThreads;
  constexpr int B_ROWS_PER_PASS = kThreads / B_VPR;
  static_assert(kThreads % B_VPR == 0, "B tile mapping");
  static_assert(!kBT || (kVec && B_VECS % kThreads == 0), "K-major B: 16-byte copies, whole passes");
  const int b_kr = tid / B_VPR, b_col = (tid % B_VPR) * VEC, b_n = n0 + b_col;
  const bool b_n_ok = b_n < a.N;
  int b_tap = (kt_begin * BK) / a.b_rows_per_tap, b_row = kt_begin * BK - b_tap * a.b_rows_per_tap;
  auto load_b = [&](int s, int kt) {
    bits* Bs = b_stage(s);
    if constexpr (kBT) {  // row n0 + b_kr + i * B_ROWS_PER_PASS of [N][K], K-elements from kt * BK + b_col
#pragma unroll
      for (int i = 0; i < B_ITERS; ++i) {
        const int nr = b_kr + i * B_ROWS_PER_PASS, n = n0 + nr, k = kt * BK + b_col;
        const bool ok = n < a.N && k < a.K;  // K % VEC == 0: a vector is all in or all out
        cp_async16(Bs + nr * T::LDB + b_col, ok ? bmat + int64_t(n) * a.b_ld + k : bmat, ok);
      }
      return;
    }
    const bits* tile = bmat + (1 - py + 2 * (b_tap >> 1)) * a.b_sky + (1 - px + 2 * (b_tap & 1)) * a.b_skx +
                       int64_t(b_row) * a.b_ld;
    b_row += BK;
    if (b_row >= a.b_rows_per_tap) {
      b_row -= a.b_rows_per_tap;
      ++b_tap;
    }
    const int rows_left = a.K - kt * BK;
#pragma unroll
    for (int i = 0; i < B_ITERS; ++i) {
      const int kr = b_kr + i * B_ROWS_PER_PASS;
      if (B_VECS % kThreads != 0 && kr >= BK) continue;
      bits* dst = Bs + kr * T::LDB + b_col;
      const bits* row = tile + kr * a.b_ld;
      if (kVec || a.b_vec) {  // N % VEC == 0: a vector is all in or all out
        const bool ok = b_n_ok && kr < rows_left;
        cp_async16(dst, ok ? row + b_n : bmat, ok);
      } else {
        uint4 val = make_uint4(0, 0, 0, 0);
        bits* e = reinterpret_cast<bits*>(&val);
        if (kr < rows_left) {
#pragma unroll
          for (int j = 0; j < VEC; ++j)
            if (b_n + j < a.N) e[j] = row[b_n + j];
        }
        *reinterpret_cast<uint4*>(dst) = val;
      }
    }
  };

  // ---- fragments and MMAs of one stage ----------------------------------------------------------------------
  float acc[T::MI][T::NI][4];
#pragma unroll
  for (int i = 0; i < T::MI; ++i)
#pragma unroll
    for (int j = 0; j < T::NI; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  const int g = lane >> 2, t4 = lane & 3;
  auto compute = [&](int s) {
    const bits* As = a_stage(s);
    const bits* Bs = b_stage(s);
#pragma unroll
    for (int kk = 0; kk < BK; kk += T::KSTEP) {
      uint32_t af[T::MI][4], bf[T::NI][2];
#pragma unroll
      for (int mi = 0; mi < T::MI; ++mi) {
        const int mrow = wm * T::WARP_M + mi * 16;
        if constexpr (!kWgrad) {
          // Lanes 0-15 address rows 0-15 at K-offset 0, lanes 16-31 the same rows 16 bytes further: the four
          // 8x8 (16-bit) / 8x4 (fp32) matrices are exactly a0..a3 of the MMA's A fragment.
          ldmatrix_x4(af[mi], smem_addr(As + (mrow + (lane & 15)) * T::LDA + kk) + (lane >> 4) * 16);
        } else if constexpr (!kF32) {
          const int q = lane >> 3, k = (q >> 1) * 8 + (lane & 7), moff = (q & 1) * 8;
          ldmatrix_x4_trans(af[mi], smem_addr(As + (kk + k) * T::LDA + mrow + moff));
        } else {
          const bits* p = As + (kk + t4) * T::LDA + mrow + g;
          af[mi][0] = p[0];
          af[mi][1] = p[8];
          af[mi][2] = p[4 * T::LDA];
          af[mi][3] = p[4 * T::LDA + 8];
        }
        if constexpr (kF32) {
#pragma unroll
          for (int e = 0; e < 4; ++e) af[mi][e] = to_tf32(af[mi][e]);
        }
      }
#pragma unroll
      for (int nj = 0; nj < T::NI / 2; ++nj) {
        const int ncol = wn * T::WARP_N + nj * 16;
        if constexpr (!kF32) {
          const int q = lane >> 3, k = (q & 1) * 8 + (lane & 7), noff = (q >> 1) * 8;
          uint32_t r[4];
          ldmatrix_x4_trans(r, smem_addr(Bs + (kk + k) * T::LDB + ncol + noff));
          bf[2 * nj][0] = r[0];
          bf[2 * nj][1] = r[1];
          bf[2 * nj + 1][0] = r[2];
          bf[2 * nj + 1][1] = r[3];
        } else if constexpr (kBT) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const bits* p = Bs + (ncol + h * 8 + g) * T::LDB + kk + t4;
            bf[2 * nj + h][0] = to_tf32(p[0]);
            bf[2 * nj + h][1] = to_tf32(p[4]);
          }
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const bits* p = Bs + (kk + t4) * T::LDB + ncol + h * 8 + g;
            bf[2 * nj + h][0] = to_tf32(p[0]);
            bf[2 * nj + h][1] = to_tf32(p[4 * T::LDB]);
          }
        }
      }
#pragma unroll
      for (int mi = 0; mi < T::MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < T::NI; ++ni) mma::mma<scalar_t>(acc[mi][ni], af[mi], bf[ni]);
    }
  };

  // ---- main loop: kStages - 1 K-tiles in flight while one is multiplied --------------------------------------
  const int nk = kt_end - kt_begin;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) {
      load_a(s, kt_begin + s);
      load_b(s, kt_begin + s);
    }
    cp_async_commit();
  }
  for (int i = 0; i < nk; ++i) {
    cp_async_wait<kStages - 2>();  // K-tile i has landed (this thread's copies) ...
    __syncthreads();               // ... everyone's, and stage (i - 1) % kStages is free again
    const int next = i + kStages - 1;
    if (next < nk) {
      load_a(next % kStages, kt_begin + next);
      load_b(next % kStages, kt_begin + next);
    }
    cp_async_commit();
    compute(i % kStages);
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- epilogue: each warp stages one 16x16 block at a time in shared memory, then writes it out ---------
  float* scratch = reinterpret_cast<float*>(smem) + warp * 256;
  int64_t* row_base = reinterpret_cast<int64_t*>(smem + 8 * 256 * 4);
  if (tid < BM) {
    const int m = m0 + tid;
    int64_t rbase = -1;
    if (m < a.M) {
      if constexpr (kWgrad) {
        const int t = m / a.act_C, co = m - t * a.act_C, ky = t / a.taps_w, kx = t - ky * a.taps_w;
        rbase = co * a.c_sN + ky * a.c_sH + kx * a.c_sW;
      } else {
        const int n = m / rows_hw, rem = m - n * rows_hw, my = rem / a.rows_W, mx = rem - my * a.rows_W;
        rbase = n * a.c_sN + int64_t(a.dst_scale * my + py) * a.c_sH + int64_t(a.dst_scale * mx + px) * a.c_sW;
      }
    }
    row_base[tid] = rbase;
  }
  __syncthreads();
  scalar_t* c_out = static_cast<scalar_t*>(a.c);
  float* c_acc = static_cast<float*>(a.c);
  auto put = [&](int64_t off, float v) {
    if (a.c_atomic)
      atomicAdd(c_acc + off, v);
    else
      c_out[off] = static_cast<scalar_t>(v);
  };
#pragma unroll
  for (int mi = 0; mi < T::MI; ++mi) {
#pragma unroll
    for (int nj = 0; nj < T::NI / 2; ++nj) {
      // Accumulator layout (both MMA shapes): rows g and g + 8, columns 2 * t4 and 2 * t4 + 1 of each 16x8 tile.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float* d = acc[mi][2 * nj + h];
        const int col = h * 8 + 2 * t4;
        scratch[g * 16 + col] = d[0];
        scratch[g * 16 + col + 1] = d[1];
        scratch[(g + 8) * 16 + col] = d[2];
        scratch[(g + 8) * 16 + col + 1] = d[3];
      }
      __syncwarp();
      const int r0 = wm * T::WARP_M + mi * 16, c0 = n0 + wn * T::WARP_N + nj * 16;
      if (a.c_sC == 1 && a.c_vec) {  // a lane writes 8 consecutive channels of one row, one 16/32-byte store
        const int r = lane >> 1, cc = (lane & 1) * 8, n = c0 + cc;
        const int64_t rbase = row_base[r0 + r];
        if (rbase >= 0 && n + 8 <= a.N) {
          alignas(16) scalar_t v[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = static_cast<scalar_t>(scratch[r * 16 + cc + e]);
#pragma unroll
          for (int q = 0; q < int(8 * sizeof(scalar_t)) / 16; ++q)
            reinterpret_cast<uint4*>(c_out + rbase + n)[q] = reinterpret_cast<const uint4*>(v)[q];
        }
      } else if (a.c_sC == 1 && a.c_atomic4) {  // fp32 accumulation: one 16-byte atomic add per lane and row
        const int cc = (lane & 3) * 4, n = c0 + cc;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = (lane >> 2) + 8 * hh;
          const int64_t rbase = row_base[r0 + r];
          if (rbase >= 0 && n + 4 <= a.N) {
            const float* v = scratch + r * 16 + cc;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            atomicAdd(reinterpret_cast<float4*>(c_acc + rbase + n), make_float4(v[0], v[1], v[2], v[3]));
#else  // 16-byte atomics exist from sm_90 on
#pragma unroll
            for (int e = 0; e < 4; ++e) atomicAdd(c_acc + rbase + n + e, v[e]);
#endif
          }
        }
      } else if (a.c_sC == 1) {  // 16 lanes cover 16 consecutive channels of a row (coalesced stores/atomics)
        const int cc = lane & 15, n = c0 + cc;
        if (n < a.N) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const int r = (lane >> 4) + 2 * e;
            const int64_t rbase = row_base[r0 + r];
            if (rbase >= 0) put(rbase + n, scratch[r * 16 + cc]);
          }
        }
      } else {  // channels strided (NCHW output, grad_weight): 16 lanes write 16 rows of one channel
        const int r = lane & 15, cc = (lane >> 4) * 8;
        const int64_t rbase = row_base[r0 + r];
        if (rbase >= 0) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const int n = c0 + cc + e;
            if (n < a.N) put(rbase + int64_t(n) * a.c_sC, scratch[r * 16 + cc + e]);
          }
        }
      }
      __syncwarp();
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int pick_bn(int n) { return n > 64 ? 128 : n > 32 ? 64 : n > 16 ? 32 : 16; }

// The most shared memory an mma.sync tile of width BN takes, over the dtypes and GEMMs.
template <int BN>
constexpr int mma_tile_smem() {
  int bytes = std::max({Tile<float, BN, false>::SMEM_BYTES, Tile<float, BN, true>::SMEM_BYTES,
                        Tile<at::BFloat16, BN, false>::SMEM_BYTES, Tile<at::BFloat16, BN, true>::SMEM_BYTES});
  if constexpr (BN >= 32) bytes = std::max(bytes, Tile<float, BN, false, true>::SMEM_BYTES);  // K-major B: BN >= 32
  return bytes;
}
static_assert(mma_tile_smem<128>() == 110592 && mma_tile_smem<64>() == 82944, "tile sizes the docs quote");
int mma_tile_smem(int bn) {
  return bn == 128 ? mma_tile_smem<128>() : bn == 64 ? mma_tile_smem<64>() : bn == 32 ? mma_tile_smem<32>()
                                                                                      : mma_tile_smem<16>();
}

// The mma.sync kernels' tile width for a GEMM of N columns: 128-column tiles (up to 108 KB of shared memory)
// where a block may have that much (A100, H100), else at most 64 (<= 81 KB: the 99 KB of sm_86, sm_89, sm_120).
int pick_mma_bn(int n) {
  return std::min(pick_bn(n), current_device_caps().max_smem_per_block >= mma_tile_smem<128>() ? 128 : 64);
}

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
      if (m < a.M) {
        const int n = m / rows_hw, rem = m - n * rows_hw, my = rem / a.rows_W, mx = rem - my * a.rows_W;
        const int y0 = a.src_scale * my + a.src_off + py, x0 = a.src_scale * mx + a.src_off + px;
        row_off[i] = n * int(a.act_sN) + y0 * sH + x0 * sW;
        for (int t = 0; t < a.ntaps; ++t) {
          const int y = y0 + a.src_dir * (t >> a.taps_shift), x = x0 + a.src_dir * (t & (a.taps_w - 1));
          if (y >= 0 && y < a.act_H && x >= 0 && x < a.act_W) row_taps[i] |= 1u << t;
        }
      }
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

    // Main loop: tiles kt + 1, kt + 2 in flight while kt is multiplied. Tile kt + 2 goes into the stage that
    // tile kt - 1 used: every thread waited for its warpgroup's wgmma of kt - 1 before the barrier below.
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < ktiles) {
        load_a(s);
        load_b(s, s);
      }
      cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; ++kt) {
      cp_async_wait<kStages - 2>();
      mma::fence_proxy_async_shared();
      __syncthreads();
      const int s = kt % kStages;
      wgmma_conv_ktile<BN, kDirectB, kF16>(acc, sbase + s * T::STAGE_BYTES, wg);
      const int next = kt + kStages - 1;
      if (next < ktiles) {
        load_a(next % kStages);
        load_b(next % kStages, next);
      }
      cp_async_commit();
      mma::wgmma_wait<0>();
    }
    cp_async_wait<0>();
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

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < nk) {
        load_a(s, kt_begin + s);
        load_b(s, kt_begin + s);
      }
      cp_async_commit();
    }
    for (int i = 0; i < nk; ++i) {
      cp_async_wait<kStages - 2>();
      mma::fence_proxy_async_shared();
      __syncthreads();
      const int s = i % kStages;
      wgmma_wgrad_ktile<BN, kF16>(acc, sbase + s * T::STAGE_BYTES, wg);
      const int next = i + kStages - 1;
      if (next < nk) {
        load_a(next % kStages, kt_begin + next);
        load_b(next % kStages, kt_begin + next);
      }
      cp_async_commit();
      mma::wgmma_wait<0>();
    }
    cp_async_wait<0>();
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

// Whether the code loaded for this process's kernels is the sm_90a one (the file is compiled for sm_90 and
// sm_90a; which cubin the driver picks is its choice), so that wgmma_conv_kernel has its body.
__global__ void sm90a_probe_kernel(int* flag) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *flag = 1;
#else
  *flag = 0;
#endif
}

// Probed once per process (synchronously: not while the stream is being captured into a CUDA graph, where
// the mma.sync kernel is used until a probe has run outside a capture).
bool wgmma_available() {
  // Switch::wgmma off keeps the mma.sync kernels (same-process before / after timings, bisecting).
  if (!switch_on(Switch::wgmma)) return false;
  static std::atomic<int> state{-1};
  const int known = state.load();
  if (known >= 0) return known == 1;
  if (current_device_caps().compute_capability != 90) {
    state = 0;
    return false;
  }
  const auto stream = at::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return false;
  at::Tensor flag = at::empty({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA));
  sm90a_probe_kernel<<<1, 1, 0, stream>>>(flag.mutable_data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const bool ok = flag.item<int>() == 1;
  state = ok ? 1 : 0;
  return ok;
}

// The wgmma kernel's preconditions beyond GemmArgs' own (a_vec, b_vec: 16-byte copies; c_vec: 16-byte
// channels-innermost stores; no split): a 16-bit dtype and a tile width of 32..128. B is a fresh ATen
// allocation (16-byte aligned) in the K-major layout, packed by the caller once this says yes, or the forward's
// weight in place (forward_weight_in_place).
template <typename scalar_t>
bool wgmma_applies(const GemmArgs& a) {
  return !std::is_same_v<scalar_t, float> && a.a_vec && a.b_vec && a.c_vec && a.c_sC == 1 && !a.c_atomic &&
         a.splits == 1 && a.K % 8 == 0 && a.N > 16 && wgmma_available();
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

// Splits K when the output tiles alone cannot fill the GPU (two CTAs per SM), into as many splits as still fit
// in one wave (a wave and a few CTAs would cost two waves: 256->128 grad_weight had 9 x 32 CTAs on 264 slots),
// keeping >= 4 K-tiles (256 16-bit / 128 fp32 elements of K) per split (each split adds one fp32 atomic per
// output element). Grids of half a wave or more are not split (a split costs a zeroed workspace and atomics).
// fp32 plans for one CTA per SM: half the splits, so half the fp32 atomics and zeroed bytes of the split passes
// (batch 64 channels_last, forward + backward in a CUDA graph: 256->128 46.3 us against 54.6 planned for two,
// 128->64 48.2 against 55.3; NCHW 84.9 against 116.9, 92.2 against 121.5); 16-bit keeps two (bf16 batch 1024's
// grad_weight with half the CTAs: 256->128 164 us against 127). HIERPAR_K4S2P1_SPLIT_TARGET=n plans for n CTAs per SM instead (same-process timings).
// Sets a.splits / a.ktiles_per_split and returns whether the result must be accumulated atomically.
template <typename scalar_t>
bool plan_splits(GemmArgs& a, int phases, bool always_split) {
  constexpr int BK = 128 / int(sizeof(scalar_t));
  const int bn = pick_mma_bn(a.N);
  const int64_t tiles = int64_t((a.M + 127) / 128) * ((a.N + bn - 1) / bn) * phases;
  const int ktiles = (a.K + BK - 1) / BK;
  const std::optional<int64_t> planned_per_sm = knob(Knob::k4s2p1_split_target);
  const DeviceCaps& caps = current_device_caps();
  // Never more CTAs per SM than its shared memory holds (one 128-wide tile per SM on an A100).
  const int per_sm = std::max(1, std::min(planned_per_sm                    ? static_cast<int>(*planned_per_sm)
                                          : std::is_same_v<scalar_t, float> ? 1
                                                                            : 2,
                                          caps.smem_per_multiprocessor / mma_tile_smem(bn)));
  const int64_t target = per_sm * int64_t(caps.multiprocessors);
  int splits = 1;
  if (2 * tiles <= target || always_split)
    splits = int(std::max<int64_t>(1, std::min<int64_t>(target / tiles, std::max(1, ktiles / 4))));
  splits = std::min(splits, 65535 / phases);
  a.ktiles_per_split = (ktiles + splits - 1) / splits;
  a.splits = std::max(1, (ktiles + a.ktiles_per_split - 1) / a.ktiles_per_split);
  return always_split || a.splits > 1;
}

// b_kmajor: B is K-major [N][K] (fp32 convolutions with 16-byte copies and tiles of >= 32 columns only).
template <typename scalar_t, int BN, bool kWgrad>
void launch_tile(const GemmArgs& a, const dim3& grid, cudaStream_t stream, bool b_kmajor) {
  auto go = [&](auto kernel, int smem) {
    // Above the 48 KB default: opt in (per device, so on every call; it is a cheap attribute write).
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<grid, kThreads, smem, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if constexpr (std::is_same_v<scalar_t, float> && !kWgrad && BN >= 32) {
    if (b_kmajor) {
      TORCH_INTERNAL_ASSERT(a.a_vec && a.b_vec, "conv_transpose2d: K-major B needs 16-byte copies");
      go(implicit_gemm_kernel<float, BN, false, true, true>, Tile<float, BN, false, true>::SMEM_BYTES);
      return;
    }
  }
  TORCH_INTERNAL_ASSERT(!b_kmajor, "conv_transpose2d: no K-major-B kernel for this GEMM");
  constexpr int smem = Tile<scalar_t, BN, kWgrad>::SMEM_BYTES;
  go(a.a_vec && a.b_vec ? implicit_gemm_kernel<scalar_t, BN, kWgrad, true>
                        : implicit_gemm_kernel<scalar_t, BN, kWgrad, false>,
     smem);
}

template <typename scalar_t, bool kWgrad>
void launch(const GemmArgs& a, int phases, bool b_kmajor = false) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const int bn = pick_mma_bn(a.N);
  const dim3 grid((a.M + 127) / 128, (a.N + bn - 1) / bn, phases * a.splits);
  switch (bn) {
    case 128: launch_tile<scalar_t, 128, kWgrad>(a, grid, stream, b_kmajor); break;
    case 64: launch_tile<scalar_t, 64, kWgrad>(a, grid, stream, b_kmajor); break;
    case 32: launch_tile<scalar_t, 32, kWgrad>(a, grid, stream, b_kmajor); break;
    default: launch_tile<scalar_t, 16, kWgrad>(a, grid, stream, b_kmajor); break;
  }
}

// grad_weight on wgmma: 16-bit operands with 16-byte copies (C_out % 8, C_in % 8) and C_in > 32 (one tile
// of 64 or 128 channels); the K splits are summed in a dense fp32 [16 C_out][C_in] workspace (with one counter
// per output tile after it) and written to grad_weight by each tile's last CTA.
template <typename scalar_t>
bool wgmma_wgrad_applies(const GemmArgs& a) {
  return !std::is_same_v<scalar_t, float> && a.a_vec && a.b_vec && a.N > 32 && wgmma_available();
}

int wgmma_wgrad_bn(const GemmArgs& a) { return a.N > 64 ? 128 : 64; }
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

// Zeroes a dense tensor (split-K accumulation target) with one memset, no ATen op.
void zero_dense(const at::Tensor& t) {
  C10_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.numel() * t.element_size(), at::cuda::getCurrentCUDAStream()));
}

// Forward weight per phase: packed[py, px][ty, tx, ci][co] = w[ci, co, 1 - py + 2ty, 1 - px + 2tx] for the
// mma.sync kernel ([K, N]), or packed[py, px][co][ty, tx, ci] when k_major (the wgmma kernel's [N, K]).
template <typename scalar_t>
__global__ void pack_forward_weight_kernel(const scalar_t* __restrict__ w, int64_t s0, int64_t s1, int64_t s2,
                                           int64_t s3, int cin, int cout, bool k_major,
                                           scalar_t* __restrict__ packed) {
  const int total = 16 * cin * cout;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
    int co, ci, tap, phase;
    if (k_major) {
      ci = i % cin;
      const int r = i / cin;
      tap = r % 4;
      co = (r / 4) % cout;
      phase = r / (4 * cout);
    } else {
      co = i % cout;
      const int r = i / cout;
      ci = r % cin;
      tap = (r / cin) % 4;
      phase = r / (4 * cin);
    }
    const int ky = 1 - (phase >> 1) + 2 * (tap >> 1), kx = 1 - (phase & 1) + 2 * (tap & 1);
    packed[i] = w[ci * s0 + co * s1 + ky * s2 + kx * s3];
  }
}

// Dense NHWC strides of a [N, C, H, W] tensor with the given layout, as (sN, sH, sW, sC).
struct Strides {
  int64_t n, h, w, c;
};
Strides dense_strides(int64_t c, int64_t h, int64_t w, bool channels_last) {
  return channels_last ? Strides{h * w * c, w * c, c, 1} : Strides{c * h * w, w, 1, h * w};
}

template <typename scalar_t>
void set_output(GemmArgs& a, void* ptr, const Strides& s, bool atomic) {
  a.c = ptr;
  a.c_sN = s.n;
  a.c_sH = s.h;
  a.c_sW = s.w;
  a.c_sC = s.c;
  a.c_atomic = atomic;
  a.c_vec = !atomic && s.c == 1 && a.N % 8 == 0 && aligned16(ptr);
  a.c_atomic4 = atomic && s.c == 1 && a.N % 4 == 0 && aligned16(ptr);
}

// The activation `t` (dense channels_last, [N, C, H, W]) as the gathered operand.
template <typename scalar_t>
void set_activation(GemmArgs& a, const at::Tensor& t) {
  constexpr int VEC = 16 / int(sizeof(scalar_t));
  const int64_t c = t.size(1), h = t.size(2), w = t.size(3);
  a.act = t.const_data_ptr<scalar_t>();
  a.act_sN = h * w * c;
  a.act_sH = w * c;
  a.act_sW = c;
  a.act_H = int(h);
  a.act_W = int(w);
  a.act_C = int(c);
  a.a_vec = c % VEC == 0 && aligned16(a.act);
}

// The all-phases forward: 16-bit, C_in % 64 == 0, 8 <= C_out <= 32 with C_out % 8 == 0, a channels_last
// output. HIERPAR_WGMMA_ALL_PHASES=0 uses the one-phase-per-CTA kernel instead (same-process timings).
template <typename scalar_t>
bool wgmma_all_phases_applies(const ConvTranspose2dGeometry& g, const at::Tensor& x, const at::Tensor& out,
                              bool out_channels_last) {
  if (std::is_same_v<scalar_t, float> || g.in_channels % 64 != 0 || g.out_channels % 8 != 0 ||
      g.out_channels > 32 || !out_channels_last || !aligned16(out.data_ptr()) || !aligned16(x.data_ptr()))
    return false;
  return switch_on(Switch::wgmma_all_phases) && wgmma_available();
}

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
    GemmArgs a{};
    a.M = int(g.in_pixels());
    a.N = cout;
    a.K = 9 * cin;
    set_activation<scalar_t>(a, x);
    a.rows_H = int(g.in_h);
    a.rows_W = int(g.in_w);
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

// The grad_input patch kernel: 16-bit, C_out == 32, C_in % 64 == 0, a channels_last grad_input.
// HIERPAR_WGMMA_GRAD_INPUT_PATCH=0 uses wgmma_conv_kernel instead (same-process timings).
template <typename scalar_t>
bool wgmma_grad_input_patch_applies(const ConvTranspose2dGeometry& g, const at::Tensor& go,
                                    const at::Tensor& grad_input, bool grad_input_channels_last) {
  if (std::is_same_v<scalar_t, float> || g.out_channels != 32 || g.in_channels % 64 != 0 ||
      !grad_input_channels_last || !aligned16(grad_input.data_ptr()) || !aligned16(go.data_ptr()))
    return false;
  return switch_on(Switch::wgmma_grad_input_patch) && wgmma_available();
}

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
    GemmArgs a{};
    set_activation<scalar_t>(a, go);
    a.rows_H = int(g.in_h);
    a.rows_W = int(g.in_w);
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

// Whether the forward reads B straight from the weight (GemmArgs' b_ld / b_sky / b_skx) instead of a packed copy:
// C_out innermost (a channels_last weight) with 16-byte-aligned rows, and K-tiles that lie in one tap (C_in a
// multiple of the K-tile); on wgmma also whole 64-column blocks (C_out > 32). The pack kernel this spares runs
// before the GEMM on the same stream (256->128: 5 us at batch 1024 bf16, 3.9 us at batch 64 fp32).
// HIERPAR_K4S2P1_WEIGHT_IN_PLACE=0 packs as before (same-process timings; also fp32 grad_input's weight copy).
bool weight_in_place_enabled() { return switch_on(Switch::k4s2p1_weight_in_place); }

template <typename scalar_t>
bool forward_weight_in_place(const at::Tensor& weight, int cin, int cout, bool wgmma) {
  constexpr int VEC = 16 / int(sizeof(scalar_t)), BK = 128 / int(sizeof(scalar_t));
  return weight_in_place_enabled() && weight.stride(1) == 1 && cout % VEC == 0 && cin % BK == 0 &&
         weight.stride(0) % VEC == 0 && weight.stride(2) % VEC == 0 && weight.stride(3) % VEC == 0 &&
         aligned16(weight.const_data_ptr()) && (!wgmma || pick_bn(cout) >= 64);
}

// Calls f(scalar_t{}) for the fast path's dtypes.
template <typename F>
void dispatch_fast(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    default: TORCH_CHECK(false, "conv_transpose2d: the k4s2p1 fast path has no ", dtype, " kernel");
  }
}

}  // namespace

bool k4s2p1_fast_path_applies(const ConvTranspose2dGeometry& g, at::ScalarType dtype) {
  const bool shape = g.kernel_h == 4 && g.kernel_w == 4 && g.stride_h == 2 && g.stride_w == 2 && g.pad_h == 1 &&
                     g.pad_w == 1 && g.dilation_h == 1 && g.dilation_w == 1 && g.groups == 1 &&
                     g.out_h == 2 * g.in_h && g.out_w == 2 * g.in_w;
  // C_out < 16: the forward's GEMM N is under one 16-wide tile and the general path measured faster
  // (32->3 at batch 1024 bf16: 1035 us general vs 1881 us here; batch 64 fp32: 116 vs 213 us).
  if (!shape || g.out_channels < 16) return false;
  // mma.sync and cp.async (code for sm_80+), and room for the 64-wide tiles.
  const DeviceCaps& caps = current_device_caps();
  if (!caps.ampere_instructions() || caps.max_smem_per_block < mma_tile_smem<64>()) return false;
  // 32-bit element indices within a tensor (offsets are 64-bit, pixel and channel counts are int).
  const int64_t biggest = std::max(g.in_pixels() * g.in_channels, g.in_pixels() * 4 * g.out_channels);
  if (biggest >= INT_MAX || 16 * std::max(g.in_channels, g.out_channels) >= INT_MAX) return false;
  if (dtype == at::kFloat) return at::globalContext().allowTF32CuDNN(at::Float32Op::CONV);
  return dtype == at::kBFloat16 || dtype == at::kHalf;
}

void k4s2p1_forward(const ConvTranspose2dGeometry& g, const at::Tensor& input4, const at::Tensor& weight,
                    const at::Tensor& out, bool out_channels_last) {
  c10::cuda::CUDAGuard device_guard(input4.device());
  const at::Tensor x = contiguous_as(input4, at::MemoryFormat::ChannelsLast);
  const int cin = int(g.in_channels), cout = int(g.out_channels);
  dispatch_fast(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    if (wgmma_all_phases_applies<scalar_t>(g, x, out, out_channels_last)) {
      launch_wgmma_all_phases<scalar_t>(g, x, weight, out);
    } else {
      constexpr int VEC = 16 / int(sizeof(scalar_t));
      auto stream = at::cuda::getCurrentCUDAStream();

      GemmArgs a{};
      a.M = int(g.in_pixels());
      a.N = cout;
      a.K = 4 * cin;
      set_activation<scalar_t>(a, x);
      a.rows_H = int(g.in_h);
      a.rows_W = int(g.in_w);
      a.taps_w = 2;
      a.taps_shift = 1;
      a.ntaps = 4;
      a.src_scale = 1;
      a.src_off = 0;  // + phase
      a.src_dir = -1;
      a.b_vec = cout % VEC == 0;
      a.dst_scale = 2;
      const bool split = plan_splits<scalar_t>(a, 4, false);
      at::Tensor ws;
      if (split && std::is_same_v<scalar_t, float>) {  // fp32: the K splits add straight into the output
        zero_dense(out);
        set_output<scalar_t>(a, out.data_ptr(), dense_strides(cout, g.out_h, g.out_w, out_channels_last), true);
      } else if (split) {
        ws = at::empty({g.batch, g.out_channels, g.out_h, g.out_w}, out.options().dtype(at::kFloat),
                       at::MemoryFormat::ChannelsLast);
        zero_dense(ws);
        set_output<scalar_t>(a, ws.data_ptr<float>(), dense_strides(cout, g.out_h, g.out_w, true), true);
      } else {
        set_output<scalar_t>(a, out.mutable_data_ptr<scalar_t>(),
                             dense_strides(cout, g.out_h, g.out_w, out_channels_last), false);
      }
      const bool wgmma = wgmma_applies<scalar_t>(a);
      at::Tensor packed;
      if (forward_weight_in_place<scalar_t>(weight, cin, cout, wgmma)) {
        a.b = weight.const_data_ptr<scalar_t>();
        a.b_phase_stride = 0;
        a.b_ld = weight.stride(0);
        a.b_sky = weight.stride(2);
        a.b_skx = weight.stride(3);
        a.b_rows_per_tap = cin;
      } else {
        packed = at::empty({4, 4 * cin, cout}, weight.options());
        a.b = packed.const_data_ptr<scalar_t>();
        a.b_phase_stride = int64_t(4) * cin * cout;
        a.b_ld = cout;
        a.b_rows_per_tap = 4 * cin;
        const int total = 16 * cin * cout;
        pack_forward_weight_kernel<scalar_t><<<std::min((total + 255) / 256, 1024), 256, 0, stream>>>(
            weight.const_data_ptr<scalar_t>(), weight.stride(0), weight.stride(1), weight.stride(2), weight.stride(3),
            cin, cout, wgmma, packed.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      if (wgmma)
        launch_wgmma<scalar_t>(a, 4, !packed.defined());
      else
        launch<scalar_t, false>(a, 4);
      if (ws.defined()) permute_copy_(out, ws);
    }
  });
}

void k4s2p1_backward(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4, const at::Tensor& input4,
                     const at::Tensor& weight, const at::Tensor& grad_input, bool grad_input_channels_last,
                     const at::Tensor& grad_weight) {
  c10::cuda::CUDAGuard device_guard(grad_output4.device());
  // grad_output, and the input where grad_weight needs it, channels_last: both by one launch.
  const std::array<at::Tensor, 2> activations = contiguous_as(
      grad_output4, grad_weight.defined() ? input4 : at::Tensor(), at::MemoryFormat::ChannelsLast);
  const at::Tensor& go = activations[0];
  const int cin = int(g.in_channels), cout = int(g.out_channels);
  dispatch_fast(go.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    {
      constexpr int VEC = 16 / int(sizeof(scalar_t));
      GemmArgs common{};
      set_activation<scalar_t>(common, go);
      common.taps_w = 4;
      common.taps_shift = 2;
      common.ntaps = 16;
      common.src_scale = 2;
      common.src_off = -1;
      common.src_dir = 1;
      common.rows_H = int(g.in_h);
      common.rows_W = int(g.in_w);
      if (grad_input.defined() &&
          wgmma_grad_input_patch_applies<scalar_t>(g, go, grad_input, grad_input_channels_last)) {
        launch_wgmma_grad_input_patch<scalar_t>(g, go, weight, grad_input);
      } else if (grad_input.defined()) {
        GemmArgs a = common;
        a.M = int(g.in_pixels());
        a.N = cin;
        a.K = 16 * cout;
        a.b_phase_stride = 0;
        a.b_vec = cin % VEC == 0;
        a.dst_scale = 1;
        const bool split = plan_splits<scalar_t>(a, 1, false);
        at::Tensor ws;
        if (split && std::is_same_v<scalar_t, float>) {
          zero_dense(grad_input);
          set_output<scalar_t>(a, grad_input.data_ptr(),
                               dense_strides(cin, g.in_h, g.in_w, grad_input_channels_last), true);
        } else if (split) {
          ws = at::empty({g.batch, g.in_channels, g.in_h, g.in_w}, go.options().dtype(at::kFloat),
                         at::MemoryFormat::ChannelsLast);
          zero_dense(ws);
          set_output<scalar_t>(a, ws.data_ptr<float>(), dense_strides(cin, g.in_h, g.in_w, true), true);
        } else {
          set_output<scalar_t>(a, grad_input.mutable_data_ptr<scalar_t>(),
                               dense_strides(cin, g.in_h, g.in_w, grad_input_channels_last), false);
        }
        // B[(ky, kx, co), ci] = w[ci, co, ky, kx] ([K, N]), or its transpose [ci][(ky, kx, co)] for wgmma and,
        // where that is the weight's own memory (channels_last), for fp32: no copy of the weight (4.9 us before
        // the 256->128 grad_input at batch 64 fp32).
        const bool wgmma = wgmma_applies<scalar_t>(a);
        const bool b_kmajor = std::is_same_v<scalar_t, float> && weight_in_place_enabled() && a.a_vec && a.b_vec &&
                              pick_bn(cin) >= 32 && weight.permute({0, 2, 3, 1}).is_contiguous() &&
                              aligned16(weight.const_data_ptr());
        const at::Tensor wt = contiguous_as(
            weight.permute(wgmma || b_kmajor ? at::IntArrayRef{0, 2, 3, 1} : at::IntArrayRef{2, 3, 1, 0}),
            at::MemoryFormat::Contiguous);
        a.b = wt.const_data_ptr<scalar_t>();
        a.b_ld = wgmma || b_kmajor ? a.K : a.N;
        a.b_rows_per_tap = a.K;
        if (wgmma)
          launch_wgmma<scalar_t>(a, 1, false);
        else
          launch<scalar_t, false>(a, 1, b_kmajor);
        if (ws.defined()) permute_copy_(grad_input, ws);
      }
      if (grad_weight.defined()) {
        const at::Tensor& x = activations[1];
        GemmArgs a = common;
        a.M = 16 * cout;
        a.N = cin;
        a.K = int(g.in_pixels());
        a.b = x.const_data_ptr<scalar_t>();
        a.b_phase_stride = 0;
        a.b_ld = cin;
        a.b_rows_per_tap = a.K;
        a.b_vec = cin % VEC == 0 && aligned16(a.b);
        plan_splits<scalar_t>(a, 1, true);
        // gw^T[(ky, kx, co), ci], accumulated in fp32 over the K splits: straight into an fp32 grad_weight
        // whose output channels are innermost (channels_last: row (ky, kx, co) at co + ky*s2 + kx*s3, column
        // ci at stride s0; the 16 rows a half-warp adds to are consecutive); on wgmma (16-bit) in an fp32
        // workspace plus one counter per output tile (one memset) that the kernel itself writes to grad_weight
        // from; else into the dense fp32 workspace [ky, kx, co, ci] (16-byte atomics along ci) and then one
        // transposing copy into grad_weight. An NCHW weight written in place puts those 16 rows 16 elements
        // apart, one sector per atomic: the 256->128 layer's grad_weight took 61 us against 17 us for the same
        // GEMM with a channels_last weight (H200).
        const bool wgmma = wgmma_wgrad_applies<scalar_t>(a);
        at::Tensor ws;
        if (std::is_same_v<scalar_t, float> && grad_weight.stride(1) == 1) {
          zero_dense(grad_weight);
          set_output<scalar_t>(a, grad_weight.data_ptr(),
                               Strides{grad_weight.stride(1), grad_weight.stride(2), grad_weight.stride(3),
                                       grad_weight.stride(0)},
                               true);
        } else if (wgmma) {
          set_output<scalar_t>(a, grad_weight.data_ptr(),
                               Strides{grad_weight.stride(1), grad_weight.stride(2), grad_weight.stride(3),
                                       grad_weight.stride(0)},
                               false);
          if (a.splits > 1) {
            ws = at::empty({int64_t(a.M) * a.N + wgmma_wgrad_tiles(a)}, go.options().dtype(at::kFloat));
            zero_dense(ws);
            a.ws = ws.data_ptr<float>();
            a.tile_done = reinterpret_cast<unsigned*>(a.ws + int64_t(a.M) * a.N);
          }
        } else {
          ws = at::empty({4, 4, g.out_channels, g.in_channels}, go.options().dtype(at::kFloat));
          zero_dense(ws);
          set_output<scalar_t>(a, ws.data_ptr<float>(), Strides{cin, int64_t(4) * cout * cin, int64_t(cout) * cin, 1},
                               true);
        }
        if (wgmma) {
          launch_wgmma_wgrad<scalar_t>(a);
        } else {
          launch<scalar_t, true>(a, 1);
          if (ws.defined()) permute_copy_(grad_weight, ws.permute({3, 2, 0, 1}));
        }
      }
    }
  });
}

}  // namespace hierpar::detail
