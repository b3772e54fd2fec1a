// The adversarial losses AdversarialTrainer takes (AdversarialOptions::loss): a function of D's logits and of which
// term of the objective they are for.
#pragma once

#include <torch/types.h>

#include <functional>
#include <string>

namespace hierpar::strategy {

// The three terms of the adversarial objective: D's loss on real images, D's loss on fakes, and G's loss (on D's
// logits of the fakes).
enum class LossTerm { real, fake, generator };
using AdversarialLoss = std::function<torch::Tensor(const torch::Tensor& logits, LossTerm term)>;
// Binary cross-entropy with logits, mean over the batch (DCGAN's loss with the sigmoid folded in): the values and
// gradients of torch::binary_cross_entropy_with_logits against a target of all ones (real, generator) or all zeros
// (fake).
torch::Tensor bce_with_logits_loss(const torch::Tensor& logits, LossTerm term);
// The hinge loss (SAGAN, BigGAN): real mean(relu(1 - l)), fake mean(relu(1 + l)), generator -mean(l).
torch::Tensor hinge_loss(const torch::Tensor& logits, LossTerm term);
// The Wasserstein critic's loss (WGAN; with a gradient penalty, WGAN-GP): real -mean(l), fake mean(l), generator
// -mean(l).
torch::Tensor wasserstein_loss(const torch::Tensor& logits, LossTerm term);
// "bce", "hinge" or "wasserstein"; throws c10::Error naming `flag` and the accepted names otherwise.
AdversarialLoss loss_by_name(const std::string& name, const std::string& flag = "loss");

}  // namespace hierpar::strategy
