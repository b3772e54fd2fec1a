// Adam over a fixed list of parameters whose step is two multi-tensor kernel launches per (device, dtype)
// group: one adds 1 to every parameter's step counter, one (hierpar::fused_adam_: on CUDA hierpar's kernel,
// on the CPU ATen's fused Adam) updates every parameter and both moments. Nothing in step() or zero_grad()
// reads a value on the host or allocates,
// so both can be captured into a CUDA graph: the step counters are device tensors (float32, as ATen's
// fused kernels expect) and the moments are allocated in the constructor, not on the first step (a
// first step inside a capture would otherwise record their zero fill into the graph).
//
// It is a torch::optim::Adam: the update is Adam's (L2 weight decay added to the gradient, optional
// AMSGrad), so the two agree to rounding, and save()/load() write and read Adam's archive format, so a
// checkpoint interchanges with torch::optim::Adam (saving reads the step counters on the host: a sync).
// Options are read from the single parameter group when step() is called. The learning rate reaches the kernels
// through a device tensor per group (hierpar::fused_adam_'s tensor_lr overload), so a captured step follows a
// schedule: set the group's lr as for torch::optim::Adam, and before replaying call sync_learning_rate(), which
// copies it to the device when it changed (an eager step() does that itself). Betas, eps and weight decay are
// captured as numbers.
//
// Usage:
//   hierpar::strategy::FusedAdam opt(model->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
//   opt.zero_grad();  loss.backward();  opt.step();
#pragma once

#include <torch/optim/adam.h>

#include <vector>

namespace hierpar::strategy {

// The kernel that updates the parameters: hierpar's (hierpar::fused_adam_), or ATen's at::_fused_adam_, the
// one torch.optim.Adam(fused=True) runs (the benchmarks' stock rows use it, so that stock keeps its own
// optimiser).
enum class AdamKernel { hierpar, aten };

class FusedAdam : public torch::optim::Adam {
 public:
  // Every parameter must be a dense floating-point leaf; parameters may live on several devices and
  // dtypes (each (device, dtype) group is updated by its own launches).
  explicit FusedAdam(std::vector<torch::Tensor> parameters,
                     torch::optim::AdamOptions options = torch::optim::AdamOptions(),
                     AdamKernel kernel = AdamKernel::hierpar);

  // Updates every parameter that has a gradient (a parameter without one is skipped and its step counter
  // stays, as in torch::optim::Adam). A gradient must have its parameter's strides (except in dimensions
  // of size 1), which autograd guarantees for the gradients it creates. A closure is refused (it would run a forward on the host).
  torch::Tensor step(LossClosure closure = nullptr) override;

  // Writes the parameter group's lr into the device tensors the update reads, when it differs from the value
  // they hold (one fill per device and dtype group, queued on the current stream; nothing when unchanged). Call it
  // before a replay of a captured step(); refused while the current stream is being captured with a changed lr
  // (the capture would record the fill and replay the old value over later changes).
  void sync_learning_rate();

  // set_to_none (the default) launches nothing: the next backward creates the gradients, so no zero fill
  // and no accumulation add runs. set_to_none=false zeroes the existing gradients with one multi-tensor
  // kernel per group (their storage stays put, for code that holds on to it, e.g. a captured graph).
  void zero_grad(bool set_to_none = true);

  // torch::optim::Adam's archive: per-parameter step, exp_avg, exp_avg_sq (and max_exp_avg_sq).
  void save(torch::serialize::OutputArchive& archive) const override;
  // Reads that archive (from either class) into this optimiser's device state, in place.
  void load(torch::serialize::InputArchive& archive) override;

  const std::vector<torch::Tensor>& parameters() const { return parameters_; }
  const torch::optim::AdamOptions& options() const;
  torch::optim::AdamOptions& options();

  // State of parameter i (in the constructor's order): its step counter (a 0-dim float32 tensor on its
  // device), first and second moments, and the running maximum of the second moment (AMSGrad only).
  const torch::Tensor& step_count(size_t i) const { return steps_.at(i); }
  const torch::Tensor& exp_avg(size_t i) const { return exp_avgs_.at(i); }
  const torch::Tensor& exp_avg_sq(size_t i) const { return exp_avg_sqs_.at(i); }
  const torch::Tensor& max_exp_avg_sq(size_t i) const { return max_exp_avg_sqs_.at(i); }

 private:
  AdamKernel kernel_;
  std::vector<torch::Tensor> parameters_;
  std::vector<torch::Tensor> steps_, exp_avgs_, exp_avg_sqs_, max_exp_avg_sqs_;
  std::vector<std::vector<size_t>> groups_;  // parameter indices sharing a device and dtype
  std::vector<torch::Tensor> group_lrs_;     // per group: the learning rate the kernels read (0-dim, on its device)
  double synced_lr_;                         // the value group_lrs_ hold
};

}  // namespace hierpar::strategy
