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
// one is copied to channels_last first (one ATen copy; stock cuDNN converts too). Outputs are written
// straight in the caller's layout by the epilogue (NCHW or NHWC), so there is no conversion on the way out.
// Grids too small to fill the GPU split K and accumulate in an fp32 workspace (then one copy to the output).
//
// Tiles: 128 x BN x (64 16-bit | 32 fp32 elements: 128 bytes of K), BN in {128, 64, 32, 16} chosen from the
// GEMM's N, 8 warps (warp tiles 64x32 at BN = 128). Mainloop: a 3-stage cp.async pipeline in dynamic shared
// memory (105 KB at most: two CTAs per SM; 16-byte copies, zero-filled at the borders through a source size of
// 0), fragments read with ldmatrix (.trans for the N- or M-contiguous operands) and multiplied with mma.sync
// (bf16/fp16 m16n8k16, TF32 m16n8k8; fp32 accumulation). Rows are padded so ldmatrix and the fp32 scalar
// fragment loads are free of bank conflicts. The gather addresses are set up once per CTA (per M row: source
// offset and a bit mask of the taps inside the image) and stepped per K-tile, with no integer division in the
// mainloop (Nsight Compute on the earlier per-copy divisions: 10.7 issued instructions per MMA, the XU pipe at
// 14-25% and the tensor pipe at 11-27%). Channel counts that allow no 16-byte copy (not a multiple of 8 for
// 16-bit, 4 for fp32) are loaded with scalar loads into the same stages (synchronously), so any channel count
// is handled.
#include "common.h"
#include "cuda/conv_transpose_k4s2p1.h"
#include "cuda/mma.cuh"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>
#include <type_traits>

