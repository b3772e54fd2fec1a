// hierpar::batch_norm_act on the CPU and Meta devices, its errors, and its layer (hierpar::nn::BatchNormAct2d)
// against ATen's batch_norm followed by the activation, evaluated in float64 as the reference, on random shapes
// drawn fresh each run (tolerances: batch_norm_act_testing.h). The CUDA kernels' tests are in
// test_batch_norm_act_cuda.cpp.
#include "batch_norm_act_testing.h"

#include "hierpar/nn/batch_norm.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>

namespace {

using namespace batch_norm_act_testing;

TEST(BatchNormActCpu, MatchesAtenOnRandomShapes) {
  for (int trial = 0; trial < 40; ++trial) {
    Case c = random_case({torch::kDouble, torch::kFloat, torch::kBFloat16, torch::kHalf});
    Inputs in = random_inputs(c, torch::kCPU);
    const Result got = check_against_reference(c, in, "cpu").got;
    EXPECT_EQ(got.save_mean.scalar_type(), c.dtype == torch::kDouble ? torch::kDouble : torch::kFloat);
    if (c.affine) EXPECT_EQ(got.dw.scalar_type(), c.param_dtype);
  }
}

// Batch 1 with H*W > 1, one channel, and each activation in each layout, always drawn.
TEST(BatchNormActCpu, EdgeShapesEveryActivationAndLayout) {
  for (const char* act : {"identity", "relu", "leaky_relu"}) {
    for (int l = 0; l < 3; ++l) {
      for (auto shape : {std::vector<int64_t>{1, rand_int(2, 7), rand_int(2, 5), rand_int(1, 5)},
                         std::vector<int64_t>{rand_int(2, 4), 1, rand_int(1, 5), rand_int(2, 5)}}) {
        const Case c = make_case(shape, torch::kDouble, torch::kDouble,
                                 static_cast<Layout>(l), act, kSlopes[rand_int(0, 4)]);
        Inputs in = random_inputs(c, torch::kCPU);
        compare(run_hierpar(c, in), run_reference(c, in), c, 1e-9, "cpu edge");
      }
    }
  }
}

// Finite differences in float64 of L = sum(out * R) against the analytic backward (the op's own), for
// every activation, training and eval, with and without the affine parameters.
TEST(BatchNormActCpu, GradcheckFiniteDifferences) {
  for (const char* act : {"identity", "relu", "leaky_relu"}) {
    for (bool training : {true, false}) {
      auto o = torch::TensorOptions().dtype(torch::kDouble);
      const int64_t C = rand_int(1, 3);
      auto x = random_tensor({rand_int(1, 3), C, rand_int(2, 3), rand_int(1, 3)}, o).mul_(2).requires_grad_();
      auto w = (random_tensor({C}, o).sign() * 0.8 + random_tensor({C}, o) * 0.2).requires_grad_();
      auto b = random_tensor({C}, o).requires_grad_();
      auto rm = random_tensor({C}, o), rv = random_tensor({C}, o).mul_(0.5).add_(1);
      auto R = random_tensor(x.sizes(), o);
      const double slope = 0.2;
      auto loss = [&](const torch::Tensor& xx, const torch::Tensor& ww, const torch::Tensor& bb) {
        auto rm_copy = rm.clone(), rv_copy = rv.clone();
        auto out = std::get<0>(hierpar::ops::batch_norm_act(xx, ww, bb, rm_copy, rv_copy, training, 0.1, 1e-5, act, slope));
        return (out * R).sum();
      };
      loss(x, w, b).backward();
      torch::NoGradGuard no_grad;
      const double h = 1e-6;
      for (auto* p : {&x, &w, &b}) {
        auto flat = p->view({-1});
        auto fd = torch::empty_like(flat);
        for (int64_t i = 0; i < flat.numel(); ++i) {
          const double v = flat[i].item<double>();
          flat[i] = v + h;
          const double up = loss(x, w, b).item<double>();
          flat[i] = v - h;
          const double down = loss(x, w, b).item<double>();
          flat[i] = v;
          fd[i] = (up - down) / (2 * h);
        }
        hierpar::testing::expect_close(p->grad().view({-1}), fd, {1e-5, 1e-6},
                                       std::string("finite differences, ") + act + (training ? " training" : " eval"));
      }
    }
  }
}

// The backward recovers y = out / slope on the negative side: at most one ulp away from the forward's y,
// and exact for power-of-two slopes (multiplying and dividing by 2^k is exact above the subnormals).
TEST(BatchNormActCpu, LeakyInversionWithinOneUlpAndExactForPowersOfTwo) {
  auto y = (random_tensor({100000}, torch::kFloat) - 1.0f).mul_(8);  // negative, several binades
  for (double slope : {0.2, 0.01, 0.3, 0.25, 0.125, 0.5}) {
    const float s = static_cast<float>(slope);
    auto out = y * s;  // the forward's rounding
    auto back = out / s;
    auto ulp = (torch::nextafter(y.abs(), torch::full_like(y, INFINITY)) - y.abs());
    EXPECT_TRUE(((back - y).abs() <= ulp).all().item<bool>()) << "slope " << slope;
    if (slope == 0.25 || slope == 0.125 || slope == 0.5) EXPECT_TRUE(back.equal(y)) << "slope " << slope;
  }
}

// gamma == 0: the output is constant per channel, so xhat is not recoverable from it. grad_input and
// grad_bias stay exact; grad_weight of that channel is NaN (documented) unless the input is given.
TEST(BatchNormActCpu, ZeroGammaGivesExactInputGradAndNanWeightGrad) {
  Case c;
  c.shape = {3, 4, 3, 2};
  c.dtype = c.param_dtype = torch::kDouble;
  c.act = "leaky_relu";
  c.slope = 0.2;
  Inputs in = random_inputs(c, torch::kCPU);
  in.w[1] = 0.0;
  Result got = run_hierpar(c, in), want = run_reference(c, in);
  expect_scaled(got.dx, want.dx, 1e-9, "grad_input with gamma[1] == 0");
  expect_scaled(got.db, want.db, 1e-9, "grad_bias with gamma[1] == 0");
  EXPECT_TRUE(std::isnan(got.dw[1].item<double>()));
  auto others = torch::tensor({0, 2, 3});
  expect_scaled(got.dw.index_select(0, others), want.dw.index_select(0, others), 1e-9, "grad_weight elsewhere");
  // With the input (what relu uses), grad_weight is recovered too.
  auto [gx, gw, gb] = hierpar::ops::batch_norm_act_backward(in.dy, got.out.detach(), in.x, in.w, in.b, got.save_mean,
                                                            got.save_invstd, true, c.eps, c.act, c.slope,
                                                            {true, true, true});
  expect_scaled(gw, want.dw, 1e-9, "grad_weight from the input with gamma[1] == 0");
}

TEST(BatchNormActCpu, DoubleBackwardIsAClearError) {
  auto x = random_tensor({2, 3, 2, 2}, torch::kDouble).requires_grad_();
  auto w = torch::ones({3}, torch::kDouble).requires_grad_();
  auto out = std::get<0>(hierpar::ops::batch_norm_act(x, w, std::nullopt, std::nullopt, std::nullopt, true, 0.1,
                                                      1e-5, "leaky_relu", 0.2));
  HIERPAR_EXPECT_THROW_MSG(torch::autograd::grad({out}, {x}, {torch::ones_like(out)}, true, true),
                           "a second derivative (create_graph) needs the layer's input, which leaky_relu does not keep: "
                           "run the forward inside a hierpar::ops::DoubleBackwardScope");
}

// Second derivatives (what an R1 or WGAN-GP penalty takes): the gradient of a function of the input gradient,
// against the stock composition (ATen's batch_norm and activation) in double, every activation, training and eval,
// with and without weight; leaky_relu inside a DoubleBackwardScope (identity and relu keep their input anyway).
TEST(BatchNormActCpu, SecondDerivativesMatchAten) {
  for (const char* activation : {"identity", "relu", "leaky_relu"}) {
    for (const bool training : {true, false}) {
      for (const bool affine : {true, false}) {
        const std::string what = std::string(activation) + (training ? ", training" : ", eval") +
                                 (affine ? "" : ", no weight");
        const int64_t c = hierpar::testing::rand_int(1, 4);
        const auto x0 = random_tensor({hierpar::testing::rand_int(2, 4), c, 3, 5}, torch::kDouble);
        const auto w0 = random_tensor({c}, torch::kDouble) + 1.5, b0 = random_tensor({c}, torch::kDouble);
        const auto rm = random_tensor({c}, torch::kDouble), rv = random_tensor({c}, torch::kDouble).abs() + 0.5;
        auto penalty = [&](bool ours) {
          auto x = x0.clone().requires_grad_();
          auto w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
          auto rm_copy = rm.clone(), rv_copy = rv.clone();
          torch::Tensor y;
          if (ours) {
            hierpar::ops::DoubleBackwardScope keep_inputs;
            y = std::get<0>(hierpar::ops::batch_norm_act(x, affine ? std::optional<at::Tensor>(w) : std::nullopt,
                                                         affine ? std::optional<at::Tensor>(b) : std::nullopt, rm_copy,
                                                         rv_copy, training, 0.1, 1e-5, activation, 0.2));
          } else {
            y = torch::batch_norm(x, affine ? w : torch::Tensor(), affine ? b : torch::Tensor(), rm_copy, rv_copy,
                                  training, 0.1, 1e-5, false);
            if (std::string(activation) == "relu") y = torch::relu(y);
            if (std::string(activation) == "leaky_relu") y = torch::leaky_relu(y, 0.2);
          }
          // An R1-like penalty: the squared norm of d(sum y^2 sin)/dx, then its gradient.
          const auto g = torch::autograd::grad({(y.square() * y.sin()).sum()}, {x}, {}, true, true)[0];
          const auto p = g.square().sum();
          std::vector<torch::Tensor> wrt{x};
          if (affine) {
            wrt.push_back(w);
            wrt.push_back(b);
          }
          auto grads = torch::autograd::grad({p}, wrt, {}, false, false, /*allow_unused=*/true);
          for (size_t i = 0; i < grads.size(); ++i) {
            if (!grads[i].defined()) grads[i] = torch::zeros_like(wrt[i]);  // unused: a zero gradient either way
          }
          return grads;
        };
        const auto ours = penalty(true), theirs = penalty(false);
        for (size_t i = 0; i < ours.size(); ++i) {
          hierpar::testing::expect_close(ours[i], theirs[i], {1e-9, 1e-11}, what + ": gradient " + std::to_string(i));
        }
      }
    }
  }
}

// The same on a GPU: hierpar's CUDA op in float32 (its kernels for the first derivatives) against the stock
// composition in float64 on the same device, within float32's rounding relative to each gradient's largest value.
TEST(BatchNormActCuda, SecondDerivativesMatchAten) {
  HIERPAR_REQUIRE_CUDA();
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  for (const char* activation : {"identity", "relu", "leaky_relu"}) {
    for (const bool training : {true, false}) {
      const std::string what = std::string(activation) + (training ? ", training" : ", eval");
      const int64_t c = hierpar::testing::rand_int(1, 5);
      const auto x0 = random_tensor({hierpar::testing::rand_int(2, 5), c, 7, 5}, cuda.dtype(torch::kDouble));
      const auto w0 = random_tensor({c}, cuda.dtype(torch::kDouble)) + 1.5;
      const auto b0 = random_tensor({c}, cuda.dtype(torch::kDouble));
      const auto rm = random_tensor({c}, cuda.dtype(torch::kDouble));
      const auto rv = random_tensor({c}, cuda.dtype(torch::kDouble)).abs() + 0.5;
      auto penalty = [&](bool ours) {
        const auto dtype = ours ? torch::kFloat : torch::kDouble;
        auto x = x0.to(dtype).requires_grad_();
        auto w = w0.to(dtype).requires_grad_(), b = b0.to(dtype).requires_grad_();
        auto rm_copy = rm.to(dtype), rv_copy = rv.to(dtype);
        torch::Tensor y;
        if (ours) {
          hierpar::ops::DoubleBackwardScope keep_inputs;
          y = std::get<0>(hierpar::ops::batch_norm_act(x, w, b, rm_copy, rv_copy, training, 0.1, 1e-5, activation, 0.2));
        } else {
          y = torch::batch_norm(x, w, b, rm_copy, rv_copy, training, 0.1, 1e-5, false);
          if (std::string(activation) == "relu") y = torch::relu(y);
          if (std::string(activation) == "leaky_relu") y = torch::leaky_relu(y, 0.2);
        }
        const auto g = torch::autograd::grad({(y.square() * y.sin()).sum()}, {x}, {}, true, true)[0];
        auto grads = torch::autograd::grad({g.square().sum()}, {x, w, b}, {}, false, false, /*allow_unused=*/true);
        for (size_t i = 0; i < grads.size(); ++i) {
          grads[i] = grads[i].defined() ? grads[i].to(torch::kDouble) : torch::zeros_like(i == 0 ? x0 : w0);  // unused
        }
        return grads;
      };
      const auto ours = penalty(true), theirs = penalty(false);
      for (size_t i = 0; i < ours.size(); ++i) {
        const double scale = theirs[i].abs().max().item<double>();
        hierpar::testing::expect_close(ours[i], theirs[i], {1e-3, 1e-4 * scale + 1e-12},
                                       what + ": gradient " + std::to_string(i));
      }
    }
  }
}

// Without gradients (no_grad, or nothing requiring grad) the autograd kernel skips its Function: same
// values, no grad_fn, running statistics updated and their versions bumped.
TEST(BatchNormActCpu, NoGradForwardSkipsTheFunction) {
  auto x = random_tensor({4, 3, 5, 5}, torch::TensorOptions().dtype(torch::kFloat));
  auto w = random_tensor({3}, x.options()), b = random_tensor({3}, x.options());
  auto rm1 = torch::zeros({3}), rv1 = torch::ones({3}), rm2 = rm1.clone(), rv2 = rv1.clone();
  auto xg = x.detach().requires_grad_();
  auto with_grad = std::get<0>(hierpar::ops::batch_norm_act(xg, w, b, rm1, rv1, true, 0.1, 1e-5, "leaky_relu", 0.2));
  EXPECT_TRUE(with_grad.requires_grad());
  const auto version = rm2._version();
  torch::Tensor without;
  {
    torch::NoGradGuard no_grad;
    without = std::get<0>(hierpar::ops::batch_norm_act(xg, w, b, rm2, rv2, true, 0.1, 1e-5, "leaky_relu", 0.2));
  }
  EXPECT_FALSE(without.requires_grad());
  EXPECT_FALSE(without.grad_fn());
  EXPECT_TRUE(torch::equal(with_grad.detach(), without));
  EXPECT_TRUE(torch::equal(rm1, rm2));
  EXPECT_TRUE(torch::equal(rv1, rv2));
  EXPECT_GT(rm2._version(), version);
  auto frozen = std::get<0>(hierpar::ops::batch_norm_act(x, w, b, std::nullopt, std::nullopt, true, 0.1, 1e-5, "relu", 0.01));
  EXPECT_FALSE(frozen.requires_grad());
}

// num_batches_tracked, when given, counts the training calls (through autograd and without it), not eval ones.
TEST(BatchNormActCpu, NumBatchesTrackedCountsTrainingCalls) {
  auto x = random_tensor({3, 5, 2, 3}, torch::kFloat).requires_grad_();
  auto rm = torch::zeros({5}), rv = torch::ones({5});
  auto counter = torch::full({}, 7, torch::kLong);
  const auto version = counter._version();
  auto call = [&](bool training) {
    hierpar::ops::batch_norm_act(x, std::nullopt, std::nullopt, rm, rv, training, 0.1, 1e-5, "relu", 0.01, counter);
  };
  call(true);
  call(true);
  {
    torch::NoGradGuard no_grad;
    call(true);
  }
  call(false);
  EXPECT_EQ(counter.item<int64_t>(), 10);
  EXPECT_EQ(counter._version(), version + 3) << "each training call bumps the counter's version (in-place update)";
}

TEST(BatchNormActMeta, ShapesDtypesAndLayout) {
  auto opts = torch::TensorOptions().device(torch::kMeta);
  auto x = torch::empty({5, 7, 3, 4}, opts.dtype(torch::kBFloat16)).contiguous(torch::MemoryFormat::ChannelsLast);
  auto w = torch::empty({7}, opts.dtype(torch::kFloat));
  auto [out, sm, si] = hierpar::ops::batch_norm_act(x, w, w, std::nullopt, std::nullopt, true, 0.1, 1e-5, "relu");
  EXPECT_EQ(out.sizes(), x.sizes());
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(out.is_contiguous(torch::MemoryFormat::ChannelsLast));
  EXPECT_EQ(sm.sizes(), torch::IntArrayRef({7}));
  EXPECT_EQ(sm.scalar_type(), torch::kFloat);
  EXPECT_EQ(si.scalar_type(), torch::kFloat);
  auto backward = [&](std::array<bool, 3> mask) {
    return hierpar::ops::batch_norm_act_backward(out, out, x, w, w, sm, si, true, 1e-5, "relu", 0.01, mask);
  };
  auto [gx, gw, gb] = backward({true, true, true});
  EXPECT_EQ(gx.sizes(), x.sizes());
  EXPECT_TRUE(gx.is_contiguous(torch::MemoryFormat::ChannelsLast));
  EXPECT_EQ(gw.sizes(), torch::IntArrayRef({7}));
  EXPECT_EQ(gw.scalar_type(), torch::kFloat);
  EXPECT_EQ(gb.scalar_type(), torch::kFloat);
  EXPECT_FALSE(std::get<1>(backward({true, false, false})).defined());
  // The Meta kernel checks like the others.
  HIERPAR_EXPECT_THROW_MSG(hierpar::ops::batch_norm_act(x, torch::empty({6}, opts.dtype(torch::kFloat)), std::nullopt,
                                                        std::nullopt, std::nullopt, true, 0.1, 1e-5),
                           "weight: expected 7 elements (input channels), got 6");
}

// Every argument check, with its message (on the CPU; CUDA and Meta share the code).
TEST(BatchNormActErrors, EachBadInputNamesTheArgument) {
  auto f = torch::kFloat;
  auto x = random_tensor({4, 64, 3, 3}, f);
  auto p = [&](int64_t n, c10::ScalarType t = torch::kFloat) { return torch::ones({n}, t); };
  auto fwd = [&](const torch::Tensor& in, std::optional<torch::Tensor> w, std::optional<torch::Tensor> rm,
                 std::optional<torch::Tensor> rv, bool training = true, std::string act = "identity",
                 double slope = 0.01, double momentum = 0.1) {
    return hierpar::ops::batch_norm_act(in, w, std::nullopt, rm, rv, training, momentum, 1e-5, act, slope);
  };
  HIERPAR_EXPECT_THROW_MSG(fwd(random_tensor({2, 3, 4, 5, 6}, f), std::nullopt, std::nullopt, std::nullopt),
                           "input: expected a 2-d (N, C), 3-d (N, C, L) or 4-d (N, C, H, W) tensor, got 5-d");
  HIERPAR_EXPECT_THROW_MSG(fwd(x.to(torch::kInt), std::nullopt, std::nullopt, std::nullopt),
                           "input: expected float32, float64, bfloat16 or float16");
  HIERPAR_EXPECT_THROW_MSG(fwd(x, p(63), std::nullopt, std::nullopt), "weight: expected 64 elements (input channels), got 63");
  HIERPAR_EXPECT_THROW_MSG(fwd(x, std::nullopt, p(32), p(64)),
                           "running_mean: expected 64 elements (input channels), got 32");
  HIERPAR_EXPECT_THROW_MSG(fwd(x, std::nullopt, p(64), p(32)),
                           "running_var: expected 64 elements (input channels), got 32");
  HIERPAR_EXPECT_THROW_MSG(fwd(x, p(64, torch::kDouble), std::nullopt, std::nullopt),
                           "weight: expected dtype Float (from the input), got Double");
  HIERPAR_EXPECT_THROW_MSG(fwd(x.to(torch::kBFloat16), p(64, torch::kHalf), std::nullopt, std::nullopt),
                           "weight: expected dtype BFloat16 or float32 (from the input), got Half");
  HIERPAR_EXPECT_THROW_MSG(fwd(x, std::nullopt, p(64), std::nullopt),
                           "running_mean and running_var: expected both or neither");
  HIERPAR_EXPECT_THROW_MSG(fwd(x, std::nullopt, std::nullopt, std::nullopt, false),
                           "running_mean: expected running statistics in eval mode");
  HIERPAR_EXPECT_THROW_MSG(fwd(random_tensor({0, 64, 3, 3}, f), std::nullopt, std::nullopt, std::nullopt),
                           "input: expected a non-empty batch in training mode");
  HIERPAR_EXPECT_THROW_MSG(fwd(random_tensor({1, 64, 1, 1}, f), std::nullopt, std::nullopt, std::nullopt),
                           "input: expected more than 1 value per channel when training");
  HIERPAR_EXPECT_THROW_MSG(fwd(x, std::nullopt, std::nullopt, std::nullopt, true, "gelu"),
                           "activation: expected \"identity\", \"relu\" or \"leaky_relu\", got \"gelu\"");
  HIERPAR_EXPECT_THROW_MSG(fwd(x, std::nullopt, std::nullopt, std::nullopt, true, "leaky_relu", -0.1),
                           "slope: expected a positive, finite negative slope for leaky_relu");
  HIERPAR_EXPECT_THROW_MSG(fwd(x, std::nullopt, std::nullopt, std::nullopt, true, "leaky_relu", 0.0),
                           "slope: expected a positive, finite negative slope for leaky_relu");
  HIERPAR_EXPECT_THROW_MSG(fwd(x, std::nullopt, p(64), p(64), true, "identity", 0.01, 1.5),
                           "momentum: expected a number in [0, 1], got 1.5");
  HIERPAR_EXPECT_THROW_MSG(hierpar::ops::batch_norm_act(x, std::nullopt, std::nullopt, std::nullopt, std::nullopt,
                                                        true, 0.1, -1.0),
                           "eps: expected a non-negative finite number, got -1");
  auto counted = [&](const torch::Tensor& counter) {
    return hierpar::ops::batch_norm_act(x, std::nullopt, std::nullopt, p(64), p(64), true, 0.1, 1e-5, "identity",
                                        0.01, counter);
  };
  HIERPAR_EXPECT_THROW_MSG(counted(torch::zeros({}, torch::kInt)),
                           "num_batches_tracked: expected one int64 element on cpu (the input's device), got Int");
  HIERPAR_EXPECT_THROW_MSG(counted(torch::zeros({2}, torch::kLong)),
                           "num_batches_tracked: expected one int64 element on cpu (the input's device), got Long of "
                           "shape [2]");

  auto [out, sm, si] = fwd(x, std::nullopt, std::nullopt, std::nullopt, true, "relu");
  auto bwd = [&](const torch::Tensor& dy, std::optional<torch::Tensor> in, const torch::Tensor& mean,
                 std::string act = "relu") {
    return hierpar::ops::batch_norm_act_backward(dy, out, in, std::nullopt, std::nullopt, mean, si, true, 1e-5, act,
                                                 0.01, {true, true, true});
  };
  HIERPAR_EXPECT_THROW_MSG(bwd(out, std::nullopt, sm), "input: required for activation \"relu\"");
  HIERPAR_EXPECT_THROW_MSG(bwd(out.narrow(0, 0, 2), x, sm), "grad_output: expected the output's shape");
  HIERPAR_EXPECT_THROW_MSG(bwd(out.to(torch::kDouble), x, sm), "grad_output: expected Float on cpu (like output)");
  HIERPAR_EXPECT_THROW_MSG(bwd(out, x.narrow(1, 0, 3), sm), "input: expected Float [4, 64, 3, 3] on cpu (like output)");
  HIERPAR_EXPECT_THROW_MSG(bwd(out, x, sm.to(torch::kDouble)), "save_mean: expected Float [64]");
  HIERPAR_EXPECT_THROW_MSG(bwd(out, x, sm, "tanh"), "activation: expected \"identity\", \"relu\" or \"leaky_relu\"");
}

// ---- layers ---------------------------------------------------------------------------------------------

torch::Tensor stock_forward(torch::nn::BatchNorm2d& bn, const torch::Tensor& x, hierpar::nn::Activation act, double slope) {
  auto y = bn->forward(x);
  if (act == hierpar::nn::Activation::relu) return torch::relu(y);
  if (act == hierpar::nn::Activation::leaky_relu) return torch::leaky_relu(y, slope);
  return y;
}

void expect_same_state(const torch::nn::Module& a, const torch::nn::Module& b, double rtol, const std::string& what) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  auto ba = a.named_buffers(), bb = b.named_buffers();
  ASSERT_EQ(pa.keys(), pb.keys()) << what;
  ASSERT_EQ(ba.keys(), bb.keys()) << what;
  for (const auto& k : pa.keys()) expect_scaled(pa[k], pb[k], rtol, what + " parameter " + k);
  for (const auto& k : ba.keys()) {
    if (ba[k].scalar_type() == torch::kLong) {
      EXPECT_TRUE(ba[k].equal(bb[k])) << what << " buffer " << k << ": " << ba[k] << " vs " << bb[k];
    } else {
      expect_scaled(ba[k], bb[k], rtol, what + " buffer " + k);
    }
  }
}

