// Helpers shared by the convolution operators' tests (test_conv_transpose.cpp, test_conv2d.cpp): each compares a
// forward + backward against ATen in float64 with a tolerance per dtype (the reasons are at the top of
// test_conv_transpose.cpp) whose absolute part scales with the reference's largest magnitude, since every output
// and gradient is a sum of many products and cancellation makes elementwise-relative error meaningless near 0.
#pragma once

#include "testing.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAGraph.h>
#include <torch/autograd.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <array>
#include <functional>
#include <sstream>
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

// `y` and the gradients its backward left in the leaves x, w and b (b undefined without a bias).
inline ConvResults results_after_backward(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& w,
                                          const torch::Tensor& b) {
  return {y.detach(), x.grad(), w.grad(), b.defined() ? b.grad() : torch::Tensor()};
}

// `run()`'s results with TF32 off for convolutions (true fp32 arithmetic); the setting is restored after.
template <class Run>
ConvResults without_tf32(const Run& run) {
  const Tf32ForConvolutions fp32(false);
  return run();
}

// A leaf that requires grad: hierpar's op gets the tensor as made (a strided view stays one), the reference a copy
// in `as`. An undefined tensor (no bias) stays undefined.
inline torch::Tensor autograd_leaf(const torch::Tensor& x, std::optional<torch::Dtype> as) {
  if (!x.defined()) return x;
  return (as ? x.detach().to(*as) : x.detach()).requires_grad_();
}

// A case's operands (bias undefined without one, grad_output shaped like the output). `Case` has batch, cin, cout,
// h, w, bias, layout, weight_channels_last, unbatched and out_hw(); the weight is made with `weight_sizes`.
struct ConvTensors {
  torch::Tensor input, weight, bias, grad_output;
};

// The operands copied to the CPU, for comparing a CUDA run with hierpar's CPU kernels.
inline ConvTensors to_cpu(const ConvTensors& t) {
  return {t.input.cpu(), t.weight.cpu(), t.bias.defined() ? t.bias.cpu() : t.bias, t.grad_output.cpu()};
}

template <class Case>
ConvTensors make_conv_tensors(const Case& c, at::IntArrayRef weight_sizes, const torch::TensorOptions& options) {
  ConvTensors t;
  std::vector<int64_t> in_sizes{c.batch, c.cin, c.h, c.w};
  if (c.unbatched) in_sizes.erase(in_sizes.begin());
  t.input = random_tensor(in_sizes, options, c.layout);
  t.weight = random_tensor(weight_sizes, options, c.weight_channels_last ? Layout::channels_last : Layout::contiguous);
  if (c.bias) t.bias = random_tensor({c.cout}, options);
  const auto o = c.out_hw();
  std::vector<int64_t> out_sizes{c.batch, c.cout, o[0], o[1]};
  if (c.unbatched) out_sizes.erase(out_sizes.begin());
  t.grad_output = random_tensor(out_sizes, options, c.layout);
  return t;
}

// The random fields both ops' cases share, each drawn in the same order: groups 1..3 dividing channel counts of 1..3
// per group, batch 1..3, height and width 1..max_hw, kernel 1..4, stride 1..3, dilation 1..2, padding 0..2.
template <class Case>
void random_conv_geometry(Case& c, int64_t max_hw) {
  c.groups = rand_int(1, 3);
  c.cin = c.groups * rand_int(1, 3);
  c.cout = c.groups * rand_int(1, 3);
  c.batch = rand_int(1, 3);
  c.h = rand_int(1, max_hw);
  c.w = rand_int(1, max_hw);
  c.kernel = {rand_int(1, 4), rand_int(1, 4)};
  c.stride = {rand_int(1, 3), rand_int(1, 3)};
  c.dilation = {rand_int(1, 2), rand_int(1, 2)};
  c.padding = {rand_int(0, 2), rand_int(0, 2)};
}

// A random bias or none, input layout, weight layout, and an unbatched input one time in six.
template <class Case>
void random_conv_layouts(Case& c) {
  c.bias = coin();
  c.layout = static_cast<Layout>(rand_int(0, 2));
  c.weight_channels_last = coin();
  c.unbatched = rand_int(0, 5) == 0;
}

