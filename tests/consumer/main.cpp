// Calls a hierpar operator from a program that only linked hierpar::ops, and checks it against ATen.
#include <hierpar/ops.h>

#include <ATen/ATen.h>

#include <iostream>

int main() {
  at::manual_seed(1);
  at::Tensor x = at::randn({2, 3, 9, 7});
  auto [out, indices] = hierpar::ops::max_pool2d(x, {2, 2});
  at::Tensor expected = at::max_pool2d(x, {2, 2});
  if (!out.equal(expected)) {
    std::cerr << "consumer: hierpar::max_pool2d differs from at::max_pool2d\n";
    return 1;
  }
  std::cout << "consumer: hierpar::max_pool2d from the installed package matches at::max_pool2d on "
            << x.sizes() << "\n";
  return 0;
}
