// Gradient averaging: host (pinned buffers, CPU threads) and collective (c10d process groups).
// The Gloo and NCCL headers are included here only, so their compile definitions stay in this file's
// concerns: USE_C10D_GLOO / USE_C10D_NCCL come from the top CMakeLists.txt when the headers are found.
#include "hierpar/strategy/averaging.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <array>
#include <condition_variable>
#include <mutex>

namespace hierpar::strategy {

const char* to_string(Network network) { return network == Network::generator ? "generator" : "discriminator"; }

bool gloo_available() {
#ifdef USE_C10D_GLOO
  return true;
#else
  return false;
#endif
}

namespace {

constexpr std::array<Network, 2> kNetworks{Network::generator, Network::discriminator};

std::string where(const Placement& placement, int64_t local, Network network) {
  const ReplicaDevices& r = placement.replicas[local];
  return c10::str("replica ", r.replica, " (", to_string(network), " on ",
                  network == Network::generator ? r.generator : r.discriminator, ")");
}

c10::Device device_of(const Placement& placement, int64_t local, Network network) {
  const ReplicaDevices& r = placement.replicas[local];
  return network == Network::generator ? r.generator : r.discriminator;
}

// All of one network's tensors of one replica, one after another in one flat buffer (reused across calls).
at::Tensor flatten_into(at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(!tensors.empty(), "averaging needs at least one tensor");
  std::vector<at::Tensor> pieces;
  pieces.reserve(tensors.size());
  int64_t numel = 0;
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.defined(), "averaging: every tensor must be defined (an unused parameter's gradient is zeros)");
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type() && t.device() == tensors[0].device(),
                "averaging: all tensors of a network must share dtype and device, got ", t.scalar_type(), " on ",
                t.device(), " and ", tensors[0].scalar_type(), " on ", tensors[0].device());
    pieces.push_back(t.reshape({-1}));
    numel += t.numel();
  }
  if (!flat.defined() || flat.numel() != numel || flat.device() != tensors[0].device() ||
      flat.scalar_type() != tensors[0].scalar_type()) {
    flat = at::empty({numel}, tensors[0].options());
  }
  at::cat_out(flat, pieces, 0);
  return flat;
}

void unflatten_from(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

// A barrier for the replica threads of one process that a failing replica can break, and that gives up
// after a timeout: either way the waiting replicas throw instead of hanging.
class ReplicaBarrier {
 public:
  ReplicaBarrier(int64_t parties, std::chrono::milliseconds timeout) : parties_(parties), timeout_(timeout) {}

  void arrive_and_wait(const std::string& who) {
    std::unique_lock<std::mutex> lock(mutex_);
    TORCH_CHECK(failure_.empty(), who, " stopped: ", failure_);
    const uint64_t generation = generation_;
    if (++arrived_ == parties_) {
      arrived_ = 0;
      ++generation_;
      changed_.notify_all();
      return;
    }
    const bool released = changed_.wait_for(lock, timeout_, [&] { return generation_ != generation || !failure_.empty(); });
    TORCH_CHECK(released, who, " waited ", timeout_.count(), " ms for the other replicas of this process and gave up");
    TORCH_CHECK(generation_ != generation, who, " stopped: ", failure_);
  }

  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.empty()) failure_ = reason;
    changed_.notify_all();
  }

 private:
  const int64_t parties_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int64_t arrived_ = 0;
  uint64_t generation_ = 0;
  std::string failure_;
};

c10::intrusive_ptr<c10d::Store> make_store(const Placement& placement, std::chrono::milliseconds timeout) {
  if (!placement.launch.multi_process()) return c10::make_intrusive<c10d::HashStore>();
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(placement.launch.master_port);
  options.isServer = placement.launch.rank == 0 && !placement.launch.agent_store;
  options.numWorkers = static_cast<size_t>(placement.launch.world_size);
  options.waitWorkers = false;  // the process groups' own rendezvous waits, with their timeout
  options.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(placement.launch.master_addr, options);
}

bool is_loopback(const std::string& host) { return host == "127.0.0.1" || host == "localhost" || host == "::1"; }

// One rank of a process group over `store`: NCCL for CUDA tensors, Gloo for CPU tensors.
c10::intrusive_ptr<c10d::Backend> make_backend(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank, int64_t size,
                                               c10::DeviceType device_type, const Launch& launch,
                                               std::chrono::milliseconds timeout) {
  if (device_type == c10::DeviceType::CUDA) {
#ifdef USE_C10D_NCCL
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    // The replica threads of one process construct their ranks one at a time: the constructor touches
    // process-wide state (monitoring threads, allocator hooks) and needs no peer (NCCL's communicator is
    // created at the first collective, by all ranks concurrently). A segfault was seen once on 2 H200s
    // when two in-process ranks started; its cause is not established and this serialisation is a guess.
    static std::mutex construction;
    std::lock_guard<std::mutex> lock(construction);
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(rank), static_cast<int>(size), options);
#else
    TORCH_CHECK(false, "--reduce nccl on CUDA devices needs hierpar built with NCCL (USE_C10D_NCCL); this build has "
                "none: use --reduce host");
#endif
  }
