// hierpar::conv_transpose2d, its backward and hierpar::nn::ConvTranspose2d against ATen / torch::nn.
//
// Tolerances (compared with at::conv_transpose2d in float64 on the same, already rounded, inputs; the
// absolute part is relative to the reference's largest magnitude, "the output scale", because every
// output is a sum of many products and cancellation makes elementwise-relative error meaningless near 0):
//  - float64: 1e-10 (summation order only).
//  - float32 on the CPU: 1e-5 (fp32 arithmetic, summation order).
//  - float32 on CUDA: 2e-3. TF32 tensor cores (stock's default for convolutions) round both GEMM operands to
//    a 10-bit mantissa (relative error <= 2^-11 each), so a product is off by ~1e-3 and a sum of K random-sign
//    products by ~1e-3 * sqrt(K) * |term|, i.e. ~1e-3 of the output scale; 2e-3 leaves room for the tail.
//  - bfloat16: 1e-2. The result is rounded to bf16 (2^-9 = 2e-3 relative), and on CUDA the GEMM result
//    (the column buffer) is rounded once more before the col2im sum: a few units of 2e-3.
//  - float16: 2e-3. The same two roundings at 2^-12 = 2.4e-4 each, plus fp16 output rounding.
#include "conv_testing.h"
#include "testing.h"

#include "hierpar/nn/conv_transpose.h"
#include "hierpar/ops.h"

#include <array>
#include <sstream>
#include <tuple>

namespace {

using namespace hierpar::testing;
using Results = ConvResults;

struct Case {
  int64_t batch, cin, cout, h, w, groups;
  std::vector<int64_t> kernel, stride, padding, output_padding, dilation;
  bool bias;
  Layout layout;
  bool weight_channels_last;
  bool unbatched;

  std::vector<int64_t> out_hw() const {
    std::vector<int64_t> r(2);
    const int64_t in[2] = {h, w};
    for (int i = 0; i < 2; ++i)
      r[i] = (in[i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (kernel[i] - 1) + output_padding[i] + 1;
    return r;
  }
  std::string describe() const {
    std::ostringstream os;
    os << "N=" << batch << " Cin=" << cin << " Cout=" << cout << " HxW=" << h << "x" << w << " groups=" << groups
       << " k=" << at::IntArrayRef(kernel) << " s=" << at::IntArrayRef(stride) << " p=" << at::IntArrayRef(padding)
       << " op=" << at::IntArrayRef(output_padding) << " d=" << at::IntArrayRef(dilation) << " bias=" << bias
       << " layout=" << hierpar::testing::to_string(layout) << " weight_cl=" << weight_channels_last
       << " unbatched=" << unbatched;
    return os.str();
  }
};

// A random valid case: groups, dilation, output_padding, odd sizes, batch 1, one channel, all layouts.
Case random_case() {
  Case c;
  for (;;) {
    hierpar::testing::random_conv_geometry(c, 7);
    c.output_padding = {rand_int(0, std::max(c.stride[0], c.dilation[0]) - 1),
                        rand_int(0, std::max(c.stride[1], c.dilation[1]) - 1)};
    const auto o = c.out_hw();
    if (o[0] > 0 && o[1] > 0) break;
  }
  hierpar::testing::random_conv_layouts(c);
  return c;
}

using Tensors = hierpar::testing::ConvTensors;

Tensors make_tensors(const Case& c, const torch::TensorOptions& options) {
  return hierpar::testing::make_conv_tensors(c, {c.cin, c.cout / c.groups, c.kernel[0], c.kernel[1]}, options);
}


// Forward + backward through autograd, with hierpar's op or ATen's.
Results run(const Case& c, const Tensors& t, bool aten, std::optional<torch::Dtype> as = std::nullopt) {
  auto x = autograd_leaf(t.input, as), w = autograd_leaf(t.weight, as), b = autograd_leaf(t.bias, as);
  auto y = aten ? at::conv_transpose2d(x, w, opt(b), c.stride, c.padding, c.output_padding, c.groups, c.dilation)
                : hierpar::ops::conv_transpose2d(x, w, opt(b), c.stride, c.padding, c.output_padding, c.groups,
                                                 c.dilation);
  y.backward(as ? t.grad_output.to(*as) : t.grad_output);
  return results_after_backward(y, x, w, b);
}

// hierpar's forward + backward of `c` on CUDA in `dtype` against ATen's in float64; a channels_last input keeps
// its layout through output and grad_input. Returns hierpar's results.
Results check_cuda_case(const Case& c, const Tensors& t, torch::Dtype dtype, const std::string& what) {
  const auto got = run(c, t, /*aten=*/false);
  compare(got, run(c, t, /*aten=*/true, torch::kDouble), conv_rel_tolerance(dtype, true), what);
  expect_channels_last_kept(c.layout, c.unbatched, t.input, got, what);
  return got;
}

// The backward asked for the gradients in `mask` only (grad_input, grad_weight, grad_bias).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> backward_only(const Case& c, const Tensors& t,
                                                                      std::array<bool, 3> mask) {
  return hierpar::ops::conv_transpose2d_backward(t.grad_output, t.input, t.weight, c.stride, c.padding,
                                                 c.output_padding, c.groups, c.dilation, mask);
}

// check_cuda_case on every case in every dtype (`label` starts the messages), then the test's own checks:
// more(c, t, dtype, what, got) with got hierpar's results.
template <typename More>
void check_cuda_cases_every_dtype(const std::vector<Case>& cases, const std::string& label, More&& more) {
  for (const Case& c : cases) {
    for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf, torch::kDouble}) {
      const auto t = make_tensors(c, torch::TensorOptions().dtype(dtype).device(torch::kCUDA));
      const std::string what = label + c10::toString(dtype) + " " + c.describe();
      more(c, t, dtype, what, check_cuda_case(c, t, dtype, what));
    }
  }
}

