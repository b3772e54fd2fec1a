// The pieces that the host and the collective averagers share (strategy/averaging.cpp defines the functions):
// flat buffers, the barrier and the job thread of in-process replicas, process groups, and the bucket reducer that
// starts each bucket's sum while the backward runs. Internal to strategy/.
#pragma once

#include "hierpar/strategy/averaging.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
// torch's CMake interface defines USE_C10D_GLOO and USE_C10D_NCCL for every file that links it (they describe
// torch's build, not which headers this build has): whether the headers are there is asked with __has_include.
#if defined(USE_C10D_GLOO) && __has_include(<gloo/algorithm.h>)
#define HIERPAR_C10D_GLOO
#endif
#if defined(USE_C10D_NCCL) && defined(HIERPAR_WITH_CUDA) && __has_include(<nccl.h>)
#define HIERPAR_C10D_NCCL
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace hierpar::strategy::detail {

std::string where(const Placement& placement, int64_t local, Network network);
c10::Device device_of(const Placement& placement, int64_t local, Network network);
// Whether every local replica has both networks on CUDA devices.
bool all_on_cuda(const Placement& placement);
// This process's index among the processes whose replicas average together, and their count: under a split
// placement those that run the same part (ranks 2r, or ranks 2r + 1), otherwise every process.
inline int64_t averaging_rank(const Placement& placement) {
  return placement.split() ? placement.launch.rank / 2 : placement.launch.rank;
}
inline int64_t averaging_processes(const Placement& placement) {
  return placement.split() ? placement.launch.world_size / 2 : placement.launch.world_size;
}
// All of one network's tensors of one replica, one after another in one flat buffer (reused across calls).
at::Tensor flatten_into(at::Tensor& flat, const std::vector<at::Tensor>& tensors);
// A buffer that grows and never shrinks (pinned host memory is costly to allocate); the first `numel`
// elements are the view used.
at::Tensor reserve(at::Tensor& buffer, int64_t numel, const at::TensorOptions& options);
void unflatten_from(const at::Tensor& flat, const std::vector<at::Tensor>& tensors);
std::vector<int64_t> global_indices(const Placement& placement);
// One rank of a process group over `store`: NCCL for CUDA tensors, Gloo for CPU tensors.
c10::intrusive_ptr<c10d::Backend> make_backend(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank, int64_t size,
                                               c10::DeviceType device_type, const Launch& launch,
                                               std::chrono::milliseconds timeout);
// Aborts NCCL `groups` on a thread of their own (ProcessGroupNCCL::abort() may take up to its timeout), so that device
// work waiting on a peer ends; libtorch's logs of the collectives it cuts short are held back from then on.
void abort_nccl_groups(std::vector<c10::intrusive_ptr<c10d::Backend>> groups);
// Destroys `group` (its last reference) at the end of a run that did not fail, without the error logs that
// ProcessGroupNCCL's destructor provokes; a group that other owners hold (an abort's thread) is only let go.
void release_backend(c10::intrusive_ptr<c10d::Backend>& group);
// release_backend for several groups at once, the NCCL ones concurrently: each ProcessGroupNCCL's destructor
// aborts its communicator and joins its threads, a few hundred ms apiece one after another.
void release_backends(std::vector<c10::intrusive_ptr<c10d::Backend>>& groups);
// The averager's abort: once set, every wait for peers ends with a PeerFailure that names the reason.
class AbortState {
 public:
  // True for the first call.
  bool set(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (set_.load()) return false;
    reason_ = reason.empty() ? "aborted" : reason;
    set_.store(true);
    return true;
  }
  bool is_set() const { return set_.load(); }
  void check(const std::string& who) const {
    if (!set_.load()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    throw_peer_failure(c10::str(who, " stopped: ", reason_));
  }

 private:
  std::atomic<bool> set_{false};
  mutable std::mutex mutex_;
  std::string reason_;
};

// A barrier for the replica threads of one process that a failing replica can break, and that gives up
// after a timeout naming the replicas that did not arrive: either way the waiting replicas throw a
// PeerFailure instead of hanging, and so does every later arrival.
class ReplicaBarrier {
 public:
  ReplicaBarrier(std::vector<int64_t> replicas, std::chrono::milliseconds timeout)
      : replicas_(std::move(replicas)), arrived_(replicas_.size(), false), timeout_(timeout) {}

  void arrive_and_wait(int64_t local, const std::string& who) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!failure_.empty()) throw_peer_failure(c10::str(who, " stopped: ", failure_));
    const uint64_t generation = generation_;
    arrived_[local] = true;
    if (++count_ == static_cast<int64_t>(replicas_.size())) {
      std::fill(arrived_.begin(), arrived_.end(), false);
      count_ = 0;
      ++generation_;
      changed_.notify_all();
      return;
    }
    const bool released = changed_.wait_for(lock, timeout_, [&] { return generation_ != generation || !failure_.empty(); });
    if (!released) {
      std::string missing;
      for (size_t i = 0; i < replicas_.size(); ++i) {
        if (!arrived_[i]) missing += c10::str(missing.empty() ? "" : ", ", replicas_[i]);
      }
      failure_ = c10::str("replica ", missing, " of this process did not arrive within ", timeout_.count(),
                          " ms (it hangs or is stuck)");
      changed_.notify_all();
      throw_peer_failure(c10::str(who, " gave up waiting: ", failure_));
    }
    if (generation_ == generation) throw_peer_failure(c10::str(who, " stopped: ", failure_));
  }

  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.empty()) failure_ = reason;
    changed_.notify_all();
  }

 private:
  const std::vector<int64_t> replicas_;  // global index of each local replica
  std::vector<bool> arrived_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int64_t count_ = 0;
  uint64_t generation_ = 0;
  std::string failure_;
};

