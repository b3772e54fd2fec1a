// AdversarialTrainer's step machinery (issue 7): the device-side loss log read every N steps, the noise
// drawn by the trainer, FusedAdam as its optimiser, channels_last, and CUDA-graph steps against eager
// steps (same seed, K steps, a learning-rate schedule, same parameters and losses). CPU tests run everywhere;
// the graph tests need a GPU and skip with a reason without one.
//
// Tolerances: FusedAdam vs torch::optim::Adam and channels_last vs contiguous change only the order of
// floating-point operations; after K Adam steps (lr 1e-3) the parameters then differ by a few float32
// rounding units, except in gradient elements that are sums of cancelling terms, where Adam's m/sqrt(v)
// carries their larger relative error (see test_strategy.cpp's kSplitBatchTolerance; seen: 3e-5 on one weight
// after 8 steps, HIERPAR_TEST_SEED=1500259483): 1e-4 absolute (a tenth of lr) admits that and is far below one
// step's movement. Graph replays run the very kernels of the eager
// steps on the same data: with deterministic cuDNN algorithms they agree to the same tolerance (seen: bit
// for bit), and bf16 autocast steps to bf16's tolerance.
#include "testing.h"

#include "hierpar/models/dcgan.h"
#include "hierpar/strategy/adversarial_trainer.h"
#include "hierpar/strategy/fused_adam.h"

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <stdexcept>

namespace hs = hierpar::strategy;
using hierpar::testing::Tolerance;

namespace {

constexpr int64_t kNoise = 8;
constexpr Tolerance kReorderTolerance{1e-5, 1e-4};

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

hs::AdversarialOptions base_options() {
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

TrainedRun train(const hs::Placement& placement, hs::AdversarialOptions options, const std::vector<torch::Tensor>& reals,
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

std::vector<torch::Tensor> batches(int64_t steps, int64_t batch, const torch::Device& device) {
  std::vector<torch::Tensor> out;
  for (int64_t k = 0; k < steps; ++k) out.push_back(hierpar::testing::random_tensor({batch, 3, 8, 8}, torch::TensorOptions().dtype(torch::kFloat).device(device)));
  return out;
}

void expect_same_run(const TrainedRun& actual, const TrainedRun& expected, Tolerance tol, const std::string& what) {
  ASSERT_EQ(actual.state.size(), expected.state.size()) << what;
  for (size_t i = 0; i < actual.state.size(); ++i)
    hierpar::testing::expect_close(actual.state[i], expected.state[i], tol, what + ": state tensor " + std::to_string(i));
  hierpar::testing::expect_close(actual.losses, expected.losses, tol, what + ": loss log");
  ASSERT_EQ(actual.ema.size(), expected.ema.size()) << what;
  for (size_t i = 0; i < actual.ema.size(); ++i)
    hierpar::testing::expect_close(actual.ema[i], expected.ema[i], tol, what + ": G's moving average " + std::to_string(i));
}

// The run must have trained: a comparison of untouched parameters would pass for anything.
void expect_moved(const TrainedRun& run, uint64_t init_seed) {
  torch::manual_seed(init_seed);
  PairNet g(true), d(false);
  std::vector<torch::Tensor> initial;
  for (auto* module : {static_cast<torch::nn::Module*>(g.get()), static_cast<torch::nn::Module*>(d.get())})
    for (const auto& p : module->parameters()) initial.push_back(p.detach());
  for (size_t i = 0; i < initial.size(); ++i)
    EXPECT_FALSE(torch::equal(run.state[i], initial[i])) << "parameter " << i << " did not move";
}

hs::Placement cpu_placement(const char* scheme, int64_t devices) {
  return hs::Placement::from_flags(scheme, devices, "host", c10::DeviceType::CPU, {});
}

}  // namespace

// ---- CPU ----------------------------------------------------------------------------------------------

// The loss log holds every step's (D real, D fake, G) losses; step() drains it itself when it is full.
TEST(AdversarialTrainerSteps, LossLogKeepsEveryStep) {
  auto options = base_options();
  options.loss_log_steps = hierpar::testing::rand_int(1, 3);
  const int64_t steps = 7;
  const auto reals = batches(steps, 4, torch::kCPU);
  torch::manual_seed(3);
  PairNet g(true), d(false);
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), cpu_placement("single", 1), options);
  std::vector<torch::Tensor> expected;
  for (int64_t k = 0; k < steps; ++k) {
    auto l = trainer.step(reals[k]);
    expected.push_back(torch::stack({l.discriminator_real[0], l.discriminator_fake[0], l.generator[0]}).clone());
    hierpar::testing::expect_close(l.discriminator[0], l.discriminator_real[0] + l.discriminator_fake[0], "D loss = real + fake");
    if (k == 2) {
      hierpar::testing::expect_close(trainer.take_losses(), torch::stack(expected), Tolerance{0, 0}, "first 3 steps");
      expected.clear();
    }
  }
  hierpar::testing::expect_close(trainer.take_losses(), torch::stack(expected), Tolerance{0, 0},
                                 "steps 4-7 with a log of " + std::to_string(options.loss_log_steps));
  EXPECT_EQ(trainer.take_losses().size(0), 0) << "nothing pending after a take";
}