void check_random_cases(const torch::Device& device, int trials) {
  const bool cuda = device.is_cuda();
  for (int trial = 0; trial < trials; ++trial) {
    const Case c = random_case();
    for (auto dtype : {torch::kDouble, torch::kFloat, torch::kBFloat16, torch::kHalf}) {
      const auto t = make_tensors(c, torch::TensorOptions().dtype(dtype).device(device));
      const auto got = run(c, t, /*aten=*/false);
      const auto ref = run(c, t, /*aten=*/true, torch::kDouble);
      const std::string what = std::string(cuda ? "CUDA " : "CPU ") + c10::toString(dtype) + " " + c.describe();
      compare(got, ref, conv_rel_tolerance(dtype, cuda), what);
      EXPECT_EQ(got.output.device().type(), device.type()) << what;
      EXPECT_EQ(got.output.scalar_type(), dtype) << what;
      expect_channels_last_kept(c.layout, c.unbatched, t.input, got, what);
      if (cuda) {
        // The same op on the CPU, same dtype: the two backends agree within both tolerances.
        const auto cpu = run(c, to_cpu(t), /*aten=*/false);
        compare(got, cpu, conv_rel_tolerance(dtype, true) + conv_rel_tolerance(dtype, false), what + " vs CPU");
      }
    }
  }
}

TEST(ConvTransposeCpu, MatchesAtenOnRandomCasesEveryDtype) { check_random_cases(torch::kCPU, 12); }

TEST(ConvTransposeCpu, DcganLayersMatchAten) {
  // The generator's shapes (smaller batch): 1x1 -> 4x4 (k4 s1 p0) and k4 s2 p1 doublings.
  for (auto layout : {Layout::contiguous, Layout::channels_last}) {
    for (auto [cin, cout, hw, s, p] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>>{
             {10, 16, 1, 1, 0}, {16, 8, 4, 2, 1}, {8, 3, 8, 2, 1}}) {
      Case c{2, cin, cout, hw, hw, 1, {4, 4}, {s, s}, {p, p}, {0, 0}, {1, 1}, false, layout, false, false};
      const auto t = make_tensors(c, torch::kFloat);
      compare(run(c, t, false), run(c, t, true, torch::kDouble), 1e-5, "CPU " + c.describe());
    }
  }
}

// hierpar::conv_transpose2d for the checks conv_testing.h shares with test_conv2d.cpp (it has no activation).
struct ConvTranspose2dOp {
  static Case random_case() { return ::random_case(); }
  static Tensors tensors(const Case& c, const torch::TensorOptions& options) { return make_tensors(c, options); }
  static Results results(const Case& c, const Tensors& t) { return run(c, t, /*aten=*/false); }
  static torch::Tensor forward(const Case& c, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                               bool /*activation*/) {
    return hierpar::ops::conv_transpose2d(x, w, opt(b), c.stride, c.padding, c.output_padding, c.groups, c.dilation);
  }
  static torch::Tensor aten_forward(const Case& c, const torch::Tensor& x, const torch::Tensor& w,
                                    const torch::Tensor& b) {
    return at::conv_transpose2d(x, w, b, c.stride, c.padding, c.output_padding, c.groups, c.dilation);
  }
  static Gradients backward(const Case& c, const Tensors& t, std::array<bool, 3> mask) {
    return backward_only(c, t, mask);
  }
};

TEST(ConvTransposeCpu, FiniteDifferenceGradcheckInDouble) {
  expect_finite_difference_gradients_on_random_cases<ConvTranspose2dOp>();
}

TEST(ConvTransposeCpu, OutputMaskComputesOnlyWhatIsAsked) {
  expect_output_mask_respected_on_a_random_case<ConvTranspose2dOp>();
}

// Second derivatives; on a GPU hierpar's CUDA op in float32 against ATen in float64.
TEST(ConvTransposeAutograd, SecondDerivativesMatchAten) {
  expect_second_derivatives_on<ConvTranspose2dOp>(torch::kCPU);
}

TEST(ConvTransposeCuda, SecondDerivativesMatchAten) {
  HIERPAR_REQUIRE_CUDA();
  expect_second_derivatives_on<ConvTranspose2dOp>(torch::kCUDA);
}

TEST(ConvTransposeMeta, ShapesAndLayoutsMatchTheCpuKernel) {
  for (int trial = 0; trial < 10; ++trial) {
    const Case c = random_case();
    const auto t = make_tensors(c, torch::kFloat);
    auto meta = [](const torch::Tensor& x) { return x.defined() ? x.to(torch::kMeta) : x; };
    const auto y = hierpar::ops::conv_transpose2d(t.input, t.weight, opt(t.bias), c.stride, c.padding,
                                                  c.output_padding, c.groups, c.dilation);
    const auto ym = hierpar::ops::conv_transpose2d(meta(t.input), meta(t.weight), opt(meta(t.bias)), c.stride,
                                                   c.padding, c.output_padding, c.groups, c.dilation);
    EXPECT_TRUE(ym.is_meta());
    EXPECT_EQ(ym.sizes(), y.sizes()) << c.describe();
    EXPECT_EQ(ym.strides(), y.strides()) << c.describe();
    const auto g = hierpar::ops::conv_transpose2d_backward(meta(t.grad_output), meta(t.input), meta(t.weight),
                                                           c.stride, c.padding, c.output_padding, c.groups,
                                                           c.dilation, {true, true, false});
    EXPECT_EQ(std::get<0>(g).sizes(), t.input.sizes());
    EXPECT_EQ(std::get<1>(g).sizes(), t.weight.sizes());
    EXPECT_FALSE(std::get<2>(g).defined());
  }
}

