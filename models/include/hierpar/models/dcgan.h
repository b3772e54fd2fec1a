// The seed paper's DCGAN (Figure 2), built from stock torch::nn or hierpar layers (LayerSet): the two are
// the same network with the same state-dict keys, so weights, checkpoints and optimiser states interchange.
//
// Image size 64, the seed's configuration:
//   Generator      z[N,100] -> ConvT 100->256 (1->4, stride 1, pad 0), BN, ReLU
//                           -> ConvT 256->128 (->8), BN, ReLU -> ConvT 128->64 (->16), BN, ReLU
//                           -> ConvT 64->32 (->32), BN, ReLU -> ConvT 32->C (->64), Tanh
//   Discriminator  x[N,C,64,64] -> Conv C->32 (->32), LeakyReLU(0.2) -> Conv 32->64 (->16), BN, LeakyReLU
//                           -> Conv 64->128 (->8), BN, LeakyReLU -> Conv 128->256 (->4), BN, LeakyReLU
//                           -> Conv 256->1 (4->1, stride 1, pad 0): a logit per image (the sigmoid lives in
//                              binary_cross_entropy_with_logits)
// Every convolution has kernel 4 and no bias; stride 2 and padding 1 unless stated.
// Image size 32 drops the widest layer pair and 128 adds one: the layer next to the image keeps 32 channels
// (times `width`) and each step away from the image doubles them (32: 128-64-32, 128: 512-256-128-64-32).
#pragma once

#include "hierpar/layer_set.h"
#include "hierpar/models/layer_factory.h"

#include "hierpar/nn/recompute.h"

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <vector>

namespace hierpar::models {

struct DCGANOptions {
  int64_t nz = 100;          // noise dimension
  int64_t image_size = 64;   // 32, 64 or 128
  int64_t channels = 3;      // image channels: 1 or 3
  double width = 1.0;        // channel multiplier: the layer next to the image has round(32 * width)
  LayerSet layers = LayerSet::stock;
  // Activation memory (hierpar/nn/recompute.h, seed 001). recompute: every convolution with what follows it up to the
  // next convolution (BatchNorm + activation, G's tanh, D's first LeakyReLU) keeps only its input for the backward
  // and runs again there: less memory, one more forward, same numbers. offload: as recompute, and the inputs the
  // network produced itself wait for the backward in pinned host memory (eager steps only: not captured), as far
  // as memory requires: from a measured step on, blocks keep their activations (no recomputation, no copy) while
  // the step's peak stays under `offload_budget` of the GPU's memory (hierpar::nn::begin_offload_step, which
  // AdversarialTrainer drives); 0 offloads every block (least memory). On the CPU every block offloads.
  nn::ActivationMemory memory = nn::ActivationMemory::none;
  double offload_budget = 0.9;
  // With recompute or offload: each recomputed block's backward runs in this many slices of the batch
  // (hierpar::nn::recompute_sliced), so the block's inner activations exist for one slice at a time, BatchNorm's
  // statistics still those of the whole batch; costs one more forward of each convolution. 1: whole batch.
  int64_t memory_slices = 1;

  // Throws c10::Error naming the option and the accepted values.
  void validate() const;
  // Channels of the generator's hidden layers from the 4x4 one to the one next to the image; the
  // discriminator uses them in reverse.
  std::vector<int64_t> hidden_channels() const;
  // "nz=100 image_size=64 channels=3 width=1": the options that decide the parameter shapes (not the
  // layer set, which leaves them unchanged).
  std::string shape_key() const;
};

// DCGAN initialisation: convolution weights N(0, 0.02), BatchNorm weights N(1, 0.02) and biases 0.
// Applied to every submodule registered as "conv*", "deconv*" or "bn*"; the constructors call it.
void dcgan_init(torch::nn::Module& model);

class GeneratorImpl : public torch::nn::Cloneable<GeneratorImpl> {
 public:
  explicit GeneratorImpl(DCGANOptions options);
  void reset() override;
  // z: [N, nz] or [N, nz, 1, 1] -> images [N, channels, image_size, image_size] in [-1, 1].
  torch::Tensor forward(const torch::Tensor& z);

  DCGANOptions options;

 private:
  std::vector<Layer> deconvs_;  // registered as deconv1..deconvL
  std::vector<Layer> norms_;    // bn1..bn(L-1), each with its ReLU
  std::shared_ptr<nn::OffloadChain> offload_;  // the blocks offloaded by this instance (memory == offload)
};
TORCH_MODULE(Generator);

class DiscriminatorImpl : public torch::nn::Cloneable<DiscriminatorImpl> {
 public:
  explicit DiscriminatorImpl(DCGANOptions options);
  void reset() override;
  // images [N, channels, image_size, image_size] -> logits [N].
  torch::Tensor forward(const torch::Tensor& images);

  DCGANOptions options;

 private:
  std::vector<Layer> convs_;  // conv1 (with its LeakyReLU(0.2)) .. convL, from make_conv2d
  std::vector<Layer> norms_;  // bn2..bn(L-1), each with its LeakyReLU(0.2)
  std::shared_ptr<nn::OffloadChain> offload_;  // the blocks offloaded by this instance (memory == offload)
};
TORCH_MODULE(Discriminator);

}  // namespace hierpar::models
