// hierpar::nn::recompute_sliced (models/include/hierpar/nn/recompute.h) and the DCGAN's memory_slices: a block whose
// backward runs in slices of the batch gives the numbers of the block run directly (BatchNorm with the whole batch's
// statistics): output, input and parameter gradients, running statistics, in double (where only the order of the
// sums differs) and in float and bf16 autocast within their rounding; through the trainer with recompute and offload.
#include "testing.h"

#include "hierpar/models/dcgan.h"
#include "hierpar/models/layer_factory.h"
#include "hierpar/nn/batch_norm.h"
#include "hierpar/nn/recompute.h"
#include "hierpar/strategy/adversarial_trainer.h"
#include "hierpar/strategy/placement.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <iostream>
#include <optional>

namespace {

using hierpar::LayerSet;
using hierpar::nn::Activation;
namespace hs = hierpar::strategy;

constexpr hierpar::testing::Tolerance kDoubleTolerance{1e-10, 1e-12};

// A (transposed) convolution, then BatchNorm + `activation`, or with `tanh` tanh instead of BatchNorm (as G's last
// block), from either layer set, in `dtype`.
struct Block {
  hierpar::models::Layer conv, norm;
  Activation activation;
  bool has_norm, tanh;

  Block(LayerSet layers, bool transposed, int64_t in, int64_t out, Activation activation, bool tanh,
        torch::Dtype dtype, const torch::Device& device = torch::kCPU)
      : activation(activation), has_norm(activation != Activation::identity || !tanh), tanh(tanh) {
    conv = transposed ? hierpar::models::make_conv_transpose2d(
                            layers, torch::nn::ConvTranspose2dOptions(in, out, 4).stride(2).padding(1).bias(false))
                      : hierpar::models::make_conv2d(
                            layers, torch::nn::Conv2dOptions(in, out, 3).stride(2).padding(1).bias(false));
    conv.module->to(device, dtype);
    if (has_norm) {
      norm = hierpar::models::make_batch_norm_act2d(layers, out, activation, slope());
      norm.module->to(device, dtype);
      torch::NoGradGuard no_grad;  // weights away from 1 and biases away from 0, so that both matter
      for (auto& p : norm.module->parameters()) p.uniform_(0.5, 1.5);
    }
  }
  double slope() const { return activation == Activation::leaky_relu ? 0.2 : 0.0; }
  torch::Tensor per_sample(const torch::Tensor& x) const {
    const torch::Tensor y = conv.forward(x);
    return tanh ? torch::tanh(y) : y;
  }
  torch::Tensor forward(const torch::Tensor& x) const { return has_norm ? norm.forward(per_sample(x)) : per_sample(x); }
  torch::Tensor sliced(const torch::Tensor& x, int64_t slices) const {
    std::optional<hierpar::nn::BatchNormActOf> of;
    if (has_norm) of = hierpar::nn::BatchNormActOf::of(norm.module, activation, slope());
    return hierpar::nn::recompute_sliced([this](const torch::Tensor& t) { return per_sample(t); }, of, x,
                                         {conv.module}, slices);
  }
  std::vector<torch::Tensor> parameters() const {
    auto p = conv.module->parameters();
    if (has_norm)
      for (const auto& t : norm.module->parameters()) p.push_back(t);
    return p;
  }
  std::vector<torch::Tensor> buffers() const { return has_norm ? norm.module->buffers() : std::vector<torch::Tensor>{}; }
  void copy(const Block& other) {
    torch::NoGradGuard no_grad;
    auto mine = parameters(), theirs = other.parameters();
    for (size_t i = 0; i < mine.size(); ++i) mine[i].copy_(theirs[i]);
  }
  void train(bool on) {
    conv.module->train(on);
    if (has_norm) norm.module->train(on);
  }
};

std::string name_of(LayerSet layers, bool transposed, Activation activation, bool tanh) {
  return std::string(layers == LayerSet::stock ? "stock " : "hierpar ") + (transposed ? "conv_transpose" : "conv") +
         (tanh ? " + tanh" : activation == Activation::identity ? " + BatchNorm" : std::string(" + BatchNorm + ") +
                                                                                        hierpar::nn::to_string(activation));
}

// Gradients under bf16 autocast: each slice's weight gradient is rounded to bf16 before the slices are summed, where
// the whole batch's is rounded once, so an element that is a small sum of large terms may move by several of its own
// roundings. So the gradients are compared as wholes (relative error of the 2-norm), and against the stock block:
// hierpar's BatchNorm + activation, run directly, takes the normalised input from its bf16 output (what it keeps),
// where stock's and the slices' take it from the convolution's output, so its weight's gradient is the one further
// off (up to 6% in norm seen).
void expect_close_in_norm(const torch::Tensor& actual, const torch::Tensor& expected, double rtol, const std::string& what) {
  const double error = (actual.to(torch::kDouble) - expected.to(torch::kDouble)).norm().item<double>();
  const double size = expected.to(torch::kDouble).norm().item<double>();
  EXPECT_LE(error, rtol * size) << what << ": |actual - expected| " << error << " against |expected| " << size;
}

// The block run directly and in `slices` slices from the same parameters and input: output, gradients and buffers
// within `tol` (gradients in 2-norm within `tol.rtol` when `normwise`), after one forward and backward with a random
// output gradient, then after one more forward in eval mode (the running statistics the first updated).
void expect_sliced_equals_direct(LayerSet layers, bool transposed, Activation activation, bool tanh, int64_t slices,
                                 torch::Dtype dtype, hierpar::testing::Layout layout,
                                 const hierpar::testing::Tolerance& tol, bool normwise = false,
                                 std::optional<LayerSet> direct_layers = std::nullopt,
                                 const torch::Device& device = torch::kCPU) {
  auto expect_gradient_close = [&](const torch::Tensor& actual, const torch::Tensor& expected, const std::string& what) {
    if (normwise) {
      expect_close_in_norm(actual, expected, tol.rtol, what);
    } else {
      hierpar::testing::expect_close(actual, expected, tol, what);
    }
  };
  const int64_t batch = hierpar::testing::rand_int(2, 9), in = hierpar::testing::rand_int(1, 4);
  const int64_t out = hierpar::testing::rand_int(2, 5), size = hierpar::testing::rand_int(3, 8);
  const std::string what = name_of(layers, transposed, activation, tanh) +
                           (direct_layers && *direct_layers != layers ? " against the stock block" : "") + ", batch " + std::to_string(batch) + " in " +
                           std::to_string(slices) + " slices, " + hierpar::testing::to_string(layout) + ", " +
                           std::string(c10::toString(dtype)) + " on " + device.str();
  Block direct(direct_layers.value_or(layers), transposed, in, out, activation, tanh, dtype, device);
  Block sliced(layers, transposed, in, out, activation, tanh, dtype, device);
  sliced.copy(direct);
  const auto x = hierpar::testing::random_tensor({batch, in, size, size},
                                                 torch::TensorOptions().dtype(dtype).device(device), layout);
  for (const bool training : {true, false}) {
    direct.train(training);
    sliced.train(training);
    const std::string mode = what + (training ? ", training" : ", eval");
    const auto x1 = x.detach().clone().requires_grad_(true), x2 = x.detach().clone().requires_grad_(true);
    for (auto& p : direct.parameters()) p.mutable_grad() = torch::Tensor();
    for (auto& p : sliced.parameters()) p.mutable_grad() = torch::Tensor();
    const auto y1 = direct.forward(x1);
    const auto y2 = sliced.sliced(x2, slices);
    ASSERT_EQ(y2.grad_fn()->name(), "hierpar::RecomputeBackward") << mode;
    ASSERT_EQ(y2.scalar_type(), y1.scalar_type()) << mode;
    hierpar::testing::expect_close(y2, y1, tol, mode + ": output");
    const auto grad = hierpar::testing::random_tensor(y1.sizes(), y1.options());
    y1.backward(grad);
    y2.backward(grad);
    expect_gradient_close(x2.grad(), x1.grad(), mode + ": input gradient");
    const auto p1 = direct.parameters(), p2 = sliced.parameters();
    for (size_t i = 0; i < p1.size(); ++i) {
      ASSERT_TRUE(p2[i].grad().defined()) << mode << ": parameter " << i << " has no gradient";
      expect_gradient_close(p2[i].grad(), p1[i].grad(), mode + ": parameter gradient " + std::to_string(i));
    }
    const auto b1 = direct.buffers(), b2 = sliced.buffers();
    for (size_t i = 0; i < b1.size(); ++i)
      hierpar::testing::expect_close(b2[i], b1[i], tol, mode + ": buffer " + std::to_string(i));
  }
}

}  // namespace