// The output's memory format: channels_last when the input or the weight is (PyTorch's rule: ATen's CPU kernels
// and cudnn_conv_suggest_memory_format), including the generator's first layer (a [N, nz, 1, 1] input, whose
// layout is ambiguous, and a channels_last weight). ATen's CPU output must agree with the rule. On CUDA the rule
// is checked but not ATen's choice: at::conv_transpose2d called from this C++ binary returned NCHW for these fp32
// cases on an H200, where PyTorch from Python (same libtorch 2.11, same machine) returned channels_last.
void check_output_layouts(const torch::Device& device) {
  const auto options = torch::TensorOptions().device(device);
  for (const bool weight_cl : {false, true}) {
    for (const auto& [input_sizes, input_cl, stride, padding] :
         std::vector<std::tuple<std::vector<int64_t>, bool, int64_t, int64_t>>{
             {{3, 16, 5, 7}, false, 2, 1}, {{3, 16, 5, 7}, true, 2, 1}, {{3, 16, 1, 1}, true, 1, 0}}) {
      const auto input = random_tensor(input_sizes, options, input_cl ? Layout::channels_last : Layout::contiguous);
      const auto weight = random_tensor({16, 8, 4, 4}, options, weight_cl ? Layout::channels_last : Layout::contiguous);
      const auto expected = at::conv_transpose2d(input, weight, {}, stride, padding);
      const auto got = hierpar::ops::conv_transpose2d(input, weight, {}, {stride}, {padding}, {0}, 1, {1});
      const auto on_meta = hierpar::ops::conv_transpose2d(input.to(torch::kMeta), weight.to(torch::kMeta), {},
                                                          {stride}, {padding}, {0}, 1, {1});
      const std::string what = hierpar::testing::layout_case_what(device, input, input_cl, weight_cl);
      const bool rule = input.suggest_memory_format() == at::MemoryFormat::ChannelsLast || weight_cl;
      EXPECT_EQ(got.is_contiguous(at::MemoryFormat::ChannelsLast), rule) << what;
      if (device.is_cpu()) EXPECT_EQ(expected.is_contiguous(at::MemoryFormat::ChannelsLast), rule) << what << ": ATen";
      EXPECT_EQ(got.strides(), on_meta.strides()) << what;
      expect_close(got, expected, scaled(conv_rel_tolerance(torch::kFloat, device.is_cuda()), expected), what);
    }
  }
}

TEST(ConvTransposeCpu, OutputLayoutFollowsAten) { check_output_layouts(torch::kCPU); }

TEST(ConvTransposeCuda, OutputLayoutFollowsAten) {
  HIERPAR_REQUIRE_CUDA();
  check_output_layouts(torch::kCUDA);
}

TEST(ConvTransposeErrors, EveryBadArgumentIsNamed) {
  const auto x = random_tensor({2, 4, 5, 5}, torch::kFloat);
  const auto w = random_tensor({4, 3, 3, 3}, torch::kFloat);
  auto call = [&](const torch::Tensor& input, const torch::Tensor& weight, std::optional<torch::Tensor> bias,
                  at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef output_padding, int64_t groups,
                  at::IntArrayRef dilation) {
    return hierpar::ops::conv_transpose2d(input, weight, bias, stride, padding, output_padding, groups, dilation);
  };
  HIERPAR_EXPECT_THROW_MSG(call(x.flatten(), w, {}, {1}, {0}, {0}, 1, {1}), "input must be 3-d (unbatched) or 4-d");
  HIERPAR_EXPECT_THROW_MSG(call(x, w[0], {}, {1}, {0}, {0}, 1, {1}), "weight must be 4-d");
  HIERPAR_EXPECT_THROW_MSG(call(x.to(torch::kInt), w.to(torch::kInt), {}, {1}, {0}, {0}, 1, {1}),
                           "input must be float32, float64, bfloat16 or float16");
  HIERPAR_EXPECT_THROW_MSG(call(x, w.to(torch::kDouble), {}, {1}, {0}, {0}, 1, {1}), "weight's dtype");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, {}, {1, 1, 1}, {0}, {0}, 1, {1}), "stride must have 1 or 2 elements");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, {}, {0, 1}, {0}, {0}, 1, {1}), "stride must be positive");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, {}, {1}, {0}, {0}, 1, {1, 0}), "dilation must be positive");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, {}, {1}, {-1}, {0}, 1, {1}), "padding must be non-negative");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, {}, {2}, {0}, {-1}, 1, {1}), "output_padding must be non-negative");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, {}, {2}, {0}, {2, 0}, 1, {1}),
                           "output_padding (2) must be smaller than either stride (2) or dilation (1)");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, {}, {1}, {0}, {0}, 0, {1}), "groups must be positive");
  HIERPAR_EXPECT_THROW_MSG(call(x, random_tensor({4, 1, 3, 3}, torch::kFloat), {}, {1}, {0}, {0}, 3, {1}),
                           "groups (3) must divide the input channels (4)");
  HIERPAR_EXPECT_THROW_MSG(call(x, random_tensor({5, 3, 3, 3}, torch::kFloat), {}, {1}, {0}, {0}, 1, {1}),
                           "weight.size(0) (5) must equal the input channels (4)");
  HIERPAR_EXPECT_THROW_MSG(call(x, torch::empty({4, 3, 0, 3}), {}, {1}, {0}, {0}, 1, {1}),
                           "weight's kernel size must be positive");
  HIERPAR_EXPECT_THROW_MSG(call(torch::empty({2, 4, 0, 5}), w, {}, {1}, {0}, {0}, 1, {1}),
                           "input must have non-zero channels, height and width");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, {}, {1}, {4}, {0}, 1, {1}), "the output size [-1, -1] is not positive");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, random_tensor({4}, torch::kFloat), {1}, {0}, {0}, 1, {1}),
                           "bias must be 1-d with out_channels = weight.size(1) * groups = 3");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, random_tensor({3}, torch::kDouble), {1}, {0}, {0}, 1, {1}), "bias's dtype");
  HIERPAR_EXPECT_THROW_MSG(call(x, w, torch::empty({3}, torch::kMeta), {1}, {0}, {0}, 1, {1}), "bias is on meta");
  HIERPAR_EXPECT_THROW_MSG(call(x, w.to(torch::kMeta), {}, {1}, {0}, {0}, 1, {1}), "weight is on meta");
  // Backward: grad_output must have the forward output's shape, dtype and device.
  HIERPAR_EXPECT_THROW_MSG(hierpar::ops::conv_transpose2d_backward(random_tensor({2, 3, 6, 6}, torch::kFloat), x, w,
                                                                   {1}, {0}, {0}, 1, {1}, {true, true, true}),
                           "grad_output must have the forward output's shape [2, 3, 7, 7]");
  HIERPAR_EXPECT_THROW_MSG(hierpar::ops::conv_transpose2d_backward(random_tensor({2, 3, 7, 7}, torch::kDouble), x, w,
                                                                   {1}, {0}, {0}, 1, {1}, {true, true, true}),
                           "grad_output's dtype");
  if (hierpar::testing::cuda_available()) {
    HIERPAR_EXPECT_THROW_MSG(call(x, w.cuda(), {}, {1}, {0}, {0}, 1, {1}), "weight is on cuda:0 but input is on cpu");
    HIERPAR_EXPECT_THROW_MSG(call(x.cuda(), w.cuda(), random_tensor({3}, torch::kFloat), {1}, {0}, {0}, 1, {1}),
                             "bias is on cpu but input is on cuda:0");
  }
}

