// Helpers shared by the convolution operators' tests (test_conv_transpose.cpp, test_conv2d.cpp): each compares a
// forward + backward against ATen in float64 with a tolerance per dtype (the reasons are at the top of
// test_conv_transpose.cpp) whose absolute part scales with the reference's largest magnitude, since every output
// and gradient is a sum of many products and cancellation makes elementwise-relative error meaningless near 0.
#pragma once

#include "testing.h"

#include <ATen/cuda/CUDAGraph.h>
#include <torch/autograd.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <array>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace hierpar::testing {

inline Tolerance scaled(double rel, const torch::Tensor& reference) {
  const double scale = reference.defined() && reference.numel() > 0 ? reference.abs().max().item<double>() : 1.0;
  return {rel, rel * std::max(scale, 1e-30)};
}

inline double conv_rel_tolerance(c10::ScalarType dtype, bool cuda) {
  switch (dtype) {
    case torch::kDouble: return 1e-10;
    case torch::kFloat: return cuda ? 2e-3 : 1e-5;
    case torch::kBFloat16: return 1e-2;
    case torch::kHalf: return 2e-3;
    default: return 0;
  }
}

// Sets whether fp32 convolutions may use TF32 (at::globalContext().allowTF32CuDNN, which hierpar's CUDA kernels follow
// as stock's convolutions do) for the guard's lifetime, restoring the previous setting after, failures included.
class Tf32ForConvolutions {
 public:
  explicit Tf32ForConvolutions(bool allow) : before_(at::globalContext().allowTF32CuDNN()) {
    at::globalContext().setAllowTF32CuDNN(allow);
  }
  ~Tf32ForConvolutions() { at::globalContext().setAllowTF32CuDNN(before_); }
  Tf32ForConvolutions(const Tf32ForConvolutions&) = delete;
  Tf32ForConvolutions& operator=(const Tf32ForConvolutions&) = delete;

 private:
  bool before_;
};

// A forward + backward's results; grad_bias is undefined without a bias.
struct ConvResults {
  torch::Tensor output, grad_input, grad_weight, grad_bias;
};

inline std::optional<torch::Tensor> opt(const torch::Tensor& t) {
  return t.defined() ? std::optional<torch::Tensor>(t) : std::nullopt;
}

inline void compare(const ConvResults& got, const ConvResults& ref, double rel, const std::string& what) {
  expect_close(got.output, ref.output, scaled(rel, ref.output), what + " output");
  expect_close(got.grad_input, ref.grad_input, scaled(rel, ref.grad_input), what + " grad_input");
  expect_close(got.grad_weight, ref.grad_weight, scaled(rel, ref.grad_weight), what + " grad_weight");
  if (ref.grad_bias.defined()) expect_close(got.grad_bias, ref.grad_bias, scaled(rel, ref.grad_bias), what + " grad_bias");
}

