// hierpar::max_pool2d and its gather backward against ATen (at::max_pool2d_with_indices and its backward, in
// float64 on the CPU), on shapes and parameters drawn fresh each run.
//
// Tolerances: the forward is a selection, so outputs must equal ATen's exactly and the decoded indices must
// name the same element. The backward sums at most kernel-area gradients per element in float32 (the opmath of
// every dtype but float64), so beside tolerance_for(dtype) each of those additions may round by a unit of float32
// at the scale of the gradients (grad_input_tolerance).
#include "testing.h"

#include "hierpar/nn/max_pool.h"
#include "hierpar/ops.h"

#include <limits>
#include <sstream>

namespace {

using namespace hierpar::testing;
namespace ops = hierpar::ops;  // qualified: at::max_pool2d is found by ADL too

const Tolerance kExact{0, 0};
const c10::ScalarType kAllDtypes[] = {torch::kDouble, torch::kFloat, torch::kBFloat16, torch::kHalf};
const Layout kAllLayouts[] = {Layout::contiguous, Layout::channels_last, Layout::strided};

struct PoolCase {
  std::vector<int64_t> shape;  // 4-d (N, C, H, W) or 3-d (C, H, W)
  std::vector<int64_t> kernel, stride, padding, dilation;  // stride may be empty (= kernel)
  bool ceil_mode = false;

