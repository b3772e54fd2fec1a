// hierpar::strategy::FusedAdam against torch::optim::Adam: the same parameters, fed the same random
// gradients for K steps, must end with the same parameters and moments (CPU in float64 and float32, CUDA
// in float32 with channels_last parameters) under a learning-rate schedule, a captured CUDA graph of step()
// replayed K times (the schedule synced before each replay) must equal K eager steps, and bad input is refused
// with a message naming the argument.
//
// Tolerances: both implementations compute the same update in the same precision, in a different order of
// operations (the fused kernel folds the bias corrections into one expression). Each step's update is
// m / (sqrt(v) + eps) * lr with m, v exact to a few rounding units, so after K steps the parameters agree
// to a few units of the dtype's rounding of their O(1) values: tolerance_for(dtype) (float64 1e-10
// relative, float32 1e-5 relative / 1e-6 absolute). The graph replay runs the very same kernels on the
// same data as eager steps, so it must agree exactly.
#include "testing.h"

#include "hierpar/ops.h"
#include "hierpar/strategy/fused_adam.h"

#include <ATen/ops/_fused_adam.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <sstream>

namespace {

using namespace hierpar::testing;
using hierpar::strategy::FusedAdam;

// A few parameters of random shapes, the last one 4-d (a convolution weight), in the given layout.
std::vector<torch::Tensor> random_parameters(const torch::TensorOptions& options, Layout conv_layout) {
  std::vector<torch::Tensor> params;
  const int64_t count = rand_int(2, 5);
  for (int64_t i = 0; i < count; ++i) {
    std::vector<int64_t> shape;
    const int64_t dims = rand_int(1, 2);
    for (int64_t d = 0; d < dims; ++d) shape.push_back(rand_int(1, 37));
    params.push_back(random_tensor(shape, options));
  }
  params.push_back(random_tensor({rand_int(1, 9), rand_int(1, 9), 4, 4}, options, conv_layout));
  return params;
}

std::vector<torch::Tensor> leaf_copies(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_(true));  // clone keeps strides
  return out;
}

torch::optim::AdamOptions random_options() {
  auto options = torch::optim::AdamOptions(1e-2).betas({coin() ? 0.5 : 0.9, 0.999}).eps(1e-8);
  options.weight_decay(coin() ? 0.0 : 0.01);
  options.amsgrad(coin());
  return options;
}

std::string describe(const torch::optim::AdamOptions& o) {
  std::ostringstream s;
  s << "lr " << o.lr() << " betas (" << std::get<0>(o.betas()) << ", " << std::get<1>(o.betas()) << ") weight_decay "
    << o.weight_decay() << " amsgrad " << o.amsgrad() << " (seed " << run_seed() << ")";
  return s.str();
}

// The schedule the tests run: a decay of 20% a step from the options' lr.
double scheduled_lr(const torch::optim::AdamOptions& options, int step) { return options.lr() * std::pow(0.8, step); }

torch::optim::AdamOptions& options_of(torch::optim::Optimizer& optimizer) {
  return static_cast<torch::optim::AdamOptions&>(optimizer.param_groups().front().options());
}

