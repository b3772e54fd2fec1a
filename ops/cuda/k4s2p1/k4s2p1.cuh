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
//
// Hopper (sm_90a code): bf16/fp16 GEMMs whose operands allow 16-byte copies run on wgmma instead, with both
// operands read by the tensor cores from 128-byte-swizzled shared memory (no ldmatrix); a probe tells whether the
// driver loaded the sm_90a code; everything else (fp32/TF32, odd channel counts, NCHW outputs of the
// convolutions, small split grids) keeps mma.sync.
// HIERPAR_WGMMA=0 / HIERPAR_WGMMA_ALL_PHASES=0 / HIERPAR_WGMMA_GRAD_INPUT_PATCH=0 switch them off,
// HIERPAR_K4S2P1_TMA=0 keeps the cp.async loads,
// HIERPAR_K4S2P1_WEIGHT_IN_PLACE=0 packs / copies channels_last weights as other ones and
// HIERPAR_K4S2P1_SPLIT_TARGET=n plans K splits for n CTAs per SM, for same-process timings.
//
// One file per kernel family, each with its kernels, its launcher and (here) the predicate saying when it applies:
// implicit_gemm.cu (mma.sync, every GEMM), wgmma_tiles.cu (wgmma tiles of the convolutions and of grad_weight,
// TMA or cp.async loads), wgmma_all_phases.cu (the forward for C_out <= 32), wgmma_grad_input_patch.cu
// (grad_input for C_out == 32), sm90a_probe.cu (whether the sm_90a code was loaded); entry.cu routes between them.
// The files with wgmma / TMA code (wgmma_*.cu, sm90a_probe.cu) are also built for sm_90a (CMakeLists.txt). This
// header holds what they share: the GEMM arguments, the mma.sync tiles, the gather cursor, the output and
// activation set-up, the predicates and the launchers' declarations.
#pragma once

#include "common.h"
#include "cuda/conv_transpose_k4s2p1.h"
#include "cuda/device_caps.h"
#include "cuda/mma.cuh"
#include "hierpar/switches.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>
#include <type_traits>

