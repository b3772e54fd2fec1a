// hierpar::strategy::RunGuard: ranks as processes of this test binary (RunGuardWorker.Run), each running a stand-in
// training loop whose "collective" waits until the guard's abort callback ends it, as a process group blocked on a
// failed peer would. Short timeouts (heartbeat 2 s, hang 1.5 s), so each test takes seconds.
#include "testing.h"

#include "child_processes.h"
#include "hierpar/strategy/averaging.h"
#include "hierpar/strategy/run_guard.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <atomic>
#include <condition_variable>
#include <mutex>

namespace hs = hierpar::strategy;
using hierpar::testing::Child;
using hierpar::testing::exit_code;
using hierpar::testing::read_text;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kFaultStep = 4;  // rank 1's fault comes at the start of this step

hs::RunGuardOptions short_options() {
  hs::RunGuardOptions options;
  options.timeout = std::chrono::milliseconds(1500);
  options.heartbeat_interval = std::chrono::milliseconds(200);
  options.heartbeat_timeout = std::chrono::seconds(2);
  options.exit_grace = std::chrono::seconds(2);
  options.vote_interval = std::chrono::milliseconds(200);
  return options;
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
}

// Runs two ranks of RunGuardWorker.Run with `scenario`; `extra` adds to their environment.
std::vector<Child> run_ranks(const std::string& scenario, const std::string& dir,
                             const std::map<std::string, std::string>& extra = {}, int port = 0) {
  if (port == 0) port = hierpar::testing::free_port();
  std::vector<Child> children;
  for (int rank = 0; rank < 2; ++rank) {
    auto env = hierpar::testing::launch_environment(rank, 2, port);
    env["HIERPAR_GUARD_OUT"] = dir;
    env["HIERPAR_GUARD_SCENARIO"] = scenario;
    env.insert(extra.begin(), extra.end());
    children.push_back(hierpar::testing::spawn({hierpar::testing::self_executable(), "--gtest_filter=RunGuardWorker.Run"},
                                               env, dir + "/rank" + std::to_string(rank) + "." + scenario + ".log"));
  }
  hierpar::testing::wait_all(children, std::chrono::seconds(60));
  return children;
}

std::string value(const std::string& dir, const std::string& name, int rank) {
  return read_text(dir + "/" + name + std::to_string(rank));
}

std::string logs(const std::vector<Child>& children) {
  std::string text;
  for (size_t r = 0; r < children.size(); ++r) text += "--- rank " + std::to_string(r) + ":\n" + read_text(children[r].log);
  return text;
}

}  // namespace

// One rank of the runs below: HIERPAR_GUARD_SCENARIO is clean (5 steps), slow_start (5 steps, rank 1's first 2.5 s
// long), stop (rank 1 asks to stop at kFaultStep),
// throw, kill, freeze (SIGSTOP) or hang (rank 1, at the start of kFaultStep). Rank 0 enters a "collective" every
// step, which from kFaultStep on (in the faults) waits for the guard's abort. Each rank writes what happened to files.
TEST(RunGuardWorker, Run) {
  const char* out_dir = std::getenv("HIERPAR_GUARD_OUT");
  if (out_dir == nullptr) GTEST_SKIP() << "the worker half of RunGuard.*: runs only in the processes they start";
  const std::string out = out_dir, scenario = std::getenv("HIERPAR_GUARD_SCENARIO");
  const auto launch = hs::Launch::from_env();
  auto record = [&](const std::string& name, const std::string& text) {
    std::ofstream(out + "/" + name + std::to_string(launch.rank)) << text;
  };
  hs::RunGuard guard(launch, short_options());
  std::atomic<int64_t> entered{0};
  std::mutex mutex;
  std::condition_variable aborted;
  std::string abort_reason;
  guard.watch(
      [&](const std::string& reason) {
        std::lock_guard<std::mutex> lock(mutex);
        abort_reason = reason;
        aborted.notify_all();
        record("aborted_at", std::to_string(now_ms()));
      },
      [&] { return entered.load(); });
  const bool faulty = launch.rank == 1;
  try {
    bool stopped = false;
    for (int64_t step = 1; step <= 5000 && !stopped; ++step) {
      guard.begin_step(step);
      // A first step longer than the timeout (startup_timeout, 60 s, bounds it), as capturing CUDA graphs can be.
      if (faulty && step == 1 && scenario == "slow_start") std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      if (faulty && step == kFaultStep) {
        if (scenario == "kill" || scenario == "freeze") {
          record("killed_at", std::to_string(now_ms()));
          ::raise(scenario == "kill" ? SIGKILL : SIGSTOP);
        }
        if (scenario == "hang") {
          for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
        }
        if (scenario == "throw") throw std::runtime_error("boom in the loss");
        if (scenario == "stop") guard.request_stop("a test's request");
      }
      ++entered;
      // Rank 0 waits in step 1's collective for the slow rank 1 (its progress ahead meanwhile).
      if (!faulty && step == 1 && scenario == "slow_start") std::this_thread::sleep_for(std::chrono::milliseconds(2600));
      if (!faulty && step >= kFaultStep && scenario != "clean" && scenario != "stop" && scenario != "slow_start") {
        std::unique_lock<std::mutex> lock(mutex);
        aborted.wait(lock, [&] { return !abort_reason.empty(); });
        hs::throw_peer_failure("the collective stopped: " + abort_reason);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(faulty ? 35 : 20));  // the ranks drift apart
      stopped = guard.end_step(step);
      if (stopped) record("stopped_after", std::to_string(step));
      if ((scenario == "clean" || scenario == "slow_start") && step == 5) break;
    }
    if (stopped && launch.rank == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));  // writes the checkpoint
      record("saved_at", std::to_string(now_ms()));
    }
    guard.finish(stopped);
    record("finished_at", std::to_string(now_ms()));
    std::fflush(nullptr);
    std::_Exit(stopped ? 130 : 0);
  } catch (const std::exception& e) {
    record("message", guard.fail(e));
    std::fflush(nullptr);
    std::_Exit(1);
  }
}

