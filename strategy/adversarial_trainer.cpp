#include "hierpar/strategy/adversarial_trainer.h"

#include "part_link.h"
#include "trainer_replica.h"
#include "replica_workers.h"
#include "hierpar/strategy/fused_adam.h"
#include "hierpar/strategy/sync_batch_norm.h"

#include "hierpar/enum_names.h"
#include "hierpar/nn/recompute.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

namespace hierpar::strategy {

namespace {
constexpr EnumNames<Schedule, 2> schedule_names{{{Schedule::exact, "exact"}, {Schedule::pipelined, "pipelined"}}};
}  // namespace

const char* to_string(Schedule schedule) { return name_of(schedule_names, schedule); }

Schedule parse_schedule(const std::string& name) {
  const std::optional<Schedule> schedule = value_named(schedule_names, name);
  TORCH_CHECK(schedule.has_value(), "--schedule must be ", listed_names(schedule_names), "; got \"", name, "\"");
  return *schedule;
}

std::pair<double, double> StepLosses::mean() const {
  TORCH_CHECK(!discriminator.empty() && discriminator.size() == generator.size(), "StepLosses: no losses to read");
  double d = 0.0, g = 0.0;
  for (size_t i = 0; i < discriminator.size(); ++i) {
    TORCH_CHECK(discriminator[i].defined(), "StepLosses: no losses in G's process of a split placement (D's process "
                "computes them); AdversarialTrainer::take_losses() brings them over");
    d += discriminator[i].item<double>();
    g += generator[i].item<double>();
  }
  return {d / discriminator.size(), g / generator.size()};
}

void convert_to_channels_last(torch::nn::Module& module) {
  for (auto& p : module.parameters()) {
    if (p.dim() == 4) p.set_data(p.data().contiguous(at::MemoryFormat::ChannelsLast));
  }
}

namespace {

using detail::current_stream;
using detail::gradients_of;
using detail::order;
using detail::PendingSpan;

torch::optim::AdamOptions adam_options(const AdamSettings& s) {
  return torch::optim::AdamOptions(s.lr).betas({s.beta1, s.beta2}).eps(s.eps).weight_decay(s.weight_decay);
}

// Parameters and buffers of a module grouped by dtype (a broadcast moves one flat buffer per dtype).
std::map<int, std::vector<torch::Tensor>> state_by_dtype(const torch::nn::Module& module) {
  std::map<int, std::vector<torch::Tensor>> groups;
  for (const torch::Tensor& t : module.parameters()) groups[static_cast<int>(t.scalar_type())].push_back(t);
  for (const torch::Tensor& t : module.buffers()) groups[static_cast<int>(t.scalar_type())].push_back(t);
  return groups;
}

// module.clone(device) without consuming the CPU generator: clone() re-runs each module's reset(), which draws a fresh
// initialisation before the original's values are copied in. Keeping the generator's state keeps the random numbers
// drawn later (the noise on a CPU placement) independent of how many copies a placement makes, so data runs match
// single runs.
torch::nn::AnyModule clone_keeping_cpu_generator(const torch::nn::AnyModule& module, const c10::Device& device) {
  at::Generator cpu_generator = at::detail::getDefaultCPUGenerator();
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(cpu_generator.mutex());
    state = cpu_generator.get_state();
  }
  torch::nn::AnyModule copy = module.clone(device);
  std::lock_guard<std::mutex> lock(cpu_generator.mutex());
  cpu_generator.set_state(state);
  return copy;
}

}  // namespace