// Steps FusedAdam and torch::optim::Adam K times on the same gradients, each step with the next learning rate of
// scheduled_lr set on both, and compares the results.
void compare_with_torch_adam(const torch::TensorOptions& options, Layout conv_layout, int steps,
                             hierpar::strategy::AdamKernel kernel = hierpar::strategy::AdamKernel::hierpar) {
  const auto adam_options = random_options();
  const auto initial = random_parameters(options, conv_layout);
  auto fused_params = leaf_copies(initial), torch_params = leaf_copies(initial);
  FusedAdam fused(fused_params, adam_options, kernel);
  torch::optim::Adam reference(torch_params, adam_options);
  for (int k = 0; k < steps; ++k) {
    fused.zero_grad();
    reference.zero_grad();
    for (size_t i = 0; i < initial.size(); ++i) {
      // Autograd gives a gradient its parameter's strides; so does empty_like + copy_ here.
      auto grad = random_tensor(initial[i].sizes(), options);
      fused_params[i].mutable_grad() = torch::empty_like(fused_params[i]).copy_(grad);
      torch_params[i].mutable_grad() = torch::empty_like(torch_params[i]).copy_(grad);
    }
    options_of(fused).lr(scheduled_lr(adam_options, k));
    options_of(reference).lr(scheduled_lr(adam_options, k));
    fused.step();
    reference.step();
    if (k == 0) {
      // The parameters move (so the comparison below is not of untouched copies): Adam's first step moves
      // every element by lr * sign(grad) (|grad| >> eps here).
      for (size_t i = 0; i < initial.size(); ++i) {
        EXPECT_GT((fused_params[i] - initial[i]).abs().min().item<double>(), adam_options.lr() / 2);
      }
    }
  }
  const auto what = describe(adam_options) + " " + to_string(conv_layout);
  for (size_t i = 0; i < initial.size(); ++i) {
    expect_close(fused_params[i], torch_params[i], what + " parameter " + std::to_string(i));
    const auto& state =
        static_cast<const torch::optim::AdamParamState&>(*reference.state().at(torch_params[i].unsafeGetTensorImpl()));
    expect_close(fused.exp_avg(i), state.exp_avg(), what + " exp_avg " + std::to_string(i));
    expect_close(fused.exp_avg_sq(i), state.exp_avg_sq(), what + " exp_avg_sq " + std::to_string(i));
    if (adam_options.amsgrad()) {
      expect_close(fused.max_exp_avg_sq(i), state.max_exp_avg_sq(), what + " max_exp_avg_sq " + std::to_string(i));
    }
    EXPECT_EQ(fused.step_count(i).item<double>(), steps) << what;
    EXPECT_EQ(fused.exp_avg(i).strides(), fused_params[i].strides()) << what << ": moments keep the layout";
  }
}

TEST(FusedAdam, MatchesTorchAdamOnCpuDouble) {
  compare_with_torch_adam(torch::dtype(torch::kDouble), coin() ? Layout::channels_last : Layout::contiguous, 7);
}

TEST(FusedAdam, MatchesTorchAdamOnCpuFloat) {
  compare_with_torch_adam(torch::dtype(torch::kFloat), coin() ? Layout::channels_last : Layout::contiguous, 7);
}

TEST(FusedAdam, MatchesTorchAdamOnCuda) {
  HIERPAR_REQUIRE_CUDA();
  compare_with_torch_adam(torch::dtype(torch::kFloat).device(torch::kCUDA), Layout::contiguous, 9);
  compare_with_torch_adam(torch::dtype(torch::kFloat).device(torch::kCUDA), Layout::channels_last, 9);
  // ATen's kernel, which the benchmarks' stock rows use.
  compare_with_torch_adam(torch::dtype(torch::kFloat).device(torch::kCUDA), Layout::channels_last, 9,
                          hierpar::strategy::AdamKernel::aten);
}

// step() captured into one CUDA graph, replayed K times with new gradients copied into the static gradient
// tensors and the next scheduled learning rate synced before each replay, equals K eager steps bit for bit.
TEST(FusedAdam, CapturedStepEqualsEagerSteps) {
  HIERPAR_REQUIRE_CUDA();
  const auto options = torch::dtype(torch::kFloat).device(torch::kCUDA);
  const auto adam_options = random_options();
  const auto initial = random_parameters(options, Layout::channels_last);
  auto eager_params = leaf_copies(initial), graph_params = leaf_copies(initial);
  FusedAdam eager(eager_params, adam_options), graphed(graph_params, adam_options);
  for (auto& p : graph_params) p.mutable_grad() = torch::zeros_like(p);

  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  torch::cuda::synchronize();  // the parameters were written on the current stream
  at::cuda::CUDAGraph graph;
  {
    c10::cuda::CUDAStreamGuard guard(side);
    graph.capture_begin();
    graphed.step();
    graph.capture_end();
  }
  torch::cuda::synchronize();
  // Capturing ran nothing: the parameters and the step counters are untouched.
  for (size_t i = 0; i < initial.size(); ++i) {
    EXPECT_TRUE(torch::equal(graph_params[i], initial[i]));
    EXPECT_EQ(graphed.step_count(i).item<double>(), 0);
  }
  const int steps = 6;
  for (int k = 0; k < steps; ++k) {
    for (size_t i = 0; i < initial.size(); ++i) {
      auto grad = random_tensor(initial[i].sizes(), options);
      graph_params[i].mutable_grad().copy_(grad);
      eager_params[i].mutable_grad() = torch::empty_like(eager_params[i]).copy_(grad);
    }
    options_of(graphed).lr(scheduled_lr(adam_options, k));
    graphed.sync_learning_rate();
    graph.replay();
    options_of(eager).lr(scheduled_lr(adam_options, k));
    eager.step();
  }
  const auto what = describe(adam_options);
  for (size_t i = 0; i < initial.size(); ++i) {
    expect_close(graph_params[i], eager_params[i], Tolerance{0, 0}, what + " parameter " + std::to_string(i));
    expect_close(graphed.exp_avg_sq(i), eager.exp_avg_sq(i), Tolerance{0, 0}, what + " exp_avg_sq " + std::to_string(i));
    EXPECT_EQ(graphed.step_count(i).item<double>(), steps) << what;
  }
}

