// Placement (strategy/placement.h): how each scheme prints, the one-line errors for impossible requests, and the
// launch read from torchrun's environment.
#include "testing.h"

#include "hierpar/strategy/placement.h"

#include <cstdlib>

namespace hs = hierpar::strategy;

TEST(StrategyPlacement, PrintsEachScheme) {
  const auto cpu = c10::DeviceType::CPU;
  EXPECT_EQ(hs::Placement::from_flags("single", 1, "host", cpu, {}).to_string(),
            "single: replica 0: G cpu, D cpu; reduce=host");
  EXPECT_EQ(hs::Placement::from_flags("task", 2, "nccl", cpu, {}).to_string(),
            "task: replica 0: G cpu, D cpu; reduce=nccl");
  EXPECT_EQ(hs::Placement::from_flags("data", 3, "host", cpu, {}).to_string(),
            "data: replica 0: G cpu, D cpu | replica 1: G cpu, D cpu | replica 2: G cpu, D cpu; reduce=host");
  // The seed's 4-GPU layout, built by hand (this machine may have no GPU); validate() checks its shape.
  hs::Placement seed;
  seed.scheme = hs::Scheme::hierarchical;
  seed.reduce = hs::Reduce::collective;
  seed.replicas = {{0, c10::Device("cuda:0"), c10::Device("cuda:1")}, {1, c10::Device("cuda:2"), c10::Device("cuda:3")}};
  seed.validate();
  std::ostringstream printed;
  printed << seed;
  EXPECT_EQ(printed.str(), "hierarchical: replica 0: G cuda:0, D cuda:1 | replica 1: G cuda:2, D cuda:3; reduce=nccl");

  hs::Launch launch;
  launch.rank = 1;
  launch.world_size = 2;
  launch.local_rank = 1;
  const auto ranked = hs::Placement::make(hs::Scheme::hierarchical, 4, hs::Reduce::host, cpu, launch);
  EXPECT_EQ(ranked.to_string(), "hierarchical: replica 1: G cpu, D cpu; reduce=host, rank 1 of 2 processes");
  EXPECT_EQ(ranked.global_replicas(), 2);
}

// One device per process: ranks 2r and 2r + 1 run replica r's G and D.
TEST(StrategyPlacement, OneDevicePerProcessSplitsEachReplica) {
  const auto cpu = c10::DeviceType::CPU;
  hs::Launch launch;
  launch.world_size = 2;
  const auto g = hs::Placement::make(hs::Scheme::task, 2, hs::Reduce::collective, cpu, launch);
  EXPECT_TRUE(g.split());
  EXPECT_EQ(g.replicas[0].part, hs::ReplicaPart::generator);
  EXPECT_EQ(g.global_replicas(), 1);
  EXPECT_EQ(g.to_string(), "task: replica 0: G cpu (D on rank 1); reduce=nccl, rank 0 of 2 processes");
  launch.world_size = 4;
  launch.rank = launch.local_rank = 3;
  const auto d = hs::Placement::make(hs::Scheme::hierarchical, 4, hs::Reduce::host, cpu, launch);
  EXPECT_EQ(d.replicas[0].part, hs::ReplicaPart::discriminator);
  EXPECT_EQ(d.replicas[0].replica, 1);
  EXPECT_EQ(d.global_replicas(), 2);
  EXPECT_EQ(d.peer_rank(), 2);
  EXPECT_EQ(d.to_string(), "hierarchical: replica 1: D cpu (G on rank 2); reduce=host, rank 3 of 4 processes");
  // Two devices per process keep whole replicas.
  launch.world_size = 2;
  launch.rank = launch.local_rank = 1;
  EXPECT_FALSE(hs::Placement::make(hs::Scheme::hierarchical, 4, hs::Reduce::host, cpu, launch).split());
  hs::Placement wrong = d;
  wrong.replicas[0].part = hs::ReplicaPart::generator;
  HIERPAR_EXPECT_THROW_MSG(wrong.validate(), "rank 3 of a split placement runs the discriminator of replica 1");
  wrong = d;
  wrong.scheme = hs::Scheme::data;
  HIERPAR_EXPECT_THROW_MSG(wrong.validate(), "only task and hierarchical split them");
}

