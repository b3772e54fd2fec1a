// The backward kernel of hierpar::batch_norm_act (batch_norm_act.cuh: sums of dy' and dy' * xhat, then
// grad_input) and its launcher, which takes the one-kernel, split or cluster path as planned (plan.cu).
#include "cuda/batch_norm_act/batch_norm_act.cuh"

namespace hierpar::detail::bn {
namespace {

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
  const BlockPlace place(t);
  if (t.cluster) cluster_arrive_at_start();
  constexpr bool has_x = kHasX;
  const acc_t neg_slope = a.act == Act::relu ? acc_t(0) : a.act == Act::leaky_relu ? a.slope : acc_t(1);
  auto channel = [&](int k) { return kCL ? place.col * V + k : place.col; };

  // xhat coefficients and gamma of this thread's channels.
  acc_t gamma[K], mp[K], mn[kHasX ? 1 : K], b0[K];  // with the input, mn = mp
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t ch = place.active ? channel(k) : 0;
    gamma[k] = place.active && a.weight ? a.weight[ch] : acc_t(1);
    if constexpr (kHasX) {
      const acc_t invstd = place.active ? a.save_invstd[ch] : acc_t(0);
      mp[k] = invstd;
      b0[k] = place.active ? -a.save_mean[ch] * invstd : acc_t(0);
    } else {
      mp[k] = gamma[k] != acc_t(0) ? acc_t(1) / gamma[k] : acc_t(0);
      mn[k] = a.act == Act::leaky_relu ? mp[k] / a.slope : mp[k];
      b0[k] = place.active && a.bias ? -a.bias[ch] * mp[k] : acc_t(0);
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
  // The element at index u of a loaded row: whether the activation passed it (out > 0), and dy through the
  // activation's backward.
  struct ActGrad {
    bool pos;
    acc_t g;
  };
  auto act_grad = [&](const Loaded& l, int u) {
    const acc_t o = static_cast<acc_t>(l.out.v[u]), d = static_cast<acc_t>(l.dy.v[u]);
    const bool pos = o > acc_t(0);
    return ActGrad{pos, pos ? d : d * neg_slope};
  };

  // Dynamic shared memory: the cluster path's exchange buffer, then the staged rows: [row][stream][thread]
  // vectors, conflict-free; streams dy, out and (kHasX) x.
  extern __shared__ __align__(16) unsigned char staged_raw[];
  constexpr int kStreams = kHasX ? 3 : 2;
  const ThreadRows rows(place.r0, place.r1, place.active);
  const int staged = min(rows.count, t.staged_rows);  // the host stages only when both passes run
  VecT* const stage = reinterpret_cast<VecT*>(staged_raw + t.exchange_bytes) + place.tid;
  auto staged_at = [&](int j, int stream) { return stage + (j * kStreams + stream) * kThreads; };
  auto load_staged = [&](int j) {
    Loaded l;
    l.dy = *staged_at(j, 0);
    l.out = *staged_at(j, 1);
    if constexpr (kHasX) l.x = *staged_at(j, 2);
    return l;
  };
  auto offset_of = [&](int j) { return vec_offset<kCL, V>(t, place.col, rows.row(j)); };

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
        const auto [pos, g] = act_grad(l, u);
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
    const int64_t fch = static_cast<int64_t>(blockIdx.x) * chb + place.tid;
    const bool finisher = t.splits > 1 && place.tid < chb && fch < t.C;
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
      if (place.tid < bx && place.active) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
          finalize(channel(k), s.p[k], s.q[k], gamma[k], a.save_invstd[channel(k)], true, tx * K + k);
        }
      }
    } else if (t.cluster) {
      const S1 total = cluster_totals(s, reinterpret_cast<acc_t*>(staged_raw), t.splits);
      if (finisher) finalize(fch, total.p[0], total.q[0], f_gamma, f_invstd, blockIdx.y == 0, place.tid);
    } else {
      publish_partials(a.partial, s, t.C, t.splits, place.tid < bx && place.active, channel);
      const bool write = blockIdx.y == 0;
      if (!(mode & kGradInput) && !write) return;  // only the parameter gradients were asked for
      const S1& total = partial_totals(a.partial, t.C, t.splits, chb, reinterpret_cast<S1*>(smem_raw));
      if (finisher) finalize(fch, total.p[0], total.q[0], f_gamma, f_invstd, write, place.tid);
    }
  }
  if (!(mode & kGradInput)) return;
  if (mode & kSums) __syncthreads();
  if (!place.active) return;
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
      const auto [pos, g] = act_grad(l, u);
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

}  // namespace

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

// The kernels entry.cu launches: each dtype with its accumulation type, both layouts, both vector widths, with
// and without the input.
#define HIERPAR_BN_BACKWARD(scalar_t, kCL, V, kHasX)                                                              \
  template void launch_backward<scalar_t, at::acc_type<scalar_t, true>, kCL, V, kHasX>(                          \
      const Geometry&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,                      \
      BackwardArgs<at::acc_type<scalar_t, true>>, bool, bool, cudaStream_t);
#define HIERPAR_BN_BACKWARD_ALL(scalar_t)                    \
  HIERPAR_BN_BACKWARD(scalar_t, true, kVec<scalar_t>, true)   \
  HIERPAR_BN_BACKWARD(scalar_t, true, kVec<scalar_t>, false)  \
  HIERPAR_BN_BACKWARD(scalar_t, true, 1, true)                \
  HIERPAR_BN_BACKWARD(scalar_t, true, 1, false)               \
  HIERPAR_BN_BACKWARD(scalar_t, false, kVec<scalar_t>, true)  \
  HIERPAR_BN_BACKWARD(scalar_t, false, kVec<scalar_t>, false) \
  HIERPAR_BN_BACKWARD(scalar_t, false, 1, true)               \
  HIERPAR_BN_BACKWARD(scalar_t, false, 1, false)
HIERPAR_BN_BACKWARD_ALL(double)
HIERPAR_BN_BACKWARD_ALL(float)
HIERPAR_BN_BACKWARD_ALL(at::BFloat16)
HIERPAR_BN_BACKWARD_ALL(at::Half)
#undef HIERPAR_BN_BACKWARD_ALL
#undef HIERPAR_BN_BACKWARD

}  // namespace hierpar::detail::bn
