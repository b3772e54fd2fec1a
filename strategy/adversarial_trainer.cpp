#include "hierpar/strategy/adversarial_trainer.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/autocast_mode.h>
#include <c10/core/DeviceGuard.h>
#include <torch/torch.h>

#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

namespace hierpar::strategy {

torch::Tensor bce_with_logits_loss(const torch::Tensor& logits, bool real_target) {
  return torch::binary_cross_entropy_with_logits(
      logits, real_target ? torch::ones_like(logits) : torch::zeros_like(logits));
}

std::pair<double, double> StepLosses::mean() const {
  TORCH_CHECK(!discriminator.empty() && discriminator.size() == generator.size(), "StepLosses: no losses to read");
  double d = 0.0, g = 0.0;
  for (size_t i = 0; i < discriminator.size(); ++i) {
    d += discriminator[i].item<double>();
    g += generator[i].item<double>();
  }
  return {d / discriminator.size(), g / generator.size()};
}

struct AdversarialTrainer::Replica {
  torch::nn::AnyModule generator;
  torch::nn::AnyModule discriminator;
  std::vector<torch::Tensor> generator_parameters;
  std::vector<torch::Tensor> discriminator_parameters;
  std::unique_ptr<torch::optim::Adam> generator_optimizer;
  std::unique_ptr<torch::optim::Adam> discriminator_optimizer;
};

// One persistent thread per local replica after the first (which runs on the caller's thread): the
// seed's one host thread per device. run() hands every replica the same job with the caller's
// thread-local state (grad mode, autocast), waits for all, and rethrows the first failure after
// telling the averager, so replicas waiting on the failed one stop instead of hanging.
class AdversarialTrainer::Workers {
 public:
  explicit Workers(int64_t replicas) : errors_(replicas) {
    for (int64_t i = 1; i < replicas; ++i) threads_.emplace_back([this, i] { loop(i); });
  }
  ~Workers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    start_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  void run(const std::function<void(int64_t)>& job, GradientAverager* averager, const Placement& placement) {
    job_ = &job;
    averager_ = averager;
    state_ = std::make_unique<at::ThreadLocalState>();
    for (auto& e : errors_) e = nullptr;
    first_failure_ = -1;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_ = static_cast<int64_t>(threads_.size());
      ++generation_;
    }
    start_.notify_all();
    execute(0);
    {
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, [&] { return pending_ == 0; });
    }
    // The replica that failed first is the cause; the others were stopped by it.
    if (first_failure_ < 0) return;
    std::string message;
    for (int64_t i : failure_order()) {
      const ReplicaDevices& r = placement.replicas[i];
      try {
        std::rethrow_exception(errors_[i]);
      } catch (const std::exception& e) {
        message += c10::str(message.empty() ? "" : "\nthen ", "replica ", r.replica, " (G ", r.generator, ", D ",
                            r.discriminator, ") failed: ", e.what());
      } catch (...) {
        message += c10::str(message.empty() ? "" : "\nthen ", "replica ", r.replica, " failed");
      }
    }
    TORCH_CHECK(false, message);
  }

 private:
  std::vector<int64_t> failure_order() const {
    std::vector<int64_t> order{first_failure_};
    for (int64_t i = 0; i < static_cast<int64_t>(errors_.size()); ++i) {
      if (errors_[i] && i != first_failure_) order.push_back(i);
    }
    return order;
  }

  void record_failure(int64_t i) {
    errors_[i] = std::current_exception();
    std::lock_guard<std::mutex> lock(mutex_);
    if (first_failure_ < 0) first_failure_ = i;
  }

  void execute(int64_t i) {
    try {
      at::ThreadLocalStateGuard guard(*state_);
      (*job_)(i);
    } catch (const std::exception& e) {
      record_failure(i);
      if (averager_ != nullptr) averager_->abort(c10::str("replica ", i, " of this process failed: ", e.what()));
    } catch (...) {
      record_failure(i);
      if (averager_ != nullptr) averager_->abort(c10::str("replica ", i, " of this process failed"));
    }
  }

  void loop(int64_t i) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        start_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
      }
      execute(i);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_all();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable start_, done_;
  uint64_t generation_ = 0;
  int64_t pending_ = 0;
  bool stopping_ = false;
  const std::function<void(int64_t)>* job_ = nullptr;
  GradientAverager* averager_ = nullptr;
  std::unique_ptr<at::ThreadLocalState> state_;
  std::vector<std::exception_ptr> errors_;
  int64_t first_failure_ = -1;
};

