// Host averaging (--reduce host): the gradients go to pinned host memory, one thread per replica sums its slice over
// every replica, and the sum goes back to each replica's device; across processes the host sums meet through Gloo.
// Eager steps move buckets during the backward; captured steps one flat buffer per network between their segments,
// or, with AveragingOptions::capture_host_copies, the buckets' copies inside the backward's graph (averaging.h).
#include "averaging_parts.h"

#include <ATen/Dispatch.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#ifdef HIERPAR_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include <algorithm>

namespace hierpar::strategy::detail {
namespace {

class HostAverager final : public GradientAverager {
 public:
  HostAverager(const Placement& placement, const AveragingOptions& options) : placement_(placement), options_(options) {
    TORCH_CHECK(options.bucket_cap_bytes >= 0 && options.first_bucket_cap_bytes >= 0,
                "AveragingOptions: bucket caps must be >= 0 (0: no bucketing), got ", options.first_bucket_cap_bytes,
                " and ", options.bucket_cap_bytes);
    // One barrier (and one cross-process group) per network: with synchronized BatchNorm on a
    // hierarchical placement, G's and D's sums of one replica run at the same time on their devices'
    // autograd threads, and must not count as each other's arrivals.
    for (auto& barrier : barriers_) barrier = std::make_unique<ReplicaBarrier>(global_indices(placement), options.timeout);
    for (auto& network_slots : slots_) {
      for (Slot& slot : network_slots) {
        slot.host.resize(placement.local_replicas());
        slot.device_flat.resize(placement.local_replicas());
      }
    }
    for (auto& reducers : reducers_) reducers.resize(placement.local_replicas());
  }

  ~HostAverager() override {
    detach_hooks(reducers_);
    // Sums still queued by a step that failed end at once instead of waiting out the timeout; then the summing
    // threads (owned by the reducers' transports) are joined while everything they use is still here.
    abort("the averager is being destroyed");
    for (auto& reducers : reducers_) reducers.clear();
  }

  void connect(int64_t local) override {
    // Across processes the host sums meet through Gloo; in one process the threads share memory.
    if (local == 0 && averaging_processes(placement_) > 1) {
      store_ = options_.store ? options_.store : connect_launch_store(placement_.launch, options_.timeout);
      for (Network network : options_.networks) {
        host_groups_[static_cast<int>(network)] =
            make_backend(c10::make_intrusive<c10d::PrefixStore>(std::string("host-") + to_string(network), store_),
                         averaging_rank(placement_), averaging_processes(placement_), c10::DeviceType::CPU, placement_.launch,
                         options_.timeout);
      }
    }
    barriers_[0]->arrive_and_wait(local, c10::str("replica ", placement_.replicas[local].replica, " (connecting)"));
  }

  GraphAveraging graph_averaging() const override {
    return options_.capture_host_copies && options_.bucket_cap_bytes > 0 && all_on_cuda(placement_)
               ? GraphAveraging::copies
               : GraphAveraging::between;
  }

  // Under a capture: every bucket's copy is in the graph (a bucket no hook started, too), joined to the step's stream.
  void backward_done(int64_t local, Network network) override {
    BucketReducer* reducer = reducers_[static_cast<int>(network)][local].get();
    if (reducer == nullptr) return;
    auto& transport = static_cast<HostBuckets&>(reducer->transport());
    if (!transport.capturing()) return;
    reducer->start_remaining(where(placement_, local, network));
    transport.join_captured_copies();
  }

