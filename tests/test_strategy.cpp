// The adversarial training strategy: every scheme's parameters after K steps against single-device references, on
// tiny conv G/D pairs of our own (with and without BatchNorm). Placements and losses: test_placement.cpp,
// test_losses.cpp.
// CPU tests run everywhere (replicas as threads on "cpu" devices, Gloo for the collective path, two
// ranks as two processes of this binary); CUDA versions skip with a reason when GPUs are missing.
#include "testing.h"

#include "child_processes.h"
#include "hierpar/strategy/adversarial_trainer.h"
#include "hierpar/strategy/averaging.h"
#include "hierpar/strategy/placement.h"
#include "hierpar/strategy/precision.h"
#include "hierpar/models/layer_factory.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <tuple>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

namespace hs = hierpar::strategy;
using hierpar::testing::Tolerance;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kNoise = 8;  // noise channels of the tiny generator
constexpr int64_t kSteps = 3;

// G: noise [B, 8, 1, 1] -> [B, 3, 8, 8]; D: [B, 3, 8, 8] -> logits [B, 1, 1, 1]. The BatchNorm comes from
// the models' layer factory (stock torch::nn::BatchNorm2d or hierpar::nn::BatchNormAct2d, the activation
// fused there), so that synchronized BatchNorm is tested on the layers the models use.
// AnyModule needs a non-templated forward (Sequential's is templated) and replicas need Cloneable.
struct TinyNetImpl : torch::nn::Cloneable<TinyNetImpl> {
  TinyNetImpl(bool generator, bool batch_norm, hierpar::LayerSet layer_set = hierpar::LayerSet::stock)
      : generator(generator), batch_norm(batch_norm), layer_set(layer_set) {
    reset();
  }
  void reset() override {
    const auto activation = generator ? hierpar::nn::Activation::relu : hierpar::nn::Activation::leaky_relu;
    if (generator) {
      auto c1 = torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(kNoise, 6, 4).bias(false));
      auto c2 = torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(6, 3, 4).stride(2).padding(1).bias(false));
      register_module("conv1", c1);
      first = [c1](const torch::Tensor& x) mutable { return c1->forward(x); };
      if (batch_norm) norm = hierpar::models::make_batch_norm_act2d(layer_set, 6, activation, 0.0);
      if (norm.module) register_module("bn", norm.module);
      register_module("conv2", c2);
      second = [c2](const torch::Tensor& x) mutable { return torch::tanh(c2->forward(x)); };
    } else {
      auto c1 = torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 6, 4).stride(2).padding(1).bias(false));
      auto c2 = torch::nn::Conv2d(torch::nn::Conv2dOptions(6, 1, 4).bias(false));
      register_module("conv1", c1);
      first = [c1](const torch::Tensor& x) mutable { return c1->forward(x); };
      if (batch_norm) norm = hierpar::models::make_batch_norm_act2d(layer_set, 6, activation, 0.2);
      if (norm.module) register_module("bn", norm.module);
      register_module("conv2", c2);
      second = [c2](const torch::Tensor& x) mutable { return c2->forward(x); };
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    x = first(x);
    if (batch_norm) return second(norm.forward(x));
    return second(generator ? torch::relu(x) : torch::leaky_relu(x, 0.2));
  }
  bool generator;
  bool batch_norm;
  hierpar::LayerSet layer_set;
  std::function<torch::Tensor(const torch::Tensor&)> first, second;
  hierpar::models::Layer norm;
};
TORCH_MODULE(TinyNet);

TinyNet tiny_generator(bool batch_norm, hierpar::LayerSet layers = hierpar::LayerSet::stock) {
  return TinyNet(true, batch_norm, layers);
}
TinyNet tiny_discriminator(bool batch_norm, hierpar::LayerSet layers = hierpar::LayerSet::stock) {
  return TinyNet(false, batch_norm, layers);
}

struct Data {
  torch::Tensor real;   // [steps, batch, 3, 8, 8] in [-1, 1)
  torch::Tensor noise;  // [steps, batch, 8, 1, 1]
};

Data make_data(int64_t batch, uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::rand({kSteps, batch, 3, 8, 8}) * 2 - 1, torch::randn({kSteps, batch, kNoise, 1, 1})};
}

hs::AdversarialOptions test_options(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  hs::AdversarialOptions options;
  options.noise_shape = {kNoise, 1, 1};
  options.generator_adam.lr = 1e-3;  // larger than DCGAN's 2e-4 so that K steps move the parameters visibly
  options.discriminator_adam.lr = 1e-3;
  options.averaging.timeout = timeout;
  return options;
}

