// CUDA kernels of hierpar::batch_norm_act and its backward, NCHW and channels_last natively, statistics in
// float32 (float64 for float64 inputs).
//
// Work layout. Each thread accesses V elements at once (16 bytes: 8 bf16/fp16, 4 fp32, 2 fp64; V = 1 when
// the shape or alignment does not allow it). The tensor is seen as "vector rows" per channel column:
//  - channels_last (and any input with H*W == 1): a row is one (n, h, w) position, a column is V
//    consecutive channels; a block has bx (<= 8) columns on threadIdx.x (a warp reads whole 128-byte rows
//    segments) and 512/bx row lanes on threadIdx.y.
//  - NCHW: a column is one channel (bx = 1), a row is V consecutive elements of one (n, c) plane.
// Every thread keeps per-lane statistics (sums of the values and of their squares, shifted by the
// channel's element at row 0, the same shift in every thread; V channels in channels_last, V lanes of one
// channel in NCHW, added before the block reduction), reduces them by addition through warp shuffles and
// shared memory.
//  - One-kernel path (each channel group has <= 8 vectors per thread): one block per channel group does
//    statistics, running-stat update and the elementwise pass (whose second read hits L1/L2). The backward
//    likewise: sums of dy' and dy'*xhat, then grad_input.
//  - Split path: the rows of a channel group are split over blocks, ONE cooperative launch per direction
//    (grid <= the blocks that fit at once, which cudaLaunchCooperativeKernel guarantees to be resident).
//    Each block writes a partial state, the grid synchronises, then every block combines its group's
//    partials itself, in the same order in every block (so all get bit-identical statistics; block row 0
//    writes them out), and goes on to the elementwise pass over its own rows.
//  - Split path: the first rows of each thread are staged in dynamic shared memory by cp.async (as many as
//    the SM's shared memory leaves per block at the kernel's occupancy; every stream the kernel reads), so
//    the elementwise pass reads them from there instead of L2/DRAM. Only the rows beyond those are read
//    twice from global memory.
//  - Cluster path (Hopper; tensors up to 8 MiB with up to 512 rows per CTA, all staged): instead of the
//    cooperative grid, a channel group's row splits are the CTAs of one thread-block cluster (up to 8).
//    Each CTA puts its block sums into every CTA's shared memory (distributed shared memory), the cluster
//    barrier replaces the grid barrier, and every CTA adds the slots in rank order itself: no global
//    partials, no grid-wide barrier, the same bit-identical statistics in every CTA. Every row is staged,
//    so each element is read from global memory once.
//  - The elementwise pass walks a thread's global rows in reverse (those read last are the likeliest to be
//    still in L2), loads them as last use (evict-first) and streams its stores, so writing the output does
//    not evict input rows not yet re-read.
#include "batch_norm_act_shape.h"
#include "common.h"
#include "cuda/arch_guard.cuh"
#include "cuda/device_caps.h"

#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cooperative_groups.h>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace hierpar::detail::bn {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCols = 8;  // channels_last columns per block (vector path)
constexpr int kUnroll = 4;   // vectors in flight per thread and stream
constexpr unsigned kFull = 0xffffffffu;

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// The raw type of a Vec's bytes for the cache-hinted load/store intrinsics.
template <int kBytes>
struct RawOf;
template <>
struct RawOf<16> { using type = uint4; };
template <>
struct RawOf<8> { using type = unsigned long long; };
template <>
struct RawOf<4> { using type = unsigned int; };
template <>
struct RawOf<2> { using type = unsigned short; };

// Last read of a value (ld.global.cs: evict first).
template <typename VecT>
__device__ __forceinline__ VecT load_last_use(const VecT* p) {
  using Raw = typename RawOf<sizeof(VecT)>::type;
  const Raw raw = __ldcs(reinterpret_cast<const Raw*>(p));
  VecT v;
  memcpy(&v, &raw, sizeof(VecT));
  return v;
}

// A result nobody in this kernel reads again (st.global.cs: streaming).
template <typename VecT>
__device__ __forceinline__ void store_streaming(VecT* p, const VecT& v) {
  using Raw = typename RawOf<sizeof(VecT)>::type;
  Raw raw;
  memcpy(&raw, &v, sizeof(VecT));
  __stcs(reinterpret_cast<Raw*>(p), raw);
}

// Calls use(load(j), j) for this thread's rows j in [j0, j1) in reverse order, kUnroll loads before their
// uses (j indexes the thread's rows: row r0 + threadIdx.y + j * blockDim.y).
template <typename Load, typename Use>
__device__ __forceinline__ void for_rows_reversed(int j0, int j1, Load load, Use use) {
  int j = j1;
  for (; j - j0 >= kUnroll; j -= kUnroll) {
    decltype(load(j0)) v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load(j - 1 - u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) use(v[u], j - 1 - u);
  }
  for (; j > j0; --j) use(load(j - 1), j - 1);
}

// Calls add(load(j)) for this thread's rows j in [j0, j1) in order, kLoads loads in flight.
template <int kLoads, typename Load, typename Add>
__device__ __forceinline__ void for_rows(int j0, int j1, Load load, Add add) {
  int j = j0;
  for (; j + kLoads <= j1; j += kLoads) {
    decltype(load(j0)) v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) v[u] = load(j + u);
#pragma unroll
    for (int u = 0; u < kLoads; ++u) add(v[u]);
  }
  for (; j < j1; ++j) add(load(j));
}

// Staging a block's rows in shared memory (split path): cp.async copies global -> shared without passing
// through registers, so a thread can have all its staged rows in flight at once; the thread that copies
// a vector is the only one that reads it, so waiting for its own copies is the only synchronisation.
// cp.async moves 4, 8 or 16 bytes: 2-byte vectors (16-bit scalar path) are not staged.
template <typename VecT>
constexpr bool kStageable = sizeof(VecT) == 4 || sizeof(VecT) == 8 || sizeof(VecT) == 16;

// cp.async exists from sm_80 on; sm_75 code never stages (stageable_rows is 0 there), so it traps.
template <typename VecT>
__device__ __forceinline__ void copy_async(VecT* dst, const VecT* src) {
#ifdef HIERPAR_PRE_SM80_CODE
  __trap();
#else
  const auto s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (sizeof(VecT) == 16) {  // .cg: through L2 only (no reuse from L1)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(src), "n"(sizeof(VecT)) : "memory");
  }
#endif
}

