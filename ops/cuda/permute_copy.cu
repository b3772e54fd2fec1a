// The tiled transposing copy of permute_copy.h.
#include "cuda/permute_copy.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace hierpar::detail {
namespace {

constexpr int kTile = 32, kTileRowsPerPass = 8;  // 32 x 8 threads move a 32 x 32 tile in 4 passes
constexpr int kPasses = kTile / kTileRowsPerPass;

// The copy as dst[b0, b1][r, c] = src[b0, b1][r, c], where r is the dimension contiguous in src (stride 1)
// and c dst's innermost one (stride 1): the other strides below, int64 (a tensor may exceed 2^31 elements).
struct TransposePlan {
  int64_t rows = 0, cols = 0;  // none: no tiles
  int64_t src_col_stride = 0, dst_row_stride = 0;
  int64_t batch[2] = {1, 1}, src_batch_stride[2] = {0, 0}, dst_batch_stride[2] = {0, 0};
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t tiles_c() const { return (cols + kTile - 1) / kTile; }
  int64_t tiles() const { return (rows + kTile - 1) / kTile * tiles_c() * batch[0] * batch[1]; }
};

// Moves tile t of copy p: a warp reads 32 consecutive src elements along r and, after the tile's transposition
// in shared memory, writes 32 consecutive dst elements along c. The tile row is padded by one element so that
// both accesses are free of bank conflicts (4-byte elements; 2- and 8-byte ones have at most 2-way conflicts).
template <typename in_t, typename out_t>
__device__ void move_tile(const TransposePlan& p, int64_t t, in_t (&tile)[kTile][kTile + 1]) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t tiles_c = (p.cols + kTile - 1) / kTile, per_batch = (p.rows + kTile - 1) / kTile * tiles_c;
  const int64_t b = t / per_batch, rem = t - b * per_batch, tr = rem / tiles_c, tc = rem - tr * tiles_c;
  const int64_t b0 = b / p.batch[1], b1 = b - b0 * p.batch[1];
  const in_t* s = static_cast<const in_t*>(p.src) + b0 * p.src_batch_stride[0] + b1 * p.src_batch_stride[1];
  out_t* d = static_cast<out_t*>(p.dst) + b0 * p.dst_batch_stride[0] + b1 * p.dst_batch_stride[1];
  const int64_t r0 = tr * kTile, c0 = tc * kTile;
  // All of a thread's loads are issued before the first is used (a loop storing each element to shared
  // memory as it arrives waits out one memory latency per pass: 4.0-4.2 us per 1-2 MB copy on the H200,
  // against 3.4 us this way).
  in_t v[kPasses];
#pragma unroll
  for (int k = 0; k < kPasses; ++k) {
    const int64_t r = r0 + tx, c = c0 + ty + k * kTileRowsPerPass;
    v[k] = r < p.rows && c < p.cols ? s[c * p.src_col_stride + r] : in_t();
  }
#pragma unroll
  for (int k = 0; k < kPasses; ++k) tile[ty + k * kTileRowsPerPass][tx] = v[k];
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kPasses; ++k) {
    const int64_t r = r0 + ty + k * kTileRowsPerPass, c = c0 + tx;
    if (r < p.rows && c < p.cols) {
      const in_t e = tile[tx][ty + k * kTileRowsPerPass];
      if constexpr (std::is_same_v<in_t, out_t>)
        d[r * p.dst_row_stride + c] = e;
      else
        d[r * p.dst_row_stride + c] = static_cast<out_t>(e);  // round to nearest even, as ATen's copy_
    }
  }
  __syncthreads();  // the tile is read before the next one overwrites it
}

// One or two copies (`second` has no tiles when there is one), grid-stride over the tiles of both: a copy of a
// few MB is a single wave whose time is mostly latency, so two in one launch take about as long as one.
template <typename in_t, typename out_t>
__global__ void __launch_bounds__(kTile * kTileRowsPerPass)
    transpose_tiles_kernel(const TransposePlan first, const TransposePlan second, int64_t first_tiles,
                           int64_t total_tiles) {
  __shared__ in_t tile[kTile][kTile + 1];  // [c - c0][r - r0]
  for (int64_t t = blockIdx.x; t < total_tiles; t += gridDim.x) {  // block-uniform branch
    if (t < first_tiles)
      move_tile<in_t, out_t>(first, t, tile);
    else
      move_tile<in_t, out_t>(second, t - first_tiles, tile);
  }
}