// Parameters then buffers of G, then of D, copied to the CPU.
std::vector<torch::Tensor> state_of(hs::AdversarialTrainer& trainer, int64_t local) {
  std::vector<torch::Tensor> state;
  for (auto* module : {trainer.generator(local).ptr().get(), trainer.discriminator(local).ptr().get()}) {
    for (const auto& p : module->parameters()) state.push_back(p.detach().cpu().clone());
  }
  return state;
}

// Trains the tiny pair under `placement` for kSteps on rows [first, first + rows) of each step's batch;
// returns every local replica's final parameters.
std::vector<std::vector<torch::Tensor>> train(const hs::Placement& placement, bool batch_norm, const Data& data,
                                              uint64_t init_seed, int64_t first = 0, int64_t rows = -1,
                                              const hs::AdversarialOptions& options = test_options(),
                                              hierpar::LayerSet layers = hierpar::LayerSet::stock,
                                              bool with_buffers = false) {
  torch::manual_seed(init_seed);
  auto g = tiny_generator(batch_norm, layers);
  auto d = tiny_discriminator(batch_norm, layers);
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, options);
  if (rows < 0) rows = data.real.size(1);
  for (int64_t k = 0; k < kSteps; ++k) {
    auto losses = trainer.step(data.real[k].narrow(0, first, rows), data.noise[k].narrow(0, first, rows));
    auto [d_loss, g_loss] = losses.mean();
    EXPECT_TRUE(std::isfinite(d_loss) && std::isfinite(g_loss)) << "step " << k;
  }
  std::vector<std::vector<torch::Tensor>> states;
  for (int64_t i = 0; i < placement.local_replicas(); ++i) {
    states.push_back(state_of(trainer, i));
    if (!with_buffers) continue;
    for (auto* module : {trainer.generator(i).ptr().get(), trainer.discriminator(i).ptr().get()}) {
      for (const auto& b : module->buffers()) {
        if (b.is_floating_point()) states.back().push_back(b.detach().cpu().clone());
      }
    }
  }
  return states;
}

void expect_states_equal(const std::vector<torch::Tensor>& actual, const std::vector<torch::Tensor>& expected,
                         const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_TRUE(torch::equal(actual[i], expected[i]))
        << what << ": tensor " << i << " differs by up to " << (actual[i] - expected[i]).abs().max().item<double>();
  }
}

void expect_states_close(const std::vector<torch::Tensor>& actual, const std::vector<torch::Tensor>& expected,
                         Tolerance tolerance, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    hierpar::testing::expect_close(actual[i], expected[i], tolerance, what + ": tensor " + std::to_string(i));
  }
}

// The parameters must have moved: a comparison of untrained parameters would pass for any scheme.
void expect_trained(const std::vector<torch::Tensor>& trained, uint64_t init_seed, bool batch_norm) {
  torch::manual_seed(init_seed);
  auto g = tiny_generator(batch_norm);
  auto d = tiny_discriminator(batch_norm);
  std::vector<torch::Tensor> initial;
  for (const auto& p : g->parameters()) initial.push_back(p.detach());
  for (const auto& p : d->parameters()) initial.push_back(p.detach());
  ASSERT_EQ(trained.size(), initial.size());
  for (size_t i = 0; i < trained.size(); ++i) EXPECT_FALSE(torch::equal(trained[i], initial[i])) << "tensor " << i;
}