// An interrupt on one rank (here request_stop() on rank 1 in step 4) stops both after the same step, no earlier;
// rank 1 leaves only after rank 0 has written its checkpoint; both exit 130.
TEST(RunGuard, InterruptOnOneRankStopsEveryRankAfterTheSameStep) {
  const std::string dir = hierpar::testing::temp_dir("guard_stop");
  const auto children = run_ranks("stop", dir);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(exit_code(children[r]), 130) << logs(children);
  const int64_t stopped0 = std::stoll(value(dir, "stopped_after", 0)), stopped1 = std::stoll(value(dir, "stopped_after", 1));
  EXPECT_EQ(stopped0, stopped1) << "the ranks must agree on the step";
  EXPECT_GE(stopped0, kFaultStep);
  EXPECT_LE(stopped0, kFaultStep + 40) << "votes come about every 0.2 s, at most a few dozen steps apart";
  EXPECT_GE(std::stoll(value(dir, "finished_at", 1)), std::stoll(value(dir, "saved_at", 0)))
      << "rank 1 must wait for rank 0's checkpoint";
  hierpar::testing::remove_dir(dir);
}

// A rank that throws publishes its failure; the other, blocked in a collective, is aborted at once, and both
// report the same line naming rank 1 and the cause.
TEST(RunGuard, FailingRankIsNamedByEveryRankAtOnce) {
  const std::string dir = hierpar::testing::temp_dir("guard_throw");
  const auto children = run_ranks("throw", dir);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(exit_code(children[r]), 1) << logs(children);
    EXPECT_EQ(value(dir, "message", r), "rank 1 failed in step 4: boom in the loss") << logs(children);
  }
  EXPECT_LT(children[0].seconds, 15.0) << "rank 0 waits for no timeout";
  hierpar::testing::remove_dir(dir);
}

// A rank killed with SIGKILL on the same host is seen at once (its process is gone), long before the heartbeat
// timeout (2 s here): the other is aborted and names rank 1 as dead.
TEST(RunGuard, KilledRankOnTheSameHostIsNamedAtOnce) {
  const std::string dir = hierpar::testing::temp_dir("guard_kill");
  const auto children = run_ranks("kill", dir);
  EXPECT_EQ(exit_code(children[1]), -SIGKILL) << logs(children);
  EXPECT_EQ(exit_code(children[0]), 1) << logs(children);
  EXPECT_EQ(value(dir, "message", 0).rfind("rank 1 died (its process, pid " + std::to_string(children[1].pid), 0), 0u)
      << value(dir, "message", 0);
  const double seen = (std::stoll(value(dir, "aborted_at", 0)) - std::stoll(value(dir, "killed_at", 1))) / 1000.0;
  EXPECT_LT(seen, 1.5) << "0.2 s heartbeats, and the process is seen gone";
  hierpar::testing::remove_dir(dir);
}