// A learning rate changed after the last sync and then captured would put its fill into the graph, which each
// replay would repeat over later changes: step() refuses it, and a sync before capture_begin is the way.
TEST(FusedAdam, RefusesALearningRateChangedDuringCapture) {
  HIERPAR_REQUIRE_CUDA();
  auto params = leaf_copies(random_parameters(torch::dtype(torch::kFloat).device(torch::kCUDA), Layout::contiguous));
  for (auto& p : params) p.mutable_grad() = torch::zeros_like(p);
  FusedAdam fused(params, torch::optim::AdamOptions(1e-2));
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  torch::cuda::synchronize();
  at::cuda::CUDAGraph graph;
  {
    c10::cuda::CUDAStreamGuard guard(side);
    graph.capture_begin();
    options_of(fused).lr(5e-3);
    HIERPAR_EXPECT_THROW_MSG(fused.step(), "the learning rate changed (0.01 -> 0.005) while a CUDA graph is being "
                             "captured: call sync_learning_rate() before capture_begin");
    graph.capture_end();
  }
  fused.sync_learning_rate();  // outside a capture: accepted
  EXPECT_NO_THROW(fused.step());
}

TEST(FusedAdam, SkipsParametersWithoutGradient) {
  auto params = leaf_copies(random_parameters(torch::dtype(torch::kFloat), Layout::contiguous));
  const auto untouched = params[0].detach().clone();
  FusedAdam fused(params, torch::optim::AdamOptions(1e-2));
  for (size_t i = 1; i < params.size(); ++i) params[i].mutable_grad() = random_tensor(params[i].sizes(), params[i].options());
  fused.step();
  EXPECT_TRUE(torch::equal(params[0], untouched));
  EXPECT_EQ(fused.step_count(0).item<double>(), 0);
  EXPECT_EQ(fused.step_count(1).item<double>(), 1);
}

TEST(FusedAdam, ZeroGrad) {
  auto params = leaf_copies(random_parameters(torch::dtype(torch::kFloat), Layout::contiguous));
  FusedAdam fused(params);
  for (auto& p : params) p.mutable_grad() = random_tensor(p.sizes(), p.options());
  const void* storage = params[0].grad().data_ptr();
  fused.zero_grad(/*set_to_none=*/false);
  for (const auto& p : params) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().abs().max().item<double>(), 0);
  }
  EXPECT_EQ(params[0].grad().data_ptr(), storage) << "zero_grad(false) zeroes in place";
  fused.zero_grad();
  for (const auto& p : params) EXPECT_FALSE(p.grad().defined());
}

