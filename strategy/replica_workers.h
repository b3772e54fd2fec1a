// AdversarialTrainer's replica threads (internal to strategy/; adversarial_trainer.cpp runs every step through them).
#pragma once

#include "hierpar/strategy/adversarial_trainer.h"

#include <ATen/ThreadLocalState.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <iomanip>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace hierpar::strategy {

// One persistent thread per local replica after the first (which runs on the caller's thread): the
// seed's one host thread per device. run() hands every replica the same job with the caller's
// thread-local state (grad mode, autocast), waits for all, and rethrows the first failure after
// telling the averager, so replicas waiting on the failed one stop instead of hanging. A replica that
// has not returned kStuckGrace after the first failure (or after interrupt()) is left behind as hung:
// run() throws naming it, and its thread keeps what it uses (the shared state, the job) alive. A replica that
// has not returned `straggler_limit` after replica 0 did is hung too: with collectives captured in the graphs the
// others do not wait for it on the host (their GPUs spin in the all-reduce), so no failure would come otherwise.
class AdversarialTrainer::Workers {
 public:
  // Long enough for a replica released by an abort to unwind its step (a device sync on queued work
  // included), short enough to keep a stop within seconds.
  static constexpr std::chrono::seconds kStuckGrace{3};

  Workers(int64_t replicas, bool report_failures, std::chrono::milliseconds straggler_limit)
      : shared_(std::make_shared<Shared>(replicas)), straggler_limit_(straggler_limit) {
    shared_->report = report_failures;
    for (int64_t i = 1; i < replicas; ++i) threads_.emplace_back([shared = shared_, i] { loop(*shared, i); });
  }
  ~Workers() {
    {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      shared_->stopping = true;
    }
    shared_->start.notify_all();
    for (size_t t = 0; t < threads_.size(); ++t) {
      std::unique_lock<std::mutex> lock(shared_->mutex);
      const bool idle = shared_->done.wait_for(lock, kStuckGrace, [&] { return !shared_->running[t + 1]; });
      lock.unlock();
      if (idle) {
        threads_[t].join();
      } else {
        threads_[t].detach();  // a hung replica: see stuck()
      }
    }
  }

  // Waits at most `limit` for every replica's thread to be out of its job; false if one is still in it (it
  // never returned from a failed step, and may still wake up and use the trainer).
  bool settle(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(shared_->mutex);
    return shared_->done.wait_for(lock, limit, [&] {
      return std::none_of(shared_->running.begin(), shared_->running.end(), [](bool r) { return r; });
    });
  }

  // Ends run()'s wait as a failure elsewhere would: replicas still running after kStuckGrace are hung.
  void interrupt(const std::string& reason) {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    if (shared_->interrupted.empty()) shared_->interrupted = reason;
    shared_->done.notify_all();
  }

