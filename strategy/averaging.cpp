// Gradient averaging: host (pinned buffers, CPU threads) and collective (c10d process groups).
// The Gloo and NCCL headers are included here only. torch's CMake interface defines USE_C10D_GLOO and
// USE_C10D_NCCL for every file that links it (they describe torch's build, not which headers this build
// has), so whether the headers are there is asked with __has_include: gloo's come from the system
// (Debian's libgloo-dev; LibTorch's wheel lacks them), nccl.h from the nvidia-nccl wheel (the top
// CMakeLists.txt adds the include directories it finds).
#include "hierpar/strategy/averaging.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#if defined(USE_C10D_GLOO) && __has_include(<gloo/algorithm.h>)
#define HIERPAR_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if defined(USE_C10D_NCCL) && defined(HIERPAR_WITH_CUDA) && __has_include(<nccl.h>)
#define HIERPAR_C10D_NCCL
#include <torch/csrc/cuda/nccl.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include <unistd.h>

namespace hierpar::strategy {

const char* to_string(Network network) { return network == Network::generator ? "generator" : "discriminator"; }

bool gloo_available() {
#ifdef HIERPAR_C10D_GLOO
  return true;
#else
  return false;
#endif
}

void throw_peer_failure(const std::string& message) {
  throw PeerFailure({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message);
}

namespace {

std::string text_of(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }
std::vector<uint8_t> bytes_of(const std::string& text) { return {text.begin(), text.end()}; }

// The ranks of one launch agree on a namespace that no earlier attempt of the run used. torchrun's agent store
// outlives a restart and keeps the failed attempt's keys, and TORCHELASTIC_RESTART_COUNT cannot name the attempt:
// each agent counts its own restarts, so after one node's worker fails the other node's restarted workers still
// say 0 (seen with two agents, --nnodes 2). Every key here is answered with fresh random tokens, so a stale
// value never matches: rank r posts a token; rank 0 answers each posted token with its own; rank r takes rank 0's
// token from the answer to its token and confirms it; rank 0 waits for every confirmation of its token.
std::string agree_on_namespace(c10d::Store& store, const Launch& launch, std::chrono::milliseconds timeout) {
  std::random_device entropy;
  const std::string token = c10::str(std::hex, entropy(), entropy(), "-", ::getpid());
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const std::string prefix = "hierpar/handshake/";
  auto key = [&](const char* what, int64_t rank) { return prefix + what + "/" + std::to_string(rank); };
  auto pause = std::chrono::microseconds(200);
  auto wait_a_little = [&](const std::string& waiting_for) {
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "rank ", launch.rank, ": ", waiting_for, " within ",
                timeout.count(), " ms (MASTER_ADDR ", launch.master_addr, ", MASTER_PORT ", launch.master_port, ")");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  };
  if (launch.rank != 0) {
    store.set(key("token", launch.rank), bytes_of(token));
    for (;;) {
      if (store.check({key("answer", launch.rank)})) {
        const std::string answer = text_of(store.get(key("answer", launch.rank)));
        const auto space = answer.find(' ');
        if (answer.substr(0, space) == token) {
          const std::string chosen = answer.substr(space + 1);
          store.set(key("confirmed", launch.rank), bytes_of(chosen));
          return chosen;
        }
      }
      wait_a_little("rank 0 did not join the run");
    }
  }
  std::vector<std::string> answered(launch.world_size);
  for (;;) {
    int64_t confirmed = 1;
    for (int64_t r = 1; r < launch.world_size; ++r) {
      if (store.check({key("confirmed", r)}) && text_of(store.get(key("confirmed", r))) == token) {
        ++confirmed;
        continue;
      }
      if (!store.check({key("token", r)})) continue;
      const std::string posted = text_of(store.get(key("token", r)));
      if (posted != answered[r]) {
        store.set(key("answer", r), bytes_of(posted + " " + token));
        answered[r] = posted;
      }
    }
    if (confirmed == launch.world_size) return token;
    wait_a_little(c10::str(launch.world_size - confirmed, " rank(s) did not join the run"));
  }
}

}  // namespace

c10::intrusive_ptr<c10d::Store> connect_launch_store(const Launch& launch, std::chrono::milliseconds timeout) {
  if (!launch.multi_process()) return c10::make_intrusive<c10d::HashStore>();
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(launch.master_port);
  options.isServer = launch.rank == 0 && !launch.agent_store;
  options.numWorkers = static_cast<size_t>(launch.world_size);
  options.waitWorkers = false;  // the process groups' own rendezvous waits, with their timeout
  options.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(launch.master_addr, options);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    TORCH_CHECK(false, "rank ", launch.rank, ": cannot ", options.isServer ? "serve" : "reach", " the rendezvous store at ",
                launch.master_addr, ":", launch.master_port, " (MASTER_ADDR, MASTER_PORT) within ", timeout.count(),
                " ms: ", what.substr(0, what.find('\n')));
  }
  return c10::make_intrusive<c10d::PrefixStore>("hierpar/" + agree_on_namespace(*store, launch, timeout), store);
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

// A buffer that grows and never shrinks (pinned host memory is costly to allocate); the first `numel`
// elements are the view used.
at::Tensor reserve(at::Tensor& buffer, int64_t numel, const at::TensorOptions& options) {
  if (!buffer.defined() || buffer.numel() < numel || buffer.device() != options.device() ||
      buffer.scalar_type() != c10::typeMetaToScalarType(options.dtype())) {
    buffer = at::empty({numel}, options);
  }
  return buffer.narrow(0, 0, numel);
}

void unflatten_from(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

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

std::vector<int64_t> global_indices(const Placement& placement) {
  std::vector<int64_t> indices;
  for (const ReplicaDevices& r : placement.replicas) indices.push_back(r.replica);
  return indices;
}

bool is_loopback(const std::string& host) { return host == "127.0.0.1" || host == "localhost" || host == "::1"; }

// One rank of a process group over `store`: NCCL for CUDA tensors, Gloo for CPU tensors.
c10::intrusive_ptr<c10d::Backend> make_backend(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank, int64_t size,
                                               c10::DeviceType device_type, const Launch& launch,
                                               std::chrono::milliseconds timeout) {
  if (device_type == c10::DeviceType::CUDA) {
#ifdef HIERPAR_C10D_NCCL
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    // The replica threads of one process construct their ranks one at a time: the constructor reads the
    // environment and starts process-wide threads; it needs no peer.
    static std::mutex construction;
    std::lock_guard<std::mutex> lock(construction);
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(rank), static_cast<int>(size), options);
#else
    TORCH_CHECK(false, "--reduce nccl on CUDA devices needs hierpar built with NCCL (nccl.h found); this build has "
                "none: use --reduce host");
#endif
  }
#ifdef HIERPAR_C10D_GLOO
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  // One process, or every process on this host: loopback, which needs no name resolution. Otherwise
  // Gloo's default (GLOO_SOCKET_IFNAME, or the interface of this host's name).
  options->devices.push_back(!launch.multi_process() || is_loopback(launch.master_addr)
                                 ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                 : c10d::ProcessGroupGloo::createDefaultDevice());
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank), static_cast<int>(size), options);
#else
  (void)store; (void)rank; (void)size; (void)launch; (void)timeout;
  TORCH_CHECK(false, "collective averaging on CPU needs hierpar built with Gloo (the gloo headers "
              "come from Debian's libgloo-dev): this build has none");
