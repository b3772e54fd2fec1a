// Helpers shared by the batch_norm_act tests (test_batch_norm_act.cpp: CPU, Meta, errors and the layer;
// test_batch_norm_act_cuda.cpp: the CUDA kernels' paths): random cases, hierpar's forward + backward and the float64
// reference (ATen's batch_norm followed by the activation), compared with tolerances relative to the reference's
// largest magnitude.
//
// Tolerances (relative to the reference's largest magnitude, since the backward's terms cancel and
// elementwise relative error means nothing near zero): float64 1e-9; float32 1e-4 (float accumulation
// over up to ~1e5 elements and xhat recovered from the rounded output); bfloat16 3e-2 and float16 1e-2:
// the output is rounded to the dtype and the backward reads it back, a few units of 2^-8 / 2^-11.
#pragma once

#include "testing.h"

#include "hierpar/ops.h"

#include <cmath>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace batch_norm_act_testing {

using hierpar::testing::coin;
using hierpar::testing::Layout;
using hierpar::testing::rand_int;
using hierpar::testing::random_tensor;

inline double scaled_rtol(c10::ScalarType dtype) {
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
inline void expect_scaled(const torch::Tensor& actual, const torch::Tensor& expected, double rtol, const std::string& what,
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
inline Case make_case(std::vector<int64_t> shape, c10::ScalarType dtype, c10::ScalarType param_dtype, Layout layout,
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

inline constexpr double kSlopes[] = {0.2, 0.01, 0.25, 0.125, 0.3};

// A random activation for the case, and a slope (which only leaky_relu uses).
inline void random_activation(Case& c) {
  const char* acts[] = {"identity", "relu", "leaky_relu"};
  c.act = acts[rand_int(0, 2)];
  c.slope = kSlopes[rand_int(0, 4)];
}

inline Case random_case(const std::vector<c10::ScalarType>& dtypes, int64_t max_c = 12, int64_t max_hw = 9) {
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
inline Inputs random_inputs(const Case& c, const torch::Device& device) {
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
inline torch::Tensor same_layout_on(const torch::Tensor& t, const torch::Device& device) {
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

inline std::optional<torch::Tensor> opt(bool on, const torch::Tensor& t) {
  return on ? std::optional<torch::Tensor>(t) : std::nullopt;
}

inline Result run_hierpar(const Case& c, const Inputs& in) {
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

inline torch::Tensor activate(const torch::Tensor& y, const std::string& act, double slope) {
  if (act == "relu") return torch::relu(y);
  if (act == "leaky_relu") return torch::leaky_relu(y, slope);
  return y;
}

// ATen in float64 on the CPU. With `branch_from` (an output of the implementation under test), the
// activation's derivative takes the branch that output's sign says: an element whose pre-activation is
// within rounding of 0 may legitimately fall on either side of the kink in float32, and would otherwise
// show up as a spurious gradient difference of (1 - slope) * dy. check_branches() bounds where they differ.
inline Result run_reference(const Case& c, const Inputs& in, const torch::Tensor& branch_from = {}) {
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

inline void compare(const Result& got, const Result& want, const Case& c, double rtol, const std::string& where) {
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
inline void check_branches(const Result& got, const Result& ref, const Case& c, const std::string& where) {
  if (c.act == "identity") return;
  auto y = ref.out.detach();  // for the kink test, out and y share signs
  auto differ = (got.out.detach().to(torch::kCPU, torch::kDouble) > 0) != (y > 0);
  const double limit = 8 * scaled_rtol(c.dtype) * y.abs().max().item<double>();
  auto far = differ & (y.abs() > limit);
  EXPECT_FALSE(far.any().item<bool>()) << where << " " << c.describe() << ": " << far.sum().item<int64_t>()
                                       << " elements on the wrong side of the activation's kink";
}

inline void expect_layout_kept(const torch::Tensor& in, const torch::Tensor& out, const std::string& what) {
  if (in.dim() == 4 && in.is_contiguous(torch::MemoryFormat::ChannelsLast) && !in.is_contiguous()) {
    EXPECT_TRUE(out.is_contiguous(torch::MemoryFormat::ChannelsLast)) << what << ": output left channels_last";
  }
}

// hierpar's forward + backward on `in` against the float64 reference: values, activation branches and the layout
// kept. Both results, for further checks.
struct Checked {
  Result got, ref;
};

inline Checked check_against_reference(const Case& c, const Inputs& in, const std::string& where) {
  Result got = run_hierpar(c, in);
  Result ref = run_reference(c, in, got.out);
  compare(got, ref, c, scaled_rtol(c.dtype), where);
  check_branches(got, ref, c, where);
  expect_layout_kept(in.x, got.out, c.describe());
  return {got, ref};
}

}  // namespace batch_norm_act_testing
