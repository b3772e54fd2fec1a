// The CPU kernels' two routes (ops/common.h, cpu_aten_route): by default float32 calls run on ATen's CPU kernels,
// bit for bit what the stock op gives; with HIERPAR_CPU_ATEN=0 the same calls run hierpar's reference kernels,
// which sum in another order (float64 for BatchNorm's statistics), so their float32 results differ from ATen's in
// low bits while agreeing within float32's tolerance. The inputs are fixed, so each check is deterministic. ctest
// also runs the CPU operator suites a second time with HIERPAR_CPU_ATEN=0 (the "reference." entries).
#include "testing.h"

#include "hierpar/ops.h"

#include <cstdlib>
#include <functional>
#include <string>

namespace {

using hierpar::testing::expect_close;

// Runs `f` with HIERPAR_CPU_ATEN set to `value` (nullptr: unset), restoring the previous setting.
torch::Tensor with_route(const char* value, const std::function<torch::Tensor()>& f) {
  const char* old = std::getenv("HIERPAR_CPU_ATEN");
  const std::string saved = old ? old : "";
  if (value) ::setenv("HIERPAR_CPU_ATEN", value, 1); else ::unsetenv("HIERPAR_CPU_ATEN");
  torch::Tensor result = f();
  if (old) ::setenv("HIERPAR_CPU_ATEN", saved.c_str(), 1); else ::unsetenv("HIERPAR_CPU_ATEN");
  return result;
}

torch::Tensor fixed(at::IntArrayRef sizes, uint64_t seed) {
  return torch::randn(sizes, at::make_generator<at::CPUGeneratorImpl>(seed), torch::kFloat);
}

void expect_routes(const std::function<torch::Tensor()>& op, const torch::Tensor& aten, const std::string& what) {
  const auto by_default = with_route(nullptr, op), on_aten = with_route("1", op), reference = with_route("0", op);
  EXPECT_TRUE(by_default.equal(aten)) << what << ": the default route should be ATen's kernels, bit for bit";
  EXPECT_TRUE(on_aten.equal(aten)) << what << ": HIERPAR_CPU_ATEN=1 should be ATen's kernels, bit for bit";
  EXPECT_FALSE(reference.equal(aten)) << what << ": HIERPAR_CPU_ATEN=0 should run the reference kernels";
  expect_close(reference, aten, {1e-4, 1e-5}, what + ": reference vs ATen");
}

TEST(CpuRoute, Conv2dTakesAtenOrTheReference) {
  // (Few input channels, as in the DCGAN's first layer, give bitwise ATen's results on both routes.)
  const auto x = fixed({8, 16, 16, 16}, 1), w = fixed({8, 16, 3, 3}, 2);
  expect_routes([&] { return hierpar::ops::conv2d(x, w, {}, {1}, {1}); }, at::conv2d(x, w, {}, 1, 1), "conv2d");
}

TEST(CpuRoute, ConvTranspose2dTakesAtenOrTheReference) {
  const auto x = fixed({8, 32, 16, 16}, 3), w = fixed({32, 3, 4, 4}, 4);
  expect_routes([&] { return hierpar::ops::conv_transpose2d(x, w, {}, {2}, {1}); },
                at::conv_transpose2d(x, w, {}, 2, 1), "conv_transpose2d");
}

TEST(CpuRoute, BatchNormActTakesAtenOrTheReference) {
  const auto x = fixed({16, 8, 16, 16}, 5).mul(100).add(1000);  // an offset that float32 sums round
  auto op = [&] { return std::get<0>(hierpar::ops::batch_norm_act(x, {}, {}, {}, {}, true, 0.1, 1e-5, "relu", 0.0)); };
  expect_routes(op, at::relu(std::get<0>(at::native_batch_norm(x, {}, {}, {}, {}, true, 0.1, 1e-5))), "batch_norm_act");
}

}  // namespace