// Every block the DCGAN slices (G's transposed convolutions with BatchNorm + ReLU and its last one with tanh, D's
// convolutions with BatchNorm + LeakyReLU), and BatchNorm without activation, both layer sets, in double: slices that
// divide the batch, that do not, one per sample and more than the batch; odd sizes, channels_last and strided inputs.
TEST(RecomputeSliced, EqualsTheBlockRunDirectlyInDouble) {
  struct Kind {
    bool transposed;
    Activation activation;
    bool tanh;
  };
  for (const LayerSet layers : {LayerSet::stock, LayerSet::hierpar}) {
    for (const Kind& k : {Kind{true, Activation::relu, false}, Kind{true, Activation::identity, true},
                          Kind{false, Activation::leaky_relu, false}, Kind{false, Activation::identity, false}}) {
      for (const int64_t slices : {1, 2, 3, 9, 20}) {
        const auto layout = static_cast<hierpar::testing::Layout>(hierpar::testing::rand_int(0, 2));
        expect_sliced_equals_direct(layers, k.transposed, k.activation, k.tanh, slices, torch::kDouble, layout,
                                    kDoubleTolerance);
      }
    }
  }
}

// In float the sums' order shows at the level of float rounding; under bf16 autocast the convolution runs in bf16,
// BatchNorm's output is rounded to bf16 by both, and the gradients agree in norm with the stock block's
// (expect_close_in_norm).
TEST(RecomputeSliced, EqualsTheBlockRunDirectlyInFloatAndUnderBf16Autocast) {
  for (const LayerSet layers : {LayerSet::stock, LayerSet::hierpar}) {
    expect_sliced_equals_direct(layers, true, Activation::relu, false, 3, torch::kFloat,
                                hierpar::testing::Layout::channels_last, {1e-4, 1e-5});
    expect_sliced_equals_direct(layers, false, Activation::leaky_relu, false, 2, torch::kFloat,
                                hierpar::testing::Layout::contiguous, {1e-4, 1e-5});
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    expect_sliced_equals_direct(layers, false, Activation::leaky_relu, false, 3, torch::kFloat,
                                hierpar::testing::Layout::contiguous, {2e-2, 2e-2}, /*normwise=*/true, LayerSet::stock);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
  }
}

