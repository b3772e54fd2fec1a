// hierpar-dcgan: the seed paper's DCGAN, trained with stock torch::nn or hierpar layers (--layers).
//   hierpar-dcgan train    --data fashion-mnist|synthetic|<folder> [--layers stock|hierpar] [--epochs N] ...
//                          [--strategy single|task|data|hierarchical --gpus N --reduce host|nccl --sync-bn]
//                          [--graphs on|off --precision fp32|tf32|bf16 --channels-last --optimizer adam|fused]
//                          [--overlap on|off --memory none|recompute|offload --schedule exact|pipelined]
//   torchrun --no-python --nproc-per-node N hierpar-dcgan train ... (one process per replica or replicas)
//                          [--resume auto --timeout S --inject-fault KIND@STEP[:REPLICA]]
//   hierpar-dcgan generate --checkpoint runs/dcgan/checkpoint.pt --count 64 --output samples.png
//   hierpar-dcgan evaluate --checkpoint runs/dcgan/checkpoint.pt [--samples 10000]
//   hierpar-dcgan export   --checkpoint runs/dcgan/checkpoint.pt --output generator.pt
//   hierpar-dcgan plot     --output curves.png --runs graphs=runs/a/losses.csv,eager=runs/b/losses.csv [--metric fid]
//   hierpar-dcgan tune     --objective epoch-time|gpu-usage|max-memory [the train flags of data, model and step]
#include "common/batch_tuning.h"
#include "common/cli.h"
#include "common/dcgan_app.h"
#include "common/loss_log.h"
#include "common/memory_snapshot.h"
#include "common/quality.h"
#include "common/shared_flags.h"
#include "common/images.h"
#include "hierpar/strategy/run_guard.h"

#include <ATen/Parallel.h>
#include <c10/util/Logging.h>
#include <torch/cuda.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <signal.h>
#include <unistd.h>

