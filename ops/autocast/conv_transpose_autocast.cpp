// Autocast for hierpar::conv_transpose2d: like aten::conv_transpose2d, it runs in the autocast dtype
// (bf16/fp16 on the tensor cores) when autocast is on. The other hierpar ops need no autocast kernel:
// batch_norm_act takes a half-precision input with fp32 parameters as it comes, and max_pool2d keeps its
// input's dtype, so autocast's fallthrough serves them.
#include "hierpar/ops.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace hierpar::ops {
namespace {

template <c10::DeviceType device_type, c10::DispatchKey autocast_key>
at::Tensor conv_transpose2d_autocast(const at::Tensor& input, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                     at::IntArrayRef padding, at::IntArrayRef output_padding, int64_t groups,
                                     at::IntArrayRef dilation) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto dtype = at::autocast::get_lower_precision_fp_from_device_type(device_type);
  return hierpar::ops::conv_transpose2d(at::autocast::cached_cast(dtype, input, device_type),
                          at::autocast::cached_cast(dtype, weight, device_type),
                          at::autocast::cached_cast(dtype, bias, device_type), stride, padding, output_padding,
                          groups, dilation);
}

}  // namespace
}  // namespace hierpar::ops

TORCH_LIBRARY_IMPL(hierpar, AutocastCUDA, m) {
  m.impl("conv_transpose2d",
         hierpar::ops::conv_transpose2d_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
}

TORCH_LIBRARY_IMPL(hierpar, AutocastCPU, m) {
  m.impl("conv_transpose2d",
         hierpar::ops::conv_transpose2d_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
}