// The trainer's own noise is the global batch's draw split over the replicas: the same as giving it.
TEST(AdversarialTrainerSteps, DrawnNoiseEqualsGivenNoise) {
  const int64_t steps = 3, batch = 4;
  const auto reals = batches(steps, batch, torch::kCPU);
  const uint64_t noise_seed = hierpar::testing::rng()();
  torch::manual_seed(noise_seed);
  std::vector<torch::Tensor> noises;
  for (int64_t k = 0; k < steps; ++k) noises.push_back(torch::randn({batch, kNoise, 1, 1}));
  for (const auto& [scheme, devices] : {std::pair{"single", 1}, std::pair{"data", 2}}) {
    const auto placement = cpu_placement(scheme, devices);
    // Noise drawn first in each step by the trainer; the given noise was drawn up front with the same seed.
    const TrainedRun drawn = train(placement, base_options(), reals, 11, noise_seed);
    const TrainedRun given = train(placement, base_options(), reals, 11, noise_seed + 1, noises);
    expect_same_run(drawn, given, Tolerance{0, 0}, std::string(scheme) + ": drawn vs given noise");
  }
}

// options.generator_ema_decay: G's moving average starts at the initial parameters and after every step is
// decay * before + (1 - decay) * the updated parameters; every replica of a data placement holds the same one.
TEST(AdversarialTrainerSteps, GeneratorEmaFollowsEachUpdate) {
  const double decay = 0.5 + 0.49 * hierpar::testing::rand_int(0, 100) / 100.0;
  const auto reals = batches(4, 4, torch::kCPU);
  for (const auto& [scheme, devices] : {std::pair{"single", 1}, std::pair{"data", 2}}) {
    SCOPED_TRACE(c10::str(scheme, ", decay ", decay));
    auto options = base_options();
    options.generator_ema_decay = decay;
    torch::manual_seed(hierpar::testing::rng()());
    PairNet g(true), d(false);
    hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), cpu_placement(scheme, devices),
                                   options);
    const auto parameters = trainer.generator().ptr()->parameters();
    std::vector<torch::Tensor> expected;
    for (const auto& p : parameters) expected.push_back(p.detach().clone());
    ASSERT_EQ(trainer.generator_ema().size(), parameters.size());
    for (size_t i = 0; i < parameters.size(); ++i)
      EXPECT_TRUE(torch::equal(trainer.generator_ema()[i], expected[i])) << "initially the parameters, " << i;
    for (const auto& real : reals) {
      trainer.step(real);
      for (size_t i = 0; i < parameters.size(); ++i) {
        expected[i] = decay * expected[i] + (1 - decay) * parameters[i].detach();
        hierpar::testing::expect_close(trainer.generator_ema()[i], expected[i], Tolerance{1e-6, 1e-7},
                                       "moving average of parameter " + std::to_string(i));
      }
    }
    EXPECT_FALSE(torch::equal(trainer.generator_ema()[0], parameters[0])) << "the average lags the parameters";
    if (devices == 2) {
      for (size_t i = 0; i < parameters.size(); ++i)
        EXPECT_TRUE(torch::equal(trainer.generator_ema(1)[i], trainer.generator_ema(0)[i])) << "replica 1, " << i;
    }
  }
  PairNet g(true), d(false);
  hs::AdversarialTrainer without(torch::nn::AnyModule(g), torch::nn::AnyModule(d), cpu_placement("single", 1),
                                 base_options());
  EXPECT_TRUE(without.generator_ema().empty());
}

TEST(AdversarialTrainerSteps, FusedAdamMatchesTorchAdam) {
  const auto reals = batches(4, 6, torch::kCPU);
  auto fused = base_options();
  fused.fused_adam = true;
  const TrainedRun a = train(cpu_placement("single", 1), fused, reals, 5, 9);
  const TrainedRun b = train(cpu_placement("single", 1), base_options(), reals, 5, 9);
  expect_moved(a, 5);
  expect_same_run(a, b, kReorderTolerance, "FusedAdam vs torch::optim::Adam");
}

TEST(AdversarialTrainerSteps, ChannelsLastMatchesContiguous) {
  const auto reals = batches(3, 6, torch::kCPU);
  auto channels_last = base_options();
  channels_last.precision.channels_last = true;
  channels_last.fused_adam = true;
  auto contiguous = base_options();
  contiguous.fused_adam = true;
  const TrainedRun a = train(cpu_placement("single", 1), channels_last, reals, 8, 2);
  const TrainedRun b = train(cpu_placement("single", 1), contiguous, reals, 8, 2);
  expect_moved(a, 8);
  expect_same_run(a, b, kReorderTolerance, "channels_last vs contiguous");
}

