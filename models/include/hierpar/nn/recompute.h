// Activation recomputation (seed 001's "recompute"; the idea of torch.utils.checkpoint): a block of layers runs its
// forward without autograd, so none of the tensors its backward needs are kept between the forward and the
// backward; the backward runs the block's forward again, with autograd on, and backpropagates through that. The
// activations kept for the block are its input alone, at the cost of one more forward of the block.
//
// Exact: the recomputation runs the same kernels on the same input, under the autocast state of the original
// forward, and it updates copies of the buffers the block's forward updates (BatchNorm's running statistics and batch
// count), so the module's own advance once per forward as without recomputation. The block must be a deterministic
// function of its input and parameters (no dropout). Parameters' gradients come out of the node as those of any
// layer would (their post-accumulate hooks, e.g. bucketed averaging, fire as usual); second derivatives work where
// the block's layers have them (create_graph). Offloading (seed 001's swapping, TFLMS) moves the kept input to host
// memory between the forward and the backward.
#pragma once

#include "hierpar/nn/batch_norm.h"

#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace hierpar::nn {

using Block = std::function<torch::Tensor(const torch::Tensor&)>;

// What a network's blocks keep for their backward (`--memory`): none saves nothing (every activation kept);
// recompute keeps each block's input on its device; offload keeps not even that: the input goes to pinned host
// memory as the forward produces it and comes back before the block's backward.
enum class ActivationMemory { none, recompute, offload };
const char* to_string(ActivationMemory memory);
// "none", "recompute" or "offload"; throws c10::Error naming `--memory` otherwise.
ActivationMemory parse_activation_memory(const std::string& name);

namespace detail {
struct OffloadedInput;
}

// Offloading only as much as memory requires (`--memory offload`): a plan per GPU, made from a measured step.
// Steps are marked by begin_offload_step(device) (AdversarialTrainer calls it on each device of a replica before its
// step). Until a plan exists every block offloads: the first marked step also measures the device's peak memory and
// each block's activations. The next step begins by choosing the blocks that keep their activations (run as without
// recomputation: no copy, no second forward) so that the measured peak plus the kept blocks' activations stays under
// the chain's `budget` of the device's memory; the blocks that save the most copying per byte kept come first, and a
// batch that fits keeps every block. The plan holds until a block's input changes shape (another batch), which
// measures again. Without marked steps (a model called directly) every block offloads. A no-op on devices where no
// block has offloaded; the device's peak-memory statistics restart at a measured step's start.
void begin_offload_step(const c10::Device& device);
// What `device`'s plan chose, in one line (empty before a plan exists, and on the CPU): how many blocks keep their
// activations, and the measured peak and budget it was chosen from. For a run's log.
std::string offload_plan_summary(const c10::Device& device);

// One block of a measured step: the bytes of its input (what offloading copies out and back) and of the
// activations it keeps when it does not offload (its input and output, counted high).
struct OffloadCandidate {
  int64_t input_bytes = 0;
  int64_t kept_bytes = 0;
};
// The plan's choice: which of `blocks` keep their activations, given the step's `measured_peak` with every block
// offloaded and a `budget_bytes` the peak may reach; most input bytes per kept byte first.
std::vector<bool> plan_kept_blocks(const std::vector<OffloadCandidate>& blocks, int64_t measured_peak,
                                   int64_t budget_bytes);

// The offloaded blocks of one network, in the order its forward ran them: each block's backward starts copying
// back the input of the block before it (the next backward to run), so the copy overlaps this block's
// recomputation. One per network instance (a replica's clone has its own); used by recompute(..., offload).
class OffloadChain {
 public:
  OffloadChain();

  // Appends a block's input (called by recompute()) and returns the block offloaded before it.
  std::weak_ptr<detail::OffloadedInput> append(const std::shared_ptr<detail::OffloadedInput>& input);

  // Whether block `block` of this network (its index in the forward), given `input`, keeps its activations under the
  // device's plan (begin_offload_step). Always false on the CPU, where offloading keeps the input where it is.
  bool keeps_activations(int64_t block, const torch::Tensor& input) const;
  // After block `block` ran offloaded: its input and output, for the measured step's plan.
  void observe(int64_t block, const torch::Tensor& input, const torch::Tensor& output) const;
  // The fraction of the device's memory a planned step may use; 0 offloads every block.
  double budget = 0.9;

 private:
  const uint64_t id_;  // this chain's blocks in the device's plan
  std::mutex mutex_;
  std::weak_ptr<detail::OffloadedInput> last_;
};

// `block(input)` without keeping its activations; `modules` are the layers the block runs (their parameters get
// gradients, their buffers are restored after the recomputation). Without grad mode, or when neither `input` nor a
// parameter requires grad, it is block(input).
// With `offload`, a CUDA input is copied to pinned host memory on a side stream (the device copy is freed once the
// caller drops it) and copied back in the backward, prefetched during the backward of the block after it; a CPU
// input stays where it is. The call first waits, on the host, until the chain's previous input is in host memory,
// so that a pass holds at most two offloaded inputs on the device. Offloaded blocks have no second derivatives
// (create_graph needs the input's history on the device): their backward says so. Not for CUDA graph capture
// (pinned host buffers come from the host allocator at every step).
torch::Tensor recompute(Block block, const torch::Tensor& input,
                        const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                        OffloadChain* offload = nullptr);

// The BatchNorm (training mode) + activation that follows a block's convolution, for recompute_sliced(): the
// module's parameters and buffers and its settings, read from hierpar::nn::BatchNormAct2d / BatchNorm2d or
// torch::nn::BatchNorm2d. `activation` is the one applied after it: hierpar's modules fuse theirs, which must be it.
struct BatchNormActOf {
  torch::Tensor weight, bias;                                    // undefined without affine
  torch::Tensor running_mean, running_var, num_batches_tracked;  // undefined without running statistics
  double eps = 1e-5;
  std::optional<double> momentum = 0.1;  // none: a cumulative average
  Activation activation = Activation::identity;
  double negative_slope = 0.0;
  bool training = true;  // batch statistics; false: the running ones (the module in eval mode)

  // Throws c10::Error naming the module when it is none of the three.
  static BatchNormActOf of(const std::shared_ptr<torch::nn::Module>& module, Activation activation,
                           double negative_slope);
};

// recompute() of `per_sample` (a convolution, its fused activation, tanh: every sample computed from its own input)
// followed by `norm`'s BatchNorm + activation, with the backward in `slices` slices of the batch, one at a time: its
// recomputation and backpropagation hold one slice's inner activations, not the whole batch's (what a block needs
// on top of its input, the gradient it receives and the one it returns). BatchNorm stays exact, with the whole
// batch's statistics: the forward keeps its per-channel mean and 1/std, and the backward makes two passes over the
// slices, the first summing the per-channel terms of BatchNorm's gradient (as synchronized BatchNorm sums them
// over replicas), the second recomputing each slice's convolution and backpropagating its share. That is one more
// forward of the convolution than recompute(); the forward normalises the convolution's output in place. The
// numbers equal recompute()'s up to the order of the sums (statistics, weight gradients). `modules` are the layers
// that `per_sample` runs (the norm's module is not among them). No second derivatives (create_graph: use
// slices 1). slices 1 is recompute(per_sample then norm), exactly.
torch::Tensor recompute_sliced(Block per_sample, const std::optional<BatchNormActOf>& norm, const torch::Tensor& input,
                               const std::vector<std::shared_ptr<torch::nn::Module>>& modules, int64_t slices,
                               OffloadChain* offload = nullptr);

}  // namespace hierpar::nn
