#include "hierpar/strategy/run_guard.h"

#include "hierpar/strategy/averaging.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

namespace hierpar::strategy {
namespace {

using Clock = std::chrono::steady_clock;

// Set by the signal handler (async-signal-safe: lock-free atomics and write()).
std::atomic<int> g_signals{0};
std::atomic<int> g_first_signal{0};
std::atomic<bool> g_exiting{false};
char g_program[64] = "hierpar";

extern "C" void on_stop_signal(int signo) {
  if (g_signals.fetch_add(1) == 0) {
    g_first_signal.store(signo);
    return;
  }
  static const char kSecond[] = ": second interrupt: exiting at once (the last checkpoint written resumes)\n";
  const ssize_t a = ::write(STDERR_FILENO, g_program, std::strlen(g_program));
  const ssize_t b = ::write(STDERR_FILENO, kSecond, sizeof kSecond - 1);
  (void)a;
  (void)b;
  ::_exit(130);
}

const char* signal_name(int signo) {
  switch (signo) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    default: return "a signal";
  }
}

std::string first_line(const std::exception& error) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&error);
  const std::string text = c10_error != nullptr ? c10_error->what_without_backtrace() : error.what();
  return text.substr(0, text.find('\n'));
}

std::string seconds(Clock::duration d) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", std::chrono::duration<double>(d).count());
  return text;
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// Prints "<program>: <line>" unless the main thread already printed its own, and ends the process.
[[noreturn]] void exit_now(int status, const std::string& line) {
  if (!g_exiting.exchange(true)) std::fprintf(stderr, "%s: %s\n", g_program, line.c_str());
  std::fflush(nullptr);
  std::_Exit(status);
}

// Store keys, under the attempt's prefix.
const std::string kFailure = "guard/failure";            // the run's first failure, one line
const std::string kFailureSeen = "guard/failure/seen";   // ranks that read it
const std::string kStop = "guard/stop";                  // who asked for a stop
const std::string kEvents = "guard/events";              // bumped when kFailure or kStop is written
const std::string kSaved = "guard/saved";                // rank 0's checkpoint after an agreed stop is written
std::string beat_key(int64_t rank) { return "guard/beat/" + std::to_string(rank); }
std::string process_key(int64_t rank) { return "guard/process/" + std::to_string(rank); }

// What identifies this process's pid namespace on this machine: a peer with the same value is a process here,
// whose death kill(pid, 0) sees at once. Ranks of different torchrun agents (GROUP_RANK) count as on different
// hosts even on one machine, so that two agents on one host fail as two hosts would.
std::string pid_namespace() {
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  char ns[128] = {0};
  const ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  const char* agent = std::getenv("GROUP_RANK");
  return c10::str(host, "/", boot, "/", n > 0 ? std::string(ns, n) : std::string("?"), "/", agent != nullptr ? agent : "");
}

// False once process `pid` is gone (or a zombie not yet reaped by its parent).
bool process_alive(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;  // no procfs: only the heartbeat tells
  const auto paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] != 'Z';
}
std::string vote_key(int64_t step, const char* what) { return "guard/vote/" + std::to_string(step) + "/" + what; }

}  // namespace

struct RunGuard::State {
  Launch launch;
  RunGuardOptions options;
  bool multi = false;
  c10::intrusive_ptr<c10d::Store> store;        // the main thread's (and the process groups')
  c10::intrusive_ptr<c10d::Store> watch_store;  // the watchdog's own connection: never queued behind a long call
  std::thread watchdog;
  pid_t launcher = 0;  // torchrun's pid: when it is gone, nothing will stop or restart this process
  Clock::time_point started = Clock::now();

  std::mutex mutex;
  std::condition_variable changed;
  bool stopping = false;
  std::function<void(const std::string&)> abort;
  std::function<int64_t()> progress;
  std::string failure;  // the run's first failure, once known
  bool reaper_armed = false;
  std::string stop_request;  // a local request (request_stop)
  std::string stop_from;     // who asked, as published
  bool stop_published = false;
  bool stop_seen = false;    // here or elsewhere
  Clock::time_point stop_seen_at;
  bool stop_agreed = false;
  bool done = false;

