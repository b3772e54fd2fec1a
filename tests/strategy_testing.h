// The tiny G/D pair, data, options and references shared by the strategy's tests (test_strategy.cpp: schemes against
// single-device references and failing replicas; test_strategy_processes.cpp: ranks as processes of this binary).
#pragma once

#include "testing.h"

#include "hierpar/models/layer_factory.h"
#include "hierpar/strategy/adversarial_trainer.h"
#include "hierpar/strategy/averaging.h"
#include "hierpar/strategy/placement.h"
#include "hierpar/strategy/precision.h"

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace strategy_testing {

namespace hs = hierpar::strategy;
using hierpar::testing::Tolerance;


inline constexpr int64_t kNoise = 8;  // noise channels of the tiny generator
inline constexpr int64_t kSteps = 3;

// G: noise [B, 8, 1, 1] -> [B, 3, 8, 8]; D: [B, 3, 8, 8] -> logits [B, 1, 1, 1]. The BatchNorm comes from
// the models' layer factory (stock torch::nn::BatchNorm2d or hierpar::nn::BatchNormAct2d, the activation
// fused there), so that synchronized BatchNorm is tested on the layers the models use.
// AnyModule needs a non-templated forward (Sequential's is templated) and replicas need Cloneable.
struct TinyNetImpl : torch::nn::Cloneable<TinyNetImpl> {
  TinyNetImpl(bool generator, bool batch_norm, hierpar::LayerSet layer_set = hierpar::LayerSet::stock)
      : generator(generator), batch_norm(batch_norm), layer_set(layer_set) {
    reset();
  }
  void reset() override {
    const auto activation = generator ? hierpar::nn::Activation::relu : hierpar::nn::Activation::leaky_relu;
    if (generator) {
      auto c1 = torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(kNoise, 6, 4).bias(false));
      auto c2 = torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(6, 3, 4).stride(2).padding(1).bias(false));
      register_module("conv1", c1);
      first = [c1](const torch::Tensor& x) mutable { return c1->forward(x); };
      if (batch_norm) norm = hierpar::models::make_batch_norm_act2d(layer_set, 6, activation, 0.0);
      if (norm.module) register_module("bn", norm.module);
      register_module("conv2", c2);
      second = [c2](const torch::Tensor& x) mutable { return torch::tanh(c2->forward(x)); };
    } else {
      auto c1 = torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 6, 4).stride(2).padding(1).bias(false));
      auto c2 = torch::nn::Conv2d(torch::nn::Conv2dOptions(6, 1, 4).bias(false));
      register_module("conv1", c1);
      first = [c1](const torch::Tensor& x) mutable { return c1->forward(x); };
      if (batch_norm) norm = hierpar::models::make_batch_norm_act2d(layer_set, 6, activation, 0.2);
      if (norm.module) register_module("bn", norm.module);
      register_module("conv2", c2);
      second = [c2](const torch::Tensor& x) mutable { return c2->forward(x); };
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    x = first(x);
    if (batch_norm) return second(norm.forward(x));
    return second(generator ? torch::relu(x) : torch::leaky_relu(x, 0.2));
  }
  bool generator;
  bool batch_norm;
  hierpar::LayerSet layer_set;
  std::function<torch::Tensor(const torch::Tensor&)> first, second;
  hierpar::models::Layer norm;
};
TORCH_MODULE(TinyNet);

inline TinyNet tiny_generator(bool batch_norm, hierpar::LayerSet layers = hierpar::LayerSet::stock) {
  return TinyNet(true, batch_norm, layers);
}
inline TinyNet tiny_discriminator(bool batch_norm, hierpar::LayerSet layers = hierpar::LayerSet::stock) {
  return TinyNet(false, batch_norm, layers);
}

struct Data {
  torch::Tensor real;   // [steps, batch, 3, 8, 8] in [-1, 1)
  torch::Tensor noise;  // [steps, batch, 8, 1, 1]
};

inline Data make_data(int64_t batch, uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::rand({kSteps, batch, 3, 8, 8}) * 2 - 1, torch::randn({kSteps, batch, kNoise, 1, 1})};
}

