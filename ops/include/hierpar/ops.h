// hierpar's operators, callable from C++. Each forwards to the dispatcher op of the same name
// (torch.ops.hierpar.<name> in Python), so autograd, CPU/CUDA/Meta kernels and TorchScript all apply.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

namespace hierpar::ops {

// Max pooling with at::max_pool2d's semantics. Returns (output, indices): indices hold, per output
// element, the row-major offset of the chosen element inside its window, as uint8 (kernels up to 16x16).
// relu: pools relu(input) in the same pass (max commutes with ReLU), what at::max_pool2d(at::relu(input)) gives,
// values and gradients; a window whose maximum is <= 0 outputs 0 with index 255, no element (kernels up to 255
// elements).
std::tuple<at::Tensor, at::Tensor> max_pool2d(const at::Tensor& input, at::IntArrayRef kernel_size,
                                              at::IntArrayRef stride = {}, at::IntArrayRef padding = {0, 0},
                                              at::IntArrayRef dilation = {1, 1}, bool ceil_mode = false,
                                              bool relu = false);

// Gather backward of max_pool2d: every input element sums the gradients of the windows that chose it.
at::Tensor max_pool2d_backward(const at::Tensor& grad_output, const at::Tensor& indices,
                               at::IntArrayRef input_size, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                               at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode);

// BatchNorm2d fused with an activation: "identity", "relu" or "leaky_relu" (negative slope `slope`).
// Training mode normalises with the batch statistics and updates running_mean/running_var in place
// (when given) with `momentum`, and adds 1 to num_batches_tracked (when given: an int64 scalar on the input's
// device) in the same kernel; eval mode uses the running statistics.
// Returns (output, save_mean, save_invstd); the statistics used, in fp32, for the backward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_act(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps, c10::string_view activation = "identity", double slope = 0.01,
    const std::optional<at::Tensor>& num_batches_tracked = std::nullopt);

// While one is alive on this thread, batch_norm_act's autograd keeps the layer's input with identity and leaky_relu
// too (relu always keeps it), so that its backward can be differentiated again (create_graph: an R1 or WGAN-GP
// penalty through a discriminator with BatchNorm). Costs one activation per layer run inside the scope.
class DoubleBackwardScope {
 public:
  DoubleBackwardScope();
  ~DoubleBackwardScope();
  DoubleBackwardScope(const DoubleBackwardScope&) = delete;
  DoubleBackwardScope& operator=(const DoubleBackwardScope&) = delete;
  static bool active();
};

// Backward of batch_norm_act from its saved output (the pre-activation is recovered by inverting the
// activation); `input` is needed only for "relu", which loses the negative half. Returns
// (grad_input, grad_weight, grad_bias), each computed only where output_mask says so.
std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_act_backward(
    const at::Tensor& grad_output, const at::Tensor& output, const std::optional<at::Tensor>& input,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, double eps, c10::string_view activation, double slope,
    std::array<bool, 3> output_mask);

// Transposed convolution with at::conv_transpose2d's semantics and weight layout [C_in, C_out/groups, kH, kW].
at::Tensor conv_transpose2d(const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias = std::nullopt, at::IntArrayRef stride = {1, 1},
                            at::IntArrayRef padding = {0, 0}, at::IntArrayRef output_padding = {0, 0},
                            int64_t groups = 1, at::IntArrayRef dilation = {1, 1});

// Returns (grad_input, grad_weight, grad_bias), each computed only where output_mask says so.
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_transpose2d_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef output_padding, int64_t groups, at::IntArrayRef dilation,
    std::array<bool, 3> output_mask);

// Convolution with at::conv2d's semantics, weight layout [C_out, C_in/groups, kH, kW] and output memory format
// (channels_last when the input or the weight is). Computed as the dual transposed convolution on
// conv_transpose2d's kernels (no cuDNN). With leaky_relu_slope (>= 0) it returns
// leaky_relu(conv2d(...), leaky_relu_slope), applied as the kernels store where they can (C_in <= 4, kernel 4,
// stride 2, padding 1, no bias on CUDA), and differentiates through it.
at::Tensor conv2d(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias = std::nullopt,
                  at::IntArrayRef stride = {1, 1}, at::IntArrayRef padding = {0, 0}, at::IntArrayRef dilation = {1, 1},
                  int64_t groups = 1, std::optional<double> leaky_relu_slope = std::nullopt);

// Returns (grad_input, grad_weight, grad_bias), each computed only where output_mask says so; grad_input has the
// input's memory format, grad_weight the weight's. grad_output is the convolution's (before any activation).
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                               const at::Tensor& weight, at::IntArrayRef stride,
                                                               at::IntArrayRef padding, at::IntArrayRef dilation,
                                                               int64_t groups, std::array<bool, 3> output_mask);

// Adam's update (torch::optim::Adam's: L2 weight decay added to the gradient, optional AMSGrad) of every
// params[i] from grads[i], in place with its moments exp_avgs[i], exp_avg_sqs[i] (and max_exp_avg_sqs[i] when
// amsgrad; else that list is empty). steps[i] is a one-element float32 tensor holding the step number this
// update is (the caller increments it first, as for ATen's fused Adam). One device and dtype per call; on CUDA
// one launch for up to 60 tensors, at memory speed (see ops/cuda/fused_adam_kernel.cu).
void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr, double beta1, double beta2,
                 double weight_decay, double eps, bool amsgrad);
// The same with the learning rate read from a device tensor (overload "tensor_lr", like ATen's fused Adam): a
// one-element tensor on the params' device, float32 (float64 for float64 params). A CUDA graph captured with it
// reads the value at replay, so a learning-rate schedule needs no re-capture.
void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList max_exp_avg_sqs, at::TensorList steps, const at::Tensor& lr, double beta1,
                 double beta2, double weight_decay, double eps, bool amsgrad);

// The CUDA architectures this build of the operators holds code for, as TORCH_CUDA_ARCH_LIST spelled them when it
// was built, space-separated (e.g. "7.5 8.0 8.6 9.0 10.0 12.0+PTX"); empty for a build without CUDA kernels.
std::string cuda_arch_list();

// The code CUDA device `device` runs hierpar's kernels from: "sm_90" (machine code built for it), or
// "compute_80 (PTX compiled by the driver for sm_90)". Throws one line naming the GPU's compute capability and
// cuda_arch_list() when the build holds no code that GPU can run.
std::string cuda_code_arch(int64_t device);

}  // namespace hierpar::ops
