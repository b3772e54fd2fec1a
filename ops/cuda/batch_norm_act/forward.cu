// The forward kernel of hierpar::batch_norm_act (batch_norm_act.cuh) and its launcher, which takes the one-kernel,
// split or cluster path as planned (plan.cu).
#include "cuda/batch_norm_act/batch_norm_act.cuh"

namespace hierpar::detail::bn {
namespace {

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
  const BlockPlace place(t);
  auto channel = [&](int k) { return kCL ? place.col * V + k : place.col; };

  // Dynamic shared memory: the cluster path's exchange buffer, then the staged rows: [row][thread]
  // vectors, conflict-free.
  extern __shared__ __align__(16) unsigned char staged_raw[];
  const ThreadRows rows(place.r0, place.r1, place.active);
  auto row_ptr = [&](int j) {
    return reinterpret_cast<const VecT*>(x + vec_offset<kCL, V>(t, place.col, rows.row(j)));
  };
  // Rows [0, staged) of this thread live in shared memory from the statistics to the elementwise pass.
  const int staged = min(rows.count, t.staged_rows);
  VecT* const stage =
      reinterpret_cast<VecT*>(staged_raw + t.exchange_bytes) + place.tid;  // row j at stage[j * kThreads]

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
      const VecT v0 = place.active ? *reinterpret_cast<const VecT*>(x + vec_offset<kCL, V>(t, place.col, 0)) : VecT{};
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
    const int64_t fch = static_cast<int64_t>(blockIdx.x) * chb + place.tid;
    const bool finisher = t.splits > 1 && place.tid < chb && fch < t.C;
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
      if (place.tid < bx && place.active) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
          finish(channel(k), a.channel_params(channel(k), true), origin[k], s.p[k], s.q[k], true,
                 s_scale[tx * K + k], s_shift[tx * K + k]);
        }
      }
    } else if (t.cluster) {
      const S1 total = cluster_totals(s, reinterpret_cast<acc_t*>(staged_raw), t.splits);
      if (finisher) {
        finish(fch, f_params, f_origin, total.p[0], total.q[0], blockIdx.y == 0, s_scale[place.tid],
               s_shift[place.tid]);
      }
    } else {
      publish_partials(a.partial, s, t.C, t.splits, place.tid < bx && place.active, channel);
      const S1& total = partial_totals(a.partial, t.C, t.splits, chb, reinterpret_cast<S1*>(smem_raw));
      if (finisher) {
        finish(fch, f_params, f_origin, total.p[0], total.q[0], blockIdx.y == 0, s_scale[place.tid],
               s_shift[place.tid]);
      }
    }
    __syncthreads();
    if (!place.active) return;
#pragma unroll
    for (int u = 0; u < V; ++u) {
      scale[u] = s_scale[kCL ? tx * V + u : 0];
      shift[u] = s_shift[kCL ? tx * V + u : 0];
    }
  } else {
    // Eval: the running statistics; the first block row also returns them as save_mean/save_invstd.
    if (!place.active) return;
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
    store_streaming(reinterpret_cast<VecT*>(out + vec_offset<kCL, V>(t, place.col, rows.row(j))), o);
  };
  for_rows_reversed(staged, rows.count, [&](int j) { return load_last_use(row_ptr(j)); }, normalise);
  for (int j = 0; j < staged; ++j) normalise(stage[j * kThreads], j);
}

}  // namespace

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

// The kernels entry.cu launches: each dtype with its accumulation type, both layouts, both vector widths.
#define HIERPAR_BN_FORWARD(scalar_t, kCL, V)                                                                \
  template void launch_forward<scalar_t, at::acc_type<scalar_t, true>, kCL, V>(                             \
      const Geometry&, const at::Tensor&, at::Tensor&, ForwardArgs<at::acc_type<scalar_t, true>>, bool, cudaStream_t);
#define HIERPAR_BN_FORWARD_ALL(scalar_t)              \
  HIERPAR_BN_FORWARD(scalar_t, true, kVec<scalar_t>)  \
  HIERPAR_BN_FORWARD(scalar_t, true, 1)               \
  HIERPAR_BN_FORWARD(scalar_t, false, kVec<scalar_t>) \
  HIERPAR_BN_FORWARD(scalar_t, false, 1)
HIERPAR_BN_FORWARD_ALL(double)
HIERPAR_BN_FORWARD_ALL(float)
HIERPAR_BN_FORWARD_ALL(at::BFloat16)
HIERPAR_BN_FORWARD_ALL(at::Half)
#undef HIERPAR_BN_FORWARD_ALL
#undef HIERPAR_BN_FORWARD

}  // namespace hierpar::detail::bn
