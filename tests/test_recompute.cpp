// hierpar::nn::recompute (models/include/hierpar/nn/recompute.h) and the DCGAN's --memory recompute|offload: the
// same numbers as keeping the activations, forward, backward, second derivatives, BatchNorm's running statistics,
// under autocast and through the trainer, and with another stream's pass over the block during the recomputation; and
// less memory on CUDA, least with the inputs offloaded to host memory.
#include "testing.h"

#include "hierpar/models/dcgan.h"
#include "hierpar/models/layer_factory.h"
#include "hierpar/nn/batch_norm.h"
#include "hierpar/nn/recompute.h"
#include "hierpar/strategy/adversarial_trainer.h"
#include "hierpar/strategy/placement.h"

#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/torch.h>

namespace {

using hierpar::LayerSet;
namespace hs = hierpar::strategy;

// A convolution with its BatchNorm and LeakyReLU, from either layer set; `copy` takes another block's state.
struct ConvBlock {
  hierpar::models::Layer conv, norm;
  ConvBlock(LayerSet layers, int64_t in, int64_t out) {
    conv = hierpar::models::make_conv2d(layers, torch::nn::Conv2dOptions(in, out, 3).stride(2).padding(1).bias(false));
    norm = hierpar::models::make_batch_norm_act2d(layers, out, hierpar::nn::Activation::leaky_relu, 0.2);
  }
  torch::Tensor forward(const torch::Tensor& x) const { return norm.forward(conv.forward(x)); }
  std::vector<std::shared_ptr<torch::nn::Module>> modules() const { return {conv.module, norm.module}; }
  std::vector<torch::Tensor> parameters() const {
    auto p = conv.module->parameters();
    for (const auto& t : norm.module->parameters()) p.push_back(t);
    return p;
  }
  std::vector<torch::Tensor> buffers() const { return norm.module->buffers(); }
  void copy(const ConvBlock& other) {
    torch::NoGradGuard no_grad;
    auto mine = parameters(), theirs = other.parameters();
    for (size_t i = 0; i < mine.size(); ++i) mine[i].copy_(theirs[i]);
  }
};

void expect_all_equal(const std::vector<torch::Tensor>& actual, const std::vector<torch::Tensor>& expected,
                      const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    ASSERT_TRUE(actual[i].defined() && expected[i].defined()) << what << ": tensor " << i;
    hierpar::testing::expect_close(actual[i], expected[i], {0, 0}, what + ": tensor " + std::to_string(i));
  }
}

std::vector<torch::Tensor> grads_of(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.grad().defined() ? t.grad().clone() : torch::Tensor());
  return out;
}

}  // namespace

// Output, input and parameter gradients and the running statistics of a block run through recompute() equal the
// block run directly, for both layer sets, odd sizes and channels_last; the statistics advance once per forward.
TEST(Recompute, BlockEqualsTheBlockRunDirectly) {
  for (const LayerSet layers : {LayerSet::stock, LayerSet::hierpar}) {
    for (const bool channels_last : {false, true}) {
      const std::string what = std::string(layers == LayerSet::stock ? "stock" : "hierpar") +
                               (channels_last ? ", channels_last" : "");
      const int64_t batch = hierpar::testing::rand_int(1, 4), in = 3, out = hierpar::testing::rand_int(2, 6);
      const int64_t size = hierpar::testing::rand_int(5, 11);
      ConvBlock direct(layers, in, out), recomputed(layers, in, out);
      recomputed.copy(direct);
      auto x = hierpar::testing::random_tensor({batch, in, size, size}, torch::kFloat);
      if (channels_last) x = x.contiguous(at::MemoryFormat::ChannelsLast);
      const auto x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
      const auto y1 = direct.forward(x1);
      const auto y2 = hierpar::nn::recompute([&](const torch::Tensor& t) { return recomputed.forward(t); }, x2,
                                             recomputed.modules());
      EXPECT_EQ(y2.grad_fn()->name(), "hierpar::RecomputeBackward") << what;
      hierpar::testing::expect_close(y2, y1, {0, 0}, what + ": output");
      const auto grad = hierpar::testing::random_tensor(y1.sizes(), torch::kFloat);
      y1.backward(grad);
      y2.backward(grad);
      hierpar::testing::expect_close(x2.grad(), x1.grad(), {0, 0}, what + ": input gradient");
      expect_all_equal(grads_of(recomputed.parameters()), grads_of(direct.parameters()), what + ": parameter gradients");
      expect_all_equal(recomputed.buffers(), direct.buffers(), what + ": running statistics after one forward");
    }
  }
}