__device__ __forceinline__ void copy_async_commit() {
#ifdef HIERPAR_PRE_SM80_CODE
  __trap();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int kPending>
__device__ __forceinline__ void copy_async_wait() {
#ifdef HIERPAR_PRE_SM80_CODE
  __trap();
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Requests the staged rows [0, jc) (stage(j) issues row j's copies) in four commit groups, so that their
// use can start once the first quarter has landed.
template <typename Stage>
__device__ __forceinline__ void stage_rows(int jc, Stage stage) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    for (int j = jc * q / 4; j < jc * (q + 1) / 4; ++j) stage(j);
    copy_async_commit();
  }
}

// Calls use(j) for the staged rows [0, jc) in order, each quarter once its copies have landed.
template <typename Use>
__device__ __forceinline__ void for_staged_rows(int jc, Use use) {
  copy_async_wait<3>();
  for (int j = 0; j < jc / 4; ++j) use(j);
  copy_async_wait<2>();
  for (int j = jc / 4; j < jc * 2 / 4; ++j) use(j);
  copy_async_wait<1>();
  for (int j = jc * 2 / 4; j < jc * 3 / 4; ++j) use(j);
  copy_async_wait<0>();
  for (int j = jc * 3 / 4; j < jc; ++j) use(j);
}

// Rows of a channel column and how a block's rows are split.
struct Tile {
  int64_t C;      // channels
  int64_t cols;   // channel columns: C / V (channels_last) or C (NCHW)
  int64_t rows;   // vector rows per column: N*H*W (channels_last) or N*H*W / V (NCHW)
  int64_t L;      // H*W (NCHW addressing)
  int64_t chunk;  // rows per split
  int splits;
  int staged_rows;  // rows per thread staged in shared memory (split path; 0: none)
  int cluster;      // 1: the splits are one thread-block cluster (grid.y == splits), combined through DSMEM
  int exchange_bytes;  // cluster path: the exchange buffer at the start of the dynamic shared memory
  at::cuda::detail::IntDivider<uint32_t> div_lv;  // NCHW: row -> (n, vector in the plane)
};

// This thread's rows of its block's range [r0, r1): r0 + threadIdx.y + j * blockDim.y for j < count.
struct ThreadRows {
  int64_t first;
  int count;
  __device__ __forceinline__ ThreadRows(int64_t r0, int64_t r1, bool active) {
    first = r0 + threadIdx.y;
    count = active && first < r1 ? static_cast<int>((r1 - first + blockDim.y - 1) / blockDim.y) : 0;
  }
  __device__ __forceinline__ int64_t row(int j) const { return first + static_cast<int64_t>(j) * blockDim.y; }
};

template <bool kCL, int V>
__device__ __forceinline__ int64_t vec_offset(const Tile& t, int64_t col, int64_t r) {
  if constexpr (kCL) {
    return r * t.C + col * V;
  } else {
    auto d = t.div_lv.divmod(static_cast<uint32_t>(r));
    return (static_cast<int64_t>(d.div) * t.C + col) * t.L + static_cast<int64_t>(d.mod) * V;
  }
}

// Elements of one channel held by one lane of a row range: 1 per row (channels_last) or V (NCHW).
template <bool kCL, int V>
constexpr int kPerRow = kCL ? 1 : V;

// Two sums per channel of K channels, combined by addition: the backward's sum dy' (p) and sum dy' * xhat
// (q); the forward's sum of the shifted values (p) and of their squares (q).
template <typename acc_t, int K>
struct SumsK {
  acc_t p[K], q[K];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int k = 0; k < K; ++k) p[k] = q[k] = 0;
  }
  __device__ __forceinline__ void combine(const SumsK& b) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      p[k] += b.p[k];
      q[k] += b.q[k];
    }
  }
  __device__ __forceinline__ void combine_xor(int off) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      p[k] += __shfl_xor_sync(kFull, p[k], off);
      q[k] += __shfl_xor_sync(kFull, q[k], off);
    }
  }
};

// Reduces each column's state over the block's row lanes (threadIdx.y); the result is valid in the threads
// with threadIdx.y == 0 (tid < blockDim.x). blockDim.x divides 32. `smem` holds kWarps * blockDim.x states.
template <typename State>
__device__ __forceinline__ State reduce_columns(State s, State* smem) {
  const int bx = blockDim.x;
  for (int off = 16; off >= bx; off >>= 1) s.combine_xor(off);
  const int tid = threadIdx.y * bx + threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (lane < bx) smem[warp * bx + lane] = s;
  __syncthreads();
  if (tid < bx) {
    s = smem[tid];
    for (int w = 1; w < kWarps; ++w) s.combine(smem[w * bx + tid]);
  }
  __syncthreads();  // smem is reused by the caller
  return s;
}

// Tree reduction over `parts` (a power of two) states of `ch` channels laid out [part][ch] in smem, valid
// in smem[0..ch) afterwards. Every thread of the block calls it; thread tid holds smem[tid] on entry.
template <typename State>
__device__ __forceinline__ void reduce_parts(State* smem, int ch, int parts) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int part = tid / ch;
  __syncthreads();
  for (int off = parts / 2; off > 0; off >>= 1) {
    if (part < off) {
      State a = smem[tid];
      a.combine(smem[tid + off * ch]);
      smem[tid] = a;
    }
    __syncthreads();
  }
}

// After each block has written its partial state: waits until every block of the (cooperatively
// launched, hence fully resident) grid has; grid.sync() orders the partials' writes before the reads.
__device__ __forceinline__ void wait_for_all_partials() {
  cooperative_groups::this_grid().sync();
}

// Cluster path (sm_90). Every thread arrives at the cluster barrier when the kernel starts; the wait for
// that phase comes before the first store into another CTA's shared memory, which is only valid once that
// CTA runs.
__device__ __forceinline__ void cluster_arrive_at_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __cluster_barrier_arrive_relaxed();
#endif
}

// The channel group's totals over the cluster's CTAs (its row splits) of the block sums `s` (valid in
// threads tid < bx: the K channels of column tx). Each CTA puts its sums into slot `rank` of every CTA's
// exchange buffer `xch` ([cluster][2][bx * K] in shared memory); after the cluster barrier every CTA adds
// the slots in rank order: the same additions in every CTA, so all have bit-identical totals. Returns the
// totals of the group's channel tid in threads tid < bx * K.
template <typename acc_t, int K>
__device__ __forceinline__ SumsK<acc_t, 1> cluster_totals(const SumsK<acc_t, K>& s, acc_t* xch, int cluster) {
  SumsK<acc_t, 1> total;
  total.zero();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  const int bx = blockDim.x, tx = threadIdx.x, tid = threadIdx.y * bx + tx;
  const int chb = bx * K, slot = 2 * chb;
  const int rank = static_cast<int>(cg::this_cluster().block_rank());
  acc_t* const mine = xch + rank * slot;
  if (tid < bx) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      mine[tx * K + k] = s.p[k];
      mine[chb + tx * K + k] = s.q[k];
    }
  }
  __syncthreads();
  __cluster_barrier_wait();  // the phase every thread arrived at when its kernel started
  for (int i = tid; i < cluster * slot; i += kThreads) {
    const int r = i / slot;
    if (r != rank) *cg::this_cluster().map_shared_rank(mine + i % slot, r) = mine[i % slot];
  }
  __cluster_barrier_arrive();  // release: this CTA's stores into the others' slots
  __cluster_barrier_wait();    // acquire: every CTA's slot has landed here
  if (tid < chb) {
    for (int r = 0; r < cluster; ++r) {
      total.p[0] += xch[r * slot + tid];
      total.q[0] += xch[r * slot + chb + tid];
    }
  }
#else
  __trap();  // the host takes the cluster path on sm_90 and newer only
#endif
  return total;
}

template <typename acc_t>
__device__ __forceinline__ acc_t activate(acc_t y, Act act, acc_t slope) {
  if (act == Act::relu) return y > acc_t(0) ? y : acc_t(0);
  if (act == Act::leaky_relu) return y > acc_t(0) ? y : y * slope;
  return y;
}

// Shared-memory bytes for the reductions of a kernel whose thread state is `State` (kBx columns at most).
template <typename State, typename State1, int kBx>
constexpr size_t kReduceBytes = kWarps * kBx * sizeof(State) > kThreads * sizeof(State1)
                                    ? kWarps * kBx * sizeof(State)
                                    : kThreads * sizeof(State1);
constexpr int kMaxChannelsPerBlock = 64;  // bx * K: <= 8 columns of 8 lanes, or 32 columns of 1

template <bool kCL, int V>
constexpr int kBxMax = kCL ? (V == 1 ? 32 : kMaxCols) : 1;

template <typename acc_t>
struct ForwardArgs {
  const acc_t* weight;  // nullable: 1
  const acc_t* bias;    // nullable: 0
  acc_t* running_mean;  // nullable
  acc_t* running_var;
  acc_t* save_mean;
  acc_t* save_invstd;
  acc_t* partial;  // [2, splits, C]: mean, m2 (split path)
  acc_t momentum, eps, slope;
  Act act;
  bool training;
  int64_t* num_batches_tracked;  // nullable: incremented with channel 0's running statistics

  // What finalize reads of channel ch (the running statistics only `with_running`).
  struct Channel {
    acc_t gamma, beta, running_mean, running_var;
  };
  __device__ __forceinline__ Channel channel_params(int64_t ch, bool with_running) const {
    Channel c;
    c.gamma = weight ? weight[ch] : acc_t(1);
    c.beta = bias ? bias[ch] : acc_t(0);
    c.running_mean = with_running && running_mean ? running_mean[ch] : acc_t(0);
    c.running_var = with_running && running_mean ? running_var[ch] : acc_t(0);
    return c;
  }

