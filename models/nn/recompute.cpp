#include "hierpar/nn/recompute.h"

#include "hierpar/enum_names.h"
#include "hierpar/nn/batch_norm.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/autograd.h>

#ifdef HIERPAR_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace hierpar::nn {

namespace detail {

// A block's input while it is offloaded: a pinned host copy (CUDA; the CPU keeps the input itself), and once
// fetched, its device copy. The copies run on one side stream, so the copy back follows the copy out.
struct OffloadedInput {
  at::Tensor host, fetched;
  c10::Device device{c10::kCPU};
  std::vector<int64_t> sizes, strides;
  at::TensorOptions options;
  std::mutex mutex;
  bool fetching = false;
  // The input's version counter (not its memory) and its version when stored: as autograd's saved tensors, a block
  // whose input changed in place since its forward refuses its backward.
  c10::VariableVersion version{c10::VariableVersion::DISABLED};
  uint32_t stored_version = 0;
#ifdef HIERPAR_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> stream;
  at::cuda::CUDAEvent copied_out, copied_back;
#endif

  // Starts the copy of `input` to pinned host memory after the work queued on the current stream (which produces
  // it); the caching allocator keeps the input's device memory until the copy is done.
  static std::shared_ptr<OffloadedInput> store(const at::Tensor& input) {
    auto o = std::make_shared<OffloadedInput>();
    o->device = input.device();
    o->version = input.unsafeGetTensorImpl()->version_counter();
    o->stored_version = o->version.enabled() ? o->version.current_version() : 0;
#ifdef HIERPAR_WITH_CUDA
    if (input.is_cuda() && input.is_non_overlapping_and_dense()) {
      o->sizes = input.sizes().vec();
      o->strides = input.strides().vec();
      o->options = input.options();
      const c10::cuda::CUDAGuard guard(input.device());
      o->stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, input.device().index());
      at::cuda::CUDAEvent produced;
      produced.record(c10::cuda::getCurrentCUDAStream(input.device().index()));
      produced.block(*o->stream);
      o->host = at::empty_strided(o->sizes, o->strides, o->options.device(at::kCPU).pinned_memory(true));
      {
        const c10::cuda::CUDAStreamGuard on_copy_stream(*o->stream);
        o->host.copy_(input, /*non_blocking=*/true);
      }
      o->copied_out.record(*o->stream);
      input.record_stream(*o->stream);
      return o;
    }
#endif
    o->host = input;  // on the CPU (or a tensor with gaps) the input stays where it is
    return o;
  }

  // Blocks the calling thread until the input is in host memory. The caching allocator reuses the input's device
  // memory only once it sees the copy done when it allocates, on the host: a wait queued on a stream would not do.
  void wait_until_copied_out() {
#ifdef HIERPAR_WITH_CUDA
    if (stream) copied_out.synchronize();
#endif
  }

  // Starts the copy back to the device (once), after the work queued so far on the current stream, whose memory
  // the new tensor may reuse.
  void prefetch() {
    std::lock_guard<std::mutex> lock(mutex);
    fetch_locked();
  }

  // The input on its device; the current stream waits for its copy. The host copy stays until the node is
  // released (a backward with retain_graph may run again).
  at::Tensor take() {
    std::lock_guard<std::mutex> lock(mutex);
    TORCH_CHECK(!version.enabled() || version.current_version() == stored_version, "recompute: the input of a block "
                "offloaded to host memory was modified by an in-place operation after the block's forward (version ",
                version.current_version(), ", stored at ", stored_version, "); its backward needs the input as the "
                "forward saw it");
    fetch_locked();
#ifdef HIERPAR_WITH_CUDA
    if (stream) {
      const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device.index());
      copied_back.block(current);
      // Fetched on the stream of the block that prefetched it, read on this one: freed only after this one's use.
      fetched.record_stream(current);
    }
#endif
    fetching = false;
    return std::move(fetched);
  }

 private:
  void fetch_locked() {
    if (fetching) return;
    fetching = true;
#ifdef HIERPAR_WITH_CUDA
    if (stream) {
      const c10::cuda::CUDAGuard guard(device);
      fetched = at::empty_strided(sizes, strides, options);
      at::cuda::CUDAEvent allocated;
      allocated.record(c10::cuda::getCurrentCUDAStream(device.index()));
      allocated.block(*stream);
      {
        const c10::cuda::CUDAStreamGuard on_copy_stream(*stream);
        fetched.copy_(host, /*non_blocking=*/true);
      }
      fetched.record_stream(*stream);
      copied_back.record(*stream);
      return;
    }
#endif
    fetched = host;
  }
};

}  // namespace detail

