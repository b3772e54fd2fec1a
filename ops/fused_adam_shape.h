// Argument checks of hierpar::fused_adam_, shared by its CPU, CUDA and Meta kernels. Private to hierpar_ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

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

}  // namespace hierpar::detail