  void run(std::function<void(int64_t)> job, GradientAverager* averager, const Placement& placement) {
    run(std::move(job), averager, placement, straggler_limit_);
  }
  // The same, with another bound for the replicas after replica 0 (a step that may be much slower on one replica:
  // cuDNN's autotuning, a CUDA graph's capture).
  void run(std::function<void(int64_t)> job, GradientAverager* averager, const Placement& placement,
           std::chrono::milliseconds straggler_limit) {
    Shared& sh = *shared_;
    {
      std::lock_guard<std::mutex> lock(sh.mutex);
      TORCH_CHECK(!std::any_of(sh.running.begin(), sh.running.end(), [](bool r) { return r; }),
                  "AdversarialTrainer: a replica's thread is still stuck in an earlier step");
      sh.job = std::make_shared<const std::function<void(int64_t)>>(std::move(job));
      sh.averager = averager;
      sh.placement = &placement;
      sh.state = std::make_shared<at::ThreadLocalState>();
      sh.streams = current_streams(placement);
      for (auto& e : sh.errors) e = nullptr;
      sh.peer_failure.assign(sh.errors.size(), false);
      sh.first_failure = -1;
      sh.interrupted.clear();
      std::fill(sh.running.begin(), sh.running.end(), true);
      ++sh.generation;
    }
    sh.start.notify_all();
    execute(sh, 0);
    std::vector<int64_t> stuck;
    bool straggling = false;
    {
      std::unique_lock<std::mutex> lock(sh.mutex);
      auto all_returned = [&] { return std::none_of(sh.running.begin(), sh.running.end(), [](bool r) { return r; }); };
      const bool ended = sh.done.wait_for(lock, straggler_limit, [&] {
        return all_returned() || sh.first_failure >= 0 || !sh.interrupted.empty();
      });
      straggling = !ended;
      if (straggling || !sh.done.wait_for(lock, kStuckGrace, all_returned)) {
        for (size_t i = 0; i < sh.running.size(); ++i) {
          if (sh.running[i]) stuck.push_back(static_cast<int64_t>(i));
        }
      }
    }
    if (stuck.empty() && sh.first_failure < 0 && sh.interrupted.empty()) return;
    // Hung replicas first (the others were stopped by them), then the replica that failed first.
    std::string message;
    bool peer = stuck.empty();
    for (int64_t i : stuck) {
      message += c10::str(message.empty() ? "" : "\nthen ", describe(sh, i), " hangs: ",
                          straggling ? c10::str("it had not returned from its step ", seconds(straggler_limit),
                                                " after replica 0 did (the timeout)")
                                     : c10::str("the other replicas stopped waiting for it, and it did not return "
                                                "within ", kStuckGrace.count(), " s"));
    }
    // The others' captured collectives wait on the GPU for the hung one: aborting the communicators releases them.
    if (straggling && sh.averager != nullptr) sh.averager->abort(message.substr(0, message.find('\n')));
    if (!sh.interrupted.empty()) message += c10::str(message.empty() ? "" : "\nthen ", sh.interrupted);
    // A step that ran out of device memory throws c10::OutOfMemoryError, as one replica alone would, so that callers
    // (the batch-size search, a user's retry at a smaller batch) can tell it from other failures.
    bool out_of_memory = stuck.empty() && sh.interrupted.empty();
    bool first = true;
    for (int64_t i : failure_order(sh)) {
      peer = peer && sh.peer_failure[i];
      try {
        std::rethrow_exception(sh.errors[i]);
      } catch (const c10::OutOfMemoryError& e) {
        message += c10::str(message.empty() ? "" : "\nthen ", describe(sh, i), " failed: ", e.what_without_backtrace());
      } catch (const c10::Error& e) {
        out_of_memory = out_of_memory && !first;
        message += c10::str(message.empty() ? "" : "\nthen ", describe(sh, i), " failed: ", e.what_without_backtrace());
      } catch (const std::exception& e) {
        out_of_memory = out_of_memory && !first;
        message += c10::str(message.empty() ? "" : "\nthen ", describe(sh, i), " failed: ", e.what());
      } catch (...) {
        out_of_memory = out_of_memory && !first;
        message += c10::str(message.empty() ? "" : "\nthen ", describe(sh, i), " failed");
      }
      first = false;
    }
    if (out_of_memory && !first) TORCH_CHECK_WITH(OutOfMemoryError, false, message);
    if (peer) throw_peer_failure(message);
    TORCH_CHECK(false, message);
  }

 private:
  struct Shared {
    explicit Shared(int64_t replicas) : errors(replicas), peer_failure(replicas, false), running(replicas, false) {}
    mutable std::mutex mutex;
    std::condition_variable start, done;
    uint64_t generation = 0;
    bool stopping = false;
    std::shared_ptr<const std::function<void(int64_t)>> job;
    GradientAverager* averager = nullptr;
    const Placement* placement = nullptr;  // the running job's
    std::shared_ptr<at::ThreadLocalState> state;
    // The caller's current stream on each device of the placement, which the other replicas' threads make current
    // too (ThreadLocalState does not carry streams): work the caller queued on its streams (the batch) comes first.
    std::vector<c10::Stream> streams;
    std::vector<std::exception_ptr> errors;
    std::vector<bool> peer_failure;  // errors[i] is a PeerFailure
    std::vector<bool> running;       // replica i has not returned from the current job
    int64_t first_failure = -1;
    std::string interrupted;
    bool report = true;  // AdversarialOptions::report_failures
  };