// The transposition that copies src into the dense dst, if there is one with at most two batch dimensions.
bool plan_transpose(const at::Tensor& dst, const at::Tensor& src, TransposePlan& p) {
  struct Dim {
    int64_t size, src_stride, dst_stride;
  };
  std::vector<Dim> dims;
  for (int64_t d = 0; d < dst.dim(); ++d)
    if (dst.size(d) > 1) dims.push_back({dst.size(d), src.stride(d), dst.stride(d)});
  // dst's memory order, outermost first (dst is dense: its strides of non-trivial dims are distinct).
  std::stable_sort(dims.begin(), dims.end(), [](const Dim& a, const Dim& b) { return a.dst_stride > b.dst_stride; });
  std::vector<Dim> merged;  // dimensions adjacent in both orders become one
  for (const Dim& d : dims) {
    if (!merged.empty() && merged.back().src_stride == d.src_stride * d.size &&
        merged.back().dst_stride == d.dst_stride * d.size) {
      merged.back() = {merged.back().size * d.size, d.src_stride, d.dst_stride};
    } else {
      merged.push_back(d);
    }
  }
  if (merged.size() < 2 || merged.size() > 4) return false;
  const Dim& col = merged.back();
  if (col.dst_stride != 1 || col.src_stride == 1) return false;
  int row = -1;
  for (int i = 0; i + 1 < int(merged.size()); ++i)
    if (merged[i].src_stride == 1) row = i;
  if (row < 0) return false;
  p = TransposePlan{};
  p.rows = merged[row].size;
  p.cols = col.size;
  p.src_col_stride = col.src_stride;
  p.dst_row_stride = merged[row].dst_stride;
  int nb = 0;
  // Batch dims fill the inner slot first: with one, b0 is always 0.
  for (int i = int(merged.size()) - 2; i >= 0; --i) {
    if (i == row) continue;
    p.batch[1 - nb] = merged[i].size;
    p.src_batch_stride[1 - nb] = merged[i].src_stride;
    p.dst_batch_stride[1 - nb] = merged[i].dst_stride;
    ++nb;
  }
  return true;
}

template <typename in_t, typename out_t>
void launch(const TransposePlan& first, const TransposePlan& second) {
  const int64_t first_tiles = first.tiles(), total = first_tiles + second.tiles();
  const int64_t max_blocks = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 8;
  const dim3 block(kTile, kTileRowsPerPass);
  transpose_tiles_kernel<in_t, out_t><<<int(std::min(total, max_blocks)), block, 0, at::cuda::getCurrentCUDAStream()>>>(
      first, second, first_tiles, total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The kernel's element types for copying src into dst: 0 when it has none (ATen's copy_ then), else an index
// for dispatch() (same dtype by element size, or fp32 into bf16 / fp16).
int kernel_types(const at::Tensor& dst, const at::Tensor& src) {
  const auto in = src.scalar_type(), out = dst.scalar_type();
  if (in == out) return dst.element_size() == 2 ? 1 : dst.element_size() == 4 ? 2 : dst.element_size() == 8 ? 3 : 0;
  if (in == at::kFloat && out == at::kBFloat16) return 4;
  if (in == at::kFloat && out == at::kHalf) return 5;
  return 0;
}

void dispatch(int types, const TransposePlan& first, const TransposePlan& second) {
  switch (types) {
    case 1: launch<uint16_t, uint16_t>(first, second); break;
    case 2: launch<uint32_t, uint32_t>(first, second); break;
    case 3: launch<uint64_t, uint64_t>(first, second); break;
    case 4: launch<float, c10::BFloat16>(first, second); break;
    default: launch<float, c10::Half>(first, second); break;
  }
}

// The plan of the tiled kernel for copying src into dst, if it applies (dst.numel() > 0).
bool plan_copy(const at::Tensor& dst, const at::Tensor& src, TransposePlan& p) {
  TORCH_INTERNAL_ASSERT(dst.sizes() == src.sizes() && dst.device() == src.device(), "permute_copy_: shapes differ");
  if (kernel_types(dst, src) == 0 || !dst.is_non_overlapping_and_dense() || !plan_transpose(dst, src, p))
    return false;
  p.src = src.const_data_ptr();
  p.dst = dst.mutable_data_ptr();
  return true;
}

}  // namespace

void permute_copy_(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.numel() == 0) return;
  TransposePlan p;
  if (plan_copy(dst, src, p)) {
    dispatch(kernel_types(dst, src), p, TransposePlan{});
  } else {
    at::Tensor target = dst;  // a handle on the same storage (the parameter is const)
    target.copy_(src);
  }
}

at::Tensor contiguous_as(const at::Tensor& t, c10::MemoryFormat format) {
  if (t.is_contiguous(format)) return t;
  at::Tensor out = at::empty(t.sizes(), t.options().memory_format(format));
  permute_copy_(out, t);
  return out;
}

std::array<at::Tensor, 2> contiguous_as(const at::Tensor& a, const at::Tensor& b, c10::MemoryFormat format) {
  if (!b.defined() || b.is_contiguous(format) || a.is_contiguous(format))
    return {contiguous_as(a, format), b.defined() ? contiguous_as(b, format) : b};
  at::Tensor out_a = at::empty(a.sizes(), a.options().memory_format(format));
  at::Tensor out_b = at::empty(b.sizes(), b.options().memory_format(format));
  TransposePlan pa, pb;
  if (a.numel() > 0 && b.numel() > 0 && plan_copy(out_a, a, pa) && plan_copy(out_b, b, pb) &&
      kernel_types(out_a, a) == kernel_types(out_b, b)) {
    dispatch(kernel_types(out_a, a), pa, pb);
  } else {
    permute_copy_(out_a, a);
    permute_copy_(out_b, b);
  }
  return {out_a, out_b};
}

}  // namespace hierpar::detail