#endif
}

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

// Waits for a collective, turning a failure, a timeout or an abort into a PeerFailure that says what was being
// averaged. On CPU (Gloo) the host waits, at most `timeout` and only until the averager is aborted (Gloo's own
// wait cannot be interrupted). On CUDA (NCCL) wait() only makes the current stream wait; given an explicit
// timeout it would also block the host until the all-reduce ends, so there the process group's timeout or an
// abort of its communicators bounds the wait instead.
void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const std::string& who, const char* what,
              std::chrono::milliseconds timeout, const AbortState& aborted, bool device_side = false) {
  try {
    aborted.check(who);
    if (!device_side) {
      struct Completion {
        std::mutex mutex;
        std::condition_variable done;
        bool completed = false;
      };
      auto completion = std::make_shared<Completion>();  // outlives an abandoned wait: the callback may come later
      work->getFuture()->addCallback([completion](c10::ivalue::Future&) {
        std::lock_guard<std::mutex> lock(completion->mutex);
        completion->completed = true;
        completion->done.notify_all();
      });
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      std::unique_lock<std::mutex> lock(completion->mutex);
      while (!completion->done.wait_for(lock, std::chrono::milliseconds(20), [&] { return completion->completed; })) {
        aborted.check(who);
        if (std::chrono::steady_clock::now() > deadline) {
          throw_peer_failure(c10::str(who, ": ", what, " did not complete within ", timeout.count(),
                                      " ms (a peer replica may hang, have failed or died)"));
        }
      }
    }
    work->wait();  // rethrows the collective's error
  } catch (const PeerFailure&) {
    throw;
  } catch (const std::exception& e) {
    throw_peer_failure(c10::str(who, ": ", what, " failed (a peer replica may have failed or died): ", first_line(e.what())));
  }
}

