// hierpar::conv2d, its backward and hierpar::nn::Conv2d against ATen / torch::nn.
//
// conv2d runs on conv_transpose2d's kernels (the dual transposed convolution), so the tolerances are those of
// tests/test_conv_transpose.cpp, for the same reasons (compared with at::conv2d in float64 on the same, already
// rounded, inputs; the absolute part is relative to the reference's largest magnitude, since every output is a
// sum of many products and cancellation makes elementwise-relative error meaningless near 0):
//  - float64: 1e-10 (summation order only).
//  - float32 on the CPU: 1e-5 (fp32 arithmetic, summation order).
//  - float32 on CUDA: 2e-3 (TF32 tensor cores, stock's default for convolutions: both GEMM operands rounded to
//    a 10-bit mantissa, ~1e-3 of the output scale for a sum of random-sign products).
//  - bfloat16: 1e-2 (output rounding 2^-9, plus one rounding of an intermediate on the general CUDA path, and
//    on the bias add, which is a separate bf16 pass).
//  - float16: 2e-3 (the same roundings at 2^-12).
// With the fused leaky_relu (leaky_relu_slope), the backward's mask comes from the output's sign. Below float64, an
// output within rounding of 0 may have the other sign than the float64 reference's, and one such element changes
// a gradient by (1 - slope) of its term, more than the tolerance allows in a small case. So below float64 the
// reference backward starts from at::leaky_relu_backward of hierpar's output in the test's dtype (what hierpar's
// autograd and stock's both compute there, rounding included: a gradient summed with cancellation, e.g. grad_bias,
// would otherwise show that rounding well above the output-scale tolerance); the forward, a continuous function,
// is compared as is, and float64 compares the whole chain with ATen's autograd.
#include "conv_testing.h"
#include "testing.h"

#include "hierpar/nn/conv2d.h"
#include "hierpar/ops.h"

#include <ATen/autocast_mode.h>
#include <torch/nn/modules/conv.h>

#include <array>
#include <sstream>
#include <tuple>

namespace {

using namespace hierpar::testing;
using Results = ConvResults;

struct Case {
  int64_t batch, cin, cout, h, w, groups;
  std::vector<int64_t> kernel, stride, padding, dilation;
  bool bias;
  Layout layout;
  bool weight_channels_last;
  bool unbatched;
  std::optional<double> slope = std::nullopt;  // the fused leaky_relu's

