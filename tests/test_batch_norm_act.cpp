// hierpar::batch_norm_act and its layers against ATen's batch_norm followed by the activation, evaluated in
// float64 as the reference, on random shapes drawn fresh each run.
//
// Tolerances (relative to the reference's largest magnitude, since the backward's terms cancel and
// elementwise relative error means nothing near zero): float64 1e-9; float32 1e-4 (float accumulation
// over up to ~1e5 elements and xhat recovered from the rounded output); bfloat16 3e-2 and float16 1e-2:
// the output is rounded to the dtype and the backward reads it back, a few units of 2^-8 / 2^-11.
#include "testing.h"

#include "hierpar/nn/batch_norm.h"
#include "hierpar/ops.h"
#include "hierpar/switches.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>

namespace {

using hierpar::testing::coin;
using hierpar::testing::Layout;
using hierpar::testing::rand_int;
using hierpar::testing::random_tensor;

double scaled_rtol(c10::ScalarType dtype) {
  switch (dtype) {
    case torch::kDouble: return 1e-9;
    case torch::kFloat: return 1e-4;
    case torch::kBFloat16: return 3e-2;
    case torch::kHalf: return 1e-2;
    default: return 0;
  }
}

// `floor`: a lower bound on the scale, for results that are sums of cancelling terms (the gradients): the
// rounding error is relative to the terms, not to what remains after cancellation.
void expect_scaled(const torch::Tensor& actual, const torch::Tensor& expected, double rtol, const std::string& what,
                   double floor = 0) {
  const double scale = std::max(
      floor, expected.detach().to(torch::kCPU, torch::kDouble).abs().nan_to_num(0, 0, 0).max().item<double>());
  hierpar::testing::expect_close(actual, expected, {rtol, rtol * std::max(scale, 1e-30)}, what);
}

struct Case {
  std::vector<int64_t> shape;
  c10::ScalarType dtype = torch::kFloat;
  c10::ScalarType param_dtype = torch::kFloat;
  Layout layout = Layout::contiguous;
  std::string act = "identity";
  double slope = 0.01;
  bool training = true, affine = true, running = true;
  double momentum = 0.1, eps = 1e-5;