// A channels_last batched input keeps its layout through output and grad_input. Inputs whose channels_last strides
// are also contiguous ones (one channel, 1x1) are taken as NCHW and not checked.
inline void expect_channels_last_kept(Layout layout, bool unbatched, const torch::Tensor& input,
                                      const ConvResults& got, const std::string& what) {
  if (layout != Layout::channels_last || unbatched || input.is_contiguous()) return;
  EXPECT_TRUE(got.output.is_contiguous(at::MemoryFormat::ChannelsLast)) << what << ": output layout";
  EXPECT_TRUE(got.grad_input.is_contiguous(at::MemoryFormat::ChannelsLast)) << what << ": grad_input layout";
}

// The description of an output-layout case: device, input sizes and both layouts.
inline std::string layout_case_what(const torch::Device& device, const torch::Tensor& input, bool input_cl,
                                    bool weight_cl) {
  return device.str() + " input " + c10::str(input.sizes()) + (input_cl ? " channels_last" : " contiguous") +
         ", weight " + (weight_cl ? "channels_last" : "contiguous");
}

inline std::optional<torch::Tensor> opt(const torch::Tensor& t) {
  return t.defined() ? std::optional<torch::Tensor>(t) : std::nullopt;
}

inline void compare(const ConvResults& got, const ConvResults& ref, double rel, const std::string& what) {
  expect_close(got.output, ref.output, scaled(rel, ref.output), what + " output");
  expect_close(got.grad_input, ref.grad_input, scaled(rel, ref.grad_input), what + " grad_input");
  expect_close(got.grad_weight, ref.grad_weight, scaled(rel, ref.grad_weight), what + " grad_weight");
  if (ref.grad_bias.defined()) expect_close(got.grad_bias, ref.grad_bias, scaled(rel, ref.grad_bias), what + " grad_bias");
}