// Without a restore of the buffers the recomputation would count the batch twice: the statistics would differ.
TEST(Recompute, RecomputationLeavesTheBuffersAsTheForwardLeftThem) {
  ConvBlock block(LayerSet::hierpar, 3, 4);
  const auto x = hierpar::testing::random_tensor({2, 3, 8, 8}, torch::kFloat).requires_grad_(true);
  const auto y = hierpar::nn::recompute([&](const torch::Tensor& t) { return block.forward(t); }, x, block.modules());
  std::vector<torch::Tensor> after_forward;
  for (const auto& b : block.buffers()) after_forward.push_back(b.clone());
  y.sum().backward();
  expect_all_equal(block.buffers(), after_forward, "buffers after the backward's recomputation");
}

// A pass over the same block on another stream while the backward recomputes it (D's fakes on their own stream beside
// the real batch's backward) keeps its statistics update: the recomputation updates copies. Made deterministic by a
// recomputation that waits on the GPU before its layers, while the other stream's pass runs at once.
TEST(Recompute, PassOnAnotherStreamKeepsItsStatisticsOnCuda) {
  HIERPAR_REQUIRE_CUDA();
  const torch::Device device(torch::kCUDA, 0);
  constexpr int64_t kCycles = 50'000'000;  // some 25 ms at 2 GHz
  for (const LayerSet layers : {LayerSet::stock, LayerSet::hierpar}) {
    const std::string what = layers == LayerSet::stock ? "stock" : "hierpar";
    ConvBlock block(layers, 3, 4), reference(layers, 3, 4);
    for (ConvBlock* b : {&block, &reference}) {
      for (const auto& m : b->modules()) m->to(device);
    }
    reference.copy(block);
    const auto real = hierpar::testing::random_tensor({4, 3, 9, 9}, torch::kFloat).to(device).requires_grad_(true);
    const auto fake = hierpar::testing::random_tensor({4, 3, 9, 9}, torch::kFloat).to(device);
    // One stream, in order: the real batch's forward, then the fakes'.
    (void)reference.forward(real);
    (void)reference.forward(fake);

    const auto y = hierpar::nn::recompute(
        [&](const torch::Tensor& t) {
          if (torch::GradMode::is_enabled()) at::cuda::sleep(kCycles);  // only the backward's recomputation waits
          return block.forward(t);
        },
        real, block.modules());
    const c10::cuda::CUDAStream main = c10::cuda::getCurrentCUDAStream(device.index());
    const c10::cuda::CUDAStream other = c10::cuda::getStreamFromPool(false, device.index());
    at::cuda::CUDAEvent forward_done;
    forward_done.record(main);
    forward_done.block(other);
    y.sum().backward();
    {
      c10::cuda::CUDAStreamGuard on_other(other);
      torch::NoGradGuard no_grad;
      (void)block.forward(fake);
    }
    torch::cuda::synchronize();
    for (size_t i = 0; i < block.buffers().size(); ++i) {
      hierpar::testing::expect_close(block.buffers()[i], reference.buffers()[i], {1e-6, 1e-7},
                                     what + ": buffer " + std::to_string(i) + " after the real backward and the fakes' pass");
    }
  }
}

