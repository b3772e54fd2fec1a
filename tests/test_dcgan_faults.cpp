// hierpar-dcgan's runs failing well: ranks as processes started by hand (as srun would) or by two torchrun agents,
// and replicas as threads of one process, each with one fault injected (--inject-fault: a replica that throws,
// hangs, is killed or gets SIGTERM at the start of a step). Every process must exit within seconds, with one line
// naming the first failed rank and the cause, and the checkpoint must resume. CPU and Gloo here; the same on two
// GPUs with NCCL (one per process) where there are two. And a split placement's checkpoint (G and D in two
// processes).
#ifdef HIERPAR_DCGAN_PROGRAM

#include "testing.h"

#include "child_processes.h"
#include "common/checkpoint.h"
#include "common/dcgan_app.h"
#include "hierpar/strategy/averaging.h"

#include <cmath>
#include <sstream>

#define HIERPAR_REQUIRE_GLOO()                                                                                  \
  do {                                                                                                          \
    if (!hierpar::strategy::gloo_available()) GTEST_SKIP() << "this build has no Gloo (the gloo headers)";      \
  } while (0)

using hierpar::testing::Child;
using hierpar::testing::exit_code;
using hierpar::testing::read_text;

namespace {

// A tiny DCGAN that trains for as long as a test needs (the fault or --max-steps ends it).
std::string training(const std::string& device, const std::string& out) {
  return "train --device " + device + " --data synthetic --limit 64 --image-size 32 --width 0.25 --channels 1 " +
         "--batch-size 16 --samples 4 --epochs 1000 --checkpoint-every 2 --out " + out;
}

std::vector<std::string> words(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// Ranks 0..world-1 of hierpar-dcgan `args`, started by hand with the launch variables.
std::vector<Child> run_ranks(int world, const std::string& args, const std::string& dir, int limit_s = 90) {
  const int port = hierpar::testing::free_port();
  std::vector<Child> ranks;
  std::vector<std::string> argv{HIERPAR_DCGAN_PROGRAM};
  for (auto& w : words(args)) argv.push_back(w);
  for (int rank = 0; rank < world; ++rank) {
    auto env = world > 1 ? hierpar::testing::launch_environment(rank, world, port) : std::map<std::string, std::string>{};
    env["OMP_NUM_THREADS"] = "1";  // as torchrun sets it: two ranks' thread pools on two cores would crawl
    ranks.push_back(hierpar::testing::spawn(argv, env, dir + "/rank" + std::to_string(rank) + ".log"));
  }
  hierpar::testing::wait_all(ranks, std::chrono::seconds(limit_s));
  return ranks;
}

std::vector<std::string> lines_of(const Child& child) {
  std::istringstream in(read_text(child.log));
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string logs(const std::vector<Child>& ranks) {
  std::string text;
  for (size_t r = 0; r < ranks.size(); ++r) text += "--- rank " + std::to_string(r) + ":\n" + read_text(ranks[r].log);
  return text;
}

// The process printed exactly one error line, its last, starting with `start`; returns it.
std::string expect_one_error_line(const Child& child, const std::string& start, const std::string& logs_text) {
  const auto lines = lines_of(child);
  int errors = 0;
  for (const auto& line : lines) errors += line.find("error:") != std::string::npos;
  EXPECT_EQ(errors, 1) << logs_text;
  if (lines.empty()) return "";
  EXPECT_EQ(lines.back().rfind("hierpar-dcgan: error: " + start, 0), 0u) << logs_text;
  return lines.back();
}

std::vector<torch::Tensor> generator_of(const std::string& checkpoint) {
  std::vector<torch::Tensor> out;
  for (const auto& p : hierpar::examples::load_generator(checkpoint, hierpar::LayerSet::hierpar, torch::kCPU)->parameters()) {
    out.push_back(p.detach().clone());
  }
  return out;
}

void expect_same_generator(const std::string& a, const std::string& b, const std::string& what) {
  const auto x = generator_of(a), y = generator_of(b);
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) hierpar::testing::expect_close(x[i], y[i], what + ": tensor " + std::to_string(i));
}

// The discriminator a checkpoint holds, on the CPU (its architecture from the checkpoint's configuration).
std::vector<torch::Tensor> discriminator_of(const std::string& checkpoint) {
  hierpar::models::Discriminator d(hierpar::examples::checkpoint_model(checkpoint, hierpar::LayerSet::stock));
  hierpar::examples::load_checkpoint(checkpoint, {}, {{"discriminator", d.get()}}, {}, torch::kCPU, /*restore_rng=*/false);
  std::vector<torch::Tensor> out;
  for (const auto& p : d->parameters()) out.push_back(p.detach().clone());
  return out;
}

int64_t checkpoint_step(const std::string& out) {
  return hierpar::examples::read_checkpoint_state(out + "/checkpoint.pt").global_step;
}

// Two ranks (one GPU each on CUDA), rank 1 failing by `fault` in step 3: data parallel with collective averaging
// (a replica each), or task (`scheme` "task": G in rank 0, D in rank 1, whose process takes the fault).
void two_ranks_fail_well(const std::string& device, const std::string& fault, const std::string& scheme = "data") {
  const std::string dir = hierpar::testing::temp_dir("dcgan_" + scheme + "_" + fault);
  const std::string two = " --strategy " + scheme + " --gpus 2 --reduce nccl";
  const std::string where = device == "cpu" ? "cpu" : "cuda:1";
  const std::string replica = scheme == "data" ? "replica 1 (G " + where + ", D " + where + ")"
                                               : "replica 0's discriminator (" + where + ")";
  const std::string run = training(device, dir + "/run") + two;
  if (fault == "throw") {  // both ranks stop at once with rank 1's cause
    const auto ranks = run_ranks(2, run + " --inject-fault throw@3", dir);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(exit_code(ranks[r]), 1) << logs(ranks);
      expect_one_error_line(ranks[r], "rank 1 failed in step 3: " + replica + " failed: injected fault", logs(ranks));
    }
    EXPECT_LT(std::abs(ranks[0].seconds - ranks[1].seconds), 5.0) << logs(ranks);
    EXPECT_EQ(checkpoint_step(dir + "/run"), 2) << "the last checkpoint before the fault";
  } else if (fault == "kill") {  // the other rank, on the same host, sees its process gone at once
    const auto ranks = run_ranks(2, run + " --inject-fault kill@3", dir);
    EXPECT_EQ(exit_code(ranks[1]), -SIGKILL) << logs(ranks);
    EXPECT_EQ(exit_code(ranks[0]), 1) << logs(ranks);
    expect_one_error_line(ranks[0], "rank 1 died", logs(ranks));
    EXPECT_LT(ranks[0].seconds - ranks[1].seconds, 5.0) << logs(ranks);
  } else if (fault == "hang") {  // named after --timeout 2; the hung rank ends by itself
    // Past the startup steps (on CUDA the graph warm-up and capture, 5), which a hang may take 60 s to be named in
    // (RunGuardOptions::startup_timeout): after them the run ends within the timeout and the exit grace.
    const std::string at = device == "cpu" ? "3" : "7";
    const auto ranks = run_ranks(2, run + " --inject-fault hang@" + at + " --timeout 2", dir);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(exit_code(ranks[r]), 1) << logs(ranks);
      expect_one_error_line(ranks[r], "rank 1 hangs in step " + at, logs(ranks));
      EXPECT_LT(ranks[r].seconds, 40.0) << "start-up, " << at << " steps, the 2 s timeout and the exit grace\n"
                                        << logs(ranks);
    }
  } else {  // SIGTERM to rank 1: both stop after one agreed step, and rank 0's checkpoint resumes to a straight run's weights
    const auto ranks = run_ranks(2, run + " --inject-fault sigterm@3", dir);
    for (int r = 0; r < 2; ++r) EXPECT_EQ(exit_code(ranks[r]), 130) << logs(ranks);
    const int64_t stopped = checkpoint_step(dir + "/run");
    EXPECT_GE(stopped, 3);
    EXPECT_NE(read_text(ranks[0].log).find("stopping after step " + std::to_string(stopped) + ": SIGTERM on rank 1"),
              std::string::npos) << logs(ranks);
    const std::string more = " --max-steps " + std::to_string(stopped + 2);
    const auto resumed = run_ranks(2, run + more + " --resume", dir);
    for (int r = 0; r < 2; ++r) ASSERT_EQ(exit_code(resumed[r]), 0) << logs(resumed);
    EXPECT_EQ(checkpoint_step(dir + "/run"), stopped + 2);
    if (device == "cpu") {  // on GPUs cuDNN's benchmark may pick other algorithms in another process
      const auto straight = run_ranks(1, training(device, dir + "/straight") + two + more, dir);
      ASSERT_EQ(exit_code(straight[0]), 0) << logs(straight);
      expect_same_generator(dir + "/run/checkpoint.pt", dir + "/straight/checkpoint.pt",
                            "2 ranks stopped and resumed vs 2 in-process replicas straight");
    }
  }
  hierpar::testing::remove_tree(dir);
}

