// Gradient averaging's public functions (the store the processes meet in, make_averager) and the pieces the two
// averagers share (averaging_parts.h); the averagers themselves are host_averager.cpp and collective_averager.cpp.
// The Gloo and NCCL process groups are constructed here: gloo's headers come from the system (Debian's
// libgloo-dev; LibTorch's wheel lacks them), nccl.h from the nvidia-nccl wheel (the top CMakeLists.txt adds the
// include directories it finds).
#include "hierpar/strategy/averaging.h"

#include "averaging_parts.h"
#include "hierpar/enum_names.h"

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef HIERPAR_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef HIERPAR_C10D_NCCL
#include <torch/csrc/cuda/nccl.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include <unistd.h>

namespace hierpar::strategy {

const char* to_string(Network network) { return network == Network::generator ? "generator" : "discriminator"; }

const char* to_string(GraphAveraging mode) {
  constexpr EnumNames<GraphAveraging, 3> names{
      {{GraphAveraging::between, "between"}, {GraphAveraging::copies, "copies"}, {GraphAveraging::whole, "whole"}}};
  return name_of(names, mode);
}

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

namespace detail {

std::string where(const Placement& placement, int64_t local, Network network) {
  const ReplicaDevices& r = placement.replicas[local];
  return c10::str("replica ", r.replica, " (", to_string(network), " on ",
                  network == Network::generator ? r.generator : r.discriminator, ")");
}

c10::Device device_of(const Placement& placement, int64_t local, Network network) {
  const ReplicaDevices& r = placement.replicas[local];
  return network == Network::generator ? r.generator : r.discriminator;
}

bool all_on_cuda(const Placement& placement) {
  return std::all_of(placement.replicas.begin(), placement.replicas.end(),
                     [](const ReplicaDevices& r) { return r.generator.is_cuda() && r.discriminator.is_cuda(); });
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

std::vector<int64_t> global_indices(const Placement& placement) {
  std::vector<int64_t> indices;
  for (const ReplicaDevices& r : placement.replicas) indices.push_back(r.replica);
  return indices;
}

namespace {
bool is_loopback(const std::string& host) { return host == "127.0.0.1" || host == "localhost" || host == "::1"; }
}  // namespace

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

void abort_nccl_groups(std::vector<c10::intrusive_ptr<c10d::Backend>> groups) {
  if (groups.empty()) return;
  // libtorch's NCCL watchdog logs every collective the abort cuts short as an error with a stack trace; the run's
  // failure already has its one line (RunGuard, the trainer's error), so from here on only fatal logs print.
  FLAGS_caffe2_log_level = std::max(FLAGS_caffe2_log_level, 3);
  std::thread([groups = std::move(groups)] {
    for (const auto& group : groups) group->abort();
  }).detach();
}

void release_backend(c10::intrusive_ptr<c10d::Backend>& group) {
  std::vector<c10::intrusive_ptr<c10d::Backend>> one{std::move(group)};
  release_backends(one);
}

void release_backends(std::vector<c10::intrusive_ptr<c10d::Backend>>& groups) {
  std::vector<c10::intrusive_ptr<c10d::Backend>> nccl;
  for (auto& group : groups) {
    if (group && group->getBackendName() == "nccl" && group.use_count() == 1) {
      nccl.push_back(std::move(group));
    } else {
      group.reset();
    }
  }
  groups.clear();
  if (nccl.empty()) return;
  // ProcessGroupNCCL's destructor aborts its communicator (C++ has no destroy_process_group()), and its watchdog
  // then logs the last collective as failed ("unhandled system error", a stack trace) before the destructor joins
  // it. Nothing failed: the logs are held back until the groups are gone.
  const int level = FLAGS_caffe2_log_level;
  FLAGS_caffe2_log_level = std::max(level, 3);
  if (nccl.size() == 1) {
    nccl.front().reset();
  } else {
    std::vector<std::thread> threads;
    for (auto& group : nccl) threads.emplace_back([g = std::move(group)]() mutable { g.reset(); });
    for (auto& t : threads) t.join();
  }
  FLAGS_caffe2_log_level = level;
}

}  // namespace detail

struct ProcessGroupCache::Groups {
  std::mutex mutex;
  std::string placement;  // what every group held belongs to (Placement::to_string), set by the first use
  std::map<std::pair<int, int64_t>, c10::intrusive_ptr<c10d::Backend>> by_replica;  // [(network, local replica)]
  void check(const Placement& p) {
    const std::string text = p.to_string();
    if (placement.empty()) placement = text;
    TORCH_CHECK(placement == text, "ProcessGroupCache: holds the groups of placement '", placement,
                "', asked for placement '", text, "'");
  }
};

ProcessGroupCache::ProcessGroupCache() : groups_(std::make_unique<Groups>()) {}

ProcessGroupCache::~ProcessGroupCache() {
  std::vector<c10::intrusive_ptr<c10d::Backend>> all;
  for (auto& [key, group] : groups_->by_replica) all.push_back(std::move(group));
  detail::release_backends(all);
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupCache::take(const Placement& placement, Network network, int64_t local) {
  std::lock_guard<std::mutex> lock(groups_->mutex);
  groups_->check(placement);
  auto it = groups_->by_replica.find({static_cast<int>(network), local});
  if (it == groups_->by_replica.end()) return {};
  c10::intrusive_ptr<c10d::Backend> group = std::move(it->second);
  groups_->by_replica.erase(it);
  return group;
}

void ProcessGroupCache::give_back(const Placement& placement, Network network, int64_t local,
                                  c10::intrusive_ptr<c10d::Backend> group) {
  if (!group) return;
  std::lock_guard<std::mutex> lock(groups_->mutex);
  groups_->check(placement);
  groups_->by_replica[{static_cast<int>(network), local}] = std::move(group);
}

size_t ProcessGroupCache::size() const {
  std::lock_guard<std::mutex> lock(groups_->mutex);
  return groups_->by_replica.size();
}

namespace detail {

namespace {
std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }
}  // namespace

void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const std::string& who, const char* what,
              std::chrono::milliseconds timeout, const AbortState& aborted, bool device_side) {
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

namespace {

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

}  // namespace

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

void detach_hooks(std::array<std::vector<std::unique_ptr<BucketReducer>>, 2>& reducers) {
  for (auto& network_reducers : reducers) {
    for (auto& reducer : network_reducers) {
      if (!reducer) continue;
      for (const at::Tensor& p : reducer->parameters()) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
    }
  }
}

}  // namespace detail

std::unique_ptr<GradientAverager> make_averager(const Placement& placement, const AveragingOptions& options) {
  placement.validate();
  TORCH_CHECK(!options.networks.empty() && options.networks.size() <= 2 &&
                  (options.networks.size() == 1 || options.networks[0] != options.networks[1]),
              "AveragingOptions: networks must name the generator, the discriminator or both, once each");
  if (placement.global_replicas() == 1) return nullptr;
  if (placement.reduce == Reduce::host) return detail::make_host_averager(placement, options);
  return detail::make_collective_averager(placement, options);
}

}  // namespace hierpar::strategy
