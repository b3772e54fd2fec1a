#include "hierpar/strategy/fused_adam.h"

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_zero.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>

#include <utility>

namespace hierpar::strategy {

FusedAdam::FusedAdam(std::vector<torch::Tensor> parameters, torch::optim::AdamOptions options)
    : parameters_(std::move(parameters)), options_(std::move(options)) {
  TORCH_CHECK(!parameters_.empty(), "FusedAdam: parameters: expected at least one tensor, got an empty list");
  const auto [beta1, beta2] = options_.betas();
  TORCH_CHECK(options_.lr() >= 0, "FusedAdam: lr: expected a non-negative learning rate, got ", options_.lr());
  TORCH_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1,
              "FusedAdam: betas: expected both in [0, 1), got (", beta1, ", ", beta2, ")");
  TORCH_CHECK(options_.eps() >= 0, "FusedAdam: eps: expected a non-negative value, got ", options_.eps());
  TORCH_CHECK(options_.weight_decay() >= 0, "FusedAdam: weight_decay: expected a non-negative value, got ",
              options_.weight_decay());
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const auto& p = parameters_[i];
    TORCH_CHECK(p.defined() && p.is_leaf() && p.layout() == at::kStrided && at::isFloatingType(p.scalar_type()) &&
                    p.is_non_overlapping_and_dense(),
                "FusedAdam: parameters[", i, "]: expected a defined, dense, non-overlapping floating-point leaf "
                "tensor, got ", p.defined() ? p.toString() : std::string("an undefined tensor"));
    // zeros_like keeps the parameter's strides (channels_last stays channels_last), which the fused kernel
    // requires of every list it walks in step.
    exp_avgs_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
    exp_avg_sqs_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (options_.amsgrad()) max_exp_avg_sqs_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
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
}

void FusedAdam::step() {
  c10::NoGradGuard no_grad;
  const auto [beta1, beta2] = options_.betas();
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
  for (const auto& group : groups_) {
    params.clear(), grads.clear(), exp_avgs.clear(), exp_avg_sqs.clear(), max_exp_avg_sqs.clear(), steps.clear();
    for (size_t i : group) {
      const auto& p = parameters_[i];
      const auto& g = p.grad();
      if (!g.defined()) continue;
      TORCH_CHECK(g.layout() == at::kStrided && g.scalar_type() == p.scalar_type() && g.strides() == p.strides(),
                  "FusedAdam: the gradient of parameters[", i, "]: expected a dense ", p.scalar_type(),
                  " tensor with its parameter's strides ", p.strides(), ", got ", g.scalar_type(), " with strides ",
                  g.strides());
      params.push_back(p);
      grads.push_back(g);
      exp_avgs.push_back(exp_avgs_[i]);
      exp_avg_sqs.push_back(exp_avg_sqs_[i]);
      if (options_.amsgrad()) max_exp_avg_sqs.push_back(max_exp_avg_sqs_[i]);
      steps.push_back(steps_[i]);
    }
    if (params.empty()) continue;
    // The fused kernel reads the step counters (for the bias corrections) but leaves incrementing them to
    // its caller, as torch.optim.Adam(fused=True) does.
    at::_foreach_add_(steps, 1);
    at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options_.lr(), beta1, beta2,
                     options_.weight_decay(), options_.eps(), options_.amsgrad(), /*maximize=*/false);
  }
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

}  // namespace hierpar::strategy