TEST(StrategyPlacement, RejectsImpossibleRequests) {
  const auto cpu = c10::DeviceType::CPU;
  HIERPAR_EXPECT_THROW_MSG(hs::Placement::from_flags("pipeline", 2, "host", cpu, {}), "--strategy must be one of");
  HIERPAR_EXPECT_THROW_MSG(hs::Placement::from_flags("data", 2, "mpi", cpu, {}), "--reduce must be host or nccl");
  HIERPAR_EXPECT_THROW_MSG(hs::Placement::from_flags("hierarchical", 3, "host", cpu, {}), "needs an even --gpus");
  HIERPAR_EXPECT_THROW_MSG(hs::Placement::from_flags("task", 3, "host", cpu, {}), "uses exactly 2 devices");
  HIERPAR_EXPECT_THROW_MSG(hs::Placement::from_flags("single", 2, "host", cpu, {}), "uses exactly 1 device");
  HIERPAR_EXPECT_THROW_MSG(hs::Placement::from_flags("data", 0, "host", cpu, {}), "--gpus must be at least 1");
  const int64_t visible = static_cast<int64_t>(torch::cuda::device_count());
  HIERPAR_EXPECT_THROW_MSG(hs::Placement::from_flags("data", visible + 1, "nccl", c10::DeviceType::CUDA, {}),
                           "visible");
  hs::Launch launch;
  launch.world_size = 2;
  HIERPAR_EXPECT_THROW_MSG(hs::Placement::make(hs::Scheme::data, 3, hs::Reduce::host, cpu, launch),
                           "does not split over WORLD_SIZE=2");
  HIERPAR_EXPECT_THROW_MSG(hs::Placement::make(hs::Scheme::single, 1, hs::Reduce::host, cpu, launch),
                           "runs one replica in one process");
  launch.world_size = 4;
  HIERPAR_EXPECT_THROW_MSG(hs::Placement::make(hs::Scheme::task, 2, hs::Reduce::host, cpu, launch),
                           "use hierarchical for more");
  launch.world_size = 2;
  hs::Placement shared_gpu;
  shared_gpu.scheme = hs::Scheme::data;
  shared_gpu.replicas = {{0, c10::Device("cuda:0"), c10::Device("cuda:0")}, {1, c10::Device("cuda:0"), c10::Device("cuda:0")}};
  HIERPAR_EXPECT_THROW_MSG(shared_gpu.validate(), "each GPU runs one network");
  hs::Placement split;
  split.scheme = hs::Scheme::data;
  split.replicas = {{0, c10::Device("cuda:0"), c10::Device("cuda:1")}};
  HIERPAR_EXPECT_THROW_MSG(split.validate(), "keeps G and D on one device");
}

TEST(StrategyPlacement, ReadsTheLaunchEnvironment) {
  ::setenv("RANK", "3", 1);
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("LOCAL_RANK", "1", 1);
  ::setenv("MASTER_ADDR", "10.0.0.7", 1);
  ::setenv("MASTER_PORT", "29555", 1);
  const auto launch = hs::Launch::from_env();
  EXPECT_EQ(launch.rank, 3);
  EXPECT_EQ(launch.world_size, 4);
  EXPECT_EQ(launch.local_rank, 1);
  EXPECT_EQ(launch.master_addr, "10.0.0.7");
  EXPECT_EQ(launch.master_port, 29555);
  EXPECT_FALSE(launch.agent_store);
  ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);  // torchrun's agent serves the store
  EXPECT_TRUE(hs::Launch::from_env().agent_store);
  ::unsetenv("TORCHELASTIC_USE_AGENT_STORE");
  ::setenv("RANK", "4", 1);
  HIERPAR_EXPECT_THROW_MSG(hs::Launch::from_env(), "RANK must be in [0, WORLD_SIZE=4)");
  ::setenv("WORLD_SIZE", "two", 1);
  HIERPAR_EXPECT_THROW_MSG(hs::Launch::from_env(), "WORLD_SIZE must be an integer");
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(name);
  EXPECT_FALSE(hs::Launch::from_env().multi_process());
}