  // The affine map (scale, shift) of the normalisation of channel ch from its state over all rows; with
  // `write`, also stores the statistics and updates the running stats (one block per channel does; `c` then
  // holds the running statistics).
  __device__ __forceinline__ void finalize(int64_t ch, const Channel& c, acc_t n, acc_t mean, acc_t m2, bool write,
                                           acc_t& scale, acc_t& shift) const {
    const acc_t var = m2 / n;
    const acc_t invstd = acc_t(1) / sqrt(var + eps);
    if (write) {
      save_mean[ch] = mean;
      save_invstd[ch] = invstd;
      if (running_mean) {
        const acc_t unbiased = var * (n / (n - acc_t(1)));
        running_mean[ch] = (acc_t(1) - momentum) * c.running_mean + momentum * mean;
        running_var[ch] = (acc_t(1) - momentum) * c.running_var + momentum * unbiased;
      }
      // Here rather than by an add kernel of the layer's: in a DCGAN step those were 14 launches, most of them
      // on the critical path of the captured step.
      if (num_batches_tracked != nullptr && ch == 0) *num_batches_tracked += 1;
    }
    affine(c, mean, invstd, scale, shift);
  }
  __device__ __forceinline__ void affine(const Channel& c, acc_t mean, acc_t invstd, acc_t& scale, acc_t& shift) const {
    scale = c.gamma * invstd;
    shift = c.beta - mean * scale;
  }
};

// Training: statistics (the whole group's rows in this block, or this block's rows and then a grid-wide
// combine), running stats, then the elementwise pass. Eval: the elementwise pass with the running stats.
template <typename scalar_t, typename acc_t, bool kCL, int V>
__global__ void __launch_bounds__(kThreads) batch_norm_act_forward_kernel(
    const scalar_t* __restrict__ x, scalar_t* __restrict__ out, Tile t, ForwardArgs<acc_t> a) {
  constexpr int K = kCL ? V : 1;  // channels per thread
  using S = SumsK<acc_t, K>;  // p: sum of the shifted values, q: of their squares
  using S1 = SumsK<acc_t, 1>;
  using VecT = Vec<scalar_t, V>;
  __shared__ __align__(16) unsigned char smem_raw[kReduceBytes<S, S1, kBxMax<kCL, V>>];
  __shared__ acc_t s_scale[kMaxChannelsPerBlock], s_shift[kMaxChannelsPerBlock];
  if (t.cluster) cluster_arrive_at_start();
  const int bx = blockDim.x, tx = threadIdx.x;
  const int tid = threadIdx.y * bx + tx;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * bx + tx;
  const bool active = col < t.cols;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * t.chunk;
  const int64_t r1 = min(t.rows, r0 + t.chunk);
  auto channel = [&](int k) { return kCL ? col * V + k : col; };

  // Dynamic shared memory: the cluster path's exchange buffer, then the staged rows: [row][thread]
  // vectors, conflict-free.
  extern __shared__ __align__(16) unsigned char staged_raw[];
  const ThreadRows rows(r0, r1, active);
  auto row_ptr = [&](int j) { return reinterpret_cast<const VecT*>(x + vec_offset<kCL, V>(t, col, rows.row(j))); };
  // Rows [0, staged) of this thread live in shared memory from the statistics to the elementwise pass.
  const int staged = min(rows.count, t.staged_rows);
  VecT* const stage = reinterpret_cast<VecT*>(staged_raw + t.exchange_bytes) + tid;  // row j at stage[j * kThreads]

  acc_t scale[V], shift[V];
  if (a.training) {
    if constexpr (kStageable<VecT>) {
      stage_rows(staged, [&](int j) { copy_async(stage + j * kThreads, row_ptr(j)); });
    }
    // Every lane of a channel sums its values shifted by the same value, the channel's element at row 0
    // (read by every thread of the column; an L2 hit after the first), so that the block and grid combines
    // are plain sums in a fixed order: no division, no count per state (a channel's count is N*H*W), and
    // bit-identical results in every block and every call.
    acc_t origin[V], s1[V], s2[V];
    {
      const VecT v0 = active ? *reinterpret_cast<const VecT*>(x + vec_offset<kCL, V>(t, col, 0)) : VecT{};
#pragma unroll
      for (int u = 0; u < V; ++u) {
        origin[u] = static_cast<acc_t>(v0.v[kCL ? u : 0]);
        s1[u] = s2[u] = 0;
      }
    }
    auto add = [&](const VecT& v) {
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const acc_t d = static_cast<acc_t>(v.v[u]) - origin[u];
        s1[u] += d;
        s2[u] += d * d;
      }
    };
    // The rows beyond the staged ones (while the staged copies are in flight), then the staged rows.
    // 16-bit channels_last: twice the loads in flight, which the registers allow without lowering the
    // blocks per SM.
    constexpr int kStatsUnroll = kCL && V == 8 ? 2 * kUnroll : kUnroll;
    for_rows<kStatsUnroll>(staged, rows.count, [&](int j) { return *row_ptr(j); }, add);
    for_staged_rows(staged, [&](int j) { add(stage[j * kThreads]); });
    // Split and cluster paths: thread tid < bx * K finishes channel tid of the group. It loads that
    // channel's shift, parameters and running statistics now, so that their latency overlaps the
    // reductions and the barrier instead of following them.
    const int chb = bx * K;
    const int64_t fch = static_cast<int64_t>(blockIdx.x) * chb + tid;
    const bool finisher = t.splits > 1 && tid < chb && fch < t.C;
    acc_t f_origin = 0;
    typename ForwardArgs<acc_t>::Channel f_params{};
    if (finisher) {
      f_origin = static_cast<acc_t>(x[kCL ? fch : fch * t.L]);  // row 0 of channel fch
      f_params = a.channel_params(fch, blockIdx.y == 0);
    }
    S s;
    s.zero();
#pragma unroll
    for (int u = 0; u < V; ++u) {  // NCHW: the V lanes of one channel
      s.p[kCL ? u : 0] += s1[u];
      s.q[kCL ? u : 0] += s2[u];
    }
    s = reduce_columns(s, reinterpret_cast<S*>(smem_raw));
    const acc_t count = static_cast<acc_t>(t.rows * kPerRow<kCL, V>);
    // (n, mean, m2) of a channel from its shifted sums: mean = origin + S1 / n, m2 = S2 - S1^2 / n.
    auto finish = [&](int64_t ch, const typename ForwardArgs<acc_t>::Channel& c, acc_t org, acc_t sum,
                      acc_t sum_sq, bool write, acc_t& sc, acc_t& sh) {
      const acc_t d = sum / count;
      a.finalize(ch, c, count, org + d, max(sum_sq - sum * d, acc_t(0)), write, sc, sh);
    };
    if (t.splits == 1) {
      if (tid < bx && active) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
          finish(channel(k), a.channel_params(channel(k), true), origin[k], s.p[k], s.q[k], true,
                 s_scale[tx * K + k], s_shift[tx * K + k]);
        }
      }
    } else if (t.cluster) {
      const S1 total = cluster_totals(s, reinterpret_cast<acc_t*>(staged_raw), t.splits);
      if (finisher) {
        finish(fch, f_params, f_origin, total.p[0], total.q[0], blockIdx.y == 0, s_scale[tid], s_shift[tid]);
      }
    } else {
      if (tid < bx && active) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
          a.partial[static_cast<int64_t>(blockIdx.y) * t.C + channel(k)] = s.p[k];
          a.partial[(static_cast<int64_t>(t.splits) + blockIdx.y) * t.C + channel(k)] = s.q[k];
        }
      }
      wait_for_all_partials();
      // Threads = (channel of the group) x (part of the splits): each part sums its splits (independent
      // loads), then a tree over the parts; the same order in every block.
      const int parts = kThreads / chb;
      const int lc = tid % chb, part = tid / chb;
      const int64_t ch = static_cast<int64_t>(blockIdx.x) * chb + lc;
      S1 total;
      total.zero();
      if (ch < t.C) {
#pragma unroll 8
        for (int sp = part; sp < t.splits; sp += parts) {
          total.p[0] += __ldcg(&a.partial[static_cast<int64_t>(sp) * t.C + ch]);
          total.q[0] += __ldcg(&a.partial[(static_cast<int64_t>(t.splits) + sp) * t.C + ch]);
        }
      }
      S1* sm = reinterpret_cast<S1*>(smem_raw);
      sm[tid] = total;
      reduce_parts(sm, chb, parts);
      if (finisher) {
        finish(fch, f_params, f_origin, sm[tid].p[0], sm[tid].q[0], blockIdx.y == 0, s_scale[tid], s_shift[tid]);
      }
    }
    __syncthreads();
    if (!active) return;
