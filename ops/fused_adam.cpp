// Schemas of hierpar::fused_adam_ (Adam's update of many tensors in one launch; the learning rate a number or,
// overload tensor_lr, a device tensor) and their C++ entry points.
#include "hierpar/ops.h"
#include "typed_op.h"

#include <torch/library.h>

namespace hierpar::ops {

void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr, double beta1, double beta2,
                 double weight_decay, double eps, bool amsgrad) {
  using Signature = void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                         at::TensorList, double, double, double, double, double, bool);
  static const auto op = detail::typed_op<Signature>("hierpar::fused_adam_");
  op.call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps, amsgrad);
}

void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList max_exp_avg_sqs, at::TensorList steps, const at::Tensor& lr, double beta1,
                 double beta2, double weight_decay, double eps, bool amsgrad) {
  using Signature = void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                         at::TensorList, const at::Tensor&, double, double, double, double, bool);
  static const auto op = detail::typed_op<Signature>("hierpar::fused_adam_", "tensor_lr");
  op.call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps, amsgrad);
}

}  // namespace hierpar::ops

TORCH_LIBRARY_FRAGMENT(hierpar, m) {
  m.def(
      "fused_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor[] steps, *, float lr, float beta1, float beta2, float weight_decay, "
      "float eps, bool amsgrad) -> ()");
  m.def(
      "fused_adam_.tensor_lr(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor[] steps, *, Tensor lr, float beta1, float beta2, float weight_decay, "
      "float eps, bool amsgrad) -> ()");
}