  // Buckets summed during the backward (eager steps, and captured ones with capture_host_copies; the trainer attaches
  // none with synchronized BatchNorm, whose sums meet at the same barriers from the autograd threads).
  void attach(int64_t local, Network network, const std::vector<at::Tensor>& parameters) override {
    if (options_.bucket_cap_bytes == 0 || parameters.empty()) return;
    const int n = static_cast<int>(network);
    const std::string who = where(placement_, local, network);
    auto reducer = std::make_unique<BucketReducer>(parameters, options_.first_bucket_cap_bytes, options_.bucket_cap_bytes);
    {
      std::lock_guard<std::mutex> lock(attach_mutex_);
      BucketBuffers& buffers = bucket_buffers_[n];
      if (buffers.sum.empty()) {  // the first replica to attach sets the layout
        buffers.host.assign(reducer->buckets(), std::vector<at::Tensor>(placement_.local_replicas()));
        for (size_t b = 0; b < reducer->buckets(); ++b) {
          buffers.sum.push_back(at::empty({reducer->flat(b).numel()}, reducer->flat(b).options().device(at::kCPU)
                                                                          .pinned_memory(pinned_any(network))));
        }
      }
      TORCH_CHECK(buffers.sum.size() == reducer->buckets(), who, ": its parameters cut into ", reducer->buckets(),
                  " buckets, another replica's into ", buffers.sum.size(), " (every replica needs the same parameters)");
      for (size_t b = 0; b < reducer->buckets(); ++b) {
        const at::Tensor& flat = reducer->flat(b);
        TORCH_CHECK(buffers.sum[b].numel() == flat.numel(), who, ": bucket ", b, " has ", flat.numel(),
                    " elements, another replica's ", buffers.sum[b].numel(), " (every replica needs the same parameters)");
        // On the CPU the bucket's flat buffer is already in host memory.
        buffers.host[b][local] = flat.is_cuda() ? at::empty({flat.numel()}, flat.options().device(at::kCPU).pinned_memory(true))
                                                : flat;
      }
    }
    reducer->set_transport(std::make_unique<HostBuckets>(*this, local, network, reducer->buckets(), reducer->flat(0).device()));
    attach_hooks(*reducer, who);
    reducers_[n][local] = std::move(reducer);
  }

  void average(int64_t local, Network network, const std::vector<at::Tensor>& grads) override {
    entered();
    const int n = static_cast<int>(network);
    const std::string who = where(placement_, local, network);
    if (BucketReducer* reducer = reducers_[n][local].get()) {
      reducer->finish(grads, placement_.global_replicas(), who);
      return;
    }
    Slot& slot = slots_[n][kGradients];
    at::Tensor flat = flatten_into(slot.device_flat[local], grads);
    sum_over_replicas(local, network, slot, flat, who);
    flat.div_(placement_.global_replicas());
    unflatten_from(flat, grads);
  }

  void sum(int64_t local, Network network, const at::Tensor& tensor) override {
    entered();
    Slot& slot = slots_[static_cast<int>(network)][kStatistics];
    TORCH_CHECK(tensor.is_contiguous(), "sum: expected a contiguous tensor");
    sum_over_replicas(local, network, slot, tensor.view({-1}), where(placement_, local, network) + " BatchNorm statistics");
  }

  void broadcast_from_first(int64_t local, Network network, const std::vector<at::Tensor>& tensors) override {
    entered();
    const std::string who = where(placement_, local, network) + " broadcast";
    ReplicaBarrier& barrier = *barriers_[static_cast<int>(network)];
    at::Tensor scratch;
    at::Tensor flat = flatten_into(scratch, tensors);
    if (local == 0) {
      broadcast_ = at::empty({flat.numel()}, flat.options().device(at::kCPU));
      broadcast_.copy_(flat);
    }
    barrier.arrive_and_wait(local, who);
    if (averaging_processes(placement_) > 1) {
      if (local == 0) {
        std::vector<at::Tensor> buffers{broadcast_};
        c10d::BroadcastOptions options;
        options.rootRank = 0;
        wait_for(host_groups_[static_cast<int>(network)]->broadcast(buffers, options), who,
                 "broadcasting replica 0's tensors", options_.timeout, aborted_);
      }
      barrier.arrive_and_wait(local, who);
    }
    flat.copy_(broadcast_);
    unflatten_from(flat, tensors);
    barrier.arrive_and_wait(local, who);  // nobody reuses broadcast_ before every replica has read it
  }

  void set_final_backward(int64_t local, Network network, bool final) override {
    if (BucketReducer* reducer = reducers_[static_cast<int>(network)][local].get()) reducer->set_final_backward(final);
  }

  // Gloo's host groups have no abort: their waits here end at once, and their threads when Gloo times out.
  void abort(const std::string& reason) override {
    aborted_.set(reason);
    for (auto& barrier : barriers_) barrier->abort(reason);
  }

