// The gradients a (transposed) convolution's backward returns, as empty Meta tensors: grad_input in the input's
// layout (unbatched 3-d inputs too), grad_weight in the weight's, grad_bias [bias_channels]; only those
// `output_mask` asks for. Shared by the conv2d and conv_transpose2d Meta kernels.
#pragma once

#include "common.h"

#include <ATen/ops/empty.h>

#include <array>
#include <tuple>

namespace hierpar::detail {

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_conv_gradients(const at::Tensor& input,
                                                                          const at::Tensor& weight,
                                                                          int64_t bias_channels,
                                                                          std::array<bool, 3> output_mask) {
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) {
    const bool unbatched = input.dim() == 3;
    const at::Tensor input4 = unbatched ? input.unsqueeze(0) : input;
    grad_input = at::empty(input4.sizes(), input.options().memory_format(layout_of(input4)));
    if (unbatched) grad_input = grad_input.squeeze(0);
  }
  if (output_mask[1]) grad_weight = at::empty(weight.sizes(), weight.options().memory_format(layout_of(weight)));
  if (output_mask[2]) grad_bias = at::empty({bias_channels}, input.options());
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace hierpar::detail