// Central finite differences (step 1e-6, in float64) of `loss`, a scalar function of (input, weight, bias), at 6
// random elements of each defined tensor, against the analytic gradients in `got`.
using ConvLoss = std::function<double(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;
inline void expect_finite_difference_gradients(const ConvLoss& loss, const torch::Tensor& input,
                                               const torch::Tensor& weight, const torch::Tensor& bias,
                                               const ConvResults& got, const std::string& what) {
  const double eps = 1e-6;
  struct Wrt {
    const char* name;
    torch::Tensor value, grad;
    int index;
  };
  for (const Wrt& wrt : {Wrt{"input", input, got.grad_input, 0}, Wrt{"weight", weight, got.grad_weight, 1},
                         Wrt{"bias", bias, got.grad_bias, 2}}) {
    if (!wrt.value.defined()) continue;
    for (int probe = 0; probe < 6; ++probe) {
      const int64_t i = rand_int(0, wrt.value.numel() - 1);
      torch::Tensor plus = wrt.value.contiguous().clone(), minus = wrt.value.contiguous().clone();
      plus.view(-1)[i] += eps;
      minus.view(-1)[i] -= eps;
      auto args = [&](const torch::Tensor& v) {
        return std::array<torch::Tensor, 3>{wrt.index == 0 ? v : input, wrt.index == 1 ? v : weight,
                                            wrt.index == 2 ? v : bias};
      };
      const auto ap = args(plus), am = args(minus);
      const double numeric = (loss(ap[0], ap[1], ap[2]) - loss(am[0], am[1], am[2])) / (2 * eps);
      const double analytic = wrt.grad.contiguous().view(-1)[i].item<double>();
      EXPECT_NEAR(analytic, numeric, 1e-6 * std::max(1.0, std::abs(numeric))) << wrt.name << " element " << i << " "
                                                                             << what;
    }
  }
}

// `backward` (CUDA; its gradients computed from `operands`, the undefined ones skipped) called eagerly, then
// captured in a CUDA graph on a pool stream and replayed twice, each time after fresh random values were copied
// into `operands` and the graph's outputs were filled with NaN: each replay's gradients must equal, bit for bit,
// an eager call's on the same values (and so be written in full). The eager call comes first so that one-time
// work outside a capture (the wgmma probe) is done, as in a training step warmed before capture.
// Second derivatives, as an R1 or WGAN-GP penalty takes them: `forward(hierpar, x, w, b)` returns the output of
// hierpar's op or of ATen's on fresh leaves; the first derivatives of (y * upstream).sum() for x and w are taken
// with create_graph, and a penalty on both is differentiated for x, w (and b when defined). Expects hierpar's first
// and second derivatives equal to ATen's (float64 tolerance).
using ConvForward = std::function<torch::Tensor(bool hierpar, const torch::Tensor& x, const torch::Tensor& w,
                                                const torch::Tensor& b)>;
inline void expect_second_derivatives_match_aten(const ConvForward& forward, const torch::Tensor& input,
                                                 const torch::Tensor& weight, const torch::Tensor& bias,
                                                 const torch::Tensor& upstream) {
  auto run = [&](bool hierpar) {
    auto x = input.detach().clone().requires_grad_();
    auto w = weight.detach().clone().requires_grad_();
    auto b = bias.defined() ? bias.detach().clone().requires_grad_() : torch::Tensor();
    const torch::Tensor y = forward(hierpar, x, w, b);
    auto first = torch::autograd::grad({(y * upstream).sum()}, {x, w}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    const auto penalty = first[0].square().sum() + first[1].square().sum();
    std::vector<torch::Tensor> wrt{x, w};
    if (b.defined()) wrt.push_back(b);
    auto second = torch::autograd::grad({penalty}, wrt, {}, std::nullopt, false, /*allow_unused=*/true);
    return std::make_pair(first, second);
  };
  const auto [first, second] = run(true);
  const auto [first_ref, second_ref] = run(false);
  expect_close(first[0], first_ref[0], "grad_input");
  expect_close(first[1], first_ref[1], "grad_weight");
  for (size_t i = 0; i < second.size(); ++i) {
    ASSERT_EQ(second[i].defined(), second_ref[i].defined()) << "second derivative " << i;
    if (second[i].defined()) expect_close(second[i], second_ref[i], "second derivative " + std::to_string(i));
  }
}

using Gradients = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>;
inline void expect_graph_replay_equals_eager(const std::function<Gradients()>& backward,
                                             const std::vector<torch::Tensor>& operands, const std::string& what) {
  auto as_list = [](const Gradients& g) {
    std::vector<torch::Tensor> out;
    for (const torch::Tensor& t : {std::get<0>(g), std::get<1>(g), std::get<2>(g)})
      if (t.defined()) out.push_back(t);
    return out;
  };
  backward();
  torch::cuda::synchronize();
  at::cuda::CUDAGraph graph;
  std::vector<torch::Tensor> captured;
  {
    const c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
    graph.capture_begin();
    captured = as_list(backward());
    graph.capture_end();
  }
  torch::cuda::synchronize();
  for (int replay = 0; replay < 2; ++replay) {
    for (const torch::Tensor& t : operands) {
      torch::Tensor in_place = t;
      in_place.copy_(random_tensor(t.sizes(), t.options()));
    }
    for (torch::Tensor& t : captured) t.fill_(std::numeric_limits<double>::quiet_NaN());
    torch::cuda::synchronize();
    graph.replay();
    torch::cuda::synchronize();
    const auto eager = as_list(backward());
    ASSERT_EQ(eager.size(), captured.size()) << what;
    for (size_t i = 0; i < eager.size(); ++i) {
      EXPECT_TRUE(torch::equal(captured[i], eager[i])) << what << ": gradient " << i << ", replay " << replay;
    }
  }
}

}  // namespace hierpar::testing
