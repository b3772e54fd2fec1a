// The CPU kernels' two routes (Switch::cpu_aten, hierpar/switches.h): by default float32 calls run on ATen's CPU
// kernels, bit for bit what the stock op gives; switched off the same calls run hierpar's reference kernels,
// which agree with ATen's within float32's tolerance. Which route ran is observed, not inferred from low bits (the
// two can agree bit for bit on some machines): a RecordFunction callback lists the ATen operators a call dispatches.
// ctest also runs the CPU operator suites a second time with HIERPAR_CPU_ATEN=0 (the "reference." entries).
#include "testing.h"

#include "hierpar/ops.h"
#include "hierpar/switches.h"


#include <algorithm>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace {

using hierpar::testing::expect_close;

// Runs `f` with Switch::cpu_aten as it is (nullopt) or set to `on`.
torch::Tensor with_route(std::optional<bool> on, const std::function<torch::Tensor()>& f) {
  std::optional<hierpar::SwitchScope> scope;
  if (on.has_value()) scope.emplace(hierpar::Switch::cpu_aten, *on);
  return f();
}

torch::Tensor fixed(at::IntArrayRef sizes, uint64_t seed) {
  return torch::randn(sizes, at::make_generator<at::CPUGeneratorImpl>(seed), torch::kFloat);
}

// Runs `f` on route `on` (nullopt: the default); sets `called` to whether it dispatched the ATen operator `aten_op`.
torch::Tensor run_route(std::optional<bool> on, const std::function<torch::Tensor()>& f, const std::string& aten_op,
                        bool& called) {
  torch::Tensor result;
  const std::vector<std::string> names = hierpar::testing::dispatched_operators([&] { result = with_route(on, f); });
  called = std::find(names.begin(), names.end(), aten_op) != names.end();
  return result;
}

void expect_routes(const std::function<torch::Tensor()>& op, const torch::Tensor& aten, const std::string& aten_op,
                   const std::string& what) {
  bool default_called = false, one_called = false, zero_called = true;
  const auto by_default = run_route(std::nullopt, op, aten_op, default_called);
  const auto on_aten = run_route(true, op, aten_op, one_called);
  const auto reference = run_route(false, op, aten_op, zero_called);
  EXPECT_TRUE(default_called) << what << ": the default route should call " << aten_op;
  EXPECT_TRUE(one_called) << what << ": Switch::cpu_aten on should call " << aten_op;
  EXPECT_FALSE(zero_called) << what << ": Switch::cpu_aten off should run the reference kernels, not " << aten_op;
  EXPECT_TRUE(by_default.equal(aten)) << what << ": the default route should give ATen's result, bit for bit";
  EXPECT_TRUE(on_aten.equal(aten)) << what << ": Switch::cpu_aten on should give ATen's result, bit for bit";
  expect_close(reference, aten, {1e-4, 1e-5}, what + ": reference vs ATen");
}

TEST(CpuRoute, Conv2dTakesAtenOrTheReference) {
  const auto x = fixed({8, 16, 16, 16}, 1), w = fixed({8, 16, 3, 3}, 2);
  expect_routes([&] { return hierpar::ops::conv2d(x, w, {}, {1}, {1}); }, at::conv2d(x, w, {}, 1, 1),
                "aten::conv2d", "conv2d");
}

TEST(CpuRoute, ConvTranspose2dTakesAtenOrTheReference) {
  const auto x = fixed({8, 32, 16, 16}, 3), w = fixed({32, 3, 4, 4}, 4);
  expect_routes([&] { return hierpar::ops::conv_transpose2d(x, w, {}, {2}, {1}); },
                at::conv_transpose2d(x, w, {}, 2, 1), "aten::conv_transpose2d", "conv_transpose2d");
}

TEST(CpuRoute, BatchNormActTakesAtenOrTheReference) {
  const auto x = fixed({16, 8, 16, 16}, 5).mul(100).add(1000);  // an offset that float32 sums round
  auto op = [&] { return std::get<0>(hierpar::ops::batch_norm_act(x, {}, {}, {}, {}, true, 0.1, 1e-5, "relu", 0.0)); };
  expect_routes(op, at::relu(std::get<0>(at::native_batch_norm(x, {}, {}, {}, {}, true, 0.1, 1e-5))),
                "aten::native_batch_norm", "batch_norm_act");
}

// max_pool2d's backward with relu (the seed CNN's pool): windows whose maximum was <= 0 chose no element, and ATen's
// backward still takes the call, with a zero gradient there: ATen's relu then pool, bit for bit.
TEST(CpuRoute, MaxPoolWithReluBackwardTakesAtenOrTheReference) {
  const auto x = fixed({4, 10, 26, 26}, 6), g = fixed({4, 10, 13, 13}, 7);
  const auto indices = std::get<1>(hierpar::ops::max_pool2d(x, {2, 2}, {}, {0, 0}, {1, 1}, false, /*relu=*/true));
  ASSERT_TRUE(indices.eq(255).any().item<bool>()) << "some windows must have chosen no element";
  auto op = [&] { return hierpar::ops::max_pool2d_backward(g, indices, x.sizes(), {2, 2}, {2, 2}, {0, 0}, {1, 1}, false); };
  const auto x_ref = x.clone().requires_grad_();
  at::max_pool2d(at::relu(x_ref), {2, 2}).backward(g);
  expect_routes(op, x_ref.grad(), "aten::max_pool2d_with_indices_backward", "max_pool2d relu backward");
}

}  // namespace
