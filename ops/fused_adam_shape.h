// Argument checks of hierpar::fused_adam_ and the kernels' common entry, shared by its CPU, CUDA and Meta kernels.
// Private to hierpar_ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/library.h>

namespace hierpar::detail {

// Every list as long as params (max_exp_avg_sqs: empty, or as long when amsgrad); every params[i] a dense,
// non-overlapping floating-point tensor on params[0]'s device with params[0]'s dtype; grads[i], exp_avgs[i],
// exp_avg_sqs[i] (and max_exp_avg_sqs[i]) of its dtype, device and sizes, holding their elements in its
// memory order (so one flat walk over the storage updates all of them); steps[i] a one-element float32 tensor
// on that device; lr, eps and weight_decay non-negative, betas in [0, 1).
void check_fused_adam_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                           double lr, double beta1, double beta2, double weight_decay, double eps, bool amsgrad);

// The tensor_lr overload's arguments: the same, with lr a one-element tensor on params[0]'s device, float32
// (float64 when the params are float64), which the kernels read where the other overload takes the number.
void check_fused_adam_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                           const at::Tensor& lr, double beta1, double beta2, double weight_decay, double eps,
                           bool amsgrad);

// A backend's kernel of either overload (Lr: double, or const at::Tensor& for tensor_lr): the checks above, then
// Update::run(the same arguments), the backend's update.
template <typename Update, typename Lr>
void fused_adam_entry(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                      at::TensorList max_exp_avg_sqs, at::TensorList steps, Lr lr, double beta1, double beta2,
                      double weight_decay, double eps, bool amsgrad) {
  check_fused_adam_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay,
                        eps, amsgrad);
  Update::run(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps,
              amsgrad);
}

// Registers both overloads' kernels of the backend whose update is `Update`.
template <typename Update>
void register_fused_adam(torch::Library& m) {
  m.impl("fused_adam_", &fused_adam_entry<Update, double>);
  m.impl("fused_adam_.tensor_lr", &fused_adam_entry<Update, const at::Tensor&>);
}

}  // namespace hierpar::detail
