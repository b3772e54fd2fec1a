// hierpar::batch_norm_act's CUDA kernels against the float64 reference and the CPU kernels: every kernel path
// (one-kernel, cluster and cooperative split; vector and scalar addressing; NCHW and channels_last), DCGAN's shapes,
// CUDA graph replay, several devices (tolerances: batch_norm_act_testing.h).
#include "batch_norm_act_testing.h"

#include "hierpar/nn/batch_norm.h"
#include "hierpar/switches.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>

namespace {

using namespace batch_norm_act_testing;


// Random shapes (small ones: the one-kernel path; larger ones: the split path, one cooperative launch with
// a grid-wide combine)
// against the float64 reference, and CUDA against the CPU kernels on the same input.
TEST(BatchNormActCuda, MatchesAtenAndCpu) {
  HIERPAR_REQUIRE_CUDA();
  for (int trial = 0; trial < 40; ++trial) {
    const bool large = trial % 4 == 3;
    Case c = random_case({torch::kFloat, torch::kBFloat16, torch::kHalf, torch::kDouble}, large ? 80 : 12,
                         large ? 40 : 9);
    if (large && c.shape.size() == 4) c.shape[0] = rand_int(16, 70);
    Inputs in = random_inputs(c, torch::kCUDA);
    const auto [got, ref] = check_against_reference(c, in, "cuda");
    Inputs cpu_in;
    cpu_in.x = same_layout_on(in.x, torch::kCPU);
    cpu_in.dy = same_layout_on(in.dy, torch::kCPU);
    cpu_in.w = in.w.cpu();
    cpu_in.b = in.b.cpu();
    cpu_in.rm = in.rm.cpu();
    cpu_in.rv = in.rv.cpu();
    // Forward: CPU kernel on the same input. Backward: CPU kernel on the CUDA output and statistics, so
    // both take the same activation branches.
    Result cpu = run_hierpar(c, cpu_in);
    const std::string ctx = c.describe();
    expect_scaled(got.out, cpu.out, scaled_rtol(c.dtype), "cuda vs cpu output, " + ctx);
    expect_scaled(got.save_mean, cpu.save_mean, 1e-4, "cuda vs cpu save_mean, " + ctx);
    expect_scaled(got.save_invstd, cpu.save_invstd, 1e-4, "cuda vs cpu save_invstd, " + ctx);
    auto [dx, dw, db] = hierpar::ops::batch_norm_act_backward(
        cpu_in.dy, got.out.detach().cpu(), c.act == "relu" ? std::optional<torch::Tensor>(cpu_in.x) : std::nullopt,
        opt(c.affine, cpu_in.w), opt(c.affine, cpu_in.b), got.save_mean.cpu(), got.save_invstd.cpu(), c.training,
        c.eps, c.act, c.slope, {true, c.affine, c.affine});
    expect_scaled(got.dx, dx, scaled_rtol(c.dtype), "cuda vs cpu grad_input, " + ctx, ref.dx_terms);
    if (c.affine) {
      expect_scaled(got.dw, dw, scaled_rtol(c.dtype), "cuda vs cpu grad_weight, " + ctx, ref.dw_terms);
      expect_scaled(got.db, db, scaled_rtol(c.dtype), "cuda vs cpu grad_bias, " + ctx, ref.db_terms);
    }
  }
}

// The DCGAN layers the benchmark times (discriminator: leaky_relu(0.2), generator: relu) at batch 1, 64 (the
// training step's batch: float32 and bfloat16 channels_last, float32 NCHW) and 256, against the reference.
TEST(BatchNormActCuda, DcganShapes) {
  HIERPAR_REQUIRE_CUDA();
  struct Layer {
    std::vector<int64_t> chw;
    const char* act;
  };
  const std::vector<Layer> layers{{{64, 16, 16}, "leaky_relu"}, {{128, 8, 8}, "leaky_relu"}, {{256, 4, 4}, "leaky_relu"},
                                  {{256, 4, 4}, "relu"},        {{128, 8, 8}, "relu"},       {{64, 16, 16}, "relu"},
                                  {{32, 32, 32}, "relu"}};
  for (int64_t batch : {1, 64, 256}) {
    for (const auto& l : layers) {
      for (auto [dtype, layout] : {std::pair{torch::kFloat, Layout::contiguous},
                                   std::pair{torch::kFloat, Layout::channels_last},
                                   std::pair{torch::kBFloat16, Layout::channels_last}}) {
        if (batch == 256 && dtype == torch::kFloat && layout == Layout::channels_last) continue;  // as batch 64
        const Case c = make_case({batch, l.chw[0], l.chw[1], l.chw[2]}, dtype, torch::kFloat, layout, l.act, 0.2);
        Inputs in = random_inputs(c, torch::kCUDA);
        Result got = run_hierpar(c, in);
        Result ref = run_reference(c, in, got.out);
        compare(got, ref, c, scaled_rtol(c.dtype), "cuda dcgan");
        check_branches(got, ref, c, "cuda dcgan");
        expect_layout_kept(in.x, got.out, c.describe());
      }
    }
  }
}

// Data far from zero relative to its spread (mean / std ~ 100): the statistics are sums of values shifted by
// each channel's element at row 0, so they must not lose the variance to cancellation. One-kernel and split
// shapes, both layouts, float32 and float64.
TEST(BatchNormActCuda, StatisticsOfOffsetData) {
  HIERPAR_REQUIRE_CUDA();
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    for (const auto& shape : {std::vector<int64_t>{8, 24, 5, 5}, std::vector<int64_t>{64, 32, 32, 32}}) {
      for (auto layout : {Layout::contiguous, Layout::channels_last}) {
        const Case c = make_case(shape, dtype, dtype, layout, "leaky_relu", 0.2);
        Inputs in = random_inputs(c, torch::kCUDA);
        in.x = in.x.mul(0.25).add_(50);  // keeps the layout
        Result got = run_hierpar(c, in);
        Result ref = run_reference(c, in, got.out);
        compare(got, ref, c, scaled_rtol(c.dtype), "cuda offset data");
      }
    }
  }
}