  int64_t height() const { return shape[shape.size() - 2]; }
  int64_t width() const { return shape.back(); }
  std::string describe() const {
    std::ostringstream s;
    s << "input " << c10::IntArrayRef(shape) << " kernel " << c10::IntArrayRef(kernel) << " stride "
      << c10::IntArrayRef(stride) << " padding " << c10::IntArrayRef(padding) << " dilation "
      << c10::IntArrayRef(dilation) << " ceil_mode " << ceil_mode << " (seed " << run_seed() << ")";
    return s.str();
  }
};

// relu: max_pool2d(relu(x)) in one pass.
std::tuple<torch::Tensor, torch::Tensor> pool(const torch::Tensor& x, const PoolCase& c, bool relu = false) {
  return ops::max_pool2d(x, c.kernel, c.stride, c.padding, c.dilation, c.ceil_mode, relu);
}
// ATen's max_pool2d, of relu(x) with relu.
torch::Tensor aten_pool(const torch::Tensor& x, const PoolCase& c, bool relu) {
  return at::max_pool2d(relu ? at::relu(x) : x, c.kernel, c.stride, c.padding, c.dilation, c.ceil_mode);
}
torch::Tensor pool_backward(const torch::Tensor& grad_output, const torch::Tensor& indices, const PoolCase& c) {
  return ops::max_pool2d_backward(grad_output, indices, c.shape, c.kernel, c.stride, c.padding, c.dilation, c.ceil_mode);
}

// Random pooling parameters and a shape they fit. Windows lying entirely in the padding are redrawn: ATen's
// index for them points outside the window (its backward would write out of bounds); hierpar's behaviour
// there has its own test.
PoolCase random_case(int64_t max_kernel = 4) {
  for (;;) {
    PoolCase c;
    const int64_t kh = rand_int(1, max_kernel), kw = rand_int(1, max_kernel);
    c.kernel = {kh, kw};
    if (rand_int(0, 3) > 0) c.stride = {rand_int(1, 3), rand_int(1, 3)};
    c.padding = {rand_int(0, kh / 2), rand_int(0, kw / 2)};
    c.dilation = {rand_int(1, 2), rand_int(1, 2)};
    c.ceil_mode = coin();
    const int64_t span_h = c.dilation[0] * (kh - 1) + 1, span_w = c.dilation[1] * (kw - 1) + 1;
    const int64_t h = rand_int(std::max<int64_t>(1, span_h - 2 * c.padding[0]), span_h + 11);
    const int64_t w = rand_int(std::max<int64_t>(1, span_w - 2 * c.padding[1]), span_w + 11);
    const int64_t channels = rand_int(1, 5);
    c.shape = rand_int(0, 5) == 0 ? std::vector<int64_t>{channels, h, w}
                                  : std::vector<int64_t>{rand_int(1, 3), channels, h, w};
    auto probe = at::max_pool2d(torch::ones({1, 1, h, w}, torch::kDouble), c.kernel, c.stride, c.padding,
                                c.dilation, c.ceil_mode);
    if (!probe.isinf().any().item<bool>()) return c;
  }
}

// ATen's flat (h * W + w) index of the element each of hierpar's uint8 window offsets names.
torch::Tensor decode_indices(const torch::Tensor& indices, const PoolCase& c) {
  const int64_t kw = c.kernel[1];
  const int64_t sh = c.stride.empty() ? c.kernel[0] : c.stride[0], sw = c.stride.empty() ? c.kernel[1] : c.stride[1];
  const auto tap = indices.to(torch::kCPU, torch::kLong);
  const int64_t out_h = tap.size(-2), out_w = tap.size(-1);
  auto ih = torch::arange(out_h, torch::kLong).mul(sh).sub(c.padding[0]).view({out_h, 1}) +
            tap.div(kw, "floor").mul(c.dilation[0]);
  auto iw = torch::arange(out_w, torch::kLong).mul(sw).sub(c.padding[1]) + tap.remainder(kw).mul(c.dilation[1]);
  return ih * c.width() + iw;
}

struct AtenResult {
  torch::Tensor output, indices;
};
AtenResult aten_forward(const torch::Tensor& input, const PoolCase& c) {
  auto [out, idx] = at::max_pool2d_with_indices(input.detach().to(torch::kCPU, torch::kDouble), c.kernel, c.stride,
                                                c.padding, c.dilation, c.ceil_mode);
  return {out, idx};
}
torch::Tensor aten_backward(const torch::Tensor& grad_output, const torch::Tensor& input, const AtenResult& ref,
                            const PoolCase& c) {
  return at::max_pool2d_with_indices_backward(grad_output.detach().to(torch::kCPU, torch::kDouble),
                                              input.detach().to(torch::kCPU, torch::kDouble), c.kernel, c.stride,
                                              c.padding, c.dilation, c.ceil_mode, ref.indices);
}

// grad_input's tolerance: tolerance_for(dtype), and for the float32 sums of up to kernel-area gradients one unit of
// float32 per addition at the gradients' scale (with stride 1 and a 16x12 window an element sums up to 192 of them,
// which cancel to a value far below their scale: 2.8e-6 off at -0.101, seed 999587833).
Tolerance grad_input_tolerance(c10::ScalarType dtype, const PoolCase& c, const torch::Tensor& grad_output) {
  Tolerance tol = tolerance_for(dtype);
  if (dtype == torch::kDouble) return tol;
  const double area = static_cast<double>(c.kernel[0] * c.kernel.back());
  tol.atol += area * std::numeric_limits<float>::epsilon() * grad_output.abs().max().item<double>();
  return tol;
}

// Forward (values, decoded indices, layout) and backward of hierpar against ATen for one input.
void check_against_aten(const torch::Tensor& input, const PoolCase& c, const std::string& what) {
  SCOPED_TRACE(what + ": " + c.describe());
  auto [out, idx] = pool(input, c);
  const auto ref = aten_forward(input, c);
  EXPECT_EQ(out.scalar_type(), input.scalar_type());
  EXPECT_EQ(out.device(), input.device());
  ASSERT_EQ(idx.scalar_type(), torch::kByte);
  expect_close(out, ref.output, kExact, what + " output");
  ASSERT_EQ(idx.sizes(), ref.indices.sizes());
  EXPECT_TRUE(decode_indices(idx, c).equal(ref.indices)) << what << ": indices name other elements than ATen's";
  if (input.dim() == 4 && input.is_contiguous(torch::MemoryFormat::ChannelsLast)) {
    EXPECT_TRUE(out.is_contiguous(torch::MemoryFormat::ChannelsLast)) << what << ": output left channels_last";
  }

  const auto grad_output = random_tensor(out.sizes(), input.options(), coin() ? Layout::contiguous : Layout::strided);
  auto grad_input = pool_backward(grad_output, idx, c);
  EXPECT_EQ(grad_input.sizes(), input.sizes());
  EXPECT_EQ(grad_input.scalar_type(), input.scalar_type());
  expect_close(grad_input, aten_backward(grad_output, input, ref, c),
               grad_input_tolerance(input.scalar_type(), c, grad_output), what + " grad_input");
}

TEST(MaxPool, ForwardBackwardMatchAtenOnCpu) {
  for (int trial = 0; trial < 10; ++trial) {
    const auto c = random_case();
    for (auto dtype : kAllDtypes) {
      for (auto layout : kAllLayouts) {
        check_against_aten(random_tensor(c.shape, torch::TensorOptions().dtype(dtype), layout), c,
                           std::string(c10::toString(dtype)) + " " + to_string(layout));
      }
    }
  }
}

TEST(MaxPool, LargeWindowsUpTo16x16) {
  for (int trial = 0; trial < 3; ++trial) {
    const auto c = random_case(16);
    for (auto layout : {Layout::contiguous, Layout::channels_last}) {
      check_against_aten(random_tensor(c.shape, torch::kFloat, layout), c, to_string(layout));
    }
  }
  // Offset 255 (the last element of a 16x16 window) must survive the uint8 round trip.
  PoolCase c{{1, 2, 16, 17}, {16, 16}, {1, 1}, {0, 0}, {1, 1}, false};
  auto x = random_tensor(c.shape, torch::kFloat);
  x.select(2, 15).select(2, 15).fill_(7.0);
  auto [out, idx] = pool(x, c);
  EXPECT_EQ(idx[0][0][0][0].item<int>(), 255);
  check_against_aten(x, c, "16x16 with the maximum in the last tap");
}

TEST(MaxPool, NanPropagatesAndIsChosenLikeAten) {
  for (int trial = 0; trial < 6; ++trial) {
    const auto c = random_case();
    for (auto dtype : kAllDtypes) {
      auto x = random_tensor(c.shape, torch::TensorOptions().dtype(dtype), trial % 2 ? Layout::channels_last
                                                                                     : Layout::contiguous);
      // Dense enough that some windows hold several NaNs (ATen keeps the last one).
      x.masked_fill_(torch::rand(c.shape) < 0.2, std::numeric_limits<double>::quiet_NaN());
      check_against_aten(x, c, std::string("NaN ") + c10::toString(dtype));
    }
  }
}

TEST(MaxPool, TiesPickTheFirstMaximumLikeAten) {
  const auto levels = torch::tensor({-std::numeric_limits<double>::infinity(), -0.5, 0.25, 1.0}, torch::kDouble);
  for (int trial = 0; trial < 6; ++trial) {
    const auto c = random_case();
    // Few distinct values: most windows tie; windows of only -inf keep their first valid element, as in ATen.
    const auto x = levels.index({torch::randint(0, 4, c.shape, torch::kLong)});
    for (auto dtype : kAllDtypes) {
      for (auto layout : {Layout::contiguous, Layout::channels_last}) {
        auto xd = x.to(dtype);
        if (layout == Layout::channels_last && xd.dim() == 4) xd = xd.contiguous(torch::MemoryFormat::ChannelsLast);
        check_against_aten(xd, c, std::string("ties ") + c10::toString(dtype) + " " + to_string(layout));
      }
    }
  }
}

// A window lying entirely in the padding (possible with dilation): -inf like ATen, and its gradient goes
// nowhere (its index points into the padding, which no input element matches).
TEST(MaxPool, WindowEntirelyInPaddingGivesMinusInfinityAndNoGradient) {
  PoolCase c{{2, 3, 4, 5}, {2, 1}, {1, 1}, {1, 0}, {5, 1}, false};
  for (auto layout : {Layout::contiguous, Layout::channels_last}) {
    const auto x = random_tensor(c.shape, torch::kFloat, layout);
    auto [out, idx] = pool(x, c);
    expect_close(out, aten_forward(x, c).output, kExact, "output");
    EXPECT_TRUE(out.isneginf().all().item<bool>());
    auto grad_input = pool_backward(random_tensor(out.sizes(), torch::kFloat), idx, c);
    expect_close(grad_input, torch::zeros(c.shape), kExact, "grad_input");
  }
}

// An offset that names no element of its window (indices max_pool2d did not make) sends that window's gradient
// nowhere, on either CPU route (the ATen route hands such indices to the reference).
TEST(MaxPool, BackwardIgnoresOffsetsOutsideTheWindow) {
  PoolCase c{{2, 3, 6, 6}, {2, 2}, {2, 2}, {0, 0}, {1, 1}, false};
  const auto x = random_tensor(c.shape, torch::kFloat);
  auto [out, idx] = pool(x, c);
  const auto grad_output = random_tensor(out.sizes(), torch::kFloat);
  auto expected = pool_backward(grad_output, idx, c);
  const int64_t flat = decode_indices(idx, c)[1][2][1][0].item<int64_t>();
  expected[1][2][flat / 6][flat % 6] = 0;
  auto bad = idx.clone();
  bad[1][2][1][0] = 200;  // a 2x2 window has offsets 0-3
  expect_close(pool_backward(grad_output, bad, c), expected, kExact, "grad_input");
}

TEST(MaxPool, AutogradMatchesAten) {
  for (int trial = 0; trial < 6; ++trial) {
    const auto c = random_case();
    for (auto dtype : kAllDtypes) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " " + c.describe());
      auto x = random_tensor(c.shape, torch::TensorOptions().dtype(dtype), kAllLayouts[trial % 3]).requires_grad_();
      auto [out, idx] = pool(x, c);
      EXPECT_TRUE(out.requires_grad());
      EXPECT_FALSE(idx.requires_grad());
      const auto g = random_tensor(out.sizes(), torch::TensorOptions().dtype(dtype));
      out.backward(g);
      const auto ref = aten_forward(x, c);
      expect_close(x.grad(), aten_backward(g, x, ref, c), "input.grad");
    }
  }
}