namespace {

torch::optim::AdamOptions adam_options(const AdamSettings& s) {
  return torch::optim::AdamOptions(s.lr).betas({s.beta1, s.beta2}).eps(s.eps).weight_decay(s.weight_decay);
}

// The parameters' gradients, a parameter that took no part in the loss getting zeros (so every replica
// averages buffers of the same layout).
std::vector<torch::Tensor> gradients_of(const std::vector<torch::Tensor>& parameters) {
  std::vector<torch::Tensor> grads;
  grads.reserve(parameters.size());
  for (const torch::Tensor& p : parameters) {
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    grads.push_back(p.grad());
  }
  return grads;
}

// D's weights need no gradient while G's loss backpropagates through D: freezing them saves D's weight
// gradient kernels, and G's gradients do not change.
class FrozenParameters {
 public:
  explicit FrozenParameters(const std::vector<torch::Tensor>& parameters) : parameters_(parameters) {
    for (const torch::Tensor& p : parameters_) p.requires_grad_(false);
  }
  ~FrozenParameters() {
    for (const torch::Tensor& p : parameters_) p.requires_grad_(true);
  }

 private:
  const std::vector<torch::Tensor>& parameters_;
};

// Parameters and buffers of a module grouped by dtype (a broadcast moves one flat buffer per dtype).
std::map<int, std::vector<torch::Tensor>> state_by_dtype(const torch::nn::Module& module) {
  std::map<int, std::vector<torch::Tensor>> groups;
  for (const torch::Tensor& t : module.parameters()) groups[static_cast<int>(t.scalar_type())].push_back(t);
  for (const torch::Tensor& t : module.buffers()) groups[static_cast<int>(t.scalar_type())].push_back(t);
  return groups;
}

}  // namespace

AdversarialTrainer::AdversarialTrainer(torch::nn::AnyModule generator, torch::nn::AnyModule discriminator,
                                       Placement placement, AdversarialOptions options)
    : placement_(std::move(placement)), options_(std::move(options)) {
  placement_.validate();
  TORCH_CHECK(!generator.is_empty() && !discriminator.is_empty(), "AdversarialTrainer needs a generator and a discriminator module");
  TORCH_CHECK(options_.loss, "AdversarialTrainer: options.loss must be set");
  for (int64_t i = 0; i < placement_.local_replicas(); ++i) {
    const ReplicaDevices& devices = placement_.replicas[i];
    auto replica = std::make_unique<Replica>();
    if (i == 0) {
      generator.ptr()->to(devices.generator);
      discriminator.ptr()->to(devices.discriminator);
      replica->generator = std::move(generator);
      replica->discriminator = std::move(discriminator);
    } else {
      replica->generator = replicas_[0]->generator.clone(devices.generator);
      replica->discriminator = replicas_[0]->discriminator.clone(devices.discriminator);
    }
    replica->generator_parameters = replica->generator.ptr()->parameters();
    replica->discriminator_parameters = replica->discriminator.ptr()->parameters();
    TORCH_CHECK(!replica->generator_parameters.empty() && !replica->discriminator_parameters.empty(),
                "AdversarialTrainer: the generator and the discriminator must have parameters");
    replica->generator_optimizer = std::make_unique<torch::optim::Adam>(replica->generator_parameters,
                                                                        adam_options(options_.generator_adam));
    replica->discriminator_optimizer = std::make_unique<torch::optim::Adam>(
        replica->discriminator_parameters, adam_options(options_.discriminator_adam));
    replicas_.push_back(std::move(replica));
  }
  averager_ = make_averager(placement_, options_.averaging);
  workers_ = std::make_unique<Workers>(placement_.local_replicas());
  if (averager_) {
    workers_->run([this](int64_t i) { averager_->connect(i); }, averager_.get(), placement_);
    if (placement_.launch.multi_process()) broadcast_from_replica0();
  }
}

AdversarialTrainer::~AdversarialTrainer() = default;

torch::nn::AnyModule& AdversarialTrainer::generator(int64_t local) { return replicas_.at(local)->generator; }
torch::nn::AnyModule& AdversarialTrainer::discriminator(int64_t local) { return replicas_.at(local)->discriminator; }
torch::optim::Adam& AdversarialTrainer::generator_optimizer(int64_t local) {
  return *replicas_.at(local)->generator_optimizer;
}
torch::optim::Adam& AdversarialTrainer::discriminator_optimizer(int64_t local) {
  return *replicas_.at(local)->discriminator_optimizer;
}

void AdversarialTrainer::broadcast_from_replica0() {
  if (!averager_) return;
  workers_->run(
      [this](int64_t i) {
        torch::NoGradGuard no_grad;
        const Replica& r = *replicas_[i];
        for (const auto& [network, module] : {std::pair{Network::generator, r.generator.ptr()},
                                              std::pair{Network::discriminator, r.discriminator.ptr()}}) {
          for (auto& [dtype, tensors] : state_by_dtype(*module)) averager_->broadcast_from_first(i, network, tensors);
        }
      },
      averager_.get(), placement_);
}