AdversarialTrainer::AdversarialTrainer(torch::nn::AnyModule generator, torch::nn::AnyModule discriminator,
                                       Placement placement, AdversarialOptions options)
    : placement_(std::move(placement)), options_(std::move(options)) {
  placement_.validate();
  TORCH_CHECK(!generator.is_empty() && !discriminator.is_empty(), "AdversarialTrainer needs a generator and a discriminator module");
  TORCH_CHECK(options_.loss, "AdversarialTrainer: options.loss must be set");
  TORCH_CHECK(options_.generator_ema_decay >= 0 && options_.generator_ema_decay < 1, "AdversarialTrainer: "
              "options.generator_ema_decay must be in [0, 1) (0: no moving average), got ", options_.generator_ema_decay);
  TORCH_CHECK(options_.loss_log_steps >= 1, "AdversarialTrainer: options.loss_log_steps must be at least 1, got ",
              options_.loss_log_steps);
  TORCH_CHECK(std::isfinite(options_.r1_gamma) && options_.r1_gamma >= 0, "AdversarialTrainer: options.r1_gamma must "
              "be >= 0 (0: no R1 penalty), got ", options_.r1_gamma);
  TORCH_CHECK(options_.r1_every >= 1, "AdversarialTrainer: options.r1_every must be at least 1, got ", options_.r1_every);
  TORCH_CHECK(!(options_.r1_gamma > 0 && options_.sync_batch_norm), "AdversarialTrainer: the R1 penalty "
              "(options.r1_gamma) cannot differentiate through synchronized BatchNorm (options.sync_batch_norm)");
  TORCH_CHECK(std::isfinite(options_.gradient_penalty) && options_.gradient_penalty >= 0, "AdversarialTrainer: "
              "options.gradient_penalty must be >= 0 (0: none), got ", options_.gradient_penalty);
  TORCH_CHECK(!(options_.gradient_penalty > 0 && options_.sync_batch_norm), "AdversarialTrainer: the gradient "
              "penalty (options.gradient_penalty) cannot differentiate through synchronized BatchNorm "
              "(options.sync_batch_norm)");
  TORCH_CHECK(options_.joint_discriminator_backward_batch >= 1, "AdversarialTrainer: options."
              "joint_discriminator_backward_batch must be a batch of at least 1, got ",
              options_.joint_discriminator_backward_batch);
  TORCH_CHECK(options_.eager_overlap_batch >= 1, "AdversarialTrainer: options.eager_overlap_batch must be a batch of "
              "at least 1, got ", options_.eager_overlap_batch);
  TORCH_CHECK(options_.graph_warmup_steps >= 0, "AdversarialTrainer: options.graph_warmup_steps must be >= 0, got ",
              options_.graph_warmup_steps);
  const bool pipelined = options_.schedule == Schedule::pipelined;
  TORCH_CHECK(!(pipelined && placement_.split()), "AdversarialTrainer: the pipelined schedule (options.schedule) "
              "runs a replica's G and D in one process; a placement with a process per device runs the exact one");
  TORCH_CHECK(!(pipelined && options_.sync_batch_norm), "AdversarialTrainer: the pipelined schedule "
              "(options.schedule) runs G's forward on copies of G, which synchronized BatchNorm (options.sync_batch_norm) "
              "does not reach");
  // A split placement's process keeps the network it runs; the other one's module is left as it came.
  const ReplicaPart part = placement_.replicas[0].part;
  const bool runs_g = part != ReplicaPart::discriminator, runs_d = part != ReplicaPart::generator;
  TORCH_CHECK(!(placement_.split() && options_.cuda_graphs && options_.graph_warmup_steps < 1), "AdversarialTrainer: "
              "a split placement needs options.graph_warmup_steps >= 1 (the first step tells D's process the fakes' "
              "layout), got ", options_.graph_warmup_steps);
  for (int64_t i = 0; i < placement_.local_replicas(); ++i) {
    const ReplicaDevices& devices = placement_.replicas[i];
    auto replica = std::make_unique<Replica>();
    if (i == 0) {
      if (runs_g) {
        generator.ptr()->to(devices.generator);
        replica->generator = std::move(generator);
      }
      if (runs_d) {
        discriminator.ptr()->to(devices.discriminator);
        replica->discriminator = std::move(discriminator);
      }
    } else {
      replica->generator = clone_keeping_cpu_generator(replicas_[0]->generator, devices.generator);
      replica->discriminator = clone_keeping_cpu_generator(replicas_[0]->discriminator, devices.discriminator);
    }
    for (torch::nn::AnyModule* module : {&replica->generator, &replica->discriminator}) {
      if (module->is_empty()) continue;
      if (options_.precision.channels_last) convert_to_channels_last(*module->ptr());
      TORCH_CHECK(!module->ptr()->parameters().empty(), "AdversarialTrainer: the generator and the discriminator must "
                  "have parameters");
    }
    if (pipelined) {
      for (auto& copy : replica->generator_ahead) {
        copy = clone_keeping_cpu_generator(replica->generator, devices.generator);
      }
    }
    if (runs_g) replica->generator_parameters = replica->generator.ptr()->parameters();
    if (runs_d) replica->discriminator_parameters = replica->discriminator.ptr()->parameters();
    for (const torch::Tensor& p : replica->generator_parameters) {
      if (options_.generator_ema_decay > 0) replica->generator_ema.push_back(p.detach().clone());
    }
    auto make_optimizer = [&](const std::vector<torch::Tensor>& parameters,
                              const AdamSettings& settings) -> std::unique_ptr<torch::optim::Adam> {
      if (options_.fused_adam) {
        return std::make_unique<FusedAdam>(parameters, adam_options(settings), options_.fused_adam_kernel);
      }
      return std::make_unique<torch::optim::Adam>(parameters, adam_options(settings));
    };
    if (runs_g) replica->generator_optimizer = make_optimizer(replica->generator_parameters, options_.generator_adam);
    if (runs_d) {
      replica->discriminator_optimizer = make_optimizer(replica->discriminator_parameters, options_.discriminator_adam);
    }
    // The losses are computed on D's device; G's process of a split placement receives them there (drain_losses).
    const auto on_d = torch::TensorOptions().device(devices.discriminator);
    replica->loss_log = torch::zeros({options_.loss_log_steps, 3}, on_d.dtype(torch::kFloat));
    replica->loss_row = torch::zeros({1}, on_d.dtype(torch::kLong));
    replicas_.push_back(std::move(replica));
  }
  for (int64_t i = 0; i < placement_.local_replicas(); ++i) {
    for (int64_t j = 0; j < i; ++j) shared_noise_generator_ |= placement_.replicas[i].generator == placement_.replicas[j].generator;
  }
  if (options_.cuda_graphs) {
    TORCH_CHECK(options_.fused_adam, "AdversarialTrainer: cuda_graphs needs fused_adam (torch::optim::Adam's step "
                "reads its step counts on the host, which a graph cannot replay)");
    for (const ReplicaDevices& r : placement_.replicas) {
      TORCH_CHECK(r.generator.is_cuda() && r.discriminator.is_cuda() && cuda_graphs_available(),
                  "AdversarialTrainer: cuda_graphs needs CUDA devices, got G ", r.generator, ", D ", r.discriminator);
    }
    if (options_.sync_batch_norm && placement_.global_replicas() > 1) {
      graph_fallback_ = "CUDA graphs off: synchronized BatchNorm sums statistics across replicas inside the "
                        "forward and backward passes, which this trainer does not capture; steps run eagerly";
    } else if (options_.r1_gamma > 0) {
      graph_fallback_ = "CUDA graphs off: the R1 penalty runs on every " + std::to_string(options_.r1_every) +
                        "th step only, and one captured step would run it on all or none; steps run eagerly";
    } else if (options_.gradient_penalty > 0) {
      graph_fallback_ = "CUDA graphs off: the gradient penalty's double backward is not captured by this trainer; "
                        "steps run eagerly";
    } else if (pipelined) {
      graph_fallback_ = "CUDA graphs off: the pipelined schedule keeps each step's next fakes, with their autograd "
                        "graph, into the following step, which a replayed graph cannot; steps run eagerly";
    } else {
      graphs_ = true;
      for (int64_t i = 0; i < placement_.local_replicas(); ++i) {
        const ReplicaDevices& devices = placement_.replicas[i];
        replicas_[i]->graph = std::make_unique<CapturedStep>(devices.discriminator);
        if (devices.generator != devices.discriminator) {
          replicas_[i]->generator_graph = std::make_unique<CapturedStep>(devices.generator);
        }
      }
    }
  }
  // Synchronized BatchNorm's host sums meet at the host averager's barriers from the autograd threads: gradient
  // buckets, summed on the averager's own threads during the backward, must not run beside them.
  AveragingOptions averaging = options_.averaging;
  if (options_.sync_batch_norm && placement_.reduce == Reduce::host) averaging.bucket_cap_bytes = 0;
  // The pipelined schedule's G backward runs through a copy of G, whose gradients reach G's own parameters after it:
  // no bucket hooks there, so both networks average one flat buffer after their backward.
  if (pipelined) averaging.bucket_cap_bytes = 0;
  if (placement_.split()) {
    // The link to the other part, then the averager of the processes that run the same part (each network's groups
    // have their own prefix in the store, so G's and D's processes never meet there).
    if (!averaging.store) averaging.store = connect_launch_store(placement_.launch, averaging.timeout);
    averaging.networks = {runs_g ? Network::generator : Network::discriminator};
    link_ = std::make_unique<detail::PartLink>(placement_, averaging.store, averaging.timeout);
  }
  averager_ = make_averager(placement_, averaging);
  if (graphs_ && averager_) graph_averaging_ = averager_->graph_averaging();
  // Eager averaging hooks into the backward (buckets averaged as their gradients become ready), which
  // assumes one stream; so do synchronized BatchNorm's collectives, which only run eagerly.
  // The gradient penalty's pass reads the real batch and the fakes together: one stream.
  if (options_.overlap_passes && !(averager_ && !graphs_) && options_.gradient_penalty == 0 && !pipelined) {
    for (int64_t i = 0; i < placement_.local_replicas(); ++i) {
      const ReplicaDevices& devices = placement_.replicas[i];
      if (devices.generator != devices.discriminator || !devices.generator.is_cuda() || placement_.split()) continue;
      c10::impl::VirtualGuardImpl guard_impl(devices.generator.type());
      for (int k = 0; k < 2; ++k) {
        replicas_[i]->pass_streams.push_back(guard_impl.getStreamFromGlobalPool(devices.generator));
      }
      TORCH_INTERNAL_ASSERT(replicas_[i]->pass_streams[0] != replicas_[i]->pass_streams[1]);
      // D's gradients from the fakes' branch (made on the second stream) accumulate on the stream of D's
      // AccumulateGrad nodes (the main one): autograd syncs them correctly and warns once that the streams
      // differ, which here is the design.
      at::globalContext().setWarnOnAccumulateGradStreamMismatch(false);
    }
  }
  workers_ = std::make_unique<Workers>(placement_.local_replicas(), options_.report_failures, options_.averaging.timeout);
  if (averager_) {
    workers_->run([this](int64_t i) { averager_->connect(i); }, averager_.get(), placement_);
    if (placement_.launch.multi_process()) broadcast_from_replica0();
    // Bucketed averaging (host_averager.cpp, collective_averager.cpp) and synchronized BatchNorm (sync_batch_norm.cpp).
    // The hooks fire during a capture too: the buckets' all-reduces (NCCL) or copies to the host become part of the
    // graph; captured steps that average between their segments attach none.
    for (int64_t i = 0; i < placement_.local_replicas(); ++i) {
      Replica& r = *replicas_[i];
      if (!graphs_ || graph_averaging_ != GraphAveraging::between) {
        if (runs_g) averager_->attach(i, Network::generator, r.generator_parameters);
        if (runs_d) averager_->attach(i, Network::discriminator, r.discriminator_parameters);
      }
      if (options_.sync_batch_norm) {
        if (runs_g) r.generator_bn_sync = std::make_unique<ReplicaBatchNormSync>(*averager_, i, Network::generator);
        if (runs_d) r.discriminator_bn_sync = std::make_unique<ReplicaBatchNormSync>(*averager_, i, Network::discriminator);
      }
    }
  }
}

