// hierpar-dcgan train: the training loop with checkpoints, resume, samples and losses, and its fault handling
// (declared in dcgan_app.h).
#include "common/cli.h"
#include "common/data.h"
#include "common/dcgan_app.h"
#include "common/images.h"
#include "common/loss_log.h"
#include "common/memory_snapshot.h"
#include "common/quality.h"
#include "common/shared_flags.h"
#include "hierpar/nn.h"
#include "hierpar/nn/recompute.h"
#include "hierpar/strategy/adversarial_trainer.h"
#include "hierpar/strategy/run_guard.h"

#include <ATen/CPUGeneratorImpl.h>
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
#include <functional>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include <signal.h>
#include <unistd.h>

namespace hierpar::examples {
namespace fs = std::filesystem;

namespace {

int64_t count_parameters(torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
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

// A generator whose parameters are `average` (the trainer's moving average of `live`'s: the same tensors, so it
// follows every step) and whose buffers start as copies of `live`'s. Built without moving the CPU generator, so the
// run draws the same noise and data order as without it.
models::Generator ema_generator(const models::DCGANOptions& options, models::GeneratorImpl& live,
                                const std::vector<torch::Tensor>& average) {
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  at::Tensor cpu_state;
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu_state = cpu.get_state();
  }
  models::Generator ema(options);
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_state(cpu_state);
  }
  auto parameters = ema->parameters();
  const auto live_buffers = live.buffers();
  auto buffers = ema->buffers();
  TORCH_INTERNAL_ASSERT(parameters.size() == average.size() && buffers.size() == live_buffers.size());
  for (size_t i = 0; i < parameters.size(); ++i) parameters[i].set_data(average[i]);
  for (size_t i = 0; i < buffers.size(); ++i) buffers[i].set_data(live_buffers[i].detach().clone());
  return ema;
}

// BatchNorm running statistics for the moving average's own weights (BigGAN's "standing statistics"): the live
// generator's statistics belong to other weights, and an averaged generator sampled with them scores worse than
// the live one. Each BatchNorm is reset and set to a cumulative average, then the average generator runs
// kStatisticsBatches batches of noise in training mode. The noise comes from a private generator with a fixed
// seed, so the run's random stream is untouched and a resumed run computes the same statistics.
void recompute_batch_norm_statistics(models::GeneratorImpl& ema, int64_t nz) {
  constexpr int64_t kStatisticsBatches = 32, kBatch = 256;
  torch::NoGradGuard no_grad;
  std::vector<std::function<void()>> restore;
  for (const auto& module : ema.modules(/*include_self=*/false)) {
    auto reset = [&](auto* bn) {
      if (bn == nullptr || !bn->options.track_running_stats()) return;
      const auto momentum = bn->options.momentum();
      bn->options.momentum(std::nullopt);
      bn->reset_running_stats();
      restore.push_back([bn, momentum] { bn->options.momentum(momentum); });
    };
    reset(module->as<torch::nn::BatchNorm2d>());
    reset(module->as<hierpar::nn::BatchNormAct2d>());
    reset(module->as<hierpar::nn::BatchNorm2d>());
  }
  if (restore.empty()) return;
  const torch::Device device = ema.parameters().front().device();
  at::Generator noise = at::make_generator<at::CPUGeneratorImpl>(20240601);
  const bool was_training = ema.is_training();
  ema.train();
  for (int64_t i = 0; i < kStatisticsBatches; ++i) {
    ema.forward(at::randn({kBatch, nz, 1, 1}, noise, at::TensorOptions()).to(device));
  }
  ema.train(was_training);
  for (const auto& undo : restore) undo();
}

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

// The folders of `folder` that do not exist yet (it and its missing parents, innermost first); when the run ends
// with them still empty (it failed before writing anything), they are removed: a folder that existed stays.
class NewFolders {
 public:
  explicit NewFolders(const std::string& folder) {
    if (folder.empty()) return;
    std::error_code ec;
    for (fs::path p = fs::absolute(folder, ec); !ec && !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
      created_.push_back(p);
      if (p == p.parent_path()) break;
    }
  }
  NewFolders(const NewFolders&) = delete;
  NewFolders& operator=(const NewFolders&) = delete;
  ~NewFolders() {
    // rmdir removes only empty folders (and std::filesystem::remove_all may be libtorch's broken copy).
    for (const fs::path& p : created_)
      if (::rmdir(p.c_str()) != 0) break;
  }