// Data parallelism over `parts` equal parts, by hand on one device: each part is its own forward (so
// BatchNorm normalises each part separately), per-part gradients are summed in part order and divided
// by `parts`, then one Adam step -- what the replicas do together, without any strategy code.
std::vector<torch::Tensor> reference_per_part(bool batch_norm, const Data& data, int64_t parts, uint64_t init_seed) {
  torch::manual_seed(init_seed);
  auto g = tiny_generator(batch_norm);
  auto d = tiny_discriminator(batch_norm);
  const auto options = test_options();
  auto adam = [](const std::vector<torch::Tensor>& params, const hs::AdamSettings& s) {
    return torch::optim::Adam(params, torch::optim::AdamOptions(s.lr).betas({s.beta1, s.beta2}).eps(s.eps));
  };
  auto g_opt = adam(g->parameters(), options.generator_adam);
  auto d_opt = adam(d->parameters(), options.discriminator_adam);
  auto averaged_backward = [&](torch::nn::Module& module, const std::function<torch::Tensor(int64_t)>& loss_of_part) {
    const auto params = module.parameters();
    std::vector<torch::Tensor> sums;
    for (int64_t i = 0; i < parts; ++i) {
      module.zero_grad();
      loss_of_part(i).backward();
      for (size_t j = 0; j < params.size(); ++j) {
        const auto grad = params[j].grad().defined() ? params[j].grad().clone() : torch::zeros_like(params[j]);
        if (i == 0) sums.push_back(grad); else sums[j].add_(grad);
      }
    }
    for (size_t j = 0; j < params.size(); ++j) params[j].mutable_grad() = sums[j].div_(parts);
  };
  const int64_t share = data.real.size(1) / parts;
  for (int64_t k = 0; k < kSteps; ++k) {
    std::vector<torch::Tensor> fakes;
    for (int64_t i = 0; i < parts; ++i) fakes.push_back(g->forward(data.noise[k].narrow(0, i * share, share)));
    averaged_backward(*d, [&](int64_t i) {
      return hs::bce_with_logits_loss(d->forward(data.real[k].narrow(0, i * share, share)), hs::LossTerm::real) +
             hs::bce_with_logits_loss(d->forward(fakes[i].detach()), hs::LossTerm::fake);
    });
    d_opt.step();
    averaged_backward(*g, [&](int64_t i) { return hs::bce_with_logits_loss(d->forward(fakes[i]), hs::LossTerm::generator); });
    g_opt.step();
  }
  std::vector<torch::Tensor> state;
  for (const auto& p : g->parameters()) state.push_back(p.detach().clone());
  for (const auto& p : d->parameters()) state.push_back(p.detach().clone());
  return state;
}

// Parameters after kSteps on split batches vs on the whole batch, in fp32: the batch-mean reductions
// (loss mean, conv weight-gradient sums over the batch) are summed in a different order, ~1e-7
// relative to the summed terms. Adam's update lr * m / sqrt(v) carries the relative error of the
// gradient element itself, and an element that is a sum of cancelling terms has a much larger relative
// error than 1e-7 (seen: 5e-7 absolute after 3 steps, seed 2879733906). The absolute tolerance, 1% of
// lr = 1e-3, admits that and stays far below a wrong averaging, which moves parameters by O(lr) a step.
constexpr Tolerance kSplitBatchTolerance{1e-5, 1e-5};

// Synchronized BatchNorm against single on the whole batch: as above, plus the statistics, which come from one
// all-reduce of per-replica moments (var = (sum M2 + sum n m^2) / N - mean^2) instead of single's two-pass
// var_mean, with other rounding. Through the BatchNorm backward and Adam's normalised update, an element whose
// gradient nearly cancels moved by 1.14e-5 (1.1% of lr; G's first weight, seed 2458730771, 1 run in ~30), and by
// 4.5e-5 (one element of 768 in G's first weight, seed 4176273735, in CI). 7e-5 admits both and stays
// below the 1e-4 by which per-replica BatchNorm must differ (the test's last check).
constexpr Tolerance kSyncBatchNormTolerance{1e-5, 7e-5};

#define HIERPAR_REQUIRE_GLOO()                                                                        \
  do {                                                                                                \
    if (!hs::gloo_available()) GTEST_SKIP() << "this build has no Gloo (install libgloo-dev and reconfigure)"; \
  } while (0)

