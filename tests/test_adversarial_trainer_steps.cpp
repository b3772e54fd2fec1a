// AdversarialTrainer's step machinery on the CPU: the device-side loss log read every N steps, the noise drawn by the
// trainer, G's moving average, FusedAdam as its optimiser, channels_last, the options' checks and the penalties (R1,
// gradient penalty) through both layer sets (tolerances: adversarial_trainer_testing.h).
#include <optional>

#include "adversarial_trainer_testing.h"

#include "hierpar/models/dcgan.h"
#include "hierpar/strategy/fused_adam.h"

using namespace adversarial_trainer_testing;


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
  options.joint_discriminator_backward_batch = 0;
  HIERPAR_EXPECT_THROW_MSG(make(options, cpu_placement("single", 1)),
                           "joint_discriminator_backward_batch must be a batch of at least 1, got 0");
  options = base_options();
  options.eager_overlap_batch = -1;
  HIERPAR_EXPECT_THROW_MSG(make(options, cpu_placement("single", 1)),
                           "eager_overlap_batch must be a batch of at least 1, got -1");
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
// steps of WGAN-GP with R1 on every step. In double: the penalties differentiate twice, and in float the rounding of
// gradients near zero becomes an Adam step of either sign, which would hide a real difference.
TEST(AdversarialTrainerSteps, PenaltiesThroughHierparLayersMatchStock) {
  struct DoubleByDefault {
    caffe2::TypeMeta before = torch::get_default_dtype();
    DoubleByDefault() { torch::set_default_dtype(caffe2::TypeMeta::Make<double>()); }
    ~DoubleByDefault() { torch::set_default_dtype(before); }
  };
  std::optional<DoubleByDefault> in_double(std::in_place);
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
      trainer.step(torch::nn::functional::interpolate(reals[k].to(torch::kDouble),
                                                      torch::nn::functional::InterpolateFuncOptions()
                                                          .size(std::vector<int64_t>{32, 32})
                                                          .mode(torch::kNearest)));
    }
    for (const auto& p : trainer.discriminator().ptr()->parameters()) state.push_back(p.detach().clone());
    states.push_back(state);
  }
  in_double.reset();
  for (size_t i = 0; i < states[0].size(); ++i) {
    ASSERT_EQ(states[1][i].scalar_type(), torch::kDouble) << "D parameter " << i;
    hierpar::testing::expect_close(states[1][i], states[0][i], {1e-10, 1e-12}, "D parameter " + std::to_string(i));
  }
}
