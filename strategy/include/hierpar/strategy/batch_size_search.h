#pragma once
// Choosing the global mini-batch size before training (seed 004): measure a few steps at a batch size on copies
// of the networks, and search over batch sizes for an objective.
//   - max_memory: the largest batch that runs without running out of memory: doubling, then a binary search
//     between the last batch that fit and the first that did not (as PyTorch Lightning's BatchSizeFinder);
//   - epoch_time: the seed's EpochTimeMinimize: the batch grows by 1, 2, 3, ... units; every 5 trials the epoch
//     time relative to the first trial is compared with the previous check, and the search stops when it moved
//     by at most 0.05; the batch with the least measured epoch time wins;
//   - gpu_usage: the seed's GpuUsageMaximize: the step grows by a unit while the GPU's utilisation (the mean of
//     the top half of its samples) is below the target (99%) and shrinks by one when above; the first batch at
//     the target wins (else the most utilised).
// Every search stays within the memory bound: a batch that runs out of memory ends the growth, and the batches
// between the last that fit and it are bisected (and measured) for the largest that fits: to one `multiple` for
// max_memory, to within a growth unit for the others (near the bound their objective barely moves, and every trial
// builds and warms up a trainer).
// A GAN's batch size changes what it learns, not only how fast: a search result is a speed choice.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace hierpar::strategy {

struct BatchTrial {
  int64_t batch = 0;
  bool fits = false;                   // the steps ran without running out of memory
  double step_seconds = 0;             // per step, over the timed steps
  double epoch_seconds = 0;            // step_seconds * the steps an epoch of the data set takes
  double images_per_second = 0;
  std::optional<double> gpu_usage;     // percent: mean of the top half of the utilisation samples (NVML)
  int64_t peak_bytes = 0;              // peak device memory over the trial, warm-up and capture included (0 on the CPU)
  int64_t timed_steps = 0;             // the steps step_seconds is measured over
  double build_seconds = 0;            // wall time building the networks, the trainer and the batch
  double setup_seconds = 0;            // wall time before the timed steps: building, then the warm-up and capture
  double trial_seconds = 0;            // wall time of the whole trial (what the search pays for it)
  std::string note;                    // why it did not fit, etc.
};

// Measures a few training steps at a global batch size. Implementations: a trainer on copies of the networks
// (examples/common/batch_tuning.cpp), a cost model in tests. Out of memory is a trial with fits = false.
using BatchProbe = std::function<BatchTrial(int64_t batch)>;

enum class BatchObjective { max_memory, epoch_time, gpu_usage };
BatchObjective parse_batch_objective(const std::string& name);  // max-memory | epoch-time | gpu-usage
const char* to_string(BatchObjective objective);

struct BatchSearchOptions {
  BatchObjective objective = BatchObjective::epoch_time;
  int64_t start = 64;          // the first batch tried
  int64_t multiple = 1;        // every batch is a multiple of this (the replicas: each gets an equal share)
  int64_t unit = 0;            // epoch_time / gpu_usage step unit (0: start / 2, rounded to `multiple`)
  int64_t limit = 1 << 20;     // never above this (e.g. the data set size)
  int64_t max_trials = 100;    // the seed's max_iteration
  double tolerance = 0.05;     // epoch_time: convergence of the improvement ratio
  int64_t check_every = 5;     // epoch_time: trials between convergence checks
  double usage_target = 99.0;  // gpu_usage: percent
  // max_memory: the bisection stops once the largest batch that fits is known to within this fraction of it (at
  // least `multiple`): each trial costs a trainer, its warm-up and a capture, and the last few images of the bound
  // are worth less than the trials that find them. 0: to within `multiple`.
  double memory_resolution = 1.0 / 64;
};

struct BatchSearchResult {
  BatchObjective objective = BatchObjective::epoch_time;
  int64_t chosen = 0;
  std::string reason;               // one line: why this batch
  std::vector<BatchTrial> trials;   // in the order measured
  std::string table() const;        // batch, fits, s/step, s/epoch, images/s, utilisation, peak MB, trial s
};

// Runs the search; throws c10::Error (naming the option) for bad options and when not even `start` fits.
BatchSearchResult search_batch_size(const BatchProbe& probe, const BatchSearchOptions& options);

}  // namespace hierpar::strategy
