// The strategy over processes: ranks 0 and 1 as two processes of this test binary (StrategyWorker.TrainAndSave), one
// or two replicas each, against the same placement's in-process replicas, and a rank that fails. CPU (Gloo) runs
// everywhere; the CUDA version skips with a reason when GPUs are missing.
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
          hierpar::testing::expect_close(saved[t], in_process[replica][t], kSplitBatchTolerance,
                                         which + ": tensor " + std::to_string(t));
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