inline hs::AdversarialOptions test_options(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  hs::AdversarialOptions options;
  options.noise_shape = {kNoise, 1, 1};
  options.generator_adam.lr = 1e-3;  // larger than DCGAN's 2e-4 so that K steps move the parameters visibly
  options.discriminator_adam.lr = 1e-3;
  // Adam moves every element by about lr whatever its gradient's size (m / sqrt(v)); an element whose gradient
  // nearly cancels, so that the split batch's summation order changes it relatively much, then moved by up to 8% of
  // lr apart from single's (seed 3796042111). An eps of 1e-4, above such gradients, keeps their steps as small as
  // they are; every run compared uses the same options.
  options.generator_adam.eps = 1e-4;
  options.discriminator_adam.eps = 1e-4;
  options.averaging.timeout = timeout;
  return options;
}

// Parameters then buffers of G, then of D, copied to the CPU.
inline std::vector<torch::Tensor> state_of(hs::AdversarialTrainer& trainer, int64_t local) {
  std::vector<torch::Tensor> state;
  for (auto* module : {trainer.generator(local).ptr().get(), trainer.discriminator(local).ptr().get()}) {
    for (const auto& p : module->parameters()) state.push_back(p.detach().cpu().clone());
  }
  return state;
}

// Trains the tiny pair under `placement` for kSteps on rows [first, first + rows) of each step's batch;
// returns every local replica's final parameters.
inline std::vector<std::vector<torch::Tensor>> train(const hs::Placement& placement, bool batch_norm, const Data& data,
                                              uint64_t init_seed, int64_t first = 0, int64_t rows = -1,
                                              const hs::AdversarialOptions& options = test_options(),
                                              hierpar::LayerSet layers = hierpar::LayerSet::stock,
                                              bool with_buffers = false) {
  torch::manual_seed(init_seed);
  auto g = tiny_generator(batch_norm, layers);
  auto d = tiny_discriminator(batch_norm, layers);
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, options);
  if (rows < 0) rows = data.real.size(1);
  for (int64_t k = 0; k < kSteps; ++k) {
    auto losses = trainer.step(data.real[k].narrow(0, first, rows), data.noise[k].narrow(0, first, rows));
    auto [d_loss, g_loss] = losses.mean();
    EXPECT_TRUE(std::isfinite(d_loss) && std::isfinite(g_loss)) << "step " << k;
  }
  std::vector<std::vector<torch::Tensor>> states;
  for (int64_t i = 0; i < placement.local_replicas(); ++i) {
    states.push_back(state_of(trainer, i));
    if (!with_buffers) continue;
    for (auto* module : {trainer.generator(i).ptr().get(), trainer.discriminator(i).ptr().get()}) {
      for (const auto& b : module->buffers()) {
        if (b.is_floating_point()) states.back().push_back(b.detach().cpu().clone());
      }
    }
  }
  return states;
}

inline void expect_states_equal(const std::vector<torch::Tensor>& actual, const std::vector<torch::Tensor>& expected,
                         const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_TRUE(torch::equal(actual[i], expected[i]))
        << what << ": tensor " << i << " differs by up to " << (actual[i] - expected[i]).abs().max().item<double>();
  }
}

inline void expect_states_close(const std::vector<torch::Tensor>& actual, const std::vector<torch::Tensor>& expected,
                         Tolerance tolerance, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    hierpar::testing::expect_close(actual[i], expected[i], tolerance, what + ": tensor " + std::to_string(i));
  }
}

// The parameters must have moved: a comparison of untrained parameters would pass for any scheme.
inline void expect_trained(const std::vector<torch::Tensor>& trained, uint64_t init_seed, bool batch_norm) {
  torch::manual_seed(init_seed);
  auto g = tiny_generator(batch_norm);
  auto d = tiny_discriminator(batch_norm);
  std::vector<torch::Tensor> initial;
  for (const auto& p : g->parameters()) initial.push_back(p.detach());
  for (const auto& p : d->parameters()) initial.push_back(p.detach());
  ASSERT_EQ(trained.size(), initial.size());
  for (size_t i = 0; i < trained.size(); ++i) EXPECT_FALSE(torch::equal(trained[i], initial[i])) << "tensor " << i;
}

