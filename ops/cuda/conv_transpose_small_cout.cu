// Small-C_out kernels of hierpar::conv_transpose2d for kernel 4, stride 2, padding 1 (DCGAN's last layer,
// 32 -> 3 channels). The layer is memory-bound (batch 1024 bf16: input 64 MB, output 25 MB, so each pass has a
// ~25 us floor on an H200), but its arithmetic is not small either (3.2 GFLOP a pass), too much for the CUDA cores
// to stay near that floor. So:
//  - bf16 / fp16 with C_in % 16 == 0 (the DCGAN case), and fp32 with C_in % 16 == 0 where stock's convolutions use
//    TF32 (allowTF32CuDNN(CONV), the default): tensor-core kernels (mma.sync, fp32 accumulation; fp32 operands
//    staged as floats and rounded to TF32 as the fragments are read) that treat each input position as a tiny GEMM
//    row, with C_out <= 4 zero-padded inside the MMA tiles; each kernel reads its inputs about once (the tiles'
//    halos aside). The forward and grad_weight need channels innermost (channels_last) input for their 16-byte
//    copies; grad_input copies a dense channels_last grad_output's rows 16 bytes at a time too, and reads any other
//    grad_output through its strides (in fp32 only one whose channels are innermost, or a single channel). The
//    forward and grad_input blocks are persistent (one per resident slot, looping over the images) and copy the next
//    image while multiplying this one; both stage their output tile in shared memory and write it as 16-byte vectors
//    where the output's layout allows.
//  - otherwise (fp32 with TF32 off for convolutions, which keeps true fp32 arithmetic here, odd channel counts, an
//    NCHW input to the forward, an NCHW fp32 grad_output to grad_input): CUDA-core kernels reading every tensor
//    through its strides.
//    Forward: a block is a 32 x 8 tile of input positions (one thread each); per 16-channel chunk it stages the
//    tile plus a one-pixel halo (fp32, channel-major so the threads' reads are conflict-free) and the chunk's
//    weights, and each thread accumulates the 4 output pixels (2qy + py, 2qx + px) x C_out it owns from the 3 x 3
//    input neighbourhood. grad_input: a thread per input pixel keeps the 4 x 4 x C_out grad_output patch its taps
//    read in registers and produces 8 input channels at a time against weights staged in shared memory.
//    grad_weight takes the general path (im2col + cuBLAS): a CUDA-core reduction measured 1225 us at batch 1024
//    bf16 against stock's 227.
#include "common.h"
#include "cuda/conv_transpose_k4s2p1.h"
#include "cuda/device_caps.h"
#include "cuda/mma.cuh"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace hierpar::detail {
namespace {

// Element strides of a 4-d tensor in (n, c, y, x) order.
struct Strides4d {
  int64_t n, c, y, x;
};
Strides4d strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)}; }

struct SmallArgs {
  int batch, cin, cout, H, W;  // input size; the output is 2H x 2W
  const void* x;
  Strides4d xs;
  const void* go;  // grad_output
  Strides4d gos;
  const void* w;  // [C_in, C_out, 4, 4] by strides
  Strides4d ws;
  const void* bias;  // nullptr when none
  void* out;         // forward output or grad_input
  Strides4d os;
  // grad_input is stored through leaky_relu with this negative slope (1: as computed). hierpar::conv2d's forward is
  // this grad_input, so its following leaky_relu costs no pass of its own.
  float grad_input_slope;
};

__device__ inline float leaky(float v, float slope) { return v < 0.f ? v * slope : v; }

constexpr int kThreads = 256;

// ---- forward ------------------------------------------------------------------------------------------------
constexpr int kTileX = 32, kTileY = 8, kChunkC = 16;
static_assert(kTileX * kTileY == kThreads, "one thread per input position of the tile");