// The same values in a buffer starting one element past a 16-byte boundary (same sizes and strides):
// the kernels must then take their scalar path.
torch::Tensor misaligned_copy(const torch::Tensor& t) {
  auto flat = torch::empty({t.numel() + 1}, t.options());
  auto v = flat.narrow(0, 1, t.numel()).as_strided(t.sizes(), t.strides());
  v.copy_(t);
  return v;
}

int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

// The backward op called directly: with the input given (for identity/leaky_relu the kernels' variant that
// reads the input, which autograd only uses for relu) and with only the parameter gradients asked for
// (the sums-only launch, in which only the first block row of the split path writes them).
void check_direct_backward(const Case& c, const Inputs& in, const Result& got, const Result& ref,
                           const std::string& where) {
  const std::string ctx = where + " " + c.describe();
  const double rtol = scaled_rtol(c.dtype);
  const torch::Tensor x = in.x.detach(), out = got.out.detach();
  auto [dx, dw, db] = hierpar::ops::batch_norm_act_backward(
      in.dy, out, x, opt(c.affine, in.w), opt(c.affine, in.b), got.save_mean, got.save_invstd, c.training, c.eps,
      c.act, c.slope, {true, c.affine, c.affine});
  expect_scaled(dx, ref.dx, rtol, "grad_input (input given), " + ctx, ref.dx_terms);
  if (!c.affine) return;
  expect_scaled(dw, ref.dw, rtol, "grad_weight (input given), " + ctx, ref.dw_terms);
  expect_scaled(db, ref.db, rtol, "grad_bias (input given), " + ctx, ref.db_terms);
  auto [no_dx, dw2, db2] = hierpar::ops::batch_norm_act_backward(
      in.dy, out, c.act == "relu" ? std::optional<torch::Tensor>(x) : std::nullopt, in.w, in.b, got.save_mean,
      got.save_invstd, c.training, c.eps, c.act, c.slope, {false, true, true});
  EXPECT_FALSE(no_dx.defined()) << ctx;
  expect_scaled(dw2, ref.dw, rtol, "grad_weight (sums only), " + ctx, ref.dw_terms);
  expect_scaled(db2, ref.db, rtol, "grad_bias (sums only), " + ctx, ref.db_terms);
}

