#include "hierpar/strategy/batch_size_search.h"

#include "hierpar/enum_names.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

namespace hierpar::strategy {

namespace {
constexpr EnumNames<BatchObjective, 3> objective_names{{{BatchObjective::max_memory, "max-memory"},
                                                         {BatchObjective::epoch_time, "epoch-time"},
                                                         {BatchObjective::gpu_usage, "gpu-usage"}}};
}  // namespace

BatchObjective parse_batch_objective(const std::string& name) { return parse_name(objective_names, name, "objective"); }

const char* to_string(BatchObjective objective) { return name_of(objective_names, objective); }

std::string BatchSearchResult::table() const {
  std::ostringstream os;
  char line[160];
  std::snprintf(line, sizeof line, "%8s %5s %10s %10s %12s %8s %9s %8s\n", "batch", "fits", "s/step", "s/epoch",
                "images/s", "GPU %", "peak MB", "trial s");
  os << line;
  for (const BatchTrial& t : trials) {
    if (!t.fits) {
      std::snprintf(line, sizeof line, "%8lld %5s  %s\n", static_cast<long long>(t.batch), "no", t.note.c_str());
    } else {
      char usage[16] = "-";
      if (t.gpu_usage) std::snprintf(usage, sizeof usage, "%.1f", *t.gpu_usage);
      char trial[16] = "-";
      if (t.trial_seconds > 0) std::snprintf(trial, sizeof trial, "%.2f", t.trial_seconds);
      std::snprintf(line, sizeof line, "%8lld %5s %10.5f %10.3f %12.0f %8s %9.0f %8s%s\n", static_cast<long long>(t.batch),
                    "yes", t.step_seconds, t.epoch_seconds, t.images_per_second, usage, t.peak_bytes / 1048576.0, trial,
                    t.batch == chosen ? "  <- chosen" : "");
    }
    os << line;
  }
  return os.str();
}

namespace {

// Measures each batch once; keeps the trials in the order measured.
class Trials {
 public:
  Trials(const BatchProbe& probe, BatchSearchResult& result) : probe_(probe), result_(result) {}

  const BatchTrial& at(int64_t batch) {
    auto it = by_batch_.find(batch);
    if (it != by_batch_.end()) return result_.trials[it->second];
    BatchTrial trial = probe_(batch);
    trial.batch = batch;
    by_batch_[batch] = result_.trials.size();
    result_.trials.push_back(std::move(trial));
    return result_.trials.back();
  }
  size_t count() const { return result_.trials.size(); }