  std::atomic<bool> in_step{false};
  std::atomic<int64_t> step{0};
  std::atomic<int64_t> step_began{0};  // Clock ticks
  std::atomic<int64_t> steps_ended{0};
  std::atomic<int64_t> steps_begun{0};
  std::atomic<bool> startup_step{false};  // the step in progress is one of the first options.startup_steps

  // The main thread's vote schedule.
  int64_t next_vote = 0;
  int64_t last_vote_step = -1;
  Clock::time_point last_vote_time;

  // The watchdog's view of the peers.
  int64_t beats = 0;
  int64_t events_seen = 0;
  bool all_beating = false;
  std::vector<std::string> last_beat;
  std::vector<Clock::time_point> last_change;
  std::vector<pid_t> local_pid;  // per rank: its pid when it runs in this pid namespace, else 0
  std::vector<int64_t> dead;  // ranks seen dead: nobody waits for them to read the failure
  Clock::time_point store_answered = Clock::now();

  int64_t rank() const { return launch.rank; }
  int64_t world() const { return launch.world_size; }

  bool failed() {
    std::lock_guard<std::mutex> lock(mutex);
    return !failure.empty();
  }
  std::string failure_text() {
    std::lock_guard<std::mutex> lock(mutex);
    return failure;
  }

  std::string local_stop_reason() {
    if (g_signals.load() > 0) return c10::str(signal_name(g_first_signal.load()), " on rank ", rank());
    std::lock_guard<std::mutex> lock(mutex);
    return stop_request;
  }

  int64_t progress_now() {
    std::function<int64_t()> read;
    {
      std::lock_guard<std::mutex> lock(mutex);
      read = progress;
    }
    return (read ? read() : 0) + steps_ended.load();
  }

  // The run failed with `message`: the first failure known here is kept (published first when `publish`,
  // where an earlier one published elsewhere wins), the process groups are aborted and the last-resort
  // exit is armed, `grace` from now (exit_grace by default). Returns the failure kept.
  std::string record_failure(const std::string& message, bool publish, c10d::Store* through,
                             std::optional<std::chrono::milliseconds> grace = std::nullopt) {
    std::string kept = message;
    if (publish && multi && through != nullptr) {
      try {
        kept = text(through->compareSet(kFailure, {}, bytes(message)));
        through->add(kEvents, 1);
      } catch (const std::exception&) {
        // The store is gone: this process still stops, with its own view of the cause.
      }
    }
    std::function<void(const std::string&)> abort_groups;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!failure.empty()) return failure;
      failure = kept;
      abort_groups = abort;
      arm_reaper_locked(1, failure, grace.value_or(options.exit_grace));
    }
    changed.notify_all();
    if (abort_groups) abort_groups(kept);
    return kept;
  }

  void arm_reaper_locked(int status, const std::string& line, std::chrono::milliseconds grace) {
    if (reaper_armed) return;
    reaper_armed = true;
    std::thread([grace, status, line] {
      std::this_thread::sleep_for(grace);
      exit_now(status, c10::str("error: ", line, " (exiting: the process did not stop within ",
                                seconds(grace), " of the failure)"));
    }).detach();
  }

  void tick();
  void watch_peers(Clock::time_point now);
  void check_hang(Clock::time_point now);
  bool vote(int64_t step, bool stop);
};

void RunGuard::State::tick() {
  const auto now = Clock::now();
  const std::string local_stop = local_stop_reason();
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!local_stop.empty() && !stop_seen) {
      stop_seen = true;
      stop_seen_at = now;
      stop_from = local_stop;
    }
  }
  // After a failure the store may be going away with its host: no more calls (each failed one warns).
  if (multi && !failed()) watch_peers(now);
  check_hang(now);

  std::string stop_line;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (stop_seen && !stop_agreed && failure.empty() && now - stop_seen_at > options.stop_grace) {
      stop_line = c10::str("interrupted (", stop_from, "), but no step boundary came within ",
                           seconds(options.stop_grace), ": exiting without a checkpoint (the last one written resumes)");
    }
  }
  if (!stop_line.empty()) exit_now(130, stop_line);
  if (launcher != 0 && ::getppid() != launcher) {
    exit_now(g_signals.load() > 0 ? 130 : 1,
             c10::str("error: rank ", rank(), ": its launcher (torchrun, pid ", launcher,
                      ") exited; stopping at once (the last checkpoint written resumes)"));
  }
}

