// Helpers shared by the convolution operators' tests (test_conv_transpose.cpp, test_conv2d.cpp): each compares a
// forward + backward against ATen in float64 with a tolerance per dtype (the reasons are at the top of
// test_conv_transpose.cpp) whose absolute part scales with the reference's largest magnitude, since every output
// and gradient is a sum of many products and cancellation makes elementwise-relative error meaningless near 0.
#pragma once

#include "testing.h"

#include <optional>
#include <string>

namespace hierpar::testing {

inline Tolerance scaled(double rel, const torch::Tensor& reference) {
  const double scale = reference.defined() && reference.numel() > 0 ? reference.abs().max().item<double>() : 1.0;
  return {rel, rel * std::max(scale, 1e-30)};
}

inline double conv_rel_tolerance(c10::ScalarType dtype, bool cuda) {
  switch (dtype) {
    case torch::kDouble: return 1e-10;
    case torch::kFloat: return cuda ? 2e-3 : 1e-5;
    case torch::kBFloat16: return 1e-2;
    case torch::kHalf: return 2e-3;
    default: return 0;
  }
}

// A forward + backward's results; grad_bias is undefined without a bias.
struct ConvResults {
  torch::Tensor output, grad_input, grad_weight, grad_bias;
};

inline std::optional<torch::Tensor> opt(const torch::Tensor& t) {
  return t.defined() ? std::optional<torch::Tensor>(t) : std::nullopt;
}

inline void compare(const ConvResults& got, const ConvResults& ref, double rel, const std::string& what) {
  expect_close(got.output, ref.output, scaled(rel, ref.output), what + " output");
  expect_close(got.grad_input, ref.grad_input, scaled(rel, ref.grad_input), what + " grad_input");
  expect_close(got.grad_weight, ref.grad_weight, scaled(rel, ref.grad_weight), what + " grad_weight");
  if (ref.grad_bias.defined()) expect_close(got.grad_bias, ref.grad_bias, scaled(rel, ref.grad_bias), what + " grad_bias");
}

}  // namespace hierpar::testing