// torch::autograd has no C++ gradcheck: central differences of sum(w * ops::max_pool2d(x)) in double, plain and with
// relu.
TEST(MaxPool, FiniteDifferenceGradcheckInDouble) {
  for (int trial = 0; trial < 8; ++trial) {
    const bool relu = trial % 2 == 1;
    auto c = random_case();
    c.shape[c.shape.size() - 3] = std::min<int64_t>(c.shape[c.shape.size() - 3], 2);
    SCOPED_TRACE(c.describe() + (relu ? " relu" : ""));
    const auto x = random_tensor(c.shape, torch::kDouble, kAllLayouts[trial % 3]).requires_grad_();
    const auto out = std::get<0>(pool(x, c, relu));
    const auto w = random_tensor(out.sizes(), torch::kDouble);
    const auto analytic = torch::autograd::grad({(out * w).sum()}, {x})[0];

    const double eps = 1e-6;
    auto base = x.detach().contiguous();
    auto numeric = torch::empty_like(base);
    auto loss_at = [&](const torch::Tensor& t) { return (std::get<0>(pool(t, c, relu)) * w).sum().item<double>(); };
    for (int64_t i = 0; i < base.numel(); ++i) {
      auto plus = base.clone(), minus = base.clone();
      plus.view(-1)[i] += eps;
      minus.view(-1)[i] -= eps;
      numeric.view(-1)[i] = (loss_at(plus) - loss_at(minus)) / (2 * eps);
    }
    // Central differences of a piecewise-linear function: exact up to rounding (~1e-16 / eps).
    expect_close(analytic, numeric, Tolerance{1e-7, 1e-8}, "gradient vs finite differences");
  }
}

