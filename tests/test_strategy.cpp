// The adversarial training strategy: every scheme's parameters after K steps against single-device references, on
// tiny conv G/D pairs of our own (with and without BatchNorm), and failing or hanging replicas. Placements and
// losses: test_placement.cpp, test_losses.cpp; ranks as processes: test_strategy_processes.cpp.
// CPU tests run everywhere (replicas as threads on "cpu" devices, Gloo for the collective path); CUDA versions skip
// with a reason when GPUs are missing.
#include "strategy_testing.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <tuple>

using namespace strategy_testing;
using Clock = std::chrono::steady_clock;

// ---- schemes against references (CPU) --------------------------------------------------------------

namespace {
// Task (G and D on two devices) against single, with and without BatchNorm, on `batch`-image batches: bit for bit.
void expect_task_equals_single(c10::DeviceType device_type, int64_t batch) {
  const auto data = make_data(batch, hierpar::testing::rng()());
  const uint64_t init = hierpar::testing::rng()();
  const std::string on = device_type == c10::DeviceType::CUDA ? " on GPUs" : "";
  for (bool bn : {false, true}) {
    const auto single = train(hs::Placement::from_flags("single", 1, "host", device_type, {}), bn, data, init);
    const auto task = train(hs::Placement::from_flags("task", 2, "host", device_type, {}), bn, data, init);
    expect_trained(single[0], init, bn);
    expect_states_equal(task[0], single[0], "task vs single" + on + (bn ? ", BatchNorm" : ""));
  }
}
}  // namespace

TEST(StrategyTrainer, TaskEqualsSingleExactlyOnCpu) { expect_task_equals_single(c10::DeviceType::CPU, 8); }

TEST(StrategyTrainer, DataAndHierarchicalMatchSingleWithoutBatchNorm) {
  const auto data = make_data(8, hierpar::testing::rng()());
  const uint64_t init = hierpar::testing::rng()();
  const auto single = train(hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CPU, {}), false, data, init);
  expect_trained(single[0], init, false);
  std::vector<std::pair<std::string, int64_t>> runs{{"data", 2}, {"data", 4}, {"hierarchical", 4}};
  for (const char* reduce : {"host", "nccl"}) {
    if (std::string(reduce) == "nccl" && !hs::gloo_available()) continue;
    for (const auto& [scheme, devices] : runs) {
      const auto placement = hs::Placement::from_flags(scheme, devices, reduce, c10::DeviceType::CPU, {});
      const auto replicas = train(placement, false, data, init);
      expect_states_close(replicas[0], single[0], kSplitBatchTolerance, placement.to_string());
      for (size_t r = 1; r < replicas.size(); ++r) {
        expect_states_equal(replicas[r], replicas[0], placement.to_string() + ": replica " + std::to_string(r));
      }
    }
  }
}

// bf16 autocast (and channels_last) through the trainer, on the CPU: it takes effect (the parameters differ from
// fp32 training's), task still equals single exactly, and the replicas of a data placement end identical (host and
// collective averaging of bf16-computed gradients).
TEST(StrategyTrainer, Bf16AutocastTakesEffectAndKeepsTheSchemesConsistent) {
  const auto data = make_data(8, hierpar::testing::rng()());
  const uint64_t init = hierpar::testing::rng()();
  auto fp32 = test_options();
  fp32.precision.channels_last = true;
  auto bf16 = fp32;
  bf16.precision.math = hs::StepPrecision::Math::bf16;
  const auto single_cpu = hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CPU, {});
  for (bool bn : {false, true}) {
    const std::string what = bn ? "bf16 autocast, BatchNorm" : "bf16 autocast";
    const auto single = train(single_cpu, bn, data, init, 0, -1, bf16);
    const auto without = train(single_cpu, bn, data, init, 0, -1, fp32);
    expect_trained(single[0], init, bn);
    double largest = 0;
    for (size_t i = 0; i < single[0].size(); ++i) {
      EXPECT_EQ(single[0][i].scalar_type(), torch::kFloat) << what << ": parameters stay float32, tensor " << i;
      largest = std::max(largest, (single[0][i] - without[0][i]).abs().max().item<double>());
    }
    EXPECT_GT(largest, 0) << what << ": training under autocast should round differently from float32";
    const auto task = train(hs::Placement::from_flags("task", 2, "host", c10::DeviceType::CPU, {}), bn, data, init, 0,
                            -1, bf16);
    expect_states_equal(task[0], single[0], what + ": task vs single");
    for (const char* reduce : {"host", "nccl"}) {
      if (std::string(reduce) == "nccl" && !hs::gloo_available()) continue;
      const auto replicas =
          train(hs::Placement::from_flags("data", 2, reduce, c10::DeviceType::CPU, {}), bn, data, init, 0, -1, bf16);
      expect_trained(replicas[0], init, bn);
      expect_states_equal(replicas[1], replicas[0], what + ", data x2 " + reduce + ": replica 1 vs replica 0");
    }
  }
}

