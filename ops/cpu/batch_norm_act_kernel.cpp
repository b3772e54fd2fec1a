// CPU kernels of hierpar::batch_norm_act and its backward: float32/float64 on ATen's batch norm (on_aten below);
// the reference, for half types and HIERPAR_CPU_ATEN=0: one at::parallel_for over channels, each channel
// reduced in float64 (two passes: mean, then squared deviations) and then normalised in the input's
// opmath type. NCHW, channels_last and 2-d/3-d inputs go through one indexing scheme: the input is made
// contiguous in its own layout and element (n, c, l) sits at n*sn + c*sc + l*sl.
#include "batch_norm_act_shape.h"
#include "common.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addcmul.h>
#include <ATen/ops/leaky_relu.h>
#include <ATen/ops/leaky_relu_backward.h>
#include <ATen/ops/native_batch_norm.h>
#include <ATen/ops/native_batch_norm_backward.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/threshold_backward.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <limits>
#include <vector>

namespace hierpar::detail::bn {
namespace {

struct Strides {
  int64_t n, c, l;
};

Strides strides_of(const Geometry& g, c10::MemoryFormat layout) {
  if (layout == c10::MemoryFormat::ChannelsLast) return {g.l * g.c, 1, g.c};
  return {g.c * g.l, g.l, 1};
}

// A [C] parameter in `dtype`, or `fill` when absent.
at::Tensor param_or(const std::optional<at::Tensor>& p, int64_t c, double fill, const at::TensorOptions& options) {
  if (present(p)) return p->to(options.dtype()).contiguous();
  return fill == 0 ? at::zeros({c}, options) : at::ones({c}, options);
}

// float32/float64 run on ATen's batch norm (vectorised over each channel, 4-10x faster on the CPU than the
// reference below at the DCGAN's shapes, docs/cpu.md) with the activation applied in place; bfloat16/float16 and
// HIERPAR_CPU_ATEN=0 take the reference.
bool on_aten(const at::Tensor& t) {
  return switch_on(Switch::cpu_aten) && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
}

void activate_(at::Tensor& t, Act act, double slope) {
  if (act == Act::relu) at::relu_(t);
  else if (act == Act::leaky_relu) at::leaky_relu_(t, slope);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_aten(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps, Act act, double slope, const std::optional<at::Tensor>& num_batches_tracked) {
  auto [out, save_mean, save_invstd] =
      at::native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps);
  out = with_layout_strides(out, layout_of(input));
  activate_(out, act, slope);
  if (training && present(num_batches_tracked)) num_batches_tracked->add_(1);
  if (!training) {  // ATen returns no statistics in eval mode; the backward reads the ones used
    const auto stats_type = stats_dtype(input.scalar_type());
    save_mean = running_mean->to(stats_type, /*non_blocking=*/false, /*copy=*/true);
    save_invstd = running_var->to(at::kDouble).add(eps).rsqrt().to(stats_type);
  }
  return {out, save_mean, save_invstd};
}

// Training mode only (eval's backward takes the reference). Without the input, it is rebuilt from the output by
// inverting the activation and the affine map, as the reference does: not possible where a weight is 0.
bool backward_on_aten(const at::Tensor& output, const std::optional<at::Tensor>& input,
                      const std::optional<at::Tensor>& weight, bool training) {
  return training && on_aten(output) &&
         (present(input) || !present(weight) || !weight->eq(0).any().item<bool>());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_aten(
    const at::Tensor& grad_output, const at::Tensor& output, const std::optional<at::Tensor>& input,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, double eps, Act act, double slope, std::array<bool, 3> output_mask) {
  // The gradient before the activation, from the output's sign.
  at::Tensor grad_pre = grad_output;
  if (act == Act::relu) grad_pre = at::threshold_backward(grad_output, output, 0);
  else if (act == Act::leaky_relu) grad_pre = at::leaky_relu_backward(grad_output, output, slope, /*self_is_result=*/true);
  at::Tensor x;
  if (present(input)) {
    x = *input;
  } else {
    // x = (y - bias) / (weight * invstd) + mean, y the pre-activation: leaky_relu with 1 / slope inverts leaky_relu.
    const at::Tensor y = act == Act::leaky_relu ? at::leaky_relu(output, 1.0 / slope) : output;
    std::vector<int64_t> per_channel(output.dim(), 1);
    per_channel[1] = output.size(1);
    const at::Tensor w = present(weight) ? *weight : at::ones_like(save_invstd);
    const at::Tensor scale = w.mul(save_invstd).reciprocal();
    const at::Tensor shift = present(bias) ? save_mean.sub(bias->mul(scale)) : save_mean;
    x = at::addcmul(shift.view(per_channel), y, scale.view(per_channel));
  }
  auto [grad_input, grad_weight, grad_bias] = at::native_batch_norm_backward(
      grad_pre, x, weight, std::nullopt, std::nullopt, save_mean, save_invstd, /*train=*/true, eps, output_mask);
  if (grad_input.defined()) grad_input = with_layout_strides(grad_input, layout_of(output));
  return {grad_input, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cpu(
    Geometry g, const at::Tensor& input_, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool training, double momentum, double eps, Act act, double slope,
    const std::optional<at::Tensor>& num_batches_tracked) {
  if (on_aten(input_))
    return forward_aten(input_, weight, bias, running_mean, running_var, training, momentum, eps, act, slope,
                        num_batches_tracked);
  auto layout = layout_of(input_);
  at::Tensor input = input_.contiguous(layout);
  Strides s = strides_of(g, layout);
  auto stats_type = stats_dtype(input.scalar_type());
  auto f64 = input.options().dtype(at::kDouble);

  at::Tensor mean, var;  // float64 [C]: the statistics used (var biased)
  if (training) {
    mean = at::empty({g.c}, f64);
    var = at::empty({g.c}, f64);
  } else {
    mean = running_mean->to(at::kDouble).contiguous();
    var = running_var->to(at::kDouble).contiguous();
  }
  at::Tensor out = new_output(input.sizes(), input.options(), layout);
  at::Tensor w = param_or(weight, g.c, 1, f64), b = param_or(bias, g.c, 0, f64);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "batch_norm_act_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    double* mean_p = mean.mutable_data_ptr<double>();
    double* var_p = var.mutable_data_ptr<double>();
    const double* w_p = w.const_data_ptr<double>();
    const double* b_p = b.const_data_ptr<double>();
    const opmath_t leak = static_cast<opmath_t>(slope);
    at::parallel_for(0, g.c, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const scalar_t* xc = x + c * s.c;
        if (training) {
          double sum = 0;
          for (int64_t n = 0; n < g.n; ++n)
            for (int64_t l = 0; l < g.l; ++l) sum += static_cast<double>(xc[n * s.n + l * s.l]);
          const double m = sum / static_cast<double>(g.reduce());
          double m2 = 0;
          for (int64_t n = 0; n < g.n; ++n)
            for (int64_t l = 0; l < g.l; ++l) {
              const double d = static_cast<double>(xc[n * s.n + l * s.l]) - m;
              m2 += d * d;
            }
          mean_p[c] = m;
          var_p[c] = m2 / static_cast<double>(g.reduce());
        }
        const double invstd = 1.0 / std::sqrt(var_p[c] + eps);
        const opmath_t scale = static_cast<opmath_t>(w_p[c] * invstd);
        const opmath_t shift = static_cast<opmath_t>(b_p[c] - mean_p[c] * w_p[c] * invstd);
        scalar_t* oc = o + c * s.c;
        for (int64_t n = 0; n < g.n; ++n)
          for (int64_t l = 0; l < g.l; ++l) {
            const int64_t i = n * s.n + l * s.l;
            opmath_t y = static_cast<opmath_t>(xc[i]) * scale + shift;
            if (act == Act::relu) y = y > 0 ? y : opmath_t(0);
            else if (act == Act::leaky_relu) y = y > 0 ? y : y * leak;
            oc[i] = static_cast<scalar_t>(y);
          }
      }
    });
  });