// FusedAdam writes and reads torch::optim::Adam's archive: its state saved after K steps loads into a
// torch::optim::Adam (and back), and both then continue with the same updates.
TEST(FusedAdam, CheckpointInterchangesWithTorchAdam) {
  const auto options = torch::dtype(torch::kDouble);
  const auto adam_options = random_options();
  const auto initial = random_parameters(options, coin() ? Layout::channels_last : Layout::contiguous);
  auto fused_params = leaf_copies(initial);
  FusedAdam fused(fused_params, adam_options);
  auto feed = [&](std::vector<torch::Tensor>& params) {
    for (size_t i = 0; i < params.size(); ++i) {
      // The same gradients for both optimisers in every round (drawn from a seed of the round).
      params[i].mutable_grad() = torch::empty_like(params[i]).copy_(random_tensor(params[i].sizes(), options));
    }
  };
  for (int k = 0; k < 3; ++k) {
    feed(fused_params);
    fused.step();
  }
  fused_params[0].mutable_grad().reset();  // ... and one step where parameter 0 has no gradient
  fused.step();
  std::stringstream archive;
  {
    torch::serialize::OutputArchive out;
    fused.save(out);
    out.save_to(archive);
  }
  // Into a torch::optim::Adam over copies of the parameters.
  auto torch_params = leaf_copies(fused_params);
  torch::optim::Adam reference(torch_params, adam_options);
  {
    torch::serialize::InputArchive in;
    in.load_from(archive);
    reference.load(in);
  }
  const auto what = describe(adam_options);
  for (size_t i = 0; i < initial.size(); ++i) {
    const auto& state =
        static_cast<const torch::optim::AdamParamState&>(*reference.state().at(torch_params[i].unsafeGetTensorImpl()));
    EXPECT_EQ(state.step(), i == 0 ? 3 : 4) << what;
    expect_close(state.exp_avg(), fused.exp_avg(i), Tolerance{0, 0}, what + " exp_avg " + std::to_string(i));
    expect_close(state.exp_avg_sq(), fused.exp_avg_sq(i), Tolerance{0, 0}, what + " exp_avg_sq " + std::to_string(i));
  }
  // Back into a fresh FusedAdam, from the torch::optim::Adam's own archive.
  std::stringstream second;
  {
    torch::serialize::OutputArchive out;
    reference.save(out);
    out.save_to(second);
  }
  auto resumed_params = leaf_copies(fused_params);
  FusedAdam resumed(resumed_params, adam_options);
  {
    torch::serialize::InputArchive in;
    in.load_from(second);
    resumed.load(in);
  }
  for (int k = 0; k < 2; ++k) {
    torch::manual_seed(100 + k);
    feed(torch_params);
    torch::manual_seed(100 + k);
    feed(resumed_params);
    reference.step();
    resumed.step();
  }
  for (size_t i = 0; i < initial.size(); ++i) {
    expect_close(resumed_params[i], torch_params[i], what + " parameter " + std::to_string(i) + " after the resume");
    EXPECT_EQ(resumed.step_count(i).item<double>(), i == 0 ? 5 : 6) << what;
  }
}

TEST(FusedAdam, RejectsBadInput) {
  auto p = torch::randn({3, 4}).requires_grad_(true);
  HIERPAR_EXPECT_THROW_MSG(FusedAdam({}), "parameters: expected at least one tensor");
  HIERPAR_EXPECT_THROW_MSG(FusedAdam({p}, torch::optim::AdamOptions(-1.0)), "lr: expected a non-negative");
  HIERPAR_EXPECT_THROW_MSG(FusedAdam({p}, torch::optim::AdamOptions().betas({0.5, 1.0})), "betas: expected both in [0, 1)");
  HIERPAR_EXPECT_THROW_MSG(FusedAdam({p}, torch::optim::AdamOptions().eps(-1.0)), "eps: expected a non-negative");
  HIERPAR_EXPECT_THROW_MSG(FusedAdam({p}, torch::optim::AdamOptions().weight_decay(-1.0)),
                           "weight_decay: expected a non-negative");
  HIERPAR_EXPECT_THROW_MSG(FusedAdam({p, torch::ones({2}, torch::kLong)}), "parameters[1]: expected a defined, dense");
  HIERPAR_EXPECT_THROW_MSG(FusedAdam({p, torch::randn({3, 8}).slice(1, 0, 8, 2)}), "parameters[1]: expected a defined, dense");
  FusedAdam fused({p});
  p.mutable_grad() = torch::randn({4, 3}).t();  // right shape, transposed strides
  HIERPAR_EXPECT_THROW_MSG(fused.step(), "the gradient of parameters[0]: expected a dense");
  HIERPAR_EXPECT_THROW_MSG(fused.step([] { return torch::Tensor(); }), "a loss closure is not supported");
}

