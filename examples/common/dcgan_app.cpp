#include "common/dcgan_app.h"

#include "common/cli.h"
#include "common/data.h"
#include "common/images.h"
#include "hierpar/strategy/adversarial_trainer.h"
#include "hierpar/strategy/run_guard.h"

#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/csrc/jit/frontend/sugared_value.h>
#include <torch/cuda.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <thread>

#include <signal.h>
#include <unistd.h>

namespace hierpar::examples {
namespace fs = std::filesystem;

namespace {

constexpr int64_t kSyntheticImages = 2944;  // the seed's data set size

std::string format_double(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

Dataset load_training_data(const DCGANTrainConfig& config) {
  if (config.data == "fashion-mnist") return load_fashion_mnist(config.fashion_mnist_dir, /*train=*/true, config.limit);
  if (config.data == "synthetic")
    return make_synthetic(config.limit > 0 ? config.limit : kSyntheticImages, config.model.channels,
                          config.model.image_size, static_cast<uint64_t>(config.seed));
  auto folder = load_image_folder(config.data, config.model.channels);
  if (config.limit > 0 && folder.images.size(0) > config.limit) folder.images = folder.images.slice(0, 0, config.limit);
  return folder;
}

int64_t count_parameters(torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

void write_losses(const std::string& out, const torch::Tensor& history, int64_t batches_per_epoch) {
  const std::string csv = out + "/losses.csv", tmp = csv + ".tmp";
  {
    std::ofstream f(tmp);
    f << "step,epoch,loss_d_real,loss_d_fake,loss_g\n";
    auto h = history.accessor<float, 2>();
    for (int64_t i = 0; i < history.size(0); ++i) {
      f << i + 1 << "," << i / batches_per_epoch + 1 << "," << h[i][0] << "," << h[i][1] << "," << h[i][2] << "\n";
    }
    if (!f) throw Error(tmp + ": cannot write");
  }
  fs::rename(tmp, csv);
  std::vector<PlotSeries> series{{"D loss (real)", {}, {31, 119, 180}},
                                 {"D loss (fake)", {}, {255, 127, 14}},
                                 {"G loss", {}, {44, 160, 44}}};
  for (int64_t i = 0; i < history.size(0); ++i)
    for (int k = 0; k < 3; ++k) series[k].values.push_back(history[i][k].item<double>());
  write_line_plot(series, "step", out + "/loss.png");
}

std::string sample_path(const std::string& out, const char* kind, int64_t number) {
  char name[48];
  std::snprintf(name, sizeof name, "samples/%s_%06lld.png", kind, static_cast<long long>(number));
  return out + "/" + name;
}

void write_samples(models::GeneratorImpl& generator, const torch::Tensor& noise, const std::string& path) {
  torch::NoGradGuard no_grad;
  generator.eval();
  auto images = generator.forward(noise);
  generator.train();
  write_image_grid(images, path);
}

// Resolves the names TorchScript source written here may use: `torch` (aten builtins) and `ops`, whose
// attributes are operator namespaces (ops.hierpar.conv_transpose2d), as in TorchScript's own serialised code.
struct OpsNamespaces : torch::jit::SugaredValue {
  std::string kind() const override { return "operator namespaces"; }
  std::shared_ptr<torch::jit::SugaredValue> attr(const torch::jit::SourceRange&, torch::jit::GraphFunction&,
                                                 const std::string& field) override {
    return std::make_shared<torch::jit::BuiltinModule>(field);
  }
};

struct ExportResolver : torch::jit::Resolver {
  std::shared_ptr<torch::jit::SugaredValue> resolveValue(const std::string& name, torch::jit::GraphFunction&,
                                                         const torch::jit::SourceRange&) override {
    if (name == "torch") return std::make_shared<torch::jit::BuiltinModule>("aten");
    if (name == "ops") return std::make_shared<OpsNamespaces>();
    return nullptr;
  }
  c10::TypePtr resolveType(const std::string&, const torch::jit::SourceRange&) override { return nullptr; }
};

}  // namespace

torch::Device parse_device(const std::string& name) {
  if (name.empty()) return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  if (name == "cpu") return torch::kCPU;
  if (name == "cuda" || name.rfind("cuda:", 0) == 0) {
    int64_t index = 0;
    if (name.size() > 5) {
      const std::string digits = name.substr(5);
      if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 3)
        throw FlagError("--device: expected cpu, cuda or cuda:N, got '" + name + "'");
      index = std::stoll(digits);
    }
    const int64_t count = torch::cuda::device_count();
    if (index >= count)
      throw FlagError("--device " + name + ": this machine has " + std::to_string(count) + " CUDA device(s)");
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  throw FlagError("--device: expected cpu, cuda or cuda:N, got '" + name + "'");
}

LayerSet parse_layers(const std::string& name) {
  if (name != "stock" && name != "hierpar") throw FlagError("--layers: expected stock or hierpar, got '" + name + "'");
  return hierpar::parse_layer_set(name);
}

Config checkpoint_config(const DCGANTrainConfig& config) {
  const auto& m = config.model;
  return {{"nz", std::to_string(m.nz)},
          {"image_size", std::to_string(m.image_size)},
          {"channels", std::to_string(m.channels)},
          {"width", format_double(m.width)},
          {"data", config.data},
          {"limit", std::to_string(config.limit)},
          {"batch_size", std::to_string(config.batch_size)},
          {"lr", format_double(config.lr)},
          {"beta1", format_double(config.beta1)},
          {"seed", std::to_string(config.seed)}};
}

hierpar::strategy::Placement dcgan_placement(const DCGANTrainConfig& config) {
  namespace hs = hierpar::strategy;
  if (config.strategy != "single" && config.strategy != "task" && config.strategy != "data" &&
      config.strategy != "hierarchical")
    throw FlagError("--strategy: expected single, task, data or hierarchical, got '" + config.strategy + "'");
  if (config.reduce != "host" && config.reduce != "nccl")
    throw FlagError("--reduce: expected host or nccl, got '" + config.reduce + "'");
  const hs::Scheme scheme = hs::parse_scheme(config.strategy);
  const hs::Reduce reduce = hs::parse_reduce(config.reduce);
  const hs::Launch launch = hs::Launch::from_env();
  const torch::Device device = parse_device(config.device);
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
  if (config.precision != "fp32" && config.precision != "tf32" && config.precision != "bf16")
    throw FlagError("--precision: expected fp32, tf32 or bf16, got '" + config.precision + "'");
  if (config.optimizer != "auto" && config.optimizer != "adam" && config.optimizer != "fused")
    throw FlagError("--optimizer: expected adam or fused, got '" + config.optimizer + "'");
  if (config.log_every < 1) throw FlagError("--log-every: expected an integer >= 1, got " + std::to_string(config.log_every));
  if (config.graphs == "on" && !cuda) throw FlagError("--graphs on needs a CUDA device (this run is on the CPU)");
  if (config.precision == "bf16" && !cuda) throw FlagError("--precision bf16 needs a CUDA device (this run is on the CPU)");
  s.graphs = config.graphs == "on" || (config.graphs == "auto" && cuda);
  if (s.graphs && config.optimizer == "adam")
    throw FlagError("--optimizer adam cannot be captured in a CUDA graph: use --optimizer fused or --graphs off");
  s.fused_adam = config.optimizer == "fused" || (config.optimizer == "auto" && cuda);
  s.tf32 = cuda && config.precision != "fp32";  // TF32 is a CUDA matmul mode; the CPU computes fp32
  if (config.precision == "bf16") s.autocast_dtype = c10::kBFloat16;
  s.channels_last = config.channels_last || config.precision == "bf16";
  s.overlap = config.overlap == "on" && cuda;
  return s;
}

std::string StepSettings::describe() const {
  std::string d = std::string("CUDA graphs ") + (graphs ? "on" : "off") + ", " + (fused_adam ? "FusedAdam" : "torch::optim::Adam");
  d += autocast_dtype ? ", bf16 autocast" : (tf32 ? ", fp32 with TF32" : ", fp32");
  if (channels_last) d += ", channels_last";
  if (overlap) d += ", two streams";
  return d;
}

namespace {

// losses.csv as written by write_losses: the D loss (real + fake) and G loss per step.
std::pair<std::vector<double>, std::vector<double>> read_losses_csv(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(path + ": cannot read the losses (expected a losses.csv written by hierpar-dcgan train)");
  std::string line;
  std::getline(in, line);
  if (line != "step,epoch,loss_d_real,loss_d_fake,loss_g")
    throw Error(path + ": not a hierpar-dcgan losses.csv (header '" + line + "')");
  std::vector<double> d, g;
  while (std::getline(in, line)) {
    double step, epoch, real, fake, gen;
    if (std::sscanf(line.c_str(), "%lf,%lf,%lf,%lf,%lf", &step, &epoch, &real, &fake, &gen) != 5)
      throw Error(path + ": line " + std::to_string(d.size() + 2) + " is not 5 numbers: '" + line + "'");
    d.push_back(real + fake);
    g.push_back(gen);
  }
  if (d.empty()) throw Error(path + ": no steps");
  return {d, g};
}

}  // namespace

std::vector<std::string> plot_loss_runs(const std::vector<std::pair<std::string, std::string>>& runs,
                                        const std::string& output) {
  if (runs.empty()) throw Error("plot: no runs to plot");
  const std::vector<std::array<uint8_t, 3>> colours{{31, 119, 180}, {255, 127, 14}, {44, 160, 44},
                                                    {214, 39, 40}, {148, 103, 189}, {140, 86, 75}};
  std::vector<PlotSeries> series;
  std::vector<std::string> summary;
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& [label, path] = runs[i];
    auto [d, g] = read_losses_csv(path);
    const auto dark = colours[i % colours.size()];
    const std::array<uint8_t, 3> light{static_cast<uint8_t>((dark[0] + 255) / 2), static_cast<uint8_t>((dark[1] + 255) / 2),
                                       static_cast<uint8_t>((dark[2] + 255) / 2)};
    const size_t from = d.size() - (d.size() + 3) / 4;
    auto mean_from = [&](const std::vector<double>& v) {
      double sum = 0;
      for (size_t k = from; k < v.size(); ++k) sum += v[k];
      return sum / static_cast<double>(v.size() - from);
    };
    std::ostringstream line;
    line << label << ": " << d.size() << " steps; mean over steps " << from + 1 << "-" << d.size() << ": D loss "
         << std::fixed << std::setprecision(4) << mean_from(d) << ", G loss " << mean_from(g);
    summary.push_back(line.str());
    series.push_back({label + " D loss", std::move(d), dark});
    series.push_back({label + " G loss", std::move(g), light});
  }
  write_line_plot(series, "step", output, 900, 480);
  return summary;
}

namespace {

// Adam's state tensors are read onto the CPU (checkpoints load there); each goes to its parameter's device.
void move_adam_state_to_parameters(torch::optim::Adam& optimizer) {
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      auto it = optimizer.state().find(p.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      auto& s = static_cast<torch::optim::AdamParamState&>(*it->second);
      s.exp_avg(s.exp_avg().to(p.device()));
      s.exp_avg_sq(s.exp_avg_sq().to(p.device()));
      if (s.max_exp_avg_sq().defined()) s.max_exp_avg_sq(s.max_exp_avg_sq().to(p.device()));
    }
  }
}

// --inject-fault KIND@STEP[:REPLICA] (a testing aid, DCGANTrainConfig::inject_fault).
struct InjectedFault {
  std::string kind;
  int64_t step = 0, replica = -1;
};

InjectedFault parse_fault(const std::string& text, int64_t replicas) {
  InjectedFault fault;
  if (text.empty()) return fault;
  const auto at = text.find('@'), colon = text.find(':');
  auto number = [&](const std::string& digits) {
    if (digits.empty() || digits.size() > 12 || digits.find_first_not_of("0123456789") != std::string::npos)
      throw FlagError("--inject-fault: expected KIND@STEP[:REPLICA], got '" + text + "'");
    return std::stoll(digits);
  };
  fault.kind = text.substr(0, at);
  if (at == std::string::npos ||
      (fault.kind != "throw" && fault.kind != "hang" && fault.kind != "kill" && fault.kind != "sigint" &&
       fault.kind != "sigterm"))
    throw FlagError("--inject-fault: expected KIND@STEP[:REPLICA] with KIND throw, hang, kill, sigint or sigterm, got '" +
                    text + "'");
  fault.step = number(text.substr(at + 1, colon == std::string::npos ? std::string::npos : colon - at - 1));
  fault.replica = colon == std::string::npos ? replicas - 1 : number(text.substr(colon + 1));
  if (fault.step < 1) throw FlagError("--inject-fault: STEP counts from 1, got '" + text + "'");
  if (fault.replica >= replicas)
    throw FlagError("--inject-fault: replica " + std::to_string(fault.replica) + " does not exist (" +
                    std::to_string(replicas) + " replica(s) in all)");
  return fault;
}

// The trainer's fault hook for `fault`, its steps counted from global step `first_step` + 1.
std::function<void(int64_t, int64_t)> fault_hook(const InjectedFault& fault, int64_t first_step) {
  if (fault.kind.empty()) return {};
  return [fault, first_step](int64_t replica, int64_t step) {
    if (replica != fault.replica || first_step + step + 1 != fault.step) return;
    // When the fault came, for scripts/fault-check's timings.
    std::cerr << "hierpar-dcgan: --inject-fault " << fault.kind << " in replica " << replica << " at the start of step "
              << fault.step << std::endl;
    if (fault.kind == "throw") {
      TORCH_CHECK(false, "injected fault (--inject-fault throw@", fault.step, "): replica ", replica,
                  "'s batch is unusable");
    } else if (fault.kind == "hang") {
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    } else if (fault.kind == "kill") {
      ::raise(SIGKILL);
    } else {
      ::kill(::getpid(), fault.kind == "sigint" ? SIGINT : SIGTERM);  // as a signal from outside would come
    }
  };
}

// torchrun shows a failed worker's TORCHELASTIC_ERROR_FILE in its summary (instead of "exitcode 1").
void write_launcher_error(const std::string& line) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (path == nullptr || *path == '\0') return;
  std::string escaped;
  for (const char c : line) {
    if (c == '"' || c == '\\') {
      escaped += '\\';
      escaped += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      escaped += ' ';
    } else {
      escaped += c;
    }
  }
  std::ofstream(path) << "{\"message\": \"" << escaped << "\", \"timestamp\": "
                      << std::chrono::duration_cast<std::chrono::seconds>(
                             std::chrono::system_clock::now().time_since_epoch()).count()
                      << "}\n";
}

}  // namespace

