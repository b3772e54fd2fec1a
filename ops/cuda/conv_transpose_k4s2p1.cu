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
// Tiles: 128 x BN x (32 16-bit | 16 fp32 elements), BN in {128, 64, 32, 16} chosen from the GEMM's N, 8 warps
// (warp tiles 64x32 at BN = 128). Mainloop: a 4-stage cp.async pipeline in dynamic shared memory (16-byte
// copies, zero-filled at the borders through a source size of 0), fragments read with ldmatrix (.trans for the
// N- or M-contiguous operands) and multiplied with mma.sync (bf16/fp16 m16n8k16, TF32 m16n8k8; fp32
// accumulation). Rows are padded so ldmatrix and the fp32 scalar fragment loads are free of bank conflicts.
// Channel counts that allow no 16-byte copy (not a multiple of 8 for 16-bit, 4 for fp32) are loaded with
// scalar loads into the same stages (synchronously), so any channel count is handled.
#include "common.h"
#include "cuda/conv_transpose_k4s2p1.h"

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
constexpr int kStages = 4;

template <typename scalar_t, int BN_, bool kWgrad>
struct Tile {
  static constexpr int ESZ = int(sizeof(scalar_t));
  static constexpr int BM = 128, BN = BN_;
  static constexpr int BK = 64 / ESZ;   // 64 bytes of K per tile row
  static constexpr int VEC = 16 / ESZ;  // elements per 16-byte copy
  static constexpr int KSTEP = ESZ == 4 ? 8 : 16;  // the MMA's K
  static constexpr int WN = BN >= 128 ? 4 : (BN >= 32 ? 2 : 1);
  static constexpr int WM = 8 / WN;
  static constexpr int WARP_M = BM / WM, WARP_N = BN / WN;
  static constexpr int MI = WARP_M / 16, NI = WARP_N / 8;
  // A in smem: [BM][BK] (K-contiguous) for the convolutions, [BK][BM] (M-contiguous) for grad_weight, whose A
  // is contiguous along M (the output channels of one tap). Padding: K-contiguous rows are 80 bytes apart (an
  // odd multiple of 16: the 8 rows of an ldmatrix hit all 32 banks); M/N-contiguous rows get 8 elements, an
  // odd multiple of 16 bytes for 16-bit (ldmatrix.trans) and 8 words mod 32 for fp32 (scalar fragment
  // loads by (k = lane % 4, n = lane / 4)).
  static constexpr int LDA = kWgrad ? BM + 8 : BK + VEC;
  static constexpr int A_ELEMS = kWgrad ? BK * LDA : BM * LDA;
  static constexpr int LDB = BN + 8;
  static constexpr int B_ELEMS = BK * LDB;
  static constexpr int STAGE_BYTES = (A_ELEMS + B_ELEMS) * ESZ;
  static constexpr int SMEM_BYTES = kStages * STAGE_BYTES;
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
  int taps_w, src_scale, src_off, src_dir;
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

__device__ inline uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16-byte global -> shared copy; with `pred` false nothing is read and the 16 bytes are zero-filled.
__device__ inline void cp_async16(void* dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(pred ? 16 : 0));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ inline uint32_t to_tf32(uint32_t bits) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(__uint_as_float(bits)));
  return r;
}