TEST(AdversarialTrainerSteps, RejectsBadOptions) {
  auto make = [](const hs::AdversarialOptions& options, const hs::Placement& placement) {
    PairNet g(true), d(false);
    hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, options);
  };
  auto options = base_options();
  options.cuda_graphs = true;
  HIERPAR_EXPECT_THROW_MSG(make(options, cpu_placement("single", 1)), "cuda_graphs needs fused_adam");
  options.fused_adam = true;
  HIERPAR_EXPECT_THROW_MSG(make(options, cpu_placement("single", 1)), "cuda_graphs needs CUDA devices, got G cpu");
  options = base_options();
  options.loss_log_steps = 0;
  HIERPAR_EXPECT_THROW_MSG(make(options, cpu_placement("single", 1)), "loss_log_steps must be at least 1, got 0");
  options = base_options();
  options.generator_ema_decay = 1.0;
  HIERPAR_EXPECT_THROW_MSG(make(options, cpu_placement("single", 1)), "generator_ema_decay must be in [0, 1)");
  options = base_options();
  options.r1_gamma = -1;
  HIERPAR_EXPECT_THROW_MSG(make(options, cpu_placement("single", 1)), "options.r1_gamma must be >= 0");
  options.r1_gamma = 1;
  options.r1_every = 0;
  HIERPAR_EXPECT_THROW_MSG(make(options, cpu_placement("single", 1)), "options.r1_every must be at least 1, got 0");
  options.r1_every = 4;
  options.sync_batch_norm = true;
  HIERPAR_EXPECT_THROW_MSG(make(options, cpu_placement("data", 2)), "cannot differentiate through synchronized BatchNorm");
}

// The R1 penalty: on its steps (every r1_every-th, the first included) D's gradient is that of loss(D(real), real) +
// (gamma / 2) * r1_every * mean |d sum D(real) / d real|^2 + loss(D(fakes), fake), computed here by hand; on the other
// steps it has no penalty. With a learning rate of 0 the networks stay as initialised, so every step's gradient
// can be computed by hand from the same networks; the penalised and plain gradients differ (the test can fail).
TEST(AdversarialTrainerSteps, R1PenaltyJoinsDsLossOnItsSteps) {
  const int64_t batch = 4;
  const auto reals = batches(2, batch, torch::kCPU);
  const auto noise = torch::randn({batch, kNoise, 1, 1});
  const double gamma = 3.0;
  auto expected = [&](bool penalised, int64_t every, size_t k) {
    torch::manual_seed(11);
    PairNet g(true), d(false);
    const auto fakes = g->forward(noise).detach();
    const auto real = reals[k].clone().requires_grad_(true);
    const auto logits = d->forward(real);
    torch::Tensor objective = hs::bce_with_logits_loss(logits, hs::LossTerm::real);
    if (penalised) {
      const auto grad = torch::autograd::grad({logits.sum()}, {real}, {}, true, true)[0];
      objective = objective + grad.square().flatten(1).sum(1).mean() * (0.5 * gamma * static_cast<double>(every));
    }
    objective.backward();
    hs::bce_with_logits_loss(d->forward(fakes), hs::LossTerm::fake).backward();
    std::vector<torch::Tensor> grads;
    for (const auto& p : d->parameters()) grads.push_back(p.grad().clone());
    return grads;
  };
  auto trained = [&](int64_t every, int steps) {
    auto options = base_options();
    options.generator_adam.lr = options.discriminator_adam.lr = 0.0;
    options.r1_gamma = gamma;
    options.r1_every = every;
    torch::manual_seed(11);
    PairNet g(true), d(false);
    hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), cpu_placement("single", 1), options);
    for (int k = 0; k < steps; ++k) trainer.step(reals[k], noise);
    std::vector<torch::Tensor> grads;
    for (const auto& p : trainer.discriminator().ptr()->parameters()) grads.push_back(p.grad().clone());
    return grads;
  };
  auto expect_all_close = [](const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, const std::string& what) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      hierpar::testing::expect_close(a[i], b[i], {1e-5, 1e-7}, what + ", D gradient " + std::to_string(i));
    }
  };
  expect_all_close(trained(2, 1), expected(true, 2, 0), "every 2, step 0 (penalised)");
  expect_all_close(trained(2, 2), expected(false, 2, 1), "every 2, step 1 (plain)");
  expect_all_close(trained(1, 2), expected(true, 1, 1), "every 1, step 1 (penalised)");
  const auto penalised = expected(true, 1, 0), plain = expected(false, 1, 0);
  double largest = 0;
  for (size_t i = 0; i < plain.size(); ++i) largest = std::max(largest, (penalised[i] - plain[i]).abs().max().item<double>());
  EXPECT_GT(largest, 1e-4) << "the penalty should change D's gradient";
}

// The hinge and Wasserstein losses and WGAN-GP's gradient penalty: D's gradient of one step against a hand computation
// from the same networks (lr 0 keeps them as initialised), the penalty's interpolation weights drawn alike.
TEST(AdversarialTrainerSteps, LossesAndGradientPenaltyGiveDsGradient) {
  const int64_t batch = 4;
  const auto real = batches(1, batch, torch::kCPU)[0];
  const auto noise = torch::randn({batch, kNoise, 1, 1});
  struct Variant {
    const char* name;
    hs::AdversarialLoss loss;
    double penalty;
  };
  for (const Variant& v : {Variant{"hinge", hs::hinge_loss, 0.0}, Variant{"wasserstein", hs::wasserstein_loss, 0.0},
                           Variant{"wasserstein + gradient penalty", hs::wasserstein_loss, 10.0}}) {
    std::vector<torch::Tensor> expected;
    {
      torch::manual_seed(31);
      PairNet g(true), d(false);
      const auto fakes = g->forward(noise).detach();
      v.loss(d->forward(real), hs::LossTerm::real).backward();
      torch::Tensor objective = v.loss(d->forward(fakes), hs::LossTerm::fake);
      if (v.penalty > 0) {
        torch::manual_seed(32);
        const auto e = torch::rand({batch, 1, 1, 1});
        const auto mixed = (real * e + fakes * (1 - e)).requires_grad_(true);
        const auto grad = torch::autograd::grad({d->forward(mixed).sum()}, {mixed}, {}, true, true)[0];
        objective = objective + (grad.flatten(1).norm(2, {1}) - 1).square().mean() * v.penalty;
      }
      objective.backward();
      for (const auto& p : d->parameters()) expected.push_back(p.grad().clone());
    }
    auto options = base_options();
    options.generator_adam.lr = options.discriminator_adam.lr = 0.0;
    options.loss = v.loss;
    options.gradient_penalty = v.penalty;
    torch::manual_seed(31);
    PairNet g(true), d(false);
    hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), cpu_placement("single", 1), options);
    torch::manual_seed(32);
    trainer.step(real, noise);
    const auto params = trainer.discriminator().ptr()->parameters();
    ASSERT_EQ(params.size(), expected.size());
    for (size_t i = 0; i < params.size(); ++i) {
      hierpar::testing::expect_close(params[i].grad(), expected[i], {1e-5, 1e-7},
                                     std::string(v.name) + ", D gradient " + std::to_string(i));
    }
  }
}

