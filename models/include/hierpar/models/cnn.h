// The seed CNN (003): a 28x28 one-channel image -> Conv 1->10 (3x3, no padding: 26x26), ReLU
// -> MaxPool 2 (13x13) -> Linear 1690->100, ReLU -> Linear 100->10 (class logits).
// Built from stock or hierpar layers (LayerSet; hierpar::nn::MaxPool2d, which applies the ReLU before it in the same
// kernel); same state-dict keys either way.
#pragma once

#include "hierpar/layer_set.h"
#include "hierpar/models/layer_factory.h"

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace hierpar::models {

class SeedCNNImpl : public torch::nn::Cloneable<SeedCNNImpl> {
 public:
  explicit SeedCNNImpl(LayerSet layers = LayerSet::stock);
  void reset() override;
  // images [N, 1, 28, 28] -> logits [N, 10].
  torch::Tensor forward(const torch::Tensor& images);
  // images [N, 1, 28, 28] -> the 100 ReLU features the logits are computed from.
  torch::Tensor features(const torch::Tensor& images);

  LayerSet layers;
  torch::nn::Conv2d conv{nullptr};
  Layer pool;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(SeedCNN);

}  // namespace hierpar::models