 private:
  struct Slot {
    std::vector<at::Tensor> host;         // per local replica: its flat buffer in (pinned) host memory
    std::vector<at::Tensor> device_flat;  // per local replica: the flat gradient buffer on its device
    at::Tensor sum;                       // the sum over replicas, written slice by slice by the replica threads
  };
  static constexpr int kGradients = 0, kStatistics = 1;

  // One network's buckets in host memory: each replica's copy of every bucket, and every bucket's sum.
  struct BucketBuffers {
    std::vector<std::vector<at::Tensor>> host;  // [bucket][local replica]
    std::vector<at::Tensor> sum;                // [bucket]
  };

  // A bucket's trip through host memory, off the threads that queue the step: the hook copies the bucket to pinned
  // memory on a side stream (the device never waits for the host, so no CUDA call anywhere can deadlock with it), a
  // summing thread of the replica waits for that copy and sums its slice of the bucket over every replica's copy;
  // wait() copies the sum back asynchronously on the step's stream. On the CPU the bucket's flat buffer is its host
  // copy, and the summing thread works while autograd goes on.
  // Under a CUDA graph capture (capture_host_copies) the copy and an event recorded after it become nodes of the
  // graph, and nothing is summed then: each replay's average() calls replayed(), whose summing job waits for that
  // event of the replay, so the sums still run while the replayed backward goes on.
  class HostBuckets final : public BucketTransport {
   public:
    HostBuckets(HostAverager& averager, int64_t local, Network network, size_t buckets, c10::Device device)
        : averager_(averager), local_(local), network_(network), buckets_(buckets) {
      if (device.is_cuda()) side_ = c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device);
    }

    ~HostBuckets() override {
#ifdef HIERPAR_WITH_CUDA
      for (cudaEvent_t event : landed_) {
        if (event != nullptr) (void)cudaEventDestroy(event);
      }
#endif
    }

    void start(size_t bucket, const at::Tensor& flat, const std::string& who) override {
      averager_.entered();
      BucketBuffers& buffers = averager_.bucket_buffers_[static_cast<int>(network_)];
      if (capturing()) {
        capture_copy(bucket, flat, buffers.host[bucket][local_]);
        return;
      }
      std::shared_ptr<c10::Event> copied;
      if (side_) {
        c10::Event ready(flat.device().type());
        ready.record(c10::impl::VirtualGuardImpl(flat.device().type()).getStream(flat.device()));
        ready.block(*side_);
        c10::StreamGuard on_side(*side_);
        buffers.host[bucket][local_].copy_(flat, /*non_blocking=*/true);
        copied = std::make_shared<c10::Event>(flat.device().type());
        copied->record(*side_);
      }
      post_sum(bucket, [copied] {
        if (copied) copied->synchronize();
      }, flat.numel(), who);
    }

    bool captured() const override { return captured_; }

    // Whether this thread's current stream of the bucket's device is being captured into a CUDA graph.
    bool capturing() const {
#ifdef HIERPAR_WITH_CUDA
      if (!side_) return false;
      c10::cuda::CUDAGuard device_guard(side_->device_index());
      return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
      return false;
#endif
    }

    void replayed(size_t bucket, const at::Tensor& flat, const std::string& who) override {
#ifdef HIERPAR_WITH_CUDA
      cudaEvent_t landed = landed_.at(bucket);
      post_sum(bucket, [landed] { C10_CUDA_CHECK(cudaEventSynchronize(landed)); }, flat.numel(), who);
#else
      (void)bucket, (void)flat, (void)who;
#endif
    }

    // The copies a capture queued on the side stream join the step's stream (a capture ends on the stream it began
    // on), once the backward has queued all its work, so that they never hold up its kernels.
    void join_captured_copies() {
      if (!join_pending_) return;
      join_pending_ = false;
      c10::Event joined(side_->device_type());
      joined.record(*side_);
      joined.block(c10::impl::VirtualGuardImpl(side_->device_type()).getStream(side_->device()));
    }

