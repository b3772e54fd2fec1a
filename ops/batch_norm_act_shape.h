// Argument checks and shape/dtype rules of hierpar::batch_norm_act and its backward, shared by the CPU,
// CUDA and Meta kernels so that every backend accepts and rejects exactly the same inputs with the same
// messages (private to hierpar_ops).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

namespace hierpar::detail::bn {

enum class Act { identity = 0, relu = 1, leaky_relu = 2 };

Act parse_activation(c10::string_view name, const char* op);

// The backward inverts the activation from its output: leaky_relu must keep the sign (slope > 0) and be
// a bijection, so the slope must be positive and finite. Other activations ignore `slope`.
void check_slope(Act act, double slope, const char* op);

// The statistics (save_mean/save_invstd) and the accumulation type: float64 for float64 inputs, float32
// for float32/bfloat16/float16 inputs.
inline c10::ScalarType stats_dtype(c10::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
}

// Per-channel geometry: the input is viewed as [N, C, L] with L = H*W (or L for 3-d, 1 for 2-d).
struct Geometry {
  int64_t n = 0, c = 0, l = 0;
  int64_t reduce() const { return n * l; }  // elements per channel
};

Geometry check_input(const at::Tensor& input, const char* op, const char* name = "input");

// weight, bias, running_mean, running_var: [C] on the input's device, in the input's dtype or (for
// bfloat16/float16 inputs) float32, like cuDNN's batch norm.
void check_channel_param(const std::optional<at::Tensor>& p, const char* name, const at::Tensor& input,
                         int64_t channels, const char* op);

inline bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// Everything the forward checks; returns the geometry.
Geometry check_forward(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
                       const std::optional<at::Tensor>& running_var, bool training, double momentum,
                       double eps, Act act, double slope, const std::optional<at::Tensor>& num_batches_tracked);

// The dtypes of the backward's grad_weight and grad_bias: the weight's and the bias's; without a weight the
// statistics' dtype (stats_dtype of the output's), without a bias grad_weight's.
struct ParamGradDtypes {
  c10::ScalarType weight, bias;
};
ParamGradDtypes param_grad_dtypes(c10::ScalarType output, const std::optional<at::Tensor>& weight,
                                  const std::optional<at::Tensor>& bias);

Geometry check_backward(const at::Tensor& grad_output, const at::Tensor& output,
                        const std::optional<at::Tensor>& input, const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias, const at::Tensor& save_mean,
                        const at::Tensor& save_invstd, double eps, Act act, double slope);

// A backend's kernels of both ops: the activation parsed and every argument checked as above, then the backend's
// kernel (Forward or Backward) with the geometry first and the parsed activation for the name.
template <auto Forward>
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_entry(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps, c10::string_view activation, double slope,
    const std::optional<at::Tensor>& num_batches_tracked) {
  const Act act = parse_activation(activation, "hierpar::batch_norm_act");
  const Geometry g = check_forward(input, weight, bias, running_mean, running_var, training, momentum, eps, act,
                                   slope, num_batches_tracked);
  return Forward(g, input, weight, bias, running_mean, running_var, training, momentum, eps, act, slope,
                 num_batches_tracked);
}

template <auto Backward>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_entry(
    const at::Tensor& grad_output, const at::Tensor& output, const std::optional<at::Tensor>& input,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, double eps, c10::string_view activation, double slope,
    std::array<bool, 3> output_mask) {
  const Act act = parse_activation(activation, "hierpar::batch_norm_act_backward");
  const Geometry g = check_backward(grad_output, output, input, weight, bias, save_mean, save_invstd, eps, act, slope);
  return Backward(g, grad_output, output, input, weight, bias, save_mean, save_invstd, training, eps, act, slope,
                  output_mask);
}

// Registers both ops' kernels of the backend whose kernels are Forward and Backward.
template <auto Forward, auto Backward>
void register_batch_norm_act(torch::Library& m) {
  m.impl("batch_norm_act", &forward_entry<Forward>);
  m.impl("batch_norm_act_backward", &backward_entry<Backward>);
}

}  // namespace hierpar::detail::bn