// hierpar's layer set computes the penalties through its own layers (their second derivatives: conv2d with its fused
// LeakyReLU, BatchNorm + LeakyReLU keeping its input for the penalties' passes) as stock's does: the seed's DCGAN, 3
// steps of WGAN-GP with R1 on every step.
TEST(AdversarialTrainerSteps, PenaltiesThroughHierparLayersMatchStock) {
  std::vector<std::vector<torch::Tensor>> states;
  const auto reals = batches(3, 4, torch::kCPU);
  for (const auto layers : {hierpar::LayerSet::stock, hierpar::LayerSet::hierpar}) {
    const auto model = hierpar::testing::small_dcgan(layers, kNoise);
    torch::manual_seed(21);
    hierpar::models::Generator g(model);
    hierpar::models::Discriminator d(model);
    auto options = base_options();
    options.r1_gamma = 5.0;
    options.r1_every = 1;
    options.loss = hs::wasserstein_loss;
    options.gradient_penalty = 10.0;
    hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), cpu_placement("single", 1), options);
    torch::manual_seed(22);
    std::vector<torch::Tensor> state;
    for (int k = 0; k < 3; ++k) {
      trainer.step(torch::nn::functional::interpolate(reals[k], torch::nn::functional::InterpolateFuncOptions()
                                                                    .size(std::vector<int64_t>{32, 32})
                                                                    .mode(torch::kNearest)));
    }
    for (const auto& p : trainer.discriminator().ptr()->parameters()) state.push_back(p.detach().clone());
    states.push_back(state);
  }
  // The penalties differentiate twice, so rounding reaches more gradient elements near zero, which Adam turns into
  // a step of either sign (HIERPAR_TEST_SEED=1675731566: one weight of 8192 1.2e-4 apart): every element within 3
  // steps of lr, all but 0.1% within the reorder tolerance.
  const double lr = base_options().discriminator_adam.lr;
  for (size_t i = 0; i < states[0].size(); ++i) {
    const auto& ours = states[1][i];
    const auto& stock = states[0][i];
    const auto diff = (ours - stock).abs();
    EXPECT_LE(diff.max().item<double>(), 3 * lr) << "D parameter " << i;
    const int64_t off =
        (diff > kReorderTolerance.atol + kReorderTolerance.rtol * stock.abs()).sum().item<int64_t>();
    EXPECT_LE(off, std::max<int64_t>(1, ours.numel() / 1000))
        << "D parameter " << i << ": " << off << " of " << ours.numel() << " elements beyond the reorder tolerance";
  }
}

// ---- CUDA graphs ----------------------------------------------------------------------------------------

namespace {
void deterministic_cudnn() {
  at::globalContext().setDeterministicCuDNN(true);
  at::globalContext().setBenchmarkCuDNN(false);
  at::globalContext().setAllowTF32CuDNN(false);
  at::globalContext().setAllowTF32CuBLAS(false);
}

// The options of an eager run with FusedAdam, and the same captured as CUDA graphs after 2 eager warm-up steps.
std::pair<hs::AdversarialOptions, hs::AdversarialOptions> eager_and_graph_options() {
  auto eager = base_options();
  eager.fused_adam = true;
  auto graphs = eager;
  graphs.cuda_graphs = true;
  graphs.graph_warmup_steps = 2;
  return {eager, graphs};
}

// `placement` trained on `reals` as graphs and eagerly ends the same (within `tol`); returns the eager run.
TrainedRun expect_graphs_equal_eager(const hs::Placement& placement, const std::vector<torch::Tensor>& reals,
                                     Tolerance tol, const std::string& what) {
  const auto [eager, graphs] = eager_and_graph_options();
  const TrainedRun a = train(placement, graphs, reals, 4, 6);
  const TrainedRun b = train(placement, eager, reals, 4, 6);
  EXPECT_GT(a.graph_nodes, 10) << what;
  expect_moved(a, 4);
  expect_same_run(a, b, tol, what + ": graphs vs eager");
  return b;
}
}  // namespace

