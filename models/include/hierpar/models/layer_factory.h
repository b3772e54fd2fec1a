// The layers a model is built from, chosen by LayerSet. A model registers `module` under a name of its
// choosing and calls `forward`; stock and hierpar layers have the same parameter and buffer names, and an
// activation is either fused (hierpar::nn::BatchNormAct2d) or applied functionally (stock), so a model
// built from either set has the same state-dict keys.
#pragma once

#include "hierpar/layer_set.h"
#include "hierpar/nn/batch_norm.h"

#include <torch/nn/module.h>
#include <torch/nn/options/conv.h>
#include <torch/nn/options/pooling.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace hierpar::models {

struct Layer {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
};

// hierpar::nn::ConvTranspose2d in the hierpar set (zero padding), torch::nn::ConvTranspose2d in the stock set. The
// hierpar layer runs each call on hierpar's kernels or cuDNN's, as hierpar/routing.h's measured table says.
Layer make_conv_transpose2d(LayerSet layers, const torch::nn::ConvTranspose2dOptions& options);
// hierpar::nn::Conv2d in the hierpar set (routed per call likewise), torch::nn::Conv2d in the stock set. With
// leaky_relu_slope the layer's forward includes leaky_relu (fused into hierpar's kernels where they run the call,
// functional otherwise).
Layer make_conv2d(LayerSet layers, const torch::nn::Conv2dOptions& options,
                  std::optional<double> leaky_relu_slope = std::nullopt);
// BatchNorm2d followed by `activation` (negative_slope for leaky_relu).
Layer make_batch_norm_act2d(LayerSet layers, int64_t num_features, nn::Activation activation,
                            double negative_slope);
// Max pooling; with relu_first the layer pools relu(x): fused into hierpar's kernel (MaxPool2d::forward_relu),
// functional before the pool in the stock set.
Layer make_max_pool2d(LayerSet layers, const torch::nn::MaxPool2dOptions& options, bool relu_first = false);

}  // namespace hierpar::models