namespace {

using namespace hierpar::examples;

constexpr const char* kUsage =
    "usage: hierpar-dcgan <command> [flags]\n"
    "  train     train a DCGAN; writes samples/, losses.csv, loss.png and checkpoint.pt under --out\n"
    "  generate  write samples of a trained generator as a PNG grid\n"
    "  evaluate  score a Fashion-MNIST generator: FID in the seed CNN's features and class coverage\n"
    "  export    save a trained generator as TorchScript (torch.jit.load after loading libhierpar_ops.so)\n"
    "  plot      plot the loss curves (losses.csv) or the FID (quality.csv, --metric fid) of several runs on one PNG\n"
    "  tune      measure batch sizes and choose one (seed 004): --objective epoch-time|gpu-usage|max-memory\n"
    "  data-speed  how many images per second the data loader alone serves (train's data flags)\n"
    "Run hierpar-dcgan <command> --help for its flags.\n";

// The flags that define the data, the model, the placement and the step: train and tune take them alike.
struct RunFlags {
  std::string layers = "hierpar", batch_size = "64", memory = "none";
  int64_t image_size = 64, channels = 0, nz = 100;
  double width = 1.0;
};

void add_run_flags(Flags& flags, DCGANTrainConfig& config, RunFlags& run) {
  flags.add("data", &config.data, "fashion-mnist, mnist, synthetic, or a folder of PNG/JPEG images (searched "
            "recursively; centre squares resized)")
      .add("fashion-mnist-dir", &config.fashion_mnist_dir, "where the Fashion-MNIST .gz files are")
      .add("mnist-dir", &config.mnist_dir, "where the MNIST .gz files are (torchvision's <root>/MNIST/raw; "
           "$HIERPAR_MNIST_DIR)")
      .add("limit", &config.limit, "use at most this many images (0: all)", 0)
      .add("layers", &run.layers, "stock (torch::nn) or hierpar")
      .add("device", &config.device, "cpu, cuda or cuda:N (default: cuda when available)")
      .add("strategy", &config.strategy, "single, task (G and D on 2 GPUs), data (a replica per GPU) or "
           "hierarchical (a G GPU and a D GPU per replica)")
      .add("gpus", &config.gpus, "devices in all, over every process (0: the strategy's own count)", 0)
      .add("reduce", &config.reduce, "gradient averaging across replicas: nccl (NCCL's all-reduce; Gloo's with --device "
           "cpu) or host (pinned memory summed by CPU threads, the seed's way); default: nccl on GPUs, host on the CPU")
      .add("sync-bn", &config.sync_batch_norm, "BatchNorm statistics over all replicas (default: per replica)")
      .add("batch-size", &run.batch_size, "images per step over all replicas (the global batch); train takes auto: "
           "tune's epoch-time search first (docs/batch_size.md); tune starts its search there")
      .add("image-size", &run.image_size, "32, 64 or 128", 1)
      .add("channels", &run.channels, "image channels, 1 or 3 (default: 1 for fashion-mnist, 3 otherwise)", 0)
      .add("width", &run.width, "channel multiplier (1: the seed's 256-128-64-32)", 0.0)
      .add("nz", &run.nz, "noise dimension", 1)
      .add("memory", &run.memory, "activation memory: none; recompute (each convolution block keeps only its input "
           "and runs its forward again in the backward: less memory, one more forward, the same numbers); or offload "
           "(as recompute, and those inputs wait in pinned host memory: least memory, limited by PCIe; eager steps, no "
           "penalties)")
      .add("offload-budget", &config.model.offload_budget, "with --memory offload: the fraction of the GPU's memory a "
           "step may use; from the third step on, blocks keep their activations (full speed) as far as the measured "
           "peak allows (0: offload every block)", -1.0)
      .add("memory-slices", &config.model.memory_slices, "with --memory recompute or offload: each block's backward "
           "in this many slices of the batch, BatchNorm exact (its inner activations for one slice at a time: larger "
           "batches fit; one more forward of each convolution)", 1)
      .add("lr", &config.lr, "Adam learning rate", 0.0)
      .add("beta1", &config.beta1, "Adam beta1", -1.0)
      .add("seed", &config.seed, "seed of weights, noise and data order", 0)
      .add("data-placement", &config.placement, "auto, device (copy the set to the device), stream (batches through "
           "host memory) or files (a folder's images decoded batch by batch as they are needed)")
      .add("graphs", &config.graphs, "capture the training step as CUDA graphs: on or off (default: on for CUDA)")
      .add("overlap", &config.overlap, "G's forward and D's pass over the fakes on a second CUDA stream: on (default; eager steps "
           "from 1024 images a replica, below which the second stream costs more host time than it saves) or off")
      .add("schedule", &config.schedule, "exact (default: the DCGAN recipe) or pipelined: G's forward for the next step "
           "runs during this one, on G's weights before this step's update, so D never waits for G. This changes the "
           "algorithm (G's gradient is one step stale; docs/strategy.md measures what it costs); eager steps, one "
           "process per replica")
      .add("precision", &config.precision, "fp32, tf32 (TF32 convolutions/matmuls) or bf16 (autocast, channels_last; CUDA)")
      .add("channels-last", &config.channels_last, "channels_last parameters and batches (bf16 implies it)")
      .add("optimizer", &config.optimizer, "adam (torch::optim::Adam) or fused (FusedAdam; default on CUDA)");
}

// --data-placement files decodes image files: the built-in sets are not files.
void require_folder_for_files(const DCGANTrainConfig& config) {
  if (config.placement == "files" && (config.data == "fashion-mnist" || config.data == "mnist" || config.data == "synthetic"))
    throw FlagError("--data-placement files: needs --data <folder of images>, got --data " + config.data);
}

// Returns whether --batch-size is "auto" (which only `allow_auto` accepts; config.batch_size then stays the default).
bool resolve_run_flags(DCGANTrainConfig& config, const RunFlags& run, bool allow_auto) {
  if (config.beta1 >= 1.0) {
    std::ostringstream os;
    os << "--beta1: expected a number in [0, 1), got " << config.beta1;
    throw FlagError(os.str());
  }
  config.model.layers = parse_layers(run.layers);
  config.model.image_size = run.image_size;
  config.model.channels = run.channels;
  config.model.width = run.width;
  if (config.model.offload_budget < 0 || config.model.offload_budget > 1)
    throw FlagError("--offload-budget: expected a fraction of the GPU's memory in [0, 1], got " +
                    format_number(config.model.offload_budget));
  config.model.nz = run.nz;
  try {
    config.model.memory = hierpar::nn::parse_activation_memory(run.memory);
  } catch (const c10::Error& e) {
    throw FlagError(e.what_without_backtrace());
  }
  if (config.model.memory_slices > 1 && config.model.memory == hierpar::nn::ActivationMemory::none)
    throw FlagError("--memory-slices: slices the backward of recomputed blocks; expected --memory recompute or offload "
                    "with " + std::to_string(config.model.memory_slices) + " slices, got --memory none");
  if (run.image_size != 32 && run.image_size != 64 && run.image_size != 128)
    throw FlagError("--image-size: expected 32, 64 or 128, got " + std::to_string(run.image_size));
  if (run.channels != 0 && run.channels != 1 && run.channels != 3)
    throw FlagError("--channels: expected 1 or 3, got " + std::to_string(run.channels));
  parse_placement(config.placement);
  if (allow_auto && run.batch_size == "auto") return true;
  char* end = nullptr;
  const long long batch = std::strtoll(run.batch_size.c_str(), &end, 10);
  if (run.batch_size.empty() || *end != '\0' || batch < 1)
    throw FlagError("--batch-size: expected an integer >= 1" + std::string(allow_auto ? " or auto" : "") + ", got '" +
                    run.batch_size + "'");
  config.batch_size = batch;
  return false;
}

// A second stop signal exits at once: RunGuard's own line promises a checkpoint, which a run may not have written
// yet (--checkpoint-every 0), so this handler, in front of RunGuard's, says which it is.
char g_checkpoint[4096] = "";
bool g_single_process = true;
std::atomic<int> g_stop_signals{0};
struct sigaction g_guard_action {};

extern "C" void on_train_stop_signal(int signo) {
  if (g_stop_signals.fetch_add(1) == 0) {
    g_guard_action.sa_handler(signo);  // the first: RunGuard stops every rank after one agreed step
    return;
  }
  static const char kHead[] = "hierpar-dcgan: second interrupt: exiting at once ";
  static const char kSaved[] = "(the last checkpoint written resumes)\n";
  static const char kNone[] = "(no checkpoint was written: this run cannot be resumed)\n";
  const bool saved = ::access(g_checkpoint, F_OK) == 0;  // async-signal-safe; checkpoints appear by rename
  const ssize_t a = ::write(STDERR_FILENO, kHead, sizeof kHead - 1);
  const ssize_t b = saved ? ::write(STDERR_FILENO, kSaved, sizeof kSaved - 1)
                          : ::write(STDERR_FILENO, kNone, sizeof kNone - 1);
  (void)a;
  (void)b;
  // 128 + the signal, the shell's convention; multi-rank runs keep RunGuard's 130 (their launchers' tests expect it).
  ::_exit(g_single_process ? 128 + signo : 130);
}

void install_stop_signal_handlers(const std::string& out) {
  hierpar::strategy::RunGuard::install_signal_handlers("hierpar-dcgan");
  std::snprintf(g_checkpoint, sizeof g_checkpoint, "%s/checkpoint.pt", out.c_str());
  g_single_process = !hierpar::strategy::Launch::from_env().multi_process();
  struct sigaction action {};
  action.sa_handler = on_train_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &action, &g_guard_action);
  ::sigaction(SIGTERM, &action, nullptr);
}