// Second derivatives (an R1-style penalty: the squared norm of the input gradient, differentiated again) through
// recompute() equal those of the block run directly: stock layers in double, which differentiate twice.
TEST(Recompute, SecondDerivativesEqualTheBlockRunDirectly) {
  ConvBlock direct(LayerSet::stock, 2, 3), recomputed(LayerSet::stock, 2, 3);
  for (auto* b : {&direct, &recomputed}) {
    b->conv.module->to(torch::kDouble);
    b->norm.module->to(torch::kDouble);
  }
  recomputed.copy(direct);
  const auto x = hierpar::testing::random_tensor({3, 2, 7, 7}, torch::kDouble);
  auto penalty = [](const torch::Tensor& y, const torch::Tensor& input) {
    const auto g = torch::autograd::grad({y.square().sum()}, {input}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    return g.square().sum();
  };
  const auto x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
  penalty(direct.forward(x1), x1).backward();
  penalty(hierpar::nn::recompute([&](const torch::Tensor& t) { return recomputed.forward(t); }, x2, recomputed.modules()),
          x2)
      .backward();
  const hierpar::testing::Tolerance tol{1e-10, 1e-12};
  hierpar::testing::expect_close(x2.grad(), x1.grad(), tol, "input gradient of the penalty");
  const auto a = grads_of(recomputed.parameters()), b = grads_of(direct.parameters());
  for (size_t i = 0; i < a.size(); ++i) hierpar::testing::expect_close(a[i], b[i], tol, "parameter " + std::to_string(i));
}

// The recomputation runs under the autocast state of the forward, even when the backward runs outside it.
TEST(Recompute, RecomputesUnderTheForwardsAutocast) {
  ConvBlock direct(LayerSet::stock, 3, 4), recomputed(LayerSet::stock, 3, 4);
  recomputed.copy(direct);
  const auto x = hierpar::testing::random_tensor({2, 3, 9, 9}, torch::kFloat);
  const auto x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
  torch::Tensor y1, y2;
  {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    y1 = direct.forward(x1);
    y2 = hierpar::nn::recompute([&](const torch::Tensor& t) { return recomputed.forward(t); }, x2, recomputed.modules());
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
  }
  EXPECT_EQ(y2.scalar_type(), y1.scalar_type());
  y1.sum().backward();
  y2.sum().backward();
  hierpar::testing::expect_close(x2.grad(), x1.grad(), {0, 0}, "input gradient under bf16 autocast");
  expect_all_equal(grads_of(recomputed.parameters()), grads_of(direct.parameters()), "parameter gradients");
}

namespace {
// The parameters and buffers of a small DCGAN trained 3 steps on `placement` with `memory`.
std::vector<torch::Tensor> trained_dcgan_state(LayerSet layers, const hs::Placement& placement,
                                               hierpar::nn::ActivationMemory memory, hs::AdversarialOptions options,
                                               const torch::Device& data_device) {
  auto model = hierpar::testing::small_dcgan(layers, /*nz=*/8, /*channels=*/1);
  model.memory = memory;
  torch::manual_seed(5);
  hierpar::models::Generator g(model);
  hierpar::models::Discriminator d(model);
  options.noise_shape = {model.nz, 1, 1};
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, options);
  torch::manual_seed(6);
  for (int step = 0; step < 3; ++step) trainer.step((torch::rand({4, 1, 32, 32}) * 2 - 1).to(data_device));
  std::vector<torch::Tensor> state;
  for (auto* module : {trainer.generator().ptr().get(), trainer.discriminator().ptr().get()}) {
    for (const auto& p : module->parameters()) state.push_back(p.detach().cpu());
    for (const auto& b : module->buffers()) state.push_back(b.detach().cpu());
  }
  return state;
}
}  // namespace

// The DCGAN with recompute or offload trains as without, through the trainer: single and data on two CPU replicas
// (bucketed host averaging, whose hooks see the parameters' gradients come out of the recomputation), both layer
// sets. (On the CPU an offloaded input stays where it is; the chain of prefetches runs all the same.)
TEST(Recompute, DcganTrainsAsWithoutRecompute) {
  using hierpar::nn::ActivationMemory;
  for (const LayerSet layers : {LayerSet::stock, LayerSet::hierpar}) {
    for (const char* scheme : {"single", "data"}) {
      const auto placement =
          hs::Placement::from_flags(scheme, std::string(scheme) == "data" ? 2 : 1, "host", c10::DeviceType::CPU, {});
      std::vector<std::vector<torch::Tensor>> states;
      for (const ActivationMemory memory : {ActivationMemory::none, ActivationMemory::recompute, ActivationMemory::offload})
        states.push_back(trained_dcgan_state(layers, placement, memory, {}, torch::kCPU));
      const std::string what = std::string(scheme) + (layers == LayerSet::stock ? ", stock" : ", hierpar");
      expect_all_equal(states[1], states[0], what + ": recompute vs keeping the activations");
      expect_all_equal(states[2], states[0], what + ": offload vs keeping the activations");
    }
  }
}

