// hierpar-dcgan's flags resolved into what the run uses: the checkpoint's configuration, the placement and
// the step's settings (declared in dcgan_app.h).
#include "common/cli.h"
#include "common/dcgan_app.h"
#include "common/shared_flags.h"

#include <torch/cuda.h>

namespace hierpar::examples {

namespace {

constexpr int64_t kSyntheticImages = 2944;  // the seed's data set size

}  // namespace

Dataset load_training_data(const DCGANTrainConfig& config) {
  if (config.data == "fashion-mnist") return load_fashion_mnist(config.fashion_mnist_dir, /*train=*/true, config.limit);
  if (config.data == "mnist") return load_mnist(config.mnist_dir, /*train=*/true, config.limit);
  if (config.data == "synthetic")
    return make_synthetic(config.limit > 0 ? config.limit : kSyntheticImages, config.model.channels,
                          config.model.image_size, static_cast<uint64_t>(config.seed));
  auto folder = load_image_folder(config.data, config.model.channels, config.model.image_size);
  if (config.limit > 0 && folder.images.size(0) > config.limit) folder.images = folder.images.slice(0, 0, config.limit);
  return folder;
}

TrainingData open_training_data(const DCGANTrainConfig& config, torch::Device device) {
  TrainingData data;
  const auto placement = parse_placement(config.placement);
  const auto seed = static_cast<uint64_t>(config.seed);
  const auto& m = config.model;
  if (placement == BatchLoader::Placement::files) {
    auto files = std::make_shared<const ImageFiles>(config.data, m.channels, m.image_size, config.limit);
    data.description = files->description() + ", decoded batch by batch as training reads them";
    data.loader = std::make_unique<BatchLoader>(std::move(files), device, config.batch_size, seed);
    data.from_files = true;
    return data;
  }
  const Dataset set = load_training_data(config);
  const auto images = prepare_images(set.images, m.image_size, m.channels);
  data.description = set.description + " -> " + std::to_string(images.size(0)) + " images " + std::to_string(m.channels) +
                     "x" + std::to_string(m.image_size) + "x" + std::to_string(m.image_size);
  data.loader = std::make_unique<BatchLoader>(images, device, config.batch_size, placement, seed);
  return data;
}

void synchronize_devices(const hierpar::strategy::Placement& placement) {
  for (const auto& r : placement.replicas) {
    for (const torch::Device& d : {r.generator, r.discriminator})
      if (d.is_cuda()) torch::cuda::synchronize(d.index());
  }
}

void resolve_model(DCGANTrainConfig& config) {
  if (config.model.channels == 0) config.model.channels = config.data == "fashion-mnist" || config.data == "mnist" ? 1 : 3;
  config.model.validate();
}

Config checkpoint_config(const DCGANTrainConfig& config) {
  const auto& m = config.model;
  Config c{{"nz", std::to_string(m.nz)},
          {"image_size", std::to_string(m.image_size)},
          {"channels", std::to_string(m.channels)},
          {"width", format_number(m.width)},
          {"data", config.data},
          {"limit", std::to_string(config.limit)},
          {"batch_size", std::to_string(config.batch_size)},
          {"lr", format_number(config.lr)},
          {"beta1", format_number(config.beta1)},
          {"seed", std::to_string(config.seed)}};
  if (config.ema > 0) c["ema"] = format_number(config.ema);  // absent without one: older checkpoints resume
  if (config.r1 > 0) {
    c["r1"] = format_number(config.r1);
    c["r1_every"] = std::to_string(config.r1_every);
  }
  if (config.loss != "bce") c["loss"] = config.loss;
  if (config.loss == "wgan-gp") c["gp"] = format_number(config.gp);
  return c;
}

hierpar::strategy::Placement dcgan_placement(const DCGANTrainConfig& config) {
  namespace hs = hierpar::strategy;
  if (config.strategy != "single" && config.strategy != "task" && config.strategy != "data" &&
      config.strategy != "hierarchical")
    throw FlagError("--strategy: expected single, task, data or hierarchical, got '" + config.strategy + "'");
  if (!config.reduce.empty() && config.reduce != "host" && config.reduce != "nccl")
    throw FlagError("--reduce: expected host or nccl, got '" + config.reduce + "'");
  const hs::Scheme scheme = hs::parse_scheme(config.strategy);
  const hs::Launch launch = hs::Launch::from_env();
  const torch::Device device = parse_device(config.device);
  const hs::Reduce reduce = hs::parse_reduce(config.reduce.empty() ? (device.is_cuda() ? "nccl" : "host") : config.reduce);
  // Several replicas or G/D devices on the CPU are threads standing in for GPUs (tests, CI): only on request.
  if (device.is_cpu() && config.device.empty() &&
      (scheme != hs::Scheme::single || config.gpus > 1 || launch.multi_process()))
    throw FlagError("--strategy " + config.strategy + (config.gpus > 0 ? " --gpus " + std::to_string(config.gpus) : "") +
                    " needs CUDA devices and this machine has none; --device cpu runs it on CPU threads (for tests)");
  const bool indexed = device.is_cuda() && config.device.find(':') != std::string::npos;
  if (indexed && (scheme != hs::Scheme::single || launch.multi_process()))
    throw FlagError("--device " + config.device + " picks one GPU, which only --strategy single in one process "
                    "uses; give --device cuda (or nothing) and --gpus");
  const int64_t per_replica = scheme == hs::Scheme::task || scheme == hs::Scheme::hierarchical ? 2 : 1;
  const int64_t gpus = config.gpus > 0 ? config.gpus : per_replica * launch.world_size;
  hs::Placement placement;
  try {
    placement = hs::Placement::make(scheme, gpus, reduce, device.type(), launch);
  } catch (const c10::Error& e) {
    throw FlagError(e.what_without_backtrace());  // each names the flag (--gpus, --strategy) it is about
  }
  if (indexed) placement.replicas[0] = {0, device, device};  // --device cuda:N with single
  return placement;
}

StepSettings step_settings(const DCGANTrainConfig& config, c10::DeviceType device_type) {
  const bool cuda = device_type == c10::DeviceType::CUDA;
  StepSettings s;
  if (config.graphs != "auto" && config.graphs != "on" && config.graphs != "off")
    throw FlagError("--graphs: expected on or off, got '" + config.graphs + "'");
  if (config.overlap != "on" && config.overlap != "off")
    throw FlagError("--overlap: expected on or off, got '" + config.overlap + "'");
  if (config.optimizer != "auto" && config.optimizer != "adam" && config.optimizer != "fused")
    throw FlagError("--optimizer: expected adam or fused, got '" + config.optimizer + "'");
  if (config.log_every < 1) throw FlagError("--log-every: expected an integer >= 1, got " + std::to_string(config.log_every));
  if (config.graphs == "on" && !cuda) throw FlagError("--graphs on needs a CUDA device (this run is on the CPU)");
  const bool offload = config.model.memory == hierpar::nn::ActivationMemory::offload;
  if (config.graphs == "on" && offload)
    throw FlagError("--graphs on: --memory offload runs eagerly (its copies to and from pinned host memory are not "
                    "captured); use --graphs off, or --memory recompute under CUDA graphs");
  if (config.sync_batch_norm && config.model.memory != hierpar::nn::ActivationMemory::none)
    throw FlagError("--sync-bn with --memory " + std::string(hierpar::nn::to_string(config.model.memory)) +
                    ": the backward's recomputation would use one replica's BatchNorm statistics; use --memory none");
  if (offload && (config.r1 > 0 || config.loss == "wgan-gp"))
    throw FlagError("--memory offload: the R1 and gradient penalties differentiate through every block's input, which "
                    "offload keeps in host memory; use --memory recompute");
  try {
    s.schedule = hierpar::strategy::parse_schedule(config.schedule);
  } catch (const c10::Error& e) {
    throw FlagError(e.what_without_backtrace());
  }
  const bool pipelined = s.schedule == hierpar::strategy::Schedule::pipelined;
  if (config.graphs == "on" && pipelined)
    throw FlagError("--graphs on: --schedule pipelined runs eagerly (each step's next fakes keep their autograd graph "
                    "into the following step); use --graphs off");
  s.graphs = config.graphs == "on" || (config.graphs == "auto" && cuda && !offload && !pipelined);
  if (s.graphs && config.optimizer == "adam")
    throw FlagError("--optimizer adam cannot be captured in a CUDA graph: use --optimizer fused or --graphs off");
  s.fused_adam = config.optimizer == "fused" || (config.optimizer == "auto" && cuda);
  try {
    s.precision = hierpar::strategy::StepPrecision::from_flags(config.precision, config.channels_last, device_type);
  } catch (const c10::Error& e) {
    throw FlagError(e.what_without_backtrace());
  }
  s.overlap = config.overlap == "on" && cuda;
  return s;
}

hierpar::strategy::AdversarialOptions trainer_options(const DCGANTrainConfig& config, const StepSettings& step) {
  hierpar::strategy::AdversarialOptions options;
  options.generator_adam.lr = options.discriminator_adam.lr = config.lr;
  options.generator_adam.beta1 = options.discriminator_adam.beta1 = config.beta1;
  options.noise_shape = {config.model.nz};
  options.fused_adam = step.fused_adam;
  options.cuda_graphs = step.graphs;
  options.overlap_passes = step.overlap;
  options.schedule = step.schedule;
  options.precision = step.precision;
  options.loss_log_steps = config.log_every;
  options.generator_ema_decay = config.ema;
  options.r1_gamma = config.r1;
  options.r1_every = config.r1_every;
  options.loss = hierpar::strategy::loss_by_name(config.loss == "wgan-gp" ? "wasserstein" : config.loss);
  options.gradient_penalty = config.loss == "wgan-gp" ? config.gp : 0.0;
  options.sync_batch_norm = config.sync_batch_norm;
  return options;
}

std::string StepSettings::describe() const {
  std::string d = std::string("CUDA graphs ") + (graphs ? "on" : "off") + ", " + (fused_adam ? "FusedAdam" : "torch::optim::Adam");
  d += ", " + precision.to_string();
  if (overlap) {
    d += graphs ? ", two streams"
                : ", two streams from " + std::to_string(hierpar::strategy::kEagerOverlapBatch) + " images a replica";
  }
  if (schedule == hierpar::strategy::Schedule::pipelined) d += ", pipelined schedule (G one step ahead)";
  return d;
}

}  // namespace hierpar::examples
