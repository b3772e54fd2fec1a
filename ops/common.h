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

// True unless HIERPAR_CPU_ATEN=0: the CPU kernels then run the common cases on ATen's CPU kernels (vectorised,
// multi-threaded), with hierpar's semantics around them; otherwise, and for the other cases, hierpar's own CPU
// kernels, the float64/opmath reference that the CUDA kernels are tested against. docs/cpu.md has the figures.
bool cpu_aten_route();

// `t` with exactly the strides new_output gives a tensor of its sizes in `layout` (copied when they differ): ATen's
// kernels may return the layout asked for with other strides on size-1 dimensions, which the Meta kernels, and so
// torch.compile's traced strides, would not match.
at::Tensor with_layout_strides(const at::Tensor& t, c10::MemoryFormat layout);

// The memory format a 4-d input is laid out in (ChannelsLast or Contiguous); outputs follow it.
c10::MemoryFormat layout_of(const at::Tensor& t);

}  // namespace hierpar::detail
