// AdversarialTrainer's step as pieces, the DCGAN recipe per replica (adversarial_trainer.h): each piece runs now on its
// device (eager) or goes into that device's open CUDA graph segment (capture), and what runs between segments
// (copies across devices, averaging outside the graphs) into the replay program.
#include "part_link.h"
#include "trainer_replica.h"

#include "hierpar/nn/batch_norm.h"
#include "hierpar/ops.h"

#include <ATen/autocast_mode.h>
#include <ATen/ops/_foreach_lerp.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>

#include <optional>

namespace hierpar::strategy {
namespace {

using detail::current_stream;
using detail::gradients_of;
using detail::order;

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

// Autocast's cache of cast weights off for the scope: a cast cached by one stream's pass and read by the
// other's would be freed to the first stream's pool while the second may still read it.
class AutocastCacheOff {
 public:
  explicit AutocastCacheOff(bool active) : active_(active), was_(at::autocast::is_autocast_cache_enabled()) {
    if (active_) at::autocast::set_autocast_cache_enabled(false);
  }
  ~AutocastCacheOff() {
    if (active_) at::autocast::set_autocast_cache_enabled(was_);
  }

 private:
  bool active_, was_;
};

// A split placement's fakes as D's process allocates them: [dtype, channels_last, dims, sizes after the batch's...],
// padded to kFakeLayoutLength.
constexpr int64_t kFakeLayoutLength = 12;

std::vector<int64_t> fake_layout(const torch::Tensor& fake) {
  TORCH_CHECK(fake.dim() >= 1 && fake.dim() <= kFakeLayoutLength - 3, "G's output must have 1 to ",
              kFakeLayoutLength - 3, " dimensions to travel to D's process, got ", fake.sizes());
  const bool channels_last = fake.dim() == 4 && !fake.is_contiguous() &&
                             fake.is_contiguous(at::MemoryFormat::ChannelsLast);
  TORCH_CHECK(fake.is_contiguous() || channels_last, "G's output must be contiguous (or channels_last) to travel to D's "
              "process as it is, got strides ", fake.strides());
  std::vector<int64_t> layout{static_cast<int64_t>(fake.scalar_type()), channels_last, fake.dim()};
  layout.insert(layout.end(), fake.sizes().begin() + 1, fake.sizes().end());
  layout.resize(kFakeLayoutLength, 0);
  return layout;
}

torch::Tensor empty_fakes(const std::vector<int64_t>& layout, int64_t batch, const c10::Device& device) {
  std::vector<int64_t> sizes{batch};
  sizes.insert(sizes.end(), layout.begin() + 3, layout.begin() + 3 + (layout[2] - 1));
  return torch::empty(sizes, torch::TensorOptions().dtype(static_cast<c10::ScalarType>(layout[0])).device(device),
                      layout[1] != 0 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
}

}  // namespace

void AdversarialTrainer::step_body(int64_t local, const torch::Tensor& real_share, const torch::Tensor& noise_share,
                                   Phase phase) {
  Replica& r = *replicas_[local];
  const ReplicaDevices& devices = placement_.replicas[local];
  const c10::Device& g_device = devices.generator;
  const c10::Device& d_device = devices.discriminator;
  const bool two_devices = g_device != d_device;
  // A split placement's process runs one network's pieces; the fakes and their gradient cross the link instead.
  const bool runs_g = devices.part != ReplicaPart::discriminator, runs_d = devices.part != ReplicaPart::generator;
  const bool split = devices.part != ReplicaPart::whole;
  const AdversarialLoss& loss = options_.loss;
  auto autocast = [&](const c10::Device& device) { return AutocastScope(device.type(), options_.precision.autocast_dtype()); };

  // The step as pieces. on(network, name, work): work of one network on its device, run now (eager) or captured into
  // the open segment of that device's CapturedStep, a new segment starting where the step moves to the other device;
  // nothing where this process runs the other network only.
  // between(device, name, work): what runs between segments (copies across devices, averaging), run now or appended
  // to the replay program. `device` is whose stream the piece runs on, for the timeline.
  CapturedStep* open = nullptr;
  std::optional<ProgramPiece> segment;  // the open segment's program entry, its name growing with its pieces
  auto close_open = [&] {
    if (open == nullptr) return;
    open->close_segment();
    segment->run = [graph = open, index = open->segments() - 1] { graph->replay(index); };
    r.program.push_back(std::move(*segment));
    segment.reset();
    open = nullptr;
  };
  auto on = [&](Network network, const char* name, const std::function<void()>& work) {
    const bool generator = network == Network::generator;
    if (!(generator ? runs_g : runs_d)) return;  // the other process's piece
    const c10::Device& device = generator ? g_device : d_device;
    if (phase == Phase::eager) {
      c10::OptionalDeviceGuard device_guard(device);
      timed(local, device, name, /*compute=*/true, work);
      return;
    }
    CapturedStep* graph = two_devices && generator ? r.generator_graph.get() : r.graph.get();
    if (open != graph) {
      close_open();
      graph->open_segment();
      open = graph;
      segment = ProgramPiece{name, device, /*compute=*/true, {}};
    } else {
      segment->name += std::string(" + ") + name;
    }
    work();
  };
  auto between = [&](const c10::Device& device, const char* name, std::function<void()> work) {
    if (phase == Phase::eager) {
      timed(local, device, name, /*compute=*/false, work);
    } else {
      close_open();
      r.program.push_back(ProgramPiece{name, device, /*compute=*/false, std::move(work)});
    }
  };
  // Averaging captured in the graphs (NCCL's bucketed all-reduces) is one more piece of the network's segment;
  // otherwise it runs between segments.
  auto average = [&](Network network) {
    const bool d = network == Network::discriminator;
    if (!averager_ || !(d ? runs_d : runs_g)) return;
    const c10::Device& device = d ? d_device : g_device;
    const char* name = d ? "average D" : "average G";
    auto work = [this, local, network, d, &r] {
      averager_->average(local, network, gradients_of(d ? r.discriminator_parameters : r.generator_parameters));
    };
    if (phase == Phase::capture && graph_averaging_ == GraphAveraging::whole) {
      on(network, name, work);
    } else {
      between(device, name, work);
    }
  };

  // One device (options.overlap_passes): G's forward and D's pass over the fakes run on `fake_stream` beside D's
  // pass over the real batch on the device's stream (`main_stream`, under capture the side stream); chosen in the
  // first piece, where that stream is current.
  std::optional<c10::Stream> fake_stream, main_stream;
  std::optional<AutocastCacheOff> autocast_cache_off;

  // The pipelined schedule's forward on copy `copy` of G, loaded with G's parameters and buffers: the fakes keep
  // that copy's autograd graph, and G's buffers (BatchNorm's running statistics) advance as after any forward.
  const bool pipelined = options_.schedule == Schedule::pipelined;
  auto next_noise = [&] {
    if (r.drawn_noise.empty()) return draw_noise(local, real_share.size(0));
    torch::Tensor noise = r.drawn_noise.front().to(g_device);
    r.drawn_noise.pop_front();
    return noise;
  };
  auto forward_on_copy = [&](int copy, const torch::Tensor& noise) {
    torch::nn::Module& master = *r.generator.ptr();
    torch::nn::Module& ahead = *r.generator_ahead[copy].ptr();
    const auto load = [](const std::vector<torch::Tensor>& from, const std::vector<torch::Tensor>& into) {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < from.size(); ++i) into[i].copy_(from[i]);
    };
    load(master.parameters(), ahead.parameters());
    load(master.buffers(), ahead.buffers());
    torch::Tensor fake;
    {
      auto scope = autocast(g_device);
      fake = r.generator_ahead[copy].forward<torch::Tensor>(noise);
    }
    load(ahead.buffers(), master.buffers());
    return fake;
  };

