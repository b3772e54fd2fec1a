// The strategy over processes: ranks as processes of this test binary (StrategyWorker.TrainAndSave), one or two
// replicas each, or one network of a replica each (split task and hierarchical placements), against the same
// placement's in-process replicas, and a rank that fails. CPU (Gloo) runs everywhere; the CUDA versions skip with a
// reason when GPUs are missing.
#include "strategy_testing.h"

#include "child_processes.h"

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

using namespace strategy_testing;
using Clock = std::chrono::steady_clock;

namespace {


using hierpar::testing::Child;
using hierpar::testing::exit_code;
using hierpar::testing::read_text;
using hierpar::testing::remove_dir;
using hierpar::testing::temp_dir;

// Runs ranks 0 .. ranks - 1 of StrategyWorker.TrainAndSave with `extra` in their environment; waits at most `limit`.
std::vector<Child> run_ranks(int ranks, const std::map<std::string, std::string>& extra, const std::string& dir,
                             std::chrono::seconds limit) {
  const int port = hierpar::testing::free_port();
  std::vector<Child> children;
  for (int rank = 0; rank < ranks; ++rank) {
    auto env = hierpar::testing::launch_environment(rank, ranks, port);
    env.insert(extra.begin(), extra.end());
    children.push_back(hierpar::testing::spawn({hierpar::testing::self_executable(), "--gtest_filter=StrategyWorker.TrainAndSave"},
                                               env, dir + "/rank" + std::to_string(rank) + ".log"));
  }
  hierpar::testing::wait_all(children, limit);
  return children;
}

constexpr int64_t kTwoRankBatch = 6;

// D's penalties, which differentiate D's gradient with respect to its inputs (the real batch; the fakes D's process
// received): R1 on every second step and WGAN-GP's.
void add_penalties(hs::AdversarialOptions& options) {
  options.r1_gamma = 1.0;
  options.r1_every = 2;
  options.gradient_penalty = 0.1;
}

// The parameters of the network this process runs of a split placement's replica.
std::vector<torch::Tensor> part_state_of(hs::AdversarialTrainer& trainer) {
  const bool g = trainer.placement().replicas[0].part == hs::ReplicaPart::generator;
  std::vector<torch::Tensor> state;
  for (const auto& p : (g ? trainer.generator() : trainer.discriminator()).ptr()->parameters()) {
    state.push_back(p.detach().cpu().clone());
  }
  return state;
}
constexpr int kWorkerStoppedByPeer = 3;  // a worker's exit code when its step failed (after reporting why)

}  // namespace