// hierpar's forward + backward on `in` against the reference: values, the activation's branches, the output's
// layout, and the backward op called directly.
void expect_matches_reference(const Case& c, const Inputs& in, const std::string& where) {
  const auto [got, ref] = check_against_reference(c, in, where);
  check_direct_backward(c, in, got, ref, where);
}

// Runs body(path) on each of the two paths that shapes beyond the one-kernel path take: the cluster path
// (the default, for tensors up to 8 MiB whose rows fit the staging) and the cooperative split path
// (Switch::bn_cluster off).
template <typename Body>
void on_both_split_paths(Body body) {
  {
    const hierpar::SwitchScope cluster(hierpar::Switch::bn_cluster, true);
    body(std::string("cluster path"));
  }
  const hierpar::SwitchScope split(hierpar::Switch::bn_cluster, false);
  body(std::string("cooperative split path"));
}

// Shapes drawn so that each CUDA path is taken (see ops/cuda/batch_norm_act/batch_norm_act.cuh): channels_last and
// NCHW addressing; 16-byte vectors (channels resp. H*W a multiple of 16 bytes' worth of elements) and the
// scalar fallback (not a multiple, or a misaligned buffer); the one-kernel path (<= 8 vectors per thread
// and channel group, 512 threads) and the split path (one cooperative launch: partials, grid sync, every
// block combining them), with one or several channel groups; the backward with and without the input and
// with only the parameter gradients; every dtype, every activation, training and eval.
TEST(BatchNormActCuda, EveryKernelPathAgainstAten) {
  HIERPAR_REQUIRE_CUDA();
  on_both_split_paths([](const std::string& path) {
    constexpr int64_t kThreads = 512;
    for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf, torch::kDouble}) {
      const int64_t V = 16 / c10::elementSize(dtype);
      for (bool channels_last : {false, true}) {
        for (int vec_mode : {0, 1, 2}) {  // 0: vectors, 1: sizes not a multiple, 2: misaligned buffer
          for (bool split : {false, true}) {
            const bool vec_sizes = vec_mode != 1, vectors = vec_mode == 0;
            Case c;
            c.dtype = dtype;
            c.param_dtype = dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
            c.layout = channels_last ? Layout::channels_last : Layout::contiguous;
            random_activation(c);
            c.affine = rand_int(0, 3) != 0;
            c.training = rand_int(0, 4) != 0;
            c.running = !c.training || coin();
            int64_t C, H, W, rows_per_lane_limit;
            if (channels_last) {
              // Up to 20 vector columns (8 per block) resp. 10 * V - 1 scalar ones (32 per block): one to
              // three channel groups.
              C = vec_sizes ? V * rand_int(1, 20) : V * rand_int(0, 9) + rand_int(1, V - 1);
              H = rand_int(1, 7);
              W = rand_int(2, 7);
              const int64_t cols = vectors ? C / V : C;
              const int64_t bx = std::min<int64_t>(pow2_at_least(cols), vectors ? 8 : 32);
              rows_per_lane_limit = 8 * (kThreads / bx);  // rows (= N*H*W) beyond which the rows are split
            } else {
              C = rand_int(1, 5);
              H = 2 * rand_int(0, 3) + 1;  // odd: H*W is a multiple of V exactly when W is
              W = vec_sizes ? V * rand_int(1, 4) : V * rand_int(0, 3) + rand_int(1, V - 1);
              rows_per_lane_limit = 8 * kThreads * (vectors ? V : 1);  // in elements N*H*W
              if (H * W == 1) H = 3;  // H*W == 1 is addressed as channels_last
            }
            const int64_t L = H * W;
            const int64_t n_max_single = std::max<int64_t>(1, rows_per_lane_limit / L);
            const int64_t N = split ? n_max_single + rand_int(1, n_max_single + 3) : rand_int(1, n_max_single);
            c.shape = {N, C, H, W};
            if (N * L < 2) c.shape[0] = 2;
            Inputs in = random_inputs(c, torch::kCUDA);
            if (vec_mode == 2) {
              in.x = misaligned_copy(in.x);
              in.dy = misaligned_copy(in.dy);
            }
            expect_matches_reference(c, in, std::string("cuda path vec_mode=") + std::to_string(vec_mode) +
                                                (split ? " split (" + path + ")" : " one-kernel"));
          }
        }
      }
    }
  });
}