// Data parallelism over `parts` equal parts, by hand on one device: each part is its own forward (so
// BatchNorm normalises each part separately), per-part gradients are summed in part order and divided
// by `parts`, then one Adam step -- what the replicas do together, without any strategy code.
inline std::vector<torch::Tensor> reference_per_part(bool batch_norm, const Data& data, int64_t parts, uint64_t init_seed) {
  torch::manual_seed(init_seed);
  auto g = tiny_generator(batch_norm);
  auto d = tiny_discriminator(batch_norm);
  const auto options = test_options();
  auto adam = [](const std::vector<torch::Tensor>& params, const hs::AdamSettings& s) {
    return torch::optim::Adam(params, torch::optim::AdamOptions(s.lr).betas({s.beta1, s.beta2}).eps(s.eps));
  };
  auto g_opt = adam(g->parameters(), options.generator_adam);
  auto d_opt = adam(d->parameters(), options.discriminator_adam);
  auto averaged_backward = [&](torch::nn::Module& module, const std::function<torch::Tensor(int64_t)>& loss_of_part) {
    const auto params = module.parameters();
    std::vector<torch::Tensor> sums;
    for (int64_t i = 0; i < parts; ++i) {
      module.zero_grad();
      loss_of_part(i).backward();
      for (size_t j = 0; j < params.size(); ++j) {
        const auto grad = params[j].grad().defined() ? params[j].grad().clone() : torch::zeros_like(params[j]);
        if (i == 0) sums.push_back(grad); else sums[j].add_(grad);
      }
    }
    for (size_t j = 0; j < params.size(); ++j) params[j].mutable_grad() = sums[j].div_(parts);
  };
  const int64_t share = data.real.size(1) / parts;
  for (int64_t k = 0; k < kSteps; ++k) {
    std::vector<torch::Tensor> fakes;
    for (int64_t i = 0; i < parts; ++i) fakes.push_back(g->forward(data.noise[k].narrow(0, i * share, share)));
    averaged_backward(*d, [&](int64_t i) {
      return hs::bce_with_logits_loss(d->forward(data.real[k].narrow(0, i * share, share)), hs::LossTerm::real) +
             hs::bce_with_logits_loss(d->forward(fakes[i].detach()), hs::LossTerm::fake);
    });
    d_opt.step();
    averaged_backward(*g, [&](int64_t i) { return hs::bce_with_logits_loss(d->forward(fakes[i]), hs::LossTerm::generator); });
    g_opt.step();
  }
  std::vector<torch::Tensor> state;
  for (const auto& p : g->parameters()) state.push_back(p.detach().clone());
  for (const auto& p : d->parameters()) state.push_back(p.detach().clone());
  return state;
}

// Parameters after kSteps on split batches vs on the whole batch, in fp32: the batch-mean reductions
// (loss mean, conv weight-gradient sums over the batch) are summed in a different order, ~1e-7
// relative to the summed terms. Adam's update lr * m / sqrt(v) carries the relative error of the
// gradient element itself, and an element that is a sum of cancelling terms has a much larger relative
// error than 1e-7 (seen: 5e-7 absolute after 3 steps, seed 2879733906). The absolute tolerance, 1% of
// lr = 1e-3, admits that and stays far below a wrong averaging, which moves parameters by O(lr) a step.
inline constexpr Tolerance kSplitBatchTolerance{1e-5, 1e-5};

// Synchronized BatchNorm against single on the whole batch: as above, plus the statistics, which come from one
// all-reduce of per-replica moments (var = (sum M2 + sum n m^2) / N - mean^2) instead of single's two-pass
// var_mean, with other rounding. Through the BatchNorm backward and Adam's normalised update, an element whose
// gradient nearly cancels moved by 1.14e-5 (1.1% of lr; G's first weight, seed 2458730771, 1 run in ~30), and by
// 4.5e-5 (one element of 768 in G's first weight, seed 4176273735, in CI). 7e-5 admits both and stays
// below the 1e-4 by which per-replica BatchNorm must differ (the test's last check).
inline constexpr Tolerance kSyncBatchNormTolerance{1e-5, 7e-5};

// cuDNN's deterministic algorithms, no autotuning, for the returned guard's lifetime: runs compared bit for bit must
// choose the same kernels.
[[nodiscard]] inline hierpar::testing::CudnnSettings deterministic_cudnn() {
  return hierpar::testing::CudnnSettings(/*deterministic=*/true, /*benchmark=*/false);
}

#define HIERPAR_REQUIRE_GLOO()                                                                        \
  do {                                                                                                \
    if (!hs::gloo_available()) GTEST_SKIP() << "this build has no Gloo (install libgloo-dev and reconfigure)"; \
  } while (0)

#define HIERPAR_REQUIRE_GPUS(n)                                                                       \
  do {                                                                                                \
    HIERPAR_REQUIRE_CUDA();                                                                           \
    if (static_cast<int64_t>(torch::cuda::device_count()) < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs"; \
  } while (0)

}  // namespace strategy_testing
