// Training checkpoints: modules, optimisers, progress counters, RNG states and the configuration that
// produced them. Written to a fresh temporary file, flushed to the disk (file and folder) and renamed over
// the previous one, so a crash or a concurrent writer never leaves a partial checkpoint under the name.
// Loading checks every tensor's shape and dtype against the modules it fills; any failure is one line.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace hierpar::examples {

// A configuration as key=value pairs (values may hold any characters); compared field by field when resuming.
using Config = std::map<std::string, std::string>;

struct CheckpointState {
  Config config;
  int64_t epoch = 0;        // the epoch in progress (0-based)
  int64_t epoch_step = 0;   // batches of that epoch already done
  int64_t global_step = 0;  // batches done in total
  torch::Tensor history;    // per-step values the program keeps (e.g. losses), float [steps, k]
};

using NamedModules = std::vector<std::pair<std::string, torch::nn::Module*>>;
using NamedOptimizers = std::vector<std::pair<std::string, torch::optim::Optimizer*>>;

// Writes `path` atomically. Also stores the CPU RNG state and, when `device` is CUDA, that device's.
// keep > 1 also keeps the last `keep` checkpoints as checkpoint-<global step>.pt beside `path` (hard links
// of the same files, so no extra disk for the newest) and removes older ones.
void save_checkpoint(const std::string& path, const CheckpointState& state, const NamedModules& modules,
                     const NamedOptimizers& optimizers, torch::Device device, int64_t keep = 1);

// Where save_checkpoint keeps the checkpoint of `global_step` beside `path` when keep > 1.
std::string numbered_checkpoint(const std::string& path, int64_t global_step);

// Reads the state of the checkpoint at `path` without touching modules (config, counters, history).
CheckpointState read_checkpoint_state(const std::string& path);

// Throws Error naming the checkpoint at `path` if its configuration differs from `expected` in any key of
// `expected`, listing the differences.
void require_config(const std::string& path, const Config& found, const Config& expected);

// Loads the named modules and optimisers (and RNG states unless `restore_rng` is false) from `path`.
// Every parameter and buffer must be in the checkpoint with the module's shape and dtype, and every Adam
// state tensor with its parameter's, else Error names the entry. Values are copied into the modules'
// tensors (on their devices); optimiser state tensors are read onto the CPU.
// Checks the configuration with require_config; throws Error if the file cannot be read.
CheckpointState load_checkpoint(const std::string& path, const Config& expected, const NamedModules& modules,
                                const NamedOptimizers& optimizers, torch::Device device, bool restore_rng = true);

}  // namespace hierpar::examples