// K steps as graphs (2 eager warm-up steps, a capture, replays) equal K eager steps: parameters, BatchNorm
// statistics and every step's losses; in fp32 and in bf16 autocast with channels_last.
TEST(AdversarialTrainerGraphs, GraphStepsEqualEagerSteps) {
  HIERPAR_REQUIRE_CUDA();
  deterministic_cudnn();
  const auto placement = hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CUDA, {});
  const auto reals = batches(9, 16, torch::kCUDA);
  const uint64_t init = hierpar::testing::rng()(), noise = hierpar::testing::rng()();
  for (bool bf16 : {false, true}) {
    auto eager = base_options();
    eager.fused_adam = true;
    eager.loss_log_steps = 4;
    eager.generator_ema_decay = 0.9;  // captured with G's update
    if (bf16) {
      eager.precision = hs::StepPrecision{hs::StepPrecision::Math::bf16, true};
    }
    auto graphs = eager;
    graphs.cuda_graphs = true;
    graphs.graph_warmup_steps = 2;
    // A learning-rate schedule that changes after the capture (step 2) must reach the replayed updates.
    const LrSchedule schedule = [](size_t k) { return k < 5 ? 1e-3 : 2.5e-4; };
    const TrainedRun a = train(placement, graphs, reals, init, noise, {}, schedule);
    const TrainedRun b = train(placement, eager, reals, init, noise, {}, schedule);
    const std::string what = bf16 ? "bf16 + channels_last: graphs vs eager" : "fp32: graphs vs eager";
    EXPECT_GT(a.graph_nodes, 10) << what << ": the step was captured";
    EXPECT_EQ(b.graph_nodes, 0);
    expect_moved(a, init);
    ASSERT_EQ(a.losses.size(0), 9) << what;
    expect_same_run(a, b, bf16 ? hierpar::testing::tolerance_for(torch::kBFloat16) : kReorderTolerance, what);
    for (size_t k = 0; k < a.step_means.size(); ++k) {
      EXPECT_NEAR(a.step_means[k].first, b.step_means[k].first, 1e-4) << what << " step " << k;
      EXPECT_NEAR(a.step_means[k].second, b.step_means[k].second, 1e-4) << what << " step " << k;
    }
  }
}

// A batch written straight into graph_input() and stepped on in place trains like a batch the step copies
// there; without graphs there is no such buffer.
TEST(AdversarialTrainerGraphs, GraphInputIsReadInPlace) {
  HIERPAR_REQUIRE_CUDA();
  deterministic_cudnn();
  const auto placement = hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CUDA, {});
  const auto reals = batches(6, 16, torch::kCUDA);
  auto options = base_options();
  options.fused_adam = options.cuda_graphs = true;
  options.graph_warmup_steps = 2;
  const TrainedRun copied = train(placement, options, reals, 11, 12);

  torch::manual_seed(11);
  PairNet g(true), d(false);
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, options);
  torch::manual_seed(12);
  torch::cuda::manual_seed_all(12);
  EXPECT_FALSE(trainer.graph_input().defined()) << "no buffer before the first step";
  trainer.step(reals[0]);
  const torch::Tensor input = trainer.graph_input();
  ASSERT_TRUE(input.defined());
  for (size_t k = 1; k < reals.size(); ++k) {
    input.copy_(reals[k]);
    trainer.step(input);
  }
  std::vector<torch::Tensor> state;
  for (auto* module : {trainer.generator().ptr().get(), trainer.discriminator().ptr().get()}) {
    for (const auto& p : module->parameters()) state.push_back(p.detach().cpu().contiguous().clone());
    for (const auto& b : module->buffers()) state.push_back(b.detach().cpu().clone());
  }
  ASSERT_EQ(state.size(), copied.state.size());
  for (size_t i = 0; i < state.size(); ++i)
    hierpar::testing::expect_close(state[i], copied.state[i], kReorderTolerance, "state tensor " + std::to_string(i));

  options.cuda_graphs = false;
  hs::AdversarialTrainer eager(torch::nn::AnyModule(PairNet(true)), torch::nn::AnyModule(PairNet(false)), placement,
                               options);
  eager.step(reals[0]);
  EXPECT_FALSE(eager.graph_input().defined()) << "eager steps read the batch where it is";
}

