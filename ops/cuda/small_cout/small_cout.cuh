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
// One file per pass (forward.cu, grad_input.cu, grad_weight.cu: its kernels and its entry point); this header holds
// what they share: the arguments, the tensor-core operand formats and tiles, and the predicates.
#pragma once

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
inline Strides4d strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)}; }

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

// The staged weight element (input channel c0 + c, output channel co, tap ky * 4 + kx) as float; 0, without a
// read, for c >= cn or co >= C_out.
template <typename scalar_t>
__device__ inline float staged_weight(const SmallArgs& a, const scalar_t* w, int c0, int c, int cn, int co, int tap) {
  float v = 0.f;
  if (c < cn && co < a.cout)
    v = static_cast<float>(w[(c0 + c) * a.ws.n + co * a.ws.c + (tap >> 2) * a.ws.y + (tap & 3) * a.ws.x]);
  return v;
}

constexpr int kThreads = 256;


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
inline int forward_mma_smem(at::ScalarType dtype) {
  return dtype == at::kFloat ? ForwardTile<float, 16>::kSmemBytes : ForwardTile<at::BFloat16, 32>::kSmemBytes;
}
inline int grad_input_mma_smem(at::ScalarType dtype) {
  return dtype == at::kFloat ? GradInputTile<float>::kSmemBytes : GradInputTile<at::BFloat16>::kSmemBytes;
}
inline int grad_weight_mma_smem(at::ScalarType dtype) {
  return dtype == at::kFloat ? WgradTile<float>::kRawSmemBytes : WgradTile<at::BFloat16>::kRawSmemBytes;
}

// The tensor-core kernels take 16-bit dtypes, and fp32 where stock's convolutions would use TF32
// (at::globalContext().allowTF32CuDNN(CONV), on by default; with it off fp32 keeps the CUDA-core kernels' true fp32
// arithmetic), and whole 16-channel chunks; and code built for sm_80 or newer (mma.sync, cp.async, TF32) on a GPU
// that gives a block `smem_bytes`.
inline bool mma_applies(const ConvTranspose2dGeometry& g, at::ScalarType dtype, int smem_bytes) {
  const bool tf32 = dtype == at::kFloat && at::globalContext().allowTF32CuDNN(at::Float32Op::CONV);
  const DeviceCaps& caps = current_device_caps();
  return (dtype == at::kBFloat16 || dtype == at::kHalf || tf32) && g.in_channels % 16 == 0 &&
         caps.ampere_instructions() && caps.max_smem_per_block >= smem_bytes;
}

// The 16-byte copies' element count of t's dtype.
inline int64_t vec_of(const at::Tensor& t) { return 16 / int64_t(t.element_size()); }

// True when an activation's pixels can be copied 16 bytes at a time: channels innermost, every other stride a
// multiple of 16 bytes, 16-byte aligned data (a dense channels_last tensor with C % 8 == 0, for one). A dimension of
// size 1 is only ever indexed at 0, so its stride (which ATen leaves as it likes: a (N, C, 1, 1) tensor is
// channels_last with stride 1 there) does not matter.
inline bool reads_by_vectors(const at::Tensor& t) {
  const int64_t vec = vec_of(t);
  const auto whole_vectors = [&](int d) { return t.size(d) == 1 || t.stride(d) % vec == 0; };
  return t.stride(1) == 1 && whole_vectors(0) && whole_vectors(2) && whole_vectors(3) &&
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
inline bool rows_are_byte_spans(const at::Tensor& t) {
  const int64_t row_elems = t.size(3) * t.size(1), vec = vec_of(t);
  return t.stride(1) == 1 && t.stride(3) == t.size(1) && row_elems % vec == 0 && t.stride(2) % vec == 0 &&
         t.stride(0) % vec == 0 && reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

// A pass's arguments: the sizes, and the tensors it uses (undefined for those it does not: their pointers stay null).
inline SmallArgs small_args(const ConvTranspose2dGeometry& g, const at::Tensor& x, const at::Tensor& grad_output,
                            const at::Tensor& weight, const at::Tensor& out) {
  SmallArgs a{};
  a.batch = int(g.batch);
  a.cin = int(g.in_channels);
  a.cout = int(g.out_channels);
  a.H = int(g.in_h);
  a.W = int(g.in_w);
  auto read = [](const at::Tensor& t, const void*& data, Strides4d& strides) {
    if (!t.defined()) return;
    data = t.const_data_ptr();
    strides = strides_of(t);
  };
  read(x, a.x, a.xs);
  read(grad_output, a.go, a.gos);
  read(weight, a.w, a.ws);
  if (out.defined()) {
    a.out = out.mutable_data_ptr();
    a.os = strides_of(out);
  }
  a.grad_input_slope = 1.f;
  return a;
}

}  // namespace
}  // namespace hierpar::detail