// Central finite differences (step 1e-6, in float64) of loss = sum(forward(input, weight, bias) * grad_output), whose
// gradient is the backward of grad_output, at 6 random elements of each defined operand, against the analytic
// gradients in `got`.
using ConvOp = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;
inline void expect_finite_difference_gradients(const ConvOp& forward, const ConvTensors& t, const ConvResults& got,
                                               const std::string& what) {
  const double eps = 1e-6;
  const torch::Tensor &input = t.input, &weight = t.weight, &bias = t.bias;
  auto loss = [&](const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
    return (forward(x, w, b) * t.grad_output).sum().item<double>();
  };
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

using Gradients = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>;
using MaskedBackward = std::function<Gradients(std::array<bool, 3> output_mask)>;

// `backward` (of `t`'s operands) with each of the 8 output masks computes exactly the gradients asked for, each
// equal to the full call's. Then through autograd, `forward(x, weight, no bias)`: a weight that does not require
// grad gets none computed, and the input's grad is the full call's.
inline void expect_output_mask_respected(const MaskedBackward& backward, const ConvOp& forward,
                                         const ConvTensors& t) {
  const auto all = backward({true, true, true});
  for (int mask = 0; mask < 8; ++mask) {
    std::array<bool, 3> m{(mask & 1) != 0, (mask & 2) != 0, (mask & 4) != 0};
    const auto r = backward(m);
    const torch::Tensor got[3] = {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
    const torch::Tensor want[3] = {std::get<0>(all), std::get<1>(all), std::get<2>(all)};
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(got[i].defined(), m[i]) << "mask " << mask << " output " << i;
      if (m[i]) EXPECT_TRUE(got[i].equal(want[i])) << "mask " << mask << " output " << i;
    }
  }
  auto x = t.input.detach().requires_grad_();
  forward(x, t.weight, torch::Tensor()).backward(t.grad_output);
  expect_close(x.grad(), std::get<0>(all), "grad_input with a frozen weight");
}

// Second derivatives, as an R1 or WGAN-GP penalty takes them: `forward(hierpar, x, w, b)` returns the output of
// hierpar's op or of ATen's on fresh leaves; the first derivatives of (y * upstream).sum() for x and w are taken
// with create_graph, and a penalty on both is differentiated for x, w (and b when defined). Returns the first
// derivatives, then the second.
using ConvForward = std::function<torch::Tensor(bool hierpar, const torch::Tensor& x, const torch::Tensor& w,
                                                const torch::Tensor& b)>;
inline std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> penalty_derivatives(
    const ConvForward& forward, bool hierpar, const torch::Tensor& input, const torch::Tensor& weight,
    const torch::Tensor& bias, const torch::Tensor& upstream) {
  auto x = input.detach().clone().requires_grad_();
  auto w = weight.detach().clone().requires_grad_();
  auto b = bias.defined() ? bias.detach().clone().requires_grad_() : torch::Tensor();
  const torch::Tensor y = forward(hierpar, x, w, b);
  auto first = torch::autograd::grad({(y * upstream).sum()}, {x, w}, {}, /*retain_graph=*/true, /*create_graph=*/true);
  const auto penalty = first[0].square().sum() + first[1].square().sum();
  std::vector<torch::Tensor> wrt{x, w};
  if (b.defined()) wrt.push_back(b);
  auto second = torch::autograd::grad({penalty}, wrt, {}, std::nullopt, false, /*allow_unused=*/true);
  return {first, second};
}

// Expects hierpar's first and second derivatives (penalty_derivatives) equal to ATen's. On the CPU both in float64;
// on CUDA hierpar's op in float32 with TF32 off (its kernels for the first derivatives) against ATen's in float64
// on the same device, within float32's accumulated rounding (relative to each result's largest value).
inline void expect_second_derivatives_match_aten(const ConvForward& forward, const torch::Tensor& input,
                                                 const torch::Tensor& weight, const torch::Tensor& bias,
                                                 const torch::Tensor& upstream) {
  const bool cuda = input.is_cuda();
  const bool tf32 = at::globalContext().allowTF32CuDNN();
  at::globalContext().setAllowTF32CuDNN(false);
  auto as = [](const torch::Tensor& t, at::ScalarType dtype) { return t.defined() ? t.to(dtype) : t; };
  const auto ours_dtype = cuda ? torch::kFloat : torch::kDouble;
  const auto [first, second] = penalty_derivatives(forward, true, as(input, ours_dtype), as(weight, ours_dtype),
                                                   as(bias, ours_dtype), as(upstream, ours_dtype));
  const auto [first_ref, second_ref] = penalty_derivatives(forward, false, as(input, torch::kDouble),
                                                           as(weight, torch::kDouble), as(bias, torch::kDouble),
                                                           as(upstream, torch::kDouble));
  at::globalContext().setAllowTF32CuDNN(tf32);
  auto close = [cuda](const torch::Tensor& ours, const torch::Tensor& ref, const std::string& what) {
    if (!cuda) return expect_close(ours, ref, what);
    const double scale = ref.abs().max().item<double>();
    expect_close(ours.to(torch::kDouble), ref, Tolerance{1e-3, 1e-4 * scale + 1e-12}, what);
  };
  close(first[0], first_ref[0], "grad_input");
  close(first[1], first_ref[1], "grad_weight");
  for (size_t i = 0; i < second.size(); ++i) {
    ASSERT_EQ(second[i].defined(), second_ref[i].defined()) << "second derivative " << i;
    if (second[i].defined()) close(second[i], second_ref[i], "second derivative " + std::to_string(i));
  }
}

// `backward` (CUDA; its gradients computed from `operands`, the undefined ones skipped) called eagerly, then
// captured in a CUDA graph on a pool stream and replayed twice, each time after fresh random values were copied
// into `operands` and the graph's outputs were filled with NaN: each replay's gradients must equal, bit for bit,
// an eager call's on the same values (and so be written in full). The eager call comes first so that one-time
// work outside a capture (the wgmma probe) is done, as in a training step warmed before capture.
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

// grad_input and grad_weight asked for together (on two streams) equal each asked for alone, bit for bit, and so
// does the joint backward replayed from a CUDA graph (expect_graph_replay_equals_eager, on `operands`).
inline void expect_joint_backward_deterministic(const MaskedBackward& backward,
                                                const std::vector<torch::Tensor>& operands, const std::string& what) {
  const auto both = backward({true, true, false});
  const auto only_input = backward({true, false, false});
  const auto only_weight = backward({false, true, false});
  EXPECT_TRUE(torch::equal(std::get<0>(both), std::get<0>(only_input))) << what << ": grad_input alone";
  EXPECT_TRUE(torch::equal(std::get<1>(both), std::get<1>(only_weight))) << what << ": grad_weight alone";
  expect_graph_replay_equals_eager([&] { return backward({true, true, false}); }, operands, what);
}

// A hierpar layer and its torch::nn counterpart: the same parameter names and shapes.
template <class Stock, class Ours>
void expect_same_parameters(const Stock& stock, const Ours& ours) {
  const auto sp = stock->named_parameters(), hp = ours->named_parameters();
  ASSERT_EQ(sp.size(), hp.size());
  for (const auto& item : sp) {
    ASSERT_TRUE(hp.contains(item.key())) << item.key();
    EXPECT_EQ(hp[item.key()].sizes(), item.value().sizes()) << item.key();
  }
}

// Checks both convolution ops' tests make, for `Op`, which gives: Op::random_case() (a Case with bias and
// describe()), Op::tensors(case, options), Op::results(case, tensors) (hierpar's forward + backward through
// autograd), Op::forward(case, x, w, b, activation) (hierpar's op at the case's arguments, b undefined for none;
// `activation`: a fused activation the case has), Op::aten_forward(case, x, w, b) (ATen's equivalent) and
// Op::backward(case, tensors, output_mask) (the backward op).

// expect_finite_difference_gradients in float64 on 3 random cases with a bias.
template <class Op>
void expect_finite_difference_gradients_on_random_cases() {
  for (int trial = 0; trial < 3; ++trial) {
    auto c = Op::random_case();
    c.bias = true;
    const auto t = Op::tensors(c, torch::kDouble);
    auto forward = [&](const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
      return Op::forward(c, x, w, b, /*activation=*/true);
    };
    expect_finite_difference_gradients(forward, t, Op::results(c, t), c.describe());
  }
}

// expect_output_mask_respected in float64 on a random case, the op without its activation (the backward op's).
template <class Op>
void expect_output_mask_respected_on_a_random_case() {
  const auto c = Op::random_case();
  const auto t = Op::tensors(c, torch::kDouble);
  auto backward = [&](std::array<bool, 3> mask) { return Op::backward(c, t, mask); };
  auto forward = [&](const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
    return Op::forward(c, x, w, b, /*activation=*/false);
  };
  expect_output_mask_respected(backward, forward, t);
}

// Second derivatives (an R1 or WGAN-GP penalty differentiates a gradient): expect_second_derivatives_match_aten on 4
// random cases, with their activation and bias, in float64 on `device`.
template <class Op>
void expect_second_derivatives_on(torch::Device device) {
  for (int trial = 0; trial < 4; ++trial) {
    const auto c = Op::random_case();
    SCOPED_TRACE(c.describe());
    const auto t = Op::tensors(c, torch::TensorOptions().dtype(torch::kDouble).device(device));
    expect_second_derivatives_match_aten(
        [&](bool hierpar, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
          return hierpar ? Op::forward(c, x, w, b, /*activation=*/true) : Op::aten_forward(c, x, w, b);
        },
        t.input, t.weight, c.bias ? t.bias : torch::Tensor(), t.grad_output);
  }
}

// Saves `from` and loads the archive into `to`.
template <class From, class To>
void copy_state(const From& from, To& to) {
  std::stringstream archive;
  torch::save(from, archive);
  torch::load(to, archive);
}

// torch::nn's module `stock` and hierpar's `ours`, of the same options, moved to float64: the same parameters (names
// and shapes), and either's state loaded into the other gives the same output on `x` (float64); `what` ends the
// messages.
template <class Stock, class Ours>
void expect_state_interchanges(Stock& stock, Ours& ours, const torch::Tensor& x, const std::string& what) {
  stock->to(torch::kDouble);
  ours->to(torch::kDouble);
  expect_same_parameters(stock, ours);
  copy_state(stock, ours);
  expect_close(ours->forward(x), stock->forward(x), "layer output, stock weights" + what);
  ours->reset_parameters();
  copy_state(ours, stock);
  expect_close(stock->forward(x), ours->forward(x), "stock output, hierpar weights" + what);
}

// torch::nn's convolution initialisation of a weight of `weight_sizes`: weight and bias drawn from U(-bound, bound),
// bound = 1/sqrt(fan_in) (kaiming_uniform with a = sqrt(5) for the weight).
inline void expect_kaiming_uniform_init(const torch::Tensor& weight, const torch::Tensor& bias,
                                        at::IntArrayRef weight_sizes, double fan_in) {
  EXPECT_EQ(weight.sizes(), weight_sizes);
  const double bound = 1.0 / std::sqrt(fan_in);
  EXPECT_LE(weight.abs().max().item<double>(), bound);
  EXPECT_GT(weight.abs().max().item<double>(), 0.9 * bound);  // spans the range (1728 draws)
  EXPECT_LE(bias.abs().max().item<double>(), bound);
  EXPECT_GT(bias.abs().max().item<double>(), 0.3 * bound);
  EXPECT_NEAR(weight.std().item<double>(), bound / std::sqrt(3.0), 0.1 * bound);
  EXPECT_TRUE(weight.requires_grad());
}

}  // namespace hierpar::testing