AdversarialTrainer::~AdversarialTrainer() {
  if (!workers_ || workers_->settle(Workers::kStuckGrace)) {
    release_graphs();
    return;
  }
  // A replica's thread never returned from a failed step: it may still wake and use the replicas and the
  // averager, so they are left allocated (released, not destroyed), as is the thread.
  TORCH_WARN("AdversarialTrainer: a replica's thread is stuck in a failed step; leaving it and its state behind");
  (void)workers_.release();
  (void)averager_.release();
  for (auto& replica : replicas_) (void)replica.release();
}

// A communicator whose collectives a CUDA graph captured is destroyed only once that graph is (NCCL waits for it), so
// the graphs go before the averager. Their memory pools return to the allocator: replays still queued must end first,
// unless the run failed (a replay may then wait for a dead peer until its communicator is aborted).
void AdversarialTrainer::release_graphs() {
  bool failed;
  {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    failed = !failure_.empty();
  }
  for (auto& replica : replicas_) {
    for (CapturedStep* graph : {replica->graph.get(), replica->generator_graph.get()}) {
      if (graph != nullptr && graph->captured() && !failed) {
        c10::Event drained(c10::kCUDA);
        drained.record(current_stream(graph->device()));
        drained.synchronize();
      }
    }
    replica->program.clear();
    replica->graph.reset();
    replica->generator_graph.reset();
  }
}