namespace hierpar::detail {
namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr int kStages = 3;

template <typename scalar_t, int BN_, bool kWgrad>
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
  static constexpr int LDB = BN + 8;
  static constexpr int B_ELEMS = BK * LDB;
  static constexpr int STAGE_BYTES = (A_ELEMS + B_ELEMS) * ESZ;
  static constexpr int SMEM_BYTES = kStages * STAGE_BYTES;  // <= 105 KB: two CTAs per SM
  static_assert(MI >= 1 && NI >= 2 && NI % 2 == 0 && WM * WARP_M == BM && WN * WARP_N == BN, "warp tiling");
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
  const void* b;  // row-major [K, N] (per phase for the forward), leading dimension N
  int64_t b_phase_stride;
  void* c;  // scalar_t, or float when c_atomic
  // Convolutions: output pixel (n, y, x) at n*c_sN + y*c_sH + x*c_sW, channel stride c_sC.
  // grad_weight: row m = (ky, kx, co) at co*c_sN + ky*c_sH + kx*c_sW, column (ci) stride c_sC.
  int64_t c_sN, c_sH, c_sW, c_sC;
  int dst_scale;  // output pixel = dst_scale * row pixel + phase
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

// kVec: a.a_vec and a.b_vec hold, so the kernel has only the 16-byte-copy paths (no scalar fallback code in
// the mainloop: fewer instructions, no branches, a smaller instruction footprint).
// Two CTAs per SM (128 registers); three for BN <= 32 (70 KB of shared memory, <= 80 registers), which have
// short K loops (64->32 forward: K = 256) and gain from a third CTA covering the pipeline fill and epilogue.
template <typename scalar_t, int BN, bool kWgrad, bool kVec>
__global__ void __launch_bounds__(kThreads, BN <= 32 ? 3 : 2) implicit_gemm_kernel(const GemmArgs a) {
  using T = Tile<scalar_t, BN, kWgrad>;
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
  int pix_nb[kWgrad ? A_ITERS : 1], pix_y[kWgrad ? A_ITERS : 1], pix_x[kWgrad ? A_ITERS : 1];
  int step_x = 0, step_y = 0, step_nb = 0;
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
    for (int i = 0; i < A_ITERS; ++i) {
      const int p = kt_begin * BK + a_r + i * A_ROWS_PER_PASS;
      const int n = p / rows_hw, rem = p - n * rows_hw;
      pix_nb[i] = n * int(a.act_sN);
      pix_y[i] = rem / a.rows_W;
      pix_x[i] = rem - pix_y[i] * a.rows_W;
    }
    step_x = BK % a.rows_W;
    step_y = (BK / a.rows_W) % a.rows_H;
    step_nb = (BK / rows_hw) * int(a.act_sN);
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
        const int y0 = a.src_scale * pix_y[i] + a.src_off, x0 = a.src_scale * pix_x[i] + a.src_off;
        if (kVec || a.a_vec) {
          const int y = y0 + a.src_dir * w_ty, x = x0 + a.src_dir * w_tx;
          const bool ok = p_ok && w_valid && in_src(y, x);
          cp_async16(dst, ok ? act + (pix_nb[i] + y * sH + x * sW + w_c) : act, ok);
        } else {
          uint4 v = make_uint4(0, 0, 0, 0);
          bits* e = reinterpret_cast<bits*>(&v);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const int m = m0 + a_v * VEC + j;
            if (p_ok && m < a.M) {
              const int t = m / a.act_C, c = m - t * a.act_C, ty = t >> a.taps_shift, tx = t & (a.taps_w - 1);
              const int y = y0 + a.src_dir * ty, x = x0 + a.src_dir * tx;
              if (in_src(y, x)) e[j] = act[pix_nb[i] + y * sH + x * sW + c];
            }
          }
          *reinterpret_cast<uint4*>(dst) = v;
        }
        // Next K-tile: BK pixels further (step_x < rows_W and step_y < rows_H, so one carry each).
        pix_x[i] += step_x;
        if (pix_x[i] >= a.rows_W) {
          pix_x[i] -= a.rows_W;
          ++pix_y[i];
        }
        pix_y[i] += step_y;
        if (pix_y[i] >= a.rows_H) {
          pix_y[i] -= a.rows_H;
          pix_nb[i] += int(a.act_sN);
        }
        pix_nb[i] += step_nb;
      }
    }
  };

  // ---- B: a row-major [K, N] matrix (prepacked weight, or the dense NHWC input for grad_weight) ----------
  // A thread copies the same column vector of rows b_kr, b_kr + B_ROWS_PER_PASS, ... of every K-tile.
  constexpr int B_VPR = BN / VEC;
  constexpr int B_VECS = BK * B_VPR;
  constexpr int B_ITERS = (B_VECS + kThreads - 1) / kThreads;
  constexpr int B_ROWS_PER_PASS = kThreads / B_VPR;
  static_assert(kThreads % B_VPR == 0, "B tile mapping");
  const int b_kr = tid / B_VPR, b_col = (tid % B_VPR) * VEC, b_n = n0 + b_col;
  const bool b_n_ok = b_n < a.N;
  auto load_b = [&](int s, int kt) {
    bits* Bs = b_stage(s);
    const bits* tile = bmat + int64_t(kt) * BK * a.N;
    const int rows_left = a.K - kt * BK;
#pragma unroll
    for (int i = 0; i < B_ITERS; ++i) {
      const int kr = b_kr + i * B_ROWS_PER_PASS;
      if (B_VECS % kThreads != 0 && kr >= BK) continue;
      bits* dst = Bs + kr * T::LDB + b_col;
      const bits* row = tile + kr * a.N;
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
            atomicAdd(reinterpret_cast<float4*>(c_acc + rbase + n), make_float4(v[0], v[1], v[2], v[3]));
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

// Splits K when the output tiles alone cannot fill the GPU (two CTAs per SM), into as many splits as still fit
// in one wave (a wave and a few CTAs would cost two waves: 256->128 grad_weight had 9 x 32 CTAs on 264 slots),
// keeping >= 4 K-tiles (256 16-bit / 128 fp32 elements of K) per split (each split adds one fp32 atomic per
// output element). Grids of half a wave or more are not split (a split costs a zeroed workspace and atomics).
// Sets a.splits / a.ktiles_per_split and returns whether the result must be accumulated atomically.
template <typename scalar_t>
bool plan_splits(GemmArgs& a, int phases, bool always_split) {
  constexpr int BK = 128 / int(sizeof(scalar_t));
  const int64_t tiles = int64_t((a.M + 127) / 128) * ((a.N + pick_bn(a.N) - 1) / pick_bn(a.N)) * phases;
  const int ktiles = (a.K + BK - 1) / BK;
  const int64_t target = 2 * int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  int splits = 1;
  if (2 * tiles <= target || always_split)
    splits = int(std::max<int64_t>(1, std::min<int64_t>(target / tiles, std::max(1, ktiles / 4))));
  splits = std::min(splits, 65535 / phases);
  a.ktiles_per_split = (ktiles + splits - 1) / splits;
  a.splits = std::max(1, (ktiles + a.ktiles_per_split - 1) / a.ktiles_per_split);
  return always_split || a.splits > 1;
}

template <typename scalar_t, int BN, bool kWgrad>
void launch_tile(const GemmArgs& a, const dim3& grid, cudaStream_t stream) {
  constexpr int smem = Tile<scalar_t, BN, kWgrad>::SMEM_BYTES;
  auto kernel = a.a_vec && a.b_vec ? implicit_gemm_kernel<scalar_t, BN, kWgrad, true>
                                   : implicit_gemm_kernel<scalar_t, BN, kWgrad, false>;
  // Above the 48 KB default: opt in (per device, so on every call; it is a cheap attribute write).
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kThreads, smem, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, bool kWgrad>
void launch(const GemmArgs& a, int phases) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid((a.M + 127) / 128, (a.N + pick_bn(a.N) - 1) / pick_bn(a.N), phases * a.splits);
  switch (pick_bn(a.N)) {
    case 128: launch_tile<scalar_t, 128, kWgrad>(a, grid, stream); break;
    case 64: launch_tile<scalar_t, 64, kWgrad>(a, grid, stream); break;
    case 32: launch_tile<scalar_t, 32, kWgrad>(a, grid, stream); break;
    default: launch_tile<scalar_t, 16, kWgrad>(a, grid, stream); break;
  }
}

// Zeroes a dense tensor (split-K accumulation target) with one memset, no ATen op.
void zero_dense(const at::Tensor& t) {
  C10_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.numel() * t.element_size(), at::cuda::getCurrentCUDAStream()));
}

