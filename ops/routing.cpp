// The layers' routing table (hierpar/routing.h): measured, not guessed; docs/architectures.md has the figures.
#include "hierpar/routing.h"

#include "hierpar/switches.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>
#ifdef HIERPAR_WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

namespace hierpar::ops {
namespace {

bool k4s2p1(const ConvCall& c) {
  return c.kernel_h == 4 && c.kernel_w == 4 && c.stride_h == 2 && c.stride_w == 2 && c.padding_h == 1 &&
         c.padding_w == 1;
}

bool plain(const ConvCall& c) { return c.dilation_h == 1 && c.dilation_w == 1 && c.groups == 1; }

// The call's spatial values: [x, y] from an argument of 1 or 2 values (at::conv2d's broadcasting).
int64_t at_or_first(at::IntArrayRef values, size_t i, int64_t otherwise) {
  if (values.empty()) return otherwise;
  return values.size() > i ? values[i] : values[0];
}

// A size or stride as a plain value. Under torch.compile with dynamic shapes it is symbolic: reading it
// specialises the compiled graph on it, as the ops' Meta kernels do (docs/python.md).
int64_t concrete(const c10::SymInt& value) { return value.guard_int(__FILE__, __LINE__); }

bool channels_last_4d(const at::Tensor& input) {
  if (input.dim() != 4) return false;
  if (!input.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return input.is_contiguous(at::MemoryFormat::ChannelsLast);
  }
  int64_t sizes[4], strides[4];
  for (int64_t d = 0; d < 4; ++d) {
    sizes[d] = concrete(input.sym_size(d));
    strides[d] = concrete(input.sym_stride(d));
  }
  // Dense NHWC, with dimensions of size 1 free to have any stride (as is_contiguous(ChannelsLast) judges them).
  int64_t expected = 1;
  for (int64_t d : {1, 3, 2, 0}) {
    if (sizes[d] != 1 && strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

ConvCall call_of(const at::Tensor& input, int64_t in_channels, int64_t out_channels, const at::Tensor& weight,
                 at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  ConvCall c;
  c.cuda = input.is_cuda();
  c.dtype = input.scalar_type();
  c.autocast = at::autocast::is_autocast_enabled(at::kCUDA);
  c.channels_last = channels_last_4d(input);
  c.tf32 = at::globalContext().allowTF32CuDNN(at::Float32Op::CONV);
  c.batch = input.dim() == 4 ? concrete(input.sym_size(0)) : 1;
  c.in_channels = in_channels;
  c.out_channels = out_channels;
  c.groups = groups;
  c.input_h = concrete(input.sym_size(-2));
  c.input_w = concrete(input.sym_size(-1));
  c.kernel_h = concrete(weight.sym_size(2));
  c.kernel_w = concrete(weight.sym_size(3));
  c.stride_h = at_or_first(stride, 0, 1);
  c.stride_w = at_or_first(stride, 1, 1);
  c.padding_h = at_or_first(padding, 0, 0);
  c.padding_w = at_or_first(padding, 1, 0);
  c.dilation_h = at_or_first(dilation, 0, 1);
  c.dilation_w = at_or_first(dilation, 1, 1);
  return c;
}

}  // namespace

bool hierpar_wins_conv_transpose2d(const ConvCall& c) {
  if (!c.cuda) return true;
  if (!plain(c) || c.output_padding_h != 0 || c.output_padding_w != 0) return false;
  // Forward + backward at batch 1024 bf16 on an H200: 4.1x (projection) and 5.0x (output layer) cuDNN's speed. The
  // middle k4s2p1 layers run at 1.01-1.12x of cuDNN alone, lost in the TF32 step at batch 1024 (6.34 -> 6.97 ms)
  // and in eager calls on an H100 (bench/results/h100-overhead.json): cuDNN's.
  const bool projection = c.kernel_h == 4 && c.kernel_w == 4 && c.stride_h == 1 && c.stride_w == 1 &&
                          c.padding_h == 0 && c.padding_w == 0;
  if (projection) return true;
  if (c.out_channels > 4 || !k4s2p1(c)) return false;
  // The output layer in float32 outside autocast: hierpar's where its tensor-core TF32 passes run (channels_last,
  // C_in % 16 == 0): forward + backward 163 vs cuDNN's 274 us at batch 64 on an H100. In NCHW its CUDA-core kernels
  // lose per call at batch 64 (314 vs 215 us, bench/results/h100-overhead.json) and take more host time; in the TF32
  // NCHW step on an H200 (bench/results/h200-dcgan_step-output-layer-routing.json, two rounds) cuDNN's is faster at
  // batch 64 (graphs 1.328 vs 1.365 ms) and hierpar's from 256 in a graph (3.112 vs 3.083 ms) but not eagerly (5.64
  // vs 6.25 ms), where it waits for batch 1024 (cuDNN's call alone is faster there, the step equal: training_step.md).
  const bool fp32 = c.dtype == at::kFloat && !c.autocast;
  const int64_t nchw_tf32_from = c.captured ? 256 : 1024;
  return !fp32 || (c.tf32 && ((c.channels_last && c.in_channels % 16 == 0) || c.batch >= nchw_tf32_from));
}

bool hierpar_wins_conv2d(const ConvCall& c) {
  if (!c.cuda) return true;
  if (!plain(c)) return false;
  if (c.in_channels <= 4 && k4s2p1(c)) {
    // The dual of the small-C_out transposed convolution. float32 outside autocast takes hierpar's kernels only
    // where all three passes run as TF32 on tensor cores (33.2 us forward + backward at batch 64 against cuDNN's
    // 97.8, CUDA graphs, H200, docs/conv2d.md); its true-fp32 CUDA-core kernels lose to cuDNN.
    const bool fp32 = c.dtype == at::kFloat && !c.autocast;
    return !fp32 || (c.tf32 && c.channels_last && c.out_channels % 16 == 0);
  }
  // A window over the whole input is a matrix product: cuBLAS GEMMs where cuDNN takes legacy kernels and layout
  // conversions (12.3 vs 53.7 us at batch 64 TF32 channels_last, bench/results/h200-conv2d.json).
  return c.stride_h == 1 && c.stride_w == 1 && c.padding_h == 0 && c.padding_w == 0 && c.input_h == c.kernel_h &&
         c.input_w == c.kernel_w;
}

bool conv_transpose2d_on_hierpar(const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
                                 at::IntArrayRef padding, at::IntArrayRef output_padding, int64_t groups,
                                 at::IntArrayRef dilation) {
  if (!input.is_cuda() || !switch_on(Switch::layer_routing)) return true;
  if (input.dim() < 3 || weight.dim() != 4) return true;  // the op's checks name what is wrong
  ConvCall c = call_of(input, concrete(weight.sym_size(0)), concrete(weight.sym_size(1)) * groups, weight, stride,
                       padding, dilation, groups);
  c.output_padding_h = at_or_first(output_padding, 0, 0);
  c.output_padding_w = at_or_first(output_padding, 1, 0);
#ifdef HIERPAR_WITH_CUDA
  // Only conv_transpose2d's table reads it: conv2d's calls do not pay the query.
  c.captured = c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#endif
  return hierpar_wins_conv_transpose2d(c);
}

bool conv2d_on_hierpar(const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  if (!input.is_cuda() || !switch_on(Switch::layer_routing)) return true;
  if (input.dim() < 3 || weight.dim() != 4) return true;
  return hierpar_wins_conv2d(
      call_of(input, concrete(weight.sym_size(1)) * groups, concrete(weight.sym_size(0)), weight, stride, padding,
              dilation, groups));
}

}  // namespace hierpar::ops

// The table as operators, for layers written in Python (hierpar.nn) and TorchScript: one answer, the C++ layers'.
TORCH_LIBRARY_FRAGMENT(hierpar, m) {
  m.def("conv_transpose2d_on_hierpar(Tensor input, Tensor weight, int[2] stride, int[2] padding, "
        "int[2] output_padding, int groups, int[2] dilation) -> bool",
        &hierpar::ops::conv_transpose2d_on_hierpar);
  m.def("conv2d_on_hierpar(Tensor input, Tensor weight, int[2] stride, int[2] padding, int[2] dilation, "
        "int groups) -> bool",
        &hierpar::ops::conv2d_on_hierpar);
}
