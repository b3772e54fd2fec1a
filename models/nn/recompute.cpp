#include "hierpar/nn/recompute.h"

#include "hierpar/enum_names.h"
#include "hierpar/nn/batch_norm.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/autograd.h>
#include <torch/nn/modules/batchnorm.h>

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
    TORCH_CHECK(!create_graph || slices == 0, "recompute: a block whose backward runs in batch slices "
                "(memory_slices > 1) has no second derivatives; use memory_slices 1");
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
    if (slices > 0) {
      sliced_backward(saved_input.detach(), grads[0], result);
      return result;
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
    norm.reset();
    mean.reset();
    invstd.reset();
  }

  // recompute_sliced's backward (its header comment says how); `result` as apply()'s.
  void sliced_backward(const at::Tensor& x, const at::Tensor& grad_out, variable_list& result) {
    const int64_t batch = x.size(0);
    const int64_t step = (batch + slices - 1) / slices;
    const bool want_input = should_compute_output(0);
    at::Tensor grad_input = want_input ? at::empty_like(x) : at::Tensor();
    // The slice's forward under the forward's autocast state, the rest (BatchNorm's terms, the backward) without.
    auto recomputed = [this](const at::Tensor& slice) {
      const AutocastAs autocast(autocast_state);
      return block(slice);
    };
    // BatchNorm's per-channel sums over the whole batch: of g, the gradient at BatchNorm's output (the activation's
    // derivative applied), and of g times the normalised input.
    at::Tensor sum_g, sum_g_xhat;
    if (norm) {
      torch::NoGradGuard no_grad;
      for (int64_t start = 0; start < batch; start += step) {
        const int64_t n = std::min(step, batch - start);
        const at::Tensor y = recomputed(x.narrow(0, start, n));
        const auto [g, xhat] = norm_gradient(y, grad_out.narrow(0, start, n));
        const at::Tensor s = g.sum({0, 2, 3}), sx = (g * xhat).sum({0, 2, 3});
        sum_g = sum_g.defined() ? sum_g.add_(s) : s;
        sum_g_xhat = sum_g_xhat.defined() ? sum_g_xhat.add_(sx) : sx;
      }
      // BatchNorm's own parameters: the weight's gradient is sum(g * xhat), the bias's sum(g).
      if (weight_slot > 0 && should_compute_output(weight_slot)) result[weight_slot] = sum_g_xhat.to(norm->weight.dtype());
      if (bias_slot > 0 && should_compute_output(bias_slot)) result[bias_slot] = sum_g.to(norm->bias.dtype());
    }
    for (int64_t start = 0; start < batch; start += step) {
      const int64_t n = std::min(step, batch - start);
      at::Tensor xs = x.narrow(0, start, n).detach();
      if (want_input) xs.requires_grad_(true);
      at::Tensor y, grad_y;
      {
        torch::AutoGradMode grad_mode(true);
        y = recomputed(xs);
      }
      if (norm) {
        torch::NoGradGuard no_grad;
        const auto [g, xhat] = norm_gradient(y.detach(), grad_out.narrow(0, start, n));
        // d/dy of BatchNorm: gamma / std * (g - mean(g) - xhat * mean(g * xhat)) per channel with batch statistics,
        // gamma / std * g with running ones (eval mode).
        const at::Tensor scale = per_channel(norm->weight.defined() ? norm->weight.to(invstd.dtype()) * invstd : invstd);
        if (norm->training || !norm->running_mean.defined()) {
          const double inv_count = 1.0 / static_cast<double>(count);
          grad_y = ((g - per_channel(sum_g * inv_count)) - xhat * per_channel(sum_g_xhat * inv_count)) * scale;
        } else {
          grad_y = g * scale;
        }
        grad_y = grad_y.to(y.scalar_type());
      } else {
        grad_y = grad_out.narrow(0, start, n);
      }
      std::vector<at::Tensor> wrt;
      std::vector<size_t> slots;
      if (want_input) {
        wrt.push_back(xs);
        slots.push_back(0);
      }
      for (size_t i = 0; i < per_sample_parameters; ++i) {
        if (should_compute_output(1 + i)) {
          wrt.push_back(parameters[i]);
          slots.push_back(1 + i);
        }
      }
      if (wrt.empty()) continue;
      const variable_list computed = torch::autograd::grad({y}, wrt, {grad_y}, /*retain_graph=*/false,
                                                           /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t k = 0; k < slots.size(); ++k) {
        if (!computed[k].defined()) continue;
        if (slots[k] == 0) {
          grad_input.narrow(0, start, n).copy_(computed[k]);
        } else {
          at::Tensor& sum = result[slots[k]];
          sum = sum.defined() ? sum.add_(computed[k]) : computed[k];
        }
      }
    }
    if (want_input) result[0] = grad_input;
  }

  // [C] -> [1, C, 1, 1]
  static at::Tensor per_channel(const at::Tensor& t) { return t.view({1, -1, 1, 1}); }

  // From one slice's convolution output y and the gradient at the block's output: g, the gradient at BatchNorm's
  // output (the activation's derivative applied), and the normalised input xhat, both in the statistics' dtype.
  std::pair<at::Tensor, at::Tensor> norm_gradient(const at::Tensor& y, const at::Tensor& grad_out) const {
    const at::Tensor xhat = (y.to(mean.scalar_type()) - per_channel(mean)) * per_channel(invstd);
    at::Tensor g = grad_out.to(mean.scalar_type());
    if (norm->activation != Activation::identity) {
      // The activations' derivatives as ATen's: 1 where the BatchNorm output is > 0, else 0 or the slope.
      const at::Tensor positive = batch_norm_output(xhat) > 0;
      g = norm->activation == Activation::relu ? g * positive : at::where(positive, g, g * norm->negative_slope);
    }
    return {g, xhat};
  }

  at::Tensor batch_norm_output(const at::Tensor& xhat) const {
    at::Tensor out = xhat;
    if (norm->weight.defined()) out = out * per_channel(norm->weight.to(out.dtype()));
    if (norm->bias.defined()) out = out + per_channel(norm->bias.to(out.dtype()));
    return out;
  }

  SavedVariable input;                                   // kept on the device (no offload)
  std::shared_ptr<detail::OffloadedInput> offloaded;     // or offloaded to host memory
  std::weak_ptr<detail::OffloadedInput> previous;        // the block offloaded before this one
  Block block;
  std::vector<at::Tensor> parameters, buffers;
  AutocastState autocast_state;
  // recompute_sliced: the number of slices (0: recompute()), the BatchNorm after `block` with the whole batch's
  // statistics from the forward, `count` values per channel; parameters[0, per_sample_parameters) are `block`'s, and
  // the norm's weight and bias, where they need gradients, have edges weight_slot and bias_slot (0: none).
  int64_t slices = 0;
  std::optional<BatchNormActOf> norm;
  at::Tensor mean, invstd;
  int64_t count = 0;
  size_t per_sample_parameters = 0;
  size_t weight_slot = 0, bias_slot = 0;
};