  std::vector<int64_t> out_hw() const {
    std::vector<int64_t> r(2);
    const int64_t in[2] = {h, w};
    for (int i = 0; i < 2; ++i) {
      const int64_t span = in[i] + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1;
      r[i] = span < 0 ? 0 : span / stride[i] + 1;
    }
    return r;
  }
  std::string describe() const {
    std::ostringstream os;
    os << "N=" << batch << " Cin=" << cin << " Cout=" << cout << " HxW=" << h << "x" << w << " groups=" << groups
       << " k=" << at::IntArrayRef(kernel) << " s=" << at::IntArrayRef(stride) << " p=" << at::IntArrayRef(padding)
       << " d=" << at::IntArrayRef(dilation) << " bias=" << bias << " layout=" << hierpar::testing::to_string(layout)
       << " weight_cl=" << weight_channels_last << " unbatched=" << unbatched;
    if (slope) os << " leaky_relu_slope=" << *slope;
    return os.str();
  }
};

// No activation (half the time), relu, DCGAN's 0.2 or a slope above 1.
std::optional<double> random_slope() {
  static const double kSlopes[] = {0.0, 0.2, 1.5};
  return coin() ? std::nullopt : std::optional<double>(kSlopes[rand_int(0, 2)]);
}

// A random valid case of the general route: groups, dilation, strides that leave a remainder (output_padding of
// the dual), odd sizes, batch 1, one channel, padding up to the kernel, all layouts.
Case random_case() {
  Case c;
  for (;;) {
    hierpar::testing::random_conv_geometry(c, 9);
    const auto o = c.out_hw();
    if (o[0] > 0 && o[1] > 0) break;
  }
  hierpar::testing::random_conv_layouts(c);
  c.slope = random_slope();
  return c;
}

// The discriminator's first layer: kernel 4, stride 2, padding 1, C_in <= 4 (the dual of the small-C_out
// transposed convolution), odd and even sizes (an odd one leaves a remainder, so the general route takes it).
Case small_cin_case(int64_t cout, int64_t batch, Layout layout) {
  return Case{batch, rand_int(1, 4), cout, rand_int(2, 40), rand_int(2, 40), 1, {4, 4}, {2, 2}, {1, 1}, {1, 1},
              coin(), layout, coin(), false, random_slope()};
}

using Tensors = hierpar::testing::ConvTensors;

Tensors make_tensors(const Case& c, const torch::TensorOptions& options) {
  return hierpar::testing::make_conv_tensors(c, {c.cout, c.cin / c.groups, c.kernel[0], c.kernel[1]}, options);
}


// Forward + backward through autograd, with hierpar's op or ATen's (at::leaky_relu after at::conv2d when the case
// has a slope). `mask_from`: an output in t's dtype whose leaky_relu backward (in that dtype) ATen's convolution
// backward starts from, instead of its own.
Results run(const Case& c, const Tensors& t, bool aten, std::optional<torch::Dtype> as = std::nullopt,
            const torch::Tensor& mask_from = {}) {
  auto x = autograd_leaf(t.input, as), w = autograd_leaf(t.weight, as), b = autograd_leaf(t.bias, as);
  const auto grad_output = as ? t.grad_output.to(*as) : t.grad_output;
  if (!aten) {
    auto y = hierpar::ops::conv2d(x, w, opt(b), c.stride, c.padding, c.dilation, c.groups, c.slope);
    y.backward(grad_output);
    return results_after_backward(y, x, w, b);
  }
  auto pre = at::conv2d(x, w, opt(b), c.stride, c.padding, c.dilation, c.groups);
  auto y = c.slope ? at::leaky_relu(pre, *c.slope) : pre;
  if (c.slope && mask_from.defined()) {
    pre.backward(at::leaky_relu_backward(t.grad_output, mask_from, *c.slope, /*self_is_result=*/true)
                     .to(grad_output.scalar_type()));
  } else {
    y.backward(grad_output);
  }
  return results_after_backward(y, x, w, b);
}

// hierpar's forward + backward of `c` in `t`'s dtype and device against ATen's in float64; on CUDA also against
// hierpar on the CPU. Output and grad_input keep a channels_last input's layout.
void check_case(const Case& c, const Tensors& t, const std::string& what) {
  const auto dtype = t.input.scalar_type();
  const bool cuda = t.input.is_cuda();
  const auto got = run(c, t, /*aten=*/false);
  compare(got, run(c, t, /*aten=*/true, torch::kDouble, dtype == torch::kDouble ? torch::Tensor() : got.output), conv_rel_tolerance(dtype, cuda),
          what);
  EXPECT_EQ(got.output.device(), t.input.device()) << what;
  EXPECT_EQ(got.output.scalar_type(), dtype) << what;
  expect_channels_last_kept(c.layout, c.unbatched, t.input, got, what);
  if (cuda) {
    const auto cpu = run(c, to_cpu(t), /*aten=*/false);
    const double rel = conv_rel_tolerance(dtype, true) + conv_rel_tolerance(dtype, false);
    if (c.slope && dtype != torch::kDouble) {
      // The two backends' masks may differ where an output is within rounding of 0 (see the top): outputs only.
      expect_close(got.output, cpu.output, scaled(rel, cpu.output), what + " vs CPU output");
    } else {
      compare(got, cpu, rel, what + " vs CPU");
    }
  }
}

void check_random_cases(const torch::Device& device, int trials) {
  for (int trial = 0; trial < trials; ++trial) {
    const Case c = random_case();
    for (auto dtype : {torch::kDouble, torch::kFloat, torch::kBFloat16, torch::kHalf}) {
      const auto t = make_tensors(c, torch::TensorOptions().dtype(dtype).device(device));
      check_case(c, t, device.str() + " " + c10::toString(dtype) + " " + c.describe());
    }
  }
}

TEST(Conv2dCpu, DualityHoldsInAten) {
  // The identity the op is built on, checked in ATen alone (float64): conv2d(x, w) is conv_transpose2d's grad_input
  // at grad_output = x with output_padding = (H + 2p - d(k - 1) - 1) mod s; conv2d's grad_input is conv_transpose2d
  // of grad_y; conv2d's grad_weight is conv_transpose2d's grad_weight with input grad_y and grad_output x.
  for (int trial = 0; trial < 6; ++trial) {
    Case c = random_case();
    c.unbatched = false;
    c.bias = false;  // the transposed convolution's grad_input has none
    c.slope = std::nullopt;
    const auto t = make_tensors(c, torch::kDouble);
    const auto o = c.out_hw();
    std::vector<int64_t> output_padding(2);
    const int64_t in[2] = {c.h, c.w};
    for (int i = 0; i < 2; ++i)
      output_padding[i] = (in[i] + 2 * c.padding[i] - c.dilation[i] * (c.kernel[i] - 1) - 1) % c.stride[i];
    const auto y_sized = torch::empty({c.batch, c.cout, o[0], o[1]}, torch::kDouble);
    const auto dual = at::convolution_backward(t.input, y_sized, t.weight, std::nullopt, c.stride, c.padding,
                                               c.dilation, /*transposed=*/true, output_padding, c.groups,
                                               {true, false, false});
    const auto conv = run(c, t, /*aten=*/true);
    expect_close(std::get<0>(dual), conv.output, scaled(1e-10, conv.output), "forward = dual grad_input " + c.describe());
    expect_close(at::conv_transpose2d(t.grad_output, t.weight, {}, c.stride, c.padding, output_padding, c.groups,
                                      c.dilation),
                 conv.grad_input, scaled(1e-10, conv.grad_input), "grad_input = dual forward " + c.describe());
    const auto dual_weight = at::convolution_backward(t.input, t.grad_output, t.weight, std::nullopt, c.stride,
                                                      c.padding, c.dilation, true, output_padding, c.groups,
                                                      {false, true, false});
    expect_close(std::get<1>(dual_weight), conv.grad_weight, scaled(1e-10, conv.grad_weight),
                 "grad_weight = dual grad_weight " + c.describe());
  }
}

TEST(Conv2dCpu, MatchesAtenOnRandomCasesEveryDtype) { check_random_cases(torch::kCPU, 12); }

TEST(Conv2dCpu, SmallCinK4S2P1MatchesAten) {
  for (auto dtype : {torch::kDouble, torch::kFloat, torch::kBFloat16}) {
    for (auto layout : {Layout::contiguous, Layout::channels_last, Layout::strided}) {
      const Case c = small_cin_case(16, rand_int(1, 3), layout);
      check_case(c, make_tensors(c, dtype), std::string("CPU ") + c10::toString(dtype) + " " + c.describe());
    }
  }
}

// hierpar::conv2d for the checks conv_testing.h shares with test_conv_transpose.cpp; its activation is the case's
// fused leaky_relu.
struct Conv2dOp {
  static Case random_case() { return ::random_case(); }
  static Tensors tensors(const Case& c, const torch::TensorOptions& options) { return make_tensors(c, options); }
  static Results results(const Case& c, const Tensors& t) { return run(c, t, /*aten=*/false); }
  static torch::Tensor forward(const Case& c, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                               bool activation) {
    return hierpar::ops::conv2d(x, w, opt(b), c.stride, c.padding, c.dilation, c.groups,
                                activation ? c.slope : std::nullopt);
  }
  static torch::Tensor aten_forward(const Case& c, const torch::Tensor& x, const torch::Tensor& w,
                                    const torch::Tensor& b) {
    const torch::Tensor y = at::conv2d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
    return c.slope ? at::leaky_relu(y, *c.slope) : y;
  }
  static Gradients backward(const Case& c, const Tensors& t, std::array<bool, 3> mask) {
    return hierpar::ops::conv2d_backward(t.grad_output, t.input, t.weight, c.stride, c.padding, c.dilation, c.groups,
                                         mask);
  }
};

TEST(Conv2dCpu, FiniteDifferenceGradcheckInDouble) { expect_finite_difference_gradients_on_random_cases<Conv2dOp>(); }

TEST(Conv2dCpu, OutputMaskComputesOnlyWhatIsAsked) { expect_output_mask_respected_on_a_random_case<Conv2dOp>(); }

// Second derivatives with and without the fused LeakyReLU and bias; on a GPU hierpar's CUDA op (its kernels for the
// first derivatives, ATen's differentiable backward under create_graph) in float32 against ATen in float64.
TEST(Conv2dAutograd, SecondDerivativesMatchAten) { expect_second_derivatives_on<Conv2dOp>(torch::kCPU); }

TEST(Conv2dCuda, SecondDerivativesMatchAten) {
  HIERPAR_REQUIRE_CUDA();
  expect_second_derivatives_on<Conv2dOp>(torch::kCUDA);
}

TEST(Conv2dAutograd, TheBackwardOpItselfIsNotDifferentiable) {
  const Case c = random_case();
  const auto t = make_tensors(c, torch::kDouble);
  auto go = t.grad_output.detach().requires_grad_();
  HIERPAR_EXPECT_THROW_MSG(hierpar::ops::conv2d_backward(go, t.input, t.weight, c.stride, c.padding, c.dilation,
                                                         c.groups, {true, true, false}),
                           "hierpar::conv2d_backward is not differentiable");
}

TEST(Conv2dAutocast, RunsInTheLowerPrecisionLikeAten) {
  const auto x = random_tensor({2, 3, 9, 9}, torch::kFloat);
  const auto w = random_tensor({16, 3, 4, 4}, torch::kFloat);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  const auto got = hierpar::ops::conv2d(x, w, std::nullopt, {2}, {1});
  const auto expected = at::conv2d(x, w, {}, 2, 1);
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();
  EXPECT_EQ(got.scalar_type(), expected.scalar_type());
  EXPECT_EQ(got.scalar_type(), torch::kBFloat16);
  expect_close(got, expected, scaled(conv_rel_tolerance(torch::kBFloat16, false), expected.to(torch::kDouble)),
               "autocast conv2d");
}

// A float32 call with a bias whose output has positions reading only padding (width 1, padding 1, stride 2, dilation
// 2): ATen's own CPU convolution crashed there (SIGSEGV in oneDNN's brgemm kernel, torch 2.11 on this project's CI
// CPU); hierpar's CPU route adds the bias after the convolution there, and matches ATen in float64.
TEST(Conv2dCpu, BiasWithOutputsReadingOnlyPadding) {
  const auto options = torch::TensorOptions().dtype(torch::kFloat);
  const auto x = random_tensor({2, 6, 4, 1}, options, Layout::channels_last);
  const auto w = random_tensor({4, 3, 2, 1}, options, Layout::channels_last);
  const auto b = random_tensor({4}, options);
  const auto y = hierpar::ops::conv2d(x, w, b, {2, 2}, {0, 1}, {1, 2}, 2);
  const std::vector<int64_t> stride{2, 2}, padding{0, 1}, dilation{1, 2};
  const auto expected =
      at::conv2d(x.to(torch::kDouble), w.to(torch::kDouble), b.to(torch::kDouble), stride, padding, dilation, 2);
  expect_close(y, expected, "conv2d with outputs in the padding");
  // The output column that reads only padding holds the bias.
  expect_close(y.select(3, 0), b.view({1, 4, 1}).expand({2, 4, 2}), "padding-only outputs");
}

TEST(Conv2dMeta, ShapesAndLayoutsMatchTheCpuKernel) {
  for (int trial = 0; trial < 10; ++trial) {
    const Case c = random_case();
    const auto t = make_tensors(c, torch::kFloat);
    auto meta = [](const torch::Tensor& x) { return x.defined() ? x.to(torch::kMeta) : x; };
    const auto y =
        hierpar::ops::conv2d(t.input, t.weight, opt(t.bias), c.stride, c.padding, c.dilation, c.groups, c.slope);
    const auto ym = hierpar::ops::conv2d(meta(t.input), meta(t.weight), opt(meta(t.bias)), c.stride, c.padding,
                                         c.dilation, c.groups, c.slope);
    EXPECT_TRUE(ym.is_meta());
    EXPECT_EQ(ym.sizes(), y.sizes()) << c.describe();
    EXPECT_EQ(ym.strides(), y.strides()) << c.describe();
    const auto g = hierpar::ops::conv2d_backward(t.grad_output, t.input, t.weight, c.stride, c.padding, c.dilation,
                                                 c.groups, {true, true, c.bias});
    const auto gm = hierpar::ops::conv2d_backward(meta(t.grad_output), meta(t.input), meta(t.weight), c.stride,
                                                  c.padding, c.dilation, c.groups, {true, true, c.bias});
    EXPECT_EQ(std::get<0>(gm).sizes(), std::get<0>(g).sizes()) << c.describe();
    EXPECT_EQ(std::get<0>(gm).strides(), std::get<0>(g).strides()) << c.describe();
    EXPECT_EQ(std::get<1>(gm).sizes(), std::get<1>(g).sizes()) << c.describe();
    EXPECT_EQ(std::get<1>(gm).strides(), std::get<1>(g).strides()) << c.describe();
    EXPECT_EQ(std::get<2>(gm).defined(), c.bias);
    if (c.bias) EXPECT_EQ(std::get<2>(gm).sizes(), std::get<2>(g).sizes());
  }
}

// The output's memory format: channels_last when the input or the weight is (PyTorch's rule: ATen's CPU kernels and
// cudnn_conv_suggest_memory_format), including one-channel and 1x1 inputs and one-channel weights, whose layout is
// ambiguous (they count as NCHW). ATen's CPU output must agree with the rule. On CUDA the rule is checked but not
// ATen's choice: at::conv2d called from this C++ binary returned NCHW for the [3, 3, 9, 7] cases below with a
// channels_last input or weight on an H200, where PyTorch from Python (same libtorch 2.11, same machine, cuDNN
// 9.19) returned channels_last for the same cases, as for conv_transpose2d (tests/test_conv_transpose.cpp).
void check_output_layouts(const torch::Device& device) {
  const auto options = torch::TensorOptions().device(device);
  for (const bool weight_cl : {false, true}) {
    for (const auto& [input_sizes, input_cl, kernel, stride, padding] :
         std::vector<std::tuple<std::vector<int64_t>, bool, int64_t, int64_t, int64_t>>{
             {{3, 3, 9, 7}, false, 4, 2, 1},
             {{3, 3, 9, 7}, true, 4, 2, 1},
             {{3, 1, 8, 8}, true, 4, 2, 1},
             {{3, 16, 1, 1}, true, 1, 1, 0}}) {
      const auto input = random_tensor(input_sizes, options, input_cl ? Layout::channels_last : Layout::contiguous);
      const auto weight = random_tensor({16, input_sizes[1], kernel, kernel}, options,
                                        weight_cl ? Layout::channels_last : Layout::contiguous);
      const auto expected = at::conv2d(input, weight, {}, stride, padding);
      const auto got = hierpar::ops::conv2d(input, weight, {}, {stride}, {padding});
      const auto on_meta =
          hierpar::ops::conv2d(input.to(torch::kMeta), weight.to(torch::kMeta), {}, {stride}, {padding});
      const std::string what = hierpar::testing::layout_case_what(device, input, input_cl, weight_cl);
      const bool rule = input.suggest_memory_format() == at::MemoryFormat::ChannelsLast ||
                        weight.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
      EXPECT_TRUE(got.is_contiguous(rule ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous))
          << what << ": channels_last expected " << rule;
      if (device.is_cpu()) {
        EXPECT_EQ(expected.is_contiguous(at::MemoryFormat::ChannelsLast),
                  got.is_contiguous(at::MemoryFormat::ChannelsLast))
            << what << ": ATen";
      }
      EXPECT_EQ(got.strides(), on_meta.strides()) << what;
      expect_close(got, expected, scaled(conv_rel_tolerance(torch::kFloat, device.is_cuda()), expected), what);
    }
  }
}

TEST(Conv2dCpu, OutputLayoutFollowsAten) { check_output_layouts(torch::kCPU); }

TEST(Conv2dErrors, EveryBadArgumentIsNamed) {
  const auto x = random_tensor({2, 4, 5, 5}, torch::kFloat);
  const auto w = random_tensor({6, 4, 3, 3}, torch::kFloat);
  auto call = [&](const torch::Tensor& input, const torch::Tensor& weight, std::optional<torch::Tensor> bias,
                  at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
    return hierpar::ops::conv2d(input, weight, bias, stride, padding, dilation, groups);
  };
  HIERPAR_EXPECT_THROW_MSG(call(x.flatten(), w, {}, {1}, {0}, {1}, 1), "conv2d: input must be 3-d (unbatched) or 4-d");
  HIERPAR_EXPECT_THROW_MSG(call(x, w[0], {}, {1}, {0}, {1}, 1), "conv2d: weight must be 4-d [C_out, C_in/groups");
  HIERPAR_EXPECT_THROW_MSG(call(x.to(torch::kInt), w.to(torch::kInt), {}, {1}, {0}, {1}, 1),
                           "conv2d: input must be float32, float64, bfloat16 or float16");
  HIERPAR_EXPECT_THROW_MSG(call(x, w.to(torch::kDouble), {}, {1}, {0}, {1}, 1),
                           "conv2d: weight's dtype (Double) must equal input's dtype (Float)");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, {}, {1, 1, 1}, {0}, {1}, 1), "conv2d: stride must have 1 or 2 elements");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, {}, {0, 1}, {0}, {1}, 1), "conv2d: stride must be positive");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, {}, {1}, {0}, {1, 0}, 1), "conv2d: dilation must be positive");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, {}, {1}, {-1}, {1}, 1), "conv2d: padding must be non-negative");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, {}, {1}, {0}, {1}, 0), "conv2d: groups must be positive");
  HIERPAR_EXPECT_THROW_MSG(hierpar::ops::conv2d(x, w, {}, {1}, {0}, {1}, 1, -0.1),
                           "conv2d: leaky_relu_slope must be non-negative, got -0.1");
  HIERPAR_EXPECT_THROW_MSG(call(x, random_tensor({6, 1, 3, 3}, torch::kFloat), {}, {1}, {0}, {1}, 3),
                           "conv2d: groups (3) must divide the input channels (4)");
  HIERPAR_EXPECT_THROW_MSG(call(x, random_tensor({6, 3, 3, 3}, torch::kFloat), {}, {1}, {0}, {1}, 1),
                           "conv2d: weight.size(1) (3) times groups (1) must equal the input channels (4)");
  HIERPAR_EXPECT_THROW_MSG(call(x, random_tensor({5, 2, 3, 3}, torch::kFloat), {}, {1}, {0}, {1}, 2),
                           "conv2d: weight.size(0) (the output channels, 5) must be a positive multiple of groups (2)");
  HIERPAR_EXPECT_THROW_MSG(call(x, torch::empty({6, 4, 0, 3}), {}, {1}, {0}, {1}, 1),
                           "conv2d: weight's kernel size must be positive");
  HIERPAR_EXPECT_THROW_MSG(call(torch::empty({2, 4, 0, 5}), w, {}, {1}, {0}, {1}, 1),
                           "conv2d: input must have non-zero channels, height and width");
  HIERPAR_EXPECT_THROW_MSG(call(x, random_tensor({6, 4, 6, 3}, torch::kFloat), {}, {1}, {0}, {1}, 1),
                           "conv2d: the padded input [5, 5] (input size plus twice padding [0]) is smaller than the "
                           "dilated kernel [6, 3]");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, {}, {1}, {0}, {3}, 1), "is smaller than the dilated kernel [7, 7]");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, random_tensor({4}, torch::kFloat), {1}, {0}, {1}, 1),
                           "conv2d: bias must be 1-d with out_channels = weight.size(0) = 6");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, random_tensor({6}, torch::kDouble), {1}, {0}, {1}, 1), "conv2d: bias's dtype");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, torch::empty({6}, torch::kMeta), {1}, {0}, {1}, 1),
                           "conv2d: bias is on meta but input is on cpu");
  HIERPAR_EXPECT_THROW_MSG(call(x, w.to(torch::kMeta), {}, {1}, {0}, {1}, 1),
                           "conv2d: weight is on meta but input is on cpu");
  // Backward: grad_output must have the forward output's shape, dtype and device.
  auto backward = [&](const torch::Tensor& grad_output) {
    return hierpar::ops::conv2d_backward(grad_output, x, w, {1}, {0}, {1}, 1, {true, true, true});
  };
  HIERPAR_EXPECT_THROW_MSG(backward(random_tensor({2, 6, 4, 4}, torch::kFloat)),
                           "conv2d_backward: grad_output must have the forward output's shape [2, 6, 3, 3]");
  HIERPAR_EXPECT_THROW_MSG(backward(random_tensor({2, 6, 3, 3}, torch::kDouble)), "conv2d_backward: grad_output's dtype");
  HIERPAR_EXPECT_THROW_MSG(backward(torch::empty({2, 6, 3, 3}, torch::kMeta)),
                           "conv2d_backward: grad_output is on meta but input is on cpu");
  if (hierpar::testing::cuda_available()) {
    HIERPAR_EXPECT_THROW_MSG(call(x, w.cuda(), {}, {1}, {0}, {1}, 1), "conv2d: weight is on cuda:0 but input is on cpu");
    HIERPAR_EXPECT_THROW_MSG(call(x.cuda(), w.cuda(), random_tensor({6}, torch::kFloat), {1}, {0}, {1}, 1),
                             "conv2d: bias is on cpu but input is on cuda:0");
  }
}

