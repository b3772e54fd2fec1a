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
#include <string>

namespace hierpar::models {

struct Layer {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
};

Layer make_conv_transpose2d(LayerSet layers, const torch::nn::ConvTranspose2dOptions& options);
// BatchNorm2d followed by `activation` (negative_slope for leaky_relu).
Layer make_batch_norm_act2d(LayerSet layers, int64_t num_features, nn::Activation activation,
                            double negative_slope);
Layer make_max_pool2d(LayerSet layers, const torch::nn::MaxPool2dOptions& options);

}  // namespace hierpar::models