  if (training && present(num_batches_tracked)) num_batches_tracked->add_(1);
  if (training && present(running_mean)) {
    // PyTorch's update: the running variance takes the unbiased batch variance.
    const double n = static_cast<double>(g.reduce());
    auto new_mean = running_mean->to(at::kDouble).mul(1 - momentum).add(mean.mul(momentum));
    auto new_var = running_var->to(at::kDouble).mul(1 - momentum).add(var.mul(momentum * n / (n - 1)));
    running_mean->copy_(new_mean);
    running_var->copy_(new_var);
  }
  // A copy even when the dtypes agree: in eval mode `mean` may be running_mean itself, and the schema
  // promises outputs that alias no input.
  at::Tensor save_mean = mean.to(stats_type, /*non_blocking=*/false, /*copy=*/true);
  at::Tensor save_invstd = var.add(eps).rsqrt().to(stats_type);
  return {out, save_mean, save_invstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    Geometry g, const at::Tensor& grad_output_, const at::Tensor& output_, const std::optional<at::Tensor>& input_,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, double eps, Act act, double slope, std::array<bool, 3> output_mask) {
  if (backward_on_aten(output_, input_, weight, training))
    return backward_aten(grad_output_, output_, input_, weight, bias, save_mean, save_invstd, eps, act, slope,
                         output_mask);
  auto layout = layout_of(output_);
  at::Tensor output = output_.contiguous(layout);
  at::Tensor grad_output = grad_output_.contiguous(layout);
  const bool from_input = present(input_);
  at::Tensor input = from_input ? input_->contiguous(layout) : at::Tensor();
  Strides s = strides_of(g, layout);
  auto f64 = output.options().dtype(at::kDouble);
  at::Tensor w = param_or(weight, g.c, 1, f64), b = param_or(bias, g.c, 0, f64);
  at::Tensor mean = save_mean.to(at::kDouble).contiguous(), invstd = save_invstd.to(at::kDouble).contiguous();

  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) grad_input = new_output(output.sizes(), output.options(), layout);
  at::Tensor sum_dy = at::empty({g.c}, f64), sum_dy_xhat = at::empty({g.c}, f64);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, output.scalar_type(), "batch_norm_act_backward_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* out_p = output.const_data_ptr<scalar_t>();
    const scalar_t* dy_p = grad_output.const_data_ptr<scalar_t>();
    const scalar_t* x_p = from_input ? input.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* dx_p = output_mask[0] ? grad_input.mutable_data_ptr<scalar_t>() : nullptr;
    const double* w_p = w.const_data_ptr<double>();
    const double* b_p = b.const_data_ptr<double>();
    const double* mean_p = mean.const_data_ptr<double>();
    const double* invstd_p = invstd.const_data_ptr<double>();
    double* sum_dy_p = sum_dy.mutable_data_ptr<double>();
    double* sum_dy_xhat_p = sum_dy_xhat.mutable_data_ptr<double>();
    const opmath_t leak = static_cast<opmath_t>(slope);
    at::parallel_for(0, g.c, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const opmath_t gamma = static_cast<opmath_t>(w_p[c]), beta = static_cast<opmath_t>(b_p[c]);
        const opmath_t mu = static_cast<opmath_t>(mean_p[c]), istd = static_cast<opmath_t>(invstd_p[c]);
        // gamma == 0 makes the output constant: xhat cannot be recovered from it. It only enters grad_input
        // multiplied by gamma (so 0 is exact there) and grad_weight (made NaN below: not recoverable).
        const opmath_t inv_gamma = gamma != 0 ? opmath_t(1) / gamma : opmath_t(0);
        // The activation's derivative from the output (out > 0 exactly when the pre-activation y > 0, as
        // slope > 0), and xhat from the input or by inverting the activation and the affine map.
        auto dy_xhat = [&](int64_t i, opmath_t& dy, opmath_t& xhat) {
          const opmath_t o = static_cast<opmath_t>(out_p[i]);
          dy = static_cast<opmath_t>(dy_p[i]);
          if (act == Act::relu) dy = o > 0 ? dy : opmath_t(0);
          else if (act == Act::leaky_relu) dy = o > 0 ? dy : dy * leak;
          if (x_p) {
            xhat = (static_cast<opmath_t>(x_p[i]) - mu) * istd;
          } else {
            const opmath_t y = (act == Act::leaky_relu && !(o > 0)) ? o / leak : o;
            xhat = (y - beta) * inv_gamma;
          }
        };
        const int64_t base = c * s.c;
        double sdy = 0, sdyx = 0;
        for (int64_t n = 0; n < g.n; ++n)
          for (int64_t l = 0; l < g.l; ++l) {
            opmath_t dy, xhat;
            dy_xhat(base + n * s.n + l * s.l, dy, xhat);
            sdy += static_cast<double>(dy);
            sdyx += static_cast<double>(dy) * static_cast<double>(xhat);
          }
        sum_dy_p[c] = sdy;
        sum_dy_xhat_p[c] = (gamma == 0 && !x_p) ? std::numeric_limits<double>::quiet_NaN() : sdyx;
        if (!dx_p) continue;
        const double count = static_cast<double>(g.reduce());
        const opmath_t k = static_cast<opmath_t>(w_p[c] * invstd_p[c]);
        const opmath_t mean_dy = training ? static_cast<opmath_t>(sdy / count) : opmath_t(0);
        const opmath_t mean_dy_xhat = training ? static_cast<opmath_t>(sdyx / count) : opmath_t(0);
        for (int64_t n = 0; n < g.n; ++n)
          for (int64_t l = 0; l < g.l; ++l) {
            const int64_t i = base + n * s.n + l * s.l;
            opmath_t dy, xhat;
            dy_xhat(i, dy, xhat);
            dx_p[i] = static_cast<scalar_t>(k * (dy - mean_dy - xhat * mean_dy_xhat));
          }
      }
    });
  });

  // Parameter gradients in the parameters' dtype (float32 by default for half inputs).
  const auto dtypes = param_grad_dtypes(output.scalar_type(), weight, bias);
  if (output_mask[1]) {
    grad_weight = new_output({g.c}, output.options().dtype(dtypes.weight));
    grad_weight.copy_(sum_dy_xhat);
  }
  if (output_mask[2]) {
    grad_bias = new_output({g.c}, output.options().dtype(dtypes.bias));
    grad_bias.copy_(sum_dy);
  }
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace
}  // namespace hierpar::detail::bn

TORCH_LIBRARY_IMPL(hierpar, CPU, m) {
  hierpar::detail::bn::register_batch_norm_act<&hierpar::detail::bn::forward_cpu, &hierpar::detail::bn::backward_cpu>(m);
}