// ---- CUDA ----------------------------------------------------------------------------------------------

TEST(Conv2dCuda, MatchesAtenAndCpuOnRandomCasesEveryDtype) {
  HIERPAR_REQUIRE_CUDA();
  check_random_cases(torch::kCUDA, 16);
}

TEST(Conv2dCuda, OutputLayoutFollowsAten) {
  HIERPAR_REQUIRE_CUDA();
  check_output_layouts(torch::kCUDA);
}

TEST(Conv2dCuda, SmallCinK4S2P1FastRouteEveryLayoutAndDtype) {
  HIERPAR_REQUIRE_CUDA();
  // Kernel 4, stride 2, padding 1, C_in <= 4: the dual of conv_transpose2d's small-C_out kernels. Forward =
  // k4s2p1_small_cout_grad_input (tensor cores for bf16/fp16 and fp32 as TF32 since C_out % 16 == 0, any input
  // layout), grad_input = k4s2p1_small_cout_forward (tensor cores for a channels_last grad_output), grad_weight =
  // k4s2p1_small_cout_grad_weight (tensor cores with a channels_last grad_output; else the general path). C_out 16,
  // 48 and 64 (the tensor-core kernels' 16- and 32-channel chunks), random sizes 2..40 (odd ones leave a remainder
  // and take the general route), batch 1, every layout, bias or not; plus the DCGAN layer at a small batch.
  std::vector<Case> cases;
  for (const int64_t cout : {16, 48, 64}) {
    for (auto layout : {Layout::contiguous, Layout::channels_last, Layout::strided}) {
      cases.push_back(small_cin_case(cout, cout == 16 ? 1 : rand_int(1, 5), layout));
    }
  }
  for (auto layout : {Layout::contiguous, Layout::channels_last}) {
    // DCGAN's layer with and without its fused LeakyReLU(0.2).
    cases.push_back(Case{9, 3, 64, 64, 64, 1, {4, 4}, {2, 2}, {1, 1}, {1, 1}, false, layout, false, false});
    cases.push_back(Case{9, 3, 64, 64, 64, 1, {4, 4}, {2, 2}, {1, 1}, {1, 1}, false, layout, true, false, 0.2});
    cases.push_back(Case{1, 1, 48, 33, 17, 1, {4, 4}, {2, 2}, {1, 1}, {1, 1}, true, layout, true, false});
  }
  for (const Case& c : cases) {
    for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
      const auto t = make_tensors(c, torch::TensorOptions().dtype(dtype).device(torch::kCUDA));
      check_case(c, t, std::string("CUDA small C_in ") + c10::toString(dtype) + " " + c.describe());
    }
  }
}

