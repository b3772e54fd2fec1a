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
//
// One file per kernel and its launcher (forward.cu, backward.cu: each launch picks the one-kernel, split or cluster
// path from the plan), plan.cu (the paths' plans: block shape, row splits, staging, clusters) and entry.cu (the
// operators: checks, then the launch for the dtype, layout and vector width). This header holds what they share:
// the per-thread row walks, the staging, the reductions (block, grid, cluster), the tile and the arguments, the
// plans and the launch.
#pragma once

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

// Where a thread works: its index in the block, its channel column (active: in the tile), its block's rows [r0, r1).
struct BlockPlace {
  int tid;
  int64_t col;
  bool active;
  int64_t r0, r1;
  __device__ __forceinline__ explicit BlockPlace(const Tile& t) {
    const int bx = blockDim.x, tx = threadIdx.x;
    tid = threadIdx.y * bx + tx;
    col = static_cast<int64_t>(blockIdx.x) * bx + tx;
    active = col < t.cols;
    r0 = static_cast<int64_t>(blockIdx.y) * t.chunk;
    r1 = min(t.rows, r0 + t.chunk);
  }
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

// Split path without a cluster: this block row's sums `s` (in threads where `publishes`: K channels each, channel(k)
// their indices) into the partials ([2][splits][C]), then the wait for every block's.
template <int K, typename acc_t, typename Channel>
__device__ __forceinline__ void publish_partials(acc_t* partial, const SumsK<acc_t, K>& s, int64_t C, int splits,
                                                 bool publishes, Channel channel) {
  if (publishes) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      partial[static_cast<int64_t>(blockIdx.y) * C + channel(k)] = s.p[k];
      partial[(static_cast<int64_t>(splits) + blockIdx.y) * C + channel(k)] = s.q[k];
    }
  }
  wait_for_all_partials();
}

// The forward's and the backward's combine after publish_partials: the totals over all splits of the group's channel
// tid (valid in threads tid < chb), added in the same order in every block; `smem` holds kThreads states.
// Threads = (channel of the group) x (part of the splits): each part sums its splits (independent loads), then a
// tree over the parts.
template <typename acc_t>
__device__ __forceinline__ const SumsK<acc_t, 1>& partial_totals(const acc_t* partial, int64_t C, int splits, int chb,
                                                                 SumsK<acc_t, 1>* smem) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int parts = kThreads / chb;
  const int lc = tid % chb, part = tid / chb;
  const int64_t ch = static_cast<int64_t>(blockIdx.x) * chb + lc;
  acc_t sum_q = 0, sum_p = 0;  // q declared before p: this order keeps the register allocation (and SASS) as it was
  if (ch < C) {
#pragma unroll 8
    for (int sp = part; sp < splits; sp += parts) {
      sum_p += __ldcg(&partial[static_cast<int64_t>(sp) * C + ch]);
      sum_q += __ldcg(&partial[(static_cast<int64_t>(splits) + sp) * C + ch]);
    }
  }
  smem[tid].p[0] = sum_p;
  smem[tid].q[0] = sum_q;
  reduce_parts(smem, chb, parts);
  return smem[tid];
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

// Block shape and the split of the rows; see the file comment.
struct Plan {
  dim3 block, grid;
  Tile tile;
};

// plan.cu: the one-kernel or split path's plan (rows split over one wave of blocks of `blocks_per_sm` per SM).
Plan plan_for(const Geometry& g, bool channels_last, int V, int blocks_per_sm);

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

// plan.cu: a launch's dynamic shared memory, and the split path's staged rows.
size_t dynamic_smem(const Plan& plan, int streams, int vec_bytes);
size_t stage_split_rows(Plan& plan, int stageable, int streams, int vec_bytes);

// ---- Cluster path (see the file comment) ----
// At most 8 CTAs per cluster, the portable size: a GPC holds such a cluster even at one CTA per SM.
constexpr int kMaxCluster = 8;

inline size_t exchange_bytes(int cluster, int channels, size_t acc_bytes) {
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

// plan.cu: the cluster path's plan for a shape the split path would take, or none.
std::optional<Plan> cluster_plan_for(const Geometry& g, bool channels_last, int V, int vec_bytes, size_t acc_bytes,
                                     const ClusterFacts& f);

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

// forward.cu / backward.cu: instantiated for every dtype (its accumulation type at::acc_type<scalar_t, true>),
// layout and vector width (kVec<scalar_t> or 1) that entry.cu launches.
template <typename scalar_t, typename acc_t, bool kCL, int V>
void launch_forward(const Geometry& g, const at::Tensor& input, at::Tensor& out, ForwardArgs<acc_t> args,
                    bool training, cudaStream_t stream);
template <typename scalar_t, typename acc_t, bool kCL, int V, bool kHasX>
void launch_backward(const Geometry& g, const at::Tensor& grad_output, const at::Tensor& output,
                     const at::Tensor& input, at::Tensor& grad_input, BackwardArgs<acc_t> args, bool need_sums,
                     bool apply, cudaStream_t stream);

}  // namespace hierpar::detail::bn
