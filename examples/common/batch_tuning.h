// hierpar-dcgan tune: the batch-size search of seed 004 (hierpar/strategy/batch_size_search.h) on the DCGAN, with
// a probe that trains fresh copies of the networks, so that nothing of a run's model or optimiser is touched.
#pragma once

#include "common/dcgan_app.h"
#include "hierpar/strategy/averaging.h"
#include "hierpar/strategy/batch_size_search.h"

#include <memory>
#include <ostream>
#include <string>

namespace hierpar::examples {

struct TuneConfig {
  std::string objective = "epoch-time";  // epoch-time | gpu-usage | max-memory
  int64_t steps = 20;                    // timed steps per trial at most (after the warm-up and any capture)
  // A trial's timed steps stop once they have run this long, after 3 at least (0: always `steps`): a large batch's
  // steps are long enough to time in a few, and the search pays for every one.
  double timed_seconds = 0.05;
  int64_t max_batch = 0;                 // never above this (0: the data set's size)
  double memory_resolution = 1.0 / 64;   // max-memory: the bound found to within this fraction (0: one image)
  // After the search, this many batches evenly spaced from the starting batch to the largest the search ran, measured
  // alike (0: none): the exhaustive sweep that the search's choice is compared with.
  int64_t sweep = 0;
};

// A trial's note for the caching allocator's out-of-memory message: the request that failed and what was allocated
// then ("out of memory: asked for 2.00 GiB with 60.12 GiB allocated"); a request far above a step's usual
// allocations points at one workspace rather than the activations.
std::string out_of_memory_note(const std::string& allocator_message);

// Up to `steps` training steps of networks built from config.model on config's placement (one process) at global batch
// `batch`, on random images, after a warm-up; with `timed_seconds` (> 0), as many steps (3 at least) as fill it at the
// first 3 steps' pace; the epoch time is for `dataset_size` images. Out of memory gives a trial that does not fit, with
// the allocator's cache emptied; a trial that fits leaves the cache to the next. `steps` 0: the warm-up alone (nothing
// timed). `process_groups`: with several replicas and --reduce nccl, the process groups the trials share (see
// hierpar::strategy::ProcessGroupCache); null: each trial its own.
hierpar::strategy::BatchTrial measure_dcgan_steps(
    const DCGANTrainConfig& config, int64_t batch, int64_t dataset_size, int64_t steps, double timed_seconds = 0,
    const std::shared_ptr<hierpar::strategy::ProcessGroupCache>& process_groups = nullptr);

// Searches from config.batch_size for `tune.objective`; prints the trials, the choice and what the search cost
// against a 20-epoch run at the chosen batch to `out`, with `tune.sweep` the sweep and how far the choice is from its
// best epoch time, and writes <config.out>/tune.png (seconds per epoch per batch: the search's and the sweep's).
hierpar::strategy::BatchSearchResult tune_batch_size(DCGANTrainConfig config, const TuneConfig& tune,
                                                     std::ostream& out);

}  // namespace hierpar::examples