// The cluster path's shapes and boundaries, each also on the cooperative split path. The cluster path takes
// training calls that would split their rows, with at most 512 rows per CTA of a cluster of 8 (N*H*W <= 4096
// vector rows) and at most 8 MiB: the rows limit exactly and just beyond it, the bytes limit exactly and
// beyond it (1024 channels); batch 1; channel counts that leave columns of a block idle (6 of 8 columns,
// 3 of 4) and odd ones on the scalar path (5 and 33 float32 channels: 8 resp. 32 columns per block); every
// dtype it stages (2-byte scalar vectors cannot be staged and keep the split path); NCHW shapes (one channel
// per block: splitting starts beyond 4096 vector rows, so they keep the split path); every activation; the
// backward with and without the input, and with only the parameter gradients (that launch keeps the split
// path).
TEST(BatchNormActCuda, ClusterPathShapesAndBoundaries) {
  HIERPAR_REQUIRE_CUDA();
  struct Shape {
    std::vector<int64_t> shape;
    c10::ScalarType dtype;
    Layout layout;
  };
  const std::vector<Shape> shapes{
      {{64, 48, 8, 8}, torch::kFloat, Layout::channels_last},      // 4096 rows: the rows limit
      {{65, 48, 8, 8}, torch::kFloat, Layout::channels_last},      // 4160 rows: beyond
      {{8, 1024, 16, 16}, torch::kFloat, Layout::channels_last},   // 8 MiB: the bytes limit
      {{9, 1024, 16, 16}, torch::kFloat, Layout::channels_last},   // 9 MiB: beyond
      {{256, 512, 4, 4}, torch::kFloat, Layout::channels_last},    // both limits exactly
      {{64, 256, 4, 4}, torch::kFloat, Layout::channels_last},     // the batch-64 DCGAN layers
      {{64, 128, 8, 8}, torch::kFloat, Layout::channels_last},
      {{64, 64, 16, 16}, torch::kFloat, Layout::channels_last},
      {{64, 256, 4, 4}, torch::kBFloat16, Layout::channels_last},
      {{64, 128, 8, 8}, torch::kBFloat16, Layout::channels_last},
      {{1, 24, 64, 64}, torch::kFloat, Layout::channels_last},  // batch 1; 6 of 8 columns per block
      {{1, 3, 256, 256}, torch::kFloat, Layout::contiguous},    // batch 1, NCHW
      {{64, 32, 32, 32}, torch::kFloat, Layout::contiguous},
      {{16, 5, 16, 16}, torch::kFloat, Layout::channels_last},  // scalar path, 5 of 8 columns
      {{16, 33, 8, 8}, torch::kFloat, Layout::channels_last},   // scalar path, 33 columns
      {{16, 6, 16, 16}, torch::kDouble, Layout::channels_last},
      {{16, 16, 16, 16}, torch::kHalf, Layout::channels_last},
      {{256, 24, 16, 16}, torch::kHalf, Layout::contiguous},
      {{8, 24, 16, 16}, torch::kBFloat16, Layout::channels_last},  // 3 of 4 columns (bf16 vectors of 8)
  };
  on_both_split_paths([&](const std::string& path) {
    for (const auto& s : shapes) {
      Case c;
      c.shape = s.shape;
      c.dtype = s.dtype;
      c.param_dtype = s.dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
      c.layout = s.layout;
      random_activation(c);
      c.affine = rand_int(0, 3) != 0;
      c.running = coin();
      Inputs in = random_inputs(c, torch::kCUDA);
      expect_matches_reference(c, in, "cuda " + path);
    }
  });
}

