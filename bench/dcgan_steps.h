// The DCGAN training steps the step suites time: stock (torch::nn layers in the anchor's recipe, written out as a
// stock LibTorch user would) and hierpar's (the AdversarialTrainer its users run). On CUDA by default; the host
// suite builds them on the CPU with a small model.
#pragma once

#include "hierpar/layer_set.h"
#include "hierpar/models/dcgan.h"
#include "hierpar/strategy/adversarial_trainer.h"
#include "hierpar/strategy/captured_step.h"
#include "hierpar/strategy/fused_adam.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <vector>

namespace hierpar::bench {

// torch.autocast(device_type="cuda", dtype=torch.bfloat16) when `bf16`, else nothing.
inline hierpar::strategy::AutocastScope autocast_bf16(bool bf16) {
  return hierpar::strategy::AutocastScope(at::kCUDA, bf16 ? std::optional<at::ScalarType>(at::kBFloat16) : std::nullopt);
}

inline torch::optim::AdamOptions dcgan_adam() { return torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}); }

// A training step that can run eagerly or be captured: owns its models, optimisers and static buffers.
class TrainingStep {
 public:
  virtual ~TrainingStep() = default;
  virtual void run() = 0;
  // A step that warms up, captures and replays itself (the trainer): measure() only calls run().
  virtual bool captures_itself() const { return false; }
  virtual int64_t graph_kernel_nodes() const { return -1; }
};

// The stock rows: torch::nn layers in the anchor's recipe, written out as a stock LibTorch user would.
class StockDcganStep : public TrainingStep {
 public:
  StockDcganStep(int64_t batch, bool bf16, bool channels_last, hierpar::models::DCGANOptions options = {},
                 at::Device device = at::kCUDA)
      : bf16_(bf16) {
    options.layers = hierpar::LayerSet::stock;
    generator_ = hierpar::models::Generator(options);
    discriminator_ = hierpar::models::Discriminator(options);
    generator_->to(device);
    discriminator_->to(device);
    if (channels_last) {
      hierpar::strategy::convert_to_channels_last(*generator_);
      hierpar::strategy::convert_to_channels_last(*discriminator_);
    }
    generator_params_ = generator_->parameters();
    optimizer_g_ = std::make_unique<hierpar::strategy::FusedAdam>(generator_params_, dcgan_adam(), hierpar::strategy::AdamKernel::aten);
    optimizer_d_ = std::make_unique<hierpar::strategy::FusedAdam>(discriminator_->parameters(), dcgan_adam(), hierpar::strategy::AdamKernel::aten);
    const auto on = at::TensorOptions().device(device);
    real_ = at::rand({batch, options.channels, options.image_size, options.image_size}, on) * 2 - 1;
    if (channels_last) real_ = real_.contiguous(at::MemoryFormat::ChannelsLast);
    ones_ = at::ones({batch}, on);
    zeros_ = at::zeros({batch}, on);
    noise_sizes_ = {batch, options.nz, 1, 1};
  }

  void run() override {
    at::Tensor fake, e_real, e_fake, e_g;
    {
      auto autocast = autocast_bf16(bf16_);
      const auto z = at::randn(noise_sizes_, real_.options());  // the default CUDA generator: graph-safe
      optimizer_d_->zero_grad();
      e_real = at::binary_cross_entropy_with_logits(discriminator_->forward(real_).to(at::kFloat), ones_);
      fake = generator_->forward(z);
      e_fake = at::binary_cross_entropy_with_logits(discriminator_->forward(fake.detach()).to(at::kFloat), zeros_);
    }
    const auto loss_d = e_real + e_fake;
    loss_d.backward();
    // Kept without their autograd graphs: a graph kept alive past the step would keep the parameters'
    // AccumulateGrad nodes from the warm-up stream, and autograd then syncs streams (and warns) every step.
    loss_d_ = loss_d.detach();
    optimizer_d_->step();
    optimizer_g_->zero_grad();
    {
      auto autocast = autocast_bf16(bf16_);
      e_g = at::binary_cross_entropy_with_logits(discriminator_->forward(fake).to(at::kFloat), ones_);
    }
    torch::autograd::backward({e_g}, {}, std::nullopt, false, generator_params_);
    optimizer_g_->step();
    loss_g_ = e_g.detach();
  }