namespace {

// One device's offload plan (begin_offload_step): what the measured step saw of each block, and the blocks kept.
struct DevicePlan {
  enum class State { unmarked, measuring, planned };
  using Key = std::pair<uint64_t, int64_t>;  // (chain, block)
  struct Seen {
    int64_t input_numel = 0;
    OffloadCandidate candidate;
  };
  std::mutex mutex;
  State state = State::unmarked;
  bool stale = false;  // a block's input changed shape since the plan: the next step measures again
  double budget = 0.9;
  std::map<Key, Seen> seen;
  std::set<Key> kept;
  std::string summary;  // offload_plan_summary()
};

// The plans of the devices on which a block has offloaded (keeps_activations creates them).
std::mutex plans_mutex;
std::map<c10::DeviceIndex, std::shared_ptr<DevicePlan>> plans;

std::shared_ptr<DevicePlan> plan_of(c10::DeviceIndex device, bool create) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  auto it = plans.find(device);
  if (it != plans.end()) return it->second;
  if (!create) return nullptr;
  return plans[device] = std::make_shared<DevicePlan>();
}

std::atomic<uint64_t> next_chain_id{1};

}  // namespace

std::vector<bool> plan_kept_blocks(const std::vector<OffloadCandidate>& blocks, int64_t measured_peak,
                                   int64_t budget_bytes) {
  std::vector<size_t> order(blocks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  auto ratio = [&](size_t i) {
    return static_cast<double>(blocks[i].input_bytes) / static_cast<double>(std::max<int64_t>(1, blocks[i].kept_bytes));
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return ratio(a) != ratio(b) ? ratio(a) > ratio(b) : blocks[a].kept_bytes > blocks[b].kept_bytes;
  });
  std::vector<bool> kept(blocks.size(), false);
  int64_t headroom = budget_bytes - measured_peak;
  for (size_t i : order) {
    if (blocks[i].kept_bytes <= headroom) {
      kept[i] = true;
      headroom -= blocks[i].kept_bytes;
    }
  }
  return kept;
}

void begin_offload_step(const c10::Device& device) {
#ifdef HIERPAR_WITH_CUDA
  if (!device.is_cuda()) return;
  const std::shared_ptr<DevicePlan> plan = plan_of(device.index(), /*create=*/false);
  if (plan == nullptr) return;
  std::lock_guard<std::mutex> lock(plan->mutex);
  if (plan->state == DevicePlan::State::planned && !plan->stale) return;
  if (plan->state == DevicePlan::State::measuring && !plan->stale) {
    // The peak of the allocations, not of the allocator's reserved memory: the cache grows to the whole GPU under
    // churn and gives back what it holds before an allocation fails, so its peak says nothing about the step's need.
    // The budget's margin (1 - budget of the GPU) is what fragmentation may take.
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    const int64_t peak = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
    const auto total = static_cast<double>(at::cuda::getDeviceProperties(device.index())->totalGlobalMem);
    std::vector<DevicePlan::Key> keys;
    std::vector<OffloadCandidate> candidates;
    for (const auto& [key, seen] : plan->seen) {
      keys.push_back(key);
      candidates.push_back(seen.candidate);
    }
    const std::vector<bool> kept = plan_kept_blocks(candidates, peak, static_cast<int64_t>(plan->budget * total));
    plan->kept.clear();
    int64_t kept_bytes = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!kept[i]) continue;
      plan->kept.insert(keys[i]);
      kept_bytes += candidates[i].kept_bytes;
    }
    plan->state = DevicePlan::State::planned;
    auto gb = [](double bytes) { return c10::str(std::round(bytes / 1e8) / 10.0, " GB"); };
    plan->summary = c10::str("offload plan on ", device, ": ", plan->kept.size(), " of ", keys.size(),
                             " blocks keep their activations (", gb(static_cast<double>(kept_bytes)),
                             "); the measured step allocated at most ", gb(static_cast<double>(peak)), " of a ",
                             gb(plan->budget * total), " budget");
    return;
  }
  // No plan yet, or one for other shapes: this step offloads every block and measures its peak allocation.
  plan->seen.clear();
  plan->kept.clear();
  plan->stale = false;
  plan->state = DevicePlan::State::measuring;
  c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#else
  (void)device;
#endif
}

std::string offload_plan_summary(const c10::Device& device) {
  if (!device.is_cuda()) return "";
  const std::shared_ptr<DevicePlan> plan = plan_of(device.index(), /*create=*/false);
  if (plan == nullptr) return "";
  std::lock_guard<std::mutex> lock(plan->mutex);
  return plan->state == DevicePlan::State::planned ? plan->summary : "";
}

OffloadChain::OffloadChain() : id_(next_chain_id.fetch_add(1)) {}