template <typename scalar_t, int CO>
__global__ void __launch_bounds__(kThreads) small_cout_forward_kernel(const SmallArgs a, bool channels_inner) {
  constexpr int HX = kTileX + 2, HY = kTileY + 2, HALO = HX * HY;
  __shared__ float xsm[kChunkC][HY][HX];
  __shared__ __align__(16) float wsm[kChunkC][16 * CO];  // [ci][(ky, kx, co)]
  const scalar_t* x = static_cast<const scalar_t*>(a.x);
  const scalar_t* w = static_cast<const scalar_t*>(a.w);
  const scalar_t* bias = static_cast<const scalar_t*>(a.bias);
  scalar_t* out = static_cast<scalar_t*>(a.out);
  const int tx = threadIdx.x % kTileX, ty = threadIdx.x / kTileX;
  const int qx0 = blockIdx.x * kTileX, qy0 = blockIdx.y * kTileY;
  const int qx = qx0 + tx, qy = qy0 + ty;

  for (int n = blockIdx.z; n < a.batch; n += gridDim.z) {
    float acc[4][CO];  // [py * 2 + px][co]
#pragma unroll
    for (int co = 0; co < CO; ++co) {
      const float b = bias != nullptr && co < a.cout ? static_cast<float>(bias[co]) : 0.f;
#pragma unroll
      for (int p = 0; p < 4; ++p) acc[p][co] = b;
    }
    const scalar_t* xn = x + n * a.xs.n;
    for (int c0 = 0; c0 < a.cin; c0 += kChunkC) {
      const int cn = min(kChunkC, a.cin - c0);
      __syncthreads();  // the previous chunk's reads are done
      for (int e = threadIdx.x; e < kChunkC * HALO; e += kThreads) {
        // Global reads follow the layout: channel-fastest for channels_last, pixel-fastest for NCHW.
        const int c = channels_inner ? e % kChunkC : e / HALO;
        const int p = channels_inner ? e / kChunkC : e % HALO;
        const int hy = p / HX, hx = p - hy * HX, y = qy0 - 1 + hy, xx = qx0 - 1 + hx;
        float v = 0.f;
        if (c < cn && y >= 0 && y < a.H && xx >= 0 && xx < a.W)
          v = static_cast<float>(xn[(c0 + c) * a.xs.c + y * a.xs.y + xx * a.xs.x]);
        xsm[c][hy][hx] = v;
      }
      for (int e = threadIdx.x; e < kChunkC * 16 * CO; e += kThreads) {
        const int c = e / (16 * CO), r = e - c * (16 * CO), tap = r / CO, co = r - tap * CO;
        float v = 0.f;
        if (c < cn && co < a.cout)
          v = static_cast<float>(w[(c0 + c) * a.ws.n + co * a.ws.c + (tap >> 2) * a.ws.y + (tap & 3) * a.ws.x]);
        wsm[c][r] = v;
      }
      __syncthreads();
#pragma unroll 2
      for (int c = 0; c < cn; ++c) {
        float xv[3][3];
#pragma unroll
        for (int dy = 0; dy < 3; ++dy)
#pragma unroll
          for (int dx = 0; dx < 3; ++dx) xv[dy][dx] = xsm[c][ty + dy][tx + dx];
        float wv[16 * CO];
#pragma unroll
        for (int i = 0; i < 4 * CO; ++i) {
          const float4 q = reinterpret_cast<const float4*>(wsm[c])[i];
          wv[4 * i] = q.x;
          wv[4 * i + 1] = q.y;
          wv[4 * i + 2] = q.z;
          wv[4 * i + 3] = q.w;
        }
        // Output phase (py, px), tap (ty, tx): input offset d = p - t, kernel index k = 1 - p + 2t.
#pragma unroll
        for (int py = 0; py < 2; ++py)
#pragma unroll
          for (int px = 0; px < 2; ++px)
#pragma unroll
            for (int tty = 0; tty < 2; ++tty)
#pragma unroll
              for (int ttx = 0; ttx < 2; ++ttx) {
                const float v = xv[py - tty + 1][px - ttx + 1];
                const int tap = (1 - py + 2 * tty) * 4 + (1 - px + 2 * ttx);
#pragma unroll
                for (int co = 0; co < CO; ++co) acc[py * 2 + px][co] = fmaf(v, wv[tap * CO + co], acc[py * 2 + px][co]);
              }
      }
    }
    if (qy < a.H && qx < a.W) {
      scalar_t* on = out + n * a.os.n;
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const int64_t pix = (2 * qy + (p >> 1)) * a.os.y + (2 * qx + (p & 1)) * a.os.x;
#pragma unroll
        for (int co = 0; co < CO; ++co)
          if (co < a.cout) on[pix + co * a.os.c] = static_cast<scalar_t>(acc[p][co]);
      }
    }
  }
}

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
      float v = 0.f;
      if (c < cn && co < a.cout)
        v = static_cast<float>(w[(c0 + c) * a.ws.n + co * a.ws.c + (tap >> 2) * a.ws.y + (tap & 3) * a.ws.x]);
      wsm[j][c] = v;
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

// ---- tensor-core kernels (bf16 / fp16, and fp32 as TF32; C_in % 16 == 0) ----------------------------------------
// A block owns 8 rows x 32 columns of input positions, one row per warp (two 16-row MMA tiles of 16 positions).
// The three passes as small GEMMs per position, with the zero-padded C_out (<= 4) spread along N or K:
//  - forward: N = (py, px, co) = 16, K = (neighbour d of the 3 x 3 neighbourhood, ci): out[2q + p] gets
//    x[q + d] * w[p + 1 - 2d]; phase row py = 0 never uses dy = +1 and py = 1 never dy = -1, so 12 of the 18
//    (neighbour, 8-column half) MMAs remain. A comes straight from the staged input tile (16-bit: ldmatrix, a
//    pixel's 16 channels being one 32-byte row), B (the weights of one channel chunk) from shared memory.
//  - grad_input: K = (ky, kx, co) = 64, N = ci; A is the 4 x 4 x 4 grad_output patch of the position, read from the
//    staged grad_output tile as 32-bit channel pairs.
//  - grad_weight: M = ci, N = (ky, kx, co) = 64, K = input positions; A = x^T from the input tile (16-bit:
//    ldmatrix.trans), B gathered from the grad_output tile. Blocks loop over tiles and keep their sums in
//    registers; the blocks' partial sums are added in a fixed order by a second kernel (deterministic, no atomics).
constexpr int kMmaRows = 8, kMmaCols = 32;
constexpr int kGoRows = 2 * kMmaRows + 2, kGoCols = 2 * kMmaCols + 2;  // grad_output pixels a tile's taps reach
constexpr int kCiChunk = 32;                                           // input channels per grad block