// Forward weight per phase: packed[py, px][ty, tx, ci][co] = w[ci, co, 1 - py + 2ty, 1 - px + 2tx].
template <typename scalar_t>
__global__ void pack_forward_weight_kernel(const scalar_t* __restrict__ w, int64_t s0, int64_t s1, int64_t s2,
                                           int64_t s3, int cin, int cout, scalar_t* __restrict__ packed) {
  const int total = 16 * cin * cout;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
    const int co = i % cout, r = i / cout, ci = r % cin, tap = (r / cin) % 4, phase = r / (4 * cin);
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
  // 32-bit element indices within a tensor (offsets are 64-bit, pixel and channel counts are int).
  const int64_t biggest = std::max(g.in_pixels() * g.in_channels, g.in_pixels() * 4 * g.out_channels);
  if (biggest >= INT_MAX || 16 * std::max(g.in_channels, g.out_channels) >= INT_MAX) return false;
  if (dtype == at::kFloat) return at::globalContext().allowTF32CuDNN(at::Float32Op::CONV);
  return dtype == at::kBFloat16 || dtype == at::kHalf;
}

void k4s2p1_forward(const ConvTranspose2dGeometry& g, const at::Tensor& input4, const at::Tensor& weight,
                    const at::Tensor& out, bool out_channels_last) {
  c10::cuda::CUDAGuard device_guard(input4.device());
  const at::Tensor x = input4.contiguous(at::MemoryFormat::ChannelsLast);
  const int cin = int(g.in_channels), cout = int(g.out_channels);
  dispatch_fast(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    {
      constexpr int VEC = 16 / int(sizeof(scalar_t));
      auto stream = at::cuda::getCurrentCUDAStream();
      at::Tensor packed = at::empty({4, 4 * cin, cout}, weight.options());
      const int total = 16 * cin * cout;
      pack_forward_weight_kernel<scalar_t><<<std::min((total + 255) / 256, 1024), 256, 0, stream>>>(
          weight.const_data_ptr<scalar_t>(), weight.stride(0), weight.stride(1), weight.stride(2), weight.stride(3),
          cin, cout, packed.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();

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
      a.b = packed.const_data_ptr<scalar_t>();
      a.b_phase_stride = int64_t(4) * cin * cout;
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
      launch<scalar_t, false>(a, 4);
      if (ws.defined()) out.copy_(ws);
    }
  });
}

void k4s2p1_backward(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4, const at::Tensor& input4,
                     const at::Tensor& weight, const at::Tensor& grad_input, bool grad_input_channels_last,
                     const at::Tensor& grad_weight) {
  c10::cuda::CUDAGuard device_guard(grad_output4.device());
  const at::Tensor go = grad_output4.contiguous(at::MemoryFormat::ChannelsLast);
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
      if (grad_input.defined()) {
        // B[(ky, kx, co), ci] = w[ci, co, ky, kx].
        const at::Tensor wt = weight.permute({2, 3, 1, 0}).contiguous();
        GemmArgs a = common;
        a.M = int(g.in_pixels());
        a.N = cin;
        a.K = 16 * cout;
        a.b = wt.const_data_ptr<scalar_t>();
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
        launch<scalar_t, false>(a, 1);
        if (ws.defined()) grad_input.copy_(ws);
      }
      if (grad_weight.defined()) {
        const at::Tensor x = input4.contiguous(at::MemoryFormat::ChannelsLast);
        GemmArgs a = common;
        a.M = 16 * cout;
        a.N = cin;
        a.K = int(g.in_pixels());
        a.b = x.const_data_ptr<scalar_t>();
        a.b_phase_stride = 0;
        a.b_vec = cin % VEC == 0 && aligned16(a.b);
        plan_splits<scalar_t>(a, 1, true);
        // gw^T[(ky, kx, co), ci], accumulated in fp32 over the K splits: straight into an fp32 grad_weight
        // (row (ky, kx, co) at co*s1 + ky*s2 + kx*s3, column ci at stride s0), else into an fp32 workspace.
        at::Tensor ws;
        if constexpr (std::is_same_v<scalar_t, float>) {
          zero_dense(grad_weight);
          set_output<scalar_t>(a, grad_weight.data_ptr(),
                               Strides{grad_weight.stride(1), grad_weight.stride(2), grad_weight.stride(3),
                                       grad_weight.stride(0)},
                               true);
        } else {
          ws = at::empty({4, 4, g.out_channels, g.in_channels}, go.options().dtype(at::kFloat));
          zero_dense(ws);
          set_output<scalar_t>(a, ws.data_ptr<float>(), Strides{cin, int64_t(4) * cout * cin, int64_t(cout) * cin, 1},
                               true);
        }
        launch<scalar_t, true>(a, 1);
        if (ws.defined()) grad_weight.copy_(ws.permute({3, 2, 0, 1}));
      }
    }
  });
}

}  // namespace hierpar::detail