    void wait(size_t bucket, const at::Tensor& flat, const std::string& /*who*/) override {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        summed_changed_.wait(lock, [&] { return summed_ > bucket; });
        if (bucket + 1 == buckets_) summed_ = 0;  // the step's last bucket: the next step counts afresh
        if (failure_) std::rethrow_exception(failure_);
      }
      const at::Tensor& sum = averager_.bucket_buffers_[static_cast<int>(network_)].sum[bucket];
      // From pinned memory, asynchronously: the next write of `sum` comes after every replica's next copy of this
      // bucket to the host, which its side stream orders after this copy back.
      flat.copy_(sum, /*non_blocking=*/flat.is_cuda());
    }

   private:
    // A summing job for `bucket`: `landed()` waits until this replica's copy of it is in host memory.
    void post_sum(size_t bucket, std::function<void()> landed, int64_t numel, const std::string& who) {
      BucketBuffers& buffers = averager_.bucket_buffers_[static_cast<int>(network_)];
      summer_.post([this, &buffers, bucket, landed = std::move(landed), who, numel] {
        try {
          landed();
          averager_.sum_on_host(local_, network_, buffers.host[bucket], buffers.sum[bucket], numel, who);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mutex_);
          if (!failure_) failure_ = std::current_exception();
        }
        {
          std::lock_guard<std::mutex> lock(mutex_);
          ++summed_;
        }
        summed_changed_.notify_all();
      });
    }

    // The bucket's copy to `host` (pinned) on the side stream, after the step's stream has produced it, and an event
    // the host can wait for at every replay (an external event record: a capture's ordinary events only order its
    // own streams). cudaMemcpyAsync directly: ATen's copy would hand the pinned buffer's bookkeeping to the host
    // allocator at capture time, while this buffer lives as long as the averager.
    void capture_copy(size_t bucket, const at::Tensor& flat, const at::Tensor& host) {
#ifdef HIERPAR_WITH_CUDA
      captured_ = true;
      if (landed_.size() < buckets_) landed_.resize(buckets_, nullptr);
      if (landed_[bucket] == nullptr) C10_CUDA_CHECK(cudaEventCreateWithFlags(&landed_[bucket], cudaEventDisableTiming));
      c10::Event ready(flat.device().type());
      ready.record(c10::impl::VirtualGuardImpl(flat.device().type()).getStream(flat.device()));
      ready.block(*side_);
      const cudaStream_t side = c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, *side_).stream();
      c10::cuda::CUDAGuard device_guard(flat.device());
      C10_CUDA_CHECK(cudaMemcpyAsync(host.data_ptr(), flat.data_ptr(), flat.numel() * flat.element_size(),
                                     cudaMemcpyDeviceToHost, side));
      C10_CUDA_CHECK(cudaEventRecordWithFlags(landed_[bucket], side, cudaEventRecordExternal));
      join_pending_ = true;
#else
      (void)bucket, (void)flat, (void)host;
#endif
    }

    HostAverager& averager_;
    const int64_t local_;
    const Network network_;
    const size_t buckets_;
    std::optional<c10::Stream> side_;
    std::mutex mutex_;
    std::condition_variable summed_changed_;
    size_t summed_ = 0;  // buckets of this step summed so far
    std::exception_ptr failure_;  // the first failed sum: rethrown by every later wait()
    bool captured_ = false, join_pending_ = false;  // capture_copy() ran; its copies are not yet joined
#ifdef HIERPAR_WITH_CUDA
    std::vector<cudaEvent_t> landed_;  // [bucket] recorded after each replay's copy (capture_copy)
