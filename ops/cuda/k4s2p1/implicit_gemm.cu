// The mma.sync implicit GEMM of the k4s2p1 fast path (k4s2p1.cuh): one kernel template for the forward,
// grad_input and grad_weight (kWgrad picks the A form), on any GPU with sm_80 code, for every dtype and channel
// count of the fast path.
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
#include "cuda/k4s2p1/k4s2p1.cuh"

namespace hierpar::detail::k4s2p1 {
namespace {

template <typename scalar_t>
using bits_t = std::conditional_t<sizeof(scalar_t) == 2, uint16_t, uint32_t>;

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
      if (m < a.M) conv_row_source(a, m, rows_hw, py, px, sH, sW, row_off[i], row_taps[i]);
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

}  // namespace

template <typename scalar_t, bool kWgrad>
void launch(const GemmArgs& a, int phases, bool b_kmajor) {
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

template void launch<float, false>(const GemmArgs&, int, bool);
template void launch<float, true>(const GemmArgs&, int, bool);
template void launch<at::BFloat16, false>(const GemmArgs&, int, bool);
template void launch<at::BFloat16, true>(const GemmArgs&, int, bool);
template void launch<at::Half, false>(const GemmArgs&, int, bool);
template void launch<at::Half, true>(const GemmArgs&, int, bool);

}  // namespace hierpar::detail::k4s2p1