  std::string describe() const {
    std::ostringstream os;
    os << "shape " << c10::IntArrayRef(shape) << " " << dtype << " params " << param_dtype << " "
       << hierpar::testing::to_string(layout) << " " << act << "(" << slope << ") training=" << training
       << " affine=" << affine << " running=" << running << " momentum=" << momentum << " eps=" << eps;
    return os.str();
  }
};

// A case of the given shape, dtypes, layout and activation; the rest at its defaults (training, affine, running).
Case make_case(std::vector<int64_t> shape, c10::ScalarType dtype, c10::ScalarType param_dtype, Layout layout,
               const std::string& act, double slope) {
  Case c;
  c.shape = std::move(shape);
  c.dtype = dtype;
  c.param_dtype = param_dtype;
  c.layout = layout;
  c.act = act;
  c.slope = slope;
  return c;
}

const double kSlopes[] = {0.2, 0.01, 0.25, 0.125, 0.3};

// A random activation for the case, and a slope (which only leaky_relu uses).
void random_activation(Case& c) {
  const char* acts[] = {"identity", "relu", "leaky_relu"};
  c.act = acts[rand_int(0, 2)];
  c.slope = kSlopes[rand_int(0, 4)];
}

Case random_case(const std::vector<c10::ScalarType>& dtypes, int64_t max_c = 12, int64_t max_hw = 9) {
  Case c;
  const int rank = rand_int(0, 5) == 0 ? static_cast<int>(rand_int(2, 3)) : 4;
  c.shape = {rand_int(1, 6), rand_int(0, 3) == 0 ? 1 : rand_int(1, max_c)};
  for (int d = 2; d < rank; ++d) c.shape.push_back(rand_int(1, max_hw));
  c.dtype = dtypes[rand_int(0, static_cast<int64_t>(dtypes.size()) - 1)];
  c.param_dtype = (c.dtype == torch::kBFloat16 || c.dtype == torch::kHalf) && coin() ? c.dtype
                  : c.dtype == torch::kDouble                                           ? torch::kDouble
                                                                                        : torch::kFloat;
  c.layout = static_cast<Layout>(rand_int(0, 2));
  if (rank != 4 && c.layout == Layout::channels_last) c.layout = Layout::contiguous;
  random_activation(c);
  c.training = rand_int(0, 3) != 0;
  c.affine = rand_int(0, 3) != 0;
  c.running = !c.training || coin();
  c.momentum = coin() ? 0.1 : 0.37;
  c.eps = coin() ? 1e-5 : 1e-3;
  int64_t per_channel = c.shape[0];
  for (size_t d = 2; d < c.shape.size(); ++d) per_channel *= c.shape[d];
  if (c.training && per_channel < 2) c.shape.size() > 2 ? c.shape.back() = 2 : c.shape[0] = 2;
  return c;
}

struct Inputs {
  torch::Tensor x, w, b, rm, rv, dy;
};

// Parameters: |gamma| in [0.5, 1.5] with either sign (the backward divides by gamma; see
// docs/batch_norm_act.md on precision as |beta/gamma| grows), beta in [-1, 1), running var in [0.5, 1.5).
Inputs random_inputs(const Case& c, const torch::Device& device) {
  auto opts = torch::TensorOptions().dtype(c.dtype).device(device);
  auto popts = torch::TensorOptions().dtype(c.param_dtype).device(device);
  const int64_t C = c.shape[1];
  Inputs in;
  in.x = random_tensor(c.shape, opts, c.layout).mul_(3).add_(0.5);
  in.dy = random_tensor(c.shape, opts, c.layout);
  auto u = random_tensor({C}, popts.dtype(torch::kDouble));
  in.w = (u.sign() * (u.abs() + 0.5)).to(popts);
  in.b = random_tensor({C}, popts);
  in.rm = random_tensor({C}, popts);
  in.rv = random_tensor({C}, popts).mul_(0.5).add_(1);
  return in;
}

// The same tensor on another device, keeping a channels_last or strided layout.
torch::Tensor same_layout_on(const torch::Tensor& t, const torch::Device& device) {
  if (t.is_non_overlapping_and_dense()) return t.to(device);
  std::vector<int64_t> wide(t.sizes().begin(), t.sizes().end());
  wide.back() *= 2;
  auto v = torch::empty(wide, t.options().device(device)).slice(-1, 0, wide.back(), 2);
  v.copy_(t);
  return v;
}

struct Result {
  torch::Tensor out, save_mean, save_invstd, rm, rv, dx, dw, db;
  // Reference only: the magnitude of the terms each gradient sums (see expect_scaled).
  double dx_terms = 0, dw_terms = 0, db_terms = 0;
};

std::optional<torch::Tensor> opt(bool on, const torch::Tensor& t) {
  return on ? std::optional<torch::Tensor>(t) : std::nullopt;
}

Result run_hierpar(const Case& c, const Inputs& in) {
  Result r;
  auto x = in.x.detach().requires_grad_();
  auto w = in.w.detach().clone().requires_grad_(), b = in.b.detach().clone().requires_grad_();
  r.rm = in.rm.clone();
  r.rv = in.rv.clone();
  std::tie(r.out, r.save_mean, r.save_invstd) =
      hierpar::ops::batch_norm_act(x, opt(c.affine, w), opt(c.affine, b), opt(c.running, r.rm), opt(c.running, r.rv),
                                   c.training, c.momentum, c.eps, c.act, c.slope);
  r.out.backward(in.dy);
  r.dx = x.grad();
  if (c.affine) {
    r.dw = w.grad();
    r.db = b.grad();
  }
  return r;
}

torch::Tensor activate(const torch::Tensor& y, const std::string& act, double slope) {
  if (act == "relu") return torch::relu(y);
  if (act == "leaky_relu") return torch::leaky_relu(y, slope);
  return y;
}

// ATen in float64 on the CPU. With `branch_from` (an output of the implementation under test), the
// activation's derivative takes the branch that output's sign says: an element whose pre-activation is
// within rounding of 0 may legitimately fall on either side of the kink in float32, and would otherwise
// show up as a spurious gradient difference of (1 - slope) * dy. check_branches() bounds where they differ.
Result run_reference(const Case& c, const Inputs& in, const torch::Tensor& branch_from = {}) {
  Result r;
  auto d = [](const torch::Tensor& t) { return t.detach().to(torch::kCPU, torch::kDouble).clone(); };
  auto x = d(in.x).requires_grad_(), w = d(in.w).requires_grad_(), b = d(in.b).requires_grad_();
  r.rm = d(in.rm);
  r.rv = d(in.rv);
  auto y = torch::batch_norm(x, c.affine ? w : torch::Tensor(), c.affine ? b : torch::Tensor(),
                             c.running ? r.rm : torch::Tensor(), c.running ? r.rv : torch::Tensor(), c.training,
                             c.momentum, c.eps, false);
  r.out = activate(y, c.act, c.slope);
  if (branch_from.defined() && c.act != "identity") {
    auto positive = branch_from.detach().to(torch::kCPU, torch::kDouble) > 0;
    auto dy_d = d(in.dy);
    auto dy_pre = torch::where(positive, dy_d, dy_d * (c.act == "relu" ? 0.0 : c.slope));
    y.backward(dy_pre);
  } else {
    r.out.backward(d(in.dy));
  }
  r.dx = x.grad();
  if (c.affine) {
    r.dw = w.grad();
    r.db = b.grad();
  }
  std::vector<int64_t> dims{0};
  for (int64_t i = 2; i < x.dim(); ++i) dims.push_back(i);
  {
    // |gamma * invstd * dy| bounds each term of grad_input; sum |dy| and sum |dy * xhat| those of the others.
    torch::NoGradGuard no_grad;
    std::vector<int64_t> bshape(x.dim(), 1);
    bshape[1] = -1;
    auto mean = c.training ? x.mean(dims, true) : r.rm.view(bshape);
    auto var = c.training ? x.var(dims, false, true) : r.rv.view(bshape);
    auto xhat = (x - mean) / (var + c.eps).sqrt();
    auto dy = d(in.dy).abs();
    const double gamma = c.affine ? w.abs().max().item<double>() : 1.0;
    r.dx_terms = 3 * gamma * (var + c.eps).rsqrt().max().item<double>() * dy.max().item<double>();
    r.db_terms = dy.sum(dims).max().item<double>();
    r.dw_terms = (dy * xhat.abs()).sum(dims).max().item<double>();
  }
  if (c.training) {
    r.save_mean = x.detach().mean(dims);
    r.save_invstd = (x.detach().var(dims, /*unbiased=*/false) + c.eps).rsqrt();
  } else {
    r.save_mean = d(in.rm);
    r.save_invstd = (d(in.rv) + c.eps).rsqrt();
  }
  return r;
}

void compare(const Result& got, const Result& want, const Case& c, double rtol, const std::string& where) {
  const std::string ctx = where + " " + c.describe();
  expect_scaled(got.out, want.out, rtol, "output, " + ctx);
  expect_scaled(got.save_mean, want.save_mean, std::min(rtol, 1e-4), "save_mean, " + ctx);
  expect_scaled(got.save_invstd, want.save_invstd, std::min(rtol, 1e-4), "save_invstd, " + ctx);
  if (c.running) {
    expect_scaled(got.rm, want.rm, std::max(scaled_rtol(c.param_dtype), std::min(rtol, 1e-4)), "running_mean, " + ctx);
    expect_scaled(got.rv, want.rv, std::max(scaled_rtol(c.param_dtype), std::min(rtol, 1e-4)), "running_var, " + ctx);
  }
  expect_scaled(got.dx, want.dx, rtol, "grad_input, " + ctx, want.dx_terms);
  if (c.affine) {
    expect_scaled(got.dw, want.dw, rtol, "grad_weight, " + ctx, want.dw_terms);
    expect_scaled(got.db, want.db, rtol, "grad_bias, " + ctx, want.db_terms);
  }
}

// Where the implementation's output sign disagrees with the float64 pre-activation's, |y| must be within
// rounding of 0 (relative to the batch's scale).
void check_branches(const Result& got, const Result& ref, const Case& c, const std::string& where) {
  if (c.act == "identity") return;
  auto y = ref.out.detach();  // for the kink test, out and y share signs
  auto differ = (got.out.detach().to(torch::kCPU, torch::kDouble) > 0) != (y > 0);
  const double limit = 8 * scaled_rtol(c.dtype) * y.abs().max().item<double>();
  auto far = differ & (y.abs() > limit);
  EXPECT_FALSE(far.any().item<bool>()) << where << " " << c.describe() << ": " << far.sum().item<int64_t>()
                                       << " elements on the wrong side of the activation's kink";
}

void expect_layout_kept(const torch::Tensor& in, const torch::Tensor& out, const std::string& what) {
  if (in.dim() == 4 && in.is_contiguous(torch::MemoryFormat::ChannelsLast) && !in.is_contiguous()) {
    EXPECT_TRUE(out.is_contiguous(torch::MemoryFormat::ChannelsLast)) << what << ": output left channels_last";
  }
}

// hierpar's forward + backward on `in` against the float64 reference: values, activation branches and the layout
// kept. Both results, for further checks.
struct Checked {
  Result got, ref;
};

Checked check_against_reference(const Case& c, const Inputs& in, const std::string& where) {
  Result got = run_hierpar(c, in);
  Result ref = run_reference(c, in, got.out);
  compare(got, ref, c, scaled_rtol(c.dtype), where);
  check_branches(got, ref, c, where);
  expect_layout_kept(in.x, got.out, c.describe());
  return {got, ref};
}

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
// with and without weight; identity and leaky_relu inside a DoubleBackwardScope (relu keeps its input anyway).
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
  auto [gx, gw, gb] = hierpar::ops::batch_norm_act_backward(out, out, x, w, w, sm, si, true, 1e-5, "relu", 0.01,
                                                            {true, true, true});
  EXPECT_EQ(gx.sizes(), x.sizes());
  EXPECT_TRUE(gx.is_contiguous(torch::MemoryFormat::ChannelsLast));
  EXPECT_EQ(gw.sizes(), torch::IntArrayRef({7}));
  EXPECT_EQ(gw.scalar_type(), torch::kFloat);
  EXPECT_EQ(gb.scalar_type(), torch::kFloat);
  auto [gx2, gw2, gb2] = hierpar::ops::batch_norm_act_backward(out, out, x, w, w, sm, si, true, 1e-5, "relu", 0.01,
                                                               {true, false, false});
  EXPECT_FALSE(gw2.defined());
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

// ---- CUDA ---------------------------------------------------------------------------------------------

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