// One thread running posted jobs in order: a replica's host sums, away from the thread that queues its device work.
class JobThread {
 public:
  JobThread() : thread_([this] { loop(); }) {}
  ~JobThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    posted_.notify_all();
    thread_.join();
  }

  void post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    posted_.notify_all();
  }

  // Returns once every job posted so far has run.
  void drain() {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [&] { return jobs_.empty() && !running_; });
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      posted_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and nothing left to run
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      running_ = true;
      lock.unlock();
      job();  // jobs catch their own errors
      lock.lock();
      running_ = false;
      if (jobs_.empty()) idle_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable posted_, idle_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false, running_ = false;
  std::thread thread_;  // last: it starts running loop() in the constructor
};

// Waits for a collective, turning a failure, a timeout or an abort into a PeerFailure that says what was being
// averaged. On CPU (Gloo) the host waits, at most `timeout` and only until the averager is aborted (Gloo's own
// wait cannot be interrupted). On CUDA (NCCL) wait() only makes the current stream wait; given an explicit
// timeout it would also block the host until the all-reduce ends, so there the process group's timeout or an
// abort of its communicators bounds the wait instead.
void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const std::string& who, const char* what,
              std::chrono::milliseconds timeout, const AbortState& aborted, bool device_side = false);

#ifdef HIERPAR_C10D_NCCL
// NCCL's one-time process initialisation, before any replica thread exists (averaging.cpp says why).
void initialise_nccl_once();
#endif

// ---- buckets: averaging that starts while the backward runs ------------------------------------------

// How one replica's bucket of one network is summed over every replica. start() is called as soon as the backward
// has produced the bucket's gradients (on the thread that ran the hook, in bucket order, the same order on every
// replica); wait() after the backward, in bucket order: then `flat` holds the sum (on a device: the current stream
// is ordered after it).
class BucketTransport {
 public:
  virtual ~BucketTransport() = default;
  virtual void start(size_t bucket, const at::Tensor& flat, const std::string& who) = 0;
  virtual void wait(size_t bucket, const at::Tensor& flat, const std::string& who) = 0;
  // Whether start() ran during a CUDA graph capture and put the bucket's device work into the graph
  // (GraphAveraging::copies): from then on each finish() follows a replay, whose buckets no hook starts, and
  // replayed() begins their host part instead.
  virtual bool captured() const { return false; }
  virtual void replayed(size_t /*bucket*/, const at::Tensor& /*flat*/, const std::string& /*who*/) {}
};

// One replica's gradients of one network in buckets, summed as the backward produces them (the design of PyTorch
// DDP's reducer): each parameter's post-accumulate-grad hook counts its bucket down; a complete bucket is copied
// into its flat buffer (one cat kernel) and handed to the transport, in bucket order, so every replica starts the
// same sums in the same order. Buckets follow reverse registration order (the backward reaches the last layers
// first), the first one smaller so that the sums start early.
class BucketReducer {
 public:
  BucketReducer(std::vector<at::Tensor> parameters, int64_t first_cap_bytes, int64_t cap_bytes)
      : parameters_(std::move(parameters)) {
    bucket_of_.resize(parameters_.size());
    for (int64_t i = static_cast<int64_t>(parameters_.size()) - 1; i >= 0; --i) {
      const at::Tensor& p = parameters_[i];
      const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
      // The bucket being filled is the first one (smaller cap) or a later one.
      const int64_t cap = buckets_.size() == 1 ? first_cap_bytes : cap_bytes;
      if (buckets_.empty() || (buckets_.back().bytes > 0 && buckets_.back().bytes + bytes > cap)) {
        buckets_.emplace_back();
      }
      Bucket& bucket = buckets_.back();
      bucket.members.push_back(i);
      bucket.bytes += bytes;
      bucket.numel += p.numel();
      bucket_of_[i] = static_cast<int64_t>(buckets_.size()) - 1;
    }
    for (Bucket& bucket : buckets_) {
      bucket.flat = at::empty({bucket.numel}, parameters_[bucket.members[0]].options().requires_grad(false));
      bucket.pending = static_cast<int64_t>(bucket.members.size());
    }
  }