// On a GPU: every block kind, both layer sets, in float (TF32 off) and under bf16 autocast against the stock block.
TEST(RecomputeSliced, EqualsTheBlockRunDirectlyOnCuda) {
  HIERPAR_REQUIRE_CUDA();
  const hierpar::testing::CudnnSettings cudnn(/*deterministic=*/true, /*benchmark=*/false, /*tf32=*/false);
  const torch::Device cuda(torch::kCUDA, 0);
  for (const LayerSet layers : {LayerSet::stock, LayerSet::hierpar}) {
    for (const int64_t slices : {2, 3}) {
      const auto layout = slices == 2 ? hierpar::testing::Layout::channels_last : hierpar::testing::Layout::contiguous;
      expect_sliced_equals_direct(layers, true, Activation::relu, false, slices, torch::kFloat, layout, {1e-4, 1e-5},
                                  false, std::nullopt, cuda);
      expect_sliced_equals_direct(layers, true, Activation::identity, true, slices, torch::kFloat, layout, {1e-4, 1e-5},
                                  false, std::nullopt, cuda);
      expect_sliced_equals_direct(layers, false, Activation::leaky_relu, false, slices, torch::kFloat, layout,
                                  {1e-4, 1e-5}, false, std::nullopt, cuda);
    }
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    expect_sliced_equals_direct(layers, false, Activation::leaky_relu, false, 3, torch::kFloat,
                                hierpar::testing::Layout::channels_last, {2e-2, 2e-2}, /*normwise=*/true,
                                LayerSet::stock, cuda);
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
  }
}

// What the slices are for: the peak of one G and D forward and backward of the seed's DCGAN (64x64, hierpar layers,
// batch 1024, every block offloaded) falls when each block's backward runs in 8 slices, since a block's
// recomputation no longer holds its convolution's output, BatchNorm's output and their gradients for the whole batch.
TEST(RecomputeSliced, LowersThePeakOfTheBackwardOnCuda) {
  HIERPAR_REQUIRE_CUDA();
  const hierpar::testing::CudnnSettings default_cudnn(/*deterministic=*/false, /*benchmark=*/false);
  auto peak = [](int64_t slices) {
    hierpar::models::DCGANOptions model;
    model.layers = LayerSet::hierpar;
    model.memory = hierpar::nn::ActivationMemory::offload;
    model.offload_budget = 0;
    model.memory_slices = slices;
    return hierpar::testing::dcgan_pass_peak_bytes(model, 1024, /*warmup=*/1, /*mark_steps=*/false);
  };
  const int64_t whole = peak(1), sliced = peak(8);
  std::cout << "peak bytes above the start, every block offloaded: whole batch " << whole << ", 8 slices " << sliced
            << "\n";
  EXPECT_LT(sliced, whole * 9 / 10) << "8 slices should lower the peak by at least a tenth";
}