using mma::cp_async16;
using mma::ldmatrix_x4;
using mma::ldmatrix_x4_trans;
using mma::smem_addr;

// A kernel's operand format. bf16 / fp16 (m16n8k16): elements staged as their 16 bits, two per fragment register.
// fp32 (m16n8k8 TF32, used where stock would use TF32: see mma_applies): elements staged as floats, one per
// register, rounded to TF32 (cvt.rna) as the fragments are read, so the staging copies stay plain 16-byte copies.
// In 32-bit registers both fragment layouts are the same (mma.cuh): A rows g and g + 8, B column g, at the K
// offsets kPack * t4 and kPack * t4 + kK / 2.
template <typename scalar_t>
struct Tc {
  static constexpr bool kTf32 = std::is_same_v<scalar_t, float>;
  using E = std::conditional_t<kTf32, float, uint16_t>;  // as staged in shared memory
  static constexpr int kK = kTf32 ? 8 : 16;              // an MMA's K
  static constexpr int kPack = kTf32 ? 1 : 2;            // elements per fragment register
  static constexpr int kVec = 16 / int(sizeof(E));       // elements per 16-byte copy

  // The fragment register holding p[0] (and p[1] for 16-bit).
  __device__ static uint32_t word(const E* p) {
    if constexpr (kTf32)
      return mma::to_tf32(__float_as_uint(*p));
    else
      return *reinterpret_cast<const uint32_t*>(p);
  }
  // A fragment whose rows g and g + 8 start at r0 and r8 at the K step's first element.
  __device__ static void load_a(uint32_t (&a)[4], const E* r0, const E* r8, int t4) {
    const int k = kPack * t4;
    a[0] = word(r0 + k);
    a[1] = word(r8 + k);
    a[2] = word(r0 + k + kK / 2);
    a[3] = word(r8 + k + kK / 2);
  }
  // B fragment whose column g's K values start at col.
  __device__ static void load_b(uint32_t (&b)[2], const E* col, int t4) {
    b[0] = word(col + kPack * t4);
    b[1] = word(col + kPack * t4 + kK / 2);
  }
  // v rounded to scalar_t, as staged.
  __device__ static E bits(float v) {
    if constexpr (kTf32)
      return v;
    else
      return static_cast<scalar_t>(v).x;
  }
  // v0, v1 rounded to scalar_t at p, p + 1 (one 32- or 64-bit store).
  __device__ static void store_pair(E* p, float v0, float v1) {
    if constexpr (kTf32)
      *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
    else
      *reinterpret_cast<uint32_t*>(p) = uint32_t(bits(v0)) | uint32_t(bits(v1)) << 16;
  }
};

// Four elements of one grad_output tile pixel (C_out padded to 4), stored by one 8- or 16-byte access.
template <typename E>
struct alignas(4 * sizeof(E)) Quad {
  E v[4];
};

// Staging from global memory in two halves: every load of a thread is issued before the first store to shared
// memory, so a block waits for one memory latency rather than one per loop trip (which, measured, made these
// kernels 3-4x slower than their memory traffic).
constexpr int kGoElems = kGoRows * kGoCols * 4;
constexpr int kGoLoads = (kGoElems + kThreads - 1) / kThreads;

// The grad_output pixels [2 iy0 - 1, 2 iy0 + 2 kMmaRows] x [2 ix0 - 1, 2 ix0 + 2 kMmaCols] of image n as
// [row][column][co padded to 4] (zero outside the image and for co >= C_out).
template <int CO, typename E>
__device__ inline void load_grad_output(const SmallArgs& a, int n, int iy0, int ix0, E (&v)[kGoLoads]) {
  const E* go = static_cast<const E*>(a.go) + n * a.gos.n;
#pragma unroll
  for (int i = 0; i < kGoLoads; ++i) {
    const int e = threadIdx.x + i * kThreads, co = e & 3, p = e >> 2, r = p / kGoCols, c = p - r * kGoCols;
    const int gy = 2 * iy0 - 1 + r, gx = 2 * ix0 - 1 + c;
    v[i] = 0;
    if (e < kGoElems && co < CO && gy >= 0 && gy < 2 * a.H && gx >= 0 && gx < 2 * a.W)
      v[i] = go[co * a.gos.c + gy * a.gos.y + gx * a.gos.x];
  }
}
template <typename E>
__device__ inline void store_grad_output(E* gs, const E (&v)[kGoLoads]) {
#pragma unroll
  for (int i = 0; i < kGoLoads; ++i) {
    const int e = threadIdx.x + i * kThreads;
    if (e < kGoElems) gs[e] = v[i];
  }
}