  static std::vector<c10::Stream> current_streams(const Placement& placement) {
    std::vector<c10::Stream> streams;
    for (const ReplicaDevices& r : placement.replicas) {
      for (const c10::Device& d : {r.generator, r.discriminator}) {
        if (d.is_cpu() || std::any_of(streams.begin(), streams.end(), [&](const c10::Stream& s) { return s.device() == d; }))
          continue;
        streams.push_back(c10::impl::VirtualGuardImpl(d.type()).getStream(d));
      }
    }
    return streams;
  }

  static std::string seconds(std::chrono::milliseconds d) {
    std::ostringstream out;
    out << std::fixed << std::setprecision(1) << static_cast<double>(d.count()) / 1000.0 << " s";
    return out.str();
  }

  static std::vector<int64_t> failure_order(const Shared& sh) {
    std::vector<int64_t> order;
    if (sh.first_failure >= 0) order.push_back(sh.first_failure);
    for (int64_t i = 0; i < static_cast<int64_t>(sh.errors.size()); ++i) {
      if (sh.errors[i] && i != sh.first_failure) order.push_back(i);
    }
    return order;
  }

  static std::string describe(const Shared& sh, int64_t i) {
    const ReplicaDevices& r = sh.placement->replicas[i];
    if (r.part != ReplicaPart::whole) return c10::str("replica ", r.replica, "'s ", to_string(r.part), " (", r.generator, ")");
    return c10::str("replica ", r.replica, " (G ", r.generator, ", D ", r.discriminator, ")");
  }

  static void execute(Shared& sh, int64_t i) {
    std::shared_ptr<const std::function<void(int64_t)>> job;
    std::shared_ptr<at::ThreadLocalState> state;
    std::vector<c10::Stream> streams;
    {
      std::lock_guard<std::mutex> lock(sh.mutex);
      job = sh.job;
      state = sh.state;
      streams = sh.streams;
    }
    std::exception_ptr error;
    bool peer = false;
    std::string what;
    try {
      at::ThreadLocalStateGuard guard(*state);
      const c10::MultiStreamGuard on_callers_streams(streams);
      (*job)(i);
    } catch (const PeerFailure& e) {
      error = std::current_exception();
      peer = true;
      what = e.what_without_backtrace();
    } catch (const c10::Error& e) {
      error = std::current_exception();
      what = e.what_without_backtrace();
    } catch (const std::exception& e) {
      error = std::current_exception();
      what = e.what();
    } catch (...) {
      error = std::current_exception();
      what = "an exception that is not a std::exception";
    }
    if (error) {
      {
        std::lock_guard<std::mutex> lock(sh.mutex);
        sh.errors[i] = error;
        sh.peer_failure[i] = peer;
        if (sh.first_failure < 0) sh.first_failure = i;
      }
      stop_peers(sh, i, what, peer);
    }
    {
      std::lock_guard<std::mutex> lock(sh.mutex);
      sh.running[i] = false;
    }
    sh.done.notify_all();
  }

  // Tells the averager, so peers blocked on this replica stop. With report_failures, a replica's own error is
  // said now, in one line: a collective library's watchdog may end the process before the step rethrows it.
  static void stop_peers(Shared& sh, int64_t i, const std::string& what, bool peer) {
    if (sh.averager == nullptr) return;
    const std::string first_line = what.substr(0, what.find('\n'));
    if (!peer && sh.report) TORCH_WARN(describe(sh, i), " failed: ", first_line, " (its peers stop)");
    sh.averager->abort(c10::str("replica ", sh.placement->replicas[i].replica, " failed: ", first_line));
  }

  static void loop(Shared& sh, int64_t i) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(sh.mutex);
        sh.start.wait(lock, [&] { return sh.stopping || sh.generation != seen; });
        if (sh.stopping) return;
        seen = sh.generation;
      }
      execute(sh, i);
    }
  }

  std::shared_ptr<Shared> shared_;
  std::chrono::milliseconds straggler_limit_;  // AveragingOptions::timeout
  std::vector<std::thread> threads_;
};

}  // namespace hierpar::strategy