TEST(Conv2dCuda, SmallCinK4S2P1Tf32TensorCoreKernels) {
  HIERPAR_REQUIRE_CUDA();
  // fp32 with TF32 on for convolutions (stock's default), channels_last, C_out % 16 == 0: the dual small-C_out
  // kernels as TF32 tensor-core kernels, every pass (forward = the dual grad_input, copying the image's rows 16
  // bytes at a time when a row holds a multiple of 4 floats (W C_in % 4 == 0) and reading its strides otherwise;
  // grad_input = the dual forward; grad_weight = the dual grad_weight). C_in 1..4, C_out 16..64, even sizes (odd ones
  // take the general route) whose halves are odd or even, across the 32 x 8 position tile, batch 1, bias and the
  // fused leaky_relu or not; the DCGAN layer; a batch large enough that the persistent blocks loop over images.
  const hierpar::testing::Tf32ForConvolutions tf32(true);
  std::vector<Case> cases;
  for (int64_t cin = 1; cin <= 4; ++cin) {
    cases.push_back(Case{cin == 1 ? 1 : rand_int(1, 4), cin, 16 * rand_int(1, 4), 2 * rand_int(1, 40),
                         2 * rand_int(1, 40), 1, {4, 4}, {2, 2}, {1, 1}, {1, 1}, coin(), Layout::channels_last,
                         coin(), false, random_slope()});
  }
  cases.push_back(Case{9, 3, 32, 64, 64, 1, {4, 4}, {2, 2}, {1, 1}, {1, 1}, false, Layout::channels_last, false,
                       false, 0.2});
  cases.push_back(Case{200, 3, 48, 10, 14, 1, {4, 4}, {2, 2}, {1, 1}, {1, 1}, true, Layout::channels_last, false,
                       false});
  for (const Case& c : cases) {
    const auto t = make_tensors(c, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA));
    const std::string what = "CUDA TF32 small C_in " + c.describe();
    check_case(c, t, what);
    // The tensor-core kernels did compute it: TF32's rounding makes every result differ from the true-fp32 one.
    // With one input channel the input's layout is ambiguous and the output may be NCHW (as ATen's: with an NCHW
    // weight); the gradients then come from an NCHW grad_output, through the CUDA-core kernel and the general
    // path, so only the forward is checked there.
    const auto got = run(c, t, /*aten=*/false);
    const Results exact = without_tf32([&] { return run(c, t, /*aten=*/false); });
    EXPECT_FALSE(torch::equal(got.output, exact.output)) << what << ": forward not on the TF32 kernel";
    if (c.cin > 1) {
      EXPECT_FALSE(torch::equal(got.grad_input, exact.grad_input)) << what << ": grad_input not on the TF32 kernel";
      EXPECT_FALSE(torch::equal(got.grad_weight, exact.grad_weight)) << what << ": grad_weight not on the TF32 kernel";
    }
  }
}