StepLosses AdversarialTrainer::step(const torch::Tensor& real, const torch::Tensor& noise) {
  const int64_t parts = placement_.local_replicas();
  TORCH_CHECK(real.defined() && real.dim() >= 1 && real.size(0) > 0, "step: real must be a batch (dim 0 the samples)");
  TORCH_CHECK(real.size(0) % parts == 0, "step: a batch of ", real.size(0), " does not split evenly over the ", parts,
              " replicas of this process (", placement_, ")");
  TORCH_CHECK(!noise.defined() || (noise.dim() >= 1 && noise.size(0) == real.size(0)), "step: noise must have the "
              "batch size of real (", real.size(0), "), got ", noise.defined() ? noise.sizes() : at::IntArrayRef{});
  const int64_t share = real.size(0) / parts;
  std::vector<torch::Tensor> reals, noises;
  for (int64_t i = 0; i < parts; ++i) {
    reals.push_back(real.narrow(0, i * share, share));
    noises.push_back(noise.defined() ? noise.narrow(0, i * share, share) : torch::Tensor());
  }
  return run_step(reals, noises);
}

StepLosses AdversarialTrainer::step_shares(const std::vector<torch::Tensor>& reals,
                                           const std::vector<torch::Tensor>& noises) {
  const int64_t parts = placement_.local_replicas();
  TORCH_CHECK(static_cast<int64_t>(reals.size()) == parts, "step_shares: expected one real batch per local replica (",
              parts, "), got ", reals.size());
  TORCH_CHECK(noises.empty() || noises.size() == reals.size(), "step_shares: expected no noise or one per local "
              "replica (", parts, "), got ", noises.size());
  for (int64_t i = 0; i < parts; ++i) {
    TORCH_CHECK(reals[i].defined() && reals[i].dim() >= 1 && reals[i].size(0) > 0, "step_shares: reals[", i,
                "] must be a batch (dim 0 the samples)");
    TORCH_CHECK(noises.empty() || (noises[i].dim() >= 1 && noises[i].size(0) == reals[i].size(0)), "step_shares: "
                "noises[", i, "] must have the batch size of reals[", i, "] (", reals[i].size(0), ")");
  }
  return run_step(reals, noises.empty() ? std::vector<torch::Tensor>(reals.size()) : noises);
}

StepLosses AdversarialTrainer::run_step(const std::vector<torch::Tensor>& reals, const std::vector<torch::Tensor>& noises) {
  StepLosses losses;
  losses.discriminator.resize(reals.size());
  losses.discriminator_real.resize(reals.size());
  losses.discriminator_fake.resize(reals.size());
  losses.generator.resize(reals.size());
  workers_->run([&](int64_t i) { step_replica(i, reals[i], noises[i], losses); }, averager_.get(), placement_);
  return losses;
}

void AdversarialTrainer::step_replica(int64_t local, const torch::Tensor& real_share, const torch::Tensor& noise_share,
                                      StepLosses& out) {
  Replica& r = *replicas_[local];
  const ReplicaDevices& devices = placement_.replicas[local];
  c10::OptionalDeviceGuard device_guard(devices.discriminator);
  const AdversarialLoss& loss = options_.loss;

  torch::Tensor noise;
  if (noise_share.defined()) {
    noise = noise_share.to(devices.generator, /*non_blocking=*/true);
  } else {
    std::vector<int64_t> shape{real_share.size(0)};
    shape.insert(shape.end(), options_.noise_shape.begin(), options_.noise_shape.end());
    noise = torch::randn(shape, torch::TensorOptions().device(devices.generator));
  }
  torch::Tensor real = real_share.to(devices.discriminator, /*non_blocking=*/true);

  // G's forward is queued first: on a task placement it runs on G's device while D's real pass runs on D's.
  torch::Tensor fake = r.generator.forward<torch::Tensor>(noise);
  torch::Tensor fake_on_d = fake.to(devices.discriminator, /*non_blocking=*/true);  // event-ordered peer copy

  r.discriminator_optimizer->zero_grad();
  torch::Tensor d_real = r.discriminator.forward<torch::Tensor>(real);
  torch::Tensor d_fake = r.discriminator.forward<torch::Tensor>(fake_on_d.detach());
  torch::Tensor d_loss_real = loss(d_real, true), d_loss_fake = loss(d_fake, false);
  torch::Tensor d_loss = d_loss_real + d_loss_fake;
  d_loss.backward();
  if (averager_) averager_->average(local, Network::discriminator, gradients_of(r.discriminator_parameters));
  r.discriminator_optimizer->step();
  // Under autocast, the casts of D's weights cached by the forwards above are stale after the update;
  // the cache is per thread, so each replica's thread clears its own.
  at::autocast::clear_cache();

  r.generator_optimizer->zero_grad();
  torch::Tensor g_loss;
  {
    FrozenParameters frozen(r.discriminator_parameters);
    g_loss = loss(r.discriminator.forward<torch::Tensor>(fake_on_d), true);
    g_loss.backward();  // the gradient w.r.t. the fake crosses back to G's device by the copy's backward
  }
  if (averager_) averager_->average(local, Network::generator, gradients_of(r.generator_parameters));
  r.generator_optimizer->step();
  at::autocast::clear_cache();

  out.discriminator[local] = d_loss.detach();
  out.discriminator_real[local] = d_loss_real.detach();
  out.discriminator_fake[local] = d_loss_fake.detach();
  out.generator[local] = g_loss.detach();
}

}  // namespace hierpar::strategy
