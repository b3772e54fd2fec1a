// Helpers shared by hierpar's kernels (private to hierpar_ops).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <c10/core/MemoryFormat.h>
#include <c10/core/TensorOptions.h>

namespace hierpar::detail {

// True when HIERPAR_POISON_OUTPUTS=1: kernels then fill every output they allocate with NaN (or the
// integer type's maximum) before computing it, so a test sees any element a kernel failed to write.
bool poison_outputs();

// at::empty, poisoned when poison_outputs() is on. Every kernel allocates its outputs through this.
at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options,
                      c10::MemoryFormat memory_format = c10::MemoryFormat::Contiguous);

// False when environment variable `name` is 0: the same-process A/B switches that turn a fast path off
// (HIERPAR_SIDE_STREAM=0, HIERPAR_BN_CLUSTER=0, ...). Read at each call, so a benchmark may flip one between rows.
bool switched_on(const char* name);

// The memory format a 4-d input is laid out in (ChannelsLast or Contiguous); outputs follow it.
c10::MemoryFormat layout_of(const at::Tensor& t);

}  // namespace hierpar::detail