TEST(Conv2dCuda, SmallCinFp32WithoutTf32IsTrueFp32) {
  HIERPAR_REQUIRE_CUDA();
  // With TF32 off for convolutions, the layer above keeps true fp32 arithmetic (the CUDA-core kernels and the general
  // path's grad_weight): the CPU's tolerance holds.
  const hierpar::testing::Tf32ForConvolutions fp32(false);
  for (const Case& c : {Case{3, 3, 32, 20, 18, 1, {4, 4}, {2, 2}, {1, 1}, {1, 1}, true, Layout::channels_last, false,
                             false},
                        Case{1, 1, 16, 14, 36, 1, {4, 4}, {2, 2}, {1, 1}, {1, 1}, false, Layout::channels_last, true,
                             false}}) {
    const auto t = make_tensors(c, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA));
    compare(run(c, t, false), run(c, t, true, torch::kDouble), 1e-5, "CUDA fp32 without TF32 " + c.describe());
  }
}

TEST(Conv2dCuda, WideK4S2P1RouteMatchesAten) {
  HIERPAR_REQUIRE_CUDA();
  // Kernel 4, stride 2, padding 1 with C_in >= 16: the dual of conv_transpose2d's implicit-GEMM fast path
  // (the discriminator's later layers). Every input layout (NCHW ones are converted by the tiled transpose of
  // ops/cuda/permute_copy.h, strided views by ATen's copy) with both weight layouts (an fp32 grad_weight goes
  // through a workspace and a transposing copy unless the weight is channels_last); channel counts that are
  // multiples of 16 / 8 or odd (scalar loads and stores in the GEMMs).
  for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    for (auto layout : {Layout::contiguous, Layout::channels_last, Layout::strided}) {
      for (const bool weight_channels_last : {false, true}) {
        const bool odd = coin();
        const Case c{rand_int(1, 5), odd ? rand_int(16, 70) : 16 * rand_int(1, 4),
                     odd ? rand_int(16, 70) : 8 * rand_int(2, 8), 2 * rand_int(1, 8), 2 * rand_int(1, 8), 1, {4, 4},
                     {2, 2}, {1, 1}, {1, 1}, false, layout, weight_channels_last, false};
        const auto t = make_tensors(c, torch::TensorOptions().dtype(dtype).device(torch::kCUDA));
        check_case(c, t, std::string("CUDA wide k4s2p1 ") + c10::toString(dtype) + " " + c.describe());
      }
    }
  }
}