void RunGuard::State::watch_peers(Clock::time_point now) {
  std::vector<std::string> beats_now;
  try {
    std::string value;
    {
      std::lock_guard<std::mutex> lock(mutex);
      value = done ? "done" : "";
    }
    if (value.empty()) value = c10::str(++beats, " ", progress_now(), " ", step.load());
    watch_store->set(beat_key(rank()), bytes(value));

    const std::string local_stop = local_stop_reason();
    if (!local_stop.empty() && !stop_published) {
      watch_store->compareSet(kStop, {}, bytes(local_stop));
      watch_store->add(kEvents, 1);
      stop_published = true;
    }
    const int64_t events = watch_store->add(kEvents, 0);
    if (events != events_seen) {
      events_seen = events;
      if (watch_store->check({kFailure})) {
        const std::string remote = text(watch_store->get(kFailure));
        if (!failed()) {
          watch_store->add(kFailureSeen, 1);
          record_failure(remote, false, nullptr);
        }
      }
      if (watch_store->check({kStop})) {
        const std::string who = text(watch_store->get(kStop));
        std::lock_guard<std::mutex> lock(mutex);
        if (!stop_seen) {
          stop_seen = true;
          stop_seen_at = now;
        }
        stop_from = who;
      }
    }
    std::vector<std::string> keys;
    for (int64_t r = 0; r < world(); ++r) keys.push_back(beat_key(r));
    if (!all_beating) all_beating = watch_store->check(keys);
    if (all_beating) {
      for (const auto& b : watch_store->multiGet(keys)) beats_now.push_back(text(b));
    }
    store_answered = now;
  } catch (const std::exception& e) {
    if (now - store_answered > options.heartbeat_timeout && !failed()) {
      record_failure(c10::str("rank ", rank(), " lost the rendezvous store at ", launch.master_addr, ":",
                              launch.master_port, " for ", seconds(now - store_answered),
                              " (the launcher or rank 0 exited): ", first_line(e)),
                     false, nullptr);
    }
    return;
  }
  if (failed()) return;

  if (beats_now.empty()) {  // some rank has not published a heartbeat yet
    const auto startup = std::max(options.timeout, options.heartbeat_timeout);
    if (now - started > startup) {
      std::vector<std::string> keys;
      for (int64_t r = 0; r < world(); ++r) keys.push_back(beat_key(r));
      std::string missing;
      try {
        for (int64_t r = 0; r < world(); ++r) {
          if (!watch_store->check({keys[r]})) missing += c10::str(missing.empty() ? "" : ", ", r);
        }
      } catch (const std::exception&) {
      }
      record_failure(c10::str("rank ", missing.empty() ? "?" : missing, " did not start within ", seconds(startup)),
                     true, watch_store.get());
    }
    return;
  }
  if (last_beat.empty()) {
    last_beat = beats_now;
    last_change.assign(world(), now);
    local_pid.assign(world(), 0);
    try {
      std::vector<std::string> keys;
      for (int64_t r = 0; r < world(); ++r) keys.push_back(process_key(r));
      const auto values = watch_store->multiGet(keys);
      const std::string here = pid_namespace();
      for (int64_t q = 0; q < world(); ++q) {
        std::istringstream fields(text(values[q]));
        int64_t pid = 0;
        std::string where;
        fields >> pid >> where;
        if (q != rank() && where == here) local_pid[q] = static_cast<pid_t>(pid);
      }
    } catch (const std::exception&) {
    }
    return;
  }
  for (int64_t q = 0; q < world(); ++q) {
    // A rank on this machine that is gone (not having said it is done, nor published its failure) died: no need
    // to wait for its heartbeats to stop.
    if (local_pid[q] != 0 && beats_now[q] != "done" && !process_alive(local_pid[q])) {
      {
        std::lock_guard<std::mutex> lock(mutex);
        dead.push_back(q);
      }
      record_failure(c10::str("rank ", q, " died (its process, pid ", local_pid[q], " on this host, is gone: killed "
                              "or crashed)"),
                     true, watch_store.get());
      return;
    }
    if (beats_now[q] != last_beat[q]) {
      last_beat[q] = beats_now[q];
      last_change[q] = now;
    } else if (q != rank() && beats_now[q] != "done" && now - last_change[q] > options.heartbeat_timeout) {
      std::istringstream fields(beats_now[q]);
      int64_t beat = 0, progress = 0, at_step = 0;
      fields >> beat >> progress >> at_step;
      {
        std::lock_guard<std::mutex> lock(mutex);
        dead.push_back(q);
      }
      record_failure(c10::str("rank ", q, " stopped responding (last heartbeat ", seconds(now - last_change[q]), " ago",
                              at_step > 0 ? c10::str(", in step ", at_step) : "", ": killed, crashed or frozen)"),
                     true, watch_store.get());
      return;
    }
  }
}