TEST(MaxPool, DoubleBackwardMatchesAten) {
  for (int trial = 0; trial < 8; ++trial) {
    const bool relu = trial % 2 == 1;
    const auto c = random_case();
    SCOPED_TRACE(c.describe() + (relu ? " relu" : ""));
    const auto x = random_tensor(c.shape, torch::kDouble, kAllLayouts[trial % 3]).requires_grad_();
    const auto x_ref = x.detach().clone().requires_grad_();
    const auto out = std::get<0>(pool(x, c, relu));
    const auto out_ref = aten_pool(x_ref, c, relu);
    const auto go = random_tensor(out.sizes(), torch::kDouble).requires_grad_();
    const auto go_ref = go.detach().clone().requires_grad_();
    const auto v = random_tensor(c.shape, torch::kDouble);
    const auto gi = torch::autograd::grad({out}, {x}, {go}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    const auto gi_ref = torch::autograd::grad({out_ref}, {x_ref}, {go_ref}, true, true)[0];
    expect_close(gi, gi_ref, "grad_input");
    const auto ggo = torch::autograd::grad({(gi * v).sum()}, {go})[0];
    const auto ggo_ref = torch::autograd::grad({(gi_ref * v).sum()}, {go_ref})[0];
    expect_close(ggo, ggo_ref, "grad of grad_input w.r.t. grad_output");
  }
}

// ---- relu: max_pool2d(relu(x)) in one pass -------------------------------------------------------------------

// Inputs around 0 (plain, with NaNs, or few levels with exact zeros and ties) in `layout`.
torch::Tensor relu_input(const PoolCase& c, c10::ScalarType dtype, Layout layout, int kind) {
  auto x = random_tensor(c.shape, torch::TensorOptions().dtype(dtype), layout);
  if (kind == 1) x.masked_fill_(torch::rand(c.shape) < 0.1, std::numeric_limits<double>::quiet_NaN());
  if (kind == 2) {
    const auto levels = torch::tensor({-std::numeric_limits<double>::infinity(), -0.5, -0.0, 0.0, 0.25}, torch::kDouble);
    auto tied = levels.index({torch::randint(0, 5, c.shape, torch::kLong)}).to(dtype);
    if (layout == Layout::channels_last && tied.dim() == 4) tied = tied.contiguous(torch::MemoryFormat::ChannelsLast);
    x = tied;
  }
  return x;
}

// The fused pool against ATen's relu then max_pool2d (float64, CPU) for one input: the output exactly; index 255
// exactly where ATen's output is 0 (the window's maximum was <= 0), ATen's element elsewhere; the input's gradient
// through autograd.
void check_relu_against_aten(const torch::Tensor& input, const PoolCase& c, const std::string& what) {
  SCOPED_TRACE(what + ": " + c.describe());
  const auto x = input.detach().requires_grad_();
  auto [out, idx] = pool(x, c, /*relu=*/true);
  const auto x_ref = input.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
  auto [out_ref, idx_ref] = at::max_pool2d_with_indices(at::relu(x_ref), c.kernel, c.stride, c.padding, c.dilation,
                                                        c.ceil_mode);
  expect_close(out, out_ref.detach(), kExact, what + " output");
  ASSERT_EQ(idx.scalar_type(), torch::kByte);
  const auto none = out_ref.detach().le(0);
  EXPECT_TRUE(idx.cpu().eq(255).equal(none)) << what << ": index 255 must mark exactly the windows whose maximum is <= 0";
  EXPECT_TRUE(decode_indices(idx, c).masked_fill(none, 0).equal(idx_ref.masked_fill(none, 0)))
      << what << ": indices name other elements than ATen's";
  const auto g = random_tensor(out.sizes(), input.options());
  out.backward(g);
  out_ref.backward(g.to(torch::kCPU, torch::kDouble));
  expect_close(x.grad(), x_ref.grad(), what + " input.grad");
}

TEST(MaxPool, ReluFusedMatchesAtenReluThenPoolOnCpu) {
  for (int trial = 0; trial < 9; ++trial) {
    const auto c = random_case();
    for (auto dtype : kAllDtypes) {
      for (auto layout : kAllLayouts) {
        check_relu_against_aten(relu_input(c, dtype, layout, trial % 3), c,
                                std::string("relu ") + c10::toString(dtype) + " " + to_string(layout));
      }
    }
  }
  // The 2x2 stride-2 tiling of the seed CNN, NCHW and channels_last.
  PoolCase cnn{{rand_int(1, 4), 10, 26, 26}, {2, 2}, {}, {0, 0}, {1, 1}, false};
  for (auto layout : {Layout::contiguous, Layout::channels_last}) {
    check_relu_against_aten(relu_input(cnn, torch::kFloat, layout, 0), cnn, std::string("relu CNN pool ") + to_string(layout));
  }
}

TEST(MaxPool, MetaKernelsGiveShapesDtypesAndLayouts) {
  for (int trial = 0; trial < 8; ++trial) {
    const auto c = random_case(6);
    SCOPED_TRACE(c.describe());
    for (auto layout : {Layout::contiguous, Layout::channels_last}) {
      auto x = torch::empty(c.shape, torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kMeta));
      if (layout == Layout::channels_last && x.dim() == 4) x = x.contiguous(torch::MemoryFormat::ChannelsLast);
      auto [out, idx] = pool(x, c);
      const auto reference = aten_forward(torch::ones(c.shape, torch::kDouble), c).output;
      const auto expected = reference.sizes();
      EXPECT_TRUE(out.is_meta());
      EXPECT_EQ(out.sizes(), expected);
      EXPECT_EQ(idx.sizes(), expected);
      EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
      EXPECT_EQ(idx.scalar_type(), torch::kByte);
      if (x.dim() == 4 && layout == Layout::channels_last && c.shape[1] > 1) {
        EXPECT_TRUE(out.is_contiguous(torch::MemoryFormat::ChannelsLast));
        EXPECT_TRUE(idx.is_contiguous(torch::MemoryFormat::ChannelsLast));
      }
      auto grad_input = pool_backward(torch::empty_like(out), idx, c);
      EXPECT_TRUE(grad_input.is_meta());
      EXPECT_EQ(grad_input.sizes(), x.sizes());
      EXPECT_EQ(grad_input.scalar_type(), torch::kBFloat16);
    }
  }
}

