// CPU kernel of hierpar::fused_adam_: ATen's fused CPU Adam (vectorised, parallel over the tensors), which
// computes the same update; the CUDA kernel is hierpar's own (ops/cuda/fused_adam_kernel.cu says why).
#include "fused_adam_shape.h"

#include <ATen/ops/_fused_adam.h>
#include <torch/library.h>

namespace hierpar::detail {
namespace {

// ATen's fused CPU Adam, which takes lr as a number or a tensor as the two overloads do.
struct CpuUpdate {
  template <typename Lr>
  static void run(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList max_exp_avg_sqs, at::TensorList steps, Lr lr, double beta1, double beta2,
                  double weight_decay, double eps, bool amsgrad) {
    if (params.empty()) return;
    at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay,
                     eps, amsgrad, /*maximize=*/false);
  }
};

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, CPU, m) {
  hierpar::detail::register_fused_adam<hierpar::detail::CpuUpdate>(m);
}