TEST(ConvTransposeCuda, MatchesAtenAndCpuOnRandomCasesEveryDtype) {
  HIERPAR_REQUIRE_CUDA();
  check_random_cases(torch::kCUDA, 16);
}

TEST(ConvTransposeCuda, DcganLayersEveryLayoutAndDtype) {
  HIERPAR_REQUIRE_CUDA();
  // Includes the direct 1x1 path (1x1 input, k4 s1 p0, no bias) and the k4 s2 p1 layers, weights in both
  // layouts, a bias on some, and a larger batch so the GEMMs take their tensor-core paths.
  for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    for (auto layout : {Layout::contiguous, Layout::channels_last}) {
      for (auto [cin, cout, hw, s, p, bias] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool>>{
               {100, 256, 1, 1, 0, false}, {100, 64, 1, 1, 0, true}, {256, 128, 4, 2, 1, false},
               {64, 32, 16, 2, 1, true}, {32, 3, 32, 2, 1, false}}) {
        Case c{8, cin, cout, hw, hw, 1, {4, 4}, {s, s}, {p, p}, {0, 0}, {1, 1}, bias, layout, coin(), false};
        const auto t = make_tensors(c, torch::TensorOptions().dtype(dtype).device(torch::kCUDA));
        compare(run(c, t, false), run(c, t, true, torch::kDouble), conv_rel_tolerance(dtype, true),
                std::string("CUDA ") + c10::toString(dtype) + " " + c.describe());
      }
    }
  }
}

TEST(ConvTransposeCuda, K4S2P1FastPathRandomShapesEveryLayoutAndDtype) {
  HIERPAR_REQUIRE_CUDA();
  // Kernel 4, stride 2, padding 1, no bias, groups 1, C_out >= 16: the phase-decomposed implicit-GEMM path
  // (ops/cuda/k4s2p1/) for fp32 (TF32 on), bf16 and fp16; float64 and 4 < C_out < 16 take the
  // general path (compared the same way).
  // Random batch (1, odd), channel counts that are and are not multiples of 8 (16-byte vector loads or the
  // scalar fallback), non-square sizes, all input layouts, both weight layouts; plus fixed shapes that cover
  // every tile width (GEMM N > 64, 33..64, 17..32, <= 16), grids large enough not to split K and small
  // ones that do (fp32 workspace), the DCGAN layers at a small batch, and grids large enough for wgmma.
  auto channels = [] { return coin() ? 8 * rand_int(2, 24) : rand_int(16, 70); };
  std::vector<Case> cases;
  for (int trial = 0; trial < 10; ++trial) {
    const int64_t batch = trial == 0 ? 1 : rand_int(1, 9);
    cases.push_back(Case{batch, channels(), channels(), rand_int(1, 9), rand_int(1, 9), 1, {4, 4}, {2, 2}, {1, 1},
                         {0, 0}, {1, 1}, false, static_cast<Layout>(rand_int(0, 2)), coin(), rand_int(0, 5) == 0});
  }
  for (auto [batch, cin, cout, hw] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>{
           {41, 32, 16, 16}, {3, 256, 128, 4}, {5, 128, 64, 8}, {2, 32, 3, 32}, {17, 100, 40, 12}, {3, 7, 17, 5},
           // Grids of >= 132 M tiles: no K split, so bf16/fp16 take the sm_90a wgmma kernel (forward and
           // grad_input) where it applies: N of 24..128 (tile widths 32, 64, 128, partly filled), K not a
           // multiple of the 64-wide K-tile (4 * 40), M not a multiple of the 128-row tile (80 * 15 * 15).
           {80, 96, 48, 15}, {72, 32, 64, 16}, {80, 40, 24, 15},
           // C_in % 64 == 0 and C_out <= 32: the all-phases forward kernel (full and partial 128-row tiles,
           // C_out padded to 32).
           {40, 64, 32, 16}, {3, 128, 24, 5}}) {
    for (auto layout : {Layout::contiguous, Layout::channels_last}) {
      cases.push_back(Case{batch, cin, cout, hw, hw, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, false, layout, coin(),
                           false});
    }
  }
  // Channels_last weights, read in place by the forward (C_out innermost, C_in a multiple of the K-tile: no
  // pack kernel) and, in fp32, by grad_input (K-major B, no weight copy): bf16/fp16 forwards on wgmma with the
  // weight as an N-major B, 128 wide (C_out 72: partial N; C_out 96) and 64 wide (C_out 48), grad_input 128 wide
  // with a partial second N tile (C_in 160, K = 256), fp32 K-major B 128 / 64 wide (C_in 160, 128, 64), and the
  // mma.sync forward reading the weight with split K (C_in 128 at batch 9: splits starting inside a tap).
  for (auto [batch, cin, cout, hw] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>{
           {33, 64, 72, 16}, {33, 128, 48, 16}, {17, 160, 16, 32}, {20, 64, 96, 16}, {9, 128, 64, 16}}) {
    for (auto layout : {Layout::contiguous, Layout::channels_last}) {
      cases.push_back(Case{batch, cin, cout, hw, hw, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, false, layout,
                           /*weight_channels_last=*/true, false});
    }
  }
  // C_out == 32, C_in % 64 == 0, channels_last: bf16/fp16 grad_input on the staged-patch kernel (8 x 16 input
  // pixels per tile): full tiles (16 x 16), partial ones in both directions and more than one tile across
  // (9 x 21, 1 x 3, 13 x 17), two 64-channel blocks (C_in 128), odd batches and batch 1.
  for (auto [batch, cin, h, w] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>{
           {5, 64, 16, 16}, {3, 128, 9, 21}, {1, 64, 1, 3}, {rand_int(1, 9), 64, 13, 17}}) {
    cases.push_back(Case{batch, cin, 32, h, w, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, false, Layout::channels_last,
                         coin(), false});
  }
  check_cuda_cases_every_dtype(cases, "CUDA k4s2p1 ", [](const Case& c, const Tensors& t, torch::Dtype dtype,
                                                         const std::string& what, const Results& got) {
    // Each gradient alone (the backward computes only what is asked for).
    const auto only_weight = backward_only(c, t, {false, true, false});
    EXPECT_FALSE(std::get<0>(only_weight).defined()) << what;
    // fp32 atomics sum the K splits in any order: equal within the dtype's tolerance, not bitwise.
    expect_close(std::get<1>(only_weight), got.grad_weight, scaled(conv_rel_tolerance(dtype, true), got.grad_weight),
                 what + " grad_weight alone");
  });
}