std::weak_ptr<detail::OffloadedInput> OffloadChain::append(const std::shared_ptr<detail::OffloadedInput>& input) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::weak_ptr<detail::OffloadedInput> previous = last_;
  last_ = input;
  return previous;
}

bool OffloadChain::keeps_activations(int64_t block, const torch::Tensor& input) const {
  if (!input.is_cuda() || budget <= 0) return false;
  const std::shared_ptr<DevicePlan> plan = plan_of(input.device().index(), /*create=*/true);
  std::lock_guard<std::mutex> lock(plan->mutex);
  plan->budget = budget;
  if (plan->state != DevicePlan::State::planned) return false;
  const DevicePlan::Key key{id_, block};
  const auto seen = plan->seen.find(key);
  if (seen == plan->seen.end() || seen->second.input_numel != input.numel()) {
    plan->stale = true;
    return false;
  }
  return plan->kept.count(key) > 0;
}

void OffloadChain::observe(int64_t block, const torch::Tensor& input, const torch::Tensor& output) const {
  if (!input.is_cuda() || budget <= 0) return;
  const std::shared_ptr<DevicePlan> plan = plan_of(input.device().index(), /*create=*/true);
  std::lock_guard<std::mutex> lock(plan->mutex);
  if (plan->state != DevicePlan::State::measuring) return;
  DevicePlan::Seen& seen = plan->seen[{id_, block}];
  const int64_t in = input.numel() * static_cast<int64_t>(input.element_size());
  const int64_t out = output.numel() * static_cast<int64_t>(output.element_size());
  seen.input_numel = input.numel();
  seen.candidate.input_bytes = std::max(seen.candidate.input_bytes, in);
  seen.candidate.kept_bytes = std::max(seen.candidate.kept_bytes, in + out);
}

namespace {
constexpr EnumNames<ActivationMemory, 3> activation_memory_names{{{ActivationMemory::none, "none"},
                                                                   {ActivationMemory::recompute, "recompute"},
                                                                   {ActivationMemory::offload, "offload"}}};
}  // namespace

const char* to_string(ActivationMemory memory) { return name_of(activation_memory_names, memory); }

ActivationMemory parse_activation_memory(const std::string& name) {
  return parse_name(activation_memory_names, name, "--memory");
}

namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// The autocast state of one device type, as the forward saw it; applied to the recomputation, which runs on
// autograd's thread (its own thread-local autocast state).
struct AutocastState {
  c10::DeviceType device_type = c10::DeviceType::CPU;
  bool enabled = false;
  c10::ScalarType dtype = c10::kFloat;

  static AutocastState of(c10::DeviceType type) {
    return {type, at::autocast::is_autocast_enabled(type), at::autocast::get_autocast_dtype(type)};
  }
};

class AutocastAs {
 public:
  explicit AutocastAs(const AutocastState& state)
      : state_(state), was_(AutocastState::of(state.device_type)) {
    at::autocast::set_autocast_enabled(state_.device_type, state_.enabled);
    at::autocast::set_autocast_dtype(state_.device_type, state_.dtype);
  }
  ~AutocastAs() {
    at::autocast::set_autocast_enabled(was_.device_type, was_.enabled);
    at::autocast::set_autocast_dtype(was_.device_type, was_.dtype);
  }

 private:
  AutocastState state_, was_;
};

// Points each buffer at a copy of its values while alive, and back at its own memory after. set_data() makes no new
// version, which stock BatchNorm's recomputed backward (it saves the running statistics) would take for an in-place
// change of what it saved.
class BuffersSetAside {
 public:
  explicit BuffersSetAside(const std::vector<at::Tensor>& buffers) : buffers_(buffers) {
    torch::NoGradGuard no_grad;
    for (const at::Tensor& b : buffers_) {
      own_.push_back(b.variable_data());
      b.set_data(b.detach().clone());
    }
  }
  ~BuffersSetAside() {
    for (size_t i = 0; i < own_.size(); ++i) buffers_[i].set_data(own_[i]);
  }
  BuffersSetAside(const BuffersSetAside&) = delete;
  BuffersSetAside& operator=(const BuffersSetAside&) = delete;

 private:
  const std::vector<at::Tensor>& buffers_;
  std::vector<at::Tensor> own_;
};

// Edges: the input, then every parameter (empty edges for those that need no gradient).
struct RecomputeBackward final : torch::autograd::Node {
  std::string name() const override { return "hierpar::RecomputeBackward"; }