// Raw-row staging of a dense channels_last grad_output (kRawRows in grad_input and grad_weight): a tile row is one
// byte span of at most kGoCols pixels of <= 4 channels, copied by cp.async as whole, aligned 16-byte units (one unit
// of slack at either end), then spread into the [row][column][co padded to 4] tile. The element-wise loads of
// load_grad_output cost ~1100 instructions per warp and tile in Nsight Compute, most of them address arithmetic.
// Sizes per element size ES (2 or 4 bytes).
template <int ES>
constexpr int kRawRowBytes = (kGoCols * 4 * ES / 16 + 2) * 16;
template <int ES>
constexpr int kRawBytes = kGoRows * kRawRowBytes<ES>;

// The byte span of the tile's rows: pixels [2 ix0 - 1, 2 ix0 + kGoCols - 1) clipped to the image, widened to 16 bytes.
template <int CO, int ES>
__device__ inline int2 raw_row_span(const SmallArgs& a, int ix0) {
  return make_int2((max(0, 2 * ix0 - 1) * CO * ES) & ~15, (min(2 * a.W, 2 * ix0 + kGoCols - 1) * CO * ES + 15) & ~15);
}

// Issues (does not commit) the copies of image n's tile rows into raw.
template <int CO, typename E>
__device__ inline void issue_raw_rows(const SmallArgs& a, int n, int iy0, int ix0, char* raw) {
  constexpr int ES = sizeof(E), kRowBytes = kRawRowBytes<ES>, kUnits = kRowBytes / 16;
  const int2 span = raw_row_span<CO, ES>(a, ix0);
  const char* go = static_cast<const char*>(a.go) + int64_t(n) * a.gos.n * ES;
  for (int v = threadIdx.x; v < kGoRows * kUnits; v += kThreads) {
    const int r = v / kUnits, off = span.x + (v - r * kUnits) * 16, gy = 2 * iy0 - 1 + r;
    if (gy >= 0 && gy < 2 * a.H && off < span.y)
      cp_async16(raw + r * kRowBytes + off - span.x, go + int64_t(gy) * a.gos.y * ES + off, true);
  }
}

template <int CO, typename E>
__device__ inline void spread_raw_rows(const SmallArgs& a, int iy0, int ix0, const char* raw, E* gs) {
  constexpr int ES = sizeof(E);
  const int span_begin = raw_row_span<CO, ES>(a, ix0).x;
  for (int p = threadIdx.x; p < kGoRows * kGoCols; p += kThreads) {
    const int r = p / kGoCols, c = p - r * kGoCols, gy = 2 * iy0 - 1 + r, gx = 2 * ix0 - 1 + c;
    Quad<E> q{};
    if (gy >= 0 && gy < 2 * a.H && gx >= 0 && gx < 2 * a.W) {
      const E* src = reinterpret_cast<const E*>(raw + r * kRawRowBytes<ES> + gx * CO * ES - span_begin);
#pragma unroll
      for (int co = 0; co < CO; ++co) q.v[co] = src[co];
    }
    *reinterpret_cast<Quad<E>*>(gs + p * 4) = q;
  }
}

// CH: input channels staged at a time (16 or 32 for 16-bit, whose DCGAN 32 are one chunk; 16 for fp32, whose
// 32-channel tiles would need 135 KB of shared memory, one block per SM, against 82 KB and two). Blocks are
// persistent: each walks the images n = blockIdx.z, + gridDim.z, ... (one (image, chunk) step at a time) with two
// input-tile buffers, so the next step's tile is copied while this one multiplies and stores, and the weights are
// staged once per block when C_in is one chunk (per step otherwise).
template <typename scalar_t, int CH>
struct ForwardTile {
  using E = typename Tc<scalar_t>::E;
  static constexpr int HY = kMmaRows + 2, HX = kMmaCols + 2;
  // Rows padded by 16 bytes: an ldmatrix's 8 rows (8 pixels) hit 8 distinct bank groups (16-bit); the TF32
  // fragments' 32-bit reads of rows g = 0..7 at t4 = 0..3 hit 32 distinct banks (row stride 20 or 36 words).
  static constexpr int LD = CH + Tc<scalar_t>::kVec;
  static constexpr int kTileElems = HY * HX * LD;  // the chunk's channels of the tile plus a 1-pixel halo
  static constexpr int kWeightElems = 9 * 16 * LD;  // [neighbour][n = py*8 + px*4 + co][ci]
  // The output tile staged per warp (its two output rows of 2 * kMmaCols pixels x C_out <= 4), so that a dense
  // channels_last output is written in whole 16-byte vectors.
  static constexpr int kOutRowElems = 2 * kMmaCols * 4;
  static constexpr int kOutElems = kMmaRows * 2 * kOutRowElems;
  static constexpr int kSmemBytes = (2 * kTileElems + kWeightElems + kOutElems) * int(sizeof(E));
};