TEST(StrategyTrainer, DataWithBatchNormMatchesPerPartReference) {
  const auto data = make_data(8, hierpar::testing::rng()());
  const uint64_t init = hierpar::testing::rng()();
  const auto reference = reference_per_part(true, data, 2, init);
  expect_trained(reference, init, true);
  const auto replicas = train(hs::Placement::from_flags("data", 2, "host", c10::DeviceType::CPU, {}), true, data, init);
  // Same parts, same part order in the sum, same division: only thread scheduling differs.
  expect_states_close(replicas[0], reference, kSplitBatchTolerance, "data R=2 with BatchNorm vs per-part reference");
  expect_states_equal(replicas[1], replicas[0], "replica 1 vs replica 0");
  // And the reference is not single on the whole batch: BatchNorm over halves is another computation.
  const auto single = train(hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CPU, {}), true, data, init);
  double largest = 0;
  for (size_t i = 0; i < single[0].size(); ++i) {
    largest = std::max(largest, (single[0][i] - reference[i]).abs().max().item<double>());
  }
  EXPECT_GT(largest, 1e-4) << "per-part BatchNorm should differ from whole-batch BatchNorm";
}

TEST(StrategyTrainer, HostAveragingEqualsCollectiveAveraging) {
  HIERPAR_REQUIRE_GLOO();
  const auto data = make_data(8, hierpar::testing::rng()());
  const uint64_t init = hierpar::testing::rng()();
  for (bool bn : {false, true}) {
    const auto host = train(hs::Placement::from_flags("data", 2, "host", c10::DeviceType::CPU, {}), bn, data, init);
    const auto gloo = train(hs::Placement::from_flags("data", 2, "nccl", c10::DeviceType::CPU, {}), bn, data, init);
    // Two replicas: a + b is the same float either way round, and both divide by 2 on the device.
    expect_states_equal(gloo[0], host[0], bn ? "Gloo vs host, BatchNorm" : "Gloo vs host");
  }
}

// Bucketed averaging (hooks start each bucket's sum during the backward) against one flat buffer after the
// backward (bucket_cap_bytes = 0) and against single on the whole batch, with host averaging and on Gloo. Caps of a
// few hundred bytes split the tiny networks (G: 3 KB + 48 B + 1.2 KB of parameters) into several buckets.
TEST(StrategyTrainer, BucketedEqualsFlatEqualsSingle) {
  const auto data = make_data(8, hierpar::testing::rng()());
  const uint64_t init = hierpar::testing::rng()();
  const auto single = train(hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CPU, {}), false, data, init);
  expect_trained(single[0], init, false);
  auto bucketed = test_options();
  bucketed.averaging.first_bucket_cap_bytes = 64;
  bucketed.averaging.bucket_cap_bytes = 2048;
  auto flat = test_options();
  flat.averaging.bucket_cap_bytes = 0;
  std::vector<const char*> reductions{"host"};
  if (hs::gloo_available()) reductions.push_back("nccl");
  for (const char* reduce : reductions) {
    for (const auto& [scheme, devices] : std::vector<std::pair<std::string, int64_t>>{{"data", 2}, {"data", 4}, {"hierarchical", 4}}) {
      for (bool bn : {false, true}) {
        const auto placement = hs::Placement::from_flags(scheme, devices, reduce, c10::DeviceType::CPU, {});
        const std::string what = placement.to_string() + (bn ? ", BatchNorm" : "");
        const auto with_buckets = train(placement, bn, data, init, 0, -1, bucketed);
        const auto with_flat = train(placement, bn, data, init, 0, -1, flat);
        const auto default_caps = train(placement, bn, data, init);  // 1 MB / 25 MB: one bucket per network here
        if (devices == 2 || std::string(reduce) == "host") {
          // Host sums add the replicas in replica order whichever way the buffers are cut; two replicas' a + b is the
          // same float either way round.
          expect_states_equal(with_buckets[0], with_flat[0], what + ": bucketed vs flat");
        } else {
          // Gloo's ring cuts a buffer into chunks by its size, so the summation order of 4 values may differ. Through
          // BatchNorm over 2 samples per replica the weight gradients before it nearly cancel, and Adam's normalised
          // update turns their rounding into up to O(lr) moves (seen: 79 of 768 elements, at most 1.9e-4, seed
          // 549372042); the exact comparisons above and bucketed vs single keep the averaging itself checked.
          expect_states_close(with_buckets[0], with_flat[0], bn ? Tolerance{1e-5, 5e-4} : kSplitBatchTolerance,
                              what + ": bucketed vs flat");
        }
        expect_states_close(default_caps[0], with_flat[0], kSplitBatchTolerance, what + ": default caps vs flat");
        for (size_t r = 1; r < with_buckets.size(); ++r) {
          expect_states_equal(with_buckets[r], with_buckets[0], what + ": bucketed replica " + std::to_string(r));
        }
        if (!bn) expect_states_close(with_buckets[0], single[0], kSplitBatchTolerance, what + ": bucketed vs single");
      }
    }
  }
}

// The buckets' sums really run during the backward, host and Gloo: replica 1 completes its average() (which
// needs replica 0's part of every bucket) while replica 0 has finished its backward but not yet called
// average(). Without hooks starting them, replica 1 would wait for replica 0's average() and replica 0
// would give up waiting for replica 1 below.
class StrategyAveragingBuckets : public ::testing::TestWithParam<const char*> {};