// Split path with more rows per thread than a block stages in shared memory (~210 KB per block at one
// block per SM: 27 rows of 16-byte vectors per thread for the forward, 13 for the backward's two streams,
// 9 for three; fp32 kernels at two blocks per SM about half): both passes read the remaining rows from
// global memory, the staged ones from shared memory. Such shapes hold more than the SMs' shared memory,
// i.e. >= ~30 MB: the batch-1024 DCGAN layer with relu (the backward stages dy, out and x) and
// leaky_relu, and an fp32 NCHW one with identity.
TEST(BatchNormActCuda, SplitPathBeyondTheStagedRows) {
  HIERPAR_REQUIRE_CUDA();
  struct Shape {
    std::vector<int64_t> shape;
    c10::ScalarType dtype;
    Layout layout;
    const char* act;
  };
  for (const auto& s : {Shape{{1024, 64, 16, 16}, torch::kBFloat16, Layout::channels_last, "relu"},
                        Shape{{1024, 64, 16, 16}, torch::kBFloat16, Layout::channels_last, "leaky_relu"},
                        Shape{{64, 3, 256, 256}, torch::kFloat, Layout::contiguous, "identity"}}) {
    const Case c = make_case(s.shape, s.dtype, torch::kFloat, s.layout, s.act, 0.2);
    Inputs in = random_inputs(c, torch::kCUDA);
    Result got = run_hierpar(c, in);
    Result ref = run_reference(c, in, got.out);
    compare(got, ref, c, scaled_rtol(c.dtype), "cuda beyond the staged rows");
    check_branches(got, ref, c, "cuda beyond the staged rows");
    check_direct_backward(c, in, got, ref, "cuda beyond the staged rows");
  }
}

// The staged split path on every GPU of the process, in turn: its shared-memory attribute is per device (the
// second device's launches once failed with "too many blocks in cooperative launch").
TEST(BatchNormActCuda, SplitPathOnEveryDevice) {
  HIERPAR_REQUIRE_CUDA();
  const int64_t devices = static_cast<int64_t>(torch::cuda::device_count());
  if (devices < 2) GTEST_SKIP() << "needs 2 GPUs (has " << devices << ")";
  const Case c = make_case({1024, 64, 16, 16}, torch::kBFloat16, torch::kFloat,
                           Layout::channels_last, "leaky_relu", 0.2);
  for (int64_t d = 0; d < devices; ++d) {
    const std::string what = "cuda:" + std::to_string(d) + " staged split path";
    Inputs in = random_inputs(c, torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(d)));
    Result got = run_hierpar(c, in);
    Result ref = run_reference(c, in, got.out);
    compare(got, ref, c, scaled_rtol(c.dtype), what);
    check_direct_backward(c, in, got, ref, what);
  }
}

