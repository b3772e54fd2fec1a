// The tiny G/D pair and the training runs shared by AdversarialTrainer's step tests (test_adversarial_trainer_steps.cpp)
// and its CUDA-graph tests (test_adversarial_trainer_graphs.cpp).
//
// Tolerances: FusedAdam vs torch::optim::Adam and channels_last vs contiguous change only the order of
// floating-point operations; after K Adam steps (lr 1e-3) the parameters then differ by a few float32
// rounding units, except in gradient elements that are sums of cancelling terms, where Adam's m/sqrt(v)
// carries their larger relative error (see strategy_testing.h's kSplitBatchTolerance; seen: 3e-5 on one weight
// after 8 steps, HIERPAR_TEST_SEED=1500259483): 1e-4 absolute (a tenth of lr) admits that and is far below one
// step's movement. Graph replays run the very kernels of the eager
// steps on the same data: with deterministic cuDNN algorithms they agree to the same tolerance (seen: bit
// for bit), and bf16 autocast steps to bf16's tolerance.
#pragma once

#include "testing.h"

#include "hierpar/strategy/adversarial_trainer.h"

#include <functional>
#include <string>
#include <vector>

namespace adversarial_trainer_testing {

namespace hs = hierpar::strategy;
using hierpar::testing::Tolerance;


inline constexpr int64_t kNoise = 8;
inline constexpr Tolerance kReorderTolerance{1e-5, 1e-4};

// A tiny DCGAN-shaped pair: G noise [B, 8, 1, 1] -> [B, 3, 8, 8], D -> a logit per image, BatchNorm in both.
struct PairNetImpl : torch::nn::Cloneable<PairNetImpl> {
  explicit PairNetImpl(bool generator) : generator(generator) { reset(); }
  void reset() override {
    torch::nn::Sequential s;
    if (generator) {
      s->push_back(torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(kNoise, 6, 4).bias(false)));
      s->push_back(torch::nn::BatchNorm2d(6));
      s->push_back(torch::nn::ReLU());
      s->push_back(torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(6, 3, 4).stride(2).padding(1).bias(false)));
      s->push_back(torch::nn::Tanh());
    } else {
      s->push_back(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 6, 4).stride(2).padding(1).bias(false)));
      s->push_back(torch::nn::BatchNorm2d(6));
      s->push_back(torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)));
      s->push_back(torch::nn::Conv2d(torch::nn::Conv2dOptions(6, 1, 4).bias(false)));
    }
    layers = register_module("layers", s);
  }
  torch::Tensor forward(torch::Tensor x) {
    auto y = layers->forward(x);
    return generator ? y : y.flatten();
  }
  bool generator;
  torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(PairNet);

inline hs::AdversarialOptions base_options() {
  hs::AdversarialOptions options;
  options.noise_shape = {kNoise, 1, 1};
  options.generator_adam.lr = options.discriminator_adam.lr = 1e-3;
  return options;
}

struct TrainedRun {
  std::vector<torch::Tensor> state;  // G's then D's parameters and buffers, on the CPU
  torch::Tensor losses;              // take_losses() over the whole run
  std::vector<std::pair<double, double>> step_means;  // StepLosses::mean() of every step
  std::vector<torch::Tensor> ema;    // G's moving average (options.generator_ema_decay > 0), on the CPU
  int64_t graph_nodes = 0;
};

// `steps` steps from parameters seeded with `init_seed`, on batches `reals[k]`; the noise is drawn by the
// trainer (from the generator seeded with `noise_seed`) unless `noises` is given.
// A learning rate per step for both optimisers (set on their parameter groups before the step), or none.
using LrSchedule = std::function<double(size_t step)>;

inline TrainedRun train(const hs::Placement& placement, hs::AdversarialOptions options, const std::vector<torch::Tensor>& reals,
          uint64_t init_seed, uint64_t noise_seed, const std::vector<torch::Tensor>& noises = {},
          const LrSchedule& schedule = {}) {
  torch::manual_seed(init_seed);
  PairNet g(true), d(false);
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, options);
  torch::manual_seed(noise_seed);
  if (torch::cuda::is_available()) torch::cuda::manual_seed_all(noise_seed);
  TrainedRun run;
  for (size_t k = 0; k < reals.size(); ++k) {
    if (schedule) {
      for (torch::optim::Adam* optimizer : {&trainer.generator_optimizer(), &trainer.discriminator_optimizer()}) {
        static_cast<torch::optim::AdamOptions&>(optimizer->param_groups().front().options()).lr(schedule(k));
      }
    }
    auto losses = noises.empty() ? trainer.step(reals[k]) : trainer.step(reals[k], noises[k]);
    run.step_means.push_back(losses.mean());
  }
  run.losses = trainer.take_losses();
  for (auto* module : {trainer.generator().ptr().get(), trainer.discriminator().ptr().get()}) {
    for (const auto& p : module->parameters()) run.state.push_back(p.detach().cpu().contiguous().clone());
    for (const auto& b : module->buffers()) run.state.push_back(b.detach().cpu().clone());
  }
  for (const auto& e : trainer.generator_ema()) run.ema.push_back(e.detach().cpu().contiguous().clone());
  run.graph_nodes = trainer.graph_kernel_nodes();
  return run;
}

inline std::vector<torch::Tensor> batches(int64_t steps, int64_t batch, const torch::Device& device) {
  std::vector<torch::Tensor> out;
  for (int64_t k = 0; k < steps; ++k) out.push_back(hierpar::testing::random_tensor({batch, 3, 8, 8}, torch::TensorOptions().dtype(torch::kFloat).device(device)));
  return out;
}

inline void expect_same_run(const TrainedRun& actual, const TrainedRun& expected, Tolerance tol, const std::string& what) {
  ASSERT_EQ(actual.state.size(), expected.state.size()) << what;
  for (size_t i = 0; i < actual.state.size(); ++i)
    hierpar::testing::expect_close(actual.state[i], expected.state[i], tol, what + ": state tensor " + std::to_string(i));
  hierpar::testing::expect_close(actual.losses, expected.losses, tol, what + ": loss log");
  ASSERT_EQ(actual.ema.size(), expected.ema.size()) << what;
  for (size_t i = 0; i < actual.ema.size(); ++i)
    hierpar::testing::expect_close(actual.ema[i], expected.ema[i], tol, what + ": G's moving average " + std::to_string(i));
}

// The run must have trained: a comparison of untouched parameters would pass for anything.
inline void expect_moved(const TrainedRun& run, uint64_t init_seed) {
  torch::manual_seed(init_seed);
  PairNet g(true), d(false);
  std::vector<torch::Tensor> initial;
  for (auto* module : {static_cast<torch::nn::Module*>(g.get()), static_cast<torch::nn::Module*>(d.get())})
    for (const auto& p : module->parameters()) initial.push_back(p.detach());
  for (size_t i = 0; i < initial.size(); ++i)
    EXPECT_FALSE(torch::equal(run.state[i], initial[i])) << "parameter " << i << " did not move";
}

inline hs::Placement cpu_placement(const char* scheme, int64_t devices) {
  return hs::Placement::from_flags(scheme, devices, "host", c10::DeviceType::CPU, {});
}

}  // namespace adversarial_trainer_testing
