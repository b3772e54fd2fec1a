// Meta kernel of hierpar::fused_adam_: the argument checks; an in-place update has no output to shape.
#include "fused_adam_shape.h"

#include <torch/library.h>

namespace hierpar::detail {
namespace {

void fused_adam_meta(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                     at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr, double beta1, double beta2,
                     double weight_decay, double eps, bool amsgrad) {
  check_fused_adam_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay,
                        eps, amsgrad);
}

void fused_adam_tensor_lr_meta(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                               at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                               const at::Tensor& lr, double beta1, double beta2, double weight_decay, double eps,
                               bool amsgrad) {
  check_fused_adam_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay,
                        eps, amsgrad);
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, Meta, m) {
  m.impl("fused_adam_", &hierpar::detail::fused_adam_meta);
  m.impl("fused_adam_.tensor_lr", &hierpar::detail::fused_adam_tensor_lr_meta);
}