// Several training steps then eval, against torch::nn::BatchNorm2d + the activation, for momentum 0.1 and
// None (cumulative average), affine on/off and track_running_stats on/off: outputs, gradients and state.
TEST(BatchNormActLayer, MatchesStockBatchNormOverSeveralStepsAndEval) {
  using hierpar::nn::Activation;
  for (std::optional<double> momentum : {std::optional<double>(0.1), std::optional<double>()}) {
    for (auto [affine, track] : {std::pair{true, true}, std::pair{false, true}, std::pair{true, false}}) {
      const int64_t C = rand_int(1, 9);
      auto options = torch::nn::BatchNorm2dOptions(C).momentum(momentum).affine(affine).track_running_stats(track);
      const Activation act = static_cast<Activation>(rand_int(0, 2));
      const double slope = kSlopes[rand_int(0, 4)];
      const std::string what = "C=" + std::to_string(C) + " act=" + hierpar::nn::to_string(act) +
                               " momentum=" + (momentum ? std::to_string(*momentum) : "None") +
                               " affine=" + std::to_string(affine) + " track=" + std::to_string(track);
      torch::nn::BatchNorm2d stock(options);
      hierpar::nn::BatchNormAct2d ours(options, act, slope);
      stock->to(torch::kDouble);
      ours->to(torch::kDouble);
      torch::optim::SGD opt_stock(stock->parameters(), 0.1), opt_ours(ours->parameters(), 0.1);
      for (int step = 0; step < 4; ++step) {
        auto x = random_tensor({rand_int(1, 5), C, rand_int(2, 6), rand_int(1, 6)}, torch::kDouble).mul_(2).add_(0.3);
        auto dy = random_tensor(x.sizes(), torch::kDouble);
        auto xs = x.clone().requires_grad_(), xo = x.clone().requires_grad_();
        auto ys = stock_forward(stock, xs, act, slope), yo = ours->forward(xo);
        expect_scaled(yo, ys, 1e-9, what + " output step " + std::to_string(step));
        ys.backward(dy);
        yo.backward(dy);
        expect_scaled(xo.grad(), xs.grad(), 1e-9, what + " grad_input step " + std::to_string(step));
        opt_stock.step();
        opt_ours.step();
        opt_stock.zero_grad();
        opt_ours.zero_grad();
        expect_same_state(*ours, *stock, 1e-9, what + " after step " + std::to_string(step));
      }
      stock->eval();
      ours->eval();
      auto x = random_tensor({2, C, 3, 3}, torch::kDouble);
      expect_scaled(ours->forward(x), stock_forward(stock, x, act, slope), 1e-9, what + " eval output");
    }
  }
}

