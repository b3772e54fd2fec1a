// The ops' backward nodes are written as ATen's generated ones are: a torch::autograd::Node whose backward
// arguments are plain members and whose tensors are SavedVariables. A torch::autograd::Function stores its
// arguments in a per-call map of IValues (ctx->saved_data) and wraps its outputs generically, which cost a few
// microseconds of host time per call (docs/overhead.md): at the seed's batch an eager step waits on the host.
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace hierpar::detail {

// Under create_graph (grad mode on inside a backward) a convolution's gradients through ATen's differentiable
// at::convolution_backward, so that second derivatives work (R1 and WGAN-GP penalties differentiate a
// gradient): hierpar's backward kernels compute first derivatives only. Unbatched (3-d) inputs are batched here.
std::tuple<at::Tensor, at::Tensor, at::Tensor> differentiable_convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, int64_t out_channels,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
    at::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> mask);

// A new node of type NodeT whose next edges are those of `inputs`, in order (an absent optional or an undefined
// tensor gives an empty edge, whose gradient the engine ignores).
template <typename NodeT, typename... Inputs>
std::shared_ptr<NodeT> new_backward_node(const Inputs&... inputs) {
  std::shared_ptr<NodeT> node(new NodeT(), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  return node;
}

// A convolution's backward node (edges: input, weight, bias). It keeps the input and the weight, released once the
// backward has run, and the convolution's arguments; apply computes the gradients the edges ask for from the
// incoming one: hierpar's backward op, or under create_graph ATen's differentiable one (second derivatives).
struct ConvBackwardNodeBase : torch::autograd::Node {
  using Gradients = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) final {
    if (!grads[0].defined()) return torch::autograd::variable_list(3);
    const std::array<bool, 3> mask{should_compute_output(0), should_compute_output(1), should_compute_output(2)};
    // A backward run inside an autocast region (it is thread-local, and autograd carries it to its threads) would
    // otherwise recast the GEMMs inside hierpar's kernels (their float accumulation of bf16 operands) and break them.
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor grad = from_output(grads[0]);
    auto [grad_input, grad_weight, grad_bias] = torch::autograd::GradMode::is_enabled()
                                                    ? differentiable_gradients(grad, mask)
                                                    : first_gradients(grad, mask);
    return {grad_input, grad_weight, grad_bias};
  }
  // The gradient of the convolution's result, from that of the op's output (an activation's backward).
  virtual at::Tensor from_output(const at::Tensor& grad_output) { return grad_output; }
  virtual Gradients first_gradients(const at::Tensor& grad, std::array<bool, 3> mask) = 0;
  virtual Gradients differentiable_gradients(const at::Tensor& grad, std::array<bool, 3> mask) = 0;

  void save(const at::Tensor& input_, const at::Tensor& weight_, at::IntArrayRef stride_, at::IntArrayRef padding_,
            at::IntArrayRef dilation_, int64_t groups_) {
    input = torch::autograd::SavedVariable(input_, /*is_output=*/false);
    weight = torch::autograd::SavedVariable(weight_, /*is_output=*/false);
    stride = stride_.vec();
    padding = padding_.vec();
    dilation = dilation_.vec();
    groups = groups_;
  }
  void release_variables() override {
    input.reset_data();
    weight.reset_data();
  }

  torch::autograd::SavedVariable input, weight;
  std::vector<int64_t> stride, padding, dilation;
  int64_t groups = 1;
};

// A convolution's Autograd kernel: `forward` (the op) below autograd, then, where a gradient is needed, its backward
// node NodeT (a ConvBackwardNodeBase) with the convolution's arguments, recorded as the output's history; the node
// (null where none is needed) for the caller to add what else it keeps.
template <typename NodeT, typename Forward>
std::pair<at::Tensor, std::shared_ptr<NodeT>> record_conv(Forward&& forward, const at::Tensor& input,
                                                          const at::Tensor& weight,
                                                          const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                                          at::IntArrayRef padding, at::IntArrayRef dilation,
                                                          int64_t groups) {
  at::Tensor output;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    output = forward();
  }
  if (!torch::autograd::compute_requires_grad(input, weight, bias)) return {output, nullptr};
  auto node = new_backward_node<NodeT>(input, weight, bias);
  node->save(input, weight, stride, padding, dilation, groups);
  torch::autograd::set_history(output, node);
  return {output, node};
}

// The Autograd kernel of a convolution's backward op, hierpar::<op>_backward, called directly: its kernels compute
// first derivatives only, so it refuses to record a graph (grad mode on and an operand requiring grad).
void check_conv_backward_not_recorded(const char* op, const at::Tensor& grad_output, const at::Tensor& input,
                                      const at::Tensor& weight);

}  // namespace hierpar::detail