// A rank that stops beating while its process lives (frozen here by SIGSTOP; on another host a death looks the same)
// is named after the heartbeat timeout, 2 s here, and not before.
TEST(RunGuard, FrozenRankIsNamedAfterTheHeartbeatTimeout) {
  const std::string dir = hierpar::testing::temp_dir("guard_freeze");
  const int port = hierpar::testing::free_port();
  std::vector<Child> children;
  for (int rank = 0; rank < 2; ++rank) {
    auto env = hierpar::testing::launch_environment(rank, 2, port);
    env["HIERPAR_GUARD_OUT"] = dir;
    env["HIERPAR_GUARD_SCENARIO"] = "freeze";
    children.push_back(hierpar::testing::spawn({hierpar::testing::self_executable(), "--gtest_filter=RunGuardWorker.Run"},
                                               env, dir + "/rank" + std::to_string(rank) + ".freeze.log"));
  }
  std::vector<Child> rank0{children[0]};
  hierpar::testing::wait_all(rank0, std::chrono::seconds(60));
  ::kill(children[1].pid, SIGKILL);
  ::waitpid(children[1].pid, nullptr, 0);
  EXPECT_EQ(exit_code(rank0[0]), 1) << logs(children);
  EXPECT_EQ(value(dir, "message", 0).rfind("rank 1 stopped responding (last heartbeat", 0), 0u) << value(dir, "message", 0);
  const double seen = (std::stoll(value(dir, "aborted_at", 0)) - std::stoll(value(dir, "killed_at", 1))) / 1000.0;
  EXPECT_GT(seen, 1.8) << "a silence shorter than the heartbeat timeout (2 s) is not a death";
  EXPECT_LT(seen, 6.0) << "2 s heartbeat timeout, 0.2 s heartbeats";
  hierpar::testing::remove_dir(dir);
}

// A rank that hangs before a collective its peer waits in is named after the timeout (1.5 s here), by its
// progress; the peer is aborted, and the hung rank ends by itself exit_grace (2 s) later.
TEST(RunGuard, HungRankIsNamedAfterTheTimeout) {
  const std::string dir = hierpar::testing::temp_dir("guard_hang");
  const auto children = run_ranks("hang", dir);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(exit_code(children[r]), 1) << logs(children);
  EXPECT_EQ(value(dir, "message", 0).rfind("rank 1 hangs in step 4: no progress for", 0), 0u) << value(dir, "message", 0);
  EXPECT_NE(read_text(children[1].log).find("error: rank 1 hangs in step 4"), std::string::npos)
      << "the hung rank says why it exits:\n" << logs(children);
  EXPECT_LT(children[1].seconds, 20.0);
  hierpar::testing::remove_dir(dir);
}

// A first step that takes longer than the timeout (2.5 s against 1.5 s) is startup, not a hang: both ranks finish.
TEST(RunGuard, SlowFirstStepIsNotAHang) {
  const std::string dir = hierpar::testing::temp_dir("guard_slow_start");
  const auto children = run_ranks("slow_start", dir);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(exit_code(children[r]), 0) << value(dir, "message", r) << logs(children);
  hierpar::testing::remove_dir(dir);
}

// torchrun's agent store outlives an attempt: a run on the same store after one that failed must not read its keys
// (its failure, its heartbeats). Here this test serves the store, as the agent would.
TEST(RunGuard, AttemptOnAStoreThatOutlivedAFailedOneStartsClean) {
  const std::string dir = hierpar::testing::temp_dir("guard_attempts");
  const int port = hierpar::testing::free_port();
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(port);
  options.isServer = true;
  options.waitWorkers = false;
  c10d::TCPStore agent_store("127.0.0.1", options);
  const std::map<std::string, std::string> agent{{"TORCHELASTIC_USE_AGENT_STORE", "True"}};
  const auto failed = run_ranks("throw", dir, agent, port);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(exit_code(failed[r]), 1) << logs(failed);
  const auto next = run_ranks("clean", dir, agent, port);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(exit_code(next[r]), 0) << logs(next);
  hierpar::testing::remove_dir(dir);
}

// In one process there is no store: a stop is agreed at once, and a failure is its own cause.
TEST(RunGuard, OneProcessStopsAtTheRequestedStep) {
  hs::RunGuard guard(hs::Launch{}, short_options());
  EXPECT_FALSE(guard.store());
  guard.begin_step(1);
  EXPECT_FALSE(guard.end_step(1));
  guard.begin_step(2);
  guard.request_stop("a test's request");
  EXPECT_TRUE(guard.end_step(2));
  EXPECT_EQ(guard.stop_reason(), "a test's request on rank 0");
  EXPECT_EQ(guard.fail(std::runtime_error("the disk is full\nmore detail")), "the disk is full");
  EXPECT_TRUE(guard.failed());
}