template <typename scalar_t, int CO, int CH>
__global__ void __launch_bounds__(kThreads, 2) small_cout_forward_mma_kernel(const SmallArgs a, bool vec_store) {
  using T = ForwardTile<scalar_t, CH>;
  using F = Tc<scalar_t>;
  using E = typename F::E;
  constexpr int HX = T::HX, LD = T::LD, VEC = F::kVec;
  constexpr int kWeightLoads = 9 * 16 * CH / kThreads;
  extern __shared__ __align__(16) uint16_t smem16[];
  E* const smem = reinterpret_cast<E*>(smem16);
  E* const wsm = smem + 2 * T::kTileElems;
  const E* x = static_cast<const E*>(a.x);
  const E* w = static_cast<const E*>(a.w);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  const int qx0 = blockIdx.x * kMmaCols, qy0 = blockIdx.y * kMmaRows, qy = qy0 + warp;
  const bool one_chunk = a.cin == CH;
  E* const out_rows = wsm + T::kWeightElems + warp * 2 * T::kOutRowElems;  // this warp's two output rows

  auto issue_tile = [&](int n, int c0, E* xs) {
    for (int v = threadIdx.x; v < T::HY * HX * (CH / VEC); v += kThreads) {
      const int p = v / (CH / VEC), cv = v % (CH / VEC), hy = p / HX, hx = p - hy * HX, y = qy0 - 1 + hy,
                xx = qx0 - 1 + hx;
      const bool in = y >= 0 && y < a.H && xx >= 0 && xx < a.W;
      cp_async16(xs + p * LD + cv * VEC, in ? x + n * a.xs.n + y * a.xs.y + xx * a.xs.x + c0 + cv * VEC : x, in);
    }
    mma::cp_async_commit();
  };
  // All loads before the first store (one memory latency, not kWeightLoads of them).
  auto stage_weights = [&](int c0) {
    E wv[kWeightLoads];
#pragma unroll
    for (int i = 0; i < kWeightLoads; ++i) {
      const int e = threadIdx.x + i * kThreads, ci = e % CH, nn = (e / CH) & 15, d = e / (16 * CH);
      const int py = nn >> 3, px = (nn >> 2) & 1, co = nn & 3;
      const int ky = py + 1 - 2 * (d / 3 - 1), kx = px + 1 - 2 * (d % 3 - 1);
      wv[i] = 0;
      if (co < CO && ky >= 0 && ky < 4 && kx >= 0 && kx < 4)
        wv[i] = w[(c0 + ci) * a.ws.n + co * a.ws.c + ky * a.ws.y + kx * a.ws.x];
    }
#pragma unroll
    for (int i = 0; i < kWeightLoads; ++i) {
      const int e = threadIdx.x + i * kThreads;
      wsm[(e / CH) * LD + e % CH] = wv[i];
    }
  };

  int n = blockIdx.z, c0 = 0, buf = 0;
  if (n < a.batch) issue_tile(n, 0, smem);
  if (one_chunk) stage_weights(0);  // read only after the loop's second barrier
  float acc[2][2][4] = {};          // [16-position tile][py][fragment]
  while (n < a.batch) {
    int next_n = n, next_c0 = c0 + CH;
    if (next_c0 == a.cin) next_n += gridDim.z, next_c0 = 0;
    __syncthreads();  // the previous step's reads of the other buffer (and of the weights) are done
    if (!one_chunk) stage_weights(c0);
    if (next_n < a.batch) {
      issue_tile(next_n, next_c0, smem + (buf ^ 1) * T::kTileElems);
      mma::cp_async_wait<1>();  // this step's tile has landed; the next one stays in flight
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();
    const E* xs = smem + buf * T::kTileElems;
#pragma unroll
    for (int d = 0; d < 9; ++d) {
      const int dy = d / 3 - 1, dx = d % 3 - 1;
#pragma unroll
      for (int kk = 0; kk < CH; kk += F::kK) {
        uint32_t bf[2][2];
#pragma unroll
        for (int py = 0; py < 2; ++py) F::load_b(bf[py], wsm + (d * 16 + py * 8 + g) * LD + kk, t4);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          uint32_t af[4];
          const int pix = (warp + 1 + dy) * HX + mt * 16 + 1 + dx;  // the tile's first position
          if constexpr (F::kTf32)
            F::load_a(af, xs + (pix + g) * LD + kk, xs + (pix + g + 8) * LD + kk, t4);
          else
            ldmatrix_x4(af, smem_addr(xs + (pix + (lane & 15)) * LD + kk) + (lane >> 4) * 16);
          if (dy <= 0) mma::mma<scalar_t>(acc[mt][0], af, bf[0]);
          if (dy >= 0) mma::mma<scalar_t>(acc[mt][1], af, bf[1]);
        }
      }
    }
    // The image's last chunk: store. C fragment: position row g (+8), column n = py*8 + 2*t4 (+1) =
    // (px = t4 / 2, co = 2 * (t4 % 2) (+1)).
    if (next_c0 == 0) {
      const scalar_t* bias = static_cast<const scalar_t*>(a.bias);
      const int px = t4 >> 1, co0 = (t4 & 1) * 2;
      scalar_t* out = static_cast<scalar_t*>(a.out) + n * a.os.n;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int col = mt * 16 + g + 8 * h, qx = qx0 + col;
#pragma unroll
          for (int py = 0; py < 2; ++py)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int co = co0 + e;
              if (co >= CO) continue;
              const float b = bias != nullptr ? static_cast<float>(bias[co]) : 0.f;
              const float v = acc[mt][py][2 * h + e] + b;
              if (vec_store)  // staged as the output rows' bytes: pixel (2 col + px) x CO channels
                out_rows[py * T::kOutRowElems + (2 * col + px) * CO + co] = F::bits(v);
              else if (qy < a.H && qx < a.W)
                out[co * a.os.c + (2 * qy + py) * a.os.y + (2 * qx + px) * a.os.x] = static_cast<scalar_t>(v);
            }
        }
      if (vec_store && qy < a.H) {
        __syncwarp();
        // Output row 2 qy + py, pixels [2 qx0, min(2 W, 2 qx0 + 2 kMmaCols)): contiguous, 16-byte aligned.
        const int units = (min(2 * a.W, 2 * qx0 + 2 * kMmaCols) - 2 * qx0) * CO / VEC;
        for (int v = lane; v < 2 * units; v += 32) {
          const int py = v / units, u = v - py * units;
          *reinterpret_cast<uint4*>(out + (2 * qy + py) * a.os.y + 2 * qx0 * CO + u * VEC) =
              *reinterpret_cast<const uint4*>(out_rows + py * T::kOutRowElems + u * VEC);
        }
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int py = 0; py < 2; ++py)
#pragma unroll
          for (int f = 0; f < 4; ++f) acc[mt][py][f] = 0.f;
    }
    n = next_n;
    c0 = next_c0;
    buf ^= 1;
  }
}

