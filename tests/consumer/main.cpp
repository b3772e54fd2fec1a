// A user's program, built against the installed package: it swaps stock layers for hierpar's (the
// README's snippet) and calls an operator, and checks both against stock LibTorch.
#include <hierpar/nn.h>
#include <hierpar/ops.h>
#include <torch/torch.h>

#include <iostream>

int main() {
  torch::manual_seed(1);
  auto x = torch::randn({8, 64, 12, 12});

  hierpar::nn::BatchNormAct2d bn(torch::nn::BatchNorm2dOptions(64), hierpar::nn::Activation::leaky_relu, 0.2);
  hierpar::nn::MaxPool2d pool(torch::nn::MaxPool2dOptions(2));  // was: torch::nn::MaxPool2d pool(...)
  torch::nn::BatchNorm2d stock_bn(64);
  torch::nn::MaxPool2d stock_pool(torch::nn::MaxPool2dOptions(2));
  auto ours = pool(bn(x));
  auto stock = stock_pool(torch::leaky_relu(stock_bn(x), 0.2));
  if (!torch::allclose(ours, stock, 1e-4, 1e-5)) {
    std::cerr << "consumer: hierpar layers differ from torch::nn\n";
    return 1;
  }
  auto [out, indices] = hierpar::ops::max_pool2d(x, {2, 2});  // the operator itself; indices are uint8
  if (!out.equal(at::max_pool2d(x, {2, 2})) || indices.scalar_type() != torch::kByte) {
    std::cerr << "consumer: hierpar::ops::max_pool2d differs from at::max_pool2d\n";
    return 1;
  }
  std::cout << "consumer: installed hierpar layers and operators match torch::nn and ATen on " << x.sizes() << "\n";
  return 0;
}