TEST_P(StrategyAveragingBuckets, AreSummedDuringTheBackward) {
  if (std::string(GetParam()) == "nccl") HIERPAR_REQUIRE_GLOO();
  const auto placement = hs::Placement::from_flags("data", 2, GetParam(), c10::DeviceType::CPU, {});
  hs::AveragingOptions options;
  options.timeout = std::chrono::seconds(20);
  options.first_bucket_cap_bytes = 64;
  options.bucket_cap_bytes = 512;
  auto averager = hs::make_averager(placement, options);
  std::vector<TinyNet> nets;
  std::vector<torch::Tensor> inputs;
  for (int64_t i = 0; i < 2; ++i) {
    torch::manual_seed(7);
    nets.push_back(tiny_discriminator(false));
    inputs.push_back(torch::rand({4, 3, 8, 8}) * (i + 1));
  }
  std::mutex mutex;
  std::condition_variable changed;
  bool replica1_averaged = false;
  bool replica0_saw_it = false;
  std::vector<std::vector<torch::Tensor>> grads(2);
  auto replica = [&](int64_t i) {
    averager->connect(i);
    const auto parameters = nets[i]->parameters();
    averager->attach(i, hs::Network::discriminator, parameters);
    nets[i]->forward(inputs[i]).square().mean().backward();
    for (const auto& p : parameters) grads[i].push_back(p.grad());
    if (i == 0) {
      std::unique_lock<std::mutex> lock(mutex);
      replica0_saw_it = changed.wait_for(lock, std::chrono::seconds(10), [&] { return replica1_averaged; });
    }
    averager->average(i, hs::Network::discriminator, grads[i]);
    if (i == 1) {
      std::lock_guard<std::mutex> lock(mutex);
      replica1_averaged = true;
      changed.notify_all();
    }
  };
  std::vector<torch::Tensor> expected;  // the mean of the two replicas' gradients, computed apart
  {
    torch::manual_seed(7);
    auto net = tiny_discriminator(false);
    std::vector<torch::Tensor> sums;
    for (int64_t i = 0; i < 2; ++i) {
      net->zero_grad();
      net->forward(inputs[i]).square().mean().backward();
      const auto params = net->parameters();
      for (size_t j = 0; j < params.size(); ++j) {
        if (i == 0) sums.push_back(params[j].grad().clone()); else sums[j].add_(params[j].grad()).div_(2);
      }
    }
    expected = sums;
  }
  std::thread other(replica, 1);
  replica(0);
  other.join();
  EXPECT_TRUE(replica0_saw_it) << "replica 1's average() waited for replica 0's: the buckets were not all-reduced "
                                  "during the backward";
  for (int64_t i = 0; i < 2; ++i) {
    expect_states_equal(grads[i], expected, "averaged gradients of replica " + std::to_string(i));
  }
  averager.reset();  // removes the hooks: the nets' later backward passes must not call into it
  nets[0]->forward(inputs[0]).sum().backward();
}

INSTANTIATE_TEST_SUITE_P(Reduce, StrategyAveragingBuckets, ::testing::Values("host", "nccl"),
                         [](const ::testing::TestParamInfo<const char*>& info) { return std::string(info.param); });

// Synchronized BatchNorm: data (R = 2, 4) and hierarchical (R = 2) on split batches end where single
// ends on the whole batch -- parameters and running statistics -- with both layer sets and both
// reductions (fp32 tolerance as for the split batch without BatchNorm: the per-channel statistics are
// sums of the same terms in another order). Without sync the same runs are far from single (checked in
// DataWithBatchNormMatchesPerPartReference), and here too, so that the comparison can fail.
TEST(StrategyTrainer, SyncBatchNormMatchesSingleOnTheWholeBatch) {
  const auto data = make_data(8, hierpar::testing::rng()());
  const uint64_t init = hierpar::testing::rng()();
  auto sync = test_options();
  sync.sync_batch_norm = true;
  for (auto layers : {hierpar::LayerSet::stock, hierpar::LayerSet::hierpar}) {
    const std::string set = layers == hierpar::LayerSet::stock ? "stock" : "hierpar";
    const auto single = train(hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CPU, {}), true, data,
                              init, 0, -1, test_options(), layers, /*with_buffers=*/true);
    std::vector<std::tuple<std::string, int64_t, std::string>> runs{{"data", 2, "host"}, {"hierarchical", 4, "host"}};
    if (hs::gloo_available()) {
      runs.emplace_back("data", 2, "nccl");
      runs.emplace_back("data", 4, "nccl");
      runs.emplace_back("hierarchical", 4, "nccl");
    }
    for (const auto& [scheme, devices, reduce] : runs) {
      const auto placement = hs::Placement::from_flags(scheme, devices, reduce, c10::DeviceType::CPU, {});
      const std::string what = set + " layers, " + placement.to_string();
      const auto replicas = train(placement, true, data, init, 0, -1, sync, layers, true);
      expect_states_close(replicas[0], single[0], kSyncBatchNormTolerance, what + ": sync BN vs single");
      for (size_t r = 1; r < replicas.size(); ++r) {
        expect_states_equal(replicas[r], replicas[0], what + ": replica " + std::to_string(r));
      }
    }
    const auto unsynced = train(hs::Placement::from_flags("data", 2, "host", c10::DeviceType::CPU, {}), true, data,
                                init, 0, -1, test_options(), layers, true);
    double largest = 0;
    for (size_t i = 0; i < single[0].size(); ++i) {
      largest = std::max(largest, (single[0][i] - unsynced[0][i]).abs().max().item<double>());
    }
    EXPECT_GT(largest, 1e-4) << set << ": per-replica BatchNorm should differ from whole-batch BatchNorm";
  }
}

TEST(StrategyTrainer, RejectsUnevenBatchAndBadNoise) {
  const auto data = make_data(8, hierpar::testing::rng()());
  torch::manual_seed(1);
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(tiny_generator(false)), torch::nn::AnyModule(tiny_discriminator(false)),
                                 hs::Placement::from_flags("data", 2, "host", c10::DeviceType::CPU, {}), test_options());
  HIERPAR_EXPECT_THROW_MSG(trainer.step(data.real[0].narrow(0, 0, 7)), "does not split evenly over the 2 replicas");
  HIERPAR_EXPECT_THROW_MSG(trainer.step(data.real[0], data.noise[0].narrow(0, 0, 4)), "noise must have the batch size");
  // Noise drawn by the trainer (no noise given) still trains.
  auto losses = trainer.step(data.real[0]);
  EXPECT_EQ(losses.discriminator.size(), 2u);
  EXPECT_TRUE(std::isfinite(losses.mean().first));
}