// G's forward and D's pass over the fakes on a second stream (options.overlap_passes, the default) give the
// numbers of one stream: in fp32 the same kernels on the same data, D's two gradient branches summed in either
// order (a + b == b + a), so bit for bit eagerly and to the graph tolerance as graphs; in bf16 autocast the
// overlapped step casts D's weights per pass (no cast cache shared across streams), so D's gradient sums round
// once more: bf16's tolerance. On the tiny pair and on the seed's DCGAN with hierpar's layers at batch 64
// (passes long enough for the streams to run side by side, so missing ordering would show).
TEST(AdversarialTrainerGraphs, OverlappedPassesEqualOneStream) {
  HIERPAR_REQUIRE_CUDA();
  deterministic_cudnn();
  const auto placement = hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CUDA, {});
  const uint64_t init = hierpar::testing::rng()(), noise = hierpar::testing::rng()();
  for (bool bf16 : {false, true}) {
    auto one_stream = base_options();
    one_stream.fused_adam = true;
    one_stream.overlap_passes = false;
    if (bf16) {
      one_stream.precision = hs::StepPrecision{hs::StepPrecision::Math::bf16, true};
    }
    auto overlapped = one_stream;
    overlapped.overlap_passes = true;
    auto overlapped_graphs = overlapped;
    overlapped_graphs.cuda_graphs = true;
    overlapped_graphs.graph_warmup_steps = 2;
    const auto reals = batches(6, 16, torch::kCUDA);
    const TrainedRun a = train(placement, one_stream, reals, init, noise);
    const TrainedRun b = train(placement, overlapped, reals, init, noise);
    const TrainedRun c = train(placement, overlapped_graphs, reals, init, noise);
    const std::string what = bf16 ? "bf16 + channels_last" : "fp32";
    expect_moved(a, init);
    const Tolerance tol = bf16 ? hierpar::testing::tolerance_for(torch::kBFloat16) : kReorderTolerance;
    expect_same_run(b, a, tol, what + ": overlapped eager vs one stream");
    expect_same_run(c, a, tol, what + ": overlapped graphs vs one stream");
    if (!bf16) {
      for (size_t i = 0; i < a.state.size(); ++i)
        EXPECT_TRUE(torch::equal(b.state[i], a.state[i])) << "fp32 eager, state tensor " << i << " not bit for bit";
    }
  }

  // The seed's DCGAN, hierpar's layers, channels_last, batch 64, fp32 (TF32 off) and bf16.
  for (bool bf16 : {false, true}) {
    auto run = [&](bool overlap, bool graphs) {
      hierpar::models::DCGANOptions model;
      model.layers = hierpar::LayerSet::hierpar;
      torch::manual_seed(init);
      hierpar::models::Generator g(model);
      hierpar::models::Discriminator d(model);
      hs::AdversarialOptions options;
      options.noise_shape = {model.nz, 1, 1};
      options.fused_adam = true;
      options.precision.channels_last = true;
      options.overlap_passes = overlap;
      options.cuda_graphs = graphs;
      options.graph_warmup_steps = 2;
      if (bf16) options.precision.math = hs::StepPrecision::Math::bf16;
      hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, options);
      torch::manual_seed(noise);
      torch::cuda::manual_seed_all(noise);
      hierpar::testing::rng().seed(noise);
      for (int k = 0; k < 5; ++k) {
        trainer.step(hierpar::testing::random_tensor({64, 3, 64, 64}, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA),
                                                     hierpar::testing::Layout::channels_last));
      }
      std::vector<torch::Tensor> state;
      for (auto* module : {trainer.generator().ptr().get(), trainer.discriminator().ptr().get()}) {
        for (const auto& p : module->parameters()) state.push_back(p.detach().cpu().contiguous().clone());
        for (const auto& b : module->buffers()) state.push_back(b.detach().cpu().clone());
      }
      return std::pair{state, trainer.take_losses()};
    };
    const auto [state_a, losses_a] = run(false, false);
    const std::string what = std::string("DCGAN batch 64 ") + (bf16 ? "bf16" : "fp32");
    const Tolerance tol = bf16 ? hierpar::testing::tolerance_for(torch::kBFloat16) : kReorderTolerance;
    for (bool graphs : {false, true}) {
      const auto [state_b, losses_b] = run(true, graphs);
      ASSERT_EQ(state_a.size(), state_b.size());
      for (size_t i = 0; i < state_a.size(); ++i)
        hierpar::testing::expect_close(state_b[i], state_a[i], tol,
                                       what + (graphs ? ", overlapped graphs" : ", overlapped eager") +
                                           " vs one stream: state tensor " + std::to_string(i));
      hierpar::testing::expect_close(losses_b, losses_a, tol, what + ": loss log");
    }
  }
}

// Data parallelism over 2 GPUs, host and NCCL averaging, graphs against eager (host averaging runs between three
// graphs per replica; NCCL's bucketed all-reduces are captured in the step's one graph).
TEST(AdversarialTrainerGraphs, DataParallelGraphsEqualEagerHostAndNccl) {
  HIERPAR_REQUIRE_TWO_GPUS();
  deterministic_cudnn();
  const auto reals = batches(6, 16, torch::kCUDA);
  for (const char* reduce : {"host", "nccl"}) {
    expect_graphs_equal_eager(hs::Placement::from_flags("data", 2, reduce, c10::DeviceType::CUDA, {}), reals,
                              kReorderTolerance, std::string("data x2, ") + reduce + " averaging");
  }
}