#pragma unroll
    for (int u = 0; u < V; ++u) {
      scale[u] = s_scale[kCL ? tx * V + u : 0];
      shift[u] = s_shift[kCL ? tx * V + u : 0];
    }
  } else {
    // Eval: the running statistics; the first block row also returns them as save_mean/save_invstd.
    if (!active) return;
#pragma unroll
    for (int u = 0; u < V; ++u) {
      const int64_t ch = channel(kCL ? u : 0);
      const acc_t mean = a.running_mean[ch], invstd = acc_t(1) / sqrt(a.running_var[ch] + a.eps);
      if (blockIdx.y == 0 && threadIdx.y == 0 && (kCL || u == 0)) {
        a.save_mean[ch] = mean;
        a.save_invstd[ch] = invstd;
      }
      a.affine(a.channel_params(ch, false), mean, invstd, scale[u], shift[u]);
    }
  }
  auto normalise = [&](const VecT& v, int j) {
    VecT o;
#pragma unroll
    for (int u = 0; u < V; ++u) {
      o.v[u] = static_cast<scalar_t>(activate(static_cast<acc_t>(v.v[u]) * scale[u] + shift[u], a.act, a.slope));
    }
    store_streaming(reinterpret_cast<VecT*>(out + vec_offset<kCL, V>(t, col, rows.row(j))), o);
  };
  for_rows_reversed(staged, rows.count, [&](int j) { return load_last_use(row_ptr(j)); }, normalise);
  for (int j = 0; j < staged; ++j) normalise(stage[j * kThreads], j);
}

template <typename acc_t>
struct BackwardArgs {
  const acc_t* weight;
  const acc_t* bias;
  const acc_t* save_mean;
  const acc_t* save_invstd;
  acc_t* grad_weight;  // sum(dy' * xhat) per channel, always written when reducing
  acc_t* grad_bias;    // sum(dy') per channel
  acc_t* partial;      // [2, splits, C] (split path)
  acc_t slope;
  acc_t inv_count;  // 1 / (N*H*W)
  Act act;
  bool training;
};

enum Mode : int { kSums = 1, kGradInput = 2 };

// Per element the backward needs dy' (the gradient at the pre-activation) and xhat. The activation's
// derivative comes from the output's sign (out > 0 exactly when y > 0, slope > 0): dy' = dy for out > 0,
// else dy * neg_slope (relu 0, leaky_relu slope, identity 1). xhat is affine in src, the input when given,
// otherwise the output, with per-sign coefficients: xhat = src * (out > 0 ? mp : mn) + b0, where for the
// input mp = mn = invstd, b0 = -mean * invstd, and for the output (inverting the activation,
// y = out / slope for out <= 0) mp = 1 / gamma, mn = mp / slope (leaky_relu; mp otherwise),
// b0 = -beta / gamma. One FMA per element, no division (see docs/batch_norm_act.md on precision).
// gamma == 0 makes xhat unrecoverable from the output: mp = mn = b0 = 0 (xhat enters grad_input only
// times gamma, and grad_weight is returned as NaN). kHasX (the input is given) is a template parameter so
// that the output-only kernel holds neither the input's registers nor the per-sign coefficients it does
// not need (register pressure decides how many threads an SM keeps).
template <typename scalar_t, typename acc_t, bool kCL, int V, bool kHasX>
__global__ void __launch_bounds__(kThreads) batch_norm_act_backward_kernel(
    const scalar_t* __restrict__ dy, const scalar_t* __restrict__ out, const scalar_t* __restrict__ x,
    scalar_t* __restrict__ dx, Tile t, BackwardArgs<acc_t> a, int mode) {
  constexpr int K = kCL ? V : 1;
  using S = SumsK<acc_t, K>;
  using S1 = SumsK<acc_t, 1>;
  using VecT = Vec<scalar_t, V>;
  __shared__ __align__(16) unsigned char smem_raw[kReduceBytes<S, S1, kBxMax<kCL, V>>];
  __shared__ acc_t s_mean_dy[kMaxChannelsPerBlock], s_mean_dyx[kMaxChannelsPerBlock];
  __shared__ acc_t s_k[kMaxChannelsPerBlock];  // gamma * invstd per channel of the group (with the sums)
  const int bx = blockDim.x, tx = threadIdx.x;
  const int tid = threadIdx.y * bx + tx;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * bx + tx;
  const bool active = col < t.cols;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * t.chunk;
  const int64_t r1 = min(t.rows, r0 + t.chunk);
  if (t.cluster) cluster_arrive_at_start();
  constexpr bool has_x = kHasX;
  const acc_t neg_slope = a.act == Act::relu ? acc_t(0) : a.act == Act::leaky_relu ? a.slope : acc_t(1);
  auto channel = [&](int k) { return kCL ? col * V + k : col; };

  // xhat coefficients and gamma of this thread's channels.
  acc_t gamma[K], mp[K], mn[kHasX ? 1 : K], b0[K];  // with the input, mn = mp
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t ch = active ? channel(k) : 0;
    gamma[k] = active && a.weight ? a.weight[ch] : acc_t(1);
    if constexpr (kHasX) {
      const acc_t invstd = active ? a.save_invstd[ch] : acc_t(0);
      mp[k] = invstd;
      b0[k] = active ? -a.save_mean[ch] * invstd : acc_t(0);
    } else {
      mp[k] = gamma[k] != acc_t(0) ? acc_t(1) / gamma[k] : acc_t(0);
      mn[k] = a.act == Act::leaky_relu ? mp[k] / a.slope : mp[k];
      b0[k] = active && a.bias ? -a.bias[ch] * mp[k] : acc_t(0);
    }
  }
  auto xhat_coef = [&](bool pos, int k) {
    if constexpr (kHasX) return mp[k];
    else return pos ? mp[k] : mn[k];
  };
  struct LoadedX {
    VecT dy, out, x;
  };
  struct LoadedOut {
    VecT dy, out;
  };
  using Loaded = std::conditional_t<kHasX, LoadedX, LoadedOut>;
  // The element at index u of a loaded row: its source of xhat (input or output).
  auto src_of = [](const Loaded& l, int u) {
    if constexpr (kHasX) return static_cast<acc_t>(l.x.v[u]);
    else return static_cast<acc_t>(l.out.v[u]);
  };

  // Dynamic shared memory: the cluster path's exchange buffer, then the staged rows: [row][stream][thread]
  // vectors, conflict-free; streams dy, out and (kHasX) x.
  extern __shared__ __align__(16) unsigned char staged_raw[];
  constexpr int kStreams = kHasX ? 3 : 2;
  const ThreadRows rows(r0, r1, active);
  const int staged = min(rows.count, t.staged_rows);  // the host stages only when both passes run
  VecT* const stage = reinterpret_cast<VecT*>(staged_raw + t.exchange_bytes) + tid;
  auto staged_at = [&](int j, int stream) { return stage + (j * kStreams + stream) * kThreads; };
  auto load_staged = [&](int j) {
    Loaded l;
    l.dy = *staged_at(j, 0);
    l.out = *staged_at(j, 1);
    if constexpr (kHasX) l.x = *staged_at(j, 2);
    return l;
  };
  auto offset_of = [&](int j) { return vec_offset<kCL, V>(t, col, rows.row(j)); };

  if (mode & kSums) {
    if constexpr (kStageable<VecT>) {
      stage_rows(staged, [&](int j) {
        const int64_t off = offset_of(j);
        copy_async(staged_at(j, 0), reinterpret_cast<const VecT*>(dy + off));
        copy_async(staged_at(j, 1), reinterpret_cast<const VecT*>(out + off));
        if constexpr (kHasX) copy_async(staged_at(j, 2), reinterpret_cast<const VecT*>(x + off));
      });
    }
    auto load = [&](int j) {
      Loaded l;
      const int64_t off = offset_of(j);
      l.dy = *reinterpret_cast<const VecT*>(dy + off);
      l.out = *reinterpret_cast<const VecT*>(out + off);
      if constexpr (kHasX) l.x = *reinterpret_cast<const VecT*>(x + off);
      return l;
    };
    acc_t sdy[V], sdyx[V];
#pragma unroll
    for (int u = 0; u < V; ++u) sdy[u] = sdyx[u] = 0;
    auto add = [&](const Loaded& l) {
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const int k = kCL ? u : 0;
        const acc_t o = static_cast<acc_t>(l.out.v[u]), d = static_cast<acc_t>(l.dy.v[u]);
        const bool pos = o > acc_t(0);
        const acc_t g = pos ? d : d * neg_slope;
        const acc_t xhat = src_of(l, u) * xhat_coef(pos, k) + b0[k];
        sdy[u] += g;
        sdyx[u] += g * xhat;
      }
    };
    // The rows beyond the staged ones (while the staged copies are in flight), then the staged rows.
    for_rows<kUnroll>(staged, rows.count, load, add);
    for_staged_rows(staged, [&](int j) { add(load_staged(j)); });
    // Split and cluster paths: thread tid < bx * K finishes channel tid of the group; its gamma and invstd,
    // loaded now, arrive while the reductions and the barrier run.
    const int chb = bx * K;
    const int64_t fch = static_cast<int64_t>(blockIdx.x) * chb + tid;
    const bool finisher = t.splits > 1 && tid < chb && fch < t.C;
    acc_t f_gamma = 1, f_invstd = 0;
    if (finisher) {
      f_gamma = a.weight ? a.weight[fch] : acc_t(1);
      f_invstd = a.save_invstd[fch];
    }
    S s;
    s.zero();