// An offloaded block's input on its way to host memory, and the block of the chain offloaded before it.
struct Offloading {
  std::shared_ptr<detail::OffloadedInput> input;
  std::weak_ptr<detail::OffloadedInput> previous;
};

// With a chain (else nothing): the copy out starts now, beside the block's forward, which is queued once the copy out
// of the block before it is done. PCIe is slower than the blocks: without that wait the host queued the whole pass
// at once and every offloaded input stayed on the device until its copy was done (the pass's peak held them all);
// with it, two.
Offloading start_offload(const at::Tensor& input, OffloadChain* chain) {
  Offloading offloading;
  if (chain == nullptr) return offloading;
  offloading.input = detail::OffloadedInput::store(input);
  offloading.previous = chain->append(offloading.input);
  if (auto before = offloading.previous.lock()) before->wait_until_copied_out();
  return offloading;
}

// The backward node of a recomputed block: edges to the input and `parameters`, the input kept (or offloaded).
std::shared_ptr<RecomputeBackward> new_node(const at::Tensor& input, std::vector<at::Tensor> parameters, Block block,
                                            const Offloading& offloading) {
  std::shared_ptr<RecomputeBackward> node(new RecomputeBackward(), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(input, at::TensorList(parameters)));
  if (offloading.input != nullptr) {
    node->offloaded = offloading.input;
    node->previous = offloading.previous;
  } else {
    node->input = SavedVariable(input, /*is_output=*/false);
  }
  node->block = std::move(block);
  node->parameters = std::move(parameters);
  node->autocast_state = AutocastState::of(input.device().type());
  return node;
}

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
  const Offloading offloading = start_offload(input, offload);
  at::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = block(input);
  }
  if (out.is_view()) out = out.clone();  // history goes on a tensor of its own, not on a view made without grad
  const std::shared_ptr<RecomputeBackward> node = new_node(input, std::move(parameters), std::move(block), offloading);
  node->buffers = std::move(buffers);
  torch::autograd::set_history(out, node);
  return out;
}