// The op under FusedAdam on its own: hierpar::fused_adam_ (hierpar's CUDA kernel) against ATen's fused Adam on
// the same GPU state, in every dtype, with tensors whose sizes straddle the kernel's 2048-element blocks, one of
// one element, an empty one, and more tensors than one launch's table holds (so the update takes several
// launches). Both compute in the dtype's opmath type (fp32 for half/bf16) with the same formula in a possibly
// different order: they agree to a few rounding units of the stored dtype, tolerance_for(dtype).
TEST(FusedAdamOp, CudaMatchesAtenFusedAdam) {
  HIERPAR_REQUIRE_CUDA();
  for (const auto dtype : {torch::kFloat, torch::kDouble, torch::kHalf, torch::kBFloat16}) {
    const bool amsgrad = coin();
    const double weight_decay = coin() ? 0.0 : 0.01;
    const auto options = torch::dtype(dtype).device(torch::kCUDA);
    std::vector<std::vector<int64_t>> shapes = {{2048 * rand_int(1, 40) + rand_int(-1, 1)}, {1}, {0},
                                                {rand_int(1, 9), rand_int(1, 9), 4, 4}, {rand_int(100, 400), 33}};
    for (int64_t i = rand_int(60, 70); i > 0; --i) shapes.push_back({rand_int(1, 3000)});
    std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
    for (const auto& shape : shapes) {
      params.push_back(random_tensor(shape, options));
      grads.push_back(random_tensor(shape, options));
      exp_avgs.push_back(random_tensor(shape, options) * 0.1);
      exp_avg_sqs.push_back(random_tensor(shape, options).abs() * 0.01);
      if (amsgrad) max_exp_avg_sqs.push_back(random_tensor(shape, options).abs() * 0.01);
      steps.push_back(torch::full({}, static_cast<double>(rand_int(1, 50)), options.dtype(torch::kFloat)));
    }
    auto clones = [](const std::vector<torch::Tensor>& v) {
      std::vector<torch::Tensor> out;
      for (const auto& t : v) out.push_back(t.clone());
      return out;
    };
    const auto initial_params = clones(params);
    auto ref_params = clones(params), ref_exp_avgs = clones(exp_avgs), ref_exp_avg_sqs = clones(exp_avg_sqs),
         ref_max = clones(max_exp_avg_sqs);
    const double lr = 1e-2, beta1 = coin() ? 0.5 : 0.9, beta2 = 0.999, eps = 1e-8;
    // Either overload: the learning rate as a number or as a device tensor (tensor_lr).
    const bool tensor_lr = coin();
    if (tensor_lr) {
      const auto lr_tensor = torch::full({}, lr, options.dtype(dtype == torch::kDouble ? torch::kDouble : torch::kFloat));
      hierpar::ops::fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr_tensor, beta1,
                                beta2, weight_decay, eps, amsgrad);
    } else {
      hierpar::ops::fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2,
                                weight_decay, eps, amsgrad);
    }
    at::_fused_adam_(ref_params, grads, ref_exp_avgs, ref_exp_avg_sqs, ref_max, steps, lr, beta1, beta2, weight_decay,
                     eps, amsgrad, /*maximize=*/false);
    const std::string what = c10::str(dtype, " amsgrad ", amsgrad, " weight_decay ", weight_decay, " beta1 ", beta1,
                                      " tensor_lr ", tensor_lr, " (seed ", run_seed(), ")");
    for (size_t i = 0; i < shapes.size(); ++i) {
      const std::string which = what + " tensor " + std::to_string(i);
      expect_close(params[i], ref_params[i], which + " param");
      expect_close(exp_avgs[i], ref_exp_avgs[i], which + " exp_avg");
      expect_close(exp_avg_sqs[i], ref_exp_avg_sqs[i], which + " exp_avg_sq");
      if (amsgrad) expect_close(max_exp_avg_sqs[i], ref_max[i], which + " max_exp_avg_sq");
    }
    // The parameters moved (the comparison is not of untouched tensors). From random moments a step can be far
    // below lr, and a tiny one rounds away in half/bf16, so per tensor of >= 64 elements: some element moved.
    for (size_t i = 0; i < shapes.size(); ++i) {
      if (params[i].numel() < 64) continue;
      EXPECT_GT((params[i] - initial_params[i]).abs().max().item<double>(), 0) << what << " tensor " << i;
    }
  }
}

