// Collective averaging (--reduce nccl): a c10d process group (ProcessGroupNCCL for CUDA, ProcessGroupGloo for CPU)
// all-reduces the gradients, in buckets launched while the backward runs (as PyTorch DDP's reducer; captured steps
// capture them in the backward's graph) or, with bucket_cap_bytes = 0, as one flat buffer per network after it
// (averaging.h).
#include "averaging_parts.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#ifdef HIERPAR_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace hierpar::strategy::detail {
namespace {

class CollectiveAverager final : public GradientAverager {
 public:
  CollectiveAverager(const Placement& placement, const AveragingOptions& options)
      : placement_(placement),
        options_(options),
        store_(options.store ? options.store : connect_launch_store(placement.launch, options.timeout)) {
    TORCH_CHECK(options.bucket_cap_bytes >= 0 && options.first_bucket_cap_bytes >= 0,
                "AveragingOptions: bucket caps must be >= 0 (0: no bucketing), got ", options.first_bucket_cap_bytes,
                " and ", options.bucket_cap_bytes);
    for (auto& groups : groups_) groups.resize(placement.local_replicas());
    for (auto& barrier : barriers_) barrier = std::make_unique<ReplicaBarrier>(global_indices(placement), options.timeout);
    for (auto& flats : flats_) flats.resize(placement.local_replicas());
    for (auto& reducers : reducers_) reducers.resize(placement.local_replicas());
#ifdef HIERPAR_C10D_NCCL
    for (int64_t i = 0; i < placement.local_replicas(); ++i) {
      for (Network network : options.networks) {
        if (device_of(placement, i, network).is_cuda()) initialise_nccl_once();
      }
    }
#endif
  }

  ~CollectiveAverager() override {
    detach_hooks(reducers_);
    const bool keep = options_.process_groups && !aborted_.is_set();
    std::vector<c10::intrusive_ptr<c10d::Backend>> all;
    for (Network network : options_.networks) {
      for (int64_t i = 0; i < placement_.local_replicas(); ++i) {
        auto& group = groups_[static_cast<int>(network)][i];
        if (keep) {
          options_.process_groups->give_back(placement_, network, i, std::move(group));
        } else {
          all.push_back(std::move(group));
        }
      }
    }
    release_backends(all);
  }

  void connect(int64_t local) override {
    // Every local replica joins concurrently (Gloo's rendezvous needs all ranks at once); one group
    // per network, so G's and D's buffers may be in flight at the same time on their own devices.
    // Each replica talks to the store through its own connection: a TCPStore client holds its lock through a
    // blocking get, so a replica waiting there for rank 0's NCCL id would keep replica 0 of the same process from
    // setting it.
    const c10::intrusive_ptr<c10d::Store> store = local == 0 ? store_ : store_->clone();
    for (Network network : options_.networks) {
      const int n = static_cast<int>(network);
      const c10::Device device = device_of(placement_, local, network);
      aborted_.check(where(placement_, local, network) + " connect");
      c10::intrusive_ptr<c10d::Backend> group;
      if (options_.process_groups) group = options_.process_groups->take(placement_, network, local);
      const bool fresh = !group;
      if (fresh) {
        group = make_backend(c10::make_intrusive<c10d::PrefixStore>(to_string(network), store),
                             placement_.replicas[local].replica, placement_.global_replicas(), device.type(),
                             placement_.launch, options_.timeout);
      }
      {
        std::lock_guard<std::mutex> lock(groups_mutex_);  // abort() may read them from another thread
        groups_[n][local] = group;
      }
#ifdef HIERPAR_C10D_NCCL
      // The NCCL communicator is created here, while no replica computes, instead of inside the first
      // step (all ranks of the group are in connect() together, so this needs no other ordering).
      if (fresh && device.is_cuda()) group->eagerConnectSingleDevice(device);
#endif
    }
    issue_first_collectives(local);
  }

