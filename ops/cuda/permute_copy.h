// Layout conversions of hierpar's CUDA convolution ops (private to hierpar_ops): NCHW activations to
// channels_last for the implicit GEMMs, weight repacks, split-K workspaces into the caller's layout.
//
// Why not ATen's copy_: a copy that permutes the memory order (NCHW -> NHWC, [C_in, C_out, kH, kW] -> [kH, kW,
// C_out, C_in]) runs ATen's generic elementwise kernel with per-element 4-d index arithmetic, reading coalesced
// and writing strided (or the reverse). Measured on an H200 (kernel profiles, batch 64 fp32 NCHW): 6-12 us per
// 1-2 MB copy, 25-49 us per DCGAN layer's forward + backward, where the bytes take ~1 us at HBM speed. Here such
// a copy goes through 32 x 32 shared-memory tiles, so that both the reads and the writes are coalesced.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/MemoryFormat.h>

#include <array>

namespace hierpar::detail {

// dst.copy_(src) for a dst that is dense in any dimension order and a src of dst's sizes with any strides, of
// dst's dtype or (a split-K workspace) fp32 into a bf16 / fp16 dst, rounded as ATen's copy_ rounds. Where the
// dimension that is contiguous in src differs from dst's innermost one (a transposition, after merging the
// dimensions the two orders share) it runs the tiled kernel; otherwise ATen's copy_, which is coalesced there.
void permute_copy_(const at::Tensor& dst, const at::Tensor& src);

// t.contiguous(format) through permute_copy_: t itself when it is already dense in `format`.
at::Tensor contiguous_as(const at::Tensor& t, c10::MemoryFormat format);

// Both of a and b (b may be undefined) in `format`, as above; where both take the tiled kernel with the same
// element types, one launch copies both: a copy of a few MB is one wave whose time is mostly latency (~3.4 us
// per launch on the H200 for 1-2 MB), so the second tensor adds little.
std::array<at::Tensor, 2> contiguous_as(const at::Tensor& a, const at::Tensor& b, c10::MemoryFormat format);

}  // namespace hierpar::detail