 private:
  bool bf16_;
  hierpar::models::Generator generator_{nullptr};
  hierpar::models::Discriminator discriminator_{nullptr};
  std::vector<at::Tensor> generator_params_;
  std::unique_ptr<hierpar::strategy::FusedAdam> optimizer_g_, optimizer_d_;
  at::Tensor real_, ones_, zeros_, loss_d_, loss_g_;
  std::vector<int64_t> noise_sizes_;
};

// hierpar's rows: the trainer its users run (strategy/adversarial_trainer.h, single placement) on hierpar's layer
// set, with hierpar's fused Adam, its own CUDA graph capture (graph rows) and G's forward and D's pass over the
// fakes on a second stream. Under graphs the batch moves into the trainer's graph input after the first step
// (the bench's own copy is freed), so that, like the stock rows, the step reads one static batch in place.
class TrainerStep : public TrainingStep {
 public:
  TrainerStep(int64_t batch, bool bf16, bool channels_last, bool graphs, hierpar::LayerSet layers = hierpar::LayerSet::hierpar,
              hierpar::models::DCGANOptions model = {}, at::Device device = at::kCUDA) {
    model.layers = layers;
    hierpar::models::Generator generator(model);
    hierpar::models::Discriminator discriminator(model);
    hierpar::strategy::AdversarialOptions options;  // DCGAN's Adam (2e-4, beta1 0.5), BCE with logits
    options.noise_shape = {model.nz, 1, 1};
    options.fused_adam = true;
    options.cuda_graphs = graphs;
    // The suite's float32 rows use TF32, as the scope it sets for the stock rows does.
    options.precision.math = bf16 ? hierpar::strategy::StepPrecision::Math::bf16 : hierpar::strategy::StepPrecision::Math::tf32;
    options.precision.channels_last = channels_last;
    options.loss_log_steps = 1 << 14;  // no host sync inside the timed steps
    // HIERPAR_BENCH_OVERLAP=0: the step on one stream (same-process A/B of options.overlap_passes).
    const char* overlap = std::getenv("HIERPAR_BENCH_OVERLAP");
    options.overlap_passes = !(overlap && overlap[0] == '0');
    // HIERPAR_BENCH_JOINT_FROM=N: captured steps run D's two backward branches as one call from N images (an A/B of
    // AdversarialOptions::joint_discriminator_backward_batch); HIERPAR_BENCH_EAGER_OVERLAP_FROM=N: eager steps use
    // the second stream from N images (of AdversarialOptions::eager_overlap_batch).
    const auto batch_from_env = [](const char* name, int64_t& into) {
      const char* value = std::getenv(name);
      if (value == nullptr) return;
      char* end = nullptr;
      into = std::strtoll(value, &end, 10);
      TORCH_CHECK(*value != '\0' && *end == '\0' && into >= 1, name, ": expected a batch >= 1, got '", value, "'");
    };
    batch_from_env("HIERPAR_BENCH_JOINT_FROM", options.joint_discriminator_backward_batch);
    batch_from_env("HIERPAR_BENCH_EAGER_OVERLAP_FROM", options.eager_overlap_batch);
    trainer_ = std::make_unique<hierpar::strategy::AdversarialTrainer>(
        torch::nn::AnyModule(generator), torch::nn::AnyModule(discriminator),
        hierpar::strategy::Placement::make(hierpar::strategy::Scheme::single, 1, hierpar::strategy::Reduce::host,
                                           device.type()),
        options);
    const auto on = at::TensorOptions().device(device);
    real_ = at::rand({batch, model.channels, model.image_size, model.image_size}, on) * 2 - 1;
    if (channels_last) real_ = real_.contiguous(at::MemoryFormat::ChannelsLast);
  }
  void run() override {
    trainer_->step(real_);
    const at::Tensor input = trainer_->graph_input();
    if (input.defined() && !input.is_same(real_)) real_ = input;  // the step copied it there
  }
  bool captures_itself() const override { return trainer_->graphs(); }
  int64_t graph_kernel_nodes() const override { return trainer_->graph_kernel_nodes(); }

 private:
  std::unique_ptr<hierpar::strategy::AdversarialTrainer> trainer_;
  at::Tensor real_;
};

}  // namespace hierpar::bench