// The same on a GPU, with D's passes over the real batch and the fakes on two streams (overlap_passes), eagerly
// and as CUDA graphs (offload runs eagerly only): the recomputation of D's blocks in the real batch's backward runs
// beside the fakes' pass over the same BatchNorm layers.
TEST(Recompute, DcganTrainsAsWithoutRecomputeOnCuda) {
  HIERPAR_REQUIRE_CUDA();
  using hierpar::nn::ActivationMemory;
  const hierpar::testing::CudnnSettings cudnn(/*deterministic=*/true, /*benchmark=*/false, /*tf32=*/false);
  const auto placement = hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CUDA, {});
  const torch::Device device(torch::kCUDA, 0);
  for (const LayerSet layers : {LayerSet::stock, LayerSet::hierpar}) {
    for (const bool graphs : {false, true}) {
      hs::AdversarialOptions options;
      options.fused_adam = true;
      options.cuda_graphs = graphs;
      options.graph_warmup_steps = 1;
      ASSERT_TRUE(options.overlap_passes);
      options.eager_overlap_batch = 1;  // the eager steps on two streams too
      const std::string what = std::string(layers == LayerSet::stock ? "stock" : "hierpar") + (graphs ? ", graphs" : ", eager");
      const auto kept = trained_dcgan_state(layers, placement, ActivationMemory::none, options, device);
      expect_all_equal(trained_dcgan_state(layers, placement, ActivationMemory::recompute, options, device), kept,
                       what + ": recompute vs keeping the activations");
      if (!graphs) {
        expect_all_equal(trained_dcgan_state(layers, placement, ActivationMemory::offload, options, device), kept,
                         what + ": offload vs keeping the activations");
      }
    }
  }
}

// What recomputation is for: the seed's DCGAN at batch 1024 keeps less between the forward and the backward (at
// 256 cuDNN's workspaces, which recomputation adds to the backward, weigh as much as the activations on an H200). Peak
// memory of one D and G forward and backward (after one untimed pass), with and without, on one GPU; offloading
// every block (offload_budget 0) keeps less still, and offloading as the budget requires leaves a batch this small
// as it is once a measured step has made the plan.
TEST(Recompute, LowersPeakMemoryOnCuda) {
  HIERPAR_REQUIRE_CUDA();
  // ATen's defaults (heuristic algorithms, not only deterministic ones), whatever an earlier test of the process set:
  // the recomputation's cuDNN workspaces count in the peak, and other algorithms need other workspaces.
  const hierpar::testing::CudnnSettings default_cudnn(/*deterministic=*/false, /*benchmark=*/false);
  using hierpar::nn::ActivationMemory;
  auto peak = [](ActivationMemory memory, double offload_budget = 0) {
    hierpar::models::DCGANOptions model;
    model.layers = LayerSet::hierpar;
    model.memory = memory;
    model.offload_budget = offload_budget;
    // With a budget, marked steps as AdversarialTrainer's: the first makes the device's plan (its blocks offload), the
    // second measures, the third's mark plans.
    const bool planned = offload_budget > 0;
    return hierpar::testing::dcgan_pass_peak_bytes(model, 1024, planned ? 2 : 0, planned);
  };
  peak(ActivationMemory::none);  // the first pass's one-time allocations (cuDNN, cuBLAS) are not the activations'
  const int64_t keeping = peak(ActivationMemory::none), recomputing = peak(ActivationMemory::recompute),
                offloading = peak(ActivationMemory::offload), offloading_if_needed = peak(ActivationMemory::offload, 0.9);
  std::cout << "peak bytes above the start: keeping " << keeping << ", recomputing " << recomputing
            << ", offloading every block " << offloading << ", offloading within 90% of the memory "
            << offloading_if_needed << "\n";
  EXPECT_LT(recomputing, keeping * 9 / 10) << "recompute should keep at least a tenth less";
  EXPECT_LT(offloading, recomputing) << "offload should keep less than recompute";
  EXPECT_NEAR(static_cast<double>(offloading_if_needed), static_cast<double>(keeping), 0.01 * keeping)
      << "a batch far below the budget offloads nothing";
  // The plan says so: every block it saw keeps its activations.
  const std::string plan = hierpar::nn::offload_plan_summary(torch::Device(torch::kCUDA, 0));
  std::cout << plan << "\n";
  const auto of = plan.find(" of ");
  ASSERT_EQ(plan.rfind("offload plan on cuda:0: ", 0), 0u) << plan;
  ASSERT_NE(of, std::string::npos) << plan;
  const std::string kept = plan.substr(24, of - 24);
  EXPECT_EQ(plan.substr(of + 4, kept.size() + 1), kept + " ") << "every block kept: " << plan;
}