#pragma unroll
    for (int u = 0; u < V; ++u) {
      s.p[kCL ? u : 0] += sdy[u];
      s.q[kCL ? u : 0] += sdyx[u];
    }
    s = reduce_columns(s, reinterpret_cast<S*>(smem_raw));
    auto finalize = [&](int64_t ch, acc_t sum_dy, acc_t sum_dyx, acc_t gam, acc_t invstd, bool write, int idx) {
      if (write) {
        a.grad_bias[ch] = sum_dy;
        a.grad_weight[ch] = (gam == acc_t(0) && !has_x) ? std::numeric_limits<acc_t>::quiet_NaN() : sum_dyx;
      }
      s_mean_dy[idx] = sum_dy * a.inv_count;
      s_mean_dyx[idx] = sum_dyx * a.inv_count;
      s_k[idx] = gam * invstd;
    };
    if (t.splits == 1) {
      if (tid < bx && active) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
          finalize(channel(k), s.p[k], s.q[k], gamma[k], a.save_invstd[channel(k)], true, tx * K + k);
        }
      }
    } else if (t.cluster) {
      const S1 total = cluster_totals(s, reinterpret_cast<acc_t*>(staged_raw), t.splits);
      if (finisher) finalize(fch, total.p[0], total.q[0], f_gamma, f_invstd, blockIdx.y == 0, tid);
    } else {
      if (tid < bx && active) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
          a.partial[static_cast<int64_t>(blockIdx.y) * t.C + channel(k)] = s.p[k];
          a.partial[(static_cast<int64_t>(t.splits) + blockIdx.y) * t.C + channel(k)] = s.q[k];
        }
      }
      wait_for_all_partials();
      const bool write = blockIdx.y == 0;
      if (!(mode & kGradInput) && !write) return;  // only the parameter gradients were asked for
      const int parts = kThreads / chb;
      const int lc = tid % chb, part = tid / chb;
      const int64_t ch = static_cast<int64_t>(blockIdx.x) * chb + lc;
      S1 total;
      total.zero();
      if (ch < t.C) {
#pragma unroll 8
        for (int sp = part; sp < t.splits; sp += parts) {
          total.p[0] += __ldcg(&a.partial[static_cast<int64_t>(sp) * t.C + ch]);
          total.q[0] += __ldcg(&a.partial[(static_cast<int64_t>(t.splits) + sp) * t.C + ch]);
        }
      }
      S1* sm = reinterpret_cast<S1*>(smem_raw);
      sm[tid] = total;
      reduce_parts(sm, chb, parts);
      if (finisher) finalize(fch, sm[tid].p[0], sm[tid].q[0], f_gamma, f_invstd, write, tid);
    }
  }
  if (!(mode & kGradInput)) return;
  if (mode & kSums) __syncthreads();
  if (!active) return;
  // grad_input = k * (dy' - mean(dy') - xhat * mean(dy' xhat)) with k = gamma * invstd (training; eval
  // keeps k * dy'), i.e. k * dy' + src * (out > 0 ? cp : cn) + c0.
  acc_t kk[K], cp[K], cn[kHasX ? 1 : K], c0[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    kk[k] = (mode & kSums) ? s_k[tx * K + k] : gamma[k] * a.save_invstd[channel(k)];
    const acc_t mean_dy = a.training ? s_mean_dy[tx * K + k] : acc_t(0);
    // NaN (gamma == 0, from the output) must not reach grad_input: xhat is 0 there and k is 0.
    acc_t mean_dyx = a.training ? s_mean_dyx[tx * K + k] : acc_t(0);
    if (mean_dyx != mean_dyx) mean_dyx = acc_t(0);
    const acc_t cm = kk[k] * mean_dyx;
    cp[k] = -cm * mp[k];
    if constexpr (!kHasX) cn[k] = -cm * mn[k];
    c0[k] = -cm * b0[k] - kk[k] * mean_dy;
  }
  auto src_coef = [&](bool pos, int k) {
    if constexpr (kHasX) return cp[k];
    else return pos ? cp[k] : cn[k];
  };
  auto grad_input = [&](const Loaded& l, int j) {
    VecT o;
#pragma unroll
    for (int u = 0; u < V; ++u) {
      const int k = kCL ? u : 0;
      const acc_t ov = static_cast<acc_t>(l.out.v[u]), d = static_cast<acc_t>(l.dy.v[u]);
      const bool pos = ov > acc_t(0);
      const acc_t g = pos ? d : d * neg_slope;
      o.v[u] = static_cast<scalar_t>(kk[k] * g + (src_of(l, u) * src_coef(pos, k) + c0[k]));
    }
    store_streaming(reinterpret_cast<VecT*>(dx + offset_of(j)), o);
  };
  for_rows_reversed(
      staged, rows.count,
      [&](int j) {
        Loaded l;
        const int64_t off = offset_of(j);
        l.dy = load_last_use(reinterpret_cast<const VecT*>(dy + off));
        l.out = load_last_use(reinterpret_cast<const VecT*>(out + off));
        if constexpr (kHasX) l.x = load_last_use(reinterpret_cast<const VecT*>(x + off));
        return l;
      },
      grad_input);
  for (int j = 0; j < staged; ++j) grad_input(load_staged(j), j);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Block shape and the split of the rows; see the file comment.
struct Plan {
  dim3 block, grid;
  Tile tile;
};

Plan plan_for(const Geometry& g, bool channels_last, int V, int blocks_per_sm) {
  const int64_t M = g.reduce();
  TORCH_CHECK(M < (int64_t(1) << 31), "hierpar::batch_norm_act: input: at most 2^31 - 1 elements per channel "
              "(N*H*W), got ", M);
  Tile t;
  t.C = g.c;
  t.L = g.l;
  t.cols = channels_last ? g.c / V : g.c;
  t.rows = channels_last ? M : M / V;
  int bx = 1;
  if (channels_last) {
    const int bx_max = V == 1 ? 32 : kMaxCols;
    while (bx < bx_max && bx < t.cols) bx *= 2;
  }
  const int by = kThreads / bx;
  const int64_t groups = ceil_div(t.cols, bx);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t splits = 1;
  // One block per channel group while each thread has at most 8 vectors; beyond, one wave of blocks
  // with at least 4 vectors per thread each. The wave must fit at once (groups * splits <= resident
  // blocks): the split path synchronises the whole grid. When one block per SM already leaves each thread
  // at most 8 rows, the wave has one block per SM: a second block per SM would only add partials to
  // combine and arrivals at the barrier (float32 channels_last [64,32,32,32] on an H200: with 128 blocks
  // the forward takes 9.9 us and the backward 14.9, against 12.1 and 17.3 with 256).
  if (t.rows > 8 * by) {
    const int64_t one_per_sm = std::max<int64_t>(sms / groups, 1);
    const int64_t per_sm = ceil_div(t.rows, one_per_sm * by) <= 8 ? 1 : blocks_per_sm;
    splits = std::min((per_sm * sms) / groups, ceil_div(t.rows, 4 * by));
    splits = std::clamp<int64_t>(splits, 1, 65535);
  }
  t.chunk = ceil_div(t.rows, splits);
  t.splits = static_cast<int>(ceil_div(t.rows, t.chunk));
  t.staged_rows = 0;
  t.cluster = 0;
  t.exchange_bytes = 0;
  t.div_lv = at::cuda::detail::IntDivider<uint32_t>(
      static_cast<uint32_t>(channels_last ? 1 : std::max<int64_t>(g.l / V, 1)));
  Plan p;
  p.block = dim3(bx, by);
  p.grid = dim3(static_cast<unsigned>(groups), static_cast<unsigned>(t.splits));
  p.tile = t;
  return p;
}