#ifdef HIERPAR_C10D_NCCL
// ProcessGroupNCCL is allocated here (make_intrusive) but constructed and used by libtorch_cuda: its
// layout, which depends on the NCCL version of the headers (NCCL_HAS_* feature macros in NCCLUtils.hpp),
// must be the one torch was built with, or the constructor writes past our allocation. torch reports
// the version it was compiled with; the top CMakeLists.txt picks nccl.h from the nvidia-nccl wheel that
// torch pins, and this check says so if another nccl.h was found.
void check_nccl_headers_match_torch() {
  const uint64_t torch_version = torch::cuda::nccl::version();  // (major << 32) | (minor << 16) | patch
  const uint64_t ours = (uint64_t{NCCL_MAJOR} << 32) | (uint64_t{NCCL_MINOR} << 16) | uint64_t{NCCL_PATCH};
  TORCH_CHECK(torch_version == ours, "hierpar was compiled with NCCL headers ", NCCL_MAJOR, ".", NCCL_MINOR, ".",
              NCCL_PATCH, " but torch with NCCL ", (torch_version >> 32), ".", ((torch_version >> 16) & 0xffff), ".",
              (torch_version & 0xffff), ": ProcessGroupNCCL's layout may differ (memory corruption); reconfigure "
              "with HIERPAR_NCCL_INCLUDE_DIR pointing at the nccl.h of torch's nvidia-nccl wheel");
}

// NCCL's one-time process initialisation (it reads ~/.nccl.conf and /etc/nccl.conf into the environment
// with setenv(), and probes the network) run once on the constructing thread, before any replica thread
// exists: setenv() racing with getenv() on another thread (a replica creating its cuDNN/cuBLAS handles
// during its first step) can crash glibc, and in-process ranks otherwise reach it concurrently.
//
// NCCL_RUNTIME_CONNECT=0 (unless the user set it): NCCL otherwise connects a communicator's rings inside its
// first collective, blocking the issuing thread until the peers connect too, and connect() issues each group's
// first collective under a process-wide lock (issue_first_collectives): in-process replicas deadlocked there
// (seen on 2 and 4 H200s: replica 0 in ncclTransportP2pSetup's accept while holding the lock, replica 1
// waiting for it). Connecting at communicator creation (eagerConnectSingleDevice, which every replica calls
// concurrently) makes issuing a collective return at once. Set before the first communicator exists, since
// NCCL reads it once.
void initialise_nccl_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    ::setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0);
    check_nccl_headers_match_torch();
    torch::cuda::nccl::ncclUniqueId id;
    torch::cuda::nccl::get_unique_id(id);
  });
}
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

  // After the backward: starts what the hooks did not (parameters without gradients: `grads` holds zeros for
  // them), waits for every bucket, divides by `replicas` and writes the averages into `grads`.
  void finish(const std::vector<at::Tensor>& grads, int64_t replicas, const std::string& who) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(grads.size() == parameters_.size(), who, ": expected the gradients of the ", parameters_.size(),
                " attached parameters, got ", grads.size());
    while (next_ < buckets_.size()) start(next_++, who, &grads);
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

class ReadyHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  ReadyHook(BucketReducer* reducer, size_t index, std::string who)
      : reducer_(reducer), index_(index), who_(std::move(who)) {}
  void operator()(const torch::autograd::Variable&) override { reducer_->ready(index_, who_); }

 private:
  BucketReducer* reducer_;
  size_t index_;
  std::string who_;
};

void attach_hooks(BucketReducer& reducer, const std::string& who) {
  const std::vector<at::Tensor>& parameters = reducer.parameters();
  for (size_t i = 0; i < parameters.size(); ++i) {
    TORCH_CHECK(parameters[i].is_leaf() && parameters[i].requires_grad(), who, ": parameter ", i,
                " must be a leaf that requires grad to be averaged by hooks");
    TORCH_CHECK(!torch::autograd::impl::post_acc_grad_hooks(parameters[i]), who, ": parameter ", i,
                " already has a post-accumulate-grad hook (one averager per parameter)");
    torch::autograd::impl::set_post_acc_grad_hooks(parameters[i], std::make_unique<ReadyHook>(&reducer, i, who));
  }
}

// The modules outlive the averager (replica 0's are the caller's): their hooks must not call into it after it is gone.
void detach_hooks(std::array<std::vector<std::unique_ptr<BucketReducer>>, 2>& reducers) {
  for (auto& network_reducers : reducers) {
    for (auto& reducer : network_reducers) {
      if (!reducer) continue;
      for (const at::Tensor& p : reducer->parameters()) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
    }
  }
}