 private:
  std::vector<fs::path> created_;
};

}  // namespace

int train_dcgan(DCGANTrainConfig config) {
  namespace hs = hierpar::strategy;
  if (config.batch_size < 1) throw FlagError("--batch-size: expected an integer >= 1, got " + std::to_string(config.batch_size));
  if (config.keep_checkpoints < 1)
    throw FlagError("--keep-checkpoints: expected an integer >= 1, got " + std::to_string(config.keep_checkpoints));
  if (!(config.timeout > 0)) throw FlagError("--timeout: expected a number of seconds > 0, got " + format_number(config.timeout));
  resolve_model(config);
  const hs::Placement placement = dcgan_placement(config);
  const StepSettings step = step_settings(config, placement.replicas[0].discriminator.type());
  const InjectedFault fault = parse_fault(config.inject_fault, placement.global_replicas());
  const bool writer = placement.launch.rank == 0;  // only rank 0 prints and writes files
  // A split placement's process runs one network of its replica (rank 0: G).
  const bool runs_g = placement.replicas[0].part != hs::ReplicaPart::discriminator;
  const bool runs_d = placement.replicas[0].part != hs::ReplicaPart::generator;
  if (config.batch_size % placement.global_replicas() != 0)
    throw FlagError("--batch-size " + std::to_string(config.batch_size) + " does not split evenly over the " +
                std::to_string(placement.global_replicas()) + " replicas of " + placement.to_string());
  // This process's replica 0: its D device receives the batches, its G device draws the noise.
  const torch::Device data_device = placement.replicas[0].discriminator;
  const torch::Device noise_device = placement.replicas[0].generator;
  auto say = [&](const std::string& line) {
    if (!config.quiet && writer) std::cerr << line << "\n";
  };

  if (config.eval_every < 0)
    throw FlagError("--eval-every: expected an integer >= 0, got " + std::to_string(config.eval_every));
  if (config.eval_every > 0 && (config.data != "fashion-mnist" || config.model.channels != 1))
    throw FlagError("--eval-every: the quality metric is for --data fashion-mnist (one channel), got --data " +
                    config.data);
  if (config.ema < 0 || config.ema >= 1)
    throw FlagError("--ema: expected a decay in [0, 1) (0: none), e.g. 0.999, got " + format_number(config.ema));
  if (config.eval_samples < 2)
    throw FlagError("--eval-samples: expected an integer >= 2, got " + std::to_string(config.eval_samples));

  const std::string checkpoint = config.out + "/checkpoint.pt";
  CheckpointState state;
  state.config = checkpoint_config(config);
  state.history = torch::empty({0, 3});
  // Checked before the (slow) data loading and training, so that a wrong flag or folder costs no work.
  const NewFolders new_folders(writer ? config.out : std::string());
  if (writer) require_writable_folder("--out", config.out);
  const bool resume = config.resume || (config.resume_auto && fs::exists(checkpoint));
  if (resume) {
    if (!fs::exists(checkpoint)) throw Error("--resume: no checkpoint at " + checkpoint);
    const auto found = read_checkpoint_state(checkpoint);
    require_config(checkpoint, found.config, state.config);
    if (found.config.count("ema") > 0 && config.ema == 0)
      throw Error(checkpoint + " keeps a moving average of G's weights: pass --ema " + found.config.at("ema") +
                  " to resume it");
    if (found.config.count("loss") > 0 && config.loss == "bce")
      throw Error(checkpoint + " was trained with --loss " + found.config.at("loss") + ": pass it to resume it");
    if (found.config.count("r1") > 0 && config.r1 == 0)
      throw Error(checkpoint + " was trained with the R1 penalty: pass --r1 " + found.config.at("r1") + " --r1-every " +
                  found.config.at("r1_every") + " to resume it");
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
  guard_options.startup_steps = trainer_options(config, step).startup_steps();
  hs::RunGuard guard(placement.launch, guard_options);
  // Why the run stopped early; one process has no ranks to name (RunGuard says "SIGINT on rank 0").
  auto stop_reason = [&] {
    std::string reason = guard.stop_reason();
    const std::string rank_0 = " on rank 0";
    if (!placement.launch.multi_process() && reason.size() > rank_0.size() &&
        reason.compare(reason.size() - rank_0.size(), rank_0.size(), rank_0) == 0)
      reason.resize(reason.size() - rank_0.size());
    return reason;
  };
  // --memory-snapshot: rank 0 records its devices' allocations from here (the data, the networks, the first steps).
  MemorySnapshot snapshot(writer ? config.memory_snapshot : std::string(), data_device.is_cuda());
  std::unique_ptr<hs::AdversarialTrainer> trainer;
  try {
    // Every rank draws the same global batches (same seed) and keeps its own rows of each.
    TrainingData data = open_training_data(config, data_device);
    BatchLoader& loader = *data.loader;
    say("data: " + data.description);

    torch::manual_seed(static_cast<uint64_t>(config.seed));
    if (data_device.is_cuda()) {
      torch::cuda::manual_seed_all(static_cast<uint64_t>(config.seed));
      at::globalContext().setBenchmarkCuDNN(config.cudnn_benchmark);
      at::globalContext().setDeterministicCuDNN(!config.cudnn_benchmark);
    }
    const hs::PrecisionScope precision(step.precision);  // TF32 as --precision says for the rest of the run (samples)
    // Built on the CPU; the trainer moves them to replica 0's devices and clones the other local replicas.
    models::Generator generator(config.model);
    models::Discriminator discriminator(config.model);

    // This process's rows of each global batch: its replicas' shares (both processes of a split replica read its rows).
    const int64_t replica_share = config.batch_size / placement.global_replicas();
    const int64_t rows = replica_share * placement.local_replicas();
    const int64_t first_row = placement.replicas[0].replica * replica_share;
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

    hs::AdversarialOptions options = trainer_options(config, step);
    // The guard names a hung rank after --timeout; the collectives wait longer, so that it acts first.
    options.averaging.timeout = guard_options.timeout + (placement.launch.multi_process() ? guard_options.heartbeat_timeout
                                                                                          : std::chrono::milliseconds(0));
    options.averaging.store = guard.store();
    options.report_failures = false;  // said once, by the line this function throws
    // A resumed run (a restart) recovers; a split replica's fault is its D process's.
    if (!resume && runs_d) options.fault_hook = fault_hook(fault, state.global_step);
    trainer = std::make_unique<hs::AdversarialTrainer>(torch::nn::AnyModule(generator),
                                                       torch::nn::AnyModule(discriminator), placement, options);
    guard.watch([t = trainer.get()](const std::string& why) { t->abort(why); },
                [t = trainer.get()] { return t->progress(); });
    if (resume) {
      for (int64_t i = 0; i < placement.local_replicas(); ++i) {
        NamedOptimizers run;  // a split placement's process has one network's
        if (runs_g) run.emplace_back("generator", &trainer->generator_optimizer(i));
        if (runs_d) run.emplace_back("discriminator", &trainer->discriminator_optimizer(i));
        load_checkpoint(checkpoint, state.config, {}, run, noise_device, /*restore_rng=*/i == 0);
        for (auto& [name, optimizer] : run) move_adam_state_to_parameters(*dynamic_cast<torch::optim::Adam*>(optimizer));
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
    // --ema: a generator whose parameters are the trainer's moving average (the same tensors).
    std::optional<models::Generator> ema;
    if (config.ema > 0 && runs_g) {
      ema = ema_generator(config.model, *generator, trainer->generator_ema());
      if (resume) {
        load_checkpoint(checkpoint, state.config, {{"generator_ema", ema->get()}}, {}, noise_device,
                        /*restore_rng=*/false);
      }
    }
    // What a checkpoint saves: replica 0 (every replica holds the same networks after each step).
    NamedModules modules{{"generator", generator.get()}, {"discriminator", discriminator.get()}};
    if (ema) modules.emplace_back("generator_ema", ema->get());
    // G's processes of a split placement keep a copy of their replica's D and its optimiser, filled from D's process
    // before each checkpoint (the module given to the trainer, which left it here).
    std::unique_ptr<torch::optim::Adam> discriminator_copy_optimizer;
    if (placement.split() && runs_g) {
      discriminator_copy_optimizer = std::make_unique<torch::optim::Adam>(discriminator->parameters(),
                                                                          torch::optim::AdamOptions(config.lr));
    }
    NamedOptimizers optimizers;
    if (writer) {
      optimizers = {{"generator", &trainer->generator_optimizer(0)},
                    {"discriminator", placement.split() ? discriminator_copy_optimizer.get()
                                                        : &trainer->discriminator_optimizer(0)}};
    }

    say("model: DCGAN " + config.model.shape_key() + ", layers " + to_string(config.model.layers) +
        (config.model.memory == hierpar::nn::ActivationMemory::recompute ? ", activations recomputed in the backward"
         : config.model.memory == hierpar::nn::ActivationMemory::offload
             ? (config.model.offload_budget > 0
                    ? ", activations offloaded to host memory as far as " + format_number(config.model.offload_budget) +
                          " of the GPU's memory requires (planned from the third step)"
                    : ", every block's activations recomputed in the backward from inputs kept in host memory")
             : "") +
        (config.model.memory_slices > 1
             ? ", each block's backward in " + std::to_string(config.model.memory_slices) + " slices of the batch"
             : "") +
        "; generator " +
        std::to_string(count_parameters(*generator)) + " parameters, discriminator " +
        std::to_string(count_parameters(*discriminator)) + "; data " +
        (loader.resident() ? "resident on " + data_device.str()
                           : data.from_files ? "decoded from the files" : "streamed through host memory"));
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
      trainer->copy_discriminator_to_generator_process(discriminator.get(), discriminator_copy_optimizer.get());
      if (!writer) return;
      if (ema) recompute_batch_norm_statistics(**ema, config.model.nz);
      save_checkpoint(checkpoint, state, modules, optimizers, noise_device,  // the noise's RNG state
                      config.keep_checkpoints);
      write_losses(config.out, state.history, loader.batches_per_epoch());
    };
    // The quality metric's classifier (trained once and cached) and the test set's features, before the steps.
    std::optional<models::SeedCNN> classifier;
    torch::Tensor real_features;
    std::optional<QualityLog> quality_log;
    if (config.eval_every > 0 && writer) {
      std::ostringstream classifier_log;
      classifier = fashion_mnist_classifier(config.fashion_mnist_dir, default_classifier_cache(),
                                            config.quiet ? classifier_log : std::cerr);
      real_features = real_test_features(**classifier, config.fashion_mnist_dir, config.model.image_size);
      quality_log.emplace(config.out, state.global_step);
    }
    bool stopped = false, interrupted = false;
    int64_t steps_run = 0;  // by this process (a resumed run counts from its restart)
    std::set<std::string> said_plans;
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
        trainer->step(batch.narrow(0, first_row, rows));
        ++unread;
        ++state.epoch_step;
        ++state.global_step;
        if (const std::string written = snapshot.after_step(++steps_run); !written.empty()) say(written);
        const bool budget_spent = config.max_steps > 0 && state.global_step >= config.max_steps;
        if (config.should_stop && config.should_stop()) guard.request_stop("an interrupt");
        interrupted = guard.end_step(state.global_step);  // the same answer on every rank
        if (interrupted) say("stopping after step " + std::to_string(state.global_step) + ": " + stop_reason());
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
        if (quality_log && state.global_step % config.eval_every == 0) {
          synchronize_devices(placement);  // the step's replays may still run on other streams
          if (ema) recompute_batch_norm_statistics(**ema, config.model.nz);
          const auto quality = generator_quality(ema ? **ema : *generator, **classifier, real_features,
                                                 config.eval_samples, 1);
          quality_log->add(state.global_step, state.epoch + 1, quality);
          say("step " + std::to_string(state.global_step) + ": " + (ema ? "moving average: " : "") + quality.to_string());
        }
        if (stopped) break;
        if (config.checkpoint_every > 0 && state.global_step % config.checkpoint_every == 0 &&
            state.epoch_step < steps_per_epoch)
          save();
      }
      if (progress) progress->finish();
      synchronize_devices(placement);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_start).count();
      const int64_t steps_done = state.epoch_step - first_step;
      // --memory offload: what each GPU keeps, once its plan exists (from the third step); each plan said once.
      if (config.model.memory == hierpar::nn::ActivationMemory::offload) {
        for (const auto& r : placement.replicas) {
          for (const c10::Device& d : {r.generator, r.discriminator}) {
            const std::string plan = hierpar::nn::offload_plan_summary(d);
            if (plan.empty() || said_plans.count(plan) > 0) continue;
            said_plans.insert(plan);
            say(plan);
          }
        }
      }
      std::string grid, ema_grid;
      if (state.epoch_step == steps_per_epoch) {
        grid = sample_path(config.out, "epoch", state.epoch + 1);
        ema_grid = sample_path(config.out, "ema_epoch", state.epoch + 1);
        ++state.epoch;
        state.epoch_step = 0;
      } else {
        grid = sample_path(config.out, "step", state.global_step);
        ema_grid = sample_path(config.out, "ema_step", state.global_step);
      }
      if (writer) write_samples(*generator, fixed_noise, grid);
      if (writer && ema) {
        recompute_batch_norm_statistics(**ema, config.model.nz);
        write_samples(**ema, fixed_noise, ema_grid);
      }
      save();
      std::ostringstream line;
      line << std::fixed << std::setprecision(2) << (state.epoch_step == 0 ? "epoch " : "stopped in epoch ")
           << (state.epoch_step == 0 ? state.epoch : state.epoch + 1) << ": " << steps_done << " steps in " << seconds
           << " s (" << (seconds > 0 ? steps_done / seconds : 0.0) << " steps/s"
           << (state.epoch_step == 0 && first_step == 0 ? ", " + format_number(seconds) + " s per epoch" : "")
           << "); samples " << grid << (writer && ema ? " and " + ema_grid : "");
      say(line.str());
    }
    if (const std::string written = snapshot.finish(); !written.empty()) say(written);
    // After rank 0's checkpoint: with an interrupt, the other ranks wait for it before they exit.
    guard.finish(interrupted);
    say("done: " + std::to_string(state.global_step) + " steps; loss curve " + config.out + "/loss.png, losses " +
        config.out + "/losses.csv, checkpoint " + checkpoint);
    if (!interrupted) return 0;
    const bool multi = placement.launch.multi_process();
    const std::string reason = stop_reason();
    const std::string stopped_line = multi ? "every rank stopped after step " + std::to_string(state.global_step) +
                                                 ", and rank 0 saved the checkpoint " + checkpoint
                                           : "stopped after step " + std::to_string(state.global_step) +
                                                 "; saved checkpoint " + checkpoint;
    write_launcher_error("interrupted (" + reason + "): " + stopped_line);
    if (!config.quiet) std::cerr << "hierpar-dcgan: interrupted: " << stopped_line << " (--resume continues)\n";
    // 128 + the signal, as a shell reports one; multi-rank runs keep 130 for every rank (what their launchers and
    // tests expect whichever rank got the signal).
    return !multi && reason.rfind("SIGTERM", 0) == 0 ? 128 + SIGTERM : 130;
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

}  // namespace hierpar::examples
