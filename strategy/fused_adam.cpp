#include "hierpar/strategy/fused_adam.h"

#include "hierpar/ops.h"

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_foreach_zero.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/ops/full.h>
#include <c10/core/GradMode.h>

#ifdef HIERPAR_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <utility>

namespace hierpar::strategy {
namespace {

// Checked before torch::optim::Adam's constructor sees them, so that the messages name the argument.
std::vector<torch::Tensor> checked(std::vector<torch::Tensor> parameters, const torch::optim::AdamOptions& options) {
  TORCH_CHECK(!parameters.empty(), "FusedAdam: parameters: expected at least one tensor, got an empty list");
  const auto [beta1, beta2] = options.betas();
  TORCH_CHECK(options.lr() >= 0, "FusedAdam: lr: expected a non-negative learning rate, got ", options.lr());
  TORCH_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1,
              "FusedAdam: betas: expected both in [0, 1), got (", beta1, ", ", beta2, ")");
  TORCH_CHECK(options.eps() >= 0, "FusedAdam: eps: expected a non-negative value, got ", options.eps());
  TORCH_CHECK(options.weight_decay() >= 0, "FusedAdam: weight_decay: expected a non-negative value, got ",
              options.weight_decay());
  for (size_t i = 0; i < parameters.size(); ++i) {
    const auto& p = parameters[i];
    TORCH_CHECK(p.defined() && p.is_leaf() && p.layout() == at::kStrided && at::isFloatingType(p.scalar_type()) &&
                    p.is_non_overlapping_and_dense(),
                "FusedAdam: parameters[", i, "]: expected a defined, dense, non-overlapping floating-point leaf "
                "tensor, got ", p.defined() ? p.toString() : std::string("an undefined tensor"));
  }
  return parameters;
}

// Whether `a` and `b` (same sizes) hold their elements in the same memory order: equal strides except in
// dimensions of size 1, whose stride is arbitrary (a [C, 1, 4, 4] channels_last weight and its contiguous
// gradient are laid out alike).
bool same_element_order(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.sizes() != b.sizes()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

// Whether the current stream of `device` is being captured into a CUDA graph.
bool is_capturing(const c10::Device& device) {
#ifdef HIERPAR_WITH_CUDA
  if (device.is_cuda()) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device.index()), &status));
    return status != cudaStreamCaptureStatusNone;
  }
#endif
  return false;
}

}  // namespace

FusedAdam::FusedAdam(std::vector<torch::Tensor> parameters, torch::optim::AdamOptions options, AdamKernel kernel)
    : torch::optim::Adam(checked(parameters, options), options), kernel_(kernel), parameters_(std::move(parameters)) {
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const auto& p = parameters_[i];
    // zeros_like keeps the parameter's strides (channels_last stays channels_last), which the fused kernel
    // requires of every list it walks in step.
    exp_avgs_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
    exp_avg_sqs_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (options.amsgrad()) max_exp_avg_sqs_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
    steps_.push_back(at::zeros({}, p.options().dtype(at::kFloat)));
    bool placed = false;
    for (auto& group : groups_) {
      const auto& first = parameters_[group.front()];
      if (first.device() == p.device() && first.scalar_type() == p.scalar_type()) {
        group.push_back(i);
        placed = true;
        break;
      }
    }
    if (!placed) groups_.push_back({i});
  }
  // hierpar's kernel reads the lr in its opmath type (float64 for float64 parameters, else float32); ATen's fused
  // kernel reads a float32 one.
  synced_lr_ = options.lr();
  for (const auto& group : groups_) {
    const auto& first = parameters_[group.front()];
    const auto dtype = kernel_ == AdamKernel::hierpar && first.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    group_lrs_.push_back(at::full({}, synced_lr_, first.options().dtype(dtype)));
  }
}

void FusedAdam::sync_learning_rate() {
  const double lr = options().lr();
  if (lr == synced_lr_) return;
  TORCH_CHECK(lr >= 0, "FusedAdam: lr: expected a non-negative learning rate, got ", lr);
  for (const auto& group_lr : group_lrs_) {
    TORCH_CHECK(!is_capturing(group_lr.device()), "FusedAdam: the learning rate changed (", synced_lr_, " -> ", lr,
                ") while a CUDA graph is being captured: call sync_learning_rate() before capture_begin, and before "
                "each replay");
  }
  c10::NoGradGuard no_grad;
  for (auto& group_lr : group_lrs_) group_lr.fill_(lr);
  synced_lr_ = lr;
}

const torch::optim::AdamOptions& FusedAdam::options() const {
  return static_cast<const torch::optim::AdamOptions&>(param_groups().front().options());
}

torch::optim::AdamOptions& FusedAdam::options() {
  return static_cast<torch::optim::AdamOptions&>(param_groups().front().options());
}