  // Each group's first collective: a one-element all-reduce, issued while no other thread of this process issues
  // one, and awaited before the replica goes on. libtorch 2.11's flight recorder (c10d FlightRecorderDetail.hpp,
  // recordWithResetEnabled) adds a process group to a process-wide std::map on its first collective BEFORE
  // taking its mutex, and looks the group up on every later one: replica threads issuing their groups' first
  // collectives at once corrupted that map (a segfault in _Rb_tree_insert_and_rebalance under
  // ProcessGroupGloo::enqueue, in 1 of 3-6 runs of StrategyTrainer.SyncBatchNormMatchesSingleOnTheWholeBatch).
  // An all-reduce completes only once every rank has issued it, so when this returns every group of every
  // local replica is in the map, and later collectives only read it. Issuing never waits for a peer (Gloo
  // queues the work; NCCL's communicators are connected at creation, see initialise_nccl_once), so the lock
  // is held briefly and cannot deadlock.
  void issue_first_collectives(int64_t local) {
    static std::mutex issuing;
    const std::string who = where(placement_, local, Network::generator) + " connect";
    std::array<at::Tensor, 2> probes;
    std::array<c10::intrusive_ptr<c10d::Work>, 2> works;
    for (Network network : options_.networks) {
      const int n = static_cast<int>(network);
      probes[n] = at::zeros({1}, at::TensorOptions().device(device_of(placement_, local, network)));
      std::vector<at::Tensor> buffers{probes[n]};
      std::lock_guard<std::mutex> lock(issuing);
      works[n] = groups_[n][local]->allreduce(buffers);
    }
    for (Network network : options_.networks) {
      const int n = static_cast<int>(network);
      wait_for(works[n], who, "the groups' first all-reduce", options_.timeout, aborted_);
      // NCCL's wait may only order the stream after the all-reduce: reading the result waits for it on the host.
      (void)probes[n].item<float>();
    }
  }

  void attach(int64_t local, Network network, const std::vector<at::Tensor>& parameters) override {
    if (options_.bucket_cap_bytes == 0 || parameters.empty()) return;
    const int n = static_cast<int>(network);
    auto reducer = std::make_unique<BucketReducer>(parameters, options_.first_bucket_cap_bytes, options_.bucket_cap_bytes);
    reducer->set_transport(std::make_unique<AllReducedBuckets>(*this, local, network, reducer->buckets()));
    attach_hooks(*reducer, where(placement_, local, network));
    reducers_[n][local] = std::move(reducer);
  }

  // NCCL's collectives can be captured (ProcessGroupNCCL leaves captured work out of its watchdog; the replays
  // all-reduce on the device with no host involved); Gloo's run on its own threads and cannot.
  GraphAveraging graph_averaging() const override {
    return options_.capture_collectives && options_.bucket_cap_bytes > 0 && all_on_cuda(placement_)
               ? GraphAveraging::whole
               : GraphAveraging::between;
  }

  // A replayed all-reduce spins on its device until every replica's arrives: a replica still capturing (CUDA calls
  // that may wait for the devices, as a cudaFree does once peer access is on) must not have a peer replaying.
  void captured(int64_t local) override {
    barriers_[static_cast<int>(Network::generator)]->arrive_and_wait(local, where(placement_, local, Network::generator) +
                                                                             " after capture");
  }

  void set_final_backward(int64_t local, Network network, bool final) override {
    if (BucketReducer* reducer = reducers_[static_cast<int>(network)][local].get()) reducer->set_final_backward(final);
  }

  void average(int64_t local, Network network, const std::vector<at::Tensor>& grads) override {
    entered();
    const std::string who = where(placement_, local, network);
    aborted_.check(who);
    const int n = static_cast<int>(network);
    if (BucketReducer* reducer = reducers_[n][local].get()) {
      reducer->finish(grads, placement_.global_replicas(), who);
      return;
    }
    at::Tensor flat = flatten_into(flats_[n][local], grads);
    // Replicas of one process launch their all-reduces only once every one of them is here. Otherwise a
    // replica's NCCL kernel waits on its device for a peer whose thread is still in its backward, where a
    // cudaFree (cuDNN's benchmark search freeing the allocator's cache) did not return while that kernel waited:
    // a deadlock (cuda-gdb, batch 4096 on 2 H200s: pt_autograd_1 in cuMemFree_v2, replica 0's all-reduce
    // pending). The bucket reducers meet at the same barrier before each bucket.
    barriers_[n]->arrive_and_wait(local, who);
    all_reduce(local, network, flat, who, "all-reducing the gradients");
    flat.div_(placement_.global_replicas());
    unflatten_from(flat, grads);
  }

  void sum(int64_t local, Network network, const at::Tensor& tensor) override {
    entered();
    TORCH_CHECK(tensor.is_contiguous(), "sum: expected a contiguous tensor");
    const std::string who = where(placement_, local, network);
    // The same launch barrier as the gradients' (without it, synchronized BatchNorm's all-reduce of its statistics
    // hangs as the gradients' did: seen on 4 H200s).
    barriers_[static_cast<int>(network)]->arrive_and_wait(local, who);
    all_reduce(local, network, tensor, who, "all-reducing BatchNorm statistics");
  }

