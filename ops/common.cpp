#include "common.h"


#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/util/strides.h>

#include <limits>

#ifdef HIERPAR_WITH_CUDA
#include <ATen/cuda/EmptyTensor.h>
#endif

namespace hierpar::detail {

at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options, c10::MemoryFormat memory_format) {
  // Made as ATen's structured kernels make their outputs, not through at::empty's dispatch: an op makes one to three
  // outputs per call, and each dispatch is host time a stock layer does not pay (docs/overhead.md).
  const at::ScalarType dtype = options.dtype().toScalarType();
  at::Tensor out;
  if (options.device().is_cpu() && !options.pinned_memory()) {
    out = at::detail::empty_cpu(sizes, dtype, /*pin_memory=*/false, memory_format);
#ifdef HIERPAR_WITH_CUDA
  } else if (options.device().is_cuda()) {
    out = at::detail::empty_cuda(sizes, dtype, options.device(), memory_format);
#endif
  } else {
    out = at::empty(sizes, options.memory_format(memory_format));
  }
  if (switch_on(Switch::poison_outputs) && out.numel() > 0) {
    if (at::isFloatingType(out.scalar_type())) {
      out.fill_(std::numeric_limits<double>::quiet_NaN());
    } else if (out.scalar_type() == at::kByte) {
      out.fill_(255);
    } else if (out.scalar_type() != at::kBool) {
      out.fill_(-1);
    }
  }
  return out;
}

at::Tensor with_layout_strides(const at::Tensor& t, c10::MemoryFormat layout) {
  const bool channels_last = layout == c10::MemoryFormat::ChannelsLast && t.dim() == 4;
  const bool canonical = channels_last ? t.strides() == at::IntArrayRef(c10::get_channels_last_strides_2d(t.sizes()))
                                       : t.strides() == at::IntArrayRef(c10::contiguous_strides(t.sizes()));
  if (canonical) return t;
  at::Tensor out = at::empty(t.sizes(), t.options().memory_format(channels_last ? layout : c10::MemoryFormat::Contiguous));
  out.copy_(t);
  return out;
}

c10::MemoryFormat layout_of(const at::Tensor& t) {
  if (t.dim() == 4 && t.suggest_memory_format() == c10::MemoryFormat::ChannelsLast) {
    return c10::MemoryFormat::ChannelsLast;
  }
  return c10::MemoryFormat::Contiguous;
}

}  // namespace hierpar::detail