torch::Tensor FusedAdam::step(LossClosure closure) {
  TORCH_CHECK(!closure, "FusedAdam: step: a loss closure is not supported (compute the loss, backward, then step())");
  sync_learning_rate();
  c10::NoGradGuard no_grad;
  const auto& o = options();
  const auto [beta1, beta2] = o.betas();
  TORCH_CHECK(!o.amsgrad() || max_exp_avg_sqs_.size() == parameters_.size(),
              "FusedAdam: amsgrad was switched on after construction; construct the optimiser with it");
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const auto& group = groups_[g];
    params.clear(), grads.clear(), exp_avgs.clear(), exp_avg_sqs.clear(), max_exp_avg_sqs.clear(), steps.clear();
    for (size_t i : group) {
      const auto& p = parameters_[i];
      const auto& g = p.grad();
      if (!g.defined()) continue;
      TORCH_CHECK(g.layout() == at::kStrided && g.scalar_type() == p.scalar_type() && same_element_order(g, p),
                  "FusedAdam: the gradient of parameters[", i, "]: expected a dense ", p.scalar_type(),
                  " tensor with its parameter's strides ", p.strides(), ", got ", g.scalar_type(), " with strides ",
                  g.strides());
      params.push_back(p);
      grads.push_back(g);
      exp_avgs.push_back(exp_avgs_[i]);
      exp_avg_sqs.push_back(exp_avg_sqs_[i]);
      if (o.amsgrad()) max_exp_avg_sqs.push_back(max_exp_avg_sqs_[i]);
      steps.push_back(steps_[i]);
    }
    if (params.empty()) continue;
    // The fused kernel reads the step counters (for the bias corrections) but leaves incrementing them to
    // its caller, as ATen's fused Adam does.
    at::_foreach_add_(steps, 1);
    if (kernel_ == AdamKernel::hierpar) {
      hierpar::ops::fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, group_lrs_[g], beta1,
                                beta2, o.weight_decay(), o.eps(), o.amsgrad());
    } else {
      at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, group_lrs_[g], beta1, beta2,
                       o.weight_decay(), o.eps(), o.amsgrad(), /*maximize=*/false);
    }
  }
  return {};
}

void FusedAdam::zero_grad(bool set_to_none) {
  if (set_to_none) {
    for (auto& p : parameters_) p.mutable_grad().reset();
    return;
  }
  std::vector<at::Tensor> grads;
  for (const auto& group : groups_) {
    grads.clear();
    for (size_t i : group) {
      auto& g = parameters_[i].mutable_grad();
      if (!g.defined()) continue;
      // A gradient that is part of a graph (create_graph=true) is detached first, as torch::optim does.
      if (g.grad_fn()) g = g.detach();
      grads.push_back(g);
    }
    if (!grads.empty()) at::_foreach_zero_(grads);
  }
}

void FusedAdam::save(torch::serialize::OutputArchive& archive) const {
  // A torch::optim::Adam over the same parameters and options, holding this optimiser's state as Adam
  // keeps it (a parameter never stepped has no state there), writes the archive.
  torch::optim::Adam adam(parameters_, options());
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const auto step = static_cast<int64_t>(steps_[i].item<double>());
    if (step == 0) continue;
    auto state = std::make_unique<torch::optim::AdamParamState>();
    state->step(step);
    state->exp_avg(exp_avgs_[i]);
    state->exp_avg_sq(exp_avg_sqs_[i]);
    if (options().amsgrad()) state->max_exp_avg_sq(max_exp_avg_sqs_[i]);
    adam.state()[parameters_[i].unsafeGetTensorImpl()] = std::move(state);
  }
  adam.save(archive);
}

void FusedAdam::load(torch::serialize::InputArchive& archive) {
  torch::optim::Adam::load(archive);  // options into the parameter group, per-parameter state into state()
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    auto it = state().find(parameters_[i].unsafeGetTensorImpl());
    if (it == state().end()) {
      steps_[i].zero_();
      exp_avgs_[i].zero_();
      exp_avg_sqs_[i].zero_();
      if (!max_exp_avg_sqs_.empty()) max_exp_avg_sqs_[i].zero_();
      continue;
    }
    const auto& s = static_cast<const torch::optim::AdamParamState&>(*it->second);
    steps_[i].fill_(static_cast<double>(s.step()));
    exp_avgs_[i].copy_(s.exp_avg());
    exp_avg_sqs_[i].copy_(s.exp_avg_sq());
    if (!max_exp_avg_sqs_.empty() && s.max_exp_avg_sq().defined()) max_exp_avg_sqs_[i].copy_(s.max_exp_avg_sq());
  }
  // The device tensors above are the state; Adam's copies (on the CPU) would only go stale.
  state().clear();
}

}  // namespace hierpar::strategy