// Bad arguments are one-line errors naming them; a second derivative through a sliced block, and synchronized
// BatchNorm, are refused.
TEST(RecomputeSliced, BadArgumentsAndSecondDerivativesAreClearErrors) {
  const Block block(LayerSet::hierpar, false, 2, 3, Activation::leaky_relu, false, torch::kFloat);
  const auto x = hierpar::testing::random_tensor({4, 2, 6, 6}, torch::kFloat).requires_grad_(true);
  HIERPAR_EXPECT_THROW_MSG(block.sliced(x, 0), "slices: expected at least 1, got 0");
  HIERPAR_EXPECT_THROW_MSG(hierpar::nn::BatchNormActOf::of(block.conv.module, Activation::relu, 0.0),
                           "module: expected hierpar::nn::BatchNormAct2d, hierpar::nn::BatchNorm2d or torch::nn::BatchNorm2d");
  HIERPAR_EXPECT_THROW_MSG(hierpar::nn::BatchNormActOf::of(block.norm.module, Activation::relu, 0.0),
                           "applies leaky_relu, not the relu given");
  HIERPAR_EXPECT_THROW_MSG(torch::autograd::grad({block.sliced(x, 2).square().sum()}, {x}, {}, /*retain_graph=*/true,
                                                  /*create_graph=*/true),
                           "no second derivatives; use memory_slices 1");
  hierpar::testing::LocalBatchNormSync sync;
  {
    const hierpar::nn::BatchNormSyncGuard installed(&sync);
    HIERPAR_EXPECT_THROW_MSG(block.sliced(x, 2), "recompute_sliced: synchronized BatchNorm (a BatchNormSync "
                                                 "installed) is not supported");
  }
  auto options = hierpar::testing::small_dcgan(LayerSet::hierpar);
  options.memory_slices = 0;
  options.memory = hierpar::nn::ActivationMemory::recompute;
  HIERPAR_EXPECT_THROW_MSG(options.validate(), "memory_slices: expected at least 1 slice of the batch, got 0");
  options.memory_slices = 4;
  options.memory = hierpar::nn::ActivationMemory::none;
  HIERPAR_EXPECT_THROW_MSG(options.validate(), "expected memory recompute or offload with 4 slices, got memory none");
}

// The DCGAN with its recomputed or offloaded blocks' backward in slices (memory_slices 4) trains as keeping its
// activations, 3 steps through the trainer, both layer sets, single and data on two CPU replicas (batch 6: slices of 2
// samples on one replica, of 1 on each of two), in double.
TEST(RecomputeSliced, DcganTrainsAsWithoutRecomputeInDouble) {
  using hierpar::nn::ActivationMemory;
  struct DoubleByDefault {
    caffe2::TypeMeta before = torch::get_default_dtype();
    DoubleByDefault() { torch::set_default_dtype(caffe2::TypeMeta::Make<double>()); }
    ~DoubleByDefault() { torch::set_default_dtype(before); }
  } in_double;
  for (const LayerSet layers : {LayerSet::stock, LayerSet::hierpar}) {
    for (const char* scheme : {"single", "data"}) {
      const auto placement =
          hs::Placement::from_flags(scheme, std::string(scheme) == "data" ? 2 : 1, "host", c10::DeviceType::CPU, {});
      std::vector<std::vector<torch::Tensor>> states;
      for (const ActivationMemory memory : {ActivationMemory::none, ActivationMemory::recompute, ActivationMemory::offload}) {
        auto model = hierpar::testing::small_dcgan(layers, /*nz=*/8, /*channels=*/1);
        model.memory = memory;
        model.memory_slices = memory == ActivationMemory::none ? 1 : 4;
        torch::manual_seed(5);
        hierpar::models::Generator g(model);
        hierpar::models::Discriminator d(model);
        hs::AdversarialOptions options;
        options.noise_shape = {model.nz, 1, 1};
        hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, options);
        torch::manual_seed(6);
        for (int step = 0; step < 3; ++step) trainer.step(torch::rand({6, 1, 32, 32}) * 2 - 1);
        std::vector<torch::Tensor> state;
        for (auto* module : {trainer.generator().ptr().get(), trainer.discriminator().ptr().get()}) {
          for (const auto& p : module->parameters()) state.push_back(p.detach().clone());
          for (const auto& b : module->buffers()) state.push_back(b.detach().clone());
        }
        states.push_back(state);
      }
      const std::string what = std::string(scheme) + (layers == LayerSet::stock ? ", stock" : ", hierpar");
      for (size_t m = 1; m < states.size(); ++m) {
        ASSERT_EQ(states[m].size(), states[0].size());
        for (size_t i = 0; i < states[0].size(); ++i) {
          ASSERT_EQ(states[m][i].scalar_type(), states[0][i].is_floating_point() ? torch::kDouble : states[0][i].scalar_type());
          hierpar::testing::expect_close(states[m][i], states[0][i], kDoubleTolerance,
                                         what + (m == 1 ? ", recompute" : ", offload") + " in slices: state tensor " +
                                             std::to_string(i));
        }
      }
    }
  }
}