#ifdef USE_C10D_GLOO
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  // One process, or every process on this host: loopback, which needs no name resolution. Otherwise
  // Gloo's default (GLOO_SOCKET_IFNAME, or the interface of this host's name).
  options->devices.push_back(!launch.multi_process() || is_loopback(launch.master_addr)
                                 ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                 : c10d::ProcessGroupGloo::createDefaultDevice());
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank), static_cast<int>(size), options);
#else
  (void)store; (void)rank; (void)size; (void)launch; (void)timeout;
  TORCH_CHECK(false, "collective averaging on CPU needs hierpar built with Gloo (USE_C10D_GLOO; the gloo headers "
              "come from Debian's libgloo-dev): this build has none");
#endif
}

// Waits for a collective, turning a failure or timeout into an error that says what was being averaged.
// On CUDA tensors NCCL's wait() only makes the current stream wait; given an explicit timeout it would
// also block the host until the all-reduce ends, so there the process group's own timeout (its watchdog)
// bounds the wait instead.
void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const std::string& who, const char* what,
              std::chrono::milliseconds timeout, bool device_side = false) {
  try {
    if (device_side) {
      work->wait();
    } else {
      work->wait(timeout);
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, who, ": ", what, " failed or timed out after at most ", timeout.count(),
                " ms (a peer replica may have failed or died): ", e.what());
  }
}

// ---- host averaging --------------------------------------------------------------------------------

class HostAverager final : public GradientAverager {
 public:
  HostAverager(const Placement& placement, const AveragingOptions& options)
      : placement_(placement), options_(options), barrier_(placement.local_replicas(), options.timeout) {
    for (Slot& slot : slots_) {
      slot.host.resize(placement.local_replicas());
      slot.device_flat.resize(placement.local_replicas());
    }
  }

  void connect(int64_t local) override {
    // Across processes the host sums meet through Gloo; in one process the threads share memory.
    if (local == 0 && placement_.launch.multi_process()) {
      store_ = make_store(placement_, options_.timeout);
      host_group_ = make_backend(c10::make_intrusive<c10d::PrefixStore>("host", store_), placement_.launch.rank,
                                 placement_.launch.world_size, c10::DeviceType::CPU, placement_.launch,
                                 options_.timeout);
    }
    barrier_.arrive_and_wait(c10::str("replica ", placement_.replicas[local].replica, " (connecting)"));
  }

  void average(int64_t local, Network network, const std::vector<at::Tensor>& grads) override {
    const std::string who = where(placement_, local, network);
    Slot& slot = slots_[static_cast<int>(network)];
    at::Tensor flat = flatten_into(slot.device_flat[local], grads);
    at::Tensor& host = slot.host[local];
    if (!host.defined() || host.numel() != flat.numel()) {
      host = at::empty({flat.numel()}, flat.options().device(at::kCPU).pinned_memory(flat.is_cuda()));
    }
    host.copy_(flat);  // the host must read the gradients: this waits for the device, by design
    if (local == 0 && (!slot.sum.defined() || slot.sum.numel() != flat.numel())) {
      slot.sum = at::empty({flat.numel()}, host.options().pinned_memory(pinned_any(network)));
    }
    barrier_.arrive_and_wait(who);

    // Each replica's thread sums its own slice over all replicas' buffers (fixed order: replica 0 first).
    const int64_t parties = placement_.local_replicas();
    const int64_t chunk = (flat.numel() + parties - 1) / parties;
    const int64_t begin = std::min(flat.numel(), local * chunk);
    const int64_t length = std::min(flat.numel(), begin + chunk) - begin;
    if (length > 0) {
      at::Tensor out = slot.sum.narrow(0, begin, length);
      out.copy_(slot.host[0].narrow(0, begin, length));
      for (int64_t i = 1; i < parties; ++i) out.add_(slot.host[i].narrow(0, begin, length));
    }
    barrier_.arrive_and_wait(who);
    if (placement_.launch.multi_process()) {
      if (local == 0) {
        std::vector<at::Tensor> tensors{slot.sum};
        wait_for(host_group_->allreduce(tensors), who, "summing the host gradient buffers across processes",
                 options_.timeout);
      }
      barrier_.arrive_and_wait(who);
    }
    // Asynchronous from pinned memory: the next use of `sum` comes after every replica's next
    // device-to-host copy on the same stream, which orders after this one.
    flat.copy_(slot.sum, /*non_blocking=*/true);
    flat.div_(placement_.global_replicas());
    unflatten_from(flat, grads);
  }