int train(int argc, char** argv) {
  DCGANTrainConfig config;
  RunFlags run;
  std::string resume = "off";
  Flags flags("hierpar-dcgan train");
  add_run_flags(flags, config, run);
  flags.add("epochs", &config.epochs, "epochs to train", 1)
      .add("max-steps", &config.max_steps, "stop after this many steps in total (0: no limit)", 0)
      .add("checkpoint-every", &config.checkpoint_every, "steps between checkpoints (0: epoch ends only)", 0)
      .add("samples", &config.samples, "images in each sample grid", 1)
      .add("out", &config.out, "output folder")
      .add_optional("resume", &resume, "on", "continue from <out>/checkpoint.pt; auto: continue from it if it exists "
                    "(torchrun --max-restarts)")
      .add("keep-checkpoints", &config.keep_checkpoints,
           "checkpoints kept: the newest as checkpoint.pt, and with K > 1 the last K as checkpoint-<step>.pt", 1)
      .add("timeout", &config.timeout, "seconds a step may go without progress while ranks or replicas wait for "
           "each other before the run stops as hung", 0.0)
      .add("inject-fault", &config.inject_fault, "a testing aid: KIND@STEP[:REPLICA], KIND throw, hang, kill, sigint "
           "or sigterm: that replica (default: the last; its D process where G and D have one each) fails so at the "
           "start of that step (not in a resumed run)")
      .add("memory-snapshot", &config.memory_snapshot, "write the GPU memory's allocations and frees over the first " +
           std::to_string(MemorySnapshot::kSteps) + " steps, with their C++ stacks, to this file (a pickle: open it at "
           "https://pytorch.org/memory_viz; CUDA)")
      .add("log-every", &config.log_every, "steps between reading the losses back from the device", 1)
      .add("eval-every", &config.eval_every, "steps between scoring samples with the quality metric (Fashion-MNIST; "
           "0: never): <out>/quality.csv and quality.png, docs/quality.md", 0)
      .add("eval-samples", &config.eval_samples, "samples each of those scores", 2)
      .add("ema", &config.ema, "decay of a moving average of G's weights (e.g. 0.999; 0: none), sampled beside G and "
           "scored by --eval-every", 0.0)
      .add("r1", &config.r1, "R1 penalty weight gamma on D's gradient at the real images (StyleGAN's regulariser; "
           "0: none; steps then run without CUDA graphs)", 0.0)
      .add("r1-every", &config.r1_every, "steps between R1 penalties (lazy regularisation, scaled by it)", 1)
      .add("loss", &config.loss, "bce (DCGAN's), hinge, or wgan-gp (Wasserstein loss with a gradient penalty; steps "
           "then run without CUDA graphs)")
      .add("gp", &config.gp, "the gradient penalty's weight with --loss wgan-gp", 0.0);
  if (!flags.parse(argc, argv, 2)) return 0;
  const bool auto_batch = resolve_run_flags(config, run, /*allow_auto=*/true);
  if (config.loss != "bce" && config.loss != "hinge" && config.loss != "wgan-gp")
    throw FlagError("--loss: expected bce, hinge or wgan-gp, got '" + config.loss + "'");
  require_folder_for_files(config);
  if (resume != "off" && resume != "on" && resume != "auto")
    throw FlagError("--resume: expected nothing or auto, got '" + resume + "'");
  config.resume = resume == "on";
  config.resume_auto = resume == "auto";
  if (auto_batch) {
    if (resume != "off")
      throw FlagError("--batch-size auto with --resume: give the batch size the run was started with");
    if (hierpar::strategy::Launch::from_env().multi_process())
      throw FlagError("--batch-size auto runs the search in one process: run hierpar-dcgan tune first, then pass "
                      "its choice to every rank");
    // The search starts from the default batch and keeps to the data set's size.
    TuneConfig tune;
    tune.steps = 10;
    DCGANTrainConfig search = config;
    search.out = config.out + "/tune";
    config.batch_size = tune_batch_size(search, tune, std::cout).chosen;
    std::cout << "train: --batch-size auto chose " << config.batch_size << " (the least epoch time measured)\n";
  }
  // The first SIGINT/SIGTERM stops every rank after one agreed step, with a checkpoint; a second exits at once.
  install_stop_signal_handlers(config.out);
  // c10d warns, with a backtrace, about every store connection that a stopping or dead peer closes; the run says
  // what failed in its own line. TORCH_CPP_LOG_LEVEL still chooses.
  if (std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr && hierpar::strategy::Launch::from_env().multi_process()) {
    FLAGS_caffe2_log_level = std::max(FLAGS_caffe2_log_level, 2);  // errors only
  }
  return train_dcgan(config);
}