// d += a * b on one 16 x 8 tile (K = 16 for 16-bit, 8 for TF32).
template <typename scalar_t>
__device__ inline void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else if constexpr (std::is_same_v<scalar_t, at::Half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

template <typename scalar_t, int BN, bool kWgrad>
__global__ void __launch_bounds__(kThreads, 2) implicit_gemm_kernel(const GemmArgs a) {
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

  // ---- A: per-thread fixed part of the gather ------------------------------------------------------------
  constexpr int A_VPR = kWgrad ? BM / VEC : BK / VEC;  // 16-byte vectors per smem row
  constexpr int A_ROWS_PER_PASS = kThreads / A_VPR;
  constexpr int A_ITERS = (kWgrad ? BK : BM) / A_ROWS_PER_PASS;
  static_assert(A_ITERS * A_ROWS_PER_PASS == (kWgrad ? BK : BM), "A tile mapping");
  const int a_v = tid % A_VPR, a_r = tid / A_VPR;
  // Convolutions: the M row of each load (fixed over K): its batch offset and its unshifted source pixel.
  int64_t a_base[kWgrad ? 1 : A_ITERS];
  int a_y[kWgrad ? 1 : A_ITERS], a_x[kWgrad ? 1 : A_ITERS];
  // grad_weight: the M column (tap, channel) of this thread's vector, fixed over K.
  int w_ty = 0, w_tx = 0, w_c = 0;
  bool w_valid = false;
  if constexpr (!kWgrad) {
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) {
      const int m = m0 + a_r + i * A_ROWS_PER_PASS;
      a_base[i] = 0;
      a_y[i] = INT_MIN / 4;  // never inside the source: rows past M read zeros
      a_x[i] = INT_MIN / 4;
      if (m < a.M) {
        const int n = m / rows_hw, rem = m - n * rows_hw, my = rem / a.rows_W, mx = rem - my * a.rows_W;
        a_base[i] = n * a.act_sN;
        a_y[i] = a.src_scale * my + a.src_off + py;
        a_x[i] = a.src_scale * mx + a.src_off + px;
      }
    }
  } else {
    const int m = m0 + a_v * VEC;
    w_valid = m < a.M;
    const int t = m / a.act_C;
    w_c = m - t * a.act_C;
    w_ty = t / a.taps_w;
    w_tx = t - w_ty * a.taps_w;
  }

  auto in_src = [&](int y, int x) { return y >= 0 && y < a.act_H && x >= 0 && x < a.act_W; };
  auto a_stage = [&](int s) { return reinterpret_cast<bits*>(smem + s * T::STAGE_BYTES); };
  auto b_stage = [&](int s) { return reinterpret_cast<bits*>(smem + s * T::STAGE_BYTES + T::A_ELEMS * ESZ); };

  // Issues the copies of K-tile kt into stage s: cp.async where 16-byte copies apply, else scalar loads stored
  // synchronously (both are visible after the barrier that precedes the stage's use).
  auto load_a = [&](int s, int kt) {
    bits* As = a_stage(s);
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) {
      const int r = a_r + i * A_ROWS_PER_PASS;
      bits* dst = As + r * T::LDA + a_v * VEC;
      if constexpr (!kWgrad) {
        const int k = kt * BK + a_v * VEC;
        if (a.a_vec) {  // act_C % VEC == 0: the vector lies in one tap
          bool ok = k < a.K;
          const bits* src = act;
          if (ok) {
            const int t = k / a.act_C, c = k - t * a.act_C, ty = t / a.taps_w, tx = t - ty * a.taps_w;
            const int y = a_y[i] + a.src_dir * ty, x = a_x[i] + a.src_dir * tx;
            ok = in_src(y, x);
            if (ok) src = act + a_base[i] + y * a.act_sH + x * a.act_sW + c;
          }
          cp_async16(dst, src, ok);
        } else {
          uint4 v = make_uint4(0, 0, 0, 0);
          bits* e = reinterpret_cast<bits*>(&v);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const int kj = k + j;
            if (kj < a.K) {
              const int t = kj / a.act_C, c = kj - t * a.act_C, ty = t / a.taps_w, tx = t - ty * a.taps_w;
              const int y = a_y[i] + a.src_dir * ty, x = a_x[i] + a.src_dir * tx;
              if (in_src(y, x)) e[j] = act[a_base[i] + y * a.act_sH + x * a.act_sW + c];
            }
          }
          *reinterpret_cast<uint4*>(dst) = v;
        }
      } else {
        const int p = kt * BK + r;  // input pixel (the GEMM's K)
        int64_t base = 0;
        int y0 = INT_MIN / 4, x0 = INT_MIN / 4;
        if (p < a.K) {
          const int n = p / rows_hw, rem = p - n * rows_hw, iy = rem / a.rows_W, ix = rem - iy * a.rows_W;
          base = n * a.act_sN;
          y0 = a.src_scale * iy + a.src_off;
          x0 = a.src_scale * ix + a.src_off;
        }
        if (a.a_vec) {
          const int y = y0 + a.src_dir * w_ty, x = x0 + a.src_dir * w_tx;
          const bool ok = w_valid && in_src(y, x);
          cp_async16(dst, ok ? act + base + y * a.act_sH + x * a.act_sW + w_c : act, ok);
        } else {
          uint4 v = make_uint4(0, 0, 0, 0);
          bits* e = reinterpret_cast<bits*>(&v);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const int m = m0 + a_v * VEC + j;
            if (m < a.M) {
              const int t = m / a.act_C, c = m - t * a.act_C, ty = t / a.taps_w, tx = t - ty * a.taps_w;
              const int y = y0 + a.src_dir * ty, x = x0 + a.src_dir * tx;
              if (in_src(y, x)) e[j] = act[base + y * a.act_sH + x * a.act_sW + c];
            }
          }
          *reinterpret_cast<uint4*>(dst) = v;
        }
      }
    }
  };

  // ---- B: a row-major [K, N] matrix (prepacked weight, or the dense NHWC input for grad_weight) ----------
  constexpr int B_VPR = BN / VEC;
  constexpr int B_VECS = BK * B_VPR;
  constexpr int B_ITERS = (B_VECS + kThreads - 1) / kThreads;
  auto load_b = [&](int s, int kt) {
    bits* Bs = b_stage(s);
#pragma unroll
    for (int i = 0; i < B_ITERS; ++i) {
      const int v = tid + i * kThreads;
      if (B_VECS % kThreads != 0 && v >= B_VECS) continue;
      const int kr = v / B_VPR, k = kt * BK + kr, n = n0 + (v % B_VPR) * VEC;
      bits* dst = Bs + kr * T::LDB + (v % B_VPR) * VEC;
      const bits* row = bmat + int64_t(k) * a.N;
      if (a.b_vec) {  // N % VEC == 0: a vector is all in or all out
        const bool ok = k < a.K && n < a.N;
        cp_async16(dst, ok ? row + n : bmat, ok);
      } else {
        uint4 val = make_uint4(0, 0, 0, 0);
        bits* e = reinterpret_cast<bits*>(&val);
        if (k < a.K) {
#pragma unroll
          for (int j = 0; j < VEC; ++j)
            if (n + j < a.N) e[j] = row[n + j];
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
        for (int ni = 0; ni < T::NI; ++ni) mma<scalar_t>(acc[mi][ni], af[mi], bf[ni]);
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

// Splits K when the output tiles alone cannot fill the GPU (two CTAs per SM), keeping >= 8 K-tiles per split
// (each split adds one fp32 atomic per output element).
// Sets a.splits / a.ktiles_per_split and returns whether the result must be accumulated atomically.
template <typename scalar_t>
bool plan_splits(GemmArgs& a, int phases, bool always_split) {
  constexpr int BK = 64 / int(sizeof(scalar_t));
  const int64_t tiles = int64_t((a.M + 127) / 128) * ((a.N + pick_bn(a.N) - 1) / pick_bn(a.N)) * phases;
  const int ktiles = (a.K + BK - 1) / BK;
  const int64_t target = 2 * int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  int splits = 1;
  if (tiles < target) splits = int(std::min<int64_t>((target + tiles - 1) / tiles, std::max(1, ktiles / 8)));
  splits = std::min(splits, 65535 / phases);
  a.ktiles_per_split = (ktiles + splits - 1) / splits;
  a.splits = std::max(1, (ktiles + a.ktiles_per_split - 1) / a.ktiles_per_split);
  return always_split || a.splits > 1;
}

template <typename scalar_t, int BN, bool kWgrad>
void launch_tile(const GemmArgs& a, const dim3& grid, cudaStream_t stream) {
  constexpr int smem = Tile<scalar_t, BN, kWgrad>::SMEM_BYTES;
  auto kernel = implicit_gemm_kernel<scalar_t, BN, kWgrad>;
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
  c10::cuda::CUDAGuard device_guard(input4.device());
  const at::Tensor go = grad_output4.contiguous(at::MemoryFormat::ChannelsLast);
  const int cin = int(g.in_channels), cout = int(g.out_channels);
  dispatch_fast(go.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    {
      constexpr int VEC = 16 / int(sizeof(scalar_t));
      GemmArgs common{};
      set_activation<scalar_t>(common, go);
      common.taps_w = 4;
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