// NCCL averaging under CUDA graphs is captured: the buckets' all-reduces are nodes of the backward's graph, so a
// data-parallel step replays as one graph per replica, with no averaging piece of its own between segments. On 2
// and 4 GPUs, with caps that cut the tiny networks into several buckets, the captured step gives the numbers of the
// eager bucketed step and of captured steps that all-reduce one flat buffer between their segments
// (capture_collectives off): bit for bit on 2 GPUs (a + b), within the reorder tolerance on 4 (NCCL may sum four
// values in another order for another buffer size or algorithm). progress() counts the replayed steps.
TEST(AdversarialTrainerGraphs, NcclAveragingIsCapturedInTheStep) {
  HIERPAR_REQUIRE_TWO_GPUS();
  deterministic_cudnn();
  const auto reals = batches(6, 16, torch::kCUDA);
  auto [eager, graphs] = eager_and_graph_options();
  for (auto* options : {&eager, &graphs}) {
    options->averaging.first_bucket_cap_bytes = 64;
    options->averaging.bucket_cap_bytes = 512;
  }
  auto between = graphs;
  between.averaging.capture_collectives = false;
  for (int64_t gpus : {2, 4}) {
    if (gpus > static_cast<int64_t>(torch::cuda::device_count())) {
      std::cout << "data x" << gpus << " skipped: " << torch::cuda::device_count() << " GPUs\n";
      continue;
    }
    const auto placement = hs::Placement::from_flags("data", gpus, "nccl", c10::DeviceType::CUDA, {});
    const std::string what = "data x" + std::to_string(gpus) + ", nccl: ";
    const Tolerance tol = gpus == 2 ? Tolerance{0, 0} : kReorderTolerance;
    const TrainedRun captured = train(placement, graphs, reals, 4, 6);
    const TrainedRun eager_run = train(placement, eager, reals, 4, 6);
    const TrainedRun between_run = train(placement, between, reals, 4, 6);
    expect_moved(captured, 4);
    expect_same_run(captured, eager_run, tol, what + "captured all-reduce vs eager buckets");
    expect_same_run(captured, between_run, tol, what + "captured all-reduce vs flat all-reduce between segments");
  }

  // The replayed step: one compute span per replica that holds both averages.
  torch::manual_seed(4);
  PairNet g(true), d(false);
  const auto placement = hs::Placement::from_flags("data", 2, "nccl", c10::DeviceType::CUDA, {});
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, graphs);
  EXPECT_EQ(trainer.graph_averaging(), hs::GraphAveraging::whole);
  for (int k = 0; k < 4; ++k) trainer.step(reals[k]);
  const int64_t before = trainer.progress();
  trainer.record_timeline(true);
  trainer.step(reals[4]);
  trainer.step(reals[5]);
  const auto spans = trainer.timeline();
  EXPECT_EQ(trainer.progress(), before + 2 * 2) << "two replayed steps of two replicas";
  ASSERT_EQ(spans.size(), 4u) << "one span per replica and step";
  for (const auto& span : spans) {
    EXPECT_TRUE(span.compute) << span.piece;
    EXPECT_NE(span.piece.find("average D"), std::string::npos) << span.piece;
    EXPECT_NE(span.piece.find("average G"), std::string::npos) << span.piece;
  }
  hs::AdversarialTrainer flat(torch::nn::AnyModule(PairNet(true)), torch::nn::AnyModule(PairNet(false)), placement,
                              between);
  EXPECT_EQ(flat.graph_averaging(), hs::GraphAveraging::between);
}

// A replica that hangs while the others' captured all-reduces wait for it on the GPU (no host wait to time out) is
// named once the averaging timeout has passed since replica 0 returned from the step, and the communicators are
// aborted, so the step ends within seconds instead of never. The hung replica, released afterwards, leaves by an
// exception (it must not replay against aborted communicators).
TEST(AdversarialTrainerGraphs, HungReplicaUnderCapturedNcclIsNamedAfterTheTimeout) {
  HIERPAR_REQUIRE_TWO_GPUS();
  const auto reals = batches(6, 16, torch::kCUDA);
  auto options = eager_and_graph_options().second;
  options.averaging.timeout = std::chrono::seconds(2);
  options.report_failures = false;
  auto gate = std::make_shared<std::pair<std::mutex, std::condition_variable>>();
  auto released = std::make_shared<bool>(false);
  options.fault_hook = [gate, released](int64_t replica, int64_t step) {
    if (replica != 1 || step != 4) return;
    std::unique_lock<std::mutex> lock(gate->first);
    gate->second.wait(lock, [&] { return *released; });
    throw std::runtime_error("released after the test");
  };
  torch::manual_seed(4);
  PairNet g(true), d(false);
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d),
                                 hs::Placement::from_flags("data", 2, "nccl", c10::DeviceType::CUDA, {}), options);
  ASSERT_EQ(trainer.graph_averaging(), hs::GraphAveraging::whole);
  for (int k = 0; k < 4; ++k) trainer.step(reals[k]);  // two eager steps, the capture, a replay
  const auto start = std::chrono::steady_clock::now();
  HIERPAR_EXPECT_THROW_MSG(trainer.step(reals[4]), "replica 1 (G cuda:1, D cuda:1) hangs: it had not returned from "
                                                   "its step 2.0 s after replica 0 did");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GT(seconds, 1.9) << "named before the timeout";
  EXPECT_LT(seconds, 6.0) << "the 2 s timeout took " << seconds << " s";
  HIERPAR_EXPECT_THROW_MSG(trainer.step(reals[5]), "refuses every later one");
  {
    std::lock_guard<std::mutex> lock(gate->first);
    *released = true;
  }
  gate->second.notify_all();
}