// torchrun on PATH (scripts/test puts the torch Python's bin first), or "".
std::string torchrun() {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "");
  for (std::string d; std::getline(dirs, d, ':');) {
    const std::string candidate = d + "/torchrun";
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

}  // namespace

TEST(DcganFaults, ThrowingRankStopsEveryRankWithItsCause) {
  HIERPAR_REQUIRE_GLOO();
  two_ranks_fail_well("cpu", "throw");
}
TEST(DcganFaults, KilledRankStopsTheOtherAtOnce) {
  HIERPAR_REQUIRE_GLOO();
  two_ranks_fail_well("cpu", "kill");
}
TEST(DcganFaults, HungRankStopsEveryRankAfterTheTimeout) {
  HIERPAR_REQUIRE_GLOO();
  two_ranks_fail_well("cpu", "hang");
}
TEST(DcganFaults, InterruptedRankStopsEveryRankAfterOneStepAndTheCheckpointResumes) {
  HIERPAR_REQUIRE_GLOO();
  two_ranks_fail_well("cpu", "interrupt");
}
// G and D in two processes: D's process failing in each way stops G's as a data rank's would stop its peer.
TEST(DcganFaults, SplitTaskProcessFaultsStopBothProcesses) {
  HIERPAR_REQUIRE_GLOO();
  for (const char* fault : {"throw", "kill", "hang", "interrupt"}) two_ranks_fail_well("cpu", fault, "task");
}
TEST(DcganFaultsCuda, SplitTaskProcessFaultsStopBothProcesses) {
  HIERPAR_REQUIRE_TWO_GPUS();
  for (const char* fault : {"throw", "kill", "hang", "interrupt"}) two_ranks_fail_well("cuda", fault, "task");
}
TEST(DcganFaultsCuda, ThrowingRankStopsEveryRankWithItsCause) {
  HIERPAR_REQUIRE_TWO_GPUS();
  two_ranks_fail_well("cuda", "throw");
}
TEST(DcganFaultsCuda, KilledRankStopsTheOtherAtOnce) {
  HIERPAR_REQUIRE_TWO_GPUS();
  two_ranks_fail_well("cuda", "kill");
}
TEST(DcganFaultsCuda, HungRankStopsEveryRankAfterTheTimeout) {
  HIERPAR_REQUIRE_TWO_GPUS();
  two_ranks_fail_well("cuda", "hang");
}
TEST(DcganFaultsCuda, InterruptedRankStopsEveryRankAfterOneStepAndTheCheckpointResumes) {
  HIERPAR_REQUIRE_TWO_GPUS();
  two_ranks_fail_well("cuda", "interrupt");
}