TEST(BatchNormActLayer, StateDictsInterchangeWithStockBatchNorm2d) {
  const int64_t C = rand_int(2, 9);
  torch::nn::BatchNorm2d stock{torch::nn::BatchNorm2dOptions(C)};
  for (int i = 0; i < 2; ++i) stock->forward(random_tensor({3, C, 4, 4}, torch::kFloat));  // running stats move
  {
    torch::NoGradGuard ng;
    stock->weight.copy_(random_tensor({C}, torch::kFloat));
    stock->bias.copy_(random_tensor({C}, torch::kFloat));
  }
  std::stringstream stock_file;
  torch::save(stock, stock_file);
  hierpar::nn::BatchNormAct2d ours(C, hierpar::nn::Activation::leaky_relu, 0.2);
  torch::load(ours, stock_file);
  expect_same_state(*ours, *stock, 0, "stock -> hierpar");

  hierpar::nn::BatchNorm2d plain(C);
  stock_file.seekg(0);
  torch::load(plain, stock_file);
  expect_same_state(*plain, *stock, 0, "stock -> hierpar BatchNorm2d");

  for (int i = 0; i < 3; ++i) ours->forward(random_tensor({2, C, 3, 5}, torch::kFloat));
  std::stringstream ours_file;
  torch::save(ours, ours_file);
  torch::nn::BatchNorm2d back{torch::nn::BatchNorm2dOptions(C)};
  torch::load(back, ours_file);
  expect_same_state(*back, *ours, 0, "hierpar -> stock");
  EXPECT_EQ(back->num_batches_tracked.item<int64_t>(), 5);
}

