#include "hierpar/nn/recompute.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/autograd.h>

namespace hierpar::nn {
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
    const at::Tensor saved_input = input.unpack();
    at::Tensor x = create_graph ? saved_input : saved_input.detach();
    if (!create_graph && should_compute_output(0)) x.requires_grad_(true);
    std::vector<at::Tensor> kept;
    {
      torch::NoGradGuard no_grad;
      for (const at::Tensor& b : buffers) kept.push_back(b.clone());
    }
    at::Tensor out;
    {
      torch::AutoGradMode grad_mode(true);
      AutocastAs autocast(autocast_state);
      out = block(x);
    }
    {
      // variable_data(): the values go back without a new version, which stock BatchNorm's recomputed backward
      // (it saves the running statistics) would take for an in-place change of what it saved.
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < buffers.size(); ++i) buffers[i].variable_data().copy_(kept[i]);
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
    block = nullptr;
  }

  SavedVariable input;
  Block block;
  std::vector<at::Tensor> parameters, buffers;
  AutocastState autocast_state;
};

}  // namespace

torch::Tensor recompute(Block block, const torch::Tensor& input,
                        const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
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
  at::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = block(input);
  }
  if (out.is_view()) out = out.clone();  // history goes on a tensor of its own, not on a view made without grad
  std::shared_ptr<RecomputeBackward> node(new RecomputeBackward(), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(input, at::TensorList(parameters)));
  node->input = SavedVariable(input, /*is_output=*/false);
  node->block = std::move(block);
  node->parameters = std::move(parameters);
  node->buffers = std::move(buffers);
  node->autocast_state = AutocastState::of(input.device().type());
  torch::autograd::set_history(out, node);
  return out;
}

}  // namespace hierpar::nn