TEST(MaxPool, EmptyBatchGivesEmptyOutputs) {
  const auto x = torch::empty({0, 3, 8, 8});
  auto [out, idx] = ops::max_pool2d(x, {2, 2});
  EXPECT_EQ(out.sizes(), torch::IntArrayRef({0, 3, 4, 4}));
  EXPECT_EQ(pool_backward(out, idx, PoolCase{{0, 3, 8, 8}, {2, 2}, {}, {0, 0}, {1, 1}, false}).sizes(), x.sizes());
}

TEST(MaxPool, BadInputsAreRejectedWithMessagesNamingTheArgument) {
  const auto x = random_tensor({2, 3, 8, 8}, torch::kFloat);
  HIERPAR_EXPECT_THROW_MSG(ops::max_pool2d(random_tensor({3, 8}, torch::kFloat), {2, 2}),
                           "expected input of 3 (C, H, W) or 4 (N, C, H, W) dimensions, got 2");
  HIERPAR_EXPECT_THROW_MSG(ops::max_pool2d(torch::empty({2, 0, 8, 8}), {2, 2}),
                           "input must have non-zero channels, height and width");
  HIERPAR_EXPECT_THROW_MSG(ops::max_pool2d(x.to(torch::kLong), {2, 2}),
                           "input must be float32, float64, float16 or bfloat16, got Long");
  HIERPAR_EXPECT_THROW_MSG(ops::max_pool2d(x, {2, 2, 2}), "kernel_size must be a single int or a pair of ints");
  HIERPAR_EXPECT_THROW_MSG(ops::max_pool2d(x, {0, 2}), "kernel_size must be positive");
  HIERPAR_EXPECT_THROW_MSG(ops::max_pool2d(x, {2, 2}, {2, 0}), "stride must be positive");
  HIERPAR_EXPECT_THROW_MSG(ops::max_pool2d(x, {2, 2}, {}, {0, 0}, {1, 0}), "dilation must be positive");
  HIERPAR_EXPECT_THROW_MSG(ops::max_pool2d(x, {2, 2}, {}, {-1, 0}), "padding must be non-negative");
  HIERPAR_EXPECT_THROW_MSG(ops::max_pool2d(x, {3, 3}, {}, {2, 2}), "padding must be at most half of kernel_size");
  HIERPAR_EXPECT_THROW_MSG(ops::max_pool2d(random_tensor({1, 1, 20, 20}, torch::kFloat), {17, 16}),
                           "the uint8 indices address at most 256");
  HIERPAR_EXPECT_THROW_MSG(ops::max_pool2d(random_tensor({1, 1, 20, 20}, torch::kFloat), {16, 16}, {}, {0, 0}, {1, 1},
                                           false, /*relu=*/true),
                           "with relu, kernel_size [16, 16] has 256 elements per window; at most 255");
  HIERPAR_EXPECT_THROW_MSG(ops::max_pool2d(x, {9, 2}), "larger than the padded input");
  HIERPAR_EXPECT_THROW_MSG(ops::max_pool2d(x, {3, 3}, {1, 1}, {0, 0}, {4, 4}), "larger than the padded input");
  HIERPAR_EXPECT_THROW_MSG(hierpar::nn::MaxPool2d(torch::nn::MaxPool2dOptions(2))(random_tensor({8}, torch::kFloat)),
                           "expected input of 3 (C, H, W) or 4 (N, C, H, W) dimensions, got 1");

  PoolCase c{{2, 3, 8, 8}, {2, 2}, {2, 2}, {0, 0}, {1, 1}, false};
  auto [out, idx] = pool(x, c);
  HIERPAR_EXPECT_THROW_MSG(pool_backward(out, idx.to(torch::kLong), c), "indices must be uint8");
  HIERPAR_EXPECT_THROW_MSG(pool_backward(out.to(torch::kInt), idx, c),
                           "grad_output must be float32, float64, float16 or bfloat16, got Int");
  HIERPAR_EXPECT_THROW_MSG(pool_backward(out.narrow(3, 0, 3), idx, c), "grad_output must have sizes [2, 3, 4, 4]");
  HIERPAR_EXPECT_THROW_MSG(pool_backward(out, idx.narrow(2, 0, 3), c), "indices must have sizes [2, 3, 4, 4]");
  HIERPAR_EXPECT_THROW_MSG(ops::max_pool2d_backward(out, idx, {8, 8}, {2, 2}, {2, 2}, {0, 0}, {1, 1}, false),
                           "expected input_size of 3 (C, H, W) or 4 (N, C, H, W) dimensions, got 2");
  HIERPAR_EXPECT_THROW_MSG(pool_backward(out, idx.to(torch::kMeta), c), "must be on the same device");
  if (cuda_available()) {
    HIERPAR_EXPECT_THROW_MSG(pool_backward(out.cuda(), idx, c), "must be on the same device");
  }
}

