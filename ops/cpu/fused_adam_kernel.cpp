// CPU kernel of hierpar::fused_adam_: ATen's fused CPU Adam (vectorised, parallel over the tensors), which
// computes the same update; the CUDA kernel is hierpar's own (ops/cuda/fused_adam_kernel.cu says why).
#include "fused_adam_shape.h"

#include <ATen/ops/_fused_adam.h>
#include <torch/library.h>

namespace hierpar::detail {
namespace {

void fused_adam_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr, double beta1, double beta2,
                    double weight_decay, double eps, bool amsgrad) {
  check_fused_adam_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay,
                        eps, amsgrad);
  if (params.empty()) return;
  at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps,
                   amsgrad, /*maximize=*/false);
}

void fused_adam_tensor_lr_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                              at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                              const at::Tensor& lr, double beta1, double beta2, double weight_decay, double eps,
                              bool amsgrad) {
  check_fused_adam_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay,
                        eps, amsgrad);
  if (params.empty()) return;
  at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps,
                   amsgrad, /*maximize=*/false);
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, CPU, m) {
  m.impl("fused_adam_", &hierpar::detail::fused_adam_cpu);
  m.impl("fused_adam_.tensor_lr", &hierpar::detail::fused_adam_tensor_lr_cpu);
}