// The worker half of StrategyTwoProcesses.* and StrategySplitProcesses.*: one rank of a data placement over WORLD_SIZE
// processes, with HIERPAR_STRATEGY_REPLICAS replicas in all (2: one per process), or with HIERPAR_STRATEGY_SCHEME task
// or hierarchical one network of a replica per process; saves each local replica's parameters (of the networks it
// runs) and the losses take_losses() gave.
TEST(StrategyWorker, TrainAndSave) {
  const char* out = std::getenv("HIERPAR_STRATEGY_WORKER_OUT");
  if (out == nullptr) GTEST_SKIP() << "the worker half of StrategyTwoProcesses.*: runs only in the processes they start";
  const auto launch = hs::Launch::from_env();
  const uint64_t data_seed = std::stoull(std::getenv("HIERPAR_STRATEGY_DATA_SEED"));
  const uint64_t init_seed = std::stoull(std::getenv("HIERPAR_STRATEGY_INIT_SEED"));
  const std::string reduce = std::getenv("HIERPAR_STRATEGY_REDUCE");
  const char* fail_rank = std::getenv("HIERPAR_STRATEGY_FAIL_RANK");
  const char* replicas_env = std::getenv("HIERPAR_STRATEGY_REPLICAS");
  const char* scheme_env = std::getenv("HIERPAR_STRATEGY_SCHEME");
  const hs::Scheme scheme = hs::parse_scheme(scheme_env != nullptr ? scheme_env : "data");
  const bool cuda = std::getenv("HIERPAR_STRATEGY_CUDA") != nullptr;  // one GPU per replica or part (NCCL)
  std::optional<hierpar::testing::CudnnSettings> cudnn;  // deterministic_cudnn()'s, on CUDA
  if (cuda) cudnn.emplace(/*deterministic=*/true, /*benchmark=*/false);
  const int64_t devices = scheme == hs::Scheme::data ? (replicas_env != nullptr ? std::stoll(replicas_env) : 2)
                                                     : launch.world_size;  // split: one device per process
  const auto placement = hs::Placement::make(scheme, devices, hs::parse_reduce(reduce),
                                             cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU, launch);
  const int64_t batch = kTwoRankBatch / 2 * placement.global_replicas();
  const auto data = make_data(batch, data_seed);
  // This process's rows: its replicas' shares (a part reads its replica's).
  const int64_t rows = batch / placement.global_replicas() * placement.local_replicas();
  const int64_t first_row = placement.replicas[0].replica * (batch / placement.global_replicas());
  try {
    // Different on each rank (the broadcast must fix it), but one seed for both parts of a replica, so that G's
    // process and D's draw the initial parameters of an in-process replica.
    torch::manual_seed(init_seed + 1000 * (placement.split() ? launch.rank / 2 : launch.rank));
    auto g = tiny_generator(true);  // G first, then D, as train() draws them
    auto d = tiny_discriminator(true);
    auto options = test_options(std::chrono::seconds(3));
    options.sync_batch_norm = std::getenv("HIERPAR_STRATEGY_SYNC_BN") != nullptr;
    options.precision.channels_last = std::getenv("HIERPAR_STRATEGY_CHANNELS_LAST") != nullptr;
    if (std::getenv("HIERPAR_STRATEGY_PENALTIES") != nullptr) add_penalties(options);
    hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, options);
    for (int64_t k = 0; k < kSteps; ++k) {
      auto real = data.real[k].narrow(0, first_row, rows);
      if (fail_rank != nullptr && std::stoll(fail_rank) == launch.rank) real = real.narrow(1, 0, 2);  // a bad batch
      trainer.step(real, data.noise[k].narrow(0, first_row, rows));
    }
    for (int64_t i = 0; i < placement.local_replicas(); ++i) {
      torch::save(placement.split() ? part_state_of(trainer) : state_of(trainer, i),
                  c10::str(out, "/rank", launch.rank, "-", i, ".pt"));
    }
    torch::save(trainer.take_losses(), c10::str(out, "/losses", launch.rank, ".pt"));
  } catch (const c10::Error& e) {
    std::ofstream(std::string(out) + "/error" + std::to_string(launch.rank) + ".txt") << e.what_without_backtrace();
    std::fflush(nullptr);
    std::_Exit(kWorkerStoppedByPeer);
  }
}

namespace {

// Ranks 0 and 1 as two processes (one GPU per replica on CUDA) end with the parameters of the in-process replicas
// of the same placement: `replicas` in all, replicas / 2 in each process; bit for bit unless `exact` is false (host
// averaging then adds each process's replicas first, (a + b) + (c + d), where one process adds ((a + b) + c) + d):
// a rounding difference in the summed gradients, which Adam's normalised update carries into the parameters as in
// the split-batch comparisons (kSplitBatchTolerance; seen: 2.5e-6 after 3 steps, seed 2420481842).
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
  const auto children = run_ranks(2, env, dir, std::chrono::seconds(120));
  auto options = test_options();
  options.sync_batch_norm = sync_bn;
  std::optional<hierpar::testing::CudnnSettings> cudnn;  // deterministic_cudnn()'s, on CUDA
  if (device == c10::DeviceType::CUDA) cudnn.emplace(/*deterministic=*/true, /*benchmark=*/false);
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
          hierpar::testing::expect_close(saved[t], in_process[replica][t], kSplitBatchTolerance,
                                         which + ": tensor " + std::to_string(t));
        }
      }
    }
  }
  remove_dir(dir);
}

// Ranks 0 and 1 of `scheme` (data: a replica each; task: G and D), rank 1 given a bad batch, with a 3 s timeout:
// both must exit as stopped (rank 1 by its error, rank 0 by its peer's). Returns the seconds both took.
double run_with_failing_rank_1(const std::string& dir, const char* scheme) {
  const auto start = Clock::now();
  const auto children = run_ranks(2, {{"HIERPAR_STRATEGY_WORKER_OUT", dir},
                                      {"HIERPAR_STRATEGY_DATA_SEED", "1"},
                                      {"HIERPAR_STRATEGY_INIT_SEED", "2"},
                                      {"HIERPAR_STRATEGY_REDUCE", "nccl"},
                                      {"HIERPAR_STRATEGY_SCHEME", scheme},
                                      {"HIERPAR_STRATEGY_FAIL_RANK", "1"}},
                                  dir, std::chrono::seconds(60));
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(exit_code(children[rank]), kWorkerStoppedByPeer) << scheme << " rank " << rank << "; its log:\n"
                                                               << read_text(children[rank].log);
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
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
  const double seconds = run_with_failing_rank_1(dir, "data");
  const std::string thrown = read_text(dir + "/error1.txt");
  const std::string stopped = read_text(dir + "/error0.txt");
  EXPECT_NE(thrown.find("replica 1"), std::string::npos) << thrown;
  EXPECT_NE(stopped.find("replica 0"), std::string::npos) << stopped;
  EXPECT_NE(stopped.find("a peer replica may have failed or died"), std::string::npos) << stopped;
  EXPECT_LT(seconds, 45.0) << "two processes (start-up included) took " << seconds << " s with a 3 s timeout";
  remove_dir(dir);
}