namespace hierpar::detail::k4s2p1 {

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

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline int pick_bn(int n) { return n > 64 ? 128 : n > 32 ? 64 : n > 16 ? 32 : 16; }

// Row m < a.M of a convolution GEMM for output phase (py, px): the offset of its unshifted source pixel in the
// activation (strides sH, sW) into `off`, and a bit per tap whose source pixel lies inside the activation or'd
// into `taps`.
__device__ __forceinline__ void conv_row_source(const GemmArgs& a, int m, int rows_hw, int py, int px, int sH, int sW,
                                                int& off, uint32_t& taps) {
  const int n = m / rows_hw, rem = m - n * rows_hw, my = rem / a.rows_W, mx = rem - my * a.rows_W;
  const int y0 = a.src_scale * my + a.src_off + py, x0 = a.src_scale * mx + a.src_off + px;
  off = n * int(a.act_sN) + y0 * sH + x0 * sW;
  for (int t = 0; t < a.ntaps; ++t) {
    const int ty = t >> a.taps_shift, tx = t & (a.taps_w - 1);
    const int y = y0 + a.src_dir * ty, x = x0 + a.src_dir * tx;
    if (y >= 0 && y < a.act_H && x >= 0 && x < a.act_W) taps |= 1u << t;
  }
}

// The most shared memory an mma.sync tile of width BN takes, over the dtypes and GEMMs.
template <int BN>
constexpr int mma_tile_smem() {
  int bytes = std::max({Tile<float, BN, false>::SMEM_BYTES, Tile<float, BN, true>::SMEM_BYTES,
                        Tile<at::BFloat16, BN, false>::SMEM_BYTES, Tile<at::BFloat16, BN, true>::SMEM_BYTES});
  if constexpr (BN >= 32) bytes = std::max(bytes, Tile<float, BN, false, true>::SMEM_BYTES);  // K-major B: BN >= 32
  return bytes;
}
static_assert(mma_tile_smem<128>() == 110592 && mma_tile_smem<64>() == 82944, "tile sizes the docs quote");
inline int mma_tile_smem(int bn) {
  return bn == 128 ? mma_tile_smem<128>() : bn == 64 ? mma_tile_smem<64>() : bn == 32 ? mma_tile_smem<32>()
                                                                                      : mma_tile_smem<16>();
}

// The mma.sync kernels' tile width for a GEMM of N columns: 128-column tiles (up to 108 KB of shared memory)
// where a block may have that much (A100, H100), else at most 64 (<= 81 KB: the 99 KB of sm_86, sm_89, sm_120).
inline int pick_mma_bn(int n) {
  return std::min(pick_bn(n), current_device_caps().max_smem_per_block >= mma_tile_smem<128>() ? 128 : 64);
}

// Dense NHWC strides of a [N, C, H, W] tensor with the given layout, as (sN, sH, sW, sC).
struct Strides {
  int64_t n, h, w, c;
};
inline Strides dense_strides(int64_t c, int64_t h, int64_t w, bool channels_last) {
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

// A GEMM over the g.in_h x g.in_w grid of input pixels gathering from the activation `t` (every pass of this
// family): the activation and the grid set, the rest zero.
template <typename scalar_t>
GemmArgs input_pixel_gemm(const ConvTranspose2dGeometry& g, const at::Tensor& t) {
  GemmArgs a{};
  set_activation<scalar_t>(a, t);
  a.rows_H = int(g.in_h);
  a.rows_W = int(g.in_w);
  return a;
}

// ---- the kernel families: when each applies, and its launcher ------------------------------------------------
// The launchers are instantiated for float, at::BFloat16 and at::Half (the fast path's dtypes) in their files;
// the wgmma ones hold only an assertion for float.

// Whether the driver loaded the sm_90a code of the wgmma kernels (sm90a_probe.cu).
bool wgmma_available();

// mma.sync implicit GEMM (implicit_gemm.cu): any GEMM of the three; the forward / grad_input with kWgrad false,
// grad_weight with it true. b_kmajor: B is K-major [N][K] (fp32 convolutions with 16-byte copies and tiles of
// >= 32 columns only).
template <typename scalar_t, bool kWgrad>
void launch(const GemmArgs& a, int phases, bool b_kmajor = false);

// The wgmma kernel's preconditions beyond GemmArgs' own (a_vec, b_vec: 16-byte copies; c_vec: 16-byte
// channels-innermost stores; no split): a 16-bit dtype and a tile width of 32..128. B is a fresh ATen
// allocation (16-byte aligned) in the K-major layout, packed by the caller once this says yes, or the forward's
// weight in place (forward_weight_in_place).
template <typename scalar_t>
bool wgmma_applies(const GemmArgs& a) {
  return !std::is_same_v<scalar_t, float> && a.a_vec && a.b_vec && a.c_vec && a.c_sC == 1 && !a.c_atomic &&
         a.splits == 1 && a.K % 8 == 0 && a.N > 16 && wgmma_available();
}

// wgmma_tiles.cu: direct_b: B is the forward's weight in place (N-major, tiles of 64 or 128 columns), else
// packed K-major.
template <typename scalar_t>
void launch_wgmma(const GemmArgs& a, int phases, bool direct_b);

// grad_weight on wgmma: 16-bit operands with 16-byte copies (C_out % 8, C_in % 8) and C_in > 32 (one tile
// of 64 or 128 channels); the K splits are summed in a dense fp32 [16 C_out][C_in] workspace (with one counter
// per output tile after it) and written to grad_weight by each tile's last CTA.
template <typename scalar_t>
bool wgmma_wgrad_applies(const GemmArgs& a) {
  return !std::is_same_v<scalar_t, float> && a.a_vec && a.b_vec && a.N > 32 && wgmma_available();
}

// wgmma_tiles.cu: the output tiles of launch_wgmma_wgrad (one counter each after its split-K workspace).
int64_t wgmma_wgrad_tiles(const GemmArgs& a);
template <typename scalar_t>
void launch_wgmma_wgrad(const GemmArgs& a);

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

// wgmma_all_phases.cu
template <typename scalar_t>
void launch_wgmma_all_phases(const ConvTranspose2dGeometry& g, const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& out);

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

// wgmma_grad_input_patch.cu
template <typename scalar_t>
void launch_wgmma_grad_input_patch(const ConvTranspose2dGeometry& g, const at::Tensor& go, const at::Tensor& weight,
                                   const at::Tensor& grad_input);
}  // namespace hierpar::detail::k4s2p1