TEST(ConvTransposeCuda, K4S2P1WgmmaTmaLoads) {
  HIERPAR_REQUIRE_CUDA();
  // bf16/fp16 GEMMs on the wgmma kernels with TMA loads, channels_last. Forward and grad_input (grids of > 132
  // tiles, so no K split; the gathered activation's channels a multiple of 64; 128-row tiles of whole images or
  // of whole pixel rows of one image): boxes of 8, 4 and 2 whole images whose last box lies partly past the
  // batch (1057 x 4x4, 531 x 4x8, 265 x 8x8), of 8 and 2 pixel rows (16x16, 8x64) and of one 128-pixel row at
  // batch 1 (grad_input's box then traverses 256 grad_output pixels, TMA's limit); B 64 and 128 wide, as the
  // weight in place (channels_last: one or two boxes per stage) or packed per phase (NCHW weight). grad_weight
  // (C_out % 64 == 0; K-tiles of 64 input pixels): 4, 2 and 1 whole images per K-tile with the last K-tile
  // partly past the batch (1057 x 4x4: 16 pixels; 531 x 4x8: 32), 4 and 1 pixel rows (16x16, 8x64), two
  // 64-channel blocks of one tap (C_out 128) or of two taps (C_out 64) per tile; and the cp.async kernels where
  // no box fits: 12x12 images (144 pixels), and grad_weight of 128-pixel-wide images.
  for (auto [batch, cin, cout, h, w] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>>{
           {1057, 128, 64, 4, 4}, {531, 64, 64, 4, 8}, {265, 64, 64, 8, 8}, {265, 128, 128, 8, 8},
           {67, 64, 64, 16, 16}, {35, 64, 64, 8, 64}, {1, 64, 64, 136, 128}, {139, 64, 64, 12, 12}}) {
    for (bool weight_cl : {true, false}) {
      const Case c{batch, cin, cout, h, w, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, false, Layout::channels_last,
                   weight_cl, false};
      for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
        const auto t = make_tensors(c, torch::TensorOptions().dtype(dtype).device(torch::kCUDA));
        check_cuda_case(c, t, dtype, std::string("CUDA k4s2p1 TMA ") + c10::toString(dtype) + " " + c.describe());
      }
    }
  }
}