TEST(MaxPool, LayerMatchesTorchNnMaxPool2d) {
  for (int trial = 0; trial < 4; ++trial) {
    const auto c = random_case();
    auto options = torch::nn::MaxPool2dOptions({c.kernel[0], c.kernel[1]})
                       .padding({c.padding[0], c.padding[1]})
                       .dilation({c.dilation[0], c.dilation[1]})
                       .ceil_mode(c.ceil_mode);
    if (!c.stride.empty()) options.stride({c.stride[0], c.stride[1]});
    hierpar::nn::MaxPool2d ours(options);
    torch::nn::MaxPool2d stock(options);
    SCOPED_TRACE(c.describe());
    const auto x = random_tensor(c.shape, torch::kFloat, kAllLayouts[trial % 3]).requires_grad_();
    const auto x_stock = x.detach().clone().requires_grad_();
    const auto y = ours(x), y_stock = stock(x_stock);
    expect_close(y, y_stock, kExact, "layer output");
    const auto g = random_tensor(y.sizes(), torch::kFloat);
    y.backward(g);
    y_stock.backward(g);
    expect_close(x.grad(), x_stock.grad(), "layer input.grad");
  }
  // forward_relu: stock's relu then pool, in one kernel.
  hierpar::nn::MaxPool2d ours(torch::nn::MaxPool2dOptions(2));
  torch::nn::MaxPool2d stock(torch::nn::MaxPool2dOptions(2));
  const auto x = random_tensor({3, 10, 26, 26}, torch::kFloat).requires_grad_();
  const auto x_stock = x.detach().clone().requires_grad_();
  const auto y = ours->forward_relu(x), y_stock = stock(torch::relu(x_stock));
  expect_close(y, y_stock, kExact, "forward_relu output");
  const auto g = random_tensor(y.sizes(), torch::kFloat);
  y.backward(g);
  y_stock.backward(g);
  expect_close(x.grad(), x_stock.grad(), kExact, "forward_relu input.grad");

  std::ostringstream printed;
  printed << *hierpar::nn::MaxPool2d(torch::nn::MaxPool2dOptions(3).stride(2).padding(1));
  EXPECT_EQ(printed.str(),
            "hierpar::nn::MaxPool2d(kernel_size=[3, 3], stride=[2, 2], padding=[1, 1], dilation=[1, 1], "
            "ceil_mode=false)");
}

