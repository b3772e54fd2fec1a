#include "hierpar/models/layer_factory.h"

#include "hierpar/nn/conv2d.h"
#include "hierpar/nn/conv_transpose.h"
#include "hierpar/nn/max_pool.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/conv2d.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/pooling.h>

namespace hierpar::models {
namespace {

template <typename Holder>
Layer wrap(Holder holder) {
  return {holder.ptr(), [holder](const torch::Tensor& x) mutable { return holder->forward(x); }};
}

bool is(const torch::ExpandingArray<2>& a, int64_t v) { return (*a)[0] == v && (*a)[1] == v; }

// A convolution's output through the layer's LeakyReLU, when it has one.
torch::Tensor then_leaky(const torch::Tensor& y, std::optional<double> slope) {
  return slope ? torch::leaky_relu(y, *slope) : y;
}

// hierpar::nn::Conv2d's forward with the layer's LeakyReLU fused into it, when it has one.
torch::Tensor fused_forward(nn::Conv2d& conv, const torch::Tensor& x, std::optional<double> slope) {
  return slope ? conv->forward_with_leaky_relu(x, *slope) : conv->forward(x);
}

}  // namespace

Layer make_conv_transpose2d(LayerSet layers, const torch::nn::ConvTranspose2dOptions& options) {
  // hierpar's kernels win on a generator's projection layer (kernel 4, stride 1, padding 0 from the noise) and on
  // its small-C_out output layer (kernel 4, stride 2, padding 1, C_out <= 4): at batch 1024 bf16 on an H200,
  // forward + backward 4.1x and 5.0x faster than cuDNN. The middle k4s2p1 layers stay torch::nn::ConvTranspose2d, as
  // the wide convolutions of make_conv2d do: hierpar's kernels run them at 1.01-1.12x of cuDNN alone, and the step
  // with them on hierpar moved within its run-to-run spread for bf16 inputs (batch 64 0.807 -> 0.789 ms, batch 1024
  // 3.262 -> 3.248 ms) and lost for TF32 (batch 1024 6.34 -> 6.97 ms): no routing is worth its branch
  // (docs/conv_transpose.md, "In the DCGAN").
  const bool plain = is(options.dilation(), 1) && options.groups() == 1 && is(options.output_padding(), 0) &&
                     std::holds_alternative<torch::enumtype::kZeros>(options.padding_mode());
  const bool projection = is(options.kernel_size(), 4) && is(options.stride(), 1) && is(options.padding(), 0);
  const bool small_cout_k4s2p1 =
      options.out_channels() <= 4 && is(options.kernel_size(), 4) && is(options.stride(), 2) && is(options.padding(), 1);
  if (layers == LayerSet::hierpar && plain && (projection || small_cout_k4s2p1))
    return wrap(nn::ConvTranspose2d(options));
  return wrap(torch::nn::ConvTranspose2d(options));
}

Layer make_conv2d(LayerSet layers, const torch::nn::Conv2dOptions& options, std::optional<double> leaky_relu_slope) {
  // The small-C_in k4s2p1 convolution is the dual of the small-C_out transposed convolution, whose kernels
  // (ops/cuda/conv_transpose_small_cout.cu) replace cuDNN's legacy NHWC engine and its C=3 padding kernels there.
  // Wider convolutions stay on cuDNN: hierpar's kernels run them at 1.01-1.16x of cuDNN alone, the margin at which
  // the generator's middle layers did not change the step (docs/conv2d.md).
  const auto* padding = std::get_if<torch::ExpandingArray<2>>(&options.padding());
  const bool small_cin_k4s2p1 = options.in_channels() <= 4 && is(options.kernel_size(), 4) &&
                                is(options.stride(), 2) && padding != nullptr && is(*padding, 1) &&
                                is(options.dilation(), 1) && options.groups() == 1 &&
                                std::holds_alternative<torch::enumtype::kZeros>(options.padding_mode());
  if (layers == LayerSet::hierpar && small_cin_k4s2p1) {
    nn::Conv2d conv(options);
    const bool tf32_tiles = options.out_channels() % 16 == 0;
    return {conv.ptr(), [conv, leaky_relu_slope, tf32_tiles](const torch::Tensor& x) mutable {
              // float32 on the GPU takes hierpar's kernels where all three passes run as TF32 on the tensor cores:
              // TF32 allowed for convolutions (as cuDNN would use it), a channels_last input, C_out % 16 == 0. There
              // the layer's forward + backward at batch 64 takes 33.2 us against cuDNN's 97.8 (CUDA graphs, H200,
              // docs/conv2d.md). Otherwise it stays on cuDNN: hierpar's true-fp32 kernels run on the CUDA cores, and
              // in the TF32 step at batch 1024 they measured slower than cuDNN's. bf16/fp16, autocast included, take
              // hierpar's tensor-core kernels.
              const bool fp32_on_gpu = x.is_cuda() && x.scalar_type() == at::kFloat &&
                                       !at::autocast::is_autocast_enabled(at::kCUDA);
              const bool tf32_kernels = tf32_tiles && at::globalContext().allowTF32CuDNN(at::Float32Op::CONV) &&
                                        x.is_contiguous(at::MemoryFormat::ChannelsLast);
              if (fp32_on_gpu && !tf32_kernels) {
                return then_leaky(at::conv2d(x, conv->weight, conv->bias, /*stride=*/{2, 2}, /*padding=*/{1, 1}),
                                  leaky_relu_slope);
              }
              return fused_forward(conv, x, leaky_relu_slope);
            }};
  }
  // A convolution with stride 1 and no padding whose window covers its whole input (a 1x1 output: a discriminator's
  // last layer) is a matrix product, which hierpar::conv2d runs as cuBLAS GEMMs where cuDNN takes legacy kernels and
  // layout conversions: forward + backward 12.3 vs 53.7 us at batch 64 TF32 channels_last, 17.4 vs 90.5 us at batch
  // 1024 bf16, in CUDA graphs on an H200 (bench/results/h200-conv2d.json). The input's size is known per call:
  // any other size takes cuDNN, through the same parameters.
  const bool unpadded = padding == nullptr ? std::holds_alternative<torch::enumtype::kValid>(options.padding())
                                           : is(*padding, 0);
  const bool full_window_candidate = is(options.stride(), 1) && unpadded && is(options.dilation(), 1) &&
                                     options.groups() == 1 &&
                                     std::holds_alternative<torch::enumtype::kZeros>(options.padding_mode());
  if (layers == LayerSet::hierpar && full_window_candidate) {
    nn::Conv2d conv(options);
    const auto kernel = *options.kernel_size();
    return {conv.ptr(), [conv, kernel, leaky_relu_slope](const torch::Tensor& x) mutable {
              const bool full_window = x.dim() >= 3 && x.size(-2) == kernel[0] && x.size(-1) == kernel[1];
              if (full_window) return fused_forward(conv, x, leaky_relu_slope);
              return then_leaky(at::conv2d(x, conv->weight, conv->bias), leaky_relu_slope);
            }};
  }
  torch::nn::Conv2d conv(options);
  return {conv.ptr(), [conv, leaky_relu_slope](const torch::Tensor& x) mutable {
            return then_leaky(conv->forward(x), leaky_relu_slope);
          }};
}

Layer make_batch_norm_act2d(LayerSet layers, int64_t num_features, nn::Activation activation,
                            double negative_slope) {
  if (layers == LayerSet::hierpar) return wrap(nn::BatchNormAct2d(num_features, activation, negative_slope));
  torch::nn::BatchNorm2d norm(num_features);
  return {norm.ptr(), [norm, activation, negative_slope](const torch::Tensor& x) mutable {
            torch::Tensor y;
            if (nn::BatchNormSync* sync = nn::batch_norm_sync(); sync != nullptr && norm->is_training()) {
              // Synchronized statistics: torch::nn::BatchNorm2d's bookkeeping, then the replicas' statistics.
              const auto& o = norm->options;
              double momentum = o.momentum().value_or(0.0);
              if (o.track_running_stats()) {
                norm->num_batches_tracked.add_(1);
                if (!o.momentum().has_value()) momentum = 1.0 / norm->num_batches_tracked.item<double>();
              }
              y = sync->forward(x, norm->weight, norm->bias, norm->running_mean, norm->running_var, momentum, o.eps());
            } else {
              y = norm->forward(x);
            }
            switch (activation) {
              case nn::Activation::identity: return y;
              case nn::Activation::relu: return torch::relu_(y);
              case nn::Activation::leaky_relu: return torch::leaky_relu_(y, negative_slope);
            }
            TORCH_CHECK(false, "batch_norm_act2d: unknown activation");
          }};
}

Layer make_max_pool2d(LayerSet layers, const torch::nn::MaxPool2dOptions& options) {
  if (layers == LayerSet::hierpar) return wrap(nn::MaxPool2d(options));
  return wrap(torch::nn::MaxPool2d(options));
}

}  // namespace hierpar::models