#define HIERPAR_REQUIRE_GPUS(n)                                                                       \
  do {                                                                                                \
    HIERPAR_REQUIRE_CUDA();                                                                           \
    if (static_cast<int64_t>(torch::cuda::device_count()) < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs"; \
  } while (0)

// ---- this test binary as the ranks of a two-process run ---------------------------------------------

using hierpar::testing::Child;
using hierpar::testing::exit_code;
using hierpar::testing::read_text;
using hierpar::testing::remove_dir;
using hierpar::testing::temp_dir;

// Runs ranks 0 and 1 of StrategyWorker.TrainAndSave with `extra` in their environment; waits at most `limit`.
std::vector<Child> run_two_ranks(const std::map<std::string, std::string>& extra, const std::string& dir,
                                 std::chrono::seconds limit) {
  const int port = hierpar::testing::free_port();
  std::vector<Child> children;
  for (int rank = 0; rank < 2; ++rank) {
    auto env = hierpar::testing::launch_environment(rank, 2, port);
    env.insert(extra.begin(), extra.end());
    children.push_back(hierpar::testing::spawn({hierpar::testing::self_executable(), "--gtest_filter=StrategyWorker.TrainAndSave"},
                                               env, dir + "/rank" + std::to_string(rank) + ".log"));
  }
  hierpar::testing::wait_all(children, limit);
  return children;
}

constexpr int64_t kTwoRankBatch = 6;
constexpr int kWorkerStoppedByPeer = 3;  // a worker's exit code when its step failed (after reporting why)

}  // namespace

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
          // Gloo's ring cuts a buffer into chunks by its size, so the summation order of 4 values may differ.
          expect_states_close(with_buckets[0], with_flat[0], kSplitBatchTolerance, what + ": bucketed vs flat");
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
  explicit HangingReplica(int64_t step) : step_(step) {}
  // Two CPU replicas whose replica 1 hangs so, averaging with `reduce` and giving up after `timeout`.
  std::unique_ptr<hs::AdversarialTrainer> trainer(const char* reduce, std::chrono::milliseconds timeout) {
    auto options = test_options(timeout);
    options.fault_hook = [this](int64_t replica, int64_t step) {
      if (replica != 1 || step != step_) return;
      std::unique_lock<std::mutex> lock(mutex_);
      released_.wait(lock, [&] { return release_; });
    };
    return two_cpu_replicas(reduce, options);
  }
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
};

}  // namespace

