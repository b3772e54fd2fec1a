// Activation recomputation (seed 001's "recompute"; the idea of torch.utils.checkpoint): a block of layers runs its
// forward without autograd, so none of the tensors its backward needs are kept between the forward and the
// backward; the backward runs the block's forward again, with autograd on, and backpropagates through that. The
// activations kept for the block are its input alone, at the cost of one more forward of the block.
//
// Exact: the recomputation runs the same kernels on the same input, under the autocast state of the original
// forward, and the buffers the block's forward updates (BatchNorm's running statistics and batch count) are
// restored after it, so they advance once per forward as without recomputation. The block must be a deterministic
// function of its input and parameters (no dropout). Parameters' gradients come out of the node as those of any
// layer would (their post-accumulate hooks, e.g. bucketed averaging, fire as usual); second derivatives work where
// the block's layers have them (create_graph).
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <vector>

namespace hierpar::nn {

using Block = std::function<torch::Tensor(const torch::Tensor&)>;

// `block(input)` without keeping its activations; `modules` are the layers the block runs (their parameters get
// gradients, their buffers are restored after the recomputation). Without grad mode, or when neither `input` nor a
// parameter requires grad, it is block(input).
torch::Tensor recompute(Block block, const torch::Tensor& input,
                        const std::vector<std::shared_ptr<torch::nn::Module>>& modules);

}  // namespace hierpar::nn
