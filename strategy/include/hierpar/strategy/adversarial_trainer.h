// Two-network adversarial training (a generator G and a discriminator D, any modules) under a Placement.
// One step is the standard DCGAN recipe, per replica on its share of the batch:
//   fake = G(z); D on real; D on fake.detach(); D loss backward; average D's gradients; D update;
//   D on fake (D's updated weights) for G's loss; G loss backward; average G's gradients; G update.
// Under task/hierarchical placements the fakes are copied to D's device and their gradient back by
// ATen's device-to-device copies, which order the two devices' current streams with CUDA events; the
// host never waits inside a step except where host averaging must read the gradients.
//
// Usage (a DCGAN example):
//   auto placement = hierpar::strategy::Placement::from_flags(strategy, gpus, reduce);
//   std::cout << placement << "\n";
//   hierpar::strategy::AdversarialTrainer trainer(torch::nn::AnyModule(generator),
//                                                 torch::nn::AnyModule(discriminator), placement, options);
//   auto losses = trainer.step(real_batch);           // this process's share of the global batch
//   if (i % 50 == 0) auto [d, g] = losses.mean();     // the only host sync
#pragma once

#include "hierpar/strategy/averaging.h"
#include "hierpar/strategy/placement.h"

#include <torch/nn/modules/container/any.h>
#include <torch/optim/adam.h>

#include <functional>
#include <memory>
#include <vector>

namespace hierpar::strategy {

// A loss on D's logits against an all-real (true) or all-fake (false) target.
using AdversarialLoss = std::function<torch::Tensor(const torch::Tensor& logits, bool real_target)>;
// Binary cross-entropy with logits, mean over the batch (DCGAN's loss with the sigmoid folded in).
torch::Tensor bce_with_logits_loss(const torch::Tensor& logits, bool real_target);

struct AdamSettings {
  double lr = 2e-4;
  double beta1 = 0.5;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

struct AdversarialOptions {
  AdamSettings generator_adam;
  AdamSettings discriminator_adam;
  // The shape of one noise sample, drawn N(0, 1) on G's device when step() is given no noise.
  std::vector<int64_t> noise_shape{100, 1, 1};
  AdversarialLoss loss = bce_with_logits_loss;
  AveragingOptions averaging;
};

// The losses of one step: one 0-dim tensor per local replica, on its D device (reading them syncs).
struct StepLosses {
  std::vector<torch::Tensor> discriminator;       // loss on real + loss on fake
  std::vector<torch::Tensor> discriminator_real;  // its two terms, for logs
  std::vector<torch::Tensor> discriminator_fake;
  std::vector<torch::Tensor> generator;
  // Means over this process's replicas, read on the host (a device sync: call it every N steps).
  std::pair<double, double> mean() const;
};

class AdversarialTrainer {
 public:
  // `generator` and `discriminator` become local replica 0 (moved to its devices); replicas 1.. are
  // clone()s (so modules must be torch::nn::Cloneable when a process runs more than one replica).
  // Every replica starts from global replica 0's parameters and buffers (broadcast across processes).
  AdversarialTrainer(torch::nn::AnyModule generator, torch::nn::AnyModule discriminator, Placement placement,
                     AdversarialOptions options = {});
  ~AdversarialTrainer();
  AdversarialTrainer(const AdversarialTrainer&) = delete;
  AdversarialTrainer& operator=(const AdversarialTrainer&) = delete;

  // One step on `real` (this process's share of the global batch, any device; split evenly over the
  // local replicas along dim 0). `noise`, if given, has the same batch size (split the same way);
  // otherwise each replica draws its own. Throws, naming the replica, if any replica fails.
  StepLosses step(const torch::Tensor& real, const torch::Tensor& noise = {});
  // The same with each local replica's share given by the caller (reals[i] for local replica i, ideally
  // already on its D device, so that no share crosses devices inside the step); `noises` empty or one
  // per replica.
  StepLosses step_shares(const std::vector<torch::Tensor>& reals, const std::vector<torch::Tensor>& noises = {});

  // Makes every replica (here and in other processes) equal to global replica 0: parameters and
  // buffers of both networks. Call after loading a checkpoint into local replica 0 of rank 0.
  void broadcast_from_replica0();

  const Placement& placement() const { return placement_; }
  // Local replica `local`'s modules and optimisers (replica 0's are what a checkpoint saves).
  torch::nn::AnyModule& generator(int64_t local = 0);
  torch::nn::AnyModule& discriminator(int64_t local = 0);
  torch::optim::Adam& generator_optimizer(int64_t local = 0);
  torch::optim::Adam& discriminator_optimizer(int64_t local = 0);

 private:
  struct Replica;
  class Workers;
  StepLosses run_step(const std::vector<torch::Tensor>& reals, const std::vector<torch::Tensor>& noises);
  void step_replica(int64_t local, const torch::Tensor& real, const torch::Tensor& noise, StepLosses& out);

  Placement placement_;
  AdversarialOptions options_;
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::unique_ptr<GradientAverager> averager_;
  std::unique_ptr<Workers> workers_;
};

}  // namespace hierpar::strategy