#endif
    JobThread summer_;            // last: its thread runs jobs that use the members above
  };

  // Sums `flat` (local replica `local`'s, on its device) over every replica, into `flat`.
  void sum_over_replicas(int64_t local, Network network, Slot& slot, const at::Tensor& flat, const std::string& who) {
    const int64_t numel = flat.numel();
    at::Tensor host = reserve(slot.host[local], numel, flat.options().device(at::kCPU).pinned_memory(flat.is_cuda()));
    host.copy_(flat);  // the host must read the values: this waits for the device, by design
    if (local == 0) reserve(slot.sum, numel, host.options().pinned_memory(pinned_any(network)));
    const at::Tensor sum = sum_on_host(local, network, slot.host, slot.sum, numel, who);
    // Asynchronous from pinned memory: the next write of `sum` comes after every replica's next (blocking)
    // device-to-host copy on the same stream, which orders after this one.
    flat.copy_(sum, /*non_blocking=*/true);
  }

  // Sums the replicas' host buffers `hosts` (their first `numel` elements) into `sum_buffer`, over this process's
  // replicas and then across processes, and returns that sum. Called by one thread of every local replica. Both
  // are read only after the first barrier, and the caller reads the returned tensor, never `sum_buffer` afterwards:
  // replica 0 may already be growing it for the next call.
  at::Tensor sum_on_host(int64_t local, Network network, const std::vector<at::Tensor>& hosts, const at::Tensor& sum_buffer,
                         int64_t numel, const std::string& who) {
    ReplicaBarrier& barrier = *barriers_[static_cast<int>(network)];
    barrier.arrive_and_wait(local, who);

    // Each replica's thread sums its own slice over all replicas' buffers (fixed order: replica 0 first).
    const int64_t parties = placement_.local_replicas();
    const int64_t chunk = (numel + parties - 1) / parties;
    const int64_t begin = std::min(numel, local * chunk);
    const int64_t length = std::min(numel, begin + chunk) - begin;
    at::Tensor sum = sum_buffer.narrow(0, 0, numel);
    if (length > 0) sum_slice(sum, hosts, parties, begin, length);
    barrier.arrive_and_wait(local, who);
    if (averaging_processes(placement_) > 1) {
      if (local == 0) {
        std::vector<at::Tensor> tensors{sum};
        wait_for(host_groups_[static_cast<int>(network)]->allreduce(tensors), who,
                 "summing the host buffers across processes", options_.timeout, aborted_);
      }
      barrier.arrive_and_wait(local, who);
    }
    return sum;
  }

  // out[begin, begin + length) = hosts[0] + hosts[1] + ... (that order), on the calling thread alone: every local
  // replica's thread sums its slice at the same time, and ATen's intra-op parallelism would start a thread team per
  // caller (local replicas x cores threads for a few hundred microseconds of adding).
  static void sum_slice(const at::Tensor& out, const std::vector<at::Tensor>& hosts, int64_t parties, int64_t begin,
                        int64_t length) {
    if (out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble) {
      AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "sum_slice", [&] {
        scalar_t* o = out.data_ptr<scalar_t>() + begin;
        const scalar_t* first = hosts[0].data_ptr<scalar_t>() + begin;
        std::copy(first, first + length, o);
        for (int64_t i = 1; i < parties; ++i) {
          const scalar_t* h = hosts[i].data_ptr<scalar_t>() + begin;
          for (int64_t k = 0; k < length; ++k) o[k] += h[k];
        }
      });
      return;
    }
    at::Tensor slice = out.narrow(0, begin, length);
    slice.copy_(hosts[0].narrow(0, begin, length));
    for (int64_t i = 1; i < parties; ++i) slice.add_(hosts[i].narrow(0, begin, length));
  }

  bool pinned_any(Network network) const {
    for (int64_t i = 0; i < placement_.local_replicas(); ++i) {
      if (device_of(placement_, i, network).is_cuda()) return true;
    }
    return false;
  }

  const Placement placement_;
  const AveragingOptions options_;
  std::array<std::unique_ptr<ReplicaBarrier>, 2> barriers_;  // [network]
  AbortState aborted_;
  std::array<std::array<Slot, 2>, 2> slots_;                 // [network][gradients | statistics]
  std::array<BucketBuffers, 2> bucket_buffers_;              // [network]
  std::mutex attach_mutex_;
  at::Tensor broadcast_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::array<c10::intrusive_ptr<c10d::Backend>, 2> host_groups_;  // [network]
  std::array<std::vector<std::unique_ptr<BucketReducer>>, 2> reducers_;  // [network][local replica]
};

}  // namespace

std::unique_ptr<GradientAverager> make_host_averager(const Placement& placement, const AveragingOptions& options) {
  return std::make_unique<HostAverager>(placement, options);
}

}  // namespace hierpar::strategy::detail