// ---- CUDA ----------------------------------------------------------------------------------------------------

// CUDA against ATen (float64, CPU) and against hierpar's CPU kernels for one input.
void check_cuda(const torch::Tensor& input_cpu, const PoolCase& c, const std::string& what) {
  SCOPED_TRACE(what + ": " + c.describe());
  const auto input = input_cpu.cuda();
  check_against_aten(input, c, what + " CUDA");
  auto [out, idx] = pool(input, c);
  auto [out_cpu, idx_cpu] = pool(input_cpu, c);
  expect_close(out, out_cpu, kExact, what + " CUDA output vs CPU");
  EXPECT_TRUE(idx.cpu().equal(idx_cpu)) << what << ": CUDA indices differ from CPU";
  const auto g = random_tensor(out.sizes(), input_cpu.options());
  expect_close(pool_backward(g.cuda(), idx, c), pool_backward(g, idx_cpu, c), what + " CUDA grad_input vs CPU");
}

TEST(MaxPool, CudaMatchesAtenAndCpu) {
  HIERPAR_REQUIRE_CUDA();
  for (int trial = 0; trial < 8; ++trial) {
    const auto c = random_case(trial == 0 ? 16 : 4);
    for (auto dtype : kAllDtypes) {
      for (auto layout : kAllLayouts) {
        auto x = random_tensor(c.shape, torch::TensorOptions().dtype(dtype), layout);
        if (trial % 2) x.masked_fill_(torch::rand(c.shape) < 0.05, std::numeric_limits<double>::quiet_NaN());
        check_cuda(x, c, std::string(c10::toString(dtype)) + " " + to_string(layout));
      }
    }
  }
}