namespace {

// The reductions this build can run on the CPU: host, and collective where it has Gloo.
std::vector<const char*> cpu_reductions() {
  return hs::gloo_available() ? std::vector<const char*>{"host", "nccl"} : std::vector<const char*>{"host"};
}

// The tiny pair with BatchNorm as two data-parallel replicas (threads) on the CPU.
std::unique_ptr<hs::AdversarialTrainer> two_cpu_replicas(const char* reduce, const hs::AdversarialOptions& options) {
  torch::manual_seed(1);
  return std::make_unique<hs::AdversarialTrainer>(torch::nn::AnyModule(tiny_generator(true)),
                                                  torch::nn::AnyModule(tiny_discriminator(true)),
                                                  hs::Placement::from_flags("data", 2, reduce, c10::DeviceType::CPU, {}),
                                                  options);
}

}  // namespace

// Trainers built one after another on a ProcessGroupCache (as the batch-size search's trials are) reuse the first
// one's process groups and train exactly as with their own; a trainer whose replica fails gives none back, and a
// cache refuses another placement's trainer.
TEST(StrategyTrainer, ProcessGroupCacheServesTheNextTrainer) {
  HIERPAR_REQUIRE_GLOO();
  const auto data = make_data(8, hierpar::testing::rng()());
  const uint64_t init = hierpar::testing::rng()();
  const hs::Placement data2 = hs::Placement::from_flags("data", 2, "nccl", c10::DeviceType::CPU, {});
  auto cached = test_options();
  cached.averaging.process_groups = std::make_shared<hs::ProcessGroupCache>();
  const auto own = train(data2, true, data, init);
  const auto first = train(data2, true, data, init, 0, -1, cached);
  EXPECT_EQ(cached.averaging.process_groups->size(), 4u) << "G's and D's group of each of the 2 replicas";
  const auto second = train(data2, true, data, init, 0, -1, cached);
  EXPECT_EQ(cached.averaging.process_groups->size(), 4u);
  expect_states_equal(first[0], own[0], "first trainer on the cache vs its own groups");
  expect_states_equal(second[0], own[0], "second trainer, on the first's groups");
  expect_states_equal(second[1], own[1], "second trainer's replica 1");

  const auto main_thread = std::this_thread::get_id();
  auto failing = cached;
  failing.loss = [main_thread](const torch::Tensor& logits, hs::LossTerm term) {
    TORCH_CHECK(std::this_thread::get_id() == main_thread, "injected failure in replica 1's loss");
    return hs::bce_with_logits_loss(logits, term);
  };
  {
    auto trainer = two_cpu_replicas("nccl", failing);
    EXPECT_EQ(cached.averaging.process_groups->size(), 0u) << "the trainer holds them";
    testing::internal::CaptureStderr();
    EXPECT_THROW(trainer->step(data.real[0], data.noise[0]), c10::Error);
    testing::internal::GetCapturedStderr();
  }
  EXPECT_EQ(cached.averaging.process_groups->size(), 0u) << "an aborted trainer gives its groups back";
  const auto after_failure = train(data2, true, data, init, 0, -1, cached);
  expect_states_equal(after_failure[0], own[0], "a trainer after the failed one, on new groups");

  auto elsewhere = cached;
  elsewhere.averaging.process_groups = std::make_shared<hs::ProcessGroupCache>();
  (void)train(hs::Placement::from_flags("data", 2, "nccl", c10::DeviceType::CPU, {}), false, data, init, 0, -1,
              elsewhere);
  testing::internal::CaptureStderr();  // each replica says why it stopped
  HIERPAR_EXPECT_THROW_MSG(train(hs::Placement::from_flags("hierarchical", 4, "nccl", c10::DeviceType::CPU, {}), false,
                                 data, init, 0, -1, elsewhere),
                           "ProcessGroupCache: holds the groups of placement");
  testing::internal::GetCapturedStderr();
}

// A replica that throws (here: its loss) makes the other replicas of its process stop at once (well within the
// averaging timeout of 60 s) with an error naming it, under both reductions. The error is the replica's own (not
// a PeerFailure), and the trainer refuses every later step with that cause.
TEST(StrategyTrainer, FailingReplicaStopsItsPeersAndTheTrainerRefusesLaterSteps) {
  const auto data = make_data(8, hierpar::testing::rng()());
  const auto main_thread = std::this_thread::get_id();
  for (const char* reduce : cpu_reductions()) {
    auto options = test_options(std::chrono::seconds(60));
    options.loss = [main_thread](const torch::Tensor& logits, hs::LossTerm term) {
      TORCH_CHECK(std::this_thread::get_id() == main_thread, "injected failure in replica 1's loss");
      return hs::bce_with_logits_loss(logits, term);
    };
    auto trainer_owner = two_cpu_replicas(reduce, options);
    hs::AdversarialTrainer& trainer = *trainer_owner;
    const auto start = Clock::now();
    testing::internal::CaptureStderr();
    std::string message;
    bool peer_failure = false;
    try {
      trainer.step(data.real[0], data.noise[0]);
      ADD_FAILURE() << reduce << ": the step should have failed";
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
      peer_failure = dynamic_cast<const hs::PeerFailure*>(&e) != nullptr;
    }
    const std::string said = testing::internal::GetCapturedStderr();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    EXPECT_NE(message.find("injected failure in replica 1's loss"), std::string::npos) << reduce << ": " << message;
    EXPECT_LT(seconds, 5.0) << reduce << ": the failure took " << seconds << " s to stop the step";
    EXPECT_FALSE(peer_failure) << reduce << ": the replica's own error is not a peer's";
    // The cause is said when it happens (a collective library's watchdog may end the process before the step
    // rethrows it).
    EXPECT_NE(said.find("replica 1 (G cpu, D cpu) failed: injected failure in replica 1's loss"), std::string::npos)
        << reduce << ": stderr was:\n" << said;
    HIERPAR_EXPECT_THROW_MSG(trainer.step(data.real[1], data.noise[1]),
                             "an earlier step failed, so this trainer refuses every later one");
    HIERPAR_EXPECT_THROW_MSG(trainer.step(data.real[1], data.noise[1]), "injected failure in replica 1's loss");
  }
}