// A step that has run longer than the timeout: the rank whose progress is behind the others' is the one that
// hangs (it has not reached the collective they wait in).
void RunGuard::State::check_hang(Clock::time_point now) {
  if (!in_step.load() || failed()) return;
  const auto began = Clock::time_point(Clock::duration(step_began.load()));
  // One process: the trainer's own waits are bounded by the timeout; this is the backstop.
  auto bound = multi ? options.timeout : options.timeout + 2 * options.exit_grace;
  if (startup_step.load()) bound = std::max(bound, options.startup_timeout);
  if (now - began <= bound) return;
  const int64_t at = step.load();
  if (!multi) {
    record_failure(c10::str("step ", at, " did not finish within ", seconds(now - began),
                            ": a replica or a collective hangs (timeout ", seconds(options.timeout), ")"),
                   false, nullptr);
    return;
  }
  if (static_cast<int64_t>(last_beat.size()) != world()) return;  // not every rank beats yet: a startup matter
  int64_t lowest = progress_now(), highest = lowest;
  std::vector<int64_t> progress(world(), -1);
  progress[rank()] = lowest;
  for (int64_t q = 0; q < world(); ++q) {
    if (q == rank() || last_beat[q] == "done") continue;
    std::istringstream fields(last_beat[q]);
    int64_t beat = 0;
    fields >> beat >> progress[q];
    lowest = std::min(lowest, progress[q]);
    highest = std::max(highest, progress[q]);
  }
  std::string message;
  bool this_rank_hangs = false;
  if (lowest < highest) {
    std::string ranks;
    for (int64_t q = 0; q < world(); ++q) {
      if (progress[q] != lowest) continue;
      this_rank_hangs |= q == rank();
      // A rank whose heartbeats stopped is dead, not hung: watch_peers names it once heartbeat_timeout has passed.
      if (q != rank() && now - last_change[q] > 4 * options.heartbeat_interval) return;
      ranks += c10::str(ranks.empty() ? "" : ", ", q);
    }
    message = c10::str("rank ", ranks, " hangs in step ", at, ": no progress for ", seconds(now - began),
                       " while the other ranks wait for it (timeout ", seconds(options.timeout), ")");
  } else {
    // Nobody is behind: a collective or a device hangs, or every rank runs a long step (the first one's
    // autotuning); the latter is given twice the timeout.
    if (now - began <= 2 * options.timeout) return;
    message = c10::str("step ", at, " did not finish on any rank within ", seconds(now - began),
                       ": a collective or a device hangs (timeout ", seconds(options.timeout), ")");
  }
  // A rank that is itself the one that hangs has a stuck main thread: it leaves once the others have read why.
  record_failure(message, true, watch_store.get(),
                 this_rank_hangs ? std::optional(3 * options.heartbeat_interval) : std::nullopt);
}