// The budget's choice: nothing kept without headroom, everything when all fits, and in between the blocks that save
// the most copying per byte kept (a discriminator's block keeps its input and a half-size output; a generator's a
// double-size output), largest first among equals.
TEST(Recompute, OffloadPlanKeepsWhatTheBudgetAllows) {
  using hierpar::nn::OffloadCandidate;
  const std::vector<OffloadCandidate> blocks{{100, 300}, {200, 300}, {400, 600}, {50, 150}};  // G-like, D-like, ...
  auto kept = [&](int64_t peak, int64_t budget) {
    std::vector<int> out;
    const auto plan = hierpar::nn::plan_kept_blocks(blocks, peak, budget);
    for (size_t i = 0; i < plan.size(); ++i) {
      if (plan[i]) out.push_back(static_cast<int>(i));
    }
    return out;
  };
  EXPECT_EQ(kept(1000, 900), std::vector<int>{}) << "a step already over the budget keeps nothing";
  EXPECT_EQ(kept(1000, 1000), std::vector<int>{});
  EXPECT_EQ(kept(1000, 1000 + 300 + 300 + 600 + 150), (std::vector<int>{0, 1, 2, 3})) << "a batch that fits keeps all";
  EXPECT_EQ(kept(1000, 1000 + 600), (std::vector<int>{2})) << "2/3 input per byte kept, the larger of two";
  EXPECT_EQ(kept(1000, 1000 + 900), (std::vector<int>{1, 2}));
  EXPECT_EQ(kept(1000, 1000 + 1050), (std::vector<int>{1, 2, 3})) << "then the 1/3 ones that still fit";
}

// Offloaded blocks on CUDA: a chain of four blocks (each offloading its input, prefetched by the block after it in
// the backward) gives the outputs and gradients of the blocks run directly, in float32 with deterministic cuDNN,
// channels_last too; a second backward through the same graph (retain_graph) fetches the inputs again.
TEST(Recompute, OffloadedChainEqualsTheBlocksRunDirectlyOnCuda) {
  HIERPAR_REQUIRE_CUDA();
  const hierpar::testing::CudnnSettings cudnn(/*deterministic=*/true, /*benchmark=*/false, /*tf32=*/false);
  for (const bool channels_last : {false, true}) {
    std::vector<ConvBlock> direct, offloaded;
    for (int i = 0; i < 4; ++i) {
      direct.emplace_back(LayerSet::hierpar, i == 0 ? 3 : 8, 8);
      offloaded.emplace_back(LayerSet::hierpar, i == 0 ? 3 : 8, 8);
      offloaded.back().copy(direct.back());
      for (auto* b : {&direct.back(), &offloaded.back()}) {
        b->conv.module->to(torch::kCUDA);
        b->norm.module->to(torch::kCUDA);
      }
    }
    auto x = hierpar::testing::random_tensor({5, 3, 37, 37}, torch::kFloat).to(torch::kCUDA);
    if (channels_last) x = x.contiguous(at::MemoryFormat::ChannelsLast);
    const auto x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
    hierpar::nn::OffloadChain chain;
    torch::Tensor y1 = x1, y2 = x2;
    for (int i = 0; i < 4; ++i) {
      y1 = direct[i].forward(y1);
      const ConvBlock* b = &offloaded[i];
      y2 = hierpar::nn::recompute([b](const torch::Tensor& t) { return b->forward(t); }, y2, b->modules(),
                                  i == 0 ? nullptr : &chain);
    }
    const std::string what = channels_last ? "channels_last" : "NCHW";
    hierpar::testing::expect_close(y2, y1, {0, 0}, what + ": output");
    const auto grad = hierpar::testing::random_tensor(y1.sizes(), torch::kFloat).to(torch::kCUDA);
    for (int pass = 0; pass < 2; ++pass) {
      y1.backward(grad, /*retain_graph=*/pass == 0);
      y2.backward(grad, /*retain_graph=*/pass == 0);
      hierpar::testing::expect_close(x2.grad(), x1.grad(), {1e-6, 1e-6}, what + ": input gradient, pass " + std::to_string(pass));
      for (int i = 0; i < 4; ++i) {
        const auto a = grads_of(offloaded[i].parameters()), b = grads_of(direct[i].parameters());
        for (size_t k = 0; k < a.size(); ++k)
          hierpar::testing::expect_close(a[k], b[k], {1e-5, 1e-6}, what + ": block " + std::to_string(i) + " parameter " +
                                                                        std::to_string(k) + ", pass " + std::to_string(pass));
      }
    }
  }
}