// A replica that runs out of device memory makes the step throw c10::OutOfMemoryError (with the replica named), as
// a single network's step would, so that a caller can retry at a smaller batch (the batch-size search does).
TEST(StrategyTrainer, ReplicaOutOfMemoryIsRethrownAsOutOfMemory) {
  const auto data = make_data(8, hierpar::testing::rng()());
  const auto main_thread = std::this_thread::get_id();
  auto options = test_options(std::chrono::seconds(60));
  options.report_failures = false;
  options.loss = [main_thread](const torch::Tensor& logits, hs::LossTerm term) {
    TORCH_CHECK_WITH(OutOfMemoryError, std::this_thread::get_id() == main_thread, "injected: out of memory");
    return hs::bce_with_logits_loss(logits, term);
  };
  auto trainer = two_cpu_replicas("host", options);
  try {
    trainer->step(data.real[0], data.noise[0]);
    ADD_FAILURE() << "the step should have failed";
  } catch (const c10::OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("replica 1 (G cpu, D cpu) failed: injected: out of memory"),
              std::string::npos)
        << e.what_without_backtrace();
  } catch (const c10::Error& e) {
    ADD_FAILURE() << "expected c10::OutOfMemoryError, got another error: " << e.what_without_backtrace();
  }
}

namespace {

// A fault hook that blocks replica 1 at step `step` until released: a replica that hangs.
class HangingReplica {
 public:
  // Two CPU replicas averaging with `reduce` and giving up on a peer after `timeout`; replica 1 hangs in step `step`
  // until release() (or the destructor, which releases it before destroying the trainer).
  HangingReplica(const char* reduce, int64_t step, std::chrono::milliseconds timeout) : step_(step) {
    auto options = test_options(timeout);
    options.fault_hook = [this](int64_t replica, int64_t at_step) {
      if (replica != 1 || at_step != step_) return;
      std::unique_lock<std::mutex> lock(mutex_);
      released_.wait(lock, [&] { return release_; });
    };
    trainer_ = two_cpu_replicas(reduce, options);
  }
  ~HangingReplica() {
    release();
    trainer_.reset();
  }
  hs::AdversarialTrainer& trainer() { return *trainer_; }
  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    release_ = true;
    released_.notify_all();
  }

 private:
  const int64_t step_;
  std::mutex mutex_;
  std::condition_variable released_;
  bool release_ = false;
  std::unique_ptr<hs::AdversarialTrainer> trainer_;
};

}  // namespace

// A replica that hangs is named once its peers give up waiting for it (the averaging timeout, 1 s here) and the
// trainer's grace for a replica to return has passed (3 s), under both reductions: the step never waits longer.
// The trainer then refuses later steps; once the hung thread returns, it is destroyed normally.
TEST(StrategyTrainer, HungReplicaIsNamedAfterTheTimeout) {
  const auto data = make_data(8, hierpar::testing::rng()());
  for (const char* reduce : cpu_reductions()) {
    HangingReplica hang(reduce, /*step=*/1, std::chrono::seconds(1));
    hs::AdversarialTrainer& trainer = hang.trainer();
    trainer.step(data.real[0], data.noise[0]);
    const auto start = Clock::now();
    HIERPAR_EXPECT_THROW_MSG(trainer.step(data.real[1], data.noise[1]),
                             "replica 1 (G cpu, D cpu) hangs: the other replicas stopped waiting for it");
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    EXPECT_GT(seconds, 0.9) << reduce << ": the peers give up after the 1 s timeout, not before";
    EXPECT_LT(seconds, 10.0) << reduce << ": 1 s timeout + 3 s grace took " << seconds << " s";
    HIERPAR_EXPECT_THROW_MSG(trainer.step(data.real[2], data.noise[2]), "refuses every later one");
    hang.release();
  }
}