// grad_input's shared memory: the grad_output tile, the weights, the output tile (staged so the block writes whole
// 16-byte vectors), and two raw buffers for the kRawRows staging below. Rows padded by 16 bytes: conflict-free B
// fragment reads of the weights (144- or 272-byte rows) and fragment stores of the output tile (80 or 144 bytes).
template <typename scalar_t>
struct GradInputTile {
  using E = typename Tc<scalar_t>::E;
  static constexpr int kWeightLd = 64 + Tc<scalar_t>::kVec;  // [ci][k = (ky*4 + kx)*4 + co]
  static constexpr int kOutLd = kCiChunk + Tc<scalar_t>::kVec;  // [position][ci]
  static constexpr int kSmemBytes = (kGoElems + kCiChunk * kWeightLd + kMmaRows * kMmaCols * kOutLd) * int(sizeof(E)) +
                                    2 * kRawBytes<sizeof(E)>;
  static_assert((kGoElems + kCiChunk * kWeightLd) * sizeof(E) % 16 == 0 &&
                    (kMmaRows * kMmaCols * kOutLd) * sizeof(E) % 16 == 0 && kRawBytes<sizeof(E)> % 16 == 0,
                "16-byte aligned regions");
};

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

// grad_weight's N: (tap, co) for the 16 taps and the real C_out channels, in 8-column MMA tiles.
template <int CO>
constexpr int kWgradTiles = (16 * CO + 7) / 8;
template <typename scalar_t>
struct WgradTile {
  using E = typename Tc<scalar_t>::E;
  // [position][ci] rows of 40 elements: ldmatrix.trans's 8 rows (80 bytes apart) fall in 8 distinct bank groups
  // (16-bit); the TF32 fragment reads (ci g, position t4), 40 t4 + g words apart, hit 32 distinct banks.
  static constexpr int kXLd = kCiChunk + 8;
  static constexpr int kStageElems = kMmaRows * kMmaCols * kXLd + kGoElems;  // input tile + grad_output tile
  static constexpr int kSmemBytes = 2 * kStageElems * int(sizeof(E));      // double-buffered
  static constexpr int kRawSmemBytes = kSmemBytes + 2 * kRawBytes<sizeof(E)>;  // plus raw grad_output rows
};

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