void AdversarialTrainer::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    if (failure_.empty()) failure_ = reason;
  }
  if (averager_) averager_->abort(reason);
  if (link_) link_->abort(reason);
  if (workers_) workers_->interrupt(reason);
}

int64_t AdversarialTrainer::progress() const {
  return (averager_ ? averager_->progress() + replayed_averages_.load(std::memory_order_relaxed) : 0) +
         (link_ ? link_->progress() : 0);
}

void AdversarialTrainer::refuse_if_failed() const {
  std::lock_guard<std::mutex> lock(failure_mutex_);
  TORCH_CHECK(failure_.empty(), "AdversarialTrainer: an earlier step failed, so this trainer refuses every later one "
              "(its replicas may differ; build a new trainer, e.g. from the last checkpoint). The failure: ", failure_);
}

void AdversarialTrainer::require_network(Network network) const {
  const ReplicaPart part = placement_.replicas[0].part;
  TORCH_CHECK(part == ReplicaPart::whole || (network == Network::generator) == (part == ReplicaPart::generator),
              "AdversarialTrainer: this process (rank ", placement_.launch.rank, ") runs only the ", to_string(part),
              " of replica ", placement_.replicas[0].replica, "; its ", to_string(network), " is in rank ",
              placement_.peer_rank());
}