// ---- host averaging --------------------------------------------------------------------------------

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
    if (local == 0 && placement_.launch.multi_process()) {
      store_ = options_.store ? options_.store : connect_launch_store(placement_.launch, options_.timeout);
      for (Network network : kNetworks) {
        host_groups_[static_cast<int>(network)] =
            make_backend(c10::make_intrusive<c10d::PrefixStore>(std::string("host-") + to_string(network), store_),
                         placement_.launch.rank, placement_.launch.world_size, c10::DeviceType::CPU, placement_.launch,
                         options_.timeout);
      }
    }
    barriers_[0]->arrive_and_wait(local, c10::str("replica ", placement_.replicas[local].replica, " (connecting)"));
  }

  // Buckets summed during the backward (eager steps; the trainer attaches none to captured steps, nor with
  // synchronized BatchNorm, whose sums meet at the same barriers from the autograd threads).
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
    if (placement_.launch.multi_process()) {
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
  class HostBuckets final : public BucketTransport {
   public:
    HostBuckets(HostAverager& averager, int64_t local, Network network, size_t buckets, c10::Device device)
        : averager_(averager), local_(local), network_(network), buckets_(buckets) {
      if (device.is_cuda()) side_ = c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device);
    }

    void start(size_t bucket, const at::Tensor& flat, const std::string& who) override {
      averager_.entered();
      BucketBuffers& buffers = averager_.bucket_buffers_[static_cast<int>(network_)];
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
      summer_.post([this, &buffers, bucket, copied, who, numel = flat.numel()] {
        try {
          if (copied) copied->synchronize();
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
    HostAverager& averager_;
    const int64_t local_;
    const Network network_;
    const size_t buckets_;
    std::optional<c10::Stream> side_;
    std::mutex mutex_;
    std::condition_variable summed_changed_;
    size_t summed_ = 0;  // buckets of this step summed so far
    std::exception_ptr failure_;  // the first failed sum: rethrown by every later wait()
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
    if (length > 0) {
      at::Tensor out = sum.narrow(0, begin, length);
      out.copy_(hosts[0].narrow(0, begin, length));
      for (int64_t i = 1; i < parties; ++i) out.add_(hosts[i].narrow(0, begin, length));
    }
    barrier.arrive_and_wait(local, who);
    if (placement_.launch.multi_process()) {
      if (local == 0) {
        std::vector<at::Tensor> tensors{sum};
        wait_for(host_groups_[static_cast<int>(network)]->allreduce(tensors), who,
                 "summing the host buffers across processes", options_.timeout, aborted_);
      }
      barrier.arrive_and_wait(local, who);
    }
    return sum;
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

// ---- collective averaging ----------------------------------------------------------------------------

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
      for (Network network : kNetworks) {
        if (device_of(placement, i, network).is_cuda()) initialise_nccl_once();
      }
    }
#endif
  }

  ~CollectiveAverager() override { detach_hooks(reducers_); }

  void connect(int64_t local) override {
    // Every local replica joins concurrently (Gloo's rendezvous needs all ranks at once); one group
    // per network, so G's and D's buffers may be in flight at the same time on their own devices.
    for (Network network : kNetworks) {
      const int n = static_cast<int>(network);
      const c10::Device device = device_of(placement_, local, network);
      aborted_.check(where(placement_, local, network) + " connect");
      auto group = make_backend(c10::make_intrusive<c10d::PrefixStore>(to_string(network), store_),
                                placement_.replicas[local].replica, placement_.global_replicas(), device.type(),
                                placement_.launch, options_.timeout);
      {
        std::lock_guard<std::mutex> lock(groups_mutex_);  // abort() may read them from another thread
        groups_[n][local] = group;
      }
#ifdef HIERPAR_C10D_NCCL
      // The NCCL communicator is created here, while no replica computes, instead of inside the first
      // step (all ranks of the group are in connect() together, so this needs no other ordering).
      if (device.is_cuda()) group->eagerConnectSingleDevice(device);
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
    for (Network network : kNetworks) {
      const int n = static_cast<int>(network);
      probes[n] = at::zeros({1}, at::TensorOptions().device(device_of(placement_, local, network)));
      std::vector<at::Tensor> buffers{probes[n]};
      std::lock_guard<std::mutex> lock(issuing);
      works[n] = groups_[n][local]->allreduce(buffers);
    }
    for (int n = 0; n < 2; ++n) {
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
      for (Network network : kNetworks) {
        const auto& group = groups_[static_cast<int>(network)][i];
        if (group && device_of(placement_, i, network).is_cuda()) nccl.push_back(group);
      }
    }
    if (!nccl.empty()) {
      std::thread([nccl] {
        for (const auto& group : nccl) group->abort();
      }).detach();
    }
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

std::unique_ptr<GradientAverager> make_averager(const Placement& placement, const AveragingOptions& options) {
  placement.validate();
  if (placement.global_replicas() == 1) return nullptr;
  if (placement.reduce == Reduce::host) return std::make_unique<HostAverager>(placement, options);
  return std::make_unique<CollectiveAverager>(placement, options);
}

}  // namespace hierpar::strategy
