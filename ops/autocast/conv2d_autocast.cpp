// Autocast for hierpar::conv2d: like aten::conv2d, it runs in the autocast dtype (bf16/fp16 on the tensor cores)
// when autocast is on.
#include "hierpar/ops.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace hierpar::ops {
namespace {

template <c10::DeviceType device_type, c10::DispatchKey autocast_key>
at::Tensor conv2d_autocast(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                           int64_t groups, std::optional<double> leaky_relu_slope) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto dtype = at::autocast::get_lower_precision_fp_from_device_type(device_type);
  return hierpar::ops::conv2d(at::autocast::cached_cast(dtype, input, device_type),
                              at::autocast::cached_cast(dtype, weight, device_type),
                              at::autocast::cached_cast(dtype, bias, device_type), stride, padding, dilation, groups,
                              leaky_relu_slope);
}

}  // namespace
}  // namespace hierpar::ops

TORCH_LIBRARY_IMPL(hierpar, AutocastCUDA, m) {
  m.impl("conv2d", hierpar::ops::conv2d_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
}

TORCH_LIBRARY_IMPL(hierpar, AutocastCPU, m) {
  m.impl("conv2d", hierpar::ops::conv2d_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
}