TEST(Conv2dCuda, BackwardInACudaGraphAndEachGradientAloneEqualTheEagerBackward) {
  HIERPAR_REQUIRE_CUDA();
  // With both gradients asked for, grad_input (the dual forward) and grad_weight (the dual grad_weight) run on two
  // streams (ops/cuda/side_stream.h). Checked bit for bit: the joint eager call equals each gradient alone, and the
  // backward captured in a CUDA graph and replayed on fresh values equals the eager call. The shapes keep every
  // fp32 atomic sum of the k4s2p1 GEMMs' K splits at one part (see the same test in test_conv_transpose.cpp): batch 2,
  // 16x16 -> 8x8 (K = 128 output pixels for grad_weight; 4 * C_out = 128 for grad_input).
  std::vector<Case> cases;
  for (auto layout : {Layout::contiguous, Layout::channels_last}) {
    // The discriminator's first layer (the dual of the small-C_out transposed convolution).
    cases.push_back(Case{2, 3, 64, 32, 32, 1, {4, 4}, {2, 2}, {1, 1}, {1, 1}, false, layout, false, false});
    // C_in >= 16: the dual of the k4s2p1 implicit GEMMs.
    cases.push_back(Case{2, 16, 32, 16, 16, 1, {4, 4}, {2, 2}, {1, 1}, {1, 1}, false, layout, false, false});
  }
  for (const Case& c : cases) {
    for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
      const auto t = make_tensors(c, torch::TensorOptions().dtype(dtype).device(torch::kCUDA));
      const std::string what = std::string("CUDA graph ") + c10::toString(dtype) + " " + c.describe();
      auto backward = [&](std::array<bool, 3> mask) {
        return hierpar::ops::conv2d_backward(t.grad_output, t.input, t.weight, c.stride, c.padding, c.dilation,
                                             c.groups, mask);
      };
      hierpar::testing::expect_joint_backward_deterministic(backward, {t.input, t.grad_output}, what);
    }
  }
}