// Two replicas as threads of one process (host averaging): a throwing or hanging replica ends the run with one line
// naming it; an interrupt stops it after that very step, with the checkpoint.
TEST(DcganFaults, InProcessReplicaFaultsEndTheRun) {
  const std::string dir = hierpar::testing::temp_dir("dcgan_inprocess");
  const std::string two = " --strategy data --gpus 2 --reduce host";
  auto thrown = run_ranks(1, training("cpu", dir + "/throw") + two + " --inject-fault throw@2", dir);
  EXPECT_EQ(exit_code(thrown[0]), 1) << logs(thrown);
  expect_one_error_line(thrown[0], "replica 1 (G cpu, D cpu) failed: injected fault (--inject-fault throw@2)", logs(thrown));
  auto hung = run_ranks(1, training("cpu", dir + "/hang") + two + " --inject-fault hang@2 --timeout 1", dir);
  EXPECT_EQ(exit_code(hung[0]), 1) << logs(hung);
  expect_one_error_line(hung[0], "replica 1 (G cpu, D cpu) hangs", logs(hung));
  EXPECT_LT(hung[0].seconds, 30.0) << "1 s timeout, 3 s grace, start-up";
  auto interrupted = run_ranks(1, training("cpu", dir + "/int") + two + " --inject-fault sigint@3", dir);
  EXPECT_EQ(exit_code(interrupted[0]), 130) << logs(interrupted);
  EXPECT_EQ(checkpoint_step(dir + "/int"), 3) << "one process stops after the step the signal came in";
  hierpar::testing::remove_tree(dir);
}