torch::nn::AnyModule& AdversarialTrainer::generator(int64_t local) {
  require_network(Network::generator);
  return replicas_.at(local)->generator;
}
torch::nn::AnyModule& AdversarialTrainer::discriminator(int64_t local) {
  require_network(Network::discriminator);
  return replicas_.at(local)->discriminator;
}
torch::optim::Adam& AdversarialTrainer::generator_optimizer(int64_t local) {
  require_network(Network::generator);
  return *replicas_.at(local)->generator_optimizer;
}
torch::optim::Adam& AdversarialTrainer::discriminator_optimizer(int64_t local) {
  require_network(Network::discriminator);
  return *replicas_.at(local)->discriminator_optimizer;
}

const std::vector<torch::Tensor>& AdversarialTrainer::generator_ema(int64_t local) const {
  return replicas_.at(local)->generator_ema;
}

void AdversarialTrainer::broadcast_from_replica0() {
  if (!averager_) return;
  refuse_if_failed();
  workers_->run(
      [this](int64_t i) {
        torch::NoGradGuard no_grad;
        const Replica& r = *replicas_[i];
        for (const auto& [network, module] : {std::pair{Network::generator, &r.generator},
                                              std::pair{Network::discriminator, &r.discriminator}}) {
          if (module->is_empty()) continue;  // the other process's network (a split placement)
          for (auto& [dtype, tensors] : state_by_dtype(*module->ptr())) averager_->broadcast_from_first(i, network, tensors);
        }
      },
      averager_.get(), placement_);
}

