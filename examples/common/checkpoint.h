// Training checkpoints: modules, optimisers, progress counters, RNG states and the configuration that
// produced them, written atomically (temporary file + rename) so an interrupted write leaves the previous
// checkpoint intact.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace hierpar::examples {

// A configuration as ordered key=value pairs; compared field by field when resuming.
using Config = std::map<std::string, std::string>;
std::string to_string(const Config& config);  // "key=value key=value"

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
void save_checkpoint(const std::string& path, const CheckpointState& state, const NamedModules& modules,
                     const NamedOptimizers& optimizers, torch::Device device);

// Reads the state of the checkpoint at `path` without touching modules (config, counters, history).
CheckpointState read_checkpoint_state(const std::string& path);

// Throws Error naming the checkpoint at `path` if its configuration differs from `expected` in any key of
// `expected`, listing the differences.
void require_config(const std::string& path, const Config& found, const Config& expected);

// Loads the named modules and optimisers (and RNG states unless `restore_rng` is false) from `path`.
// Tensors are read onto the CPU: a module's parameters on another device take the CPU values' device
// (load into CPU modules and move them), and optimiser state tensors are CPU tensors.
// Checks the configuration with require_config; throws Error if the file cannot be read.
CheckpointState load_checkpoint(const std::string& path, const Config& expected, const NamedModules& modules,
                                const NamedOptimizers& optimizers, torch::Device device, bool restore_rng = true);

}  // namespace hierpar::examples