int tune(int argc, char** argv) {
  DCGANTrainConfig config;
  RunFlags run;
  TuneConfig tune;
  config.out = "runs/tune";
  Flags flags("hierpar-dcgan tune");
  add_run_flags(flags, config, run);
  flags.add("objective", &tune.objective, "epoch-time (the seed's EpochTimeMinimize), gpu-usage (GpuUsageMaximize) "
            "or max-memory (the largest batch that fits)")
      .add("steps", &tune.steps, "timed steps per batch size at most", 1)
      .add("timed-seconds", &tune.timed_seconds, "a batch's timed steps are as many as fill this long at the pace of "
           "the first 3 (3 at least): a large batch's steps are long enough to time in a few", 0)
      .add("max-batch", &tune.max_batch, "never try a batch above this (0: the data set's size)", 0)
      .add("memory-resolution", &tune.memory_resolution, "max-memory: stop bisecting once the largest batch that "
           "fits is known to within this fraction of it (each trial builds and captures a step; 0: to one image)",
           -std::numeric_limits<double>::infinity())  // checked by tune_batch_size: [0, 1)
      .add("sweep", &tune.sweep, "after the search, measure this many batches evenly spaced over its range and say how "
           "far its choice is from their best (0: no sweep)", 0)
      .add("out", &config.out, "folder for tune.png");
  if (!flags.parse(argc, argv, 2)) return 0;
  resolve_run_flags(config, run, /*allow_auto=*/false);
  tune_batch_size(config, tune, std::cout);
  return 0;
}

