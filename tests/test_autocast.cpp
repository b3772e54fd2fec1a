// Under autocast, hierpar's operators take the dtypes stock ATen takes: conv_transpose2d runs in the
// autocast dtype, batch_norm_act and max_pool2d keep their input's, so a model mixes them like stock layers.
#include "testing.h"

#include <hierpar/ops.h>

#include <ATen/autocast_mode.h>

#include <optional>

namespace {

using hierpar::testing::random_tensor;

struct AutocastScope {
  AutocastScope(c10::DeviceType device, at::ScalarType dtype) : device(device) {
    at::autocast::set_autocast_enabled(device, true);
    at::autocast::set_autocast_dtype(device, dtype);
  }
  ~AutocastScope() {
    at::autocast::set_autocast_enabled(device, false);
    at::autocast::clear_cache();
  }
  c10::DeviceType device;
};

void check_conv_transpose_autocast(const torch::Device& device) {
  auto options = torch::TensorOptions().device(device).dtype(torch::kFloat);
  auto input = random_tensor({3, 8, 5, 5}, options);
  auto weight = random_tensor({8, 4, 4, 4}, options);
  torch::Tensor ours, stock;
  {
    AutocastScope autocast(device.type(), torch::kBFloat16);
    ours = hierpar::ops::conv_transpose2d(input, weight, std::nullopt, {2, 2}, {1, 1});
    stock = at::conv_transpose2d(input, weight, {}, {2, 2}, {1, 1});
  }
  EXPECT_EQ(stock.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(ours.scalar_type(), stock.scalar_type()) << "conv_transpose2d under autocast";
  // The bf16 operands' exact products summed in float64, then rounded once to bf16: hierpar accumulates in fp32, so
  // it is within bf16's output rounding of that. (Stock's CPU kernel is not compared by value: it may round partial
  // sums to bf16, several units of the last place away.)
  const auto exact = at::conv_transpose2d(input.to(torch::kBFloat16).to(torch::kDouble),
                                          weight.to(torch::kBFloat16).to(torch::kDouble), {}, {2, 2}, {1, 1});
  hierpar::testing::expect_close(ours, exact.to(torch::kBFloat16).to(device), {1e-2, 1e-2},
                                 "conv_transpose2d under autocast");
}

TEST(Autocast, ConvTransposeRunsInTheAutocastDtypeOnCpu) { check_conv_transpose_autocast(torch::kCPU); }

TEST(Autocast, ConvTransposeRunsInTheAutocastDtypeOnCuda) {
  HIERPAR_REQUIRE_CUDA();
  check_conv_transpose_autocast(torch::kCUDA);
}

TEST(Autocast, BatchNormActAndMaxPoolKeepTheInputDtype) {
  auto input = random_tensor({4, 6, 8, 8}, torch::TensorOptions().dtype(torch::kBFloat16));
  auto weight = random_tensor({6}, torch::TensorOptions().dtype(torch::kFloat)).abs().add_(0.5);
  auto bias = random_tensor({6}, torch::TensorOptions().dtype(torch::kFloat));
  AutocastScope autocast(c10::DeviceType::CPU, torch::kBFloat16);
  auto [out, mean, invstd] =
      hierpar::ops::batch_norm_act(input, weight, bias, std::nullopt, std::nullopt, true, 0.1, 1e-5, "relu", 0.0);
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(mean.scalar_type(), torch::kFloat);
  auto [pooled, indices] = hierpar::ops::max_pool2d(out, {2, 2});
  EXPECT_EQ(pooled.scalar_type(), torch::kBFloat16);
}

}  // namespace

// A backward run inside the autocast region (autocast is thread-local state that autograd carries to its threads)
// gives the gradients of one run outside it: the autocast dispatch does not reach inside hierpar's backward kernels
// (their GEMMs accumulate bf16 operands in float). Both convolutions, on the CPU and on CUDA.
void check_backward_inside_autocast(const torch::Device& device) {
  const auto options = torch::TensorOptions().device(device).dtype(torch::kFloat);
  const auto input = random_tensor({3, 4, 7, 7}, options);
  const auto weight = random_tensor({4, 5, 4, 4}, options);
  for (const bool transposed : {false, true}) {
    std::vector<torch::Tensor> grads[2];
    for (const bool inside : {false, true}) {
      const auto x = input.clone().requires_grad_(true), w = weight.clone().requires_grad_(true);
      torch::Tensor y;
      std::optional<AutocastScope> autocast(std::in_place, device.type(), torch::kBFloat16);
      y = transposed ? hierpar::ops::conv_transpose2d(x, w, std::nullopt, {2, 2}, {1, 1})
                     : hierpar::ops::conv2d(x, w.transpose(0, 1).contiguous(), std::nullopt, {2, 2}, {1, 1});
      if (!inside) autocast.reset();
      y.backward(torch::ones_like(y));
      grads[inside] = {x.grad(), w.grad()};
    }
    const std::string op = transposed ? "conv_transpose2d" : "conv2d";
    hierpar::testing::expect_close(grads[1][0], grads[0][0], {0, 0}, op + ": input gradient, backward inside autocast");
    hierpar::testing::expect_close(grads[1][1], grads[0][1], {0, 0}, op + ": weight gradient, backward inside autocast");
  }
}

TEST(Autocast, BackwardInsideAutocastEqualsBackwardOutsideOnCpu) { check_backward_inside_autocast(torch::kCPU); }

TEST(Autocast, BackwardInsideAutocastEqualsBackwardOutsideOnCuda) {
  HIERPAR_REQUIRE_CUDA();
  check_backward_inside_autocast(torch::kCUDA);
}
