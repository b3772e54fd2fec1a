#include "hierpar/models/cnn.h"

namespace hierpar::models {

SeedCNNImpl::SeedCNNImpl(LayerSet layers_) : layers(layers_) { reset(); }

void SeedCNNImpl::reset() {
  conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 10, 3)));
  pool = make_max_pool2d(layers, torch::nn::MaxPool2dOptions(2), /*relu_first=*/true);
  register_module("pool", pool.module);
  fc1 = register_module("fc1", torch::nn::Linear(10 * 13 * 13, 100));
  fc2 = register_module("fc2", torch::nn::Linear(100, 10));
}

torch::Tensor SeedCNNImpl::features(const torch::Tensor& images) {
  TORCH_CHECK(images.dim() == 4 && images.size(1) == 1 && images.size(2) == 28 && images.size(3) == 28,
              "SeedCNN: expected images of shape [N, 1, 28, 28], got ", images.sizes());
  auto x = pool.forward(conv->forward(images));  // the pool applies the conv's ReLU (fused in hierpar's)
  return torch::relu(fc1->forward(x.flatten(1)));
}

torch::Tensor SeedCNNImpl::forward(const torch::Tensor& images) { return fc2->forward(features(images)); }

}  // namespace hierpar::models