template <typename Kernel>
int blocks_per_sm(Kernel kernel) {
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0));
  return std::max(n, 1);
}

// Rows per thread a block of `kernel` can stage in shared memory (split path) for `streams` tensors of
// `vec_bytes`-byte vectors: what the SM's shared memory leaves per block at the kernel's occupancy without
// it, so that staging never lowers the blocks per SM (the split path's grid is sized from that occupancy).
// 0 where cp.async cannot move the vectors (2 bytes) or the code has no cp.async (built for sm_75).
template <typename Kernel>
int stageable_rows(Kernel kernel, int occupancy, int streams, int vec_bytes) {
  if (vec_bytes != 4 && vec_bytes != 8 && vec_bytes != 16) return 0;
  if (!current_device_caps().ampere_instructions()) return 0;
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  cudaFuncAttributes attr;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const int64_t per_block = static_cast<int64_t>(prop->sharedMemPerMultiprocessor) / occupancy -
                            static_cast<int64_t>(prop->reservedSharedMemPerBlock);
  const int64_t available = std::min<int64_t>(per_block, current_device_caps().max_smem_per_block) -
                            static_cast<int64_t>(attr.sharedSizeBytes);
  const int64_t row_bytes = static_cast<int64_t>(streams) * kThreads * vec_bytes;
  int rows = static_cast<int>(std::max<int64_t>(available, 0) / row_bytes);
  if (rows == 0) return 0;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(rows * row_bytes)));
  for (; rows > 0; --rows) {  // the formula above is the occupancy calculator's; check it anyway
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, rows * row_bytes));
    if (n >= occupancy) break;
  }
  return rows;
}

// cudaFuncSetAttribute holds for the current device only, so each device needs its own call (stageable_rows made
// it on the device of the first launch; a replica on another device failed with "too many blocks in cooperative
// launch"). Made before every launch that stages rows, always with the kernel's largest staging, so launches from
// other threads see the same value.
template <typename Kernel>
void allow_staging(Kernel kernel, size_t bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// The dynamic shared memory of a launch: the exchange buffer (cluster path) and the staged rows.
size_t dynamic_smem(const Plan& plan, int streams, int vec_bytes) {
  return static_cast<size_t>(plan.tile.exchange_bytes) +
         static_cast<size_t>(plan.tile.staged_rows) * streams * kThreads * vec_bytes;
}

// Stages the rows of the split path's blocks (as many per thread as the kernel can, at most all a thread
// has); returns the dynamic shared memory bytes of the launch.
size_t stage_split_rows(Plan& plan, int stageable, int streams, int vec_bytes) {
  const int rows_per_thread = static_cast<int>(ceil_div(plan.tile.chunk, plan.block.y));
  plan.tile.staged_rows = std::min(stageable, rows_per_thread);
  return dynamic_smem(plan, streams, vec_bytes);
}

// ---- Cluster path (see the file comment) ----
// At most 8 CTAs per cluster, the portable size: a GPC holds such a cluster even at one CTA per SM.
constexpr int kMaxCluster = 8;
// Tensors up to 8 MiB (the batch-64 DCGAN layers are 1-8 MiB); larger ones keep the cooperative split path.
constexpr int64_t kClusterMaxBytes = int64_t(8) << 20;
// At most 512 rows per CTA. The cluster's barrier costs ~0.9 us less than the grid's, but a CTA of the
// cluster path walks rows / 8 rows against the split path's ~256: on an H200 at 128 rows per CTA the cluster
// path was 1.1-2.8 us faster per call, at 512 within -0.5..+1.9 us, at 2048 (float32 [64,64,16,16],
// bfloat16 [1024,256,4,4]) 0.4-3.5 us slower (docs/batch_norm_act.md).
constexpr int64_t kClusterMaxRows = 512;

// HIERPAR_BN_CLUSTER=0 keeps the cooperative split path for every shape. Read at each call (a getenv beside
// the op's ~10 us of host work) so that one process can time both paths.
bool cluster_path_enabled() { return switch_on(Switch::bn_cluster); }

size_t exchange_bytes(int cluster, int channels, size_t acc_bytes) {
  return (static_cast<size_t>(cluster) * 2 * channels * acc_bytes + 15) / 16 * 16;
}

// What the cluster path's plan needs to know of a kernel, once per kernel.
struct ClusterFacts {
  int max_rows = 0;     // rows per thread a CTA stages with all the shared memory a block may have; 0: no cluster path
  size_t max_smem = 0;  // dynamic shared memory at max_rows (the largest exchange buffer included)
  // Clusters the device runs at once, [cluster size - 2][rows per thread], from the occupancy calculator (it
  // knows how the SMs are grouped into GPCs, which a cluster may not span), with the largest exchange buffer.
  std::vector<int> active;
  int active_clusters(int cluster, int rows) const { return active[(cluster - 2) * (max_rows + 1) + rows]; }
};

// No cluster path in code built for an architecture before sm_90 (a compute_80 build on an H100 included), or for
// 2-byte vectors (cp.async cannot stage them). Asked once per kernel (on the first call's device), not at each
// call: a call may be inside a CUDA graph capture.
template <typename Kernel>
ClusterFacts cluster_facts(Kernel kernel, int streams, int vec_bytes, size_t acc_bytes) {
  ClusterFacts f;
  if (!current_device_caps().clusters() || (vec_bytes != 4 && vec_bytes != 8 && vec_bytes != 16)) return f;
  cudaFuncAttributes attr;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const size_t exchange = exchange_bytes(kMaxCluster, kMaxChannelsPerBlock, acc_bytes);
  const int64_t row_bytes = static_cast<int64_t>(streams) * kThreads * vec_bytes;
  const int64_t available = static_cast<int64_t>(current_device_caps().max_smem_per_block) -
                            static_cast<int64_t>(attr.sharedSizeBytes + exchange);
  const int max_rows = static_cast<int>(std::max<int64_t>(available, 0) / row_bytes);
  if (max_rows == 0) return f;
  f.max_smem = exchange + static_cast<size_t>(max_rows) * row_bytes;
  allow_staging(kernel, f.max_smem);
  for (int cluster = 2; cluster <= kMaxCluster; ++cluster) {
    for (int rows = 0; rows <= max_rows; ++rows) {
      cudaLaunchConfig_t config = {};
      config.gridDim = dim3(1, cluster);
      config.blockDim = dim3(kThreads);
      config.dynamicSmemBytes = exchange_bytes(cluster, kMaxChannelsPerBlock, acc_bytes) + rows * row_bytes;
      cudaLaunchAttribute cluster_dim;
      cluster_dim.id = cudaLaunchAttributeClusterDimension;
      cluster_dim.val.clusterDim.x = 1;
      cluster_dim.val.clusterDim.y = cluster;
      cluster_dim.val.clusterDim.z = 1;
      config.attrs = &cluster_dim;
      config.numAttrs = 1;
      int n = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &config));
      f.active.push_back(n);
    }
  }
  f.max_rows = max_rows;
  return f;
}

