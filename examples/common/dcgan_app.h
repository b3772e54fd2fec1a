// hierpar-dcgan's work, callable from the program and the tests: training with checkpoints and resume
// (dcgan_train.cpp), the flags resolved into what a run uses (dcgan_settings.cpp), sampling from a checkpoint
// and TorchScript export of the generator (dcgan_export.cpp).
#pragma once

#include "common/checkpoint.h"
#include "common/data.h"
#include "hierpar/models/dcgan.h"
#include "hierpar/strategy/adversarial_trainer.h"
#include "hierpar/strategy/precision.h"
#include "hierpar/strategy/placement.h"

#include <torch/script.h>

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace hierpar::examples {

struct DCGANTrainConfig {
  std::string data = "fashion-mnist";  // fashion-mnist | synthetic | a folder of images
  std::string fashion_mnist_dir = default_fashion_mnist_dir();
  std::string mnist_dir = default_mnist_dir();
  int64_t limit = 0;                   // use at most this many images (0: all)
  std::string placement = "auto";      // auto | device | stream
  models::DCGANOptions model;          // channels 0 below means: 1 for Fashion-MNIST, 3 otherwise
  std::string device = "";             // "" picks cuda when available; cpu runs every strategy on the CPU
  // How G and D are placed and trained (hierpar::strategy): single | task | data | hierarchical over
  // `gpus` devices in all (0: the scheme's own count, times WORLD_SIZE under a launcher), gradients
  // averaged by host | nccl (empty: nccl on GPUs, the fast path on an NVLink host; host, the seed's way, on the
  // CPU). batch_size is the global batch, split evenly over all replicas.
  std::string strategy = "single";
  int64_t gpus = 0;
  std::string reduce;
  bool sync_batch_norm = false;        // BatchNorm statistics over all replicas (off: per replica, as the paper)
  int64_t epochs = 5;
  int64_t batch_size = 64;
  double lr = 2e-4, beta1 = 0.5;
  int64_t seed = 0;
  int64_t max_steps = 0;               // stop after this many steps in total (0: no limit)
  int64_t checkpoint_every = 500;      // steps between checkpoints (besides every epoch end and the stop)
  int64_t samples = 64;                // images in each per-epoch grid
  std::string out = "runs/dcgan";
  bool resume = false;                 // continue from <out>/checkpoint.pt, which must exist
  bool resume_auto = false;            // continue from it when it exists, start otherwise (torchrun restarts)
  int64_t keep_checkpoints = 1;        // checkpoints kept: checkpoint.pt, and the last K as checkpoint-<step>.pt
  // Seconds a step may go without progress while ranks or replicas wait for each other before the run stops
  // as hung (the RunGuard's and the averaging's timeout); failures and deaths stop it within seconds anyway.
  double timeout = 60;
  // A testing aid (--inject-fault KIND@STEP[:REPLICA]): global replica REPLICA (default: the last) throws, hangs,
  // is killed (SIGKILL) or sends its process SIGINT or SIGTERM at the start of global step STEP (under a split
  // placement, the process of its D); KIND is
  // throw | hang | kill | sigint | sigterm. It fires only in a run that did not resume, so that a restart
  // (torchrun --max-restarts with --resume auto) shows the recovery.
  std::string inject_fault;
  // Non-empty: the CUDA caching allocator's history of the run's first steps, written there as the pickle that
  // https://pytorch.org/memory_viz draws (common/memory_snapshot.h; rank 0's devices).
  std::string memory_snapshot;
  // The training step (hierpar::strategy::AdversarialTrainer): CUDA graphs auto (on for CUDA) | on | off;
  // precision fp32 | tf32 (TF32 convolutions and matmuls) | bf16 (autocast to bf16, channels_last end to
  // end; CUDA only); channels_last for fp32/tf32 too; optimiser auto (FusedAdam on CUDA) | adam | fused;
  // overlap on | off: G's forward and D's pass over the fakes on a second stream (AdversarialOptions).
  std::string graphs = "auto";
  std::string overlap = "on";
  // exact (the DCGAN recipe) | pipelined: G one step ahead, on weights one update old (AdversarialOptions::schedule).
  std::string schedule = "exact";
  std::string precision = "tf32";
  bool channels_last = false;
  std::string optimizer = "auto";
  bool cudnn_benchmark = true;         // false: deterministic cuDNN algorithms (tests comparing two runs)
  int64_t log_every = 50;              // steps between reading the losses back (the progress bar's values)
  bool quiet = false;                  // no progress bar or messages (tests)
  // Every `eval_every` steps (0: never), rank 0 scores `eval_samples` samples with the quality metric
  // (common/quality.h; Fashion-MNIST only) into <out>/quality.csv and quality.png.
  int64_t eval_every = 0;
  int64_t eval_samples = 2000;
  // > 0: a moving average of G's weights with this decay (AdversarialOptions::generator_ema_decay): kept in the
  // checkpoint as "generator_ema", drawn as samples/ema_*.png beside the live generator's grids, and the one the
  // quality metric scores.
  double ema = 0.0;
  // > 0: the R1 penalty's weight on D's real batch, applied every `r1_every` steps (AdversarialOptions::r1_gamma).
  double r1 = 0.0;
  int64_t r1_every = 16;
  // The adversarial loss: "bce" (DCGAN's), "hinge", or "wgan-gp" (the Wasserstein loss with a gradient penalty of
  // weight `gp`).
  std::string loss = "bce";
  double gp = 10.0;
  // Polled on the training thread after every step; returning true stops like an interrupt (every rank at
  // one agreed step): checkpoint, then return 130.
  std::function<bool()> should_stop;
};

// The configuration recorded in checkpoints: everything that decides the networks, the data and the
// optimisation (not the layer set, device, epochs, step budget or output folder, which may change on resume).
Config checkpoint_config(const DCGANTrainConfig& config);

// Trains; returns 0, or 130 when should_stop() or a stop signal (RunGuard::install_signal_handlers) ended it
// early, after the checkpoint (143, 128 + SIGTERM, when SIGTERM stopped a single-process run). Throws Error for bad input and for a failure, with one line naming the first
// failed rank and its cause.
// Under a launcher (torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) every process calls
// it with the same flags: each reads its share of the same global batches, and only rank 0 prints and
// writes samples, losses and checkpoints. A checkpoint holds replica 0's networks and optimisers, so
// it resumes under any strategy and device count. A hierpar::strategy::RunGuard keeps the ranks stopping
// together: on a failure, death or hang anywhere within seconds (a failed process's process groups are left
// to its end, which should then come at once: std::_Exit), and on an interrupt after one agreed step.
int train_dcgan(DCGANTrainConfig config);

// How the step runs, resolved from the flags for the placement's device type: throws FlagError naming the
// flag for unknown values and for requests the device cannot serve (graphs or bf16 on the CPU).
struct StepSettings {
  bool graphs = false, fused_adam = false, overlap = true;
  hierpar::strategy::Schedule schedule = hierpar::strategy::Schedule::exact;
  hierpar::strategy::StepPrecision precision;  // the trainer applies it to its steps, train and tune to the rest
  std::string describe() const;  // e.g. "CUDA graphs on, FusedAdam, bf16 autocast, channels_last"
};
StepSettings step_settings(const DCGANTrainConfig& config, c10::DeviceType device_type);

// Fills in what the flags leave to the data (channels 0: 1 for Fashion-MNIST, 3 otherwise) and checks the model.
void resolve_model(DCGANTrainConfig& config);

// Waits for every CUDA device of `placement` (the step's replays may run on streams of their own).
void synchronize_devices(const hierpar::strategy::Placement& placement);

// The training images --data, --limit and the model's channels ask for, as loaded (before resizing).
Dataset load_training_data(const DCGANTrainConfig& config);

// The training batches on `device` as --data and --data-placement ask (files: the folder's images decoded batch by
// batch; otherwise the set loaded and resized first), with the line that describes the data.
struct TrainingData {
  std::unique_ptr<BatchLoader> loader;
  std::string description;
  bool from_files = false;
};
TrainingData open_training_data(const DCGANTrainConfig& config, torch::Device device);

// The trainer's options for `config` and `step` (optimiser, graphs, streams, precision, synchronized BatchNorm);
// a run adds its fault handling and timeouts.
hierpar::strategy::AdversarialOptions trainer_options(const DCGANTrainConfig& config, const StepSettings& step);

// The placement that `config` asks for (strategy, gpus, reduce, device) in this process's launch;
// throws FlagError naming the flag for unknown names and Error for impossible requests.
hierpar::strategy::Placement dcgan_placement(const DCGANTrainConfig& config);

// The DCGAN shape a checkpoint written by train_dcgan was trained with (nz, image size, channels, width; from its
// configuration), built with `layers`; Error names a missing key.
models::DCGANOptions checkpoint_model(const std::string& checkpoint, LayerSet layers);

// The generator stored in a checkpoint written by train_dcgan, built with `layers`, in eval mode: its weights as
// trained ("live") or their moving average ("ema", from a run with --ema).
models::Generator load_generator(const std::string& checkpoint, LayerSet layers, torch::Device device,
                                 const std::string& weights = "live");

// Which ops the exported TorchScript calls: those of the layers the generator was built from, or forced.
enum class ExportOps { as_built, aten, hierpar };
// The generator (eval mode: BatchNorm uses its running statistics) as a TorchScript module defined from
// source, with the weights registered under the same names as in C++ ("deconv1.weight", "bn1.running_mean",
// ...); hierpar layers become torch.ops.hierpar calls.
torch::jit::Module export_generator(models::GeneratorImpl& generator, ExportOps ops = ExportOps::as_built);

}  // namespace hierpar::examples