// One vote at `step`: every rank adds its stop flag, then its arrival; the last to arrive reads the flags,
// schedules the next vote from its step time and writes the result, which every rank reads.
bool RunGuard::State::vote(int64_t at, bool stop) {
  const auto now = Clock::now();
  std::string result;
  try {
    const std::string local = local_stop_reason();
    if (!local.empty()) store->compareSet(kStop, {}, bytes(local));  // who asked, for every rank's log
    if (stop) store->add(vote_key(at, "stop"), 1);
    if (store->add(vote_key(at, "in"), 1) == world()) {
      const int64_t stops = store->add(vote_key(at, "stop"), 0);
      int64_t gap = 1;
      if (last_vote_step >= 0 && at > last_vote_step) {
        const double per_step = std::chrono::duration<double>(now - last_vote_time).count() / (at - last_vote_step);
        const double interval = std::chrono::duration<double>(options.vote_interval).count();
        gap = std::clamp<int64_t>(static_cast<int64_t>(interval / std::max(per_step, 1e-6)), 1, 10000);
      }
      result = c10::str(stops, " ", at + gap);
      store->set(vote_key(at, "result"), bytes(result));
      if (last_vote_step >= 0) {  // every rank has read the previous result: it reached this vote
        for (const char* what : {"stop", "in", "result"}) store->deleteKey(vote_key(last_vote_step, what));
      }
    } else {
      auto pause = std::chrono::microseconds(100);
      while (!store->check({vote_key(at, "result")})) {
        if (failed()) throw_peer_failure(failure_text());
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::microseconds(5000));
      }
      result = text(store->get(vote_key(at, "result")));
    }
  } catch (const PeerFailure&) {
    throw;
  } catch (const std::exception& e) {
    throw_peer_failure(c10::str("rank ", rank(), " could not vote on stopping at step ", at, ": ", first_line(e)));
  }
  std::istringstream fields(result);
  int64_t stops = 0;
  fields >> stops >> next_vote;
  last_vote_step = at;
  last_vote_time = now;
  if (stops > 0) {
    std::string who = "a stop requested on another rank";
    try {
      if (store->check({kStop})) who = text(store->get(kStop));
    } catch (const std::exception&) {
    }
    std::lock_guard<std::mutex> lock(mutex);
    stop_from = who;
  }
  return stops > 0;
}

RunGuard::RunGuard(const Launch& launch, RunGuardOptions options) : state_(std::make_shared<State>()) {
  State& s = *state_;
  s.launch = launch;
  s.options = options;
  s.multi = launch.multi_process();
  if (s.multi) {
    // As in Python, where c10d usually runs: a write to a peer that died fails with EPIPE (an error the collective
    // or the store reports) instead of killing this process with SIGPIPE.
    ::signal(SIGPIPE, SIG_IGN);
    s.store = connect_launch_store(launch, options.timeout);
    s.watch_store = s.store->clone();  // its own connection: never queued behind the main thread's calls
    s.store->set(process_key(launch.rank), bytes(c10::str(::getpid(), " ", pid_namespace())));
    s.store->set(beat_key(launch.rank), bytes("0 0 0"));
  }
  if (launch.torchrun) s.launcher = ::getppid();
  s.watchdog = std::thread([state = state_] {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(state->mutex);
        state->changed.wait_for(lock, state->options.heartbeat_interval, [&] { return state->stopping; });
        if (state->stopping) return;
      }
      state->tick();
    }
  });
}

RunGuard::~RunGuard() {
  State& s = *state_;
  bool failed = false;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.stopping = true;
    failed = !s.failure.empty();
  }
  s.changed.notify_all();
  if (!s.watchdog.joinable()) return;
  // After a failure the watchdog may be inside a call to a store that no longer answers: it holds its state
  // and ends with the process.
  if (failed) {
    s.watchdog.detach();
  } else {
    s.watchdog.join();
  }
}

c10::intrusive_ptr<c10d::Store> RunGuard::store() const { return state_->store; }

void RunGuard::watch(std::function<void(const std::string&)> abort, std::function<int64_t()> progress) {
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->abort = std::move(abort);
    state_->progress = std::move(progress);
    failure = state_->failure;
  }
  if (!failure.empty() && state_->abort) state_->abort(failure);
}

void RunGuard::begin_step(int64_t step) {
  state_->step.store(step);
  state_->startup_step.store(state_->steps_begun.fetch_add(1) < state_->options.startup_steps);
  state_->step_began.store(Clock::now().time_since_epoch().count());
  state_->in_step.store(true);
}

bool RunGuard::end_step(int64_t step) {
  State& s = *state_;
  s.steps_ended.fetch_add(1);
  if (s.failed()) throw_peer_failure(s.failure_text());
  const std::string local = s.local_stop_reason();
  bool stop = !local.empty();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (stop && s.stop_from.empty()) s.stop_from = local;
    stop = stop || s.stop_seen;
  }
  if (s.multi) {
    if (step < s.next_vote) {
      s.in_step.store(false);
      return false;
    }
    stop = s.vote(step, stop);  // the step's deadline covers the wait for the other ranks' votes
  }
  s.in_step.store(false);
  if (stop) {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.stop_agreed = true;
  }
  return stop;
}