namespace {

// A split placement's processes (`processes`: 2 for task, 4 for hierarchical's two replicas; one device each) end
// with the parameters and losses of the in-process placement, bit for bit: G's processes with its replicas' G, D's
// with their D, and every process with the losses (G's receive them from D's).
void expect_split_processes_agree_with_in_process(c10::DeviceType device, const char* scheme, const char* reduce,
                                                  int processes, bool sync_bn = false, bool channels_last = false,
                                                  bool penalties = false) {
  const uint64_t data_seed = hierpar::testing::rng()() % 1000000;
  const uint64_t init_seed = hierpar::testing::rng()() % 1000000;
  const int64_t replicas = processes / 2;
  const auto data = make_data(kTwoRankBatch / 2 * replicas, data_seed);
  const std::string what = c10::str(scheme, " over ", processes, " processes, ", reduce, sync_bn ? " sync BN" : "",
                                    channels_last ? " channels_last" : "", penalties ? " R1 + GP" : "", " on ",
                                    c10::DeviceTypeName(device, true));
  const std::string dir = temp_dir(c10::str("split_", scheme, "_", reduce, sync_bn ? "_sync" : "",
                                            channels_last ? "_cl" : "", penalties ? "_penalties" : ""));
  std::map<std::string, std::string> env{{"HIERPAR_STRATEGY_WORKER_OUT", dir},
                                         {"HIERPAR_STRATEGY_DATA_SEED", std::to_string(data_seed)},
                                         {"HIERPAR_STRATEGY_INIT_SEED", std::to_string(init_seed)},
                                         {"HIERPAR_STRATEGY_REDUCE", reduce},
                                         {"HIERPAR_STRATEGY_SCHEME", scheme}};
  if (device == c10::DeviceType::CUDA) env["HIERPAR_STRATEGY_CUDA"] = "1";
  if (sync_bn) env["HIERPAR_STRATEGY_SYNC_BN"] = "1";
  if (channels_last) env["HIERPAR_STRATEGY_CHANNELS_LAST"] = "1";
  if (penalties) env["HIERPAR_STRATEGY_PENALTIES"] = "1";
  const auto children = run_ranks(processes, env, dir, std::chrono::seconds(120));

  // The same placement in one process: every replica's G and D, and the losses (means over the replicas).
  std::optional<hierpar::testing::CudnnSettings> cudnn;  // deterministic_cudnn()'s, on CUDA
  if (device == c10::DeviceType::CUDA) cudnn.emplace(/*deterministic=*/true, /*benchmark=*/false);
  torch::manual_seed(init_seed);
  auto g = tiny_generator(true);
  auto d = tiny_discriminator(true);
  const size_t g_parameters = g->parameters().size();
  auto options = test_options();
  options.sync_batch_norm = sync_bn;
  options.precision.channels_last = channels_last;
  if (penalties) add_penalties(options);
  hs::AdversarialTrainer in_process(torch::nn::AnyModule(g), torch::nn::AnyModule(d),
                                    hs::Placement::from_flags(scheme, 2 * replicas, reduce, device, {}), options);
  for (int64_t k = 0; k < kSteps; ++k) in_process.step(data.real[k], data.noise[k]);
  const torch::Tensor losses = in_process.take_losses();

  std::vector<torch::Tensor> replica_losses;
  for (int rank = 0; rank < processes; ++rank) {
    ASSERT_EQ(exit_code(children[rank]), 0) << what << ": rank " << rank << " failed; its log:\n"
                                            << read_text(children[rank].log);
    const int64_t replica = rank / 2;
    std::vector<torch::Tensor> saved;
    torch::load(saved, c10::str(dir, "/rank", rank, "-0.pt"));
    const std::vector<torch::Tensor> all = state_of(in_process, replica);
    const std::vector<torch::Tensor> expected = rank % 2 == 0
                                                    ? std::vector<torch::Tensor>(all.begin(), all.begin() + g_parameters)
                                                    : std::vector<torch::Tensor>(all.begin() + g_parameters, all.end());
    expect_states_equal(saved, expected, c10::str(what, ": rank ", rank, " (replica ", replica, "'s ",
                                                  rank % 2 == 0 ? "G" : "D", ")"));
    torch::Tensor taken;
    torch::load(taken, c10::str(dir, "/losses", rank, ".pt"));
    ASSERT_EQ(taken.sizes(), (std::vector<int64_t>{kSteps, 3})) << what << ": rank " << rank << "'s losses";
    if (rank % 2 == 1) {
      torch::Tensor from_g;
      torch::load(from_g, c10::str(dir, "/losses", rank - 1, ".pt"));
      EXPECT_TRUE(torch::equal(from_g, taken)) << what << ": G's process of replica " << replica
                                               << " took other losses than D's:\n" << from_g << "\n" << taken;
      replica_losses.push_back(taken);
    }
  }
  EXPECT_TRUE(torch::equal(torch::stack(replica_losses).mean(0), losses))
      << what << ": the processes' losses differ from one process's";
  remove_dir(dir);
}

}  // namespace