  variable_list apply(variable_list&& grads) override {
    const size_t parameters = this->parameters.size();
    variable_list result(1 + parameters);
    if (!grads[0].defined()) return result;
    // create_graph when the caller differentiates this backward again (grad mode is on inside it then): the
    // recomputation then starts from the input with its history, so that the gradients it returns depend on it.
    const bool create_graph = torch::autograd::GradMode::is_enabled();
    at::Tensor saved_input;
    if (offloaded) {
      TORCH_CHECK(!create_graph, "recompute: a block whose input is offloaded to host memory has no second "
                  "derivatives (create_graph needs the input's history on the device); use --memory recompute");
      // The block before this one runs its backward next: its input starts coming back now.
      if (auto before = previous.lock()) before->prefetch();
      saved_input = offloaded->take();
    } else {
      saved_input = input.unpack();
    }
    at::Tensor x = create_graph ? saved_input : saved_input.detach();
    if (!create_graph && should_compute_output(0)) x.requires_grad_(true);
    at::Tensor out;
    {
      // The recomputation updates copies of the buffers (BatchNorm's running statistics), not the module's own, so
      // they advance once per forward; and a pass over the same module on another stream meanwhile (D's fakes while
      // the real batch's backward recomputes) is not undone by a write-back.
      const BuffersSetAside set_aside(buffers);
      torch::AutoGradMode grad_mode(true);
      AutocastAs autocast(autocast_state);
      out = block(x);
    }
    std::vector<at::Tensor> wrt;
    std::vector<size_t> slots;
    if (should_compute_output(0)) {
      wrt.push_back(x);
      slots.push_back(0);
    }
    for (size_t i = 0; i < parameters; ++i) {
      if (should_compute_output(1 + i)) {
        wrt.push_back(this->parameters[i]);
        slots.push_back(1 + i);
      }
    }
    if (wrt.empty()) return result;
    const variable_list computed = torch::autograd::grad({out}, wrt, {grads[0]}, /*retain_graph=*/create_graph,
                                                         create_graph, /*allow_unused=*/true);
    for (size_t k = 0; k < slots.size(); ++k) result[slots[k]] = computed[k];
    return result;
  }

  void release_variables() override {
    input.reset_data();
    offloaded.reset();
    block = nullptr;
  }

  SavedVariable input;                                   // kept on the device (no offload)
  std::shared_ptr<detail::OffloadedInput> offloaded;     // or offloaded to host memory
  std::weak_ptr<detail::OffloadedInput> previous;        // the block offloaded before this one
  Block block;
  std::vector<at::Tensor> parameters, buffers;
  AutocastState autocast_state;
};

}  // namespace

torch::Tensor recompute(Block block, const torch::Tensor& input,
                        const std::vector<std::shared_ptr<torch::nn::Module>>& modules, OffloadChain* offload) {
  std::vector<at::Tensor> parameters, buffers;
  for (const auto& module : modules) {
    TORCH_CHECK(module != nullptr, "recompute: modules must not be null");
    for (const at::Tensor& p : module->parameters()) parameters.push_back(p);
    for (const at::Tensor& b : module->buffers()) buffers.push_back(b);
  }
  if (!torch::autograd::GradMode::is_enabled() ||
      !torch::autograd::compute_requires_grad(input, at::TensorList(parameters))) {
    return block(input);
  }
  TORCH_CHECK(batch_norm_sync() == nullptr, "recompute: synchronized BatchNorm (a BatchNormSync installed) in a "
              "recomputed block is not supported: the backward's recomputation runs on autograd's thread, without the "
              "other replicas' statistics, so its gradients would be those of per-replica statistics");
  std::shared_ptr<detail::OffloadedInput> offloaded;
  std::weak_ptr<detail::OffloadedInput> previous;
  if (offload != nullptr) {
    // The copy out starts now, beside this block's forward, which is queued once the copy out of the block before it
    // is done. PCIe is slower than the blocks: without that wait the host queued the whole pass at once and every
    // offloaded input stayed on the device until its copy was done (the pass's peak held them all); with it, two.
    offloaded = detail::OffloadedInput::store(input);
    previous = offload->append(offloaded);
    if (auto before = previous.lock()) before->wait_until_copied_out();
  }
  at::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = block(input);
  }
  if (out.is_view()) out = out.clone();  // history goes on a tensor of its own, not on a view made without grad
  std::shared_ptr<RecomputeBackward> node(new RecomputeBackward(), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(input, at::TensorList(parameters)));
  if (offloaded != nullptr) {
    node->offloaded = std::move(offloaded);
    node->previous = std::move(previous);
  } else {
    node->input = SavedVariable(input, /*is_output=*/false);
  }
  node->block = std::move(block);
  node->parameters = std::move(parameters);
  node->buffers = std::move(buffers);
  node->autocast_state = AutocastState::of(input.device().type());
  torch::autograd::set_history(out, node);
  return out;
}

}  // namespace hierpar::nn