int train_dcgan(DCGANTrainConfig config) {
  namespace hs = hierpar::strategy;
  if (config.batch_size < 1) throw FlagError("--batch-size: expected an integer >= 1, got " + std::to_string(config.batch_size));
  if (config.keep_checkpoints < 1)
    throw FlagError("--keep-checkpoints: expected an integer >= 1, got " + std::to_string(config.keep_checkpoints));
  if (!(config.timeout > 0)) throw FlagError("--timeout: expected a number of seconds > 0, got " + format_double(config.timeout));
  if (config.model.channels == 0) config.model.channels = config.data == "fashion-mnist" ? 1 : 3;
  config.model.validate();
  const hs::Placement placement = dcgan_placement(config);
  const StepSettings step = step_settings(config, placement.replicas[0].discriminator.type());
  const InjectedFault fault = parse_fault(config.inject_fault, placement.global_replicas());
  const int64_t rank = placement.launch.rank, world = placement.launch.world_size;
  const bool writer = rank == 0;  // only rank 0 prints and writes files
  if (config.batch_size % placement.global_replicas() != 0)
    throw FlagError("--batch-size " + std::to_string(config.batch_size) + " does not split evenly over the " +
                std::to_string(placement.global_replicas()) + " replicas of " + placement.to_string());
  // This process's replica 0: its D device receives the batches, its G device draws the noise.
  const torch::Device data_device = placement.replicas[0].discriminator;
  const torch::Device noise_device = placement.replicas[0].generator;
  auto say = [&](const std::string& line) {
    if (!config.quiet && writer) std::cerr << line << "\n";
  };

  const std::string checkpoint = config.out + "/checkpoint.pt";
  CheckpointState state;
  state.config = checkpoint_config(config);
  state.history = torch::empty({0, 3});
  // Checked before the (slow) data loading and training, so that a wrong flag or folder costs no work.
  if (writer) require_writable_folder("--out", config.out);
  const bool resume = config.resume || (config.resume_auto && fs::exists(checkpoint));
  if (resume) {
    if (!fs::exists(checkpoint)) throw Error("--resume: no checkpoint at " + checkpoint);
    const auto found = read_checkpoint_state(checkpoint);
    require_config(checkpoint, found.config, state.config);
    if (found.epoch >= config.epochs || (config.max_steps > 0 && found.global_step >= config.max_steps)) {
      say("nothing to train: " + checkpoint + " has done " + std::to_string(found.global_step) + " steps (" +
          std::to_string(found.epoch) + " of --epochs " + std::to_string(config.epochs) + " epochs" +
          (config.max_steps > 0 ? ", --max-steps " + std::to_string(config.max_steps) : std::string()) +
          "); pass a larger --epochs or --max-steps to train on, or another --out for a new run");
      return 0;
    }
  } else if (fs::exists(checkpoint)) {
    throw Error(checkpoint + " exists: pass --resume to continue that run (--resume auto: continue one if it is "
                "there, as restarts under torchrun --max-restarts need), or choose another --out");
  }

  // Every rank stops together: on a failure, death or hang anywhere, and on an interrupt after one agreed step.
  hs::RunGuardOptions guard_options;
  guard_options.timeout = std::chrono::milliseconds(static_cast<int64_t>(config.timeout * 1000));
  hs::RunGuard guard(placement.launch, guard_options);
  std::unique_ptr<hs::AdversarialTrainer> trainer;
  try {
    const Dataset data = load_training_data(config);
    const auto images = prepare_images(data.images, config.model.image_size, config.model.channels);
    say("data: " + data.description + " -> " + std::to_string(images.size(0)) + " images " +
        std::to_string(config.model.channels) + "x" + std::to_string(config.model.image_size) + "x" +
        std::to_string(config.model.image_size));

    torch::manual_seed(static_cast<uint64_t>(config.seed));
    if (data_device.is_cuda()) {
      torch::cuda::manual_seed_all(static_cast<uint64_t>(config.seed));
      at::globalContext().setBenchmarkCuDNN(config.cudnn_benchmark);
      at::globalContext().setDeterministicCuDNN(!config.cudnn_benchmark);
      at::globalContext().setAllowTF32CuDNN(step.tf32);
      at::globalContext().setAllowTF32CuBLAS(step.tf32);
    }
    // Built on the CPU; the trainer moves them to replica 0's devices and clones the other local replicas.
    models::Generator generator(config.model);
    models::Discriminator discriminator(config.model);

    // Every rank draws the same global batches (same seed) and keeps its own rows of each.
    BatchLoader loader(images, data_device, config.batch_size, parse_placement(config.placement),
                       static_cast<uint64_t>(config.seed));
    const int64_t share = config.batch_size / world;
    auto fixed_noise = torch::randn({config.samples, config.model.nz},
                                    at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(config.seed) + 1))
                           .to(noise_device);

    // Replica 0's state, read on the CPU before the trainer copies it to every replica (here and, by its
    // broadcast, in the other processes); the optimisers' state and the RNG states are loaded below, once
    // the trainer exists: cloning replicas re-runs the modules' initialisation, which draws random numbers.
    if (resume) {
      auto loaded = load_checkpoint(checkpoint, state.config,
                                    {{"generator", generator.get()}, {"discriminator", discriminator.get()}}, {},
                                    noise_device, /*restore_rng=*/false);
      state.epoch = loaded.epoch;
      state.epoch_step = loaded.epoch_step;
      state.global_step = loaded.global_step;
      if (loaded.history.size(0) != loaded.global_step || (loaded.history.numel() > 0 && loaded.history.size(1) != 3))
        throw Error(checkpoint + ": entry history has " + std::to_string(loaded.history.size(0)) + " rows of " +
                    std::to_string(loaded.history.size(1)) + " losses, expected " +
                    std::to_string(loaded.global_step) + " rows (one per step) of 3");
      state.history = loaded.history.numel() > 0 ? loaded.history : state.history;
    }

    hs::AdversarialOptions options;
    options.generator_adam.lr = options.discriminator_adam.lr = config.lr;
    options.generator_adam.beta1 = options.discriminator_adam.beta1 = config.beta1;
    options.noise_shape = {config.model.nz};
    options.fused_adam = step.fused_adam;
    options.cuda_graphs = step.graphs;
    options.overlap_passes = step.overlap;
    options.autocast_dtype = step.autocast_dtype;
    options.channels_last = step.channels_last;
    options.loss_log_steps = config.log_every;
    options.sync_batch_norm = config.sync_batch_norm;
    // The guard names a hung rank after --timeout; the collectives wait longer, so that it acts first.
    options.averaging.timeout = guard_options.timeout + (placement.launch.multi_process() ? guard_options.heartbeat_timeout
                                                                                          : std::chrono::milliseconds(0));
    options.averaging.store = guard.store();
    options.report_failures = false;  // said once, by the line this function throws
    if (!resume) options.fault_hook = fault_hook(fault, state.global_step);  // a resumed run (a restart) recovers
    trainer = std::make_unique<hs::AdversarialTrainer>(torch::nn::AnyModule(generator),
                                                       torch::nn::AnyModule(discriminator), placement, options);
    guard.watch([t = trainer.get()](const std::string& why) { t->abort(why); },
                [t = trainer.get()] { return t->progress(); });
    if (resume) {
      for (int64_t i = 0; i < placement.local_replicas(); ++i) {
        load_checkpoint(checkpoint, state.config, {},
                        {{"generator", &trainer->generator_optimizer(i)},
                         {"discriminator", &trainer->discriminator_optimizer(i)}},
                        noise_device, /*restore_rng=*/i == 0);
        move_adam_state_to_parameters(trainer->generator_optimizer(i));
        move_adam_state_to_parameters(trainer->discriminator_optimizer(i));
      }
      // Every G device draws the global batch's noise from its own generator (AdversarialTrainer): all take
      // the restored state of replica 0's.
      at::Generator restored = at::globalContext().defaultGenerator(noise_device);
      for (const auto& r : placement.replicas) {
        at::Generator target = at::globalContext().defaultGenerator(r.generator);  // a handle to the device's
        if (r.generator != noise_device) target.set_state(restored.get_state());
      }
      say("resumed from " + checkpoint + " at epoch " + std::to_string(state.epoch + 1) + ", step " +
          std::to_string(state.global_step));
    }
    // What a checkpoint saves: replica 0 (every replica holds the same networks after each step).
    const NamedModules modules{{"generator", generator.get()}, {"discriminator", discriminator.get()}};
    const NamedOptimizers optimizers{{"generator", &trainer->generator_optimizer(0)},
                                     {"discriminator", &trainer->discriminator_optimizer(0)}};

    say("model: DCGAN " + config.model.shape_key() + ", layers " + to_string(config.model.layers) + "; generator " +
        std::to_string(count_parameters(*generator)) + " parameters, discriminator " +
        std::to_string(count_parameters(*discriminator)) + "; data " +
        (loader.resident() ? "resident on " + data_device.str() : "streamed through host memory"));
    const bool gloo_for_nccl = data_device.is_cpu() && placement.reduce == hs::Reduce::collective;
    say("strategy: " + placement.to_string() + (gloo_for_nccl ? " (Gloo's collectives on the CPU)" : "") +
        "; global batch " + std::to_string(config.batch_size) + " = " + std::to_string(placement.global_replicas()) +
        " replica(s) x " + std::to_string(config.batch_size / placement.global_replicas()));
    say("step: " + (trainer->graph_fallback().empty() ? step.describe() : trainer->graph_fallback()) +
        "; losses read every " + std::to_string(config.log_every) + " steps");
    say("output: " + config.out + " (samples/, losses.csv, loss.png, checkpoint.pt)");

    int64_t unread = 0;  // steps whose losses are still on the device
    auto flush_losses = [&] {
      if (unread == 0) return;
      state.history = torch::cat({state.history, trainer->take_losses()});
      unread = 0;
    };
    auto save = [&] {
      flush_losses();
      if (!writer) return;
      save_checkpoint(checkpoint, state, modules, optimizers, noise_device,  // the noise's RNG state
                      config.keep_checkpoints);
      write_losses(config.out, state.history, loader.batches_per_epoch());
    };
    bool stopped = false, interrupted = false;
    const int64_t steps_per_epoch = loader.batches_per_epoch();
    while (state.epoch < config.epochs && !stopped) {
      loader.start_epoch(state.epoch, state.epoch_step);
      std::unique_ptr<Progress> progress;
      if (!config.quiet && writer)
        progress = std::make_unique<Progress>("epoch " + std::to_string(state.epoch + 1) + "/" + std::to_string(config.epochs),
                                              steps_per_epoch, config.batch_size, 10.0, state.epoch_step);
      const auto epoch_start = std::chrono::steady_clock::now();
      const int64_t first_step = state.epoch_step;
      for (auto batch = loader.next(); batch.defined(); batch = loader.next()) {
        // Every rank draws the same global batch and keeps its rows; the trainer does the same with the noise
        // (the same seed everywhere), inside the step.
        guard.begin_step(state.global_step + 1);
        trainer->step(batch.narrow(0, rank * share, share));
        ++unread;
        ++state.epoch_step;
        ++state.global_step;
        const bool budget_spent = config.max_steps > 0 && state.global_step >= config.max_steps;
        if (config.should_stop && config.should_stop()) guard.request_stop("an interrupt");
        interrupted = guard.end_step(state.global_step);  // the same answer on every rank
        if (interrupted) say("stopping after step " + std::to_string(state.global_step) + ": " + guard.stop_reason());
        stopped = budget_spent || interrupted;
        if (unread >= config.log_every || stopped || state.epoch_step == steps_per_epoch) {
          flush_losses();
          if (progress) {
            auto last = state.history[-1];
            progress->update(state.epoch_step, {{"loss_d_real", last[0].item<double>()},
                                                {"loss_d_fake", last[1].item<double>()},
                                                {"loss_g", last[2].item<double>()}});
          }
        }
        if (stopped) break;
        if (config.checkpoint_every > 0 && state.global_step % config.checkpoint_every == 0 &&
            state.epoch_step < steps_per_epoch)
          save();
      }
      if (progress) progress->finish();
      for (const auto& r : placement.replicas) {
        for (const torch::Device& d : {r.generator, r.discriminator})
          if (d.is_cuda()) torch::cuda::synchronize(d.index());
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_start).count();
      const int64_t steps_done = state.epoch_step - first_step;
      std::string grid;
      if (state.epoch_step == steps_per_epoch) {
        grid = sample_path(config.out, "epoch", state.epoch + 1);
        ++state.epoch;
        state.epoch_step = 0;
      } else {
        grid = sample_path(config.out, "step", state.global_step);
      }
      if (writer) write_samples(*generator, fixed_noise, grid);
      save();
      std::ostringstream line;
      line << std::fixed << std::setprecision(2) << (state.epoch_step == 0 ? "epoch " : "stopped in epoch ")
           << (state.epoch_step == 0 ? state.epoch : state.epoch + 1) << ": " << steps_done << " steps in " << seconds
           << " s (" << (seconds > 0 ? steps_done / seconds : 0.0) << " steps/s"
           << (state.epoch_step == 0 && first_step == 0 ? ", " + format_double(seconds) + " s per epoch" : "")
           << "); samples " << grid;
      say(line.str());
    }
    // After rank 0's checkpoint: with an interrupt, the other ranks wait for it before they exit.
    guard.finish(interrupted);
    say("done: " + std::to_string(state.global_step) + " steps; loss curve " + config.out + "/loss.png, losses " +
        config.out + "/losses.csv, checkpoint " + checkpoint);
    if (!interrupted) return 0;
    write_launcher_error("interrupted (" + guard.stop_reason() + "): every rank stopped after step " +
                         std::to_string(state.global_step) + ", and rank 0 saved " + checkpoint);
    return 130;
  } catch (const std::exception& e) {
    const std::string line = guard.fail(e);
    // Its process groups may wait on dead peers (ProcessGroupNCCL's destructor joins its watchdog, Gloo's its
    // threads): the trainer is left to the process's end, which the caller makes immediate.
    (void)trainer.release();
    write_launcher_error(line);
    if (dynamic_cast<const Error*>(&e) != nullptr && !placement.launch.multi_process()) throw;
    throw Error(line);
  }
}