// G in one process, D in another: the fakes and their gradient cross between the processes (Gloo on the CPU).
TEST(StrategySplitProcesses, TaskOverTwoProcessesEqualsOneProcess) {
  HIERPAR_REQUIRE_GLOO();
  expect_split_processes_agree_with_in_process(c10::DeviceType::CPU, "task", "nccl", 2);
  // channels_last fakes (and their gradient) keep their layout on the way.
  expect_split_processes_agree_with_in_process(c10::DeviceType::CPU, "task", "nccl", 2, false, /*channels_last=*/true);
  // D's penalties in D's process, through the fakes it received.
  expect_split_processes_agree_with_in_process(c10::DeviceType::CPU, "task", "nccl", 2, false, false, /*penalties=*/true);
}

// Seed 000's four-device layout with a process per device: each network averages over the processes that run it.
TEST(StrategySplitProcesses, HierarchicalOverFourProcessesEqualsOneProcess) {
  HIERPAR_REQUIRE_GLOO();
  expect_split_processes_agree_with_in_process(c10::DeviceType::CPU, "hierarchical", "nccl", 4);
  expect_split_processes_agree_with_in_process(c10::DeviceType::CPU, "hierarchical", "host", 4);
  // Synchronized BatchNorm: each network's statistics summed over the processes that run it.
  expect_split_processes_agree_with_in_process(c10::DeviceType::CPU, "hierarchical", "nccl", 4, /*sync_bn=*/true);
}

// D's process fails on a bad batch: G's, waiting for the fakes' gradient, stops within the timeout and names its peer.
TEST(StrategySplitProcesses, FailingPartStopsTheOtherWithinTheTimeout) {
  HIERPAR_REQUIRE_GLOO();
  const std::string dir = temp_dir("split_fault");
  const double seconds = run_with_failing_rank_1(dir, "task");
  const std::string stopped = read_text(dir + "/error0.txt");
  EXPECT_NE(stopped.find("replica 0's generator (rank 0, its discriminator on rank 1)"), std::string::npos) << stopped;
  EXPECT_NE(stopped.find("a peer replica may"), std::string::npos) << stopped;
  EXPECT_FALSE(read_text(dir + "/error1.txt").empty());
  EXPECT_LT(seconds, 45.0) << "two processes (start-up included) took " << seconds << " s with a 3 s timeout";
  remove_dir(dir);
}

// One GPU per process, NCCL between them.
TEST(StrategySplitProcessesCuda, TaskAndHierarchicalEqualOneProcess) {
  HIERPAR_REQUIRE_GPUS(2);
  expect_split_processes_agree_with_in_process(c10::DeviceType::CUDA, "task", "nccl", 2);
  if (torch::cuda::device_count() >= 4) {
    expect_split_processes_agree_with_in_process(c10::DeviceType::CUDA, "hierarchical", "nccl", 4);
  } else {
    std::cout << "hierarchical over 4 processes skipped: " << torch::cuda::device_count() << " GPUs\n";
  }
}