  void broadcast_from_first(int64_t local, Network network, const std::vector<at::Tensor>& tensors) override {
    const std::string who = where(placement_, local, network) + " broadcast";
    at::Tensor scratch;
    at::Tensor flat = flatten_into(scratch, tensors);
    if (local == 0) {
      broadcast_ = at::empty({flat.numel()}, flat.options().device(at::kCPU));
      broadcast_.copy_(flat);
    }
    barrier_.arrive_and_wait(who);
    if (placement_.launch.multi_process()) {
      if (local == 0) {
        std::vector<at::Tensor> buffers{broadcast_};
        c10d::BroadcastOptions options;
        options.rootRank = 0;
        wait_for(host_group_->broadcast(buffers, options), who, "broadcasting replica 0's tensors", options_.timeout);
      }
      barrier_.arrive_and_wait(who);
    }
    flat.copy_(broadcast_);
    unflatten_from(flat, tensors);
    barrier_.arrive_and_wait(who);  // nobody reuses broadcast_ before every replica has read it
  }

  void abort(const std::string& reason) override { barrier_.abort(reason); }

 private:
  bool pinned_any(Network network) const {
    for (int64_t i = 0; i < placement_.local_replicas(); ++i) {
      if (device_of(placement_, i, network).is_cuda()) return true;
    }
    return false;
  }

  struct Slot {
    std::vector<at::Tensor> host;         // per local replica: its gradients, flattened, in (pinned) host memory
    std::vector<at::Tensor> device_flat;  // per local replica: the flat buffer on its device
    at::Tensor sum;                       // the sum over replicas, written slice by slice by the replica threads
  };
  const Placement placement_;
  const AveragingOptions options_;
  ReplicaBarrier barrier_;
  std::array<Slot, 2> slots_;
  at::Tensor broadcast_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> host_group_;
};

// ---- collective averaging ----------------------------------------------------------------------------

class CollectiveAverager final : public GradientAverager {
 public:
  CollectiveAverager(const Placement& placement, const AveragingOptions& options)
      : placement_(placement), options_(options), store_(make_store(placement, options.timeout)) {
    for (auto& groups : groups_) groups.resize(placement.local_replicas());
    for (auto& flats : flats_) flats.resize(placement.local_replicas());
  }

  void connect(int64_t local) override {
    // Every local replica joins concurrently (Gloo's rendezvous needs all ranks at once); one group
    // per network, so G's and D's buffers may be in flight at the same time on their own devices.
    for (Network network : kNetworks) {
      const int n = static_cast<int>(network);
      groups_[n][local] = make_backend(c10::make_intrusive<c10d::PrefixStore>(to_string(network), store_),
                                       placement_.replicas[local].replica, placement_.global_replicas(),
                                       device_of(placement_, local, network).type(), placement_.launch,
                                       options_.timeout);
    }
  }

  void average(int64_t local, Network network, const std::vector<at::Tensor>& grads) override {
    const std::string who = where(placement_, local, network);
    const int n = static_cast<int>(network);
    at::Tensor flat = flatten_into(flats_[n][local], grads);
    std::vector<at::Tensor> buffers{flat};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    options.timeout = options_.timeout;
    // For NCCL, wait() makes the current stream wait for the all-reduce; the host does not.
    wait_for(groups_[n][local]->allreduce(buffers, options), who, "all-reducing the gradients", options_.timeout,
             flat.is_cuda());
    flat.div_(placement_.global_replicas());
    unflatten_from(flat, grads);
  }

  void broadcast_from_first(int64_t local, Network network, const std::vector<at::Tensor>& tensors) override {
    const std::string who = where(placement_, local, network) + " broadcast";
    at::Tensor scratch;
    at::Tensor flat = flatten_into(scratch, tensors);
    std::vector<at::Tensor> buffers{flat};
    c10d::BroadcastOptions options;
    options.rootRank = 0;
    options.timeout = options_.timeout;
    wait_for(groups_[static_cast<int>(network)][local]->broadcast(buffers, options), who,
             "broadcasting replica 0's tensors", options_.timeout);
    unflatten_from(flat, tensors);
  }

  // Peers blocked in a collective, in this process or another, end by the collective's timeout.
  void abort(const std::string&) override {}

 private:
  const Placement placement_;
  const AveragingOptions options_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::array<std::vector<c10::intrusive_ptr<c10d::Backend>>, 2> groups_;  // [network][local replica]
  std::array<std::vector<at::Tensor>, 2> flats_;                          // [network][local replica]
};

}  // namespace

std::unique_ptr<GradientAverager> make_averager(const Placement& placement, const AveragingOptions& options) {
  placement.validate();
  if (placement.global_replicas() == 1) return nullptr;
  if (placement.reduce == Reduce::host) return std::make_unique<HostAverager>(placement, options);
  return std::make_unique<CollectiveAverager>(placement, options);
}

}  // namespace hierpar::strategy
