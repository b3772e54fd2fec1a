// Definitions of ops/batch_norm_act_shape.h. They live in a C++ translation unit so that the CUDA kernels
// only call them: every argument check and message is compiled once, by the host compiler.
#include "batch_norm_act_shape.h"

#include <cmath>
#include <string>
#include <utility>

namespace hierpar::detail::bn {

Act parse_activation(c10::string_view name, const char* op) {
  if (name == "identity") return Act::identity;
  if (name == "relu") return Act::relu;
  if (name == "leaky_relu") return Act::leaky_relu;
  TORCH_CHECK(false, op, ": activation: expected \"identity\", \"relu\" or \"leaky_relu\", got \"",
              std::string(name.data(), name.size()), "\"");
}

void check_slope(Act act, double slope, const char* op) {
  if (act != Act::leaky_relu) return;
  TORCH_CHECK(std::isfinite(slope) && slope > 0, op,
              ": slope: expected a positive, finite negative slope for leaky_relu (the backward recovers the "
              "pre-activation by dividing by it), got ",
              slope);
}

Geometry check_input(const at::Tensor& input, const char* op, const char* name) {
  TORCH_CHECK(input.defined(), op, ": ", name, ": expected a tensor, got an undefined one");
  TORCH_CHECK(input.dim() >= 2 && input.dim() <= 4, op, ": ", name,
              ": expected a 2-d (N, C), 3-d (N, C, L) or 4-d (N, C, H, W) tensor, got ", input.dim(), "-d ",
              input.sizes());
  auto t = input.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf, op, ": ", name,
              ": expected float32, float64, bfloat16 or float16, got ", t);
  Geometry g;
  g.n = input.size(0);
  g.c = input.size(1);
  g.l = 1;
  for (int64_t d = 2; d < input.dim(); ++d) g.l *= input.size(d);
  TORCH_CHECK(g.c > 0, op, ": ", name, ": expected at least one channel (dimension 1), got shape ", input.sizes());
  return g;
}

void check_channel_param(const std::optional<at::Tensor>& p, const char* name, const at::Tensor& input,
                         int64_t channels, const char* op) {
  if (!p.has_value() || !p->defined()) return;
  // size(0), not numel(): FakeTensors with symbolic sizes (torch.compile, opcheck) answer the former only.
  TORCH_CHECK(p->dim() == 1 && p->size(0) == channels, op, ": ", name, ": expected ", channels,
              " elements (input channels), got ", p->numel(), " (shape ", p->sizes(), ")");
  TORCH_CHECK(p->device() == input.device(), op, ": ", name, ": expected a tensor on ", input.device(),
              " (the input's device), got one on ", p->device());
  auto it = input.scalar_type();
  bool ok = p->scalar_type() == it || ((it == at::kBFloat16 || it == at::kHalf) && p->scalar_type() == at::kFloat);
  TORCH_CHECK(ok, op, ": ", name, ": expected dtype ", it,
              (it == at::kBFloat16 || it == at::kHalf) ? " or float32" : "", " (from the input), got ",
              p->scalar_type());
}

Geometry check_forward(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
                       const std::optional<at::Tensor>& running_var, bool training, double momentum,
                       double eps, Act act, double slope, const std::optional<at::Tensor>& num_batches_tracked) {
  const char* op = "hierpar::batch_norm_act";
  Geometry g = check_input(input, op);
  check_channel_param(weight, "weight", input, g.c, op);
  check_channel_param(bias, "bias", input, g.c, op);
  check_channel_param(running_mean, "running_mean", input, g.c, op);
  check_channel_param(running_var, "running_var", input, g.c, op);
  TORCH_CHECK(present(running_mean) == present(running_var), op,
              ": running_mean and running_var: expected both or neither, got only ",
              present(running_mean) ? "running_mean" : "running_var");
  TORCH_CHECK(training || present(running_mean), op,
              ": running_mean: expected running statistics in eval mode (training=false), got none");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps: expected a non-negative finite number, got ", eps);
  if (present(num_batches_tracked)) {
    const at::Tensor& t = *num_batches_tracked;
    TORCH_CHECK(t.scalar_type() == at::kLong && t.numel() == 1 && t.device() == input.device(), op,
                ": num_batches_tracked: expected one int64 element on ", input.device(), " (the input's device), got ",
                t.scalar_type(), " of shape ", t.sizes(), " on ", t.device());
  }
  if (training) {
    TORCH_CHECK(g.n > 0, op, ": input: expected a non-empty batch in training mode, got shape ", input.sizes());
    TORCH_CHECK(g.reduce() > 1, op, ": input: expected more than 1 value per channel when training, got input size ",
                input.sizes());
    TORCH_CHECK(!present(running_mean) || (std::isfinite(momentum) && momentum >= 0 && momentum <= 1), op,
                ": momentum: expected a number in [0, 1], got ", momentum);
  }
  check_slope(act, slope, op);
  return g;
}

Geometry check_backward(const at::Tensor& grad_output, const at::Tensor& output,
                        const std::optional<at::Tensor>& input, const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias, const at::Tensor& save_mean,
                        const at::Tensor& save_invstd, double eps, Act act, double slope) {
  const char* op = "hierpar::batch_norm_act_backward";
  Geometry g = check_input(output, op, "output");
  TORCH_CHECK(grad_output.defined() && grad_output.sizes() == output.sizes(), op,
              ": grad_output: expected the output's shape ", output.sizes(), ", got ",
              grad_output.defined() ? grad_output.sizes() : at::IntArrayRef{});
  TORCH_CHECK(grad_output.device() == output.device() && grad_output.scalar_type() == output.scalar_type(), op,
              ": grad_output: expected ", output.scalar_type(), " on ", output.device(), " (like output), got ",
              grad_output.scalar_type(), " on ", grad_output.device());
  if (present(input)) {
    TORCH_CHECK(input->sizes() == output.sizes() && input->device() == output.device() &&
                    input->scalar_type() == output.scalar_type(),
                op, ": input: expected ", output.scalar_type(), " ", output.sizes(), " on ", output.device(),
                " (like output), got ", input->scalar_type(), " ", input->sizes(), " on ", input->device());
  }
  TORCH_CHECK(act != Act::relu || present(input), op,
              ": input: required for activation \"relu\" (ReLU discards the negative half of the "
              "pre-activation, which the backward needs), got none");
  check_channel_param(weight, "weight", output, g.c, op);
  check_channel_param(bias, "bias", output, g.c, op);
  auto st = stats_dtype(output.scalar_type());
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{save_mean, "save_mean"},
                                std::pair<const at::Tensor&, const char*>{save_invstd, "save_invstd"}}) {
    TORCH_CHECK(t.defined() && t.dim() == 1 && t.size(0) == g.c && t.scalar_type() == st &&
                    t.device() == output.device(),
                op, ": ", name, ": expected ", st, " [", g.c, "] on ", output.device(), ", got ",
                t.defined() ? t.toString() : std::string("undefined"), " ",
                t.defined() ? t.sizes() : at::IntArrayRef{});
  }
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps: expected a non-negative finite number, got ", eps);
  check_slope(act, slope, op);
  return g;
}

ParamGradDtypes param_grad_dtypes(c10::ScalarType output, const std::optional<at::Tensor>& weight,
                                  const std::optional<at::Tensor>& bias) {
  const auto weight_dtype = present(weight) ? weight->scalar_type() : stats_dtype(output);
  return {weight_dtype, present(bias) ? bias->scalar_type() : weight_dtype};
}

}  // namespace hierpar::detail::bn