// A replica that hangs is named once its peers give up waiting for it (the averaging timeout, 1 s here) and the
// trainer's grace for a replica to return has passed (3 s), under both reductions: the step never waits longer.
// The trainer then refuses later steps; once the hung thread returns, it is destroyed normally.
TEST(StrategyTrainer, HungReplicaIsNamedAfterTheTimeout) {
  const auto data = make_data(8, hierpar::testing::rng()());
  for (const char* reduce : cpu_reductions()) {
    HangingReplica hang(1);
    auto trainer_owner = hang.trainer(reduce, std::chrono::seconds(1));
    hs::AdversarialTrainer& trainer = *trainer_owner;
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
    HangingReplica hang(0);
    auto trainer_owner = hang.trainer(reduce, std::chrono::seconds(60));
    hs::AdversarialTrainer& trainer = *trainer_owner;
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

// ---- two ranks as two processes --------------------------------------------------------------------

namespace {
void deterministic_cudnn() {
  at::globalContext().setDeterministicCuDNN(true);
  at::globalContext().setBenchmarkCuDNN(false);
}
}  // namespace

// The worker half of StrategyTwoProcesses.*: one rank of a data placement over WORLD_SIZE processes, with
// HIERPAR_STRATEGY_REPLICAS replicas in all (2: one per process); saves each local replica's parameters.
TEST(StrategyWorker, TrainAndSave) {
  const char* out = std::getenv("HIERPAR_STRATEGY_WORKER_OUT");
  if (out == nullptr) GTEST_SKIP() << "the worker half of StrategyTwoProcesses.*: runs only in the processes they start";
  const auto launch = hs::Launch::from_env();
  const uint64_t data_seed = std::stoull(std::getenv("HIERPAR_STRATEGY_DATA_SEED"));
  const uint64_t init_seed = std::stoull(std::getenv("HIERPAR_STRATEGY_INIT_SEED"));
  const std::string reduce = std::getenv("HIERPAR_STRATEGY_REDUCE");
  const char* fail_rank = std::getenv("HIERPAR_STRATEGY_FAIL_RANK");
  const char* replicas_env = std::getenv("HIERPAR_STRATEGY_REPLICAS");
  const int64_t replicas = replicas_env != nullptr ? std::stoll(replicas_env) : 2;
  const int64_t batch = kTwoRankBatch * replicas / 2;
  const auto data = make_data(batch, data_seed);
  const bool cuda = std::getenv("HIERPAR_STRATEGY_CUDA") != nullptr;  // one GPU per replica (NCCL)
  if (cuda) deterministic_cudnn();
  const auto placement = hs::Placement::make(hs::Scheme::data, replicas, hs::parse_reduce(reduce),
                                             cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU, launch);
  const int64_t share = batch / launch.world_size;
  try {
    torch::manual_seed(init_seed + 1000 * launch.rank);  // different on each rank: the broadcast must fix it
    auto g = tiny_generator(true);  // G first, then D, as train() draws them
    auto d = tiny_discriminator(true);
    auto options = test_options(std::chrono::seconds(3));
    options.sync_batch_norm = std::getenv("HIERPAR_STRATEGY_SYNC_BN") != nullptr;
    hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, options);
    for (int64_t k = 0; k < kSteps; ++k) {
      auto real = data.real[k].narrow(0, launch.rank * share, share);
      if (fail_rank != nullptr && std::stoll(fail_rank) == launch.rank) real = real.narrow(1, 0, 2);  // a bad batch
      trainer.step(real, data.noise[k].narrow(0, launch.rank * share, share));
    }
    for (int64_t i = 0; i < placement.local_replicas(); ++i) {
      torch::save(state_of(trainer, i), c10::str(out, "/rank", launch.rank, "-", i, ".pt"));
    }
  } catch (const c10::Error& e) {
    std::ofstream(std::string(out) + "/error" + std::to_string(launch.rank) + ".txt") << e.what_without_backtrace();
    std::fflush(nullptr);
    std::_Exit(kWorkerStoppedByPeer);
  }
}

namespace {

// Ranks 0 and 1 as two processes (one GPU per replica on CUDA) end with the parameters of the in-process replicas
// of the same placement: `replicas` in all, replicas / 2 in each process; bit for bit unless `exact` is false (host
// averaging then adds each process's replicas first, (a + b) + (c + d), where one process adds ((a + b) + c) + d).
void expect_two_processes_agree_with_in_process_replicas(c10::DeviceType device, const char* reduce, bool sync_bn,
                                                         int64_t replicas = 2, bool exact = true) {
  const uint64_t data_seed = hierpar::testing::rng()() % 1000000;
  const uint64_t init_seed = hierpar::testing::rng()() % 1000000;
  const auto data = make_data(kTwoRankBatch * replicas / 2, data_seed);
  const std::string what = c10::str(reduce, sync_bn ? " sync BN" : "", " on ", c10::DeviceTypeName(device, true), ", ",
                                    replicas, " replicas");
  const std::string dir = temp_dir(c10::str("agree_", reduce, sync_bn ? "_sync" : "", "_", replicas));
  std::map<std::string, std::string> env{{"HIERPAR_STRATEGY_WORKER_OUT", dir},
                                         {"HIERPAR_STRATEGY_DATA_SEED", std::to_string(data_seed)},
                                         {"HIERPAR_STRATEGY_INIT_SEED", std::to_string(init_seed)},
                                         {"HIERPAR_STRATEGY_REDUCE", reduce},
                                         {"HIERPAR_STRATEGY_REPLICAS", std::to_string(replicas)}};
  if (sync_bn) env["HIERPAR_STRATEGY_SYNC_BN"] = "1";
  if (device == c10::DeviceType::CUDA) env["HIERPAR_STRATEGY_CUDA"] = "1";
  const auto children = run_two_ranks(env, dir, std::chrono::seconds(120));
  auto options = test_options();
  options.sync_batch_norm = sync_bn;
  if (device == c10::DeviceType::CUDA) deterministic_cudnn();
  const auto in_process = train(hs::Placement::from_flags("data", replicas, reduce, device, {}), true, data, init_seed,
                                0, -1, options);
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(exit_code(children[rank]), 0) << what << " rank " << rank << " failed; its log:\n"
                                            << read_text(children[rank].log);
    for (int64_t i = 0; i < replicas / 2; ++i) {
      std::vector<torch::Tensor> saved;
      torch::load(saved, c10::str(dir, "/rank", rank, "-", i, ".pt"));
      const int64_t replica = rank * replicas / 2 + i;
      const std::string which = c10::str(what, ": process rank ", rank, "'s replica ", i, " vs in-process replica ",
                                         replica);
      if (exact) {
        expect_states_equal(saved, in_process[replica], which);
      } else {
        ASSERT_EQ(saved.size(), in_process[replica].size()) << which;
        for (size_t t = 0; t < saved.size(); ++t) {
          hierpar::testing::expect_close(saved[t], in_process[replica][t], {1e-5, 1e-6}, which + ": tensor " +
                                                                                             std::to_string(t));
        }
      }
    }
  }
  remove_dir(dir);
}

}  // namespace