// abort() from another thread -- what a RunGuard does when another process failed -- ends a step whose replicas
// wait on a peer (replica 1, held in its fault hook until then) with a PeerFailure naming the reason, long before
// the averaging timeout (60 s); the trainer refuses later steps with that reason.
TEST(StrategyTrainer, AbortEndsAStepWaitingOnPeersWithTheReason) {
  const auto data = make_data(8, hierpar::testing::rng()());
  for (const char* reduce : cpu_reductions()) {
    HangingReplica hang(reduce, /*step=*/0, std::chrono::seconds(60));
    hs::AdversarialTrainer& trainer = hang.trainer();
    std::thread aborter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      trainer.abort("rank 3 failed elsewhere");
      hang.release();
    });
    const auto start = Clock::now();
    std::string message;
    try {
      trainer.step(data.real[0], data.noise[0]);
      ADD_FAILURE() << reduce << ": the step should have stopped";
    } catch (const hs::PeerFailure& e) {
      message = e.what_without_backtrace();
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    aborter.join();
    EXPECT_NE(message.find("rank 3 failed elsewhere"), std::string::npos) << reduce << ": " << message;
    EXPECT_LT(seconds, 5.0) << reduce << ": the abort took " << seconds << " s to end the step";
    EXPECT_GT(trainer.progress(), 0) << reduce << ": replica 0 entered collectives";
    HIERPAR_EXPECT_THROW_MSG(trainer.step(data.real[1], data.noise[1]), "rank 3 failed elsewhere");
  }
}

// ---- the pipelined schedule (CPU) ------------------------------------------------------------------

namespace {
// Parameters, then floating-point buffers, of G then D.
std::vector<torch::Tensor> parameters_and_buffers(torch::nn::Module& g, torch::nn::Module& d) {
  std::vector<torch::Tensor> state;
  for (torch::nn::Module* module : {&g, &d}) {
    for (const auto& p : module->parameters()) state.push_back(p.detach().cpu().clone());
  }
  for (torch::nn::Module* module : {&g, &d}) {
    for (const auto& b : module->buffers()) {
      if (b.is_floating_point()) state.push_back(b.detach().cpu().clone());
    }
  }
  return state;
}

// kSteps of the trainer with options.schedule = pipelined (noise drawn by the trainer), every local replica's state.
std::vector<std::vector<torch::Tensor>> train_pipelined(const hs::Placement& placement, bool batch_norm,
                                                        const Data& data, uint64_t init_seed) {
  const c10::Device data_device = placement.replicas[0].discriminator;
  torch::manual_seed(init_seed);
  auto g = tiny_generator(batch_norm);
  auto d = tiny_discriminator(batch_norm);
  auto options = test_options();
  options.schedule = hs::Schedule::pipelined;
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, options);
  for (int64_t k = 0; k < kSteps; ++k) trainer.step(data.real[k].to(data_device));
  std::vector<std::vector<torch::Tensor>> states;
  for (int64_t i = 0; i < placement.local_replicas(); ++i) {
    states.push_back(parameters_and_buffers(*trainer.generator(i).ptr(), *trainer.discriminator(i).ptr()));
  }
  return states;
}

// The pipelined algorithm written out on one device, in the trainer's order of operations: step k's D update on the
// fakes of step k; G's loss through the updated D; G's forward for step k + 1 on copy (k + 1) % 2 of G, loaded with
// G's weights before step k's update; G's backward through the copy that made step k's fakes, its gradients applied
// to G by G's Adam. Each forward's BatchNorm statistics become G's.
std::vector<torch::Tensor> pipelined_by_hand(bool batch_norm, const Data& data, uint64_t init_seed) {
  torch::manual_seed(init_seed);
  auto g = tiny_generator(batch_norm);
  auto d = tiny_discriminator(batch_norm);
  // Copies of G that leave the CPU generator as they found it (as the trainer's), so the noise draws line up.
  auto cpu_generator = at::detail::getDefaultCPUGenerator();
  const torch::Tensor rng_state = cpu_generator.get_state();
  std::array<TinyNet, 2> copies{std::dynamic_pointer_cast<TinyNetImpl>(g->clone()),
                                std::dynamic_pointer_cast<TinyNetImpl>(g->clone())};
  cpu_generator.set_state(rng_state);
  const auto options = test_options();
  auto adam = [](const std::vector<torch::Tensor>& params, const hs::AdamSettings& s) {
    return torch::optim::Adam(params, torch::optim::AdamOptions(s.lr).betas({s.beta1, s.beta2}).eps(s.eps));
  };
  auto g_opt = adam(g->parameters(), options.generator_adam);
  auto d_opt = adam(d->parameters(), options.discriminator_adam);
  auto forward_on_copy = [&](int c) {
    const auto load = [](const std::vector<torch::Tensor>& from, const std::vector<torch::Tensor>& into) {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < from.size(); ++i) into[i].copy_(from[i]);
    };
    load(g->parameters(), copies[c]->parameters());
    load(g->buffers(), copies[c]->buffers());
    const torch::Tensor fake = copies[c]->forward(torch::randn({data.real.size(1), kNoise, 1, 1}));
    load(copies[c]->buffers(), g->buffers());
    return fake;
  };
  int fake_copy = 0;
  torch::Tensor fake = forward_on_copy(0);
  for (int64_t k = 0; k < kSteps; ++k) {
    if (k > 0) fake_copy = 1 - fake_copy;
    d_opt.zero_grad();
    hs::bce_with_logits_loss(d->forward(data.real[k]), hs::LossTerm::real).backward();
    const torch::Tensor fake_on_d = fake.detach();
    hs::bce_with_logits_loss(d->forward(fake_on_d.detach()), hs::LossTerm::fake).backward();
    d_opt.step();
    fake_on_d.requires_grad_(true);
    for (auto& p : d->parameters()) p.requires_grad_(false);
    hs::bce_with_logits_loss(d->forward(fake_on_d), hs::LossTerm::generator).backward();
    for (auto& p : d->parameters()) p.requires_grad_(true);
    const torch::Tensor ahead = forward_on_copy(1 - fake_copy);
    g_opt.zero_grad();
    const auto copy_parameters = copies[fake_copy]->parameters();
    for (const auto& p : copy_parameters) p.mutable_grad() = torch::Tensor();
    torch::autograd::backward({fake}, {fake_on_d.grad()});
    const auto g_parameters = g->parameters();
    for (size_t i = 0; i < g_parameters.size(); ++i) g_parameters[i].mutable_grad() = copy_parameters[i].grad();
    g_opt.step();
    fake = ahead;
  }
  return parameters_and_buffers(*g, *d);
}
}  // namespace