BatchNormActOf BatchNormActOf::of(const std::shared_ptr<torch::nn::Module>& module, Activation activation,
                                  double negative_slope) {
  TORCH_CHECK(module != nullptr, "BatchNormActOf: module must not be null");
  BatchNormActOf norm;
  norm.activation = activation;
  norm.negative_slope = negative_slope;
  norm.training = module->is_training();
  auto read = [&norm](const auto& m) {
    norm.weight = m.weight;
    norm.bias = m.bias;
    norm.running_mean = m.running_mean;
    norm.running_var = m.running_var;
    norm.num_batches_tracked = m.num_batches_tracked;
    norm.eps = m.options.eps();
    norm.momentum = m.options.momentum();
  };
  auto check_activation = [&](Activation own, double own_slope) {
    TORCH_CHECK(own == activation && (own != Activation::leaky_relu || own_slope == negative_slope),
                "BatchNormActOf: activation: ", module->name(), " applies ", to_string(own), ", not the ",
                to_string(activation), " given");
  };
  if (const auto* fused = dynamic_cast<const BatchNormAct2dImpl*>(module.get())) {
    check_activation(fused->activation, fused->negative_slope);
    read(*fused);
  } else if (const auto* plain = dynamic_cast<const BatchNorm2dImpl*>(module.get())) {
    check_activation(Activation::identity, 0.0);
    read(*plain);
  } else if (const auto* stock = dynamic_cast<const torch::nn::BatchNorm2dImpl*>(module.get())) {
    read(*stock);
  } else {
    TORCH_CHECK(false, "BatchNormActOf: module: expected hierpar::nn::BatchNormAct2d, hierpar::nn::BatchNorm2d or "
                "torch::nn::BatchNorm2d, got ", module->name());
  }
  return norm;
}

namespace {

// The statistics recompute_sliced's BatchNorm normalises with: the batch's (training; the running statistics
// updated as BatchNorm2d updates them) or the running ones; per channel, in float (double for double inputs).
struct NormStatistics {
  at::Tensor mean, invstd;
  int64_t count = 0;  // values per channel
};

NormStatistics norm_statistics(const at::Tensor& y, const BatchNormActOf& norm, int64_t step) {
  const c10::ScalarType acc = y.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  NormStatistics stats;
  stats.count = y.numel() / y.size(1);
  if (!norm.training && norm.running_mean.defined()) {
    stats.mean = norm.running_mean.to(acc);
    stats.invstd = (norm.running_var.to(acc) + norm.eps).rsqrt();
    return stats;
  }
  TORCH_CHECK(stats.count > 1, "recompute_sliced: BatchNorm in training mode needs more than 1 value per channel, "
              "got input of size ", y.sizes());
  // Each slice's mean and sum of squared deviations, combined in double (Chan et al.'s pairwise update), so the
  // whole batch's variance does not come from a difference of large sums.
  at::Tensor mean, m2;
  int64_t seen = 0;
  for (int64_t start = 0; start < y.size(0); start += step) {
    const int64_t n = std::min(step, y.size(0) - start);
    const at::Tensor ys = y.narrow(0, start, n).to(acc);
    const auto [var_s, mean_s] = at::var_mean(ys, {0, 2, 3}, /*correction=*/0, /*keepdim=*/false);
    const int64_t n_s = ys.numel() / ys.size(1);
    const at::Tensor m = mean_s.to(at::kDouble), sq = var_s.to(at::kDouble) * static_cast<double>(n_s);
    if (!mean.defined()) {
      mean = m;
      m2 = sq;
    } else {
      const double total = static_cast<double>(seen + n_s);
      const at::Tensor delta = m - mean;
      mean = mean + delta * (static_cast<double>(n_s) / total);
      m2 = m2 + sq + delta.square() * (static_cast<double>(seen) * static_cast<double>(n_s) / total);
    }
    seen += n_s;
  }
  const at::Tensor var = m2 / static_cast<double>(stats.count);
  stats.mean = mean.to(acc);
  stats.invstd = (var + norm.eps).rsqrt().to(acc);
  if (norm.running_mean.defined()) {
    double momentum = norm.momentum.value_or(0.0);
    if (norm.num_batches_tracked.defined()) {
      norm.num_batches_tracked.add_(1);
      if (!norm.momentum.has_value()) momentum = 1.0 / norm.num_batches_tracked.item<double>();
    }
    const at::Tensor unbiased = m2 / static_cast<double>(stats.count - 1);
    norm.running_mean.mul_(1 - momentum).add_(mean.to(norm.running_mean.dtype()), momentum);
    norm.running_var.mul_(1 - momentum).add_(unbiased.to(norm.running_var.dtype()), momentum);
  }
  return stats;
}

// y <- activation(BatchNorm(y)) with `stats`, slice by slice (a slice's temporaries in the statistics' dtype).
void normalise_in_place(at::Tensor& y, const BatchNormActOf& norm, const NormStatistics& stats, int64_t step) {
  const c10::ScalarType acc = stats.mean.scalar_type();
  const at::Tensor scale =
      (norm.weight.defined() ? norm.weight.to(acc) * stats.invstd : stats.invstd).view({1, -1, 1, 1});
  const at::Tensor shift = (norm.bias.defined() ? norm.bias.to(acc) - stats.mean * scale.view(-1)
                                                : -stats.mean * scale.view(-1))
                               .view({1, -1, 1, 1});
  for (int64_t start = 0; start < y.size(0); start += step) {
    const int64_t n = std::min(step, y.size(0) - start);
    at::Tensor ys = y.narrow(0, start, n);
    at::Tensor z = ys.to(acc) * scale + shift;
    if (norm.activation == Activation::relu) z.relu_();
    if (norm.activation == Activation::leaky_relu) z = at::leaky_relu_(z, norm.negative_slope);
    ys.copy_(z);
  }
}

}  // namespace