TEST(BatchNormActLayer, PrettyPrintAndClone) {
  hierpar::nn::BatchNormAct2d act(torch::nn::BatchNorm2dOptions(64), hierpar::nn::Activation::leaky_relu, 0.2);
  std::ostringstream os;
  os << *act;
  EXPECT_EQ(os.str(),
            "hierpar::nn::BatchNormAct2d(64, eps=1e-05, momentum=0.1, affine=true, track_running_stats=true, "
            "activation=leaky_relu(0.2))");
  hierpar::nn::BatchNorm2d bn(torch::nn::BatchNorm2dOptions(8).momentum(std::nullopt));
  std::ostringstream os2;
  os2 << *bn;
  EXPECT_EQ(os2.str(), "hierpar::nn::BatchNorm2d(8, eps=1e-05, momentum=None, affine=true, track_running_stats=true)");
  auto copy = std::dynamic_pointer_cast<hierpar::nn::BatchNorm2dImpl>(bn->clone());
  ASSERT_TRUE(copy) << "clone() of BatchNorm2d must be a BatchNorm2dImpl";
  EXPECT_NE(copy->weight.data_ptr(), bn->weight.data_ptr());
  HIERPAR_EXPECT_THROW_MSG(act->forward(random_tensor({2, 64, 3}, torch::kFloat)),
                           "hierpar::nn::BatchNormAct2d: input: expected a 4-d tensor (N, C, H, W), got 3-d");
}

}  // namespace
