// The batch-size searches (strategy/batch_size_search.h) on a cost model with a known answer: a step costs a
// fixed overhead plus a per-image time, a batch above the memory bound does not fit, and the GPU is busy for the
// per-image part of each step. (The probe that trains copies of the DCGAN is tested in test_examples.cpp.)
#include "testing.h"

#include "hierpar/strategy/batch_size_search.h"
#include "hierpar/strategy/gpu_utilization.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

namespace hs = hierpar::strategy;

namespace {

struct CostModel {
  double overhead_s = 2e-3, per_image_s = 1e-5;
  int64_t memory_bound = 700, dataset = 60000;
  std::set<int64_t> measured;
  int64_t repeats = 0;  // batches measured twice

  double epoch_seconds(int64_t batch) const {
    return static_cast<double>((dataset + batch - 1) / batch) * (overhead_s + per_image_s * batch);
  }
  hs::BatchProbe probe() {
    return [this](int64_t batch) {
      repeats += measured.count(batch);
      measured.insert(batch);
      hs::BatchTrial t;
      if (batch > memory_bound) {
        t.note = "out of memory";
        return t;
      }
      t.fits = true;
      t.step_seconds = overhead_s + per_image_s * batch;
      t.epoch_seconds = epoch_seconds(batch);
      t.images_per_second = batch / t.step_seconds;
      t.gpu_usage = 100.0 * per_image_s * batch / t.step_seconds;
      t.peak_bytes = batch * 1000;
      return t;
    };
  }
};

TEST(BatchSizeSearch, MaxMemoryFindsTheLargestBatchThatFits) {
  for (int64_t bound : {64, 100, 700, 1024, 5000}) {
    CostModel model;
    model.memory_bound = bound;
    hs::BatchSearchOptions options;
    options.objective = hs::BatchObjective::max_memory;
    options.multiple = 8;
    options.memory_resolution = 0;
    const auto result = hs::search_batch_size(model.probe(), options);
    EXPECT_EQ(result.chosen, bound / 8 * 8) << "memory bound " << bound << "\n" << result.table();
    EXPECT_EQ(model.repeats, 0) << "a batch was measured twice";
    // Doubling then bisection: logarithmically many trials.
    EXPECT_LE(result.trials.size(), 2 * static_cast<size_t>(std::log2(bound)) + 2) << result.table();
    for (const auto& t : result.trials) EXPECT_EQ(t.fits, t.batch <= bound) << t.batch;
  }
}

// By default the bisection stops once the bound is known to within 1/64 of it: never a batch that does not fit,
// never more than that below the largest that does, and fewer trials than bisecting to one image.
TEST(BatchSizeSearch, MaxMemoryBisectsToItsResolution) {
  for (int64_t bound : {100, 3072, 3100, 5000, 20000}) {
    hs::BatchSearchOptions options;
    options.objective = hs::BatchObjective::max_memory;
    CostModel exact_model, model;
    exact_model.memory_bound = model.memory_bound = bound;
    hs::BatchSearchOptions exact = options;
    exact.memory_resolution = 0;
    const auto to_one = hs::search_batch_size(exact_model.probe(), exact);
    const auto result = hs::search_batch_size(model.probe(), options);
    EXPECT_EQ(to_one.chosen, bound);
    EXPECT_LE(result.chosen, bound) << result.table();
    EXPECT_GE(result.chosen, bound - bound / 64) << result.table();
    EXPECT_LE(result.trials.size(), to_one.trials.size()) << result.table();
    if (bound >= 3072) {
      EXPECT_LT(result.trials.size() + 3, to_one.trials.size()) << result.table();
      EXPECT_NE(result.reason.find("to within"), std::string::npos) << result.reason;
    }
  }
  hs::BatchSearchOptions bad;
  bad.objective = hs::BatchObjective::max_memory;
  bad.memory_resolution = 1.5;
  CostModel model;
  HIERPAR_EXPECT_THROW_MSG(hs::search_batch_size(model.probe(), bad), "memory_resolution");
}

// The search of `options` on the default costs with a memory bound that no search reaches.
hs::BatchSearchResult search_without_memory_bound(const hs::BatchSearchOptions& options) {
  CostModel model;
  model.memory_bound = 1 << 20;
  return hs::search_batch_size(model.probe(), options);
}

TEST(BatchSizeSearch, MaxMemoryStopsAtTheLimit) {
  hs::BatchSearchOptions options;
  options.objective = hs::BatchObjective::max_memory;
  options.limit = 1000;
  const auto result = search_without_memory_bound(options);
  EXPECT_EQ(result.chosen, 1000);
  EXPECT_NE(result.reason.find("limit"), std::string::npos) << result.reason;
}

// EpochTimeMinimize picks a batch whose epoch time is within 5% of the best of an exhaustive sweep, and never
// one that does not fit.
TEST(BatchSizeSearch, EpochTimeIsNearTheExhaustiveBest) {
  for (double overhead : {1e-4, 2e-3, 2e-2}) {
    for (int64_t bound : {300, 700, 4000}) {
      CostModel model;
      model.overhead_s = overhead;
      model.memory_bound = bound;
      hs::BatchSearchOptions options;
      options.multiple = 2;
      const auto result = hs::search_batch_size(model.probe(), options);
      double best = std::numeric_limits<double>::infinity();
      for (int64_t b = 64; b <= bound; b += 2) best = std::min(best, model.epoch_seconds(b));
      EXPECT_LE(result.chosen, bound);
      EXPECT_LE(model.epoch_seconds(result.chosen), 1.05 * best)
          << "overhead " << overhead << ", bound " << bound << ": " << result.reason << "\n" << result.table();
      EXPECT_EQ(model.repeats, 0);
    }
  }
}

// The seed's schedule: the batch grows by 1, 2, 3, ... units from the first; convergence is checked every 5.
TEST(BatchSizeSearch, EpochTimeGrowsByTheSeedsSchedule) {
  CostModel model;
  model.memory_bound = 1 << 20;
  model.overhead_s = 0;  // the epoch time never changes: converged at the first check
  hs::BatchSearchOptions options;
  options.start = 10;
  options.unit = 4;
  const auto result = hs::search_batch_size(model.probe(), options);
  std::vector<int64_t> batches;
  for (const auto& t : result.trials) batches.push_back(t.batch);
  EXPECT_EQ(batches, (std::vector<int64_t>{10, 14, 22, 34, 50, 70})) << result.table();
  EXPECT_NE(result.reason.find("settled"), std::string::npos) << result.reason;
}

TEST(BatchSizeSearch, GpuUsageStopsAtTheFirstBatchAtTheTarget) {
  hs::BatchSearchOptions options;
  options.objective = hs::BatchObjective::gpu_usage;
  options.usage_target = 95;
  const auto result = search_without_memory_bound(options);
  ASSERT_GE(result.trials.size(), 2u);
  EXPECT_EQ(result.chosen, result.trials.back().batch);
  EXPECT_GE(*result.trials.back().gpu_usage, 95.0);
  for (size_t i = 0; i + 1 < result.trials.size(); ++i) EXPECT_LT(*result.trials[i].gpu_usage, 95.0);
}

// Running out of memory ends the growth there; the choice is a batch that fit.
TEST(BatchSizeSearch, OutOfMemoryEndsTheGrowth) {
  for (auto objective : {hs::BatchObjective::epoch_time, hs::BatchObjective::gpu_usage}) {
    CostModel model;
    model.memory_bound = 200;
    model.overhead_s = 1.0;  // far from settling or from the utilisation target before the bound
    hs::BatchSearchOptions options;
    options.objective = objective;
    const auto result = hs::search_batch_size(model.probe(), options);
    EXPECT_TRUE(std::any_of(result.trials.begin(), result.trials.end(), [](const auto& t) { return !t.fits; }))
        << result.table();
    EXPECT_LE(result.chosen, 200);
    EXPECT_NE(result.reason.find("ran out of memory"), std::string::npos) << result.reason;
  }
}

// Beyond the memory bound, epoch-time and gpu-usage bisect only to within a growth unit: from 64 by units of 32,
// 1824 runs out of memory after 1504 fits, and 4 bisecting trials (not the 8 to one image) leave a batch that fits
// within 32 of the bound of 1600.
TEST(BatchSizeSearch, OutOfMemoryBisectsToAUnit) {
  for (auto objective : {hs::BatchObjective::epoch_time, hs::BatchObjective::gpu_usage}) {
    CostModel model;
    model.memory_bound = 1600;
    model.overhead_s = 10.0;  // neither settled nor at the utilisation target before the bound
    hs::BatchSearchOptions options;
    options.objective = objective;
    const auto result = hs::search_batch_size(model.probe(), options);
    const auto first_failure = std::find_if(result.trials.begin(), result.trials.end(), [](const auto& t) { return !t.fits; });
    ASSERT_NE(first_failure, result.trials.end()) << result.table();
    EXPECT_EQ(first_failure->batch, 1824) << result.table();
    EXPECT_EQ(result.trials.end() - first_failure - 1, 4) << "bisecting trials\n" << result.table();
    int64_t largest = 0;
    for (const auto& t : result.trials) {
      if (t.fits) largest = std::max(largest, t.batch);
    }
    EXPECT_GT(largest, 1600 - 32) << result.table();
    EXPECT_NE(result.reason.find("the largest that fits, to within 32: " + std::to_string(largest)), std::string::npos)
        << result.reason;
  }
}

TEST(BatchSizeSearch, BadOptionsAndAFirstBatchThatDoesNotFit) {
  CostModel model;
  hs::BatchSearchOptions options;
  options.multiple = 0;
  HIERPAR_EXPECT_THROW_MSG(hs::search_batch_size(model.probe(), options), "multiple: expected >= 1, got 0");
  options = {};
  options.start = 2000;
  options.limit = 1000;
  HIERPAR_EXPECT_THROW_MSG(hs::search_batch_size(model.probe(), options), "is above the limit 1000");
  options = {};
  options.start = 800;  // above the model's memory bound of 700
  HIERPAR_EXPECT_THROW_MSG(hs::search_batch_size(model.probe(), options), "the first batch, 800, does not run");
  HIERPAR_EXPECT_THROW_MSG(hs::parse_batch_objective("fastest"),
                           "objective: expected max-memory, epoch-time or gpu-usage, got 'fastest'");
  CostModel cpu;
  auto no_usage = [&](int64_t b) {
    auto t = cpu.probe()(b);
    t.gpu_usage.reset();
    return t;
  };
  options = {};
  options.objective = hs::BatchObjective::gpu_usage;
  HIERPAR_EXPECT_THROW_MSG(hs::search_batch_size(no_usage, options), "needs a CUDA device");
}

TEST(BatchSizeSearch, TopHalfMean) {
  EXPECT_FALSE(hs::top_half_mean({}).has_value());
  EXPECT_DOUBLE_EQ(*hs::top_half_mean({10, 100, 90, 0}), 95.0);
  EXPECT_DOUBLE_EQ(*hs::top_half_mean({10, 100, 90}), 95.0);
  EXPECT_FALSE(hs::UtilizationSampler::available(c10::Device(c10::kCPU)));
}

}  // namespace