// The cluster path's plan for a shape the split path would take, or none: a tensor of at most
// kClusterMaxBytes whose rows all fit the staging (each element read from global memory once), at most
// kClusterMaxRows rows and kMaxCluster CTAs per channel group, at most one CTA per SM, and every cluster
// resident at once. Of the
// channel-column widths (a warp reads row segments of bx vectors: 128 bytes down to 32, one sector) and
// cluster sizes that fit, the one with the most CTAs (the rows spread over the most SMs: one CTA streams its
// share at a fraction of the device's bandwidth), the widest columns and largest cluster among equals.
std::optional<Plan> cluster_plan_for(const Geometry& g, bool channels_last, int V, int vec_bytes, size_t acc_bytes,
                                     const ClusterFacts& f) {
  if (f.max_rows == 0 || !cluster_path_enabled()) return std::nullopt;
  const int64_t M = g.reduce();
  if (g.c * M * (vec_bytes / V) > kClusterMaxBytes) return std::nullopt;
  const int64_t cols = channels_last ? g.c / V : g.c;
  const int64_t rows = channels_last ? M : M / V;
  int bx_max = 1, bx_min = 1;
  if (channels_last) {
    const int limit = V == 1 ? 32 : kMaxCols;
    while (bx_max < limit && bx_max < cols) bx_max *= 2;
    bx_min = std::min(bx_max, std::max(1, 32 / vec_bytes));
  }
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int K = channels_last ? V : 1;
  std::optional<Plan> best;
  int64_t best_ctas = 0;
  for (int bx = bx_max; bx >= bx_min; bx /= 2) {
    const int by = kThreads / bx;
    const int64_t groups = ceil_div(cols, bx);
    for (int cluster = kMaxCluster; cluster >= 2; --cluster) {
      const int64_t chunk = ceil_div(rows, cluster);
      const int64_t per_thread = ceil_div(chunk, by);
      if (per_thread > f.max_rows || chunk > kClusterMaxRows) break;  // smaller clusters only add rows
      const int64_t ctas = groups * cluster;
      if (ctas > sms || ctas <= best_ctas) continue;
      Tile t;
      t.C = g.c;
      t.L = g.l;
      t.cols = cols;
      t.rows = rows;
      t.chunk = chunk;
      t.splits = cluster;  // a CTA past the last row (rows < cluster^2) has no rows: zero sums
      t.staged_rows = static_cast<int>(per_thread);
      t.cluster = 1;
      t.exchange_bytes = static_cast<int>(exchange_bytes(cluster, bx * K, acc_bytes));
      t.div_lv = at::cuda::detail::IntDivider<uint32_t>(
          static_cast<uint32_t>(channels_last ? 1 : std::max<int64_t>(g.l / V, 1)));
      Plan p;
      p.block = dim3(bx, by);
      p.grid = dim3(static_cast<unsigned>(groups), static_cast<unsigned>(cluster));
      p.tile = t;
      if (f.active_clusters(cluster, t.staged_rows) < groups) continue;
      best = p;
      best_ctas = ctas;
    }
  }
  return best;
}

// A [C] parameter as a contiguous tensor of the accumulation type: itself when it already is one.
at::Tensor as_acc(const std::optional<at::Tensor>& p, c10::ScalarType acc) {
  if (!present(p)) return at::Tensor();
  if (p->scalar_type() == acc && p->is_contiguous()) return *p;
  return p->to(acc).contiguous();
}

template <typename T>
T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