// Calls f(tag, std::integral_constant<int, CO>{}) with CO = cout for 1..3 and 4 otherwise (cout <= 4 here).
template <typename Tag, typename F>
void with_cout(int cout, Tag tag, F&& f) {
  switch (cout) {
    case 1: f(tag, std::integral_constant<int, 1>{}); break;
    case 2: f(tag, std::integral_constant<int, 2>{}); break;
    case 3: f(tag, std::integral_constant<int, 3>{}); break;
    default: f(tag, std::integral_constant<int, 4>{}); break;
  }
}

template <typename F>
void dispatch_small(at::ScalarType dtype, int cout, F&& f) {
  switch (dtype) {
    case at::kFloat: with_cout(cout, float{}, f); break;
    case at::kBFloat16: with_cout(cout, at::BFloat16{}, f); break;
    case at::kHalf: with_cout(cout, at::Half{}, f); break;
    default: TORCH_CHECK(false, "conv_transpose2d: the small-C_out path has no ", dtype, " kernel");
  }
}

// Shared memory of each tensor-core kernel, by dtype (fp16 as bf16): the fp32 (TF32) grad_input and grad_weight
// tiles exceed the 99 KB a block may have on sm_86/89/120, whose fp32 calls take the other kernels.
int forward_mma_smem(at::ScalarType dtype) {
  return dtype == at::kFloat ? ForwardTile<float, 16>::kSmemBytes : ForwardTile<at::BFloat16, 32>::kSmemBytes;
}
int grad_input_mma_smem(at::ScalarType dtype) {
  return dtype == at::kFloat ? GradInputTile<float>::kSmemBytes : GradInputTile<at::BFloat16>::kSmemBytes;
}
int grad_weight_mma_smem(at::ScalarType dtype) {
  return dtype == at::kFloat ? WgradTile<float>::kRawSmemBytes : WgradTile<at::BFloat16>::kRawSmemBytes;
}

// The tensor-core kernels take 16-bit dtypes, and fp32 where stock's convolutions would use TF32
// (at::globalContext().allowTF32CuDNN(CONV), on by default; with it off fp32 keeps the CUDA-core kernels' true fp32
// arithmetic), and whole 16-channel chunks; and code built for sm_80 or newer (mma.sync, cp.async, TF32) on a GPU
// that gives a block `smem_bytes`.
bool mma_applies(const ConvTranspose2dGeometry& g, at::ScalarType dtype, int smem_bytes) {
  const bool tf32 = dtype == at::kFloat && at::globalContext().allowTF32CuDNN(at::Float32Op::CONV);
  const DeviceCaps& caps = current_device_caps();
  return (dtype == at::kBFloat16 || dtype == at::kHalf || tf32) && g.in_channels % 16 == 0 &&
         caps.ampere_instructions() && caps.max_smem_per_block >= smem_bytes;
}

// The 16-byte copies' element count of t's dtype.
int64_t vec_of(const at::Tensor& t) { return 16 / int64_t(t.element_size()); }

// True when an activation's pixels can be copied 16 bytes at a time: channels innermost, every other stride a
// multiple of 16 bytes, 16-byte aligned data (a dense channels_last tensor with C % 8 == 0, for one).
bool reads_by_vectors(const at::Tensor& t) {
  const int64_t vec = vec_of(t);
  return t.stride(1) == 1 && t.stride(0) % vec == 0 && t.stride(2) % vec == 0 && t.stride(3) % vec == 0 &&
         reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

// gridDim.z of a persistent kernel whose blocks each own `blocks_per_image` tiles and loop over the images: as many
// blocks as are resident on the GPU at once (no second wave), at least one image per block.
template <typename Kernel>
int persistent_image_blocks(Kernel kernel, int smem_bytes, int blocks_per_image, int batch) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem_bytes));
  const int resident = std::max(1, per_sm) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return std::clamp(resident / blocks_per_image, 1, std::min(batch, 65535));
}

// True when every row of an activation is one contiguous run of whole, aligned 16-byte units: dense pixels
// (channels innermost, packed), rows and images starting at 16-byte boundaries (a dense channels_last tensor whose
// rows hold a multiple of 16 bytes, for one).
bool rows_are_byte_spans(const at::Tensor& t) {
  const int64_t row_elems = t.size(3) * t.size(1), vec = vec_of(t);
  return t.stride(1) == 1 && t.stride(3) == t.size(1) && row_elems % vec == 0 && t.stride(2) % vec == 0 &&
         t.stride(0) % vec == 0 && reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

SmallArgs base_args(const ConvTranspose2dGeometry& g) {
  SmallArgs a{};
  a.batch = int(g.batch);
  a.cin = int(g.in_channels);
  a.cout = int(g.out_channels);
  a.H = int(g.in_h);
  a.W = int(g.in_w);
  a.grad_input_slope = 1.f;
  return a;
}

}  // namespace

