// The ops' backward nodes are written as ATen's generated ones are: a torch::autograd::Node whose backward
// arguments are plain members and whose tensors are SavedVariables. A torch::autograd::Function stores its
// arguments in a per-call map of IValues (ctx->saved_data) and wraps its outputs generically, which cost a few
// microseconds of host time per call (docs/overhead.md): at the seed's batch an eager step waits on the host.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <array>
#include <memory>
#include <tuple>

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

}  // namespace hierpar::detail