TEST(ConvTransposeCuda, K4S2P1ChannelViewsAndEveryWeightLayout) {
  HIERPAR_REQUIRE_CUDA();
  // The layout copies of the k4s2p1 path (ops/cuda/permute_copy.h: a tiled transpose where a copy permutes the
  // memory order, ATen's copy_ otherwise) and its grad_weight outputs: an fp32 grad_weight is accumulated in
  // place when the weight is channels_last, else in a workspace copied over by the transpose. Inputs and
  // grad_outputs as NCHW, channels_last, or every other channel of a twice-as-wide tensor in either layout
  // (not dense: the NCHW one still has unit stride along W, so it takes the tiled kernel with a gap between
  // channels, the channels_last one has no unit stride and takes ATen's copy); weights NCHW, channels_last or
  // every other output channel of a wider NCHW weight (its grad_weight is then dense NCHW). Channel counts
  // below, at and above the 32-element tile and odd (scalar loads and stores in the GEMMs), spatial sizes
  // of fewer and more pixels than a tile; float64 runs the general path's copies (8-byte elements).
  enum class View { nchw, channels_last, nchw_channel_slice, channels_last_channel_slice };
  auto make = [](std::vector<int64_t> sizes, const torch::TensorOptions& options, View view) {
    if (view == View::nchw) return random_tensor(sizes, options, Layout::contiguous);
    if (view == View::channels_last) return random_tensor(sizes, options, Layout::channels_last);
    sizes[1] *= 2;
    const auto wide = random_tensor(sizes, options, view == View::nchw_channel_slice ? Layout::contiguous
                                                                                     : Layout::channels_last);
    return wide.slice(1, 0, sizes[1], 2);
  };
  const View views[] = {View::nchw, View::channels_last, View::nchw_channel_slice, View::channels_last_channel_slice};
  for (auto [batch, cin, cout, h, w] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>>{
           {5, 256, 128, 4, 4}, {3, 48, 32, 7, 9}, {2, 37, 19, 5, 6}, {1, 16, 70, 12, 3}}) {
    for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf, torch::kDouble}) {
      const auto options = torch::TensorOptions().dtype(dtype).device(torch::kCUDA);
      for (int weight_view = 0; weight_view < 3; ++weight_view) {
        const View act = views[rand_int(0, 3)];
        Case c{batch, cin, cout, h, w, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, false,
               act == View::channels_last ? Layout::channels_last : Layout::contiguous, weight_view == 1, false};
        Tensors t;
        t.input = make({batch, cin, h, w}, options, act);
        t.grad_output = make({batch, cout, 2 * h, 2 * w}, options, act);
        t.weight = make({cin, cout, 4, 4}, options, weight_view == 0   ? View::nchw
                                                    : weight_view == 1 ? View::channels_last
                                                                       : View::nchw_channel_slice);
        const std::string what = std::string("CUDA k4s2p1 views ") + c10::toString(dtype) + " " + c.describe() +
                                 " activations view " + std::to_string(int(act)) + " weight view " +
                                 std::to_string(weight_view);
        const auto got = check_cuda_case(c, t, dtype, what);
        const auto only_weight = backward_only(c, t, {false, true, false});
        expect_close(std::get<1>(only_weight), got.grad_weight,
                     scaled(conv_rel_tolerance(dtype, true), got.grad_weight), what + " grad_weight alone");
        const auto only_input = backward_only(c, t, {true, false, false});
        expect_close(std::get<0>(only_input), got.grad_input, scaled(conv_rel_tolerance(dtype, true), got.grad_input),
                     what + " grad_input alone");
      }
    }
  }
}

TEST(ConvTransposeCuda, K4S2P1SmallCoutRandomShapesEveryLayoutAndDtype) {
  HIERPAR_REQUIRE_CUDA();
  // Kernel 4, stride 2, padding 1, groups 1, C_out <= 4 (DCGAN's RGB / grayscale layer): the kernels of
  // ops/cuda/small_cout/, bias or not; float64 and C_in * C_out > 1024 take the general path.
  //  - bf16 / fp16 with C_in % 16 == 0 take the tensor-core kernels (forward and grad_weight only for a channels_last
  //    input): half the random cases draw such a C_in, across the 32-channel chunks of the grad kernels (48, 80);
  //    sizes across the 32 x 8 position tile (odd, 1..40, non-square); batches large enough that the persistent
  //    blocks loop over several images or tiles (140 images of 4 tiles; 700 one-tile images in three 16-channel
  //    forward chunks, against at most 4 blocks per SM).
  //  - fp32 (TF32 on, the default) with C_in % 16 == 0 takes the same kernels as TF32 (more in
  //    K4S2P1SmallCoutTf32TensorCoreKernels).
  //  - the other channel counts take the CUDA-core kernels (C_in 1..150 across their 16-channel forward and
  //    64-channel grad_input chunks), every input layout (strided views are read in place); their grad_weight goes
  //    the general path (column buffer + GEMM).
  // Batch 1 and odd, both weight layouts, unbatched inputs.
  std::vector<Case> cases;
  for (int trial = 0; trial < 14; ++trial) {
    const int64_t cout = rand_int(1, 4);
    const int64_t cin = trial == 0 ? 1 : trial % 2 == 0 ? 16 * rand_int(1, 5) : rand_int(1, 150);
    const int64_t batch = trial == 1 ? 1 : rand_int(1, 5);
    cases.push_back(Case{batch, cin, cout, rand_int(1, 40), rand_int(1, 40), 1, {4, 4}, {2, 2}, {1, 1}, {0, 0},
                         {1, 1}, coin(), static_cast<Layout>(rand_int(0, 2)), coin(), rand_int(0, 5) == 0});
  }
  for (auto layout : {Layout::contiguous, Layout::channels_last}) {
    cases.push_back(Case{9, 32, 3, 32, 32, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, false, layout, coin(), false});
    cases.push_back(Case{2, 300, 4, 5, 3, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, true, layout, coin(), false});
    cases.push_back(Case{3, 48, 2, 9, 40, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, true, layout, coin(), false});
  }
  cases.push_back(Case{140, 32, 3, 32, 32, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, false, Layout::channels_last,
                       false, false});
  cases.push_back(Case{700, 48, 3, 5, 7, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, true, Layout::channels_last,
                       false, false});
  // Two tiles across (the second tile's grad_output rows start mid-row) with whole 16-byte output rows.
  cases.push_back(Case{5, 32, 4, 11, 40, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, true, Layout::channels_last,
                       false, false});
  check_cuda_cases_every_dtype(cases, "CUDA k4s2p1 small C_out ", [](const Case& c, const Tensors& t, torch::Dtype,
                                                                     const std::string& what, const Results& got) {
    // Each gradient alone, bitwise equal to the joint call: no kernel of this path uses atomics (grad_weight's
    // block sums are added in a fixed order), and the general path's GEMM is deterministic.
    const auto only_weight = backward_only(c, t, {false, true, false});
    const auto only_input = backward_only(c, t, {true, false, false});
    EXPECT_FALSE(std::get<0>(only_weight).defined()) << what;
    EXPECT_FALSE(std::get<1>(only_input).defined()) << what;
    EXPECT_TRUE(torch::equal(std::get<1>(only_weight), got.grad_weight)) << what << ": grad_weight alone";
    EXPECT_TRUE(torch::equal(std::get<0>(only_input), got.grad_input)) << what << ": grad_input alone";
  });
}

