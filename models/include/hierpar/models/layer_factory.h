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

// hierpar::nn::ConvTranspose2d in the hierpar set only where hierpar's kernels beat cuDNN: a generator's projection
// layer (kernel 4, stride 1, padding 0) and its small-C_out output layer (C_out <= 4, kernel 4, stride 2,
// padding 1); torch::nn::ConvTranspose2d otherwise, and in the stock set.
Layer make_conv_transpose2d(LayerSet layers, const torch::nn::ConvTranspose2dOptions& options);
// hierpar::nn::Conv2d in the hierpar set only where hierpar's kernels beat cuDNN: C_in <= 4, kernel 4, stride 2,
// padding 1 (a discriminator's first layer), and a window covering the whole input (stride 1, no padding: a
// discriminator's last layer; other input sizes take cuDNN per call); torch::nn::Conv2d otherwise, and in the
// stock set. With
// leaky_relu_slope the layer's forward includes leaky_relu (fused into hierpar's kernels, functional in stock's).
Layer make_conv2d(LayerSet layers, const torch::nn::Conv2dOptions& options,
                  std::optional<double> leaky_relu_slope = std::nullopt);
// BatchNorm2d followed by `activation` (negative_slope for leaky_relu).
Layer make_batch_norm_act2d(LayerSet layers, int64_t num_features, nn::Activation activation,
                            double negative_slope);
Layer make_max_pool2d(LayerSet layers, const torch::nn::MaxPool2dOptions& options);

}  // namespace hierpar::models