// The loader alone, as train would read it (decoding, resizing, gathering, the copy to the device): images per second,
// to set against a training step's.
int data_speed(int argc, char** argv) {
  DCGANTrainConfig config;
  RunFlags run;
  int64_t batches = 100;
  Flags flags("hierpar-dcgan data-speed");
  add_run_flags(flags, config, run);
  flags.add("batches", &batches, "batches to time, after one untimed", 1);
  if (!flags.parse(argc, argv, 2)) return 0;
  resolve_run_flags(config, run, /*allow_auto=*/false);
  require_folder_for_files(config);
  resolve_model(config);
  const torch::Device device = parse_device(config.device);
  TrainingData data = open_training_data(config, device);
  std::cout << "data: " << data.description << "\n";
  BatchLoader& loader = *data.loader;
  int64_t epoch = 0;
  loader.start_epoch(epoch);
  auto next = [&] {
    torch::Tensor batch = loader.next();
    if (!batch.defined()) {
      loader.start_epoch(++epoch);
      batch = loader.next();
    }
    return batch;
  };
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  };
  next();
  sync();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < batches; ++i) next();
  sync();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "loader alone on " << device << " (" << (loader.resident() ? "resident" : data.from_files ? "files" : "streamed")
            << ", " << at::get_num_threads() << " threads): " << batches << " batches of " << config.batch_size << " in "
            << std::fixed << std::setprecision(3) << seconds << " s = " << std::setprecision(0)
            << batches * config.batch_size / seconds << " images/s\n";
  return 0;
}

constexpr const char* kWeightsHelp = "live (G as trained) or ema (its moving average, from a run with --ema)";

// The flags that place a loaded generator, in evaluate and generate: its layer set and its device.
Flags& add_generator_placement(Flags& flags, std::string* layers, std::string* device) {
  return flags.add("layers", layers, "stock or hierpar")
      .add("device", device, "cpu, cuda or cuda:N (default: cuda when available)");
}

int evaluate(int argc, char** argv) {
  std::string checkpoint = "runs/dcgan/checkpoint.pt", layers = "hierpar", device, weights = "live";
  std::string fashion_mnist_dir = default_fashion_mnist_dir(), classifier_path = default_classifier_cache();
  int64_t count = 10000, seed = 0;
  Flags flags("hierpar-dcgan evaluate");
  flags.add("checkpoint", &checkpoint, "checkpoint written by train (a Fashion-MNIST generator)")
      .add("samples", &count, "generated images scored against the 10000 test images", 2)
      .add("seed", &seed, "noise seed", 0);
  add_generator_placement(flags, &layers, &device)
      .add("fashion-mnist-dir", &fashion_mnist_dir, "where the Fashion-MNIST .gz files are")
      .add("classifier", &classifier_path, "the feature network's cache (trained there once when missing)")
      .add("weights", &weights, kWeightsHelp);
  if (!flags.parse(argc, argv, 2)) return 0;
  auto classifier = fashion_mnist_classifier(fashion_mnist_dir, classifier_path, std::cerr);
  auto generator = load_generator(checkpoint, parse_layers(layers), parse_device(device), weights);
  const int64_t size = generator->options.image_size;
  const auto test_features = real_test_features(*classifier, fashion_mnist_dir, size);
  const auto samples = generator_quality(*generator, *classifier, test_features, count, static_cast<uint64_t>(seed));
  const auto real = evaluate_images(load_fashion_mnist(fashion_mnist_dir, /*train=*/true, count).images, size,
                                    *classifier, test_features);
  std::cout << checkpoint << ": " << count << " samples: " << samples.to_string() << "\n"
            << "for scale, " << count << " Fashion-MNIST training images: " << real.to_string() << "\n"
            << "(the seed CNN's features: comparable between hierpar runs at one image size, not with Inception FIDs)\n";
  return 0;
}