  // G's forward: the fakes, kept with their autograd graph until G's backward (the end of this step). Pipelined, the
  // previous step made them (unless it was the first, or the batch changed).
  on(Network::generator, "G forward", [&] {
    if (pipelined) {
      if (r.ahead_fake.defined() && r.ahead_fake.size(0) == real_share.size(0)) {
        r.fake = std::move(r.ahead_fake);
        r.fake_copy = r.ahead_copy;
        return;
      }
      r.ahead_fake = torch::Tensor();
      r.ahead_on_d = torch::Tensor();
      r.fake_copy = 0;
      r.fake = forward_on_copy(0, next_noise());
      return;
    }
    if (!two_devices) {
      main_stream = current_stream(d_device);
      fake_stream = fake_pass_stream(local, real_share.size(0));
      autocast_cache_off.emplace(fake_stream.has_value() && options_.precision.autocast_dtype().has_value());
    }
    const torch::Tensor noise = noise_share.defined() ? noise_share.to(g_device, /*non_blocking=*/true)
                                                      : draw_noise(local, real_share.size(0));
    if (fake_stream) {
      order(*main_stream, *fake_stream);
      noise.record_stream(*fake_stream);
    }
    c10::OptionalStreamGuard on_fake_stream(fake_stream);
    auto scope = autocast(g_device);
    hierpar::nn::BatchNormSyncGuard bn_sync(r.generator_bn_sync.get());
    r.fake = r.generator.forward<torch::Tensor>(noise);
  });