// options.schedule = pipelined against its algorithm written out by hand (above), bit for bit on one CPU device, with
// and without BatchNorm; task (G and D on two devices) equals it too, and data on two replicas within the split-batch
// tolerance without BatchNorm. It is another algorithm than the recipe: the exact schedule's parameters differ.
TEST(StrategyTrainer, PipelinedScheduleEqualsItsAlgorithmByHand) {
  const auto data = make_data(8, hierpar::testing::rng()());
  const uint64_t init = hierpar::testing::rng()();
  const auto on = [](const char* scheme, int64_t devices) {
    return hs::Placement::from_flags(scheme, devices, "host", c10::DeviceType::CPU, {});
  };
  for (bool bn : {false, true}) {
    const std::string with = bn ? ", BatchNorm" : "";
    const auto by_hand = pipelined_by_hand(bn, data, init);
    const auto single = train_pipelined(on("single", 1), bn, data, init);
    expect_states_equal(single[0], by_hand, "pipelined single vs by hand" + with);
    const auto task = train_pipelined(on("task", 2), bn, data, init);
    expect_states_equal(task[0], by_hand, "pipelined task vs by hand" + with);
    // The comparison can fail: the exact schedule, same data and noise draws, ends elsewhere.
    torch::manual_seed(init);
    auto g = tiny_generator(bn);
    auto d = tiny_discriminator(bn);
    hs::AdversarialTrainer exact(torch::nn::AnyModule(g), torch::nn::AnyModule(d), on("single", 1), test_options());
    for (int64_t k = 0; k < kSteps; ++k) exact.step(data.real[k]);
    const auto exact_state = parameters_and_buffers(*exact.generator(0).ptr(), *exact.discriminator(0).ptr());
    double largest = 0;
    for (size_t i = 0; i < by_hand.size(); ++i) {
      largest = std::max(largest, (exact_state[i] - by_hand[i]).abs().max().item<double>());
    }
    EXPECT_GT(largest, 1e-6) << "pipelined and exact schedules should differ" << with;
  }
  const auto single = train_pipelined(on("single", 1), false, data, init);
  const auto replicas = train_pipelined(on("data", 2), false, data, init);
  expect_states_close(replicas[0], single[0], kSplitBatchTolerance, "pipelined data R=2 vs single");
  expect_states_equal(replicas[1], replicas[0], "pipelined data: replica 1 vs 0");
}

// The pipelined schedule draws its own noise: a step given noise is refused with the reason.
TEST(StrategyTrainer, PipelinedScheduleRefusesGivenNoise) {
  const auto data = make_data(4, hierpar::testing::rng()());
  auto options = test_options();
  options.schedule = hs::Schedule::pipelined;
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(tiny_generator(false)),
                                 torch::nn::AnyModule(tiny_discriminator(false)),
                                 hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CPU, {}), options);
  HIERPAR_EXPECT_THROW_MSG(trainer.step(data.real[0], data.noise[0]), "the pipelined schedule draws G's noise itself");
  EXPECT_EQ(hs::to_string(hs::parse_schedule("pipelined")), std::string("pipelined"));
  HIERPAR_EXPECT_THROW_MSG(hs::parse_schedule("ahead"), "--schedule must be exact or pipelined; got \"ahead\"");
}

// ---- CUDA ------------------------------------------------------------------------------------------


TEST(StrategyTrainerCuda, TaskEqualsSingleExactly) {
  HIERPAR_REQUIRE_GPUS(2);
  const auto cudnn = deterministic_cudnn();
  expect_task_equals_single(c10::DeviceType::CUDA, 16);
}

// The pipelined schedule on two GPUs, where the next step's fakes are copied to D's device as G makes them (and the
// step's own copy is skipped), equals it on one GPU bit for bit, with and without BatchNorm.
TEST(StrategyTrainerCuda, PipelinedTaskEqualsPipelinedSingle) {
  HIERPAR_REQUIRE_GPUS(2);
  const auto cudnn = deterministic_cudnn();
  const auto data = make_data(16, hierpar::testing::rng()());
  const uint64_t init = hierpar::testing::rng()();
  for (bool bn : {false, true}) {
    const auto single = train_pipelined(hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CUDA, {}), bn,
                                        data, init);
    const auto task = train_pipelined(hs::Placement::from_flags("task", 2, "host", c10::DeviceType::CUDA, {}), bn,
                                      data, init);
    expect_states_equal(task[0], single[0],
                        std::string("pipelined task vs single on GPUs") + (bn ? ", BatchNorm" : ""));
  }
}