// The split and cluster paths combine the partials in a fixed order in every block: two calls in a row give
// bit-identical results (split: NCHW float32, channels_last bfloat16 with several channel groups; cluster:
// channels_last float32 with an idle column), on each path.
TEST(BatchNormActCuda, SplitPathRepeatsExactly) {
  HIERPAR_REQUIRE_CUDA();
  struct Shape {
    std::vector<int64_t> shape;
    c10::ScalarType dtype;
    bool channels_last;
  };
  const std::vector<Shape> shapes{{{64, 24, 20, 20}, torch::kFloat, false},
                                  {{256, 136, 8, 8}, torch::kBFloat16, true},
                                  {{64, 136, 8, 8}, torch::kFloat, true}};
  on_both_split_paths([&](const std::string& path) {
    for (const auto& [shape, dtype, channels_last] : shapes) {
      const auto opts = torch::TensorOptions().dtype(dtype).device(torch::kCUDA);
      auto x = random_tensor(shape, opts, channels_last ? Layout::channels_last : Layout::contiguous);
      auto dy = random_tensor(shape, opts, channels_last ? Layout::channels_last : Layout::contiguous);
      auto popts = opts.dtype(torch::kFloat);
      auto w = random_tensor({shape[1]}, popts), b = random_tensor({shape[1]}, popts);
      auto once = [&] {
        auto [out, mean, invstd] = hierpar::ops::batch_norm_act(x, w, b, std::nullopt, std::nullopt, true, 0.1, 1e-5,
                                                                "leaky_relu", 0.2);
        auto [dx, dw, db] = hierpar::ops::batch_norm_act_backward(dy, out, std::nullopt, w, b, mean, invstd, true,
                                                                  1e-5, "leaky_relu", 0.2, {true, true, true});
        return std::vector<torch::Tensor>{out, mean, invstd, dx, dw, db};
      };
      auto first = once(), second = once();
      for (size_t i = 0; i < first.size(); ++i) {
        EXPECT_TRUE(torch::equal(first[i], second[i])) << path << ": result " << i << " shape " << c10::IntArrayRef(shape);
      }
    }
  });
}

// The split path is a cooperative launch, the cluster path a cluster launch: each must capture into a CUDA
// graph (the training step is replayed as one) and the replay, with new input values copied in, must equal
// eager calls bit for bit.
TEST(BatchNormActCuda, SplitPathReplaysFromACudaGraph) {
  HIERPAR_REQUIRE_CUDA();
  // 9 vector columns: several channel groups; 16384 rows (the split path) and 4096 (the cluster path)
  const std::vector<std::vector<int64_t>> shapes{{256, 72, 8, 8}, {64, 72, 8, 8}};
  on_both_split_paths([&](const std::string& path) {
    for (const auto& shape : shapes) {
      const auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
      auto x = random_tensor(shape, opts, Layout::channels_last), dy = random_tensor(shape, opts, Layout::channels_last);
      auto w = random_tensor({shape[1]}, opts.dtype(torch::kFloat)), b = random_tensor({shape[1]}, opts.dtype(torch::kFloat));
      auto rm = torch::zeros({shape[1]}, w.options()), rv = torch::ones({shape[1]}, w.options());
      auto step = [&](const torch::Tensor& rm_, const torch::Tensor& rv_) {
        auto [out, mean, invstd] = hierpar::ops::batch_norm_act(x, w, b, rm_, rv_, true, 0.1, 1e-5, "leaky_relu", 0.2);
        auto [dx, dw, db] = hierpar::ops::batch_norm_act_backward(dy, out, std::nullopt, w, b, mean, invstd, true, 1e-5,
                                                                  "leaky_relu", 0.2, {true, true, true});
        return std::vector<torch::Tensor>{out, mean, invstd, dx, dw, db};
      };
      c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
      torch::cuda::synchronize();
      at::cuda::CUDAGraph graph;
      std::vector<torch::Tensor> captured;
      {
        c10::cuda::CUDAStreamGuard guard(side);
        graph.capture_begin();
        captured = step(rm, rv);
        graph.capture_end();
      }
      torch::cuda::synchronize();
      auto rm_eager = torch::zeros_like(rm), rv_eager = torch::ones_like(rv);
      for (int replay = 0; replay < 2; ++replay) {
        x.copy_(random_tensor(shape, opts, Layout::channels_last));
        dy.copy_(random_tensor(shape, opts, Layout::channels_last));
        torch::cuda::synchronize();
        graph.replay();
        torch::cuda::synchronize();
        auto eager = step(rm_eager, rv_eager);
        for (size_t i = 0; i < eager.size(); ++i) {
          EXPECT_TRUE(torch::equal(captured[i], eager[i]))
              << path << " " << c10::IntArrayRef(shape) << ": result " << i << ", replay " << replay;
        }
        EXPECT_TRUE(torch::equal(rm, rm_eager)) << path << " " << c10::IntArrayRef(shape) << ": running_mean, replay " << replay;
        EXPECT_TRUE(torch::equal(rv, rv_eager)) << path << " " << c10::IntArrayRef(shape) << ": running_var, replay " << replay;
      }
    }
  });
}