TEST(ConvTransposeCuda, K4S2P1SmallCoutTf32TensorCoreKernels) {
  HIERPAR_REQUIRE_CUDA();
  // fp32 with TF32 on for convolutions (stock's default) and C_in % 16 == 0 takes the small-C_out tensor-core
  // kernels as TF32 (m16n8k8): the forward and grad_weight with a channels_last input, grad_input with a
  // channels-innermost (or single-channel) grad_output (16-byte row copies when its rows are whole 16-byte units,
  // i.e. 2 W C_out % 4 == 0, strided loads otherwise); an NCHW grad_output with C_out > 1 leaves grad_input to the
  // true-fp32 CUDA-core kernel (the C_out = 2 case below). C_out 1..4, C_in across the
  // forward's 16-channel chunks and the grad kernels' 32-channel ones (16..96), odd sizes across the 32 x 8 position
  // tile, batch 1, bias or not; batches large enough that the persistent blocks loop over several images (300 one-
  // tile images) and grad_weight's blocks over many tiles. Against ATen in float64 at the TF32 tolerance.
  const hierpar::testing::Tf32ForConvolutions tf32(true);
  struct Tf32Case {
    Case c;
    bool grad_output_nchw;  // grad_input then takes the CUDA-core kernel
  };
  std::vector<Tf32Case> cases;
  for (int64_t cout = 1; cout <= 4; ++cout) {
    cases.push_back({Case{cout == 1 ? 1 : rand_int(1, 4), 16 * rand_int(1, 6), cout, 2 * rand_int(0, 20) + 1,
                          2 * rand_int(0, 20) + 1, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, coin(),
                          Layout::channels_last, coin(), false},
                     cout == 2});
  }
  const auto fixed = [&](int64_t n, int64_t cin, int64_t cout, int64_t h, int64_t w, bool bias, bool weight_cl,
                         bool grad_output_nchw) {
    cases.push_back({Case{n, cin, cout, h, w, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, bias, Layout::channels_last,
                          weight_cl, false},
                     grad_output_nchw});
  };
  fixed(9, 32, 3, 32, 32, false, false, false);
  fixed(300, 48, 3, 5, 7, true, false, false);
  fixed(1, 96, 4, 17, 40, true, true, true);
  // A 1 x 1 input: its size-1 dimensions' strides (1, as ATen leaves them) are never used, so the TF32 kernels take it.
  fixed(4, 48, 2, 1, 1, true, false, false);
  for (const auto& [c, grad_output_nchw] : cases) {
    auto t = make_tensors(c, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA));
    if (grad_output_nchw) t.grad_output = t.grad_output.contiguous();
    const std::string what = std::string("CUDA TF32 small C_out ") + c.describe() +
                             (grad_output_nchw ? " grad_output NCHW" : "");
    const auto got = check_cuda_case(c, t, torch::kFloat, what);
    // Deterministic (no atomics): each gradient alone equals the joint call bit for bit.
    EXPECT_TRUE(torch::equal(std::get<1>(backward_only(c, t, {false, true, false})), got.grad_weight)) << what;
    EXPECT_TRUE(torch::equal(std::get<0>(backward_only(c, t, {true, false, false})), got.grad_input)) << what;
    // The tensor-core kernels did compute it: TF32's rounding makes every result differ from the true-fp32 one
    // (grad_input from an NCHW grad_output is the true-fp32 kernel's, bit for bit).
    const Results exact = without_tf32([&] { return run(c, t, /*aten=*/false); });
    EXPECT_FALSE(torch::equal(got.output, exact.output)) << what << ": forward not on the TF32 kernel";
    EXPECT_EQ(torch::equal(got.grad_input, exact.grad_input), grad_output_nchw) << what << ": grad_input's kernel";
    EXPECT_FALSE(torch::equal(got.grad_weight, exact.grad_weight)) << what << ": grad_weight not on the TF32 kernel";
  }
}

TEST(ConvTransposeCuda, Fp32FollowsTheConvolutionTf32Flag) {
  HIERPAR_REQUIRE_CUDA();
  // With TF32 off for convolutions, fp32 is full fp32: the CPU's tolerance holds, on the k4s2p1 implicit GEMMs and
  // on the small-C_out route (its CUDA-core kernels and the general path's grad_weight, not the TF32 kernels that
  // the same channels_last shapes take with TF32 on).
  const hierpar::testing::Tf32ForConvolutions fp32(false);
  for (const Case& c :
       {Case{4, 64, 32, 8, 8, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, true, Layout::channels_last, false, false},
        Case{3, 32, 3, 9, 11, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, true, Layout::channels_last, false, false},
        Case{1, 48, 1, 13, 6, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, false, Layout::channels_last, true, false}}) {
    const auto t = make_tensors(c, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA));
    compare(run(c, t, false), run(c, t, true, torch::kDouble), 1e-5, "CUDA fp32 without TF32 " + c.describe());
  }
}

