#include "hierpar/models/layer_factory.h"

#include "hierpar/nn/conv2d.h"
#include "hierpar/nn/conv_transpose.h"
#include "hierpar/nn/max_pool.h"

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

}  // namespace

Layer make_conv_transpose2d(LayerSet layers, const torch::nn::ConvTranspose2dOptions& options) {
  // hierpar's layer runs each call on hierpar's kernels or cuDNN's, whichever measured faster (hierpar/routing.h);
  // it supports zero padding only, as the DCGAN uses.
  if (layers == LayerSet::hierpar && std::holds_alternative<torch::enumtype::kZeros>(options.padding_mode()))
    return wrap(nn::ConvTranspose2d(options));
  return wrap(torch::nn::ConvTranspose2d(options));
}

Layer make_conv2d(LayerSet layers, const torch::nn::Conv2dOptions& options, std::optional<double> leaky_relu_slope) {
  // hierpar's layer routes each call (hierpar/routing.h) and applies the LeakyReLU as its kernels store where they
  // run the call.
  if (layers == LayerSet::hierpar) {
    nn::Conv2d conv(options);
    return {conv.ptr(), [conv, leaky_relu_slope](const torch::Tensor& x) mutable {
              return leaky_relu_slope ? conv->forward_with_leaky_relu(x, *leaky_relu_slope) : conv->forward(x);
            }};
  }
  torch::nn::Conv2d conv(options);
  return {conv.ptr(), [conv, leaky_relu_slope](const torch::Tensor& x) mutable {
            return leaky_relu_slope ? torch::leaky_relu(conv->forward(x), *leaky_relu_slope) : conv->forward(x);
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

Layer make_max_pool2d(LayerSet layers, const torch::nn::MaxPool2dOptions& options, bool relu_first) {
  if (!relu_first) {
    if (layers == LayerSet::hierpar) return wrap(nn::MaxPool2d(options));
    return wrap(torch::nn::MaxPool2d(options));
  }
  if (layers == LayerSet::hierpar) {
    nn::MaxPool2d pool(options);
    return {pool.ptr(), [pool](const torch::Tensor& x) mutable { return pool->forward_relu(x); }};
  }
  torch::nn::MaxPool2d pool(options);
  return {pool.ptr(), [pool](const torch::Tensor& x) mutable { return pool->forward(torch::relu(x)); }};
}

}  // namespace hierpar::models