TEST(FusedAdamOp, RejectsBadInput) {
  const auto p = torch::randn({3, 4}), g = torch::randn({3, 4}), m = torch::zeros({3, 4}), v = torch::zeros({3, 4});
  const auto s = torch::ones({});
  auto call = [](std::vector<torch::Tensor> ps, std::vector<torch::Tensor> gs, std::vector<torch::Tensor> ms,
                 std::vector<torch::Tensor> vs, std::vector<torch::Tensor> maxs, std::vector<torch::Tensor> ss,
                 bool amsgrad = false, double lr = 1e-3) {
    hierpar::ops::fused_adam_(ps, gs, ms, vs, maxs, ss, lr, 0.9, 0.999, 0.0, 1e-8, amsgrad);
  };
  HIERPAR_EXPECT_THROW_MSG(call({p}, {g, g}, {m}, {v}, {}, {s}), "grads, exp_avgs, exp_avg_sqs and steps: expected 1");
  HIERPAR_EXPECT_THROW_MSG(call({p}, {g}, {m}, {v}, {}, {s}, /*amsgrad=*/true), "max_exp_avg_sqs: expected 1");
  HIERPAR_EXPECT_THROW_MSG(call({p}, {g}, {m}, {v}, {}, {s}, false, -1.0), "lr: expected a non-negative");
  HIERPAR_EXPECT_THROW_MSG(call({torch::ones({3}, torch::kLong)}, {g}, {m}, {v}, {}, {s}), "params[0]: expected a dense");
  HIERPAR_EXPECT_THROW_MSG(call({p, p.to(torch::kDouble)}, {g, g}, {m, m}, {v, v}, {}, {s, s}),
                           "params[1]: expected params[0]'s device and dtype");
  HIERPAR_EXPECT_THROW_MSG(call({p}, {torch::randn({4, 3}).t()}, {m}, {v}, {}, {s}), "grads[0]: expected a dense");
  HIERPAR_EXPECT_THROW_MSG(call({p}, {g}, {m.to(torch::kDouble)}, {v}, {}, {s}), "exp_avgs[0]: expected a dense");
  HIERPAR_EXPECT_THROW_MSG(call({p}, {g}, {m}, {torch::zeros({3})}, {}, {s}), "exp_avg_sqs[0]: expected a dense");
  HIERPAR_EXPECT_THROW_MSG(call({p}, {g}, {m}, {v}, {}, {torch::ones({}, torch::kDouble)}),
                           "steps[0]: expected a one-element float32 tensor");
  // The tensor_lr overload's learning rate: one element, the params' device, float32 (float64 for float64 params).
  auto call_tensor_lr = [&](const torch::Tensor& params, const torch::Tensor& lr) {
    hierpar::ops::fused_adam_({params}, {g.to(params.dtype())}, {m.to(params.dtype())}, {v.to(params.dtype())}, {},
                              {s}, lr, 0.9, 0.999, 0.0, 1e-8, false);
  };
  HIERPAR_EXPECT_THROW_MSG(call_tensor_lr(p, torch::full({}, 1e-3, torch::kDouble)),
                           "lr: expected a one-element Float tensor on cpu");
  HIERPAR_EXPECT_THROW_MSG(call_tensor_lr(p, torch::full({2}, 1e-3)), "lr: expected a one-element Float tensor");
  HIERPAR_EXPECT_THROW_MSG(call_tensor_lr(p.to(torch::kDouble), torch::full({}, 1e-3)),
                           "lr: expected a one-element Double tensor on cpu (the learning rate for Double params)");
  HIERPAR_EXPECT_THROW_MSG(call_tensor_lr(p, torch::Tensor()), "lr: expected a one-element Float tensor");
  // On the CPU the tensor_lr overload computes what the number overload does (an lr that float32 holds exactly).
  {
    auto p1 = p.clone(), p2 = p.clone(), m1 = m.clone(), m2 = m.clone(), v1 = v.clone(), v2 = v.clone();
    hierpar::ops::fused_adam_({p1}, {g}, {m1}, {v1}, {}, {s}, 0.0078125, 0.9, 0.999, 0.0, 1e-8, false);
    hierpar::ops::fused_adam_({p2}, {g}, {m2}, {v2}, {}, {s}, torch::full({}, 0.0078125), 0.9, 0.999, 0.0, 1e-8, false);
    EXPECT_TRUE(torch::equal(p1, p2));
    EXPECT_FALSE(torch::equal(p1, p));
  }
  // The Meta kernel checks the same.
  const auto meta = [](const torch::Tensor& t) { return t.to(torch::kMeta); };
  HIERPAR_EXPECT_THROW_MSG(call({meta(p)}, {meta(g)}, {meta(m)}, {meta(torch::zeros({3}))}, {}, {meta(s)}),
                           "exp_avg_sqs[0]: expected a dense");
  EXPECT_NO_THROW(call({meta(p)}, {meta(g)}, {meta(m)}, {meta(v)}, {}, {meta(s)}));
  HIERPAR_EXPECT_THROW_MSG(hierpar::ops::fused_adam_({meta(p)}, {meta(g)}, {meta(m)}, {meta(v)}, {}, {meta(s)},
                                                     torch::full({}, 1e-3), 0.9, 0.999, 0.0, 1e-8, false),
                           "lr: expected a one-element Float tensor on meta");
}

}  // namespace