bool k4s2p1_small_cout_applies(const ConvTranspose2dGeometry& g, at::ScalarType dtype) {
  const bool shape = g.kernel_h == 4 && g.kernel_w == 4 && g.stride_h == 2 && g.stride_w == 2 && g.pad_h == 1 &&
                     g.pad_w == 1 && g.dilation_h == 1 && g.dilation_w == 1 && g.groups == 1 &&
                     g.out_h == 2 * g.in_h && g.out_w == 2 * g.in_w;
  if (!shape || g.out_channels > kSmallCoutMax || g.in_channels * g.out_channels > 1024) return false;
  // 32-bit pixel and element indices within one image, 32-bit pixel counts overall (offsets are 64-bit).
  if (g.in_pixels() >= INT_MAX / 4 || 4 * g.in_h * g.in_w * std::max(g.in_channels, g.out_channels) >= INT_MAX)
    return false;
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

void k4s2p1_small_cout_forward(const ConvTranspose2dGeometry& g, const at::Tensor& input4, const at::Tensor& weight,
                               const at::Tensor& bias, const at::Tensor& out) {
  c10::cuda::CUDAGuard device_guard(input4.device());
  SmallArgs a = base_args(g);
  a.w = weight.const_data_ptr();
  a.ws = strides_of(weight);
  a.x = input4.const_data_ptr();
  a.xs = strides_of(input4);
  a.bias = bias.defined() ? bias.const_data_ptr() : nullptr;
  a.out = out.mutable_data_ptr();
  a.os = strides_of(out);
  auto stream = at::cuda::getCurrentCUDAStream();
  if (mma_applies(g, input4.scalar_type(), forward_mma_smem(input4.scalar_type())) && reads_by_vectors(input4)) {
    const int tiles_x = (a.W + kMmaCols - 1) / kMmaCols, tiles_y = (a.H + kMmaRows - 1) / kMmaRows;
    dispatch_small(input4.scalar_type(), a.cout, [&](auto tag, auto co) {
      using scalar_t = decltype(tag);
      constexpr int CO = decltype(co)::value;
      auto launch = [&](auto kernel, int smem) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        const dim3 grid(tiles_x, tiles_y, persistent_image_blocks(kernel, smem, tiles_x * tiles_y, a.batch));
        kernel<<<grid, kThreads, smem, stream>>>(a, rows_are_byte_spans(out));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if constexpr (Tc<scalar_t>::kTf32)  // 16-channel chunks only (see ForwardTile)
        launch(small_cout_forward_mma_kernel<scalar_t, CO, 16>, ForwardTile<scalar_t, 16>::kSmemBytes);
      else if (a.cin % 32 == 0)
        launch(small_cout_forward_mma_kernel<scalar_t, CO, 32>, ForwardTile<scalar_t, 32>::kSmemBytes);
      else
        launch(small_cout_forward_mma_kernel<scalar_t, CO, 16>, ForwardTile<scalar_t, 16>::kSmemBytes);
    });
    return;
  }
  const bool channels_inner = a.xs.c == 1;
  const dim3 grid((a.W + kTileX - 1) / kTileX, (a.H + kTileY - 1) / kTileY, std::min(a.batch, 65535));
  dispatch_small(input4.scalar_type(), a.cout, [&](auto tag, auto co) {
    using scalar_t = decltype(tag);
    small_cout_forward_kernel<scalar_t, decltype(co)::value><<<grid, kThreads, 0, stream>>>(a, channels_inner);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void k4s2p1_small_cout_grad_input(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4,
                                  const at::Tensor& weight, const at::Tensor& grad_input,
                                  std::optional<double> leaky_relu_slope) {
  c10::cuda::CUDAGuard device_guard(grad_output4.device());
  SmallArgs a = base_args(g);
  a.grad_input_slope = float(leaky_relu_slope.value_or(1.0));
  a.w = weight.const_data_ptr();
  a.ws = strides_of(weight);
  a.go = grad_output4.const_data_ptr();
  a.gos = strides_of(grad_output4);
  a.out = grad_input.mutable_data_ptr();
  a.os = strides_of(grad_input);
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

bool k4s2p1_small_cout_grad_weight_applies(const ConvTranspose2dGeometry& g, const at::Tensor& input4) {
  return k4s2p1_small_cout_applies(g, input4.scalar_type()) &&
         mma_applies(g, input4.scalar_type(), grad_weight_mma_smem(input4.scalar_type())) &&
         reads_by_vectors(input4);
}

void k4s2p1_small_cout_grad_weight(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4,
                                   const at::Tensor& input4, const at::Tensor& grad_weight) {
  c10::cuda::CUDAGuard device_guard(grad_output4.device());
  SmallArgs a = base_args(g);
  a.x = input4.const_data_ptr();
  a.xs = strides_of(input4);
  a.go = grad_output4.const_data_ptr();
  a.gos = strides_of(grad_output4);
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