  // D's pass over the real batch, forward and backward: it needs no fakes, so on a task or hierarchical placement it
  // runs on D's device while G's device runs G's backward and update of the previous step and its forward.
  torch::Tensor d_loss_real, d_loss_fake, g_loss, real_on_d;
  // One device, overlapped passes, no penalty: the real pass's objective, whose backward joins the fakes' (below).
  torch::Tensor real_objective_pending;
  // The penalties' gradient: of D's logits (their sum) with respect to its input `x`, kept differentiable, in float.
  auto input_gradient = [](const torch::Tensor& logits, const torch::Tensor& x) {
    return torch::autograd::grad({logits.sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0]
        .to(torch::kFloat);
  };
  on(Network::discriminator, "D real", [&] {
    torch::Tensor real = real_share.to(d_device, /*non_blocking=*/true);
    if (options_.precision.channels_last && real.dim() == 4) real = real.contiguous(at::MemoryFormat::ChannelsLast);
    real_on_d = real;
    const bool r1 = options_.r1_gamma > 0 && (steps_ - 1) % options_.r1_every == 0;
    if (r1) real = real.detach().requires_grad_(true);
    r.discriminator_optimizer->zero_grad();
    torch::Tensor real_logits;
    {
      auto scope = autocast(d_device);
      hierpar::nn::BatchNormSyncGuard bn_sync(r.discriminator_bn_sync.get());
      std::optional<hierpar::ops::DoubleBackwardScope> keep_inputs;
      if (r1) keep_inputs.emplace();
      real_logits = r.discriminator.forward<torch::Tensor>(real);
      d_loss_real = loss(real_logits, LossTerm::real);
    }
    torch::Tensor d_objective_real = d_loss_real;
    if (r1) {
      const torch::Tensor penalty = input_gradient(real_logits, real).square().flatten(1).sum(1).mean();
      d_objective_real = d_loss_real + penalty * (0.5 * options_.r1_gamma * static_cast<double>(options_.r1_every));
    }
    // D's BatchNorm running statistics: the fakes' pass updates them after the real batch's.
    if (fake_stream) order(*main_stream, *fake_stream);
    // A captured step on one device from options_.joint_discriminator_backward_batch up runs both branches' backward
    // as one call: captured interleaved, the replay does not queue the fakes' backward (the path to D's update) behind
    // the whole real one. Eagerly the host's order is the launch order, and apart the real pass's activations are freed
    // before the fakes' are made. With a penalty a third term joins a parameter's gradient: kept apart, its sums are
    // those of placements that run the passes on two devices.
    if (phase == Phase::capture && fake_stream && !r1 && options_.gradient_penalty <= 0 &&
        real_share.size(0) >= options_.joint_discriminator_backward_batch) {
      real_objective_pending = d_objective_real;
      return;
    }
    if (averager_) averager_->set_final_backward(local, Network::discriminator, false);
    d_objective_real.backward();
  });

  // The fakes to D's device (ATen's copy orders both devices' streams with events); on one device, the same memory;
  // to D's process over the link.
  if (split) {
    between(g_device, runs_g ? "send fakes" : "receive fakes", [this, &r, runs_g, batch = real_share.size(0), g_device] {
      if (runs_g) {
        const torch::Tensor fake = r.fake.detach();
        const std::vector<int64_t> layout = fake_layout(fake);
        if (r.fake_layout.empty()) {  // the first step: D's process learns what it will receive
          r.fake_layout = layout;
          link_->send(torch::tensor(layout, torch::TensorOptions().device(g_device)), "the fakes' layout");
        }
        TORCH_CHECK(layout == r.fake_layout, "replica ", placement_.replicas[0].replica, ": G's output changed its "
                    "shape, dtype or memory format since the first step (", fake.sizes(), " ", fake.scalar_type(),
                    "); D's process allocated the first step's");
        link_->send(fake, "the fakes");
        return;
      }
      if (r.fake_layout.empty()) {
        torch::Tensor layout = torch::empty({kFakeLayoutLength}, torch::TensorOptions().dtype(torch::kLong).device(g_device));
        link_->receive(layout, "the fakes' layout");
        layout = layout.cpu();
        r.fake_layout.assign(layout.data_ptr<int64_t>(), layout.data_ptr<int64_t>() + kFakeLayoutLength);
      }
      if (!r.fake_on_d.defined() || r.fake_on_d.size(0) != batch) r.fake_on_d = empty_fakes(r.fake_layout, batch, g_device);
      link_->receive(r.fake_on_d, "the fakes");
    });
  } else if (two_devices && pipelined && r.ahead_on_d.defined() && r.ahead_on_d.sizes() == r.fake.sizes()) {
    // Pipelined: the previous step copied these fakes to D's device as soon as G made them.
    std::swap(r.fake_on_d, r.ahead_on_d);
  } else if (two_devices) {
    between(g_device, "copy fakes", [&r, d_device] {
      if (!r.fake_on_d.defined() || r.fake_on_d.sizes() != r.fake.sizes()) {
        r.fake_on_d = torch::empty_like(r.fake, r.fake.options().device(d_device));
      }
      r.fake_on_d.copy_(r.fake.detach(), /*non_blocking=*/true);
    });
  }

  // D's pass over the fakes; its gradients add to the real pass's.
  on(Network::discriminator, "D fakes", [&] {
    if (!two_devices && !split) {
      r.fake_on_d = r.fake.detach();
    } else if (!r.fake_on_d.defined()) {  // captured without a warm-up step: the buffer comes from D's graph pool
      r.fake_on_d = torch::empty_like(r.fake, r.fake.options().device(d_device));
    }
    {
      auto scope = autocast(d_device);
      hierpar::nn::BatchNormSyncGuard bn_sync(r.discriminator_bn_sync.get());
      c10::OptionalStreamGuard on_fake_stream(fake_stream);
      d_loss_fake = loss(r.discriminator.forward<torch::Tensor>(r.fake_on_d.detach()), LossTerm::fake);
    }
    if (fake_stream) {
      // The fakes and their loss, made on `fake_stream`, are read on the main stream from here on (after the joint
      // backward, whose real branch need not wait for the fakes' forward).
      if (!real_objective_pending.defined()) order(*fake_stream, *main_stream);
      r.fake_on_d.record_stream(*main_stream);
      d_loss_fake.record_stream(*main_stream);
    }
    torch::Tensor d_objective_fake = d_loss_fake;
    if (options_.gradient_penalty > 0) {
      const torch::Tensor fake = r.fake_on_d.detach();
      std::vector<int64_t> per_image(fake.dim(), 1);
      per_image[0] = fake.size(0);
      const torch::Tensor e = torch::rand(per_image, fake.options().dtype(torch::kFloat));
      const torch::Tensor mixed = (real_on_d * e + fake * (1 - e)).requires_grad_(true);
      torch::Tensor mixed_logits;
      {
        auto scope = autocast(d_device);
        hierpar::ops::DoubleBackwardScope keep_inputs;
        mixed_logits = r.discriminator.forward<torch::Tensor>(mixed);
      }
      const torch::Tensor penalty = (input_gradient(mixed_logits, mixed).flatten(1).norm(2, {1}) - 1).square().mean();
      d_objective_fake = d_loss_fake + penalty * options_.gradient_penalty;
    }
    if (averager_) averager_->set_final_backward(local, Network::discriminator, true);
    if (real_objective_pending.defined()) {
      // From the main stream: autograd runs each node on its forward's stream, the fakes' on `fake_stream`, and
      // sums a parameter's two gradients before its AccumulateGrad (one hook call, as bucketed averaging expects).
      torch::autograd::backward({real_objective_pending, d_objective_fake});
      real_objective_pending = torch::Tensor();
    } else {
      // Called from `fake_stream`, so that this backward does not wait for the real pass's, queued on the main
      // stream. D's AccumulateGrad nodes were made by the real pass's forward (d_loss_real keeps that graph) on
      // the main stream and run there: the fakes' gradients add to the real ones in the same order as on one stream.
      c10::OptionalStreamGuard on_fake_stream(fake_stream);
      d_objective_fake.backward();
    }
    // Its nodes ran on `fake_stream`; autograd has made the main stream wait for them (D's update reads those
    // gradients), and so does a capture's end: made explicit here and after G's backward.
    if (fake_stream) order(*fake_stream, *main_stream);
    if (averager_) averager_->backward_done(local, Network::discriminator);
  });
  average(Network::discriminator);

  // D's update, then G's loss through the updated D (D's weights frozen), back to the fakes on D's device only.
  on(Network::discriminator, "D update + G loss", [&] {
    r.discriminator_optimizer->step();
    // Under autocast, the casts of D's weights cached by the forwards above are stale after the update; the cache
    // is per thread, so each replica's thread clears its own.
    at::autocast::clear_cache();
    r.fake_on_d.requires_grad_(true);
    r.fake_on_d.mutable_grad() = torch::Tensor();
    {
      FrozenParameters frozen(r.discriminator_parameters);
      {
        auto scope = autocast(d_device);
        hierpar::nn::BatchNormSyncGuard bn_sync(r.discriminator_bn_sync.get());
        g_loss = loss(r.discriminator.forward<torch::Tensor>(r.fake_on_d), LossTerm::generator);
      }
      g_loss.backward();
    }
    r.fake_on_d.requires_grad_(false);
    // Kept without their autograd graphs: a graph kept alive past the step would keep the parameters'
    // AccumulateGrad nodes (and, captured, the capture's stream) alive.
    r.d_loss = (d_loss_real + d_loss_fake).detach();
    r.d_loss_real = d_loss_real.detach();
    r.d_loss_fake = d_loss_fake.detach();
    r.g_loss = g_loss.detach();
    torch::NoGradGuard no_grad;
    const auto row = torch::stack({r.d_loss_real, r.d_loss_fake, r.g_loss}).to(torch::kFloat).unsqueeze(0);
    r.loss_log.index_copy_(0, r.loss_row, row);
    r.loss_row.add_(1);
  });

  // Pipelined: the next step's fakes, on G's weights before this step's update. Queued after D's work of this step
  // (which they do not need), they run on G's device while D's runs; on two devices they go to D's at once, queued
  // here so that the copy (an ATen copy between devices waits for what both devices have queued) orders neither D's
  // passes of this step nor those of the next after G's backward.
  if (pipelined) {
    on(Network::generator, "G forward ahead", [&] {
      r.ahead_copy = 1 - r.fake_copy;
      r.ahead_fake = forward_on_copy(r.ahead_copy, next_noise());
    });
    if (two_devices) {
      between(g_device, "copy fakes ahead", [&r, d_device] {
        if (!r.ahead_on_d.defined() || r.ahead_on_d.sizes() != r.ahead_fake.sizes()) {
          r.ahead_on_d = torch::empty_like(r.ahead_fake, r.ahead_fake.options().device(d_device));
        }
        r.ahead_on_d.copy_(r.ahead_fake.detach(), /*non_blocking=*/true);
      });
    }
  }

  // The gradient w.r.t. the fakes to G's device, or G's process.
  if (split) {
    between(d_device, runs_d ? "send gradient" : "receive gradient", [this, &r, runs_d] {
      if (runs_d) {
        link_->send(r.fake_on_d.grad().contiguous(r.fake_on_d.suggest_memory_format()), "the fakes' gradient");
        return;
      }
      if (!r.fake_grad.defined() || r.fake_grad.sizes() != r.fake.sizes()) r.fake_grad = torch::empty_like(r.fake);
      link_->receive(r.fake_grad, "the fakes' gradient");
    });
  } else if (two_devices) {
    between(d_device, "copy gradient", [&r, g_device] {
      if (!r.fake_grad.defined()) r.fake_grad = torch::empty_like(r.fake_on_d.grad(), r.fake.options().device(g_device));
      r.fake_grad.copy_(r.fake_on_d.grad(), /*non_blocking=*/true);
    });
  }

  // G's backward from that gradient, its averaging and update.
  on(Network::generator, "G backward", [&] {
    if (!two_devices && !split) {
      r.fake_grad = r.fake_on_d.grad();
    } else if (!r.fake_grad.defined()) {
      r.fake_grad = torch::empty_like(r.fake);
    }
    r.generator_optimizer->zero_grad();
    if (pipelined) {
      // Through the copy that made the fakes; its gradients become G's.
      const std::vector<torch::Tensor> copy_parameters = r.generator_ahead[r.fake_copy].ptr()->parameters();
      for (const torch::Tensor& p : copy_parameters) p.mutable_grad() = torch::Tensor();
      torch::autograd::backward({r.fake}, {r.fake_grad});
      for (size_t i = 0; i < copy_parameters.size(); ++i) {
        r.generator_parameters[i].mutable_grad() = copy_parameters[i].grad();
        copy_parameters[i].mutable_grad() = torch::Tensor();
      }
    } else {
      torch::autograd::backward({r.fake}, {r.fake_grad});
    }
    if (fake_stream) order(*fake_stream, *main_stream);  // G's backward ran there
    if (averager_) averager_->backward_done(local, Network::generator);
  });
  average(Network::generator);
  on(Network::generator, "G update", [&] {
    r.generator_optimizer->step();
    if (!r.generator_ema.empty()) {
      torch::NoGradGuard no_grad;
      at::_foreach_lerp_(r.generator_ema, r.generator_parameters, 1.0 - options_.generator_ema_decay);
    }
    at::autocast::clear_cache();
    // The fakes' autograd graph is spent: G's activations are freed now, not at the next step's forward.
    if (phase == Phase::eager) r.fake = r.fake.detach();
  });
  close_open();
  r.first_step_done = true;
}

}  // namespace hierpar::strategy