TEST(StrategyTwoProcesses, AgreeBitForBitWithInProcessReplicas) {
  HIERPAR_REQUIRE_GLOO();
  // Collective averaging is bucketed (the default caps); the third run adds synchronized BatchNorm.
  for (const auto& [reduce, sync_bn] : std::vector<std::pair<const char*, bool>>{{"nccl", false}, {"host", false}, {"nccl", true}}) {
    expect_two_processes_agree_with_in_process_replicas(c10::DeviceType::CPU, reduce, sync_bn);
  }
}

// Two replicas in each of the two processes: each replica's groups reach the store through a connection of its own
// (a shared TCPStore client deadlocked their NCCL setup on GPUs), and the replicas of both processes agree with one
// process's.
TEST(StrategyTwoProcesses, TwoReplicasPerProcessAgreeWithInProcessReplicas) {
  HIERPAR_REQUIRE_GLOO();
  expect_two_processes_agree_with_in_process_replicas(c10::DeviceType::CPU, "nccl", false, 4);
  expect_two_processes_agree_with_in_process_replicas(c10::DeviceType::CPU, "host", false, 4, /*exact=*/false);
}

// One GPU per process, NCCL between the processes (and Gloo for host averaging's sums).
TEST(StrategyTwoProcessesCuda, AgreeBitForBitWithInProcessReplicas) {
  HIERPAR_REQUIRE_GPUS(2);
  expect_two_processes_agree_with_in_process_replicas(c10::DeviceType::CUDA, "nccl", false);
  if (hs::gloo_available()) expect_two_processes_agree_with_in_process_replicas(c10::DeviceType::CUDA, "host", false);
  if (torch::cuda::device_count() >= 4) {
    expect_two_processes_agree_with_in_process_replicas(c10::DeviceType::CUDA, "nccl", false, 4);
  } else {
    std::cout << "two GPUs per process skipped: " << torch::cuda::device_count() << " GPUs\n";
  }
}

TEST(StrategyTwoProcesses, ThrowingRankStopsTheOtherWithinTheTimeout) {
  HIERPAR_REQUIRE_GLOO();
  const std::string dir = temp_dir("fault");
  const auto start = Clock::now();
  const auto children = run_two_ranks({{"HIERPAR_STRATEGY_WORKER_OUT", dir},
                                       {"HIERPAR_STRATEGY_DATA_SEED", "1"},
                                       {"HIERPAR_STRATEGY_INIT_SEED", "2"},
                                       {"HIERPAR_STRATEGY_REDUCE", "nccl"},
                                       {"HIERPAR_STRATEGY_FAIL_RANK", "1"}},
                                      dir, std::chrono::seconds(60));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(exit_code(children[rank]), kWorkerStoppedByPeer) << "rank " << rank << "; its log:\n"
                                                               << read_text(children[rank].log);
  }
  const std::string thrown = read_text(dir + "/error1.txt");
  const std::string stopped = read_text(dir + "/error0.txt");
  EXPECT_NE(thrown.find("replica 1"), std::string::npos) << thrown;
  EXPECT_NE(stopped.find("replica 0"), std::string::npos) << stopped;
  EXPECT_NE(stopped.find("a peer replica may have failed or died"), std::string::npos) << stopped;
  EXPECT_LT(seconds, 45.0) << "two processes (start-up included) took " << seconds << " s with a 3 s timeout";
  remove_dir(dir);
}

// ---- CUDA ------------------------------------------------------------------------------------------


TEST(StrategyTrainerCuda, TaskEqualsSingleExactly) {
  HIERPAR_REQUIRE_GPUS(2);
  deterministic_cudnn();
  expect_task_equals_single(c10::DeviceType::CUDA, 16);
}

TEST(StrategyTrainerCuda, HostEqualsNcclAndBothMatchSingle) {
  HIERPAR_REQUIRE_GPUS(2);
  deterministic_cudnn();
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
  deterministic_cudnn();
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
  deterministic_cudnn();
  const auto data = make_data(16, hierpar::testing::rng()());
  const uint64_t init = hierpar::testing::rng()();
  const auto reference = reference_per_part(true, data, 2, init);  // on the CPU, in fp32
  for (const char* reduce : {"host", "nccl"}) {
    const auto replicas = train(hs::Placement::from_flags("hierarchical", 4, reduce, c10::DeviceType::CUDA, {}), true, data, init);
    expect_states_close(replicas[0], reference, {2e-3, 1e-5}, std::string("hierarchical R=2 (GPU) vs CPU per-part reference, ") + reduce);
    expect_states_equal(replicas[1], replicas[0], std::string("hierarchical replica 1 vs 0, ") + reduce);
  }
}