// Shapes that take the 2x2 stride-2 fast paths (and their neighbours that must not), with NaNs and ties.
TEST(MaxPool, CudaTwoByTwoFastPathsMatchAten) {
  HIERPAR_REQUIRE_CUDA();
  const auto levels = torch::tensor({-std::numeric_limits<double>::infinity(), -0.5, 0.25, 1.0}, torch::kDouble);
  for (int trial = 0; trial < 6; ++trial) {
    // Widths a multiple of 8 (NCHW fast path) and channel counts a multiple of 8 (channels_last), or not.
    const int64_t n = rand_int(1, 3), ch = 8 * rand_int(1, 4) + (trial % 3 == 2 ? rand_int(1, 7) : 0);
    const int64_t h = 2 * rand_int(1, 12) + (trial == 5 ? 1 : 0), w = 8 * rand_int(1, 6) + (trial % 3 == 1 ? 2 : 0);
    PoolCase c{{n, ch, h, w}, {2, 2}, {}, {0, 0}, {1, 1}, trial == 5};
    for (auto dtype : kAllDtypes) {
      for (auto layout : {Layout::contiguous, Layout::channels_last}) {
        const std::string what = std::string("2x2 ") + c10::toString(dtype) + " " + to_string(layout);
        auto x = random_tensor(c.shape, torch::TensorOptions().dtype(dtype), layout);
        x.masked_fill_(torch::rand(c.shape) < 0.02, std::numeric_limits<double>::quiet_NaN());
        check_cuda(x, c, what);
        auto ties = levels.index({torch::randint(0, 4, c.shape, torch::kLong)}).to(dtype);
        if (layout == Layout::channels_last) ties = ties.contiguous(torch::MemoryFormat::ChannelsLast);
        check_cuda(ties, c, what + " ties");
      }
    }
    // Contiguous inputs starting 1 or 2 fp32 elements past a 16-byte boundary: the 4-window NCHW kernel must
    // not take them (the 1-window one may take the 8-byte aligned one).
    for (int64_t shift : {1, 2}) {
      const auto flat =
          random_tensor({n * ch * h * w + shift}, torch::TensorOptions(torch::kFloat).device(torch::kCUDA));
      const auto misaligned = flat.narrow(0, shift, n * ch * h * w).view(c.shape);
      ASSERT_NE(reinterpret_cast<uintptr_t>(misaligned.data_ptr()) % 16, 0u);
      check_against_aten(misaligned, c, "2x2 fp32 shifted by " + std::to_string(shift));
    }
  }
}

TEST(MaxPool, CudaAutogradAndDoubleBackwardMatchAten) {
  HIERPAR_REQUIRE_CUDA();
  for (int trial = 0; trial < 3; ++trial) {
    const auto c = random_case();
    SCOPED_TRACE(c.describe());
    const auto x = random_tensor(c.shape, torch::kDouble, kAllLayouts[trial]).cuda().requires_grad_();
    const auto x_ref = x.detach().cpu().requires_grad_();
    const auto out = std::get<0>(pool(x, c));
    const auto out_ref = at::max_pool2d(x_ref, c.kernel, c.stride, c.padding, c.dilation, c.ceil_mode);
    const auto go = random_tensor(out.sizes(), torch::kDouble).requires_grad_();
    const auto go_cuda = go.detach().cuda().requires_grad_();
    const auto gi = torch::autograd::grad({out}, {x}, {go_cuda}, true, true)[0];
    const auto gi_ref = torch::autograd::grad({out_ref}, {x_ref}, {go}, true, true)[0];
    expect_close(gi, gi_ref, "grad_input");
    const auto v = random_tensor(c.shape, torch::kDouble);
    expect_close(torch::autograd::grad({(gi * v.cuda()).sum()}, {go_cuda})[0],
                 torch::autograd::grad({(gi_ref * v).sum()}, {go})[0], "double backward");
  }
}

// The fused relu pool on CUDA: every path (general, the 2x2 NCHW and channels_last fast paths) against ATen and
// against the CPU's fused pool (same output and indices).
TEST(MaxPool, CudaReluFusedMatchesAtenAndCpu) {
  HIERPAR_REQUIRE_CUDA();
  for (int trial = 0; trial < 9; ++trial) {
    PoolCase c = random_case();
    if (trial >= 3) {  // the 2x2 tiling, widths and channels that take each fast path, or not
      const int64_t n = rand_int(1, 3), ch = 8 * rand_int(1, 4) + (trial % 3 == 2 ? rand_int(1, 7) : 0);
      const int64_t h = 2 * rand_int(1, 12), w = 8 * rand_int(1, 6) + (trial % 3 == 1 ? 2 : 0);
      c = PoolCase{{n, ch, h, w}, {2, 2}, {}, {0, 0}, {1, 1}, false};
    }
    for (auto dtype : kAllDtypes) {
      for (auto layout : kAllLayouts) {
        const std::string what = std::string("relu CUDA ") + c10::toString(dtype) + " " + to_string(layout);
        const auto x = relu_input(c, dtype, layout, trial % 3);
        check_relu_against_aten(x.cuda(), c, what);
        auto [out, idx] = pool(x.cuda(), c, /*relu=*/true);
        auto [out_cpu, idx_cpu] = pool(x, c, /*relu=*/true);
        expect_close(out, out_cpu, kExact, what + " output vs CPU");
        EXPECT_TRUE(idx.cpu().equal(idx_cpu)) << what << ": CUDA indices differ from CPU";
      }
    }
  }
}

}  // namespace