void AdversarialTrainer::copy_discriminator_to_generator_process(torch::nn::Module* discriminator,
                                                                 torch::optim::Optimizer* optimizer) {
  if (!link_) return;
  refuse_if_failed();
  // One serialised archive (module and optimiser) in two transfers: its size, then its bytes.
  const c10::Device device = placement_.replicas[0].discriminator;  // this process's one device
  torch::Tensor size = torch::empty({1}, torch::TensorOptions().dtype(torch::kLong).device(device));
  if (placement_.replicas[0].part == ReplicaPart::discriminator) {
    torch::serialize::OutputArchive module_archive, optimizer_archive, archive;
    replicas_[0]->discriminator.ptr()->save(module_archive);
    replicas_[0]->discriminator_optimizer->save(optimizer_archive);
    archive.write("module", module_archive);
    archive.write("optimizer", optimizer_archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    const std::string text = bytes.str();
    size.fill_(static_cast<int64_t>(text.size()));
    link_->send(size, "the discriminator's size");
    const torch::Tensor payload =
        torch::from_blob(const_cast<char*>(text.data()), {static_cast<int64_t>(text.size())}, torch::kUInt8).clone();
    link_->send(payload.to(device), "the discriminator");
    return;
  }
  TORCH_CHECK(discriminator != nullptr && optimizer != nullptr, "copy_discriminator_to_generator_process: G's "
              "process needs a discriminator and an optimizer to load into");
  link_->receive(size, "the discriminator's size");
  torch::Tensor payload = torch::empty({size.item<int64_t>()}, torch::TensorOptions().dtype(torch::kUInt8).device(device));
  link_->receive(payload, "the discriminator");
  payload = payload.cpu().contiguous();
  torch::serialize::InputArchive archive, module_archive, optimizer_archive;
  archive.load_from(reinterpret_cast<const char*>(payload.data_ptr()), static_cast<size_t>(payload.numel()), torch::kCPU);
  archive.read("module", module_archive);
  archive.read("optimizer", optimizer_archive);
  discriminator->load(module_archive);
  optimizer->load(optimizer_archive);
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
  // Replicas that share a generator (CPU) would race for it: their rows of one global draw are made here.
  auto rows_of_one_draw = [&] {
    const int64_t share = reals[0].size(0);
    const torch::Tensor all = global_noise(share, placement_.replicas[0].generator);
    std::vector<torch::Tensor> rows;
    for (size_t i = 0; i < reals.size(); ++i) {
      TORCH_CHECK(reals[i].size(0) == share, "step_shares: replicas drawing their noise need equal shares, got ",
                  reals[i].size(0), " and ", share);
      rows.push_back(all.narrow(0, placement_.replicas[i].replica * share, share));
    }
    return rows;
  };
  std::vector<torch::Tensor> shares = noises;
  const bool draw = std::none_of(noises.begin(), noises.end(), [](const torch::Tensor& n) { return n.defined(); });
  if (options_.schedule == Schedule::pipelined) {
    TORCH_CHECK(draw, "AdversarialTrainer: the pipelined schedule draws G's noise itself (the next step's forward runs "
                "during this one): call step(real) without noise");
    if (shared_noise_generator_) {
      // The draws the replicas' steps will make, in order: this step's fakes too when the pipeline is empty (the first
      // step, or another batch size), then the next step's.
      const Replica& first = *replicas_[0];
      const bool refill = !first.ahead_fake.defined() || first.ahead_fake.size(0) != reals[0].size(0);
      for (int draws = refill ? 2 : 1; draws > 0; --draws) {
        const std::vector<torch::Tensor> rows = rows_of_one_draw();
        for (size_t i = 0; i < rows.size(); ++i) replicas_[i]->drawn_noise.push_back(rows[i]);
      }
    }
  } else if (draw && shared_noise_generator_) {
    shares = rows_of_one_draw();
  }
  // A replayed step's all-reduces spin on the device until every replica's arrive, and an ATen copy between devices
  // orders both devices' current streams: a replica that copied its share from another replica's device after that
  // replica's replay was queued would wait for it while it waits for this one. The shares move here, before any
  // replica replays this step.
  std::vector<torch::Tensor> placed = reals;
  if (graph_averaging_ == GraphAveraging::whole && placement_.local_replicas() > 1) {
    for (size_t i = 0; i < reals.size(); ++i) {
      const ReplicaDevices& devices = placement_.replicas[i];
      placed[i] = reals[i].to(devices.discriminator, /*non_blocking=*/true);
      if (shares[i].defined()) shares[i] = shares[i].to(devices.generator, /*non_blocking=*/true);
    }
  }
  refuse_if_failed();
  if (pending_losses_ == options_.loss_log_steps) drain_losses();
  // Held by the job, which a replica left behind as hung keeps alive (Workers).
  auto losses = std::make_shared<StepLosses>();
  losses->discriminator.resize(reals.size());
  losses->discriminator_real.resize(reals.size());
  losses->discriminator_fake.resize(reals.size());
  losses->generator.resize(reals.size());
  const int64_t step = steps_++;
  const PrecisionScope precision(options_.precision);
  // A startup step may keep one replica far longer than replica 0; later ones are a hang after the averaging timeout.
  const auto straggler_limit =
      step < options_.startup_steps()
          ? std::max<std::chrono::milliseconds>(options_.averaging.timeout, std::chrono::minutes(1))
          : options_.averaging.timeout;
  // The step that captures (warm-up done, nothing captured yet) starts with the warm-up's cached memory given back,
  // so that a batch that fits eagerly also fits captured (the capture cannot reuse or free those blocks).
  if (graphs_ && replicas_[0]->program.empty() && replicas_[0]->warmup_done >= options_.graph_warmup_steps) {
    release_cached_memory_before_capture();
  }
  try {
    workers_->run(
        [this, losses, placed, shares, step](int64_t i) {
          if (options_.fault_hook) options_.fault_hook(placement_.replicas[i].replica, step);
          step_replica(i, placed[i], shares[i], *losses);
        },
        averager_.get(), placement_, straggler_limit);
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    if (failure_.empty()) {
      const auto* error = dynamic_cast<const c10::Error*>(&e);
      const std::string what = error != nullptr ? error->what_without_backtrace() : e.what();
      failure_ = what.substr(0, what.find('\n'));
    }
    throw;
  }
  ++pending_losses_;
  return *losses;
}

torch::Tensor AdversarialTrainer::global_noise(int64_t share, const c10::Device& device) const {
  std::vector<int64_t> shape{share * placement_.global_replicas()};
  shape.insert(shape.end(), options_.noise_shape.begin(), options_.noise_shape.end());
  return torch::randn(shape, torch::TensorOptions().device(device));
}

torch::Tensor AdversarialTrainer::draw_noise(int64_t local, int64_t share) const {
  // The whole global batch's noise, of which this replica keeps its rows: every replica's draw (and a
  // single-device run's) consumes its generator alike, so the numbers do not depend on the placement.
  const ReplicaDevices& devices = placement_.replicas[local];
  return global_noise(share, devices.generator).narrow(0, devices.replica * share, share);
}

std::optional<c10::Stream> AdversarialTrainer::fake_pass_stream(int64_t local, int64_t share) const {
  const Replica& r = *replicas_[local];
  const std::vector<c10::Stream>& streams = r.pass_streams;
  if (streams.empty() || !r.first_step_done) return std::nullopt;
  if (!graphs_ && share < options_.eager_overlap_batch) return std::nullopt;
  return streams[0] == current_stream(placement_.replicas[local].discriminator) ? streams[1] : streams[0];
}

void AdversarialTrainer::drain_losses() {
  if (pending_losses_ == 0) return;
  if (link_) {  // computed in D's process: G's receives them
    const torch::Tensor rows = replicas_[0]->loss_log.narrow(0, 0, pending_losses_);
    if (placement_.replicas[0].part == ReplicaPart::discriminator) {
      link_->send(rows, "the losses");
    } else {
      link_->receive(rows, "the losses");
    }
  }
  std::vector<torch::Tensor> per_replica;
  for (const auto& r : replicas_) {
    per_replica.push_back(r->loss_log.narrow(0, 0, pending_losses_).to(torch::kCPU));
    r->loss_row.zero_();
  }
  drained_losses_.push_back(torch::stack(per_replica).mean(0));
  pending_losses_ = 0;
}

torch::Tensor AdversarialTrainer::take_losses() {
  drain_losses();
  torch::Tensor all = drained_losses_.empty() ? torch::empty({0, 3}) : torch::cat(drained_losses_);
  drained_losses_.clear();
  return all;
}

int64_t AdversarialTrainer::graph_kernel_nodes(int64_t local) const {
  const Replica& r = *replicas_.at(local);
  if (!r.graph || !r.graph->captured()) return 0;
  return r.graph->kernel_nodes() + (r.generator_graph ? r.generator_graph->kernel_nodes() : 0);
}

torch::Tensor AdversarialTrainer::graph_input(int64_t local) const { return replicas_.at(local)->static_real; }

void AdversarialTrainer::step_replica(int64_t local, const torch::Tensor& real_share, const torch::Tensor& noise_share,
                                      StepLosses& out) {
  Replica& r = *replicas_[local];
  const ReplicaDevices& devices = placement_.replicas[local];
  c10::OptionalDeviceGuard device_guard(devices.discriminator);
  // Offloading modules (hierpar::nn::recompute with an OffloadChain) plan their devices' memory from measured steps.
  hierpar::nn::begin_offload_step(devices.generator);
  if (devices.discriminator != devices.generator) hierpar::nn::begin_offload_step(devices.discriminator);
  if (graphs_) {
    graph_step_replica(local, real_share, noise_share);
  } else {
    step_body(local, real_share, noise_share, Phase::eager);
  }
  out.discriminator[local] = r.d_loss;
  out.discriminator_real[local] = r.d_loss_real;
  out.discriminator_fake[local] = r.d_loss_fake;
  out.generator[local] = r.g_loss;
}

void AdversarialTrainer::timed(int64_t local, const c10::Device& device, const std::string& piece, bool compute,
                               const std::function<void()>& work) {
  if (!timeline_on_ || !device.is_cuda()) {
    work();
    return;
  }
  Replica& r = *replicas_[local];
  PendingSpan span{steps_ - 1, device, piece, compute, c10::Event(c10::kCUDA, c10::EventFlag::BACKEND_DEFAULT),
                   c10::Event(c10::kCUDA, c10::EventFlag::BACKEND_DEFAULT)};
  span.start.record(current_stream(device));
  work();
  span.end.record(current_stream(device));
  r.spans.push_back(std::move(span));
}

void AdversarialTrainer::record_timeline(bool on) {
  timeline_on_ = on;
  if (!on) return;
  // Time zero on every device at once: each device's stream drained, then one event per device back to back.
  std::vector<c10::Device> devices;
  for (const ReplicaDevices& r : placement_.replicas) {
    for (const c10::Device& d : {r.generator, r.discriminator}) {
      if (d.is_cuda() && std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
    }
  }
  for (const c10::Device& d : devices) {
    c10::Event drained(c10::kCUDA);
    drained.record(current_stream(d));
    drained.synchronize();
  }
  timeline_refs_.clear();
  for (const c10::Device& d : devices) {
    auto zero = std::make_shared<c10::Event>(c10::kCUDA, c10::EventFlag::BACKEND_DEFAULT);
    zero->record(current_stream(d));
    timeline_refs_.emplace_back(d, std::move(zero));
  }
}

std::vector<TimelineSpan> AdversarialTrainer::timeline() {
  std::vector<TimelineSpan> out;
  for (int64_t i = 0; i < placement_.local_replicas(); ++i) {
    for (PendingSpan& span : replicas_[i]->spans) {
      span.end.synchronize();
      const auto ref = std::find_if(timeline_refs_.begin(), timeline_refs_.end(),
                                    [&](const auto& entry) { return entry.first == span.device; });
      TORCH_INTERNAL_ASSERT(ref != timeline_refs_.end(), "timeline: no time zero for ", span.device);
      out.push_back(TimelineSpan{span.step, placement_.replicas[i].replica, span.device, span.piece, span.compute,
                                 ref->second->elapsedTime(span.start), ref->second->elapsedTime(span.end)});
    }
    replicas_[i]->spans.clear();
  }
  std::sort(out.begin(), out.end(), [](const TimelineSpan& a, const TimelineSpan& b) { return a.start_ms < b.start_ms; });
  return out;
}

void AdversarialTrainer::graph_step_replica(int64_t local, const torch::Tensor& real_share,
                                            const torch::Tensor& noise_share) {
  Replica& r = *replicas_[local];
  const ReplicaDevices& devices = placement_.replicas[local];
  if (!r.static_real.defined()) {
    r.static_real = torch::empty(real_share.sizes(), real_share.options().device(devices.discriminator),
                                 options_.precision.channels_last && real_share.dim() == 4 ? at::MemoryFormat::ChannelsLast
                                                                                 : at::MemoryFormat::Contiguous);
    r.noise_given = noise_share.defined();
    if (r.noise_given) r.static_noise = torch::empty(noise_share.sizes(), noise_share.options().device(devices.generator));
  }
  TORCH_CHECK(real_share.sizes() == r.static_real.sizes() && real_share.scalar_type() == r.static_real.scalar_type(),
              "step: under CUDA graphs every step's batch must have the first step's shape and dtype (",
              r.static_real.sizes(), " ", r.static_real.scalar_type(), "), got ", real_share.sizes(), " ",
              real_share.scalar_type());
  TORCH_CHECK(noise_share.defined() == r.noise_given, "step: under CUDA graphs noise must be given at every step "
              "or at none (the first step ", r.noise_given ? "gave" : "did not give", " it)");
  // The only work outside the graphs: the batch (and given noise) into the buffers the graphs read.
  const bool in_place = real_share.data_ptr() == r.static_real.data_ptr() &&
                        real_share.strides() == r.static_real.strides() && real_share.device() == r.static_real.device();
  // (G's process of a split placement reads only the batch's size.)
  if (!in_place && devices.part != ReplicaPart::generator) r.static_real.copy_(real_share, /*non_blocking=*/true);
  if (r.noise_given) {
    TORCH_CHECK(noise_share.sizes() == r.static_noise.sizes(), "step: under CUDA graphs the noise must keep the "
                "first step's shape ", r.static_noise.sizes(), ", got ", noise_share.sizes());
    r.static_noise.copy_(noise_share, /*non_blocking=*/true);
  }
  if (r.warmup_done < options_.graph_warmup_steps) {
    // On each device's side stream, as the capture will run (autograd keeps the streams it first saw).
    auto body = [&] { step_body(local, r.static_real, r.static_noise, Phase::eager); };
    if (r.generator_graph) {
      r.graph->warm_up([&] { r.generator_graph->warm_up(body); });
    } else {
      r.graph->warm_up(body);
    }
    ++r.warmup_done;
    return;
  }
  // A learning rate set since the last step (a schedule) into the device tensors the captured updates read.
  for (torch::optim::Adam* optimizer : {r.generator_optimizer.get(), r.discriminator_optimizer.get()}) {
    if (optimizer == nullptr) continue;  // the other process's network (a split placement)
    auto* fused = dynamic_cast<FusedAdam*>(optimizer);
    TORCH_INTERNAL_ASSERT(fused != nullptr, "cuda_graphs runs FusedAdam optimisers");
    fused->sync_learning_rate();
  }
  // The capture runs nothing (and so averages and copies nothing): every replica captures in the same step, then
  // all replay it below.
  if (r.program.empty()) {
    std::vector<CapturedStep*> graphs{r.graph.get()};
    if (r.generator_graph) graphs.push_back(r.generator_graph.get());
    for (CapturedStep* graph : graphs) graph->begin_capture();
    try {
      step_body(local, r.static_real, r.static_noise, Phase::capture);
    } catch (...) {
      for (CapturedStep* graph : graphs) graph->abandon_capture();
      r.program.clear();
      throw;
    }
    for (CapturedStep* graph : graphs) graph->end_capture();
    if (graph_averaging_ == GraphAveraging::whole) averager_->captured(local);
  }
  if (graph_averaging_ == GraphAveraging::whole) replayed_averages_.fetch_add(1, std::memory_order_relaxed);
  for (const ProgramPiece& piece : r.program) timed(local, piece.device, piece.name, piece.compute, piece.run);
}

}  // namespace hierpar::strategy