void RunGuard::request_stop(const std::string& why) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->stop_request.empty()) state_->stop_request = c10::str(why, " on rank ", state_->rank());
}

void RunGuard::install_signal_handlers(const std::string& program) {
  std::snprintf(g_program, sizeof g_program, "%s", program.c_str());
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
}

bool RunGuard::signalled() { return g_signals.load() > 0; }

std::string RunGuard::stop_reason() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stop_agreed ? state_->stop_from : std::string();
}

void RunGuard::exiting() { g_exiting.store(true); }

bool RunGuard::failed() const { return state_->failed(); }

std::string RunGuard::fail(const std::exception& error) {
  State& s = *state_;
  const std::string cause = first_line(error);
  if (!s.multi) {
    // One process: its replicas' waits are bounded by the trainer, and nothing else is waited for.
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.failure.empty()) s.failure = cause;
    return s.failure;
  }
  if (s.failed()) return s.failure_text();
  if (dynamic_cast<const PeerFailure*>(&error) != nullptr) {
    // This rank only waited for others: the watchdog sees a failure they publish, or a death, within a
    // heartbeat timeout.
    std::unique_lock<std::mutex> lock(s.mutex);
    s.changed.wait_for(lock, s.options.heartbeat_timeout + 2 * s.options.heartbeat_interval,
                       [&] { return !s.failure.empty(); });
  }
  const int64_t step = s.step.load();
  const std::string where = step > 0 ? c10::str(" in step ", step) : std::string(" before its first step");
  const std::string kept = s.record_failure(c10::str("rank ", s.rank(), " failed", where, ": ", cause), true, s.store.get());
  // The rank that serves the store stays until the others alive have read the failure (or a moment has passed).
  if (s.launch.rank == 0 && !s.launch.agent_store) {
    int64_t readers = s.world() - 1;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      readers -= static_cast<int64_t>(s.dead.size());
    }
    const auto deadline = Clock::now() + std::min(s.options.exit_grace / 2, s.options.heartbeat_timeout);
    try {
      while (Clock::now() < deadline && s.store->add(kFailureSeen, 0) < readers) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    } catch (const std::exception&) {
    }
  }
  return kept;
}

void RunGuard::finish(bool stopped) {
  State& s = *state_;
  if (s.failed()) throw_peer_failure(s.failure_text());
  if (s.multi && stopped) {
    if (s.rank() == 0) {
      s.store->set(kSaved, bytes("1"));
    } else {
      const auto deadline = Clock::now() + s.options.timeout;
      while (!s.store->check({kSaved})) {
        if (s.failed()) throw_peer_failure(s.failure_text());
        TORCH_CHECK(Clock::now() < deadline, "rank ", s.rank(), ": rank 0 did not write its checkpoint within ",
                    seconds(s.options.timeout));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.stopping = true;
    s.done = true;
  }
  s.changed.notify_all();
  if (s.watchdog.joinable()) s.watchdog.join();
  if (!s.multi) return;
  s.store->set(beat_key(s.rank()), bytes("done"));
  if (s.launch.rank != 0 || s.launch.agent_store) return;
  // The store goes away with this process: the others' watchdogs must have stopped first. A rank that neither
  // finishes nor beats for a heartbeat timeout is not waited for.
  std::vector<std::string> keys;
  for (int64_t r = 0; r < s.world(); ++r) keys.push_back(beat_key(r));
  std::vector<std::string> last(s.world());
  std::vector<Clock::time_point> changed(s.world(), Clock::now());
  const auto deadline = Clock::now() + s.options.timeout;
  while (Clock::now() < deadline) {
    bool waiting = false;
    const auto values = s.store->multiGet(keys);
    for (int64_t r = 0; r < s.world(); ++r) {
      const std::string value = text(values[r]);
      if (value == "done") continue;
      if (value != last[r]) {
        last[r] = value;
        changed[r] = Clock::now();
      }
      waiting |= Clock::now() - changed[r] < s.options.heartbeat_timeout;
    }
    if (!waiting) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace hierpar::strategy