// G and D of one replica in two processes (task with a process per device): rank 0's checkpoint holds both networks
// (D's copied from rank 1 before each save), and a run stopped and resumed so ends with the weights of one process's
// straight run.
TEST(DcganSplitProcesses, TaskCheckpointsBothNetworksAndResumes) {
  HIERPAR_REQUIRE_GLOO();
  const std::string dir = hierpar::testing::temp_dir("dcgan_split");
  const std::string task = " --strategy task --gpus 2 --reduce nccl";
  const std::string run = training("cpu", dir + "/run") + task;
  const auto first = run_ranks(2, run + " --max-steps 3", dir);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(exit_code(first[r]), 0) << logs(first);
  EXPECT_NE(read_text(first[0].log).find("strategy: task: replica 0: G cpu (D on rank 1)"), std::string::npos)
      << logs(first);
  EXPECT_EQ(checkpoint_step(dir + "/run"), 3);
  const auto resumed = run_ranks(2, run + " --max-steps 5 --resume", dir);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(exit_code(resumed[r]), 0) << logs(resumed);
  const auto straight = run_ranks(1, training("cpu", dir + "/straight") + task + " --max-steps 5", dir);
  ASSERT_EQ(exit_code(straight[0]), 0) << logs(straight);
  const std::string a = dir + "/run/checkpoint.pt", b = dir + "/straight/checkpoint.pt";
  expect_same_generator(a, b, "G: task over 2 processes, stopped and resumed, vs 1 process straight");
  const auto x = discriminator_of(a), y = discriminator_of(b);
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) {
    hierpar::testing::expect_close(x[i], y[i], "D: task over 2 processes vs 1 process: tensor " + std::to_string(i));
  }
  hierpar::testing::remove_tree(dir);
}

// Two torchrun agents on one host (--nnodes 2, c10d rendezvous), as two hosts would run: rank 1 is killed in step 5;
// rank 0 stops once rank 1's heartbeats have stopped for 5 s, torchrun restarts both (--max-restarts 1), and the
// restart resumes from the step-4 checkpoint (--resume auto) to the end, with the weights of a straight run.
TEST(DcganFaults, TwoTorchrunAgentsRestartFromTheCheckpointAfterAKill) {
  HIERPAR_REQUIRE_GLOO();
  const std::string launcher = torchrun();
  if (launcher.empty()) GTEST_SKIP() << "torchrun is not on PATH (scripts/test puts the torch Python's bin first)";
  const std::string dir = hierpar::testing::temp_dir("dcgan_agents");
  const std::string two = " --strategy data --gpus 2 --reduce nccl --max-steps 8";
  const std::string endpoint = "127.0.0.1:" + std::to_string(hierpar::testing::free_port());
  std::vector<Child> agents;
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> argv{launcher, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                  "--rdzv-endpoint", endpoint, "--rdzv-id", "faults", "--max-restarts", "1",
                                  "--no-python", HIERPAR_DCGAN_PROGRAM};
    for (auto& w : words(training("cpu", dir + "/run") + two + " --resume auto --inject-fault kill@5")) argv.push_back(w);
    // One thread, as the straight run below: ATen's CPU convolutions sum in an order that depends on the thread
    // count (torchrun sets OMP_NUM_THREADS=1 only for several processes per agent).
    agents.push_back(
        hierpar::testing::spawn(argv, {{"OMP_NUM_THREADS", "1"}}, dir + "/agent" + std::to_string(node) + ".log"));
  }
  hierpar::testing::wait_all(agents, std::chrono::seconds(120));
  for (int node = 0; node < 2; ++node) ASSERT_EQ(exit_code(agents[node]), 0) << logs(agents);
  const std::string both = logs(agents);
  // Each agent's ranks count as on another host: rank 1's death is seen by its heartbeats stopping.
  EXPECT_NE(both.find("hierpar-dcgan: error: rank 1 stopped responding"), std::string::npos) << both;
  EXPECT_NE(both.find("resumed from " + dir + "/run/checkpoint.pt at epoch 2, step 4"), std::string::npos) << both;
  EXPECT_EQ(checkpoint_step(dir + "/run"), 8);
  const auto straight = run_ranks(1, training("cpu", dir + "/straight") + two, dir);
  ASSERT_EQ(exit_code(straight[0]), 0) << logs(straight);
  expect_same_generator(dir + "/run/checkpoint.pt", dir + "/straight/checkpoint.pt",
                        "killed, restarted by torchrun and resumed vs straight");
  hierpar::testing::remove_tree(dir);
}

#endif  // HIERPAR_DCGAN_PROGRAM
