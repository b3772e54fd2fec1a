#include "hierpar/strategy/sync_batch_norm.h"

#include <torch/autograd.h>

namespace hierpar::strategy {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Per-channel tensors [C] as [1, C, 1, 1] to broadcast over [N, C, H, W].
torch::Tensor per_channel(const torch::Tensor& t) { return t.view({1, -1, 1, 1}); }

// Statistics in fp32 at least (under autocast the input may be bf16/fp16).
torch::Tensor statistics_dtype(const torch::Tensor& t) {
  return at::isReducedFloatingType(t.scalar_type()) ? t.to(torch::kFloat) : t;
}

class SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, const torch::Tensor& weight,
                               const torch::Tensor& bias, ReplicaBatchNormSync* sync, const torch::Tensor& running_mean,
                               const torch::Tensor& running_var, double momentum, double eps) {
    const int64_t channels = input.size(1);
    const torch::Tensor x = statistics_dtype(input);
    const int64_t local_count = input.numel() / channels;
    auto [var, mean] = torch::var_mean(x, {0, 2, 3}, /*correction=*/0, /*keepdim=*/false);
    torch::Tensor stats = torch::cat({mean * local_count, var * local_count, mean * mean * local_count,
                                      torch::full({1}, static_cast<double>(local_count), mean.options())});
    sync->sum(stats);
    const torch::Tensor count = stats.narrow(0, 3 * channels, 1);
    const torch::Tensor global_mean = stats.narrow(0, 0, channels) / count;
    const torch::Tensor global_var =
        ((stats.narrow(0, channels, channels) + stats.narrow(0, 2 * channels, channels)) / count -
         global_mean * global_mean).clamp_min(0);
    const torch::Tensor invstd = torch::rsqrt(global_var + eps);
    if (running_mean.defined()) {
      torch::NoGradGuard no_grad;
      running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.scalar_type()), momentum);
      running_var.mul_(1 - momentum)
          .add_((global_var * count / (count - 1)).to(running_var.scalar_type()), momentum);
    }
    const torch::Tensor scale = weight.defined() ? weight.to(invstd.scalar_type()) * invstd : invstd;
    torch::Tensor shift = -global_mean * scale;
    if (bias.defined()) shift = shift + bias.to(shift.scalar_type());
    ctx->save_for_backward({input, weight, global_mean, invstd, count});
    ctx->saved_data["sync"] = reinterpret_cast<int64_t>(sync);
    ctx->saved_data["bias"] = bias.defined();
    return (x * per_channel(scale) + per_channel(shift)).to(input.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &input = saved[0], &weight = saved[1], &mean = saved[2], &invstd = saved[3], &count = saved[4];
    auto* sync = reinterpret_cast<ReplicaBatchNormSync*>(ctx->saved_data["sync"].toInt());
    const int64_t channels = input.size(1);
    const torch::Tensor dy = statistics_dtype(grad_outputs[0]);
    const torch::Tensor xmu = statistics_dtype(input) - per_channel(mean);
    const torch::Tensor sum_dy = dy.sum({0, 2, 3});
    const torch::Tensor sum_dy_xmu = (dy * xmu).sum({0, 2, 3});
    // Local parameter gradients (the gradient averaging sums them over the replicas and divides by R).
    const torch::Tensor grad_weight = weight.defined() ? sum_dy_xmu * invstd : torch::Tensor();
    const torch::Tensor grad_bias = ctx->saved_data["bias"].toBool() ? sum_dy : torch::Tensor();
    // Every replica runs this node (same graph), so every replica joins this all-reduce.
    torch::Tensor sums = torch::cat({sum_dy, sum_dy_xmu});
    sync->sum(sums);
    const torch::Tensor mean_dy = sums.narrow(0, 0, channels) / count;
    const torch::Tensor mean_dy_xmu = sums.narrow(0, channels, channels) / count;
    const torch::Tensor scale = weight.defined() ? weight.to(invstd.scalar_type()) * invstd : invstd;
    const torch::Tensor grad_input =
        ((dy - per_channel(mean_dy) - xmu * per_channel(invstd * invstd * mean_dy_xmu)) * per_channel(scale))
            .to(input.scalar_type());
    return {grad_input, grad_weight, grad_bias, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

torch::Tensor ReplicaBatchNormSync::forward(const torch::Tensor& input, const torch::Tensor& weight,
                                            const torch::Tensor& bias, const torch::Tensor& running_mean,
                                            const torch::Tensor& running_var, double momentum, double eps) {
  TORCH_CHECK(input.dim() == 4, "synchronized BatchNorm: input: expected a 4-d tensor (N, C, H, W), got ",
              input.dim(), "-d ", input.sizes());
  TORCH_CHECK(running_mean.defined() == running_var.defined(),
              "synchronized BatchNorm: running_mean and running_var must both be defined or both undefined");
  return SyncBatchNormFunction::apply(input, weight, bias, this, running_mean, running_var, momentum, eps);
}

}  // namespace hierpar::strategy