TEST(ConvTransposeCuda, BackwardInACudaGraphAndEachGradientAloneEqualTheEagerBackward) {
  HIERPAR_REQUIRE_CUDA();
  // With both gradients asked for, the k4s2p1 and small-C_out routes compute grad_weight on a side stream
  // alongside grad_input (ops/cuda/side_stream.h). Checked bit for bit: (1) the joint eager call equals each
  // gradient computed alone (the concurrency changes no value); (2) the backward captured in a CUDA graph (the
  // fork/join captured as a branch) and replayed on fresh values equals the eager call.
  // Bitwise equality needs a deterministic summation order: the k4s2p1 GEMMs split K into at most
  // max(1, K-tiles / 4) parts added by fp32 atomics, and up to two such adds onto zero are order-independent
  // (a + b == b + a). So the shapes keep every atomic sum at <= 2 parts: batch 2 at 8x8 (K = 128 pixels for
  // grad_weight: one split), C_out = 16 in fp32 (grad_input K = 256: two splits), C_out = 32 only in bf16
  // (grad_input K = 512 of 64-wide tiles: two splits; channels_last takes the staged-patch kernel, no atomics).
  // The small-C_out kernels use no atomics; their grad_weight with an NCHW input is the general path's cuBLAS GEMM.
  struct Route {
    Case c;
    std::vector<torch::Dtype> dtypes;
  };
  std::vector<Route> routes;
  for (auto layout : {Layout::contiguous, Layout::channels_last}) {
    routes.push_back({Case{2, 64, 16, 8, 8, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, false, layout, false, false},
                      {torch::kFloat, torch::kBFloat16}});
    routes.push_back({Case{2, 64, 32, 8, 8, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, false, layout, false, false},
                      {torch::kBFloat16}});
    // Small C_out: tensor-core kernels for both gradients with a channels_last input (TF32 for fp32); with an NCHW
    // one, tensor-core grad_input and the general path's grad_weight.
    routes.push_back({Case{2, 32, 3, 16, 16, 1, {4, 4}, {2, 2}, {1, 1}, {0, 0}, {1, 1}, false, layout, false, false},
                      {torch::kFloat, torch::kBFloat16}});
  }
  for (const Route& r : routes) {
    for (auto dtype : r.dtypes) {
      const Case& c = r.c;
      const auto t = make_tensors(c, torch::TensorOptions().dtype(dtype).device(torch::kCUDA));
      const std::string what = std::string("CUDA graph ") + c10::toString(dtype) + " " + c.describe();
      hierpar::testing::expect_joint_backward_deterministic(
          [&](std::array<bool, 3> mask) { return backward_only(c, t, mask); }, {t.input, t.grad_output}, what);
    }
  }
}

// ---- the layer ---------------------------------------------------------------------------------------

torch::nn::ConvTranspose2dOptions random_options() {
  const int64_t groups = rand_int(1, 2);
  auto o = torch::nn::ConvTranspose2dOptions(groups * rand_int(1, 3), groups * rand_int(1, 3),
                                             {rand_int(1, 4), rand_int(1, 4)})
               .stride({rand_int(1, 3), rand_int(1, 3)})
               .padding({rand_int(0, 1), rand_int(0, 1)})
               .groups(groups)
               .bias(coin());
  o.output_padding({rand_int(0, (*o.stride())[0] - 1), rand_int(0, (*o.stride())[1] - 1)});
  return o;
}

TEST(ConvTransposeLayer, StateDictInterchangesWithTorchNn) {
  for (int trial = 0; trial < 4; ++trial) {
    const auto o = random_options();
    torch::nn::ConvTranspose2d stock(o);
    hierpar::nn::ConvTranspose2d ours(o);
    const auto x = random_tensor({2, o.in_channels(), rand_int(3, 5), rand_int(3, 5)}, torch::kDouble);
    hierpar::testing::expect_state_interchanges(stock, ours, x, "");
  }
}

TEST(ConvTransposeLayer, InitialisationFollowsTorchNn) {
  hierpar::nn::ConvTranspose2d layer(torch::nn::ConvTranspose2dOptions(16, 24, 3).groups(2));
  // torch's fan_in of a transposed weight [in, out/groups, kH, kW] is out/groups * kH * kW.
  hierpar::testing::expect_kaiming_uniform_init(layer->weight, layer->bias, {16, 12, 3, 3}, 12.0 * 9.0);
}

TEST(ConvTransposeLayer, ForwardWithOutputSizeMatchesTorchNn) {
  for (int trial = 0; trial < 4; ++trial) {
    auto o = random_options().output_padding(0);
    torch::nn::ConvTranspose2d stock(o);
    hierpar::nn::ConvTranspose2d ours(o);
    hierpar::testing::copy_state(stock, ours);
    const auto x = random_tensor({1, o.in_channels(), rand_int(3, 5), rand_int(3, 5)}, torch::kFloat);
    const auto base = stock->forward(x).sizes();
    const std::vector<int64_t> size{base[2] + rand_int(0, (*o.stride())[0] - 1),
                                    base[3] + rand_int(0, (*o.stride())[1] - 1)};
    const auto y = ours->forward(x, at::IntArrayRef(size));
    EXPECT_EQ(y.size(2), size[0]);
    EXPECT_EQ(y.size(3), size[1]);
    expect_close(y, stock->forward(x, at::IntArrayRef(size)), "forward(input, output_size)");
    const std::vector<int64_t> too_big{base[2] + (*o.stride())[0], base[3]};
    HIERPAR_EXPECT_THROW_MSG(ours->forward(x, at::IntArrayRef(too_big)), "requested an output size of");
  }
}

TEST(ConvTransposeLayer, PrettyPrintAndPaddingMode) {
  hierpar::nn::ConvTranspose2d layer(torch::nn::ConvTranspose2dOptions(256, 128, 4).stride(2).padding(1).bias(false));
  std::ostringstream os;
  os << *layer;
  EXPECT_EQ(os.str(), "hierpar::nn::ConvTranspose2d(256, 128, kernel_size=[4, 4], stride=[2, 2], padding=[1, 1], bias=false)");
  HIERPAR_EXPECT_THROW_MSG(
      hierpar::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(2, 2, 3).padding_mode(torch::kReflect)),
      "only padding_mode zeros is supported");
}

}  // namespace
