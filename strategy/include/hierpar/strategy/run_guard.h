// A run of one or many processes (torchrun, srun, or started by hand) that fails well. One RunGuard per
// process, around the training loop:
//  - a watchdog thread publishes a heartbeat (and this process's progress) through the launch store every
//    heartbeat_interval and reads every peer's: a rank that dies is seen within a heartbeat_interval where its
//    process was on this host (under the same torchrun agent), within heartbeat_timeout elsewhere or when it
//    freezes; a step that makes no progress for `timeout` is a hang, and the rank that stopped making progress is
//    named; a failure anywhere is published once (the first one wins), and every process aborts its process
//    groups (watch()'s callback) so that collectives blocked on the failed peer return;
//  - each rank stops with one line naming the first failed rank and its cause (fail()), and a process whose
//    main thread stays stuck anyway exits by itself exit_grace after the failure, with that line;
//  - an interrupt (SIGINT or SIGTERM to any rank, or request_stop()) stops every rank after the same step:
//    ranks vote through the store about every vote_interval at step boundaries (end_step()), so they agree
//    without an extra collective; rank 0 then writes its checkpoint while the others wait for it (finish());
//    a second signal exits at once, and so does a process whose launcher (torchrun) is gone;
//  - every key lives under a namespace the ranks agree on when they connect (connect_launch_store), so a run
//    restarted by torchrun --max-restarts never reads the keys of the attempt that failed.
// In a one-process run there is no store: the guard keeps the interrupt and the last-resort exit.
//
//   hierpar::strategy::RunGuard::install_signal_handlers("hierpar-dcgan");
//   hierpar::strategy::RunGuard guard(placement.launch, guard_options);
//   options.averaging.store = guard.store();
//   AdversarialTrainer trainer(g, d, placement, options);
//   guard.watch([&](const std::string& why) { trainer.abort(why); }, [&] { return trainer.progress(); });
//   for (int64_t step = 1;; ++step) {
//     guard.begin_step(step);
//     trainer.step(batch);                   // on an exception: std::cerr << guard.fail(e); exit 1
//     if (guard.end_step(step)) break;       // every rank agreed to stop after this step
//   }
//   if (rank == 0) save_checkpoint(...);
//   guard.finish(stopped);
#pragma once

#include "hierpar/strategy/placement.h"

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>

namespace c10d {
class Store;
}

namespace hierpar::strategy {

struct RunGuardOptions {
  // A step that has not finished after this long while no rank makes progress is a hang (the example's
  // --timeout). Give the process groups a longer timeout (the example adds heartbeat_timeout), so that the
  // guard, which can name the rank that hangs, acts first.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  // The first `startup_steps` steps of a process (lazy initialisation, cuDNN's autotuning, CUDA graph warm-up and
  // capture, slower still with other processes sharing the GPUs) are a hang only after `startup_timeout`, if longer.
  int64_t startup_steps = 1;
  std::chrono::milliseconds startup_timeout{std::chrono::seconds(60)};
  std::chrono::milliseconds heartbeat_interval{500};
  std::chrono::milliseconds heartbeat_timeout{std::chrono::seconds(5)};  // a rank silent this long is dead
  // After a failure, the process exits by itself this long later if its main thread has not.
  std::chrono::milliseconds exit_grace{std::chrono::seconds(3)};
  // An interrupt that no step boundary has answered this long after it came exits at once (no checkpoint).
  std::chrono::milliseconds stop_grace{std::chrono::seconds(8)};
  // Ranks vote on stopping at step boundaries about this often: the last to arrive at a vote schedules the next
  // from its step time, so a stop comes this long after the request, or stop_grace if steps slow down 30-fold.
  std::chrono::milliseconds vote_interval{250};
};

class RunGuard {
 public:
  // Connects to the launch store (a multi-process `launch`) and starts the watchdog. A multi-process run ignores
  // SIGPIPE, as Python does: a write to a peer that died must fail with an error, not kill the process.
  explicit RunGuard(const Launch& launch, RunGuardOptions options = {});
  // Stops the watchdog; after a failure it is left to exit with the process instead of being waited for.
  ~RunGuard();
  RunGuard(const RunGuard&) = delete;
  RunGuard& operator=(const RunGuard&) = delete;

  // The store this attempt's processes meet in, for the process groups (AveragingOptions::store); null in a
  // one-process run.
  c10::intrusive_ptr<c10d::Store> store() const;

  // What the watchdog calls once when the run fails (abort this process's process groups: any thread, must
  // not block), and where it reads this process's progress (collectives entered: a hung rank's stops).
  void watch(std::function<void(const std::string& reason)> abort, std::function<int64_t()> progress);

  // The main thread, around each training step (global step numbers, increasing). end_step() returns true
  // when every rank agreed to stop after this step (an interrupt anywhere), the same answer on every rank;
  // it throws a PeerFailure when the run failed elsewhere.
  void begin_step(int64_t step);
  bool end_step(int64_t step);

  // Asks every rank to stop at the next agreed step boundary (any thread).
  void request_stop(const std::string& why);
  // SIGINT and SIGTERM: the first asks for a stop (every RunGuard of the process sees it), the second
  // exits at once with status 130, saying so on stderr as "<program>: ...".
  static void install_signal_handlers(const std::string& program);
  // Whether a stop signal arrived in this process (async-signal-safe to set, safe to read anywhere).
  static bool signalled();
  // Who asked for the stop that end_step() agreed on, e.g. "SIGTERM on rank 1" (empty before).
  std::string stop_reason() const;

  // This process failed with `error` (from the step or the training loop): publishes the failure unless an
  // earlier one elsewhere caused it, makes the process exit within exit_grace even if a thread stays stuck,
  // and returns the one line to print: the first failed rank and its cause. A PeerFailure (this rank only
  // waited for others) first gives the watchdog time to find its cause (a dead, failed or hung peer).
  std::string fail(const std::exception& error);
  // Whether the run failed (here or elsewhere): the caller should then not wait on its process groups,
  // e.g. leave them undestroyed and end the process with std::_Exit.
  bool failed() const;
  // The main thread is about to exit with `status` after printing its line: the last-resort exit then
  // prints nothing more.
  static void exiting();

  // After the training loop (and, on rank 0, after the checkpoint): with `stopped` (an agreed stop) the
  // other ranks wait until rank 0 says its checkpoint is written, so that a launcher reacting to their exit
  // cannot kill rank 0 mid-write; then each rank says it is done (no watchdog takes its exit for a death),
  // and the rank serving the store waits for the others. Bounded by `timeout`; throws if the run failed.
  void finish(bool stopped);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace hierpar::strategy
