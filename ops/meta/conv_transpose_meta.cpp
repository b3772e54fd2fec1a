// Meta kernels of hierpar::conv_transpose2d and its backward: the same checks and output shapes/layouts as
// the CPU and CUDA kernels, no data.
#include "common.h"
#include "conv_transpose_backends.h"
#include "meta/conv_gradients.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace hierpar::detail {
namespace {

at::Tensor conv_transpose2d_meta(const ConvTranspose2dGeometry& g, const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>&) {
  const bool unbatched = input.dim() == 3;
  const auto layout = conv_transpose2d_output_layout(unbatched ? input.unsqueeze(0) : input, weight);
  at::Tensor out = at::empty({g.batch, g.out_channels, g.out_h, g.out_w}, input.options().memory_format(layout));
  return unbatched ? out.squeeze(0) : out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_transpose2d_backward_meta(
    const ConvTranspose2dGeometry& g, const at::Tensor&, const at::Tensor& input, const at::Tensor& weight,
    std::array<bool, 3> output_mask) {
  return empty_conv_gradients(input, weight, g.out_channels, output_mask);
}

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, Meta, m) {
  hierpar::detail::register_conv_transpose2d<&hierpar::detail::conv_transpose2d_meta,
                                             &hierpar::detail::conv_transpose2d_backward_meta>(m);
}
