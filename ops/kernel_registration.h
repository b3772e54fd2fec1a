// Registration of a backend's kernels of an op and its backward (private to hierpar_ops).
#pragma once

#include <torch/library.h>

namespace hierpar::detail {

// Registers Forward as the kernel of `op` and Backward as that of `backward_op`, both unboxed (TORCH_FN).
template <auto Forward, auto Backward>
void register_kernels(torch::Library& m, const char* op, const char* backward_op) {
  m.impl(op, TORCH_FN(Forward));
  m.impl(backward_op, TORCH_FN(Backward));
}

}  // namespace hierpar::detail
