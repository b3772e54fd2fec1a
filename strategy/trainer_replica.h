// AdversarialTrainer's internals shared by strategy/adversarial_trainer.cpp (construction, steps, graphs, timeline)
// and strategy/adversarial_step.cpp (the step's recipe, piece by piece): a replica's state and a few stream helpers.
// Internal to strategy/.
#pragma once

#include "hierpar/strategy/adversarial_trainer.h"
#include "hierpar/strategy/captured_step.h"
#include "hierpar/strategy/sync_batch_norm.h"

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#include <array>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace hierpar::strategy {

// A piece of a captured step's replay: a segment of one device's CapturedStep, or what runs between segments.
struct AdversarialTrainer::ProgramPiece {
  std::string name;
  c10::Device device;  // whose stream runs it (a copy: its source's, as ATen's copy_ does)
  bool compute;
  std::function<void()> run;
};

namespace detail {
// A timeline span not yet read back.
struct PendingSpan {
  int64_t step;
  c10::Device device;
  std::string piece;
  bool compute;
  c10::Event start, end;
};
}  // namespace detail

struct AdversarialTrainer::Replica {
  torch::nn::AnyModule generator;
  torch::nn::AnyModule discriminator;
  std::vector<torch::Tensor> generator_parameters;
  std::vector<torch::Tensor> discriminator_parameters;
  std::vector<torch::Tensor> generator_ema;  // options.generator_ema_decay > 0: G's parameters' moving average
  std::unique_ptr<torch::optim::Adam> generator_optimizer;  // a FusedAdam with options.fused_adam
  std::unique_ptr<torch::optim::Adam> discriminator_optimizer;
  // The last step's losses (under graphs: the graph's outputs) and the device buffer of pending steps'
  // losses: row k = (D real, D fake, G) of the k-th step since the last read; `loss_row` is k, on the device.
  torch::Tensor d_loss, d_loss_real, d_loss_fake, g_loss;
  torch::Tensor loss_log, loss_row;
  // CUDA graphs: the captured step (`graph` on D's device, and on G's `generator_graph` when G has a device of its
  // own), the static inputs it reads, and the eager steps run so far. `program` replays it: the segments of both
  // devices with the copies and the averaging between them, in the order the step runs.
  std::unique_ptr<CapturedStep> graph, generator_graph;
  std::vector<ProgramPiece> program;
  torch::Tensor static_real, static_noise;
  // What crosses between G's and D's parts of a step: the fakes (G's output, with its autograd graph until G's
  // backward), the fakes on D's device (a leaf: G's loss backpropagates to it), and that gradient on G's device.
  // On two devices the last two are persistent buffers that the copies between segments fill.
  torch::Tensor fake, fake_on_d, fake_grad;
  // A split placement: the fakes' layout, sent by G's process on the first step (adversarial_step.cpp).
  std::vector<int64_t> fake_layout;
  // options.schedule == pipelined: two copies of G that run its forward one step ahead, alternately, each loaded with
  // G's parameters and buffers just before; `ahead_fake` is the next step's fakes, made by copy `ahead_copy` and kept
  // with its autograd graph (and `fake`'s copy with its own) until that step's G backward.
  std::array<torch::nn::AnyModule, 2> generator_ahead;
  torch::Tensor ahead_fake, ahead_on_d;  // on two devices, `ahead_fake` copied to D's as soon as it is made
  int fake_copy = 0, ahead_copy = 0;
  // Its noise, where replicas share one generator (CPU): the rows of the draws run_step made, in the order used.
  std::deque<torch::Tensor> drawn_noise;
  bool noise_given = false;
  // Synchronized BatchNorm (options.sync_batch_norm; null otherwise): installed around each forward.
  std::unique_ptr<ReplicaBatchNormSync> generator_bn_sync, discriminator_bn_sync;
  int64_t warmup_done = 0;
  // options.overlap_passes: two pooled streams of the device, so that one differs from whichever stream
  // the step runs on (the caller's, or a CapturedStep's); empty when the step runs on one stream.
  std::vector<c10::Stream> pass_streams;
  // The first step runs on one stream all the same: cuDNN's benchmark mode times its candidate algorithms
  // there, and timings taken beside the other stream's kernels would pick them by noise.
  bool first_step_done = false;
  std::vector<detail::PendingSpan> spans;  // record_timeline
};

namespace detail {

// The parameters' gradients, a parameter that took no part in the loss getting zeros (so every replica
// averages buffers of the same layout).
inline std::vector<torch::Tensor> gradients_of(const std::vector<torch::Tensor>& parameters) {
  std::vector<torch::Tensor> grads;
  grads.reserve(parameters.size());
  for (const torch::Tensor& p : parameters) {
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    grads.push_back(p.grad());
  }
  return grads;
}

// `waiter` waits for the work queued so far on `producer` (captured as a dependency inside a CUDA graph).
inline void order(const c10::Stream& producer, const c10::Stream& waiter) {
  c10::Event event(producer.device_type());
  event.record(producer);
  event.block(waiter);
}

inline c10::Stream current_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

}  // namespace detail
}  // namespace hierpar::strategy