// PCIe is slower than the blocks: a pass of offloaded blocks holds at most two inputs on the device while their
// copies to the host run (the block's and the one before it), not one per block. Eight offloaded blocks of 64 MB
// inputs (each a scale, far faster than its copy out): the forward's peak stays under four inputs; queued at once,
// the pass held eight.
TEST(Recompute, OffloadedPassHoldsAtMostTwoInputsOnCuda) {
  HIERPAR_REQUIRE_CUDA();
  constexpr int64_t numel = 16 << 20;
  constexpr int64_t bytes = numel * 4;
  const auto x = hierpar::testing::random_tensor({numel}, torch::kFloat).to(torch::kCUDA).requires_grad_(true);
  torch::cuda::synchronize();
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  const int64_t before = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current;
  hierpar::nn::OffloadChain chain;
  torch::Tensor y = x * 1.5;
  for (int i = 0; i < 8; ++i) y = hierpar::nn::recompute([](const torch::Tensor& t) { return t * 1.5; }, y, {}, &chain);
  torch::cuda::synchronize();
  const int64_t peak = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak - before;
  std::cout << "forward peak above the input: " << peak / bytes << "." << (peak % bytes) * 10 / bytes
            << " inputs of 64 MB\n";
  EXPECT_LT(peak, 4 * bytes) << "the offloaded inputs waited on the device for their copies";
  // The pass still computes what it should, and its backward fetches every input back.
  y.backward(torch::ones_like(y));
  const double expected = std::pow(1.5, 9);
  EXPECT_NEAR(x.grad().min().item<double>(), expected, 1e-3 * expected);
  EXPECT_NEAR(x.grad().max().item<double>(), expected, 1e-3 * expected);
}

// An offloaded block refuses second derivatives with a message that says what to use instead.
// As autograd's saved tensors: an offloaded input changed in place after the block's forward fails the backward,
// rather than recomputing from other values (or, on a GPU, from whichever the copy to the host read).
TEST(Recompute, OffloadedInputChangedInPlaceFailsTheBackward) {
  ConvBlock block(LayerSet::hierpar, 2, 3);
  const auto leaf = hierpar::testing::random_tensor({2, 2, 6, 6}, torch::kFloat).requires_grad_(true);
  const torch::Tensor x = leaf * 2;
  hierpar::nn::OffloadChain chain;
  const auto y = hierpar::nn::recompute([&](const torch::Tensor& t) { return block.forward(t); }, x, block.modules(), &chain);
  {
    torch::NoGradGuard no_grad;
    x.add_(1);
  }
  HIERPAR_EXPECT_THROW_MSG(y.sum().backward(), "recompute: the input of a block offloaded to host memory was modified "
                           "by an in-place operation after the block's forward");
}

// Synchronized BatchNorm normalises on the forward's thread with every replica's statistics; the backward's
// recomputation runs on autograd's thread without them, so a recomputed block refuses it.
TEST(Recompute, RefusesSynchronizedBatchNorm) {
  hierpar::testing::LocalBatchNormSync sync;
  ConvBlock block(LayerSet::hierpar, 2, 3);
  const auto x = hierpar::testing::random_tensor({2, 2, 6, 6}, torch::kFloat).requires_grad_(true);
  const hierpar::nn::BatchNormSyncGuard installed(&sync);
  HIERPAR_EXPECT_THROW_MSG(
      hierpar::nn::recompute([&](const torch::Tensor& t) { return block.forward(t); }, x, block.modules()),
      "recompute: synchronized BatchNorm (a BatchNormSync installed) in a recomputed block is not supported");
}

TEST(Recompute, OffloadedBlockRefusesSecondDerivatives) {
  ConvBlock block(LayerSet::stock, 2, 3);
  const auto x = hierpar::testing::random_tensor({2, 2, 6, 6}, torch::kFloat).requires_grad_(true);
  hierpar::nn::OffloadChain chain;
  const auto y = hierpar::nn::recompute([&](const torch::Tensor& t) { return block.forward(t); }, x, block.modules(), &chain);
  HIERPAR_EXPECT_THROW_MSG(torch::autograd::grad({y.square().sum()}, {x}, {}, true, /*create_graph=*/true),
                           "has no second derivatives (create_graph needs the input's history on the device); use "
                           "--memory recompute");
  EXPECT_EQ(hierpar::nn::parse_activation_memory("offload"), hierpar::nn::ActivationMemory::offload);
  HIERPAR_EXPECT_THROW_MSG(hierpar::nn::parse_activation_memory("swap"),
                           "--memory: expected none, recompute or offload, got 'swap'");
}
