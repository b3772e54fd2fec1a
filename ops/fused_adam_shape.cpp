#include "fused_adam_shape.h"

#include <c10/util/Exception.h>

namespace hierpar::detail {
namespace {

// Equal strides except in dimensions of size 1, whose stride is arbitrary (a [C, 1, 4, 4] channels_last weight
// and its contiguous gradient are laid out alike).
bool same_element_order(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

void check_like_param(const char* list, size_t i, const at::Tensor& t, const at::Tensor& param) {
  TORCH_CHECK(t.defined() && t.layout() == at::kStrided && t.scalar_type() == param.scalar_type() &&
                  t.device() == param.device() && same_element_order(t, param),
              "hierpar::fused_adam_: ", list, "[", i, "]: expected a dense ", param.scalar_type(), " tensor on ",
              param.device(), " with sizes ", param.sizes(), " and strides ", param.strides(), " (those of params[",
              i, "]), got ",
              t.defined() ? c10::str(t.scalar_type(), " on ", t.device(), " with sizes ", t.sizes(), " and strides ",
                                     t.strides())
                          : std::string("an undefined tensor"));
}

}  // namespace

void check_fused_adam_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                           double lr, double beta1, double beta2, double weight_decay, double eps, bool amsgrad) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
              "hierpar::fused_adam_: grads, exp_avgs, exp_avg_sqs and steps: expected ", n,
              " tensors each (one per parameter), got ", grads.size(), ", ", exp_avgs.size(), ", ",
              exp_avg_sqs.size(), " and ", steps.size());
  TORCH_CHECK(max_exp_avg_sqs.size() == (amsgrad ? n : 0), "hierpar::fused_adam_: max_exp_avg_sqs: expected ",
              amsgrad ? n : 0, " tensors (amsgrad=", amsgrad, "), got ", max_exp_avg_sqs.size());
  TORCH_CHECK(lr >= 0, "hierpar::fused_adam_: lr: expected a non-negative learning rate, got ", lr);
  TORCH_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1,
              "hierpar::fused_adam_: betas: expected both in [0, 1), got (", beta1, ", ", beta2, ")");
  TORCH_CHECK(eps >= 0, "hierpar::fused_adam_: eps: expected a non-negative value, got ", eps);
  TORCH_CHECK(weight_decay >= 0, "hierpar::fused_adam_: weight_decay: expected a non-negative value, got ",
              weight_decay);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.defined() && p.layout() == at::kStrided && at::isFloatingType(p.scalar_type()) &&
                    p.is_non_overlapping_and_dense(),
                "hierpar::fused_adam_: params[", i, "]: expected a dense, non-overlapping floating-point tensor, got ",
                p.defined() ? p.toString() + " with strides " + c10::str(p.strides()) : std::string("an undefined tensor"));
    TORCH_CHECK(p.device() == params[0].device() && p.scalar_type() == params[0].scalar_type(),
                "hierpar::fused_adam_: params[", i, "]: expected params[0]'s device and dtype (", params[0].device(),
                ", ", params[0].scalar_type(), "), got ", p.device(), ", ", p.scalar_type(),
                " (one call per device and dtype)");
    check_like_param("grads", i, grads[i], p);
    check_like_param("exp_avgs", i, exp_avgs[i], p);
    check_like_param("exp_avg_sqs", i, exp_avg_sqs[i], p);
    if (amsgrad) check_like_param("max_exp_avg_sqs", i, max_exp_avg_sqs[i], p);
    const at::Tensor& s = steps[i];
    TORCH_CHECK(s.defined() && s.numel() == 1 && s.scalar_type() == at::kFloat && s.device() == p.device(),
                "hierpar::fused_adam_: steps[", i, "]: expected a one-element float32 tensor on ", p.device(),
                ", got ", s.defined() ? s.toString() + " with " + std::to_string(s.numel()) + " elements"
                                      : std::string("an undefined tensor"));
  }
}

void check_fused_adam_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                           const at::Tensor& lr, double beta1, double beta2, double weight_decay, double eps,
                           bool amsgrad) {
  check_fused_adam_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, /*lr=*/0.0, beta1, beta2,
                        weight_decay, eps, amsgrad);
  if (params.empty()) return;
  const auto dtype = params[0].scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(lr.defined() && lr.numel() == 1 && lr.scalar_type() == dtype && lr.device() == params[0].device(),
              "hierpar::fused_adam_: lr: expected a one-element ", dtype, " tensor on ", params[0].device(),
              " (the learning rate for ", params[0].scalar_type(), " params), got ",
              lr.defined() ? c10::str(lr.scalar_type(), " on ", lr.device(), " with ", lr.numel(), " elements")
                           : std::string("an undefined tensor"));
}

}  // namespace hierpar::detail
