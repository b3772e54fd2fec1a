// Helpers shared by hierpar's kernels (private to hierpar_ops).
#pragma once

#include "hierpar/switches.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <c10/core/MemoryFormat.h>
#include <c10/core/TensorOptions.h>

namespace hierpar::detail {

// at::empty; with Switch::poison_outputs on (hierpar/switches.h) filled with NaN (or the integer type's -1 / 255)
// first, so a test sees any element a kernel failed to write. Every kernel allocates its outputs through this.
at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options,
                      c10::MemoryFormat memory_format = c10::MemoryFormat::Contiguous);

// `t` with exactly the strides new_output gives a tensor of its sizes in `layout` (copied when they differ): ATen's
// kernels may return the layout asked for with other strides on size-1 dimensions, which the Meta kernels, and so
// torch.compile's traced strides, would not match.
at::Tensor with_layout_strides(const at::Tensor& t, c10::MemoryFormat layout);

// The memory format a 4-d input is laid out in (ChannelsLast or Contiguous); outputs follow it.
c10::MemoryFormat layout_of(const at::Tensor& t);

}  // namespace hierpar::detail