// ---- the layer ---------------------------------------------------------------------------------------

torch::nn::Conv2dOptions random_options() {
  const int64_t groups = rand_int(1, 2);
  auto o = torch::nn::Conv2dOptions(groups * rand_int(1, 3), groups * rand_int(1, 3), {rand_int(1, 4), rand_int(1, 4)})
               .dilation({rand_int(1, 2), rand_int(1, 2)})
               .groups(groups)
               .bias(coin());
  switch (rand_int(0, 2)) {
    case 0: o.stride({rand_int(1, 3), rand_int(1, 3)}).padding(torch::ExpandingArray<2>({rand_int(0, 1), rand_int(0, 1)})); break;
    case 1: o.stride({rand_int(1, 3), rand_int(1, 3)}).padding(torch::kValid); break;
    default: o.padding(torch::kSame); break;  // stride 1; an even kernel pads asymmetrically
  }
  return o;
}

TEST(Conv2dLayer, StateDictAndOutputsInterchangeWithTorchNn) {
  for (int trial = 0; trial < 6; ++trial) {
    auto o = random_options();
    // Other padding modes with explicit padding: libtorch's module pads a kSame input's dims in the wrong order
    // (H's padding on W) when they differ, where Python's and hierpar's keep the size.
    if (trial == 1 || trial == 2) {
      o.padding(torch::ExpandingArray<2>({rand_int(0, 1), rand_int(0, 1)}));
      if (trial == 1) o.padding_mode(torch::kReflect);
      if (trial == 2) o.padding_mode(torch::kCircular);
    }
    torch::nn::Conv2d stock(o);
    hierpar::nn::Conv2d ours(o);
    // At least the largest dilated kernel (7).
    const auto x = random_tensor({2, o.in_channels(), rand_int(7, 11), rand_int(7, 11)}, torch::kDouble);
    std::ostringstream what;
    what << *ours;
    hierpar::testing::expect_state_interchanges(stock, ours, x, ": " + what.str());
    // Gradients through the layer equal torch::nn's.
    const auto gx_in = x.detach().requires_grad_();
    ours->forward(gx_in).pow(2).sum().backward();
    const auto sx_in = x.detach().requires_grad_();
    stock->forward(sx_in).pow(2).sum().backward();
    expect_close(gx_in.grad(), sx_in.grad(), "layer grad_input: " + what.str());
    expect_close(ours->weight.grad(), stock->weight.grad(), "layer grad_weight: " + what.str());
  }
}

