// Gradient averaging across the replicas of a placement, behind one interface with two implementations:
//  - host: the gradients go to pinned host memory, one thread per replica (like seed 000's OpenMP threads)
//    each sums one slice over all replicas, and the sum goes back to every replica's device (across
//    processes the host sums meet through Gloo). Eager steps move buckets as the backward produces them
//    (copied on a side stream, summed on a thread of the replica while the backward goes on); captured steps
//    move one flat buffer per network between the replayed segments;
//  - collective: a c10d process group (ProcessGroupNCCL for CUDA, ProcessGroupGloo for CPU) all-reduces
//    the gradients, either in buckets launched by autograd hooks while the backward still runs (the
//    default, like PyTorch DDP's reducer) or, with bucket_cap_bytes = 0, as ONE flat buffer per network
//    after the backward.
// Both divide the sum by the global replica count on the device, so they agree bit for bit for two replicas.
// Replicas in one process are threads that are ranks of the same groups (a shared HashStore); replicas in
// other processes join through a TCPStore at MASTER_ADDR:MASTER_PORT. The code path is the same.
#pragma once

#include "hierpar/strategy/placement.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Backend;
}  // namespace c10d

namespace hierpar::strategy {

enum class Network { generator = 0, discriminator = 1 };
const char* to_string(Network network);

// How much of an averager's work a captured step (CUDA graphs) captures:
//  - between: none; average() runs between the replayed segments, on one flat buffer per network;
//  - copies: the bucket hooks fire during the capture, so each bucket's copy into host memory is a node of the
//    backward's graph; average(), between the segments, sums the buckets on CPU threads as the replay's copies land
//    and copies the sums back (host averaging);
//  - whole: the buckets' collectives are graph nodes too, and average() is captured after them (NCCL).
enum class GraphAveraging { between, copies, whole };
const char* to_string(GraphAveraging mode);

// A wait for other replicas that ended without a result: a peer failed, died or did not arrive in time, or the
// averager was aborted. An error of this replica's own is a plain c10::Error; a caller coordinating many processes
// (RunGuard) looks for the cause of a PeerFailure elsewhere before reporting it.
class PeerFailure : public c10::Error {
 public:
  using c10::Error::Error;
};
[[noreturn]] void throw_peer_failure(const std::string& message);

// The store the processes of `launch` meet in: torchrun's agent store when it serves one
// (TORCHELASTIC_USE_AGENT_STORE), otherwise a TCPStore at MASTER_ADDR:MASTER_PORT served by rank 0, under a
// namespace that every rank of this launch agrees on at connection and that no earlier attempt used (the agent
// store outlives torchrun's restarts, and TORCHELASTIC_RESTART_COUNT differs between agents, so neither it nor a
// fixed prefix can keep a restarted attempt from reading a failed one's keys). Call it on every rank.
c10::intrusive_ptr<c10d::Store> connect_launch_store(const Launch& launch, std::chrono::milliseconds timeout);

class GradientAverager {
 public:
  virtual ~GradientAverager() = default;

  // Called concurrently by every local replica's thread (`local` in [0, local replicas)); returns when
  // `grads` (that replica's gradients of `network`, on its device for that network) hold the average over
  // all replicas everywhere. Device work is stream-ordered; the host waits only where the scheme must
  // (host averaging reads the gradients on the CPU). Throws a c10::Error naming the replica and the
  // network when a peer replica failed or a collective timed out.
  virtual void average(int64_t local, Network network, const std::vector<at::Tensor>& grads) = 0;

  // Called concurrently by every local replica's thread: every replica's `tensors` take global replica
  // 0's values (initial parameters, a resumed checkpoint).
  virtual void broadcast_from_first(int64_t local, Network network, const std::vector<at::Tensor>& tensors) = 0;

  // Called by a failing replica's thread, or from any thread when the run failed elsewhere: every wait for
  // peers in this process ends with a PeerFailure naming `reason` (in-process barriers and Gloo waits at
  // once; NCCL communicators are aborted, so device work waiting on a dead peer ends), and so does every
  // later call. Never blocks.
  virtual void abort(const std::string& reason) = 0;

  // Called by every local replica's thread before its first average(): collectives may rendezvous here.
  virtual void connect(int64_t local) = 0;

  // What a captured step (CUDA graphs) may capture of this averager's work (GraphAveraging); the hooks attach()
  // registers then fire during the capture as in an eager backward.
  virtual GraphAveraging graph_averaging() const { return GraphAveraging::between; }

  // Called by every local replica's thread after its step was captured and before the first replay: replicas
  // whose captured collectives wait on the device for each other start replaying only once all are captured.
  virtual void captured(int64_t /*local*/) {}

  // Called after the last backward of `network` in a step (eager or being captured), on the step's stream: work
  // the averager queued on other streams during that backward is joined back (a capture must end on one stream).
  virtual void backward_done(int64_t /*local*/, Network /*network*/) {}

  // Optional overlap with the backward: local replica `local`'s parameters of `network`, in registration
  // order, whose gradients later average() calls will average (same tensors, same order). An averager
  // may register autograd hooks on them that start averaging parts of the gradients while the backward
  // is still running; average() then only finishes. Called once per replica and network, after
  // connect(). The default keeps average() doing all the work.
  virtual void attach(int64_t /*local*/, Network /*network*/, const std::vector<at::Tensor>& /*parameters*/) {}