  void broadcast_from_first(int64_t local, Network network, const std::vector<at::Tensor>& tensors) override {
    entered();
    const std::string who = where(placement_, local, network) + " broadcast";
    at::Tensor scratch;
    at::Tensor flat = flatten_into(scratch, tensors);
    std::vector<at::Tensor> buffers{flat};
    c10d::BroadcastOptions options;
    options.rootRank = 0;
    options.timeout = options_.timeout;
    barriers_[static_cast<int>(network)]->arrive_and_wait(local, who);
    wait_for(groups_[static_cast<int>(network)][local]->broadcast(buffers, options), who,
             "broadcasting replica 0's tensors", options_.timeout, aborted_);
    unflatten_from(flat, tensors);
  }

  // Local peers waiting at a barrier or on a Gloo collective stop at once. NCCL's communicators are aborted (device
  // work waiting on a peer ends), on a thread of their own: ProcessGroupNCCL::abort() may take up to its timeout.
  // Peers in other processes learn of the failure from their RunGuard, or by their collectives' timeout.
  void abort(const std::string& reason) override {
    if (!aborted_.set(reason)) return;
    for (auto& barrier : barriers_) barrier->abort(reason);
    std::vector<c10::intrusive_ptr<c10d::Backend>> nccl;
    std::lock_guard<std::mutex> lock(groups_mutex_);
    for (int64_t i = 0; i < placement_.local_replicas(); ++i) {
      for (Network network : options_.networks) {
        const auto& group = groups_[static_cast<int>(network)][i];
        if (group && device_of(placement_, i, network).is_cuda()) nccl.push_back(group);
      }
    }
    abort_nccl_groups(std::move(nccl));
  }

 private:
  // A bucket's all-reduce, launched asynchronously on the network's group. The replicas of one process launch each
  // bucket together (the network's launch barrier): a replica's NCCL kernel must not wait on its device for a peer
  // whose thread may block in a cudaFree meanwhile (that deadlocks, see average()).
  class AllReducedBuckets final : public BucketTransport {
   public:
    AllReducedBuckets(CollectiveAverager& averager, int64_t local, Network network, size_t buckets)
        : averager_(averager), local_(local), network_(network), works_(buckets) {}
    void start(size_t bucket, const at::Tensor& flat, const std::string& who) override {
      averager_.entered();
      const int n = static_cast<int>(network_);
      averager_.barriers_[n]->arrive_and_wait(local_, who);
      std::vector<at::Tensor> buffers{flat};
      c10d::AllreduceOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      works_[bucket] = averager_.groups_[n][local_]->allreduce(buffers, options);
    }
    void wait(size_t bucket, const at::Tensor& flat, const std::string& who) override {
      c10::intrusive_ptr<c10d::Work> work = std::move(works_[bucket]);
      wait_for(work, who, "all-reducing a gradient bucket", averager_.options_.timeout, averager_.aborted_,
               flat.is_cuda());
    }

   private:
    CollectiveAverager& averager_;
    const int64_t local_;
    const Network network_;
    std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  };

  void all_reduce(int64_t local, Network network, const at::Tensor& tensor, const std::string& who, const char* what) {
    std::vector<at::Tensor> buffers{tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    options.timeout = options_.timeout;
    // For NCCL, wait() makes the current stream wait for the all-reduce; the host does not.
    wait_for(groups_[static_cast<int>(network)][local]->allreduce(buffers, options), who, what, options_.timeout, aborted_,
             tensor.is_cuda());
  }

  const Placement placement_;
  const AveragingOptions options_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::array<std::vector<c10::intrusive_ptr<c10d::Backend>>, 2> groups_;  // [network][local replica]
  std::mutex groups_mutex_;                                               // connect() writes, abort() reads
  std::array<std::unique_ptr<ReplicaBarrier>, 2> barriers_;               // [network]
  AbortState aborted_;
  std::array<std::vector<at::Tensor>, 2> flats_;                          // [network][local replica]
  std::array<std::vector<std::unique_ptr<BucketReducer>>, 2> reducers_;   // [network][local replica]
};
}  // namespace

std::unique_ptr<GradientAverager> make_collective_averager(const Placement& placement, const AveragingOptions& options) {
  return std::make_unique<CollectiveAverager>(placement, options);
}

}  // namespace hierpar::strategy::detail