// Host averaging on 2 GPUs: eager steps sum buckets on the replicas' threads during the backward (caps of a few
// hundred bytes cut the networks into several), and give the numbers of one flat buffer per network after the
// backward (caps 0), of captured steps (flat, between the segments) and of captured steps whose bucket copies are
// graph nodes (capture_host_copies) bit for bit: every element is the same sum of the same two values, divided
// alike. Two runs of each kind in one process, as a user's runs follow each other.
TEST(AdversarialTrainerGraphs, BucketedHostAveragingEqualsFlatAndGraphs) {
  HIERPAR_REQUIRE_TWO_GPUS();
  deterministic_cudnn();
  const auto reals = batches(6, 16, torch::kCUDA);
  const auto placement = hs::Placement::from_flags("data", 2, "host", c10::DeviceType::CUDA, {});
  auto bucketed = eager_and_graph_options().first;
  bucketed.averaging.first_bucket_cap_bytes = 64;
  bucketed.averaging.bucket_cap_bytes = 512;
  auto flat = bucketed;
  flat.averaging.bucket_cap_bytes = 0;
  const auto graphs = eager_and_graph_options().second;
  auto captured_copies = graphs;
  captured_copies.averaging = bucketed.averaging;
  captured_copies.averaging.capture_host_copies = true;
  for (int round = 0; round < 2; ++round) {
    const std::string what = "data x2, host averaging, round " + std::to_string(round) + ": ";
    const TrainedRun a = train(placement, bucketed, reals, 4, 6);
    const TrainedRun b = train(placement, flat, reals, 4, 6);
    const TrainedRun c = train(placement, graphs, reals, 4, 6);
    const TrainedRun d = train(placement, captured_copies, reals, 4, 6);
    expect_moved(a, 4);
    expect_same_run(a, b, Tolerance{0, 0}, what + "bucketed vs flat");
    expect_same_run(c, b, Tolerance{0, 0}, what + "graphs vs eager flat");
    expect_same_run(d, b, Tolerance{0, 0}, what + "graphs with captured bucket copies vs eager flat");
  }
  torch::manual_seed(4);
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(PairNet(true)), torch::nn::AnyModule(PairNet(false)), placement,
                                 captured_copies);
  EXPECT_EQ(trainer.graph_averaging(), hs::GraphAveraging::copies);
}

// Placements whose step spans two devices are captured per device (G's segments on G's GPU, D's on D's, the copies
// and host averaging between, NCCL's all-reduces inside): task on 2 GPUs and hierarchical on 4 (host and NCCL
// averaging), graphs against eager, and task against single. The same kernels on the same data in the same order:
// bit for bit.
TEST(AdversarialTrainerGraphs, TaskAndHierarchicalGraphsEqualEager) {
  HIERPAR_REQUIRE_TWO_GPUS();
  deterministic_cudnn();
  const auto reals = batches(6, 16, torch::kCUDA);
  constexpr Tolerance kExact{0, 0};
  const TrainedRun task_eager =
      expect_graphs_equal_eager(hs::Placement::from_flags("task", 2, "host", c10::DeviceType::CUDA, {}), reals, kExact,
                                "task");
  const TrainedRun single = train(hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CUDA, {}),
                                  eager_and_graph_options().first, reals, 4, 6);
  expect_same_run(task_eager, single, kExact, "task vs single (eager)");
  if (torch::cuda::device_count() < 4) {
    std::cout << "hierarchical rows skipped: " << torch::cuda::device_count() << " GPUs, needs 4\n";
    return;
  }
  for (const char* reduce : {"host", "nccl"}) {
    expect_graphs_equal_eager(hs::Placement::from_flags("hierarchical", 4, reduce, c10::DeviceType::CUDA, {}), reals,
                              kExact, std::string("hierarchical x2, ") + reduce + " averaging");
  }
}

// On a task placement D's device runs D's pass over the next real batch while G's device runs G's backward and
// update of the step before: in every steady-state step of the timeline, "D real" starts before the previous step's
// G update ends. A step that made D's real pass wait for G's update (serialised devices) fails this. The seed's
// DCGAN at batch 256, so that the GPUs' work, not the host's, sets the pace.
TEST(AdversarialTrainerGraphs, TaskStepOverlapsTheDevices) {
  HIERPAR_REQUIRE_TWO_GPUS();
  hierpar::models::DCGANOptions model;
  model.layers = hierpar::LayerSet::hierpar;
  torch::manual_seed(1);
  hierpar::models::Generator g(model);
  hierpar::models::Discriminator d(model);
  auto options = base_options();
  options.noise_shape = {model.nz};
  options.fused_adam = options.cuda_graphs = true;
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d),
                                 hs::Placement::from_flags("task", 2, "host", c10::DeviceType::CUDA, {}), options);
  const torch::Tensor real = hierpar::testing::random_tensor(
      {256, 3, 64, 64},
      torch::TensorOptions().dtype(torch::kFloat).device(trainer.placement().replicas[0].discriminator));
  for (int i = 0; i < 5; ++i) trainer.step(real);
  trainer.record_timeline(true);
  for (int i = 0; i < 6; ++i) trainer.step(real);
  const auto spans = trainer.timeline();
  auto find = [&](int64_t step, const std::string& piece) -> const hs::TimelineSpan* {
    for (const auto& s : spans) {
      if (s.step == step && s.piece.find(piece) != std::string::npos) return &s;
    }
    return nullptr;
  };
  int checked = 0;
  for (int64_t step = spans.front().step + 1; step <= spans.back().step; ++step) {
    const hs::TimelineSpan* d_real = find(step, "D real");
    const hs::TimelineSpan* g_update = find(step - 1, "G update");
    ASSERT_TRUE(d_real && g_update) << "step " << step << ": no 'D real' or previous 'G update' span";
    EXPECT_NE(d_real->device, g_update->device);
    EXPECT_LT(d_real->start_ms, g_update->end_ms)
        << "step " << step << ": D's real pass started " << d_real->start_ms - g_update->end_ms
        << " ms after G's update of the step before ended (serialised)";
    ++checked;
  }
  EXPECT_GE(checked, 4);
}