torch::Tensor recompute_sliced(Block per_sample, const std::optional<BatchNormActOf>& norm, const torch::Tensor& input,
                               const std::vector<std::shared_ptr<torch::nn::Module>>& modules, int64_t slices,
                               OffloadChain* offload) {
  TORCH_CHECK(slices >= 1, "recompute_sliced: slices: expected at least 1, got ", slices);
  TORCH_CHECK(input.dim() >= 1 && input.size(0) >= 1, "recompute_sliced: input: expected a batch of at least one "
              "sample, got size ", input.sizes());
  TORCH_CHECK(!norm || input.dim() == 4, "recompute_sliced: input: expected [N, C, H, W] before a BatchNorm, got ",
              input.sizes());
  std::vector<at::Tensor> parameters;
  for (const auto& module : modules) {
    TORCH_CHECK(module != nullptr, "recompute_sliced: modules must not be null");
    for (const at::Tensor& p : module->parameters()) parameters.push_back(p);
  }
  const size_t per_sample_parameters = parameters.size();
  size_t weight_slot = 0, bias_slot = 0;
  if (norm && norm->weight.defined()) {
    parameters.push_back(norm->weight);
    weight_slot = parameters.size();
  }
  if (norm && norm->bias.defined()) {
    parameters.push_back(norm->bias);
    bias_slot = parameters.size();
  }
  const int64_t step = (input.size(0) + slices - 1) / slices;
  const bool track = torch::autograd::GradMode::is_enabled() &&
                     torch::autograd::compute_requires_grad(input, at::TensorList(parameters));
  TORCH_CHECK(!norm || batch_norm_sync() == nullptr, "recompute_sliced: synchronized BatchNorm (a BatchNormSync "
              "installed) is not supported: the block's statistics are those of this replica's batch");
  const Offloading offloading = start_offload(input, track ? offload : nullptr);
  at::Tensor out;
  NormStatistics stats;
  {
    torch::NoGradGuard no_grad;
    out = per_sample(input);
    if (norm) {
      if (out.is_view()) out = out.clone();  // normalised in place below
      stats = norm_statistics(out, *norm, step);
      normalise_in_place(out, *norm, stats, step);
    }
  }
  if (!track) return out;
  if (out.is_view()) out = out.clone();
  const std::shared_ptr<RecomputeBackward> node =
      new_node(input, std::move(parameters), std::move(per_sample), offloading);
  node->slices = slices;
  node->norm = norm;
  node->mean = stats.mean;
  node->invstd = stats.invstd;
  node->count = stats.count;
  node->per_sample_parameters = per_sample_parameters;
  node->weight_slot = weight_slot;
  node->bias_slot = bias_slot;
  torch::autograd::set_history(out, node);
  return out;
}

}  // namespace hierpar::nn