bool aligned16(const at::Tensor& t) {
  return !t.defined() || reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

// The vector width for this shape: 16 bytes when the channels (channels_last) or the plane (NCHW) hold a
// whole number of vectors and every tensor is 16-byte aligned, else 1.
template <typename scalar_t>
bool use_vectors(const Geometry& g, bool channels_last, std::initializer_list<const at::Tensor*> tensors) {
  constexpr int V = 16 / sizeof(scalar_t);
  if ((channels_last ? g.c : g.l) % V != 0) return false;
  for (const at::Tensor* t : tensors) {
    if (!aligned16(*t)) return false;
  }
  return true;
}

template <typename scalar_t>
constexpr int kVec = 16 / sizeof(scalar_t);

// Launches `kernel` with `args`: as clusters of the plan's splits (cluster path); cooperatively when its grid
// synchronises (the split path), which guarantees that all blocks are resident at once (the plan keeps the
// grid within one wave).
template <typename... KernelArgs, typename... Args>
void launch(void (*kernel)(KernelArgs...), const Plan& plan, bool grid_sync, size_t smem, cudaStream_t stream,
            Args... args) {
  if (plan.tile.cluster) {
    cudaLaunchConfig_t config = {};
    config.gridDim = plan.grid;
    config.blockDim = plan.block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute cluster_dim;
    cluster_dim.id = cudaLaunchAttributeClusterDimension;
    cluster_dim.val.clusterDim.x = 1;
    cluster_dim.val.clusterDim.y = plan.grid.y;
    cluster_dim.val.clusterDim.z = 1;
    config.attrs = &cluster_dim;
    config.numAttrs = 1;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
  } else if (grid_sync) {
    std::tuple<KernelArgs...> values{args...};
    void* pointers[sizeof...(KernelArgs)];
    std::apply([&](auto&... v) {
      int i = 0;
      ((pointers[i++] = static_cast<void*>(&v)), ...);
    }, values);
    C10_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), plan.grid, plan.block, pointers,
                                               smem, stream));
  } else {
    kernel<<<plan.grid, plan.block, smem, stream>>>(args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename scalar_t, typename acc_t, bool kCL, int V>
void launch_forward(const Geometry& g, const at::Tensor& input, at::Tensor& out, ForwardArgs<acc_t> args,
                    bool training, cudaStream_t stream) {
  auto kernel = batch_norm_act_forward_kernel<scalar_t, acc_t, kCL, V>;
  constexpr int kVecBytes = sizeof(Vec<scalar_t, V>);
  static const int occupancy = blocks_per_sm(kernel);
  static const int stageable = stageable_rows(kernel, occupancy, 1, kVecBytes);
  static const ClusterFacts cluster = cluster_facts(kernel, 1, kVecBytes, sizeof(acc_t));
  static const size_t max_smem =
      std::max<size_t>(static_cast<size_t>(stageable) * kThreads * kVecBytes, cluster.max_smem);
  Plan plan = plan_for(g, kCL, V, occupancy);
  const bool split = training && plan.tile.splits > 1;
  at::Tensor partial;
  size_t smem = 0;
  if (split) {
    if (auto clustered = cluster_plan_for(g, kCL, V, kVecBytes, sizeof(acc_t), cluster)) {
      plan = *clustered;
      smem = dynamic_smem(plan, 1, kVecBytes);
    } else {
      partial = at::empty({2, plan.tile.splits, g.c}, input.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
      args.partial = partial.data_ptr<acc_t>();
      smem = stage_split_rows(plan, stageable, 1, kVecBytes);
    }
    if (smem > 0) allow_staging(kernel, max_smem);
  }
  launch(kernel, plan, split, smem, stream, input.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
         plan.tile, args);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cuda(
    const at::Tensor& input_, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps, c10::string_view activation, double slope,
    const std::optional<at::Tensor>& num_batches_tracked) {
  Act act = parse_activation(activation, "hierpar::batch_norm_act");
  Geometry g = check_forward(input_, weight, bias, running_mean, running_var, training, momentum, eps, act, slope,
                             num_batches_tracked);
  c10::cuda::CUDAGuard guard(input_.device());
  check_device_code(input_.get_device());
  auto layout = layout_of(input_);
  // With H*W == 1 both layouts are the row-major [N, C] matrix: address it as channels_last (coalesced).
  const bool cl = layout == c10::MemoryFormat::ChannelsLast || g.l == 1;
  at::Tensor input = input_.contiguous(layout);
  const auto acc = stats_dtype(input.scalar_type());
  at::Tensor out = new_output(input.sizes(), input.options(), layout);
  at::Tensor save_mean = new_output({g.c}, input.options().dtype(acc));
  at::Tensor save_invstd = new_output({g.c}, input.options().dtype(acc));
  if (input.numel() == 0) {  // eval with an empty batch (training rejects it): nothing to normalise
    save_mean.copy_(*running_mean);
    save_invstd.copy_(running_var->to(acc).add(eps).rsqrt());
    return {out, save_mean, save_invstd};
  }

  at::Tensor w = as_acc(weight, acc), b = as_acc(bias, acc);
  at::Tensor rm = as_acc(running_mean, acc), rv = as_acc(running_var, acc);
  auto stream = at::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "batch_norm_act_cuda", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    ForwardArgs<acc_t> args{ptr_or_null<acc_t>(w),
                            ptr_or_null<acc_t>(b),
                            ptr_or_null<acc_t>(rm),  // training: updated when given; eval: read
                            ptr_or_null<acc_t>(rv),
                            save_mean.data_ptr<acc_t>(),
                            save_invstd.data_ptr<acc_t>(),
                            nullptr,
                            static_cast<acc_t>(momentum),
                            static_cast<acc_t>(eps),
                            static_cast<acc_t>(slope),
                            act,
                            training,
                            training && present(num_batches_tracked) ? num_batches_tracked->data_ptr<int64_t>()
                                                                     : nullptr};
    const bool vec = use_vectors<scalar_t>(g, cl, {&input, &out});
    if (cl) {
      if (vec) launch_forward<scalar_t, acc_t, true, kVec<scalar_t>>(g, input, out, args, training, stream);
      else launch_forward<scalar_t, acc_t, true, 1>(g, input, out, args, training, stream);
    } else {
      if (vec) launch_forward<scalar_t, acc_t, false, kVec<scalar_t>>(g, input, out, args, training, stream);
      else launch_forward<scalar_t, acc_t, false, 1>(g, input, out, args, training, stream);
    }
  });

  if (training && present(running_mean)) {  // running stats kept in another dtype or not contiguous
    if (!rm.is_same(*running_mean)) running_mean->copy_(rm);
    if (!rv.is_same(*running_var)) running_var->copy_(rv);
  }
  return {out, save_mean, save_invstd};
}

template <typename scalar_t, typename acc_t, bool kCL, int V, bool kHasX>
void launch_backward(const Geometry& g, const at::Tensor& grad_output, const at::Tensor& output,
                     const at::Tensor& input, at::Tensor& grad_input, BackwardArgs<acc_t> args, bool need_sums,
                     bool apply, cudaStream_t stream) {
  auto kernel = batch_norm_act_backward_kernel<scalar_t, acc_t, kCL, V, kHasX>;
  constexpr int kVecBytes = sizeof(Vec<scalar_t, V>), kStreams = kHasX ? 3 : 2;
  static const int occupancy = blocks_per_sm(kernel);
  static const int stageable = stageable_rows(kernel, occupancy, kStreams, kVecBytes);
  static const ClusterFacts cluster = cluster_facts(kernel, kStreams, kVecBytes, sizeof(acc_t));
  static const size_t max_smem =
      std::max<size_t>(static_cast<size_t>(stageable) * kStreams * kThreads * kVecBytes, cluster.max_smem);
  Plan plan = plan_for(g, kCL, V, occupancy);
  const bool split = need_sums && plan.tile.splits > 1;
  at::Tensor partial;
  size_t smem = 0;
  if (split) {
    // Staging pays only when the rows are read twice (sums, then grad_input); the cluster path stages all.
    std::optional<Plan> clustered;
    if (apply) clustered = cluster_plan_for(g, kCL, V, kVecBytes, sizeof(acc_t), cluster);
    if (clustered) {
      plan = *clustered;
      smem = dynamic_smem(plan, kStreams, kVecBytes);
    } else {
      partial = at::empty({2, plan.tile.splits, g.c}, output.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
      args.partial = partial.data_ptr<acc_t>();
      if (apply) smem = stage_split_rows(plan, stageable, kStreams, kVecBytes);
    }
    if (smem > 0) allow_staging(kernel, max_smem);
  }
  const int mode = (need_sums ? kSums : 0) | (apply ? kGradInput : 0);
  launch(kernel, plan, split, smem, stream, grad_output.const_data_ptr<scalar_t>(), output.const_data_ptr<scalar_t>(),
         input.defined() ? input.const_data_ptr<scalar_t>() : static_cast<const scalar_t*>(nullptr),
         grad_input.defined() ? grad_input.mutable_data_ptr<scalar_t>() : static_cast<scalar_t*>(nullptr), plan.tile,
         args, mode);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad_output_, const at::Tensor& output_, const std::optional<at::Tensor>& input_,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, double eps, c10::string_view activation, double slope,
    std::array<bool, 3> output_mask) {
  Act act = parse_activation(activation, "hierpar::batch_norm_act_backward");
  Geometry g = check_backward(grad_output_, output_, input_, weight, bias, save_mean, save_invstd, eps, act, slope);
  c10::cuda::CUDAGuard guard(output_.device());
  check_device_code(output_.get_device());
  auto layout = layout_of(output_);
  const bool cl = layout == c10::MemoryFormat::ChannelsLast || g.l == 1;
  at::Tensor output = output_.contiguous(layout);
  at::Tensor grad_output = grad_output_.contiguous(layout);
  at::Tensor input = present(input_) ? input_->contiguous(layout) : at::Tensor();
  const auto acc = stats_dtype(output.scalar_type());
  at::Tensor w = as_acc(weight, acc), b = as_acc(bias, acc);
  at::Tensor mean = save_mean.contiguous(), invstd = save_invstd.contiguous();

  const bool need_sums = output_mask[1] || output_mask[2] || (output_mask[0] && training);
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) grad_input = new_output(output.sizes(), output.options(), layout);
  // Sums land in accumulation-type [C] buffers; they are the parameter gradients when requested.
  at::Tensor sum_dy_xhat = need_sums ? new_output({g.c}, output.options().dtype(acc)) : at::Tensor();
  at::Tensor sum_dy = need_sums ? new_output({g.c}, output.options().dtype(acc)) : at::Tensor();
  if (output.numel() == 0) {
    if (need_sums) {
      sum_dy.zero_();
      sum_dy_xhat.zero_();
    }
  } else if (need_sums || output_mask[0]) {
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, output.scalar_type(), "batch_norm_act_backward_cuda", [&] {
      using acc_t = at::acc_type<scalar_t, true>;
      BackwardArgs<acc_t> args{ptr_or_null<acc_t>(w),
                               ptr_or_null<acc_t>(b),
                               mean.data_ptr<acc_t>(),
                               invstd.data_ptr<acc_t>(),
                               ptr_or_null<acc_t>(sum_dy_xhat),
                               ptr_or_null<acc_t>(sum_dy),
                               nullptr,
                               static_cast<acc_t>(slope),
                               acc_t(1) / static_cast<acc_t>(g.reduce()),
                               act,
                               training};
      const bool vec = use_vectors<scalar_t>(g, cl, {&grad_output, &output, &input, &grad_input});
      // The four kernel paths (layout x vector width), each with and without the input.
      auto run = [&](auto cl_tag, auto v_tag) {
        constexpr bool kCL = decltype(cl_tag)::value;
        constexpr int V = decltype(v_tag)::value;
        if (input.defined()) {
          launch_backward<scalar_t, acc_t, kCL, V, true>(g, grad_output, output, input, grad_input, args, need_sums,
                                                         output_mask[0], stream);
        } else {
          launch_backward<scalar_t, acc_t, kCL, V, false>(g, grad_output, output, input, grad_input, args, need_sums,
                                                          output_mask[0], stream);
        }
      };
      using Vector = std::integral_constant<int, kVec<scalar_t>>;
      using Scalar = std::integral_constant<int, 1>;
      if (cl) {
        if (vec) run(std::true_type{}, Vector{});
        else run(std::true_type{}, Scalar{});
      } else {
        if (vec) run(std::false_type{}, Vector{});
        else run(std::false_type{}, Scalar{});
      }
    });
  }
  auto param_dtype = present(weight) ? weight->scalar_type() : acc;
  if (output_mask[1]) grad_weight = sum_dy_xhat.scalar_type() == param_dtype ? sum_dy_xhat : sum_dy_xhat.to(param_dtype);
  if (output_mask[2]) {
    auto bias_dtype = present(bias) ? bias->scalar_type() : param_dtype;
    grad_bias = sum_dy.scalar_type() == bias_dtype ? sum_dy : sum_dy.to(bias_dtype);
  }
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace
}  // namespace hierpar::detail::bn

TORCH_LIBRARY_IMPL(hierpar, CUDA, m) {
  m.impl("batch_norm_act", &hierpar::detail::bn::forward_cuda);
  m.impl("batch_norm_act_backward", &hierpar::detail::bn::backward_cuda);
}