// The replicas' threads run on the caller's current streams: a batch that the caller's own stream writes late (it
// waits 25 ms on the GPU first) is what replica 1 copies to its GPU, so the step trains as on a batch already there.
// (On their devices' default streams, replica 1 copied the buffer before the write.)
TEST(StrategyTrainerCuda, ReplicasRunOnTheCallersStreams) {
  HIERPAR_REQUIRE_GPUS(2);
  const auto cudnn = deterministic_cudnn();
  const auto data = make_data(8, hierpar::testing::rng()());
  const uint64_t init = hierpar::testing::rng()();
  const torch::Device gpu0(torch::kCUDA, 0);
  const torch::Tensor reals = data.real.to(gpu0);
  auto train_on_a_stream = [&](bool late) {
    torch::manual_seed(init);
    auto g = tiny_generator(false);
    auto d = tiny_discriminator(false);
    hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d),
                                   hs::Placement::from_flags("data", 2, "host", c10::DeviceType::CUDA, {}), test_options());
    const c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool(false, gpu0.index());
    const c10::cuda::CUDAStreamGuard on_stream(stream);
    for (int64_t k = 0; k < kSteps; ++k) {
      torch::Tensor batch = torch::empty_like(reals[k]);
      if (late) at::cuda::sleep(50'000'000);
      batch.copy_(reals[k], /*non_blocking=*/true);
      trainer.step(batch, data.noise[k]);
    }
    torch::cuda::synchronize();
    return state_of(trainer, 0);
  };
  expect_states_equal(train_on_a_stream(true), train_on_a_stream(false),
                      "batches written late on the caller's stream vs ready");
}

TEST(StrategyTrainerCuda, HostEqualsNcclAndBothMatchSingle) {
  HIERPAR_REQUIRE_GPUS(2);
  const auto cudnn = deterministic_cudnn();
  const auto data = make_data(16, hierpar::testing::rng()());
  const uint64_t init = hierpar::testing::rng()();
  const auto single = train(hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CUDA, {}), false, data, init);
  const auto host = train(hs::Placement::from_flags("data", 2, "host", c10::DeviceType::CUDA, {}), false, data, init);
  const auto nccl = train(hs::Placement::from_flags("data", 2, "nccl", c10::DeviceType::CUDA, {}), false, data, init);
  expect_states_equal(nccl[0], host[0], "NCCL vs host averaging");
  expect_states_equal(nccl[1], nccl[0], "NCCL replica 1 vs replica 0");
  // cuDNN's TF32 convolutions (on by default) make this looser than the CPU's split-batch tolerance.
  const Tolerance tf32 = hierpar::testing::tolerance_for(torch::kFloat32);
  expect_states_close(host[0], single[0], {std::max(tf32.rtol, 2e-3), std::max(tf32.atol, 1e-5)}, "data vs single on GPUs");
}

// NCCL: bucketed (all-reduced during the backward, several buckets) == flat bit for bit for two
// replicas; synchronized BatchNorm on 2 GPUs == single on the whole batch (TF32 tolerance, as above).
TEST(StrategyTrainerCuda, BucketedEqualsFlatAndSyncBatchNormMatchesSingle) {
  HIERPAR_REQUIRE_GPUS(2);
  const auto cudnn = deterministic_cudnn();
  const auto data = make_data(16, hierpar::testing::rng()());
  const uint64_t init = hierpar::testing::rng()();
  const auto placement = hs::Placement::from_flags("data", 2, "nccl", c10::DeviceType::CUDA, {});
  auto bucketed = test_options();
  bucketed.averaging.first_bucket_cap_bytes = 64;
  bucketed.averaging.bucket_cap_bytes = 2048;
  auto flat = test_options();
  flat.averaging.bucket_cap_bytes = 0;
  for (bool bn : {false, true}) {
    const auto with_buckets = train(placement, bn, data, init, 0, -1, bucketed);
    const auto with_flat = train(placement, bn, data, init, 0, -1, flat);
    expect_states_equal(with_buckets[0], with_flat[0], bn ? "NCCL bucketed vs flat, BatchNorm" : "NCCL bucketed vs flat");
    expect_states_equal(with_buckets[1], with_buckets[0], "NCCL bucketed replica 1 vs 0");
  }
  auto sync = bucketed;
  sync.sync_batch_norm = true;
  const auto single = train(hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CUDA, {}), true, data, init,
                            0, -1, test_options(), hierpar::LayerSet::stock, /*with_buffers=*/true);
  const auto synced = train(placement, true, data, init, 0, -1, sync, hierpar::LayerSet::stock, true);
  const Tolerance tf32 = hierpar::testing::tolerance_for(torch::kFloat32);
  expect_states_close(synced[0], single[0], {std::max(tf32.rtol, 2e-3), std::max(tf32.atol, 1e-5)},
                      "NCCL sync BN vs single on GPUs");
  expect_states_equal(synced[1], synced[0], "NCCL sync BN replica 1 vs 0");
}

// Against the CPU's float32 reference the GPUs compute float32 too (the trainer's default precision): with cuDNN's
// TF32 convolutions, ATen's default, single weights ended 1% off after the test's Adam steps.
TEST(StrategyTrainerCuda, HierarchicalMatchesPerPartReference) {
  HIERPAR_REQUIRE_GPUS(4);
  const auto cudnn = deterministic_cudnn();
  const auto data = make_data(16, hierpar::testing::rng()());
  const uint64_t init = hierpar::testing::rng()();
  const auto reference = reference_per_part(true, data, 2, init);  // on the CPU, in fp32
  for (const char* reduce : {"host", "nccl"}) {
    const auto replicas = train(hs::Placement::from_flags("hierarchical", 4, reduce, c10::DeviceType::CUDA, {}), true, data, init);
    expect_states_close(replicas[0], reference, {2e-3, 1e-5}, std::string("hierarchical R=2 (GPU) vs CPU per-part reference, ") + reduce);
    expect_states_equal(replicas[1], replicas[0], std::string("hierarchical replica 1 vs 0, ") + reduce);
  }
}