  // Bucketed averaging counts each parameter's gradient once per step. A step that runs several backward passes
  // through `network` (D's: the real half, then the fake half) says before each whether it is the last, so that
  // the hooks start buckets only during the last one. Default: every backward is the last.
  virtual void set_final_backward(int64_t /*local*/, Network /*network*/, bool /*final*/) {}

  // Sums `tensor` (local replica `local`'s, on its device for `network`) over all replicas, in place:
  // synchronized BatchNorm's per-channel statistics (forward) and gradient sums (backward). Every
  // replica must call it in the same order relative to its other calls for `network`; it may be called
  // from the autograd engine's thread of the replica's device.
  virtual void sum(int64_t local, Network network, const at::Tensor& tensor) = 0;

  // Calls of average(), sum() and broadcast_from_first() entered so far by this process's replicas: a process
  // whose count stops below its peers' while they wait is the one that hangs (RunGuard names it so).
  int64_t progress() const { return entered_.load(std::memory_order_relaxed); }

 protected:
  void entered() { entered_.fetch_add(1, std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> entered_{0};
};

// Process groups kept from one averager to the next of the same placement in one process (a batch-size search
// builds a trainer per trial): an averager given a cache takes its groups from it, and gives them back when it is
// destroyed, so the next one connects without a rendezvous, NCCL's communicator set-up and the abort that ends a
// group (together about 0.8 s a trainer with two replicas on two GPUs). An averager that aborts gives nothing back:
// an aborted NCCL group is done. The cache destroys what it holds when it goes.
class ProcessGroupCache {
 public:
  ProcessGroupCache();
  ~ProcessGroupCache();  // not copyable: groups_ is a unique_ptr

  // The group of local replica `local` for `network`, removed from the cache; null when it holds none. Every group
  // it holds belongs to `placement` (checked: the first placement given to it).
  c10::intrusive_ptr<c10d::Backend> take(const Placement& placement, Network network, int64_t local);
  void give_back(const Placement& placement, Network network, int64_t local, c10::intrusive_ptr<c10d::Backend> group);
  size_t size() const;  // groups held

 private:
  struct Groups;
  std::unique_ptr<Groups> groups_;
};

struct AveragingOptions {
  // Bound on every wait for a peer replica (in-process barriers and c10d collectives): a replica that
  // dies, throws or hangs makes the others fail with a PeerFailure after at most this long, never hang.
  std::chrono::milliseconds timeout{std::chrono::minutes(1)};
  // Where the processes of a multi-process placement meet (a RunGuard's store, so that its heartbeats and the
  // process groups share one namespace); null: connect_launch_store(placement.launch, timeout).
  c10::intrusive_ptr<c10d::Store> store;
  // Collective averaging (--reduce nccl) takes its process groups from here and gives them back (see above); null:
  // its own, destroyed with it.
  std::shared_ptr<ProcessGroupCache> process_groups;
  // Gradients are grouped into buckets of at most this many bytes, in reverse registration order (the
  // backward produces the last layers' gradients first); a bucket's sum starts, asynchronously, as soon as
  // the backward has produced all of its gradients and every earlier bucket has started (the same order on
  // every replica): an all-reduce (collective), or a copy to pinned memory on a side stream that a thread of
  // the replica sums over the replicas while the backward goes on (host; the device never waits for the host).
  // As in DDP the first bucket is smaller (first_bucket_cap_bytes) so that the sums start early. Buckets need
  // the backward's hooks: captured steps capture NCCL's bucketed all-reduces in their graphs (capture_collectives)
  // and otherwise average one flat buffer per network between their segments, as host averaging with
  // synchronized BatchNorm does. 0 turns bucketing off: one flat buffer per network after the backward (for
  // comparison).
  int64_t bucket_cap_bytes = 25 * 1024 * 1024;
  int64_t first_bucket_cap_bytes = 1024 * 1024;
  // Captured steps with NCCL averaging (and bucket_cap_bytes > 0): the buckets' all-reduces are captured inside
  // the backward's CUDA graph, as PyTorch DDP's under torch.cuda.graph, so a replayed step overlaps them with the
  // backward and needs no host work between its segments. false: one flat all-reduce per network between the
  // replayed segments (for comparison).
  bool capture_collectives = true;
  // Captured steps with host averaging (and bucket_cap_bytes > 0): each bucket's copy to pinned memory is captured
  // in the backward's graph as the bucket becomes ready, and the replicas' threads sum a bucket as soon as the
  // replay's copy of it has landed, while the GPU goes on with the backward. false: one flat buffer per network,
  // copied, summed and copied back between the replayed segments. Off until measured on GPUs (docs/strategy.md).
  bool capture_host_copies = false;
  // The networks this process averages: both, or the one it runs of a split placement's replica (ReplicaPart), whose
  // averager then has groups for that network only.
  std::vector<Network> networks{Network::generator, Network::discriminator};
};

// The averager for `placement.reduce`; nullptr when there is one replica in all (nothing to average).
std::unique_ptr<GradientAverager> make_averager(const Placement& placement, const AveragingOptions& options = {});

// Whether this build can create the Gloo process group (CPU collectives): LibTorch's wheels lack the gloo
// headers, so the build takes them from the system (Debian's libgloo-dev).
bool gloo_available();

}  // namespace hierpar::strategy