  size_t buckets() const { return buckets_.size(); }
  const at::Tensor& flat(size_t bucket) const { return buckets_[bucket].flat; }
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  void set_transport(std::unique_ptr<BucketTransport> transport) { transport_ = std::move(transport); }
  BucketTransport& transport() { return *transport_; }

  // Whether the hooks of the coming backward count (GradientAverager::set_final_backward).
  void set_final_backward(bool final) { final_backward_ = final; }

  // Autograd's hook: parameter `index` has its gradient for this backward.
  void ready(size_t index, const std::string& who) {
    if (!final_backward_) return;
    std::lock_guard<std::mutex> lock(mutex_);
    Bucket& bucket = buckets_[bucket_of_[index]];
    TORCH_CHECK(!bucket.started && bucket.pending > 0, who, ": a gradient was produced twice before averaging "
                "(two backward passes through the network in one step are not supported with bucketed averaging)");
    --bucket.pending;
    while (next_ < buckets_.size() && buckets_[next_].pending == 0) start(next_++, who);
  }

  // Starts the buckets the hooks did not (parameters without a gradient get zeros, as average()'s caller gives
  // them): a capture of the bucket copies must hold every bucket's.
  void start_remaining(const std::string& who) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t i : unstarted_members()) {
      if (!parameters_[i].grad().defined()) parameters_[i].mutable_grad() = at::zeros_like(parameters_[i]);
    }
    while (next_ < buckets_.size()) start(next_++, who);
  }

  // After the backward: starts what the hooks did not (parameters without gradients: `grads` holds zeros for
  // them), waits for every bucket, divides by `replicas` and writes the averages into `grads`.
  // After a replayed step whose bucket copies were captured (BucketTransport::captured()), every bucket's host part
  // begins here instead, before the waits.
  void finish(const std::vector<at::Tensor>& grads, int64_t replicas, const std::string& who) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(grads.size() == parameters_.size(), who, ": expected the gradients of the ", parameters_.size(),
                " attached parameters, got ", grads.size());
    if (transport_->captured()) {
      for (size_t b = 0; b < buckets_.size(); ++b) transport_->replayed(b, buckets_[b].flat, who);
    } else {
      while (next_ < buckets_.size()) start(next_++, who, &grads);
    }
    next_ = 0;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      Bucket& bucket = buckets_[b];
      bucket.started = false;
      bucket.pending = static_cast<int64_t>(bucket.members.size());
      transport_->wait(b, bucket.flat, who);
      bucket.flat.div_(replicas);
      int64_t offset = 0;
      for (int64_t i : bucket.members) {
        grads[i].copy_(bucket.flat.narrow(0, offset, grads[i].numel()).view(grads[i].sizes()));
        offset += grads[i].numel();
      }
    }
  }

 private:
  struct Bucket {
    std::vector<int64_t> members;  // parameter indices, in the order the backward tends to produce them
    int64_t bytes = 0, numel = 0;
    at::Tensor flat;
    int64_t pending = 0;  // members whose gradient this backward has not produced yet
    bool started = false;
  };

  std::vector<int64_t> unstarted_members() const {
    std::vector<int64_t> out;
    for (size_t b = next_; b < buckets_.size(); ++b) out.insert(out.end(), buckets_[b].members.begin(), buckets_[b].members.end());
    return out;
  }

  void start(size_t b, const std::string& who, const std::vector<at::Tensor>* grads = nullptr) {
    Bucket& bucket = buckets_[b];
    std::vector<at::Tensor> pieces;
    pieces.reserve(bucket.members.size());
    for (int64_t i : bucket.members) {
      const at::Tensor grad = grads != nullptr ? (*grads)[i] : parameters_[i].grad();
      TORCH_CHECK(grad.defined(), "bucketed averaging: parameter ", i, " has no gradient");
      pieces.push_back(grad.reshape({-1}));
    }
    at::cat_out(bucket.flat, pieces, 0);
    bucket.started = true;
    transport_->start(b, bucket.flat, who);
  }

  std::vector<at::Tensor> parameters_;
  std::unique_ptr<BucketTransport> transport_;
  std::vector<int64_t> bucket_of_;
  std::vector<Bucket> buckets_;
  size_t next_ = 0;  // the next bucket to start
  std::mutex mutex_;
  std::atomic<bool> final_backward_{true};
};

// Registers each parameter's post-accumulate-grad hook, which tells `reducer` that its gradient is ready.
void attach_hooks(BucketReducer& reducer, const std::string& who);
// The modules outlive the averager (replica 0's are the caller's): their hooks must not call into it after it is gone.
void detach_hooks(std::array<std::vector<std::unique_ptr<BucketReducer>>, 2>& reducers);

std::unique_ptr<GradientAverager> make_host_averager(const Placement& placement, const AveragingOptions& options);
std::unique_ptr<GradientAverager> make_collective_averager(const Placement& placement, const AveragingOptions& options);

}  // namespace hierpar::strategy::detail
