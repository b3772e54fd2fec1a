// GraphedStep (hierpar/strategy/graphed_step.h): a user's loop body captured and replayed computes what the same body
// run eagerly does; random draws change at each replay; a body that cannot be captured fails with one line naming the
// operator. The CUDA tests skip without a GPU; the argument checks run everywhere.
#include "testing.h"

#include "hierpar/nn.h"
#include "hierpar/optim.h"
#include "hierpar/strategy/graphed_step.h"

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

namespace hs = hierpar::strategy;

namespace {

// A small generator-like network as a user writes it, on `device`.
torch::nn::Sequential small_net(const torch::Device& device) {
  torch::nn::Sequential net(
      torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(8, 16, 4).bias(false)),
      hierpar::nn::BatchNormAct2d(16, hierpar::nn::Activation::relu),
      torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(16, 3, 4).stride(2).padding(1).bias(false)),
      torch::nn::Tanh());
  net->to(device);
  return net;
}

// One step of a user's loop: forward, a loss against `target`, backward, the optimiser's step.
std::function<void()> loop_body(torch::nn::Sequential& net, hierpar::optim::Adam& opt, const torch::Tensor& input,
                                const torch::Tensor& target) {
  return [&net, &opt, input, target] {
    opt.zero_grad();
    const torch::Tensor loss = torch::mse_loss(net->forward(input), target);
    loss.backward();
    opt.step();
  };
}

std::vector<torch::Tensor> parameters_of(torch::nn::Sequential& net) {
  std::vector<torch::Tensor> copies;
  for (const auto& p : net->parameters()) copies.push_back(p.detach().clone());
  return copies;
}

}  // namespace

TEST(GraphedStep, RefusesAnEmptyBodyAndNoWarmUp) {
  HIERPAR_EXPECT_THROW_MSG(hs::GraphedStep(nullptr, torch::Device(torch::kCUDA, 0)), "body: expected a function");
  hs::GraphedStepOptions options;
  options.warm_up_steps = 0;
  HIERPAR_EXPECT_THROW_MSG(hs::GraphedStep([] {}, torch::Device(torch::kCUDA, 0), options),
                           "warm_up_steps: expected at least 1");
}

TEST(GraphedStep, SaysWhyWithoutCuda) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is visible: the refusal applies to machines without one";
  HIERPAR_EXPECT_THROW_MSG(hs::GraphedStep([] {}, torch::Device(torch::kCUDA, 0)), "CUDA graphs need");
}

// Eight steps: three warm-up runs, the capture and its replay, four replays; the parameters equal those of eight
// eager steps of the same body from the same start, and the graph holds kernels.
TEST(GraphedStepCuda, ReplaysEqualEagerSteps) {
  HIERPAR_REQUIRE_CUDA();
  const torch::Device device(torch::kCUDA, 0);
  torch::manual_seed(3);
  auto eager_net = small_net(device);
  auto graphed_net = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(eager_net->clone(device));
  torch::nn::Sequential graphed(graphed_net);
  const auto options = torch::TensorOptions().device(device);
  const torch::Tensor input = torch::randn({5, 8, 3, 3}, options);
  const torch::Tensor target = torch::rand({5, 3, 12, 12}, options) * 2 - 1;
  hierpar::optim::Adam eager_opt(eager_net->parameters(), torch::optim::AdamOptions(1e-2));
  hierpar::optim::Adam graphed_opt(graphed->parameters(), torch::optim::AdamOptions(1e-2));
  const auto eager_step = loop_body(eager_net, eager_opt, input, target);
  hs::GraphedStep step(loop_body(graphed, graphed_opt, input, target), device);
  for (int i = 0; i < 8; ++i) {
    eager_step();
    step();
  }
  EXPECT_TRUE(step.captured());
  EXPECT_EQ(step.steps(), 8);
  EXPECT_GT(step.kernel_nodes(), 10);
  const auto expected = parameters_of(eager_net), actual = parameters_of(graphed);
  ASSERT_EQ(expected.size(), actual.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    // TF32 may differ between the eager and the captured run's convolution algorithms.
    EXPECT_TRUE(torch::allclose(actual[i], expected[i], 1e-3, 1e-4)) << "parameter " << i;
  }
}

// Noise drawn inside the body is new at every replay, as in the eager loop.
TEST(GraphedStepCuda, RandomDrawsChangeAtEachReplay) {
  HIERPAR_REQUIRE_CUDA();
  const torch::Device device(torch::kCUDA, 0);
  torch::Tensor noise = torch::empty({1024}, torch::TensorOptions().device(device));
  hs::GraphedStep step([&] { noise.copy_(torch::randn({1024}, noise.options())); }, device);
  std::vector<torch::Tensor> draws;
  for (int i = 0; i < 6; ++i) {
    step();
    draws.push_back(noise.clone());
  }
  ASSERT_TRUE(step.captured());
  EXPECT_FALSE(torch::equal(draws[4], draws[5]));
  EXPECT_FALSE(torch::equal(draws[3], draws[4]));
  EXPECT_NEAR(draws[5].std().item<double>(), 1.0, 0.1);
}

TEST(GraphedStepCuda, HostReadFailsNamingTheOperator) {
  HIERPAR_REQUIRE_CUDA();
  const torch::Device device(torch::kCUDA, 0);
  torch::Tensor x = torch::rand({64}, torch::TensorOptions().device(device)) + 1;
  double read = 0;
  hs::GraphedStepOptions options;
  options.warm_up_steps = 1;
  hs::GraphedStep step([&] { read = x.sum().item<double>(); }, device, options);
  step();  // warm-up: eager, allowed
  EXPECT_GT(read, 64.0);
  HIERPAR_EXPECT_THROW_MSG(step(), "cannot be captured into a CUDA graph at aten::item");
  // The device is usable after the failed capture.
  EXPECT_GT(x.sum().item<double>(), 64.0);
}

TEST(GraphedStepCuda, CpuTensorWorkIsRefused) {
  HIERPAR_REQUIRE_CUDA();
  const torch::Device device(torch::kCUDA, 0);
  torch::Tensor on_device = torch::rand({16}, torch::TensorOptions().device(device));
  torch::Tensor on_host = torch::rand({16});
  hs::GraphedStepOptions options;
  options.warm_up_steps = 1;
  hs::GraphedStep step([&] {
    on_device.add_(1);
    on_host.mul_(2);  // runs at capture only: refused
  }, device, options);
  step();
  HIERPAR_EXPECT_THROW_MSG(step(), "ran aten::mul_ on a CPU tensor while being captured");
  EXPECT_FALSE(step.captured());
}