models::Generator load_generator(const std::string& checkpoint, LayerSet layers, torch::Device device) {
  const auto state = read_checkpoint_state(checkpoint);
  auto field = [&](const char* key) {
    auto it = state.config.find(key);
    if (it == state.config.end()) throw Error(checkpoint + ": the configuration has no " + key);
    return it->second;
  };
  models::DCGANOptions options;
  options.nz = std::stoll(field("nz"));
  options.image_size = std::stoll(field("image_size"));
  options.channels = std::stoll(field("channels"));
  options.width = std::stod(field("width"));
  options.layers = layers;
  models::Generator generator(options);
  load_checkpoint(checkpoint, {}, {{"generator", generator.get()}}, {}, device, /*restore_rng=*/false);
  generator->to(device);
  generator->eval();
  return generator;
}

torch::jit::Module export_generator(models::GeneratorImpl& generator, ExportOps ops) {
  auto cu = std::make_shared<torch::jit::CompilationUnit>();
  torch::jit::Module module(c10::QualifiedName("__torch__.hierpar.DCGANGenerator"), cu);
  const double eps = torch::nn::BatchNorm2dOptions(1).eps();
  std::ostringstream src;
  src << "def forward(self, z):\n"
      << "    x = z.reshape([z.size(0), " << generator.options.nz << ", 1, 1])\n";
  const auto children = generator.named_children();
  for (const auto& child : children) {
    const std::string& name = child.key();
    const bool hierpar = ops == ExportOps::hierpar ||
                         (ops == ExportOps::as_built && child.value()->name().rfind("hierpar::", 0) == 0);
    torch::jit::Module sub(c10::QualifiedName("__torch__.hierpar.DCGANGenerator_" + name), cu);
    for (const auto& p : child.value()->named_parameters(false)) sub.register_parameter(p.key(), p.value().detach(), false);
    for (const auto& b : child.value()->named_buffers(false)) sub.register_buffer(b.key(), b.value().detach());
    module.register_module(name, sub);
    const std::string self = "self." + name;
    if (name.rfind("deconv", 0) == 0) {
      const bool first = name == "deconv1";
      const std::string geometry = first ? "[1, 1], [0, 0]" : "[2, 2], [1, 1]";
      if (hierpar) {
        src << "    x = ops.hierpar.conv_transpose2d(x, " << self << ".weight, None, " << geometry
            << ", [0, 0], 1, [1, 1])\n";
      } else {
        src << "    x = torch.conv_transpose2d(x, " << self << ".weight, None, " << geometry << ")\n";
      }
    } else {
      const std::string args = self + ".weight, " + self + ".bias, " + self + ".running_mean, " + self +
                               ".running_var, False, 0.1, " + format_double(eps);
      if (hierpar) {
        src << "    x = ops.hierpar.batch_norm_act(x, " << args << ", \"relu\", 0.0)[0]\n";
      } else {
        src << "    x = torch.relu(torch.batch_norm(x, " << args << ", False))\n";
      }
    }
  }
  src << "    return torch.tanh(x)\n";
  module.define(src.str(), std::make_shared<ExportResolver>());
  module.eval();
  return module;
}

}  // namespace hierpar::examples