// The kernel that writes channel 0's statistics adds 1 to num_batches_tracked: exactly once per training call on
// every path (one kernel, cluster, cooperative split), never in eval, and once per replay of a captured call.
TEST(BatchNormActCuda, NumBatchesTrackedCountsEachTrainingCallOnce) {
  HIERPAR_REQUIRE_CUDA();
  const std::vector<std::vector<int64_t>> shapes{{2, 4, 3, 3}, {64, 72, 8, 8}, {256, 72, 8, 8}};
  on_both_split_paths([&](const std::string& path) {
    for (const auto& shape : shapes) {
      const std::string what = path + " " + c10::str(c10::IntArrayRef(shape));
      const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA);
      auto x = random_tensor(shape, opts, Layout::channels_last);
      auto rm = torch::zeros({shape[1]}, opts), rv = torch::ones({shape[1]}, opts);
      auto counter = torch::full({}, 5, opts.dtype(torch::kLong));
      auto call = [&](bool training) {
        hierpar::ops::batch_norm_act(x, std::nullopt, std::nullopt, rm, rv, training, 0.1, 1e-5, "identity", 0.01,
                                     counter);
      };
      for (int i = 0; i < 3; ++i) call(true);
      call(false);
      EXPECT_EQ(counter.item<int64_t>(), 8) << what;
      c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
      torch::cuda::synchronize();
      at::cuda::CUDAGraph graph;
      {
        c10::cuda::CUDAStreamGuard guard(side);
        graph.capture_begin();
        call(true);
        graph.capture_end();
      }
      torch::cuda::synchronize();
      graph.replay();
      graph.replay();
      torch::cuda::synchronize();
      EXPECT_EQ(counter.item<int64_t>(), 10) << what << ": two replays";
    }
  });
}

TEST(BatchNormActCuda, DeviceMismatchNamesTheArgument) {
  HIERPAR_REQUIRE_CUDA();
  auto x = random_tensor({2, 4, 3, 3}, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA));
  HIERPAR_EXPECT_THROW_MSG(hierpar::ops::batch_norm_act(x, torch::ones({4}), std::nullopt, std::nullopt, std::nullopt,
                                                        true, 0.1, 1e-5),
                           "weight: expected a tensor on cuda:0 (the input's device), got one on cpu");
  auto rm = torch::zeros({4}, torch::kCUDA), rv = torch::ones({4});
  HIERPAR_EXPECT_THROW_MSG(hierpar::ops::batch_norm_act(x, std::nullopt, std::nullopt, rm, rv, true, 0.1, 1e-5),
                           "running_var: expected a tensor on cuda:0 (the input's device), got one on cpu");
  HIERPAR_EXPECT_THROW_MSG(hierpar::ops::batch_norm_act(x, std::nullopt, std::nullopt, rm, rv.cuda(), true, 0.1, 1e-5,
                                                        "identity", 0.01, torch::zeros({}, torch::kLong)),
                           "num_batches_tracked: expected one int64 element on cuda:0 (the input's device), got Long of "
                           "shape [] on cpu");
}

}  // namespace