TEST(Conv2dLayer, ForwardWithLeakyReluMatchesTorchNn) {
  // The discriminator's first layer (fused on CUDA) and a general one (a separate pass), forward and backward.
  for (const auto& o : {torch::nn::Conv2dOptions(3, 16, 4).stride(2).padding(1).bias(false), random_options()}) {
    torch::nn::Conv2d stock(o);
    hierpar::nn::Conv2d ours(o);
    stock->to(torch::kDouble);
    ours->to(torch::kDouble);
    hierpar::testing::copy_state(stock, ours);
    const auto x = random_tensor({2, o.in_channels(), rand_int(7, 11), rand_int(7, 11)}, torch::kDouble);
    const auto ours_x = x.detach().requires_grad_(), stock_x = x.detach().requires_grad_();
    const auto y = ours->forward_with_leaky_relu(ours_x, 0.2);
    const auto expected = torch::leaky_relu(stock->forward(stock_x), 0.2);
    expect_close(y, expected, "forward_with_leaky_relu");
    const auto grad = random_tensor(y.sizes(), torch::kDouble);
    y.backward(grad);
    expected.backward(grad);
    expect_close(ours_x.grad(), stock_x.grad(), "forward_with_leaky_relu grad_input");
    expect_close(ours->weight.grad(), stock->weight.grad(), "forward_with_leaky_relu grad_weight");
  }
}

TEST(Conv2dLayer, InitialisationFollowsTorchNn) {
  hierpar::nn::Conv2d layer(torch::nn::Conv2dOptions(16, 24, 3).groups(2));
  // fan_in of a weight [out, in/groups, kH, kW] is in/groups * kH * kW.
  hierpar::testing::expect_kaiming_uniform_init(layer->weight, layer->bias, {24, 8, 3, 3}, 8.0 * 9.0);
}

TEST(Conv2dLayer, PrettyPrintAndOptionChecks) {
  hierpar::nn::Conv2d layer(torch::nn::Conv2dOptions(3, 64, 4).stride(2).padding(1).bias(false));
  std::ostringstream os;
  os << *layer;
  EXPECT_EQ(os.str(), "hierpar::nn::Conv2d(3, 64, kernel_size=[4, 4], stride=[2, 2], padding=[1, 1], bias=false)");
  HIERPAR_EXPECT_THROW_MSG(hierpar::nn::Conv2d(torch::nn::Conv2dOptions(2, 2, 3).stride(2).padding(torch::kSame)),
                           "padding kSame is not supported for strided convolutions");
  HIERPAR_EXPECT_THROW_MSG(hierpar::nn::Conv2d(torch::nn::Conv2dOptions(3, 2, 3).groups(2)),
                           "in_channels must be divisible by groups");
}

}  // namespace
