// The plans of hierpar::batch_norm_act's kernels (batch_norm_act.cuh): block shape and the split of a channel
// group's rows over blocks (one-kernel and split paths), the rows staged per thread, and the cluster path's plan
// where it applies. Host code only.
#include "cuda/batch_norm_act/batch_norm_act.cuh"

namespace hierpar::detail::bn {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

}  // namespace

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

}  // namespace hierpar::detail::bn