 private:
  const BatchProbe& probe_;
  BatchSearchResult& result_;
  std::map<int64_t, size_t> by_batch_;
};

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }
int64_t round_down(int64_t value, int64_t multiple) { return value / multiple * multiple; }

std::string batch_text(int64_t batch) { return std::to_string(batch); }

// Bisects between a batch that fits and a larger one that does not, measuring each batch in between that it
// tries, until they are at most `resolution` apart; returns the largest that fits.
int64_t largest_fitting(Trials& trials, const BatchSearchOptions& o, int64_t fits, int64_t fails, int64_t resolution) {
  while (fails - fits > resolution && trials.count() < static_cast<size_t>(o.max_trials)) {
    const int64_t middle = round_down((fits + fails) / 2, o.multiple);
    if (middle <= fits) break;
    (trials.at(middle).fits ? fits : fails) = middle;
  }
  return fits;
}

// Growth by `unit` ran out of memory at `fails`: the batches between the last that fit and it are bisected to within
// a unit (what the growth itself resolves; each trial costs the search a trainer and its warm-up). Says so.
std::string out_of_memory(Trials& trials, const BatchSearchOptions& o, int64_t fits, int64_t fails, int64_t unit) {
  const int64_t largest = largest_fitting(trials, o, fits, fails, unit);
  return batch_text(fails) + " ran out of memory (the largest that fits, to within " + batch_text(unit) + ": " +
         batch_text(largest) + ")";
}

void search_max_memory(Trials& trials, const BatchSearchOptions& o, int64_t start, int64_t limit,
                       BatchSearchResult& result) {
  int64_t fits = start, fails = 0;
  while (trials.count() < static_cast<size_t>(o.max_trials)) {
    const int64_t next = std::min(limit, round_up(fits * 2, o.multiple));
    if (next == fits) break;
    if (trials.at(next).fits) {
      fits = next;
    } else {
      fails = next;
      break;
    }
  }
  int64_t resolution = o.multiple;
  if (fails > 0) {
    resolution = std::max(o.multiple, round_down(static_cast<int64_t>(o.memory_resolution * static_cast<double>(fits)),
                                                 o.multiple));
    fits = largest_fitting(trials, o, fits, fails, resolution);
  }
  result.chosen = fits;
  result.reason = fails > 0 ? "the largest batch that fits: " + batch_text(fits) + " (" + batch_text(fails) +
                                  " ran out of memory" +
                                  (resolution > o.multiple ? "; the bound to within " + batch_text(resolution) : "") +
                                  ")"
                            : "the largest batch tried, " + batch_text(fits) + ": the limit " + batch_text(limit) +
                                  " (the data set, or --max-batch) was reached without running out of memory";
}

// The seed's growth: the batch grows by `growth` units, one more each time, up to `limit`; false (and why in
// `stop`) when it cannot grow.
bool grow(int64_t& batch, int64_t& growth, int64_t unit, int64_t limit, std::string& stop) {
  const int64_t next = std::min(limit, batch + ++growth * unit);
  if (next == batch) {
    stop = "the limit " + batch_text(limit) + " was reached";
    return false;
  }
  batch = next;
  return true;
}

void search_epoch_time(Trials& trials, const BatchSearchOptions& o, int64_t start, int64_t unit, int64_t limit,
                       BatchSearchResult& result) {
  int64_t batch = start, previous = start, growth = 0;
  double base = 0, last_check = 1;
  std::string stop = "the search reached " + std::to_string(o.max_trials) + " trials";
  for (int64_t k = 0; k < o.max_trials; ++k) {
    const BatchTrial& trial = trials.at(batch);
    if (!trial.fits) {  // the memory bound, found to within a unit: the epoch time is flat there
      stop = out_of_memory(trials, o, previous, batch, unit);
      break;
    }
    previous = batch;
    if (k == 0) base = trial.epoch_seconds;
    const double ratio = trial.epoch_seconds / base;
    if (k > 0 && k % o.check_every == 0) {
      if (std::abs(ratio - last_check) <= o.tolerance) {
        char text[160];
        std::snprintf(text, sizeof text, "the epoch time settled (%.3f of the first trial's, %.3f %d trials before)",
                      ratio, last_check, static_cast<int>(o.check_every));
        stop = text;
        break;
      }
      last_check = ratio;
    }
    if (!grow(batch, growth, unit, limit, stop)) break;
  }
  const BatchTrial* best = nullptr;
  for (const BatchTrial& t : result.trials) {
    if (t.fits && (best == nullptr || t.epoch_seconds < best->epoch_seconds)) best = &t;
  }
  result.chosen = best->batch;
  char text[96];
  std::snprintf(text, sizeof text, "the least epoch time measured (%.3f s)", best->epoch_seconds);
  result.reason = std::string(text) + "; the search stopped as " + stop;
}

void search_gpu_usage(Trials& trials, const BatchSearchOptions& o, int64_t start, int64_t unit, int64_t limit,
                      BatchSearchResult& result) {
  int64_t batch = start, previous = start, growth = 0;
  std::string stop = "the search reached " + std::to_string(o.max_trials) + " trials";
  for (int64_t k = 0; k < o.max_trials; ++k) {
    const BatchTrial& trial = trials.at(batch);
    if (!trial.fits) {
      stop = out_of_memory(trials, o, previous, batch, unit);
      break;
    }
    previous = batch;
    TORCH_CHECK(trial.gpu_usage.has_value(), "objective gpu-usage: batch ", batch,
                " was measured without GPU utilisation samples (it needs a CUDA device and the driver's NVML)");
    if (*trial.gpu_usage >= o.usage_target) {
      char text[120];
      std::snprintf(text, sizeof text, "the first batch whose GPU utilisation reached %.0f%% (%.1f%%)",
                    o.usage_target, *trial.gpu_usage);
      result.chosen = batch;
      result.reason = text;
      return;
    }
    if (!grow(batch, growth, unit, limit, stop)) break;
  }
  const BatchTrial *best = nullptr, *at_target = nullptr;
  for (const BatchTrial& t : result.trials) {
    if (!t.fits || !t.gpu_usage) continue;
    if (best == nullptr || *t.gpu_usage > *best->gpu_usage) best = &t;
    if (*t.gpu_usage >= o.usage_target && (at_target == nullptr || t.batch < at_target->batch)) at_target = &t;
  }
  char text[120];
  if (at_target != nullptr) {  // found while bisecting below the memory bound
    result.chosen = at_target->batch;
    std::snprintf(text, sizeof text, "the smallest batch whose GPU utilisation reached %.0f%% (%.1f%%)",
                  o.usage_target, *at_target->gpu_usage);
    result.reason = std::string(text) + "; the search stopped as " + stop;
    return;
  }
  result.chosen = best->batch;
  std::snprintf(text, sizeof text, "the most utilised batch (%.1f%%, below the %.0f%% target)", *best->gpu_usage,
                o.usage_target);
  result.reason = std::string(text) + "; the search stopped as " + stop;
}

}  // namespace

BatchSearchResult search_batch_size(const BatchProbe& probe, const BatchSearchOptions& o) {
  TORCH_CHECK(o.multiple >= 1, "batch search: multiple: expected >= 1, got ", o.multiple);
  TORCH_CHECK(o.start >= 1, "batch search: start: expected >= 1, got ", o.start);
  TORCH_CHECK(o.max_trials >= 1, "batch search: max_trials: expected >= 1, got ", o.max_trials);
  TORCH_CHECK(o.check_every >= 1, "batch search: check_every: expected >= 1, got ", o.check_every);
  TORCH_CHECK(o.memory_resolution >= 0 && o.memory_resolution < 1,
              "batch search: memory_resolution: expected a fraction in [0, 1), got ", o.memory_resolution);
  const int64_t start = round_up(o.start, o.multiple), limit = round_down(o.limit, o.multiple);
  TORCH_CHECK(start <= limit, "batch search: the first batch (", start, ", a multiple of ", o.multiple,
              ") is above the limit ", o.limit);
  const int64_t unit = std::max(o.multiple, round_up(o.unit > 0 ? o.unit : start / 2, o.multiple));
  BatchSearchResult result;
  result.objective = o.objective;
  Trials trials(probe, result);
  const BatchTrial& first = trials.at(start);
  TORCH_CHECK(first.fits, "batch search: the first batch, ", start, ", does not run: ", first.note);
  switch (o.objective) {
    case BatchObjective::max_memory: search_max_memory(trials, o, start, limit, result); break;
    case BatchObjective::epoch_time: search_epoch_time(trials, o, start, unit, limit, result); break;
    case BatchObjective::gpu_usage: search_gpu_usage(trials, o, start, unit, limit, result); break;
  }
  return result;
}

}  // namespace hierpar::strategy