int generate(int argc, char** argv) {
  std::string checkpoint = "runs/dcgan/checkpoint.pt", output = "samples.png", layers = "hierpar", device;
  std::string weights = "live";
  int64_t count = 64, seed = 0;
  Flags flags("hierpar-dcgan generate");
  flags.add("checkpoint", &checkpoint, "checkpoint written by train")
      .add("count", &count, "number of images", 1)
      .add("seed", &seed, "noise seed", 0)
      .add("output", &output, "PNG file to write");
  add_generator_placement(flags, &layers, &device).add("weights", &weights, kWeightsHelp);
  if (!flags.parse(argc, argv, 2)) return 0;
  const auto dev = parse_device(device);
  auto generator = load_generator(checkpoint, parse_layers(layers), dev, weights);
  auto noise = torch::randn({count, generator->options.nz}, at::make_generator<at::CPUGeneratorImpl>(seed)).to(dev);
  torch::NoGradGuard no_grad;
  write_image_grid(generator->forward(noise), output);
  std::cout << "wrote " << count << " samples to " << output << "\n";
  return 0;
}

int plot(int argc, char** argv) {
  std::string output = "losses.png", list, metric = "loss";
  Flags flags("hierpar-dcgan plot");
  flags.add("output", &output, "PNG file to write")
      .add("runs", &list, "LABEL=PATH[,LABEL=PATH...]: each run's losses.csv (or quality.csv) and its legend label")
      .add("metric", &metric, "loss (D and G losses from losses.csv) or fid (the FID of train --eval-every, from "
                              "quality.csv)");
  if (!flags.parse(argc, argv, 2)) return 0;
  if (list.empty()) throw FlagError("--runs: give at least one LABEL=PATH");
  std::vector<std::pair<std::string, std::string>> runs;
  std::istringstream items(list);
  for (std::string item; std::getline(items, item, ',');) {
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
      throw FlagError("--runs: expected LABEL=PATH, got '" + item + "'");
    runs.emplace_back(item.substr(0, eq), item.substr(eq + 1));
  }
  if (metric != "loss" && metric != "fid") throw FlagError("--metric: expected loss or fid, got '" + metric + "'");
  const auto summary = metric == "fid" ? plot_quality_runs(runs, output) : plot_loss_runs(runs, output);
  for (const auto& line : summary) std::cout << line << "\n";
  std::cout << "wrote " << output << "\n";
  return 0;
}

int export_generator(int argc, char** argv) {
  std::string checkpoint = "runs/dcgan/checkpoint.pt", output = "generator.pt", layers = "hierpar", weights = "live";
  Flags flags("hierpar-dcgan export");
  flags.add("checkpoint", &checkpoint, "checkpoint written by train")
      .add("output", &output, "TorchScript file to write")
      .add("layers", &layers, "stock (aten ops) or hierpar (torch.ops.hierpar where hierpar layers are built)")
      .add("weights", &weights, kWeightsHelp);
  if (!flags.parse(argc, argv, 2)) return 0;
  auto generator = load_generator(checkpoint, parse_layers(layers), torch::kCPU, weights);
  auto module = hierpar::examples::export_generator(*generator);
  module.save(output);
  std::cout << "wrote " << output << ": in Python, torch.ops.load_library('<build>/libhierpar_ops.so'); "
            << "g = torch.jit.load('" << output << "'); g(torch.randn(16, " << generator->options.nz << "))\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Every command: dispatch, the unknown-command line and the help a flag error points to all come from here.
  const std::vector<std::pair<std::string, int (*)(int, char**)>> commands{
      {"train", train},     {"generate", generate}, {"evaluate", evaluate},     {"export", export_generator},
      {"plot", plot},       {"tune", tune},         {"data-speed", data_speed}};
  const std::string command = argc > 1 ? argv[1] : "";
  const auto found = std::find_if(commands.begin(), commands.end(), [&](const auto& c) { return c.first == command; });
  const std::string help = found != commands.end() ? "hierpar-dcgan " + command : "hierpar-dcgan";
  const int status = run_reporting_errors("hierpar-dcgan", [&]() -> int {
    if (found != commands.end()) return found->second(argc, argv);
    if (command == "--help" || command == "-h") {
      std::cout << kUsage;
      return 0;
    }
    std::string names;
    for (size_t i = 0; i < commands.size(); ++i)
      names += (i == 0 ? "" : i + 1 == commands.size() ? " or " : ", ") + commands[i].first;
    throw FlagError(command.empty() ? "missing command (" + names + ")"
                                    : "unknown command '" + command + "' (" + names + ")");
  }, help);
  // After a failure, threads may still wait on peers that are gone (a failed run leaves its process groups and
  // any hung replica behind): the line is printed, so the process ends now instead of in their destructors.
  hierpar::strategy::RunGuard::exiting();
  if (status == 1) {
    std::fflush(nullptr);
    std::_Exit(status);
  }
  return status;
}
